//! Connecting to PostgreSQL: the pool, the schema check, and database URLs
//! as messages and `--print-config` show them.

use std::time::Duration;

use anyhow::{bail, Context};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection as _, PgPool};

/// host:port/database of a PostgreSQL URL (no user or password), for messages.
pub(super) fn describe_url(url: &str) -> String {
    match url.parse::<PgConnectOptions>() {
        Ok(o) => format!("{}:{}/{}", o.get_host(), o.get_port(), o.get_database().unwrap_or("")),
        Err(_) => "a consumer database".into(),
    }
}

/// Longest the first connection to PostgreSQL may take before a command
/// gives up with the cause, ms.
pub const DB_CONNECT_TIMEOUT_MS: u64 = 10_000;

/// A pool on the outbox database. A URL that is not PostgreSQL's is refused;
/// a server that refuses or does not answer fails within
/// [`DB_CONNECT_TIMEOUT_MS`] naming the host and the cause.
pub async fn connect(url: &str, max_connections: u32) -> anyhow::Result<PgPool> {
    let scheme = url.split_once("://").map(|(s, _)| s.to_ascii_lowercase());
    if !matches!(scheme.as_deref(), Some("postgres" | "postgresql")) {
        bail!("the database URL is not a PostgreSQL URL: expected postgres://USER@HOST:PORT/DATABASE (the URL is not shown: it may hold a password)");
    }
    let opts: PgConnectOptions = url.parse().map_err(|e: sqlx::Error| anyhow::anyhow!("the database URL cannot be read: {}", first_line(&e.to_string())))?;
    let opts = opts.log_slow_statements(tracing::log::LevelFilter::Warn, Duration::from_secs(5)).log_statements(tracing::log::LevelFilter::Trace);
    let target = format!("{}:{}/{}", opts.get_host(), opts.get_port(), opts.get_database().unwrap_or(""));
    // One direct connection first: a pool retries until its acquire timeout
    // and then reports only "pool timed out", losing the cause.
    match tokio::time::timeout(Duration::from_millis(DB_CONNECT_TIMEOUT_MS), opts.connect()).await {
        Ok(Ok(c)) => {
            let _ = c.close().await;
        }
        Ok(Err(e)) => bail!("connecting to PostgreSQL at {target}: {}", sqlx_cause(&e)),
        Err(_) => bail!("connecting to PostgreSQL at {target}: no answer within {} s", DB_CONNECT_TIMEOUT_MS / 1000),
    }
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(opts.clone())
        .await
        .map_err(|e| anyhow::anyhow!("connecting to PostgreSQL at {target}: {}", sqlx_cause(&e)))
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}

/// What went wrong, once: the server's message for a database error, the
/// I/O error for a refused or broken connection.
pub fn sqlx_cause(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Database(d) => d.message().to_owned(),
        sqlx::Error::Io(io) => io.to_string(),
        sqlx::Error::Tls(t) => format!("TLS: {t}"),
        sqlx::Error::PoolTimedOut => "no connection within the pool's timeout".to_owned(),
        other => other.to_string(),
    }
}

/// [`connect`], then [`require_schema`].
pub async fn open(url: &str, max_connections: u32) -> anyhow::Result<PgPool> {
    let pool = connect(url, max_connections).await?;
    require_schema(&pool).await?;
    Ok(pool)
}

/// Refuses to go on against a database without the outbox schema (or with
/// part of it), saying to run `outbox migrate`.
pub async fn require_schema(pool: &PgPool) -> anyhow::Result<()> {
    let present: bool = sqlx::query_scalar("SELECT to_regclass('outbox_events') IS NOT NULL AND to_regclass('outbox_meta') IS NOT NULL").fetch_one(pool).await?;
    if !present {
        bail!("this database has no outbox schema: run `outbox migrate` first");
    }
    // Every producer migration this build knows, when the history is readable.
    let applied: Result<Vec<i64>, sqlx::Error> = sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success").fetch_all(pool).await;
    if let Ok(applied) = applied {
        let missing: Vec<String> =
            outbox_producer::MIGRATOR.iter().filter(|m| !m.migration_type.is_down_migration() && !applied.contains(&m.version)).map(|m| m.version.to_string()).collect();
        if !missing.is_empty() {
            bail!("the outbox schema is older than this build ({} migration(s) missing, e.g. {}): run `outbox migrate` first", missing.len(), missing[0]);
        }
    }
    outbox_producer::check_protocol(pool).await.context("the outbox schema")?;
    Ok(())
}

/// `url` with its password (user info or `password=` parameter) replaced by `***`.
pub fn mask_database_url(url: &str) -> String {
    let mut out = url.to_owned();
    if let Some(scheme_end) = out.find("://") {
        let rest = &out[scheme_end + 3..];
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        if let Some(at) = rest[..authority_end].rfind('@') {
            if let Some(colon) = rest[..at].find(':') {
                out = format!("{}{}:***{}", &out[..scheme_end + 3], &rest[..colon], &rest[at..]);
            }
        }
    }
    if let Some(q) = out.find('?') {
        let (head, query) = out.split_at(q + 1);
        let masked: Vec<String> = query
            .split('&')
            .map(|kv| match kv.split_once('=') {
                Some((k, _)) if k.eq_ignore_ascii_case("password") || k.eq_ignore_ascii_case("sslpassword") => format!("{k}=***"),
                _ => kv.to_owned(),
            })
            .collect();
        out = format!("{head}{}", masked.join("&"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_passwords_are_masked() {
        assert_eq!(mask_database_url("postgres://u:Pw_1@h:5432/db"), "postgres://u:***@h:5432/db");
        assert_eq!(mask_database_url("postgres://u@h/db?sslmode=require&password=Pw_2"), "postgres://u@h/db?sslmode=require&password=***");
        assert_eq!(mask_database_url("postgres://h/db"), "postgres://h/db");
    }
}
