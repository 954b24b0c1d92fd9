#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
//! `starckpt bench` through its real interface: its own dev cluster, every phase beside the
//! baselines measured in the same run, as JSON and a chart; bad flags refused. (No timing is
//! asserted: these tests check that every figure is measured, not what it is.)

mod common;

use std::path::Path;

/// Runs `starckpt bench --size 64MiB --json` with `args`, its data in `data`, and returns its report.
fn bench(args: &[&str], data: &Path, chart: Option<&Path>) -> serde_json::Value {
    let mut command = std::process::Command::new(common::BIN);
    command.args(["bench", "--size", "64MiB", "--json"]).args(args).arg("--data").arg(data);
    if let Some(chart) = chart {
        command.arg("--chart").arg(chart);
    }
    let output = command.output().unwrap();
    // (The chart needs a TrueType font: .ci/run installs fonts-dejavu-core.)
    assert!(output.status.success(), "bench failed: {}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).unwrap()
}

/// The baselines' files are removed; the cluster's data stays in `--data`.
fn only_the_cluster_is_left(data: &Path) {
    let left: Vec<String> =
        std::fs::read_dir(data).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(left, ["cluster"], "{left:?}");
}

/// `starckpt bench` end to end: its own dev cluster, two ranks, two runs; JSON with every phase
/// beside its baseline, and a PNG chart. Bad flags are refused. (No timing is asserted.)
#[test]
fn bench_reports_every_phase_beside_its_baseline() {
    let dir = tempfile::tempdir().unwrap();
    let chart = dir.path().join("bench.png");
    let data = dir.path().join("data");
    let args = ["--ranks", "2", "--runs", "2", "--targets", "2", "--shm-slots", "3"];
    let report = bench(&args, &data, Some(&chart));
    assert_eq!(report["shm_slots"], 3, "{report}");
    let bytes = report["bytes"].as_u64().unwrap();
    assert!(bytes > 60 << 20 && bytes <= 64 << 20, "{report}");
    assert_eq!(report["ranks"], 2);
    assert_eq!(report["runs"], 2);
    for phase in ["blocking", "committed", "persist", "restore"] {
        let seconds = report["starckpt"][phase]["seconds"].as_f64().unwrap();
        let cpu = report["starckpt"][phase]["cpu_seconds_per_gb"].as_f64().unwrap();
        assert!(seconds > 0.0 && cpu > 0.0, "{phase}: {report}");
        // (Not bounded by the host's cores: a short phase under a CPU quota can burst past it.)
        let cores = report["starckpt"][phase]["cores_busy"].as_f64().unwrap();
        assert!(cores > 0.0 && cores.is_finite() && report["cores"].as_u64().unwrap() >= 1, "{phase}: {report}");
        // The data disk's busy share where /proc/diskstats names it (not on tmpfs).
        let disk = &report["starckpt"][phase]["disk_busy"];
        match report["disk"].is_string() {
            true => assert!((0.0..=1.0).contains(&disk.as_f64().unwrap()), "{phase}: {report}"),
            false => assert!(disk.is_null(), "{phase}: {report}"),
        }
    }
    // Persist is the part of committed after the stall, in every run, so in their medians too.
    let seconds = |phase: &str| report["starckpt"][phase]["seconds"].as_f64().unwrap();
    assert!(seconds("persist") < seconds("committed"), "{report}");
    for baseline in [
        "memcpy",
        "odirect_write_fsync",
        "odirect_write_fsync_from_all_memory",
        "buffered_write_fsync",
        "odirect_read",
        "odirect_read_into_all_memory",
        "odirect_read_chunk_files",
    ] {
        assert!(report["baselines"][baseline]["seconds"].as_f64().unwrap() > 0.0, "{baseline}: {report}");
    }
    for tcp in ["loopback_tcp_odirect_write", "odirect_read_loopback_tcp"] {
        assert!(report["baselines"][tcp].is_null(), "{tcp}: {report}");
    }
    for ratio in [
        "blocking_vs_memcpy",
        "committed_vs_odirect_write",
        "committed_vs_odirect_write_from_all_memory",
        "committed_vs_buffered_write_fsync",
        "persist_vs_odirect_write",
        "persist_vs_odirect_write_from_all_memory",
        "restore_vs_odirect_read",
        "restore_vs_odirect_read_into_all_memory",
        "restore_vs_odirect_read_chunk_files",
    ] {
        let value = report["ratios"][ratio].as_f64().unwrap();
        assert!(value.is_finite() && value > 0.0, "{ratio}: {report}");
    }
    let png = std::fs::read(&chart).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    only_the_cluster_is_left(&data);

    let bad_flags = [
        &["--size", "1MiB"][..],
        &["--ranks", "0"],
        &["--size", "lots"],
        &["--io-engine", "magic"],
        &["--shm-slots", "0"],
        &["--shm-slots", "257"],
        &["--shm-slots", "2", "--no-shm"],
    ];
    for bad in bad_flags {
        let output = std::process::Command::new(common::BIN).arg("bench").args(bad).output().unwrap();
        assert!(!output.status.success(), "{bad:?} should fail");
        assert!(!String::from_utf8_lossy(&output.stderr).contains("panicked"), "{bad:?}");
    }
}

/// Over TCP (`--no-shm`) the same bytes also travel the loopback into and out of an O_DIRECT file,
/// the transport's limit beside the disk's; over shared memory that baseline is not measured.
#[test]
fn bench_over_tcp_reports_the_loopback_baselines() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let report = bench(&["--runs", "1", "--targets", "1", "--no-shm"], &data, None);
    assert!(report["shm_slots"].is_null(), "{report}");
    for baseline in ["loopback_tcp_odirect_write", "odirect_read_loopback_tcp"] {
        assert!(report["baselines"][baseline]["seconds"].as_f64().unwrap() > 0.0, "{baseline}: {report}");
        // Both ends of the connection run in the bench's process.
        assert!(report["baselines"][baseline]["cpu_seconds_per_gb"].as_f64().unwrap() > 0.0, "{baseline}: {report}");
    }
    for ratio in [
        "committed_vs_loopback_tcp_odirect_write",
        "persist_vs_loopback_tcp_odirect_write",
        "restore_vs_odirect_read_loopback_tcp",
    ] {
        let value = report["ratios"][ratio].as_f64().unwrap();
        assert!(value.is_finite() && value > 0.0, "{ratio}: {report}");
    }
    only_the_cluster_is_left(&data);
}
