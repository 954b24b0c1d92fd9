//! The scrubber: re-verifies every stored chunk against its hash, pass after pass, at a throttled
//! rate, so that bit rot is found while other copies still exist rather than at restore time.
//!
//! A copy that fails verification is removed (under its use lock, like any delete). From then on
//! the target answers NOT_FOUND for it: a reader moves to the next replica and repairs this one
//! (read repair), a writer deduplicating against it uploads it again, and the control plane's
//! next re-replication pass, which checks listed copies with HAS, makes a new copy. Removing is
//! safe because a corrupt copy serves nothing: every reader verifies, so it was already useless.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::store::{ChunkStore, ChunkStoreError};

#[derive(Clone, Debug)]
pub struct ScrubConfig {
    /// Bytes verified per second (reads compete with saves and restores). 0 turns scrubbing off.
    /// Default 64 MiB/s: a 4 TB device is re-verified about weekly.
    pub bytes_per_second: u64,
    /// Pause between the end of a pass and the start of the next. Default 1 h.
    pub pause: Duration,
}

impl Default for ScrubConfig {
    fn default() -> Self {
        ScrubConfig { bytes_per_second: 64 << 20, pause: Duration::from_secs(3600) }
    }
}

/// Counters since the target started (reported by OP_STAT).
#[derive(Debug, Default)]
pub struct ScrubStats {
    pub passes: AtomicU64,
    pub verified_chunks: AtomicU64,
    pub corrupt_removed: AtomicU64,
}

/// Scrubs until dropped.
pub async fn run(store: Arc<ChunkStore>, config: ScrubConfig) {
    if config.bytes_per_second == 0 {
        return;
    }
    loop {
        if let Err(error) = pass(&store, &config).await {
            tracing::warn!(%error, "scrub pass stopped early");
        }
        store.scrub_stats().passes.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(config.pause).await;
    }
}

async fn pass(store: &ChunkStore, config: &ScrubConfig) -> Result<(), ChunkStoreError> {
    let started = Instant::now();
    let mut verified_bytes = 0u64;
    let mut after = None;
    loop {
        let (page, complete) = store.list(after, 256).await?;
        for listed in page {
            after = Some(listed.hash);
            match store.verify(listed.hash).await {
                Ok(length) => {
                    verified_bytes += length;
                    store.scrub_stats().verified_chunks.fetch_add(1, Ordering::Relaxed);
                }
                Err(ChunkStoreError::Corrupt { reason, .. }) => {
                    tracing::error!(chunk = %listed.hash, %reason, "scrub found a corrupt copy; removing it");
                    store.delete(vec![listed.hash], None).await?;
                    store.scrub_stats().corrupt_removed.fetch_add(1, Ordering::Relaxed);
                }
                // Deleted (GC, repair) since it was listed.
                Err(ChunkStoreError::NotFound { .. }) => {}
                Err(error) => tracing::warn!(chunk = %listed.hash, %error, "scrub could not verify a chunk"),
            }
            let due = Duration::from_secs_f64(verified_bytes as f64 / config.bytes_per_second as f64);
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                tokio::time::sleep(wait).await;
            }
        }
        if complete {
            return Ok(());
        }
    }
}
