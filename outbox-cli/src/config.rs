//! The configuration file and how it merges with the environment and flags.
//!
//! Precedence, highest first: command-line flag, environment variable, the
//! TOML file (`--config FILE` or `OUTBOX_CONFIG`), built-in default.
//!
//! The file is `outbox-config`'s [`Config`](outbox_config::Config), the one
//! configuration a service embedding the SDK reads too: every section is
//! documented in the workspace's `examples/outbox.toml`. This module merges
//! the command's flags over it.

use std::collections::BTreeMap;

use anyhow::bail;
use outbox_producer::kafka::KafkaConfig;
use outbox_producer::DispatcherConfig;

pub use outbox_config::{Config as FileConfig, ConsumerSection, KafkaSection, MetricsSection, ReconcileSection, ReportSection, RetentionSection};

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
    let mut section = file.clone();
    if pick(flags.bootstrap.clone(), file.bootstrap.clone()).filter(|b| !b.trim().is_empty()).is_none() {
        bail!("no Kafka cluster: pass --kafka-bootstrap, set OUTBOX_KAFKA_BOOTSTRAP, or put bootstrap in the [kafka] section of the --config file")
    }
    let over = |into: &mut Option<u64>, flag: Option<u64>| {
        if flag.is_some() {
            *into = flag;
        }
    };
    if flags.bootstrap.is_some() {
        section.bootstrap = flags.bootstrap.clone();
    }
    over(&mut section.message_timeout_ms, flags.message_timeout_ms);
    over(&mut section.request_timeout_ms, flags.request_timeout_ms);
    over(&mut section.lookup_timeout_ms, flags.lookup_timeout_ms);
    over(&mut section.producer_stall_ms, flags.producer_stall_ms);
    if flags.max_in_flight.is_some() {
        section.max_in_flight = flags.max_in_flight;
    }
    let mut settings: BTreeMap<String, String> = BTreeMap::new();
    for (n, kv) in flags.settings.iter().enumerate() {
        let (k, v) = split_setting("--kafka-setting", n + 1, kv)?;
        settings.insert(k, v);
    }
    section.settings.extend(settings);
    for (n, kv) in flags.lookup_settings.iter().enumerate() {
        let (k, v) = split_setting("--kafka-lookup-setting", n + 1, kv)?;
        section.lookup_settings.insert(k, v);
    }
    for (into, flag) in [
        (&mut section.oidc_token_url, &flags.oidc_token_url),
        (&mut section.oidc_client_id, &flags.oidc_client_id),
        (&mut section.oidc_client_secret, &flags.oidc_client_secret),
        (&mut section.oidc_scope, &flags.oidc_scope),
    ] {
        if flag.is_some() {
            *into = flag.clone();
        }
    }
    Ok(section.kafka_config()?)
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
