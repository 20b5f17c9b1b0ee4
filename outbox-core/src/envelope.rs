//! `outboxEnvelope.v1` and `destination.v1`: what is frozen at commit.

use serde::{Deserialize, Serialize};

use crate::canonical::{sha256_digest, CanonicalReader, CanonicalWriter};
use crate::error::CoreError;
use crate::id::{validate_identifier, EventId};

/// Schema name of the envelope encoding.
pub const ENVELOPE_SCHEMA: &str = "outboxEnvelope.v1";
/// Schema name of the destination encoding.
pub const DESTINATION_SCHEMA: &str = "destination.v1";
/// Schema of a destination that names its topic's identity (Kafka topic id):
/// `destination.v1`'s fields with `topicId` after `topic`.
pub const DESTINATION_SCHEMA_V2: &str = "destination.v2";

/// The identity and content summary of one event at one envelope generation.
///
/// Canonical field order (`outboxEnvelope.v1`): `eventId`,
/// `envelopeGeneration`, `aggregateType`, `aggregateId`, `aggregateVersion`,
/// `eventType`, `payloadSchema`, `payloadDigest`, `tenant`, `occurredAtMs`,
/// `createdTxid`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Envelope {
    /// Business identity of the event.
    pub event_id: EventId,
    /// 1 at commit; a destination migration creates generation + 1.
    pub envelope_generation: u32,
    /// Aggregate type, e.g. `order`.
    pub aggregate_type: String,
    /// Aggregate id, e.g. `o-42`.
    pub aggregate_id: String,
    /// Aggregate version after the command, e.g. 17.
    pub aggregate_version: i64,
    /// Event type, e.g. `order.created.v2`.
    pub event_type: String,
    /// Digest of the payload schema document.
    pub payload_schema: String,
    /// Digest of the exact payload bytes that will be sent.
    pub payload_digest: String,
    /// Tenant the event belongs to.
    pub tenant: String,
    /// Milliseconds since the Unix epoch at which the command was accepted.
    pub occurred_at_ms: i64,
    /// `pg_current_xact_id()` of the creating transaction.
    pub created_txid: u64,
}

impl Envelope {
    /// The canonical `outboxEnvelope.v1` bytes.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        CanonicalWriter::new(ENVELOPE_SCHEMA)
            .field("eventId", self.event_id.as_str())
            .field("envelopeGeneration", self.envelope_generation.to_string())
            .field("aggregateType", &self.aggregate_type)
            .field("aggregateId", &self.aggregate_id)
            .field("aggregateVersion", self.aggregate_version.to_string())
            .field("eventType", &self.event_type)
            .field("payloadSchema", &self.payload_schema)
            .field("payloadDigest", &self.payload_digest)
            .field("tenant", &self.tenant)
            .field("occurredAtMs", self.occurred_at_ms.to_string())
            .field("createdTxid", self.created_txid.to_string())
            .finish()
    }

    /// Parses canonical bytes back into an envelope.
    pub fn from_canonical(bytes: &[u8]) -> Result<Self, CoreError> {
        let mut r = CanonicalReader::new(bytes, ENVELOPE_SCHEMA)?;
        let env = Envelope {
            event_id: r.field("eventId")?.parse()?,
            envelope_generation: r.int("envelopeGeneration")?,
            aggregate_type: r.field("aggregateType")?.to_owned(),
            aggregate_id: r.field("aggregateId")?.to_owned(),
            aggregate_version: r.int("aggregateVersion")?,
            event_type: r.field("eventType")?.to_owned(),
            payload_schema: r.field("payloadSchema")?.to_owned(),
            payload_digest: r.field("payloadDigest")?.to_owned(),
            tenant: r.field("tenant")?.to_owned(),
            occurred_at_ms: r.int("occurredAtMs")?,
            created_txid: r.int("createdTxid")?,
        };
        r.end()?;
        Ok(env)
    }

    /// Digest of the canonical envelope bytes.
    pub fn digest(&self) -> String {
        sha256_digest(&self.canonical_bytes())
    }
}

/// How the partition is derived from the routing key. The dispatcher computes
/// the partition itself and produces to it explicitly, so the frozen algorithm
/// is the one that decides, whatever the client library's default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Partitioner {
    /// Kafka's default: `(murmur2(key) & 0x7fffffff) % partitions`, seed
    /// `0x9747b28c` (Java client `Utils.murmur2`, librdkafka `murmur2`).
    Murmur2,
}

impl Partitioner {
    /// Stable name used in the canonical encoding.
    pub fn as_str(self) -> &'static str {
        match self {
            Partitioner::Murmur2 => "murmur2",
        }
    }

    /// Parses [`Partitioner::as_str`].
    pub fn parse(s: &str) -> Result<Self, CoreError> {
        match s {
            "murmur2" => Ok(Partitioner::Murmur2),
            other => Err(CoreError::InvalidDestination(format!("unknown partitioner {other:?}"))),
        }
    }

    /// The partition of `key` among `partitions`.
    pub fn partition(self, key: &[u8], partitions: u32) -> Result<i32, CoreError> {
        if partitions == 0 || partitions > i32::MAX as u32 {
            return Err(CoreError::InvalidDestination(format!("{partitions} partitions")));
        }
        Ok(match self {
            Partitioner::Murmur2 => ((murmur2(key) & 0x7fff_ffff) % partitions) as i32,
        })
    }
}

/// Kafka's murmur2 (32-bit, seed `0x9747b28c`).
pub fn murmur2(data: &[u8]) -> u32 {
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let len = data.len();
    let mut h: u32 = 0x9747_b28c ^ (len as u32);
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = chunks.remainder();
    if tail.len() >= 3 {
        h ^= (tail[2] as u32) << 16;
    }
    if tail.len() >= 2 {
        h ^= (tail[1] as u32) << 8;
    }
    if !tail.is_empty() {
        h ^= tail[0] as u32;
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h
}

/// Whether events of one routing key are sent strictly one after another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Ordering {
    /// An event is sent only after every earlier event of the same
    /// destination and routing key is PUBLISHED (default).
    Key,
    /// Events may interleave across workers for throughput.
    None,
}

impl Ordering {
    /// Stable name used in the canonical encoding.
    pub fn as_str(self) -> &'static str {
        match self {
            Ordering::Key => "key",
            Ordering::None => "none",
        }
    }

    /// Parses [`Ordering::as_str`].
    pub fn parse(s: &str) -> Result<Self, CoreError> {
        match s {
            "key" => Ok(Ordering::Key),
            "none" => Ok(Ordering::None),
            other => Err(CoreError::InvalidDestination(format!("unknown ordering {other:?}"))),
        }
    }
}

/// Where an event goes, resolved from the route policy at commit and frozen.
///
/// Canonical field order (`destination.v1`): `clusterId`, `topic`,
/// `routingKey`, `partitioner`, `partitions`, `partition`, `routePolicy`,
/// `routePolicyGeneration`, `serializer`, `durability`, `requiredAcks`,
/// `ordering`. A destination with a topic id is `destination.v2`: the same
/// fields with `topicId` right after `topic`. A destination without one is
/// always encoded as `destination.v1`, so the bytes (and digest) of an
/// existing event never change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Destination {
    /// Broker cluster identity (Kafka cluster id).
    pub cluster_id: String,
    /// Topic.
    pub topic: String,
    /// The topic's identity (Kafka topic id, 22-character URL-safe base64)
    /// learned when the route was set; `None` for a `destination.v1`. A
    /// topic deleted and created again under the same name has another id:
    /// it is another destination.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic_id: Option<String>,
    /// Routing (partition) key.
    pub routing_key: String,
    /// Partitioner algorithm.
    pub partitioner: Partitioner,
    /// Partition count the partition was computed against.
    pub partitions: u32,
    /// The partition the key maps to; derived, stored for readers.
    pub partition: i32,
    /// Name of the route policy (the event type it routes).
    pub route_policy: String,
    /// Generation of the route policy in force at commit.
    pub route_policy_generation: u32,
    /// Serializer name, e.g. `order-v2`.
    pub serializer: String,
    /// Durability class, e.g. `durable`.
    pub durability: String,
    /// Required acks, e.g. `all`.
    pub required_acks: String,
    /// Per-key ordering rule.
    pub ordering: Ordering,
}

impl Destination {
    /// The canonical bytes: `destination.v2` when the destination has a
    /// topic id, `destination.v1` otherwise.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        let w = match &self.topic_id {
            None => CanonicalWriter::new(DESTINATION_SCHEMA).field("clusterId", &self.cluster_id).field("topic", &self.topic),
            Some(id) => CanonicalWriter::new(DESTINATION_SCHEMA_V2).field("clusterId", &self.cluster_id).field("topic", &self.topic).field("topicId", id),
        };
        w.field("routingKey", &self.routing_key)
            .field("partitioner", self.partitioner.as_str())
            .field("partitions", self.partitions.to_string())
            .field("partition", self.partition.to_string())
            .field("routePolicy", &self.route_policy)
            .field("routePolicyGeneration", self.route_policy_generation.to_string())
            .field("serializer", &self.serializer)
            .field("durability", &self.durability)
            .field("requiredAcks", &self.required_acks)
            .field("ordering", self.ordering.as_str())
            .finish()
    }

    /// The schema name of the canonical bytes (`destination.v1` or `.v2`).
    pub fn schema(&self) -> &'static str {
        if self.topic_id.is_some() {
            DESTINATION_SCHEMA_V2
        } else {
            DESTINATION_SCHEMA
        }
    }

    /// Parses canonical bytes (`destination.v1` or `destination.v2`),
    /// re-checking that the partition is the one the partitioner gives for
    /// the key and, for `.v2`, that the topic id is well formed.
    pub fn from_canonical(bytes: &[u8]) -> Result<Self, CoreError> {
        let v2 = bytes.starts_with(DESTINATION_SCHEMA_V2.as_bytes()) && bytes.get(DESTINATION_SCHEMA_V2.len()) == Some(&b'\n');
        let mut r = CanonicalReader::new(bytes, if v2 { DESTINATION_SCHEMA_V2 } else { DESTINATION_SCHEMA })?;
        let cluster_id = r.field("clusterId")?.to_owned();
        let topic = r.field("topic")?.to_owned();
        let topic_id = if v2 {
            let id = r.field("topicId")?;
            validate_topic_id(id)?;
            Some(id.to_owned())
        } else {
            None
        };
        let d = Destination {
            cluster_id,
            topic,
            topic_id,
            routing_key: r.field("routingKey")?.to_owned(),
            partitioner: Partitioner::parse(r.field("partitioner")?)?,
            partitions: r.int("partitions")?,
            partition: r.int("partition")?,
            route_policy: r.field("routePolicy")?.to_owned(),
            route_policy_generation: r.int("routePolicyGeneration")?,
            serializer: r.field("serializer")?.to_owned(),
            durability: r.field("durability")?.to_owned(),
            required_acks: r.field("requiredAcks")?.to_owned(),
            ordering: Ordering::parse(r.field("ordering")?)?,
        };
        r.end()?;
        if d.partitioner.partition(d.routing_key.as_bytes(), d.partitions)? != d.partition {
            return Err(CoreError::InvalidDestination("partition does not follow from key and partitioner".into()));
        }
        Ok(d)
    }

    /// `destinationDigest`: SHA-256 of the canonical bytes.
    pub fn digest(&self) -> String {
        sha256_digest(&self.canonical_bytes())
    }

    /// Whether a broker placement (cluster, topic, partition) is the one this
    /// destination prescribes.
    pub fn admits(&self, cluster_id: &str, topic: &str, partition: i32) -> bool {
        self.cluster_id == cluster_id && self.topic == topic && self.partition == partition
    }
}

/// Length of a topic id in its text form: 16 bytes in URL-safe base64
/// without padding.
pub const TOPIC_ID_CHARS: usize = 22;

/// The text form of a Kafka topic id (16 bytes, most significant first):
/// URL-safe base64 (`A-Z a-z 0-9 - _`) without padding, 22 characters, as
/// Kafka's own tools print it.
pub fn topic_id_text(bytes: &[u8; 16]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(TOPIC_ID_CHARS);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        let chars = chunk.len() + 1;
        for i in 0..chars {
            out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

/// Checks the text form of a topic id: 22 characters of URL-safe base64
/// whose last one carries no bits beyond the 128 (one text per id), and
/// not the all-zero id (which Kafka uses for "no id").
pub fn validate_topic_id(value: &str) -> Result<(), CoreError> {
    let bad = |why: &str| Err(CoreError::InvalidDestination(format!("topic id {value:?}: {why}")));
    if value.len() != TOPIC_ID_CHARS {
        return bad("must be 22 characters (16 bytes, URL-safe base64 without padding)");
    }
    if !value.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_') {
        return bad("only A-Z a-z 0-9 - _ are allowed");
    }
    // The last character holds the final 2 bits: its low 4 bits must be zero.
    if !b"AQgw".contains(&value.as_bytes()[TOPIC_ID_CHARS - 1]) {
        return bad("the last character carries bits beyond 16 bytes");
    }
    if value == "AAAAAAAAAAAAAAAAAAAAAA" {
        return bad("the all-zero id means no id");
    }
    Ok(())
}

/// One generation of the route of one event type./// One generation of the route of one event type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RoutePolicy {
    /// Event type routed by this policy.
    pub event_type: String,
    /// Generation; a revision is a new row with generation + 1.
    pub generation: u32,
    /// Target cluster id.
    pub cluster_id: String,
    /// Target topic.
    pub topic: String,
    /// The topic's identity (Kafka topic id) as the cluster reported it when
    /// the route was set; `None` when it was not learned (the route was set
    /// without checking the cluster, or before topic ids). Events routed by
    /// a generation with an id freeze a `destination.v2`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic_id: Option<String>,
    /// Partition count of the topic.
    pub partitions: u32,
    /// Partitioner algorithm.
    pub partitioner: Partitioner,
    /// Routing key template; placeholders `{tenant}`, `{aggregate_type}`,
    /// `{aggregate_id}`, `{event_type}`.
    pub key_template: String,
    /// Serializer name.
    pub serializer: String,
    /// Durability class.
    pub durability: String,
    /// Required acks.
    pub required_acks: String,
    /// Per-key ordering.
    pub ordering: Ordering,
    /// Whether messages of this route carry the CloudEvents headers (Kafka
    /// protocol binding, binary mode) beside the outbox headers. On by
    /// default. Like every field, it is fixed per generation: an event sends
    /// what the generation frozen in its destination says.
    #[serde(default = "default_cloudevents")]
    pub cloudevents: bool,
    /// Media type of the payload, sent as `content-type` with the
    /// CloudEvents headers (default `application/octet-stream`).
    #[serde(default = "default_content_type")]
    pub content_type: String,
}

/// The media type of a route that names none: opaque bytes.
pub const DEFAULT_CONTENT_TYPE: &str = "application/octet-stream";

fn default_cloudevents() -> bool {
    true
}

fn default_content_type() -> String {
    DEFAULT_CONTENT_TYPE.to_owned()
}

impl RoutePolicy {
    /// A policy with the defaults users want most of the time: murmur2,
    /// key `{tenant}.{aggregate_type}.{aggregate_id}`, acks `all`, ordered,
    /// CloudEvents headers on with content type `application/octet-stream`.
    pub fn new(event_type: &str, cluster_id: &str, topic: &str, partitions: u32) -> Self {
        RoutePolicy {
            event_type: event_type.to_owned(),
            generation: 1,
            cluster_id: cluster_id.to_owned(),
            topic: topic.to_owned(),
            topic_id: None,
            partitions,
            partitioner: Partitioner::Murmur2,
            key_template: "{tenant}.{aggregate_type}.{aggregate_id}".to_owned(),
            serializer: "bytes".to_owned(),
            durability: "durable".to_owned(),
            required_acks: "all".to_owned(),
            ordering: Ordering::Key,
            cloudevents: true,
            content_type: DEFAULT_CONTENT_TYPE.to_owned(),
        }
    }

    /// Checks the policy itself.
    pub fn validate(&self) -> Result<(), CoreError> {
        validate_identifier("eventType", &self.event_type)?;
        validate_identifier("clusterId", &self.cluster_id)?;
        validate_identifier("topic", &self.topic)?;
        if let Some(id) = &self.topic_id {
            validate_topic_id(id)?;
        }
        if self.partitions == 0 || self.partitions > 100_000 {
            return Err(CoreError::InvalidDestination(format!("{} partitions (1..=100000)", self.partitions)));
        }
        if self.required_acks != "all" && self.required_acks != "1" {
            return Err(CoreError::InvalidDestination(format!("required acks {:?} (all or 1)", self.required_acks)));
        }
        validate_content_type(&self.content_type)?;
        Ok(())
    }

    /// Freezes the destination of one event under this policy.
    pub fn resolve(&self, tenant: &str, aggregate_type: &str, aggregate_id: &str) -> Result<Destination, CoreError> {
        self.validate()?;
        let routing_key = self
            .key_template
            .replace("{tenant}", tenant)
            .replace("{aggregate_type}", aggregate_type)
            .replace("{aggregate_id}", aggregate_id)
            .replace("{event_type}", &self.event_type);
        if routing_key.is_empty() {
            return Err(CoreError::InvalidDestination("routing key renders empty".into()));
        }
        let partition = self.partitioner.partition(routing_key.as_bytes(), self.partitions)?;
        Ok(Destination {
            cluster_id: self.cluster_id.clone(),
            topic: self.topic.clone(),
            topic_id: self.topic_id.clone(),
            routing_key,
            partitioner: self.partitioner,
            partitions: self.partitions,
            partition,
            route_policy: self.event_type.clone(),
            route_policy_generation: self.generation,
            serializer: self.serializer.clone(),
            durability: self.durability.clone(),
            required_acks: self.required_acks.clone(),
            ordering: self.ordering,
        })
    }
}

/// Default payload limit: 1 MiB, Kafka's default `message.max.bytes`.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024;

/// What a service asks to emit, before anything is frozen.
#[derive(Debug, Clone)]
pub struct EmitRequest<'a> {
    /// Idempotency key of the business command; a retry carries the same key.
    pub command_key: &'a str,
    /// Tenant.
    pub tenant: &'a str,
    /// Aggregate type.
    pub aggregate_type: &'a str,
    /// Aggregate id.
    pub aggregate_id: &'a str,
    /// Aggregate version after the command.
    pub aggregate_version: i64,
    /// Event type; selects the route policy.
    pub event_type: &'a str,
    /// The payload schema document (or its stable identifier); its digest is frozen.
    pub payload_schema: &'a str,
    /// The exact bytes that will be sent.
    pub payload: &'a [u8],
}

impl EmitRequest<'_> {
    /// Checks everything that can be checked without the database.
    pub fn validate(&self, max_payload_bytes: usize) -> Result<(), CoreError> {
        validate_identifier("commandKey", self.command_key)?;
        validate_identifier("tenant", self.tenant)?;
        validate_identifier("aggregateType", self.aggregate_type)?;
        validate_identifier("aggregateId", self.aggregate_id)?;
        validate_identifier("eventType", self.event_type)?;
        if self.aggregate_version < 0 {
            return Err(CoreError::MalformedIdentifier { field: "aggregateVersion", reason: "must not be negative".into() });
        }
        if self.payload_schema.is_empty() {
            return Err(CoreError::MalformedIdentifier { field: "payloadSchema", reason: "must not be empty".into() });
        }
        if self.payload.is_empty() {
            return Err(CoreError::EmptyPayload);
        }
        if self.payload.len() > max_payload_bytes {
            return Err(CoreError::PayloadTooLarge { size_bytes: self.payload.len(), limit_bytes: max_payload_bytes });
        }
        Ok(())
    }

    /// Freezes the envelope and destination for a new event.
    pub fn freeze(
        &self,
        event_id: EventId,
        occurred_at_ms: i64,
        created_txid: u64,
        policy: &RoutePolicy,
    ) -> Result<(Envelope, Destination), CoreError> {
        let destination = policy.resolve(self.tenant, self.aggregate_type, self.aggregate_id)?;
        let envelope = Envelope {
            event_id,
            envelope_generation: 1,
            aggregate_type: self.aggregate_type.to_owned(),
            aggregate_id: self.aggregate_id.to_owned(),
            aggregate_version: self.aggregate_version,
            event_type: self.event_type.to_owned(),
            payload_schema: sha256_digest(self.payload_schema.as_bytes()),
            payload_digest: sha256_digest(self.payload),
            tenant: self.tenant.to_owned(),
            occurred_at_ms,
            created_txid,
        };
        Ok((envelope, destination))
    }
}


/// Longest source identity and content type accepted, bytes.
pub const MAX_CLOUDEVENTS_ATTRIBUTE_BYTES: usize = 200;

/// A media type `type/subtype[;parameters]` of at most 200 bytes of printable ASCII.
pub fn validate_content_type(content_type: &str) -> Result<(), CoreError> {
    let token = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$&^_.+-".contains(&b));
    let essence = content_type.split(';').next().unwrap_or("");
    let ok = content_type.len() <= MAX_CLOUDEVENTS_ATTRIBUTE_BYTES
        && content_type.bytes().all(|b| b == b' ' || b.is_ascii_graphic())
        && essence.split_once('/').is_some_and(|(t, s)| token(t) && token(s.trim_end()));
    if !ok {
        return Err(CoreError::MalformedIdentifier { field: "contentType", reason: format!("{content_type:?}: a media type type/subtype[;parameters] of at most 200 bytes") });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_id_text_is_url_safe_base64_without_padding() {
        let bytes: [u8; 16] = core::array::from_fn(|i| i as u8);
        assert_eq!(topic_id_text(&bytes), "AAECAwQFBgcICQoLDA0ODw");
        assert_eq!(topic_id_text(&[0xff; 16]), "_____________________w");
        validate_topic_id("AAECAwQFBgcICQoLDA0ODw").unwrap();
        validate_topic_id("_____________________w").unwrap();
        for bad in ["", "AAECAwQFBgcICQoLDA0OD", "AAECAwQFBgcICQoLDA0ODw=", "AAECAwQFBgcICQoLDA0OD+", "AAECAwQFBgcICQoLDA0ODx", "AAAAAAAAAAAAAAAAAAAAAA"] {
            assert!(validate_topic_id(bad).is_err(), "{bad:?} must be refused");
        }
    }

    #[test]
    fn murmur2_matches_kafka_reference_values() {
        // Reference values of Kafka's Java client (Utils.murmur2).
        let cases: [(&str, i32); 6] = [
            ("21", -973932308),
            ("foobar", -790332482),
            ("a-little-bit-long-string", -985981536),
            ("a-little-bit-longer-string", -1486304829),
            ("lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
            ("abc", 479470107),
        ];
        for (key, want) in cases {
            assert_eq!(murmur2(key.as_bytes()) as i32, want, "{key}");
        }
    }

    fn policy() -> RoutePolicy {
        RoutePolicy::new("order.created.v2", "kafka-prod", "orders", 12)
    }

    #[test]
    fn destination_round_trips_and_digest_is_stable() {
        let d = policy().resolve("tenant-7", "order", "o-42").unwrap();
        assert_eq!(d.routing_key, "tenant-7.order.o-42");
        let back = Destination::from_canonical(&d.canonical_bytes()).unwrap();
        assert_eq!(back, d);
        assert_eq!(back.digest(), d.digest());
        let mut other = d.clone();
        other.route_policy_generation = 2;
        assert_ne!(other.digest(), d.digest());
    }

    #[test]
    fn destination_v2_carries_the_topic_id_and_v1_stays_v1() {
        let v1 = policy().resolve("tenant-7", "order", "o-42").unwrap();
        let v1_bytes = v1.canonical_bytes();
        assert!(v1_bytes.starts_with(b"destination.v1\nclusterId=10:kafka-prod\ntopic=6:orders\nroutingKey="), "{}", String::from_utf8_lossy(&v1_bytes));
        assert_eq!(v1.schema(), DESTINATION_SCHEMA);
        let with_id = RoutePolicy { topic_id: Some("AAECAwQFBgcICQoLDA0ODw".into()), ..policy() };
        let v2 = with_id.resolve("tenant-7", "order", "o-42").unwrap();
        let v2_bytes = v2.canonical_bytes();
        assert!(v2_bytes.starts_with(b"destination.v2\nclusterId=10:kafka-prod\ntopic=6:orders\ntopicId=22:AAECAwQFBgcICQoLDA0ODw\nroutingKey="), "{}", String::from_utf8_lossy(&v2_bytes));
        assert_eq!(v2.schema(), DESTINATION_SCHEMA_V2);
        let back = Destination::from_canonical(&v2_bytes).unwrap();
        assert_eq!(back, v2);
        assert_ne!(v2.digest(), v1.digest(), "another topic identity, another destination");
        assert_eq!(Destination::from_canonical(&v1_bytes).unwrap().topic_id, None);
        // The same fields as v1 after the header, without topicId: refused.
        let mut wrong = b"destination.v2".to_vec();
        wrong.extend_from_slice(&v1_bytes["destination.v1".len()..]);
        assert!(Destination::from_canonical(&wrong).is_err());
        // A malformed topic id is refused, in the policy and in the bytes.
        let bad = RoutePolicy { topic_id: Some("not-an-id".into()), ..policy() };
        assert!(bad.validate().is_err());
        let forged = String::from_utf8(v2_bytes).unwrap().replace("topicId=22:AAECAwQFBgcICQoLDA0ODw", "topicId=22:AAAAAAAAAAAAAAAAAAAAAA");
        assert!(Destination::from_canonical(forged.as_bytes()).is_err());
    }

    #[test]
    fn destination_with_wrong_partition_is_refused() {
        let mut d = policy().resolve("tenant-7", "order", "o-42").unwrap();
        d.partition = (d.partition + 1) % 12;
        assert!(Destination::from_canonical(&d.canonical_bytes()).is_err());
    }

    #[test]
    fn envelope_round_trips() {
        let req = EmitRequest {
            command_key: "cmd-1",
            tenant: "tenant-7",
            aggregate_type: "order",
            aggregate_id: "o-42",
            aggregate_version: 17,
            event_type: "order.created.v2",
            payload_schema: "order-v2",
            payload: b"{\"id\":\"o-42\"}",
        };
        let (env, _) = req.freeze(EventId::from_parts(1, 2), 1_700_000_000_000, 777, &policy()).unwrap();
        assert_eq!(env.payload_digest, sha256_digest(b"{\"id\":\"o-42\"}"));
        assert_eq!(Envelope::from_canonical(&env.canonical_bytes()).unwrap(), env);
    }

    #[test]
    fn bad_emit_requests_are_refused() {
        let ok = EmitRequest {
            command_key: "cmd-1",
            tenant: "t",
            aggregate_type: "order",
            aggregate_id: "o-1",
            aggregate_version: 1,
            event_type: "e",
            payload_schema: "s",
            payload: b"x",
        };
        assert!(ok.validate(10).is_ok());
        assert_eq!(EmitRequest { payload: b"", ..ok.clone() }.validate(10), Err(CoreError::EmptyPayload));
        assert!(matches!(EmitRequest { payload: b"01234567890", ..ok.clone() }.validate(10), Err(CoreError::PayloadTooLarge { .. })));
        assert!(EmitRequest { tenant: "", ..ok.clone() }.validate(10).is_err());
        assert!(EmitRequest { aggregate_id: "o 1", ..ok.clone() }.validate(10).is_err());
        assert!(EmitRequest { aggregate_version: -1, ..ok.clone() }.validate(10).is_err());
    }

    #[test]
    fn partition_spread_is_deterministic() {
        let p = Partitioner::Murmur2;
        assert_eq!(p.partition(b"k", 8).unwrap(), p.partition(b"k", 8).unwrap());
        assert!(p.partition(b"k", 0).is_err());
    }
}
