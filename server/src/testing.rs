//! Test support: the servers the control plane's optional backends need, PostgreSQL and S3.
//!
//! `scripts/test` starts throwaway ones (`scripts/postgres`, moto's S3 server) and names them in
//! [`ADMIN_URL_VAR`] and [`S3_ENDPOINT_VAR`]; each test takes a database or bucket of its own, so
//! tests run in parallel and a cluster never sees another test's targets. Where no server is
//! named those variants say so and pass, unless [`REQUIRED_VAR`] / [`S3_REQUIRED_VAR`] is set (CI
//! sets both), which makes that a failure.

use sqlx::Connection;

/// The admin URL (`postgres://user@host:port/db`) of a server the tests may create databases on.
pub const ADMIN_URL_VAR: &str = "STARCKPT_TEST_POSTGRES";
/// Set (to anything): a missing [`ADMIN_URL_VAR`] fails the PostgreSQL tests instead of skipping.
pub const REQUIRED_VAR: &str = "STARCKPT_REQUIRE_POSTGRES";

/// The URL of a new, empty database for `test` on the server [`ADMIN_URL_VAR`] names; `None`
/// where it names none (and [`REQUIRED_VAR`] is unset).
pub async fn fresh_postgres_database(test: &str) -> anyhow::Result<Option<String>> {
    let Some(admin) = server(ADMIN_URL_VAR, REQUIRED_VAR, test, "PostgreSQL")? else { return Ok(None) };
    let name = format!("starckpt_test_{}", uuid::Uuid::new_v4().simple());
    let mut connection = sqlx::postgres::PgConnection::connect(&admin).await?;
    sqlx::raw_sql(&format!("CREATE DATABASE {name}")).execute(&mut connection).await?;
    connection.close().await?;
    let mut url = url::Url::parse(&admin)?;
    url.set_path(&name);
    Ok(Some(url.to_string()))
}

/// The endpoint (`http://host:port`) of an S3-compatible server the tests may create buckets on.
pub const S3_ENDPOINT_VAR: &str = "STARCKPT_TEST_S3";
/// Set (to anything): a missing [`S3_ENDPOINT_VAR`] fails the S3 tests instead of skipping.
pub const S3_REQUIRED_VAR: &str = "STARCKPT_REQUIRE_S3";

/// A new, empty bucket for `test` on the S3 server [`S3_ENDPOINT_VAR`] names, as
/// `(endpoint, bucket)`; `None` where it names none (and [`S3_REQUIRED_VAR`] is unset). The
/// server must take unsigned requests (moto's does; `scripts/test` starts one).
pub fn fresh_s3_bucket(test: &str) -> anyhow::Result<Option<(String, String)>> {
    use std::io::{Read, Write};
    let Some(endpoint) = server(S3_ENDPOINT_VAR, S3_REQUIRED_VAR, test, "S3")? else { return Ok(None) };
    let url = url::Url::parse(&endpoint)?;
    let host = url.host_str().ok_or_else(|| anyhow::anyhow!("{endpoint}: no host"))?;
    let port = url.port_or_known_default().unwrap_or(80);
    let bucket = format!("starckpt-test-{}", uuid::Uuid::new_v4().simple());
    // CreateBucket is one unsigned PUT: not worth an HTTP client in the dependencies.
    let mut stream = std::net::TcpStream::connect((host, port))?;
    write!(stream, "PUT /{bucket} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    anyhow::ensure!(
        response.starts_with("HTTP/1.1 200") || response.starts_with("HTTP/1.0 200"),
        "creating bucket {bucket} at {endpoint}: {}",
        response.lines().next().unwrap_or_default()
    );
    Ok(Some((endpoint, bucket)))
}

/// The server `var` names; None (after saying the `what` variant of `test` is skipped) where it
/// names none, an error where `required` is set.
fn server(var: &str, required: &str, test: &str, what: &str) -> anyhow::Result<Option<String>> {
    if let Ok(value) = std::env::var(var) {
        return Ok(Some(value));
    }
    anyhow::ensure!(std::env::var_os(required).is_none(), "{required} is set but {var} names no {what} server");
    eprintln!("{test}: {what} variant skipped: {var} is unset (scripts/test sets it)");
    Ok(None)
}
