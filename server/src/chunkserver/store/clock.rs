//! When chunks were last used: striped locks per chunk, and a clock that survives restarts.

use super::*;
use starckpt_dataplane::sync::LockExt;

/// Stripes of the per-chunk "last use" lock (see the module docs).
pub(crate) const USE_LOCK_STRIPES: usize = 64;

/// Serialises refreshing a chunk's last use (HAS, PUT) with GC's check-and-unlink of that chunk.
pub(crate) struct UseLocks(Vec<Mutex<()>>);

impl UseLocks {
    pub(crate) fn new() -> UseLocks {
        UseLocks((0..USE_LOCK_STRIPES).map(|_| Mutex::new(())).collect())
    }

    pub(crate) fn lock(&self, hash: &ChunkHash) -> MutexGuard<'_, ()> {
        // The guarded data is (); a poisoned stripe is still a valid lock.
        self.0[hash.0[1] as usize % USE_LOCK_STRIPES].lock_unpoisoned()
    }
}

/// Caps chunk ages by what this process has itself observed (module docs): the time since the
/// store opened or since the wall clock last jumped against the monotonic clock.
pub struct UseClock {
    /// (monotonic, wall) at the last baseline.
    pub(crate) baseline: Mutex<(std::time::Instant, SystemTime)>,
}

/// A wall clock that moved this far from the monotonic one has jumped.
pub(crate) const CLOCK_JUMP: Duration = Duration::from_secs(1);

impl UseClock {
    pub(crate) fn new() -> UseClock {
        UseClock { baseline: Mutex::new((std::time::Instant::now(), SystemTime::now())) }
    }

    /// Moves the baseline `by` into the past (`TargetConfig::assumed_uptime`).
    pub(crate) fn backdate(&self, by: Duration) {
        let mut baseline = self.baseline.lock_unpoisoned();
        if let (Some(monotonic), Some(wall)) = (baseline.0.checked_sub(by), baseline.1.checked_sub(by)) {
            *baseline = (monotonic, wall);
        }
    }

    /// The longest a chunk can have gone unused as far as this process can tell.
    pub fn age_cap(&self) -> Duration {
        let mut baseline = self.baseline.lock_unpoisoned();
        let monotonic = baseline.0.elapsed();
        let wall = SystemTime::now().duration_since(baseline.1).unwrap_or(Duration::ZERO);
        let drift = wall.abs_diff(monotonic);
        if drift > CLOCK_JUMP || SystemTime::now() < baseline.1 {
            tracing::warn!(?drift, "the wall clock jumped; chunk ages restart from now");
            *baseline = (std::time::Instant::now(), SystemTime::now());
            return Duration::ZERO;
        }
        monotonic
    }

    /// Time since `last_use`, capped.
    pub(crate) fn unused_for(&self, last_use: SystemTime) -> Duration {
        SystemTime::now().duration_since(last_use).unwrap_or_default().min(self.age_cap())
    }
}
