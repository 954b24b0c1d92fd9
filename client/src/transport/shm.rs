//! The same-host shared-memory transport, and [`AutoTransport`], which picks it or TCP per target.
//!
//! A [`ShmTransport`] connection is a Unix-socket connection to the target plus a memfd region
//! the client creates, seals and passes over it (`starckpt_proto::shm` has the handshake and why
//! the target can trust the mapping). The region is split into slots. A PUT copies its payload
//! into a free slot and sends a frame naming the slot; the target copies it out into its aligned
//! write buffer, verifies and stores it. A GET names a slot; the target writes the bytes there and
//! answers with their length. So payload bytes never pass through socket buffers; the frames that
//! carry the requests are the same as on TCP (HAS, LIST, ... travel on the same socket). A payload
//! larger than a slot travels inline on the same socket.
//!
//! A slot is reused only after the target answered the request that used it. A request abandoned
//! before its answer (a timeout, a cancelled save) may still be read or written by the target, so
//! its connection is closed instead, and the next request attaches a fresh region.
//!
//! [`AutoTransport`] is what the SDK uses: it asks a target over TCP (STAT, in the background, so
//! no request waits for it) for its shared-memory endpoint and host; on the same host it attaches,
//! and uses TCP until then, when the target serves no shared memory, runs elsewhere, the attach
//! fails, or a shared-memory request fails to connect.

use std::path::PathBuf;
use std::sync::Mutex;

use starckpt_proto::shm::{self, Attach, Region};
use tokio::io::AsyncReadExt;
use tokio::net::UnixStream;

use super::*;

/// Shared-memory settings of a client.
#[derive(Clone, Debug)]
pub struct ShmConfig {
    /// Use shared memory with targets on this host. Default true.
    pub enabled: bool,
    /// Slots per target: payloads in flight to one target at once through shared memory (more
    /// wait for a slot). Default 8.
    pub slots: u32,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig { enabled: true, slots: 8 }
    }
}

/// One attached connection.
struct ShmConnection {
    frames: Connection,
    region: Region,
    slot_bytes: usize,
    free: Mutex<Vec<u32>>,
    available: Semaphore,
}

/// A slot in use; returned to its connection only once the target answered (see the module docs).
struct Slot {
    connection: Arc<ShmConnection>,
    index: u32,
    answered: bool,
}

impl Slot {
    fn offset(&self) -> usize {
        self.index as usize * self.connection.slot_bytes
    }

    /// The 1-based number frames carry.
    fn number(&self) -> u32 {
        self.index + 1
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.answered {
            self.connection.free.lock().unwrap_or_else(|p| p.into_inner()).push(self.index);
            self.connection.available.add_permits(1);
        } else {
            // The slot is never reused: the connection goes, and requests waiting for a slot of
            // it fail (and retry on a fresh connection) instead of waiting for a permit that
            // will not come back.
            self.connection.available.close();
            self.connection.frames.close("a request was abandoned while the target may still use its slot");
        }
    }
}

impl ShmConnection {
    async fn slot(self: &Arc<Self>) -> Result<Slot, TransportError> {
        let permit = self
            .available
            .acquire()
            .await
            .map_err(|_| TransportError::Connection("the shared-memory connection closed".into()))?;
        permit.forget();
        let index = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let index = index.ok_or_else(|| TransportError::Protocol("no free slot behind a permit".into()))?;
        Ok(Slot { connection: Arc::clone(self), index, answered: false })
    }
}

/// The shared-memory transport to one target on this host.
pub struct ShmTransport {
    socket: PathBuf,
    target_id: Option<String>,
    config: TcpConfig,
    attach: Attach,
    connection: tokio::sync::Mutex<Option<Arc<ShmConnection>>>,
}

impl ShmTransport {
    /// Connects to the target's shared-memory socket and attaches a region of `slots` slots of
    /// `slot_bytes` (rounded up to 4 KiB) each.
    pub async fn connect(
        socket: PathBuf,
        target_id: Option<&str>,
        config: TcpConfig,
        slots: u32,
        slot_bytes: usize,
    ) -> Result<ShmTransport, TransportError> {
        let slot_bytes = u32::try_from(slot_bytes.div_ceil(4096) * 4096)
            .map_err(|_| TransportError::Connect(format!("slot of {slot_bytes} bytes")))?;
        let attach = Attach { slots, slot_bytes };
        Attach::decode(&attach.encode()).map_err(TransportError::Connect)?;
        let transport = ShmTransport {
            socket,
            target_id: target_id.map(str::to_owned),
            config,
            attach,
            connection: tokio::sync::Mutex::new(None),
        };
        // Over the attached connection, so a socket that belongs to another target (two
        // containers' targets at the same path) fails here (WRONG_TARGET), not on every request.
        transport.stat().await?;
        Ok(transport)
    }

    async fn connection(&self) -> Result<Arc<ShmConnection>, TransportError> {
        let mut slot = self.connection.lock().await;
        if let Some(connection) = slot.as_ref().filter(|c| c.frames.is_alive()) {
            return Ok(Arc::clone(connection));
        }
        let connection =
            Arc::new(tokio::time::timeout(self.config.connect_timeout, self.open()).await.map_err(|_| {
                TransportError::Connect(format!(
                    "shared-memory attach timed out after {:?}",
                    self.config.connect_timeout
                ))
            })??);
        *slot = Some(Arc::clone(&connection));
        Ok(connection)
    }

    async fn open(&self) -> Result<ShmConnection, TransportError> {
        let connect = |e: std::io::Error| TransportError::Connect(format!("{}: {e}", self.socket.display()));
        let mut stream = UnixStream::connect(&self.socket).await.map_err(connect)?;
        let region = Region::create("starckpt-slots", self.attach.region_bytes()).map_err(connect)?;
        shm::send_attach(&stream, self.attach, region.fd()).await.map_err(connect)?;
        let mut answer = [0u8; 8];
        stream.read_exact(&mut answer).await.map_err(connect)?;
        if &answer != shm::ATTACH_OK {
            return Err(TransportError::Connect("the target refused the shared-memory region".into()));
        }
        let (reader, writer) = stream.into_split();
        Ok(ShmConnection {
            frames: Connection::start(reader, writer, self.config.max_requests_per_connection),
            region,
            slot_bytes: self.attach.slot_bytes as usize,
            free: Mutex::new((0..self.attach.slots).rev().collect()),
            available: Semaphore::new(self.attach.slots as usize),
        })
    }

    /// One request on `connection`, its response checked.
    async fn call_on(
        &self,
        connection: &ShmConnection,
        opcode: Opcode,
        header: Vec<u8>,
        payload: Option<Bytes>,
    ) -> Result<(data::Response, Bytes), TransportError> {
        let (response, payload) = connection.frames.call(opcode, header, payload, self.config.request_timeout).await?;
        checked(response, payload)
    }

    async fn put_request(&self, hash: ChunkHash, payload: Payload, repair: bool) -> Result<bool, TransportError> {
        let (response, _) = once_more(|| async {
            let connection = self.connection().await?;
            if payload.bytes.len() > connection.slot_bytes {
                let header = put_header(self, hash, &payload, repair, 0);
                return self.call_on(&connection, Opcode::Put, header, Some(payload.bytes.clone())).await;
            }
            let mut slot = connection.slot().await?;
            connection
                .region
                .write_at(slot.offset(), &payload.bytes)
                .map_err(|e| TransportError::Protocol(e.to_string()))?;
            let header = put_header(self, hash, &payload, repair, slot.number());
            let result = self.call_on(&connection, Opcode::Put, header, None).await;
            slot.answered = answered(&result);
            result
        })
        .await?;
        Ok(response.already_present)
    }
}

/// Whether the target is done with a request's slot: it answered (even with an error).
fn answered<T>(result: &Result<T, TransportError>) -> bool {
    !matches!(result, Err(TransportError::Timeout(_) | TransportError::Connection(_)))
}

#[async_trait]
impl FrameTransport for ShmTransport {
    fn auth(&self) -> Option<data::Auth> {
        auth_for(&self.target_id)
    }

    async fn call(
        &self,
        opcode: Opcode,
        header: Vec<u8>,
        payload: Option<Bytes>,
    ) -> Result<(data::Response, Bytes), TransportError> {
        once_more(|| async {
            let connection = self.connection().await?;
            self.call_on(&connection, opcode, header.clone(), payload.clone()).await
        })
        .await
    }

    async fn put_chunk(&self, hash: ChunkHash, payload: Payload, repair: bool) -> Result<bool, TransportError> {
        self.put_request(hash, payload, repair).await
    }

    async fn get_chunk(&self, hash: ChunkHash, offset: u64, length: u64) -> Result<Payload, TransportError> {
        once_more(|| async {
            let connection = self.connection().await?;
            let mut slot = connection.slot().await?;
            let header = get_header(self, hash, offset, length, slot.number());
            let result = self.call_on(&connection, Opcode::Get, header, None).await;
            slot.answered = answered(&result);
            let (response, inline) = result?;
            if response.shm_length == 0 {
                // Too big for a slot (or empty): it came in the frame.
                return get_payload(&response, inline);
            }
            let len = usize::try_from(response.shm_length).unwrap_or(usize::MAX);
            if len > connection.slot_bytes || !inline.is_empty() {
                return Err(TransportError::Protocol(format!("GET answered {len} bytes in a slot")));
            }
            let mut bytes = vec![0u8; len];
            connection
                .region
                .read_at(slot.offset(), &mut bytes)
                .map_err(|e| TransportError::Protocol(e.to_string()))?;
            get_payload(&response, Bytes::from(bytes))
        })
        .await
    }

    fn name(&self) -> &'static str {
        "shm"
    }
}

/// Shared memory to a target on this host, TCP otherwise (module docs).
///
/// Whether the target is local is found out in the background, so no request waits for it: until
/// the target has answered and the region is attached, requests go over TCP. A probe that fails
/// (the target is down or slow) is tried again after [`PROBE_RETRY`].
pub struct AutoTransport {
    tcp: Arc<TcpTransport>,
    probe: Arc<Probe>,
}

/// How long after a failed probe (the target did not answer, or the attach failed) the next one
/// may start.
const PROBE_RETRY: Duration = Duration::from_secs(10);

struct Probe {
    tcp: Arc<TcpTransport>,
    target_id: String,
    config: TcpConfig,
    shm_config: ShmConfig,
    slot_bytes: usize,
    /// Set once decided: Some when the target is local and attached.
    decided: std::sync::OnceLock<Option<Arc<ShmTransport>>>,
    running: std::sync::atomic::AtomicBool,
    retry_at: Mutex<Option<std::time::Instant>>,
    finished: tokio::sync::Notify,
}

impl Probe {
    /// Starts a probe unless one is running, the answer is known, or the last one failed recently.
    fn start(self: &Arc<Self>) {
        if !self.shm_config.enabled || self.decided.get().is_some() {
            return;
        }
        if self.retry_at.lock().unwrap_or_else(|p| p.into_inner()).is_some_and(|at| std::time::Instant::now() < at) {
            return;
        }
        if self.running.swap(true, Ordering::AcqRel) {
            return;
        }
        let probe = Arc::clone(self);
        tokio::spawn(async move {
            match probe.ask().await {
                Ok(decision) => {
                    let _ = probe.decided.set(decision);
                }
                Err(error) => {
                    tracing::debug!(target = %probe.target_id, %error, "no shared memory with the target yet");
                    *probe.retry_at.lock().unwrap_or_else(|p| p.into_inner()) =
                        Some(std::time::Instant::now() + PROBE_RETRY);
                }
            }
            probe.running.store(false, Ordering::Release);
            probe.finished.notify_waiters();
        });
    }

    /// The target's answer: its shared memory, attached, if it is on this host and serves it.
    async fn ask(&self) -> Result<Option<Arc<ShmTransport>>, TransportError> {
        let stat = self.tcp.stat().await?;
        let here = shm::host_id();
        let Some(endpoint) = stat.shm.filter(|e| !here.is_empty() && e.host_id == here) else {
            return Ok(None);
        };
        let attached = ShmTransport::connect(
            endpoint.socket.clone(),
            Some(&self.target_id),
            self.config.clone(),
            self.shm_config.slots,
            self.slot_bytes,
        )
        .await;
        match attached {
            Ok(transport) => {
                tracing::debug!(target = %self.target_id, socket = %endpoint.socket.display(), "using shared memory");
                Ok(Some(Arc::new(transport)))
            }
            Err(error) => {
                tracing::info!(target = %self.target_id, %error, "shared memory unavailable; using TCP for now");
                Err(error)
            }
        }
    }
}

impl AutoTransport {
    /// `slot_bytes`: the largest payload that goes through shared memory (the client's chunk
    /// size); larger ones travel inline.
    pub fn new(
        address: SocketAddr,
        target_id: &str,
        config: TcpConfig,
        shm_config: ShmConfig,
        slot_bytes: usize,
    ) -> AutoTransport {
        let tcp = Arc::new(TcpTransport::for_target(address, target_id, config.clone()));
        let probe = Arc::new(Probe {
            tcp: Arc::clone(&tcp),
            target_id: target_id.to_owned(),
            config,
            shm_config,
            slot_bytes,
            decided: std::sync::OnceLock::new(),
            running: std::sync::atomic::AtomicBool::new(false),
            retry_at: Mutex::new(None),
            finished: tokio::sync::Notify::new(),
        });
        AutoTransport { tcp, probe }
    }

    /// The transport to use now (module docs); starts a probe if the answer is not known yet.
    fn chosen(&self) -> Arc<dyn ChunkTransport> {
        match self.probe.decided.get() {
            Some(Some(shm)) => Arc::clone(shm) as Arc<dyn ChunkTransport>,
            Some(None) => Arc::clone(&self.tcp) as Arc<dyn ChunkTransport>,
            None => {
                self.probe.start();
                Arc::clone(&self.tcp) as Arc<dyn ChunkTransport>
            }
        }
    }

    /// Runs `op` on the chosen transport; a shared-memory failure to connect is retried on TCP.
    async fn run<T, F>(&self, op: impl Fn(Arc<dyn ChunkTransport>) -> F) -> Result<T, TransportError>
    where
        F: std::future::Future<Output = Result<T, TransportError>>,
    {
        let chosen = self.chosen();
        let shm = chosen.kind() == "shm";
        match op(chosen).await {
            Err(error) if shm && error.is_connection() => {
                tracing::warn!(target = %self.probe.target_id, %error, "shared-memory request failed; retrying over TCP");
                op(Arc::clone(&self.tcp) as Arc<dyn ChunkTransport>).await
            }
            other => other,
        }
    }
}

#[async_trait]
impl ChunkTransport for AutoTransport {
    async fn put(&self, hash: ChunkHash, payload: Payload) -> Result<bool, TransportError> {
        self.run(|t| {
            let payload = payload.clone();
            async move { t.put(hash, payload).await }
        })
        .await
    }

    async fn repair(&self, hash: ChunkHash, payload: Payload) -> Result<bool, TransportError> {
        self.run(|t| {
            let payload = payload.clone();
            async move { t.repair(hash, payload).await }
        })
        .await
    }

    async fn get(&self, hash: ChunkHash, offset: u64, length: u64) -> Result<Payload, TransportError> {
        self.run(|t| async move { t.get(hash, offset, length).await }).await
    }

    async fn has(&self, hashes: &[ChunkHash]) -> Result<Vec<bool>, TransportError> {
        self.run(|t| async move { t.has(hashes).await }).await
    }

    async fn delete(&self, hashes: &[ChunkHash], unused_for: Option<Duration>) -> Result<u64, TransportError> {
        self.run(|t| async move { t.delete(hashes, unused_for).await }).await
    }

    async fn list(&self, after: Option<ChunkHash>, limit: u32) -> Result<ChunkPage, TransportError> {
        self.run(|t| async move { t.list(after, limit).await }).await
    }

    async fn stat(&self) -> Result<TargetStat, TransportError> {
        self.run(|t| async move { t.stat().await }).await
    }

    fn kind(&self) -> &'static str {
        match self.probe.decided.get() {
            Some(Some(_)) => "shm",
            _ => "tcp",
        }
    }

    async fn settle(&self) {
        let deadline = self.probe.config.connect_timeout + self.probe.config.request_timeout;
        let _ = tokio::time::timeout(deadline, async {
            loop {
                let finished = self.probe.finished.notified();
                self.probe.start();
                if self.probe.decided.get().is_some() || !self.probe.running.load(Ordering::Acquire) {
                    return;
                }
                finished.await;
            }
        })
        .await;
    }
}
