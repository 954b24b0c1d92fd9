#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
//! The crash matrix: seeded trials, each a real cluster (a control plane and three targets as
//! processes, two copies per chunk, scrubbing every second) that saves checkpoints while one
//! fault strikes per save at a random moment: the saving client, a target or the control plane
//! is SIGKILLed (and what died is restarted), or a byte of a stored copy is flipped. After every
//! trial:
//!
//! - `latest` is the newest committed checkpoint;
//! - every committed checkpoint restores byte for byte (no chunk is missing on all its copies);
//!   a save the client saw succeed is always among them;
//! - every flipped copy was detected (removed by the scrubber or rewritten by read repair).
//!
//! `STARCKPT_CRASH_TRIALS` (default 3) trials run from `STARCKPT_CRASH_SEED` (default: random,
//! printed); a failing trial prints its seed, and `STARCKPT_CRASH_SEED=S STARCKPT_CRASH_TRIALS=1`
//! replays it.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{BIN, Cluster, random_bytes};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Clone, Copy, Debug)]
enum Fault {
    KillClient,
    KillTarget(usize),
    KillServer,
    FlipByte,
    Nothing,
}

/// Prints the trial's seed if the test panics inside it.
struct SeedOnPanic(u64);

impl Drop for SeedOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("crash-matrix trial failed; replay with STARCKPT_CRASH_SEED={} STARCKPT_CRASH_TRIALS=1", self.0);
        }
    }
}

#[test]
fn crash_matrix() {
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let trials = env("STARCKPT_CRASH_TRIALS").unwrap_or(3);
    let first = env("STARCKPT_CRASH_SEED").unwrap_or_else(|| rand::rng().random_range(0..1_000_000));
    let mut faults: BTreeMap<String, usize> = BTreeMap::new();
    let mut totals = Outcome::default();
    for seed in first..first + trials {
        eprintln!("crash-matrix trial seed {seed}");
        let _guard = SeedOnPanic(seed);
        let outcome = trial(seed);
        for fault in &outcome.faults {
            *faults.entry(format!("{fault:?}").split('(').next().unwrap().to_owned()).or_default() += 1;
        }
        totals.saves += outcome.saves;
        totals.acknowledged += outcome.acknowledged;
        totals.committed += outcome.committed;
        totals.corruptions_detected += outcome.corruptions_detected;
        totals.mid_save += outcome.mid_save;
    }
    eprintln!(
        "crash matrix: {trials} trials from seed {first}; faults injected: {faults:?} ({} while the save ran); {} \
         saves, {} acknowledged, {} committed (each restored byte-exact), {} corruptions (each detected)",
        totals.mid_save, totals.saves, totals.acknowledged, totals.committed, totals.corruptions_detected
    );
}

#[derive(Default)]
struct Outcome {
    faults: Vec<Fault>,
    saves: usize,
    acknowledged: usize,
    committed: usize,
    corruptions_detected: usize,
    /// Faults that struck while the save was still running.
    mid_save: usize,
}

fn save(cluster: &Cluster, step: u64, file: &Path) -> Child {
    let step = step.to_string();
    Command::new(BIN)
        .args(["save", "--job", "crash", "--step", &step, "--chunk-size", "262144", file.to_str().unwrap()])
        .env("STARCKPT_SERVER", &cluster.server.address)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn wait(child: &mut Child, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.success();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// One trial: four saves, one fault each; asserts the invariants.
fn trial(seed: u64) -> Outcome {
    let mut rng = StdRng::seed_from_u64(seed);
    let scrub = ["--scrub-mib-per-sec", "1024", "--scrub-pause-secs", "1"];
    let mut cluster = Cluster::start(0);
    for index in 0..3 {
        let target = cluster.start_target_with(index, &scrub);
        cluster.targets.push(target);
    }
    cluster.wait_alive(3);
    let data_dir = cluster.dir.path().join("data");
    std::fs::create_dir_all(&data_dir).unwrap();
    let mut acknowledged = Vec::new();
    let mut contents = BTreeMap::new();
    let mut flipped: Vec<(PathBuf, Vec<u8>)> = Vec::new();
    let mut injected = Vec::new();
    let mut mid_save = 0;

    for step in 1..=4u64 {
        let bytes = random_bytes(rng.random_range(1 << 20..12 << 20), seed.wrapping_mul(31).wrapping_add(step));
        let file = data_dir.join(format!("state-{step}.bin"));
        std::fs::write(&file, &bytes).unwrap();
        contents.insert(step, bytes);
        let fault = match rng.random_range(0..5) {
            0 => Fault::KillClient,
            1 => Fault::KillTarget(rng.random_range(0..3)),
            2 => Fault::KillServer,
            3 => Fault::FlipByte,
            _ => Fault::Nothing,
        };
        injected.push(fault);
        let delay = Duration::from_millis(rng.random_range(0..150));
        let mut client = save(&cluster, step, &file);
        std::thread::sleep(delay);
        if client.try_wait().unwrap().is_none() {
            mid_save += 1;
        }
        match fault {
            Fault::KillClient => {
                let _ = client.kill();
            }
            Fault::KillTarget(index) => cluster.targets[index].kill(),
            Fault::KillServer => cluster.restart_server(),
            Fault::FlipByte | Fault::Nothing => {}
        }
        let succeeded = wait(&mut client, Duration::from_secs(90));
        if succeeded {
            acknowledged.push(step);
        } else if matches!(fault, Fault::Nothing | Fault::FlipByte) {
            // (Bytes are flipped after the save.) A save nothing struck must succeed.
            panic!("seed {seed}: step {step} failed with no fault");
        }
        if let Fault::KillTarget(index) = fault {
            cluster.targets[index] = cluster.start_target_with(index, &scrub);
        }
        cluster.wait_alive(3);
        if let Fault::FlipByte = fault {
            let holders: Vec<usize> = (0..3).filter(|i| !cluster.chunk_files(*i).is_empty()).collect();
            let target = holders[rng.random_range(0..holders.len())];
            let files = cluster.chunk_files(target);
            let path = files[rng.random_range(0..files.len())].clone();
            let mut bytes = std::fs::read(&path).unwrap();
            bytes[4096] ^= 1 << rng.random_range(0..8);
            std::fs::write(&path, &bytes).unwrap();
            flipped.push((path, bytes));
        }
    }

    // Invariants. Every flipped copy is detected by the target's scrubber (before any restore
    // could repair it by reading it).
    let deadline = Instant::now() + Duration::from_secs(20);
    for (path, bad) in &flipped {
        while std::fs::read(path).is_ok_and(|now| now == *bad) {
            assert!(Instant::now() < deadline, "seed {seed}: corruption of {} was never detected", path.display());
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    // (Only a job whose every save died before reaching the control plane may not exist.)
    let output = cluster.cli(&["ls", "crash", "--all", "--json"]);
    assert!(output.status.success() || acknowledged.is_empty(), "seed {seed}: ls failed: {output:?}");
    let listing: serde_json::Value =
        if output.status.success() { serde_json::from_slice(&output.stdout).unwrap() } else { serde_json::json!([]) };
    let committed: Vec<u64> = listing
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["state"] == "committed")
        .map(|c| c["step"].as_u64().unwrap())
        .collect();
    for step in &acknowledged {
        assert!(committed.contains(step), "seed {seed}: step {step} was acknowledged but is not committed: {listing}");
    }
    let latest = cluster.json(&["ls"]).as_array().unwrap().first().and_then(|j| j["latest_step"].as_u64());
    assert_eq!(latest, committed.iter().max().copied(), "seed {seed}: latest is not the newest committed");
    for step in &committed {
        let to = cluster.dir.path().join(format!("restored-{step}"));
        cluster.ok(&["restore", "--job", "crash", "--step", &step.to_string(), "--to", to.to_str().unwrap()]);
        let restored = std::fs::read(to.join(format!("state-{step}.bin"))).unwrap();
        assert!(restored == contents[step], "seed {seed}: step {step} restored different bytes");
    }
    Outcome {
        saves: injected.len(),
        faults: injected,
        acknowledged: acknowledged.len(),
        committed: committed.len(),
        corruptions_detected: flipped.len(),
        mid_save,
    }
}
