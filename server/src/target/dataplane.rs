//! The target's data-plane server: frames in, chunk-store operations, frames out.
//!
//! One task reads frames from a connection, one writes responses; each request runs in its own
//! task so a slow device operation never blocks the connection. Everything is bounded:
//! connections ([`DataPlaneLimits::max_connections`]), requests in flight per connection, and
//! payload bytes in flight across the whole target. When a bound is reached the reader stops
//! reading, so TCP flow control pushes back on the client instead of memory growing.
//!
//! A frame with a bad fixed header (magic, version, opcode, flags, sizes) closes the connection:
//! after it the stream has no trustworthy frame boundary. A frame with a good fixed header but an
//! undecodable prost header gets a BAD_REQUEST response and the connection stays open.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;
use starckpt_proto::ChunkHash;
use starckpt_proto::data::{self, ErrorCode};
use starckpt_proto::frame::{
    self, FrameHeader, LIST_ENTRY_BYTES, MAX_BATCH_HASHES, MAX_LIST_ENTRIES, Opcode, ReadFrameError,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use super::store::{ChunkStore, ChunkStoreError, PutOutcome};

/// Bounds of the data-plane server. Defaults suit one NVMe device behind a 25 GB/s NIC.
#[derive(Clone, Debug)]
pub struct DataPlaneLimits {
    /// Concurrent connections; more wait in the accept backlog. Default 1024: a few per client
    /// process, hundreds of trainer processes per target.
    pub max_connections: usize,
    /// Requests being served at once on one connection. Default 64.
    pub max_requests_per_connection: usize,
    /// Payload bytes buffered at once across all connections. Default 1 GiB: enough to keep a
    /// device at queue depth 8 with 4 MiB chunks from dozens of clients, small beside host memory.
    pub max_inflight_bytes: u32,
    /// Time allowed to receive the rest of a frame once its fixed header has arrived. Default 60 s.
    pub frame_timeout: Duration,
    /// A connection that completes no frame header for this long is closed (idle clients
    /// reconnect on their next request; a peer stalled in the middle of a header releases its
    /// connection slot). Default 10 min.
    pub idle_timeout: Duration,
}

impl Default for DataPlaneLimits {
    fn default() -> Self {
        DataPlaneLimits {
            max_connections: 1024,
            max_requests_per_connection: 64,
            max_inflight_bytes: 1 << 30,
            frame_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(600),
        }
    }
}

struct Outgoing {
    opcode: Opcode,
    request_id: u64,
    header: Vec<u8>,
    payload: Option<Bytes>,
    /// In-flight bytes charged for the payload, released once it is written.
    charge: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// Serves the data plane on `listener` until `shutdown` resolves; then closes every connection
/// (requests already being served finish and are answered first) and returns.
pub async fn serve(
    listener: TcpListener,
    store: Arc<ChunkStore>,
    limits: DataPlaneLimits,
    shutdown: impl Future<Output = ()>,
) {
    let connections = Arc::new(Semaphore::new(limits.max_connections));
    // Never below one maximal frame, or a maximal PUT would wait forever.
    let inflight_bytes = Arc::new(Semaphore::new(limits.max_inflight_bytes.max(frame::MAX_PAYLOAD_BYTES) as usize));
    let stopping = CancellationToken::new();
    // If this future is dropped (aborted) rather than shut down, its connections still close.
    let _stop_on_drop = stopping.clone().drop_guard();
    let connection_tasks = TaskTracker::new();
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            _ = &mut shutdown => break,
            permit = Arc::clone(&connections).acquire_owned() => permit.expect("never closed"),
        };
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(error) => {
                    // EMFILE and friends: back off instead of spinning.
                    warn!(%error, "data plane accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let (store, limits, inflight_bytes) = (Arc::clone(&store), limits.clone(), Arc::clone(&inflight_bytes));
        let stop = stopping.child_token();
        connection_tasks.spawn(async move {
            if let Err(reason) = serve_connection(stream, store, limits, inflight_bytes, stop).await {
                info!(%peer, %reason, "closed data-plane connection");
            }
            drop(permit);
        });
    }
    stopping.cancel();
    connection_tasks.close();
    connection_tasks.wait().await;
}

async fn serve_connection(
    stream: TcpStream,
    store: Arc<ChunkStore>,
    limits: DataPlaneLimits,
    inflight_bytes: Arc<Semaphore>,
    stop: CancellationToken,
) -> Result<(), String> {
    let _ = stream.set_nodelay(true);
    let (mut reader, writer) = stream.into_split();
    let (responses, outgoing) = mpsc::channel::<Outgoing>(limits.max_requests_per_connection);
    let writer_task = tokio::spawn(write_loop(writer, outgoing, limits.frame_timeout));
    let requests = Arc::new(Semaphore::new(limits.max_requests_per_connection));

    let result = loop {
        let head = tokio::select! {
            _ = stop.cancelled() => break Ok(()),
            head = tokio::time::timeout(limits.idle_timeout, frame::read_frame_head(&mut reader)) => head,
        };
        let Ok(head) = head else {
            debug!(idle = ?limits.idle_timeout, "closing an idle connection");
            break Ok(());
        };
        let (header, prost_header) = match head {
            Ok(head) => head,
            Err(ReadFrameError::Closed) => break Ok(()),
            Err(ReadFrameError::Frame(error)) => break Err(format!("protocol error: {error}")),
            Err(ReadFrameError::Io(error)) => break Err(format!("read: {error}")),
        };
        if header.opcode.is_response() {
            break Err(format!("protocol error: client sent response opcode {:?}", header.opcode));
        }
        if header.opcode != Opcode::Put && header.payload_len != 0 {
            break Err(format!("protocol error: {:?} carries a payload", header.opcode));
        }
        let permit = Arc::clone(&requests).acquire_owned().await.expect("never closed");
        let store = Arc::clone(&store);
        let responses = responses.clone();
        if header.opcode == Opcode::Put {
            let bytes_permit = match Arc::clone(&inflight_bytes).acquire_many_owned(header.payload_len.max(1)).await {
                Ok(p) => p,
                Err(_) => break Err("shutting down".into()),
            };
            let request = decode_for::<data::PutRequest>(&store, prost_header);
            let mut chunk = store.write_buffer(header.payload_len as usize).await;
            let read = tokio::time::timeout(limits.frame_timeout, reader.read_exact(chunk.data_mut())).await;
            match read {
                Ok(Ok(_)) => {}
                Ok(Err(error)) => break Err(format!("read payload: {error}")),
                Err(_) => break Err(format!("payload not received within {:?}", limits.frame_timeout)),
            }
            tokio::spawn(async move {
                let response = match request {
                    Ok(request) => put(&store, request, chunk).await,
                    Err(response) => response,
                };
                drop(bytes_permit);
                let _ = responses.send(reply(header, response, None)).await;
                drop(permit);
            });
        } else {
            let inflight_bytes = Arc::clone(&inflight_bytes);
            tokio::spawn(async move {
                // A GET's response is charged to the same in-flight byte budget as PUT payloads,
                // from before the chunk is read until it has been written to the socket.
                let mut charge = None;
                if header.opcode == Opcode::Get
                    && let Ok(request) = data::GetRequest::decode(prost_header.clone())
                    && let Ok(hash) = ChunkHash::try_from(&request.hash[..])
                    && let Some(len) = store.file_len(&hash).await
                {
                    let bytes = u32::try_from(len).unwrap_or(u32::MAX).clamp(1, frame::MAX_PAYLOAD_BYTES);
                    charge = inflight_bytes.acquire_many_owned(bytes).await.ok();
                }
                let (response, payload) = dispatch(&store, header, prost_header).await;
                let mut message = reply(header, response, payload);
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

async fn write_loop(
    writer: tokio::net::tcp::OwnedWriteHalf,
    mut outgoing: mpsc::Receiver<Outgoing>,
    timeout: Duration,
) {
    let mut writer = BufWriter::with_capacity(64 * 1024, writer);
    while let Some(message) = outgoing.recv().await {
        let payload: Vec<Bytes> = message.payload.iter().cloned().collect();
        // A client that stops reading must not pin buffers and in-flight bytes forever.
        let written = tokio::time::timeout(
            timeout,
            frame::write_frame(&mut writer, message.opcode, message.request_id, &message.header, &payload),
        )
        .await;
        drop(message.charge);
        match written {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                debug!(%error, "data-plane write failed");
                return;
            }
            Err(_) => {
                info!("client did not read a response within {timeout:?}; closing the connection");
                return;
            }
        }
        // Flush when nothing else is queued, so responses are batched under load but never delayed.
        if outgoing.is_empty() && writer.flush().await.is_err() {
            return;
        }
    }
    let _ = writer.flush().await;
}

fn reply(header: FrameHeader, response: data::Response, payload: Option<Bytes>) -> Outgoing {
    Outgoing {
        opcode: header.opcode.response(),
        request_id: header.request_id,
        header: response.encode_to_vec(),
        payload,
        charge: None,
    }
}

fn error_response(code: ErrorCode, message: String) -> data::Response {
    data::Response { code: code as i32, message, ..Default::default() }
}

fn store_error(error: ChunkStoreError) -> data::Response {
    let code = match &error {
        ChunkStoreError::HashMismatch { .. } => ErrorCode::HashMismatch,
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

/// Requests that carry an `Auth`.
trait Addressed: Message + Default {
    fn auth(&self) -> &Option<data::Auth>;
}

macro_rules! addressed {
    ($($request:ty),*) => {
        $(impl Addressed for $request {
            fn auth(&self) -> &Option<data::Auth> {
                &self.auth
            }
        })*
    };
}
addressed!(
    data::PutRequest,
    data::GetRequest,
    data::HasRequest,
    data::DeleteRequest,
    data::ListRequest,
    data::StatRequest
);

/// Decodes a request, refusing one meant for another target.
fn decode_for<M: Addressed>(store: &ChunkStore, prost_header: Bytes) -> Result<M, data::Response> {
    let request: M = decode(prost_header)?;
    check_target(store, request.auth())?;
    Ok(request)
}

/// Refuses a request meant for another target (see `Auth.target_id` in dataplane.proto).
fn check_target(store: &ChunkStore, auth: &Option<data::Auth>) -> Result<(), data::Response> {
    match (auth.as_ref().map(|a| a.target_id.as_str()), store.target_id()) {
        (Some(wanted), Some(mine)) if !wanted.is_empty() && wanted != mine => Err(error_response(
            ErrorCode::WrongTarget,
            format!("this is target {mine}, not {wanted} (the address now belongs to another target)"),
        )),
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

async fn put(store: &ChunkStore, request: data::PutRequest, chunk: super::store::ChunkWrite) -> data::Response {
    let hash = match ChunkHash::try_from(&request.hash[..]) {
        Ok(hash) => hash,
        Err(error) => return error_response(ErrorCode::BadRequest, error.to_string()),
    };
    if chunk.data().is_empty() {
        return error_response(ErrorCode::BadRequest, "empty chunk".into());
    }
    let stored = if request.repair { store.repair(hash, chunk).await } else { store.put(hash, chunk).await };
    if let (Ok(_), Err(injected)) = (&stored, starckpt_client::faults::point("target.put.ack")) {
        return error_response(ErrorCode::Internal, injected.to_string());
    }
    match stored {
        Ok(outcome) => data::Response { already_present: outcome == PutOutcome::AlreadyPresent, ..Default::default() },
        Err(error) => store_error(error),
    }
}

async fn dispatch(store: &ChunkStore, header: FrameHeader, prost_header: Bytes) -> (data::Response, Option<Bytes>) {
    match header.opcode {
        Opcode::Get => {
            let request: data::GetRequest = match decode_for(store, prost_header) {
                Ok(r) => r,
                Err(response) => return (response, None),
            };
            let hash = match ChunkHash::try_from(&request.hash[..]) {
                Ok(hash) => hash,
                Err(error) => return (error_response(ErrorCode::BadRequest, error.to_string()), None),
            };
            match store.get(hash, request.offset, request.length).await {
                Ok((bytes, chunk_len)) => {
                    (data::Response { chunk_length_bytes: chunk_len, ..Default::default() }, Some(bytes))
                }
                Err(error) => (store_error(error), None),
            }
        }
        Opcode::Has => {
            let request: data::HasRequest = match decode_for(store, prost_header) {
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
            let request: data::DeleteRequest = match decode_for(store, prost_header) {
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
            let request: data::ListRequest = match decode_for(store, prost_header) {
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
            if let Err(response) = decode_for::<data::StatRequest>(store, prost_header) {
                return (response, None);
            }
            let stats = store.stats();
            let scrub = store.scrub_stats();
            let response = data::Response {
                capacity_bytes: stats.capacity_bytes,
                used_bytes: stats.used_bytes,
                chunk_count: stats.chunk_count,
                scrub_passes: scrub.passes.load(std::sync::atomic::Ordering::Relaxed),
                scrub_verified_chunks: scrub.verified_chunks.load(std::sync::atomic::Ordering::Relaxed),
                scrub_corrupt_removed: scrub.corrupt_removed.load(std::sync::atomic::Ordering::Relaxed),
                ..Default::default()
            };
            (response, None)
        }
        other => (error_response(ErrorCode::BadRequest, format!("unexpected opcode {other:?}")), None),
    }
}
