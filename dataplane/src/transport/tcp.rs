//! The TCP transport: one multiplexed connection per target (requests written by one task,
//! answers read by another and matched by id), its configuration and deadlines.

use super::*;
use crate::sync::LockExt;

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

pub(super) type Reply = oneshot::Sender<Result<Answer, TransportError>>;

/// A connection's reading half. Boxed so that it can be lent to a caller ([`LentReader`]).
pub(super) type Reader = Box<dyn AsyncRead + Unpin + Send>;

/// How a response reaches its request.
pub(super) enum Answer {
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
pub(super) struct LentReader {
    lent: Option<(Reader, oneshot::Sender<Returned>)>,
    /// Payload bytes not yet read.
    left: usize,
    /// A read began and did not finish.
    broken: bool,
}

/// A lent reader coming back to its connection's reader task.
pub(super) struct Returned {
    reader: Reader,
    left: usize,
    broken: bool,
}

impl LentReader {
    /// Reads the payload into `dest` (exactly its length), hashing it as it arrives.
    pub(super) async fn read_hashed(mut self, dest: &mut [u8]) -> Result<ChunkHash, TransportError> {
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

pub(super) struct OutFrame {
    opcode: Opcode,
    request_id: u64,
    header: Vec<u8>,
    payload: Option<Bytes>,
}

/// A request waiting for its response; `land`: the length of a raw payload it reads itself;
/// `hold`: memory the target reads while it serves the request ([`Connection::call_holding`]).
pub(super) struct Waiting {
    reply: Reply,
    land: Option<usize>,
    hold: Option<Bytes>,
}

/// Requests of one connection waiting for their responses (`None` once the connection is dead),
/// and memory lent to the target by requests failed unanswered, kept until the target closes the
/// connection ([`Connection::call_holding`]), or a while longer than a request may take for a
/// target that never does. `dead` turns true with `map` gone.
pub(super) struct PendingState {
    map: Option<HashMap<u64, Waiting>>,
    orphans: Vec<Bytes>,
    dead: tokio::sync::watch::Sender<bool>,
}

pub(super) type Pending = Arc<Mutex<PendingState>>;

pub(super) fn lock(pending: &Pending) -> std::sync::MutexGuard<'_, PendingState> {
    pending.lock_unpoisoned()
}

/// Fails every request still waiting on the connection with [`TransportError::Connection`]: none
/// of them was answered, whatever ended the connection (a frame the reader could not follow
/// answers none of the others), so the memory they lent the target (shared-memory and RDMA
/// slots) is still the target's to use until the connection is gone.
pub(super) fn fail_all(pending: &Pending, why: String) {
    fail_all_with(pending, TransportError::Connection(why));
}

/// [`fail_all`] with `error`: [`TransportError::Timeout`] when the target went silent, so that
/// no request tries it again on a fresh connection (a stopped host accepts connections, and
/// answers none of them).
pub(super) fn fail_all_with(pending: &Pending, error: TransportError) {
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

pub(super) struct Connection {
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
    pub(super) async fn open(
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

    pub(super) fn is_alive(&self) -> bool {
        lock(&self.pending).map.is_some()
    }

    /// Fails every pending request, marks the connection dead (it is replaced on next use) and
    /// stops its writer (the target sees the stream end).
    pub(crate) fn close(&self, why: &str) {
        fail_all(&self.pending, why.to_owned());
        self.closed.notify_one();
    }

    pub(super) async fn call(
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
    pub(super) async fn exchange(
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
pub(super) struct Unqueue<'a> {
    queued: &'a AtomicU64,
    bytes: u64,
}

impl Drop for Unqueue<'_> {
    fn drop(&mut self) {
        self.queued.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

pub(super) struct ForgetOnDrop<'a> {
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
pub(super) async fn write_loop<W: AsyncWrite + Unpin>(
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
pub(super) struct Reading {
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
pub(super) async fn given_up_for(mut given_up: tokio::sync::watch::Receiver<bool>, hold: Duration) {
    if given_up.wait_for(|dead| *dead).await.is_ok() {
        tokio::time::sleep(hold).await;
    } else {
        std::future::pending::<()>().await;
    }
}

/// Reads responses and hands each to its request. `lend_timeout`: how long a request may hold the
/// stream lent to it; one that holds it longer (its future kept but no longer polled) would stall
/// every other response on the connection, so the connection is given up instead.
pub(super) async fn read_loop(mut reader: Reader, reading: Reading, lend_timeout: Duration) {
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
pub(super) enum Rest {
    /// The target closed it, or it failed: nothing more comes.
    Ended,
    /// Open, but not followed any more (a frame the task cannot make sense of).
    Open(Reader),
    /// Lent to a request that has not given it back yet.
    Lent(oneshot::Receiver<Returned>),
}

/// One GET of a whole chunk on `connection` (its `header` asks for the bytes in the frame): a raw
/// chunk of `dest`'s size is read from the stream straight into `dest`, hashed as it lands.
pub(super) async fn get_landing(
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
pub(super) fn take_waiting(pending: &Pending, id: u64, wanted: impl FnOnce(Option<usize>) -> bool) -> Option<Waiting> {
    let mut pending = lock(pending);
    let map = pending.map.as_mut()?;
    match wanted(map.get(&id)?.land) {
        true => map.remove(&id),
        false => None,
    }
}

/// Reads and drops `len` bytes of `reader` (a payload whose request went away).
pub(super) async fn skip(reader: &mut Reader, len: usize) -> std::io::Result<()> {
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

    pub(super) async fn connection(&self) -> Result<Arc<Connection>, TransportError> {
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
