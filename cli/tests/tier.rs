#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
//! The object-store tier end to end: real `starckpt server --tier` and target processes, the real
//! CLI, a real object store: a directory (`file://`), and an S3 API server (moto's, which
//! scripts/test starts; `starckpt_server::testing`).

mod common;

use std::sync::Arc;

use common::{Cluster, random_bytes, tree};
use futures::TryStreamExt;
use object_store::ObjectStore;
use object_store::path::Path;

/// Objects under `prefix` in `store`.
fn count(store: &Arc<dyn ObjectStore>, prefix: &str) -> u64 {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let listed: Vec<_> = store.list(Some(&Path::from(prefix))).try_collect().await.unwrap();
        listed.len() as u64
    })
}

/// Restarts every target with its chunk files gone.
fn lose_every_copy(cluster: &mut Cluster) {
    for index in 0..cluster.targets.len() {
        cluster.targets[index].kill();
        for file in cluster.chunk_files(index) {
            std::fs::remove_file(file).unwrap();
        }
        cluster.targets[index] = cluster.start_target(index);
    }
    cluster.wait_alive(cluster.targets.len());
}

/// Saves, tiers, loses every copy on the targets, restores from the tier, deletes, sweeps.
/// With `metrics`, the control plane's metrics address: the recoveries are checked to be batched.
fn lose_every_target_copy_and_restore_from_the_tier(
    mut cluster: Cluster,
    store: Arc<dyn ObjectStore>,
    metrics: Option<&str>,
) {
    let source = cluster.dir.path().join("source");
    for (index, len) in [(9 << 20) + 5, 3 << 20, 1000].into_iter().enumerate() {
        std::fs::create_dir_all(source.join("model")).unwrap();
        std::fs::write(source.join(format!("model/part-{index}.bin")), random_bytes(len, index as u64)).unwrap();
    }
    cluster.json(&["save", "--job", "llm", "--step", "1", source.to_str().unwrap()]);
    let report = cluster.json(&["tier"]);
    assert_eq!((report["ran"].as_bool(), report["checkpoints_tiered"].as_u64()), (Some(true), Some(1)), "{report}");
    assert_eq!(report["checkpoints_behind"], 0, "{report}");
    let chunks = report["chunks_uploaded"].as_u64().unwrap();
    assert!(chunks >= 4, "{report}");
    assert_eq!(count(&store, "chunks"), chunks);
    assert_eq!(count(&store, "checkpoints"), 2, "one rank's manifest and the checkpoint's record");
    let listed = cluster.json(&["ls", "llm"]);
    assert!(listed[0]["tiered_at_ms"].as_u64().unwrap() > 0, "{listed}");

    // Nothing new: nothing to do. The same bytes at the next step: only its manifest travels.
    let again = cluster.json(&["tier"]);
    assert_eq!((again["checkpoints_tiered"].as_u64(), again["chunks_uploaded"].as_u64()), (Some(0), Some(0)));
    cluster.json(&["save", "--job", "llm", "--step", "2", source.to_str().unwrap()]);
    let second = cluster.json(&["tier"]);
    assert_eq!((second["checkpoints_tiered"].as_u64(), second["chunks_uploaded"].as_u64()), (Some(1), Some(0)));
    assert_eq!(second["chunks_present"].as_u64(), Some(chunks), "{second}");
    assert_eq!(count(&store, "checkpoints"), 4);

    // Every copy on every target is lost.
    lose_every_copy(&mut cluster);
    assert_eq!(cluster.total_chunks(), 0);
    // A restore right away (before any re-replication pass) finds no copy, and has the control
    // plane bring each chunk back from the tier onto the targets as it goes.
    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "llm", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(tree(&source), tree(&restored));
    assert!(cluster.total_chunks() as u64 >= chunks, "the recovered chunks are on the targets again");
    if let Some(metrics) = metrics {
        // The readers that found no copy queued their chunks for the control plane together
        // (`client/src/recovery.rs`): fewer calls than chunks.
        let text = common::scrape(metrics);
        let recovered = common::value(&text, "starckpt_control_recovered_chunks_total").unwrap_or(0.0);
        let calls: f64 = text
            .lines()
            .filter(|l| l.starts_with("starckpt_control_requests_total{") && l.contains("method=\"RecoverChunks\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        assert!(
            recovered >= chunks as f64 && calls >= 1.0 && calls < recovered,
            "{calls} calls for {recovered} chunks"
        );
    }
    // Every copy on the targets rots: present is not readable, so the recovery verifies what it
    // finds, reads the tier's copy, and rewrites the bad ones.
    for index in 0..cluster.targets.len() {
        for file in cluster.chunk_files(index) {
            let mut bytes = std::fs::read(&file).unwrap();
            let middle = 4096 + (bytes.len() - 4096) / 2;
            bytes[middle] ^= 1;
            std::fs::write(&file, bytes).unwrap();
        }
    }
    let rotted = cluster.dir.path().join("restored-rotted");
    cluster.ok(&["restore", "--job", "llm", "--latest", "--to", rotted.to_str().unwrap()]);
    assert_eq!(tree(&source), tree(&rotted));
    let repair = cluster.json(&["repair"]);
    assert_eq!((repair["from_tier"].as_u64(), repair["unreadable"].as_u64()), (Some(0), Some(0)), "{repair}");
    assert_eq!(repair["still_under_replicated"].as_u64(), Some(0), "{repair}");
    // Lost again: the re-replication pass reads them back from the tier too.
    lose_every_copy(&mut cluster);
    let repair = cluster.json(&["repair"]);
    assert_eq!((repair["from_tier"].as_u64(), repair["unreadable"].as_u64()), (Some(chunks), Some(0)), "{repair}");
    let restored = cluster.dir.path().join("restored-again");
    cluster.ok(&["restore", "--job", "llm", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(tree(&source), tree(&restored));

    // Deleted checkpoints leave the tier; chunks go with the last checkpoint naming them.
    cluster.ok(&["rm", "llm", "1"]);
    let swept = cluster.json(&["tier"]);
    assert_eq!(swept["swept"], true, "a pass on request always sweeps");
    assert_eq!((swept["manifests_deleted"].as_u64(), swept["chunks_deleted"].as_u64()), (Some(1), Some(0)));
    cluster.ok(&["rm", "llm", "2"]);
    let swept = cluster.json(&["tier"]);
    assert_eq!((swept["manifests_deleted"].as_u64(), swept["chunks_deleted"].as_u64()), (Some(1), Some(chunks)));
    assert_eq!((count(&store, "chunks"), count(&store, "checkpoints")), (0, 0));
}

#[test]
fn a_directory_tier_restores_what_every_target_lost() {
    let tier = tempfile::tempdir().unwrap();
    let url = format!("file://{}", tier.path().display());
    // No background re-replication: the restore's own recovery is what brings chunks back.
    let metrics = common::free_address();
    let flags =
        ["--tier", &url, "--tier-interval-secs", "0", "--repair-interval-secs", "0", "--metrics-listen", &metrics];
    let cluster = Cluster::start_with(2, &flags);
    let store: Arc<dyn ObjectStore> =
        Arc::new(object_store::local::LocalFileSystem::new_with_prefix(tier.path()).unwrap());
    lose_every_target_copy_and_restore_from_the_tier(cluster, store, Some(&metrics));
}

/// What the control plane and the CLI need to reach the tests' S3 server.
fn s3_env(endpoint: &str) -> [(&'static str, &str); 5] {
    [
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("AWS_REGION", "us-east-1"),
        ("AWS_ENDPOINT", endpoint),
        ("AWS_ALLOW_HTTP", "true"),
    ]
}

/// A cluster tiering to a new bucket of the tests' S3 server, under prefix `cluster`: (cluster,
/// tier URL, endpoint, bucket); None where the tests have no S3 server.
fn s3_cluster(test: &str) -> Option<(Cluster, String, String, String)> {
    let (endpoint, bucket) = starckpt_server::testing::fresh_s3_bucket(test).unwrap()?;
    let url = format!("s3://{bucket}/cluster");
    let flags = ["--tier", &url, "--tier-interval-secs", "0", "--repair-interval-secs", "0"];
    let cluster = Cluster::start_with_env(2, &flags, &s3_env(&endpoint));
    Some((cluster, url, endpoint, bucket))
}

#[test]
fn an_s3_tier_restores_what_every_target_lost() {
    let Some((cluster, _, endpoint, bucket)) = s3_cluster("an_s3_tier") else { return };
    let s3 = object_store::aws::AmazonS3Builder::new()
        .with_endpoint(&endpoint)
        .with_allow_http(true)
        .with_region("us-east-1")
        .with_access_key_id("test")
        .with_secret_access_key("test")
        .with_bucket_name(&bucket)
        .build()
        .unwrap();
    let store: Arc<dyn ObjectStore> = Arc::new(object_store::prefix::PrefixStore::new(s3, "cluster"));
    lose_every_target_copy_and_restore_from_the_tier(cluster, store, None);
}

/// Runs the CLI with extra environment variables (a tier's credentials).
fn cli_env(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut command = std::process::Command::new(common::BIN);
    command.args(args);
    for (key, value) in env {
        command.env(key, value);
    }
    command.output().unwrap()
}

/// Two checkpoints tiered, a third not; then the cluster is gone, database and targets: the tier
/// alone restores what it holds, each chunk verified, and only complete checkpoints count.
fn restore_from_the_tier_alone(cluster: Cluster, url: &str, env: &[(&str, &str)]) -> tempfile::TempDir {
    let kept = tempfile::tempdir().unwrap();
    let trees: Vec<_> = (1..=3u64)
        .map(|step| {
            let source = kept.path().join(format!("source-{step}"));
            std::fs::create_dir_all(source.join("model")).unwrap();
            std::fs::write(source.join("model/weights.bin"), random_bytes((6 << 20) + 11, step)).unwrap();
            std::fs::write(source.join("step.txt"), step.to_string()).unwrap();
            cluster.json(&["save", "--job", "llm", "--step", &step.to_string(), source.to_str().unwrap()]);
            if step == 2 {
                assert_eq!(cluster.json(&["tier"])["checkpoints_tiered"], 2);
            }
            source
        })
        .collect();
    drop(cluster);

    // No control plane answers at --server: none is asked.
    let listed = cli_env(&["--server", "127.0.0.1:1", "ls", "llm", "--from-tier", url, "--json"], env);
    assert!(listed.status.success(), "{}", String::from_utf8_lossy(&listed.stderr));
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    let steps: Vec<_> = listed.as_array().unwrap().iter().map(|c| (c["step"].as_u64(), c["state"].clone())).collect();
    assert_eq!(steps, [(Some(1), "committed".into()), (Some(2), "committed".into())], "{listed}");
    assert!(listed[1]["tiered_at_ms"].as_u64().unwrap() > 0, "{listed}");
    let restore = |args: &[&str], to: &str| {
        let to = kept.path().join(to);
        let mut all = vec!["--server", "127.0.0.1:1", "restore", "--job", "llm", "--from-tier", url];
        all.extend_from_slice(args);
        all.extend(["--to", to.to_str().unwrap()]);
        (cli_env(&all, env), to)
    };
    let (output, latest) = restore(&["--latest"], "latest");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(String::from_utf8_lossy(&output.stdout).contains("step 2"), "the untiered step 3 is not in the tier");
    assert_eq!(tree(&trees[1]), tree(&latest));
    let (output, first) = restore(&["--step", "1"], "first");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(tree(&trees[0]), tree(&first));
    let (output, third) = restore(&["--step", "3"], "third");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("no complete checkpoint of llm at step 3"), "{stderr}");
    assert!(!third.exists());
    kept
}

#[test]
fn a_directory_tier_alone_restores_when_the_cluster_is_gone() {
    let tier = tempfile::tempdir().unwrap();
    let url = format!("file://{}", tier.path().display());
    let cluster = Cluster::start_with(2, &["--tier", &url, "--tier-interval-secs", "0"]);
    let kept = restore_from_the_tier_alone(cluster, &url, &[]);
    let restore_latest = |job: &str, to: &str| {
        let to = kept.path().join(to);
        let args = ["restore", "--job", job, "--latest", "--from-tier", &url, "--to", to.to_str().unwrap()];
        (cli_env(&args, &[]), to)
    };

    // A pass cut short before a checkpoint's record: that checkpoint does not count. With step
    // 2's record gone, the latest complete checkpoint in the tier is step 1.
    let records: Vec<_> = walk(tier.path()).into_iter().filter(|p| p.ends_with("checkpoint.info")).collect();
    assert_eq!(records.len(), 2, "{records:?}");
    let step_two = records.iter().find(|p| p.to_str().unwrap().contains(&format!("/{:020}-", 2))).unwrap();
    std::fs::remove_file(step_two).unwrap();
    let (output, to) = restore_latest("llm", "without-two");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(String::from_utf8_lossy(&output.stdout).contains("step 1"));
    assert_eq!(tree(&kept.path().join("source-1")), tree(&to));

    // Chunks that rotted in the tier fail the restore, named, and leave nothing behind.
    let chunks = walk(&tier.path().join("chunks"));
    for chunk in &chunks {
        let mut bytes = std::fs::read(chunk).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 1;
        std::fs::write(chunk, bytes).unwrap();
    }
    let (output, to) = restore_latest("llm", "rotted");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let named = chunks.iter().any(|c| stderr.contains(c.file_name().unwrap().to_str().unwrap()));
    assert!(!output.status.success() && named && stderr.contains("tier"), "{stderr}");
    assert!(!to.exists());

    // A tier directory that does not exist (a typo) is an error, and is not made.
    let missing = kept.path().join("no-such-tier");
    let url_missing = format!("file://{}", missing.display());
    let output = cli_env(&["ls", "llm", "--from-tier", &url_missing], &[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("is not a directory"), "{stderr}");
    assert!(!missing.exists());

    // No such job in the tier: a clear error.
    let (output, _) = restore_latest("other", "other");
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(!output.status.success() && stderr.contains("no complete checkpoint of other"), "{stderr}");
}

#[test]
fn a_new_cluster_adopts_the_checkpoints_of_a_tier() {
    let tier = tempfile::tempdir().unwrap();
    let url = format!("file://{}", tier.path().display());
    let flags = ["--tier", url.as_str(), "--tier-interval-secs", "0"];
    let kept = tempfile::tempdir().unwrap();
    // With bearer tokens: only an admin's token may start a tenant's job (below).
    let tokens = kept.path().join("tokens");
    let admin = common::new_token(&tokens, &["--admin"]);
    let old = Cluster::start_with_tokens(2, &tokens, &admin, &flags);
    // Checkpoints saved and deleted first, so the old database's ids are not the new one's.
    std::fs::write(kept.path().join("scratch"), b"scratch").unwrap();
    for step in ["1", "2"] {
        old.json(&["save", "--job", "scratch", "--step", step, kept.path().join("scratch").to_str().unwrap()]);
        old.ok(&["rm", "scratch", step]);
    }
    let trees: Vec<_> = (1..=2u64)
        .map(|step| {
            let source = kept.path().join(format!("source-{step}"));
            std::fs::create_dir_all(&source).unwrap();
            std::fs::write(source.join("weights.bin"), random_bytes((5 << 20) + 3, step)).unwrap();
            old.json(&["save", "--job", "llm", "--step", &step.to_string(), source.to_str().unwrap()]);
            source
        })
        .collect();
    // A tenant's job (tenants.rs), saved here by the operator under its stored name. Its chunks
    // are addressed with a key derived from this cluster's (starckpt_proto::address), which its
    // manifest records.
    old.json(&["save", "--job", "acme/llm", "--step", "9", trees[0].to_str().unwrap()]);
    assert_eq!(old.json(&["tier"])["checkpoints_tiered"], 3);
    drop(old);
    let listed = cli_env(&["--server", "127.0.0.1:1", "ls", "acme/llm", "--from-tier", &url, "--json"], &[]);
    assert!(listed.status.success(), "{}", String::from_utf8_lossy(&listed.stderr));
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!((listed[0]["job"].as_str(), listed[0]["step"].as_u64()), (Some("acme/llm"), Some(9)), "{listed}");
    // Restored from the tier alone, the tenant's chunks verify with the key their manifest records.
    let to = kept.path().join("acme-from-tier");
    let restore = ["--server", "127.0.0.1:1", "restore", "--job", "acme/llm", "--latest", "--from-tier", &url];
    let restore: Vec<&str> = restore.iter().copied().chain(["--to", to.to_str().unwrap()]).collect();
    let output = cli_env(&restore, &[]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(tree(&trees[0]), tree(&to));

    // A new cluster on the same tier: a new database, empty targets, another cluster key (the
    // tenant's old chunks keep the key their manifests record).
    let new = Cluster::start_with_tokens(2, &tokens, &admin, &flags);
    assert!(new.json(&["ls"]).as_array().unwrap().is_empty());
    let report = new.json(&["tier", "--import"]);
    let mut imported: Vec<_> = report["imported"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["job"].as_str().unwrap().to_owned(), c["step"].as_u64().unwrap()))
        .collect();
    imported.sort();
    let expected = [("acme/llm".to_owned(), 9), ("llm".to_owned(), 1), ("llm".to_owned(), 2)];
    assert_eq!((imported.as_slice(), report["present"].as_u64()), (&expected[..], Some(0)), "{report}");
    let again = new.json(&["tier", "--import", "--job", "llm"]);
    assert_eq!((again["imported"].as_array().unwrap().len(), again["present"].as_u64()), (0, Some(2)), "{again}");
    let jobs = new.json(&["ls"]);
    let llm = jobs.as_array().unwrap().iter().find(|j| j["job"] == "llm").unwrap();
    assert_eq!(llm["latest_step"], 2);

    // Re-replication brings the chunks from the tier onto the targets; restores read them there.
    let repair = new.json(&["repair"]);
    assert!(repair["from_tier"].as_u64().unwrap() > 0 && repair["unreadable"] == 0, "{repair}");
    for (step, source) in trees.iter().enumerate() {
        let to = kept.path().join(format!("restored-{step}"));
        new.ok(&["restore", "--job", "llm", "--step", &(step + 1).to_string(), "--to", to.to_str().unwrap()]);
        assert_eq!(tree(source), tree(&to));
    }
    let to = kept.path().join("restored-acme");
    new.ok(&["restore", "--job", "acme/llm", "--step", "9", "--to", to.to_str().unwrap()]);
    assert_eq!(tree(&trees[0]), tree(&to));
    // The next pass records them under their new ids (their chunks are there already), and
    // sweeps the old ids' manifests and records.
    let pass = new.json(&["tier"]);
    assert_eq!((pass["checkpoints_tiered"].as_u64(), pass["chunks_uploaded"].as_u64()), (Some(3), Some(0)), "{pass}");
    assert_eq!(pass["manifests_deleted"], 3, "{pass}");
    let records = walk(tier.path()).into_iter().filter(|p| p.ends_with("checkpoint.info")).count();
    assert_eq!(records, 3);
    // New checkpoints of the tenant's job are addressed with the new cluster's key: the same
    // bytes are stored once more, and both steps read back.
    let saved = new.json(&["save", "--job", "acme/llm", "--step", "10", trees[0].to_str().unwrap()]);
    assert_eq!(saved["deduplicated_chunks"], 0, "{saved}");
    for step in ["9", "10"] {
        let to = kept.path().join(format!("acme-{step}"));
        new.ok(&["restore", "--job", "acme/llm", "--step", step, "--to", to.to_str().unwrap()]);
        assert_eq!(tree(&trees[0]), tree(&to));
    }
}

/// Every file under `dir`.
#[test]
fn an_import_waits_for_the_garbage_collection_pass_under_way() {
    // A pass that marked before an import commits must not sweep after it: its mark does not
    // hold the imported checkpoint's chunks (server/src/control/gc.rs). The pass here is held 3 s
    // between its mark and its sweep.
    let tier = tempfile::tempdir().unwrap();
    let url = format!("file://{}", tier.path().display());
    let flags = ["--tier", url.as_str(), "--tier-interval-secs", "0"];
    let cluster = Cluster::start_with_env(2, &flags, &[("FAILPOINTS", "control.gc.mark=sleep(3000)")]);
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("weights.bin"), random_bytes((5 << 20) + 3, 7)).unwrap();
    cluster.json(&["save", "--job", "llm", "--step", "1", source.to_str().unwrap()]);
    assert_eq!(cluster.json(&["tier"])["checkpoints_tiered"], 1);
    // Deleted by mistake: the tier still holds it until its next pass.
    cluster.ok(&["rm", "llm", "1"]);
    let mut pass = cluster.spawn(&["gc"]);
    let log = cluster.dir.path().join("server.log");
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !read_log().contains("garbage collection pass marked the live chunks") {
        assert!(std::time::Instant::now() < deadline, "the garbage-collection pass never marked");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let report = cluster.json(&["tier", "--import"]);
    assert!(pass.wait().unwrap().success());
    assert_eq!(report["imported"].as_array().unwrap().len(), 1, "{report}");
    let log = read_log();
    let (done, imported) = (log.find("garbage collection pass done"), log.find("imported from the object-store tier"));
    assert!(
        matches!((done, imported), (Some(done), Some(imported)) if done < imported),
        "the import committed while a garbage-collection pass was under way:\n{log}"
    );
    let to = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "llm", "--latest", "--to", to.to_str().unwrap()]);
    assert_eq!(tree(&source), tree(&to));
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() { files.extend(walk(&path)) } else { files.push(path) }
    }
    files
}

#[test]
fn an_s3_tier_alone_restores_when_the_cluster_is_gone() {
    let Some((cluster, url, endpoint, _)) = s3_cluster("tier_alone") else { return };
    restore_from_the_tier_alone(cluster, &url, &s3_env(&endpoint));
}

#[test]
fn bad_tiers_are_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("meta.db");
    for (tier, says) in [("ftp://host/x", "unsupported scheme"), ("s3://", "no bucket"), ("not a url", "tier")] {
        let output = std::process::Command::new(common::BIN)
            .args(["server", "--listen", "127.0.0.1:0", "--db", db.to_str().unwrap(), "--tier", tier])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success() && stderr.contains(says), "{tier}: {stderr}");
    }
    // A control plane without a tier says so.
    let cluster = Cluster::start(1);
    let refused = cluster.fails(&["tier"]);
    assert!(refused.contains("no object-store tier"), "{refused}");
}

#[test]
fn a_tier_object_of_the_wrong_size_is_uploaded_again() {
    let tier = tempfile::tempdir().unwrap();
    let url = format!("file://{}", tier.path().display());
    let cluster = Cluster::start_with(2, &["--tier", &url, "--tier-interval-secs", "0"]);
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("weights.bin"), random_bytes(10 << 20, 11)).unwrap();
    cluster.json(&["save", "--job", "llm", "--step", "1", source.to_str().unwrap()]);
    let first = cluster.json(&["tier"]);
    let chunks = first["chunks_uploaded"].as_u64().unwrap();
    assert!(chunks >= 3, "{first}");
    // One chunk's object loses its last bytes (something else wrote it, or it was damaged).
    let objects = walk(&tier.path().join("chunks"));
    let damaged = &objects[0];
    let whole = std::fs::read(damaged).unwrap();
    std::fs::write(damaged, &whole[..whole.len() - 1]).unwrap();
    // The same bytes at the next step: the damaged chunk travels again, the others do not.
    cluster.json(&["save", "--job", "llm", "--step", "2", source.to_str().unwrap()]);
    let second = cluster.json(&["tier"]);
    assert_eq!((second["chunks_uploaded"].as_u64(), second["chunks_present"].as_u64()), (Some(1), Some(chunks - 1)));
    assert_eq!(std::fs::read(damaged).unwrap(), whole);
}

#[test]
fn a_checkpoint_waits_for_the_tier_until_every_chunk_is_readable() {
    let tier = tempfile::tempdir().unwrap();
    let url = format!("file://{}", tier.path().display());
    let mut cluster = Cluster::start_with(2, &["--tier", &url, "--tier-interval-secs", "0"]);
    cluster.ok(&["replication", "llm", "1"]);
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("weights.bin"), random_bytes(24 << 20, 7)).unwrap();
    cluster.json(&["save", "--job", "llm", "--step", "1", source.to_str().unwrap()]);
    // One copy per chunk: with a target down, some chunk has no readable copy.
    cluster.targets[1].kill();
    let (succeeded, behind) = cluster.json_outcome(&["tier"]);
    assert!(!succeeded, "a pass that leaves a checkpoint behind exits non-zero: {behind}");
    assert_eq!((behind["checkpoints_tiered"].as_u64(), behind["checkpoints_behind"].as_u64()), (Some(0), Some(1)));
    assert!(behind["errors"][0].as_str().unwrap().contains("no live target has a verified copy"), "{behind}");
    assert!(cluster.json(&["ls", "llm"])[0]["tiered_at_ms"].is_null());
    // Back up: the next pass finishes it (what the first uploaded is already there).
    cluster.targets[1] = cluster.start_target(1);
    cluster.wait_alive(2);
    let done = cluster.json(&["tier"]);
    assert_eq!((done["checkpoints_tiered"].as_u64(), done["checkpoints_behind"].as_u64()), (Some(1), Some(0)));
    assert!(cluster.json(&["ls", "llm"])[0]["tiered_at_ms"].as_u64().is_some());
}
