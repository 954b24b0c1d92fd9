//! Data-plane transports: how chunk bytes reach a target.
//!
//! [`ChunkTransport`] is the seam: the SDK's save and restore logic only calls it, so the
//! shared-memory ([`ShmTransport`]) and RDMA ([`RdmaTransport`]) transports slot in beside
//! [`TcpTransport`] without touching that logic; [`AutoTransport`] picks one per target.
//!
//! [`TcpTransport`] keeps a few persistent connections per target. Each connection multiplexes
//! many requests: a writer task sends frames in order, a reader task matches responses to
//! requests by id, so a slow GET never blocks a PUT behind it; a GET's raw chunk bound for the
//! caller's memory is read from the socket straight into it ([`LentReader`]). Requests in flight per connection
//! are bounded; the bytes in flight are bounded by the caller (the staging pool for saves, the
//! restore concurrency for reads). A broken connection fails its pending requests at once and is
//! replaced on the next request; every operation is idempotent (chunks are content-addressed), so
//! one retry on a fresh connection is always safe.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::rdma::RemoteBuffer;
pub use crate::zerocopy::{FrameWriter, ZeroCopyCounts, ZeroCopySend, ZeroCopyStats};
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use prost::Message;
pub use starckpt_proto::capability::Credentials;
use starckpt_proto::codec::Codec;
use starckpt_proto::data::{self, ErrorCode};
use starckpt_proto::frame::{self, LIST_ENTRY_BYTES, MAX_BATCH_HASHES, Opcode, ReadFrameError};
use starckpt_proto::{Addressing, ChunkHash, ChunkName};
use thiserror::Error;

mod deadline;
mod rdma;
mod shm;
mod slots;
pub use deadline::Deadline;
pub(crate) use deadline::request_bytes;
pub use rdma::{RdmaClient, RdmaConfig, RdmaTransport};
pub use shm::{AutoTransport, ShmConfig, ShmTransport};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc, oneshot};

#[derive(Debug, Error, Clone)]
pub enum TransportError {
    #[error("connect: {0}")]
    Connect(String),
    #[error("connection lost: {0}")]
    Connection(String),
    #[error("no response within {0:?}")]
    Timeout(Duration),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("{code:?}: {message}")]
    Remote { code: ErrorCode, message: String },
}

impl TransportError {
    /// Worth retrying on a fresh connection (or another replica). A peer that turned out to be
    /// another target counts too: the target we want has moved.
    pub fn is_connection(&self) -> bool {
        matches!(
            self,
            TransportError::Connect(_)
                | TransportError::Connection(_)
                | TransportError::Timeout(_)
                | TransportError::Remote { code: ErrorCode::WrongTarget | ErrorCode::TransferFailed, .. }
        )
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TargetStat {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub chunk_count: u64,
    /// Bytes of deleted chunks' files the target keeps for reuse, and puts that reused one.
    pub free_pool_bytes: u64,
    pub reused_files: u64,
    /// Chunk files the target read from its device for GETs.
    pub chunk_reads: u64,
    /// GETs the target read from its device straight into a same-host client's slot.
    pub placed_reads: u64,
    /// PUTs the target wrote to its device straight from a same-host client's staging memory.
    pub placed_writes: u64,
    /// GET payloads the target sent zero-copy over TCP, and notifications of those that reported
    /// the kernel copied them after all.
    pub zero_copy_sends: u64,
    pub zero_copy_copied: u64,
    /// The target's scrubber since it started: passes finished, chunks verified, corrupt copies
    /// found and removed.
    pub scrub_passes: u64,
    pub scrub_verified_chunks: u64,
    pub scrub_corrupt_removed: u64,
    /// Where a client on the target's host can attach shared memory; None if it serves none.
    pub shm: Option<ShmEndpoint>,
    /// The target's RDMA device, if it serves RDMA.
    pub rdma_device: Option<String>,
}

/// A target's shared-memory endpoint, from its STAT response.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShmEndpoint {
    /// The target's host ([`crate::shm::host_id`]): shared memory only works on the same one.
    pub host_id: String,
    pub socket: std::path::PathBuf,
}

/// A page of a target's chunk list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChunkPage {
    /// Hashes with the time since each was last used, ascending by hash.
    pub chunks: Vec<(ChunkHash, Duration)>,
    /// No chunks follow this page.
    pub complete: bool,
}

/// A chunk's bytes as they travel and lie on a target: encoded by `codec`, `length` bytes once
/// decoded. The chunk's hash is always of the decoded bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Payload {
    pub bytes: Bytes,
    pub codec: Codec,
    pub length: u64,
}

impl Payload {
    /// Bytes as they are (no codec).
    pub fn raw(bytes: Bytes) -> Payload {
        Payload { length: bytes.len() as u64, bytes, codec: Codec::None }
    }

    /// The chunk's bytes, decoded if compressed and checked against the chunk's address `hash`
    /// under `addressing` and its `length`, with the name to store them under elsewhere; `Err`
    /// says what was wrong. CPU-bound: call off the runtime.
    pub fn verified(self, addressing: &Addressing, hash: ChunkHash, length: u64) -> Result<(Bytes, ChunkName), String> {
        let data = match self.codec {
            Codec::None => self.bytes,
            codec => starckpt_proto::codec::decompress(codec, &self.bytes, self.length as usize)
                .map(Bytes::from)
                .map_err(|e| format!("a {codec} copy does not decode: {e}"))?,
        };
        let name = addressing.name(ChunkHash::of(&data));
        if name.address != hash {
            return Err(format!("got {}", name.address));
        }
        if data.len() as u64 != length {
            return Err(format!("{} bytes, expected {length}", data.len()));
        }
        Ok((data, name))
    }
}

/// One target's chunk operations, whatever carries them.
#[async_trait]
pub trait ChunkTransport: Send + Sync + 'static {
    /// Stores a chunk named by its plain BLAKE3; true if the target already had it (under
    /// whatever codec).
    async fn put(&self, hash: ChunkHash, payload: Payload) -> Result<bool, TransportError> {
        self.put_named(&ChunkName::plain(hash), payload, false).await
    }
    /// Read repair: stores a chunk unless the target holds a copy that verifies (a copy that
    /// fails is replaced); true if the stored copy was good.
    async fn repair(&self, hash: ChunkHash, payload: Payload) -> Result<bool, TransportError> {
        self.put_named(&ChunkName::plain(hash), payload, true).await
    }
    /// [`ChunkTransport::put`] (or with `repair`, [`ChunkTransport::repair`]) of a chunk by its
    /// full name: a tenant's chunk carries its key and content hash (`starckpt_proto::address`).
    async fn put_named(&self, name: &ChunkName, payload: Payload, repair: bool) -> Result<bool, TransportError>;
    /// Reads `length` bytes at `offset` of a chunk (`length` 0: to the end). A whole chunk comes
    /// as stored (maybe compressed); a range comes decoded.
    async fn get(&self, hash: ChunkHash, offset: u64, length: u64) -> Result<Payload, TransportError>;
    /// Reads a whole chunk into `dest` when it comes raw and exactly `dest.len()` bytes long
    /// (shared memory and RDMA copy it there straight out of their slot, TCP reads it there
    /// straight from the socket, with no buffer between, hashing it as it lands:
    /// [`Fetched::Placed`]); otherwise returns it (compressed, or another length) for the caller
    /// to decode and verify.
    async fn get_into(&self, hash: ChunkHash, dest: &mut [u8]) -> Result<Fetched, TransportError> {
        let _ = dest;
        self.get(hash, 0, 0).await.map(Fetched::Payload)
    }
    /// Which of `hashes` are stored, for a writer deduplicating against them: the target makes
    /// a present one durable and refreshes its last use, so GC keeps it until the writer commits.
    async fn has(&self, hashes: &[ChunkHash]) -> Result<Vec<bool>, TransportError>;
    /// Which of `hashes` are stored, and nothing more: an audit's question (re-replication
    /// checking copies a committed checkpoint names, which GC keeps anyway), answered without the
    /// fsyncs and last-use updates of [`ChunkTransport::has`].
    async fn stored(&self, hashes: &[ChunkHash]) -> Result<Vec<bool>, TransportError>;
    /// Deletes chunks; with `unused_for`, only those not used (written, re-put, reported present)
    /// within that long (garbage collection's guard). Returns how many were removed.
    async fn delete(&self, hashes: &[ChunkHash], unused_for: Option<Duration>) -> Result<u64, TransportError>;
    /// One page of the stored chunks in hash order, after `after`, at most `limit` entries.
    async fn list(&self, after: Option<ChunkHash>, limit: u32) -> Result<ChunkPage, TransportError>;
    async fn stat(&self) -> Result<TargetStat, TransportError>;
    /// Short name for status output ("tcp", "shm", "rdma").
    fn kind(&self) -> &'static str;
    /// Waits (briefly) until a transport that chooses how to reach its target has chosen, so
    /// [`ChunkTransport::kind`] is final. Most transports have nothing to choose.
    async fn settle(&self) {}
}

/// Bounds and timeouts of the TCP transport.
#[derive(Clone, Debug)]
pub struct TcpConfig {
    /// Persistent connections per target. Default 2: one stream saturates loopback on these
    /// machines (../shared/MACHINE.md), a second hides a connection's head-of-line stalls.
    pub connections_per_target: usize,
    /// Requests in flight per connection. Default 32 (matches the target's limit of 64 with room).
    pub max_requests_per_connection: usize,
    /// Time to establish a connection. Default 5 s.
    pub connect_timeout: Duration,
    /// How long each request may take, by its size ([`Deadline`]). A request past it is abandoned
    /// (the memory it lent the target stays held until the connection ends); a connection that
    /// answered nothing meanwhile is given up with every request on it, so the caller moves
    /// their copies to other targets at once.
    pub deadline: Deadline,
    /// PUT payloads sent zero-copy (io_uring SEND_ZC). Default auto: until the kernel reports it
    /// copied them anyway, as it does over loopback (`crate::zerocopy`).
    pub zero_copy_send: ZeroCopySend,
    /// The capability every request carries (`starckpt_proto::capability`): the client's comes
    /// from the control plane; none where the cluster has no key.
    pub credentials: Credentials,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            connections_per_target: 2,
            max_requests_per_connection: 32,
            connect_timeout: Duration::from_secs(5),
            deadline: Deadline::default(),
            zero_copy_send: ZeroCopySend::Auto,
            credentials: Credentials::default(),
        }
    }
}

type Reply = oneshot::Sender<Result<Answer, TransportError>>;

/// A connection's reading half. Boxed so that it can be lent to a caller ([`LentReader`]).
type Reader = Box<dyn AsyncRead + Unpin + Send>;

/// How a response reaches its request.
enum Answer {
    /// With its payload, read by the connection's reader task.
    Whole(data::Response, Bytes),
    /// With its payload still on the stream, of exactly the length the request asked to land
    /// itself: the caller reads it into its own buffer ([`LentReader::read_hashed`]).
    Lent(data::Response, LentReader),
}

/// The reading half of a connection, lent by its reader task to the request whose raw payload is
/// next on the stream, so the payload goes from the socket straight into the caller's buffer (no
/// intermediate buffer, no copy in user space). Dropping it gives the stream back to the reader
/// task: with the payload read, or not begun (the task skips it), or abandoned mid-read (a
/// timeout: the stream is lost mid-frame and the task closes the connection).
struct LentReader {
    lent: Option<(Reader, oneshot::Sender<Returned>)>,
    /// Payload bytes not yet read.
    left: usize,
    /// A read began and did not finish.
    broken: bool,
}

/// A lent reader coming back to its connection's reader task.
struct Returned {
    reader: Reader,
    left: usize,
    broken: bool,
}

impl LentReader {
    /// Reads the payload into `dest` (exactly its length), hashing it as it arrives.
    async fn read_hashed(mut self, dest: &mut [u8]) -> Result<ChunkHash, TransportError> {
        let Some((reader, _)) = self.lent.as_mut() else {
            return Err(TransportError::Connection("the connection's stream is gone".into()));
        };
        if dest.len() != self.left {
            return Err(TransportError::Protocol(format!(
                "{} payload bytes for {} bytes of buffer",
                self.left,
                dest.len()
            )));
        }
        self.broken = true;
        let hash = crate::buf::read_hashed(reader, dest)
            .await
            .map_err(|e| TransportError::Connection(format!("reading a payload: {e}")))?;
        (self.broken, self.left) = (false, 0);
        Ok(hash)
    }
}

impl Drop for LentReader {
    fn drop(&mut self) {
        if let Some((reader, back)) = self.lent.take() {
            let _ = back.send(Returned { reader, left: self.left, broken: self.broken });
        }
    }
}

struct OutFrame {
    opcode: Opcode,
    request_id: u64,
    header: Vec<u8>,
    payload: Option<Bytes>,
}

/// A request waiting for its response; `land`: the length of a raw payload it reads itself;
/// `hold`: memory the target reads while it serves the request ([`Connection::call_holding`]).
struct Waiting {
    reply: Reply,
    land: Option<usize>,
    hold: Option<Bytes>,
}

/// Requests of one connection waiting for their responses (`None` once the connection is dead),
/// and memory lent to the target by requests failed unanswered, kept until the target closes the
/// connection ([`Connection::call_holding`]), or a while longer than a request may take for a
/// target that never does. `dead` turns true with `map` gone.
struct PendingState {
    map: Option<HashMap<u64, Waiting>>,
    orphans: Vec<Bytes>,
    dead: tokio::sync::watch::Sender<bool>,
}

type Pending = Arc<Mutex<PendingState>>;

fn lock(pending: &Pending) -> std::sync::MutexGuard<'_, PendingState> {
    pending.lock().unwrap_or_else(|p| p.into_inner())
}

/// Fails every request still waiting on the connection with [`TransportError::Connection`]: none
/// of them was answered, whatever ended the connection (a frame the reader could not follow
/// answers none of the others), so the memory they lent the target (shared-memory and RDMA
/// slots) is still the target's to use until the connection is gone.
fn fail_all(pending: &Pending, why: String) {
    fail_all_with(pending, TransportError::Connection(why));
}

/// [`fail_all`] with `error`: [`TransportError::Timeout`] when the target went silent, so that
/// no request tries it again on a fresh connection (a stopped host accepts connections, and
/// answers none of them).
fn fail_all_with(pending: &Pending, error: TransportError) {
    let replies: Vec<Reply> = {
        let mut state = lock(pending);
        let drained = state.map.take().into_iter().flatten().map(|(_, waiting)| waiting);
        let (replies, holds): (Vec<_>, Vec<_>) = drained.map(|waiting| (waiting.reply, waiting.hold)).unzip();
        state.orphans.extend(holds.into_iter().flatten());
        state.dead.send_replace(true);
        replies
    };
    for reply in replies {
        let _ = reply.send(Err(error.clone()));
    }
}

struct Connection {
    frames: mpsc::Sender<OutFrame>,
    pending: Pending,
    /// Told when the connection is given up: its writer stops, ending the stream towards the
    /// target, which then closes it once the requests it is serving are over.
    closed: Arc<tokio::sync::Notify>,
    /// Frames received from the target, counted by the reader task: a request that times out
    /// with none received since it was sent finds the connection dead, not merely slow.
    heard: Arc<AtomicU64>,
    next_id: AtomicU64,
    slots: Arc<Semaphore>,
    /// Payload bytes (either way) of the requests sent and not yet answered: a request's deadline
    /// grows by the time those ahead of it take at the floor throughput.
    queued: Arc<AtomicU64>,
    deadline: Deadline,
}

impl Connection {
    async fn open(
        address: SocketAddr,
        config: &TcpConfig,
        zero_copy: Option<&Arc<ZeroCopyStats>>,
    ) -> Result<Connection, TransportError> {
        let stream = tokio::time::timeout(config.connect_timeout, TcpStream::connect(address))
            .await
            .map_err(|_| TransportError::Connect(format!("timed out after {:?}", config.connect_timeout)))?
            .map_err(|e| TransportError::Connect(e.to_string()))?;
        let _ = stream.set_nodelay(true);
        let (reader, writer) = stream.into_split();
        match zero_copy {
            Some(stats) => {
                let frames = FrameWriter::tcp(writer, config.zero_copy_send, Arc::clone(stats));
                Ok(Connection::start(reader, frames, config))
            }
            None => Ok(Connection::start(reader, FrameWriter::new(writer), config)),
        }
    }

    /// A connection over any byte stream: a writer task sends frames, a reader task matches
    /// responses to requests. `config`: its requests in flight, and how long a request may hold
    /// the stream lent to it ([`LentReader`]).
    pub(crate) fn start<R, W>(reader: R, writer: FrameWriter<W>, config: &TcpConfig) -> Connection
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (dead, given_up) = tokio::sync::watch::channel(false);
        let pending: Pending =
            Arc::new(Mutex::new(PendingState { map: Some(HashMap::new()), orphans: Vec::new(), dead }));
        let max_requests = config.max_requests_per_connection.max(1);
        let (frames, outgoing) = mpsc::channel(max_requests);
        let closed = Arc::new(tokio::sync::Notify::new());
        // A target that stops reading must not pin the payloads queued to it: a frame whose bytes
        // have not gone out within a request's time fails the connection, and its queue goes.
        let writer = writer.with_timeout(config.deadline.frame());
        tokio::spawn(write_loop(writer, outgoing, Arc::clone(&pending), Arc::clone(&closed)));
        let heard = Arc::new(AtomicU64::new(0));
        let reading =
            Reading { pending: Arc::clone(&pending), closed: Arc::clone(&closed), heard: Arc::clone(&heard), given_up };
        tokio::spawn(read_loop(Box::new(reader), reading, config.deadline.frame()));
        let slots = Arc::new(Semaphore::new(max_requests));
        let queued = Arc::new(AtomicU64::new(0));
        let deadline = config.deadline;
        Connection { frames, pending, closed, heard, next_id: AtomicU64::new(1), slots, queued, deadline }
    }

    fn is_alive(&self) -> bool {
        lock(&self.pending).map.is_some()
    }

    /// Fails every pending request, marks the connection dead (it is replaced on next use) and
    /// stops its writer (the target sees the stream end).
    pub(crate) fn close(&self, why: &str) {
        fail_all(&self.pending, why.to_owned());
        self.closed.notify_one();
    }

    async fn call(
        &self,
        opcode: Opcode,
        header: Vec<u8>,
        payload: Option<Bytes>,
        timeout: Duration,
    ) -> Result<(data::Response, Bytes), TransportError> {
        match self.exchange(opcode, header, payload, None, timeout, None).await? {
            Answer::Whole(response, payload) => Ok((response, payload)),
            Answer::Lent(..) => Err(TransportError::Protocol("a payload lent to a request that reads none".into())),
        }
    }

    /// [`Connection::call`] for a request whose target reads `memory` while serving it (a staged
    /// chunk in shared memory, named by offset). The memory is held until the target answers, or
    /// closes the connection (which it does only once every request it was serving is over),
    /// even if the caller gives up first (a timeout, a cancelled save): it is not reused while the
    /// target may still read it. A target that never closes a connection given up (hung) holds
    /// it a request's time after the connection's end at most (`given_up_for`).
    pub(crate) async fn call_holding(
        &self,
        opcode: Opcode,
        header: Vec<u8>,
        memory: Bytes,
        timeout: Duration,
    ) -> Result<(data::Response, Bytes), TransportError> {
        match self.exchange(opcode, header, None, None, timeout, Some(memory)).await? {
            Answer::Whole(response, payload) => Ok((response, payload)),
            Answer::Lent(..) => Err(TransportError::Protocol("a payload lent to a request that reads none".into())),
        }
    }

    /// Sends a request and waits for its response. `land`: a raw (not encoded) response payload
    /// of exactly this length is left on the stream for the caller ([`Answer::Lent`]). `hold`:
    /// [`Connection::call_holding`]. `timeout`: the request's own deadline
    /// ([`Deadline::for_bytes`]), to which the time the requests queued ahead of it take at the
    /// floor throughput is added.
    async fn exchange(
        &self,
        opcode: Opcode,
        header: Vec<u8>,
        payload: Option<Bytes>,
        land: Option<usize>,
        timeout: Duration,
        hold: Option<Bytes>,
    ) -> Result<Answer, TransportError> {
        let _slot = self.slots.acquire().await.map_err(|_| TransportError::Connection("closed".into()))?;
        let bytes = payload.as_ref().or(hold.as_ref()).map_or(0, |p| p.len() as u64) + land.map_or(0, |l| l as u64);
        let request_id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, answer) = oneshot::channel();
        {
            let mut pending = lock(&self.pending);
            match pending.map.as_mut() {
                Some(map) => map.insert(request_id, Waiting { reply, land, hold }),
                None => return Err(TransportError::Connection("connection is closed".into())),
            };
        }
        // Removes the pending entry however this call ends, including when its future is dropped
        // (a cancelled upload), so long-lived connections do not accumulate dead entries.
        let mut forget = ForgetOnDrop { pending: &self.pending, request_id, sent: false };
        let ahead = self.queued.fetch_add(bytes, Ordering::Relaxed);
        let _queued = Unqueue { queued: &self.queued, bytes };
        let timeout = timeout + self.deadline.moving(ahead);
        let heard = self.heard.load(Ordering::Relaxed);
        let sent = self.frames.send(OutFrame { opcode, request_id, header, payload }).await;
        forget.sent = sent.is_ok();
        if sent.is_err() {
            return Err(TransportError::Connection("writer stopped".into()));
        }
        match tokio::time::timeout(timeout, answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(TransportError::Connection("connection closed before the response".into())),
            Err(_) => {
                // Nothing at all came back while this request waited: a hung target (stopped,
                // its I/O stuck) or one that stopped midway through a frame, whose connection
                // would otherwise keep taking requests only to time them out one by one. Given
                // up, it is replaced on next use; a target that is merely slow answered others.
                if self.heard.load(Ordering::Relaxed) == heard {
                    tracing::debug!(
                        ?timeout,
                        "the target sent nothing within a request's deadline; giving its connection up"
                    );
                    fail_all_with(&self.pending, TransportError::Timeout(timeout));
                    self.closed.notify_one();
                }
                Err(TransportError::Timeout(timeout))
            }
        }
    }
}

/// Takes a request's bytes off its connection's queue however the request ends.
struct Unqueue<'a> {
    queued: &'a AtomicU64,
    bytes: u64,
}

impl Drop for Unqueue<'_> {
    fn drop(&mut self) {
        self.queued.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

struct ForgetOnDrop<'a> {
    pending: &'a Pending,
    request_id: u64,
    /// The request reached the writer's queue (so the target will see it, or the stream end).
    sent: bool,
}

impl Drop for ForgetOnDrop<'_> {
    fn drop(&mut self) {
        // Unless it was sent holding memory the target may still read: then it stays until the
        // target answers (and the answer is dropped) or the connection ends.
        if let Some(map) = lock(self.pending).map.as_mut()
            && map.get(&self.request_id).is_some_and(|waiting| waiting.hold.is_none() || !self.sent)
        {
            map.remove(&self.request_id);
        }
    }
}

/// Sends queued frames in order. Payloads sent zero-copy stay held (their staging buffers out of
/// the pool) until the kernel's notification, taken here between frames.
async fn write_loop<W: AsyncWrite + Unpin>(
    mut writer: FrameWriter<W>,
    mut outgoing: mpsc::Receiver<OutFrame>,
    pending: Pending,
    closed: Arc<tokio::sync::Notify>,
) {
    loop {
        let next = tokio::select! {
            // Given up: dropping the writer ends the stream towards the target.
            () = closed.notified() => return,
            next = writer.next(&mut outgoing) => next,
        };
        let message = match next {
            Ok(Some(message)) => message,
            Ok(None) => {
                // The connection was dropped: given up like a closed one, so memory lent to a
                // target that never hangs up is let go in time (`given_up_for`).
                fail_all(&pending, "the connection was dropped".into());
                return;
            }
            Err(error) => {
                fail_all(&pending, format!("zero-copy notifications: {error}"));
                return;
            }
        };
        let payload: Vec<Bytes> = message.payload.into_iter().collect();
        let mut result = writer.write_frame(message.opcode, message.request_id, &message.header, &payload).await;
        if result.is_ok() && outgoing.is_empty() {
            result = writer.flush().await;
        }
        if let Err(error) = result {
            fail_all(&pending, format!("write: {error}"));
            return;
        }
    }
}

/// What a connection's reader task shares with the connection.
struct Reading {
    pending: Pending,
    closed: Arc<tokio::sync::Notify>,
    heard: Arc<AtomicU64>,
    /// Turns true when the connection is given up ([`PendingState::dead`]).
    given_up: tokio::sync::watch::Receiver<bool>,
}

/// Returns `hold` after the connection is given up: how long its reader waits for the target to
/// close it (the target does once the requests it is serving are over) before letting go of the
/// memory lent to it anyway. A target that has not closed by then is hung (stopped, its device
/// stuck); the staging buffers it held go back to the pool instead of shrinking it for good. Were
/// it to wake and read one refilled meanwhile, its hash check of what it read, or of its placed
/// write, refuses the changed bytes: what it stores is never wrong, only refused.
async fn given_up_for(mut given_up: tokio::sync::watch::Receiver<bool>, hold: Duration) {
    if given_up.wait_for(|dead| *dead).await.is_ok() {
        tokio::time::sleep(hold).await;
    } else {
        std::future::pending::<()>().await;
    }
}

/// Reads responses and hands each to its request. `lend_timeout`: how long a request may hold the
/// stream lent to it; one that holds it longer (its future kept but no longer polled) would stall
/// every other response on the connection, so the connection is given up instead.
async fn read_loop(mut reader: Reader, reading: Reading, lend_timeout: Duration) {
    let Reading { pending, closed, heard, given_up } = reading;
    // Bounds the wait for a target that never closes a connection given up (`given_up_for`).
    let hung = given_up_for(given_up, lend_timeout);
    tokio::pin!(hung);
    let mut expired = false;
    // The frames, raced as a whole against `hung`: a target that stalls midway through a
    // payload is as hung as one that sends no frame.
    let (pending_of, heard_of) = (&pending, &heard);
    let frames = async move {
        'frames: loop {
            let (header, prost_header) = match frame::read_frame_head(&mut reader).await {
                Ok(head) => {
                    heard_of.fetch_add(1, Ordering::Relaxed);
                    head
                }
                Err(ReadFrameError::Closed) => {
                    break (TransportError::Connection("closed by the target".into()), Rest::Ended);
                }
                Err(ReadFrameError::Frame(e)) => break (TransportError::Protocol(e.to_string()), Rest::Open(reader)),
                Err(ReadFrameError::Io(e)) => break (TransportError::Connection(e.to_string()), Rest::Ended),
            };
            if !header.opcode.is_response() {
                let error = TransportError::Protocol(format!("target sent request opcode {:?}", header.opcode));
                break (error, Rest::Open(reader));
            }
            let decoded = data::Response::decode(prost_header);
            // A raw payload of the length its request lands itself goes straight into the request's
            // buffer: the stream is lent to it until it has read the payload.
            if let Ok(response) = &decoded
                && header.payload_len != 0
                && response.codec == Codec::None.to_wire()
            {
                let lands = |land| land == Some(header.payload_len as usize);
                if let Some(waiting) = take_waiting(pending_of, header.request_id, lands) {
                    let (back, mut returned) = oneshot::channel();
                    let lent =
                        LentReader { lent: Some((reader, back)), left: header.payload_len as usize, broken: false };
                    // Not received (the request gave up): the answer is dropped and the stream comes back.
                    let _ = waiting.reply.send(Ok(Answer::Lent(response.clone(), lent)));
                    let Ok(came_back) = tokio::time::timeout(lend_timeout, &mut returned).await else {
                        let error =
                            TransportError::Connection(format!("a request held the stream over {lend_timeout:?}"));
                        break (error, Rest::Lent(returned));
                    };
                    match came_back {
                        Ok(Returned { reader: back, left, broken: false }) => {
                            reader = back;
                            if let Err(error) = skip(&mut reader, left).await {
                                break (TransportError::Connection(error.to_string()), Rest::Ended);
                            }
                            continue;
                        }
                        Ok(Returned { reader: back, .. }) => {
                            let error =
                                TransportError::Connection("a request stopped reading its payload midway".into());
                            break (error, Rest::Open(back));
                        }
                        Err(_) => {
                            break (
                                TransportError::Connection("a lent stream was never given back".into()),
                                Rest::Ended,
                            );
                        }
                    }
                }
            }
            let mut payload = BytesMut::with_capacity(header.payload_len as usize);
            while payload.len() < header.payload_len as usize {
                let want = header.payload_len as usize - payload.len();
                match (&mut reader).take(want as u64).read_buf(&mut payload).await {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) => break 'frames (TransportError::Connection(e.to_string()), Rest::Ended),
                }
            }
            if payload.len() != header.payload_len as usize {
                break (TransportError::Connection("closed in the middle of a payload".into()), Rest::Ended);
            }
            let outcome = decoded
                .map(|response| Answer::Whole(response, payload.freeze()))
                .map_err(|e| TransportError::Protocol(format!("undecodable response header: {e}")));
            // A response to a request that timed out is dropped (and memory it held let go).
            if let Some(waiting) = take_waiting(pending_of, header.request_id, |_| true) {
                let _ = waiting.reply.send(outcome);
            }
        }
    };
    let (error, rest) = tokio::select! {
        out = frames => out,
        () = &mut hung => {
            expired = true;
            let why = format!("the target did not close the connection within {lend_timeout:?} of its end");
            (TransportError::Connection(why), Rest::Ended)
        }
    };
    fail_all(
        &pending,
        match error {
            TransportError::Connection(why) => why,
            other => other.to_string(),
        },
    );
    // The writer stops too, ending the stream towards the target, which closes the connection
    // once the requests it is serving are over: read to that end (when the stream can still be
    // had) before letting go of memory lent to the target by requests that gave up.
    closed.notify_one();
    let to_the_end = async {
        let reader = match rest {
            Rest::Ended => None,
            Rest::Open(reader) => Some(reader),
            Rest::Lent(returned) => returned.await.ok().map(|returned| returned.reader),
        };
        if let Some(mut reader) = reader {
            let _ = tokio::io::copy(&mut reader, &mut tokio::io::sink()).await;
        }
    };
    tokio::select! {
        () = to_the_end => {}
        () = &mut hung, if !expired => expired = true,
    }
    if expired && !lock(&pending).orphans.is_empty() {
        tracing::warn!(
            "a target kept a connection given up open for {lend_timeout:?} after its end: the staging memory \
             lent to it is reused"
        );
    }
    let orphans = std::mem::take(&mut lock(&pending).orphans);
    drop(orphans);
}

/// What is left of a connection's stream when its reader task stops.
enum Rest {
    /// The target closed it, or it failed: nothing more comes.
    Ended,
    /// Open, but not followed any more (a frame the task cannot make sense of).
    Open(Reader),
    /// Lent to a request that has not given it back yet.
    Lent(oneshot::Receiver<Returned>),
}

/// One GET of a whole chunk on `connection` (its `header` asks for the bytes in the frame): a raw
/// chunk of `dest`'s size is read from the stream straight into `dest`, hashed as it lands.
async fn get_landing(
    connection: &Connection,
    header: Vec<u8>,
    dest: &mut [u8],
    timeout: Duration,
) -> Result<Fetched, TransportError> {
    // One deadline for the response and the payload read after it.
    let fetch = async {
        match connection.exchange(Opcode::Get, header, None, Some(dest.len()), timeout, None).await? {
            Answer::Whole(response, bytes) => {
                let (response, bytes) = checked(response, bytes)?;
                get_payload(&response, bytes).map(Fetched::Payload)
            }
            Answer::Lent(response, lent) => {
                checked(response, Bytes::new())?;
                lent.read_hashed(dest).await.map(Fetched::Placed)
            }
        }
    };
    tokio::time::timeout(timeout, fetch).await.unwrap_or(Err(TransportError::Timeout(timeout)))
}

/// Removes request `id`'s entry if `wanted` accepts the length it lands itself.
fn take_waiting(pending: &Pending, id: u64, wanted: impl FnOnce(Option<usize>) -> bool) -> Option<Waiting> {
    let mut pending = lock(pending);
    let map = pending.map.as_mut()?;
    match wanted(map.get(&id)?.land) {
        true => map.remove(&id),
        false => None,
    }
}

/// Reads and drops `len` bytes of `reader` (a payload whose request went away).
async fn skip(reader: &mut Reader, len: usize) -> std::io::Result<()> {
    let copied = tokio::io::copy(&mut reader.take(len as u64), &mut tokio::io::sink()).await?;
    match copied == len as u64 {
        true => Ok(()),
        false => Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof)),
    }
}

/// The TCP data-plane transport to one target.
pub struct TcpTransport {
    address: SocketAddr,
    /// Sent with every request; a target with another id refuses it (WRONG_TARGET).
    target_id: Option<String>,
    config: TcpConfig,
    connections: Vec<tokio::sync::Mutex<Option<Arc<Connection>>>>,
    next: AtomicUsize,
    zero_copy: Arc<ZeroCopyStats>,
}

impl TcpTransport {
    pub fn new(address: SocketAddr, config: TcpConfig) -> TcpTransport {
        let connections = (0..config.connections_per_target.max(1)).map(|_| tokio::sync::Mutex::new(None)).collect();
        let zero_copy = Arc::new(ZeroCopyStats::default());
        TcpTransport { address, target_id: None, config, connections, next: AtomicUsize::new(0), zero_copy }
    }

    /// A transport to target `target_id` at `address`: requests are refused by any other target
    /// found at that address.
    pub fn for_target(address: SocketAddr, target_id: &str, config: TcpConfig) -> TcpTransport {
        TcpTransport { target_id: Some(target_id.to_owned()), ..TcpTransport::new(address, config) }
    }

    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// PUT payloads this transport sent zero-copy ([`TcpConfig::zero_copy_send`]).
    pub fn zero_copy_counts(&self) -> ZeroCopyCounts {
        self.zero_copy.counts()
    }

    async fn connection(&self) -> Result<Arc<Connection>, TransportError> {
        let index = self.next.fetch_add(1, Ordering::Relaxed) % self.connections.len();
        let mut slot = self.connections[index].lock().await;
        if let Some(connection) = slot.as_ref().filter(|c| c.is_alive()) {
            return Ok(Arc::clone(connection));
        }
        let connection = Arc::new(Connection::open(self.address, &self.config, Some(&self.zero_copy)).await?);
        *slot = Some(Arc::clone(&connection));
        Ok(connection)
    }
}

/// The `Auth` of a transport's requests: the target meant, and the sender's capability.
async fn auth_for(target_id: &Option<String>, config: &TcpConfig) -> Option<data::Auth> {
    let capability = config.credentials.fresh(target_id.as_deref()).await;
    (target_id.is_some() || !capability.is_empty())
        .then(|| data::Auth { capability, target_id: target_id.clone().unwrap_or_default() })
}

/// Runs `attempt`, and once more if it failed because its connection broke: a fresh connection is
/// made on the second try, and every request is idempotent (chunks are content-addressed).
async fn once_more<T, F, Fut>(mut attempt: F) -> Result<T, TransportError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, TransportError>>,
{
    match attempt().await {
        Err(TransportError::Connection(_)) => attempt().await,
        other => other,
    }
}

/// The response of a request, or its error code as an error.
fn checked(response: data::Response, payload: Bytes) -> Result<(data::Response, Bytes), TransportError> {
    let code = ErrorCode::try_from(response.code).unwrap_or(ErrorCode::Internal);
    if code != ErrorCode::Ok {
        return Err(TransportError::Remote { code, message: response.message });
    }
    Ok((response, payload))
}

/// A transport that carries data-plane frames over a byte stream (TCP, a Unix socket): it sends
/// one frame and returns the checked response (retrying once on a fresh connection), and moves
/// chunk payloads its own way. HAS, DELETE, LIST and STAT are the same frames on every such
/// transport; [`ChunkTransport`] comes with it.
#[async_trait]
pub trait FrameTransport: Send + Sync + 'static {
    /// Sent in every request: a target with another id refuses it, and one whose cluster has a
    /// key checks its capability.
    async fn auth(&self) -> Option<data::Auth>;
    async fn call(
        &self,
        opcode: Opcode,
        header: Vec<u8>,
        payload: Option<Bytes>,
    ) -> Result<(data::Response, Bytes), TransportError>;
    /// PUT (`repair`: read repair's PUT); true if the chunk was there already.
    async fn put_chunk(&self, name: &ChunkName, payload: Payload, repair: bool) -> Result<bool, TransportError>;
    async fn get_chunk(&self, hash: ChunkHash, offset: u64, length: u64) -> Result<Payload, TransportError>;
    /// [`ChunkTransport::get_into`]; by default the chunk comes as a payload.
    async fn get_chunk_into(&self, hash: ChunkHash, dest: &mut [u8]) -> Result<Fetched, TransportError> {
        let _ = dest;
        self.get_chunk(hash, 0, 0).await.map(Fetched::Payload)
    }
    fn name(&self) -> &'static str;
}

#[async_trait]
impl FrameTransport for TcpTransport {
    async fn auth(&self) -> Option<data::Auth> {
        auth_for(&self.target_id, &self.config).await
    }

    async fn call(
        &self,
        opcode: Opcode,
        header: Vec<u8>,
        payload: Option<Bytes>,
    ) -> Result<(data::Response, Bytes), TransportError> {
        once_more(|| async {
            let connection = self.connection().await?;
            let timeout = self.config.deadline.for_bytes(request_bytes(opcode, payload.as_ref()));
            let (response, payload) = connection.call(opcode, header.clone(), payload.clone(), timeout).await?;
            checked(response, payload)
        })
        .await
    }

    async fn put_chunk(&self, name: &ChunkName, payload: Payload, repair: bool) -> Result<bool, TransportError> {
        let header = put_header(self, name, &payload, repair, Place::Inline).await;
        Ok(self.call(Opcode::Put, header, Some(payload.bytes)).await?.0.already_present)
    }

    async fn get_chunk(&self, hash: ChunkHash, offset: u64, length: u64) -> Result<Payload, TransportError> {
        let (response, bytes) =
            self.call(Opcode::Get, get_header(self, hash, offset, length, Place::Inline).await, None).await?;
        get_payload(&response, bytes)
    }

    /// A raw chunk of `dest`'s size is read from the socket straight into `dest`, hashed as it
    /// arrives; anything else comes as a payload.
    async fn get_chunk_into(&self, hash: ChunkHash, dest: &mut [u8]) -> Result<Fetched, TransportError> {
        let timeout = self.config.deadline.for_bytes(dest.len() as u64);
        let mut retried = false;
        loop {
            let attempt = async {
                let connection = self.connection().await?;
                get_landing(&connection, get_header(self, hash, 0, 0, Place::Inline).await, dest, timeout).await
            };
            // Once more on a fresh connection if this one broke, as `once_more` does.
            match attempt.await {
                Err(TransportError::Connection(_)) if !retried => retried = true,
                other => return other,
            }
        }
    }

    fn name(&self) -> &'static str {
        "tcp"
    }
}

fn hash_list(hashes: &[ChunkHash]) -> Result<Vec<Bytes>, TransportError> {
    if hashes.len() > MAX_BATCH_HASHES {
        return Err(TransportError::Protocol(format!("batch of {} exceeds {MAX_BATCH_HASHES}", hashes.len())));
    }
    Ok(hashes.iter().map(|h| h.to_bytes()).collect())
}

/// Where a request's payload (PUT) or result (GET) travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// In the frame.
    Inline,
    /// In this 1-based shared-memory slot.
    Slot(u32),
    /// At this offset of the client's shared staging region (a PUT's payload only).
    Staging(u64),
    /// In client memory registered for RDMA.
    Rdma(RemoteBuffer),
}

/// A PUT request's header, its payload at `place`.
pub(crate) async fn put_header<F: FrameTransport + ?Sized>(
    frames: &F,
    name: &ChunkName,
    payload: &Payload,
    repair: bool,
    place: Place,
) -> Vec<u8> {
    let (shm_slot, shm_length) = match place {
        Place::Slot(slot) => (slot, payload.bytes.len() as u64),
        _ => (0, 0),
    };
    data::PutRequest {
        auth: frames.auth().await,
        hash: name.address.to_bytes(),
        chunk_key: name.addressing.to_wire(),
        content_hash: match name.addressing.is_keyed() {
            true => name.content.to_bytes(),
            false => Default::default(),
        },
        repair,
        codec: payload.codec.to_wire(),
        length_bytes: payload.length,
        shm_slot,
        shm_length,
        rdma: match place {
            Place::Rdma(remote) => Some(remote.to_wire()),
            _ => None,
        },
        staging: match place {
            Place::Staging(offset) => Some(data::StagingRange { offset, length: payload.bytes.len() as u64 }),
            _ => None,
        },
    }
    .encode_to_vec()
}

pub(crate) async fn get_header<F: FrameTransport + ?Sized>(
    frames: &F,
    hash: ChunkHash,
    offset: u64,
    length: u64,
    place: Place,
) -> Vec<u8> {
    data::GetRequest {
        auth: frames.auth().await,
        hash: hash.to_bytes(),
        offset,
        length,
        shm_slot: match place {
            Place::Slot(slot) => slot,
            _ => 0,
        },
        accept_encoded: true,
        rdma: match place {
            Place::Rdma(remote) => Some(remote.to_wire()),
            _ => None,
        },
    }
    .encode_to_vec()
}

/// What [`ChunkTransport::get_into`] fetched.
#[derive(Debug)]
pub enum Fetched {
    /// The chunk is in the caller's buffer, copied there out of a slot or read there from a
    /// socket; this is the BLAKE3 hash of the bytes as they landed (computed piece by piece as
    /// they landed, while in cache), for
    /// the caller to compare with the chunk's. A transport must hash exactly the bytes it left
    /// in the buffer: restore trusts this hash instead of hashing the buffer again.
    Placed(ChunkHash),
    /// The chunk as it came (compressed, or another length than the buffer), for the caller to
    /// decode and verify.
    Payload(Payload),
}

/// Where the `len` bytes a target put into a GET's slot go: into `dest` (copied and hashed by
/// `read_into`) when the chunk came raw and exactly `dest`'s size, otherwise into a fresh
/// payload (copied by `read_fresh`).
pub(crate) fn land_slot(
    response: &data::Response,
    len: usize,
    dest: Option<&mut [u8]>,
    read_into: impl FnOnce(&mut [u8]) -> Result<ChunkHash, TransportError>,
    read_fresh: impl FnOnce() -> Result<Bytes, TransportError>,
) -> Result<Fetched, TransportError> {
    match dest {
        Some(dest) if response.codec == Codec::None.to_wire() && dest.len() == len => {
            let copy_and_hash = || read_into(dest);
            // A large copy (~0.1 ms and more) hands the worker's other tasks over meanwhile.
            if len >= BLOCK_IN_PLACE_BYTES { crate::blocking::off_runtime(copy_and_hash) } else { copy_and_hash() }
                .map(Fetched::Placed)
        }
        _ => get_payload(response, read_fresh()?).map(Fetched::Payload),
    }
}

/// Copies at least this big are hashed off the runtime's books ([`land_slot`]).
const BLOCK_IN_PLACE_BYTES: usize = 256 << 10;

/// A GET that had no buffer to land in always comes as a payload.
pub(crate) fn fetched_payload(fetched: Fetched) -> Result<Payload, TransportError> {
    match fetched {
        Fetched::Payload(payload) => Ok(payload),
        Fetched::Placed(_) => Err(TransportError::Protocol("a GET without a buffer placed its bytes somewhere".into())),
    }
}

/// A GET response's bytes as a [`Payload`], its codec checked.
pub(crate) fn get_payload(response: &data::Response, bytes: Bytes) -> Result<Payload, TransportError> {
    let codec = Codec::from_wire(response.codec).map_err(|e| TransportError::Protocol(format!("GET: {e}")))?;
    if codec == Codec::None {
        return Ok(Payload::raw(bytes));
    }
    if response.chunk_length_bytes == 0 || response.chunk_length_bytes > u64::from(frame::MAX_PAYLOAD_BYTES) {
        return Err(TransportError::Protocol(format!("GET: a {codec} chunk of {} bytes", response.chunk_length_bytes)));
    }
    Ok(Payload { bytes, codec, length: response.chunk_length_bytes })
}

async fn has_frames<F: FrameTransport + ?Sized>(
    frames: &F,
    hashes: &[ChunkHash],
    existence_only: bool,
) -> Result<Vec<bool>, TransportError> {
    let header =
        data::HasRequest { auth: frames.auth().await, hashes: hash_list(hashes)?, existence_only }.encode_to_vec();
    let (response, _) = frames.call(Opcode::Has, header, None).await?;
    if response.present.len() != hashes.len() {
        return Err(TransportError::Protocol(format!(
            "HAS answered {} flags for {} hashes",
            response.present.len(),
            hashes.len()
        )));
    }
    Ok(response.present)
}

async fn delete_frames<F: FrameTransport + ?Sized>(
    frames: &F,
    hashes: &[ChunkHash],
    unused_for: Option<Duration>,
) -> Result<u64, TransportError> {
    // A zero guard would mean "unconditional" on the wire; the smallest real guard is 1 ms.
    let unused_for_ms = unused_for.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1));
    let header =
        data::DeleteRequest { auth: frames.auth().await, hashes: hash_list(hashes)?, unused_for_ms }.encode_to_vec();
    Ok(frames.call(Opcode::Delete, header, None).await?.0.deleted)
}

async fn list_frames<F: FrameTransport + ?Sized>(
    frames: &F,
    after: Option<ChunkHash>,
    limit: u32,
) -> Result<ChunkPage, TransportError> {
    let after = after.map_or_else(Bytes::new, |h| h.to_bytes());
    let header = data::ListRequest { auth: frames.auth().await, after, limit }.encode_to_vec();
    let (response, payload) = frames.call(Opcode::List, header, None).await?;
    if payload.len() % LIST_ENTRY_BYTES != 0 || payload.len() / LIST_ENTRY_BYTES > limit as usize {
        return Err(TransportError::Protocol(format!("LIST answered {} payload bytes", payload.len())));
    }
    let chunks = payload
        .chunks_exact(LIST_ENTRY_BYTES)
        .map(|entry| {
            let (mut hash, mut age) = ([0u8; 32], [0u8; 8]);
            hash.copy_from_slice(&entry[..32]);
            age.copy_from_slice(&entry[32..]);
            (ChunkHash(hash), Duration::from_millis(u64::from_le_bytes(age)))
        })
        .collect();
    Ok(ChunkPage { chunks, complete: response.list_complete })
}

async fn stat_frames<F: FrameTransport + ?Sized>(frames: &F) -> Result<TargetStat, TransportError> {
    let header = data::StatRequest { auth: frames.auth().await }.encode_to_vec();
    let (response, _) = frames.call(Opcode::Stat, header, None).await?;
    Ok(TargetStat {
        capacity_bytes: response.capacity_bytes,
        used_bytes: response.used_bytes,
        chunk_count: response.chunk_count,
        free_pool_bytes: response.free_pool_bytes,
        reused_files: response.reused_files,
        chunk_reads: response.chunk_reads,
        placed_reads: response.placed_reads,
        placed_writes: response.placed_writes,
        zero_copy_sends: response.zero_copy_sends,
        zero_copy_copied: response.zero_copy_copied,
        scrub_passes: response.scrub_passes,
        scrub_verified_chunks: response.scrub_verified_chunks,
        scrub_corrupt_removed: response.scrub_corrupt_removed,
        shm: (!response.shm_socket.is_empty())
            .then(|| ShmEndpoint { host_id: response.host_id, socket: response.shm_socket.into() }),
        rdma_device: response.rdma_endpoint.is_some().then_some(response.rdma_device),
    })
}

#[async_trait]
impl<T: FrameTransport> ChunkTransport for T {
    async fn put_named(&self, name: &ChunkName, payload: Payload, repair: bool) -> Result<bool, TransportError> {
        self.put_chunk(name, payload, repair).await
    }

    async fn get(&self, hash: ChunkHash, offset: u64, length: u64) -> Result<Payload, TransportError> {
        self.get_chunk(hash, offset, length).await
    }

    async fn get_into(&self, hash: ChunkHash, dest: &mut [u8]) -> Result<Fetched, TransportError> {
        self.get_chunk_into(hash, dest).await
    }

    async fn has(&self, hashes: &[ChunkHash]) -> Result<Vec<bool>, TransportError> {
        has_frames(self, hashes, false).await
    }

    async fn stored(&self, hashes: &[ChunkHash]) -> Result<Vec<bool>, TransportError> {
        has_frames(self, hashes, true).await
    }

    async fn delete(&self, hashes: &[ChunkHash], unused_for: Option<Duration>) -> Result<u64, TransportError> {
        delete_frames(self, hashes, unused_for).await
    }

    async fn list(&self, after: Option<ChunkHash>, limit: u32) -> Result<ChunkPage, TransportError> {
        list_frames(self, after, limit).await
    }

    async fn stat(&self) -> Result<TargetStat, TransportError> {
        stat_frames(self).await
    }

    fn kind(&self) -> &'static str {
        self.name()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
    use super::*;
    use tokio::io::{AsyncWriteExt, DuplexStream};

    /// A connection over an in-memory stream, and the far end, which plays the target by hand.
    fn connection() -> (Connection, DuplexStream) {
        let (near, far) = tokio::io::duplex(1 << 20);
        let (reader, writer) = tokio::io::split(near);
        let config = TcpConfig {
            max_requests_per_connection: 8,
            deadline: Deadline { allowance: Duration::from_secs(2), ..Deadline::default() },
            ..TcpConfig::default()
        };
        (Connection::start(reader, FrameWriter::new(writer), &config), far)
    }

    /// Reads one request off `far`; returns its id.
    async fn request(far: &mut DuplexStream) -> u64 {
        let (header, _) = frame::read_frame_head(far).await.unwrap();
        header.request_id
    }

    /// Answers request `id` with an OK response and `payload`.
    async fn respond(far: &mut DuplexStream, id: u64, payload: &[u8]) {
        let header = data::Response::default().encode_to_vec();
        frame::write_frame(far, Opcode::GetResponse, id, &header, &[Bytes::copy_from_slice(payload)]).await.unwrap();
    }

    async fn get(connection: &Connection, land: Option<usize>) -> Result<Answer, TransportError> {
        connection.exchange(Opcode::Get, vec![], None, land, Duration::from_secs(10), None).await
    }

    /// Bytes whose release (their last reference dropped) shows in a flag.
    struct Tracked(Arc<std::sync::atomic::AtomicBool>, Vec<u8>);

    impl AsRef<[u8]> for Tracked {
        fn as_ref(&self) -> &[u8] {
            &self.1
        }
    }

    impl Drop for Tracked {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn tracked() -> (Bytes, Arc<std::sync::atomic::AtomicBool>) {
        let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
        (Bytes::from_owner(Tracked(Arc::clone(&released), vec![7; 4096])), released)
    }

    async fn released(flag: &std::sync::atomic::AtomicBool) -> bool {
        for _ in 0..500 {
            if flag.load(Ordering::SeqCst) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    /// Memory a request lends the target (a staged chunk it reads in place) stays held after the
    /// request gives up (a timeout), until the target answers it; and, on a connection the client
    /// closed, until the target closes it: never reused while the target may still read it.
    #[tokio::test]
    async fn memory_lent_to_the_target_is_held_until_it_answers_or_hangs_up() {
        let (connection, mut far) = connection();
        // Long enough that the other request, sent 20 ms in, is answered first on a busy machine.
        let short = Duration::from_secs(2);
        let (memory, freed) = tracked();
        // The target answers another request meanwhile: slow, not dead, so the connection stays.
        let serve = async {
            let held = request(&mut far).await;
            let other = request(&mut far).await;
            respond(&mut far, other, b"").await;
            held
        };
        let other = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            connection.call(Opcode::Stat, vec![], None, Duration::from_secs(5)).await
        };
        let (asked, answered, id) =
            tokio::join!(connection.call_holding(Opcode::Put, vec![], memory, short), other, serve);
        assert!(matches!(asked, Err(TransportError::Timeout(_))), "{asked:?}");
        answered.unwrap();
        assert!(connection.is_alive(), "a connection that answers was given up");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!freed.load(Ordering::SeqCst), "let go before the target answered");
        respond(&mut far, id, b"").await;
        assert!(released(&freed).await, "held after the target answered");

        // Answered in time: let go with the answer.
        let (memory, freed) = tracked();
        let serve = async {
            let id = request(&mut far).await;
            respond(&mut far, id, b"").await;
        };
        let (asked, ()) =
            tokio::join!(connection.call_holding(Opcode::Put, vec![], memory, Duration::from_secs(5)), serve);
        asked.unwrap();
        assert!(released(&freed).await);

        // The client gives the connection up: held until the target hangs up.
        let (memory, freed) = tracked();
        let (asked, _) = tokio::join!(connection.call_holding(Opcode::Put, vec![], memory, short), request(&mut far));
        assert!(asked.is_err());
        connection.close("given up");
        assert!(!connection.is_alive());
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!freed.load(Ordering::SeqCst), "let go while the target may still read it");
        drop(far);
        assert!(released(&freed).await, "held after the target hung up");

        // The target sends what the reader cannot follow: the requests fail at once, as ones
        // that lost their connection (none was answered, so a slot they lent is still the
        // target's), but their memory stays held while the stream is read to its end.
        let (connection, mut far) = self::connection();
        let (memory, freed) = tracked();
        let serve = async {
            let id = request(&mut far).await;
            request(&mut far).await;
            frame::write_frame(&mut far, Opcode::Put, id, &[], &[]).await.unwrap();
        };
        let other = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            connection.call(Opcode::Stat, vec![], None, Duration::from_secs(5)).await
        };
        let (asked, other, ()) =
            tokio::join!(connection.call_holding(Opcode::Put, vec![], memory, Duration::from_secs(5)), other, serve);
        for asked in [asked.map(drop), other.map(drop)] {
            let unanswered = matches!(&asked, Err(TransportError::Connection(why)) if why.contains("request opcode"));
            assert!(unanswered, "{asked:?}");
        }
        assert!(!connection.is_alive());
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!freed.load(Ordering::SeqCst), "let go while the target may still read it");
        drop(far);
        assert!(released(&freed).await, "held after the target hung up");
    }

    /// A target that never closes a connection the client gave up (stopped, its device hung) does
    /// not keep the memory lent to it for ever: it comes back a request's time after the
    /// connection's end (the target's hash checks refuse bytes changed under it, should it wake).
    #[tokio::test]
    async fn memory_lent_to_a_hung_target_comes_back_a_while_after_the_connection_ends() {
        let (connection, mut far) = connection();
        let (memory, freed) = tracked();
        let short = Duration::from_millis(200);
        let (asked, _) = tokio::join!(connection.call_holding(Opcode::Put, vec![], memory, short), request(&mut far));
        assert!(matches!(asked, Err(TransportError::Timeout(_))), "{asked:?}");
        connection.close("given up");
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!freed.load(Ordering::SeqCst), "let go before a request's time (2 s) passed");
        assert!(released(&freed).await, "held for ever by a target that never hangs up");
        drop(far);
    }

    /// A request that times out with nothing at all heard from the target since it was sent (a
    /// stopped target, its I/O hung) gives the connection up, so the next request opens another
    /// instead of waiting out its own timeout on a dead one.
    #[tokio::test]
    async fn a_target_that_answers_nothing_gets_its_connection_given_up() {
        let (connection, mut far) = connection();
        let (asked, _) = tokio::join!(get_within(&connection, Duration::from_millis(100)), request(&mut far));
        assert!(matches!(asked, Err(TransportError::Timeout(_))), "{:?}", asked.err());
        assert!(!connection.is_alive(), "a connection that answered nothing stays in use");
        let asked = get_within(&connection, Duration::from_secs(5)).await;
        assert!(asked.as_ref().is_err_and(TransportError::is_connection), "{:?}", asked.err());
    }

    async fn get_within(connection: &Connection, timeout: Duration) -> Result<Answer, TransportError> {
        connection.exchange(Opcode::Get, vec![], None, None, timeout, None).await
    }

    /// A lent payload the caller drops unread is skipped: the next response is read intact.
    #[tokio::test]
    async fn a_lent_payload_left_unread_is_skipped() {
        let (connection, mut far) = connection();
        let serve = async {
            let id = request(&mut far).await;
            respond(&mut far, id, &[1u8; 5000]).await;
            let id = request(&mut far).await;
            respond(&mut far, id, b"next").await;
        };
        let ask = async {
            let Answer::Lent(_, lent) = get(&connection, Some(5000)).await.unwrap() else { panic!("not lent") };
            drop(lent);
            match get(&connection, Some(3)).await.unwrap() {
                Answer::Whole(_, payload) => assert_eq!(&payload[..], b"next", "another length: read whole"),
                Answer::Lent(..) => panic!("lent a payload of another length"),
            }
        };
        tokio::join!(serve, ask);
    }

    /// A lent payload abandoned midway leaves the stream mid-frame: the connection is closed and
    /// every request on it fails, instead of reading payload bytes as a frame header.
    #[tokio::test]
    async fn a_lent_payload_abandoned_midway_closes_the_connection() {
        let (connection, mut far) = connection();
        let serve = async {
            let id = request(&mut far).await;
            respond_partly(&mut far, id, 8192, 3000).await;
        };
        let ask = async {
            let Answer::Lent(_, lent) = get(&connection, Some(8192)).await.unwrap() else { panic!("not lent") };
            lent
        };
        let ((), lent) = tokio::join!(serve, ask);
        let mut dest = vec![0u8; 8192];
        let read = tokio::time::timeout(Duration::from_millis(100), lent.read_hashed(&mut dest)).await;
        assert!(read.is_err(), "half a payload cannot be read whole");
        // Failed when the reader task closes the connection, whether or not it was sent.
        let asked = tokio::time::timeout(Duration::from_secs(10), get(&connection, None)).await.unwrap();
        let Err(error) = asked else { panic!("a request was answered from the middle of a payload") };
        assert!(error.is_connection(), "{error}");
        assert!(!connection.is_alive());
    }

    /// A request that keeps its lent stream without reading it (its future held, no longer
    /// polled) does not stall the connection for ever: past the request timeout the connection is
    /// given up, and its other requests fail at once instead of waiting behind it.
    #[tokio::test(start_paused = true)]
    async fn a_lent_stream_held_unread_gives_the_connection_up() {
        let (connection, mut far) = connection();
        let serve = async {
            let id = request(&mut far).await;
            respond(&mut far, id, &[3u8; 4096]).await;
        };
        let ask = async {
            let Answer::Lent(_, lent) = get(&connection, Some(4096)).await.unwrap() else { panic!("not lent") };
            lent
        };
        let ((), _held) = tokio::join!(serve, ask);
        let error = get(&connection, None).await.err().expect("answered behind a held stream");
        assert!(error.is_connection(), "{error}");
        assert!(!connection.is_alive());
    }

    /// A target that stops reading (alive, its connection open) does not pin what was queued to
    /// it for ever: past the request timeout without the bytes going out, the connection is
    /// given up, the payloads queued on it go back to their owners (staging buffers to their
    /// pool), and the next request opens another connection.
    #[tokio::test]
    async fn a_target_that_stops_reading_gets_its_connection_given_up() {
        let (near, far) = tokio::io::duplex(64 * 1024);
        let (reader, writer) = tokio::io::split(near);
        let deadline = Deadline { allowance: Duration::from_millis(300), floor_bytes_per_sec: 1 << 30 };
        let config = TcpConfig { deadline, ..TcpConfig::default() };
        let connection = Connection::start(reader, FrameWriter::new(writer), &config);
        let large = || {
            let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
            (Bytes::from_owner(Tracked(Arc::clone(&released), vec![7; 1 << 20])), released)
        };
        let (first, first_freed) = large();
        let (second, second_freed) = large();
        let put = |payload| connection.call(Opcode::Put, vec![], Some(payload), Duration::from_millis(300));
        let (one, two) = tokio::join!(put(first), put(second));
        // Whichever times out first gives the connection up (nothing heard) under the other.
        for asked in [one, two] {
            assert!(matches!(asked, Err(TransportError::Timeout(_) | TransportError::Connection(_))), "{asked:?}");
        }
        assert!(released(&first_freed).await, "the payload being written is pinned by a target that reads nothing");
        assert!(released(&second_freed).await, "a payload queued behind it is pinned");
        assert!(!connection.is_alive(), "a connection whose writes stall stays in use");
        drop(far);
    }

    /// Sends the response header of request `id` with a `len`-byte payload, and `sent` bytes of it.
    async fn respond_partly(far: &mut DuplexStream, id: u64, len: u32, sent: usize) {
        let header = data::Response::default().encode_to_vec();
        let fixed = frame::FrameHeader {
            opcode: Opcode::GetResponse,
            request_id: id,
            header_len: header.len() as u32,
            payload_len: len,
        };
        far.write_all(&fixed.encode()).await.unwrap();
        far.write_all(&header).await.unwrap();
        far.write_all(&vec![9u8; sent]).await.unwrap();
    }

    /// A lent payload read whole lands in the caller's buffer with its hash; the stream goes back.
    #[tokio::test]
    async fn a_lent_payload_lands_hashed() {
        let (connection, mut far) = connection();
        let data: Vec<u8> = (0..700_000u32).map(|i| (i * 13) as u8).collect();
        let serve = async {
            let id = request(&mut far).await;
            respond(&mut far, id, &data).await;
            let id = request(&mut far).await;
            respond(&mut far, id, b"after").await;
        };
        let ask = async {
            let Answer::Lent(_, lent) = get(&connection, Some(data.len())).await.unwrap() else { panic!("not lent") };
            let mut dest = vec![0u8; data.len()];
            assert_eq!(lent.read_hashed(&mut dest).await.unwrap(), ChunkHash::of(&data));
            assert_eq!(dest, data);
            let Answer::Whole(_, payload) = get(&connection, None).await.unwrap() else { panic!("lent unasked") };
            assert_eq!(&payload[..], b"after");
        };
        tokio::join!(serve, ask);
    }
}
