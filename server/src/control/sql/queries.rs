//! Queries and row conversions the metadata store's operations share.

use futures::TryStreamExt;
use prost::Message;
use sqlx::any::AnyRow;
use sqlx::{Any, Row, Transaction};
use starckpt_proto::control as pb;
use starckpt_proto::model::{BeginCheckpoint, Manifest};

use super::CHECKPOINT_COLUMNS;
use crate::control::store::{CheckpointRecord, CheckpointState, MetaError, MetaResult, RetentionPolicy, TierSweeps};

pub(super) fn to_i64(value: u64, what: &str) -> MetaResult<i64> {
    i64::try_from(value).map_err(|_| MetaError::InvalidArgument(format!("{what} {value} is out of range")))
}

pub(super) fn get_u64(row: &AnyRow, column: &str) -> MetaResult<u64> {
    let value: i64 = row.try_get(column)?;
    u64::try_from(value).map_err(|_| MetaError::Corrupt(format!("negative {column}")))
}

pub(super) fn checkpoint_from_row(row: &AnyRow) -> MetaResult<CheckpointRecord> {
    let committed_at: Option<i64> = row.try_get("committed_at_ms")?;
    let tiered_at: Option<i64> = row.try_get("tiered_at_ms")?;
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
        tiered_at_ms: tiered_at.map(|v| v.max(0) as u64),
    })
}

pub(super) fn decode_manifest(blob: &[u8], checkpoint_id: u64, rank: u32) -> MetaResult<Manifest> {
    let message = pb::Manifest::decode(blob)
        .map_err(|e| MetaError::Corrupt(format!("manifest of checkpoint {checkpoint_id} rank {rank}: {e}")))?;
    Manifest::try_from(message)
        .map_err(|e| MetaError::Corrupt(format!("manifest of checkpoint {checkpoint_id} rank {rank}: {e}")))
}

/// The job's current lease epoch and run id, if any run ever took it.
pub(super) async fn current_lease(tx: &mut Transaction<'_, Any>, job: &str) -> MetaResult<Option<(u64, String)>> {
    let row = sqlx::query("SELECT epoch, run_id FROM leases WHERE job = $1 ORDER BY epoch DESC LIMIT 1")
        .bind(job)
        .fetch_optional(&mut **tx)
        .await?;
    row.map(|row| Ok((get_u64(&row, "epoch")?, row.try_get("run_id")?))).transpose()
}

/// The pending checkpoint a rank's begin joins, as of `tx`'s snapshot: the job's current epoch is
/// the request's, and a checkpoint of that epoch and world size is pending at the step. None
/// otherwise (the begin then runs under the writer lock, which also says what is wrong).
pub(super) async fn joinable(
    tx: &mut Transaction<'_, Any>,
    request: &BeginCheckpoint,
) -> MetaResult<Option<CheckpointRecord>> {
    let job = request.job.as_str();
    if current_lease(tx, job).await?.map(|(epoch, _)| epoch) != Some(request.epoch) {
        return Ok(None);
    }
    let row = sqlx::query(&format!(
        "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE job = $1 AND step = $2 AND epoch = $3 AND state = 'pending'"
    ))
    .bind(job)
    .bind(to_i64(request.step, "step")?)
    .bind(to_i64(request.epoch, "epoch")?)
    .fetch_optional(&mut **tx)
    .await?;
    let record = row.as_ref().map(checkpoint_from_row).transpose()?;
    Ok(record.filter(|record| record.world_size == request.world_size && !expired(record, request.begun_after_ms)))
}

/// Whether `record`, a pending checkpoint, was begun before `begun_after_ms` (now less the pending
/// timeout): it can no longer commit, so no rank may join it and `MetaStore::commit_part` aborts it.
pub(super) fn expired(record: &CheckpointRecord, begun_after_ms: u64) -> bool {
    record.created_at_ms < begun_after_ms
}

/// Checks that `epoch` is the job's current one: Fenced if a newer run took over, InvalidArgument
/// if it was never issued.
pub(super) async fn check_epoch(tx: &mut Transaction<'_, Any>, job: &str, epoch: u64) -> MetaResult<()> {
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

pub(super) async fn retention_policy(tx: &mut Transaction<'_, Any>, job: &str) -> MetaResult<RetentionPolicy> {
    let row = sqlx::query("SELECT keep_last, keep_every FROM retention WHERE job = $1")
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
pub(super) async fn apply_retention(
    tx: &mut Transaction<'_, Any>,
    job: &str,
    now_ms: u64,
    spare: Option<u64>,
) -> MetaResult<Vec<u64>> {
    let policy = retention_policy(tx, job).await?;
    if policy.keeps_everything() {
        return Ok(Vec::new());
    }
    let rows = sqlx::query(
        "SELECT id, step, CASE WHEN EXISTS (SELECT 1 FROM tags WHERE tags.checkpoint_id = checkpoints.id) THEN 1 ELSE 0 END AS tagged
         FROM checkpoints WHERE job = $1 AND state = 'committed' ORDER BY step DESC",
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
        sqlx::query("UPDATE checkpoints SET state = 'deleted', ended_at_ms = $1 WHERE id = $2")
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

pub(super) async fn tier_sweeps(tx: &mut Transaction<'_, Any>) -> MetaResult<TierSweeps> {
    let row = sqlx::query("SELECT started, finished FROM tier_sweeps WHERE id = 1").fetch_optional(&mut **tx).await?;
    let Some(row) = row else { return Ok(TierSweeps::default()) };
    Ok(TierSweeps { started: get_u64(&row, "started")?, finished: get_u64(&row, "finished")? })
}

/// Inserts rank `rank`'s part (`blob`: `manifest`, encoded) of checkpoint `id`; its bytes and
/// file count, for the checkpoint's totals.
pub(super) async fn insert_part(
    tx: &mut Transaction<'_, Any>,
    id: i64,
    rank: u32,
    blob: Vec<u8>,
    manifest: &Manifest,
    written_bytes: u64,
    now_ms: u64,
) -> MetaResult<(i64, i64)> {
    let total_bytes = to_i64(manifest.total_bytes(), "bytes")?;
    let file_count = manifest.files.len() as i64;
    sqlx::query(
        "INSERT INTO parts (checkpoint_id, rank, manifest, total_bytes, written_bytes, file_count, committed_at_ms)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(id)
    .bind(rank as i64)
    .bind(blob)
    .bind(total_bytes)
    .bind(to_i64(written_bytes, "written bytes")?)
    .bind(file_count)
    .bind(to_i64(now_ms, "time")?)
    .execute(&mut **tx)
    .await?;
    Ok((total_bytes, file_count))
}

/// Marks pending checkpoint `id` aborted and commits `tx`.
pub(super) async fn abort_in(mut tx: Transaction<'_, Any>, id: i64, now_ms: u64) -> MetaResult<()> {
    sqlx::query("UPDATE checkpoints SET state = 'aborted', ended_at_ms = $1 WHERE id = $2")
        .bind(to_i64(now_ms, "time")?)
        .bind(id)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

/// The committed parts of checkpoint `id` (rank and manifest), by rank.
pub(super) async fn part_manifests(tx: &mut Transaction<'_, Any>, id: u64) -> MetaResult<Vec<(u32, Manifest)>> {
    Ok(part_manifests_from(tx, id, 0, usize::MAX).await?.0)
}

/// The parts of checkpoint `id` from `from_rank` on, in rank order, while their stored manifests
/// add up to at most `max_bytes` (at least one part), and the rank of the first one left out.
pub(super) async fn part_manifests_from(
    tx: &mut Transaction<'_, Any>,
    id: u64,
    from_rank: u32,
    max_bytes: usize,
) -> MetaResult<(Vec<(u32, Manifest)>, Option<u32>)> {
    let mut rows =
        sqlx::query("SELECT rank, manifest FROM parts WHERE checkpoint_id = $1 AND rank >= $2 ORDER BY rank")
            .bind(to_i64(id, "checkpoint id")?)
            .bind(i64::from(from_rank))
            .fetch(&mut **tx);
    let (mut parts, mut bytes) = (Vec::new(), 0usize);
    while let Some(row) = rows.try_next().await? {
        let rank = u32::try_from(get_u64(&row, "rank")?)
            .map_err(|_| MetaError::Corrupt(format!("checkpoint {id} has a part of rank above 2^32")))?;
        let blob: Vec<u8> = row.try_get("manifest")?;
        if !parts.is_empty() && bytes.saturating_add(blob.len()) > max_bytes {
            return Ok((parts, Some(rank)));
        }
        bytes = bytes.saturating_add(blob.len());
        parts.push((rank, decode_manifest(&blob, id, rank)?));
    }
    Ok((parts, None))
}

pub(super) async fn checkpoint_by_id(tx: &mut Transaction<'_, Any>, id: i64) -> MetaResult<Option<CheckpointRecord>> {
    let row = sqlx::query(&format!("SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE id = $1"))
        .bind(id)
        .fetch_optional(&mut **tx)
        .await?;
    row.as_ref().map(checkpoint_from_row).transpose()
}
