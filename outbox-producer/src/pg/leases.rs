//! Leases: renewing the leases of live claims, and the lease sweep's
//! statement.

use std::collections::HashMap;
use std::sync::LazyLock;

use outbox_core::claim::validate_lease_ms;
use outbox_core::{ClaimToken, StoreError};
use sqlx::Row;

use super::PgStore;
use crate::error::store_err;

/// Largest number of rows one lease sweep touches.
pub const MAX_SWEEP_ROWS: i64 = 10_000;

impl PgStore {
    /// Extends the leases of many live claims; returns, per token, the new
    /// lease end or `None` when the claim is no longer the holder's.
    pub async fn renew_leases(&self, tokens: &[ClaimToken], lease_ms: i64) -> Result<Vec<Option<i64>>, StoreError> {
        validate_lease_ms(lease_ms)?;
        let now = self.now_ms();
        let ids: Vec<&str> = tokens.iter().map(|t| t.event_id.as_str()).collect();
        // Stream events (schema section 17) hold their bucket's lease.
        let lane = self.lane_rows(&ids).await?;
        let stream = if lane.len() < tokens.len() {
            let on_stream: Vec<&ClaimToken> = tokens.iter().filter(|t| !lane.contains(t.event_id.as_str())).collect();
            self.renew_stream(&on_stream, lease_ms).await?
        } else {
            HashMap::new()
        };
        let gens: Vec<i64> = tokens.iter().map(|t| t.claim_generation as i64).collect();
        let owners: Vec<&str> = tokens.iter().map(|t| t.owner.as_str()).collect();
        let rows = sqlx::query(&format!(
            "UPDATE outbox_events e SET lease_until_ms = $4 + $5
             FROM UNNEST($1::text[], $2::bigint[], $3::text[]) AS t(event_id, gen, owner)
             WHERE e.event_id = t.event_id AND e.claim_generation = t.gen AND e.claim_owner = t.owner AND e.lease_until_ms > $4
               AND e.state IN ({leased})
             RETURNING e.event_id, e.lease_until_ms",
            leased = outbox_core::sql_state_list(&outbox_core::LEASED_STATES),
        ))
        .persistent(false)
        .bind(&ids)
        .bind(&gens)
        .bind(&owners)
        .bind(now)
        .bind(lease_ms)
        .fetch_all(&self.pool)
        .await
        .map_err(store_err)?;
        let mut renewed: HashMap<String, i64> = HashMap::new();
        for r in rows {
            renewed.insert(r.try_get("event_id").map_err(store_err)?, r.try_get("lease_until_ms").map_err(store_err)?);
        }
        Ok(tokens.iter().map(|t| renewed.get(t.event_id.as_str()).or_else(|| stream.get(t.event_id.as_str())).copied()).collect())
    }
}

/// The lease sweep: `outbox_core::plan_lease_expiry` as SQL
/// (`outbox_core::lease_expiry_sql` writes its state lists and CASE
/// expressions from the plan).
pub(super) static EXPIRE_LEASES_SQL: LazyLock<String> = LazyLock::new(|| {
    let p = outbox_core::lease_expiry_sql("c.old_state");
    format!(
        "WITH c AS (
            SELECT event_id, state AS old_state, claim_attempt_id FROM outbox_events
            WHERE claim_owner IS NOT NULL AND lease_until_ms <= $1
              AND state IN ({leased})
            ORDER BY lease_until_ms LIMIT $2 FOR UPDATE SKIP LOCKED),
         ev AS (
            UPDATE outbox_events e SET
                state = {to},
                claim_generation = e.claim_generation + 1, claim_owner = NULL, lease_until_ms = NULL,
                claim_attempt_id = CASE WHEN c.old_state IN ({keeps}) THEN e.claim_attempt_id ELSE NULL END,
                unknown_since_ms = CASE WHEN c.old_state IN ({unknown}) THEN coalesce(e.unknown_since_ms, $1) ELSE e.unknown_since_ms END,
                next_check_at_ms = $1, state_since_ms = $1
            FROM c WHERE e.event_id = c.event_id
            RETURNING c.old_state, c.claim_attempt_id),
         att AS (
            UPDATE outbox_attempts a SET state = 'UNKNOWN', detail = 'lease expired while sending', finished_at_ms = $1
            FROM ev WHERE ev.old_state IN ({attempt}) AND a.attempt_id = ev.claim_attempt_id AND a.state = 'SENDING')
         SELECT old_state, count(*) AS n FROM ev GROUP BY old_state",
        leased = p.leased,
        to = p.to,
        keeps = p.keeps_attempt,
        unknown = p.outcome_unknown,
        attempt = p.attempt_unknown,
    )
});
