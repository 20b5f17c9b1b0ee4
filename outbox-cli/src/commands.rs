//! What each command does.

use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use outbox_core::{EventId, RetryPolicy, RoutePolicy};
use outbox_producer::kafka::{KafkaBroker, KafkaConfig};
use outbox_producer::report::{build_report, ReportOptions};
use outbox_producer::retention::{purge, RetentionPolicy};
use outbox_producer::rollout;
use outbox_producer::{Dispatcher, DispatcherConfig, MigrationOutcome, PgStore, Reconciler, ReconcilerConfig};
use prometheus::Registry;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection as _, PgPool};
use tokio::sync::watch;

use crate::cli::{
    AliasCommand, Cli, Command, DispatchArgs, KafkaArgs, LogFormat, MigrateArgs, MigrateDestinationArgs, PurgeArgs, ReconcileArgs, ReportArgs, ShadowArgs, Side,
    TakeoverCommand,
};
use crate::config::{self, DispatchFlags, FileConfig, KafkaFlags};
use crate::health::{Health, EXIT_PRODUCER_FATAL};
use crate::metrics::{self, DispatchExport, ReconcileExport};

/// Exit code: findings are open.
pub const EXIT_FINDINGS: u8 = 2;
/// Exit code: a destination migration was refused.
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
        Command::Migrate(a) => migrate(&url()?, a).await,
        Command::Dispatch(a) => dispatch(&url, &file, a).await,
        Command::Reconcile(a) => reconcile(&url, &file, a).await,
        Command::Status(a) => {
            let pool = open(&url()?, 2).await?;
            let stale = a.reconciler_stale_ms.or(file.report.reconciler_stale_ms).unwrap_or(outbox_producer::report::DEFAULT_RECONCILER_STALE_MS);
            let s = crate::status::status(&pool, stale).await.context("reading status (has `outbox migrate` run?)")?;
            if a.json {
                println!("{}", crate::fmt::json(&s)?);
            } else {
                print!("{}", s.to_text());
            }
            Ok(if a.fail_on_findings && s.findings_total() > 0 { EXIT_FINDINGS } else { 0 })
        }
        Command::Trace(a) => {
            let pool = open(&url()?, 2).await?;
            let id: EventId = a.event_id.parse().with_context(|| format!("{:?} is not an eventId (evt-<26 characters>)", a.event_id))?;
            let Some(mut t) = crate::trace::trace(&pool, id.as_str()).await? else { bail!("no outbox event {id}") };
            for u in &a.consumer_database_urls {
                let consumer_pool = connect(u, 1).await.context("--consumer-database-url")?;
                let source = describe_url(u);
                t.add_consumer_database(&consumer_pool, &source).await.with_context(|| format!("reading the consumer side in {source}"))?;
                consumer_pool.close().await;
            }
            if a.json {
                println!("{}", crate::fmt::json(&t)?);
            } else {
                print!("{}", t.to_text());
            }
            Ok(0)
        }
        Command::Route(c) => route_cmd(&url()?, &file, c).await,
        Command::DeadLetters(c) => {
            use crate::cli::DeadLettersCommand as D;
            let db = |over: &Option<String>| over.clone().map(Ok).unwrap_or_else(url);
            match c {
                D::List { consumer, limit, json, consumer_database_url } => {
                    let pool = connect(&db(consumer_database_url)?, 2).await?;
                    crate::runbook::dead_letters_list(&pool, consumer.as_deref(), *limit, *json).await
                }
                D::Show { event_id, json, consumer_database_url } => {
                    let pool = connect(&db(consumer_database_url)?, 2).await?;
                    crate::runbook::dead_letters_show(&pool, event_id, *json).await
                }
                D::Requeue { event_id, consumer, operator, consumer_database_url } => {
                    let pool = connect(&db(consumer_database_url)?, 2).await?;
                    crate::runbook::dead_letters_requeue(&pool, event_id, consumer, operator).await
                }
            }
        }
        Command::Gaps(c) => {
            use crate::cli::GapsCommand as G;
            let db = |over: &Option<String>| over.clone().map(Ok).unwrap_or_else(url);
            match c {
                G::List { consumer, all, limit, json, consumer_database_url } => {
                    let pool = connect(&db(consumer_database_url)?, 2).await?;
                    crate::runbook::gaps_list(&pool, consumer.as_deref(), *all, *limit, *json).await
                }
                G::Accept { consumer, cluster, topic, partition, detected_from, operator, reason, consumer_database_url } => {
                    let pool = connect(&db(consumer_database_url)?, 2).await?;
                    crate::runbook::gaps_accept(&pool, consumer, cluster, topic, *partition, *detected_from, operator, reason).await
                }
            }
        }
        Command::Findings(c) => {
            use crate::cli::FindingsCommand as F;
            let pool = connect(&url()?, 2).await?;
            match c {
                F::List { all, kind, limit, json } => crate::runbook::findings_list(&pool, *all, kind.as_deref(), *limit, *json).await,
                F::Ack { id, operator, note } => crate::runbook::findings_ack(&pool, *id, operator, note.as_deref()).await,
            }
        }
        Command::Unknown(c) => {
            use crate::cli::UnknownCommand as U;
            let pool = connect(&url()?, 2).await?;
            match c {
                U::List { limit, json } => crate::runbook::unknown_list(&pool, *limit, *json).await,
                U::Show { event_id, lookups, json } => crate::runbook::unknown_show(&pool, event_id, *lookups, *json).await,
            }
        }
        Command::Report(a) => report(&url()?, &file, a).await,
        Command::Purge(a) => purge_cmd(&url()?, &file, a).await,
        Command::MigrateDestination(a) => migrate_destination_cmd(&url()?, &file, a).await,
        Command::Takeover(c) => takeover_cmd(&url()?, c).await,
        Command::Alias(c) => alias_cmd(&url()?, c).await,
        Command::Shadow(a) => shadow_cmd(&url()?, &file, a).await,
    }
}

/// host:port/database of a PostgreSQL URL (no user or password), for messages.
fn describe_url(url: &str) -> String {
    match url.parse::<PgConnectOptions>() {
        Ok(o) => format!("{}:{}/{}", o.get_host(), o.get_port(), o.get_database().unwrap_or("")),
        Err(_) => "a consumer database".into(),
    }
}

async fn route_cmd(url: &str, file: &FileConfig, c: &crate::cli::RouteCommand) -> anyhow::Result<u8> {
    use crate::cli::RouteCommand as R;
    let pool = connect(url, 2).await?;
    let optional_kafka = |k: &KafkaArgs| {
        let flags = kafka_flags(k);
        if flags.bootstrap.is_none() && file.kafka.bootstrap.is_none() {
            Ok(None)
        } else {
            config::kafka_config(&flags, &file.kafka).map(Some)
        }
    };
    match c {
        R::Set(a) => {
            let broker = if a.no_check { None } else {
                match optional_kafka(&a.kafka)? {
                    Some(k) => Some(connect_kafka(k).await?),
                    None => bail!("checking the partition count needs a Kafka connection (--kafka-bootstrap or OUTBOX_KAFKA_BOOTSTRAP); or pass --no-check with --cluster-id"),
                }
            };
            crate::runbook::route_set(&pool, broker.as_deref(), a).await
        }
        R::Show { event_type, json, kafka } => {
            let broker = match optional_kafka(kafka)? {
                Some(k) => Some(connect_kafka(k).await?),
                None => None,
            };
            crate::runbook::route_show(&pool, broker.as_deref(), event_type, *json).await
        }
        R::List { json } => crate::runbook::route_list(&pool, *json).await,
    }
}

async fn takeover_cmd(url: &str, c: &TakeoverCommand) -> anyhow::Result<u8> {
    let pool = open(url, 2).await?;
    if let TakeoverCommand::Set { event_types, percent_bp } = c {
        let types: Vec<&str> = event_types.iter().map(String::as_str).collect();
        rollout::set_takeover(&pool, &types, *percent_bp).await?;
    }
    match rollout::current_takeover(&pool).await? {
        None => println!("takeover: none (the outbox sends every event)"),
        Some(p) => println!(
            "takeover generation {}: the outbox sends {} of event types [{}]; everything else stays with the legacy publisher",
            p.generation,
            format_args!("{}.{:02}%", p.percent_bp / 100, p.percent_bp % 100),
            p.event_types.join(", ")
        ),
    }
    Ok(0)
}

async fn alias_cmd(url: &str, c: &AliasCommand) -> anyhow::Result<u8> {
    let pool = open(url, 2).await?;
    if let AliasCommand::Switch { alias, implementation, protocol_version } = c {
        let before = rollout::current_alias(&pool, alias).await?;
        rollout::switch_alias(&pool, alias, implementation, *protocol_version).await?;
        println!("alias {alias}: {} -> {implementation}", before.map(|b| b.implementation).unwrap_or_else(|| "none".into()));
    }
    for a in rollout::aliases(&pool).await? {
        println!("{}\t{}\tprotocol {}\tswitched at {}", a.alias, a.implementation, a.protocol_version, crate::fmt::ts(a.switched_at_ms));
    }
    Ok(0)
}

async fn shadow_cmd(url: &str, file: &FileConfig, a: &ShadowArgs) -> anyhow::Result<u8> {
    let kafka = config::kafka_config(&kafka_flags(&a.kafka), &file.kafka)?;
    let pool = open(url, 2).await?;
    let broker = connect_kafka(kafka).await?;
    let store = PgStore::new(pool.clone());
    let shadow = rollout::ShadowDispatcher::new(store.clone());
    let mut built = 0;
    loop {
        let n = shadow.shadow_once(1_000).await?;
        built += n;
        if n == 0 {
            break;
        }
    }
    let r = rollout::compare_shadow(&store, &*broker, a.grace_ms.unwrap_or(60_000), a.max_messages.unwrap_or(100_000)).await?;
    println!(
        "shadow: {built} built, {} messages read, {} matched; new mismatches: {} missing, {} extra, {} different_bytes, {} different_partition",
        r.scanned_messages, r.matched, r.missing, r.extra, r.different_bytes, r.different_partition
    );
    let open = rollout::open_shadow_mismatches(&pool).await?;
    for (id, kind, detail) in &open {
        println!("{kind}\t{id}\t{detail}");
    }
    Ok(if open.is_empty() { 0 } else { EXIT_FINDINGS })
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

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

fn kafka_flags(a: &KafkaArgs) -> KafkaFlags {
    KafkaFlags {
        bootstrap: a.kafka_bootstrap.clone(),
        message_timeout_ms: a.kafka_message_timeout_ms,
        request_timeout_ms: a.kafka_request_timeout_ms,
        max_in_flight: a.kafka_max_in_flight,
        lookup_timeout_ms: a.kafka_lookup_timeout_ms,
        producer_stall_ms: a.kafka_producer_stall_ms,
        settings: a.kafka_settings.clone(),
        lookup_settings: a.kafka_lookup_settings.clone(),
        oidc_token_url: a.kafka_oidc_token_url.clone(),
        oidc_client_id: a.kafka_oidc_client_id.clone(),
        oidc_client_secret: a.kafka_oidc_client_secret.clone(),
        oidc_scope: a.kafka_oidc_scope.clone(),
    }
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

fn int(v: impl TryInto<i64>) -> toml::Value {
    toml::Value::Integer(v.try_into().unwrap_or(i64::MAX))
}

/// The `[kafka]` section of the effective configuration, secrets masked.
fn kafka_table(k: &KafkaConfig) -> toml::Table {
    use outbox_producer::kafka::redact_setting;
    let mut t = toml::Table::new();
    t.insert("bootstrap".into(), toml::Value::String(k.bootstrap_servers.clone()));
    for (name, v) in [
        ("message_timeout_ms", k.message_timeout_ms),
        ("request_timeout_ms", k.request_timeout_ms),
        ("max_in_flight", k.max_in_flight as u64),
        ("enqueue_timeout_ms", k.enqueue_timeout_ms),
        ("connect_timeout_ms", k.connect_timeout_ms),
        ("lookup_max_messages", k.lookup_max_messages),
        ("lookup_timeout_ms", k.lookup_timeout_ms),
        ("max_concurrent_lookups", k.max_concurrent_lookups as u64),
        ("producer_stall_ms", k.producer_stall_ms),
        ("probe_timeout_ms", k.probe_timeout_ms),
    ] {
        t.insert(name.into(), int(v));
    }
    let settings = |v: &[(String, String)]| {
        let mut s = toml::Table::new();
        for (key, value) in v {
            s.insert(key.clone(), toml::Value::String(redact_setting(key, value).to_owned()));
        }
        toml::Value::Table(s)
    };
    t.insert("settings".into(), settings(&k.extra));
    t.insert("lookup_settings".into(), settings(&k.lookup_extra));
    t
}

/// The effective configuration as a TOML document in the `--config` file's
/// format; every secret (database password, secret-bearing Kafka settings)
/// is `***`.
fn config_toml(database_url: Option<&str>, kafka: &KafkaConfig, metrics_addr: Option<&str>, section: (&str, toml::Table)) -> anyhow::Result<String> {
    let mut doc = toml::Table::new();
    if let Some(u) = database_url {
        doc.insert("database_url".into(), toml::Value::String(mask_database_url(u)));
    }
    doc.insert("kafka".into(), toml::Value::Table(kafka_table(kafka)));
    doc.insert(section.0.into(), toml::Value::Table(section.1));
    let mut m = toml::Table::new();
    if let Some(a) = metrics_addr {
        m.insert("addr".into(), toml::Value::String(a.to_owned()));
    }
    doc.insert("metrics".into(), toml::Value::Table(m));
    Ok(toml::to_string(&doc)?)
}

fn dispatch_table(c: &DispatcherConfig) -> toml::Table {
    let mut t = toml::Table::new();
    t.insert("name".into(), toml::Value::String(c.name.clone()));
    t.insert("workers".into(), int(c.workers as u64));
    t.insert("batch_size".into(), int(c.batch_size as u64));
    t.insert("lease_ms".into(), int(c.lease_ms));
    t.insert("poll_interval_ms".into(), int(c.poll_interval_ms));
    t.insert("sweep_interval_ms".into(), int(c.sweep_interval_ms));
    t.insert("head_scan_every".into(), int(c.head_scan_every));
    t.insert("shutdown_grace_ms".into(), int(c.shutdown_grace_ms));
    t.insert("record_retry_ms".into(), int(c.record_retry_ms));
    t.insert("listen".into(), toml::Value::Boolean(c.listen));
    if let Some(a) = &c.alias {
        t.insert("alias".into(), toml::Value::String(a.clone()));
    }
    t.insert("implementation".into(), toml::Value::String(c.implementation.clone()));
    if let Some(s) = &c.signing {
        // The key id only: the secret is never printed.
        let mut sig = toml::Table::new();
        sig.insert("key_id".into(), toml::Value::String(s.key_id.clone()));
        sig.insert("secret_hex".into(), toml::Value::String("***".into()));
        t.insert("signing".into(), toml::Value::Table(sig));
    }
    t
}

fn reconcile_table(c: &ReconcilerConfig, interval_ms: u64) -> toml::Table {
    let mut t = toml::Table::new();
    t.insert("interval_ms".into(), int(interval_ms));
    t.insert("owner".into(), toml::Value::String(c.owner.clone()));
    t.insert("batch_size".into(), int(c.batch_size as u64));
    t.insert("lease_ms".into(), int(c.lease_ms));
    t.insert("allow_retry".into(), toml::Value::Boolean(c.retry.allow_retry));
    t.insert("max_attempts".into(), int(c.retry.max_attempts));
    t.insert("in_flight_bound_ms".into(), int(c.retry.in_flight_bound_ms));
    t.insert("recheck_ms".into(), int(c.retry.recheck_ms));
    t.insert("aged_pending_ms".into(), int(c.aged_pending_ms));
    t.insert("unconsumed_after_ms".into(), int(c.unconsumed_after_ms));
    t.insert("unknown_slo_ms".into(), int(c.unknown_slo_ms));
    t.insert("bypass_scan_max_messages".into(), int(c.bypass_scan_max_messages));
    t.insert("max_findings_per_kind".into(), int(c.max_findings_per_kind));
    t.insert("history_keep_ms".into(), int(c.history_keep_ms));
    t.insert("declared_sources".into(), toml::Value::Array(c.declared_sources.iter().cloned().map(toml::Value::String).collect()));
    t
}

async fn connect_kafka(k: KafkaConfig) -> anyhow::Result<Arc<KafkaBroker>> {
    let bootstrap = k.bootstrap_servers.clone();
    let b = KafkaBroker::connect(k).await.with_context(|| format!("connecting to Kafka at {bootstrap}"))?;
    tracing::info!(cluster_id = b.cluster_id(), %bootstrap, "connected to Kafka");
    Ok(Arc::new(b))
}

/// Resolves on the first SIGINT or SIGTERM; a second one exits the process at once.
async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    let which = tokio::select! {
        _ = int.recv() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    };
    tokio::spawn(async move {
        tokio::select! {
            _ = int.recv() => {},
            _ = term.recv() => {},
        }
        eprintln!("outbox: second signal: exiting without draining");
        std::process::exit(EXIT_INTERRUPTED as i32);
    });
    which
}

async fn start_metrics(addr: &str, registry: Registry, refresh: Arc<dyn Fn() + Send + Sync>, health: Option<Arc<Health>>) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let routes: Option<metrics::Routes> = health.map(|h| Arc::new(move |path: &str| h.route(path)) as metrics::Routes);
    let (bound, handle) = metrics::serve_with_routes(addr, registry, refresh, routes).await?;
    tracing::info!(addr = %bound, "serving Prometheus metrics at /metrics, health at /healthz and /readyz");
    Ok(handle)
}

async fn migrate(url: &str, a: &MigrateArgs) -> anyhow::Result<u8> {
    let pool = connect(url, 2).await?;
    let applied = |pool: PgPool| async move {
        let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL").fetch_one(&pool).await?;
        if !exists {
            return Ok::<Vec<i64>, sqlx::Error>(Vec::new());
        }
        sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success ORDER BY version").fetch_all(&pool).await
    };
    let before = applied(pool.clone()).await?;
    if a.only != Some(Side::Consumer) {
        outbox_producer::migrate_with_source(&pool, a.source.as_deref()).await.context("producer migrations")?;
    }
    if a.only != Some(Side::Producer) {
        outbox_consumer::migrate(&pool).await.context("consumer migrations")?;
    }
    let after = applied(pool.clone()).await?;
    let sides = [(Side::Producer, "producer", &outbox_producer::MIGRATOR), (Side::Consumer, "consumer", &outbox_consumer::MIGRATOR)];
    for (side, name, migrator) in sides {
        if a.only.is_some_and(|only| only != side) {
            continue;
        }
        let new: Vec<String> =
            migrator.iter().filter(|m| after.contains(&m.version) && !before.contains(&m.version)).map(|m| format!("{} {}", m.version, m.description)).collect();
        if new.is_empty() {
            println!("{name} schema: up to date");
        } else {
            println!("{name} schema: applied {} migration(s): {}", new.len(), new.join(", "));
        }
    }
    outbox_producer::check_protocol(&pool).await.ok();
    Ok(0)
}

async fn dispatch(url: &dyn Fn() -> anyhow::Result<String>, file: &FileConfig, a: &DispatchArgs) -> anyhow::Result<u8> {
    let flags = DispatchFlags {
        name: a.name.clone(),
        workers: a.workers,
        batch_size: a.batch_size,
        lease_ms: a.lease_ms,
        poll_interval_ms: a.poll_interval_ms,
        sweep_interval_ms: a.sweep_interval_ms,
        head_scan_every: a.head_scan_every,
        shutdown_grace_ms: a.shutdown_grace_ms,
        record_retry_ms: a.record_retry_ms,
        no_listen: a.no_listen,
    };
    let cfg: DispatcherConfig = config::dispatcher_config(&flags, file)?;
    let kafka = config::kafka_config(&kafka_flags(&a.kafka), &file.kafka)?;
    let metrics_addr = a.metrics_addr.clone().or_else(|| file.metrics.addr.clone());
    if a.print_config {
        print!("{}", config_toml(url().ok().as_deref(), &kafka, metrics_addr.as_deref(), ("dispatch", dispatch_table(&cfg)))?);
        return Ok(0);
    }
    let pool = connect(&url()?, cfg.workers as u32 * 2 + 4).await?;
    require_schema(&pool).await?;
    let broker = connect_kafka(kafka).await?;
    let gate = broker.clone();
    let dispatcher = Arc::new(Dispatcher::new(PgStore::new(pool.clone()), broker.clone(), cfg.clone())?.with_claim_gate(Arc::new(move || gate.ready())));
    let (stop_tx, stop_rx) = watch::channel(false);
    let stop_tx = Arc::new(stop_tx);
    let progress = dispatcher.metrics();
    // A worker claims at least every poll interval and renews a long batch's
    // leases every half lease; recording its answers may take record_retry_ms.
    let max_silence_ms = (cfg.lease_ms.max(0) as u64) * 2 + cfg.record_retry_ms + cfg.poll_interval_ms;
    let health = Arc::new(Health::new("dispatch", pool.clone(), broker.clone(), Arc::new(move || progress.last_progress_ms.load(std::sync::atomic::Ordering::Relaxed)), max_silence_ms));
    let fatal = supervise(&health, a.exit_on_fatal, stop_tx.clone());
    let _metrics = match &metrics_addr {
        Some(addr) => {
            let registry = Registry::new();
            metrics::build_info(&registry, "dispatch");
            let b = broker.clone();
            let export = DispatchExport::register(&registry, dispatcher.metrics(), Some(Arc::new(move || b.in_flight())));
            Some(start_metrics(addr, registry, Arc::new(move || export.refresh()), Some(health.clone())).await?)
        }
        None => None,
    };
    tracing::info!(name = %cfg.name, workers = cfg.workers, batch_size = cfg.batch_size, lease_ms = cfg.lease_ms, cluster_id = broker.cluster_id(), "dispatcher running");
    {
        let stop_tx = stop_tx.clone();
        tokio::spawn(async move {
            let which = shutdown_signal().await;
            tracing::info!(signal = which, "stopping: no new claims, draining outstanding answers (a second signal exits at once)");
            let _ = stop_tx.send(true);
        });
    }
    let totals = dispatcher.clone().run(outbox_producer::until_true(stop_rx)).await?;
    let _ = broker.flush(5_000).await;
    tracing::info!(
        claimed = totals.claimed,
        sent = totals.sent,
        published = totals.published,
        duplicates = totals.duplicates,
        unknown = totals.unknown,
        not_sent = totals.not_sent,
        quarantined = totals.quarantined,
        fenced = totals.fenced,
        "dispatcher stopped"
    );
    pool.close().await;
    if let Some(cause) = fatal.lock().unwrap_or_else(|p| p.into_inner()).clone() {
        tracing::error!(cause = %cause, exit_code = EXIT_PRODUCER_FATAL, "exiting: the Kafka producer could not deliver (--exit-on-fatal)");
        return Ok(EXIT_PRODUCER_FATAL);
    }
    Ok(0)
}

/// Starts the health loop; with `exit_on_fatal`, a producer that cannot
/// deliver stops the service (its cause is kept for the exit).
fn supervise(health: &Arc<Health>, exit_on_fatal: bool, stop: Arc<watch::Sender<bool>>) -> Arc<std::sync::Mutex<Option<String>>> {
    let fatal: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
    let keep = fatal.clone();
    health.clone().spawn(exit_on_fatal, move |cause| {
        tracing::error!(cause = %cause, "the Kafka producer cannot deliver: stopping (--exit-on-fatal)");
        *keep.lock().unwrap_or_else(|p| p.into_inner()) = Some(cause);
        let _ = stop.send(true);
    });
    fatal
}

fn reconciler_config(a: &ReconcileArgs, file: &FileConfig) -> ReconcilerConfig {
    let f = &file.reconcile;
    let mut c = ReconcilerConfig::default();
    let retry_default = RetryPolicy::default();
    if let Some(v) = a.owner.clone().or(f.owner.clone()) {
        c.owner = v;
    }
    c.batch_size = a.batch_size.or(f.batch_size).unwrap_or(c.batch_size);
    c.lease_ms = a.lease_ms.or(f.lease_ms).unwrap_or(c.lease_ms);
    c.retry = RetryPolicy {
        allow_retry: if a.no_retry { false } else { f.allow_retry.unwrap_or(retry_default.allow_retry) },
        max_attempts: a.max_attempts.or(f.max_attempts).unwrap_or(retry_default.max_attempts),
        in_flight_bound_ms: a.in_flight_bound_ms.or(f.in_flight_bound_ms).unwrap_or(retry_default.in_flight_bound_ms),
        recheck_ms: a.recheck_ms.or(f.recheck_ms).unwrap_or(retry_default.recheck_ms),
    };
    c.aged_pending_ms = a.aged_pending_ms.or(f.aged_pending_ms).unwrap_or(c.aged_pending_ms);
    c.unconsumed_after_ms = a.unconsumed_after_ms.or(f.unconsumed_after_ms).unwrap_or(c.unconsumed_after_ms);
    c.unknown_slo_ms = a.unknown_slo_ms.or(f.unknown_slo_ms).unwrap_or(c.unknown_slo_ms);
    c.bypass_scan_max_messages = a.bypass_scan_max_messages.or(f.bypass_scan_max_messages).unwrap_or(c.bypass_scan_max_messages);
    c.stale_watermark_after_ms = a.stale_watermark_after_ms.or(f.stale_watermark_after_ms).unwrap_or(c.stale_watermark_after_ms);
    c.max_findings_per_kind = f.max_findings_per_kind.unwrap_or(c.max_findings_per_kind);
    c.history_keep_ms = f.history_keep_ms.unwrap_or(c.history_keep_ms);
    c.compare_every_rounds = f.compare_every_rounds.unwrap_or(c.compare_every_rounds);
    let flag_sources: Vec<String> = a.declared_sources.iter().map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()).collect();
    c.declared_sources = if flag_sources.is_empty() { f.declared_sources.clone().unwrap_or_default() } else { flag_sources };
    c
}

/// Environment variable of the watermark records' verification keys
/// (space-separated `CONSUMER_ID=KEY_ID=HEX`); it replaces the file's `watermark_keys`.
pub const WATERMARK_KEYS_ENV: &str = "OUTBOX_RECONCILE_WATERMARK_KEYS";
/// Environment variable of `--watermark-unsigned` (comma-separated consumer
/// ids); flag or variable replace the file's `watermark_unsigned`.
pub const WATERMARK_UNSIGNED_ENV: &str = "OUTBOX_RECONCILE_WATERMARK_UNSIGNED";

/// The watermark topic the reconciler reads, unless turned off.
fn watermark_topic_config(a: &ReconcileArgs, file: &FileConfig, kafka: &KafkaConfig) -> anyhow::Result<Option<outbox_producer::WatermarkTopicConfig>> {
    if a.no_watermark_topic {
        return Ok(None);
    }
    let topic = a.watermark_topic.clone().or(file.reconcile.watermark_topic.clone()).unwrap_or_else(|| outbox_producer::watermark_topic::DEFAULT_TOPIC.to_owned());
    if topic.trim().is_empty() {
        return Ok(None);
    }
    let mut c = outbox_producer::WatermarkTopicConfig::new(kafka.bootstrap_servers.clone());
    c.topic = topic.trim().to_owned();
    for (k, v) in &kafka.extra {
        if outbox_consumer::SHARED_KAFKA_PROPERTY_PREFIXES.iter().any(|p| k.starts_with(p)) {
            c.kafka.insert(k.clone(), v.clone());
        }
    }
    c.verify_keys = match std::env::var(WATERMARK_KEYS_ENV).ok().filter(|v| !v.trim().is_empty()) {
        Some(text) => outbox_producer::WatermarkTopicConfig::parse_keys(WATERMARK_KEYS_ENV, text.split_whitespace())?,
        None => outbox_producer::WatermarkTopicConfig::parse_keys("[reconcile] watermark_keys", file.reconcile.watermark_keys.iter().flatten().map(String::as_str))?,
    };
    c.allow_unsigned = if a.watermark_unsigned.iter().any(|s| !s.trim().is_empty()) {
        outbox_producer::WatermarkTopicConfig::parse_unsigned(&format!("--watermark-unsigned ({WATERMARK_UNSIGNED_ENV})"), a.watermark_unsigned.iter().map(String::as_str))?
    } else {
        outbox_producer::WatermarkTopicConfig::parse_unsigned("[reconcile] watermark_unsigned", file.reconcile.watermark_unsigned.iter().flatten().map(String::as_str))?
    };
    c.validate()?;
    Ok(Some(c))
}

/// `watermark_keys` as --print-config shows them: consumer and key id, the secret `***`.
fn watermark_keys_value(c: &outbox_producer::WatermarkTopicConfig) -> toml::Value {
    toml::Value::Array(c.verify_keys.iter().flat_map(|(consumer, keys)| keys.iter().map(move |k| toml::Value::String(format!("{consumer}={}=***", k.key_id())))).collect())
}

async fn reconcile(url: &dyn Fn() -> anyhow::Result<String>, file: &FileConfig, a: &ReconcileArgs) -> anyhow::Result<u8> {
    let mut cfg = reconciler_config(a, file);
    let interval_ms = a.interval_ms.or(file.reconcile.interval_ms).unwrap_or(10_000).max(100);
    cfg.interval_ms = interval_ms;
    let kafka = config::kafka_config(&kafka_flags(&a.kafka), &file.kafka)?;
    let metrics_addr = a.metrics_addr.clone().or_else(|| file.metrics.addr.clone());
    let watermark_cfg = watermark_topic_config(a, file, &kafka)?;
    if a.print_config {
        let mut table = reconcile_table(&cfg, interval_ms);
        table.insert("watermark_topic".into(), toml::Value::String(watermark_cfg.as_ref().map(|w| w.topic.clone()).unwrap_or_else(|| "off".into())));
        if let Some(w) = &watermark_cfg {
            table.insert("watermark_keys".into(), watermark_keys_value(w));
            table.insert("watermark_unsigned".into(), toml::Value::Array(w.allow_unsigned.iter().cloned().map(toml::Value::String).collect()));
        }
        print!("{}", config_toml(url().ok().as_deref(), &kafka, metrics_addr.as_deref(), ("reconcile", table))?);
        return Ok(0);
    }
    let pool = connect(&url()?, 6).await?;
    require_schema(&pool).await?;
    let broker = connect_kafka(kafka).await?;
    let reconciler = Reconciler::new(PgStore::new(pool.clone()), broker.clone(), cfg.clone())?;
    let watermarks = match watermark_cfg {
        None => None,
        Some(wc) => match outbox_producer::WatermarkTopicReader::connect(pool.clone(), wc).await {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!(error = %e, "not reading the watermark topic");
                None
            }
        },
    };
    if a.once {
        let ingested = match &watermarks {
            None => None,
            Some(r) => match r.ingest_once().await {
                Ok(rep) => Some(rep),
                Err(e) => {
                    tracing::warn!(error = %e, "watermark topic round failed");
                    None
                }
            },
        };
        let (resolved, compared) = reconciler.run_once().await?;
        let report = reconciler.report().await?;
        if a.json {
            println!("{}", crate::fmt::json(&serde_json::json!({
                "resolved": { "examined": resolved.examined, "published": resolved.published, "quarantined": resolved.quarantined, "retried": resolved.retried, "rechecks": resolved.rechecks },
                "compared": { "agedPending": compared.aged_pending, "unconsumedPublished": compared.unconsumed_published, "bypassPublish": compared.bypass_publish,
                              "unknownPastSlo": compared.unknown_past_slo, "quarantined": compared.quarantined, "scannedMessages": compared.scanned_messages,
                              "bypassSubmitted": compared.bypass_submitted,
                              "foreignSource": compared.foreign_source, "unrecordedCopy": compared.unrecorded_copy, "divergentCopy": compared.divergent_copy, "partitionCountChanged": compared.partition_count_changed },
                "watermarkTopic": ingested.map(|w| serde_json::json!({
                    "read": w.read, "applied": w.applied, "outOfDate": w.out_of_date, "undeclared": w.undeclared,
                    "movedBack": w.moved_back, "beyondEnd": w.beyond_end, "rejected": w.rejected, "badSignature": w.bad_signature, "noKey": w.no_key })),
                "report": report,
            }))?);
        } else {
            if let Some(w) = ingested {
                println!(
                    "watermark topic: read {} records, applied {}, out of date {}; ignored with a finding: undeclared {}, moved back {}, beyond end {}, rejected {} (signature check {}, no key {})",
                    w.read, w.applied, w.out_of_date, w.undeclared, w.moved_back, w.beyond_end, w.rejected, w.bad_signature, w.no_key
                );
            }
            println!(
                "round: examined {} UNKNOWN (published {}, quarantined {}, retried {}, recheck {}); bypass check read {} messages, handed {} copies to the receipt transaction",
                resolved.examined, resolved.published, resolved.quarantined, resolved.retried, resolved.rechecks, compared.scanned_messages, compared.bypass_submitted
            );
            print!("{}", report.to_text());
        }
        return Ok(if a.fail_on_findings && !report.findings.is_empty() { EXIT_FINDINGS } else { 0 });
    }

    let registry = Registry::new();
    metrics::build_info(&registry, "reconcile");
    let export = ReconcileExport::register(&registry);
    let last_round: Arc<std::sync::atomic::AtomicI64> = Arc::default();
    let progress = last_round.clone();
    // A round may take its lease (its claims) and then some lookups.
    let max_silence_ms = interval_ms * 3 + (cfg.lease_ms.max(0) as u64) * 2;
    let health = Arc::new(Health::new("reconcile", pool.clone(), broker.clone(), Arc::new(move || progress.load(std::sync::atomic::Ordering::Relaxed)), max_silence_ms));
    let (fatal_tx, mut fatal_rx) = watch::channel(false);
    let fatal = supervise(&health, a.exit_on_fatal, Arc::new(fatal_tx));
    let _metrics = match &metrics_addr {
        Some(addr) => Some(start_metrics(addr, registry.clone(), Arc::new(|| {}), Some(health.clone())).await?),
        None => None,
    };
    tracing::info!(owner = %cfg.owner, interval_ms, unknown_slo_ms = cfg.unknown_slo_ms, "reconciler running");
    // Two services until a signal or a fatal producer error stops both: the
    // reconciler's own loop (Reconciler::run_observed, the loop the
    // simulator runs) and the watermark-topic reader beside it.
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopper = async {
        tokio::select! {
            which = shutdown_signal() => tracing::info!(signal = which, "reconciler stopping (a round in progress is abandoned; its claims expire with their lease)"),
            _ = fatal_rx.changed() => {}
        }
        let _ = stop_tx.send(true);
    };
    let watermark_reader = async {
        if let Some(reader) = &watermarks {
            reader
                .run(outbox_producer::until_true(stop_rx.clone()), Duration::from_millis(interval_ms), |r| {
                    if let Ok(w) = r {
                        export.watermarks(w);
                    }
                })
                .await;
        }
    };
    let observer = RoundExport { export: &export, reconciler: &reconciler, pool: &pool, last_round: &last_round };
    let rounds = reconciler.run_observed(outbox_producer::until_true(stop_rx.clone()), &observer);
    let ((), (), rounds) = tokio::join!(stopper, watermark_reader, rounds);
    tracing::info!(rounds = rounds.unwrap_or(0), "reconciler stopped");
    pool.close().await;
    if let Some(cause) = fatal.lock().unwrap_or_else(|p| p.into_inner()).clone() {
        tracing::error!(cause = %cause, exit_code = EXIT_PRODUCER_FATAL, "exiting: the Kafka producer could not deliver (--exit-on-fatal)");
        return Ok(EXIT_PRODUCER_FATAL);
    }
    Ok(0)
}

/// What `outbox reconcile` does after each round of the reconciler: the
/// round's metrics, the report's gauges, and the progress readiness checks.
struct RoundExport<'a> {
    export: &'a ReconcileExport,
    reconciler: &'a Reconciler<KafkaBroker, PgStore>,
    pool: &'a PgPool,
    last_round: &'a std::sync::atomic::AtomicI64,
}

#[async_trait::async_trait]
impl outbox_producer::RoundObserver for RoundExport<'_> {
    async fn round_done(&self, _round: u64, result: Result<&(outbox_producer::ResolveReport, outbox_producer::CompareReport), &outbox_producer::ProducerError>, took: Duration) {
        let Ok((resolved, compared)) = result else {
            self.export.round_failed();
            return;
        };
        self.last_round.store(now_ms(), std::sync::atomic::Ordering::Relaxed);
        // The report's gauges are read before the round is counted: a scrape
        // that sees the round sees its report.
        let report = self.reconciler.report().await;
        let unknown = crate::status::unknown_open(self.pool, now_ms()).await;
        self.export.round(resolved, compared, took);
        match (report, unknown) {
            (Ok(report), Ok((_, oldest_unknown))) => {
                self.export.report(&report, oldest_unknown);
                tracing::info!(findings = report.findings.len(), unknown_open = report.unknown_open, slo_met = report.unknown_slo_met(), "reconcile report");
            }
            (Err(e), _) => tracing::warn!(error = %e, "could not read the report after the round; its gauges keep their last values"),
            (_, Err(e)) => tracing::warn!(error = %e, "could not read the open UNKNOWNs after the round; the gauge keeps its last value"),
        }
    }
}

async fn report(url: &str, file: &FileConfig, a: &ReportArgs) -> anyhow::Result<u8> {
    let pool = open(url, 2).await?;
    let mut opts = ReportOptions::at(now_ms());
    let f = &file.report;
    opts.unknown_slo_ms = a.unknown_slo_ms.or(f.unknown_slo_ms).or(file.reconcile.unknown_slo_ms).unwrap_or(opts.unknown_slo_ms);
    opts.max_findings = a.max_findings.or(f.max_findings).unwrap_or(opts.max_findings);
    opts.max_history = a.max_history.or(f.max_history).unwrap_or(opts.max_history);
    // One SLO: the reconciler's (recorded with its rounds) unless given here.
    opts.use_reconciler_slo = a.unknown_slo_ms.is_none() && f.unknown_slo_ms.is_none();
    opts.reconciler_stale_ms = a.reconciler_stale_ms.or(f.reconciler_stale_ms).unwrap_or(opts.reconciler_stale_ms);
    let report = build_report(&pool, &opts).await.context("building the report (has `outbox migrate` run?)")?;
    if a.json {
        println!("{}", crate::fmt::json(&report)?);
    } else {
        print!("{}", report.to_text());
    }
    if let Some(path) = &a.html {
        std::fs::write(path, crate::html::render(&report)).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote HTML report to {}", path.display());
    }
    Ok(if a.fail_on_findings && !report.findings.is_empty() { EXIT_FINDINGS } else { 0 })
}

async fn purge_cmd(url: &str, file: &FileConfig, a: &PurgeArgs) -> anyhow::Result<u8> {
    let pool = open(url, 2).await?;
    let d = RetentionPolicy::default();
    let f = &file.retention;
    let policy = RetentionPolicy {
        replay_window_ms: a.replay_window_ms.or(f.replay_window_ms).unwrap_or(d.replay_window_ms),
        batch_size: a.batch_size.or(f.batch_size).unwrap_or(d.batch_size),
        max_batches: a.max_batches.or(f.max_batches).unwrap_or(d.max_batches),
    };
    let dry_run = !a.execute;
    if dry_run {
        println!("dry run: nothing is written (pass --execute to apply); replay window {}", crate::fmt::age(policy.replay_window_ms));
    } else {
        println!(
            "purging: replay window {}, batches of {} rows, at most {} batches per phase",
            crate::fmt::age(policy.replay_window_ms),
            policy.batch_size,
            policy.max_batches
        );
    }
    let started = std::time::Instant::now();
    let result = purge(&pool, now_ms(), &policy, dry_run, |r| {
        if !r.dry_run {
            println!("  batch {:>4}: {} retained, {} purged so far ({:.1} s)", r.batches, r.retained, r.purged, started.elapsed().as_secs_f64());
            let _ = std::io::stdout().flush();
        }
    })
    .await?;
    let verb = if dry_run { "would be" } else { "were" };
    println!("{} event(s) {verb} retained (PUBLISHED -> RETAINED)", result.retained);
    println!("{} event(s) {verb} purged (payload deleted; tombstone, digests and receipt kept)", result.purged);
    println!("{} event(s) past the replay window held back by a mandatory consumer's watermark", result.held_by_consumers);
    Ok(0)
}

async fn migrate_destination_cmd(url: &str, file: &FileConfig, a: &MigrateDestinationArgs) -> anyhow::Result<u8> {
    let id: EventId = a.event_id.parse().with_context(|| format!("{:?} is not an eventId", a.event_id))?;
    let pool = open(url, 4).await?;
    let row: Option<(String, String, String, String, String)> = sqlx::query_as(
        "SELECT e.event_type, e.state, e.tenant, e.aggregate_type, e.aggregate_id FROM outbox_events e WHERE e.event_id = $1",
    )
    .bind(id.as_str())
    .fetch_optional(&pool)
    .await?;
    let Some((event_type, state, tenant, aggregate_type, aggregate_id)) = row else { bail!("no outbox event {id}") };
    let current = outbox_producer::routes::current(&pool, &event_type).await?;
    let explicit = a.to_cluster.is_some() || a.to_topic.is_some() || a.to_partitions.is_some();
    let route: RoutePolicy = match (current, explicit) {
        (Some(mut r), true) => {
            // The current route's topic id names its own topic on its own
            // cluster: another topic or cluster has another id (or none
            // recorded), so the destination names none (destination.v1)
            // rather than one a send would be refused for.
            if a.to_cluster.as_ref().is_some_and(|c| *c != r.cluster_id) || a.to_topic.as_ref().is_some_and(|t| *t != r.topic) {
                r.topic_id = None;
            }
            if let Some(c) = &a.to_cluster {
                r.cluster_id = c.clone();
            }
            if let Some(t) = &a.to_topic {
                r.topic = t.clone();
            }
            if let Some(p) = a.to_partitions {
                r.partitions = p;
            }
            r
        }
        (Some(r), false) => r,
        (None, true) => match (&a.to_cluster, &a.to_topic, a.to_partitions) {
            (Some(c), Some(t), Some(p)) => RoutePolicy::new(&event_type, c, t, p),
            _ => bail!("no route policy for {event_type}: pass all of --to-cluster, --to-topic and --to-partitions"),
        },
        (None, false) => bail!("no route policy for {event_type}: pass --to-cluster, --to-topic and --to-partitions"),
    };
    let destination = route.resolve(&tenant, &aggregate_type, &aggregate_id)?;
    println!(
        "event {id} ({state}) -> {}/{} partition {} of {} key {} (route {}@{}, destination {})",
        destination.cluster_id,
        destination.topic,
        destination.partition,
        destination.partitions,
        destination.routing_key,
        route.event_type,
        route.generation,
        destination.digest()
    );
    let kafka = config::kafka_config(&kafka_flags(&a.kafka), &file.kafka)?;
    let broker = connect_kafka(kafka).await?;
    let retry = RetryPolicy { in_flight_bound_ms: a.in_flight_bound_ms.unwrap_or(RetryPolicy::default().in_flight_bound_ms), ..RetryPolicy::default() };
    let store = PgStore::new(pool.clone());
    // A dry run runs the same eligibility check (reads, lookup, decision
    // under the row lock) and changes nothing.
    match outbox_producer::migration::migrate_destination_with(&store, broker.as_ref(), &id, &route, &a.operator, &retry, a.dry_run).await? {
        MigrationOutcome::WouldMigrate { from_generation, to_destination_digest, proof } => {
            println!("dry run: nothing changed; it would migrate envelope generation {from_generation} -> {}, destination {to_destination_digest}, proof {proof}", from_generation + 1);
            Ok(0)
        }
        MigrationOutcome::Migrated { from_generation, to_generation, to_destination_digest } => {
            println!("migrated: envelope generation {from_generation} -> {to_generation}, destination {to_destination_digest}; the event is PENDING for its new destination");
            Ok(0)
        }
        MigrationOutcome::Refused { reason } => {
            println!("refused: {reason}; nothing changed");
            Ok(EXIT_REFUSED)
        }
    }
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

    #[test]
    fn database_passwords_are_masked() {
        assert_eq!(mask_database_url("postgres://u:Pw_1@h:5432/db"), "postgres://u:***@h:5432/db");
        assert_eq!(mask_database_url("postgres://u@h/db?sslmode=require&password=Pw_2"), "postgres://u@h/db?sslmode=require&password=***");
        assert_eq!(mask_database_url("postgres://h/db"), "postgres://h/db");
    }
}
