//! [`OutboxStore`] for [`PgStore`]: the trait's methods, on the claims,
//! attempts, receipts, leases and reconciliation of the other files, and
//! the fenced reports (unknown, not sent, release, quarantine).

use std::sync::LazyLock;

use async_trait::async_trait;
use outbox_core::claim::{not_sent_backoff_ms, NOT_SENT_BACKOFF_MAX_MS};
use outbox_core::{
    AttemptId, AttemptRecord, BrokerReceipt, ClaimToken, ClaimedEvent, EventId, EventState, FenceOutcome, OutboxStore, ReceiptOutcome, ReconcileDecision, ReconcileTask,
    StoreError, SweepOutcome,
};
use sqlx::Row;

use super::claims::{CLAIM_EVERY_HEAD, CLAIM_RETRIES};
use super::leases::{EXPIRE_LEASES_SQL, MAX_SWEEP_ROWS};
use super::reconcile::FINISH_RECONCILE_SQL;
use super::rows::{attempt_from_row, receipt_from_row, ATTEMPT_COLUMNS, RECEIPT_COLUMNS};
use super::PgStore;
use crate::error::store_err;

/// outbox_core's `not_sent_backoff_ms` for attempt generations 1, 2, ...
/// up to the first at its bound, which holds for every later generation:
/// report_not_sent looks its row's generation up here, so the rule is
/// stated once, in outbox-core.
static NOT_SENT_BACKOFFS: LazyLock<Vec<i64>> = LazyLock::new(|| {
    let mut schedule = Vec::new();
    for generation in 1..=64 {
        let backoff = not_sent_backoff_ms(generation);
        schedule.push(backoff);
        if backoff >= NOT_SENT_BACKOFF_MAX_MS {
            break;
        }
    }
    schedule
});

#[async_trait]
impl OutboxStore for PgStore {
    async fn claim_batch(&self, owner: &str, limit: usize, lease_ms: i64) -> Result<Vec<ClaimedEvent>, StoreError> {
        self.claim_with(&CLAIM_EVERY_HEAD, owner, limit, lease_ms, EventState::Pending, None).await
    }

    async fn claim_retries(&self, owner: &str, limit: usize, lease_ms: i64) -> Result<Vec<ClaimedEvent>, StoreError> {
        self.claim_with(&CLAIM_RETRIES, owner, limit, lease_ms, EventState::RetryClaimed, None).await
    }

    async fn register_attempt(&self, token: &ClaimToken) -> Result<AttemptRecord, StoreError> {
        self.register_attempts_tx(std::slice::from_ref(token))
            .await?
            .pop()
            .unwrap_or_else(|| Err(StoreError::NotFound(token.event_id.clone())))
    }

    async fn accept_dispatch_receipt(&self, receipt: &BrokerReceipt) -> Result<ReceiptOutcome, StoreError> {
        self.accept_dispatch_receipts_tx(std::slice::from_ref(receipt))
            .await?
            .pop()
            .ok_or_else(|| StoreError::NotFound(receipt.event_id.clone()))
    }

    async fn register_attempts(&self, tokens: &[ClaimToken]) -> Result<Vec<Result<AttemptRecord, StoreError>>, StoreError> {
        self.register_attempts_tx(tokens).await
    }

    async fn accept_dispatch_receipts(&self, receipts: &[BrokerReceipt]) -> Result<Vec<ReceiptOutcome>, StoreError> {
        self.accept_dispatch_receipts_tx(receipts).await
    }

    async fn report_unknown(&self, token: &ClaimToken, attempt_id: &AttemptId, detail: &str) -> Result<FenceOutcome, StoreError> {
        self.stream_to_lane(&[(token.event_id.as_str(), token.claim_generation)]).await?;
        self.fenced_update(
            token,
            "report_unknown",
            "WITH ev AS (
                UPDATE outbox_events SET state = 'DISPATCH_UNKNOWN', claim_owner = NULL, lease_until_ms = NULL,
                       state_since_ms = $4, unknown_since_ms = coalesce(unknown_since_ms, $4), next_check_at_ms = $4
                WHERE event_id = $1 AND claim_generation = $2 AND claim_owner = $3 AND state = 'SENDING' AND claim_attempt_id = $5
                RETURNING event_id)
             UPDATE outbox_attempts SET state = 'UNKNOWN', detail = $6, finished_at_ms = $4
             WHERE attempt_id = $5 AND state = 'SENDING' AND EXISTS (SELECT 1 FROM ev)",
            |q| q.bind(attempt_id.as_str()).bind(detail),
        )
        .await
    }

    async fn report_not_sent(&self, token: &ClaimToken, attempt_id: &AttemptId, detail: &str) -> Result<FenceOutcome, StoreError> {
        self.stream_to_lane(&[(token.event_id.as_str(), token.claim_generation)]).await?;
        self.fenced_update(
            token,
            "report_not_sent",
            // PENDING again, claimable after the backoff of its attempt
            // generation ($7: NOT_SENT_BACKOFFS), unless an earlier attempt
            // may still be in the log (a blind
            // retry left it UNKNOWN): then its late ACK must still find the
            // event accepting, so the event waits in DISPATCH_UNKNOWN for the
            // reconciler.
            "WITH other AS (
                SELECT 1 FROM outbox_attempts WHERE event_id = $1 AND attempt_id <> $5 AND state IN ('SENDING', 'UNKNOWN') LIMIT 1),
             ev AS (
                UPDATE outbox_events SET
                       state = CASE WHEN EXISTS (SELECT 1 FROM other) THEN 'DISPATCH_UNKNOWN' ELSE 'PENDING' END,
                       unknown_since_ms = CASE WHEN EXISTS (SELECT 1 FROM other) THEN coalesce(unknown_since_ms, $4) ELSE unknown_since_ms END,
                       next_check_at_ms = CASE WHEN EXISTS (SELECT 1 FROM other) THEN $4
                                          ELSE $4 + ($7::bigint[])[LEAST(GREATEST(attempt_generation, 1), cardinality($7::bigint[]))] END,
                       claim_owner = NULL, lease_until_ms = NULL, claim_attempt_id = NULL, state_since_ms = $4
                WHERE event_id = $1 AND claim_generation = $2 AND claim_owner = $3 AND state = 'SENDING' AND claim_attempt_id = $5
                RETURNING event_id)
             UPDATE outbox_attempts SET state = 'NOT_SENT', detail = $6, finished_at_ms = $4
             WHERE attempt_id = $5 AND state = 'SENDING' AND EXISTS (SELECT 1 FROM ev)",
            |q| q.bind(attempt_id.as_str()).bind(detail).bind(NOT_SENT_BACKOFFS.as_slice()),
        )
        .await
    }

    async fn release(&self, token: &ClaimToken) -> Result<FenceOutcome, StoreError> {
        self.stream_to_lane(&[(token.event_id.as_str(), token.claim_generation)]).await?;
        self.fenced_update(
            token,
            "release",
            "UPDATE outbox_events SET state = 'PENDING', claim_owner = NULL, lease_until_ms = NULL, state_since_ms = $4
             WHERE event_id = $1 AND claim_generation = $2 AND claim_owner = $3 AND state = 'CLAIMED'",
            |q| q,
        )
        .await
    }

    async fn quarantine_claimed(&self, token: &ClaimToken, reason: &str, evidence: serde_json::Value) -> Result<FenceOutcome, StoreError> {
        self.stream_to_lane(&[(token.event_id.as_str(), token.claim_generation)]).await?;
        self.fenced_update(
            token,
            "quarantine",
            "WITH ev AS (
                UPDATE outbox_events SET state = 'QUARANTINED', claim_owner = NULL, lease_until_ms = NULL, state_since_ms = $4
                WHERE event_id = $1 AND claim_generation = $2 AND claim_owner = $3 AND state IN ('CLAIMED', 'RETRY_CLAIMED')
                RETURNING event_id, envelope_generation)
             INSERT INTO outbox_quarantine (event_id, envelope_generation, reason, evidence, created_at_ms)
             SELECT event_id, envelope_generation, $5, $6, $4 FROM ev",
            |q| q.bind(reason).bind(evidence),
        )
        .await
    }

    async fn renew_lease(&self, token: &ClaimToken, lease_ms: i64) -> Result<Option<i64>, StoreError> {
        Ok(self.renew_leases(std::slice::from_ref(token), lease_ms).await?.pop().flatten())
    }

    async fn expire_leases(&self) -> Result<SweepOutcome, StoreError> {
        let now = self.now_ms();
        let mut tx = self.begin().await?;
        let rows = sqlx::query(&EXPIRE_LEASES_SQL)
        .bind(now)
        .bind(MAX_SWEEP_ROWS)
        .fetch_all(&mut *tx)
        .await
        .map_err(store_err)?;
        tx.commit().await.map_err(store_err)?;
        let mut out = SweepOutcome::default();
        // Open stream batches whose lease ran out go to the lane (schema section 17).
        out.unknown += self.expire_stream().await? as u64;
        for r in rows {
            let n = r.try_get::<i64, _>("n").map_err(store_err)? as u64;
            match r.try_get::<&str, _>("old_state").map_err(store_err)? {
                "CLAIMED" => out.released += n,
                "SENDING" => out.unknown += n,
                _ => out.retry_expired += n,
            }
        }
        if out != SweepOutcome::default() {
            tracing::info!(?out, "expired leases");
        }
        Ok(out)
    }

    async fn begin_reconcile(&self, owner: &str, limit: usize, lease_ms: i64) -> Result<Vec<ReconcileTask>, StoreError> {
        self.begin_reconcile_where(owner, limit, lease_ms, None).await
    }

    async fn finish_reconcile(&self, token: &ClaimToken, decision: &ReconcileDecision) -> Result<FenceOutcome, StoreError> {
        let Some(plan) = outbox_core::reconcile::plan_reconcile_finish(decision) else { return Ok(FenceOutcome::NoOp) };
        self.fenced_update(token, "finish_reconcile", &FINISH_RECONCILE_SQL, move |q| {
            q.bind(plan.to.as_str()).bind(plan.next_check_at_ms).bind(plan.close_open_attempts)
        })
        .await
        .inspect(|_| {
            if let ReconcileDecision::Recheck { reason, .. } = decision {
                tracing::debug!(event_id = %token.event_id, ?reason, "unknown stays unknown");
            }
        })
    }

    async fn attempts(&self, event_id: &EventId) -> Result<Vec<AttemptRecord>, StoreError> {
        let lane: Vec<AttemptRecord> = sqlx::query(&format!("SELECT {ATTEMPT_COLUMNS} FROM outbox_attempts WHERE event_id = $1 ORDER BY attempt_generation"))
            .bind(event_id.as_str())
            .fetch_all(&self.pool)
            .await
            .map_err(store_err)?
            .iter()
            .map(attempt_from_row)
            .collect::<Result<_, _>>()?;
        if !lane.is_empty() {
            return Ok(lane);
        }
        // A stream event's attempt has no row (schema section 17).
        self.stream_attempts(event_id.as_str()).await
    }

    async fn event_state(&self, event_id: &EventId) -> Result<(EventState, Option<BrokerReceipt>), StoreError> {
        // Wherever it lives: the lane, or the stream (schema section 17).
        let row = sqlx::query(
            "SELECT outbox_event_state($1) AS state,
                    coalesce((SELECT envelope_generation FROM outbox_events WHERE event_id = $1), 1) AS envelope_generation
             WHERE outbox_event_state($1) IS NOT NULL",
        )
            .bind(event_id.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(store_err)?
            .ok_or_else(|| StoreError::NotFound(event_id.clone()))?;
        let state = EventState::parse(row.try_get("state").map_err(store_err)?)?;
        let generation: i32 = row.try_get("envelope_generation").map_err(store_err)?;
        let slot = sqlx::query(&format!("SELECT {RECEIPT_COLUMNS} FROM outbox_publish_receipts WHERE event_id = $1 AND envelope_generation = $2"))
            .bind(event_id.as_str())
            .bind(generation)
            .fetch_optional(&self.pool)
            .await
            .map_err(store_err)?
            .map(|r| receipt_from_row(&r))
            .transpose()?;
        Ok((state, slot))
    }
}
