//! Drafts at the control plane (`proto/src/draft.rs`): a writer's record of the closed files of
//! a checkpoint it writes in place (the mount's, `fuse/src/fs/journal.rs`), so that they outlive
//! its process.

use starckpt_proto::JobName;
use starckpt_proto::control as pb;
use starckpt_proto::draft::{validate_name, validate_writer};
use starckpt_proto::model::{Manifest, part_manifest};

use crate::control::Resend;
use crate::{Client, Error, Result};

pub use starckpt_proto::control::DraftInfo;

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
}
