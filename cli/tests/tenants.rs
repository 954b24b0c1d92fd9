//! Bearer tokens and tenants (`server/src/control/auth.rs`), with real processes: tokens made by
//! `starckpt token new`, a control plane started with `--tokens-file`, and every call made
//! through the CLI or raw gRPC the way a peer would. Also TLS on the control plane's port
//! (`server/src/control/tls.rs`), which keeps those tokens off the wire.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{BIN, Cluster, TestCertificate, cli_with_env};

/// `starckpt token new`, its token checked.
fn new_token(tokens_file: &Path, args: &[&str]) -> String {
    let token = common::new_token(tokens_file, args);
    starckpt_proto::token::check(&token).unwrap();
    token
}

/// The CLI as the holder of `token` (None: no token).
fn as_holder(cluster: &Cluster, token: Option<&str>, args: &[&str]) -> std::process::Output {
    let env: Vec<(&str, &str)> = token.map(|t| ("STARCKPT_TOKEN", t)).into_iter().collect();
    cli_with_env(&cluster.server.address, args, &env)
}

fn ok(cluster: &Cluster, token: &str, args: &[&str]) -> String {
    let output = as_holder(cluster, Some(token), args);
    assert!(output.status.success(), "{args:?}: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).unwrap()
}

fn fails(cluster: &Cluster, token: Option<&str>, args: &[&str]) -> String {
    let output = as_holder(cluster, token, args);
    assert!(!output.status.success(), "{args:?} should have failed: {}", String::from_utf8_lossy(&output.stdout));
    String::from_utf8(output.stderr).unwrap()
}

fn jobs(cluster: &Cluster, token: &str) -> Vec<String> {
    let listed: serde_json::Value = serde_json::from_str(&ok(cluster, token, &["ls", "--json"])).unwrap();
    let mut names: Vec<String> =
        listed.as_array().unwrap().iter().map(|j| j["job"].as_str().unwrap().to_owned()).collect();
    names.sort();
    names
}

#[test]
fn tenants_reach_only_their_own_jobs_and_operators_reach_all() {
    let secrets = tempfile::tempdir().unwrap();
    let tokens = secrets.path().join("tokens");
    let admin = new_token(&tokens, &["--admin"]);
    let acme = new_token(&tokens, &["--tenant", "acme"]);
    let beta = new_token(&tokens, &["--tenant", "beta"]);
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&tokens).unwrap().permissions().mode() & 0o777, 0o600);
    let listed = std::fs::read_to_string(&tokens).unwrap();
    assert!(!listed.contains(&acme[4..]), "the file holds hashes, not tokens");
    let cluster = Cluster::start_with_tokens(2, &tokens, &admin, &[]);

    // Two tenants save a job of the same name; each sees only its own.
    let data = tempfile::tempdir().unwrap();
    let (ours, theirs) = (data.path().join("ours"), data.path().join("theirs"));
    std::fs::write(&ours, common::random_bytes(3 << 20, 1)).unwrap();
    std::fs::write(&theirs, common::random_bytes(1 << 20, 2)).unwrap();
    ok(&cluster, &acme, &["save", "--job", "llama", "--step", "1", ours.to_str().unwrap()]);
    ok(&cluster, &beta, &["save", "--job", "llama", "--step", "7", theirs.to_str().unwrap()]);
    assert_eq!(jobs(&cluster, &acme), ["llama"]);
    assert_eq!(jobs(&cluster, &beta), ["llama"]);
    // The token from a file (STARCKPT_TOKEN_FILE), surrounding whitespace ignored.
    let token_file = secrets.path().join("beta.token");
    std::fs::write(&token_file, format!("{beta}\n")).unwrap();
    let from_file = cli_with_env(
        &cluster.server.address,
        &["ls", "llama"],
        &[("STARCKPT_TOKEN_FILE", token_file.to_str().unwrap())],
    );
    assert!(from_file.status.success() && String::from_utf8_lossy(&from_file.stdout).contains('7'), "{from_file:?}");
    let restored = data.path().join("restored-acme");
    ok(&cluster, &acme, &["restore", "--job", "llama", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(std::fs::read(restored.join("ours")).unwrap(), std::fs::read(&ours).unwrap());
    let restored = data.path().join("restored-beta");
    ok(&cluster, &beta, &["restore", "--job", "llama", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(std::fs::read(restored.join("theirs")).unwrap(), std::fs::read(&theirs).unwrap());
    let shown: serde_json::Value = serde_json::from_str(&ok(&cluster, &acme, &["ls", "llama", "--json"])).unwrap();
    assert_eq!(shown[0]["job"], "llama", "a tenant sees its jobs by their short names: {shown}");
    assert_eq!(shown[0]["step"], 1);

    // A tenant cannot reach another's job, nor act for the cluster.
    let refused = fails(&cluster, Some(&acme), &["ls", "beta/llama"]);
    assert!(refused.contains("without a tenant part"), "{refused}");
    for operation in [&["gc"][..], &["repair"], &["tier"]] {
        let refused = fails(&cluster, Some(&acme), operation);
        assert!(refused.contains("operator"), "{operation:?}: {refused}");
    }
    // The operator sees every job by its stored name and runs the cluster's operations.
    assert_eq!(jobs(&cluster, &admin), ["acme/llama", "beta/llama"]);
    assert!(ok(&cluster, &admin, &["show", "beta/llama", "7"]).contains("theirs"));
    ok(&cluster, &admin, &["gc"]);
    ok(&cluster, &acme, &["status"]);
    // Errors name a tenant's jobs by their short names too.
    let missing = fails(&cluster, Some(&acme), &["show", "llama", "99"]);
    assert!(missing.contains("llama") && !missing.contains("acme/"), "{missing}");

    // No token, an unknown one, a malformed one.
    let refused = fails(&cluster, None, &["ls"]);
    assert!(refused.contains("bearer token") && refused.contains("STARCKPT_TOKEN"), "{refused}");
    let refused = fails(&cluster, Some(&starckpt_proto::token::generate()), &["ls"]);
    assert!(refused.contains("not one this control plane knows"), "{refused}");
    let refused = fails(&cluster, Some("hunter2"), &["ls"]);
    assert!(refused.contains("stk_"), "{refused}");

    // Revoked: the file rewritten without acme's line takes effect without a restart.
    let kept: Vec<&str> = listed.lines().filter(|line| !line.starts_with("tenant acme ")).collect();
    std::fs::write(&tokens, kept.join("\n") + "\n").unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while as_holder(&cluster, Some(&acme), &["ls"]).status.success() {
        assert!(Instant::now() < deadline, "a revoked token still works");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(jobs(&cluster, &beta), ["llama"], "the other tokens still work");
}

/// A tokens file in `dir` with an admin's token and tenants acme's and beta's: (file, admin,
/// acme, beta).
fn tokens_of_two_tenants(dir: &Path) -> (std::path::PathBuf, String, String, String) {
    let tokens = dir.join("tokens");
    let admin = new_token(&tokens, &["--admin"]);
    let acme = new_token(&tokens, &["--tenant", "acme"]);
    let beta = new_token(&tokens, &["--tenant", "beta"]);
    (tokens, admin, acme, beta)
}

/// A cluster of `targets` targets whose control plane serves the tokens of
/// [`tokens_of_two_tenants`], started off the runtime's threads: (the tokens file's directory,
/// the cluster, admin's token, acme's, beta's).
async fn cluster_of_two_tenants(targets: usize) -> (tempfile::TempDir, Cluster, String, String, String) {
    let secrets = tempfile::tempdir().unwrap();
    let (tokens, admin, acme, beta) = tokens_of_two_tenants(secrets.path());
    let started = admin.clone();
    let cluster =
        tokio::task::spawn_blocking(move || Cluster::start_with_tokens(targets, &tokens, &started, &[])).await.unwrap();
    (secrets, cluster, admin, acme, beta)
}

/// A gRPC channel to the cluster's control plane.
async fn channel(cluster: &Cluster) -> tonic::transport::Channel {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{}", cluster.server.address)).unwrap();
    endpoint.connect().await.unwrap()
}

/// Adds a bearer token to every call.
#[derive(Clone)]
struct Bearer(tonic::metadata::MetadataValue<tonic::metadata::Ascii>);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        request.metadata_mut().insert("authorization", self.0.clone());
        Ok(request)
    }
}

type Holder = starckpt_proto::control::control_client::ControlClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Bearer>,
>;

/// A raw gRPC client of the control plane, as the holder of `token`.
fn holder(channel: &tonic::transport::Channel, token: &str) -> Holder {
    let bearer = Bearer(format!("Bearer {token}").try_into().unwrap());
    starckpt_proto::control::control_client::ControlClient::with_interceptor(channel.clone(), bearer)
}

#[tokio::test]
async fn a_tenant_cannot_commit_into_another_tenants_checkpoint() {
    use starckpt_proto::control::control_client::ControlClient;
    use starckpt_proto::control::*;

    let (_secrets, cluster, _, acme, beta) = cluster_of_two_tenants(1).await;
    let channel = channel(&cluster).await;
    let (mut acme, mut beta) = (holder(&channel, &acme), holder(&channel, &beta));

    let epoch = acme
        .acquire_lease(AcquireLeaseRequest { job: "j".into(), run_id: "r".into(), started_at_ms: 0 })
        .await
        .unwrap()
        .into_inner()
        .epoch;
    let begun = acme
        .begin_checkpoint(BeginCheckpointRequest { job: "j".into(), step: 1, world_size: 1, epoch })
        .await
        .unwrap()
        .into_inner();
    let target = begun.placement[0].target_id.clone();
    let part = CommitPartRequest {
        checkpoint_id: begun.checkpoint_id,
        rank: 0,
        manifest: Some(Manifest {
            files: vec![FileEntry {
                path: "intruder".into(),
                size_bytes: 4,
                mode: 0o644,
                chunks: vec![ChunkRef {
                    hash: vec![7u8; 32].into(),
                    length_bytes: 4,
                    stored_length_bytes: 4,
                    codec: 0,
                    replicas: vec![target],
                }],
            }],
            chunk_key: begun.chunk_key.clone(),
            ..Default::default()
        }),
        written_bytes: 0,
    };
    // A tenant's chunks are addressed with its key, handed out with the checkpoint: a manifest
    // addressed by plain BLAKE3, or with a key of its own choosing, is refused.
    assert_eq!(begun.chunk_key.len(), 32);
    for chunk_key in [Vec::new(), vec![5u8; 32]] {
        let mut unkeyed = part.clone();
        unkeyed.manifest.as_mut().unwrap().chunk_key = chunk_key.into();
        let refused = acme.commit_part(unkeyed).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().contains("tenant acme's"), "{refused:?}");
    }
    let refused = beta.commit_part(part.clone()).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::NotFound, "{refused:?}");
    let state = beta.latest(LatestRequest { job: "j".into() }).await.unwrap().into_inner();
    assert!(state.checkpoint.is_none(), "beta has no job j");
    // Nor may a tenant's token ask for what only operators may.
    let refused = beta.collect_garbage(CollectGarbageRequest {}).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);
    // The owner's commit goes through, and the checkpoint is acme's alone.
    let committed = acme.commit_part(part).await.unwrap().into_inner();
    assert_eq!(committed.state, CheckpointState::Committed as i32);
    let latest = acme.latest(LatestRequest { job: "j".into() }).await.unwrap().into_inner().checkpoint.unwrap();
    assert_eq!((latest.job.as_str(), latest.step), ("j", 1));
    // The data capability needs a token too.
    let mut anonymous = ControlClient::new(channel.clone());
    let refused = anonymous.data_capability(DataCapabilityRequest {}).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    assert!(!acme.data_capability(DataCapabilityRequest {}).await.unwrap().into_inner().capability.is_empty());
}

#[test]
fn a_control_plane_refuses_tokens_it_cannot_use() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    new_token(&tokens, &["--admin"]);
    let db = dir.path().join("meta.db");
    let server = |extra: &[&str], key: bool| {
        let mut command = std::process::Command::new(BIN);
        command.args(["server", "--listen", "127.0.0.1:0", "--db", db.to_str().unwrap()]).args(extra);
        command.env_remove("STARCKPT_CLUSTER_KEY_FILE").env_remove("STARCKPT_TOKENS_FILE");
        if key {
            command.env("STARCKPT_CLUSTER_KEY_FILE", common::cluster_key_file(dir.path()));
        }
        let output = command.output().unwrap();
        assert!(!output.status.success(), "{extra:?} started");
        String::from_utf8(output.stderr).unwrap()
    };
    let refused = server(&["--tokens-file", tokens.to_str().unwrap()], false);
    assert!(refused.contains("cluster key"), "{refused}");
    std::fs::write(dir.path().join("broken"), "admin 1234\n").unwrap();
    let refused = server(&["--tokens-file", dir.path().join("broken").to_str().unwrap()], true);
    assert!(refused.contains("line 1"), "{refused}");
    let refused = server(&["--tokens-file", dir.path().join("missing").to_str().unwrap()], true);
    assert!(refused.contains("missing"), "{refused}");
    // `token new` does not add to a file that does not parse, nor make a token for a bad tenant.
    for args in
        [&["--tenant", "a/b"][..], &["--tenant", "ok", "--tokens-file", dir.path().join("broken").to_str().unwrap()]]
    {
        let output = std::process::Command::new(BIN).args(["token", "new"]).args(args).output().unwrap();
        assert!(!output.status.success(), "{args:?}");
    }
    assert_eq!(std::fs::read_to_string(dir.path().join("broken")).unwrap(), "admin 1234\n");
}

/// The CLI against `cluster`'s control plane, as `address` (None: as the harness dials it), with
/// `env` alone.
fn tls_client(cluster: &Cluster, address: Option<&str>, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    cli_with_env(address.unwrap_or(&cluster.server.address), args, env)
}

#[test]
fn a_control_plane_with_a_certificate_serves_tls_only() {
    let certs = tempfile::tempdir().unwrap();
    let first = TestCertificate::make(certs.path(), "first");
    // The targets register and heartbeat over TLS (the harness waits for them), and a save and a
    // restore go through it.
    let cluster = Cluster::start_with_tls(2, &first);
    let source = cluster.dir.path().join("state.bin");
    std::fs::write(&source, common::random_bytes(3 << 20, 7)).unwrap();
    cluster.ok(&["save", "--job", "tls", "--step", "1", source.to_str().unwrap()]);
    let restored = cluster.dir.path().join("restored");
    cluster.ok(&["restore", "--job", "tls", "--latest", "--to", restored.to_str().unwrap()]);
    assert_eq!(std::fs::read(restored.join("state.bin")).unwrap(), std::fs::read(&source).unwrap());
    let ca = first.ca.to_str().unwrap();
    // The CA as a flag, and an https:// address with it.
    let https = format!("https://{}", cluster.server.address);
    for (address, args) in [(None, &["--tls-ca", ca, "ls"][..]), (Some(https.as_str()), &["--tls-ca", ca, "ls"])] {
        let output = tls_client(&cluster, address, args, &[]);
        assert!(output.status.success(), "{address:?}: {}", String::from_utf8_lossy(&output.stderr));
        assert!(String::from_utf8_lossy(&output.stdout).contains("tls"));
    }

    // A client in plaintext fails (and the control plane says what probably happened); so does
    // one that checks the certificate against CAs that did not sign it: the system's, or another.
    let plain = tls_client(&cluster, None, &["ls"], &[]);
    assert!(String::from_utf8_lossy(&plain.stderr).contains("serve TLS?"), "{plain:?}");
    let log = std::fs::read_to_string(cluster.dir.path().join("server.log")).unwrap();
    assert!(log.contains("TLS handshake failed (a client dialling without TLS?"), "{log}");
    let unknown = tls_client(&cluster, Some(&https), &["ls"], &[]);
    let other = TestCertificate::make(certs.path(), "other");
    let wrong_ca = tls_client(&cluster, None, &["ls"], &[("STARCKPT_TLS_CA", other.ca.to_str().unwrap())]);
    for refused in [unknown, wrong_ca] {
        assert!(!refused.status.success());
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(stderr.contains("certificate"), "{stderr}");
    }
    // A CA file that holds no certificate is refused before anything is dialled.
    let broken = certs.path().join("broken.pem");
    std::fs::write(&broken, "not a certificate").unwrap();
    let refused = tls_client(&cluster, None, &["ls"], &[("STARCKPT_TLS_CA", broken.to_str().unwrap())]);
    assert!(String::from_utf8_lossy(&refused.stderr).contains("broken.pem"), "{refused:?}");

    // A renewed certificate (from another CA, to tell them apart) is served without a restart:
    // the key file first, then the certificate, each by a rename.
    let install = |from: &Path, to: &Path| {
        let staged = to.with_extension("new");
        std::fs::copy(from, &staged).unwrap();
        std::fs::rename(&staged, to).unwrap();
    };
    install(&other.key, &first.key);
    install(&other.cert, &first.cert);
    let renewed = [("STARCKPT_TLS_CA", other.ca.to_str().unwrap())];
    let deadline = Instant::now() + Duration::from_secs(60);
    while !tls_client(&cluster, None, &["ls"], &renewed).status.success() {
        assert!(Instant::now() < deadline, "the renewed certificate is not served");
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(!tls_client(&cluster, None, &["ls"], &[("STARCKPT_TLS_CA", ca)]).status.success());
    let log = std::fs::read_to_string(cluster.dir.path().join("server.log")).unwrap();
    assert!(log.contains("serving the control plane's renewed TLS certificate"), "{log}");
}

#[test]
fn a_control_plane_refuses_a_certificate_it_cannot_serve() {
    let dir = tempfile::tempdir().unwrap();
    let made = TestCertificate::make(dir.path(), "made");
    let other = TestCertificate::make(dir.path(), "other");
    let db = dir.path().join("meta.db");
    let server = |extra: &[&str]| {
        let mut command = std::process::Command::new(BIN);
        command.args(["server", "--listen", "127.0.0.1:0", "--db", db.to_str().unwrap()]).args(extra);
        command.env_remove("STARCKPT_TLS_CERT").env_remove("STARCKPT_TLS_KEY");
        let output = command.output().unwrap();
        assert!(!output.status.success(), "{extra:?} started");
        String::from_utf8(output.stderr).unwrap()
    };
    let (cert, key) = (made.cert.to_str().unwrap(), made.key.to_str().unwrap());
    let refused = server(&["--tls-cert", cert]);
    assert!(refused.contains("--tls-key"), "{refused}");
    let refused = server(&["--tls-cert", cert, "--tls-key", other.key.to_str().unwrap()]);
    assert!(refused.contains("does not hold the key of the certificate"), "{refused}");
    let missing = dir.path().join("missing-cert.pem");
    let refused = server(&["--tls-cert", missing.to_str().unwrap(), "--tls-key", key]);
    assert!(refused.contains("missing"), "{refused}");
    let refused = server(&["--tls-cert", key, "--tls-key", key]);
    assert!(refused.contains("holds no PEM certificate"), "{refused}");
}

/// Deduplication never crosses tenants (starckpt_proto::address): the same bytes saved by two
/// tenants and an operator's job outside every tenant are three sets of chunks, each addressed
/// differently, each restored and verified; within a tenant, saving them again deduplicates.
#[tokio::test]
async fn tenants_never_deduplicate_against_each_other() {
    use starckpt_proto::control::*;

    let (_secrets, cluster, admin, acme, beta) = cluster_of_two_tenants(2).await;
    let data = tempfile::tempdir().unwrap();
    let weights = data.path().join("weights");
    let bytes = common::random_bytes((9 << 20) + 5, 11);
    std::fs::write(&weights, &bytes).unwrap();
    let save = |token: &str, job: &str, step: &str| -> serde_json::Value {
        let args = ["save", "--job", job, "--step", step, "--json", weights.to_str().unwrap()];
        serde_json::from_str(&ok(&cluster, token, &args)).unwrap()
    };
    let first = save(&acme, "llama", "1");
    assert_eq!(first["deduplicated_chunks"], 0, "{first}");
    let chunks = first["chunks"].as_u64().unwrap();
    assert!(chunks >= 3, "{first}");
    for (token, job) in [(&beta, "llama"), (&admin, "shared")] {
        let saved = save(token, job, "1");
        assert_eq!(saved["deduplicated_chunks"], 0, "{job} deduplicated against another tenant's chunks: {saved}");
        assert_eq!(saved["uploaded_bytes"].as_u64(), Some(bytes.len() as u64), "{saved}");
    }
    let again = save(&acme, "llama", "2");
    assert_eq!(again["deduplicated_chunks"].as_u64(), Some(chunks), "within a tenant: {again}");

    // The manifests: three sets of addresses; the operator's job's are plain BLAKE3.
    let channel = channel(&cluster).await;
    let addresses = |token: &str, job: &str| {
        let mut client = holder(&channel, token);
        let job = job.to_owned();
        async move {
            let got = client
                .get_manifest(GetManifestRequest { job, step: Some(1), ..Default::default() })
                .await
                .unwrap()
                .into_inner();
            let manifest = got.parts[0].manifest.clone().unwrap();
            let hashes: Vec<Vec<u8>> = manifest.files[0].chunks.iter().map(|c| c.hash.to_vec()).collect();
            (manifest.chunk_key.to_vec(), hashes, manifest.files[0].chunks[0].length_bytes)
        }
    };
    let (acme_key, acme_chunks, _) = addresses(&acme, "llama").await;
    let (beta_key, beta_chunks, _) = addresses(&beta, "llama").await;
    let (plain_key, plain_chunks, first_length) = addresses(&admin, "shared").await;
    assert_eq!((acme_key.len(), beta_key.len(), plain_key.len()), (32, 32, 0));
    assert_ne!(acme_key, beta_key);
    // The first chunk's address: plain BLAKE3 outside every tenant, the key's hash of that within.
    let plain = blake3::hash(&bytes[..first_length as usize]);
    assert_eq!(plain_chunks[0], plain.as_bytes().to_vec(), "outside every tenant: plain BLAKE3");
    let keyed = blake3::keyed_hash(&acme_key.clone().try_into().unwrap(), plain.as_bytes());
    assert_eq!(acme_chunks[0], keyed.as_bytes().to_vec(), "acme's: its key's hash of the plain one");
    for (index, plain) in plain_chunks.iter().enumerate() {
        assert_ne!(&acme_chunks[index], plain);
        assert_ne!(&beta_chunks[index], plain);
        assert_ne!(&acme_chunks[index], &beta_chunks[index]);
    }
    // The operator reading acme's job reads acme's addressing.
    let (key, chunks_seen, _) = addresses(&admin, "acme/llama").await;
    assert_eq!((&key, &chunks_seen), (&acme_key, &acme_chunks));

    // Each restores, verified under its own addressing.
    for (token, job, to) in [(&acme, "llama", "acme"), (&beta, "llama", "beta"), (&admin, "shared", "plain")] {
        let to = data.path().join(to);
        ok(&cluster, token, &["restore", "--job", job, "--step", "1", "--to", to.to_str().unwrap()]);
        assert_eq!(std::fs::read(to.join("weights")).unwrap(), bytes, "{job}");
    }

    // Read repair of a tenant's chunk: its first copy rots; the restore reads around it and the
    // copy is rewritten from the good one, under its keyed address.
    let (path, good) = cluster.rot_first_copy("acme/llama", "1");
    let to = data.path().join("acme-repaired");
    ok(&cluster, &acme, &["restore", "--job", "llama", "--step", "1", "--to", to.to_str().unwrap()]);
    assert_eq!(std::fs::read(to.join("weights")).unwrap(), bytes);
    tokio::task::spawn_blocking(move || common::wait_repaired(&path, &good)).await.unwrap();
}

/// A file streamed for one job's chunk addresses (the mount's way: chunks uploaded before a
/// checkpoint begins) commits only into a job addressed the same way: into a job outside every
/// tenant it is refused, and the checkpoint it began is not left pending.
#[tokio::test]
async fn a_file_streamed_for_a_tenants_job_commits_only_there() {
    let (_secrets, cluster, admin, _, _) = cluster_of_two_tenants(1).await;
    let mut config = starckpt_client::ClientConfig::new(&cluster.server.address);
    config.token = Some(admin.clone());
    let client = starckpt_client::Client::connect(config).await.unwrap();
    let data = common::random_bytes(3 << 20, 21);
    let mut stream = client.streaming_file("acme/llama").await.unwrap();
    stream.write(&data).await.unwrap();
    let file = stream.finish("weights.bin".try_into().unwrap(), 0o644).await.unwrap();

    let refused = client.commit_streamed("shared", 1, vec![file.clone()], vec![], Default::default()).await;
    let message = refused.unwrap_err().to_string();
    assert!(message.contains("streamed with other chunk addresses"), "{message}");
    assert!(client.list_checkpoints("shared", false).await.unwrap().is_empty(), "nothing left pending");

    let committed = client.commit_streamed("acme/llama", 1, vec![file], vec![], Default::default()).await.unwrap();
    assert!(committed.committed());
    let manifest = client.manifest("acme/llama", Some(1)).await.unwrap();
    assert!(manifest.addressing.is_keyed());
    assert_eq!(&client.read_file(&manifest, "weights.bin").await.unwrap()[..], &data[..]);
}
