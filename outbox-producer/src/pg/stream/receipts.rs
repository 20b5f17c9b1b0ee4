//! Receipts of stream events (PROTOCOL §5): a genuine ACK of a registered
//! attempt fills the publish slot, one insert; every other receipt moves
//! its event to the lane, where the chains path's receipt transaction
//! decides it (duplicates, divergent copies, lost positions, refusals).

use std::collections::{BTreeSet, HashMap};

use outbox_core::stream::{batch_attempt_id, batch_position};
use outbox_core::{decide_receipt, AttemptRecord, AttemptState, BrokerReceipt, Destination, EventState, LockedEvent, ReceiptDecision, ReceiptOutcome, StoreError};
use sqlx::Row;

use super::claims::{destination_digests, load_batches};
use super::lane::move_to_lane;
use super::registration::{batch_events, in_lane, lock_leases, moves_for};
use crate::error::store_err;
use crate::pg::rows::{parse_id, receipt_from_row, RECEIPT_COLUMNS};
use sqlx::{Postgres, Transaction};
use crate::pg::PgStore;

impl PgStore {
    /// Decides `receipts` of events that have a stream row and no lane
    /// row: `Some(outcome)` where the stream decided it, `None` where the
    /// event was moved to the lane for the chains path to decide.
    pub(crate) async fn accept_stream_receipts(&self, receipts: &[&BrokerReceipt]) -> Result<Vec<Option<ReceiptOutcome>>, StoreError> {
        // The slot's insert is a plain insert first: arbitrating a conflict
        // (`ON CONFLICT`) costs about a third of the insert, and a conflict
        // is rare (a receipt racing another for the same slot, or a
        // position another event's receipt holds: a replaced log). A plain
        // insert that meets one fails the transaction, which is then run
        // again whole with the arbitrating insert, which decides it.
        match self.accept_stream_receipts_as(receipts, SlotInsert::Plain).await? {
            Some(out) => Ok(out),
            None => {
                tracing::debug!(receipts = receipts.len(), "a stream receipt met another in its slot or position: deciding the batch again with ON CONFLICT");
                self.accept_stream_receipts_as(receipts, SlotInsert::Arbitrated)
                    .await?
                    .ok_or_else(|| StoreError::Backend { message: "an arbitrated receipt insert reported a conflict".into(), retryable: true })
            }
        }
    }

    /// [`Self::accept_stream_receipts`] with the slot's insert `how`: `None`
    /// when a plain insert met a conflict (nothing was written).
    async fn accept_stream_receipts_as(&self, receipts: &[&BrokerReceipt], how: SlotInsert) -> Result<Option<Vec<Option<ReceiptOutcome>>>, StoreError> {
        let now = self.now_ms();
        let g = |e: sqlx::Error| store_err(e);
        let mut tx = self.begin().await?;
        let batch_ids: Vec<i64> = receipts.iter().map(|r| batch_position(&r.attempt_id).0 as i64).collect::<BTreeSet<_>>().into_iter().collect();
        // The leases first (shared): a takeover, which moves a batch's
        // events to the lane, waits for this transaction, or this for it.
        let leases = lock_leases(&mut tx, &batch_ids, false).await?;
        let ids: Vec<&str> = receipts.iter().map(|r| r.event_id.as_str()).collect();
        let lane = in_lane(&mut tx, &ids).await?;
        // The steps say what each attempt may be; receipts and lane rows are read below.
        let mut batches = load_batches(&mut tx, &batch_ids, false).await?;
        let mut frozen: HashMap<String, (String, String, Destination)> = HashMap::new();
        for r in sqlx::query("SELECT event_id, payload_digest, destination_digest, destination_canonical FROM outbox_stream WHERE event_id = ANY($1)")
            .bind(&ids)
            .fetch_all(&mut *tx)
            .await
            .map_err(g)?
        {
            frozen.insert(
                r.try_get("event_id").map_err(g)?,
                (r.try_get("payload_digest").map_err(g)?, r.try_get("destination_digest").map_err(g)?, Destination::from_canonical(r.try_get::<&[u8], _>("destination_canonical").map_err(g)?)?),
            );
        }
        let mut slots: HashMap<String, BrokerReceipt> = HashMap::new();
        for r in sqlx::query(&format!("SELECT {RECEIPT_COLUMNS} FROM outbox_publish_receipts WHERE event_id = ANY($1) AND envelope_generation = 1"))
            .bind(&ids)
            .fetch_all(&mut *tx)
            .await
            .map_err(g)?
        {
            let rec = receipt_from_row(&r)?;
            slots.insert(rec.event_id.to_string(), rec);
        }

        let mut out: Vec<Option<ReceiptOutcome>> = Vec::with_capacity(receipts.len());
        let mut accepted: Vec<(&BrokerReceipt, i64)> = Vec::new();
        let mut to_lane: Vec<(&str, i64, usize)> = Vec::new();
        let mut lane_bound: BTreeSet<String> = BTreeSet::new();
        for r in receipts {
            let id = r.event_id.as_str();
            let (batch_id, index) = batch_position(&r.attempt_id);
            let batch = batches.get(&(batch_id as i64)).filter(|b| b.event_ids.get(index).is_some_and(|e| e == id));
            let Some((payload_digest, destination_digest, destination)) = frozen.get(id) else {
                out.push(None);
                continue;
            };
            if lane.contains(id) || lane_bound.contains(id) {
                out.push(None);
                continue;
            }
            let facts = batch.map(|b| b.facts[index]).unwrap_or_default();
            let genuine = batch.filter(|b| facts.registered && batch_attempt_id(b.id as u64, index, b.cut_at_ms.max(0) as u64).is_ok_and(|a| a == r.attempt_id));
            let slot = slots.get(id).cloned();
            let state = if slot.is_some() { EventState::Published } else if facts.registered { EventState::Sending } else if facts.handed { EventState::Claimed } else { EventState::Pending };
            let state_of_attempt = if slot.is_some() { AttemptState::Acked } else { AttemptState::Sending };
            let attempts: Vec<AttemptRecord> =
                genuine.map(|b| b.attempt_record(index, id, destination_digest.clone(), state_of_attempt, None)).transpose()?.into_iter().collect();
            let event = LockedEvent {
                event_id: r.event_id.clone(),
                envelope_generation: 1,
                state,
                payload_digest: payload_digest.clone(),
                destination: destination.clone(),
                destination_digest: destination_digest.clone(),
                slot: slot.clone(),
            };
            match decide_receipt(&event, &attempts, r) {
                ReceiptDecision::Accept { .. } if accepted.iter().all(|(a, _)| a.event_id != r.event_id) => {
                    accepted.push((r, batch_id as i64));
                    out.push(Some(ReceiptOutcome { decision: ReceiptDecision::Accept { from: state }, primary: Some((*r).clone()), state: EventState::Published }));
                }
                d @ ReceiptDecision::AlreadyAccepted => out.push(Some(ReceiptOutcome { decision: d, primary: slot, state: EventState::Published })),
                ReceiptDecision::Reject { reason } if batch.is_none() => {
                    // An attempt no batch registered for this event: refused
                    // and audited, the event left where it is.
                    Self::audit(&mut tx, id, "acceptDispatchReceipt", "receipt_rejected", serde_json::json!({ "reason": reason, "receipt": r }), now).await?;
                    let state = outbox_state(&mut tx, id).await?;
                    out.push(Some(ReceiptOutcome { decision: ReceiptDecision::Reject { reason }, primary: slot, state }));
                }
                _ => {
                    // Decided in the lane, where the event goes in the state
                    // its batch gave it.
                    lane_bound.insert(id.to_owned());
                    to_lane.push((id, batch_id as i64, index));
                    out.push(None);
                }
            }
        }

        // The slot: one insert per receipt. A position another receipt
        // holds is not taken here: that receipt goes to the lane.
        if !accepted.is_empty() {
            let a: Vec<&BrokerReceipt> = accepted.iter().map(|x| x.0).collect();
            let inserted: Result<Vec<String>, sqlx::Error> = sqlx::query_scalar(how.sql())
            .bind(a.iter().map(|r| r.event_id.as_str()).collect::<Vec<_>>())
            .bind(a.iter().map(|r| r.envelope_generation as i32).collect::<Vec<_>>())
            .bind(a.iter().map(|r| r.attempt_id.as_str()).collect::<Vec<_>>())
            .bind(a.iter().map(|r| r.payload_digest.as_str()).collect::<Vec<_>>())
            .bind(a.iter().map(|r| r.destination_digest.as_str()).collect::<Vec<_>>())
            .bind(a.iter().map(|r| r.cluster_id.as_str()).collect::<Vec<_>>())
            .bind(a.iter().map(|r| r.topic.as_str()).collect::<Vec<_>>())
            .bind(a.iter().map(|r| r.topic_id.as_deref()).collect::<Vec<_>>())
            .bind(a.iter().map(|r| r.partition).collect::<Vec<_>>())
            .bind(a.iter().map(|r| r.offset).collect::<Vec<_>>())
            .bind(a.iter().map(|r| r.key.as_deref()).collect::<Vec<_>>())
            .bind(now)
            .bind(accepted.iter().map(|x| x.1).collect::<Vec<_>>())
            .bind(a.iter().map(|r| r.log_id.as_deref()).collect::<Vec<_>>())
            .fetch_all(&mut *tx)
            .await;
            let inserted: BTreeSet<String> = match inserted {
                Err(e) if how == SlotInsert::Plain && e.as_database_error().and_then(|d| d.code()).as_deref() == Some("23505") => return Ok(None),
                r => r.map_err(g)?.into_iter().collect(),
            };
            for (i, r) in receipts.iter().enumerate() {
                let was_accepted = matches!(out[i], Some(ReceiptOutcome { decision: ReceiptDecision::Accept { .. }, .. }));
                if was_accepted && !inserted.contains(r.event_id.as_str()) {
                    out[i] = None;
                    let (batch_id, index) = batch_position(&r.attempt_id);
                    to_lane.push((r.event_id.as_str(), batch_id as i64, index));
                }
            }
        }

        // The rest to the lane, in the state the stream gave them (which
        // needs where each event of their batches stands).
        if !to_lane.is_empty() {
            batches = load_batches(&mut tx, &batch_ids, true).await?;
        }
        let mut moves = Vec::new();
        if !to_lane.is_empty() {
            let digests = destination_digests(&mut tx, &batch_events(batches.values())).await?;
            for (_, batch_id, index) in to_lane {
                if let Some(b) = batches.get(&batch_id) {
                    moves.extend(moves_for(b, index, leases.get(&batch_id), &digests)?);
                }
            }
        }
        move_to_lane(&mut tx, &moves, now).await?;
        tx.commit().await.map_err(store_err)?;
        Ok(Some(out))
    }
}

/// How a receipt transaction inserts its slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotInsert {
    /// A plain insert: a conflict fails the statement (and the transaction).
    Plain,
    /// `ON CONFLICT DO NOTHING`: a receipt that meets a taken slot or
    /// position is not inserted, and goes to the lane.
    Arbitrated,
}

/// The slots' insert, one row per accepted receipt, answering the events
/// inserted; `$conflict` is what the two forms differ by.
macro_rules! insert_slots {
    ($conflict:literal) => {
        concat!(
            "INSERT INTO outbox_publish_receipts (event_id, envelope_generation, attempt_id, payload_digest, destination_digest, cluster_id, topic,
      topic_id, partition, \"offset\", message_key, accepted_at_ms, batch_id, log_id)
 SELECT t.e, t.g, t.a, t.pd, t.dd, t.c, t.tp, t.ti, t.p, t.o, t.k, $12, t2.batch_id, t.li FROM UNNEST($1::text[], $2::int[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[],
                                        $9::int[], $10::bigint[], $11::bytea[], $14::text[]) WITH ORDINALITY AS t(e, g, a, pd, dd, c, tp, ti, p, o, k, li, n)
 JOIN UNNEST($13::bigint[]) WITH ORDINALITY AS t2(batch_id, n) USING (n) ",
            $conflict,
            " RETURNING event_id"
        )
    };
}

impl SlotInsert {
    /// Its statement.
    fn sql(self) -> &'static str {
        match self {
            SlotInsert::Plain => insert_slots!(""),
            SlotInsert::Arbitrated => insert_slots!("ON CONFLICT DO NOTHING"),
        }
    }
}

/// One event's state, wherever it lives (`outbox_event_state`).
pub(crate) async fn outbox_state(tx: &mut Transaction<'static, Postgres>, id: &str) -> Result<EventState, StoreError> {
    let s: Option<String> = sqlx::query_scalar("SELECT outbox_event_state($1)").bind(id).fetch_one(&mut **tx).await.map_err(store_err)?;
    match s {
        Some(s) => Ok(EventState::parse(&s)?),
        None => Err(StoreError::NotFound(parse_id(id)?)),
    }
}
