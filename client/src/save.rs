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

mod calls;
mod items;
mod outcome;
mod stage;
mod upload;

pub use items::*;
pub use outcome::*;
pub use stage::*;
pub(crate) use upload::*;

impl Client {
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
}
