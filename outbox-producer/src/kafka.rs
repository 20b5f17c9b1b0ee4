//! The Kafka broker adapter: [`outbox_core::Broker`] over librdkafka (rdkafka).
//!
//! **Guarantee.** A send reports [`SendOutcome::Acked`] only for a message the
//! cluster acknowledged with `acks=all`, at the position it was written;
//! [`SendOutcome::NotPersisted`] only when librdkafka says the message was
//! *not* persisted (its `NOT_PERSISTED` status, or it never left the client);
//! everything else, notably a request that timed out after the broker may
//! have written it, is [`SendOutcome::Unknown`]. A lookup answers
//! [`LookupOutcome::Absent`] only after reading every offset of the frozen
//! partition from the lower bound to the high watermark captured when the
//! scan began.
//!
//! Pieces:
//! - [`KafkaConfig`]: bootstrap servers and every limit, with units in names.
//! - [`KafkaBroker`]: an idempotent producer (`enable.idempotence=true`,
//!   `acks=all`) on a [`ThreadedProducer`] whose delivery callback reads the
//!   persistence status with `rd_kafka_message_status` and completes a
//!   oneshot channel carried as the delivery opaque. The report is captured
//!   by the channel even while the caller is not polling its future (a
//!   stalled worker), so a late poll still yields the genuine outcome.
//! - Lookup: a fresh, group-less [`BaseConsumer`] assigned to the frozen
//!   partition, bounded in messages and time.
//!
//! ## Lookup
//!
//! A fresh consumer (unique `group.id`, `enable.auto.commit=false`, manual
//! `assign`, `read_uncommitted` since this producer is never transactional)
//! reads the frozen partition:
//! - The range is `[from.offset, high watermark)`, both watermarks read
//!   first. An empty range is `Absent`; the answer says nothing of messages
//!   written after the scan began.
//! - The lower bound is sound only on the log it was read from. When it
//!   has an anchor (the event whose receipt held `from.offset - 1`), that
//!   offset is read first, with a consumer of its own: when it holds
//!   another message, or lies at or past the log's end, the partition is
//!   another log (the cluster replaced by an empty one, a topic without a
//!   recorded id recreated) and is read from offset 0 instead
//!   ([`outbox_core::plan_absence_scan`]), so a message of the new log
//!   below the old bound is found, not declared absent. Such a log that no
//!   longer starts at 0, or an anchor offset that holds no record, is
//!   `Unavailable`.
//! - A log that starts above `from.offset` (truncated), a `from.offset`
//!   above the high watermark with no anchor to tell the log (the topic was
//!   recreated, the cluster replaced, the partition truncated) or a range
//!   in which some offset holds no record (a compacted topic, deleted
//!   records, transaction markers) is `Unavailable` with a reason starting
//!   [`LOG_INCOMPLETE`], never `Absent`.
//! - A `destination.v2` names its topic's id: when the topic now has
//!   another id (deleted and created again under the same name) the lookup
//!   is `Unavailable` with a reason starting [`LOG_INCOMPLETE`] ("the topic
//!   was recreated") before anything is read; when the cluster gives no id
//!   or cannot be asked, `Unavailable` too.
//! - A range wider than [`KafkaConfig::lookup_max_messages`] offsets, a scan
//!   longer than [`KafkaConfig::lookup_timeout_ms`], or any broker or consumer
//!   error is `Unavailable`, never `Absent`. A destination on another cluster
//!   than the connected one is `Unavailable` too.
//! - A message matches when its last `outbox-event-id` header equals the
//!   eventId. Its receipt is [`outbox_core::headers::MessageClaims::receipt`]
//!   of its parsed headers at its real position, with the digest of the
//!   bytes read back, so divergent bytes are quarantined by the receipt
//!   decision. If the other headers do not parse, the receipt is built from
//!   what can be read (generation or 0, attemptId or the nil id, destination
//!   digest header or empty), with the real payload digest and position: the
//!   receipt decision rejects or quarantines it rather than it going unseen.
//!   A key that contradicts the destination header is only logged, since a
//!   receipt has no field for it.
//!
//! **Invariant:** the client never chooses a partition: every record carries
//! the partition of the frozen destination.
//!
//! ## Sends to a `destination.v2`
//!
//! A message whose `outbox-destination` header is a `destination.v2` names
//! the topic id frozen with the event. Before it is handed to librdkafka the
//! topic's current id is checked against it: a topic that now has another
//! id (deleted and created again under the same name) is not the
//! destination's log, and the send is [`SendOutcome::NotPersisted`] with
//! nothing written. The current id is read once per topic per
//! [`TOPIC_ID_CACHE_MS`] ([`KafkaBroker::topic_id`]: a metadata request and
//! a topic description, not one per message); a send that finds no fresh
//! answer waits for the read at most half of
//! [`KafkaConfig::enqueue_timeout_ms`], within its enqueue wait; a lookup's
//! own (always fresh) read of the id replaces it.
//! When the id cannot be read (the cluster gives no topic ids, or does not
//! answer in time) the send goes ahead unchecked (logged at debug): the
//! lookup still refuses to call a range of such a log absent. A recreation
//! less than [`TOPIC_ID_CACHE_MS`] before a send, or between the check and
//! the write, is not caught here; the receipt then names the frozen id, and
//! the bypass scan's lost positions and the lookups report the log's
//! change.
//!
//! **Invariant:** an in-flight slot (see [`KafkaConfig::max_in_flight`]) is
//! released only when librdkafka has reported the message's fate, not when the
//! caller stops waiting.

use outbox_core::Clock as _;
use std::future::Future;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_core::headers;
use outbox_core::{
    sha256_digest, AnchorCheck, AttemptId, Broker, BrokerReceipt, Destination, EventId, LookupOutcome, OutgoingMessage, PartitionScan, ScanFrom, ScannedMessage, SendOutcome,
};
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::client::OAuthToken;
use rdkafka::metadata::Metadata;
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use rdkafka_sys::rd_kafka_msg_status_t;
use tokio::sync::{oneshot, watch, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, error, info, warn};

/// Environment variable read by [`KafkaConfig::from_env`]: the bootstrap
/// servers, `host:port[,host:port...]`.
pub const BOOTSTRAP_ENV: &str = "OUTBOX_KAFKA_BOOTSTRAP";

/// Default [`KafkaConfig::message_timeout_ms`].
pub const DEFAULT_MESSAGE_TIMEOUT_MS: u64 = 30_000;
/// Default [`KafkaConfig::request_timeout_ms`].
pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 10_000;
/// Default [`KafkaConfig::max_in_flight`].
pub const DEFAULT_MAX_IN_FLIGHT: usize = 1_000;
/// Default [`KafkaConfig::enqueue_timeout_ms`].
pub const DEFAULT_ENQUEUE_TIMEOUT_MS: u64 = 5_000;
/// Default [`KafkaConfig::connect_timeout_ms`].
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 10_000;
/// Default [`KafkaConfig::lookup_max_messages`].
pub const DEFAULT_LOOKUP_MAX_MESSAGES: u64 = 1_000_000;
/// Default [`KafkaConfig::lookup_timeout_ms`].
pub const DEFAULT_LOOKUP_TIMEOUT_MS: u64 = 30_000;
/// Default [`KafkaConfig::max_concurrent_lookups`].
pub const DEFAULT_MAX_CONCURRENT_LOOKUPS: usize = 4;
/// Default [`KafkaConfig::producer_stall_ms`].
pub const DEFAULT_PRODUCER_STALL_MS: u64 = 60_000;
/// Default [`KafkaConfig::probe_timeout_ms`].
pub const DEFAULT_PROBE_TIMEOUT_MS: u64 = 5_000;

/// Slack added to the longest time librdkafka may take to report on a
/// message before a send whose report never came is declared
/// [`SendOutcome::Unknown`]. This is only a backstop against a lost report.
const DELIVERY_REPORT_SLACK_MS: u64 = 5_000;
/// librdkafka's default `reconnect.backoff.max.ms`. While a leader is
/// unreachable, expired messages are noticed between reconnect attempts, so
/// a report may come this much after `message.timeout.ms`.
const LIBRDKAFKA_RECONNECT_BACKOFF_MAX_MS: u64 = 10_000;
/// Pause between two enqueue attempts while librdkafka's local queue is full.
const ENQUEUE_RETRY_PAUSE_MS: u64 = 10;
/// Longest single consumer poll during a lookup.
const LOOKUP_POLL_SLICE_MS: u64 = 100;
/// How long a topic id read for the send-time check of a `destination.v2`
/// is used, ms (see the [module documentation](self)).
pub const TOPIC_ID_CACHE_MS: u64 = 5_000;

/// librdkafka settings the adapter sets itself and that
/// [`KafkaConfig::extra`] may not override: they carry the guarantees.
const PROTECTED_SETTINGS: &[&str] = &[
    "bootstrap.servers",
    "metadata.broker.list",
    "enable.idempotence",
    "acks",
    "request.required.acks",
    "message.timeout.ms",
    "delivery.timeout.ms",
    "request.timeout.ms",
    "transactional.id",
    "group.id",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "auto.offset.reset",
    "isolation.level",
    "enable.partition.eof",
];

/// Whether a librdkafka setting carries a secret (a password, a private
/// key, a token or a configuration that may hold one). Its value is never
/// printed, logged or echoed in an error: see [`redact_setting`].
pub fn is_secret_setting(key: &str) -> bool {
    let k = key.trim().to_ascii_lowercase();
    ["password", "secret", "token", "jaas", "oauthbearer.config", "ssl.key.pem", "ssl_key", "keystore", "sasl.oauthbearer.extensions", "credential"]
        .iter()
        .any(|s| k.contains(s))
}

/// Splits a raw setting given as `KEY=VALUE` (a `--kafka-setting` flag):
/// the key trimmed, the value as given. `None` without an `=` or with an
/// empty key; a caller's error should not echo the text (it may hold a
/// secret).
pub fn split_setting(kv: &str) -> Option<(String, String)> {
    match kv.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Some((k.trim().to_owned(), v.to_owned())),
        _ => None,
    }
}

/// The value of `key` as it may be shown: `***` for a secret-bearing key.
pub fn redact_setting<'a>(key: &str, value: &'a str) -> &'a str {
    if is_secret_setting(key) {
        "***"
    } else {
        value
    }
}

/// Prefixes of the librdkafka settings that describe the connection to the
/// cluster (security, authentication, sockets, addresses, client identity):
/// [`KafkaConfig::extra`] settings with one of them are applied to the
/// lookup consumers as well as to the producer.
const CONNECTION_SETTING_PREFIXES: &[&str] = &[
    "security.protocol",
    "ssl.",
    "ssl_",
    "sasl.",
    "enable.ssl.",
    "enable.sasl.",
    "https.",
    "socket.",
    "broker.address.",
    "broker.version.fallback",
    "client.id",
    "client.dns.lookup",
    "client.rack",
    "connections.max.idle.ms",
    "reconnect.backoff.",
    "retry.backoff.",
    "metadata.max.age.ms",
    "topic.metadata.refresh.",
    "api.version.request.timeout.ms",
    "resolve.",
    "debug",
    "log.connection.close",
    "log_level",
];

/// Whether `key` describes the connection (see [`KafkaConfig::extra`]).
pub fn is_connection_setting(key: &str) -> bool {
    let k = key.trim();
    CONNECTION_SETTING_PREFIXES.iter().any(|p| k == p.trim_end_matches('.') || k.starts_with(p))
}

/// Configuration of a [`KafkaBroker`]. Every limit has its unit in its name.
#[derive(Clone, PartialEq, Eq)]
pub struct KafkaConfig {
    /// `bootstrap.servers`: `host:port[,host:port...]`.
    pub bootstrap_servers: String,
    /// `message.timeout.ms`: how long librdkafka may try to deliver one
    /// message (queueing, retries, in flight) before reporting it failed.
    /// Default 30 000.
    pub message_timeout_ms: u64,
    /// `request.timeout.ms`: how long one produce request may wait for the
    /// broker's answer. Default 10 000.
    pub request_timeout_ms: u64,
    /// Most messages handed to librdkafka and not yet reported on. A send
    /// beyond the bound waits for a slot (at most `enqueue_timeout_ms`).
    /// Default 1 000.
    pub max_in_flight: usize,
    /// Longest a send waits for an in-flight slot and for room in
    /// librdkafka's local queue before it gives up with
    /// [`SendOutcome::NotPersisted`] (nothing was handed over). Default 5 000.
    pub enqueue_timeout_ms: u64,
    /// Longest [`KafkaBroker::connect`] waits for the cluster id. Default 10 000.
    pub connect_timeout_ms: u64,
    /// Most offsets one lookup may scan; a wider range answers
    /// [`LookupOutcome::Unavailable`]. Default 1 000 000.
    pub lookup_max_messages: u64,
    /// Longest one lookup may take, watermarks included; past it the lookup
    /// answers [`LookupOutcome::Unavailable`]. Default 30 000.
    pub lookup_timeout_ms: u64,
    /// Most lookups scanning at the same time (each uses its own consumer).
    /// Default 4.
    pub max_concurrent_lookups: usize,
    /// How long the producer may go without a single acknowledged message
    /// while it has messages to deliver before it counts as unable to
    /// deliver (see [`KafkaBroker::supervise_once`]: not ready, then
    /// rebuilt). Default 60 000.
    pub producer_stall_ms: u64,
    /// Longest one health probe (a metadata request) may take. Default 5 000.
    pub probe_timeout_ms: u64,
    /// Raw librdkafka settings of the producer (security, client.id,
    /// tuning such as `linger.ms`...). Those that describe the connection
    /// (security, SASL, TLS, sockets, client.id: see
    /// [`is_connection_setting`]) are applied to the lookup consumers too.
    /// The settings the adapter relies on (idempotence, acks, timeouts,
    /// consumer group and offset settings) are refused here; use the typed
    /// fields.
    pub extra: Vec<(String, String)>,
    /// Raw librdkafka settings of the lookup consumers only (e.g.
    /// `fetch.max.bytes`), on top of the connection settings of
    /// [`KafkaConfig::extra`]. The same settings are refused.
    pub lookup_extra: Vec<(String, String)>,
}

impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown = |v: &[(String, String)]| v.iter().map(|(k, v)| format!("{k}={}", redact_setting(k, v))).collect::<Vec<_>>();
        f.debug_struct("KafkaConfig")
            .field("bootstrap_servers", &self.bootstrap_servers)
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
            .field("extra", &shown(&self.extra))
            .field("lookup_extra", &shown(&self.lookup_extra))
            .finish()
    }
}

impl KafkaConfig {
    /// A configuration for `bootstrap_servers` with the default limits.
    pub fn new(bootstrap_servers: impl Into<String>) -> Self {
        KafkaConfig {
            bootstrap_servers: bootstrap_servers.into(),
            message_timeout_ms: DEFAULT_MESSAGE_TIMEOUT_MS,
            request_timeout_ms: DEFAULT_REQUEST_TIMEOUT_MS,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            enqueue_timeout_ms: DEFAULT_ENQUEUE_TIMEOUT_MS,
            connect_timeout_ms: DEFAULT_CONNECT_TIMEOUT_MS,
            lookup_max_messages: DEFAULT_LOOKUP_MAX_MESSAGES,
            lookup_timeout_ms: DEFAULT_LOOKUP_TIMEOUT_MS,
            max_concurrent_lookups: DEFAULT_MAX_CONCURRENT_LOOKUPS,
            producer_stall_ms: DEFAULT_PRODUCER_STALL_MS,
            probe_timeout_ms: DEFAULT_PROBE_TIMEOUT_MS,
            extra: Vec::new(),
            lookup_extra: Vec::new(),
        }
    }

    /// A configuration with the default limits for the bootstrap servers in
    /// the `OUTBOX_KAFKA_BOOTSTRAP` environment variable ([`BOOTSTRAP_ENV`]).
    pub fn from_env() -> Result<Self, KafkaAdapterError> {
        match std::env::var(BOOTSTRAP_ENV) {
            Ok(v) if !v.trim().is_empty() => Ok(KafkaConfig::new(v.trim())),
            Ok(_) => Err(KafkaAdapterError::Config(format!("{BOOTSTRAP_ENV} is empty"))),
            Err(e) => Err(KafkaAdapterError::Config(format!("{BOOTSTRAP_ENV}: {e}"))),
        }
    }

    /// Adds one raw librdkafka setting (see [`KafkaConfig::extra`]).
    pub fn with_setting(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.extra.push((key.into(), value.into()));
        self
    }

    /// Checks the limits and the extra settings.
    pub fn validate(&self) -> Result<(), KafkaAdapterError> {
        let fail = |m: String| Err(KafkaAdapterError::Config(m));
        if self.bootstrap_servers.trim().is_empty() {
            return fail("bootstrap_servers is empty".into());
        }
        let positive: [(&str, u64); 9] = [
            ("producer_stall_ms", self.producer_stall_ms),
            ("probe_timeout_ms", self.probe_timeout_ms),
            ("message_timeout_ms", self.message_timeout_ms),
            ("request_timeout_ms", self.request_timeout_ms),
            ("enqueue_timeout_ms", self.enqueue_timeout_ms),
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("lookup_max_messages", self.lookup_max_messages),
            ("lookup_timeout_ms", self.lookup_timeout_ms),
            ("max_in_flight", self.max_in_flight as u64),
        ];
        for (name, v) in positive {
            if v == 0 {
                return fail(format!("{name} must be positive"));
            }
        }
        if self.max_concurrent_lookups == 0 {
            return fail("max_concurrent_lookups must be positive".into());
        }
        // librdkafka takes these as C ints.
        for (name, v) in [("message_timeout_ms", self.message_timeout_ms), ("request_timeout_ms", self.request_timeout_ms)] {
            if v > i32::MAX as u64 {
                return fail(format!("{name} {v} is too large"));
            }
        }
        if self.max_in_flight > Semaphore::MAX_PERMITS {
            return fail(format!("max_in_flight {} is too large", self.max_in_flight));
        }
        for (k, _) in self.extra.iter().chain(&self.lookup_extra) {
            if k.trim().is_empty() {
                return fail("an extra setting has an empty name".into());
            }
            if PROTECTED_SETTINGS.contains(&k.trim()) {
                return fail(format!("extra setting {k:?} is set by the adapter; use the typed field"));
            }
        }
        Ok(())
    }

    /// The settings the lookup consumers get from [`KafkaConfig::extra`]
    /// and [`KafkaConfig::lookup_extra`], in the order applied.
    pub fn lookup_settings(&self) -> Vec<(String, String)> {
        self.extra.iter().filter(|(k, _)| is_connection_setting(k)).chain(&self.lookup_extra).cloned().collect()
    }

    fn producer_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        for (k, v) in &self.extra {
            c.set(k, v);
        }
        c.set("bootstrap.servers", &self.bootstrap_servers)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("message.timeout.ms", self.message_timeout_ms.to_string())
            .set("request.timeout.ms", self.request_timeout_ms.to_string())
            .set_log_level(RDKafkaLogLevel::Info);
        c
    }

    fn lookup_config(&self, group_id: &str) -> ClientConfig {
        let mut c = ClientConfig::new();
        for (k, v) in self.lookup_settings() {
            c.set(k, v);
        }
        c.set("bootstrap.servers", &self.bootstrap_servers)
            .set("group.id", group_id)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "error")
            .set("enable.partition.eof", "false")
            // Our producer is never transactional: every message it wrote is
            // in the log for good, whatever transactions others run.
            .set("isolation.level", "read_uncommitted")
            .set("check.crcs", "true")
            .set_log_level(RDKafkaLogLevel::Info);
        c
    }
}

/// Errors of the Kafka adapter's setup calls. Sends and lookups never fail
/// with an error: they answer with [`SendOutcome`] and [`LookupOutcome`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaAdapterError {
    /// The configuration is invalid (a limit is zero, a protected setting in `extra`...).
    #[error("kafka adapter configuration: {0}")]
    Config(String),
    /// librdkafka refused to create or use a client. The text never holds
    /// the value of a secret-bearing setting (see [`is_secret_setting`]).
    #[error("kafka client: {0}")]
    Client(String),
    /// After a rebuild the bootstrap servers answer for another cluster:
    /// the events are frozen for the first one, so nothing is sent.
    #[error("the Kafka cluster changed from {expected} to {found}: not sending to it")]
    ClusterChanged {
        /// The cluster id the adapter connected to first.
        expected: String,
        /// The cluster id the bootstrap servers report now.
        found: String,
    },
    /// The cluster did not tell its id within the connect timeout.
    #[error("no cluster id from the Kafka cluster within {timeout_ms} ms{}", last_error.as_deref().map(|e| format!(" (last client error: {e})")).unwrap_or_default())]
    NoClusterId {
        /// The timeout that ran out.
        timeout_ms: u64,
        /// The client's last error meanwhile (a refused connection, a failed
        /// TLS handshake, a failed authentication...), secrets masked.
        last_error: Option<String>,
    },
    /// Topic metadata could not be read or is not usable.
    #[error("kafka metadata: {0}")]
    Metadata(String),
    /// A blocking task of the adapter failed.
    #[error("kafka adapter task: {0}")]
    Task(String),
}

impl From<KafkaError> for KafkaAdapterError {
    fn from(e: KafkaError) -> Self {
        KafkaAdapterError::Client(describe_kafka_error(&e, &[]))
    }
}

/// `e` as text with no secret in it: a configuration error names the
/// setting and says what is wrong, shows the value only for a setting that
/// carries no secret, and every value of `settings` whose key is
/// secret-bearing is replaced by `***` wherever it appears.
pub fn describe_kafka_error(e: &KafkaError, settings: &[(String, String)]) -> String {
    let text = match e {
        KafkaError::ClientConfig(_, desc, key, value) if is_secret_setting(key) => {
            format!("setting {key}: {}", redact_text(desc, &[(key.clone(), value.clone())]))
        }
        KafkaError::ClientConfig(_, desc, key, value) => format!("setting {key} = {value:?}: {desc}"),
        other => other.to_string(),
    };
    redact_text(&text, settings)
}

/// `text` with the value of every secret-bearing setting of `settings` replaced by `***`.
pub fn redact_text(text: &str, settings: &[(String, String)]) -> String {
    let mut out = text.to_owned();
    for (k, v) in settings {
        if is_secret_setting(k) && !v.is_empty() {
            out = out.replace(v.as_str(), "***");
        }
    }
    out
}

impl KafkaAdapterError {
    /// Whether the same call may succeed if retried (the cluster may be
    /// unreachable for now).
    pub fn is_retryable(&self) -> bool {
        matches!(self, KafkaAdapterError::NoClusterId { .. } | KafkaAdapterError::Metadata(_))
    }
}

/// What the delivery callback needs: where to put the outcome, and the
/// in-flight slot to release once librdkafka has reported.
struct Pending {
    tx: oneshot::Sender<SendOutcome>,
    permit: OwnedSemaphorePermit,
}

/// A source of SASL/OAUTHBEARER tokens, for clusters that authenticate with
/// short-lived tokens (AWS MSK IAM, an OIDC provider the service talks to
/// itself...). librdkafka asks for a token when a client starts and again
/// before the previous one expires; `sasl.oauthbearer.config` is passed
/// through. Set `security.protocol=SASL_SSL` and
/// `sasl.mechanism=OAUTHBEARER`, and give the provider to
/// [`KafkaBroker::connect_with_token_provider`]. For OIDC client
/// credentials librdkafka can fetch tokens itself instead
/// (`sasl.oauthbearer.method=oidc`, no provider).
pub trait OAuthTokenProvider: Send + Sync + 'static {
    /// A fresh token. An error is reported to librdkafka, which retries.
    fn token(&self, oauthbearer_config: Option<&str>) -> Result<OAuthBearerToken, String>;
}

/// One OAUTHBEARER token.
#[derive(Clone, PartialEq, Eq)]
pub struct OAuthBearerToken {
    /// The token (often a JWT).
    pub token: String,
    /// The Kafka principal it authenticates.
    pub principal_name: String,
    /// When it expires, ms since the Unix epoch.
    pub lifetime_ms: i64,
}

impl std::fmt::Debug for OAuthBearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OAuthBearerToken").field("token", &"***").field("principal_name", &self.principal_name).field("lifetime_ms", &self.lifetime_ms).finish()
    }
}

type TokenSource = Option<Arc<dyn OAuthTokenProvider>>;

fn oauth_token(tokens: &TokenSource, config: Option<&str>) -> Result<OAuthToken, Box<dyn std::error::Error>> {
    let Some(p) = tokens else { return Err("no OAUTHBEARER token provider".into()) };
    match p.token(config) {
        Ok(t) => {
            debug!(principal = %t.principal_name, lifetime_ms = t.lifetime_ms, "OAUTHBEARER token provided");
            Ok(OAuthToken { token: t.token, principal_name: t.principal_name, lifetime_ms: t.lifetime_ms })
        }
        Err(e) => {
            warn!(error = %e, "OAUTHBEARER token provider failed");
            Err(e.into())
        }
    }
}

/// What the delivery callbacks tell about the producer's ability to
/// deliver, shared by every producer the adapter builds.
#[derive(Debug, Default)]
struct HealthState {
    /// When the last message was acknowledged, ms since the epoch (0: never).
    last_ack_ms: AtomicI64,
    /// When the oldest send not followed by any acknowledgement started
    /// (0: every send so far was followed by one).
    waiting_since_ms: AtomicI64,
    /// A fatal error of the current producer (idempotence broken, fenced...).
    fatal: Mutex<Option<String>>,
    /// The last failed delivery, for the readiness report.
    last_failure: Mutex<Option<String>>,
    /// The last probe: when, and its error.
    probe: Mutex<Option<(i64, Option<String>)>>,
    /// Producers built after the first.
    rebuilds: AtomicU64,
    /// The client's last error (connection, TLS, authentication...).
    last_client_error: Mutex<Option<String>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl HealthState {
    fn note_send(&self) {
        let _ = self.waiting_since_ms.compare_exchange(0, outbox_core::SystemClock.now_ms(), AtomicOrdering::AcqRel, AtomicOrdering::Acquire);
    }

    fn note_outcome(&self, outcome: &SendOutcome) {
        match outcome {
            SendOutcome::Acked { .. } => {
                self.last_ack_ms.store(outbox_core::SystemClock.now_ms(), AtomicOrdering::Release);
                self.waiting_since_ms.store(0, AtomicOrdering::Release);
            }
            SendOutcome::NotPersisted(why) | SendOutcome::Unknown(why) => *lock(&self.last_failure) = Some(why.clone()),
        }
    }
}

/// The producer context: reads the persistence status of each delivery
/// report and completes the send's channel; records fatal errors and
/// deliveries for [`KafkaBroker::producer_health`]; forwards librdkafka logs
/// to tracing; with `OAUTH`, asks the token provider for OAUTHBEARER tokens.
struct DeliveryContext<const OAUTH: bool> {
    health: Arc<HealthState>,
    tokens: TokenSource,
}

impl<const OAUTH: bool> ClientContext for DeliveryContext<OAUTH> {
    const ENABLE_REFRESH_OAUTH_TOKEN: bool = OAUTH;

    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        forward_log(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if matches!(error.rdkafka_error_code(), Some(RDKafkaErrorCode::Fatal)) {
            error!(%error, reason, "kafka producer fatal error: every further send will fail; the producer is rebuilt by its supervisor");
            *lock(&self.health.fatal) = Some(format!("{error}: {reason}"));
        } else {
            warn!(%error, reason, "kafka producer error");
        }
        // "All broker connections are down" follows the error that says why.
        let mut last = lock(&self.health.last_client_error);
        if last.is_none() || !matches!(error.rdkafka_error_code(), Some(RDKafkaErrorCode::AllBrokersDown)) {
            *last = Some(if reason.is_empty() { error.to_string() } else { reason.to_owned() });
        }
    }

    fn generate_oauth_token(&self, config: Option<&str>) -> Result<OAuthToken, Box<dyn std::error::Error>> {
        oauth_token(&self.tokens, config)
    }
}

impl<const OAUTH: bool> ProducerContext for DeliveryContext<OAUTH> {
    type DeliveryOpaque = Box<Pending>;

    fn delivery(&self, result: &DeliveryResult<'_>, pending: Box<Pending>) {
        let outcome = delivery_outcome(result);
        let Pending { tx, permit } = *pending;
        match &outcome {
            SendOutcome::Acked { partition, offset } => debug!(partition, offset, "kafka delivery acked"),
            SendOutcome::NotPersisted(reason) => warn!(reason = %reason, "kafka delivery failed, not persisted"),
            SendOutcome::Unknown(reason) => warn!(reason = %reason, "kafka delivery outcome unknown"),
        }
        self.health.note_outcome(&outcome);
        // The slot is free before anyone can observe the outcome.
        drop(permit);
        if tx.send(outcome).is_err() {
            debug!("kafka delivery report for a send whose caller is gone");
        }
    }
}

struct LookupContext<const OAUTH: bool> {
    tokens: TokenSource,
}

impl<const OAUTH: bool> ClientContext for LookupContext<OAUTH> {
    const ENABLE_REFRESH_OAUTH_TOKEN: bool = OAUTH;

    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        forward_log(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        debug!(%error, reason, "kafka lookup consumer error");
    }

    fn generate_oauth_token(&self, config: Option<&str>) -> Result<OAuthToken, Box<dyn std::error::Error>> {
        oauth_token(&self.tokens, config)
    }
}

impl<const OAUTH: bool> rdkafka::consumer::ConsumerContext for LookupContext<OAUTH> {}

/// The producer, with or without a token provider (librdkafka's refresh
/// hook is chosen by the context's type).
enum AnyProducer {
    Plain(ThreadedProducer<DeliveryContext<false>>),
    OAuth(ThreadedProducer<DeliveryContext<true>>),
}

type Record<'a> = BaseRecord<'a, [u8], [u8], Box<Pending>>;

impl AnyProducer {
    fn create(config: &KafkaConfig, health: &Arc<HealthState>, tokens: &TokenSource) -> Result<AnyProducer, KafkaAdapterError> {
        let cc = config.producer_config();
        let secret = |e: KafkaError| KafkaAdapterError::Client(describe_kafka_error(&e, &config.extra));
        Ok(match tokens {
            None => AnyProducer::Plain(cc.create_with_context(DeliveryContext::<false> { health: health.clone(), tokens: None }).map_err(secret)?),
            Some(_) => AnyProducer::OAuth(cc.create_with_context(DeliveryContext::<true> { health: health.clone(), tokens: tokens.clone() }).map_err(secret)?),
        })
    }

    fn send<'a>(&self, record: Record<'a>) -> Result<(), (KafkaError, Record<'a>)> {
        match self {
            AnyProducer::Plain(p) => p.send(record),
            AnyProducer::OAuth(p) => p.send(record),
        }
    }

    fn fetch_cluster_id(&self, timeout: Duration) -> Option<String> {
        match self {
            AnyProducer::Plain(p) => p.client().fetch_cluster_id(timeout),
            AnyProducer::OAuth(p) => p.client().fetch_cluster_id(timeout),
        }
    }

    fn fetch_metadata(&self, topic: Option<&str>, timeout: Duration) -> Result<Metadata, KafkaError> {
        match self {
            AnyProducer::Plain(p) => p.client().fetch_metadata(topic, timeout),
            AnyProducer::OAuth(p) => p.client().fetch_metadata(topic, timeout),
        }
    }

    fn native(&self) -> *mut rdkafka_sys::rd_kafka_t {
        match self {
            AnyProducer::Plain(p) => p.client().native_ptr(),
            AnyProducer::OAuth(p) => p.client().native_ptr(),
        }
    }

    /// librdkafka's fatal error of this client, if it has one
    /// (`rd_kafka_fatal_error`): every further send fails.
    #[allow(unsafe_code)]
    fn fatal_error(&self) -> Option<String> {
        let mut buf = [0 as std::os::raw::c_char; 512];
        // SAFETY: the handle is live for the call; librdkafka writes at most
        // `buf.len()` bytes, NUL-terminated, into `buf`.
        let err = unsafe { rdkafka_sys::rd_kafka_fatal_error(self.native(), buf.as_mut_ptr(), buf.len()) };
        if RDKafkaErrorCode::from(err) == RDKafkaErrorCode::NoError {
            return None;
        }
        // SAFETY: NUL-terminated by librdkafka within `buf`.
        let text = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned();
        Some(format!("{}: {text}", RDKafkaErrorCode::from(err)))
    }

    /// A metadata request for the brokers and the topics this client
    /// already knows (not every topic of the cluster: a probe every second
    /// must stay cheap on a cluster with thousands of topics).
    #[allow(unsafe_code)]
    fn probe(&self, timeout: Duration) -> Result<(), String> {
        let rk = self.native();
        let timeout_ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        let mut md: *const rdkafka_sys::rd_kafka_metadata = std::ptr::null();
        // SAFETY: `rk` is the live handle of the client `self` owns, for the
        // whole call; `md` is written by librdkafka and freed once below.
        let err = unsafe { rdkafka_sys::rd_kafka_metadata(rk, 0, std::ptr::null_mut(), &mut md, timeout_ms) };
        if !md.is_null() {
            // SAFETY: `md` was returned by rd_kafka_metadata and is freed exactly once.
            unsafe { rdkafka_sys::rd_kafka_metadata_destroy(md) };
        }
        match RDKafkaErrorCode::from(err) {
            RDKafkaErrorCode::NoError => Ok(()),
            code => Err(format!("metadata request: {code}")),
        }
    }

    /// The topic id of `topic` (Kafka's 16-byte topic UUID) from the admin
    /// DescribeTopics API (`rd_kafka_DescribeTopics`), or `None` when the
    /// cluster answers the all-zero id (a broker without topic ids).
    #[allow(unsafe_code)]
    /// The request goes to broker `broker_id` (any broker answers it: it is
    /// a metadata request), not to the controller librdkafka would wait for.
    fn describe_topic_id(&self, topic: &str, broker_id: i32, timeout: Duration) -> Result<Option<[u8; 16]>, String> {
        use rdkafka_sys as sys;
        let name = std::ffi::CString::new(topic).map_err(|_| format!("topic name {topic:?} holds a NUL byte"))?;
        let timeout_ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX).max(1);
        let rk = self.native();
        let mut names = [name.as_ptr()];
        // SAFETY: every object created below is destroyed exactly once on
        // every path; `rk` is the live handle owned by `self` for the whole
        // call; the strings librdkafka returns are copied before the event
        // that owns them is destroyed.
        unsafe {
            let topics = sys::rd_kafka_TopicCollection_of_topic_names(names.as_mut_ptr(), 1);
            if topics.is_null() {
                return Err("DescribeTopics: no topic collection".into());
            }
            let options = sys::rd_kafka_AdminOptions_new(rk, sys::rd_kafka_admin_op_t::RD_KAFKA_ADMIN_OP_DESCRIBETOPICS);
            if !options.is_null() {
                let mut errstr = [0 as std::os::raw::c_char; 256];
                sys::rd_kafka_AdminOptions_set_request_timeout(options, timeout_ms, errstr.as_mut_ptr(), errstr.len());
                sys::rd_kafka_AdminOptions_set_broker(options, broker_id, errstr.as_mut_ptr(), errstr.len());
            }
            let queue = sys::rd_kafka_queue_new(rk);
            sys::rd_kafka_DescribeTopics(rk, topics, options, queue);
            // One result event per request; bounded by the timeout plus a
            // margin (the request timeout answers first).
            let event = sys::rd_kafka_queue_poll(queue, timeout_ms.saturating_add(1_000));
            let out = if event.is_null() {
                Err(format!("DescribeTopics {topic}: no answer within {timeout_ms} ms"))
            } else {
                let r = describe_topics_answer(event, topic);
                sys::rd_kafka_event_destroy(event);
                r
            };
            sys::rd_kafka_queue_destroy(queue);
            if !options.is_null() {
                sys::rd_kafka_AdminOptions_destroy(options);
            }
            sys::rd_kafka_TopicCollection_destroy(topics);
            out
        }
    }

    fn flush(&self, timeout: Duration) -> Result<(), KafkaError> {
        match self {
            AnyProducer::Plain(p) => p.flush(timeout),
            AnyProducer::OAuth(p) => p.flush(timeout),
        }
    }
}

/// Reads the topic id of `topic` out of one DescribeTopics result event.
///
/// # Safety
/// `event` must be a live event returned by `rd_kafka_queue_poll`.
#[allow(unsafe_code)]
unsafe fn describe_topics_answer(event: *mut rdkafka_sys::rd_kafka_event_t, topic: &str) -> Result<Option<[u8; 16]>, String> {
    use rdkafka_sys as sys;
    let text = |p: *const std::os::raw::c_char| if p.is_null() { String::new() } else { std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned() };
    let err = sys::rd_kafka_event_error(event);
    if RDKafkaErrorCode::from(err) != RDKafkaErrorCode::NoError {
        return Err(format!("DescribeTopics {topic}: {}: {}", RDKafkaErrorCode::from(err), text(sys::rd_kafka_event_error_string(event))));
    }
    let result = sys::rd_kafka_event_DescribeTopics_result(event);
    if result.is_null() {
        return Err(format!("DescribeTopics {topic}: not a DescribeTopics result"));
    }
    let mut count = 0usize;
    let descs = sys::rd_kafka_DescribeTopics_result_topics(result, &mut count);
    if descs.is_null() || count == 0 {
        return Err(format!("DescribeTopics {topic}: no topic in the answer"));
    }
    for i in 0..count {
        let d = *descs.add(i);
        if d.is_null() || text(sys::rd_kafka_TopicDescription_name(d)) != topic {
            continue;
        }
        let e = sys::rd_kafka_TopicDescription_error(d);
        if !e.is_null() && RDKafkaErrorCode::from(sys::rd_kafka_error_code(e)) != RDKafkaErrorCode::NoError {
            return Err(format!("DescribeTopics {topic}: {}", text(sys::rd_kafka_error_string(e))));
        }
        let id = sys::rd_kafka_TopicDescription_topic_id(d);
        if id.is_null() {
            return Ok(None);
        }
        let hi = sys::rd_kafka_Uuid_most_significant_bits(id).to_be_bytes();
        let lo = sys::rd_kafka_Uuid_least_significant_bits(id).to_be_bytes();
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&hi);
        bytes[8..].copy_from_slice(&lo);
        return Ok(if bytes == [0u8; 16] { None } else { Some(bytes) });
    }
    Err(format!("DescribeTopics {topic}: topic not in the answer"))
}

fn forward_log(level: RDKafkaLogLevel, fac: &str, message: &str) {
    match level {
        RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical | RDKafkaLogLevel::Error => {
            error!(target: "librdkafka", fac, "{message}")
        }
        RDKafkaLogLevel::Warning => warn!(target: "librdkafka", fac, "{message}"),
        RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => info!(target: "librdkafka", fac, "{message}"),
        RDKafkaLogLevel::Debug => debug!(target: "librdkafka", fac, "{message}"),
    }
}

/// The outcome of one delivery report.
fn delivery_outcome(result: &DeliveryResult<'_>) -> SendOutcome {
    match result {
        Ok(msg) if msg.offset() >= 0 => SendOutcome::Acked { partition: msg.partition(), offset: msg.offset() },
        Ok(msg) => SendOutcome::Unknown(format!("acknowledged without an offset on partition {}", msg.partition())),
        Err((err, msg)) => match persistence_status(msg) {
            rd_kafka_msg_status_t::RD_KAFKA_MSG_STATUS_NOT_PERSISTED => SendOutcome::NotPersisted(format!("{err} (not persisted)")),
            rd_kafka_msg_status_t::RD_KAFKA_MSG_STATUS_POSSIBLY_PERSISTED => SendOutcome::Unknown(format!("{err} (possibly persisted)")),
            // An error report with status PERSISTED: the message is in the
            // log but we have no trustworthy position for it.
            rd_kafka_msg_status_t::RD_KAFKA_MSG_STATUS_PERSISTED => SendOutcome::Unknown(format!("{err} (persisted, reported as failed)")),
        },
    }
}

#[allow(unsafe_code)]
fn persistence_status(msg: &BorrowedMessage<'_>) -> rd_kafka_msg_status_t {
    // SAFETY: `msg.ptr()` points to the librdkafka message of a delivery
    // report, valid for as long as `msg` is borrowed; the call only reads it.
    unsafe { rdkafka_sys::rd_kafka_message_status(msg.ptr()) }
}

/// The result of one attempt to hand a message to librdkafka.
enum Enqueue {
    /// Handed over: the delivery report will complete the channel.
    Queued(oneshot::Receiver<SendOutcome>),
    /// librdkafka's local queue is full: retry with the same slot.
    QueueFull(OwnedSemaphorePermit),
    /// Refused before anything left the client.
    Refused(SendOutcome),
}

struct Inner {
    producer: AnyProducer,
    cluster_id: String,
    config: KafkaConfig,
    in_flight: Arc<Semaphore>,
    lookups: Arc<Semaphore>,
    health: Arc<HealthState>,
    tokens: TokenSource,
}

impl Inner {
    /// A producer for `config`, and the cluster id it reports (which must
    /// be `expected` when given).
    fn build(
        config: KafkaConfig,
        in_flight: Arc<Semaphore>,
        lookups: Arc<Semaphore>,
        health: Arc<HealthState>,
        tokens: TokenSource,
        expected: Option<String>,
    ) -> Result<Inner, KafkaAdapterError> {
        let producer = AnyProducer::create(&config, &health, &tokens)?;
        let timeout = Duration::from_millis(config.connect_timeout_ms);
        let cluster_id = producer.fetch_cluster_id(timeout).filter(|id| !id.is_empty()).ok_or_else(|| KafkaAdapterError::NoClusterId {
            timeout_ms: config.connect_timeout_ms,
            last_error: lock(&health.last_client_error).clone().map(|e| redact_text(&e, &config.extra)),
        })?;
        if let Some(expected) = expected.filter(|e| *e != cluster_id) {
            return Err(KafkaAdapterError::ClusterChanged { expected, found: cluster_id });
        }
        Ok(Inner { producer, cluster_id, config, in_flight, lookups, health, tokens })
    }

    fn enqueue(&self, m: &OutgoingMessage, permit: OwnedSemaphorePermit) -> Enqueue {
        if m.partition < 0 {
            return Enqueue::Refused(SendOutcome::NotPersisted(format!("invalid partition {}", m.partition)));
        }
        let (tx, rx) = oneshot::channel();
        let mut hs = OwnedHeaders::new_with_capacity(m.headers.len());
        for (key, value) in &m.headers {
            hs = hs.insert(Header { key: key.as_str(), value: Some(value.as_slice()) });
        }
        let record: Record<'_> = BaseRecord::with_opaque_to(&m.topic, Box::new(Pending { tx, permit }))
            .partition(m.partition)
            .key(m.key.as_slice())
            .payload(m.payload.as_slice())
            .headers(hs);
        match self.producer.send(record) {
            Ok(()) => {
                self.health.note_send();
                debug!(topic = %m.topic, partition = m.partition, "kafka message enqueued");
                Enqueue::Queued(rx)
            }
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), record)) => {
                let Pending { permit, .. } = *record.delivery_opaque;
                Enqueue::QueueFull(permit)
            }
            Err((e, _record)) => {
                warn!(topic = %m.topic, partition = m.partition, error = %e, "kafka refused to enqueue");
                Enqueue::Refused(SendOutcome::NotPersisted(format!("not enqueued: {e}")))
            }
        }
    }

    /// Drives one send to its outcome, starting from an enqueue attempt made
    /// at call time if there was one; the enqueue wait counts from `started`.
    async fn drive(self: Arc<Self>, message: OutgoingMessage, first: Option<Enqueue>, started: tokio::time::Instant) -> SendOutcome {
        let enqueue_timeout = Duration::from_millis(self.config.enqueue_timeout_ms);
        let deadline = started + enqueue_timeout;
        let mut step = first;
        let rx = loop {
            let attempt = match step.take() {
                Some(a) => a,
                None => {
                    let permit = match tokio::time::timeout_at(deadline, Arc::clone(&self.in_flight).acquire_owned()).await {
                        Ok(Ok(p)) => p,
                        Ok(Err(_)) => return SendOutcome::NotPersisted("kafka adapter closed".into()),
                        Err(_) => {
                            warn!(topic = %message.topic, max_in_flight = self.config.max_in_flight, "no in-flight slot for a send");
                            return SendOutcome::NotPersisted(format!(
                                "no in-flight slot within {} ms ({} in flight)",
                                self.config.enqueue_timeout_ms, self.config.max_in_flight
                            ));
                        }
                    };
                    self.enqueue(&message, permit)
                }
            };
            match attempt {
                Enqueue::Queued(rx) => break rx,
                Enqueue::Refused(outcome) => return outcome,
                Enqueue::QueueFull(permit) => {
                    if tokio::time::Instant::now() >= deadline {
                        warn!(topic = %message.topic, "librdkafka queue full for the whole enqueue timeout");
                        return SendOutcome::NotPersisted(format!("librdkafka queue full for {} ms", self.config.enqueue_timeout_ms));
                    }
                    debug!(topic = %message.topic, "librdkafka queue full, retrying enqueue");
                    tokio::time::sleep(Duration::from_millis(ENQUEUE_RETRY_PAUSE_MS)).await;
                    step = Some(self.enqueue(&message, permit));
                }
            }
        };
        await_report(rx, self.report_backstop()).await
    }

    /// How long a send waits for its delivery report before answering
    /// Unknown: `message_timeout_ms + request_timeout_ms +
    /// reconnect.backoff.max.ms` + slack.
    fn report_backstop(&self) -> Duration {
        let c = &self.config;
        let backoff_ms = c
            .extra
            .iter()
            .rev()
            .find(|(k, _)| k.trim() == "reconnect.backoff.max.ms")
            .and_then(|(_, v)| v.trim().parse::<u64>().ok())
            .unwrap_or(LIBRDKAFKA_RECONNECT_BACKOFF_MAX_MS);
        Duration::from_millis(c.message_timeout_ms.saturating_add(c.request_timeout_ms).saturating_add(backoff_ms).saturating_add(DELIVERY_REPORT_SLACK_MS))
    }
}

/// Waits for a delivery report. A report already in the channel always wins
/// over the backstop, however late the caller polls.
async fn await_report(mut rx: oneshot::Receiver<SendOutcome>, backstop: Duration) -> SendOutcome {
    match tokio::time::timeout(backstop, &mut rx).await {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(_)) => SendOutcome::Unknown("delivery report lost: the producer was closed with the message in flight".into()),
        Err(_) => match rx.try_recv() {
            Ok(outcome) => outcome,
            Err(_) => {
                warn!(backstop_ms = backstop.as_millis() as u64, "no kafka delivery report within the backstop");
                SendOutcome::Unknown(format!("no delivery report within {} ms", backstop.as_millis()))
            }
        },
    }
}

/// The Kafka side of the protocol: an idempotent producer that sends each
/// message to its frozen partition and reports its persistence status, and
/// bounded scans of a partition for an eventId.
///
/// Cheap to clone; clones share the producer and the limits.
///
/// **Supervision.** A producer that cannot deliver (a fatal error such as
/// broken idempotence, or no acknowledgement for
/// [`KafkaConfig::producer_stall_ms`] while it has messages to deliver, e.g.
/// after the cluster was replaced and answers `UnknownProducerId`) is
/// reported by [`KafkaBroker::producer_health`] and
/// [`KafkaBroker::ready`]; [`KafkaBroker::supervise_once`], called
/// periodically, rebuilds it once the cluster answers again. Sends already
/// handed to the old producer keep their delivery reports.
#[derive(Clone)]
pub struct KafkaBroker {
    shared: Arc<Shared>,
}

struct Shared {
    cluster_id: String,
    config: KafkaConfig,
    current: RwLock<Arc<Inner>>,
    rebuilding: tokio::sync::Mutex<()>,
    /// The topic ids sends to a `destination.v2` are checked against.
    topic_ids: Mutex<std::collections::HashMap<String, TopicIdRead>>,
}

/// One read of a topic's current id for the send-time check: when it began,
/// and its answer once there (`Some(None)`: no id could be read: the
/// cluster gives none, or it could not be asked).
#[derive(Clone)]
struct TopicIdRead {
    began: Instant,
    answer: watch::Receiver<Option<Option<String>>>,
}

/// The topic id a message's `outbox-destination` header (the last one)
/// freezes, when it is a `destination.v2` that parses.
fn frozen_topic_id(hs: &[(String, Vec<u8>)]) -> Option<String> {
    let (_, bytes) = hs.iter().rev().find(|(k, _)| k == headers::DESTINATION)?;
    if !bytes.starts_with(outbox_core::envelope::DESTINATION_SCHEMA_V2.as_bytes()) {
        return None;
    }
    Destination::from_canonical(bytes).ok()?.topic_id
}

/// Why a send to `topic` with frozen topic id `frozen` is refused, when the
/// topic's current id is known to be another.
fn recreated(topic: &str, current: Option<&str>, frozen: &str) -> Option<String> {
    match current {
        Some(now) if now != frozen => Some(format!(
            "topic {topic} has id {now}, the destination froze id {frozen}: the topic was recreated, its log is not the destination's; nothing was sent"
        )),
        _ => None,
    }
}

/// What [`KafkaBroker::producer_health`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducerHealth {
    /// The current producer's fatal error, if any.
    pub fatal: Option<String>,
    /// How long the oldest send not followed by any acknowledgement has
    /// waited, ms (`None`: nothing is waiting).
    pub waiting_ms: Option<u64>,
    /// Whether `waiting_ms` exceeds [`KafkaConfig::producer_stall_ms`].
    pub stalled: bool,
    /// The last failed delivery.
    pub last_failure: Option<String>,
    /// When the last message was acknowledged, ms since the epoch.
    pub last_ack_ms: Option<i64>,
    /// The last probe: its age in ms and its error (`None`: never probed).
    pub last_probe: Option<(u64, Option<String>)>,
    /// Producers rebuilt since connect.
    pub rebuilds: u64,
}

impl ProducerHealth {
    /// Why the producer cannot deliver, if it cannot.
    pub fn cannot_deliver(&self) -> Option<String> {
        if let Some(f) = &self.fatal {
            return Some(format!("fatal producer error: {f}"));
        }
        if self.stalled {
            let last = self.last_failure.as_deref().map(|f| format!(" (last failure: {f})")).unwrap_or_default();
            return Some(format!("no delivery acknowledged for {} ms{last}", self.waiting_ms.unwrap_or(0)));
        }
        None
    }
}

/// What one [`KafkaBroker::supervise_once`] found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SupervisionStep {
    /// The cluster answers and the producer delivers (or has nothing to deliver).
    Healthy,
    /// The cluster does not answer (nothing rebuilt: a new producer could not do better).
    BrokerUnreachable(String),
    /// The producer could not deliver while the cluster answered; it was rebuilt.
    Rebuilt {
        /// Why.
        cause: String,
    },
    /// The producer cannot deliver and was not rebuilt (rebuilding was not
    /// asked for, or it failed: the reason is appended).
    CannotDeliver(String),
}

impl std::fmt::Debug for KafkaBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.inner();
        f.debug_struct("KafkaBroker")
            .field("cluster_id", &inner.cluster_id)
            .field("bootstrap_servers", &inner.config.bootstrap_servers)
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

impl KafkaBroker {
    /// Creates the idempotent producer (`enable.idempotence=true`,
    /// `acks=all`) and reads the cluster id, failing with
    /// [`KafkaAdapterError::NoClusterId`] if the cluster does not tell it
    /// within [`KafkaConfig::connect_timeout_ms`].
    pub async fn connect(config: KafkaConfig) -> Result<KafkaBroker, KafkaAdapterError> {
        KafkaBroker::connect_inner(config, None).await
    }

    /// [`KafkaBroker::connect`] with a source of SASL/OAUTHBEARER tokens used
    /// by the producer and the lookup consumers (see [`OAuthTokenProvider`]).
    pub async fn connect_with_token_provider(config: KafkaConfig, provider: Arc<dyn OAuthTokenProvider>) -> Result<KafkaBroker, KafkaAdapterError> {
        KafkaBroker::connect_inner(config, Some(provider)).await
    }

    async fn connect_inner(config: KafkaConfig, tokens: TokenSource) -> Result<KafkaBroker, KafkaAdapterError> {
        config.validate()?;
        let inner = tokio::task::spawn_blocking(move || {
            let in_flight = Arc::new(Semaphore::new(config.max_in_flight));
            let lookups = Arc::new(Semaphore::new(config.max_concurrent_lookups));
            Inner::build(config, in_flight, lookups, Arc::default(), tokens, None)
        })
        .await
        .map_err(|e| KafkaAdapterError::Task(e.to_string()))??;
        info!(cluster_id = %inner.cluster_id, bootstrap = %inner.config.bootstrap_servers, "kafka adapter connected");
        Ok(KafkaBroker {
            shared: Arc::new(Shared {
                cluster_id: inner.cluster_id.clone(),
                config: inner.config.clone(),
                current: RwLock::new(Arc::new(inner)),
                rebuilding: tokio::sync::Mutex::new(()),
                topic_ids: Mutex::default(),
            }),
        })
    }

    fn inner(&self) -> Arc<Inner> {
        self.shared.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The producer's ability to deliver, from its delivery reports and
    /// errors (no I/O).
    pub fn producer_health(&self) -> ProducerHealth {
        let inner = self.inner();
        let h = &inner.health;
        let now = outbox_core::SystemClock.now_ms();
        let since = h.waiting_since_ms.load(AtomicOrdering::Acquire);
        let waiting_ms = (since > 0).then(|| now.saturating_sub(since).max(0) as u64);
        let last_ack = h.last_ack_ms.load(AtomicOrdering::Acquire);
        let fatal = lock(&h.fatal).clone().or_else(|| inner.producer.fatal_error());
        let last_failure = lock(&h.last_failure).clone();
        let last_probe = lock(&h.probe).as_ref().map(|(at, e)| (now.saturating_sub(*at).max(0) as u64, e.clone()));
        ProducerHealth {
            fatal,
            waiting_ms,
            stalled: waiting_ms.is_some_and(|w| w > inner.config.producer_stall_ms),
            last_failure,
            last_ack_ms: (last_ack > 0).then_some(last_ack),
            last_probe,
            rebuilds: h.rebuilds.load(AtomicOrdering::Relaxed),
        }
    }

    /// Raises a fatal error inside librdkafka's current producer with
    /// librdkafka's own test hook (`rd_kafka_test_fatal_error`), as broken
    /// idempotence would: for tests of supervision. Returns whether it was raised.
    #[doc(hidden)]
    #[allow(unsafe_code)]
    pub fn raise_fatal_error_for_tests(&self, reason: &str) -> bool {
        let inner = self.inner();
        let Ok(reason) = std::ffi::CString::new(reason) else { return false };
        // SAFETY: the handle is live for the call (`inner` holds the
        // producer); `reason` is NUL-terminated and outlives the call.
        let err = unsafe {
            rdkafka_sys::rd_kafka_test_fatal_error(inner.producer.native(), rdkafka_sys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER, reason.as_ptr())
        };
        RDKafkaErrorCode::from(err) == RDKafkaErrorCode::NoError
    }

    /// `Ok` while the producer may be trusted with sends: no fatal error, not
    /// stalled, and the last probe (if any) answered. A dispatcher stops
    /// claiming while this is an error.
    pub fn ready(&self) -> Result<(), String> {
        let h = self.producer_health();
        if let Some(why) = h.cannot_deliver() {
            return Err(why);
        }
        match h.last_probe {
            Some((_, Some(e))) => Err(format!("the Kafka cluster does not answer: {e}")),
            _ => Ok(()),
        }
    }

    /// Asks the cluster for its metadata (at most
    /// [`KafkaConfig::probe_timeout_ms`]) and records the answer.
    pub async fn probe(&self) -> Result<(), String> {
        let inner = self.inner();
        let timeout = Duration::from_millis(inner.config.probe_timeout_ms);
        let probed = inner.clone();
        let r = tokio::task::spawn_blocking(move || probed.producer.probe(timeout).map_err(|e| redact_text(&e, &probed.config.extra)))
            .await
            .unwrap_or_else(|e| Err(format!("probe task failed: {e}")));
        *lock(&inner.health.probe) = Some((outbox_core::SystemClock.now_ms(), r.clone().err()));
        r
    }

    /// Replaces the producer by a new one (same configuration, same
    /// cluster). Messages handed to the old producer keep their delivery
    /// reports. Fails with [`KafkaAdapterError::ClusterChanged`] if the
    /// bootstrap servers now answer for another cluster.
    pub async fn rebuild(&self, cause: &str) -> Result<(), KafkaAdapterError> {
        let _one = self.shared.rebuilding.lock().await;
        let old = self.inner();
        let (config, in_flight, lookups, health, tokens, cluster) =
            (old.config.clone(), old.in_flight.clone(), old.lookups.clone(), old.health.clone(), old.tokens.clone(), old.cluster_id.clone());
        let new = tokio::task::spawn_blocking(move || Inner::build(config, in_flight, lookups, health, tokens, Some(cluster)))
            .await
            .map_err(|e| KafkaAdapterError::Task(e.to_string()))??;
        let h = &new.health;
        *lock(&h.fatal) = None;
        h.waiting_since_ms.store(0, AtomicOrdering::Release);
        let n = h.rebuilds.fetch_add(1, AtomicOrdering::Relaxed) + 1;
        warn!(cause, rebuilds = n, cluster_id = %new.cluster_id, "kafka producer rebuilt");
        *self.shared.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(new);
        Ok(())
    }

    /// One supervision step: probe the cluster; if the producer cannot
    /// deliver while the cluster answers, rebuild it (when `rebuild`) and
    /// say so. Call it every second or so (the CLI does).
    pub async fn supervise_once(&self, rebuild: bool) -> SupervisionStep {
        let probe = self.probe().await;
        let cannot = self.producer_health().cannot_deliver();
        match (probe, cannot) {
            (Err(e), _) => SupervisionStep::BrokerUnreachable(e),
            (Ok(()), None) => SupervisionStep::Healthy,
            (Ok(()), Some(cause)) if rebuild => match self.rebuild(&cause).await {
                Ok(()) => SupervisionStep::Rebuilt { cause },
                Err(e) => {
                    error!(cause = %cause, error = %e, "kafka producer could not be rebuilt");
                    SupervisionStep::CannotDeliver(format!("{cause}; rebuild failed: {e}"))
                }
            },
            (Ok(()), Some(cause)) => SupervisionStep::CannotDeliver(cause),
        }
    }

    /// The cluster id the cluster reported at connect.
    pub fn cluster_id(&self) -> &str {
        // Fixed for the adapter's life: a rebuild never changes it.
        &self.shared.cluster_id
    }

    /// The configuration in force.
    pub fn config(&self) -> &KafkaConfig {
        &self.shared.config
    }

    /// Messages handed to librdkafka and not yet reported on.
    pub fn in_flight(&self) -> usize {
        let inner = self.inner();
        inner.config.max_in_flight.saturating_sub(inner.in_flight.available_permits())
    }

    /// Sends one message to its explicit topic and partition and returns a
    /// `'static` future of its outcome, so callers can spawn it.
    ///
    /// If an in-flight slot is free, the message is handed to librdkafka
    /// right here, before the future is polled; otherwise at the future's
    /// first poll, after waiting (at most [`KafkaConfig::enqueue_timeout_ms`])
    /// for a slot. Once handed over, the delivery report is captured whether
    /// or not the future is being polled, and a later poll yields it.
    /// Dropping the future does not withdraw the message.
    ///
    /// A message to a `destination.v2` is first checked against its topic's
    /// current id (see the [module documentation](self)): refused
    /// ([`SendOutcome::NotPersisted`], nothing written) when the topic now
    /// has another id. Without a fresh read of that id at hand, the message
    /// is handed over at the first poll, once the id is read (within the
    /// enqueue wait).
    pub fn send_detached(&self, message: OutgoingMessage) -> impl Future<Output = SendOutcome> + Send + 'static {
        let frozen = frozen_topic_id(&message.headers);
        let (refused, unchecked) = match &frozen {
            None => (None, false),
            Some(f) => match self.cached_topic_id(&message.topic) {
                Some(current) => (recreated(&message.topic, current.as_deref(), f), false),
                None => (None, true),
            },
        };
        let inner = self.inner();
        let first = if refused.is_none() && !unchecked { Arc::clone(&inner.in_flight).try_acquire_owned().ok().map(|permit| inner.enqueue(&message, permit)) } else { None };
        let this = self.clone();
        async move {
            let started = tokio::time::Instant::now();
            if let Some(reason) = refused {
                warn!(topic = %message.topic, %reason, "send refused: the destination's topic was recreated");
                return SendOutcome::NotPersisted(reason);
            }
            let inner = match frozen.filter(|_| unchecked) {
                None => inner,
                Some(frozen) => {
                    let wait = Duration::from_millis(this.shared.config.enqueue_timeout_ms / 2);
                    let current = this.topic_id_for_send(&message.topic, started + wait).await;
                    if let Some(reason) = recreated(&message.topic, current.as_deref(), &frozen) {
                        warn!(topic = %message.topic, %reason, "send refused: the destination's topic was recreated");
                        return SendOutcome::NotPersisted(reason);
                    }
                    this.inner()
                }
            };
            inner.drive(message, first, started).await
        }
    }

    /// Keeps `id`, just read, as the current id of `topic` for the sends.
    fn remember_topic_id(&self, topic: &str, id: Option<String>) {
        let (_, answer) = watch::channel(Some(id));
        lock(&self.shared.topic_ids).insert(topic.to_owned(), TopicIdRead { began: Instant::now(), answer });
    }

    /// The current id of `topic` as read less than [`TOPIC_ID_CACHE_MS`]
    /// ago, when that read has answered (no I/O): `Some(None)` when no id
    /// could be read.
    fn cached_topic_id(&self, topic: &str) -> Option<Option<String>> {
        let reads = lock(&self.shared.topic_ids);
        let read = reads.get(topic).filter(|r| r.began.elapsed() < Duration::from_millis(TOPIC_ID_CACHE_MS))?;
        let answer = read.answer.borrow().clone();
        answer
    }

    /// The current id of `topic` for the send-time check: the answer of a
    /// read begun less than [`TOPIC_ID_CACHE_MS`] ago, or of one begun now
    /// (one read per topic at a time, its answer kept for the others),
    /// waiting for it until `deadline`. `None`: not known (no id, no answer
    /// in time, an error: all logged at debug).
    async fn topic_id_for_send(&self, topic: &str, deadline: tokio::time::Instant) -> Option<String> {
        let mut answer = {
            let mut reads = lock(&self.shared.topic_ids);
            match reads.get(topic).filter(|r| r.began.elapsed() < Duration::from_millis(TOPIC_ID_CACHE_MS)) {
                Some(r) => r.answer.clone(),
                None => {
                    let (tx, rx) = watch::channel(None);
                    reads.insert(topic.to_owned(), TopicIdRead { began: Instant::now(), answer: rx.clone() });
                    let (broker, topic) = (self.clone(), topic.to_owned());
                    tokio::spawn(async move {
                        let id = match broker.topic_id(&topic).await {
                            Ok(id) => {
                                if id.is_none() {
                                    debug!(%topic, "the cluster gives no topic id: sends to destination.v2 are not checked against it");
                                }
                                id
                            }
                            Err(e) => {
                                debug!(%topic, error = %e, "topic id not read: sends to destination.v2 go unchecked until it is");
                                None
                            }
                        };
                        let _ = tx.send(Some(id));
                    });
                    rx
                }
            }
        };
        let id = match tokio::time::timeout_at(deadline, answer.wait_for(Option::is_some)).await {
            Ok(Ok(id)) => id.clone().flatten(),
            _ => {
                debug!(%topic, "topic id not read within the send's wait: sent unchecked");
                None
            }
        };
        id
    }

    /// The partition count of `topic`, from the cluster's metadata (for
    /// checking route policies against the real topic).
    pub async fn partition_count(&self, topic: &str) -> Result<u32, KafkaAdapterError> {
        let inner = self.inner();
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let timeout = Duration::from_millis(inner.config.connect_timeout_ms);
            let md = inner.producer.fetch_metadata(Some(&topic), timeout)?;
            let t = topic_in(&md, &topic)?;
            if t.partitions().is_empty() {
                return Err(KafkaAdapterError::Metadata(format!("topic {topic} has no partitions")));
            }
            u32::try_from(t.partitions().len()).map_err(|_| KafkaAdapterError::Metadata(format!("topic {topic}: too many partitions")))
        })
        .await
        .map_err(|e| KafkaAdapterError::Task(e.to_string()))?
    }

    /// The topic id of `topic` as the cluster reports it now (Kafka's topic
    /// UUID, in its usual text form: URL-safe base64 without padding, 22
    /// characters), or `None` when the cluster gives no topic ids (all-zero
    /// id). A topic deleted and created again under the same name has a new
    /// id. Bounded by [`KafkaConfig::connect_timeout_ms`].
    pub async fn topic_id(&self, topic: &str) -> Result<Option<String>, KafkaAdapterError> {
        let inner = self.inner();
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let timeout = Duration::from_millis(inner.config.connect_timeout_ms);
            let md = inner.producer.fetch_metadata(Some(&topic), timeout)?;
            let t = topic_in(&md, &topic)?;
            // The leader of one of its partitions surely knows the topic.
            let broker_id = t
                .partitions()
                .iter()
                .map(|p| p.leader())
                .find(|l| *l >= 0)
                .or_else(|| md.brokers().first().map(|b| b.id()))
                .ok_or_else(|| KafkaAdapterError::Metadata(format!("topic {topic}: no broker in metadata")))?;
            inner
                .producer
                .describe_topic_id(&topic, broker_id, timeout)
                .map(|id| id.map(|b| outbox_core::envelope::topic_id_text(&b)))
                .map_err(|e| KafkaAdapterError::Metadata(redact_text(&e, &inner.config.extra)))
        })
        .await
        .map_err(|e| KafkaAdapterError::Task(e.to_string()))?
    }

    /// Waits (at most `timeout_ms`) until every message handed to librdkafka
    /// has been reported on.
    pub async fn flush(&self, timeout_ms: u64) -> Result<(), KafkaAdapterError> {
        let inner = self.inner();
        tokio::task::spawn_blocking(move || inner.producer.flush(Duration::from_millis(timeout_ms)))
            .await
            .map_err(|e| KafkaAdapterError::Task(e.to_string()))?
            .map_err(KafkaAdapterError::from)
    }
}

#[async_trait]
impl Broker for KafkaBroker {
    fn cluster_id(&self) -> &str {
        &self.shared.cluster_id
    }

    /// Hands the message to librdkafka at the first poll (see
    /// [`KafkaBroker::send_detached`]) and waits for its delivery report.
    async fn send(&self, message: OutgoingMessage) -> SendOutcome {
        self.send_detached(message).await
    }

    fn supports_lookup(&self) -> bool {
        true
    }

    /// The enqueue wait plus the delivery-report backstop: past it librdkafka
    /// has given up on the message, so it can no longer be written.
    fn max_in_flight_ms(&self) -> Option<u64> {
        let backstop = u64::try_from(self.inner().report_backstop().as_millis()).unwrap_or(u64::MAX);
        Some(self.shared.config.enqueue_timeout_ms.saturating_add(backstop))
    }

    /// Scans `destination.topic` / `destination.partition` from
    /// `from.offset` (raised to the low watermark; from 0 when its anchor
    /// shows the bound was read from another log) to the high watermark read
    /// at the start, for messages whose `outbox-event-id` header is
    /// `event_id`. See the [module documentation](self) for what a match reports.
    async fn lookup(&self, destination: &Destination, event_id: &EventId, from: &ScanFrom) -> LookupOutcome {
        if destination.cluster_id != self.shared.cluster_id {
            return LookupOutcome::Unavailable(format!(
                "destination is on cluster {}, this adapter is connected to {}",
                destination.cluster_id, self.shared.cluster_id
            ));
        }
        let timeout = Duration::from_millis(self.shared.config.lookup_timeout_ms);
        let started = Instant::now();
        // A destination.v2 names its topic's identity: the partition's log is
        // that destination's only while the topic still has that id.
        if let Some(frozen) = &destination.topic_id {
            let current = match tokio::time::timeout(timeout, self.topic_id(&destination.topic)).await {
                Ok(Ok(id)) => {
                    // The freshest answer there is: sends check against it too.
                    self.remember_topic_id(&destination.topic, id.clone());
                    id
                }
                Ok(Err(e)) => return LookupOutcome::Unavailable(format!("reading the topic id of {}: {e}", destination.topic)),
                Err(_) => return LookupOutcome::Unavailable(format!("no topic id for {} within {} ms", destination.topic, timeout.as_millis())),
            };
            match current {
                Some(now) if &now == frozen => {}
                Some(now) => {
                    return LookupOutcome::Unavailable(format!(
                        "{LOG_INCOMPLETE}topic {} has id {now}, the destination froze id {frozen}: the topic was recreated, its log is not the destination's",
                        destination.topic
                    ))
                }
                None => {
                    return LookupOutcome::Unavailable(format!(
                        "the cluster gives no topic id for {}, the destination froze id {frozen}: cannot tell whether the topic was recreated",
                        destination.topic
                    ))
                }
            }
        }
        let permit = match tokio::time::timeout(timeout.saturating_sub(started.elapsed()), Arc::clone(&self.inner().lookups).acquire_owned()).await {
            Ok(Ok(p)) => p,
            Ok(Err(_)) => return LookupOutcome::Unavailable("kafka adapter closed".into()),
            Err(_) => return LookupOutcome::Unavailable(format!("no lookup slot within {} ms", timeout.as_millis())),
        };
        let deadline = started + timeout;
        let scan = ScanRequest {
            tokens: self.inner().tokens.clone(),
            cluster_id: self.shared.cluster_id.clone(),
            topic: destination.topic.clone(),
            partition: destination.partition,
            event_id: event_id.clone(),
            from: from.clone(),
            max_messages: self.shared.config.lookup_max_messages,
            deadline,
        };
        let config = self.shared.config.clone();
        let outcome = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            scan_partition(&config, &scan)
        })
        .await;
        match outcome {
            Ok(o) => {
                debug!(event_id = %event_id, topic = %destination.topic, partition = destination.partition, outcome = ?o, "kafka lookup");
                o
            }
            Err(e) => LookupOutcome::Unavailable(format!("lookup task failed: {e}")),
        }
    }

    /// Reads the eventId header of up to `max_messages` messages of
    /// `topic`/`partition` from `from_offset`, for the bypass check.
    async fn scan_event_ids(&self, topic: &str, partition: i32, from_offset: i64, max_messages: u64) -> Result<PartitionScan, String> {
        let timeout = Duration::from_millis(self.shared.config.lookup_timeout_ms);
        let permit = match tokio::time::timeout(timeout, Arc::clone(&self.inner().lookups).acquire_owned()).await {
            Ok(Ok(p)) => p,
            _ => return Err("no lookup slot".into()),
        };
        let req = ScanRequest {
            tokens: self.inner().tokens.clone(),
            cluster_id: self.shared.cluster_id.clone(),
            topic: topic.to_owned(),
            partition,
            event_id: EventId::from_parts(0, 0),
            from: ScanFrom::at(from_offset),
            max_messages: max_messages.min(self.shared.config.lookup_max_messages),
            deadline: Instant::now() + timeout,
        };
        let config = self.shared.config.clone();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let mut messages = Vec::new();
            let (next_offset, log_start, log_end) = scan_range(&config, &req, Some(req.max_messages), |msg| {
                let hs = message_headers(msg);
                messages.push(ScannedMessage::read(&req.cluster_id, msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.payload().unwrap_or_default(), &hs));
            })?;
            Ok(PartitionScan { messages, next_offset, log_end: Some(log_end), log_start: Some(log_start) })
        })
        .await
        .map_err(|e| format!("scan task failed: {e}"))?
    }
}

/// One bounded scan.
struct ScanRequest {
    tokens: TokenSource,
    cluster_id: String,
    topic: String,
    partition: i32,
    event_id: EventId,
    /// Where to read from; for a lookup, with the bound's anchor.
    from: ScanFrom,
    max_messages: u64,
    deadline: Instant,
}

impl ScanRequest {
    fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }
}

/// `topic`'s entry in `md`, or why the cluster gave none usable.
fn topic_in<'m>(md: &'m rdkafka::metadata::Metadata, topic: &str) -> Result<&'m rdkafka::metadata::MetadataTopic, KafkaAdapterError> {
    let t = md.topics().iter().find(|t| t.name() == topic).ok_or_else(|| KafkaAdapterError::Metadata(format!("topic {topic} not in metadata")))?;
    match t.error() {
        Some(e) => Err(KafkaAdapterError::Metadata(format!("topic {topic}: {}", RDKafkaErrorCode::from(e)))),
        None => Ok(t),
    }
}

static LOOKUP_SEQ: AtomicU64 = AtomicU64::new(0);

/// How the reason of a lookup that found the log incomplete (truncated,
/// recreated, compacted) begins: see [`is_log_incomplete`].
pub use outbox_core::reconcile::LOG_INCOMPLETE;

/// Whether an [`LookupOutcome::Unavailable`] reason says the log itself
/// cannot prove absence (truncated, recreated, compacted), as opposed to a
/// broker that could not be asked: the reconciler reports it as the finding
/// `log_unavailable`.
pub fn is_log_incomplete(reason: &str) -> bool {
    reason.starts_with(LOG_INCOMPLETE)
}

/// Scans one partition with a fresh consumer; see the module documentation.
///
/// - The range is `[max(from_offset, low watermark), high watermark)`, with
///   both watermarks read first; an empty range is `Absent`. A range wider
///   than `lookup_max_messages` offsets, a deadline that runs out or any
///   broker or consumer error is `Unavailable`.
/// - A message matches when its last `outbox-event-id` header equals the
///   eventId. Its receipt is `MessageClaims::receipt` of its parsed headers
///   at its real position, with the digest of the bytes read back. If the
///   headers do not parse, the receipt is built from what can be read (the
///   generation or 0, the attemptId or the nil id, the destination digest
///   header or empty) with the real payload digest and position, so the
///   receipt decision rejects or quarantines it rather than it going unseen.
/// - Messages whose placement or key contradict their destination header are
///   still reported (the receipt carries the real placement; the decision
///   quarantines a wrong partition); a wrong key is logged as a warning,
///   since a receipt has no field for it.
fn scan_partition(config: &KafkaConfig, req: &ScanRequest) -> LookupOutcome {
    let mut found = Vec::new();
    let scanned = scan_range(config, req, None, |msg| {
        if let Some(receipt) = match_message(&req.cluster_id, &req.event_id, msg) {
            found.push(receipt);
        }
    });
    match scanned {
        Err(what) => {
            warn!(topic = %req.topic, partition = req.partition, event_id = %req.event_id, reason = %what, "kafka lookup unavailable");
            LookupOutcome::Unavailable(what)
        }
        Ok(_) if found.is_empty() => LookupOutcome::Absent,
        Ok(_) => LookupOutcome::Found(found),
    }
}

/// Reads `[max(from_offset, low), end)` of one partition with a fresh
/// consumer, where `end` is the high watermark read at the start, or
/// `from_offset + limit` if that is lower. Calls `on_message` for each
/// message in order and returns the next offset to read and the low and
/// high watermarks read at the start. A range wider than
/// `max_messages` (with no `limit`), a deadline that runs out or any broker
/// error is an `Err`.
fn scan_range(config: &KafkaConfig, req: &ScanRequest, limit: Option<u64>, on_message: impl FnMut(&BorrowedMessage<'_>)) -> Result<(i64, i64, i64), String> {
    if req.from.offset < 0 {
        return Err(format!("negative lower bound {}", req.from.offset));
    }
    if req.tokens.is_some() {
        scan_range_with::<true>(config, req, limit, on_message)
    } else {
        scan_range_with::<false>(config, req, limit, on_message)
    }
}

/// A fresh group-less consumer for one read of the request's partition
/// (its own `group.id`, ending in `suffix`).
fn lookup_consumer<const OAUTH: bool>(config: &KafkaConfig, req: &ScanRequest, suffix: &str) -> Result<BaseConsumer<LookupContext<OAUTH>>, String> {
    let seq = LOOKUP_SEQ.fetch_add(1, AtomicOrdering::Relaxed);
    let group_id = format!("outbox-lookup-{}-{}-{}{suffix}", std::process::id(), seq, req.event_id.as_str());
    config
        .lookup_config(&group_id)
        .create_with_context(LookupContext::<OAUTH> { tokens: req.tokens.clone() })
        .map_err(|e| format!("lookup consumer: {}", describe_kafka_error(&e, &config.lookup_settings())))
}

fn scan_range_with<const OAUTH: bool>(config: &KafkaConfig, req: &ScanRequest, limit: Option<u64>, mut on_message: impl FnMut(&BorrowedMessage<'_>)) -> Result<(i64, i64, i64), String> {
    let consumer = lookup_consumer::<OAUTH>(config, req, "")?;
    let (low, high) = consumer
        .fetch_watermarks(&req.topic, req.partition, req.remaining())
        .map_err(|e| format!("watermarks of {}/{}: {e}", req.topic, req.partition))?;
    // A lookup (no limit) is an absence proof: it must read every offset
    // from the lower bound. A log that starts above the bound was truncated
    // (retention, deleted records) and a bound above the log's end belongs
    // to another log (the topic was recreated, the cluster replaced, the
    // partition truncated): either way messages may be gone unseen.
    let proof = limit.is_none();
    let mut from_offset = req.from.offset;
    if proof {
        let check = match outbox_core::anchor_to_read(&req.from, low, high) {
            Ok((at, _)) => read_anchor::<OAUTH>(config, req, at, &req.from)?,
            Err(known) => known,
        };
        let plan = outbox_core::plan_absence_scan(&req.topic, req.partition, &req.from, low, high, check)?;
        if plan.floor_from_another_log {
            warn!(topic = %req.topic, partition = req.partition, event_id = %req.event_id, lower_bound = req.from.offset, ?check, low, high,
                "kafka lookup: the lower bound was read from another log (the cluster replaced or the topic recreated): reading this log from its start");
        }
        from_offset = plan.start;
    }
    let start = from_offset.max(low).max(0);
    let log_end = high;
    let high = match limit {
        Some(l) => high.min(start.saturating_add(i64::try_from(l).unwrap_or(i64::MAX))),
        None => high,
    };
    if start >= high {
        debug!(topic = %req.topic, partition = req.partition, start, low, high, "kafka scan: empty range");
        return Ok((start.max(from_offset), low, log_end));
    }
    let width = u64::try_from(high - start).unwrap_or(u64::MAX);
    if width > req.max_messages {
        return Err(format!("range [{start}, {high}) of {}/{} exceeds the lookup bound of {} messages", req.topic, req.partition, req.max_messages));
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&req.topic, req.partition, Offset::Offset(start)).map_err(|e| format!("assignment: {e}"))?;
    consumer.assign(&tpl).map_err(|e| format!("assign {}/{}: {e}", req.topic, req.partition))?;
    debug!(topic = %req.topic, partition = req.partition, start, high, "kafka scan");
    let mut next = start;
    let mut read: u64 = 0;
    while next < high {
        let remaining = req.remaining();
        if remaining.is_zero() {
            return Err(format!("scan timed out at offset {next} of [{start}, {high}) of {}/{}", req.topic, req.partition));
        }
        match consumer.poll(remaining.min(Duration::from_millis(LOOKUP_POLL_SLICE_MS))) {
            None | Some(Err(KafkaError::PartitionEOF(_))) => {
                // Offsets without messages (e.g. transaction markers) advance
                // the position without yielding anything.
                if let Some(p) = position_of(&consumer, &req.topic, req.partition) {
                    next = next.max(p);
                }
            }
            Some(Err(e)) => return Err(format!("reading {}/{} at offset {next}: {e}", req.topic, req.partition)),
            Some(Ok(msg)) => {
                if msg.topic() != req.topic || msg.partition() != req.partition || msg.offset() < next {
                    continue;
                }
                if msg.offset() >= high {
                    break;
                }
                // A record above the next expected offset: the offsets in
                // between hold no record (compaction removed them, or
                // transaction markers): the range cannot prove absence.
                if proof {
                    outbox_core::reconcile::check_no_hole(&req.topic, req.partition, next, msg.offset())?;
                }
                next = msg.offset() + 1;
                read += 1;
                if read > req.max_messages {
                    return Err(format!("scan read more than {} messages", req.max_messages));
                }
                on_message(&msg);
            }
        }
    }
    debug!(topic = %req.topic, partition = req.partition, start, high, read, "kafka scan complete");
    Ok((next, low, log_end))
}

/// What offset `at` of the request's partition holds, for the anchor check
/// of an absence proof: read with a consumer of its own (a scan that starts
/// elsewhere must not see its prefetched records).
fn read_anchor<const OAUTH: bool>(config: &KafkaConfig, req: &ScanRequest, at: i64, from: &ScanFrom) -> Result<AnchorCheck, String> {
    let consumer = lookup_consumer::<OAUTH>(config, req, "-anchor")?;
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&req.topic, req.partition, Offset::Offset(at)).map_err(|e| format!("assignment: {e}"))?;
    consumer.assign(&tpl).map_err(|e| format!("assign {}/{}: {e}", req.topic, req.partition))?;
    loop {
        let remaining = req.remaining();
        if remaining.is_zero() {
            return Err(format!("reading the anchor offset {at} of {}/{} timed out", req.topic, req.partition));
        }
        match consumer.poll(remaining.min(Duration::from_millis(LOOKUP_POLL_SLICE_MS))) {
            None | Some(Err(KafkaError::PartitionEOF(_))) => {
                if position_of(&consumer, &req.topic, req.partition).is_some_and(|p| p > at) {
                    return Ok(AnchorCheck::NoRecord);
                }
            }
            Some(Err(e)) => return Err(format!("reading {}/{} at offset {at}: {e}", req.topic, req.partition)),
            Some(Ok(msg)) => {
                if msg.topic() != req.topic || msg.partition() != req.partition || msg.offset() < at {
                    continue;
                }
                if msg.offset() > at {
                    return Ok(AnchorCheck::NoRecord);
                }
                let owned = message_headers(&msg);
                let header = |name: &str| owned.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.as_slice());
                let holds = outbox_core::anchor_holds(from, header(headers::EVENT_ID), header(headers::ATTEMPT_ID));
                return Ok(if holds { AnchorCheck::Holds } else { AnchorCheck::HoldsOther });
            }
        }
    }
}

fn position_of<const OAUTH: bool>(consumer: &BaseConsumer<LookupContext<OAUTH>>, topic: &str, partition: i32) -> Option<i64> {
    let tpl = consumer.position().ok()?;
    match tpl.find_partition(topic, partition)?.offset() {
        Offset::Offset(o) => Some(o),
        _ => None,
    }
}

/// Every header of a message, read without panicking whatever it holds
/// (rdkafka's own accessors panic on a name that is not UTF-8): such a name
/// is decoded lossily, so it can never equal an outbox header name, and the
/// message is read, reported and passed like any other.
pub fn message_headers(msg: &BorrowedMessage<'_>) -> Vec<(String, Vec<u8>)> {
    let Some(h) = msg.headers() else {
        return Vec::new();
    };
    let count = h.count();
    let mut out = Vec::with_capacity(count);
    for idx in 0..count {
        let mut name: *const std::os::raw::c_char = std::ptr::null();
        let mut value: *const std::os::raw::c_void = std::ptr::null();
        let mut size: usize = 0;
        // `BorrowedHeaders` is a zero-sized view whose address is librdkafka's
        // header list (rdkafka casts it the same way).
        let native = h as *const rdkafka::message::BorrowedHeaders as *const rdkafka_sys::rd_kafka_headers_t;
        // SAFETY: the list lives as long as `msg`; the pointers written are
        // borrowed from it and copied out below.
        let err = unsafe { rdkafka_sys::rd_kafka_header_get_all(native, idx, &mut name, &mut value, &mut size) };
        if err != rdkafka_sys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
            continue;
        }
        // SAFETY: header names are NUL-terminated; `value` spans `size` bytes.
        let name = String::from_utf8_lossy(unsafe { std::ffi::CStr::from_ptr(name) }.to_bytes()).into_owned();
        let value = if value.is_null() { Vec::new() } else { unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) }.to_vec() };
        out.push((name, value));
    }
    out
}

/// The topic id the last `outbox-destination` header names, when that
/// header parses as a destination (`None`: a `destination.v1`, or no
/// readable destination).
pub fn destination_topic_id(hs: &[(String, Vec<u8>)]) -> Option<String> {
    let (_, bytes) = hs.iter().rev().find(|(k, _)| k == headers::DESTINATION)?;
    Destination::from_canonical(bytes).ok()?.topic_id
}

/// The receipt of `msg` if its last eventId header is `event_id`; its topic
/// id is the one the message's `outbox-destination` header names.
fn match_message(cluster_id: &str, event_id: &EventId, msg: &BorrowedMessage<'_>) -> Option<BrokerReceipt> {
    let owned = message_headers(msg);
    let hit = owned.iter().rev().find(|(k, _)| k == headers::EVENT_ID)?;
    if hit.1 != event_id.as_str().as_bytes() {
        return None;
    }
    let payload = msg.payload().unwrap_or_default();
    let (topic, partition, offset) = (msg.topic(), msg.partition(), msg.offset());
    Some(match headers::parse(&owned) {
        Ok(claims) => {
            if let Err(e) = claims.check(payload, topic, partition, msg.key()) {
                warn!(event_id = %event_id, topic, partition, offset, error = %e, "kafka lookup: matching message does not verify");
            }
            claims.receipt(cluster_id, topic, partition, offset, payload)
        }
        Err(e) => {
            warn!(event_id = %event_id, topic, partition, offset, error = %e, "kafka lookup: matching message has unreadable headers");
            let text = |name: &str| owned.iter().rev().find(|(k, _)| k == name).and_then(|(_, v)| std::str::from_utf8(v).ok());
            BrokerReceipt {
                event_id: event_id.clone(),
                envelope_generation: text(headers::ENVELOPE_GENERATION).and_then(|v| v.parse().ok()).unwrap_or(0),
                attempt_id: text(headers::ATTEMPT_ID).and_then(|v| v.parse().ok()).unwrap_or_else(|| AttemptId::from_parts(0, 0)),
                payload_digest: sha256_digest(payload),
                destination_digest: text(headers::DESTINATION_DIGEST).unwrap_or_default().to_owned(),
                cluster_id: cluster_id.to_owned(),
                topic: topic.to_owned(),
                topic_id: destination_topic_id(&owned),
                partition,
                offset,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_consumers_get_connection_settings_and_their_own_only() {
        let mut c = KafkaConfig::new("b:1")
            .with_setting("security.protocol", "SASL_SSL")
            .with_setting("sasl.mechanism", "SCRAM-SHA-512")
            .with_setting("ssl.ca.location", "/ca.pem")
            .with_setting("client.id", "orders")
            .with_setting("linger.ms", "5")
            .with_setting("compression.type", "lz4")
            .with_setting("batch.num.messages", "1");
        c.lookup_extra.push(("fetch.max.bytes".into(), "1048576".into()));
        let keys: Vec<String> = c.lookup_settings().into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, ["security.protocol", "sasl.mechanism", "ssl.ca.location", "client.id", "fetch.max.bytes"]);
        let lookup = c.lookup_config("g");
        assert_eq!(lookup.get("linger.ms"), None, "producer-only settings stay off the consumers");
        assert_eq!(lookup.get("compression.type"), None);
        assert_eq!(lookup.get("api.version.request"), None, "deprecated setting not set");
        assert_eq!(lookup.get("security.protocol"), Some("SASL_SSL"));
        let producer = c.producer_config();
        assert_eq!(producer.get("linger.ms"), Some("5"));
        assert_eq!(producer.get("fetch.max.bytes"), None, "lookup settings stay off the producer");
        c.lookup_extra.push(("group.id".into(), "x".into()));
        assert!(c.validate().is_err(), "protected settings are refused in lookup_extra too");
    }

    #[test]
    fn a_setting_splits_at_its_first_equals_sign_and_keeps_its_value_as_given() {
        assert_eq!(split_setting(" linger.ms =0"), Some(("linger.ms".to_owned(), "0".to_owned())));
        assert_eq!(split_setting("sasl.password= a=b "), Some(("sasl.password".to_owned(), " a=b ".to_owned())));
        assert_eq!(split_setting("client.id="), Some(("client.id".to_owned(), String::new())));
        assert_eq!(split_setting("linger.ms"), None);
        assert_eq!(split_setting(" =0"), None);
    }

    #[test]
    fn secrets_never_appear_in_debug_or_errors() {
        let c = KafkaConfig::new("b:1")
            .with_setting("sasl.password", "Planted_Pw_1")
            .with_setting("ssl.key.password", "SslKeyPw_55")
            .with_setting("sasl.oauthbearer.config", "principal=x secret=Planted_Cfg_2")
            .with_setting("sasl.oauthbearer.client.secret", "Planted_Client_3")
            .with_setting("sasl.username", "svc-orders");
        let debug = format!("{c:?}");
        for planted in ["Planted_Pw_1", "SslKeyPw_55", "Planted_Cfg_2", "Planted_Client_3"] {
            assert!(!debug.contains(planted), "{debug}");
        }
        assert!(debug.contains("svc-orders"), "non-secret values are shown: {debug}");
        let e = KafkaError::ClientConfig(rdkafka_sys::types::RDKafkaConfRes::RD_KAFKA_CONF_INVALID, "Invalid value SslKeyPw_55".into(), "ssl.key.password".into(), "SslKeyPw_55".into());
        assert!(e.to_string().contains("SslKeyPw_55"), "librdkafka's own text echoes the value");
        let text = describe_kafka_error(&e, &c.extra);
        assert!(!text.contains("SslKeyPw_55") && text.contains("ssl.key.password"), "{text}");
        let e = KafkaError::ClientCreation("sasl.password Planted_Pw_1 rejected".into());
        assert!(!describe_kafka_error(&e, &c.extra).contains("Planted_Pw_1"));
        let e = KafkaError::ClientConfig(rdkafka_sys::types::RDKafkaConfRes::RD_KAFKA_CONF_UNKNOWN, "No such configuration property".into(), "lingr.ms".into(), "5".into());
        assert!(describe_kafka_error(&e, &[]).contains("lingr.ms = \"5\""), "a non-secret value is shown");
        assert!(format!("{:?}", OAuthBearerToken { token: "Planted_Tok".into(), principal_name: "p".into(), lifetime_ms: 1 }).contains("***"));
    }

    #[tokio::test]
    async fn a_real_client_config_error_does_not_echo_the_secret() {
        let mut c = KafkaConfig::new("127.0.0.1:1").with_setting("security.protocol", "SSL").with_setting("ssl.key.password", "SslKeyPw_55").with_setting("ssl.key.pem", "SslKeyPem_66");
        c.connect_timeout_ms = 500;
        let err = KafkaBroker::connect(c.clone()).await.expect_err("invalid key").to_string();
        eprintln!("{err}");
        assert!(!err.contains("SslKeyPw_55") && !err.contains("SslKeyPem_66"), "{err}");
        c.extra.push(("sasl.mechanism".into(), "SslKeyPw_55".into()));
        c.extra.push(("security.protocol".into(), "SASL_SSL".into()));
        let err = KafkaBroker::connect(c).await.expect_err("invalid mechanism").to_string();
        eprintln!("{err}");
        assert!(!err.contains("SslKeyPw_55"), "{err}");
    }

    #[tokio::test]
    async fn a_report_already_received_wins_over_the_backstop() {
        let (tx, rx) = oneshot::channel();
        assert!(tx.send(SendOutcome::Acked { partition: 1, offset: 9 }).is_ok());
        assert_eq!(await_report(rx, Duration::ZERO).await, SendOutcome::Acked { partition: 1, offset: 9 });
    }

    #[tokio::test]
    async fn a_missing_or_lost_report_is_unknown() {
        let (tx, rx) = oneshot::channel::<SendOutcome>();
        assert!(matches!(await_report(rx, Duration::from_millis(10)).await, SendOutcome::Unknown(_)));
        drop(tx);
        let (tx, rx) = oneshot::channel::<SendOutcome>();
        drop(tx);
        assert!(matches!(await_report(rx, Duration::from_secs(5)).await, SendOutcome::Unknown(_)));
    }
}
