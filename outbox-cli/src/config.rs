//! The configuration file and how it merges with the environment and flags.
//!
//! Precedence, highest first: command-line flag, environment variable, the
//! TOML file (`--config FILE` or `OUTBOX_CONFIG`), built-in default.
//!
//! ```toml
//! database_url = "postgres://outbox_dispatcher@db:5432/app"
//! log_format = "json"          # or "text"
//! log = "info"                 # tracing filter
//!
//! [kafka]
//! bootstrap = "kafka-1:9092,kafka-2:9092"
//! message_timeout_ms = 30000
//! settings = { "security.protocol" = "SASL_SSL" }
//!
//! [dispatch]                   # outbox_producer::DispatcherConfig
//! workers = 4
//! batch_size = 500
//!
//! [dispatch.signing]           # optional: HMAC-SHA256 of every message's claims
//! key_id = "k-2026-12"         # (--print-config shows the key id, never the secret)
//! secret_hex = "…"             # or OUTBOX_DISPATCH_SIGNING_KEY_ID / _SECRET_HEX
//!
//! [reconcile]
//! interval_ms = 10000
//! compare_every_rounds = 1     # compare the three sets every N rounds
//! unknown_slo_ms = 900000
//! declared_sources = []        # other outboxes writing these topics too
//! # Verification keys of consumers' watermark records, CONSUMER_ID=KEY_ID=HEX
//! # (or OUTBOX_RECONCILE_WATERMARK_KEYS, space-separated; --print-config masks the secrets)
//! watermark_keys = ["shipping=wm-2026-12=…"]
//! # Consumers whose watermark records are applied unsigned (explicit opt-out;
//! # or --watermark-unsigned / OUTBOX_RECONCILE_WATERMARK_UNSIGNED, which replace it).
//! # Any other declared consumer without a key has its records refused.
//! watermark_unsigned = []
//!
//! [retention]
//! replay_window_ms = 604800000
//!
//! [report]
//! max_findings = 1000
//!
//! [metrics]
//! addr = "0.0.0.0:9187"
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context};
use outbox_producer::kafka::KafkaConfig;
use outbox_producer::DispatcherConfig;
use serde::Deserialize;

/// The whole file; every section optional, unknown keys refused.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FileConfig {
    /// PostgreSQL URL of the outbox database.
    pub database_url: Option<String>,
    /// `text` or `json`.
    pub log_format: Option<String>,
    /// tracing filter, e.g. `info,outbox_producer=debug`.
    pub log: Option<String>,
    /// Kafka adapter.
    pub kafka: KafkaSection,
    /// The dispatcher (all of `DispatcherConfig`'s fields).
    pub dispatch: Option<DispatcherConfig>,
    /// The reconciler.
    pub reconcile: ReconcileSection,
    /// Retention (purge).
    pub retention: RetentionSection,
    /// The report.
    pub report: ReportSection,
    /// The metrics endpoint.
    pub metrics: MetricsSection,
}

/// `[kafka]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KafkaSection {
    /// `bootstrap.servers`.
    pub bootstrap: Option<String>,
    /// See `KafkaConfig::message_timeout_ms`.
    pub message_timeout_ms: Option<u64>,
    /// See `KafkaConfig::request_timeout_ms`.
    pub request_timeout_ms: Option<u64>,
    /// See `KafkaConfig::max_in_flight`.
    pub max_in_flight: Option<usize>,
    /// See `KafkaConfig::enqueue_timeout_ms`.
    pub enqueue_timeout_ms: Option<u64>,
    /// See `KafkaConfig::connect_timeout_ms`.
    pub connect_timeout_ms: Option<u64>,
    /// See `KafkaConfig::lookup_max_messages`.
    pub lookup_max_messages: Option<u64>,
    /// See `KafkaConfig::lookup_timeout_ms`.
    pub lookup_timeout_ms: Option<u64>,
    /// See `KafkaConfig::max_concurrent_lookups`.
    pub max_concurrent_lookups: Option<usize>,
    /// See `KafkaConfig::producer_stall_ms`.
    pub producer_stall_ms: Option<u64>,
    /// See `KafkaConfig::probe_timeout_ms`.
    pub probe_timeout_ms: Option<u64>,
    /// Raw librdkafka settings of the producer (security, client.id...);
    /// connection settings also go to the lookup consumers.
    pub settings: BTreeMap<String, String>,
    /// Raw librdkafka settings of the lookup consumers only.
    pub lookup_settings: BTreeMap<String, String>,
    /// OIDC client credentials for SASL/OAUTHBEARER: the token endpoint.
    pub oidc_token_url: Option<String>,
    /// OIDC client id.
    pub oidc_client_id: Option<String>,
    /// OIDC client secret.
    pub oidc_client_secret: Option<String>,
    /// OIDC scope.
    pub oidc_scope: Option<String>,
}

/// `[reconcile]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReconcileSection {
    /// Pause between rounds, ms.
    pub interval_ms: Option<u64>,
    /// Compare the three sets every this many rounds (1: every round).
    pub compare_every_rounds: Option<u32>,
    /// Claim owner name.
    pub owner: Option<String>,
    /// UNKNOWN events per round.
    pub batch_size: Option<usize>,
    /// RECONCILING lease, ms.
    pub lease_ms: Option<i64>,
    /// Whether a proven-absent event may be re-sent to its frozen destination.
    pub allow_retry: Option<bool>,
    /// Most attempts per event.
    pub max_attempts: Option<u32>,
    /// How long an attempt may still be in flight inside the client, ms.
    pub in_flight_bound_ms: Option<i64>,
    /// Delay before an unresolved UNKNOWN is looked at again, ms.
    pub recheck_ms: Option<i64>,
    /// PENDING older than this is a finding, ms.
    pub aged_pending_ms: Option<i64>,
    /// PUBLISHED not consumed by a critical consumer after this long is a finding, ms.
    pub unconsumed_after_ms: Option<i64>,
    /// UNKNOWN older than this is a finding, ms.
    pub unknown_slo_ms: Option<i64>,
    /// Most messages the bypass check reads per partition per round.
    pub bypass_scan_max_messages: Option<u64>,
    /// The watermark topic read each round (`""`: none).
    pub watermark_topic: Option<String>,
    /// A declared consumer whose watermark records stopped arriving this long ago is a finding, ms.
    pub stale_watermark_after_ms: Option<i64>,
    /// Verification keys of watermark records, `CONSUMER_ID=KEY_ID=HEX` each
    /// (`OUTBOX_RECONCILE_WATERMARK_KEYS` replaces them).
    pub watermark_keys: Option<Vec<String>>,
    /// Consumers whose watermark records are applied unsigned (explicit
    /// opt-out; `--watermark-unsigned` / `OUTBOX_RECONCILE_WATERMARK_UNSIGNED`
    /// replace them).
    pub watermark_unsigned: Option<Vec<String>>,
    /// Most findings of one kind recorded per round.
    pub max_findings_per_kind: Option<i64>,
    /// State snapshots kept, ms.
    pub history_keep_ms: Option<i64>,
    /// Source identities of other outboxes declared to write these topics.
    pub declared_sources: Option<Vec<String>>,
}

/// `[retention]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetentionSection {
    /// Maximum replay window, ms.
    pub replay_window_ms: Option<i64>,
    /// Rows per statement.
    pub batch_size: Option<i64>,
    /// Most batches per run.
    pub max_batches: Option<u32>,
}

/// `[report]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReportSection {
    /// UNKNOWN SLO, ms.
    pub unknown_slo_ms: Option<i64>,
    /// Most findings listed.
    pub max_findings: Option<i64>,
    /// Most history snapshots.
    pub max_history: Option<i64>,
    /// A last reconciler round older than this is a `reconciler_stale` finding, ms.
    pub reconciler_stale_ms: Option<i64>,
}

/// `[metrics]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsSection {
    /// `HOST:PORT` of the Prometheus endpoint.
    pub addr: Option<String>,
}

impl FileConfig {
    /// Reads and parses `path`.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading config file {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("config file {}", path.display()))
    }

    /// Parses TOML text. An error names the line and what is wrong, never
    /// the text of the line (it may hold a secret).
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        toml::from_str(text).map_err(|e| {
            let line = e.span().map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
            let message = e.message().lines().next().unwrap_or("invalid TOML").to_owned();
            match line {
                Some(l) => anyhow::anyhow!("line {l}: {message}"),
                None => anyhow::anyhow!("{message}"),
            }
        })
    }
}

/// First of flag, (environment is folded into the flag by clap), file.
pub fn pick<T: Clone>(flag: Option<T>, file: Option<T>) -> Option<T> {
    flag.or(file)
}

/// The database URL: flag or `DATABASE_URL` (clap), else the file.
pub fn database_url(flag_or_env: Option<&str>, file: &FileConfig) -> anyhow::Result<String> {
    match flag_or_env.map(str::to_owned).or_else(|| file.database_url.clone()) {
        Some(u) if !u.trim().is_empty() => Ok(u),
        _ => bail!("no database: pass --database-url, set DATABASE_URL, or put database_url in the --config file"),
    }
}

/// Kafka flags (already merged with `OUTBOX_KAFKA_BOOTSTRAP` by clap).
#[derive(Debug, Clone, Default)]
pub struct KafkaFlags {
    /// Bootstrap servers.
    pub bootstrap: Option<String>,
    /// message.timeout.ms.
    pub message_timeout_ms: Option<u64>,
    /// request.timeout.ms.
    pub request_timeout_ms: Option<u64>,
    /// In-flight bound.
    pub max_in_flight: Option<usize>,
    /// Lookup timeout.
    pub lookup_timeout_ms: Option<u64>,
    /// Producer stall bound.
    pub producer_stall_ms: Option<u64>,
    /// KEY=VALUE settings (producer, connection settings also lookups).
    pub settings: Vec<String>,
    /// KEY=VALUE settings of the lookup consumers.
    pub lookup_settings: Vec<String>,
    /// OIDC token endpoint.
    pub oidc_token_url: Option<String>,
    /// OIDC client id.
    pub oidc_client_id: Option<String>,
    /// OIDC client secret.
    pub oidc_client_secret: Option<String>,
    /// OIDC scope.
    pub oidc_scope: Option<String>,
}

/// Splits `KEY=VALUE`; the error never shows the text (it may be a secret).
fn split_setting(flag: &str, n: usize, kv: &str) -> anyhow::Result<(String, String)> {
    outbox_producer::kafka::split_setting(kv)
        .ok_or_else(|| anyhow::anyhow!("{flag} number {n}: expected KEY=VALUE (the value is not shown: it may be a secret)"))
}

/// The Kafka adapter configuration: defaults < file < environment < flags.
pub fn kafka_config(flags: &KafkaFlags, file: &KafkaSection) -> anyhow::Result<KafkaConfig> {
    let Some(bootstrap) = pick(flags.bootstrap.clone(), file.bootstrap.clone()).filter(|b| !b.trim().is_empty()) else {
        bail!("no Kafka cluster: pass --kafka-bootstrap, set OUTBOX_KAFKA_BOOTSTRAP, or put bootstrap in the [kafka] section of the --config file")
    };
    let mut c = KafkaConfig::new(bootstrap.trim());
    let set = |into: &mut u64, f: Option<u64>, file: Option<u64>| {
        if let Some(v) = f.or(file) {
            *into = v;
        }
    };
    set(&mut c.message_timeout_ms, flags.message_timeout_ms, file.message_timeout_ms);
    set(&mut c.request_timeout_ms, flags.request_timeout_ms, file.request_timeout_ms);
    set(&mut c.enqueue_timeout_ms, None, file.enqueue_timeout_ms);
    set(&mut c.connect_timeout_ms, None, file.connect_timeout_ms);
    set(&mut c.lookup_max_messages, None, file.lookup_max_messages);
    set(&mut c.lookup_timeout_ms, flags.lookup_timeout_ms, file.lookup_timeout_ms);
    if let Some(v) = flags.max_in_flight.or(file.max_in_flight) {
        c.max_in_flight = v;
    }
    if let Some(v) = file.max_concurrent_lookups {
        c.max_concurrent_lookups = v;
    }
    set(&mut c.producer_stall_ms, flags.producer_stall_ms, file.producer_stall_ms);
    set(&mut c.probe_timeout_ms, None, file.probe_timeout_ms);
    let mut extra: BTreeMap<String, String> = file.settings.iter().map(|(k, v)| (k.trim().to_owned(), v.clone())).collect();
    for (n, kv) in flags.settings.iter().enumerate() {
        let (k, v) = split_setting("--kafka-setting", n + 1, kv)?;
        extra.insert(k, v);
    }
    let mut lookup: BTreeMap<String, String> = file.lookup_settings.iter().map(|(k, v)| (k.trim().to_owned(), v.clone())).collect();
    for (n, kv) in flags.lookup_settings.iter().enumerate() {
        let (k, v) = split_setting("--kafka-lookup-setting", n + 1, kv)?;
        lookup.insert(k, v);
    }
    // OIDC client credentials: librdkafka fetches and refreshes the tokens.
    let oidc_url = pick(flags.oidc_token_url.clone(), file.oidc_token_url.clone());
    let oidc_id = pick(flags.oidc_client_id.clone(), file.oidc_client_id.clone());
    let oidc_secret = pick(flags.oidc_client_secret.clone(), file.oidc_client_secret.clone());
    let oidc_scope = pick(flags.oidc_scope.clone(), file.oidc_scope.clone());
    match (&oidc_url, &oidc_id, &oidc_secret) {
        (None, None, None) if oidc_scope.is_none() => {}
        (Some(url), Some(id), Some(secret)) => {
            if !(url.starts_with("https://") || url.starts_with("http://")) {
                bail!("--kafka-oidc-token-url must be an http(s) URL");
            }
            extra.entry("security.protocol".into()).or_insert_with(|| "SASL_SSL".into());
            extra.insert("sasl.mechanism".into(), "OAUTHBEARER".into());
            extra.insert("sasl.oauthbearer.method".into(), "oidc".into());
            extra.insert("sasl.oauthbearer.token.endpoint.url".into(), url.clone());
            extra.insert("sasl.oauthbearer.client.id".into(), id.clone());
            extra.insert("sasl.oauthbearer.client.secret".into(), secret.clone());
            if let Some(scope) = &oidc_scope {
                extra.insert("sasl.oauthbearer.scope".into(), scope.clone());
            }
        }
        _ => bail!("OIDC needs all of --kafka-oidc-token-url, --kafka-oidc-client-id and --kafka-oidc-client-secret (or oidc_token_url, oidc_client_id, oidc_client_secret in [kafka])"),
    }
    c.extra = extra.into_iter().collect();
    c.lookup_extra = lookup.into_iter().collect();
    c.validate()?;
    Ok(c)
}

/// Dispatcher flags.
#[derive(Debug, Clone, Default)]
pub struct DispatchFlags {
    /// Owner prefix.
    pub name: Option<String>,
    /// Workers.
    pub workers: Option<usize>,
    /// Batch size.
    pub batch_size: Option<usize>,
    /// Lease, ms.
    pub lease_ms: Option<i64>,
    /// Poll interval, ms.
    pub poll_interval_ms: Option<u64>,
    /// Sweep interval, ms.
    pub sweep_interval_ms: Option<u64>,
    /// Claims between head scans.
    pub head_scan_every: Option<u32>,
    /// Shutdown grace, ms.
    pub shutdown_grace_ms: Option<u64>,
    /// Retry bound for recording broker answers, ms.
    pub record_retry_ms: Option<u64>,
    /// Disable LISTEN.
    pub no_listen: bool,
}

/// The dispatcher configuration: defaults < file `[dispatch]` < `OUTBOX_DISPATCH_*` < flags.
pub fn dispatcher_config(flags: &DispatchFlags, file: &FileConfig) -> anyhow::Result<DispatcherConfig> {
    let mut c = file.dispatch.clone().unwrap_or_default().with_env()?;
    if let Some(v) = &flags.name {
        c.name = v.clone();
    }
    if let Some(v) = flags.workers {
        c.workers = v;
    }
    if let Some(v) = flags.batch_size {
        c.batch_size = v;
    }
    if let Some(v) = flags.lease_ms {
        c.lease_ms = v;
    }
    if let Some(v) = flags.poll_interval_ms {
        c.poll_interval_ms = v;
    }
    if let Some(v) = flags.sweep_interval_ms {
        c.sweep_interval_ms = v;
    }
    if let Some(v) = flags.head_scan_every {
        c.head_scan_every = v;
    }
    if let Some(v) = flags.shutdown_grace_ms {
        c.shutdown_grace_ms = v;
    }
    if let Some(v) = flags.record_retry_ms {
        c.record_retry_ms = v;
    }
    if flags.no_listen {
        c.listen = false;
    }
    c.validate()?;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_parses_and_refuses_unknown_keys() {
        let f = FileConfig::parse(
            r#"
            database_url = "postgres://file/db"
            [kafka]
            bootstrap = "file:9092"
            message_timeout_ms = 1234
            settings = { "client.id" = "ops" }
            [dispatch]
            workers = 3
            [reconcile]
            interval_ms = 500
            "#,
        )
        .unwrap();
        assert_eq!(f.database_url.as_deref(), Some("postgres://file/db"));
        assert_eq!(f.dispatch.as_ref().unwrap().workers, 3);
        assert_eq!(f.dispatch.as_ref().unwrap().batch_size, outbox_producer::dispatcher::DEFAULT_BATCH_SIZE);
        assert_eq!(f.reconcile.interval_ms, Some(500));
        assert!(FileConfig::parse("[dispatch]\nwokers = 3").is_err());
        assert!(FileConfig::parse("colour = 1").is_err());
    }

    #[test]
    fn flags_beat_file_beats_defaults() {
        let f = FileConfig::parse("database_url = \"postgres://file/db\"\n[kafka]\nbootstrap = \"file:9092\"\nmessage_timeout_ms = 1234\nrequest_timeout_ms = 999").unwrap();
        assert_eq!(database_url(None, &f).unwrap(), "postgres://file/db");
        assert_eq!(database_url(Some("postgres://flag/db"), &f).unwrap(), "postgres://flag/db");
        assert!(database_url(None, &FileConfig::default()).unwrap_err().to_string().contains("DATABASE_URL"));

        let k = kafka_config(&KafkaFlags::default(), &f.kafka).unwrap();
        assert_eq!((k.bootstrap_servers.as_str(), k.message_timeout_ms, k.request_timeout_ms), ("file:9092", 1234, 999));
        let flags = KafkaFlags { bootstrap: Some("flag:9092".into()), message_timeout_ms: Some(77), settings: vec!["client.id=x".into()], ..Default::default() };
        let k = kafka_config(&flags, &f.kafka).unwrap();
        assert_eq!((k.bootstrap_servers.as_str(), k.message_timeout_ms, k.request_timeout_ms), ("flag:9092", 77, 999));
        assert_eq!(k.extra, vec![("client.id".to_owned(), "x".to_owned())]);
        let k = kafka_config(&KafkaFlags::default(), &KafkaSection { bootstrap: Some("b:1".into()), ..Default::default() }).unwrap();
        assert_eq!(k.message_timeout_ms, outbox_producer::kafka::DEFAULT_MESSAGE_TIMEOUT_MS);
        assert!(kafka_config(&KafkaFlags::default(), &KafkaSection::default()).unwrap_err().to_string().contains("OUTBOX_KAFKA_BOOTSTRAP"));
        let bad = KafkaFlags { bootstrap: Some("b:1".into()), settings: vec!["acks=0".into()], ..Default::default() };
        assert!(kafka_config(&bad, &KafkaSection::default()).is_err(), "protected settings are refused");
    }

    #[test]
    fn dispatcher_flags_beat_file() {
        let f = FileConfig::parse("[dispatch]\nworkers = 3\nbatch_size = 50").unwrap();
        // OUTBOX_DISPATCH_* is read by DispatcherConfig::with_env; this test leaves the environment alone.
        if std::env::vars().any(|(k, _)| k.starts_with("OUTBOX_DISPATCH_")) {
            return;
        }
        let c = dispatcher_config(&DispatchFlags::default(), &f).unwrap();
        assert_eq!((c.workers, c.batch_size), (3, 50));
        let c = dispatcher_config(&DispatchFlags { workers: Some(5), no_listen: true, ..Default::default() }, &f).unwrap();
        assert_eq!((c.workers, c.batch_size, c.listen), (5, 50, false));
        assert!(dispatcher_config(&DispatchFlags { workers: Some(0), ..Default::default() }, &f).is_err());
        assert!(dispatcher_config(&DispatchFlags { head_scan_every: Some(0), ..Default::default() }, &f).is_err());
        assert_eq!(dispatcher_config(&DispatchFlags { head_scan_every: Some(1), ..Default::default() }, &f).unwrap().head_scan_every, 1);
        assert_eq!(dispatcher_config(&DispatchFlags { record_retry_ms: Some(0), ..Default::default() }, &f).unwrap().record_retry_ms, 0);
        assert!(dispatcher_config(&DispatchFlags { record_retry_ms: Some(600_001), ..Default::default() }, &f).is_err());
    }
}
