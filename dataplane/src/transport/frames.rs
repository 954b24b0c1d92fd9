//! What every frame transport shares (TCP, shared memory, RDMA): the [`FrameTransport`] calls,
//! the request and answer frames of each operation, landing a payload, and the
//! [`ChunkTransport`] every [`FrameTransport`] is.

use super::*;

/// The `Auth` of a transport's requests: the target meant, and the sender's capability.
pub(super) async fn auth_for(target_id: &Option<String>, config: &TcpConfig) -> Option<data::Auth> {
    let capability = config.credentials.fresh(target_id.as_deref()).await;
    (target_id.is_some() || !capability.is_empty())
        .then(|| data::Auth { capability, target_id: target_id.clone().unwrap_or_default() })
}

/// Runs `attempt`, and once more if it failed because its connection broke: a fresh connection is
/// made on the second try, and every request is idempotent (chunks are content-addressed).
pub(super) async fn once_more<T, F, Fut>(mut attempt: F) -> Result<T, TransportError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, TransportError>>,
{
    match attempt().await {
        Err(TransportError::Connection(_)) => attempt().await,
        other => other,
    }
}

/// The response of a request, or its error code as an error.
pub(super) fn checked(response: data::Response, payload: Bytes) -> Result<(data::Response, Bytes), TransportError> {
    let code = ErrorCode::try_from(response.code).unwrap_or(ErrorCode::Internal);
    if code != ErrorCode::Ok {
        return Err(TransportError::Remote { code, message: response.message });
    }
    Ok((response, payload))
}

/// A transport that carries data-plane frames over a byte stream (TCP, a Unix socket): it sends
/// one frame and returns the checked response (retrying once on a fresh connection), and moves
/// chunk payloads its own way. HAS, DELETE, LIST and STAT are the same frames on every such
/// transport; [`ChunkTransport`] comes with it.
#[async_trait]
pub trait FrameTransport: Send + Sync + 'static {
    /// Sent in every request: a target with another id refuses it, and one whose cluster has a
    /// key checks its capability.
    async fn auth(&self) -> Option<data::Auth>;
    async fn call(
        &self,
        opcode: Opcode,
        header: Vec<u8>,
        payload: Option<Bytes>,
    ) -> Result<(data::Response, Bytes), TransportError>;
    /// PUT (`repair`: read repair's PUT); true if the chunk was there already.
    async fn put_chunk(&self, name: &ChunkName, payload: Payload, repair: bool) -> Result<bool, TransportError>;
    async fn get_chunk(&self, hash: ChunkHash, offset: u64, length: u64) -> Result<Payload, TransportError>;
    /// [`ChunkTransport::get_into`]; by default the chunk comes as a payload.
    async fn get_chunk_into(&self, hash: ChunkHash, dest: &mut [u8]) -> Result<Fetched, TransportError> {
        let _ = dest;
        self.get_chunk(hash, 0, 0).await.map(Fetched::Payload)
    }
    fn name(&self) -> &'static str;
}

pub(super) fn hash_list(hashes: &[ChunkHash]) -> Result<Vec<Bytes>, TransportError> {
    if hashes.len() > MAX_BATCH_HASHES {
        return Err(TransportError::Protocol(format!("batch of {} exceeds {MAX_BATCH_HASHES}", hashes.len())));
    }
    Ok(hashes.iter().map(|h| h.to_bytes()).collect())
}

/// Where a request's payload (PUT) or result (GET) travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// In the frame.
    Inline,
    /// In this 1-based shared-memory slot.
    Slot(u32),
    /// At this offset of the client's shared staging region (a PUT's payload only).
    Staging(u64),
    /// In client memory registered for RDMA.
    Rdma(RemoteBuffer),
}

/// A PUT request's header, its payload at `place`.
pub(crate) async fn put_header<F: FrameTransport + ?Sized>(
    frames: &F,
    name: &ChunkName,
    payload: &Payload,
    repair: bool,
    place: Place,
) -> Vec<u8> {
    let (shm_slot, shm_length) = match place {
        Place::Slot(slot) => (slot, payload.bytes.len() as u64),
        _ => (0, 0),
    };
    data::PutRequest {
        auth: frames.auth().await,
        hash: name.address.to_bytes(),
        chunk_key: name.addressing.to_wire(),
        content_hash: match name.addressing.is_keyed() {
            true => name.content.to_bytes(),
            false => Default::default(),
        },
        repair,
        codec: payload.codec.to_wire(),
        length_bytes: payload.length,
        shm_slot,
        shm_length,
        rdma: match place {
            Place::Rdma(remote) => Some(remote.to_wire()),
            _ => None,
        },
        staging: match place {
            Place::Staging(offset) => Some(data::StagingRange { offset, length: payload.bytes.len() as u64 }),
            _ => None,
        },
    }
    .encode_to_vec()
}

pub(crate) async fn get_header<F: FrameTransport + ?Sized>(
    frames: &F,
    hash: ChunkHash,
    offset: u64,
    length: u64,
    place: Place,
) -> Vec<u8> {
    data::GetRequest {
        auth: frames.auth().await,
        hash: hash.to_bytes(),
        offset,
        length,
        shm_slot: match place {
            Place::Slot(slot) => slot,
            _ => 0,
        },
        accept_encoded: true,
        rdma: match place {
            Place::Rdma(remote) => Some(remote.to_wire()),
            _ => None,
        },
    }
    .encode_to_vec()
}

/// What [`ChunkTransport::get_into`] fetched.
#[derive(Debug)]
pub enum Fetched {
    /// The chunk is in the caller's buffer, copied there out of a slot or read there from a
    /// socket; this is the BLAKE3 hash of the bytes as they landed (computed piece by piece as
    /// they landed, while in cache), for
    /// the caller to compare with the chunk's. A transport must hash exactly the bytes it left
    /// in the buffer: restore trusts this hash instead of hashing the buffer again.
    Placed(ChunkHash),
    /// The chunk as it came (compressed, or another length than the buffer), for the caller to
    /// decode and verify.
    Payload(Payload),
}

/// Where the `len` bytes a target put into a GET's slot go: into `dest` (copied and hashed by
/// `read_into`) when the chunk came raw and exactly `dest`'s size, otherwise into a fresh
/// payload (copied by `read_fresh`).
pub(crate) fn land_slot(
    response: &data::Response,
    len: usize,
    dest: Option<&mut [u8]>,
    read_into: impl FnOnce(&mut [u8]) -> Result<ChunkHash, TransportError>,
    read_fresh: impl FnOnce() -> Result<Bytes, TransportError>,
) -> Result<Fetched, TransportError> {
    match dest {
        Some(dest) if response.codec == Codec::None.to_wire() && dest.len() == len => {
            let copy_and_hash = || read_into(dest);
            // A large copy (~0.1 ms and more) hands the worker's other tasks over meanwhile.
            if len >= BLOCK_IN_PLACE_BYTES { crate::blocking::off_runtime(copy_and_hash) } else { copy_and_hash() }
                .map(Fetched::Placed)
        }
        _ => get_payload(response, read_fresh()?).map(Fetched::Payload),
    }
}

/// Copies at least this big are hashed off the runtime's books ([`land_slot`]).
pub(super) const BLOCK_IN_PLACE_BYTES: usize = 256 << 10;

/// A GET that had no buffer to land in always comes as a payload.
pub(crate) fn fetched_payload(fetched: Fetched) -> Result<Payload, TransportError> {
    match fetched {
        Fetched::Payload(payload) => Ok(payload),
        Fetched::Placed(_) => Err(TransportError::Protocol("a GET without a buffer placed its bytes somewhere".into())),
    }
}

/// A GET response's bytes as a [`Payload`], its codec checked.
pub(crate) fn get_payload(response: &data::Response, bytes: Bytes) -> Result<Payload, TransportError> {
    let codec = Codec::from_wire(response.codec).map_err(|e| TransportError::Protocol(format!("GET: {e}")))?;
    if codec == Codec::None {
        return Ok(Payload::raw(bytes));
    }
    if response.chunk_length_bytes == 0 || response.chunk_length_bytes > u64::from(frame::MAX_PAYLOAD_BYTES) {
        return Err(TransportError::Protocol(format!("GET: a {codec} chunk of {} bytes", response.chunk_length_bytes)));
    }
    Ok(Payload { bytes, codec, length: response.chunk_length_bytes })
}

pub(super) async fn has_frames<F: FrameTransport + ?Sized>(
    frames: &F,
    hashes: &[ChunkHash],
    existence_only: bool,
) -> Result<Vec<bool>, TransportError> {
    let header =
        data::HasRequest { auth: frames.auth().await, hashes: hash_list(hashes)?, existence_only }.encode_to_vec();
    let (response, _) = frames.call(Opcode::Has, header, None).await?;
    if response.present.len() != hashes.len() {
        return Err(TransportError::Protocol(format!(
            "HAS answered {} flags for {} hashes",
            response.present.len(),
            hashes.len()
        )));
    }
    Ok(response.present)
}

pub(super) async fn delete_frames<F: FrameTransport + ?Sized>(
    frames: &F,
    hashes: &[ChunkHash],
    unused_for: Option<Duration>,
) -> Result<u64, TransportError> {
    // A zero guard would mean "unconditional" on the wire; the smallest real guard is 1 ms.
    let unused_for_ms = unused_for.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1));
    let header =
        data::DeleteRequest { auth: frames.auth().await, hashes: hash_list(hashes)?, unused_for_ms }.encode_to_vec();
    Ok(frames.call(Opcode::Delete, header, None).await?.0.deleted)
}

pub(super) async fn list_frames<F: FrameTransport + ?Sized>(
    frames: &F,
    after: Option<ChunkHash>,
    limit: u32,
) -> Result<ChunkPage, TransportError> {
    let after = after.map_or_else(Bytes::new, |h| h.to_bytes());
    let header = data::ListRequest { auth: frames.auth().await, after, limit }.encode_to_vec();
    let (response, payload) = frames.call(Opcode::List, header, None).await?;
    if payload.len() % LIST_ENTRY_BYTES != 0 || payload.len() / LIST_ENTRY_BYTES > limit as usize {
        return Err(TransportError::Protocol(format!("LIST answered {} payload bytes", payload.len())));
    }
    let chunks = payload
        .chunks_exact(LIST_ENTRY_BYTES)
        .map(|entry| {
            let (mut hash, mut age) = ([0u8; 32], [0u8; 8]);
            hash.copy_from_slice(&entry[..32]);
            age.copy_from_slice(&entry[32..]);
            (ChunkHash(hash), Duration::from_millis(u64::from_le_bytes(age)))
        })
        .collect();
    Ok(ChunkPage { chunks, complete: response.list_complete })
}

pub(super) async fn stat_frames<F: FrameTransport + ?Sized>(frames: &F) -> Result<TargetStat, TransportError> {
    let header = data::StatRequest { auth: frames.auth().await }.encode_to_vec();
    let (response, _) = frames.call(Opcode::Stat, header, None).await?;
    Ok(TargetStat {
        capacity_bytes: response.capacity_bytes,
        used_bytes: response.used_bytes,
        chunk_count: response.chunk_count,
        free_pool_bytes: response.free_pool_bytes,
        reused_files: response.reused_files,
        chunk_reads: response.chunk_reads,
        placed_reads: response.placed_reads,
        placed_writes: response.placed_writes,
        zero_copy_sends: response.zero_copy_sends,
        zero_copy_copied: response.zero_copy_copied,
        scrub_passes: response.scrub_passes,
        scrub_verified_chunks: response.scrub_verified_chunks,
        scrub_corrupt_removed: response.scrub_corrupt_removed,
        shm: (!response.shm_socket.is_empty())
            .then(|| ShmEndpoint { host_id: response.host_id, socket: response.shm_socket.into() }),
        rdma_device: response.rdma_endpoint.is_some().then_some(response.rdma_device),
    })
}

#[async_trait]
impl<T: FrameTransport> ChunkTransport for T {
    async fn put_named(&self, name: &ChunkName, payload: Payload, repair: bool) -> Result<bool, TransportError> {
        self.put_chunk(name, payload, repair).await
    }

    async fn get(&self, hash: ChunkHash, offset: u64, length: u64) -> Result<Payload, TransportError> {
        self.get_chunk(hash, offset, length).await
    }

    async fn get_into(&self, hash: ChunkHash, dest: &mut [u8]) -> Result<Fetched, TransportError> {
        self.get_chunk_into(hash, dest).await
    }

    async fn has(&self, hashes: &[ChunkHash]) -> Result<Vec<bool>, TransportError> {
        has_frames(self, hashes, false).await
    }

    async fn stored(&self, hashes: &[ChunkHash]) -> Result<Vec<bool>, TransportError> {
        has_frames(self, hashes, true).await
    }

    async fn delete(&self, hashes: &[ChunkHash], unused_for: Option<Duration>) -> Result<u64, TransportError> {
        delete_frames(self, hashes, unused_for).await
    }

    async fn list(&self, after: Option<ChunkHash>, limit: u32) -> Result<ChunkPage, TransportError> {
        list_frames(self, after, limit).await
    }

    async fn stat(&self) -> Result<TargetStat, TransportError> {
        stat_frames(self).await
    }

    fn kind(&self) -> &'static str {
        self.name()
    }
}
