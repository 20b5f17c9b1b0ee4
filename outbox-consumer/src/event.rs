//! What the consumer reads (a [`RawMessage`]), what a handler sees (a
//! verified [`ConsumedEvent`]) and the stable key for external effects.

use outbox_core::canonical::{sha256_digest, CanonicalWriter};
use outbox_core::headers::MessageClaims;
use outbox_core::EventId;
use serde_json::{json, Value};

/// One message as read from the broker, before any check. Build it yourself
/// to drive a [`Processor`](crate::Processor) without Kafka.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawMessage {
    /// Topic the message was read from.
    pub topic: String,
    /// Partition the message was read from.
    pub partition: i32,
    /// Log position of the message.
    pub offset: i64,
    /// Message key.
    pub key: Option<Vec<u8>>,
    /// Message value; `None` for a tombstone.
    pub payload: Option<Vec<u8>>,
    /// Headers in wire order (a repeated name: the last one wins).
    pub headers: Vec<(String, Vec<u8>)>,
}

impl RawMessage {
    /// Copies a message out of the Kafka client.
    pub fn from_kafka<M: rdkafka::Message>(m: &M) -> Self {
        use rdkafka::message::Headers as _;
        let headers = m
            .headers()
            .map(|h| h.iter().map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec).unwrap_or_default())).collect())
            .unwrap_or_default();
        RawMessage {
            topic: m.topic().to_owned(),
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().map(<[u8]>::to_vec),
            payload: m.payload().map(<[u8]>::to_vec),
            headers,
        }
    }

    /// Bytes of key, value and headers: what the batch byte limit counts.
    pub fn size_bytes(&self) -> usize {
        self.key.as_ref().map_or(0, Vec::len)
            + self.payload.as_ref().map_or(0, Vec::len)
            + self.headers.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>()
    }

    /// The payload, empty for a tombstone.
    pub fn payload_bytes(&self) -> &[u8] {
        self.payload.as_deref().unwrap_or_default()
    }
}

/// A verified event, as the handler sees it: every field below was checked
/// against the message's digests and placement by
/// [`outbox_core::headers::verify`] before the handler runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumedEvent {
    /// The consumer this event is being applied for.
    pub consumer_id: String,
    /// Business identity of the event; the receipt key with `consumer_id`.
    pub event_id: EventId,
    /// Envelope generation of this copy (a destination migration makes a new one).
    pub envelope_generation: u32,
    /// Event type, e.g. `order.created.v2`.
    pub event_type: String,
    /// Tenant.
    pub tenant: String,
    /// Topic read from.
    pub topic: String,
    /// Partition read from.
    pub partition: i32,
    /// Offset read from.
    pub offset: i64,
    /// Message key (the frozen routing key).
    pub key: Option<Vec<u8>>,
    /// The exact payload bytes; their sha256 is `payload_digest`.
    pub payload: Vec<u8>,
    /// `sha256:` digest of the payload.
    pub payload_digest: String,
    /// All headers of the message.
    pub headers: Vec<(String, Vec<u8>)>,
    /// [`effect_key`] of this consumer and event with purpose `"effect"`: the
    /// idempotency key to give an external system for this event's one effect.
    pub effect_key: String,
}

/// Purpose used for [`ConsumedEvent::effect_key`].
pub const DEFAULT_EFFECT_PURPOSE: &str = "effect";

impl ConsumedEvent {
    pub(crate) fn new(consumer_id: &str, claims: MessageClaims, msg: &RawMessage) -> Self {
        let payload = msg.payload_bytes().to_vec();
        let effect_key = effect_key(consumer_id, &claims.event_id, DEFAULT_EFFECT_PURPOSE);
        ConsumedEvent {
            consumer_id: consumer_id.to_owned(),
            event_id: claims.event_id,
            envelope_generation: claims.envelope_generation,
            event_type: claims.event_type,
            tenant: claims.tenant,
            topic: msg.topic.clone(),
            partition: msg.partition,
            offset: msg.offset,
            key: msg.key.clone(),
            payload,
            payload_digest: claims.payload_digest,
            headers: msg.headers.clone(),
            effect_key,
        }
    }

    /// The idempotency key for one named external effect of this event, when
    /// a handler performs several (`"charge"`, `"email"`, ...).
    pub fn effect_key_for(&self, purpose: &str) -> String {
        effect_key(&self.consumer_id, &self.event_id, purpose)
    }

    /// The value of a header (the last one of that name).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.as_slice())
    }

    /// The aggregate header `type/id@version`, split. Informational: the
    /// aggregate is not covered by the message digests.
    pub fn aggregate(&self) -> Option<(&str, &str, i64)> {
        let text = std::str::from_utf8(self.header(outbox_core::headers::AGGREGATE)?).ok()?;
        let (ty, rest) = text.split_once('/')?;
        let (id, version) = rest.rsplit_once('@')?;
        Some((ty, id, version.parse().ok()?))
    }

    /// The payload parsed as JSON, if it is JSON.
    pub fn json(&self) -> Option<Value> {
        serde_json::from_slice(&self.payload).ok()
    }
}

/// Schema name of the effect key encoding.
pub const EFFECT_KEY_SCHEMA: &str = "outboxEffectKey.v1";

/// The stable idempotency key of one external effect of one event for one
/// consumer.
///
/// `"ek1-"` followed by the lowercase hex SHA-256 of the canonical bytes
/// (`outbox_core::canonical`, length-prefixed fields) of record
/// `outboxEffectKey.v1` with fields `consumerId`, `eventId`, `purpose`:
///
/// ```text
/// outboxEffectKey.v1\nconsumerId=<len>:<id>\neventId=<len>:<evt-...>\npurpose=<len>:<purpose>\n
/// ```
///
/// It depends on nothing that changes between deliveries (not the offset, the
/// attempt or the envelope generation), so every retry of an effect whose
/// outcome is unknown presents the same key, and the external system can
/// answer "already done" instead of doing it twice. 68 ASCII characters, within
/// the limits of common APIs (Stripe: 255).
///
/// ```
/// # use outbox_core::EventId;
/// let e = EventId::from_parts(1_700_000_000_000, 7);
/// let k = outbox_consumer::effect_key("billing", &e, "charge");
/// assert_eq!(k, outbox_consumer::effect_key("billing", &e, "charge"));
/// assert_ne!(k, outbox_consumer::effect_key("billing", &e, "refund"));
/// assert_ne!(k, outbox_consumer::effect_key("shipping", &e, "charge"));
/// assert!(k.starts_with("ek1-") && k.len() == 68);
/// ```
pub fn effect_key(consumer_id: &str, event_id: &EventId, purpose: &str) -> String {
    let bytes = CanonicalWriter::new(EFFECT_KEY_SCHEMA)
        .field("consumerId", consumer_id)
        .field("eventId", event_id.as_str())
        .field("purpose", purpose)
        .finish();
    let digest = sha256_digest(&bytes);
    format!("ek1-{}", digest.trim_start_matches("sha256:"))
}

/// Longest header value kept verbatim in evidence, in bytes.
pub(crate) const MAX_EVIDENCE_HEADER_BYTES: usize = 4096;
/// Most headers kept in evidence.
pub(crate) const MAX_EVIDENCE_HEADERS: usize = 64;

/// Headers as JSON: `[{"name": ..., "utf8": ...}]` or `{"name", "hex"}` for
/// values that are not UTF-8. Values longer than the limit are cut and
/// marked `"truncated": true` (evidence only; dead letters keep them whole).
pub(crate) fn headers_json(headers: &[(String, Vec<u8>)], limit_bytes: usize) -> Value {
    let items: Vec<Value> = headers
        .iter()
        .take(MAX_EVIDENCE_HEADERS)
        .map(|(k, v)| {
            let truncated = v.len() > limit_bytes;
            let v = &v[..v.len().min(limit_bytes)];
            let mut o = match std::str::from_utf8(v) {
                Ok(s) => json!({ "name": k, "utf8": s }),
                Err(_) => json!({ "name": k, "hex": hex::encode(v) }),
            };
            if truncated {
                o["truncated"] = Value::Bool(true);
            }
            o
        })
        .collect();
    Value::Array(items)
}

/// Inverse of [`headers_json`] for untruncated values.
pub(crate) fn headers_from_json(v: &Value) -> Option<Vec<(String, Vec<u8>)>> {
    v.as_array()?
        .iter()
        .map(|h| {
            let name = h.get("name")?.as_str()?.to_owned();
            let value = match (h.get("utf8").and_then(Value::as_str), h.get("hex").and_then(Value::as_str)) {
                (Some(s), _) => s.as_bytes().to_vec(),
                (None, Some(x)) => hex::decode(x).ok()?,
                _ => return None,
            };
            Some((name, value))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn effect_key_is_documented_bytes() {
        let e = EventId::from_parts(1, 1);
        let bytes = format!("outboxEffectKey.v1\nconsumerId=1:c\neventId=30:{}\npurpose=1:p\n", e.as_str());
        assert_eq!(effect_key("c", &e, "p"), format!("ek1-{}", sha256_digest(bytes.as_bytes()).trim_start_matches("sha256:")));
        // Length prefixes keep field boundaries unambiguous.
        assert_ne!(effect_key("a:b", &e, "c"), effect_key("a", &e, "b:c"));
    }

    #[test]
    fn headers_round_trip_through_json() {
        let h = vec![("a".to_owned(), b"text".to_vec()), ("b".to_owned(), vec![0xff, 0x00])];
        assert_eq!(headers_from_json(&headers_json(&h, 100)), Some(h));
    }
}
