//! The same settings as environment variables. A variable that is set wins
//! over the file ([`crate::Config::from_file_and_env`]); the CLI's flags win
//! over both. The names are the ones the CLI and the SDK already read.
//!
//! | variable | setting |
//! |---|---|
//! | `DATABASE_URL` | `database_url` |
//! | `OUTBOX_LOG`, `OUTBOX_LOG_FORMAT` | `log`, `log_format` |
//! | `OUTBOX_KAFKA_BOOTSTRAP` (`OUTBOX_KAFKA_BOOTSTRAP_SERVERS`: deprecated) | `kafka.bootstrap` |
//! | `OUTBOX_KAFKA_<FIELD>`, e.g. `OUTBOX_KAFKA_MESSAGE_TIMEOUT_MS`, `OUTBOX_KAFKA_MAX_IN_FLIGHT` | `kafka.<field>` (every number of `[kafka]`) |
//! | `OUTBOX_KAFKA_SETTING_<NAME>`, e.g. `OUTBOX_KAFKA_SETTING_SASL_PASSWORD` | `kafka.settings."<name>"`: lower-cased, `_` → `.`, `__` → `_` (`OUTBOX_KAFKA_SETTING_LOG__LEVEL` is `log_level`) |
//! | `OUTBOX_KAFKA_LOOKUP_SETTING_<NAME>` | `kafka.lookup_settings."<name>"` |
//! | `OUTBOX_KAFKA_OIDC_TOKEN_URL`, `_OIDC_CLIENT_ID`, `_OIDC_CLIENT_SECRET`, `_OIDC_SCOPE` | `kafka.oidc_*` |
//! | `OUTBOX_DISPATCH_*` (`DispatcherConfig::with_env`: `_NAME`, `_WORKERS`, …, `_SIGNING_KEY_ID` with `_SIGNING_SECRET_HEX`) | `[dispatch]` |
//! | `OUTBOX_RECONCILE_<FIELD>`, e.g. `OUTBOX_RECONCILE_INTERVAL_MS` | `reconcile.<field>` |
//! | `OUTBOX_RECONCILE_WATERMARK_KEYS` (space-separated `CONSUMER_ID=KEY_ID=HEX`) | `reconcile.watermark_keys` (replaces it) |
//! | `OUTBOX_RECONCILE_WATERMARK_UNSIGNED`, `OUTBOX_RECONCILE_DECLARED_SOURCES` (comma-separated) | `reconcile.watermark_unsigned`, `reconcile.declared_sources` |
//! | `OUTBOX_RETENTION_<FIELD>`, `OUTBOX_REPORT_<FIELD>` | `retention.<field>`, `report.<field>` |
//! | `OUTBOX_METRICS_ADDR` | `metrics.addr` |
//! | `OUTBOX_CONSUMER_ID` | the consumer the `OUTBOX_CONSUMER_*` variables describe: `[consumer.<id>]` (created, or overlaid) |
//! | `OUTBOX_CONSUMER_<FIELD>`, e.g. `OUTBOX_CONSUMER_GROUP_ID`, `OUTBOX_CONSUMER_TOPICS` (comma-separated), `OUTBOX_CONSUMER_MAX_ATTEMPTS`, `OUTBOX_CONSUMER_WATERMARK_TOPIC`, `OUTBOX_CONSUMER_DATABASE_URL` | `consumer.<id>.<field>` |
//! | `OUTBOX_CONSUMER_WATERMARK_SIGNING_KEY_ID` with `_SECRET_HEX` | `consumer.<id>.watermark_signing` |
//! | `OUTBOX_CONSUMER_KAFKA_<PROPERTY>` | `consumer.<id>.kafka."<property>"` (as `OUTBOX_KAFKA_SETTING_`) |
//! | `OUTBOX_CONSUMER_ACCEPT_SOURCES` (space-separated `TOPIC=SOURCE`) | `consumer.<id>.accept` (replaces it) |
//! | `OUTBOX_CONSUMER_REQUIRE_SIGNATURE` (comma-separated topics) | `consumer.<id>.require_signature` (replaces it) |
//! | `OUTBOX_CONSUMER_VERIFY_KEYS` (space-separated `SOURCE=KEY_ID=HEX`) | `consumer.<id>.keys` (replaces it) |
//!
//! Errors name the variable and never repeat its value.

use std::collections::BTreeMap;

use crate::error::{producer_text, ConfigError};
use crate::keys::{parse_owned_entries, KeyList, KeySpec};
use crate::Config;

/// The prefix of `[kafka.settings]` variables.
pub const KAFKA_SETTING_PREFIX: &str = "OUTBOX_KAFKA_SETTING_";
/// The prefix of `[kafka.lookup_settings]` variables.
pub const KAFKA_LOOKUP_SETTING_PREFIX: &str = "OUTBOX_KAFKA_LOOKUP_SETTING_";
/// The prefix of a consumer's own librdkafka settings.
pub const CONSUMER_KAFKA_PREFIX: &str = "OUTBOX_CONSUMER_KAFKA_";

/// A librdkafka setting's name from a variable's suffix: lower-cased,
/// `__` → `_`, `_` → `.`.
pub fn setting_name(suffix: &str) -> String {
    suffix.to_ascii_lowercase().split("__").map(|part| part.replace('_', ".")).collect::<Vec<_>>().join("_")
}

type Get<'a> = &'a dyn Fn(&str) -> Option<String>;

fn value(get: Get, k: &str) -> Option<String> {
    get(k)
}

fn num<T: std::str::FromStr>(get: Get, k: &str, into: &mut Option<T>) -> Result<(), ConfigError> {
    if let Some(v) = value(get, k).filter(|v| !v.trim().is_empty()) {
        *into = Some(v.trim().parse().map_err(|_| ConfigError::new(k, format!("is not a valid {} (the value is not shown)", std::any::type_name::<T>())))?);
    }
    Ok(())
}

fn text(get: Get, k: &str, into: &mut Option<String>) {
    if let Some(v) = value(get, k) {
        *into = Some(v.trim().to_owned());
    }
}

fn boolean(get: Get, k: &str, into: &mut Option<bool>) -> Result<(), ConfigError> {
    if let Some(v) = value(get, k) {
        *into = Some(match v.trim().to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" => true,
            "" | "0" | "false" | "no" => false,
            _ => return Err(ConfigError::new(k, "is not true or false")),
        });
    }
    Ok(())
}

fn list(get: Get, k: &str, into: &mut Option<Vec<String>>) {
    if let Some(v) = value(get, k) {
        *into = Some(v.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect());
    }
}

fn key_pair(get: Get, prefix: &str) -> Result<Option<KeySpec>, ConfigError> {
    let (id_var, secret_var) = (format!("{prefix}_KEY_ID"), format!("{prefix}_SECRET_HEX"));
    let key_id = get(&id_var).filter(|v| !v.trim().is_empty());
    let secret = get(&secret_var).filter(|v| !v.trim().is_empty());
    match (key_id, secret) {
        (Some(key_id), Some(secret_hex)) => Ok(Some(KeySpec { key_id: key_id.trim().to_owned(), secret_hex: secret_hex.trim().to_owned() })),
        (None, None) => Ok(None),
        _ => Err(ConfigError::new(id_var.clone(), format!("set both {id_var} and {secret_var}, or neither"))),
    }
}

pub(crate) fn apply(c: &mut Config, get: &dyn Fn(&str) -> Option<String>, all: &[(String, String)]) -> Result<(), ConfigError> {
    text(get, "DATABASE_URL", &mut c.database_url);
    text(get, "OUTBOX_LOG", &mut c.log);
    text(get, "OUTBOX_LOG_FORMAT", &mut c.log_format);

    // [kafka]
    let k = &mut c.kafka;
    match (get("OUTBOX_KAFKA_BOOTSTRAP").filter(|v| !v.trim().is_empty()), get("OUTBOX_KAFKA_BOOTSTRAP_SERVERS").filter(|v| !v.trim().is_empty())) {
        (Some(b), _) => k.bootstrap = Some(b.trim().to_owned()),
        (None, Some(b)) => {
            k.bootstrap = Some(b.trim().to_owned());
            c.warn("OUTBOX_KAFKA_BOOTSTRAP_SERVERS is deprecated: set OUTBOX_KAFKA_BOOTSTRAP");
        }
        (None, None) => {}
    }
    let k = &mut c.kafka;
    num(get, "OUTBOX_KAFKA_MESSAGE_TIMEOUT_MS", &mut k.message_timeout_ms)?;
    num(get, "OUTBOX_KAFKA_REQUEST_TIMEOUT_MS", &mut k.request_timeout_ms)?;
    num(get, "OUTBOX_KAFKA_MAX_IN_FLIGHT", &mut k.max_in_flight)?;
    num(get, "OUTBOX_KAFKA_ENQUEUE_TIMEOUT_MS", &mut k.enqueue_timeout_ms)?;
    num(get, "OUTBOX_KAFKA_CONNECT_TIMEOUT_MS", &mut k.connect_timeout_ms)?;
    num(get, "OUTBOX_KAFKA_LOOKUP_MAX_MESSAGES", &mut k.lookup_max_messages)?;
    num(get, "OUTBOX_KAFKA_LOOKUP_TIMEOUT_MS", &mut k.lookup_timeout_ms)?;
    num(get, "OUTBOX_KAFKA_MAX_CONCURRENT_LOOKUPS", &mut k.max_concurrent_lookups)?;
    num(get, "OUTBOX_KAFKA_PRODUCER_STALL_MS", &mut k.producer_stall_ms)?;
    num(get, "OUTBOX_KAFKA_PROBE_TIMEOUT_MS", &mut k.probe_timeout_ms)?;
    text(get, "OUTBOX_KAFKA_OIDC_TOKEN_URL", &mut k.oidc_token_url);
    text(get, "OUTBOX_KAFKA_OIDC_CLIENT_ID", &mut k.oidc_client_id);
    if let Some(v) = get("OUTBOX_KAFKA_OIDC_CLIENT_SECRET") {
        k.oidc_client_secret = Some(v);
    }
    text(get, "OUTBOX_KAFKA_OIDC_SCOPE", &mut k.oidc_scope);
    for (name, v) in all {
        if let Some(suffix) = name.strip_prefix(KAFKA_SETTING_PREFIX).filter(|s| !s.is_empty()) {
            k.settings.insert(setting_name(suffix), v.clone());
        } else if let Some(suffix) = name.strip_prefix(KAFKA_LOOKUP_SETTING_PREFIX).filter(|s| !s.is_empty()) {
            k.lookup_settings.insert(setting_name(suffix), v.clone());
        }
    }

    // [dispatch]
    if all.iter().any(|(name, _)| name.starts_with("OUTBOX_DISPATCH_")) {
        let d = c.dispatch.clone().unwrap_or_default().with_env_lookup(get).map_err(|e| {
            let text = producer_text(&e);
            let var = text.split(['=', ' ']).next().filter(|v| v.starts_with("OUTBOX_DISPATCH_")).unwrap_or("OUTBOX_DISPATCH_*").to_owned();
            ConfigError::new(var, text.split_once("=\"").map(|(head, _)| format!("{head}: not a valid value (not shown)")).unwrap_or(text))
        })?;
        c.dispatch = Some(d);
    }

    // [reconcile]
    let r = &mut c.reconcile;
    num(get, "OUTBOX_RECONCILE_INTERVAL_MS", &mut r.interval_ms)?;
    num(get, "OUTBOX_RECONCILE_COMPARE_EVERY_ROUNDS", &mut r.compare_every_rounds)?;
    text(get, "OUTBOX_RECONCILE_OWNER", &mut r.owner);
    num(get, "OUTBOX_RECONCILE_BATCH_SIZE", &mut r.batch_size)?;
    num(get, "OUTBOX_RECONCILE_LEASE_MS", &mut r.lease_ms)?;
    boolean(get, "OUTBOX_RECONCILE_ALLOW_RETRY", &mut r.allow_retry)?;
    num(get, "OUTBOX_RECONCILE_MAX_ATTEMPTS", &mut r.max_attempts)?;
    num(get, "OUTBOX_RECONCILE_IN_FLIGHT_BOUND_MS", &mut r.in_flight_bound_ms)?;
    num(get, "OUTBOX_RECONCILE_RECHECK_MS", &mut r.recheck_ms)?;
    num(get, "OUTBOX_RECONCILE_AGED_PENDING_MS", &mut r.aged_pending_ms)?;
    num(get, "OUTBOX_RECONCILE_UNCONSUMED_AFTER_MS", &mut r.unconsumed_after_ms)?;
    num(get, "OUTBOX_RECONCILE_UNKNOWN_SLO_MS", &mut r.unknown_slo_ms)?;
    num(get, "OUTBOX_RECONCILE_BYPASS_SCAN_MAX_MESSAGES", &mut r.bypass_scan_max_messages)?;
    text(get, "OUTBOX_RECONCILE_WATERMARK_TOPIC", &mut r.watermark_topic);
    num(get, "OUTBOX_RECONCILE_STALE_WATERMARK_AFTER_MS", &mut r.stale_watermark_after_ms)?;
    num(get, "OUTBOX_RECONCILE_MAX_FINDINGS_PER_KIND", &mut r.max_findings_per_kind)?;
    num(get, "OUTBOX_RECONCILE_HISTORY_KEEP_MS", &mut r.history_keep_ms)?;
    list(get, "OUTBOX_RECONCILE_WATERMARK_UNSIGNED", &mut r.watermark_unsigned);
    list(get, "OUTBOX_RECONCILE_DECLARED_SOURCES", &mut r.declared_sources);
    if let Some(v) = get("OUTBOX_RECONCILE_WATERMARK_KEYS").filter(|v| !v.trim().is_empty()) {
        r.watermark_keys = Some(KeyList::ByOwner(parse_owned_entries("OUTBOX_RECONCILE_WATERMARK_KEYS", v.split_whitespace())?));
    }

    // [retention], [report], [metrics]
    num(get, "OUTBOX_RETENTION_REPLAY_WINDOW_MS", &mut c.retention.replay_window_ms)?;
    num(get, "OUTBOX_RETENTION_BATCH_SIZE", &mut c.retention.batch_size)?;
    num(get, "OUTBOX_RETENTION_MAX_BATCHES", &mut c.retention.max_batches)?;
    num(get, "OUTBOX_REPORT_UNKNOWN_SLO_MS", &mut c.report.unknown_slo_ms)?;
    num(get, "OUTBOX_REPORT_MAX_FINDINGS", &mut c.report.max_findings)?;
    num(get, "OUTBOX_REPORT_MAX_HISTORY", &mut c.report.max_history)?;
    num(get, "OUTBOX_REPORT_RECONCILER_STALE_MS", &mut c.report.reconciler_stale_ms)?;
    text(get, "OUTBOX_METRICS_ADDR", &mut c.metrics.addr);

    apply_consumer(c, get, all)
}

/// The one consumer the `OUTBOX_CONSUMER_*` variables describe.
fn apply_consumer(c: &mut Config, get: Get, all: &[(String, String)]) -> Result<(), ConfigError> {
    let Some(id) = get("OUTBOX_CONSUMER_ID").map(|v| v.trim().to_owned()).filter(|v| !v.is_empty()) else {
        // Variables that describe a consumer, with no consumer named: refused, not ignored.
        let describing = ["OUTBOX_CONSUMER_TOPICS", "OUTBOX_CONSUMER_ACCEPT_SOURCES", "OUTBOX_CONSUMER_REQUIRE_SIGNATURE", "OUTBOX_CONSUMER_VERIFY_KEYS"];
        if let Some(set) = describing.iter().find(|k| get(k).is_some_and(|v| !v.trim().is_empty())) {
            return Err(ConfigError::new("OUTBOX_CONSUMER_ID", format!("not set, but {set} is: name the consumer it describes")));
        }
        return Ok(());
    };
    let s = c.consumer.entry(id).or_default();
    let mut topics = None;
    list(get, "OUTBOX_CONSUMER_TOPICS", &mut topics);
    if let Some(t) = topics {
        s.topics = t;
    }
    text(get, "OUTBOX_CONSUMER_DATABASE_URL", &mut s.database_url);
    text(get, "OUTBOX_CONSUMER_GROUP_ID", &mut s.group_id);
    num(get, "OUTBOX_CONSUMER_MAX_BATCH_MESSAGES", &mut s.max_batch_messages)?;
    num(get, "OUTBOX_CONSUMER_MAX_BATCH_BYTES", &mut s.max_batch_bytes)?;
    num(get, "OUTBOX_CONSUMER_MAX_BUFFERED_PER_PARTITION", &mut s.max_buffered_per_partition)?;
    num(get, "OUTBOX_CONSUMER_MAX_ATTEMPTS", &mut s.max_attempts)?;
    num(get, "OUTBOX_CONSUMER_INITIAL_BACKOFF_MS", &mut s.initial_backoff_ms)?;
    num(get, "OUTBOX_CONSUMER_MAX_BACKOFF_MS", &mut s.max_backoff_ms)?;
    num(get, "OUTBOX_CONSUMER_HANDLER_TIMEOUT_MS", &mut s.handler_timeout_ms)?;
    num(get, "OUTBOX_CONSUMER_DB_MAX_ATTEMPTS", &mut s.db_max_attempts)?;
    num(get, "OUTBOX_CONSUMER_SESSION_TIMEOUT_MS", &mut s.session_timeout_ms)?;
    num(get, "OUTBOX_CONSUMER_SHUTDOWN_TIMEOUT_MS", &mut s.shutdown_timeout_ms)?;
    num(get, "OUTBOX_CONSUMER_MAX_EVIDENCE_PAYLOAD_BYTES", &mut s.max_evidence_payload_bytes)?;
    if let Some(v) = get("OUTBOX_CONSUMER_WATERMARK_TOPIC") {
        s.watermark_topic = Some(v.trim().to_owned());
    }
    num(get, "OUTBOX_CONSUMER_WATERMARK_PUBLISH_INTERVAL_MS", &mut s.watermark_publish_interval_ms)?;
    num(get, "OUTBOX_CONSUMER_WATERMARK_PUBLISH_TIMEOUT_MS", &mut s.watermark_publish_timeout_ms)?;
    if let Some(k) = key_pair(get, "OUTBOX_CONSUMER_WATERMARK_SIGNING")? {
        s.watermark_signing = Some(k);
    }
    boolean(get, "OUTBOX_CONSUMER_REPLAY", &mut s.replay)?;
    for (name, v) in all {
        if let Some(suffix) = name.strip_prefix(CONSUMER_KAFKA_PREFIX).filter(|s| !s.is_empty()) {
            s.kafka.insert(setting_name(suffix), v.clone());
        }
    }
    if let Some(v) = get("OUTBOX_CONSUMER_ACCEPT_SOURCES").filter(|v| !v.trim().is_empty()) {
        let mut accept: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (i, entry) in v.split_whitespace().enumerate() {
            let (topic, source) = entry.split_once('=').ok_or_else(|| ConfigError::new("OUTBOX_CONSUMER_ACCEPT_SOURCES", format!("entry {} is not TOPIC=SOURCE", i + 1)))?;
            accept.entry(topic.to_owned()).or_default().push(source.to_owned());
        }
        s.accept = accept;
    }
    if let Some(v) = get("OUTBOX_CONSUMER_REQUIRE_SIGNATURE").filter(|v| !v.trim().is_empty()) {
        s.require_signature = v.split(',').map(str::trim).filter(|t| !t.is_empty()).map(str::to_owned).collect();
    }
    if let Some(v) = get("OUTBOX_CONSUMER_VERIFY_KEYS").filter(|v| !v.trim().is_empty()) {
        s.keys = parse_owned_entries("OUTBOX_CONSUMER_VERIFY_KEYS", v.split_whitespace())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn setting_names_from_variables() {
        assert_eq!(super::setting_name("SASL_PASSWORD"), "sasl.password");
        assert_eq!(super::setting_name("SSL_KEY_PASSWORD"), "ssl.key.password");
        assert_eq!(super::setting_name("LOG__LEVEL"), "log_level");
        assert_eq!(super::setting_name("SSL_ENDPOINT_IDENTIFICATION_ALGORITHM"), "ssl.endpoint.identification.algorithm");
    }
}
