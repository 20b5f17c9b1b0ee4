//! The decision transaction: claims, duplicates, quarantine, the handler's
//! results, and the watermarks it moves.

use std::collections::HashSet;

use chrono::Utc;
use outbox_core::headers;
use serde_json::{json, Value};
use tracing::{error, warn};

use super::verify::bytes_json;
use super::{position, Fail, Prepared, Processor};
use crate::error::ConsumerError;
use crate::event::{headers_json, ConsumedEvent, RawMessage, MAX_EVIDENCE_HEADER_BYTES};
use crate::gap::{capped_watermark, decide_reading, decide_reading_in_log, OffsetGap};
use crate::metrics::Metrics;
use crate::outcome::{DeadLettered, Outcome, Quarantined, QuarantineReason, Receipt};
use crate::store::{Claim, ConsumerStore, QuarantineRow, WatermarkAdvance};

/// A message to quarantine: the message, its record, the evidence, and
/// the topic id it counts under ([`topic_id_of`]).
type Quarantine<'a> = (&'a RawMessage, Quarantined, Value, Option<String>);

/// Per-transaction counts for one watermark row.
#[derive(Default)]
pub(super) struct Counts {
    applied: i64,
    pub(super) duplicates: i64,
    quarantined: i64,
    pub(super) dead_lettered: i64,
    last_event_id: Option<String>,
    /// The last offset of a message counted here.
    last_offset: i64,
    /// The event of the highest offset decided as a genuine message of it
    /// (applied, answered with its receipt, dead-lettered): the watermark's
    /// anchor when that offset is the last one counted.
    anchor: Option<(i64, String)>,
}

impl Counts {
    /// Notes `event_id` as the genuine message decided at `offset`.
    pub(super) fn decided(&mut self, offset: i64, event_id: &str) {
        if self.anchor.as_ref().is_none_or(|(o, _)| offset >= *o) {
            self.anchor = Some((offset, event_id.to_owned()));
        }
    }
}

/// Gaps found in a transaction, reported once it committed.
pub(super) type Found = Vec<OffsetGap>;

/// Per-transaction counts for the watermarks of a partition: one row per
/// topic id the decided messages name (see [`topic_id_of`]), in order of
/// first appearance. Each row moves to the last offset of a message with
/// its id, plus one.
#[derive(Default)]
pub(super) struct Tally(Vec<(Option<String>, Counts)>, Vec<i64>);

impl Tally {
    /// A tally of one message.
    pub(super) fn one(topic_id: Option<&str>, offset: i64, f: impl FnOnce(&mut Counts)) -> Tally {
        let mut t = Tally::default();
        f(t.of(topic_id, offset));
        t
    }

    /// The counts of `topic_id`, with `offset` noted as a message of it.
    fn of(&mut self, topic_id: Option<&str>, offset: i64) -> &mut Counts {
        self.1.push(offset);
        let i = match self.0.iter().position(|(t, _)| t.as_deref() == topic_id) {
            Some(i) => i,
            None => {
                self.0.push((topic_id.map(str::to_owned), Counts { last_offset: offset, ..Counts::default() }));
                self.0.len() - 1
            }
        };
        let c = &mut self.0[i].1;
        c.last_offset = c.last_offset.max(offset);
        c
    }
}

/// The topic id of the log a message is a position of, as far as the
/// message tells: the one its verified destination names, else the one its
/// `outbox-destination` header names when that parses (a quarantined
/// message), else none (`destination.v1`, or no readable destination).
fn topic_id_of(p: &Prepared<'_>) -> Option<String> {
    match p {
        Prepared::Event { event, .. } => event.topic_id.clone(),
        Prepared::Bad { msg, .. } => msg
            .headers
            .iter()
            .rev()
            .find(|(k, _)| k == headers::DESTINATION)
            .and_then(|(_, v)| outbox_core::Destination::from_canonical(v).ok())
            .and_then(|d| d.topic_id),
    }
}

impl<S: ConsumerStore> Processor<S> {
    /// The body of a decision transaction, without begin and commit.
    pub(super) async fn decide_in(&self, tx: &mut S::Tx, slice: &[Prepared<'_>]) -> Result<Result<(Vec<Outcome>, Found), Fail>, ConsumerError> {
        let Some(last) = slice.last() else {
            return Ok(Ok((Vec::new(), Vec::new())));
        };
        let last_msg = last.msg();
        // First occurrence of each eventId in the slice: the one that may be claimed.
        let mut seen = HashSet::new();
        let firsts: Vec<&ConsumedEvent> = slice
            .iter()
            .filter_map(|p| match p {
                Prepared::Event { event, .. } if seen.insert(event.event_id.as_str()) => Some(event),
                _ => None,
            })
            .collect();
        let mut claims = if outbox_core::simulation::mutation_active("consumer-skips-receipt") {
            // The deliberate defect: the handler runs without the
            // `(consumerId, eventId)` receipt being claimed (or written).
            firsts.iter().map(|e| (e.event_id.as_str().to_owned(), Claim::New(Utc::now()))).collect()
        } else {
            self.store.claim(tx, &self.consumer_id, self.cluster_id(), &firsts).await?
        };
        let earlier: Vec<&str> = firsts.iter().map(|e| e.event_id.as_str()).filter(|id| !claims.contains_key(*id)).collect();
        let mut receipts = self.store.receipts(tx, &self.consumer_id, &earlier).await?;
        if outbox_core::simulation::mutation_active("redelivery-reapplied") {
            // The deliberate defect: a redelivery is applied again instead
            // of being answered with its receipt.
            for id in receipts.keys() {
                claims.insert(id.clone(), Claim::New(Utc::now()));
            }
            receipts.clear();
        }
        let mut dead_ids: Vec<&str> = claims.iter().filter(|(_, c)| matches!(c, Claim::Dead)).map(|(id, _)| id.as_str()).collect();
        dead_ids.sort_unstable();
        let dead = self.store.dead_letters(tx, &self.consumer_id, &dead_ids).await?;

        let mut outs = Vec::with_capacity(slice.len());
        let mut tally = Tally::default();
        let mut results: Vec<(String, Value)> = Vec::new();
        let mut quarantine: Vec<Quarantine<'_>> = Vec::new();
        for (index, p) in slice.iter().enumerate() {
            let topic_id = topic_id_of(p);
            // Every message decided moves the watermark of its topic id.
            let counts = tally.of(topic_id.as_deref(), p.msg().offset);
            let (msg, event) = match p {
                Prepared::Bad { msg, quarantined, evidence } => {
                    quarantine.push((msg, quarantined.clone(), evidence.clone(), topic_id));
                    outs.push(Outcome::Quarantined(quarantined.clone()));
                    continue;
                }
                Prepared::Event { msg, event } => (*msg, event),
            };
            let id = event.event_id.as_str();
            if let Some(original) = receipts.get(id) {
                if original.payload_digest == event.payload_digest {
                    counts.duplicates += 1;
                    counts.decided(msg.offset, id);
                    outs.push(Outcome::Duplicate { original: original.clone(), delivery: position(msg) });
                } else {
                    let q = Quarantined {
                        position: position(msg),
                        event_id: Some(id.to_owned()),
                        reason: QuarantineReason::DivergentDuplicate { receipt_digest: original.payload_digest.clone(), message_digest: event.payload_digest.clone() },
                        payload_digest: event.payload_digest.clone(),
                    };
                    let evidence = json!({
                        "error": "eventId already applied with other payload bytes",
                        "receipt": original,
                        "headers": headers_json(&msg.headers, MAX_EVIDENCE_HEADER_BYTES),
                        "key": bytes_json(msg.key.as_deref()),
                        "payloadBytes": event.payload.len(),
                    });
                    quarantine.push((msg, q.clone(), evidence, topic_id));
                    outs.push(Outcome::Quarantined(q));
                }
                continue;
            }
            match claims.get(id) {
                Some(Claim::Dead) => {
                    counts.duplicates += 1;
                    counts.decided(msg.offset, id);
                    let (attempts, error) = dead.get(id).cloned().unwrap_or((0, String::new()));
                    outs.push(Outcome::DeadLettered(DeadLettered { event_id: event.event_id.clone(), position: position(msg), attempts, error, redelivery: true }));
                }
                Some(Claim::New(received_at)) => match self.run_handler(tx, event).await {
                    Ok(result) => {
                        let receipt = Receipt {
                            consumer_id: self.consumer_id.clone(),
                            event_id: event.event_id.clone(),
                            envelope_generation: event.envelope_generation,
                            event_type: event.event_type.clone(),
                            position: position(msg),
                            topic_id: event.topic_id.clone(),
                            payload_digest: event.payload_digest.clone(),
                            result: result.clone(),
                            received_at: *received_at,
                        };
                        results.push((id.to_owned(), result));
                        counts.applied += 1;
                        counts.last_event_id = Some(id.to_owned());
                        counts.decided(msg.offset, id);
                        receipts.insert(id.to_owned(), receipt.clone());
                        outs.push(Outcome::Applied { receipt });
                    }
                    Err(error) => return Ok(Err(Fail::Handler { index, error })),
                },
                None => {
                    // Neither claimed, nor dead, nor an earlier receipt: the
                    // receipt was removed between the claim and the read.
                    return Err(ConsumerError::CorruptRow(format!("receipt of {id} vanished during the batch")));
                }
            }
        }
        match self.record(tx, last_msg, &results, &quarantine, tally).await {
            Ok(found) => Ok(Ok((outs, found))),
            Err(e) if e.is_aborted_transaction() && !results.is_empty() => Ok(Err(Fail::Aborted)),
            Err(e) => Err(e),
        }
    }

    /// Stores handler results, quarantine rows and the watermark.
    async fn record(&self, tx: &mut S::Tx, last: &RawMessage, results: &[(String, Value)], quarantine: &[Quarantine<'_>], mut tally: Tally) -> Result<Found, ConsumerError> {
        self.store.store_results(tx, &self.consumer_id, results).await?;
        if !quarantine.is_empty() {
            let rows: Vec<QuarantineRow<'_>> = quarantine
                .iter()
                .map(|(msg, q, e, _)| {
                    let mut evidence = e.clone();
                    evidence["reason"] = serde_json::to_value(&q.reason).unwrap_or(Value::Null);
                    QuarantineRow { msg, quarantined: q.clone(), evidence }
                })
                .collect();
            let inserted = self.store.quarantine(tx, &self.consumer_id, &rows, self.max_evidence_payload_bytes).await?;
            for (m, _, _, topic_id) in quarantine {
                let c = tally.of(topic_id.as_deref(), m.offset);
                if inserted.contains(&m.offset) {
                    c.quarantined += 1;
                } else {
                    // A quarantined position seen again is a redelivery.
                    c.duplicates += 1;
                }
            }
        }
        self.advance_watermarks(tx, last, &tally).await
    }

    /// Moves the partition's watermark rows, one per topic id in `tally`:
    /// each to the last offset of a message of its id, plus one (never
    /// back), adding its counts, but never past the start of a gap in what
    /// this consumer read (module [`gap`](crate::gap)): answers the gaps this
    /// transaction found.
    pub(super) async fn advance_watermarks(&self, tx: &mut S::Tx, at: &RawMessage, tally: &Tally) -> Result<Found, ConsumerError> {
        let (cluster, topic, partition) = (self.cluster_id(), &at.topic, at.partition);
        let stored = self.store.reading(tx, &self.consumer_id, cluster, topic, partition).await?;
        let mut change = if outbox_core::simulation::mutation_active("replaced-log-read-as-continuous") {
            // The deliberate defect: the reading goes on across a replaced
            // log, as if the new log's offsets continued the old one's.
            decide_reading(&stored, &tally.1)
        } else {
            decide_reading_in_log(&stored, at.log_id.as_deref(), &tally.1)
        };
        if change.new_log {
            warn!(consumer = %self.consumer_id, cluster = %cluster, topic = %topic, partition, old_log = ?stored.log_id, new_log = ?at.log_id,
                "the partition's log was replaced (the topic was created again, or the cluster replaced): this consumer's reading and watermark start over in the new log");
        }
        if outbox_core::simulation::mutation_active("watermark-passes-gaps") {
            // The deliberate defect: the watermark moves to the last offset
            // decided plus one, past a range this consumer never read.
            change.watermark_cap = None;
        }
        if change.new_log || change.log_id != stored.log_id || stored.next_offset != Some(change.next_offset) || !change.opened.is_empty() || !change.shrunk.is_empty() {
            self.store.save_reading(tx, &self.consumer_id, cluster, topic, partition, &change).await?;
        }
        let rows: Vec<WatermarkAdvance> = tally
            .0
            .iter()
            .map(|(topic_id, c)| {
                let committed_offset = capped_watermark(c.last_offset.saturating_add(1), change.watermark_cap);
                // The anchor: the event of the message just below the new
                // watermark, when this transaction decided it as genuine.
                let anchor_event_id = c.anchor.as_ref().filter(|(o, _)| o.saturating_add(1) == committed_offset).map(|(_, id)| id.clone());
                WatermarkAdvance {
                    topic_id: topic_id.clone(),
                    log_id: change.log_id.clone(),
                    committed_offset,
                    applied: c.applied,
                    duplicates: c.duplicates,
                    quarantined: c.quarantined,
                    dead_lettered: c.dead_lettered,
                    last_event_id: c.last_event_id.clone(),
                    anchor_event_id,
                }
            })
            .collect();
        self.store.advance_watermarks(tx, &self.consumer_id, cluster, topic, partition, &rows).await?;
        Ok(change.opened)
    }

    /// Says, once the transaction that found them committed, which ranges of
    /// a partition this consumer skipped: an error line each and the
    /// `offset_gaps` counters.
    pub(super) fn report_gaps(&self, topic: &str, partition: i32, found: &[OffsetGap]) {
        for g in found {
            Metrics::add(&self.metrics.offset_gaps, 1);
            Metrics::add(&self.metrics.offset_gap_offsets, g.len().max(0) as u64);
            error!(consumer = %self.consumer_id, cluster = %self.cluster_id(), topic, partition, from_offset = g.from_offset, to_offset = g.to_offset,
                "offsets skipped: this consumer never read [from_offset, to_offset) of the partition (the group was reset, its offset fell out of range, or it started past the log's start); its watermark stays at from_offset until the range is replayed or the gap accepted (docs/OPERATIONS.md, \"A consumer gap\")");
        }
    }
}
