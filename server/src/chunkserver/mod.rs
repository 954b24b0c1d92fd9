//! The storage target: a chunk store on one device, served over the data plane, registered with
//! the control plane and kept alive there by heartbeats. (The module is named for what it is,
//! not `target`, which tools that skip Cargo's build directory would skip too.)
//!
//! Entry point: [`run`]. The binary (`starckpt target`) only parses flags and calls it.

pub mod calibrate;
pub mod dataplane;
pub mod engine;
pub mod freepool;
pub mod scrub;
pub mod store;

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use starckpt_proto::capability::{ClusterKey, Rights};
use starckpt_proto::control::control_client::ControlClient;
use starckpt_proto::control::{HeartbeatRequest, RegisterTargetRequest};
use tokio::net::TcpListener;
use tracing::{info, warn};

pub use dataplane::DataPlaneLimits;
pub use engine::EngineKind;
use store::ChunkStore;

/// Configuration of one target.
#[derive(Clone, Debug)]
pub struct TargetConfig {
    /// Data directory on the device this target owns.
    pub dir: PathBuf,
    /// Control-plane address (`host:port` or URL), or a comma-separated list of the control planes
    /// sharing one PostgreSQL database: the target registers with the first that answers and moves
    /// to the next when it stops answering.
    pub server: String,
    /// What the target trusts on the control planes' TLS ports (`--tls-ca`, `starckpt_proto::tls`).
    /// Default: no CA file (plaintext, unless `server` says `https://`).
    pub control_tls: starckpt_proto::tls::ControlTls,
    /// Address clients should dial; default: the listener's address.
    pub advertise: Option<SocketAddr>,
    /// I/O engine. Default io_uring; `std` where io_uring is blocked (Docker's default seccomp);
    /// `auto` picks ([`engine::resolve`]).
    pub engine: EngineKind,
    /// Operations in flight on the device. Default 8: fio reaches 2.8 GiB/s at QD8 on these disks
    /// against 1.9 at QD1 (../shared/MACHINE.md); more adds latency, not throughput.
    /// [`QueueDepth::Measured`] (`starckpt target`'s default) measures the device once.
    pub queue_depth: QueueDepth,
    /// Size of the reusable I/O buffers (one chunk). Default 4 MiB, the client's default chunk.
    pub chunk_size_bytes: usize,
    /// Reusable I/O buffers. Default 64 (256 MiB): bounds the memory serving puts and gets.
    pub pool_buffers: usize,
    pub limits: DataPlaneLimits,
    /// Treat the store as open this much longer than it has been, for chunk ages (see
    /// `UseClock` in `store.rs`). For tests of garbage collection only: in production a target's
    /// chunks never look older than its uptime. Default zero.
    pub assumed_uptime: std::time::Duration,
    /// Free space the target never writes into: puts that would eat into it are refused with
    /// NO_SPACE, and writers place those chunks on other targets. Default 256 MiB.
    pub reserve_bytes: u64,
    /// Failure domain label sent at registration (a host, a rack); empty: its own.
    pub failure_domain: String,
    /// Background re-verification of stored chunks (`scrub.rs`).
    pub scrub: scrub::ScrubConfig,
    /// Unix socket for same-host clients' shared memory (`dataplane.rs`). Default
    /// `DIR/shm.sock`; None serves TCP only. A socket that cannot be bound (a path over the
    /// 107-byte limit, a read-only directory) is logged and skipped: clients then use TCP.
    pub shm_socket: Option<PathBuf>,
    /// Staged chunks of same-host clients running as this target's user (or root) are written
    /// to the device straight from their staging memory ([`dataplane::ShmListener::placed_writes`]).
    /// Default true; false copies every chunk out first.
    pub shm_placed_writes: bool,
    /// RDMA (`dataplane.rs`): default: open the first device (builds with the `rdma` feature);
    /// without one the target serves TCP and shared memory only.
    pub rdma: TargetRdma,
    /// Bytes of deleted chunks' files kept for reuse (`freepool.rs`: overwriting an allocated
    /// file is ~1.4x faster than allocating one on ext4 here). None: a tenth of the filesystem.
    pub free_pool_bytes: Option<u64>,
    /// Fill the free pool to this many bytes at start, in the background (0: only chunks deleted
    /// by GC fill it). Raises the pool's cap to at least this.
    pub preallocate_bytes: u64,
    /// The cluster's key (`--cluster-key-file`): requests must carry a capability the control
    /// plane signed with it (`starckpt_proto::capability`). None: every request is served.
    pub cluster_key: Option<starckpt_proto::capability::ClusterKey>,
    /// How long the device may have operations in flight without completing any before the
    /// target stops heartbeating (`heartbeat_loop`): the control plane then turns it suspect and
    /// dead, writers place chunks elsewhere and its chunks are copied again, as for a target that
    /// died. Default 30 s, far above any one operation of a working device.
    pub io_stall_timeout: Duration,
}

/// How many operations a target keeps in flight on its device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueDepth {
    Fixed(usize),
    /// Chosen by measuring the device on the first start and remembered in `DIR/queue-depth`
    /// (`calibrate.rs`).
    Measured,
}

impl std::str::FromStr for QueueDepth {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(QueueDepth::Measured),
            n => match n.parse::<usize>() {
                Ok(depth) if (1..=256).contains(&depth) => Ok(QueueDepth::Fixed(depth)),
                _ => Err(format!("{n:?} is not `auto` or a queue depth of 1 to 256")),
            },
        }
    }
}

/// Which RDMA device a target serves on.
#[derive(Clone)]
pub enum TargetRdma {
    Off,
    /// Open a device with these settings at start; none found means no RDMA (logged).
    Open(starckpt_rdma::DeviceSettings),
    /// This device (the in-process software fabric in tests).
    Device(Arc<dyn starckpt_rdma::Verbs>),
}

impl std::fmt::Debug for TargetRdma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TargetRdma::Off => f.write_str("Off"),
            TargetRdma::Open(settings) => f.debug_tuple("Open").field(settings).finish(),
            TargetRdma::Device(device) => f.debug_tuple("Device").field(&device.name()).finish(),
        }
    }
}

impl TargetRdma {
    /// The device to serve on, if any.
    fn device(&self) -> Option<Arc<dyn starckpt_rdma::Verbs>> {
        match self {
            TargetRdma::Off => None,
            TargetRdma::Device(device) => Some(Arc::clone(device)),
            TargetRdma::Open(settings) => match starckpt_rdma::open(settings) {
                Ok(device) => Some(device),
                Err(error) => {
                    info!(%error, "no RDMA; serving TCP (and shared memory)");
                    None
                }
            },
        }
    }
}

impl TargetConfig {
    pub fn new(dir: PathBuf, server: String) -> TargetConfig {
        TargetConfig {
            server,
            control_tls: Default::default(),
            advertise: None,
            engine: EngineKind::Uring,
            queue_depth: QueueDepth::Fixed(8),
            chunk_size_bytes: 4 << 20,
            pool_buffers: 64,
            limits: DataPlaneLimits::default(),
            assumed_uptime: std::time::Duration::ZERO,
            reserve_bytes: 256 << 20,
            failure_domain: String::new(),
            scrub: scrub::ScrubConfig::default(),
            shm_socket: Some(dir.join("shm.sock")),
            shm_placed_writes: true,
            rdma: TargetRdma::Open(starckpt_rdma::DeviceSettings::default()),
            free_pool_bytes: None,
            preallocate_bytes: 0,
            cluster_key: None,
            io_stall_timeout: Duration::from_secs(30),
            dir,
        }
    }
}

/// Reads this target's id from `dir/target.id`, creating it durably on first start.
pub fn load_or_create_target_id(dir: &Path) -> anyhow::Result<String> {
    let path = dir.join("target.id");
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let id = text.trim().to_owned();
            starckpt_proto::model::validate_target_id(&id).with_context(|| format!("corrupt {}", path.display()))?;
            Ok(id)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
            let id = uuid::Uuid::new_v4().to_string();
            let temp = dir.join("target.id.tmp");
            std::fs::write(&temp, format!("{id}\n")).with_context(|| format!("write {}", temp.display()))?;
            std::fs::File::open(&temp)?.sync_all()?;
            std::fs::rename(&temp, &path).with_context(|| format!("rename to {}", path.display()))?;
            std::fs::File::open(dir)?.sync_all()?;
            Ok(id)
        }
        Err(e) => Err(e).with_context(|| format!("read {}", path.display())),
    }
}

/// Binds the shared-memory socket at `path`, replacing a stale socket a previous run left; None
/// (logged) if it cannot.
fn bind_shm_socket(path: &Path) -> Option<dataplane::ShmListener> {
    use std::os::unix::fs::FileTypeExt;
    // Advertised to clients, whose working directory is not ours.
    let absolute = std::path::absolute(path);
    let path = absolute.as_deref().unwrap_or(path);
    if let Ok(meta) = std::fs::symlink_metadata(path)
        && meta.file_type().is_socket()
    {
        let _ = std::fs::remove_file(path);
    }
    match tokio::net::UnixListener::bind(path) {
        Ok(listener) => {
            info!(socket = %path.display(), "serving same-host clients over shared memory");
            Some(dataplane::ShmListener::new(listener, path.to_path_buf()))
        }
        Err(error) => {
            tracing::warn!(%error, socket = %path.display(), "no shared-memory socket; same-host clients use TCP");
            None
        }
    }
}

/// Takes `DIR/target.lock` for the life of the returned file. Two target processes on one data
/// directory would hand out the same free-pool files and delete each other's temporaries, so a
/// second one is refused with a clear error rather than left to corrupt chunks
/// ([`crate::lockfile`]: a crash never leaves it held).
pub fn lock_data_dir(dir: &Path) -> anyhow::Result<std::fs::File> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let path = dir.join("target.lock");
    match crate::lockfile::try_hold(&path).with_context(|| format!("lock {}", path.display()))? {
        Some(file) => Ok(file),
        None => anyhow::bail!(
            "{} is in use by another target process (it holds {}); give each target its own --dir",
            dir.display(),
            path.display()
        ),
    }
}

/// Removes a cut-short measurement's scratch directory. Its last operations (a rename, an
/// fsync on the blocking pool) may still be finishing and create entries in it, so it is removed
/// again until it stays gone, for up to about a second; a start removes whatever is left.
async fn remove_scratch(scratch: &std::path::Path) {
    for _ in 0..20 {
        let _ = std::fs::remove_dir_all(scratch);
        tokio::time::sleep(Duration::from_millis(50)).await;
        if !scratch.exists() {
            return;
        }
    }
    warn!(dir = %scratch.display(), "could not remove the measurement's scratch files; the next start will");
}

/// Runs a target on `listener` until `shutdown` resolves.
pub async fn run(
    config: TargetConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let _dir_lock = lock_data_dir(&config.dir)?;
    let target_id = load_or_create_target_id(&config.dir)?;
    // Whatever a measurement cut short by a crash left behind.
    let scratch = config.dir.join("calibrating");
    let _ = std::fs::remove_dir_all(&scratch);
    let mut shutdown = std::pin::pin!(shutdown);
    let engine_kind = engine::resolve(config.engine);
    let queue_depth = match config.queue_depth {
        QueueDepth::Fixed(depth) => depth,
        QueueDepth::Measured => {
            let measuring =
                calibrate::queue_depth(&config.dir, engine_kind, config.chunk_size_bytes, config.reserve_bytes);
            let measured = tokio::select! {
                measured = measuring => measured,
                () = &mut shutdown => {
                    // Nothing is served yet: stop now, not after the measurement (seconds); the
                    // next start measures again.
                    info!("stopped while measuring the device; the next start measures it again");
                    remove_scratch(&scratch).await;
                    return Ok(());
                }
            };
            match measured {
                Ok(depth) => depth,
                Err(error) => {
                    warn!(%error, "could not measure the device; queue depth 8 until a later start measures it");
                    8
                }
            }
        }
    };
    let engine = engine::open_engine(engine_kind, queue_depth)
        .with_context(|| format!("start the {engine_kind:?} I/O engine (try --io-engine std)"))?;
    let store = Arc::new(
        ChunkStore::open(&config.dir, engine, config.chunk_size_bytes, config.pool_buffers)
            .await
            .with_context(|| format!("open chunk store in {}", config.dir.display()))?,
    );
    store.assume_uptime(config.assumed_uptime);
    store.set_target_id(&target_id);
    store.set_reserve(config.reserve_bytes);
    // The pool's cap: as configured (default: a tenth of the filesystem), raised to what is to
    // be preallocated.
    let max_bytes = config.free_pool_bytes.unwrap_or(store.free_pool_max()).max(config.preallocate_bytes);
    let reuse_after = freepool::FreePoolConfig::default().reuse_after;
    store.set_free_pool(freepool::FreePoolConfig { max_bytes, reuse_after }).await?;
    let local = listener.local_addr()?;
    let advertise = config.advertise.unwrap_or(local);
    info!(%target_id, data_address = %advertise, dir = %config.dir.display(), engine = ?engine_kind, queue_depth, "target starting");

    let rdma_device = config.rdma.device();
    let registration = Registration {
        target_id,
        advertise,
        failure_domain: config.failure_domain.clone(),
        rdma_device: rdma_device.as_ref().map(|device| device.name()).unwrap_or_default(),
        cluster_key: config.cluster_key.clone(),
        control_tls: config.control_tls.clone(),
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut heartbeat_stop = stop_rx.clone();
    let heartbeat_task = tokio::spawn(heartbeat_loop(
        config.server.clone(),
        registration,
        Arc::clone(&store),
        config.io_stall_timeout,
        async move {
            let _ = heartbeat_stop.wait_for(|stopped| *stopped).await;
        },
    ));
    // Aborted with this future, so a target killed in-process stops heartbeating too.
    let heartbeat = tokio_util::task::AbortOnDropHandle::new(heartbeat_task);
    let _scrubber =
        tokio_util::task::AbortOnDropHandle::new(tokio::spawn(scrub::run(Arc::clone(&store), config.scrub.clone())));
    let _preallocating = (config.preallocate_bytes > 0).then(|| {
        let (store, bytes) = (Arc::clone(&store), config.preallocate_bytes);
        tokio_util::task::AbortOnDropHandle::new(tokio::spawn(async move {
            match store.preallocate(bytes).await {
                Ok(written) => info!(bytes = written, "free pool preallocated"),
                Err(error) => warn!(%error, "preallocation stopped"),
            }
        }))
    });
    let mut serve_stop = stop_rx;
    let shm = config.shm_socket.as_deref().and_then(bind_shm_socket).map(|mut shm| {
        shm.placed_writes = config.shm_placed_writes;
        shm
    });
    let transports = dataplane::Transports { shm, rdma: rdma_device, cluster_key: config.cluster_key.clone() };
    let serving = dataplane::serve_with(listener, transports, store, config.limits.clone(), async move {
        let _ = serve_stop.wait_for(|stopped| *stopped).await;
    });
    tokio::pin!(serving);
    tokio::select! {
        _ = shutdown => {}
        _ = &mut serving => {}
    }
    let _ = stop_tx.send(true);
    let _ = heartbeat.await;
    info!("target stopped");
    Ok(())
}

/// What a target tells the control plane about itself.
struct Registration {
    target_id: String,
    advertise: SocketAddr,
    failure_domain: String,
    /// Empty: no RDMA.
    rdma_device: String,
    /// Signs the proof that this is a target of the cluster (`starckpt_proto::capability`).
    cluster_key: Option<ClusterKey>,
    control_tls: starckpt_proto::tls::ControlTls,
}

/// How long a registration's or heartbeat's proof is good for.
const PROOF_LIFETIME: Duration = Duration::from_secs(10);

/// Registers with the control plane, then heartbeats; re-registers whenever the control plane
/// forgot us (NOT_FOUND) and keeps retrying while it is unreachable.
async fn heartbeat_loop(
    server: String,
    registration: Registration,
    store: Arc<ChunkStore>,
    io_stall_timeout: Duration,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let mut clients = Vec::new();
    for url in registration.control_tls.urls(&server) {
        match registration.control_tls.endpoint(&url) {
            Ok(endpoint) => {
                let endpoint = endpoint.connect_timeout(Duration::from_secs(3)).timeout(Duration::from_secs(10));
                clients.push((url, ControlClient::new(endpoint.connect_lazy())));
            }
            Err(error) => warn!(%error, %url, "invalid control-plane address; skipping it"),
        }
    }
    if clients.is_empty() {
        warn!(%server, "no valid control-plane address; target will not register");
        return;
    }
    let Registration { target_id, advertise, failure_domain, rdma_device, cluster_key, .. } = registration;
    // A registration's proof covers the address too: one seen on the wire cannot register the
    // target elsewhere. A heartbeat changes nothing but liveness.
    let registration_scope = starckpt_proto::capability::registration_scope(&target_id, &advertise.to_string());
    let proof = |scope: &str| {
        cluster_key.as_ref().map_or_else(Bytes::new, |key| {
            key.mint(Rights::TARGET, std::time::SystemTime::now() + PROOF_LIFETIME, Some(scope))
        })
    };
    let mut refusal_logged = false;
    // The control plane in use: the next one is tried when it stops answering.
    let mut current = 0;
    let mut registered = false;
    let mut interval = Duration::from_secs(1);
    let mut unreachable_logged = false;
    let mut stall_logged = false;
    loop {
        let stats = store.stats();
        crate::telemetry::publish_target(&target_id, &stats, store.scrub_stats());
        // A device that stopped completing operations makes this target useless to writers and
        // readers while the process still answers: silent, it turns suspect, then dead, at the
        // control plane, and its chunks are copied again elsewhere. It speaks again once the
        // device completes something.
        let stalled = store.io_stalled_for();
        if stalled > io_stall_timeout {
            if !stall_logged {
                warn!(?stalled, "the device has completed no operation for this long; not heartbeating until it does");
                stall_logged = true;
            }
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(interval.min(Duration::from_secs(1))) => {}
            }
            continue;
        }
        if std::mem::take(&mut stall_logged) {
            info!("the device completes operations again; heartbeating");
        }
        let (server, client) = &mut clients[current];
        let sent = std::time::Instant::now();
        let outcome = if registered {
            client
                .heartbeat(HeartbeatRequest {
                    target_id: target_id.clone(),
                    capacity_bytes: stats.capacity_bytes,
                    used_bytes: stats.used_bytes,
                    chunk_count: stats.chunk_count,
                    proof: proof(&target_id),
                })
                .await
                .map(|_| ())
        } else {
            client
                .register_target(RegisterTargetRequest {
                    target_id: target_id.clone(),
                    data_address: advertise.to_string(),
                    capacity_bytes: stats.capacity_bytes,
                    used_bytes: stats.used_bytes,
                    failure_domain: failure_domain.clone(),
                    rdma_device: rdma_device.clone(),
                    proof: proof(&registration_scope),
                })
                .await
                .map(|response| {
                    interval = Duration::from_millis(response.into_inner().heartbeat_interval_ms.clamp(100, 60_000));
                    info!(%target_id, %server, "registered with the control plane");
                    registered = true;
                })
        };
        match outcome {
            Ok(()) => (unreachable_logged, refusal_logged) = (false, false),
            Err(status) if status.code() == tonic::Code::NotFound => registered = false,
            Err(status) if status.code() == tonic::Code::PermissionDenied => {
                registered = false;
                if !refusal_logged {
                    warn!(%server, error = %status.message(), "the control plane refused this target; retrying");
                    refusal_logged = true;
                }
                current = (current + 1) % clients.len();
            }
            Err(status) => {
                registered = false;
                if !unreachable_logged {
                    warn!(%server, error = %status.message(), "control plane unreachable; retrying");
                    unreachable_logged = true;
                }
                current = (current + 1) % clients.len();
            }
        }
        // Heartbeats keep their rate while the control plane is slow to answer (its database
        // busy): one interval from the last one sent, not from its answer, and at least a quarter
        // of it apart, so one slow answer does not make the control plane count this target
        // silent for the interval plus that answer's time.
        let wait = if registered {
            interval.saturating_sub(sent.elapsed()).max(interval / 4)
        } else {
            Duration::from_millis(500)
        };
        tokio::select! {
            _ = &mut shutdown => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::lock_data_dir;

    #[test]
    fn a_second_target_on_one_data_dir_is_refused_until_the_first_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let first = lock_data_dir(&data).unwrap();
        let refused = lock_data_dir(&data).unwrap_err().to_string();
        assert!(refused.contains("in use by another target process"), "{refused}");
        // Another directory is not affected.
        let _other = lock_data_dir(&dir.path().join("other")).unwrap();
        drop(first);
        lock_data_dir(&data).unwrap();
    }
}
