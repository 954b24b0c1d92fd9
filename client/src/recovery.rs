//! Chunks that readers found on no target, handed to the control plane together.
//!
//! When every copy of a chunk is gone from the targets a reader tries, the control plane brings
//! it back from another live target or the object-store tier (`RecoverChunks`;
//! `server/src/control/repair.rs`). Back of the envelope: a tier read is tens of ms from S3, so a
//! call per chunk, a few served at once, held a restore of a checkpoint whose copies were all
//! lost to tens of chunks per second. Here the readers of one checkpoint queue their chunks, and
//! one call at a time goes out per checkpoint carrying every chunk queued while the previous one
//! ran (at most [`MAX_RECOVER_CHUNKS`]), which the control plane works on several at once: group
//! commit, with no wait added when the control plane is idle.
//!
//! The calls are made by a task of their own, started by the first chunk queued while none runs
//! and ending once the queue is empty, so a reader that gives up (its restore was cancelled)
//! strands no other: its chunk is skipped if still queued, its answer dropped if not.

use std::collections::HashMap;
use std::sync::Mutex;

use starckpt_proto::ChunkHash;
use starckpt_proto::control::MAX_RECOVER_CHUNKS;
use tokio::sync::oneshot;

use crate::sync::LockExt;
use crate::{CheckpointManifest, Client, Error};

/// Times a batch is asked again of a control plane busy recovering other readers' chunks.
const BUSY_RETRIES: usize = 3;

/// A checkpoint: job, step, id.
type Checkpoint = (String, u64, u64);
/// Whether a live target holds a verified copy of the chunk now, or why the control plane could
/// not say.
pub(crate) type Answer = std::result::Result<bool, Unanswered>;

/// Why the control plane could not say whether it recovered a chunk.
#[derive(Clone, Debug)]
pub(crate) enum Unanswered {
    /// The checkpoint is no longer the one committed at its step (deleted, its chunks collected
    /// with it): what the control plane said.
    Gone(String),
    /// Anything else: the call failed.
    Failed(String),
}

impl std::fmt::Display for Unanswered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unanswered::Gone(said) | Unanswered::Failed(said) => f.write_str(said),
        }
    }
}

/// The queues of chunks waiting for recovery, one per checkpoint.
#[derive(Default)]
pub(crate) struct Recoveries(Mutex<HashMap<Checkpoint, Queue>>);

#[derive(Default)]
struct Queue {
    waiting: Vec<(ChunkHash, oneshot::Sender<Answer>)>,
    /// A task is making this checkpoint's calls.
    draining: bool,
}

impl Recoveries {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Checkpoint, Queue>> {
        self.0.lock_unpoisoned()
    }

    /// The next batch of `checkpoint`'s queue (readers that gave up skipped), or None, the queue
    /// then left to the next reader's task.
    fn next_batch(&self, checkpoint: &Checkpoint) -> Option<Vec<(ChunkHash, oneshot::Sender<Answer>)>> {
        let mut queues = self.lock();
        let queue = queues.get_mut(checkpoint)?;
        queue.waiting.retain(|(_, reader)| !reader.is_closed());
        if queue.waiting.is_empty() {
            queues.remove(checkpoint);
            return None;
        }
        let take = queue.waiting.len().min(MAX_RECOVER_CHUNKS);
        Some(queue.waiting.drain(..take).collect())
    }
}

/// Clears a checkpoint's `draining` if its task ends any other way than by emptying the queue
/// (the runtime shutting down), so a later reader starts another.
struct Draining<'a> {
    recoveries: &'a Recoveries,
    checkpoint: Checkpoint,
    /// The queue was emptied (and removed: a reader since has its own queue and task).
    emptied: bool,
}

impl Drop for Draining<'_> {
    fn drop(&mut self) {
        if self.emptied {
            return;
        }
        if let Some(queue) = self.recoveries.lock().get_mut(&self.checkpoint) {
            queue.draining = false;
        }
    }
}

impl Client {
    /// Asks the control plane to bring back `hash`, a chunk of `manifest`'s checkpoint that no
    /// target had, batched with other readers' chunks (module docs). Whether a live target holds
    /// a verified copy now, or why the control plane could not say.
    pub(crate) async fn recover_chunk(&self, manifest: &CheckpointManifest, hash: ChunkHash) -> Answer {
        let checkpoint = (manifest.info.job.clone(), manifest.info.step, manifest.info.checkpoint_id);
        let (reader, answer) = oneshot::channel();
        let start = {
            let mut queues = self.inner.recoveries.lock();
            let queue = queues.entry(checkpoint.clone()).or_default();
            queue.waiting.push((hash, reader));
            !std::mem::replace(&mut queue.draining, true)
        };
        if start {
            let client = self.clone();
            tokio::spawn(async move { client.drain_recoveries(checkpoint).await });
        }
        answer.await.unwrap_or_else(|_| Err(Unanswered::Failed("the recovery task ended without an answer".into())))
    }

    /// Makes `checkpoint`'s calls until its queue is empty.
    async fn drain_recoveries(&self, checkpoint: Checkpoint) {
        let recoveries = &self.inner.recoveries;
        let mut draining = Draining { recoveries, checkpoint: checkpoint.clone(), emptied: false };
        let (job, step, checkpoint_id) = &checkpoint;
        while let Some(batch) = recoveries.next_batch(&checkpoint) {
            let hashes: Vec<ChunkHash> = batch.iter().map(|(hash, _)| *hash).collect();
            let mut answer = self.recover_chunks_of(job, *step, *checkpoint_id, &hashes).await;
            for _ in 0..BUSY_RETRIES {
                match &answer {
                    Err(Error::Control { status, .. }) if status.code() == tonic::Code::ResourceExhausted => {
                        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                        answer = self.recover_chunks_of(job, *step, *checkpoint_id, &hashes).await;
                    }
                    _ => break,
                }
            }
            let answer = answer.map_err(|error| match error {
                Error::NotFound { message, .. } => Unanswered::Gone(message),
                error => Unanswered::Failed(error.to_string()),
            });
            for (index, (_, reader)) in batch.into_iter().enumerate() {
                let answered = answer.as_ref().map(|recovered| recovered.get(index) == Some(&true));
                let _ = reader.send(answered.map_err(Clone::clone));
            }
        }
        draining.emptied = true;
    }
}
