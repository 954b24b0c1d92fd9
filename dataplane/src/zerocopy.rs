//! Zero-copy sends of large data-plane payloads over TCP, and the frame writer both ends use.
//!
//! A plain `write` copies every payload byte from user memory into socket buffers: for a 4 MiB
//! chunk, 4 MiB of CPU copying per send. io_uring's SEND_ZC (Linux 6.0) instead pins the
//! payload's pages and hands them to the network stack, which a NIC with scatter-gather DMA reads
//! straight from user memory. It completes twice: once when the bytes are queued on the socket
//! (the send), and once when the kernel no longer references the pages (the notification, after
//! the peer acknowledged them). The payload is held until the second, so staging memory is never
//! reused under a possible retransmission; a writer dropped before then leaves its payloads to a
//! thread that waits for the kernel ([`RETIRE_WAIT`]), so they are released, not leaked.
//!
//! It pays for large sends through a NIC. It does not on loopback, nor through a device without
//! scatter-gather and checksum offload: there the kernel copies anyway (a "deferred copy"), after
//! pinning pages and posting a notification, which is more work than a plain write. The
//! notification says so (`IORING_SEND_ZC_REPORT_USAGE`), and [`ZeroCopySend::Auto`] sends
//! zero-copy on a connection until a notification reports a copy, then writes plainly on that
//! connection: the kernel's own advice for MSG_ZEROCOPY (`Documentation/networking/msg_zerocopy.rst`).
//! Payloads under [`MIN_ZERO_COPY_BYTES`] are always written plainly (pinning costs more than
//! copying a few pages).
//!
//! Why io_uring and not `send(MSG_ZEROCOPY)`: the latter reports completions on the socket's error
//! queue, which raises EPOLLERR; mio reports EPOLLOUT|EPOLLERR as write-closed, a readiness tokio
//! never clears, so a tokio socket with notifications queued spins in `poll_write`. io_uring posts
//! both completions to its own ring, whose descriptor the runtime polls like any other.
//!
//! Each connection that may send zero-copy owns a small ring ([`RING_ENTRIES`]). Its sends go one
//! at a time, in frame order, between the frame writer's buffered writes (flushed first), with
//! MSG_WAITALL, so the kernel queues the whole payload (waiting for socket buffer space as a
//! blocking send would) before the next frame's bytes. A kernel without SEND_ZC or usage reports
//! (before 6.2) answers EINVAL: the connection then writes plainly, as where io_uring is refused
//! (seccomp), or where the pinned pages would pass the locked-memory limit (ENOMEM: a process
//! without CAP_IPC_LOCK, as in a container).

use std::collections::{HashMap, HashSet};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use io_uring::{IoUring, cqueue, opcode, types};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncWrite, AsyncWriteExt, BufWriter, Interest};
use tokio::net::tcp::OwnedWriteHalf;

use starckpt_proto::frame::{self, Opcode};

/// Payloads at least this large go zero-copy where it is on.
pub const MIN_ZERO_COPY_BYTES: usize = 64 * 1024;

/// Submission entries of a connection's ring: one send or poll at a time, with room.
pub const RING_ENTRIES: u32 = 8;

/// Set in the user data of a send's linked timeout (sends' ids stay below it).
const LINKED_TIMEOUT: u64 = 1 << 63;

/// How long a dropped writer's payloads wait for the kernel to let go of them ([`ZeroCopy::retire`])
/// before they are abandoned to it: past TCP's own give-up on an unresponsive peer.
pub const RETIRE_WAIT: Duration = Duration::from_secs(600);

/// Buffered bytes before the frame writer writes through.
const BUFFER_BYTES: usize = 64 * 1024;

/// `IORING_SEND_ZC_REPORT_USAGE` and `IORING_NOTIF_USAGE_ZC_COPIED` (linux/io_uring.h; the
/// io-uring crate does not export its bindings).
const SEND_ZC_REPORT_USAGE: u16 = 1 << 3;
const NOTIF_USAGE_ZC_COPIED: u32 = 1 << 31;

/// Where a connection sends large payloads zero-copy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ZeroCopySend {
    /// Until the kernel reports it copied a zero-copy send (loopback, a device without offloads).
    #[default]
    Auto,
    /// Always (where the kernel supports it), copies reported or not: for measuring.
    Always,
    /// Never: plain writes.
    Off,
}

impl std::str::FromStr for ZeroCopySend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(ZeroCopySend::Auto),
            "always" | "on" => Ok(ZeroCopySend::Always),
            "off" | "never" => Ok(ZeroCopySend::Off),
            other => Err(format!("unknown zero-copy send mode {other:?} (expected auto, always or off)")),
        }
    }
}

impl std::fmt::Display for ZeroCopySend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ZeroCopySend::Auto => "auto",
            ZeroCopySend::Always => "always",
            ZeroCopySend::Off => "off",
        })
    }
}

/// Zero-copy sends of one process side (a client's TCP transport, a target's data plane), across
/// its connections.
#[derive(Debug, Default)]
pub struct ZeroCopyStats {
    sends: AtomicU64,
    bytes: AtomicU64,
    copied: AtomicU64,
    notified: AtomicU64,
    held: AtomicU64,
    refused: AtomicU64,
    abandoned: AtomicU64,
}

/// [`ZeroCopyStats`] at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ZeroCopyCounts {
    /// SEND_ZC operations that sent bytes, and those bytes.
    pub sends: u64,
    pub bytes: u64,
    /// Notifications received (each releases a send's payload), and of those, the ones that
    /// reported the kernel copied the bytes after all.
    pub notified: u64,
    pub copied: u64,
    /// Payloads held now, waiting for their notifications.
    pub held: u64,
    /// Sends refused over the locked-memory limit (each turned zero-copy off on its connection).
    pub refused: u64,
    /// Payloads never released: the kernel had not let go of them [`RETIRE_WAIT`] after their
    /// connection's writer was dropped, so their memory was left to it rather than reused.
    pub abandoned: u64,
}

impl ZeroCopyStats {
    pub fn counts(&self) -> ZeroCopyCounts {
        ZeroCopyCounts {
            sends: self.sends.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            notified: self.notified.load(Ordering::Relaxed),
            copied: self.copied.load(Ordering::Relaxed),
            held: self.held.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            abandoned: self.abandoned.load(Ordering::Relaxed),
        }
    }
}

/// Writes data-plane frames: headers and small payloads through a buffer, large payloads
/// zero-copy where that is on (module docs). Call [`FrameWriter::flush`] when nothing else is
/// queued, and wait for frames with [`FrameWriter::next`], which takes zero-copy notifications.
pub struct FrameWriter<W> {
    writer: BufWriter<W>,
    zero_copy: Option<ZeroCopy>,
    /// Longest a write may make no progress ([`FrameWriter::with_timeout`]).
    timeout: Option<Duration>,
}

impl<W> Drop for FrameWriter<W> {
    /// Runs before the socket's half (`writer`) is dropped, so the descriptor the ring's
    /// operations name is still this connection's.
    fn drop(&mut self) {
        if let Some(zero_copy) = self.zero_copy.take() {
            zero_copy.retire();
        }
    }
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    /// Plain writes only.
    pub fn new(writer: W) -> FrameWriter<W> {
        FrameWriter { writer: BufWriter::with_capacity(BUFFER_BYTES, writer), zero_copy: None, timeout: None }
    }

    /// Fails a write (frame or flush) that has not finished after `timeout` with
    /// [`io::ErrorKind::TimedOut`]: a peer that stops reading must not hold buffers forever. A
    /// zero-copy send is cancelled by the kernel (a linked timeout), so its payload is released
    /// the normal way rather than abandoned to it.
    pub fn with_timeout(mut self, timeout: Duration) -> FrameWriter<W> {
        self.timeout = Some(timeout);
        if let Some(zero_copy) = self.zero_copy.as_mut() {
            zero_copy.timeout = Some(timeout);
        }
        self
    }

    /// Writes one frame. Returns once its bytes are queued on the connection; a zero-copy payload
    /// is held (a reference to its `Bytes`) until the kernel's notification.
    pub async fn write_frame(
        &mut self,
        opcode: Opcode,
        request_id: u64,
        header: &[u8],
        payload: &[Bytes],
    ) -> io::Result<()> {
        let payload_len: usize = payload.iter().map(Bytes::len).sum();
        let zero_copy = match self.zero_copy.as_mut() {
            Some(zero_copy) if payload_len >= MIN_ZERO_COPY_BYTES => {
                zero_copy.reap();
                zero_copy.enabled
            }
            _ => false,
        };
        let writer = &mut self.writer;
        if !zero_copy {
            return timed(self.timeout, frame::write_frame(writer, opcode, request_id, header, payload)).await;
        }
        let head = async {
            frame::write_frame_head(writer, opcode, request_id, header, payload_len).await?;
            // The socket is written by two means: what is buffered goes first.
            writer.flush().await
        };
        timed(self.timeout, head).await?;
        for piece in payload {
            let sent = match self.zero_copy.as_mut() {
                Some(zero_copy) if zero_copy.enabled => zero_copy.send(piece).await?,
                _ => 0,
            };
            if sent < piece.len() {
                timed(self.timeout, self.writer.write_all(&piece[sent..])).await?;
            }
        }
        Ok(())
    }

    pub async fn flush(&mut self) -> io::Result<()> {
        timed(self.timeout, self.writer.flush()).await
    }

    /// The next frame to write from `queue` (None once it is closed), taking the notifications of
    /// zero-copy sends while waiting, so their payloads go back to their pools between frames.
    pub async fn next<T>(&mut self, queue: &mut tokio::sync::mpsc::Receiver<T>) -> io::Result<Option<T>> {
        loop {
            tokio::select! {
                message = queue.recv() => return Ok(message),
                released = self.release(), if self.holding() => released?,
            }
        }
    }

    /// Payloads sent zero-copy are held for their notifications.
    fn holding(&self) -> bool {
        self.zero_copy.as_ref().is_some_and(|z| !z.held.is_empty())
    }

    /// Waits for notifications of zero-copy sends and releases their payloads. Cancel-safe; pends
    /// while nothing is held.
    async fn release(&mut self) -> io::Result<()> {
        match self.zero_copy.as_mut() {
            Some(zero_copy) if !zero_copy.held.is_empty() => zero_copy.wait().await,
            _ => std::future::pending().await,
        }
    }
}

impl FrameWriter<OwnedWriteHalf> {
    /// A TCP connection's writer, sending large payloads zero-copy as `mode` says. Where the
    /// process may not use io_uring, writes plainly.
    pub fn tcp(writer: OwnedWriteHalf, mode: ZeroCopySend, stats: Arc<ZeroCopyStats>) -> FrameWriter<OwnedWriteHalf> {
        let fd = writer.as_ref().as_raw_fd();
        let mut frames = FrameWriter::new(writer);
        if mode != ZeroCopySend::Off {
            // The descriptor stays open as long as `frames.writer` (a half of the socket) lives.
            match ZeroCopy::new(fd, mode, stats) {
                Ok(zero_copy) => frames.zero_copy = Some(zero_copy),
                // Its ring's pages count against the same locked-memory limit as a send's (for a
                // process without CAP_IPC_LOCK, on recent kernels).
                Err(error) if error.raw_os_error() == Some(libc::ENOMEM) => tracing::info!(
                    %error,
                    "zero-copy send refused: no io_uring ring within the locked-memory limit \
                     (raise RLIMIT_MEMLOCK or grant CAP_IPC_LOCK); writing plainly"
                ),
                Err(error) => tracing::debug!(%error, "no io_uring for zero-copy sends; writing plainly"),
            }
        }
        frames
    }
}

/// `write`, failed with [`io::ErrorKind::TimedOut`] if it takes longer than `timeout`.
async fn timed<T>(timeout: Option<Duration>, write: impl Future<Output = io::Result<T>>) -> io::Result<T> {
    match timeout {
        None => write.await,
        Some(timeout) => tokio::time::timeout(timeout, write).await.unwrap_or_else(|_| Err(timed_out(timeout))),
    }
}

fn timed_out(timeout: Duration) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, format!("the peer took no bytes for {timeout:?}"))
}

/// A connection's zero-copy sender: its ring, and the payloads the kernel may still read.
struct ZeroCopy {
    ring: AsyncFd<IoUring>,
    fd: RawFd,
    mode: ZeroCopySend,
    enabled: bool,
    /// Linked to each send: the kernel cancels a send that takes longer.
    timeout: Option<Duration>,
    /// A send has succeeded here, so a later EINVAL is an error, not a kernel without SEND_ZC.
    worked: bool,
    next_id: u64,
    /// Payloads of sends submitted and not yet completed, by send id. Owned here rather than by
    /// the sending future, so that a send abandoned midway (its future dropped) still holds its
    /// payload until the kernel is done with it.
    sending: HashMap<u64, Bytes>,
    /// Payloads of completed sends, by send id, until their notifications. The kernel holds the
    /// pages of a send it has not notified, but not the memory's contents: reused early, a
    /// retransmission would carry other bytes. A dropped writer leaves both maps to
    /// [`ZeroCopy::retire`].
    held: HashMap<u64, Bytes>,
    /// Results and flags of operations whose completion arrived, by id (one at a time in flight).
    completed: HashMap<u64, (i32, u32)>,
    /// Sends whose notification was taken before their completion was (so before their payload
    /// went into `held`): over loopback the kernel copies during the send and notifies at once.
    notified_early: HashSet<u64>,
    stats: Arc<ZeroCopyStats>,
}

impl ZeroCopy {
    fn new(fd: RawFd, mode: ZeroCopySend, stats: Arc<ZeroCopyStats>) -> io::Result<ZeroCopy> {
        // SAFETY: the ring owns its descriptor and closes it only when dropped, with the AsyncFd.
        let ring = unsafe { AsyncFd::register_with_interest(IoUring::new(RING_ENTRIES)?, Interest::READABLE) }?;
        Ok(ZeroCopy {
            ring,
            fd,
            mode,
            enabled: true,
            timeout: None,
            worked: false,
            next_id: 1,
            sending: HashMap::new(),
            held: HashMap::new(),
            completed: HashMap::new(),
            notified_early: HashSet::new(),
            stats,
        })
    }

    /// Sends all of `piece`; returns how many bytes it sent, short only if the kernel turned out
    /// not to support SEND_ZC (then this connection stops trying and the caller writes the rest).
    async fn send(&mut self, piece: &Bytes) -> io::Result<usize> {
        let mut sent = 0;
        while sent < piece.len() {
            let rest = &piece[sent..];
            let len = u32::try_from(rest.len()).unwrap_or(u32::MAX);
            let id = self.next_id();
            let send = opcode::SendZc::new(types::Fd(self.fd), rest.as_ptr(), len)
                .flags(libc::MSG_WAITALL | libc::MSG_NOSIGNAL)
                .zc_flags(SEND_ZC_REPORT_USAGE)
                .build()
                .user_data(id);
            let timeout_id = id | LINKED_TIMEOUT;
            // SAFETY: the send's memory is `piece`'s, kept alive by `sending` until the send
            // completes and then by `held` until the kernel's notification says it no longer
            // reads it (`reap`), or by `retire` if this writer is dropped first; the descriptor
            // is the socket's, open while its writer lives (`FrameWriter::tcp`); the timeout's
            // timespec is read when it is submitted, here.
            let timespec = self.timeout.map(types::Timespec::from);
            self.sending.insert(id, piece.clone());
            let pushed = unsafe {
                match &timespec {
                    None => self.push(&send),
                    Some(timespec) => {
                        let timeout = opcode::LinkTimeout::new(timespec).build().user_data(timeout_id);
                        self.push(&send.flags(io_uring::squeue::Flags::IO_LINK)).and_then(|()| self.push(&timeout))
                    }
                }
            };
            if let Err(error) = pushed.and_then(|()| self.ring.get_ref().submit().map(drop)) {
                // Entries pushed but not submitted are dropped with the ring, never run.
                self.sending.remove(&id);
                return Err(error);
            }
            // `reap` moves the payload from `sending` to `held` as the completion arrives.
            let (result, _) = self.completion(id).await?;
            // A linked timeout always completes: -ETIME if it cancelled the send.
            if let Some(timeout) = self.timeout
                && self.completion(timeout_id).await?.0 == -libc::ETIME
            {
                return Err(timed_out(timeout));
            }
            match result {
                n if n > 0 => {
                    sent += n as usize;
                    self.worked = true;
                    self.stats.sends.fetch_add(1, Ordering::Relaxed);
                    self.stats.bytes.fetch_add(n as u64, Ordering::Relaxed);
                }
                0 => return Err(io::Error::from(io::ErrorKind::WriteZero)),
                e if -e == libc::EINTR => {}
                e if -e == libc::EAGAIN => self.writable().await?,
                e if !self.worked && (-e == libc::EINVAL || -e == libc::EOPNOTSUPP) => {
                    let error = io::Error::from_raw_os_error(-e);
                    tracing::info!(%error, "this kernel does not send zero-copy (io_uring SEND_ZC); writing plainly");
                    self.enabled = false;
                    return Ok(sent);
                }
                // The pages a zero-copy send pins count against RLIMIT_MEMLOCK for a process
                // without CAP_IPC_LOCK (a container's default: 8 MiB or less, shared by every
                // process of its user), and a send over the limit is refused before it sends a
                // byte. Nothing was lost: this connection writes plainly from here on.
                e if -e == libc::ENOMEM || -e == libc::ENOBUFS => {
                    let error = io::Error::from_raw_os_error(-e);
                    tracing::info!(
                        %error,
                        "zero-copy send refused: pinned pages over the locked-memory limit \
                         (raise RLIMIT_MEMLOCK or grant CAP_IPC_LOCK); writing plainly"
                    );
                    self.enabled = false;
                    self.stats.refused.fetch_add(1, Ordering::Relaxed);
                    return Ok(sent);
                }
                e => return Err(io::Error::from_raw_os_error(-e)),
            }
        }
        Ok(sent)
    }

    /// Waits until the socket can take more bytes (after a send answered EAGAIN).
    async fn writable(&mut self) -> io::Result<()> {
        let id = self.next_id();
        let poll = opcode::PollAdd::new(types::Fd(self.fd), libc::POLLOUT as u32).build().user_data(id);
        // SAFETY: a poll references no memory; the descriptor is open (as for `send`).
        unsafe { self.push(&poll) }?;
        self.ring.get_ref().submit()?;
        let waited = match self.timeout {
            None => self.completion(id).await,
            Some(timeout) => match tokio::time::timeout(timeout, self.completion(id)).await {
                Ok(done) => done,
                // The poll stays queued on the ring; dropped with it, it references no memory.
                Err(_) => return Err(timed_out(timeout)),
            },
        };
        let (result, _) = waited?;
        if result < 0 { Err(io::Error::from_raw_os_error(-result)) } else { Ok(()) }
    }

    /// The id of the next operation. One runs at a time, so a completion still unclaimed belongs
    /// to an operation abandoned midway (a dropped future, a timed-out poll): forgotten here.
    fn next_id(&mut self) -> u64 {
        self.completed.clear();
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Queues `entry` for the next submit.
    ///
    /// # Safety
    /// Whatever `entry` references must stay valid until it completes.
    unsafe fn push(&mut self, entry: &io_uring::squeue::Entry) -> io::Result<()> {
        // SAFETY: the caller's.
        unsafe { self.ring.get_mut().submission().push(entry) }
            .map_err(|_| io::Error::other("zero-copy ring's submission queue is full"))
    }

    /// Waits for the completion of the operation with user data `id`: its result and flags.
    async fn completion(&mut self, id: u64) -> io::Result<(i32, u32)> {
        loop {
            self.reap();
            if let Some(done) = self.completed.remove(&id) {
                return Ok(done);
            }
            self.ring.readable_mut().await?.clear_ready();
        }
    }

    /// Waits for at least one completion and takes what arrived.
    async fn wait(&mut self) -> io::Result<()> {
        let before = self.held.len();
        loop {
            self.reap();
            if self.held.len() < before || self.held.is_empty() {
                return Ok(());
            }
            self.ring.readable_mut().await?.clear_ready();
        }
    }

    /// Takes the completions that arrived: notifications release their payloads (and, in
    /// [`ZeroCopySend::Auto`], one that reports a copy turns zero-copy off here); other results
    /// wait for [`ZeroCopy::completion`].
    fn reap(&mut self) {
        let mut arrived: Vec<(u64, i32, u32)> =
            self.ring.get_mut().completion().map(|c| (c.user_data(), c.result(), c.flags())).collect();
        if self.ring.get_mut().submission().cq_overflow() {
            tracing::warn!("zero-copy ring's completion queue overflowed; flushing");
            let _ = self.ring.get_ref().submit();
            arrived.extend(self.ring.get_mut().completion().map(|c| (c.user_data(), c.result(), c.flags())));
        }
        for (id, result, flags) in arrived {
            if !cqueue::notif(flags) {
                // A send completed: its payload waits for the notification, unless that came
                // first (in the same batch, or before it) or none follows.
                if let Some(bytes) = self.sending.remove(&id)
                    && cqueue::more(flags)
                    && !self.notified_early.remove(&id)
                {
                    self.held.insert(id, bytes);
                    self.stats.held.fetch_add(1, Ordering::Relaxed);
                }
                self.completed.insert(id, (result, flags));
                continue;
            }
            match self.held.remove(&id) {
                Some(_) => _ = self.stats.held.fetch_sub(1, Ordering::Relaxed),
                None => _ = self.notified_early.insert(id),
            }
            self.stats.notified.fetch_add(1, Ordering::Relaxed);
            if result as u32 & NOTIF_USAGE_ZC_COPIED != 0 {
                self.stats.copied.fetch_add(1, Ordering::Relaxed);
                if self.mode == ZeroCopySend::Auto && self.enabled {
                    tracing::debug!("the kernel copied a zero-copy send (loopback or no offload); writing plainly");
                    self.enabled = false;
                }
            }
        }
    }
}

impl ZeroCopy {
    /// Lets go of this connection's ring once the kernel no longer reads any payload it was
    /// given. With none in its hands, at once. Otherwise a thread waits for the kernel
    /// ([`ZeroCopy::drain`]): notifications come as the peer acknowledges the bytes, or as the
    /// connection is torn down. A send abandoned midway (its future dropped) left a frame cut
    /// short on the connection, which is of no use to the peer any more: the send is cancelled and
    /// the socket set to reset on close, discarding what it still queues rather than waiting for
    /// a peer that may never read it.
    fn retire(mut self) {
        self.reap();
        if self.sending.is_empty() && self.held.is_empty() {
            return;
        }
        if !self.sending.is_empty() {
            let ids: Vec<u64> = self.sending.keys().copied().collect();
            for id in ids {
                let cancel = opcode::AsyncCancel::new(id).build().user_data(self.next_id());
                // SAFETY: a cancellation references no memory.
                if unsafe { self.push(&cancel) }.is_err() {
                    break;
                }
            }
            let _ = self.ring.get_ref().submit();
            let linger = libc::linger { l_onoff: 1, l_linger: 0 };
            // SAFETY: the descriptor is the connection's socket, open while its writer lives (the
            // caller, `FrameWriter`'s drop, runs before the writer's fields are dropped); the
            // option's value is a `linger`, of the length given.
            unsafe {
                libc::setsockopt(
                    self.fd,
                    libc::SOL_SOCKET,
                    libc::SO_LINGER,
                    (&raw const linger).cast(),
                    std::mem::size_of::<libc::linger>() as libc::socklen_t,
                );
            }
        }
        // Should the thread not start, the payloads are dropped with `self`, which abandons them.
        let _ = std::thread::Builder::new().name("zero-copy-retire".into()).spawn(move || self.drain(RETIRE_WAIT));
    }

    /// Takes completions (on this thread, blocking) until no payload is in the kernel's hands, or
    /// `wait` has passed.
    fn drain(mut self, wait: Duration) {
        let deadline = std::time::Instant::now() + wait;
        let tick = types::Timespec::new().sec(1);
        loop {
            self.reap();
            if (self.sending.is_empty() && self.held.is_empty()) || std::time::Instant::now() >= deadline {
                return;
            }
            let args = types::SubmitArgs::new().timespec(&tick);
            match self.ring.get_ref().submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(error) if matches!(error.raw_os_error(), Some(libc::ETIME | libc::EINTR | libc::EBUSY)) => {}
                // A kernel without timed waits (before 5.11): poll instead.
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }
}

impl Drop for ZeroCopy {
    /// Payloads still in the kernel's hands (a ring dropped before [`ZeroCopy::drain`] saw them
    /// released) are left to it, never freed: their memory could otherwise be reused while the
    /// kernel still sends from it.
    fn drop(&mut self) {
        self.stats.held.fetch_sub(self.held.len() as u64, Ordering::Relaxed);
        let abandoned = self.sending.len() + self.held.len();
        if abandoned > 0 {
            tracing::warn!(
                payloads = abandoned,
                "the kernel still held zero-copy payloads of a closed connection; leaving their memory to it"
            );
            self.stats.abandoned.fetch_add(abandoned as u64, Ordering::Relaxed);
            for (_, bytes) in self.sending.drain().chain(self.held.drain()) {
                std::mem::forget(bytes);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
    use super::*;
    use std::sync::Weak;
    use tokio::io::AsyncReadExt;
    use tokio::net::{TcpListener, TcpStream};

    /// Bytes, and a handle that shows whether they were released (their last reference dropped).
    fn tracked(len: usize) -> (Bytes, Weak<[u8]>) {
        let memory: Arc<[u8]> = Arc::from(vec![7u8; len]);
        let handle = Arc::downgrade(&memory);
        (Bytes::from_owner(memory), handle)
    }

    async fn released(memory: &Weak<[u8]>) -> bool {
        for _ in 0..1000 {
            if memory.strong_count() == 0 {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    /// A loopback connection: a zero-copy frame writer on one end, the other end's stream.
    async fn connection(
        stats: &Arc<ZeroCopyStats>,
    ) -> (FrameWriter<OwnedWriteHalf>, tokio::net::tcp::OwnedReadHalf, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (near, far) = tokio::join!(TcpStream::connect(listener.local_addr().unwrap()), listener.accept());
        let (reader, writer) = near.unwrap().into_split();
        let frames = FrameWriter::tcp(writer, ZeroCopySend::Always, Arc::clone(stats));
        assert!(frames.zero_copy.is_some(), "no io_uring ring for zero-copy sends here");
        (frames, reader, far.unwrap().0)
    }

    /// A send abandoned midway (its future dropped while the kernel still reads the payload, as
    /// when a connection's task is cancelled) keeps the payload until the kernel lets go of it,
    /// and then releases it: neither freed under the kernel nor leaked. So does a send that
    /// completed but whose notification had not come when the writer was dropped.
    #[tokio::test]
    async fn payloads_of_a_dropped_writer_are_released_once_the_kernel_is_done() {
        let stats = Arc::new(ZeroCopyStats::default());
        let (mut frames, reader, far) = connection(&stats).await;
        // Far larger than loopback's socket buffers, and the peer reads nothing: the send blocks.
        let (payload, freed) = tracked(64 << 20);
        let write = frames.write_frame(Opcode::Put, 1, &[], std::slice::from_ref(&payload));
        assert!(tokio::time::timeout(Duration::from_millis(300), write).await.is_err(), "a 64 MiB send completed");
        drop(payload);
        assert_eq!(frames.zero_copy.as_ref().map(|z| z.sending.len()), Some(1), "not sent zero-copy");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(freed.strong_count() > 0, "released while the kernel may read it");
        drop(frames);
        drop(reader);
        assert!(released(&freed).await, "an abandoned send's payload was never released");
        drop(far);
        assert_eq!(stats.counts().abandoned, 0);

        // Completed, its notification not yet taken: the peer reads it after the writer is gone.
        let (mut frames, reader, mut far) = connection(&stats).await;
        let (payload, freed) = tracked(256 << 10);
        frames.write_frame(Opcode::Put, 2, &[], std::slice::from_ref(&payload)).await.unwrap();
        drop(payload);
        assert_eq!(stats.counts().sends, 1, "not sent zero-copy");
        drop(frames);
        drop(reader);
        let mut received = Vec::new();
        far.read_to_end(&mut received).await.unwrap();
        assert_eq!(received.len(), frame::FIXED_HEADER_BYTES + (256 << 10), "the frame was cut short");
        assert!(released(&freed).await, "a completed send's payload was never released");
        assert_eq!(stats.counts().held, 0);
        assert_eq!(stats.counts().abandoned, 0);
    }
}
