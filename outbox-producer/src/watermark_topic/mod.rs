//! Reading the watermark topic: consumers' watermarks published over the
//! broker, applied to the outbox database.
//!
//! An idempotent consumer whose state lives in its own database publishes
//! its watermark rows as `outboxWatermark.v1` records (`.v2` for a row of a
//! topic id: the log of one incarnation of a topic; `.v3` at an open gap;
//! `.v4` naming the log its offset was read in) to a compacted topic
//! of the cluster it reads ([`DEFAULT_TOPIC`], one per cluster). The
//! [`WatermarkTopicReader`] reads that topic from the start of its log (its
//! read position is kept in `outbox_watermark_topic_cursors` and moves in
//! the transaction that applies the records) and applies each record to
//! `outbox_consumer_watermarks`, from where the unconsumed check, lag in the
//! status and the report, and the retention gate use it unchanged.
//!
//! **What is applied.** A record is applied only when all of this holds;
//! otherwise it is ignored and, but for the first case, is a finding:
//! - it decodes (`outboxWatermark.v1` to `.v4`, its key naming its value) and names
//!   the cluster it was read from (`watermark_rejected` otherwise);
//! - when [`WatermarkTopicConfig::verify_keys`] holds keys for the consumer
//!   it names: it is signed (headers `outbox-watermark-key-id` and
//!   `outbox-watermark-signature`) by one of those keys, over its exact
//!   value bytes (`watermark_rejected` otherwise, with the reason: unsigned,
//!   unknown key id, bad signature);
//! - when the reader holds no key for the consumer: the consumer is opted
//!   out of verification by name ([`WatermarkTopicConfig::allow_unsigned`]),
//!   and its records are then not checked. A declared consumer neither keyed
//!   nor opted out has every record refused, signed or not
//!   (`watermark_rejected`, saying that no key is configured for it and how
//!   to configure one or opt it out; one open finding per consumer and log,
//!   however many records arrive);
//! - the consumer is declared in `outbox_consumers`
//!   (`watermark_undeclared_consumer` otherwise);
//! - its committed offset is not beyond the end (high watermark) of the
//!   partition it speaks about (`watermark_beyond_end` otherwise);
//! - it is not older than what is stored (its `updatedAtMs`, the consumer
//!   database's time of the row, is not below the stored one): an older
//!   record is a reordered earlier publication and is ignored quietly;
//! - the committed offset and every count are at least what is stored:
//!   offsets and counts never move back (`watermark_moved_back` otherwise),
//!   except in a new log: a `.v4` record whose log id differs from the one
//!   stored with the row (the topic deleted and created again, the cluster
//!   replaced under the same id) is the consumer's reading started over,
//!   and replaces the row's offset; the retention gate then holds every
//!   event whose receipt names the old log.
//!
//! A declared consumer that has published over the broker and whose last
//! acceptable record is older than `ReconcilerConfig::stale_watermark_after_ms`
//! is `stale_watermark` (a condition: it resolves once records arrive
//! again); its watermark stays where it was, so a mandatory consumer's
//! stale watermark holds retention.
//!
//! **Authentication.** By default a record moves a consumer's watermark only
//! when signed by a key the reader holds for that consumer. For a consumer
//! opted out ([`WatermarkTopicConfig::allow_unsigned`]; the reader logs them
//! at WARN when it connects) the reader trusts any producer with write
//! access to the watermark topic, within the rules above. For one with keys,
//! only a holder of one of them can speak for it; a replayed genuine record
//! is still bounded by the rules above (an
//! older record is out of date, a lower offset moves back), and the value
//! names the consumer, cluster, topic, topic id and partition, so a signed
//! record cannot be moved to another of them.
//!
//! A record is applied to the row of its own log: consumer, cluster, topic,
//! partition and topic id (exactly; a `.v1` record is of no topic id). The
//! partition's end it is checked against is the end of the topic's current
//! log, whatever id the record names.
//!
//! Files: `config` holds the [`WatermarkTopicConfig`] (verification keys
//! and opt-outs, their parsing and validation); [`decide`] the decisions
//! about one record, without I/O, and [`round`] a round's over the records
//! it read, through a [`round::RoundSink`] (the simulator's reader runs
//! both); `reader` the
//! [`WatermarkTopicReader`]: the Kafka client, and a round that reads the
//! topic and decides about each record ([`IngestReport`]); `apply` the SQL
//! a round runs in its transaction (the monotonic watermark upsert, the
//! writer pin and the findings) and [`repin`].

mod apply;
mod config;
pub mod decide;
mod reader;
pub mod round;

pub use outbox_core::watermark_record::DEFAULT_TOPIC;

pub use apply::{repin, MAX_FINDINGS_PER_ROUND};
pub use config::{
    WatermarkTopicConfig, DEFAULT_GROUP_ID, DEFAULT_MAX_RECORDS_PER_ROUND, DEFAULT_ROUND_TIMEOUT_MS, LIMIT_KEYED_CONSUMERS, LIMIT_KEYS_PER_CONSUMER, LIMIT_MAX_RECORDS_PER_ROUND,
    LIMIT_UNSIGNED_CONSUMERS,
};
pub use reader::{IngestReport, WatermarkTopicReader, READER_FINDINGS, READ_PAST_END_IDLE_MS};
