//! Where a PUT's payload is (the frame, a shared-memory slot, the client's staging memory or its
//! registered memory) and bringing it into the chunk being written.

#![allow(clippy::result_large_err)] // see the parent module

use std::sync::Arc;

use starckpt_dataplane::rdma::RemoteBuffer;
use starckpt_proto::ChunkHash;
use starckpt_proto::data::{self, ErrorCode};
use starckpt_rdma::{Op, QpDriver};

use super::Served;
use super::rdma::rdma_transfer;
use super::requests::error_response;
use super::same_host::Slots;

/// Where a PUT's payload is.
pub(super) enum PayloadSource {
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
    pub(super) fn of(request: &data::PutRequest, slots: Option<&Slots>, rdma: Option<&Arc<QpDriver>>) -> PayloadSource {
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
pub(super) async fn fetch(
    served: &Served,
    source: PayloadSource,
    slots: Option<Arc<Slots>>,
    rdma: Option<&QpDriver>,
    mut chunk: crate::chunkserver::store::ChunkWrite,
) -> Result<crate::chunkserver::store::ChunkWrite, data::Response> {
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
    mut chunk: crate::chunkserver::store::ChunkWrite,
    copy: impl FnOnce(&mut [u8]) -> std::io::Result<ChunkHash> + Send + 'static,
) -> Result<crate::chunkserver::store::ChunkWrite, data::Response> {
    let copied = tokio::task::spawn_blocking(move || chunk.fill_hashed(copy).map(|()| chunk)).await;
    match copied {
        Ok(Ok(chunk)) => Ok(chunk),
        Ok(Err(error)) => Err(error_response(ErrorCode::BadRequest, error.to_string())),
        Err(error) => Err(error_response(ErrorCode::Internal, format!("copying a payload: {error}"))),
    }
}
