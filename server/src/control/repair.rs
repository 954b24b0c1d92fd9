//! Re-replication: restores the copies of committed chunks that a lost target took with it.
//!
//! A pass:
//!
//! 1. Lists every chunk of a committed checkpoint with the targets its manifests name and the
//!    copies it should have ([`MetaStore::committed_chunks`]).
//! 2. Counts a chunk's copies: those listed on targets that are not *lost* (a target is lost once
//!    it has been silent for `lost_after`, minutes by default, so a restarting target is not
//!    copied around) and, on live targets, still there (batched HAS: the scrubber removes corrupt
//!    copies), plus copies an earlier pass made on other live targets (found with HAS, in the
//!    chunk's rendezvous order, which is where passes put them). Its HAS asks only which are
//!    stored (`existence_only`, [`ChunkTransport::stored`]): a writer's HAS also fsyncs and
//!    refreshes every chunk it finds, which for a pass over every committed chunk each minute
//!    would be a metadata write and a directory fsync per chunk, for nothing (GC keeps every
//!    chunk a committed checkpoint names without it).
//! 3. For a chunk short of copies, reads one verified copy from a live target and puts it on the
//!    next live targets in rendezvous order that lack it, preferring failure domains without a
//!    copy, until it has enough (or no target is left), at most `copies_per_second`. It works on
//!    [`RepairConfig::chunks_at_once`] chunks at once: one chunk is a few round trips and a
//!    tier read (tens of ms from S3), so one at a time held a 1 TB recovery to hours.
//!
//! A chunk no live target can provide is read from the object-store tier, when the control plane
//! has one and the chunk is there (`tier.rs`), and its copies made from that.
//!
//! Manifests are not rewritten: a reader that finds none of the listed copies looks for the
//! chunk on the live targets in its rendezvous order (`read_chunk` in the SDK). A reader that
//! finds it nowhere asks for it (`RecoverChunks`, [`recover`]): the same steps for that chunk
//! alone, at once, every live target's copy checked with HAS rather than trusting the list. GC keeps every
//! copy of a hash that any retained checkpoint names, so the new copies live as long as the
//! chunk is needed.

use std::collections::{BTreeSet, HashSet};

use futures::StreamExt;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use starckpt_dataplane::placement::rank_targets;
use starckpt_dataplane::transport::{Credentials, Payload, TransportError};
use starckpt_proto::ChunkHash;
use starckpt_proto::frame::MAX_BATCH_HASHES;

use super::copying::{CopyError, Live, Pace, live_targets, read_verified};
use super::store::{CommittedChunk, MetaResult, MetaStore, TargetRecord};
use super::tier::Tier;
use starckpt_dataplane::sync::LockExt;

#[derive(Clone, Debug)]
pub struct RepairConfig {
    /// A target silent this long is lost: its copies are made again elsewhere. Default 5 min.
    pub lost_after: Duration,
    /// New copies per second, over all targets (they compete with saves for disks).
    pub copies_per_second: u32,
    /// Chunks a pass (or one reader's recovery) works on at once. Default 8: enough to keep
    /// `copies_per_second` busy through per-chunk round trips and tier reads, and at most 8
    /// chunks' bytes (as stored and decoded, ~64 MiB of 4 MiB chunks) held at once.
    pub chunks_at_once: usize,
}

impl Default for RepairConfig {
    fn default() -> Self {
        RepairConfig { lost_after: Duration::from_secs(300), copies_per_second: 200, chunks_at_once: 8 }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RepairReport {
    /// Distinct chunks of committed checkpoints.
    pub chunks: u64,
    /// Of those, chunks with fewer listed copies (on targets not lost, and there) than they should
    /// have: including chunks whose extra copies an earlier pass already made (manifests are not
    /// rewritten), so this does not fall to 0 after a repair; `still_under_replicated` does.
    pub under_replicated: u64,
    pub copies_made: u64,
    /// Chunks still short after the pass (no live source, or no target left to copy to).
    pub still_under_replicated: u64,
    /// Chunks no live target could provide a verified copy of (nor the tier).
    pub unreadable: u64,
    /// Chunks no live target had, read back from the object-store tier.
    pub from_tier: u64,
    pub errors: Vec<String>,
    pub duration: Duration,
}

/// Runs one pass. `targets` are every registered target with its data address when alive;
/// `silent_ms` says how long each has been silent.
pub async fn rereplicate(
    store: &dyn MetaStore,
    targets: Vec<(TargetRecord, Option<SocketAddr>)>,
    credentials: &Credentials,
    now_ms: u64,
    default_replicas: u32,
    config: &RepairConfig,
    tier: Option<&Tier>,
) -> MetaResult<RepairReport> {
    let started = Instant::now();
    let chunks = store.committed_chunks(default_replicas).await?;
    let lost: HashSet<String> = targets
        .iter()
        .filter(|(t, _)| now_ms.saturating_sub(t.last_heartbeat_ms) > config.lost_after.as_millis() as u64)
        .map(|(t, _)| t.target_id.clone())
        .collect();
    let known: HashSet<&str> = targets.iter().map(|(t, _)| t.target_id.as_str()).collect();
    let live = live_targets(&targets, credentials);
    let live_ids: Vec<&str> = live.iter().map(|l| l.id.as_str()).collect();
    let mut report = RepairReport { chunks: chunks.len() as u64, ..RepairReport::default() };
    // Which listed copies on live targets are really there (a scrub may have removed a corrupt
    // one): one batched HAS per live target. A target that cannot answer is given the benefit of
    // the doubt until the next pass.
    let mut missing: HashSet<(&str, ChunkHash)> = HashSet::new();
    for target in &live {
        let listed_here: Vec<ChunkHash> =
            chunks.iter().filter(|(_, c)| c.replicas.contains(&target.id)).map(|(h, _)| *h).collect();
        for batch in listed_here.chunks(MAX_BATCH_HASHES) {
            match target.transport.stored(batch).await {
                Ok(present) => missing
                    .extend(batch.iter().zip(present).filter(|(_, here)| !here).map(|(h, _)| (target.id.as_str(), *h))),
                Err(error) => {
                    report.errors.push(format!("{}: {error}", target.id));
                    break;
                }
            }
        }
    }
    // Chunks short of copies: listed on a target neither lost nor forgotten, and there.
    let short: Vec<(ChunkHash, &CommittedChunk, BTreeSet<&str>)> = chunks
        .iter()
        .filter_map(|(hash, chunk)| {
            let listed: BTreeSet<&str> = chunk
                .replicas
                .iter()
                .filter(|r| known.contains(r) && !lost.contains(*r) && !missing.contains(&(*r, *hash)))
                .collect();
            (listed.len() < chunk.wanted as usize).then_some((*hash, chunk, listed))
        })
        .collect();
    report.under_replicated = short.len() as u64;
    let pass = Pass::new(&live, &live_ids, config, tier);
    // By index: a closure taking a reference into `short` fails rustc's higher-ranked lifetime
    // check where the pass's future must be Send (the control plane spawns it).
    let outcomes: Vec<Outcome> = futures::stream::iter(0..short.len())
        .map(|index| {
            let (hash, chunk, listed) = &short[index];
            restore_copies(*hash, chunk, listed, &pass, false)
        })
        .buffer_unordered(config.chunks_at_once.max(1))
        .collect()
        .await;
    for outcome in outcomes {
        match outcome {
            Outcome::Complete => {}
            Outcome::Short { .. } => report.still_under_replicated += 1,
            Outcome::Unreadable => {
                report.unreadable += 1;
                report.still_under_replicated += 1;
            }
        }
    }
    report.copies_made = pass.copies_made.load(Ordering::Relaxed);
    report.from_tier = pass.from_tier.load(Ordering::Relaxed);
    for index in pass.unreachable() {
        report.errors.push(format!("{}: unreachable, skipped for the rest of the pass", live[index].id));
    }
    report.duration = started.elapsed();
    if report.under_replicated > 0 {
        tracing::info!(?report, "re-replication pass done");
    }
    Ok(report)
}

/// What [`recover`] did.
pub(crate) struct Recovered {
    /// Per chunk: a live target holds a copy verified now.
    pub chunks: Vec<bool>,
    /// Chunks read back from the tier.
    pub from_tier: u64,
    /// Live targets that did not answer (the caller skips them for a while).
    pub unreachable: Vec<String>,
}

/// Chunks of a committed checkpoint a reader could not get from any target it tried
/// (`RecoverChunks`): each found on live targets and verified there, or given its copies again
/// from a live one or the tier, as a pass would. Targets in `skip` (recently unreachable) are not
/// asked.
pub(crate) async fn recover(
    chunks: &[(ChunkHash, CommittedChunk)],
    live: &[Live],
    tier: Option<&Tier>,
    config: &RepairConfig,
    skip: &HashSet<String>,
) -> Recovered {
    let live_ids: Vec<&str> = live.iter().map(|l| l.id.as_str()).collect();
    let pass = Pass::new(live, &live_ids, config, tier);
    pass.unreachable.lock_unpoisoned().extend((0..live.len()).filter(|&i| skip.contains(&live[i].id)));
    // Not trusting the manifest's list: the reader found none of those copies. In the order
    // asked: the answer is per chunk.
    let empty = BTreeSet::new();
    let recovered: Vec<bool> = futures::stream::iter(0..chunks.len())
        .map(|index| restore_copies(chunks[index].0, &chunks[index].1, &empty, &pass, true))
        .buffered(config.chunks_at_once.max(1))
        .map(|outcome| matches!(outcome, Outcome::Complete | Outcome::Short { holders: 1.. }))
        .collect()
        .await;
    let unreachable =
        pass.unreachable().into_iter().map(|i| live[i].id.clone()).filter(|id| !skip.contains(id)).collect();
    Recovered { chunks: recovered, from_tier: pass.from_tier.load(Ordering::Relaxed), unreachable }
}

enum Outcome {
    Complete,
    /// Not enough live targets to hold the copies it should have; `holders` do.
    Short {
        holders: usize,
    },
    /// No live copy could be read and verified.
    Unreadable,
}

/// What a pass shares between the chunks it works on (several at once).
struct Pass<'a> {
    live: &'a [Live],
    live_ids: &'a [&'a str],
    /// Live targets that failed to answer: skipped for the rest of the pass. (Never held across
    /// an await.)
    unreachable: Mutex<HashSet<usize>>,
    /// Paces new copies over every chunk at once: a copy is counted when admitted.
    throttle: tokio::sync::Mutex<Pace>,
    tier: Option<&'a Tier>,
    /// New copies written (not counting targets that turned out to have one).
    copies_made: AtomicU64,
    /// Chunks read back from the tier.
    from_tier: AtomicU64,
}

impl<'a> Pass<'a> {
    fn new(live: &'a [Live], live_ids: &'a [&'a str], config: &RepairConfig, tier: Option<&'a Tier>) -> Pass<'a> {
        Pass {
            live,
            live_ids,
            unreachable: Mutex::new(HashSet::new()),
            throttle: tokio::sync::Mutex::new(Pace::new(u64::from(config.copies_per_second))),
            tier,
            copies_made: AtomicU64::new(0),
            from_tier: AtomicU64::new(0),
        }
    }

    fn unreachable(&self) -> HashSet<usize> {
        self.unreachable.lock_unpoisoned().clone()
    }

    fn is_unreachable(&self, index: usize) -> bool {
        self.unreachable.lock_unpoisoned().contains(&index)
    }

    fn mark_unreachable(&self, index: usize) {
        self.unreachable.lock_unpoisoned().insert(index);
    }

    /// Waits for the next copy's turn under `copies_per_second`, and counts it.
    async fn admit_copy(&self) {
        let mut throttle = self.throttle.lock().await;
        throttle.admit().await;
        throttle.spent += 1;
    }
}

/// Gives `hash` the copies it should have (module docs). With `verify`, the copies found are not
/// taken on trust (present is not readable: a reader failed on them): one is read and verified,
/// and copies that fail are repaired from a good one or the tier.
async fn restore_copies(
    hash: ChunkHash,
    chunk: &CommittedChunk,
    listed: &BTreeSet<&str>,
    pass: &Pass<'_>,
    verify: bool,
) -> Outcome {
    let (live, tier) = (pass.live, pass.tier);
    let wanted = chunk.wanted as usize;
    let addressing = chunk.addressing;
    let order: Vec<usize> =
        rank_targets(&hash, pass.live_ids).into_iter().filter(|&index| !pass.is_unreachable(index)).collect();
    // Live targets holding it: listed ones, then ones an earlier pass copied it to (in rendezvous
    // order, where passes put them), until there are enough.
    let mut holders: Vec<usize> = order.iter().copied().filter(|&i| listed.contains(live[i].id.as_str())).collect();
    for &index in &order {
        if holders.len() >= wanted {
            if verify {
                break;
            }
            return Outcome::Complete;
        }
        if holders.contains(&index) {
            continue;
        }
        match live[index].transport.stored(&[hash]).await {
            Ok(present) if present.first() == Some(&true) => holders.push(index),
            Ok(_) => {}
            Err(error) => {
                // Skipped for the rest of the pass rather than stalling every chunk on it.
                tracing::warn!(target = %live[index].id, %error, "target unreachable; skipped this pass");
                pass.mark_unreachable(index);
            }
        }
    }
    if holders.len() >= wanted && !verify {
        return Outcome::Complete;
    }
    let candidates = order.iter().filter(|&&i| !holders.contains(&i) && !pass.is_unreachable(i)).count();
    if candidates == 0 && !verify {
        return Outcome::Short { holders: holders.len() };
    }
    // One verified copy to spread; a holder whose copy fails verification is no holder.
    let mut data = None;
    let mut bad_holders = Vec::new();
    for &index in &holders {
        match read_verified(&live[index], &addressing, hash, chunk.length).await {
            Ok((payload, _, name)) => {
                data = Some((payload, name));
                break;
            }
            Err(CopyError::Corrupt(_)) => bad_holders.push(index),
            Err(CopyError::Unreadable(error) | CopyError::Unanswered(error)) => {
                tracing::warn!(chunk = %hash, target = %live[index].id, %error, "a copy could not be read")
            }
        }
    }
    // No target has one: the tier's copy, if there is one.
    if data.is_none()
        && let Some(tier) = tier
    {
        match tier.get_chunk(&addressing, hash, chunk.length).await {
            Ok(Some((bytes, name))) => {
                tracing::info!(chunk = %hash, "no target has a copy; restoring it from the object-store tier");
                data = Some((Payload::raw(bytes), name));
                pass.from_tier.fetch_add(1, Ordering::Relaxed);
            }
            Ok(None) => {}
            Err(error) => tracing::warn!(chunk = %hash, %error, "the object-store tier could not provide it"),
        }
    }
    let Some((data, name)) = data else { return Outcome::Unreadable };
    for &index in &bad_holders {
        tracing::warn!(chunk = %hash, target = %live[index].id, "a copy failed verification; repairing it");
        holders.retain(|&h| h != index);
        if live[index].transport.put_named(&name, data.clone(), true).await.is_ok() {
            holders.push(index);
        }
    }
    // New copies: the next targets in rendezvous order without one, new failure domains first.
    for prefer_new_domain in [true, false] {
        for &index in &order {
            if holders.len() >= wanted {
                return Outcome::Complete;
            }
            let target = &live[index];
            let new_domain = !holders.iter().any(|&h| live[h].domain == target.domain);
            if holders.contains(&index) || pass.is_unreachable(index) || (prefer_new_domain && !new_domain) {
                continue;
            }
            pass.admit_copy().await;
            let put = match starckpt_dataplane::faults::point("control.repair.copy") {
                Ok(()) => target.transport.put_named(&name, data.clone(), false).await,
                Err(injected) => Err(TransportError::Connection(injected.to_string())),
            };
            match put {
                Ok(already_present) => {
                    if !already_present {
                        pass.copies_made.fetch_add(1, Ordering::Relaxed);
                    }
                    holders.push(index);
                }
                Err(error) => tracing::warn!(chunk = %hash, target = %target.id, %error, "could not place a new copy"),
            }
        }
    }
    if holders.len() >= wanted { Outcome::Complete } else { Outcome::Short { holders: holders.len() } }
}
