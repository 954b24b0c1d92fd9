#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)] // tests: a failed unwrap is a failed test
//! A cluster in this test process whose data travels the way `STARCKPT_TEST_FABRIC` says.

use std::time::Duration;

use starckpt_client::{Client, ClientConfig, TargetState};
use starckpt_server::chunkserver::{EngineKind, TargetConfig, TargetRdma};
use starckpt_server::control::ControlConfig;
use starckpt_server::dev::DevCluster;

/// What carries this run's data (`STARCKPT_TEST_FABRIC`): `soft`: RDMA over the in-process
/// software fabric (scripts/test runs this suite that way too); `ibverbs`: RDMA over the host's
/// device (builds with `--features starckpt-rdma/rdma`; `STARCKPT_RDMA_*` select it, see
/// docs/rdma.md); unset: the default transports (shared memory with these same-host targets).
pub fn fabric() -> Option<String> {
    std::env::var("STARCKPT_TEST_FABRIC").ok().filter(|fabric| fabric == "soft" || fabric == "ibverbs")
}

pub async fn cluster(
    targets: usize,
    config: impl FnOnce(&mut ClientConfig),
) -> (tempfile::TempDir, DevCluster, Client) {
    cluster_on(fabric().as_deref(), targets, config).await
}

/// [`cluster`] on the given fabric (`soft`, `ibverbs`) or, with None, the default transports.
pub async fn cluster_on(
    fabric: Option<&str>,
    targets: usize,
    config: impl FnOnce(&mut ClientConfig),
) -> (tempfile::TempDir, DevCluster, Client) {
    cluster_configured(fabric, targets, |_| {}, config).await
}

/// [`cluster_on`] with each target's configuration changed by `target_config` too.
pub async fn cluster_configured(
    fabric: Option<&str>,
    targets: usize,
    target_config: impl Fn(&mut TargetConfig),
    config: impl FnOnce(&mut ClientConfig),
) -> (tempfile::TempDir, DevCluster, Client) {
    cluster_tuned(fabric, targets, |_| {}, target_config, config).await
}

/// [`cluster_configured`] with the control plane's configuration changed by `control` too.
pub async fn cluster_tuned(
    fabric: Option<&str>,
    targets: usize,
    control: impl FnOnce(&mut ControlConfig),
    target_config: impl Fn(&mut TargetConfig),
    config: impl FnOnce(&mut ClientConfig),
) -> (tempfile::TempDir, DevCluster, Client) {
    let dir = tempfile::tempdir().unwrap();
    let rdma = fabric.is_some();
    let soft = fabric == Some("soft");
    let engine = EngineKind::Uring;
    let cluster = DevCluster::start_tuned(dir.path(), "127.0.0.1:0", targets, engine, control, |target| {
        if soft {
            target.rdma = TargetRdma::Device(starckpt_rdma::soft::SoftDevice::new("target"));
        } else if rdma {
            target.rdma = TargetRdma::Open(starckpt_rdma::DeviceSettings::from_env().unwrap());
        }
        target_config(target);
    })
    .await
    .unwrap();
    let mut client_config = ClientConfig::new(cluster.control_address.to_string());
    // This cluster's saves wait for each other's staging, not for other tests' (`host_staging.rs`).
    client_config.host_staging_lock = Some(dir.path().join("staging.lock"));
    if rdma {
        client_config.shm.enabled = false;
    }
    if soft {
        client_config.rdma.device = Some(starckpt_rdma::soft::SoftDevice::new("client"));
    }
    config(&mut client_config);
    let client = Client::connect(client_config).await.unwrap();
    wait_alive(&client, targets).await;
    if rdma {
        // The suite must really run over RDMA, not quietly over TCP.
        for target in client.targets().await.unwrap() {
            assert_eq!(client.transport_kind(&target).await.unwrap(), "rdma", "target {}", target.target_id);
            assert!(!target.rdma_device.is_empty(), "target {} registered no RDMA device", target.target_id);
        }
    }
    (dir, cluster, client)
}

/// Waits until `targets` targets are alive, failing the test after 60 s.
pub async fn wait_alive(client: &Client, targets: usize) {
    let alive =
        |listed: &[starckpt_client::TargetInfo]| listed.iter().filter(|t| t.state == TargetState::Alive as i32).count();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let listed = client.targets().await.unwrap();
        if alive(&listed) == targets {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{targets} targets never all alive: {listed:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls `done` every 50 ms until it holds, failing the test with `what` after 30 s.
pub async fn eventually(what: &str, done: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "never happened: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Heartbeats so slow that a target registered by hand, which never heartbeats, or one just
/// killed, stays alive to the control plane for the whole test, however busy the machine.
pub fn slow_heartbeats(control: &mut ControlConfig) {
    control.heartbeat_interval = Duration::from_secs(30);
    control.liveness_timeout = Duration::from_secs(120);
}
