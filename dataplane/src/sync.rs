//! Locks whose holder panicked.
//!
//! Every `std::sync` lock in starckpt guards state that stays consistent however a critical
//! section ends (each is a few assignments or one map operation, never a multi-step update
//! another thread could see half done), so a lock poisoned by a panicking holder is used as it
//! is: one panic must not turn every later request into another. This is the one place that
//! decision is written down; `starckpt-rdma` and `starckpt-proto`'s credential cache, below this
//! crate, repeat it for their own locks.

use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// [`Mutex::lock`], poisoned or not (module docs).
pub trait LockExt<T: ?Sized> {
    fn lock_unpoisoned(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> LockExt<T> for Mutex<T> {
    fn lock_unpoisoned(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// [`RwLock::read`] and [`RwLock::write`], poisoned or not (module docs).
pub trait RwLockExt<T: ?Sized> {
    fn read_unpoisoned(&self) -> RwLockReadGuard<'_, T>;
    fn write_unpoisoned(&self) -> RwLockWriteGuard<'_, T>;
}

impl<T: ?Sized> RwLockExt<T> for RwLock<T> {
    fn read_unpoisoned(&self) -> RwLockReadGuard<'_, T> {
        self.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write_unpoisoned(&self) -> RwLockWriteGuard<'_, T> {
        self.write().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_used_as_it_is() {
        let lock = std::sync::Arc::new(Mutex::new(1));
        let held = std::sync::Arc::clone(&lock);
        let _ = std::thread::spawn(move || {
            let mut value = held.lock().unwrap();
            *value = 2;
            panic!("a holder panics");
        })
        .join();
        assert!(lock.is_poisoned());
        assert_eq!(*lock.lock_unpoisoned(), 2);
        let rw = RwLock::new(3);
        *rw.write_unpoisoned() += 1;
        assert_eq!(*rw.read_unpoisoned(), 4);
    }
}
