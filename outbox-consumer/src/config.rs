//! Configuration, with a named default and a limit for every number.

/// The environment variable naming the Kafka bootstrap servers: one name for
/// the CLI, the producer (`KafkaConfig::from_env`) and the consumer.
pub const BOOTSTRAP_ENV: &str = "OUTBOX_KAFKA_BOOTSTRAP";
/// The consumer's former name for [`BOOTSTRAP_ENV`], still read (with a warning).
pub const DEPRECATED_BOOTSTRAP_ENV: &str = "OUTBOX_KAFKA_BOOTSTRAP_SERVERS";

use std::collections::BTreeMap;
use std::time::Duration;

use outbox_core::id::validate_identifier;

use crate::error::ConsumerError;

/// Default [`ConsumerConfig::max_batch_messages`].
pub const DEFAULT_MAX_BATCH_MESSAGES: usize = 500;
/// Upper limit of [`ConsumerConfig::max_batch_messages`].
pub const LIMIT_MAX_BATCH_MESSAGES: usize = 10_000;
/// Default [`ConsumerConfig::max_batch_bytes`]: 8 MiB.
pub const DEFAULT_MAX_BATCH_BYTES: usize = 8 * 1024 * 1024;
/// Upper limit of [`ConsumerConfig::max_batch_bytes`]: 256 MiB.
pub const LIMIT_MAX_BATCH_BYTES: usize = 256 * 1024 * 1024;
/// Default [`ConsumerConfig::max_buffered_per_partition`].
pub const DEFAULT_MAX_BUFFERED_PER_PARTITION: usize = 2_000;
/// Upper limit of [`ConsumerConfig::max_buffered_per_partition`].
pub const LIMIT_MAX_BUFFERED_PER_PARTITION: usize = 100_000;
/// Default [`RetryPolicy::max_attempts`].
pub const DEFAULT_HANDLER_MAX_ATTEMPTS: u32 = 5;
/// Upper limit of [`RetryPolicy::max_attempts`].
pub const LIMIT_HANDLER_MAX_ATTEMPTS: u32 = 100;
/// Default [`RetryPolicy::initial_backoff_ms`].
pub const DEFAULT_INITIAL_BACKOFF_MS: u64 = 200;
/// Default [`RetryPolicy::max_backoff_ms`].
pub const DEFAULT_MAX_BACKOFF_MS: u64 = 10_000;
/// Upper limit of any backoff: 10 minutes.
pub const LIMIT_BACKOFF_MS: u64 = 600_000;
/// Default [`RetryPolicy::handler_timeout_ms`].
pub const DEFAULT_HANDLER_TIMEOUT_MS: u64 = 30_000;
/// Upper limit of [`RetryPolicy::handler_timeout_ms`]: 15 minutes.
pub const LIMIT_HANDLER_TIMEOUT_MS: u64 = 900_000;
/// Default [`RetryPolicy::db_max_attempts`].
pub const DEFAULT_DB_MAX_ATTEMPTS: u32 = 10;
/// Default [`ConsumerConfig::session_timeout_ms`].
pub const DEFAULT_SESSION_TIMEOUT_MS: u64 = 10_000;
/// Default [`ConsumerConfig::shutdown_timeout_ms`].
pub const DEFAULT_SHUTDOWN_TIMEOUT_MS: u64 = 10_000;
/// Default [`ConsumerConfig::max_evidence_payload_bytes`]: 1 MiB.
pub const DEFAULT_MAX_EVIDENCE_PAYLOAD_BYTES: usize = 1024 * 1024;
/// Default [`ConsumerConfig::watermark_publish_interval_ms`].
pub const DEFAULT_WATERMARK_PUBLISH_INTERVAL_MS: u64 = 5_000;
/// Range of [`ConsumerConfig::watermark_publish_interval_ms`].
pub const LIMIT_WATERMARK_PUBLISH_INTERVAL_MS: std::ops::RangeInclusive<u64> = 100..=600_000;
/// Default [`ConsumerConfig::watermark_publish_timeout_ms`].
pub const DEFAULT_WATERMARK_PUBLISH_TIMEOUT_MS: u64 = 5_000;
/// Range of [`ConsumerConfig::watermark_publish_timeout_ms`].
pub const LIMIT_WATERMARK_PUBLISH_TIMEOUT_MS: std::ops::RangeInclusive<u64> = 100..=120_000;
/// Most topics one consumer subscribes to.
pub const LIMIT_TOPICS: usize = 100;

/// librdkafka properties the consumer sets itself and refuses to take from
/// [`ConsumerConfig::kafka`]: offsets are stored and committed only after the
/// receipt transaction commits.
pub const RESERVED_KAFKA_PROPERTIES: &[&str] = &["group.id", "bootstrap.servers", "enable.auto.commit", "enable.auto.offset.store", "session.timeout.ms"];

/// How handler failures are retried, and how long anything may take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Handler runs per event before it is dead-lettered (1 = no retry).
    pub max_attempts: u32,
    /// Wait before the second attempt; doubles per attempt.
    pub initial_backoff_ms: u64,
    /// Longest wait between attempts.
    pub max_backoff_ms: u64,
    /// Longest one handler run may take; a timeout is a transient failure.
    pub handler_timeout_ms: u64,
    /// Tries of a batch whose *database* work (not the handler) fails with a
    /// retryable error, before the consumer stops with that error.
    pub db_max_attempts: u32,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: DEFAULT_HANDLER_MAX_ATTEMPTS,
            initial_backoff_ms: DEFAULT_INITIAL_BACKOFF_MS,
            max_backoff_ms: DEFAULT_MAX_BACKOFF_MS,
            handler_timeout_ms: DEFAULT_HANDLER_TIMEOUT_MS,
            db_max_attempts: DEFAULT_DB_MAX_ATTEMPTS,
        }
    }
}

impl RetryPolicy {
    /// The wait after failed attempt number `attempt` (1-based):
    /// `initial_backoff_ms * 2^(attempt-1)`, at most `max_backoff_ms`.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(32);
        let ms = self.initial_backoff_ms.saturating_mul(1u64 << exp).min(self.max_backoff_ms);
        Duration::from_millis(ms)
    }

    /// Checks every number against its limit.
    pub fn validate(&self) -> Result<(), ConsumerError> {
        let bad = |m: String| Err(ConsumerError::Config(m));
        if !(1..=LIMIT_HANDLER_MAX_ATTEMPTS).contains(&self.max_attempts) {
            return bad(format!("max_attempts {} (1..={LIMIT_HANDLER_MAX_ATTEMPTS})", self.max_attempts));
        }
        if self.initial_backoff_ms > LIMIT_BACKOFF_MS || self.max_backoff_ms > LIMIT_BACKOFF_MS {
            return bad(format!("backoff over {LIMIT_BACKOFF_MS} ms"));
        }
        if self.initial_backoff_ms > self.max_backoff_ms {
            return bad(format!("initial_backoff_ms {} > max_backoff_ms {}", self.initial_backoff_ms, self.max_backoff_ms));
        }
        if !(1..=LIMIT_HANDLER_TIMEOUT_MS).contains(&self.handler_timeout_ms) {
            return bad(format!("handler_timeout_ms {} (1..={LIMIT_HANDLER_TIMEOUT_MS})", self.handler_timeout_ms));
        }
        if !(1..=LIMIT_HANDLER_MAX_ATTEMPTS).contains(&self.db_max_attempts) {
            return bad(format!("db_max_attempts {} (1..={LIMIT_HANDLER_MAX_ATTEMPTS})", self.db_max_attempts));
        }
        Ok(())
    }
}

/// Everything an [`IdempotentConsumer`](crate::IdempotentConsumer) needs.
/// `Debug` never shows a secret: neither a key nor the value of a
/// secret-bearing librdkafka property ([`is_secret_kafka_property`]).
#[derive(Clone, PartialEq, Eq)]
pub struct ConsumerConfig {
    /// Logical consumer identity: the first half of every receipt key. Keep it
    /// stable for the life of the consumer; changing it replays everything.
    pub consumer_id: String,
    /// Kafka consumer group (default: `consumer_id`).
    pub group_id: String,
    /// Kafka `bootstrap.servers`.
    pub bootstrap_servers: String,
    /// Topics to subscribe to.
    pub topics: Vec<String>,
    /// Most messages of one partition decided in one database transaction.
    pub max_batch_messages: usize,
    /// Most message bytes (key + value + headers) in one transaction.
    pub max_batch_bytes: usize,
    /// Messages read ahead per partition before that partition is paused.
    pub max_buffered_per_partition: usize,
    /// Handler retries and time limits.
    pub retry: RetryPolicy,
    /// Kafka group session timeout.
    pub session_timeout_ms: u64,
    /// How long [`run`](crate::IdempotentConsumer::run) waits for in-flight
    /// batches after shutdown is requested, before abandoning them (they are
    /// rolled back or, if committed, redelivered as duplicates).
    pub shutdown_timeout_ms: u64,
    /// Largest quarantined payload stored verbatim (larger: digest and size only).
    pub max_evidence_payload_bytes: usize,
    /// The compacted topic the consumer publishes its watermarks to, on the
    /// cluster it reads (`None`: it does not publish them over the broker).
    /// Default [`outbox_core::watermark_record::DEFAULT_TOPIC`].
    pub watermark_topic: Option<String>,
    /// Pause between two publications of every watermark row.
    pub watermark_publish_interval_ms: u64,
    /// Longest wait for the broker's answers to one publication, and for the
    /// last one at shutdown.
    pub watermark_publish_timeout_ms: u64,
    /// Signs every published watermark record (headers
    /// `outbox-watermark-key-id` and `outbox-watermark-signature`: HMAC-SHA256
    /// of the record's value bytes). `None` (the default): unsigned. The
    /// reconciler's side verifies with the same key id and secret. `Debug`
    /// never shows the secret.
    pub watermark_signing_key: Option<outbox_core::trust::SigningKey>,
    /// Extra librdkafka properties (security, `auto.offset.reset`,
    /// `partition.assignment.strategy`, ...). [`RESERVED_KAFKA_PROPERTIES`]
    /// are refused. `auto.offset.reset` defaults to `earliest`.
    pub kafka: BTreeMap<String, String>,
    /// Accepted sources per topic and verification keys per source. Empty
    /// (the default): any source is accepted, and the consumer says so at start.
    pub trust: crate::trust::TrustPolicy,
    /// A replay (a scratch run: a new group, another database, the same
    /// consumer id): it publishes no watermark record, whatever
    /// `watermark_topic` says, so the production consumer's watermarks are
    /// not moved by what the replay decided. Default `false`.
    pub replay: bool,
}

/// Whether a librdkafka property carries a secret (a password, a private
/// key, a token, a configuration that may hold one): its value is shown as
/// `***` by `ConsumerConfig`'s `Debug`.
pub fn is_secret_kafka_property(key: &str) -> bool {
    let k = key.trim().to_ascii_lowercase();
    ["password", "secret", "token", "jaas", "oauthbearer.config", "ssl.key.pem", "ssl_key", "keystore", "sasl.oauthbearer.extensions", "credential"]
        .iter()
        .any(|s| k.contains(s))
}

impl std::fmt::Debug for ConsumerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kafka: BTreeMap<&str, &str> = self.kafka.iter().map(|(k, v)| (k.as_str(), if is_secret_kafka_property(k) { "***" } else { v.as_str() })).collect();
        f.debug_struct("ConsumerConfig")
            .field("consumer_id", &self.consumer_id)
            .field("group_id", &self.group_id)
            .field("bootstrap_servers", &self.bootstrap_servers)
            .field("topics", &self.topics)
            .field("max_batch_messages", &self.max_batch_messages)
            .field("max_batch_bytes", &self.max_batch_bytes)
            .field("max_buffered_per_partition", &self.max_buffered_per_partition)
            .field("retry", &self.retry)
            .field("session_timeout_ms", &self.session_timeout_ms)
            .field("shutdown_timeout_ms", &self.shutdown_timeout_ms)
            .field("max_evidence_payload_bytes", &self.max_evidence_payload_bytes)
            .field("watermark_topic", &self.watermark_topic)
            .field("watermark_publish_interval_ms", &self.watermark_publish_interval_ms)
            .field("watermark_publish_timeout_ms", &self.watermark_publish_timeout_ms)
            .field("watermark_signing_key", &self.watermark_signing_key)
            .field("kafka", &kafka)
            .field("trust", &self.trust)
            .field("replay", &self.replay)
            .finish()
    }
}

impl ConsumerConfig {
    /// A configuration with every default.
    pub fn new(consumer_id: impl Into<String>, bootstrap_servers: impl Into<String>, topics: &[&str]) -> Self {
        let consumer_id = consumer_id.into();
        ConsumerConfig {
            group_id: consumer_id.clone(),
            consumer_id,
            bootstrap_servers: bootstrap_servers.into(),
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            max_batch_messages: DEFAULT_MAX_BATCH_MESSAGES,
            max_batch_bytes: DEFAULT_MAX_BATCH_BYTES,
            max_buffered_per_partition: DEFAULT_MAX_BUFFERED_PER_PARTITION,
            retry: RetryPolicy::default(),
            session_timeout_ms: DEFAULT_SESSION_TIMEOUT_MS,
            shutdown_timeout_ms: DEFAULT_SHUTDOWN_TIMEOUT_MS,
            max_evidence_payload_bytes: DEFAULT_MAX_EVIDENCE_PAYLOAD_BYTES,
            watermark_topic: Some(outbox_core::watermark_record::DEFAULT_TOPIC.to_owned()),
            watermark_publish_interval_ms: DEFAULT_WATERMARK_PUBLISH_INTERVAL_MS,
            watermark_publish_timeout_ms: DEFAULT_WATERMARK_PUBLISH_TIMEOUT_MS,
            watermark_signing_key: None,
            kafka: BTreeMap::new(),
            trust: crate::trust::TrustPolicy::default(),
            replay: false,
        }
    }

    /// Reads the configuration from the environment (tests read
    /// `OUTBOX_TEST_KAFKA_BOOTSTRAP` instead, through `outbox-testkit`, never
    /// these):
    ///
    /// | variable | field | default |
    /// |---|---|---|
    /// | `OUTBOX_CONSUMER_ID` | `consumer_id` | required |
    /// | `OUTBOX_CONSUMER_GROUP_ID` | `group_id` | `consumer_id` |
    /// | `OUTBOX_KAFKA_BOOTSTRAP` (the CLI's and the producer's name; `OUTBOX_KAFKA_BOOTSTRAP_SERVERS` is a deprecated alias, read with a warning) | `bootstrap_servers` | required |
    /// | `OUTBOX_CONSUMER_TOPICS` (comma-separated) | `topics` | required |
    /// | `OUTBOX_CONSUMER_MAX_BATCH_MESSAGES` | `max_batch_messages` | 500 |
    /// | `OUTBOX_CONSUMER_MAX_BATCH_BYTES` | `max_batch_bytes` | 8 MiB |
    /// | `OUTBOX_CONSUMER_MAX_BUFFERED_PER_PARTITION` | `max_buffered_per_partition` | 2000 |
    /// | `OUTBOX_CONSUMER_MAX_ATTEMPTS` | `retry.max_attempts` | 5 |
    /// | `OUTBOX_CONSUMER_INITIAL_BACKOFF_MS` | `retry.initial_backoff_ms` | 200 |
    /// | `OUTBOX_CONSUMER_MAX_BACKOFF_MS` | `retry.max_backoff_ms` | 10000 |
    /// | `OUTBOX_CONSUMER_HANDLER_TIMEOUT_MS` | `retry.handler_timeout_ms` | 30000 |
    /// | `OUTBOX_CONSUMER_SESSION_TIMEOUT_MS` | `session_timeout_ms` | 10000 |
    /// | `OUTBOX_CONSUMER_SHUTDOWN_TIMEOUT_MS` | `shutdown_timeout_ms` | 10000 |
    /// | `OUTBOX_CONSUMER_WATERMARK_TOPIC` (empty: off) | `watermark_topic` | `outbox.watermarks` |
    /// | `OUTBOX_CONSUMER_WATERMARK_PUBLISH_INTERVAL_MS` | `watermark_publish_interval_ms` | 5000 |
    /// | `OUTBOX_CONSUMER_WATERMARK_PUBLISH_TIMEOUT_MS` | `watermark_publish_timeout_ms` | 5000 |
    /// | `OUTBOX_CONSUMER_WATERMARK_SIGNING_KEY_ID` with `OUTBOX_CONSUMER_WATERMARK_SIGNING_SECRET_HEX` (32..=128 hex digits; both or neither) | `watermark_signing_key` | unsigned |
    /// | `OUTBOX_CONSUMER_REPLAY` (`true`/`1`: a replay that publishes no watermark record) | `replay` | `false` |
    /// | `OUTBOX_CONSUMER_KAFKA_<PROPERTY>` | `kafka`: `<property>` lower-cased, `_` → `.` | |
    /// | `OUTBOX_CONSUMER_ACCEPT_SOURCES` (space-separated `TOPIC=SOURCE`) | `trust.topics` | any source |
    /// | `OUTBOX_CONSUMER_REQUIRE_SIGNATURE` (comma-separated topics) | `trust.topics[..].require_signature` | none |
    /// | `OUTBOX_CONSUMER_VERIFY_KEYS` (space-separated `SOURCE=KEY_ID=HEX`) | `trust.keys` | none |
    pub fn from_env() -> Result<Self, ConsumerError> {
        Self::from_lookup(|k| std::env::var(k).ok(), std::env::vars())
    }

    fn from_lookup(get: impl Fn(&str) -> Option<String>, all: impl Iterator<Item = (String, String)>) -> Result<Self, ConsumerError> {
        let required = |k: &str| get(k).filter(|v| !v.is_empty()).ok_or_else(|| ConsumerError::Config(format!("{k} is not set")));
        let topics_text = required("OUTBOX_CONSUMER_TOPICS")?;
        let topics: Vec<&str> = topics_text.split(',').map(str::trim).filter(|t| !t.is_empty()).collect();
        let bootstrap = match get(BOOTSTRAP_ENV).filter(|v| !v.trim().is_empty()) {
            Some(b) => b,
            None => match get(DEPRECATED_BOOTSTRAP_ENV).filter(|v| !v.trim().is_empty()) {
                Some(b) => {
                    tracing::warn!("{DEPRECATED_BOOTSTRAP_ENV} is deprecated: set {BOOTSTRAP_ENV} (the name the CLI and the producer read)");
                    b
                }
                None => return Err(ConsumerError::Config(format!("{BOOTSTRAP_ENV} is not set"))),
            },
        };
        let mut c = ConsumerConfig::new(required("OUTBOX_CONSUMER_ID")?, bootstrap.trim(), &topics);
        if let Some(g) = get("OUTBOX_CONSUMER_GROUP_ID") {
            c.group_id = g;
        }
        fn num<T: std::str::FromStr>(get: &impl Fn(&str) -> Option<String>, k: &str, slot: &mut T) -> Result<(), ConsumerError> {
            if let Some(v) = get(k) {
                *slot = v.trim().parse().map_err(|_| ConsumerError::Config(format!("{k}={v:?} is not a number")))?;
            }
            Ok(())
        }
        num(&get, "OUTBOX_CONSUMER_MAX_BATCH_MESSAGES", &mut c.max_batch_messages)?;
        num(&get, "OUTBOX_CONSUMER_MAX_BATCH_BYTES", &mut c.max_batch_bytes)?;
        num(&get, "OUTBOX_CONSUMER_MAX_BUFFERED_PER_PARTITION", &mut c.max_buffered_per_partition)?;
        num(&get, "OUTBOX_CONSUMER_MAX_ATTEMPTS", &mut c.retry.max_attempts)?;
        num(&get, "OUTBOX_CONSUMER_INITIAL_BACKOFF_MS", &mut c.retry.initial_backoff_ms)?;
        num(&get, "OUTBOX_CONSUMER_MAX_BACKOFF_MS", &mut c.retry.max_backoff_ms)?;
        num(&get, "OUTBOX_CONSUMER_HANDLER_TIMEOUT_MS", &mut c.retry.handler_timeout_ms)?;
        num(&get, "OUTBOX_CONSUMER_SESSION_TIMEOUT_MS", &mut c.session_timeout_ms)?;
        num(&get, "OUTBOX_CONSUMER_SHUTDOWN_TIMEOUT_MS", &mut c.shutdown_timeout_ms)?;
        c.trust = trust_from_lookup(&get)?;
        if let Some(t) = get("OUTBOX_CONSUMER_WATERMARK_TOPIC") {
            c.watermark_topic = Some(t.trim().to_owned()).filter(|t| !t.is_empty());
        }
        if let Some(v) = get("OUTBOX_CONSUMER_REPLAY") {
            c.replay = match v.trim().to_ascii_lowercase().as_str() {
                "" | "0" | "false" | "no" => false,
                "1" | "true" | "yes" => true,
                _ => return Err(ConsumerError::Config(format!("OUTBOX_CONSUMER_REPLAY={v:?} is not true or false"))),
            };
        }
        num(&get, "OUTBOX_CONSUMER_WATERMARK_PUBLISH_INTERVAL_MS", &mut c.watermark_publish_interval_ms)?;
        num(&get, "OUTBOX_CONSUMER_WATERMARK_PUBLISH_TIMEOUT_MS", &mut c.watermark_publish_timeout_ms)?;
        let key_id = get("OUTBOX_CONSUMER_WATERMARK_SIGNING_KEY_ID").filter(|v| !v.trim().is_empty());
        let secret = get("OUTBOX_CONSUMER_WATERMARK_SIGNING_SECRET_HEX").filter(|v| !v.trim().is_empty());
        match (key_id, secret) {
            (Some(key_id), Some(secret_hex)) => {
                // The error names the key id, never the secret.
                let key = outbox_core::trust::SigningKey::from_hex(key_id.trim(), &secret_hex).map_err(|e| ConsumerError::Config(format!("OUTBOX_CONSUMER_WATERMARK_SIGNING_SECRET_HEX: {e}")))?;
                c.watermark_signing_key = Some(key);
            }
            (None, None) => {}
            _ => return Err(ConsumerError::Config("set both OUTBOX_CONSUMER_WATERMARK_SIGNING_KEY_ID and OUTBOX_CONSUMER_WATERMARK_SIGNING_SECRET_HEX, or neither".into())),
        }
        for (k, v) in all {
            if let Some(prop) = k.strip_prefix("OUTBOX_CONSUMER_KAFKA_") {
                c.kafka.insert(prop.to_ascii_lowercase().replace('_', "."), v);
            }
        }
        c.validate()?;
        Ok(c)
    }

    /// The librdkafka configuration of this consumer's client: its group,
    /// offsets stored and committed by the consumer only, then
    /// [`ConsumerConfig::kafka`]. Shown for checks (e.g. that TLS settings
    /// reach the client); its secrets are not masked.
    pub fn client_config(&self) -> rdkafka::config::ClientConfig {
        let mut k = rdkafka::config::ClientConfig::new();
        k.set("bootstrap.servers", &self.bootstrap_servers)
            .set("group.id", &self.group_id)
            .set("client.id", &self.consumer_id)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false")
            .set("auto.offset.reset", "earliest")
            .set("session.timeout.ms", self.session_timeout_ms.to_string());
        for (key, value) in &self.kafka {
            k.set(key, value);
        }
        k
    }

    /// Checks identifiers and every limit.
    pub fn validate(&self) -> Result<(), ConsumerError> {
        let id = |field: &'static str, v: &str| validate_identifier(field, v).map_err(|e| ConsumerError::Config(e.to_string()));
        id("consumerId", &self.consumer_id)?;
        id("groupId", &self.group_id)?;
        if self.bootstrap_servers.trim().is_empty() {
            return Err(ConsumerError::Config("bootstrap_servers is empty".into()));
        }
        if self.topics.is_empty() || self.topics.len() > LIMIT_TOPICS {
            return Err(ConsumerError::Config(format!("{} topics (1..={LIMIT_TOPICS})", self.topics.len())));
        }
        for t in &self.topics {
            id("topic", t)?;
        }
        let range = |name: &str, v: usize, max: usize| {
            if (1..=max).contains(&v) {
                Ok(())
            } else {
                Err(ConsumerError::Config(format!("{name} {v} (1..={max})")))
            }
        };
        range("max_batch_messages", self.max_batch_messages, LIMIT_MAX_BATCH_MESSAGES)?;
        range("max_batch_bytes", self.max_batch_bytes, LIMIT_MAX_BATCH_BYTES)?;
        range("max_buffered_per_partition", self.max_buffered_per_partition, LIMIT_MAX_BUFFERED_PER_PARTITION)?;
        range("max_evidence_payload_bytes", self.max_evidence_payload_bytes.max(1), LIMIT_MAX_BATCH_BYTES)?;
        if !(1_000..=3_600_000).contains(&self.session_timeout_ms) {
            return Err(ConsumerError::Config(format!("session_timeout_ms {} (1000..=3600000)", self.session_timeout_ms)));
        }
        if self.shutdown_timeout_ms > 3_600_000 {
            return Err(ConsumerError::Config(format!("shutdown_timeout_ms {} (..=3600000)", self.shutdown_timeout_ms)));
        }
        if let Some(t) = &self.watermark_topic {
            id("watermark_topic", t)?;
            if self.topics.contains(t) {
                return Err(ConsumerError::Config(format!("watermark_topic {t:?} is also a subscribed topic")));
            }
        }
        if !LIMIT_WATERMARK_PUBLISH_INTERVAL_MS.contains(&self.watermark_publish_interval_ms) {
            return Err(ConsumerError::Config(format!("watermark_publish_interval_ms {} ({LIMIT_WATERMARK_PUBLISH_INTERVAL_MS:?})", self.watermark_publish_interval_ms)));
        }
        if !LIMIT_WATERMARK_PUBLISH_TIMEOUT_MS.contains(&self.watermark_publish_timeout_ms) {
            return Err(ConsumerError::Config(format!("watermark_publish_timeout_ms {} ({LIMIT_WATERMARK_PUBLISH_TIMEOUT_MS:?})", self.watermark_publish_timeout_ms)));
        }
        if let Some(k) = self.kafka.keys().find(|k| RESERVED_KAFKA_PROPERTIES.contains(&k.as_str())) {
            return Err(ConsumerError::Config(format!("kafka property {k:?} is set by the consumer itself")));
        }
        self.trust.validate()?;
        self.retry.validate()
    }
}

/// The variables that carry a consumer's trust policy: accepted sources per
/// topic, topics that require a signature, verification keys. Read by
/// [`ConsumerConfig::from_env`] and [`TrustPolicy::from_env`](crate::TrustPolicy::from_env);
/// a consumer built otherwise is refused while any of them is set and its
/// policy is not theirs ([`ConsumerConfig::check_trust_environment`]).
pub const TRUST_ENV: [&str; 3] = ["OUTBOX_CONSUMER_ACCEPT_SOURCES", "OUTBOX_CONSUMER_REQUIRE_SIGNATURE", "OUTBOX_CONSUMER_VERIFY_KEYS"];

impl crate::trust::TrustPolicy {
    /// The trust policy the environment's [`TRUST_ENV`] variables describe
    /// (formats as in [`ConsumerConfig::from_env`]); empty, accepting any
    /// source, when none is set. For a configuration built in code:
    /// `config.trust = TrustPolicy::from_env()?`.
    pub fn from_env() -> Result<Self, ConsumerError> {
        trust_from_lookup(&|k| std::env::var(k).ok())
    }
}

impl ConsumerConfig {
    /// Refuses this configuration when the environment sets a trust
    /// variable ([`TRUST_ENV`]) and [`ConsumerConfig::trust`] is not the
    /// policy the variables describe. A configuration built with
    /// [`ConsumerConfig::new`] reads no environment: without this check a
    /// service that sets `OUTBOX_CONSUMER_ACCEPT_SOURCES` and builds its
    /// configuration in code would run open while its operators believe it
    /// verifies sources. [`IdempotentConsumer::new`](crate::IdempotentConsumer::new) calls it.
    pub fn check_trust_environment(&self) -> Result<(), ConsumerError> {
        check_trust_lookup(&self.trust, &|k| std::env::var(k).ok())
    }
}

fn check_trust_lookup(trust: &crate::trust::TrustPolicy, get: &impl Fn(&str) -> Option<String>) -> Result<(), ConsumerError> {
    let set: Vec<&str> = TRUST_ENV.iter().copied().filter(|k| get(k).is_some_and(|v| !v.trim().is_empty())).collect();
    if set.is_empty() || trust_from_lookup(get)? == *trust {
        return Ok(());
    }
    Err(ConsumerError::Config(format!(
        "{} set in the environment, but this configuration's trust policy is not the one the variables describe \
         (a ConsumerConfig built with ConsumerConfig::new reads no environment): build it with ConsumerConfig::from_env, \
         or set config.trust = TrustPolicy::from_env()?, or unset the variables",
        set.join(", ")
    )))
}

/// The trust policy from `OUTBOX_CONSUMER_ACCEPT_SOURCES`,
/// `OUTBOX_CONSUMER_REQUIRE_SIGNATURE` and `OUTBOX_CONSUMER_VERIFY_KEYS`.
/// Sources and key ids hold no spaces and topics no `=`, so the formats are
/// unambiguous; an error never repeats a secret.
fn trust_from_lookup(get: &impl Fn(&str) -> Option<String>) -> Result<crate::trust::TrustPolicy, ConsumerError> {
    let mut t = crate::trust::TrustPolicy::default();
    for entry in get("OUTBOX_CONSUMER_ACCEPT_SOURCES").unwrap_or_default().split_whitespace() {
        let (topic, source) = entry.split_once('=').ok_or_else(|| ConsumerError::Config(format!("OUTBOX_CONSUMER_ACCEPT_SOURCES: {entry:?} is not TOPIC=SOURCE")))?;
        t = t.accept(topic, &[source], false);
    }
    for topic in get("OUTBOX_CONSUMER_REQUIRE_SIGNATURE").unwrap_or_default().split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let rule = t.topics.get_mut(topic).ok_or_else(|| ConsumerError::Config(format!("OUTBOX_CONSUMER_REQUIRE_SIGNATURE: topic {topic} has no accepted source in OUTBOX_CONSUMER_ACCEPT_SOURCES")))?;
        rule.require_signature = true;
    }
    for (i, entry) in get("OUTBOX_CONSUMER_VERIFY_KEYS").unwrap_or_default().split_whitespace().enumerate() {
        let bad = || ConsumerError::Config(format!("OUTBOX_CONSUMER_VERIFY_KEYS: entry {} is not SOURCE=KEY_ID=HEX", i + 1));
        let mut parts = entry.rsplitn(3, '=');
        let (hex, key_id, source) = (parts.next().ok_or_else(bad)?, parts.next().ok_or_else(bad)?, parts.next().ok_or_else(bad)?);
        let key = outbox_core::trust::SigningKey::from_hex(key_id, hex).map_err(|e| ConsumerError::Config(format!("OUTBOX_CONSUMER_VERIFY_KEYS: entry {}: {e}", i + 1)))?;
        t = t.with_key(source, key);
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A configuration built in code while the trust variables are set is
    /// refused unless its policy is theirs; with none set, any policy goes.
    #[test]
    fn trust_variables_with_a_config_built_by_new_are_not_ignored() {
        let env = |pairs: &'static [(&'static str, &'static str)]| move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| (*v).to_owned());
        let open = ConsumerConfig::new("c", "b:9092", &["orders"]);
        let set = env(&[("OUTBOX_CONSUMER_ACCEPT_SOURCES", "orders=urn:uuid:a")]);
        let err = check_trust_lookup(&open.trust, &set).unwrap_err().to_string();
        assert!(err.contains("OUTBOX_CONSUMER_ACCEPT_SOURCES set in the environment") && err.contains("TrustPolicy::from_env"), "{err}");
        // The same policy given in code is accepted.
        let mut same = open.clone();
        same.trust = crate::trust::TrustPolicy::default().accept("orders", &["urn:uuid:a"], false);
        check_trust_lookup(&same.trust, &set).unwrap();
        // A stricter or other policy in code is refused too: the choice is the operator's to make in one place.
        let mut other = open.clone();
        other.trust = crate::trust::TrustPolicy::default().accept("orders", &["urn:uuid:b"], false);
        assert!(check_trust_lookup(&other.trust, &set).is_err());
        // Nothing set: whatever the code says.
        check_trust_lookup(&other.trust, &env(&[])).unwrap();
        check_trust_lookup(&open.trust, &env(&[("OUTBOX_CONSUMER_VERIFY_KEYS", " ")])).unwrap();
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let p = RetryPolicy { initial_backoff_ms: 100, max_backoff_ms: 350, ..RetryPolicy::default() };
        let ms: Vec<u128> = (1..=5).map(|a| p.backoff(a).as_millis()).collect();
        assert_eq!(ms, vec![100, 200, 350, 350, 350]);
        assert_eq!(p.backoff(u32::MAX).as_millis(), 350);
    }

    #[test]
    fn config_limits_are_enforced() {
        let ok = ConsumerConfig::new("billing", "127.0.0.1:9092", &["orders"]);
        ok.validate().unwrap();
        let mut c = ok.clone();
        c.consumer_id = "bad id".into();
        assert!(c.validate().is_err());
        let mut c = ok.clone();
        c.max_batch_messages = 0;
        assert!(c.validate().is_err());
        let mut c = ok.clone();
        c.kafka.insert("enable.auto.commit".into(), "true".into());
        assert!(c.validate().is_err());
        let mut c = ok.clone();
        c.retry.max_attempts = 0;
        assert!(c.validate().is_err());
        let mut c = ok.clone();
        c.watermark_publish_interval_ms = 0;
        assert!(c.validate().is_err());
        let mut c = ok.clone();
        c.watermark_topic = Some("orders".into());
        assert!(c.validate().is_err());
        let mut c = ok;
        c.topics.clear();
        assert!(c.validate().is_err());
    }

    #[test]
    fn config_from_env_lookup() {
        let env = [
            ("OUTBOX_CONSUMER_ID", "billing"),
            ("OUTBOX_KAFKA_BOOTSTRAP", "k:9092"),
            ("OUTBOX_CONSUMER_TOPICS", "orders, payments"),
            ("OUTBOX_CONSUMER_MAX_ATTEMPTS", "3"),
            ("OUTBOX_CONSUMER_KAFKA_SECURITY_PROTOCOL", "ssl"),
        ];
        let get = |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| (*v).to_owned());
        let all = env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned()));
        let c = ConsumerConfig::from_lookup(get, all).unwrap();
        assert_eq!(c.topics, vec!["orders", "payments"]);
        assert_eq!(c.group_id, "billing");
        assert_eq!(c.retry.max_attempts, 3);
        assert_eq!(c.kafka.get("security.protocol").map(String::as_str), Some("ssl"));
        assert_eq!(c.bootstrap_servers, "k:9092");
        assert_eq!(c.watermark_topic.as_deref(), Some(outbox_core::watermark_record::DEFAULT_TOPIC));
        assert_eq!(c.watermark_publish_interval_ms, DEFAULT_WATERMARK_PUBLISH_INTERVAL_MS);
        let off = ConsumerConfig::from_lookup(
            |k| match k {
                "OUTBOX_CONSUMER_WATERMARK_TOPIC" => Some(String::new()),
                "OUTBOX_CONSUMER_WATERMARK_PUBLISH_INTERVAL_MS" => Some("250".into()),
                _ => get(k),
            },
            std::iter::empty(),
        )
        .unwrap();
        assert_eq!((off.watermark_topic, off.watermark_publish_interval_ms), (None, 250));
        assert!(!c.replay);
        let replay = |v: &str| ConsumerConfig::from_lookup(|k| if k == "OUTBOX_CONSUMER_REPLAY" { Some(v.to_owned()) } else { get(k) }, std::iter::empty());
        assert!(replay("true").unwrap().replay && replay("1").unwrap().replay && !replay("false").unwrap().replay);
        assert!(replay("maybe").unwrap_err().to_string().contains("OUTBOX_CONSUMER_REPLAY"));
        let bad = ConsumerConfig::from_lookup(|k| if k == "OUTBOX_CONSUMER_ID" { None } else { get(k) }, std::iter::empty());
        assert!(bad.is_err());
        // The old name still works (deprecated), and the new one wins over it.
        let old = |k: &str| match k {
            "OUTBOX_KAFKA_BOOTSTRAP" => None,
            "OUTBOX_KAFKA_BOOTSTRAP_SERVERS" => Some("old:9092".to_owned()),
            _ => get(k),
        };
        assert_eq!(ConsumerConfig::from_lookup(old, std::iter::empty()).unwrap().bootstrap_servers, "old:9092");
        let both = |k: &str| if k == "OUTBOX_KAFKA_BOOTSTRAP_SERVERS" { Some("old:9092".to_owned()) } else { get(k) };
        assert_eq!(ConsumerConfig::from_lookup(both, std::iter::empty()).unwrap().bootstrap_servers, "k:9092");
        let none = |k: &str| if k.starts_with("OUTBOX_KAFKA_BOOTSTRAP") { None } else { get(k) };
        assert!(ConsumerConfig::from_lookup(none, std::iter::empty()).unwrap_err().to_string().contains("OUTBOX_KAFKA_BOOTSTRAP"));
        assert!(c.trust.is_open());
    }

    #[test]
    fn trust_from_env_lookup() {
        let secret = "0b".repeat(32);
        let keys = format!("urn:uuid:a=k-old={} urn:uuid:a=k-new={secret}", "0a".repeat(32));
        let env = [
            ("OUTBOX_CONSUMER_ID", "billing".to_owned()),
            ("OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "k:9092".to_owned()),
            ("OUTBOX_CONSUMER_TOPICS", "orders,payments".to_owned()),
            ("OUTBOX_CONSUMER_ACCEPT_SOURCES", "orders=urn:uuid:a orders=urn:uuid:b payments=urn:uuid:a".to_owned()),
            ("OUTBOX_CONSUMER_REQUIRE_SIGNATURE", "orders".to_owned()),
            ("OUTBOX_CONSUMER_VERIFY_KEYS", keys),
        ];
        let lookup = |env: Vec<(&'static str, String)>| {
            let get = move |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
            ConsumerConfig::from_lookup(get, std::iter::empty())
        };
        // orders requires a signature but urn:uuid:b has no key: refused.
        let err = lookup(env.to_vec()).unwrap_err().to_string();
        assert!(err.contains("urn:uuid:b has no verification key"), "{err}");
        let mut ok = env.to_vec();
        ok[3].1 = "orders=urn:uuid:a payments=urn:uuid:a".into();
        let c = lookup(ok.clone()).unwrap();
        assert!(c.trust.topics["orders"].require_signature && !c.trust.topics["payments"].require_signature);
        assert_eq!(c.trust.keys["urn:uuid:a"].keys().collect::<Vec<_>>(), vec!["k-new", "k-old"]);
        assert!(!format!("{c:?}").contains(&secret), "no secret in Debug");
        let mut bad = ok.clone();
        bad[5].1 = format!("urn:uuid:a=k-new={}zz", "0b".repeat(31));
        let err = lookup(bad).unwrap_err().to_string();
        assert!(err.contains("entry 1") && !err.contains("0b0b"), "{err}");
        let mut bad = ok;
        bad[4].1 = "refunds".into();
        assert!(lookup(bad).is_err());
    }

    #[test]
    fn watermark_signing_key_from_env_lookup() {
        let secret = "5e".repeat(32);
        let base = [("OUTBOX_CONSUMER_ID", "billing".to_owned()), ("OUTBOX_KAFKA_BOOTSTRAP", "k:9092".to_owned()), ("OUTBOX_CONSUMER_TOPICS", "orders".to_owned())];
        let lookup = |extra: &[(&'static str, String)]| {
            let env: Vec<(&str, String)> = base.iter().cloned().chain(extra.iter().cloned()).collect();
            ConsumerConfig::from_lookup(move |k| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone()), std::iter::empty())
        };
        assert_eq!(lookup(&[]).unwrap().watermark_signing_key, None);
        let c = lookup(&[("OUTBOX_CONSUMER_WATERMARK_SIGNING_KEY_ID", "wm-1".into()), ("OUTBOX_CONSUMER_WATERMARK_SIGNING_SECRET_HEX", secret.clone())]).unwrap();
        let key = c.watermark_signing_key.as_ref().unwrap();
        assert_eq!(key, &outbox_core::trust::SigningKey::from_hex("wm-1", &secret).unwrap());
        assert!(!format!("{c:?}").contains("5e5e"), "no secret in Debug: {c:?}");
        let err = lookup(&[("OUTBOX_CONSUMER_WATERMARK_SIGNING_KEY_ID", "wm-1".into())]).unwrap_err().to_string();
        assert!(err.contains("both"), "{err}");
        let err = lookup(&[("OUTBOX_CONSUMER_WATERMARK_SIGNING_SECRET_HEX", secret.clone())]).unwrap_err().to_string();
        assert!(err.contains("both"), "{err}");
        let short = "5e".repeat(8);
        let err = lookup(&[("OUTBOX_CONSUMER_WATERMARK_SIGNING_KEY_ID", "wm-1".into()), ("OUTBOX_CONSUMER_WATERMARK_SIGNING_SECRET_HEX", short)]).unwrap_err().to_string();
        assert!(err.contains("wm-1") && !err.contains("5e5e"), "{err}");
    }
}
