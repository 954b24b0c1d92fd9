//! The metadata store behind the control plane.
//!
//! [`MetaStore`] is the whole contract between the gRPC service and its database. The embedded
//! default is SQLite; PostgreSQL, for HA, runs the same queries over the same tables
//! ([`super::sql::SqlStore`]), and any number of control planes may share one PostgreSQL.
//!
//! ## Checkpoint state machine
//!
//! ```text
//!   begin ──► PENDING ──(last of world_size parts)──► COMMITTED ──(rm)──► DELETED
//!                │
//!                └──(a new run takes the job's lease; pending timeout; rm)──► ABORTED
//! ```
//!
//! Retention marks COMMITTED checkpoints DELETED (see `RetentionPolicy` in control.proto) in the
//! transaction that commits a newer one. A commit arriving after the pending timeout (measured
//! from begin) is refused and the checkpoint aborted, even before the reaper gets to it: garbage
//! collection's safety argument (`gc.rs`) relies on no checkpoint committing later than that.
//!
//! ## Leases and fencing
//!
//! A job's writers hold a lease identified by an epoch (see `AcquireLeaseRequest` in
//! control.proto). Taking the lease for a new run increments the epoch and aborts the pending
//! checkpoints of older epochs in the same transaction; begin and commit check the caller's
//! checkpoint epoch against the job's current one, so a zombie writer of a preempted run can
//! neither start nor finish a checkpoint once a new run has taken over.
//! At most one PENDING or COMMITTED checkpoint exists per (job, step) (a partial unique index
//! enforces it). The transition to COMMITTED happens in the same transaction as the insertion of
//! the last part, so `latest` can never observe a checkpoint with a missing part.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use async_trait::async_trait;
use starckpt_proto::model::{AcquireLease, BeginCheckpoint, CommitPart, Manifest, TargetRegistration};
use starckpt_proto::{ChunkHash, JobName};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum MetaError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    InvalidArgument(String),
    /// A bound was reached (drafts of a job or a writer).
    #[error("{0}")]
    ResourceExhausted(String),
    /// The caller's run or epoch was superseded by a newer run of the job.
    #[error("fenced: {0}")]
    Fenced(String),
    #[error("metadata in the database is corrupt: {0}")]
    Corrupt(String),
    #[error("database: {0}")]
    Backend(#[from] sqlx::Error),
}

pub type MetaResult<T> = Result<T, MetaError>;

impl MetaError {
    /// Whether the database failed in a way that says nothing about the request: it could not be
    /// reached or lost the connection, it was busy, it is shutting down or is a standby, or it
    /// picked this transaction to abort (a serialization failure or a deadlock). The same call,
    /// sent again, may well succeed, here or on another control plane sharing the database, so
    /// the service answers these as Unavailable and clients resend what is safe to resend.
    pub fn is_transient(&self) -> bool {
        let MetaError::Backend(error) = self else { return false };
        match error {
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed => true,
            sqlx::Error::Database(error) => match error.try_downcast_ref::<sqlx::sqlite::SqliteError>() {
                // SQLITE_BUSY and SQLITE_LOCKED: the low byte of an extended result code.
                Some(_) => {
                    error.code().and_then(|code| code.parse::<u32>().ok()).is_some_and(|c| matches!(c & 0xff, 5 | 6))
                }
                None => error.code().is_some_and(|code| transient_sqlstate(&code)),
            },
            _ => false,
        }
    }
}

/// PostgreSQL's SQLSTATEs among [`MetaError::is_transient`]'s failures.
fn transient_sqlstate(code: &str) -> bool {
    // Class 08: connection exceptions. Then serialization_failure, deadlock_detected,
    // lock_not_available, too_many_connections, admin_shutdown, crash_shutdown,
    // cannot_connect_now, and read_only_sql_transaction (a standby, promoted or not yet).
    code.starts_with("08")
        || matches!(code, "40001" | "40P01" | "55P03" | "53300" | "57P01" | "57P02" | "57P03" | "25006")
}

/// A fault point (`starckpt_dataplane::faults`) on the control plane: an injected failure reads as a
/// database error.
pub fn fault(name: &'static str) -> MetaResult<()> {
    starckpt_dataplane::faults::point(name).map_err(|e| MetaError::Backend(sqlx::Error::Io(e)))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointState {
    Pending,
    Committed,
    Aborted,
    Deleted,
}

impl CheckpointState {
    pub fn as_str(self) -> &'static str {
        match self {
            CheckpointState::Pending => "pending",
            CheckpointState::Committed => "committed",
            CheckpointState::Aborted => "aborted",
            CheckpointState::Deleted => "deleted",
        }
    }

    pub fn parse(text: &str) -> MetaResult<CheckpointState> {
        Ok(match text {
            "pending" => CheckpointState::Pending,
            "committed" => CheckpointState::Committed,
            "aborted" => CheckpointState::Aborted,
            "deleted" => CheckpointState::Deleted,
            other => return Err(MetaError::Corrupt(format!("unknown checkpoint state {other:?}"))),
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetRecord {
    pub target_id: String,
    pub data_address: String,
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub chunk_count: u64,
    pub last_heartbeat_ms: u64,
    pub failure_domain: String,
    /// Empty: the target serves no RDMA.
    pub rdma_device: String,
}

/// A chunk of committed checkpoints, as the manifests describe it ([`MetaStore::committed_chunks`]).
/// A pass holds one per distinct chunk of every committed checkpoint (millions on a large
/// cluster), so it is kept small: ~100 bytes with two replicas.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommittedChunk {
    pub length: u64,
    /// Targets the manifests list for it.
    pub replicas: Replicas,
    /// Copies it should have.
    pub wanted: u32,
    /// How it is addressed (`starckpt_proto::address`): the key of the manifest naming it.
    pub addressing: starckpt_proto::Addressing,
}

impl CommittedChunk {
    /// Adds the chunks `manifest` lists (each to have `wanted` copies, or more if another
    /// manifest wants more) to `index`, with the targets it lists for them.
    pub fn index(
        index: &mut HashMap<ChunkHash, CommittedChunk>,
        manifest: &Manifest,
        wanted: u32,
        ids: &mut TargetIds,
    ) {
        for chunk in manifest.files.iter().flat_map(|f| f.chunks.iter()) {
            let entry = index.entry(chunk.hash).or_insert_with(|| CommittedChunk {
                length: chunk.length_bytes,
                replicas: Default::default(),
                wanted,
                addressing: manifest.addressing,
            });
            for replica in &chunk.replicas {
                entry.replicas.add(replica, ids);
            }
            entry.wanted = entry.wanted.max(wanted);
        }
    }
}

/// The targets listed for a chunk, each once, in order. The ids are shared ([`TargetIds`]): a
/// set of strings per chunk cost ~500 bytes, this ~56 with two replicas.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Replicas(Vec<Arc<str>>);

impl Replicas {
    /// Adds target `id` (the shared copy `ids` holds) unless listed already.
    pub fn add(&mut self, id: &str, ids: &mut TargetIds) {
        if let Err(at) = self.0.binary_search_by(|listed| (**listed).cmp(id)) {
            self.0.insert(at, ids.get(id));
        }
    }

    pub fn contains(&self, id: &str) -> bool {
        self.0.binary_search_by(|listed| (**listed).cmp(id)).is_ok()
    }

    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|id| &**id)
    }
}

/// Target ids, one copy of each, shared by the [`Replicas`] that list them.
#[derive(Debug, Default)]
pub struct TargetIds(HashSet<Arc<str>>);

impl TargetIds {
    pub fn get(&mut self, id: &str) -> Arc<str> {
        if let Some(shared) = self.0.get(id) {
            return Arc::clone(shared);
        }
        let shared: Arc<str> = Arc::from(id);
        self.0.insert(Arc::clone(&shared));
        shared
    }
}

/// Which committed checkpoint of a job [`MetaStore::get_manifest_page`] reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ManifestOf {
    /// The one at this step, or the latest.
    Step(Option<u64>),
    /// The one with this id (the later pages of a paged read).
    Checkpoint(u64),
}

/// Some of a committed checkpoint's parts ([`MetaStore::get_manifest_page`]).
#[derive(Clone, Debug)]
pub struct ManifestPage {
    pub record: CheckpointRecord,
    /// Consecutive ranks, in order.
    pub parts: Vec<(u32, Manifest)>,
    /// The rank of the first part not in this page; None: this page ends with the last rank.
    pub next_rank: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointRecord {
    pub id: u64,
    pub job: String,
    pub step: u64,
    pub state: CheckpointState,
    pub world_size: u32,
    pub epoch: u64,
    pub parts_committed: u32,
    pub total_bytes: u64,
    pub written_bytes: u64,
    pub file_count: u64,
    pub created_at_ms: u64,
    pub committed_at_ms: Option<u64>,
    /// Sorted.
    pub tags: Vec<String>,
    /// When every chunk and manifest of it was in the object-store tier (`tier.rs`).
    pub tiered_at_ms: Option<u64>,
}

/// Which committed checkpoints of a job survive; see `RetentionPolicy` in control.proto. The
/// default (both rules 0) keeps everything.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RetentionPolicy {
    pub keep_last: u32,
    pub keep_every: u64,
}

impl RetentionPolicy {
    pub fn keeps_everything(&self) -> bool {
        self.keep_last == 0 && self.keep_every == 0
    }

    /// Whether the checkpoint at `step`, the `rank`-th most recent committed one (0 = latest),
    /// survives.
    pub fn keeps(&self, rank: usize, step: u64, tagged: bool) -> bool {
        self.keeps_everything()
            || rank == 0
            || tagged
            || (self.keep_last > 0 && rank < self.keep_last as usize)
            || (self.keep_every > 0 && step.is_multiple_of(self.keep_every))
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobRecord {
    pub job: String,
    pub committed_checkpoints: u32,
    pub latest_step: Option<u64>,
    pub committed_bytes: u64,
}

/// Everything the control plane persists. Implementations must make each method atomic.
#[async_trait]
pub trait MetaStore: Send + Sync + 'static {
    /// Inserts or updates a target (its address may change across restarts; its id does not).
    async fn upsert_target(&self, registration: &TargetRegistration, now_ms: u64) -> MetaResult<()>;
    /// Records a heartbeat. NotFound if the target never registered.
    async fn heartbeat(&self, target_id: &str, capacity: u64, used: u64, chunks: u64, now_ms: u64) -> MetaResult<()>;
    async fn list_targets(&self) -> MetaResult<Vec<TargetRecord>>;

    /// Returns the epoch of `run_id`'s lease on the job, taking the lease (and aborting older
    /// epochs' pending checkpoints) for a new run; Fenced for a superseded run id.
    async fn acquire_lease(&self, request: &AcquireLease, now_ms: u64) -> MetaResult<LeaseGrant>;
    /// Starts or joins checkpoint (job, step) under the caller's epoch; see `control.proto`.
    async fn begin_checkpoint(&self, request: &BeginCheckpoint, now_ms: u64) -> MetaResult<CheckpointRecord>;
    /// Adds one rank's part; commits the checkpoint when it is the last, and applies the job's
    /// retention policy in the same transaction. Idempotent for an identical part; a different
    /// part for the same rank is FailedPrecondition. A checkpoint begun more than
    /// `pending_timeout_ms` before `now_ms()` is aborted instead, and FailedPrecondition
    /// returned: the clock is read once, with the writer lock held, so a commit that waited for
    /// the lock is judged when it got it (GC's grace covers the timeout, not the wait: `gc.rs`).
    async fn commit_part(
        &self,
        part: &CommitPart,
        now_ms: &(dyn Fn() -> u64 + Sync),
        pending_timeout_ms: u64,
    ) -> MetaResult<CheckpointRecord>;
    async fn latest(&self, job: &JobName) -> MetaResult<Option<CheckpointRecord>>;
    async fn list_jobs(&self) -> MetaResult<Vec<JobRecord>>;
    async fn list_checkpoints(&self, job: &JobName, include_inactive: bool) -> MetaResult<Vec<CheckpointRecord>>;
    /// The committed checkpoint at `step` (or the latest) and all its parts ordered by rank.
    async fn get_manifest(
        &self,
        job: &JobName,
        step: Option<u64>,
    ) -> MetaResult<(CheckpointRecord, Vec<(u32, Manifest)>)> {
        let page = self.get_manifest_page(job, ManifestOf::Step(step), 0, usize::MAX).await?;
        Ok((page.record, page.parts))
    }
    /// A committed checkpoint of `job` and its parts from `from_rank` on, in rank order, as many
    /// as fit in `max_bytes` of stored manifests (at least one); `next_rank` is where the rest
    /// start. Corrupt if the parts are not the ranks they should be.
    async fn get_manifest_page(
        &self,
        job: &JobName,
        of: ManifestOf,
        from_rank: u32,
        max_bytes: usize,
    ) -> MetaResult<ManifestPage>;
    /// Committed → deleted; pending → aborted. With `only`, just when checkpoint `only` is the
    /// one at `step` (a caller acting on what it saw earlier never deletes a newer one). NotFound
    /// if there is none.
    async fn delete_checkpoint(&self, job: &JobName, step: u64, only: Option<u64>, now_ms: u64) -> MetaResult<()>;
    /// Pending → aborted for checkpoint `id` of `job` only, its writer giving up on it. Ok if it
    /// is aborted already; FailedPrecondition if it committed (or was deleted), NotFound if `job`
    /// has no checkpoint `id`.
    async fn abort_pending(&self, job: &JobName, id: u64, now_ms: u64) -> MetaResult<()>;
    /// Aborts pending checkpoints begun before `created_before_ms` (a rank never committed its
    /// part). Returns the aborted checkpoints.
    async fn abort_stale_pending(&self, created_before_ms: u64, now_ms: u64) -> MetaResult<Vec<CheckpointRecord>>;

    /// Sets the job's retention policy and applies it now; returns the steps it deleted.
    async fn set_retention(&self, job: &JobName, policy: RetentionPolicy, now_ms: u64) -> MetaResult<Vec<u64>>;
    async fn get_retention(&self, job: &JobName) -> MetaResult<RetentionPolicy>;
    /// Sets the job's replication factor (1..=MAX_REPLICAS) for checkpoints begun from now on.
    async fn set_replication(&self, job: &JobName, replicas: u32, now_ms: u64) -> MetaResult<()>;
    /// The job's replication factor, if one was set.
    async fn replication(&self, job: &JobName) -> MetaResult<Option<u32>>;
    /// Adds (or removes) `tag` on the committed checkpoint (job, step). NotFound if there is none;
    /// removing from a step deleted since (retention, once its last tag went) is done already.
    async fn tag_checkpoint(&self, job: &JobName, step: u64, tag: &str, remove: bool) -> MetaResult<()>;
    /// Records draft (job, name, writer) as `manifest` says, replacing its previous record;
    /// ResourceExhausted past [`starckpt_proto::draft::MAX_DRAFTS_PER_JOB`] drafts of the job or
    /// [`starckpt_proto::draft::MAX_DRAFTS_PER_WRITER`] of the writer.
    async fn put_draft(&self, draft: &DraftKey, manifest: &Manifest, now_ms: u64) -> MetaResult<()>;
    /// Every draft `writer` recorded, in every job, by job and name.
    async fn drafts_of(&self, writer: &str) -> MetaResult<Vec<StoredDraft>>;
    /// Every writer's record of draft `name` of `job`, by writer.
    async fn drafts_named(&self, job: &JobName, name: &str) -> MetaResult<Vec<StoredDraft>>;
    /// One draft's record with its files.
    async fn get_draft(&self, draft: &DraftKey) -> MetaResult<Option<(StoredDraft, Manifest)>>;
    /// Forgets a draft's record; whether there was one.
    async fn drop_draft(&self, draft: &DraftKey) -> MetaResult<bool>;
    /// Forgets drafts last recorded before `updated_before_ms` (abandoned: their mount is gone);
    /// those forgotten.
    async fn expire_drafts(&self, updated_before_ms: u64) -> MetaResult<Vec<StoredDraft>>;
    /// Puts job file `name` of `job` ([`starckpt_proto::draft::validate_job_file`]), replacing
    /// the one of that name; ResourceExhausted past
    /// [`starckpt_proto::draft::MAX_JOB_FILES_PER_JOB`] files of the job.
    async fn put_job_file(&self, job: &JobName, name: &str, manifest: &Manifest, now_ms: u64) -> MetaResult<()>;
    /// The job files of `job`, by name.
    async fn job_files(&self, job: &JobName) -> MetaResult<Vec<StoredJobFile>>;
    /// One job file with its manifest.
    async fn get_job_file(&self, job: &JobName, name: &str) -> MetaResult<Option<(StoredJobFile, Manifest)>>;
    /// Drops a job file; whether there was one.
    async fn drop_job_file(&self, job: &JobName, name: &str) -> MetaResult<bool>;
    /// Every chunk hash a part of a pending or committed checkpoint names, a draft's record or a
    /// job file: GC's mark set.
    async fn live_chunks(&self) -> MetaResult<HashSet<ChunkHash>>;
    /// Every chunk a committed checkpoint names, with every target a manifest lists for it and
    /// the copies it should have: the highest replication factor among the jobs naming it
    /// (`default_replicas` for a job that set none). Re-replication's work list.
    async fn committed_chunks(&self, default_replicas: u32) -> MetaResult<HashMap<ChunkHash, CommittedChunk>>;
    /// Committed checkpoints not yet in the object-store tier, oldest commit first.
    async fn untiered_checkpoints(&self) -> MetaResult<Vec<CheckpointRecord>>;
    /// Records that every chunk and manifest of checkpoint `id` is in the tier, if the tier's
    /// sweeps still stand where they did when the upload began ([`TierSweeps::fence`]); false
    /// (nothing recorded) if a sweep began since.
    async fn mark_tiered(&self, id: u64, now_ms: u64, fence: u64) -> MetaResult<bool>;
    /// Checkpoints marked tiered that are no longer committed (deleted since): what makes a
    /// sweep of the tier worth its listing.
    async fn tiered_gone(&self) -> MetaResult<Vec<u64>>;
    /// Forgets that checkpoints `ids` (no longer committed) were tiered: a sweep removed them.
    async fn forget_tiered(&self, ids: &[u64]) -> MetaResult<()>;
    /// Where the tier's sweeps stand.
    async fn tier_sweeps(&self) -> MetaResult<TierSweeps>;
    /// Records that a sweep begins; its number.
    async fn begin_tier_sweep(&self) -> MetaResult<u64>;
    /// Records that sweep `sweep` finished (every deletion done).
    async fn finish_tier_sweep(&self, sweep: u64) -> MetaResult<()>;
    /// Records the cluster's last re-replication pass: when it finished, and the chunks it left
    /// short of copies.
    async fn record_repair_pass(&self, finished_at_ms: u64, still_under_replicated: u64) -> MetaResult<()>;
    /// The last re-replication pass any control plane of the database recorded, if any:
    /// (finished at, chunks still short of copies).
    async fn last_repair_pass(&self) -> MetaResult<Option<(u64, u64)>>;
    /// Takes the cluster-wide role `role` for as long as the returned guard lives, or None while
    /// another process of a database shared by several control planes holds it (one at a time:
    /// tiering's safety rests on it, `tier.rs`). A holder that dies loses it.
    async fn try_lead(&self, role: Role) -> MetaResult<Option<Leadership>>;
    /// Records control plane `member.id` and when it was seen, and says (Some, the reason) whether
    /// another control plane seen at or after `live_since_ms` runs with other settings (GC's
    /// safety and the reaper assume every control plane of a database shares them, `gc.rs`). With
    /// `refuse`, such a conflict leaves `member` unrecorded. Forgets control planes unseen for a day.
    async fn join_control_planes(
        &self,
        member: &ControlPlaneMember,
        now_ms: u64,
        live_since_ms: u64,
        refuse: bool,
    ) -> MetaResult<Option<String>>;
    /// Adds a committed checkpoint read back from the object-store tier (`tier.rs`), as it was,
    /// under a new id and not marked tiered (the next pass records it under that id); None when
    /// the job already has a pending or committed checkpoint at that step. Like
    /// [`MetaStore::mark_tiered`], only if the tier's sweeps still stand at `fence`, read before
    /// the tier was: a sweep that began since may be deleting the chunks this checkpoint needs
    /// (its list of what to keep predates the import), so FailedPrecondition instead.
    async fn import_checkpoint(
        &self,
        checkpoint: &ImportedCheckpoint,
        now_ms: u64,
        fence: u64,
    ) -> MetaResult<Option<CheckpointRecord>>;
    /// Forgets control plane `id` (it is shutting down).
    async fn leave_control_planes(&self, id: &str) -> MetaResult<()>;
    /// The database server's clock, where control planes on other hosts share the database
    /// (PostgreSQL); None for SQLite, which one host serves.
    async fn database_clock_ms(&self) -> MetaResult<Option<u64>>;
}

/// Which draft: its job (as stored, with a tenant's prefix), its name under the job and the
/// writer (one mount) holding it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DraftKey {
    pub job: JobName,
    pub name: String,
    pub writer: String,
}

/// A draft's record, without its files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredDraft {
    pub key: DraftKey,
    pub file_count: u64,
    pub total_bytes: u64,
    pub updated_at_ms: u64,
}

/// A job file, without its manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredJobFile {
    pub name: String,
    pub size_bytes: u64,
    pub updated_at_ms: u64,
}

/// A committed checkpoint from the object-store tier ([`MetaStore::import_checkpoint`]).
#[derive(Clone, Debug)]
pub struct ImportedCheckpoint {
    pub job: JobName,
    pub step: u64,
    pub epoch: u64,
    pub created_at_ms: u64,
    pub committed_at_ms: u64,
    pub written_bytes: u64,
    /// Every rank's manifest, ranks 0..world size in order.
    pub parts: Vec<Manifest>,
}

/// A control plane as the database knows it ([`MetaStore::join_control_planes`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControlPlaneMember {
    /// `listener` `/` a per-process id.
    pub id: String,
    /// Where it listens, as only one process at a time can: host name, kernel boot id, network
    /// namespace and address (IP and port). A member with the same listener and another id is this one's earlier
    /// run, killed before it could leave; joining replaces it.
    pub listener: String,
    pub pending_timeout_ms: u64,
    pub gc_grace_ms: u64,
    /// What callers and targets must prove to it ([`ControlPlaneMember::security_of`]): control
    /// planes sharing a database must agree, or a cluster key's capabilities work on only some
    /// targets, and one control plane without bearer tokens opens every tenant's jobs to anyone.
    /// Empty: not known (a control plane of a build that did not record it), which binds nobody.
    pub security: String,
    /// The object-store tier it copies checkpoints to and recovers lost chunks from
    /// ([`ControlPlaneMember::tier_of`]): control planes sharing a database share its record of
    /// what is tiered, so they must share the tier too. Empty: not known, which binds nobody.
    pub tier: String,
}

impl ControlPlaneMember {
    /// `tier` for a control plane with the tier at `url`, or none.
    pub fn tier_of(url: Option<&str>) -> String {
        url.map_or_else(|| "no tier".to_owned(), |url| format!("tier {url}"))
    }

    /// `security` for a control plane with `key` (by fingerprint) that requires bearer tokens
    /// or not, and serves TLS or not. (Without TLS, the text is what builds before TLS wrote,
    /// so upgrading them one by one finds no conflict.)
    pub fn security_of(key: Option<&starckpt_proto::capability::ClusterKey>, tokens: bool, tls: bool) -> String {
        let key = key.map_or("no cluster key".to_owned(), |key| format!("cluster key {}", key.fingerprint()));
        let tokens = if tokens { "bearer tokens required" } else { "no bearer tokens" };
        let tls = if tls { ", TLS" } else { "" };
        format!("{key}, {tokens}{tls}")
    }
}

/// The tier's sweeps: how many began, and the last that finished (`tier.rs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierSweeps {
    pub started: u64,
    pub finished: u64,
}

impl TierSweeps {
    /// The fence an upload passes to [`MetaStore::mark_tiered`]; None while a sweep is running
    /// (or died midway: the next sweep to finish clears it), when nothing may be marked.
    pub fn fence(&self) -> Option<u64> {
        (self.started == self.finished).then_some(self.started)
    }
}

/// Work one control plane of the cluster does at a time ([`MetaStore::try_lead`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Tiering,
    /// Re-replication: passes of several control planes at once would each copy what is short
    /// (more copies than wanted, the bandwidth spent several times over) and scan every chunk.
    Repair,
    /// Garbage collection: safe beside another pass (`gc.rs`), but each would list every chunk
    /// of every target. Imports from the object-store tier take it too: a pass must not run
    /// across one (`gc.rs`).
    Gc,
}

/// Holds a [`Role`] while alive (what holds it is the backend's: a database session).
pub struct Leadership(pub Box<dyn Send + Sync>);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseGrant {
    pub epoch: u64,
    /// Pending checkpoints of older epochs aborted by this takeover.
    pub aborted_checkpoints: u32,
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

#[cfg(test)]
pub(crate) mod conformance;
