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
//! Memory is bounded by the staging pool: staging waits for a free buffer, and a buffer returns to
//! the pool only when its chunk is durable on a target (or found there already). A failed upload
//! stops staging, and the part is never committed: the checkpoint stays pending until a new
//! run takes the job's lease (or the pending timeout) aborts it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use futures::StreamExt;
use starckpt_proto::control as pb;
use starckpt_proto::model::{ChunkRef, Codec, FileEntry, Manifest};
use starckpt_proto::{ChunkHash, JobName, RelPath};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::placement::rank_targets;
use crate::transport::{ChunkTransport, TransportError};
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
    pub deduplicated_bytes: AtomicU64,
    pub chunks: AtomicU64,
    pub deduplicated_chunks: AtomicU64,
}

impl SaveProgress {
    /// Bytes whose chunk is durable on a target, uploaded now or found there already.
    pub fn done_bytes(&self) -> u64 {
        self.uploaded_bytes.load(Ordering::Relaxed) + self.deduplicated_bytes.load(Ordering::Relaxed)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitState {
    /// Every rank's part is in: the checkpoint is complete and visible to `latest`.
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

struct StagedChunk {
    file: usize,
    index: usize,
    /// A staging buffer frozen (it returns to the pool when dropped) or a slice of shared bytes.
    data: Bytes,
}

#[derive(Clone)]
struct Placement {
    ids: Vec<String>,
    transports: Vec<Arc<dyn ChunkTransport>>,
    addresses: Vec<String>,
}

impl Client {
    /// Starts saving a part. Returns once every byte is copied into staging buffers; the returned
    /// handle resolves when the part is committed (and says whether that completed the checkpoint).
    ///
    /// Back-pressure: if this client's previous save is still uploading, this one first waits for
    /// it to finish. [`Client::try_save`] skips instead.
    pub async fn save(&self, part: SavePart) -> Result<SaveHandle> {
        let slot = Arc::clone(&self.inner.upload_slot).acquire_owned().await.expect("never closed");
        self.save_in_slot(part, slot).await
    }

    /// Like [`Client::save`], but if this client's previous save is still uploading, skips this one
    /// and returns `Ok(None)` (the trainer goes on and saves a later step).
    pub async fn try_save(&self, part: SavePart) -> Result<Option<SaveHandle>> {
        match Arc::clone(&self.inner.upload_slot).try_acquire_owned() {
            Ok(slot) => self.save_in_slot(part, slot).await.map(Some),
            Err(_) => {
                tracing::info!(job = %part.job, step = part.step, "previous save still uploading; skipped this one");
                Ok(None)
            }
        }
    }

    async fn save_in_slot(&self, part: SavePart, slot: tokio::sync::OwnedSemaphorePermit) -> Result<SaveHandle> {
        let job = JobName::try_from(part.job.as_str())?;
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
        let epoch = self.lease(job.as_str()).await?;
        let begin = self
            .control()
            .begin_checkpoint(pb::BeginCheckpointRequest {
                job: job.to_string(),
                step: part.step,
                world_size: part.world_size,
                epoch,
            })
            .await
            .map_err(self.status("begin checkpoint"))?
            .into_inner();
        let mut placement = Placement { ids: vec![], transports: vec![], addresses: vec![] };
        for target in &begin.placement {
            placement.transports.push(self.transport(&target.target_id, &target.data_address)?);
            placement.ids.push(target.target_id.clone());
            placement.addresses.push(target.data_address.clone());
        }

        let progress = Arc::new(SaveProgress::default());
        // Every message holds a staging buffer, so the pool already bounds this queue; a smaller
        // channel would make staging wait for uploads while buffers sit free (the trainer would
        // stall for the upload instead of the copy).
        let (chunks, receiver) = mpsc::channel::<StagedChunk>(self.inner.staging.max_buffers());
        let uploads = tokio::spawn(upload_all(
            self.clone(),
            receiver,
            placement,
            Arc::clone(&progress),
            self.inner.config.upload_concurrency.max(1),
        ));
        let staged = self.stage(&part.items, &chunks, &progress).await;
        drop(chunks);
        let files = match staged {
            Ok(files) => files,
            Err(stage_error) => {
                // An upload failure closes the channel and is the real cause; prefer it.
                return Err(match uploads.await {
                    Ok(Err(upload_error)) => upload_error,
                    _ => stage_error,
                });
            }
        };
        let total_bytes = files.iter().map(|f| f.size).sum();
        let client = self.clone();
        let task_progress = Arc::clone(&progress);
        let checkpoint_id = begin.checkpoint_id;
        let task = tokio::spawn(async move {
            // Held until the part is committed (or failed): the next save waits for, or skips on, it.
            let _slot = slot;
            let mut chunk_refs = uploads.await.map_err(|e| Error::Cancelled(e.to_string()))??;
            let mut manifest = Manifest { metadata: part.metadata.clone(), ..Default::default() };
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
            let response = client
                .control()
                .commit_part(pb::CommitPartRequest {
                    checkpoint_id,
                    rank: part.rank,
                    manifest: Some(pb::Manifest::from(&manifest)),
                    written_bytes: task_progress.uploaded_bytes.load(Ordering::Relaxed),
                })
                .await
                .map_err(client.status("commit part"))?
                .into_inner();
            let state = if response.state == pb::CheckpointState::Committed as i32 {
                CommitState::Committed
            } else {
                CommitState::WaitingForRanks {
                    parts_committed: response.parts_committed,
                    world_size: response.world_size,
                }
            };
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

    /// Copies every item into staging buffers and hands them to the uploaders.
    async fn stage(
        &self,
        items: &[SaveItem],
        chunks: &mpsc::Sender<StagedChunk>,
        progress: &SaveProgress,
    ) -> Result<Vec<StagedFile>> {
        let pool = &self.inner.staging;
        let chunk_size = self.inner.config.chunk_size_bytes;
        let closed = || Error::Cancelled("upload stopped".into());
        let mut files = Vec::with_capacity(items.len());
        for (file_index, item) in items.iter().enumerate() {
            match item {
                SaveItem::Directory { path } => {
                    files.push(StagedFile { path: path.clone(), size: 0, chunks: 0, kind: StagedKind::Directory })
                }
                SaveItem::Buffer { path, data } => {
                    let index = self.stage_copies(file_index, data, chunks, progress).await?;
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
                        chunks
                            .send(StagedChunk { file: file_index, index, data: piece })
                            .await
                            .map_err(|_| closed())?;
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
                    let mut file = Some(std::fs::File::open(source).map_err(Error::io("open", source))?);
                    let (mut index, mut size) = (0usize, 0u64);
                    loop {
                        let buf = pool.acquire().await;
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
                        chunks.send(StagedChunk { file: file_index, index, data }).await.map_err(|_| closed())?;
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
        Ok(files)
    }
}

impl Client {
    /// Copies `data` into staging buffers and hands each staged chunk to the uploaders. Returns
    /// the number of chunks.
    ///
    /// The copy runs on the caller's task (`block_in_place`), batches of `staging_threads` chunks
    /// split across scoped threads. Measured on 2 cores with uploads running: handing each copy to
    /// the blocking pool instead stalled the caller ~2.5x longer, because the copies then queued
    /// behind the uploaders' hashing; the caller's own thread is the one the trainer waits on.
    async fn stage_copies(
        &self,
        file_index: usize,
        data: &Bytes,
        chunks: &mpsc::Sender<StagedChunk>,
        progress: &SaveProgress,
    ) -> Result<usize> {
        let pool = &self.inner.staging;
        let chunk_size = self.inner.config.chunk_size_bytes;
        // A batch holds pool buffers until it is queued; never more than the pool has.
        let batch_size = self.inner.config.staging_threads.clamp(1, pool.max_buffers());
        let starts: Vec<usize> = (0..data.len()).step_by(chunk_size).collect();
        for (batch_index, batch) in starts.chunks(batch_size).enumerate() {
            let mut staged = Vec::with_capacity(batch.len());
            for start in batch {
                staged.push((data.slice(*start..(*start + chunk_size).min(data.len())), pool.acquire().await));
            }
            copy_blocking(&mut staged);
            for (offset, (source, buf)) in staged.into_iter().enumerate() {
                progress.staged_bytes.fetch_add(source.len() as u64, Ordering::Relaxed);
                progress.copied_bytes.fetch_add(source.len() as u64, Ordering::Relaxed);
                let index = batch_index * batch_size + offset;
                chunks
                    .send(StagedChunk { file: file_index, index, data: buf.freeze() })
                    .await
                    .map_err(|_| Error::Cancelled("upload stopped".into()))?;
            }
        }
        Ok(starts.len())
    }
}

/// Copies each source into its buffer, one per thread (the current one included), without
/// stalling other tasks of a multi-threaded runtime.
fn copy_blocking(staged: &mut [(Bytes, starckpt_proto::buf::PooledBuf)]) {
    fn copy_one((source, buf): &mut (Bytes, starckpt_proto::buf::PooledBuf)) {
        buf.buf_mut().full_mut()[..source.len()].copy_from_slice(source);
        buf.buf_mut().set_len(source.len());
    }
    let mut run = || match staged {
        [] => {}
        [only] => copy_one(only),
        [first, rest @ ..] => std::thread::scope(|scope| {
            for item in rest.iter_mut() {
                scope.spawn(move || copy_one(item));
            }
            copy_one(first);
        }),
    };
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(run),
        _ => run(),
    }
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
    placement: Placement,
    progress: Arc<SaveProgress>,
    concurrency: usize,
) -> Result<ChunkRefs> {
    let mut receiver = receiver;
    let staged = futures::stream::poll_fn(move |cx| receiver.poll_recv(cx));
    let mut uploads = staged
        .map(|chunk| {
            let (client, placement, progress) = (client.clone(), placement.clone(), Arc::clone(&progress));
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

/// Hashes one staged chunk and makes it durable on the first target (in rendezvous order) that
/// accepts it. A target that is unreachable or full is skipped for the next candidate; the
/// manifest records where the chunk really went.
async fn upload_one(client: &Client, data: Bytes, placement: &Placement, progress: &SaveProgress) -> Result<ChunkRef> {
    let length = data.len() as u64;
    let hashed = data.clone();
    let hash = tokio::task::spawn_blocking(move || ChunkHash::of(&hashed))
        .await
        .map_err(|e| Error::Cancelled(e.to_string()))?;
    progress.chunks.fetch_add(1, Ordering::Relaxed);
    let ids: Vec<&str> = placement.ids.iter().map(String::as_str).collect();
    let mut last_error = None;
    for index in rank_targets(&hash, &ids) {
        let store = |transport: Arc<dyn ChunkTransport>| {
            let data = data.clone();
            async move {
                if transport.has(&[hash]).await?.first() == Some(&true) {
                    return Ok::<bool, TransportError>(true);
                }
                transport.put(hash, data).await
            }
        };
        let mut address = placement.addresses[index].clone();
        let mut outcome = store(Arc::clone(&placement.transports[index])).await;
        if let Err(error) = &outcome
            && error.is_connection()
            && let Some((moved, transport)) = client.refreshed_transport(&placement.ids[index], &address).await
        {
            address = moved;
            outcome = store(transport).await;
        }
        match outcome {
            Ok(already_present) => {
                if already_present {
                    progress.deduplicated_chunks.fetch_add(1, Ordering::Relaxed);
                    progress.deduplicated_bytes.fetch_add(length, Ordering::Relaxed);
                } else {
                    progress.uploaded_bytes.fetch_add(length, Ordering::Relaxed);
                }
                return Ok(ChunkRef {
                    hash,
                    length_bytes: length,
                    stored_length_bytes: length,
                    codec: Codec::None,
                    replicas: vec![placement.ids[index].clone()],
                });
            }
            Err(source) => {
                let retry_elsewhere = source.is_connection()
                    || matches!(
                        source,
                        TransportError::Remote {
                            code: starckpt_proto::data::ErrorCode::NoSpace
                                | starckpt_proto::data::ErrorCode::Busy
                                | starckpt_proto::data::ErrorCode::Internal,
                            ..
                        }
                    );
                let error = Error::Target { target_id: placement.ids[index].clone(), address, source };
                if !retry_elsewhere {
                    return Err(error);
                }
                tracing::warn!(%error, chunk = %hash, "target failed; placing the chunk on the next candidate");
                last_error = Some(error);
            }
        }
    }
    Err(Error::NoTarget {
        hash,
        last: Box::new(last_error.unwrap_or_else(|| Error::InvalidInput("no live targets were offered".into()))),
    })
}
