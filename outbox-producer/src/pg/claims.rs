//! Claims: the claim statements (retries, every chain's head, the
//! successors of given events), the transactions that run them, the
//! linking of new chains to heads first, and the quarantine of claimed rows
//! whose frozen records cannot be read.

use std::sync::LazyLock;

use outbox_core::claim::{validate_lease_ms, MAX_CLAIM_BATCH};
use outbox_core::{ClaimedEvent, EventId, EventState, StoreError};
use sqlx::postgres::PgRow;
use sqlx::{Postgres, Row, Transaction};

use super::rows::{claim_token, frozen_records, Unreadable};
use super::PgStore;
use crate::error::store_err;
use crate::service_store::ClaimRound;
#[cfg(doc)]
use outbox_core::OutboxStore;

impl PgStore {
    /// The claimed rows as events to send, and the rows whose frozen
    /// envelope or destination cannot be read: `(event id, envelope
    /// generation, why)`.
    fn claimed_rows(rows: Vec<PgRow>, from: EventState) -> Result<(Vec<ClaimedEvent>, Vec<Unreadable>), StoreError> {
        let mut claimed = Vec::with_capacity(rows.len());
        let mut unreadable = Vec::new();
        for r in &rows {
            let g = |e: sqlx::Error| store_err(e);
            let (envelope, destination) = match frozen_records(r)? {
                Ok(p) => p,
                Err(u) => {
                    unreadable.push(u);
                    continue;
                }
            };
            claimed.push(ClaimedEvent {
                token: claim_token(r, &envelope.event_id)?,
                envelope,
                destination,
                destination_digest: r.try_get("destination_digest").map_err(g)?,
                payload: r.try_get::<Option<Vec<u8>>, _>("payload").map_err(g)?.unwrap_or_default(),
                event_payload_digest: r.try_get("payload_digest").map_err(g)?,
                claimed_from: from,
                traceparent: r.try_get("traceparent").map_err(g)?,
                tracestate: r.try_get("tracestate").map_err(g)?,
                cloudevents: None,
                source: None,
            });
        }
        Ok((claimed, unreadable))
    }

    /// Quarantines, in the claim's transaction, claimed rows whose frozen
    /// envelope or destination cannot be read: that event can never be
    /// sent as frozen, and it must not fail the claim of every other event.
    pub(super) async fn quarantine_unreadable(tx: &mut Transaction<'static, Postgres>, owner: &str, unreadable: &[(String, i32, String)], now: i64) -> Result<usize, StoreError> {
        if unreadable.is_empty() {
            return Ok(0);
        }
        for (id, _, why) in unreadable {
            tracing::error!(event_id = %id, error = %why, "frozen envelope or destination unreadable: quarantined, not sent");
        }
        let ids: Vec<&str> = unreadable.iter().map(|u| u.0.as_str()).collect();
        let gens: Vec<i32> = unreadable.iter().map(|u| u.1).collect();
        let whys: Vec<&str> = unreadable.iter().map(|u| u.2.as_str()).collect();
        let n = sqlx::query(
            "WITH t AS (SELECT * FROM UNNEST($1::text[], $2::int[], $3::text[]) AS t(event_id, gen, why)),
             ev AS (
                UPDATE outbox_events e SET state = 'QUARANTINED', claim_owner = NULL, lease_until_ms = NULL, state_since_ms = $5,
                       claim_generation = e.claim_generation + 1
                FROM t WHERE e.event_id = t.event_id AND e.claim_owner = $4 AND e.state IN ('CLAIMED', 'RETRY_CLAIMED', 'RECONCILING')
                RETURNING e.event_id, e.envelope_generation, t.why)
             INSERT INTO outbox_quarantine (event_id, envelope_generation, reason, evidence, created_at_ms)
             SELECT event_id, envelope_generation, 'frozen_record_unreadable', jsonb_build_object('error', why), $5 FROM ev",
        )
        .bind(&ids)
        .bind(&gens)
        .bind(&whys)
        .bind(owner)
        .bind(now)
        .execute(&mut **tx)
        .await
        .map_err(store_err)?
        .rows_affected();
        Ok(n as usize)
    }

    /// Runs a claim statement in a transaction of its own (planned without
    /// sequential scans, see `begin`): `$1` limit, `$2` owner, `$3` now,
    /// `$4` lease, `$5` cluster scope, `$6` highest protocol understood,
    /// `$7` (when given) event ids; it returns [`CLAIM_FROM_C`] rows.
    pub(super) async fn claim_with(&self, sql: &str, owner: &str, limit: usize, lease_ms: i64, from: EventState, events: Option<&[&str]>) -> Result<Vec<ClaimedEvent>, StoreError> {
        validate_claim(owner, lease_ms)?;
        let mut tx = self.begin().await?;
        if from == EventState::Pending {
            link_arrivals(&mut tx, limit).await?;
        }
        let mut claimed = self.claim_in(&mut tx, sql, owner, limit, lease_ms, from, events, &mut 0).await?;
        if from == EventState::Pending && events.is_none() {
            // The stream's batches (schema section 17), after the lane's events.
            let (path, _) = self.claim_paths(&mut tx).await?;
            let stream = self.claim_stream_in(&mut tx, path, owner, limit - claimed.len().min(limit), lease_ms).await?;
            claimed.extend(stream);
        }
        tx.commit().await.map_err(store_err)?;
        Ok(claimed)
    }

    /// Runs a claim statement (as [`PgStore::claim_with`] describes) in `tx`,
    /// its owner and lease already validated; claims of PENDING events come
    /// back in event-id order.
    #[allow(clippy::too_many_arguments)]
    async fn claim_in(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        sql: &str,
        owner: &str,
        limit: usize,
        lease_ms: i64,
        from: EventState,
        events: Option<&[&str]>,
        quarantined: &mut usize,
    ) -> Result<Vec<ClaimedEvent>, StoreError> {
        let mut q = sqlx::query(sql)
            .bind(limit.min(MAX_CLAIM_BATCH) as i64)
            .bind(owner)
            .bind(self.now_ms())
            .bind(lease_ms)
            .bind(self.cluster_scope.as_deref())
            .bind(self.max_protocol_version);
        if let Some(events) = events {
            q = q.bind(events);
        }
        let rows = q.fetch_all(&mut **tx).await.map_err(store_err)?;
        let (mut claimed, unreadable) = Self::claimed_rows(rows, from)?;
        *quarantined += Self::quarantine_unreadable(tx, owner, &unreadable, self.now_ms()).await?;
        self.cloudevents.attach(&mut **tx, &mut claimed).await?;
        if from == EventState::Pending {
            claimed.sort_by(|a, b| a.envelope.event_id.cmp(&b.envelope.event_id));
        }
        Ok(claimed)
    }

    /// A dispatcher's claim of up to `limit` events, in one transaction:
    /// events waiting for a retry first; then, unless `scan_due`, the
    /// successors of the events `after` ([`PgStore::claim_successors`]);
    /// then, when a scan is due or the batch is not full, every key's head
    /// ([`OutboxStore::claim_batch`]). All of it commits or none of it does,
    /// and the transaction's round trips are paid once. New chains are
    /// linked to heads first, in the same transaction (`link_arrivals`).
    pub async fn claim_next(&self, owner: &str, after: &[EventId], scan_due: bool, limit: usize, lease_ms: i64) -> Result<ClaimRound, StoreError> {
        validate_claim(owner, lease_ms)?;
        let mut tx = self.begin().await?;
        let (path, lane_busy) = self.claim_paths(&mut tx).await?;
        let mut quarantined = 0;
        let mut round = ClaimRound { claimed: Vec::new(), successor_claim: false, head_scan: false, quarantined: 0 };
        if lane_busy {
            link_arrivals(&mut tx, limit).await?;
            round.claimed = self.claim_in(&mut tx, &CLAIM_RETRIES, owner, limit, lease_ms, EventState::RetryClaimed, None, &mut quarantined).await?;
        }
        if lane_busy && round.claimed.len() < limit {
            let mut scan = scan_due;
            if !scan {
                let found = self
                    .claim_in(&mut tx, &CLAIM_SUCCESSORS, owner, limit - round.claimed.len(), lease_ms, EventState::Pending, Some(&successor_ids(after)), &mut quarantined)
                    .await?;
                round.successor_claim = true;
                round.claimed.extend(found);
                // Successors that do not fill the batch: top it up from every
                // key's head (O(batch) since the chain heads) rather than
                // send a smaller batch, or wait when there were none. With
                // many workers each holds fewer keys, and successors alone
                // made batches of a fraction of the limit.
                scan = round.claimed.len() < limit;
            }
            if scan {
                let heads = self.claim_in(&mut tx, &CLAIM_EVERY_HEAD, owner, limit - round.claimed.len(), lease_ms, EventState::Pending, None, &mut quarantined).await?;
                round.claimed.extend(heads);
                round.head_scan = true;
            }
        }
        // The stream's batches (schema section 17), after the lane's events.
        let stream = self.claim_stream_in(&mut tx, path, owner, limit - round.claimed.len().min(limit), lease_ms).await?;
        round.claimed.extend(stream);
        tx.commit().await.map_err(store_err)?;
        round.quarantined = quarantined;
        Ok(round)
    }

    /// Claims, as `owner`, up to `limit` PENDING events: the current heads
    /// of the ordering chains of `events` (given the events an owner has
    /// just published, their successors) and unordered events, oldest
    /// first. It finds them with one probe per chain named, where
    /// [`OutboxStore::claim_batch`] visits every chain's head; it never
    /// finds a chain not named, so a dispatcher must also claim with
    /// `claim_batch` (see [`crate::DispatcherConfig::head_scan_every`]). At most
    /// [`MAX_CLAIM_BATCH`] events are read.
    pub async fn claim_successors(&self, owner: &str, events: &[EventId], limit: usize, lease_ms: i64) -> Result<Vec<ClaimedEvent>, StoreError> {
        self.claim_with(&CLAIM_SUCCESSORS, owner, limit, lease_ms, EventState::Pending, Some(&successor_ids(events))).await
    }
}

/// The end of every claim statement: the UPDATE of `outbox_events e` applies
/// to the rows of the CTE `c` and returns them with their current envelope.
pub(super) const CLAIM_FROM_C: &str = "FROM c, outbox_envelopes v
             WHERE e.event_id = c.event_id AND v.event_id = e.event_id AND v.envelope_generation = e.envelope_generation
             RETURNING e.event_id, e.envelope_generation, e.traceparent, e.tracestate, e.claim_owner, e.claim_generation, e.lease_until_ms, e.payload, e.destination_digest, e.payload_digest,
                 e.unknown_since_ms, e.state_since_ms, v.envelope_canonical, v.destination_canonical";

/// A claim's owner and lease, checked before any statement runs.
pub(super) fn validate_claim(owner: &str, lease_ms: i64) -> Result<(), StoreError> {
    validate_lease_ms(lease_ms)?;
    outbox_core::id::validate_identifier("owner", owner)?;
    Ok(())
}

/// The ids of the events whose successors a claim looks for, at most
/// [`MAX_CLAIM_BATCH`].
fn successor_ids(events: &[EventId]) -> Vec<&str> {
    events.iter().take(MAX_CLAIM_BATCH).map(EventId::as_str).collect()
}

/// The claim of events waiting for a retry (RETRY_CLAIMED, nobody's),
/// oldest first.
pub(super) static CLAIM_RETRIES: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH c AS (
            SELECT event_id FROM outbox_events WHERE phase = 'RETRY_CLAIMED' AND claim_owner IS NULL
              AND publisher = 'outbox' AND protocol_version <= $6 AND ($5::text IS NULL OR cluster_id = $5)
            ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED)
         UPDATE outbox_events e SET claim_owner = $2, claim_generation = e.claim_generation + 1,
                lease_until_ms = $3 + $4, claim_attempt_id = NULL
         {CLAIM_FROM_C}"
    )
});

/// The claim over every ordering chain's head: the claimable rows of
/// `outbox_chain_heads` (schema section 7) in seq order, read from
/// its partial index and locked with SKIP LOCKED, `LIMIT $1`: as many index
/// entries as the batch, whatever the backlog behind the heads or the
/// number of open chains, and a concurrent claim takes the next heads
/// instead of waiting for these.
pub(super) static CLAIM_EVERY_HEAD: LazyLock<String> = LazyLock::new(|| {
    claim_heads_sql(
        "SELECT h.event_id FROM outbox_chain_heads h
            WHERE h.claimable_at_ms IS NOT NULL AND h.claimable_at_ms <= $3 AND h.protocol_version <= $6
              AND ($5::text IS NULL OR h.cluster_id = $5)
            ORDER BY h.seq LIMIT $1 FOR NO KEY UPDATE OF h SKIP LOCKED",
    )
});

/// The claim over the heads of the chains of the events `$7`: one
/// primary-key probe for each event and one for each chain's head,
/// whatever the number of chains in the table.
static CLAIM_SUCCESSORS: LazyLock<String> = LazyLock::new(|| {
    claim_heads_sql(
        // No ORDER BY here: ordered by seq, the planner may walk the
        // claimable index and filter by chain, reading every claimable
        // head; the claim below orders and bounds the candidates.
        "SELECT h.event_id FROM outbox_chain_heads h
            WHERE h.key_chain = ANY (ARRAY(SELECT DISTINCT key_chain FROM outbox_events WHERE event_id = ANY($7::text[]) AND ordered))
              AND h.claimable_at_ms IS NOT NULL AND h.claimable_at_ms <= $3 AND h.protocol_version <= $6
              AND ($5::text IS NULL OR h.cluster_id = $5)
            FOR NO KEY UPDATE OF h SKIP LOCKED",
    )
});

fn claim_heads_sql(heads: &str) -> String {
    format!(
        "WITH hc AS ({heads}),
             cand AS (
                -- A head of a newer protocol is refused by the head query,
                -- and so is a head waiting out its backoff after a refused
                -- send (claimable_at_ms): it still holds its key, so nothing
                -- behind it overtakes it.
                SELECT event_id FROM hc
                UNION ALL
                (SELECT event_id FROM outbox_events WHERE phase = 'PENDING' AND NOT ordered AND publisher = 'outbox'
                   AND next_check_at_ms <= $3 AND protocol_version <= $6 AND ($5::text IS NULL OR cluster_id = $5)
                 ORDER BY seq LIMIT $1)),
             c AS (
                -- The candidates come in as one array (an init plan, run
                -- once), not as a join: when a row changed since this
                -- statement's snapshot, the lock re-checks that one row's
                -- conditions instead of re-running a join. The event row
                -- is the claim's record; its state is checked again here,
                -- and so are its cluster (the head row's copy is not the
                -- record) and, for an ordered event, that it heads its own
                -- current chain: a head row left on an event that a
                -- destination migration moved to another chain or cluster
                -- never hands that event out (one primary-key probe of
                -- outbox_chain_heads per candidate).
                SELECT e.event_id FROM outbox_events e
                WHERE e.event_id = ANY (ARRAY(SELECT event_id FROM cand))
                  AND e.state = 'PENDING' AND e.next_check_at_ms <= $3 AND e.protocol_version <= $6
                  AND ($5::text IS NULL OR e.cluster_id = $5)
                  AND (NOT e.ordered OR EXISTS (SELECT 1 FROM outbox_chain_heads h WHERE h.key_chain = e.key_chain AND h.event_id = e.event_id))
                ORDER BY e.seq LIMIT $1 FOR UPDATE OF e SKIP LOCKED)
             UPDATE outbox_events e SET state = 'CLAIMED', claim_owner = $2, claim_generation = e.claim_generation + 1,
                    lease_until_ms = $3 + $4, claim_attempt_id = NULL, state_since_ms = $3
             {CLAIM_FROM_C}"
    )
}

/// Links the chains of newly committed ordered events to heads
/// (`outbox_link_arrivals`), at most this many arrivals per claim
/// transaction, before the claim reads the heads.
const ARRIVALS_PER_CLAIM: i32 = 2_000;

/// Links the chains of newly committed ordered events to heads
/// (`outbox_link_arrivals`, schema section 7) as the first
/// statement of a claim's transaction: the claim's next statement sees
/// the new heads. It locks the arrivals it takes and the heads it inserts
/// until the claim commits; only another linker ever waits for those.
async fn link_arrivals(tx: &mut Transaction<'static, Postgres>, limit: usize) -> Result<(), StoreError> {
    let n = (limit.min(MAX_CLAIM_BATCH) as i32).saturating_mul(4).max(ARRIVALS_PER_CLAIM);
    sqlx::query("SELECT outbox_link_arrivals($1)").bind(n).execute(&mut **tx).await.map_err(store_err)?;
    Ok(())
}
