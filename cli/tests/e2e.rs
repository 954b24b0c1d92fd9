#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
//! End to end: real `starckpt server` and `starckpt target` processes on 127.0.0.1, driven by the
//! real CLI.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{Cluster, cli_with_env, random_bytes, tree};

/// ~200 MB of random data in nested directories, with empty files and an empty directory.
fn make_tree(root: &Path) -> u64 {
    let mut total = 0u64;
    let files: &[(&str, usize)] = &[
        ("model/layer0.safetensors", 60 << 20),
        ("model/layer1.safetensors", 50 << 20),
        ("model/deep/a/b/c/tail.bin", (37 << 20) + 12_345),
        ("optim/rank0.pt", 40 << 20),
        ("optim/small.json", 1_000),
        ("rng.bin", 4096),
        ("odd-size.bin", (4 << 20) + 1),
        ("model/empty.bin", 0),
        ("empty-top", 0),
    ];
    for (index, (path, len)) in files.iter().enumerate() {
        let full = root.join(path);
        std::fs::create_dir_all(full.parent().unwrap()).unwrap();
        std::fs::write(&full, random_bytes(*len, index as u64)).unwrap();
        total += *len as u64;
    }
    std::fs::create_dir_all(root.join("logs/empty-dir")).unwrap();
    total
}

#[test]
fn save_and_restore_a_tree_across_three_targets() {
    let cluster = Cluster::start(3);
    let source = cluster.dir.path().join("source");
    let total = make_tree(&source);

    let saved = cluster.json(&["save", "--job", "llama", "--step", "100", source.to_str().unwrap()]);
    assert_eq!(saved["committed"], true);
    assert_eq!(saved["bytes"], total);

    let restored = cluster.dir.path().join("restored");
    // The job comes from the environment here, as a launcher script would set it.
    let output = std::process::Command::new(common::BIN)
        .args(["restore", "--latest", "--to", restored.to_str().unwrap()])
        .env("STARCKPT_SERVER", &cluster.server.address)
        .env("STARCKPT_JOB", "llama")
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(tree(&source), tree(&restored), "restored tree differs");

    // Chunks are spread over all three targets.
    for index in 0..3 {
        assert!(!cluster.chunk_files(index).is_empty(), "target {index} stores no chunk");
    }

    // Listings, human and JSON.
    let jobs = cluster.json(&["ls"]);
    assert_eq!(jobs[0]["job"], "llama");
    assert_eq!(jobs[0]["latest_step"], 100);
    let checkpoints = cluster.json(&["ls", "llama"]);
    assert_eq!(checkpoints[0]["state"], "committed");
    assert_eq!(checkpoints[0]["bytes"], total);
    let shown = cluster.ok(&["show", "llama", "100"]);
    assert!(shown.contains("model/deep/a/b/c/tail.bin"), "{shown}");
    assert!(shown.contains("logs/empty-dir/"), "{shown}");
    let status = cluster.json(&["status"]);
    assert_eq!(status["targets"].as_array().unwrap().len(), 3);
    assert!(status["targets"][0]["capacity_bytes"].as_u64().unwrap() > 0);
    // Targets on this host are reached over shared memory.
    assert!(status["targets"].as_array().unwrap().iter().all(|t| t["transport"] == "shm"), "{status}");
    // No RDMA device on this host: the targets registered none.
    assert!(status["targets"].as_array().unwrap().iter().all(|t| t["rdma_device"] == ""), "{status}");

    // A second save of unchanged data deduplicates every chunk.
    let again = cluster.json(&["save", "--job", "llama", "--step", "200", source.to_str().unwrap()]);
    assert_eq!(again["deduplicated_chunks"], again["chunks"]);
    assert_eq!(again["uploaded_bytes"], 0);
    // ls and show report logical bytes and bytes actually written.
    let listed = cluster.json(&["ls", "llama"]);
    assert_eq!((listed[0]["bytes"].as_u64(), listed[0]["written_bytes"].as_u64()), (Some(total), Some(total)));
    assert_eq!((listed[1]["bytes"].as_u64(), listed[1]["written_bytes"].as_u64()), (Some(total), Some(0)));
    let shown = cluster.ok(&["show", "llama", "200"]);
    assert!(shown.contains("(0 B written"), "{shown}");
    // A reader that goes away (`| head -1`) ends a command quietly, as SIGPIPE ends other tools
    // (status 141), not with a panic.
    for args in [&["ls", "--json"][..], &["show", "llama", "200"], &["cat", "llama", "200", "optim/rank0.pt"]] {
        let mut child = std::process::Command::new(common::BIN)
            .args(args)
            .env("STARCKPT_SERVER", &cluster.server.address)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let output = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(141), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }

    // A non-empty destination is refused without --force, and replaced with it.
    let stderr = cluster.fails(&["restore", "--job", "llama", "--step", "100", "--to", restored.to_str().unwrap()]);
    assert!(stderr.contains("not empty"), "{stderr}");
    std::fs::write(restored.join("stray"), b"x").unwrap();
    cluster.ok(&["restore", "--job", "llama", "--step", "100", "--to", restored.to_str().unwrap(), "--force"]);
    assert_eq!(tree(&source), tree(&restored));
    // On a file system without the atomic exchange the old tree is moved aside first; a restore
    // that then fails to rename the new one into place puts the old one back, and leaves nothing.
    std::fs::write(restored.join("stray"), b"kept").unwrap();
    let before = tree(&restored);
    let force = ["restore", "--job", "llama", "--step", "100", "--to", restored.to_str().unwrap(), "--force"];
    let both = ("FAILPOINTS", "client.restore.exchange=return;client.restore.into_place=return");
    let failed = cli_with_env(&cluster.server.address, &force, &[both]);
    assert!(!failed.status.success(), "a restore whose rename into place failed succeeded");
    assert!(String::from_utf8_lossy(&failed.stderr).contains("rename into place"), "{failed:?}");
    assert_eq!(tree(&restored), before, "the old tree was lost");
    let parent = restored.parent().unwrap();
    let left: Vec<_> = std::fs::read_dir(parent).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.iter().all(|n| !n.to_string_lossy().contains("partial")), "{left:?}");
    let replaced = cli_with_env(&cluster.server.address, &force, &[("FAILPOINTS", "client.restore.exchange=return")]);
    assert!(replaced.status.success(), "{replaced:?}");
    assert_eq!(tree(&source), tree(&restored));
    // When even moving the old tree back fails, the error says where it is kept, and a later
    // restore into the same destination leaves it there.
    std::fs::write(restored.join("stray"), b"kept").unwrap();
    let before = tree(&restored);
    let three = "client.restore.exchange=return;client.restore.into_place=return;client.restore.move_back=return";
    let failed = cli_with_env(&cluster.server.address, &force, &[("FAILPOINTS", three)]);
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert!(!failed.status.success() && stderr.contains("is kept at"), "{stderr}");
    let kept: Vec<_> = std::fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().contains("starckpt-replaced"))
        .collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert!(stderr.contains(kept[0].to_str().unwrap()), "{stderr}");
    cluster.ok(&["restore", "--job", "llama", "--step", "100", "--to", restored.to_str().unwrap()]);
    assert_eq!(tree(&kept[0]), before, "the old tree, kept where the error said");
    assert_eq!(tree(&source), tree(&restored));
    std::fs::remove_dir_all(&kept[0]).unwrap();

    // A destination that is a symbolic link: the tree it leads to is replaced, the link stays.
    let real = cluster.dir.path().join("real-ckpt");
    std::fs::create_dir_all(&real).unwrap();
    std::fs::write(real.join("stale"), b"old").unwrap();
    let link = cluster.dir.path().join("ckpt-link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    cluster.ok(&["restore", "--job", "llama", "--step", "100", "--to", link.to_str().unwrap(), "--force"]);
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link was replaced");
    assert_eq!(tree(&source), tree(&real));
    // A mount point cannot be renamed over: refused before anything is fetched (as root, which
    // may mount a tmpfs; CI runs as root).
    let mount = cluster.dir.path().join("mounted");
    std::fs::create_dir_all(&mount).unwrap();
    let mounted = std::process::Command::new("mount").args(["-t", "tmpfs", "tmpfs"]).arg(&mount).status();
    if mounted.is_ok_and(|status| status.success()) {
        let stderr = cluster.fails(&["restore", "--job", "llama", "--step", "100", "--to", mount.to_str().unwrap()]);
        let _ = std::process::Command::new("umount").arg(&mount).status();
        assert!(stderr.contains("is a mount point") && stderr.contains("mounted/ckpt"), "{stderr}");
    } else {
        eprintln!("skipped the mount-point restore: cannot mount a tmpfs here (not root?)");
    }

    // Saving an existing committed step is a clear error; deleting it makes latest fall back.
    let stderr = cluster.fails(&["save", "--job", "llama", "--step", "200", source.to_str().unwrap()]);
    assert!(stderr.contains("already has a committed checkpoint at step 200"), "{stderr}");
    cluster.ok(&["rm", "llama", "200"]);
    assert_eq!(cluster.json(&["ls"])[0]["latest_step"], 100);
}

/// Saved modes come back, and restoring them needs no privilege: files saved read-only or
/// write-only restore for a user who could not write (or read) them again once they have their
/// modes. As root the restore runs as nobody (uid 65534), otherwise as the user running the tests.
#[test]
fn saved_modes_come_back_for_an_unprivileged_user() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let cluster = Cluster::start(2);
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    let files = [("weights.bin", 0o444, (5 << 20) + 3), ("secret.bin", 0o200, 1000), ("run.sh", 0o755, 10)];
    let setuid = ("setuid.bin", 0o4755, 10);
    for (index, (name, mode, len)) in files.into_iter().chain([setuid]).enumerate() {
        std::fs::write(source.join(name), random_bytes(len, index as u64)).unwrap();
        std::fs::set_permissions(source.join(name), std::fs::Permissions::from_mode(mode)).unwrap();
    }
    cluster.json(&["save", "--job", "modes", "--step", "1", source.to_str().unwrap()]);

    // Where the other user may create the restore.
    std::fs::set_permissions(cluster.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let parent = cluster.dir.path().join("out");
    std::fs::create_dir(&parent).unwrap();
    std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o777)).unwrap();
    let restored = parent.join("restored");
    let mut command = std::process::Command::new(common::BIN);
    command
        .args(["restore", "--job", "modes", "--latest", "--to", restored.to_str().unwrap()])
        .env("STARCKPT_SERVER", &cluster.server.address);
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        command.uid(65534).gid(65534).env("HOME", "/");
    }
    let output = command.output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));

    for (index, (name, mode, len)) in files.into_iter().enumerate() {
        let path = restored.join(name);
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777, mode, "{name}");
        assert_eq!(std::fs::read(&path).unwrap(), random_bytes(len, index as u64), "{name}");
    }
    // Permission bits only: a checkpoint does not make setuid files.
    let mode = std::fs::metadata(restored.join(setuid.0)).unwrap().permissions().mode();
    assert_eq!(mode & 0o7777, 0o755);
}

#[test]
fn two_ranks_in_two_processes_commit_together() {
    let cluster = Cluster::start(3);
    let rank_dir = |rank: usize| {
        let dir = cluster.dir.path().join(format!("rank{rank}"));
        std::fs::create_dir_all(dir.join(format!("rank{rank}"))).unwrap();
        std::fs::write(dir.join(format!("rank{rank}/shard.bin")), random_bytes(9 << 20, rank as u64)).unwrap();
        dir
    };
    let (dir0, dir1) = (rank_dir(0), rank_dir(1));
    let save = |rank: &str, dir: &Path| {
        let args = [
            "save",
            "--job",
            "mr",
            "--step",
            "7",
            "--rank",
            rank,
            "--world-size",
            "2",
            "--run-id",
            "run-1",
            dir.to_str().unwrap(),
        ];
        let mut all = args.to_vec();
        all.push("--json");
        serde_json::from_str::<serde_json::Value>(&cluster.ok(&all)).unwrap()
    };
    let first = save("0", &dir0);
    assert_eq!(first["committed"], false, "one of two ranks must not commit the checkpoint");
    let listed = cluster.json(&["ls", "mr"]);
    assert_eq!(listed[0]["state"], "pending");
    assert_eq!(listed[0]["parts_committed"], 1);
    let stderr =
        cluster.fails(&["restore", "--job", "mr", "--latest", "--to", cluster.dir.path().join("x").to_str().unwrap()]);
    assert!(stderr.contains("no committed checkpoint"), "{stderr}");
    assert!(cluster.json(&["ls"])[0]["latest_step"].is_null());

    // Without a shared run id a multi-rank save is refused.
    let stderr = cluster.fails(&[
        "save",
        "--job",
        "mr",
        "--step",
        "8",
        "--rank",
        "1",
        "--world-size",
        "2",
        dir1.to_str().unwrap(),
    ]);
    assert!(stderr.contains("run id shared by all ranks"), "{stderr}");

    let second = save("1", &dir1);
    assert_eq!(second["committed"], true);
    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "mr", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(std::fs::read(restored.join("rank0/shard.bin")).unwrap(), random_bytes(9 << 20, 0));
    assert_eq!(std::fs::read(restored.join("rank1/shard.bin")).unwrap(), random_bytes(9 << 20, 1));
}

#[test]
fn sigkill_everything_mid_save_keeps_the_previous_checkpoint() {
    let mut cluster = Cluster::start(3);
    let first = cluster.dir.path().join("first");
    std::fs::create_dir_all(&first).unwrap();
    std::fs::write(first.join("weights.bin"), random_bytes(20 << 20, 1)).unwrap();
    cluster.ok(&["save", "--job", "crash", "--step", "1", first.to_str().unwrap()]);

    // A large second save, killed (with every server process) once chunks start landing.
    let second = cluster.dir.path().join("second");
    std::fs::create_dir_all(&second).unwrap();
    std::fs::write(second.join("weights.bin"), random_bytes(400 << 20, 2)).unwrap();
    let before = cluster.total_chunks();
    let mut saver =
        cluster.spawn(&["save", "--job", "crash", "--step", "2", "--chunk-size", "1048576", second.to_str().unwrap()]);
    cluster.wait_for_chunks(before + 20, "the second save never started writing");
    let _ = saver.kill();
    let _ = saver.wait();
    cluster.kill_and_restart();

    let checkpoints = cluster.json(&["ls", "crash"]);
    let states: Vec<(u64, String)> = checkpoints
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["step"].as_u64().unwrap(), c["state"].as_str().unwrap().into()))
        .collect();
    assert_eq!(states, vec![(1, "committed".into()), (2, "pending".into())]);
    assert_eq!(cluster.json(&["ls"])[0]["latest_step"], 1);
    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "crash", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(tree(&first), tree(&restored));

    // The restarted trainer (a new run) saves step 2 again: taking the job's lease aborts the
    // crashed run's checkpoint, and the new one commits.
    cluster.ok(&["save", "--job", "crash", "--step", "2", second.to_str().unwrap()]);
    assert_eq!(cluster.json(&["ls"])[0]["latest_step"], 2);
    let all = cluster.json(&["ls", "crash", "--all"]);
    assert!(all.as_array().unwrap().iter().any(|c| c["step"] == 2 && c["state"] == "aborted"), "{all}");
}

/// A cluster whose control plane dies after committing a part, before answering it, and a save of
/// `source` (one file of `bytes`) to (`job`, step 1) under way against it: wait for
/// [`Cluster::wait_server_exit`], start the control plane again, then read the save's output.
fn save_through_a_crash_before_the_commit_answer(job: &str, bytes: usize) -> (Cluster, PathBuf, std::process::Child) {
    let cluster = Cluster::start_with_env(2, &[], &[("FAILPOINTS", "control.commit.reply=return(crash)")]);
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("weights.bin"), random_bytes(bytes, 1)).unwrap();
    let saver = std::process::Command::new(common::BIN)
        .args(["save", "--job", job, "--step", "1", source.to_str().unwrap(), "--json"])
        .env("STARCKPT_SERVER", &cluster.server.address)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    (cluster, source, saver)
}

/// The save's output: it succeeded, and says its checkpoint committed.
fn committed_save(saver: std::process::Child) -> String {
    let output = saver.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "save failed: {stderr}");
    let saved: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(saved["committed"], true, "{saved}");
    stderr
}

#[test]
fn a_save_waits_for_its_control_plane_to_be_restarted() {
    // The control plane dies after committing the part, before answering; a supervisor starts it
    // again. The client sends the part again once it answers, and hears it committed.
    let (mut cluster, source, saver) = save_through_a_crash_before_the_commit_answer("llm", 9 << 20);
    cluster.wait_server_exit();
    std::thread::sleep(Duration::from_millis(500));
    cluster.restart_server();
    committed_save(saver);
    assert_eq!(cluster.json(&["ls"])[0]["latest_step"], 1);
    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "llm", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(tree(&source), tree(&restored));
}

#[test]
fn a_part_sent_again_to_a_checkpoint_deleted_meanwhile_is_reported_committed() {
    // As above, but before the part sent again reaches the restarted control plane (held back 10 s
    // there), the checkpoint is deleted: the save did commit, and says so rather than fail.
    let (mut cluster, _source, saver) = save_through_a_crash_before_the_commit_answer("gone", 1 << 20);
    cluster.wait_server_exit();
    cluster.restart_server_env(&[("FAILPOINTS", "control.commit.record=sleep(10000)")]);
    cluster.ok(&["rm", "gone", "1"]);
    let stderr = committed_save(saver);
    assert!(stderr.contains("deleted since"), "the save warns: {stderr}");
    let all = cluster.json(&["ls", "gone", "--all"]);
    assert_eq!(all[0]["state"], "deleted", "{all}");
}

#[test]
fn a_flipped_byte_fails_restore_naming_chunk_and_target() {
    let cluster = Cluster::start(3);
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("only.bin"), random_bytes(1 << 20, 3)).unwrap();
    // One copy: nothing to read around the damage.
    cluster.ok(&["replication", "rot", "1"]);
    cluster.ok(&["save", "--job", "rot", "--step", "1", source.to_str().unwrap()]);

    let (index, chunk) = (0..3).find_map(|i| cluster.chunk_files(i).into_iter().next().map(|c| (i, c))).unwrap();
    let mut bytes = std::fs::read(&chunk).unwrap();
    bytes[4096 + 1000] ^= 0x01;
    std::fs::write(&chunk, bytes).unwrap();
    let target_id = std::fs::read_to_string(cluster.target_dir(index).join("target.id")).unwrap().trim().to_owned();
    let hash = chunk.file_name().unwrap().to_str().unwrap().to_owned();

    let restored = cluster.dir.path().join("restored");
    let stderr = cluster.fails(&["restore", "--job", "rot", "--latest", "--to", restored.to_str().unwrap()]);
    assert!(stderr.contains("BLAKE3"), "{stderr}");
    assert!(stderr.contains(&hash), "error must name the chunk: {stderr}");
    assert!(stderr.contains(&target_id), "error must name the target: {stderr}");
    assert!(!restored.exists(), "a failed restore must not leave a destination behind");
    let leftovers: Vec<_> = std::fs::read_dir(cluster.dir.path())
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().contains("starckpt-partial"))
        .collect();
    assert!(leftovers.is_empty(), "partial restore left behind");

    // Two copies (the default): the restore reads around the same damage, and the bad copy is
    // rewritten from the good one (read repair).
    let other = cluster.dir.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("twice.bin"), random_bytes(1 << 20, 4)).unwrap();
    cluster.ok(&["save", "--job", "rot2", "--step", "1", other.to_str().unwrap()]);
    let (path, good) = cluster.rot_first_copy("rot2", "1");
    let restored = cluster.dir.path().join("restored-2");
    cluster.ok(&["restore", "--job", "rot2", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(std::fs::read(restored.join("twice.bin")).unwrap(), random_bytes(1 << 20, 4));
    common::wait_repaired(&path, &good);
}

fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return received,
            Ok(n) => received.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return received,
            Err(e) => panic!("target neither answered nor closed: {e}"),
        }
    }
}

#[test]
fn garbage_on_the_data_port_is_rejected_and_the_target_keeps_serving() {
    use prost::Message;
    use starckpt_proto::frame::{FrameHeader, Opcode};

    let cluster = Cluster::start(1);
    let address = cluster.targets[0].address.clone();

    // Random bytes: not a frame; the target closes the connection.
    let mut garbage = TcpStream::connect(&address).unwrap();
    garbage.write_all(&random_bytes(1000, 9)).unwrap();
    read_until_closed(&mut garbage);

    // A well-formed header announcing a 4 GiB payload: refused before any allocation.
    let mut oversized = TcpStream::connect(&address).unwrap();
    let header = FrameHeader { opcode: Opcode::Put, request_id: 1, header_len: 0, payload_len: u32::MAX };
    oversized.write_all(&header.encode()).unwrap();
    read_until_closed(&mut oversized);

    // A valid frame whose prost header is garbage: a BAD_REQUEST answer, connection kept open.
    let mut garbled = TcpStream::connect(&address).unwrap();
    let junk = [0xffu8, 0xff, 0xff, 0xff, 0x0f];
    let header = FrameHeader { opcode: Opcode::Has, request_id: 42, header_len: junk.len() as u32, payload_len: 0 };
    garbled.write_all(&header.encode()).unwrap();
    garbled.write_all(&junk).unwrap();
    let mut fixed = [0u8; 24];
    garbled.read_exact(&mut fixed).unwrap();
    let response = FrameHeader::decode(&fixed).unwrap();
    assert_eq!((response.opcode, response.request_id), (Opcode::HasResponse, 42));
    let mut body = vec![0u8; response.header_len as usize];
    garbled.read_exact(&mut body).unwrap();
    let decoded = starckpt_proto::data::Response::decode(&body[..]).unwrap();
    assert_eq!(decoded.code, starckpt_proto::data::ErrorCode::BadRequest as i32);
    // Same connection, a valid STAT now works.
    let stat = starckpt_proto::data::StatRequest::default().encode_to_vec();
    let header = FrameHeader { opcode: Opcode::Stat, request_id: 43, header_len: stat.len() as u32, payload_len: 0 };
    garbled.write_all(&header.encode()).unwrap();
    garbled.write_all(&stat).unwrap();
    garbled.read_exact(&mut fixed).unwrap();
    assert_eq!(FrameHeader::decode(&fixed).unwrap().request_id, 43);

    // A truncated frame followed by a hang-up does not disturb anyone else.
    let mut truncated = TcpStream::connect(&address).unwrap();
    let header = FrameHeader { opcode: Opcode::Put, request_id: 2, header_len: 0, payload_len: 1 << 20 };
    truncated.write_all(&header.encode()).unwrap();
    truncated.write_all(&[0u8; 1000]).unwrap();
    drop(truncated);

    // The target still serves real clients.
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("f"), random_bytes(3 << 20, 4)).unwrap();
    cluster.ok(&["save", "--job", "g", "--step", "1", source.to_str().unwrap()]);
    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "g", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(tree(&source), tree(&restored));
}

#[test]
fn a_cluster_key_keeps_peers_without_a_capability_off_the_targets() {
    // The harness gives the control plane and targets one key file.
    let mut cluster = Cluster::start(2);
    let answer = common::stat_without_capability(&cluster.targets[0].address);
    assert_eq!(answer.code, starckpt_proto::data::ErrorCode::Unauthorized as i32, "{answer:?}");
    assert!(answer.message.contains("no capability"), "{answer:?}");
    // Nor does a local process get a shared-memory region mapped (out of the target's budget for
    // them) without one, or with one signed by another key; with the cluster's, it does.
    use starckpt_dataplane::shm::{ATTACH_OK, ATTACH_UNAUTHORIZED};
    use starckpt_proto::capability::{ClusterKey, Rights};
    let socket = cluster.target_dir(0).join("shm.sock");
    let expires = std::time::SystemTime::now() + Duration::from_secs(600);
    let forged =
        ClusterKey::from_secret(b"a guess at the cluster's secret").unwrap().mint(Rights::CLIENT, expires, None);
    assert_eq!(common::shm_attach_answer(&socket, &[]).as_ref(), Some(ATTACH_UNAUTHORIZED));
    assert_eq!(common::shm_attach_answer(&socket, &forged).as_ref(), Some(ATTACH_UNAUTHORIZED));
    let key = ClusterKey::from_file(&common::cluster_key_file(cluster.dir.path())).unwrap();
    let write_only = key.mint(Rights::WRITE, expires, None);
    assert_eq!(common::shm_attach_answer(&socket, &write_only).as_ref(), Some(ATTACH_UNAUTHORIZED));
    let granted = key.mint(Rights::READ, expires, None);
    assert_eq!(common::shm_attach_answer(&socket, &granted).as_ref(), Some(ATTACH_OK));
    let log = std::fs::read_to_string(cluster.dir.path().join("target-0.log")).unwrap();
    assert!(log.contains("an attach without a capability it accepts"), "{log}");

    // A target set up with another cluster's key cannot join this one (it cannot prove it holds
    // this cluster's key), so it is never sent this cluster's capabilities or chunks.
    let other = cluster.dir.path().join("other.key");
    std::fs::write(&other, "the key of some other cluster").unwrap();
    let stray = cluster.start_target_env(2, &[], &[("STARCKPT_CLUSTER_KEY_FILE", other.to_str().unwrap())]);
    cluster.targets.push(stray);
    let log = cluster.dir.path().join("target-2.log");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&log).unwrap().contains("the control plane refused this target") {
        assert!(
            Instant::now() < deadline,
            "the stray target was not refused: {}",
            std::fs::read_to_string(&log).unwrap()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let status = cluster.json(&["status"]);
    assert_eq!(status["targets"].as_array().unwrap().len(), 2, "{status}");
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("f"), random_bytes(3 << 20, 5)).unwrap();
    cluster.ok(&["save", "--job", "k", "--step", "1", "--chunk-size", "262144", source.to_str().unwrap()]);
    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "k", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(tree(&source), tree(&restored));
    assert!(cluster.chunk_files(0).len() + cluster.chunk_files(1).len() >= 12);

    // A key file too short to be a secret stops a service at start, saying why.
    let short = cluster.dir.path().join("short.key");
    std::fs::write(&short, "tiny").unwrap();
    let output = std::process::Command::new(common::BIN)
        .args(["server", "--listen", "127.0.0.1:0", "--db", cluster.dir.path().join("x.db").to_str().unwrap()])
        .env("STARCKPT_CLUSTER_KEY_FILE", &short)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("at least 16 bytes"), "{stderr}");
}

#[test]
fn a_dead_target_during_save_and_restore() {
    let mut cluster = Cluster::start(3);
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("f"), random_bytes(24 << 20, 5)).unwrap();

    // Target 0 dies; the control plane still believes it alive for a few seconds, so placement
    // offers it, and the client places its chunks on the next rendezvous candidate instead.
    cluster.targets[0].kill();
    cluster.ok(&["save", "--job", "dead", "--step", "1", source.to_str().unwrap()]);
    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "dead", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(tree(&source), tree(&restored));

    // Two copies of every chunk (the default), on targets 1 and 2 since 0 was dead: losing one
    // more target still restores everything.
    assert!(cluster.chunk_files(0).is_empty());
    assert_eq!(cluster.chunk_files(1).len(), cluster.chunk_files(2).len());
    cluster.targets[1].kill();
    let again = cluster.dir.path().join("again");
    cluster.ok(&["restore", "--job", "dead", "--latest", "--to", again.to_str().unwrap()]);
    assert_eq!(tree(&source), tree(&again));

    // Losing the last copy makes restore fail clearly, naming the target.
    cluster.targets[2].kill();
    let third = cluster.dir.path().join("third");
    let stderr = cluster.fails(&["restore", "--job", "dead", "--latest", "--to", third.to_str().unwrap()]);
    let target_id = std::fs::read_to_string(cluster.target_dir(2).join("target.id")).unwrap();
    assert!(stderr.contains(target_id.trim()), "{stderr}");
    assert!(!third.exists());
}

#[test]
fn bad_requests_get_clear_errors() {
    let cluster = Cluster::start(1);
    let to = cluster.dir.path().join("to");
    let stderr = cluster.fails(&["restore", "--job", "nope", "--latest", "--to", to.to_str().unwrap()]);
    assert!(stderr.contains("job nope has no committed checkpoint"), "{stderr}");
    let stderr = cluster.fails(&["show", "nope", "5"]);
    assert!(stderr.contains("no committed checkpoint at step 5"), "{stderr}");
    let stderr = cluster.fails(&["rm", "nope", "5"]);
    assert!(stderr.contains("no checkpoint at step 5"), "{stderr}");
    let stderr = cluster.fails(&["ls", "../job"]);
    assert!(stderr.contains("invalid job name"), "{stderr}");
    // Without bearer tokens, nobody starts a job in a tenant's namespace (tenants.rs).
    let file = cluster.dir.path().join("planted");
    std::fs::write(&file, b"x").unwrap();
    let stderr = cluster.fails(&["save", "--job", "acme/llama", "--step", "1", file.to_str().unwrap()]);
    assert!(stderr.contains("names a tenant's job"), "{stderr}");
    let stderr = cluster.fails(&["save", "--job", "j", "--step", "1", "/definitely/not/here"]);
    assert!(stderr.contains("/definitely/not/here"), "{stderr}");

    // Bad save arguments: the step must be a non-negative integer, the rank inside the world.
    let file = cluster.dir.path().join("f");
    std::fs::write(&file, b"data").unwrap();
    let file = file.to_str().unwrap();
    for step in ["--step=-5", "--step=abc", "--step=1.5"] {
        let stderr = cluster.fails(&["save", "--job", "j", step, file]);
        assert!(stderr.contains("invalid value"), "{step}: {stderr}");
    }
    let ranks = |rank: &'static str, world: &'static str| {
        ["save", "--job", "j", "--step", "3", "--rank", rank, "--world-size", world, "--run-id", "run", file]
    };
    let stderr = cluster.fails(&ranks("2", "2"));
    assert!(stderr.contains("rank 2 is outside world size 2"), "{stderr}");
    let stderr = cluster.fails(&ranks("0", "0"));
    assert!(stderr.contains("world size"), "{stderr}");
    // Ranks of one checkpoint that disagree on the world size.
    cluster.ok(&ranks("0", "2"));
    let stderr = cluster.fails(&ranks("1", "3"));
    assert!(stderr.contains("was begun with world size 2, not 3"), "{stderr}");

    // The control plane is unreachable.
    let output = common::cli_with_server("127.0.0.1:1", &["ls"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("unreachable"), "{stderr}");
}

#[tokio::test]
async fn malformed_grpc_requests_are_invalid_argument() {
    use starckpt_proto::control::control_client::ControlClient;
    use starckpt_proto::control::*;

    let cluster = Cluster::start(1);
    let mut client = ControlClient::connect(format!("http://{}", cluster.server.address)).await.unwrap();
    let epoch = client
        .acquire_lease(AcquireLeaseRequest { job: "j".into(), run_id: "r".into(), started_at_ms: 0 })
        .await
        .unwrap()
        .into_inner()
        .epoch;
    let begin = |job: &str, world_size| BeginCheckpointRequest { job: job.into(), step: 1, world_size, epoch };
    let status = client.begin_checkpoint(begin("j", 0)).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    let status = client.begin_checkpoint(begin("../etc", 1)).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);

    let id = client.begin_checkpoint(begin("j", 1)).await.unwrap().into_inner().checkpoint_id;
    let target = client.list_targets(ListTargetsRequest {}).await.unwrap().into_inner().targets[0].target_id.clone();
    let manifest = |path: &str| Manifest {
        files: vec![FileEntry {
            path: path.into(),
            size_bytes: 4,
            mode: 0,
            chunks: vec![ChunkRef {
                hash: vec![1u8; 32].into(),
                length_bytes: 4,
                stored_length_bytes: 4,
                codec: 0,
                replicas: vec![target.clone()],
            }],
        }],
        ..Default::default()
    };
    for bad in ["/etc/passwd", "a/../../b", ""] {
        let status = client
            .commit_part(CommitPartRequest {
                checkpoint_id: id,
                rank: 0,
                manifest: Some(manifest(bad)),
                written_bytes: 0,
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{bad:?}: {status:?}");
    }
    let mut unknown = manifest("ok");
    unknown.files[0].chunks[0].replicas = vec!["not-a-target".into()];
    let status = client
        .commit_part(CommitPartRequest { checkpoint_id: id, rank: 0, manifest: Some(unknown), written_bytes: 0 })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(client.latest(LatestRequest { job: "j".into() }).await.unwrap().into_inner().checkpoint.is_none());

    // A commit after the checkpoint was aborted (here by `rm` of the pending step) is refused.
    client.delete_checkpoint(DeleteCheckpointRequest { job: "j".into(), step: 1, ..Default::default() }).await.unwrap();
    let status = client
        .commit_part(CommitPartRequest { checkpoint_id: id, rank: 0, manifest: Some(manifest("ok")), written_bytes: 0 })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert!(status.message().contains("is aborted"), "{status:?}");
    // Retention and tags validate their input too.
    let status = client.set_retention(SetRetentionRequest { job: "j".into(), policy: None }).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    let status = client
        .tag_checkpoint(TagCheckpointRequest { job: "j".into(), step: 1, tag: "x".repeat(65), remove: false })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);

    // Raw garbage on the gRPC port: the server drops that connection and keeps serving.
    let mut raw = TcpStream::connect(&cluster.server.address).unwrap();
    raw.write_all(&random_bytes(4096, 11)).unwrap();
    read_until_closed(&mut raw);
    client.list_jobs(ListJobsRequest {}).await.unwrap();
}

#[test]
fn the_demo_runs_and_verifies() {
    let output = std::process::Command::new(common::BIN)
        .args(["demo", "--size", "48MiB", "--steps", "2", "--json", "--io-engine", "std"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["verified"], true);
    assert_eq!(report["steps"].as_array().unwrap().len(), 2);
    assert!(report["steps"][1]["deduplicated_chunks"].as_u64().unwrap() > 0, "the frozen tensor deduplicates");
    // The commit is held to a write of what it wrote: two copies of every chunk of the first step.
    assert_eq!(report["steps"][0]["copies"], 2);
    assert_eq!(report["steps"][0]["written_bytes"].as_u64(), Some(2 * (48 << 20)));
}

#[test]
fn dev_keeps_its_data_across_a_restart() {
    use std::io::{BufRead, BufReader};

    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("dev");
    let start = || {
        let mut child = std::process::Command::new(common::BIN)
            .args(["dev", "--data", data.to_str().unwrap(), "--listen", "127.0.0.1:0", "--targets", "2"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(dir.path().join("dev.log")).unwrap())
            .spawn()
            .unwrap();
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
        // "starckpt dev cluster: control plane on ADDR, N targets, data in DIR"
        let address = first.split("control plane on ").nth(1).unwrap().split(',').next().unwrap().to_owned();
        (child, address)
    };
    let stop = |mut child: std::process::Child| {
        // SIGTERM: a clean shutdown, exit status 0.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let status = child.wait().unwrap();
        let log = std::fs::read_to_string(dir.path().join("dev.log")).unwrap_or_default();
        assert!(status.success(), "dev exited with {status}: {log}");
    };
    let wait_ready = |address: &str| {
        for _ in 0..200 {
            let output = common::cli_with_server(address, &["status", "--json"]);
            if output.status.success() {
                let status: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
                if status["targets"].as_array().unwrap().iter().filter(|t| t["state"] == "alive").count() == 2 {
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("dev cluster never became ready");
    };

    let (child, address) = start();
    wait_ready(&address);
    let source = dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("w.bin"), random_bytes(5 << 20, 8)).unwrap();
    let saved = common::cli_with_server(&address, &["save", "--job", "dev", "--step", "3", source.to_str().unwrap()]);
    assert!(saved.status.success(), "{}", String::from_utf8_lossy(&saved.stderr));
    stop(child);

    let (child, address) = start();
    wait_ready(&address);
    let restored = dir.path().join("restored");
    let output =
        common::cli_with_server(&address, &["restore", "--job", "dev", "--latest", "--to", restored.to_str().unwrap()]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(tree(&source), tree(&restored));
    stop(child);
}

#[test]
fn a_restarted_two_rank_run_fences_the_preempted_one() {
    let cluster = Cluster::start(3);
    let shard = |name: &str, len: usize, seed: u64| {
        let dir = cluster.dir.path().join(name);
        std::fs::create_dir_all(dir.join(name)).unwrap();
        std::fs::write(dir.join(name).join("shard.bin"), random_bytes(len, seed)).unwrap();
        dir
    };
    let save = |run: &str, rank: &str, step: &str, dir: &Path| {
        let args = ["save", "--job", "fence", "--step", step, "--rank", rank, "--world-size", "2", "--run-id", run];
        let mut all = args.to_vec();
        all.push(dir.to_str().unwrap());
        cluster.cli(&all)
    };

    // Run 1: rank 0 commits its part of step 5; rank 1 is SIGKILLed in the middle of its upload.
    let run1_rank0 = shard("r1-rank0", 2 << 20, 1);
    assert!(save("run-1", "0", "5", &run1_rank0).status.success());
    let run1_rank1 = shard("r1-rank1", 300 << 20, 2);
    let mut rank1 = std::process::Command::new(common::BIN)
        .args(["save", "--job", "fence", "--step", "5", "--rank", "1", "--world-size", "2", "--run-id", "run-1"])
        .args(["--chunk-size", "1048576", run1_rank1.to_str().unwrap()])
        .env("STARCKPT_SERVER", &cluster.server.address)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let before = cluster.total_chunks();
    cluster.wait_for_chunks(before + 10, "rank 1 never started uploading");
    let _ = rank1.kill();
    let _ = rank1.wait();
    assert_eq!(cluster.json(&["ls", "fence"])[0]["state"], "pending");

    // Run 2 (the launcher restarted the job): both ranks save step 5 again and it commits.
    let run2_rank0 = shard("r2-rank0", 2 << 20, 3);
    let run2_rank1 = shard("r2-rank1", 2 << 20, 4);
    assert!(save("run-2", "0", "5", &run2_rank0).status.success());
    let second = save("run-2", "1", "5", &run2_rank1);
    assert!(second.status.success(), "{}", String::from_utf8_lossy(&second.stderr));
    let all = cluster.json(&["ls", "fence", "--all"]);
    let states: Vec<(u64, String, u64)> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["step"].as_u64().unwrap(), c["state"].as_str().unwrap().to_owned(), c["epoch"].as_u64().unwrap()))
        .collect();
    assert_eq!(states, vec![(5, "aborted".into(), 1), (5, "committed".into(), 2)]);

    // The zombie of run 1 comes back: it can neither commit step 5 nor save a new step.
    for (rank, step) in [("1", "5"), ("0", "6")] {
        let zombie = save("run-1", rank, step, &run1_rank1);
        assert!(!zombie.status.success(), "a fenced writer must fail");
        let stderr = String::from_utf8_lossy(&zombie.stderr);
        assert!(stderr.contains("fenced") && stderr.contains("superseded"), "{stderr}");
    }
    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "fence", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(std::fs::read(restored.join("r2-rank1/shard.bin")).unwrap(), random_bytes(2 << 20, 4));
    assert!(!restored.join("r1-rank0").exists(), "nothing of the preempted run is in the checkpoint");
}

#[test]
fn a_rank_that_never_commits_aborts_the_checkpoint_after_the_timeout() {
    let mut cluster = Cluster::start(1);
    // Restart the control plane with a 5-second pending timeout: short, but long enough for the
    // save below to commit its part and `ls` to see it pending on a busy machine.
    cluster.server.kill();
    cluster.server = common::start_server_with(cluster.dir.path(), &["--pending-timeout-secs", "5"]);
    cluster.targets[0].kill();
    cluster.targets[0] = cluster.start_target(0);
    cluster.wait_alive(1);

    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("part0"), random_bytes(1 << 20, 6)).unwrap();
    let args = ["save", "--job", "slow", "--step", "1", "--rank", "0", "--world-size", "2", "--run-id", "r"];
    let mut all = args.to_vec();
    all.push(source.to_str().unwrap());
    cluster.ok(&all);
    assert_eq!(cluster.json(&["ls", "slow"])[0]["state"], "pending");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let listed = cluster.json(&["ls", "slow", "--all"]);
        if listed[0]["state"] == "aborted" {
            break;
        }
        assert!(Instant::now() < deadline, "the pending checkpoint was never aborted: {listed}");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(cluster.json(&["ls"])[0]["latest_step"].is_null());
    // Rank 1 arriving late cannot revive the aborted checkpoint: it starts a fresh attempt of
    // step 1 that waits alone, and nothing becomes visible.
    let late = ["save", "--job", "slow", "--step", "1", "--rank", "1", "--world-size", "2", "--run-id", "r"];
    let mut all = late.to_vec();
    all.push(source.to_str().unwrap());
    let output = cluster.cli(&all);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let latest = cluster.json(&["ls"])[0]["latest_step"].clone();
    assert!(latest.is_null(), "one of two ranks must not make step 1 visible: {latest}");
}

#[test]
fn restore_of_more_files_than_the_descriptor_limit() {
    use std::os::unix::process::CommandExt;

    let cluster = Cluster::start(2);
    let source = cluster.dir.path().join("many");
    for i in 0..300 {
        let path = source.join(format!("rank{}/shard{i}.bin", i % 7));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, random_bytes(1000 + i, i as u64)).unwrap();
    }
    cluster.ok(&["save", "--job", "many", "--step", "1", source.to_str().unwrap()]);
    let restored = cluster.dir.path().join("restored");
    let mut command = std::process::Command::new(common::BIN);
    command
        .args(["restore", "--job", "many", "--latest", "--to", restored.to_str().unwrap()])
        .env("STARCKPT_SERVER", &cluster.server.address);
    // SAFETY: setrlimit is async-signal-safe; the closure runs in the child before exec.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: 64, rlim_max: 64 };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let output = command.output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(tree(&source), tree(&restored));
}

#[test]
fn zero_copy_sends_over_the_locked_memory_limit_fall_back_to_plain_writes() {
    // As in a container: no CAP_IPC_LOCK and a small RLIMIT_MEMLOCK. The pages of a zero-copy
    // send (every payload here is 290 KiB or more) count against it, so the kernel refuses every
    // one; PUTs and GET results must still arrive, written plainly. The limit is per user, and
    // recent kernels count each connection's io_uring ring (a few pages) against it too: it
    // leaves room for the rings of this test's processes, so that the sends are what it refuses.
    let limit = 256 << 10;
    let mut cluster = Cluster::start(0);
    for index in 0..2 {
        let target = cluster.start_target_configured(index, &["--no-shm", "--zero-copy-send", "always"], &[], |c| {
            common::limit_locked_memory(c, limit)
        });
        cluster.targets.push(target);
    }
    cluster.wait_alive(2);
    let source = cluster.dir.path().join("source");
    for (i, len) in [6 << 20, 1 << 20, 300_000].into_iter().enumerate() {
        std::fs::create_dir_all(&source).unwrap();
        std::fs::write(source.join(format!("part{i}.bin")), random_bytes(len, i as u64)).unwrap();
    }
    let run = |args: &[&str]| {
        let mut command = std::process::Command::new(common::BIN);
        command.args(args).env("STARCKPT_SERVER", &cluster.server.address).env("RUST_LOG", "info");
        common::limit_locked_memory(&mut command, limit);
        let output = command.output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert!(output.status.success(), "{args:?}: {stderr}");
        stderr
    };
    let refused = "zero-copy send refused";
    let saved = run(&["save", "--job", "memlock", "--step", "1", source.to_str().unwrap()]);
    assert!(saved.contains(refused), "the client's PUTs were not refused zero-copy: {saved}");
    let restored = cluster.dir.path().join("restored");
    run(&["restore", "--job", "memlock", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(tree(&source), tree(&restored));
    let logs: String =
        (0..2).map(|i| std::fs::read_to_string(cluster.dir.path().join(format!("target-{i}.log"))).unwrap()).collect();
    assert!(logs.contains(refused), "no target had a GET result refused zero-copy: {logs}");
}

#[test]
fn a_target_whose_write_from_staging_memory_fails_copies_that_clients_chunks_instead() {
    // Same-host targets write a staged chunk straight from the client's staging memory (the CLI
    // runs as their user). One's first such write fails: the save still commits (that copy goes
    // to another target), and that target copies the connection's chunks from then on.
    let mut cluster = Cluster::start(0);
    for index in 0..3 {
        let fails = [("FAILPOINTS", "target.store.write_placed=1*return")];
        let env: &[(&str, &str)] = if index == 0 { &fails } else { &[] };
        let target = cluster.start_target_env(index, &[], env);
        cluster.targets.push(target);
    }
    cluster.wait_alive(3);
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("weights.bin"), random_bytes(200 << 20, 7)).unwrap();
    cluster.ok(&["save", "--job", "placed", "--step", "1", source.to_str().unwrap()]);
    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "placed", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(tree(&source), tree(&restored));
    let log = std::fs::read_to_string(cluster.dir.path().join("target-0.log")).unwrap();
    assert!(log.contains("chunks are copied from now on"), "target 0 kept writing from staging memory: {log}");
    for index in 1..3 {
        let log = std::fs::read_to_string(cluster.dir.path().join(format!("target-{index}.log"))).unwrap();
        assert!(!log.contains("copied from now on"), "target {index}: {log}");
    }
}

#[test]
fn full_targets_refuse_puts_and_writers_go_elsewhere_until_none_has_room() {
    // Three targets, two copies of each chunk (the default replication factor).
    let mut cluster = Cluster::start(3);
    let data = cluster.dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let file = |name: &str, seed: u64| {
        let path = data.join(name);
        std::fs::write(&path, random_bytes(4 << 20, seed)).unwrap();
        path
    };
    let save = |cluster: &Cluster, step: &str, path: &Path| {
        cluster.cli(&["save", "--job", "full", "--step", step, "--chunk-size", "1048576", path.to_str().unwrap()])
    };
    assert!(save(&cluster, "1", &file("one.bin", 1)).status.success());

    // Target 0 is (nearly) full: it keeps more in reserve than its disk holds.
    let everything = u64::MAX.to_string();
    cluster.targets[0].kill();
    cluster.targets[0] = cluster.start_target_with(0, &["--reserve-bytes", &everything]);
    cluster.wait_alive(3);
    let on_full_target = cluster.chunk_files(0).len();
    let two = file("two.bin", 2);
    let output = save(&cluster, "2", &two);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(cluster.chunk_files(0).len(), on_full_target, "the full target stored nothing new");
    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "full", "--step", "2", "--to", restored.to_str().unwrap()]);
    assert_eq!(std::fs::read(restored.join("two.bin")).unwrap(), std::fs::read(&two).unwrap());

    // Fewer targets have room than copies are needed: the save fails cleanly and the previous
    // checkpoint stays the latest.
    cluster.targets[1].kill();
    cluster.targets[1] = cluster.start_target_with(1, &["--reserve-bytes", &everything]);
    cluster.wait_alive(3);
    let output = save(&cluster, "3", &file("three.bin", 3));
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("target is full") && stderr.contains("on 1 of the 2 targets"), "{stderr}");
    assert_eq!(cluster.json(&["ls"])[0]["latest_step"], 2);
    let again = cluster.dir.path().join("again");
    cluster.ok(&["restore", "--job", "full", "--latest", "--to", again.to_str().unwrap()]);
    assert_eq!(std::fs::read(again.join("two.bin")).unwrap(), std::fs::read(&two).unwrap());
}

#[test]
fn a_silent_target_turns_suspect_then_dead_and_gets_no_new_chunks() {
    let cluster = Cluster::start(2);
    let wait_for = |address: &str, wanted: &str| cluster.wait_target_state(address, wanted);
    let frozen = cluster.targets[0].address.clone();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(cluster.targets[0].pid() as i32, libc::SIGSTOP) };
    wait_for(&frozen, "suspect");
    let before = cluster.chunk_files(0).len();
    let file = cluster.dir.path().join("f.bin");
    std::fs::write(&file, random_bytes(2 << 20, 9)).unwrap();
    let args = ["save", "--job", "sus", "--step", "1", "--chunk-size", "262144", file.to_str().unwrap()];
    cluster.ok(&args);
    assert_eq!(cluster.chunk_files(0).len(), before, "a suspect target got new chunks");
    wait_for(&frozen, "dead");
    // SAFETY: as above.
    unsafe { libc::kill(cluster.targets[0].pid() as i32, libc::SIGCONT) };
    wait_for(&frozen, "alive");
}

/// A control plane whose database is slow to take writes (each heartbeat's write held back
/// 0.9 s, most of the 1 s interval) still counts its targets alive: a heartbeat counts from its
/// arrival, and targets keep their rate while answers are slow. (Before, every target turned
/// suspect for part of each heartbeat, and saves begun then failed: "no live storage targets".)
#[test]
fn targets_stay_alive_while_the_database_is_slow_to_record_heartbeats() {
    let slow = [("FAILPOINTS", "control.heartbeat.record=return(900)")];
    let cluster = Cluster::start_with_env(2, &[], &slow);
    let until = Instant::now() + Duration::from_secs(8);
    while Instant::now() < until {
        let status = cluster.json(&["status"]);
        for target in status["targets"].as_array().unwrap() {
            assert_eq!(target["state"], "alive", "{status}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let file = cluster.dir.path().join("f.bin");
    std::fs::write(&file, random_bytes(1 << 20, 13)).unwrap();
    assert_eq!(cluster.json(&["save", "--job", "slowdb", "--step", "1", file.to_str().unwrap()])["committed"], true);
}

/// A target whose device stops completing writes, its process up and answering, stops
/// heartbeating: it turns suspect, then dead, and saves place their chunks elsewhere. (Without
/// this, every chunk placed there waited out a request timeout, and the target kept getting new
/// ones.)
#[test]
fn a_target_whose_device_hangs_turns_dead_and_gets_no_new_chunks() {
    let mut cluster = Cluster::start(1);
    let hang = [("FAILPOINTS", "target.io.hang=return")];
    let hung = cluster.start_target_env(1, &["--io-stall-timeout-secs", "1"], &hang);
    cluster.targets.push(hung);
    cluster.wait_alive(2);
    let address = cluster.targets[1].address.clone();
    let file = cluster.dir.path().join("f.bin");
    std::fs::write(&file, random_bytes(2 << 20, 11)).unwrap();
    // A save whose chunks placed on the hung target never complete there.
    let mut stuck =
        cluster.spawn(&["save", "--job", "hang", "--step", "1", "--chunk-size", "262144", file.to_str().unwrap()]);
    cluster.wait_target_state(&address, "suspect");
    cluster.wait_target_state(&address, "dead");
    // The next save goes to the working target alone, and commits.
    let before = cluster.chunk_files(0).len();
    std::fs::write(&file, random_bytes(2 << 20, 12)).unwrap();
    let saved =
        cluster.json(&["save", "--job", "fine", "--step", "1", "--chunk-size", "262144", file.to_str().unwrap()]);
    assert_eq!(saved["committed"], true);
    assert_eq!(cluster.chunk_files(0).len(), before + 8);
    assert!(cluster.chunk_files(1).is_empty(), "a chunk file appeared on the hung target");
    let _ = stuck.kill();
    let _ = stuck.wait();
}

#[test]
fn replicas_span_failure_domains_so_a_whole_domain_can_die() {
    let mut cluster = Cluster::start(0);
    for (index, domain) in ["rack-a", "rack-a", "rack-b", "rack-b"].into_iter().enumerate() {
        let target = cluster.start_target_with(index, &["--failure-domain", domain]);
        cluster.targets.push(target);
    }
    cluster.wait_alive(4);
    let status = cluster.json(&["status"]);
    let domain_of: std::collections::HashMap<String, String> = status["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["target_id"].as_str().unwrap().to_owned(), t["failure_domain"].as_str().unwrap().to_owned()))
        .collect();
    assert!(cluster.ok(&["status"]).contains("rack-b"));

    let source = cluster.dir.path().join("weights.bin");
    std::fs::write(&source, common::random_bytes(3_000_000, 5)).unwrap();
    let saved =
        cluster.json(&["save", "--job", "ha", "--step", "1", "--chunk-size", "262144", source.to_str().unwrap()]);
    assert_eq!(saved["committed"], true);
    let shown = cluster.json(&["show", "ha", "1"]);
    let chunks = shown["files"][0]["chunk_refs"].as_array().unwrap();
    assert_eq!(chunks.len(), 12);
    for chunk in chunks {
        let domains: std::collections::HashSet<&str> =
            chunk["replicas"].as_array().unwrap().iter().map(|r| domain_of[r.as_str().unwrap()].as_str()).collect();
        assert_eq!(domains.len(), 2, "two copies in two racks: {chunk}");
    }

    // Rack A goes away at once; every chunk still has its rack-B copy.
    cluster.targets[0].kill();
    cluster.targets[1].kill();
    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "ha", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(std::fs::read(restored.join("weights.bin")).unwrap(), std::fs::read(&source).unwrap());

    // With a replication factor of 3 and only rack B left, a save makes copies on both of its
    // targets (as many as are live) and commits.
    cluster.ok(&["replication", "ha", "3"]);
    std::thread::sleep(std::time::Duration::from_secs(6)); // rack A is dead to the control plane
    let saved = cluster.json(&["save", "--job", "ha", "--step", "2", source.to_str().unwrap()]);
    assert_eq!(saved["committed"], true);
    let shown = cluster.json(&["show", "ha", "2"]);
    for chunk in shown["files"][0]["chunk_refs"].as_array().unwrap() {
        let replicas: Vec<&str> = chunk["replicas"].as_array().unwrap().iter().map(|r| r.as_str().unwrap()).collect();
        assert_eq!(replicas.len(), 2, "{chunk}");
        assert!(replicas.iter().all(|r| domain_of[*r] == "rack-b"), "{chunk}");
    }
    assert!(!cluster.cli(&["replication", "ha", "0"]).status.success());
}

/// Durations past any use (which once overflowed into panics, or wrapped into timeouts of
/// milliseconds) are refused when the process starts, with clap's message and exit status 2.
#[test]
fn durations_out_of_range_are_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("meta.db");
    let server = ["server", "--listen", "127.0.0.1:0", "--db", db.to_str().unwrap()];
    let target = ["target", "--dir", dir.path().to_str().unwrap()];
    let cases: [(&[&str], &str); 4] = [
        (&server, "--gc-grace-secs=18446744073709551615"),
        (&server, "--pending-timeout-secs=18446744073709551615"),
        (&server, "--lost-after-secs=18446744073709552"),
        (&target, "--io-stall-timeout-secs=0"),
    ];
    for (command, flag) in cases {
        let output = std::process::Command::new(common::BIN).args(command).arg(flag).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{flag}: {stderr}");
        assert!(stderr.contains("invalid value") && !stderr.contains("panicked"), "{flag}: {stderr}");
    }
}

#[test]
fn copies_lost_with_a_target_are_made_again_elsewhere() {
    // Targets silent for 3 s are lost (they heartbeat every second); passes run on request.
    let mut cluster = Cluster::start_with(3, &["--lost-after-secs", "3", "--repair-interval-secs", "0"]);
    let source = cluster.dir.path().join("weights.bin");
    std::fs::write(&source, random_bytes(4 << 20, 9)).unwrap();
    cluster.ok(&["save", "--job", "heal", "--step", "1", "--chunk-size", "262144", source.to_str().unwrap()]);
    let status = cluster.json(&["status"]);
    assert!(status["under_replicated_chunks"].is_null(), "no pass yet: {status}");

    // Nothing lost: a pass finds every chunk with its two copies.
    let report = cluster.json(&["repair"]);
    assert_eq!((report["chunks"].as_u64(), report["under_replicated"].as_u64()), (Some(16), Some(0)), "{report}");
    assert_eq!(cluster.json(&["status"])["under_replicated_chunks"], 0);

    // Target 0 dies; once it is lost, the pass copies what it held onto the others.
    let held = cluster.chunk_files(0).len() as u64;
    assert!(held > 0);
    cluster.targets[0].kill();
    std::thread::sleep(Duration::from_secs(6));
    let report = cluster.json(&["repair"]);
    assert_eq!(report["under_replicated"], held, "{report}");
    assert_eq!(report["copies_made"], held, "{report}");
    assert_eq!(report["still_under_replicated"], 0, "{report}");
    assert_eq!(cluster.json(&["status"])["under_replicated_chunks"], 0);
    // Targets 1 and 2 now hold both copies of every chunk.
    assert_eq!(cluster.chunk_files(1).len(), 16);
    assert_eq!(cluster.chunk_files(2).len(), 16);

    // So losing one more target still restores everything, the readers finding the copies
    // the manifests do not list.
    cluster.targets[1].kill();
    // GC right away: the control plane still counts the target alive, so sweeping it fails, and
    // the command says so with its exit status.
    let (succeeded, report) = cluster.json_outcome(&["gc"]);
    let errors = report["target_errors"].as_array().unwrap();
    assert!(!succeeded && errors.len() == 2 && report["targets_skipped"] == 1, "the dead one skipped: {report}");
    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "heal", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(std::fs::read(restored.join("weights.bin")).unwrap(), std::fs::read(&source).unwrap());

    // With one target left, every chunk stays one copy short: the command fails (after its
    // report), and status says so.
    std::thread::sleep(Duration::from_secs(6));
    let (succeeded, report) = cluster.json_outcome(&["repair"]);
    assert!(!succeeded, "an incomplete repair exits non-zero: {report}");
    assert_eq!((report["copies_made"].as_u64(), report["still_under_replicated"].as_u64()), (Some(0), Some(16)));
    let stderr = cluster.fails(&["repair"]);
    assert!(stderr.contains("16 chunks still short of copies"), "{stderr}");
    let status = cluster.ok(&["status"]);
    assert!(status.contains("under-replicated chunks: 16"), "{status}");
}

#[test]
fn same_host_targets_use_shared_memory_unless_they_serve_none() {
    let mut cluster = Cluster::start(0);
    // Target 0 measures its device for a queue depth (the default) and remembers it.
    cluster.targets.push(cluster.start_target_with(0, &["--queue-depth", "auto"]));
    cluster.targets.push(cluster.start_target_with(1, &["--no-shm", "--no-rdma", "--queue-depth", "2"]));
    cluster.wait_alive(2);
    // A target stopped while it measures its device stops then (cleanly), and measures again on
    // its next start.
    let mut measuring = cluster.start_target_with(2, &["--queue-depth", "auto"]);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(measuring.pid() as i32, libc::SIGTERM) };
    assert!(measuring.child.wait().unwrap().success());
    let log = std::fs::read_to_string(cluster.dir.path().join("target-2.log")).unwrap();
    assert!(log.contains("stopped while measuring the device"), "{log}");
    assert!(!cluster.target_dir(2).join("queue-depth").exists());
    assert!(!cluster.target_dir(2).join("calibrating").exists());
    let measured = std::fs::read_to_string(cluster.target_dir(0).join("queue-depth")).unwrap();
    let depth: usize = measured.lines().next().unwrap().parse().unwrap();
    assert!([1, 2, 4, 8, 16, 32].contains(&depth), "{measured}");
    assert!(!cluster.target_dir(1).join("queue-depth").exists());
    for bad in [
        &["--queue-depth", "0"][..],
        &["--queue-depth", "257"],
        &["--queue-depth", "fast"],
        &["--rdma-mtu", "1500"],
        &["--rdma-port", "0"],
    ] {
        let output = std::process::Command::new(common::BIN)
            .args(["target", "--dir", "/nonexistent"])
            .args(bad)
            .output()
            .unwrap();
        assert!(!output.status.success(), "{bad:?} should fail");
        assert!(!String::from_utf8_lossy(&output.stderr).contains("panicked"), "{bad:?}");
    }
    let source = cluster.dir.path().join("weights.bin");
    let data = common::random_bytes(5_000_000, 8);
    std::fs::write(&source, &data).unwrap();
    let saved =
        cluster.json(&["save", "--job", "mixed", "--step", "1", "--chunk-size", "1048576", source.to_str().unwrap()]);
    assert_eq!(saved["committed"], true);
    let status = cluster.json(&["status"]);
    let mut transports: Vec<&str> =
        status["targets"].as_array().unwrap().iter().map(|t| t["transport"].as_str().unwrap()).collect();
    transports.sort_unstable();
    assert_eq!(transports, ["shm", "tcp"], "{status}");
    assert!(cluster.ok(&["status"]).contains("TRANSPORT"));
    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "mixed", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(std::fs::read(restored.join("weights.bin")).unwrap(), data);
}

#[test]
fn a_relative_database_path_is_the_file_it_names() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let child = std::process::Command::new(common::BIN)
        .args(["server", "--listen", "127.0.0.1:0", "--db", "nested/../meta.db"])
        .current_dir(dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let output = child.wait_with_output().unwrap();
    // '..' is refused rather than folded into another file.
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("without '..'"), "{output:?}");

    // What a server on ./meta.db keeps is there for the next one on ./meta.db.
    let start = || {
        let mut child = std::process::Command::new(common::BIN)
            .args(["server", "--listen", "127.0.0.1:0", "--db", "meta.db"])
            .current_dir(dir.path())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let address = line.trim().rsplit(' ').next().unwrap().to_owned();
        (child, address)
    };
    let (mut first, address) = start();
    let set = common::cli_with_server(&address, &["retention", "kept", "--keep-last", "3"]);
    assert!(set.status.success(), "{set:?}");
    let _ = first.kill();
    let _ = first.wait();
    let (mut second, address) = start();
    let shown = common::cli_with_server(&address, &["retention", "kept", "--json"]);
    let _ = second.kill();
    let _ = second.wait();
    let policy: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(policy["keep_last"], 3, "{shown:?}");
    assert!(dir.path().join("meta.db").exists());
}

/// Beside a restore's destination: its unfinished trees and its lock file.
fn restore_leftovers(parent: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".starckpt-"))
        .collect();
    names.sort();
    names
}

/// A restore interrupted by SIGTERM (a preempted launcher) exits non-zero and leaves nothing
/// beside its destination; what a SIGKILLed one left is removed by the next restore there, and
/// two restores into one destination at once are refused.
#[test]
fn an_interrupted_restore_leaves_nothing_behind() {
    let cluster = Cluster::start(2);
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("weights.bin"), random_bytes(128 << 20, 5)).unwrap();
    cluster.json(&["save", "--job", "intr", "--step", "1", source.to_str().unwrap()]);
    let parent = cluster.dir.path().join("out");
    std::fs::create_dir(&parent).unwrap();
    let restored = parent.join("restored");
    let restore_with = |failpoints: &str| {
        std::process::Command::new(common::BIN)
            .args(["restore", "--job", "intr", "--latest", "--to", restored.to_str().unwrap()])
            .env("STARCKPT_SERVER", &cluster.server.address)
            .env("FAILPOINTS", failpoints)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let restore = || restore_with("");

    // SIGTERM as soon as the unfinished tree appears, while the tree is still being made (the
    // fault point holds its making there): what is still making it must not make it again.
    let child = restore_with("client.restore.tree=sleep(1500)");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !restore_leftovers(&parent).iter().any(|n| n.contains("partial")) {
        assert!(Instant::now() < deadline, "the restore never started its tree");
        std::thread::sleep(Duration::from_millis(1));
    }
    // SAFETY: kill(2) on a child we spawned, which has not been waited for.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let output = child.wait_with_output().unwrap();
    assert!(!output.status.success());
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("interrupted"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(restore_leftovers(&parent), Vec::<String>::new());
    assert!(!restored.exists());

    // What a killed restore left (SIGKILL cannot be caught) goes with the next restore there.
    std::fs::create_dir_all(parent.join(".restored.starckpt-partial-0123/model")).unwrap();
    std::fs::write(parent.join(".restored.starckpt-partial-0123/model/w.bin"), b"half").unwrap();
    // One restore into a destination at a time.
    let lock = std::fs::File::create(parent.join(".restored.starckpt-restore.lock")).unwrap();
    lock.lock().unwrap();
    let refused = restore().wait_with_output().unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("another restore into"), "{refused:?}");
    lock.unlock().unwrap();
    let done = restore().wait_with_output().unwrap();
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    assert_eq!(tree(&source), tree(&restored));
    assert_eq!(restore_leftovers(&parent), Vec::<String>::new());
}

/// A second control plane on the SQLite file another is serving exits at once, saying why; the
/// first serves on.
#[test]
fn a_second_control_plane_on_one_sqlite_file_is_refused() {
    let cluster = Cluster::start(1);
    let second = std::process::Command::new(common::BIN)
        .args(["server", "--listen", "127.0.0.1:0", "--db", &cluster.db])
        .output()
        .unwrap();
    assert!(!second.status.success(), "two control planes serve one SQLite file");
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(stderr.contains("in use by another control plane"), "{stderr}");
    assert_eq!(cluster.json(&["status"])["targets"].as_array().unwrap().len(), 1);
}

#[test]
fn a_second_target_on_one_data_dir_is_refused() {
    let cluster = Cluster::start(1);
    let dir = cluster.target_dir(0);
    let mut second = std::process::Command::new(common::BIN);
    second
        .args(["target", "--dir", dir.to_str().unwrap(), "--listen", "127.0.0.1:0", "--queue-depth", "8"])
        .args(["--server", &cluster.servers()])
        .env("STARCKPT_CLUSTER_KEY_FILE", common::cluster_key_file(dir.parent().unwrap()));
    let stderr = common::refuses_to_start(second, "a second target on one data directory");
    assert!(stderr.contains("in use by another target process"), "{stderr}");
    // The first still serves.
    let data = cluster.dir.path().join("one");
    std::fs::write(&data, b"still served").unwrap();
    cluster.ok(&["save", "--job", "locked", "--step", "1", data.to_str().unwrap()]);
}
