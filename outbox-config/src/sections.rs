//! The file's sections, as written: every field optional (a default applies),
//! unknown keys refused. [`crate::Config`] builds the SDK's types from them.

use std::collections::BTreeMap;

use outbox_producer::kafka::{redact_setting, KafkaConfig};
use serde::Deserialize;

use crate::error::{kafka_text, ConfigError};
use crate::keys::{KeyList, KeySpec};

/// Most librdkafka settings in one table (`[kafka.settings]`, a consumer's `kafka`).
pub const MAX_SETTINGS: usize = 256;
/// Longest librdkafka setting name, bytes.
pub const MAX_SETTING_NAME_BYTES: usize = 256;
/// Longest librdkafka setting value, bytes (an inline PEM certificate chain fits).
pub const MAX_SETTING_VALUE_BYTES: usize = 64 * 1024;

/// Settings tables shown with every secret-bearing value as `***`.
pub(crate) struct Masked<'a>(pub &'a BTreeMap<String, String>);

impl std::fmt::Debug for Masked<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.0.iter().map(|(k, v)| (k, redact_setting(k, v)))).finish()
    }
}

/// `[kafka]`: the cluster, the adapter's limits and every librdkafka setting.
#[derive(Clone, Default, PartialEq, Eq, Deserialize)]
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
    /// Raw librdkafka settings (any librdkafka setting but the few the
    /// adapter sets itself): all reach the producer; the connection
    /// settings (security, TLS, SASL, sockets, client.id) also the lookup
    /// consumers; the security, TLS, SASL and socket ones also every
    /// `[consumer.<id>]`.
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

impl std::fmt::Debug for KafkaSection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSection")
            .field("bootstrap", &self.bootstrap)
            .field("message_timeout_ms", &self.message_timeout_ms)
            .field("request_timeout_ms", &self.request_timeout_ms)
            .field("max_in_flight", &self.max_in_flight)
            .field("enqueue_timeout_ms", &self.enqueue_timeout_ms)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("lookup_max_messages", &self.lookup_max_messages)
            .field("lookup_timeout_ms", &self.lookup_timeout_ms)
            .field("max_concurrent_lookups", &self.max_concurrent_lookups)
            .field("producer_stall_ms", &self.producer_stall_ms)
            .field("probe_timeout_ms", &self.probe_timeout_ms)
            .field("settings", &Masked(&self.settings))
            .field("lookup_settings", &Masked(&self.lookup_settings))
            .field("oidc_token_url", &self.oidc_token_url)
            .field("oidc_client_id", &self.oidc_client_id)
            .field("oidc_client_secret", &self.oidc_client_secret.as_ref().map(|_| "***"))
            .field("oidc_scope", &self.oidc_scope)
            .finish()
    }
}

/// Checks one table of raw librdkafka settings: size limits, and no setting
/// the adapter (or, for a consumer, the consumer) sets itself. Errors name
/// `table.<setting>`, never the value.
pub(crate) fn check_settings(table: &str, settings: &BTreeMap<String, String>) -> Result<(), ConfigError> {
    if settings.len() > MAX_SETTINGS {
        return Err(ConfigError::new(table, format!("{} settings (..={MAX_SETTINGS})", settings.len())));
    }
    for (k, v) in settings {
        let at = format!("{table}.{}", crate::keys::quote_key(k));
        if k.trim().is_empty() || k.len() > MAX_SETTING_NAME_BYTES {
            return Err(ConfigError::new(table, format!("a setting name is empty or longer than {MAX_SETTING_NAME_BYTES} bytes")));
        }
        if v.len() > MAX_SETTING_VALUE_BYTES {
            return Err(ConfigError::new(at, format!("the value is {} bytes (..={MAX_SETTING_VALUE_BYTES}; not shown)", v.len())));
        }
        if let Err(e) = KafkaConfig::new("check:0").with_setting(k.trim(), "").validate() {
            return Err(ConfigError::new(at, kafka_text(&e)));
        }
    }
    Ok(())
}

impl KafkaSection {
    /// The raw librdkafka settings of the producer, `[kafka] settings` with
    /// the OIDC client credentials' settings added; checked.
    pub fn effective_settings(&self) -> Result<BTreeMap<String, String>, ConfigError> {
        check_settings("kafka.settings", &self.settings)?;
        check_settings("kafka.lookup_settings", &self.lookup_settings)?;
        let mut extra: BTreeMap<String, String> = self.settings.iter().map(|(k, v)| (k.trim().to_owned(), v.clone())).collect();
        match (&self.oidc_token_url, &self.oidc_client_id, &self.oidc_client_secret) {
            (None, None, None) if self.oidc_scope.is_none() => {}
            (Some(url), Some(id), Some(secret)) => {
                if !(url.starts_with("https://") || url.starts_with("http://")) {
                    return Err(ConfigError::new("kafka.oidc_token_url", "must be an http(s) URL"));
                }
                extra.entry("security.protocol".into()).or_insert_with(|| "SASL_SSL".into());
                extra.insert("sasl.mechanism".into(), "OAUTHBEARER".into());
                extra.insert("sasl.oauthbearer.method".into(), "oidc".into());
                extra.insert("sasl.oauthbearer.token.endpoint.url".into(), url.clone());
                extra.insert("sasl.oauthbearer.client.id".into(), id.clone());
                extra.insert("sasl.oauthbearer.client.secret".into(), secret.clone());
                if let Some(scope) = &self.oidc_scope {
                    extra.insert("sasl.oauthbearer.scope".into(), scope.clone());
                }
            }
            _ => {
                return Err(ConfigError::new(
                    "kafka.oidc_token_url",
                    "OIDC needs all of oidc_token_url, oidc_client_id and oidc_client_secret (--kafka-oidc-token-url, --kafka-oidc-client-id, OUTBOX_KAFKA_OIDC_CLIENT_SECRET)",
                ))
            }
        }
        Ok(extra)
    }

    /// The Kafka adapter's configuration: the defaults, then this section.
    pub fn kafka_config(&self) -> Result<KafkaConfig, ConfigError> {
        let Some(bootstrap) = self.bootstrap.as_deref().map(str::trim).filter(|b| !b.is_empty()) else {
            return Err(ConfigError::new("kafka.bootstrap", "not set (OUTBOX_KAFKA_BOOTSTRAP, --kafka-bootstrap)"));
        };
        let mut c = KafkaConfig::new(bootstrap);
        let set = |into: &mut u64, v: Option<u64>| {
            if let Some(v) = v {
                *into = v;
            }
        };
        set(&mut c.message_timeout_ms, self.message_timeout_ms);
        set(&mut c.request_timeout_ms, self.request_timeout_ms);
        set(&mut c.enqueue_timeout_ms, self.enqueue_timeout_ms);
        set(&mut c.connect_timeout_ms, self.connect_timeout_ms);
        set(&mut c.lookup_max_messages, self.lookup_max_messages);
        set(&mut c.lookup_timeout_ms, self.lookup_timeout_ms);
        set(&mut c.producer_stall_ms, self.producer_stall_ms);
        set(&mut c.probe_timeout_ms, self.probe_timeout_ms);
        if let Some(v) = self.max_in_flight {
            c.max_in_flight = v;
        }
        if let Some(v) = self.max_concurrent_lookups {
            c.max_concurrent_lookups = v;
        }
        c.extra = self.effective_settings()?.into_iter().collect();
        c.lookup_extra = self.lookup_settings.iter().map(|(k, v)| (k.trim().to_owned(), v.clone())).collect();
        c.validate().map_err(|e| {
            let text = kafka_text(&e);
            let field = text.split_whitespace().next().unwrap_or("");
            ConfigError::new(if field.ends_with("_ms") || field.starts_with("max_") || field.starts_with("lookup_") { format!("kafka.{field}") } else { "kafka".to_owned() }, text)
        })?;
        Ok(c)
    }
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
    /// Verification keys of consumers' watermark records: consumer id →
    /// keys (`OUTBOX_RECONCILE_WATERMARK_KEYS` replaces them). The former
    /// array of `"CONSUMER_ID=KEY_ID=HEX"` strings is still read, deprecated.
    pub watermark_keys: Option<KeyList>,
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

impl ReconcileSection {
    /// The watermark records' verification keys, per consumer id.
    pub fn watermark_verify_keys(&self) -> Result<BTreeMap<String, Vec<outbox_core::trust::SigningKey>>, ConfigError> {
        let setting = "reconcile.watermark_keys";
        match &self.watermark_keys {
            None => Ok(BTreeMap::new()),
            Some(list) => crate::keys::resolve(setting, &list.by_owner(setting)?),
        }
    }
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

/// `[consumer.<id>]`: one consumer (`outbox_consumer::ConsumerConfig`); the
/// section's name is its consumer id.
#[derive(Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConsumerSection {
    /// Its own database (receipts, watermarks); default: the top-level `database_url`.
    pub database_url: Option<String>,
    /// Kafka consumer group (default: the consumer id).
    pub group_id: Option<String>,
    /// Topics it subscribes to (required).
    pub topics: Vec<String>,
    /// Most messages of one partition decided in one transaction.
    pub max_batch_messages: Option<usize>,
    /// Most message bytes in one transaction.
    pub max_batch_bytes: Option<usize>,
    /// Messages read ahead per partition.
    pub max_buffered_per_partition: Option<usize>,
    /// Handler runs per event before it is dead-lettered.
    pub max_attempts: Option<u32>,
    /// Wait before the second handler attempt, ms; doubles per attempt.
    pub initial_backoff_ms: Option<u64>,
    /// Longest wait between handler attempts, ms.
    pub max_backoff_ms: Option<u64>,
    /// Longest one handler run may take, ms.
    pub handler_timeout_ms: Option<u64>,
    /// Tries of a batch whose database work fails with a retryable error.
    pub db_max_attempts: Option<u32>,
    /// Kafka group session timeout, ms.
    pub session_timeout_ms: Option<u64>,
    /// How long shutdown waits for in-flight batches, ms.
    pub shutdown_timeout_ms: Option<u64>,
    /// Largest quarantined payload stored verbatim, bytes.
    pub max_evidence_payload_bytes: Option<usize>,
    /// The compacted topic its watermarks are published to (`""`: not over
    /// the broker). Default `outbox.watermarks`.
    pub watermark_topic: Option<String>,
    /// Pause between two publications of its watermarks, ms.
    pub watermark_publish_interval_ms: Option<u64>,
    /// Longest wait for the broker's answers to one publication, ms.
    pub watermark_publish_timeout_ms: Option<u64>,
    /// Signs every watermark record it publishes (the reconciler verifies
    /// with `[reconcile.watermark_keys]`).
    pub watermark_signing: Option<KeySpec>,
    /// A replay: publishes no watermark record.
    pub replay: Option<bool>,
    /// Raw librdkafka settings of this consumer only, on top of the
    /// security, TLS, SASL and socket settings of `[kafka.settings]`.
    pub kafka: BTreeMap<String, String>,
    /// Accepted sources per topic: `{ orders = ["urn:…"] }`. A topic not
    /// listed accepts any source.
    pub accept: BTreeMap<String, Vec<String>>,
    /// Topics (of `accept`) whose messages must carry a valid signature.
    pub require_signature: Vec<String>,
    /// Verification keys per source: `{ "urn:…" = [{ key_id, secret_hex }] }`.
    pub keys: BTreeMap<String, Vec<KeySpec>>,
}

impl std::fmt::Debug for ConsumerSection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerSection")
            .field("database_url", &self.database_url.as_deref().map(crate::mask_database_url))
            .field("group_id", &self.group_id)
            .field("topics", &self.topics)
            .field("max_batch_messages", &self.max_batch_messages)
            .field("max_batch_bytes", &self.max_batch_bytes)
            .field("max_buffered_per_partition", &self.max_buffered_per_partition)
            .field("max_attempts", &self.max_attempts)
            .field("initial_backoff_ms", &self.initial_backoff_ms)
            .field("max_backoff_ms", &self.max_backoff_ms)
            .field("handler_timeout_ms", &self.handler_timeout_ms)
            .field("db_max_attempts", &self.db_max_attempts)
            .field("session_timeout_ms", &self.session_timeout_ms)
            .field("shutdown_timeout_ms", &self.shutdown_timeout_ms)
            .field("max_evidence_payload_bytes", &self.max_evidence_payload_bytes)
            .field("watermark_topic", &self.watermark_topic)
            .field("watermark_publish_interval_ms", &self.watermark_publish_interval_ms)
            .field("watermark_publish_timeout_ms", &self.watermark_publish_timeout_ms)
            .field("watermark_signing", &self.watermark_signing)
            .field("replay", &self.replay)
            .field("kafka", &Masked(&self.kafka))
            .field("accept", &self.accept)
            .field("require_signature", &self.require_signature)
            .field("keys", &self.keys)
            .finish()
    }
}
