#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
//! The checkpoint manager and the preemption helper against a real cluster. Its own test binary:
//! it sends SIGTERM to this process.

use std::time::Duration;

use bytes::Bytes;
use starckpt_client::{
    CheckpointManager, CheckpointPolicy, CheckpointState, FinalReport, IfBusy, RetentionPolicy, SavePart,
};

mod common;

fn state(step: u64) -> Bytes {
    Bytes::from((0..200_000u32).map(|i| (i as u64 * 31 + step) as u8).collect::<Vec<u8>>())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn periodic_saves_then_a_final_save_on_sigterm() {
    let (_dir, cluster, client) = common::cluster(2, |_| {}).await;
    let preempted = starckpt_client::preemption_signal().unwrap();

    // Keep the last two checkpoints, and every fourth step's.
    let retention = RetentionPolicy { keep_last: 2, keep_every: 4 };
    let policy =
        CheckpointPolicy { every_steps: Some(2), every: None, if_busy: IfBusy::Wait, retention: Some(retention) };
    let mut manager = CheckpointManager::new(client.clone(), "train", policy);
    for step in 1..=10 {
        manager.maybe_save(step, |part| part.buffer("model.bin", state(step))).await.unwrap();
    }
    assert!(matches!(manager.finish(Duration::from_secs(30)).await, Some(FinalReport::Committed { step: 9 })));
    assert_eq!(client.retention("train").await.unwrap(), retention);
    let all = client.list_checkpoints("train", true).await.unwrap();
    let steps = |state: CheckpointState| all.iter().filter(|c| c.state == state as i32).map(|c| c.step).collect();
    let (kept, deleted): (Vec<u64>, Vec<u64>) = (steps(CheckpointState::Committed), steps(CheckpointState::Deleted));
    assert_eq!(kept, vec![7, 9], "every second step saved, the last two kept (no multiple of 4 saved)");
    assert_eq!(deleted, vec![1, 3, 5]);

    // The scheduler preempts the job: SIGTERM. The trainer notices and takes a final save.
    assert!(!*preempted.borrow());
    // SAFETY: raising a signal this process handles.
    unsafe { libc::raise(libc::SIGTERM) };
    let mut flag = preempted.clone();
    tokio::time::timeout(Duration::from_secs(10), flag.wait_for(|p| *p)).await.unwrap().unwrap();
    let report =
        manager.save_final(11, |part: SavePart| part.buffer("model.bin", state(11)), Duration::from_secs(30)).await;
    assert!(matches!(report, FinalReport::Committed { step: 11 }), "{report:?}");

    let latest = client.latest("train").await.unwrap().unwrap();
    assert_eq!(latest.step, 11);
    // A second signal handler run for the same step finds it committed, without saving twice.
    let again =
        manager.save_final(11, |part: SavePart| part.buffer("model.bin", state(11)), Duration::from_secs(30)).await;
    assert!(matches!(again, FinalReport::Committed { step: 11 }), "{again:?}");
    let manifest = client.manifest("train", None).await.unwrap();
    assert_eq!(client.read_file(&manifest, "model.bin").await.unwrap(), state(11));
    cluster.shutdown().await.unwrap();
}
