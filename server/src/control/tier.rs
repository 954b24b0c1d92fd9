//! The object-store tier: committed checkpoints copied to an object store (S3 or any
//! S3-compatible server, or a directory) for durability beyond the NVMe targets.
//!
//! Layout under the tier's URL:
//!
//! ```text
//!   chunks/<64 hex digits>                               a chunk's bytes, decoded: the object's
//!                                                        BLAKE3 is its name
//!   checkpoints/<job>/<step, 20 digits>-<checkpoint id>/rank-<6 digits>.manifest
//!                                                        a rank's manifest (prost
//!                                                        starckpt.control.v1.Manifest), as committed
//! ```
//!
//! A pass (the RPC `Tier`, and every `--tier-interval-secs`):
//!
//! 1. **Upload.** Each committed checkpoint not yet tiered, oldest commit first: every chunk it
//!    names that the tier lacks (HEAD) is read from a live target holding a verified copy and PUT,
//!    a few at once, at most `--tier-mib-per-sec`; then its manifests; then it is marked tiered
//!    (`CheckpointRecord::tiered_at_ms`, `starckpt ls`). A checkpoint a chunk of which no target can
//!    provide stays untiered (the pass says so) and is retried by the next pass.
//! 2. **Sweep.** Objects no committed checkpoint needs are deleted: chunks none names, manifests of
//!    checkpoints no longer committed (retention, `starckpt rm`). A sweep lists the whole tier,
//!    so background passes sweep only after a tiered checkpoint was deleted
//!    ([`MetaStore::tiered_gone`]); `starckpt tier` always does.
//!
//! ## Why a tiered checkpoint never misses a chunk
//!
//! The sweep deletes only chunks named by no committed checkpoint when it reads the database;
//! every checkpoint tiered by then is committed (its chunks are kept) or no longer needs them. The
//! danger is an upload that finds a chunk present (HEAD) which a sweep then deletes: a checkpoint
//! that committed after the sweep read the database, deduplicating against that chunk. Two
//! guards:
//!
//! - A pass holds the cluster-wide `Tiering` role ([`MetaStore::try_lead`]: a PostgreSQL session
//!   lock where control planes share a database), and runs upload, then sweep: they do not
//!   overlap while the role holds.
//! - A fence in the database, for when it does not (a lock lost with its session while its holder
//!   runs on, a pass cut short with deletions in flight): a sweep records that it begins before it
//!   reads the database and that it finished after its last deletion ([`MetaStore::begin_tier_sweep`]),
//!   and an upload marks its checkpoint only if no sweep was running when it began nor began since
//!   ([`MetaStore::mark_tiered`]'s fence, checked in the marking transaction). A fenced-off
//!   checkpoint is marked by a later pass, whose HEADs see what the sweep deleted and upload it
//!   again. A sweep that died midway blocks marking until the next sweep finishes.
//!
//! Re-replication (`repair.rs`) reads a chunk no live target has from here, so a checkpoint
//! survives the loss of every copy on the NVMe targets once it is tiered.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::prefix::PrefixStore;
use object_store::{ObjectStore, PutPayload};
use prost::Message;
use starckpt_client::placement::rank_targets;
use starckpt_proto::control as pb;
use starckpt_proto::model::ChunkRef;
use starckpt_proto::{ChunkHash, JobName};

use super::repair::{CopyError, Live, Pace, live_targets, read_verified};
use super::store::{CheckpointRecord, MetaError, MetaResult, MetaStore, Role, TargetRecord, now_ms};

const CHUNKS: &str = "chunks";
const CHECKPOINTS: &str = "checkpoints";
/// Chunks a pass reads and uploads at once.
const UPLOADS: usize = 4;

/// An object store holding tiered checkpoints.
pub struct Tier {
    store: Arc<dyn ObjectStore>,
    /// As given, for messages.
    url: String,
}

impl std::fmt::Debug for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tier({})", self.url)
    }
}

#[derive(Clone, Debug)]
pub struct TierConfig {
    /// Upload pace: tiering competes with saves and restores for the targets' disks and NICs.
    pub bytes_per_second: u64,
}

impl Default for TierConfig {
    fn default() -> Self {
        TierConfig { bytes_per_second: 256 << 20 }
    }
}

/// When a pass sweeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sweep {
    Always,
    /// Only after a tiered checkpoint was deleted.
    IfDeleted,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierReport {
    /// False: another control plane held the role; this one ran no pass.
    pub ran: bool,
    pub swept: bool,
    pub checkpoints_tiered: u64,
    /// Committed checkpoints still not tiered after the pass.
    pub checkpoints_behind: u64,
    pub chunks_uploaded: u64,
    pub bytes_uploaded: u64,
    /// Chunks already in the tier.
    pub chunks_present: u64,
    pub chunks_deleted: u64,
    pub manifests_deleted: u64,
    pub errors: Vec<String>,
    pub duration: Duration,
}

type TierResult<T> = Result<T, object_store::Error>;

impl Tier {
    /// Opens the tier at `url` and checks it answers: `s3://BUCKET[/PREFIX]`, configured from the
    /// `AWS_*` environment as AWS's tools read it (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
    /// `AWS_REGION`; `AWS_ENDPOINT` and `AWS_ALLOW_HTTP=true` for an S3-compatible server), or
    /// `file:///DIR` (created if missing).
    pub async fn open(url: &str) -> anyhow::Result<Tier> {
        let parsed = url::Url::parse(url).map_err(|e| anyhow::anyhow!("object-store tier {url:?}: {e}"))?;
        let store: Arc<dyn ObjectStore> = match parsed.scheme() {
            "s3" => {
                let bucket = parsed
                    .host_str()
                    .filter(|b| !b.is_empty())
                    .ok_or_else(|| anyhow::anyhow!("object-store tier {url}: no bucket (s3://BUCKET/PREFIX)"))?;
                let s3 = AmazonS3Builder::from_env().with_bucket_name(bucket).build()?;
                let prefix = parsed.path().trim_matches('/');
                if prefix.is_empty() { Arc::new(s3) } else { Arc::new(PrefixStore::new(s3, prefix)) }
            }
            "file" => {
                let dir =
                    parsed.to_file_path().map_err(|()| anyhow::anyhow!("object-store tier {url}: not a local path"))?;
                std::fs::create_dir_all(&dir)
                    .map_err(|e| anyhow::anyhow!("object-store tier {}: {e}", dir.display()))?;
                Arc::new(LocalFileSystem::new_with_prefix(&dir)?)
            }
            other => anyhow::bail!(
                "object-store tier {url}: unsupported scheme {other:?} (s3://BUCKET/PREFIX or file:///DIR)"
            ),
        };
        let tier = Tier { store, url: url.to_owned() };
        // Wrong credentials, a missing bucket or an unreachable endpoint fail the start, not the
        // first pass minutes later.
        // One page of a listing, not the whole of it.
        if let Some(Err(error)) = tier.store.list(Some(&Path::from(CHUNKS))).next().await {
            anyhow::bail!("object-store tier {url}: {error}");
        }
        Ok(tier)
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    fn chunk_path(hash: ChunkHash) -> Path {
        Path::from_iter([CHUNKS, &hash.to_hex()])
    }

    fn manifest_path(checkpoint: &CheckpointRecord, rank: u32) -> Path {
        let dir = format!("{:020}-{}", checkpoint.step, checkpoint.id);
        Path::from_iter([CHECKPOINTS, checkpoint.job.as_str(), &dir, &format!("rank-{rank:06}.manifest")])
    }

    async fn has_chunk(&self, hash: ChunkHash) -> TierResult<bool> {
        match self.store.head(&Tier::chunk_path(hash)).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// The tier's copy of chunk `hash`, verified (BLAKE3 and length); None if the tier has none.
    /// A copy that fails verification is an error (and stays: the sweep is not the place to judge).
    pub async fn get_chunk(&self, hash: ChunkHash, length: u64) -> Result<Option<Bytes>, String> {
        let bytes = match self.store.get(&Tier::chunk_path(hash)).await {
            Ok(result) => result.bytes().await.map_err(|e| e.to_string())?,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(error) => return Err(error.to_string()),
        };
        let checked = bytes.clone();
        let actual = tokio::task::spawn_blocking(move || ChunkHash::of(&checked)).await.map_err(|e| e.to_string())?;
        if actual != hash || bytes.len() as u64 != length {
            return Err(format!("the tier's copy of {hash} is {} bytes hashing to {actual}", bytes.len()));
        }
        Ok(Some(bytes))
    }
}

/// Runs one pass (module docs). `targets`: every registered target with its data address when
/// alive.
pub async fn pass(
    store: &dyn MetaStore,
    tier: &Tier,
    targets: Vec<(TargetRecord, Option<SocketAddr>)>,
    config: &TierConfig,
    when: Sweep,
) -> MetaResult<TierReport> {
    let started = Instant::now();
    let Some(_leadership) = store.try_lead(Role::Tiering).await? else {
        return Ok(TierReport::default());
    };
    let mut report = TierReport { ran: true, ..TierReport::default() };
    // Read before any HEAD of this pass's uploads (module docs).
    let fence = store.tier_sweeps().await?.fence();
    let live = live_targets(&targets);
    let mut upload = Upload {
        tier,
        live: &live,
        pace: tokio::sync::Mutex::new(Pace::new(config.bytes_per_second)),
        present: HashSet::new(),
    };
    let untiered = store.untiered_checkpoints().await?;
    match fence {
        Some(fence) => {
            for checkpoint in untiered {
                let what = format!("{} step {}", checkpoint.job, checkpoint.step);
                match upload.checkpoint(store, &checkpoint, &mut report).await {
                    Ok(false) => {}
                    Ok(true) if store.mark_tiered(checkpoint.id, now_ms(), fence).await? => {
                        report.checkpoints_tiered += 1;
                        tracing::info!(checkpoint = %what, tier = %tier.url, "checkpoint tiered");
                    }
                    Ok(true) => {
                        report.checkpoints_behind += 1;
                        report.errors.push(format!("{what}: a sweep began meanwhile; the next pass marks it"));
                    }
                    Err(error) => {
                        report.checkpoints_behind += 1;
                        report.errors.push(format!("{what}: {error}"));
                    }
                }
            }
        }
        None => {
            report.checkpoints_behind = untiered.len() as u64;
            report.errors.push(
                "a sweep is unfinished (running elsewhere, or it died midway): nothing is marked \
                 tiered until one finishes"
                    .into(),
            );
        }
    }
    let gone = store.tiered_gone().await?;
    if when == Sweep::Always || !gone.is_empty() {
        match sweep(store, tier, &mut report).await {
            Ok(()) => {
                report.swept = true;
                store.forget_tiered(&gone).await?;
            }
            Err(error) => report.errors.push(format!("sweep: {error}")),
        }
    }
    report.duration = started.elapsed();
    if report.checkpoints_tiered + report.chunks_deleted + report.manifests_deleted > 0 || !report.errors.is_empty() {
        tracing::info!(?report, "tier pass done");
    }
    Ok(report)
}

/// The upload half of a pass.
struct Upload<'a> {
    tier: &'a Tier,
    live: &'a [Live],
    /// Bytes uploaded, paced.
    pace: tokio::sync::Mutex<Pace>,
    /// Chunks known to be in the tier, this pass.
    present: HashSet<ChunkHash>,
}

impl Upload<'_> {
    /// Puts every chunk and manifest of `checkpoint` in the tier; false if it is no longer
    /// committed (nothing to tier).
    async fn checkpoint(
        &mut self,
        store: &dyn MetaStore,
        checkpoint: &CheckpointRecord,
        report: &mut TierReport,
    ) -> Result<bool, String> {
        let job = JobName::try_from(checkpoint.job.as_str()).map_err(|e| e.to_string())?;
        let parts = match store.get_manifest(&job, Some(checkpoint.step)).await {
            Ok((current, parts)) if current.id == checkpoint.id => parts,
            Ok(_) | Err(MetaError::NotFound(_)) => return Ok(false),
            Err(error) => return Err(error.to_string()),
        };
        let mut seen = HashSet::new();
        let chunks: Vec<ChunkRef> = parts
            .iter()
            .flat_map(|(_, m)| m.files.iter())
            .flat_map(|f| f.chunks.iter())
            .filter(|c| !self.present.contains(&c.hash) && seen.insert(c.hash))
            .cloned()
            .collect();
        // A few chunks in flight: an object store's latency, not its bandwidth, bounds one PUT at
        // a time. Memory: at most UPLOADS chunks.
        let this = &*self;
        let mut outcomes = futures::stream::iter(chunks)
            .map(|chunk| async move { this.chunk(&chunk).await })
            .buffer_unordered(UPLOADS);
        while let Some(outcome) = outcomes.next().await {
            match outcome? {
                None => report.chunks_present += 1,
                Some(length) => {
                    report.chunks_uploaded += 1;
                    report.bytes_uploaded += length;
                }
            }
        }
        drop(outcomes);
        self.present.extend(seen);
        for (rank, manifest) in &parts {
            let bytes = pb::Manifest::from(manifest).encode_to_vec();
            self.tier
                .store
                .put(&Tier::manifest_path(checkpoint, *rank), PutPayload::from(bytes))
                .await
                .map_err(|e| format!("manifest of rank {rank}: {e}"))?;
        }
        Ok(true)
    }

    /// Puts `chunk` in the tier unless it is there: its length if it was uploaded.
    async fn chunk(&self, chunk: &ChunkRef) -> Result<Option<u64>, String> {
        if self.tier.has_chunk(chunk.hash).await.map_err(|e| format!("chunk {}: {e}", chunk.hash))? {
            return Ok(None);
        }
        let data = self.read(chunk.hash, chunk.length_bytes, &chunk.replicas).await?;
        let length = data.len() as u64;
        {
            let mut pace = self.pace.lock().await;
            pace.admit().await;
            pace.spent += length;
        }
        self.tier
            .store
            .put(&Tier::chunk_path(chunk.hash), PutPayload::from_bytes(data))
            .await
            .map_err(|e| format!("chunk {}: {e}", chunk.hash))?;
        Ok(Some(length))
    }

    /// A verified copy of the chunk, decoded: from the targets its manifest lists, then from the
    /// others in its rendezvous order (where re-replication puts copies).
    async fn read(&self, hash: ChunkHash, length: u64, listed: &[String]) -> Result<Bytes, String> {
        let ids: Vec<&str> = self.live.iter().map(|l| l.id.as_str()).collect();
        let mut order: Vec<usize> = (0..self.live.len()).filter(|&i| listed.contains(&self.live[i].id)).collect();
        order.extend(rank_targets(&hash, &ids).into_iter().filter(|i| !listed.contains(&self.live[*i].id)));
        let mut failures = Vec::new();
        for index in order {
            match read_verified(&self.live[index], hash, length).await {
                Ok((_, data)) => return Ok(data),
                Err(CopyError::Unreadable(e) | CopyError::Corrupt(e)) => {
                    failures.push(format!("{}: {e}", self.live[index].id))
                }
            }
        }
        Err(format!("chunk {hash}: no live target has a verified copy ({})", failures.join("; ")))
    }
}

/// The sweep half of a pass: deletes chunks no committed checkpoint names and manifests of
/// checkpoints no longer committed.
async fn sweep(store: &dyn MetaStore, tier: &Tier, report: &mut TierReport) -> Result<(), String> {
    // Recorded before the database is read; finished only after the last deletion (module docs).
    let sweep = store.begin_tier_sweep().await.map_err(|e| e.to_string())?;
    let needed: HashSet<ChunkHash> = store.committed_chunks(1).await.map_err(|e| e.to_string())?.into_keys().collect();
    let mut committed: HashSet<(String, String)> = HashSet::new();
    for job in store.list_jobs().await.map_err(|e| e.to_string())? {
        let name = JobName::try_from(job.job.as_str()).map_err(|e| e.to_string())?;
        for checkpoint in store.list_checkpoints(&name, false).await.map_err(|e| e.to_string())? {
            if checkpoint.state == super::store::CheckpointState::Committed {
                committed.insert((job.job.clone(), format!("{:020}-{}", checkpoint.step, checkpoint.id)));
            }
        }
    }
    // Objects whose names are not ours are left alone.
    let garbage_chunks = tier.store.list(Some(&Path::from(CHUNKS))).try_filter_map(|meta| {
        let unneeded = meta
            .location
            .filename()
            .and_then(|name| ChunkHash::from_hex(name).ok())
            .is_some_and(|h| !needed.contains(&h));
        futures::future::ready(Ok(unneeded.then_some(meta.location)))
    });
    report.chunks_deleted = delete_all(tier, garbage_chunks.boxed()).await?;
    let garbage_manifests = tier.store.list(Some(&Path::from(CHECKPOINTS))).try_filter_map(|meta| {
        let parts: Vec<String> = meta.location.parts().map(|p| p.as_ref().to_owned()).collect();
        let unneeded = match parts.as_slice() {
            [_, job, dir, file] if file.ends_with(".manifest") => !committed.contains(&(job.clone(), dir.clone())),
            _ => false,
        };
        futures::future::ready(Ok(unneeded.then_some(meta.location)))
    });
    report.manifests_deleted = delete_all(tier, garbage_manifests.boxed()).await?;
    store.finish_tier_sweep(sweep).await.map_err(|e| e.to_string())
}

/// Deletes every path `paths` yields (batched by the store); how many.
async fn delete_all(tier: &Tier, paths: futures::stream::BoxStream<'_, TierResult<Path>>) -> Result<u64, String> {
    let mut deleted = 0;
    let mut results = tier.store.delete_stream(paths);
    while let Some(result) = results.next().await {
        match result {
            Ok(_) => deleted += 1,
            Err(object_store::Error::NotFound { .. }) => {}
            Err(error) => return Err(error.to_string()),
        }
    }
    Ok(deleted)
}
