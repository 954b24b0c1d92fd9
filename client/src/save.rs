//! The asynchronous save pipeline.
//!
//! ```text
//!  caller ──stage──► staging pool buffers ──channel──► upload workers ──► targets
//!  (save() returns        (bounded: ClientConfig      hash (BLAKE3), rendezvous placement,
//!   when the last byte     ::staging_bytes)           HAS (dedup), PUT; buffer back to pool
//!   is staged)                                                   │
//!                                          all chunks acked ──► CommitPart at the control plane
//! ```
//!
//! On a small host, uploads start once the caller's bytes are all staged (or the pool runs out of
//! buffers, for a save larger than the pool): the copy is the only part of a save the trainer
//! waits for, and on 2 cores hashing and sending alongside it slowed it down 1.5-5x. Time to
//! commit grows by the copy time (~0.1-0.2 s per GB). With cores to spare
//! (`ClientConfig::upload_during_staging`, on from 8 cores) uploads start with the first chunk.
//! Waiting, they also wait for the other saves staging on the host (the job's other ranks: they
//! share its cores and memory bandwidth), through a host-wide `flock` (`host_staging.rs`).
//!
//! Memory is bounded by the staging pool: staging waits for a free buffer, and a buffer returns to
//! the pool only when its chunk is durable on a target (or found there already). Pieces smaller
//! than a chunk share buffers ([`Packer`]); such a buffer returns when its last piece is durable.
//! A failed upload stops staging, and the part is never committed: the checkpoint stays pending
//! until a new run takes the job's lease (or the pending timeout) aborts it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use futures::StreamExt;
use starckpt_proto::codec::{self, CompressConfig};
use starckpt_proto::control as pb;
use starckpt_proto::model::{ChunkRef, Codec, FileEntry, Manifest};
use starckpt_proto::{Addressing, ChunkHash, ChunkName, JobName, RelPath};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use starckpt_dataplane::blocking::off_runtime;

use crate::placement::rank_targets;
use crate::transport::{ChunkTransport, Payload, TransportError};
use crate::{Client, Error, Result};

/// One entry of a checkpoint part.
#[derive(Clone, Debug)]
pub enum SaveItem {
    /// A file on local disk, read at staging time.
    File { path: RelPath, source: PathBuf, mode: u32 },
    /// Bytes in memory, copied into staging buffers (the caller may reuse its memory once `save`
    /// returns).
    Buffer { path: RelPath, data: Bytes },
    /// Immutable bytes uploaded straight from the caller's memory: no staging copy at all. The
    /// save holds references to `data` until it is uploaded.
    Shared { path: RelPath, data: Bytes },
    /// A directory to recreate on restore even if empty.
    Directory { path: RelPath },
}

impl SaveItem {
    fn path(&self) -> &RelPath {
        match self {
            SaveItem::File { path, .. }
            | SaveItem::Buffer { path, .. }
            | SaveItem::Shared { path, .. }
            | SaveItem::Directory { path } => path,
        }
    }
}

/// One rank's part of checkpoint (job, step).
#[derive(Clone, Debug)]
pub struct SavePart {
    pub job: String,
    pub step: u64,
    pub rank: u32,
    /// Ranks in this checkpoint; with more than one, every rank's client must have the same run
    /// id ([`crate::ClientConfig::run_id`]).
    pub world_size: u32,
    pub items: Vec<SaveItem>,
    pub metadata: BTreeMap<String, String>,
}

impl SavePart {
    pub fn new(job: impl Into<String>, step: u64) -> SavePart {
        SavePart { job: job.into(), step, rank: 0, world_size: 1, items: Vec::new(), metadata: BTreeMap::new() }
    }

    pub fn rank(mut self, rank: u32, world_size: u32) -> SavePart {
        self.rank = rank;
        self.world_size = world_size;
        self
    }

    pub fn buffer(mut self, path: &str, data: Bytes) -> Result<SavePart> {
        self.items.push(SaveItem::Buffer { path: RelPath::try_from(path)?, data });
        Ok(self)
    }

    /// Zero-copy: uploads `data` from the caller's memory without staging it.
    pub fn shared(mut self, path: &str, data: Bytes) -> Result<SavePart> {
        self.items.push(SaveItem::Shared { path: RelPath::try_from(path)?, data });
        Ok(self)
    }

    pub fn file(mut self, path: &str, source: impl Into<PathBuf>) -> Result<SavePart> {
        self.items.push(SaveItem::File { path: RelPath::try_from(path)?, source: source.into(), mode: 0 });
        Ok(self)
    }

    pub fn directory(mut self, path: &str) -> Result<SavePart> {
        self.items.push(SaveItem::Directory { path: RelPath::try_from(path)? });
        Ok(self)
    }

    pub fn items(mut self, items: Vec<SaveItem>) -> SavePart {
        self.items.extend(items);
        self
    }
}

/// Items for local paths: a file becomes one item named by its file name; a directory contributes
/// its whole tree with paths relative to it (empty directories included). Symlinks and special
/// files are refused rather than silently skipped. Names must be unique across `paths`.
pub fn items_from_paths(paths: &[PathBuf]) -> Result<Vec<SaveItem>> {
    use std::os::unix::fs::PermissionsExt;
    let mut items = Vec::new();
    for root in paths {
        let meta = std::fs::symlink_metadata(root).map_err(Error::io("stat", root))?;
        if meta.is_file() {
            let name = root
                .file_name()
                .and_then(|n| n.to_str())
                .ok_or_else(|| Error::InvalidInput(format!("{} has no UTF-8 file name", root.display())))?;
            items.push(SaveItem::File {
                path: RelPath::try_from(name)?,
                source: root.clone(),
                mode: meta.permissions().mode() & 0o7777,
            });
        } else if meta.is_dir() {
            walk(root, root, &mut items)?;
        } else {
            return Err(Error::InvalidInput(format!("{} is not a regular file or directory", root.display())));
        }
    }
    let mut seen = std::collections::HashSet::new();
    for item in &items {
        if !seen.insert(item.path().clone()) {
            return Err(Error::InvalidInput(format!("two inputs would both be saved as {}", item.path())));
        }
    }
    Ok(items)
}

fn walk(root: &Path, dir: &Path, items: &mut Vec<SaveItem>) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .map_err(Error::io("list", dir))?
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(Error::io("list", dir))?;
    entries.sort_by_key(|e| e.file_name());
    if entries.is_empty() && dir != root {
        items.push(SaveItem::Directory { path: relative(root, dir)? });
    }
    for entry in entries {
        let path = entry.path();
        let meta = std::fs::symlink_metadata(&path).map_err(Error::io("stat", &path))?;
        if meta.is_dir() {
            walk(root, &path, items)?;
        } else if meta.is_file() {
            items.push(SaveItem::File {
                path: relative(root, &path)?,
                source: path,
                mode: meta.permissions().mode() & 0o7777,
            });
        } else {
            return Err(Error::InvalidInput(format!(
                "{} is a symlink or special file; only regular files and directories can be saved",
                path.display()
            )));
        }
    }
    Ok(())
}

fn relative(root: &Path, path: &Path) -> Result<RelPath> {
    let rel =
        path.strip_prefix(root).map_err(|_| Error::InvalidInput(format!("{} escapes its root", path.display())))?;
    let text = rel.to_str().ok_or_else(|| Error::InvalidInput(format!("{} is not UTF-8", path.display())))?;
    Ok(RelPath::try_from(text)?)
}

/// Live counters of a save, updated by the pipeline.
#[derive(Debug, Default)]
pub struct SaveProgress {
    /// Bytes handed to the uploaders (copied into staging, or shared zero-copy).
    pub staged_bytes: AtomicU64,
    /// Of those, bytes copied into staging buffers (0 for a save of shared bytes only).
    pub copied_bytes: AtomicU64,
    pub uploaded_bytes: AtomicU64,
    /// What the uploaded chunks came to as sent and stored (after compression; counted once per
    /// chunk, like `uploaded_bytes`).
    pub stored_bytes: AtomicU64,
    pub deduplicated_bytes: AtomicU64,
    pub chunks: AtomicU64,
    pub deduplicated_chunks: AtomicU64,
    /// Times staging had to wait for uploads to free staging memory or queue slots: then the
    /// caller's stall includes upload time. Non-zero when a save is larger than
    /// [`crate::ClientConfig::staging_bytes`].
    pub staging_waits: AtomicU64,
}

impl SaveProgress {
    /// Bytes whose chunk is durable on a target, uploaded now or found there already.
    pub fn done_bytes(&self) -> u64 {
        self.uploaded_bytes.load(Ordering::Relaxed) + self.deduplicated_bytes.load(Ordering::Relaxed)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitState {
    /// Every rank's part is in: the checkpoint is complete and visible to `latest` (until it is
    /// deleted: a part sent again after its answer was lost, to a checkpoint that committed and
    /// was deleted meanwhile, is answered so too, with a warning).
    Committed,
    /// This part is in; other ranks have not committed yet.
    WaitingForRanks { parts_committed: u32, world_size: u32 },
}

#[derive(Clone, Debug)]
pub struct SaveOutcome {
    pub checkpoint_id: u64,
    pub job: String,
    pub step: u64,
    pub state: CommitState,
    /// The writer-lease epoch the checkpoint was written under.
    pub epoch: u64,
    pub total_bytes: u64,
    pub chunks: u64,
    pub deduplicated_chunks: u64,
    pub uploaded_bytes: u64,
}

impl SaveOutcome {
    pub fn committed(&self) -> bool {
        self.state == CommitState::Committed
    }
}

/// A save whose bytes are staged; resolves when the part is committed.
pub struct SaveHandle {
    pub checkpoint_id: u64,
    pub total_bytes: u64,
    progress: Arc<SaveProgress>,
    task: JoinHandle<Result<SaveOutcome>>,
}

impl std::fmt::Debug for SaveHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaveHandle")
            .field("checkpoint_id", &self.checkpoint_id)
            .field("total_bytes", &self.total_bytes)
            .field("done_bytes", &self.progress.done_bytes())
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl SaveHandle {
    pub fn progress(&self) -> &Arc<SaveProgress> {
        &self.progress
    }

    /// True once the upload and commit have finished (successfully or not).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    pub async fn wait(self) -> Result<SaveOutcome> {
        self.task.await.map_err(|e| Error::Cancelled(e.to_string()))?
    }
}

/// Holds the uploaders back until staging is done or has to wait for a buffer (module docs).
struct UploadGate(tokio::sync::watch::Sender<bool>, Arc<SaveProgress>);

impl UploadGate {
    fn open(&self) {
        self.0.send_replace(true);
    }

    /// A staging buffer; if none is free, lets the uploads start (they return buffers) and waits.
    async fn buffer(&self, pool: &starckpt_dataplane::buf::BufPool) -> starckpt_dataplane::buf::PooledBuf {
        match pool.try_acquire() {
            Some(buf) => buf,
            None => {
                // Counted before the gate opens: the uploads then know not to wait for staging.
                self.1.staging_waits.fetch_add(1, Ordering::Release);
                self.open();
                pool.acquire().await
            }
        }
    }

    /// Queues a staged chunk; if the queue is full, lets the uploads start and waits.
    async fn send(&self, chunks: &mpsc::Sender<StagedChunk>, chunk: StagedChunk) -> Result<()> {
        let closed = || Error::Cancelled("upload stopped".into());
        match chunks.try_send(chunk) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(chunk)) => {
                self.1.staging_waits.fetch_add(1, Ordering::Release);
                self.open();
                chunks.send(chunk).await.map_err(|_| closed())
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(closed()),
        }
    }
}

struct StagedChunk {
    file: usize,
    index: usize,
    /// A staging buffer frozen (it returns to the pool when dropped) or a slice of shared bytes.
    data: Bytes,
}

/// The targets a save places chunks on, in the order the control plane offered them.
#[derive(Clone)]
pub(crate) struct Placement {
    pub(crate) ids: Vec<String>,
    pub(crate) transports: Vec<Arc<dyn ChunkTransport>>,
    pub(crate) addresses: Vec<String>,
    /// Each target's failure domain (its own id when unlabelled).
    pub(crate) domains: Vec<String>,
    /// Copies of each chunk to make (at most the number of targets).
    pub(crate) replicas: usize,
    /// How the job's chunks are addressed (`starckpt_proto::address`).
    pub(crate) addressing: Addressing,
}

impl Client {
    /// Begins (or, for another rank of this run, joins) checkpoint `step` of `job` under this
    /// run's lease, whose epoch it returns too. Sent again after a lost reply, it joins the
    /// checkpoint the first one began.
    pub(crate) async fn begin(
        &self,
        job: &JobName,
        step: u64,
        world_size: u32,
    ) -> Result<(u64, pb::BeginCheckpointResponse)> {
        let epoch = self.lease(job.as_str()).await?;
        let request = pb::BeginCheckpointRequest { job: job.to_string(), step, world_size, epoch };
        let begun = self
            .rpc("begin checkpoint", crate::Resend::Idempotent, request, |mut c, r| async move {
                c.begin_checkpoint(r).await
            })
            .await?;
        Ok((epoch, begun))
    }

    /// How the chunks of the job named `job` are addressed, as its control plane says (for
    /// writers that upload before they begin a checkpoint).
    pub(crate) async fn chunk_addressing(&self, job: &JobName) -> Result<Addressing> {
        let request = pb::ChunkAddressingRequest { job: job.to_string() };
        let response = self
            .rpc("chunk addressing", crate::Resend::Idempotent, request, |mut c, r| async move {
                c.chunk_addressing(r).await
            })
            .await?;
        addressing_from(&response.chunk_key)
    }

    /// Sends one rank's manifest; says whether that completed the checkpoint.
    pub(crate) async fn commit_manifest(
        &self,
        checkpoint_id: u64,
        rank: u32,
        manifest: &Manifest,
        written_bytes: u64,
    ) -> Result<CommitState> {
        let injected = |e: std::io::Error| tonic::Status::unavailable(e.to_string());
        crate::faults::point("client.commit").map_err(injected).map_err(self.status("commit part"))?;
        // Sent again after a lost reply, it commits nothing twice: an identical part is a no-op.
        let request =
            pb::CommitPartRequest { checkpoint_id, rank, manifest: Some(pb::Manifest::from(manifest)), written_bytes };
        let response = self
            .rpc("commit part", crate::Resend::Idempotent, request, |mut c, r| async move { c.commit_part(r).await })
            .await?;
        crate::faults::point("client.commit.reply").map_err(injected).map_err(self.status("commit part"))?;
        match pb::CheckpointState::try_from(response.state) {
            Ok(pb::CheckpointState::Committed) => Ok(CommitState::Committed),
            // This part, sent again after its answer was lost, had committed the checkpoint (or
            // been in it when another rank's did); it has been deleted since.
            Ok(pb::CheckpointState::Deleted) => {
                tracing::warn!(checkpoint_id, rank, "checkpoint committed, and deleted since (retention or rm)");
                Ok(CommitState::Committed)
            }
            Ok(pb::CheckpointState::Pending) => Ok(CommitState::WaitingForRanks {
                parts_committed: response.parts_committed,
                world_size: response.world_size,
            }),
            // The control plane refuses a part of an ended checkpoint; an answer saying so anyway
            // is no save waiting for ranks.
            _ => Err(Error::Rejected {
                op: "commit part",
                message: format!("checkpoint {checkpoint_id} answered state {} to a committed part", response.state),
            }),
        }
    }

    pub(crate) fn placement(
        &self,
        targets: &[pb::TargetInfo],
        replicas: u32,
        addressing: Addressing,
    ) -> Result<Placement> {
        let mut placement = Placement {
            addressing,
            ids: vec![],
            transports: vec![],
            addresses: vec![],
            domains: vec![],
            replicas: (replicas as usize).clamp(1, targets.len().max(1)),
        };
        for target in targets {
            placement.transports.push(self.transport(&target.target_id, &target.data_address)?);
            placement.ids.push(target.target_id.clone());
            placement.addresses.push(target.data_address.clone());
            let domain = if target.failure_domain.is_empty() { &target.target_id } else { &target.failure_domain };
            placement.domains.push(domain.clone());
        }
        Ok(placement)
    }

    /// Starts saving a part. Returns once every byte is copied into staging buffers; the returned
    /// handle resolves when the part is committed (and says whether that completed the checkpoint).
    ///
    /// Back-pressure: if this client's previous save is still uploading, this one first waits for
    /// it to finish. [`Client::try_save`] skips instead.
    pub async fn save(&self, part: SavePart) -> Result<SaveHandle> {
        self.save_borrowed(part, &[]).await
    }

    /// Like [`Client::save`], but if this client's previous save is still uploading, skips this one
    /// and returns `Ok(None)` (the trainer goes on and saves a later step).
    pub async fn try_save(&self, part: SavePart) -> Result<Option<SaveHandle>> {
        self.try_save_borrowed(part, &[]).await
    }

    /// [`Client::save`] of `part` plus files whose bytes the caller lends: `(path, bytes)` pairs,
    /// copied into staging buffers during this call, so the caller may change its memory as soon
    /// as the call returns. For trainers whose state lives in their own mutable buffers: the one
    /// copy is the staging copy (with [`SavePart::buffer`] they would first copy into `Bytes`).
    pub async fn save_borrowed(&self, part: SavePart, borrowed: &[(&str, &[u8])]) -> Result<SaveHandle> {
        self.save_lent(part, &as_lent(borrowed)).await
    }

    /// [`Client::try_save`] with lent bytes, as [`Client::save_borrowed`].
    pub async fn try_save_borrowed(&self, part: SavePart, borrowed: &[(&str, &[u8])]) -> Result<Option<SaveHandle>> {
        self.try_save_lent(part, &as_lent(borrowed)).await
    }

    /// [`Client::save_borrowed`] generalised to [`Lent`] sources: bytes in memory, or a fill
    /// function that writes each staging buffer itself (a device-to-host copy straight into
    /// staging, for example). Every source is consumed during this call.
    pub async fn save_lent(&self, part: SavePart, lent: &[(&str, Lent<'_>)]) -> Result<SaveHandle> {
        let slot = Arc::clone(&self.inner.upload_slot).acquire_owned().await.expect("never closed");
        self.save_in_slot(part, lent, slot).await
    }

    /// [`Client::try_save`] with [`Lent`] sources.
    pub async fn try_save_lent(&self, part: SavePart, lent: &[(&str, Lent<'_>)]) -> Result<Option<SaveHandle>> {
        match Arc::clone(&self.inner.upload_slot).try_acquire_owned() {
            Ok(slot) => self.save_in_slot(part, lent, slot).await.map(Some),
            Err(_) => {
                tracing::info!(job = %part.job, step = part.step, "previous save still uploading; skipped this one");
                Ok(None)
            }
        }
    }

    async fn save_in_slot(
        &self,
        part: SavePart,
        lent: &[(&str, Lent<'_>)],
        slot: tokio::sync::OwnedSemaphorePermit,
    ) -> Result<SaveHandle> {
        let job = JobName::try_from(part.job.as_str())?;
        let borrowed = lent
            .iter()
            .map(|(path, source)| Ok((RelPath::try_from(*path)?, *source)))
            .collect::<Result<Vec<(RelPath, Lent<'_>)>>>()?;
        let mut seen = std::collections::HashSet::new();
        if let Some(path) =
            part.items.iter().map(SaveItem::path).chain(borrowed.iter().map(|(p, _)| p)).find(|p| !seen.insert(*p))
        {
            return Err(Error::InvalidInput(format!("{path} is saved twice in one part")));
        }
        if part.world_size > 1 && !self.inner.run_id_shared {
            return Err(Error::InvalidInput(
                "a save with several ranks needs a run id shared by all ranks (--run-id, STARCKPT_RUN_ID or \
                 torchrun's TORCHELASTIC_RUN_ID)"
                    .into(),
            ));
        }
        if part.rank >= part.world_size {
            return Err(Error::InvalidInput(format!("rank {} is outside world size {}", part.rank, part.world_size)));
        }
        let progress = Arc::new(SaveProgress::default());
        // Every message holds a staging buffer or a slice of a shared one, so the pool bounds the
        // memory behind this queue; a channel with fewer slots than messages would make staging
        // wait for uploads while buffers sit free (the trainer would stall for the upload instead
        // of the copy). Whole chunks take one slot per buffer; packed small pieces (many per
        // buffer) get MAX_PACKED_PIECES more. The slots are allocated as used.
        let (chunks, receiver) = mpsc::channel::<StagedChunk>(self.inner.staging.max_buffers() + MAX_PACKED_PIECES);
        let (gate, gate_open) = tokio::sync::watch::channel(false);
        let gate = UploadGate(gate, Arc::clone(&progress));
        if self.inner.config.upload_during_staging {
            gate.open();
        }
        // Uploads that wait for staging also wait for the host's other saves to stage.
        let host = self.inner.config.host_staging_lock.clone().filter(|_| !self.inner.config.upload_during_staging);
        let staging_on_host = match &host {
            Some(path) => crate::host_staging::Staging::begin(path).await,
            None => None,
        };
        // The checkpoint is begun while the part is staged: the trainer waits for the slower of
        // the two, not both (a job's ranks all begin at once, and their begins queue at the
        // control plane's writer). Nothing reaches a target before the begin is answered (the
        // uploads start after it), so every chunk a commit names is used after its checkpoint
        // began, which garbage collection relies on (`server/src/control/gc.rs`).
        let (begun_tx, begun) = tokio::sync::oneshot::channel();
        let uploads = tokio::spawn({
            let (client, job, progress) = (self.clone(), job.clone(), Arc::clone(&progress));
            let (step, world_size, concurrency) = (part.step, part.world_size, self.inner.config.upload_concurrency);
            async move {
                let (epoch, begin) = client.begin(&job, step, world_size).await?;
                let addressing = addressing_from(&begin.chunk_key)?;
                let placement = client.placement(&begin.placement, begin.replicas, addressing)?;
                let _ = begun_tx.send((epoch, begin.checkpoint_id, addressing));
                upload_all(client, receiver, gate_open, host, placement, progress, concurrency.max(1)).await
            }
        });
        let staged = self.stage(&part.items, &borrowed, &chunks, &gate, &progress).await;
        drop((staging_on_host, chunks));
        gate.open();
        // A failed begin or upload drops the queue (failing the staging) and is the real cause.
        let failed = |uploads: tokio::task::JoinHandle<Result<ChunkRefs>>, otherwise: Error| async move {
            match uploads.await {
                Ok(Err(upload_error)) => upload_error,
                _ => otherwise,
            }
        };
        let files = match staged {
            Ok(files) => files,
            Err(stage_error) => return Err(failed(uploads, stage_error).await),
        };
        let (epoch, checkpoint_id, addressing) = match begun.await {
            Ok(begun) => begun,
            Err(_) => return Err(failed(uploads, Error::Cancelled("the checkpoint was never begun".into())).await),
        };
        let total_bytes = files.iter().map(|f| f.size).sum();
        let client = self.clone();
        let task_progress = Arc::clone(&progress);
        let task = tokio::spawn(async move {
            // Held until the part is committed (or failed): the next save waits for, or skips on, it.
            let _slot = slot;
            let mut chunk_refs = uploads.await.map_err(|e| Error::Cancelled(e.to_string()))??;
            let mut manifest = Manifest { metadata: part.metadata.clone(), addressing, ..Default::default() };
            for (file_index, file) in files.into_iter().enumerate() {
                match file.kind {
                    StagedKind::Directory => manifest.directories.push(file.path),
                    StagedKind::File { mode } => {
                        let chunks = (0..file.chunks)
                            .map(|index| {
                                chunk_refs.remove(&(file_index, index)).ok_or_else(|| {
                                    Error::Cancelled(format!("chunk {index} of {} was never uploaded", file.path))
                                })
                            })
                            .collect::<Result<Vec<_>>>()?;
                        manifest.files.push(FileEntry { path: file.path, size_bytes: file.size, mode, chunks });
                    }
                }
            }
            let written = task_progress.uploaded_bytes.load(Ordering::Relaxed);
            let state = client.commit_manifest(checkpoint_id, part.rank, &manifest, written).await?;
            Ok(SaveOutcome {
                checkpoint_id,
                job: part.job,
                step: part.step,
                state,
                epoch,
                total_bytes,
                chunks: task_progress.chunks.load(Ordering::Relaxed),
                deduplicated_chunks: task_progress.deduplicated_chunks.load(Ordering::Relaxed),
                uploaded_bytes: task_progress.uploaded_bytes.load(Ordering::Relaxed),
            })
        });
        Ok(SaveHandle { checkpoint_id, total_bytes, progress, task })
    }

    /// Copies every item, then every lent file, into staging buffers and hands them to the
    /// uploaders.
    async fn stage(
        &self,
        items: &[SaveItem],
        borrowed: &[(RelPath, Lent<'_>)],
        chunks: &mpsc::Sender<StagedChunk>,
        gate: &UploadGate,
        progress: &SaveProgress,
    ) -> Result<Vec<StagedFile>> {
        let pool = &self.inner.staging;
        let chunk_size = self.inner.config.chunk_size_bytes;
        let mut files = Vec::with_capacity(items.len());
        let mut packer = Packer { current: None, gate, chunks };
        for (file_index, item) in items.iter().enumerate() {
            match item {
                SaveItem::Directory { path } => {
                    files.push(StagedFile { path: path.clone(), size: 0, chunks: 0, kind: StagedKind::Directory })
                }
                SaveItem::Buffer { path, data } => {
                    let source = Lent::Bytes(data.as_ref());
                    let index = self.stage_copies(file_index, path, source, &mut packer, progress).await?;
                    files.push(StagedFile {
                        path: path.clone(),
                        size: data.len() as u64,
                        chunks: index,
                        kind: StagedKind::File { mode: 0 },
                    });
                }
                SaveItem::Shared { path, data } => {
                    let mut index = 0;
                    for start in (0..data.len()).step_by(chunk_size) {
                        let piece = data.slice(start..(start + chunk_size).min(data.len()));
                        progress.staged_bytes.fetch_add(piece.len() as u64, Ordering::Relaxed);
                        gate.send(chunks, StagedChunk { file: file_index, index, data: piece }).await?;
                        index += 1;
                    }
                    files.push(StagedFile {
                        path: path.clone(),
                        size: data.len() as u64,
                        chunks: index,
                        kind: StagedKind::File { mode: 0 },
                    });
                }
                SaveItem::File { path, source, mode } => {
                    let mut file = Some(open_regular(source)?);
                    let (mut index, mut size) = (0usize, 0u64);
                    loop {
                        let buf = packer.buffer(pool).await?;
                        let taken = file.take().expect("file is returned after each read");
                        let (returned, buf, read) = tokio::task::spawn_blocking(move || {
                            let mut buf = buf;
                            let read = read_full(&taken, &mut buf.buf_mut().full_mut()[..chunk_size]);
                            if let Ok(n) = read {
                                buf.buf_mut().set_len(n);
                            }
                            (taken, buf, read)
                        })
                        .await
                        .map_err(|e| Error::Cancelled(e.to_string()))?;
                        file = Some(returned);
                        let n = read.map_err(Error::io("read", source))?;
                        if n == 0 {
                            break;
                        }
                        size += n as u64;
                        progress.staged_bytes.fetch_add(n as u64, Ordering::Relaxed);
                        progress.copied_bytes.fetch_add(n as u64, Ordering::Relaxed);
                        let data = buf.freeze();
                        gate.send(chunks, StagedChunk { file: file_index, index, data }).await?;
                        index += 1;
                        if n < chunk_size {
                            break;
                        }
                    }
                    files.push(StagedFile {
                        path: path.clone(),
                        size,
                        chunks: index,
                        kind: StagedKind::File { mode: *mode },
                    });
                }
            }
        }
        for (path, source) in borrowed {
            let index = self.stage_copies(files.len(), path, *source, &mut packer, progress).await?;
            files.push(StagedFile {
                path: path.clone(),
                size: source.len(),
                chunks: index,
                kind: StagedKind::File { mode: 0 },
            });
        }
        packer.flush().await?;
        Ok(files)
    }
}

/// Pieces smaller than a chunk (a file's tail, a small file) share staging buffers: copied one
/// after another into the current buffer and handed to the uploaders as slices of it once it is
/// full or staging ends (the buffer returns to the pool when the last slice is uploaded). Without
/// this each would hold a whole chunk-sized buffer, and a model's hundreds of small tensors
/// (norms, biases) would exhaust staging long before its bytes do, making the trainer wait for
/// uploads.
struct Packer<'a> {
    current: Option<Packing>,
    gate: &'a UploadGate,
    chunks: &'a mpsc::Sender<StagedChunk>,
}

struct Packing {
    buf: starckpt_dataplane::buf::PooledBuf,
    used: usize,
    /// (file, chunk index, start in the buffer, length)
    pieces: Vec<(usize, usize, usize, usize)>,
}

impl Packer<'_> {
    /// A whole staging buffer for a whole chunk. If none is free, the packed buffer is handed to
    /// the uploaders first: it may be the one this would wait for.
    async fn buffer(&mut self, pool: &starckpt_dataplane::buf::BufPool) -> Result<starckpt_dataplane::buf::PooledBuf> {
        if let Some(buf) = pool.try_acquire() {
            return Ok(buf);
        }
        self.flush().await?;
        Ok(self.gate.buffer(pool).await)
    }

    /// Copies a piece in with `copy`, starting a new buffer when the current one has no room.
    async fn add(
        &mut self,
        pool: &starckpt_dataplane::buf::BufPool,
        chunk_size: usize,
        (file, index, len): (usize, usize, usize),
        copy: impl FnOnce(&mut [u8]) -> std::result::Result<(), String>,
    ) -> Result<std::result::Result<(), String>> {
        if self.current.as_ref().is_some_and(|p| p.used + len > chunk_size) {
            self.flush().await?;
        }
        if self.current.is_none() {
            self.current = Some(Packing { buf: self.gate.buffer(pool).await, used: 0, pieces: Vec::new() });
        }
        let packing = self.current.as_mut().expect("just set");
        let start = packing.used;
        // Off the async runtime, like every staging copy (a fill may be a device-to-host copy).
        if let Err(message) = off_runtime(|| copy(&mut packing.buf.buf_mut().full_mut()[start..start + len])) {
            return Ok(Err(message));
        }
        packing.pieces.push((file, index, start, len));
        packing.used += len;
        Ok(Ok(()))
    }

    /// Hands the current buffer's pieces to the uploaders.
    async fn flush(&mut self) -> Result<()> {
        let Some(mut packing) = self.current.take() else { return Ok(()) };
        packing.buf.buf_mut().set_len(packing.used);
        let data = packing.buf.freeze();
        for (file, index, start, len) in packing.pieces {
            self.gate.send(self.chunks, StagedChunk { file, index, data: data.slice(start..start + len) }).await?;
        }
        Ok(())
    }
}

impl Client {
    /// Copies `source` into staging buffers and hands each staged chunk to the uploaders.
    /// Returns the number of chunks.
    ///
    /// The copy runs on the caller's task (`block_in_place`), batches of `staging_threads` chunks
    /// split across scoped threads. Measured on 2 cores with uploads running: handing each copy to
    /// the blocking pool instead stalled the caller ~2.5x longer, because the copies then queued
    /// behind the uploaders' hashing; the caller's own thread is the one the trainer waits on.
    async fn stage_copies(
        &self,
        file_index: usize,
        path: &RelPath,
        source: Lent<'_>,
        packer: &mut Packer<'_>,
        progress: &SaveProgress,
    ) -> Result<usize> {
        let (gate, chunks) = (packer.gate, packer.chunks);
        let pool = &self.inner.staging;
        let chunk_size = self.inner.config.chunk_size_bytes;
        let size = usize::try_from(source.len())
            .map_err(|_| Error::InvalidInput(format!("{path}: {} bytes do not fit in memory", source.len())))?;
        let threads = self.inner.config.staging_threads.max(1);
        let starts: Vec<usize> = (0..size).step_by(chunk_size).collect();
        let piece = |index: usize| (starts[index], (starts[index] + chunk_size).min(size) - starts[index]);
        let staging_error = |message| Error::InvalidInput(format!("staging {path}: {message}"));
        // Whole chunks get buffers of their own; a last piece smaller than a chunk is packed.
        let whole = if size % chunk_size == 0 { starts.len() } else { starts.len() - 1 };
        let mut next = 0;
        while next < whole {
            // One batch: every buffer free right now (at least one, waiting for it if need be), so
            // the copy leaves the async runtime once per batch rather than once per chunk.
            let first = next;
            let mut staged = vec![(piece(next), packer.buffer(pool).await?)];
            next += 1;
            while next < whole && staged.len() < MAX_COPY_BATCH {
                let Some(buf) = pool.try_acquire() else { break };
                staged.push((piece(next), buf));
                next += 1;
            }
            copy_blocking(source, &mut staged, threads).map_err(staging_error)?;
            for (offset, ((_, len), buf)) in staged.into_iter().enumerate() {
                progress.staged_bytes.fetch_add(len as u64, Ordering::Relaxed);
                progress.copied_bytes.fetch_add(len as u64, Ordering::Relaxed);
                gate.send(chunks, StagedChunk { file: file_index, index: first + offset, data: buf.freeze() }).await?;
            }
        }
        if whole < starts.len() {
            let (offset, len) = piece(whole);
            let copy = |out: &mut [u8]| source.copy_into(offset, out);
            packer.add(pool, chunk_size, (file_index, whole, len), copy).await?.map_err(staging_error)?;
            progress.staged_bytes.fetch_add(len as u64, Ordering::Relaxed);
            progress.copied_bytes.fetch_add(len as u64, Ordering::Relaxed);
        }
        Ok(starts.len())
    }
}

/// A function that fills `buffer` with a lent file's bytes from `offset` on (all of it), or says
/// why it could not.
pub type FillFn<'f> = dyn Fn(u64, &mut [u8]) -> std::result::Result<(), String> + Sync + 'f;

/// Bytes a save takes from the caller during the call ([`Client::save_lent`]).
#[derive(Clone, Copy)]
pub enum Lent<'a> {
    /// The caller's memory, copied into staging.
    Bytes(&'a [u8]),
    /// `size` bytes written by `fill(offset, buffer)` straight into each staging buffer in turn
    /// (buffers of one file may be filled from several threads, in any order): a device-to-host
    /// copy, say, which then needs no host copy of its own.
    Fill { size: u64, fill: &'a FillFn<'a> },
}

impl Lent<'_> {
    pub fn len(&self) -> u64 {
        match self {
            Lent::Bytes(data) => data.len() as u64,
            Lent::Fill { size, .. } => *size,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Writes bytes `[offset, offset + out.len())` of the source into `out`.
    fn copy_into(&self, offset: usize, out: &mut [u8]) -> std::result::Result<(), String> {
        match self {
            Lent::Bytes(data) => {
                out.copy_from_slice(&data[offset..offset + out.len()]);
                Ok(())
            }
            Lent::Fill { fill, .. } => fill(offset as u64, out),
        }
    }
}

impl std::fmt::Debug for Lent<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lent::Bytes(data) => write!(f, "Lent::Bytes({} bytes)", data.len()),
            Lent::Fill { size, .. } => write!(f, "Lent::Fill({size} bytes)"),
        }
    }
}

fn as_lent<'a>(borrowed: &[(&'a str, &'a [u8])]) -> Vec<(&'a str, Lent<'a>)> {
    borrowed.iter().map(|(path, data)| (*path, Lent::Bytes(data))).collect()
}

/// Most chunks staged in one batch (1 GiB at 4 MiB chunks).
const MAX_COPY_BATCH: usize = 256;

/// Queue slots for packed small pieces beyond one per staging buffer (a model's small tensors);
/// a save with more waits for uploads to drain them.
const MAX_PACKED_PIECES: usize = 16 << 10;

/// Copies each `(offset, len)` piece of `source` into its buffer: the batch split into `threads`
/// runs of chunks, one per thread (the current one included), without stalling other tasks of a
/// multi-threaded runtime. The first failure of a fill is returned (after every run finished).
fn copy_blocking(
    source: Lent<'_>,
    staged: &mut [((usize, usize), starckpt_dataplane::buf::PooledBuf)],
    threads: usize,
) -> std::result::Result<(), String> {
    let copy_run = |run: &mut [((usize, usize), starckpt_dataplane::buf::PooledBuf)]| {
        for ((offset, len), buf) in run {
            source.copy_into(*offset, &mut buf.buf_mut().full_mut()[..*len])?;
            buf.buf_mut().set_len(*len);
        }
        Ok::<(), String>(())
    };
    let per_thread = staged.len().div_ceil(threads.max(1)).max(1);
    let run = || {
        let mut runs = staged.chunks_mut(per_thread);
        let Some(own) = runs.next() else { return Ok(()) };
        std::thread::scope(|scope| {
            let others: Vec<_> = runs.map(|other| scope.spawn(move || copy_run(other))).collect();
            let mut result = copy_run(own);
            for other in others {
                let joined = other.join().unwrap_or_else(|_| Err("a staging copy thread panicked".into()));
                result = result.and(joined);
            }
            result
        })
    };
    off_runtime(run)
}

/// Opens a file item's source for staging, refusing anything but a regular file: a path replaced
/// by a FIFO or a device since it was listed must not hang or stream without end. (Non-blocking
/// open, so a FIFO without a writer does not block; reads of a regular file ignore the flag.)
fn open_regular(source: &Path) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(source)
        .map_err(Error::io("open", source))?;
    let meta = file.metadata().map_err(Error::io("stat", source))?;
    if !meta.is_file() {
        return Err(Error::InvalidInput(format!("{} is not a regular file", source.display())));
    }
    // Blocking reads from here on (a network filesystem may honour the flag with EAGAIN).
    // SAFETY: F_GETFL/F_SETFL on a descriptor `file` owns.
    let cleared = unsafe {
        let flags = libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&file), libc::F_GETFL);
        flags >= 0 && libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&file), libc::F_SETFL, flags & !libc::O_NONBLOCK) == 0
    };
    if !cleared {
        return Err(Error::io("fcntl", source)(std::io::Error::last_os_error()));
    }
    Ok(file)
}

fn read_full(file: &std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    use std::io::Read;
    let mut reader = file;
    let mut done = 0;
    while done < buf.len() {
        match reader.read(&mut buf[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

enum StagedKind {
    File { mode: u32 },
    Directory,
}

struct StagedFile {
    path: RelPath,
    size: u64,
    chunks: usize,
    kind: StagedKind,
}

type ChunkRefs = std::collections::HashMap<(usize, usize), ChunkRef>;

async fn upload_all(
    client: Client,
    receiver: mpsc::Receiver<StagedChunk>,
    mut gate: tokio::sync::watch::Receiver<bool>,
    host: Option<PathBuf>,
    placement: Placement,
    progress: Arc<SaveProgress>,
    concurrency: usize,
) -> Result<ChunkRefs> {
    let placement = Arc::new(placement);
    // A long save hears, every TARGETS_REFRESH, which targets the control plane found silent
    // since it began (heartbeats stopped, or another client's report), and places no more copies
    // there while others will do.
    let watcher = tokio::spawn({
        let client = client.clone();
        async move {
            let mut every = tokio::time::interval(TARGETS_REFRESH);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            every.tick().await;
            loop {
                every.tick().await;
                if let Err(error) = client.refresh_targets().await {
                    tracing::debug!(%error, "could not refresh the targets' states during a save");
                }
            }
        }
    });
    let _watching = AbortOnDrop(watcher.abort_handle());
    // A dropped gate (staging failed) also lets the queue drain. Opened because staging is done
    // (not because it ran out of buffers, which only these uploads give back), the uploads wait
    // for the host's other saves to stage too (`host_staging.rs`).
    let staged = gate.wait_for(|open| *open).await.is_ok();
    if staged
        && progress.staging_waits.load(Ordering::Acquire) == 0
        && let Some(path) = &host
    {
        crate::host_staging::wait_for_others(path).await;
    }
    let mut receiver = receiver;
    let staged = futures::stream::poll_fn(move |cx| receiver.poll_recv(cx));
    let mut uploads = staged
        .map(|chunk| {
            let (client, placement, progress) = (client.clone(), Arc::clone(&placement), Arc::clone(&progress));
            async move {
                let (file, index) = (chunk.file, chunk.index);
                upload_one(&client, chunk.data, &placement, &progress).await.map(|chunk_ref| ((file, index), chunk_ref))
            }
        })
        .buffer_unordered(concurrency);
    let mut refs = ChunkRefs::new();
    while let Some(result) = uploads.next().await {
        let (key, chunk_ref) = result?;
        refs.insert(key, chunk_ref);
    }
    Ok(refs)
}

/// How often a save still uploading asks the control plane how the targets stand: one request
/// per saving client per period, only from saves that take longer than it.
const TARGETS_REFRESH: std::time::Duration = std::time::Duration::from_secs(5);

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A copy lagging its chunk's first finished copy by this factor of that copy's time gets a
/// hedge: the same copy started on the next candidate target.
const HEDGE_FACTOR: u32 = 4;
/// ... and by at least this long: below it, differences are queueing noise, not a sick target.
const HEDGE_AFTER_MIN: std::time::Duration = std::time::Duration::from_millis(500);

/// Hashes one staged chunk and makes it durable on `placement.replicas` distinct targets: the
/// first ones in rendezvous order (targets this client recently found silent last), skipping
/// targets in a failure domain that already holds a copy while other domains remain. A target
/// that is unreachable, full, or misses its request's deadline is skipped for the next
/// candidate; the manifest records where each copy really is. Fails unless every copy is made.
///
/// Hedging: once one copy of the chunk is durable, a copy still running [`HEDGE_FACTOR`] times
/// longer (at least [`HEDGE_AFTER_MIN`]) is started on the next candidate as well, once per
/// chunk, and its target is tried last by this client's next chunks for a while (a silent host
/// would otherwise cost each chunk placed there its full deadline). The extra traffic is at most
/// one copy per lagging copy, and stops once the lagging target ranks last. Each copy runs in a
/// task of its own, to its deadline even when the chunk no longer waits for it: a request given
/// up keeps the memory it lent the target until the target can no longer touch it, and its
/// outcome still tells this client whether the target answers.
pub(crate) async fn upload_one(
    client: &Client,
    data: Bytes,
    placement: &Arc<Placement>,
    progress: &SaveProgress,
) -> Result<ChunkRef> {
    let length = data.len() as u64;
    let hashed = data.clone();
    let content = tokio::task::spawn_blocking(move || ChunkHash::of(&hashed))
        .await
        .map_err(|e| Error::Cancelled(e.to_string()))?;
    let name = placement.addressing.name(content);
    let hash = name.address;
    let chunk =
        Arc::new(ChunkBytes { data, compression: client.config().compression, payload: tokio::sync::OnceCell::new() });
    progress.chunks.fetch_add(1, Ordering::Relaxed);
    let ids: Vec<&str> = placement.ids.iter().map(String::as_str).collect();
    // Rendezvous order, but targets this client recently found silent or unreachable last: a
    // host that stopped answering costs a save one deadline, not one per chunk.
    let targets = &client.inner.targets;
    let (mut order, silent): (Vec<usize>, Vec<usize>) =
        rank_targets(&hash, &ids).into_iter().partition(|&i| !targets.unreachable(&placement.ids[i]));
    order.extend(silent);
    let wanted = placement.replicas.clamp(1, order.len().max(1));
    let mut stored: Vec<usize> = Vec::with_capacity(wanted);
    let mut running: Vec<usize> = Vec::with_capacity(wanted);
    let mut tried = vec![false; placement.ids.len()];
    // The next candidate: untried, in a domain without a copy (made or being made) first.
    let next = |tried: &[bool], stored: &[usize], running: &[usize]| {
        let used: std::collections::HashSet<&str> =
            stored.iter().chain(running).map(|&i| placement.domains[i].as_str()).collect();
        let untried = || order.iter().copied().filter(|&i| !tried[i]);
        untried().find(|&i| !used.contains(placement.domains[i].as_str())).or_else(|| untried().next())
    };
    let launch = |index: usize| {
        let (client, placement, chunk) = (client.clone(), Arc::clone(placement), Arc::clone(&chunk));
        let task = tokio::spawn(async move {
            let started = std::time::Instant::now();
            let outcome = store_on(&client, &placement, index, &name, &chunk).await;
            let reached = !matches!(&outcome, Err(Error::Target { source, .. }) if source.is_connection());
            client.reached(&placement.ids[index], reached);
            (outcome, started.elapsed())
        });
        async move { (index, task.await) }
    };
    let mut copies = futures::stream::FuturesUnordered::new();
    let mut hedge_at: Option<tokio::time::Instant> = None;
    let mut hedged = false;
    let mut uploaded = false;
    let mut last_error = None;
    while stored.len() < wanted {
        while stored.len() + running.len() < wanted {
            let Some(index) = next(&tried, &stored, &running) else { break };
            tried[index] = true;
            running.push(index);
            copies.push(launch(index));
        }
        let finished = match hedge_at.filter(|_| !hedged && !running.is_empty()) {
            Some(at) => match tokio::time::timeout_at(at, copies.next()).await {
                Ok(finished) => finished,
                Err(_) => {
                    hedged = true;
                    for lagging in running.clone() {
                        let Some(index) = next(&tried, &stored, &running) else { break };
                        tracing::info!(
                            chunk = %hash, lagging = %placement.ids[lagging], hedge = %placement.ids[index],
                            "a copy lags its sibling; starting it on another target too"
                        );
                        client.reached(&placement.ids[lagging], false);
                        tried[index] = true;
                        running.push(index);
                        copies.push(launch(index));
                    }
                    continue;
                }
            },
            None => copies.next().await,
        };
        let Some((index, joined)) = finished else { break };
        running.retain(|&i| i != index);
        let (outcome, took) = joined.map_err(|e| Error::Cancelled(e.to_string()))?;
        match outcome {
            Ok(already_present) => {
                uploaded |= !already_present;
                stored.push(index);
                let lag = (took * HEDGE_FACTOR).max(HEDGE_AFTER_MIN);
                hedge_at.get_or_insert(tokio::time::Instant::now() + lag);
            }
            Err(error) => {
                let Error::Target { source, .. } = &error else { return Err(error) };
                let retry_elsewhere = source.is_connection()
                    || matches!(
                        source,
                        TransportError::Remote {
                            code: starckpt_proto::data::ErrorCode::NoSpace
                                | starckpt_proto::data::ErrorCode::Busy
                                | starckpt_proto::data::ErrorCode::Internal
                                // A target set up with another cluster's key.
                                | starckpt_proto::data::ErrorCode::Unauthorized,
                            ..
                        }
                    );
                if !retry_elsewhere {
                    return Err(error);
                }
                tracing::warn!(%error, chunk = %hash, "target failed; placing the copy on the next candidate");
                last_error = Some(error);
            }
        }
    }
    if stored.len() < wanted {
        let last = last_error.unwrap_or_else(|| Error::InvalidInput("no live targets were offered".into()));
        return Err(if stored.is_empty() {
            Error::NoTarget { hash, last: Box::new(last) }
        } else {
            Error::Underreplicated { hash, stored: stored.len(), wanted, last: Box::new(last) }
        });
    }
    // Counted once per chunk, whatever the replication: `done_bytes` compares with the save's size.
    // The stored form, if a copy was sent (a chunk every target had is never encoded).
    let (codec, stored_length) = chunk.payload.get().map_or((Codec::None, length), |p| (p.codec, p.bytes.len() as u64));
    if uploaded {
        progress.uploaded_bytes.fetch_add(length, Ordering::Relaxed);
        progress.stored_bytes.fetch_add(stored_length, Ordering::Relaxed);
    } else {
        progress.deduplicated_chunks.fetch_add(1, Ordering::Relaxed);
        progress.deduplicated_bytes.fetch_add(length, Ordering::Relaxed);
    }
    Ok(ChunkRef {
        hash,
        length_bytes: length,
        stored_length_bytes: stored_length,
        codec,
        replicas: stored.iter().map(|&i| placement.ids[i].clone()).collect(),
    })
}

/// A chunk's bytes and their stored form, made on first need (a chunk every target already holds
/// is never compressed) and shared by all its copies.
struct ChunkBytes {
    data: Bytes,
    compression: Option<CompressConfig>,
    payload: tokio::sync::OnceCell<Payload>,
}

impl ChunkBytes {
    async fn payload(&self) -> Result<Payload, TransportError> {
        let encode = || async {
            let Some(config) = self.compression else { return Ok(Payload::raw(self.data.clone())) };
            let data = self.data.clone();
            tokio::task::spawn_blocking(move || match codec::compress(&data, &config) {
                Some(compressed) => {
                    Payload { length: data.len() as u64, codec: compressed.codec, bytes: Bytes::from(compressed.bytes) }
                }
                None => Payload::raw(data),
            })
            .await
            // Not a connection problem: no other target would do better.
            .map_err(|e| TransportError::Protocol(format!("compression task failed: {e}")))
        };
        self.payload.get_or_try_init(encode).await.cloned()
    }
}

/// Makes the chunk durable on target `index` of the placement (HAS, then PUT if missing),
/// following the target to a new address once if it moved. Ok(true): it was there already.
async fn store_on(
    client: &Client,
    placement: &Placement,
    index: usize,
    name: &ChunkName,
    chunk: &ChunkBytes,
) -> Result<bool> {
    let store = |transport: Arc<dyn ChunkTransport>| async move {
        crate::faults::point("client.put").map_err(|e| TransportError::Connection(e.to_string()))?;
        if transport.has(&[name.address]).await?.first() == Some(&true) {
            return Ok::<bool, TransportError>(true);
        }
        transport.put_named(name, chunk.payload().await?, false).await
    };
    let mut address = placement.addresses[index].clone();
    let mut outcome = store(Arc::clone(&placement.transports[index])).await;
    // A target that did not answer in time has not moved: asking again would wait once more.
    if let Err(error) = &outcome
        && error.is_connection()
        && !matches!(error, TransportError::Timeout(_))
        && let Some((moved, transport)) = client.refreshed_transport(&placement.ids[index], &address).await
    {
        address = moved;
        outcome = store(transport).await;
    }
    outcome.map_err(|source| Error::Target { target_id: placement.ids[index].clone(), address, source })
}

/// The addressing a control plane's answer describes (its `chunk_key`).
pub(crate) fn addressing_from(key: &[u8]) -> Result<Addressing> {
    Addressing::from_wire(key).map_err(|e| Error::InvalidInput(format!("the control plane's chunk addressing: {e}")))
}
