//! `acceptDispatchReceipt`: receipts decided by outbox-core against the
//! locked events and their attempts, in one transaction, with the findings
//! they reveal (lost positions, refuted absence proofs, unregistered
//! messages) and the resolution of unknown outcomes.

use std::collections::HashMap;

use outbox_core::{
    decide_receipt, AttemptRecord, AttemptState, BrokerReceipt, Destination, EventState, LockedEvent, ReceiptDecision, ReceiptOutcome, StoreError,
};
use sqlx::{Postgres, Row, Transaction};

use super::findings::record_findings;
use super::rows::{attempt_from_row, parse_id, receipt_from_row, ATTEMPT_COLUMNS, RECEIPT_COLUMNS};
use super::PgStore;
use crate::error::store_err;

/// A log position: cluster, topic, topic id (`None` for `destination.v1`),
/// partition, offset.
type Position = (String, String, Option<String>, i32, i64);

impl PgStore {
    /// `acceptDispatchReceipt` for many receipts in one transaction. Rows are
    /// locked in event-id order; each receipt is decided by
    /// [`decide_receipt`] against the state the earlier receipts of the same
    /// batch left.
    pub(super) async fn accept_dispatch_receipts_tx(&self, receipts: &[BrokerReceipt]) -> Result<Vec<ReceiptOutcome>, StoreError> {
        if receipts.is_empty() {
            return Ok(vec![]);
        }
        // Receipts of stream events (schema section 17) are decided on the
        // stream, or moved to the lane and decided below.
        let lane = self.lane_rows(&receipts.iter().map(|r| r.event_id.as_str()).collect::<Vec<_>>()).await?;
        if lane.len() < receipts.len() {
            let on_stream: Vec<&BrokerReceipt> = receipts.iter().filter(|r| !lane.contains(r.event_id.as_str())).collect();
            let decided = self.accept_stream_receipts(&on_stream).await?;
            let mut stream_out: std::collections::VecDeque<Option<ReceiptOutcome>> = decided.into();
            let mut slots: Vec<Option<ReceiptOutcome>> = Vec::with_capacity(receipts.len());
            let mut rest: Vec<BrokerReceipt> = Vec::new();
            for r in receipts {
                let here = if lane.contains(r.event_id.as_str()) { None } else { stream_out.pop_front().flatten() };
                if here.is_none() {
                    rest.push(r.clone());
                }
                slots.push(here);
            }
            let mut chains = if rest.is_empty() { Vec::new() } else { Box::pin(self.accept_chains_receipts(&rest)).await? }.into_iter();
            return slots
                .into_iter()
                .map(|s| match s {
                    Some(o) => Ok(o),
                    None => chains.next().ok_or_else(|| StoreError::Backend { message: "the receipt transaction answered fewer receipts than asked".into(), retryable: false }),
                })
                .collect();
        }
        self.accept_chains_receipts(receipts).await
    }

    /// `acceptDispatchReceipt` on the chains path (and the lane).
    async fn accept_chains_receipts(&self, receipts: &[BrokerReceipt]) -> Result<Vec<ReceiptOutcome>, StoreError> {
        let now = self.now_ms();
        let mut ids: Vec<&str> = receipts.iter().map(|r| r.event_id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        let mut tx = self.begin().await?;
        let rows = sqlx::query(
            "SELECT e.event_id, e.envelope_generation, e.state, e.payload_digest, e.destination_digest, e.unknown_since_ms, v.destination_canonical
             FROM outbox_events e
             JOIN outbox_envelopes v ON v.event_id = e.event_id AND v.envelope_generation = e.envelope_generation
             WHERE e.event_id = ANY($1) ORDER BY e.event_id FOR UPDATE OF e",
        )
        .bind(&ids)
        .fetch_all(&mut *tx)
        .await
        .map_err(store_err)?;
        let mut events: HashMap<String, LockedEvent> = HashMap::with_capacity(rows.len());
        // Events that had been UNKNOWN: publishing one records its time to resolution.
        let mut unknown_since: HashMap<String, i64> = HashMap::new();
        for r in &rows {
            let g = |e: sqlx::Error| store_err(e);
            let id: String = r.try_get("event_id").map_err(g)?;
            if let Some(since) = r.try_get::<Option<i64>, _>("unknown_since_ms").map_err(g)? {
                unknown_since.insert(id.clone(), since);
            }
            events.insert(
                id.clone(),
                LockedEvent {
                    event_id: parse_id(&id)?,
                    envelope_generation: r.try_get::<i32, _>("envelope_generation").map_err(g)? as u32,
                    state: EventState::parse(r.try_get("state").map_err(g)?)?,
                    payload_digest: r.try_get("payload_digest").map_err(g)?,
                    destination_digest: r.try_get("destination_digest").map_err(g)?,
                    destination: Destination::from_canonical(r.try_get::<&[u8], _>("destination_canonical").map_err(g)?)?,
                    slot: None,
                },
            );
        }
        // The slot is filled in the same transaction that sets PUBLISHED, and
        // only RETAINED and PURGED follow: other events have an empty slot.
        // (Were that ever violated, filling the slot again would fail on its
        // primary key, not overwrite it.)
        let (filled, generations): (Vec<&str>, Vec<i32>) = events
            .values()
            .filter(|e| matches!(e.state, EventState::Published | EventState::Retained | EventState::Purged))
            .map(|e| (e.event_id.as_str(), e.envelope_generation as i32))
            .unzip();
        if !filled.is_empty() {
            // By primary key, the current generation's slot of each.
            let slots = sqlx::query(&format!(
                "SELECT {RECEIPT_COLUMNS} FROM outbox_publish_receipts
                 WHERE (event_id, envelope_generation) IN (SELECT * FROM UNNEST($1::text[], $2::int[]))"
            ))
            .bind(&filled)
            .bind(&generations)
            .fetch_all(&mut *tx)
            .await
            .map_err(store_err)?;
            for r in slots {
                let rec = receipt_from_row(&r)?;
                if let Some(ev) = events.get_mut(rec.event_id.as_str()) {
                    ev.slot = Some(rec);
                }
            }
        }
        let mut attempts: HashMap<String, Vec<AttemptRecord>> = HashMap::new();
        // The attempts the receipts name, by primary key: a receipt is
        // decided on its own attempt only. (By event id, `event_id = ANY`
        // over a few hundred ids of a never-analyzed table is estimated as
        // the whole table, and read so, once per batch.)
        let mut attempt_ids: Vec<&str> = receipts.iter().map(|r| r.attempt_id.as_str()).collect();
        attempt_ids.sort_unstable();
        attempt_ids.dedup();
        for r in sqlx::query(&format!("SELECT {ATTEMPT_COLUMNS} FROM outbox_attempts WHERE attempt_id = ANY($1)"))
            .bind(&attempt_ids)
            .fetch_all(&mut *tx)
            .await
            .map_err(store_err)?
        {
            let a = attempt_from_row(&r)?;
            attempts.entry(a.event_id.to_string()).or_default().push(a);
        }

        // Log positions of this batch already held by another event's primary
        // receipt: the log they were recorded in is gone (the cluster
        // replaced, or a topic without a recorded id recreated) and a new
        // message sits there now: offsets are unique within one log, and
        // this receipt is a genuine ACK or a message read back at its real
        // position. A position names its topic id: a receipt of a recreated
        // topic's new log (another id) does not collide with one of the old.
        // The new receipt is accepted one position epoch above the newest
        // receipt there (the old receipt stays, as the evidence it is), and
        // the old receipt's lost position is a finding.
        // Position -> (event of the newest receipt there, its epoch).
        let mut held: HashMap<Position, (String, i32)> = HashMap::new();
        {
            let clusters: Vec<&str> = receipts.iter().map(|r| r.cluster_id.as_str()).collect();
            let topics: Vec<&str> = receipts.iter().map(|r| r.topic.as_str()).collect();
            let topic_ids: Vec<Option<&str>> = receipts.iter().map(|r| r.topic_id.as_deref()).collect();
            let partitions: Vec<i32> = receipts.iter().map(|r| r.partition).collect();
            let offsets: Vec<i64> = receipts.iter().map(|r| r.offset).collect();
            for r in sqlx::query(
                "SELECT r.cluster_id, r.topic, r.topic_id, r.partition, r.\"offset\", r.event_id, r.position_epoch FROM outbox_publish_receipts r
                 JOIN UNNEST($1::text[], $2::text[], $3::int[], $4::bigint[], $5::text[]) AS t(c, tp, p, o, tid)
                   ON r.cluster_id = t.c AND r.topic = t.tp AND r.partition = t.p AND r.\"offset\" = t.o AND r.topic_id IS NOT DISTINCT FROM t.tid
                 ORDER BY r.position_epoch",
            )
            .persistent(false)
            .bind(&clusters)
            .bind(&topics)
            .bind(&partitions)
            .bind(&offsets)
            .bind(&topic_ids)
            .fetch_all(&mut *tx)
            .await
            .map_err(store_err)?
            {
                let g = |e: sqlx::Error| store_err(e);
                let position = (
                    r.try_get("cluster_id").map_err(g)?,
                    r.try_get("topic").map_err(g)?,
                    r.try_get("topic_id").map_err(g)?,
                    r.try_get("partition").map_err(g)?,
                    r.try_get("offset").map_err(g)?,
                );
                // In epoch order: the newest receipt at a position is the last one kept.
                held.insert(position, (r.try_get("event_id").map_err(g)?, r.try_get("position_epoch").map_err(g)?));
            }
        }
        // The position epoch of each accepted receipt, in `accepted` order.
        let mut epochs: Vec<i32> = Vec::new();
        let mut accepted: Vec<&BrokerReceipt> = Vec::new();
        let mut findings: Vec<(&'static str, String, String)> = Vec::new();
        let mut duplicates: Vec<&BrokerReceipt> = Vec::new();
        let mut acked_attempts: Vec<&str> = Vec::new();
        let mut outcomes = Vec::with_capacity(receipts.len());
        for receipt in receipts {
            let Some(ev) = events.get_mut(receipt.event_id.as_str()) else {
                Self::audit(&mut tx, receipt.event_id.as_str(), "acceptDispatchReceipt", "receipt_for_unknown_event", serde_json::to_value(receipt).unwrap_or_default(), now).await?;
                outcomes.push(Err(StoreError::NotFound(receipt.event_id.clone())));
                continue;
            };
            let list = attempts.entry(receipt.event_id.to_string()).or_default();
            let position = (receipt.cluster_id.clone(), receipt.topic.clone(), receipt.topic_id.clone(), receipt.partition, receipt.offset);
            let decision = decide_receipt(ev, list, receipt);
            let mut epoch = 0;
            if let Some((holder, holder_epoch)) = held.get(&position).filter(|h| h.0.as_str() != receipt.event_id.as_str()) {
                if matches!(decision, ReceiptDecision::Accept { .. }) {
                    epoch = outbox_core::compare::next_position_epoch(Some((holder.as_str(), *holder_epoch)), receipt.event_id.as_str());
                    tracing::error!(event_id = %receipt.event_id, holder = %holder, topic = %receipt.topic, partition = receipt.partition, offset = receipt.offset, epoch,
                        "a receipt's position is held by another event's receipt from a log that is gone: the old position is lost, the receipt accepted in the next position epoch");
                    findings.push((outbox_core::compare::RECEIPT_POSITION_LOST, holder.clone(), outbox_core::compare::position_taken_detail(receipt)));
                }
            }
            if matches!(decision, ReceiptDecision::Accept { .. }) {
                held.insert(position, (receipt.event_id.to_string(), epoch));
                epochs.push(epoch);
            }
            if outbox_core::refutes_absence(list, receipt, &decision) {
                tracing::warn!(event_id = %receipt.event_id, attempt_id = %receipt.attempt_id, offset = receipt.offset, "a message of an attempt proven absent is in the log: the proof was wrong");
                findings.push((
                    "absence_proof_refuted",
                    receipt.event_id.to_string(),
                    format!(
                        "attempt {} was closed ABSENT, yet its message is at {}/{}@{} ({})",
                        receipt.attempt_id,
                        receipt.topic,
                        receipt.partition,
                        receipt.offset,
                        if matches!(decision, ReceiptDecision::Accept { .. }) { "now the primary receipt" } else { "kept as a duplicate transport receipt" }
                    ),
                ));
            }
            if outbox_core::is_unregistered_message(&decision) {
                findings.push((
                    "unregistered_message",
                    receipt.event_id.to_string(),
                    format!("a message carrying the eventId at {}/{}@{} names attempt {}, which this event never registered (a mirror, a replay, a bypass)", receipt.topic, receipt.partition, receipt.offset, receipt.attempt_id),
                ));
            }
            match &decision {
                ReceiptDecision::Accept { from } => {
                    ev.state = from.transition(EventState::Published)?;
                    ev.slot = Some(receipt.clone());
                    accepted.push(receipt);
                    acked_attempts.push(receipt.attempt_id.as_str());
                    list.iter_mut().filter(|a| a.attempt_id == receipt.attempt_id).for_each(|a| a.state = AttemptState::Acked);
                }
                ReceiptDecision::AlreadyAccepted => {}
                ReceiptDecision::Duplicate => {
                    duplicates.push(receipt);
                    acked_attempts.push(receipt.attempt_id.as_str());
                    list.iter_mut().filter(|a| a.attempt_id == receipt.attempt_id).for_each(|a| a.state = AttemptState::Acked);
                }
                ReceiptDecision::Quarantine { reason, move_event } => {
                    if *move_event {
                        ev.state = ev.state.transition(EventState::Quarantined)?;
                        sqlx::query(
                            "UPDATE outbox_events SET state = 'QUARANTINED', claim_owner = NULL, lease_until_ms = NULL, unknown_since_ms = NULL,
                                    claim_generation = claim_generation + 1, state_since_ms = $2 WHERE event_id = $1",
                        )
                        .bind(receipt.event_id.as_str())
                        .bind(now)
                        .execute(&mut *tx)
                        .await
                        .map_err(store_err)?;
                        if let Some(since) = unknown_since.remove(receipt.event_id.as_str()) {
                            record_resolutions(&mut tx, &[(receipt.event_id.as_str(), since)], "QUARANTINED", now).await?;
                        }
                    }
                    sqlx::query(
                        "INSERT INTO outbox_quarantine (event_id, envelope_generation, attempt_id, reason, evidence, created_at_ms)
                         VALUES ($1, $2, $3, $4, $5, $6)",
                    )
                    .bind(receipt.event_id.as_str())
                    .bind(receipt.envelope_generation as i32)
                    .bind(receipt.attempt_id.as_str())
                    .bind(serde_json::to_value(reason).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default())
                    .bind(serde_json::json!({ "receipt": receipt, "frozenPayloadDigest": ev.payload_digest, "frozenDestinationDigest": ev.destination_digest }))
                    .bind(now)
                    .execute(&mut *tx)
                    .await
                    .map_err(store_err)?;
                    tracing::warn!(event_id = %receipt.event_id, ?reason, "receipt quarantined");
                }
                ReceiptDecision::Reject { reason } => {
                    Self::audit(&mut tx, receipt.event_id.as_str(), "acceptDispatchReceipt", "receipt_rejected", serde_json::json!({ "reason": reason, "receipt": receipt }), now)
                        .await?;
                }
            }
            outcomes.push(Ok(ReceiptOutcome { decision, primary: ev.slot.clone(), state: ev.state }));
        }

        if !accepted.is_empty() {
            let ev_ids: Vec<&str> = accepted.iter().map(|r| r.event_id.as_str()).collect();
            sqlx::query(
                "UPDATE outbox_events SET state = 'PUBLISHED', claim_owner = NULL, lease_until_ms = NULL, unknown_since_ms = NULL,
                        published_at_ms = $2, state_since_ms = $2
                 WHERE event_id = ANY($1)",
            )
            .bind(&ev_ids)
            .bind(now)
            .execute(&mut *tx)
            .await
            .map_err(store_err)?;
            let resolved: Vec<(&str, i64)> = ev_ids.iter().filter_map(|id| unknown_since.get(*id).map(|s| (*id, *s))).collect();
            record_resolutions(&mut tx, &resolved, "PUBLISHED", now).await?;
            insert_receipts(&mut tx, "outbox_publish_receipts", "accepted_at_ms", &accepted, Some(&epochs), now, "").await?;
        }
        if !duplicates.is_empty() {
            insert_receipts(
                &mut tx,
                "outbox_duplicate_receipts",
                "received_at_ms",
                &duplicates,
                None,
                now,
                "ON CONFLICT (event_id, envelope_generation, cluster_id, topic, topic_id, partition, \"offset\") DO NOTHING",
            )
            .await?;
        }
        record_findings(&mut tx, &findings, now).await?;
        if !acked_attempts.is_empty() {
            sqlx::query("UPDATE outbox_attempts SET state = 'ACKED', finished_at_ms = $2 WHERE attempt_id = ANY($1) AND state <> 'ACKED'")
                .bind(&acked_attempts)
                .bind(now)
                .execute(&mut *tx)
                .await
                .map_err(store_err)?;
        }
        tx.commit().await.map_err(store_err)?;
        outcomes.into_iter().collect()
    }
}

/// Records, for events that had been DISPATCH_UNKNOWN (`(event id, unknown
/// since)`), how and when their unknown outcome was resolved; nothing for
/// none.
async fn record_resolutions(tx: &mut Transaction<'_, Postgres>, resolved: &[(&str, i64)], outcome: &str, now: i64) -> Result<(), StoreError> {
    if resolved.is_empty() {
        return Ok(());
    }
    let (ids, since): (Vec<&str>, Vec<i64>) = resolved.iter().copied().unzip();
    sqlx::query(
        "INSERT INTO outbox_unknown_resolutions (event_id, unknown_since_ms, resolved_at_ms, outcome)
         SELECT event_id, since, $3, $4 FROM UNNEST($1::text[], $2::bigint[]) AS t(event_id, since)",
    )
    .bind(&ids)
    .bind(&since)
    .bind(now)
    .bind(outcome)
    .execute(&mut **tx)
    .await
    .map_err(store_err)?;
    Ok(())
}

/// Inserts `receipts` into `table` with `now` in `at_column`; with `epochs`
/// (one per receipt) into its `position_epoch` too.
async fn insert_receipts(
    tx: &mut Transaction<'_, Postgres>,
    table: &str,
    at_column: &str,
    receipts: &[&BrokerReceipt],
    epochs: Option<&[i32]>,
    now: i64,
    conflict: &str,
) -> Result<(), StoreError> {
    let ev: Vec<&str> = receipts.iter().map(|r| r.event_id.as_str()).collect();
    let gen: Vec<i32> = receipts.iter().map(|r| r.envelope_generation as i32).collect();
    let att: Vec<&str> = receipts.iter().map(|r| r.attempt_id.as_str()).collect();
    let pd: Vec<&str> = receipts.iter().map(|r| r.payload_digest.as_str()).collect();
    let dd: Vec<&str> = receipts.iter().map(|r| r.destination_digest.as_str()).collect();
    let cl: Vec<&str> = receipts.iter().map(|r| r.cluster_id.as_str()).collect();
    let tp: Vec<&str> = receipts.iter().map(|r| r.topic.as_str()).collect();
    let ti: Vec<Option<&str>> = receipts.iter().map(|r| r.topic_id.as_deref()).collect();
    let pa: Vec<i32> = receipts.iter().map(|r| r.partition).collect();
    let of: Vec<i64> = receipts.iter().map(|r| r.offset).collect();
    let ky: Vec<Option<&[u8]>> = receipts.iter().map(|r| r.key.as_deref()).collect();
    let li: Vec<Option<&str>> = receipts.iter().map(|r| r.log_id.as_deref()).collect();
    let (epoch_column, epoch_values) = match epochs {
        Some(_) => (", position_epoch", ", $14::int[]"),
        None => ("", ""),
    };
    let sql = format!(
        "INSERT INTO {table} ({RECEIPT_COLUMNS}{epoch_column}, {at_column})
         SELECT *, $11 FROM UNNEST($1::text[], $2::int[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[], $9::int[], $10::bigint[], $12::bytea[], $13::text[]{epoch_values})
         {conflict}"
    );
    let query = sqlx::query(&sql)
    .bind(&ev)
    .bind(&gen)
    .bind(&att)
    .bind(&pd)
    .bind(&dd)
    .bind(&cl)
    .bind(&tp)
    .bind(&ti)
    .bind(&pa)
    .bind(&of)
    .bind(now)
    .bind(&ky)
    .bind(&li);
    let query = match epochs {
        Some(e) => query.bind(e),
        None => query,
    };
    query
    .execute(&mut **tx)
    .await
    .map_err(store_err)?;
    Ok(())
}
