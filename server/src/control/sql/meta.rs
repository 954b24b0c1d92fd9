//! The metadata store's operations ([`MetaStore`]) as SQL.

use std::collections::{HashMap, HashSet};

use async_trait::async_trait;
use futures::TryStreamExt;
use prost::Message;
use sqlx::Row;
use starckpt_proto::control as pb;
use starckpt_proto::model::{AcquireLease, BeginCheckpoint, CommitPart, Manifest, TargetRegistration, check_disjoint};
use starckpt_proto::{Addressing, ChunkHash, JobName};

use super::queries::{
    abort_in, apply_retention, check_epoch, checkpoint_by_id, checkpoint_from_row, current_lease, decode_manifest,
    expired, get_u64, insert_part, joinable, part_manifests, part_manifests_from, retention_policy, tier_sweeps,
    to_i64,
};
use super::{CHECKPOINT_COLUMNS, Dialect, SqlStore, role_lock};
use crate::control::store::{
    CheckpointRecord, CheckpointState, CommittedChunk, ControlPlaneMember, DraftKey, ImportedCheckpoint, JobRecord,
    Leadership, LeaseGrant, ManifestOf, ManifestPage, MetaError, MetaResult, MetaStore, RetentionPolicy, Role,
    StoredDraft, StoredJobFile, TargetIds, TargetRecord, TierSweeps, fault,
};

#[async_trait]
impl MetaStore for SqlStore {
    async fn upsert_target(&self, registration: &TargetRegistration, now_ms: u64) -> MetaResult<()> {
        let mut tx = self.write().await?;
        sqlx::query(
            "INSERT INTO targets (target_id, data_address, capacity_bytes, used_bytes, registered_at_ms, last_heartbeat_ms,
                 failure_domain, rdma_device)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
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
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn heartbeat(&self, target_id: &str, capacity: u64, used: u64, chunks: u64, now_ms: u64) -> MetaResult<()> {
        let mut tx = self.write().await?;
        let result = sqlx::query(
            "UPDATE targets SET capacity_bytes = $1, used_bytes = $2, chunk_count = $3, last_heartbeat_ms = $4 WHERE target_id = $5",
        )
        .bind(to_i64(capacity, "capacity")?)
        .bind(to_i64(used, "used bytes")?)
        .bind(to_i64(chunks, "chunk count")?)
        .bind(to_i64(now_ms, "time")?)
        .bind(target_id)
        .execute(&mut *tx)
        .await?;
        if result.rows_affected() == 0 {
            return Err(MetaError::NotFound(format!("target {target_id} is not registered")));
        }
        tx.commit().await?;
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
        let mut tx = self.write().await?;
        let known: Option<i64> = sqlx::query_scalar("SELECT epoch FROM leases WHERE job = $1 AND run_id = $2")
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
        if let Some((current, holder)) = &current {
            let holder_started: i64 =
                sqlx::query_scalar("SELECT started_at_ms FROM leases WHERE job = $1 AND epoch = $2")
                    .bind(job)
                    .bind(to_i64(*current, "epoch")?)
                    .fetch_one(&mut *tx)
                    .await?;
            let started = to_i64(request.started_at_ms, "started_at_ms")?;
            if started > 0 && started < holder_started {
                return Err(MetaError::Fenced(format!(
                    "job {job}: run {:?} started (at {started} ms) before run {holder:?} (at {holder_started} ms), which \
                     holds the lease (epoch {current}); a process of a run that was replaced may no longer write",
                    request.run_id
                )));
            }
        }
        let epoch = current.map_or(1, |(current, _)| current + 1);
        let now = to_i64(now_ms, "time")?;
        sqlx::query(
            "INSERT INTO leases (job, run_id, epoch, acquired_at_ms, started_at_ms) VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(job)
        .bind(&request.run_id)
        .bind(to_i64(epoch, "epoch")?)
        .bind(now)
        .bind(to_i64(request.started_at_ms, "started_at_ms")?)
        .execute(&mut *tx)
        .await?;
        // The takeover and the abort of the older runs' half-written checkpoints are one transaction.
        let aborted = sqlx::query(
            "UPDATE checkpoints SET state = 'aborted', ended_at_ms = $1 WHERE job = $2 AND state = 'pending' AND epoch < $3",
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
        // Every rank but the first joins a checkpoint another began, which writes nothing: it is
        // answered from a read snapshot, not queued at the writer lock behind the job's other
        // ranks and every other writer of the cluster.
        if let Some(joined) = joinable(&mut self.read().await?, request).await? {
            return Ok(joined);
        }
        let step = to_i64(request.step, "step")?;
        let now = to_i64(now_ms, "time")?;
        let mut tx = self.write().await?;
        check_epoch(&mut tx, request.job.as_str(), request.epoch).await?;
        let live = sqlx::query(&format!(
            "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE job = $1 AND step = $2 AND state IN ('pending', 'committed')"
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
                _ if existing.epoch == request.epoch && !expired(&existing, request.begun_after_ms) => {
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
                    // one left over (from a database written before that rule) is aborted here,
                    // as is one past the pending timeout that the reaper has not got to yet.
                    sqlx::query("UPDATE checkpoints SET state = 'aborted', ended_at_ms = $1 WHERE id = $2")
                        .bind(now)
                        .bind(existing.id as i64)
                        .execute(&mut *tx)
                        .await?;
                }
            }
        }
        let row = sqlx::query(&format!(
            "INSERT INTO checkpoints (job, step, state, world_size, epoch, created_at_ms)
             VALUES ($1, $2, 'pending', $3, $4, $5) RETURNING {CHECKPOINT_COLUMNS}"
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

    async fn commit_part(
        &self,
        part: &CommitPart,
        now_ms: &(dyn Fn() -> u64 + Sync),
        pending_timeout_ms: u64,
    ) -> MetaResult<CheckpointRecord> {
        let id = to_i64(part.checkpoint_id, "checkpoint id")?;
        let mut tx = self.write().await?;
        // Read with the writer lock held: a commit that waited for it (behind other writers, or
        // another control plane's long transaction) is judged when it got it.
        let now_ms = now_ms();
        let begun_after_ms = now_ms.saturating_sub(pending_timeout_ms);
        let record = checkpoint_by_id(&mut tx, id).await?;
        // Another tenant's checkpoint is answered as one that does not exist: ids are sequential,
        // so anything else would tell a tenant which ids others use.
        let Some(record) = record.filter(|r| part.namespace.as_ref().is_none_or(|tenant| tenant.holds(&r.job))) else {
            return Err(MetaError::NotFound(format!("checkpoint {} does not exist", part.checkpoint_id)));
        };
        if part.rank >= record.world_size {
            return Err(MetaError::InvalidArgument(format!(
                "rank {} is outside world size {} of checkpoint {}",
                part.rank, record.world_size, record.id
            )));
        }
        let existing: Option<Vec<u8>> =
            sqlx::query_scalar("SELECT manifest FROM parts WHERE checkpoint_id = $1 AND rank = $2")
                .bind(id)
                .bind(part.rank as i64)
                .fetch_optional(&mut *tx)
                .await?;
        let ended = |record: &CheckpointRecord| {
            MetaError::FailedPrecondition(format!(
                "checkpoint {} ({} step {}) is {}; its parts can no longer be committed",
                record.id,
                record.job,
                record.step,
                record.state.as_str()
            ))
        };
        if let Some(blob) = existing {
            // The same content, its chunks placed elsewhere (a save retried after its answer was
            // lost), is the same part.
            if !decode_manifest(&blob, record.id, part.rank)?.same_content(&part.manifest) {
                // Two writers of one rank: a relaunch that reused its run id (so it joined the
                // preempted launch's checkpoint), or a step saved twice. Its parts are not of one
                // launch: aborted before the last part could commit it mixed.
                let aborted = record.state == CheckpointState::Pending;
                if aborted {
                    check_epoch(&mut tx, &record.job, record.epoch).await?;
                    abort_in(tx, id, now_ms).await?;
                }
                return Err(MetaError::FailedPrecondition(format!(
                    "rank {} of checkpoint {} ({} step {}) already committed a different manifest: two writers \
                     saved this rank (a relaunch reusing the run id of the one before? each launch needs its own){}",
                    part.rank,
                    record.id,
                    record.job,
                    record.step,
                    if aborted { "; the checkpoint is aborted" } else { "" }
                )));
            }
            // Sent again (its answer was lost): answered as the first while the checkpoint lives,
            // and with its state once it was committed and then deleted (by retention, or `rm`):
            // the part is in, and the writer hears what became of it. One aborted since is no save
            // waiting for ranks: the writer hears why.
            if matches!(record.state, CheckpointState::Pending | CheckpointState::Committed | CheckpointState::Deleted)
            {
                return Ok(record);
            }
            check_epoch(&mut tx, &record.job, record.epoch).await?;
            return Err(ended(&record));
        }
        // A tenant's chunks are addressed with its current key, or they could deduplicate
        // against other tenants' (starckpt_proto::address).
        let job = JobName::try_from(record.job.as_str()).map_err(|e| MetaError::Corrupt(e.to_string()))?;
        let wanted = Addressing::of_job(part.cluster_key.as_ref(), &job);
        if part.manifest.addressing != wanted {
            let addressed = |addressing: &Addressing| match addressing.is_keyed() {
                true => "with a tenant's key",
                false => "by plain BLAKE3",
            };
            let which = match (wanted.is_keyed(), job.tenant()) {
                (true, Some(tenant)) if part.manifest.addressing.is_keyed() => {
                    format!("with tenant {tenant}'s current key, not another")
                }
                (true, Some(tenant)) => format!("with tenant {tenant}'s key"),
                _ => addressed(&wanted).to_owned(),
            };
            return Err(MetaError::InvalidArgument(format!(
                "rank {}'s manifest addresses its chunks {}, and job {}'s are addressed {which} \
                 (a client older than the control plane? upgrade it)",
                part.rank,
                addressed(&part.manifest.addressing),
                record.job,
            )));
        }
        check_epoch(&mut tx, &record.job, record.epoch).await?;
        if record.state != CheckpointState::Pending {
            return Err(ended(&record));
        }
        if expired(&record, begun_after_ms) {
            abort_in(tx, id, now_ms).await?;
            return Err(MetaError::FailedPrecondition(format!(
                "checkpoint {} ({} step {}) was begun {} s ago, past the pending timeout; it is aborted (save again)",
                record.id,
                record.job,
                record.step,
                now_ms.saturating_sub(record.created_at_ms) / 1000
            )));
        }
        // Parts whose files overlap could all be committed, and the checkpoint never restored.
        // The part alone is checked now; with the last part, all of them, and a conflict then
        // aborts the checkpoint (the parts committed before cannot change).
        let overlap = |e: starckpt_proto::model::ModelError| {
            format!("rank {} of checkpoint {} ({} step {}): {e}", part.rank, record.id, record.job, record.step)
        };
        check_disjoint([(part.rank, &part.manifest)]).map_err(|e| MetaError::InvalidArgument(overlap(e)))?;
        if record.parts_committed + 1 == record.world_size {
            let others = part_manifests(&mut tx, record.id).await?;
            let all = others.iter().map(|(rank, manifest)| (*rank, manifest)).chain([(part.rank, &part.manifest)]);
            if let Err(error) = check_disjoint(all) {
                abort_in(tx, id, now_ms).await?;
                return Err(MetaError::InvalidArgument(format!(
                    "{}; the checkpoint can never be restored and is aborted (ranks must save disjoint files)",
                    overlap(error)
                )));
            }
        }
        let blob = pb::Manifest::from(&part.manifest).encode_to_vec();
        let stored: i64 = sqlx::query_scalar(
            "SELECT CAST(COALESCE(SUM(LENGTH(manifest)), 0) AS BIGINT) FROM parts WHERE checkpoint_id = $1",
        )
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
        let (total_bytes, file_count) =
            insert_part(&mut tx, id, part.rank, blob, &part.manifest, part.written_bytes, now_ms).await?;
        let written_bytes = to_i64(part.written_bytes, "written bytes")?;
        let now = to_i64(now_ms, "time")?;
        // The commit transition happens in the same transaction as the last part's insertion.
        sqlx::query(
            "UPDATE checkpoints SET parts_committed = parts_committed + 1, total_bytes = total_bytes + $1,
                 written_bytes = written_bytes + $2, file_count = file_count + $3,
                 state = CASE WHEN parts_committed + 1 = world_size THEN 'committed' ELSE state END,
                 committed_at_ms = CASE WHEN parts_committed + 1 = world_size THEN $4 ELSE committed_at_ms END
             WHERE id = $5",
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
            "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE job = $1 AND state = 'committed' ORDER BY step DESC LIMIT 1"
        ))
        .bind(job.as_str())
        .fetch_optional(&self.reader)
        .await?;
        row.as_ref().map(checkpoint_from_row).transpose()
    }

    async fn list_jobs(&self) -> MetaResult<Vec<JobRecord>> {
        let rows = sqlx::query(
            "SELECT job,
                    CAST(SUM(CASE WHEN state = 'committed' THEN 1 ELSE 0 END) AS BIGINT) AS committed,
                    MAX(CASE WHEN state = 'committed' THEN step END) AS latest_step,
                    CAST(SUM(CASE WHEN state = 'committed' THEN total_bytes ELSE 0 END) AS BIGINT) AS committed_bytes
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
            "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE job = $1 {filter} ORDER BY step, id"
        ))
        .bind(job.as_str())
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(checkpoint_from_row).collect()
    }

    async fn get_manifest_page(
        &self,
        job: &JobName,
        of: ManifestOf,
        from_rank: u32,
        max_bytes: usize,
    ) -> MetaResult<ManifestPage> {
        // One read transaction, so the checkpoint and its parts come from the same snapshot.
        let mut tx = self.read().await?;
        let committed = format!("SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE job = $1 AND state = 'committed'");
        let row = match of {
            ManifestOf::Step(Some(step)) => {
                sqlx::query(&format!("{committed} AND step = $2"))
                    .bind(job.as_str())
                    .bind(to_i64(step, "step")?)
                    .fetch_optional(&mut *tx)
                    .await?
            }
            ManifestOf::Step(None) => {
                sqlx::query(&format!("{committed} ORDER BY step DESC LIMIT 1"))
                    .bind(job.as_str())
                    .fetch_optional(&mut *tx)
                    .await?
            }
            ManifestOf::Checkpoint(id) => {
                sqlx::query(&format!("{committed} AND id = $2"))
                    .bind(job.as_str())
                    .bind(to_i64(id, "checkpoint id")?)
                    .fetch_optional(&mut *tx)
                    .await?
            }
        };
        let Some(row) = row else {
            return Err(MetaError::NotFound(match of {
                ManifestOf::Step(Some(step)) => format!("job {job} has no committed checkpoint at step {step}"),
                ManifestOf::Step(None) => format!("job {job} has no committed checkpoint"),
                ManifestOf::Checkpoint(id) => format!("checkpoint {id} of job {job} is no longer committed"),
            }));
        };
        let record = checkpoint_from_row(&row)?;
        if from_rank >= record.world_size {
            return Err(MetaError::InvalidArgument(format!(
                "rank {from_rank} is outside checkpoint {}'s world size {}",
                record.id, record.world_size
            )));
        }
        let (parts, next_rank) = part_manifests_from(&mut tx, record.id, from_rank, max_bytes).await?;
        let expected = from_rank..next_rank.unwrap_or(record.world_size);
        if !parts.iter().map(|(rank, _)| *rank).eq(expected.clone()) {
            return Err(MetaError::Corrupt(format!(
                "committed checkpoint {} of world size {} lacks a part of ranks {expected:?}",
                record.id, record.world_size
            )));
        }
        Ok(ManifestPage { record, parts, next_rank })
    }

    async fn abort_stale_pending(&self, created_before_ms: u64, now_ms: u64) -> MetaResult<Vec<CheckpointRecord>> {
        let mut tx = self.write().await?;
        let rows = sqlx::query(&format!(
            "UPDATE checkpoints SET state = 'aborted', ended_at_ms = $1
             WHERE state = 'pending' AND created_at_ms < $2 RETURNING {CHECKPOINT_COLUMNS}"
        ))
        .bind(to_i64(now_ms, "time")?)
        .bind(to_i64(created_before_ms, "time")?)
        .fetch_all(&mut *tx)
        .await?;
        let aborted = rows.iter().map(checkpoint_from_row).collect::<MetaResult<_>>()?;
        tx.commit().await?;
        Ok(aborted)
    }

    async fn delete_checkpoint(&self, job: &JobName, step: u64, only: Option<u64>, now_ms: u64) -> MetaResult<()> {
        let mut tx = self.write().await?;
        let result = sqlx::query(
            "UPDATE checkpoints SET state = CASE WHEN state = 'committed' THEN 'deleted' ELSE 'aborted' END, ended_at_ms = $1
             WHERE job = $2 AND step = $3 AND state IN ('pending', 'committed') AND ($4 = 0 OR id = $4)",
        )
        .bind(to_i64(now_ms, "time")?)
        .bind(job.as_str())
        .bind(to_i64(step, "step")?)
        .bind(to_i64(only.unwrap_or(0), "checkpoint id")?)
        .execute(&mut *tx)
        .await?;
        if result.rows_affected() == 0 {
            let which = only.map_or(String::new(), |id| format!(" (checkpoint {id})"));
            return Err(MetaError::NotFound(format!("job {job} has no checkpoint at step {step}{which}")));
        }
        tx.commit().await?;
        Ok(())
    }

    async fn abort_pending(&self, job: &JobName, id: u64, now_ms: u64) -> MetaResult<()> {
        let mut tx = self.write().await?;
        let id = to_i64(id, "checkpoint id")?;
        let state: Option<String> = sqlx::query_scalar(
            "UPDATE checkpoints SET state = CASE WHEN state = 'pending' THEN 'aborted' ELSE state END,
                 ended_at_ms = CASE WHEN state = 'pending' THEN $1 ELSE ended_at_ms END
             WHERE id = $2 AND job = $3 RETURNING state",
        )
        .bind(to_i64(now_ms, "time")?)
        .bind(id)
        .bind(job.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        match state.as_deref() {
            None => Err(MetaError::NotFound(format!("job {job} has no checkpoint {id}"))),
            Some("aborted") => Ok(()),
            Some(state) => {
                Err(MetaError::FailedPrecondition(format!("checkpoint {id} of job {job} is {state}, not pending")))
            }
        }
    }

    async fn set_retention(&self, job: &JobName, policy: RetentionPolicy, now_ms: u64) -> MetaResult<Vec<u64>> {
        let mut tx = self.write().await?;
        sqlx::query(
            "INSERT INTO retention (job, keep_last, keep_every, updated_at_ms) VALUES ($1, $2, $3, $4)
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
        let mut tx = self.read().await?;
        retention_policy(&mut tx, job.as_str()).await
    }

    async fn set_replication(&self, job: &JobName, replicas: u32, now_ms: u64) -> MetaResult<()> {
        if !(1..=starckpt_proto::model::MAX_REPLICAS).contains(&replicas) {
            return Err(MetaError::InvalidArgument(format!(
                "replication factor {replicas} is outside 1..={}",
                starckpt_proto::model::MAX_REPLICAS
            )));
        }
        let mut tx = self.write().await?;
        sqlx::query(
            "INSERT INTO replication (job, replicas, updated_at_ms) VALUES ($1, $2, $3)
             ON CONFLICT (job) DO UPDATE SET replicas = excluded.replicas, updated_at_ms = excluded.updated_at_ms",
        )
        .bind(job.as_str())
        .bind(i64::from(replicas))
        .bind(to_i64(now_ms, "time")?)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn replication(&self, job: &JobName) -> MetaResult<Option<u32>> {
        let replicas: Option<i64> = sqlx::query_scalar("SELECT replicas FROM replication WHERE job = $1")
            .bind(job.as_str())
            .fetch_optional(&self.reader)
            .await?;
        replicas
            .map(|r| u32::try_from(r).map_err(|_| MetaError::Corrupt(format!("replication factor {r}"))))
            .transpose()
    }

    async fn tag_checkpoint(&self, job: &JobName, step: u64, tag: &str, remove: bool) -> MetaResult<()> {
        starckpt_proto::model::validate_tag(tag).map_err(|e| MetaError::InvalidArgument(e.to_string()))?;
        let mut tx = self.write().await?;
        // Removing a tag is sent again when its answer is lost, and the first removal may have let
        // retention delete the checkpoint: removing the tags of a step deleted since is done.
        let states = if remove { "('committed', 'deleted')" } else { "('committed')" };
        let found = sqlx::query(&format!(
            "SELECT id, state FROM checkpoints WHERE job = $1 AND step = $2 AND state IN {states} ORDER BY id DESC LIMIT 1"
        ))
        .bind(job.as_str())
        .bind(to_i64(step, "step")?)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(found) = found else {
            return Err(MetaError::NotFound(format!("job {job} has no committed checkpoint at step {step}")));
        };
        let id: i64 = found.try_get("id")?;
        if found.try_get::<String, _>("state")? == "deleted" {
            return Ok(());
        }
        let statement = if remove {
            "DELETE FROM tags WHERE checkpoint_id = $1 AND tag = $2"
        } else {
            "INSERT INTO tags (checkpoint_id, tag) VALUES ($1, $2) ON CONFLICT DO NOTHING"
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
        let mut tx = self.read().await?;
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
        drop(rows);
        super::drafts::mark_draft_chunks(&mut tx, &mut live).await?;
        super::job_files::mark_job_file_chunks(&mut tx, &mut live).await?;
        Ok(live)
    }

    async fn put_job_file(&self, job: &JobName, name: &str, manifest: &Manifest, now_ms: u64) -> MetaResult<()> {
        self.put_job_file_row(job, name, manifest, now_ms).await
    }

    async fn job_files(&self, job: &JobName) -> MetaResult<Vec<StoredJobFile>> {
        self.job_file_rows(job).await
    }

    async fn get_job_file(&self, job: &JobName, name: &str) -> MetaResult<Option<(StoredJobFile, Manifest)>> {
        self.job_file_row(job, name).await
    }

    async fn drop_job_file(&self, job: &JobName, name: &str) -> MetaResult<bool> {
        self.drop_job_file_row(job, name).await
    }

    async fn put_draft(&self, draft: &DraftKey, manifest: &Manifest, now_ms: u64) -> MetaResult<()> {
        self.put_draft_row(draft, manifest, now_ms).await
    }

    async fn drafts_of(&self, writer: &str) -> MetaResult<Vec<StoredDraft>> {
        self.drafts_of_writer(writer).await
    }

    async fn drafts_named(&self, job: &JobName, name: &str) -> MetaResult<Vec<StoredDraft>> {
        self.drafts_named_rows(job, name).await
    }

    async fn get_draft(&self, draft: &DraftKey) -> MetaResult<Option<(StoredDraft, Manifest)>> {
        self.draft_row(draft).await
    }

    async fn drop_draft(&self, draft: &DraftKey) -> MetaResult<bool> {
        self.drop_draft_row(draft).await
    }

    async fn expire_drafts(&self, updated_before_ms: u64) -> MetaResult<Vec<StoredDraft>> {
        self.expire_draft_rows(updated_before_ms).await
    }

    async fn committed_chunks(&self, default_replicas: u32) -> MetaResult<HashMap<ChunkHash, CommittedChunk>> {
        let mut tx = self.read().await?;
        let mut rows = sqlx::query(
            "SELECT p.checkpoint_id, p.rank, p.manifest, r.replicas FROM parts p
             JOIN checkpoints c ON c.id = p.checkpoint_id LEFT JOIN replication r ON r.job = c.job
             WHERE c.state = 'committed'",
        )
        .fetch(&mut *tx);
        let mut chunks: HashMap<ChunkHash, CommittedChunk> = HashMap::new();
        let mut ids = TargetIds::default();
        while let Some(row) = rows.try_next().await? {
            let (id, rank) = (get_u64(&row, "checkpoint_id")?, get_u64(&row, "rank")? as u32);
            let replicas: Option<i64> = row.try_get("replicas")?;
            let wanted = replicas.map_or(default_replicas, |r| u32::try_from(r).unwrap_or(default_replicas));
            let blob: Vec<u8> = row.try_get("manifest")?;
            CommittedChunk::index(&mut chunks, &decode_manifest(&blob, id, rank)?, wanted, &mut ids);
        }
        Ok(chunks)
    }

    async fn untiered_checkpoints(&self) -> MetaResult<Vec<CheckpointRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE state = 'committed'
             AND NOT EXISTS (SELECT 1 FROM tiered WHERE tiered.checkpoint_id = checkpoints.id)
             ORDER BY committed_at_ms, id"
        ))
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(checkpoint_from_row).collect()
    }

    async fn mark_tiered(&self, id: u64, now_ms: u64, fence: u64) -> MetaResult<bool> {
        let mut tx = self.write().await?;
        if tier_sweeps(&mut tx).await?.fence() != Some(fence) {
            return Ok(false);
        }
        sqlx::query("INSERT INTO tiered (checkpoint_id, tiered_at_ms) VALUES ($1, $2) ON CONFLICT DO NOTHING")
            .bind(to_i64(id, "checkpoint id")?)
            .bind(to_i64(now_ms, "time")?)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn tiered_gone(&self) -> MetaResult<Vec<u64>> {
        let ids: Vec<i64> = sqlx::query_scalar(
            "SELECT t.checkpoint_id FROM tiered t JOIN checkpoints c ON c.id = t.checkpoint_id
             WHERE c.state <> 'committed' ORDER BY t.checkpoint_id",
        )
        .fetch_all(&self.reader)
        .await?;
        Ok(ids.into_iter().map(|id| id.max(0) as u64).collect())
    }

    async fn forget_tiered(&self, ids: &[u64]) -> MetaResult<()> {
        let mut tx = self.write().await?;
        for &id in ids {
            sqlx::query(
                "DELETE FROM tiered WHERE checkpoint_id = $1 AND checkpoint_id NOT IN
                         (SELECT id FROM checkpoints WHERE state = 'committed')",
            )
            .bind(to_i64(id, "checkpoint id")?)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn tier_sweeps(&self) -> MetaResult<TierSweeps> {
        tier_sweeps(&mut self.read().await?).await
    }

    async fn begin_tier_sweep(&self) -> MetaResult<u64> {
        let mut tx = self.write().await?;
        let started: i64 = sqlx::query_scalar(
            "INSERT INTO tier_sweeps (id, started, finished) VALUES (1, 1, 0)
             ON CONFLICT (id) DO UPDATE SET started = tier_sweeps.started + 1 RETURNING started",
        )
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        u64::try_from(started).map_err(|_| MetaError::Corrupt(format!("tier sweep {started}")))
    }

    async fn join_control_planes(
        &self,
        member: &ControlPlaneMember,
        now_ms: u64,
        live_since_ms: u64,
        refuse: bool,
    ) -> MetaResult<Option<String>> {
        const FORGET_AFTER_MS: u64 = 24 * 3600 * 1000;
        let mut tx = self.write().await?;
        sqlx::query("DELETE FROM control_planes WHERE seen_at_ms < $1")
            .bind(to_i64(now_ms.saturating_sub(FORGET_AFTER_MS), "time")?)
            .execute(&mut *tx)
            .await?;
        // This control plane's earlier runs (same listener, other ids): gone, since it listens there.
        sqlx::query("DELETE FROM control_planes WHERE id <> $1 AND substr(id, 1, length($2)) = $2")
            .bind(&member.id)
            .bind(format!("{}/", member.listener))
            .execute(&mut *tx)
            .await?;
        let other = sqlx::query(
            "SELECT id, pending_timeout_ms, gc_grace_ms, seen_at_ms, security, tier FROM control_planes
             WHERE id <> $1 AND seen_at_ms >= $2 AND (pending_timeout_ms <> $3 OR gc_grace_ms <> $4
                 OR (security <> $5 AND security <> '' AND $5 <> '')
                 OR (tier <> $6 AND tier <> '' AND $6 <> ''))
             ORDER BY seen_at_ms DESC LIMIT 1",
        )
        .bind(&member.id)
        .bind(to_i64(live_since_ms, "time")?)
        .bind(to_i64(member.pending_timeout_ms, "pending timeout")?)
        .bind(to_i64(member.gc_grace_ms, "GC grace")?)
        .bind(&member.security)
        .bind(&member.tier)
        .fetch_optional(&mut *tx)
        .await?;
        let conflict = match other {
            None => None,
            Some(row) => {
                let id: String = row.try_get("id")?;
                let security: String = row.try_get("security")?;
                let (pending, grace) = (get_u64(&row, "pending_timeout_ms")?, get_u64(&row, "gc_grace_ms")?);
                let mut differences = Vec::new();
                if (pending, grace) != (member.pending_timeout_ms, member.gc_grace_ms) {
                    differences.push(format!(
                        "it has a pending timeout of {} s and a GC grace of {} s, this one {} s and {} s \
                         (--pending-timeout-secs, --gc-grace-secs)",
                        pending / 1000,
                        grace / 1000,
                        member.pending_timeout_ms / 1000,
                        member.gc_grace_ms / 1000,
                    ));
                }
                if !security.is_empty() && !member.security.is_empty() && security != member.security {
                    differences.push(format!(
                        "it runs with {security}, this one with {} (--cluster-key-file, --tokens-file, --tls-cert)",
                        member.security
                    ));
                }
                let tier: String = row.try_get("tier")?;
                if !tier.is_empty() && !member.tier.is_empty() && tier != member.tier {
                    differences.push(format!("it uses {tier}, this one {} (--tier)", member.tier));
                }
                Some(format!(
                    "control plane {id} (seen {} s ago) serves this database, and control planes sharing a \
                     database must agree: {}",
                    now_ms.saturating_sub(get_u64(&row, "seen_at_ms")?) / 1000,
                    differences.join("; "),
                ))
            }
        };
        if refuse && conflict.is_some() {
            return Ok(conflict);
        }
        sqlx::query(
            "INSERT INTO control_planes (id, pending_timeout_ms, gc_grace_ms, seen_at_ms, security, tier)
             VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (id) DO UPDATE SET pending_timeout_ms = excluded.pending_timeout_ms,
                 gc_grace_ms = excluded.gc_grace_ms, seen_at_ms = excluded.seen_at_ms, security = excluded.security,
                 tier = excluded.tier",
        )
        .bind(&member.id)
        .bind(to_i64(member.pending_timeout_ms, "pending timeout")?)
        .bind(to_i64(member.gc_grace_ms, "GC grace")?)
        .bind(to_i64(now_ms, "time")?)
        .bind(&member.security)
        .bind(&member.tier)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(conflict)
    }

    async fn import_checkpoint(
        &self,
        checkpoint: &ImportedCheckpoint,
        now_ms: u64,
        fence: u64,
    ) -> MetaResult<Option<CheckpointRecord>> {
        let world_size = u32::try_from(checkpoint.parts.len())
            .ok()
            .filter(|n| (1..=starckpt_proto::model::MAX_WORLD_SIZE).contains(n))
            .ok_or_else(|| MetaError::InvalidArgument(format!("{} ranks", checkpoint.parts.len())))?;
        let blobs: Vec<Vec<u8>> = checkpoint.parts.iter().map(|m| pb::Manifest::from(m).encode_to_vec()).collect();
        let manifest_total: u64 = blobs.iter().map(|b| b.len() as u64).sum();
        if manifest_total > starckpt_proto::model::MAX_CHECKPOINT_MANIFEST_BYTES {
            return Err(MetaError::InvalidArgument(format!("manifest of {manifest_total} bytes")));
        }
        let step = to_i64(checkpoint.step, "step")?;
        let mut tx = self.write().await?;
        if tier_sweeps(&mut tx).await?.fence() != Some(fence) {
            return Err(MetaError::FailedPrecondition(format!(
                "{} step {}: a sweep of the tier began after the tier was read (it may delete chunks \
                 this checkpoint needs); import again once it finishes",
                checkpoint.job, checkpoint.step
            )));
        }
        let live: Option<i64> = sqlx::query_scalar(
            "SELECT id FROM checkpoints WHERE job = $1 AND step = $2 AND state IN ('pending', 'committed')",
        )
        .bind(checkpoint.job.as_str())
        .bind(step)
        .fetch_optional(&mut *tx)
        .await?;
        if live.is_some() {
            return Ok(None);
        }
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO checkpoints (job, step, state, world_size, epoch, written_bytes, created_at_ms, committed_at_ms)
             VALUES ($1, $2, 'committed', $3, $4, $5, $6, $7) RETURNING id",
        )
        .bind(checkpoint.job.as_str())
        .bind(step)
        .bind(world_size as i64)
        .bind(to_i64(checkpoint.epoch, "epoch")?)
        .bind(to_i64(checkpoint.written_bytes, "written bytes")?)
        .bind(to_i64(checkpoint.created_at_ms, "time")?)
        .bind(to_i64(checkpoint.committed_at_ms, "time")?)
        .fetch_one(&mut *tx)
        .await?;
        let (mut total_bytes, mut file_count) = (0, 0);
        for ((rank, manifest), blob) in checkpoint.parts.iter().enumerate().zip(blobs) {
            let (bytes, files) = insert_part(&mut tx, id, rank as u32, blob, manifest, 0, now_ms).await?;
            total_bytes += bytes;
            file_count += files;
        }
        sqlx::query(
            "UPDATE checkpoints SET parts_committed = world_size, total_bytes = $1, file_count = $2 WHERE id = $3",
        )
        .bind(total_bytes)
        .bind(file_count)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        let record =
            checkpoint_by_id(&mut tx, id).await?.ok_or_else(|| MetaError::Corrupt("import vanished".into()))?;
        tx.commit().await?;
        Ok(Some(record))
    }

    async fn leave_control_planes(&self, id: &str) -> MetaResult<()> {
        let mut tx = self.write().await?;
        sqlx::query("DELETE FROM control_planes WHERE id = $1").bind(id).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn database_clock_ms(&self) -> MetaResult<Option<u64>> {
        if self.dialect != Dialect::Postgres {
            return Ok(None);
        }
        let clock: i64 = sqlx::query_scalar("SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)")
            .fetch_one(&self.reader)
            .await?;
        Ok(Some(clock.max(0) as u64))
    }

    async fn finish_tier_sweep(&self, sweep: u64) -> MetaResult<()> {
        let mut tx = self.write().await?;
        sqlx::query("UPDATE tier_sweeps SET finished = $1 WHERE id = 1 AND finished < $1")
            .bind(to_i64(sweep, "sweep")?)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn record_repair_pass(&self, finished_at_ms: u64, still_under_replicated: u64) -> MetaResult<()> {
        let mut tx = self.write().await?;
        sqlx::query(
            "INSERT INTO repair_passes (id, finished_at_ms, still_under_replicated) VALUES (1, $1, $2)
             ON CONFLICT (id) DO UPDATE SET finished_at_ms = excluded.finished_at_ms,
                 still_under_replicated = excluded.still_under_replicated
             WHERE repair_passes.finished_at_ms <= excluded.finished_at_ms",
        )
        .bind(to_i64(finished_at_ms, "time")?)
        .bind(to_i64(still_under_replicated, "chunk count")?)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn last_repair_pass(&self) -> MetaResult<Option<(u64, u64)>> {
        let mut tx = self.read().await?;
        let row = sqlx::query("SELECT finished_at_ms, still_under_replicated FROM repair_passes WHERE id = 1")
            .fetch_optional(&mut *tx)
            .await?;
        row.map(|row| Ok((get_u64(&row, "finished_at_ms")?, get_u64(&row, "still_under_replicated")?))).transpose()
    }

    async fn try_lead(&self, role: Role) -> MetaResult<Option<Leadership>> {
        match self.dialect {
            // One control plane per SQLite file: it leads.
            Dialect::Sqlite => Ok(Some(Leadership(Box::new(role)))),
            Dialect::Postgres => {
                // A session lock on a connection of its own, out of the pool: it is released when
                // the guard drops the connection, or when PostgreSQL sees this process gone.
                let mut connection = self.reader.acquire().await?.detach();
                let taken: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                    .bind(role_lock(role))
                    .fetch_one(&mut connection)
                    .await?;
                Ok(taken.then(|| Leadership(Box::new(std::sync::Mutex::new(connection)))))
            }
        }
    }
}
