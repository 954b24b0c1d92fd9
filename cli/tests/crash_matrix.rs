#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
//! The crash matrix: seeded trials, each a real cluster (a control plane and three targets as
//! processes, two copies per chunk, scrubbing every second) that saves a run of checkpoints
//! (sharing a prefix, so they share chunks) with one fault per save:
//!
//! - during the save, at a random moment: the saving client, a target or the control plane is
//!   SIGKILLed (and restarted, as a supervisor would);
//! - during the save, a fault point (`starckpt_dataplane::faults`) of the client, a target or the
//!   control plane on the put or commit path fails the operation once or kills the process
//!   there (which is then restarted);
//! - during the save, one, two or three targets are full (they refuse every put);
//! - after the save: a bit of a stored copy flips (and the target may die removing it); an older
//!   checkpoint is deleted and garbage collection runs over everything aged past its grace (and a
//!   fault point may kill the control plane or a target in the middle); a target's disk is lost
//!   (killed, wiped, started empty) and re-replication restores the copies (and may be killed in
//!   the middle).
//!
//! After every trial:
//!
//! - `latest` is the newest committed checkpoint; every save the client saw succeed is committed
//!   unless it was deleted; saves whose outcome is determined (a save nothing struck; a crash
//!   before or after the commit's transaction; disks full) ended that way;
//! - every committed checkpoint restores byte for byte, and after re-replication every chunk of
//!   it has two copies on live targets; GC left no chunk no committed checkpoint needs;
//! - every flipped copy was detected (removed by the scrubber or rewritten by read repair).
//!
//! `STARCKPT_CRASH_TRIALS` (default 3) trials run from `STARCKPT_CRASH_SEED` (default: random,
//! printed); a failing trial prints its seed, and `STARCKPT_CRASH_SEED=S STARCKPT_CRASH_TRIALS=1`
//! replays it (the faults and their moments; process scheduling is the machine's).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{BIN, Cluster, Proc, random_bytes};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const TARGETS: usize = 3;
const CHUNK: usize = 256 << 10;
/// Targets hold chunk ages as if they had run a day; GC's default grace is an hour.
const LONG_AGO: Duration = Duration::from_secs(3 * 3600);
/// The control plane treats a target silent this long as lost (so a lost disk's copies are
/// made again); re-replication runs only when the matrix asks.
const SERVER_FLAGS: &[&str] = &["--lost-after-secs", "2", "--repair-interval-secs", "0", "--gc-interval-secs", "0"];
const SCRUB: &[&str] = &["--scrub-mib-per-sec", "1024", "--scrub-pause-secs", "1"];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Who {
    Client,
    Server,
    Target(usize),
}

/// Fault points on the save path, by process.
const SAVE_POINTS: &[(&str, u8)] = &[
    ("client.put", 0),
    ("client.commit", 0),
    ("client.commit.reply", 0),
    ("target.store.write", 1),
    ("target.store.rename", 1),
    ("target.store.sync_dir", 1),
    ("target.put.ack", 1),
    ("control.begin.reply", 2),
    ("control.commit.record", 2),
    ("control.commit.txn", 2),
    ("control.commit.reply", 2),
];

#[derive(Clone, Debug)]
enum Fault {
    KillClient,
    KillTarget(usize),
    KillServer,
    /// A fault point strikes at its `skip + 1`th hit: kills the process there, or fails once.
    Point {
        who: Who,
        point: &'static str,
        crash: bool,
        skip: u32,
    },
    /// This many targets refuse every put (their reserve is larger than the disk).
    DiskFull(usize),
    FlipByte {
        crash_on_remove: bool,
    },
    /// Delete an older checkpoint and collect garbage, maybe with a crash at a GC fault point.
    Gc(Option<(Who, &'static str)>),
    LoseDisk {
        target: usize,
        crash_repair: bool,
    },
    Nothing,
}

impl Fault {
    /// The kind, for the report.
    fn kind(&self) -> String {
        match self {
            Fault::KillTarget(_) => "KillTarget".into(),
            Fault::Point { point, crash, .. } => format!("{point}={}", if *crash { "crash" } else { "error" }),
            Fault::DiskFull(count) => format!("DiskFull({count})"),
            Fault::FlipByte { crash_on_remove: true } => "FlipByte+target.remove_bad=crash".into(),
            Fault::FlipByte { crash_on_remove: false } => "FlipByte".into(),
            Fault::Gc(Some((_, point))) => format!("Gc+{point}=crash"),
            Fault::Gc(None) => "Gc".into(),
            Fault::LoseDisk { crash_repair: true, .. } => "LoseDisk+control.repair.copy=crash".into(),
            Fault::LoseDisk { crash_repair: false, .. } => "LoseDisk".into(),
            other => format!("{other:?}"),
        }
    }

    /// What the save must end as, when that is determined.
    fn expect(&self) -> Expect {
        match self {
            Fault::KillClient | Fault::KillServer => Expect::Any,
            // A target that dies or fails is replaced by the next candidate.
            Fault::KillTarget(_) => Expect::Succeeds,
            Fault::Point { who: Who::Target(_), .. } => Expect::Succeeds,
            // One failed copy is placed elsewhere.
            Fault::Point { point: "client.put", crash: false, .. } => Expect::Succeeds,
            Fault::Point { point: "client.put" | "client.commit", crash: true, .. } => Expect::NotCommitted,
            Fault::Point { point: "client.commit", crash: false, .. } => Expect::NotCommitted,
            // Committed, whatever the client heard.
            Fault::Point { point: "client.commit.reply" | "control.commit.reply", .. } => Expect::Committed,
            // Before the transaction commits: only a retry the client saw succeed commits it.
            Fault::Point { .. } => Expect::CommittedIffAcknowledged,
            Fault::DiskFull(1) => Expect::Succeeds,
            Fault::DiskFull(_) => Expect::NotCommitted,
            Fault::FlipByte { .. } | Fault::Gc(_) | Fault::LoseDisk { .. } | Fault::Nothing => Expect::Succeeds,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Expect {
    Any,
    /// Acknowledged (and so committed).
    Succeeds,
    Committed,
    NotCommitted,
    CommittedIffAcknowledged,
}

fn choose(rng: &mut StdRng) -> Fault {
    let target = rng.random_range(0..TARGETS);
    match rng.random_range(0..11) {
        0 => Fault::KillClient,
        1 => Fault::KillTarget(target),
        2 => Fault::KillServer,
        3 | 4 => {
            let (point, process) = SAVE_POINTS[rng.random_range(0..SAVE_POINTS.len())];
            let who = [Who::Client, Who::Target(target), Who::Server][process as usize];
            let crash = rng.random_bool(0.5);
            // Per-chunk points strike at a random chunk (each save has at least four new ones).
            let per_chunk = point == "client.put" || point.starts_with("target.");
            Fault::Point { who, point, crash, skip: if per_chunk { rng.random_range(0..3) } else { 0 } }
        }
        5 => Fault::DiskFull(rng.random_range(1..=TARGETS)),
        6 => Fault::FlipByte { crash_on_remove: rng.random_bool(0.5) },
        7 | 8 => Fault::Gc(match rng.random_range(0..4) {
            0 => Some((Who::Server, "control.gc.mark")),
            1 => Some((Who::Server, "control.gc.delete")),
            2 => Some((Who::Target(target), "target.delete.unlink")),
            _ => None,
        }),
        9 => Fault::LoseDisk { target, crash_repair: rng.random_bool(0.5) },
        _ => Fault::Nothing,
    }
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
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    let mut totals = Outcome::default();
    let started = Instant::now();
    for seed in first..first + trials {
        eprintln!("crash-matrix trial seed {seed}");
        let _guard = SeedOnPanic(seed);
        let outcome = Trial::run(seed);
        for fault in &outcome.faults {
            *kinds.entry(fault.kind()).or_default() += 1;
        }
        totals.add(&outcome);
    }
    eprintln!(
        "crash matrix: {trials} trials from seed {first} in {:.0} s; faults: {kinds:?}; {} struck a save mid-way, \
         {} processes died at a fault point; {} saves, {} acknowledged, {} committed (each restored byte-exact, \
         0 lost), {} deleted and collected; {} corruptions (each detected); {} lost disks re-replicated",
        started.elapsed().as_secs_f64(),
        totals.mid_save,
        totals.point_crashes,
        totals.saves,
        totals.acknowledged,
        totals.committed,
        totals.deleted,
        totals.corruptions_detected,
        totals.disks_lost,
    );
}

#[derive(Default)]
struct Outcome {
    faults: Vec<Fault>,
    saves: usize,
    acknowledged: usize,
    committed: usize,
    deleted: usize,
    corruptions_detected: usize,
    disks_lost: usize,
    /// Faults that struck while the save was still running.
    mid_save: usize,
    /// Processes that died at a fault point (a point set to crash that was reached).
    point_crashes: usize,
}

impl Outcome {
    fn add(&mut self, other: &Outcome) {
        self.saves += other.saves;
        self.acknowledged += other.acknowledged;
        self.committed += other.committed;
        self.deleted += other.deleted;
        self.corruptions_detected += other.corruptions_detected;
        self.disks_lost += other.disks_lost;
        self.mid_save += other.mid_save;
        self.point_crashes += other.point_crashes;
    }
}

struct Trial {
    seed: u64,
    rng: StdRng,
    cluster: Cluster,
    /// Bytes every step's file starts with (whole chunks, so steps share them).
    shared: Vec<u8>,
    contents: BTreeMap<u64, Vec<u8>>,
    acknowledged: BTreeSet<u64>,
    deleted: BTreeSet<u64>,
    expected: Vec<(u64, Expect, String)>,
    outcome: Outcome,
}

fn crash_env(point: &str, skip: u32) -> String {
    if skip == 0 { format!("{point}=1*return(crash)") } else { format!("{point}={skip}*off->1*return(crash)") }
}

fn error_env(point: &str, skip: u32) -> String {
    if skip == 0 { format!("{point}=1*return") } else { format!("{point}={skip}*off->1*return") }
}

fn exited(proc: &mut Proc) -> bool {
    proc.child.try_wait().unwrap().is_some()
}

impl Trial {
    fn run(seed: u64) -> Outcome {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut cluster = Cluster::start_with(0, SERVER_FLAGS);
        for index in 0..TARGETS {
            let target = cluster.start_target_with(index, SCRUB);
            cluster.targets.push(target);
        }
        cluster.wait_alive(TARGETS);
        std::fs::create_dir_all(cluster.dir.path().join("data")).unwrap();
        let shared = random_bytes(rng.random_range(1..8) * CHUNK, seed);
        let mut trial = Trial {
            seed,
            rng,
            cluster,
            shared,
            contents: BTreeMap::new(),
            acknowledged: BTreeSet::new(),
            deleted: BTreeSet::new(),
            expected: Vec::new(),
            outcome: Outcome::default(),
        };
        for step in 1..=5u64 {
            let fault = choose(&mut trial.rng);
            let struck = trial.step(step, &fault);
            trial.outcome.faults.push(struck);
        }
        trial.check();
        trial.outcome
    }

    fn start_target(&self, index: usize, env: &[(&str, &str)]) -> Proc {
        self.cluster.start_target_env(index, SCRUB, env)
    }

    /// Restarts what `who` names (a target or the control plane) with `env`.
    fn restart(&mut self, who: Who, env: &[(&str, &str)]) {
        match who {
            Who::Server => self.cluster.restart_server_env(env),
            Who::Target(index) => {
                self.cluster.targets[index].kill();
                self.cluster.targets[index] = self.start_target(index, env);
            }
            Who::Client => unreachable!("clients are not restarted"),
        }
    }

    /// Restarts `who` if it died, as a supervisor would; says whether it had.
    fn revive(&mut self, who: Who) -> bool {
        let died = match who {
            Who::Server => exited(&mut self.cluster.server),
            Who::Target(index) => exited(&mut self.cluster.targets[index]),
            Who::Client => false,
        };
        if died {
            self.restart(who, &[]);
        }
        died
    }

    /// [`Trial::revive`] for a process that should have killed itself by now: its peers see its
    /// sockets close a moment before it can be reaped, so a first look may be too early.
    fn revive_struck(&mut self, who: Who) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if self.revive(who) {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn save(&self, step: u64, file: &Path, env: &[(&str, &str)]) -> Child {
        let step = step.to_string();
        let mut command = Command::new(BIN);
        command
            .args(["save", "--job", "crash", "--step", &step, "--chunk-size", &CHUNK.to_string()])
            .arg(file)
            .env("STARCKPT_SERVER", &self.cluster.server.address)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        for (key, value) in env {
            command.env(key, value);
        }
        command.spawn().unwrap()
    }

    /// One save with `fault` striking it or following it.
    /// Returns the fault as it struck (a GC fault point needs garbage to collect: without any,
    /// the pass runs unstruck).
    fn step(&mut self, step: u64, fault: &Fault) -> Fault {
        let seed = self.seed;
        let mut bytes = self.shared.clone();
        bytes.extend(random_bytes(self.rng.random_range(1 << 20..8 << 20), seed.wrapping_mul(31).wrapping_add(step)));
        let file = self.cluster.dir.path().join("data").join(format!("state-{step}.bin"));
        std::fs::write(&file, &bytes).unwrap();
        self.contents.insert(step, bytes);

        // Arm what must be in place before the save starts.
        let mut client_env = Vec::new();
        let mut watched = None;
        match *fault {
            Fault::Point { who: Who::Client, point, crash, skip } => {
                client_env.push(("FAILPOINTS", if crash { crash_env(point, skip) } else { error_env(point, skip) }));
            }
            Fault::Point { who, point, crash, skip } => {
                let spec = if crash { crash_env(point, skip) } else { error_env(point, skip) };
                self.restart(who, &[("FAILPOINTS", &spec)]);
                self.cluster.wait_alive(TARGETS);
                watched = Some(who);
            }
            Fault::DiskFull(count) => {
                for index in 0..count {
                    self.cluster.targets[index].kill();
                    let full = self
                        .cluster
                        .start_target_with(index, &[SCRUB, &["--reserve-bytes", "1000000000000000"]].concat());
                    self.cluster.targets[index] = full;
                }
                self.cluster.wait_alive(TARGETS);
            }
            _ => {}
        }
        let env: Vec<(&str, &str)> = client_env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let delay = Duration::from_millis(self.rng.random_range(0..150));
        let mut client = self.save(step, &file, &env);
        std::thread::sleep(delay);
        if client.try_wait().unwrap().is_none()
            && matches!(fault, Fault::KillClient | Fault::KillTarget(_) | Fault::KillServer)
        {
            self.outcome.mid_save += 1;
        }
        match *fault {
            Fault::KillClient => {
                let _ = client.kill();
            }
            Fault::KillTarget(index) => self.cluster.targets[index].kill(),
            Fault::KillServer => self.cluster.restart_server(),
            _ => {}
        }
        // Wait for the save, restarting a struck process that died.
        let deadline = Instant::now() + Duration::from_secs(90);
        let succeeded = loop {
            if let Some(status) = client.try_wait().unwrap() {
                break status.success();
            }
            if let Some(who) = watched
                && self.revive(who)
            {
                self.outcome.point_crashes += 1;
                watched = None;
            }
            assert!(Instant::now() < deadline, "seed {seed}: step {step}'s save hangs ({fault:?})");
            std::thread::sleep(Duration::from_millis(10));
        };
        if let Fault::Point { who: Who::Client, crash: true, .. } = fault
            && !succeeded
        {
            self.outcome.point_crashes += 1;
        }
        if succeeded {
            self.acknowledged.insert(step);
        }
        self.expected.push((step, fault.expect(), format!("{fault:?}")));
        // Disarm: restart with a clean environment what was started with a fault armed.
        match *fault {
            Fault::KillTarget(index) => self.restart(Who::Target(index), &[]),
            Fault::Point { who: who @ (Who::Server | Who::Target(_)), .. } => {
                if self.revive(who) {
                    self.outcome.point_crashes += 1;
                } else {
                    self.restart(who, &[]);
                }
            }
            Fault::DiskFull(count) => {
                for index in 0..count {
                    self.restart(Who::Target(index), &[]);
                }
            }
            _ => {}
        }
        self.cluster.wait_alive(TARGETS);
        if fault.expect() == Expect::Succeeds {
            assert!(succeeded, "seed {seed}: step {step}'s save failed ({fault:?})");
        }

        match *fault {
            Fault::FlipByte { crash_on_remove } => self.flip_byte(crash_on_remove),
            Fault::Gc(point) => return Fault::Gc(self.collect_garbage(point)),
            Fault::LoseDisk { target, crash_repair } => self.lose_disk(target, crash_repair),
            _ => {}
        }
        fault.clone()
    }

    /// Flips one bit of a stored copy; the target's scrubber must find it.
    fn flip_byte(&mut self, crash_on_remove: bool) {
        let seed = self.seed;
        let holders: Vec<usize> = (0..TARGETS).filter(|i| !self.cluster.chunk_files(*i).is_empty()).collect();
        let target = holders[self.rng.random_range(0..holders.len())];
        if crash_on_remove {
            self.restart(Who::Target(target), &[("FAILPOINTS", "target.remove_bad=1*return(crash)")]);
            self.cluster.wait_alive(TARGETS);
        }
        let files = self.cluster.chunk_files(target);
        let path = files[self.rng.random_range(0..files.len())].clone();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[4096] ^= 1 << self.rng.random_range(0..8);
        std::fs::write(&path, &bytes).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut died = false;
        while std::fs::read(&path).is_ok_and(|now| now == bytes) {
            assert!(Instant::now() < deadline, "seed {seed}: corruption of {} was never detected", path.display());
            if self.revive(Who::Target(target)) {
                died = true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if crash_on_remove {
            if self.revive_struck(Who::Target(target)) {
                died = true;
            }
            assert!(died, "seed {seed}: the scrubber removed a bad copy without reaching target.remove_bad");
            self.outcome.point_crashes += 1;
            self.cluster.wait_alive(TARGETS);
        }
        self.outcome.corruptions_detected += 1;
        // Its copy comes back by re-replication.
        self.repair_until_clean();
    }

    /// Deletes an older committed checkpoint and collects garbage with every chunk aged past the
    /// grace period, maybe with a crash at a GC fault point first.
    /// Returns the fault point that struck, if any.
    fn collect_garbage(&mut self, point: Option<(Who, &'static str)>) -> Option<(Who, &'static str)> {
        let seed = self.seed;
        let committed = self.committed();
        if committed.len() >= 2 {
            let older = &committed[..committed.len() - 1];
            let step = older[self.rng.random_range(0..older.len())];
            self.cluster.ok(&["rm", "crash", &step.to_string()]);
            self.deleted.insert(step);
            self.outcome.deleted += 1;
        }
        self.cluster.age_all_chunks(LONG_AGO);
        // A GC fault point strikes only where there is garbage: a target that holds some.
        let live = self.live_chunks();
        let holding_garbage: Vec<usize> = (0..TARGETS)
            .filter(|&i| {
                self.cluster.chunk_files(i).iter().any(|p| !live.contains_key(p.file_name().unwrap().to_str().unwrap()))
            })
            .collect();
        let point = match point {
            _ if holding_garbage.is_empty() => None,
            Some((Who::Target(_), point)) => {
                Some((Who::Target(holding_garbage[self.rng.random_range(0..holding_garbage.len())]), point))
            }
            other => other,
        };
        if let Some((who, point)) = point {
            self.restart(who, &[("FAILPOINTS", &crash_env(point, 0))]);
            self.cluster.wait_alive(TARGETS);
            let _ = self.cluster.cli(&["gc"]);
            assert!(
                self.revive_struck(who),
                "seed {seed}: {point} was armed, with garbage to collect, but never struck"
            );
            self.outcome.point_crashes += 1;
            self.cluster.wait_alive(TARGETS);
        }
        let report = self.cluster.json_outcome(&["gc"]).1;
        // Every running target was swept (a lost disk's old target may still count as alive for
        // a while, and fail to answer).
        let running = self.running_target_ids();
        let errors = report["target_errors"].as_array().unwrap();
        assert!(
            errors.iter().all(|e| !running.iter().any(|id| e.as_str().unwrap().starts_with(id.as_str()))),
            "seed {seed}: gc: {report}"
        );
        // Nothing is left that no committed checkpoint needs.
        let live = self.live_chunks();
        for index in 0..TARGETS {
            for path in self.cluster.chunk_files(index) {
                let name = path.file_name().unwrap().to_str().unwrap().to_owned();
                assert!(live.contains_key(&name), "seed {seed}: GC left garbage {}: {report}", path.display());
            }
        }
        point
    }

    /// Loses target `index`'s disk: SIGKILLed, its directory wiped, started empty (a new target
    /// to the control plane). Re-replication must restore every chunk's copies.
    fn lose_disk(&mut self, index: usize, crash_repair: bool) {
        let seed = self.seed;
        // Copies of committed chunks the disk held: what re-replication must make again.
        let live = self.live_chunks();
        let held = self
            .cluster
            .chunk_files(index)
            .iter()
            .filter(|p| live.contains_key(p.file_name().unwrap().to_str().unwrap()))
            .count();
        self.cluster.targets[index].kill();
        std::fs::remove_dir_all(self.cluster.target_dir(index)).unwrap();
        self.cluster.targets[index] = self.start_target(index, &[]);
        self.cluster.wait_alive(TARGETS);
        // Until the old target counts as lost.
        std::thread::sleep(Duration::from_millis(2500));
        if crash_repair {
            self.restart(Who::Server, &[("FAILPOINTS", &crash_env("control.repair.copy", 0))]);
            let _ = self.cluster.cli(&["repair"]);
            if self.revive_struck(Who::Server) {
                self.outcome.point_crashes += 1;
            } else {
                // Only a disk that held no copies leaves nothing to copy.
                assert_eq!(
                    held, 0,
                    "seed {seed}: control.repair.copy was armed, with copies to make, but never struck"
                );
                self.restart(Who::Server, &[]);
            }
            self.cluster.wait_alive(TARGETS);
        }
        self.repair_until_clean();
        self.outcome.disks_lost += 1;
    }

    /// The ids of the target processes now running.
    fn running_target_ids(&self) -> Vec<String> {
        let status = self.cluster.json(&["status"]);
        let listed = status["targets"].as_array().unwrap();
        self.cluster
            .targets
            .iter()
            .map(|proc| {
                let target = listed.iter().find(|t| t["data_address"] == proc.address.as_str()).unwrap();
                target["target_id"].as_str().unwrap().to_owned()
            })
            .collect()
    }

    /// Runs re-replication passes until one finds nothing short of copies (within 30 s: a pass
    /// skips a target whose heartbeat is late, as one may be on a busy machine).
    fn repair_until_clean(&self) {
        let seed = self.seed;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let last = self.cluster.json_outcome(&["repair"]).1;
            if last["still_under_replicated"] == 0 && last["unreadable"] == 0 {
                return;
            }
            assert!(Instant::now() < deadline, "seed {seed}: re-replication did not complete: {last}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn committed(&self) -> Vec<u64> {
        let output = self.cluster.cli(&["ls", "crash", "--all", "--json"]);
        // (Only a job whose every save died before reaching the control plane may not exist.)
        if !output.status.success() {
            return Vec::new();
        }
        let listing: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        let mut steps: Vec<u64> = listing
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["state"] == "committed")
            .map(|c| c["step"].as_u64().unwrap())
            .collect();
        steps.sort_unstable();
        steps
    }

    /// Every chunk of every committed checkpoint (hex hash → replicas wanted).
    fn live_chunks(&self) -> BTreeMap<String, usize> {
        let mut live = BTreeMap::new();
        for step in self.committed() {
            let manifest = self.cluster.json(&["show", "crash", &step.to_string()]);
            for file in manifest["files"].as_array().unwrap() {
                for chunk in file["chunk_refs"].as_array().unwrap() {
                    let replicas = chunk["replicas"].as_array().unwrap().len();
                    let wanted = live.entry(chunk["hash"].as_str().unwrap().to_owned()).or_insert(0);
                    *wanted = (*wanted).max(replicas);
                }
            }
        }
        live
    }

    fn check(&mut self) {
        let seed = self.seed;
        let committed = self.committed();
        for step in &self.acknowledged {
            assert!(
                committed.contains(step) || self.deleted.contains(step),
                "seed {seed}: step {step} was acknowledged but is not committed: {committed:?}"
            );
        }
        for step in &self.deleted {
            assert!(!committed.contains(step), "seed {seed}: deleted step {step} is still committed");
        }
        for (step, expect, fault) in &self.expected {
            let is_committed = committed.contains(step) || self.deleted.contains(step);
            let acknowledged = self.acknowledged.contains(step);
            let holds = match expect {
                Expect::Any => true,
                Expect::Succeeds => acknowledged && is_committed,
                Expect::Committed => is_committed,
                Expect::NotCommitted => !is_committed,
                Expect::CommittedIffAcknowledged => is_committed == acknowledged,
            };
            assert!(
                holds,
                "seed {seed}: step {step} ({fault}) should be {expect:?}: committed {is_committed}, acknowledged {acknowledged}"
            );
        }
        let latest = self.cluster.json(&["ls"]).as_array().unwrap().first().and_then(|j| j["latest_step"].as_u64());
        assert_eq!(latest, committed.last().copied(), "seed {seed}: latest is not the newest committed");
        // Every chunk of every committed checkpoint has its copies on live targets.
        self.repair_until_clean();
        let held: Vec<BTreeSet<String>> = (0..TARGETS)
            .map(|i| {
                self.cluster
                    .chunk_files(i)
                    .iter()
                    .map(|p| p.file_name().unwrap().to_str().unwrap().to_owned())
                    .collect()
            })
            .collect();
        for (hash, wanted) in self.live_chunks() {
            let copies = held.iter().filter(|h| h.contains(&hash)).count();
            assert!(copies >= wanted.min(2), "seed {seed}: chunk {hash} has {copies} copies on live targets");
        }
        for step in &committed {
            let to = self.cluster.dir.path().join(format!("restored-{step}"));
            self.cluster.ok(&["restore", "--job", "crash", "--step", &step.to_string(), "--to", to.to_str().unwrap()]);
            let restored = std::fs::read(to.join(format!("state-{step}.bin"))).unwrap();
            assert!(restored == self.contents[step], "seed {seed}: step {step} restored different bytes");
        }
        self.outcome.saves = self.expected.len();
        self.outcome.acknowledged = self.acknowledged.len();
        self.outcome.committed = committed.len() + self.deleted.len();
    }
}

#[test]
fn a_malformed_or_unknown_fault_point_is_refused() {
    for spec in ["no.such.point=return", "client.put", "client.put=explode"] {
        let output =
            Command::new(BIN).arg("ls").env("FAILPOINTS", spec).env("STARCKPT_SERVER", "127.0.0.1:1").output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success() && stderr.contains("FAILPOINTS"), "{spec}: {stderr}");
    }
}
