//! Test harness: real `starckpt` processes on 127.0.0.1, each killed when the test ends.
#![allow(dead_code, clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_starckpt");

/// A child process, SIGKILLed on drop.
pub struct Proc {
    pub child: Child,
    pub address: String,
}

impl Proc {
    /// Starts `starckpt ARGS` and waits for its "... listening on ADDR" line.
    fn start(args: &[&str], log: &Path, env: &[(&str, &str)]) -> Proc {
        Proc::start_configured(args, log, env, |_| {})
    }

    /// `start`, the command further set up by `configure` before it is spawned.
    fn start_configured(args: &[&str], log: &Path, env: &[(&str, &str)], configure: impl FnOnce(&mut Command)) -> Proc {
        let log_file = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
        let mut command = Command::new(BIN);
        command.args(args).stdout(Stdio::piped()).stderr(Stdio::from(log_file)).env("RUST_LOG", "info");
        // Control planes and targets of one test's cluster (their logs share its directory) share
        // a cluster key, as in production: clients' data-plane requests carry capabilities.
        if matches!(args.first(), Some(&"server" | &"target")) {
            command.env("STARCKPT_CLUSTER_KEY_FILE", cluster_key_file(log.parent().unwrap()));
        }
        for (key, value) in env {
            command.env(key, value);
        }
        configure(&mut command);
        let mut child = command.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).unwrap();
        let address = line.trim().rsplit(' ').next().unwrap_or_default().to_owned();
        assert!(
            address.contains(':'),
            "no address from {args:?}: {line:?}; log: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        Proc { child, address }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The cluster key file of the cluster whose files are in `dir`, made on first use.
pub fn cluster_key_file(dir: &Path) -> PathBuf {
    let path = dir.join("cluster.key");
    if !path.exists() {
        let secret = format!("test secret {} {:?}", std::process::id(), std::time::SystemTime::now());
        std::fs::write(&path, secret).unwrap();
    }
    path
}

/// A control plane and N targets, each a separate `starckpt` process, data under one temp dir.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub server: Proc,
    pub targets: Vec<Proc>,
    /// The control plane's extra flags, kept across restarts.
    pub server_flags: Vec<String>,
    /// The control plane's metadata store: `meta.db` in `dir`, or a PostgreSQL URL.
    pub db: String,
    /// Further control planes on the same PostgreSQL database ([`Cluster::start_ha`]); the
    /// targets know them all.
    pub peers: Vec<Proc>,
    /// Environment of [`Cluster::cli`]'s commands (an admin's bearer token, where the control
    /// plane requires one: [`Cluster::start_with_tokens`]).
    pub cli_env: Vec<(String, String)>,
    /// Environment of every target process (the CA of a control plane serving TLS:
    /// [`Cluster::start_with_tls`]).
    pub target_env: Vec<(String, String)>,
}

/// A CA, and a certificate for 127.0.0.1 and localhost that it signed, as PEM files in a
/// directory: what a control plane serves TLS with, and what its clients trust.
pub struct TestCertificate {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestCertificate {
    /// Makes a new CA and certificate, written to `dir`/`name`-{ca,cert,key}.pem.
    pub fn make(dir: &Path, name: &str) -> TestCertificate {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(DnType::CommonName, format!("starckpt test CA {name}"));
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        let made = TestCertificate {
            ca: dir.join(format!("{name}-ca.pem")),
            cert: dir.join(format!("{name}-cert.pem")),
            key: dir.join(format!("{name}-key.pem")),
        };
        std::fs::write(&made.ca, ca.pem()).unwrap();
        std::fs::write(&made.cert, cert.pem()).unwrap();
        std::fs::write(&made.key, key.serialize_pem()).unwrap();
        made
    }
}

impl Cluster {
    pub fn start(targets: usize) -> Cluster {
        Cluster::start_with(targets, &[])
    }

    /// A cluster whose control plane gets extra flags.
    pub fn start_with(targets: usize, server_flags: &[&str]) -> Cluster {
        Cluster::start_with_env(targets, server_flags, &[])
    }

    /// A cluster whose control plane gets extra flags and environment variables.
    pub fn start_with_env(targets: usize, server_flags: &[&str], server_env: &[(&str, &str)]) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("meta.db").to_str().unwrap().to_owned();
        Cluster::start_on(dir, db, 1, targets, server_flags, server_env, Vec::new())
    }

    /// A cluster whose control plane serves only the bearer tokens of `tokens_file` (and gets
    /// `server_flags`); the harness's own commands (and [`Cluster::cli`]) carry `admin_token`.
    pub fn start_with_tokens(targets: usize, tokens_file: &Path, admin_token: &str, server_flags: &[&str]) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("meta.db").to_str().unwrap().to_owned();
        let mut flags = vec!["--tokens-file", tokens_file.to_str().unwrap()];
        flags.extend_from_slice(server_flags);
        let cli_env = vec![("STARCKPT_TOKEN".to_owned(), admin_token.to_owned())];
        Cluster::start_on(dir, db, 1, targets, &flags, &[], cli_env)
    }

    /// A cluster whose control plane serves TLS only, with `certificate`; its targets and the
    /// harness's own commands (and [`Cluster::cli`]) trust its CA (`STARCKPT_TLS_CA`).
    pub fn start_with_tls(targets: usize, certificate: &TestCertificate) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("meta.db").to_str().unwrap().to_owned();
        let flags = ["--tls-cert", certificate.cert.to_str().unwrap(), "--tls-key", certificate.key.to_str().unwrap()];
        let cli_env = vec![("STARCKPT_TLS_CA".to_owned(), certificate.ca.to_str().unwrap().to_owned())];
        Cluster::start_on(dir, db, 1, targets, &flags, &[], cli_env)
    }

    /// A cluster of `control_planes` control planes sharing the PostgreSQL database `db`, and
    /// targets that know every one of them.
    pub fn start_ha(db: &str, control_planes: usize, targets: usize) -> Cluster {
        Cluster::start_ha_env(db, control_planes, targets, &[])
    }

    /// `start_ha`, the first control plane (`server`) started with extra environment variables.
    pub fn start_ha_env(db: &str, control_planes: usize, targets: usize, first_env: &[(&str, &str)]) -> Cluster {
        Cluster::start_on(
            tempfile::tempdir().unwrap(),
            db.to_owned(),
            control_planes,
            targets,
            &[],
            first_env,
            Vec::new(),
        )
    }

    fn start_on(
        dir: tempfile::TempDir,
        db: String,
        control_planes: usize,
        targets: usize,
        server_flags: &[&str],
        server_env: &[(&str, &str)],
        cli_env: Vec<(String, String)>,
    ) -> Cluster {
        let start = |env| start_server_env(dir.path(), &db, server_flags, env);
        let server = start(server_env);
        let peers = (1..control_planes).map(|_| start(&[])).collect();
        let server_flags = server_flags.iter().map(|f| f.to_string()).collect();
        // Targets trust what the harness's commands trust.
        let target_env = cli_env.iter().filter(|(key, _)| key == "STARCKPT_TLS_CA").cloned().collect();
        let mut cluster = Cluster { dir, server, targets: Vec::new(), server_flags, db, peers, cli_env, target_env };
        for index in 0..targets {
            let target = cluster.start_target(index);
            cluster.targets.push(target);
        }
        cluster.wait_alive(targets);
        cluster
    }

    /// Every control plane's address, comma-separated (what `--server` takes).
    pub fn servers(&self) -> String {
        std::iter::once(&self.server).chain(&self.peers).map(|p| p.address.as_str()).collect::<Vec<_>>().join(",")
    }

    pub fn target_dir(&self, index: usize) -> PathBuf {
        self.dir.path().join(format!("target-{index}"))
    }

    pub fn start_target(&self, index: usize) -> Proc {
        self.start_target_with(index, &[])
    }

    /// Starts target `index` with extra flags.
    pub fn start_target_with(&self, index: usize, extra: &[&str]) -> Proc {
        self.start_target_env(index, extra, &[])
    }

    /// Starts target `index` with extra flags and environment variables.
    pub fn start_target_env(&self, index: usize, extra: &[&str], env: &[(&str, &str)]) -> Proc {
        self.start_target_configured(index, extra, env, |_| {})
    }

    /// Starts target `index` with extra flags and environment variables, its command further set
    /// up by `configure` (e.g. [`limit_locked_memory`]).
    pub fn start_target_configured(
        &self,
        index: usize,
        extra: &[&str],
        env: &[(&str, &str)],
        configure: impl FnOnce(&mut Command),
    ) -> Proc {
        let dir = self.target_dir(index);
        // Targets that trust chunk ages as if they had run for a day, so GC tests can age chunks.
        let servers = self.servers();
        let args = ["target", "--dir", dir.to_str().unwrap(), "--listen", "127.0.0.1:0", "--server", &servers];
        let mut args = args.to_vec();
        args.extend(["--assume-uptime-secs", "86400"]);
        // A fixed queue depth unless a test asks otherwise: measuring the device (the default,
        // `auto`) writes 1.5 GiB on each target's first start.
        if !extra.contains(&"--queue-depth") {
            args.extend(["--queue-depth", "8"]);
        }
        args.extend_from_slice(extra);
        let mut all_env: Vec<(&str, &str)> = self.target_env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        all_env.extend_from_slice(env);
        Proc::start_configured(&args, &self.dir.path().join(format!("target-{index}.log")), &all_env, configure)
    }

    /// SIGKILLs the control plane and starts it again on the same address and database (the
    /// targets keep heartbeating to that address and re-register when it answers again).
    pub fn restart_server(&mut self) {
        self.restart_server_env(&[]);
    }

    /// `restart_server`, the new process started with extra environment variables.
    pub fn restart_server_env(&mut self, env: &[(&str, &str)]) {
        let address = self.server.address.clone();
        self.server.kill();
        let mut args = vec!["server", "--listen", &address, "--db", &self.db];
        args.extend(self.server_flags.iter().map(String::as_str));
        self.server = Proc::start(&args, &self.dir.path().join("server.log"), env);
    }

    /// SIGKILLs every process, then starts them again on the same data.
    pub fn kill_and_restart(&mut self) {
        self.server.kill();
        for target in &mut self.targets {
            target.kill();
        }
        let flags: Vec<&str> = self.server_flags.iter().map(String::as_str).collect();
        self.server = start_server_on(self.dir.path(), &self.db, &flags);
        let count = self.targets.len();
        self.targets = (0..count).map(|i| self.start_target(i)).collect();
        self.wait_alive(count);
    }

    /// Waits (up to a minute) for the control plane to exit: struck by a fault point.
    pub fn wait_server_exit(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.server.child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "the control plane is still running");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Runs the CLI against this cluster.
    pub fn cli(&self, args: &[&str]) -> Output {
        let env: Vec<(&str, &str)> = self.cli_env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        cli_with_env(&self.server.address, args, &env)
    }

    /// Starts the CLI against this cluster in the background, its output discarded.
    pub fn spawn(&self, args: &[&str]) -> std::process::Child {
        let mut command = Command::new(BIN);
        command.args(args).env("STARCKPT_SERVER", &self.server.address).env_remove("STARCKPT_JOB");
        command.envs(self.cli_env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        command.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().unwrap()
    }

    /// Runs the CLI and asserts success, returning stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let output = self.cli(args);
        assert!(
            output.status.success(),
            "starckpt {args:?} failed: {}\n{}",
            String::from_utf8_lossy(&output.stderr),
            String::from_utf8_lossy(&output.stdout)
        );
        String::from_utf8(output.stdout).unwrap()
    }

    /// Runs the CLI and asserts failure, returning stderr.
    pub fn fails(&self, args: &[&str]) -> String {
        let output = self.cli(args);
        assert!(
            !output.status.success(),
            "starckpt {args:?} should have failed: {}",
            String::from_utf8_lossy(&output.stdout)
        );
        String::from_utf8(output.stderr).unwrap()
    }

    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = args.to_vec();
        all.push("--json");
        serde_json::from_str(&self.ok(&all)).unwrap()
    }

    /// Runs the CLI with `--json`: whether it succeeded, and the report it printed either way.
    pub fn json_outcome(&self, args: &[&str]) -> (bool, serde_json::Value) {
        let mut all = args.to_vec();
        all.push("--json");
        let output = self.cli(&all);
        let report = serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
            panic!("starckpt {all:?} printed no JSON ({e}): {}", String::from_utf8_lossy(&output.stderr))
        });
        (output.status.success(), report)
    }

    /// Waits until every running target process is registered, alive, at its current address.
    /// A bound for a hung target, not a timing: a target run with `--queue-depth auto` registers
    /// only after it has measured its device (1.5 GiB each way), which on a 2-core CI machine busy
    /// with other tests has taken over 20 s.
    /// Waits (up to 15 s) for the control plane to list the target at `address` in `state`
    /// (alive, suspect, dead).
    pub fn wait_target_state(&self, address: &str, state: &str) {
        let state_of = || -> String {
            let status = self.json(&["status"]);
            let targets = status["targets"].as_array().unwrap();
            targets.iter().find(|t| t["data_address"] == address).unwrap()["state"].as_str().unwrap().to_owned()
        };
        let deadline = Instant::now() + Duration::from_secs(15);
        while state_of() != state {
            assert!(Instant::now() < deadline, "target {address} never became {state}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn wait_alive(&self, count: usize) {
        assert_eq!(count, self.targets.len());
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let output = self.cli(&["status", "--json"]);
            if output.status.success() {
                let status: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
                let listed = status["targets"].as_array().cloned().unwrap_or_default();
                let ready = self.targets.iter().all(|proc| {
                    listed.iter().any(|t| t["state"] == "alive" && t["data_address"] == proc.address.as_str())
                });
                if ready {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "targets did not come alive");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Chunk files stored by all targets.
    pub fn total_chunks(&self) -> usize {
        (0..self.targets.len()).map(|i| self.chunk_files(i).len()).sum()
    }

    /// Waits (at most 30 s) until the targets hold at least `count` chunks: an upload is under
    /// way and can be killed in the middle.
    pub fn wait_for_chunks(&self, count: usize, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.total_chunks() < count {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Makes every chunk file on every target look last used `ago` (as if written long before).
    pub fn age_all_chunks(&self, ago: Duration) {
        for index in 0..self.targets.len() {
            for path in self.chunk_files(index) {
                let file = std::fs::File::options().write(true).open(&path).unwrap();
                file.set_modified(std::time::SystemTime::now() - ago).unwrap();
            }
        }
    }

    /// Rots the copy a restore of `job` at `step` reads first: the first chunk of its first file,
    /// on the target its manifest lists first (one payload byte flipped). Returns the chunk file
    /// and its good bytes ([`wait_repaired`]).
    pub fn rot_first_copy(&self, job: &str, step: &str) -> (PathBuf, Vec<u8>) {
        let shown = self.json(&["show", job, step]);
        let chunk = &shown["files"][0]["chunk_refs"][0];
        let first = chunk["replicas"][0].as_str().unwrap();
        let index = (0..self.targets.len())
            .find(|i| std::fs::read_to_string(self.target_dir(*i).join("target.id")).unwrap().trim() == first)
            .unwrap();
        let hash = chunk["hash"].as_str().unwrap();
        let path = self.target_dir(index).join("chunks").join(&hash[..2]).join(hash);
        let good = std::fs::read(&path).unwrap();
        let mut bad = good.clone();
        bad[4096 + 1000] ^= 0x01;
        std::fs::write(&path, &bad).unwrap();
        (path, good)
    }

    /// Chunk files stored by target `index`.
    pub fn chunk_files(&self, index: usize) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let chunks = self.target_dir(index).join("chunks");
        for fan in std::fs::read_dir(chunks).unwrap() {
            for entry in std::fs::read_dir(fan.unwrap().path()).unwrap() {
                out.push(entry.unwrap().path());
            }
        }
        out
    }
}

/// Waits (10 s at most) for read repair to rewrite the chunk file `path` as `good`.
pub fn wait_repaired(path: &Path, good: &[u8]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::fs::read(path).unwrap_or_default() != good {
        assert!(Instant::now() < deadline, "the bad copy {} was not repaired", path.display());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `starckpt token new ARGS --tokens-file FILE` (`--admin`, or `--tenant NAME`): the token it
/// prints, its hash added to the file.
pub fn new_token(tokens_file: &Path, args: &[&str]) -> String {
    let output =
        Command::new(BIN).args(["token", "new"]).args(args).arg("--tokens-file").arg(tokens_file).output().unwrap();
    assert!(output.status.success(), "token new {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).unwrap().trim().to_owned()
}

/// Sends a data-plane STAT carrying no capability to the target at `address`, as a peer without
/// the cluster key would, and returns the answer.
pub fn stat_without_capability(address: &str) -> starckpt_proto::data::Response {
    use prost::Message;
    use starckpt_proto::frame::{FrameHeader, Opcode};
    use std::io::{Read, Write};
    let mut peer = std::net::TcpStream::connect(address).unwrap();
    let stat = starckpt_proto::data::StatRequest::default().encode_to_vec();
    let header = FrameHeader { opcode: Opcode::Stat, request_id: 7, header_len: stat.len() as u32, payload_len: 0 };
    peer.write_all(&header.encode()).unwrap();
    peer.write_all(&stat).unwrap();
    let mut fixed = [0u8; 24];
    peer.read_exact(&mut fixed).unwrap();
    let mut body = vec![0u8; FrameHeader::decode(&fixed).unwrap().header_len as usize];
    peer.read_exact(&mut body).unwrap();
    starckpt_proto::data::Response::decode(&body[..]).unwrap()
}

/// The target's answer to a shared-memory attach (one 4 KiB slot) on `socket` carrying
/// `capability` (empty: none, the older message); None if it closed the connection instead.
pub fn shm_attach_answer(socket: &Path, capability: &[u8]) -> Option<[u8; 8]> {
    use starckpt_dataplane::shm::{self, Attach, Region};
    use tokio::io::AsyncReadExt;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let region = Region::create("test-slots", 4096).unwrap();
        let mut stream = tokio::net::UnixStream::connect(socket).await.unwrap();
        let attach = Attach { slots: 1, slot_bytes: 4096, staging_bytes: 0 };
        shm::send_attach(&stream, attach, capability, region.fd(), None).await.unwrap();
        let mut answer = [0u8; 8];
        stream.read_exact(&mut answer).await.ok().map(|_| answer)
    })
}

/// Starts a control plane on the cluster's database (`meta.db` in `dir`) with extra flags.
pub fn start_server_with(dir: &Path, extra: &[&str]) -> Proc {
    start_server_on(dir, dir.join("meta.db").to_str().unwrap(), extra)
}

/// Starts a control plane on the database `db` with extra flags; it logs to `dir`/server.log.
pub fn start_server_on(dir: &Path, db: &str, extra: &[&str]) -> Proc {
    start_server_env(dir, db, extra, &[])
}

/// `start_server_on`, the process started with extra environment variables.
pub fn start_server_env(dir: &Path, db: &str, extra: &[&str], env: &[(&str, &str)]) -> Proc {
    start_server_at(dir, db, "127.0.0.1:0", extra, env)
}

/// `start_server_env`, listening on `listen`.
pub fn start_server_at(dir: &Path, db: &str, listen: &str, extra: &[&str], env: &[(&str, &str)]) -> Proc {
    let mut args = vec!["server", "--listen", listen, "--db", db];
    args.extend_from_slice(extra);
    Proc::start(&args, &dir.join("server.log"), env)
}

pub fn cli_with_server(server: &str, args: &[&str]) -> Output {
    cli_with_env(server, args, &[])
}

/// Runs the CLI against `server` with extra environment variables (and no job or token but
/// those given).
pub fn cli_with_env(server: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(BIN);
    command.args(args).env("STARCKPT_SERVER", server).env_remove("STARCKPT_JOB");
    command.env_remove("STARCKPT_TOKEN").env_remove("STARCKPT_TOKEN_FILE").env_remove("STARCKPT_TLS_CA");
    command.envs(env.iter().copied()).output().unwrap()
}

/// Deterministic pseudo-random bytes.
/// Runs `command`'s process as in a container: without CAP_IPC_LOCK (dropped from the bounding
/// set, so root loses it at exec) and with RLIMIT_MEMLOCK at `bytes`, so every page it pins (an
/// io_uring buffer registration, a zero-copy send) counts against that limit.
pub fn limit_locked_memory(command: &mut Command, bytes: u64) {
    use std::os::unix::process::CommandExt;
    const CAP_IPC_LOCK: libc::c_ulong = 14;
    // SAFETY: prctl and setrlimit are async-signal-safe; the closure runs in the child before exec.
    unsafe {
        command.pre_exec(move || {
            // Unprivileged, the drop fails (EPERM), and there is no CAP_IPC_LOCK to lose.
            libc::prctl(libc::PR_CAPBSET_DROP, CAP_IPC_LOCK, 0, 0, 0);
            let limit = libc::rlimit { rlim_cur: bytes, rlim_max: bytes };
            if libc::setrlimit(libc::RLIMIT_MEMLOCK, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    use rand::{RngCore, SeedableRng};
    let mut out = vec![0u8; len];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut out);
    out
}

/// Every file and directory under `root`, relative, with file contents' BLAKE3 and sizes.
pub fn tree(root: &Path) -> Vec<(String, Option<(u64, String)>)> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, Option<(u64, String)>)>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let rel = path.strip_prefix(root).unwrap().to_str().unwrap().to_owned();
            if path.is_dir() {
                out.push((rel, None));
                walk(root, &path, out);
            } else {
                let data = std::fs::read(&path).unwrap();
                out.push((rel, Some((data.len() as u64, blake3::hash(&data).to_hex().to_string()))));
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

/// A loopback address with a port free a moment ago (the exporter binds it itself).
pub fn free_address() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

/// `GET /metrics` at `address`: the exposition text.
pub fn scrape(address: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream
        .write_all(format!("GET /metrics HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n").as_bytes())
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    answer
}

/// The value of the series whose line starts with `series` (name and labels, in the order the
/// exporter writes them), if present.
pub fn value(text: &str, series: &str) -> Option<f64> {
    text.lines().find(|line| line.starts_with(series)).and_then(|line| line.rsplit(' ').next()?.parse().ok())
}

/// Runs `command` and expects it to exit with an error within 30 s (a server that should refuse
/// to start would otherwise serve on); its stderr.
pub fn refuses_to_start(mut command: Command, what: &str) -> String {
    let mut child = command.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{what} kept running");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = child.wait_with_output().unwrap();
    assert!(!output.status.success(), "{what} exited 0");
    String::from_utf8(output.stderr).unwrap()
}
