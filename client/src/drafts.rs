//! Drafts at the control plane (`proto/src/draft.rs`): a writer's record of the closed files of
//! a checkpoint it writes in place (the mount's, `fuse/src/fs/journal.rs`), so that they outlive
//! its process. And job files: files of a job that are no checkpoint (Lightning's `last.ckpt`),
//! one file each, replaced whole.

use starckpt_proto::JobName;
use starckpt_proto::RelPath;
use starckpt_proto::control as pb;
use starckpt_proto::draft::{validate_job_file, validate_job_file_name, validate_name, validate_writer};
use starckpt_proto::model::{FileEntry, Manifest, part_manifest};

use crate::control::Resend;
use crate::{CheckpointManifest, Client, Error, Result, StreamedFile};

pub use starckpt_proto::control::{DraftInfo, JobFileInfo};

fn checked(job: &str, name: &str, writer: &str) -> Result<()> {
    JobName::try_from(job)?;
    validate_name(name)?;
    validate_writer(writer)?;
    Ok(())
}

impl Client {
    /// Records draft `name` of `job`, as `writer` holds it now: its closed files and directories.
    /// Replaces the writer's previous record of it; durable at the control plane once this returns.
    pub async fn put_draft(&self, job: &str, name: &str, writer: &str, manifest: &Manifest) -> Result<()> {
        checked(job, name, writer)?;
        let request = pb::PutDraftRequest {
            job: job.to_owned(),
            name: name.to_owned(),
            writer: writer.to_owned(),
            manifest: Some(pb::Manifest::from(manifest)),
        };
        self.rpc("put draft", Resend::Idempotent, request, |mut c, r| async move { c.put_draft(r).await }).await?;
        Ok(())
    }

    /// The drafts `writer` recorded, in every job this client reaches.
    pub async fn drafts(&self, writer: &str) -> Result<Vec<DraftInfo>> {
        validate_writer(writer)?;
        let request = pb::ListDraftsRequest { writer: writer.to_owned(), ..Default::default() };
        let response = self
            .rpc("list drafts", Resend::Idempotent, request, |mut c, r| async move { c.list_drafts(r).await })
            .await?;
        Ok(response.drafts)
    }

    /// Every writer's record of draft `name` of `job` (the mounts of several hosts writing it).
    pub async fn draft_writers(&self, job: &str, name: &str) -> Result<Vec<DraftInfo>> {
        JobName::try_from(job)?;
        validate_name(name)?;
        let request = pb::ListDraftsRequest { writer: String::new(), job: job.to_owned(), name: name.to_owned() };
        let response = self
            .rpc("list drafts", Resend::Idempotent, request, |mut c, r| async move { c.list_drafts(r).await })
            .await?;
        Ok(response.drafts)
    }

    /// The files of draft `name` of `job` as `writer` recorded them; None if it has no record.
    pub async fn draft(&self, job: &str, name: &str, writer: &str) -> Result<Option<Manifest>> {
        checked(job, name, writer)?;
        let request = pb::GetDraftRequest { job: job.to_owned(), name: name.to_owned(), writer: writer.to_owned() };
        match self.rpc("get draft", Resend::Idempotent, request, |mut c, r| async move { c.get_draft(r).await }).await {
            Ok(response) => Ok(Some(part_manifest(response.manifest)?)),
            Err(Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Forgets `writer`'s record of draft `name` of `job` (committed, or removed); whether there
    /// was one.
    pub async fn drop_draft(&self, job: &str, name: &str, writer: &str) -> Result<bool> {
        checked(job, name, writer)?;
        let request = pb::DropDraftRequest { job: job.to_owned(), name: name.to_owned(), writer: writer.to_owned() };
        let response = self
            .rpc("drop draft", Resend::Idempotent, request, |mut c, r| async move { c.drop_draft(r).await })
            .await?;
        Ok(response.dropped)
    }

    /// Puts `file` (streamed and finished: [`crate::StreamingFile::finish`]) as job file `name`
    /// of `job`, replacing the job file of that name whole; durable once this returns. Its chunks
    /// are confirmed on their targets first, as a commit does, so a file streamed longer ago
    /// than the collector's grace period is refused rather than kept with holes.
    pub async fn put_job_file(&self, job: &str, name: &str, file: StreamedFile) -> Result<()> {
        JobName::try_from(job)?;
        let mut files = [file];
        self.recheck_chunks(&mut files).await?;
        let [file] = files;
        let manifest = Manifest {
            files: vec![FileEntry {
                path: RelPath::try_from(name)?,
                size_bytes: file.size,
                mode: file.mode,
                chunks: file.chunks,
            }],
            addressing: file.addressing,
            ..Default::default()
        };
        validate_job_file(name, &manifest)?;
        let request = pb::PutJobFileRequest {
            job: job.to_owned(),
            name: name.to_owned(),
            manifest: Some(pb::Manifest::from(&manifest)),
        };
        self.rpc("put job file", Resend::Idempotent, request, |mut c, r| async move { c.put_job_file(r).await })
            .await?;
        Ok(())
    }

    /// The job files of `job`, by name.
    pub async fn job_files(&self, job: &str) -> Result<Vec<JobFileInfo>> {
        JobName::try_from(job)?;
        let request = pb::ListJobFilesRequest { job: job.to_owned() };
        let response = self
            .rpc("list job files", Resend::Idempotent, request, |mut c, r| async move { c.list_job_files(r).await })
            .await?;
        Ok(response.files)
    }

    /// Job file `name` of `job`, to read as file 0 of a manifest (its info names no checkpoint:
    /// id and step 0); None if there is none.
    pub async fn job_file(&self, job: &str, name: &str) -> Result<Option<CheckpointManifest>> {
        JobName::try_from(job)?;
        validate_job_file_name(name)?;
        let request = pb::GetJobFileRequest { job: job.to_owned(), name: name.to_owned() };
        let response = match self
            .rpc("get job file", Resend::Idempotent, request, |mut c, r| async move { c.get_job_file(r).await })
            .await
        {
            Ok(response) => response,
            Err(Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let manifest = part_manifest(response.manifest)?;
        validate_job_file(name, &manifest)?;
        let file = response.file.unwrap_or_default();
        let info = pb::CheckpointInfo {
            job: job.to_owned(),
            state: pb::CheckpointState::Committed as i32,
            world_size: 1,
            parts_committed: 1,
            total_bytes: manifest.total_bytes(),
            file_count: 1,
            created_at_ms: file.updated_at_ms,
            committed_at_ms: file.updated_at_ms,
            ..Default::default()
        };
        let as_checkpoint = pb::GetManifestResponse {
            checkpoint: Some(info),
            parts: vec![pb::RankManifest { rank: 0, manifest: Some(pb::Manifest::from(&manifest)) }],
            targets: response.targets,
            next_rank: None,
        };
        CheckpointManifest::from_response(as_checkpoint).map(Some)
    }

    /// Drops job file `name` of `job`; whether there was one.
    pub async fn drop_job_file(&self, job: &str, name: &str) -> Result<bool> {
        JobName::try_from(job)?;
        validate_job_file_name(name)?;
        let request = pb::DropJobFileRequest { job: job.to_owned(), name: name.to_owned() };
        let response = self
            .rpc("drop job file", Resend::Idempotent, request, |mut c, r| async move { c.drop_job_file(r).await })
            .await?;
        Ok(response.dropped)
    }
}
