#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
//! The targets' scrubber through real processes: a rotted copy is found and removed, and
//! re-replication makes it again; a copy it cannot remove, or a part of the store it cannot list,
//! does not stop its pass.

mod common;

use std::time::{Duration, Instant};

use common::{Cluster, random_bytes};

#[test]
fn the_scrubber_removes_a_rotted_copy_and_re_replication_restores_it() {
    let mut cluster = Cluster::start_with(0, &["--lost-after-secs", "3", "--repair-interval-secs", "0"]);
    for index in 0..2 {
        let target = cluster.start_target_with(index, &["--scrub-mib-per-sec", "1024", "--scrub-pause-secs", "1"]);
        cluster.targets.push(target);
    }
    cluster.wait_alive(2);
    let source = cluster.dir.path().join("weights.bin");
    std::fs::write(&source, random_bytes(1 << 20, 12)).unwrap();
    cluster.ok(&["save", "--job", "scrub", "--step", "1", "--chunk-size", "262144", source.to_str().unwrap()]);
    assert_eq!((cluster.chunk_files(0).len(), cluster.chunk_files(1).len()), (4, 4));

    // Rot one copy on target 0: the scrubber finds it and removes it.
    let rotten = cluster.chunk_files(0).into_iter().next().unwrap();
    let good = std::fs::read(&rotten).unwrap();
    let mut bad = good.clone();
    bad[4096 + 7] ^= 0x10;
    std::fs::write(&rotten, &bad).unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    while rotten.exists() {
        assert!(Instant::now() < deadline, "the scrubber did not remove the corrupt copy");
        std::thread::sleep(Duration::from_millis(100));
    }

    // The re-replication pass sees the listed copy gone and makes it again.
    let report = cluster.json(&["repair"]);
    assert_eq!((report["under_replicated"].as_u64(), report["copies_made"].as_u64()), (Some(1), Some(1)), "{report}");
    assert_eq!(std::fs::read(&rotten).unwrap(), good);

    // Target 0 alone now serves the whole checkpoint.
    cluster.targets[1].kill();
    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "scrub", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(std::fs::read(restored.join("weights.bin")).unwrap(), std::fs::read(&source).unwrap());
}

#[test]
fn a_corrupt_copy_the_scrubber_cannot_remove_does_not_stop_its_pass() {
    let mut cluster = Cluster::start(2);
    let source = cluster.dir.path().join("weights.bin");
    std::fs::write(&source, random_bytes(1 << 20, 13)).unwrap();
    cluster.ok(&["save", "--job", "scrub", "--step", "1", "--chunk-size", "262144", source.to_str().unwrap()]);
    assert_eq!(cluster.chunk_files(0).len(), 4);

    // Two copies on target 0 rot while it is down. It comes back scrubbing (its first pass at
    // once, the next in an hour) and unable to remove the first corrupt copy it meets.
    cluster.targets[0].kill();
    let rotten: Vec<std::path::PathBuf> = cluster.chunk_files(0).into_iter().take(2).collect();
    for path in &rotten {
        let mut bytes = std::fs::read(path).unwrap();
        bytes[4096 + 11] ^= 0x08;
        std::fs::write(path, &bytes).unwrap();
    }
    let scrubbing = ["--scrub-mib-per-sec", "1024", "--scrub-pause-secs", "3600"];
    cluster.targets[0] = cluster.start_target_env(0, &scrubbing, &[("FAILPOINTS", "target.remove_bad=1*return")]);

    // The pass goes on past the one it could not remove, and removes the other.
    let deadline = Instant::now() + Duration::from_secs(15);
    while rotten.iter().all(|path| path.exists()) {
        assert!(Instant::now() < deadline, "the scrub pass stopped at the copy it could not remove");
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(rotten.iter().filter(|path| path.exists()).count(), 1, "the one whose removal failed is kept");
    let log = std::fs::read_to_string(cluster.dir.path().join("target-0.log")).unwrap();
    assert!(log.contains("could not remove a corrupt copy"), "{log}");
}

#[test]
fn a_part_of_the_store_the_scrubber_cannot_list_does_not_stop_its_pass() {
    let mut cluster = Cluster::start(2);
    let source = cluster.dir.path().join("weights.bin");
    std::fs::write(&source, random_bytes(1 << 20, 14)).unwrap();
    cluster.ok(&["save", "--job", "scrub", "--step", "1", "--chunk-size", "262144", source.to_str().unwrap()]);

    // While target 0 is down, its last copy in hash order rots, and a chunk name ahead of it
    // becomes a file that cannot be stat'ed (a link to itself: ELOOP, as a bad inode gives EIO),
    // so every listing from the start fails there.
    cluster.targets[0].kill();
    let mut files = cluster.chunk_files(0);
    files.sort();
    let rotten = files.last().unwrap().clone();
    let mut bytes = std::fs::read(&rotten).unwrap();
    bytes[4096 + 5] ^= 0x04;
    std::fs::write(&rotten, &bytes).unwrap();
    let looped = cluster.target_dir(0).join("chunks").join("00").join("0".repeat(64));
    std::os::unix::fs::symlink(&looped, &looped).unwrap();
    let scrubbing = ["--scrub-mib-per-sec", "1024", "--scrub-pause-secs", "3600"];
    cluster.targets[0] = cluster.start_target_with(0, &scrubbing);

    // The pass reports the unreadable name and goes on to the corrupt copy after it.
    let deadline = Instant::now() + Duration::from_secs(15);
    while rotten.exists() {
        assert!(Instant::now() < deadline, "the scrub pass stopped at the part it could not list");
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = std::fs::read_to_string(cluster.dir.path().join("target-0.log")).unwrap();
    assert!(log.contains("scrub could not list part of the store"), "{log}");
}
