//! `starckpt demo`: the whole path on one machine, with timings against the hardware.
//!
//! It starts a dev cluster in a temporary directory, saves a synthetic model state (a few
//! "tensors", one of them frozen so deduplication has something to find) at a few steps, kills the
//! cluster in the middle of the next save (a preemption), restarts it from the same data
//! directory, restores the latest committed checkpoint into memory, verifies it byte for byte,
//! and prints each figure beside a baseline measured in the same run on the same disk:
//! stall ÷ memcpy, persist ÷ O_DIRECT write of as many bytes as the save wrote (every copy of
//! every chunk: with two copies on one disk, twice the state), restore ÷ O_DIRECT read. These are
//! the baselines `starckpt bench` holds the same phases to.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Args;
use rand::{RngCore, SeedableRng};
use serde_json::json;
use starckpt_client::{Client, ClientConfig, SavePart, TargetState};
use starckpt_server::chunkserver::EngineKind;
use starckpt_server::dev::DevCluster;

use crate::baseline::{self, ratio};
use crate::output;

#[derive(Args)]
pub struct DemoArgs {
    /// Bytes of model state saved at each step (e.g. 2GiB, 512MiB).
    #[arg(long, default_value = "2GiB", value_parser = parse_size)]
    size: u64,
    /// Checkpoints to save before the simulated preemption.
    #[arg(long, default_value_t = 3)]
    steps: u64,
    #[arg(long, default_value_t = 3)]
    targets: usize,
    /// Keep the cluster's data here instead of a temporary directory.
    #[arg(long)]
    data: Option<PathBuf>,
    #[arg(long, default_value = "uring")]
    io_engine: EngineKind,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

/// Parses sizes like `2GiB`, `512MiB`, `64MB`, `1000`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        other => return Err(format!("unknown size unit {other:?}")),
    };
    let not_a_size = || format!("{text:?} is not a size");
    if !number.contains('.') {
        let whole: u64 = number.parse().map_err(|_| not_a_size())?;
        return whole.checked_mul(scale).ok_or_else(|| format!("{text:?} is more bytes than this machine counts"));
    }
    // A fraction of a unit (1.5GiB): whole bytes, and small enough for f64 to hold exactly.
    let bytes = number.parse::<f64>().map_err(|_| not_a_size())? * scale as f64;
    if !bytes.is_finite() || bytes > (1u64 << 53) as f64 {
        return Err(format!("{text:?} is too large for a fractional size; give it in a smaller unit"));
    }
    if bytes.fract() != 0.0 {
        return Err(format!("{text:?} is not a whole number of bytes"));
    }
    Ok(bytes as u64)
}

const TENSORS: usize = 8;
/// The last tensor never changes between steps (think frozen embeddings): its chunks deduplicate.
const FROZEN: usize = TENSORS - 1;

fn tensor_len(size: u64, index: usize) -> usize {
    let base = size as usize / TENSORS;
    if index == TENSORS - 1 { size as usize - base * (TENSORS - 1) } else { base }
}

fn tensor(size: u64, step: u64, index: usize) -> Vec<u8> {
    let seed = if index == FROZEN { 0xF0F0 } else { step * 1000 + index as u64 };
    let mut data = vec![0u8; tensor_len(size, index)];
    rand::rngs::SmallRng::seed_from_u64(seed).fill_bytes(&mut data);
    data
}

fn model_state(size: u64, step: u64) -> Vec<Bytes> {
    (0..TENSORS).map(|i| Bytes::from(tensor(size, step, i))).collect()
}

fn tensor_name(index: usize) -> String {
    if index == FROZEN { "model/embeddings.bin".into() } else { format!("model/layer{index}.bin") }
}

struct Baselines {
    memcpy: Duration,
    direct_write: Duration,
    direct_read: Duration,
}

impl Baselines {
    fn measure(state: &[Bytes], dir: &Path) -> anyhow::Result<Baselines> {
        let total = state.iter().map(|t| t.len() as u64).sum();
        let direct = baseline::direct(total, dir)?;
        Ok(Baselines { memcpy: baseline::memcpy(state), direct_write: direct.write, direct_read: direct.read })
    }
}

pub(crate) async fn wait_for_targets(client: &Client, count: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let alive = client.targets().await?.iter().filter(|t| t.state == TargetState::Alive as i32).count();
        if alive >= count {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("only {alive} of {count} targets registered within 15 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn client_config(address: String, size: u64) -> ClientConfig {
    let mut config = ClientConfig::new(address);
    // Room for a whole step, so `save` returns after the staging copy instead of waiting for
    // uploads to free buffers.
    config.staging_bytes = size as usize + config.chunk_size_bytes;
    config
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    if args.size < TENSORS as u64 || args.steps == 0 || args.targets == 0 {
        bail!("--size must be at least {TENSORS} bytes and --steps and --targets at least 1");
    }
    let temp;
    let data_dir = match &args.data {
        Some(dir) => dir.clone(),
        None => {
            temp = tempfile::Builder::new().prefix("starckpt-demo-").tempdir().context("create a temp dir")?;
            temp.path().to_path_buf()
        }
    };
    let say = |line: String| {
        if !args.json {
            say!("{line}");
        }
    };
    let job = "demo-llama";
    let size = args.size;
    say(format!(
        "starckpt demo: {} of model state in {TENSORS} tensors, {} targets ({:?}), data in {}",
        output::bytes(size),
        args.targets,
        args.io_engine,
        data_dir.display()
    ));

    let cluster = DevCluster::start(&data_dir, "127.0.0.1:0", args.targets, args.io_engine).await?;
    let client = Client::connect(client_config(cluster.control_address.to_string(), size)).await?;
    wait_for_targets(&client, args.targets).await?;
    // Every chunk on two targets where there are two (one disk here: each copy is written to it).
    let copies: u32 = if args.targets >= 2 { 2 } else { 1 };
    client.set_replication(job, copies).await?;

    let first_state = model_state(size, 100);
    let baselines = Baselines::measure(&first_state, &data_dir)?;
    say(format!(
        "baselines on this machine: memcpy {} ({}), O_DIRECT write+fsync {} ({}), O_DIRECT read {} ({})",
        format_args!("{:.2?}", baselines.memcpy),
        output::rate(size, baselines.memcpy),
        format_args!("{:.2?}", baselines.direct_write),
        output::rate(size, baselines.direct_write),
        format_args!("{:.2?}", baselines.direct_read),
        output::rate(size, baselines.direct_read),
    ));
    let warm = Instant::now();
    client.warm_staging(size as usize);
    say(format!("staging pool: {} allocated and pre-faulted once in {:.2?}", output::bytes(size), warm.elapsed()));

    let mut steps = Vec::new();
    let mut state = first_state;
    for n in 1..=args.steps {
        let step = n * 100;
        if n > 1 {
            state = model_state(size, step);
        }
        let mut part = SavePart::new(job, step);
        for (index, data) in state.iter().enumerate() {
            part = part.buffer(&tensor_name(index), data.clone())?;
        }
        let started = Instant::now();
        let handle = client.save(part).await?;
        let stall = started.elapsed();
        let outcome = handle.wait().await?;
        let persist = started.elapsed();
        // What the save wrote to the disk: each copy of each chunk it uploaded (deduplicated ones
        // were not written again), against an O_DIRECT write of that many bytes.
        let written = outcome.uploaded_bytes * u64::from(copies);
        let write_baseline = baselines.direct_write.mul_f64(written as f64 / size as f64);
        say(format!(
            "step {step}: trainer stalled {:.2?} ({:.2}x memcpy); committed after {:.2?} ({}, {:.2}x an O_DIRECT write of the {} it wrote: {copies} copies, {}/{} chunks deduplicated)",
            stall,
            ratio(stall, baselines.memcpy),
            persist,
            output::rate(size, persist),
            ratio(persist, write_baseline),
            output::bytes(written),
            outcome.deduplicated_chunks,
            outcome.chunks
        ));
        steps.push(json!({
            "step": step, "stall_seconds": stall.as_secs_f64(), "persist_seconds": persist.as_secs_f64(),
            "stall_vs_memcpy": ratio(stall, baselines.memcpy), "persist_vs_odirect_write": ratio(persist, write_baseline),
            "written_bytes": written, "copies": copies,
            "chunks": outcome.chunks, "deduplicated_chunks": outcome.deduplicated_chunks,
        }));
    }

    // Preemption: the next save is staged, then every service dies mid-upload.
    let preempted_step = (args.steps + 1) * 100;
    let mut part = SavePart::new(job, preempted_step);
    for (index, data) in model_state(size, preempted_step).iter().enumerate() {
        part = part.buffer(&tensor_name(index), data.clone())?;
    }
    let handle = client.save(part).await?;
    cluster.kill().await;
    // A preempted trainer dies with its cluster: it does not wait out the SDK's retries of a
    // control plane that is gone (they give it minutes to fail over). Whether the save made it
    // is what `latest` says after the restart; a save still running here is abandoned.
    let interrupted = match tokio::time::timeout(Duration::from_secs(2), handle.wait()).await {
        Ok(result) => result.map(|_| ()).map_err(|e| e.to_string()),
        Err(_) => Err("still retrying the dead control plane".to_owned()),
    };
    drop(client);
    say(format!(
        "preemption: cluster killed while step {preempted_step} was uploading (save {})",
        if interrupted.is_ok() { "had already committed" } else { "did not commit" }
    ));

    let cluster = DevCluster::start(&data_dir, "127.0.0.1:0", args.targets, args.io_engine).await?;
    let client = Client::connect(client_config(cluster.control_address.to_string(), size)).await?;
    wait_for_targets(&client, args.targets).await?;
    let started = Instant::now();
    let latest = client.latest(job).await?.context("no committed checkpoint after restart")?;
    let latest_latency = started.elapsed();
    // The last step saved before the kill, or the preempted one if its commit landed just
    // before the kill (a save reports success only once committed, so never the other way round).
    let expected = if interrupted.is_ok() { vec![preempted_step] } else { vec![args.steps * 100, preempted_step] };
    if !expected.contains(&latest.step) {
        bail!("latest is step {} after the restart, expected one of {expected:?}", latest.step);
    }
    say(format!("restart: latest committed checkpoint is step {} (found in {:.2?})", latest.step, latest_latency));

    // Destination buffers are allocated and touched first, as a trainer's tensors would be.
    let mut restored: Vec<Vec<u8>> = (0..TENSORS).map(|i| vec![1u8; tensor_len(size, i)]).collect();
    let started = Instant::now();
    let manifest = client.manifest(job, Some(latest.step)).await?;
    // All tensors at once, as a trainer's loader (and `starckpt bench`) reads them: one after the
    // other, each small tensor would wait for the one before.
    let reads = restored.iter_mut().enumerate().map(|(index, buffer)| {
        let (client, manifest) = (&client, &manifest);
        async move { client.read_into(manifest, &tensor_name(index), buffer).await }
    });
    futures::future::try_join_all(reads).await?;
    let restore = started.elapsed();
    for (index, buffer) in restored.iter().enumerate() {
        if buffer[..] != tensor(size, latest.step, index)[..] {
            bail!("restored {} differs from what step {} saved", tensor_name(index), latest.step);
        }
    }
    say(format!(
        "restore: step {} into memory in {:.2?} ({}, {:.2}x O_DIRECT read time); every chunk BLAKE3-verified, every byte compared: OK",
        latest.step,
        restore,
        output::rate(size, restore),
        ratio(restore, baselines.direct_read)
    ));
    cluster.shutdown().await?;

    if args.json {
        say!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "bytes": size, "targets": args.targets, "io_engine": format!("{:?}", args.io_engine),
                "baselines": {
                    "memcpy_seconds": baselines.memcpy.as_secs_f64(),
                    "odirect_write_seconds": baselines.direct_write.as_secs_f64(),
                    "odirect_read_seconds": baselines.direct_read.as_secs_f64(),
                },
                "steps": steps,
                "preempted_step": preempted_step,
                "latest_after_restart": latest.step,
                "latest_seconds": latest_latency.as_secs_f64(),
                "restore_seconds": restore.as_secs_f64(),
                "restore_vs_odirect_read": ratio(restore, baselines.direct_read),
                "verified": true,
            }))?
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("64MB"), Ok(64_000_000));
        assert_eq!(parse_size("1000"), Ok(1000));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("5 parsecs").is_err());
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("0.5KiB"), Ok(512));
        // Once these saturated at u64::MAX or rounded down to 0.
        assert!(parse_size("20000000000GiB").is_err());
        assert!(parse_size("99999999999999999999").is_err());
        assert!(parse_size("0.5").is_err());
        assert!(parse_size("1e30").is_err());
        assert!(parse_size("1.2.3MiB").is_err());
    }
}
