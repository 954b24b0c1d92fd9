//! The embedded metadata store: one SQLite file through sqlx.
//!
//! WAL journal with `synchronous = FULL`, so a committed transaction survives power loss.
//! Writes go through a pool of exactly one connection: SQLite allows one writer at a time anyway,
//! and a single writer connection means transactions never race to upgrade a read lock into a
//! write lock (which fails with SQLITE_BUSY instead of waiting). Reads use a separate pool and,
//! thanks to WAL, never wait for the writer.

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use futures::TryStreamExt;
use prost::Message;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow, SqliteSynchronous,
};
use sqlx::{Row, Sqlite, Transaction};
use starckpt_proto::control as pb;
use starckpt_proto::model::{AcquireLease, BeginCheckpoint, CommitPart, Manifest, TargetRegistration};
use starckpt_proto::{ChunkHash, JobName};

use super::store::{
    CheckpointRecord, CheckpointState, CommittedChunk, JobRecord, LeaseGrant, MetaError, MetaResult, MetaStore,
    RetentionPolicy, TargetRecord, fault,
};

const SCHEMA: &str = include_str!("schema.sql");
/// 2: targets.failure_domain, the replication table. 3: targets.rdma_device. Older databases are
/// migrated on open.
const SCHEMA_VERSION: i64 = 3;
const CHECKPOINT_COLUMNS: &str = "id, job, step, state, world_size, epoch, parts_committed, total_bytes, \
     written_bytes, file_count, created_at_ms, committed_at_ms, \
     (SELECT GROUP_CONCAT(tag, ',') FROM tags WHERE tags.checkpoint_id = checkpoints.id) AS tags";

pub struct SqliteStore {
    writer: SqlitePool,
    reader: SqlitePool,
}

impl SqliteStore {
    /// Opens (creating if missing) the database at `url`: `sqlite://PATH` or a plain file path.
    /// In-memory databases are refused: the control plane must be durable.
    pub async fn open(url: &str) -> MetaResult<SqliteStore> {
        let options = if url.starts_with("sqlite:") {
            SqliteConnectOptions::from_str(url)?
        } else {
            SqliteConnectOptions::new().filename(url)
        };
        if url.contains(":memory:") || url.contains("mode=memory") {
            return Err(MetaError::InvalidArgument(
                "an in-memory database would lose every checkpoint on restart".into(),
            ));
        }
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(10));
        let writer = SqlitePoolOptions::new().max_connections(1).connect_with(options.clone()).await?;
        sqlx::raw_sql(SCHEMA).execute(&writer).await?;
        let version: Option<i64> =
            sqlx::query_scalar("SELECT version FROM schema_version").fetch_optional(&writer).await?;
        match version {
            None => {
                sqlx::query("INSERT INTO schema_version (version) VALUES (?)")
                    .bind(SCHEMA_VERSION)
                    .execute(&writer)
                    .await?;
            }
            Some(SCHEMA_VERSION) => {}
            Some(old @ (1 | 2)) => {
                let mut tx = writer.begin().await?;
                if old < 2 {
                    sqlx::query("ALTER TABLE targets ADD COLUMN failure_domain TEXT NOT NULL DEFAULT ''")
                        .execute(&mut *tx)
                        .await?;
                }
                sqlx::query("ALTER TABLE targets ADD COLUMN rdma_device TEXT NOT NULL DEFAULT ''")
                    .execute(&mut *tx)
                    .await?;
                sqlx::query("UPDATE schema_version SET version = ?").bind(SCHEMA_VERSION).execute(&mut *tx).await?;
                tx.commit().await?;
            }
            Some(other) => {
                return Err(MetaError::Corrupt(format!(
                    "database schema version {other}; this build understands {SCHEMA_VERSION}"
                )));
            }
        }
        let reader = SqlitePoolOptions::new().max_connections(4).connect_with(options).await?;
        Ok(SqliteStore { writer, reader })
    }
}

fn to_i64(value: u64, what: &str) -> MetaResult<i64> {
    i64::try_from(value).map_err(|_| MetaError::InvalidArgument(format!("{what} {value} is out of range")))
}

fn get_u64(row: &SqliteRow, column: &str) -> MetaResult<u64> {
    let value: i64 = row.try_get(column)?;
    u64::try_from(value).map_err(|_| MetaError::Corrupt(format!("negative {column}")))
}

fn checkpoint_from_row(row: &SqliteRow) -> MetaResult<CheckpointRecord> {
    let committed_at: Option<i64> = row.try_get("committed_at_ms")?;
    let tags: Option<String> = row.try_get("tags")?;
    // Tags never contain ',' (validate_tag).
    let mut tags: Vec<String> = tags.iter().flat_map(|t| t.split(',')).map(str::to_owned).collect();
    tags.sort();
    Ok(CheckpointRecord {
        id: get_u64(row, "id")?,
        job: row.try_get("job")?,
        step: get_u64(row, "step")?,
        state: CheckpointState::parse(row.try_get("state")?)?,
        world_size: get_u64(row, "world_size")? as u32,
        epoch: get_u64(row, "epoch")?,
        parts_committed: get_u64(row, "parts_committed")? as u32,
        total_bytes: get_u64(row, "total_bytes")?,
        written_bytes: get_u64(row, "written_bytes")?,
        file_count: get_u64(row, "file_count")?,
        created_at_ms: get_u64(row, "created_at_ms")?,
        committed_at_ms: committed_at.map(|v| v.max(0) as u64),
        tags,
    })
}

fn decode_manifest(blob: &[u8], checkpoint_id: u64, rank: u32) -> MetaResult<Manifest> {
    let message = pb::Manifest::decode(blob)
        .map_err(|e| MetaError::Corrupt(format!("manifest of checkpoint {checkpoint_id} rank {rank}: {e}")))?;
    Manifest::try_from(message)
        .map_err(|e| MetaError::Corrupt(format!("manifest of checkpoint {checkpoint_id} rank {rank}: {e}")))
}

/// The job's current lease epoch and run id, if any run ever took it.
async fn current_lease(tx: &mut Transaction<'_, Sqlite>, job: &str) -> MetaResult<Option<(u64, String)>> {
    let row = sqlx::query("SELECT epoch, run_id FROM leases WHERE job = ? ORDER BY epoch DESC LIMIT 1")
        .bind(job)
        .fetch_optional(&mut **tx)
        .await?;
    row.map(|row| Ok((get_u64(&row, "epoch")?, row.try_get("run_id")?))).transpose()
}

/// Checks that `epoch` is the job's current one: Fenced if a newer run took over, InvalidArgument
/// if it was never issued.
async fn check_epoch(tx: &mut Transaction<'_, Sqlite>, job: &str, epoch: u64) -> MetaResult<()> {
    match current_lease(tx, job).await? {
        Some((current, _)) if current == epoch => Ok(()),
        Some((current, run_id)) if current > epoch => Err(MetaError::Fenced(format!(
            "job {job}: epoch {epoch} was superseded by run {run_id:?} at epoch {current}; this writer belongs to a \
             preempted run and may no longer write"
        ))),
        _ => Err(MetaError::InvalidArgument(format!(
            "job {job}: epoch {epoch} was never issued (take a lease with AcquireLease first)"
        ))),
    }
}

async fn retention_policy(tx: &mut Transaction<'_, Sqlite>, job: &str) -> MetaResult<RetentionPolicy> {
    let row = sqlx::query("SELECT keep_last, keep_every FROM retention WHERE job = ?")
        .bind(job)
        .fetch_optional(&mut **tx)
        .await?;
    let Some(row) = row else { return Ok(RetentionPolicy::default()) };
    let keep_last = u32::try_from(get_u64(&row, "keep_last")?)
        .map_err(|_| MetaError::Corrupt(format!("job {job}: keep_last out of range")))?;
    Ok(RetentionPolicy { keep_last, keep_every: get_u64(&row, "keep_every")? })
}

/// Marks the job's committed checkpoints its retention policy does not keep as deleted; returns
/// their steps. `spare` (the checkpoint committing in this transaction) is never deleted by it: a
/// writer is never told "committed" about a checkpoint that is already gone (it goes at the next
/// commit if the policy still drops it, e.g. a lower step than the kept ones).
async fn apply_retention(
    tx: &mut Transaction<'_, Sqlite>,
    job: &str,
    now_ms: u64,
    spare: Option<u64>,
) -> MetaResult<Vec<u64>> {
    let policy = retention_policy(tx, job).await?;
    if policy.keeps_everything() {
        return Ok(Vec::new());
    }
    let rows = sqlx::query(
        "SELECT id, step, EXISTS (SELECT 1 FROM tags WHERE tags.checkpoint_id = checkpoints.id) AS tagged
         FROM checkpoints WHERE job = ? AND state = 'committed' ORDER BY step DESC",
    )
    .bind(job)
    .fetch_all(&mut **tx)
    .await?;
    let mut deleted = Vec::new();
    for (rank, row) in rows.iter().enumerate() {
        let step = get_u64(row, "step")?;
        let tagged: i64 = row.try_get("tagged")?;
        if policy.keeps(rank, step, tagged != 0) || spare == Some(get_u64(row, "id")?) {
            continue;
        }
        sqlx::query("UPDATE checkpoints SET state = 'deleted', ended_at_ms = ? WHERE id = ?")
            .bind(to_i64(now_ms, "time")?)
            .bind(row.try_get::<i64, _>("id")?)
            .execute(&mut **tx)
            .await?;
        deleted.push(step);
    }
    if !deleted.is_empty() {
        tracing::info!(%job, ?deleted, ?policy, "retention deleted checkpoints");
    }
    Ok(deleted)
}

async fn checkpoint_by_id(tx: &mut Transaction<'_, Sqlite>, id: i64) -> MetaResult<Option<CheckpointRecord>> {
    let row = sqlx::query(&format!("SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE id = ?"))
        .bind(id)
        .fetch_optional(&mut **tx)
        .await?;
    row.as_ref().map(checkpoint_from_row).transpose()
}

#[async_trait]
impl MetaStore for SqliteStore {
    async fn upsert_target(&self, registration: &TargetRegistration, now_ms: u64) -> MetaResult<()> {
        sqlx::query(
            "INSERT INTO targets (target_id, data_address, capacity_bytes, used_bytes, registered_at_ms, last_heartbeat_ms,
                 failure_domain, rdma_device)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?)
             ON CONFLICT (target_id) DO UPDATE SET data_address = excluded.data_address,
                 capacity_bytes = excluded.capacity_bytes, used_bytes = excluded.used_bytes,
                 registered_at_ms = excluded.registered_at_ms, last_heartbeat_ms = excluded.last_heartbeat_ms,
                 failure_domain = excluded.failure_domain, rdma_device = excluded.rdma_device",
        )
        .bind(&registration.target_id)
        .bind(registration.data_address.to_string())
        .bind(to_i64(registration.capacity_bytes, "capacity")?)
        .bind(to_i64(registration.used_bytes, "used bytes")?)
        .bind(to_i64(now_ms, "time")?)
        .bind(to_i64(now_ms, "time")?)
        .bind(&registration.failure_domain)
        .bind(&registration.rdma_device)
        .execute(&self.writer)
        .await?;
        Ok(())
    }

    async fn heartbeat(&self, target_id: &str, capacity: u64, used: u64, chunks: u64, now_ms: u64) -> MetaResult<()> {
        let result = sqlx::query(
            "UPDATE targets SET capacity_bytes = ?, used_bytes = ?, chunk_count = ?, last_heartbeat_ms = ? WHERE target_id = ?",
        )
        .bind(to_i64(capacity, "capacity")?)
        .bind(to_i64(used, "used bytes")?)
        .bind(to_i64(chunks, "chunk count")?)
        .bind(to_i64(now_ms, "time")?)
        .bind(target_id)
        .execute(&self.writer)
        .await?;
        if result.rows_affected() == 0 {
            return Err(MetaError::NotFound(format!("target {target_id} is not registered")));
        }
        Ok(())
    }

    async fn list_targets(&self) -> MetaResult<Vec<TargetRecord>> {
        let rows = sqlx::query(
            "SELECT target_id, data_address, capacity_bytes, used_bytes, chunk_count, last_heartbeat_ms, failure_domain,
                 rdma_device
             FROM targets ORDER BY target_id",
        )
        .fetch_all(&self.reader)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(TargetRecord {
                    target_id: row.try_get("target_id")?,
                    data_address: row.try_get("data_address")?,
                    capacity_bytes: get_u64(row, "capacity_bytes")?,
                    used_bytes: get_u64(row, "used_bytes")?,
                    chunk_count: get_u64(row, "chunk_count")?,
                    last_heartbeat_ms: get_u64(row, "last_heartbeat_ms")?,
                    failure_domain: row.try_get("failure_domain")?,
                    rdma_device: row.try_get("rdma_device")?,
                })
            })
            .collect()
    }

    async fn acquire_lease(&self, request: &AcquireLease, now_ms: u64) -> MetaResult<LeaseGrant> {
        let job = request.job.as_str();
        let mut tx = self.writer.begin().await?;
        let known: Option<i64> = sqlx::query_scalar("SELECT epoch FROM leases WHERE job = ? AND run_id = ?")
            .bind(job)
            .bind(&request.run_id)
            .fetch_optional(&mut *tx)
            .await?;
        let current = current_lease(&mut tx, job).await?;
        if let Some(epoch) = known {
            let epoch = epoch.max(0) as u64;
            return match current {
                Some((current, _)) if current == epoch => Ok(LeaseGrant { epoch, aborted_checkpoints: 0 }),
                Some((current, run_id)) => Err(MetaError::Fenced(format!(
                    "job {job}: run {:?} (epoch {epoch}) was superseded by run {run_id:?} (epoch {current})",
                    request.run_id
                ))),
                None => Err(MetaError::Corrupt(format!("job {job} has a lease row but no current lease"))),
            };
        }
        let epoch = current.map_or(1, |(current, _)| current + 1);
        let now = to_i64(now_ms, "time")?;
        sqlx::query("INSERT INTO leases (job, run_id, epoch, acquired_at_ms) VALUES (?, ?, ?, ?)")
            .bind(job)
            .bind(&request.run_id)
            .bind(to_i64(epoch, "epoch")?)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        // The takeover and the abort of the older runs' half-written checkpoints are one transaction.
        let aborted = sqlx::query(
            "UPDATE checkpoints SET state = 'aborted', ended_at_ms = ? WHERE job = ? AND state = 'pending' AND epoch < ?",
        )
        .bind(now)
        .bind(job)
        .bind(to_i64(epoch, "epoch")?)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        tracing::info!(%job, run_id = %request.run_id, epoch, aborted, "writer lease taken");
        Ok(LeaseGrant { epoch, aborted_checkpoints: aborted as u32 })
    }

    async fn begin_checkpoint(&self, request: &BeginCheckpoint, now_ms: u64) -> MetaResult<CheckpointRecord> {
        let step = to_i64(request.step, "step")?;
        let now = to_i64(now_ms, "time")?;
        let mut tx = self.writer.begin().await?;
        check_epoch(&mut tx, request.job.as_str(), request.epoch).await?;
        let live = sqlx::query(&format!(
            "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE job = ? AND step = ? AND state IN ('pending', 'committed')"
        ))
        .bind(request.job.as_str())
        .bind(step)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(row) = live {
            let existing = checkpoint_from_row(&row)?;
            match existing.state {
                CheckpointState::Committed => {
                    return Err(MetaError::AlreadyExists(format!(
                        "job {} already has a committed checkpoint at step {}; delete it first to save that step again",
                        request.job, request.step
                    )));
                }
                _ if existing.epoch == request.epoch => {
                    if existing.world_size != request.world_size {
                        return Err(MetaError::FailedPrecondition(format!(
                            "{} step {} was begun with world size {}, not {}",
                            request.job, request.step, existing.world_size, request.world_size
                        )));
                    }
                    return Ok(existing);
                }
                _ => {
                    // Older epochs' pending checkpoints are aborted when a new run takes the lease;
                    // one left over (from a database written before that rule) is aborted here.
                    sqlx::query("UPDATE checkpoints SET state = 'aborted', ended_at_ms = ? WHERE id = ?")
                        .bind(now)
                        .bind(existing.id as i64)
                        .execute(&mut *tx)
                        .await?;
                }
            }
        }
        let row = sqlx::query(&format!(
            "INSERT INTO checkpoints (job, step, state, world_size, epoch, created_at_ms)
             VALUES (?, ?, 'pending', ?, ?, ?) RETURNING {CHECKPOINT_COLUMNS}"
        ))
        .bind(request.job.as_str())
        .bind(step)
        .bind(request.world_size as i64)
        .bind(to_i64(request.epoch, "epoch")?)
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        let record = checkpoint_from_row(&row)?;
        tx.commit().await?;
        Ok(record)
    }

    async fn commit_part(&self, part: &CommitPart, now_ms: u64, begun_after_ms: u64) -> MetaResult<CheckpointRecord> {
        let id = to_i64(part.checkpoint_id, "checkpoint id")?;
        let mut tx = self.writer.begin().await?;
        let Some(record) = checkpoint_by_id(&mut tx, id).await? else {
            return Err(MetaError::NotFound(format!("checkpoint {} does not exist", part.checkpoint_id)));
        };
        if part.rank >= record.world_size {
            return Err(MetaError::InvalidArgument(format!(
                "rank {} is outside world size {} of checkpoint {}",
                part.rank, record.world_size, record.id
            )));
        }
        let existing: Option<Vec<u8>> =
            sqlx::query_scalar("SELECT manifest FROM parts WHERE checkpoint_id = ? AND rank = ?")
                .bind(id)
                .bind(part.rank as i64)
                .fetch_optional(&mut *tx)
                .await?;
        if let Some(blob) = existing {
            if decode_manifest(&blob, record.id, part.rank)? == part.manifest {
                return Ok(record);
            }
            return Err(MetaError::FailedPrecondition(format!(
                "rank {} of checkpoint {} already committed a different manifest",
                part.rank, record.id
            )));
        }
        check_epoch(&mut tx, &record.job, record.epoch).await?;
        if record.state != CheckpointState::Pending {
            return Err(MetaError::FailedPrecondition(format!(
                "checkpoint {} ({} step {}) is {}; its parts can no longer be committed",
                record.id,
                record.job,
                record.step,
                record.state.as_str()
            )));
        }
        if record.created_at_ms < begun_after_ms {
            sqlx::query("UPDATE checkpoints SET state = 'aborted', ended_at_ms = ? WHERE id = ?")
                .bind(to_i64(now_ms, "time")?)
                .bind(id)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            return Err(MetaError::FailedPrecondition(format!(
                "checkpoint {} ({} step {}) was begun {} s ago, past the pending timeout; it is aborted (save again)",
                record.id,
                record.job,
                record.step,
                now_ms.saturating_sub(record.created_at_ms) / 1000
            )));
        }
        let blob = pb::Manifest::from(&part.manifest).encode_to_vec();
        let stored: i64 =
            sqlx::query_scalar("SELECT COALESCE(SUM(LENGTH(manifest)), 0) FROM parts WHERE checkpoint_id = ?")
                .bind(id)
                .fetch_one(&mut *tx)
                .await?;
        let manifest_total = stored.max(0) as u64 + blob.len() as u64;
        if manifest_total > starckpt_proto::model::MAX_CHECKPOINT_MANIFEST_BYTES {
            return Err(MetaError::InvalidArgument(format!(
                "checkpoint {}'s manifest would be {manifest_total} bytes, over the {} byte limit \
                 (use a larger chunk size)",
                record.id,
                starckpt_proto::model::MAX_CHECKPOINT_MANIFEST_BYTES
            )));
        }
        let total_bytes = to_i64(part.manifest.total_bytes(), "bytes")?;
        let file_count = part.manifest.files.len() as i64;
        let written_bytes = to_i64(part.written_bytes, "written bytes")?;
        let now = to_i64(now_ms, "time")?;
        sqlx::query(
            "INSERT INTO parts (checkpoint_id, rank, manifest, total_bytes, written_bytes, file_count, committed_at_ms)
             VALUES (?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(id)
        .bind(part.rank as i64)
        .bind(blob)
        .bind(total_bytes)
        .bind(written_bytes)
        .bind(file_count)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        // The commit transition happens in the same transaction as the last part's insertion.
        sqlx::query(
            "UPDATE checkpoints SET parts_committed = parts_committed + 1, total_bytes = total_bytes + ?,
                 written_bytes = written_bytes + ?, file_count = file_count + ?,
                 state = CASE WHEN parts_committed + 1 = world_size THEN 'committed' ELSE state END,
                 committed_at_ms = CASE WHEN parts_committed + 1 = world_size THEN ? ELSE committed_at_ms END
             WHERE id = ?",
        )
        .bind(total_bytes)
        .bind(written_bytes)
        .bind(file_count)
        .bind(now)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        let record =
            checkpoint_by_id(&mut tx, id).await?.ok_or_else(|| MetaError::Corrupt("checkpoint vanished".into()))?;
        if record.state == CheckpointState::Committed {
            apply_retention(&mut tx, &record.job, now_ms, Some(record.id)).await?;
        }
        fault("control.commit.txn")?;
        tx.commit().await?;
        Ok(record)
    }

    async fn latest(&self, job: &JobName) -> MetaResult<Option<CheckpointRecord>> {
        let row = sqlx::query(&format!(
            "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE job = ? AND state = 'committed' ORDER BY step DESC LIMIT 1"
        ))
        .bind(job.as_str())
        .fetch_optional(&self.reader)
        .await?;
        row.as_ref().map(checkpoint_from_row).transpose()
    }

    async fn list_jobs(&self) -> MetaResult<Vec<JobRecord>> {
        let rows = sqlx::query(
            "SELECT job,
                    SUM(CASE WHEN state = 'committed' THEN 1 ELSE 0 END) AS committed,
                    MAX(CASE WHEN state = 'committed' THEN step END) AS latest_step,
                    SUM(CASE WHEN state = 'committed' THEN total_bytes ELSE 0 END) AS committed_bytes
             FROM checkpoints GROUP BY job ORDER BY job",
        )
        .fetch_all(&self.reader)
        .await?;
        rows.iter()
            .map(|row| {
                let latest: Option<i64> = row.try_get("latest_step")?;
                Ok(JobRecord {
                    job: row.try_get("job")?,
                    committed_checkpoints: get_u64(row, "committed")? as u32,
                    latest_step: latest.map(|s| s.max(0) as u64),
                    committed_bytes: get_u64(row, "committed_bytes")?,
                })
            })
            .collect()
    }

    async fn list_checkpoints(&self, job: &JobName, include_inactive: bool) -> MetaResult<Vec<CheckpointRecord>> {
        let filter = if include_inactive { "" } else { "AND state IN ('pending', 'committed')" };
        let rows = sqlx::query(&format!(
            "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE job = ? {filter} ORDER BY step, id"
        ))
        .bind(job.as_str())
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(checkpoint_from_row).collect()
    }

    async fn get_manifest(
        &self,
        job: &JobName,
        step: Option<u64>,
    ) -> MetaResult<(CheckpointRecord, Vec<(u32, Manifest)>)> {
        // One read transaction, so the checkpoint and its parts come from the same snapshot.
        let mut tx = self.reader.begin().await?;
        let row = match step {
            Some(step) => {
                sqlx::query(&format!(
                    "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE job = ? AND step = ? AND state = 'committed'"
                ))
                .bind(job.as_str())
                .bind(to_i64(step, "step")?)
                .fetch_optional(&mut *tx)
                .await?
            }
            None => {
                sqlx::query(&format!(
                    "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE job = ? AND state = 'committed' ORDER BY step DESC LIMIT 1"
                ))
                .bind(job.as_str())
                .fetch_optional(&mut *tx)
                .await?
            }
        };
        let Some(row) = row else {
            return Err(MetaError::NotFound(match step {
                Some(step) => format!("job {job} has no committed checkpoint at step {step}"),
                None => format!("job {job} has no committed checkpoint"),
            }));
        };
        let record = checkpoint_from_row(&row)?;
        let rows = sqlx::query("SELECT rank, manifest FROM parts WHERE checkpoint_id = ? ORDER BY rank")
            .bind(record.id as i64)
            .fetch_all(&mut *tx)
            .await?;
        let mut parts = Vec::with_capacity(rows.len());
        for row in &rows {
            let rank = get_u64(row, "rank")? as u32;
            let blob: Vec<u8> = row.try_get("manifest")?;
            parts.push((rank, decode_manifest(&blob, record.id, rank)?));
        }
        if parts.len() != record.world_size as usize {
            return Err(MetaError::Corrupt(format!(
                "committed checkpoint {} has {} parts of {}",
                record.id,
                parts.len(),
                record.world_size
            )));
        }
        Ok((record, parts))
    }

    async fn abort_stale_pending(&self, created_before_ms: u64, now_ms: u64) -> MetaResult<Vec<CheckpointRecord>> {
        let rows = sqlx::query(&format!(
            "UPDATE checkpoints SET state = 'aborted', ended_at_ms = ?
             WHERE state = 'pending' AND created_at_ms < ? RETURNING {CHECKPOINT_COLUMNS}"
        ))
        .bind(to_i64(now_ms, "time")?)
        .bind(to_i64(created_before_ms, "time")?)
        .fetch_all(&self.writer)
        .await?;
        rows.iter().map(checkpoint_from_row).collect()
    }

    async fn delete_checkpoint(&self, job: &JobName, step: u64, now_ms: u64) -> MetaResult<()> {
        let result = sqlx::query(
            "UPDATE checkpoints SET state = CASE WHEN state = 'committed' THEN 'deleted' ELSE 'aborted' END, ended_at_ms = ?
             WHERE job = ? AND step = ? AND state IN ('pending', 'committed')",
        )
        .bind(to_i64(now_ms, "time")?)
        .bind(job.as_str())
        .bind(to_i64(step, "step")?)
        .execute(&self.writer)
        .await?;
        if result.rows_affected() == 0 {
            return Err(MetaError::NotFound(format!("job {job} has no checkpoint at step {step}")));
        }
        Ok(())
    }

    async fn set_retention(&self, job: &JobName, policy: RetentionPolicy, now_ms: u64) -> MetaResult<Vec<u64>> {
        let mut tx = self.writer.begin().await?;
        sqlx::query(
            "INSERT INTO retention (job, keep_last, keep_every, updated_at_ms) VALUES (?, ?, ?, ?)
             ON CONFLICT (job) DO UPDATE SET keep_last = excluded.keep_last, keep_every = excluded.keep_every,
                 updated_at_ms = excluded.updated_at_ms",
        )
        .bind(job.as_str())
        .bind(i64::from(policy.keep_last))
        .bind(to_i64(policy.keep_every, "keep_every")?)
        .bind(to_i64(now_ms, "time")?)
        .execute(&mut *tx)
        .await?;
        let deleted = apply_retention(&mut tx, job.as_str(), now_ms, None).await?;
        tx.commit().await?;
        Ok(deleted)
    }

    async fn get_retention(&self, job: &JobName) -> MetaResult<RetentionPolicy> {
        let mut tx = self.reader.begin().await?;
        retention_policy(&mut tx, job.as_str()).await
    }

    async fn set_replication(&self, job: &JobName, replicas: u32, now_ms: u64) -> MetaResult<()> {
        if !(1..=starckpt_proto::model::MAX_REPLICAS).contains(&replicas) {
            return Err(MetaError::InvalidArgument(format!(
                "replication factor {replicas} is outside 1..={}",
                starckpt_proto::model::MAX_REPLICAS
            )));
        }
        sqlx::query(
            "INSERT INTO replication (job, replicas, updated_at_ms) VALUES (?, ?, ?)
             ON CONFLICT (job) DO UPDATE SET replicas = excluded.replicas, updated_at_ms = excluded.updated_at_ms",
        )
        .bind(job.as_str())
        .bind(i64::from(replicas))
        .bind(to_i64(now_ms, "time")?)
        .execute(&self.writer)
        .await?;
        Ok(())
    }

    async fn replication(&self, job: &JobName) -> MetaResult<Option<u32>> {
        let replicas: Option<i64> = sqlx::query_scalar("SELECT replicas FROM replication WHERE job = ?")
            .bind(job.as_str())
            .fetch_optional(&self.reader)
            .await?;
        replicas
            .map(|r| u32::try_from(r).map_err(|_| MetaError::Corrupt(format!("replication factor {r}"))))
            .transpose()
    }

    async fn tag_checkpoint(&self, job: &JobName, step: u64, tag: &str, remove: bool) -> MetaResult<()> {
        starckpt_proto::model::validate_tag(tag).map_err(|e| MetaError::InvalidArgument(e.to_string()))?;
        let mut tx = self.writer.begin().await?;
        let id: Option<i64> =
            sqlx::query_scalar("SELECT id FROM checkpoints WHERE job = ? AND step = ? AND state = 'committed'")
                .bind(job.as_str())
                .bind(to_i64(step, "step")?)
                .fetch_optional(&mut *tx)
                .await?;
        let Some(id) = id else {
            return Err(MetaError::NotFound(format!("job {job} has no committed checkpoint at step {step}")));
        };
        let statement = if remove {
            "DELETE FROM tags WHERE checkpoint_id = ? AND tag = ?"
        } else {
            "INSERT INTO tags (checkpoint_id, tag) VALUES (?, ?) ON CONFLICT DO NOTHING"
        };
        sqlx::query(statement).bind(id).bind(tag).execute(&mut *tx).await?;
        if remove {
            // An untagged checkpoint falls back under the policy at once.
            apply_retention(&mut tx, job.as_str(), crate::control::store::now_ms(), None).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn live_chunks(&self) -> MetaResult<HashSet<ChunkHash>> {
        // One read transaction: a consistent snapshot, streamed one manifest at a time.
        let mut tx = self.reader.begin().await?;
        let mut rows = sqlx::query(
            "SELECT p.checkpoint_id, p.rank, p.manifest FROM parts p JOIN checkpoints c ON c.id = p.checkpoint_id
             WHERE c.state IN ('pending', 'committed')",
        )
        .fetch(&mut *tx);
        let mut live = HashSet::new();
        while let Some(row) = rows.try_next().await? {
            let (id, rank) = (get_u64(&row, "checkpoint_id")?, get_u64(&row, "rank")? as u32);
            let blob: Vec<u8> = row.try_get("manifest")?;
            let manifest = decode_manifest(&blob, id, rank)?;
            live.extend(manifest.files.iter().flat_map(|f| f.chunks.iter()).map(|c| c.hash));
        }
        Ok(live)
    }

    async fn committed_chunks(&self, default_replicas: u32) -> MetaResult<HashMap<ChunkHash, CommittedChunk>> {
        let mut tx = self.reader.begin().await?;
        let mut rows = sqlx::query(
            "SELECT p.checkpoint_id, p.rank, p.manifest, r.replicas FROM parts p
             JOIN checkpoints c ON c.id = p.checkpoint_id LEFT JOIN replication r ON r.job = c.job
             WHERE c.state = 'committed'",
        )
        .fetch(&mut *tx);
        let mut chunks: HashMap<ChunkHash, CommittedChunk> = HashMap::new();
        while let Some(row) = rows.try_next().await? {
            let (id, rank) = (get_u64(&row, "checkpoint_id")?, get_u64(&row, "rank")? as u32);
            let replicas: Option<i64> = row.try_get("replicas")?;
            let wanted = replicas.map_or(default_replicas, |r| u32::try_from(r).unwrap_or(default_replicas));
            let blob: Vec<u8> = row.try_get("manifest")?;
            for chunk in decode_manifest(&blob, id, rank)?.files.iter().flat_map(|f| f.chunks.iter()) {
                let entry = chunks.entry(chunk.hash).or_insert_with(|| CommittedChunk {
                    length: chunk.length_bytes,
                    replicas: Default::default(),
                    wanted,
                });
                entry.replicas.extend(chunk.replicas.iter().cloned());
                entry.wanted = entry.wanted.max(wanted);
            }
        }
        Ok(chunks)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::control::store::conformance;

    async fn open() -> (tempfile::TempDir, SqliteStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&format!("sqlite://{}", dir.path().join("meta.db").display())).await.unwrap();
        (dir, store)
    }

    #[tokio::test]
    async fn targets() {
        conformance::targets(&open().await.1).await;
    }

    #[tokio::test]
    async fn multi_rank_commit() {
        conformance::multi_rank_commit(&open().await.1).await;
    }

    #[tokio::test]
    async fn step_collisions() {
        conformance::step_collisions(&open().await.1).await;
    }

    #[tokio::test]
    async fn fencing() {
        conformance::fencing(&open().await.1).await;
    }

    #[tokio::test]
    async fn stale_pending_is_aborted() {
        conformance::stale_pending_is_aborted(&open().await.1).await;
    }

    /// A database of an older schema version with one target, as that version wrote it.
    async fn old_database(path: &std::path::Path, version: i64) {
        let options = SqliteConnectOptions::new().filename(path).create_if_missing(true);
        let pool = SqlitePoolOptions::new().max_connections(1).connect_with(options).await.unwrap();
        let (domain_column, domain_value) =
            if version >= 2 { (", failure_domain TEXT NOT NULL DEFAULT ''", ", 'rack'") } else { ("", "") };
        sqlx::raw_sql(&format!(
            "CREATE TABLE schema_version (version INTEGER NOT NULL);
             INSERT INTO schema_version (version) VALUES ({version});
             CREATE TABLE targets (target_id TEXT PRIMARY KEY, data_address TEXT NOT NULL,
                 capacity_bytes BIGINT NOT NULL, used_bytes BIGINT NOT NULL, chunk_count BIGINT NOT NULL DEFAULT 0,
                 registered_at_ms BIGINT NOT NULL, last_heartbeat_ms BIGINT NOT NULL{domain_column});
             INSERT INTO targets VALUES ('old', '127.0.0.1:9000', 100, 1, 0, 5, 5{domain_value});"
        ))
        .execute(&pool)
        .await
        .unwrap();
        pool.close().await;
    }

    #[tokio::test]
    async fn older_databases_are_migrated_and_keep_their_targets() {
        for (version, domain) in [(1, ""), (2, "rack")] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("old.db");
            old_database(&path, version).await;
            let store = SqliteStore::open(path.to_str().unwrap()).await.unwrap();
            let targets = store.list_targets().await.unwrap();
            let target =
                (targets[0].target_id.as_str(), targets[0].failure_domain.as_str(), targets[0].rdma_device.as_str());
            assert_eq!(target, ("old", domain, ""), "from version {version}");
            drop(store);
            // Opening again finds the current version and changes nothing.
            let store = SqliteStore::open(path.to_str().unwrap()).await.unwrap();
            assert_eq!(store.list_targets().await.unwrap().len(), 1);
        }
    }

    #[tokio::test]
    async fn replication() {
        conformance::replication(&open().await.1).await;
    }

    #[tokio::test]
    async fn retention_and_tags() {
        conformance::retention_and_tags(&open().await.1).await;
    }

    #[tokio::test]
    async fn late_commit_is_refused() {
        conformance::late_commit_is_refused(&open().await.1).await;
    }

    #[tokio::test]
    async fn committed_chunks() {
        conformance::committed_chunks(&open().await.1).await;
    }

    #[tokio::test]
    async fn live_chunks() {
        conformance::live_chunks(&open().await.1).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_last_parts() {
        let (_dir, store) = open().await;
        conformance::concurrent_last_parts(Arc::new(store)).await;
    }

    #[tokio::test]
    async fn survives_reopen_and_refuses_memory() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta.db");
        {
            let store = SqliteStore::open(path.to_str().unwrap()).await.unwrap();
            conformance::multi_rank_commit(&store).await;
        }
        let store = SqliteStore::open(path.to_str().unwrap()).await.unwrap();
        let job = JobName::try_from("j").unwrap();
        assert_eq!(store.latest(&job).await.unwrap().unwrap().step, 100);
        assert!(SqliteStore::open("sqlite::memory:").await.is_err());
    }

    #[tokio::test]
    async fn corrupt_manifest_is_an_error() {
        let (_dir, store) = open().await;
        conformance::multi_rank_commit(&store).await;
        sqlx::query("UPDATE parts SET manifest = X'FFFF01'").execute(&store.writer).await.unwrap();
        let job = JobName::try_from("j").unwrap();
        assert!(matches!(store.get_manifest(&job, None).await, Err(MetaError::Corrupt(_))));
    }
}
