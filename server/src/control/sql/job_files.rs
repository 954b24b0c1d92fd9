//! Job files ([`MetaStore::put_job_file`] and the rest) as SQL.
//!
//! [`MetaStore::put_job_file`]: crate::control::store::MetaStore::put_job_file

use futures::TryStreamExt;
use prost::Message;
use sqlx::Row;
use sqlx::any::AnyRow;
use starckpt_proto::control as pb;
use starckpt_proto::draft::MAX_JOB_FILES_PER_JOB;
use starckpt_proto::model::Manifest;
use starckpt_proto::{ChunkHash, JobName};

use super::SqlStore;
use super::drafts::decode_record;
use super::queries::{get_u64, to_i64};
use crate::control::store::{MetaError, MetaResult, StoredJobFile};

const COLUMNS: &str = "name, size_bytes, updated_at_ms";

fn job_file_from_row(row: &AnyRow) -> MetaResult<StoredJobFile> {
    Ok(StoredJobFile {
        name: row.try_get("name")?,
        size_bytes: get_u64(row, "size_bytes")?,
        updated_at_ms: get_u64(row, "updated_at_ms")?,
    })
}

impl SqlStore {
    pub(super) async fn put_job_file_row(
        &self,
        job: &JobName,
        name: &str,
        manifest: &Manifest,
        now_ms: u64,
    ) -> MetaResult<()> {
        let blob = pb::Manifest::from(manifest).encode_to_vec();
        let mut tx = self.write().await?;
        let exists: Option<i64> = sqlx::query_scalar("SELECT 1 FROM job_files WHERE job = $1 AND name = $2")
            .bind(job.as_str())
            .bind(name)
            .fetch_optional(&mut *tx)
            .await?;
        if exists.is_none() {
            let of_job: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM job_files WHERE job = $1")
                .bind(job.as_str())
                .fetch_one(&mut *tx)
                .await?;
            if of_job as u64 >= MAX_JOB_FILES_PER_JOB {
                return Err(MetaError::ResourceExhausted(format!(
                    "job {job} has {of_job} job files, the most it may have: remove some"
                )));
            }
        }
        sqlx::query(
            "INSERT INTO job_files (job, name, manifest, size_bytes, updated_at_ms) VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (job, name) DO UPDATE SET manifest = excluded.manifest,
                 size_bytes = excluded.size_bytes, updated_at_ms = excluded.updated_at_ms",
        )
        .bind(job.as_str())
        .bind(name)
        .bind(blob)
        .bind(to_i64(manifest.total_bytes(), "bytes")?)
        .bind(to_i64(now_ms, "time")?)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    pub(super) async fn job_file_rows(&self, job: &JobName) -> MetaResult<Vec<StoredJobFile>> {
        let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM job_files WHERE job = $1 ORDER BY name"))
            .bind(job.as_str())
            .fetch_all(&self.reader)
            .await?;
        rows.iter().map(job_file_from_row).collect()
    }

    pub(super) async fn job_file_row(
        &self,
        job: &JobName,
        name: &str,
    ) -> MetaResult<Option<(StoredJobFile, Manifest)>> {
        let row = sqlx::query(&format!("SELECT {COLUMNS}, manifest FROM job_files WHERE job = $1 AND name = $2"))
            .bind(job.as_str())
            .bind(name)
            .fetch_optional(&self.reader)
            .await?;
        let Some(row) = row else { return Ok(None) };
        let stored = job_file_from_row(&row)?;
        let blob: Vec<u8> = row.try_get("manifest")?;
        let manifest = decode_record(&blob, || format!("job file {name} of job {job}"))?;
        Ok(Some((stored, manifest)))
    }

    pub(super) async fn drop_job_file_row(&self, job: &JobName, name: &str) -> MetaResult<bool> {
        let mut tx = self.write().await?;
        let done = sqlx::query("DELETE FROM job_files WHERE job = $1 AND name = $2")
            .bind(job.as_str())
            .bind(name)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(done.rows_affected() > 0)
    }
}

/// Adds every chunk a job file names to `live`, in the read transaction `tx` (GC's mark).
pub(super) async fn mark_job_file_chunks(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    live: &mut std::collections::HashSet<ChunkHash>,
) -> MetaResult<()> {
    let mut rows = sqlx::query("SELECT job, name, manifest FROM job_files").fetch(&mut **tx);
    while let Some(row) = rows.try_next().await? {
        let (job, name): (String, String) = (row.try_get("job")?, row.try_get("name")?);
        let blob: Vec<u8> = row.try_get("manifest")?;
        let manifest = decode_record(&blob, || format!("job file {name} of job {job}"))?;
        live.extend(manifest.files.iter().flat_map(|f| f.chunks.iter()).map(|c| c.hash));
    }
    Ok(())
}
