//! What the consumer reads (a [`RawMessage`]), what a handler sees (a
//! verified [`ConsumedEvent`]) and the stable key for external effects.

use outbox_core::canonical::{sha256_digest, CanonicalWriter};
use outbox_core::headers::MessageClaims;
use outbox_core::EventId;
use serde_json::{json, Value};

/// One message as read from the broker, before any check. Build it yourself
/// to drive a [`Processor`](crate::Processor) without Kafka.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
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
    /// Headers in wire order (a repeated name: the last one wins). A name
    /// that is not UTF-8 is kept with its invalid bytes replaced by U+FFFD,
    /// and its position is in `non_utf8_header_names`.
    pub headers: Vec<(String, Vec<u8>)>,
    /// Positions (in `headers`) of header names that were not UTF-8 on the
    /// wire. Verification refuses such a message (it is quarantined, never
    /// handled): no outbox dispatcher writes one.
    pub non_utf8_header_names: Vec<usize>,
    /// The identity of the log the message was fetched from, as the
    /// consumer saw it: the topic's id when the message was read (a topic
    /// deleted and created again under its name, or a cluster replaced,
    /// has another). `None`: not known. When it differs from the id the
    /// partition's reading was kept under, the log was replaced: the
    /// reading starts over, and what this consumer did not read of the new
    /// log is a gap (module [`gap`](crate::gap)). One batch holds the
    /// messages of one log.
    pub log_id: Option<String>,
}

impl RawMessage {
    /// Copies a message out of the Kafka client. Never panics, whatever the
    /// headers hold (rdkafka's own header accessors panic on a name that is
    /// not UTF-8).
    pub fn from_kafka(m: &rdkafka::message::BorrowedMessage<'_>) -> Self {
        use rdkafka::Message as _;
        let (headers, non_utf8_header_names) = m.headers().map(read_headers).unwrap_or_default();
        RawMessage {
            topic: m.topic().to_owned(),
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().map(<[u8]>::to_vec),
            payload: m.payload().map(<[u8]>::to_vec),
            headers,
            non_utf8_header_names,
            log_id: None,
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
    /// The topic id the event's frozen destination names (`destination.v2`;
    /// `None` for a `destination.v1`): with the topic and partition, which
    /// log the offset is a position of. Receipts and watermarks carry it.
    pub topic_id: Option<String>,
    /// Message key (the frozen routing key).
    pub key: Option<Vec<u8>>,
    /// The exact payload bytes; their sha256 is `payload_digest`.
    pub payload: Vec<u8>,
    /// `sha256:` digest of the payload.
    pub payload_digest: String,
    /// All headers of the message.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The `outbox-source` header: which outbox wrote the message. Checked
    /// against the consumer's [`TrustPolicy`](crate::TrustPolicy) when the
    /// topic has one; otherwise only what the message says.
    pub source: Option<String>,
    /// [`effect_key`] of this consumer and event with purpose `"effect"`: the
    /// idempotency key to give an external system for this event's one effect.
    pub effect_key: String,
}

/// Purpose used for [`ConsumedEvent::effect_key`].
pub const DEFAULT_EFFECT_PURPOSE: &str = "effect";

impl ConsumedEvent {
    pub(crate) fn new(consumer_id: &str, claims: MessageClaims, source: Option<String>, msg: &RawMessage) -> Self {
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
            topic_id: claims.destination.topic_id.clone(),
            key: msg.key.clone(),
            payload,
            payload_digest: claims.payload_digest,
            headers: msg.headers.clone(),
            source,
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

    /// The aggregate header `type/id@version`, split. Its exact text is
    /// covered by `outbox-claims-digest` (checked before the handler when
    /// the message has one), but the split is ambiguous for an aggregate
    /// type containing `/`.
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

/// Reads every header of a message without panicking: names that are not
/// UTF-8 are decoded lossily and their positions returned.
pub fn read_headers(h: &rdkafka::message::BorrowedHeaders) -> (Vec<(String, Vec<u8>)>, Vec<usize>) {
    use rdkafka::message::Headers as _;
    let count = h.count();
    let mut out = Vec::with_capacity(count);
    let mut bad = Vec::new();
    for idx in 0..count {
        let mut name: *const std::os::raw::c_char = std::ptr::null();
        let mut value: *const std::os::raw::c_void = std::ptr::null();
        let mut size: usize = 0;
        // SAFETY: `h` is a live header list; librdkafka writes borrowed
        // pointers into it that stay valid while `h` does, and we copy them
        // out before returning.
        // `BorrowedHeaders` is a zero-sized view whose address is librdkafka's
        // header list (rdkafka casts it the same way).
        let native = h as *const rdkafka::message::BorrowedHeaders as *const rdkafka::bindings::rd_kafka_headers_t;
        let err = unsafe { rdkafka::bindings::rd_kafka_header_get_all(native, idx, &mut name, &mut value, &mut size) };
        if err != rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
            continue;
        }
        // SAFETY: librdkafka header names are NUL-terminated.
        let name_bytes = unsafe { std::ffi::CStr::from_ptr(name) }.to_bytes();
        let value = if value.is_null() {
            Vec::new()
        } else {
            // SAFETY: `value` points at `size` bytes owned by the header list.
            unsafe { std::slice::from_raw_parts(value as *const u8, size) }.to_vec()
        };
        let name = match std::str::from_utf8(name_bytes) {
            Ok(s) => s.to_owned(),
            Err(_) => {
                bad.push(out.len());
                String::from_utf8_lossy(name_bytes).into_owned()
            }
        };
        out.push((name, value));
    }
    (out, bad)
}
