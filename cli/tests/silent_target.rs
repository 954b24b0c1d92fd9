#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
//! A storage host that stops answering (SIGSTOP: its sockets stay open, its kernel still accepts
//! connections, nothing is answered) must not freeze saves or restores: a copy lagging its
//! sibling is started on another target too (a hedge), a read waits a few times the usual read
//! time before reading the next replica, every data-plane request has a deadline that scales
//! with its size, and a target found silent is tried last by the client's next chunks.
//!
//! The control plane here asks for heartbeats every 60 s, so it keeps offering the stopped
//! target in placements: what is tested is the client finding the silence out by itself (with
//! 1 s heartbeats the control plane marks it suspect within 2 s and new saves avoid it anyway:
//! `e2e.rs` `a_silent_target_turns_suspect_then_dead_and_gets_no_new_chunks`).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{Cluster, Proc, random_bytes};

/// Generous bound for what must not hang: before deadlines, one request to a stopped target
/// waited 120 s, and each chunk placed on it waited its own.
const HANG: Duration = Duration::from_secs(60);

fn stop(target: &Proc) {
    // SAFETY: signalling our own child.
    unsafe { libc::kill(target.pid() as i32, libc::SIGSTOP) };
}

/// Three targets, with shared memory (same host) or TCP only; slow heartbeats.
fn cluster(tcp_only: bool) -> Cluster {
    cluster_with(tcp_only, &[])
}

/// [`cluster`], the control plane started with `flags` too.
fn cluster_with(tcp_only: bool, flags: &[&str]) -> Cluster {
    let mut server_flags = vec!["--heartbeat-secs", "60"];
    server_flags.extend_from_slice(flags);
    let mut cluster = Cluster::start_with(0, &server_flags);
    for index in 0..3 {
        let flags: &[&str] = if tcp_only { &["--no-shm"] } else { &[] };
        let target = cluster.start_target_with(index, flags);
        cluster.targets.push(target);
    }
    cluster.wait_alive(3);
    cluster
}

fn target_id(cluster: &Cluster, address: &str) -> String {
    let status = cluster.json(&["status"]);
    let targets = status["targets"].as_array().unwrap();
    let target = targets.iter().find(|t| t["data_address"] == address).expect("the target is registered");
    target["target_id"].as_str().unwrap().to_owned()
}

/// `starckpt save` of `file` as `job` `step` in 256 KiB chunks; its JSON outcome (or stderr on
/// failure) and how long it took.
fn save(cluster: &Cluster, job: &str, step: u64, file: &Path) -> (Result<serde_json::Value, String>, Duration) {
    let step = step.to_string();
    let args = ["--json", "save", "--job", job, "--step", &step, "--chunk-size", "262144", file.to_str().unwrap()];
    let started = Instant::now();
    let output = cluster.cli(&args);
    let elapsed = started.elapsed();
    if output.status.success() {
        (Ok(serde_json::from_slice(&output.stdout).unwrap()), elapsed)
    } else {
        (Err(String::from_utf8_lossy(&output.stderr).into_owned()), elapsed)
    }
}

fn replicas(cluster: &Cluster, job: &str, step: u64) -> Vec<Vec<String>> {
    let shown = cluster.json(&["show", job, &step.to_string()]);
    let mut all = Vec::new();
    for file in shown["files"].as_array().unwrap() {
        for chunk in file["chunk_refs"].as_array().unwrap() {
            all.push(chunk["replicas"].as_array().unwrap().iter().map(|r| r.as_str().unwrap().to_owned()).collect());
        }
    }
    all
}

fn restore_within(cluster: &Cluster, job: &str, step: u64, to: &Path) -> Duration {
    let started = Instant::now();
    let output = cluster.cli(&["restore", "--job", job, "--step", &step.to_string(), "--to", to.to_str().unwrap()]);
    let elapsed = started.elapsed();
    assert!(output.status.success(), "restore failed: {}", String::from_utf8_lossy(&output.stderr));
    assert!(elapsed < HANG, "restore took {elapsed:?}");
    elapsed
}

/// With two copies of every chunk and one of three targets stopped before the save begins
/// (offered in its placement all the same), the save commits with both copies of every chunk on
/// the two that answer; a restore of an older checkpoint with copies on the stopped target reads
/// them from the others; the target continued, nothing it missed is in any manifest, and every
/// checkpoint restores intact.
fn saves_and_restores_around_a_stopped_target(tcp_only: bool) {
    let cluster = cluster(tcp_only);
    let data = |seed| random_bytes(24 << 20, seed);
    let file = cluster.dir.path().join("state.bin");
    let first = data(1);
    std::fs::write(&file, &first).unwrap();
    let (saved, healthy) = save(&cluster, "hung", 1, &file);
    assert_eq!(saved.unwrap()["committed"], true);
    let stopped_id = target_id(&cluster, &cluster.targets[0].address);
    assert!(
        replicas(&cluster, "hung", 1).iter().any(|r| r.contains(&stopped_id)),
        "step 1 should have copies on every target"
    );

    let restored = cluster.dir.path().join("healthy");
    let healthy_restore = restore_within(&cluster, "hung", 1, &restored);

    stop(&cluster.targets[0]);
    let second = data(2);
    std::fs::write(&file, &second).unwrap();
    let (saved, stalled) = save(&cluster, "hung", 2, &file);
    let saved = saved.unwrap_or_else(|stderr| panic!("the save failed with a target stopped: {stderr}"));
    assert_eq!(saved["committed"], true);
    assert!(stalled < HANG, "the save took {stalled:?} with a target stopped");
    for chunk in replicas(&cluster, "hung", 2) {
        assert_eq!(chunk.len(), 2, "{chunk:?}");
        assert!(!chunk.contains(&stopped_id), "a copy recorded on the stopped target: {chunk:?}");
    }

    // The saving client reported the target it found silent: the control plane, which still
    // hears nothing amiss (heartbeats 60 s apart), shows it suspect and places no new chunks
    // there for a while.
    let state = |cluster: &Cluster| {
        let status = cluster.json(&["status"]);
        let targets = status["targets"].as_array().unwrap().clone();
        targets.into_iter().find(|t| t["target_id"] == stopped_id.as_str()).unwrap()["state"].clone()
    };
    assert_eq!(state(&cluster), "suspect", "the silent target was not reported");

    // Step 1 has copies on the stopped target: read from the other replica.
    let again = cluster.dir.path().join("stalled");
    let stalled_restore = restore_within(&cluster, "hung", 1, &again);
    assert_eq!(std::fs::read(again.join("state.bin")).unwrap(), first);
    eprintln!(
        "transport {}: save {healthy:.2?} with all targets answering, {stalled:.2?} with one stopped; \
         restore {healthy_restore:.2?}, {stalled_restore:.2?}",
        if tcp_only { "tcp" } else { "shm" }
    );

    // Continued in the middle of the next save (its copies there lagging, hedged, abandoned):
    // whatever it answers late is ignored, nothing is committed twice, and nothing is corrupt.
    let third = data(3);
    std::fs::write(&file, &third).unwrap();
    let resumer = {
        let pid = cluster.targets[0].pid();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            // SAFETY: signalling our own child.
            unsafe { libc::kill(pid as i32, libc::SIGCONT) };
        })
    };
    assert_eq!(save(&cluster, "hung", 3, &file).0.unwrap()["committed"], true);
    resumer.join().unwrap();
    let listed = cluster.json(&["ls", "hung"]);
    assert_eq!(listed.as_array().map(Vec::len), Some(3), "{listed}");
    for (step, bytes) in [(1, &first), (2, &second), (3, &third)] {
        let to = cluster.dir.path().join(format!("after-{step}"));
        restore_within(&cluster, "hung", step, &to);
        assert_eq!(&std::fs::read(to.join("state.bin")).unwrap(), bytes, "step {step}");
    }
}

#[test]
fn a_stopped_target_holds_neither_a_save_nor_a_restore_over_shared_memory() {
    saves_and_restores_around_a_stopped_target(false);
}

#[test]
fn a_stopped_target_holds_neither_a_save_nor_a_restore_over_tcp() {
    saves_and_restores_around_a_stopped_target(true);
}

/// One copy, and the only target stopped: the save fails within a bound, naming the target, and
/// the last committed checkpoint stays the latest.
#[test]
fn a_save_whose_only_target_is_stopped_fails_in_time_naming_it() {
    let mut cluster = Cluster::start_with(0, &["--heartbeat-secs", "60"]);
    let target = cluster.start_target(0);
    cluster.targets.push(target);
    cluster.wait_alive(1);
    let file = cluster.dir.path().join("state.bin");
    std::fs::write(&file, random_bytes(4 << 20, 5)).unwrap();
    assert_eq!(save(&cluster, "alone", 1, &file).0.unwrap()["committed"], true);
    let id = target_id(&cluster, &cluster.targets[0].address);

    stop(&cluster.targets[0]);
    std::fs::write(&file, random_bytes(4 << 20, 6)).unwrap();
    let (failed, took) = save(&cluster, "alone", 2, &file);
    let stderr = failed.expect_err("a save with its only target stopped committed");
    assert!(took < HANG, "the failing save took {took:?}");
    assert!(stderr.contains(&id), "the error does not name the stopped target {id}: {stderr}");
    // SAFETY: signalling our own child.
    unsafe { libc::kill(cluster.targets[0].pid() as i32, libc::SIGCONT) };
    assert_eq!(cluster.json(&["ls"])[0]["latest_step"], 1);
}

/// The control plane's own passes over the targets (GC's sweep, re-replication's count of
/// copies, the object-store tier's copy) with one target stopped but still listed alive: each
/// finishes within a bound, the stopped target reported as not done, the others done; the tier
/// reads the chunks the stopped target holds from their other copies.
#[test]
fn control_plane_passes_with_a_target_stopped_finish_in_time() {
    let tier = tempfile::tempdir().unwrap();
    let tier_url = format!("file://{}", tier.path().display());
    let cluster = cluster_with(true, &["--tier", &tier_url, "--tier-interval-secs", "0"]);
    let file = cluster.dir.path().join("state.bin");
    std::fs::write(&file, random_bytes(4 << 20, 7)).unwrap();
    assert_eq!(save(&cluster, "passes", 1, &file).0.unwrap()["committed"], true);
    let id = target_id(&cluster, &cluster.targets[0].address);
    stop(&cluster.targets[0]);

    let started = Instant::now();
    let (succeeded, report) = cluster.json_outcome(&["gc"]);
    let gc_took = started.elapsed();
    assert!(gc_took < HANG, "GC took {gc_took:?} with a target stopped");
    assert!(!succeeded, "a GC pass that could not sweep a target exits non-zero: {report}");
    assert_eq!(report["targets_swept"], 2, "{report}");
    let errors = report["target_errors"].as_array().unwrap();
    assert!(errors.len() == 1 && errors[0].as_str().unwrap().contains(&id), "{report}");

    let started = Instant::now();
    let _ = cluster.json_outcome(&["repair"]);
    let repair_took = started.elapsed();
    assert!(repair_took < HANG, "re-replication took {repair_took:?} with a target stopped");

    let started = Instant::now();
    let report = cluster.json(&["tier"]);
    let tier_took = started.elapsed();
    assert!(tier_took < HANG, "the tier pass took {tier_took:?} with a target stopped");
    assert_eq!(report["checkpoints_tiered"], 1, "{report}");
    eprintln!(
        "with a target stopped: GC pass {gc_took:.2?}, re-replication pass {repair_took:.2?}, tier pass {tier_took:.2?}"
    );

    // SAFETY: signalling our own child.
    unsafe { libc::kill(cluster.targets[0].pid() as i32, libc::SIGCONT) };
    let restored = cluster.dir.path().join("restored");
    restore_within(&cluster, "passes", 1, &restored);
    assert_eq!(std::fs::read(restored.join("state.bin")).unwrap(), std::fs::read(&file).unwrap());
}

/// A target stopped while a save's uploads are under way (once it has stored some of them):
/// the save commits in time and restores intact with the target still stopped. Then the same
/// bytes saved again, whose every chunk is asked for (HAS) at its targets, the stopped one among
/// them: deduplicated where they answer, in time.
#[test]
fn a_target_stopped_during_a_saves_uploads_or_after_them() {
    let cluster = cluster(false);
    let file = cluster.dir.path().join("state.bin");
    let bytes = random_bytes(96 << 20, 11);
    std::fs::write(&file, &bytes).unwrap();
    let before = cluster.chunk_files(0).len();
    let args = ["save", "--job", "during", "--step", "1", "--chunk-size", "262144", file.to_str().unwrap()];
    let started = Instant::now();
    let mut saving = cluster.spawn(&args);
    // Stopped once it holds some of this save's chunks (or once the save is over, on a machine
    // fast enough to finish first: then the dedup half below still meets it stopped).
    while cluster.chunk_files(0).len() == before && saving.try_wait().unwrap().is_none() {
        assert!(started.elapsed() < HANG, "the save stored nothing on target 0");
        std::thread::sleep(Duration::from_millis(2));
    }
    let mid_save = saving.try_wait().unwrap().is_none();
    stop(&cluster.targets[0]);
    let status = loop {
        if let Some(status) = saving.try_wait().unwrap() {
            break status;
        }
        assert!(started.elapsed() < HANG, "the save took over {HANG:?} with a target stopped mid-upload");
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = started.elapsed();
    assert!(status.success(), "the save failed with a target stopped mid-upload");
    eprintln!("saved 96 MiB in {took:.2?}, target stopped {}", if mid_save { "mid-upload" } else { "after it" });
    let restored = cluster.dir.path().join("restored");
    restore_within(&cluster, "during", 1, &restored);
    assert!(std::fs::read(restored.join("state.bin")).unwrap() == bytes, "restored bytes differ");

    let (saved, took) = save(&cluster, "during", 2, &file);
    let saved = saved.unwrap_or_else(|stderr| panic!("the same bytes saved again failed: {stderr}"));
    assert_eq!(saved["committed"], true);
    assert!(took < HANG, "saving the same bytes again took {took:?}");
    // SAFETY: signalling our own child.
    unsafe { libc::kill(cluster.targets[0].pid() as i32, libc::SIGCONT) };
}
