//! The metadata store behind the control plane.
//!
//! [`MetaStore`] is the whole contract between the gRPC service and its database. The embedded
//! default is SQLite ([`super::sqlite::SqliteStore`]); the schema (`schema.sql`) sticks to SQL that
//! PostgreSQL accepts too (partial unique index, integer ids, no SQLite-only types), so an HA
//! backend implements the same trait over the same tables.
//!
//! ## Checkpoint state machine
//!
//! ```text
//!   begin ──► PENDING ──(last of world_size parts)──► COMMITTED ──(rm)──► DELETED
//!                │
//!                └──(a begin of the same (job, step) with another attempt id; rm)──► ABORTED
//! ```
//! At most one PENDING or COMMITTED checkpoint exists per (job, step) (a partial unique index
//! enforces it). The transition to COMMITTED happens in the same transaction as the insertion of
//! the last part, so `latest` can never observe a checkpoint with a missing part.

use async_trait::async_trait;
use starckpt_proto::JobName;
use starckpt_proto::model::{BeginCheckpoint, CommitPart, Manifest, TargetRegistration};
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
    #[error("metadata in the database is corrupt: {0}")]
    Corrupt(String),
    #[error("database: {0}")]
    Backend(#[from] sqlx::Error),
}

pub type MetaResult<T> = Result<T, MetaError>;

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
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointRecord {
    pub id: u64,
    pub job: String,
    pub step: u64,
    pub state: CheckpointState,
    pub world_size: u32,
    pub attempt_id: String,
    pub parts_committed: u32,
    pub total_bytes: u64,
    pub file_count: u64,
    pub created_at_ms: u64,
    pub committed_at_ms: Option<u64>,
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

    /// Starts or joins an attempt at (job, step); see the rule in `control.proto`.
    async fn begin_checkpoint(&self, request: &BeginCheckpoint, now_ms: u64) -> MetaResult<CheckpointRecord>;
    /// Adds one rank's part; commits the checkpoint when it is the last. Idempotent for an
    /// identical part; a different part for the same rank is FailedPrecondition.
    async fn commit_part(&self, part: &CommitPart, now_ms: u64) -> MetaResult<CheckpointRecord>;
    async fn latest(&self, job: &JobName) -> MetaResult<Option<CheckpointRecord>>;
    async fn list_jobs(&self) -> MetaResult<Vec<JobRecord>>;
    async fn list_checkpoints(&self, job: &JobName, include_inactive: bool) -> MetaResult<Vec<CheckpointRecord>>;
    /// The committed checkpoint at `step` (or the latest) and its parts ordered by rank.
    async fn get_manifest(
        &self,
        job: &JobName,
        step: Option<u64>,
    ) -> MetaResult<(CheckpointRecord, Vec<(u32, Manifest)>)>;
    /// Committed → deleted; pending → aborted. NotFound if neither exists.
    async fn delete_checkpoint(&self, job: &JobName, step: u64, now_ms: u64) -> MetaResult<()>;
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

#[cfg(test)]
pub(crate) mod conformance {
    //! The suite every [`MetaStore`] backend must pass.
    use super::*;
    use starckpt_proto::control as pb;

    fn begin(job: &str, step: u64, world_size: u32, attempt: &str) -> BeginCheckpoint {
        BeginCheckpoint { job: JobName::try_from(job).unwrap(), step, world_size, attempt_id: attempt.into() }
    }

    fn part(checkpoint_id: u64, rank: u32, path: &str, size: u64) -> CommitPart {
        let chunks = if size == 0 {
            vec![]
        } else {
            vec![pb::ChunkRef {
                hash: bytes::Bytes::from(vec![rank as u8; 32]),
                length_bytes: size,
                stored_length_bytes: size,
                codec: 0,
                replicas: vec!["t1".into()],
            }]
        };
        let manifest = pb::Manifest {
            files: vec![pb::FileEntry { path: path.into(), size_bytes: size, mode: 0o644, chunks }],
            directories: vec![],
            metadata: [("rank".to_string(), rank.to_string())].into_iter().collect(),
        };
        CommitPart { checkpoint_id, rank, manifest: Manifest::try_from(manifest).unwrap() }
    }

    fn job(name: &str) -> JobName {
        JobName::try_from(name).unwrap()
    }

    pub async fn targets(store: &dyn MetaStore) {
        let registration = TargetRegistration {
            target_id: "t1".into(),
            data_address: "127.0.0.1:9000".parse().unwrap(),
            capacity_bytes: 100,
            used_bytes: 1,
        };
        assert!(matches!(store.heartbeat("t1", 1, 1, 1, 5).await, Err(MetaError::NotFound(_))));
        store.upsert_target(&registration, 10).await.unwrap();
        store
            .upsert_target(&TargetRegistration { data_address: "127.0.0.1:9001".parse().unwrap(), ..registration }, 20)
            .await
            .unwrap();
        store.heartbeat("t1", 200, 50, 7, 30).await.unwrap();
        let targets = store.list_targets().await.unwrap();
        assert_eq!(
            targets,
            vec![TargetRecord {
                target_id: "t1".into(),
                data_address: "127.0.0.1:9001".into(),
                capacity_bytes: 200,
                used_bytes: 50,
                chunk_count: 7,
                last_heartbeat_ms: 30,
            }]
        );
    }

    pub async fn multi_rank_commit(store: &dyn MetaStore) {
        let first = store.begin_checkpoint(&begin("j", 100, 2, "a"), 1).await.unwrap();
        let joined = store.begin_checkpoint(&begin("j", 100, 2, "a"), 2).await.unwrap();
        assert_eq!(first.id, joined.id, "same attempt joins");
        assert_eq!(first.state, CheckpointState::Pending);
        assert!(matches!(
            store.begin_checkpoint(&begin("j", 100, 3, "a"), 2).await,
            Err(MetaError::FailedPrecondition(_))
        ));

        let after_one = store.commit_part(&part(first.id, 0, "r0.pt", 10), 3).await.unwrap();
        assert_eq!((after_one.state, after_one.parts_committed), (CheckpointState::Pending, 1));
        assert_eq!(store.latest(&job("j")).await.unwrap(), None, "not visible before every rank");
        // Idempotent re-commit; conflicting re-commit; out-of-range rank.
        store.commit_part(&part(first.id, 0, "r0.pt", 10), 4).await.unwrap();
        assert!(matches!(
            store.commit_part(&part(first.id, 0, "other.pt", 10), 4).await,
            Err(MetaError::FailedPrecondition(_))
        ));
        assert!(matches!(
            store.commit_part(&part(first.id, 2, "r2.pt", 1), 4).await,
            Err(MetaError::InvalidArgument(_))
        ));
        assert!(matches!(store.commit_part(&part(9999, 0, "x", 1), 4).await, Err(MetaError::NotFound(_))));

        let done = store.commit_part(&part(first.id, 1, "r1.pt", 5), 5).await.unwrap();
        assert_eq!(done.state, CheckpointState::Committed);
        assert_eq!((done.total_bytes, done.file_count, done.committed_at_ms), (15, 2, Some(5)));
        let latest = store.latest(&job("j")).await.unwrap().unwrap();
        assert_eq!((latest.step, latest.id), (100, first.id));
        // Committing again after the commit is still idempotent.
        assert_eq!(
            store.commit_part(&part(first.id, 1, "r1.pt", 5), 6).await.unwrap().state,
            CheckpointState::Committed
        );

        let (record, parts) = store.get_manifest(&job("j"), None).await.unwrap();
        assert_eq!(record.id, first.id);
        assert_eq!(parts.iter().map(|(rank, _)| *rank).collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(parts[1].1.files[0].path.as_str(), "r1.pt");
        assert_eq!(parts[0].1.metadata.get("rank").map(String::as_str), Some("0"));
    }

    pub async fn step_collisions(store: &dyn MetaStore) {
        let committed = store.begin_checkpoint(&begin("c", 1, 1, "a"), 1).await.unwrap();
        store.commit_part(&part(committed.id, 0, "f", 1), 2).await.unwrap();
        assert!(matches!(store.begin_checkpoint(&begin("c", 1, 1, "b"), 3).await, Err(MetaError::AlreadyExists(_))));

        // A crashed attempt at step 2 is aborted by the next attempt with another id.
        let crashed = store.begin_checkpoint(&begin("c", 2, 2, "old"), 3).await.unwrap();
        store.commit_part(&part(crashed.id, 0, "f", 1), 4).await.unwrap();
        let retry = store.begin_checkpoint(&begin("c", 2, 1, "new"), 5).await.unwrap();
        assert_ne!(retry.id, crashed.id);
        assert!(matches!(
            store.commit_part(&part(crashed.id, 1, "g", 1), 6).await,
            Err(MetaError::FailedPrecondition(_))
        ));
        store.commit_part(&part(retry.id, 0, "f", 1), 6).await.unwrap();
        assert_eq!(store.latest(&job("c")).await.unwrap().unwrap().step, 2);

        let all = store.list_checkpoints(&job("c"), true).await.unwrap();
        let states: Vec<_> = all.iter().map(|c| (c.step, c.state)).collect();
        assert_eq!(
            states,
            vec![(1, CheckpointState::Committed), (2, CheckpointState::Aborted), (2, CheckpointState::Committed)]
        );
        let active = store.list_checkpoints(&job("c"), false).await.unwrap();
        assert_eq!(active.len(), 2);

        // Delete the latest: latest falls back; the step can be saved again.
        store.delete_checkpoint(&job("c"), 2, 7).await.unwrap();
        assert_eq!(store.latest(&job("c")).await.unwrap().unwrap().step, 1);
        assert!(matches!(store.get_manifest(&job("c"), Some(2)).await, Err(MetaError::NotFound(_))));
        assert!(matches!(store.delete_checkpoint(&job("c"), 2, 8).await, Err(MetaError::NotFound(_))));
        store.begin_checkpoint(&begin("c", 2, 1, "again"), 9).await.unwrap();
        assert!(matches!(store.latest(&job("nope")).await, Ok(None)));
        assert!(matches!(store.get_manifest(&job("nope"), None).await, Err(MetaError::NotFound(_))));

        let jobs = store.list_jobs().await.unwrap();
        let c = jobs.iter().find(|j| j.job == "c").unwrap();
        assert_eq!((c.committed_checkpoints, c.latest_step, c.committed_bytes), (1, Some(1), 1));
    }

    pub async fn concurrent_last_parts(store: std::sync::Arc<dyn MetaStore>) {
        // Eight ranks commit at once: exactly one commit transition, all parts recorded.
        let record = store.begin_checkpoint(&begin("par", 1, 8, "a"), 1).await.unwrap();
        let tasks: Vec<_> = (0..8)
            .map(|rank| {
                let store = std::sync::Arc::clone(&store);
                tokio::spawn(async move { store.commit_part(&part(record.id, rank, &format!("r{rank}"), 1), 2).await })
            })
            .collect();
        for task in tasks {
            task.await.unwrap().unwrap();
        }
        let latest = store.latest(&job("par")).await.unwrap().unwrap();
        assert_eq!((latest.parts_committed, latest.state, latest.total_bytes), (8, CheckpointState::Committed, 8));
    }
}
