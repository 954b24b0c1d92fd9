//! RDMA: queue pairs set up by OP_CONNECT, and the transfers between the target's buffers and
//! a client's registered memory, admitted per device.

#![allow(clippy::result_large_err)] // see the parent module

use std::sync::Arc;

use bytes::Bytes;
use starckpt_dataplane::rdma::{RemoteBuffer, endpoint_from_wire, endpoint_to_wire};
use starckpt_proto::data::{self, ErrorCode};
use starckpt_rdma::{Access, MemoryMap, Op, QpDriver, WorkRequest};
use tokio::sync::Semaphore;
use tracing::{debug, warn};

use super::Served;
use super::requests::{decode_for, error_response};

/// A target's RDMA device, its registrations and its admission control.
pub(super) struct RdmaServing {
    /// The target's buffers: the I/O pool registered once, other memory per transfer.
    pub(super) memory: MemoryMap,
    /// Transfers in flight on the device.
    pub(super) admission: Semaphore,
}

/// RDMA-WRITEs a GET's bytes into the client's buffer; returns how many were written, or the
/// failure (with the bytes when they never reached the device: they go in the frame instead).
pub(super) async fn deliver(
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
pub(super) async fn rdma_transfer<K: Send + 'static>(
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
pub(super) async fn echo_probe(
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
    let mut landing = starckpt_dataplane::buf::AlignedBuf::new(remote.len as usize);
    landing.set_len(remote.len as usize);
    let at = landing.as_mut_ptr() as usize;
    let landing = rdma_transfer(served, driver, Op::Read, at, remote.len as usize, remote, landing)
        .await
        .map_err(|failed| failed.response)?;
    Ok(Bytes::copy_from_slice(landing.as_ref()))
}

/// A transfer that did not happen: the TRANSFER_FAILED answer, and the memory back if the device
/// never had it.
pub(super) struct Untransferred<K> {
    pub(super) owner: Option<K>,
    pub(super) response: data::Response,
}

/// OP_CONNECT: a queue pair for this connection (`already`: it has one), connected to the
/// client's; the response, and the queue pair's driver when one was set up.
pub(super) fn connect_rdma(
    served: &Served,
    prost_header: Bytes,
    already: bool,
) -> (data::Response, Option<Arc<QpDriver>>) {
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
