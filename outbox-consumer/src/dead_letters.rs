//! Dead letters for operators: list, show, and requeue (`outbox
//! dead-letters ...`). A requeue is a request: the running consumer, which
//! has the handler, picks it up (every [`REQUEUE_CHECK_MS`]) and redrives the
//! event through [`Processor::redrive_dead_letter`](crate::Processor::redrive_dead_letter).

use serde::Serialize;
use sqlx::{PgPool, Row};

use crate::error::ConsumerError;

/// How often a running consumer looks for requeue requests, ms.
pub const REQUEUE_CHECK_MS: u64 = 1_000;
/// Most requeue requests one check redrives.
pub const MAX_REQUEUE_PER_CHECK: i64 = 100;
/// Most dead letters one listing returns.
pub const MAX_LIST_ROWS: i64 = 10_000;

/// One dead letter (the payload itself is left out; `payload_bytes` is its size).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DeadLetter {
    /// Consumer.
    pub consumer_id: String,
    /// Event.
    pub event_id: String,
    /// Envelope generation.
    pub envelope_generation: i32,
    /// Event type.
    pub event_type: String,
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// Handler attempts so far.
    pub attempts: i32,
    /// The handler's last error.
    pub last_error: String,
    /// When it was dead-lettered, RFC 3339.
    pub dead_lettered_at: String,
    /// Size of the kept payload, bytes.
    pub payload_bytes: i64,
    /// A pending requeue request, ms since the epoch.
    pub requeue_requested_at_ms: Option<i64>,
    /// Who asked for it.
    pub requeue_requested_by: Option<String>,
}

const COLUMNS: &str = r#"consumer_id, event_id, envelope_generation, event_type, topic, partition, "offset", attempts, last_error,
    to_char(dead_lettered_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') AS dead_lettered_at, octet_length(payload)::bigint AS payload_bytes,
    requeue_requested_at_ms, requeue_requested_by"#;

fn from_row(r: &sqlx::postgres::PgRow) -> Result<DeadLetter, sqlx::Error> {
    Ok(DeadLetter {
        consumer_id: r.try_get("consumer_id")?,
        event_id: r.try_get("event_id")?,
        envelope_generation: r.try_get("envelope_generation")?,
        event_type: r.try_get("event_type")?,
        topic: r.try_get("topic")?,
        partition: r.try_get("partition")?,
        offset: r.try_get("offset")?,
        attempts: r.try_get("attempts")?,
        last_error: r.try_get("last_error")?,
        dead_lettered_at: r.try_get("dead_lettered_at")?,
        payload_bytes: r.try_get("payload_bytes")?,
        requeue_requested_at_ms: r.try_get("requeue_requested_at_ms")?,
        requeue_requested_by: r.try_get("requeue_requested_by")?,
    })
}

/// Dead letters, oldest first, of one consumer or all; at most `limit` (1..=[`MAX_LIST_ROWS`]).
pub async fn list_dead_letters(pool: &PgPool, consumer_id: Option<&str>, limit: i64) -> Result<Vec<DeadLetter>, ConsumerError> {
    if !(1..=MAX_LIST_ROWS).contains(&limit) {
        return Err(ConsumerError::Config(format!("limit {limit} (1..={MAX_LIST_ROWS})")));
    }
    let rows = sqlx::query(&format!(
        "SELECT {COLUMNS} FROM outbox_consumer_dead_letters WHERE $1::text IS NULL OR consumer_id = $1 ORDER BY dead_lettered_at, consumer_id, event_id LIMIT $2"
    ))
    .bind(consumer_id)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    Ok(rows.iter().map(from_row).collect::<Result<_, _>>()?)
}

/// The dead letters of `event_id` (one per consumer that dead-lettered it).
pub async fn dead_letters_of(pool: &PgPool, event_id: &str) -> Result<Vec<DeadLetter>, ConsumerError> {
    let rows = sqlx::query(&format!("SELECT {COLUMNS} FROM outbox_consumer_dead_letters WHERE event_id = $1 ORDER BY consumer_id"))
        .bind(event_id)
        .fetch_all(pool)
        .await?;
    Ok(rows.iter().map(from_row).collect::<Result<_, _>>()?)
}

/// Asks the running consumer `consumer_id` to run the handler of its dead
/// letter `event_id` again; returns false when there is no such dead letter.
/// `requested_by` (at most 200 characters) is recorded.
pub async fn request_requeue(pool: &PgPool, consumer_id: &str, event_id: &str, requested_by: &str) -> Result<bool, ConsumerError> {
    if requested_by.is_empty() || requested_by.chars().count() > 200 {
        return Err(ConsumerError::Config("requested_by: 1..=200 characters".into()));
    }
    let n = sqlx::query(
        "UPDATE outbox_consumer_dead_letters SET requeue_requested_at_ms = (extract(epoch FROM clock_timestamp()) * 1000)::bigint,
             requeue_requested_by = $3
         WHERE consumer_id = $1 AND event_id = $2",
    )
    .bind(consumer_id)
    .bind(event_id)
    .bind(requested_by)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(n > 0)
}

/// The event ids with a pending requeue request for `consumer_id`, oldest request first.
pub(crate) async fn requested(pool: &PgPool, consumer_id: &str) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT event_id FROM outbox_consumer_dead_letters WHERE consumer_id = $1 AND requeue_requested_at_ms IS NOT NULL
         ORDER BY requeue_requested_at_ms LIMIT $2",
    )
    .bind(consumer_id)
    .bind(MAX_REQUEUE_PER_CHECK)
    .fetch_all(pool)
    .await
}
