//! Drafts' records ([`MetaStore::put_draft`] and the rest) as SQL.

use futures::TryStreamExt;
use prost::Message;
use sqlx::Row;
use sqlx::any::AnyRow;
use starckpt_proto::control as pb;
use starckpt_proto::draft::{MAX_DRAFTS_PER_JOB, MAX_DRAFTS_PER_WRITER};
use starckpt_proto::model::Manifest;
use starckpt_proto::{ChunkHash, JobName};

use super::SqlStore;
use super::queries::{get_u64, to_i64};
use crate::control::store::{DraftKey, MetaError, MetaResult, StoredDraft};

const COLUMNS: &str = "job, name, writer, file_count, total_bytes, updated_at_ms";

fn draft_from_row(row: &AnyRow) -> MetaResult<StoredDraft> {
    let job: String = row.try_get("job")?;
    Ok(StoredDraft {
        key: DraftKey {
            job: JobName::try_from(job.as_str())
                .map_err(|e| MetaError::Corrupt(format!("draft of job {job:?}: {e}")))?,
            name: row.try_get("name")?,
            writer: row.try_get("writer")?,
        },
        file_count: get_u64(row, "file_count")?,
        total_bytes: get_u64(row, "total_bytes")?,
        updated_at_ms: get_u64(row, "updated_at_ms")?,
    })
}

fn decode(blob: &[u8], key: &DraftKey) -> MetaResult<Manifest> {
    decode_record(blob, || format!("draft {} of job {} by {}", key.name, key.job, key.writer))
}

/// A manifest stored as a record's blob (a draft's, a job file's), validated; `what` names the
/// record in the error.
pub(super) fn decode_record(blob: &[u8], what: impl Fn() -> String) -> MetaResult<Manifest> {
    let corrupt = |e: String| MetaError::Corrupt(format!("{}: {e}", what()));
    let message = pb::Manifest::decode(blob).map_err(|e| corrupt(e.to_string()))?;
    Manifest::try_from(message).map_err(|e| corrupt(e.to_string()))
}

impl SqlStore {
    pub(super) async fn put_draft_row(&self, draft: &DraftKey, manifest: &Manifest, now_ms: u64) -> MetaResult<()> {
        let blob = pb::Manifest::from(manifest).encode_to_vec();
        let mut tx = self.write().await?;
        let exists: Option<i64> =
            sqlx::query_scalar("SELECT 1 FROM drafts WHERE job = $1 AND name = $2 AND writer = $3")
                .bind(draft.job.as_str())
                .bind(&draft.name)
                .bind(&draft.writer)
                .fetch_optional(&mut *tx)
                .await?;
        if exists.is_none() {
            let of_job: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM drafts WHERE job = $1")
                .bind(draft.job.as_str())
                .fetch_one(&mut *tx)
                .await?;
            if of_job as u64 >= MAX_DRAFTS_PER_JOB {
                return Err(MetaError::ResourceExhausted(format!(
                    "job {} has {of_job} drafts recorded, the most it may have: commit or remove some",
                    draft.job
                )));
            }
            let of_writer: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM drafts WHERE writer = $1")
                .bind(&draft.writer)
                .fetch_one(&mut *tx)
                .await?;
            if of_writer as u64 >= MAX_DRAFTS_PER_WRITER {
                return Err(MetaError::ResourceExhausted(format!(
                    "writer {} has {of_writer} drafts recorded, the most it may have: commit or remove some",
                    draft.writer
                )));
            }
        }
        sqlx::query(
            "INSERT INTO drafts (job, name, writer, manifest, file_count, total_bytes, updated_at_ms)
             VALUES ($1, $2, $3, $4, $5, $6, $7)
             ON CONFLICT (job, name, writer) DO UPDATE SET manifest = excluded.manifest,
                 file_count = excluded.file_count, total_bytes = excluded.total_bytes,
                 updated_at_ms = excluded.updated_at_ms",
        )
        .bind(draft.job.as_str())
        .bind(&draft.name)
        .bind(&draft.writer)
        .bind(blob)
        .bind(to_i64(manifest.files.len() as u64, "file count")?)
        .bind(to_i64(manifest.total_bytes(), "bytes")?)
        .bind(to_i64(now_ms, "time")?)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    pub(super) async fn drafts_of_writer(&self, writer: &str) -> MetaResult<Vec<StoredDraft>> {
        let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM drafts WHERE writer = $1 ORDER BY job, name"))
            .bind(writer)
            .fetch_all(&self.reader)
            .await?;
        rows.iter().map(draft_from_row).collect()
    }

    pub(super) async fn drafts_named_rows(&self, job: &JobName, name: &str) -> MetaResult<Vec<StoredDraft>> {
        let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM drafts WHERE job = $1 AND name = $2 ORDER BY writer"))
            .bind(job.as_str())
            .bind(name)
            .fetch_all(&self.reader)
            .await?;
        rows.iter().map(draft_from_row).collect()
    }

    pub(super) async fn draft_row(&self, draft: &DraftKey) -> MetaResult<Option<(StoredDraft, Manifest)>> {
        let row = sqlx::query(&format!(
            "SELECT {COLUMNS}, manifest FROM drafts WHERE job = $1 AND name = $2 AND writer = $3"
        ))
        .bind(draft.job.as_str())
        .bind(&draft.name)
        .bind(&draft.writer)
        .fetch_optional(&self.reader)
        .await?;
        let Some(row) = row else { return Ok(None) };
        let stored = draft_from_row(&row)?;
        let blob: Vec<u8> = row.try_get("manifest")?;
        let manifest = decode(&blob, &stored.key)?;
        Ok(Some((stored, manifest)))
    }

    pub(super) async fn drop_draft_row(&self, draft: &DraftKey) -> MetaResult<bool> {
        let mut tx = self.write().await?;
        let done = sqlx::query("DELETE FROM drafts WHERE job = $1 AND name = $2 AND writer = $3")
            .bind(draft.job.as_str())
            .bind(&draft.name)
            .bind(&draft.writer)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected() > 0)
    }

    pub(super) async fn expire_draft_rows(&self, updated_before_ms: u64) -> MetaResult<Vec<StoredDraft>> {
        let before = to_i64(updated_before_ms, "time")?;
        let mut tx = self.write().await?;
        let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM drafts WHERE updated_at_ms < $1"))
            .bind(before)
            .fetch_all(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM drafts WHERE updated_at_ms < $1").bind(before).execute(&mut *tx).await?;
        tx.commit().await?;
        rows.iter().map(draft_from_row).collect()
    }
}

/// Adds every chunk the drafts' records name to `live`, in the read transaction `tx` (GC's mark).
pub(super) async fn mark_draft_chunks(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    live: &mut std::collections::HashSet<ChunkHash>,
) -> MetaResult<()> {
    let statement = format!("SELECT {COLUMNS}, manifest FROM drafts");
    let mut rows = sqlx::query(&statement).fetch(&mut **tx);
    while let Some(row) = rows.try_next().await? {
        let stored = draft_from_row(&row)?;
        let blob: Vec<u8> = row.try_get("manifest")?;
        let manifest = decode(&blob, &stored.key)?;
        live.extend(manifest.files.iter().flat_map(|f| f.chunks.iter()).map(|c| c.hash));
    }
    Ok(())
}
