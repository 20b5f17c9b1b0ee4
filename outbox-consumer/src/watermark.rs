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
    /// The end of the open gap the watermark stands at: the offsets
    /// `[committed_offset, open_gap_end)` were skipped, not read
    /// ([`crate::gap`]; `None`: no open gap there).
    pub open_gap_end: Option<i64>,
    /// The log the watermark was kept in, as the consumer's fetches saw it
    /// (the topic's id; [`RawMessage::log_id`](crate::RawMessage::log_id);
    /// `None`: not known).
    pub log_id: Option<String>,
    /// Whether the consumer recorded what it decided at
    /// `committed_offset - 1` (its own store does; a copy moved by an
    /// older watermark record does not).
    pub anchor_recorded: bool,
    /// The event of the message at `committed_offset - 1`, when the
    /// consumer decided it as a genuine message of it.
    pub anchor_event_id: Option<String>,
}

/// The columns of a watermark row (`w`), with the end of the open gap it
/// stands at (one probe of `outbox_consumer_gaps_open`).
const COLUMNS: &str = "w.consumer_id, w.cluster_id, w.topic, w.topic_id, w.partition, w.committed_offset, w.applied_count, w.duplicate_count,
     w.quarantined_count, w.dead_lettered_count, w.last_event_id, w.updated_at, w.log_id, w.anchor_recorded, w.anchor_event_id,
     (SELECT min(g.to_offset) FROM outbox_consumer_gaps g
      WHERE g.consumer_id = w.consumer_id AND g.cluster_id = w.cluster_id AND g.topic = w.topic AND g.partition = w.partition
        AND g.closed_at IS NULL AND g.from_offset <= w.committed_offset AND g.to_offset > w.committed_offset) AS open_gap_end";

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
        open_gap_end: row.try_get("open_gap_end")?,
        log_id: row.try_get("log_id")?,
        anchor_recorded: row.try_get("anchor_recorded")?,
        anchor_event_id: row.try_get("anchor_event_id")?,
    })
}

/// The watermarks of `consumer_id`, ordered by cluster, topic, partition
/// and topic id (none first).
pub async fn watermarks(pool: &PgPool, consumer_id: &str) -> Result<Vec<Watermark>, ConsumerError> {
    let sql = format!("SELECT {COLUMNS} FROM outbox_consumer_watermarks w WHERE w.consumer_id = $1 ORDER BY w.cluster_id, w.topic, w.partition, w.topic_id NULLS FIRST LIMIT $2");
    let rows = sqlx::query(&sql).bind(consumer_id).bind(MAX_WATERMARK_ROWS).fetch_all(pool).await?;
    Ok(rows.iter().map(from_row).collect::<Result<_, _>>()?)
}

/// The watermarks of `consumer_id` on the logs of one cluster, ordered by
/// topic, partition and topic id (what the consumer publishes over that
/// cluster).
pub(crate) async fn watermarks_on(pool: &PgPool, consumer_id: &str, cluster_id: &str) -> Result<Vec<Watermark>, ConsumerError> {
    let sql = format!("SELECT {COLUMNS} FROM outbox_consumer_watermarks w WHERE w.consumer_id = $1 AND w.cluster_id = $2 ORDER BY w.topic, w.partition, w.topic_id NULLS FIRST LIMIT $3");
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
/// watermark back, except to replace a row of another log (both log ids
/// known and different: the consumer's reading started over in a new log). Call it periodically (e.g. every few seconds) and after
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
    let log_ids: Vec<Option<&str>> = rows.iter().map(|w| w.log_id.as_deref()).collect();
    let anchors: Vec<Option<&str>> = rows.iter().map(|w| w.anchor_event_id.as_deref()).collect();
    let recorded: Vec<bool> = rows.iter().map(|w| w.anchor_recorded).collect();
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
    .bind(&log_ids)
    .bind(&anchors)
    .bind(&recorded)
    .execute(to)
    .await?
    .rows_affected();
    gap_findings(to, consumer_id, &rows).await?;
    Ok(usize::try_from(n).unwrap_or(usize::MAX))
}

/// Where `to` holds the outbox's findings (the outbox database): a
/// `consumer_gap` finding for each watermark standing at an open gap, and
/// the open one of every other watermark's log resolved (as the watermark
/// topic's reader does with the same rows published as records).
async fn gap_findings(to: &PgPool, consumer_id: &str, rows: &[Watermark]) -> Result<(), ConsumerError> {
    use outbox_core::watermark_record::{log_name, GapFindings, GAP_FINDINGS_OPEN_SQL, GAP_FINDINGS_RESOLVE_SQL};
    let has_findings: bool = sqlx::query_scalar("SELECT to_regclass('outbox_findings') IS NOT NULL").fetch_one(to).await?;
    if !has_findings {
        return Ok(());
    }
    let GapFindings { open, resolved } =
        GapFindings::of(consumer_id, rows.iter().map(|w| (log_name(&w.cluster_id, &w.topic, w.topic_id.as_deref(), w.partition), w.committed_offset, w.open_gap_end)));
    let (open_logs, details): (Vec<String>, Vec<String>) = open.into_iter().unzip();
    let now = Utc::now().timestamp_millis();
    if !resolved.is_empty() {
        sqlx::query(GAP_FINDINGS_RESOLVE_SQL).bind(consumer_id).bind(&resolved).bind(now).execute(to).await?;
    }
    if !open_logs.is_empty() {
        sqlx::query(GAP_FINDINGS_OPEN_SQL).bind(consumer_id).bind(&open_logs).bind(&details).bind(now).execute(to).await?;
    }
    Ok(())
}
