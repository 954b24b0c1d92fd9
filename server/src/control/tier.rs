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
//!   checkpoints/<job>/<step, 20 digits>-<checkpoint id>/checkpoint.info
//!                                                        the checkpoint's record (prost
//!                                                        CheckpointInfo: world size, sizes, times),
//!                                                        written after every chunk and manifest
//! ```
//!
//! The tier is enough to restore from when the cluster is gone, metadata and targets
//! (`starckpt restore --from-tier`, [`Tier::manifest`]), and for a new cluster to adopt
//! (`starckpt tier --import`, [`import`]: its checkpoints added to the database under new ids,
//! recorded again under those by the next pass, whose sweep removes the old ids' objects): a checkpoint whose `checkpoint.info` is
//! there has every chunk and manifest there, and each chunk read back is verified. Until the next
//! sweep, the tier may still hold checkpoints the cluster has deleted since.
//!
//! A pass (the RPC `Tier`, and every `--tier-interval-secs`):
//!
//! 1. **Upload.** Each committed checkpoint not yet tiered, oldest commit first: every chunk it
//!    names that the tier lacks (HEAD; an object of the wrong size counts as missing) is read from
//!    a live target holding a verified copy and PUT,
//!    a few at once, at most `--tier-mib-per-sec`; then its manifests and record; then it is marked tiered
//!    (`CheckpointRecord::tiered_at_ms`, `starckpt ls`). A checkpoint a chunk of which no target can
//!    provide stays untiered (the pass says so) and is retried by the next pass.
//! 2. **Sweep.** Objects no committed checkpoint needs are deleted: chunks none names, manifests
//!    and records of checkpoints no longer committed (retention, `starckpt rm`). A sweep lists the whole tier,
//!    so background passes sweep only after a tiered checkpoint was deleted
//!    ([`MetaStore::tiered_gone`]), or when the last sweep did not finish; `starckpt tier` always does.
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
//!   again. An import (`starckpt tier --import`, [`import`]) commits checkpoints whose chunks
//!   are in the tier alone, so the same fence guards it: read before the tier is, checked in the
//!   importing transaction ([`MetaStore::import_checkpoint`]). A sweep that died midway blocks
//!   marking and importing until the next sweep finishes (the next pass runs one). A sweep that
//!   did not die but lost its lock (a paused VM, a partition from the database) while another
//!   began, finished and reopened the fence stops deleting: before each batch of deletions it
//!   checks it is still the latest sweep begun. What is left is one batch in flight across that
//!   check, since an object store takes no fencing token.
//!
//! Re-replication (`repair.rs`), and a reader's `RecoverChunks`, read a chunk no live target has
//! from here, so a checkpoint survives the loss of every copy on the NVMe targets once it is
//! tiered.

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
use starckpt_dataplane::placement::rank_targets;
use starckpt_dataplane::transport::Credentials;
use starckpt_proto::control as pb;
use starckpt_proto::model::{ChunkRef, Manifest};
use starckpt_proto::{Addressing, ChunkHash, ChunkName, JobName};

use super::copying::{CopyError, Live, Pace, live_targets, read_verified};
use super::store::{
    CheckpointRecord, ImportedCheckpoint, MetaError, MetaResult, MetaStore, Role, TargetRecord, now_ms,
};
use starckpt_dataplane::sync::LockExt;

const CHUNKS: &str = "chunks";
const CHECKPOINTS: &str = "checkpoints";
/// A tiered checkpoint's record, the last object of it written.
const INFO: &str = "checkpoint.info";
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
        Tier::open_with(url, true).await
    }

    /// [`Tier::open`] for reading what a tier holds: a `file://` directory must exist.
    pub async fn open_existing(url: &str) -> anyhow::Result<Tier> {
        Tier::open_with(url, false).await
    }

    async fn open_with(url: &str, create: bool) -> anyhow::Result<Tier> {
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
                if create {
                    std::fs::create_dir_all(&dir)
                        .map_err(|e| anyhow::anyhow!("object-store tier {}: {e}", dir.display()))?;
                } else if !dir.is_dir() {
                    anyhow::bail!("object-store tier {url}: {} is not a directory", dir.display());
                }
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

    /// Where a checkpoint's `file` lies. The job is one path part: a tenant's (`acme/llama`)
    /// with its `/` percent-encoded ([`job_of_part`] reads it back).
    fn checkpoint_path(job: &str, step: u64, id: u64, file: &str) -> Path {
        Path::from_iter([CHECKPOINTS, job, &format!("{step:020}-{id}"), file])
    }

    fn manifest_path(job: &str, step: u64, id: u64, rank: u32) -> Path {
        Tier::checkpoint_path(job, step, id, &format!("rank-{rank:06}.manifest"))
    }

    /// The manifest of `job`'s checkpoint at `step` (None: the highest step) read from the tier
    /// alone, as the control plane would answer it (with no targets: the chunks are read from
    /// the tier). Only checkpoints whose record is in the tier count (module docs).
    pub async fn manifest(&self, job: &JobName, step: Option<u64>) -> anyhow::Result<pb::GetManifestResponse> {
        // A step saved again after a delete the sweep has not caught up with yet: the later
        // attempt (higher id).
        let found =
            self.complete(job).await?.into_iter().filter(|(found, _)| step.is_none_or(|wanted| wanted == *found)).max();
        let Some((found_step, id)) = found else {
            let which = step.map_or(String::new(), |s| format!(" at step {s}"));
            anyhow::bail!("the object-store tier {} holds no complete checkpoint of {job}{which}", self.url);
        };
        let info = self.record(job, found_step, id).await?;
        if info.world_size == 0 || info.world_size > starckpt_proto::model::MAX_WORLD_SIZE {
            anyhow::bail!("object-store tier {}: {job} step {found_step} has world size {}", self.url, info.world_size);
        }
        let mut parts = Vec::with_capacity(info.world_size as usize);
        let mut budget = starckpt_proto::model::MAX_CHECKPOINT_MANIFEST_BYTES;
        for rank in 0..info.world_size {
            let path = Tier::manifest_path(job.as_str(), found_step, id, rank);
            let (manifest, size) = self.get_message_sized::<pb::Manifest>(&path, budget).await?;
            budget -= size;
            parts.push(pb::RankManifest { rank, manifest: Some(manifest) });
        }
        Ok(pb::GetManifestResponse { checkpoint: Some(info), parts, targets: vec![], next_rank: None })
    }

    /// The jobs with checkpoints in the tier (names that are not valid job names are skipped).
    pub async fn jobs(&self) -> anyhow::Result<Vec<JobName>> {
        let listed = self
            .store
            .list_with_delimiter(Some(&Path::from(CHECKPOINTS)))
            .await
            .map_err(|e| anyhow::anyhow!("object-store tier {}: listing jobs: {e}", self.url))?;
        Ok(listed
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename())
            .filter_map(|n| JobName::try_from(job_of_part(n).as_str()).ok())
            .collect())
    }

    /// The records of `job`'s complete checkpoints in the tier, by step (module docs), and why
    /// each record that could not be read was skipped.
    pub async fn checkpoints(&self, job: &JobName) -> anyhow::Result<(Vec<pb::CheckpointInfo>, Vec<String>)> {
        let (mut records, mut skipped) = (Vec::new(), Vec::new());
        for (step, id) in self.complete(job).await? {
            match self.record(job, step, id).await {
                Ok(record) => records.push(record),
                Err(error) => skipped.push(error.to_string()),
            }
        }
        records.sort_by_key(|r| (r.step, r.checkpoint_id));
        Ok((records, skipped))
    }

    /// (step, id) of each of `job`'s checkpoints whose record is in the tier.
    async fn complete(&self, job: &JobName) -> anyhow::Result<Vec<(u64, u64)>> {
        let listed: Vec<_> = self
            .store
            .list(Some(&Path::from_iter([CHECKPOINTS, job.as_str()])))
            .try_collect()
            .await
            .map_err(|e| anyhow::anyhow!("object-store tier {}: listing {job}: {e}", self.url))?;
        Ok(listed
            .iter()
            .filter_map(|meta| {
                let parts: Vec<String> = meta.location.parts().map(|p| p.as_ref().to_owned()).collect();
                let [_, _, dir, file] = parts.as_slice() else { return None };
                let (step, id) = dir.split_once('-')?;
                (file == INFO).then_some((step.parse::<u64>().ok()?, id.parse::<u64>().ok()?))
            })
            .collect())
    }

    /// The record of `job`'s checkpoint (step, id), checked to be that checkpoint's.
    async fn record(&self, job: &JobName, step: u64, id: u64) -> anyhow::Result<pb::CheckpointInfo> {
        let info: pb::CheckpointInfo =
            self.get_message(&Tier::checkpoint_path(job.as_str(), step, id, INFO), 1 << 20).await?;
        if info.job != job.as_str() || info.step != step || info.checkpoint_id != id {
            anyhow::bail!(
                "object-store tier {}: the record of {job} step {step} (id {id}) names {} step {} (id {})",
                self.url,
                info.job,
                info.step,
                info.checkpoint_id
            );
        }
        Ok(info)
    }

    /// Reads and decodes the prost message at `path`, of at most `limit` bytes.
    async fn get_message<M: Message + Default>(&self, path: &Path, limit: u64) -> anyhow::Result<M> {
        Ok(self.get_message_sized(path, limit).await?.0)
    }

    /// [`Tier::get_message`], and the object's size.
    async fn get_message_sized<M: Message + Default>(&self, path: &Path, limit: u64) -> anyhow::Result<(M, u64)> {
        let what = |e: &dyn std::fmt::Display| anyhow::anyhow!("object-store tier {}: {path}: {e}", self.url);
        let result = self.store.get(path).await.map_err(|e| what(&e))?;
        if result.meta.size > limit {
            return Err(what(&format!("{} bytes, over the {limit} byte limit", result.meta.size)));
        }
        let size = result.meta.size;
        let bytes = result.bytes().await.map_err(|e| what(&e))?;
        let message = M::decode(bytes).map_err(|e| what(&e))?;
        Ok((message, size))
    }

    /// Whether the tier holds chunk `hash` as `length` bytes. An object of another size (written
    /// by something else, or damaged) is not the chunk: it is reported and uploaded again.
    async fn has_chunk(&self, hash: ChunkHash, length: u64) -> TierResult<bool> {
        match self.store.head(&Tier::chunk_path(hash)).await {
            Ok(meta) if meta.size == length => Ok(true),
            Ok(meta) => {
                tracing::warn!(%hash, size = meta.size, length, "the tier's copy of a chunk has the wrong size; uploading it again");
                Ok(false)
            }
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(error) => Err(error),
        }
    }

    /// The tier's copy of chunk `hash`, verified (BLAKE3 and length); None if the tier has none.
    /// A copy that fails verification is an error (and stays: the sweep is not the place to judge).
    pub async fn get_chunk(
        &self,
        addressing: &Addressing,
        hash: ChunkHash,
        length: u64,
    ) -> Result<Option<(Bytes, ChunkName)>, String> {
        let bytes = match self.store.get(&Tier::chunk_path(hash)).await {
            // Not read into memory when its size already says it is not the chunk.
            Ok(result) if result.meta.size != length => {
                return Err(format!("the tier's copy of {hash} is {} bytes, not {length}", result.meta.size));
            }
            Ok(result) => result.bytes().await.map_err(|e| e.to_string())?,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(error) => return Err(error.to_string()),
        };
        let checked = bytes.clone();
        let content = tokio::task::spawn_blocking(move || ChunkHash::of(&checked)).await.map_err(|e| e.to_string())?;
        let name = addressing.name(content);
        if name.address != hash || bytes.len() as u64 != length {
            return Err(format!("the tier's copy of {hash} is {} bytes addressed {}", bytes.len(), name.address));
        }
        Ok(Some((bytes, name)))
    }
}

/// What [`import`] did.
#[derive(Debug, Default)]
pub struct ImportReport {
    pub imported: Vec<CheckpointRecord>,
    /// Checkpoints whose job already has one at that step.
    pub present: u64,
    pub errors: Vec<String>,
}

/// The job name a listed path part holds: object_store percent-encodes the `/` of a tenant's job
/// (`acme%2Fllama`), and a valid job name has no other character that needs encoding.
fn job_of_part(part: &str) -> String {
    part.replace("%2F", "/")
}

/// Adds to `store` the complete checkpoints in `tier` (of `job`, or of every job) that it lacks,
/// oldest step first ([`MetaStore::import_checkpoint`]).
pub async fn import(store: &dyn MetaStore, tier: &Tier, job: Option<JobName>) -> MetaResult<ImportReport> {
    let mut report = ImportReport::default();
    // Read before the tier is: a sweep that begins after this refuses the imports (its list of
    // what to keep would lack them), as it refuses an upload's mark (module docs).
    let Some(fence) = store.tier_sweeps().await?.fence() else {
        report.errors.push(
            "a sweep of the tier is unfinished (running, or it died midway: `starckpt tier` runs \
             one); import once one finishes"
                .into(),
        );
        return Ok(report);
    };
    let jobs = match job {
        Some(job) => vec![job],
        None => match tier.jobs().await {
            Ok(jobs) => jobs,
            Err(error) => {
                report.errors.push(error.to_string());
                return Ok(report);
            }
        },
    };
    for job in jobs {
        let steps: std::collections::BTreeSet<u64> = match tier.checkpoints(&job).await {
            Ok((records, skipped)) => {
                report.errors.extend(skipped);
                records.iter().map(|r| r.step).collect()
            }
            Err(error) => {
                report.errors.push(error.to_string());
                continue;
            }
        };
        for step in steps {
            let parts = match tier.manifest(&job, Some(step)).await {
                Ok(response) => response,
                Err(error) => {
                    report.errors.push(error.to_string());
                    continue;
                }
            };
            let info = parts.checkpoint.unwrap_or_default();
            let manifests: Result<Vec<Manifest>, _> =
                parts.parts.into_iter().map(|p| Manifest::try_from(p.manifest.unwrap_or_default())).collect();
            let manifests = match manifests {
                // Only a tenant's chunks are addressed with a key (`starckpt_proto::address`).
                Ok(manifests) if job.tenant().is_none() && manifests.iter().any(|m| m.addressing.is_keyed()) => {
                    report.errors.push(format!("{job} step {step}: a job outside every tenant's with keyed chunks"));
                    continue;
                }
                Ok(manifests) => manifests,
                Err(error) => {
                    report.errors.push(format!("{job} step {step}: {error}"));
                    continue;
                }
            };
            let checkpoint = ImportedCheckpoint {
                job: job.clone(),
                step,
                epoch: info.epoch,
                created_at_ms: info.created_at_ms,
                committed_at_ms: info.committed_at_ms,
                written_bytes: info.written_bytes,
                parts: manifests,
            };
            match store.import_checkpoint(&checkpoint, now_ms(), fence).await {
                Ok(Some(record)) => {
                    tracing::info!(%job, step, id = record.id, "checkpoint imported from the object-store tier");
                    report.imported.push(record);
                }
                Ok(None) => report.present += 1,
                Err(MetaError::InvalidArgument(reason)) => report.errors.push(format!("{job} step {step}: {reason}")),
                // A sweep began: every later import would be refused too.
                Err(MetaError::FailedPrecondition(reason)) => {
                    report.errors.push(reason);
                    return Ok(report);
                }
                Err(error) => return Err(error),
            }
        }
    }
    Ok(report)
}

/// Runs one pass (module docs). `targets`: every registered target with its data address when
/// alive.
pub async fn pass(
    store: &dyn MetaStore,
    tier: &Tier,
    targets: Vec<(TargetRecord, Option<SocketAddr>)>,
    credentials: &Credentials,
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
    let live = live_targets(&targets, credentials);
    let mut upload = Upload {
        tier,
        live: &live,
        pace: tokio::sync::Mutex::new(Pace::new(config.bytes_per_second)),
        present: HashSet::new(),
        silent: Default::default(),
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
    // A sweep that died midway leaves the fence down until one finishes: without this, a
    // cluster that deletes no tiered checkpoint would never tier anything again.
    if when == Sweep::Always || !gone.is_empty() || fence.is_none() {
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
    /// Targets that did not answer a read in time this pass: read last, so one silent target
    /// costs the pass one deadline, not one per chunk it holds.
    silent: std::sync::Mutex<HashSet<String>>,
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
        let chunks: Vec<(Addressing, ChunkRef)> = parts
            .iter()
            .flat_map(|(_, m)| m.files.iter().flat_map(|f| f.chunks.iter()).map(|c| (m.addressing, c)))
            .filter(|(_, c)| !self.present.contains(&c.hash) && seen.insert(c.hash))
            .map(|(addressing, c)| (addressing, c.clone()))
            .collect();
        // A few chunks in flight: an object store's latency, not its bandwidth, bounds one PUT at
        // a time. Memory: at most UPLOADS chunks.
        let this = &*self;
        let mut outcomes = futures::stream::iter(chunks)
            .map(|(addressing, chunk)| async move { this.chunk(&addressing, &chunk).await })
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
        let (job, step, id) = (checkpoint.job.as_str(), checkpoint.step, checkpoint.id);
        for (rank, manifest) in &parts {
            let bytes = pb::Manifest::from(manifest).encode_to_vec();
            self.tier
                .store
                .put(&Tier::manifest_path(job, step, id, *rank), PutPayload::from(bytes))
                .await
                .map_err(|e| format!("manifest of rank {rank}: {e}"))?;
        }
        // Last: its presence says the rest is there (module docs).
        let info = pb::CheckpointInfo { tiered_at_ms: now_ms(), ..super::convert::checkpoint_info(checkpoint) };
        let info = info.encode_to_vec();
        self.tier
            .store
            .put(&Tier::checkpoint_path(job, step, id, INFO), PutPayload::from(info))
            .await
            .map_err(|e| format!("checkpoint record: {e}"))?;
        Ok(true)
    }

    /// Puts `chunk` in the tier unless it is there: its length if it was uploaded.
    async fn chunk(&self, addressing: &Addressing, chunk: &ChunkRef) -> Result<Option<u64>, String> {
        let present = self.tier.has_chunk(chunk.hash, chunk.length_bytes).await;
        if present.map_err(|e| format!("chunk {}: {e}", chunk.hash))? {
            return Ok(None);
        }
        let data = self.read(addressing, chunk.hash, chunk.length_bytes, &chunk.replicas).await?;
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
    async fn read(
        &self,
        addressing: &Addressing,
        hash: ChunkHash,
        length: u64,
        listed: &[String],
    ) -> Result<Bytes, String> {
        let ids: Vec<&str> = self.live.iter().map(|l| l.id.as_str()).collect();
        let mut order: Vec<usize> = (0..self.live.len()).filter(|&i| listed.contains(&self.live[i].id)).collect();
        order.extend(rank_targets(&hash, &ids).into_iter().filter(|i| !listed.contains(&self.live[*i].id)));
        let silent = |index: &usize| self.silent.lock_unpoisoned().contains(&self.live[*index].id);
        let (answering, quiet): (Vec<usize>, Vec<usize>) = order.into_iter().partition(|i| !silent(i));
        let mut failures = Vec::new();
        for index in answering.into_iter().chain(quiet) {
            match read_verified(&self.live[index], addressing, hash, length).await {
                Ok((_, data, _)) => return Ok(data),
                Err(CopyError::Unanswered(e)) => {
                    self.silent.lock_unpoisoned().insert(self.live[index].id.clone());
                    failures.push(format!("{}: {e}", self.live[index].id))
                }
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
    // Records, then manifests, then chunks: a checkpoint whose record is still there keeps every
    // manifest and chunk (`restore --from-tier` trusts that), however far a sweep gets.
    let garbage: Vec<(bool, Path)> = tier
        .store
        .list(Some(&Path::from(CHECKPOINTS)))
        .try_filter_map(|meta| {
            let parts: Vec<String> = meta.location.parts().map(|p| p.as_ref().to_owned()).collect();
            let unneeded = match parts.as_slice() {
                [_, job, dir, file] if file.ends_with(".manifest") || file == INFO => {
                    (!committed.contains(&(job_of_part(job), dir.clone()))).then_some(file != INFO)
                }
                _ => None,
            };
            futures::future::ready(Ok(unneeded.map(|manifest| (manifest, meta.location))))
        })
        .try_collect()
        .await
        .map_err(|e| e.to_string())?;
    let (manifests, records): (Vec<_>, Vec<_>) = garbage.into_iter().partition(|(manifest, _)| *manifest);
    let listed = |paths: Vec<(bool, Path)>| futures::stream::iter(paths.into_iter().map(|(_, path)| Ok(path))).boxed();
    delete_all(store, sweep, tier, listed(records)).await?;
    report.manifests_deleted = delete_all(store, sweep, tier, listed(manifests)).await?;
    // Objects whose names are not ours are left alone.
    let garbage_chunks = tier.store.list(Some(&Path::from(CHUNKS))).try_filter_map(|meta| {
        let unneeded = meta
            .location
            .filename()
            .and_then(|name| ChunkHash::from_hex(name).ok())
            .is_some_and(|h| !needed.contains(&h));
        futures::future::ready(Ok(unneeded.then_some(meta.location)))
    });
    report.chunks_deleted = delete_all(store, sweep, tier, garbage_chunks.boxed()).await?;
    store.finish_tier_sweep(sweep).await.map_err(|e| e.to_string())
}

/// Paths deleted between two checks that the sweep deleting them is still the latest begun.
const DELETE_BATCH: usize = 1000;

/// Deletes every path `paths` yields; how many. Sweep `sweep` deletes a batch only while it is
/// still the latest begun: a sweep whose control plane lost its lock (a paused VM, a partition
/// from the database) and runs on must stop once another has begun, or it could delete what that
/// one found needed after it finished and reopened the fence (module docs): a chunk a checkpoint
/// committed since then deduplicated against, and was marked tiered with.
async fn delete_all(
    store: &dyn MetaStore,
    sweep: u64,
    tier: &Tier,
    paths: futures::stream::BoxStream<'_, TierResult<Path>>,
) -> Result<u64, String> {
    let mut deleted = 0;
    let mut batches = paths.chunks(DELETE_BATCH);
    while let Some(batch) = batches.next().await {
        let latest = store.tier_sweeps().await.map_err(|e| e.to_string())?.started;
        if latest != sweep {
            return Err(format!("sweep {sweep} stopped: sweep {latest} began meanwhile (another control plane leads)"));
        }
        let mut results = tier.store.delete_stream(futures::stream::iter(batch).boxed());
        while let Some(result) = results.next().await {
            match result {
                Ok(_) => deleted += 1,
                Err(object_store::Error::NotFound { .. }) => {}
                Err(error) => return Err(error.to_string()),
            }
        }
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
    use super::*;

    /// A sweep that another has superseded (its control plane lost its lock and ran on) deletes
    /// nothing more; the latest sweep deletes as before.
    #[tokio::test]
    async fn a_superseded_sweep_stops_deleting() {
        let dir = tempfile::tempdir().unwrap();
        let store = super::super::sql::SqlStore::open(dir.path().join("meta.db").to_str().unwrap()).await.unwrap();
        let tier = Tier::open(&format!("file://{}", dir.path().join("tier").display())).await.unwrap();
        let paths: Vec<Path> = (0..3).map(|i| Path::from_iter([CHUNKS, &format!("{i:064x}")])).collect();
        for path in &paths {
            tier.store.put(path, PutPayload::from_static(b"chunk")).await.unwrap();
        }
        let listed = || futures::stream::iter(paths.clone().into_iter().map(Ok)).boxed();
        let first = store.begin_tier_sweep().await.unwrap();
        let second = store.begin_tier_sweep().await.unwrap();
        let stopped = delete_all(&store, first, &tier, listed()).await;
        assert!(stopped.as_ref().is_err_and(|e| e.contains("began meanwhile")), "{stopped:?}");
        for path in &paths {
            tier.store.head(path).await.expect("a superseded sweep deleted an object");
        }
        assert_eq!(delete_all(&store, second, &tier, listed()).await.unwrap(), 3);
        assert!(tier.store.head(&paths[0]).await.is_err());
    }

    /// A sweep that died midway (the fence stays down) is run again by the next background pass,
    /// though no tiered checkpoint was deleted, so checkpoints are tiered again after it.
    #[tokio::test]
    async fn a_sweep_that_died_midway_is_run_again_by_the_next_pass() {
        use crate::control::store::conformance::{begin, lease, part};
        let dir = tempfile::tempdir().unwrap();
        let store = super::super::sql::SqlStore::open(dir.path().join("meta.db").to_str().unwrap()).await.unwrap();
        let tier = Tier::open(&format!("file://{}", dir.path().join("tier").display())).await.unwrap();
        let epoch = lease(&store, "dm", "run").await.unwrap().epoch;
        let record = store.begin_checkpoint(&begin("dm", 1, 1, epoch), 1).await.unwrap();
        store.commit_part(&part(record.id, 0, "empty", 0), &|| 2, u64::MAX).await.unwrap();
        store.begin_tier_sweep().await.unwrap(); // and its control plane dies
        let (credentials, config) = (Credentials::default(), TierConfig::default());
        let first = pass(&store, &tier, vec![], &credentials, &config, Sweep::IfDeleted).await.unwrap();
        assert!(first.swept && first.checkpoints_tiered == 0, "{:?}", first.errors);
        let second = pass(&store, &tier, vec![], &credentials, &config, Sweep::IfDeleted).await.unwrap();
        assert_eq!(second.checkpoints_tiered, 1, "{:?}", second.errors);
    }
}
