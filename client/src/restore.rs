//! Restore: manifest → parallel chunk reads → BLAKE3 verification → files or caller buffers.
//!
//! No byte reaches a file before its chunk's hash is verified. A restore into a directory is
//! built in a hidden sibling directory and renamed into place only when complete, so a failed or
//! interrupted restore never leaves a half-written checkpoint where the trainer will look.
//!
//! Reads into the caller's memory (`read_into`, `read_range_into`) fetch each whole chunk
//! straight into its place: shared memory and RDMA copy it there out of their slot (one copy on
//! the client instead of two and an allocation), and it is verified where it lies before the
//! call returns. A read that fails leaves the buffer's contents unspecified.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::Bytes;
use futures::StreamExt;
use starckpt_proto::ChunkHash;
use starckpt_proto::control::{self as pb};
use starckpt_proto::model::{ChunkRef, FileEntry, Manifest};
use starckpt_proto::{Addressing, ChunkName, JobName, RelPath};

use crate::transport::{ChunkTransport, Fetched, Payload, TransportError};
use crate::{CheckpointInfo, Client, Error, Result, TargetInfo};
use starckpt_proto::data::ErrorCode;

/// Decodes a fetched copy of `chunk` and checks it against the manifest, off the runtime: the
/// chunk's bytes and its name (what read repair stores them under), or `Err(what was wrong)`.
/// The outer error is only a cancelled task.
async fn verify(
    addressing: &Addressing,
    chunk: &ChunkRef,
    payload: Payload,
) -> Result<std::result::Result<(Bytes, ChunkName), String>> {
    let (hash, length, addressing) = (chunk.hash, chunk.length_bytes, *addressing);
    tokio::task::spawn_blocking(move || payload.verified(&addressing, hash, length))
        .await
        .map_err(|e| Error::Cancelled(e.to_string()))
}

/// One GET of a whole chunk: into `dest` when there is one and the transport can put it there.
async fn fetch_from(
    transport: &dyn ChunkTransport,
    chunk: &ChunkRef,
    dest: Option<&mut [u8]>,
) -> std::result::Result<Fetched, TransportError> {
    match dest {
        Some(dest) => transport.get_into(chunk.hash, dest).await,
        None => transport.get(chunk.hash, 0, 0).await.map(Fetched::Payload),
    }
}

/// A verified chunk: copied into `dest` when there is one and it came as bytes (`None` then).
fn settle_chunk(data: Option<Bytes>, dest: Option<&mut [u8]>) -> Option<Bytes> {
    match (data, dest) {
        (Some(data), Some(dest)) => {
            dest.copy_from_slice(&data);
            starckpt_dataplane::buf::copies::record(data.len());
            None
        }
        (data, _) => data,
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
    by_path: HashMap<String, usize>,
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
    fn addressing(info: &CheckpointInfo, parts: &[(u32, Manifest)]) -> Result<Addressing> {
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

#[derive(Clone, Debug, Default)]
pub struct RestoreOptions {
    /// Replace a non-empty destination directory.
    pub force: bool,
}

#[derive(Debug, Default)]
pub struct RestoreProgress {
    pub verified_bytes: AtomicU64,
}

#[derive(Clone, Debug)]
pub struct RestoreOutcome {
    pub files: usize,
    pub bytes: u64,
}

/// Removes a directory tree when dropped.
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The name prefix of a restore's unfinished tree beside destination `name`.
fn partial_prefix(name: &str) -> String {
    format!(".{name}.starckpt-partial-")
}

/// The name prefix of the tree a `--force` restore moved aside (file systems without the atomic
/// exchange). Never removed by a later restore: one that failed to move it back says it is kept
/// there.
fn replaced_prefix(name: &str) -> String {
    format!(".{name}.starckpt-replaced-")
}

/// A restore's unfinished tree, beside its destination: removed when dropped unless it was
/// placed, then the destination's lock is let go. Held by the restore and by the blocking task
/// making the tree, so both go when the last of them does: removed while that task still ran,
/// the tree would be made again by it, and let go of, the destination would be open to another
/// restore while this one's task still wrote beside it.
struct Unfinished {
    tree: PathBuf,
    placed: AtomicBool,
    _lock: DestinationLock,
}

impl Unfinished {
    /// Whether the restore that made it has been dropped (only the task making the tree holds
    /// it now).
    fn abandoned(self: &Arc<Self>) -> bool {
        Arc::strong_count(self) == 1
    }
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        if !self.placed.load(Ordering::Relaxed) {
            let _ = std::fs::remove_dir_all(&self.tree);
        }
    }
}

/// Held while a restore into one destination runs: an exclusive lock on a file beside it
/// (`.NAME.starckpt-restore.lock`, removed when the restore ends). Taking it removes unfinished
/// trees a restore into the same destination left when it was killed (SIGKILL, power loss),
/// which nothing else can be writing while the lock is held.
struct DestinationLock {
    path: PathBuf,
    _file: std::fs::File,
}

impl DestinationLock {
    fn take(parent: &Path, name: &str, to: &Path) -> Result<DestinationLock> {
        let path = parent.join(format!(".{name}.starckpt-restore.lock"));
        let mut tries = 0;
        let file = loop {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
                .map_err(Error::io("create", &path))?;
            match file.try_lock() {
                Ok(()) => {}
                Err(std::fs::TryLockError::WouldBlock) => {
                    return Err(Error::InvalidInput(format!("another restore into {} is running", to.display())));
                }
                Err(std::fs::TryLockError::Error(e)) => return Err(Error::io("lock", &path)(e)),
            }
            // A restore that ended unlinks its lock file before closing it: one that opened the
            // file before the unlink and locked it after the close holds a lock no later restore
            // sees. Only the file still at the path counts.
            if is_at(&file, &path) {
                break file;
            }
            tries += 1;
            if tries == 100 {
                return Err(Error::InvalidInput(format!(
                    "the lock file {} keeps being replaced: is another restore into {} starting and ending?",
                    path.display(),
                    to.display()
                )));
            }
        };
        let (partial, replaced) = (partial_prefix(name), replaced_prefix(name));
        for entry in std::fs::read_dir(parent).map_err(Error::io("list", parent))? {
            let entry = entry.map_err(Error::io("list", parent))?;
            let Some(file_name) = entry.file_name().to_str().map(str::to_owned) else { continue };
            if file_name.starts_with(&partial) {
                tracing::info!(path = %entry.path().display(), "removing what an interrupted restore left");
                std::fs::remove_dir_all(entry.path()).map_err(Error::io("remove", &entry.path()))?;
            } else if file_name.starts_with(&replaced) {
                tracing::warn!(
                    path = %entry.path().display(),
                    "an earlier restore left the tree it replaced here; remove it once it is not needed"
                );
            }
        }
        Ok(DestinationLock { path, _file: file })
    }
}

impl Drop for DestinationLock {
    fn drop(&mut self) {
        // Unlinked while still locked: a restore that opened it meanwhile fails to lock it (and
        // says another is running) rather than locking a file no one else will see.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The order to try a chunk's `replicas` in: copies on targets the control plane last saw alive
/// and this client has not failed to reach lately first, then the rest; as listed otherwise. A
/// target that is down then costs a restore one timeout, not one per chunk it holds.
fn replica_order<'a>(
    targets: &HashMap<String, TargetInfo>,
    replicas: &'a [String],
    unreachable: impl Fn(&str) -> bool,
) -> Vec<&'a str> {
    let mut order: Vec<&str> = replicas.iter().map(String::as_str).collect();
    order.sort_by_cached_key(|id| {
        let alive = targets.get(*id).is_some_and(|t| t.state == pb::TargetState::Alive as i32);
        (unreachable(id), !alive)
    });
    order
}

/// Whether `file` is the file at `path` (not one unlinked, or replaced, since it was opened).
fn is_at(file: &std::fs::File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(open), Ok(named)) => (open.dev(), open.ino()) == (named.dev(), named.ino()),
        _ => false,
    }
}

/// Atomically exchanges two paths (renameat2 RENAME_EXCHANGE).
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let a = std::ffi::CString::new(a.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let b = std::ffi::CString::new(b.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: both are NUL-terminated paths that outlive the call.
    let rc = unsafe { libc::renameat2(libc::AT_FDCWD, a.as_ptr(), libc::AT_FDCWD, b.as_ptr(), libc::RENAME_EXCHANGE) };
    if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

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

    /// Reads one chunk from its replicas in order, verifying its hash; the first verified copy
    /// wins. Errors name the chunk and each target that failed.
    pub async fn read_chunk(&self, manifest: &CheckpointManifest, chunk: &ChunkRef) -> Result<Bytes> {
        self.fetch_chunk(manifest, chunk, None)
            .await?
            .ok_or_else(|| Error::Cancelled(format!("chunk {} was read into no buffer", chunk.hash)))
    }

    /// [`Client::read_chunk`] into `dest` (exactly the chunk's length): shared memory and RDMA
    /// place the bytes there straight from their slot, and they are verified where they lie. If
    /// every copy fails, `dest` holds unverified bytes and the error says so.
    pub async fn read_chunk_into(
        &self,
        manifest: &CheckpointManifest,
        chunk: &ChunkRef,
        dest: &mut [u8],
    ) -> Result<()> {
        if dest.len() as u64 != chunk.length_bytes {
            return Err(Error::InvalidInput(format!(
                "chunk {} is {} bytes, buffer is {}",
                chunk.hash,
                chunk.length_bytes,
                dest.len()
            )));
        }
        self.fetch_chunk(manifest, chunk, Some(dest)).await.map(drop)
    }

    /// The replica loop of [`Client::read_chunk`] and [`Client::read_chunk_into`]: with `dest`,
    /// the verified chunk ends up there (`Ok(None)`), otherwise it is returned. A chunk no target
    /// could provide is handed to the control plane to recover (from a live target it did not
    /// know of, or from the object-store tier: [`Client::recover_chunks`]), then read once more.
    async fn fetch_chunk(
        &self,
        manifest: &CheckpointManifest,
        chunk: &ChunkRef,
        mut dest: Option<&mut [u8]>,
    ) -> Result<Option<Bytes>> {
        let error = match self.fetch_listed(manifest, chunk, dest.as_deref_mut()).await {
            Err(error @ (Error::ChunkUnavailable { .. } | Error::Target { .. } | Error::Checksum { .. })) => error,
            done => return done,
        };
        // Batched with other readers' chunks of this checkpoint (`recovery.rs`).
        match self.recover_chunk(manifest, chunk.hash).await {
            Ok(true) => {
                tracing::info!(chunk = %chunk.hash, "the control plane recovered a chunk no target had; reading it again");
                self.fetch_listed(manifest, chunk, dest).await
            }
            Ok(false) => Err(error),
            // Deleted since this reader fetched its manifest: no copy is to be had, and no
            // repair brings one back.
            Err(crate::recovery::Unanswered::Gone(said)) => Err(Error::Deleted {
                job: manifest.info.job.clone(),
                step: manifest.info.step,
                checkpoint_id: manifest.info.checkpoint_id,
                hash: chunk.hash,
                said,
            }),
            Err(recovering) => {
                tracing::warn!(chunk = %chunk.hash, error = %recovering, "the control plane could not recover a chunk");
                Err(error)
            }
        }
    }

    /// Asks the control plane to bring back copies of `hashes` (chunks of `manifest`'s checkpoint)
    /// on live targets, from a copy on another live target or from the object-store tier. Returns,
    /// per hash, whether a live target holds a verified copy now.
    pub async fn recover_chunks(&self, manifest: &CheckpointManifest, hashes: &[ChunkHash]) -> Result<Vec<bool>> {
        let info = &manifest.info;
        self.recover_chunks_of(&info.job, info.step, info.checkpoint_id, hashes).await
    }

    /// [`Client::recover_chunks`] for the checkpoint (`job`, `step`, `checkpoint_id`).
    pub(crate) async fn recover_chunks_of(
        &self,
        job: &str,
        step: u64,
        checkpoint_id: u64,
        hashes: &[ChunkHash],
    ) -> Result<Vec<bool>> {
        let request = pb::RecoverChunksRequest {
            job: job.to_owned(),
            step,
            checkpoint_id,
            hashes: hashes.iter().map(|hash| hash.to_bytes()).collect(),
        };
        let response =
            self.rpc("recover chunks", crate::Resend::Idempotent, request, |mut c, r| async move {
                c.recover_chunks(r).await
            })
            .await?;
        Ok(response.recovered)
    }

    /// One round of [`Client::fetch_chunk`]: the listed replicas, then live targets in the
    /// chunk's rendezvous order.
    async fn fetch_listed(
        &self,
        manifest: &CheckpointManifest,
        chunk: &ChunkRef,
        mut dest: Option<&mut [u8]>,
    ) -> Result<Option<Bytes>> {
        let mut last = None;
        // Replicas that answered with bad bytes or without the chunk: repaired once a good copy
        // is found.
        let mut damaged: Vec<&TargetInfo> = Vec::new();
        let order = replica_order(&manifest.targets, &chunk.replicas, |id| self.inner.targets.unreachable(id));
        let copies = order.len();
        for (attempt_index, target_id) in order.into_iter().enumerate() {
            let Some(target) = manifest.targets.get(target_id) else {
                last = Some(Error::InvalidInput(format!("chunk {} names unknown target {target_id}", chunk.hash)));
                continue;
            };
            let attempt = async {
                let mut address = target.data_address.clone();
                let mut transport = self.transport(target_id, &address)?;
                let mut fetched = fetch_from(&*transport, chunk, dest.as_deref_mut()).await;
                if let Err(error) = &fetched
                    && error.is_connection()
                    && let Some((moved, moved_transport)) = self.refreshed_transport(target_id, &address).await
                {
                    (address, transport) = (moved, moved_transport);
                    fetched = fetch_from(&*transport, chunk, dest.as_deref_mut()).await;
                }
                self.reached(target_id, !fetched.as_ref().is_err_and(TransportError::is_connection));
                let fetched = fetched.map_err(|source| Error::Target {
                    target_id: target_id.to_owned(),
                    address: address.clone(),
                    source,
                })?;
                // Bytes placed in `dest` were hashed as the transport copied them there.
                let checked = match fetched {
                    Fetched::Payload(payload) => {
                        verify(&manifest.addressing, chunk, payload).await?.map(|(data, name)| (Some(data), name))
                    }
                    Fetched::Placed(hash) if dest.is_none() => Err(format!("placed in no buffer ({hash})")),
                    Fetched::Placed(hash) => match manifest.addressing.name(hash) {
                        name if name.address == chunk.hash => Ok((None, name)),
                        name => Err(format!("got {}", name.address)),
                    },
                };
                checked.map_err(|found| Error::Checksum {
                    hash: chunk.hash,
                    found,
                    target_id: target_id.to_owned(),
                    address,
                })
            };
            // Another replica is there to read: one that does not answer within a few times
            // this client's usual read time is left for it (and tried last by the next reads),
            // rather than waited on for its whole deadline.
            let started = std::time::Instant::now();
            let patience = self.inner.targets.read_patience();
            let outcome = if attempt_index + 1 < copies {
                match tokio::time::timeout(patience, attempt).await {
                    Ok(outcome) => outcome,
                    Err(_) => {
                        tracing::warn!(
                            chunk = %chunk.hash, target = %target_id, ?patience,
                            "a replica did not answer in time; reading the next replica"
                        );
                        self.reached(target_id, false);
                        last = Some(Error::Target {
                            target_id: target_id.to_owned(),
                            address: target.data_address.clone(),
                            source: TransportError::Timeout(patience),
                        });
                        continue;
                    }
                }
            } else {
                attempt.await
            };
            match outcome {
                Ok((data, name)) => {
                    self.inner.targets.read_took(started.elapsed());
                    let data = settle_chunk(data, dest.as_deref_mut());
                    if !damaged.is_empty() {
                        let good =
                            data.clone().unwrap_or_else(|| Bytes::copy_from_slice(dest.as_deref().unwrap_or(&[])));
                        for target in damaged {
                            self.repair_copy(target, name, good.clone());
                        }
                    }
                    return Ok(data);
                }
                Err(error) => {
                    let bad_copy = match &error {
                        Error::Checksum { .. } => true,
                        Error::Target { source: TransportError::Remote { code, .. }, .. } => {
                            matches!(code, ErrorCode::NotFound | ErrorCode::Corrupt)
                        }
                        _ => false,
                    };
                    if bad_copy {
                        damaged.push(target);
                    }
                    // Handled here by trying the next replica; the last failure is returned instead.
                    if attempt_index + 1 < chunk.replicas.len() {
                        tracing::warn!(%error, "replica read failed; trying the next replica");
                    }
                    last = Some(error);
                }
            }
        }
        // None of the listed copies: the control plane's re-replication puts lost copies on other
        // live targets, in the chunk's rendezvous order; look there.
        if let Some((data, name)) = self.read_elsewhere(manifest, chunk).await {
            for target in damaged {
                self.repair_copy(target, name, data.clone());
            }
            return Ok(settle_chunk(Some(data), dest));
        }
        let last = last.unwrap_or_else(|| Error::InvalidInput(format!("chunk {} has no replicas", chunk.hash)));
        // With a single replica the underlying error is the clearest message, unless it is that
        // the replica names a target unknown here (a cluster rebuilt around a tier's copy): the
        // control plane may still recover the chunk, so it is unavailable like any other.
        if chunk.replicas.len() == 1 && !matches!(last, Error::InvalidInput(_)) {
            Err(last)
        } else {
            Err(Error::ChunkUnavailable { hash: chunk.hash, last: Box::new(last) })
        }
    }

    /// A verified copy of `chunk` from a live target its manifest does not list, trying them in
    /// the chunk's rendezvous order (where re-replication puts new copies). None if none has one.
    async fn read_elsewhere(&self, manifest: &CheckpointManifest, chunk: &ChunkRef) -> Option<(Bytes, ChunkName)> {
        let live: Vec<TargetInfo> = match self.targets().await {
            Ok(targets) => targets
                .into_iter()
                .filter(|t| t.state == pb::TargetState::Alive as i32 && !chunk.replicas.contains(&t.target_id))
                .collect(),
            Err(error) => {
                tracing::warn!(%error, "could not list targets to look for another copy");
                return None;
            }
        };
        let ids: Vec<&str> = live.iter().map(|t| t.target_id.as_str()).collect();
        for index in crate::placement::rank_targets(&chunk.hash, &ids) {
            let target = &live[index];
            let Ok(transport) = self.transport(&target.target_id, &target.data_address) else { continue };
            let Ok(payload) = transport.get(chunk.hash, 0, 0).await else { continue };
            if let Ok(Ok(verified)) = verify(&manifest.addressing, chunk, payload).await {
                tracing::info!(chunk = %chunk.hash, target = %target.target_id, "read a copy the manifest does not list");
                return Some(verified);
            }
        }
        None
    }

    /// Read repair, in the background: sends `data` (verified as the chunk `name`) to a target
    /// whose copy was bad or missing; it replaces its copy unless that verifies now. Bounded: when
    /// [`crate::REPAIRS_IN_FLIGHT`] repairs are queued or running, this one is skipped (logged).
    fn repair_copy(&self, target: &TargetInfo, name: ChunkName, data: Bytes) {
        let hash = name.address;
        let Ok(permit) = Arc::clone(&self.inner.repairs).try_acquire_owned() else {
            tracing::warn!(chunk = %hash, target = %target.target_id, "read repair skipped: too many in flight");
            return;
        };
        let transport = match self.transport(&target.target_id, &target.data_address) {
            Ok(transport) => transport,
            Err(error) => return tracing::warn!(%error, "read repair skipped"),
        };
        let target_id = target.target_id.clone();
        let running = Arc::clone(&self.inner.repairs_running);
        tokio::spawn(async move {
            let _permit = permit;
            let Ok(_running) = running.acquire_owned().await else { return };
            match transport.put_named(&name, Payload::raw(data), true).await {
                Ok(false) => tracing::info!(chunk = %hash, target = %target_id, "read repair rewrote a bad copy"),
                Ok(true) => tracing::info!(chunk = %hash, target = %target_id, "read repair: the copy verifies now"),
                Err(error) => tracing::warn!(%error, chunk = %hash, target = %target_id, "read repair failed"),
            }
        });
    }

    /// `length` bytes of `path` starting at `offset`, verified. Whole chunks are fetched (a chunk
    /// can only be verified whole) and the range is cut from them.
    pub async fn read_range(
        &self,
        manifest: &CheckpointManifest,
        path: &str,
        offset: u64,
        length: u64,
    ) -> Result<Bytes> {
        // Checked before allocating: a bad length must be an error, not an abort.
        let size = manifest.require(path)?.size_bytes;
        if offset.checked_add(length).is_none_or(|end| end > size) {
            return Err(Error::InvalidInput(format!("range {offset}+{length} is outside {path} ({size} bytes)")));
        }
        let length = usize::try_from(length)
            .map_err(|_| Error::InvalidInput(format!("range {offset}+{length} does not fit in memory")))?;
        // An allocation the system refuses (larger than memory) is an error, not an abort.
        let mut out = Vec::new();
        out.try_reserve_exact(length).map_err(|_| {
            Error::InvalidInput(format!(
                "{length} bytes of {path} do not fit in memory: read it in ranges, or into a buffer of yours"
            ))
        })?;
        out.resize(length, 0);
        self.read_range_into(manifest, path, offset, &mut out).await?;
        Ok(Bytes::from(out))
    }

    /// Fills `target` with the verified bytes of `path` from `offset` on (`target.len()` bytes),
    /// fetching up to `restore_concurrency` chunks at once and copying each straight into place.
    pub async fn read_range_into(
        &self,
        manifest: &CheckpointManifest,
        path: &str,
        offset: u64,
        target: &mut [u8],
    ) -> Result<()> {
        let concurrency = self.inner.config.restore_concurrency;
        self.read_range_into_with(manifest, path, offset, target, concurrency).await
    }

    /// [`Client::read_range_into`] with at most `concurrency` chunks in flight: callers reading
    /// several ranges at once share the client's `restore_concurrency` out among them.
    pub async fn read_range_into_with(
        &self,
        manifest: &CheckpointManifest,
        path: &str,
        offset: u64,
        target: &mut [u8],
        concurrency: usize,
    ) -> Result<()> {
        let file = manifest.require(path)?;
        let length = target.len() as u64;
        let end = offset.checked_add(length).filter(|end| *end <= file.size_bytes).ok_or_else(|| {
            Error::InvalidInput(format!("range {offset}+{length} is outside {path} ({} bytes)", file.size_bytes))
        })?;
        // Each chunk gets the part of `target` it fills (chunks come in file order), so they are
        // fetched concurrently straight into place. A loop rather than a stream of closures: the
        // future stays provably Send, so callers can spawn it.
        let mut chunks = file.chunks_in_range(offset, length);
        let mut unfilled: &mut [u8] = target;
        let mut fetched = futures::stream::FuturesUnordered::new();
        loop {
            while fetched.len() < concurrency.max(1) {
                let Some((start, chunk)) = chunks.next() else { break };
                let from = offset.saturating_sub(start);
                let to = (end - start).min(chunk.length_bytes);
                let (part, rest) = std::mem::take(&mut unfilled).split_at_mut(to.saturating_sub(from) as usize);
                unfilled = rest;
                fetched.push(self.read_chunk_part(manifest, chunk, from as usize, part));
            }
            match fetched.next().await {
                Some(result) => result?,
                None => return Ok(()),
            }
        }
    }

    /// Fills `part` with `chunk`'s verified bytes from `from` on: in place when `part` is the
    /// whole chunk, through a whole-chunk read otherwise (a chunk is verified whole).
    async fn read_chunk_part(
        &self,
        manifest: &CheckpointManifest,
        chunk: &ChunkRef,
        from: usize,
        part: &mut [u8],
    ) -> Result<()> {
        if from == 0 && part.len() as u64 == chunk.length_bytes {
            return self.read_chunk_into(manifest, chunk, part).await;
        }
        let data = self.read_chunk(manifest, chunk).await?;
        part.copy_from_slice(&data[from..from + part.len()]);
        starckpt_dataplane::buf::copies::record(part.len());
        Ok(())
    }

    /// A whole file, verified.
    pub async fn read_file(&self, manifest: &CheckpointManifest, path: &str) -> Result<Bytes> {
        let size = manifest.file(path).map(|f| f.size_bytes).unwrap_or(0);
        self.read_range(manifest, path, 0, size).await
    }

    /// Streams the verified contents of `path` to `out`, in order, fetching up to
    /// `restore_concurrency` chunks ahead. Returns the bytes written.
    pub async fn copy_file_to<W: tokio::io::AsyncWrite + Unpin>(
        &self,
        manifest: &CheckpointManifest,
        path: &str,
        out: &mut W,
    ) -> Result<u64> {
        use tokio::io::AsyncWriteExt;
        let file = manifest.require(path)?;
        let mut fetched = futures::stream::iter(file.chunks.iter().map(|chunk| self.read_chunk(manifest, chunk)))
            .buffered(self.inner.config.restore_concurrency.max(1));
        let mut written = 0;
        while let Some(data) = fetched.next().await {
            let data = data?;
            out.write_all(&data).await.map_err(Error::io("write", "output"))?;
            written += data.len() as u64;
        }
        out.flush().await.map_err(Error::io("write", "output"))?;
        Ok(written)
    }

    /// Fills `target` (exactly the file's size) with the verified contents of `path`.
    pub async fn read_into(&self, manifest: &CheckpointManifest, path: &str, target: &mut [u8]) -> Result<()> {
        let size = manifest.file(path).map_or(target.len() as u64, |f| f.size_bytes);
        if target.len() as u64 != size {
            return Err(Error::InvalidInput(format!("{path} is {size} bytes, buffer is {}", target.len())));
        }
        self.read_range_into(manifest, path, 0, target).await
    }

    /// Restores every file and directory of the checkpoint under `to`, which must not exist or be
    /// empty (unless `options.force`). Chunks are fetched in parallel and verified before they
    /// are written; the tree appears at `to` only once complete ([`restore_from`]).
    pub async fn restore(
        &self,
        manifest: &CheckpointManifest,
        to: &Path,
        options: RestoreOptions,
    ) -> Result<RestoreOutcome> {
        self.restore_with_progress(manifest, to, options, Arc::new(RestoreProgress::default())).await
    }

    pub async fn restore_with_progress(
        &self,
        manifest: &CheckpointManifest,
        to: &Path,
        options: RestoreOptions,
        progress: Arc<RestoreProgress>,
    ) -> Result<RestoreOutcome> {
        restore_from(self, manifest, to, options, &progress, self.inner.config.restore_concurrency).await
    }
}

/// Where a restore reads a checkpoint's chunks: the cluster's targets ([`Client`]), or the
/// object-store tier when the cluster is gone (`starckpt restore --from-tier`).
pub trait ChunkSource: Sync {
    /// The chunk's bytes, verified against its hash; an error names the chunk and the source.
    fn read_chunk(&self, manifest: &CheckpointManifest, chunk: &ChunkRef)
    -> impl Future<Output = Result<Bytes>> + Send;
}

impl ChunkSource for Client {
    fn read_chunk(
        &self,
        manifest: &CheckpointManifest,
        chunk: &ChunkRef,
    ) -> impl Future<Output = Result<Bytes>> + Send {
        Client::read_chunk(self, manifest, chunk)
    }
}

/// Restores every file and directory of the checkpoint under `to` from `source`, `concurrency`
/// chunks at a time; see [`Client::restore`]. `to` must not exist or be empty unless
/// `options.force`; the tree is built beside it, made durable, and renamed (or swapped) into
/// place, so `to` never holds a partial restore.
pub async fn restore_from(
    source: &impl ChunkSource,
    manifest: &CheckpointManifest,
    to: &Path,
    options: RestoreOptions,
    progress: &RestoreProgress,
    concurrency: usize,
) -> Result<RestoreOutcome> {
    let to = &destination(to)?;
    let existing = match std::fs::read_dir(to) {
        Ok(mut entries) => Some(entries.next().is_some()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(Error::io("list", to)(e)),
    };
    if existing == Some(true) && !options.force {
        return Err(Error::InvalidInput(format!(
            "{} is not empty; restore into an empty directory or pass --force to replace it",
            to.display()
        )));
    }
    let name = to
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| Error::InvalidInput(format!("{} has no directory name", to.display())))?;
    let parent = match to.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(Error::io("create", &parent))?;
    let lock = DestinationLock::take(&parent, name, to)?;
    let staging = parent.join(format!("{}{}", partial_prefix(name), uuid::Uuid::new_v4().simple()));
    // Removed on every way out (errors, a dropped future) unless it became the destination.
    let unfinished = Arc::new(Unfinished { tree: staging.clone(), placed: AtomicBool::new(false), _lock: lock });
    crate::faults::point("client.restore.begin").map_err(Error::io("restore", to))?;
    restore_into(source, manifest, &unfinished, progress, concurrency).await?;
    if existing == Some(true) {
        // Swap atomically: `to` is always either the old tree or the complete new one. The old
        // tree ends up at the staging name, which is removed when `unfinished` goes.
        // The fault point plays a file system without the exchange.
        let unsupported = |_| std::io::Error::from_raw_os_error(libc::EINVAL);
        match crate::faults::point("client.restore.exchange").map_err(unsupported).and_then(|()| exchange(&staging, to))
        {
            Ok(()) => {}
            // A file system without the exchange (NFS, some FUSE ones): the old tree is moved
            // aside first, so `to` is briefly missing, but never partial.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)) => {
                let aside = parent.join(format!("{}{}", replaced_prefix(name), uuid::Uuid::new_v4().simple()));
                std::fs::rename(to, &aside).map_err(Error::io("move aside", to))?;
                let old = RemoveOnDrop(aside.clone());
                let placed =
                    crate::faults::point("client.restore.into_place").and_then(|()| std::fs::rename(&staging, to));
                if let Err(e) = placed {
                    // A failed restore leaves the destination as it found it: the old tree goes
                    // back, or, if even that fails, stays where it is, and the error says where.
                    std::mem::forget(old);
                    let back =
                        crate::faults::point("client.restore.move_back").and_then(|()| std::fs::rename(&aside, to));
                    let e = match back {
                        Ok(()) => e,
                        Err(back) => std::io::Error::new(
                            e.kind(),
                            format!("{e}; the tree it held is kept at {} (moving it back: {back})", aside.display()),
                        ),
                    };
                    return Err(Error::io("rename into place", to)(e));
                }
            }
            Err(e) => return Err(Error::io("swap into place", to)(e)),
        }
    } else {
        // Missing or empty: a rename replaces an empty directory atomically.
        std::fs::rename(&staging, to).map_err(Error::io("rename into place", to))?;
        unfinished.placed.store(true, Ordering::Relaxed);
    }
    std::fs::File::open(&parent).and_then(|d| d.sync_all()).map_err(Error::io("fsync", &parent))?;
    Ok(RestoreOutcome { files: manifest.files.len(), bytes: manifest.total_bytes() })
}

/// The directory a restore puts its tree at: `to`, or where `to` leads if it is a symbolic
/// link (the link stays; the tree it points to is what is replaced). A destination a rename
/// cannot replace, a mount point, is refused here, before anything is fetched.
fn destination(to: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let to = match std::fs::symlink_metadata(to) {
        Ok(meta) if meta.file_type().is_symlink() => std::fs::canonicalize(to).map_err(|e| {
            Error::InvalidInput(format!(
                "{} is a symbolic link that does not lead to a directory ({e}); create where it points, or \
                 restore elsewhere",
                to.display()
            ))
        })?,
        Ok(_) => to.to_path_buf(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(to.to_path_buf()),
        Err(e) => return Err(Error::io("stat", to)(e)),
    };
    let parent = match to.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let device = |path: &Path| std::fs::metadata(path).map(|m| m.dev()).map_err(Error::io("stat", path));
    if device(&to)? != device(parent)? {
        return Err(Error::InvalidInput(format!(
            "{} is a mount point: a restore builds its tree beside the destination and renames it into \
             place, which cannot replace a mount point; restore into a directory inside it (e.g. {})",
            to.display(),
            to.join("ckpt").display()
        )));
    }
    Ok(to)
}

async fn restore_into(
    source: &impl ChunkSource,
    manifest: &CheckpointManifest,
    unfinished: &Arc<Unfinished>,
    progress: &RestoreProgress,
    concurrency: usize,
) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    // The tree is made off the runtime (a checkpoint may have a million files): a signal that
    // stops the restore is noticed meanwhile. The task holds the unfinished tree, so a restore
    // dropped meanwhile removes it only once the task has ended, which it does early then.
    let held = Arc::clone(unfinished);
    let root = unfinished.tree.as_path();
    let directories: Vec<PathBuf> = manifest.directories.iter().map(|dir| dir.under(root)).collect();
    let sized: Vec<(PathBuf, u64)> =
        manifest.files.iter().map(|file| (file.path.under(root), file.size_bytes)).collect();
    let (dirs, paths) = tokio::task::spawn_blocking(move || {
        let root = held.tree.as_path();
        let abandoned = || held.abandoned().then(|| Error::Cancelled("the restore was stopped".to_owned()));
        std::fs::create_dir(root).map_err(Error::io("create", root))?;
        crate::faults::point("client.restore.tree").map_err(Error::io("create", root))?;
        let mut dirs = std::collections::BTreeSet::from([root.to_path_buf()]);
        for path in directories {
            if let Some(stopped) = abandoned() {
                return Err(stopped);
            }
            std::fs::create_dir_all(&path).map_err(Error::io("create", &path))?;
            dirs.extend(path.ancestors().take_while(|p| p.starts_with(root)).map(Path::to_path_buf));
        }
        // Files are created up front and opened again per chunk write, so a checkpoint with
        // more files than the descriptor limit still restores.
        let mut paths = Vec::with_capacity(sized.len());
        for (path, size) in sized {
            if let Some(stopped) = abandoned() {
                return Err(stopped);
            }
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(Error::io("create", parent))?;
                dirs.extend(parent.ancestors().take_while(|p| p.starts_with(root)).map(Path::to_path_buf));
            }
            // Each path once (the manifest says so), into a fresh tree: a file found there
            // already is another path the file system takes for the same name (a
            // case-insensitive one: `A` and `a`), which would get both files' bytes; an error
            // instead.
            let handle = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
                .map_err(Error::io("create", &path))?;
            handle.set_len(size).map_err(Error::io("size", &path))?;
            paths.push(Arc::new(path));
        }
        Ok::<_, Error>((dirs, paths))
    })
    .await
    .map_err(|e| Error::Cancelled(e.to_string()))??;
    let work = manifest.files.iter().zip(&paths).flat_map(|(file, path)| {
        let mut offset = 0u64;
        file.chunks.iter().map(move |chunk| {
            let start = offset;
            offset += chunk.length_bytes;
            (chunk, start, Arc::clone(path))
        })
    });
    let mut writes = futures::stream::iter(work.map(|(chunk, start, path)| async move {
        let data = source.read_chunk(manifest, chunk).await?;
        let len = data.len() as u64;
        tokio::task::spawn_blocking(move || {
            use std::os::unix::fs::FileExt;
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(path.as_ref())
                .map_err(Error::io("open", path.as_ref()))?;
            file.write_all_at(&data, start).map_err(Error::io("write", path.as_ref()))
        })
        .await
        .map_err(|e| Error::Cancelled(e.to_string()))??;
        progress.verified_bytes.fetch_add(len, Ordering::Relaxed);
        Ok::<(), Error>(())
    }))
    .buffer_unordered(concurrency.max(1));
    while let Some(result) = writes.next().await {
        result?;
    }
    drop(writes);
    // Durable before it is renamed into place: a crash must not leave a restore that looks
    // complete but has holes. Saved modes are applied last, through the descriptor that syncs
    // the file: a file saved read-only (or write-only) could not be opened again to write (or
    // to sync) its bytes once it has its mode, unless by root. Permission bits only: a manifest
    // does not make setuid, setgid or sticky files.
    let modes: Vec<u32> = manifest.files.iter().map(|file| file.mode & 0o777).collect();
    tokio::task::spawn_blocking(move || {
        for (path, mode) in paths.iter().map(|p| p.as_path()).zip(modes) {
            let file = std::fs::OpenOptions::new().write(true).open(path).map_err(Error::io("open", path))?;
            if mode != 0 {
                file.set_permissions(std::fs::Permissions::from_mode(mode)).map_err(Error::io("chmod", path))?;
            }
            file.sync_all().map_err(Error::io("fsync", path))?;
        }
        for path in &dirs {
            std::fs::File::open(path).and_then(|f| f.sync_all()).map_err(Error::io("fsync", path))?;
        }
        Ok::<(), Error>(())
    })
    .await
    .map_err(|e| Error::Cancelled(e.to_string()))??;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_on_targets_down_or_unreachable_are_tried_last() {
        let target = |id: &str, state: pb::TargetState| {
            (id.to_owned(), TargetInfo { target_id: id.into(), state: state as i32, ..Default::default() })
        };
        let targets: HashMap<String, TargetInfo> = [
            target("dead", pb::TargetState::Dead),
            target("alive", pb::TargetState::Alive),
            target("silent", pb::TargetState::Alive),
            target("suspect", pb::TargetState::Suspect),
        ]
        .into_iter()
        .collect();
        let replicas: Vec<String> =
            ["dead", "silent", "unknown", "suspect", "alive"].iter().map(|s| s.to_string()).collect();
        let order = replica_order(&targets, &replicas, |id| id == "silent");
        assert_eq!(order, ["alive", "dead", "unknown", "suspect", "silent"]);
        // Nothing known against any: as listed.
        let order = replica_order(&HashMap::new(), &replicas, |_| false);
        assert_eq!(order, ["dead", "silent", "unknown", "suspect", "alive"]);
    }

    #[test]
    fn a_lock_counts_only_on_the_file_still_at_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lock");
        let file = std::fs::File::create(&path).unwrap();
        assert!(is_at(&file, &path));
        std::fs::remove_file(&path).unwrap();
        assert!(!is_at(&file, &path), "unlinked");
        std::fs::File::create(&path).unwrap();
        assert!(!is_at(&file, &path), "replaced");
    }

    #[test]
    fn a_part_without_a_manifest_is_refused() {
        let info = CheckpointInfo { job: "j".into(), step: 3, world_size: 2, ..Default::default() };
        let part = |rank, manifest| pb::RankManifest { rank, manifest };
        let response = pb::GetManifestResponse {
            checkpoint: Some(info),
            parts: vec![part(0, Some(pb::Manifest::default())), part(1, None)],
            ..Default::default()
        };
        let error = CheckpointManifest::from_response(response).unwrap_err();
        assert!(error.to_string().contains("rank 1 has no manifest"), "{error}");
    }
}
