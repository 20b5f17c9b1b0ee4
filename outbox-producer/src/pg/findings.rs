//! Evidence: the findings opened by the statement that found them, and the
//! open attempts the bypass scan asks about.

use outbox_core::{AttemptRecord, StoreError};
use sqlx::{PgPool, Postgres, Transaction};

use super::rows::{attempt_from_row, ATTEMPT_COLUMNS};
use crate::error::store_err;

/// Findings that are evidence, not conditions: opened (or seen again) by
/// the statement that found them and left open until an operator resolves
/// them; a comparison round never resolves them.
/// They are `outbox_core::findings::EVIDENCE_FINDINGS`.
pub const EVIDENCE_FINDINGS: &[&str] = outbox_core::findings::EVIDENCE_FINDINGS;

/// The open attempts (SENDING, UNKNOWN) of `event_ids`, in one query.
pub(crate) async fn unanswered_attempts_of(pool: &PgPool, event_ids: &[&str]) -> Result<Vec<AttemptRecord>, StoreError> {
    sqlx::query(&format!("SELECT {ATTEMPT_COLUMNS} FROM outbox_attempts WHERE event_id = ANY($1) AND state IN ('SENDING', 'UNKNOWN', 'ABSENT', 'NOT_SENT')"))
        .bind(event_ids)
        .fetch_all(pool)
        .await
        .map_err(store_err)?
        .iter()
        .map(attempt_from_row)
        .collect()
}

/// Opens findings `(kind, event_id, detail)` in `tx`, or marks open ones seen again.
pub(crate) async fn record_findings(tx: &mut Transaction<'_, Postgres>, findings: &[(&'static str, String, String)], now: i64) -> Result<(), StoreError> {
    if findings.is_empty() {
        return Ok(());
    }
    let kinds: Vec<&str> = findings.iter().map(|f| f.0).collect();
    let ids: Vec<&str> = findings.iter().map(|f| f.1.as_str()).collect();
    let details: Vec<&str> = findings.iter().map(|f| f.2.as_str()).collect();
    sqlx::query(
        "INSERT INTO outbox_findings (kind, event_id, consumer_id, age_ms, detail, first_seen_ms, last_seen_ms)
         SELECT DISTINCT ON (k, e) k, e, '', 0, d, $4, $4 FROM UNNEST($1::text[], $2::text[], $3::text[]) AS t(k, e, d)
         ON CONFLICT (kind, event_id, consumer_id) WHERE resolved_at_ms IS NULL
         DO UPDATE SET detail = EXCLUDED.detail, last_seen_ms = EXCLUDED.last_seen_ms",
    )
    .bind(&kinds)
    .bind(&ids)
    .bind(&details)
    .bind(now)
    .execute(&mut **tx)
    .await
    .map_err(store_err)?;
    Ok(())
}
