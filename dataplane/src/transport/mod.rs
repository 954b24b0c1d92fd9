//! Data-plane transports: how chunk bytes reach a target.
//!
//! [`ChunkTransport`] is the seam: the SDK's save and restore logic only calls it, so the
//! shared-memory ([`ShmTransport`]) and RDMA ([`RdmaTransport`]) transports slot in beside
//! [`TcpTransport`] without touching that logic; [`AutoTransport`] picks one per target.
//!
//! [`TcpTransport`] keeps a few persistent connections per target. Each connection multiplexes
//! many requests: a writer task sends frames in order, a reader task matches responses to
//! requests by id, so a slow GET never blocks a PUT behind it; a GET's raw chunk bound for the
//! caller's memory is read from the socket straight into it ([`LentReader`]). Requests in flight per connection
//! are bounded; the bytes in flight are bounded by the caller (the staging pool for saves, the
//! restore concurrency for reads). A broken connection fails its pending requests at once and is
//! replaced on the next request; every operation is idempotent (chunks are content-addressed), so
//! one retry on a fresh connection is always safe.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::rdma::RemoteBuffer;
pub use crate::zerocopy::{FrameWriter, ZeroCopyCounts, ZeroCopySend, ZeroCopyStats};
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use prost::Message;
pub use starckpt_proto::capability::Credentials;
use starckpt_proto::codec::Codec;
use starckpt_proto::data::{self, ErrorCode};
use starckpt_proto::frame::{self, LIST_ENTRY_BYTES, MAX_BATCH_HASHES, Opcode, ReadFrameError};
use starckpt_proto::{Addressing, ChunkHash, ChunkName};
use thiserror::Error;

mod auto;
mod deadline;
mod frames;
mod rdma;
mod shm;
mod slots;
mod tcp;
pub use auto::AutoTransport;
pub use deadline::Deadline;
pub(crate) use deadline::request_bytes;
use frames::*;
pub use frames::{Fetched, FrameTransport};
pub use rdma::{RdmaClient, RdmaConfig, RdmaTransport};
pub use shm::{ShmConfig, ShmTransport};
use tcp::*;
pub use tcp::{TcpConfig, TcpTransport};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, mpsc, oneshot};

#[derive(Debug, Error, Clone)]
pub enum TransportError {
    #[error("connect: {0}")]
    Connect(String),
    #[error("connection lost: {0}")]
    Connection(String),
    #[error("no response within {0:?}")]
    Timeout(Duration),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("{code:?}: {message}")]
    Remote { code: ErrorCode, message: String },
}

impl TransportError {
    /// Worth retrying on a fresh connection (or another replica). A peer that turned out to be
    /// another target counts too: the target we want has moved.
    pub fn is_connection(&self) -> bool {
        matches!(
            self,
            TransportError::Connect(_)
                | TransportError::Connection(_)
                | TransportError::Timeout(_)
                | TransportError::Remote { code: ErrorCode::WrongTarget | ErrorCode::TransferFailed, .. }
        )
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TargetStat {
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub chunk_count: u64,
    /// Bytes of deleted chunks' files the target keeps for reuse, and puts that reused one.
    pub free_pool_bytes: u64,
    pub reused_files: u64,
    /// Chunk files the target read from its device for GETs.
    pub chunk_reads: u64,
    /// GETs the target read from its device straight into a same-host client's slot.
    pub placed_reads: u64,
    /// PUTs the target wrote to its device straight from a same-host client's staging memory.
    pub placed_writes: u64,
    /// GET payloads the target sent zero-copy over TCP, and notifications of those that reported
    /// the kernel copied them after all.
    pub zero_copy_sends: u64,
    pub zero_copy_copied: u64,
    /// The target's scrubber since it started: passes finished, chunks verified, corrupt copies
    /// found and removed.
    pub scrub_passes: u64,
    pub scrub_verified_chunks: u64,
    pub scrub_corrupt_removed: u64,
    /// Where a client on the target's host can attach shared memory; None if it serves none.
    pub shm: Option<ShmEndpoint>,
    /// The target's RDMA device, if it serves RDMA.
    pub rdma_device: Option<String>,
}

/// A target's shared-memory endpoint, from its STAT response.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShmEndpoint {
    /// The target's host ([`crate::shm::host_id`]): shared memory only works on the same one.
    pub host_id: String,
    pub socket: std::path::PathBuf,
}

/// A page of a target's chunk list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChunkPage {
    /// Hashes with the time since each was last used, ascending by hash.
    pub chunks: Vec<(ChunkHash, Duration)>,
    /// No chunks follow this page.
    pub complete: bool,
}

/// A chunk's bytes as they travel and lie on a target: encoded by `codec`, `length` bytes once
/// decoded. The chunk's hash is always of the decoded bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Payload {
    pub bytes: Bytes,
    pub codec: Codec,
    pub length: u64,
}

impl Payload {
    /// Bytes as they are (no codec).
    pub fn raw(bytes: Bytes) -> Payload {
        Payload { length: bytes.len() as u64, bytes, codec: Codec::None }
    }

    /// The chunk's bytes, decoded if compressed and checked against the chunk's address `hash`
    /// under `addressing` and its `length`, with the name to store them under elsewhere; `Err`
    /// says what was wrong. CPU-bound: call off the runtime.
    pub fn verified(self, addressing: &Addressing, hash: ChunkHash, length: u64) -> Result<(Bytes, ChunkName), String> {
        let data = match self.codec {
            Codec::None => self.bytes,
            codec => starckpt_proto::codec::decompress(codec, &self.bytes, self.length as usize)
                .map(Bytes::from)
                .map_err(|e| format!("a {codec} copy does not decode: {e}"))?,
        };
        let name = addressing.name(ChunkHash::of(&data));
        if name.address != hash {
            return Err(format!("got {}", name.address));
        }
        if data.len() as u64 != length {
            return Err(format!("{} bytes, expected {length}", data.len()));
        }
        Ok((data, name))
    }
}

/// One target's chunk operations, whatever carries them.
#[async_trait]
pub trait ChunkTransport: Send + Sync + 'static {
    /// Stores a chunk named by its plain BLAKE3; true if the target already had it (under
    /// whatever codec).
    async fn put(&self, hash: ChunkHash, payload: Payload) -> Result<bool, TransportError> {
        self.put_named(&ChunkName::plain(hash), payload, false).await
    }
    /// Read repair: stores a chunk unless the target holds a copy that verifies (a copy that
    /// fails is replaced); true if the stored copy was good.
    async fn repair(&self, hash: ChunkHash, payload: Payload) -> Result<bool, TransportError> {
        self.put_named(&ChunkName::plain(hash), payload, true).await
    }
    /// [`ChunkTransport::put`] (or with `repair`, [`ChunkTransport::repair`]) of a chunk by its
    /// full name: a tenant's chunk carries its key and content hash (`starckpt_proto::address`).
    async fn put_named(&self, name: &ChunkName, payload: Payload, repair: bool) -> Result<bool, TransportError>;
    /// Reads `length` bytes at `offset` of a chunk (`length` 0: to the end). A whole chunk comes
    /// as stored (maybe compressed); a range comes decoded.
    async fn get(&self, hash: ChunkHash, offset: u64, length: u64) -> Result<Payload, TransportError>;
    /// Reads a whole chunk into `dest` when it comes raw and exactly `dest.len()` bytes long
    /// (shared memory and RDMA copy it there straight out of their slot, TCP reads it there
    /// straight from the socket, with no buffer between, hashing it as it lands:
    /// [`Fetched::Placed`]); otherwise returns it (compressed, or another length) for the caller
    /// to decode and verify.
    async fn get_into(&self, hash: ChunkHash, dest: &mut [u8]) -> Result<Fetched, TransportError> {
        let _ = dest;
        self.get(hash, 0, 0).await.map(Fetched::Payload)
    }
    /// Which of `hashes` are stored, for a writer deduplicating against them: the target makes
    /// a present one durable and refreshes its last use, so GC keeps it until the writer commits.
    async fn has(&self, hashes: &[ChunkHash]) -> Result<Vec<bool>, TransportError>;
    /// Which of `hashes` are stored, and nothing more: an audit's question (re-replication
    /// checking copies a committed checkpoint names, which GC keeps anyway), answered without the
    /// fsyncs and last-use updates of [`ChunkTransport::has`].
    async fn stored(&self, hashes: &[ChunkHash]) -> Result<Vec<bool>, TransportError>;
    /// Deletes chunks; with `unused_for`, only those not used (written, re-put, reported present)
    /// within that long (garbage collection's guard). Returns how many were removed.
    async fn delete(&self, hashes: &[ChunkHash], unused_for: Option<Duration>) -> Result<u64, TransportError>;
    /// One page of the stored chunks in hash order, after `after`, at most `limit` entries.
    async fn list(&self, after: Option<ChunkHash>, limit: u32) -> Result<ChunkPage, TransportError>;
    async fn stat(&self) -> Result<TargetStat, TransportError>;
    /// Short name for status output ("tcp", "shm", "rdma").
    fn kind(&self) -> &'static str;
    /// Waits (briefly) until a transport that chooses how to reach its target has chosen, so
    /// [`ChunkTransport::kind`] is final. Most transports have nothing to choose.
    async fn settle(&self) {}
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
    use super::*;
    use tokio::io::{AsyncWriteExt, DuplexStream};

    /// A connection over an in-memory stream, and the far end, which plays the target by hand.
    fn connection() -> (Connection, DuplexStream) {
        let (near, far) = tokio::io::duplex(1 << 20);
        let (reader, writer) = tokio::io::split(near);
        let config = TcpConfig {
            max_requests_per_connection: 8,
            deadline: Deadline { allowance: Duration::from_secs(2), ..Deadline::default() },
            ..TcpConfig::default()
        };
        (Connection::start(reader, FrameWriter::new(writer), &config), far)
    }

    /// Reads one request off `far`; returns its id.
    async fn request(far: &mut DuplexStream) -> u64 {
        let (header, _) = frame::read_frame_head(far).await.unwrap();
        header.request_id
    }

    /// Answers request `id` with an OK response and `payload`.
    async fn respond(far: &mut DuplexStream, id: u64, payload: &[u8]) {
        let header = data::Response::default().encode_to_vec();
        frame::write_frame(far, Opcode::GetResponse, id, &header, &[Bytes::copy_from_slice(payload)]).await.unwrap();
    }

    async fn get(connection: &Connection, land: Option<usize>) -> Result<Answer, TransportError> {
        connection.exchange(Opcode::Get, vec![], None, land, Duration::from_secs(10), None).await
    }

    /// Bytes whose release (their last reference dropped) shows in a flag.
    struct Tracked(Arc<std::sync::atomic::AtomicBool>, Vec<u8>);

    impl AsRef<[u8]> for Tracked {
        fn as_ref(&self) -> &[u8] {
            &self.1
        }
    }

    impl Drop for Tracked {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn tracked() -> (Bytes, Arc<std::sync::atomic::AtomicBool>) {
        let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
        (Bytes::from_owner(Tracked(Arc::clone(&released), vec![7; 4096])), released)
    }

    async fn released(flag: &std::sync::atomic::AtomicBool) -> bool {
        for _ in 0..500 {
            if flag.load(Ordering::SeqCst) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    /// Memory a request lends the target (a staged chunk it reads in place) stays held after the
    /// request gives up (a timeout), until the target answers it; and, on a connection the client
    /// closed, until the target closes it: never reused while the target may still read it.
    #[tokio::test]
    async fn memory_lent_to_the_target_is_held_until_it_answers_or_hangs_up() {
        let (connection, mut far) = connection();
        // Long enough that the other request, sent 20 ms in, is answered first on a busy machine.
        let short = Duration::from_secs(2);
        let (memory, freed) = tracked();
        // The target answers another request meanwhile: slow, not dead, so the connection stays.
        let serve = async {
            let held = request(&mut far).await;
            let other = request(&mut far).await;
            respond(&mut far, other, b"").await;
            held
        };
        let other = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            connection.call(Opcode::Stat, vec![], None, Duration::from_secs(5)).await
        };
        let (asked, answered, id) =
            tokio::join!(connection.call_holding(Opcode::Put, vec![], memory, short), other, serve);
        assert!(matches!(asked, Err(TransportError::Timeout(_))), "{asked:?}");
        answered.unwrap();
        assert!(connection.is_alive(), "a connection that answers was given up");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!freed.load(Ordering::SeqCst), "let go before the target answered");
        respond(&mut far, id, b"").await;
        assert!(released(&freed).await, "held after the target answered");

        // Answered in time: let go with the answer.
        let (memory, freed) = tracked();
        let serve = async {
            let id = request(&mut far).await;
            respond(&mut far, id, b"").await;
        };
        let (asked, ()) =
            tokio::join!(connection.call_holding(Opcode::Put, vec![], memory, Duration::from_secs(5)), serve);
        asked.unwrap();
        assert!(released(&freed).await);

        // The client gives the connection up: held until the target hangs up.
        let (memory, freed) = tracked();
        let (asked, _) = tokio::join!(connection.call_holding(Opcode::Put, vec![], memory, short), request(&mut far));
        assert!(asked.is_err());
        connection.close("given up");
        assert!(!connection.is_alive());
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!freed.load(Ordering::SeqCst), "let go while the target may still read it");
        drop(far);
        assert!(released(&freed).await, "held after the target hung up");

        // The target sends what the reader cannot follow: the requests fail at once, as ones
        // that lost their connection (none was answered, so a slot they lent is still the
        // target's), but their memory stays held while the stream is read to its end.
        let (connection, mut far) = self::connection();
        let (memory, freed) = tracked();
        let serve = async {
            let id = request(&mut far).await;
            request(&mut far).await;
            frame::write_frame(&mut far, Opcode::Put, id, &[], &[]).await.unwrap();
        };
        let other = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            connection.call(Opcode::Stat, vec![], None, Duration::from_secs(5)).await
        };
        let (asked, other, ()) =
            tokio::join!(connection.call_holding(Opcode::Put, vec![], memory, Duration::from_secs(5)), other, serve);
        for asked in [asked.map(drop), other.map(drop)] {
            let unanswered = matches!(&asked, Err(TransportError::Connection(why)) if why.contains("request opcode"));
            assert!(unanswered, "{asked:?}");
        }
        assert!(!connection.is_alive());
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!freed.load(Ordering::SeqCst), "let go while the target may still read it");
        drop(far);
        assert!(released(&freed).await, "held after the target hung up");
    }

    /// A target that never closes a connection the client gave up (stopped, its device hung) does
    /// not keep the memory lent to it for ever: it comes back a request's time after the
    /// connection's end (the target's hash checks refuse bytes changed under it, should it wake).
    #[tokio::test]
    async fn memory_lent_to_a_hung_target_comes_back_a_while_after_the_connection_ends() {
        let (connection, mut far) = connection();
        let (memory, freed) = tracked();
        let short = Duration::from_millis(200);
        let (asked, _) = tokio::join!(connection.call_holding(Opcode::Put, vec![], memory, short), request(&mut far));
        assert!(matches!(asked, Err(TransportError::Timeout(_))), "{asked:?}");
        connection.close("given up");
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!freed.load(Ordering::SeqCst), "let go before a request's time (2 s) passed");
        assert!(released(&freed).await, "held for ever by a target that never hangs up");
        drop(far);
    }

    /// A request that times out with nothing at all heard from the target since it was sent (a
    /// stopped target, its I/O hung) gives the connection up, so the next request opens another
    /// instead of waiting out its own timeout on a dead one.
    #[tokio::test]
    async fn a_target_that_answers_nothing_gets_its_connection_given_up() {
        let (connection, mut far) = connection();
        let (asked, _) = tokio::join!(get_within(&connection, Duration::from_millis(100)), request(&mut far));
        assert!(matches!(asked, Err(TransportError::Timeout(_))), "{:?}", asked.err());
        assert!(!connection.is_alive(), "a connection that answered nothing stays in use");
        let asked = get_within(&connection, Duration::from_secs(5)).await;
        assert!(asked.as_ref().is_err_and(TransportError::is_connection), "{:?}", asked.err());
    }

    async fn get_within(connection: &Connection, timeout: Duration) -> Result<Answer, TransportError> {
        connection.exchange(Opcode::Get, vec![], None, None, timeout, None).await
    }

    /// A lent payload the caller drops unread is skipped: the next response is read intact.
    #[tokio::test]
    async fn a_lent_payload_left_unread_is_skipped() {
        let (connection, mut far) = connection();
        let serve = async {
            let id = request(&mut far).await;
            respond(&mut far, id, &[1u8; 5000]).await;
            let id = request(&mut far).await;
            respond(&mut far, id, b"next").await;
        };
        let ask = async {
            let Answer::Lent(_, lent) = get(&connection, Some(5000)).await.unwrap() else { panic!("not lent") };
            drop(lent);
            match get(&connection, Some(3)).await.unwrap() {
                Answer::Whole(_, payload) => assert_eq!(&payload[..], b"next", "another length: read whole"),
                Answer::Lent(..) => panic!("lent a payload of another length"),
            }
        };
        tokio::join!(serve, ask);
    }

    /// A lent payload abandoned midway leaves the stream mid-frame: the connection is closed and
    /// every request on it fails, instead of reading payload bytes as a frame header.
    #[tokio::test]
    async fn a_lent_payload_abandoned_midway_closes_the_connection() {
        let (connection, mut far) = connection();
        let serve = async {
            let id = request(&mut far).await;
            respond_partly(&mut far, id, 8192, 3000).await;
        };
        let ask = async {
            let Answer::Lent(_, lent) = get(&connection, Some(8192)).await.unwrap() else { panic!("not lent") };
            lent
        };
        let ((), lent) = tokio::join!(serve, ask);
        let mut dest = vec![0u8; 8192];
        let read = tokio::time::timeout(Duration::from_millis(100), lent.read_hashed(&mut dest)).await;
        assert!(read.is_err(), "half a payload cannot be read whole");
        // Failed when the reader task closes the connection, whether or not it was sent.
        let asked = tokio::time::timeout(Duration::from_secs(10), get(&connection, None)).await.unwrap();
        let Err(error) = asked else { panic!("a request was answered from the middle of a payload") };
        assert!(error.is_connection(), "{error}");
        assert!(!connection.is_alive());
    }

    /// A request that keeps its lent stream without reading it (its future held, no longer
    /// polled) does not stall the connection for ever: past the request timeout the connection is
    /// given up, and its other requests fail at once instead of waiting behind it.
    #[tokio::test(start_paused = true)]
    async fn a_lent_stream_held_unread_gives_the_connection_up() {
        let (connection, mut far) = connection();
        let serve = async {
            let id = request(&mut far).await;
            respond(&mut far, id, &[3u8; 4096]).await;
        };
        let ask = async {
            let Answer::Lent(_, lent) = get(&connection, Some(4096)).await.unwrap() else { panic!("not lent") };
            lent
        };
        let ((), _held) = tokio::join!(serve, ask);
        let error = get(&connection, None).await.err().expect("answered behind a held stream");
        assert!(error.is_connection(), "{error}");
        assert!(!connection.is_alive());
    }

    /// A target that stops reading (alive, its connection open) does not pin what was queued to
    /// it for ever: past the request timeout without the bytes going out, the connection is
    /// given up, the payloads queued on it go back to their owners (staging buffers to their
    /// pool), and the next request opens another connection.
    #[tokio::test]
    async fn a_target_that_stops_reading_gets_its_connection_given_up() {
        let (near, far) = tokio::io::duplex(64 * 1024);
        let (reader, writer) = tokio::io::split(near);
        let deadline = Deadline { allowance: Duration::from_millis(300), floor_bytes_per_sec: 1 << 30 };
        let config = TcpConfig { deadline, ..TcpConfig::default() };
        let connection = Connection::start(reader, FrameWriter::new(writer), &config);
        let large = || {
            let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
            (Bytes::from_owner(Tracked(Arc::clone(&released), vec![7; 1 << 20])), released)
        };
        let (first, first_freed) = large();
        let (second, second_freed) = large();
        let put = |payload| connection.call(Opcode::Put, vec![], Some(payload), Duration::from_millis(300));
        let (one, two) = tokio::join!(put(first), put(second));
        // Whichever times out first gives the connection up (nothing heard) under the other.
        for asked in [one, two] {
            assert!(matches!(asked, Err(TransportError::Timeout(_) | TransportError::Connection(_))), "{asked:?}");
        }
        assert!(released(&first_freed).await, "the payload being written is pinned by a target that reads nothing");
        assert!(released(&second_freed).await, "a payload queued behind it is pinned");
        assert!(!connection.is_alive(), "a connection whose writes stall stays in use");
        drop(far);
    }

    /// Sends the response header of request `id` with a `len`-byte payload, and `sent` bytes of it.
    async fn respond_partly(far: &mut DuplexStream, id: u64, len: u32, sent: usize) {
        let header = data::Response::default().encode_to_vec();
        let fixed = frame::FrameHeader {
            opcode: Opcode::GetResponse,
            request_id: id,
            header_len: header.len() as u32,
            payload_len: len,
        };
        far.write_all(&fixed.encode()).await.unwrap();
        far.write_all(&header).await.unwrap();
        far.write_all(&vec![9u8; sent]).await.unwrap();
    }

    /// A lent payload read whole lands in the caller's buffer with its hash; the stream goes back.
    #[tokio::test]
    async fn a_lent_payload_lands_hashed() {
        let (connection, mut far) = connection();
        let data: Vec<u8> = (0..700_000u32).map(|i| (i * 13) as u8).collect();
        let serve = async {
            let id = request(&mut far).await;
            respond(&mut far, id, &data).await;
            let id = request(&mut far).await;
            respond(&mut far, id, b"after").await;
        };
        let ask = async {
            let Answer::Lent(_, lent) = get(&connection, Some(data.len())).await.unwrap() else { panic!("not lent") };
            let mut dest = vec![0u8; data.len()];
            assert_eq!(lent.read_hashed(&mut dest).await.unwrap(), ChunkHash::of(&data));
            assert_eq!(dest, data);
            let Answer::Whole(_, payload) = get(&connection, None).await.unwrap() else { panic!("lent unasked") };
            assert_eq!(&payload[..], b"after");
        };
        tokio::join!(serve, ask);
    }
}
