//! Streaming writes: files whose bytes arrive piece by piece (the FUSE mount, a pipe), uploaded
//! chunk by chunk as they come and committed later, together, as one checkpoint.
//!
//! ```text
//!  write(bytes) ──► staging buffer (one chunk) ──full──► upload task (hash, HAS, PUT)
//!  sync()       ──► cut the partial chunk, wait for every upload: durable on targets
//!  finish()     ──► the file's size and chunk list
//!  Client::commit_streamed(job, step, files) ──► begin, re-check chunks, commit
//! ```
//!
//! Memory: each open file holds at most one staging buffer being filled, and the uploads in
//! flight hold theirs; all come from the client's bounded staging pool, so writers wait when it is
//! exhausted. Uploads in flight per file are bounded by `ClientConfig::upload_concurrency`. A
//! writer does not wait for ever, though, when every buffer holds the partial chunk of an open
//! file: only a write, sync or close of one of those files would free one, which may be the very
//! caller waiting (the mount's few threads, one program with more files open than buffers). Past
//! [`PARTIALS_WAIT`] in that state the write fails, saying so.
//!
//! Unlike [`Client::save`], no checkpoint is begun while bytes stream: a file may be written for
//! a long time, and its step may only be known at the end (the mount's rename-to-commit). So
//! [`Client::commit_streamed`] begins the checkpoint and then checks every chunk with HAS, which
//! also refreshes the chunk's last use (see `server/src/control/gc.rs`), before committing. A chunk
//! garbage collection took meanwhile (streamed longer than the GC grace period before the commit)
//! fails the commit with a clear error; a hole is never committed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use starckpt_dataplane::buf::PooledBuf;
use starckpt_proto::control as pb;
use starckpt_proto::frame::MAX_BATCH_HASHES;
use starckpt_proto::model::{ChunkRef, FileEntry, Manifest};
use starckpt_proto::{Addressing, ChunkHash, JobName, RelPath};
use tokio::task::JoinHandle;

use crate::save::{Placement, SaveOutcome, SaveProgress, upload_one};
use crate::{Client, Error, Result, TargetState};

/// A file being written sequentially and uploaded as it grows.
pub struct StreamingFile {
    client: Client,
    placement: Arc<Placement>,
    progress: Arc<SaveProgress>,
    current: Option<Partial>,
    filled: usize,
    size: u64,
    next_index: usize,
    uploads: FuturesUnordered<JoinHandle<(usize, Result<ChunkRef>)>>,
    done: BTreeMap<usize, ChunkRef>,
    /// The first upload failure; every later call reports it.
    failed: Option<String>,
}

/// How long a write waits for a staging buffer while every buffer holds a partial chunk.
pub const PARTIALS_WAIT: Duration = Duration::from_secs(10);

/// A staging buffer holding a file's last, partial chunk, counted while held
/// (`streaming_partials`).
struct Partial {
    /// Present until [`Partial::into_buf`].
    buf: Option<PooledBuf>,
    held: Arc<std::sync::atomic::AtomicUsize>,
}

impl Partial {
    fn buf_mut(&mut self) -> &mut PooledBuf {
        self.buf.as_mut().expect("present until into_buf")
    }

    /// The buffer, no longer a partial chunk (it is being uploaded).
    fn into_buf(mut self) -> PooledBuf {
        self.buf.take().expect("present until into_buf")
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        self.held.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A finished streamed file, ready to be committed.
#[derive(Clone, Debug)]
pub struct StreamedFile {
    pub path: RelPath,
    pub size: u64,
    /// Unix permission bits; 0 means default.
    pub mode: u32,
    pub chunks: Vec<ChunkRef>,
    /// Bytes actually uploaded (the rest deduplicated against stored chunks).
    pub written_bytes: u64,
    /// How its chunks are addressed: its job's way ([`Client::streaming_file`]).
    pub addressing: Addressing,
}

impl Client {
    /// A new streaming file of job `job`, placing its chunks on the targets live now, each on
    /// [`crate::ClientConfig::stream_replicas`] of them (no checkpoint is begun yet, so the job's
    /// own replication factor does not apply), addressed as the job's chunks are.
    pub async fn streaming_file(&self, job: &str) -> Result<StreamingFile> {
        let addressing = self.chunk_addressing(&JobName::try_from(job)?).await?;
        let live: Vec<pb::TargetInfo> =
            self.targets().await?.into_iter().filter(|t| t.state == TargetState::Alive as i32).collect();
        if live.is_empty() {
            return Err(Error::Rejected { op: "stream", message: "no live storage targets".into() });
        }
        Ok(StreamingFile {
            client: self.clone(),
            placement: Arc::new(self.placement(&live, self.config().stream_replicas, addressing)?),
            progress: Arc::new(SaveProgress::default()),
            current: None,
            filled: 0,
            size: 0,
            next_index: 0,
            uploads: FuturesUnordered::new(),
            done: BTreeMap::new(),
            failed: None,
        })
    }

    /// Commits `files` (and empty `directories`) as checkpoint (job, step), a single rank: begins
    /// it under this client's lease, checks that every chunk is still stored (refreshing it
    /// against garbage collection), then commits. See the module docs.
    pub async fn commit_streamed(
        &self,
        job: &str,
        step: u64,
        mut files: Vec<StreamedFile>,
        directories: Vec<RelPath>,
        metadata: BTreeMap<String, String>,
    ) -> Result<SaveOutcome> {
        let job = JobName::try_from(job)?;
        let (epoch, begin) = self.begin(&job, step, 1).await?;
        // Streamed under the addressing the job's chunks have now (a re-key since makes them
        // another tenant key's), and still stored.
        let addressing = crate::save::addressing_from(&begin.chunk_key)?;
        let checked = match files.iter().find(|f| f.addressing != addressing) {
            Some(file) => Err(Error::InvalidInput(format!(
                "{} was streamed with other chunk addresses ({:?}) than {job}'s now ({addressing:?}): \
                 streamed for another job, or the cluster key changed since; write it again",
                file.path, file.addressing
            ))),
            None => self.recheck_chunks(&mut files).await,
        };
        if let Err(error) = checked {
            // Abort the checkpoint now rather than leave it pending until the timeout: this one
            // only, and only while pending (never someone's step, never a committed one). The
            // control plane checks both; one older than that field deletes whatever is at the
            // step, so the request goes only while this checkpoint is the step's and pending.
            let ours_pending = self.list_checkpoints(job.as_str(), false).await.is_ok_and(|list| {
                list.iter()
                    .any(|c| c.checkpoint_id == begin.checkpoint_id && c.state == pb::CheckpointState::Pending as i32)
            });
            if ours_pending && let Err(abort) = self.abort_pending(&job, step, begin.checkpoint_id).await {
                tracing::warn!(%job, step, error = %abort, "could not abort the pending checkpoint; it times out");
            }
            return Err(error);
        }
        let written_bytes = files.iter().map(|f| f.written_bytes).sum();
        let total_bytes = files.iter().map(|f| f.size).sum();
        let chunks = files.iter().map(|f| f.chunks.len() as u64).sum();
        let manifest = Manifest {
            files: files
                .into_iter()
                .map(|f| FileEntry { path: f.path, size_bytes: f.size, mode: f.mode, chunks: f.chunks })
                .collect(),
            directories,
            metadata,
            addressing,
        };
        let state = self.commit_manifest(begin.checkpoint_id, 0, &manifest, written_bytes).await?;
        Ok(SaveOutcome {
            checkpoint_id: begin.checkpoint_id,
            job: job.to_string(),
            step,
            state,
            epoch,
            total_bytes,
            chunks,
            deduplicated_chunks: 0,
            uploaded_bytes: written_bytes,
        })
    }

    /// HAS every chunk on every target its reference names: present copies are refreshed against
    /// GC (one not asked about could be collected after the commit, though the manifest lists
    /// it). A copy a target no longer has, or that a target gone or not answering cannot
    /// confirm, is left out of the reference (re-replication makes it again); a chunk left with
    /// none is an error.
    pub(crate) async fn recheck_chunks(&self, files: &mut [StreamedFile]) -> Result<()> {
        let mut by_target: HashMap<String, Vec<ChunkHash>> = HashMap::new();
        for chunk in files.iter().flat_map(|f| f.chunks.iter()) {
            if chunk.replicas.is_empty() {
                return Err(Error::InvalidInput(format!("chunk {} has no replica", chunk.hash)));
            }
            for target in &chunk.replicas {
                by_target.entry(target.clone()).or_default().push(chunk.hash);
            }
        }
        let addresses: HashMap<String, String> =
            self.targets().await?.into_iter().map(|t| (t.target_id, t.data_address)).collect();
        // Copies not confirmed: (target, chunk).
        let mut unconfirmed: HashSet<(String, ChunkHash)> = HashSet::new();
        for (target_id, hashes) in by_target {
            let Some(address) = addresses.get(&target_id) else {
                tracing::warn!(target = %target_id, "a target holding streamed chunks is no longer registered");
                unconfirmed.extend(hashes.into_iter().map(|hash| (target_id.clone(), hash)));
                continue;
            };
            let transport = self.transport(&target_id, address)?;
            for batch in hashes.chunks(MAX_BATCH_HASHES) {
                match transport.has(batch).await {
                    Ok(present) => unconfirmed.extend(
                        batch.iter().zip(present).filter(|(_, present)| !present).map(|(h, _)| (target_id.clone(), *h)),
                    ),
                    Err(error) => {
                        tracing::warn!(target = %target_id, %error, "could not confirm streamed chunks on a target");
                        unconfirmed.extend(batch.iter().map(|hash| (target_id.clone(), *hash)));
                    }
                }
            }
        }
        if unconfirmed.is_empty() {
            return Ok(());
        }
        for chunk in files.iter_mut().flat_map(|f| f.chunks.iter_mut()) {
            let hash = chunk.hash;
            chunk.replicas.retain(|target| !unconfirmed.contains(&(target.clone(), hash)));
            if chunk.replicas.is_empty() {
                return Err(Error::NotFound {
                    op: "commit",
                    message: format!(
                        "chunk {hash} is no longer on any target that stored it: data streamed longer ago than \
                         the garbage-collection grace period was collected (or its targets are gone); write \
                         the checkpoint again"
                    ),
                });
            }
        }
        Ok(())
    }
}

impl StreamingFile {
    /// Bytes written so far.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Appends `data`. Full chunks start uploading at once; waits when the staging pool or the
    /// per-file upload bound is exhausted.
    pub async fn write(&mut self, mut data: &[u8]) -> Result<()> {
        self.check()?;
        let chunk_size = self.client.inner.config.chunk_size_bytes;
        while !data.is_empty() {
            if self.current.is_none() {
                self.current = Some(self.partial_buffer().await?);
                self.filled = 0;
            }
            let buf = self.current.as_mut().expect("set above").buf_mut();
            let take = (chunk_size - self.filled).min(data.len());
            buf.buf_mut().full_mut()[self.filled..self.filled + take].copy_from_slice(&data[..take]);
            self.filled += take;
            self.size += take as u64;
            data = &data[take..];
            if self.filled == chunk_size {
                self.cut().await?;
            }
        }
        Ok(())
    }

    /// Makes every byte written so far durable on the targets (a partial chunk becomes a chunk
    /// of its own).
    pub async fn sync(&mut self) -> Result<()> {
        self.check()?;
        if self.filled > 0 {
            self.cut().await?;
        }
        while !self.uploads.is_empty() {
            self.reap().await?;
        }
        Ok(())
    }

    /// Ends the file: syncs it and returns it ready for [`Client::commit_streamed`].
    pub async fn finish(mut self, path: RelPath, mode: u32) -> Result<StreamedFile> {
        self.sync().await?;
        let chunks: Vec<ChunkRef> = std::mem::take(&mut self.done).into_values().collect();
        if chunks.len() != self.next_index {
            return Err(Error::Cancelled(format!("{path}: {} of {} chunks uploaded", chunks.len(), self.next_index)));
        }
        let written_bytes = self.progress.uploaded_bytes.load(Ordering::Relaxed);
        let addressing = self.placement.addressing;
        Ok(StreamedFile { path, size: self.size, mode, chunks, written_bytes, addressing })
    }

    fn check(&self) -> Result<()> {
        match &self.failed {
            Some(message) => Err(Error::Cancelled(format!("an upload of this file failed: {message}"))),
            None => Ok(()),
        }
    }

    /// A staging buffer for this file's next chunk: waits while buffers come back from uploads,
    /// and fails when every one holds another file's partial chunk (module docs).
    async fn partial_buffer(&self) -> Result<Partial> {
        let staging = &self.client.inner.staging;
        let held = &self.client.inner.streaming_partials;
        let mut deadlocked_since = None;
        let buf = loop {
            match tokio::time::timeout(Duration::from_millis(200), staging.acquire()).await {
                Ok(buf) => break buf,
                Err(_) if held.load(Ordering::Acquire) >= staging.max_buffers() => {
                    let since = *deadlocked_since.get_or_insert_with(std::time::Instant::now);
                    if since.elapsed() >= PARTIALS_WAIT {
                        return Err(Error::InvalidInput(format!(
                            "every staging buffer ({}) holds the unfinished last chunk of a file being \
                             written: close or sync some of them, or give the client more staging memory",
                            staging.max_buffers()
                        )));
                    }
                }
                Err(_) => deadlocked_since = None,
            }
        };
        held.fetch_add(1, Ordering::AcqRel);
        Ok(Partial { buf: Some(buf), held: Arc::clone(held) })
    }

    async fn cut(&mut self) -> Result<()> {
        let Some(partial) = self.current.take() else { return Ok(()) };
        let mut buf = partial.into_buf();
        buf.buf_mut().set_len(self.filled);
        self.filled = 0;
        let data: Bytes = buf.freeze();
        let index = self.next_index;
        self.next_index += 1;
        let (client, placement, progress) =
            (self.client.clone(), Arc::clone(&self.placement), Arc::clone(&self.progress));
        self.uploads.push(tokio::spawn(async move { (index, upload_one(&client, data, &placement, &progress).await) }));
        while self.uploads.len() >= self.client.inner.config.upload_concurrency.max(1) {
            self.reap().await?;
        }
        Ok(())
    }

    async fn reap(&mut self) -> Result<()> {
        let Some(joined) = self.uploads.next().await else { return Ok(()) };
        let (index, result) = match joined {
            Ok(joined) => joined,
            Err(e) => {
                self.failed = Some(e.to_string());
                return Err(Error::Cancelled(e.to_string()));
            }
        };
        match result {
            Ok(chunk) => {
                self.done.insert(index, chunk);
                Ok(())
            }
            Err(error) => {
                self.failed = Some(error.to_string());
                Err(error)
            }
        }
    }
}
