//! Exclusive ownership of a directory or database by one process, held with `flock`: the kernel
//! drops the lock when the process dies, so a crash never leaves it held.
use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::path::Path;

/// Opens `path` (created if missing) and takes an exclusive lock on it without waiting. The lock
/// lives as long as the returned file; `Ok(None)` when another process holds it.
pub fn try_hold(path: &Path) -> io::Result<Option<File>> {
    let file = OpenOptions::new().create(true).truncate(false).write(true).open(path)?;
    match file.try_lock() {
        Ok(()) => Ok(Some(file)),
        Err(TryLockError::WouldBlock) => Ok(None),
        Err(TryLockError::Error(error)) => Err(error),
    }
}
