//! The receipt store seam: what the [`Processor`](crate::Processor) asks of
//! the database it keeps receipts in, as one small trait.
//!
//! The processor makes every decision (which message is applied, which is a
//! duplicate, which is quarantined or dead-lettered, how far each watermark
//! moves) in its own code; a store only answers reads and performs writes
//! inside one transaction. [`PgConsumerStore`] is the production store
//! (PostgreSQL, the tables of this crate's migrations);
//! [`MemoryConsumerStore`](crate::memory::MemoryConsumerStore) keeps the same
//! rows in memory for tests and the simulator, which runs this very
//! processor over it.
//!
//! **Contract** a store must keep, whatever its backend:
//! - [`claim`](ConsumerStore::claim) inserts the `(consumerId, eventId)`
//!   receipt of each event that has neither a receipt nor a dead letter, in
//!   the transaction; two transactions claiming one event serialize on it
//!   (the second sees the first's receipt once it committed, or fails
//!   retryably); it answers, per event, `New` (claimed here) or `Dead`.
//! - Everything written through the transaction (the handler's writes
//!   included) commits together or not at all; dropping a transaction
//!   without committing rolls it back.

use std::collections::{HashMap, HashSet};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{PgPool, Postgres, Row as _, Transaction};

use crate::error::{ConsumerError, HandlerError};
use crate::event::{headers_json, ConsumedEvent, RawMessage};
use crate::gap::{OffsetGap, Reading, ReadingChange};
use crate::handler::Handler;
use crate::outcome::{Position, Quarantined, Receipt};

/// How a claim went for one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The receipt was claimed in this transaction; it was received then.
    New(DateTime<Utc>),
    /// The event is dead-lettered for this consumer: not claimed.
    Dead,
}

/// One watermark row to move: the partition's row for one topic id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WatermarkAdvance {
    /// The topic id the decided messages name (`None`: `destination.v1`).
    pub topic_id: Option<String>,
    /// The log the decided messages were fetched from
    /// ([`RawMessage::log_id`](crate::RawMessage::log_id)).
    pub log_id: Option<String>,
    /// The next offset to read: the row moves to it, never back, unless the
    /// row was of another log (both log ids known and different): then it
    /// is replaced by this one.
    pub committed_offset: i64,
    /// Events applied in this transaction.
    pub applied: i64,
    /// Redeliveries answered with a receipt (or a known quarantine or dead letter).
    pub duplicates: i64,
    /// Messages newly quarantined.
    pub quarantined: i64,
    /// Events newly dead-lettered.
    pub dead_lettered: i64,
    /// The last event applied, if any.
    pub last_event_id: Option<String>,
    /// The event of the message at `committed_offset - 1`, when this
    /// transaction decided it as a genuine message of it: the watermark's
    /// anchor, by which retention tells a watermark of another log under
    /// the same name (`outbox_core::WatermarkAnchor`). The row keeps the
    /// anchor of its committed offset.
    pub anchor_event_id: Option<String>,
}

/// A message to quarantine.
#[derive(Debug, Clone)]
pub struct QuarantineRow<'a> {
    /// The message.
    pub msg: &'a RawMessage,
    /// Its record.
    pub quarantined: Quarantined,
    /// Bounded evidence, the reason included.
    pub evidence: Value,
}

/// A dead letter to write: a verified event whose handler kept failing.
#[derive(Debug, Clone)]
pub struct DeadLetterRow<'a> {
    /// The message.
    pub msg: &'a RawMessage,
    /// Its verified event.
    pub event: &'a ConsumedEvent,
    /// Handler runs that failed.
    pub attempts: u32,
    /// The last error, at most 4,000 characters.
    pub error: &'a str,
}

/// The database a [`Processor`](crate::Processor) keeps receipts, quarantine
/// rows, dead letters and watermarks in (see the module's contract).
#[async_trait]
pub trait ConsumerStore: Send + Sync + 'static {
    /// One open transaction; dropping it rolls back.
    type Tx: Send + 'static;

    /// Opens a transaction.
    async fn begin(&self) -> Result<Self::Tx, ConsumerError>;
    /// Commits it. An error may hide a commit that happened (a lost answer):
    /// the processor decides again and finds its own receipts.
    async fn commit(&self, tx: Self::Tx) -> Result<(), ConsumerError>;
    /// Rolls it back (best effort: dropping it rolls back too).
    async fn rollback(&self, tx: Self::Tx);
    /// Claims the receipts of `events` (first occurrences, offset order)
    /// for `consumer_id` reading `cluster_id`; answers for each event
    /// claimed here or dead-lettered, nothing for those already received.
    async fn claim(&self, tx: &mut Self::Tx, consumer_id: &str, cluster_id: &str, events: &[&ConsumedEvent]) -> Result<HashMap<String, Claim>, ConsumerError>;
    /// The receipts of `ids` that exist.
    async fn receipts(&self, tx: &mut Self::Tx, consumer_id: &str, ids: &[&str]) -> Result<HashMap<String, Receipt>, ConsumerError>;
    /// The dead letters of `ids` that exist: (attempts, last error).
    async fn dead_letters(&self, tx: &mut Self::Tx, consumer_id: &str, ids: &[&str]) -> Result<HashMap<String, (u32, String)>, ConsumerError>;
    /// Stores the handlers' results in the receipts claimed in `tx`.
    async fn store_results(&self, tx: &mut Self::Tx, consumer_id: &str, results: &[(String, Value)]) -> Result<(), ConsumerError>;
    /// Inserts quarantine rows (payloads above `max_payload_bytes` are not
    /// kept verbatim); answers the offsets newly quarantined (a position
    /// quarantined before is not inserted again).
    async fn quarantine(&self, tx: &mut Self::Tx, consumer_id: &str, rows: &[QuarantineRow<'_>], max_payload_bytes: usize) -> Result<HashSet<i64>, ConsumerError>;
    /// Inserts a dead letter; answers whether it is new (false: the event
    /// was dead-lettered before).
    async fn insert_dead_letter(&self, tx: &mut Self::Tx, consumer_id: &str, row: &DeadLetterRow<'_>) -> Result<bool, ConsumerError>;
    /// The reading of `(cluster_id, topic, partition)` for `consumer_id`: the
    /// offset after the greatest one decided (for a partition with no reading
    /// yet, the greatest `committed_offset` of its watermark rows, if any) and
    /// the open gaps. A second transaction asking for the same reading waits
    /// for this one (or sees its writes), so two deciders never both open a gap.
    async fn reading(&self, tx: &mut Self::Tx, consumer_id: &str, cluster_id: &str, topic: &str, partition: i32) -> Result<Reading, ConsumerError>;
    /// Stores `change` ([`decide_reading`](crate::gap::decide_reading)): the
    /// next offset (never back), the gaps opened, and the new bounds of the
    /// gaps shrunk (a closed one is closed as `replayed`).
    async fn save_reading(&self, tx: &mut Self::Tx, consumer_id: &str, cluster_id: &str, topic: &str, partition: i32, change: &ReadingChange) -> Result<(), ConsumerError>;
    /// Moves the watermark rows of `(cluster_id, topic, partition)`, one per
    /// entry, each to its `committed_offset` if that is higher, adding the counts.
    async fn advance_watermarks(
        &self,
        tx: &mut Self::Tx,
        consumer_id: &str,
        cluster_id: &str,
        topic: &str,
        partition: i32,
        rows: &[WatermarkAdvance],
    ) -> Result<(), ConsumerError>;
}

/// A handler over the transaction type of a [`ConsumerStore`]. Every
/// [`Handler`] (PostgreSQL) is one for [`PgConsumerStore`]; implement this
/// to run a [`Processor`](crate::Processor) over another store (for example
/// [`MemoryConsumerStore`](crate::memory::MemoryConsumerStore) in tests).
#[async_trait]
pub trait TxHandler<Tx: Send>: Send + Sync {
    /// Applies `event` within `tx` (the [`Handler`] rules apply).
    async fn handle_in(&self, tx: &mut Tx, event: &ConsumedEvent) -> Result<Value, HandlerError>;
}

/// The transaction of [`PgConsumerStore`].
pub type PgTx = Transaction<'static, Postgres>;

#[async_trait]
impl<H: Handler + ?Sized> TxHandler<PgTx> for H {
    async fn handle_in(&self, tx: &mut PgTx, event: &ConsumedEvent) -> Result<Value, HandlerError> {
        self.handle(tx, event).await
    }
}

/// The production store: PostgreSQL, the tables of this crate's migrations.
#[derive(Debug, Clone)]
pub struct PgConsumerStore {
    pool: PgPool,
}

impl PgConsumerStore {
    /// A store over `pool`.
    pub fn new(pool: PgPool) -> Self {
        PgConsumerStore { pool }
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

/// Reads a receipt row (columns of `RECEIPT_COLUMNS`).
pub(crate) fn receipt_from_row(row: &sqlx::postgres::PgRow) -> Result<Receipt, ConsumerError> {
    let event_id: String = row.try_get("event_id")?;
    let generation: i32 = row.try_get("envelope_generation")?;
    Ok(Receipt {
        consumer_id: row.try_get("consumer_id")?,
        event_id: event_id.parse().map_err(|e| ConsumerError::CorruptRow(format!("receipt event_id {event_id:?}: {e}")))?,
        envelope_generation: u32::try_from(generation).map_err(|_| ConsumerError::CorruptRow(format!("receipt generation {generation}")))?,
        event_type: row.try_get("event_type")?,
        position: Position { topic: row.try_get("topic")?, partition: row.try_get("partition")?, offset: row.try_get("offset")? },
        topic_id: row.try_get("topic_id")?,
        payload_digest: row.try_get("payload_digest")?,
        result: row.try_get("result")?,
        received_at: row.try_get("received_at")?,
    })
}

pub(crate) const RECEIPT_COLUMNS: &str = r#"consumer_id, event_id, envelope_generation, event_type, topic, topic_id, partition, "offset", payload_digest, result, received_at"#;

#[async_trait]
impl ConsumerStore for PgConsumerStore {
    type Tx = PgTx;

    async fn begin(&self) -> Result<PgTx, ConsumerError> {
        Ok(self.pool.begin().await?)
    }

    async fn commit(&self, tx: PgTx) -> Result<(), ConsumerError> {
        Ok(tx.commit().await?)
    }

    async fn rollback(&self, tx: PgTx) {
        // Rolling back can fail on a broken connection; dropping the
        // transaction rolls back as well.
        let _ = tx.rollback().await;
    }

    async fn claim(&self, tx: &mut PgTx, consumer_id: &str, cluster_id: &str, events: &[&ConsumedEvent]) -> Result<HashMap<String, Claim>, ConsumerError> {
        let mut out = HashMap::with_capacity(events.len());
        if events.is_empty() {
            return Ok(out);
        }
        let ids: Vec<&str> = events.iter().map(|e| e.event_id.as_str()).collect();
        let gens: Vec<i32> = events.iter().map(|e| i32::try_from(e.envelope_generation).unwrap_or(i32::MAX)).collect();
        let types: Vec<&str> = events.iter().map(|e| e.event_type.as_str()).collect();
        let topics: Vec<&str> = events.iter().map(|e| e.topic.as_str()).collect();
        let partitions: Vec<i32> = events.iter().map(|e| e.partition).collect();
        let offsets: Vec<i64> = events.iter().map(|e| e.offset).collect();
        let digests: Vec<&str> = events.iter().map(|e| e.payload_digest.as_str()).collect();
        let topic_ids: Vec<Option<&str>> = events.iter().map(|e| e.topic_id.as_deref()).collect();
        let rows = sqlx::query(
            r#"WITH input AS (
                   SELECT * FROM UNNEST($2::text[], $3::int4[], $4::text[], $5::text[], $6::int4[], $7::int8[], $8::text[], $10::text[])
                       WITH ORDINALITY AS t(event_id, envelope_generation, event_type, topic, partition, "offset", payload_digest, topic_id, ord)
               ), dead AS (
                   SELECT d.event_id FROM outbox_consumer_dead_letters d
                   WHERE d.consumer_id = $1 AND d.event_id IN (SELECT event_id FROM input)
               ), claimed AS (
                   INSERT INTO outbox_consumer_receipts AS r (consumer_id, event_id, envelope_generation, event_type, cluster_id, topic, topic_id, partition, "offset", payload_digest)
                   SELECT $1, i.event_id, i.envelope_generation, i.event_type, $9, i.topic, i.topic_id, i.partition, i."offset", i.payload_digest
                   FROM input i WHERE i.event_id NOT IN (SELECT event_id FROM dead)
                   ORDER BY i.ord
                   ON CONFLICT (consumer_id, event_id) DO NOTHING
                   RETURNING r.event_id, r.received_at
               )
               SELECT event_id, received_at, false AS dead FROM claimed
               UNION ALL
               SELECT event_id, NULL::timestamptz, true FROM dead"#,
        )
        .bind(consumer_id)
        .bind(&ids)
        .bind(&gens)
        .bind(&types)
        .bind(&topics)
        .bind(&partitions)
        .bind(&offsets)
        .bind(&digests)
        .bind(cluster_id)
        .bind(&topic_ids)
        .fetch_all(&mut **tx)
        .await?;
        for row in rows {
            let id: String = row.try_get("event_id")?;
            let dead: bool = row.try_get("dead")?;
            let claim = if dead { Claim::Dead } else { Claim::New(row.try_get("received_at")?) };
            out.insert(id, claim);
        }
        Ok(out)
    }

    async fn receipts(&self, tx: &mut PgTx, consumer_id: &str, ids: &[&str]) -> Result<HashMap<String, Receipt>, ConsumerError> {
        let mut out = HashMap::with_capacity(ids.len());
        if ids.is_empty() {
            return Ok(out);
        }
        let sql = format!("SELECT {RECEIPT_COLUMNS} FROM outbox_consumer_receipts WHERE consumer_id = $1 AND event_id = ANY($2)");
        for row in sqlx::query(&sql).bind(consumer_id).bind(ids).fetch_all(&mut **tx).await? {
            let r = receipt_from_row(&row)?;
            out.insert(r.event_id.as_str().to_owned(), r);
        }
        Ok(out)
    }

    async fn dead_letters(&self, tx: &mut PgTx, consumer_id: &str, ids: &[&str]) -> Result<HashMap<String, (u32, String)>, ConsumerError> {
        let mut out = HashMap::new();
        if ids.is_empty() {
            return Ok(out);
        }
        let rows = sqlx::query("SELECT event_id, attempts, last_error FROM outbox_consumer_dead_letters WHERE consumer_id = $1 AND event_id = ANY($2)")
            .bind(consumer_id)
            .bind(ids)
            .fetch_all(&mut **tx)
            .await?;
        for row in rows {
            let attempts: i32 = row.try_get("attempts")?;
            out.insert(row.try_get("event_id")?, (u32::try_from(attempts).unwrap_or(0), row.try_get("last_error")?));
        }
        Ok(out)
    }

    async fn store_results(&self, tx: &mut PgTx, consumer_id: &str, results: &[(String, Value)]) -> Result<(), ConsumerError> {
        if results.is_empty() {
            return Ok(());
        }
        let ids: Vec<&str> = results.iter().map(|(id, _)| id.as_str()).collect();
        let values: Vec<Value> = results.iter().map(|(_, v)| v.clone()).collect();
        sqlx::query(
            "UPDATE outbox_consumer_receipts r SET result = u.result
             FROM UNNEST($2::text[], $3::jsonb[]) AS u(event_id, result)
             WHERE r.consumer_id = $1 AND r.event_id = u.event_id",
        )
        .bind(consumer_id)
        .bind(&ids)
        .bind(&values)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    async fn quarantine(&self, tx: &mut PgTx, consumer_id: &str, rows: &[QuarantineRow<'_>], max_payload_bytes: usize) -> Result<HashSet<i64>, ConsumerError> {
        let Some(last) = rows.last() else {
            return Ok(HashSet::new());
        };
        let offsets: Vec<i64> = rows.iter().map(|r| r.msg.offset).collect();
        let event_ids: Vec<Option<&str>> = rows.iter().map(|r| r.quarantined.event_id.as_deref()).collect();
        let reasons: Vec<String> = rows.iter().map(|r| r.quarantined.reason.code()).collect();
        let evidence: Vec<&Value> = rows.iter().map(|r| &r.evidence).collect();
        let digests: Vec<&str> = rows.iter().map(|r| r.quarantined.payload_digest.as_str()).collect();
        let sizes: Vec<i32> = rows.iter().map(|r| i32::try_from(r.msg.payload_bytes().len()).unwrap_or(i32::MAX)).collect();
        let payloads: Vec<Option<&[u8]>> = rows.iter().map(|r| Some(r.msg.payload_bytes()).filter(|p| p.len() <= max_payload_bytes)).collect();
        let inserted: HashSet<i64> = sqlx::query_scalar(
            r#"INSERT INTO outbox_consumer_quarantine (consumer_id, topic, partition, "offset", event_id, reason, evidence, payload_digest, payload_bytes, payload)
               SELECT $1, $2, $3, u."offset", u.event_id, u.reason, u.evidence, u.payload_digest, u.payload_bytes, u.payload
               FROM UNNEST($4::int8[], $5::text[], $6::text[], $7::jsonb[], $8::text[], $9::int4[], $10::bytea[])
                   AS u("offset", event_id, reason, evidence, payload_digest, payload_bytes, payload)
               ON CONFLICT (consumer_id, topic, partition, "offset") DO NOTHING
               RETURNING "offset""#,
        )
        .bind(consumer_id)
        .bind(&last.msg.topic)
        .bind(last.msg.partition)
        .bind(&offsets)
        .bind(&event_ids)
        .bind(&reasons)
        .bind(&evidence)
        .bind(&digests)
        .bind(&sizes)
        .bind(&payloads)
        .fetch_all(&mut **tx)
        .await?
        .into_iter()
        .collect();
        Ok(inserted)
    }

    async fn insert_dead_letter(&self, tx: &mut PgTx, consumer_id: &str, row: &DeadLetterRow<'_>) -> Result<bool, ConsumerError> {
        let (msg, event) = (row.msg, row.event);
        let inserted = sqlx::query(
            r#"INSERT INTO outbox_consumer_dead_letters
                   (consumer_id, event_id, envelope_generation, event_type, topic, partition, "offset", message_key, payload_digest, payload, headers, attempts, last_error)
               VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
               ON CONFLICT (consumer_id, event_id) DO NOTHING"#,
        )
        .bind(consumer_id)
        .bind(event.event_id.as_str())
        .bind(i32::try_from(event.envelope_generation).unwrap_or(i32::MAX))
        .bind(&event.event_type)
        .bind(&msg.topic)
        .bind(msg.partition)
        .bind(msg.offset)
        .bind(msg.key.as_deref())
        .bind(&event.payload_digest)
        .bind(&event.payload)
        .bind(headers_json(&msg.headers, usize::MAX))
        .bind(i32::try_from(row.attempts).unwrap_or(i32::MAX))
        .bind(row.error)
        .execute(&mut **tx)
        .await?
        .rows_affected();
        Ok(inserted > 0)
    }

    async fn reading(&self, tx: &mut PgTx, consumer_id: &str, cluster_id: &str, topic: &str, partition: i32) -> Result<Reading, ConsumerError> {
        // The reading row is locked (when there is one) so that a second
        // decider of the partition waits; a first reading falls back to the
        // watermark rows (a database from before readings were kept).
        let row: (Option<i64>, Option<String>, Option<i64>, Vec<i64>, Vec<i64>, Vec<i64>) = sqlx::query_as(
            "WITH r AS (
                 SELECT next_offset, log_id FROM outbox_consumer_readings
                 WHERE consumer_id = $1 AND cluster_id = $2 AND topic = $3 AND partition = $4
                 FOR UPDATE
             ), g AS (
                 SELECT detected_from, from_offset, to_offset FROM outbox_consumer_gaps
                 WHERE consumer_id = $1 AND cluster_id = $2 AND topic = $3 AND partition = $4 AND closed_at IS NULL
             )
             SELECT (SELECT next_offset FROM r), (SELECT log_id FROM r),
                    (SELECT max(committed_offset) FROM outbox_consumer_watermarks
                      WHERE consumer_id = $1 AND cluster_id = $2 AND topic = $3 AND partition = $4),
                    COALESCE((SELECT array_agg(detected_from ORDER BY detected_from) FROM g), '{}'),
                    COALESCE((SELECT array_agg(from_offset ORDER BY detected_from) FROM g), '{}'),
                    COALESCE((SELECT array_agg(to_offset ORDER BY detected_from) FROM g), '{}')",
        )
        .bind(consumer_id)
        .bind(cluster_id)
        .bind(topic)
        .bind(partition)
        .fetch_one(&mut **tx)
        .await?;
        let (next, log_id, watermark, detected, from, to) = row;
        let open = detected.into_iter().zip(from).zip(to).map(|((detected_from, from_offset), to_offset)| OffsetGap { detected_from, from_offset, to_offset }).collect();
        Ok(Reading { next_offset: next.or(watermark), open, log_id })
    }

    async fn save_reading(&self, tx: &mut PgTx, consumer_id: &str, cluster_id: &str, topic: &str, partition: i32, change: &ReadingChange) -> Result<(), ConsumerError> {
        sqlx::query(
            "INSERT INTO outbox_consumer_readings AS r (consumer_id, cluster_id, topic, partition, next_offset, log_id)
             VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (consumer_id, cluster_id, topic, partition) DO UPDATE
                 SET next_offset = CASE WHEN $7 THEN EXCLUDED.next_offset ELSE GREATEST(r.next_offset, EXCLUDED.next_offset) END,
                     log_id = COALESCE(EXCLUDED.log_id, r.log_id), updated_at = now()
                 WHERE $7 OR r.next_offset < EXCLUDED.next_offset OR r.log_id IS DISTINCT FROM COALESCE(EXCLUDED.log_id, r.log_id)",
        )
        .bind(consumer_id)
        .bind(cluster_id)
        .bind(topic)
        .bind(partition)
        .bind(change.next_offset)
        .bind(change.log_id.as_deref())
        .bind(change.new_log)
        .execute(&mut **tx)
        .await?;
        if change.new_log {
            // The old log is gone: its gaps (open or closed) say nothing of
            // the new one's offsets, and their identities would collide
            // with the new log's.
            sqlx::query("DELETE FROM outbox_consumer_gaps WHERE consumer_id = $1 AND cluster_id = $2 AND topic = $3 AND partition = $4")
                .bind(consumer_id)
                .bind(cluster_id)
                .bind(topic)
                .bind(partition)
                .execute(&mut **tx)
                .await?;
        }
        if change.opened.is_empty() && change.shrunk.is_empty() {
            return Ok(());
        }
        let rows: Vec<&OffsetGap> = change.opened.iter().chain(change.shrunk.iter()).collect();
        let detected: Vec<i64> = rows.iter().map(|g| g.detected_from).collect();
        let from: Vec<i64> = rows.iter().map(|g| g.from_offset).collect();
        let to: Vec<i64> = rows.iter().map(|g| g.to_offset).collect();
        sqlx::query(
            "INSERT INTO outbox_consumer_gaps AS g (consumer_id, cluster_id, topic, partition, detected_from, from_offset, to_offset, closed_at, close_reason)
             SELECT $1, $2, $3, $4, u.detected_from, u.from_offset, u.to_offset,
                    CASE WHEN u.from_offset >= u.to_offset THEN now() END,
                    CASE WHEN u.from_offset >= u.to_offset THEN 'replayed' END
             FROM UNNEST($5::int8[], $6::int8[], $7::int8[]) AS u(detected_from, from_offset, to_offset)
             ON CONFLICT (consumer_id, cluster_id, topic, partition, detected_from) DO UPDATE
                 SET from_offset = EXCLUDED.from_offset, to_offset = EXCLUDED.to_offset,
                     closed_at = EXCLUDED.closed_at, close_reason = EXCLUDED.close_reason
                 WHERE g.closed_at IS NULL",
        )
        .bind(consumer_id)
        .bind(cluster_id)
        .bind(topic)
        .bind(partition)
        .bind(&detected)
        .bind(&from)
        .bind(&to)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    async fn advance_watermarks(
        &self,
        tx: &mut PgTx,
        consumer_id: &str,
        cluster_id: &str,
        topic: &str,
        partition: i32,
        rows: &[WatermarkAdvance],
    ) -> Result<(), ConsumerError> {
        if rows.is_empty() {
            return Ok(());
        }
        let topic_ids: Vec<Option<&str>> = rows.iter().map(|r| r.topic_id.as_deref()).collect();
        let offsets: Vec<i64> = rows.iter().map(|r| r.committed_offset).collect();
        let applied: Vec<i64> = rows.iter().map(|r| r.applied).collect();
        let duplicates: Vec<i64> = rows.iter().map(|r| r.duplicates).collect();
        let quarantined: Vec<i64> = rows.iter().map(|r| r.quarantined).collect();
        let dead: Vec<i64> = rows.iter().map(|r| r.dead_lettered).collect();
        let last: Vec<Option<&str>> = rows.iter().map(|r| r.last_event_id.as_deref()).collect();
        let anchors: Vec<Option<&str>> = rows.iter().map(|r| r.anchor_event_id.as_deref()).collect();
        let log_ids: Vec<Option<&str>> = rows.iter().map(|r| r.log_id.as_deref()).collect();
        // A row of another log (both log ids known, and different) is
        // replaced: its offset counted in a log that is gone.
        sqlx::query(
            "INSERT INTO outbox_consumer_watermarks AS w
                 (consumer_id, topic, partition, committed_offset, applied_count, duplicate_count, quarantined_count, dead_lettered_count, last_event_id, updated_at, cluster_id, topic_id, anchor_event_id, anchor_recorded, log_id)
             SELECT $1, $2, $3, u.committed_offset, u.applied, u.duplicates, u.quarantined, u.dead, u.last_event_id, now(), $4, u.topic_id, u.anchor, true, u.log_id
             FROM UNNEST($5::text[], $6::int8[], $7::int8[], $8::int8[], $9::int8[], $10::int8[], $11::text[], $12::text[], $13::text[])
                 AS u(topic_id, committed_offset, applied, duplicates, quarantined, dead, last_event_id, anchor, log_id)
             ON CONFLICT (consumer_id, cluster_id, topic, partition, topic_id) DO UPDATE SET
                 anchor_event_id = CASE WHEN w.log_id <> EXCLUDED.log_id OR EXCLUDED.committed_offset > w.committed_offset THEN EXCLUDED.anchor_event_id
                                        WHEN EXCLUDED.committed_offset = w.committed_offset THEN COALESCE(EXCLUDED.anchor_event_id, w.anchor_event_id)
                                        ELSE w.anchor_event_id END,
                 anchor_recorded = CASE WHEN w.log_id <> EXCLUDED.log_id OR EXCLUDED.committed_offset >= w.committed_offset THEN true ELSE w.anchor_recorded END,
                 committed_offset = CASE WHEN w.log_id <> EXCLUDED.log_id THEN EXCLUDED.committed_offset
                                         ELSE GREATEST(w.committed_offset, EXCLUDED.committed_offset) END,
                 log_id = CASE WHEN w.log_id <> EXCLUDED.log_id OR EXCLUDED.committed_offset >= w.committed_offset
                               THEN COALESCE(EXCLUDED.log_id, w.log_id) ELSE w.log_id END,
                 applied_count = w.applied_count + EXCLUDED.applied_count,
                 duplicate_count = w.duplicate_count + EXCLUDED.duplicate_count,
                 quarantined_count = w.quarantined_count + EXCLUDED.quarantined_count,
                 dead_lettered_count = w.dead_lettered_count + EXCLUDED.dead_lettered_count,
                 last_event_id = COALESCE(EXCLUDED.last_event_id, w.last_event_id),
                 updated_at = now()",
        )
        .bind(consumer_id)
        .bind(topic)
        .bind(partition)
        .bind(cluster_id)
        .bind(&topic_ids)
        .bind(&offsets)
        .bind(&applied)
        .bind(&duplicates)
        .bind(&quarantined)
        .bind(&dead)
        .bind(&last)
        .bind(&anchors)
        .bind(&log_ids)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}
