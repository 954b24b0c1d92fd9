#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
//! Retention and garbage collection through real processes: the CLI sets policies and tags, GC
//! frees exactly the chunks no retained or in-flight checkpoint needs, and saves racing a sweep
//! keep every chunk they rely on.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Cluster, random_bytes, tree};

/// Chunks are 64 KiB in these tests, so a few MiB make hundreds of chunks.
const CHUNK: &str = "65536";
/// Older than the default grace period (twice the default 30 min pending timeout).
const LONG_AGO: Duration = Duration::from_secs(3 * 3600);

fn write_file(dir: &Path, name: &str, len: usize, seed: u64) -> PathBuf {
    let path = dir.join(name);
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(&path, random_bytes(len, seed)).unwrap();
    path
}

fn save(cluster: &Cluster, job: &str, step: u64, path: &Path) -> serde_json::Value {
    let step = step.to_string();
    cluster.json(&["save", "--job", job, "--step", &step, "--chunk-size", CHUNK, path.to_str().unwrap()])
}

fn restore_matches(cluster: &Cluster, job: &str, step: u64, source: &Path) {
    let to = cluster.dir.path().join(format!("restored-{job}-{step}"));
    cluster.ok(&["restore", "--job", job, "--step", &step.to_string(), "--to", to.to_str().unwrap(), "--force"]);
    let name = source.file_name().unwrap();
    assert_eq!(std::fs::read(to.join(name)).unwrap(), std::fs::read(source).unwrap(), "{job} step {step}");
}

/// Files in the targets' free pools.
fn free_files(cluster: &Cluster) -> usize {
    (0..cluster.targets.len()).map(|i| std::fs::read_dir(cluster.target_dir(i).join("free")).unwrap().count()).sum()
}

fn steps_in(listing: &serde_json::Value, state: &str) -> Vec<u64> {
    listing.as_array().unwrap().iter().filter(|c| c["state"] == state).map(|c| c["step"].as_u64().unwrap()).collect()
}

#[test]
fn retention_tags_and_gc_free_exactly_the_garbage() {
    let mut cluster = Cluster::start(2);
    let data = cluster.dir.path().join("data");
    let out = cluster.ok(&["retention", "job", "--keep-last", "2"]);
    assert!(out.contains("keep the last 2"), "{out}");

    let mut files = Vec::new();
    for step in 1..=4u64 {
        let file = write_file(&data.join(step.to_string()), "state.bin", 1 << 20, step);
        // Step 4 also carries step 3's bytes: shared chunks must survive step 3's deletion.
        if step == 4 {
            let mut bytes = std::fs::read(&file).unwrap();
            bytes.extend(std::fs::read(&files[2]).unwrap());
            std::fs::write(&file, bytes).unwrap();
        }
        save(&cluster, "job", step, &file);
        if step == 1 {
            cluster.ok(&["tag", "job", "1", "best"]);
        }
        files.push(file);
    }
    let listing = cluster.json(&["ls", "job", "--all"]);
    assert_eq!(steps_in(&listing, "committed"), vec![1, 3, 4], "the last two and the tagged one");
    assert_eq!(steps_in(&listing, "deleted"), vec![2]);
    assert_eq!(listing[0]["tags"], serde_json::json!(["best"]));

    // Step 2's 16 chunks are garbage (two copies each: the default replication factor, on both
    // targets), but too recently used to collect.
    let before = cluster.total_chunks();
    let report = cluster.json(&["gc"]);
    assert_eq!((report["chunks_deleted"].as_u64(), report["targets_swept"].as_u64()), (Some(0), Some(2)));
    assert_eq!(report["chunks_in_grace"], 2 * 16);
    // Once they are older than the grace period they go; nothing a kept checkpoint names does.
    cluster.age_all_chunks(LONG_AGO);
    let report = cluster.json(&["gc"]);
    assert_eq!(report["chunks_deleted"], 2 * 16, "{report}");
    assert_eq!(report["live_chunks"], 16 * 3, "distinct chunks");
    assert_eq!(cluster.total_chunks(), before - 2 * 16);
    // Their files are kept for reuse (the targets' free pools), not unlinked.
    assert_eq!(free_files(&cluster), 2 * 16);
    for step in [1, 3, 4] {
        restore_matches(&cluster, "job", step, &files[step as usize - 1]);
    }
    let stderr = cluster.fails(&["restore", "--job", "job", "--step", "2", "--to", "/tmp/never"]);
    assert!(stderr.contains("no committed checkpoint at step 2"), "{stderr}");

    // Tighter retention deletes at once; untagging lets it take step 1; shared chunks stay.
    let out = cluster.ok(&["retention", "job", "--keep-last", "1"]);
    assert!(out.contains("deleted steps 3"), "{out}");
    cluster.ok(&["tag", "job", "1", "best", "--remove"]);
    assert_eq!(steps_in(&cluster.json(&["ls", "job"]), "committed"), vec![4]);
    cluster.age_all_chunks(LONG_AGO);
    let report = cluster.json(&["gc"]);
    assert_eq!(report["chunks_deleted"], 2 * 16, "step 1's chunks; step 3's are all in step 4");
    assert_eq!(cluster.total_chunks(), 2 * 32);
    restore_matches(&cluster, "job", 4, &files[3]);

    // New chunks of the same size overwrite free files (a restarted target reuses them at once;
    // one that recycled them waits for in-flight reads first), and read back intact.
    assert_eq!(free_files(&cluster), 4 * 16);
    cluster.kill_and_restart();
    let file = write_file(&data.join("5"), "state.bin", 1 << 20, 5);
    save(&cluster, "job", 5, &file);
    assert_eq!(free_files(&cluster), 2 * 16, "16 new chunks, 2 copies each, in reused files");
    restore_matches(&cluster, "job", 5, &file);

    // Bad input gets clear errors.
    let stderr = cluster.fails(&["tag", "job", "4", "no spaces"]);
    assert!(stderr.contains("invalid tag"), "{stderr}");
    let stderr = cluster.fails(&["tag", "job", "99", "x"]);
    assert!(stderr.contains("no committed checkpoint at step 99"), "{stderr}");
    let stderr = cluster.fails(&["retention", "job", "--keep-last=-1"]);
    assert!(stderr.contains("invalid value"), "{stderr}");
    let file = file.to_str().unwrap();
    let stderr = cluster.fails(&["save", "--job", "job", "--step", "9", "--chunk-size", "1", file]);
    assert!(stderr.contains("chunk size 1 is outside 65536..=67108864 bytes"), "{stderr}");
}

#[test]
fn saves_racing_a_sweep_keep_every_chunk_they_rely_on() {
    // A slow sweep (25 deletions per second over ~300 garbage chunks) that saves run into.
    let cluster = Cluster::start_with(1, &["--gc-deletes-per-sec", "25", "--gc-interval-secs", "0"]);
    let data = cluster.dir.path().join("data");
    let garbage = write_file(&data.join("g"), "garbage.bin", 16 << 20, 100);
    let reused = write_file(&data.join("r"), "reused.bin", 2 << 20, 101);
    let fresh = write_file(&data.join("f"), "fresh.bin", 2 << 20, 102);
    save(&cluster, "race", 1, &garbage);
    save(&cluster, "race", 2, &reused);
    cluster.ok(&["rm", "race", "1"]);
    cluster.ok(&["rm", "race", "2"]);
    cluster.age_all_chunks(LONG_AGO);
    let total = cluster.total_chunks();
    assert_eq!(total, 256 + 32);

    let mut gc = Command::new(common::BIN)
        .args(["gc", "--json"])
        .env("STARCKPT_SERVER", &cluster.server.address)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while cluster.total_chunks() == total {
        assert!(Instant::now() < deadline, "the sweep never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Mid-sweep: one save deduplicates against the old, unreferenced chunks of `reused` (its
    // HAS refreshes them), another uploads new chunks; both commit while the sweep goes on.
    let deduplicated = save(&cluster, "race", 3, &reused);
    let uploaded = save(&cluster, "race", 4, &fresh);
    assert!(gc.try_wait().unwrap().is_none(), "the sweep ended before the saves committed: the race was not run");
    assert!(deduplicated["deduplicated_chunks"].as_u64().unwrap() > 0, "{deduplicated}");
    assert_eq!(uploaded["deduplicated_chunks"], 0);

    let output = gc.wait_with_output().unwrap();
    assert!(output.status.success());
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert!(report["chunks_deleted"].as_u64().unwrap() >= 256, "{report}");
    restore_matches(&cluster, "race", 3, &reused);
    restore_matches(&cluster, "race", 4, &fresh);
    // Only the garbage went: what is left is exactly the two live checkpoints' chunks.
    assert_eq!(cluster.total_chunks(), 64);
    let restored = cluster.dir.path().join("restored-race-3");
    assert_eq!(tree(&restored).len(), 1);
}

#[test]
fn a_grace_period_shorter_than_the_pending_timeout_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(common::BIN)
        .args(["server", "--listen", "127.0.0.1:0", "--pending-timeout-secs", "600", "--gc-grace-secs", "300"])
        .args(["--db", dir.path().join("meta.db").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("must exceed the pending timeout"), "{stderr}");
}

#[test]
fn restore_latest_moves_on_when_retention_deletes_what_it_was_restoring() {
    // A relaunched trainer's `restore --latest` reads step 1's manifest; before it reads the
    // chunks (a fault point holds it 15 s), step 2 commits, retention deletes step 1 and GC
    // collects its chunks. The restore hears that step 1 was deleted and restores step 2.
    let cluster = Cluster::start(2);
    let data = cluster.dir.path().join("data");
    cluster.ok(&["retention", "job", "--keep-last", "1"]);
    let first = write_file(&data.join("1"), "state.bin", 1 << 20, 31);
    save(&cluster, "job", 1, &first);
    let to = cluster.dir.path().join("restored");
    let mut restore = Command::new(common::BIN)
        .args(["-v", "restore", "--job", "job", "--latest", "--to", to.to_str().unwrap()])
        .env("STARCKPT_SERVER", &cluster.server.address)
        .env("FAILPOINTS", "client.restore.begin=1*sleep(15000)")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = std::io::BufReader::new(restore.stderr.take().unwrap());
    let (lines, logged) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        for line in stderr.lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    let mut log = Vec::new();
    while !log.iter().any(|line: &String| line.contains("restoring") && line.contains("step=1")) {
        log.push(logged.recv_timeout(Duration::from_secs(60)).expect("the restore logs that it began"));
    }

    let second = write_file(&data.join("2"), "state.bin", 1 << 20, 32);
    save(&cluster, "job", 2, &second);
    assert_eq!(steps_in(&cluster.json(&["ls", "job", "--all"]), "deleted"), vec![1]);
    cluster.age_all_chunks(LONG_AGO);
    let report = cluster.json(&["gc"]);
    assert_eq!(report["chunks_deleted"], 2 * 16, "step 1's chunks, both copies: {report}");

    let output = restore.wait_with_output().unwrap();
    reader.join().unwrap();
    log.extend(logged.try_iter());
    let log = log.join("\n");
    assert!(output.status.success(), "{log}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("restored job step 2"), "{stdout}\n{log}");
    assert!(log.contains("was deleted while it was being restored"), "{log}");
    assert_eq!(std::fs::read(to.join("state.bin")).unwrap(), std::fs::read(&second).unwrap());
}
