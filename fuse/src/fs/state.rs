//! The mount's state: its nodes (what each inode stands for), open handles, the maps of drafts
//! and files being written, and the bookkeeping around them ([`CkptFs`]).

use super::*;

/// What an inode stands for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum Node {
    Root,
    Job(String),
    /// `<job>/.starckpt/`, the mount's own pointers ([`META_DIR`]).
    Meta(String),
    /// `<job>/.starckpt/latest` (None) or `<job>/.starckpt/<step>`: a symlink to the name the
    /// latest (or that step's) committed checkpoint shows under.
    Pointer {
        job: String,
        step: Option<u64>,
    },
    /// A job file (`last.ckpt`, `latest`): a name with no step number, directly in the job
    /// directory, kept at the control plane (`fs/names.rs`).
    JobFile {
        job: String,
        name: String,
    },
    /// A directory of a committed checkpoint ("" is the step directory itself). `checkpoint` is
    /// its id: a step deleted and saved again is another checkpoint, whose nodes (and inodes,
    /// and cached pages) are not this one's; this one's then answer ESTALE.
    StepDir {
        job: String,
        step: u64,
        checkpoint: u64,
        dir: String,
    },
    /// A file of a committed checkpoint, by index into its manifest's files.
    StepFile {
        job: String,
        step: u64,
        checkpoint: u64,
        index: usize,
    },
    /// A directory being written (a draft checkpoint of this mount); "" is its top.
    DraftDir {
        draft: u64,
        path: String,
    },
    /// A file being written, in a draft or directly in a job directory.
    DraftFile {
        file: u64,
    },
}

pub(super) enum Handle {
    Read(Arc<Reader>),
    /// A file being written, and the process that opened the handle (its thread group id): only
    /// that process's close ends the file ([`CkptFs::flush`]).
    Write(Arc<DraftFile>, u32),
    /// A file being written, opened to read what was written so far.
    DraftRead(Arc<DraftFile>),
    /// An open directory: its listing as of `opendir`, which `readdir` pages through. Built once
    /// per open, not per page (the kernel asks for ~4 KiB of names at a time, so rebuilding it
    /// for each page made listing N entries cost N²/100 node lookups), and stable while open.
    Dir(Arc<Vec<(u64, FileType, String)>>),
    /// A tracker file's content as a committed checkpoint recorded it ([`names::JobEntry`]).
    Content(Arc<Vec<u8>>),
}

#[derive(Default)]
pub(super) struct State {
    pub(super) inodes: HashMap<u64, (Node, u64)>,
    pub(super) by_node: HashMap<Node, u64>,
    pub(super) next_ino: u64,
    pub(super) handles: HashMap<u64, Handle>,
    pub(super) next_handle: u64,
    pub(super) local_jobs: BTreeSet<String>,
    pub(super) drafts: HashMap<u64, Draft>,
    pub(super) draft_names: HashMap<(String, String), u64>,
    pub(super) files: HashMap<u64, Arc<DraftFile>>,
    pub(super) single_files: HashMap<(String, String), u64>,
    pub(super) next_draft: u64,
    /// Committed checkpoints' names and kinds, by checkpoint id (`fs/names.rs`).
    pub(super) labels: HashMap<u64, Arc<names::Label>>,
    /// Job files by job, as last listed, and when.
    pub(super) job_files: HashMap<String, (Instant, Arc<Vec<starckpt_client::JobFileInfo>>)>,
    /// Committed checkpoints being removed file by file, by checkpoint id.
    pub(super) removals: HashMap<u64, Removal>,
    pub(super) trees: HashMap<(String, u64), Arc<StepTree>>,
    pub(super) jobs: Option<(Instant, Vec<String>)>,
    pub(super) steps: HashMap<String, (Instant, Vec<CheckpointInfo>)>,
}

pub struct CkptFs {
    pub(super) client: Client,
    pub(super) runtime: tokio::runtime::Handle,
    pub(super) config: MountConfig,
    pub(super) reads: Reads,
    pub(super) spills: Arc<spill::Spills>,
    /// Held while a draft's record is put or dropped at the control plane (`fs/journal.rs`).
    pub(super) recording: tokio::sync::Mutex<()>,
    pub(super) state: Mutex<State>,
    pub(super) uid: u32,
    pub(super) gid: u32,
    pub(super) mounted_at: SystemTime,
}

pub(super) fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

pub(super) fn time_of(unix_ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(unix_ms)
}

/// The errno a client error becomes; the message goes to the log.
pub(super) fn errno(op: &str, what: &str, error: &Error) -> Errno {
    tracing::warn!(op, what, %error, "request failed");
    match error {
        Error::NotFound { .. } => Errno::ENOENT,
        // What NFS answers for a file deleted under an open handle.
        Error::Deleted { .. } => Errno::ESTALE,
        Error::AlreadyExists { .. } => Errno::EEXIST,
        Error::Fenced { .. } | Error::Denied { .. } => Errno::EPERM,
        Error::Rejected { .. } | Error::Invalid(_) | Error::InvalidInput(_) => Errno::EINVAL,
        Error::NoTarget { last, .. } if last.to_string().contains("NoSpace") => Errno::ENOSPC,
        _ => Errno::EIO,
    }
}

pub(super) fn name_str(name: &OsStr) -> Result<&str, Errno> {
    name.to_str().ok_or(Errno::EINVAL)
}

impl CkptFs {
    pub fn new(client: Client, runtime: tokio::runtime::Handle, config: MountConfig) -> CkptFs {
        let mut state = State { next_ino: 2, next_handle: 1, next_draft: 1, ..State::default() };
        state.inodes.insert(1, (Node::Root, 1));
        state.by_node.insert(Node::Root, 1);
        // SAFETY: getuid/getgid have no preconditions.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        let reads = Reads::new(client.clone(), runtime.clone(), config.read_ahead_chunks, config.read_ahead_budget);
        let spills = spill::Spills::new(config.spill_dir.clone(), config.spill_limit_bytes);
        let fs = CkptFs {
            client,
            runtime,
            config,
            reads,
            spills,
            recording: tokio::sync::Mutex::new(()),
            state: Mutex::new(state),
            uid,
            gid,
            mounted_at: SystemTime::now(),
        };
        // On a thread of its own: the caller may be running on the runtime.
        std::thread::scope(|scope| {
            let restoring = scope.spawn(|| fs.runtime.block_on(fs.restore_drafts()));
            if restoring.join().is_err() {
                tracing::error!("restoring the drafts of an earlier run of this mount failed");
            }
        });
        fs
    }

    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        // Every update leaves the maps consistent; a panicked request does not poison the mount.
        self.state.lock_unpoisoned()
    }

    pub(super) fn node(&self, ino: INodeNo) -> Result<Node, Errno> {
        self.state().inodes.get(&ino.0).map(|(node, _)| node.clone()).ok_or(Errno::ENOENT)
    }

    /// The inode of `node`, counting one kernel lookup.
    pub(super) fn remember(&self, node: Node) -> u64 {
        let mut state = self.state();
        if let Some(ino) = state.by_node.get(&node).copied() {
            if let Some(entry) = state.inodes.get_mut(&ino) {
                entry.1 += 1;
            }
            return ino;
        }
        let ino = state.next_ino;
        state.next_ino += 1;
        state.inodes.insert(ino, (node.clone(), 1));
        state.by_node.insert(node, ino);
        ino
    }

    /// An inode number for a directory listing: the known one, or a stable stand-in (listings
    /// do not count as lookups, so they must not grow the table).
    pub(super) fn listing_ino(&self, node: &Node) -> u64 {
        if let Some(ino) = self.state().by_node.get(node) {
            return *ino;
        }
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        node.hash(&mut hasher);
        hasher.finish() | (1 << 63)
    }

    pub(super) fn block_on<T>(&self, future: impl std::future::Future<Output = T>) -> T {
        self.runtime.block_on(future)
    }

    /// The file behind a write handle; None for read handles and unknown ones.
    pub(super) fn write_handle(&self, fh: FileHandle) -> Option<Arc<DraftFile>> {
        self.write_handle_opened(fh).map(|(file, _)| file)
    }

    /// [`CkptFs::write_handle`], with the process that opened the handle.
    pub(super) fn write_handle_opened(&self, fh: FileHandle) -> Option<(Arc<DraftFile>, u32)> {
        match self.state().handles.get(&fh.0) {
            Some(Handle::Write(file, opener)) => Some((Arc::clone(file), *opener)),
            _ => None,
        }
    }

    pub(super) fn add_handle(&self, handle: Handle) -> u64 {
        if let Handle::Write(file, _) = &handle {
            file.open_handles.fetch_add(1, Ordering::Relaxed);
        }
        self.insert_handle(handle)
    }

    /// Adds the handle `create` opened a new file with (counted in its `open_handles` already).
    pub(super) fn add_created(&self, file: Arc<DraftFile>, opener: u32) -> u64 {
        self.insert_handle(Handle::Write(file, opener))
    }

    pub(super) fn insert_handle(&self, handle: Handle) -> u64 {
        let mut state = self.state();
        let fh = state.next_handle;
        state.next_handle += 1;
        state.handles.insert(fh, handle);
        fh
    }

    /// Deletes the checkpoint at `step` of `job`; with `only`, just when it is that checkpoint
    /// (the name resolved to it earlier). A name that no longer resolved to what is there is
    /// forgotten either way.
    pub(super) fn delete_step(&self, job: &str, step: u64, only: Option<u64>) -> Result<(), Errno> {
        let deleted = match only {
            Some(checkpoint) => self.block_on(self.client.delete_seen(job, step, checkpoint)),
            None => self.block_on(self.client.delete(job, step)),
        };
        deleted.map_err(|e| errno("delete", &format!("{job}/{step}"), &e))?;
        let mut state = self.state();
        state.trees.remove(&(job.to_owned(), step));
        if let Some(checkpoint) = only {
            state.removals.remove(&checkpoint);
        }
        drop(state);
        self.forget_listings(job);
        Ok(())
    }
}

/// Points the inode of `old` at `new`, unless `new` already has an inode of its own (then the
/// old inode keeps its node and goes stale).
pub(super) fn remap(state: &mut State, old: &Node, new: Node) {
    if state.by_node.contains_key(&new) {
        return;
    }
    if let Some(ino) = state.by_node.remove(old) {
        if let Some(entry) = state.inodes.get_mut(&ino) {
            entry.0 = new.clone();
        }
        state.by_node.insert(new, ino);
    }
}

pub(super) fn wants_write(flags: OpenFlags) -> bool {
    let access = flags.0 & libc::O_ACCMODE;
    access == libc::O_WRONLY || access == libc::O_RDWR || flags.0 & (libc::O_TRUNC | libc::O_APPEND) != 0
}
