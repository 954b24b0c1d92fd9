//! `starckpt`: the one binary. Parses flags, sets up logging, and calls into the libraries.

/// `println!` for command output: a reader that went away (`starckpt ls | head -1`) ends the
/// process quietly, as SIGPIPE ends other tools, instead of a panic (`output::line`).
macro_rules! say {
    () => {
        $crate::output::line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::output::line(format_args!($($arg)*))
    };
}

mod baseline;
mod bench;
mod chart;
mod commands;
mod demo;
mod output;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use starckpt_server::chunkserver::EngineKind;

/// Longest duration a `--*-secs` flag takes: ten years. Far past any useful setting, and far
/// from where adding durations or counting them in milliseconds overflows.
const MAX_SECS: u64 = 10 * 365 * 24 * 3600;

fn parse_draft_writer(text: &str) -> Result<String, String> {
    starckpt_proto::draft::validate_writer(text).map_err(|e| e.to_string())?;
    Ok(text.to_owned())
}

#[derive(Parser)]
#[command(name = "starckpt", version, about = "Checkpoint storage for large-model training")]
struct Cli {
    /// Control-plane address.
    #[arg(long, global = true, env = "STARCKPT_SERVER", default_value = "127.0.0.1:7070")]
    server: String,
    /// PEM file of the CA the control planes' TLS certificates chain to (`starckpt server
    /// --tls-cert`): addresses without a scheme are then dialled over TLS, trusting this CA alone.
    /// Without it, plaintext unless an address says https:// (checked against the system's CAs).
    #[arg(long, global = true, env = "STARCKPT_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// Machine-readable output (listing commands).
    #[arg(long, global = true)]
    json: bool,
    /// More logging (-v info, -vv debug). RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

/// The RDMA device a target serves on (clients read the same variables: `RdmaConfig`). Only
/// builds with the `rdma` feature have ibverbs; without a device the target serves TCP (and
/// shared memory).
#[derive(Args, Clone, Debug)]
pub struct RdmaArgs {
    /// RDMA device name (`ibv_devices`); default: the first one.
    #[arg(long, env = "STARCKPT_RDMA_DEVICE")]
    rdma_device: Option<String>,
    /// Port of the device (from 1).
    #[arg(long, env = "STARCKPT_RDMA_PORT", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..))]
    rdma_port: u8,
    /// GID table index (RoCE v2 is often 1 or 3: `show_gids`).
    #[arg(long, env = "STARCKPT_RDMA_GID_INDEX", default_value_t = 0)]
    rdma_gid_index: u8,
    /// Largest path MTU in bytes (256, 512, 1024, 2048, 4096); default: the port's active MTU.
    #[arg(long, env = "STARCKPT_RDMA_MTU", value_parser = parse_mtu)]
    rdma_mtu: Option<u32>,
    /// Serve no RDMA even if a device is present.
    #[arg(long)]
    no_rdma: bool,
}

fn parse_mtu(text: &str) -> Result<u32, String> {
    match text.parse::<u32>() {
        Ok(mtu) if starckpt_rdma::valid_mtu(mtu) => Ok(mtu),
        _ => Err(format!("{text:?} is not one of 256, 512, 1024, 2048, 4096")),
    }
}

impl RdmaArgs {
    fn target(self) -> starckpt_server::chunkserver::TargetRdma {
        use starckpt_server::chunkserver::TargetRdma;
        if self.no_rdma {
            return TargetRdma::Off;
        }
        TargetRdma::Open(starckpt_rdma::DeviceSettings {
            device: self.rdma_device,
            port: self.rdma_port,
            gid_index: self.rdma_gid_index,
            mtu: self.rdma_mtu,
        })
    }
}

/// Chunk compression of a writing command (see `ClientConfig::compression`).
#[derive(Args, Clone, Debug)]
pub struct CompressArg {
    /// Compress chunks before sending them (zstd over float byte planes, each chunk only if it
    /// shrinks by 5%), at this zstd level (1 if omitted; 1..=19).
    #[arg(long, num_args = 0..=1, default_missing_value = "1", value_name = "LEVEL")]
    pub compress: Option<i32>,
}

impl CompressArg {
    pub fn config(&self) -> anyhow::Result<Option<starckpt_proto::codec::CompressConfig>> {
        match self.compress {
            None => Ok(None),
            Some(level @ 1..=19) => Ok(Some(starckpt_proto::codec::CompressConfig { level, ..Default::default() })),
            Some(level) => anyhow::bail!("--compress level {level} is outside 1..=19"),
        }
    }
}

#[derive(Args, Clone)]
struct JobArg {
    /// Job name.
    #[arg(long, env = "STARCKPT_JOB")]
    job: String,
}

/// Where a service serves its Prometheus metrics (`server/src/telemetry.rs`).
#[derive(clap::Args)]
struct MetricsArg {
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 0.0.0.0:9100). Default: none.
    #[arg(long, env = "STARCKPT_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
}

impl MetricsArg {
    fn serve(&self) -> anyhow::Result<()> {
        self.metrics_listen.map(starckpt_server::telemetry::serve).transpose().map(drop)
    }
}

/// The secret a cluster's control planes and targets share (`starckpt_proto::capability`).
#[derive(clap::Args)]
struct ClusterKeyArg {
    /// File holding the cluster's secret (16 bytes or more; `head -c 32 /dev/urandom`), the same
    /// for its control planes and targets: control planes sign data-plane capabilities with it,
    /// and targets serve only requests carrying one (clients get theirs from the control plane).
    /// Without it a target serves any peer that reaches its port.
    #[arg(long, env = "STARCKPT_CLUSTER_KEY_FILE")]
    cluster_key_file: Option<PathBuf>,
}

impl ClusterKeyArg {
    fn load(&self) -> anyhow::Result<Option<starckpt_proto::capability::ClusterKey>> {
        self.cluster_key_file
            .as_deref()
            .map(starckpt_proto::capability::ClusterKey::from_file)
            .transpose()
            .map_err(anyhow::Error::msg)
    }
}

#[derive(Subcommand)]
enum Command {
    /// Run the control plane.
    Server {
        #[arg(long, default_value = "127.0.0.1:7070")]
        listen: String,
        /// Metadata store: a SQLite file path or sqlite:// URL (embedded), or a
        /// postgres://user:password@host/database URL (PostgreSQL, for HA: several servers may
        /// share one). The environment keeps a password out of the process list.
        #[arg(long, env = "STARCKPT_DB", default_value = "starckpt-meta.db")]
        db: String,
        /// Abort a checkpoint whose ranks have not all committed this many seconds after it began.
        #[arg(long, default_value_t = 1800, value_parser = clap::value_parser!(u64).range(..=MAX_SECS))]
        pending_timeout_secs: u64,
        /// Seconds between background garbage-collection passes (0: only on `starckpt gc`).
        #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(..=MAX_SECS))]
        gc_interval_secs: u64,
        /// GC keeps an unreferenced chunk used within this many seconds (default: twice the
        /// pending timeout; at least the pending timeout + 60).
        #[arg(long, value_parser = clap::value_parser!(u64).range(..=MAX_SECS))]
        gc_grace_secs: Option<u64>,
        /// GC deletes at most this many chunks per second.
        #[arg(long, default_value_t = 2000)]
        gc_deletes_per_sec: u32,
        /// A draft (a checkpoint a mount writes in place) whose mount has not recorded it for
        /// this many hours is forgotten, and its chunks collected: the mount is gone.
        #[arg(long, default_value_t = 168, value_parser = clap::value_parser!(u64).range(1..=MAX_SECS / 3600))]
        draft_ttl_hours: u64,
        /// Seconds between the heartbeats asked of targets. A target silent for two heartbeats
        /// is suspect, for five dead (placement skips both). Longer periods cost the database
        /// fewer writes on clusters of many targets, and leave dead targets in new placements
        /// longer: saves then find them silent themselves and place their copies elsewhere.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=3600))]
        heartbeat_secs: u64,
        /// A target silent this many seconds is lost: the copies it held are made again on live
        /// targets by the re-replication pass.
        #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(..=MAX_SECS))]
        lost_after_secs: u64,
        /// Seconds between background re-replication passes (0: only on `starckpt repair`).
        #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(..=MAX_SECS))]
        repair_interval_secs: u64,
        /// Object-store tier: committed checkpoints are copied to it, and chunks every target
        /// lost are read back from it. s3://BUCKET/PREFIX (AWS_* environment: credentials,
        /// AWS_REGION, AWS_ENDPOINT and AWS_ALLOW_HTTP=true for S3-compatible servers) or
        /// file:///DIR.
        #[arg(long, env = "STARCKPT_TIER")]
        tier: Option<String>,
        /// Seconds between background tier passes (0: only on `starckpt tier`).
        #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(..=MAX_SECS))]
        tier_interval_secs: u64,
        /// Upload pace of the tier, in MiB/s (it competes with saves for the targets' disks).
        #[arg(long, default_value_t = 256)]
        tier_mib_per_sec: u64,
        #[command(flatten)]
        key: ClusterKeyArg,
        /// Serve only callers with a bearer token listed in this file (by hash; `starckpt token
        /// new` adds them), each reaching its tenant's jobs or, with an admin token, every job
        /// and the cluster-wide operations. Read again within seconds of a change. Needs
        /// --cluster-key-file. Without it, every caller is an operator.
        #[arg(long, env = "STARCKPT_TOKENS_FILE")]
        tokens_file: Option<PathBuf>,
        /// Serve gRPC over TLS only, with the certificate chain in this PEM file (the server's
        /// certificate first; it must name the address clients dial). Read again within seconds
        /// of a change, so a renewed certificate needs no restart. Needs --tls-key.
        #[arg(long, env = "STARCKPT_TLS_CERT", requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
        #[arg(long, env = "STARCKPT_TLS_KEY", requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        #[command(flatten)]
        metrics: MetricsArg,
    },
    /// Run a storage target on one device or directory.
    Target {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: String,
        /// Address clients should dial (default: the listen address).
        #[arg(long)]
        advertise: Option<SocketAddr>,
        /// I/O engine: uring (io_uring + O_DIRECT), std (blocking O_DIRECT, for containers whose
        /// seccomp profile blocks io_uring), or auto: uring where this process may use it, else
        /// std with a warning.
        #[arg(long, default_value = "auto")]
        io_engine: EngineKind,
        /// Device operations in flight (per target), 1 to 256, or `auto`: measured on the first
        /// start (writes ~1.5 GiB of chunk files at depths 1 to 32 and takes the smallest within
        /// 10% of the best) and remembered in DIR/queue-depth (delete it to measure again).
        #[arg(long, default_value = "auto")]
        queue_depth: starckpt_server::chunkserver::QueueDepth,
        /// Count chunk ages as if the target had run this many seconds longer. For tests of
        /// garbage collection only.
        #[arg(long, hide = true, default_value_t = 0, value_parser = clap::value_parser!(u64).range(..=MAX_SECS))]
        assume_uptime_secs: u64,
        /// Free bytes to keep on the device: puts that would eat into them are refused (NO_SPACE)
        /// and go to other targets.
        #[arg(long, default_value_t = 256 << 20)]
        reserve_bytes: u64,
        /// Failure domain (host, rack, ...): a chunk's replicas go to distinct domains when there
        /// are enough. Default: a domain of its own.
        #[arg(long, default_value = "")]
        failure_domain: String,
        /// Scrub rate: stored chunks are re-verified at this many MiB/s, and a corrupt copy is
        /// removed (and copied back from another replica). 0 turns scrubbing off.
        #[arg(long, default_value_t = 64)]
        scrub_mib_per_sec: u64,
        /// Pause between scrub passes, in seconds.
        #[arg(long, default_value_t = 3600, value_parser = clap::value_parser!(u64).range(..=MAX_SECS))]
        scrub_pause_secs: u64,
        /// Seconds the device may have operations in flight without completing any before the
        /// target stops heartbeating (and is treated as dead, its chunks copied elsewhere) until
        /// the device completes something again.
        #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=MAX_SECS))]
        io_stall_timeout_secs: u64,
        /// Unix socket where clients on this host attach shared memory (default: DIR/shm.sock).
        #[arg(long, conflicts_with = "no_shm")]
        shm_socket: Option<PathBuf>,
        /// Serve TCP only: same-host clients do not get shared memory.
        #[arg(long)]
        no_shm: bool,
        /// Copy every staged chunk out of a same-host client's staging memory before writing
        /// it, even for clients running as this target's user or root (by default their chunks
        /// are written to the device straight from that memory: they could rewrite the chunk
        /// files anyway).
        #[arg(long, conflicts_with = "no_shm")]
        shm_copy_writes: bool,
        /// Send GET results over TCP zero-copy (io_uring SEND_ZC): auto (on each connection until
        /// the kernel reports it copied anyway, as over loopback), always, or off.
        #[arg(long, default_value = "auto")]
        zero_copy_send: starckpt_dataplane::zerocopy::ZeroCopySend,
        #[command(flatten)]
        rdma: RdmaArgs,
        /// Keep up to SIZE of deleted chunks' files for new chunks to overwrite in place (faster
        /// than allocating new files). Default: a tenth of the filesystem; 0 turns reuse off.
        #[arg(long, value_parser = crate::demo::parse_size)]
        free_pool: Option<u64>,
        /// Fill the free pool with SIZE of chunk files at start, in the background, so the first
        /// checkpoints are written into allocated files too (raises --free-pool to at least SIZE).
        #[arg(long, default_value = "0", value_parser = crate::demo::parse_size)]
        preallocate: u64,
        #[command(flatten)]
        key: ClusterKeyArg,
        #[command(flatten)]
        metrics: MetricsArg,
    },
    /// Run a control plane and N targets in one process, data kept in DIR across restarts.
    Dev {
        #[arg(long, default_value = "starckpt-dev")]
        data: PathBuf,
        #[arg(long, default_value_t = 3)]
        targets: usize,
        #[arg(long, default_value = "127.0.0.1:7070")]
        listen: String,
        /// I/O engine of the targets: uring, std or auto (as `starckpt target --io-engine`).
        #[arg(long, default_value = "auto")]
        io_engine: EngineKind,
        #[command(flatten)]
        metrics: MetricsArg,
    },
    /// Save files or directory trees as (a rank's part of) a checkpoint.
    Save {
        #[command(flatten)]
        job: JobArg,
        #[arg(long)]
        step: u64,
        /// This process's rank, for multi-rank checkpoints.
        #[arg(long, default_value_t = 0)]
        rank: u32,
        #[arg(long, default_value_t = 1)]
        world_size: u32,
        /// The training run this save belongs to, shared by all its ranks (required when world
        /// size > 1). A new run id takes over the job and fences writers of older runs. Default:
        /// torchrun's TORCHELASTIC_RUN_ID/RESTART_COUNT if set, else a fresh run per invocation.
        #[arg(long, env = "STARCKPT_RUN_ID")]
        run_id: Option<String>,
        /// Chunk size (e.g. 4MiB, or bytes).
        #[arg(long, value_parser = crate::demo::parse_size)]
        chunk_size: Option<u64>,
        #[command(flatten)]
        compression: CompressArg,
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// List jobs, or the checkpoints of JOB.
    Ls {
        job: Option<String>,
        /// Include aborted and deleted checkpoints.
        #[arg(long)]
        all: bool,
        /// List JOB's complete checkpoints in this object-store tier instead, with no control
        /// plane (see `restore --from-tier`).
        #[arg(long, value_name = "URL", requires = "job", conflicts_with = "all")]
        from_tier: Option<String>,
    },
    /// Show a checkpoint's files.
    Show { job: String, step: u64 },
    /// Write one file of a checkpoint to stdout, verified.
    Cat { job: String, step: u64, path: String },
    /// Restore a checkpoint into a directory.
    Restore {
        #[command(flatten)]
        job: JobArg,
        #[arg(long, conflicts_with = "step", required_unless_present = "step")]
        latest: bool,
        #[arg(long)]
        step: Option<u64>,
        #[arg(long)]
        to: PathBuf,
        /// Replace a non-empty destination.
        #[arg(long)]
        force: bool,
        /// Read the checkpoint from this object-store tier (`s3://BUCKET/PREFIX`, `file:///DIR`:
        /// the server's `--tier`) alone, with no control plane or target: for when the cluster
        /// is gone. Only checkpoints a tier pass completed are there, and until the next pass
        /// sweeps, also ones the cluster deleted since (`--latest` is then the highest step the
        /// tier holds: `starckpt ls JOB --from-tier URL` lists them).
        #[arg(long, value_name = "URL")]
        from_tier: Option<String>,
    },
    /// Delete a checkpoint (its chunks are freed by the next garbage collection).
    Rm { job: String, step: u64 },
    /// Show JOB's retention policy, or set it with --keep-last / --keep-every (0 turns a rule
    /// off; both 0 keeps everything). Tagged checkpoints and the latest are always kept.
    Retention {
        job: String,
        /// Keep the N most recent checkpoints.
        #[arg(long)]
        keep_last: Option<u32>,
        /// Keep checkpoints whose step is a multiple of K.
        #[arg(long)]
        keep_every: Option<u64>,
    },
    /// Run a re-replication pass now: chunks that lost copies with a lost target (silent for
    /// `--lost-after-secs`) get them back on live targets. Prints the report.
    Repair,
    /// Run an object-store tier pass now: committed checkpoints not yet in the tier are copied
    /// to it, objects no committed checkpoint needs are deleted. Prints the report.
    Tier {
        /// Instead, add the tier's committed checkpoints that the control plane's database lacks
        /// (after losing it): of JOB, or of every job. `starckpt repair` then copies their chunks
        /// back onto the targets.
        #[arg(long)]
        import: bool,
        #[arg(long, requires = "import")]
        job: Option<String>,
    },
    /// Set JOB's replication factor: copies of every chunk its saves make from now on, on
    /// distinct targets and failure domains (default 2; capped by the live targets).
    Replication { job: String, replicas: u32 },
    /// Tag a committed checkpoint (retention never deletes it), or untag it with --remove.
    Tag {
        job: String,
        step: u64,
        tag: String,
        #[arg(long)]
        remove: bool,
    },
    /// Run a garbage-collection pass now: free chunks no retained or in-flight checkpoint needs.
    Gc,
    /// Mount the checkpoints as a filesystem at MOUNTPOINT (e.g. /ckpt) until SIGTERM/SIGINT or
    /// `fusermount3 -u MOUNTPOINT`. Layout and rules: `fuse/src/lib.rs`.
    Mount {
        mountpoint: PathBuf,
        /// Threads serving requests.
        #[arg(long, default_value_t = 4)]
        threads: usize,
        /// Chunks read ahead of a sequential reader.
        #[arg(long, default_value_t = 8)]
        read_ahead_chunks: usize,
        /// Memory the read-ahead of all open files together may hold (e.g. 256MiB, 1GiB).
        #[arg(long, default_value = "256MiB", value_parser = crate::demo::parse_size)]
        read_ahead_budget: u64,
        /// Local directory holding a copy of each file being written until its checkpoint
        /// commits (seeks back, pre-sized files, reads of a draft). Default: the system's
        /// temporary directory. Its files are unlinked from the moment they are made.
        #[arg(long, env = "STARCKPT_SPILL_DIR")]
        spill_dir: Option<PathBuf>,
        /// Bytes the spill directory may hold for this mount (e.g. 64GiB).
        #[arg(long, default_value = "64GiB", value_parser = crate::demo::parse_size)]
        spill_limit: u64,
        /// The name this mount records its drafts (the closed files of checkpoints being
        /// written in place) under at the control plane: a mount started again with the same
        /// name, on any host, gets them back. Default: <host>:<mount point>.
        #[arg(long, env = "STARCKPT_DRAFT_WRITER", value_parser = parse_draft_writer)]
        draft_writer: Option<String>,
    },
    /// Targets, their capacity and health.
    Status,
    /// Make a bearer token for a control plane's tokens file (`starckpt server --tokens-file`):
    /// prints the token once (give it to its user: STARCKPT_TOKEN or STARCKPT_TOKEN_FILE) and adds
    /// its hash to FILE, which control planes read again within seconds.
    Token {
        #[command(subcommand)]
        action: TokenAction,
    },
    /// Start a throwaway cluster, save a multi-GB synthetic state at a few steps, simulate a
    /// preemption, restore the latest, verify it, and print timings against raw disk and memory.
    Demo(demo::DemoArgs),
    /// Measure starckpt against the hardware and torch.save on the same bytes and disk: a
    /// synthetic mixed-precision Adam state from N ranks; blocking, committed and restore times
    /// beside memcpy, O_DIRECT write/read and buffered write+fsync; a table, --json, --chart PNG.
    Bench(bench::BenchArgs),
}

#[derive(Subcommand)]
enum TokenAction {
    /// A new token, for one tenant's jobs or (--admin) for an operator.
    New {
        /// The tenant whose jobs the token reaches (letters, digits, '.', '_', '-').
        #[arg(long, required_unless_present = "admin", conflicts_with = "admin")]
        tenant: Option<String>,
        /// An operator's token: every job (tenants' ones as TENANT/JOB) and the cluster-wide
        /// operations (gc, repair, tier).
        #[arg(long)]
        admin: bool,
        /// The tokens file to add it to (made, readable by its owner only, if missing). Without
        /// it, the line to add is printed to stderr.
        #[arg(long, env = "STARCKPT_TOKENS_FILE")]
        tokens_file: Option<PathBuf>,
    },
}

fn init_logging(verbose: u8, default: &str) {
    let level = match verbose {
        0 => default,
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    // Colours only on a terminal: logs collected from a file, a pipe or a container runtime stay
    // plain text that grep and log shippers read.
    use std::io::IsTerminal;
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).init();
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_level = match cli.command {
        Command::Server { .. } | Command::Target { .. } | Command::Dev { .. } | Command::Mount { .. } => "info",
        // The demo kills its own cluster on purpose; the warnings that provokes are expected.
        Command::Demo(_) | Command::Bench(_) => "error",
        _ => "warn",
    };
    init_logging(cli.verbose, default_level);
    // Fault points for the crash matrix (test builds only; a no-op otherwise).
    if let Err(error) = starckpt_client::faults::setup() {
        eprintln!("error: {error}");
        return ExitCode::FAILURE;
    }
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", describe(&error));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, skipping a cause whose text the line already holds (our
/// error types print their source in their own message).
fn describe(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let cause = cause.to_string();
        if text.contains(&cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let out = output::Output { json: cli.json };
    let remote = commands::Remote { server: cli.server.clone(), tls_ca: cli.tls_ca.clone() };
    match cli.command {
        Command::Server {
            listen,
            db,
            pending_timeout_secs,
            gc_interval_secs,
            gc_grace_secs,
            gc_deletes_per_sec,
            draft_ttl_hours,
            heartbeat_secs,
            lost_after_secs,
            repair_interval_secs,
            tier,
            tier_interval_secs,
            tier_mib_per_sec,
            key,
            tokens_file,
            tls_cert,
            tls_key,
            metrics,
        } => {
            metrics.serve()?;
            let pending_timeout = pending_timeout_secs.max(1);
            let args = commands::ServerArgs {
                pending_timeout: Duration::from_secs(pending_timeout),
                gc_interval: (gc_interval_secs > 0).then(|| Duration::from_secs(gc_interval_secs)),
                gc_grace: Duration::from_secs(
                    gc_grace_secs.unwrap_or(pending_timeout.saturating_mul(2).max(pending_timeout + 60)),
                ),
                gc_deletes_per_sec,
                draft_ttl: Duration::from_secs(draft_ttl_hours * 3600),
                heartbeat_interval: Duration::from_secs(heartbeat_secs),
                lost_after: Duration::from_secs(lost_after_secs),
                repair_interval: (repair_interval_secs > 0).then(|| Duration::from_secs(repair_interval_secs)),
                tier,
                tier_interval: (tier_interval_secs > 0).then(|| Duration::from_secs(tier_interval_secs)),
                tier_bytes_per_sec: tier_mib_per_sec
                    .max(1)
                    .checked_mul(1 << 20)
                    .ok_or_else(|| anyhow::anyhow!("--tier-mib-per-sec {tier_mib_per_sec} is out of range"))?,
                cluster_key: key.load()?,
                tokens: tokens_file
                    .as_deref()
                    .map(starckpt_server::control::auth::Tokens::load)
                    .transpose()
                    .map_err(anyhow::Error::msg)?
                    .map(std::sync::Arc::new),
                tls: match (tls_cert, tls_key) {
                    (Some(cert), Some(key)) => Some(
                        starckpt_server::control::tls::ServerTls::load(starckpt_server::control::tls::TlsFiles {
                            cert,
                            key,
                        })
                        .map_err(anyhow::Error::msg)?,
                    ),
                    _ => None,
                },
            };
            commands::server(&listen, &db, args).await
        }
        Command::Target {
            dir,
            listen,
            advertise,
            io_engine,
            queue_depth,
            assume_uptime_secs,
            reserve_bytes,
            failure_domain,
            scrub_mib_per_sec,
            scrub_pause_secs,
            io_stall_timeout_secs,
            shm_socket,
            no_shm,
            shm_copy_writes,
            zero_copy_send,
            rdma,
            free_pool,
            preallocate,
            key,
            metrics,
        } => {
            metrics.serve()?;
            let mut config = starckpt_server::chunkserver::TargetConfig::new(dir, cli.server.clone());
            config.control_tls = starckpt_proto::tls::ControlTls::from_optional_file(cli.tls_ca.as_deref())
                .map_err(anyhow::Error::msg)?;
            config.rdma = rdma.target();
            if no_shm {
                config.shm_socket = None;
            } else if shm_socket.is_some() {
                config.shm_socket = shm_socket;
            }
            config.shm_placed_writes = !shm_copy_writes;
            config.advertise = advertise;
            config.limits.zero_copy_send = zero_copy_send;
            config.engine = io_engine;
            config.queue_depth = queue_depth;
            config.assumed_uptime = Duration::from_secs(assume_uptime_secs);
            config.reserve_bytes = reserve_bytes;
            config.failure_domain = failure_domain;
            config.free_pool_bytes = free_pool;
            config.preallocate_bytes = preallocate;
            config.cluster_key = key.load()?;
            config.io_stall_timeout = Duration::from_secs(io_stall_timeout_secs);
            config.scrub = starckpt_server::chunkserver::scrub::ScrubConfig {
                bytes_per_second: scrub_mib_per_sec.saturating_mul(1 << 20),
                pause: Duration::from_secs(scrub_pause_secs),
            };
            commands::target(config, &listen).await
        }
        Command::Dev { data, targets, listen, io_engine, metrics } => {
            metrics.serve()?;
            commands::dev(&data, targets, &listen, io_engine).await
        }
        Command::Save { job, step, rank, world_size, run_id, chunk_size, compression, paths } => {
            let compression = compression.config()?;
            let chunk_size = chunk_size
                .map(usize::try_from)
                .transpose()
                .map_err(|_| anyhow::anyhow!("--chunk-size is too large"))?;
            let args =
                commands::SaveArgs { job: job.job, step, rank, world_size, run_id, chunk_size, compression, paths };
            commands::save(&remote, args, &out).await
        }
        Command::Ls { job, all, from_tier } => commands::ls(&remote, job, all, from_tier.as_deref(), &out).await,
        Command::Show { job, step } => commands::show(&remote, &job, step, &out).await,
        Command::Cat { job, step, path } => commands::cat(&remote, &job, step, &path).await,
        Command::Restore { job, latest: _, step, to, force, from_tier } => {
            commands::restore(&remote, &job.job, step, &to, force, from_tier.as_deref(), &out).await
        }
        Command::Rm { job, step } => commands::rm(&remote, &job, step).await,
        Command::Retention { job, keep_last, keep_every } => {
            commands::retention(&remote, &job, keep_last, keep_every, &out).await
        }
        Command::Replication { job, replicas } => commands::replication(&remote, &job, replicas).await,
        Command::Tag { job, step, tag, remove } => commands::tag(&remote, &job, step, &tag, remove).await,
        Command::Gc => commands::gc(&remote, &out).await,
        Command::Repair => commands::repair(&remote, &out).await,
        Command::Tier { import: false, .. } => commands::tier(&remote, &out).await,
        Command::Tier { import: true, job } => commands::import_tier(&remote, job.as_deref(), &out).await,
        Command::Mount {
            mountpoint,
            threads,
            read_ahead_chunks,
            read_ahead_budget,
            spill_dir,
            spill_limit,
            draft_writer,
        } => {
            let defaults = starckpt_fuse::MountConfig::default();
            let config = starckpt_fuse::MountConfig {
                read_ahead_chunks,
                read_ahead_budget,
                spill_dir: spill_dir.unwrap_or(defaults.spill_dir.clone()),
                spill_limit_bytes: spill_limit,
                draft_writer,
                ..defaults
            };
            commands::mount(&remote, &mountpoint, threads, config).await
        }
        Command::Status => commands::status(&remote, &out).await,
        Command::Token { action: TokenAction::New { tenant, admin: _, tokens_file } } => {
            commands::new_token(tenant.as_deref(), tokens_file.as_deref(), &out)
        }
        Command::Demo(args) => demo::run(args).await,
        Command::Bench(args) => bench::run(args, cli.json).await,
    }
}
