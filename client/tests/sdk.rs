#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
//! The SDK against a real cluster (control plane + targets on loopback sockets, in this process).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use starckpt_client::{Client, ClientConfig, CommitState, Error, Lent, SavePart};
use starckpt_server::chunkserver::EngineKind;
use starckpt_server::dev::DevCluster;

mod common;
use common::{cluster, fabric};

fn random(len: usize, seed: u64) -> Vec<u8> {
    use rand::{RngCore, SeedableRng};
    let mut out = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut out);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranged_reads_and_caller_buffers_cross_chunk_boundaries() {
    // Small chunks so one file spans many of them.
    // Four copy threads: batches of four chunks staged in parallel.
    let (_dir, cluster, client) = cluster(3, |c| {
        c.chunk_size_bytes = 64 * 1024;
        c.staging_threads = 4;
    })
    .await;
    let data = random(1_000_003, 1);
    let part = SavePart::new("ranges", 1).buffer("t/weights.bin", Bytes::from(data.clone())).unwrap();
    let outcome = client.save(part).await.unwrap().wait().await.unwrap();
    assert_eq!(outcome.state, CommitState::Committed);
    assert_eq!(outcome.chunks, 16);

    let manifest = client.manifest("ranges", None).await.unwrap();
    for (offset, length) in [(0, 1), (65_535, 2), (65_536, 65_536), (100_000, 500_000), (999_000, 1003), (0, 1_000_003)]
    {
        let got = client.read_range(&manifest, "t/weights.bin", offset, length).await.unwrap();
        assert_eq!(&got[..], &data[offset as usize..(offset + length) as usize], "{offset}+{length}");
    }
    assert!(matches!(client.read_range(&manifest, "t/weights.bin", 999_999, 10).await, Err(Error::InvalidInput(_))));
    assert!(matches!(client.read_range(&manifest, "absent", 0, 1).await, Err(Error::NotFound { .. })));

    let mut buffer = vec![0u8; data.len()];
    client.read_into(&manifest, "t/weights.bin", &mut buffer).await.unwrap();
    assert_eq!(buffer, data);
    // A read is a future that can be spawned (Send, whatever the borrows inside it).
    let (spawned_client, spawned_manifest) = (client.clone(), manifest.clone());
    let spawned = tokio::spawn(async move {
        let mut buffer = vec![0u8; 1_000_003];
        spawned_client.read_into(&spawned_manifest, "t/weights.bin", &mut buffer).await.map(|()| buffer)
    });
    assert_eq!(spawned.await.unwrap().unwrap(), data);
    assert!(client.read_into(&manifest, "t/weights.bin", &mut [0u8; 5]).await.is_err());
    cluster.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_save_larger_than_staging_memory_streams_through_it() {
    // Two 64 KiB staging buffers for a 3 MiB save: staging must wait for uploads to return
    // buffers, and the save must still complete with the right bytes.
    let (_dir, cluster, client) = cluster(2, |c| {
        c.chunk_size_bytes = 64 * 1024;
        c.staging_bytes = 128 * 1024;
        // More copy threads than pool buffers: batches must shrink to the pool, not deadlock.
        c.staging_threads = 3;
    })
    .await;
    let data = random(3 << 20, 2);
    let part = SavePart::new("bounded", 5).buffer("big", Bytes::from(data.clone())).unwrap();
    let handle = client.save(part).await.unwrap();
    // Staging could only finish once all but the last two chunks were durable.
    let progress = handle.progress().clone();
    assert!(progress.done_bytes() >= (3 << 20) - 2 * 64 * 1024, "staged ahead of the pool bound");
    assert_eq!(progress.staged_bytes.load(Ordering::Relaxed), 3 << 20);
    handle.wait().await.unwrap();
    let manifest = client.manifest("bounded", Some(5)).await.unwrap();
    assert_eq!(&client.read_file(&manifest, "big").await.unwrap()[..], &data[..]);
    cluster.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_tensors_share_staging_buffers() {
    // One 64 KiB staging buffer. 150 tensors of 400 bytes (a model's norms and biases) fit in it
    // together: staging never waits for an upload. Then tensors with tails (whole chunks plus a
    // remainder) and more small ones: the packed buffer is handed over when whole chunks need the
    // pool, so a one-buffer pool still completes, and every byte comes back.
    let (dir, cluster, client) = cluster(2, |c| {
        c.chunk_size_bytes = 64 * 1024;
        c.staging_bytes = 64 * 1024;
    })
    .await;
    let small: Vec<(String, Vec<u8>)> = (0..150).map(|i| (format!("norm/{i}"), random(400, 1000 + i))).collect();
    let mut part = SavePart::new("packed", 1);
    for (path, data) in &small {
        part = part.buffer(path, Bytes::from(data.clone())).unwrap();
    }
    let handle = client.save(part).await.unwrap();
    assert_eq!(handle.progress().staging_waits.load(Ordering::Relaxed), 0, "small tensors waited for uploads");
    let outcome = handle.wait().await.unwrap();
    assert_eq!(outcome.chunks, 150);

    let mut files = small.clone();
    for i in 0..6u64 {
        files.push((format!("layer/{i}"), random(2 * 64 * 1024 + 1000 * i as usize + 1, 2000 + i)));
        files.push((format!("bias/{i}"), random(100 + i as usize, 3000 + i)));
    }
    let mut part = SavePart::new("packed", 2);
    for (path, data) in &files {
        part = part.buffer(path, Bytes::from(data.clone())).unwrap();
    }
    client.save(part).await.unwrap().wait().await.unwrap();
    let manifest = client.manifest("packed", Some(2)).await.unwrap();
    for (path, data) in &files {
        assert_eq!(&client.read_file(&manifest, path).await.unwrap()[..], &data[..], "{path}");
        let chunks = manifest.file(path).unwrap().chunks.len();
        assert_eq!(chunks, data.len().div_ceil(64 * 1024), "{path}: a packed piece is still its own chunk");
    }

    // A small tensor, then a file read from disk: the file's chunks need the one buffer the
    // packed piece is in (the save must hand it over, not wait for it forever).
    let on_disk = dir.path().join("on-disk.bin");
    let disk_bytes = random(3 * 64 * 1024 + 5, 4000);
    std::fs::write(&on_disk, &disk_bytes).unwrap();
    let part =
        SavePart::new("packed", 3).buffer("bias", Bytes::from(vec![7u8; 100])).unwrap().file("w", &on_disk).unwrap();
    let saved = tokio::time::timeout(Duration::from_secs(60), async { client.save(part).await.unwrap().wait().await });
    saved.await.expect("a save with a packed piece before a file hung").unwrap();
    let manifest = client.manifest("packed", Some(3)).await.unwrap();
    assert_eq!(&client.read_file(&manifest, "w").await.unwrap()[..], &disk_bytes[..]);
    assert_eq!(&client.read_file(&manifest, "bias").await.unwrap()[..], &[7u8; 100][..]);
    cluster.shutdown().await.unwrap();
}

/// `RecoverChunks` recovers only chunks of the checkpoint the reader names, and says per chunk
/// whether a live target holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recover_chunks_checks_what_it_is_asked() {
    let (_dir, cluster, client) = cluster(2, |c| c.chunk_size_bytes = 64 * 1024).await;
    let part = SavePart::new("recover", 1).buffer("w", Bytes::from(random(200_000, 9))).unwrap();
    client.save(part).await.unwrap().wait().await.unwrap();
    let manifest = client.manifest("recover", None).await.unwrap();
    let hashes: Vec<_> = manifest.files[0].chunks.iter().map(|c| c.hash).collect();
    assert_eq!(client.recover_chunks(&manifest, &hashes).await.unwrap(), vec![true; hashes.len()]);

    let foreign = starckpt_proto::ChunkHash::of(b"not in this checkpoint");
    let error = client.recover_chunks(&manifest, &[foreign]).await.unwrap_err();
    assert!(error.to_string().contains("is not part of"), "{error}");
    let error = client.recover_chunks(&manifest, &vec![hashes[0]; 65]).await.unwrap_err();
    assert!(error.to_string().contains("exceed the limit"), "{error}");
    let mut other = manifest.clone();
    other.info.checkpoint_id += 1000;
    let error = client.recover_chunks(&other, &hashes[..1]).await.unwrap_err();
    assert!(matches!(error, Error::NotFound { .. }), "{error}");
    cluster.shutdown().await.unwrap();
}

/// A file item that is not a regular file when it is staged (here a FIFO without a writer, as if
/// the path had been replaced since it was listed) fails the save at once: no hang, no commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_item_that_is_not_a_regular_file_fails_the_save() {
    let (dir, cluster, client) = cluster(1, |_| {}).await;
    let fifo = dir.path().join("fifo");
    let status = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(status.success());
    let part = SavePart::new("fifo", 1).buffer("meta", Bytes::from_static(b"{}")).unwrap().file("w", &fifo).unwrap();
    let saved = tokio::time::timeout(Duration::from_secs(30), async {
        match client.save(part).await {
            Ok(handle) => handle.wait().await.map(|_| ()),
            Err(error) => Err(error),
        }
    });
    let error = saved.await.expect("a save of a FIFO hung").unwrap_err();
    assert!(matches!(error, Error::InvalidInput(ref m) if m.contains("not a regular file")), "{error}");
    assert!(client.latest("fifo").await.unwrap().is_none());
    cluster.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lent_bytes_are_staged_during_the_call_so_the_caller_may_change_them() {
    let (_dir, cluster, client) = cluster(2, |c| {
        c.chunk_size_bytes = 64 * 1024;
        // Smaller than the state: the lent bytes stream through the pool during the call.
        c.staging_bytes = 256 * 1024;
    })
    .await;
    let mut weights = random(700_001, 7);
    let mut moments = random(300_000, 8);
    let (weights_at_save, moments_at_save) = (weights.clone(), moments.clone());
    let part = SavePart::new("lent", 1).buffer("meta.json", Bytes::from_static(b"{}")).unwrap();
    let handle = client.save_borrowed(part, &[("w.bf16", &weights), ("m.fp32", &moments)]).await.unwrap();
    assert_eq!(handle.progress().copied_bytes.load(Ordering::Relaxed), 2 + 700_001 + 300_000);
    // The trainer goes on and overwrites its state while the upload runs.
    weights.iter_mut().for_each(|b| *b = b.wrapping_add(1));
    moments.fill(0);
    assert!(handle.wait().await.unwrap().committed());
    let manifest = client.manifest("lent", Some(1)).await.unwrap();
    assert_eq!(&client.read_file(&manifest, "w.bf16").await.unwrap()[..], &weights_at_save[..]);
    assert_eq!(&client.read_file(&manifest, "m.fp32").await.unwrap()[..], &moments_at_save[..]);
    assert_eq!(&client.read_file(&manifest, "meta.json").await.unwrap()[..], b"{}");

    // A path given twice, or one that could escape the restore directory, is refused up front.
    let part = SavePart::new("lent", 2).buffer("w.bf16", Bytes::from_static(b"x")).unwrap();
    let error = client.save_borrowed(part, &[("w.bf16", &weights)]).await.unwrap_err();
    assert!(error.to_string().contains("saved twice"), "{error}");
    let error = client.save_borrowed(SavePart::new("lent", 2), &[("../w", &weights)]).await.unwrap_err();
    assert!(matches!(error, Error::Invalid(_)), "{error:?}");
    assert_eq!(client.latest("lent").await.unwrap().unwrap().step, 1);
    cluster.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fill_sources_write_staging_buffers_themselves_and_their_errors_fail_the_save() {
    let (_dir, cluster, client) = cluster(2, |c| {
        c.chunk_size_bytes = 64 * 1024;
        c.staging_bytes = 256 * 1024;
        c.staging_threads = 2;
    })
    .await;
    // A "device" the SDK cannot read directly: only the fill function copies out of it, each
    // call for one staging buffer's range (offset, length), possibly from several threads.
    let device = random(1_000_003, 11);
    let calls = std::sync::Mutex::new(Vec::new());
    let fill = |offset: u64, out: &mut [u8]| {
        calls.lock().unwrap().push((offset, out.len()));
        out.copy_from_slice(&device[offset as usize..offset as usize + out.len()]);
        Ok(())
    };
    let sources =
        [("tensor.bin", Lent::Fill { size: device.len() as u64, fill: &fill }), ("small", Lent::Bytes(b"abc"))];
    let handle = client.save_lent(SavePart::new("fill", 1), &sources).await.unwrap();
    assert_eq!(handle.progress().copied_bytes.load(Ordering::Relaxed), device.len() as u64 + 3);
    assert!(handle.wait().await.unwrap().committed());
    let mut calls = calls.into_inner().unwrap();
    calls.sort_unstable();
    let expected: Vec<(u64, usize)> =
        (0..device.len()).step_by(64 * 1024).map(|o| (o as u64, (device.len() - o).min(64 * 1024))).collect();
    assert_eq!(calls, expected, "one call per staging buffer, covering the file exactly once");
    let manifest = client.manifest("fill", Some(1)).await.unwrap();
    assert_eq!(&client.read_file(&manifest, "tensor.bin").await.unwrap()[..], &device[..]);
    assert_eq!(&client.read_file(&manifest, "small").await.unwrap()[..], b"abc");

    let failing = |offset: u64, _: &mut [u8]| if offset >= 128 * 1024 { Err("device lost".to_owned()) } else { Ok(()) };
    let sources = [("tensor.bin", Lent::Fill { size: device.len() as u64, fill: &failing })];
    let error = client.save_lent(SavePart::new("fill", 2), &sources).await.unwrap_err();
    assert!(error.to_string().contains("staging tensor.bin: device lost"), "{error}");
    assert_eq!(client.latest("fill").await.unwrap().unwrap().step, 1);
    // The failed save gave its staging buffers and its upload slot back.
    let handle = client.save_lent(SavePart::new("fill", 3), &[("b", Lent::Bytes(&device))]).await.unwrap();
    assert!(handle.wait().await.unwrap().committed());
    cluster.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_save_stages_while_its_checkpoint_is_begun_and_fails_when_it_cannot_be() {
    // The trainer waits for the slower of the staging copy and the begin, not both: staging
    // starts before the control plane answers. One that never answers fails the save.
    let (_dir, cluster, client) = cluster(1, |c| {
        c.chunk_size_bytes = 64 * 1024;
        c.failover_timeout = Duration::from_secs(1);
        c.rpc_timeout = Duration::from_secs(1);
    })
    .await;
    cluster.kill().await;
    let filled = std::sync::atomic::AtomicU64::new(0);
    let fill = |_: u64, out: &mut [u8]| {
        filled.fetch_add(out.len() as u64, Ordering::Relaxed);
        Ok(())
    };
    let sources = [("tensor.bin", Lent::Fill { size: 200_000, fill: &fill })];
    let error = client.save_lent(SavePart::new("unbegun", 1), &sources).await.unwrap_err();
    assert!(matches!(error, Error::Unreachable { .. }), "{error}");
    assert_eq!(filled.load(Ordering::Relaxed), 200_000, "staged while the begin was tried");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_wait_for_the_other_saves_staging_on_the_host() {
    // Two trainers' saves on one host (ranks of a job, or two jobs): A's copy is held up in its
    // fill source; B has staged, and its uploads wait for A's copy to finish (they would compete
    // with it for cores and memory bandwidth).
    let (dir, cluster, client) = cluster(2, |c| c.chunk_size_bytes = 64 * 1024).await;
    let mut config = client.config().clone();
    config.upload_during_staging = false;
    config.host_staging_lock = Some(dir.path().join("staging.lock"));
    let (a, b) = (Client::connect(config.clone()).await.unwrap(), Client::connect(config).await.unwrap());
    let (entered, copying) = std::sync::mpsc::channel::<()>();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let released = std::sync::Mutex::new(released);
    let staging_a = tokio::spawn(async move {
        let fill = |_: u64, out: &mut [u8]| {
            let _ = entered.send(());
            let _ = released.lock().unwrap().recv();
            out.fill(7);
            Ok(())
        };
        let sources = [("a.bin", Lent::Fill { size: 100_000, fill: &fill })];
        a.save_lent(SavePart::new("host-a", 1), &sources).await.unwrap().wait().await
    });
    tokio::task::spawn_blocking(move || copying.recv().unwrap()).await.unwrap();
    let part = SavePart::new("host-b", 1).buffer("b.bin", Bytes::from(random(200_000, 24))).unwrap();
    let staged_b = b.save(part).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(staged_b.progress().uploaded_bytes.load(Ordering::Relaxed), 0, "B uploaded while A was copying");
    assert!(!staging_a.is_finished());
    drop(release);
    assert!(staged_b.wait().await.unwrap().committed());
    assert!(staging_a.await.unwrap().unwrap().committed());
    cluster.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_wait_for_staging_unless_told_to_overlap_it() {
    // The first file's one chunk is staged before the second file's fill runs: the fill looks
    // for it on the targets' disks. Held back (the small-host default), it cannot be there yet;
    // overlapped, it arrives while the save is still staging.
    for overlap in [false, true] {
        let (dir, cluster, client) = cluster(2, |c| {
            c.chunk_size_bytes = 64 * 1024;
            c.upload_during_staging = overlap;
        })
        .await;
        let first = random(64 * 1024, 40 + overlap as u64);
        let hash = starckpt_proto::ChunkHash::of(&first);
        let dirs: Vec<std::path::PathBuf> = target_dirs(dir.path(), 2).into_values().collect();
        let uploaded = || dirs.iter().any(|d| copy_verifies(&chunk_file(d, &hash), &hash, first.len() as u64));
        let fill = |_: u64, out: &mut [u8]| {
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while overlap && !uploaded() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            out.fill(7);
            match (overlap, uploaded()) {
                (false, true) => Err("the first chunk was uploaded while the save was staging".to_owned()),
                (true, false) => Err("the first chunk was not uploaded while the save was staging".to_owned()),
                _ => Ok(()),
            }
        };
        let sources = [("first", Lent::Bytes(&first)), ("second", Lent::Fill { size: 1000, fill: &fill })];
        let handle = client.save_lent(SavePart::new("overlap", 1), &sources).await.unwrap();
        assert!(handle.wait().await.unwrap().committed());
        assert!(uploaded());
        cluster.shutdown().await.unwrap();
    }
}

/// The message of a target's UNAUTHORIZED answer; any other outcome fails the test.
fn refusal<T: std::fmt::Debug>(result: Result<T, starckpt_client::transport::TransportError>) -> String {
    match result {
        Err(starckpt_client::transport::TransportError::Remote {
            code: starckpt_proto::data::ErrorCode::Unauthorized,
            message,
        }) => message,
        other => panic!("expected UNAUTHORIZED, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_serve_only_requests_carrying_a_capability_from_the_control_plane() {
    use starckpt_client::transport::{ChunkTransport, Credentials, Payload, TcpConfig, TcpTransport};
    use starckpt_proto::capability::{CLOCK_SKEW, ClusterKey, Rights};
    use std::time::SystemTime;
    let (_dir, cluster, client) = cluster(1, |c| c.chunk_size_bytes = 64 * 1024).await;
    // The SDK asks the control plane for its capability: saves and restores just work.
    let data = random(200_000, 50);
    let part = SavePart::new("auth", 1).buffer("w", Bytes::from(data.clone())).unwrap();
    assert!(client.save(part).await.unwrap().wait().await.unwrap().committed());
    let manifest = client.manifest("auth", Some(1)).await.unwrap();
    assert_eq!(&client.read_file(&manifest, "w").await.unwrap()[..], &data[..]);
    let stored = manifest.file("w").unwrap().chunks[0].hash;
    let fresh = random(1000, 51);
    let fresh_hash = starckpt_proto::ChunkHash::of(&fresh);

    let target = client.targets().await.unwrap().remove(0);
    let address = target.data_address.parse().unwrap();
    let with = |credentials: Credentials| {
        TcpTransport::for_target(address, &target.target_id, TcpConfig { credentials, ..TcpConfig::default() })
    };
    let fixed = |capability: Bytes| {
        Credentials::asked(Box::new(move || {
            let capability = capability.clone();
            Box::pin(async move { Ok((capability, Duration::from_secs(3600))) })
        }))
    };
    let hour = SystemTime::now() + Duration::from_secs(3600);

    // A peer without a capability gets nothing done.
    let anyone = with(Credentials::default());
    let message = refusal(anyone.has(&[stored]).await);
    assert!(message.contains("carries no capability"), "{message}");
    refusal(anyone.get(stored, 0, 0).await);
    refusal(anyone.put(fresh_hash, Payload::raw(Bytes::from(fresh.clone()))).await);
    refusal(anyone.delete(&[stored], None).await);
    refusal(anyone.list(None, 10).await);
    refusal(anyone.stat().await);

    // A client's capability (valid on any target) reads and writes, and neither deletes nor lists.
    let key = cluster.cluster_key.clone();
    let a_client = with(fixed(key.mint(Rights::CLIENT, hour, None)));
    assert_eq!(a_client.has(&[stored, fresh_hash]).await.unwrap(), vec![true, false]);
    assert!(!a_client.put(fresh_hash, Payload::raw(Bytes::from(fresh.clone()))).await.unwrap());
    assert_eq!(&a_client.get(fresh_hash, 0, 0).await.unwrap().bytes[..], &fresh[..]);
    let message = refusal(a_client.delete(&[stored], None).await);
    assert!(message.contains("grants read+write, and the request needs admin"), "{message}");
    refusal(a_client.list(None, 10).await);

    // Signed with another key, bound to another target, or expired: refused.
    let forged = ClusterKey::from_secret(b"a guess at the cluster's secret").unwrap();
    let forger = with(Credentials::minted(forged, Rights::ALL, Duration::from_secs(600)));
    let message = refusal(forger.delete(&[stored], None).await);
    assert!(message.contains("not signed with this cluster's key"), "{message}");
    let elsewhere = with(fixed(key.mint(Rights::ALL, hour, Some("another-target"))));
    refusal(elsewhere.delete(&[stored], None).await);
    refusal(elsewhere.has(&[stored]).await);
    let old = key.mint(Rights::CLIENT, SystemTime::now() - 2 * CLOCK_SKEW, None);
    let message = refusal(with(fixed(old)).has(&[stored]).await);
    assert!(message.contains("expired"), "{message}");

    // The control plane's own (what GC carries) deletes.
    let admin = with(cluster.admin_credentials());
    assert_eq!(admin.list(None, 100).await.unwrap().chunks.len(), manifest.file("w").unwrap().chunks.len() + 1);
    assert_eq!(admin.delete(&[fresh_hash], None).await.unwrap(), 1);
    cluster.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_asks_for_a_new_capability_when_targets_refuse_its_own() {
    // The cluster gets a new key under a running client (the control plane and targets restarted
    // with it): the client's capability, good for another half hour by its clock, is refused,
    // and the client asks for a new one instead of failing (or recovering chunks it has).
    let (dir, cluster, client) = cluster(2, |c| c.chunk_size_bytes = 64 * 1024).await;
    let data = random(300_000, 60);
    let part = SavePart::new("rekey", 1).buffer("w", Bytes::from(data.clone())).unwrap();
    assert!(client.save(part).await.unwrap().wait().await.unwrap().committed());
    let address = cluster.control_address.to_string();
    cluster.shutdown().await.unwrap();
    std::fs::remove_file(dir.path().join("cluster.key")).unwrap();
    let cluster = DevCluster::start(dir.path(), &address, 2, EngineKind::Uring).await.unwrap();
    common::wait_alive(&client, 2).await;
    let manifest = client.manifest("rekey", Some(1)).await.unwrap();
    assert_eq!(&client.read_file(&manifest, "w").await.unwrap()[..], &data[..]);
    let part = SavePart::new("rekey", 2).buffer("w", Bytes::from(random(300_000, 61))).unwrap();
    let saved = client.save(part).await.unwrap().wait().await.unwrap();
    assert!(saved.committed());
    assert!(saved.uploaded_bytes > 0);
    cluster.shutdown().await.unwrap();
}

/// Target id -> data directory of a dev cluster's targets.
fn target_dirs(dir: &std::path::Path, targets: usize) -> std::collections::HashMap<String, std::path::PathBuf> {
    (0..targets)
        .map(|i| {
            let target_dir = dir.join(format!("target-{i}"));
            (std::fs::read_to_string(target_dir.join("target.id")).unwrap().trim().to_owned(), target_dir)
        })
        .collect()
}

/// The file holding `hash` in a target's data directory (see `ChunkStore::chunk_path`).
fn chunk_file(target_dir: &std::path::Path, hash: &starckpt_proto::ChunkHash) -> std::path::PathBuf {
    target_dir.join("chunks").join(format!("{:02x}", hash.0[0])).join(hash.to_hex())
}

/// Whether a chunk file's payload (after its 4 KiB header) hashes to `hash`.
fn copy_verifies(path: &std::path::Path, hash: &starckpt_proto::ChunkHash, length: u64) -> bool {
    let bytes = std::fs::read(path).unwrap_or_default();
    bytes.len() as u64 >= 4096 + length && starckpt_proto::ChunkHash::of(&bytes[4096..4096 + length as usize]) == *hash
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_are_replicated_and_a_read_repairs_the_bad_copies_it_meets() {
    let (dir, cluster, client) = cluster(2, |c| c.chunk_size_bytes = 64 * 1024).await;
    let data = random(1_000_000, 21);
    let part = SavePart::new("replicated", 1).buffer("w.bin", Bytes::from(data.clone())).unwrap();
    assert!(client.save(part).await.unwrap().wait().await.unwrap().committed());
    let manifest = client.manifest("replicated", Some(1)).await.unwrap();
    let chunks = &manifest.file("w.bin").unwrap().chunks;
    // The default replication factor: every chunk on both targets.
    assert!(chunks.iter().all(|c| c.replicas.len() == 2 && c.replicas[0] != c.replicas[1]), "{chunks:?}");

    // Rot the copy each chunk is read from first (its first replica).
    let dirs = target_dirs(dir.path(), 2);
    for chunk in chunks {
        let path = chunk_file(&dirs[&chunk.replicas[0]], &chunk.hash);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[4096 + 100] ^= 0x40;
        std::fs::write(&path, bytes).unwrap();
        assert!(!copy_verifies(&path, &chunk.hash, chunk.length_bytes));
    }
    // The read detects each bad copy, returns the good one, and has the bad one rewritten.
    assert_eq!(&client.read_file(&manifest, "w.bin").await.unwrap()[..], &data[..]);
    let repaired =
        || chunks.iter().all(|c| copy_verifies(&chunk_file(&dirs[&c.replicas[0]], &c.hash), &c.hash, c.length_bytes));
    common::eventually("every bad copy rewritten", repaired).await;

    // A chunk bad on every replica is an error, never unverified bytes.
    let chunk = &chunks[3];
    for target in &chunk.replicas {
        let path = chunk_file(&dirs[target], &chunk.hash);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[4096] ^= 1;
        std::fs::write(&path, bytes).unwrap();
    }
    let error = client.read_file(&manifest, "w.bin").await.unwrap_err();
    assert!(error.is_checksum(), "{error}");

    // With one replica asked for, one copy is made.
    client.set_replication("single", 1).await.unwrap();
    let part = SavePart::new("single", 1).buffer("x", Bytes::from(random(200_000, 22))).unwrap();
    assert!(client.save(part).await.unwrap().wait().await.unwrap().committed());
    let manifest = client.manifest("single", None).await.unwrap();
    assert!(manifest.files[0].chunks.iter().all(|c| c.replicas.len() == 1));
    assert!(client.set_replication("single", 0).await.is_err());
    cluster.shutdown().await.unwrap();
}

/// More files being streamed at once than staging buffers: once every buffer holds some file's
/// unfinished last chunk, nothing but those files can free one, so the next write fails, saying
/// why, instead of waiting for ever; closing a file lets writes go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_deleted_while_it_is_read_is_reported_as_deleted() {
    // A reader holds a manifest; the checkpoint is deleted and its chunks collected (removed here
    // as GC would, past its grace period) before the reader gets to them. Its reads and restores
    // say so, not that copies are lost and a repair could bring them back.
    let (dir, cluster, client) = cluster(2, |c| c.chunk_size_bytes = 64 * 1024).await;
    let data = random(300_000, 23);
    let part = SavePart::new("doomed", 4).buffer("w.bin", Bytes::from(data)).unwrap();
    assert!(client.save(part).await.unwrap().wait().await.unwrap().committed());
    let manifest = client.manifest("doomed", Some(4)).await.unwrap();
    let dirs = target_dirs(dir.path(), 2);
    let remove_chunks = || {
        for chunk in &manifest.file("w.bin").unwrap().chunks {
            for target in &chunk.replicas {
                std::fs::remove_file(chunk_file(&dirs[target], &chunk.hash)).unwrap();
            }
        }
    };

    // Lost while the checkpoint is committed: unavailable, a repair's business.
    remove_chunks();
    let lost = client.read_file(&manifest, "w.bin").await.unwrap_err();
    assert!(matches!(lost, Error::ChunkUnavailable { .. }), "{lost}");

    // Deleted since the manifest was read: the reader hears that.
    client.delete("doomed", 4).await.unwrap();
    let deleted = client.read_file(&manifest, "w.bin").await.unwrap_err();
    assert!(matches!(&deleted, Error::Deleted { step: 4, .. }), "{deleted}");
    assert!(deleted.to_string().contains("was deleted while it was being read"), "{deleted}");
    let to = dir.path().join("restored");
    let restore = client.restore(&manifest, &to, starckpt_client::RestoreOptions::default()).await.unwrap_err();
    assert!(matches!(restore, Error::Deleted { .. }), "{restore}");
    assert!(!to.exists(), "a failed restore leaves nothing at its destination");
    cluster.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_more_files_than_staging_buffers_fails_a_write_instead_of_hanging() {
    let (_dir, cluster, client) = cluster(1, |c| {
        c.chunk_size_bytes = 64 * 1024;
        c.staging_bytes = 4 * 64 * 1024;
    })
    .await;
    let mut open = Vec::new();
    for _ in 0..4 {
        let mut stream = client.streaming_file("many").await.unwrap();
        stream.write(b"partial").await.unwrap();
        open.push(stream);
    }
    let mut fifth = client.streaming_file("many").await.unwrap();
    let wait = starckpt_client::PARTIALS_WAIT + Duration::from_secs(30);
    let refused = tokio::time::timeout(wait, fifth.write(b"one too many")).await.expect("the write waited for ever");
    let error = refused.expect_err("a write found a buffer no file could free");
    assert!(error.to_string().contains("unfinished last chunk"), "{error}");
    // A file closed gives its buffer back: the others write on.
    let done = open.pop().unwrap().finish("f".try_into().unwrap(), 0).await.unwrap();
    assert_eq!(done.size, 7);
    let mut sixth = client.streaming_file("many").await.unwrap();
    sixth.write(b"fits now").await.unwrap();
    cluster.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_files_commit_together_and_a_collected_chunk_fails_the_commit() {
    let (_dir, cluster, client) = cluster(2, |c| {
        c.chunk_size_bytes = 64 * 1024;
        c.staging_bytes = 256 * 1024;
    })
    .await;
    let data = random(1_000_000, 9);
    let mut stream = client.streaming_file("streamed").await.unwrap();
    for piece in data.chunks(7_777) {
        stream.write(piece).await.unwrap();
    }
    stream.sync().await.unwrap();
    stream.write(b"tail").await.unwrap();
    assert_eq!(stream.size(), 1_000_004);
    let first = stream.finish("a/big.bin".try_into().unwrap(), 0o600).await.unwrap();
    // sync cut a partial chunk: 15 full chunks, the 16th up to the sync, then "tail".
    assert_eq!(first.chunks.len(), 17);
    let empty = client.streaming_file("streamed").await.unwrap().finish("empty".try_into().unwrap(), 0).await.unwrap();
    let outcome = client
        .commit_streamed("streamed", 3, vec![first.clone(), empty], vec!["dir".try_into().unwrap()], Default::default())
        .await
        .unwrap();
    assert!(outcome.committed());
    let manifest = client.manifest("streamed", Some(3)).await.unwrap();
    let mut expected = data.clone();
    expected.extend_from_slice(b"tail");
    assert_eq!(&client.read_file(&manifest, "a/big.bin").await.unwrap()[..], &expected[..]);
    assert_eq!(manifest.file("a/big.bin").unwrap().mode, 0o600);
    assert_eq!(manifest.file("empty").unwrap().size_bytes, 0);

    // Every copy is checked at commit (and so refreshed against GC): one that vanished from its
    // target (collected) is left out of the manifest, and the chunk is read from the other.
    let admin = |target: &starckpt_client::TargetInfo| {
        use starckpt_client::transport::{TcpConfig, TcpTransport};
        let config = TcpConfig { credentials: cluster.admin_credentials(), ..Default::default() };
        TcpTransport::for_target(target.data_address.parse().unwrap(), &target.target_id, config)
    };
    use starckpt_client::transport::ChunkTransport;
    let targets = client.targets().await.unwrap();
    let target = |id: &str| targets.iter().find(|t| t.target_id == id).unwrap();
    let mut stream = client.streaming_file("streamed").await.unwrap();
    stream.write(&random(100_000, 11)).await.unwrap();
    let halved = stream.finish("halved.bin".try_into().unwrap(), 0).await.unwrap();
    let (chunk, kept) = (&halved.chunks[0], halved.chunks[0].replicas[1].clone());
    assert_eq!(chunk.replicas.len(), 2, "streamed to both targets");
    assert_eq!(admin(target(&chunk.replicas[0])).delete(&[chunk.hash], None).await.unwrap(), 1);
    let outcome = client.commit_streamed("streamed", 4, vec![halved], vec![], Default::default()).await.unwrap();
    assert!(outcome.committed());
    let manifest = client.manifest("streamed", Some(4)).await.unwrap();
    assert_eq!(manifest.file("halved.bin").unwrap().chunks[0].replicas, vec![kept]);
    assert_eq!(&client.read_file(&manifest, "halved.bin").await.unwrap()[..], &random(100_000, 11)[..]);

    // A chunk gone from every target that stored it fails the commit; nothing is committed.
    let mut stream = client.streaming_file("streamed").await.unwrap();
    stream.write(&random(100_000, 10)).await.unwrap();
    let lost = stream.finish("lost.bin".try_into().unwrap(), 0).await.unwrap();
    let chunk = &lost.chunks[0];
    for holder in &chunk.replicas {
        assert_eq!(admin(target(holder)).delete(&[chunk.hash], None).await.unwrap(), 1);
    }
    let error = client.commit_streamed("streamed", 5, vec![lost], vec![], Default::default()).await.unwrap_err();
    assert!(error.to_string().contains("no longer on any target"), "{error}");
    assert_eq!(client.latest("streamed").await.unwrap().unwrap().step, 4);
    let attempts = client.list_checkpoints("streamed", true).await.unwrap();
    let five: Vec<i32> = attempts.iter().filter(|c| c.step == 5).map(|c| c.state).collect();
    assert_eq!(five, vec![starckpt_client::CheckpointState::Aborted as i32]);
    cluster.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handle_reports_dedup_and_metadata_round_trips() {
    let (_dir, cluster, client) = cluster(3, |c| c.chunk_size_bytes = 128 * 1024).await;
    let frozen = Bytes::from(random(1 << 20, 3));
    let mut part = SavePart::new("meta", 1).buffer("frozen", frozen.clone()).unwrap().directory("empty").unwrap();
    part.metadata.insert("lr".into(), "0.001".into());
    let first = client.save(part).await.unwrap().wait().await.unwrap();
    assert_eq!(first.deduplicated_chunks, 0);
    let part = SavePart::new("meta", 2)
        .buffer("frozen", frozen)
        .unwrap()
        .buffer("fresh", Bytes::from(random(1 << 20, 4)))
        .unwrap();
    let second = client.save(part).await.unwrap().wait().await.unwrap();
    assert_eq!((second.chunks, second.deduplicated_chunks), (16, 8));
    assert_eq!(second.uploaded_bytes, 1 << 20);

    let manifest = client.manifest("meta", Some(1)).await.unwrap();
    assert_eq!(manifest.metadata[0].1.get("lr").map(String::as_str), Some("0.001"));
    assert_eq!(manifest.directories[0].as_str(), "empty");
    assert_eq!(client.latest("meta").await.unwrap().unwrap().step, 2);
    cluster.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn save_fails_cleanly_when_every_target_is_gone() {
    let (_dir, cluster, client) = cluster(1, |_| {}).await;
    // Kill the targets and the control plane together; a fresh control plane on the same data
    // still lists the target as alive for a while (here, with slow heartbeats, for the whole
    // test), so the client tries it and must fail with a clear error instead of committing
    // anything.
    let data_dir = cluster.data_dir.clone();
    cluster.kill().await;
    let store = starckpt_server::control::open_store(&data_dir.join("meta.db").to_string_lossy()).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let mut config = starckpt_server::control::ControlConfig::default();
    common::slow_heartbeats(&mut config);
    let server = tokio::spawn(starckpt_server::control::run(listener, store, config, async {
        let _ = stopped.await;
    }));
    // The dead target registered moments ago, so it is still "alive" to the control plane.
    let registered = std::fs::read_to_string(data_dir.join("target-0/target.id")).unwrap();
    let client2 = Client::connect(ClientConfig::new(address.to_string())).await.unwrap();
    let listed = client2.targets().await.unwrap();
    assert_eq!(listed[0].target_id, registered.trim());
    drop(client);

    let part = SavePart::new("orphan", 1).buffer("f", Bytes::from(random(100_000, 5))).unwrap();
    let result = match client2.save(part).await {
        Ok(handle) => handle.wait().await.map(|_| ()),
        Err(error) => Err(error),
    };
    let error = result.unwrap_err();
    assert!(matches!(error, Error::NoTarget { .. }), "{error}");
    assert!(error.to_string().contains("no storage target accepted chunk"), "{error}");
    assert!(client2.latest("orphan").await.unwrap().is_none());
    let _ = stop.send(());
    server.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_and_saves_follow_a_target_that_moved() {
    use starckpt_server::chunkserver::{self, TargetConfig};
    use tokio::net::TcpListener;

    let dir = tempfile::tempdir().unwrap();
    let store = starckpt_server::control::open_store(&dir.path().join("meta.db").to_string_lossy()).await.unwrap();
    let control_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let control_address = control_listener.local_addr().unwrap().to_string();
    tokio::spawn(starckpt_server::control::run(control_listener, store, Default::default(), std::future::pending()));

    let start_target = |listener: TcpListener| {
        let config = TargetConfig::new(dir.path().join("t0"), control_address.clone());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(chunkserver::run(config, listener, async {
            let _ = stopped.await;
        }));
        (stop, task)
    };
    let wait_for_address = |client: Client, address: String| async move {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !client.targets().await.unwrap().iter().any(|t| t.data_address == address) {
            assert!(std::time::Instant::now() < deadline, "target never registered at {address}");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    };

    let first = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let first_address = first.local_addr().unwrap().to_string();
    let (stop, task) = start_target(first);
    let client = Client::connect(ClientConfig::new(control_address.clone())).await.unwrap();
    wait_for_address(client.clone(), first_address.clone()).await;

    let data = random(300_000, 9);
    let part = SavePart::new("moving", 1).buffer("f", Bytes::from(data.clone())).unwrap();
    client.save(part).await.unwrap().wait().await.unwrap();
    let stale = client.manifest("moving", None).await.unwrap();
    assert_eq!(stale.targets.values().next().unwrap().data_address, first_address);

    // The target restarts on another port; the manifest in hand still names the old one.
    let _ = stop.send(());
    task.await.unwrap().unwrap();
    let second = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let second_address = second.local_addr().unwrap().to_string();
    let (_stop, _task) = start_target(second);
    wait_for_address(client.clone(), second_address).await;

    assert_eq!(&client.read_file(&stale, "f").await.unwrap()[..], &data[..]);
    // The same client's transports also still point at the old address for saves.
    let part = SavePart::new("moving", 2).buffer("g", Bytes::from(random(200_000, 10))).unwrap();
    client.save(part).await.unwrap().wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_client_holding_an_old_epoch_is_fenced() {
    let (_dir, cluster, _) = cluster(1, |_| {}).await;
    let client_for = |run: &str| {
        let mut config = ClientConfig::new(cluster.control_address.to_string());
        config.run_id = Some(run.into());
        Client::connect(config)
    };
    let zombie = client_for("run-1").await.unwrap();
    let part = |rank, data: u64| {
        SavePart::new("z", 1).rank(rank, 2).buffer(&format!("f{rank}"), Bytes::from(random(1000, data))).unwrap()
    };
    let zombie_part = zombie.save(part(0, 1).buffer("g", Bytes::from(random(10, 2))).unwrap()).await.unwrap();
    assert_eq!(zombie_part.wait().await.unwrap().epoch, 1);

    let restarted = client_for("run-2").await.unwrap();
    assert_eq!(restarted.lease("z").await.unwrap(), 2);

    // The zombie still believes it holds epoch 1: every write it attempts is refused.
    assert_eq!(zombie.lease("z").await.unwrap(), 1, "cached");
    let Err(error) = zombie.save(part(1, 3)).await else { panic!("a fenced writer began a checkpoint") };
    assert!(matches!(error, Error::Fenced { .. }), "{error}");
    // A fresh client of the old run cannot take the lease back either.
    let Err(error) = client_for("run-1").await.unwrap().lease("z").await else { panic!("lease taken back") };
    assert!(matches!(error, Error::Fenced { .. }), "{error}");

    for rank in 0..2 {
        restarted.save(part(rank, 10 + rank as u64)).await.unwrap().wait().await.unwrap();
    }
    let latest = restarted.latest("z").await.unwrap().unwrap();
    assert_eq!((latest.step, latest.epoch), (1, 2));
    // Without a shared run id, a multi-rank save is refused before anything is sent.
    let mut config = ClientConfig::new(cluster.control_address.to_string());
    config.run_id = None;
    let lone = Client::connect(config).await.unwrap();
    assert!(matches!(lone.save(part(0, 20)).await, Err(Error::InvalidInput(_))));
    cluster.shutdown().await.unwrap();
}

/// A checkpoint whose parts add up to more than one `GetManifest` answer carries (64 MiB for a
/// multi-terabyte checkpoint of many ranks; here a page of one part) is read a page at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_larger_than_one_answer_is_read_a_page_at_a_time() {
    let (_dir, cluster, client) = common::cluster_tuned(
        fabric().as_deref(),
        1,
        |control| control.manifest_page_bytes = 1,
        |_| {},
        |config| config.run_id = Some("paged".into()),
    )
    .await;
    let ranks = 5u32;
    for rank in 0..ranks {
        let part = SavePart::new("paged", 3).rank(rank, ranks);
        let part = part.buffer(&format!("rank{rank}/w"), Bytes::from(random(10_000 + rank as usize, rank.into())));
        client.save(part.unwrap()).await.unwrap().wait().await.unwrap();
    }
    let manifest = client.manifest("paged", None).await.unwrap();
    assert_eq!((manifest.info.step, manifest.info.world_size), (3, ranks));
    assert_eq!(manifest.metadata.iter().map(|(rank, _)| *rank).collect::<Vec<_>>(), (0..ranks).collect::<Vec<_>>());
    for rank in 0..ranks {
        let read = client.read_file(&manifest, &format!("rank{rank}/w")).await.unwrap();
        assert_eq!(read, random(10_000 + rank as usize, rank.into()), "rank {rank}");
    }
    cluster.shutdown().await.unwrap();
}

/// Commits checkpoint `job`@1 of `ranks` parts, each a file `rank{r}.bin` of `chunks_per_part`
/// references to 4 MiB chunks on `target`, through the control plane's API (chunk references
/// only: no bytes behind them): the manifest of a checkpoint far larger than the test's disk.
async fn commit_references(control: &std::net::SocketAddr, target: &str, job: &str, ranks: u32, chunks_per_part: u64) {
    use starckpt_proto::control::{self as pb, control_client::ControlClient};
    let mut control =
        ControlClient::connect(format!("http://{control}")).await.unwrap().max_encoding_message_size(64 << 20);
    let lease = pb::AcquireLeaseRequest { job: job.into(), run_id: format!("{job}-run"), started_at_ms: 0 };
    let epoch = control.acquire_lease(lease).await.unwrap().into_inner().epoch;
    let begin = pb::BeginCheckpointRequest { job: job.into(), step: 1, world_size: ranks, epoch };
    let checkpoint_id = control.begin_checkpoint(begin).await.unwrap().into_inner().checkpoint_id;
    for rank in 0..ranks {
        let chunks = (0..chunks_per_part)
            .map(|i| {
                let mut hash = [0u8; 32];
                hash[..4].copy_from_slice(&rank.to_le_bytes());
                hash[4..12].copy_from_slice(&i.to_le_bytes());
                pb::ChunkRef {
                    hash: Bytes::copy_from_slice(&hash),
                    length_bytes: 4 << 20,
                    stored_length_bytes: 4 << 20,
                    codec: 0,
                    replicas: vec![target.into()],
                }
            })
            .collect();
        let file =
            pb::FileEntry { path: format!("rank{rank}.bin"), size_bytes: chunks_per_part << 22, mode: 0, chunks };
        let manifest = pb::Manifest { files: vec![file], ..Default::default() };
        let request = pb::CommitPartRequest { checkpoint_id, rank, manifest: Some(manifest), written_bytes: 0 };
        control.commit_part(request).await.unwrap();
    }
}

/// Parts adding up to more than the 64 MiB a gRPC message carries (each under it, as CommitPart
/// requires): the manifest of a multi-terabyte checkpoint, read back whole by the SDK.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_whose_parts_exceed_one_message_can_be_read() {
    let (_dir, cluster, client) = cluster(1, |_| {}).await;
    let target = client.targets().await.unwrap().remove(0).target_id;
    // ~48 MiB per part encoded: 600,000 references of 4 MiB chunks each (a 2.3 TiB part).
    let chunks_per_part = 600_000u64;
    commit_references(&cluster.control_address, &target, "huge", 2, chunks_per_part).await;
    let manifest = client.manifest("huge", None).await.unwrap();
    assert_eq!((manifest.info.step, manifest.info.world_size), (1, 2));
    assert_eq!(manifest.files.len(), 2);
    assert!(manifest.files.iter().all(|file| file.chunks.len() as u64 == chunks_per_part));
    cluster.shutdown().await.unwrap();
}

/// A TCP proxy in front of a control plane that passes each connection's first `limit` bytes
/// from the control plane to the client, then stops passing them on while holding the connection
/// open: a control plane that began an answer and stalled (overloaded, or cut off mid-stream).
struct StallingProxy {
    address: std::net::SocketAddr,
    stalled: Arc<std::sync::atomic::AtomicBool>,
    /// Accepts connections; its connections' tasks end with it.
    task: tokio::task::JoinHandle<()>,
}

impl StallingProxy {
    async fn start(upstream: std::net::SocketAddr, limit: usize) -> StallingProxy {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let stalled = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = stalled.clone();
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let server = tokio::net::TcpStream::connect(upstream).await.unwrap();
                let stalled = seen.clone();
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                connections.spawn(async move {
                    let requests = async move {
                        let _ = tokio::io::copy(&mut client_read, &mut server_write).await;
                        // Holds the control plane's side open until the proxy stops.
                        std::future::pending::<()>().await;
                    };
                    let answers = async move {
                        let mut passed = 0;
                        let mut buffer = vec![0u8; 16 << 10];
                        loop {
                            let read = server_read.read(&mut buffer).await.unwrap_or(0);
                            if read == 0 {
                                return;
                            }
                            let pass = read.min(limit - passed);
                            client_write.write_all(&buffer[..pass]).await.unwrap_or(());
                            passed += pass;
                            if passed == limit {
                                stalled.store(true, Ordering::SeqCst);
                                // Neither passes on nor closes: the client hears nothing more.
                                std::future::pending::<()>().await;
                            }
                        }
                    };
                    tokio::select! { _ = requests => {}, _ = answers => {} }
                });
            }
        });
        StallingProxy { address, stalled, task }
    }
}

impl Drop for StallingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A control plane that sends the headers of an answer and then stalls is a failed control
/// plane: the RPC timeout bounds the whole answer, and the call goes on at the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_control_plane_stalling_mid_answer_is_failed_over() {
    let (_dir, cluster, client) = cluster(1, |_| {}).await;
    let target = client.targets().await.unwrap().remove(0).target_id;
    // A manifest of ~1.2 MiB: its answer cannot fit in the proxy's first 64 KiB.
    commit_references(&cluster.control_address, &target, "stalls", 1, 20_000).await;
    let proxy = StallingProxy::start(cluster.control_address, 64 << 10).await;
    let mut config = ClientConfig::new(format!("{},{}", proxy.address, cluster.control_address));
    config.rpc_timeout = Duration::from_secs(2);
    let through_proxy = Client::connect(config).await.unwrap();
    let read = tokio::time::timeout(Duration::from_secs(60), through_proxy.manifest("stalls", None)).await;
    let manifest = read.expect("the call waited on a stalled answer").unwrap();
    assert!(proxy.stalled.load(Ordering::SeqCst), "the proxy never cut an answer short");
    assert_eq!(manifest.files[0].chunks.len(), 20_000);
    drop((through_proxy, proxy));
    cluster.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_bytes_are_uploaded_without_a_staging_copy() {
    // One 64 KiB staging buffer; the shared tensor is 40x larger and never touches it.
    let (_dir, cluster, client) = cluster(2, |c| {
        c.chunk_size_bytes = 64 * 1024;
        c.staging_bytes = 64 * 1024;
    })
    .await;
    let tensor = Bytes::from(random(40 * 64 * 1024 + 5, 30));
    let copied = Bytes::from(random(100_000, 31));
    let part =
        SavePart::new("zc", 1).shared("tensor", tensor.clone()).unwrap().buffer("small", copied.clone()).unwrap();
    let handle = client.save(part).await.unwrap();
    let progress = handle.progress().clone();
    handle.wait().await.unwrap();
    assert_eq!(progress.staged_bytes.load(Ordering::Relaxed), (tensor.len() + copied.len()) as u64);
    assert_eq!(progress.copied_bytes.load(Ordering::Relaxed), copied.len() as u64, "only the buffer item is copied");
    let manifest = client.manifest("zc", None).await.unwrap();
    assert_eq!(client.read_file(&manifest, "tensor").await.unwrap(), tensor);
    assert_eq!(client.read_file(&manifest, "small").await.unwrap(), copied);
    cluster.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_save_while_the_previous_one_uploads_waits_or_skips() {
    use starckpt_proto::control::RegisterTargetRequest;
    use starckpt_proto::control::control_client::ControlClient;

    // The only target accepts connections and never answers (nor heartbeats), so an upload
    // stays in flight.
    let dir = tempfile::tempdir().unwrap();
    let slow = common::slow_heartbeats;
    let cluster = DevCluster::start_tuned(dir.path(), "127.0.0.1:0", 0, EngineKind::Uring, slow, |_| {}).await.unwrap();
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_address = silent.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let mut control = ControlClient::connect(format!("http://{}", cluster.control_address)).await.unwrap();
    let registration = |proof| RegisterTargetRequest {
        target_id: "silent-1".into(),
        data_address: silent_address.clone(),
        capacity_bytes: 1 << 30,
        used_bytes: 0,
        failure_domain: String::new(),
        rdma_device: String::new(),
        proof,
    };
    // Only a process holding the cluster key may register as a target.
    let refused = control.register_target(registration(Bytes::new())).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused}");
    let expires = std::time::SystemTime::now() + Duration::from_secs(60);
    let rights = starckpt_proto::capability::Rights::TARGET;
    let scope = |id, address| starckpt_proto::capability::registration_scope(id, address);
    // Another target's proof, a heartbeat's, or one for another address (seen on the wire) will
    // not do.
    for stolen in [scope("another-target", &silent_address), "silent-1".into(), scope("silent-1", "10.9.9.9:1")] {
        let stolen = cluster.cluster_key.mint(rights, expires, Some(&stolen));
        let refused = control.register_target(registration(stolen)).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused}");
    }
    let proof = cluster.cluster_key.mint(rights, expires, Some(&scope("silent-1", &silent_address)));
    control.register_target(registration(proof)).await.unwrap();
    let mut config = ClientConfig::new(cluster.control_address.to_string());
    // Long enough that the checks below, made while the first save uploads, come before it
    // gives up on a busy machine.
    config.tcp.deadline.allowance = Duration::from_secs(5);
    let client = Client::connect(config).await.unwrap();
    let part = |step| SavePart::new("bp", step).buffer("f", Bytes::from(random(10_000, step))).unwrap();

    let first = client.save(part(1)).await.unwrap();
    assert!(!first.is_finished());
    // Skip policy: reported as skipped at once.
    assert!(client.try_save(part(2)).await.unwrap().is_none(), "a save while one uploads must be skipped");
    // Wait policy: does not even start staging until the first save has finished.
    let waiting = tokio::spawn({
        let client = client.clone();
        async move { client.save(part(3)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the second save must wait for the first");
    let failed = first.wait().await.unwrap_err();
    assert!(matches!(failed, Error::NoTarget { .. }), "{failed}");
    let third = waiting.await.unwrap().unwrap();
    assert!(third.wait().await.is_err());
    assert!(client.latest("bp").await.unwrap().is_none(), "nothing half-uploaded is ever committed");
}

/// Values like a trained layer's bf16 weights: small, so their exponents take few values.
fn bf16_weights(values: usize, seed: u64) -> Vec<u8> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..values)
        .flat_map(|_| (((rng.random::<f32>() - 0.5) * 0.05).to_bits() >> 16).to_le_bytes()[..2].to_vec())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_chunks_round_trip_repair_and_dedup_across_codecs() {
    use starckpt_proto::codec::{Codec, CompressConfig};
    let (dir, cluster, client) = cluster(2, |c| {
        c.chunk_size_bytes = 256 * 1024;
        c.compression = Some(CompressConfig::default());
    })
    .await;
    let weights = bf16_weights(700_001, 31);
    let noise = random(600_000, 32);
    let part = SavePart::new("packed", 1)
        .buffer("w.bf16", Bytes::from(weights.clone()))
        .unwrap()
        .buffer("noise", Bytes::from(noise.clone()))
        .unwrap();
    let handle = client.save(part).await.unwrap();
    let progress = std::sync::Arc::clone(handle.progress());
    assert!(handle.wait().await.unwrap().committed());
    let (uploaded, stored) =
        (progress.uploaded_bytes.load(Ordering::Relaxed), progress.stored_bytes.load(Ordering::Relaxed));
    assert_eq!(uploaded, (weights.len() + noise.len()) as u64);
    assert!(stored < uploaded - weights.len() as u64 / 5, "weights shrank: {stored} of {uploaded}");

    let manifest = client.manifest("packed", None).await.unwrap();
    let w = &manifest.file("w.bf16").unwrap().chunks;
    assert!(
        w.iter()
            .all(|c| matches!(c.codec, Codec::Planes16 | Codec::Planes32) && c.stored_length_bytes < c.length_bytes),
        "{w:?}"
    );
    assert!(manifest.file("noise").unwrap().chunks.iter().all(|c| c.codec == Codec::None), "noise is stored as is");
    assert_eq!(&client.read_file(&manifest, "w.bf16").await.unwrap()[..], &weights[..]);
    assert_eq!(&client.read_file(&manifest, "noise").await.unwrap()[..], &noise[..]);
    let got = client.read_range(&manifest, "w.bf16", 300_001, 400_000).await.unwrap();
    assert_eq!(&got[..], &weights[300_001..700_001]);

    // Rot the stored (compressed) bytes of each chunk's first copy: reads still return the
    // weights, and read repair rewrites the bad copies.
    let dirs = target_dirs(dir.path(), 2);
    for chunk in w {
        let path = chunk_file(&dirs[&chunk.replicas[0]], &chunk.hash);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[4096 + 40] ^= 0x08;
        std::fs::write(&path, bytes).unwrap();
    }
    assert_eq!(&client.read_file(&manifest, "w.bf16").await.unwrap()[..], &weights[..]);
    // Read repair sends the decoded bytes, so a rewritten copy is stored uncompressed.
    let repaired =
        || w.iter().all(|c| copy_verifies(&chunk_file(&dirs[&c.replicas[0]], &c.hash), &c.hash, c.length_bytes));
    common::eventually("every rotten compressed copy rewritten", repaired).await;

    // The same bytes saved by a client that does not compress: found present, nothing sent.
    let mut config = ClientConfig::new(cluster.control_address.to_string());
    config.chunk_size_bytes = 256 * 1024;
    let plain = Client::connect(config).await.unwrap();
    let part = SavePart::new("plain", 1).buffer("w.bf16", Bytes::from(weights.clone())).unwrap();
    let outcome = plain.save(part).await.unwrap().wait().await.unwrap();
    assert_eq!((outcome.uploaded_bytes, outcome.deduplicated_chunks), (0, w.len() as u64));
    let manifest = plain.manifest("plain", None).await.unwrap();
    assert_eq!(&plain.read_file(&manifest, "w.bf16").await.unwrap()[..], &weights[..]);
    cluster.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_rdma_devices_data_travels_over_shared_memory_or_tcp() {
    if fabric().is_some() {
        return; // this test is about the default transports
    }
    // On a host without RDMA devices (this one: no InfiniBand in the kernel), both sides fail to
    // open one (with the ibverbs layer built in, or not) and nothing changes for the caller. On a
    // host with a device, the same cluster uses it.
    let has_device = starckpt_rdma::open(&starckpt_rdma::DeviceSettings::default()).is_ok();
    for shm in [true, false] {
        let (_dir, _cluster, client) = cluster(2, |config| config.shm.enabled = shm).await;
        let data = random(300_000, 11);
        let part = SavePart::new("plain", 1).buffer("w.bin", Bytes::from(data.clone())).unwrap();
        client.save(part).await.unwrap().wait().await.unwrap();
        for target in client.targets().await.unwrap() {
            let kind = client.transport_kind(&target).await.unwrap();
            let expected = if shm {
                "shm"
            } else if has_device {
                "rdma"
            } else {
                "tcp"
            };
            assert_eq!(kind, expected, "shm enabled: {shm}");
        }
        let manifest = client.manifest("plain", Some(1)).await.unwrap();
        assert_eq!(&client.read_file(&manifest, "w.bin").await.unwrap()[..], &data[..]);
    }
}
