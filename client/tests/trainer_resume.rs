#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
//! The example trainer (`examples/trainer.rs`) as a real process: SIGKILLed in the middle of an
//! upload, started again, it resumes from `latest` and verifies the restored state bit for bit.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};

use starckpt_client::{CheckpointState, Client, ClientConfig};
use starckpt_server::chunkserver::EngineKind;
use starckpt_server::dev::DevCluster;

mod common;

/// `cargo test` builds the examples next to the test binaries.
fn trainer_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let path = exe.parent().unwrap().parent().unwrap().join("examples").join("trainer");
    assert!(
        path.exists(),
        "{} is missing: run the tests with `cargo test --workspace` (it builds the examples)",
        path.display()
    );
    path
}

fn start_trainer(server: &str) -> (Child, BufReader<ChildStdout>) {
    let mut child = Command::new(trainer_binary())
        .args(["--server", server, "--job", "resume", "--state-mib", "160", "--steps", "12", "--save-every", "2"])
        .args(["--update-fraction", "0.3", "--seed", "7"])
        .env_remove("STARCKPT_RUN_ID")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    (child, stdout)
}

/// The next JSON line the trainer prints.
fn next_event(stdout: &mut BufReader<ChildStdout>) -> serde_json::Value {
    let mut line = String::new();
    assert!(stdout.read_line(&mut line).unwrap() > 0, "the trainer exited early");
    serde_json::from_str(&line).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_trainer_resumes_after_sigkill_mid_upload() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = DevCluster::start(dir.path(), "127.0.0.1:0", 2, EngineKind::Uring).await.unwrap();
    let server = cluster.control_address.to_string();
    let client = Client::connect(ClientConfig::new(server.clone())).await.unwrap();
    common::wait_alive(&client, 2).await;

    // First run: kill it the moment step 6 is staged, while its upload is under way.
    let (mut child, mut stdout) = start_trainer(&server);
    let killed_at = tokio::task::spawn_blocking(move || {
        loop {
            let event = next_event(&mut stdout);
            if event["event"] == "staged" && event["step"] == 6 {
                child.kill().unwrap();
                child.wait().unwrap();
                return event;
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(killed_at["step"], 6);
    let latest = client.latest("resume").await.unwrap().expect("steps 2 and 4 committed before the kill");
    assert!(latest.step == 4, "step 6 was still uploading when killed, so latest is 4, not {}", latest.step);

    // Second run: a new run takes the job's lease, resumes from step 4 and verifies it.
    let (mut child, mut stdout) = start_trainer(&server);
    let events = tokio::task::spawn_blocking(move || {
        let mut events = Vec::new();
        let mut line = String::new();
        while stdout.read_line(&mut line).unwrap() > 0 {
            events.push(serde_json::from_str::<serde_json::Value>(&line).unwrap());
            line.clear();
        }
        assert!(child.wait().unwrap().success(), "the resumed trainer failed: {events:?}");
        events
    })
    .await
    .unwrap();
    let resumed = events.iter().find(|e| e["event"] == "resumed").expect("no resume");
    assert_eq!((resumed["step"].as_u64(), resumed["verified"].as_bool()), (Some(4), Some(true)));
    let saved: Vec<u64> =
        events.iter().filter(|e| e["event"] == "saved").map(|e| e["step"].as_u64().unwrap()).collect();
    assert_eq!(saved, vec![6, 8, 10, 12]);
    // Unchanged tensors cost nothing: every save after the first of a run deduplicates some.
    for event in events.iter().filter(|e| e["event"] == "saved") {
        assert!(event["written_bytes"].as_u64().unwrap() < event["bytes"].as_u64().unwrap(), "{event}");
    }
    // The killed run's half-uploaded step 6 was aborted when the new run took over; the trainer's
    // retention (keep the last 3) deleted the older committed ones.
    let all = client.list_checkpoints("resume", true).await.unwrap();
    let in_state = |state: CheckpointState| -> Vec<u64> {
        all.iter().filter(|c| c.state == state as i32).map(|c| c.step).collect()
    };
    assert_eq!(in_state(CheckpointState::Aborted), vec![6]);
    assert_eq!(in_state(CheckpointState::Committed), vec![8, 10, 12]);
    assert_eq!(in_state(CheckpointState::Deleted), vec![2, 4, 6]);

    // A third start resumes from the final step, verifying it too, and has nothing left to do.
    let (mut child, mut stdout) = start_trainer(&server);
    let resumed = tokio::task::spawn_blocking(move || {
        let event = next_event(&mut stdout);
        assert!(child.wait().unwrap().success());
        event
    })
    .await
    .unwrap();
    assert_eq!((resumed["event"].as_str(), resumed["step"].as_u64()), (Some("resumed"), Some(12)));
    assert_eq!(resumed["verified"], true);
    cluster.shutdown().await.unwrap();
}
