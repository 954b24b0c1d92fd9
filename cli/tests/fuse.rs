#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
//! The FUSE mount for real: `starckpt mount` as a process over a cluster of processes, driven by
//! the tools people use (cp, mv, tar, sha256sum, rsync, python, numpy or torch).

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{Cluster, random_bytes, tree};

/// A `starckpt mount` process; unmounted (lazily, if it died) when dropped.
struct Mounted {
    child: Child,
    point: PathBuf,
}

impl Mounted {
    fn start(cluster: &Cluster, point: &Path) -> Mounted {
        Mounted::start_with(cluster, point, &[])
    }

    /// Mounts with extra `starckpt mount` flags.
    fn start_with(cluster: &Cluster, point: &Path, flags: &[&str]) -> Mounted {
        Mounted::start_env(cluster, point, flags, &[])
    }

    /// Mounts with extra flags and environment variables (a bearer token).
    fn start_env(cluster: &Cluster, point: &Path, flags: &[&str], env: &[(&str, &str)]) -> Mounted {
        std::fs::create_dir_all(point).unwrap();
        let log = std::fs::File::create(cluster.dir.path().join("mount.log")).unwrap();
        let mut child = Command::new(common::BIN)
            .args(["mount", point.to_str().unwrap()])
            .args(flags)
            .envs(env.iter().copied())
            .env("STARCKPT_SERVER", &cluster.server.address)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert!(
            line.contains("mounted at"),
            "mount did not come up: {line:?}; log: {}",
            std::fs::read_to_string(cluster.dir.path().join("mount.log")).unwrap_or_default()
        );
        Mounted { child, point: point.to_path_buf() }
    }

    /// Waits for the process to exit and asserts it exited cleanly.
    fn wait_clean_exit(&mut self, log: &Path) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "mount exited with {status}: {}", std::fs::read_to_string(log).unwrap());
                return;
            }
            assert!(Instant::now() < deadline, "the mount process did not exit");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = Command::new("umount").arg("-l").arg(&self.point).output();
    }
}

fn sh(script: &str) -> Output {
    Command::new("bash").args(["-c", script]).output().unwrap()
}

fn sh_ok(script: &str) -> String {
    let output = sh(script);
    assert!(
        output.status.success(),
        "{script}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// Runs a Python snippet; returns its stdout.
fn python(script: &str) -> String {
    let output = Command::new("python3").args(["-c", script]).output().unwrap();
    assert!(output.status.success(), "python failed: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).unwrap()
}

/// The OS error a failed Python operation raised, as its errno name.
fn python_errno(script: &str) -> String {
    let wrapped = format!(
        "import errno, os, sys\ntry:\n{}\n    print('no error')\nexcept OSError as e:\n    print(errno.errorcode[e.errno])",
        script.lines().map(|l| format!("    {l}")).collect::<Vec<_>>().join("\n")
    );
    python(&wrapped).trim().to_owned()
}

fn make_tree(root: &Path) {
    for (path, len, seed) in
        [("model/weights.bin", 5 << 20, 1), ("model/deep/a/b.bin", 300_001, 2), ("optim.pt", 4096, 3), ("empty", 0, 4)]
    {
        let path = root.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, random_bytes(len, seed)).unwrap();
    }
    std::fs::create_dir_all(root.join("logs/empty-dir")).unwrap();
}

#[test]
fn checkpoints_through_the_mount_with_everyday_tools() {
    let cluster = Cluster::start(2);
    let mount = Mounted::start(&cluster, &cluster.dir.path().join("ckpt"));
    let source = cluster.dir.path().join("source");
    make_tree(&source);
    let (m, src) = (mount.point.to_str().unwrap().to_owned(), source.to_str().unwrap().to_owned());

    // cp -r into a temporary directory, then rename: one atomic commit.
    sh_ok(&format!("mkdir -p {m}/llama && mkdir {m}/llama/step_100.tmp && cp -r {src}/. {m}/llama/step_100.tmp/"));
    let listed = cluster.json(&["ls", "llama", "--all"]);
    assert!(listed.as_array().unwrap().is_empty(), "nothing is committed before the rename: {listed}");
    sh_ok(&format!("mv {m}/llama/step_100.tmp {m}/llama/step_100"));
    let listed = cluster.json(&["ls", "llama"]);
    assert_eq!((listed[0]["step"].as_u64(), listed[0]["state"].as_str()), (Some(100), Some("committed")));
    assert_eq!(listed[0]["files"], 4);
    // Restorable with the CLI, and readable back out with cp, tar, sha256sum and rsync.
    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "llama", "--step", "100", "--to", restored.to_str().unwrap()]);
    assert_eq!(tree(&source), tree(&restored));
    let copied = cluster.dir.path().join("copied");
    // Listed under the name it was committed as, with the mount's pointers under .starckpt/.
    assert_eq!(sh_ok(&format!("ls {m}/llama")).trim(), "step_100");
    sh_ok(&format!("cp -r {m}/llama/step_100 {}", copied.display()));
    assert_eq!(tree(&source), tree(&copied));
    let through_mount = sh_ok(&format!("cd {m}/llama/step_100 && tar cf - . | tar tf - | sort"));
    let from_source = sh_ok(&format!("cd {src} && tar cf - . | tar tf - | sort"));
    assert_eq!(through_mount, from_source);
    let sums = |dir: &str| sh_ok(&format!("cd {dir} && find . -type f | sort | xargs sha256sum"));
    assert_eq!(sums(&format!("{m}/llama/step_100")), sums(&src));
    let synced = cluster.dir.path().join("synced");
    sh_ok(&format!("rsync -a {m}/llama/step_100/ {}/", synced.display()));
    assert_eq!(tree(&source), tree(&synced));
    assert_eq!(sh_ok(&format!("readlink {m}/llama/.starckpt/latest")).trim(), "../step_100");
    assert_eq!(sh_ok(&format!("readlink {m}/llama/.starckpt/100")).trim(), "../step_100");
    sh_ok(&format!("cmp {m}/llama/.starckpt/latest/optim.pt {src}/optim.pt"));
    // `starckpt cat` streams one verified file through the SDK.
    let cat = cluster.cli(&["cat", "llama", "100", "model/weights.bin"]);
    assert!(cat.status.success());
    assert_eq!(cat.stdout, std::fs::read(source.join("model/weights.bin")).unwrap());
    let stderr = cluster.fails(&["cat", "llama", "100", "model/absent.bin"]);
    assert!(stderr.contains("has no file model/absent.bin"), "{stderr}");
    assert!(sh_ok(&format!("ls {m}")).lines().any(|l| l == "llama"));

    // Python open/write/read: a file written straight into the job is a one-file checkpoint.
    let out = python(&format!(
        "data = bytes(range(256)) * 40000\nwith open('{m}/llama/py_200.bin', 'wb') as f:\n    f.write(data[:5000])\n    \
         f.write(data[5000:])\nassert open('{m}/llama/.starckpt/200', 'rb').read() == data\nassert \
         open('{m}/llama/py_200.bin', 'rb').read() == data\nprint('ok')"
    ));
    assert_eq!(out.trim(), "ok");
    let deadline = Instant::now() + Duration::from_secs(5);
    while sh_ok(&format!("readlink {m}/llama/.starckpt/latest")).trim() != "../py_200.bin" {
        assert!(Instant::now() < deadline, "latest did not move to the new checkpoint");
        std::thread::sleep(Duration::from_millis(100));
    }

    // torch.save/torch.load through the mount where torch is installed, numpy.save/load elsewhere.
    let has_torch = Command::new("python3").args(["-c", "import torch"]).output().unwrap().status.success();
    let out = if has_torch {
        python(&format!(
            "import torch\nsd = {{'w': torch.arange(1000000, dtype=torch.float32), 'b': torch.ones(3, dtype=torch.bfloat16)}}\n\
             torch.save(sd, '{m}/llama/model_300.pt')\nback = torch.load('{m}/llama/model_300.pt')\n\
             assert all(torch.equal(sd[k], back[k]) for k in sd)\nprint('ok')"
        ))
    } else {
        python(&format!(
            "import numpy as np\na = np.arange(1000000, dtype=np.float32).reshape(1000, 1000)\n\
             np.save('{m}/llama/model_300.npy', a)\nb = np.load('{m}/llama/model_300.npy')\n\
             assert b.dtype == a.dtype and b.shape == a.shape and (a == b).all()\nprint('ok')"
        ))
    };
    assert_eq!(out.trim(), "ok");

    // A 1 GiB file written and read back.
    let big = cluster.dir.path().join("big.bin");
    sh_ok(&format!("head -c 1G /dev/urandom > {}", big.display()));
    sh_ok(&format!(
        "mkdir {m}/llama/big.tmp && cp {} {m}/llama/big.tmp/ && mv {m}/llama/big.tmp {m}/llama/ckpt-400",
        big.display()
    ));
    sh_ok(&format!("cmp {} {m}/llama/ckpt-400/big.bin", big.display()));
    std::fs::remove_file(&big).unwrap();

    // A file its writer closed is final while another descriptor of it is still open (its
    // release not yet come): the rename commits it, and writes through that descriptor fail.
    let out = python(&format!(
        "import os\nos.mkdir('{m}/llama/held.tmp')\nf = open('{m}/llama/held.tmp/f', 'wb', buffering=0)\n\
         f.write(b'z' * 100)\nother = os.dup(f.fileno())\nf.close()\nos.rename('{m}/llama/held.tmp', '{m}/llama/step_500')\n\
         try:\n    os.write(other, b'more')\nexcept OSError as e:\n    print(e.errno)\nos.close(other)\n\
         print(open('{m}/llama/step_500/f', 'rb').read() == b'z' * 100)"
    ));
    assert_eq!(out.split_whitespace().collect::<Vec<_>>(), ["95", "True"], "{out}");
    // Bytes written through such a descriptor before the rename are not in the file: the draft
    // cannot commit.
    let out = python(&format!(
        "import os\nos.mkdir('{m}/llama/late.tmp')\nf = open('{m}/llama/late.tmp/f', 'wb', buffering=0)\n\
         f.write(b'z' * 100)\nother = os.dup(f.fileno())\nf.close()\n\
         for op in (lambda: os.write(other, b'more'), lambda: os.rename('{m}/llama/late.tmp', '{m}/llama/step_600')):\n\
         \x20   try:\n        op()\n        print('ok')\n    except OSError as e:\n        print(e.errno)"
    ));
    assert_eq!(out.split_whitespace().collect::<Vec<_>>(), ["95", "5"], "{out}");

    // What is refused, with the right errno, at once.
    assert_eq!(python_errno(&format!("open('{m}/llama/999/x', 'rb')")), "ENOENT");
    assert_eq!(python_errno(&format!("open('{m}/llama/step_100/new', 'wb')")), "EROFS");
    assert_eq!(python_errno(&format!("open('{m}/llama/step_100/optim.pt', 'r+b')")), "EROFS");
    assert_eq!(python_errno(&format!("os.truncate('{m}/llama/step_100/optim.pt', 1)")), "EROFS");
    assert_eq!(python_errno(&format!("os.link('{m}/llama/step_100/optim.pt', '{m}/llama/hard_1')")), "EPERM");
    assert_eq!(python_errno(&format!("os.mkdir('{m}/llama/step_100/sub')")), "EROFS");
    // A file of a committed checkpoint removed (rm -r does it file by file) is gone for its
    // remover only, and back whole when the remover stops before removing the top.
    let out = python(&format!(
        "import os\nos.unlink('{m}/llama/step_100/optim.pt')\nprint(os.path.exists('{m}/llama/step_100/optim.pt'))"
    ));
    assert_eq!(out.trim(), "False");
    sh_ok(&format!("cmp {m}/llama/step_100/optim.pt {src}/optim.pt"));
    // Seeks back, read-your-writes and renames inside a draft.
    let out = python(&format!(
        "import os\nos.mkdir('{m}/llama/rand.tmp')\nf = open('{m}/llama/rand.tmp/f', 'w+b')\nf.write(b'x' * 10)\nf.flush()\n\
         f.seek(2)\nf.write(b'y')\nf.flush()\nf.seek(0)\nprint(f.read())\nf.close()\n\
         os.rename('{m}/llama/rand.tmp/f', '{m}/llama/rand.tmp/g')\nprint(open('{m}/llama/rand.tmp/g', 'rb').read())"
    ));
    assert_eq!(out.split_whitespace().collect::<Vec<_>>(), ["b'xxyxxxxxxx'", "b'xxyxxxxxxx'"], "{out}");
    assert_eq!(python_errno(&format!("os.rename('{m}/llama/rand.tmp', '{m}/llama/no-digits')")), "EINVAL");
    assert_eq!(
        python_errno(&format!("os.mkdir('{m}/llama/dup.tmp')\nos.rename('{m}/llama/dup.tmp', '{m}/llama/step_100')")),
        "EEXIST"
    );
    assert_eq!(python_errno(&format!("os.rmdir('{m}/llama')")), "ENOTEMPTY");
    // rmdir of a committed step deletes the checkpoint.
    sh_ok(&format!("rmdir {m}/llama/ckpt-400"));
    let listed = cluster.json(&["ls", "llama", "--all"]);
    let state_of_400: Vec<&str> =
        listed.as_array().unwrap().iter().filter(|c| c["step"] == 400).map(|c| c["state"].as_str().unwrap()).collect();
    assert_eq!(state_of_400, vec!["deleted"]);
}

/// A tenant's mount streams its files' chunks under the tenant's chunk addresses
/// (starckpt_proto::address): they commit, restore, and deduplicate against nothing outside the
/// tenant.
#[test]
fn a_tenants_mount_writes_under_its_own_chunk_addresses() {
    let secrets = tempfile::tempdir().unwrap();
    let tokens = secrets.path().join("tokens");
    let admin = common::new_token(&tokens, &["--admin"]);
    let acme = common::new_token(&tokens, &["--tenant", "acme"]);
    let cluster = Cluster::start_with_tokens(2, &tokens, &admin, &[]);
    let point = cluster.dir.path().join("ckpt");
    let mount = Mounted::start_env(&cluster, &point, &[], &[("STARCKPT_TOKEN", &acme)]);
    let source = cluster.dir.path().join("source");
    make_tree(&source);
    let (m, src) = (mount.point.to_str().unwrap().to_owned(), source.to_str().unwrap().to_owned());
    sh_ok(&format!("mkdir -p {m}/llama && mkdir {m}/llama/step_5.tmp && cp -r {src}/. {m}/llama/step_5.tmp/"));
    sh_ok(&format!("mv {m}/llama/step_5.tmp {m}/llama/step_5"));
    // acme's job; the operator sees it under its stored name and restores it.
    let listed = cluster.json(&["ls", "acme/llama"]);
    assert_eq!((listed[0]["step"].as_u64(), listed[0]["state"].as_str()), (Some(5), Some("committed")), "{listed}");
    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "acme/llama", "--step", "5", "--to", restored.to_str().unwrap()]);
    assert_eq!(tree(&source), tree(&restored));
    // The same files saved outside every tenant are stored again, not deduplicated.
    let saved = cluster.json(&["save", "--job", "shared", "--step", "1", &src]);
    assert_eq!(saved["deduplicated_chunks"], 0, "{saved}");
    assert!(saved["chunks"].as_u64().unwrap() >= 3, "{saved}");
}

#[test]
fn killing_the_mount_mid_write_commits_nothing_and_unmount_paths_work() {
    let cluster = Cluster::start(1);
    let point = cluster.dir.path().join("ckpt");
    let mut mount = Mounted::start(&cluster, &point);
    let m = point.to_str().unwrap().to_owned();
    sh_ok(&format!(
        "mkdir {m}/job && mkdir {m}/job/s1.tmp && echo hello > {m}/job/s1.tmp/a && mv {m}/job/s1.tmp {m}/job/step_1"
    ));
    // Mounting on a busy mount point is a clear error.
    let second = cluster.cli(&["mount", &m]);
    assert!(!second.status.success());
    assert!(String::from_utf8_lossy(&second.stderr).contains("already a mount point"), "{second:?}");

    // A writer is in the middle of a draft checkpoint when the daemon is SIGKILLed.
    let mut writer = Command::new("python3")
        .args([
            "-c",
            &format!(
                "import os, time\nos.mkdir('{m}/job/step_2.tmp')\nf = open('{m}/job/step_2.tmp/big', 'wb')\n\
                 for i in range(10000):\n    f.write(os.urandom(1 << 20))\n    time.sleep(0.01)"
            ),
        ])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    cluster.wait_for_chunks(4, "the writer never streamed a chunk");
    mount.child.kill().unwrap();
    mount.child.wait().unwrap();
    let _ = writer.kill();
    let _ = writer.wait();
    let listed = cluster.json(&["ls", "job", "--all"]);
    assert_eq!(listed.as_array().unwrap().len(), 1, "only step 1 exists: {listed}");
    assert_eq!(cluster.json(&["ls"])[0]["latest_step"], 1);
    sh_ok(&format!("umount -l {m}"));

    // A writer killed in the middle of a one-file checkpoint: its descriptors are closed by the
    // kernel as it exits, which must not commit the truncated file. Nor one killed before writing
    // anything (not an empty file as the latest checkpoint), whose name is then free again.
    let mount_again = Mounted::start(&cluster, &point);
    let killed_commits_nothing = |script: &str| {
        let killed = Command::new("python3").args(["-c", script]).output().unwrap();
        assert!(!killed.status.success());
        // The kernel does not wait for the dying writer's flush: give a wrong commit time to land.
        for _ in 0..20 {
            std::thread::sleep(Duration::from_millis(100));
            let listed = cluster.json(&["ls", "job", "--all"]);
            assert_eq!(listed.as_array().unwrap().len(), 1, "a killed writer's file was committed: {listed}");
        }
    };
    killed_commits_nothing(&format!(
        "import os\nf = open('{m}/job/partial_7.bin', 'wb')\nf.write(os.urandom(9 << 20))\nf.flush()\nos.kill(os.getpid(), 9)"
    ));
    killed_commits_nothing(&format!("import os\nf = open('{m}/job/run_8.bin', 'wb')\nos.kill(os.getpid(), 9)"));
    // The next run writes it, starting a child process midway: the child's exec closes the
    // descriptor it inherited, which is not the end of the file.
    let script = format!(
        "import os, subprocess\nf = open('{m}/job/run_8.bin', 'wb')\nf.write(b'a' * (3 << 20))\nf.flush()\n\
         subprocess.run(['true'], check=True)\nf.write(b'b' * (3 << 20))\nf.close()"
    );
    let run = Command::new("python3").args(["-c", &script]).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let listed = cluster.json(&["ls", "job"]);
    let step_8 = listed.as_array().unwrap().iter().find(|c| c["step"] == 8).expect("step 8 committed");
    assert_eq!(step_8["bytes"], 6 << 20, "{step_8}");
    // A writer that exits cleanly with the file still open (a program writing to its stdout):
    // the kernel's close of it ends the file.
    sh_ok(&format!("exec > {m}/job/stdout_9.txt; printf hello"));
    // Opened by one process and written by another, which closes it last: its release ends it
    // (a release names no process).
    let file = std::fs::File::create(format!("{m}/job/child_10.txt")).unwrap();
    let child = Command::new("sh").args(["-c", "printf world"]).stdout(file).status().unwrap();
    assert!(child.success());
    // A seek back to patch what was written (a zip writer's header) lands in the file, which is
    // uploaded from its spill copy when it is closed. A name with a multibyte character before
    // its digits is just a name.
    python(&format!(
        "import os\nf = open('{m}/job/seek_11.bin', 'wb', buffering=0)\nf.write(b'a' * 10)\nf.seek(0)\n\
         f.write(b'b')\nf.close()"
    ));
    assert_eq!(sh_ok(&format!("cat {m}/job/seek_11.bin")), "baaaaaaaaa");
    sh_ok(&format!("printf x > {m}/job/é12"));
    // The shell opens the file and a child writes it: the child killed mid-write gives it up,
    // although the shell then closes it as usual.
    let script = format!(
        "{{ python3 -c 'import os, sys; sys.stdout.buffer.write(b\"x\" * (3 << 20)); sys.stdout.flush(); \
         os.kill(os.getpid(), 9)'; true; }} > {m}/job/kid_13.bin"
    );
    sh(&script);
    // The shell closes one descriptor of the file (`>&2` moves its stdout) and writes on through
    // another: that close committed it short, and the next write takes the checkpoint back.
    let moved = sh(&format!("{{ echo a; echo note >&2; echo b; }} > {m}/job/moved_14.txt"));
    assert!(!moved.status.success(), "the write after the commit was not refused");
    let committed = |step: u64| {
        let listed = cluster.json(&["ls", "job", "--all"]);
        listed.as_array().unwrap().iter().find(|c| c["step"] == step && c["state"] == "committed").cloned()
    };
    for (step, bytes) in [(9, 5), (10, 5), (11, 10), (12, 1)] {
        let checkpoint = committed(step).unwrap_or_else(|| panic!("step {step} was not committed"));
        assert_eq!(checkpoint["bytes"], bytes, "{checkpoint}");
    }
    assert!(committed(13).is_none(), "a file whose writing child was killed was committed");
    assert!(committed(14).is_none(), "a file written to after its commit stayed committed");
    drop(mount_again);

    // fusermount3 -u from outside: the daemon notices and exits cleanly.
    let mut mount = Mounted::start(&cluster, &point);
    assert_eq!(sh_ok(&format!("cat {m}/job/step_1/a")), "hello\n");
    sh_ok(&format!("fusermount3 -u {m}"));
    mount.wait_clean_exit(&cluster.dir.path().join("mount.log"));
    // SIGTERM: unmounts and exits cleanly.
    let mut mount = Mounted::start(&cluster, &point);
    // SAFETY: sending a signal to our own child.
    unsafe { libc::kill(mount.child.id() as i32, libc::SIGTERM) };
    mount.wait_clean_exit(&cluster.dir.path().join("mount.log"));
    assert!(!sh_ok("cat /proc/self/mountinfo").contains(&m), "still mounted after SIGTERM");
    // A missing mount point is a clear error.
    let stderr = cluster.fails(&["mount", "/definitely/not/here"]);
    assert!(stderr.contains("does not exist"), "{stderr}");
}

/// A mount SIGKILLed in the middle of two saves (a tree being copied for a rename, a DCP step
/// directory written in place) and started again under the same writer name, at another mount
/// point (as on another host: the drafts are kept at the control plane), lists both drafts with
/// every file that was closed in them, and the saves' last steps (the rename, `.metadata`)
/// commit them whole; their records are gone once committed.
#[test]
fn a_restarted_mount_finds_its_drafts_and_commits_them() {
    let cluster = Cluster::start(2);
    let point = cluster.dir.path().join("ckpt");
    let writer = ["--draft-writer", "trainer-7:/ckpt"];
    let mut mount = Mounted::start_with(&cluster, &point, &writer);
    let m = point.to_str().unwrap().to_owned();
    let source = cluster.dir.path().join("source");
    make_tree(&source);
    let src = source.to_str().unwrap();
    sh_ok(&format!("mkdir -p {m}/job/copy.tmp && cp -a {src}/. {m}/job/copy.tmp/"));
    sh_ok(&format!("mkdir {m}/job/step-7 && cp {src}/optim.pt {m}/job/step-7/__0_0.distcp"));
    mount.child.kill().unwrap();
    mount.child.wait().unwrap();
    sh_ok(&format!("umount -l {m}"));
    assert!(cluster.json(&["ls", "job", "--all"]).as_array().unwrap().is_empty(), "nothing committed yet");

    // Another mount point, the same writer: its drafts come back.
    let point = cluster.dir.path().join("ckpt-moved");
    let mut mount = Mounted::start_with(&cluster, &point, &writer);
    let m = point.to_str().unwrap().to_owned();
    let listed = sh_ok(&format!("ls -a {m}/job"));
    assert_eq!(listed.split_whitespace().collect::<Vec<_>>(), [".", "..", "copy.tmp", "step-7"], "{listed}");
    let size = std::fs::metadata(point.join("job/copy.tmp/model/weights.bin")).unwrap().len();
    assert_eq!(size, 5 << 20);
    sh_ok(&format!("mv {m}/job/copy.tmp {m}/job/step_3"));
    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "job", "--step", "3", "--to", restored.to_str().unwrap()]);
    assert_eq!(tree(&source), tree(&restored));
    // DCP's last step, after the restart: the rest of the directory was kept.
    python(&format!("open('{m}/job/step-7/.metadata', 'wb').write(b'meta')"));
    sh_ok(&format!("cmp {m}/job/step-7/__0_0.distcp {src}/optim.pt"));
    let steps: Vec<u64> =
        cluster.json(&["ls", "job"]).as_array().unwrap().iter().map(|c| c["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [3, 7]);

    // Committed, the drafts' records are gone: the writer started once more sees no draft.
    mount.child.kill().unwrap();
    mount.child.wait().unwrap();
    sh_ok(&format!("umount -l {m}"));
    let _mount = Mounted::start_with(&cluster, &point, &writer);
    let listed = sh_ok(&format!("ls -a {m}/job"));
    assert_eq!(listed.split_whitespace().collect::<Vec<_>>(), [".", "..", "step-7", "step_3"], "{listed}");
}

/// Files with no step number directly in a job directory (Lightning's `last.ckpt`, a model saved
/// at the top of HF's output directory, `-v1` copies) are job files: kept at the control plane,
/// of any size, replaced whole when written again (O_TRUNC, or a rename over them), read back by
/// every mount, deleted by unlink, never a checkpoint and never `latest`.
#[test]
fn job_files_are_kept_replaced_whole_and_seen_by_every_mount() {
    let cluster = Cluster::start(2);
    let point = cluster.dir.path().join("ckpt");
    let mount = Mounted::start(&cluster, &point);
    let m = point.to_str().unwrap().to_owned();
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    let first = source.join("first.bin");
    std::fs::write(&first, random_bytes(9 << 20, 1)).unwrap();
    let second = source.join("second.bin");
    std::fs::write(&second, random_bytes(3 << 20, 2)).unwrap();
    sh_ok(&format!("mkdir {m}/job && cp {} {m}/job/epoch=0-step=5.ckpt", first.display()));
    // Larger than any tracker, written in order: kept, and read back from the targets.
    sh_ok(&format!("cp {} {m}/job/last.ckpt && cmp {m}/job/last.ckpt {}", first.display(), first.display()));
    // Written again with O_TRUNC: replaced whole (a shorter file leaves nothing of the longer).
    sh_ok(&format!("cp {} {m}/job/last.ckpt", second.display()));
    sh_ok(&format!("cmp {m}/job/last.ckpt {}", second.display()));
    // Lightning's atomic idiom (a temporary, then a rename over it) and a `-v1` copy of a step
    // taken under another name, patched at its head as zip writers do.
    python(&format!(
        "import os, shutil\nshutil.copyfile('{}', '{m}/job/last.ckpt.tmp')\nos.replace('{m}/job/last.ckpt.tmp', '{m}/job/last.ckpt')\n\
         f = open('{m}/job/epoch=0-step=5-v1.ckpt', 'wb')\nf.write(b'z' * (2 << 20))\nf.seek(0)\nf.write(b'head')\nf.close()",
        first.display()
    ));
    sh_ok(&format!("cmp {m}/job/last.ckpt {}", first.display()));
    // Appending to a kept file would need its bytes here: refused.
    assert_eq!(python_errno(&format!("open('{m}/job/last.ckpt', 'ab').write(b'x')")), "ENOTSUP");
    // `copystat` after the copy (shutil.move across filesystems) is accepted.
    sh_ok(&format!("touch -d 2020-01-01 {m}/job/last.ckpt && chmod 600 {m}/job/last.ckpt"));
    let listed = sh_ok(&format!("ls {m}/job"));
    assert_eq!(
        listed.split_whitespace().collect::<Vec<_>>(),
        ["epoch=0-step=5-v1.ckpt", "epoch=0-step=5.ckpt", "last.ckpt"],
        "{listed}"
    );
    // Job files are no checkpoints: step 5 alone is committed, and it is `latest`.
    let steps: Vec<u64> =
        cluster.json(&["ls", "job"]).as_array().unwrap().iter().map(|c| c["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [5]);
    assert_eq!(std::fs::read_link(point.join("job/.starckpt/latest")).unwrap(), Path::new("../epoch=0-step=5.ckpt"));

    // Another mount (another host, or this one restarted) sees them as written.
    drop(mount);
    let other = cluster.dir.path().join("other");
    let _mount = Mounted::start(&cluster, &other);
    let o = other.to_str().unwrap().to_owned();
    sh_ok(&format!("cmp {o}/job/last.ckpt {}", first.display()));
    let patched = std::fs::read(other.join("job/epoch=0-step=5-v1.ckpt")).unwrap();
    assert_eq!((patched.len(), &patched[..5]), (2 << 20, &b"headz"[..]));
    // A collection leaves a kept file's chunks alone (the replaced ones' go after the grace).
    cluster.ok(&["gc"]);
    sh_ok(&format!("cmp {o}/job/last.ckpt {}", first.display()));
    // Deleted by unlink, for every mount; a directory cannot replace one.
    sh_ok(&format!("rm {o}/job/epoch=0-step=5-v1.ckpt"));
    assert!(!other.join("job/epoch=0-step=5-v1.ckpt").exists());
    assert_eq!(
        python_errno(&format!("os.mkdir('{o}/job/d.tmp')\nos.rename('{o}/job/d.tmp', '{o}/job/last.ckpt')")),
        "ENOTDIR"
    );
    let listed = sh_ok(&format!("ls {o}/job"));
    assert_eq!(listed.split_whitespace().collect::<Vec<_>>(), ["epoch=0-step=5.ckpt", "last.ckpt"], "{listed}");
}

/// A close in a draft whose record the control plane cannot take fails (`EIO`): the file would
/// not survive a restart of the mount, and the framework is told its save failed.
#[test]
fn a_close_whose_draft_cannot_be_recorded_fails() {
    let cluster = Cluster::start(1);
    let point = cluster.dir.path().join("ckpt");
    let _mount = Mounted::start(&cluster, &point);
    let m = point.to_str().unwrap().to_owned();
    sh_ok(&format!("mkdir {m}/job && mkdir {m}/job/step-1 && echo a > {m}/job/step-1/a"));
    // The job's bound on drafts (1,024) is reached through the SDK, then the mount's next draft
    // cannot be recorded.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let config = starckpt_client::ClientConfig::new(cluster.server.address.clone());
        let client = starckpt_client::Client::connect(config).await.unwrap();
        let empty = starckpt_proto::model::Manifest {
            files: vec![],
            directories: vec![],
            metadata: Default::default(),
            addressing: starckpt_proto::Addressing::plain(),
        };
        for i in 1..starckpt_proto::draft::MAX_DRAFTS_PER_JOB {
            client.put_draft("job", &format!("other-{i}"), "elsewhere", &empty).await.unwrap();
        }
    });
    sh_ok(&format!("mkdir {m}/job/step-2"));
    let closed = python_errno(&format!("with open('{m}/job/step-2/b', 'wb') as f:\n    f.write(b'b')"));
    assert_eq!(closed, "EIO", "the close succeeded without a record");
    // The draft recorded before the bound was reached is intact, and commits.
    python(&format!("open('{m}/job/step-1/.metadata', 'wb').write(b'meta')"));
    assert_eq!(cluster.json(&["ls", "job"]).as_array().unwrap().len(), 1);
}

/// A chunk read that fails (every copy's target down) is EIO for that read only: the same open
/// file reads it once a target is back, instead of failing for as long as it stays open.
#[test]
fn a_failed_read_is_tried_again_on_the_same_open_file() {
    use std::io::Write;
    let mut cluster = Cluster::start(1);
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    let data = random_bytes((6 << 20) + 17, 9);
    std::fs::write(source.join("weights.bin"), &data).unwrap();
    cluster.json(&["save", "--job", "llama", "--step", "1", source.to_str().unwrap()]);
    let mount = Mounted::start(&cluster, &cluster.dir.path().join("ckpt"));
    let path = mount.point.join("llama/1/weights.bin");

    // One open file, read after each line on stdin: its errno or its bytes' length and digest.
    let script = format!(
        "import errno, hashlib, sys\nf = open('{}', 'rb', buffering=0)\nprint('open', flush=True)\n\
         for _ in sys.stdin:\n    f.seek(0)\n    try:\n        b = f.read()\n        \
         print(len(b), hashlib.sha256(b).hexdigest(), flush=True)\n    except OSError as e:\n        \
         print(errno.errorcode[e.errno], flush=True)\n",
        path.display()
    );
    let mut reader =
        Command::new("python3").args(["-c", &script]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut stdin = reader.stdin.take().unwrap();
    let mut stdout = BufReader::new(reader.stdout.take().unwrap());
    let mut answer = || {
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        line.trim().to_owned()
    };
    assert_eq!(answer(), "open");
    cluster.targets[0].kill();
    stdin.write_all(b"read\n").unwrap();
    assert_eq!(answer(), "EIO");
    cluster.targets[0] = cluster.start_target(0);
    cluster.wait_alive(1);
    stdin.write_all(b"read\n").unwrap();
    let digest = sh_ok(&format!("sha256sum {}", source.join("weights.bin").display()));
    assert_eq!(answer(), format!("{} {}", data.len(), digest.split_whitespace().next().unwrap()));
    drop(stdin);
    reader.wait().unwrap();
}

/// A step deleted and saved again is another checkpoint: the mount serves the new one's bytes,
/// not the old one's from the kernel's cache of the same path (same name, same size).
#[test]
fn a_step_saved_again_serves_its_new_bytes() {
    let cluster = Cluster::start(1);
    let mount = Mounted::start(&cluster, &cluster.dir.path().join("ckpt"));
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(source.join("model")).unwrap();
    let path = mount.point.join("again/7/model/weights.bin");
    let digest = |file: &Path| sh_ok(&format!("sha256sum < {}", file.display()));
    for seed in [1, 2] {
        if seed == 2 {
            cluster.ok(&["rm", "again", "7"]);
        }
        std::fs::write(source.join("model/weights.bin"), random_bytes((1 << 20) + 5, seed)).unwrap();
        cluster.json(&["save", "--job", "again", "--step", "7", source.to_str().unwrap()]);
        // Past the mount's listing cache (1 s), not its cache of names and pages (60 s).
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(digest(&path), digest(&source.join("model/weights.bin")), "seed {seed}");
    }
}

/// A name the mount gave a checkpoint (a one-file checkpoint's file name) deletes that
/// checkpoint only: once the step is saved again by someone else, removing the old name leaves
/// the new checkpoint alone.
#[test]
fn removing_a_stale_name_never_deletes_a_newer_checkpoint() {
    let cluster = Cluster::start(1);
    let mount = Mounted::start(&cluster, &cluster.dir.path().join("ckpt"));
    let m = mount.point.to_str().unwrap().to_owned();
    sh_ok(&format!("mkdir {m}/stale && printf old > {m}/stale/weights_9.bin"));
    let committed = |step: u64| {
        let listed = cluster.json(&["ls", "stale"]);
        listed.as_array().unwrap().iter().find(|c| c["step"] == step).map(|c| c["checkpoint_id"].clone())
    };
    let first = committed(9).expect("the one-file checkpoint committed");
    // Saved again at step 9 from outside the mount.
    cluster.ok(&["rm", "stale", "9"]);
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("other.bin"), b"new").unwrap();
    cluster.json(&["save", "--job", "stale", "--step", "9", source.to_str().unwrap()]);
    let second = committed(9).expect("saved again");
    assert_ne!(first, second);
    assert_eq!(python_errno(&format!("os.unlink('{m}/stale/weights_9.bin')")), "ENOENT");
    assert_eq!(committed(9), Some(second), "the newer checkpoint was deleted through the old name");
    // Its own name deletes it, once past the mount's listing cache (1 s).
    std::thread::sleep(Duration::from_millis(1500));
    sh_ok(&format!("rmdir {m}/stale/9"));
    assert_eq!(committed(9), None);
}

/// A directory of many entries lists each exactly once, across the many pages the kernel reads
/// it in (each open lists it once; pages come from that listing).
#[test]
fn a_large_directory_lists_every_entry_once() {
    let cluster = Cluster::start(1);
    let mount = Mounted::start(&cluster, &cluster.dir.path().join("ckpt"));
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(source.join("shards")).unwrap();
    const FILES: usize = 20_000;
    for i in 0..FILES {
        std::fs::write(source.join(format!("shards/{i:05}.pt")), b"").unwrap();
    }
    cluster.json(&["save", "--job", "wide", "--step", "1", source.to_str().unwrap()]);
    let dir = mount.point.join("wide/1/shards");
    let mut listed: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert_eq!(listed.len(), FILES);
    listed.sort();
    listed.dedup();
    assert_eq!(listed.len(), FILES, "an entry was listed twice");
    assert_eq!(sh_ok(&format!("ls -f {} | wc -l", dir.display())).trim(), (FILES + 2).to_string());
}

/// Chunk files the cluster's targets have read for GETs so far.
fn chunk_reads(cluster: &Cluster) -> u64 {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let config = starckpt_client::ClientConfig::new(cluster.server.address.clone());
        let client = starckpt_client::Client::connect(config).await.unwrap();
        let mut reads = 0;
        for target in client.targets().await.unwrap() {
            reads += client.target_stat(&target).await.unwrap().chunk_reads;
        }
        reads
    })
}

/// A random read (a loader reading one tensor by its offset) fetches the chunks it covers, not a
/// read-ahead window behind them.
#[test]
fn random_reads_fetch_only_the_chunks_they_cover() {
    let cluster = Cluster::start(1);
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    let data = random_bytes(12 << 20, 4);
    std::fs::write(source.join("shard.bin"), &data).unwrap();
    cluster.json(&["save", "--job", "rand", "--step", "1", "--chunk-size", "1MiB", source.to_str().unwrap()]);
    let mount = Mounted::start(&cluster, &cluster.dir.path().join("ckpt"));
    let path = mount.point.join("rand/1/shard.bin");

    let before = chunk_reads(&cluster);
    for (offset, len) in [((5 << 20) + 100, 200), ((9 << 20) + 4000, 100)] {
        let script = format!(
            "import os, sys\nf = os.open('{}', os.O_RDONLY)\nsys.stdout.buffer.write(os.pread(f, {len}, {offset}))",
            path.display()
        );
        let output = Command::new("python3").args(["-c", &script]).output().unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        assert_eq!(output.stdout, &data[offset..offset + len]);
    }
    assert_eq!(chunk_reads(&cluster) - before, 2, "each read fetched its one chunk");
    // Read through from the start: whole and right. (How many fetches that takes depends on the
    // order the mount's threads see the kernel's requests in; at least one per chunk.)
    assert_eq!(std::fs::read(&path).unwrap(), data);
    assert!(chunk_reads(&cluster) - before >= 2 + 12);
}

/// The read-ahead windows of all open files share one budget: a file held open keeps what it read
/// ahead within the budget until it idles; another file read meanwhile still reads whole and
/// right; one read after the first idled takes the budget back.
#[test]
fn read_ahead_of_all_open_files_shares_one_budget() {
    let cluster = Cluster::start(1);
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    let data: Vec<Vec<u8>> = (0..3).map(|seed| random_bytes(12 << 20, 10 + seed)).collect();
    for (name, bytes) in ["a", "b", "c"].iter().zip(&data) {
        std::fs::write(source.join(format!("{name}.bin")), bytes).unwrap();
    }
    cluster.json(&["save", "--job", "budget", "--step", "1", "--chunk-size", "1MiB", source.to_str().unwrap()]);
    let mount = Mounted::start_with(&cluster, &cluster.dir.path().join("ckpt"), &["--read-ahead-budget", "2MiB"]);
    let dir = mount.point.join("budget/1");
    // Fetches settle (read-ahead runs in the background): wait for `at_least`, then a moment more.
    let settled = |since: u64, at_least: u64| {
        let deadline = Instant::now() + Duration::from_secs(20);
        while chunk_reads(&cluster) - since < at_least && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(500));
        chunk_reads(&cluster) - since
    };
    // Opens `name`, reads its first 4 KiB and keeps it open: (the holder, chunks fetched).
    let first_bytes = |name: &str| -> (Child, u64) {
        let before = chunk_reads(&cluster);
        let script = format!(
            "import os, sys\nf = os.open('{}', os.O_RDONLY)\nsys.stdout.buffer.write(os.read(f, 4096))\nsys.stdout.flush()\nsys.stdin.read()",
            dir.join(name).display()
        );
        let mut holder =
            Command::new("python3").args(["-c", &script]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
        let mut head = vec![0; 4096];
        std::io::Read::read_exact(holder.stdout.as_mut().unwrap(), &mut head).unwrap();
        assert_eq!(head, data[(name.as_bytes()[0] - b'a') as usize][..4096]);
        let fetched = settled(before, 2);
        (holder, fetched)
    };
    let close = |mut holder: Child| {
        drop(holder.stdin.take());
        assert!(holder.wait().unwrap().success());
    };

    // a.bin: the chunk read and one ahead fill the 2 MiB budget; it stays open, and idles.
    let (a, fetched) = first_bytes("a.bin");
    assert_eq!(fetched, 2, "the first read's chunk and one chunk ahead, within the budget");
    std::thread::sleep(Duration::from_millis(2500));
    // c.bin takes the idle window's budget back.
    let (c, fetched) = first_bytes("c.bin");
    assert_eq!(fetched, 2, "the budget of a file that idled went to one being read");
    // b.bin, read through while c.bin holds the budget: whole and right.
    assert_eq!(std::fs::read(dir.join("b.bin")).unwrap(), data[1]);
    close(a);
    close(c);
}

/// Past the budget (here no chunk fits in it at all), a sequential reader still fetches each chunk
/// about once, not once per kernel request inside it.
#[test]
fn reads_past_the_budget_fetch_each_chunk_about_once() {
    let cluster = Cluster::start(1);
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    let data = random_bytes(16 << 20, 21);
    std::fs::write(source.join("big.bin"), &data).unwrap();
    cluster.json(&["save", "--job", "over", "--step", "1", "--chunk-size", "4MiB", source.to_str().unwrap()]);
    let mount = Mounted::start_with(&cluster, &cluster.dir.path().join("ckpt"), &["--read-ahead-budget", "1MiB"]);
    let before = chunk_reads(&cluster);
    // 256 KiB reads, one at a time (no kernel read-ahead running alongside): 16 per chunk.
    let script = format!(
        "import os, sys\nf = open('{}', 'rb', buffering=0)\nos.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)\nout = bytearray()\nwhile True:\n    b = f.read(256 << 10)\n    if not b: break\n    out += b\nsys.stdout.buffer.write(out)",
        mount.point.join("over/1/big.bin").display()
    );
    let output = Command::new("python3").args(["-c", &script]).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(output.stdout == data, "read back wrong");
    let fetched = chunk_reads(&cluster) - before;
    // 4 chunks; a chunk fetched again where the kernel's requests arrive out of order.
    assert!((4..=8).contains(&fetched), "{fetched} fetches for 4 chunks");
}

/// Targets that fill up in the middle of a save written in place: the file's write or close
/// fails with ENOSPC and a log line, its draft's completion marker commits nothing (the draft
/// holds a failed file), and the checkpoint committed before is still the latest, whole.
#[test]
fn targets_that_fill_up_mid_save_fail_it_and_keep_the_last_checkpoint() {
    let mut cluster = Cluster::start(1);
    let point = cluster.dir.path().join("ckpt");
    let _mount = Mounted::start(&cluster, &point);
    let m = point.to_str().unwrap().to_owned();
    let data = random_bytes(3 << 20, 11);
    let shard = cluster.dir.path().join("shard.bin");
    std::fs::write(&shard, &data).unwrap();
    let s = shard.to_str().unwrap();
    sh_ok(&format!("mkdir -p {m}/job/step-1 && cp {s} {m}/job/step-1/__0_0.distcp"));
    python(&format!("open('{m}/job/step-1/.metadata', 'wb').write(b'meta')"));

    // The only target keeps more in reserve than its disk holds: every put is refused.
    cluster.targets[0].kill();
    cluster.targets[0] = cluster.start_target_with(0, &["--reserve-bytes", &u64::MAX.to_string()]);
    cluster.wait_alive(1);
    sh_ok(&format!("mkdir {m}/job/step-2"));
    let other = cluster.dir.path().join("other.bin");
    std::fs::write(&other, random_bytes(3 << 20, 12)).unwrap();
    let code = python_errno(&format!(
        "with open('{m}/job/step-2/__0_0.distcp', 'wb') as f:\n    f.write(open('{}', 'rb').read())",
        other.display()
    ));
    assert_eq!(code, "ENOSPC", "a write to full targets");
    let marker = python_errno(&format!("with open('{m}/job/step-2/.metadata', 'wb') as f:\n    f.write(b'meta')"));
    assert!(["ENOSPC", "EIO"].contains(&marker.as_str()), "the marker of a draft with a failed file: {marker}");
    let log = std::fs::read_to_string(cluster.dir.path().join("mount.log")).unwrap();
    assert!(log.contains("full") || log.contains("NoSpace"), "no log line says the targets are full");

    let listed: Vec<u64> =
        cluster.json(&["ls", "job"]).as_array().unwrap().iter().map(|c| c["step"].as_u64().unwrap()).collect();
    assert_eq!(listed, [1], "only the checkpoint committed before");
    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "job", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(std::fs::read(restored.join("__0_0.distcp")).unwrap(), data);
}

/// Two hosts' mounts (two writer names) write one DCP step directory in place, each its rank's
/// file, as `dcp.save` on two hosts does; the coordinator's `.metadata` on the first commits
/// the files of both, and the second mount then shows the committed checkpoint, whole.
#[test]
fn mounts_of_two_hosts_commit_one_draft_together() {
    let cluster = Cluster::start(2);
    let (a, b) = (cluster.dir.path().join("host-a"), cluster.dir.path().join("host-b"));
    let _mount_a = Mounted::start_with(&cluster, &a, &["--draft-writer", "host-a:/ckpt"]);
    let _mount_b = Mounted::start_with(&cluster, &b, &["--draft-writer", "host-b:/ckpt"]);
    let (ma, mb) = (a.to_str().unwrap().to_owned(), b.to_str().unwrap().to_owned());
    let (rank0, rank1) = (random_bytes((5 << 20) + 3, 21), random_bytes(777_777, 22));
    let (f0, f1) = (cluster.dir.path().join("r0"), cluster.dir.path().join("r1"));
    std::fs::write(&f0, &rank0).unwrap();
    std::fs::write(&f1, &rank1).unwrap();
    sh_ok(&format!("mkdir -p {ma}/job/step-9 && cp {} {ma}/job/step-9/__0_0.distcp", f0.display()));
    sh_ok(&format!("mkdir -p {mb}/job/step-9/sub && cp {} {mb}/job/step-9/__1_0.distcp", f1.display()));
    python(&format!("with open('{ma}/job/step-9/.metadata', 'wb') as f:\n    f.write(b'meta')"));

    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "job", "--step", "9", "--to", restored.to_str().unwrap()]);
    assert_eq!(std::fs::read(restored.join("__0_0.distcp")).unwrap(), rank0);
    assert_eq!(std::fs::read(restored.join("__1_0.distcp")).unwrap(), rank1);
    assert!(restored.join("sub").is_dir(), "the other writer's directory");
    // The other host's mount: its draft is the committed checkpoint now (after its listing's TTL).
    std::thread::sleep(Duration::from_millis(1500));
    sh_ok(&format!("cmp {mb}/job/step-9/__0_0.distcp {}", f0.display()));
    sh_ok(&format!("cmp {mb}/job/step-9/.metadata - <<< 'meta' || test \"$(cat {mb}/job/step-9/.metadata)\" = meta"));
    let listed = sh_ok(&format!("ls -a {mb}/job"));
    assert_eq!(listed.split_whitespace().collect::<Vec<_>>(), [".", "..", "step-9"], "{listed}");
}

/// A read through the mount of a checkpoint with a copy of each chunk on a target that stopped
/// answering (SIGSTOP; the control plane, heartbeats 60 s apart, still lists it alive) is served
/// from the other replica, in about a second rather than a request's deadline per chunk.
#[test]
fn a_read_with_one_replicas_target_stopped_is_served_from_the_other() {
    let mut cluster = Cluster::start_with(0, &["--heartbeat-secs", "60"]);
    for index in 0..2 {
        let target = cluster.start_target(index);
        cluster.targets.push(target);
    }
    cluster.wait_alive(2);
    let mount = Mounted::start(&cluster, &cluster.dir.path().join("ckpt"));
    let source = cluster.dir.path().join("source");
    std::fs::create_dir_all(&source).unwrap();
    let bytes = random_bytes(8 << 20, 41);
    std::fs::write(source.join("weights.bin"), &bytes).unwrap();
    let saved =
        cluster.json(&["save", "--job", "stopped", "--step", "3", "--chunk-size", "262144", source.to_str().unwrap()]);
    assert_eq!(saved["committed"], true);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(cluster.targets[0].pid() as i32, libc::SIGSTOP) };
    let started = Instant::now();
    let read = std::fs::read(mount.point.join("stopped/3/weights.bin"));
    let took = started.elapsed();
    // SAFETY: as above.
    unsafe { libc::kill(cluster.targets[0].pid() as i32, libc::SIGCONT) };
    assert!(read.unwrap() == bytes, "the bytes read differ");
    assert!(took < Duration::from_secs(60), "the read took {took:?}");
    eprintln!("read 8 MiB with one of two replicas' targets stopped in {took:.2?}");
}
