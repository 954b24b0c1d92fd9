//! The subcommands. Each is a thin layer over the server or client library.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::json;
use starckpt_client::{
    CheckpointInfo, CheckpointManifest, CheckpointState, Client, ClientConfig, CommitState, RestoreOptions,
    RetentionPolicy, SavePart, TargetState,
};
use starckpt_server::chunkserver::{EngineKind, TargetConfig};
use starckpt_server::control::ControlConfig;
use starckpt_server::control::gc::GcConfig;
use tokio::net::TcpListener;

use crate::output::{self, Output};

/// Prints a daemon's banner. A closed stdout (`starckpt dev | head -1`, a test that read the
/// address and went away) must not kill a server, so write errors are ignored.
fn banner(text: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{text}");
    let _ = stdout.flush();
}

/// Resolves on SIGINT or SIGTERM. The handlers are installed when this is called, not when the
/// future is first polled: call it before announcing readiness, or a signal sent right after the
/// announcement would kill the process instead of shutting it down.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate()).ok();
    let int = signal(SignalKind::interrupt()).ok();
    async move {
        let wait = |s: Option<tokio::signal::unix::Signal>| async move {
            match s {
                Some(mut s) => {
                    s.recv().await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = wait(term) => {}
            _ = wait(int) => {}
        }
        tracing::info!("shutting down");
    }
}

pub struct ServerArgs {
    pub pending_timeout: Duration,
    pub gc_interval: Option<Duration>,
    pub gc_grace: Duration,
    pub gc_deletes_per_sec: u32,
    /// How long a draft's record lives without being put again.
    pub draft_ttl: Duration,
    /// Heartbeat period asked of targets; a target is dead after five missed.
    pub heartbeat_interval: Duration,
    pub lost_after: Duration,
    pub repair_interval: Option<Duration>,
    /// The object-store tier's URL.
    pub tier: Option<String>,
    pub tier_interval: Option<Duration>,
    pub tier_bytes_per_sec: u64,
    pub cluster_key: Option<starckpt_proto::capability::ClusterKey>,
    pub tokens: Option<std::sync::Arc<starckpt_server::control::auth::Tokens>>,
    pub tls: Option<std::sync::Arc<starckpt_server::control::tls::ServerTls>>,
}

pub async fn server(listen: &str, db: &str, args: ServerArgs) -> anyhow::Result<()> {
    let gc = GcConfig { grace: args.gc_grace, deletes_per_second: args.gc_deletes_per_sec, draft_ttl: args.draft_ttl };
    // Checked before anything binds, so a bad flag is one clear line.
    gc.validate(args.pending_timeout).map_err(anyhow::Error::msg)?;
    // Held until the process exits: one control plane per SQLite file.
    let _database = starckpt_server::control::DatabaseLock::take(db)?;
    let store = starckpt_server::control::open_store(db).await?;
    let tier = match &args.tier {
        Some(url) => Some(std::sync::Arc::new(starckpt_server::control::tier::Tier::open(url).await?)),
        None => None,
    };
    let listener = TcpListener::bind(listen).await.with_context(|| format!("listen on {listen}"))?;
    let shutdown = shutdown_signal();
    // The address line is for scripts and tests that listen on port 0.
    banner(&format!("control plane listening on {}", listener.local_addr()?));
    let config = ControlConfig {
        heartbeat_interval: args.heartbeat_interval,
        liveness_timeout: args.heartbeat_interval * 5,
        pending_timeout: args.pending_timeout,
        gc,
        gc_interval: args.gc_interval,
        repair: starckpt_server::control::repair::RepairConfig { lost_after: args.lost_after, ..Default::default() },
        repair_interval: args.repair_interval,
        tier,
        tier_config: starckpt_server::control::tier::TierConfig { bytes_per_second: args.tier_bytes_per_sec },
        tier_interval: args.tier_interval,
        cluster_key: args.cluster_key,
        tokens: args.tokens,
        tls: args.tls,
        ..Default::default()
    };
    starckpt_server::control::run(listener, store, config, shutdown).await
}

pub async fn target(config: TargetConfig, listen: &str) -> anyhow::Result<()> {
    let listener = TcpListener::bind(listen).await.with_context(|| format!("listen on {listen}"))?;
    let shutdown = shutdown_signal();
    // The address line is for scripts and tests that start targets on port 0.
    banner(&format!("target data plane listening on {}", listener.local_addr()?));
    starckpt_server::chunkserver::run(config, listener, shutdown).await
}

pub async fn dev(data: &Path, targets: usize, listen: &str, engine: EngineKind) -> anyhow::Result<()> {
    if targets == 0 {
        bail!("--targets must be at least 1");
    }
    let mut cluster = starckpt_server::dev::DevCluster::start(data, listen, targets, engine).await?;
    let mut text = format!(
        "starckpt dev cluster: control plane on {}, {} targets, data in {}",
        cluster.control_address,
        targets,
        data.display()
    );
    for (index, address) in cluster.target_addresses.iter().enumerate() {
        text.push_str(&format!("\n  target-{index}: {address}"));
    }
    text.push_str(&format!("\n\nUse it from another shell:\n  export STARCKPT_SERVER={}", cluster.control_address));
    let shutdown = shutdown_signal();
    banner(&text);
    tokio::select! {
        _ = shutdown => cluster.shutdown().await,
        error = cluster.failed() => Err(error),
    }
}

pub struct SaveArgs {
    pub job: String,
    pub step: u64,
    pub rank: u32,
    pub world_size: u32,
    pub run_id: Option<String>,
    pub chunk_size: Option<usize>,
    pub compression: Option<starckpt_proto::codec::CompressConfig>,
    pub paths: Vec<PathBuf>,
}

/// The control plane(s) a command talks to, and what it trusts on their TLS ports.
pub struct Remote {
    /// `--server`: `host:port`, a URL, or a comma-separated list of them.
    pub server: String,
    /// `--tls-ca` (`ClientConfig::tls_ca`).
    pub tls_ca: Option<PathBuf>,
}

impl std::fmt::Display for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.server)
    }
}

async fn connect(server: &Remote, chunk_size: Option<usize>) -> anyhow::Result<Client> {
    connect_as(server, chunk_size, None, None, false).await
}

/// Staging memory of `starckpt save`: every buffer is touched for the first time when it is first
/// filled, and first touches run at ~0.4-0.6 GB/s on these VMs (../shared/MACHINE.md) against
/// ~13 GB/s into memory touched before, so a 1 GiB pool filled once cost a save of 1 GiB of files
/// ~0.5 s of page faults. Staging that runs ahead of the uploads gains a command nothing, as no
/// trainer waits for its copy: twice the uploads in flight (16 chunks of 4 MiB by default) keeps
/// them fed from buffers that are reused hot.
const STAGING_AHEAD_BYTES: usize = 128 << 20;

async fn connect_as(
    server: &Remote,
    chunk_size: Option<usize>,
    run_id: Option<String>,
    compression: Option<starckpt_proto::codec::CompressConfig>,
    files: bool,
) -> anyhow::Result<Client> {
    let mut config = ClientConfig::new(&server.server);
    // Saving files, no trainer waits for the copy into staging: upload while it runs, and stage
    // only a little ahead of the uploads (STAGING_AHEAD_BYTES).
    if files {
        config.upload_during_staging = true;
        config.staging_bytes = config.staging_bytes.min(STAGING_AHEAD_BYTES);
    }
    config.tls_ca = server.tls_ca.clone();
    config.compression = compression;
    if run_id.is_some() {
        config.run_id = run_id;
    }
    if let Some(size) = chunk_size {
        config.chunk_size_bytes = size;
    }
    Ok(Client::connect(config).await?)
}

pub async fn save(server: &Remote, args: SaveArgs, out: &Output) -> anyhow::Result<()> {
    let client = connect_as(server, args.chunk_size, args.run_id, args.compression, true).await?;
    let items = starckpt_client::items_from_paths(&args.paths)?;
    let part = SavePart::new(&args.job, args.step).items(items).rank(args.rank, args.world_size);
    let started = Instant::now();
    let handle = client.save(part).await?;
    let staged = started.elapsed();
    let total = handle.total_bytes;
    let bar = output::progress_bar(total, "saving");
    let progress = Arc::clone(handle.progress());
    let follow = output::follow(&bar, move || progress.done_bytes());
    let result = handle.wait().await;
    drop(follow);
    bar.finish_and_clear();
    let outcome = result?;
    let elapsed = started.elapsed();
    if out.json {
        out.json(json!({
            "job": outcome.job, "step": outcome.step, "checkpoint_id": outcome.checkpoint_id, "epoch": outcome.epoch,
            "committed": outcome.committed(), "bytes": outcome.total_bytes, "chunks": outcome.chunks,
            "deduplicated_chunks": outcome.deduplicated_chunks, "uploaded_bytes": outcome.uploaded_bytes,
            "staged_seconds": staged.as_secs_f64(), "seconds": elapsed.as_secs_f64(),
        }));
        return Ok(());
    }
    let state = match outcome.state {
        CommitState::Committed => "committed".to_string(),
        CommitState::WaitingForRanks { parts_committed, world_size } => {
            format!("part committed, waiting for ranks ({parts_committed}/{world_size})")
        }
    };
    say!(
        "{} step {}: {} ({}, {} chunks, {} deduplicated) in {:.2?} ({}), staged in {:.2?}",
        outcome.job,
        outcome.step,
        state,
        output::bytes(outcome.total_bytes),
        outcome.chunks,
        outcome.deduplicated_chunks,
        elapsed,
        output::rate(outcome.total_bytes, elapsed),
        staged
    );
    Ok(())
}

fn state_name(state: i32) -> &'static str {
    match CheckpointState::try_from(state) {
        Ok(CheckpointState::Pending) => "pending",
        Ok(CheckpointState::Committed) => "committed",
        Ok(CheckpointState::Aborted) => "aborted",
        Ok(CheckpointState::Deleted) => "deleted",
        _ => "unknown",
    }
}

fn checkpoint_json(c: &CheckpointInfo) -> serde_json::Value {
    json!({
        "job": c.job, "step": c.step, "state": state_name(c.state), "checkpoint_id": c.checkpoint_id,
        "world_size": c.world_size, "parts_committed": c.parts_committed, "bytes": c.total_bytes, "epoch": c.epoch,
        "written_bytes": c.written_bytes,
        "files": c.file_count, "created_at_ms": c.created_at_ms, "tags": c.tags,
        "tiered_at_ms": (c.tiered_at_ms > 0).then_some(c.tiered_at_ms),
        "committed_at_ms": if c.committed_at_ms == 0 { None } else { Some(c.committed_at_ms) },
    })
}

pub async fn ls(
    server: &Remote,
    job: Option<String>,
    all: bool,
    from_tier: Option<&str>,
    out: &Output,
) -> anyhow::Result<()> {
    if let Some(url) = from_tier {
        let job = starckpt_proto::JobName::try_from(job.as_deref().unwrap_or_default())?;
        let tier = starckpt_server::control::tier::Tier::open_existing(url).await?;
        let (checkpoints, skipped) = tier.checkpoints(&job).await?;
        for reason in &skipped {
            eprintln!("skipped: {reason}");
        }
        if checkpoints.is_empty() && !out.json {
            eprintln!("the object-store tier {url} holds no complete checkpoint of {job}");
        }
        print_checkpoints(&checkpoints, out);
        return Ok(());
    }
    let client = connect(server, None).await?;
    match job {
        None => {
            let jobs = client.list_jobs().await?;
            if out.json {
                out.json(json!(
                    jobs.iter()
                        .map(|j| json!({
                            "job": j.job, "committed_checkpoints": j.committed_checkpoints,
                            "latest_step": j.latest_step, "committed_bytes": j.committed_bytes,
                        }))
                        .collect::<Vec<_>>()
                ));
                return Ok(());
            }
            say!("{:<32} {:>12} {:>12} {:>12}", "JOB", "CHECKPOINTS", "LATEST", "SIZE");
            for j in jobs {
                let latest = j.latest_step.map(|s| s.to_string()).unwrap_or_else(|| "-".into());
                say!(
                    "{:<32} {:>12} {:>12} {:>12}",
                    j.job,
                    j.committed_checkpoints,
                    latest,
                    output::bytes(j.committed_bytes)
                );
            }
        }
        Some(job) => {
            let checkpoints = client.list_checkpoints(&job, all).await?;
            if checkpoints.is_empty() && !out.json {
                eprintln!("job {job} has no {}checkpoints", if all { "" } else { "pending or committed " });
            }
            print_checkpoints(&checkpoints, out);
        }
    }
    Ok(())
}

/// A job's checkpoints, as a table or JSON.
fn print_checkpoints(checkpoints: &[CheckpointInfo], out: &Output) {
    if out.json {
        out.json(json!(checkpoints.iter().map(checkpoint_json).collect::<Vec<_>>()));
        return;
    }
    say!(
        "{:>12} {:<10} {:>7} {:>6} {:>12} {:>12} {:>8} {:>16} {:>6}  TAGS",
        "STEP",
        "STATE",
        "RANKS",
        "EPOCH",
        "SIZE",
        "WRITTEN",
        "FILES",
        "CREATED",
        "TIERED"
    );
    for c in checkpoints {
        say!(
            "{:>12} {:<10} {:>7} {:>6} {:>12} {:>12} {:>8} {:>16} {:>6}  {}",
            c.step,
            state_name(c.state),
            format!("{}/{}", c.parts_committed, c.world_size),
            c.epoch,
            output::bytes(c.total_bytes),
            output::bytes(c.written_bytes),
            c.file_count,
            output::age(c.created_at_ms),
            if c.tiered_at_ms > 0 { "yes" } else { "-" },
            c.tags.join(",")
        );
    }
}

pub async fn cat(server: &Remote, job: &str, step: u64, path: &str) -> anyhow::Result<()> {
    let client = connect(server, None).await?;
    let manifest = client.manifest(job, Some(step)).await?;
    match client.copy_file_to(&manifest, path, &mut tokio::io::stdout()).await {
        // The reader went away (`starckpt cat ... | head -c 100`): as SIGPIPE would (`output::line`).
        Err(starckpt_client::Error::Io { path, source, .. })
            if path.as_os_str() == "output" && source.kind() == std::io::ErrorKind::BrokenPipe =>
        {
            std::process::exit(141)
        }
        other => other.map(drop).map_err(Into::into),
    }
}

pub async fn show(server: &Remote, job: &str, step: u64, out: &Output) -> anyhow::Result<()> {
    let client = connect(server, None).await?;
    let manifest = client.manifest(job, Some(step)).await?;
    if out.json {
        out.json(json!({
            "checkpoint": checkpoint_json(&manifest.info),
            "files": manifest.files.iter().map(|f| json!({
                "path": f.path.as_str(), "bytes": f.size_bytes, "mode": f.mode, "chunks": f.chunks.len(),
                "chunk_refs": f.chunks.iter().map(|c| json!({
                    "hash": c.hash.to_hex(), "bytes": c.length_bytes, "replicas": c.replicas,
                })).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "directories": manifest.directories.iter().map(|d| d.as_str()).collect::<Vec<_>>(),
            "metadata": manifest.metadata.iter().map(|(rank, m)| json!({"rank": rank, "metadata": m})).collect::<Vec<_>>(),
        }));
        return Ok(());
    }
    let info = &manifest.info;
    say!(
        "{} step {}: {}, {} ranks, {} in {} files ({} written, the rest deduplicated), committed {}",
        info.job,
        info.step,
        state_name(info.state),
        info.world_size,
        output::bytes(info.total_bytes),
        info.file_count,
        output::bytes(info.written_bytes),
        output::age(info.committed_at_ms)
    );
    for file in &manifest.files {
        let path = output::printable(file.path.as_str());
        say!("  {:>12}  {:>5} chunks  {path}", output::bytes(file.size_bytes), file.chunks.len());
    }
    for dir in &manifest.directories {
        say!("  {:>12}  {:>12}  {}/", "dir", "", output::printable(dir.as_str()));
    }
    Ok(())
}

pub async fn restore(
    server: &Remote,
    job: &str,
    step: Option<u64>,
    to: &Path,
    force: bool,
    from_tier: Option<&str>,
    out: &Output,
) -> anyhow::Result<()> {
    match from_tier {
        None => {
            let client = connect(server, None).await?;
            let concurrency = client.config().restore_concurrency;
            let client = &client;
            client
                .with_manifest(job, step, deleted_meanwhile, |manifest| async move {
                    restore_from(client, &manifest, to, force, concurrency, out).await
                })
                .await
        }
        Some(url) => {
            let name = starckpt_proto::JobName::try_from(job)?;
            let tier = starckpt_server::control::tier::Tier::open_existing(url).await?;
            let manifest = CheckpointManifest::from_response(tier.manifest(&name, step).await?)?;
            // As many chunks in flight as a restore from the cluster.
            let concurrency = ClientConfig::new(&server.server).restore_concurrency;
            restore_from(&TierSource(&tier), &manifest, to, force, concurrency, out).await
        }
    }
}

/// Restoring with no cluster (`starckpt restore --from-tier`): chunks read from the object-store
/// tier (the restore verifies each against its hash and length).
struct TierSource<'a>(&'a starckpt_server::control::tier::Tier);

impl starckpt_client::ChunkSource for TierSource<'_> {
    async fn read_chunk(
        &self,
        manifest: &CheckpointManifest,
        chunk: &starckpt_proto::model::ChunkRef,
    ) -> starckpt_client::Result<bytes::Bytes> {
        let failed = |message: String| starckpt_client::Error::Source {
            hash: chunk.hash,
            from: format!("the object-store tier {}", self.0.url()),
            message,
        };
        match self.0.get_chunk(&manifest.addressing, chunk.hash, chunk.length_bytes).await {
            Ok(Some((bytes, _))) => Ok(bytes),
            Ok(None) => Err(failed("not there".into())),
            Err(message) => Err(failed(message)),
        }
    }
}

/// Whether a restore failed because its checkpoint was deleted while it ran.
fn deleted_meanwhile(error: &anyhow::Error) -> bool {
    matches!(error.downcast_ref::<starckpt_client::Error>(), Some(starckpt_client::Error::Deleted { .. }))
}

/// Restores `manifest` from `source` to `to`, with a progress bar; prints what it did.
async fn restore_from(
    source: &impl starckpt_client::ChunkSource,
    manifest: &CheckpointManifest,
    to: &Path,
    force: bool,
    concurrency: usize,
    out: &Output,
) -> anyhow::Result<()> {
    let job = &manifest.info.job;
    let total = manifest.total_bytes();
    tracing::info!(job, step = manifest.info.step, bytes = total, to = %to.display(), "restoring");
    let bar = output::progress_bar(total, "restoring");
    let progress = Arc::new(starckpt_client::RestoreProgress::default());
    let verified = Arc::clone(&progress);
    let follow = output::follow(&bar, move || verified.verified_bytes.load(std::sync::atomic::Ordering::Relaxed));
    let started = Instant::now();
    // SIGINT or SIGTERM (a preempted launcher) stops the restore: dropping it removes its
    // unfinished tree, which would otherwise sit beside the destination.
    let signal = shutdown_signal();
    let restore = starckpt_client::restore_from(source, manifest, to, RestoreOptions { force }, &progress, concurrency);
    let result = tokio::select! {
        result = restore => result,
        () = signal => {
            drop(follow);
            bar.finish_and_clear();
            anyhow::bail!("restore {job} step {} to {}: interrupted; nothing was restored", manifest.info.step, to.display());
        }
    };
    drop(follow);
    bar.finish_and_clear();
    let outcome = result.with_context(|| format!("restore {job} step {} to {}", manifest.info.step, to.display()))?;
    let elapsed = started.elapsed();
    if out.json {
        out.json(json!({
            "job": job, "step": manifest.info.step, "to": to, "files": outcome.files, "bytes": outcome.bytes,
            "seconds": elapsed.as_secs_f64(),
        }));
    } else {
        say!(
            "restored {job} step {} to {}: {} files, {} in {:.2?} ({}), every chunk verified",
            manifest.info.step,
            to.display(),
            outcome.files,
            output::bytes(outcome.bytes),
            elapsed,
            output::rate(outcome.bytes, elapsed)
        );
    }
    Ok(())
}

pub async fn rm(server: &Remote, job: &str, step: u64) -> anyhow::Result<()> {
    let client = connect(server, None).await?;
    client.delete(job, step).await?;
    say!("deleted {job} step {step}");
    Ok(())
}

fn describe_retention(policy: &RetentionPolicy) -> String {
    let mut rules = Vec::new();
    if policy.keep_last > 0 {
        rules.push(format!("the last {}", policy.keep_last));
    }
    if policy.keep_every > 0 {
        rules.push(format!("every step divisible by {}", policy.keep_every));
    }
    if rules.is_empty() {
        return "keep every checkpoint".into();
    }
    format!("keep {}, tagged checkpoints and the latest", rules.join(", "))
}

pub async fn tier(server: &Remote, out: &Output) -> anyhow::Result<()> {
    let report = connect(server, None).await?.tier().await?;
    if out.json {
        out.json(json!({
            "ran": report.ran, "swept": report.swept, "checkpoints_tiered": report.checkpoints_tiered,
            "checkpoints_behind": report.checkpoints_behind, "chunks_uploaded": report.chunks_uploaded,
            "bytes_uploaded": report.bytes_uploaded, "chunks_present": report.chunks_present,
            "chunks_deleted": report.chunks_deleted, "manifests_deleted": report.manifests_deleted,
            "errors": report.errors, "duration_ms": report.duration_ms,
        }));
        return tier_outcome(&report);
    }
    if !report.ran {
        say!("tier: another control plane is running a pass; none ran here");
        return Ok(());
    }
    say!(
        "tier: {} checkpoints tiered ({} chunks, {} uploaded; {} chunks already there), {} still behind; \
         swept {} chunks and {} manifests in {} ms",
        report.checkpoints_tiered,
        report.chunks_uploaded,
        output::bytes(report.bytes_uploaded),
        report.chunks_present,
        report.checkpoints_behind,
        report.chunks_deleted,
        report.manifests_deleted,
        report.duration_ms
    );
    for error in &report.errors {
        say!("  {error}");
    }
    tier_outcome(&report)
}

/// A pass that left checkpoints untiered, or failed to sweep, fails the command (after its
/// report), so `starckpt tier || alert` alerts.
fn tier_outcome(report: &starckpt_proto::control::TierResponse) -> anyhow::Result<()> {
    if report.ran && !report.errors.is_empty() {
        bail!(
            "the tier pass is incomplete: {} checkpoints still behind, {} errors (listed above)",
            report.checkpoints_behind,
            report.errors.len()
        );
    }
    Ok(())
}

pub async fn import_tier(server: &Remote, job: Option<&str>, out: &Output) -> anyhow::Result<()> {
    let report = connect(server, None).await?.import_tier(job).await?;
    if out.json {
        out.json(json!({
            "imported": report.imported.iter().map(checkpoint_json).collect::<Vec<_>>(),
            "present": report.present, "errors": report.errors,
        }));
    } else {
        for c in &report.imported {
            say!("imported {} step {} ({} ranks, {})", c.job, c.step, c.world_size, output::bytes(c.total_bytes));
        }
        say!(
            "tier import: {} checkpoints imported, {} already here; run `starckpt repair` to copy their chunks onto the targets",
            report.imported.len(),
            report.present
        );
        for error in &report.errors {
            say!("  {error}");
        }
    }
    if !report.errors.is_empty() {
        bail!("{} checkpoints of the tier could not be imported", report.errors.len());
    }
    Ok(())
}

pub async fn repair(server: &Remote, out: &Output) -> anyhow::Result<()> {
    let report = connect(server, None).await?.rereplicate().await?;
    if out.json {
        out.json(json!({
            "chunks": report.chunks, "under_replicated": report.under_replicated,
            "copies_made": report.copies_made, "still_under_replicated": report.still_under_replicated,
            "unreadable": report.unreadable, "from_tier": report.from_tier, "errors": report.errors,
            "duration_ms": report.duration_ms,
        }));
        return repair_outcome(&report);
    }
    say!(
        "re-replication: {} chunks, {} short of copies, {} copies made ({} chunks from the tier), {} still short \
         ({} unreadable) in {} ms",
        report.chunks,
        report.under_replicated,
        report.copies_made,
        report.from_tier,
        report.still_under_replicated,
        report.unreadable,
        report.duration_ms
    );
    for error in &report.errors {
        say!("  {error}");
    }
    repair_outcome(&report)
}

/// Chunks left short of copies (or with none readable) fail the command after its report, so
/// `starckpt repair || alert` alerts.
fn repair_outcome(report: &starckpt_proto::control::RereplicateResponse) -> anyhow::Result<()> {
    if report.still_under_replicated > 0 || report.unreadable > 0 || !report.errors.is_empty() {
        bail!(
            "re-replication is incomplete: {} chunks still short of copies, {} with no readable copy",
            report.still_under_replicated,
            report.unreadable
        );
    }
    Ok(())
}

pub async fn replication(server: &Remote, job: &str, replicas: u32) -> anyhow::Result<()> {
    connect(server, None).await?.set_replication(job, replicas).await?;
    say!("{job}: {replicas} replicas per chunk for saves from now on");
    Ok(())
}

pub async fn retention(
    server: &Remote,
    job: &str,
    keep_last: Option<u32>,
    keep_every: Option<u64>,
    out: &Output,
) -> anyhow::Result<()> {
    let client = connect(server, None).await?;
    let (policy, deleted) = if keep_last.is_none() && keep_every.is_none() {
        (client.retention(job).await?, None)
    } else {
        // A flag left out keeps that rule's current value.
        let current = client.retention(job).await?;
        let policy = RetentionPolicy {
            keep_last: keep_last.unwrap_or(current.keep_last),
            keep_every: keep_every.unwrap_or(current.keep_every),
        };
        (policy, Some(client.set_retention(job, policy).await?))
    };
    if out.json {
        out.json(json!({"job": job, "keep_last": policy.keep_last, "keep_every": policy.keep_every, "deleted_steps": deleted}));
        return Ok(());
    }
    say!("{job}: {}", describe_retention(&policy));
    if let Some(deleted) = deleted.filter(|d| !d.is_empty()) {
        let steps: Vec<String> = deleted.iter().map(u64::to_string).collect();
        say!("deleted steps {} (their chunks are freed by the next garbage collection)", steps.join(", "));
    }
    Ok(())
}

pub async fn tag(server: &Remote, job: &str, step: u64, tag: &str, remove: bool) -> anyhow::Result<()> {
    let client = connect(server, None).await?;
    client.tag(job, step, tag, remove).await?;
    say!(
        "{} {job} step {step} {} {tag:?}",
        if remove { "untagged" } else { "tagged" },
        if remove { "from" } else { "as" }
    );
    Ok(())
}

pub async fn gc(server: &Remote, out: &Output) -> anyhow::Result<()> {
    let client = connect(server, None).await?;
    let report = client.collect_garbage().await?;
    if out.json {
        out.json(json!({
            "live_chunks": report.live_chunks, "targets_swept": report.targets_swept,
            "target_errors": report.target_errors, "chunks_listed": report.chunks_listed,
            "chunks_deleted": report.chunks_deleted, "chunks_in_grace": report.chunks_in_grace,
            "targets_skipped": report.targets_skipped, "duration_ms": report.duration_ms,
        }));
        return gc_outcome(&report);
    }
    say!(
        "swept {} targets in {:.1}s: {} chunks listed, {} live, {} deleted, {} kept within the grace period",
        report.targets_swept,
        report.duration_ms as f64 / 1000.0,
        report.chunks_listed,
        report.live_chunks,
        report.chunks_deleted,
        report.chunks_in_grace
    );
    for error in &report.target_errors {
        say!("  not swept: {error}");
    }
    gc_outcome(&report)
}

/// A live target whose sweep failed fails the command after its report (dead ones are skipped:
/// `starckpt status` and re-replication speak of those).
fn gc_outcome(report: &starckpt_client::GcReport) -> anyhow::Result<()> {
    let failed = report.target_errors.len().saturating_sub(report.targets_skipped as usize);
    if failed > 0 {
        bail!("{failed} live targets could not be swept (listed above)");
    }
    Ok(())
}

pub async fn mount(
    server: &Remote,
    mountpoint: &Path,
    threads: usize,
    config: starckpt_fuse::MountConfig,
) -> anyhow::Result<()> {
    let client = connect(server, None).await?;
    let runtime = tokio::runtime::Handle::current();
    let mounted = starckpt_fuse::mount(client, runtime, mountpoint, config, threads)?;
    let mut signal = std::pin::pin!(shutdown_signal());
    banner(&format!("starckpt mounted at {} (control plane {server})", mountpoint.display()));
    loop {
        tokio::select! {
            _ = &mut signal => break,
            _ = tokio::time::sleep(Duration::from_millis(200)) => {
                if !mounted.is_mounted() {
                    tracing::info!("unmounted from outside");
                    break;
                }
            }
        }
    }
    // The request threads block on this runtime: wait for them off its worker threads.
    tokio::task::spawn_blocking(move || mounted.unmount()).await??;
    Ok(())
}

fn target_state(state: i32) -> &'static str {
    match TargetState::try_from(state) {
        Ok(TargetState::Alive) => "alive",
        Ok(TargetState::Suspect) => "suspect",
        Ok(TargetState::Dead) => "dead",
        _ => "unknown",
    }
}

pub async fn status(server: &Remote, out: &Output) -> anyhow::Result<()> {
    let client = connect(server, None).await?;
    let status = client.cluster_status().await?;
    let targets = status.targets;
    // How this host reaches each alive target (shared memory on the same host, else TCP), asked
    // in parallel and briefly: a hung target must not hang `status`.
    let transports: Vec<&str> = futures::future::join_all(targets.iter().map(|t| async {
        if t.state != TargetState::Alive as i32 {
            return "-";
        }
        match tokio::time::timeout(Duration::from_secs(2), client.transport_kind(t)).await {
            Ok(Ok(kind)) => kind,
            _ => "?",
        }
    }))
    .await;
    if out.json {
        out.json(json!({
            "server": server.server,
            "under_replicated_chunks": status.under_replicated_chunks,
            "repair_pass_age_ms": status.repair_pass_age_ms,
            "targets": targets.iter().zip(&transports).map(|(t, transport)| json!({
                "target_id": t.target_id, "data_address": t.data_address,
                "state": target_state(t.state),
                "capacity_bytes": t.capacity_bytes, "used_bytes": t.used_bytes, "chunks": t.chunk_count,
                "heartbeat_age_ms": t.heartbeat_age_ms, "transport": transport, "failure_domain": t.failure_domain,
                "rdma_device": t.rdma_device,
            })).collect::<Vec<_>>(),
        }));
        return Ok(());
    }
    let alive = targets.iter().filter(|t| t.state == TargetState::Alive as i32).count();
    say!("control plane {server}: {} targets, {alive} alive", targets.len());
    match status.under_replicated_chunks {
        Some(count) => say!(
            "under-replicated chunks: {count} (re-replication pass {:.0}s ago)",
            status.repair_pass_age_ms as f64 / 1000.0
        ),
        None => say!("under-replicated chunks: unknown until the first re-replication pass"),
    }
    say!(
        "{:<38} {:<22} {:<9} {:<10} {:<12} {:<7} {:>10} {:>10} {:>9} {:>10}",
        "TARGET",
        "ADDRESS",
        "TRANSPORT",
        "RDMA",
        "DOMAIN",
        "STATE",
        "USED",
        "CAPACITY",
        "CHUNKS",
        "HEARTBEAT"
    );
    for (t, transport) in targets.iter().zip(&transports) {
        let state = target_state(t.state);
        say!(
            "{:<38} {:<22} {:<9} {:<10} {:<12} {:<7} {:>10} {:>10} {:>9} {:>10}",
            t.target_id,
            t.data_address,
            transport,
            if t.rdma_device.is_empty() { "-" } else { &t.rdma_device },
            if t.failure_domain.is_empty() { "-" } else { &t.failure_domain },
            state,
            output::bytes(t.used_bytes),
            output::bytes(t.capacity_bytes),
            t.chunk_count,
            format!("{:.1}s ago", t.heartbeat_age_ms as f64 / 1000.0)
        );
    }
    Ok(())
}

/// `starckpt token new`: a token for `tenant` (None: an admin's), printed once; its hash added to
/// `tokens_file` (or printed, to add by hand).
pub fn new_token(tenant: Option<&str>, tokens_file: Option<&Path>, out: &Output) -> anyhow::Result<()> {
    use starckpt_server::control::auth::{Caller, TokenTable};
    let caller = match tenant {
        Some(name) => Caller::Tenant(starckpt_proto::TenantName::try_from(name)?),
        None => Caller::Operator,
    };
    let token = starckpt_proto::token::generate();
    let line = TokenTable::line(&caller, &token);
    if let Some(path) = tokens_file {
        append_token_line(path, &line)?;
    }
    if out.json {
        out.json(json!({ "token": token, "line": line, "tokens_file": tokens_file }));
    } else {
        say!("{token}");
        match tokens_file {
            Some(path) => eprintln!("added to {}: {line}", path.display()),
            None => eprintln!("add this line to the control plane's --tokens-file: {line}"),
        }
    }
    Ok(())
}

/// Adds `line` to the tokens file at `path` (made 0600 if missing), durably, after checking that
/// what is there parses: a control plane that cannot parse the file keeps its old tokens.
fn append_token_line(path: &Path, line: &str) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let existing = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(error) => return Err(error).with_context(|| format!("read {}", path.display())),
    };
    starckpt_server::control::auth::TokenTable::parse(&existing)
        .map_err(|e| anyhow::anyhow!("{} does not parse, so nothing was added: {e}", path.display()))?;
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("open {}", path.display()))?;
    let separator = if existing.is_empty() || existing.ends_with('\n') { "" } else { "\n" };
    file.write_all(format!("{separator}{line}\n").as_bytes())
        .and_then(|()| file.sync_all())
        .with_context(|| format!("write {}", path.display()))?;
    Ok(())
}
