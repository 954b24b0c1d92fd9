#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
//! Conformance of `ChunkTransport` implementations against a real target data plane. Every
//! transport (TCP today; shared memory and RDMA later) must pass these.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use starckpt_client::transport::{ChunkPage, ChunkTransport, TcpConfig, TcpTransport, TransportError};
use starckpt_proto::ChunkHash;
use starckpt_proto::data::ErrorCode;
use starckpt_server::target::dataplane::{self, DataPlaneLimits};
use starckpt_server::target::engine::{EngineKind, open_engine};
use starckpt_server::target::store::ChunkStore;
use tokio::net::TcpListener;
use tokio::sync::watch;

struct Target {
    address: std::net::SocketAddr,
    store: Arc<ChunkStore>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

async fn start_target(dir: &std::path::Path, address: &str) -> Target {
    let store = Arc::new(ChunkStore::open(dir, open_engine(EngineKind::Uring, 8).unwrap(), 1 << 20, 8).await.unwrap());
    let listener = TcpListener::bind(address).await.unwrap();
    let address = listener.local_addr().unwrap();
    let (stop, mut stopped) = watch::channel(false);
    let task = tokio::spawn(dataplane::serve(listener, Arc::clone(&store), DataPlaneLimits::default(), async move {
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
    assert!(!transport.put(hash, data.clone()).await.unwrap());
    assert!(transport.put(hash, data.clone()).await.unwrap(), "second put reports the chunk present");
    assert_eq!(transport.get(hash, 0, 0).await.unwrap(), data);
    assert_eq!(transport.get(hash, 1000, 5000).await.unwrap(), data.slice(1000..6000));
    let missing = ChunkHash::of(b"missing");
    assert_eq!(transport.has(&[hash, missing]).await.unwrap(), vec![true, false]);
    let stat = transport.stat().await.unwrap();
    assert_eq!(stat.chunk_count, 1);
    assert!(stat.used_bytes >= 300_001 && stat.capacity_bytes > stat.used_bytes);

    let error = transport.get(missing, 0, 0).await.unwrap_err();
    assert!(matches!(error, TransportError::Remote { code: ErrorCode::NotFound, .. }), "{error}");
    let error = transport.get(hash, 300_000, 10).await.unwrap_err();
    assert!(matches!(error, TransportError::Remote { code: ErrorCode::BadRequest, .. }), "{error}");
    let error = transport.put(missing, data.clone()).await.unwrap_err();
    assert!(matches!(error, TransportError::Remote { code: ErrorCode::HashMismatch, .. }), "{error}");

    // LIST pages through the store; a guarded delete keeps a chunk used within the guard.
    let (second, second_data) = chunk(1000, 2);
    assert!(!transport.put(second, second_data).await.unwrap());
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
                transport.put(hash, data.clone()).await.unwrap();
                assert_eq!(transport.get(hash, 0, 0).await.unwrap(), data);
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
    transport.put(hash, data.clone()).await.unwrap();

    let _ = target.stop.send(true);
    target.task.await.unwrap();
    let Err(error) = transport.get(hash, 0, 0).await else { panic!("a stopped target still served a read") };
    assert!(error.is_connection(), "{error}");

    let _restarted = start_target(dir.path(), &address.to_string()).await;
    assert_eq!(transport.get(hash, 0, 0).await.unwrap(), data, "the chunk survived and the transport reconnected");
}

#[tokio::test]
async fn a_peer_stalled_mid_header_is_disconnected_after_the_idle_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let store =
        Arc::new(ChunkStore::open(dir.path(), open_engine(EngineKind::Std, 2).unwrap(), 1 << 20, 2).await.unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let limits = DataPlaneLimits { idle_timeout: Duration::from_millis(300), ..DataPlaneLimits::default() };
    let _server = tokio::spawn(dataplane::serve(listener, store, limits, std::future::pending()));
    let mut stalled = tokio::net::TcpStream::connect(address).await.unwrap();
    stalled.write_all(b"SCK").await.unwrap();
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(Duration::from_secs(10), stalled.read(&mut buf)).await;
    assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "the stalled connection was not closed: {read:?}");
    // A client whose idle connection was closed just reconnects.
    let transport = tcp(address, 1);
    transport.stat().await.unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    transport.stat().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_meant_for_another_target_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let target = start_target(dir.path(), "127.0.0.1:0").await;
    let (hash, data) = chunk(1000, 7);
    // The harness's store has no id yet: nothing is checked.
    let anyone = TcpTransport::for_target(target.address, "someone-else", TcpConfig::default());
    assert!(!anyone.put(hash, data.clone()).await.unwrap());
    target.store.set_target_id("target-a");
    let wrong = TcpTransport::for_target(target.address, "target-b", TcpConfig::default());
    let error = wrong.has(&[hash]).await.unwrap_err();
    assert!(matches!(error, TransportError::Remote { code: ErrorCode::WrongTarget, .. }), "{error}");
    assert!(error.is_connection(), "callers look the target up again");
    assert!(wrong.put(hash, data).await.is_err());
    let right = TcpTransport::for_target(target.address, "target-a", TcpConfig::default());
    assert_eq!(right.has(&[hash]).await.unwrap(), vec![true]);
    assert_eq!(tcp(target.address, 1).has(&[hash]).await.unwrap(), vec![true], "no expectation: unchecked");
}

#[tokio::test]
async fn a_silent_target_times_out_instead_of_hanging() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let _holder = tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let (socket, _) = listener.accept().await.unwrap();
            held.push(socket);
        }
    });
    let config = TcpConfig { request_timeout: Duration::from_millis(300), ..TcpConfig::default() };
    let transport = TcpTransport::new(address, config);
    let Err(error) = transport.stat().await else { panic!("a silent target answered") };
    assert!(matches!(error, TransportError::Timeout(_)), "{error}");
}
