//! The metadata store over SQL: one SQLite file (the embedded default) or a PostgreSQL server
//! (for HA), through sqlx's `Any` driver, so both run the same queries.
//!
//! The queries stick to SQL both accept (`$N` parameters, `string_agg`, `RETURNING`, `ON CONFLICT`,
//! explicit casts where PostgreSQL's types differ); the one schema (`schema.sql`) differs only in
//! the checkpoint id column and the manifest's byte type ([`Dialect::schema`]).
//!
//! **Writes are serialized.** Every write runs in a transaction that holds the database's one
//! writer lock ([`SqlStore::write`]): on SQLite, a pool of exactly one writer connection (SQLite
//! allows one writer at a time anyway, and a single writer connection means transactions never
//! race to upgrade a read lock into a write lock, which fails with SQLITE_BUSY instead of
//! waiting); on PostgreSQL, a transaction-scoped advisory lock as well, so any number of control
//! planes may share one database and still see the state machine of `store.rs` step by step. The
//! control plane writes a few rows per rank per checkpoint, so one writer at a time is no limit.
//!
//! **Reads** that span statements run in one snapshot ([`SqlStore::read`]): SQLite's WAL read
//! transactions, PostgreSQL's REPEATABLE READ. Single-statement reads use the reader pool directly.
//!
//! **Durability.** SQLite: WAL journal with `synchronous = FULL`, so a committed transaction
//! survives power loss. PostgreSQL: what the server is configured for (`synchronous_commit`,
//! synchronous standbys); the control plane tells a writer "committed" only after the commit
//! returns.

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use futures::TryStreamExt;
use prost::Message;
use sqlx::any::{AnyConnectOptions, AnyPoolOptions, AnyRow};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};
use sqlx::{Any, AnyPool, ConnectOptions, Connection, Row, Transaction};
use starckpt_proto::control as pb;
use starckpt_proto::model::{AcquireLease, BeginCheckpoint, CommitPart, Manifest, TargetRegistration, check_disjoint};
use starckpt_proto::{Addressing, ChunkHash, JobName};

use super::store::{
    CheckpointRecord, CheckpointState, CommittedChunk, ControlPlaneMember, ImportedCheckpoint, JobRecord, Leadership,
    LeaseGrant, ManifestOf, ManifestPage, MetaError, MetaResult, MetaStore, RetentionPolicy, Role, TargetIds,
    TargetRecord, TierSweeps, fault,
};

const SCHEMA: &str = include_str!("schema.sql");
/// 2: targets.failure_domain, the replication table. 3: targets.rdma_device. 5:
/// control_planes.tier. Older databases are migrated on open (PostgreSQL support began at 3).
const SCHEMA_VERSION: i64 = 5;
const CHECKPOINT_COLUMNS: &str = "id, job, step, state, world_size, epoch, parts_committed, total_bytes, \
     written_bytes, file_count, created_at_ms, committed_at_ms, \
     (SELECT string_agg(tag, ',') FROM tags WHERE tags.checkpoint_id = checkpoints.id) AS tags, \
     (SELECT tiered_at_ms FROM tiered WHERE tiered.checkpoint_id = checkpoints.id) AS tiered_at_ms";
/// The PostgreSQL advisory lock every write transaction holds ("starckpt" in ASCII).
const WRITER_LOCK: i64 = 0x7374_6172_636b_7074;
/// The PostgreSQL advisory lock (session-level) of each [`Role`]: "starckpt" + 1, ...
fn role_lock(role: Role) -> i64 {
    WRITER_LOCK
        + match role {
            Role::Tiering => 1,
            Role::Repair => 2,
            Role::Gc => 3,
        }
}
/// How long a write waits for the writer lock before it fails instead of hanging the RPC: 10 s,
/// SQLite's busy timeout and PostgreSQL's lock_timeout, set on every connection.
const LOCK_WAIT: Duration = Duration::from_secs(10);
const SQLITE_SESSION: &str = "PRAGMA busy_timeout = 10000; PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON;";
/// PostgreSQL sessions also end a transaction left idle by a control plane that stopped
/// answering (it would hold the writer lock), and probe idle connections, so a host that vanished
/// without closing its sockets (power loss, a partition) is noticed in about a minute rather than
/// the kernel's two hours: its locks go with its sessions.
const POSTGRES_SESSION: &str = "SET lock_timeout = '10s'; SET idle_in_transaction_session_timeout = '60s'; \
     SET tcp_keepalives_idle = 30; SET tcp_keepalives_interval = 10; SET tcp_keepalives_count = 3";
/// Connections of the reader pool. With the one writer connection, a control plane holds at most
/// this many plus one connections to its database.
const READERS: u32 = 4;

/// Which SQL database a [`SqlStore`] talks to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    Sqlite,
    Postgres,
}

impl Dialect {
    /// `postgres://` and `postgresql://` URLs name PostgreSQL; `sqlite:` URLs and paths SQLite;
    /// any other URL (a typo such as `postgress://`) is refused rather than taken for a path.
    pub fn of(url: &str) -> MetaResult<Dialect> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Ok(Dialect::Postgres)
        } else if url.starts_with("sqlite:") || !url.contains("://") {
            Ok(Dialect::Sqlite)
        } else {
            Err(MetaError::InvalidArgument(
                "not a database URL this build knows: use postgres://..., sqlite://PATH or a file path".into(),
            ))
        }
    }

    /// `schema.sql` with this database's column types filled in.
    fn schema(self) -> String {
        let (id, bytes) = match self {
            Dialect::Sqlite => ("INTEGER PRIMARY KEY", "BLOB"),
            Dialect::Postgres => ("BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY", "BYTEA"),
        };
        SCHEMA.replace("{ID}", id).replace("{BYTES}", bytes)
    }
}

pub struct SqlStore {
    dialect: Dialect,
    writer: AnyPool,
    reader: AnyPool,
}

/// A control plane's claim on its SQLite database ([`DatabaseLock::take`]), held while it runs.
pub struct DatabaseLock {
    _file: std::fs::File,
}

impl DatabaseLock {
    /// For an SQLite `url` (a path or `sqlite://` URL), locks `<database>.lock` for this holder
    /// alone; for PostgreSQL, None: several control planes share one, checking each other's
    /// settings as they join. SQLite serves one control plane: two on one file would each lead
    /// garbage collection and tiering (leadership there is the process), with settings nothing
    /// compares. A second is refused while the first runs; the lock goes with its process,
    /// however it ends.
    pub fn take(url: &str) -> MetaResult<Option<DatabaseLock>> {
        match Dialect::of(url)? {
            Dialect::Postgres => Ok(None),
            Dialect::Sqlite => sqlite_options(url).and_then(|(_, path)| owner_lock(&path)).map(Some),
        }
    }
}

/// The connection options of an SQLite `url`, and its database file's absolute path.
fn sqlite_options(url: &str) -> MetaResult<(SqliteConnectOptions, std::path::PathBuf)> {
    if url.contains(":memory:") || url.contains("mode=memory") {
        return Err(MetaError::InvalidArgument("an in-memory database would lose every checkpoint on restart".into()));
    }
    let options = if url.starts_with("sqlite:") {
        SqliteConnectOptions::from_str(url)?
    } else {
        SqliteConnectOptions::new().filename(url)
    };
    // Absolute and without `..`: the pools reopen the file through a `sqlite://` URL, which would
    // read a relative path's first component as a host and fold `..`.
    let path = std::path::absolute(options.get_filename())
        .map_err(|e| MetaError::InvalidArgument(format!("database path {}: {e}", options.get_filename().display())))?;
    // sqlx decodes '%' escapes in the URL's path but does not encode '%'.
    let plain = path.to_str().is_some_and(|p| !p.contains('%'));
    if path.components().any(|c| c == std::path::Component::ParentDir) || !plain {
        return Err(MetaError::InvalidArgument(format!(
            "database path {}: give it without '..' or '%', in UTF-8",
            path.display()
        )));
    }
    Ok((options, path))
}

fn owner_lock(database: &std::path::Path) -> MetaResult<DatabaseLock> {
    let mut name = database.as_os_str().to_owned();
    name.push(".lock");
    let path = std::path::PathBuf::from(name);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| MetaError::InvalidArgument(format!("database lock file {}: {e}", path.display())))?;
    match file.try_lock() {
        Ok(()) => Ok(DatabaseLock { _file: file }),
        Err(std::fs::TryLockError::WouldBlock) => Err(MetaError::FailedPrecondition(format!(
            "database {} is in use by another control plane (it holds {}); an SQLite database serves \
             one control plane at a time: for several, use PostgreSQL",
            database.display(),
            path.display()
        ))),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(MetaError::InvalidArgument(format!("database lock file {}: {e}", path.display())))
        }
    }
}

impl SqlStore {
    /// Opens the database at `url`, creating the schema if missing: `postgres://…` or
    /// `postgresql://…` for PostgreSQL, else `sqlite://PATH` or a plain file path (created if
    /// missing). In-memory SQLite databases are refused: the control plane must be durable.
    pub async fn open(url: &str) -> MetaResult<SqlStore> {
        sqlx::any::install_default_drivers();
        let dialect = Dialect::of(url)?;
        let options = match dialect {
            Dialect::Postgres => {
                let options = AnyConnectOptions::from_str(url)?;
                // One plain connection first: a pool reports an unreachable server only as "pool
                // timed out"; this says why (refused, unknown role, no such database, ...).
                options.connect().await?.close().await?;
                options
            }
            Dialect::Sqlite => {
                let (options, path) = sqlite_options(url)?;
                let options = options.filename(path);
                let options = options.create_if_missing(true);
                // Create the file and switch it to WAL (a property of the file) before the pools
                // open it through the Any driver, whose URL form carries neither setting.
                let setup =
                    options.clone().journal_mode(SqliteJournalMode::Wal).busy_timeout(LOCK_WAIT).connect().await?;
                setup.close().await?;
                AnyConnectOptions::from_url(&options.to_url_lossy())?
            }
        };
        let session = match dialect {
            Dialect::Sqlite => SQLITE_SESSION,
            Dialect::Postgres => POSTGRES_SESSION,
        };
        let pool = |connections: u32| {
            AnyPoolOptions::new().max_connections(connections).acquire_timeout(LOCK_WAIT).after_connect(
                move |conn, _| Box::pin(async move { sqlx::Executor::execute(conn, session).await.map(drop) }),
            )
        };
        let writer = pool(1).connect_with(options.clone()).await?;
        let reader = pool(READERS).connect_with(options).await?;
        let store = SqlStore { dialect, writer, reader };
        store.migrate().await?;
        Ok(store)
    }

    /// Which database this store talks to.
    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    /// Begins a write transaction holding the writer lock (module docs).
    async fn write(&self) -> MetaResult<Transaction<'static, Any>> {
        let mut tx = self.writer.begin().await?;
        if self.dialect == Dialect::Postgres {
            sqlx::query("SELECT 1 FROM pg_advisory_xact_lock($1)").bind(WRITER_LOCK).execute(&mut *tx).await?;
        }
        Ok(tx)
    }

    /// Begins a read transaction: every statement in it sees one snapshot.
    async fn read(&self) -> MetaResult<Transaction<'static, Any>> {
        let mut tx = self.reader.begin().await?;
        if self.dialect == Dialect::Postgres {
            sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY").execute(&mut *tx).await?;
        }
        Ok(tx)
    }

    /// Creates the schema, or brings an older one up to [`SCHEMA_VERSION`]; under the writer
    /// lock, so control planes starting together against one PostgreSQL do not race.
    async fn migrate(&self) -> MetaResult<()> {
        let mut tx = self.write().await?;
        sqlx::Executor::execute(&mut *tx, sqlx::raw_sql(&self.dialect.schema())).await?;
        let version: Option<i64> =
            sqlx::query_scalar("SELECT version FROM schema_version").fetch_optional(&mut *tx).await?;
        match version {
            None => {
                sqlx::query("INSERT INTO schema_version (version) VALUES ($1)")
                    .bind(SCHEMA_VERSION)
                    .execute(&mut *tx)
                    .await?;
            }
            Some(SCHEMA_VERSION) => {}
            Some(old @ (1..=4)) => {
                if old < 2 {
                    sqlx::query("ALTER TABLE targets ADD COLUMN failure_domain TEXT NOT NULL DEFAULT ''")
                        .execute(&mut *tx)
                        .await?;
                }
                if old < 3 {
                    sqlx::query("ALTER TABLE targets ADD COLUMN rdma_device TEXT NOT NULL DEFAULT ''")
                        .execute(&mut *tx)
                        .await?;
                }
                // Its rows are refreshed every few seconds by the control planes they name: made
                // again with the current columns (version 3 databases may or may not have it; 5
                // added one).
                sqlx::query("DROP TABLE IF EXISTS control_planes").execute(&mut *tx).await?;
                sqlx::Executor::execute(&mut *tx, sqlx::raw_sql(&self.dialect.schema())).await?;
                sqlx::query("UPDATE schema_version SET version = $1").bind(SCHEMA_VERSION).execute(&mut *tx).await?;
            }
            Some(other) => {
                return Err(MetaError::Corrupt(format!(
                    "database schema version {other}; this build understands {SCHEMA_VERSION}"
                )));
            }
        }
        tx.commit().await?;
        Ok(())
    }
}

fn to_i64(value: u64, what: &str) -> MetaResult<i64> {
    i64::try_from(value).map_err(|_| MetaError::InvalidArgument(format!("{what} {value} is out of range")))
}

fn get_u64(row: &AnyRow, column: &str) -> MetaResult<u64> {
    let value: i64 = row.try_get(column)?;
    u64::try_from(value).map_err(|_| MetaError::Corrupt(format!("negative {column}")))
}

fn checkpoint_from_row(row: &AnyRow) -> MetaResult<CheckpointRecord> {
    let committed_at: Option<i64> = row.try_get("committed_at_ms")?;
    let tiered_at: Option<i64> = row.try_get("tiered_at_ms")?;
    let tags: Option<String> = row.try_get("tags")?;
    // Tags never contain ',' (validate_tag).
    let mut tags: Vec<String> = tags.iter().flat_map(|t| t.split(',')).map(str::to_owned).collect();
    tags.sort();
    Ok(CheckpointRecord {
        id: get_u64(row, "id")?,
        job: row.try_get("job")?,
        step: get_u64(row, "step")?,
        state: CheckpointState::parse(row.try_get("state")?)?,
        world_size: get_u64(row, "world_size")? as u32,
        epoch: get_u64(row, "epoch")?,
        parts_committed: get_u64(row, "parts_committed")? as u32,
        total_bytes: get_u64(row, "total_bytes")?,
        written_bytes: get_u64(row, "written_bytes")?,
        file_count: get_u64(row, "file_count")?,
        created_at_ms: get_u64(row, "created_at_ms")?,
        committed_at_ms: committed_at.map(|v| v.max(0) as u64),
        tags,
        tiered_at_ms: tiered_at.map(|v| v.max(0) as u64),
    })
}

fn decode_manifest(blob: &[u8], checkpoint_id: u64, rank: u32) -> MetaResult<Manifest> {
    let message = pb::Manifest::decode(blob)
        .map_err(|e| MetaError::Corrupt(format!("manifest of checkpoint {checkpoint_id} rank {rank}: {e}")))?;
    Manifest::try_from(message)
        .map_err(|e| MetaError::Corrupt(format!("manifest of checkpoint {checkpoint_id} rank {rank}: {e}")))
}

/// The job's current lease epoch and run id, if any run ever took it.
async fn current_lease(tx: &mut Transaction<'_, Any>, job: &str) -> MetaResult<Option<(u64, String)>> {
    let row = sqlx::query("SELECT epoch, run_id FROM leases WHERE job = $1 ORDER BY epoch DESC LIMIT 1")
        .bind(job)
        .fetch_optional(&mut **tx)
        .await?;
    row.map(|row| Ok((get_u64(&row, "epoch")?, row.try_get("run_id")?))).transpose()
}

/// Checks that `epoch` is the job's current one: Fenced if a newer run took over, InvalidArgument
/// if it was never issued.
async fn check_epoch(tx: &mut Transaction<'_, Any>, job: &str, epoch: u64) -> MetaResult<()> {
    match current_lease(tx, job).await? {
        Some((current, _)) if current == epoch => Ok(()),
        Some((current, run_id)) if current > epoch => Err(MetaError::Fenced(format!(
            "job {job}: epoch {epoch} was superseded by run {run_id:?} at epoch {current}; this writer belongs to a \
             preempted run and may no longer write"
        ))),
        _ => Err(MetaError::InvalidArgument(format!(
            "job {job}: epoch {epoch} was never issued (take a lease with AcquireLease first)"
        ))),
    }
}

async fn retention_policy(tx: &mut Transaction<'_, Any>, job: &str) -> MetaResult<RetentionPolicy> {
    let row = sqlx::query("SELECT keep_last, keep_every FROM retention WHERE job = $1")
        .bind(job)
        .fetch_optional(&mut **tx)
        .await?;
    let Some(row) = row else { return Ok(RetentionPolicy::default()) };
    let keep_last = u32::try_from(get_u64(&row, "keep_last")?)
        .map_err(|_| MetaError::Corrupt(format!("job {job}: keep_last out of range")))?;
    Ok(RetentionPolicy { keep_last, keep_every: get_u64(&row, "keep_every")? })
}

/// Marks the job's committed checkpoints its retention policy does not keep as deleted; returns
/// their steps. `spare` (the checkpoint committing in this transaction) is never deleted by it: a
/// writer is never told "committed" about a checkpoint that is already gone (it goes at the next
/// commit if the policy still drops it, e.g. a lower step than the kept ones).
async fn apply_retention(
    tx: &mut Transaction<'_, Any>,
    job: &str,
    now_ms: u64,
    spare: Option<u64>,
) -> MetaResult<Vec<u64>> {
    let policy = retention_policy(tx, job).await?;
    if policy.keeps_everything() {
        return Ok(Vec::new());
    }
    let rows = sqlx::query(
        "SELECT id, step, CASE WHEN EXISTS (SELECT 1 FROM tags WHERE tags.checkpoint_id = checkpoints.id) THEN 1 ELSE 0 END AS tagged
         FROM checkpoints WHERE job = $1 AND state = 'committed' ORDER BY step DESC",
    )
    .bind(job)
    .fetch_all(&mut **tx)
    .await?;
    let mut deleted = Vec::new();
    for (rank, row) in rows.iter().enumerate() {
        let step = get_u64(row, "step")?;
        let tagged: i64 = row.try_get("tagged")?;
        if policy.keeps(rank, step, tagged != 0) || spare == Some(get_u64(row, "id")?) {
            continue;
        }
        sqlx::query("UPDATE checkpoints SET state = 'deleted', ended_at_ms = $1 WHERE id = $2")
            .bind(to_i64(now_ms, "time")?)
            .bind(row.try_get::<i64, _>("id")?)
            .execute(&mut **tx)
            .await?;
        deleted.push(step);
    }
    if !deleted.is_empty() {
        tracing::info!(%job, ?deleted, ?policy, "retention deleted checkpoints");
    }
    Ok(deleted)
}

async fn tier_sweeps(tx: &mut Transaction<'_, Any>) -> MetaResult<TierSweeps> {
    let row = sqlx::query("SELECT started, finished FROM tier_sweeps WHERE id = 1").fetch_optional(&mut **tx).await?;
    let Some(row) = row else { return Ok(TierSweeps::default()) };
    Ok(TierSweeps { started: get_u64(&row, "started")?, finished: get_u64(&row, "finished")? })
}

/// Inserts rank `rank`'s part (`blob`: `manifest`, encoded) of checkpoint `id`; its bytes and
/// file count, for the checkpoint's totals.
async fn insert_part(
    tx: &mut Transaction<'_, Any>,
    id: i64,
    rank: u32,
    blob: Vec<u8>,
    manifest: &Manifest,
    written_bytes: u64,
    now_ms: u64,
) -> MetaResult<(i64, i64)> {
    let total_bytes = to_i64(manifest.total_bytes(), "bytes")?;
    let file_count = manifest.files.len() as i64;
    sqlx::query(
        "INSERT INTO parts (checkpoint_id, rank, manifest, total_bytes, written_bytes, file_count, committed_at_ms)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(id)
    .bind(rank as i64)
    .bind(blob)
    .bind(total_bytes)
    .bind(to_i64(written_bytes, "written bytes")?)
    .bind(file_count)
    .bind(to_i64(now_ms, "time")?)
    .execute(&mut **tx)
    .await?;
    Ok((total_bytes, file_count))
}

/// Marks pending checkpoint `id` aborted and commits `tx`.
async fn abort_in(mut tx: Transaction<'_, Any>, id: i64, now_ms: u64) -> MetaResult<()> {
    sqlx::query("UPDATE checkpoints SET state = 'aborted', ended_at_ms = $1 WHERE id = $2")
        .bind(to_i64(now_ms, "time")?)
        .bind(id)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

/// The committed parts of checkpoint `id` (rank and manifest), by rank.
async fn part_manifests(tx: &mut Transaction<'_, Any>, id: u64) -> MetaResult<Vec<(u32, Manifest)>> {
    Ok(part_manifests_from(tx, id, 0, usize::MAX).await?.0)
}

/// The parts of checkpoint `id` from `from_rank` on, in rank order, while their stored manifests
/// add up to at most `max_bytes` (at least one part), and the rank of the first one left out.
async fn part_manifests_from(
    tx: &mut Transaction<'_, Any>,
    id: u64,
    from_rank: u32,
    max_bytes: usize,
) -> MetaResult<(Vec<(u32, Manifest)>, Option<u32>)> {
    let mut rows =
        sqlx::query("SELECT rank, manifest FROM parts WHERE checkpoint_id = $1 AND rank >= $2 ORDER BY rank")
            .bind(to_i64(id, "checkpoint id")?)
            .bind(i64::from(from_rank))
            .fetch(&mut **tx);
    let (mut parts, mut bytes) = (Vec::new(), 0usize);
    while let Some(row) = rows.try_next().await? {
        let rank = u32::try_from(get_u64(&row, "rank")?)
            .map_err(|_| MetaError::Corrupt(format!("checkpoint {id} has a part of rank above 2^32")))?;
        let blob: Vec<u8> = row.try_get("manifest")?;
        if !parts.is_empty() && bytes.saturating_add(blob.len()) > max_bytes {
            return Ok((parts, Some(rank)));
        }
        bytes = bytes.saturating_add(blob.len());
        parts.push((rank, decode_manifest(&blob, id, rank)?));
    }
    Ok((parts, None))
}

async fn checkpoint_by_id(tx: &mut Transaction<'_, Any>, id: i64) -> MetaResult<Option<CheckpointRecord>> {
    let row = sqlx::query(&format!("SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE id = $1"))
        .bind(id)
        .fetch_optional(&mut **tx)
        .await?;
    row.as_ref().map(checkpoint_from_row).transpose()
}

#[async_trait]
impl MetaStore for SqlStore {
    async fn upsert_target(&self, registration: &TargetRegistration, now_ms: u64) -> MetaResult<()> {
        let mut tx = self.write().await?;
        sqlx::query(
            "INSERT INTO targets (target_id, data_address, capacity_bytes, used_bytes, registered_at_ms, last_heartbeat_ms,
                 failure_domain, rdma_device)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
             ON CONFLICT (target_id) DO UPDATE SET data_address = excluded.data_address,
                 capacity_bytes = excluded.capacity_bytes, used_bytes = excluded.used_bytes,
                 registered_at_ms = excluded.registered_at_ms, last_heartbeat_ms = excluded.last_heartbeat_ms,
                 failure_domain = excluded.failure_domain, rdma_device = excluded.rdma_device",
        )
        .bind(&registration.target_id)
        .bind(registration.data_address.to_string())
        .bind(to_i64(registration.capacity_bytes, "capacity")?)
        .bind(to_i64(registration.used_bytes, "used bytes")?)
        .bind(to_i64(now_ms, "time")?)
        .bind(to_i64(now_ms, "time")?)
        .bind(&registration.failure_domain)
        .bind(&registration.rdma_device)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn heartbeat(&self, target_id: &str, capacity: u64, used: u64, chunks: u64, now_ms: u64) -> MetaResult<()> {
        let mut tx = self.write().await?;
        let result = sqlx::query(
            "UPDATE targets SET capacity_bytes = $1, used_bytes = $2, chunk_count = $3, last_heartbeat_ms = $4 WHERE target_id = $5",
        )
        .bind(to_i64(capacity, "capacity")?)
        .bind(to_i64(used, "used bytes")?)
        .bind(to_i64(chunks, "chunk count")?)
        .bind(to_i64(now_ms, "time")?)
        .bind(target_id)
        .execute(&mut *tx)
        .await?;
        if result.rows_affected() == 0 {
            return Err(MetaError::NotFound(format!("target {target_id} is not registered")));
        }
        tx.commit().await?;
        Ok(())
    }

    async fn list_targets(&self) -> MetaResult<Vec<TargetRecord>> {
        let rows = sqlx::query(
            "SELECT target_id, data_address, capacity_bytes, used_bytes, chunk_count, last_heartbeat_ms, failure_domain,
                 rdma_device
             FROM targets ORDER BY target_id",
        )
        .fetch_all(&self.reader)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(TargetRecord {
                    target_id: row.try_get("target_id")?,
                    data_address: row.try_get("data_address")?,
                    capacity_bytes: get_u64(row, "capacity_bytes")?,
                    used_bytes: get_u64(row, "used_bytes")?,
                    chunk_count: get_u64(row, "chunk_count")?,
                    last_heartbeat_ms: get_u64(row, "last_heartbeat_ms")?,
                    failure_domain: row.try_get("failure_domain")?,
                    rdma_device: row.try_get("rdma_device")?,
                })
            })
            .collect()
    }

    async fn acquire_lease(&self, request: &AcquireLease, now_ms: u64) -> MetaResult<LeaseGrant> {
        let job = request.job.as_str();
        let mut tx = self.write().await?;
        let known: Option<i64> = sqlx::query_scalar("SELECT epoch FROM leases WHERE job = $1 AND run_id = $2")
            .bind(job)
            .bind(&request.run_id)
            .fetch_optional(&mut *tx)
            .await?;
        let current = current_lease(&mut tx, job).await?;
        if let Some(epoch) = known {
            let epoch = epoch.max(0) as u64;
            return match current {
                Some((current, _)) if current == epoch => Ok(LeaseGrant { epoch, aborted_checkpoints: 0 }),
                Some((current, run_id)) => Err(MetaError::Fenced(format!(
                    "job {job}: run {:?} (epoch {epoch}) was superseded by run {run_id:?} (epoch {current})",
                    request.run_id
                ))),
                None => Err(MetaError::Corrupt(format!("job {job} has a lease row but no current lease"))),
            };
        }
        let epoch = current.map_or(1, |(current, _)| current + 1);
        let now = to_i64(now_ms, "time")?;
        sqlx::query("INSERT INTO leases (job, run_id, epoch, acquired_at_ms) VALUES ($1, $2, $3, $4)")
            .bind(job)
            .bind(&request.run_id)
            .bind(to_i64(epoch, "epoch")?)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        // The takeover and the abort of the older runs' half-written checkpoints are one transaction.
        let aborted = sqlx::query(
            "UPDATE checkpoints SET state = 'aborted', ended_at_ms = $1 WHERE job = $2 AND state = 'pending' AND epoch < $3",
        )
        .bind(now)
        .bind(job)
        .bind(to_i64(epoch, "epoch")?)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        tracing::info!(%job, run_id = %request.run_id, epoch, aborted, "writer lease taken");
        Ok(LeaseGrant { epoch, aborted_checkpoints: aborted as u32 })
    }

    async fn begin_checkpoint(&self, request: &BeginCheckpoint, now_ms: u64) -> MetaResult<CheckpointRecord> {
        let step = to_i64(request.step, "step")?;
        let now = to_i64(now_ms, "time")?;
        let mut tx = self.write().await?;
        check_epoch(&mut tx, request.job.as_str(), request.epoch).await?;
        let live = sqlx::query(&format!(
            "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE job = $1 AND step = $2 AND state IN ('pending', 'committed')"
        ))
        .bind(request.job.as_str())
        .bind(step)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(row) = live {
            let existing = checkpoint_from_row(&row)?;
            match existing.state {
                CheckpointState::Committed => {
                    return Err(MetaError::AlreadyExists(format!(
                        "job {} already has a committed checkpoint at step {}; delete it first to save that step again",
                        request.job, request.step
                    )));
                }
                _ if existing.epoch == request.epoch => {
                    if existing.world_size != request.world_size {
                        return Err(MetaError::FailedPrecondition(format!(
                            "{} step {} was begun with world size {}, not {}",
                            request.job, request.step, existing.world_size, request.world_size
                        )));
                    }
                    return Ok(existing);
                }
                _ => {
                    // Older epochs' pending checkpoints are aborted when a new run takes the lease;
                    // one left over (from a database written before that rule) is aborted here.
                    sqlx::query("UPDATE checkpoints SET state = 'aborted', ended_at_ms = $1 WHERE id = $2")
                        .bind(now)
                        .bind(existing.id as i64)
                        .execute(&mut *tx)
                        .await?;
                }
            }
        }
        let row = sqlx::query(&format!(
            "INSERT INTO checkpoints (job, step, state, world_size, epoch, created_at_ms)
             VALUES ($1, $2, 'pending', $3, $4, $5) RETURNING {CHECKPOINT_COLUMNS}"
        ))
        .bind(request.job.as_str())
        .bind(step)
        .bind(request.world_size as i64)
        .bind(to_i64(request.epoch, "epoch")?)
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        let record = checkpoint_from_row(&row)?;
        tx.commit().await?;
        Ok(record)
    }

    async fn commit_part(&self, part: &CommitPart, now_ms: u64, begun_after_ms: u64) -> MetaResult<CheckpointRecord> {
        let id = to_i64(part.checkpoint_id, "checkpoint id")?;
        let mut tx = self.write().await?;
        let record = checkpoint_by_id(&mut tx, id).await?;
        // Another tenant's checkpoint is answered as one that does not exist: ids are sequential,
        // so anything else would tell a tenant which ids others use.
        let Some(record) = record.filter(|r| part.namespace.as_ref().is_none_or(|tenant| tenant.holds(&r.job))) else {
            return Err(MetaError::NotFound(format!("checkpoint {} does not exist", part.checkpoint_id)));
        };
        if part.rank >= record.world_size {
            return Err(MetaError::InvalidArgument(format!(
                "rank {} is outside world size {} of checkpoint {}",
                part.rank, record.world_size, record.id
            )));
        }
        let existing: Option<Vec<u8>> =
            sqlx::query_scalar("SELECT manifest FROM parts WHERE checkpoint_id = $1 AND rank = $2")
                .bind(id)
                .bind(part.rank as i64)
                .fetch_optional(&mut *tx)
                .await?;
        let ended = |record: &CheckpointRecord| {
            MetaError::FailedPrecondition(format!(
                "checkpoint {} ({} step {}) is {}; its parts can no longer be committed",
                record.id,
                record.job,
                record.step,
                record.state.as_str()
            ))
        };
        if let Some(blob) = existing {
            // The same content, its chunks placed elsewhere (a save retried after its answer was
            // lost), is the same part.
            if !decode_manifest(&blob, record.id, part.rank)?.same_content(&part.manifest) {
                // Two writers of one rank: a relaunch that reused its run id (so it joined the
                // preempted launch's checkpoint), or a step saved twice. Its parts are not of one
                // launch: aborted before the last part could commit it mixed.
                let aborted = record.state == CheckpointState::Pending;
                if aborted {
                    check_epoch(&mut tx, &record.job, record.epoch).await?;
                    abort_in(tx, id, now_ms).await?;
                }
                return Err(MetaError::FailedPrecondition(format!(
                    "rank {} of checkpoint {} ({} step {}) already committed a different manifest: two writers \
                     saved this rank (a relaunch reusing the run id of the one before? each launch needs its own){}",
                    part.rank,
                    record.id,
                    record.job,
                    record.step,
                    if aborted { "; the checkpoint is aborted" } else { "" }
                )));
            }
            // Sent again (its answer was lost): answered as the first while the checkpoint lives.
            // One aborted since is no save waiting for ranks: the writer hears why.
            if matches!(record.state, CheckpointState::Pending | CheckpointState::Committed) {
                return Ok(record);
            }
            check_epoch(&mut tx, &record.job, record.epoch).await?;
            return Err(ended(&record));
        }
        // A tenant's chunks are addressed with its current key, or they could deduplicate
        // against other tenants' (starckpt_proto::address).
        let job = JobName::try_from(record.job.as_str()).map_err(|e| MetaError::Corrupt(e.to_string()))?;
        let wanted = Addressing::of_job(part.cluster_key.as_ref(), &job);
        if part.manifest.addressing != wanted {
            let addressed = |addressing: &Addressing| match addressing.is_keyed() {
                true => "with a tenant's key",
                false => "by plain BLAKE3",
            };
            let which = match (wanted.is_keyed(), job.tenant()) {
                (true, Some(tenant)) if part.manifest.addressing.is_keyed() => {
                    format!("with tenant {tenant}'s current key, not another")
                }
                (true, Some(tenant)) => format!("with tenant {tenant}'s key"),
                _ => addressed(&wanted).to_owned(),
            };
            return Err(MetaError::InvalidArgument(format!(
                "rank {}'s manifest addresses its chunks {}, and job {}'s are addressed {which} \
                 (a client older than the control plane? upgrade it)",
                part.rank,
                addressed(&part.manifest.addressing),
                record.job,
            )));
        }
        check_epoch(&mut tx, &record.job, record.epoch).await?;
        if record.state != CheckpointState::Pending {
            return Err(ended(&record));
        }
        if record.created_at_ms < begun_after_ms {
            abort_in(tx, id, now_ms).await?;
            return Err(MetaError::FailedPrecondition(format!(
                "checkpoint {} ({} step {}) was begun {} s ago, past the pending timeout; it is aborted (save again)",
                record.id,
                record.job,
                record.step,
                now_ms.saturating_sub(record.created_at_ms) / 1000
            )));
        }
        // Parts whose files overlap could all be committed, and the checkpoint never restored.
        // The part alone is checked now; with the last part, all of them, and a conflict then
        // aborts the checkpoint (the parts committed before cannot change).
        let overlap = |e: starckpt_proto::model::ModelError| {
            format!("rank {} of checkpoint {} ({} step {}): {e}", part.rank, record.id, record.job, record.step)
        };
        check_disjoint([(part.rank, &part.manifest)]).map_err(|e| MetaError::InvalidArgument(overlap(e)))?;
        if record.parts_committed + 1 == record.world_size {
            let others = part_manifests(&mut tx, record.id).await?;
            let all = others.iter().map(|(rank, manifest)| (*rank, manifest)).chain([(part.rank, &part.manifest)]);
            if let Err(error) = check_disjoint(all) {
                abort_in(tx, id, now_ms).await?;
                return Err(MetaError::InvalidArgument(format!(
                    "{}; the checkpoint can never be restored and is aborted (ranks must save disjoint files)",
                    overlap(error)
                )));
            }
        }
        let blob = pb::Manifest::from(&part.manifest).encode_to_vec();
        let stored: i64 = sqlx::query_scalar(
            "SELECT CAST(COALESCE(SUM(LENGTH(manifest)), 0) AS BIGINT) FROM parts WHERE checkpoint_id = $1",
        )
        .bind(id)
        .fetch_one(&mut *tx)
        .await?;
        let manifest_total = stored.max(0) as u64 + blob.len() as u64;
        if manifest_total > starckpt_proto::model::MAX_CHECKPOINT_MANIFEST_BYTES {
            return Err(MetaError::InvalidArgument(format!(
                "checkpoint {}'s manifest would be {manifest_total} bytes, over the {} byte limit \
                 (use a larger chunk size)",
                record.id,
                starckpt_proto::model::MAX_CHECKPOINT_MANIFEST_BYTES
            )));
        }
        let (total_bytes, file_count) =
            insert_part(&mut tx, id, part.rank, blob, &part.manifest, part.written_bytes, now_ms).await?;
        let written_bytes = to_i64(part.written_bytes, "written bytes")?;
        let now = to_i64(now_ms, "time")?;
        // The commit transition happens in the same transaction as the last part's insertion.
        sqlx::query(
            "UPDATE checkpoints SET parts_committed = parts_committed + 1, total_bytes = total_bytes + $1,
                 written_bytes = written_bytes + $2, file_count = file_count + $3,
                 state = CASE WHEN parts_committed + 1 = world_size THEN 'committed' ELSE state END,
                 committed_at_ms = CASE WHEN parts_committed + 1 = world_size THEN $4 ELSE committed_at_ms END
             WHERE id = $5",
        )
        .bind(total_bytes)
        .bind(written_bytes)
        .bind(file_count)
        .bind(now)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        let record =
            checkpoint_by_id(&mut tx, id).await?.ok_or_else(|| MetaError::Corrupt("checkpoint vanished".into()))?;
        if record.state == CheckpointState::Committed {
            apply_retention(&mut tx, &record.job, now_ms, Some(record.id)).await?;
        }
        fault("control.commit.txn")?;
        tx.commit().await?;
        Ok(record)
    }

    async fn latest(&self, job: &JobName) -> MetaResult<Option<CheckpointRecord>> {
        let row = sqlx::query(&format!(
            "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE job = $1 AND state = 'committed' ORDER BY step DESC LIMIT 1"
        ))
        .bind(job.as_str())
        .fetch_optional(&self.reader)
        .await?;
        row.as_ref().map(checkpoint_from_row).transpose()
    }

    async fn list_jobs(&self) -> MetaResult<Vec<JobRecord>> {
        let rows = sqlx::query(
            "SELECT job,
                    CAST(SUM(CASE WHEN state = 'committed' THEN 1 ELSE 0 END) AS BIGINT) AS committed,
                    MAX(CASE WHEN state = 'committed' THEN step END) AS latest_step,
                    CAST(SUM(CASE WHEN state = 'committed' THEN total_bytes ELSE 0 END) AS BIGINT) AS committed_bytes
             FROM checkpoints GROUP BY job ORDER BY job",
        )
        .fetch_all(&self.reader)
        .await?;
        rows.iter()
            .map(|row| {
                let latest: Option<i64> = row.try_get("latest_step")?;
                Ok(JobRecord {
                    job: row.try_get("job")?,
                    committed_checkpoints: get_u64(row, "committed")? as u32,
                    latest_step: latest.map(|s| s.max(0) as u64),
                    committed_bytes: get_u64(row, "committed_bytes")?,
                })
            })
            .collect()
    }

    async fn list_checkpoints(&self, job: &JobName, include_inactive: bool) -> MetaResult<Vec<CheckpointRecord>> {
        let filter = if include_inactive { "" } else { "AND state IN ('pending', 'committed')" };
        let rows = sqlx::query(&format!(
            "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE job = $1 {filter} ORDER BY step, id"
        ))
        .bind(job.as_str())
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(checkpoint_from_row).collect()
    }

    async fn get_manifest_page(
        &self,
        job: &JobName,
        of: ManifestOf,
        from_rank: u32,
        max_bytes: usize,
    ) -> MetaResult<ManifestPage> {
        // One read transaction, so the checkpoint and its parts come from the same snapshot.
        let mut tx = self.read().await?;
        let committed = format!("SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE job = $1 AND state = 'committed'");
        let row = match of {
            ManifestOf::Step(Some(step)) => {
                sqlx::query(&format!("{committed} AND step = $2"))
                    .bind(job.as_str())
                    .bind(to_i64(step, "step")?)
                    .fetch_optional(&mut *tx)
                    .await?
            }
            ManifestOf::Step(None) => {
                sqlx::query(&format!("{committed} ORDER BY step DESC LIMIT 1"))
                    .bind(job.as_str())
                    .fetch_optional(&mut *tx)
                    .await?
            }
            ManifestOf::Checkpoint(id) => {
                sqlx::query(&format!("{committed} AND id = $2"))
                    .bind(job.as_str())
                    .bind(to_i64(id, "checkpoint id")?)
                    .fetch_optional(&mut *tx)
                    .await?
            }
        };
        let Some(row) = row else {
            return Err(MetaError::NotFound(match of {
                ManifestOf::Step(Some(step)) => format!("job {job} has no committed checkpoint at step {step}"),
                ManifestOf::Step(None) => format!("job {job} has no committed checkpoint"),
                ManifestOf::Checkpoint(id) => format!("checkpoint {id} of job {job} is no longer committed"),
            }));
        };
        let record = checkpoint_from_row(&row)?;
        if from_rank >= record.world_size {
            return Err(MetaError::InvalidArgument(format!(
                "rank {from_rank} is outside checkpoint {}'s world size {}",
                record.id, record.world_size
            )));
        }
        let (parts, next_rank) = part_manifests_from(&mut tx, record.id, from_rank, max_bytes).await?;
        let expected = from_rank..next_rank.unwrap_or(record.world_size);
        if !parts.iter().map(|(rank, _)| *rank).eq(expected.clone()) {
            return Err(MetaError::Corrupt(format!(
                "committed checkpoint {} of world size {} lacks a part of ranks {expected:?}",
                record.id, record.world_size
            )));
        }
        Ok(ManifestPage { record, parts, next_rank })
    }

    async fn abort_stale_pending(&self, created_before_ms: u64, now_ms: u64) -> MetaResult<Vec<CheckpointRecord>> {
        let mut tx = self.write().await?;
        let rows = sqlx::query(&format!(
            "UPDATE checkpoints SET state = 'aborted', ended_at_ms = $1
             WHERE state = 'pending' AND created_at_ms < $2 RETURNING {CHECKPOINT_COLUMNS}"
        ))
        .bind(to_i64(now_ms, "time")?)
        .bind(to_i64(created_before_ms, "time")?)
        .fetch_all(&mut *tx)
        .await?;
        let aborted = rows.iter().map(checkpoint_from_row).collect::<MetaResult<_>>()?;
        tx.commit().await?;
        Ok(aborted)
    }

    async fn delete_checkpoint(&self, job: &JobName, step: u64, only: Option<u64>, now_ms: u64) -> MetaResult<()> {
        let mut tx = self.write().await?;
        let result = sqlx::query(
            "UPDATE checkpoints SET state = CASE WHEN state = 'committed' THEN 'deleted' ELSE 'aborted' END, ended_at_ms = $1
             WHERE job = $2 AND step = $3 AND state IN ('pending', 'committed') AND ($4 = 0 OR id = $4)",
        )
        .bind(to_i64(now_ms, "time")?)
        .bind(job.as_str())
        .bind(to_i64(step, "step")?)
        .bind(to_i64(only.unwrap_or(0), "checkpoint id")?)
        .execute(&mut *tx)
        .await?;
        if result.rows_affected() == 0 {
            let which = only.map_or(String::new(), |id| format!(" (checkpoint {id})"));
            return Err(MetaError::NotFound(format!("job {job} has no checkpoint at step {step}{which}")));
        }
        tx.commit().await?;
        Ok(())
    }

    async fn abort_pending(&self, job: &JobName, id: u64, now_ms: u64) -> MetaResult<()> {
        let mut tx = self.write().await?;
        let id = to_i64(id, "checkpoint id")?;
        let state: Option<String> = sqlx::query_scalar(
            "UPDATE checkpoints SET state = CASE WHEN state = 'pending' THEN 'aborted' ELSE state END,
                 ended_at_ms = CASE WHEN state = 'pending' THEN $1 ELSE ended_at_ms END
             WHERE id = $2 AND job = $3 RETURNING state",
        )
        .bind(to_i64(now_ms, "time")?)
        .bind(id)
        .bind(job.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        match state.as_deref() {
            None => Err(MetaError::NotFound(format!("job {job} has no checkpoint {id}"))),
            Some("aborted") => Ok(()),
            Some(state) => {
                Err(MetaError::FailedPrecondition(format!("checkpoint {id} of job {job} is {state}, not pending")))
            }
        }
    }

    async fn set_retention(&self, job: &JobName, policy: RetentionPolicy, now_ms: u64) -> MetaResult<Vec<u64>> {
        let mut tx = self.write().await?;
        sqlx::query(
            "INSERT INTO retention (job, keep_last, keep_every, updated_at_ms) VALUES ($1, $2, $3, $4)
             ON CONFLICT (job) DO UPDATE SET keep_last = excluded.keep_last, keep_every = excluded.keep_every,
                 updated_at_ms = excluded.updated_at_ms",
        )
        .bind(job.as_str())
        .bind(i64::from(policy.keep_last))
        .bind(to_i64(policy.keep_every, "keep_every")?)
        .bind(to_i64(now_ms, "time")?)
        .execute(&mut *tx)
        .await?;
        let deleted = apply_retention(&mut tx, job.as_str(), now_ms, None).await?;
        tx.commit().await?;
        Ok(deleted)
    }

    async fn get_retention(&self, job: &JobName) -> MetaResult<RetentionPolicy> {
        let mut tx = self.read().await?;
        retention_policy(&mut tx, job.as_str()).await
    }

    async fn set_replication(&self, job: &JobName, replicas: u32, now_ms: u64) -> MetaResult<()> {
        if !(1..=starckpt_proto::model::MAX_REPLICAS).contains(&replicas) {
            return Err(MetaError::InvalidArgument(format!(
                "replication factor {replicas} is outside 1..={}",
                starckpt_proto::model::MAX_REPLICAS
            )));
        }
        let mut tx = self.write().await?;
        sqlx::query(
            "INSERT INTO replication (job, replicas, updated_at_ms) VALUES ($1, $2, $3)
             ON CONFLICT (job) DO UPDATE SET replicas = excluded.replicas, updated_at_ms = excluded.updated_at_ms",
        )
        .bind(job.as_str())
        .bind(i64::from(replicas))
        .bind(to_i64(now_ms, "time")?)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn replication(&self, job: &JobName) -> MetaResult<Option<u32>> {
        let replicas: Option<i64> = sqlx::query_scalar("SELECT replicas FROM replication WHERE job = $1")
            .bind(job.as_str())
            .fetch_optional(&self.reader)
            .await?;
        replicas
            .map(|r| u32::try_from(r).map_err(|_| MetaError::Corrupt(format!("replication factor {r}"))))
            .transpose()
    }

    async fn tag_checkpoint(&self, job: &JobName, step: u64, tag: &str, remove: bool) -> MetaResult<()> {
        starckpt_proto::model::validate_tag(tag).map_err(|e| MetaError::InvalidArgument(e.to_string()))?;
        let mut tx = self.write().await?;
        // Removing a tag is sent again when its answer is lost, and the first removal may have let
        // retention delete the checkpoint: removing the tags of a step deleted since is done.
        let states = if remove { "('committed', 'deleted')" } else { "('committed')" };
        let found = sqlx::query(&format!(
            "SELECT id, state FROM checkpoints WHERE job = $1 AND step = $2 AND state IN {states} ORDER BY id DESC LIMIT 1"
        ))
        .bind(job.as_str())
        .bind(to_i64(step, "step")?)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(found) = found else {
            return Err(MetaError::NotFound(format!("job {job} has no committed checkpoint at step {step}")));
        };
        let id: i64 = found.try_get("id")?;
        if found.try_get::<String, _>("state")? == "deleted" {
            return Ok(());
        }
        let statement = if remove {
            "DELETE FROM tags WHERE checkpoint_id = $1 AND tag = $2"
        } else {
            "INSERT INTO tags (checkpoint_id, tag) VALUES ($1, $2) ON CONFLICT DO NOTHING"
        };
        sqlx::query(statement).bind(id).bind(tag).execute(&mut *tx).await?;
        if remove {
            // An untagged checkpoint falls back under the policy at once.
            apply_retention(&mut tx, job.as_str(), crate::control::store::now_ms(), None).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn live_chunks(&self) -> MetaResult<HashSet<ChunkHash>> {
        // One read transaction: a consistent snapshot, streamed one manifest at a time.
        let mut tx = self.read().await?;
        let mut rows = sqlx::query(
            "SELECT p.checkpoint_id, p.rank, p.manifest FROM parts p JOIN checkpoints c ON c.id = p.checkpoint_id
             WHERE c.state IN ('pending', 'committed')",
        )
        .fetch(&mut *tx);
        let mut live = HashSet::new();
        while let Some(row) = rows.try_next().await? {
            let (id, rank) = (get_u64(&row, "checkpoint_id")?, get_u64(&row, "rank")? as u32);
            let blob: Vec<u8> = row.try_get("manifest")?;
            let manifest = decode_manifest(&blob, id, rank)?;
            live.extend(manifest.files.iter().flat_map(|f| f.chunks.iter()).map(|c| c.hash));
        }
        Ok(live)
    }

    async fn committed_chunks(&self, default_replicas: u32) -> MetaResult<HashMap<ChunkHash, CommittedChunk>> {
        let mut tx = self.read().await?;
        let mut rows = sqlx::query(
            "SELECT p.checkpoint_id, p.rank, p.manifest, r.replicas FROM parts p
             JOIN checkpoints c ON c.id = p.checkpoint_id LEFT JOIN replication r ON r.job = c.job
             WHERE c.state = 'committed'",
        )
        .fetch(&mut *tx);
        let mut chunks: HashMap<ChunkHash, CommittedChunk> = HashMap::new();
        let mut ids = TargetIds::default();
        while let Some(row) = rows.try_next().await? {
            let (id, rank) = (get_u64(&row, "checkpoint_id")?, get_u64(&row, "rank")? as u32);
            let replicas: Option<i64> = row.try_get("replicas")?;
            let wanted = replicas.map_or(default_replicas, |r| u32::try_from(r).unwrap_or(default_replicas));
            let blob: Vec<u8> = row.try_get("manifest")?;
            let manifest = decode_manifest(&blob, id, rank)?;
            for chunk in manifest.files.iter().flat_map(|f| f.chunks.iter()) {
                let entry = chunks.entry(chunk.hash).or_insert_with(|| CommittedChunk {
                    length: chunk.length_bytes,
                    replicas: Default::default(),
                    wanted,
                    addressing: manifest.addressing,
                });
                for replica in &chunk.replicas {
                    entry.replicas.add(replica, &mut ids);
                }
                entry.wanted = entry.wanted.max(wanted);
            }
        }
        Ok(chunks)
    }

    async fn untiered_checkpoints(&self) -> MetaResult<Vec<CheckpointRecord>> {
        let rows = sqlx::query(&format!(
            "SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE state = 'committed'
             AND NOT EXISTS (SELECT 1 FROM tiered WHERE tiered.checkpoint_id = checkpoints.id)
             ORDER BY committed_at_ms, id"
        ))
        .fetch_all(&self.reader)
        .await?;
        rows.iter().map(checkpoint_from_row).collect()
    }

    async fn mark_tiered(&self, id: u64, now_ms: u64, fence: u64) -> MetaResult<bool> {
        let mut tx = self.write().await?;
        if tier_sweeps(&mut tx).await?.fence() != Some(fence) {
            return Ok(false);
        }
        sqlx::query("INSERT INTO tiered (checkpoint_id, tiered_at_ms) VALUES ($1, $2) ON CONFLICT DO NOTHING")
            .bind(to_i64(id, "checkpoint id")?)
            .bind(to_i64(now_ms, "time")?)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn tiered_gone(&self) -> MetaResult<Vec<u64>> {
        let ids: Vec<i64> = sqlx::query_scalar(
            "SELECT t.checkpoint_id FROM tiered t JOIN checkpoints c ON c.id = t.checkpoint_id
             WHERE c.state <> 'committed' ORDER BY t.checkpoint_id",
        )
        .fetch_all(&self.reader)
        .await?;
        Ok(ids.into_iter().map(|id| id.max(0) as u64).collect())
    }

    async fn forget_tiered(&self, ids: &[u64]) -> MetaResult<()> {
        let mut tx = self.write().await?;
        for &id in ids {
            sqlx::query(
                "DELETE FROM tiered WHERE checkpoint_id = $1 AND checkpoint_id NOT IN
                         (SELECT id FROM checkpoints WHERE state = 'committed')",
            )
            .bind(to_i64(id, "checkpoint id")?)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    async fn tier_sweeps(&self) -> MetaResult<TierSweeps> {
        tier_sweeps(&mut self.read().await?).await
    }

    async fn begin_tier_sweep(&self) -> MetaResult<u64> {
        let mut tx = self.write().await?;
        let started: i64 = sqlx::query_scalar(
            "INSERT INTO tier_sweeps (id, started, finished) VALUES (1, 1, 0)
             ON CONFLICT (id) DO UPDATE SET started = tier_sweeps.started + 1 RETURNING started",
        )
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        u64::try_from(started).map_err(|_| MetaError::Corrupt(format!("tier sweep {started}")))
    }

    async fn join_control_planes(
        &self,
        member: &ControlPlaneMember,
        now_ms: u64,
        live_since_ms: u64,
        refuse: bool,
    ) -> MetaResult<Option<String>> {
        const FORGET_AFTER_MS: u64 = 24 * 3600 * 1000;
        let mut tx = self.write().await?;
        sqlx::query("DELETE FROM control_planes WHERE seen_at_ms < $1")
            .bind(to_i64(now_ms.saturating_sub(FORGET_AFTER_MS), "time")?)
            .execute(&mut *tx)
            .await?;
        // This control plane's earlier runs (same listener, other ids): gone, since it listens there.
        sqlx::query("DELETE FROM control_planes WHERE id <> $1 AND substr(id, 1, length($2)) = $2")
            .bind(&member.id)
            .bind(format!("{}/", member.listener))
            .execute(&mut *tx)
            .await?;
        let other = sqlx::query(
            "SELECT id, pending_timeout_ms, gc_grace_ms, seen_at_ms, security, tier FROM control_planes
             WHERE id <> $1 AND seen_at_ms >= $2 AND (pending_timeout_ms <> $3 OR gc_grace_ms <> $4
                 OR (security <> $5 AND security <> '' AND $5 <> '')
                 OR (tier <> $6 AND tier <> '' AND $6 <> ''))
             ORDER BY seen_at_ms DESC LIMIT 1",
        )
        .bind(&member.id)
        .bind(to_i64(live_since_ms, "time")?)
        .bind(to_i64(member.pending_timeout_ms, "pending timeout")?)
        .bind(to_i64(member.gc_grace_ms, "GC grace")?)
        .bind(&member.security)
        .bind(&member.tier)
        .fetch_optional(&mut *tx)
        .await?;
        let conflict = match other {
            None => None,
            Some(row) => {
                let id: String = row.try_get("id")?;
                let security: String = row.try_get("security")?;
                let (pending, grace) = (get_u64(&row, "pending_timeout_ms")?, get_u64(&row, "gc_grace_ms")?);
                let mut differences = Vec::new();
                if (pending, grace) != (member.pending_timeout_ms, member.gc_grace_ms) {
                    differences.push(format!(
                        "it has a pending timeout of {} s and a GC grace of {} s, this one {} s and {} s \
                         (--pending-timeout-secs, --gc-grace-secs)",
                        pending / 1000,
                        grace / 1000,
                        member.pending_timeout_ms / 1000,
                        member.gc_grace_ms / 1000,
                    ));
                }
                if !security.is_empty() && !member.security.is_empty() && security != member.security {
                    differences.push(format!(
                        "it runs with {security}, this one with {} (--cluster-key-file, --tokens-file, --tls-cert)",
                        member.security
                    ));
                }
                let tier: String = row.try_get("tier")?;
                if !tier.is_empty() && !member.tier.is_empty() && tier != member.tier {
                    differences.push(format!("it uses {tier}, this one {} (--tier)", member.tier));
                }
                Some(format!(
                    "control plane {id} (seen {} s ago) serves this database, and control planes sharing a \
                     database must agree: {}",
                    now_ms.saturating_sub(get_u64(&row, "seen_at_ms")?) / 1000,
                    differences.join("; "),
                ))
            }
        };
        if refuse && conflict.is_some() {
            return Ok(conflict);
        }
        sqlx::query(
            "INSERT INTO control_planes (id, pending_timeout_ms, gc_grace_ms, seen_at_ms, security, tier)
             VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (id) DO UPDATE SET pending_timeout_ms = excluded.pending_timeout_ms,
                 gc_grace_ms = excluded.gc_grace_ms, seen_at_ms = excluded.seen_at_ms, security = excluded.security,
                 tier = excluded.tier",
        )
        .bind(&member.id)
        .bind(to_i64(member.pending_timeout_ms, "pending timeout")?)
        .bind(to_i64(member.gc_grace_ms, "GC grace")?)
        .bind(to_i64(now_ms, "time")?)
        .bind(&member.security)
        .bind(&member.tier)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(conflict)
    }

    async fn import_checkpoint(
        &self,
        checkpoint: &ImportedCheckpoint,
        now_ms: u64,
        fence: u64,
    ) -> MetaResult<Option<CheckpointRecord>> {
        let world_size = u32::try_from(checkpoint.parts.len())
            .ok()
            .filter(|n| (1..=starckpt_proto::model::MAX_WORLD_SIZE).contains(n))
            .ok_or_else(|| MetaError::InvalidArgument(format!("{} ranks", checkpoint.parts.len())))?;
        let blobs: Vec<Vec<u8>> = checkpoint.parts.iter().map(|m| pb::Manifest::from(m).encode_to_vec()).collect();
        let manifest_total: u64 = blobs.iter().map(|b| b.len() as u64).sum();
        if manifest_total > starckpt_proto::model::MAX_CHECKPOINT_MANIFEST_BYTES {
            return Err(MetaError::InvalidArgument(format!("manifest of {manifest_total} bytes")));
        }
        let step = to_i64(checkpoint.step, "step")?;
        let mut tx = self.write().await?;
        if tier_sweeps(&mut tx).await?.fence() != Some(fence) {
            return Err(MetaError::FailedPrecondition(format!(
                "{} step {}: a sweep of the tier began after the tier was read (it may delete chunks \
                 this checkpoint needs); import again once it finishes",
                checkpoint.job, checkpoint.step
            )));
        }
        let live: Option<i64> = sqlx::query_scalar(
            "SELECT id FROM checkpoints WHERE job = $1 AND step = $2 AND state IN ('pending', 'committed')",
        )
        .bind(checkpoint.job.as_str())
        .bind(step)
        .fetch_optional(&mut *tx)
        .await?;
        if live.is_some() {
            return Ok(None);
        }
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO checkpoints (job, step, state, world_size, epoch, written_bytes, created_at_ms, committed_at_ms)
             VALUES ($1, $2, 'committed', $3, $4, $5, $6, $7) RETURNING id",
        )
        .bind(checkpoint.job.as_str())
        .bind(step)
        .bind(world_size as i64)
        .bind(to_i64(checkpoint.epoch, "epoch")?)
        .bind(to_i64(checkpoint.written_bytes, "written bytes")?)
        .bind(to_i64(checkpoint.created_at_ms, "time")?)
        .bind(to_i64(checkpoint.committed_at_ms, "time")?)
        .fetch_one(&mut *tx)
        .await?;
        let (mut total_bytes, mut file_count) = (0, 0);
        for ((rank, manifest), blob) in checkpoint.parts.iter().enumerate().zip(blobs) {
            let (bytes, files) = insert_part(&mut tx, id, rank as u32, blob, manifest, 0, now_ms).await?;
            total_bytes += bytes;
            file_count += files;
        }
        sqlx::query(
            "UPDATE checkpoints SET parts_committed = world_size, total_bytes = $1, file_count = $2 WHERE id = $3",
        )
        .bind(total_bytes)
        .bind(file_count)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        let record =
            checkpoint_by_id(&mut tx, id).await?.ok_or_else(|| MetaError::Corrupt("import vanished".into()))?;
        tx.commit().await?;
        Ok(Some(record))
    }

    async fn leave_control_planes(&self, id: &str) -> MetaResult<()> {
        let mut tx = self.write().await?;
        sqlx::query("DELETE FROM control_planes WHERE id = $1").bind(id).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn database_clock_ms(&self) -> MetaResult<Option<u64>> {
        if self.dialect != Dialect::Postgres {
            return Ok(None);
        }
        let clock: i64 = sqlx::query_scalar("SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)")
            .fetch_one(&self.reader)
            .await?;
        Ok(Some(clock.max(0) as u64))
    }

    async fn finish_tier_sweep(&self, sweep: u64) -> MetaResult<()> {
        let mut tx = self.write().await?;
        sqlx::query("UPDATE tier_sweeps SET finished = $1 WHERE id = 1 AND finished < $1")
            .bind(to_i64(sweep, "sweep")?)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn record_repair_pass(&self, finished_at_ms: u64, still_under_replicated: u64) -> MetaResult<()> {
        let mut tx = self.write().await?;
        sqlx::query(
            "INSERT INTO repair_passes (id, finished_at_ms, still_under_replicated) VALUES (1, $1, $2)
             ON CONFLICT (id) DO UPDATE SET finished_at_ms = excluded.finished_at_ms,
                 still_under_replicated = excluded.still_under_replicated
             WHERE repair_passes.finished_at_ms <= excluded.finished_at_ms",
        )
        .bind(to_i64(finished_at_ms, "time")?)
        .bind(to_i64(still_under_replicated, "chunk count")?)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    async fn last_repair_pass(&self) -> MetaResult<Option<(u64, u64)>> {
        let mut tx = self.read().await?;
        let row = sqlx::query("SELECT finished_at_ms, still_under_replicated FROM repair_passes WHERE id = 1")
            .fetch_optional(&mut *tx)
            .await?;
        row.map(|row| Ok((get_u64(&row, "finished_at_ms")?, get_u64(&row, "still_under_replicated")?))).transpose()
    }

    async fn try_lead(&self, role: Role) -> MetaResult<Option<Leadership>> {
        match self.dialect {
            // One control plane per SQLite file: it leads.
            Dialect::Sqlite => Ok(Some(Leadership(Box::new(role)))),
            Dialect::Postgres => {
                // A session lock on a connection of its own, out of the pool: it is released when
                // the guard drops the connection, or when PostgreSQL sees this process gone.
                let mut connection = self.reader.acquire().await?.detach();
                let taken: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                    .bind(role_lock(role))
                    .fetch_one(&mut connection)
                    .await?;
                Ok(taken.then(|| Leadership(Box::new(std::sync::Mutex::new(connection)))))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::control::store::conformance;

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
        manifest_pages,
        tenant_namespaces,
        overlapping_parts,
        two_writers_of_a_rank,
        step_collisions,
        fencing,
        stale_pending_is_aborted,
        replication,
        retention_and_tags,
        late_commit_is_refused,
        committed_chunks,
        live_chunks,
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
            assert!(
                matches!(store.get_manifest(&job, None).await, Err(MetaError::Corrupt(_))),
                "{:?}",
                store.dialect()
            );
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
        sqlx::raw_sql(&format!(
            "CREATE TABLE schema_version (version INTEGER NOT NULL);
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
        for (version, domain) in [(1, ""), (2, "rack"), (3, "rack"), (4, "rack")] {
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
}
