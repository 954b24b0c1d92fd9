//! Test support: PostgreSQL databases for the suites that run the control plane on PostgreSQL.
//!
//! `scripts/test` starts a throwaway server (`scripts/postgres`) and names it in
//! [`ADMIN_URL_VAR`]; each test takes a database of its own on it, so tests run in parallel and a
//! cluster never sees another test's targets. Where no server is named the PostgreSQL variants
//! say so and pass, unless [`REQUIRED_VAR`] is set (CI sets it), which makes that a failure.

use sqlx::Connection;

/// The admin URL (`postgres://user@host:port/db`) of a server the tests may create databases on.
pub const ADMIN_URL_VAR: &str = "STARCKPT_TEST_POSTGRES";
/// Set (to anything): a missing [`ADMIN_URL_VAR`] fails the PostgreSQL tests instead of skipping.
pub const REQUIRED_VAR: &str = "STARCKPT_REQUIRE_POSTGRES";

/// The URL of a new, empty database for `test` on the server [`ADMIN_URL_VAR`] names; `None`
/// where it names none (and [`REQUIRED_VAR`] is unset).
pub async fn fresh_postgres_database(test: &str) -> anyhow::Result<Option<String>> {
    let Ok(admin) = std::env::var(ADMIN_URL_VAR) else {
        anyhow::ensure!(
            std::env::var_os(REQUIRED_VAR).is_none(),
            "{REQUIRED_VAR} is set but {ADMIN_URL_VAR} names no PostgreSQL server"
        );
        eprintln!("{test}: PostgreSQL variant skipped: {ADMIN_URL_VAR} is unset (scripts/test sets it)");
        return Ok(None);
    };
    let name = format!("starckpt_test_{}", uuid::Uuid::new_v4().simple());
    let mut connection = sqlx::postgres::PgConnection::connect(&admin).await?;
    sqlx::raw_sql(&format!("CREATE DATABASE {name}")).execute(&mut connection).await?;
    connection.close().await?;
    let mut url = url::Url::parse(&admin)?;
    url.set_path(&name);
    Ok(Some(url.to_string()))
}
