//! Prometheus metrics (`--metrics-listen`, `server/src/telemetry.rs`), scraped over HTTP from real
//! `starckpt` processes as Prometheus would.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::{Cluster, free_address, scrape, value};

/// Scrapes until `ready` holds (series published on a period), at most 20 s.
fn scrape_until(address: &str, ready: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = scrape(address);
        if ready(&text) {
            return text;
        }
        assert!(Instant::now() < deadline, "never ready: {text}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn control_plane_and_targets_serve_prometheus_metrics() {
    let (control_metrics, target_metrics) = (free_address(), free_address());
    let mut cluster = Cluster::start_with(1, &["--metrics-listen", &control_metrics]);
    let measured = cluster.start_target_with(1, &["--metrics-listen", &target_metrics]);
    cluster.targets.push(measured);
    cluster.wait_alive(2);

    // A save (two copies per chunk on two targets: the measured one holds every chunk), a call
    // that fails, and a data-plane request without a capability.
    let file = cluster.dir.path().join("weights.bin");
    std::fs::write(&file, common::random_bytes(9 << 20, 3)).unwrap();
    cluster.ok(&["save", "--job", "metered", "--step", "1", file.to_str().unwrap()]);
    cluster.fails(&["show", "metered", "99"]);
    let refused = common::stat_without_capability(&cluster.targets[1].address);
    assert_eq!(refused.code, starckpt_proto::data::ErrorCode::Unauthorized as i32);

    let control = scrape(&control_metrics);
    assert_eq!(value(&control, "starckpt_control_checkpoints_committed_total "), Some(1.0), "{control}");
    assert_eq!(value(&control, "starckpt_control_committed_bytes_total "), Some((9 << 20) as f64), "{control}");
    let committed = control
        .lines()
        .find(|l| l.starts_with("starckpt_control_requests_total{") && l.contains("method=\"CommitPart\""))
        .unwrap_or_else(|| panic!("no CommitPart calls: {control}"));
    assert!(committed.contains("code=\"OK\""), "{committed}");
    assert!(
        control.lines().any(|l| l.contains("method=\"GetManifest\"") && l.contains("code=\"NotFound\"")),
        "the failed call is counted by its code: {control}"
    );
    assert!(control.contains("starckpt_control_request_seconds_bucket{method=\"BeginCheckpoint\""), "{control}");

    // Target series arrive with the next heartbeat.
    let target = scrape_until(&target_metrics, |text| {
        value_of_target(text, "starckpt_target_chunk_writes_total").is_some_and(|v| v >= 3.0)
    });
    assert!(value_of_target(&target, "starckpt_target_used_bytes").unwrap() >= (9 << 20) as f64, "{target}");
    assert!(value_of_target(&target, "starckpt_target_capacity_bytes").unwrap() > 0.0, "{target}");
    assert_eq!(value_of_target(&target, "starckpt_target_chunks"), Some(3.0), "{target}");
    assert!(
        target.lines().any(|l| l.starts_with("starckpt_target_refused_total{") && l.contains("unauthorized")),
        "{target}"
    );
    // Every data-plane request answered is counted by operation and code, and timed.
    let puts = labelled(&target, "starckpt_target_requests_total{", &["op=\"put\"", "code=\"OK\""]);
    assert!(puts.is_some_and(|v| v >= 3.0), "a PUT per chunk: {target}");
    let refused = labelled(&target, "starckpt_target_requests_total{", &["op=\"stat\"", "code=\"UNAUTHORIZED\""]);
    assert_eq!(refused, Some(1.0), "the STAT without a capability: {target}");
    let timed = labelled(&target, "starckpt_target_request_seconds_count{", &["op=\"put\""]);
    assert_eq!(timed, puts, "every PUT answered is timed: {target}");
}

/// The value of the series named `prefix` (up to its labels' `{`) whose line has every one of
/// `labels`.
fn labelled(text: &str, prefix: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .find(|line| line.starts_with(prefix) && labels.iter().all(|label| line.contains(label)))
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
}

/// The value of a target series (it has a `target` label, whatever the id).
fn value_of_target(text: &str, name: &str) -> Option<f64> {
    value(text, &format!("{name}{{target=\""))
}
