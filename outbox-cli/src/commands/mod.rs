//! What each command does.
//!
//! Files: this one holds the dispatch over [`Command`], the exit codes,
//! logging and how an error is shown; `db` connecting to PostgreSQL (and
//! the schema check); `broker` the Kafka flags and connection; `service`
//! what the two services share (signals, the metrics and health endpoint,
//! supervision); `print_config` the effective configuration as TOML; then
//! one file per command or group of commands: `migrate`, `dispatch`,
//! `reconcile` (with the watermark topic's configuration and the round
//! export), `inspect` (`status`, `trace`, `report`), `runbook`
//! (`dead-letters`, `watermarks`, `gaps`, `findings`, `unknown`), `route`,
//! `rollout` (`takeover`, `alias`, `shadow`), `purge`,
//! `migrate_destination` and `skip`.

mod broker;
mod db;
mod dispatch;
mod dispatch_path;
mod inspect;
mod migrate;
mod migrate_destination;
mod print_config;
mod purge;
mod reconcile;
mod rollout;
mod route;
mod runbook;
mod service;
mod skip;

use anyhow::{bail, Context};

use crate::cli::{Cli, Command, LogFormat};
use crate::config::{self, FileConfig};

pub use db::{connect, mask_database_url, open, require_schema, sqlx_cause, DB_CONNECT_TIMEOUT_MS};
pub use reconcile::{WATERMARK_KEYS_ENV, WATERMARK_UNSIGNED_ENV};

/// Exit code: findings are open.
pub const EXIT_FINDINGS: u8 = 2;
/// Exit code: a destination migration (or a skip) was refused.
pub const EXIT_REFUSED: u8 = 3;
/// Exit code: interrupted twice.
pub const EXIT_INTERRUPTED: u8 = 130;

/// The log filter without `--log`, `RUST_LOG` or a file setting (PostgreSQL
/// notices such as "relation already exists, skipping" are sqlx info lines).
pub const DEFAULT_LOG: &str = "info,sqlx=warn";

/// Sets up logging on standard error: `--log` > `RUST_LOG` > file `log` > `info`;
/// `--log-format`/`OUTBOX_LOG_FORMAT` > file `log_format` > text.
pub fn init_logging(cli: &Cli, file: &FileConfig) -> anyhow::Result<()> {
    use tracing_subscriber::EnvFilter;
    let filter = cli.log.clone().or_else(|| std::env::var("RUST_LOG").ok()).or_else(|| file.log.clone()).unwrap_or_else(|| DEFAULT_LOG.into());
    let filter = EnvFilter::try_new(&filter).with_context(|| format!("log filter {filter:?}"))?;
    let format = match (cli.log_format, file.log_format.as_deref()) {
        (Some(f), _) => f,
        (None, Some("json")) => LogFormat::Json,
        (None, Some("text") | None) => LogFormat::Text,
        (None, Some(other)) => bail!("config file: log_format = {other:?} (text or json)"),
    };
    use std::io::IsTerminal as _;
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(false).init(),
        LogFormat::Text => builder.with_target(false).init(),
    }
    Ok(())
}

/// Runs the command; returns the exit code.
pub async fn run(cli: Cli, file: FileConfig) -> anyhow::Result<u8> {
    let url = || config::database_url(cli.database_url.as_deref(), &file);
    match &cli.command {
        Command::Migrate(a) => migrate::migrate(&url()?, a).await,
        Command::Dispatch(a) => dispatch::dispatch(&url, &file, a).await,
        Command::Reconcile(a) => reconcile::reconcile(&url, &file, a).await,
        Command::Status(a) => inspect::status(&url()?, &file, a).await,
        Command::Trace(a) => inspect::trace(&url()?, a).await,
        Command::Route(c) => route::route_cmd(&url()?, &file, c).await,
        Command::DeadLetters(c) => runbook::dead_letters(&url, c).await,
        Command::Watermarks(c) => runbook::watermarks(&url()?, c).await,
        Command::Gaps(c) => runbook::gaps(&url, c).await,
        Command::Findings(c) => runbook::findings(&url()?, c).await,
        Command::Unknown(c) => runbook::unknown(&url()?, c).await,
        Command::Report(a) => inspect::report(&url()?, &file, a).await,
        Command::Purge(a) => purge::purge_cmd(&url()?, &file, a).await,
        Command::MigrateDestination(a) => migrate_destination::migrate_destination_cmd(&url()?, &file, a).await,
        Command::Skip(a) => skip::skip_cmd(&url()?, a).await,
        Command::DispatchPath(a) => dispatch_path::dispatch_path_cmd(&url()?, a).await,
        Command::AggregateHeads(a) => dispatch_path::aggregate_heads_cmd(&url()?, a).await,
        Command::Takeover(c) => rollout::takeover_cmd(&url()?, c).await,
        Command::Alias(c) => rollout::alias_cmd(&url()?, c).await,
        Command::Shadow(a) => rollout::shadow_cmd(&url()?, &file, a).await,
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// `e` and its causes on one line, `: `-separated, each text once (sqlx and
/// librdkafka errors often repeat their source's message in their own).
pub fn render_error(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if text.is_empty() || out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_say_each_thing_once() {
        let inner = anyhow::anyhow!("database \"x\" does not exist");
        let e = inner.context("database \"x\" does not exist").context("connecting to PostgreSQL at h:5432/x");
        assert_eq!(render_error(&e), "connecting to PostgreSQL at h:5432/x: database \"x\" does not exist");
    }
}
