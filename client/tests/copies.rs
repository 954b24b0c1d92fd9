#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
//! How many times each transport copies payload bytes in user space between the staging buffers
//! and the target's device buffers, and back from the device into the caller's memory for a
//! restore, counted by the copy sites themselves (`starckpt_dataplane::buf::copies`). Its own test
//! binary: the counters are per process.
//!
//! Not counted: the staging copy itself (the caller's bytes into staging, which is what a save's
//! blocking time pays for). Kernel copies (socket buffers) are not user-space copies.

mod common;

use bytes::Bytes;
use starckpt_client::SavePart;
use starckpt_dataplane::buf::copies;

/// Payload copies per chunk transfer on the way to the targets and back, for one transport.
async fn copies_per_transfer(fabric: Option<&str>, shm: bool, expected_kind: &str) -> (f64, f64) {
    copies_saving(fabric, shm, expected_kind, true, true).await
}

/// [`copies_per_transfer`] of a save whose bytes are `staged` (copied into staging buffers, as
/// `SavePart::buffer` does) or not (`SavePart::shared`: uploaded from the caller's memory), to
/// targets that write a trusted client's staged chunks from where they lie or not
/// (`placed_writes`, `TargetConfig::shm_placed_writes`).
async fn copies_saving(
    fabric: Option<&str>,
    shm: bool,
    expected_kind: &str,
    staged: bool,
    placed_writes: bool,
) -> (f64, f64) {
    let chunk = 1 << 20;
    let targets = |target: &mut starckpt_server::chunkserver::TargetConfig| target.shm_placed_writes = placed_writes;
    let (_dir, _cluster, client) = common::cluster_configured(fabric, 2, targets, |config| {
        config.shm.enabled = shm;
        config.chunk_size_bytes = chunk;
    })
    .await;
    for target in client.targets().await.unwrap() {
        assert_eq!(client.transport_kind(&target).await.unwrap(), expected_kind);
    }
    // Every chunk distinct (a repeated chunk would be deduplicated, not sent).
    let data: Vec<u8> = (0..8 * chunk).map(|i| (i * 7 + (i >> 12) * 13 + (i >> 20) * 101) as u8).collect();
    let (before, _) = copies::snapshot();
    let part = SavePart::new("copies", 1);
    let part = match staged {
        true => part.buffer("w.bin", Bytes::from(data.clone())).unwrap(),
        false => part.shared("w.bin", Bytes::from(data.clone())).unwrap(),
    };
    let outcome = client.save(part).await.unwrap().wait().await.unwrap();
    let (saved, _) = copies::snapshot();
    // Every chunk went to each of its replicas (two: the job's default).
    assert_eq!((outcome.chunks, outcome.deduplicated_chunks), (8, 0), "{outcome:?}");
    let puts = 8.0 * 2.0;
    // Whether the targets wrote staged chunks straight from the client's staging memory.
    let mut placed = 0;
    for target in client.targets().await.unwrap() {
        placed += client.target_stat(&target).await.unwrap().placed_writes;
    }
    assert_eq!(placed, if shm && staged && placed_writes { 16 } else { 0 }, "placed writes");
    let manifest = client.manifest("copies", Some(1)).await.unwrap();
    assert_eq!(&client.read_file(&manifest, "w.bin").await.unwrap()[..], &data[..]);
    let (restored, _) = copies::snapshot();
    ((saved - before) as f64 / puts, (restored - saved) as f64 / 8.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payload_copies_per_transport() {
    // TCP: the kernel copies into and out of socket buffers; a GET's bytes are read from the
    // socket straight into the caller's memory.
    assert_eq!(copies_per_transfer(None, false, "tcp").await, (0.0, 0.0));
    // RDMA: the target reads straight from the client's registered staging buffer into the buffer
    // it writes to the device; a GET lands in a receive slot and is copied out once, into place.
    assert_eq!(copies_per_transfer(Some("soft"), false, "rdma").await, (0.0, 1.0));
    // Shared memory: the client shares its staging memory at attach, and the target (whose own
    // user this test's client runs as) writes a staged chunk to its device straight from there
    // (`ShmListener::placed_writes`); a GET is read from the device straight into a slot
    // (O_DIRECT into the shared memory) and copied out of it, into place, by the client. Where
    // shared memory gets no huge pages, the target reads a GET into its own buffer and copies it
    // into the slot (`ShmListener::placed_reads`): one copy more.
    let restore = if starckpt_dataplane::shm::shared_huge_pages() { 1.0 } else { 2.0 };
    assert_eq!(copies_per_transfer(None, true, "shm").await, (0.0, restore));
    // A target told not to trust any client's staging memory (and one serving another user's
    // client) copies a staged chunk out of it first: it must own what it verifies.
    assert_eq!(copies_saving(None, true, "shm", true, false).await, (1.0, restore));
    // Bytes that were not staged (the caller's own memory) go through a slot: the client copies
    // them in, the target out.
    assert_eq!(copies_saving(None, true, "shm", false, true).await, (2.0, restore));
}
