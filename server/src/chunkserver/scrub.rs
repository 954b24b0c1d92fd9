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

use super::store::{ChunkStore, ChunkStoreError, Copy};

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

/// Counters since the target started (reported by OP_STAT): complete passes, chunks verified,
/// corrupt copies removed.
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
        match pass(&store, &config).await {
            Ok(0) => {
                store.scrub_stats().passes.fetch_add(1, Ordering::Relaxed);
            }
            Ok(skipped) => tracing::warn!(skipped, "scrub pass finished past parts of the store it could not read"),
            Err(error) => tracing::warn!(%error, "scrub pass stopped early"),
        }
        // At least a second between passes, so an empty store is not listed in a loop.
        tokio::time::sleep(config.pause.max(Duration::from_secs(1))).await;
    }
}

/// One pass over every stored chunk. A fan-out directory or chunk file that cannot be listed is
/// reported and passed (a pass that stopped there would never check the chunks after it); Ok
/// says how many were, 0 for a complete pass. Err if it could not go on at all; the counters say
/// what it got through.
async fn pass(store: &ChunkStore, config: &ScrubConfig) -> Result<usize, ChunkStoreError> {
    let started = Instant::now();
    let mut read_bytes = 0u64;
    let mut after = None;
    let mut skipped = 0;
    loop {
        let (page, complete, unreadable) = store.list_past_unreadable(after, 256).await?;
        for error in unreadable {
            tracing::error!(%error, "scrub could not list part of the store; its chunks go unchecked this pass");
            skipped += 1;
        }
        for listed in page {
            after = Some(listed.hash);
            match store.check_copy(listed.hash).await {
                Ok(Copy::Good { length }) => {
                    read_bytes += length;
                    store.scrub_stats().verified_chunks.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Copy::Bad { inode, reason }) => {
                    read_bytes += store.file_len(&listed.hash).await.unwrap_or(0);
                    tracing::error!(chunk = %listed.hash, %reason, "scrub found a corrupt copy; removing it");
                    // Only that file: a good copy a repair swapped in meanwhile stays. One that
                    // cannot be removed (an I/O error, an immutable file) is reported and the
                    // pass goes on: stopping there would leave every chunk after it unchecked,
                    // pass after pass.
                    match store.remove_copy_if(listed.hash, inode).await {
                        Ok(true) => {
                            store.scrub_stats().corrupt_removed.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(false) => {}
                        Err(error) => {
                            tracing::error!(chunk = %listed.hash, %error, "could not remove a corrupt copy; it is kept")
                        }
                    }
                }
                // Deleted (GC) since it was listed.
                Err(ChunkStoreError::NotFound { .. }) => {}
                // An I/O error or an unknown format: reported, never deleted on.
                Err(error) => tracing::warn!(chunk = %listed.hash, %error, "scrub could not verify a chunk"),
            }
            let due = Duration::from_secs_f64(read_bytes as f64 / config.bytes_per_second as f64);
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                tokio::time::sleep(wait).await;
            }
        }
        if complete {
            return Ok(skipped);
        }
    }
}
