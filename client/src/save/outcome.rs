//! What a save gives back: its progress, its handle to wait on, and its outcome.

use super::*;

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
    pub(super) progress: Arc<SaveProgress>,
    pub(super) task: JoinHandle<Result<SaveOutcome>>,
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
