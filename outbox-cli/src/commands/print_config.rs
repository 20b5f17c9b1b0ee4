//! `--print-config`: the effective configuration as a TOML document in the
//! `--config` file's format, every secret masked.

use outbox_producer::kafka::KafkaConfig;
use outbox_producer::{DispatcherConfig, ReconcilerConfig};

use super::db::mask_database_url;

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
pub(super) fn config_toml(database_url: Option<&str>, kafka: &KafkaConfig, metrics_addr: Option<&str>, section: (&str, toml::Table)) -> anyhow::Result<String> {
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

pub(super) fn dispatch_table(c: &DispatcherConfig) -> toml::Table {
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

pub(super) fn reconcile_table(c: &ReconcilerConfig, interval_ms: u64) -> toml::Table {
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

/// `watermark_keys` as --print-config shows them, in the file's key format:
/// a table of consumer id to `{ key_id, secret_hex = "***" }`.
pub(super) fn watermark_keys_value(c: &outbox_producer::WatermarkTopicConfig) -> toml::Value {
    let mut t = toml::Table::new();
    for (consumer, keys) in &c.verify_keys {
        let list = keys
            .iter()
            .map(|k| {
                let mut key = toml::Table::new();
                key.insert("key_id".into(), toml::Value::String(k.key_id().to_owned()));
                key.insert("secret_hex".into(), toml::Value::String("***".into()));
                toml::Value::Table(key)
            })
            .collect();
        t.insert(consumer.clone(), toml::Value::Array(list));
    }
    toml::Value::Table(t)
}
