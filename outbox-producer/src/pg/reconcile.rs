//! Reconciliation: the CAS DISPATCH_UNKNOWN -> RECONCILING with the
//! attempts and receipt slot of each event, and the statement that
//! finishes it.

use std::sync::LazyLock;

use outbox_core::claim::MAX_CLAIM_BATCH;
use outbox_core::{AttemptRecord, EventId, EventState, LockedEvent, ReconcileTask, StoreError};
use sqlx::Row;

use super::claims::{validate_claim, CLAIM_FROM_C};
use super::rows::{attempt_from_row, claim_token, frozen_records, receipt_from_row, ATTEMPT_COLUMNS, RECEIPT_COLUMNS};
use super::PgStore;
use crate::error::store_err;

impl PgStore {
    /// The CAS DISPATCH_UNKNOWN -> RECONCILING, for due events or, with
    /// `event_id`, for that one event whatever its next check time.
    pub async fn begin_reconcile_where(&self, owner: &str, limit: usize, lease_ms: i64, event_id: Option<&EventId>) -> Result<Vec<ReconcileTask>, StoreError> {
        validate_claim(owner, lease_ms)?;
        let now = self.now_ms();
        let mut tx = self.begin().await?;
        let rows = sqlx::query(&format!(
            "WITH c AS (
                SELECT event_id FROM outbox_events WHERE phase = '{from}' AND protocol_version <= $6
                  AND (($5::text IS NULL AND next_check_at_ms <= $3) OR event_id = $5)
                  AND ($7::text IS NULL OR cluster_id = $7)
                ORDER BY next_check_at_ms LIMIT $1 FOR UPDATE SKIP LOCKED)
             UPDATE outbox_events e SET state = '{claim}', claim_owner = $2, claim_generation = e.claim_generation + 1,
                    lease_until_ms = $3 + $4, claim_attempt_id = NULL, state_since_ms = $3
             {CLAIM_FROM_C}",
            claim = outbox_core::reconcile::RECONCILE_CLAIM.as_str(),
            from = outbox_core::reconcile::RECONCILE_FROM.as_str(),
        ))
        .bind(limit.min(MAX_CLAIM_BATCH) as i64)
        .bind(owner)
        .bind(now)
        .bind(lease_ms)
        .bind(event_id.map(|e| e.as_str()))
        .bind(self.max_protocol_version)
        .bind(self.cluster_scope.as_deref())
        .fetch_all(&mut *tx)
        .await
        .map_err(store_err)?;
        let mut tasks = Vec::with_capacity(rows.len());
        let mut unreadable = Vec::new();
        for r in &rows {
            let g = |e: sqlx::Error| store_err(e);
            let (envelope, destination) = match frozen_records(r)? {
                Ok(p) => p,
                // That event cannot be looked up as frozen: quarantined
                // below, the other events of the round go on.
                Err(u) => {
                    unreadable.push(u);
                    continue;
                }
            };
            let id = envelope.event_id.to_string();
            let mut attempts = Vec::new();
            for a in sqlx::query(&format!(
                "SELECT {ATTEMPT_COLUMNS}, (extract(epoch FROM clock_timestamp()) * 1000)::bigint - registered_db_ms AS db_age_ms
                 FROM outbox_attempts WHERE event_id = $1 ORDER BY attempt_generation"
            ))
            .bind(&id)
            .fetch_all(&mut *tx)
            .await
            .map_err(store_err)?
            {
                let mut attempt = attempt_from_row(&a)?;
                if self.database_clock {
                    let db_age_ms: Option<i64> = a.try_get("db_age_ms").map_err(g)?;
                    measure_with_database_clock(&mut attempt, db_age_ms, now);
                }
                attempts.push(attempt);
            }
            let slot = sqlx::query(&format!("SELECT {RECEIPT_COLUMNS} FROM outbox_publish_receipts WHERE event_id = $1 AND envelope_generation = $2"))
                .bind(&id)
                .bind(envelope.envelope_generation as i32)
                .fetch_optional(&mut *tx)
                .await
                .map_err(store_err)?
                .map(|r| receipt_from_row(&r))
                .transpose()?;
            tasks.push(ReconcileTask {
                token: claim_token(r, &envelope.event_id)?,
                event: LockedEvent {
                    event_id: envelope.event_id.clone(),
                    envelope_generation: envelope.envelope_generation,
                    state: EventState::Reconciling,
                    payload_digest: r.try_get("payload_digest").map_err(g)?,
                    destination_digest: r.try_get("destination_digest").map_err(g)?,
                    destination,
                    slot,
                },
                attempts,
                unknown_since_ms: r.try_get::<Option<i64>, _>("unknown_since_ms").map_err(g)?.unwrap_or(now),
            });
        }
        Self::quarantine_unreadable(&mut tx, owner, &unreadable, now).await?;
        tx.commit().await.map_err(store_err)?;
        Ok(tasks)
    }
}

/// Moves `attempt`'s registration time (and with it the end of its lease,
/// by the remaining lease its own dispatcher measured) to when the
/// database's clock says it was registered, `db_age_ms` before `now`,
/// when that is later: a dispatcher host whose clock is behind cannot make
/// an attempt look older than it is.
fn measure_with_database_clock(attempt: &mut AttemptRecord, db_age_ms: Option<i64>, now: i64) {
    let Some(age) = db_age_ms else { return };
    let registered = now.saturating_sub(age.max(0));
    if registered > attempt.started_at_ms {
        let remaining_lease = attempt.send_deadline_ms.map(|d| d.saturating_sub(attempt.started_at_ms).max(0));
        attempt.started_at_ms = registered;
        attempt.send_deadline_ms = remaining_lease.map(|r| registered.saturating_add(r));
    }
}

/// `finish_reconcile`, written from [`outbox_core::reconcile::plan_reconcile_finish`]:
/// `$5` the new state, `$6` the recheck's due time (NULL: unchanged), `$7`
/// whether the open attempts close ABSENT.
pub(super) static FINISH_RECONCILE_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH ev AS (
            UPDATE outbox_events SET state = $5, claim_owner = NULL, lease_until_ms = NULL, claim_attempt_id = NULL,
                   next_check_at_ms = coalesce($6, next_check_at_ms), state_since_ms = $4
            WHERE event_id = $1 AND claim_generation = $2 AND claim_owner = $3 AND state = '{claim}'
            RETURNING event_id),
         att AS (
            UPDATE outbox_attempts SET state = 'ABSENT', finished_at_ms = $4, detail = 'proven absent by reconciler'
            WHERE $7 AND event_id = $1 AND state IN ({open}) AND EXISTS (SELECT 1 FROM ev))
         SELECT event_id FROM ev",
        claim = outbox_core::reconcile::RECONCILE_CLAIM.as_str(),
        open = outbox_core::reconcile::OPEN_ATTEMPT_STATES.iter().map(|s| format!("'{}'", s.as_str())).collect::<Vec<_>>().join(", "),
    )
});
