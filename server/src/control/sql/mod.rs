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

use std::str::FromStr;
use std::time::Duration;

use sqlx::any::{AnyConnectOptions, AnyPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode};
use sqlx::{Any, AnyPool, ConnectOptions, Connection, Transaction};

use super::store::{MetaError, MetaResult, Role};

const SCHEMA: &str = include_str!("schema.sql");
/// 2: targets.failure_domain, the replication table. 3: targets.rdma_device. 5:
/// control_planes.tier. 6: leases.started_at_ms. 7: drafts. 8: job_files. Older databases are
/// migrated on open (PostgreSQL support began at 3).
const SCHEMA_VERSION: i64 = 8;
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

    /// A query counting the columns named `$2` of table `$1` (0 or 1).
    fn column_count(self) -> &'static str {
        match self {
            Dialect::Sqlite => "SELECT COUNT(*) FROM pragma_table_info($1) WHERE name = $2",
            Dialect::Postgres => {
                "SELECT COUNT(*) FROM information_schema.columns WHERE table_schema = current_schema() \
                 AND table_name = $1 AND column_name = $2"
            }
        }
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
    match crate::lockfile::try_hold(&path) {
        Ok(Some(file)) => Ok(DatabaseLock { _file: file }),
        Ok(None) => Err(MetaError::FailedPrecondition(format!(
            "database {} is in use by another control plane (it holds {}); an SQLite database serves \
             one control plane at a time: for several, use PostgreSQL",
            database.display(),
            path.display()
        ))),
        Err(e) => Err(MetaError::InvalidArgument(format!("database lock file {}: {e}", path.display()))),
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
            Some(old @ (1..=7)) => {
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
                // A table the schema above just made has the column already.
                let has_start: i64 = sqlx::query_scalar(self.dialect.column_count())
                    .bind("leases")
                    .bind("started_at_ms")
                    .fetch_one(&mut *tx)
                    .await?;
                if has_start == 0 {
                    sqlx::query("ALTER TABLE leases ADD COLUMN started_at_ms BIGINT NOT NULL DEFAULT 0")
                        .execute(&mut *tx)
                        .await?;
                }
                // Its rows are refreshed every few seconds by the control planes they name: made
                // again with the current columns (version 3 databases may or may not have it; 5
                // added one).
                if old < 6 {
                    sqlx::query("DROP TABLE IF EXISTS control_planes").execute(&mut *tx).await?;
                    sqlx::Executor::execute(&mut *tx, sqlx::raw_sql(&self.dialect.schema())).await?;
                }
                // Version 7 added the drafts table and 8 the job_files table, which the schema
                // above made.
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

mod drafts;
mod job_files;
mod meta;
mod queries;
#[cfg(test)]
mod tests;
