//! The RDMA transport (the 3FS model; `starckpt_rdma` has the protocol).
//!
//! A connection is a TCP data-plane connection plus a reliable-connected queue pair set up over it
//! (OP_CONNECT). Frames stay on TCP; payloads do not:
//! - a PUT names the payload's memory (address, rkey, length) and the target RDMA-READs it into
//!   the buffer it writes to the device from. The client registers its staging pool's buffers once
//!   (a [`MemoryMap`] over the pool), so a staged chunk goes from staging to the target's buffer
//!   with no copy on the client; other payloads (caller-shared bytes, compressed chunks) are
//!   registered for the request. Memory that cannot be registered (a memlock limit) travels in the
//!   frame instead.
//! - a GET names a slot of the client's receive region (registered once, remote write, shared by
//!   every target connection, so its memory does not grow with the number of targets); the target
//!   RDMA-WRITEs the chunk there. A slot is reused once the target answered; a slot whose request
//!   was abandoned waits until that connection's queue pair is destroyed (no peer can write it).
//!
//! A transfer the target reports failed (TRANSFER_FAILED: a revoked key, a queue pair in error)
//! closes the connection and counts as a connection error (`slots.rs`, `Dialled::call_on`): the
//! request is retried once on a fresh connection, and [`super::AutoTransport`] retries it over
//! TCP after that.

use std::fmt;

use crate::buf::{AlignedBuf, BufPool};
use crate::rdma::{endpoint_from_wire, endpoint_to_wire};
use starckpt_rdma::{Access, DeviceSettings, MemoryMap, MemoryRegion, QueuePair, Verbs};

use super::slots::{Dialled, Slot, SlotHost, SlotPool};
use super::*;
use crate::sync::LockExt;

/// RDMA settings of a client.
#[derive(Clone)]
pub struct RdmaConfig {
    /// Use RDMA with targets that serve it, when this client has a device. Default: true unless
    /// `STARCKPT_RDMA=off`.
    pub enabled: bool,
    /// The device to use; None: open one per `settings` when the client starts (ibverbs, in
    /// builds with the `rdma` feature; otherwise, or with no device, TCP).
    pub device: Option<Arc<dyn Verbs>>,
    /// Which device, port, GID index and MTU; None: from `STARCKPT_RDMA_DEVICE`,
    /// `STARCKPT_RDMA_PORT`, `STARCKPT_RDMA_GID_INDEX`, `STARCKPT_RDMA_MTU`
    /// ([`DeviceSettings::from_env`]).
    pub settings: Option<DeviceSettings>,
    /// Receive slots (one chunk each) shared by all targets: GET results in flight at once over
    /// RDMA (more wait). Default 16, the default restore concurrency.
    pub slots: u32,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        let off = std::env::var("STARCKPT_RDMA").is_ok_and(|v| v == "off");
        RdmaConfig { enabled: !off, device: None, settings: None, slots: 16 }
    }
}

impl fmt::Debug for RdmaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaConfig")
            .field("enabled", &self.enabled)
            .field("device", &self.device.as_ref().map(|d| d.name()))
            .field("settings", &self.settings)
            .field("slots", &self.slots)
            .finish()
    }
}

/// A client's RDMA device and its registrations, shared by its transports to every target.
/// Fields drop in order: registrations before their memory.
pub struct RdmaClient {
    /// PUT payloads: the staging pool registered once (remote read), other memory per request.
    memory: MemoryMap,
    /// GET results: slots of one region, registered once (remote write).
    receive_slots: SlotPool,
    receive_registration: Box<dyn MemoryRegion>,
    receive: AlignedBuf,
}

impl RdmaClient {
    /// `staging`: the pool whose buffers PUT payloads usually lie in; `slot_bytes`: the largest
    /// GET result received by RDMA (the chunk size).
    pub fn new(
        verbs: Arc<dyn Verbs>,
        staging: &BufPool,
        slots: u32,
        slot_bytes: usize,
    ) -> Result<Arc<RdmaClient>, starckpt_rdma::VerbsError> {
        let (slots, slot_bytes) = (slots.max(1), crate::buf::round_up(slot_bytes));
        let mut receive = AlignedBuf::new(slots as usize * slot_bytes);
        let len = receive.capacity();
        // SAFETY: the registration is dropped before `receive` (field order of RdmaClient).
        let receive_registration = unsafe { verbs.register(receive.as_mut_ptr(), len, Access::REMOTE_WRITE) }?;
        let pool = staging.clone();
        let memory = MemoryMap::new(verbs, Access::REMOTE_READ, Box::new(move |at| pool.buffer_containing(at)));
        Ok(Arc::new(RdmaClient {
            memory,
            receive_slots: SlotPool::new(slots, slot_bytes),
            receive_registration,
            receive,
        }))
    }

    pub fn device(&self) -> String {
        self.memory.verbs().name()
    }

    /// Staging buffers registered so far (each once).
    pub fn registered_staging_buffers(&self) -> usize {
        self.memory.cached()
    }
}

/// One TCP connection with its queue pair; it lends the client's receive slots.
pub(crate) struct RdmaConnection {
    frames: Connection,
    /// Some until destroyed: when a slot is abandoned, or (first) in `Drop`.
    queue_pair: Mutex<Option<Box<dyn QueuePair>>>,
    client: Arc<RdmaClient>,
    /// Receive slots abandoned while the target might still write them: returned once the queue
    /// pair is destroyed.
    quarantined: Mutex<Vec<u32>>,
}

impl SlotHost for RdmaConnection {
    fn slot_pool(&self) -> &SlotPool {
        &self.client.receive_slots
    }

    fn frames(&self) -> &Connection {
        &self.frames
    }

    fn abandon(&self, index: u32) {
        self.quarantined.lock_unpoisoned().push(index);
        self.frames.close("a request was abandoned while the target may still write its slot");
        // The slot is shared with every target's connection: free it now, not when this
        // connection is next looked at (which may be never).
        self.destroy_queue_pair();
    }
}

impl RdmaConnection {
    /// Destroys the queue pair (no peer can write through it after this) and returns the slots
    /// abandoned on it.
    fn destroy_queue_pair(&self) {
        drop(self.queue_pair.lock_unpoisoned().take());
        for index in self.quarantined.lock_unpoisoned().drain(..) {
            self.client.receive_slots.release(index);
        }
    }
}

impl Drop for RdmaConnection {
    fn drop(&mut self) {
        self.destroy_queue_pair();
    }
}

/// The RDMA transport to one target.
pub struct RdmaTransport {
    address: SocketAddr,
    target_id: Option<String>,
    config: TcpConfig,
    client: Arc<RdmaClient>,
    connection: tokio::sync::Mutex<Option<Arc<RdmaConnection>>>,
}

impl RdmaTransport {
    /// Connects to the target at `address` and sets up a queue pair (failing if it serves no RDMA
    /// or the queue pairs cannot connect).
    pub async fn connect(
        address: SocketAddr,
        target_id: Option<&str>,
        config: TcpConfig,
        client: Arc<RdmaClient>,
    ) -> Result<RdmaTransport, TransportError> {
        let transport = RdmaTransport {
            address,
            target_id: target_id.map(str::to_owned),
            config,
            client,
            connection: tokio::sync::Mutex::new(None),
        };
        transport.connection().await?;
        Ok(transport)
    }

    /// Checks that data crosses the new queue pair: the target RDMA-READs random bytes and returns
    /// them (a queue pair connects over paths that cannot carry data).
    async fn probe(&self, frames: &Connection, verbs: &dyn Verbs) -> Result<(), TransportError> {
        let mut nonce = AlignedBuf::new(32);
        nonce.set_len(32);
        let seed = uuid::Uuid::new_v4();
        nonce.full_mut()[..16].copy_from_slice(seed.as_bytes());
        nonce.full_mut()[16..32].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
        // SAFETY: `nonce` outlives the registration (declared before it).
        let region = unsafe { verbs.register(nonce.as_mut_ptr(), 32, Access::REMOTE_READ) }
            .map_err(|e| TransportError::Connect(format!("RDMA probe: {e}")))?;
        let probe = RemoteBuffer { addr: region.addr(), rkey: region.rkey(), len: 32 };
        let header = data::ConnectRequest { auth: self.auth().await, endpoint: None, probe: Some(probe.to_wire()) }
            .encode_to_vec();
        let (response, echoed) = frames.call(Opcode::Connect, header, None, self.config.deadline.allowance).await?;
        let (_, echoed) = checked(response, echoed).map_err(|e| TransportError::Connect(format!("RDMA probe: {e}")))?;
        drop(region);
        if echoed[..] != nonce.as_ref()[..] {
            return Err(TransportError::Connect("RDMA probe: the target read other bytes than the client's".into()));
        }
        Ok(())
    }

    async fn put_once(&self, name: &ChunkName, payload: &Payload, repair: bool) -> Result<bool, TransportError> {
        let connection = self.connection().await?;
        let bytes = payload.bytes.clone();
        let fits = !bytes.is_empty() && bytes.len() <= frame::MAX_PAYLOAD_BYTES as usize;
        // SAFETY: `bytes` keeps the memory alive and is declared before the registration, so it
        // is dropped after it, however this future ends.
        let registered =
            if fits { unsafe { self.client.memory.register(bytes.as_ptr(), bytes.len()) }.ok() } else { None };
        let Some(registered) = registered else {
            let header = put_header(self, name, payload, repair, Place::Inline).await;
            return Ok(self.call_on(&connection, Opcode::Put, header, Some(bytes)).await?.0.already_present);
        };
        let remote =
            RemoteBuffer { addr: bytes.as_ptr() as u64, rkey: registered.region().rkey(), len: bytes.len() as u32 };
        let header = put_header(self, name, payload, repair, Place::Rdma(remote)).await;
        let (response, _) = self.call_on(&connection, Opcode::Put, header, None).await?;
        drop(registered);
        Ok(response.already_present)
    }
}

/// The start of `len` bytes at `offset` of the receive region, if they lie inside it.
fn receive_range(connection: &RdmaConnection, offset: usize, len: usize) -> Result<*const u8, TransportError> {
    let receive = &connection.client.receive;
    match offset.checked_add(len) {
        // SAFETY: in bounds (checked).
        Some(end) if end <= receive.capacity() => Ok(unsafe { receive.as_ptr().add(offset) }),
        _ => Err(TransportError::Protocol(format!("{len} bytes at {offset} are outside the receive region"))),
    }
}

#[async_trait]
impl Dialled for RdmaTransport {
    type Conn = RdmaConnection;

    fn current(&self) -> &tokio::sync::Mutex<Option<Arc<RdmaConnection>>> {
        &self.connection
    }

    fn timeouts(&self) -> &TcpConfig {
        &self.config
    }

    fn setup(&self) -> &'static str {
        "RDMA setup"
    }

    fn slot_place(&self, connection: &RdmaConnection, slot: &Slot<RdmaConnection>) -> Place {
        let client = &connection.client;
        Place::Rdma(RemoteBuffer {
            addr: client.receive_registration.addr() + slot.offset() as u64,
            rkey: client.receive_registration.rkey(),
            len: client.receive_slots.slot_bytes() as u32,
        })
    }

    fn slot_length(response: &data::Response) -> u64 {
        response.rdma_length
    }

    // SAFETY (both copies): the range is checked to lie inside `receive`; it is a slot the caller
    // holds until its `Slot` drops, and the target wrote it before answering. Raw copies: other
    // slots may be written concurrently by the device, so no reference to the whole buffer is
    // formed.
    fn copy_out(connection: &RdmaConnection, offset: usize, dest: &mut [u8]) -> Result<ChunkHash, TransportError> {
        let from = receive_range(connection, offset, dest.len())?;
        crate::buf::fill_hashed(dest, |at, piece| {
            unsafe { std::ptr::copy_nonoverlapping(from.add(at), piece.as_mut_ptr(), piece.len()) };
            Ok(())
        })
    }

    fn copy_fresh(connection: &RdmaConnection, offset: usize, len: usize) -> Result<Bytes, TransportError> {
        let from = receive_range(connection, offset, len)?;
        let mut bytes = BytesMut::with_capacity(len);
        unsafe {
            std::ptr::copy_nonoverlapping(from, bytes.spare_capacity_mut().as_mut_ptr().cast::<u8>(), len);
            bytes.set_len(len);
        }
        crate::buf::copies::record(len);
        Ok(bytes.freeze())
    }

    async fn open(&self) -> Result<RdmaConnection, TransportError> {
        // Payloads travel by RDMA, never on this stream: nothing to send zero-copy.
        let frames = Connection::open(self.address, &self.config, None).await?;
        let verbs = self.client.memory.verbs();
        let setup = |e: starckpt_rdma::VerbsError| TransportError::Connect(format!("RDMA setup: {e}"));
        // The target reads PUT payloads and writes GET results.
        let access = Access { remote_read: true, remote_write: true };
        let queue_pair = verbs.create_qp(self.config.max_requests_per_connection as u32, access).map_err(setup)?;
        let header = data::ConnectRequest {
            auth: self.auth().await,
            endpoint: Some(endpoint_to_wire(&queue_pair.endpoint())),
            probe: None,
        }
        .encode_to_vec();
        let (response, payload) = frames.call(Opcode::Connect, header, None, self.config.deadline.allowance).await?;
        // Any refusal (RDMA no longer served there, setup failing) means: use TCP for now.
        let (response, _) =
            checked(response, payload).map_err(|e| TransportError::Connect(format!("OP_CONNECT: {e}")))?;
        let remote = response
            .rdma_endpoint
            .as_ref()
            .ok_or_else(|| "no endpoint".to_owned())
            .and_then(endpoint_from_wire)
            .map_err(|e| TransportError::Protocol(format!("OP_CONNECT answered a bad endpoint: {e}")))?;
        // Connecting may block (address resolution on RoCE): off the runtime.
        let queue_pair = tokio::task::spawn_blocking(move || queue_pair.connect(&remote).map(|()| queue_pair))
            .await
            .map_err(|e| TransportError::Connect(format!("RDMA setup: {e}")))?
            .map_err(setup)?;
        self.probe(&frames, &**verbs).await?;
        Ok(RdmaConnection {
            frames,
            queue_pair: Mutex::new(Some(queue_pair)),
            client: Arc::clone(&self.client),
            quarantined: Mutex::new(Vec::new()),
        })
    }
}

#[async_trait]
impl FrameTransport for RdmaTransport {
    async fn auth(&self) -> Option<data::Auth> {
        auth_for(&self.target_id, &self.config).await
    }

    async fn call(
        &self,
        opcode: Opcode,
        header: Vec<u8>,
        payload: Option<Bytes>,
    ) -> Result<(data::Response, Bytes), TransportError> {
        self.call_frame(opcode, header, payload).await
    }

    async fn put_chunk(&self, name: &ChunkName, payload: Payload, repair: bool) -> Result<bool, TransportError> {
        once_more(|| self.put_once(name, &payload, repair)).await
    }

    async fn get_chunk(&self, hash: ChunkHash, offset: u64, length: u64) -> Result<Payload, TransportError> {
        fetched_payload(self.get_slot(hash, offset, length, None).await?)
    }

    async fn get_chunk_into(&self, hash: ChunkHash, dest: &mut [u8]) -> Result<Fetched, TransportError> {
        self.get_slot(hash, 0, 0, Some(dest)).await
    }

    fn name(&self) -> &'static str {
        "rdma"
    }
}
