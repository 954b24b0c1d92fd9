//! A synthetic trainer that checkpoints through starckpt the way a large training job does.
//!
//! Its state is laid out like mixed-precision Adam training: per tensor, bf16 weights, fp32
//! master weights and two fp32 Adam moments (14 bytes per parameter), in tensors of up to 16 M
//! parameters (a 4096 x 4096 projection). Each step "trains" by rewriting a deterministic subset of
//! the tensors (`--update-fraction`); every `--save-every` steps it saves asynchronously with
//! [`Client::save_borrowed`]: the call returns once the state is copied into the SDK's staging
//! buffers, and training goes on while the upload runs.
//!
//! It prints one JSON line per event: `staged` when a save returns (the trainer may go on),
//! `saved` when it commits, with the bytes, the blocking time, the time of a plain memcpy of the
//! same bytes into touched memory measured just before it, the time to commit and the bytes
//! actually written after dedup, and the resident memory; `resumed` after a restart; `summary`
//! at the end.
//!
//! Kill it (SIGKILL, at any moment) and start it again with the same flags: it resumes from the
//! latest committed checkpoint, checks that the restored state is bit for bit the state that
//! step had, and goes on. The state of tensor `t` after step `s` is a pure function of
//! (`--seed`, `t`, the last step <= `s` that updated `t`), which is what makes that check exact.
//!
//! ```text
//! cargo run --release --example trainer -- --state-mib 2048 --steps 20 --save-every 2
//! cargo run --release --example trainer -- --server 127.0.0.1:7070 --job run1   # against `starckpt dev`
//! ```
//! Without `--server` it starts an in-process cluster of three targets in a temporary directory.

use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use serde_json::json;
use starckpt_client::{Client, ClientConfig, RetentionPolicy, SaveHandle, SaveOutcome, SavePart};

#[derive(Parser)]
#[command(about = "Synthetic mixed-precision Adam trainer checkpointing through starckpt")]
struct Args {
    /// Control-plane address; without it an in-process dev cluster is started.
    #[arg(long, env = "STARCKPT_SERVER")]
    server: Option<String>,
    #[arg(long, default_value = "synthetic-trainer")]
    job: String,
    /// Size of the training state in MiB (14 bytes per parameter).
    #[arg(long, default_value_t = 2048)]
    state_mib: usize,
    /// Train until this step.
    #[arg(long, default_value_t = 20)]
    steps: u64,
    #[arg(long, default_value_t = 2)]
    save_every: u64,
    /// Fraction of the tensors each step rewrites (the rest is unchanged and deduplicates).
    #[arg(long, default_value_t = 0.25)]
    update_fraction: f64,
    /// Simulated compute per step in milliseconds, on top of rewriting the tensors.
    #[arg(long, default_value_t = 0)]
    step_ms: u64,
    /// Skip a save that comes due while the previous one still uploads (default: wait for it).
    #[arg(long)]
    skip_if_busy: bool,
    /// Staging memory in MiB (default: the state size and a chunk per file, so a save never
    /// waits for uploads).
    #[arg(long)]
    staging_mib: Option<usize>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Retention: keep the last N checkpoints of the job (0: keep all). Older ones are deleted at
    /// each commit and their chunks freed by garbage collection after its grace period.
    #[arg(long, default_value_t = 3)]
    keep_last: u32,
}

/// Parameters per tensor at most: a 4096 x 4096 projection.
const MAX_TENSOR_PARAMS: usize = 4096 * 4096;

/// One tensor's training state.
struct Tensor {
    weight_bf16: Vec<u8>,
    master_fp32: Vec<u8>,
    exp_avg_fp32: Vec<u8>,
    exp_avg_sq_fp32: Vec<u8>,
}

impl Tensor {
    fn new(params: usize) -> Tensor {
        Tensor {
            weight_bf16: vec![0; params * 2],
            master_fp32: vec![0; params * 4],
            exp_avg_fp32: vec![0; params * 4],
            exp_avg_sq_fp32: vec![0; params * 4],
        }
    }

    fn bytes(&self) -> usize {
        self.weight_bf16.len() + self.master_fp32.len() + self.exp_avg_fp32.len() + self.exp_avg_sq_fp32.len()
    }

    /// The tensor's state at `version` (the last step that updated it; 0 = initialisation).
    /// Values look like training state: fp32 weights of magnitude 2^-4..1, small moments, the
    /// bf16 weights the top half of the fp32 master weights.
    fn fill(&mut self, seed: u64, index: usize, version: u64) {
        let mut rng = splitmix(seed ^ splitmix(index as u64 ^ splitmix(version)));
        let mut next = move || {
            rng = splitmix(rng);
            rng
        };
        let float = |bits: u64, exponent_base: u64, signed: bool| -> u32 {
            let sign = if signed { ((bits >> 25) & 1) as u32 } else { 0 };
            (sign << 31) | (((exponent_base + ((bits >> 23) & 3)) as u32) << 23) | (bits & 0x7f_ffff) as u32
        };
        for (master, weight) in self.master_fp32.chunks_exact_mut(4).zip(self.weight_bf16.chunks_exact_mut(2)) {
            let value = float(next(), 123, true);
            master.copy_from_slice(&value.to_le_bytes());
            weight.copy_from_slice(&((value >> 16) as u16).to_le_bytes());
        }
        for moment in self.exp_avg_fp32.chunks_exact_mut(4) {
            moment.copy_from_slice(&float(next(), 110, true).to_le_bytes());
        }
        for moment in self.exp_avg_sq_fp32.chunks_exact_mut(4) {
            moment.copy_from_slice(&float(next(), 100, false).to_le_bytes());
        }
    }

    fn files(&self, index: usize) -> [(String, &[u8]); 4] {
        [
            (format!("model/layers.{index:03}.weight.bf16"), &self.weight_bf16),
            (format!("optim/layers.{index:03}.master.fp32"), &self.master_fp32),
            (format!("optim/layers.{index:03}.exp_avg.fp32"), &self.exp_avg_fp32),
            (format!("optim/layers.{index:03}.exp_avg_sq.fp32"), &self.exp_avg_sq_fp32),
        ]
    }

    fn files_mut(&mut self, index: usize) -> [(String, &mut Vec<u8>); 4] {
        [
            (format!("model/layers.{index:03}.weight.bf16"), &mut self.weight_bf16),
            (format!("optim/layers.{index:03}.master.fp32"), &mut self.master_fp32),
            (format!("optim/layers.{index:03}.exp_avg.fp32"), &mut self.exp_avg_fp32),
            (format!("optim/layers.{index:03}.exp_avg_sq.fp32"), &mut self.exp_avg_sq_fp32),
        ]
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The training schedule: which tensors each step rewrites.
struct Schedule {
    seed: u64,
    update_fraction: f64,
}

impl Schedule {
    fn updates(&self, tensor: usize, step: u64) -> bool {
        let draw = splitmix(self.seed.rotate_left(17) ^ splitmix((tensor as u64) << 32 ^ step));
        ((draw >> 11) as f64 / (1u64 << 53) as f64) < self.update_fraction
    }

    /// The last step <= `step` that rewrote `tensor` (0: never, the initial state).
    fn version(&self, tensor: usize, step: u64) -> u64 {
        (1..=step).rev().find(|s| self.updates(tensor, *s)).unwrap_or(0)
    }
}

fn rss_mib() -> f64 {
    let pages = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()))
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;
    (pages * page) as f64 / (1 << 20) as f64
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

fn emit(value: serde_json::Value) {
    println!("{value}");
}

/// A save whose upload is under way.
struct InFlight {
    step: u64,
    bytes: u64,
    started: Instant,
    blocking: Duration,
    memcpy: Duration,
    waited: Duration,
    done: tokio::task::JoinHandle<(starckpt_client::Result<SaveOutcome>, Instant)>,
}

impl InFlight {
    fn new(step: u64, handle: SaveHandle, started: Instant, blocking: Duration, memcpy: Duration) -> InFlight {
        let bytes = handle.total_bytes;
        let done = tokio::spawn(async move {
            let outcome = handle.wait().await;
            (outcome, Instant::now())
        });
        InFlight { step, bytes, started, blocking, memcpy, waited: Duration::ZERO, done }
    }

    /// Waits for the commit and prints the save's line.
    async fn report(self, stats: &mut Stats) -> anyhow::Result<()> {
        let (outcome, committed_at) = self.done.await?;
        let outcome = outcome?;
        anyhow::ensure!(outcome.committed(), "step {} did not commit: {:?}", self.step, outcome.state);
        let ratio = self.blocking.as_secs_f64() / self.memcpy.as_secs_f64().max(1e-9);
        let rss = rss_mib();
        stats.ratios.push(ratio);
        stats.rss.push(rss);
        emit(json!({
            "event": "saved", "step": self.step, "bytes": self.bytes,
            "blocking_ms": ms(self.blocking), "memcpy_ms": ms(self.memcpy), "blocking_over_memcpy": ratio,
            "waited_for_previous_ms": ms(self.waited),
            "commit_ms": ms(committed_at - self.started), "written_bytes": outcome.uploaded_bytes,
            "chunks": outcome.chunks, "deduplicated_chunks": outcome.deduplicated_chunks, "rss_mib": rss,
        }));
        Ok(())
    }
}

#[derive(Default)]
struct Stats {
    ratios: Vec<f64>,
    rss: Vec<f64>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.save_every > 0, "--save-every must be at least 1");
    anyhow::ensure!((0.0..=1.0).contains(&args.update_fraction), "--update-fraction must be within 0..=1");
    let params = (args.state_mib << 20) / 14;
    anyhow::ensure!(params >= 8 * 1024, "--state-mib is too small for a model");
    let count = params.div_ceil(MAX_TENSOR_PARAMS).max(8);
    let tensor_params = params / count;
    let schedule = Schedule { seed: args.seed, update_fraction: args.update_fraction };

    // The cluster: the given one, or an in-process one that lives as long as this process.
    let scratch_dir = tempfile::tempdir()?;
    let (server, _cluster) = match &args.server {
        Some(server) => (server.clone(), None),
        None => {
            let engine = starckpt_server::chunkserver::EngineKind::Uring;
            let cluster = starckpt_server::dev::DevCluster::start(scratch_dir.path(), "127.0.0.1:0", 3, engine).await?;
            wait_for_targets(&cluster.control_address.to_string(), 3).await?;
            (cluster.control_address.to_string(), Some(cluster))
        }
    };

    let mut tensors: Vec<Tensor> = (0..count).map(|_| Tensor::new(tensor_params)).collect();
    let state_bytes: usize = tensors.iter().map(Tensor::bytes).sum();
    let mut config = ClientConfig::new(server);
    // Each file's last chunk may fill only part of a staging buffer: one spare buffer per file.
    let files = count * 4 + 1;
    config.staging_bytes = args.staging_mib.map_or(state_bytes + files * config.chunk_size_bytes, |m| m << 20);
    let client = Client::connect(config).await?;
    // Touch the staging pool and the memcpy baseline's destination now, not during the first save.
    client.warm_staging(client.config().staging_bytes);
    let mut scratch = vec![1u8; state_bytes];

    if args.keep_last > 0 {
        client.set_retention(&args.job, RetentionPolicy { keep_last: args.keep_last, keep_every: 0 }).await?;
    }
    let resumed = match client.latest(&args.job).await? {
        Some(latest) => {
            let started = Instant::now();
            restore(&client, &args, &schedule, &mut tensors, latest.step).await?;
            emit(json!({
                "event": "resumed", "step": latest.step, "bytes": state_bytes, "verified": true,
                "restore_ms": ms(started.elapsed()),
            }));
            latest.step
        }
        None => {
            for (index, tensor) in tensors.iter_mut().enumerate() {
                tensor.fill(args.seed, index, 0);
            }
            0
        }
    };

    let mut stats = Stats::default();
    let mut in_flight: Option<InFlight> = None;
    for step in resumed + 1..=args.steps {
        for (index, tensor) in tensors.iter_mut().enumerate() {
            if schedule.updates(index, step) {
                tensor.fill(args.seed, index, step);
            }
        }
        if args.step_ms > 0 {
            tokio::time::sleep(Duration::from_millis(args.step_ms)).await;
        }
        if step % args.save_every != 0 {
            continue;
        }
        let mut waited = Duration::ZERO;
        if let Some(previous) = in_flight.take() {
            if previous.done.is_finished() || !args.skip_if_busy {
                let started = Instant::now();
                previous.report(&mut stats).await?;
                waited = started.elapsed();
            } else {
                emit(json!({"event": "skipped", "step": step, "reason": "previous save still uploading"}));
                in_flight = Some(previous);
                continue;
            }
        }
        // Baseline: a memcpy of the same bytes into touched memory, just before the save.
        let memcpy_started = Instant::now();
        let mut offset = 0;
        for (index, tensor) in tensors.iter().enumerate() {
            for (_, data) in tensor.files(index) {
                scratch[offset..offset + data.len()].copy_from_slice(data);
                offset += data.len();
            }
        }
        let memcpy = memcpy_started.elapsed();
        std::hint::black_box(&scratch);

        let files: Vec<(String, &[u8])> =
            tensors.iter().enumerate().flat_map(|(index, tensor)| tensor.files(index)).collect();
        let lent: Vec<(&str, &[u8])> = files.iter().map(|(path, data)| (path.as_str(), *data)).collect();
        let part = SavePart::new(&args.job, step).buffer("trainer.json", trainer_json(&args, count, tensor_params))?;
        let started = Instant::now();
        let handle = client.save_borrowed(part, &lent).await?;
        let blocking = started.elapsed();
        emit(json!({"event": "staged", "step": step, "blocking_ms": ms(blocking)}));
        let mut save = InFlight::new(step, handle, started, blocking, memcpy);
        save.waited = waited;
        in_flight = Some(save);
    }
    if let Some(last) = in_flight.take() {
        last.report(&mut stats).await?;
    }
    summary(&stats);
    Ok(())
}

fn trainer_json(args: &Args, tensors: usize, tensor_params: usize) -> Bytes {
    Bytes::from(
        json!({"seed": args.seed, "tensors": tensors, "tensor_params": tensor_params, "update_fraction": args.update_fraction})
            .to_string(),
    )
}

/// Reads checkpoint `step` into the tensors and checks every byte against the state that step
/// had.
async fn restore(
    client: &Client,
    args: &Args,
    schedule: &Schedule,
    tensors: &mut [Tensor],
    step: u64,
) -> anyhow::Result<()> {
    let manifest = client.manifest(&args.job, Some(step)).await?;
    let saved: serde_json::Value = serde_json::from_slice(&client.read_file(&manifest, "trainer.json").await?)?;
    let expected = serde_json::from_slice::<serde_json::Value>(&trainer_json(
        args,
        tensors.len(),
        tensors[0].weight_bf16.len() / 2,
    ))?;
    anyhow::ensure!(
        saved == expected,
        "checkpoint {step} was written by a trainer with other flags: {saved} (this one: {expected})"
    );
    let mut reference = Tensor::new(tensors[0].weight_bf16.len() / 2);
    for (index, tensor) in tensors.iter_mut().enumerate() {
        for (path, buffer) in tensor.files_mut(index) {
            client.read_into(&manifest, &path, buffer).await?;
        }
        reference.fill(args.seed, index, schedule.version(index, step));
        for ((path, restored), (_, wanted)) in tensor.files(index).iter().zip(reference.files(index)) {
            anyhow::ensure!(*restored == wanted, "{path} of step {step} differs from the state it was saved with");
        }
    }
    Ok(())
}

fn summary(stats: &Stats) {
    let mut ratios = stats.ratios.clone();
    ratios.sort_by(f64::total_cmp);
    let median = ratios.get(ratios.len() / 2).copied();
    let (first, last) = (stats.rss.first().copied(), stats.rss.last().copied());
    let growth = first.zip(last).map(|(first, last)| (last - first) / first * 100.0);
    emit(json!({
        "event": "summary", "saves": stats.ratios.len(), "median_blocking_over_memcpy": median,
        "rss_mib_first_save": first, "rss_mib_last_save": last, "rss_growth_pct": growth,
    }));
}

async fn wait_for_targets(server: &str, count: usize) -> anyhow::Result<()> {
    let client = Client::connect(ClientConfig::new(server)).await?;
    for _ in 0..200 {
        let alive =
            client.targets().await?.iter().filter(|t| t.state == starckpt_client::TargetState::Alive as i32).count();
        if alive >= count {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("the in-process cluster's targets did not come up")
}
