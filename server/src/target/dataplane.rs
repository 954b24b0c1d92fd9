//! The target's data-plane server: frames in, chunk-store operations, frames out.
//!
//! One task reads frames from a connection, one writes responses; each request runs in its own
//! task so a slow device operation never blocks the connection. Everything is bounded:
//! connections ([`DataPlaneLimits::max_connections`]), requests in flight per connection, and
//! payload bytes in flight across the whole target. When a bound is reached the reader stops
//! reading, so TCP flow control pushes back on the client instead of memory growing.
//!
//! Three ways to the same frames: TCP; a Unix socket with a shared-memory region (same host,
//! `starckpt_proto::shm`); and TCP with an RDMA queue pair set up by OP_CONNECT (`starckpt_rdma`):
//! a PUT then names a client buffer the target RDMA-READs into its own registered buffer (the one
//! it writes to the device from), a GET one it RDMA-WRITEs the chunk into. RDMA transfers are
//! admitted per device ([`DataPlaneLimits::rdma_transfers`]) on top of the byte budget; one that
//! fails leaves the connection's queue pair in the error state and is answered TRANSFER_FAILED.
//!
//! A frame with a bad fixed header (magic, version, opcode, flags, sizes) closes the connection:
//! after it the stream has no trustworthy frame boundary. A frame with a good fixed header but an
//! undecodable prost header gets a BAD_REQUEST response and the connection stays open.

// A refused request is answered with its `data::Response` (~130 bytes), built once per request:
// boxing it would only add an allocation.
#![allow(clippy::result_large_err)]

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;
use starckpt_proto::buf::ALIGN;
use starckpt_proto::capability::{ClusterKey, Rights};
use starckpt_proto::codec::Codec;
use starckpt_proto::data::{self, ErrorCode};
use starckpt_proto::frame::{
    self, FrameHeader, LIST_ENTRY_BYTES, MAX_BATCH_HASHES, MAX_LIST_ENTRIES, Opcode, ReadFrameError,
};
use starckpt_proto::model::validate_target_id;
use starckpt_proto::rdma::{RemoteBuffer, endpoint_from_wire, endpoint_to_wire};
use starckpt_proto::shm::{self, Attach, Region, StagingFile};
use starckpt_proto::zerocopy::{FrameWriter, ZeroCopySend, ZeroCopyStats};
use starckpt_proto::{ChunkHash, ChunkName};
use starckpt_rdma::{Access, MemoryMap, Op, QpDriver, Verbs, WorkRequest};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixListener};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use super::engine::ExternalBuf;
use super::store::{ChunkStore, ChunkStoreError, PutOutcome};

/// Bounds of the data-plane server. Defaults suit one NVMe device behind a 25 GB/s NIC.
#[derive(Clone, Debug)]
pub struct DataPlaneLimits {
    /// Concurrent connections; more wait in the accept backlog. Default 1024: a few per client
    /// process, hundreds of trainer processes per target.
    pub max_connections: usize,
    /// Of those, the most one peer address holds at once; a connection past it is closed as soon
    /// as it is accepted (counted: `starckpt_target_refused_total{reason="peer_connections"}`).
    /// One host leaking connections (a client made per step and never dropped) then runs out
    /// alone. Default 256: a host of 8 trainer processes uses 16, two per process.
    pub max_connections_per_peer: usize,
    /// Requests being served at once on one connection. Default 64.
    pub max_requests_per_connection: usize,
    /// Payload bytes buffered at once across all connections. Default 1 GiB: enough to keep a
    /// device at queue depth 8 with 4 MiB chunks from dozens of clients, small beside host memory.
    pub max_inflight_bytes: u32,
    /// Of those, the most one connection holds at once (at least one payload's worth), so one
    /// slow peer (a restore over a thin link, an upload trickling its payloads) cannot take the
    /// budget every other client needs. Default 128 MiB: a connection's share of the device's
    /// queue many times over.
    pub max_connection_inflight_bytes: u32,
    /// Time allowed to receive the rest of a frame once its fixed header has arrived. Default 60 s.
    pub frame_timeout: Duration,
    /// A connection that completes no frame header for this long is closed (idle clients
    /// reconnect on their next request; a peer stalled in the middle of a header releases its
    /// connection slot). Default 10 min.
    pub idle_timeout: Duration,
    /// RDMA transfers (READs of PUT payloads, WRITEs of GET results) in flight on the device at
    /// once, across connections; more wait. Default 32 (128 MiB at 4 MiB chunks).
    pub rdma_transfers: usize,
    /// GET payloads sent zero-copy over TCP (io_uring SEND_ZC). Default auto: on each connection
    /// until the kernel reports it copied them anyway, as over loopback (`starckpt_proto::zerocopy`).
    pub zero_copy_send: ZeroCopySend,
    /// Bytes of slot regions same-host clients may share with this target at once (the target
    /// maps them and may fault them in: memory it is charged for). An attach past it is answered
    /// busy and that client goes over TCP until a region is given back. Default 4 GiB: 128 of the
    /// SDK's regions (8 slots of 4 MiB), one per client process.
    pub max_shm_region_bytes: u64,
}

impl Default for DataPlaneLimits {
    fn default() -> Self {
        DataPlaneLimits {
            max_connections: 1024,
            max_connections_per_peer: 256,
            max_requests_per_connection: 64,
            max_inflight_bytes: 1 << 30,
            max_connection_inflight_bytes: 128 << 20,
            frame_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(600),
            rdma_transfers: 32,
            zero_copy_send: ZeroCopySend::Auto,
            max_shm_region_bytes: 4 << 30,
        }
    }
}

struct Outgoing {
    opcode: Opcode,
    request_id: u64,
    header: Vec<u8>,
    payload: Option<Bytes>,
    /// In-flight bytes charged for the payload, released once it is written.
    charge: Option<Charge>,
    /// When the request's header was read, and the response's code: what its metrics record
    /// once the response is written.
    started: Instant,
    code: i32,
}

/// Payload bytes a request holds: charged to its connection's share and to the target's budget
/// ([`DataPlaneLimits::max_connection_inflight_bytes`]), in that order.
struct Charge {
    _connection: tokio::sync::OwnedSemaphorePermit,
    target: tokio::sync::OwnedSemaphorePermit,
}

impl Charge {
    /// Waits for `bytes` (at most one payload's worth) of both budgets. None once shutting down.
    async fn take(connection: &Arc<Semaphore>, served: &Served, bytes: u32) -> Option<Charge> {
        let bytes = bytes.clamp(1, frame::MAX_PAYLOAD_BYTES);
        let connection = Arc::clone(connection).acquire_many_owned(bytes).await.ok()?;
        let target = Arc::clone(&served.inflight_bytes).acquire_many_owned(bytes).await.ok()?;
        Some(Charge { _connection: connection, target })
    }

    fn bytes(&self) -> usize {
        self.target.num_permits()
    }
}

/// A Unix socket on which same-host clients attach shared memory ([`starckpt_proto::shm`]).
pub struct ShmListener {
    pub listener: UnixListener,
    /// Its path, as advertised to clients in STAT responses.
    pub path: std::path::PathBuf,
    /// Whether whole-chunk GETs are read from the device straight into the client's slot (no
    /// copy here) rather than read into the target's buffer and copied there. None: where
    /// shared memory gets transparent huge pages (`shm::shared_huge_pages`). Into 4 KiB shared
    /// pages a read is one segment per page, and the virtual disks this was measured on serve
    /// that far slower than the copy costs (restore 1.5-1.7x the O_DIRECT read, against 1.2-1.3x
    /// with the copy and 1.16-1.18x placed into huge pages; README "starckpt bench").
    pub placed_reads: Option<bool>,
    /// Whether a PUT of a staged chunk from a client running as this target's user (or as root)
    /// is written to the device straight from the client's staging memory (no copy; the client
    /// could rewrite the chunk files anyway, `starckpt_proto::shm`'s docs) rather than copied
    /// out of it first. Default true. Other clients' chunks are always copied.
    pub placed_writes: bool,
}

impl ShmListener {
    pub fn new(listener: UnixListener, path: std::path::PathBuf) -> ShmListener {
        ShmListener { listener, path, placed_reads: None, placed_writes: true }
    }
}

/// Ways to reach a target besides plain TCP, and who may use them all.
#[derive(Default)]
pub struct Transports {
    /// Same-host clients' shared memory.
    pub shm: Option<ShmListener>,
    /// An opened RDMA device: clients with RDMA set up queue pairs on their TCP connections.
    pub rdma: Option<Arc<dyn Verbs>>,
    /// The cluster's key: requests must carry a capability signed with it
    /// (`starckpt_proto::capability`). None serves every request.
    pub cluster_key: Option<ClusterKey>,
}

/// A target's RDMA device, its registrations and its admission control.
struct RdmaServing {
    /// The target's buffers: the I/O pool registered once, other memory per transfer.
    memory: MemoryMap,
    /// Transfers in flight on the device.
    admission: Semaphore,
}

/// What a connection handler needs besides its stream.
struct Served {
    store: Arc<ChunkStore>,
    limits: DataPlaneLimits,
    /// Payload bytes buffered across all connections.
    inflight_bytes: Arc<Semaphore>,
    /// Advertised in STAT: (this host's id, the shared-memory socket's path).
    shm: Option<(String, String)>,
    rdma: Option<RdmaServing>,
    /// [`ShmListener::placed_reads`], decided.
    placed_reads: bool,
    /// [`ShmListener::placed_writes`].
    placed_writes: bool,
    zero_copy: Arc<ZeroCopyStats>,
    /// Slot regions attached, in pages ([`DataPlaneLimits::max_shm_region_bytes`]).
    shm_regions: Arc<Semaphore>,
    /// [`Transports::cluster_key`].
    cluster_key: Option<ClusterKey>,
}

/// Serves the data plane on `listener` until `shutdown` resolves; then closes every connection
/// (requests already being served finish and are answered first) and returns.
pub async fn serve(
    listener: TcpListener,
    store: Arc<ChunkStore>,
    limits: DataPlaneLimits,
    shutdown: impl Future<Output = ()>,
) {
    serve_with_shm(listener, None, store, limits, shutdown).await
}

/// [`serve`], plus same-host clients on `shm`: they attach a shared-memory region and then speak
/// the same frames, with PUT payloads and GET results in the region's slots instead of the
/// stream. Both kinds of connection share one set of bounds.
pub async fn serve_with_shm(
    listener: TcpListener,
    shm: Option<ShmListener>,
    store: Arc<ChunkStore>,
    limits: DataPlaneLimits,
    shutdown: impl Future<Output = ()>,
) {
    serve_with(listener, Transports { shm, rdma: None, cluster_key: None }, store, limits, shutdown).await
}

/// [`serve`], plus the `transports` given: same-host shared memory, RDMA.
pub async fn serve_with(
    listener: TcpListener,
    transports: Transports,
    store: Arc<ChunkStore>,
    limits: DataPlaneLimits,
    shutdown: impl Future<Output = ()>,
) {
    let Transports { shm, rdma, cluster_key } = transports;
    if cluster_key.is_none() {
        tracing::warn!(
            "no cluster key: any peer that reaches this target may read, write, list and delete its chunks \
             (--cluster-key-file)"
        );
    }
    let connections = Arc::new(Semaphore::new(limits.max_connections));
    // Never below one maximal frame, or a maximal PUT would wait forever.
    let inflight_bytes = Arc::new(Semaphore::new(limits.max_inflight_bytes.max(frame::MAX_PAYLOAD_BYTES) as usize));
    let advertised = shm.as_ref().map(|s| (starckpt_proto::shm::host_id(), s.path.to_string_lossy().into_owned()));
    let rdma = rdma.map(|verbs| {
        let pool = store.buffer_pool().clone();
        info!(device = %verbs.name(), "serving RDMA");
        RdmaServing {
            memory: MemoryMap::new(verbs, Access::LOCAL, Box::new(move |at| pool.buffer_containing(at))),
            admission: Semaphore::new(limits.rdma_transfers.max(1)),
        }
    });
    let placed_reads =
        shm.as_ref().is_some_and(|s| s.placed_reads.unwrap_or_else(starckpt_proto::shm::shared_huge_pages));
    if shm.is_some() {
        if placed_reads {
            info!("serving shared memory: GETs are read from the device straight into the client's slot");
        } else {
            info!(
                "serving shared memory: GETs are copied into the client's slot (shared memory gets no huge pages \
                 here; `echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled` to read them straight \
                 there, README \"starckpt bench\")"
            );
        }
    }
    let zero_copy = Arc::new(ZeroCopyStats::default());
    let shm_pages = usize::try_from(limits.max_shm_region_bytes / SHM_PAGE as u64).unwrap_or(usize::MAX);
    let shm_regions = Arc::new(Semaphore::new(shm_pages.min(Semaphore::MAX_PERMITS)));
    let placed_writes = shm.as_ref().is_some_and(|s| s.placed_writes);
    let served = Arc::new(Served {
        store,
        limits,
        inflight_bytes,
        shm: advertised,
        rdma,
        placed_reads,
        placed_writes,
        zero_copy,
        shm_regions,
        cluster_key,
    });
    let stopping = CancellationToken::new();
    // If this future is dropped (aborted) rather than shut down, its connections still close.
    let _stop_on_drop = stopping.clone().drop_guard();
    let connection_tasks = TaskTracker::new();
    let peers = Arc::new(PeerConnections::default());
    let unix = shm.map(|s| s.listener);
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            _ = &mut shutdown => break,
            permit = Arc::clone(&connections).acquire_owned() => permit.expect("never closed"),
        };
        let accept_unix = async {
            match &unix {
                Some(listener) => listener.accept().await.map(|(stream, _)| stream),
                None => std::future::pending().await,
            }
        };
        let accepted = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => accepted.map(|(stream, peer)| Accepted::Tcp(stream, peer)),
            accepted = accept_unix => accepted.map(Accepted::Unix),
        };
        let accepted = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // EMFILE and friends: back off instead of spinning.
                warn!(%error, "data plane accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let peer_slot = match &accepted {
            Accepted::Tcp(_, peer) => match peers.take(peer.ip(), served.limits.max_connections_per_peer) {
                Some(slot) => Some(slot),
                None => {
                    metrics::counter!("starckpt_target_refused_total", "target" => served.store.target_id().unwrap_or_default().to_owned(), "reason" => "peer_connections").increment(1);
                    debug!(%peer, limit = served.limits.max_connections_per_peer, "closed a connection past the peer's limit");
                    continue;
                }
            },
            // Unix-socket peers are this host's processes, each attaching once per target.
            Accepted::Unix(_) => None,
        };
        let served = Arc::clone(&served);
        let stop = stopping.child_token();
        connection_tasks.spawn(async move {
            let _peer_slot = peer_slot;
            match accepted {
                Accepted::Tcp(stream, peer) => {
                    let _ = stream.set_nodelay(true);
                    let (reader, writer) = stream.into_split();
                    let frames = FrameWriter::tcp(writer, served.limits.zero_copy_send, Arc::clone(&served.zero_copy));
                    if let Err(reason) = serve_connection(reader, frames, None, served, stop).await {
                        info!(%peer, %reason, "closed data-plane connection");
                    }
                }
                Accepted::Unix(stream) => {
                    let attaching = attach(&stream, &served);
                    let attached = tokio::time::timeout(served.limits.frame_timeout, attaching).await;
                    match attached {
                        Ok(Ok(region)) => {
                            let (reader, writer) = stream.into_split();
                            let frames = FrameWriter::new(writer);
                            if let Err(reason) = serve_connection(reader, frames, Some(region), served, stop).await {
                                info!(%reason, "closed shared-memory data-plane connection");
                            }
                        }
                        Ok(Err(error)) => info!(%error, "refused a shared-memory attach"),
                        Err(_) => info!("no shared-memory attach within the frame timeout"),
                    }
                }
            }
            drop(permit);
        });
    }
    stopping.cancel();
    connection_tasks.close();
    connection_tasks.wait().await;
}

enum Accepted {
    Tcp(TcpStream, std::net::SocketAddr),
    Unix(tokio::net::UnixStream),
}

/// Connections open per peer address ([`DataPlaneLimits::max_connections_per_peer`]).
#[derive(Default)]
struct PeerConnections(Mutex<HashMap<std::net::IpAddr, usize>>);

/// One of a peer's connections, given back when dropped.
struct PeerSlot {
    peers: Arc<PeerConnections>,
    ip: std::net::IpAddr,
}

impl PeerConnections {
    /// A slot for another connection of `ip`, if it holds fewer than `max`.
    fn take(self: &Arc<Self>, ip: std::net::IpAddr, max: usize) -> Option<PeerSlot> {
        let mut open = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let count = open.entry(ip).or_insert(0);
        if *count >= max.max(1) {
            return None;
        }
        *count += 1;
        Some(PeerSlot { peers: Arc::clone(self), ip })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut open = self.peers.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = open.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// A region a client shared, split into slots, and its staging memory if it shared that too.
struct Slots {
    region: Region,
    attach: Attach,
    /// The client's staging region, read with `pread` (`shm::StagingFile`).
    staging: Option<StagingFile>,
    /// The staging region mapped read-only, when the client is trusted with placed writes
    /// ([`ShmListener::placed_writes`]).
    staging_mapped: Option<Arc<Region>>,
    /// A placed write on this connection failed to reach the device: its chunks are copied from
    /// then on (the device or filesystem may refuse to write from the client's memory where it
    /// writes from the target's).
    placed_failed: std::sync::atomic::AtomicBool,
    /// Whole-chunk GETs are read from the device straight into their slot ([`get_placed`]).
    placed_reads: bool,
    /// Its share of [`DataPlaneLimits::max_shm_region_bytes`], held while it is mapped.
    _room: tokio::sync::OwnedSemaphorePermit,
}

/// The unit [`DataPlaneLimits::max_shm_region_bytes`] is counted in.
const SHM_PAGE: usize = 4096;

impl Slots {
    /// The byte offset of 1-based slot `slot` if `len` bytes fit in it.
    fn offset(&self, slot: u32, len: u64) -> Result<usize, String> {
        if slot == 0 || slot > self.attach.slots {
            return Err(format!("slot {slot} is outside 1..={}", self.attach.slots));
        }
        if len > u64::from(self.attach.slot_bytes) {
            return Err(format!("{len} bytes do not fit a slot of {}", self.attach.slot_bytes));
        }
        Ok((slot - 1) as usize * self.attach.slot_bytes as usize)
    }

    /// Whether a staged chunk of `len` bytes at `offset` is written from where it lies: the
    /// client is trusted with it, the payload is stored as sent (the store decodes only its own
    /// memory), and it holds whole blocks from an aligned offset (O_DIRECT).
    fn placeable(&self, offset: usize, len: usize, codec: i32) -> bool {
        self.staging_mapped.is_some()
            && !self.placed_failed.load(std::sync::atomic::Ordering::Relaxed)
            && codec == Codec::None.to_wire()
            && offset.is_multiple_of(ALIGN)
            && len >= ALIGN
    }

    /// A chunk whose whole blocks are `len` bytes at `offset` of the mapped staging region
    /// ([`ChunkStore::placed_write`]); None if the region is not mapped (or the range is unfit).
    fn placed(&self, offset: usize, len: usize) -> Option<super::store::ChunkWrite> {
        let mapped = self.staging_mapped.as_ref()?;
        let body = len - len % ALIGN;
        if offset.checked_add(len)? > mapped.len() {
            return None;
        }
        let owner: Arc<dyn std::any::Any + Send + Sync> = Arc::clone(mapped) as _;
        // SAFETY: within the mapping (checked), which `owner` keeps mapped; nothing here makes
        // Rust references to it while the device reads it.
        let blocks = unsafe { ExternalBuf::new(mapped.base().add(offset), body, owner) }.ok()?;
        let hashed = Arc::clone(mapped);
        ChunkStore::placed_write(len, blocks, Box::new(move || hashed.hash_in_place(offset, body))).ok()
    }

    /// `range` of the staging region as (offset, length), if it lies within it and is no larger
    /// than a payload may be.
    fn staged(&self, range: &data::StagingRange) -> Result<(usize, usize), String> {
        let Some(staging) = &self.staging else {
            return Err("a staging range named on a connection without a staging region".into());
        };
        if range.length == 0 || range.length > u64::from(frame::MAX_PAYLOAD_BYTES) {
            return Err(format!("a staging range of {} bytes", range.length));
        }
        match range.offset.checked_add(range.length) {
            Some(end) if end <= staging.len() => Ok((range.offset as usize, range.length as usize)),
            _ => Err(format!(
                "{} bytes at {} are outside the {}-byte staging region",
                range.length,
                range.offset,
                staging.len()
            )),
        }
    }
}

/// The shared-memory handshake: the client's region, mapped, or why not.
async fn attach(stream: &tokio::net::UnixStream, served: &Served) -> std::io::Result<Arc<Slots>> {
    let (placed_reads, placed_writes) = (served.placed_reads, served.placed_writes);
    let attached = shm::recv_attach(stream).await?;
    let attach = attached.attach;
    // Before anything is mapped or counted against the shared budget.
    if let Err(refused) = check_capability(served, &attached.capability, Rights::READ) {
        // Best effort, as for busy: a closed connection is a refusal too.
        let _ = write_all_unix(stream, shm::ATTACH_UNAUTHORIZED).await;
        return Err(std::io::Error::other(format!("an attach without a capability it accepts: {refused}")));
    }
    if attach.region_bytes() as u64 > served.limits.max_shm_region_bytes {
        // Never room for it: refused (the connection closed), not busy.
        return Err(std::io::Error::other(format!(
            "a region of {} bytes exceeds max_shm_region_bytes",
            attach.region_bytes()
        )));
    }
    let pages = u32::try_from(attach.region_bytes().div_ceil(SHM_PAGE)).unwrap_or(u32::MAX);
    let Ok(room) = Arc::clone(&served.shm_regions).try_acquire_many_owned(pages) else {
        // Best effort: the client reads a closed connection as a refusal, and goes over TCP too.
        let _ = write_all_unix(stream, shm::ATTACH_BUSY).await;
        return Err(std::io::Error::other(format!(
            "no room for another {} bytes of slots (max_shm_region_bytes)",
            attach.region_bytes()
        )));
    };
    let region = Region::attach(attached.slots, attach.region_bytes())?;
    let staging = match attached.staging {
        Some(fd) => Some(StagingFile::attach(fd, attach.staging_bytes)?),
        None => None,
    };
    let staging_mapped = match &staging {
        Some(staging) if placed_writes && trusted_peer(stream) => match staging.map() {
            Ok(mapped) => Some(Arc::new(mapped)),
            Err(error) => {
                info!(%error, "could not map a client's staging region; its chunks are copied out of it");
                None
            }
        },
        _ => None,
    };
    write_all_unix(stream, shm::ATTACH_OK).await?;
    debug!(
        slots = attach.slots,
        slot_bytes = attach.slot_bytes,
        staging_bytes = attach.staging_bytes,
        "shared-memory client attached"
    );
    let placed_failed = std::sync::atomic::AtomicBool::new(false);
    let slots = Arc::new(Slots { region, attach, staging, staging_mapped, placed_failed, placed_reads, _room: room });
    if placed_reads {
        // Huge pages for the slots where this mapping faults them in first (the device's reads):
        // a read into them is a few contiguous segments rather than one per 4 KiB page. And
        // faulted in now, off the runtime, rather than by the first read into each slot on the
        // ring's thread (which would stall every other client's I/O meanwhile). The memory is
        // the client's region, which it sized (within the attach's limits).
        let mapped = Arc::clone(&slots);
        let populated = tokio::task::spawn_blocking(move || {
            let (at, len) = (mapped.region.base().cast::<libc::c_void>(), mapped.region.len());
            // SAFETY: advice on exactly this mapping, which `mapped` keeps mapped.
            unsafe {
                libc::madvise(at, len, libc::MADV_HUGEPAGE);
                libc::madvise(at, len, libc::MADV_POPULATE_WRITE)
            }
        })
        .await;
        if !matches!(populated, Ok(0)) {
            debug!("could not fault the client's slots in at attach; the first reads into them will");
        }
    }
    Ok(slots)
}

/// Writes all of `bytes` to `stream` (which is still whole: not split into halves yet).
async fn write_all_unix(stream: &tokio::net::UnixStream, bytes: &[u8]) -> std::io::Result<()> {
    let mut written = 0;
    while written < bytes.len() {
        stream.writable().await?;
        match stream.try_write(&bytes[written..]) {
            Ok(n) => written += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Whether the process at the other end of `stream` could rewrite this target's chunk files
/// itself, so its staged chunks need no protective copy ([`ShmListener::placed_writes`]): it runs
/// as this one's effective user or as root, and sees the same files (same mount namespace; a
/// container's root does not, and may not write them).
fn trusted_peer(stream: &tokio::net::UnixStream) -> bool {
    let Ok(peer) = stream.peer_cred() else { return false };
    // SAFETY: geteuid cannot fail and touches no memory.
    let own = unsafe { libc::geteuid() };
    // A peer in a pid namespace this one cannot see has no pid here (None, or 0).
    let peer_pid = peer.pid().filter(|&pid| pid > 0);
    trusted_uid(peer.uid(), own) && peer_pid.is_some_and(|pid| same_mount_namespace(pid as u32))
}

/// A peer running as `peer` may write the files of a target running as `own`.
fn trusted_uid(peer: u32, own: u32) -> bool {
    peer == 0 || peer == own
}

/// Whether process `pid` sees the files this one sees. Not told (gone, or its namespace hidden
/// from this process): no.
fn same_mount_namespace(pid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    let namespace = |path: &str| std::fs::metadata(path).map(|m| (m.dev(), m.ino())).ok();
    namespace("/proc/self/ns/mnt").is_some_and(|own| namespace(&format!("/proc/{pid}/ns/mnt")) == Some(own))
}

async fn serve_connection<R, W>(
    mut reader: R,
    writer: FrameWriter<W>,
    slots: Option<Arc<Slots>>,
    served: Arc<Served>,
    stop: CancellationToken,
) -> Result<(), String>
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let limits = &served.limits;
    let (responses, outgoing) = mpsc::channel::<Outgoing>(limits.max_requests_per_connection);
    let writer_failed = CancellationToken::new();
    let writer_task =
        tokio::spawn(write_loop(writer, outgoing, limits.frame_timeout, writer_failed.clone(), Arc::clone(&served)));
    let requests = Arc::new(Semaphore::new(limits.max_requests_per_connection));
    let budget = limits
        .max_connection_inflight_bytes
        .clamp(frame::MAX_PAYLOAD_BYTES, limits.max_inflight_bytes.max(frame::MAX_PAYLOAD_BYTES));
    let budget = Arc::new(Semaphore::new(budget as usize));
    // Set up by OP_CONNECT; lives as long as the connection.
    let mut rdma: Option<Arc<QpDriver>> = None;

    let result = loop {
        let head = tokio::select! {
            _ = stop.cancelled() => break Ok(()),
            _ = writer_failed.cancelled() => break Err("its responses could not be written".into()),
            head = tokio::time::timeout(limits.idle_timeout, frame::read_fixed_header(&mut reader)) => head,
        };
        let Ok(head) = head else {
            debug!(idle = ?limits.idle_timeout, "closing an idle connection");
            break Ok(());
        };
        // The rest of the header within a frame's time: a peer trickling a large header does
        // not hold its connection slot (and the header's buffer) for the idle timeout.
        let head = match head {
            Ok(header) => tokio::select! {
                _ = stop.cancelled() => break Ok(()),
                rest = tokio::time::timeout(limits.frame_timeout, frame::read_message_header(&mut reader, &header)) => {
                    rest.map(|prost_header| prost_header.map(|prost_header| (header, prost_header)))
                }
            },
            Err(error) => Ok(Err(error)),
        };
        let (header, prost_header) = match head {
            Ok(Ok(head)) => head,
            Ok(Err(ReadFrameError::Closed)) => break Ok(()),
            Ok(Err(ReadFrameError::Frame(error))) => break Err(format!("protocol error: {error}")),
            Ok(Err(ReadFrameError::Io(error))) => break Err(format!("read: {error}")),
            Err(_) => break Err(format!("frame header not received within {:?}", limits.frame_timeout)),
        };
        // From here on the request is served; its latency ends when its response is written.
        let started = Instant::now();
        if header.opcode.is_response() {
            break Err(format!("protocol error: client sent response opcode {:?}", header.opcode));
        }
        if header.opcode != Opcode::Put && header.payload_len != 0 {
            break Err(format!("protocol error: {:?} carries a payload", header.opcode));
        }
        if header.opcode == Opcode::Connect
            && let Ok(request) = data::ConnectRequest::decode(prost_header.clone())
            && let Some(probe) = request.probe
        {
            // A request like any other: bounded by the connection's request limit.
            let permit = Arc::clone(&requests).acquire_owned().await.expect("never closed");
            let (served, rdma, responses) = (Arc::clone(&served), rdma.clone(), responses.clone());
            tokio::spawn(async move {
                let checked = check_auth(&served, &request.auth, Rights::READ);
                let (response, payload) = match checked {
                    Err(response) => (response, None),
                    Ok(()) => match echo_probe(&served, rdma.as_deref(), &probe).await {
                        Ok(bytes) => (data::Response::default(), Some(bytes)),
                        Err(response) => (response, None),
                    },
                };
                let _ = responses.send(reply(header, started, response, payload)).await;
                drop(permit);
            });
            continue;
        }
        if header.opcode == Opcode::Connect {
            // Queue-pair setup may block (address resolution on RoCE): off the runtime.
            let (setup, already) = (Arc::clone(&served), rdma.is_some());
            let (response, driver) = tokio::task::spawn_blocking(move || connect_rdma(&setup, prost_header, already))
                .await
                .unwrap_or_else(|_| (error_response(ErrorCode::Internal, "RDMA setup panicked".into()), None));
            if driver.is_some() {
                rdma = driver;
            }
            if responses.send(reply(header, started, response, None)).await.is_err() {
                break Ok(());
            }
            continue;
        }
        let permit = Arc::clone(&requests).acquire_owned().await.expect("never closed");
        let served = Arc::clone(&served);
        let responses = responses.clone();
        if header.opcode == Opcode::Put {
            let request = match decode_for::<data::PutRequest>(&served, prost_header) {
                Ok(request) => request,
                Err(refused) => {
                    // A PUT refused for its header (undecodable, no capability): its payload is
                    // read past, never buffered or charged to the budget other requests share.
                    let mut payload = (&mut reader).take(u64::from(header.payload_len));
                    let mut sink = tokio::io::sink();
                    match tokio::time::timeout(limits.frame_timeout, tokio::io::copy(&mut payload, &mut sink)).await {
                        Ok(Ok(n)) if n == u64::from(header.payload_len) => {}
                        Ok(Ok(_)) => break Err("payload cut short".into()),
                        Ok(Err(error)) => break Err(format!("read payload: {error}")),
                        Err(_) => break Err(format!("payload not received within {:?}", limits.frame_timeout)),
                    }
                    let _ = responses.send(reply(header, started, refused, None)).await;
                    drop(permit);
                    continue;
                }
            };
            // Where the payload is: after the frame, in a slot of the shared region, or in the
            // client's registered memory.
            let mut source = PayloadSource::of(&request, slots.as_deref(), rdma.as_ref());
            if !matches!(source, PayloadSource::Frame) && header.payload_len != 0 {
                break Err("protocol error: a PUT with its payload both in the frame and elsewhere".into());
            }
            let payload_len = match &source {
                PayloadSource::Slot(_, len) | PayloadSource::Staging(_, len) | PayloadSource::Placed(_, len) => *len,
                PayloadSource::Rdma(remote) => remote.len as usize,
                PayloadSource::Frame | PayloadSource::Bad(_) => header.payload_len as usize,
            };
            let bytes = u32::try_from(payload_len).unwrap_or(u32::MAX);
            let Some(bytes_permit) = Charge::take(&budget, &served, bytes).await else {
                break Err("shutting down".into());
            };
            let placed = match (&source, slots.as_deref()) {
                (PayloadSource::Placed(offset, len), Some(slots)) => slots.placed(*offset, *len),
                _ => None,
            };
            let mut chunk = match placed {
                Some(chunk) => chunk,
                None => {
                    if let PayloadSource::Placed(offset, len) = source {
                        source = PayloadSource::Staging(offset, len);
                    }
                    served.store.write_buffer(payload_len).await
                }
            };
            if matches!(source, PayloadSource::Frame | PayloadSource::Bad(_)) {
                let read = tokio::time::timeout(limits.frame_timeout, reader.read_exact(chunk.data_mut())).await;
                match read {
                    Ok(Ok(_)) => {}
                    Ok(Err(error)) => break Err(format!("read payload: {error}")),
                    Err(_) => break Err(format!("payload not received within {:?}", limits.frame_timeout)),
                }
            }
            let is_placed = matches!(source, PayloadSource::Placed(..));
            let (slots, rdma) = (slots.clone(), rdma.clone());
            tokio::spawn(async move {
                let response = match fetch(&served, source, slots.clone(), rdma.as_deref(), chunk).await {
                    Ok(chunk) => {
                        let response = put(&served.store, request, chunk).await;
                        if is_placed
                            && response.code == ErrorCode::Internal as i32
                            && let Some(slots) = &slots
                            && !slots.placed_failed.swap(true, std::sync::atomic::Ordering::Relaxed)
                        {
                            warn!(
                                error = %response.message,
                                "a write straight from a client's staging memory failed; this connection's \
                                 chunks are copied from now on"
                            );
                        }
                        response
                    }
                    Err(response) => response,
                };
                drop(bytes_permit);
                let _ = responses.send(reply(header, started, response, None)).await;
                drop(permit);
            });
        } else {
            let (slots, rdma, budget) = (slots.clone(), rdma.clone(), Arc::clone(&budget));
            tokio::spawn(async move {
                if header.opcode == Opcode::Get
                    && let Some(slots) = &slots
                    && let Ok(request) = data::GetRequest::decode(prost_header.clone())
                    && request.shm_slot != 0
                    && slots.placed_reads
                    && let Some(response) = get_placed(&served, slots, &request).await
                {
                    let _ = responses.send(reply(header, started, response, None)).await;
                    drop(permit);
                    return;
                }
                // A GET's response is charged to the same in-flight byte budget as PUT payloads,
                // from before the chunk is read until it has been written to the socket.
                let mut charge = None;
                let mut get_slot = 0;
                let mut get_remote = None;
                if header.opcode == Opcode::Get
                    && let Ok(request) = data::GetRequest::decode(prost_header.clone())
                    && check_auth(&served, &request.auth, Rights::READ).is_ok()
                    && let Ok(hash) = ChunkHash::try_from(&request.hash[..])
                {
                    get_slot = request.shm_slot;
                    get_remote = request.rdma;
                    if let Some(len) = served.store.file_len(&hash).await {
                        charge = Charge::take(&budget, &served, u32::try_from(len).unwrap_or(u32::MAX)).await;
                    }
                }
                let (mut response, mut payload) = dispatch(&served, header, prost_header).await;
                // A decoded chunk can be larger than its file: charge what is really held (never
                // holding one charge while waiting for another).
                let charged = charge.as_ref().map_or(0, Charge::bytes);
                if let Some(bytes) = &payload
                    && bytes.len() > charged
                {
                    drop(charge.take());
                    charge = Charge::take(&budget, &served, u32::try_from(bytes.len()).unwrap_or(u32::MAX)).await;
                }
                if get_slot != 0 && response.code == ErrorCode::Ok as i32 {
                    let bytes = payload.take().unwrap_or_default();
                    match &slots {
                        None => {
                            let reason = "a slot named on a connection without shared memory";
                            response = error_response(ErrorCode::BadRequest, reason.into());
                        }
                        // Too big for the slot: sent in the frame instead.
                        Some(slots) if bytes.len() > slots.attach.slot_bytes as usize => payload = Some(bytes),
                        Some(slots) => match slots.offset(get_slot, bytes.len() as u64) {
                            Ok(offset) => match slots.region.write_at(offset, &bytes) {
                                Ok(()) => response.shm_length = bytes.len() as u64,
                                Err(error) => response = error_response(ErrorCode::BadRequest, error.to_string()),
                            },
                            Err(reason) => response = error_response(ErrorCode::BadRequest, reason),
                        },
                    }
                }
                if let Some(remote) = get_remote
                    && response.code == ErrorCode::Ok as i32
                    && get_slot == 0
                {
                    let bytes = payload.take().unwrap_or_default();
                    match RemoteBuffer::from_wire(&remote) {
                        Err(reason) => response = error_response(ErrorCode::BadRequest, reason),
                        // Empty, or too big for the client's buffer: sent in the frame instead.
                        Ok(remote) if bytes.is_empty() || bytes.len() > remote.len as usize => payload = Some(bytes),
                        Ok(remote) => match deliver(&served, rdma.as_deref(), remote, bytes).await {
                            Ok(written) => response.rdma_length = written,
                            Err(Untransferred { owner: Some(bytes), .. }) => payload = Some(bytes),
                            Err(Untransferred { response: failed, .. }) => response = failed,
                        },
                    }
                }
                let mut message = reply(header, started, response, payload);
                message.charge = charge;
                let _ = responses.send(message).await;
                drop(permit);
            });
        }
    };
    drop(responses);
    let _ = writer_task.await;
    result
}

/// A whole-chunk GET from a client on this host, read from the device straight into the slot it
/// named: no copy on the target, and no bytes held here (so nothing charged to the in-flight
/// budget). None when the GET takes the ordinary path: a range, a request that path answers with
/// an error, a chunk larger than the slot, a compressed one the client does not decode, or an I/O
/// error (the device may refuse to read into the client's memory where it reads into the
/// target's: a memory limit on pinning it, a filesystem without O_DIRECT into shared memory).
async fn get_placed(served: &Served, slots: &Arc<Slots>, request: &data::GetRequest) -> Option<data::Response> {
    let store = &served.store;
    if request.offset != 0 || request.length != 0 || check_auth(served, &request.auth, Rights::READ).is_err() {
        return None;
    }
    let hash = ChunkHash::try_from(&request.hash[..]).ok()?;
    let offset = slots.offset(request.shm_slot, 0).ok()?;
    let len = slots.attach.slot_bytes as usize;
    if offset.checked_add(len)? > slots.region.len() {
        return None;
    }
    let owner: Arc<dyn std::any::Any + Send + Sync> = Arc::clone(slots) as _;
    // SAFETY: the slot lies within the mapping (checked); `owner` keeps the mapping (its `Slots`)
    // alive until the engine drops the buffer, and the region is only ever accessed by raw copies.
    let dest = unsafe { ExternalBuf::new(slots.region.base().add(offset), len, owner) }.ok()?;
    match store.read_placed(hash, dest).await {
        Ok(Some(placed)) if placed.codec == Codec::None || request.accept_encoded => Some(data::Response {
            chunk_length_bytes: placed.length,
            codec: placed.codec.to_wire(),
            shm_length: placed.stored_len,
            ..Default::default()
        }),
        Ok(_) => None,
        Err(error @ ChunkStoreError::Io { .. }) => {
            debug!(%error, "a GET read into the client's slot failed; reading it into the target's buffer");
            None
        }
        Err(error) => Some(store_error(error)),
    }
}

/// Where a PUT's payload is.
enum PayloadSource {
    /// After the frame, on the stream.
    Frame,
    /// In a slot of the connection's shared region: (offset, length).
    Slot(usize, usize),
    /// In the client's staging region: (offset, length).
    Staging(usize, usize),
    /// In the client's staging region, written to the device from there ([`Slots::placed`]).
    Placed(usize, usize),
    /// In the client's registered memory, for an RDMA READ.
    Rdma(RemoteBuffer),
    /// Named wrongly (the frame's payload, if any, is read and dropped).
    Bad(String),
}

impl PayloadSource {
    fn of(request: &data::PutRequest, slots: Option<&Slots>, rdma: Option<&Arc<QpDriver>>) -> PayloadSource {
        if let Some(range) = &request.staging {
            return match (request.shm_slot, &request.rdma, slots) {
                (0, None, Some(slots)) => match slots.staged(range) {
                    Ok((offset, len)) if slots.placeable(offset, len, request.codec) => {
                        PayloadSource::Placed(offset, len)
                    }
                    Ok((offset, len)) => PayloadSource::Staging(offset, len),
                    Err(reason) => PayloadSource::Bad(reason),
                },
                (0, None, None) => {
                    PayloadSource::Bad("a staging range named on a connection without shared memory".into())
                }
                _ => PayloadSource::Bad("a PUT names a staging range and another place for its payload".into()),
            };
        }
        match (request.shm_slot, &request.rdma) {
            (0, None) => PayloadSource::Frame,
            (slot, None) => match slots {
                Some(slots) => match slots.offset(slot, request.shm_length) {
                    Ok(offset) => PayloadSource::Slot(offset, request.shm_length as usize),
                    Err(reason) => PayloadSource::Bad(reason),
                },
                None => PayloadSource::Bad("a slot named on a connection without shared memory".into()),
            },
            (0, Some(remote)) => match (rdma, RemoteBuffer::from_wire(remote)) {
                (None, _) => PayloadSource::Bad("a remote buffer named on a connection without RDMA".into()),
                (Some(_), Ok(remote)) => PayloadSource::Rdma(remote),
                (Some(_), Err(reason)) => PayloadSource::Bad(reason),
            },
            (_, Some(_)) => PayloadSource::Bad("a PUT names both a slot and a remote buffer".into()),
        }
    }
}

/// Brings a PUT's payload into `chunk` (from the slot or the client's memory; a payload in the
/// frame is there already). Copied out of the client's memory before it is verified: what is
/// checked is what is stored, whatever the client does to its memory meanwhile. A placed write's
/// whole blocks stay in the client's memory (only its last partial block is copied): the store
/// checks them there once the device has written them (`ChunkStore::placed_write`).
async fn fetch(
    served: &Served,
    source: PayloadSource,
    slots: Option<Arc<Slots>>,
    rdma: Option<&QpDriver>,
    mut chunk: super::store::ChunkWrite,
) -> Result<super::store::ChunkWrite, data::Response> {
    match (source, slots, rdma) {
        (PayloadSource::Frame, _, _) => Ok(chunk),
        (PayloadSource::Bad(reason), _, _) => Err(error_response(ErrorCode::BadRequest, reason)),
        (PayloadSource::Slot(offset, _), Some(slots), _) => {
            copy_hashed(chunk, move |data| slots.region.read_at_hashed(offset, data)).await
        }
        // The whole blocks stay where they are (verified once the device has written them); the
        // last partial block, if any, is copied.
        (PayloadSource::Placed(offset, len), Some(slots), _) => {
            let tail = chunk.data_mut();
            let copied = match (&slots.staging_mapped, tail.is_empty()) {
                (_, true) => Ok(()),
                (Some(mapped), false) => mapped.read_at(offset + len - tail.len(), tail),
                (None, false) => Err(std::io::Error::other("no mapped staging region")),
            };
            copied.map(|()| chunk).map_err(|error| error_response(ErrorCode::BadRequest, error.to_string()))
        }
        (PayloadSource::Staging(offset, _), Some(slots), _) => {
            copy_hashed(chunk, move |data| match &slots.staging {
                Some(staging) => staging.read_at_hashed(offset as u64, data),
                None => Err(std::io::Error::other("no staging region")),
            })
            .await
        }
        (PayloadSource::Rdma(remote), _, Some(driver)) => {
            let data = chunk.data_mut();
            let (at, len) = (data.as_mut_ptr() as usize, data.len());
            rdma_transfer(served, driver, Op::Read, at, len, remote, chunk).await.map_err(|failed| failed.response)
        }
        _ => Err(error_response(ErrorCode::Internal, "the payload's source went away".into())),
    }
}

/// Copies a PUT's payload out of shared memory into `chunk` with `copy`, which hashes it as it
/// goes (`read_at_hashed`: the hash reads the copy from cache, and the store's verification only
/// compares), off the runtime's workers.
async fn copy_hashed(
    mut chunk: super::store::ChunkWrite,
    copy: impl FnOnce(&mut [u8]) -> std::io::Result<ChunkHash> + Send + 'static,
) -> Result<super::store::ChunkWrite, data::Response> {
    let copied = tokio::task::spawn_blocking(move || chunk.fill_hashed(copy).map(|()| chunk)).await;
    match copied {
        Ok(Ok(chunk)) => Ok(chunk),
        Ok(Err(error)) => Err(error_response(ErrorCode::BadRequest, error.to_string())),
        Err(error) => Err(error_response(ErrorCode::Internal, format!("copying a payload: {error}"))),
    }
}

/// RDMA-WRITEs a GET's bytes into the client's buffer; returns how many were written, or the
/// failure (with the bytes when they never reached the device: they go in the frame instead).
async fn deliver(
    served: &Served,
    rdma: Option<&QpDriver>,
    remote: RemoteBuffer,
    bytes: Bytes,
) -> Result<u64, Untransferred<Bytes>> {
    let Some(driver) = rdma else {
        let response =
            error_response(ErrorCode::BadRequest, "a remote buffer named on a connection without RDMA".into());
        return Err(Untransferred { owner: None, response });
    };
    let (at, len) = (bytes.as_ptr() as usize, bytes.len());
    rdma_transfer(served, driver, Op::Write, at, len, remote, bytes).await?;
    Ok(len as u64)
}

/// One RDMA transfer between `len` bytes at address `at` (memory `owner` keeps alive) and the
/// client's buffer, admitted by the device's bound. `owner` comes back when the device is done
/// with it.
async fn rdma_transfer<K: Send + 'static>(
    served: &Served,
    driver: &QpDriver,
    op: Op,
    at: usize,
    len: usize,
    remote: RemoteBuffer,
    owner: K,
) -> Result<K, Untransferred<K>> {
    let failed = |message: String| error_response(ErrorCode::TransferFailed, message);
    let Some(rdma) = &served.rdma else {
        return Err(Untransferred { owner: Some(owner), response: failed("RDMA is not served".into()) });
    };
    let Ok(_admitted) = rdma.admission.acquire().await else {
        return Err(Untransferred { owner: Some(owner), response: failed("closing".into()) });
    };
    // SAFETY: `owner` holds this memory; it travels with the registration into the driver, which
    // gives both back (registration first, dropped before the memory) only once the device is done.
    let registered = match unsafe { rdma.memory.register(at as *const u8, len) } {
        Ok(registered) => registered,
        Err(error) => {
            // A memlock limit, say: the bytes are still here (a GET sends them in the frame).
            warn!(%error, "RDMA registration failed");
            return Err(Untransferred { owner: Some(owner), response: failed(format!("RDMA registration: {error}")) });
        }
    };
    let request = WorkRequest {
        id: 0,
        op,
        local_addr: at as u64,
        lkey: registered.region().lkey(),
        len: len as u32,
        remote_addr: remote.addr,
        rkey: remote.rkey,
    };
    match driver.execute(request, (registered, owner)).await {
        Ok((registered, owner)) => {
            drop(registered);
            Ok(owner)
        }
        Err(error) => {
            debug!(%error, ?op, "RDMA transfer failed");
            Err(Untransferred { owner: None, response: failed(format!("RDMA {op:?} of {len} bytes: {error}")) })
        }
    }
}

/// Most bytes an RDMA probe (ConnectRequest.probe) reads.
const PROBE_BYTES: u32 = 64;

/// OP_CONNECT with a probe: RDMA-READs the client's probe bytes and returns them.
async fn echo_probe(
    served: &Served,
    rdma: Option<&QpDriver>,
    probe: &data::RemoteBuffer,
) -> Result<Bytes, data::Response> {
    let remote = RemoteBuffer::from_wire(probe).map_err(|reason| error_response(ErrorCode::BadRequest, reason))?;
    if remote.len > PROBE_BYTES {
        return Err(error_response(
            ErrorCode::BadRequest,
            format!("a probe of {} bytes (at most {PROBE_BYTES})", remote.len),
        ));
    }
    let Some(driver) = rdma else {
        return Err(error_response(ErrorCode::BadRequest, "a probe on a connection without RDMA".into()));
    };
    let mut landing = starckpt_proto::buf::AlignedBuf::new(remote.len as usize);
    landing.set_len(remote.len as usize);
    let at = landing.as_mut_ptr() as usize;
    let landing = rdma_transfer(served, driver, Op::Read, at, remote.len as usize, remote, landing)
        .await
        .map_err(|failed| failed.response)?;
    Ok(Bytes::copy_from_slice(landing.as_ref()))
}

/// A transfer that did not happen: the TRANSFER_FAILED answer, and the memory back if the device
/// never had it.
struct Untransferred<K> {
    owner: Option<K>,
    response: data::Response,
}

/// OP_CONNECT: a queue pair for this connection (`already`: it has one), connected to the
/// client's; the response, and the queue pair's driver when one was set up.
fn connect_rdma(served: &Served, prost_header: Bytes, already: bool) -> (data::Response, Option<Arc<QpDriver>>) {
    let refuse = |reason: String| (error_response(ErrorCode::BadRequest, reason), None);
    let request: data::ConnectRequest = match decode_for(served, prost_header) {
        Ok(request) => request,
        Err(response) => return (response, None),
    };
    let Some(rdma) = &served.rdma else {
        return refuse("this target serves no RDMA".into());
    };
    if already {
        return refuse("RDMA is already set up on this connection".into());
    }
    let remote = match request.endpoint.as_ref().map(endpoint_from_wire) {
        Some(Ok(remote)) => remote,
        Some(Err(reason)) => return refuse(format!("client endpoint: {reason}")),
        None => return refuse("no client endpoint".into()),
    };
    let depth = served.limits.max_requests_per_connection as u32;
    // The client never reads or writes the target's memory: its queue pair grants nothing.
    let queue_pair =
        rdma.memory.verbs().create_qp(depth, Access::LOCAL).and_then(|qp| qp.connect(&remote).map(|()| qp));
    match queue_pair {
        Ok(qp) => {
            let endpoint = qp.endpoint();
            let driver = QpDriver::new(qp, depth, served.limits.frame_timeout);
            debug!(qp = endpoint.qp_num, client_qp = remote.qp_num, "RDMA connection set up");
            (data::Response { rdma_endpoint: Some(endpoint_to_wire(&endpoint)), ..Default::default() }, Some(driver))
        }
        Err(error) => (error_response(ErrorCode::TransferFailed, format!("RDMA setup: {error}")), None),
    }
}

/// Sends responses in order. A GET payload sent zero-copy stays held (its pool buffer out of the
/// pool) until the kernel's notification, taken here between frames.
async fn write_loop<W: AsyncWrite + Unpin>(
    writer: FrameWriter<W>,
    mut outgoing: mpsc::Receiver<Outgoing>,
    timeout: Duration,
    failed: CancellationToken,
    served: Arc<Served>,
) {
    // A client that stops reading must not pin buffers and in-flight bytes forever.
    let mut writer = writer.with_timeout(timeout);
    let finished = loop {
        let message = match writer.next(&mut outgoing).await {
            Ok(Some(message)) => message,
            Ok(None) => break true,
            Err(error) => {
                warn!(%error, "zero-copy notifications failed; closing the connection");
                break false;
            }
        };
        let payload: Vec<Bytes> = message.payload.iter().cloned().collect();
        let written = writer.write_frame(message.opcode, message.request_id, &message.header, &payload).await;
        drop(message.charge);
        match written {
            Ok(()) => {
                let target = served.store.target_id().unwrap_or_default();
                crate::telemetry::answered(target, message.opcode, message.code, message.started);
            }
            Err(error) if error.kind() == std::io::ErrorKind::TimedOut => {
                info!("client did not read a response within {timeout:?}; closing the connection");
                break false;
            }
            Err(error) => {
                debug!(%error, "data-plane write failed");
                break false;
            }
        }
        // Flush when nothing else is queued, so responses are batched under load but never delayed.
        if outgoing.is_empty() && writer.flush().await.is_err() {
            break false;
        }
    };
    if finished {
        let _ = writer.flush().await;
        return;
    }
    // The connection is done for, but the requests being served may still read the client's
    // memory (a staged chunk, in place): the stream stays open until they end (a client lets go
    // of memory it lent only once the connection is closed), their answers dropped, and no new
    // request is read.
    failed.cancel();
    while outgoing.recv().await.is_some() {}
}

fn reply(header: FrameHeader, started: Instant, response: data::Response, payload: Option<Bytes>) -> Outgoing {
    Outgoing {
        opcode: header.opcode.response(),
        request_id: header.request_id,
        header: response.encode_to_vec(),
        payload,
        charge: None,
        started,
        code: response.code,
    }
}

fn error_response(code: ErrorCode, message: String) -> data::Response {
    data::Response { code: code as i32, message, ..Default::default() }
}

fn store_error(error: ChunkStoreError) -> data::Response {
    let code = match &error {
        ChunkStoreError::HashMismatch { .. } | ChunkStoreError::Undecodable { .. } => ErrorCode::HashMismatch,
        ChunkStoreError::NotFound { .. } => ErrorCode::NotFound,
        ChunkStoreError::Corrupt { .. } => ErrorCode::Corrupt,
        ChunkStoreError::BadRange { .. } => ErrorCode::BadRequest,
        ChunkStoreError::NoSpace { .. } | ChunkStoreError::Full { .. } => ErrorCode::NoSpace,
        ChunkStoreError::Io { .. } => ErrorCode::Internal,
    };
    if code == ErrorCode::Internal || code == ErrorCode::Corrupt {
        warn!(%error, "chunk store error");
    }
    error_response(code, error.to_string())
}

/// Decodes a request header, or the BAD_REQUEST response that says why it could not be decoded.
fn decode<M: Message + Default>(prost_header: Bytes) -> Result<M, data::Response> {
    M::decode(prost_header).map_err(|e| {
        let name = std::any::type_name::<M>().rsplit("::").next().unwrap_or("request");
        error_response(ErrorCode::BadRequest, format!("undecodable {name}: {e}"))
    })
}

/// Requests that carry an `Auth`, and the right each needs (`starckpt_proto::capability`).
trait Addressed: Message + Default {
    const NEEDS: Rights;
    fn auth(&self) -> &Option<data::Auth>;
}

macro_rules! addressed {
    ($($request:ty => $needs:expr),*) => {
        $(impl Addressed for $request {
            const NEEDS: Rights = $needs;
            fn auth(&self) -> &Option<data::Auth> {
                &self.auth
            }
        })*
    };
}
addressed!(
    data::PutRequest => Rights::WRITE,
    data::GetRequest => Rights::READ,
    data::HasRequest => Rights::READ,
    data::DeleteRequest => Rights::ADMIN,
    data::ListRequest => Rights::ADMIN,
    data::StatRequest => Rights::READ,
    data::ConnectRequest => Rights::READ
);

/// Decodes a request, refusing one meant for another target or without the capability it needs.
fn decode_for<M: Addressed>(served: &Served, prost_header: Bytes) -> Result<M, data::Response> {
    let request: M = decode(prost_header)?;
    check_auth(served, request.auth(), M::NEEDS)?;
    Ok(request)
}

/// Refuses a request meant for another target, or, where the cluster has a key, one whose
/// capability does not grant `needs`.
fn check_auth(served: &Served, auth: &Option<data::Auth>, needs: Rights) -> Result<(), data::Response> {
    check_target(&served.store, auth)?;
    let capability = auth.as_ref().map_or(&[][..], |a| &a.capability[..]);
    check_capability(served, capability, needs).map_err(|refused| error_response(ErrorCode::Unauthorized, refused))
}

/// Where the cluster has a key, refuses a `capability` that does not grant `needs` on this
/// target (counted), saying why.
fn check_capability(served: &Served, capability: &[u8], needs: Rights) -> Result<(), String> {
    let Some(key) = &served.cluster_key else { return Ok(()) };
    key.verify(capability, needs, served.store.target_id(), std::time::SystemTime::now()).map_err(|refused| {
        metrics::counter!("starckpt_target_refused_total", "target" => served.store.target_id().unwrap_or_default().to_owned(), "reason" => "unauthorized").increment(1);
        refused.to_string()
    })
}

/// Refuses a request meant for another target (see `Auth.target_id` in dataplane.proto).
fn check_target(store: &ChunkStore, auth: &Option<data::Auth>) -> Result<(), data::Response> {
    match (auth.as_ref().map(|a| a.target_id.as_str()), store.target_id()) {
        (Some(wanted), Some(mine)) if !wanted.is_empty() && wanted != mine => {
            // Named back only when it can be a target id: the answer is no echo of any request.
            let wanted = if validate_target_id(wanted).is_ok() { wanted } else { "the target asked for" };
            Err(error_response(
                ErrorCode::WrongTarget,
                format!("this is target {mine}, not {wanted} (the address now belongs to another target)"),
            ))
        }
        _ => Ok(()),
    }
}

fn parse_hashes(hashes: &[Bytes]) -> Result<Vec<ChunkHash>, data::Response> {
    if hashes.len() > MAX_BATCH_HASHES {
        return Err(error_response(
            ErrorCode::BadRequest,
            format!("{} hashes exceed the batch limit of {MAX_BATCH_HASHES}", hashes.len()),
        ));
    }
    hashes
        .iter()
        .map(|h| ChunkHash::try_from(&h[..]).map_err(|e| error_response(ErrorCode::BadRequest, e.to_string())))
        .collect()
}

async fn put(store: &ChunkStore, request: data::PutRequest, mut chunk: super::store::ChunkWrite) -> data::Response {
    let hash = match ChunkHash::try_from(&request.hash[..]) {
        Ok(hash) => hash,
        Err(error) => return error_response(ErrorCode::BadRequest, error.to_string()),
    };
    // A tenant's address must be its key's hash of the content hash; the payload is then checked
    // against the content hash (starckpt_proto::address).
    let name = match ChunkName::checked(hash, &request.chunk_key, &request.content_hash) {
        Ok(name) => name,
        Err(reason) => return error_response(ErrorCode::HashMismatch, reason),
    };
    if chunk.is_empty() {
        return error_response(ErrorCode::BadRequest, "empty chunk".into());
    }
    match Codec::from_wire(request.codec) {
        Ok(Codec::None) => {}
        Ok(codec) => chunk.set_codec(codec, request.length_bytes),
        Err(error) => return error_response(ErrorCode::BadRequest, error.to_string()),
    }
    let stored =
        if request.repair { store.repair_named(&name, chunk).await } else { store.put_named(&name, chunk).await };
    if let (Ok(_), Err(injected)) = (&stored, starckpt_client::faults::point("target.put.ack")) {
        return error_response(ErrorCode::Internal, injected.to_string());
    }
    match stored {
        Ok(outcome) => data::Response { already_present: outcome == PutOutcome::AlreadyPresent, ..Default::default() },
        Err(error) => store_error(error),
    }
}

async fn dispatch(served: &Served, header: FrameHeader, prost_header: Bytes) -> (data::Response, Option<Bytes>) {
    let store = &*served.store;
    match header.opcode {
        Opcode::Get => {
            let request: data::GetRequest = match decode_for(served, prost_header) {
                Ok(r) => r,
                Err(response) => return (response, None),
            };
            let hash = match ChunkHash::try_from(&request.hash[..]) {
                Ok(hash) => hash,
                Err(error) => return (error_response(ErrorCode::BadRequest, error.to_string()), None),
            };
            match store.read(hash, request.offset, request.length, request.accept_encoded).await {
                Ok(read) => (
                    data::Response {
                        chunk_length_bytes: read.length,
                        codec: read.codec.to_wire(),
                        ..Default::default()
                    },
                    Some(read.bytes),
                ),
                Err(error) => (store_error(error), None),
            }
        }
        Opcode::Has => {
            let request: data::HasRequest = match decode_for(served, prost_header) {
                Ok(r) => r,
                Err(response) => return (response, None),
            };
            let hashes = match parse_hashes(&request.hashes) {
                Ok(h) => h,
                Err(response) => return (response, None),
            };
            match store.has(hashes).await {
                Ok(present) => (data::Response { present, ..Default::default() }, None),
                Err(error) => (store_error(error), None),
            }
        }
        Opcode::Delete => {
            let request: data::DeleteRequest = match decode_for(served, prost_header) {
                Ok(r) => r,
                Err(response) => return (response, None),
            };
            let hashes = match parse_hashes(&request.hashes) {
                Ok(h) => h,
                Err(response) => return (response, None),
            };
            let unused_for = (request.unused_for_ms > 0).then(|| Duration::from_millis(request.unused_for_ms));
            match store.delete(hashes, unused_for).await {
                Ok(deleted) => (data::Response { deleted, ..Default::default() }, None),
                Err(error) => (store_error(error), None),
            }
        }
        Opcode::List => {
            let request: data::ListRequest = match decode_for(served, prost_header) {
                Ok(r) => r,
                Err(response) => return (response, None),
            };
            if request.limit == 0 || request.limit > MAX_LIST_ENTRIES {
                let message = format!("list limit {} is outside 1..={MAX_LIST_ENTRIES}", request.limit);
                return (error_response(ErrorCode::BadRequest, message), None);
            }
            let after = if request.after.is_empty() {
                None
            } else {
                match ChunkHash::try_from(&request.after[..]) {
                    Ok(hash) => Some(hash),
                    Err(error) => return (error_response(ErrorCode::BadRequest, error.to_string()), None),
                }
            };
            match store.list(after, request.limit as usize).await {
                Ok((page, complete)) => {
                    let mut payload = BytesMut::with_capacity(page.len() * LIST_ENTRY_BYTES);
                    for chunk in page {
                        payload.put_slice(&chunk.hash.0);
                        payload.put_u64_le(u64::try_from(chunk.unused_for.as_millis()).unwrap_or(u64::MAX));
                    }
                    (data::Response { list_complete: complete, ..Default::default() }, Some(payload.freeze()))
                }
                Err(error) => (store_error(error), None),
            }
        }
        Opcode::Stat => {
            if let Err(response) = decode_for::<data::StatRequest>(served, prost_header) {
                return (response, None);
            }
            let stats = store.stats();
            let scrub = store.scrub_stats();
            let response = data::Response {
                capacity_bytes: stats.capacity_bytes,
                used_bytes: stats.used_bytes,
                chunk_count: stats.chunk_count,
                free_pool_bytes: stats.free_pool_bytes,
                reused_files: stats.reused_files,
                chunk_reads: stats.chunk_reads,
                placed_reads: stats.placed_reads,
                placed_writes: stats.placed_writes,
                zero_copy_sends: served.zero_copy.counts().sends,
                zero_copy_copied: served.zero_copy.counts().copied,
                scrub_passes: scrub.passes.load(std::sync::atomic::Ordering::Relaxed),
                scrub_verified_chunks: scrub.verified_chunks.load(std::sync::atomic::Ordering::Relaxed),
                scrub_corrupt_removed: scrub.corrupt_removed.load(std::sync::atomic::Ordering::Relaxed),
                host_id: served.shm.as_ref().map(|(host, _)| host.clone()).unwrap_or_default(),
                shm_socket: served.shm.as_ref().map(|(_, path)| path.clone()).unwrap_or_default(),
                rdma_endpoint: served.rdma.as_ref().map(|rdma| data::RdmaEndpoint {
                    gid: Bytes::copy_from_slice(&rdma.memory.verbs().gid()),
                    ..Default::default()
                }),
                rdma_device: served.rdma.as_ref().map(|rdma| rdma.memory.verbs().name()).unwrap_or_default(),
                ..Default::default()
            };
            (response, None)
        }
        other => (error_response(ErrorCode::BadRequest, format!("unexpected opcode {other:?}")), None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn only_peers_that_could_write_the_chunk_files_are_trusted_with_placed_writes() {
        assert!(trusted_uid(1000, 1000) && trusted_uid(0, 1000) && trusted_uid(0, 0));
        assert!(!trusted_uid(1001, 1000) && !trusted_uid(1000, 0) && !trusted_uid(65534, 0));
        // Read from the socket: a peer of this process is this process's user.
        let (ours, _theirs) = tokio::net::UnixStream::pair().unwrap();
        assert!(trusted_peer(&ours));
    }

    /// A peer of the same user in a mount namespace of its own (a container's root) does not see
    /// this target's files: its staged chunks are copied.
    #[tokio::test]
    async fn a_peer_in_another_mount_namespace_is_not_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        // unshare(1) needs CAP_SYS_ADMIN: the test runs as root (as CI does) or not at all.
        // SAFETY: geteuid cannot fail and touches no memory.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root for unshare -m");
            return;
        }
        let connect = |isolated: bool| {
            let script = format!(
                "import socket, time\ns = socket.socket(socket.AF_UNIX)\ns.connect({:?})\ntime.sleep(30)",
                path.to_str().unwrap()
            );
            let mut command = std::process::Command::new(if isolated { "unshare" } else { "python3" });
            if isolated {
                command.args(["-m", "--", "python3"]);
            }
            command.args(["-c", &script]).spawn().unwrap()
        };
        for isolated in [false, true] {
            let mut peer = connect(isolated);
            let (stream, _) = tokio::time::timeout(Duration::from_secs(30), listener.accept()).await.unwrap().unwrap();
            let trusted = trusted_peer(&stream);
            let _ = peer.kill();
            let _ = peer.wait();
            assert_eq!(trusted, !isolated, "isolated: {isolated}");
        }
    }
}
