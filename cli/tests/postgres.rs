#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a failed unwrap is a failed test
//! The control plane on PostgreSQL, end to end: real `starckpt server` processes on a real
//! PostgreSQL server (scripts/test starts a throwaway one; `starckpt_server::testing`), real
//! targets, the real CLI. Each test takes a database of its own.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{BIN, Cluster, cli_with_server, random_bytes, tree};

/// A fresh database on the tests' PostgreSQL server; None where the tests have none.
fn database(test: &str) -> Option<String> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(starckpt_server::testing::fresh_postgres_database(test)).unwrap()
}

/// A few files, different for each `seed`.
fn make_tree(root: &Path, seed: u64) {
    for (index, (path, len)) in
        [("model.bin", 9 << 20), ("optim/rank0.pt", (3 << 20) + 17), ("meta.json", 300)].into_iter().enumerate()
    {
        let full = root.join(path);
        std::fs::create_dir_all(full.parent().unwrap()).unwrap();
        std::fs::write(full, random_bytes(len, seed * 10 + index as u64)).unwrap();
    }
}

/// Runs the CLI against `servers`, asserting success; stdout.
fn ok(servers: &str, args: &[&str]) -> String {
    let output = cli_with_server(servers, args);
    assert!(output.status.success(), "starckpt {args:?} failed: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).unwrap()
}

fn save(servers: &str, source: &Path, step: &str) {
    let saved: serde_json::Value = serde_json::from_str(&ok(
        servers,
        &["save", "--job", "llm", "--step", step, source.to_str().unwrap(), "--json"],
    ))
    .unwrap();
    assert_eq!(saved["committed"], true, "{saved}");
}

fn restore_latest(servers: &str, to: &Path) {
    ok(servers, &["restore", "--job", "llm", "--latest", "--to", to.to_str().unwrap()]);
}

/// Committed checkpoints of job llm, read from the database itself.
fn committed_in_database(db: &str) -> Vec<i64> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        use sqlx::Connection;
        let mut connection = sqlx::postgres::PgConnection::connect(db).await.unwrap();
        sqlx::query_scalar("SELECT step FROM checkpoints WHERE job = 'llm' AND state = 'committed' ORDER BY step")
            .fetch_all(&mut connection)
            .await
            .unwrap()
    })
}

#[test]
fn a_cluster_keeps_its_checkpoints_in_postgres() {
    let Some(db) = database("a_cluster_keeps_its_checkpoints_in_postgres") else { return };
    let mut cluster = Cluster::start_ha(&db, 1, 2);
    let servers = cluster.servers();
    let (one, two) = (cluster.dir.path().join("one"), cluster.dir.path().join("two"));
    make_tree(&one, 1);
    make_tree(&two, 2);
    save(&servers, &one, "1");
    save(&servers, &two, "2");
    assert_eq!(committed_in_database(&db), [1, 2]);

    // The control plane dies without warning and comes back: the checkpoints are in PostgreSQL.
    cluster.restart_server();
    cluster.wait_alive(2);
    let restored = cluster.dir.path().join("restored");
    restore_latest(&servers, &restored);
    assert_eq!(tree(&two), tree(&restored));
    let older = cluster.dir.path().join("older");
    ok(&servers, &["restore", "--job", "llm", "--step", "1", "--to", older.to_str().unwrap()]);
    assert_eq!(tree(&one), tree(&older));
}

/// Starts `starckpt server` on `db` (with `extra` flags) and expects it to exit with an error
/// within 30 s; its stderr.
fn server_refuses(db: &str, extra: &[&str]) -> String {
    let mut command = std::process::Command::new(BIN);
    command.args(["server", "--listen", "127.0.0.1:0", "--db", db]).args(extra);
    common::refuses_to_start(command, &format!("the control plane on {db}"))
}

#[test]
fn the_control_plane_talks_verified_tls_to_postgres() {
    let Some(db) = database("the_control_plane_talks_verified_tls_to_postgres") else { return };
    let url = url::Url::parse(&db).unwrap();
    let query: Vec<(String, String)> = url.query_pairs().map(|(k, v)| (k.into_owned(), v.into_owned())).collect();
    let Some(ca) = query.iter().find(|(k, _)| k == "sslrootcert").map(|(_, v)| v.clone()) else {
        // scripts/postgres's server demands TLS and names its CA in the URL; another may not.
        eprintln!("skipped: {} names no CA (sslrootcert)", starckpt_server::testing::ADMIN_URL_VAR);
        return;
    };
    let cluster = Cluster::start_ha(&db, 1, 1);
    let source = cluster.dir.path().join("one");
    make_tree(&source, 1);
    save(&cluster.servers(), &source, "1");
    // The control plane's connections, seen from the server: every one is TLS (scripts/postgres's
    // server also refuses TCP without it; another server in STARCKPT_TEST_POSTGRES may not).
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (connections, encrypted): (i64, i64) = runtime.block_on(async {
        use sqlx::Connection;
        let mut connection = sqlx::postgres::PgConnection::connect(&db).await.unwrap();
        sqlx::query_as(
            "SELECT count(*), count(*) FILTER (WHERE s.ssl) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
             WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()",
        )
        .fetch_one(&mut connection)
        .await
        .unwrap()
    });
    assert!(connections > 0, "the control plane holds no connection to its database");
    assert_eq!(encrypted, connections, "every connection of the control plane is TLS");

    // A server whose certificate the given CA did not sign is refused (here: the server's own
    // certificate given as the CA, which signed nothing), with the reason.
    let mut wrong_ca = url.clone();
    let server_cert = Path::new(&ca).with_file_name("server.crt");
    wrong_ca.query_pairs_mut().clear().append_pair("sslmode", "verify-full");
    wrong_ca.query_pairs_mut().append_pair("sslrootcert", server_cert.to_str().unwrap());
    let error = server_refuses(wrong_ca.as_str(), &[]);
    assert!(error.contains("UnknownIssuer"), "{error}");
    // Without TLS, this server refuses the connection, and the error says so.
    let mut plain = url.clone();
    plain.query_pairs_mut().clear().append_pair("sslmode", "disable");
    let error = server_refuses(plain.as_str(), &[]);
    assert!(error.contains("no encryption"), "{error}");
}

#[test]
fn control_planes_sharing_postgres_must_agree_on_their_settings() {
    let Some(db) = database("control_planes_sharing_postgres_must_agree_on_their_settings") else { return };
    let cluster = Cluster::start_ha(&db, 1, 1);
    // GC's safety rests on every control plane refusing commits past the same pending timeout.
    let error = server_refuses(&db, &["--pending-timeout-secs", "300"]);
    assert!(error.contains("must agree") && error.contains("pending timeout of 1800 s"), "{error}");
    let error = server_refuses(&db, &["--gc-grace-secs", "7200"]);
    assert!(error.contains("GC grace of 3600 s"), "{error}");
    // Another cluster key (the targets would refuse its capabilities), or bearer tokens where the
    // first serves everyone (tenants would be open through it).
    let key = common::cluster_key_file(cluster.dir.path());
    let other_key = cluster.dir.path().join("other.key");
    std::fs::write(&other_key, "another cluster's secret").unwrap();
    let error = server_refuses(&db, &["--cluster-key-file", other_key.to_str().unwrap()]);
    assert!(error.contains("must agree") && error.contains("--cluster-key-file"), "{error}");
    assert!(!error.contains("pending timeout"), "only what differs is named: {error}");
    let tokens = cluster.dir.path().join("tokens");
    std::fs::write(&tokens, "").unwrap();
    let error =
        server_refuses(&db, &["--cluster-key-file", key.to_str().unwrap(), "--tokens-file", tokens.to_str().unwrap()]);
    assert!(error.contains("bearer tokens required") && error.contains("no bearer tokens"), "{error}");
    // The same settings: it serves beside the first.
    let second = common::start_server_on(cluster.dir.path(), &db, &[]);
    let status = cli_with_server(&second.address, &["status", "--json"]);
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
}

#[test]
fn a_control_plane_killed_and_restarted_where_it_listened_may_change_its_settings() {
    let Some(db) = database("a_control_plane_killed_and_restarted_where_it_listened_may_change_its_settings") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut first = common::start_server_on(dir.path(), &db, &[]);
    let listen = first.address.clone();
    // Serving (so it has joined: its banner comes first).
    let status = cli_with_server(&listen, &["status", "--json"]);
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    // Killed, it never leaves the database's list of control planes, and looks alive for a
    // minute: one starting elsewhere with other settings is refused meanwhile.
    first.kill();
    let error = server_refuses(&db, &["--pending-timeout-secs", "300"]);
    assert!(error.contains("must agree") && error.contains("pending timeout of 1800 s"), "{error}");
    // Started again where it listened (where no other process can be listening), it is the same
    // control plane: its earlier run is replaced, and it serves with its new settings at once.
    let second = common::start_server_at(dir.path(), &db, &listen, &["--pending-timeout-secs", "300"], &[]);
    let status = cli_with_server(&second.address, &["status", "--json"]);
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    // And now it binds others to those settings.
    let error = server_refuses(&db, &[]);
    assert!(error.contains("pending timeout of 300 s"), "{error}");
}

#[test]
fn a_save_goes_on_through_the_other_control_plane_when_its_own_dies() {
    let Some(db) = database("a_save_goes_on_through_the_other_control_plane_when_its_own_dies") else { return };
    // The first control plane dies after recording the begin, before answering it.
    let begin = [("FAILPOINTS", "control.begin.reply=return(crash)")];
    let mut cluster = Cluster::start_ha_env(&db, 2, 2, &begin);
    let servers = cluster.servers();
    let (one, two) = (cluster.dir.path().join("one"), cluster.dir.path().join("two"));
    make_tree(&one, 1);
    make_tree(&two, 2);
    // The client sends the begin again to the other control plane, which joins the checkpoint
    // the first one began; the part commits there.
    save(&servers, &one, "1");
    cluster.wait_server_exit();
    assert_eq!(committed_in_database(&db), [1]);

    // Back, it dies after a part's transaction commits, before answering: the client sends the
    // part again to the other control plane, which finds it committed already.
    cluster.restart_server_env(&[("FAILPOINTS", "control.commit.reply=return(crash)")]);
    save(&servers, &two, "2");
    cluster.wait_server_exit();
    assert_eq!(committed_in_database(&db), [1, 2]);
    let standby = cluster.peers[0].address.clone();
    let restored = cluster.dir.path().join("restored");
    restore_latest(&standby, &restored);
    assert_eq!(tree(&two), tree(&restored));
}

#[test]
fn control_planes_sharing_postgres_take_over_from_each_other() {
    let Some(db) = database("control_planes_sharing_postgres_take_over_from_each_other") else { return };
    let mut cluster = Cluster::start_ha(&db, 2, 2);
    let servers = cluster.servers();
    let standby = cluster.peers[0].address.clone();
    let (one, two) = (cluster.dir.path().join("one"), cluster.dir.path().join("two"));
    make_tree(&one, 1);
    make_tree(&two, 2);
    // Through the first control plane (the first of the list that answers).
    save(&servers, &one, "1");

    cluster.server.kill();
    // A trainer restarting now still finds and restores its checkpoint: the client skips the
    // dead control plane, and the other serves the same database.
    let restored = cluster.dir.path().join("restored-1");
    restore_latest(&servers, &restored);
    assert_eq!(tree(&one), tree(&restored));

    // The targets move their heartbeats to the control plane that answers.
    let deadline = Instant::now() + Duration::from_secs(20);
    for index in 0..2 {
        let log = cluster.dir.path().join(format!("target-{index}.log"));
        while !std::fs::read_to_string(&log).unwrap().lines().any(|l| l.contains("registered") && l.contains(&standby))
        {
            assert!(Instant::now() < deadline, "target {index} never registered with {standby}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    save(&servers, &two, "2");
    let restored = cluster.dir.path().join("restored-2");
    restore_latest(&standby, &restored);
    assert_eq!(tree(&two), tree(&restored));
    assert_eq!(committed_in_database(&db), [1, 2]);
}
