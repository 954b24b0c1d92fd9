//! The control plane's side of drafts and job files (`proto/src/draft.rs`): the PutDraft,
//! ListDrafts, GetDraft and DropDraft handlers, and PutJobFile, ListJobFiles, GetJobFile and
//! DropJobFile, in the caller's namespace.
//!
//! A tenant's writers are its own: the writer name is stored under the tenant's prefix, so two
//! tenants' mounts of the same name neither see nor crowd out each other's drafts.

use starckpt_proto::control as pb;
use starckpt_proto::draft::{validate_job_file, validate_job_file_name, validate_name, validate_writer};
use starckpt_proto::model::{Manifest, part_manifest};
use tonic::{Response, Status};

use super::ControlService;
use crate::control::auth::Caller;
use crate::control::convert::{invalid, meta_status};
use crate::control::store::{DraftKey, StoredDraft, StoredJobFile, now_ms};

/// The writer `writer` as stored for `caller`.
fn stored_writer(caller: &Caller, writer: &str) -> Result<String, Status> {
    validate_writer(writer).map_err(invalid)?;
    Ok(match caller.namespace() {
        Some(tenant) => format!("{tenant}/{writer}"),
        None => writer.to_owned(),
    })
}

/// What `caller` calls the writer stored as `stored`.
fn shown_writer<'a>(caller: &Caller, stored: &'a str) -> &'a str {
    match caller.namespace() {
        Some(tenant) => stored.strip_prefix(tenant.as_str()).and_then(|s| s.strip_prefix('/')).unwrap_or(stored),
        None => stored,
    }
}

fn key(caller: &Caller, job: &str, name: &str, writer: &str) -> Result<DraftKey, Status> {
    validate_name(name).map_err(invalid)?;
    Ok(DraftKey { job: caller.job(job)?, name: name.to_owned(), writer: stored_writer(caller, writer)? })
}

fn info(caller: &Caller, writer: &str, draft: &StoredDraft) -> pb::DraftInfo {
    pb::DraftInfo {
        job: caller.shown(draft.key.job.as_str()),
        name: draft.key.name.clone(),
        writer: writer.to_owned(),
        file_count: draft.file_count,
        total_bytes: draft.total_bytes,
        updated_at_ms: draft.updated_at_ms,
    }
}

fn job_file_info(file: &StoredJobFile) -> pb::JobFileInfo {
    pb::JobFileInfo { name: file.name.clone(), size_bytes: file.size_bytes, updated_at_ms: file.updated_at_ms }
}

impl ControlService {
    /// Refuses a manifest whose chunks are not addressed as `job`'s are (`what` names it).
    fn addressed_as_job(&self, job: &starckpt_proto::JobName, manifest: &Manifest, what: &str) -> Result<(), Status> {
        if manifest.addressing != self.job_addressing(job) && !manifest.files.iter().all(|f| f.chunks.is_empty()) {
            return Err(Status::invalid_argument(format!(
                "{what}: its chunks are not addressed as the job's are (ChunkAddressing says how)"
            )));
        }
        Ok(())
    }

    pub(super) async fn put_draft_as(
        &self,
        caller: &Caller,
        request: pb::PutDraftRequest,
    ) -> Result<Response<pb::PutDraftResponse>, Status> {
        let mut key = key(caller, &request.job, &request.name, &request.writer)?;
        key.job = caller.new_job(&request.job)?;
        let manifest: Manifest = part_manifest(request.manifest).map_err(invalid)?;
        self.addressed_as_job(&key.job, &manifest, &format!("draft {} of job {}", key.name, request.job))?;
        self.store.put_draft(&key, &manifest, now_ms()).await.map_err(|e| caller.told(meta_status(e)))?;
        Ok(Response::new(pb::PutDraftResponse {}))
    }

    pub(super) async fn list_drafts_as(
        &self,
        caller: &Caller,
        request: pb::ListDraftsRequest,
    ) -> Result<Response<pb::ListDraftsResponse>, Status> {
        if request.writer.is_empty() {
            validate_name(&request.name).map_err(invalid)?;
            let job = caller.job(&request.job)?;
            let drafts = self.store.drafts_named(&job, &request.name).await.map_err(|e| caller.told(meta_status(e)))?;
            return Ok(Response::new(pb::ListDraftsResponse {
                drafts: drafts.iter().map(|d| info(caller, shown_writer(caller, &d.key.writer), d)).collect(),
            }));
        }
        let writer = stored_writer(caller, &request.writer)?;
        let drafts = self.store.drafts_of(&writer).await.map_err(|e| caller.told(meta_status(e)))?;
        Ok(Response::new(pb::ListDraftsResponse {
            drafts: drafts
                .iter()
                .filter(|d| caller.reaches(d.key.job.as_str()))
                .map(|d| info(caller, &request.writer, d))
                .collect(),
        }))
    }

    pub(super) async fn get_draft_as(
        &self,
        caller: &Caller,
        request: pb::GetDraftRequest,
    ) -> Result<Response<pb::GetDraftResponse>, Status> {
        let key = key(caller, &request.job, &request.name, &request.writer)?;
        let found = self.store.get_draft(&key).await.map_err(|e| caller.told(meta_status(e)))?;
        let Some((stored, manifest)) = found else {
            return Err(Status::not_found(format!(
                "job {} has no draft {} recorded by {}",
                request.job, request.name, request.writer
            )));
        };
        Ok(Response::new(pb::GetDraftResponse {
            draft: Some(info(caller, &request.writer, &stored)),
            manifest: Some(pb::Manifest::from(&manifest)),
        }))
    }

    pub(super) async fn drop_draft_as(
        &self,
        caller: &Caller,
        request: pb::DropDraftRequest,
    ) -> Result<Response<pb::DropDraftResponse>, Status> {
        let key = key(caller, &request.job, &request.name, &request.writer)?;
        let dropped = self.store.drop_draft(&key).await.map_err(|e| caller.told(meta_status(e)))?;
        Ok(Response::new(pb::DropDraftResponse { dropped }))
    }

    pub(super) async fn put_job_file_as(
        &self,
        caller: &Caller,
        request: pb::PutJobFileRequest,
    ) -> Result<Response<pb::PutJobFileResponse>, Status> {
        let job = caller.new_job(&request.job)?;
        let manifest: Manifest = part_manifest(request.manifest).map_err(invalid)?;
        validate_job_file(&request.name, &manifest).map_err(invalid)?;
        self.addressed_as_job(&job, &manifest, &format!("job file {} of job {}", request.name, request.job))?;
        self.store
            .put_job_file(&job, &request.name, &manifest, now_ms())
            .await
            .map_err(|e| caller.told(meta_status(e)))?;
        Ok(Response::new(pb::PutJobFileResponse {}))
    }

    pub(super) async fn list_job_files_as(
        &self,
        caller: &Caller,
        request: pb::ListJobFilesRequest,
    ) -> Result<Response<pb::ListJobFilesResponse>, Status> {
        let job = caller.job(&request.job)?;
        let files = self.store.job_files(&job).await.map_err(|e| caller.told(meta_status(e)))?;
        Ok(Response::new(pb::ListJobFilesResponse { files: files.iter().map(job_file_info).collect() }))
    }

    pub(super) async fn get_job_file_as(
        &self,
        caller: &Caller,
        request: pb::GetJobFileRequest,
    ) -> Result<Response<pb::GetJobFileResponse>, Status> {
        validate_job_file_name(&request.name).map_err(invalid)?;
        let job = caller.job(&request.job)?;
        let found = self.store.get_job_file(&job, &request.name).await.map_err(|e| caller.told(meta_status(e)))?;
        let Some((stored, manifest)) = found else {
            return Err(Status::not_found(format!("job {} has no job file {}", request.job, request.name)));
        };
        let targets = self.targets_named(caller, std::iter::once(&manifest)).await?;
        Ok(Response::new(pb::GetJobFileResponse {
            file: Some(job_file_info(&stored)),
            manifest: Some(pb::Manifest::from(&manifest)),
            targets,
        }))
    }

    pub(super) async fn drop_job_file_as(
        &self,
        caller: &Caller,
        request: pb::DropJobFileRequest,
    ) -> Result<Response<pb::DropJobFileResponse>, Status> {
        validate_job_file_name(&request.name).map_err(invalid)?;
        let job = caller.job(&request.job)?;
        let dropped = self.store.drop_job_file(&job, &request.name).await.map_err(|e| caller.told(meta_status(e)))?;
        Ok(Response::new(pb::DropJobFileResponse { dropped }))
    }
}
