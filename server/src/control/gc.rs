//! Garbage collection: frees the chunks no retained or in-flight checkpoint needs.
//!
//! A pass marks, then sweeps:
//!
//! 1. **Mark.** Forget drafts not recorded again for the draft TTL (their mount is gone), note
//!    the time `M`, then read every chunk hash named by a part of a PENDING or COMMITTED
//!    checkpoint or by a draft's record ([`MetaStore::live_chunks`], one snapshot).
//! 2. **Sweep**, target by target (live ones; a dead target's garbage waits for a later pass):
//!    page through its chunks (data-plane LIST), and delete, in throttled batches, those that are
//!    not marked and were last used (written, re-put, or reported present by HAS) before
//!    `M − grace`. The target checks that condition and unlinks under the chunk's use lock, so
//!    the check cannot race a HAS or PUT of the same chunk (`chunkserver/store.rs`).
//!
//! ## Why a chunk a checkpoint needs is never deleted
//!
//! - Checkpoints that were PENDING or COMMITTED with parts at the snapshot are marked.
//! - A part committed after the snapshot belongs to a checkpoint begun at `t0`. Its writer began
//!   the checkpoint before touching any chunk, and every chunk it names was written, re-put, or
//!   reported present by HAS after `t0`, so its last use is after `t0`. The control plane refuses
//!   a commit more than the pending timeout after begin (`MetaStore::commit_part`), and this
//!   commit came after `M`, so `t0 > M − pending_timeout > M − grace`: the chunk is too recent
//!   to be swept. This is the "save that deduplicates against a chunk while GC runs" and the
//!   "commit that lands during a sweep" of the retention tests.
//! - A draft (a checkpoint a mount writes in place, `fuse/src/fs/journal.rs`) commits chunks
//!   uploaded when its files were written, maybe long before it began. Those in its record at
//!   the snapshot are marked. One recorded after the snapshot was uploaded (or reported present)
//!   when its file was written, which is recent unless the file stayed open for longer than
//!   `grace`; such a chunk may be swept, and the mount's commit, which asks the targets for every
//!   chunk after it begins (a HAS, counted as a use), then fails (`EIO`) instead of committing a
//!   hole.
//! - A checkpoint imported from the object-store tier (`tier.rs` `import`) commits chunks nobody
//!   may have used for a long time, so the argument above does not hold for it. Instead an import
//!   takes GC's turn ([`Role::Gc`](super::store::Role), as a pass does): no pass marks before
//!   an import commits and sweeps after it. (A pass before the import may have deleted the
//!   targets' copies: the tier keeps every chunk the import needs, its sweep fence, and
//!   re-replication and readers' recoveries copy them back from there.)
//! - Hence `grace` must exceed the pending timeout, with room for the delay between this process
//!   computing the cutoff and a target applying it, and for the rest of the commit's transaction
//!   after its check (the check itself is made with the writer lock held, so time spent waiting
//!   for the lock counts against the timeout); [`GcConfig::validate`] demands a minute.
//! - Clocks: only durations cross machines (the guard is "unused for", measured by the target on
//!   its own clock), so offsets between machines do not matter. A target never counts a chunk as
//!   older than its own uptime, nor than the time since its wall clock last jumped (`UseClock` in
//!   `chunkserver/store.rs`), so a lost mtime after a power loss or a clock stepped forward cannot make
//!   a fresh chunk collectable. A control-plane clock stepped back by more than the pending timeout
//!   could admit a late commit; run it with a slewing clock (chrony/ntpd), as any database.
//!
//! The mark set is global (a hash named anywhere is kept on every target), which can keep a stray
//! copy a fallback placement left behind, but never deletes a needed one. Memory: ~100 bytes per
//! distinct live chunk, ~25 MB per TB of distinct live data at 4 MiB chunks.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use starckpt_dataplane::transport::{ChunkTransport, Credentials, TcpConfig, TcpTransport, TransportError};
use starckpt_proto::ChunkHash;
use starckpt_proto::frame::MAX_LIST_ENTRIES;

use super::store::{MetaResult, MetaStore, TargetRecord, fault};

#[derive(Clone, Debug)]
pub struct GcConfig {
    /// Unmarked chunks used within this long are kept. Must exceed the pending timeout by at
    /// least a minute.
    pub grace: Duration,
    /// Chunk deletions per second, over all targets: GC must not starve saves and restores of
    /// disk operations.
    pub deletes_per_second: u32,
    /// A draft's record not put again for this long is forgotten, and its chunks with it: the
    /// mount that held it is gone. At least `grace`.
    pub draft_ttl: Duration,
}

impl Default for GcConfig {
    fn default() -> Self {
        GcConfig {
            grace: Duration::from_secs(60 * 60),
            deletes_per_second: 2000,
            draft_ttl: Duration::from_secs(7 * 24 * 60 * 60),
        }
    }
}

impl GcConfig {
    pub fn validate(&self, pending_timeout: Duration) -> Result<(), String> {
        if self.grace < pending_timeout + Duration::from_secs(60) {
            return Err(format!(
                "GC grace period {:?} must exceed the pending timeout {pending_timeout:?} by at least 60 s \
                 (a save may commit until its pending timeout, naming chunks it relied on)",
                self.grace
            ));
        }
        if self.draft_ttl < self.grace {
            return Err(format!(
                "draft TTL {:?} must be at least the GC grace period {:?}",
                self.draft_ttl, self.grace
            ));
        }
        if self.deletes_per_second == 0 {
            return Err("GC deletion rate must be at least 1 per second".into());
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    pub live_chunks: u64,
    pub targets_swept: u32,
    /// Targets skipped or failed, with why.
    pub target_errors: Vec<String>,
    /// Of `target_errors`, targets skipped because they are not alive.
    pub targets_skipped: u32,
    pub chunks_listed: u64,
    pub chunks_deleted: u64,
    pub chunks_in_grace: u64,
    pub duration: Duration,
}

/// Spaces deletions out to at most `per_second`.
struct Throttle {
    per_second: u32,
    started: Instant,
    granted: u64,
}

impl Throttle {
    fn batch(&self) -> usize {
        (self.per_second as usize / 10).clamp(1, 1024)
    }

    async fn admit(&mut self, count: usize) {
        self.granted += count as u64;
        let due = Duration::from_secs_f64(self.granted as f64 / f64::from(self.per_second));
        if let Some(wait) = due.checked_sub(self.started.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
}

/// Runs one pass over `targets` (those the caller considers alive), with the data-plane address
/// of each; its requests carry `credentials`.
pub async fn collect(
    store: &dyn MetaStore,
    targets: Vec<(TargetRecord, Option<SocketAddr>)>,
    credentials: &Credentials,
    config: &GcConfig,
) -> MetaResult<GcReport> {
    let started = Instant::now();
    let now = super::store::now_ms();
    for draft in store.expire_drafts(now.saturating_sub(config.draft_ttl.as_millis() as u64)).await? {
        tracing::warn!(
            job = %draft.key.job,
            draft = draft.key.name,
            writer = draft.key.writer,
            files = draft.file_count,
            bytes = draft.total_bytes,
            "a draft nobody recorded for the draft TTL is forgotten, and its chunks may be collected"
        );
    }
    let marked_at = Instant::now();
    let live = store.live_chunks().await?;
    tracing::info!(live_chunks = live.len(), "garbage collection pass marked the live chunks");
    fault("control.gc.mark")?;
    let mut report = GcReport { live_chunks: live.len() as u64, ..GcReport::default() };
    let mut throttle = Throttle { per_second: config.deletes_per_second, started: Instant::now(), granted: 0 };
    for (target, address) in targets {
        let Some(address) = address else {
            report.target_errors.push(format!("{}: not alive, skipped", target.target_id));
            report.targets_skipped += 1;
            continue;
        };
        let tcp = TcpConfig { connections_per_target: 1, credentials: credentials.clone(), ..TcpConfig::default() };
        let transport = TcpTransport::for_target(address, &target.target_id, tcp);
        match sweep(&transport, &live, marked_at, config, &mut throttle, &mut report).await {
            Ok(()) => report.targets_swept += 1,
            Err(error) => {
                tracing::warn!(target = %target.target_id, %error, "GC sweep of a target failed");
                report.target_errors.push(format!("{}: {error}", target.target_id));
            }
        }
    }
    report.duration = started.elapsed();
    tracing::info!(?report, "garbage collection pass done");
    Ok(report)
}

async fn sweep(
    transport: &dyn ChunkTransport,
    live: &HashSet<ChunkHash>,
    marked_at: Instant,
    config: &GcConfig,
    throttle: &mut Throttle,
    report: &mut GcReport,
) -> Result<(), TransportError> {
    let mut after = None;
    let mut doomed = Vec::new();
    loop {
        let page = transport.list(after, MAX_LIST_ENTRIES).await?;
        after = page.chunks.last().map(|(hash, _)| *hash);
        for (hash, unused_for) in page.chunks {
            report.chunks_listed += 1;
            if live.contains(&hash) {
                continue;
            }
            // Last used before M − grace, as of now: unused for longer than grace + (now − M).
            if unused_for < config.grace + marked_at.elapsed() {
                report.chunks_in_grace += 1;
                continue;
            }
            doomed.push(hash);
            if doomed.len() >= throttle.batch() {
                delete(transport, &mut doomed, marked_at, config, throttle, report).await?;
            }
        }
        if page.complete || after.is_none() {
            break;
        }
    }
    delete(transport, &mut doomed, marked_at, config, throttle, report).await
}

async fn delete(
    transport: &dyn ChunkTransport,
    doomed: &mut Vec<ChunkHash>,
    marked_at: Instant,
    config: &GcConfig,
    throttle: &mut Throttle,
    report: &mut GcReport,
) -> Result<(), TransportError> {
    if doomed.is_empty() {
        return Ok(());
    }
    throttle.admit(doomed.len()).await;
    // The guard is computed after the throttle's wait, so it still means "before M − grace".
    let guard = config.grace + marked_at.elapsed();
    starckpt_dataplane::faults::point("control.gc.delete").map_err(|e| TransportError::Connection(e.to_string()))?;
    let deleted = transport.delete(doomed, Some(guard)).await?;
    // Chunks used since listing were kept by the target; count them with the recent ones.
    report.chunks_in_grace += doomed.len() as u64 - deleted.min(doomed.len() as u64);
    report.chunks_deleted += deleted;
    doomed.clear();
    Ok(())
}
