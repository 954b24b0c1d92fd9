//! The same-host shared-memory transport (`auto.rs` picks it, RDMA or TCP per target).
//!
//! A [`ShmTransport`] connection is a Unix-socket connection to the target plus a memfd region
//! the client creates, seals and passes over it (`crate::shm` has the handshake and why
//! the target can trust the mapping). The region is split into slots. A PUT of a staged chunk
//! names where it lies in the client's staging memory, which the client passed at attach too
//! (its staging pool is carved out of a memfd, `BufPool::shared`); any other PUT copies its
//! payload into a free slot and names the slot. The target copies the bytes into its aligned
//! write buffer, verifies and stores them, except a staged chunk of a client running as the
//! target's user (or root), which it writes to its device straight from the staging memory and
//! verifies there after the write (`crate::shm`): no user-space copy. A GET
//! names a slot; the target writes the bytes there and answers with their length. So payload
//! bytes never pass through socket buffers; the frames that carry the requests are the same as on
//! TCP (HAS, LIST, ... travel on the same socket). A payload that is not staged and is larger
//! than a slot travels inline on the same socket.
//!
//! Slots are lent as `slots.rs` describes: reused only once the target answered; an abandoned
//! request closes its connection, and the next request attaches a fresh region. A staged PUT
//! holds its staging buffer until answered, or abandoned, until the target closes the connection
//! (`Connection::call_holding`): the buffer is not refilled while the target may still read it.
//! (Were it refilled, the target's hash check, of what it copied or after its placed write,
//! would refuse the changed bytes; so a hung target that never closes the connection gets the
//! buffer back a request's time after the connection ended, not for ever.) A target that refuses staging memory (one
//! older than it) gets the slots alone from then on.

use std::path::PathBuf;

use crate::shm::{self, Attach, Region};
use tokio::io::AsyncReadExt;
use tokio::net::UnixStream;

use super::slots::{Dialled, Slot, SlotPool, Slotted};
use super::*;

/// Shared-memory settings of a client.
#[derive(Clone, Debug)]
pub struct ShmConfig {
    /// Use shared memory with targets on this host. Default true.
    pub enabled: bool,
    /// Slots per target: payloads in flight to one target at once through shared memory (more
    /// wait for a slot). Default 2: a target reads a GET from its device straight into the slot,
    /// and a slot freed is the first lent again, so few slots keep the memory the device writes
    /// into, and the client then hashes and copies out of, small enough to stay in cache. With
    /// 8, restores over shared memory ran at 0.77-0.89x the speed they have with 2 on a VM whose
    /// disk fills a small buffer faster than a large one (docs/performance.md, "What bounds each
    /// phase"). Puts of staged chunks name staging memory, not slots.
    pub slots: u32,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig { enabled: true, slots: 2 }
    }
}

/// One attached connection.
pub(crate) type ShmConnection = Slotted<Regions>;

/// What a connection shares with its target.
pub(crate) struct Regions {
    slots: Region,
    /// The client's staging memory, if the target took it at this attach.
    staging: Option<Arc<Region>>,
}

/// The shared-memory transport to one target on this host.
pub struct ShmTransport {
    socket: PathBuf,
    target_id: Option<String>,
    config: TcpConfig,
    attach: Attach,
    /// The client's staging memory, shared at every attach.
    staging: Option<Arc<Region>>,
    /// The target refused an attach with staging memory (a target that predates it): attach the
    /// slots alone from then on.
    staging_refused: std::sync::atomic::AtomicBool,
    connection: tokio::sync::Mutex<Option<Arc<ShmConnection>>>,
}

impl ShmTransport {
    /// Connects to the target's shared-memory socket and attaches a region of `slots` slots of
    /// `slot_bytes` (rounded up to 4 KiB) each, and `staging` (the client's staging pool's
    /// region, `BufPool::arena`) if given: PUTs of bytes that lie in it name them there.
    pub async fn connect(
        socket: PathBuf,
        target_id: Option<&str>,
        config: TcpConfig,
        slots: u32,
        slot_bytes: usize,
        staging: Option<Arc<Region>>,
    ) -> Result<ShmTransport, TransportError> {
        let slot_bytes = u32::try_from(slot_bytes.div_ceil(4096) * 4096)
            .map_err(|_| TransportError::Connect(format!("slot of {slot_bytes} bytes")))?;
        let attach = Attach { slots, slot_bytes, staging_bytes: 0 };
        Attach::decode(&attach.encode(&[])).map_err(TransportError::Connect)?;
        // Staging memory larger than a target takes is not shared (PUTs go through slots).
        let staging = staging.filter(|region| region.len() as u64 <= shm::MAX_STAGING_BYTES);
        let transport = ShmTransport {
            socket,
            target_id: target_id.map(str::to_owned),
            config,
            attach,
            staging,
            staging_refused: std::sync::atomic::AtomicBool::new(false),
            connection: tokio::sync::Mutex::new(None),
        };
        // Over the attached connection, so a socket that belongs to another target (two
        // containers' targets at the same path) fails here (WRONG_TARGET), not on every request.
        transport.stat().await?;
        Ok(transport)
    }

    async fn put_request(&self, name: &ChunkName, payload: Payload, repair: bool) -> Result<bool, TransportError> {
        let (response, _) = once_more(|| async {
            let connection = self.connection().await?;
            // Staged: named where it lies. The request holds its staging buffer until the target
            // answers or closes the connection, even when the caller gives up first (a timeout, a
            // cancelled save), so the buffer is not refilled while the target may still read it
            // (a target writes a staged chunk to its device straight from there, for a client of
            // its own user).
            let staged = connection.region.staging.as_ref();
            let staged = staged.and_then(|r| r.offset_of(payload.bytes.as_ptr(), payload.bytes.len()));
            if let Some(offset) = staged.filter(|_| !payload.bytes.is_empty()) {
                let header = put_header(self, name, &payload, repair, Place::Staging(offset as u64)).await;
                let timeout = self.timeouts().deadline.for_bytes(payload.bytes.len() as u64);
                let memory = payload.bytes.clone();
                let (response, bytes) = connection.frames.call_holding(Opcode::Put, header, memory, timeout).await?;
                return checked(response, bytes);
            }
            if payload.bytes.len() > connection.slots.slot_bytes() {
                let header = put_header(self, name, &payload, repair, Place::Inline).await;
                return self.call_on(&connection, Opcode::Put, header, Some(payload.bytes.clone())).await;
            }
            let mut slot = Slot::lend(&connection).await?;
            connection
                .region
                .slots
                .write_at(slot.offset(), &payload.bytes)
                .map_err(|e| TransportError::Protocol(e.to_string()))?;
            let header = put_header(self, name, &payload, repair, Place::Slot(slot.number())).await;
            let result = self.call_on(&connection, Opcode::Put, header, None).await;
            slot.settle(&result);
            result
        })
        .await?;
        Ok(response.already_present)
    }
}

/// Why an attach failed.
enum Attached {
    /// The target closed the connection instead of answering the attach.
    Refused,
    /// The target shares as much memory as it allows now.
    Busy,
    /// The target did not accept the capability sent (its cluster's key changed since it was
    /// asked for, or it expired).
    Unauthorized,
    Failed(TransportError),
}

impl Attached {
    fn into_error(self) -> TransportError {
        match self {
            Attached::Refused => TransportError::Connect("the target refused the shared-memory region".into()),
            Attached::Busy => TransportError::Connect("the target has no room for another shared-memory region".into()),
            Attached::Unauthorized => {
                TransportError::Connect("the target did not accept the capability sent with the shared memory".into())
            }
            Attached::Failed(error) => error,
        }
    }
}

impl ShmTransport {
    /// A fresh connection with a fresh slot region and, if given, the staging memory.
    async fn attach_with(&self, staging: Option<&Arc<Region>>) -> Result<ShmConnection, Attached> {
        let connect =
            |e: std::io::Error| Attached::Failed(TransportError::Connect(format!("{}: {e}", self.socket.display())));
        let mut stream = UnixStream::connect(&self.socket).await.map_err(connect)?;
        let region = Region::create("starckpt-slots", self.attach.region_bytes()).map_err(connect)?;
        let attach = Attach { staging_bytes: staging.map_or(0, |r| r.len() as u64), ..self.attach };
        let sent = std::time::Instant::now();
        let capability = self.config.credentials.fresh(self.target_id.as_deref()).await;
        shm::send_attach(&stream, attach, &capability, region.fd(), staging.map(|r| r.fd())).await.map_err(connect)?;
        let mut answer = [0u8; 8];
        match stream.read_exact(&mut answer).await {
            Ok(_) if &answer == shm::ATTACH_OK => {}
            Ok(_) if &answer == shm::ATTACH_BUSY => return Err(Attached::Busy),
            Ok(_) if &answer == shm::ATTACH_UNAUTHORIZED => {
                // The next attach asks for a fresh one.
                self.config.credentials.invalidate(sent);
                return Err(Attached::Unauthorized);
            }
            Ok(_) => return Err(Attached::Refused),
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(Attached::Refused),
            Err(e) => return Err(connect(e)),
        }
        let (reader, writer) = stream.into_split();
        Ok(ShmConnection {
            frames: Connection::start(reader, FrameWriter::new(writer), &self.config),
            region: Regions { slots: region, staging: staging.cloned() },
            slots: SlotPool::new(self.attach.slots, self.attach.slot_bytes as usize),
        })
    }
}

#[async_trait]
impl Dialled for ShmTransport {
    type Conn = ShmConnection;

    fn current(&self) -> &tokio::sync::Mutex<Option<Arc<ShmConnection>>> {
        &self.connection
    }

    fn timeouts(&self) -> &TcpConfig {
        &self.config
    }

    fn setup(&self) -> &'static str {
        "shared-memory attach"
    }

    async fn open(&self) -> Result<ShmConnection, TransportError> {
        let staging = self.staging.as_ref().filter(|_| !self.staging_refused.load(Ordering::Relaxed));
        match self.attach_with(staging).await {
            Err(Attached::Refused) if staging.is_some() => {
                tracing::info!(
                    socket = %self.socket.display(),
                    "the target did not take the staging memory (an older target?); PUTs go through slots"
                );
                self.staging_refused.store(true, Ordering::Relaxed);
                self.attach_with(None).await.map_err(Attached::into_error)
            }
            other => other.map_err(Attached::into_error),
        }
    }

    fn slot_place(&self, _: &ShmConnection, slot: &Slot<ShmConnection>) -> Place {
        Place::Slot(slot.number())
    }

    fn slot_length(response: &data::Response) -> u64 {
        response.shm_length
    }

    fn copy_out(connection: &ShmConnection, offset: usize, dest: &mut [u8]) -> Result<ChunkHash, TransportError> {
        connection.region.slots.read_at_hashed(offset, dest).map_err(|e| TransportError::Protocol(e.to_string()))
    }

    fn copy_fresh(connection: &ShmConnection, offset: usize, len: usize) -> Result<Bytes, TransportError> {
        connection.region.slots.read_bytes(offset, len).map_err(|e| TransportError::Protocol(e.to_string()))
    }
}

#[async_trait]
impl FrameTransport for ShmTransport {
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
        self.put_request(name, payload, repair).await
    }

    async fn get_chunk(&self, hash: ChunkHash, offset: u64, length: u64) -> Result<Payload, TransportError> {
        fetched_payload(self.get_slot(hash, offset, length, None).await?)
    }

    async fn get_chunk_into(&self, hash: ChunkHash, dest: &mut [u8]) -> Result<Fetched, TransportError> {
        self.get_slot(hash, 0, 0, Some(dest)).await
    }

    fn name(&self) -> &'static str {
        "shm"
    }
}
