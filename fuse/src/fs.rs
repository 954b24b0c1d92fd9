//! The FUSE filesystem: starckpt's jobs, checkpoints and files as a directory tree (see the crate
//! docs for the layout and the rules).
//!
//! fuser calls these methods from several threads at once. Shared state sits behind one mutex
//! held only for map lookups and updates, never across I/O; control-plane and data-plane calls
//! run on the tokio runtime (`Handle::block_on` from the FUSE thread). Writes to one file are
//! serialised by that file's own async mutex.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::OsStr;
use std::hash::{Hash, Hasher};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fuser::{
    Errno, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, KernelConfig, LockOwner, OpenFlags,
    RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs,
    ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use starckpt_client::{CheckpointInfo, Client, Error};
use starckpt_proto::{JobName, RelPath};

use crate::read::{Reader, Reads};
use crate::tree::{StepTree, join, step_of};
use starckpt_client::sync::LockExt;

mod config;
mod state;

pub use config::*;
pub use state::*;

mod journal;
mod judge;
mod names;
mod spill;
mod view;
mod write;

use judge::{Requester, opener_of};
pub use names::{KIND_KEY, TRACKER_KEY_PREFIX};
use names::{META_DIR, Removal};
use write::{Draft, DraftFile, Writer};

/// Metadata key recording the name a checkpoint was committed under through the mount.
pub const NAME_KEY: &str = "starckpt.fuse.name";

impl Filesystem for CkptFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let wanted = self.config.max_write;
        let max_write = config.set_max_write(wanted).err().map_or(wanted, |allowed| {
            let _ = config.set_max_write(allowed);
            allowed
        });
        // `open(O_TRUNC)` arrives as one open with the flag, not a truncate and an open: a job
        // file opened so is replaced by what is written, not cut in place.
        let _ = config.add_capabilities(fuser::InitFlags::FUSE_ATOMIC_O_TRUNC);
        let read_ahead = read_ahead_bytes(&self.client, &self.config);
        let _ = config.set_max_readahead(read_ahead).or_else(|allowed| config.set_max_readahead(allowed));
        tracing::info!(max_write, "FUSE session initialised");
        Ok(())
    }

    fn destroy(&mut self) {
        // A save that returned success but left a draft its framework never finished (no
        // marker, no rename) is not a checkpoint: say so loudly where an operator looks.
        let state = self.state();
        for d in state.drafts.values().filter(|d| !d.files.is_empty()) {
            tracing::warn!(
                job = %d.job, draft = %d.name, files = d.files.len(),
                writer = ?self.config.draft_writer,
                "unmounted with a checkpoint still being written: it is NOT committed (a mount started again at the same point lists it, with its closed files)"
            );
        }
        for (job, name) in state.single_files.keys() {
            tracing::warn!(%job, file = %name, "unmounted with a one-file checkpoint not committed (never closed, or a temporary name never renamed)");
        }
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let result = self.node(parent).and_then(|parent| self.resolve(&parent, name_str(name)?));
        match result {
            Ok(node) => self.reply_entry(node, reply),
            Err(e) => reply.error(e),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        let mut state = self.state();
        let remove = match state.inodes.get_mut(&ino.0) {
            Some((node, count)) if *node != Node::Root => {
                *count = count.saturating_sub(nlookup);
                *count == 0
            }
            _ => false,
        };
        if remove
            && let Some((node, _)) = state.inodes.remove(&ino.0)
            && state.by_node.get(&node) == Some(&ino.0)
        {
            state.by_node.remove(&node);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.node(ino).and_then(|node| self.node_attr(ino.0, &node)) {
            Ok((attr, ttl)) => reply.attr(&ttl, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let result = self.node(ino).and_then(|node| {
            // A file being written: one of a draft, or a job file being written again through
            // this handle (opened with O_TRUNC; `ftruncate` on it).
            let writing = match &node {
                Node::DraftFile { file } => Some(self.state().files.get(file).cloned().ok_or(Errno::ENOENT)?),
                Node::JobFile { .. } => fh.and_then(|fh| self.write_handle(fh)),
                _ => None,
            };
            match (&node, writing) {
                (_, Some(file)) => {
                    let mode = mode.map(|mode| mode & 0o7777);
                    self.block_on(async {
                        let mut writer = file.writer.lock().await;
                        if let Some(size) = size
                            && size != file.size.load(Ordering::Relaxed)
                        {
                            file.truncate(self, &mut writer, size).await?;
                        }
                        if let (Some(mode), Writer::Done(done)) = (mode, &mut *writer) {
                            done.mode = mode;
                        }
                        Ok::<(), Errno>(())
                    })?;
                    if let Some(mode) = mode {
                        file.mode.store(u64::from(mode), Ordering::Relaxed);
                    }
                    if let Some(mtime) = mtime {
                        *file.mtime.lock_unpoisoned() = Some(match mtime {
                            TimeOrNow::SpecificTime(time) => time,
                            TimeOrNow::Now => SystemTime::now(),
                        });
                    }
                }
                // Times and modes of directories being written are not kept; accept them.
                (Node::DraftDir { .. } | Node::Job(_) | Node::Root, None) => {
                    if size.is_some() {
                        return Err(Errno::EISDIR);
                    }
                }
                // A committed checkpoint's bytes never change. What `cp -a`, `rsync -a`, `tar -x`
                // and `shutil.copystat` (Lightning's move of a finished file into place) set
                // after a file is complete (times, owner, permission bits) is accepted and not
                // kept: the checkpoint was committed as written.
                // A kept job file is replaced whole, never cut in place: what `copystat` sets after
                // `shutil.move` wrote it (Lightning's last.ckpt) is accepted the same way.
                (Node::StepDir { .. } | Node::StepFile { .. } | Node::JobFile { .. }, None) => {
                    if size.is_some() {
                        return Err(Errno::EROFS);
                    }
                    tracing::debug!(
                        ?node,
                        "times, owner and mode of a committed checkpoint or a job file are not kept"
                    );
                }
                (Node::Meta(_) | Node::Pointer { .. } | Node::DraftFile { .. }, None) => return Err(Errno::EROFS),
            }
            self.node_attr(ino.0, &node)
        });
        match result {
            Ok((attr, ttl)) => reply.attr(&ttl, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        let result = self.node(ino).and_then(|node| match node {
            Node::Pointer { job, step } => self.pointer(&job, step),
            _ => Err(Errno::EINVAL),
        });
        match result {
            Ok(target) => reply.data(target.as_bytes()),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, _mode: u32, _umask: u32, reply: ReplyEntry) {
        let result = (|| {
            let name = name_str(name)?;
            match self.node(parent)? {
                Node::Root => {
                    JobName::try_from(name).map_err(|_| Errno::EINVAL)?;
                    if self.resolve(&Node::Root, name).is_ok() {
                        return Err(Errno::EEXIST);
                    }
                    self.state().local_jobs.insert(name.to_owned());
                    Ok(Node::Job(name.to_owned()))
                }
                Node::Job(job) => {
                    RelPath::try_from(name).map_err(|_| Errno::EINVAL)?;
                    if self.job_name_taken(&job, name)? {
                        return Err(Errno::EEXIST);
                    }
                    let mut state = self.state();
                    let id = state.next_draft;
                    state.next_draft += 1;
                    let mut draft = Draft {
                        job: job.clone(),
                        name: name.to_owned(),
                        dirs: [String::new()].into_iter().collect(),
                        files: BTreeMap::new(),
                        committing: false,
                        writers: Vec::new(),
                        journaled: BTreeMap::new(),
                        begun_ms: unix_ms(),
                    };
                    draft.wrote(req.pid());
                    state.drafts.insert(id, draft);
                    state.draft_names.insert((job, name.to_owned()), id);
                    Ok(Node::DraftDir { draft: id, path: String::new() })
                }
                Node::DraftDir { draft, path } => {
                    let full = join(&path, name);
                    RelPath::try_from(full.as_str()).map_err(|_| Errno::EINVAL)?;
                    let mut state = self.state();
                    let d = state.drafts.get_mut(&draft).ok_or(Errno::ENOENT)?;
                    if d.committing {
                        return Err(Errno::EBUSY);
                    }
                    if d.dirs.contains(&full) || d.files.contains_key(&full) {
                        return Err(Errno::EEXIST);
                    }
                    d.wrote(req.pid());
                    d.dirs.insert(full.clone());
                    drop(state);
                    self.journal_draft(draft)?;
                    Ok(Node::DraftDir { draft, path: full })
                }
                Node::StepDir { .. } => Err(Errno::EROFS),
                _ => Err(Errno::ENOTDIR),
            }
        })();
        match result {
            Ok(node) => self.reply_entry(node, reply),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        let result = (|| {
            let name = name_str(name)?;
            let opener = opener_of(req.pid())?;
            let mode = mode & !umask & 0o7777;
            match self.node(parent)? {
                Node::Job(job) => {
                    // A one-file checkpoint (its step is the name's last number), or a job file (a
                    // name with no step number: `fs/names.rs`). One with a temporary name
                    // (`.tmpXXXX`, `model_5.pt.tmp`) waits for the rename to its final name
                    // instead of its close.
                    if name == META_DIR {
                        return Err(Errno::EINVAL);
                    }
                    RelPath::try_from(name).map_err(|_| Errno::EINVAL)?;
                    if self.job_name_taken(&job, name)? {
                        return Err(Errno::EEXIST);
                    }
                    let file = self.new_draft_file(&job, None, name.to_owned(), mode)?;
                    let mut state = self.state();
                    let id = state.next_draft;
                    state.next_draft += 1;
                    state.files.insert(id, Arc::clone(&file));
                    state.single_files.insert((job, name.to_owned()), id);
                    Ok((Node::DraftFile { file: id }, file, opener))
                }
                Node::DraftDir { draft, path } => {
                    let full = join(&path, name);
                    RelPath::try_from(full.as_str()).map_err(|_| Errno::EINVAL)?;
                    let job = {
                        let state = self.state();
                        let d = state.drafts.get(&draft).ok_or(Errno::ENOENT)?;
                        if d.committing {
                            return Err(Errno::EBUSY);
                        }
                        if d.dirs.contains(&full) || d.files.contains_key(&full) {
                            return Err(Errno::EEXIST);
                        }
                        d.job.clone()
                    };
                    let file = self.new_draft_file(&job, Some(draft), full.clone(), mode)?;
                    let mut state = self.state();
                    let id = state.next_draft;
                    state.next_draft += 1;
                    let d = state.drafts.get_mut(&draft).ok_or(Errno::ENOENT)?;
                    if d.committing || d.files.contains_key(&full) {
                        return Err(Errno::EBUSY);
                    }
                    d.wrote(req.pid());
                    d.files.insert(full, id);
                    state.files.insert(id, Arc::clone(&file));
                    Ok((Node::DraftFile { file: id }, file, opener))
                }
                Node::Root => Err(Errno::EPERM),
                Node::StepDir { .. } => Err(Errno::EROFS),
                _ => Err(Errno::ENOTDIR),
            }
        })();
        match result {
            Ok((node, file, opener)) => {
                let ino = self.remember(node.clone());
                match self.node_attr(ino, &node) {
                    Ok((attr, ttl)) => {
                        let fh = self.add_created(file, opener);
                        reply.created(&ttl, &attr, Generation(0), FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO)
                    }
                    Err(e) => {
                        // No handle reaches the kernel, so no release will come for it.
                        self.release_write(&file);
                        reply.error(e)
                    }
                }
            }
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let result = self.node(ino).and_then(|node| match node {
            Node::StepFile { job, step, checkpoint, index } => {
                if wants_write(flags) {
                    return Err(Errno::EROFS);
                }
                let reader = self.open_reader(&job, step, checkpoint, index)?;
                // Committed files never change: the kernel may keep their pages across opens.
                Ok((self.add_handle(Handle::Read(reader)), FopenFlags::FOPEN_KEEP_CACHE))
            }
            Node::DraftFile { file } => {
                let file = self.state().files.get(&file).cloned().ok_or(Errno::ENOENT)?;
                // What was written is read from its spill copy, which the kernel must not cache
                // past a write through another handle.
                if !wants_write(flags) {
                    if file.spill.lock_unpoisoned().is_none() {
                        return Err(Errno::ENOTSUP);
                    }
                    return Ok((self.add_handle(Handle::DraftRead(file)), FopenFlags::FOPEN_DIRECT_IO));
                }
                let opener = opener_of(req.pid())?;
                self.block_on(async { file.reopen(&mut *file.writer.lock().await) })?;
                // Writing a draft again (a trainer resumed into a checkpoint directory its killed
                // run left) makes it attended again.
                if let Some(draft) = file.draft
                    && let Some(d) = self.state().drafts.get_mut(&draft)
                {
                    d.wrote(req.pid());
                }
                Ok((self.add_handle(Handle::Write(file, opener)), FopenFlags::FOPEN_DIRECT_IO))
            }
            Node::JobFile { job, name } => {
                if !wants_write(flags) {
                    return Ok((self.add_handle(self.open_job_file(&job, &name)?), FopenFlags::empty()));
                }
                // Written again: replaced whole by what is written now, when it ends. Writing
                // into the kept bytes (append, patch) is not supported.
                if flags.0 & libc::O_TRUNC == 0 {
                    tracing::warn!(%job, file = %name, "a job file is replaced whole: open it with O_TRUNC to write it");
                    return Err(Errno::ENOTSUP);
                }
                let opener = opener_of(req.pid())?;
                let file = self.new_draft_file(&job, None, name.clone(), 0o644)?;
                {
                    let mut state = self.state();
                    if state.single_files.contains_key(&(job.clone(), name.clone())) {
                        // Being written already, by another open (O_CREAT raced it).
                        drop(state);
                        self.discard_single(&file);
                        self.release_write(&file);
                        return Err(Errno::EBUSY);
                    }
                    let id = state.next_draft;
                    state.next_draft += 1;
                    state.files.insert(id, Arc::clone(&file));
                    state.single_files.insert((job, name), id);
                }
                Ok((self.add_created(file, opener), FopenFlags::FOPEN_DIRECT_IO))
            }
            Node::Pointer { .. } => Err(Errno::ELOOP),
            _ => Err(Errno::EISDIR),
        });
        match result {
            Ok((fh, flags)) => reply.opened(FileHandle(fh), flags),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let reader = match self.state().handles.get(&fh.0) {
            Some(Handle::Read(reader)) => Arc::clone(reader),
            Some(Handle::Write(file, _) | Handle::DraftRead(file)) => {
                let file = Arc::clone(file);
                return match file.read_at(offset, size) {
                    Ok(data) => reply.data(&data),
                    Err(e) => reply.error(e),
                };
            }
            Some(Handle::Content(content)) => {
                let start = (offset as usize).min(content.len());
                let end = start.saturating_add(size as usize).min(content.len());
                return reply.data(&content[start..end]);
            }
            Some(Handle::Dir(_)) | None => return reply.error(Errno::EBADF),
        };
        match self.reads.read(&reader, offset, size) {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let Some(file) = self.write_handle(fh) else { return reply.error(Errno::EBADF) };
        file.wrote_from(req.pid());
        // A one-file checkpoint written to after its commit, to be taken back.
        let mut undo = None;
        let result = self.block_on(async {
            let mut writer = file.writer.lock().await;
            if !matches!(&*writer, Writer::Open(_) | Writer::Spilled) {
                // Closed files are final (a new open for writing reopens one: `open`). A file
                // whose write failed stays failed. Bytes written after it ended (through a
                // descriptor shared before its opener closed one: `cmd >&2` inside
                // `{ ...; } > f`, or a child still writing) are not in it: a draft holding it
                // cannot commit, and a one-file checkpoint its opener's close committed is
                // deleted again. A draft the user renamed to commit stays committed.
                return Err(match &mut *writer {
                    Writer::Failed(code) => *code,
                    Writer::Done(_) => {
                        *writer = Writer::Failed(Errno::EIO);
                        Errno::ENOTSUP
                    }
                    Writer::Committed(Some(committed)) => {
                        undo = Some(*committed);
                        *writer = Writer::Failed(Errno::EIO);
                        Errno::EIO
                    }
                    Writer::Committed(None) | Writer::Open(_) | Writer::Spilled => Errno::ENOTSUP,
                });
            }
            file.write_at(&mut writer, offset, data).await
        });
        if let Some((step, checkpoint)) = undo {
            let path = file.path();
            tracing::error!(job = %file.job, %path, step, "written to after its close committed it: deleting that checkpoint");
            if let Err(e) = self.delete_step(&file.job, step, Some(checkpoint)) {
                tracing::error!(job = %file.job, %path, step, "could not delete a checkpoint committed short: {e:?}");
            }
        }
        match result {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(e),
        }
    }

    fn flush(&self, req: &Request, _ino: INodeNo, fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        let Some((file, opener)) = self.write_handle_opened(fh) else { return reply.ok() };
        // close() of a descriptor, which ends the file when its opener closes it with data
        // written. Not when it is closed for a writer killed mid-write (or before writing
        // anything): that must never commit a truncated file; the file is marked, and its
        // release gives it up. Nor another process's close: a child the writer started
        // (`subprocess`, whose exec closes the inherited descriptor) while it was still
        // writing, killed or not. The file then ends at the opener's close, or at its last
        // release. An opener exiting cleanly without closing (a program writing to its stdout)
        // ends it.
        let Some((true, requester)) = file.judge(opener, req.pid()) else { return reply.ok() };
        // A shell's `echo x > f` closes a duplicate before writing, so a file nothing was written
        // to yet is not ended here; it ends at release (or commit).
        if requester == Requester::Died || file.size.load(Ordering::Relaxed) == 0 {
            return reply.ok();
        }
        // A writer's death still being judged (a child whose exit was told late) gives the file
        // up rather than this close ending it.
        file.judged();
        match self.finish(&file).and_then(|()| self.completes_draft(&file)) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn fsync(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        let Some(file) = self.write_handle(fh) else { return reply.ok() };
        let result = self.block_on(async {
            match &mut *file.writer.lock().await {
                Writer::Open(stream) => stream.sync().await.map_err(|e| errno("fsync", &file.path(), &e)),
                // Durable on the targets means uploaded: the whole file from its copy, which
                // then streams on from its end.
                writer @ Writer::Spilled => {
                    let mut stream = self.upload_rest(&file, Writer::Spilled).await?;
                    stream.sync().await.map_err(|e| errno("fsync", &file.path(), &e))?;
                    *writer = Writer::Open(stream);
                    Ok(())
                }
                Writer::Failed(code) => Err(*code),
                Writer::Done(_) | Writer::Committed(_) => Ok(()),
            }
        });
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let handle = self.state().handles.remove(&fh.0);
        if let Some(Handle::Write(file, _)) = handle {
            self.release_write(&file);
        }
        reply.ok();
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let result = (|| {
            let name = name_str(name)?;
            match self.node(parent)? {
                Node::Job(job) => {
                    let key = (job.clone(), name.to_owned());
                    let single = {
                        let state = self.state();
                        state.single_files.get(&key).and_then(|id| state.files.get(id)).cloned()
                    };
                    if let Some(file) = single {
                        self.discard_single(&file);
                        return Ok(());
                    }
                    match self.resolve(&Node::Job(job.clone()), name)? {
                        // A one-file checkpoint by its name: deleting the file deletes it (that
                        // checkpoint only, never a newer one saved at its step since).
                        Node::StepFile { step, checkpoint, .. } => self.delete_step(&job, step, Some(checkpoint)),
                        Node::JobFile { .. } => self.remove_job_file(&job, name),
                        Node::Meta(_) => Err(Errno::EISDIR),
                        _ => Err(Errno::EISDIR),
                    }
                }
                // `rm -r` of a committed checkpoint: see `Removal`.
                Node::StepDir { job, step, checkpoint, dir } => {
                    match self.resolve(&Node::StepDir { job, step, checkpoint, dir: dir.clone() }, name)? {
                        Node::StepFile { .. } => {
                            let remover = opener_of(req.pid())?;
                            self.note_removed(checkpoint, remover, join(&dir, name))
                        }
                        _ => Err(Errno::EISDIR),
                    }
                }
                Node::Meta(_) => Err(Errno::EROFS),
                Node::DraftDir { draft, path } => {
                    let full = join(&path, name);
                    let mut state = self.state();
                    let d = state.drafts.get_mut(&draft).ok_or(Errno::ENOENT)?;
                    if d.committing {
                        return Err(Errno::EBUSY);
                    }
                    if d.dirs.contains(&full) {
                        return Err(Errno::EISDIR);
                    }
                    let id = d.files.remove(&full).ok_or(Errno::ENOENT)?;
                    let journaled = d.journaled.remove(&full).is_some();
                    state.files.remove(&id);
                    drop(state);
                    if journaled {
                        self.journal_draft(draft)?;
                    }
                    Ok(())
                }
                Node::Root => Err(Errno::EISDIR),
                _ => Err(Errno::ENOTDIR),
            }
        })();
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let result = (|| {
            let name = name_str(name)?;
            match self.node(parent)? {
                Node::Root => {
                    let (local, has_children) = {
                        let state = self.state();
                        let children =
                            state.draft_names.keys().chain(state.single_files.keys()).any(|(j, _)| j == name);
                        (state.local_jobs.contains(name), children)
                    };
                    // Never call jobs() with the state locked: it locks it too.
                    let on_server = self.jobs()?.iter().any(|j| j == name);
                    if has_children || on_server {
                        Err(Errno::ENOTEMPTY)
                    } else if local {
                        self.state().local_jobs.remove(name);
                        Ok(())
                    } else {
                        Err(Errno::ENOENT)
                    }
                }
                Node::Job(job) => match self.resolve(&Node::Job(job.clone()), name)? {
                    // Removing a committed step's directory deletes the checkpoint (the one the
                    // name resolved to).
                    Node::StepDir { step, checkpoint, dir, .. } if dir.is_empty() => {
                        self.delete_step(&job, step, Some(checkpoint))
                    }
                    Node::DraftDir { draft, .. } => {
                        let mut state = self.state();
                        let d = state.drafts.get(&draft).ok_or(Errno::ENOENT)?;
                        if !d.files.is_empty() || d.dirs.len() > 1 {
                            return Err(Errno::ENOTEMPTY);
                        }
                        state.drafts.remove(&draft);
                        state.draft_names.remove(&(job.clone(), name.to_owned()));
                        drop(state);
                        self.forget_draft(&job, name);
                        Ok(())
                    }
                    Node::Meta(_) => Err(Errno::EROFS),
                    _ => Err(Errno::ENOTDIR),
                },
                Node::StepDir { job, step, checkpoint, dir } => {
                    let full = join(&dir, name);
                    match self.resolve(&Node::StepDir { job: job.clone(), step, checkpoint, dir }, name)? {
                        Node::StepDir { .. } => {
                            let tree = self.tree_at(&job, step, checkpoint)?;
                            let prefix = format!("{full}/");
                            let left = tree
                                .manifest
                                .files
                                .iter()
                                .map(|f| f.path.as_str())
                                .chain(tree.dirs.keys().map(String::as_str))
                                .any(|p| p.starts_with(&prefix) && !self.removed(checkpoint, p));
                            if left {
                                return Err(Errno::ENOTEMPTY);
                            }
                            let remover = opener_of(req.pid())?;
                            self.note_removed(checkpoint, remover, full)
                        }
                        _ => Err(Errno::ENOTDIR),
                    }
                }
                Node::DraftDir { draft, path } => {
                    let full = join(&path, name);
                    let mut state = self.state();
                    let d = state.drafts.get_mut(&draft).ok_or(Errno::ENOENT)?;
                    if !d.dirs.contains(&full) {
                        return Err(if d.files.contains_key(&full) { Errno::ENOTDIR } else { Errno::ENOENT });
                    }
                    let prefix = format!("{full}/");
                    if d.files.keys().chain(d.dirs.iter()).any(|p| p.starts_with(&prefix)) {
                        return Err(Errno::ENOTEMPTY);
                    }
                    d.dirs.remove(&full);
                    drop(state);
                    self.journal_draft(draft)?;
                    Ok(())
                }
                Node::Meta(_) => Err(Errno::EROFS),
                _ => Err(Errno::ENOTDIR),
            }
        })();
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let result = (|| {
            if flags.contains(RenameFlags::RENAME_EXCHANGE) {
                return Err(Errno::EINVAL);
            }
            let (name, newname) = (name_str(name)?, name_str(newname)?);
            match (self.node(parent)?, self.node(newparent)?) {
                (Node::Job(job), Node::Job(new_job)) => {
                    if job != new_job {
                        return Err(Errno::EXDEV);
                    }
                    match self.resolve(&Node::Job(job.clone()), name)? {
                        // Rename-to-commit: the new name's last number is the step.
                        Node::DraftDir { draft, path } if path.is_empty() => {
                            let step = step_of(newname).ok_or(Errno::EINVAL)?;
                            if self.job_name_taken(&job, newname)? {
                                return Err(Errno::EEXIST);
                            }
                            self.commit_draft(draft, step, newname, Default::default())
                        }
                        // The write-to-a-temporary-then-rename idiom (`os.replace(p + ".tmp", p)`,
                        // safetensors' `.tmpXXXXXX`): the rename names the one-file checkpoint.
                        Node::DraftFile { file } => self.rename_single(&job, name, file, newname),
                        // A kept job file is moved by copying it (`mv` does, on EXDEV).
                        Node::JobFile { .. } => Err(Errno::EXDEV),
                        _ => Err(Errno::EROFS),
                    }
                }
                (Node::DraftDir { draft, path }, Node::DraftDir { draft: new_draft, path: new_path }) => {
                    if draft != new_draft {
                        return Err(Errno::EXDEV);
                    }
                    let (from, to) = (join(&path, name), join(&new_path, newname));
                    let moved = self.rename_in_draft(draft, &from, &to)?;
                    // `.metadata.tmp` renamed to `.metadata` (DCP) completes the draft.
                    match moved {
                        Some(file) => self.completes_draft(&file),
                        None => Ok(()),
                    }
                }
                (Node::StepDir { .. }, _) | (_, Node::StepDir { .. }) => Err(Errno::EROFS),
                _ => Err(Errno::EXDEV),
            }
        })();
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn link(&self, _req: &Request, _ino: INodeNo, _newparent: INodeNo, _newname: &OsStr, reply: ReplyEntry) {
        reply.error(Errno::EPERM);
    }

    fn symlink(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _link_name: &OsStr,
        _target: &std::path::Path,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EPERM);
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.node(ino).and_then(|node| self.listing(ino.0, &node)) {
            Ok(entries) => {
                reply.opened(FileHandle(self.add_handle(Handle::Dir(Arc::new(entries)))), FopenFlags::empty())
            }
            Err(e) => reply.error(e),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let opened = match self.state().handles.get(&fh.0) {
            Some(Handle::Dir(entries)) => Some(Arc::clone(entries)),
            _ => None,
        };
        // Without a handle from opendir (none is promised), listed afresh.
        let entries =
            match opened.map_or_else(|| self.node(ino).and_then(|node| self.listing(ino.0, &node)).map(Arc::new), Ok) {
                Ok(entries) => entries,
                Err(e) => return reply.error(e),
            };
        let start = usize::try_from(offset).unwrap_or(usize::MAX).min(entries.len());
        for (index, (ino, kind, name)) in entries.iter().enumerate().skip(start) {
            if reply.add(INodeNo(*ino), (index + 1) as u64, *kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn releasedir(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, _flags: OpenFlags, reply: ReplyEmpty) {
        self.state().handles.remove(&fh.0);
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let targets = self.block_on(self.client.targets()).unwrap_or_default();
        let block = 4096u64;
        let capacity: u64 = targets.iter().map(|t| t.capacity_bytes).sum();
        let used: u64 = targets.iter().map(|t| t.used_bytes).sum();
        let free = capacity.saturating_sub(used) / block;
        reply.statfs(capacity / block, free, free, 0, 0, block as u32, 255, block as u32);
    }
}
