//! `starckpt bench`: starckpt against the hardware and against `torch.save`, side by side, in one
//! run on the same bytes and the same disk.
//!
//! The state is synthetic but laid out like mixed-precision Adam training of a transformer: for
//! every parameter tensor (embedding, per-layer QKV/output/MLP matrices, norms) a bf16 weight, an
//! fp32 master copy and two fp32 Adam moments (14 bytes per parameter), with values drawn like
//! real ones (small weights, smaller first moments, tiny positive second moments), sharded across
//! `--ranks` ranks by size. Each rank is its own client with its own staging memory; the ranks
//! save one checkpoint together.
//!
//! Phases, each timed, charged the process's CPU time (client, and with the built-in dev cluster
//! the targets and control plane too) and the data disk's busy time (what bounds it:
//! `baseline::Meter`), each beside its baseline:
//! - blocking: until every rank's `save` returned (the trainer's stall) ÷ a memcpy into touched
//!   memory;
//! - committed: until the checkpoint is committed (every chunk durable on its targets) ÷ an
//!   O_DIRECT sequential write+fsync from one buffer written again and again, and from touched
//!   memory that holds all the bytes (`baseline::direct_all`), as staging does; and
//!   ÷ a buffered write+fsync (what `torch.save` does);
//! - persist: the part of committed after the stall (from the last rank's `save` returning until
//!   committed: the uploads, which wait for staging, and the commit) ÷ the same O_DIRECT write,
//!   so the data path's own pace shows apart from the staging copy the trainer waits for (÷ both
//!   O_DIRECT writes);
//! - restore: every rank reading its tensors into touched buffers, every chunk verified ÷ an
//!   O_DIRECT sequential read into one buffer filled again and again, and ÷ one into touched
//!   memory that holds all the bytes (`baseline::direct_all`), as the restore's do.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Args;
use futures::StreamExt;
use rand::{RngCore, SeedableRng};
use serde_json::json;
use starckpt_client::{Client, ClientConfig, SavePart, SaveProgress};
use starckpt_server::chunkserver::EngineKind;
use starckpt_server::dev::DevCluster;

use crate::baseline::{self, Meter, Timed, ratio};
use crate::demo::parse_size;
use crate::output;

#[derive(Args)]
pub struct BenchArgs {
    /// Bytes of model state across all ranks (e.g. 2GiB): 14 bytes per parameter.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    size: u64,
    /// Ranks saving the checkpoint together, each with its own client and staging memory.
    #[arg(long, default_value_t = 1)]
    ranks: u32,
    /// Checkpoints saved (each with new values); each figure is the median.
    #[arg(long, default_value_t = 3)]
    runs: u32,
    /// Copies of each chunk. 1 compares the data path with the disk; more multiplies the bytes
    /// written.
    #[arg(long, default_value_t = 1)]
    replicas: u32,
    /// Chunk size in bytes.
    #[arg(long, default_value = "4MiB", value_parser = parse_size)]
    chunk_size: u64,
    /// Benchmark a running cluster at this control-plane address instead of starting one.
    #[arg(long)]
    cluster: Option<String>,
    /// Targets of the built-in cluster.
    #[arg(long, default_value_t = 3)]
    targets: usize,
    #[arg(long, default_value = "uring")]
    io_engine: EngineKind,
    /// Directory of the built-in cluster's data and of the baselines' files (default: a temporary
    /// directory). With --cluster, put it on the targets' disk so the baselines measure that disk.
    /// The built-in cluster's data stays in `DIR/cluster` after the run, until the next run there
    /// removes it (its chunks would deduplicate the next run's same bytes).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Also draw throughput per phase, starckpt beside its baselines, as a PNG chart here.
    #[arg(long)]
    chart: Option<PathBuf>,
    #[command(flatten)]
    compression: crate::CompressArg,
    /// Reach the targets over TCP even where they share this host (default: shared memory there),
    /// and measure the same bytes over a loopback TCP connection into and out of an O_DIRECT file
    /// beside them (the transport's limit).
    #[arg(long)]
    no_shm: bool,
    /// The built-in cluster's targets copy each staged chunk out of this process's staging memory
    /// before writing it (`starckpt target --shm-copy-writes`), instead of writing it from there.
    #[arg(long, conflicts_with = "no_shm")]
    shm_copy_writes: bool,
    /// Shared-memory slots each rank's client keeps per target (`ShmConfig::slots`): GETs in
    /// flight to one target at once. Default: the client's.
    #[arg(long, conflicts_with = "no_shm",
          value_parser = clap::value_parser!(u32).range(1..=starckpt_dataplane::shm::MAX_SLOTS as i64))]
    shm_slots: Option<u32>,
    /// Hash and upload chunks while the rest is still being copied into staging (true), or once
    /// the copy is done (false): a shorter time to commit against a longer stall where cores are
    /// few. Default: the client's (`ClientConfig::upload_during_staging`: on from 8 cores).
    #[arg(long)]
    upload_during_staging: Option<bool>,
    /// TCP payloads (PUTs, and the built-in cluster's GET results) sent zero-copy: auto, always
    /// or off (`starckpt target --zero-copy-send`). Over loopback the kernel copies them anyway.
    #[arg(long, default_value = "auto")]
    zero_copy_send: starckpt_dataplane::zerocopy::ZeroCopySend,
    /// Write every chunk into a new file, as on a target's first checkpoints. Default: the
    /// built-in cluster's targets first fill their free pools (untimed), so chunks overwrite
    /// allocated files as a job's checkpoints do in steady state, once retention deletes old ones
    /// and GC hands their files back (`server/src/chunkserver/freepool.rs`).
    #[arg(long)]
    fresh_files: bool,
    /// Device operations in flight per target of the built-in cluster (1 to 256, or `auto`:
    /// measured per target, `starckpt target --queue-depth`).
    #[arg(long, default_value = "8")]
    queue_depth: starckpt_server::chunkserver::QueueDepth,
    /// Profile one phase only: perf's control FIFO (`perf record --control fifo:FIFO -D -1 --
    /// starckpt bench --perf-control FIFO`, likewise `perf stat`), told `enable` when each run's
    /// `--perf-phase` starts and `disable` when it ends, so baselines and data generation stay out
    /// of the profile.
    #[arg(long)]
    perf_control: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "committed", requires = "perf_control")]
    perf_phase: PerfPhase,
}

/// The phase a [`BenchArgs::perf_control`] profile covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum PerfPhase {
    /// From the first rank's save call until every rank's call returned (the trainers' stall).
    Blocking,
    /// From the first rank's save call until every rank's part is committed.
    Committed,
    /// From the first read until every rank's tensors are restored and verified.
    Restore,
}

/// Tells perf (through its control FIFO) when the profiled phase starts and ends.
struct PerfControl {
    fifo: Option<std::fs::File>,
    phase: PerfPhase,
}

impl PerfControl {
    fn open(args: &BenchArgs) -> anyhow::Result<PerfControl> {
        let fifo = match &args.perf_control {
            Some(path) => Some(
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .with_context(|| format!("opening perf's control FIFO {}", path.display()))?,
            ),
            None => None,
        };
        Ok(PerfControl { fifo, phase: args.perf_phase })
    }

    fn tell(&self, phase: PerfPhase, command: &str) {
        if let Some(mut fifo) = self.fifo.as_ref().filter(|_| phase == self.phase) {
            use std::io::Write;
            if let Err(e) = fifo.write_all(command.as_bytes()) {
                tracing::warn!("perf control FIFO: {e}");
            }
        }
    }

    fn start(&self, phase: PerfPhase) {
        self.tell(phase, "enable\n");
    }

    fn end(&self, phase: PerfPhase) {
        self.tell(phase, "disable\n");
    }
}

/// Waits until every target's free pool holds `bytes`, or stops growing for 10 s (a target's
/// space reserve); returns the bytes in all pools.
async fn wait_for_free_pools(client: &Client, bytes: u64, file: u64) -> anyhow::Result<u64> {
    let targets = client.targets().await?;
    let (mut last, mut since) = (0u64, Instant::now());
    loop {
        let mut pools = Vec::new();
        for target in &targets {
            pools.push(client.target_stat(target).await?.free_pool_bytes);
        }
        let total: u64 = pools.iter().sum();
        // Each target stops within one file (a chunk and its header) of the goal.
        if pools.iter().all(|&pool| pool + file >= bytes) {
            return Ok(total);
        }
        if total > last {
            (last, since) = (total, Instant::now());
        } else if since.elapsed() > Duration::from_secs(10) {
            tracing::warn!(bytes = total, "free pools stopped growing short of the goal");
            return Ok(total);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A parameter tensor of the synthetic model.
struct Param {
    name: String,
    elements: usize,
}

/// Transformer parameter tensors totalling `params` elements: an embedding, then layers of QKV,
/// output, MLP up and down projections and two norms (the last tensor cut to fit).
fn transformer(params: usize) -> (usize, Vec<Param>) {
    // The widest hidden size that still gives four layers.
    let hidden = [8192, 5120, 4096, 2048, 1024, 512, 256].into_iter().find(|h| 4 * 12 * h * h <= params).unwrap_or(64);
    let vocab = 32_000.min((params / 4 / hidden).max(1));
    let mut out = vec![Param { name: "embed.weight".into(), elements: vocab * hidden }];
    let mut remaining = params.saturating_sub(vocab * hidden);
    let shapes = [("attn.qkv", 3 * hidden * hidden), ("attn.out", hidden * hidden), ("mlp.up", 4 * hidden * hidden)];
    let shapes = shapes.into_iter().chain([("mlp.down", 4 * hidden * hidden), ("norm1", hidden), ("norm2", hidden)]);
    let shapes: Vec<(&str, usize)> = shapes.collect();
    let mut layer = 0;
    while remaining > 0 {
        for (name, elements) in &shapes {
            let elements = (*elements).min(remaining);
            if elements == 0 {
                break;
            }
            out.push(Param { name: format!("layers.{layer}.{name}.weight"), elements });
            remaining -= elements;
        }
        layer += 1;
    }
    (hidden, out)
}

/// One rank's tensors: (path, bytes).
type Shard = Vec<(String, Bytes)>;

/// Values like training's: weights ~ ±scale around 0 (the sum of two uniforms), moments smaller,
/// second moments positive. `seed` differs per run, so no chunk repeats between checkpoints.
fn fill_f32(out: &mut [u8], seed: u64, scale: f32, positive: bool) {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    for value in out.chunks_exact_mut(4) {
        let bits = rng.next_u64();
        let (a, b) = ((bits >> 40) as f32, ((bits >> 16) & 0xFF_FFFF) as f32);
        let unit = (a + b) / (1u32 << 24) as f32 - 1.0;
        let x = if positive { unit * unit * scale } else { unit * scale };
        value.copy_from_slice(&x.to_le_bytes());
    }
}

/// The model's state split into `ranks` shards of about equal bytes: per parameter a bf16 weight
/// (the master copy's high half), the fp32 master copy and the two fp32 Adam moments.
fn model_state(params: &[Param], ranks: u32, seed: u64) -> Vec<Shard> {
    let mut shards: Vec<(u64, Shard)> = (0..ranks).map(|_| (0, Vec::new())).collect();
    for (index, param) in params.iter().enumerate() {
        let seed = seed.wrapping_mul(1_000_003).wrapping_add(index as u64 * 4);
        let mut master = vec![0u8; param.elements * 4];
        fill_f32(&mut master, seed, 0.02, false);
        let weight: Vec<u8> = master.chunks_exact(4).flat_map(|v| [v[2], v[3]]).collect();
        let mut exp_avg = vec![0u8; param.elements * 4];
        fill_f32(&mut exp_avg, seed + 1, 1e-3, false);
        let mut exp_avg_sq = vec![0u8; param.elements * 4];
        fill_f32(&mut exp_avg_sq, seed + 2, 1e-6, true);
        let (bytes, shard) = shards.iter_mut().min_by_key(|(bytes, _)| *bytes).expect("at least one rank");
        *bytes += param.elements as u64 * 14;
        shard.push((format!("model/{}", param.name), Bytes::from(weight)));
        shard.push((format!("optim/master/{}", param.name), Bytes::from(master)));
        shard.push((format!("optim/exp_avg/{}", param.name), Bytes::from(exp_avg)));
        shard.push((format!("optim/exp_avg_sq/{}", param.name), Bytes::from(exp_avg_sq)));
    }
    shards.into_iter().map(|(_, shard)| shard).collect()
}

async fn timed<T>(
    meter: &Meter,
    work: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<(T, Timed)> {
    let start = meter.read();
    let value = work.await?;
    Ok((value, meter.since(&start)))
}

/// Reads a rank's tensors into `buffers`, 4 tensors at a time.
async fn restore_rank(
    client: &Client,
    manifest: &starckpt_client::CheckpointManifest,
    paths: &[String],
    buffers: &mut [Vec<u8>],
) -> starckpt_client::Result<()> {
    let mut pending = futures::stream::FuturesUnordered::new();
    let mut tensors = paths.iter().zip(buffers.iter_mut());
    loop {
        while pending.len() < 4 {
            let Some((path, buffer)) = tensors.next() else { break };
            pending.push(client.read_into(manifest, path, buffer));
        }
        match pending.next().await {
            Some(read) => read?,
            None => return Ok(()),
        }
    }
}

/// The median run (the mean of the middle two for an even count).
fn median(mut values: Vec<Timed>) -> Timed {
    values.sort_by_key(|t| t.wall);
    let (low, high) = (values[(values.len() - 1) / 2], values[values.len() / 2]);
    let disk_busy = low.disk_busy.zip(high.disk_busy).map(|(a, b)| (a + b) / 2);
    Timed { wall: (low.wall + high.wall) / 2, cpu: (low.cpu + high.cpu) / 2.0, disk_busy }
}

struct Run {
    blocking: Timed,
    committed: Timed,
    /// From the stall's end until committed.
    persist: Timed,
    restore: Timed,
    /// Times a rank's staging waited for uploads (staging memory or queue slots ran out).
    staging_waits: u64,
    /// Bytes uploaded, and what they came to as sent (after compression).
    uploaded_bytes: u64,
    stored_bytes: u64,
    /// The checkpoint's chunks, in restore order.
    chunks: Vec<starckpt_proto::ChunkHash>,
}

/// Where the built-in cluster (`dir`, `targets` targets) keeps each of `chunks` (one copy each:
/// the first target holding it), in order (`server/src/chunkserver/store.rs`'s layout).
fn chunk_files(
    dir: &std::path::Path,
    targets: usize,
    chunks: &[starckpt_proto::ChunkHash],
) -> anyhow::Result<Vec<PathBuf>> {
    chunks
        .iter()
        .map(|hash| {
            let hex = hash.to_hex();
            (0..targets)
                .map(|index| dir.join(format!("target-{index}")).join("chunks").join(&hex[..2]).join(&hex))
                .find(|path| path.exists())
                .with_context(|| format!("chunk {hex} is in no target directory under {}", dir.display()))
        })
        .collect()
}

/// Saves `state` as `step` from every rank at once, then restores it from every rank.
async fn run_once(
    clients: &[Client],
    job: &str,
    step: u64,
    state: &[Shard],
    perf: &PerfControl,
    meter: &Meter,
) -> anyhow::Result<Run> {
    let ranks = clients.len() as u32;
    let parts: Vec<SavePart> = state
        .iter()
        .enumerate()
        .map(|(rank, shard)| {
            shard.iter().try_fold(SavePart::new(job, step).rank(rank as u32, ranks), |part, (path, data)| {
                part.buffer(path, data.clone())
            })
        })
        .collect::<Result<_, _>>()?;
    perf.start(PerfPhase::Committed);
    perf.start(PerfPhase::Blocking);
    let start = meter.read();
    let started = Instant::now();
    // Each rank on its own task, as ranks are separate processes: their copies run in parallel,
    // and the stall is the slowest rank's.
    let saves = clients.iter().zip(parts).map(|(client, part)| {
        let client = client.clone();
        tokio::spawn(async move {
            let handle = client.save(part).await?;
            Ok::<_, starckpt_client::Error>((started.elapsed(), handle))
        })
    });
    let mut handles = Vec::new();
    let mut stall = Duration::ZERO;
    for saved in futures::future::try_join_all(saves).await? {
        let (elapsed, handle) = saved?;
        stall = stall.max(elapsed);
        handles.push(handle);
    }
    let stall_ended = meter.read();
    let blocking = Timed { wall: stall, ..meter.since(&start) };
    perf.end(PerfPhase::Blocking);
    let staging_waits = handles.iter().map(|h| h.progress().staging_waits.load(Ordering::Relaxed)).sum();
    let progress: Vec<_> = handles.iter().map(|h| Arc::clone(h.progress())).collect();
    let outcomes = futures::future::try_join_all(handles.into_iter().map(|h| h.wait())).await?;
    let (committed, persist) = (meter.since(&start), meter.since(&stall_ended));
    perf.end(PerfPhase::Committed);
    if !outcomes.iter().any(|o| o.committed()) {
        bail!("step {step} did not commit");
    }

    // Destination buffers are allocated and touched first, as a trainer's tensors would be.
    let buffers: Vec<Vec<Vec<u8>>> =
        state.iter().map(|shard| shard.iter().map(|(_, data)| vec![1u8; data.len()]).collect()).collect();
    let manifest = Arc::new(clients[0].manifest(job, Some(step)).await?);
    let chunks = manifest.files.iter().flat_map(|f| f.chunks.iter().map(|c| c.hash)).collect();
    meter.settle();
    perf.start(PerfPhase::Restore);
    let (buffers, restore) = timed(meter, async {
        // Each rank on its own task, as ranks are separate processes.
        let reads = clients.iter().zip(state).zip(buffers).map(|((client, shard), mut buffers)| {
            let (client, manifest) = (client.clone(), Arc::clone(&manifest));
            let paths: Vec<String> = shard.iter().map(|(path, _)| path.clone()).collect();
            tokio::spawn(async move {
                restore_rank(&client, &manifest, &paths, &mut buffers).await?;
                Ok::<_, starckpt_client::Error>(buffers)
            })
        });
        let mut restored = Vec::new();
        for rank in futures::future::try_join_all(reads).await? {
            restored.push(rank?);
        }
        Ok(restored)
    })
    .await?;
    perf.end(PerfPhase::Restore);
    for (shard, buffers) in state.iter().zip(&buffers) {
        for ((path, data), buffer) in shard.iter().zip(buffers) {
            if buffer[..] != data[..] {
                bail!("restored {path} of step {step} differs from what was saved");
            }
        }
    }
    let sum = |count: fn(&SaveProgress) -> &std::sync::atomic::AtomicU64| {
        progress.iter().map(|p| count(p).load(Ordering::Relaxed)).sum::<u64>()
    };
    let (uploaded_bytes, stored_bytes) = (sum(|p| &p.uploaded_bytes), sum(|p| &p.stored_bytes));
    Ok(Run { blocking, committed, persist, restore, staging_waits, uploaded_bytes, stored_bytes, chunks })
}

pub async fn run(args: BenchArgs, json: bool) -> anyhow::Result<()> {
    if args.size < 64 << 20 {
        bail!("--size must be at least 64MiB (it was {})", output::bytes(args.size));
    }
    if args.ranks == 0 || args.runs == 0 || args.replicas == 0 || args.targets == 0 {
        bail!("--ranks, --runs, --replicas and --targets must be at least 1");
    }
    let temp;
    let data_dir = match &args.data {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
            dir.clone()
        }
        None => {
            temp = tempfile::Builder::new().prefix("starckpt-bench-").tempdir().context("create a temp dir")?;
            temp.path().to_path_buf()
        }
    };
    let params = (args.size / 14) as usize;
    let (hidden, layout) = transformer(params);
    let total = params as u64 * 14;
    let say = |line: String| {
        if !json {
            say!("{line}");
        }
    };

    // Free files per target for every run's chunks (tensor tails, smaller than a chunk, get new
    // files), with a margin for uneven placement.
    let preallocate = match (&args.cluster, args.fresh_files) {
        (None, false) => total * u64::from(args.replicas) * u64::from(args.runs) / args.targets as u64 * 5 / 4,
        _ => 0,
    };
    let cluster = match &args.cluster {
        Some(_) => None,
        None => {
            let (chunk_size, queue_depth, zero_copy_send) =
                (args.chunk_size as usize, args.queue_depth, args.zero_copy_send);
            let placed_writes = !args.shm_copy_writes;
            let configure = |config: &mut starckpt_server::chunkserver::TargetConfig| {
                config.chunk_size_bytes = chunk_size;
                config.shm_placed_writes = placed_writes;
                config.limits.zero_copy_send = zero_copy_send;
                config.preallocate_bytes = preallocate;
                config.queue_depth = queue_depth;
            };
            let dir = data_dir.join("cluster");
            match std::fs::remove_dir_all(&dir) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    bail!("remove the previous run's cluster in {}: {e}", dir.display())
                }
                _ => {}
            }
            Some(DevCluster::start_with(&dir, "127.0.0.1:0", args.targets, args.io_engine, configure).await?)
        }
    };
    let address = match (&args.cluster, &cluster) {
        (Some(address), _) => address.clone(),
        (None, Some(cluster)) => cluster.control_address.to_string(),
        (None, None) => unreachable!("a cluster was started"),
    };
    // Each rank's staging holds its whole shard: every tensor's whole chunks, plus room for the
    // pieces smaller than a chunk, packed (a packed buffer is handed over when the next piece does
    // not fit, so at most half of it is wasted).
    let mut first_state = Some(model_state(&layout, args.ranks, 1));
    let chunk = args.chunk_size;
    let staging = first_state
        .iter()
        .flatten()
        .map(|shard| {
            let whole: u64 = shard.iter().map(|(_, d)| d.len() as u64 / chunk * chunk).sum();
            let tails: u64 = shard.iter().map(|(_, d)| d.len() as u64 % chunk).sum();
            whole + 2 * tails + 2 * chunk
        })
        .max()
        .unwrap_or(chunk) as usize;
    let run_id = format!("bench-{}", uuid::Uuid::new_v4().simple());
    let mut clients = Vec::new();
    for _ in 0..args.ranks {
        let mut config = ClientConfig::new(address.clone());
        config.chunk_size_bytes = args.chunk_size as usize;
        // Room for the rank's whole shard, so `save` returns after the staging copy.
        config.staging_bytes = staging;
        config.run_id = Some(run_id.clone());
        config.compression = args.compression.config()?;
        config.shm.enabled = !args.no_shm;
        if let Some(slots) = args.shm_slots {
            config.shm.slots = slots;
        }
        config.tcp.zero_copy_send = args.zero_copy_send;
        if let Some(overlap) = args.upload_during_staging {
            config.upload_during_staging = overlap;
        }
        clients.push(Client::connect(config).await?);
    }
    crate::demo::wait_for_targets(&clients[0], if cluster.is_some() { args.targets } else { 1 }).await?;
    let targets = clients[0].targets().await?.len();
    if preallocate > 0 {
        let started = Instant::now();
        let filled = wait_for_free_pools(&clients[0], preallocate, args.chunk_size + 4096).await?;
        say(format!(
            "free pools filled with {} of chunk files in {:.2?} (not counted)",
            output::bytes(filled),
            started.elapsed()
        ));
    }
    let job = format!("bench-{}", &run_id[6..14]);
    clients[0].set_replication(&job, args.replicas).await?;
    say(format!(
        "starckpt bench: {} of mixed-precision Adam state ({:.0}M parameters, hidden {hidden}, {} tensors: bf16 \
         weights, fp32 master weights, 2 fp32 moments) from {} rank(s) to {targets} target(s), {} cop{} per chunk, \
         {} chunks, {} run(s); data in {}",
        output::bytes(total),
        params as f64 / 1e6,
        layout.len() * 4,
        args.ranks,
        args.replicas,
        if args.replicas == 1 { "y" } else { "ies" },
        output::bytes(args.chunk_size),
        args.runs,
        data_dir.display()
    ));
    let warm = Instant::now();
    for client in &clients {
        client.warm_staging(staging);
    }
    say(format!("staging memory allocated and pre-faulted once in {:.2?} (not counted)", warm.elapsed()));

    let perf = PerfControl::open(&args)?;
    let meter = Meter::for_dir(&data_dir);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut runs = Vec::new();
    let mut memcpy = Vec::new();
    let mut direct_write = Vec::new();
    let mut direct_read = Vec::new();
    let mut direct_read_all = Vec::new();
    let mut direct_write_all = Vec::new();
    let mut layout_read = Vec::new();
    let mut buffered = Vec::new();
    let (mut tcp_write, mut tcp_read) = (Vec::new(), Vec::new());
    // A warm-up save, untimed: connections opened and the job's lease taken before run 1.
    let (job_name, ranks) = (&job, args.ranks);
    let warm_up = clients.iter().enumerate().map(|(rank, client)| async move {
        let part = SavePart::new(job_name, 0)
            .rank(rank as u32, ranks)
            .buffer(&format!("warm-up-{rank}"), Bytes::from_static(b"."))?;
        client.save(part).await?.wait().await
    });
    futures::future::try_join_all(warm_up).await?;
    for n in 0..args.runs {
        let state = match first_state.take() {
            Some(state) => state,
            None => model_state(&layout, args.ranks, u64::from(n) + 1),
        };
        let flat: Vec<Bytes> = state.iter().flatten().map(|(_, data)| data.clone()).collect();
        // The baselines of this run, interleaved with it so drift hits both alike, each measure
        // starting on an idle disk.
        meter.settle();
        let direct = baseline::direct(total, &data_dir)?;
        meter.settle();
        let direct_all = baseline::direct_all(total, &data_dir)?;
        let copy = baseline::memcpy(&flat);
        meter.settle();
        let torch_save = baseline::buffered_fsync(&flat, &data_dir)?;
        meter.settle();
        // Chunks sent over TCP: what the same bytes cost over the loopback, into and out of the disk.
        if args.no_shm {
            let [write, read] = baseline::tcp_direct(total, &data_dir)?;
            meter.settle();
            tcp_write.push(write);
            tcp_read.push(read);
        }
        let baselines = [copy, direct.write, torch_save, direct.read, direct_all.write, direct_all.read];
        let all = [
            &mut memcpy,
            &mut direct_write,
            &mut buffered,
            &mut direct_read,
            &mut direct_write_all,
            &mut direct_read_all,
        ];
        for (all, this) in all.into_iter().zip(baselines) {
            all.push(Timed::wall(this));
        }
        let run = run_once(&clients, &job, u64::from(n) + 1, &state, &perf, &meter).await?;
        // The built-in cluster's chunk files of this checkpoint, read raw as many at once as the
        // restore fetched them (over shared memory, at most a slot per target and rank each).
        if cluster.is_some() {
            let files = chunk_files(&data_dir.join("cluster"), args.targets, &run.chunks)?;
            let shm = &clients[0].config().shm;
            let per_rank = clients[0].config().restore_concurrency;
            let per_rank = if shm.enabled { per_rank.min(args.targets * shm.slots as usize) } else { per_rank };
            let in_flight = per_rank * args.ranks as usize;
            meter.settle();
            layout_read.push(Timed::wall(baseline::direct_read_files(&files, in_flight)?));
        }
        say(format!(
            "run {}: blocking {:.2?} ({} staging waits), committed {:.2?} (persist {:.2?}, sent {:.3} of the bytes), \
             restore {:.2?} | memcpy {:.2?}, O_DIRECT write {:.2?}, buffered write+fsync {:.2?}, O_DIRECT read {:.2?}{}",
            n + 1,
            run.blocking.wall,
            run.staging_waits,
            run.committed.wall,
            run.persist.wall,
            run.stored_bytes as f64 / run.uploaded_bytes.max(1) as f64,
            run.restore.wall,
            copy,
            direct.write,
            torch_save,
            direct.read,
            match (args.no_shm, tcp_write.last(), tcp_read.last()) {
                (true, Some(write), Some(read)) =>
                    format!(", over loopback TCP: write {:.2?}, read {:.2?}", write.wall, read.wall),
                _ => String::new(),
            }
        ));
        runs.push(run);
    }
    let blocking = median(runs.iter().map(|r| r.blocking).collect());
    let committed = median(runs.iter().map(|r| r.committed).collect());
    let persist = median(runs.iter().map(|r| r.persist).collect());
    let restore = median(runs.iter().map(|r| r.restore).collect());
    let (uploaded, stored) = runs.iter().fold((0u64, 0u64), |(u, s), r| (u + r.uploaded_bytes, s + r.stored_bytes));
    let compression_ratio = uploaded as f64 / stored.max(1) as f64;
    let (memcpy, direct_write, direct_read, buffered) =
        (median(memcpy), median(direct_write), median(direct_read), median(buffered));
    let (direct_write_all, direct_read_all) = (median(direct_write_all), median(direct_read_all));
    let layout_read = (!layout_read.is_empty()).then(|| median(layout_read));
    let tcp = (!tcp_write.is_empty()).then(|| (median(tcp_write), median(tcp_read)));
    if let Some(cluster) = cluster {
        cluster.shutdown().await?;
    }

    let gb = total as f64 / 1e9;
    let gbps = |t: Timed| gb / t.wall.as_secs_f64().max(1e-9);
    let mut rows = vec![
        ("blocking", blocking, "memcpy into touched memory", memcpy),
        ("committed", committed, "O_DIRECT write + fsync", direct_write),
        ("committed", committed, "O_DIRECT write from memory for all", direct_write_all),
        ("committed", committed, "buffered write + fsync (torch.save)", buffered),
    ];
    if let Some((tcp_write, _)) = tcp {
        rows.push(("committed", committed, "loopback TCP to O_DIRECT write", tcp_write));
    }
    rows.push(("persist", persist, "O_DIRECT write + fsync", direct_write));
    rows.push(("persist", persist, "O_DIRECT write from memory for all", direct_write_all));
    if let Some((tcp_write, _)) = tcp {
        rows.push(("persist", persist, "loopback TCP to O_DIRECT write", tcp_write));
    }
    rows.push(("restore", restore, "O_DIRECT read", direct_read));
    rows.push(("restore", restore, "O_DIRECT read into memory for all", direct_read_all));
    if let Some(layout_read) = layout_read {
        rows.push(("restore", restore, "O_DIRECT read of its chunk files", layout_read));
    }
    if let Some((_, tcp_read)) = tcp {
        rows.push(("restore", restore, "O_DIRECT read to loopback TCP", tcp_read));
    }
    if json {
        let phase = |t: Timed| {
            json!({
                "seconds": t.wall.as_secs_f64(), "gb_per_s": gbps(t), "cpu_seconds_per_gb": t.cpu / gb,
                "cores_busy": t.cores(), "disk_busy": t.disk_share(),
            })
        };
        let baseline = |t: Timed| json!({"seconds": t.wall.as_secs_f64(), "gb_per_s": gbps(t)});
        let measured =
            |t: Timed| json!({"seconds": t.wall.as_secs_f64(), "gb_per_s": gbps(t), "cpu_seconds_per_gb": t.cpu / gb});
        say!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "bytes": total, "parameters": params, "tensors": layout.len() * 4, "ranks": args.ranks,
                "cores": cores, "disk": meter.disk(),
                "targets": targets, "replicas": args.replicas, "chunk_bytes": args.chunk_size, "runs": args.runs, "fresh_files": preallocate == 0,
                "built_in_cluster": args.cluster.is_none(),
                "shm_slots": (!args.no_shm).then(|| clients[0].config().shm.slots),
                "compression": args.compression.compress, "compression_ratio": compression_ratio,
                "starckpt": {"blocking": phase(blocking), "committed": phase(committed), "persist": phase(persist),
                    "restore": phase(restore)},
                "baselines": {
                    "memcpy": baseline(memcpy), "odirect_write_fsync": baseline(direct_write),
                    "odirect_write_fsync_from_all_memory": baseline(direct_write_all),
                    "buffered_write_fsync": baseline(buffered), "odirect_read": baseline(direct_read),
                    "odirect_read_into_all_memory": baseline(direct_read_all),
                    "odirect_read_chunk_files": layout_read.map(baseline),
                    "loopback_tcp_odirect_write": tcp.map(|(write, _)| measured(write)),
                    "odirect_read_loopback_tcp": tcp.map(|(_, read)| measured(read)),
                },
                "ratios": {
                    "blocking_vs_memcpy": ratio(blocking.wall, memcpy.wall),
                    "committed_vs_odirect_write": ratio(committed.wall, direct_write.wall),
                    "committed_vs_odirect_write_from_all_memory": ratio(committed.wall, direct_write_all.wall),
                    "committed_vs_buffered_write_fsync": ratio(committed.wall, buffered.wall),
                    "persist_vs_odirect_write": ratio(persist.wall, direct_write.wall),
                    "persist_vs_odirect_write_from_all_memory": ratio(persist.wall, direct_write_all.wall),
                    "persist_vs_loopback_tcp_odirect_write": tcp.map(|(w, _)| ratio(persist.wall, w.wall)),
                    "restore_vs_odirect_read": ratio(restore.wall, direct_read.wall),
                    "restore_vs_odirect_read_into_all_memory": ratio(restore.wall, direct_read_all.wall),
                    "restore_vs_odirect_read_chunk_files": layout_read.map(|l| ratio(restore.wall, l.wall)),
                    "committed_vs_loopback_tcp_odirect_write": tcp.map(|(w, _)| ratio(committed.wall, w.wall)),
                    "restore_vs_odirect_read_loopback_tcp": tcp.map(|(_, r)| ratio(restore.wall, r.wall)),
                },
            }))?
        );
    } else {
        say!();
        say!(
            "{:<10} {:>9} {:>8} {:>9} {:>6} {:>5}   {:<36} {:>9} {:>8}   {:>10}",
            "phase",
            "starckpt",
            "GB/s",
            "CPU s/GB",
            "cores",
            "disk",
            "baseline (same bytes, same disk)",
            "time",
            "GB/s",
            "time ratio"
        );
        for (phase, ours, name, base) in rows {
            let disk = ours.disk_share().map_or("-".to_owned(), |share| format!("{:.0}%", share * 100.0));
            say!(
                "{:<10} {:>8.2}s {:>8.2} {:>9.2} {:>6.2} {:>5}   {:<36} {:>8.2}s {:>8.2}   {:>9.2}x",
                phase,
                ours.wall.as_secs_f64(),
                gbps(ours),
                ours.cpu / gb,
                ours.cores(),
                disk,
                name,
                base.wall.as_secs_f64(),
                gbps(base),
                ratio(ours.wall, base.wall)
            );
        }
        if let Some((write, read)) = tcp {
            say!(
                "loopback TCP baselines: {:.2} CPU s/GB to O_DIRECT write, {:.2} from O_DIRECT read (both ends, {:.2} \
                 and {:.2} cores)",
                write.cpu / gb,
                read.cpu / gb,
                write.cores(),
                read.cores()
            );
        }
        if args.compression.compress.is_some() {
            say!("compression: {compression_ratio:.3}x (bytes uploaded ÷ bytes sent and stored, all runs)");
        }
        say!(
            "(time ratio: starckpt's time ÷ the baseline's; below 1 is faster. CPU: {}. cores: CPU seconds per \
             second, of {cores} here; disk: the share of the phase {} had I/O in flight, /proc/diskstats.)",
            if args.cluster.is_none() {
                "this process, which runs the client, the targets and the control plane"
            } else {
                "the client process only"
            },
            meter
                .disk()
                .map_or("the data directory's disk (unknown here)".to_owned(), |d| format!("{d}, the data disk,"))
        );
    }
    if let Some(path) = &args.chart {
        let mut bars = [
            ("blocking", vec![("memcpy", gbps(memcpy))]),
            (
                "committed",
                vec![
                    ("O_DIRECT write", gbps(direct_write)),
                    ("write from all", gbps(direct_write_all)),
                    ("buffered+fsync", gbps(buffered)),
                ],
            ),
            ("restore", vec![("O_DIRECT read", gbps(direct_read)), ("read into all", gbps(direct_read_all))]),
        ];
        if let Some((tcp_write, tcp_read)) = tcp {
            bars[1].1.push(("TCP to O_DIRECT", gbps(tcp_write)));
            bars[2].1.push(("O_DIRECT to TCP", gbps(tcp_read)));
        }
        for ((_, phase), ours) in bars.iter_mut().zip([blocking, committed, restore]) {
            phase.push(("starckpt", gbps(ours)));
        }
        let title = format!(
            "starckpt bench: {} from {} rank(s), {} copies per chunk",
            output::bytes(total),
            args.ranks,
            args.replicas
        );
        crate::chart::throughput(path, &title, &bars)?;
        if !json {
            say!("chart: {}", path.display());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_adds_up_to_the_requested_parameters() {
        for params in [5_000_000usize, 77_000_000, 1_000_000_000] {
            let (hidden, layout) = transformer(params);
            assert_eq!(layout.iter().map(|p| p.elements).sum::<usize>(), params, "{params}");
            assert!(layout.len() >= 4 * 6, "{params}: at least four layers, got {} tensors", layout.len());
            assert!(hidden >= 256, "{params}: hidden {hidden}");
        }
    }

    #[test]
    fn shards_are_balanced_and_hold_every_tensor_once() {
        let (_, layout) = transformer(3_000_000);
        let state = model_state(&layout, 3, 1);
        let sizes: Vec<usize> = state.iter().map(|s| s.iter().map(|(_, d)| d.len()).sum()).collect();
        assert_eq!(sizes.iter().sum::<usize>(), 3_000_000 * 14);
        let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
        assert!(max - min <= layout.iter().map(|p| p.elements * 14).max().unwrap(), "{sizes:?}");
        let mut names: Vec<&str> = state.iter().flatten().map(|(n, _)| n.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), layout.len() * 4);
        // The bf16 weight is the high half of the master copy.
        let weight = &state.iter().flatten().find(|(n, _)| n == "model/embed.weight").unwrap().1;
        let master = &state.iter().flatten().find(|(n, _)| n == "optim/master/embed.weight").unwrap().1;
        assert_eq!(&weight[..2], &master[2..4]);
    }
}
