//! The adapter's configuration: the limits' defaults, which librdkafka
//! settings are the adapter's own, carry a secret or describe the
//! connection, and [`KafkaConfig`] with its checks and the librdkafka
//! configurations it makes.

use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use tokio::sync::Semaphore;

use super::error::KafkaAdapterError;
#[cfg(doc)]
use super::KafkaBroker;
#[cfg(doc)]
use outbox_core::{LookupOutcome, SendOutcome};

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

    /// The librdkafka configuration of the producer: [`KafkaConfig::extra`]
    /// first, then the settings the adapter relies on. Shown for checks
    /// (e.g. that TLS settings reach the client); its secrets are not masked.
    pub fn producer_config(&self) -> ClientConfig {
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

    /// The librdkafka configuration of a lookup consumer of group
    /// `group_id`: [`KafkaConfig::lookup_settings`], then the adapter's own.
    pub fn lookup_config(&self, group_id: &str) -> ClientConfig {
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
}
