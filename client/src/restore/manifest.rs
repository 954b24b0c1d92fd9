//! A checkpoint's manifest as a reader holds it ([`CheckpointManifest`]): fetched whole or by
//! pages, checked, indexed by path; and using one while the checkpoint may be deleted.

use super::*;

impl Client {
    /// The committed manifest of (job, step), or of the latest committed step.
    /// Read a page at a time (`GetManifestRequest`), however many bytes its parts add up to.
    pub async fn manifest(&self, job: &str, step: Option<u64>) -> Result<CheckpointManifest> {
        let job = JobName::try_from(job)?;
        let get =
            |request: pb::GetManifestRequest| {
                self.rpc("get manifest", crate::Resend::Idempotent, request, |mut c, r| async move {
                    c.get_manifest(r).await
                })
            };
        let first =
            get(pb::GetManifestRequest { job: job.to_string(), step, from_rank: Some(0), checkpoint_id: None }).await?;
        let mut next_rank = first.next_rank;
        let mut whole = first;
        let id = whole.checkpoint.as_ref().map(|info| info.checkpoint_id);
        while let Some(from_rank) = next_rank {
            let page = get(pb::GetManifestRequest {
                job: job.to_string(),
                step: None,
                from_rank: Some(from_rank),
                checkpoint_id: id,
            })
            .await?;
            // Each page must move on, or a confused control plane would keep this loop going.
            if page.parts.first().is_none_or(|part| part.rank != from_rank)
                || page.next_rank.is_some_and(|next| next <= from_rank)
            {
                return Err(Error::InvalidInput(format!(
                    "{job}: the control plane answered a manifest page from rank {from_rank} with ranks {:?} (next {:?})",
                    page.parts.first().map(|part| part.rank),
                    page.next_rank
                )));
            }
            next_rank = page.next_rank;
            whole.parts.extend(page.parts);
            whole.targets.extend(page.targets);
        }
        CheckpointManifest::from_response(whole)
    }

    /// Runs `use_it` on the manifest of (job, step), or of the latest committed step. The latest
    /// can be deleted while it is in use (a newer one committed and retention let it go, its
    /// chunks collected: `use_it` fails with [`Error::Deleted`], which `deleted` recognises in
    /// its error type); the latest then is used instead, [`LATEST_ATTEMPTS`] times at most. A
    /// step named is never swapped for another.
    pub async fn with_manifest<T, E, Fut>(
        &self,
        job: &str,
        step: Option<u64>,
        deleted: impl Fn(&E) -> bool,
        mut use_it: impl FnMut(CheckpointManifest) -> Fut,
    ) -> std::result::Result<T, E>
    where
        E: From<Error>,
        Fut: Future<Output = std::result::Result<T, E>>,
    {
        let mut attempt = 1;
        loop {
            let manifest = self.manifest(job, step).await?;
            let used = manifest.info.step;
            match use_it(manifest).await {
                Err(error) if step.is_none() && attempt < LATEST_ATTEMPTS && deleted(&error) => {
                    tracing::warn!(
                        job,
                        step = used,
                        "the latest checkpoint was deleted while it was being restored; restoring the latest again"
                    );
                    attempt += 1;
                }
                done => return done,
            }
        }
    }
}

/// Manifests of the latest checkpoint [`Client::with_manifest`] tries, each deleted while in use
/// but the last.
pub const LATEST_ATTEMPTS: u32 = 3;

/// A committed checkpoint's files (all ranks merged) and where its chunks live.
#[derive(Clone, Debug)]
pub struct CheckpointManifest {
    pub info: CheckpointInfo,
    pub files: Vec<FileEntry>,
    pub directories: Vec<RelPath>,
    /// Each rank's user metadata, by rank.
    pub metadata: Vec<(u32, std::collections::BTreeMap<String, String>)>,
    pub targets: HashMap<String, TargetInfo>,
    /// How the chunks are addressed: plain BLAKE3, or the job's tenant's keyed addresses.
    pub addressing: Addressing,
    /// Index into `files` by path (a checkpoint may hold tens of thousands of tensors).
    pub(super) by_path: HashMap<String, usize>,
}

impl CheckpointManifest {
    pub fn file(&self, path: &str) -> Option<&FileEntry> {
        self.by_path.get(path).map(|&index| &self.files[index])
    }

    /// The entry of `path`, or a NotFound error naming the checkpoint.
    pub fn require(&self, path: &str) -> Result<&FileEntry> {
        self.file(path).ok_or_else(|| Error::NotFound {
            op: "read",
            message: format!("{} step {} has no file {path}", self.info.job, self.info.step),
        })
    }

    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size_bytes).sum()
    }

    /// A checkpoint's manifest as the control plane (or the object-store tier) describes it:
    /// every rank's part, checked to describe one tree (`check_disjoint`: ranks write disjoint
    /// files; a path that is a file in one part and a directory in another is an error).
    pub fn from_response(response: pb::GetManifestResponse) -> Result<CheckpointManifest> {
        let info =
            response.checkpoint.ok_or_else(|| Error::InvalidInput("manifest response without checkpoint".into()))?;
        if !response.parts.iter().map(|part| part.rank).eq(0..info.world_size) {
            return Err(Error::InvalidInput(format!(
                "{} step {}: the manifest has {} parts, not one for each of its {} ranks in order",
                info.job,
                info.step,
                response.parts.len(),
                info.world_size
            )));
        }
        let parts = response
            .parts
            .into_iter()
            .map(|part| {
                let manifest = part.manifest.ok_or_else(|| {
                    Error::InvalidInput(format!("{} step {}: rank {} has no manifest", info.job, info.step, part.rank))
                })?;
                Ok((part.rank, Manifest::try_from(manifest)?))
            })
            .collect::<Result<Vec<_>>>()?;
        starckpt_proto::model::check_disjoint(parts.iter().map(|(rank, manifest)| (*rank, manifest)))
            .map_err(|e| Error::InvalidInput(format!("{} step {}: {e}", info.job, info.step)))?;
        let addressing = Self::addressing(&info, &parts)?;
        let mut files = Vec::new();
        let mut directories = Vec::new();
        let mut metadata = Vec::new();
        for (rank, manifest) in parts {
            files.extend(manifest.files);
            directories.extend(manifest.directories);
            metadata.push((rank, manifest.metadata));
        }
        let targets = response.targets.into_iter().map(|t| (t.target_id.clone(), t)).collect();
        let by_path = files.iter().enumerate().map(|(index, f)| (f.path.to_string(), index)).collect();
        Ok(CheckpointManifest { info, files, directories, metadata, targets, addressing, by_path })
    }

    /// How the parts' chunks are addressed: all parts must agree (the control plane commits a
    /// tenant's parts only with the tenant's current key).
    pub(super) fn addressing(info: &CheckpointInfo, parts: &[(u32, Manifest)]) -> Result<Addressing> {
        let mut keys = parts.iter().map(|(_, manifest)| manifest.addressing);
        let first = keys.next().unwrap_or_default();
        if keys.any(|addressing| addressing != first) {
            return Err(Error::InvalidInput(format!(
                "{} step {}: its parts address their chunks with different keys",
                info.job, info.step
            )));
        }
        Ok(first)
    }
}
