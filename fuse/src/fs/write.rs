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

use super::spill::{Spill, SpillError};
use super::{CkptFs, KIND_KEY, NAME_KEY, Node, errno, remap};
use crate::tree::step_of;
use starckpt_client::sync::LockExt;

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
    /// The processes that made its directories and files ([`Draft::wrote`]). Once none of them
    /// lives, and it is still not committed, it is not listed any more (a trainer killed midway
    /// left it; one resuming must see only complete checkpoints), though its name still resolves
    /// (`mv` of a tree `cp` wrote, writing it again).
    pub(super) writers: Vec<super::names::Process>,
    /// Its closed files as its record at the control plane has them (`fs/journal.rs`), by path.
    pub(super) journaled: BTreeMap<String, StreamedFile>,
    /// When it was begun (Unix ms): a checkpoint of its name committed since is this draft,
    /// committed by another writer's mount (`fs/journal.rs` `committed_elsewhere`).
    pub(super) begun_ms: u64,
}

impl Draft {
    /// Notes that thread `tid` made something in the draft.
    pub(super) fn wrote(&mut self, tid: u32) {
        const MAX_DRAFT_WRITERS: usize = 64;
        let Some(process) = super::names::Process::of(tid) else { return };
        if !self.writers.contains(&process) && self.writers.len() < MAX_DRAFT_WRITERS {
            self.writers.push(process);
        }
    }

    /// Whether a process that wrote it still runs (or none is known).
    pub(super) fn attended(&self) -> bool {
        self.writers.is_empty() || self.writers.iter().any(super::names::Process::live)
    }
}

pub(super) enum Writer {
    /// Written in order so far: bytes `[0, stream.size())` are streaming to the targets; the
    /// file may be longer (pre-sized with `ftruncate`: zeros past the stream's head).
    Open(StreamingFile),
    /// Written out of order (or cut below what was streamed): its bytes are only in its spill
    /// copy, uploaded from there when it ends.
    Spilled,
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
    /// Its local copy ([`super::spill`]), kept until its checkpoint commits; None once the spill
    /// area had no room for it.
    pub(super) spill: Mutex<Option<Spill>>,
    /// Modification time set by `utime` (`cp -a`, `rsync -a`, `tar -x`); None: its creation.
    pub(super) mtime: Mutex<Option<SystemTime>>,
}

/// Files whose arrival at the top of a draft completes it ([`CkptFs::completes_draft`]), and
/// the prefix the draft's name must have for that ("" for any): what each framework writes
/// last. DCP's `FileSystemWriter` (torchtitan) writes `.metadata` last (as `.metadata.tmp`,
/// renamed); Orbax, `commit_success.txt`; HF `Trainer._save_checkpoint`, `trainer_state.json`
/// into `checkpoint-<step>/` after the model, optimizer, scheduler and RNG states.
pub(super) const COMPLETION_MARKERS: &[(&str, &str)] =
    &[(".metadata", ""), ("commit_success.txt", ""), ("trainer_state.json", "checkpoint-")];

/// Bytes read from a spill copy at a time when a file written out of order is uploaded.
const UPLOAD_PIECE_BYTES: usize = 4 << 20;

impl DraftFile {
    /// A file closed before the mount restarted: its chunk list, no spill copy.
    pub(super) fn closed(job: &str, draft: u64, done: StreamedFile) -> DraftFile {
        DraftFile {
            job: job.to_owned(),
            draft: Some(draft),
            path: Mutex::new(done.path.to_string()),
            mode: AtomicU64::new(u64::from(done.mode)),
            size: AtomicU64::new(done.size),
            created: SystemTime::now(),
            open_handles: AtomicU64::new(0),
            abandoned: std::sync::atomic::AtomicBool::new(false),
            killed: std::sync::atomic::AtomicBool::new(false),
            judging: Default::default(),
            writers: Default::default(),
            spill: Mutex::new(None),
            mtime: Mutex::new(None),
            writer: tokio::sync::Mutex::new(Writer::Done(done)),
        }
    }

    pub(super) fn path(&self) -> String {
        self.path.lock_unpoisoned().clone()
    }

    fn spill(&self) -> std::sync::MutexGuard<'_, Option<Spill>> {
        self.spill.lock_unpoisoned()
    }

    /// Lets its spill copy go (its bytes are a committed checkpoint's now, or it is given up).
    pub(super) fn drop_spill(&self) {
        self.spill().take();
    }

    fn size(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }

    fn grow(&self, end: u64) {
        self.size.fetch_max(end, Ordering::Relaxed);
    }

    /// Bytes `[offset, offset + len)` as written so far (read-your-writes in a draft), from its
    /// spill copy: `ENOTSUP` when it has none.
    pub(super) fn read_at(&self, offset: u64, len: u32) -> Result<Vec<u8>, Errno> {
        let spill = self.spill();
        let Some(spill) = spill.as_ref() else { return Err(Errno::ENOTSUP) };
        spill.read_at(offset, len, self.size()).map_err(|e| {
            tracing::error!(job = %self.job, path = %self.path(), "reading the spill copy: {e}");
            Errno::EIO
        })
    }

    /// Copies a write into the spill copy. A file written in order goes on without its copy
    /// when the spill area is full (`required` false); one that needs it fails (`ENOSPC`).
    fn copy_out(&self, offset: u64, data: &[u8], required: bool) -> Result<(), Errno> {
        let mut spill = self.spill();
        let Some(copy) = spill.as_mut() else { return Err(if required { Errno::ENOTSUP } else { Errno::EIO }) };
        match copy.write_at(offset, data) {
            Ok(()) => Ok(()),
            Err(e) => {
                let (errno, why) = match e {
                    SpillError::Full => (Errno::ENOSPC, "the spill area is full".to_owned()),
                    SpillError::Io(e) => (Errno::EIO, e.to_string()),
                };
                if required {
                    tracing::error!(job = %self.job, path = %self.path(), "a write out of order needs the spill copy: {why}");
                    return Err(errno);
                }
                tracing::warn!(
                    job = %self.job, path = %self.path(),
                    "{why}: the file goes on streaming without its copy (it cannot be patched or read back before it commits)"
                );
                *spill = None;
                Ok(())
            }
        }
    }

    /// Writes `data` at `offset`, `writer` (this file's) held. In order, the bytes stream to
    /// the targets and are copied into the spill copy; out of order, the stream is dropped and the
    /// spill copy holds the file. A failed write fails the file: it is not what its writer wrote.
    pub(super) async fn write_at(&self, writer: &mut Writer, offset: u64, data: &[u8]) -> Result<(), Errno> {
        let end = offset + data.len() as u64;
        let result = match writer {
            Writer::Open(stream) if offset == stream.size() => {
                // The copy first: a write that does not reach it leaves the file as it was.
                let _ = self.copy_out(offset, data, false);
                match stream.write(data).await {
                    Ok(()) => Ok(()),
                    Err(e) => Err(errno("write", &self.path(), &e)),
                }
            }
            Writer::Open(_) | Writer::Spilled => {
                let copied = self.copy_out(offset, data, true);
                if copied.is_ok() && matches!(writer, Writer::Open(_)) {
                    tracing::debug!(job = %self.job, path = %self.path(), offset, "written out of order: uploaded from the spill copy at its end");
                    // The chunks streamed so far are never committed; GC frees them.
                    *writer = Writer::Spilled;
                }
                copied
            }
            _ => unreachable!("write_at is called on files being written"),
        };
        match result {
            Ok(()) => {
                self.grow(end);
                Ok(())
            }
            Err(code) => {
                *writer = Writer::Failed(code);
                Err(code)
            }
        }
    }

    /// `ftruncate`/`truncate` to `len`, `writer` held: pre-sizing (zeros past the stream's head),
    /// growing, shrinking, and emptying a file to write it again (`open(O_TRUNC)` of a file of
    /// the draft, finished or not).
    pub(super) async fn truncate(&self, fs: &CkptFs, writer: &mut Writer, len: u64) -> Result<(), Errno> {
        let path = self.path();
        let set_copy = |required: bool| -> Result<(), Errno> {
            let mut spill = self.spill();
            match spill.as_mut().map(|copy| copy.set_len(len)) {
                Some(Ok(())) => Ok(()),
                None if !required => Ok(()),
                None => Err(Errno::ENOTSUP),
                Some(Err(SpillError::Full)) if !required => {
                    tracing::warn!(job = %self.job, %path, "the spill area is full: the file goes on streaming without its copy");
                    *spill = None;
                    Ok(())
                }
                Some(Err(SpillError::Full)) => Err(Errno::ENOSPC),
                Some(Err(SpillError::Io(e))) => {
                    tracing::error!(job = %self.job, %path, "resizing the spill copy: {e}");
                    Err(Errno::EIO)
                }
            }
        };
        match writer {
            Writer::Committed(_) => return Err(Errno::EROFS),
            _ if len == 0 => {
                // Written again from nothing: a new stream, and a new copy (the spill area may
                // have had no room for the old one).
                let stream = fs.client.streaming_file(&self.job).await.map_err(|e| errno("truncate", &path, &e))?;
                let copy = Spill::new(&fs.spills).map_err(|e| {
                    tracing::error!(job = %self.job, %path, "a spill copy in {}: {e}", fs.spills.dir().display());
                    Errno::EIO
                })?;
                *self.spill() = Some(copy);
                *writer = Writer::Open(stream);
                self.killed.store(false, Ordering::Relaxed);
            }
            Writer::Open(stream) if len >= stream.size() => set_copy(false)?,
            Writer::Open(_) | Writer::Spilled | Writer::Done(_) => {
                set_copy(true)?;
                *writer = Writer::Spilled;
            }
            Writer::Failed(code) => return Err(*code),
        }
        self.size.store(len, Ordering::Relaxed);
        Ok(())
    }

    /// A finished file opened for writing again (to patch it): written on from its spill copy.
    pub(super) fn reopen(&self, writer: &mut Writer) -> Result<(), Errno> {
        match writer {
            Writer::Done(_) if self.spill().is_some() => {
                *writer = Writer::Spilled;
                Ok(())
            }
            Writer::Done(_) => Err(Errno::ENOTSUP),
            Writer::Committed(_) => Err(Errno::EROFS),
            Writer::Failed(code) => Err(*code),
            Writer::Open(_) | Writer::Spilled => Ok(()),
        }
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
        let spill = Spill::new(&self.spills).map_err(|e| {
            tracing::error!(job, %path, "cannot make a spill copy in {}: {e}", self.spills.dir().display());
            Errno::EIO
        })?;
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
            spill: Mutex::new(Some(spill)),
            mtime: Mutex::new(None),
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
        // Whether it becomes a job file (which may list the job's checkpoints) matters only to
        // a file not settled yet.
        let settled = file.writer.try_lock().is_ok_and(|w| matches!(&*w, Writer::Committed(_) | Writer::Failed(_)));
        let job_file = !settled && self.ends_as_job_file(file).unwrap_or(false);
        let (last, ended, failed) = self.block_on(async {
            let mut writer = file.writer.lock().await;
            if file.open_handles.fetch_sub(1, Ordering::Relaxed) != 1 {
                return (false, false, false);
            }
            // A failed commit stays listed (a rename or a new open may retry it); a failed
            // file is dropped.
            let ended = self.end(file, &mut writer, job_file).await.is_ok();
            (true, ended, matches!(&*writer, Writer::Failed(_)))
        });
        if !last {
            return;
        }
        match file.draft {
            None if failed => self.discard_single(file),
            None if ended && job_file => {
                if let Err(e) = self.keep_job_file(file) {
                    tracing::error!(job = %file.job, path = %file.path(), "could not keep a job file: {e:?}");
                }
            }
            Some(draft) if failed && file.killed.load(Ordering::Relaxed) => self.abandon_draft(draft, file),
            Some(_) if ended => {
                if let Err(e) = self.completes_draft(file) {
                    tracing::error!(job = %file.job, path = %file.path(), "the completion marker's commit failed: {e:?}");
                }
            }
            _ => {}
        }
    }

    /// Renames `from` to `to` inside draft `draft`: a file (over another file), or a directory
    /// with everything in it. Returns the file moved, if it was one.
    pub(super) fn rename_in_draft(&self, draft: u64, from: &str, to: &str) -> Result<Option<Arc<DraftFile>>, Errno> {
        RelPath::try_from(to).map_err(|_| Errno::EINVAL)?;
        if from == to {
            return Ok(None);
        }
        let mut state = self.state();
        let d = state.drafts.get(&draft).ok_or(Errno::ENOENT)?;
        if d.committing {
            return Err(Errno::EBUSY);
        }
        let is_dir = d.dirs.contains(from);
        if !is_dir && !d.files.contains_key(from) {
            return Err(Errno::ENOENT);
        }
        if d.dirs.contains(to) && !is_dir {
            return Err(Errno::EISDIR);
        }
        if is_dir && d.files.contains_key(to) {
            return Err(Errno::ENOTDIR);
        }
        let prefix = format!("{from}/");
        if is_dir && to.starts_with(&prefix) {
            return Err(Errno::EINVAL);
        }
        let to_prefix = format!("{to}/");
        if is_dir && d.dirs.contains(to) && d.files.keys().chain(d.dirs.iter()).any(|p| p.starts_with(&to_prefix)) {
            return Err(Errno::ENOTEMPTY);
        }
        let (parent, _) = crate::tree::split(to);
        if !d.dirs.contains(parent) {
            return Err(Errno::ENOENT);
        }
        let renamed = |path: &str| -> Option<String> {
            if path == from {
                Some(to.to_owned())
            } else {
                path.strip_prefix(&prefix).map(|rest| format!("{to}/{rest}"))
            }
        };
        let moves: Vec<(String, String, u64)> =
            d.files.iter().filter_map(|(path, id)| Some((path.clone(), renamed(path)?, *id))).collect();
        // Each moved file's new path goes into its chunk list's record under its writer lock,
        // which ending the file takes to read its path: all or none.
        let files: Vec<Arc<DraftFile>> = moves.iter().filter_map(|(_, _, id)| state.files.get(id).cloned()).collect();
        let mut writers = Vec::with_capacity(files.len());
        for file in &files {
            let writer = file.writer.try_lock().map_err(|_| Errno::EBUSY)?;
            if !matches!(&*writer, Writer::Done(_) | Writer::Open(_) | Writer::Spilled) {
                return Err(Errno::EBUSY);
            }
            writers.push(writer);
        }
        for ((_, new_path, _), (file, writer)) in moves.iter().zip(files.iter().zip(writers.iter_mut())) {
            if let Writer::Done(done) = &mut **writer {
                done.path = RelPath::try_from(new_path.as_str()).map_err(|_| Errno::EINVAL)?;
            }
            *file.path.lock_unpoisoned() = new_path.clone();
        }
        drop(writers);
        let d = state.drafts.get_mut(&draft).ok_or(Errno::ENOENT)?;
        let mut replaced = Vec::new();
        for (old_path, _, _) in &moves {
            d.files.remove(old_path);
        }
        for (_, new_path, id) in &moves {
            if let Some(old) = d.files.insert(new_path.clone(), *id) {
                replaced.push(old);
            }
        }
        if is_dir {
            let dirs: Vec<String> = d.dirs.iter().filter_map(|p| renamed(p)).collect();
            d.dirs.retain(|p| renamed(p).is_none());
            d.dirs.extend(dirs);
        }
        let journaled: Vec<(String, StreamedFile)> = moves
            .iter()
            .filter_map(|(old_path, new_path, _)| {
                let mut file = d.journaled.remove(old_path)?;
                file.path = RelPath::try_from(new_path.as_str()).ok()?;
                Some((new_path.clone(), file))
            })
            .collect();
        if !is_dir {
            d.journaled.remove(to);
        }
        d.journaled.extend(journaled);
        for old in replaced {
            state.files.remove(&old);
        }
        drop(state);
        self.journal_draft(draft)?;
        Ok(if is_dir { None } else { files.into_iter().next() })
    }

    /// A draft one of whose writers died writing it: nothing of it is committed, and it is gone
    /// from the job directory (its name free again), as a half-written checkpoint on a local
    /// disk would not be: a framework resuming lists only what is complete.
    pub(super) fn abandon_draft(&self, draft: u64, file: &DraftFile) {
        let mut state = self.state();
        let Some(d) = state.drafts.get(&draft) else { return };
        if d.committing {
            return;
        }
        let Some(d) = state.drafts.remove(&draft) else { return };
        tracing::warn!(
            job = %d.job, draft = %d.name, path = %file.path(),
            "a writer died writing this file: the checkpoint being written is dropped, nothing of it committed"
        );
        state.draft_names.remove(&(d.job.clone(), d.name.clone()));
        for id in d.files.values() {
            state.files.remove(id);
        }
        drop(state);
        self.forget_draft(&d.job, &d.name);
    }

    /// After a file of a draft ended, or was renamed: a completion marker at the top of a
    /// draft written in place commits it under its own name, at the step its name ends in.
    /// The markers are what the frameworks write last: DCP's `.metadata` (`FileSystemWriter`
    /// writes `.metadata.tmp` and renames it), and Orbax's `commit_success.txt`.
    pub(super) fn completes_draft(&self, file: &DraftFile) -> Result<(), Errno> {
        let Some(draft) = file.draft else { return Ok(()) };
        let path = file.path();
        let name = match self.state().drafts.get(&draft) {
            Some(d) if !d.committing => d.name.clone(),
            _ => return Ok(()),
        };
        if !COMPLETION_MARKERS.iter().any(|(marker, prefix)| path == *marker && name.starts_with(prefix)) {
            return Ok(());
        }
        let Some(step) = step_of(&name) else {
            tracing::warn!(job = %file.job, draft = %name, "a completion marker landed in a draft whose name has no step number: rename it to commit it");
            return Ok(());
        };
        tracing::info!(job = %file.job, draft = %name, marker = %file.path(), "completion marker written: committing");
        self.commit_draft(draft, step, &name, BTreeMap::new())
    }

    /// Ends a file's writes: its bytes durable, its chunk list final. A one-file checkpoint is
    /// committed here. Idempotent; a failure is reported again on every later call.
    pub(super) fn finish(&self, file: &Arc<DraftFile>) -> Result<(), Errno> {
        let job_file = self.ends_as_job_file(file)?;
        self.block_on(async { self.end(file, &mut *file.writer.lock().await, job_file).await })?;
        if job_file {
            self.keep_job_file(file)?;
        }
        Ok(())
    }

    /// Whether `file` is directly in its job directory under a name that makes it a job file
    /// when it ends, not a one-file checkpoint.
    pub(super) fn ends_as_job_file(&self, file: &DraftFile) -> Result<bool, Errno> {
        Ok(file.draft.is_none() && self.is_job_file_name(&file.job, &file.path())?)
    }

    /// [`Self::finish`], `writer` (the file's) held; a `job_file` is left finished for
    /// [`Self::keep_job_file`]. A file given up ([`DraftFile::killed`]) fails instead: a
    /// truncated file is never committed, and the partial chunk's staging buffer goes back to
    /// the pool now rather than with the mount.
    pub(super) async fn end(&self, file: &Arc<DraftFile>, writer: &mut Writer, job_file: bool) -> Result<(), Errno> {
        // Read under the writer lock: a rename inside the draft takes that lock too.
        let path = file.path();
        match std::mem::replace(writer, Writer::Failed(Errno::EIO)) {
            Writer::Open(_) | Writer::Spilled if file.killed.load(Ordering::Relaxed) => {
                tracing::warn!(job = %file.job, %path, "its writer died mid-write: the file is given up");
                file.drop_spill();
            }
            open @ (Writer::Open(_) | Writer::Spilled) => {
                let Ok(rel) = RelPath::try_from(path.as_str()) else { return Err(Errno::EINVAL) };
                let mode = file.mode.load(Ordering::Relaxed) as u32;
                match self.upload_rest(file, open).await {
                    Ok(stream) => match stream.finish(rel, mode).await {
                        Ok(done) => {
                            // Recorded at the control plane before the close returns.
                            let recorded = match file.draft {
                                Some(draft) => self.journal_closed(draft, &path, &done).await,
                                None => Ok(()),
                            };
                            *writer = match recorded {
                                Ok(()) => Writer::Done(done),
                                Err(code) => Writer::Failed(code),
                            };
                        }
                        Err(e) => *writer = Writer::Failed(errno("write", &path, &e)),
                    },
                    Err(code) => *writer = Writer::Failed(code),
                }
            }
            other => *writer = other,
        }
        if file.draft.is_none()
            && !job_file
            && !file.abandoned.load(Ordering::Relaxed)
            && !crate::tree::temporary(&path)
            && let Writer::Done(done) = &*writer
        {
            let step = step_of(&path).ok_or(Errno::EINVAL)?;
            let metadata =
                [(NAME_KEY.to_owned(), path.clone()), (KIND_KEY.to_owned(), "file".to_owned())].into_iter().collect();
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
                file.drop_spill();
                self.committed_single(file, step, checkpoint);
            }
        }
        match &*writer {
            Writer::Failed(code) => Err(*code),
            _ => Ok(()),
        }
    }

    /// The stream of a file that ends, with every byte of it: the zeros past the head of a
    /// pre-sized file, or, for a file written out of order, all of its spill copy.
    pub(super) async fn upload_rest(&self, file: &DraftFile, writer: Writer) -> Result<StreamingFile, Errno> {
        let path = file.path();
        let size = file.size();
        let (mut stream, from_copy) = match writer {
            Writer::Open(stream) => (stream, false),
            _ => (self.client.streaming_file(&file.job).await.map_err(|e| errno("write", &path, &e))?, true),
        };
        let mut piece = Vec::new();
        while stream.size() < size {
            let len = (size - stream.size()).min(UPLOAD_PIECE_BYTES as u64) as u32;
            if from_copy {
                piece = file.read_at(stream.size(), len)?;
            } else {
                piece.clear();
                piece.resize(len as usize, 0);
            }
            if piece.is_empty() {
                return Err(Errno::EIO);
            }
            stream.write(&piece).await.map_err(|e| errno("write", &path, &e))?;
        }
        Ok(stream)
    }

    /// Renames one-file checkpoint `file` (not committed yet) of `job` from `name` to `new_name`.
    /// A finished file under a final name is committed now; one still open commits at its close.
    pub(super) fn rename_single(&self, job: &str, name: &str, file: u64, new_name: &str) -> Result<(), Errno> {
        RelPath::try_from(new_name).map_err(|_| Errno::EINVAL)?;
        if new_name == super::META_DIR {
            return Err(Errno::EINVAL);
        }
        let final_name = !crate::tree::temporary(new_name);
        // Over a job file (`os.replace("last.ckpt.tmp", "last.ckpt")`): it replaces that file
        // when it is kept.
        match self.resolve(&Node::Job(job.to_owned()), new_name) {
            Ok(Node::JobFile { .. }) => {}
            Ok(_) => return Err(Errno::EEXIST),
            Err(e) if e == Errno::ENOENT => {}
            Err(e) => return Err(e),
        }
        let file = self.state().files.get(&file).cloned().ok_or(Errno::ENOENT)?;
        let new_path = RelPath::try_from(new_name).map_err(|_| Errno::EINVAL)?;
        let done = self.block_on(async {
            let mut writer = file.writer.lock().await;
            match &mut *writer {
                Writer::Done(done) => done.path = new_path,
                Writer::Open(_) | Writer::Spilled => {}
                Writer::Failed(code) => return Err(*code),
                Writer::Committed(_) => return Err(Errno::EROFS),
            }
            {
                let mut state = self.state();
                let key = (job.to_owned(), name.to_owned());
                let id = state.single_files.remove(&key).ok_or(Errno::ENOENT)?;
                state.single_files.insert((job.to_owned(), new_name.to_owned()), id);
            }
            *file.path.lock_unpoisoned() = new_name.to_owned();
            Ok(matches!(&*writer, Writer::Done(_)))
        })?;
        if done && final_name {
            // Its close came first: the rename is what ends it.
            self.finish(&file)?;
        }
        Ok(())
    }

    /// Bookkeeping after a one-file checkpoint committed: the name now resolves to the committed
    /// file, through the same inode.
    pub(super) fn committed_single(&self, file: &Arc<DraftFile>, step: u64, checkpoint: u64) {
        let mut state = self.state();
        settle_single(&mut state, file, Node::StepFile { job: file.job.clone(), step, checkpoint, index: 0 });
        state.trees.remove(&(file.job.clone(), step));
        state.jobs = None;
        state.steps.remove(&file.job);
    }

    /// Bookkeeping after a job file was kept: the name now resolves to the kept file, through
    /// the same inode.
    pub(super) fn kept_single(&self, file: &Arc<DraftFile>) {
        let mut state = self.state();
        settle_single(&mut state, file, Node::JobFile { job: file.job.clone(), name: file.path() });
        state.job_files.remove(&file.job);
    }

    /// Commits draft `id` as step `step` of its job, under `name`.
    pub(super) fn commit_draft(
        &self,
        id: u64,
        step: u64,
        name: &str,
        metadata: BTreeMap<String, String>,
    ) -> Result<(), Errno> {
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
        let result = self.commit_draft_files(id, (step, name), &job, (&files, &dirs), metadata);
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
        (step, name): (u64, &str),
        job: &str,
        (files, dirs): (&[Arc<DraftFile>], &BTreeSet<String>),
        mut metadata: BTreeMap<String, String>,
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
            let open = || matches!(&*self.block_on(file.writer.lock()), Writer::Open(_) | Writer::Spilled);
            while open() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            // Its last release ends (or fails) it with the writer lock held: a file open here is
            // still open for writing, and committing could cut it short.
            let writer = self.block_on(file.writer.lock());
            match &*writer {
                Writer::Done(done) => streamed.push(done.clone()),
                Writer::Open(_) | Writer::Spilled => {
                    tracing::warn!(job, path = %file.path(), "a file of the checkpoint is still open for writing: not committed");
                    return Err(Errno::EBUSY);
                }
                Writer::Failed(code) => return Err(*code),
                Writer::Committed(_) => return Err(Errno::EINVAL),
            }
            writers.push(writer);
        }
        // The files other hosts' mounts wrote into the same draft (their ranks'), as recorded.
        let draft_name = self.state().drafts.get(&id).map(|d| d.name.clone()).ok_or(Errno::ENOENT)?;
        let mut dirs = dirs.clone();
        let others = self.other_writers(&job, &draft_name, &mut streamed, &mut dirs)?;
        let directories: Vec<RelPath> =
            dirs.iter().filter(|d| !d.is_empty()).filter_map(|d| RelPath::try_from(d.as_str()).ok()).collect();
        metadata.insert(NAME_KEY.to_owned(), name.to_owned());
        metadata.insert(KIND_KEY.to_owned(), "dir".to_owned());
        let checkpoint = self
            .block_on(self.client.commit_streamed(&job, step, streamed, directories, metadata))
            .map_err(|e| errno("commit", &format!("{job}/{name}"), &e))?
            .checkpoint_id;
        // Its files are the checkpoint's now: a descriptor still open on one writes no more to
        // it (ENOTSUP), and its close has nothing left to report.
        for mut writer in writers {
            *writer = Writer::Committed(None);
        }
        for file in files {
            file.drop_spill();
        }
        self.became_committed(id, &job, step, checkpoint);
        self.forget_draft(&job, &draft_name);
        self.drop_other_writers(&job, &draft_name, &others);
        Ok(())
    }

    /// Draft `id` is committed as step `step` of `job` (checkpoint `checkpoint`), here or by
    /// another writer's mount: it is forgotten, and the inodes the kernel may still hold of it
    /// each become their committed counterpart.
    pub(super) fn became_committed(&self, id: u64, job: &str, step: u64, checkpoint: u64) {
        let job = job.to_owned();
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
        state.jobs = None;
        state.steps.remove(&job);
    }
}

/// One-file `file`, ended, is no longer being written: its name resolves to `settled` (a
/// committed checkpoint's file, a kept job file), through the inode the kernel knows it by.
fn settle_single(state: &mut super::State, file: &Arc<DraftFile>, settled: Node) {
    let key = (file.job.clone(), file.path());
    let id =
        state.single_files.get(&key).copied().filter(|id| state.files.get(id).is_some_and(|f| Arc::ptr_eq(f, file)));
    if let Some(id) = id {
        state.single_files.remove(&key);
        state.files.remove(&id);
        remap(state, &Node::DraftFile { file: id }, settled);
    }
}
