//! The watermark record a consumer publishes over the broker
//! (`outboxWatermark.v1` to `.v4`), and its key (`outboxWatermarkKey.v1` or
//! `.v2`).
//!
//! A consumer whose state lives in its own database publishes, for each of
//! its watermark rows, one record to a compacted topic; the producer side
//! reads the topic and applies the records to its copy of the watermarks.
//! Both are `canonical.v1` text (see [`crate::canonical`]); docs/WIRE.md
//! documents the bytes.
//!
//! The key names the log the record speaks about, so compaction keeps the
//! newest record per consumer, cluster, topic, topic identity and
//! partition. The topic identity is the Kafka topic id the counted
//! messages' destinations name (`destination.v2`): a topic deleted and
//! created again under the same name is another log, with its own key.
//! A watermark of no topic id (`destination.v1` messages) is a `.v1` key
//! and value, byte for byte as before topic ids; one with a topic id is a
//! `.v2` key and value, the same fields with `topicId` right after `topic`
//! (the encoding has no optional fields, and a `.v1` reader refuses a
//! `.v2` record rather than read it as a watermark of no topic id).
//!
//! **A gap at the watermark.** A consumer that skipped offsets it never
//! decided (a group reset, an out-of-range fetch, a new group started at
//! the end) keeps its watermark at the gap's start
//! (`outbox_consumer::gap`). Its record then says so: `outboxWatermark.v3`,
//! the `.v2` fields with `topicId` always present (empty: of no topic id)
//! and `openGapEnd` after `committedOffset`: the offsets
//! `[committedOffset, openGapEnd)` were skipped, not read. The key stays
//! `.v1` or `.v2`, by the topic id. The reader turns it into a
//! `consumer_gap` finding, resolved by the consumer's first record without
//! a gap (the gap replayed, or accepted by an operator).
//!
//! **The log read, and the anchor.** `outboxWatermark.v4` names the log
//! the consumer read its offset in (`logId`: the topic's id on the broker
//! when it fetched; empty when not known) and what it decided just below
//! it (`anchorEventId`: the event of the message at `committedOffset - 1`
//! when it was a genuine message of it; empty otherwise): the `.v3` fields
//! with `logId` after `topicId`, `openGapEnd` (empty when no gap is open)
//! and `anchorEventId` after `committedOffset`. The key stays `.v1` or
//! `.v2`. A reader takes a record of another log id than its row's for the
//! consumer's reading started over in a new log (the topic recreated, the
//! cluster replaced under the same id): its offset replaces the row's. The
//! anchor lets retention tell a watermark of a replaced log from the new
//! log's events when the log ids cannot (a send whose receipt read the
//! topic's id just before the topic was recreated).
//!
//! **Authentication (optional).** A consumer with a watermark signing key
//! adds two headers: [`KEY_ID_HEADER`] (the key id) and [`SIGNATURE_HEADER`]
//! (`hmac-sha256:` + 64 lower-case hex: HMAC-SHA256 of the exact value
//! bytes, see [`WatermarkRecord::signature`]). The value names the consumer,
//! cluster, topic, topic id and partition, and [`WatermarkRecord::decode`] refuses a
//! key that does not name what the value says, so the signature covers the
//! key too. Neither encoding changes; a reader with verification keys for a
//! consumer checks them with [`verify_signature`].

use crate::canonical::{CanonicalReader, CanonicalWriter};
use crate::error::CoreError;
use crate::id::{validate_identifier, EventId};
use crate::trust::SigningKey;

/// Schema of the value of a record without a topic id.
pub const SCHEMA: &str = "outboxWatermark.v1";
/// Schema of the value of a record with a topic id (`topicId` after `topic`).
pub const SCHEMA_V2: &str = "outboxWatermark.v2";
/// Schema of the value of a record with an open gap at its watermark
/// (`topicId` after `topic`, empty without one; `openGapEnd` after
/// `committedOffset`).
pub const SCHEMA_V3: &str = "outboxWatermark.v3";
/// Schema of the value of a record that names the log its offsets were
/// read in and its anchor (`topicId` and `logId` after `topic`,
/// `openGapEnd` and `anchorEventId` after `committedOffset`; each empty
/// when absent).
pub const SCHEMA_V4: &str = "outboxWatermark.v4";
/// Schema of the key of a record without a topic id.
pub const KEY_SCHEMA: &str = "outboxWatermarkKey.v1";
/// Schema of the key of a record with a topic id (`topicId` after `topic`).
pub const KEY_SCHEMA_V2: &str = "outboxWatermarkKey.v2";
/// Header carrying the value's schema ([`SCHEMA`] or [`SCHEMA_V2`],
/// [`WatermarkRecord::schema`]) on every watermark record.
pub const SCHEMA_HEADER: &str = "outbox-watermark-schema";
/// The record's signature: `hmac-sha256:<hex>` of the value bytes (only on signed records).
pub const SIGNATURE_HEADER: &str = "outbox-watermark-signature";
/// The id of the key that signed the record (only on signed records).
pub const KEY_ID_HEADER: &str = "outbox-watermark-key-id";
/// Header naming the database that decided what a record counts (its
/// PostgreSQL system identifier and database name, `<id>/<name>`): the
/// reader pins the first one it sees per consumer and cluster, and a record
/// of another is a second writer under the same consumer id (a replay, a
/// copy of the consumer's database), not a moved watermark.
pub const DECIDER_HEADER: &str = "outbox-watermark-decider";
/// Longest decider name accepted, bytes.
pub const MAX_DECIDER_BYTES: usize = 200;

/// What the reader does with a record given the decider pinned for its
/// consumer ([`decide_writer`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriterDecision {
    /// The first decider seen: pin it and apply the record.
    Pin(String),
    /// The pinned decider (or a record that names none, from a consumer
    /// older than the header): apply.
    Same,
    /// Another database decided it than the pinned one: a second writer;
    /// the record moves nothing.
    Second {
        /// The decider pinned for the consumer.
        pinned: String,
        /// The one the record names (or why it is unreadable).
        found: String,
    },
}

/// Whether a record whose [`DECIDER_HEADER`] is `found` comes from the
/// writer pinned for its consumer (`pinned`).
pub fn decide_writer(pinned: Option<&str>, found: Option<&[u8]>) -> WriterDecision {
    let Some(found) = found else {
        return WriterDecision::Same;
    };
    let readable = std::str::from_utf8(found).ok().filter(|f| !f.is_empty() && f.len() <= MAX_DECIDER_BYTES && !f.chars().any(char::is_control));
    match (pinned, readable) {
        (_, None) => WriterDecision::Second { pinned: pinned.unwrap_or("").to_owned(), found: format!("an unreadable decider header ({} bytes)", found.len()) },
        (None, Some(f)) => WriterDecision::Pin(f.to_owned()),
        (Some(p), Some(f)) if p == f => WriterDecision::Same,
        (Some(p), Some(f)) => WriterDecision::Second { pinned: p.to_owned(), found: f.to_owned() },
    }
}
/// Default name of the watermark topic (one per cluster).
pub const DEFAULT_TOPIC: &str = "outbox.watermarks";
/// Largest key or value accepted, bytes.
pub const MAX_RECORD_BYTES: usize = 4096;

/// One consumer's watermark of one partition, as published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatermarkRecord {
    /// The consumer (its `consumerId`).
    pub consumer_id: String,
    /// The consumer's Kafka group.
    pub group_id: String,
    /// Cluster id of the log the watermark is about.
    pub cluster_id: String,
    /// Topic name.
    pub topic: String,
    /// The topic id the counted messages' destinations name (`None`: of no
    /// id, `destination.v1` messages): with the topic, which log.
    pub topic_id: Option<String>,
    /// The log the committed offset was read in: the topic id the broker
    /// gave the topic when the consumer read it (`None`: unknown, a cluster
    /// without topic ids or a consumer older than it). Unlike `topic_id`
    /// (what the counted messages' destinations name) it is the log itself:
    /// a record of another log id than the stored row's is the consumer's
    /// reading started over in a new log (the topic recreated, the cluster
    /// replaced under the same id), and replaces the row rather than being
    /// taken for a watermark moved back.
    pub log_id: Option<String>,
    /// Whether the record says what the consumer decided at
    /// `committed_offset - 1` (`anchor_event_id`): every `.v4` record does;
    /// older ones do not, and their watermark is judged by its log's name
    /// and id alone.
    pub anchor_recorded: bool,
    /// The event of the message at `committed_offset - 1`, when the
    /// consumer decided it as a genuine message of that event (`None`:
    /// another message, or an offset capped at a gap). Retention finds that
    /// event's receipt there, so a watermark of a replaced log under the
    /// same name (and id, when a send's receipt read the id before the
    /// replacement) does not pass the new log's events.
    pub anchor_event_id: Option<String>,
    /// Partition.
    pub partition: i32,
    /// Next offset the consumer reads: every message below has a committed decision.
    pub committed_offset: i64,
    /// The end of an open gap at the watermark: the offsets
    /// `[committed_offset, end)` were skipped, not read (`None`: no gap
    /// there). Greater than `committed_offset`.
    pub open_gap_end: Option<i64>,
    /// Events applied (cumulative).
    pub applied_count: i64,
    /// Redeliveries answered without a second effect (cumulative).
    pub duplicate_count: i64,
    /// Messages quarantined (cumulative).
    pub quarantined_count: i64,
    /// Events dead-lettered (cumulative).
    pub dead_lettered_count: i64,
    /// Last event applied on the partition.
    pub last_event_id: Option<String>,
    /// When the consumer's database last moved this watermark, ms since the
    /// epoch (the consumer database's clock): the record's version.
    pub updated_at_ms: i64,
    /// When the record was published, ms since the epoch (the consumer's clock).
    pub published_at_ms: i64,
}

fn bad(why: impl Into<String>) -> CoreError {
    CoreError::InvalidEncoding(why.into())
}

impl WatermarkRecord {
    /// Checks every field: identifiers, a well-formed topic id, a
    /// non-negative partition, offsets and counts, a well-formed last eventId.
    pub fn validate(&self) -> Result<(), CoreError> {
        validate_identifier("consumerId", &self.consumer_id)?;
        validate_identifier("groupId", &self.group_id)?;
        validate_identifier("clusterId", &self.cluster_id)?;
        validate_identifier("topic", &self.topic)?;
        if let Some(id) = &self.topic_id {
            crate::envelope::validate_topic_id(id)?;
        }
        if let Some(id) = &self.log_id {
            crate::envelope::validate_topic_id(id).map_err(|e| bad(format!("logId: {e}")))?;
        }
        if self.partition < 0 {
            return Err(bad(format!("partition {} is negative", self.partition)));
        }
        for (name, v) in [
            ("committedOffset", self.committed_offset),
            ("appliedCount", self.applied_count),
            ("duplicateCount", self.duplicate_count),
            ("quarantinedCount", self.quarantined_count),
            ("deadLetteredCount", self.dead_lettered_count),
            ("updatedAtMs", self.updated_at_ms),
            ("publishedAtMs", self.published_at_ms),
        ] {
            if v < 0 {
                return Err(bad(format!("{name} {v} is negative")));
            }
        }
        if let Some(e) = &self.last_event_id {
            e.parse::<EventId>()?;
        }
        if let Some(e) = &self.anchor_event_id {
            if !self.anchor_recorded {
                return Err(bad("an anchor event on a record that does not record its anchor"));
            }
            e.parse::<EventId>().map_err(|e| bad(format!("anchorEventId: {e}")))?;
        }
        if let Some(end) = self.open_gap_end {
            if end <= self.committed_offset {
                return Err(bad(format!("openGapEnd {end} is not above committedOffset {}", self.committed_offset)));
            }
        }
        Ok(())
    }

    /// The schema of the value: [`SCHEMA_V4`] with a log id or a recorded
    /// anchor, [`SCHEMA_V3`] with an open gap, [`SCHEMA_V2`] with a topic
    /// id, [`SCHEMA`] with none of them.
    pub fn schema(&self) -> &'static str {
        match (self.log_id.is_some() || self.anchor_recorded, self.open_gap_end, &self.topic_id) {
            (true, _, _) => SCHEMA_V4,
            (false, Some(_), _) => SCHEMA_V3,
            (false, None, Some(_)) => SCHEMA_V2,
            (false, None, None) => SCHEMA,
        }
    }

    /// The key bytes: `outboxWatermarkKey.v1` with consumerId, clusterId,
    /// topic, partition; `outboxWatermarkKey.v2` with `topicId` after
    /// `topic` when the record has a topic id.
    pub fn key_bytes(&self) -> Vec<u8> {
        let w = match &self.topic_id {
            None => CanonicalWriter::new(KEY_SCHEMA).field("consumerId", &self.consumer_id).field("clusterId", &self.cluster_id).field("topic", &self.topic),
            Some(id) => CanonicalWriter::new(KEY_SCHEMA_V2)
                .field("consumerId", &self.consumer_id)
                .field("clusterId", &self.cluster_id)
                .field("topic", &self.topic)
                .field("topicId", id),
        };
        w.field("partition", self.partition.to_string()).finish()
    }

    /// The value bytes: `outboxWatermark.v1`, fields in the documented order;
    /// `outboxWatermark.v2`, with `topicId` after `topic`, when the record
    /// has a topic id; `outboxWatermark.v3`, with `topicId` (empty without
    /// one) and `openGapEnd` after `committedOffset`, when it has an open gap;
    /// `outboxWatermark.v4`, with `topicId`, `logId`, `openGapEnd` and
    /// `anchorEventId` always (each empty when absent), when it has a log
    /// id or records its anchor.
    pub fn value_bytes(&self) -> Vec<u8> {
        let schema = self.schema();
        let w = CanonicalWriter::new(schema)
            .field("consumerId", &self.consumer_id)
            .field("groupId", &self.group_id)
            .field("clusterId", &self.cluster_id)
            .field("topic", &self.topic);
        let w = match schema {
            SCHEMA => w,
            _ => w.field("topicId", self.topic_id.as_deref().unwrap_or("")),
        };
        let w = match schema {
            SCHEMA_V4 => w.field("logId", self.log_id.as_deref().unwrap_or("")),
            _ => w,
        };
        let w = w.field("partition", self.partition.to_string()).field("committedOffset", self.committed_offset.to_string());
        let w = match (schema, self.open_gap_end) {
            (SCHEMA_V4, end) => w.field("openGapEnd", end.map(|e| e.to_string()).unwrap_or_default()).field("anchorEventId", self.anchor_event_id.as_deref().unwrap_or("")),
            (_, None) => w,
            (_, Some(end)) => w.field("openGapEnd", end.to_string()),
        };
        w.field("appliedCount", self.applied_count.to_string())
            .field("duplicateCount", self.duplicate_count.to_string())
            .field("quarantinedCount", self.quarantined_count.to_string())
            .field("deadLetteredCount", self.dead_lettered_count.to_string())
            .field("lastEventId", self.last_event_id.as_deref().unwrap_or(""))
            .field("updatedAtMs", self.updated_at_ms.to_string())
            .field("publishedAtMs", self.published_at_ms.to_string())
            .finish()
    }

    /// The signature the publisher writes in [`SIGNATURE_HEADER`]:
    /// `hmac-sha256:<hex>` of [`Self::value_bytes`] under `key`.
    pub fn signature(&self, key: &SigningKey) -> String {
        key.sign(&self.value_bytes())
    }

    /// Reads a record from its key and value (`.v1` to `.v4`), refusing
    /// anything malformed, oversized, or whose key does not name what its
    /// value says (consumer, cluster, topic, topic id and partition, the
    /// key's schema included: a `.v1` key does not name a `.v2` value).
    pub fn decode(key: Option<&[u8]>, value: Option<&[u8]>) -> Result<WatermarkRecord, CoreError> {
        let key = key.ok_or_else(|| bad("watermark record without a key"))?;
        let value = value.ok_or_else(|| bad("watermark record without a value (a tombstone)"))?;
        if key.len() > MAX_RECORD_BYTES || value.len() > MAX_RECORD_BYTES {
            return Err(bad(format!("watermark record over {MAX_RECORD_BYTES} bytes")));
        }
        let is = |schema: &str| value.starts_with(schema.as_bytes()) && value.get(schema.len()) == Some(&b'\n');
        let schema = [SCHEMA_V2, SCHEMA_V3, SCHEMA_V4].into_iter().find(|s| is(s)).unwrap_or(SCHEMA);
        let mut r = CanonicalReader::new(value, schema)?;
        let nonempty = |s: &str| Some(s).filter(|s| !s.is_empty()).map(str::to_owned);
        let record = WatermarkRecord {
            consumer_id: r.field("consumerId")?.to_owned(),
            group_id: r.field("groupId")?.to_owned(),
            cluster_id: r.field("clusterId")?.to_owned(),
            topic: r.field("topic")?.to_owned(),
            topic_id: match schema {
                SCHEMA => None,
                SCHEMA_V2 => Some(r.field("topicId")?.to_owned()),
                _ => nonempty(r.field("topicId")?),
            },
            log_id: match schema {
                SCHEMA_V4 => nonempty(r.field("logId")?),
                _ => None,
            },
            anchor_recorded: schema == SCHEMA_V4,
            partition: r.int("partition")?,
            committed_offset: r.int("committedOffset")?,
            open_gap_end: match schema {
                SCHEMA_V3 => Some(r.int("openGapEnd")?),
                SCHEMA_V4 => match r.field("openGapEnd")? {
                    "" => None,
                    end => Some(end.parse().map_err(|_| bad(format!("openGapEnd {end:?} is not an integer")))?),
                },
                _ => None,
            },
            anchor_event_id: match schema {
                SCHEMA_V4 => nonempty(r.field("anchorEventId")?),
                _ => None,
            },
            applied_count: r.int("appliedCount")?,
            duplicate_count: r.int("duplicateCount")?,
            quarantined_count: r.int("quarantinedCount")?,
            dead_lettered_count: r.int("deadLetteredCount")?,
            last_event_id: Some(r.field("lastEventId")?).filter(|s| !s.is_empty()).map(str::to_owned),
            updated_at_ms: r.int("updatedAtMs")?,
            published_at_ms: r.int("publishedAtMs")?,
        };
        r.end()?;
        record.validate()?;
        if record.key_bytes() != key {
            return Err(bad("the key does not name the value's consumer, cluster, topic, topic id and partition"));
        }
        Ok(record)
    }
}

/// The log a watermark is about, as findings name it:
/// `cluster/topic/partition`, or `cluster/topic (topic id ID)/partition`.
pub fn log_name(cluster_id: &str, topic: &str, topic_id: Option<&str>, partition: i32) -> String {
    match topic_id {
        None => format!("{cluster_id}/{topic}/{partition}"),
        Some(id) => format!("{cluster_id}/{topic} (topic id {id})/{partition}"),
    }
}

/// The detail of the `consumer_gap` finding of `consumer_id` on `log`,
/// whose watermark stands at `from`, with `[from, to)` skipped.
pub fn gap_detail(consumer_id: &str, log: &str, from: i64, to: i64) -> String {
    format!(
        "consumer {consumer_id} skipped offsets [{from}, {to}) of {log} without reading them (a group reset, an offset out of range, or a new group started past them); its watermark stays at {from}, so retention keeps those events. Replay the range (reset the group to offset {from}) or, when the messages are gone, accept the gap (`outbox gaps accept`); docs/OPERATIONS.md, \"A consumer gap\""
    )
}

/// The `consumer_gap` findings one consumer's watermarks call for: a
/// finding opened (or seen again) for each log whose watermark stands at an
/// open gap, and the open one of every other log resolved. The consumer's
/// direct copy and the watermark topic's reader both split their rows here.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GapFindings {
    /// The logs (as [`log_name`] names them) whose watermark stands at an
    /// open gap, and each finding's [`gap_detail`].
    pub open: Vec<(String, String)>,
    /// The logs whose watermark stands at no gap.
    pub resolved: Vec<String>,
}

impl GapFindings {
    /// Splits `watermarks` of `consumer_id`: each is its log's name, its
    /// committed offset and its open gap's end, if any.
    pub fn of(consumer_id: &str, watermarks: impl IntoIterator<Item = (String, i64, Option<i64>)>) -> Self {
        let mut split = Self::default();
        for (log, committed_offset, open_gap_end) in watermarks {
            match open_gap_end {
                Some(end) => {
                    let detail = gap_detail(consumer_id, &log, committed_offset, end);
                    split.open.push((log, detail));
                }
                None => split.resolved.push(log),
            }
        }
        split
    }
}

/// Resolves the open `consumer_gap` findings of `$1` (consumer id) on the
/// logs `$2` (`text[]`, as [`log_name`] names them) at `$3` (ms): their
/// watermarks stand at no gap now.
pub const GAP_FINDINGS_RESOLVE_SQL: &str = "UPDATE outbox_findings SET resolved_at_ms = $3
     WHERE kind = 'consumer_gap' AND consumer_id = $1 AND event_id = ANY($2::text[]) AND resolved_at_ms IS NULL";

/// Opens (or sees again) the `consumer_gap` findings of `$1` (consumer id)
/// on the logs `$2` (`text[]`, distinct) with the details `$3` (`text[]`)
/// at `$4` (ms).
pub const GAP_FINDINGS_OPEN_SQL: &str = "INSERT INTO outbox_findings (kind, event_id, consumer_id, age_ms, detail, first_seen_ms, last_seen_ms)
     SELECT 'consumer_gap', l, $1, 0, d, $4, $4 FROM UNNEST($2::text[], $3::text[]) AS t(l, d)
     ON CONFLICT (kind, event_id, consumer_id) WHERE resolved_at_ms IS NULL
     DO UPDATE SET detail = EXCLUDED.detail, last_seen_ms = EXCLUDED.last_seen_ms";

/// Why [`verify_signature`] refused a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SignatureError {
    /// No [`SIGNATURE_HEADER`] or no [`KEY_ID_HEADER`].
    Unsigned,
    /// The key id is none of the consumer's verification keys.
    UnknownKeyId(String),
    /// The signature is not the named key's signature of the value.
    BadSignature(String),
}

impl std::fmt::Display for SignatureError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SignatureError::Unsigned => write!(f, "unsigned (no {SIGNATURE_HEADER} or {KEY_ID_HEADER} header), but the consumer has verification keys"),
            SignatureError::UnknownKeyId(k) => write!(f, "signed with key id {k:?}, which is none of the consumer's verification keys"),
            SignatureError::BadSignature(k) => write!(f, "the signature is not key {k:?}'s signature of the value"),
        }
    }
}

impl std::error::Error for SignatureError {}

/// Checks a record's signature headers against the verification keys of the
/// consumer it names: `value` is the exact value bytes read, `key_id` and
/// `signature` the [`KEY_ID_HEADER`] and [`SIGNATURE_HEADER`] values (the
/// last of each). Any one of `keys` whose id matches may have signed
/// (rotation: the old and the new key both accepted).
pub fn verify_signature(value: &[u8], key_id: Option<&[u8]>, signature: Option<&[u8]>, keys: &[SigningKey]) -> Result<(), SignatureError> {
    let (Some(key_id), Some(signature)) = (key_id, signature) else {
        return Err(SignatureError::Unsigned);
    };
    let shown = || String::from_utf8_lossy(&key_id[..key_id.len().min(200)]).into_owned();
    let mut named = keys.iter().filter(|k| k.key_id().as_bytes() == key_id).peekable();
    if named.peek().is_none() {
        return Err(SignatureError::UnknownKeyId(shown()));
    }
    if named.any(|k| k.verifies(value, signature)) {
        Ok(())
    } else {
        Err(SignatureError::BadSignature(shown()))
    }
}


/// The one statement that copies consumers' watermarks into the outbox
/// database (`outbox_consumer_watermarks`), used by the consumer's direct
/// copy (`outbox_consumer::publish_watermarks`) and by the watermark topic's
/// reader (`outbox_producer::WatermarkTopicReader`). Monotonic: offsets and
/// counts only grow, `updated_at` keeps the consumer's own time and never
/// goes back, and `last_event_id` follows the committed offset (a copy whose
/// offset is behind the stored one keeps the stored event). The anchor
/// (`anchor_event_id`, `anchor_recorded`) follows the offset too: a copy
/// that moves the offset brings its own (an unrecorded one from a record
/// older than `.v4`), and one at the same offset keeps a recorded anchor
/// unless it records one itself.
///
/// Binds: `$1` the consumer id, then one array per column, element `i` of
/// each describing row `i`: `$2` topic (`text[]`), `$3` partition (`int4[]`),
/// `$4` committed offset, `$5` applied, `$6` duplicates, `$7` quarantined,
/// `$8` dead-lettered (`int8[]` each), `$9` last event id (`text[]`),
/// `$10` updated at (`timestamptz[]`), `$11` cluster id, `$12` topic id,
/// `$13` log id and `$14` anchor event id (`text[]`), `$15` anchor
/// recorded (`bool[]`). A row of another log (both log ids known and
/// different: the consumer's reading started over in a new log) is
/// replaced, its offset included, not raised. A row's log id is always the
/// one its offset was read in: a copy that does not move the offset does
/// not relabel it.
pub const COPY_UPSERT_SQL: &str = "INSERT INTO outbox_consumer_watermarks AS w
         (consumer_id, cluster_id, topic, topic_id, partition, committed_offset, applied_count, duplicate_count, quarantined_count, dead_lettered_count, last_event_id, updated_at, log_id, anchor_event_id, anchor_recorded)
     SELECT $1, u.cluster_id, u.topic, u.topic_id, u.partition, u.committed_offset, u.applied, u.duplicates, u.quarantined, u.dead, u.last_event_id, u.updated_at, u.log_id, u.anchor, u.recorded
     FROM UNNEST($2::text[], $3::int4[], $4::int8[], $5::int8[], $6::int8[], $7::int8[], $8::int8[], $9::text[], $10::timestamptz[], $11::text[], $12::text[], $13::text[], $14::text[], $15::bool[])
         AS u(topic, partition, committed_offset, applied, duplicates, quarantined, dead, last_event_id, updated_at, cluster_id, topic_id, log_id, anchor, recorded)
     ON CONFLICT (consumer_id, cluster_id, topic, partition, topic_id) DO UPDATE SET
         anchor_event_id = CASE WHEN w.log_id <> EXCLUDED.log_id OR EXCLUDED.committed_offset > w.committed_offset THEN EXCLUDED.anchor_event_id
                                WHEN EXCLUDED.committed_offset = w.committed_offset AND EXCLUDED.anchor_recorded THEN EXCLUDED.anchor_event_id
                                ELSE w.anchor_event_id END,
         anchor_recorded = CASE WHEN w.log_id <> EXCLUDED.log_id OR EXCLUDED.committed_offset > w.committed_offset THEN EXCLUDED.anchor_recorded
                                WHEN EXCLUDED.committed_offset = w.committed_offset THEN w.anchor_recorded OR EXCLUDED.anchor_recorded
                                ELSE w.anchor_recorded END,
         committed_offset = CASE WHEN w.log_id <> EXCLUDED.log_id THEN EXCLUDED.committed_offset
                                 ELSE GREATEST(w.committed_offset, EXCLUDED.committed_offset) END,
         log_id = CASE WHEN w.log_id <> EXCLUDED.log_id OR EXCLUDED.committed_offset >= w.committed_offset
                       THEN COALESCE(EXCLUDED.log_id, w.log_id) ELSE w.log_id END,
         applied_count = GREATEST(w.applied_count, EXCLUDED.applied_count),
         duplicate_count = GREATEST(w.duplicate_count, EXCLUDED.duplicate_count),
         quarantined_count = GREATEST(w.quarantined_count, EXCLUDED.quarantined_count),
         dead_lettered_count = GREATEST(w.dead_lettered_count, EXCLUDED.dead_lettered_count),
         last_event_id = CASE WHEN w.log_id <> EXCLUDED.log_id OR EXCLUDED.committed_offset >= w.committed_offset
                              THEN COALESCE(EXCLUDED.last_event_id, w.last_event_id) ELSE w.last_event_id END,
         updated_at = GREATEST(w.updated_at, EXCLUDED.updated_at)";

#[cfg(test)]
mod writer_tests {
    use super::*;

    #[test]
    fn the_first_decider_is_pinned_and_another_is_a_second_writer() {
        assert_eq!(decide_writer(None, Some(b"7716/orders")), WriterDecision::Pin("7716/orders".into()));
        assert_eq!(decide_writer(Some("7716/orders"), Some(b"7716/orders")), WriterDecision::Same);
        assert_eq!(decide_writer(Some("7716/orders"), None), WriterDecision::Same, "a record of an older consumer names none");
        assert_eq!(decide_writer(None, None), WriterDecision::Same);
        assert_eq!(
            decide_writer(Some("7716/orders"), Some(b"9001/orders_replay")),
            WriterDecision::Second { pinned: "7716/orders".into(), found: "9001/orders_replay".into() }
        );
        assert_eq!(decide_writer(None, Some("7716/bestellungen ü".as_bytes())), WriterDecision::Pin("7716/bestellungen ü".into()), "any database name");
        assert!(matches!(decide_writer(None, Some(b"a\nb")), WriterDecision::Second { .. }), "unreadable");
        assert!(matches!(decide_writer(None, Some(&[0xff, 0xfe])), WriterDecision::Second { .. }), "not UTF-8");
        assert!(matches!(decide_writer(Some("a"), Some(&[b'x'; MAX_DECIDER_BYTES + 1])), WriterDecision::Second { .. }), "too long");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> WatermarkRecord {
        WatermarkRecord {
            consumer_id: "shipping".into(),
            group_id: "shipping".into(),
            cluster_id: "kafka-prod".into(),
            topic: "orders".into(),
            topic_id: None,
            log_id: None,
            anchor_recorded: false,
            anchor_event_id: None,
            partition: 3,
            committed_offset: 42,
            open_gap_end: None,
            applied_count: 40,
            duplicate_count: 1,
            quarantined_count: 1,
            dead_lettered_count: 0,
            last_event_id: None,
            updated_at_ms: 1_764_547_200_000,
            published_at_ms: 1_764_547_201_000,
        }
    }

    #[test]
    fn round_trip_and_exact_key() {
        let r = sample();
        assert_eq!(WatermarkRecord::decode(Some(&r.key_bytes()), Some(&r.value_bytes())).unwrap(), r);
        assert_eq!(r.key_bytes(), b"outboxWatermarkKey.v1\nconsumerId=8:shipping\nclusterId=10:kafka-prod\ntopic=6:orders\npartition=1:3\n".to_vec());
    }

    /// A record with a topic id is `.v2` (key and value, `topicId` after
    /// `topic`), one without stays `.v1` byte for byte; both read back.
    #[test]
    fn a_topic_id_makes_a_v2_record_and_round_trips() {
        let v1 = sample();
        assert_eq!(v1.schema(), SCHEMA);
        assert!(v1.value_bytes().starts_with(b"outboxWatermark.v1\nconsumerId=8:shipping\ngroupId=8:shipping\nclusterId=10:kafka-prod\ntopic=6:orders\npartition=1:3\n"));
        let v2 = WatermarkRecord { topic_id: Some("AAECAwQFBgcICQoLDA0ODw".into()), ..sample() };
        assert_eq!(v2.schema(), SCHEMA_V2);
        assert_eq!(
            v2.key_bytes(),
            b"outboxWatermarkKey.v2\nconsumerId=8:shipping\nclusterId=10:kafka-prod\ntopic=6:orders\ntopicId=22:AAECAwQFBgcICQoLDA0ODw\npartition=1:3\n".to_vec()
        );
        assert!(v2.value_bytes().starts_with(b"outboxWatermark.v2\nconsumerId=8:shipping\ngroupId=8:shipping\nclusterId=10:kafka-prod\ntopic=6:orders\ntopicId=22:AAECAwQFBgcICQoLDA0ODw\npartition=1:3\n"));
        assert_eq!(WatermarkRecord::decode(Some(&v2.key_bytes()), Some(&v2.value_bytes())).unwrap(), v2);
        assert_eq!(WatermarkRecord::decode(Some(&v1.key_bytes()), Some(&v1.value_bytes())).unwrap(), v1);
        // The same value bytes under the other schema name do not read.
        let mut renamed = b"outboxWatermark.v1".to_vec();
        renamed.extend_from_slice(&v2.value_bytes()[SCHEMA_V2.len()..]);
        assert!(WatermarkRecord::decode(Some(&v2.key_bytes()), Some(&renamed)).is_err());
        let bad = WatermarkRecord { topic_id: Some("not-a-topic-id".into()), ..sample() };
        assert!(WatermarkRecord::decode(Some(&bad.key_bytes()), Some(&bad.value_bytes())).is_err());
    }

    /// A record standing at an open gap is `.v3` (`topicId` always, empty
    /// without one; `openGapEnd` after `committedOffset`) under the same
    /// `.v1` or `.v2` key, and round-trips; a gap end not above the
    /// committed offset is refused.
    #[test]
    fn an_open_gap_makes_a_v3_value_under_the_same_key() {
        let plain = sample();
        let gapped = WatermarkRecord { open_gap_end: Some(50), ..sample() };
        assert_eq!(gapped.schema(), SCHEMA_V3);
        assert_eq!(gapped.key_bytes(), plain.key_bytes());
        assert!(gapped.value_bytes().starts_with(
            b"outboxWatermark.v3\nconsumerId=8:shipping\ngroupId=8:shipping\nclusterId=10:kafka-prod\ntopic=6:orders\ntopicId=0:\npartition=1:3\ncommittedOffset=2:42\nopenGapEnd=2:50\nappliedCount=2:40\n"
        ));
        assert_eq!(WatermarkRecord::decode(Some(&gapped.key_bytes()), Some(&gapped.value_bytes())).unwrap(), gapped);
        let with_id = WatermarkRecord { topic_id: Some("AAECAwQFBgcICQoLDA0ODw".into()), ..gapped.clone() };
        assert!(with_id.value_bytes().starts_with(b"outboxWatermark.v3\nconsumerId=8:shipping\ngroupId=8:shipping\nclusterId=10:kafka-prod\ntopic=6:orders\ntopicId=22:AAECAwQFBgcICQoLDA0ODw\n"));
        assert!(with_id.key_bytes().starts_with(b"outboxWatermarkKey.v2\n"));
        assert_eq!(WatermarkRecord::decode(Some(&with_id.key_bytes()), Some(&with_id.value_bytes())).unwrap(), with_id);
        // The gapped value under the other topic identity's key is refused.
        assert!(WatermarkRecord::decode(Some(&with_id.key_bytes()), Some(&gapped.value_bytes())).is_err());
        for end in [42, 7] {
            let bad = WatermarkRecord { open_gap_end: Some(end), ..sample() };
            let err = WatermarkRecord::decode(Some(&bad.key_bytes()), Some(&bad.value_bytes())).unwrap_err();
            assert!(err.to_string().contains("openGapEnd"), "{err}");
        }
    }

    /// A record that names the log its offset was read in, or records its
    /// anchor, is `.v4` (`topicId`, `logId`, `openGapEnd` and
    /// `anchorEventId` always, the absent ones empty) under the same `.v1`
    /// or `.v2` key, and round-trips with or without a topic id, a log id, a
    /// gap and an anchor event; a `.v4` record always records its anchor
    /// (empty: none); a malformed log id or anchor is refused.
    #[test]
    fn a_log_id_or_an_anchor_makes_a_v4_value_under_the_same_key() {
        let log = Some("ERESERESERESERESERESEQ".to_owned());
        let anchor = Some("evt-01KBBKB13V04HMASW9NF6YY093".to_owned());
        let plain = WatermarkRecord { log_id: log.clone(), anchor_recorded: true, ..sample() };
        assert_eq!(plain.schema(), SCHEMA_V4);
        assert_eq!(plain.key_bytes(), sample().key_bytes());
        assert!(plain.value_bytes().starts_with(
            b"outboxWatermark.v4\nconsumerId=8:shipping\ngroupId=8:shipping\nclusterId=10:kafka-prod\ntopic=6:orders\ntopicId=0:\nlogId=22:ERESERESERESERESERESEQ\npartition=1:3\ncommittedOffset=2:42\nopenGapEnd=0:\nanchorEventId=0:\nappliedCount=2:40\n"
        ));
        let both = WatermarkRecord { topic_id: Some("AAECAwQFBgcICQoLDA0ODw".into()), open_gap_end: Some(50), anchor_event_id: anchor.clone(), ..plain.clone() };
        assert!(both.value_bytes().starts_with(
            b"outboxWatermark.v4\nconsumerId=8:shipping\ngroupId=8:shipping\nclusterId=10:kafka-prod\ntopic=6:orders\ntopicId=22:AAECAwQFBgcICQoLDA0ODw\nlogId=22:ERESERESERESERESERESEQ\npartition=1:3\ncommittedOffset=2:42\nopenGapEnd=2:50\nanchorEventId=30:evt-01KBBKB13V04HMASW9NF6YY093\n"
        ));
        assert!(both.key_bytes().starts_with(b"outboxWatermarkKey.v2\n"));
        let anchored_only = WatermarkRecord { anchor_recorded: true, anchor_event_id: anchor.clone(), ..sample() };
        assert_eq!(anchored_only.schema(), SCHEMA_V4, "an anchor without a log id");
        assert!(anchored_only.value_bytes().starts_with(b"outboxWatermark.v4\nconsumerId=8:shipping\ngroupId=8:shipping\nclusterId=10:kafka-prod\ntopic=6:orders\ntopicId=0:\nlogId=0:\n"));
        for r in [&plain, &both, &anchored_only] {
            assert_eq!(&WatermarkRecord::decode(Some(&r.key_bytes()), Some(&r.value_bytes())).unwrap(), r);
        }
        let bad = WatermarkRecord { log_id: Some("not-a-log-id".into()), ..sample() };
        let err = WatermarkRecord::decode(Some(&bad.key_bytes()), Some(&bad.value_bytes())).unwrap_err();
        assert!(err.to_string().contains("logId"), "{err}");
        let bad = WatermarkRecord { anchor_event_id: Some("evt-nope".into()), ..plain.clone() };
        let err = WatermarkRecord::decode(Some(&bad.key_bytes()), Some(&bad.value_bytes())).unwrap_err();
        assert!(err.to_string().contains("anchorEventId"), "{err}");
        let unrecorded = WatermarkRecord { anchor_recorded: false, anchor_event_id: anchor, ..sample() };
        assert!(unrecorded.validate().is_err(), "an anchor event on a record that records none");
    }

    /// A consumer's watermarks split into the gap findings to open, with
    /// the skipped range in each detail, and the logs whose finding resolves.
    #[test]
    fn gap_findings_open_the_gapped_logs_and_resolve_the_rest() {
        let split = GapFindings::of("shipping", [("c/orders/0".to_owned(), 10, Some(25)), ("c/orders/1".to_owned(), 7, None), ("c/orders/2".to_owned(), 3, Some(4))]);
        assert_eq!(split.resolved, vec!["c/orders/1".to_owned()]);
        let logs: Vec<&str> = split.open.iter().map(|(l, _)| l.as_str()).collect();
        assert_eq!(logs, ["c/orders/0", "c/orders/2"]);
        assert!(split.open[0].1.contains("consumer shipping skipped offsets [10, 25) of c/orders/0"), "{}", split.open[0].1);
        assert!(split.open[1].1.contains("[3, 4)"), "{}", split.open[1].1);
        assert_eq!(GapFindings::of("shipping", []), GapFindings::default());
    }

    /// The key must name the value's topic id: another id, an id the value
    /// does not have, or none where the value has one are refused.
    #[test]
    fn a_key_naming_another_topic_id_is_refused() {
        let v2 = WatermarkRecord { topic_id: Some("AAECAwQFBgcICQoLDA0ODw".into()), ..sample() };
        let other = WatermarkRecord { topic_id: Some("_____________________w".into()), ..sample() };
        let none = sample();
        for (key, value) in [(&other, &v2), (&none, &v2), (&v2, &none)] {
            let err = WatermarkRecord::decode(Some(&key.key_bytes()), Some(&value.value_bytes())).unwrap_err();
            assert!(err.to_string().contains("topic id"), "{err}");
        }
    }

    #[test]
    fn refuses_mismatched_key_negative_values_and_tombstones() {
        let r = sample();
        let mut other = r.clone();
        other.partition = 4;
        assert!(WatermarkRecord::decode(Some(&other.key_bytes()), Some(&r.value_bytes())).is_err());
        let mut neg = r.clone();
        neg.committed_offset = -1;
        assert!(WatermarkRecord::decode(Some(&neg.key_bytes()), Some(&neg.value_bytes())).is_err());
        assert!(WatermarkRecord::decode(Some(&r.key_bytes()), None).is_err());
        assert!(WatermarkRecord::decode(None, Some(&r.value_bytes())).is_err());
        let mut bad_event = r.clone();
        bad_event.last_event_id = Some("evt-nope".into());
        assert!(WatermarkRecord::decode(Some(&bad_event.key_bytes()), Some(&bad_event.value_bytes())).is_err());
        let big = vec![b'x'; MAX_RECORD_BYTES + 1];
        assert!(WatermarkRecord::decode(Some(&r.key_bytes()), Some(&big)).is_err());
    }

    #[test]
    fn signatures_are_checked_against_the_consumers_keys() {
        let r = sample();
        let old = SigningKey::from_hex("wm-old", &"0a".repeat(32)).unwrap();
        let new = SigningKey::from_hex("wm-new", &"0b".repeat(32)).unwrap();
        let keys = [old.clone(), new.clone()];
        let value = r.value_bytes();
        let sig = r.signature(&new);
        assert!(sig.starts_with("hmac-sha256:") && sig.len() == 12 + 64, "{sig}");
        assert_eq!(verify_signature(&value, Some(b"wm-new"), Some(sig.as_bytes()), &keys), Ok(()));
        // Rotation: the old key's signature is accepted too.
        assert_eq!(verify_signature(&value, Some(b"wm-old"), Some(r.signature(&old).as_bytes()), &keys), Ok(()));
        assert_eq!(verify_signature(&value, None, None, &keys), Err(SignatureError::Unsigned));
        assert_eq!(verify_signature(&value, Some(b"wm-new"), None, &keys), Err(SignatureError::Unsigned));
        assert_eq!(verify_signature(&value, Some(b"wm-x"), Some(sig.as_bytes()), &keys), Err(SignatureError::UnknownKeyId("wm-x".into())));
        // The new key's signature under the old key's id, and a changed value.
        assert_eq!(verify_signature(&value, Some(b"wm-old"), Some(sig.as_bytes()), &keys), Err(SignatureError::BadSignature("wm-old".into())));
        let mut moved = r.clone();
        moved.committed_offset += 1;
        assert_eq!(verify_signature(&moved.value_bytes(), Some(b"wm-new"), Some(sig.as_bytes()), &keys), Err(SignatureError::BadSignature("wm-new".into())));
        // Another partition's record (key and value) does not carry this one's signature.
        let mut other = r.clone();
        other.partition = 4;
        assert!(verify_signature(&other.value_bytes(), Some(b"wm-new"), Some(sig.as_bytes()), &keys).is_err());
    }
}
