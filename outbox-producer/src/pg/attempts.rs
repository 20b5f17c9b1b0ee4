//! Attempts: registering attempts for claims (with where a scan for each
//! message would start), and reading registered attempts back.

use std::collections::HashMap;

use outbox_core::{AttemptId, AttemptRecord, ClaimToken, CoreError, EventId, EventState, StoreError};
use sqlx::{Postgres, Transaction};

use super::rows::{attempt_from_row, ATTEMPT_COLUMNS};
use super::PgStore;
use crate::error::store_err;

impl PgStore {
    /// Registers attempts for many claims in one transaction. Each token is
    /// fenced on its own; the answer is per token, in order.
    pub(super) async fn register_attempts_tx(&self, tokens: &[ClaimToken]) -> Result<Vec<Result<AttemptRecord, StoreError>>, StoreError> {
        if tokens.is_empty() {
            return Ok(vec![]);
        }
        // Tokens of stream events (schema section 17) register on the stream.
        let lane = self.lane_rows(&tokens.iter().map(|t| t.event_id.as_str()).collect::<Vec<_>>()).await?;
        if lane.len() < tokens.len() {
            let (in_lane, on_stream): (Vec<&ClaimToken>, Vec<&ClaimToken>) = tokens.iter().partition(|t| lane.contains(t.event_id.as_str()));
            let mut stream = self.register_stream(&on_stream).await?.into_iter();
            let lane_tokens: Vec<ClaimToken> = in_lane.into_iter().cloned().collect();
            let mut chains = Box::pin(self.register_attempts_tx(&lane_tokens)).await?.into_iter();
            return Ok(tokens
                .iter()
                .map(|t| if lane.contains(t.event_id.as_str()) { chains.next() } else { stream.next() })
                .map(|r| r.unwrap_or_else(|| Err(StoreError::Backend { message: "registration answered fewer tokens than asked".into(), retryable: false })))
                .collect());
        }
        let now = self.now_ms();
        let ids: Vec<&str> = tokens.iter().map(|t| t.event_id.as_str()).collect();
        let gens: Vec<i64> = tokens.iter().map(|t| t.claim_generation as i64).collect();
        let owners: Vec<&str> = tokens.iter().map(|t| t.owner.as_str()).collect();
        let attempt_ids: Vec<String> = tokens.iter().map(|_| AttemptId::generate(now.max(0) as u64).to_string()).collect();
        let mut tx = self.begin().await?;
        let rows = sqlx::query(&format!(
            "WITH input AS (SELECT * FROM UNNEST($1::text[], $2::bigint[], $3::text[], $4::text[]) AS t(event_id, gen, owner, attempt_id)),
             upd AS (
                UPDATE outbox_events e SET state = 'SENDING', claim_attempt_id = i.attempt_id,
                       attempt_generation = e.attempt_generation + 1, state_since_ms = $5
                FROM input i
                WHERE e.event_id = i.event_id AND e.claim_generation = i.gen AND e.claim_owner = i.owner
                  AND e.lease_until_ms > $5 AND e.state IN ({registrable}) AND e.claim_attempt_id IS NULL
                RETURNING e.event_id, e.envelope_generation, e.attempt_generation, e.destination_digest, e.cluster_id, e.topic,
                          e.partition, e.lease_until_ms, i.attempt_id, i.gen, i.owner),
             -- The topic id each frozen destination names (NULL: destination.v1).
             dest AS (
                SELECT u.*, outbox_destination_topic_id(v.destination_canonical) AS topic_id FROM upd u
                JOIN outbox_envelopes v ON v.event_id = u.event_id AND v.envelope_generation = u.envelope_generation),
             -- Where a scan for the message would start: past the highest
             -- receipted offset of its partition's log (the topic id is part
             -- of it: a recreated topic's new log starts at 0 again), looked
             -- up once per partition and topic id, by equality on the key;
             -- with the event whose receipt holds it (the newest epoch), the
             -- anchor by which a lookup recognises that log.
             floors AS MATERIALIZED (
                SELECT p.cluster_id, p.topic, p.topic_id, p.partition, f.scan_from, f.scan_anchor, f.scan_anchor_attempt
                FROM (SELECT DISTINCT cluster_id, topic, topic_id, partition FROM dest) p
                CROSS JOIN LATERAL outbox_log_floor(p.cluster_id, p.topic, p.topic_id, p.partition) f)
             INSERT INTO outbox_attempts ({ATTEMPT_COLUMNS})
             SELECT u.attempt_id, u.event_id, u.envelope_generation, u.attempt_generation, u.gen, u.owner, 'SENDING',
                    u.destination_digest, $5, f.scan_from, u.lease_until_ms, f.scan_anchor, f.scan_anchor_attempt
             FROM dest u JOIN floors f
               ON f.cluster_id = u.cluster_id AND f.topic = u.topic AND f.topic_id IS NOT DISTINCT FROM u.topic_id AND f.partition = u.partition
             RETURNING {ATTEMPT_COLUMNS}",
            registrable = outbox_core::sql_state_list(&outbox_core::REGISTRABLE_STATES),
        ))
        // Planned for each batch with its real size: a cached generic plan
        // guesses 10 input rows and joined them to the table by nested loop
        // (auto_explain: 160,000 join-filter rows for a batch of 400).
        .persistent(false)
        .bind(&ids)
        .bind(&gens)
        .bind(&owners)
        .bind(&attempt_ids)
        .bind(now)
        .fetch_all(&mut *tx)
        .await
        .map_err(store_err)?;
        let mut registered: HashMap<String, AttemptRecord> = HashMap::with_capacity(rows.len());
        for r in &rows {
            let a = attempt_from_row(r)?;
            registered.insert(a.event_id.to_string(), a);
        }
        let mut out = Vec::with_capacity(tokens.len());
        for t in tokens {
            match registered.remove(t.event_id.as_str()) {
                Some(a) => out.push(Ok(a)),
                None => {
                    let err = match Self::claim_of(&mut tx, t.event_id.as_str()).await? {
                        None => StoreError::NotFound(t.event_id.clone()),
                        // The guard that refused it, named: the statement above guards the same columns.
                        Some((claim, state)) => match outbox_core::check_registration(state, &claim, t, now) {
                            Err(e) => StoreError::Core(e),
                            Ok(()) => StoreError::Core(CoreError::IllegalTransition { from: state, to: EventState::Sending }),
                        },
                    };
                    if err.is_fenced() {
                        let detail = serde_json::json!({ "write": "register_attempt", "writerGeneration": t.claim_generation, "error": err.to_string() });
                        Self::audit(&mut tx, t.event_id.as_str(), &t.owner, "stale_write", detail, now).await?;
                    }
                    out.push(Err(err));
                }
            }
        }
        tx.commit().await.map_err(store_err)?;
        Ok(out)
    }

    /// All attempts of an event, oldest first, read in `tx`.
    pub(crate) async fn attempts_in(tx: &mut Transaction<'_, Postgres>, event_id: &EventId) -> Result<Vec<AttemptRecord>, StoreError> {
        sqlx::query(&format!("SELECT {ATTEMPT_COLUMNS} FROM outbox_attempts WHERE event_id = $1 ORDER BY attempt_generation"))
            .bind(event_id.as_str())
            .fetch_all(&mut **tx)
            .await
            .map_err(store_err)?
            .iter()
            .map(attempt_from_row)
            .collect()
    }

    /// The attempts a registration of `tokens` made, where it committed: for
    /// each token, the SENDING attempt its own claim (owner and generation)
    /// registered and the event still names, under a lease that has not run
    /// out (as registration itself requires). A dispatcher asks after its
    /// registration failed with a broken connection: the commit may have
    /// gone through before the answer was lost, and then those attempts
    /// are registered and theirs to send.
    pub async fn registered_attempts(&self, tokens: &[ClaimToken]) -> Result<Vec<AttemptRecord>, StoreError> {
        if tokens.is_empty() {
            return Ok(vec![]);
        }
        let ids: Vec<&str> = tokens.iter().map(|t| t.event_id.as_str()).collect();
        let gens: Vec<i64> = tokens.iter().map(|t| t.claim_generation as i64).collect();
        let owners: Vec<&str> = tokens.iter().map(|t| t.owner.as_str()).collect();
        let rows = sqlx::query(&format!(
            "SELECT {ATTEMPT_COLUMNS} FROM outbox_attempts
             WHERE state = 'SENDING' AND (attempt_id, claim_generation, owner) IN (
                 SELECT e.claim_attempt_id, t.gen, t.owner FROM UNNEST($1::text[], $2::bigint[], $3::text[]) AS t(event_id, gen, owner)
                 JOIN outbox_events e ON e.event_id = t.event_id AND e.claim_generation = t.gen AND e.claim_owner = t.owner
                                       AND e.state = 'SENDING' AND e.lease_until_ms > $4)"
        ))
        .bind(&ids)
        .bind(&gens)
        .bind(&owners)
        .bind(self.now_ms())
        .fetch_all(&self.pool)
        .await
        .map_err(store_err)?;
        rows.iter().map(attempt_from_row).collect()
    }
}
