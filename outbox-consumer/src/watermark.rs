//! Reading watermarks, and publishing them to the outbox database.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgPool, Row as _};

use crate::error::ConsumerError;

/// One row of `outbox_consumer_watermarks`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Watermark {
    /// The consumer.
    pub consumer_id: String,
    /// Broker cluster identity of the log read (`''` for rows written
    /// before watermarks named their cluster: such a row passes nothing).
    pub cluster_id: String,
    /// Topic.
    pub topic: String,
    /// The topic id the counted messages' destinations name (`None`:
    /// `destination.v1` messages, ones whose destination does not parse, and
    /// rows written before watermarks named it). A partition has one row
    /// per topic id: a topic deleted and created again under the same name
    /// is another log.
    pub topic_id: Option<String>,
    /// Partition.
    pub partition: i32,
    /// Next offset to read: every message below it has a committed decision.
    pub committed_offset: i64,
    /// Events applied.
    pub applied_count: i64,
    /// Redeliveries answered without a second effect.
    pub duplicate_count: i64,
    /// Messages quarantined.
    pub quarantined_count: i64,
    /// Events dead-lettered.
    pub dead_lettered_count: i64,
    /// Last event applied on this partition.
    pub last_event_id: Option<String>,
    /// When the consumer last moved this row (consumer database clock).
    pub updated_at: DateTime<Utc>,
}

const COLUMNS: &str = "consumer_id, cluster_id, topic, topic_id, partition, committed_offset, applied_count, duplicate_count, quarantined_count, dead_lettered_count, last_event_id, updated_at";

/// Most watermark rows read or published per call.
pub const MAX_WATERMARK_ROWS: i64 = 100_000;

fn from_row(row: &sqlx::postgres::PgRow) -> Result<Watermark, sqlx::Error> {
    Ok(Watermark {
        consumer_id: row.try_get("consumer_id")?,
        cluster_id: row.try_get("cluster_id")?,
        topic: row.try_get("topic")?,
        topic_id: row.try_get("topic_id")?,
        partition: row.try_get("partition")?,
        committed_offset: row.try_get("committed_offset")?,
        applied_count: row.try_get("applied_count")?,
        duplicate_count: row.try_get("duplicate_count")?,
        quarantined_count: row.try_get("quarantined_count")?,
        dead_lettered_count: row.try_get("dead_lettered_count")?,
        last_event_id: row.try_get("last_event_id")?,
        updated_at: row.try_get("updated_at")?,
    })
}

/// The watermarks of `consumer_id`, ordered by cluster, topic, partition
/// and topic id (none first).
pub async fn watermarks(pool: &PgPool, consumer_id: &str) -> Result<Vec<Watermark>, ConsumerError> {
    let sql = format!("SELECT {COLUMNS} FROM outbox_consumer_watermarks WHERE consumer_id = $1 ORDER BY cluster_id, topic, partition, topic_id NULLS FIRST LIMIT $2");
    let rows = sqlx::query(&sql).bind(consumer_id).bind(MAX_WATERMARK_ROWS).fetch_all(pool).await?;
    Ok(rows.iter().map(from_row).collect::<Result<_, _>>()?)
}

/// The watermarks of `consumer_id` on the logs of one cluster, ordered by
/// topic, partition and topic id (what the consumer publishes over that
/// cluster).
pub(crate) async fn watermarks_on(pool: &PgPool, consumer_id: &str, cluster_id: &str) -> Result<Vec<Watermark>, ConsumerError> {
    let sql = format!("SELECT {COLUMNS} FROM outbox_consumer_watermarks WHERE consumer_id = $1 AND cluster_id = $2 ORDER BY topic, partition, topic_id NULLS FIRST LIMIT $3");
    let rows = sqlx::query(&sql).bind(consumer_id).bind(cluster_id).bind(MAX_WATERMARK_ROWS).fetch_all(pool).await?;
    Ok(rows.iter().map(from_row).collect::<Result<_, _>>()?)
}

/// Copies the watermarks of `consumer_id` from the consumer's database
/// (`from`) into the outbox database (`to`), for a consumer whose state does
/// not live in the outbox database. Returns the number of rows published.
///
/// The target table is `outbox_consumer_watermarks` with the same columns
/// (run [`migrate`](crate::migrate) on the outbox database once). The copy is
/// monotonic: offsets and counts only grow (`GREATEST`), `updated_at` keeps
/// the consumer's own time, so a late or repeated publish never moves a
/// watermark back. Call it periodically (e.g. every few seconds) and after
/// shutdown; a watermark that lags only delays retention and alarms, it never
/// lets an unconsumed event be purged.
pub async fn publish_watermarks(from: &PgPool, to: &PgPool, consumer_id: &str) -> Result<usize, ConsumerError> {
    let rows = watermarks(from, consumer_id).await?;
    if rows.is_empty() {
        return Ok(0);
    }
    let clusters: Vec<&str> = rows.iter().map(|w| w.cluster_id.as_str()).collect();
    let topics: Vec<&str> = rows.iter().map(|w| w.topic.as_str()).collect();
    let topic_ids: Vec<Option<&str>> = rows.iter().map(|w| w.topic_id.as_deref()).collect();
    let partitions: Vec<i32> = rows.iter().map(|w| w.partition).collect();
    let offsets: Vec<i64> = rows.iter().map(|w| w.committed_offset).collect();
    let applied: Vec<i64> = rows.iter().map(|w| w.applied_count).collect();
    let duplicates: Vec<i64> = rows.iter().map(|w| w.duplicate_count).collect();
    let quarantined: Vec<i64> = rows.iter().map(|w| w.quarantined_count).collect();
    let dead: Vec<i64> = rows.iter().map(|w| w.dead_lettered_count).collect();
    let last: Vec<Option<&str>> = rows.iter().map(|w| w.last_event_id.as_deref()).collect();
    let updated: Vec<DateTime<Utc>> = rows.iter().map(|w| w.updated_at).collect();
    let n = sqlx::query(outbox_core::watermark_record::COPY_UPSERT_SQL)
    .bind(consumer_id)
    .bind(&topics)
    .bind(&partitions)
    .bind(&offsets)
    .bind(&applied)
    .bind(&duplicates)
    .bind(&quarantined)
    .bind(&dead)
    .bind(&last)
    .bind(&updated)
    .bind(&clusters)
    .bind(&topic_ids)
    .execute(to)
    .await?
    .rows_affected();
    Ok(usize::try_from(n).unwrap_or(usize::MAX))
}
