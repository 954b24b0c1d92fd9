use std::sync::Arc;

use starckpt_proto::JobName;
use starckpt_proto::model::AcquireLease;

use super::*;
use crate::control::store::{CheckpointState, ControlPlaneMember, MetaStore, conformance};

async fn open() -> (tempfile::TempDir, SqlStore) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqlStore::open(&format!("sqlite://{}", dir.path().join("meta.db").display())).await.unwrap();
    (dir, store)
}

/// A store on a fresh PostgreSQL database, where the tests have a server (`crate::testing`).
async fn postgres(test: &str) -> Option<(String, SqlStore)> {
    let url = crate::testing::fresh_postgres_database(test).await.unwrap()?;
    let store = SqlStore::open(&url).await.unwrap();
    assert_eq!(store.dialect(), Dialect::Postgres);
    Some((url, store))
}

/// Each case of the conformance suite, on SQLite and then on PostgreSQL.
macro_rules! on_both {
    ($($case:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $case() {
            conformance::$case(&open().await.1).await;
            if let Some((_, store)) = postgres(stringify!($case)).await {
                conformance::$case(&store).await;
            }
        }
    )*};
}

on_both!(
    targets,
    multi_rank_commit,
    resent_part_of_a_deleted_checkpoint,
    manifest_pages,
    tenant_namespaces,
    overlapping_parts,
    two_writers_of_a_rank,
    step_collisions,
    fencing,
    runs_that_started_earlier_never_take_over,
    stale_pending_is_aborted,
    replication,
    retention_and_tags,
    late_commit_is_refused,
    expired_pending_is_not_joined,
    committed_chunks,
    live_chunks,
    drafts,
    job_files,
    tiering,
    repair_passes,
    control_plane_settings,
    importing,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_at_a_time_on_postgres() {
    let Some((url, first)) = postgres("one_leader_at_a_time_on_postgres").await else { return };
    let second = SqlStore::open(&url).await.unwrap();
    let leader = first.try_lead(Role::Tiering).await.unwrap().expect("nobody leads yet");
    assert!(second.try_lead(Role::Tiering).await.unwrap().is_none(), "two leaders");
    drop(leader);
    // The dropped session ends asynchronously on the server.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while second.try_lead(Role::Tiering).await.unwrap().is_none() {
        assert!(std::time::Instant::now() < deadline, "leadership never passed on");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_last_parts() {
    let (_dir, store) = open().await;
    conformance::concurrent_last_parts(&[Arc::new(store)]).await;
    if let Some((url, first)) = postgres("concurrent_last_parts").await {
        // Three control planes on one database: their writes still serialize.
        let second = SqlStore::open(&url).await.unwrap();
        let third = SqlStore::open(&url).await.unwrap();
        conformance::concurrent_last_parts(&[Arc::new(first), Arc::new(second), Arc::new(third)]).await;
    }
}

/// A commit that waited for the writer lock is judged against the pending timeout as of when it
/// got the lock, not when it asked: GC's grace covers the timeout, not the wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_that_waited_for_the_writer_lock_is_judged_when_it_got_it() {
    let (_dir, store) = open().await;
    let store = Arc::new(store);
    let epoch = conformance::lease(&*store, "waits", "run").await.unwrap().epoch;
    let record = store.begin_checkpoint(&conformance::begin("waits", 1, 1, epoch), 10_000).await.unwrap();
    let held = store.write().await.unwrap();
    let committing = tokio::spawn({
        let store = Arc::clone(&store);
        // In time when asked (begun at 10 000, a 200 ms timeout), but it waits 300 ms for the lock.
        let asked = std::time::Instant::now();
        let clock = move || 10_000 + asked.elapsed().as_millis() as u64;
        async move { store.commit_part(&conformance::part(record.id, 0, "f", 1), &clock, 200).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    held.rollback().await.unwrap();
    let error = committing.await.unwrap().unwrap_err();
    assert!(matches!(&error, MetaError::FailedPrecondition(m) if m.contains("past the pending timeout")), "{error}");
    assert_eq!(store.latest(&JobName::try_from("waits").unwrap()).await.unwrap(), None);
}

/// A rank joining the checkpoint its job's first rank began writes nothing, so it does not queue
/// at the writer lock (held here as a long transaction of another writer would: GC's, another
/// control plane's); a begin that must write does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_joining_a_begun_checkpoint_does_not_wait_for_the_writer_lock() {
    let (_dir, store) = open().await;
    let pg = postgres("a_rank_joining_a_begun_checkpoint").await.map(|(_, store)| store);
    for store in std::iter::once(&store).chain(pg.as_ref()) {
        let epoch = conformance::lease(store, "joins", "run").await.unwrap().epoch;
        let first = store.begin_checkpoint(&conformance::begin("joins", 1, 2, epoch), 10_000).await.unwrap();
        let held = store.write().await.unwrap();
        let join = conformance::begin("joins", 1, 2, epoch);
        let joining = store.begin_checkpoint(&join, 10_001);
        let joined = tokio::time::timeout(Duration::from_secs(10), joining).await.expect("the join queued").unwrap();
        assert_eq!((joined.id, joined.state), (first.id, CheckpointState::Pending));
        // Another world size is an error the writer path gives; another step inserts: both wait.
        for begin in [conformance::begin("joins", 1, 3, epoch), conformance::begin("joins", 2, 2, epoch)] {
            let waiting = tokio::time::timeout(Duration::from_millis(300), store.begin_checkpoint(&begin, 10_002));
            assert!(waiting.await.is_err(), "{:?}: a begin that writes did not wait", store.dialect());
        }
        held.rollback().await.unwrap();
        let error = store.begin_checkpoint(&conformance::begin("joins", 1, 3, epoch), 10_003).await.unwrap_err();
        assert!(matches!(&error, MetaError::FailedPrecondition(m) if m.contains("world size 2")), "{error}");
        // A fenced writer's join is refused, not answered from the snapshot.
        conformance::lease(store, "joins", "next run").await.unwrap();
        let error = store.begin_checkpoint(&conformance::begin("joins", 1, 2, epoch), 10_004).await.unwrap_err();
        assert!(matches!(error, MetaError::Fenced(_)), "{error}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_planes_starting_together_create_one_schema() {
    let Some(url) = crate::testing::fresh_postgres_database("schema race").await.unwrap() else { return };
    // Four control planes open the same empty database at once.
    let opens: Vec<_> = (0..4)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { SqlStore::open(&url).await.map(drop) })
        })
        .collect();
    for open in opens {
        open.await.unwrap().unwrap();
    }
    let store = SqlStore::open(&url).await.unwrap();
    let versions: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM schema_version").fetch_one(&store.reader).await.unwrap();
    assert_eq!(versions, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_manifest_is_an_error() {
    let (_dir, store) = open().await;
    let pg = postgres("corrupt_manifest_is_an_error").await.map(|(_, store)| store);
    for store in std::iter::once(&store).chain(pg.as_ref()) {
        conformance::multi_rank_commit(store).await;
        sqlx::query("UPDATE parts SET manifest = $1")
            .bind(vec![0xFFu8, 0xFF, 0x01])
            .execute(&store.writer)
            .await
            .unwrap();
        let job = JobName::try_from("j").unwrap();
        assert!(matches!(store.get_manifest(&job, None).await, Err(MetaError::Corrupt(_))), "{:?}", store.dialect());
    }
}

/// The database's own errors, classified: a lock held elsewhere, a session the server ended,
/// a serialization failure are worth sending again; a broken constraint is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_database_errors_are_told_apart() {
    use sqlx::{Connection, Executor};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("busy.db");
    let options = SqliteConnectOptions::new().filename(&path).create_if_missing(true).busy_timeout(Duration::ZERO);
    let mut holder = sqlx::SqliteConnection::connect_with(&options).await.unwrap();
    holder.execute("CREATE TABLE t (k INTEGER PRIMARY KEY); INSERT INTO t VALUES (1);").await.unwrap();
    holder.execute("BEGIN EXCLUSIVE").await.unwrap();
    let mut other = sqlx::SqliteConnection::connect_with(&options).await.unwrap();
    let busy = other.execute("INSERT INTO t VALUES (2)").await.unwrap_err();
    assert!(MetaError::Backend(busy).is_transient(), "SQLITE_BUSY");
    holder.execute("COMMIT").await.unwrap();
    let duplicate = other.execute("INSERT INTO t VALUES (1)").await.unwrap_err();
    assert!(!MetaError::Backend(duplicate).is_transient(), "a unique violation");
    assert!(!MetaError::NotFound("x".into()).is_transient());

    let Some(url) = crate::testing::fresh_postgres_database("transient errors").await.unwrap() else { return };
    let mut session = sqlx::PgConnection::connect(&url).await.unwrap();
    let ended = session.execute("SELECT pg_terminate_backend(pg_backend_pid())").await.unwrap_err();
    assert!(MetaError::Backend(ended).is_transient(), "a session the server ended");
    let mut session = sqlx::PgConnection::connect(&url).await.unwrap();
    let failed = session
        .execute("DO $$ BEGIN RAISE EXCEPTION 'conflict' USING ERRCODE = 'serialization_failure'; END $$")
        .await
        .unwrap_err();
    assert!(MetaError::Backend(failed).is_transient(), "a serialization failure");
    let wrong = session.execute("SELECT 1/0").await.unwrap_err();
    assert!(!MetaError::Backend(wrong).is_transient(), "division by zero");
}

/// A database of an older schema version with one target, as that version wrote it.
async fn old_database(path: &std::path::Path, version: i64) {
    let options = SqliteConnectOptions::new().filename(path).create_if_missing(true);
    let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect_with(options).await.unwrap();
    let (mut domain_column, mut domain_value) =
        if version >= 2 { (", failure_domain TEXT NOT NULL DEFAULT ''", ", 'rack'") } else { ("", "") };
    // Version 3 added the RDMA device; its control_planes table had no security column.
    let mut control_planes = "";
    if version >= 3 {
        (domain_column, domain_value) =
            (", failure_domain TEXT NOT NULL DEFAULT '', rdma_device TEXT NOT NULL DEFAULT ''", ", 'rack', ''");
        control_planes = "CREATE TABLE control_planes (id TEXT PRIMARY KEY, pending_timeout_ms BIGINT NOT NULL,
             gc_grace_ms BIGINT NOT NULL, seen_at_ms BIGINT NOT NULL);
             INSERT INTO control_planes VALUES ('old/1', 1, 2, 3);";
    }
    // Version 4 recorded control planes' security, not their tier.
    if version >= 4 {
        control_planes = "CREATE TABLE control_planes (id TEXT PRIMARY KEY, pending_timeout_ms BIGINT NOT NULL,
             gc_grace_ms BIGINT NOT NULL, seen_at_ms BIGINT NOT NULL, security TEXT NOT NULL DEFAULT '');
             INSERT INTO control_planes VALUES ('old/1', 1, 2, 3, 'no cluster key, bearer tokens required');";
    }
    // Version 6 recorded when a run started; before, leases were only (job, run, epoch, time).
    let leases = "CREATE TABLE leases (job TEXT NOT NULL, run_id TEXT NOT NULL, epoch BIGINT NOT NULL,
         acquired_at_ms BIGINT NOT NULL, PRIMARY KEY (job, run_id), UNIQUE (job, epoch));
         INSERT INTO leases VALUES ('old', 'run-old', 1, 5);";
    sqlx::raw_sql(&format!(
        "{leases}
         CREATE TABLE schema_version (version INTEGER NOT NULL);
         INSERT INTO schema_version (version) VALUES ({version});
         CREATE TABLE targets (target_id TEXT PRIMARY KEY, data_address TEXT NOT NULL,
             capacity_bytes BIGINT NOT NULL, used_bytes BIGINT NOT NULL, chunk_count BIGINT NOT NULL DEFAULT 0,
             registered_at_ms BIGINT NOT NULL, last_heartbeat_ms BIGINT NOT NULL{domain_column});
         INSERT INTO targets VALUES ('old', '127.0.0.1:9000', 100, 1, 0, 5, 5{domain_value});
         {control_planes}"
    ))
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;
}

#[tokio::test]
async fn older_databases_are_migrated_and_keep_their_targets() {
    for (version, domain) in [(1, ""), (2, "rack"), (3, "rack"), (4, "rack"), (5, "rack")] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.db");
        old_database(&path, version).await;
        let store = SqlStore::open(path.to_str().unwrap()).await.unwrap();
        let targets = store.list_targets().await.unwrap();
        let target =
            (targets[0].target_id.as_str(), targets[0].failure_domain.as_str(), targets[0].rdma_device.as_str());
        assert_eq!(target, ("old", domain, ""), "from version {version}");
        // Control planes record their security (schema version 4) and tier (5).
        let member = ControlPlaneMember {
            id: "new/1".into(),
            listener: "new".into(),
            pending_timeout_ms: 1,
            gc_grace_ms: 2,
            security: ControlPlaneMember::security_of(None, true, false),
            tier: ControlPlaneMember::tier_of(Some("file:///t")),
        };
        assert_eq!(store.join_control_planes(&member, 10, 0, true).await.unwrap(), None, "from version {version}");
        // The old run keeps its lease; a run that says when it started (version 6) takes over.
        let lease = |run_id: &str, started_at_ms| AcquireLease {
            job: JobName::try_from("old").unwrap(),
            run_id: run_id.into(),
            started_at_ms,
        };
        assert_eq!(store.acquire_lease(&lease("run-old", 0), 11).await.unwrap().epoch, 1, "from version {version}");
        assert_eq!(store.acquire_lease(&lease("run-new", 9), 12).await.unwrap().epoch, 2, "from version {version}");
        assert!(matches!(store.acquire_lease(&lease("run-older", 8), 13).await, Err(MetaError::Fenced(_))));
        drop(store);
        // Opening again finds the current version and changes nothing.
        let store = SqlStore::open(path.to_str().unwrap()).await.unwrap();
        assert_eq!(store.list_targets().await.unwrap().len(), 1);
    }
}

#[tokio::test]
async fn survives_reopen_and_refuses_memory() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("meta.db");
    {
        let store = SqlStore::open(path.to_str().unwrap()).await.unwrap();
        conformance::multi_rank_commit(&store).await;
    }
    let store = SqlStore::open(path.to_str().unwrap()).await.unwrap();
    let job = JobName::try_from("j").unwrap();
    assert_eq!(store.latest(&job).await.unwrap().unwrap().step, 100);
    assert!(SqlStore::open("sqlite::memory:").await.is_err());
}

/// A second claim on an SQLite file in use is refused, with the reason, whichever way the
/// file is named; the file is free again once the first lets go. PostgreSQL takes none.
#[test]
fn one_control_plane_per_sqlite_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("meta.db");
    let first = DatabaseLock::take(path.to_str().unwrap()).unwrap();
    assert!(first.is_some());
    let Err(refused) = DatabaseLock::take(&format!("sqlite://{}", path.display())) else {
        panic!("two control planes claimed one SQLite file");
    };
    assert!(
        matches!(&refused, MetaError::FailedPrecondition(m) if m.contains("in use by another control plane")),
        "{refused}"
    );
    drop(first);
    assert!(DatabaseLock::take(path.to_str().unwrap()).unwrap().is_some());
    assert!(DatabaseLock::take("postgres://localhost/x").unwrap().is_none());
    assert!(DatabaseLock::take("sqlite::memory:").is_err());
}
