//! # outbox-config
//!
//! One configuration for the `outbox` CLI and for a service that embeds the
//! SDK: the `outbox.toml` file, or the same settings as `OUTBOX_*`
//! environment variables, loaded and validated at start, and the SDK's own
//! types built from it.
//!
//! ```no_run
//! # fn main() -> Result<(), outbox_config::ConfigError> {
//! let config = outbox_config::Config::from_file("outbox.toml")?; // or Config::from_env()?
//! let database_url = config.database_url()?;
//! let kafka = config.kafka_config()?;             // every [kafka.settings] librdkafka setting
//! let dispatcher = config.dispatcher_config()?;   // [dispatch], [dispatch.signing]
//! let fulfilment = config.consumer_config("fulfilment")?; // [consumer.fulfilment]
//! # let _ = (database_url, kafka, dispatcher, fulfilment); Ok(()) }
//! ```
//!
//! Every error names the setting (`consumer.fulfilment.keys: …`,
//! `OUTBOX_CONSUMER_VERIFY_KEYS: entry 2 …`) and never shows a secret;
//! `Debug` and `Display` mask secrets. The file's sections, the environment
//! variables and the key format are documented in the workspace's
//! `examples/outbox.toml`, in [`mod@env`] and in [`keys`].
#![warn(missing_docs)]

use std::collections::BTreeMap;
use std::path::Path;

use outbox_consumer::ConsumerConfig;
use outbox_core::trust::SigningKey;
use outbox_producer::kafka::KafkaConfig;
use outbox_producer::{DispatcherConfig, WatermarkTopicConfig};
use serde::Deserialize;

pub mod env;
mod error;
pub mod keys;
mod sections;

pub use error::ConfigError;
pub use keys::{KeyList, KeySpec};
pub use sections::{ConsumerSection, KafkaSection, MetricsSection, ReconcileSection, ReportSection, RetentionSection, MAX_SETTINGS, MAX_SETTING_NAME_BYTES, MAX_SETTING_VALUE_BYTES};

use error::{consumer_text, producer_text};

/// Largest configuration file read, bytes.
pub const MAX_FILE_BYTES: u64 = 1024 * 1024;
/// Most `[consumer.<id>]` sections.
pub const MAX_CONSUMERS: usize = 100;
/// Longest database URL, bytes.
pub const MAX_URL_BYTES: usize = 4096;

/// The whole configuration: every section optional, unknown keys refused.
#[derive(Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// PostgreSQL URL of the outbox database.
    pub database_url: Option<String>,
    /// `text` or `json` (the CLI's logs).
    pub log_format: Option<String>,
    /// tracing filter, e.g. `info,outbox_producer=debug` (the CLI's logs).
    pub log: Option<String>,
    /// `[kafka]`: the cluster and every librdkafka setting.
    pub kafka: KafkaSection,
    /// `[dispatch]`: the dispatcher (all of `DispatcherConfig`'s fields,
    /// `[dispatch.signing]` its signing key).
    pub dispatch: Option<DispatcherConfig>,
    /// `[reconcile]`.
    pub reconcile: ReconcileSection,
    /// `[retention]`.
    pub retention: RetentionSection,
    /// `[report]`.
    pub report: ReportSection,
    /// `[metrics]`.
    pub metrics: MetricsSection,
    /// `[consumer.<id>]`: one section per consumer, named by its consumer id.
    pub consumer: BTreeMap<String, ConsumerSection>,
    /// Deprecation notes gathered while loading (also logged at WARN).
    #[serde(skip)]
    warnings: Vec<String>,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("database_url", &self.database_url.as_deref().map(mask_database_url))
            .field("log_format", &self.log_format)
            .field("log", &self.log)
            .field("kafka", &self.kafka)
            .field("dispatch", &self.dispatch)
            .field("reconcile", &self.reconcile)
            .field("retention", &self.retention)
            .field("report", &self.report)
            .field("metrics", &self.metrics)
            .field("consumer", &self.consumer)
            .finish()
    }
}

/// `Display` is `Debug`'s text: every secret masked.
impl std::fmt::Display for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}

/// A PostgreSQL URL with its password as `***` (`postgres://user:***@host/db`).
pub fn mask_database_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    match rest.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

impl Config {
    /// Parses TOML text, without validating (see [`Config::validate`]). An
    /// error names the setting and the line, never the line's text.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        Self::parse_from("config", text)
    }

    fn parse_from(origin: &str, text: &str) -> Result<Self, ConfigError> {
        if text.len() as u64 > MAX_FILE_BYTES {
            return Err(ConfigError::new(origin, format!("{} bytes (..={MAX_FILE_BYTES})", text.len())));
        }
        let mut c: Config = toml::from_str(text).map_err(|e| error::toml_error(origin, text, &e))?;
        c.note_deprecations();
        Ok(c)
    }

    /// Reads and parses `path`, without validating (the CLI validates after
    /// its flags are merged in).
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let origin = path.display().to_string();
        let meta = std::fs::metadata(path).map_err(|e| ConfigError::new(&origin, format!("reading the configuration file: {e}")))?;
        if meta.len() > MAX_FILE_BYTES {
            return Err(ConfigError::new(&origin, format!("{} bytes (..={MAX_FILE_BYTES})", meta.len())));
        }
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::new(&origin, format!("reading the configuration file: {e}")))?;
        Self::parse_from(&origin, &text)
    }

    /// Reads, parses and validates `path`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let c = Self::load(path)?;
        c.validate()?;
        Ok(c)
    }

    /// Parses and validates TOML text.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let c = Self::parse(text)?;
        c.validate()?;
        Ok(c)
    }

    /// The same settings from the environment only (names in [`mod@env`]),
    /// validated.
    pub fn from_env() -> Result<Self, ConfigError> {
        let c = Config::default().with_env()?;
        c.validate()?;
        Ok(c)
    }

    /// `path`, then the environment over it (a variable that is set wins
    /// over the file), validated: the CLI's precedence without flags.
    pub fn from_file_and_env(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let c = Self::load(path)?.with_env()?;
        c.validate()?;
        Ok(c)
    }

    /// Applies the environment's variables over this configuration (see [`mod@env`]).
    pub fn with_env(self) -> Result<Self, ConfigError> {
        self.with_env_lookup(|k| std::env::var(k).ok(), std::env::vars())
    }

    /// [`Config::with_env`] over `get` (a variable by name) and `all` (every
    /// variable, for the prefixed families) instead of the process environment.
    pub fn with_env_lookup(mut self, get: impl Fn(&str) -> Option<String>, all: impl IntoIterator<Item = (String, String)>) -> Result<Self, ConfigError> {
        env::apply(&mut self, &get, &all.into_iter().collect::<Vec<_>>())?;
        self.note_deprecations();
        Ok(self)
    }

    fn note_deprecations(&mut self) {
        if self.reconcile.watermark_keys.as_ref().is_some_and(KeyList::is_legacy) {
            self.warn(
                "reconcile.watermark_keys: the array of \"CONSUMER_ID=KEY_ID=HEX\" strings is deprecated; write a table of consumer id to keys, \
                 [reconcile.watermark_keys] shipping = [{ key_id = \"…\", secret_hex = \"…\" }]",
            );
        }
    }

    pub(crate) fn warn(&mut self, note: &str) {
        if !self.warnings.iter().any(|w| w == note) {
            tracing::warn!("{note}");
            self.warnings.push(note.to_owned());
        }
    }

    /// Deprecation notes gathered while loading (each also logged at WARN once).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The outbox database's URL (`database_url`, `DATABASE_URL`).
    pub fn database_url(&self) -> Result<String, ConfigError> {
        match self.database_url.as_deref().map(str::trim) {
            Some(u) if !u.is_empty() => Ok(u.to_owned()),
            _ => Err(ConfigError::new("database_url", "not set (DATABASE_URL, --database-url)")),
        }
    }

    /// The Kafka adapter's configuration (`[kafka]`), every
    /// `[kafka.settings]` librdkafka setting included.
    pub fn kafka_config(&self) -> Result<KafkaConfig, ConfigError> {
        self.kafka.kafka_config()
    }

    /// The dispatcher's configuration (`[dispatch]`; the defaults without one).
    pub fn dispatcher_config(&self) -> Result<DispatcherConfig, ConfigError> {
        let c = self.dispatch.clone().unwrap_or_default();
        if let Some(s) = &c.signing {
            KeySpec { key_id: s.key_id.clone(), secret_hex: s.secret_hex.clone() }.key("dispatch.signing")?;
        }
        c.validate().map_err(|e| ConfigError::new("dispatch", producer_text(&e)))?;
        Ok(c)
    }

    /// The dispatcher's signing key (`[dispatch.signing]`), if any.
    pub fn signing_key(&self) -> Result<Option<SigningKey>, ConfigError> {
        match self.dispatch.as_ref().and_then(|d| d.signing.as_ref()) {
            None => Ok(None),
            Some(s) => KeySpec { key_id: s.key_id.clone(), secret_hex: s.secret_hex.clone() }.key("dispatch.signing").map(Some),
        }
    }

    /// The consumer ids of the `[consumer.<id>]` sections.
    pub fn consumer_ids(&self) -> Vec<&str> {
        self.consumer.keys().map(String::as_str).collect()
    }

    /// The database of consumer `id`: its `database_url`, else the top-level one.
    pub fn consumer_database_url(&self, id: &str) -> Result<String, ConfigError> {
        let section = self.consumer.get(id).ok_or_else(|| ConfigError::new(format!("consumer.{id}"), "no such section"))?;
        match section.database_url.as_deref().map(str::trim) {
            Some(u) if !u.is_empty() => Ok(u.to_owned()),
            _ => self.database_url().map_err(|_| ConfigError::new(format!("consumer.{id}.database_url"), "not set, and no top-level database_url")),
        }
    }

    /// Consumer `id`'s configuration (`[consumer.<id>]`): its topics and
    /// limits, its trust policy (accepted sources, verification keys), its
    /// watermark publishing, the security, TLS, SASL and socket settings of
    /// `[kafka.settings]` and its own `kafka` settings.
    pub fn consumer_config(&self, id: &str) -> Result<ConsumerConfig, ConfigError> {
        let section = self.consumer.get(id).ok_or_else(|| ConfigError::new(format!("consumer.{id}"), "no such section"))?;
        let bootstrap = self.kafka.bootstrap.as_deref().map(str::trim).filter(|b| !b.is_empty());
        let Some(bootstrap) = bootstrap else {
            return Err(ConfigError::new("kafka.bootstrap", format!("not set, and consumer.{id} needs the cluster (OUTBOX_KAFKA_BOOTSTRAP)")));
        };
        self.build_consumer(id, section, bootstrap)
    }

    /// Every consumer's configuration, by consumer id.
    pub fn consumer_configs(&self) -> Result<BTreeMap<String, ConsumerConfig>, ConfigError> {
        self.consumer.keys().map(|id| Ok((id.clone(), self.consumer_config(id)?))).collect()
    }

    fn build_consumer(&self, id: &str, s: &ConsumerSection, bootstrap: &str) -> Result<ConsumerConfig, ConfigError> {
        let at = |field: &str| format!("consumer.{}.{field}", keys::quote_key(id));
        outbox_core::id::validate_identifier("consumerId", id).map_err(|e| ConfigError::new(format!("consumer.{}", keys::quote_key(id)), e.to_string()))?;
        if s.topics.is_empty() {
            return Err(ConfigError::new(at("topics"), "no topic: list the topics it subscribes to"));
        }
        let topics: Vec<&str> = s.topics.iter().map(|t| t.trim()).collect();
        let mut c = ConsumerConfig::new(id, bootstrap, &topics);
        if let Some(g) = &s.group_id {
            c.group_id = g.trim().to_owned();
        }
        let set = |into: &mut usize, v: Option<usize>| {
            if let Some(v) = v {
                *into = v;
            }
        };
        set(&mut c.max_batch_messages, s.max_batch_messages);
        set(&mut c.max_batch_bytes, s.max_batch_bytes);
        set(&mut c.max_buffered_per_partition, s.max_buffered_per_partition);
        set(&mut c.max_evidence_payload_bytes, s.max_evidence_payload_bytes);
        let set64 = |into: &mut u64, v: Option<u64>| {
            if let Some(v) = v {
                *into = v;
            }
        };
        set64(&mut c.retry.initial_backoff_ms, s.initial_backoff_ms);
        set64(&mut c.retry.max_backoff_ms, s.max_backoff_ms);
        set64(&mut c.retry.handler_timeout_ms, s.handler_timeout_ms);
        set64(&mut c.session_timeout_ms, s.session_timeout_ms);
        set64(&mut c.shutdown_timeout_ms, s.shutdown_timeout_ms);
        set64(&mut c.watermark_publish_interval_ms, s.watermark_publish_interval_ms);
        set64(&mut c.watermark_publish_timeout_ms, s.watermark_publish_timeout_ms);
        if let Some(v) = s.max_attempts {
            c.retry.max_attempts = v;
        }
        if let Some(v) = s.db_max_attempts {
            c.retry.db_max_attempts = v;
        }
        if let Some(t) = &s.watermark_topic {
            c.watermark_topic = Some(t.trim().to_owned()).filter(|t| !t.is_empty());
        }
        if let Some(r) = s.replay {
            c.replay = r;
        }
        if let Some(k) = &s.watermark_signing {
            c.watermark_signing_key = Some(k.key(&at("watermark_signing"))?);
        }
        // Librdkafka settings: the shared connection settings of [kafka.settings], then its own.
        for (k, v) in self.kafka.effective_settings()? {
            if outbox_consumer::SHARED_KAFKA_PROPERTY_PREFIXES.iter().any(|p| k.starts_with(p)) {
                c.kafka.insert(k, v);
            }
        }
        if s.kafka.len() > MAX_SETTINGS {
            return Err(ConfigError::new(at("kafka"), format!("{} settings (..={MAX_SETTINGS})", s.kafka.len())));
        }
        for (k, v) in &s.kafka {
            let k = k.trim();
            if outbox_consumer::RESERVED_KAFKA_PROPERTIES.contains(&k) {
                return Err(ConfigError::new(format!("{}.{}", at("kafka"), keys::quote_key(k)), "set by the consumer itself"));
            }
            if k.is_empty() || k.len() > MAX_SETTING_NAME_BYTES || v.len() > MAX_SETTING_VALUE_BYTES {
                return Err(ConfigError::new(at("kafka"), "a setting's name or value is empty or too long (the value is not shown)"));
            }
            c.kafka.insert(k.to_owned(), v.clone());
        }
        // Trust: accepted sources per topic, signatures, verification keys.
        let mut trust = outbox_consumer::TrustPolicy::default();
        for (topic, sources) in &s.accept {
            if sources.is_empty() {
                return Err(ConfigError::new(format!("{}.{}", at("accept"), keys::quote_key(topic)), "no source: list the sources it accepts"));
            }
            let sources: Vec<&str> = sources.iter().map(|x| x.trim()).collect();
            trust = trust.accept(topic.trim(), &sources, false);
        }
        for topic in &s.require_signature {
            let rule = trust.topics.get_mut(topic.trim()).ok_or_else(|| ConfigError::new(at("require_signature"), format!("topic {topic} has no accepted source in consumer.{id}.accept")))?;
            rule.require_signature = true;
        }
        for (source, made) in keys::resolve(&at("keys"), &s.keys)? {
            for k in made {
                trust = trust.with_key(&source, k);
            }
        }
        trust.validate().map_err(|e| {
            let text = consumer_text(&e);
            ConfigError::new(if text.contains("verification key") || text.contains("keys") { at("keys") } else { at("accept") }, text.trim_start_matches("trust: ").to_owned())
        })?;
        c.trust = trust;
        c.validate().map_err(|e| {
            let text = consumer_text(&e);
            let field = text.split_whitespace().next().unwrap_or("").trim_end_matches(':');
            let known = ["max_batch_messages", "max_batch_bytes", "max_buffered_per_partition", "max_evidence_payload_bytes", "session_timeout_ms", "shutdown_timeout_ms", "watermark_topic", "watermark_publish_interval_ms", "watermark_publish_timeout_ms", "max_attempts", "handler_timeout_ms", "db_max_attempts"];
            ConfigError::new(if known.contains(&field) { at(field) } else { format!("consumer.{}", keys::quote_key(id)) }, text)
        })?;
        Ok(c)
    }

    /// The reconciler's reader of the watermark topic (`[reconcile]`
    /// `watermark_topic`, `watermark_keys`, `watermark_unsigned`, on the
    /// `[kafka]` cluster with its security settings); `None` when
    /// `watermark_topic = ""`.
    pub fn watermark_topic_config(&self) -> Result<Option<WatermarkTopicConfig>, ConfigError> {
        let topic = self.reconcile.watermark_topic.clone().unwrap_or_else(|| outbox_producer::watermark_topic::DEFAULT_TOPIC.to_owned());
        if topic.trim().is_empty() {
            return Ok(None);
        }
        let kafka = self.kafka_config()?;
        let mut c = WatermarkTopicConfig::new(kafka.bootstrap_servers.clone());
        c.topic = topic.trim().to_owned();
        for (k, v) in &kafka.extra {
            if outbox_consumer::SHARED_KAFKA_PROPERTY_PREFIXES.iter().any(|p| k.starts_with(p)) {
                c.kafka.insert(k.clone(), v.clone());
            }
        }
        c.verify_keys = self.reconcile.watermark_verify_keys()?;
        c.allow_unsigned = WatermarkTopicConfig::parse_unsigned("reconcile.watermark_unsigned", self.reconcile.watermark_unsigned.iter().flatten().map(String::as_str))
            .map_err(|e| ConfigError::new("reconcile.watermark_unsigned", producer_text(&e)))?;
        c.validate().map_err(|e| ConfigError::new("reconcile.watermark_keys", producer_text(&e)))?;
        Ok(Some(c))
    }

    /// Checks every section that is present, and the keys across sections:
    /// where the dispatcher's signing key and a consumer's verification keys
    /// are both configured, the consumer holds the dispatcher's key id (with
    /// the same secret); where a consumer signs its watermark records and
    /// `[reconcile.watermark_keys]` lists it, the reconciler holds its key id.
    /// Sections that need the cluster are checked without it when
    /// `kafka.bootstrap` is not set (the CLI may take it from a flag).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(u) = &self.database_url {
            if u.len() > MAX_URL_BYTES {
                return Err(ConfigError::new("database_url", format!("longer than {MAX_URL_BYTES} bytes")));
            }
        }
        if let Some(f) = &self.log_format {
            if !matches!(f.as_str(), "text" | "json") {
                return Err(ConfigError::new("log_format", "must be \"text\" or \"json\""));
            }
        }
        self.kafka.effective_settings()?;
        if self.kafka.bootstrap.is_some() {
            self.kafka_config()?;
        }
        if self.dispatch.is_some() {
            self.dispatcher_config()?;
        }
        if self.consumer.len() > MAX_CONSUMERS {
            return Err(ConfigError::new("consumer", format!("{} sections (..={MAX_CONSUMERS})", self.consumer.len())));
        }
        let bootstrap = self.kafka.bootstrap.as_deref().map(str::trim).filter(|b| !b.is_empty()).unwrap_or("bootstrap.not.set:9092");
        let mut consumers = BTreeMap::new();
        for (id, s) in &self.consumer {
            if let Some(u) = &s.database_url {
                if u.len() > MAX_URL_BYTES {
                    return Err(ConfigError::new(format!("consumer.{id}.database_url"), format!("longer than {MAX_URL_BYTES} bytes")));
                }
            }
            consumers.insert(id.clone(), self.build_consumer(id, s, bootstrap)?);
        }
        let watermark_keys = self.reconcile.watermark_verify_keys()?;
        WatermarkTopicConfig::parse_unsigned("reconcile.watermark_unsigned", self.reconcile.watermark_unsigned.iter().flatten().map(String::as_str))
            .map_err(|e| ConfigError::new("reconcile.watermark_unsigned", producer_text(&e)))?;
        if self.kafka.bootstrap.is_some() {
            self.watermark_topic_config()?;
        }
        check_key_ids(self.signing_key()?.as_ref(), &consumers, &watermark_keys)
    }
}

/// The checks across sections (see [`Config::validate`]).
fn check_key_ids(signing: Option<&SigningKey>, consumers: &BTreeMap<String, ConsumerConfig>, watermark_keys: &BTreeMap<String, Vec<SigningKey>>) -> Result<(), ConfigError> {
    if let Some(signing) = signing {
        for (id, c) in consumers {
            let held: Vec<&SigningKey> = c.trust.keys.values().flat_map(|k| k.values()).collect();
            if held.is_empty() {
                continue;
            }
            let setting = format!("consumer.{}.keys", keys::quote_key(id));
            match held.iter().find(|k| k.key_id() == signing.key_id()) {
                None => {
                    let mut ids: Vec<&str> = held.iter().map(|k| k.key_id()).collect();
                    ids.dedup();
                    return Err(ConfigError::new(
                        setting,
                        format!(
                            "holds no key with the dispatcher's key id dispatch.signing.key_id = {:?} (this consumer's key ids: {}): \
                             every message the dispatcher signs would be quarantined (verify:key_unknown); add that key for the dispatcher's source",
                            signing.key_id(),
                            ids.join(", ")
                        ),
                    ));
                }
                Some(k) if *k != signing => {
                    return Err(ConfigError::new(
                        setting,
                        format!(
                            "key id {:?} has another secret than dispatch.signing (key id {:?}): every message the dispatcher signs would be quarantined (verify:signature_bad)",
                            k.key_id(),
                            signing.key_id()
                        ),
                    ))
                }
                Some(_) => {}
            }
        }
    }
    for (id, c) in consumers {
        let (Some(key), Some(held)) = (&c.watermark_signing_key, watermark_keys.get(id)) else {
            continue;
        };
        match held.iter().find(|k| k.key_id() == key.key_id()) {
            None => {
                let ids: Vec<&str> = held.iter().map(SigningKey::key_id).collect();
                return Err(ConfigError::new(
                    format!("reconcile.watermark_keys.{}", keys::quote_key(id)),
                    format!(
                        "holds no key with consumer.{id}.watermark_signing's key id {:?} (held: {}): the reconciler would refuse its watermark records",
                        key.key_id(),
                        ids.join(", ")
                    ),
                ));
            }
            Some(k) if k != key => {
                return Err(ConfigError::new(
                    format!("reconcile.watermark_keys.{}", keys::quote_key(id)),
                    format!("key id {:?} has another secret than consumer.{id}.watermark_signing", k.key_id()),
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}
