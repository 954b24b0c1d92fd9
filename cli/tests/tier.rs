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

/// Saves, tiers, loses every copy on the targets, restores from the tier, deletes, sweeps.
fn lose_every_target_copy_and_restore_from_the_tier(mut cluster: Cluster, store: Arc<dyn ObjectStore>) {
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
    assert_eq!(count(&store, "checkpoints"), 1, "one rank's manifest");
    let listed = cluster.json(&["ls", "llm"]);
    assert!(listed[0]["tiered_at_ms"].as_u64().unwrap() > 0, "{listed}");

    // Nothing new: nothing to do. The same bytes at the next step: only its manifest travels.
    let again = cluster.json(&["tier"]);
    assert_eq!((again["checkpoints_tiered"].as_u64(), again["chunks_uploaded"].as_u64()), (Some(0), Some(0)));
    cluster.json(&["save", "--job", "llm", "--step", "2", source.to_str().unwrap()]);
    let second = cluster.json(&["tier"]);
    assert_eq!((second["checkpoints_tiered"].as_u64(), second["chunks_uploaded"].as_u64()), (Some(1), Some(0)));
    assert_eq!(second["chunks_present"].as_u64(), Some(chunks), "{second}");
    assert_eq!(count(&store, "checkpoints"), 2);

    // Every copy on every target is lost.
    for index in 0..cluster.targets.len() {
        cluster.targets[index].kill();
        for file in cluster.chunk_files(index) {
            std::fs::remove_file(file).unwrap();
        }
        cluster.targets[index] = cluster.start_target(index);
    }
    cluster.wait_alive(cluster.targets.len());
    assert_eq!(cluster.total_chunks(), 0);
    let repair = cluster.json(&["repair"]);
    assert_eq!((repair["from_tier"].as_u64(), repair["unreadable"].as_u64()), (Some(chunks), Some(0)), "{repair}");
    let restored = cluster.dir.path().join("restored");
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
    let cluster = Cluster::start_with(2, &["--tier", &url, "--tier-interval-secs", "0"]);
    let store: Arc<dyn ObjectStore> =
        Arc::new(object_store::local::LocalFileSystem::new_with_prefix(tier.path()).unwrap());
    lose_every_target_copy_and_restore_from_the_tier(cluster, store);
}

#[test]
fn an_s3_tier_restores_what_every_target_lost() {
    let Some((endpoint, bucket)) = starckpt_server::testing::fresh_s3_bucket("an_s3_tier").unwrap() else { return };
    let env = [
        ("AWS_ACCESS_KEY_ID", "test"),
        ("AWS_SECRET_ACCESS_KEY", "test"),
        ("AWS_REGION", "us-east-1"),
        ("AWS_ENDPOINT", endpoint.as_str()),
        ("AWS_ALLOW_HTTP", "true"),
    ];
    let url = format!("s3://{bucket}/cluster-a");
    let cluster = Cluster::start_with_env(2, &["--tier", &url, "--tier-interval-secs", "0"], &env);
    let s3 = object_store::aws::AmazonS3Builder::new()
        .with_endpoint(&endpoint)
        .with_allow_http(true)
        .with_region("us-east-1")
        .with_access_key_id("test")
        .with_secret_access_key("test")
        .with_bucket_name(&bucket)
        .build()
        .unwrap();
    let store: Arc<dyn ObjectStore> = Arc::new(object_store::prefix::PrefixStore::new(s3, "cluster-a"));
    lose_every_target_copy_and_restore_from_the_tier(cluster, store);
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
    let behind = cluster.json(&["tier"]);
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
