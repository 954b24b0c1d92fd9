#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
//! The checkpoint manager and the preemption helper against a real cluster. Its own test binary:
//! it sends SIGTERM to this process.

use std::time::Duration;

use bytes::Bytes;
use starckpt_client::{
    CheckpointManager, CheckpointPolicy, Client, ClientConfig, FinalReport, IfBusy, SavePart, TargetState,
};
use starckpt_server::dev::DevCluster;
use starckpt_server::target::EngineKind;

fn state(step: u64) -> Bytes {
    Bytes::from((0..200_000u32).map(|i| (i as u64 * 31 + step) as u8).collect::<Vec<u8>>())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn periodic_saves_then_a_final_save_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = DevCluster::start(dir.path(), "127.0.0.1:0", 2, EngineKind::Uring).await.unwrap();
    let client = Client::connect(ClientConfig::new(cluster.control_address.to_string())).await.unwrap();
    for _ in 0..100 {
        if client.targets().await.unwrap().iter().filter(|t| t.state == TargetState::Alive as i32).count() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let preempted = starckpt_client::preemption_signal().unwrap();

    let policy = CheckpointPolicy { every_steps: Some(2), every: None, if_busy: IfBusy::Wait };
    let mut manager = CheckpointManager::new(client.clone(), "train", policy);
    for step in 1..=6 {
        manager.maybe_save(step, |part| part.buffer("model.bin", state(step))).await.unwrap();
    }
    assert!(matches!(manager.finish(Duration::from_secs(30)).await, Some(FinalReport::Committed { step: 5 })));
    let steps: Vec<u64> = client.list_checkpoints("train", false).await.unwrap().iter().map(|c| c.step).collect();
    assert_eq!(steps, vec![1, 3, 5], "every second step, starting with the first");

    // The scheduler preempts the job: SIGTERM. The trainer notices and takes a final save.
    assert!(!*preempted.borrow());
    // SAFETY: raising a signal this process handles.
    unsafe { libc::raise(libc::SIGTERM) };
    let mut flag = preempted.clone();
    tokio::time::timeout(Duration::from_secs(10), flag.wait_for(|p| *p)).await.unwrap().unwrap();
    let report =
        manager.save_final(7, |part: SavePart| part.buffer("model.bin", state(7)), Duration::from_secs(30)).await;
    assert!(matches!(report, FinalReport::Committed { step: 7 }), "{report:?}");

    let latest = client.latest("train").await.unwrap().unwrap();
    assert_eq!(latest.step, 7);
    // A second signal handler run for the same step finds it committed, without saving twice.
    let again =
        manager.save_final(7, |part: SavePart| part.buffer("model.bin", state(7)), Duration::from_secs(30)).await;
    assert!(matches!(again, FinalReport::Committed { step: 7 }), "{again:?}");
    let manifest = client.manifest("train", None).await.unwrap();
    assert_eq!(client.read_file(&manifest, "model.bin").await.unwrap(), state(7));
    cluster.shutdown().await.unwrap();
}
