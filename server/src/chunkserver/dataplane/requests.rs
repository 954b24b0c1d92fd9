//! Requests: decoding, authorisation (capabilities, target ids) and each opcode's store
//! operation.

#![allow(clippy::result_large_err)] // see the parent module

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;
use starckpt_proto::capability::Rights;
use starckpt_proto::codec::Codec;
use starckpt_proto::data::{self, ErrorCode};
use starckpt_proto::frame::{FrameHeader, LIST_ENTRY_BYTES, MAX_BATCH_HASHES, MAX_LIST_ENTRIES, Opcode};
use starckpt_proto::model::validate_target_id;
use starckpt_proto::{ChunkHash, ChunkName};
use tracing::warn;

use crate::chunkserver::store::{ChunkStore, ChunkStoreError, PutOutcome};

use super::Served;

pub(super) fn error_response(code: ErrorCode, message: String) -> data::Response {
    data::Response { code: code as i32, message, ..Default::default() }
}

pub(super) fn store_error(error: ChunkStoreError) -> data::Response {
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
pub(super) fn decode<M: Message + Default>(prost_header: Bytes) -> Result<M, data::Response> {
    M::decode(prost_header).map_err(|e| {
        let name = std::any::type_name::<M>().rsplit("::").next().unwrap_or("request");
        error_response(ErrorCode::BadRequest, format!("undecodable {name}: {e}"))
    })
}

/// Requests that carry an `Auth`, and the right each needs (`starckpt_proto::capability`).
pub(super) trait Addressed: Message + Default {
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
pub(super) fn decode_for<M: Addressed>(served: &Served, prost_header: Bytes) -> Result<M, data::Response> {
    let request: M = decode(prost_header)?;
    check_auth(served, request.auth(), M::NEEDS)?;
    Ok(request)
}

/// Refuses a request meant for another target, or, where the cluster has a key, one whose
/// capability does not grant `needs`.
pub(super) fn check_auth(served: &Served, auth: &Option<data::Auth>, needs: Rights) -> Result<(), data::Response> {
    check_target(&served.store, auth)?;
    let capability = auth.as_ref().map_or(&[][..], |a| &a.capability[..]);
    check_capability(served, capability, needs).map_err(|refused| error_response(ErrorCode::Unauthorized, refused))
}

/// Where the cluster has a key, refuses a `capability` that does not grant `needs` on this
/// target (counted), saying why.
pub(super) fn check_capability(served: &Served, capability: &[u8], needs: Rights) -> Result<(), String> {
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

pub(super) async fn put(
    store: &ChunkStore,
    request: data::PutRequest,
    mut chunk: crate::chunkserver::store::ChunkWrite,
) -> data::Response {
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
    if let (Ok(_), Err(injected)) = (&stored, starckpt_dataplane::faults::point("target.put.ack")) {
        return error_response(ErrorCode::Internal, injected.to_string());
    }
    match stored {
        Ok(outcome) => data::Response { already_present: outcome == PutOutcome::AlreadyPresent, ..Default::default() },
        Err(error) => store_error(error),
    }
}

/// Runs a request of the opcodes answered in one frame (GET, HAS, DELETE, LIST, STAT): its
/// response, and the payload to send after it.
pub(super) async fn dispatch(
    served: &Served,
    header: FrameHeader,
    prost_header: Bytes,
) -> (data::Response, Option<Bytes>) {
    run(served, header, prost_header).await.unwrap_or_else(|refused| (refused, None))
}

async fn run(
    served: &Served,
    header: FrameHeader,
    prost_header: Bytes,
) -> Result<(data::Response, Option<Bytes>), data::Response> {
    let store = &*served.store;
    let bad_request = |error: &dyn std::fmt::Display| error_response(ErrorCode::BadRequest, error.to_string());
    Ok(match header.opcode {
        Opcode::Get => {
            let request: data::GetRequest = decode_for(served, prost_header)?;
            let hash = ChunkHash::try_from(&request.hash[..]).map_err(|e| bad_request(&e))?;
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
            let request: data::HasRequest = decode_for(served, prost_header)?;
            let hashes = parse_hashes(&request.hashes)?;
            let answer = match request.existence_only {
                true => store.stored(hashes).await,
                false => store.has(hashes).await,
            };
            match answer {
                Ok(present) => (data::Response { present, ..Default::default() }, None),
                Err(error) => (store_error(error), None),
            }
        }
        Opcode::Delete => {
            let request: data::DeleteRequest = decode_for(served, prost_header)?;
            let hashes = parse_hashes(&request.hashes)?;
            let unused_for = (request.unused_for_ms > 0).then(|| Duration::from_millis(request.unused_for_ms));
            match store.delete(hashes, unused_for).await {
                Ok(deleted) => (data::Response { deleted, ..Default::default() }, None),
                Err(error) => (store_error(error), None),
            }
        }
        Opcode::List => {
            let request: data::ListRequest = decode_for(served, prost_header)?;
            if request.limit == 0 || request.limit > MAX_LIST_ENTRIES {
                let message = format!("list limit {} is outside 1..={MAX_LIST_ENTRIES}", request.limit);
                return Err(bad_request(&message));
            }
            let after = if request.after.is_empty() {
                None
            } else {
                Some(ChunkHash::try_from(&request.after[..]).map_err(|e| bad_request(&e))?)
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
            decode_for::<data::StatRequest>(served, prost_header)?;
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
        other => return Err(bad_request(&format!("unexpected opcode {other:?}"))),
    })
}
