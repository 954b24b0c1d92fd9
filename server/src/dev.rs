//! A whole cluster in one process: the control plane on SQLite and N targets, each on its own
//! data directory and port. `starckpt dev` and `starckpt demo` run it; tests use the real
//! binaries instead.
//!
//! Layout of the data directory (kept across restarts):
//! ```text
//! DIR/meta.db        control-plane metadata (SQLite, WAL)
//! DIR/target-0/ …    one chunk store per target (listen.addr: its port, reused on restart)
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::chunkserver::{self, EngineKind, TargetConfig};
use crate::control::{self, ControlConfig};
use starckpt_proto::capability::ClusterKey;

/// Binds a target's port, reusing the one it had last time (remembered in `DIR/listen.addr`) so
/// addresses stay valid across `starckpt dev` restarts; a fresh ephemeral port if that one is taken.
async fn bind_stable(dir: &Path) -> anyhow::Result<TcpListener> {
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let remembered = dir.join("listen.addr");
    let previous = std::fs::read_to_string(&remembered).ok().and_then(|text| text.trim().parse::<SocketAddr>().ok());
    let listener = match previous {
        Some(address) => match TcpListener::bind(address).await {
            Ok(listener) => listener,
            Err(_) => TcpListener::bind("127.0.0.1:0").await.context("bind a target port")?,
        },
        None => TcpListener::bind("127.0.0.1:0").await.context("bind a target port")?,
    };
    std::fs::write(&remembered, listener.local_addr()?.to_string())
        .with_context(|| format!("write {}", remembered.display()))?;
    Ok(listener)
}

/// The dev cluster's key, in `DIR/cluster.key` (made on first start, readable by its owner only):
/// its targets serve only requests with a capability from its control plane, as in production.
/// Other processes join the cluster with `--cluster-key-file DIR/cluster.key`.
fn cluster_key(data_dir: &Path) -> anyhow::Result<ClusterKey> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = data_dir.join("cluster.key");
    if !path.exists() {
        // Written whole, then renamed into place: a crash never leaves a short key behind.
        let partial = data_dir.join("cluster.key.partial");
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&partial)
            .with_context(|| format!("create {}", partial.display()))?;
        file.write_all(format!("{}\n", ClusterKey::generate_secret()).as_bytes())
            .and_then(|()| file.sync_all())
            .and_then(|()| std::fs::rename(&partial, &path))
            .with_context(|| format!("write {}", path.display()))?;
    }
    ClusterKey::from_file(&path).map_err(anyhow::Error::msg)
}

pub struct DevCluster {
    pub control_address: SocketAddr,
    pub target_addresses: Vec<SocketAddr>,
    pub data_dir: PathBuf,
    /// The key its control plane and targets share (`DIR/cluster.key`).
    pub cluster_key: ClusterKey,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<anyhow::Result<()>>>,
    /// Its control plane's claim on `DIR/meta.db`, let go once its tasks are over.
    _database: Option<control::DatabaseLock>,
}

impl DevCluster {
    /// Starts the control plane on `listen` and `targets` targets on ephemeral loopback ports.
    pub async fn start(
        data_dir: &Path,
        listen: &str,
        targets: usize,
        engine: EngineKind,
    ) -> anyhow::Result<DevCluster> {
        DevCluster::start_with(data_dir, listen, targets, engine, |_| {}).await
    }

    /// [`DevCluster::start`], with each target's configuration adjusted by `configure`.
    pub async fn start_with(
        data_dir: &Path,
        listen: &str,
        targets: usize,
        engine: EngineKind,
        configure: impl Fn(&mut TargetConfig),
    ) -> anyhow::Result<DevCluster> {
        DevCluster::start_tuned(data_dir, listen, targets, engine, |_| {}, configure).await
    }

    /// [`DevCluster::start_with`], with the control plane's configuration adjusted by `control`.
    pub async fn start_tuned(
        data_dir: &Path,
        listen: &str,
        targets: usize,
        engine: EngineKind,
        control: impl FnOnce(&mut ControlConfig),
        configure: impl Fn(&mut TargetConfig),
    ) -> anyhow::Result<DevCluster> {
        std::fs::create_dir_all(data_dir).with_context(|| format!("create {}", data_dir.display()))?;
        let database = data_dir.join("meta.db").to_string_lossy().into_owned();
        let lock = control::DatabaseLock::take(&database)?;
        let store = control::open_store(&database).await?;
        let listener = TcpListener::bind(listen).await.with_context(|| format!("listen on {listen}"))?;
        let control_address = listener.local_addr()?;
        let (stop, stopped) = watch::channel(false);
        let wait = |mut stopped: watch::Receiver<bool>| async move {
            let _ = stopped.wait_for(|s| *s).await;
        };
        let key = cluster_key(data_dir)?;
        let cluster_key = Some(key.clone());
        let mut control_config = ControlConfig { cluster_key: cluster_key.clone(), ..ControlConfig::default() };
        control(&mut control_config);
        let mut tasks = vec![tokio::spawn(control::run(listener, store, control_config, wait(stopped.clone())))];
        let mut target_addresses = Vec::new();
        for index in 0..targets {
            let mut config = TargetConfig::new(data_dir.join(format!("target-{index}")), control_address.to_string());
            config.engine = engine;
            config.cluster_key = cluster_key.clone();
            configure(&mut config);
            let listener = bind_stable(&config.dir).await?;
            target_addresses.push(listener.local_addr()?);
            tasks.push(tokio::spawn(chunkserver::run(config, listener, wait(stopped.clone()))));
        }
        Ok(DevCluster {
            control_address,
            target_addresses,
            data_dir: data_dir.to_path_buf(),
            cluster_key: key,
            stop,
            tasks,
            _database: lock,
        })
    }

    /// What the control plane's garbage collection carries: capabilities to do anything on the
    /// target each is sent to (a transport made `for_target`), for tools and tests that act for
    /// it (deleting or listing chunks).
    pub fn admin_credentials(&self) -> starckpt_proto::capability::Credentials {
        let rights = starckpt_proto::capability::Rights::ALL;
        starckpt_proto::capability::Credentials::minted(self.cluster_key.clone(), rights, Duration::from_secs(3600))
    }

    /// Graceful stop: services finish what they are doing and exit.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        for task in self.tasks {
            task.await.context("cluster task panicked")??;
        }
        Ok(())
    }

    /// Abrupt stop, as close to a crash as one process can get: every task is dropped at its
    /// current await point, with no cleanup.
    pub async fn kill(self) {
        for task in &self.tasks {
            task.abort();
        }
        for task in self.tasks {
            let _ = task.await;
        }
    }

    /// Resolves when any service stops on its own (an error), with that error.
    pub async fn failed(&mut self) -> anyhow::Error {
        let (result, index, _) = futures::future::select_all(self.tasks.iter_mut()).await;
        let _ = index;
        match result {
            Ok(Ok(())) => anyhow::anyhow!("a cluster service stopped"),
            Ok(Err(error)) => error,
            Err(join) => anyhow::anyhow!("a cluster service panicked: {join}"),
        }
    }
}
