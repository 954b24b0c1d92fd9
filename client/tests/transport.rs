#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
//! Conformance of `ChunkTransport` implementations against a real target data plane. Every
//! transport (TCP, shared memory, RDMA over the in-process software fabric) must pass these.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use prost::Message;
use starckpt_client::transport::{
    AutoTransport, ChunkPage, ChunkTransport, Deadline, Fetched, Payload, RdmaClient, RdmaTransport, ShmConfig,
    ShmTransport, TcpConfig, TcpTransport, TransportError, ZeroCopyCounts, ZeroCopySend,
};
use starckpt_proto::codec::{self, Codec, CompressConfig};
use starckpt_proto::data::ErrorCode;
use starckpt_proto::frame::Opcode;
use starckpt_proto::{Addressing, ChunkHash, ChunkName, TenantName};
use starckpt_server::chunkserver::dataplane::{self, DataPlaneLimits, ShmListener, Transports};
use starckpt_server::chunkserver::engine::{EngineKind, open_engine};
use starckpt_server::chunkserver::store::ChunkStore;
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio::sync::watch;

struct Target {
    address: std::net::SocketAddr,
    store: Arc<ChunkStore>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

async fn start_target(dir: &std::path::Path, address: &str) -> Target {
    start_target_with(dir, address, None).await
}

/// A target serving TCP and, with `shm`, same-host shared memory on that Unix socket.
async fn start_target_with(dir: &std::path::Path, address: &str, shm: Option<&std::path::Path>) -> Target {
    start_target_placing(dir, address, shm, None).await
}

/// [`start_target_with`], with GETs over shared memory read straight into slots or not
/// (`placed_reads`; None: where shared memory gets huge pages).
async fn start_target_placing(
    dir: &std::path::Path,
    address: &str,
    shm: Option<&std::path::Path>,
    placed_reads: Option<bool>,
) -> Target {
    let shm = shm.map(|path| {
        let _ = std::fs::remove_file(path);
        let mut listener = ShmListener::new(tokio::net::UnixListener::bind(path).unwrap(), path.to_path_buf());
        listener.placed_reads = placed_reads;
        listener
    });
    start_target_on(dir, address, Transports { shm, rdma: None, cluster_key: None }, DataPlaneLimits::default()).await
}

async fn start_target_on(
    dir: &std::path::Path,
    address: &str,
    transports: Transports,
    limits: DataPlaneLimits,
) -> Target {
    let store = Arc::new(ChunkStore::open(dir, open_engine(EngineKind::Uring, 8).unwrap(), 1 << 20, 8).await.unwrap());
    let listener = TcpListener::bind(address).await.unwrap();
    let address = listener.local_addr().unwrap();
    let (stop, mut stopped) = watch::channel(false);
    let task = tokio::spawn(dataplane::serve_with(listener, transports, Arc::clone(&store), limits, async move {
        let _ = stopped.wait_for(|s| *s).await;
    }));
    Target { address, store, stop, task }
}

fn chunk(len: usize, seed: u8) -> (ChunkHash, Bytes) {
    let data: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
    (ChunkHash::of(&data), Bytes::from(data))
}

fn tcp(address: std::net::SocketAddr, connections: usize) -> TcpTransport {
    TcpTransport::new(address, TcpConfig { connections_per_target: connections, ..TcpConfig::default() })
}

async fn operations(transport: &dyn ChunkTransport) {
    let (hash, data) = chunk(300_001, 1);
    assert_eq!(transport.has(&[hash]).await.unwrap(), vec![false]);
    assert!(!transport.put(hash, Payload::raw(data.clone())).await.unwrap());
    assert!(transport.put(hash, Payload::raw(data.clone())).await.unwrap(), "second put reports the chunk present");
    assert_eq!(transport.get(hash, 0, 0).await.unwrap().bytes, data);
    assert_eq!(transport.get(hash, 1000, 5000).await.unwrap().bytes, data.slice(1000..6000));
    let missing = ChunkHash::of(b"missing");
    assert_eq!(transport.has(&[hash, missing]).await.unwrap(), vec![true, false]);
    assert_eq!(transport.stored(&[missing, hash]).await.unwrap(), vec![false, true]);
    let stat = transport.stat().await.unwrap();
    assert_eq!(stat.chunk_count, 1);
    assert!(stat.used_bytes >= 300_001 && stat.capacity_bytes > stat.used_bytes);

    let error = transport.get(missing, 0, 0).await.unwrap_err();
    assert!(matches!(error, TransportError::Remote { code: ErrorCode::NotFound, .. }), "{error}");
    let error = transport.get(hash, 300_000, 10).await.unwrap_err();
    assert!(matches!(error, TransportError::Remote { code: ErrorCode::BadRequest, .. }), "{error}");
    let error = transport.put(missing, Payload::raw(data.clone())).await.unwrap_err();
    assert!(matches!(error, TransportError::Remote { code: ErrorCode::HashMismatch, .. }), "{error}");

    // LIST pages through the store; a guarded delete keeps a chunk used within the guard.
    let (second, second_data) = chunk(1000, 2);
    assert!(!transport.put(second, Payload::raw(second_data)).await.unwrap());
    let first = transport.list(None, 1).await.unwrap();
    assert_eq!((first.chunks.len(), first.complete), (1, false));
    let rest = transport.list(Some(first.chunks[0].0), 100).await.unwrap();
    assert!(rest.complete);
    let mut listed: Vec<ChunkHash> = first.chunks.iter().chain(&rest.chunks).map(|(h, _)| *h).collect();
    let mut expected = vec![hash, second];
    listed.sort();
    expected.sort();
    assert_eq!(listed, expected);
    assert!(first.chunks.iter().chain(&rest.chunks).all(|(_, age)| *age < Duration::from_secs(600)));
    let error = transport.list(None, 0).await.unwrap_err();
    assert!(matches!(error, TransportError::Remote { code: ErrorCode::BadRequest, .. }), "{error}");
    assert_eq!(transport.delete(&[hash, second], Some(Duration::from_secs(600))).await.unwrap(), 0);

    assert_eq!(transport.delete(&[hash, missing, second], None).await.unwrap(), 2);
    assert_eq!(transport.has(&[hash]).await.unwrap(), vec![false]);
    assert_eq!(transport.list(None, 10).await.unwrap(), ChunkPage { chunks: vec![], complete: true });
    compressed(transport).await;
    tenant_chunks(transport).await;
}

/// A tenant's chunks (starckpt_proto::address) through the data plane: a PUT names the tenant and
/// the content hash; the target refuses an address that is not the tenant's keyed hash of that
/// content, and bytes that are not that content; a reader verifies with the tenant's addressing.
async fn tenant_chunks(transport: &dyn ChunkTransport) {
    let acme = Addressing::tenant(None, &TenantName::try_from("acme").unwrap());
    let beta = Addressing::tenant(None, &TenantName::try_from("beta").unwrap());
    let (content, data) = chunk(70_001, 9);
    let name = acme.name(content);
    let mismatch = |result: Result<bool, TransportError>| {
        assert!(matches!(result, Err(TransportError::Remote { code: ErrorCode::HashMismatch, .. })), "{result:?}")
    };
    // An address that is not acme's for this content: a forged one, beta's, the plain one.
    for address in [ChunkHash::of(b"elsewhere"), beta.address(&content), content] {
        mismatch(transport.put_named(&ChunkName { address, ..name }, Payload::raw(data.clone()), false).await);
    }
    // Bytes that are not the content named.
    mismatch(transport.put_named(&name, Payload::raw(chunk(70_001, 10).1), false).await);
    assert_eq!(transport.has(&[name.address]).await.unwrap(), vec![false]);

    assert!(!transport.put_named(&name, Payload::raw(data.clone()), false).await.unwrap());
    // Not deduplicated against the plain chunk of the same bytes, nor another tenant's.
    assert_eq!(
        transport.has(&[name.address, content, beta.address(&content)]).await.unwrap(),
        vec![true, false, false]
    );
    let got = transport.get(name.address, 0, 0).await.unwrap();
    let (bytes, verified) = got.clone().verified(&acme, name.address, data.len() as u64).unwrap();
    assert_eq!((bytes, &verified), (data.clone(), &name));
    assert!(got.clone().verified(&beta, name.address, data.len() as u64).is_err());
    assert!(got.verified(&Addressing::plain(), name.address, data.len() as u64).is_err());
    assert!(transport.put_named(&name, Payload::raw(data.clone()), true).await.unwrap(), "read repair: it verifies");

    // Compressed: the target decodes it and checks the content hash.
    let (content, floats) = float_chunk(100_000);
    let packed = codec::compress(&floats, &CompressConfig::default()).expect("compresses");
    let payload = Payload { bytes: Bytes::from(packed.bytes), codec: packed.codec, length: floats.len() as u64 };
    let packed_name = acme.name(content);
    let wrong = ChunkName { content: ChunkHash::of(b"else"), ..packed_name };
    mismatch(transport.put_named(&wrong, payload.clone(), false).await);
    assert!(!transport.put_named(&packed_name, payload, false).await.unwrap());
    let got = transport.get(packed_name.address, 0, 0).await.unwrap();
    assert_eq!(got.verified(&acme, packed_name.address, floats.len() as u64).unwrap().0, floats);
    assert_eq!(transport.delete(&[name.address, packed_name.address], None).await.unwrap(), 2);
}

/// bf16-like values: the exponent plane compresses.
fn float_chunk(values: usize) -> (ChunkHash, Bytes) {
    let data: Vec<u8> = (0..values)
        .flat_map(|i| (((((i * 7919) % 2000) as f32 - 1000.0) * 1e-5).to_bits() >> 16).to_le_bytes()[..2].to_vec())
        .collect();
    (ChunkHash::of(&data), Bytes::from(data))
}

/// Compressed payloads: stored as sent, read back encoded (whole) or decoded (a range), checked by
/// the target against the content hash before they are stored, deduplicated across codecs.
async fn compressed(transport: &dyn ChunkTransport) {
    let (hash, data) = float_chunk(200_000);
    let packed = codec::compress(&data, &CompressConfig::default()).expect("compresses");
    assert_ne!(packed.codec, Codec::None);
    let payload = Payload { bytes: Bytes::from(packed.bytes.clone()), codec: packed.codec, length: data.len() as u64 };
    assert!(!transport.put(hash, payload.clone()).await.unwrap());
    let whole = transport.get(hash, 0, 0).await.unwrap();
    assert_eq!(whole, payload, "a whole chunk comes back as stored");
    assert_eq!(whole.verified(&Addressing::plain(), hash, data.len() as u64).unwrap().0, data);
    let range = transport.get(hash, 1001, 7000).await.unwrap();
    assert_eq!(range, Payload::raw(data.slice(1001..8001)), "a range comes back decoded");
    assert!(transport.put(hash, Payload::raw(data.clone())).await.unwrap(), "present under another codec");
    let error = transport.get(hash, data.len() as u64 - 1, 2).await.unwrap_err();
    assert!(matches!(error, TransportError::Remote { code: ErrorCode::BadRequest, .. }), "{error}");

    // Payloads that lie: wrong decoded length, bytes that do not decode, bytes of another chunk,
    // zero and absurd lengths. Each is refused and nothing is stored.
    let (other, other_data) = float_chunk(100_000);
    let lies = [
        Payload { length: data.len() as u64 + 1, ..payload.clone() },
        Payload { bytes: Bytes::from(vec![7u8; 5000]), ..payload.clone() },
        Payload { length: other_data.len() as u64, ..payload.clone() },
        Payload { length: 0, ..payload.clone() },
        Payload { length: u64::MAX, ..payload.clone() },
    ];
    for lie in lies {
        let error = transport.put(other, lie).await.unwrap_err();
        assert!(matches!(error, TransportError::Remote { code: ErrorCode::HashMismatch, .. }), "{error}");
    }
    assert_eq!(transport.has(&[other]).await.unwrap(), vec![false]);
    assert!(transport.delete(&[hash], None).await.unwrap() == 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_operations() {
    let dir = tempfile::tempdir().unwrap();
    let target = start_target(dir.path(), "127.0.0.1:0").await;
    operations(&tcp(target.address, 2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_requests_in_flight_on_one_connection() {
    let dir = tempfile::tempdir().unwrap();
    let target = start_target(dir.path(), "127.0.0.1:0").await;
    let transport = Arc::new(tcp(target.address, 1));
    let tasks: Vec<_> = (0..200u32)
        .map(|i| {
            let transport = Arc::clone(&transport);
            tokio::spawn(async move {
                let (hash, data) = chunk(1000 + i as usize * 97, i as u8);
                transport.put(hash, Payload::raw(data.clone())).await.unwrap();
                assert_eq!(transport.get(hash, 0, 0).await.unwrap().bytes, data);
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(transport.stat().await.unwrap().chunk_count, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_after_the_target_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let target = start_target(dir.path(), "127.0.0.1:0").await;
    let address = target.address;
    let transport = tcp(address, 1);
    let (hash, data) = chunk(10_000, 7);
    transport.put(hash, Payload::raw(data.clone())).await.unwrap();

    let _ = target.stop.send(true);
    target.task.await.unwrap();
    let Err(error) = transport.get(hash, 0, 0).await else { panic!("a stopped target still served a read") };
    assert!(error.is_connection(), "{error}");

    let _restarted = start_target(dir.path(), &address.to_string()).await;
    assert_eq!(
        transport.get(hash, 0, 0).await.unwrap().bytes,
        data,
        "the chunk survived and the transport reconnected"
    );
}

/// Starts a target with `idle` and `frame` timeouts, connects, sends `sent` and stalls; asserts the
/// target closes the connection within 10 s. Returns the target's address.
async fn stalled_peer_is_cut_off(idle: Duration, frame: Duration, sent: &[u8]) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let store =
        Arc::new(ChunkStore::open(dir.path(), open_engine(EngineKind::Std, 2).unwrap(), 1 << 20, 2).await.unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let limits = DataPlaneLimits { idle_timeout: idle, frame_timeout: frame, ..DataPlaneLimits::default() };
    tokio::spawn(async move {
        dataplane::serve(listener, store, limits, std::future::pending()).await;
        drop(dir);
    });
    let mut stalled = tokio::net::TcpStream::connect(address).await.unwrap();
    stalled.write_all(sent).await.unwrap();
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(Duration::from_secs(10), stalled.read(&mut buf)).await;
    assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "the stalled connection was not closed: {read:?}");
    address
}

#[tokio::test]
async fn a_peer_stalled_mid_header_is_disconnected_after_the_idle_timeout() {
    let address = stalled_peer_is_cut_off(Duration::from_millis(300), Duration::from_secs(3600), b"SCK").await;
    // A client whose idle connection was closed just reconnects.
    let transport = tcp(address, 1);
    transport.stat().await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    transport.stat().await.unwrap();
}

/// A peer that sends a frame's fixed header and then trickles (or withholds) the rest of its header
/// is cut off after the frame timeout, not the (long) idle timeout.
#[tokio::test]
async fn a_peer_stalled_after_the_fixed_header_is_cut_off_after_the_frame_timeout() {
    use starckpt_proto::frame::FrameHeader;
    let mut sent =
        FrameHeader { opcode: Opcode::Stat, request_id: 1, header_len: 1000, payload_len: 0 }.encode().to_vec();
    sent.extend_from_slice(&[0u8; 10]);
    stalled_peer_is_cut_off(Duration::from_secs(3600), Duration::from_millis(300), &sent).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_meant_for_another_target_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let target = start_target(dir.path(), "127.0.0.1:0").await;
    let (hash, data) = chunk(1000, 7);
    // The harness's store has no id yet: nothing is checked.
    let anyone = TcpTransport::for_target(target.address, "someone-else", TcpConfig::default());
    assert!(!anyone.put(hash, Payload::raw(data.clone())).await.unwrap());
    target.store.set_target_id("target-a");
    let wrong = TcpTransport::for_target(target.address, "target-b", TcpConfig::default());
    let error = wrong.has(&[hash]).await.unwrap_err();
    assert!(matches!(error, TransportError::Remote { code: ErrorCode::WrongTarget, .. }), "{error}");
    assert!(error.is_connection(), "callers look the target up again");
    assert!(wrong.put(hash, Payload::raw(data)).await.is_err());
    // A name no target can have is not echoed back.
    let long = "x".repeat(100_000);
    let error = TcpTransport::for_target(target.address, &long, TcpConfig::default()).has(&[hash]).await.unwrap_err();
    assert!(matches!(error, TransportError::Remote { code: ErrorCode::WrongTarget, .. }), "{error}");
    assert!(error.to_string().len() < 1000, "{error}");
    let right = TcpTransport::for_target(target.address, "target-a", TcpConfig::default());
    assert_eq!(right.has(&[hash]).await.unwrap(), vec![true]);
    assert_eq!(tcp(target.address, 1).has(&[hash]).await.unwrap(), vec![true], "no expectation: unchecked");
}

/// Flips a bit of chunk `hash`'s stored bytes at `at`: a GET into `dest` brings it through (the
/// reader verifies), hashed as it landed. Returns the chunk file's path and its unflipped bytes.
async fn flipped_bit_comes_through(
    target: &Target,
    transport: &dyn ChunkTransport,
    hash: ChunkHash,
    dest: &mut [u8],
    at: usize,
) -> (std::path::PathBuf, Vec<u8>) {
    let path = target.store.chunk_path(&hash);
    let file = std::fs::read(&path).unwrap();
    let mut flipped = file.clone();
    flipped[4096 + at] ^= 1;
    std::fs::write(&path, &flipped).unwrap();
    let fetched = transport.get_into(hash, dest).await.unwrap();
    assert!(matches!(fetched, Fetched::Placed(placed) if placed == ChunkHash::of(dest) && placed != hash));
    (path, file)
}

/// A 3 MiB chunk through a transport with 1 MiB slots: stored, read whole and in part, and read
/// into the caller's memory straight from the stream (not tried in a slot first).
async fn larger_than_a_slot(transport: &dyn ChunkTransport) {
    let (hash, data) = chunk(3 << 20, 9);
    assert!(!transport.put(hash, Payload::raw(data.clone())).await.unwrap());
    assert_eq!(transport.get(hash, 0, 0).await.unwrap().bytes, data);
    assert_eq!(transport.get(hash, 5, 1 << 20).await.unwrap().bytes, data.slice(5..(1 << 20) + 5));
    let mut dest = vec![0u8; data.len()];
    let fetched = transport.get_into(hash, &mut dest).await.unwrap();
    assert!(matches!(fetched, Fetched::Placed(placed) if placed == hash), "{fetched:?}");
    assert_eq!(dest, data);
}

/// A target that accepts connections and holds them open, answering nothing, or (`half_a_payload`)
/// answering each connection's first request with a GET response of a 1 MiB payload of which it
/// sends half. Counts the connections it accepted.
async fn silent_target(half_a_payload: bool) -> (std::net::SocketAddr, Arc<AtomicU32>) {
    use tokio::io::AsyncWriteExt;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicU32::new(0));
    let counter = Arc::clone(&accepted);
    tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            counter.fetch_add(1, Ordering::SeqCst);
            if half_a_payload {
                let (header, _) = starckpt_proto::frame::read_frame_head(&mut socket).await.unwrap();
                let response = prost::Message::encode_to_vec(&starckpt_proto::data::Response::default());
                let fixed = starckpt_proto::frame::FrameHeader {
                    opcode: Opcode::GetResponse,
                    request_id: header.request_id,
                    header_len: response.len() as u32,
                    payload_len: 1 << 20,
                };
                socket.write_all(&fixed.encode()).await.unwrap();
                socket.write_all(&response).await.unwrap();
                socket.write_all(&vec![5u8; 1 << 19]).await.unwrap();
            }
            held.push(socket);
        }
    });
    (address, accepted)
}

/// Deadlines short enough for a test to wait them out: 300 ms, and bytes at 1 GiB/s.
fn short_deadline() -> Deadline {
    Deadline { allowance: Duration::from_millis(300), floor_bytes_per_sec: 1 << 30 }
}

#[tokio::test]
async fn a_silent_target_times_out_instead_of_hanging() {
    let (address, _) = silent_target(false).await;
    let config = TcpConfig { deadline: short_deadline(), ..TcpConfig::default() };
    let transport = TcpTransport::new(address, config);
    let Err(error) = transport.stat().await else { panic!("a silent target answered") };
    assert!(matches!(error, TransportError::Timeout(_)), "{error}");
}

/// A raw chunk of the caller's buffer's size is read from the socket straight into it, hashed as
/// it arrives; any other comes back as a payload. Requests abandoned before or while their payload
/// is read leave the transport serving the next ones correctly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_gets_land_in_the_callers_buffer() {
    let dir = tempfile::tempdir().unwrap();
    let target = start_target(dir.path(), "127.0.0.1:0").await;
    let transport = Arc::new(tcp(target.address, 1));
    let (hash, data) = chunk(4 << 20, 11);
    transport.put(hash, Payload::raw(data.clone())).await.unwrap();
    let mut dest = vec![0u8; data.len()];
    let fetched = transport.get_into(hash, &mut dest).await.unwrap();
    assert!(matches!(fetched, Fetched::Placed(placed) if placed == hash), "{fetched:?}");
    assert_eq!(dest, data);
    // Another length than the chunk's: a payload, the buffer untouched.
    let mut short = vec![0u8; data.len() - 1];
    let Fetched::Payload(payload) = transport.get_into(hash, &mut short).await.unwrap() else { panic!("placed") };
    assert_eq!((payload.bytes, short.iter().all(|b| *b == 0)), (data.clone(), true));
    // Compressed: as stored, for the caller to decode.
    let (packed_hash, floats) = float_chunk(200_000);
    let packed = codec::compress(&floats, &CompressConfig::default()).expect("compresses");
    let payload = Payload { bytes: Bytes::from(packed.bytes), codec: packed.codec, length: floats.len() as u64 };
    transport.put(packed_hash, payload.clone()).await.unwrap();
    let mut dest_floats = vec![0u8; floats.len()];
    let fetched = transport.get_into(packed_hash, &mut dest_floats).await.unwrap();
    assert!(matches!(&fetched, Fetched::Payload(p) if *p == payload), "{fetched:?}");
    let (path, file) = flipped_bit_comes_through(&target, transport.as_ref(), hash, &mut dest, 77).await;
    std::fs::write(&path, &file).unwrap();
    let missing = ChunkHash::of(b"missing");
    let error = transport.get_into(missing, &mut dest).await.unwrap_err();
    assert!(matches!(error, TransportError::Remote { code: ErrorCode::NotFound, .. }), "{error}");

    // Abandoned at every stage: before the response, with the stream lent but unread, midway.
    for round in 0..40u64 {
        let wait = Duration::from_micros(round * round * 5);
        let _ = tokio::time::timeout(wait, transport.get_into(hash, &mut dest)).await;
    }
    // Then many at once on the one connection, landing and not, each with the right bytes.
    let tasks: Vec<_> = (0..24)
        .map(|i| {
            let (transport, data, floats) = (Arc::clone(&transport), data.clone(), floats.clone());
            tokio::spawn(async move {
                if i % 3 == 0 {
                    let got = transport.get(packed_hash, 0, 0).await.unwrap();
                    assert_eq!(got.verified(&Addressing::plain(), packed_hash, floats.len() as u64).unwrap().0, floats);
                } else {
                    let mut dest = vec![0u8; data.len()];
                    let fetched = transport.get_into(hash, &mut dest).await.unwrap();
                    assert!(matches!(fetched, Fetched::Placed(placed) if placed == hash));
                    assert_eq!(dest, data);
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
}

/// A target that sends half a GET's payload and goes silent: the caller reading it straight into
/// its buffer times out instead of hanging, and a fresh connection serves the next request.
#[tokio::test]
async fn a_payload_that_stops_midway_times_out() {
    let (address, accepted) = silent_target(true).await;
    let config = TcpConfig { deadline: short_deadline(), connections_per_target: 1, ..TcpConfig::default() };
    let transport = TcpTransport::new(address, config);
    let mut dest = vec![0u8; 1 << 20];
    let error = transport.get_into(ChunkHash::of(b"x"), &mut dest).await.unwrap_err();
    assert!(matches!(error, TransportError::Timeout(_)), "{error}");
    // The stream is mid-payload: that connection is closed, and the next request dials anew.
    let error = transport.get_into(ChunkHash::of(b"x"), &mut dest).await.unwrap_err();
    assert!(matches!(error, TransportError::Timeout(_)), "a fresh connection, the same silence: {error}");
    assert_eq!(accepted.load(Ordering::SeqCst), 2, "the second request went out on a fresh connection");
}

/// The shared-memory transport against a target serving both, with 1 MiB slots.
async fn shm_target(dir: &std::path::Path, slots: u32) -> (Target, ShmTransport) {
    shm_target_placing(dir, slots, None).await
}

async fn shm_target_placing(dir: &std::path::Path, slots: u32, placed_reads: Option<bool>) -> (Target, ShmTransport) {
    let socket = dir.join("shm.sock");
    let target = start_target_placing(&dir.join("data"), "127.0.0.1:0", Some(&socket), placed_reads).await;
    let transport = ShmTransport::connect(socket, None, TcpConfig::default(), slots, 1 << 20, None).await.unwrap();
    (target, transport)
}

/// Every operation over shared memory, with GETs read straight into slots or copied there.
async fn shm_operations_placing(placed_reads: bool) {
    let dir = tempfile::tempdir().unwrap();
    let (target, transport) = shm_target_placing(dir.path(), 4, Some(placed_reads)).await;
    assert_eq!(transport.kind(), "shm");
    operations(&transport).await;
    // A payload larger than a slot travels inline on the same socket, both ways.
    larger_than_a_slot(&transport).await;
    // Into the caller's memory, exactly a slot's worth; then from a truncated file and a missing
    // one: errors, never the slot's stale bytes passed off as the chunk.
    let (hash, data) = chunk(1 << 20, 10);
    transport.put(hash, Payload::raw(data.clone())).await.unwrap();
    let mut dest = vec![0u8; 1 << 20];
    let fetched = transport.get_into(hash, &mut dest).await.unwrap();
    assert!(matches!(fetched, Fetched::Placed(placed) if placed == hash), "{fetched:?}");
    assert_eq!(dest, data);
    let (path, file) = flipped_bit_comes_through(&target, &transport, hash, &mut dest, 1000).await;
    assert_eq!(dest[1000], data[1000] ^ 1);
    std::fs::write(&path, &file[..file.len() - 8192]).unwrap();
    let error = transport.get_into(hash, &mut dest).await.unwrap_err();
    assert!(matches!(error, TransportError::Remote { code: ErrorCode::Corrupt, .. }), "{error}");
    std::fs::remove_file(&path).unwrap();
    let error = transport.get(hash, 0, 0).await.unwrap_err();
    assert!(matches!(error, TransportError::Remote { code: ErrorCode::NotFound, .. }), "{error}");
    // The target says which way it served them.
    let placed = transport.stat().await.unwrap().placed_reads;
    assert_eq!(placed > 0, placed_reads, "{placed} GETs read straight into slots");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_operations() {
    shm_operations_placing(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_operations_copying_into_slots() {
    shm_operations_placing(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_requests_share_few_slots() {
    let dir = tempfile::tempdir().unwrap();
    let (target, transport) = shm_target(dir.path(), 2).await;
    let transport = Arc::new(transport);
    let tasks: Vec<_> = (0..100u32)
        .map(|i| {
            let transport = Arc::clone(&transport);
            tokio::spawn(async move {
                let (hash, data) = chunk(1000 + i as usize * 7919, i as u8);
                transport.put(hash, Payload::raw(data.clone())).await.unwrap();
                assert_eq!(transport.get(hash, 0, 0).await.unwrap().bytes, data);
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(target.store.stats().chunk_count, 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_uses_shared_memory_on_this_host_and_tcp_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("shm.sock");
    let with_shm = start_target_with(&dir.path().join("a"), "127.0.0.1:0", Some(&socket)).await;
    let tcp_only = start_target(&dir.path().join("b"), "127.0.0.1:0").await;
    let (hash, data) = chunk(200_000, 3);
    let auto =
        |address, shm: ShmConfig| AutoTransport::new(address, "t", TcpConfig::default(), shm, 1 << 20, None, None);

    let local = auto(with_shm.address, ShmConfig::default());
    assert_eq!(local.kind(), "tcp", "undecided: TCP, while the target is asked in the background");
    assert!(!local.put(hash, Payload::raw(data.clone())).await.unwrap());
    local.settle().await;
    assert_eq!(local.kind(), "shm");
    assert_eq!(local.get(hash, 0, 0).await.unwrap().bytes, data);
    let stat = local.stat().await.unwrap();
    assert_eq!(stat.shm.unwrap().socket, socket);

    let disabled = auto(with_shm.address, ShmConfig { enabled: false, ..ShmConfig::default() });
    assert_eq!(disabled.get(hash, 0, 0).await.unwrap().bytes, data);
    disabled.settle().await;
    assert_eq!(disabled.kind(), "tcp");

    let remote = auto(tcp_only.address, ShmConfig::default());
    assert!(!remote.put(hash, Payload::raw(data.clone())).await.unwrap());
    remote.settle().await;
    assert_eq!(remote.kind(), "tcp", "a target without shared memory is reached over TCP");

    // The shared-memory socket disappears (a target restarted elsewhere): requests fall back to
    // TCP instead of failing.
    let _ = with_shm.stop.send(true);
    with_shm.task.await.unwrap();
    let restarted = start_target_with(&dir.path().join("a"), &with_shm.address.to_string(), None).await;
    assert_eq!(local.get(hash, 0, 0).await.unwrap().bytes, data);
    drop(restarted);
}

/// A target maps at most `max_shm_region_bytes` of clients' slot regions at once: an attach past
/// that is answered busy and the client's requests go over TCP, until a region is given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_memory_regions_are_bounded_per_target() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("shm.sock");
    let listener = ShmListener::new(tokio::net::UnixListener::bind(&socket).unwrap(), socket.clone());
    // Room for one region of 4 slots of 1 MiB.
    let limits = DataPlaneLimits { max_shm_region_bytes: 4 << 20, ..DataPlaneLimits::default() };
    let transports = Transports { shm: Some(listener), rdma: None, cluster_key: None };
    let target = start_target_on(&dir.path().join("data"), "127.0.0.1:0", transports, limits).await;
    let attach = || ShmTransport::connect(socket.clone(), None, TcpConfig::default(), 4, 1 << 20, None);
    let first = attach().await.unwrap();
    let (hash, data) = chunk(200_000, 3);
    assert!(!first.put(hash, Payload::raw(data.clone())).await.unwrap());

    let error = attach().await.err().expect("a second region past the limit was attached");
    assert!(error.to_string().contains("no room"), "{error}");
    // A region that would fit were the first one gone (4 slots of 1 MiB).
    let shm = ShmConfig { slots: 4, ..ShmConfig::default() };
    let auto = AutoTransport::new(target.address, "t", TcpConfig::default(), shm, 1 << 20, None, None);
    assert_eq!(auto.get(hash, 0, 0).await.unwrap().bytes, data);
    auto.settle().await;
    assert_eq!(auto.kind(), "tcp", "no room for its region: TCP");
    assert_eq!(auto.get(hash, 0, 0).await.unwrap().bytes, data);

    // The first client goes away: its room comes back.
    drop(first);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let again = loop {
        match attach().await {
            Ok(transport) => break transport,
            Err(error) => {
                assert!(std::time::Instant::now() < deadline, "the region was not given back: {error}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    assert_eq!(again.get(hash, 0, 0).await.unwrap().bytes, data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_shared_memory_attach_is_refused() {
    use starckpt_dataplane::shm::{self, Attach, Region};
    use std::os::fd::AsFd;
    use tokio::io::AsyncReadExt;
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("shm.sock");
    let target = start_target_with(&dir.path().join("data"), "127.0.0.1:0", Some(&socket)).await;
    // A region smaller than the geometry it claims; garbage instead of an attach.
    let small = Region::create("small", 4096).unwrap();
    let mut stream = tokio::net::UnixStream::connect(&socket).await.unwrap();
    shm::send_attach(&stream, Attach { slots: 4, slot_bytes: 4096, staging_bytes: 0 }, &[], small.fd(), None)
        .await
        .unwrap();
    let mut answer = [0u8; 8];
    assert!(stream.read_exact(&mut answer).await.is_err(), "an undersized region was accepted");
    let mut stream = tokio::net::UnixStream::connect(&socket).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut stream, &[7u8; 16]).await.unwrap();
    assert!(stream.read_exact(&mut answer).await.is_err(), "garbage was accepted");
    // Attached properly, a frame naming a slot outside the region, or a length beyond its slot,
    // is a BAD_REQUEST, and the connection goes on serving.
    let region = Region::create("good", 2 * 4096).unwrap();
    let mut stream = tokio::net::UnixStream::connect(&socket).await.unwrap();
    shm::send_attach(&stream, Attach { slots: 2, slot_bytes: 4096, staging_bytes: 0 }, &[], region.fd(), None)
        .await
        .unwrap();
    stream.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, shm::ATTACH_OK);
    let (hash, data) = chunk(4000, 1);
    region.write_at(4096, &data).unwrap();
    let put = |slot: u32, length: u64| {
        use prost::Message;
        starckpt_proto::data::PutRequest {
            hash: hash.to_bytes(),
            shm_slot: slot,
            shm_length: length,
            ..Default::default()
        }
        .encode_to_vec()
    };
    for (id, (slot, length), code) in
        [(1, (3, 4000), ErrorCode::BadRequest), (2, (2, 4097), ErrorCode::BadRequest), (3, (2, 4000), ErrorCode::Ok)]
    {
        let header = put(slot, length);
        starckpt_proto::frame::write_frame(&mut stream, Opcode::Put, id, &header, &[]).await.unwrap();
        let (head, response) = starckpt_proto::frame::read_frame_head(&mut stream).await.unwrap();
        let response = <starckpt_proto::data::Response as prost::Message>::decode(response).unwrap();
        assert_eq!((head.request_id, response.code), (id, code as i32), "{}", response.message);
    }
    assert_eq!(target.store.stats().chunk_count, 1);

    // A staging region smaller than it claims, not sealed, or writable by the target (sealed
    // only against resizing, like a slot region) is refused; so are descriptors that do not
    // match the message.
    let slots = Region::create("slots", 4096).unwrap();
    let attach = Attach { slots: 1, slot_bytes: 4096, staging_bytes: 3 * 4096 };
    let staging = Region::create_private_writes("staging", 3 * 4096).unwrap();
    let small = Region::create_private_writes("small", 2 * 4096).unwrap();
    let unsealed = std::fs::File::options().create_new(true).read(true).write(true).open(dir.path().join("u")).unwrap();
    unsealed.set_len(3 * 4096).unwrap();
    let writable = Region::create("writable", 3 * 4096).unwrap();
    for (why, staging_fd) in
        [("undersized", small.fd()), ("unsealed", unsealed.as_fd()), ("writable by the target", writable.fd())]
    {
        let mut stream = tokio::net::UnixStream::connect(&socket).await.unwrap();
        shm::send_attach(&stream, attach, &[], slots.fd(), Some(staging_fd)).await.unwrap();
        assert!(stream.read_exact(&mut answer).await.is_err(), "a staging region {why} was accepted");
    }
    let raw_attach = |message: Vec<u8>, fds: Vec<std::os::fd::RawFd>| {
        let socket = socket.clone();
        async move {
            let stream = std::os::unix::net::UnixStream::connect(&socket).unwrap();
            let cmsgs = [nix::sys::socket::ControlMessage::ScmRights(&fds)];
            let iov = [std::io::IoSlice::new(&message)];
            use std::os::fd::AsRawFd;
            nix::sys::socket::sendmsg::<()>(
                stream.as_raw_fd(),
                &iov,
                &cmsgs,
                nix::sys::socket::MsgFlags::empty(),
                None,
            )
            .unwrap();
            let mut stream = tokio::net::UnixStream::from_std({
                stream.set_nonblocking(true).unwrap();
                stream
            })
            .unwrap();
            let mut answer = [0u8; 8];
            stream.read_exact(&mut answer).await.is_ok()
        }
    };
    use std::os::fd::AsRawFd;
    let (slots_fd, staging_fd) = (slots.fd().as_raw_fd(), staging.fd().as_raw_fd());
    let slots_only = Attach { staging_bytes: 0, ..attach };
    assert!(raw_attach(attach.encode(&[]), vec![slots_fd, staging_fd]).await, "a proper version-2 attach");
    assert!(!raw_attach(attach.encode(&[]), vec![slots_fd]).await, "a staging region without its descriptor");
    assert!(!raw_attach(slots_only.encode(&[]), vec![slots_fd, staging_fd]).await, "an extra descriptor");
    assert!(!raw_attach(attach.encode(&[]), vec![slots_fd; 5]).await, "five descriptors");
    assert!(raw_attach(slots_only.encode(&[]), vec![slots_fd]).await, "a version-1 attach");

    // With a staging region: a PUT names a range of it; one outside it, one that also names a
    // slot, or bytes that do not match the hash are refused, and the connection goes on serving.
    let mut stream = tokio::net::UnixStream::connect(&socket).await.unwrap();
    shm::send_attach(&stream, attach, &[], slots.fd(), Some(staging.fd())).await.unwrap();
    stream.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, shm::ATTACH_OK);
    let (hash, data) = chunk(5000, 2);
    staging.write_at(4096, &data).unwrap();
    let staged = |offset: u64, length: u64, slot: u32| {
        use prost::Message;
        starckpt_proto::data::PutRequest {
            hash: hash.to_bytes(),
            shm_slot: slot,
            shm_length: if slot == 0 { 0 } else { length },
            staging: Some(starckpt_proto::data::StagingRange { offset, length }),
            ..Default::default()
        }
        .encode_to_vec()
    };
    for (id, header, code) in [
        (1, staged(4096 * 2, 5000, 0), ErrorCode::BadRequest),
        (2, staged(u64::MAX - 10, 5000, 0), ErrorCode::BadRequest),
        (3, staged(4096, 5000, 1), ErrorCode::BadRequest),
        (4, staged(4096, 0, 0), ErrorCode::BadRequest),
        (5, staged(0, 5000, 0), ErrorCode::HashMismatch),
        (6, staged(4096, 5000, 0), ErrorCode::Ok),
    ] {
        starckpt_proto::frame::write_frame(&mut stream, Opcode::Put, id, &header, &[]).await.unwrap();
        let (head, response) = starckpt_proto::frame::read_frame_head(&mut stream).await.unwrap();
        let response = <starckpt_proto::data::Response as prost::Message>::decode(response).unwrap();
        assert_eq!((head.request_id, response.code), (id, code as i32), "{}", response.message);
    }
    assert_eq!(target.store.stats().chunk_count, 2);
    assert_eq!(&target.store.get(hash, 0, 0).await.unwrap().bytes[..], &data[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_that_refuses_staging_memory_gets_puts_through_slots() {
    use prost::Message;
    use starckpt_dataplane::buf::BufPool;
    use starckpt_dataplane::shm::{self, Region};
    // A target from before staging regions: it closes a connection whose attach carries one, and
    // serves STAT and slot PUTs (checking each payload's hash).
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("old.sock");
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    let (refused, slot_puts) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let (refused_seen, slot_puts_seen) = (Arc::clone(&refused), Arc::clone(&slot_puts));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (refused, slot_puts) = (Arc::clone(&refused), Arc::clone(&slot_puts));
            tokio::spawn(async move {
                let attached = shm::recv_attach(&stream).await.unwrap();
                if attached.staging.is_some() {
                    refused.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                let region = Region::attach(attached.slots, attached.attach.region_bytes()).unwrap();
                stream.writable().await.unwrap();
                stream.try_write(shm::ATTACH_OK).unwrap();
                let (mut reader, mut writer) = stream.into_split();
                while let Ok((head, header)) = starckpt_proto::frame::read_frame_head(&mut reader).await {
                    let mut answer = starckpt_proto::data::Response::default();
                    if head.opcode == Opcode::Put {
                        let put = starckpt_proto::data::PutRequest::decode(header).unwrap();
                        assert!(put.staging.is_none() && put.shm_slot != 0, "{put:?}");
                        let offset = (put.shm_slot as usize - 1) * attached.attach.slot_bytes as usize;
                        let mut payload = vec![0u8; put.shm_length as usize];
                        region.read_at(offset, &mut payload).unwrap();
                        assert_eq!(ChunkHash::of(&payload).to_bytes(), put.hash);
                        slot_puts.fetch_add(1, Ordering::Relaxed);
                    }
                    let (opcode, id) = (head.opcode.response(), head.request_id);
                    starckpt_proto::frame::write_frame(&mut writer, opcode, id, &answer.encode_to_vec(), &[])
                        .await
                        .unwrap();
                    answer.clear();
                }
            });
        }
    });
    let staging = BufPool::shared("staging", 1 << 20, 2).unwrap();
    let config = TcpConfig::default();
    let arena = staging.arena().cloned();
    let transport = ShmTransport::connect(socket, None, config, 2, 1 << 20, arena).await.unwrap();
    for seed in 0..3u8 {
        let (hash, data) = chunk(100_000, seed);
        let mut staged = staging.acquire().await;
        staged.buf_mut().full_mut()[..data.len()].copy_from_slice(&data);
        staged.buf_mut().set_len(data.len());
        assert!(!transport.put(hash, Payload::raw(staged.freeze())).await.unwrap());
    }
    assert_eq!((refused_seen.load(Ordering::Relaxed), slot_puts_seen.load(Ordering::Relaxed)), (1, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_waiting_for_a_slot_fail_instead_of_hanging_when_its_holder_times_out() {
    use prost::Message;
    use starckpt_dataplane::shm::{self, Region};
    // A target that attaches every region and answers STAT, but never a GET.
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("silent.sock");
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let attached = shm::recv_attach(&stream).await.unwrap();
                let _region = Region::attach(attached.slots, attached.attach.region_bytes()).unwrap();
                stream.writable().await.unwrap();
                stream.try_write(shm::ATTACH_OK).unwrap();
                let (mut reader, mut writer) = stream.into_split();
                while let Ok((head, _)) = starckpt_proto::frame::read_frame_head(&mut reader).await {
                    if head.opcode == Opcode::Stat {
                        let answer = starckpt_proto::data::Response::default().encode_to_vec();
                        let (opcode, id) = (head.opcode.response(), head.request_id);
                        starckpt_proto::frame::write_frame(&mut writer, opcode, id, &answer, &[]).await.unwrap();
                    }
                }
            });
        }
    });
    let config = TcpConfig { deadline: short_deadline(), ..TcpConfig::default() };
    let transport = Arc::new(ShmTransport::connect(socket, None, config, 1, 1 << 20, None).await.unwrap());
    // One slot, three GETs: the first holds it and times out; the others must not wait forever
    // for a slot that is never handed back.
    let gets: Vec<_> = (0..3u8)
        .map(|i| {
            let transport = Arc::clone(&transport);
            tokio::spawn(async move { transport.get(ChunkHash::of(&[i]), 0, 0).await })
        })
        .collect();
    for get in gets {
        let outcome = tokio::time::timeout(Duration::from_secs(20), get).await.expect("a GET hung").unwrap();
        assert!(outcome.unwrap_err().is_connection());
    }
}

// ---- RDMA, over the in-process software fabric (starckpt_rdma::soft) ----

use starckpt_dataplane::buf::BufPool;
use starckpt_rdma::soft::SoftDevice;

/// A target serving TCP and RDMA on its own software device.
async fn rdma_target(dir: &std::path::Path, limits: DataPlaneLimits) -> (Target, Arc<SoftDevice>) {
    let device = SoftDevice::new("target");
    let transports = Transports { shm: None, rdma: Some(device.clone()), cluster_key: None };
    (start_target_on(dir, "127.0.0.1:0", transports, limits).await, device)
}

/// A client's RDMA state on its own software device, with a staging pool of 1 MiB buffers carved
/// out of a memfd, as a client with shared memory on (the default) has them (`copies.rs` runs
/// RDMA with heap staging).
fn rdma_client() -> (Arc<RdmaClient>, BufPool, Arc<SoftDevice>) {
    let device = SoftDevice::new("client");
    let pool = BufPool::shared("staging", 1 << 20, 4).unwrap();
    (RdmaClient::new(device.clone(), &pool, 4, 1 << 20).unwrap(), pool, device)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_operations() {
    let dir = tempfile::tempdir().unwrap();
    let (target, _target_device) = rdma_target(dir.path(), DataPlaneLimits::default()).await;
    let (client, _pool, client_device) = rdma_client();
    let transport =
        RdmaTransport::connect(target.address, None, TcpConfig::default(), Arc::clone(&client)).await.unwrap();
    assert_eq!(transport.kind(), "rdma");
    let stat = transport.stat().await.unwrap();
    assert_eq!(stat.rdma_device.as_deref(), Some("target"));
    operations(&transport).await;
    // A payload larger than a receive slot comes back in the frame; one larger than a staging
    // buffer is registered for its request.
    larger_than_a_slot(&transport).await;
    // Per-request registrations are gone; the client's receive region remains, until the client.
    assert_eq!(client_device.registered_regions(), 1);
    drop(transport);
    assert_eq!(client_device.registered_regions(), 1);
    drop(client);
    assert_eq!(client_device.registered_regions(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_registers_staging_buffers_once_and_serves_many_requests_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let (target, target_device) = rdma_target(dir.path(), DataPlaneLimits::default()).await;
    let (client, pool, client_device) = rdma_client();
    let transport = Arc::new(
        RdmaTransport::connect(target.address, None, TcpConfig::default(), Arc::clone(&client)).await.unwrap(),
    );
    // Staged payloads (pool buffers) are registered once each, however many times they are sent.
    let tasks: Vec<_> = (0..64u32)
        .map(|i| {
            let (transport, pool) = (Arc::clone(&transport), pool.clone());
            tokio::spawn(async move {
                let (hash, data) = chunk(1000 + i as usize * 9973, i as u8);
                let mut staged = pool.acquire().await;
                staged.buf_mut().full_mut()[..data.len()].copy_from_slice(&data);
                staged.buf_mut().set_len(data.len());
                transport.put(hash, Payload::raw(staged.freeze())).await.unwrap();
                assert_eq!(transport.get(hash, 0, 0).await.unwrap().bytes, data);
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(target.store.stats().chunk_count, 64);
    assert!((1..=4).contains(&client.registered_staging_buffers()), "{}", client.registered_staging_buffers());
    // The client: its staging buffers and one receive region; the target: its pool's buffers.
    assert_eq!(client_device.registered_regions(), client.registered_staging_buffers() + 1);
    assert!(target_device.registered_regions() <= 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_requests_that_lie_are_refused() {
    use prost::Message;
    use starckpt_dataplane::rdma::{RemoteBuffer, endpoint_from_wire, endpoint_to_wire};
    use starckpt_proto::data::{self, ConnectRequest, Response};
    use starckpt_proto::frame::{read_frame_head, write_frame};
    use starckpt_rdma::{Access, Verbs};

    let dir = tempfile::tempdir().unwrap();
    let (target, _target_device) = rdma_target(&dir.path().join("a"), DataPlaneLimits::default()).await;
    let plain = start_target(&dir.path().join("b"), "127.0.0.1:0").await;
    let device = SoftDevice::new("raw");
    let (hash, data) = chunk(8192, 4);
    let mut source = data.to_vec();
    let region = unsafe { device.register(source.as_mut_ptr(), source.len(), Access::REMOTE_READ) }.unwrap();
    let good = RemoteBuffer { addr: region.addr(), rkey: region.rkey(), len: 8192 };
    let put = |remote: RemoteBuffer| {
        data::PutRequest { hash: hash.to_bytes(), rdma: Some(remote.to_wire()), ..Default::default() }.encode_to_vec()
    };
    async fn call(stream: &mut tokio::net::TcpStream, opcode: Opcode, id: u64, header: &[u8]) -> Response {
        write_frame(stream, opcode, id, header, &[]).await.unwrap();
        let (head, response) = read_frame_head(stream).await.unwrap();
        assert_eq!(head.request_id, id);
        Response::decode(response).unwrap()
    }
    let code = |response: &Response| ErrorCode::try_from(response.code).unwrap();

    // A remote buffer before OP_CONNECT, and OP_CONNECT to a target without RDMA: BAD_REQUEST.
    let mut stream = tokio::net::TcpStream::connect(target.address).await.unwrap();
    assert_eq!(code(&call(&mut stream, Opcode::Put, 1, &put(good)).await), ErrorCode::BadRequest);
    let qp = device.create_qp(8, Access::REMOTE_READ).unwrap();
    let connect =
        ConnectRequest { endpoint: Some(endpoint_to_wire(&qp.endpoint())), ..Default::default() }.encode_to_vec();
    let mut elsewhere = tokio::net::TcpStream::connect(plain.address).await.unwrap();
    assert_eq!(code(&call(&mut elsewhere, Opcode::Connect, 1, &connect).await), ErrorCode::BadRequest);
    // A malformed endpoint.
    let mut bad_endpoint = endpoint_to_wire(&qp.endpoint());
    bad_endpoint.gid = bytes::Bytes::from_static(&[1, 2, 3]);
    let bad_connect = ConnectRequest { endpoint: Some(bad_endpoint), ..Default::default() }.encode_to_vec();
    assert_eq!(code(&call(&mut stream, Opcode::Connect, 2, &bad_connect).await), ErrorCode::BadRequest);

    // Connected: a second OP_CONNECT is refused; a good PUT is stored.
    let answer = call(&mut stream, Opcode::Connect, 3, &connect).await;
    assert_eq!(code(&answer), ErrorCode::Ok, "{}", answer.message);
    qp.connect(&endpoint_from_wire(answer.rdma_endpoint.as_ref().unwrap()).unwrap()).unwrap();
    assert_eq!(code(&call(&mut stream, Opcode::Connect, 4, &connect).await), ErrorCode::BadRequest);
    let stored = call(&mut stream, Opcode::Put, 5, &put(good)).await;
    assert_eq!(code(&stored), ErrorCode::Ok, "{}", stored.message);
    assert_eq!(target.store.stats().chunk_count, 1);

    // Zero and absurd lengths are refused before any transfer; a wrong rkey or a range past the
    // region fails the transfer (and the queue pair): TRANSFER_FAILED; nothing is stored.
    let (other, _) = chunk(8192, 5);
    let put_other = |remote: RemoteBuffer| {
        data::PutRequest { hash: other.to_bytes(), rdma: Some(remote.to_wire()), ..Default::default() }.encode_to_vec()
    };
    let absurd = data::PutRequest {
        hash: other.to_bytes(),
        rdma: Some(data::RemoteBuffer { addr: region.addr(), rkey: region.rkey(), length: 1 << 40 }),
        ..Default::default()
    }
    .encode_to_vec();
    assert_eq!(code(&call(&mut stream, Opcode::Put, 6, &absurd).await), ErrorCode::BadRequest);
    let wrong_key = RemoteBuffer { rkey: region.rkey() + 77, ..good };
    assert_eq!(code(&call(&mut stream, Opcode::Put, 7, &put_other(wrong_key)).await), ErrorCode::TransferFailed);
    // The queue pair is in the error state now: even a good request fails its transfer.
    assert_eq!(code(&call(&mut stream, Opcode::Put, 8, &put_other(good)).await), ErrorCode::TransferFailed);
    // A fresh connection with a range past the region's end.
    let mut stream = tokio::net::TcpStream::connect(target.address).await.unwrap();
    let qp = device.create_qp(8, Access::REMOTE_READ).unwrap();
    let connect =
        ConnectRequest { endpoint: Some(endpoint_to_wire(&qp.endpoint())), ..Default::default() }.encode_to_vec();
    let answer = call(&mut stream, Opcode::Connect, 1, &connect).await;
    qp.connect(&endpoint_from_wire(answer.rdma_endpoint.as_ref().unwrap()).unwrap()).unwrap();
    let past_end = RemoteBuffer { addr: region.addr() + 4096, ..good };
    assert_eq!(code(&call(&mut stream, Opcode::Put, 2, &put_other(past_end)).await), ErrorCode::TransferFailed);
    // A GET into a buffer the client registered read-only fails its transfer too.
    let mut stream = tokio::net::TcpStream::connect(target.address).await.unwrap();
    let qp = device.create_qp(8, Access::REMOTE_READ).unwrap();
    let connect =
        ConnectRequest { endpoint: Some(endpoint_to_wire(&qp.endpoint())), ..Default::default() }.encode_to_vec();
    let answer = call(&mut stream, Opcode::Connect, 1, &connect).await;
    qp.connect(&endpoint_from_wire(answer.rdma_endpoint.as_ref().unwrap()).unwrap()).unwrap();
    let get = data::GetRequest { hash: hash.to_bytes(), rdma: Some(good.to_wire()), ..Default::default() };
    assert_eq!(code(&call(&mut stream, Opcode::Get, 2, &get.encode_to_vec()).await), ErrorCode::TransferFailed);
    assert_eq!(target.store.stats().chunk_count, 1);
    drop(region);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_uses_rdma_when_both_sides_have_it_and_falls_back_to_tcp() {
    let dir = tempfile::tempdir().unwrap();
    let limits = DataPlaneLimits { frame_timeout: Duration::from_millis(300), ..DataPlaneLimits::default() };
    let (with_rdma, target_device) = rdma_target(&dir.path().join("a"), limits.clone()).await;
    let tcp_only = start_target(&dir.path().join("b"), "127.0.0.1:0").await;
    let (client, _pool, _client_device) = rdma_client();
    let (hash, data) = chunk(200_000, 3);
    let no_shm = ShmConfig { enabled: false, ..ShmConfig::default() };
    let auto = |address, rdma: Option<Arc<RdmaClient>>| {
        AutoTransport::new(address, "t", TcpConfig::default(), no_shm.clone(), 1 << 20, None, rdma)
    };

    let fast = auto(with_rdma.address, Some(Arc::clone(&client)));
    assert!(!fast.put(hash, Payload::raw(data.clone())).await.unwrap());
    fast.settle().await;
    assert_eq!(fast.kind(), "rdma");
    assert_eq!(fast.get(hash, 0, 0).await.unwrap().bytes, data);

    // No RDMA on the client (no device, or a build without the feature), or none on the target:
    // TCP, with no change for the caller.
    for (address, rdma) in [(with_rdma.address, None), (tcp_only.address, Some(Arc::clone(&client)))] {
        let plain = auto(address, rdma);
        assert!(plain.put(hash, Payload::raw(data.clone())).await.is_ok());
        plain.settle().await;
        assert_eq!(plain.kind(), "tcp");
        assert_eq!(plain.get(hash, 0, 0).await.unwrap().bytes, data);
    }

    // The link hangs mid-transfer: the target's transfer times out, its queue pair fails, the
    // request is answered TRANSFER_FAILED, and the client retries over TCP, which it then keeps
    // using (the target is asked again later, not on every request).
    target_device.stall();
    let (second, second_data) = chunk(100_000, 4);
    assert!(!fast.put(second, Payload::raw(second_data.clone())).await.unwrap());
    assert_eq!(fast.kind(), "tcp");
    assert_eq!(fast.get(second, 0, 0).await.unwrap().bytes, second_data);
    // A queue pair that connects over a path that carries no data is never chosen: the probe
    // transfer of the setup fails.
    let hung = auto(with_rdma.address, Some(Arc::clone(&client)));
    hung.settle().await;
    assert_eq!(hung.kind(), "tcp");
    target_device.resume();

    // The target restarts without RDMA after the client chose it: requests go over TCP.
    let fresh = auto(with_rdma.address, Some(Arc::clone(&client)));
    fresh.settle().await;
    assert_eq!(fresh.kind(), "rdma");
    let _ = with_rdma.stop.send(true);
    with_rdma.task.await.unwrap();
    let address = with_rdma.address.to_string();
    let _restarted = start_target_on(&dir.path().join("a"), &address, Transports::default(), limits).await;
    assert_eq!(fresh.get(hash, 0, 0).await.unwrap().bytes, data);
    let (third, third_data) = chunk(50_000, 5);
    assert!(!fresh.put(third, Payload::raw(third_data.clone())).await.unwrap());
    assert_eq!(fresh.kind(), "tcp");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_rdma_gets_free_the_shared_receive_slots_for_other_targets() {
    let dir = tempfile::tempdir().unwrap();
    let (hung, hung_device) = rdma_target(&dir.path().join("a"), DataPlaneLimits::default()).await;
    let (healthy, _device) = rdma_target(&dir.path().join("b"), DataPlaneLimits::default()).await;
    let (client, _pool, _client_device) = rdma_client();
    let connect = |address| RdmaTransport::connect(address, None, TcpConfig::default(), Arc::clone(&client));
    let (to_hung, to_healthy) = (connect(hung.address).await.unwrap(), connect(healthy.address).await.unwrap());
    let (hash, data) = chunk(100_000, 6);
    to_hung.put(hash, Payload::raw(data.clone())).await.unwrap();
    to_healthy.put(hash, Payload::raw(data.clone())).await.unwrap();
    // Every one of the client's 4 receive slots is taken by a GET the hung target never answers;
    // the callers give up (their futures are dropped while the target may still write the slots).
    hung_device.stall();
    let gets: Vec<_> =
        (0..4).map(|_| tokio::time::timeout(Duration::from_millis(200), to_hung.get(hash, 0, 0))).collect();
    for outcome in futures::future::join_all(gets).await {
        assert!(outcome.is_err(), "a GET from the hung target finished");
    }
    // The slots come back at once (the hung connection's queue pair is destroyed), not when that
    // target is next used: another target's GETs go on.
    let got = tokio::time::timeout(Duration::from_secs(10), to_healthy.get(hash, 0, 0)).await;
    assert_eq!(got.expect("waited for a receive slot").unwrap().bytes, data);
    hung_device.resume();
}

/// Waits until `done` holds of the transport's zero-copy counts (the write loops take the kernel's
/// notifications between frames, after the responses may already have arrived).
async fn zero_copy_settled(transport: &TcpTransport, done: impl Fn(&ZeroCopyCounts) -> bool) -> ZeroCopyCounts {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let counts = transport.zero_copy_counts();
        if done(&counts) || tokio::time::Instant::now() > deadline {
            return counts;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_copy_sends_carry_puts_and_gets_intact() {
    let dir = tempfile::tempdir().unwrap();
    let limits = DataPlaneLimits { zero_copy_send: ZeroCopySend::Always, ..DataPlaneLimits::default() };
    let target = start_target_on(dir.path(), "127.0.0.1:0", Transports::default(), limits).await;
    let config = TcpConfig { zero_copy_send: ZeroCopySend::Always, ..TcpConfig::default() };
    let transport = TcpTransport::new(target.address, config);
    // Large payloads of odd lengths, several in flight at once, go zero-copy; a small one plainly.
    let chunks: Vec<(ChunkHash, Bytes)> = (0..8).map(|i| chunk((1 << 20) - 4097 * i, i as u8)).collect();
    let puts = chunks.iter().map(|(hash, data)| transport.put(*hash, Payload::raw(data.clone())));
    for stored in futures::future::join_all(puts).await {
        assert!(!stored.unwrap());
    }
    let (small, small_data) = chunk(4096, 99);
    assert!(!transport.put(small, Payload::raw(small_data.clone())).await.unwrap());
    let large_bytes: u64 = chunks.iter().map(|(_, data)| data.len() as u64).sum();
    let counts = zero_copy_settled(&transport, |c| c.notified == c.sends && c.held == 0).await;
    assert_eq!(counts.bytes, large_bytes, "{counts:?}");
    assert!(counts.sends >= chunks.len() as u64, "{counts:?}");
    // Every payload was held until its notification and then let go (over loopback the kernel
    // notifies during the send); each notification says the kernel copied after all.
    assert_eq!((counts.notified, counts.held), (counts.sends, 0), "{counts:?}");
    assert_eq!(counts.copied, counts.notified, "{counts:?}");
    assert_eq!(target.store.stats().chunk_count, chunks.len() as u64 + 1);

    // The target sends GET results zero-copy too: whole payloads and ones landed in place.
    for (hash, data) in &chunks {
        assert_eq!(&transport.get(*hash, 0, 0).await.unwrap().bytes, data);
    }
    let (hash, data) = &chunks[3];
    let mut landed = vec![0u8; data.len()];
    let fetched = transport.get_into(*hash, &mut landed).await.unwrap();
    assert!(matches!(fetched, Fetched::Placed(placed) if placed == *hash), "{fetched:?}");
    assert_eq!(&landed[..], &data[..]);
    assert_eq!(transport.get(small, 0, 0).await.unwrap().bytes, small_data);
    // Rounds of GETs, far more than the target has pool buffers (8): a result's buffer held for
    // a notification that was already taken would never come back, and GETs would stall.
    let transport = Arc::new(transport);
    for _ in 0..3 {
        let gets = (0..128).map(|i| {
            let (transport, (hash, data)) = (Arc::clone(&transport), chunks[i % chunks.len()].clone());
            tokio::spawn(async move {
                let mut landed = vec![0u8; data.len()];
                let got = tokio::time::timeout(Duration::from_secs(20), transport.get_into(hash, &mut landed)).await;
                assert!(matches!(got.expect("a GET stalled").unwrap(), Fetched::Placed(placed) if placed == hash));
            })
        });
        for got in futures::future::join_all(gets).await {
            got.unwrap();
        }
    }
    let stat = transport.stat().await.unwrap();
    assert!(stat.zero_copy_sends > 3 * 128, "{stat:?}");
    // The client's zero-copy counts did not move: GET requests carry no payload.
    assert_eq!(transport.zero_copy_counts().bytes, large_bytes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_zero_copy_stops_on_a_connection_once_the_kernel_reports_a_copy() {
    let dir = tempfile::tempdir().unwrap();
    let target = start_target_on(dir.path(), "127.0.0.1:0", Transports::default(), DataPlaneLimits::default()).await;
    // Auto is the default on both sides.
    let transport = tcp(target.address, 1);
    let chunks: Vec<(ChunkHash, Bytes)> = (0..16).map(|i| chunk(512 << 10, i)).collect();
    for (hash, data) in &chunks {
        assert!(!transport.put(*hash, Payload::raw(data.clone())).await.unwrap());
    }
    // Over loopback the first notification reports a copy: the connection writes plainly after.
    let counts = zero_copy_settled(&transport, |c| c.notified == c.sends).await;
    assert!(counts.sends >= 1 && counts.sends < chunks.len() as u64, "{counts:?}");
    assert!(counts.copied >= 1, "{counts:?}");
    for (hash, data) in &chunks {
        assert_eq!(&transport.get(*hash, 0, 0).await.unwrap().bytes, data);
    }
    let stat = transport.stat().await.unwrap();
    assert!(stat.zero_copy_sends >= 1 && stat.zero_copy_sends < chunks.len() as u64, "{stat:?}");
    assert!(stat.zero_copy_copied >= 1, "{stat:?}");

    // Off: plain writes only.
    let off =
        TcpTransport::new(target.address, TcpConfig { zero_copy_send: ZeroCopySend::Off, ..TcpConfig::default() });
    let (hash, data) = chunk(1 << 20, 77);
    assert!(!off.put(hash, Payload::raw(data.clone())).await.unwrap());
    assert_eq!(off.zero_copy_counts(), ZeroCopyCounts::default());
}

/// A target holding one 1 MiB chunk, and a raw connection that has sent `gets` GETs of it and
/// reads none of the results (yet).
async fn unread_gets(
    dir: &std::path::Path,
    limits: DataPlaneLimits,
    seed: u8,
    gets: u64,
) -> (Target, ChunkHash, Bytes, tokio::net::TcpStream) {
    let target = start_target_on(dir, "127.0.0.1:0", Transports::default(), limits).await;
    let (hash, data) = chunk(1 << 20, seed);
    assert!(!tcp(target.address, 1).put(hash, Payload::raw(data.clone())).await.unwrap());
    let mut stream = tokio::net::TcpStream::connect(target.address).await.unwrap();
    let get = starckpt_proto::data::GetRequest { hash: hash.to_bytes(), ..Default::default() }.encode_to_vec();
    for id in 1..=gets {
        starckpt_proto::frame::write_frame(&mut stream, Opcode::Get, id, &get, &[]).await.unwrap();
    }
    (target, hash, data, stream)
}

/// A client that sends GETs and stops reading: the target's sends of the results, zero-copy or
/// plain, time out, the connection is closed, and the buffers it held serve others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_cut_off_whatever_the_send_mode() {
    for mode in [ZeroCopySend::Always, ZeroCopySend::Off] {
        let dir = tempfile::tempdir().unwrap();
        let limits = DataPlaneLimits {
            frame_timeout: Duration::from_millis(300),
            zero_copy_send: mode,
            ..DataPlaneLimits::default()
        };
        // 48 MiB of results: more than the socket buffers of both ends hold.
        const GETS: u64 = 48;
        let (target, hash, data, mut stream) = unread_gets(dir.path(), limits, 5, GETS).await;
        // Ten times the target's timeout without reading; then what the target had sent ends early.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let mut received = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut received)).await;
        let total = match read.expect("the target closed the connection") {
            Ok(_) => received.len(),
            // Closed with requests unread: a reset.
            Err(error) => {
                assert_eq!(error.kind(), std::io::ErrorKind::ConnectionReset, "{mode}: {error}");
                received.len()
            }
        };
        assert!(total < (GETS as usize) * data.len(), "{mode}: {total} bytes, all of them");
        // Its buffers were given back: GETs go on.
        let fresh = tcp(target.address, 1);
        let got = tokio::time::timeout(Duration::from_secs(20), fresh.get(hash, 0, 0)).await;
        assert_eq!(got.expect("buffers were released").unwrap().bytes, data, "{mode}");
    }
}

/// One peer holds at most `max_connections_per_peer` connections: one past it is closed at once,
/// and a slot given back serves the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_past_its_connection_limit_is_closed_and_others_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let limits = DataPlaneLimits { max_connections_per_peer: 2, ..DataPlaneLimits::default() };
    let target = start_target_on(dir.path(), "127.0.0.1:0", Transports::default(), limits).await;
    let stat = starckpt_proto::data::StatRequest::default().encode_to_vec();
    // A connection that answers a STAT is served; one past the limit is closed, unanswered.
    async fn served(address: std::net::SocketAddr, stat: &[u8]) -> Option<tokio::net::TcpStream> {
        let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
        starckpt_proto::frame::write_frame(&mut stream, Opcode::Stat, 1, stat, &[]).await.ok()?;
        let head = tokio::time::timeout(Duration::from_secs(30), starckpt_proto::frame::read_frame_head(&mut stream));
        head.await.expect("neither answered nor closed").ok().map(|_| stream)
    }
    let first = served(target.address, &stat).await.expect("the first connection is served");
    let _second = served(target.address, &stat).await.expect("the second connection is served");
    assert!(served(target.address, &stat).await.is_none(), "a third connection was served");
    drop(first);
    // The slot comes back once the target sees the first connection closed.
    let mut again = None;
    for _ in 0..100 {
        again = served(target.address, &stat).await;
        if again.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(again.is_some(), "a slot given back was not taken again");
}

/// A client that reads none of its GET results holds at most its connection's share of the
/// target's in-flight bytes: other clients' GETs and PUTs still go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_holds_only_its_connections_share_of_in_flight_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let limits = DataPlaneLimits {
        frame_timeout: Duration::from_secs(120),
        max_inflight_bytes: 128 << 20,
        max_connection_inflight_bytes: 64 << 20,
        ..DataPlaneLimits::default()
    };
    let target = start_target_on(dir.path(), "127.0.0.1:0", Transports::default(), limits).await;
    let (hash, data) = chunk(4 << 20, 30);
    assert!(!tcp(target.address, 1).put(hash, Payload::raw(data.clone())).await.unwrap());
    // 48 GETs of 4 MiB, none read: far more than the socket buffers and the whole budget.
    const GETS: u64 = 48;
    let mut stuck = tokio::net::TcpStream::connect(target.address).await.unwrap();
    let get = starckpt_proto::data::GetRequest { hash: hash.to_bytes(), ..Default::default() }.encode_to_vec();
    for id in 1..=GETS {
        starckpt_proto::frame::write_frame(&mut stuck, Opcode::Get, id, &get, &[]).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let others = tcp(target.address, 1);
    for seed in 31..35 {
        // Hang guards (the stuck connection's frames time out only after 120 s), not timings.
        let got = tokio::time::timeout(Duration::from_secs(30), others.get(hash, 0, 0)).await;
        assert_eq!(got.expect("a GET waited on the budget a slow reader holds").unwrap().bytes, data);
        let (other, other_data) = chunk(4 << 20, seed);
        let put = tokio::time::timeout(Duration::from_secs(30), others.put(other, Payload::raw(other_data))).await;
        assert!(!put.expect("a PUT waited on the budget a slow reader holds").unwrap());
    }
    for _ in 0..GETS {
        let (header, _) = starckpt_proto::frame::read_frame_head(&mut stuck).await.unwrap();
        let mut payload = vec![0u8; header.payload_len as usize];
        stuck.read_exact(&mut payload).await.unwrap();
        assert_eq!(payload, data);
    }
}

/// A client that reads its GET results slowly (or not at all, within the target's timeout)
/// holds at most the reads' share of the target's buffer pool: other clients' PUTs still find
/// buffers, and GETs beyond the share still get answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_leaves_buffers_for_others() {
    let dir = tempfile::tempdir().unwrap();
    let limits = DataPlaneLimits { frame_timeout: Duration::from_secs(120), ..DataPlaneLimits::default() };
    // 48 GETs of 1 MiB, against a pool of 8 buffers; none of the results read.
    let (target, _, data, mut stuck) = unread_gets(dir.path(), limits, 9, 48).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let others = tcp(target.address, 1);
    for seed in 10..20 {
        let (hash, data) = chunk(1 << 20, seed);
        let put = tokio::time::timeout(Duration::from_secs(30), others.put(hash, Payload::raw(data.clone()))).await;
        assert!(!put.expect("a PUT waited on buffers a slow reader holds").unwrap());
        assert_eq!(others.get(hash, 0, 0).await.unwrap().bytes, data);
    }
    // The slow reader gets every result, those read into buffers of their own too.
    let mut received = 0;
    for _ in 0..48 {
        let (header, _) = starckpt_proto::frame::read_frame_head(&mut stuck).await.unwrap();
        let mut payload = vec![0u8; header.payload_len as usize];
        stuck.read_exact(&mut payload).await.unwrap();
        assert_eq!(payload, data);
        received += 1;
    }
    assert_eq!(received, 48);
}
