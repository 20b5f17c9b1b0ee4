//! Gaps for operators: list them and accept one that cannot be replayed
//! (`outbox gaps ...`; module [`gap`](crate::gap) for what a gap is).

use serde::Serialize;
use sqlx::{PgPool, Row};

use crate::error::ConsumerError;

/// Most gaps one listing returns.
pub const MAX_GAP_ROWS: i64 = 10_000;

/// A gap as stored, for operators.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct GapRecord {
    /// Consumer.
    pub consumer_id: String,
    /// Broker cluster of the log.
    pub cluster_id: String,
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Where the range began when found (the gap's identity).
    pub detected_from: i64,
    /// The first offset not decided.
    pub from_offset: i64,
    /// The first offset after the range.
    pub to_offset: i64,
    /// When it was found, RFC 3339.
    pub detected_at: String,
    /// When it closed, RFC 3339 (`None`: open).
    pub closed_at: Option<String>,
    /// Who accepted it (`None`: open, or closed by a replay).
    pub closed_by: Option<String>,
    /// `replayed`, or the operator's reason.
    pub close_reason: Option<String>,
}

const COLUMNS: &str = r#"consumer_id, cluster_id, topic, partition, detected_from, from_offset, to_offset,
    to_char(detected_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') AS detected_at,
    to_char(closed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') AS closed_at, closed_by, close_reason"#;

fn from_row(r: &sqlx::postgres::PgRow) -> Result<GapRecord, sqlx::Error> {
    Ok(GapRecord {
        consumer_id: r.try_get("consumer_id")?,
        cluster_id: r.try_get("cluster_id")?,
        topic: r.try_get("topic")?,
        partition: r.try_get("partition")?,
        detected_from: r.try_get("detected_from")?,
        from_offset: r.try_get("from_offset")?,
        to_offset: r.try_get("to_offset")?,
        detected_at: r.try_get("detected_at")?,
        closed_at: r.try_get("closed_at")?,
        closed_by: r.try_get("closed_by")?,
        close_reason: r.try_get("close_reason")?,
    })
}

/// The gaps of `consumer_id` (every consumer's when `None`), open ones only
/// unless `all`, oldest first, at most `limit` (1..=[`MAX_GAP_ROWS`]).
pub async fn list_gaps(pool: &PgPool, consumer_id: Option<&str>, all: bool, limit: i64) -> Result<Vec<GapRecord>, ConsumerError> {
    if !(1..=MAX_GAP_ROWS).contains(&limit) {
        return Err(ConsumerError::Config(format!("limit must be 1..={MAX_GAP_ROWS}, got {limit}")));
    }
    let sql = format!(
        "SELECT {COLUMNS} FROM outbox_consumer_gaps
         WHERE ($1::text IS NULL OR consumer_id = $1) AND ($2 OR closed_at IS NULL)
         ORDER BY detected_at, consumer_id, cluster_id, topic, partition, detected_from LIMIT $3"
    );
    let rows = sqlx::query(&sql).bind(consumer_id).bind(all).bind(limit).fetch_all(pool).await?;
    Ok(rows.iter().map(from_row).collect::<Result<_, _>>()?)
}

/// An operator accepts an open gap whose messages cannot be replayed (they
/// are gone from the log): it closes with `operator` and `reason` kept, and
/// the partition's watermark moves on with the consumer's next decision
/// there. The events of the range stay unconsumed for this consumer, and
/// the reconciler keeps saying so. Answers the closed gap, or `None` when no
/// such open gap exists.
#[allow(clippy::too_many_arguments)]
pub async fn accept_gap(pool: &PgPool, consumer_id: &str, cluster_id: &str, topic: &str, partition: i32, detected_from: i64, operator: &str, reason: &str) -> Result<Option<GapRecord>, ConsumerError> {
    if operator.trim().is_empty() || reason.trim().is_empty() {
        return Err(ConsumerError::Config("accepting a gap needs an operator and a reason".into()));
    }
    let sql = format!(
        "UPDATE outbox_consumer_gaps SET closed_at = now(), closed_by = $6, close_reason = $7
         WHERE consumer_id = $1 AND cluster_id = $2 AND topic = $3 AND partition = $4 AND detected_from = $5 AND closed_at IS NULL
         RETURNING {COLUMNS}"
    );
    let row = sqlx::query(&sql)
        .bind(consumer_id)
        .bind(cluster_id)
        .bind(topic)
        .bind(partition)
        .bind(detected_from)
        .bind(operator)
        .bind(reason)
        .fetch_optional(pool)
        .await?;
    Ok(row.as_ref().map(from_row).transpose()?)
}
