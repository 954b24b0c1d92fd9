//! The starckpt client SDK.
//!
//! A trainer saves a checkpoint part asynchronously (the call returns once the bytes are staged in
//! SDK-owned buffers; chunking, hashing, deduplication and upload continue in the background),
//! finds the latest committed checkpoint after a preemption in one call, and restores it with
//! every chunk verified against its BLAKE3 hash.
//!
//! ```no_run
//! # async fn demo() -> Result<(), starckpt_client::Error> {
//! use starckpt_client::{Client, ClientConfig, SavePart};
//!
//! let client = Client::connect(ClientConfig::new("127.0.0.1:7070")).await?;
//! let part = SavePart::new("llama", 100)
//!     .buffer("model/weights.bin", bytes::Bytes::from(vec![0u8; 1 << 20]))?;
//! let handle = client.save(part).await?;      // returns once staged
//! let outcome = handle.wait().await?;         // committed
//! assert!(outcome.committed());
//!
//! let latest = client.latest("llama").await?.expect("one checkpoint");
//! let manifest = client.manifest("llama", Some(latest.step)).await?;
//! let weights = client.read_file(&manifest, "model/weights.bin").await?;
//! client.restore(&manifest, std::path::Path::new("/tmp/llama-100"), Default::default()).await?;
//! # Ok(()) }
//! ```

mod control;
mod drafts;
mod error;
mod host_staging;
mod manager;
mod recovery;
mod restore;
mod save;
mod stream;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use starckpt_dataplane::buf::BufPool;
use starckpt_proto::JobName;
use starckpt_proto::control::{self as pb};

use crate::sync::LockExt;
use control::{Control, ControlPlanes, Resend};
pub use drafts::{DraftInfo, JobFileInfo};
pub use error::{Error, Result};
pub use manager::{CheckpointManager, CheckpointPolicy, FinalReport, IfBusy, preemption_signal};
pub use restore::{CheckpointManifest, ChunkSource, RestoreOptions, RestoreOutcome, RestoreProgress, restore_from};
pub use save::{
    CommitState, FillFn, Lent, SaveHandle, SaveItem, SaveOutcome, SavePart, SaveProgress, items_from_paths,
};
/// The data plane (`starckpt-dataplane`), as the SDK's own modules.
pub use starckpt_dataplane::{faults, placement, sync, transport};
pub use starckpt_proto::control::{
    CheckpointInfo, CheckpointState, CollectGarbageResponse as GcReport, JobInfo, RetentionPolicy, TargetInfo,
    TargetState,
};
pub use stream::{PARTIALS_WAIT, StreamedFile, StreamingFile};
use transport::{AutoTransport, ChunkTransport, RdmaClient, RdmaConfig, ShmConfig, TcpConfig};

/// Client configuration. Every field has a default chosen for one trainer process on a host with
/// tens of GB of memory; see each field.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Control-plane address, `host:port` or URL.
    pub server: String,
    /// Chunk size. Default 4 MiB: per-chunk costs (a round trip, a device sync, ~100 bytes of
    /// manifest) stay under ~5% of transfer time, and one tensor file still spreads over targets.
    /// From [`MIN_CHUNK_SIZE_BYTES`] (64 KiB) to 64 MiB.
    pub chunk_size_bytes: usize,
    /// Staging memory: the most bytes a save holds in SDK buffers at once. Default 1 GiB. A save
    /// larger than this returns once its last byte is staged, which waits for earlier chunks to
    /// upload; memory never grows past it.
    pub staging_bytes: usize,
    /// Threads copying a save's bytes into staging buffers. Default: one per 4 available cores,
    /// 1..=4. A second copy thread pays only where cores are idle while the previous chunks upload:
    /// on the 2-core development VMs it raised the demo's stall from ~1.3x to ~2x a memcpy, because
    /// it competed with hashing and the in-process targets.
    pub staging_threads: usize,
    /// Hash and upload chunks while the rest of the save is still being copied into staging,
    /// instead of once the copy is done (or the pool runs out). It shortens the time to commit
    /// by up to the copy time, and lengthens the copy the trainer waits for wherever hashing and
    /// sending compete with it for cores or memory bandwidth. Default: on with 8 or more
    /// available cores. Measured on a 2-core VM (`starckpt bench --size 2GiB`, same run): off,
    /// stall 1.08x a memcpy and committed 1.57x the O_DIRECT write; on, 1.56x and 1.33x.
    pub upload_during_staging: bool,
    /// While uploads wait for staging (`upload_during_staging` off), they also wait for the other
    /// saves staging on this host (the job's other ranks), coordinated through a `flock` on this
    /// file, 30 s at most (`host_staging.rs`). Default `/dev/shm/starckpt-staging.lock`; None:
    /// each save waits for its own staging only.
    pub host_staging_lock: Option<std::path::PathBuf>,
    /// Chunks uploading at once per save. Default 16 (64 MiB in flight at 4 MiB chunks): enough to
    /// keep several targets at queue depth 4+.
    pub upload_concurrency: usize,
    /// Chunks fetched at once per restore. Default 16.
    pub restore_concurrency: usize,
    /// Deadline of each control-plane call, its whole answer included. Default 30 s.
    pub rpc_timeout: Duration,
    /// Deadline of a pass over the cluster run at the control plane on request (GC,
    /// re-replication, a tier pass, importing from the tier): one that outlasts it goes on there
    /// while the call fails. Default 1 h.
    pub pass_timeout: Duration,
    /// How long a call keeps failing over between the control planes of `server` (or waiting for
    /// the only one to come back) before its error is returned, from its first failure; see
    /// `control.rs`. Default 60 s: a supervisor restarts a control plane well within it.
    pub failover_timeout: Duration,
    /// The training run this client writes for, shared by all its ranks; decides the writer
    /// lease epoch (see `AcquireLeaseRequest` in control.proto). Default: `STARCKPT_RUN_ID`, else
    /// torchrun's `TORCHELASTIC_RUN_ID` and `TORCHELASTIC_RESTART_COUNT` (a restart is a new
    /// run), else a fresh id for this client alone, which suits single-process trainers: every
    /// restart of the process is then a new run that fences the previous one. Each launch needs
    /// its own: a relaunch under the run id of the launch before joins that launch's unfinished
    /// checkpoint (the control plane aborts it only when a rank of both launches commits
    /// different content before its last part is in).
    pub run_id: Option<String>,
    /// Copies of each chunk of a streamed file ([`Client::streaming_file`], the FUSE mount's
    /// writes), whose job is unknown until commit. Default 2, the control plane's default
    /// replication factor. (Saves use their job's factor, which the control plane sends.)
    pub stream_replicas: u32,
    /// Compress chunks before they travel (lossless; floats split into byte planes, see
    /// `starckpt_proto::codec`), each chunk only if it shrinks by `min_ratio`. Default off:
    /// compression costs client CPU per byte, and pays where the network or the targets' disks are
    /// slower than the client's cores compress (`starckpt bench --compress` measures both).
    pub compression: Option<starckpt_proto::codec::CompressConfig>,
    pub tcp: TcpConfig,
    /// Shared memory with targets on this host (`transport/shm.rs`): on by default, TCP where
    /// it is not available.
    pub shm: ShmConfig,
    /// RDMA with targets that serve it (`transport/rdma.rs`): used when this client has a device
    /// (builds with the `rdma` feature on a host with one, or a device given here); TCP otherwise.
    pub rdma: RdmaConfig,
    /// The bearer token sent with every control-plane call, for a control plane that requires
    /// one (`starckpt server --tokens-file`; `starckpt token new` makes one): it decides whose
    /// jobs this client reaches. Default: `$STARCKPT_TOKEN`. None: no token, which is all a
    /// control plane without tokens needs.
    pub token: Option<String>,
    /// A file holding the token (read once, at connect; surrounding whitespace ignored), used
    /// when `token` is None: keeps the token out of the environment and the process list.
    /// Default: `$STARCKPT_TOKEN_FILE`.
    pub token_file: Option<std::path::PathBuf>,
    /// A PEM file of the CA that the control planes' TLS certificates chain to (`starckpt server
    /// --tls-cert`): addresses without a scheme are then dialled over TLS, trusting that CA
    /// alone (`starckpt_proto::tls`). Default: `$STARCKPT_TLS_CA`. None: plaintext, unless an
    /// address says `https://` (verified against the system's trust store).
    pub tls_ca: Option<std::path::PathBuf>,
}

impl ClientConfig {
    pub fn new(server: impl Into<String>) -> ClientConfig {
        ClientConfig {
            server: server.into(),
            chunk_size_bytes: 4 << 20,
            staging_bytes: 1 << 30,
            staging_threads: std::thread::available_parallelism().map_or(1, |n| (n.get() / 4).clamp(1, 4)),
            upload_during_staging: std::thread::available_parallelism().is_ok_and(|n| n.get() >= 8),
            host_staging_lock: host_staging::default_path(),
            upload_concurrency: 16,
            restore_concurrency: 16,
            rpc_timeout: Duration::from_secs(30),
            pass_timeout: Duration::from_secs(3600),
            failover_timeout: Duration::from_secs(60),
            tcp: TcpConfig::default(),
            run_id: run_id_from_env(),
            stream_replicas: 2,
            compression: None,
            shm: ShmConfig::default(),
            rdma: RdmaConfig::default(),
            token: std::env::var("STARCKPT_TOKEN").ok().filter(|t| !t.is_empty()),
            token_file: std::env::var_os("STARCKPT_TOKEN_FILE").filter(|p| !p.is_empty()).map(Into::into),
            tls_ca: std::env::var_os("STARCKPT_TLS_CA").filter(|p| !p.is_empty()).map(Into::into),
        }
    }
}

/// The capability the client's data-plane requests carry, asked of the control plane when the
/// first request needs it and again at half its life (`starckpt_proto::capability`). A control
/// plane that does not know the call has no key to sign with.
fn data_capability(control: Arc<ControlPlanes>) -> transport::Credentials {
    const SHORTEST_LIFE: Duration = Duration::from_secs(10);
    transport::Credentials::asked(Box::new(move || {
        let control = Arc::clone(&control);
        Box::pin(async move {
            let request = pb::DataCapabilityRequest {};
            let asked = control.call("data capability", Resend::Idempotent, request, |mut c, r| async move {
                c.data_capability(r).await
            });
            match asked.await {
                Ok(answer) => {
                    // An answer without a lifetime (or an absurdly short one) is held at least
                    // SHORTEST_LIFE: never a control-plane call per request.
                    let lifetime = match answer.lifetime_ms {
                        0 => Duration::from_millis(
                            answer
                                .expires_unix_ms
                                .saturating_sub(starckpt_proto::capability::unix_ms(std::time::SystemTime::now())),
                        ),
                        ms => Duration::from_millis(ms),
                    };
                    Ok((answer.capability, lifetime.max(SHORTEST_LIFE)))
                }
                Err(status) if status.code() == tonic::Code::Unimplemented => Ok((bytes::Bytes::new(), Duration::ZERO)),
                Err(status) => Err(format!("data capability: {}", status.message())),
            }
        })
    }))
}

/// The RDMA device `config` asks for, if enabled and present (a missing one means TCP, logged);
/// malformed settings are an error.
fn rdma_device(config: &RdmaConfig) -> Result<Option<Arc<dyn starckpt_rdma::Verbs>>> {
    if !config.enabled {
        return Ok(None);
    }
    if let Some(device) = &config.device {
        return Ok(Some(Arc::clone(device)));
    }
    let settings = match &config.settings {
        Some(settings) => settings.clone(),
        None => starckpt_rdma::DeviceSettings::from_env().map_err(Error::InvalidInput)?,
    };
    Ok(match starckpt_rdma::open(&settings) {
        Ok(device) => {
            tracing::info!(device = %device.name(), "RDMA device opened");
            Some(device)
        }
        Err(error) => {
            tracing::debug!(%error, "no RDMA; using shared memory or TCP");
            None
        }
    })
}

/// The run id the environment names, if any: `STARCKPT_RUN_ID`, else torchrun's run id and
/// restart count.
pub fn run_id_from_env() -> Option<String> {
    let var = |name| std::env::var(name).ok().filter(|v: &String| !v.is_empty());
    var("STARCKPT_RUN_ID").or_else(|| {
        let run = var("TORCHELASTIC_RUN_ID")?;
        Some(format!("{run}/{}", var("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into())))
    })
}

/// When this process started, in Unix milliseconds (`/proc/self/stat`, or else when this was
/// first asked): a lease is refused to a new run that started before the run holding it.
pub fn process_started_at_ms() -> u64 {
    static STARTED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *STARTED.get_or_init(|| {
        proc_started_at_ms().unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
        })
    })
}

/// Boot time (`/proc/stat` btime) plus the process's start in clock ticks after it (field 22 of
/// `/proc/self/stat`).
fn proc_started_at_ms() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let after_name = stat.rsplit_once(')')?.1;
    // Fields from 3 on follow the command name: starttime is field 22.
    let ticks: u64 = after_name.split_whitespace().nth(22 - 3)?.parse().ok()?;
    let boot = std::fs::read_to_string("/proc/stat").ok()?;
    let btime: u64 = boot.lines().find_map(|line| line.strip_prefix("btime "))?.trim().parse().ok()?;
    // SAFETY: sysconf reads a constant of the system.
    let per_second = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).ok().filter(|&t| t > 0)?;
    Some(btime * 1000 + ticks * 1000 / per_second)
}

/// Data-plane transports by target id, rebuilt when a target's address changes.
/// A target's current data address and the transport dialled to it.
type KnownTarget = (String, Arc<dyn ChunkTransport>);

#[derive(Default)]
struct Targets {
    by_id: Mutex<HashMap<String, KnownTarget>>,
    /// Targets a read or a write could not reach (no connection, no answer in time), and when:
    /// their copies are tried last, and saves place copies elsewhere first, for
    /// [`UNREACHABLE_FOR`], so a target that is down costs a reader or a save one deadline rather
    /// than one per chunk.
    unreachable: Mutex<HashMap<String, std::time::Instant>>,
    /// This client's usual time to read a chunk, in µs: a moving average of verified reads.
    read_micros: std::sync::atomic::AtomicU64,
    /// This client's RDMA device and registrations, if it has a device.
    rdma: Option<Arc<RdmaClient>>,
    /// The staging pool's shared region, passed to targets on this host.
    staging: Option<Arc<starckpt_dataplane::shm::Region>>,
}

/// How long a target a read could not reach has its copies tried last.
const UNREACHABLE_FOR: std::time::Duration = std::time::Duration::from_secs(30);
/// A read of a chunk with another replica to go to waits this many times the client's usual
/// read time for its first replica ([`Targets::read_patience`])...
const READ_PATIENCE_FACTOR: u32 = 4;
/// ... and at least this long: below it, differences are queueing noise, not a sick target.
const READ_PATIENCE_MIN: std::time::Duration = std::time::Duration::from_secs(1);

impl Targets {
    /// Notes whether a read or a write reached `target_id`. True when it newly did not (not
    /// already within [`UNREACHABLE_FOR`]): [`Client::reached`] reports that.
    fn reached(&self, target_id: &str, reached: bool) -> bool {
        let mut unreachable = self.unreachable.lock_unpoisoned();
        if reached {
            unreachable.remove(target_id);
            false
        } else {
            let before = unreachable.insert(target_id.to_owned(), std::time::Instant::now());
            before.is_none_or(|since| since.elapsed() >= UNREACHABLE_FOR)
        }
    }

    /// Notes what the control plane says of the targets: one it lists suspect or dead is tried
    /// last, as if this client had found it silent itself.
    fn heard_of(&self, targets: &[TargetInfo]) {
        let now = std::time::Instant::now();
        let mut unreachable = self.unreachable.lock_unpoisoned();
        for target in targets.iter().filter(|t| t.state != pb::TargetState::Alive as i32) {
            unreachable.insert(target.target_id.clone(), now);
        }
    }

    /// Notes how long a verified chunk read took, for [`Targets::read_patience`].
    fn read_took(&self, took: std::time::Duration) {
        use std::sync::atomic::Ordering;
        let sample = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        // An average over the last ~8 reads: a slow stretch of the disk moves it within a few
        // chunks, one outlier does not.
        let _ = self.read_micros.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
            Some(if old == 0 { sample } else { old - old / 8 + sample / 8 })
        });
    }

    /// How long a read waits for one replica when another could be read instead.
    fn read_patience(&self) -> std::time::Duration {
        let usual = std::time::Duration::from_micros(self.read_micros.load(std::sync::atomic::Ordering::Relaxed));
        (usual * READ_PATIENCE_FACTOR).max(READ_PATIENCE_MIN)
    }

    /// Whether a read or a write failed to reach `target_id` within [`UNREACHABLE_FOR`].
    fn unreachable(&self, target_id: &str) -> bool {
        let unreachable = self.unreachable.lock_unpoisoned();
        unreachable.get(target_id).is_some_and(|since| since.elapsed() < UNREACHABLE_FOR)
    }

    fn transport(&self, target_id: &str, address: &str, config: &ClientConfig) -> Result<Arc<dyn ChunkTransport>> {
        let mut map = self.by_id.lock_unpoisoned();
        if let Some((known, transport)) = map.get(target_id)
            && known == address
        {
            return Ok(Arc::clone(transport));
        }
        let socket: SocketAddr = address
            .parse()
            .map_err(|_| Error::InvalidInput(format!("target {target_id} advertises a bad address {address:?}")))?;
        let transport: Arc<dyn ChunkTransport> = Arc::new(AutoTransport::new(
            socket,
            target_id,
            config.tcp.clone(),
            config.shm.clone(),
            config.chunk_size_bytes,
            self.staging.clone(),
            self.rdma.clone(),
        ));
        map.insert(target_id.to_owned(), (address.to_owned(), Arc::clone(&transport)));
        Ok(transport)
    }
}

struct Inner {
    config: ClientConfig,
    run_id: String,
    /// False when the run id was made up for this client: fine for one process, wrong for a
    /// multi-rank save (each rank would be its own run and fence the others).
    run_id_shared: bool,
    /// Epoch of this run's lease, per job, taken once.
    leases: tokio::sync::Mutex<HashMap<String, u64>>,
    /// One save uploads at a time per client; held from staging until commit.
    upload_slot: Arc<tokio::sync::Semaphore>,
    control: Arc<ControlPlanes>,
    staging: BufPool,
    /// Staging buffers holding the last, partial chunk of a file being streamed (`stream.rs`).
    streaming_partials: Arc<std::sync::atomic::AtomicUsize>,
    targets: Targets,
    /// Read repairs queued or running in the background (see `read_chunk`), and those running.
    repairs: Arc<tokio::sync::Semaphore>,
    repairs_running: Arc<tokio::sync::Semaphore>,
    /// Chunks no target had, queued for the control plane to recover (`recovery.rs`).
    recoveries: recovery::Recoveries,
}

/// Smallest chunk a client cuts: below it a checkpoint's chunk count (its manifest, staging
/// slots, requests) grows past use, and a save of a few GB would upload for hours.
pub const MIN_CHUNK_SIZE_BYTES: usize = 64 << 10;

/// Most read repairs a client holds at once, queued or running (each holds one chunk in memory);
/// more are skipped (a later read, or the target's scrub, finds the copy again).
pub const REPAIRS_IN_FLIGHT: usize = 32;
/// Most read repairs sent at once.
const REPAIRS_RUNNING: usize = 4;

/// A connection to a starckpt cluster. Cheap to clone; clones share connections and the staging
/// pool.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl Client {
    /// Connects to the control plane, failing fast if it is unreachable. `config.server` may list
    /// several control planes of one cluster (`a:7070,b:7070`, sharing a PostgreSQL database):
    /// the first that answers is used.
    pub async fn connect(mut config: ClientConfig) -> Result<Client> {
        let chunk_sizes = MIN_CHUNK_SIZE_BYTES..=starckpt_proto::frame::MAX_PAYLOAD_BYTES as usize;
        if !chunk_sizes.contains(&config.chunk_size_bytes) {
            return Err(Error::InvalidInput(format!(
                "chunk size {} is outside {}..={} bytes",
                config.chunk_size_bytes,
                chunk_sizes.start(),
                chunk_sizes.end()
            )));
        }
        let control = Arc::new(ControlPlanes::connect(&config).await?);
        config.tcp.credentials = data_capability(Arc::clone(&control));
        let buffers = (config.staging_bytes / config.chunk_size_bytes).max(1);
        // In a memfd when shared memory is on, so targets on this host read staged chunks where
        // they lie; on the heap if the memfd cannot be made (a sandbox without memfd_create).
        let staging = match config.shm.enabled {
            true => BufPool::shared("starckpt-staging", config.chunk_size_bytes, buffers).unwrap_or_else(|error| {
                tracing::warn!(%error, "staging memory not shareable; shared-memory PUTs copy through slots");
                BufPool::new(config.chunk_size_bytes, buffers)
            }),
            false => BufPool::new(config.chunk_size_bytes, buffers),
        };
        // A device whose receive region cannot be registered (a memlock limit) means TCP.
        let rdma = rdma_device(&config.rdma)?.and_then(|verbs| {
            RdmaClient::new(verbs, &staging, config.rdma.slots, config.chunk_size_bytes)
                .inspect_err(|error| tracing::warn!(%error, "RDMA receive memory not registered; using TCP"))
                .ok()
        });
        let shared_staging = staging.arena().cloned();
        let (run_id, run_id_shared) = match &config.run_id {
            Some(id) => (id.clone(), true),
            None => (uuid::Uuid::new_v4().to_string(), false),
        };
        Ok(Client {
            inner: Arc::new(Inner {
                config,
                run_id,
                run_id_shared,
                leases: Default::default(),
                upload_slot: Arc::new(tokio::sync::Semaphore::new(1)),
                control,
                staging,
                streaming_partials: Arc::default(),
                targets: Targets { rdma, staging: shared_staging, ..Default::default() },
                repairs: Arc::new(tokio::sync::Semaphore::new(REPAIRS_IN_FLIGHT)),
                repairs_running: Arc::new(tokio::sync::Semaphore::new(REPAIRS_RUNNING)),
                recoveries: Default::default(),
            }),
        })
    }

    pub fn config(&self) -> &ClientConfig {
        &self.inner.config
    }

    /// The run id this client writes for.
    pub fn run_id(&self) -> &str {
        &self.inner.run_id
    }

    /// This run's writer-lease epoch for `job`, taking the lease on first use. A newer run taking
    /// over fences this one: its begins and commits then fail with [`Error::Fenced`].
    pub async fn lease(&self, job: &str) -> Result<u64> {
        let job = JobName::try_from(job)?;
        let mut leases = self.inner.leases.lock().await;
        if let Some(epoch) = leases.get(job.as_str()) {
            return Ok(*epoch);
        }
        let request = pb::AcquireLeaseRequest {
            job: job.to_string(),
            run_id: self.inner.run_id.clone(),
            started_at_ms: process_started_at_ms(),
        };
        let grant = self
            .rpc("acquire lease", Resend::Idempotent, request, |mut c, r| async move { c.acquire_lease(r).await })
            .await?;
        if grant.aborted_checkpoints > 0 {
            tracing::info!(%job, epoch = grant.epoch, aborted = grant.aborted_checkpoints,
                "took over the job; the previous run's unfinished checkpoints were aborted");
        }
        leases.insert(job.to_string(), grant.epoch);
        Ok(grant.epoch)
    }

    /// Calls the control plane, failing over to the others of the cluster (`control.rs`):
    /// `self.rpc(op, resend, request, |mut control, request| async move { control.op(request).await })`.
    pub(crate) async fn rpc<Req, Resp, F, Fut>(
        &self,
        op: &'static str,
        resend: Resend,
        request: Req,
        call: F,
    ) -> Result<Resp>
    where
        Req: Clone,
        F: Fn(Control, Req) -> Fut,
        Fut: Future<Output = std::result::Result<tonic::Response<Resp>, tonic::Status>>,
    {
        self.inner.control.call(op, resend, request, call).await.map_err(self.status(op))
    }

    fn status(&self, op: &'static str) -> impl FnOnce(tonic::Status) -> Error + '_ {
        move |status| Error::from_status(op, &self.inner.config.server, status)
    }

    pub(crate) fn transport(&self, target_id: &str, address: &str) -> Result<Arc<dyn ChunkTransport>> {
        self.inner.targets.transport(target_id, address, &self.inner.config)
    }

    /// The highest committed checkpoint of `job`, if any.
    pub async fn latest(&self, job: &str) -> Result<Option<CheckpointInfo>> {
        let job = JobName::try_from(job)?;
        let request = pb::LatestRequest { job: job.to_string() };
        let response =
            self.rpc("latest", Resend::Idempotent, request, |mut c, r| async move { c.latest(r).await }).await?;
        Ok(response.checkpoint)
    }

    pub async fn list_jobs(&self) -> Result<Vec<JobInfo>> {
        let request = pb::ListJobsRequest {};
        let response =
            self.rpc("list jobs", Resend::Idempotent, request, |mut c, r| async move { c.list_jobs(r).await }).await?;
        Ok(response.jobs)
    }

    /// Checkpoints of `job` by step; with `include_inactive`, aborted and deleted ones too.
    pub async fn list_checkpoints(&self, job: &str, include_inactive: bool) -> Result<Vec<CheckpointInfo>> {
        let job = JobName::try_from(job)?;
        let request = pb::ListCheckpointsRequest { job: job.to_string(), include_inactive };
        let response = self
            .rpc("list checkpoints", Resend::Idempotent, request, |mut c, r| async move { c.list_checkpoints(r).await })
            .await?;
        Ok(response.checkpoints)
    }

    pub async fn delete(&self, job: &str, step: u64) -> Result<()> {
        self.delete_checkpoint(job, step, 0).await
    }

    /// Deletes checkpoint `checkpoint_id` of `job`, only while it is the one at `step`: acting on
    /// what a listing said earlier never deletes a newer checkpoint saved at that step since
    /// (NotFound then).
    pub async fn delete_seen(&self, job: &str, step: u64, checkpoint_id: u64) -> Result<()> {
        if checkpoint_id == 0 {
            return Err(Error::InvalidInput("checkpoint id 0 names no checkpoint".into()));
        }
        self.delete_checkpoint(job, step, checkpoint_id).await
    }

    async fn delete_checkpoint(&self, job: &str, step: u64, checkpoint_id: u64) -> Result<()> {
        let job = JobName::try_from(job)?;
        // Not idempotent: a second delete of the same step says NotFound.
        let request = pb::DeleteCheckpointRequest { job: job.to_string(), step, checkpoint_id, ..Default::default() };
        self.rpc(
            "delete checkpoint",
            Resend::IfUnsent,
            request,
            |mut c, r| async move { c.delete_checkpoint(r).await },
        )
        .await?;
        Ok(())
    }

    /// Aborts this client's pending checkpoint `checkpoint_id` of `job`@`step`, giving up on it
    /// (only it, and only while pending: `DeleteCheckpointRequest.pending_checkpoint_id`).
    pub(crate) async fn abort_pending(&self, job: &JobName, step: u64, checkpoint_id: u64) -> Result<()> {
        let request = pb::DeleteCheckpointRequest {
            job: job.to_string(),
            step,
            pending_checkpoint_id: checkpoint_id,
            ..Default::default()
        };
        let abort = |mut c: Control, r| async move { c.delete_checkpoint(r).await };
        // Idempotent at a control plane that knows the field; one older than it deletes by step.
        self.rpc("abort checkpoint", Resend::IfUnsent, request, abort).await?;
        Ok(())
    }

    /// Runs a re-replication pass at the control plane now and returns its report.
    pub async fn rereplicate(&self) -> Result<pb::RereplicateResponse> {
        // Passes (re-replication, tiering, GC, importing) go on after the caller gives up: one
        // is sent again only if it never reached a control plane.
        let request = pb::RereplicateRequest {};
        self.rpc("re-replicate", Resend::Pass, request, |mut c, r| async move { c.rereplicate(r).await }).await
    }

    /// Runs an object-store tier pass at the control plane now and returns its report.
    pub async fn tier(&self) -> Result<pb::TierResponse> {
        self.rpc("tier", Resend::Pass, pb::TierRequest {}, |mut c, r| async move { c.tier(r).await }).await
    }

    /// Adds the committed checkpoints the control plane's object-store tier holds and its
    /// database lacks (of `job`, or of every job), e.g. after the database was lost; returns the
    /// report. Re-replication then brings their chunks back onto the targets.
    pub async fn import_tier(&self, job: Option<&str>) -> Result<pb::ImportTierResponse> {
        let job = job.map(JobName::try_from).transpose()?.map(|j| j.to_string()).unwrap_or_default();
        let request = pb::ImportTierRequest { job };
        // A pass; sent again, it would report no imports.
        self.rpc("import from the tier", Resend::Pass, request, |mut c, r| async move { c.import_tier(r).await }).await
    }

    /// Sets `job`'s replication factor: copies of every chunk its saves make from now on, on
    /// distinct targets (and failure domains, while there are enough).
    pub async fn set_replication(&self, job: &str, replicas: u32) -> Result<()> {
        let job = JobName::try_from(job)?;
        let request = pb::SetReplicationRequest { job: job.to_string(), replicas };
        self.rpc("set replication", Resend::Idempotent, request, |mut c, r| async move { c.set_replication(r).await })
            .await?;
        Ok(())
    }

    /// Sets `job`'s retention policy (applied now and at every commit); returns the steps it
    /// deleted now. Both rules 0 keeps everything.
    pub async fn set_retention(&self, job: &str, policy: RetentionPolicy) -> Result<Vec<u64>> {
        let job = JobName::try_from(job)?;
        let request = pb::SetRetentionRequest { job: job.to_string(), policy: Some(policy) };
        // Sent again, it would report no deleted steps (the first deleted them).
        let response = self
            .rpc("set retention", Resend::IfUnsent, request, |mut c, r| async move { c.set_retention(r).await })
            .await?;
        Ok(response.deleted_steps)
    }

    pub async fn retention(&self, job: &str) -> Result<RetentionPolicy> {
        let job = JobName::try_from(job)?;
        let request = pb::GetRetentionRequest { job: job.to_string() };
        let response = self
            .rpc("get retention", Resend::Idempotent, request, |mut c, r| async move { c.get_retention(r).await })
            .await?;
        Ok(response.policy.unwrap_or_default())
    }

    /// Tags (or with `remove`, untags) the committed checkpoint (job, step). Retention never
    /// deletes a tagged checkpoint.
    pub async fn tag(&self, job: &str, step: u64, tag: &str, remove: bool) -> Result<()> {
        let job = JobName::try_from(job)?;
        starckpt_proto::model::validate_tag(tag)?;
        let request = pb::TagCheckpointRequest { job: job.to_string(), step, tag: tag.to_owned(), remove };
        self.rpc("tag checkpoint", Resend::Idempotent, request, |mut c, r| async move { c.tag_checkpoint(r).await })
            .await?;
        Ok(())
    }

    /// Runs a garbage-collection pass on the control plane now and returns its report.
    pub async fn collect_garbage(&self) -> Result<GcReport> {
        let request = pb::CollectGarbageRequest {};
        self.rpc("collect garbage", Resend::Pass, request, |mut c, r| async move { c.collect_garbage(r).await }).await
    }

    pub async fn targets(&self) -> Result<Vec<TargetInfo>> {
        Ok(self.cluster_status().await?.targets)
    }

    /// Notes whether a request reached `target_id`. One newly found silent (or unreachable) is
    /// tried last by this client's next chunks, and reported to the control plane in the
    /// background, so other clients leave it out too (`ReportSilentTargets`); the control
    /// plane's answer also marks the targets others found silent.
    pub(crate) fn reached(&self, target_id: &str, reached: bool) {
        if self.inner.targets.reached(target_id, reached) {
            let client = self.clone();
            let reported = vec![target_id.to_owned()];
            tokio::spawn(async move {
                let request = pb::ReportSilentTargetsRequest { target_ids: reported };
                let answer = client
                    .rpc("report silent targets", Resend::Idempotent, request, |mut c, r| async move {
                        c.report_silent_targets(r).await
                    })
                    .await;
                match answer {
                    Ok(answer) => client.inner.targets.heard_of(&answer.targets),
                    // An older control plane, or none reachable: this client's own evidence stands.
                    Err(error) => tracing::debug!(%error, "could not report a silent target"),
                }
            });
        }
    }

    /// Asks the control plane how the targets stand and tries those it lists suspect or dead
    /// last: saves and restores under way skip targets found silent since they began.
    pub(crate) async fn refresh_targets(&self) -> Result<()> {
        let targets = self.targets().await?;
        self.inner.targets.heard_of(&targets);
        Ok(())
    }

    /// The targets and the last re-replication pass's count of chunks still short of copies.
    pub async fn cluster_status(&self) -> Result<pb::ListTargetsResponse> {
        let request = pb::ListTargetsRequest {};
        self.rpc("list targets", Resend::Idempotent, request, |mut c, r| async move { c.list_targets(r).await }).await
    }

    /// Asks a target for its own view of its store (over the data plane).
    pub async fn target_stat(&self, target: &TargetInfo) -> Result<transport::TargetStat> {
        let transport = self.transport(&target.target_id, &target.data_address)?;
        transport.stat().await.map_err(|source| Error::Target {
            target_id: target.target_id.clone(),
            address: target.data_address.clone(),
            source,
        })
    }

    /// How this client reaches `target`: "shm" (shared memory, same host) or "tcp". Asks the
    /// target (STAT) if it has not been asked yet.
    pub async fn transport_kind(&self, target: &TargetInfo) -> Result<&'static str> {
        let transport = self.transport(&target.target_id, &target.data_address)?;
        transport.stat().await.map_err(|source| Error::Target {
            target_id: target.target_id.clone(),
            address: target.data_address.clone(),
            source,
        })?;
        transport.settle().await;
        Ok(transport.kind())
    }
}

impl Client {
    /// Makes at least `bytes` of staging buffers allocated and pre-faulted (allocating what is
    /// missing now), so the first save does not pay for first-touch page faults (0.38 GB/s on
    /// these VMs against 13.5 GB/s into touched memory). Bounded by [`ClientConfig::staging_bytes`].
    pub fn warm_staging(&self, bytes: usize) {
        let staging = &self.inner.staging;
        let wanted = bytes.min(self.inner.config.staging_bytes).div_ceil(staging.buf_bytes());
        staging.prefill(wanted.saturating_sub(staging.allocated()));
    }

    /// Staging memory allocated and pre-faulted so far (it stays allocated for reuse).
    pub fn staging_allocated_bytes(&self) -> usize {
        self.inner.staging.allocated() * self.inner.staging.buf_bytes()
    }
}

impl Client {
    /// After a connection failure to `target_id` at `failed_address`, asks the control plane for
    /// the target's current address (a restarted target may listen elsewhere). Returns a transport
    /// to the new address, or None if the address has not changed.
    pub(crate) async fn refreshed_transport(
        &self,
        target_id: &str,
        failed_address: &str,
    ) -> Option<(String, Arc<dyn ChunkTransport>)> {
        let target = self.targets().await.ok()?.into_iter().find(|t| t.target_id == target_id)?;
        if target.data_address == failed_address {
            return None;
        }
        tracing::info!(target_id, old = failed_address, new = %target.data_address, "target moved; retrying at its new address");
        let transport = self.transport(target_id, &target.data_address).ok()?;
        Some((target.data_address, transport))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_started_before_now_and_after_boot() {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
        let started = proc_started_at_ms().expect("/proc tells when this process started");
        // Clock ticks are 10 ms; boot time is in whole seconds.
        assert!(started <= now + 1000, "started {started} after now {now}");
        assert!(
            now.saturating_sub(started) < 24 * 3600 * 1000,
            "a test process started over a day ago: {started} vs {now}"
        );
        assert_eq!(process_started_at_ms(), process_started_at_ms(), "asked once");
    }
}
