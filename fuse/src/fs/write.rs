//! Writing through the mount: files being written ([`DraftFile`]), the draft directories
//! holding them, and how each ends: committed as a one-file checkpoint, committed with its draft
//! by a rename, or given up.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use fuser::Errno;
use starckpt_client::{StreamedFile, StreamingFile};
use starckpt_proto::RelPath;

use super::{CkptFs, NAME_KEY, Node, errno, remap};
use crate::tree::{step_name, step_of};

/// A directory tree being written, committed by renaming its top.
pub(super) struct Draft {
    pub(super) job: String,
    pub(super) name: String,
    /// Every directory in it, "" (the top) included.
    pub(super) dirs: BTreeSet<String>,
    /// Path → file id.
    pub(super) files: BTreeMap<String, u64>,
    /// A rename-to-commit is in progress: changes inside are refused (EBUSY).
    pub(super) committing: bool,
}

pub(super) enum Writer {
    Open(StreamingFile),
    Done(StreamedFile),
    Failed(Errno),
    /// Part of a committed checkpoint: a one-file checkpoint (at its first flush; its step and
    /// checkpoint id), or a file of a draft that was renamed to commit (None).
    Committed(Option<(u64, u64)>),
}

/// A file being written.
pub(super) struct DraftFile {
    pub(super) job: String,
    /// None: written directly in the job directory, a one-file checkpoint.
    pub(super) draft: Option<u64>,
    /// Path inside the draft (a rename inside the draft changes it), or the file name in the
    /// job directory.
    pub(super) path: Mutex<String>,
    pub(super) mode: AtomicU64,
    pub(super) size: AtomicU64,
    pub(super) created: SystemTime,
    pub(super) writer: tokio::sync::Mutex<Writer>,
    /// Open write handles (create/open to release). Lowered by the last release only with
    /// `writer` held, so that holding `writer` sees it 0 only once the file has ended.
    pub(super) open_handles: AtomicU64,
    /// Unlinked while open: never committed.
    pub(super) abandoned: std::sync::atomic::AtomicBool,
    /// Its opener, or another process that wrote to it, died with it open (a flush said so), or
    /// whether one did cannot be told: never ended; whatever would end it fails it instead
    /// ([`CkptFs::end`]).
    pub(super) killed: std::sync::atomic::AtomicBool,
    /// Flushes whose requester is still being judged ([`DraftFile::judge`]); release waits for them.
    pub(super) judging: (Mutex<u32>, std::sync::Condvar),
    /// The processes that wrote to it ([`DraftFile::wrote_from`]): any of them dying with it
    /// open gives it up, not only its opener.
    pub(super) writers: Mutex<super::judge::Writers>,
}

impl DraftFile {
    pub(super) fn path(&self) -> String {
        self.path.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl CkptFs {
    /// A new file, open by the handle its `create` is about to add ([`Self::add_created`]): no
    /// rename sees it closed before that handle is in.
    pub(super) fn new_draft_file(
        &self,
        job: &str,
        draft: Option<u64>,
        path: String,
        mode: u32,
    ) -> Result<Arc<DraftFile>, Errno> {
        let writer = self.block_on(self.client.streaming_file(job)).map_err(|e| errno("create", &path, &e))?;
        Ok(Arc::new(DraftFile {
            job: job.to_owned(),
            draft,
            path: Mutex::new(path),
            mode: AtomicU64::new(u64::from(mode & 0o7777)),
            size: AtomicU64::new(0),
            created: SystemTime::now(),
            writer: tokio::sync::Mutex::new(Writer::Open(writer)),
            open_handles: AtomicU64::new(1),
            abandoned: std::sync::atomic::AtomicBool::new(false),
            killed: std::sync::atomic::AtomicBool::new(false),
            judging: Default::default(),
            writers: Default::default(),
        }))
    }

    /// Drops a one-file checkpoint that will never be committed (unlinked, its writer died, or a
    /// write failed): out of the job's listing, its staging memory let go with its last handle.
    pub(super) fn discard_single(&self, file: &Arc<DraftFile>) {
        file.abandoned.store(true, Ordering::Relaxed);
        let key = (file.job.clone(), file.path());
        let mut state = self.state();
        let id = state.single_files.get(&key).copied();
        if let Some(id) = id.filter(|id| state.files.get(id).is_some_and(|f| Arc::ptr_eq(f, file))) {
            state.single_files.remove(&key);
            state.files.remove(&id);
        }
    }

    /// One of `file`'s write handles let go. The last ends a file no flush ended: closed without
    /// data, or last by a process other than its opener. One a writer died writing (a flush said
    /// so: a release names no process) is never ended: its staging buffers go back now, a draft
    /// holding it cannot commit (EIO), and a one-file checkpoint is dropped, its name free again
    /// for the writer's next run, as is one whose write failed.
    pub(super) fn release_write(&self, file: &Arc<DraftFile>) {
        file.judged();
        let failed_single = self.block_on(async {
            let mut writer = file.writer.lock().await;
            if file.open_handles.fetch_sub(1, Ordering::Relaxed) != 1 {
                return false;
            }
            // A failed commit stays listed (a rename or a new open may retry it); a failed
            // file is dropped.
            let _ = self.end(file, &mut writer).await;
            file.draft.is_none() && matches!(&*writer, Writer::Failed(_))
        });
        if failed_single {
            self.discard_single(file);
        }
    }

    /// Ends a file's writes: its bytes durable, its chunk list final. A one-file checkpoint is
    /// committed here. Idempotent; a failure is reported again on every later call.
    pub(super) fn finish(&self, file: &Arc<DraftFile>) -> Result<(), Errno> {
        self.block_on(async { self.end(file, &mut *file.writer.lock().await).await })
    }

    /// [`Self::finish`], `writer` (the file's) held. A file given up ([`DraftFile::killed`])
    /// fails instead: a truncated file is never committed, and the partial chunk's staging
    /// buffer goes back to the pool now rather than with the mount.
    pub(super) async fn end(&self, file: &Arc<DraftFile>, writer: &mut Writer) -> Result<(), Errno> {
        // Read under the writer lock: a rename inside the draft takes that lock too.
        let path = file.path();
        match std::mem::replace(writer, Writer::Failed(Errno::EIO)) {
            Writer::Open(_) if file.killed.load(Ordering::Relaxed) => {
                tracing::warn!(job = %file.job, %path, "its writer died mid-write: the file is given up");
            }
            Writer::Open(stream) => {
                let Ok(rel) = RelPath::try_from(path.as_str()) else { return Err(Errno::EINVAL) };
                let mode = file.mode.load(Ordering::Relaxed) as u32;
                match stream.finish(rel, mode).await {
                    Ok(done) => *writer = Writer::Done(done),
                    Err(e) => *writer = Writer::Failed(errno("write", &path, &e)),
                }
            }
            other => *writer = other,
        }
        if file.draft.is_none()
            && !file.abandoned.load(Ordering::Relaxed)
            && let Writer::Done(done) = &*writer
        {
            let step = step_of(&path).ok_or(Errno::EINVAL)?;
            let metadata = [(NAME_KEY.to_owned(), path.clone())].into_iter().collect();
            let checkpoint =
                match self.client.commit_streamed(&file.job, step, vec![done.clone()], vec![], metadata).await {
                    Ok(outcome) => outcome.checkpoint_id,
                    // Keep the finished file: a later flush or fsync retries the commit.
                    Err(e) => return Err(errno("commit", &path, &e)),
                };
            if file.abandoned.load(Ordering::Relaxed) {
                // Unlinked while its commit was on the way: what the name named goes with it.
                if let Err(e) = self.client.delete_seen(&file.job, step, checkpoint).await {
                    tracing::error!(job = %file.job, %path, step, "could not delete an unlinked file's checkpoint: {e}");
                }
            } else {
                *writer = Writer::Committed(Some((step, checkpoint)));
                self.committed_single(file, step, checkpoint);
            }
        }
        match &*writer {
            Writer::Failed(code) => Err(*code),
            _ => Ok(()),
        }
    }

    /// Bookkeeping after a one-file checkpoint committed: the name now resolves to the committed
    /// file, through the same inode.
    pub(super) fn committed_single(&self, file: &Arc<DraftFile>, step: u64, checkpoint: u64) {
        let mut state = self.state();
        let key = (file.job.clone(), file.path());
        let id = state
            .single_files
            .get(&key)
            .copied()
            .filter(|id| state.files.get(id).is_some_and(|f| Arc::ptr_eq(f, file)));
        if let Some(id) = id {
            state.single_files.remove(&key);
            state.files.remove(&id);
            let new = Node::StepFile { job: file.job.clone(), step, checkpoint, index: 0 };
            remap(&mut state, &Node::DraftFile { file: id }, new);
        }
        state.trees.remove(&(file.job.clone(), step));
        state.aliases.insert(key, (step, checkpoint, Some(0)));
        state.jobs = None;
        state.steps.remove(&file.job);
    }

    /// Commits draft `id` as step `step` of its job, under `name`.
    pub(super) fn commit_draft(&self, id: u64, step: u64, name: &str) -> Result<(), Errno> {
        let (job, files, dirs) = {
            let mut state = self.state();
            let draft = state.drafts.get_mut(&id).ok_or(Errno::ENOENT)?;
            if draft.committing {
                return Err(Errno::EBUSY);
            }
            draft.committing = true;
            let (job, dirs) = (draft.job.clone(), draft.dirs.clone());
            let ids: Vec<u64> = draft.files.values().copied().collect();
            let files: Vec<Arc<DraftFile>> = ids.iter().filter_map(|f| state.files.get(f).cloned()).collect();
            (job, files, dirs)
        };
        let result = self.commit_draft_files(id, step, name, &job, &files, &dirs);
        if result.is_err()
            && let Some(draft) = self.state().drafts.get_mut(&id)
        {
            draft.committing = false;
        }
        result
    }

    pub(super) fn commit_draft_files(
        &self,
        id: u64,
        step: u64,
        name: &str,
        job: &str,
        files: &[Arc<DraftFile>],
        dirs: &BTreeSet<String>,
    ) -> Result<(), Errno> {
        let job = job.to_owned();
        let mut streamed = Vec::with_capacity(files.len());
        // Held until the commit is done: a write through a descriptor still open on a file (which
        // fails it) lands before the commit reads it, or after the file is the checkpoint's.
        let mut writers = Vec::with_capacity(files.len());
        for file in files {
            // A file its writer closed is final, even with its release still on the way (the
            // kernel sends it after close() returns). One that no close ended (closed without
            // data, or last by a child) ends with its release: wait for that a little.
            let deadline = Instant::now() + Duration::from_secs(1);
            let open = || matches!(&*self.block_on(file.writer.lock()), Writer::Open(_));
            while open() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            // Its last release ends (or fails) it with the writer lock held: a file open here is
            // still open for writing, and committing could cut it short.
            let writer = self.block_on(file.writer.lock());
            match &*writer {
                Writer::Done(done) => streamed.push(done.clone()),
                Writer::Open(_) => return Err(Errno::EBUSY),
                Writer::Failed(code) => return Err(*code),
                Writer::Committed(_) => return Err(Errno::EINVAL),
            }
            writers.push(writer);
        }
        let directories: Vec<RelPath> =
            dirs.iter().filter(|d| !d.is_empty()).filter_map(|d| RelPath::try_from(d.as_str()).ok()).collect();
        let metadata = [(NAME_KEY.to_owned(), name.to_owned())].into_iter().collect();
        let checkpoint = self
            .block_on(self.client.commit_streamed(&job, step, streamed, directories, metadata))
            .map_err(|e| errno("commit", &format!("{job}/{name}"), &e))?
            .checkpoint_id;
        // Its files are the checkpoint's now: a descriptor still open on one writes no more to
        // it (ENOTSUP), and its close has nothing left to report.
        for mut writer in writers {
            *writer = Writer::Committed(None);
        }
        // The kernel may still hold inodes of the draft: each becomes its committed counterpart.
        self.state().trees.remove(&(job.clone(), step));
        let tree = self.tree(&job, step).ok();
        let mut state = self.state();
        let draft_files: HashMap<u64, String> = match state.drafts.remove(&id) {
            Some(draft) => {
                state.draft_names.remove(&(draft.job.clone(), draft.name.clone()));
                for file in draft.files.values() {
                    state.files.remove(file);
                }
                draft.files.into_iter().map(|(path, file)| (file, path)).collect()
            }
            None => HashMap::new(),
        };
        let moves: Vec<(u64, Node)> = state
            .inodes
            .iter()
            .filter_map(|(ino, (node, _))| {
                let new = match node {
                    Node::DraftDir { draft, path } if *draft == id => {
                        Node::StepDir { job: job.clone(), step, checkpoint, dir: path.clone() }
                    }
                    Node::DraftFile { file } => {
                        let path = draft_files.get(file)?;
                        let index = tree.as_ref()?.manifest.files.iter().position(|f| f.path.as_str() == path)?;
                        Node::StepFile { job: job.clone(), step, checkpoint, index }
                    }
                    _ => return None,
                };
                Some((*ino, new))
            })
            .collect();
        for (ino, new) in moves {
            let old = state.inodes.get(&ino).map(|(node, _)| node.clone());
            if let Some(old) = old {
                remap(&mut state, &old, new);
            }
        }
        if name != step_name(step) {
            state.aliases.insert((job.clone(), name.to_owned()), (step, checkpoint, None));
        }
        state.jobs = None;
        state.steps.remove(&job);
        Ok(())
    }
}
