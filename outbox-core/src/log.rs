//! What a broker's log holds and what it answers: the message a send
//! carries, the outcomes of a send and of a lookup, a page of a partition
//! scan and the scan's cursor. Data only, no traits: the decisions
//! (`compare`, `reconcile`, `retention`) read these, and the store and
//! broker traits (`store`) pass them.

use crate::envelope::Destination;
use crate::receipt::BrokerReceipt;

/// Which log: one partition of one topic of one broker cluster, and the
/// topic's identity. Two clusters may carry a topic of one name with
/// unrelated offsets, and a topic deleted and created again under its name
/// starts another log at offset 0 under another topic id; `topic_id` is
/// `None` for a `destination.v1` (the name alone, which cannot tell a
/// recreated topic from the old one). Every position, receipt and
/// watermark names its log by this one type (owned here, borrowed as
/// [`LogRef`]); two logs are the same only when all four parts are equal
/// (`None` matches only `None`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LogId {
    /// Broker cluster identity.
    pub cluster_id: String,
    /// Topic name.
    pub topic: String,
    /// The topic's id (`None`: `destination.v1`).
    pub topic_id: Option<String>,
    /// Partition.
    pub partition: i32,
}

impl LogId {
    /// The log of `cluster_id`/`topic` (of id `topic_id`), partition `partition`.
    pub fn new(cluster_id: impl Into<String>, topic: impl Into<String>, topic_id: Option<String>, partition: i32) -> Self {
        LogId { cluster_id: cluster_id.into(), topic: topic.into(), topic_id, partition }
    }

    /// Borrowed, as the decisions compare logs.
    pub fn as_ref(&self) -> LogRef<'_> {
        LogRef { cluster_id: &self.cluster_id, topic: &self.topic, topic_id: self.topic_id.as_deref(), partition: self.partition }
    }
}

impl std::fmt::Display for LogId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_ref().fmt(f)
    }
}

/// A [`LogId`], borrowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LogRef<'a> {
    /// Broker cluster identity.
    pub cluster_id: &'a str,
    /// Topic name.
    pub topic: &'a str,
    /// The topic's id (`None`: `destination.v1`).
    pub topic_id: Option<&'a str>,
    /// Partition.
    pub partition: i32,
}

impl LogRef<'_> {
    /// Owned.
    pub fn to_log_id(&self) -> LogId {
        LogId { cluster_id: self.cluster_id.to_owned(), topic: self.topic.to_owned(), topic_id: self.topic_id.map(str::to_owned), partition: self.partition }
    }

    /// Whether `other` is a log of the same name (cluster, topic,
    /// partition), whatever the topic ids: the logs a `destination.v1`
    /// cannot tell apart.
    pub fn same_name(&self, other: &LogRef<'_>) -> bool {
        self.cluster_id == other.cluster_id && self.topic == other.topic && self.partition == other.partition
    }
}

impl std::fmt::Display for LogRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.topic_id {
            Some(id) => write!(f, "{}/{}[{id}]/p{}", self.cluster_id, self.topic, self.partition),
            None => write!(f, "{}/{}/p{}", self.cluster_id, self.topic, self.partition),
        }
    }
}

impl BrokerReceipt {
    /// The log this receipt's message is in.
    pub fn log(&self) -> LogRef<'_> {
        LogRef { cluster_id: &self.cluster_id, topic: &self.topic, topic_id: self.topic_id.as_deref(), partition: self.partition }
    }
}

impl Destination {
    /// The log a send of this destination writes to.
    pub fn log(&self) -> LogRef<'_> {
        LogRef { cluster_id: &self.cluster_id, topic: &self.topic, topic_id: self.topic_id.as_deref(), partition: self.partition }
    }
}

/// A message as the broker adapter sends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutgoingMessage {
    /// Topic (from the frozen destination).
    pub topic: String,
    /// Partition (from the frozen destination).
    pub partition: i32,
    /// Routing key bytes.
    pub key: Vec<u8>,
    /// Payload bytes.
    pub payload: Vec<u8>,
    /// Headers, name and value.
    pub headers: Vec<(String, Vec<u8>)>,
}

/// What a send came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendOutcome {
    /// Acknowledged at this position.
    Acked {
        /// Partition.
        partition: i32,
        /// Offset.
        offset: i64,
    },
    /// Definitely not persisted.
    NotPersisted(String),
    /// Possibly persisted, timed out, or otherwise unknown.
    Unknown(String),
}

/// What a lookup in the broker found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LookupOutcome {
    /// Messages carrying the eventId, with their receipts as read back.
    Found(Vec<BrokerReceipt>),
    /// The scanned range provably holds no message with the eventId.
    Absent,
    /// The broker could not answer.
    Unavailable(String),
}

/// One message seen by [`Broker::scan_event_ids`](crate::Broker::scan_event_ids).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScannedMessage {
    /// Its offset.
    pub offset: i64,
    /// Its `outbox-event-id` header, if any.
    pub event_id: Option<String>,
    /// Its key, if any.
    pub key: Option<Vec<u8>>,
    /// `sha256:` digest of its value.
    pub payload_digest: String,
    /// Its `outbox-source` header, if any.
    pub source: Option<String>,
    /// Its `outbox-attempt-id` header, if any.
    pub attempt_id: Option<String>,
    /// The topic id its `outbox-destination` header names (a
    /// `destination.v2` that parses; `None` otherwise): which log a receipt
    /// of it names.
    pub topic_id: Option<String>,
    /// The receipt its outbox headers claim, when they parse: what a lookup
    /// finding it would hand to the receipt transaction.
    pub receipt: Option<crate::receipt::BrokerReceipt>,
}

impl ScannedMessage {
    /// What a scan reads of the message at `offset` of
    /// `cluster_id`/`topic`/`partition`, from its key, value and headers
    /// (the last of a repeated header counts). Both broker adapters build
    /// their pages with it.
    pub fn read(cluster_id: &str, topic: &str, partition: i32, offset: i64, key: Option<&[u8]>, payload: &[u8], headers: &[(String, Vec<u8>)]) -> Self {
        let last = |name: &str| headers.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.as_slice());
        let text = |name: &str| last(name).map(|v| String::from_utf8_lossy(v).into_owned());
        ScannedMessage {
            offset,
            event_id: text(crate::headers::EVENT_ID),
            key: key.map(<[u8]>::to_vec),
            payload_digest: crate::canonical::sha256_digest(payload),
            source: text(crate::trust::SOURCE),
            attempt_id: text(crate::headers::ATTEMPT_ID),
            topic_id: last(crate::headers::DESTINATION).and_then(|v| Destination::from_canonical(v).ok()?.topic_id),
            receipt: crate::headers::parse(headers).ok().map(|claims| claims.receipt(cluster_id, topic, partition, offset, key, payload)),
        }
    }
}

/// The answer of [`Broker::scan_event_ids`](crate::Broker::scan_event_ids).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PartitionScan {
    /// Messages read, in offset order.
    pub messages: Vec<ScannedMessage>,
    /// The next offset to read.
    pub next_offset: i64,
    /// The partition's end (high watermark) when the scan began, when the
    /// adapter knows it: a receipt recorded at or above it, accepted before
    /// the scan, names a position the log no longer has.
    pub log_end: Option<i64>,
    /// The partition's start (low watermark) when the scan began, when the
    /// adapter knows it: offsets from the cursor up to it were deleted
    /// (retention, DeleteRecords) unread.
    pub log_start: Option<i64>,
}

/// Where the bypass scan reads a partition next, and what makes its log
/// recognisable: the anchor of the message at `next_offset - 1`
/// ([`scan_anchor`](crate::compare::scan_anchor)), when known.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BypassCursor {
    /// The next offset to read (0 for a partition never read).
    pub next_offset: i64,
    /// What the message below it was; `None` when not known.
    pub anchor: Option<String>,
}

