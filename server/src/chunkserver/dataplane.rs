//! The target's data-plane server: frames in, chunk-store operations, frames out.
//!
//! One task reads frames from a connection, one writes responses; each request runs in its own
//! task so a slow device operation never blocks the connection. Everything is bounded:
//! connections ([`DataPlaneLimits::max_connections`]), requests in flight per connection, and
//! payload bytes in flight across the whole target. When a bound is reached the reader stops
//! reading, so TCP flow control pushes back on the client instead of memory growing.
//!
//! Three ways to the same frames: TCP; a Unix socket with a shared-memory region (same host,
//! `starckpt_dataplane::shm`); and TCP with an RDMA queue pair set up by OP_CONNECT (`starckpt_rdma`):
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

use bytes::Bytes;
use prost::Message;
use starckpt_dataplane::rdma::RemoteBuffer;
use starckpt_dataplane::zerocopy::{FrameWriter, ZeroCopySend, ZeroCopyStats};
use starckpt_proto::ChunkHash;
use starckpt_proto::capability::{ClusterKey, Rights};
use starckpt_proto::data::{self, ErrorCode};
use starckpt_proto::frame::{self, FrameHeader, Opcode, ReadFrameError};
use starckpt_rdma::{Access, MemoryMap, QpDriver, Verbs};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use super::store::ChunkStore;
use starckpt_dataplane::sync::LockExt;

mod payload;
mod rdma;
mod requests;
mod same_host;

use payload::{PayloadSource, fetch};
use rdma::{RdmaServing, Untransferred, connect_rdma, deliver, echo_probe};
use requests::{check_auth, decode_for, dispatch, error_response, put};
pub use same_host::ShmListener;
use same_host::{SHM_PAGE, Slots, attach, get_placed};

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
    /// until the kernel reports it copied them anyway, as over loopback (`starckpt_dataplane::zerocopy`).
    pub zero_copy_send: ZeroCopySend,
    /// Bytes of slot regions same-host clients may share with this target at once (the target
    /// maps them and may fault them in: memory it is charged for). An attach past it is answered
    /// busy and that client goes over TCP until a region is given back. Default 4 GiB: ~500 of the
    /// SDK's regions (2 slots of 4 MiB + 4 KiB), one per client process.
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
    let advertised = shm.as_ref().map(|s| (starckpt_dataplane::shm::host_id(), s.path.to_string_lossy().into_owned()));
    let rdma = rdma.map(|verbs| {
        let pool = store.buffer_pool().clone();
        info!(device = %verbs.name(), "serving RDMA");
        RdmaServing {
            memory: MemoryMap::new(verbs, Access::LOCAL, Box::new(move |at| pool.buffer_containing(at))),
            admission: Semaphore::new(limits.rdma_transfers.max(1)),
        }
    });
    let placed_reads =
        shm.as_ref().is_some_and(|s| s.placed_reads.unwrap_or_else(starckpt_dataplane::shm::shared_huge_pages));
    if shm.is_some() {
        if placed_reads {
            info!("serving shared memory: GETs are read from the device straight into the client's slot");
        } else {
            info!(
                "serving shared memory: GETs are copied into the client's slot (shared memory gets no huge pages \
                 here; `echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled` to read them straight \
                 there, docs/benchmarks.md)"
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
        let mut open = self.0.lock_unpoisoned();
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
        let mut open = self.peers.0.lock_unpoisoned();
        if let Some(count) = open.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.ip);
            }
        }
    }
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
