//! [`UringEngine`]: one thread per device owning an io_uring, with registered buffers and files
//! (the engine module's docs say why).

use super::*;

pub(super) enum OpKind {
    /// `create`: a new file; otherwise an existing one, overwritten in place.
    Write {
        create: bool,
    },
    Read,
    SyncDir,
}

pub(super) struct Request {
    kind: OpKind,
    path: PathBuf,
    buf: Option<BoxedBuf>,
    /// A split transfer's memory outside `buf` ([`IoEngine::read_file_split`],
    /// [`IoEngine::write_file_split`]).
    tail: Option<ExternalBuf>,
    /// A split write's bytes of `buf` before `tail`.
    split: usize,
    reply: oneshot::Sender<io::Result<Completed>>,
}

/// A finished operation: its buffer back, and the bytes it transferred.
pub(super) struct Completed {
    buf: Option<BoxedBuf>,
    bytes: usize,
}

/// Most buffers a ring registers (a store's pool has 64 by default).
pub const FIXED_BUFFERS: u32 = 256;

/// io_uring on a dedicated thread. Requests arrive over a bounded channel (back-pressure on the
/// callers when the device queue is full) and up to `queue_depth` are in flight on the ring.
pub struct UringEngine {
    requests: mpsc::Sender<Request>,
    fixed: Arc<std::sync::atomic::AtomicUsize>,
    registered_files: bool,
}

impl UringEngine {
    pub fn start(queue_depth: usize) -> io::Result<UringEngine> {
        UringEngine::start_with(queue_depth, FIXED_BUFFERS, true)
    }

    /// With up to `fixed_buffers` pool buffers registered (0: none, every operation pins its
    /// buffer's pages itself), and files opened by the ring into its table of registered files
    /// when `registered_files` and the kernel has one (Linux 5.19), otherwise with a syscall on
    /// the ring's thread (for comparisons, and older kernels).
    pub fn start_with(queue_depth: usize, fixed_buffers: u32, registered_files: bool) -> io::Result<UringEngine> {
        let queue_depth = queue_depth.clamp(1, 256);
        // Room for each operation's entry and for the CLOSE of each finished one's file.
        let ring = io_uring::IoUring::new((queue_depth * 4) as u32)?;
        let registered_files = registered_files
            && match ring.submitter().register_files_sparse((queue_depth * 4) as u32) {
                Ok(()) => true,
                Err(error) => {
                    tracing::info!(%error, "io_uring registered files unavailable; files are opened per operation");
                    false
                }
            };
        let (requests, receiver) = mpsc::channel(queue_depth * 2);
        let fixed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let registry = FixedBuffers::new(&ring, fixed_buffers, Arc::clone(&fixed));
        std::thread::Builder::new()
            .name("starckpt-uring".into())
            .spawn(move || uring_thread(ring, receiver, queue_depth, registry, registered_files))?;
        Ok(UringEngine { requests, fixed, registered_files })
    }

    /// Whether the ring opens files into its table of registered files.
    pub fn registered_files(&self) -> bool {
        self.registered_files
    }

    pub(super) async fn submit(
        &self,
        kind: OpKind,
        path: PathBuf,
        buf: Option<BoxedBuf>,
    ) -> io::Result<Option<BoxedBuf>> {
        self.submit_with(kind, path, buf, None, 0).await.map(|done| done.buf)
    }

    pub(super) async fn submit_with(
        &self,
        kind: OpKind,
        path: PathBuf,
        buf: Option<BoxedBuf>,
        tail: Option<ExternalBuf>,
        split: usize,
    ) -> io::Result<Completed> {
        let (reply, answer) = oneshot::channel();
        self.requests
            .send(Request { kind, path, buf, tail, split, reply })
            .await
            .map_err(|_| io::Error::other("io_uring thread has stopped"))?;
        answer.await.map_err(|_| io::Error::other("io_uring thread dropped a request"))?
    }
}

#[async_trait]
impl IoEngine for UringEngine {
    async fn write_new_file(&self, path: PathBuf, buf: BoxedBuf) -> io::Result<BoxedBuf> {
        self.submit(OpKind::Write { create: true }, path, Some(buf))
            .await?
            .ok_or_else(|| io::Error::other("buffer lost"))
    }

    async fn overwrite_file(&self, path: PathBuf, buf: BoxedBuf) -> io::Result<BoxedBuf> {
        self.submit(OpKind::Write { create: false }, path, Some(buf))
            .await?
            .ok_or_else(|| io::Error::other("buffer lost"))
    }

    async fn read_file(&self, path: PathBuf, buf: BoxedBuf) -> io::Result<BoxedBuf> {
        self.submit(OpKind::Read, path, Some(buf)).await?.ok_or_else(|| io::Error::other("buffer lost"))
    }

    async fn read_file_split(&self, path: PathBuf, head: BoxedBuf, tail: ExternalBuf) -> io::Result<(BoxedBuf, usize)> {
        let head_len = head.aligned().capacity();
        let done = self.submit_with(OpKind::Read, path, Some(head), Some(tail), 0).await?;
        let head = done.buf.ok_or_else(|| io::Error::other("buffer lost"))?;
        Ok((head, done.bytes.saturating_sub(head_len)))
    }

    async fn write_file_split(
        &self,
        path: PathBuf,
        create: bool,
        head: BoxedBuf,
        split: usize,
        body: ExternalBuf,
    ) -> io::Result<BoxedBuf> {
        let done = self.submit_with(OpKind::Write { create }, path, Some(head), Some(body), split).await?;
        done.buf.ok_or_else(|| io::Error::other("buffer lost"))
    }

    async fn sync_dir(&self, path: PathBuf) -> io::Result<()> {
        self.submit(OpKind::SyncDir, path, None).await.map(|_| ())
    }

    fn kind(&self) -> EngineKind {
        EngineKind::Uring
    }

    fn fixed_buffers(&self) -> usize {
        self.fixed.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Pool buffers registered with a ring, by their identity in their pool. A buffer is registered
/// on first use; its pool keeps it allocated, and a registration is only ever used for the same
/// (pool, index), so a dropped pool's registrations (whose pages the ring keeps pinned) are never
/// reused for other memory.
pub(super) struct FixedBuffers {
    capacity: u32,
    registered: std::collections::HashMap<PoolSlot, u16>,
    /// Registration is off (an old kernel, a memlock limit): operations pin their buffers.
    off: bool,
    count: Arc<std::sync::atomic::AtomicUsize>,
}

impl FixedBuffers {
    pub(super) fn new(
        ring: &io_uring::IoUring,
        capacity: u32,
        count: Arc<std::sync::atomic::AtomicUsize>,
    ) -> FixedBuffers {
        let capacity = capacity.min(u32::from(u16::MAX));
        let off = capacity == 0
            || match ring.submitter().register_buffers_sparse(capacity) {
                Ok(()) => false,
                Err(error) => {
                    tracing::info!(%error, "io_uring fixed buffers unavailable; buffers are pinned per operation");
                    true
                }
            };
        FixedBuffers { capacity, registered: std::collections::HashMap::new(), off, count }
    }

    /// The fixed-buffer index of `buf` (registering it now if needed), or None to use it unfixed.
    pub(super) fn index(&mut self, ring: &io_uring::IoUring, buf: &BoxedBuf) -> Option<u16> {
        let slot = buf.pool_slot().filter(|_| !self.off)?;
        if let Some(&index) = self.registered.get(&slot) {
            return Some(index);
        }
        let next = u32::try_from(self.registered.len()).ok().filter(|&n| n < self.capacity)?;
        let aligned = buf.aligned();
        let iovec = libc::iovec { iov_base: aligned.as_ptr().cast_mut().cast(), iov_len: aligned.capacity() };
        // SAFETY: a pool buffer stays allocated while its pool lives; after that the ring keeps
        // its pages pinned and this index is never used for other memory (see the type's docs).
        match unsafe { ring.submitter().register_buffers_update(next, &[iovec], None) } {
            Ok(_) => {
                self.registered.insert(slot, next as u16);
                self.count.store(self.registered.len(), std::sync::atomic::Ordering::Relaxed);
                Some(next as u16)
            }
            Err(error) => {
                tracing::info!(%error, "io_uring buffer registration failed; buffers are pinned per operation");
                self.off = true;
                None
            }
        }
    }
}

pub(super) enum Phase {
    /// The ring is opening the file into its table of registered files.
    Open,
    Transfer,
    Sync,
}

/// An operation's file.
pub(super) enum Handle {
    /// To be opened by the ring: the path, kept here until the open completes.
    Opening(std::ffi::CString),
    /// A registered file (a direct descriptor: an index in the ring's file table, never in the
    /// process's descriptor table), opened by the ring.
    Registered(u32),
    /// Opened here with a syscall, where the ring has no file table to open into.
    File(File),
}

/// The descriptor an entry names.
#[derive(Clone, Copy)]
pub(super) enum Target {
    Registered(u32),
    Fd(std::os::fd::RawFd),
}

/// Evaluates `$entry` with `$fd` bound to `$target` as the io_uring type it is (the crate's trait
/// over both types is sealed, so this cannot be a generic function).
macro_rules! with_target {
    ($target:expr, |$fd:ident| $entry:expr) => {
        match $target {
            Target::Registered(index) => {
                let $fd = io_uring::types::Fixed(index);
                $entry
            }
            Target::Fd(raw) => {
                let $fd = io_uring::types::Fd(raw);
                $entry
            }
        }
    };
}

/// `openat` flags of an operation's file (no O_CLOEXEC: direct descriptors refuse it, and have no
/// exec to survive).
pub(super) fn open_flags(kind: &OpKind) -> i32 {
    match kind {
        OpKind::Write { create: true } => libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_DIRECT,
        OpKind::Write { create: false } => libc::O_WRONLY | libc::O_DIRECT,
        OpKind::Read => libc::O_RDONLY | libc::O_DIRECT,
        OpKind::SyncDir => libc::O_RDONLY | libc::O_DIRECTORY,
    }
}

/// Completions of the CLOSEs of registered files carry this instead of an operation's slot.
pub(super) const CLOSE_USER_DATA: u64 = u64::MAX;

/// Gives back a registered file's table entry once its operation is over: a CLOSE on the ring
/// (its completion is not waited for), or, if the submission queue is full, a synchronous update.
pub(super) fn close_registered(ring: &mut io_uring::IoUring, handle: &Handle) {
    let Handle::Registered(index) = *handle else { return };
    let close = io_uring::opcode::Close::new(io_uring::types::Fixed(index)).build().user_data(CLOSE_USER_DATA);
    // SAFETY: a CLOSE names no memory.
    if unsafe { ring.submission().push(&close) }.is_err()
        && let Err(error) = ring.submitter().register_files_update(index, &[-1])
    {
        tracing::warn!(%error, index, "could not close a registered file");
    }
}

pub(super) struct InFlight {
    kind: OpKind,
    phase: Phase,
    handle: Handle,
    buf: Option<BoxedBuf>,
    /// A split transfer's memory outside `buf`; the transfer is then vectored over `iovecs`.
    tail: Option<ExternalBuf>,
    /// A split write's bytes of `buf` before `tail`.
    split: usize,
    /// A vectored transfer's iovecs, boxed so that their address stays put while the kernel
    /// reads them.
    iovecs: Box<[libc::iovec; 3]>,
    /// The buffer's fixed index, when registered with the ring.
    fixed: Option<u16>,
    done: usize,
    reply: oneshot::Sender<io::Result<Completed>>,
}

impl InFlight {
    /// The next submission entry for this operation's current phase.
    pub(super) fn next_entry(&mut self, slot: usize) -> io_uring::squeue::Entry {
        use io_uring::{opcode, types};
        let target = match &self.handle {
            Handle::Opening(path) => {
                // SAFETY (for the path): it lives in this InFlight until the open completes.
                let entry = opcode::OpenAt::new(types::Fd(libc::AT_FDCWD), path.as_ptr())
                    .flags(open_flags(&self.kind))
                    .mode(0o666)
                    .file_index(Some(types::DestinationSlot::auto_target()))
                    .build();
                return entry.user_data(slot as u64);
            }
            Handle::Registered(index) => Target::Registered(*index),
            Handle::File(file) => Target::Fd(file.as_raw_fd()),
        };
        let entry = with_target!(target, |fd| match (&self.phase, &mut self.buf) {
            (Phase::Transfer, Some(buf)) => {
                if let Some(tail) = &self.tail {
                    let bounds = match self.kind {
                        OpKind::Write { .. } => (self.split, write_len(buf)),
                        _ => (buf.aligned().capacity(), buf.aligned().capacity()),
                    };
                    let count = split_iovecs(buf, bounds, tail, self.done, &mut self.iovecs) as u32;
                    let (iovecs, offset) = (self.iovecs.as_ptr(), self.done as u64);
                    // SAFETY (for the iovecs): they, the buffer and the tail live in this
                    // InFlight until completion.
                    match self.kind {
                        OpKind::Write { .. } => opcode::Writev::new(fd, iovecs, count).offset(offset).build(),
                        _ => opcode::Readv::new(fd, iovecs, count).offset(offset).build(),
                    }
                } else {
                    let total = match self.kind {
                        OpKind::Write { .. } => write_len(buf),
                        _ => buf.aligned().capacity(),
                    };
                    let remaining = (total - self.done) as u32;
                    // SAFETY (for the pointer): the buffer lives in this InFlight until completion.
                    let ptr = unsafe { buf.aligned_mut().as_mut_ptr().add(self.done) };
                    let offset = self.done as u64;
                    match (&self.kind, self.fixed) {
                        (OpKind::Write { .. }, Some(index)) => {
                            opcode::WriteFixed::new(fd, ptr, remaining, index).offset(offset).build()
                        }
                        (OpKind::Write { .. }, None) => opcode::Write::new(fd, ptr, remaining).offset(offset).build(),
                        (_, Some(index)) => opcode::ReadFixed::new(fd, ptr, remaining, index).offset(offset).build(),
                        (_, None) => opcode::Read::new(fd, ptr, remaining).offset(offset).build(),
                    }
                }
            }
            (Phase::Sync, _) if matches!(self.kind, OpKind::SyncDir) => opcode::Fsync::new(fd).build(),
            _ => opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build(),
        });
        entry.user_data(slot as u64)
    }

    /// The phase after the file is open.
    pub(super) fn first_phase(kind: &OpKind) -> Phase {
        if matches!(kind, OpKind::SyncDir) { Phase::Sync } else { Phase::Transfer }
    }

    /// Advances on a completion. Returns the outcome when the operation is finished.
    pub(super) fn complete(&mut self, result: i32) -> Option<io::Result<Completed>> {
        if result < 0 {
            return Some(Err(io::Error::from_raw_os_error(-result)));
        }
        match self.phase {
            Phase::Open => {
                self.handle = Handle::Registered(result as u32);
                self.phase = InFlight::first_phase(&self.kind);
                None
            }
            Phase::Transfer => {
                let capacity = match (&self.kind, self.buf.as_ref()) {
                    (_, None) => 0,
                    (OpKind::Write { .. }, Some(b)) => write_len(b) + self.tail.as_ref().map_or(0, ExternalBuf::len),
                    (_, Some(b)) => b.aligned().capacity() + self.tail.as_ref().map_or(0, ExternalBuf::len),
                };
                let n = result as usize;
                self.done += n;
                let eof = n == 0;
                match self.kind {
                    OpKind::Read if eof || self.done >= capacity => {
                        let mut buf = self.buf.take();
                        if let Some(b) = buf.as_mut() {
                            let len = self.done.min(b.aligned().capacity());
                            b.aligned_mut().set_len(len);
                        }
                        Some(Ok(Completed { buf, bytes: self.done }))
                    }
                    OpKind::Write { .. } if eof => {
                        Some(Err(io::Error::new(io::ErrorKind::WriteZero, "device accepted no bytes")))
                    }
                    OpKind::Write { .. } if self.done >= capacity => {
                        self.phase = Phase::Sync;
                        None
                    }
                    _ => None,
                }
            }
            Phase::Sync => Some(Ok(Completed { buf: self.buf.take(), bytes: self.done })),
        }
    }
}

/// Turns a request into an in-flight operation: its file to be opened by the ring into its file
/// table when `registered_files`, otherwise opened here; or answers the error.
pub(super) fn start_request(
    request: Request,
    ring: &io_uring::IoUring,
    registry: &mut FixedBuffers,
    registered_files: bool,
) -> Option<InFlight> {
    let opened = if registered_files {
        use std::os::unix::ffi::OsStrExt;
        std::ffi::CString::new(request.path.as_os_str().as_bytes())
            .map(Handle::Opening)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path with a NUL byte"))
    } else {
        match request.kind {
            OpKind::Write { create: true } => create_direct(&request.path),
            OpKind::Write { create: false } => open_direct_write(&request.path),
            OpKind::Read => open_direct_read(&request.path),
            OpKind::SyncDir => File::open(&request.path),
        }
        .map(Handle::File)
    };
    match opened {
        Ok(handle) => Some(InFlight {
            phase: if registered_files { Phase::Open } else { InFlight::first_phase(&request.kind) },
            kind: request.kind,
            handle,
            // A vectored transfer uses no fixed buffer.
            fixed: request.buf.as_ref().filter(|_| request.tail.is_none()).and_then(|buf| registry.index(ring, buf)),
            buf: request.buf,
            tail: request.tail,
            split: request.split,
            iovecs: Box::new([libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; 3]),
            done: 0,
            reply: request.reply,
        }),
        Err(error) => {
            let _ = request.reply.send(Err(error));
            None
        }
    }
}

pub(super) fn uring_thread(
    mut ring: io_uring::IoUring,
    mut receiver: mpsc::Receiver<Request>,
    queue_depth: usize,
    mut registry: FixedBuffers,
    registered_files: bool,
) {
    let mut slots: Vec<Option<InFlight>> = (0..queue_depth).map(|_| None).collect();
    let mut in_flight = 0usize;
    let mut closed = false;
    loop {
        // CLOSEs queued by the last completions go in before this thread may block for requests.
        if in_flight == 0 && !ring.submission().is_empty() {
            let _ = ring.submit();
        }
        // Admit new requests: block for one when idle, otherwise take what is queued.
        while in_flight < queue_depth && !closed {
            let next = if in_flight == 0 {
                match receiver.blocking_recv() {
                    Some(r) => Some(r),
                    None => {
                        closed = true;
                        None
                    }
                }
            } else {
                match receiver.try_recv() {
                    Ok(r) => Some(r),
                    Err(mpsc::error::TryRecvError::Empty) => None,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        closed = true;
                        None
                    }
                }
            };
            let Some(request) = next else { break };
            let Some(mut op) = start_request(request, &ring, &mut registry, registered_files) else { continue };
            let slot = slots.iter().position(Option::is_none).expect("in_flight < queue_depth");
            let entry = op.next_entry(slot);
            slots[slot] = Some(op);
            in_flight += 1;
            // SAFETY: the entry's buffer and fd live in `slots[slot]` until its completion.
            if unsafe { ring.submission().push(&entry) }.is_err() {
                fail_slot(&mut ring, &mut slots[slot], io::Error::other("io_uring submission queue full"));
                in_flight -= 1;
            }
        }
        if in_flight == 0 {
            if closed {
                return;
            }
            continue;
        }
        if let Err(error) = ring.submit_and_wait(1) {
            if error.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            // The kernel may still be using the submitted operations' buffers and files: answer
            // their callers but leak the memory and descriptors rather than free them under it.
            tracing::error!(%error, "io_uring failed; this target's device engine has stopped");
            for slot in slots.iter_mut() {
                if let Some(op) = slot.take() {
                    let InFlight { reply, buf, tail, iovecs, handle, .. } = op;
                    std::mem::forget(buf);
                    std::mem::forget(tail);
                    std::mem::forget(iovecs);
                    std::mem::forget(handle);
                    let _ = reply.send(Err(io::Error::new(error.kind(), format!("io_uring submit: {error}"))));
                }
            }
            // Leak the ring too: dropping it would unmap queues the kernel may still complete into.
            std::mem::forget(ring);
            return;
        }
        let completions: Vec<(u64, i32)> = ring.completion().map(|c| (c.user_data(), c.result())).collect();
        for (user_data, result) in completions {
            if user_data == CLOSE_USER_DATA {
                if result < 0 {
                    let error = io::Error::from_raw_os_error(-result);
                    tracing::warn!(%error, "closing a registered file failed");
                }
                continue;
            }
            let slot = user_data as usize;
            let Some(op) = slots.get_mut(slot).and_then(Option::as_mut) else { continue };
            match op.complete(result) {
                Some(outcome) => {
                    if let Some(op) = slots[slot].take() {
                        let _ = op.reply.send(outcome);
                        close_registered(&mut ring, &op.handle);
                    }
                    in_flight -= 1;
                }
                None => {
                    let entry = op.next_entry(slot);
                    // SAFETY: as above; the operation stays in its slot.
                    if unsafe { ring.submission().push(&entry) }.is_err() {
                        fail_slot(&mut ring, &mut slots[slot], io::Error::other("io_uring submission queue full"));
                        in_flight -= 1;
                    }
                }
            }
        }
    }
}

/// Fails an operation whose latest entry never reached the kernel (so its buffer is free to drop),
/// closing its registered file if it has one.
pub(super) fn fail_slot(ring: &mut io_uring::IoUring, slot: &mut Option<InFlight>, error: io::Error) {
    if let Some(op) = slot.take() {
        let _ = op.reply.send(Err(error));
        close_registered(ring, &op.handle);
    }
}
