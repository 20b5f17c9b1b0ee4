//! Reading and purging receipts.

use chrono::{DateTime, Utc};
use outbox_core::EventId;
use sqlx::PgPool;

use crate::error::ConsumerError;
use crate::outcome::Receipt;
use crate::store::{receipt_from_row, RECEIPT_COLUMNS};

/// The receipt of one event for one consumer, if the consumer applied it.
pub async fn receipt(pool: &PgPool, consumer_id: &str, event_id: &EventId) -> Result<Option<Receipt>, ConsumerError> {
    let sql = format!("SELECT {RECEIPT_COLUMNS} FROM outbox_consumer_receipts WHERE consumer_id = $1 AND event_id = $2");
    let row = sqlx::query(&sql).bind(consumer_id).bind(event_id.as_str()).fetch_optional(pool).await?;
    row.as_ref().map(receipt_from_row).transpose()
}

/// Most receipts [`purge_receipts_before`] deletes per call.
pub const LIMIT_PURGE_ROWS: i64 = 100_000;

/// Deletes at most `max_rows` (up to [`LIMIT_PURGE_ROWS`]) receipts of
/// `consumer_id` received before `received_before` *and* below the
/// committed watermark of their log (cluster, topic, topic id, partition),
/// oldest first; returns how many were
/// deleted. Call it in a loop until it returns less than `max_rows`.
///
/// The watermark condition is the consumer-side twin of the outbox's
/// retention rule: a receipt whose offset the watermark has not passed may
/// still see its message redelivered (the offset commit may not have
/// happened), so it is kept whatever its age.
///
/// A receipt is what makes a redelivery a duplicate: once it is gone, a
/// replay of that event would apply it again. Only purge receipts older than
/// the longest possible replay window (the topic's retention, plus any
/// re-publication from the outbox you allow), the same rule as the outbox's
/// own retention (PROTOCOL §9). Dead letters and quarantine rows are never purged
/// here.
pub async fn purge_receipts_before(pool: &PgPool, consumer_id: &str, received_before: DateTime<Utc>, max_rows: i64) -> Result<u64, ConsumerError> {
    if !(1..=LIMIT_PURGE_ROWS).contains(&max_rows) {
        return Err(ConsumerError::Config(format!("max_rows {max_rows} (1..={LIMIT_PURGE_ROWS})")));
    }
    let n = sqlx::query(
        "DELETE FROM outbox_consumer_receipts WHERE consumer_id = $1 AND event_id IN (
             SELECT r.event_id FROM outbox_consumer_receipts r
             WHERE r.consumer_id = $1 AND r.received_at < $2
               AND EXISTS (SELECT 1 FROM outbox_consumer_watermarks w
                           WHERE w.consumer_id = r.consumer_id AND w.cluster_id = r.cluster_id AND w.topic = r.topic AND w.partition = r.partition
                             AND w.topic_id IS NOT DISTINCT FROM r.topic_id AND w.committed_offset > r.\"offset\")
             ORDER BY r.received_at LIMIT $3)",
    )
    .bind(consumer_id)
    .bind(received_before)
    .bind(max_rows)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(n)
}
