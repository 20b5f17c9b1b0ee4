//! Which outboxes a consumer accepts messages from, per topic, and the keys
//! it verifies their signatures with (see [`outbox_core::trust`]).
//!
//! A topic listed in the policy accepts only messages whose `outbox-source`
//! is one of its sources and whose `outbox-claims-digest` matches; with
//! `require_signature`, only messages signed by a verification key of their
//! source. A signature that is present is always checked when the source has
//! keys. Several keys per source are accepted at once: add the new key,
//! switch the dispatchers to it, remove the old key once no message signed
//! with it can still arrive (the topic's retention).
//!
//! A topic not listed accepts any source (today's behaviour, logged at start
//! by the consumer); the claims digest is still checked where present.

use std::collections::{BTreeMap, BTreeSet};

use outbox_core::headers::{validate_source, VerifyError};
use outbox_core::trust::{check_claims, SigningKey, TrustClaims};

use crate::error::ConsumerError;

/// Most sources one topic accepts, and most keys per source.
pub const LIMIT_TRUST_ENTRIES: usize = 100;

/// What one topic accepts.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TopicTrust {
    /// Source identities accepted (`outbox status` shows an outbox's).
    pub sources: BTreeSet<String>,
    /// Refuse messages without a valid signature.
    pub require_signature: bool,
}

/// The consumer's trust policy: accepted sources per topic and verification
/// keys per source. `Debug` never shows a secret.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TrustPolicy {
    /// Topic → what it accepts. A topic not here accepts any source.
    pub topics: BTreeMap<String, TopicTrust>,
    /// Source → key id → verification key.
    pub keys: BTreeMap<String, BTreeMap<String, SigningKey>>,
}

impl TrustPolicy {
    /// Accepts messages of `sources` on `topic` (adds to what it accepted).
    pub fn accept(mut self, topic: &str, sources: &[&str], require_signature: bool) -> Self {
        let t = self.topics.entry(topic.to_owned()).or_default();
        t.sources.extend(sources.iter().map(|s| (*s).to_owned()));
        t.require_signature |= require_signature;
        self
    }

    /// Adds a verification key of `source` (several may be in force at once).
    pub fn with_key(mut self, source: &str, key: SigningKey) -> Self {
        self.keys.entry(source.to_owned()).or_default().insert(key.key_id().to_owned(), key);
        self
    }

    /// Whether no topic is configured (any source is accepted everywhere).
    pub fn is_open(&self) -> bool {
        self.topics.is_empty()
    }

    /// Topics of `subscribed` that accept any source.
    pub fn open_topics<'a>(&self, subscribed: &'a [String]) -> Vec<&'a str> {
        subscribed.iter().filter(|t| !self.topics.contains_key(t.as_str())).map(String::as_str).collect()
    }

    /// Checks sources and limits.
    pub fn validate(&self) -> Result<(), ConsumerError> {
        let bad = |m: String| Err(ConsumerError::Config(format!("trust: {m}")));
        for (topic, t) in &self.topics {
            if t.sources.is_empty() || t.sources.len() > LIMIT_TRUST_ENTRIES {
                return bad(format!("topic {topic}: {} sources (1..={LIMIT_TRUST_ENTRIES})", t.sources.len()));
            }
            for s in &t.sources {
                validate_source(s).map_err(|e| ConsumerError::Config(format!("trust: topic {topic}: {e}")))?;
                if t.require_signature && self.keys.get(s).map_or(true, BTreeMap::is_empty) {
                    return bad(format!("topic {topic} requires a signature but source {s} has no verification key"));
                }
            }
        }
        for (s, keys) in &self.keys {
            validate_source(s).map_err(|e| ConsumerError::Config(format!("trust: {e}")))?;
            if keys.len() > LIMIT_TRUST_ENTRIES {
                return bad(format!("source {s}: {} keys (..={LIMIT_TRUST_ENTRIES})", keys.len()));
            }
        }
        Ok(())
    }

    /// The trust checks of one message on `topic`: the claims digest where
    /// present, then the topic's sources and signature rules.
    pub fn check(&self, topic: &str, headers: &[(String, Vec<u8>)]) -> Result<TrustClaims, VerifyError> {
        let claims = check_claims(headers)?;
        let Some(rule) = self.topics.get(topic) else {
            return Ok(claims);
        };
        let source = claims.source.as_deref().ok_or(VerifyError::SourceMissing)?;
        if !rule.sources.contains(source) {
            return Err(VerifyError::SourceUnknown(source.chars().take(200).collect()));
        }
        let Some(record) = &claims.claims else {
            return Err(VerifyError::MissingHeader(outbox_core::trust::CLAIMS_DIGEST));
        };
        let keys = self.keys.get(source);
        match (&claims.signature, keys.filter(|k| !k.is_empty())) {
            (None, _) if rule.require_signature => return Err(VerifyError::SignatureMissing),
            (None, _) | (Some(_), None) => {}
            (Some(sig), Some(keys)) => {
                let key_id = claims.key_id.as_deref().unwrap_or("");
                let key = keys.get(key_id).ok_or_else(|| VerifyError::KeyUnknown(key_id.chars().take(200).collect()))?;
                if !key.verifies(record, sig) {
                    return Err(VerifyError::SignatureBad);
                }
            }
        }
        Ok(claims)
    }
}
