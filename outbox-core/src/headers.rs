//! Names of the message headers every dispatcher writes and every consumer
//! and reconciler reads. The values are UTF-8 text.

/// Always `outboxEnvelope.v1`: tells readers how to interpret the others.
pub const SCHEMA: &str = "outbox-schema";
/// The eventId.
pub const EVENT_ID: &str = "outbox-event-id";
/// The envelope generation, decimal.
pub const ENVELOPE_GENERATION: &str = "outbox-envelope-generation";
/// The attemptId of the attempt that produced this message.
pub const ATTEMPT_ID: &str = "outbox-attempt-id";
/// `sha256:` digest of the message value.
pub const PAYLOAD_DIGEST: &str = "outbox-payload-digest";
/// `sha256:` digest of the canonical destination.
pub const DESTINATION_DIGEST: &str = "outbox-destination-digest";
/// The canonical `destination.v1` bytes, so a reader can recompute the digest
/// and compare topic, partition and key with where the message really is.
pub const DESTINATION: &str = "outbox-destination";
/// The event type.
pub const EVENT_TYPE: &str = "outbox-event-type";
/// The tenant.
pub const TENANT: &str = "outbox-tenant";
/// The aggregate, `type/id@version`.
pub const AGGREGATE: &str = "outbox-aggregate";
/// W3C trace context, when a trace is active.
pub const TRACEPARENT: &str = "traceparent";

/// CloudEvents Kafka protocol binding, binary mode: `specversion`, always [`CE_SPECVERSION_VALUE`].
pub const CE_SPECVERSION: &str = "ce_specversion";
/// CloudEvents `id`: the eventId (unique within `ce_source`, the same on every attempt).
pub const CE_ID: &str = "ce_id";
/// CloudEvents `source`: the outbox's source identity (one per outbox database).
pub const CE_SOURCE: &str = "ce_source";
/// CloudEvents `type`: the event type.
pub const CE_TYPE: &str = "ce_type";
/// CloudEvents `time`: when the command was accepted (`occurredAtMs`), RFC 3339 UTC with milliseconds.
pub const CE_TIME: &str = "ce_time";
/// CloudEvents `datacontenttype` (binary mode): the route's media type of the value.
pub const CONTENT_TYPE: &str = "content-type";
/// The CloudEvents specification version written.
pub const CE_SPECVERSION_VALUE: &str = "1.0";
pub use crate::envelope::{validate_content_type, MAX_CLOUDEVENTS_ATTRIBUTE_BYTES};

use crate::canonical::sha256_digest;
use crate::envelope::{Destination, Envelope, ENVELOPE_SCHEMA};
use crate::error::CoreError;
use crate::id::{AttemptId, EventId};
use crate::receipt::BrokerReceipt;

/// The headers a dispatcher writes for one attempt of one event.
pub fn build(envelope: &Envelope, destination: &Destination, destination_digest: &str, attempt_id: &AttemptId, traceparent: Option<&str>) -> Vec<(String, Vec<u8>)> {
    let mut h: Vec<(String, Vec<u8>)> = vec![
        (SCHEMA.into(), ENVELOPE_SCHEMA.as_bytes().to_vec()),
        (EVENT_ID.into(), envelope.event_id.as_str().as_bytes().to_vec()),
        (ENVELOPE_GENERATION.into(), envelope.envelope_generation.to_string().into_bytes()),
        (ATTEMPT_ID.into(), attempt_id.as_str().as_bytes().to_vec()),
        (PAYLOAD_DIGEST.into(), envelope.payload_digest.as_bytes().to_vec()),
        (DESTINATION_DIGEST.into(), destination_digest.as_bytes().to_vec()),
        (DESTINATION.into(), destination.canonical_bytes()),
        (EVENT_TYPE.into(), envelope.event_type.as_bytes().to_vec()),
        (TENANT.into(), envelope.tenant.as_bytes().to_vec()),
        (AGGREGATE.into(), format!("{}/{}@{}", envelope.aggregate_type, envelope.aggregate_id, envelope.aggregate_version).into_bytes()),
    ];
    if let Some(tp) = traceparent {
        h.push((TRACEPARENT.into(), tp.as_bytes().to_vec()));
    }
    h
}

/// The CloudEvents attributes one message carries beyond its envelope: the
/// outbox's source identity and the route's content type. `None` in
/// [`crate::ClaimedEvent::cloudevents`] means the route sends no CloudEvents headers.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CloudEventsBinding {
    /// `ce_source`: a URI-reference naming the outbox (e.g. `urn:uuid:...`).
    pub source: String,
    /// `content-type`: the media type of the message value.
    pub content_type: String,
}

impl CloudEventsBinding {
    /// Checks both attributes: non-empty, at most
    /// [`MAX_CLOUDEVENTS_ATTRIBUTE_BYTES`], printable ASCII without spaces in
    /// the source, and a `type/subtype` media type.
    pub fn validate(&self) -> Result<(), CoreError> {
        validate_source(&self.source)?;
        validate_content_type(&self.content_type)
    }
}

/// A CloudEvents `source`: 1..=200 bytes of printable ASCII, no spaces.
pub fn validate_source(source: &str) -> Result<(), CoreError> {
    if source.is_empty() || source.len() > MAX_CLOUDEVENTS_ATTRIBUTE_BYTES || !source.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(CoreError::MalformedIdentifier { field: "source", reason: format!("{source:?}: 1..=200 bytes of printable ASCII without spaces") });
    }
    Ok(())
}

/// The CloudEvents headers (Kafka protocol binding, binary mode) of one
/// event: `ce_specversion`, `ce_id` (the eventId), `ce_source`, `ce_type`
/// (the event type), `ce_time` (`occurredAtMs`) and `content-type`. They
/// are written beside the outbox headers, never instead of them, and are
/// the same on every attempt of the event.
pub fn cloudevents(envelope: &Envelope, binding: &CloudEventsBinding) -> Vec<(String, Vec<u8>)> {
    vec![
        (CE_SPECVERSION.into(), CE_SPECVERSION_VALUE.as_bytes().to_vec()),
        (CE_ID.into(), envelope.event_id.as_str().as_bytes().to_vec()),
        (CE_SOURCE.into(), binding.source.as_bytes().to_vec()),
        (CE_TYPE.into(), envelope.event_type.as_bytes().to_vec()),
        (CE_TIME.into(), rfc3339_ms(envelope.occurred_at_ms).into_bytes()),
        (CONTENT_TYPE.into(), binding.content_type.as_bytes().to_vec()),
    ]
}

/// `ms` since the Unix epoch as RFC 3339 UTC with milliseconds,
/// `YYYY-MM-DDTHH:MM:SS.mmmZ` (proleptic Gregorian; years 0000..=9999, clamped).
pub fn rfc3339_ms(ms: i64) -> String {
    // 0000-01-01T00:00:00.000Z and 9999-12-31T23:59:59.999Z.
    let ms = ms.clamp(-62_167_219_200_000, 253_402_300_799_999);
    let days = ms.div_euclid(86_400_000);
    let in_day = ms.rem_euclid(86_400_000);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        in_day / 3_600_000,
        in_day / 60_000 % 60,
        in_day / 1000 % 60,
        in_day % 1000
    )
}

/// What a message's headers claim, parsed and checked for form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageClaims {
    /// eventId header.
    pub event_id: EventId,
    /// envelope generation header.
    pub envelope_generation: u32,
    /// attemptId header.
    pub attempt_id: AttemptId,
    /// payload digest header.
    pub payload_digest: String,
    /// destination digest header.
    pub destination_digest: String,
    /// The canonical destination header, parsed.
    pub destination: Destination,
    /// event type header.
    pub event_type: String,
    /// tenant header.
    pub tenant: String,
}

/// Why a message does not verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VerifyError {
    /// A required header is missing or unreadable.
    #[error("header {0} missing or malformed")]
    MissingHeader(&'static str),
    /// A header is present but malformed.
    #[error("header {header}: {error}")]
    Malformed {
        /// Which header.
        header: &'static str,
        /// What is wrong.
        error: CoreError,
    },
    /// sha256 of the value is not the payload digest header.
    #[error("payload digest mismatch: header {claimed}, bytes {actual}")]
    PayloadDigest {
        /// From the header.
        claimed: String,
        /// Of the bytes.
        actual: String,
    },
    /// The destination header does not hash to the destination digest header.
    #[error("destination digest mismatch")]
    DestinationDigest,
    /// The message is not where its destination says (topic, partition or key).
    #[error("message placement {0} differs from its frozen destination")]
    Placement(String),
    /// A header name is not UTF-8 (Kafka's protocol says header keys are
    /// UTF-8 strings): the message was not written by an outbox dispatcher,
    /// or was altered on the way.
    #[error("header name at position {index} is not UTF-8")]
    HeaderName {
        /// Position of the first such header in wire order.
        index: usize,
    },
    /// The headers covered by `outboxClaims.v1` do not hash to the
    /// `outbox-claims-digest` header (see [`crate::trust`]).
    #[error("the message claims do not hash to outbox-claims-digest")]
    ClaimsDigest,
    /// The message names no source (`outbox-source`) where the reader requires one.
    #[error("no outbox-source header")]
    SourceMissing,
    /// The message's source is not one the reader accepts on this topic.
    #[error("source {0:?} is not accepted on this topic")]
    SourceUnknown(String),
    /// The reader requires a signature on this topic and the message has none.
    #[error("no outbox-signature header where a signature is required")]
    SignatureMissing,
    /// The signature names a key id the reader has no key for, for this source.
    #[error("key id {0:?} is not a verification key of this source")]
    KeyUnknown(String),
    /// The signature does not verify under the named key.
    #[error("the signature does not verify")]
    SignatureBad,
    /// The CloudEvents `ce_source` header names another source than the
    /// `outbox-source` the claims digest covers: a reader going by
    /// `ce_source` would take the message for another outbox's.
    #[error("ce_source {ce_source:?} is not the message's outbox-source {outbox_source:?}")]
    CeSourceMismatch {
        /// The `ce_source` header (at most 200 characters of it).
        ce_source: String,
        /// The `outbox-source` header.
        outbox_source: String,
    },
}

fn header<'a>(headers: &'a [(String, Vec<u8>)], name: &'static str) -> Result<&'a str, VerifyError> {
    headers
        .iter()
        .rev()
        .find(|(k, _)| k == name)
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
        .ok_or(VerifyError::MissingHeader(name))
}

/// Parses the headers without checking them against the payload.
pub fn parse(headers: &[(String, Vec<u8>)]) -> Result<MessageClaims, VerifyError> {
    if header(headers, SCHEMA)? != ENVELOPE_SCHEMA {
        return Err(VerifyError::MissingHeader(SCHEMA));
    }
    let malformed = |header: &'static str| move |error: CoreError| VerifyError::Malformed { header, error };
    let destination_bytes = headers.iter().rev().find(|(k, _)| k == DESTINATION).map(|(_, v)| v.as_slice()).ok_or(VerifyError::MissingHeader(DESTINATION))?;
    Ok(MessageClaims {
        event_id: header(headers, EVENT_ID)?.parse().map_err(malformed(EVENT_ID))?,
        envelope_generation: header(headers, ENVELOPE_GENERATION)?.parse().map_err(|_| VerifyError::MissingHeader(ENVELOPE_GENERATION))?,
        attempt_id: header(headers, ATTEMPT_ID)?.parse().map_err(malformed(ATTEMPT_ID))?,
        payload_digest: header(headers, PAYLOAD_DIGEST)?.to_owned(),
        destination_digest: header(headers, DESTINATION_DIGEST)?.to_owned(),
        destination: Destination::from_canonical(destination_bytes).map_err(malformed(DESTINATION))?,
        event_type: header(headers, EVENT_TYPE)?.to_owned(),
        tenant: header(headers, TENANT)?.to_owned(),
    })
}

/// Parses and verifies a message as read from the broker: the payload hashes
/// to its digest, the destination header hashes to its digest, and the
/// message sits on the topic, partition and key its destination prescribes.
pub fn verify(headers: &[(String, Vec<u8>)], payload: &[u8], topic: &str, partition: i32, key: Option<&[u8]>) -> Result<MessageClaims, VerifyError> {
    let claims = parse(headers)?;
    claims.check(payload, topic, partition, key)?;
    Ok(claims)
}

impl MessageClaims {
    /// The checks of [`verify`] on claims already parsed: the payload hashes
    /// to its digest, the destination to its digest, and the message sits on
    /// the topic, partition and key its destination prescribes.
    pub fn check(&self, payload: &[u8], topic: &str, partition: i32, key: Option<&[u8]>) -> Result<(), VerifyError> {
        let actual = if crate::simulation::mutation_active("payload-digest-from-header") {
            // The deliberate defect: the digest the header claims is taken
            // for the payload's own, so changed bytes pass.
            self.payload_digest.clone()
        } else {
            sha256_digest(payload)
        };
        if actual != self.payload_digest {
            return Err(VerifyError::PayloadDigest { claimed: self.payload_digest.clone(), actual });
        }
        if self.destination.digest() != self.destination_digest {
            return Err(VerifyError::DestinationDigest);
        }
        let d = &self.destination;
        if d.topic != topic || d.partition != partition || key != Some(d.routing_key.as_bytes()) {
            return Err(VerifyError::Placement(format!("{topic}/{partition}")));
        }
        Ok(())
    }

    /// The broker receipt of this message at a log position, under `key`
    /// (the message's key as read; a message without one reads as the
    /// empty key); its topic id is the one the claimed destination names.
    pub fn receipt(&self, cluster_id: &str, topic: &str, partition: i32, offset: i64, key: Option<&[u8]>, payload: &[u8]) -> BrokerReceipt {
        BrokerReceipt {
            event_id: self.event_id.clone(),
            envelope_generation: self.envelope_generation,
            attempt_id: self.attempt_id.clone(),
            payload_digest: sha256_digest(payload),
            destination_digest: self.destination_digest.clone(),
            cluster_id: cluster_id.to_owned(),
            topic: topic.to_owned(),
            topic_id: self.destination.topic_id.clone(),
            partition,
            offset,
            key: Some(key.unwrap_or_default().to_vec()),
            log_id: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{EmitRequest, RoutePolicy};

    fn sample() -> (Envelope, Destination, Vec<u8>) {
        let payload = b"{\"order\":\"o-1\"}".to_vec();
        let req = EmitRequest { command_key: "c", tenant: "t", aggregate_type: "order", aggregate_id: "o-1", aggregate_version: 1, event_type: "order.created", payload_schema: "s", payload: &payload };
        let (e, d) = req.freeze(EventId::from_parts(5, 5), 5, 9, &RoutePolicy::new("order.created", "c1", "orders", 4)).unwrap();
        (e, d, payload)
    }

    #[test]
    fn built_headers_verify() {
        let (e, d, p) = sample();
        let h = build(&e, &d, &d.digest(), &AttemptId::from_parts(1, 1), Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"));
        let c = verify(&h, &p, "orders", d.partition, Some(d.routing_key.as_bytes())).unwrap();
        assert_eq!(c.event_id, e.event_id);
        let r = c.receipt("c1", "orders", d.partition, 7, Some(d.routing_key.as_bytes()), &p);
        assert_eq!(r.payload_digest, e.payload_digest);
        assert_eq!(r.key.as_deref(), Some(d.routing_key.as_bytes()));
        // A message without a key reads as the empty key, never as "not known".
        assert_eq!(c.receipt("c1", "orders", d.partition, 7, None, &p).key, Some(Vec::new()));
    }

    #[test]
    fn tampered_messages_do_not_verify() {
        let (e, d, p) = sample();
        let h = build(&e, &d, &d.digest(), &AttemptId::from_parts(1, 1), None);
        assert!(matches!(verify(&h, b"other", "orders", d.partition, Some(d.routing_key.as_bytes())), Err(VerifyError::PayloadDigest { .. })));
        assert!(matches!(verify(&h, &p, "payments", d.partition, Some(d.routing_key.as_bytes())), Err(VerifyError::Placement(_))));
        assert!(matches!(verify(&h, &p, "orders", d.partition, Some(b"k")), Err(VerifyError::Placement(_))));
        let mut bad = h.clone();
        bad.retain(|(k, _)| k != EVENT_ID);
        assert_eq!(verify(&bad, &p, "orders", d.partition, None), Err(VerifyError::MissingHeader(EVENT_ID)));
        let mut bad = h.clone();
        for (k, v) in bad.iter_mut() {
            if k == DESTINATION_DIGEST {
                *v = sha256_digest(b"x").into_bytes();
            }
        }
        assert_eq!(verify(&bad, &p, "orders", d.partition, Some(d.routing_key.as_bytes())), Err(VerifyError::DestinationDigest));
    }

    #[test]
    fn rfc3339_matches_known_instants() {
        assert_eq!(rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_ms(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
        assert_eq!(rfc3339_ms(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339_ms(4_107_542_399_999), "2100-02-28T23:59:59.999Z");
        assert_eq!(rfc3339_ms(-1), "1969-12-31T23:59:59.999Z");
        assert_eq!(rfc3339_ms(i64::MAX), "9999-12-31T23:59:59.999Z");
        assert_eq!(rfc3339_ms(i64::MIN), "0000-01-01T00:00:00.000Z");
    }

    #[test]
    fn cloudevents_headers_name_the_event() {
        let (e, _, _) = sample();
        let b = CloudEventsBinding { source: "urn:uuid:6b1c1e0e-0c59-4c1e-9d0e-3c1b9f1b8a11".into(), content_type: "application/json".into() };
        b.validate().unwrap();
        let h = cloudevents(&e, &b);
        let get = |n: &str| h.iter().find(|(k, _)| k == n).map(|(_, v)| String::from_utf8(v.clone()).unwrap());
        assert_eq!(get(CE_SPECVERSION).as_deref(), Some("1.0"));
        assert_eq!(get(CE_ID).as_deref(), Some(e.event_id.as_str()));
        assert_eq!(get(CE_SOURCE), Some(b.source.clone()));
        assert_eq!(get(CE_TYPE), Some(e.event_type.clone()));
        assert_eq!(get(CE_TIME), Some(rfc3339_ms(e.occurred_at_ms)));
        assert_eq!(get(CONTENT_TYPE).as_deref(), Some("application/json"));
    }

    #[test]
    fn bad_cloudevents_attributes_are_refused() {
        for ct in ["", "json", "/json", "application/", "application/json x", "text/plain;\ncharset=utf-8", &"a/".repeat(150)] {
            assert!(validate_content_type(ct).is_err(), "{ct:?}");
        }
        for ct in ["application/json", "application/cloudevents+json", "text/plain; charset=utf-8", "application/vnd.acme.order-v2+avro"] {
            validate_content_type(ct).unwrap();
        }
        for s in ["", "has space", "tab\t", &"x".repeat(201)] {
            assert!(validate_source(s).is_err(), "{s:?}");
        }
        validate_source("/orders/service").unwrap();
    }
}
