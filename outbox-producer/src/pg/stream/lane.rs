//! The exception lane: stream events copied into `outbox_events` in the
//! state the stream gave them, so that the chains machinery (fenced
//! reports, reconciliation, migration, retention) takes them from there.

use std::collections::{BTreeSet, HashMap};

use outbox_core::StoreError;
use sqlx::{Postgres, Row, Transaction};

use crate::error::store_err;

/// Where a stream event stands when it moves to the lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LaneState {
    /// Not handed out (or handed out and never registered, its lease gone).
    Pending,
    /// Handed out under the batch's claim, not registered.
    Claimed,
    /// Registered under the batch's claim: it may be in the log.
    Sending,
    /// Registered, and the batch's lease ran out without a receipt.
    Unknown,
    /// Its receipt fills the slot.
    Published,
}

/// The batch's claim and attempt an event carries into the lane.
#[derive(Debug, Clone)]
pub(super) struct LaneClaim {
    pub owner: String,
    pub batch_id: i64,
    pub lease_until_ms: i64,
    pub attempt: Option<LaneAttempt>,
}

/// The attempt a registered event carries into the lane.
#[derive(Debug, Clone)]
pub(super) struct LaneAttempt {
    pub attempt_id: String,
    pub destination_digest: String,
    pub started_at_ms: i64,
    pub registered_db_ms: i64,
    pub scan_from: i64,
    pub scan_anchor: Option<String>,
    pub scan_anchor_attempt: Option<String>,
}

/// One event to move.
#[derive(Debug, Clone)]
pub(super) struct LaneMove {
    pub event_id: String,
    pub to: LaneState,
    pub claim: Option<LaneClaim>,
}

/// Copies `moves`' events into the lane, each in its state (events already
/// there are left as they are). Returns the events copied.
pub(super) async fn move_to_lane(tx: &mut Transaction<'static, Postgres>, moves: &[LaneMove], now: i64) -> Result<BTreeSet<String>, StoreError> {
    if moves.is_empty() {
        return Ok(BTreeSet::new());
    }
    let ids: Vec<&str> = moves.iter().map(|m| m.event_id.as_str()).collect();
    let copied: BTreeSet<String> = sqlx::query_scalar("SELECT outbox_stream_to_lane($1::text[])")
        .bind(&ids)
        .fetch_all(&mut **tx)
        .await
        .map_err(store_err)?
        .into_iter()
        .collect();
    let moved: Vec<&LaneMove> = moves.iter().filter(|m| copied.contains(&m.event_id)).collect();
    // Unclaimed events of a batch keep its id as their generation, so that a
    // claim in the lane is above every claim of the batch.
    let floors: Vec<(&str, i64)> = moved.iter().filter(|m| m.to == LaneState::Pending).filter_map(|m| m.claim.as_ref().map(|c| (m.event_id.as_str(), c.batch_id))).collect();
    if !floors.is_empty() {
        sqlx::query(
            "UPDATE outbox_events e SET claim_generation = t.gen FROM UNNEST($1::text[], $2::bigint[]) AS t(event_id, gen)
             WHERE e.event_id = t.event_id AND e.state = 'PENDING' AND e.claim_generation < t.gen",
        )
        .bind(floors.iter().map(|f| f.0).collect::<Vec<_>>())
        .bind(floors.iter().map(|f| f.1).collect::<Vec<_>>())
        .execute(&mut **tx)
        .await
        .map_err(store_err)?;
    }
    let claimed: Vec<(&LaneMove, &LaneClaim)> = moved.iter().filter(|m| m.to != LaneState::Pending).filter_map(|m| m.claim.as_ref().map(|c| (*m, c))).collect();
    if !claimed.is_empty() {
        sqlx::query(
            "UPDATE outbox_events e SET state = 'CLAIMED', claim_owner = t.owner, claim_generation = t.gen, lease_until_ms = t.lease,
                    state_since_ms = $5
             FROM UNNEST($1::text[], $2::text[], $3::bigint[], $4::bigint[]) AS t(event_id, owner, gen, lease)
             WHERE e.event_id = t.event_id AND e.state = 'PENDING'",
        )
        .bind(claimed.iter().map(|(m, _)| m.event_id.as_str()).collect::<Vec<_>>())
        .bind(claimed.iter().map(|(_, c)| c.owner.as_str()).collect::<Vec<_>>())
        .bind(claimed.iter().map(|(_, c)| c.batch_id).collect::<Vec<_>>())
        .bind(claimed.iter().map(|(_, c)| c.lease_until_ms).collect::<Vec<_>>())
        .bind(now)
        .execute(&mut **tx)
        .await
        .map_err(store_err)?;
    }
    let registered: Vec<(&LaneMove, &LaneClaim, &LaneAttempt)> = claimed
        .iter()
        .filter(|(m, _)| matches!(m.to, LaneState::Sending | LaneState::Unknown | LaneState::Published))
        .filter_map(|(m, c)| c.attempt.as_ref().map(|a| (*m, *c, a)))
        .collect();
    if !registered.is_empty() {
        let col = |f: &dyn Fn(&LaneMove, &LaneClaim, &LaneAttempt) -> Option<String>| registered.iter().map(|(m, c, a)| f(m, c, a)).collect::<Vec<_>>();
        sqlx::query(
            "WITH t AS (SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bigint[], $5::bigint[], $6::bigint[], $7::bigint[],
                                            $8::text[], $9::text[], $10::bigint[], $11::bigint[])
                        AS t(event_id, attempt_id, owner, gen, started, registered_db, scan_from, anchor, anchor_attempt, deadline, lease)),
             ev AS (
                UPDATE outbox_events e SET state = 'SENDING', claim_attempt_id = t.attempt_id, attempt_generation = 1, state_since_ms = $12
                FROM t WHERE e.event_id = t.event_id AND e.state = 'CLAIMED'
                RETURNING e.event_id, e.envelope_generation, e.destination_digest)
             INSERT INTO outbox_attempts (attempt_id, event_id, envelope_generation, attempt_generation, claim_generation, owner, state,
                  destination_digest, started_at_ms, scan_from_offset, send_deadline_ms, scan_anchor_event_id, scan_anchor_attempt_id,
                  registered_db_ms)
             SELECT t.attempt_id, t.event_id, ev.envelope_generation, 1, t.gen, t.owner, 'SENDING', ev.destination_digest, t.started,
                    t.scan_from, t.deadline, t.anchor, t.anchor_attempt, t.registered_db
             FROM t JOIN ev USING (event_id)",
        )
        .bind(col(&|m, _, _| Some(m.event_id.clone())))
        .bind(col(&|_, _, a| Some(a.attempt_id.clone())))
        .bind(col(&|_, c, _| Some(c.owner.clone())))
        .bind(registered.iter().map(|(_, c, _)| c.batch_id).collect::<Vec<_>>())
        .bind(registered.iter().map(|(_, _, a)| a.started_at_ms).collect::<Vec<_>>())
        .bind(registered.iter().map(|(_, _, a)| a.registered_db_ms).collect::<Vec<_>>())
        .bind(registered.iter().map(|(_, _, a)| a.scan_from).collect::<Vec<_>>())
        .bind(col(&|_, _, a| a.scan_anchor.clone()))
        .bind(col(&|_, _, a| a.scan_anchor_attempt.clone()))
        .bind(registered.iter().map(|(_, c, _)| c.lease_until_ms).collect::<Vec<_>>())
        .bind(registered.iter().map(|(_, c, _)| c.lease_until_ms).collect::<Vec<_>>())
        .bind(now)
        .execute(&mut **tx)
        .await
        .map_err(store_err)?;
    }
    let of = |s: LaneState| registered.iter().filter(|(m, _, _)| m.to == s).map(|(m, _, _)| m.event_id.as_str()).collect::<Vec<_>>();
    let unknown = of(LaneState::Unknown);
    if !unknown.is_empty() {
        // As the lease sweep leaves a SENDING event whose lease ran out.
        sqlx::query(
            "WITH ev AS (
                UPDATE outbox_events SET state = 'DISPATCH_UNKNOWN', claim_generation = claim_generation + 1, claim_owner = NULL,
                       lease_until_ms = NULL, unknown_since_ms = coalesce(unknown_since_ms, $2), next_check_at_ms = $2, state_since_ms = $2
                WHERE event_id = ANY($1) AND state = 'SENDING'
                RETURNING claim_attempt_id)
             UPDATE outbox_attempts a SET state = 'UNKNOWN', detail = 'lease expired while sending', finished_at_ms = $2
             FROM ev WHERE a.attempt_id = ev.claim_attempt_id AND a.state = 'SENDING'",
        )
        .bind(&unknown)
        .bind(now)
        .execute(&mut **tx)
        .await
        .map_err(store_err)?;
    }
    let published = of(LaneState::Published);
    if !published.is_empty() {
        let at: HashMap<String, i64> = sqlx::query("SELECT event_id, accepted_at_ms FROM outbox_publish_receipts WHERE event_id = ANY($1) AND envelope_generation = 1")
            .bind(&published)
            .fetch_all(&mut **tx)
            .await
            .map_err(store_err)?
            .iter()
            .map(|r| Ok((r.try_get("event_id").map_err(store_err)?, r.try_get("accepted_at_ms").map_err(store_err)?)))
            .collect::<Result<_, StoreError>>()?;
        let ats: Vec<i64> = published.iter().map(|e| at.get(*e).copied().unwrap_or(now)).collect();
        sqlx::query(
            "WITH t AS (SELECT * FROM UNNEST($1::text[], $2::bigint[]) AS t(event_id, at)),
             ev AS (
                UPDATE outbox_events e SET state = 'PUBLISHED', claim_owner = NULL, lease_until_ms = NULL, published_at_ms = t.at, state_since_ms = t.at
                FROM t WHERE e.event_id = t.event_id AND e.state = 'SENDING'
                RETURNING e.claim_attempt_id, t.at)
             UPDATE outbox_attempts a SET state = 'ACKED', finished_at_ms = ev.at
             FROM ev WHERE a.attempt_id = ev.claim_attempt_id AND a.state = 'SENDING'",
        )
        .bind(&published)
        .bind(&ats)
        .execute(&mut **tx)
        .await
        .map_err(store_err)?;
    }
    Ok(copied)
}
