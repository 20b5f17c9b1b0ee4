//! Where the watermark topic is, how much a round reads, and whose records
//! are verified with which keys (or explicitly not verified).

use std::collections::{BTreeMap, BTreeSet};

use outbox_core::trust::SigningKey;
use outbox_core::watermark_record::DEFAULT_TOPIC;

use crate::error::ProducerError;

/// Default [`WatermarkTopicConfig::group_id`].
pub const DEFAULT_GROUP_ID: &str = "outbox-reconciler-watermarks";
/// Default [`WatermarkTopicConfig::max_records_per_round`].
pub const DEFAULT_MAX_RECORDS_PER_ROUND: usize = 10_000;
/// Upper limit of [`WatermarkTopicConfig::max_records_per_round`].
pub const LIMIT_MAX_RECORDS_PER_ROUND: usize = 1_000_000;
/// Default [`WatermarkTopicConfig::round_timeout_ms`].
pub const DEFAULT_ROUND_TIMEOUT_MS: u64 = 10_000;
/// Most verification keys per consumer in [`WatermarkTopicConfig::verify_keys`].
pub const LIMIT_KEYS_PER_CONSUMER: usize = 16;
/// Most consumers with verification keys.
pub const LIMIT_KEYED_CONSUMERS: usize = 10_000;
/// Most consumers in [`WatermarkTopicConfig::allow_unsigned`].
pub const LIMIT_UNSIGNED_CONSUMERS: usize = 10_000;

/// Where the watermark topic is and how much one round reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatermarkTopicConfig {
    /// Kafka `bootstrap.servers` of the cluster whose watermark topic is read.
    pub bootstrap_servers: String,
    /// The watermark topic (default [`DEFAULT_TOPIC`]).
    pub topic: String,
    /// Kafka group id of the reader's client (default [`DEFAULT_GROUP_ID`]);
    /// the read position is kept in the outbox database, not in the group.
    pub group_id: String,
    /// Most records read and applied by one round.
    pub max_records_per_round: usize,
    /// Longest one round reads, ms (also the metadata timeout).
    pub round_timeout_ms: u64,
    /// Extra librdkafka properties (security, ...).
    pub kafka: BTreeMap<String, String>,
    /// Verification keys per consumer id: a record naming a consumer listed
    /// here is applied only when signed by one of its keys (several during a
    /// rotation). The records of a declared consumer listed neither here nor
    /// in [`Self::allow_unsigned`] are refused. `Debug` never shows the
    /// secrets.
    pub verify_keys: BTreeMap<String, Vec<SigningKey>>,
    /// Consumer ids explicitly opted out of verification: their records are
    /// applied without a signature check (signed or not), so anyone who can
    /// write the watermark topic can speak for them. A consumer may not be
    /// both here and in [`Self::verify_keys`] ([`Self::validate`] refuses it).
    pub allow_unsigned: BTreeSet<String>,
}

impl WatermarkTopicConfig {
    /// Defaults for the cluster at `bootstrap_servers`.
    pub fn new(bootstrap_servers: impl Into<String>) -> Self {
        WatermarkTopicConfig {
            bootstrap_servers: bootstrap_servers.into(),
            topic: DEFAULT_TOPIC.to_owned(),
            group_id: DEFAULT_GROUP_ID.to_owned(),
            max_records_per_round: DEFAULT_MAX_RECORDS_PER_ROUND,
            round_timeout_ms: DEFAULT_ROUND_TIMEOUT_MS,
            kafka: BTreeMap::new(),
            verify_keys: BTreeMap::new(),
            allow_unsigned: BTreeSet::new(),
        }
    }

    /// Adds a verification key for `consumer_id`.
    pub fn with_key(mut self, consumer_id: &str, key: SigningKey) -> Self {
        self.verify_keys.entry(consumer_id.to_owned()).or_default().push(key);
        self
    }

    /// Opts `consumer_id` out of verification: its records are applied
    /// unsigned (see [`Self::allow_unsigned`]). Only for a consumer that
    /// cannot sign yet, and with writes to the watermark topic restricted to
    /// the consumers' principals.
    pub fn allow_unsigned(mut self, consumer_id: &str) -> Self {
        self.allow_unsigned.insert(consumer_id.to_owned());
        self
    }

    /// Parses consumer ids opted out of verification (entries trimmed, empty
    /// ones skipped; `what` names where they come from in errors).
    pub fn parse_unsigned<'a>(what: &str, entries: impl IntoIterator<Item = &'a str>) -> Result<BTreeSet<String>, ProducerError> {
        let mut out = BTreeSet::new();
        for (i, entry) in entries.into_iter().enumerate() {
            let consumer = entry.trim();
            if consumer.is_empty() {
                continue;
            }
            outbox_core::id::validate_identifier("consumerId", consumer).map_err(|e| ProducerError::Config(format!("{what}: entry {}: {e}", i + 1)))?;
            out.insert(consumer.to_owned());
        }
        Ok(out)
    }

    /// Parses verification keys written `CONSUMER_ID=KEY_ID=HEX`, one per
    /// entry (`what` names where they come from in errors, which never
    /// repeat a secret).
    pub fn parse_keys<'a>(what: &str, entries: impl IntoIterator<Item = &'a str>) -> Result<BTreeMap<String, Vec<SigningKey>>, ProducerError> {
        let mut out: BTreeMap<String, Vec<SigningKey>> = BTreeMap::new();
        for (i, entry) in entries.into_iter().enumerate() {
            let bad = || ProducerError::Config(format!("{what}: entry {} is not CONSUMER_ID=KEY_ID=HEX", i + 1));
            let mut parts = entry.trim().rsplitn(3, '=');
            let (hex, key_id, consumer) = (parts.next().ok_or_else(bad)?, parts.next().ok_or_else(bad)?, parts.next().ok_or_else(bad)?);
            outbox_core::id::validate_identifier("consumerId", consumer).map_err(|e| ProducerError::Config(format!("{what}: entry {}: {e}", i + 1)))?;
            let key = SigningKey::from_hex(key_id, hex).map_err(|e| ProducerError::Config(format!("{what}: entry {}: {e}", i + 1)))?;
            out.entry(consumer.to_owned()).or_default().push(key);
        }
        Ok(out)
    }

    /// Checks identifiers and limits.
    pub fn validate(&self) -> Result<(), ProducerError> {
        outbox_core::id::validate_identifier("watermark topic", &self.topic)?;
        outbox_core::id::validate_identifier("watermark group id", &self.group_id)?;
        if self.bootstrap_servers.trim().is_empty() {
            return Err(ProducerError::Config("watermark topic: bootstrap_servers is empty".into()));
        }
        if !(1..=LIMIT_MAX_RECORDS_PER_ROUND).contains(&self.max_records_per_round) {
            return Err(ProducerError::Config(format!("max_records_per_round {} (1..={LIMIT_MAX_RECORDS_PER_ROUND})", self.max_records_per_round)));
        }
        if !(100..=600_000).contains(&self.round_timeout_ms) {
            return Err(ProducerError::Config(format!("round_timeout_ms {} (100..=600000)", self.round_timeout_ms)));
        }
        if self.verify_keys.len() > LIMIT_KEYED_CONSUMERS {
            return Err(ProducerError::Config(format!("verification keys for {} consumers (..={LIMIT_KEYED_CONSUMERS})", self.verify_keys.len())));
        }
        for (consumer, keys) in &self.verify_keys {
            outbox_core::id::validate_identifier("consumerId", consumer)?;
            if keys.is_empty() || keys.len() > LIMIT_KEYS_PER_CONSUMER {
                return Err(ProducerError::Config(format!("consumer {consumer}: {} verification keys (1..={LIMIT_KEYS_PER_CONSUMER})", keys.len())));
            }
            for (i, k) in keys.iter().enumerate() {
                if keys[..i].iter().any(|o| o.key_id() == k.key_id()) {
                    return Err(ProducerError::Config(format!("consumer {consumer}: key id {} given twice", k.key_id())));
                }
            }
        }
        if self.allow_unsigned.len() > LIMIT_UNSIGNED_CONSUMERS {
            return Err(ProducerError::Config(format!("{} consumers allowed unsigned watermark records (..={LIMIT_UNSIGNED_CONSUMERS})", self.allow_unsigned.len())));
        }
        for consumer in &self.allow_unsigned {
            outbox_core::id::validate_identifier("consumerId", consumer)?;
            if self.verify_keys.contains_key(consumer) {
                return Err(ProducerError::Config(format!(
                    "consumer {consumer} has watermark verification keys and is also allowed unsigned watermark records: remove one of the two (with keys its records are verified)"
                )));
            }
        }
        Ok(())
    }
}

/// Why a declared consumer's record is refused when the reader holds no key
/// for it and it is not opted out: what to configure, in code and in `outbox
/// reconcile`.
pub(super) fn no_key_reason(consumer: &str) -> String {
    format!(
        "consumer {consumer}: no watermark verification key is configured for this consumer, so its records are refused (signed or not); \
         give the reconciler the consumer's key (OUTBOX_RECONCILE_WATERMARK_KEYS=\"{consumer}=KEY_ID=HEX\", [reconcile] watermark_keys, \
         WatermarkTopicConfig::with_key), or opt the consumer out of verification explicitly (--watermark-unsigned {consumer}, \
         OUTBOX_RECONCILE_WATERMARK_UNSIGNED, [reconcile] watermark_unsigned, WatermarkTopicConfig::allow_unsigned)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verification_keys_parse_and_validate() {
        let (a, b) = ("0a".repeat(32), "0b".repeat(32));
        let keys = WatermarkTopicConfig::parse_keys("X", [format!("shipping=wm-old={a}").as_str(), &format!("shipping=wm-new={b}"), &format!("billing=wm-1={a}")]).unwrap();
        assert_eq!(keys["shipping"].iter().map(SigningKey::key_id).collect::<Vec<_>>(), vec!["wm-old", "wm-new"]);
        assert_eq!(keys["billing"].len(), 1);
        let mut c = WatermarkTopicConfig::new("k:9092");
        c.verify_keys = keys;
        c.validate().unwrap();
        assert!(!format!("{c:?}").contains("0a0a"), "no secret in Debug");
        for bad in ["shipping", "shipping=wm-1", &format!("bad id=wm-1={a}"), "shipping=wm-1=zz", &format!("shipping=wm-1={}", "0a".repeat(8))] {
            let err = WatermarkTopicConfig::parse_keys("OUTBOX_RECONCILE_WATERMARK_KEYS", [bad]).unwrap_err().to_string();
            assert!(err.contains("OUTBOX_RECONCILE_WATERMARK_KEYS: entry 1") && !err.contains("0a0a"), "{bad}: {err}");
        }
        let twice = WatermarkTopicConfig::new("k:9092").with_key("s", SigningKey::from_hex("k", &a).unwrap()).with_key("s", SigningKey::from_hex("k", &b).unwrap());
        assert!(twice.validate().unwrap_err().to_string().contains("given twice"));
        let mut many = WatermarkTopicConfig::new("k:9092");
        for i in 0..=LIMIT_KEYS_PER_CONSUMER {
            many = many.with_key("s", SigningKey::from_hex(&format!("k{i}"), &a).unwrap());
        }
        assert!(many.validate().is_err());
        let mut empty = WatermarkTopicConfig::new("k:9092");
        empty.verify_keys.insert("s".into(), Vec::new());
        assert!(empty.validate().is_err());
    }

    #[test]
    fn unsigned_consumers_are_opted_out_by_name_and_validated() {
        assert!(WatermarkTopicConfig::new("k:9092").allow_unsigned.is_empty(), "nobody is opted out by default");
        let c = WatermarkTopicConfig::new("k:9092").allow_unsigned("billing").allow_unsigned("audit");
        c.validate().unwrap();
        assert_eq!(c.allow_unsigned.iter().map(String::as_str).collect::<Vec<_>>(), vec!["audit", "billing"]);
        let parsed = WatermarkTopicConfig::parse_unsigned("OUTBOX_RECONCILE_WATERMARK_UNSIGNED", [" billing", "", "audit ", "billing"]).unwrap();
        assert_eq!(parsed, c.allow_unsigned);
        for bad in ["*", "bad id", "a,b"] {
            let err = WatermarkTopicConfig::parse_unsigned("OUTBOX_RECONCILE_WATERMARK_UNSIGNED", [bad]).unwrap_err().to_string();
            assert!(err.contains("OUTBOX_RECONCILE_WATERMARK_UNSIGNED: entry 1"), "{bad}: {err}");
            assert!(WatermarkTopicConfig::new("k:9092").allow_unsigned(bad).validate().is_err(), "{bad}");
        }
        // Keys and an opt-out for one consumer: a configuration error.
        let both = WatermarkTopicConfig::new("k:9092").with_key("billing", SigningKey::from_hex("k", &"0a".repeat(32)).unwrap()).allow_unsigned("billing");
        let err = both.validate().unwrap_err().to_string();
        assert!(err.contains("consumer billing has watermark verification keys and is also allowed unsigned"), "{err}");
        let mut many = WatermarkTopicConfig::new("k:9092");
        many.allow_unsigned = (0..=LIMIT_UNSIGNED_CONSUMERS).map(|i| format!("c{i}")).collect();
        assert!(many.validate().is_err());
    }

    #[test]
    fn the_no_key_reason_says_how_to_configure_a_key_or_opt_out() {
        let why = no_key_reason("shipping");
        for want in ["no watermark verification key is configured", "OUTBOX_RECONCILE_WATERMARK_KEYS=\"shipping=KEY_ID=HEX\"", "with_key", "--watermark-unsigned shipping", "OUTBOX_RECONCILE_WATERMARK_UNSIGNED", "allow_unsigned"] {
            assert!(why.contains(want), "{want}: {why}");
        }
    }
}
