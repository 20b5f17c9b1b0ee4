//! The reconciler's bypass scan: the [`ScanLog`] broker a scenario fills,
//! what a scan left ([`ScanOutcome`]), and the scenario judging every
//! message of a page.

use async_trait::async_trait;

use outbox_core::canonical::sha256_digest;
use outbox_core::id::EventId;
use outbox_core::receipt::{AttemptRecord, BrokerReceipt, ReceiptDecision};
use outbox_core::reconcile::{decide_reconcile, ReconcileDecision};
use outbox_core::state::EventState;
use outbox_core::store::{ClaimedEvent, LookupOutcome, OutboxStore};

use super::ctx::{ensure, eq, err, receipt, Ctx};
use super::{Harness, Verdict, LEASE_MS, POLICY};

/// A broker whose topic holds only the messages a scenario put there, per
/// partition (each page ends just past its last offset); other partitions
/// and topics cannot be read. For the bypass scan ([`Harness::bypass_scan`]).
#[derive(Debug, Clone, Default)]
pub struct ScanLog {
    /// Its cluster.
    pub cluster_id: String,
    /// Its topic.
    pub topic: String,
    /// Messages per partition, in offset order.
    pub partitions: std::collections::BTreeMap<i32, Vec<outbox_core::store::ScannedMessage>>,
    /// Per partition, the log's start where retention moved it (else 0):
    /// a scan reads nothing below it.
    pub starts: std::collections::BTreeMap<i32, i64>,
}

#[async_trait]
impl outbox_core::store::Broker for ScanLog {
    fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    async fn send(&self, _message: outbox_core::store::OutgoingMessage) -> outbox_core::store::SendOutcome {
        outbox_core::store::SendOutcome::NotPersisted("a scan log takes no sends".into())
    }

    fn supports_lookup(&self) -> bool {
        false
    }

    async fn lookup(&self, _destination: &outbox_core::envelope::Destination, _event_id: &EventId, _from: &outbox_core::reconcile::ScanFrom) -> LookupOutcome {
        LookupOutcome::Unavailable("a scan log answers no lookups".into())
    }

    async fn scan_event_ids(&self, topic: &str, partition: i32, from_offset: i64, max_messages: u64) -> Result<outbox_core::store::PartitionScan, String> {
        let Some(log) = self.partitions.get(&partition).filter(|_| topic == self.topic) else { return Err(format!("{topic}/{partition} is not in the scan log")) };
        let start = self.starts.get(&partition).copied().unwrap_or(0);
        let end = log.last().map_or(0, |m| m.offset + 1).max(start);
        let from = from_offset.max(start);
        let messages: Vec<_> = log.iter().filter(|m| m.offset >= from).take(usize::try_from(max_messages).unwrap_or(usize::MAX)).cloned().collect();
        let next_offset = if messages.len() as u64 == max_messages { messages.last().map_or(from, |m| m.offset + 1) } else { from.max(end) };
        Ok(outbox_core::store::PartitionScan { messages, next_offset, log_end: Some(end), log_start: Some(start) })
    }
}

/// The message a claimed event's attempt wrote at `offset`, as a scan reads it.
fn scanned(ce: &ClaimedEvent, attempt: &AttemptRecord, offset: i64, payload: &[u8]) -> outbox_core::store::ScannedMessage {
    outbox_core::store::ScannedMessage {
        offset,
        event_id: Some(ce.envelope.event_id.to_string()),
        key: Some(ce.destination.routing_key.clone().into_bytes()),
        payload_digest: sha256_digest(payload),
        source: None,
        attempt_id: Some(attempt.attempt_id.to_string()),
        topic_id: ce.destination.topic_id.clone(),
        receipt: Some(BrokerReceipt { payload_digest: sha256_digest(payload), ..receipt(ce, attempt, offset) }),
    }
}

/// What one bypass scan of [`Harness::bypass_scan`] left.
#[derive(Debug, Clone, Default)]
pub struct ScanOutcome {
    /// The findings it recorded: (kind, event id).
    pub findings: Vec<(String, String)>,
    /// The store's scan cursor of each partition after it.
    pub cursors: std::collections::BTreeMap<i32, i64>,
    /// Copies it handed to the receipt transaction.
    pub submitted: usize,
}

/// The bypass scan's judgement of a page (`outbox_core::compare`), on both
/// stores through the shipped reconciler: a primary or duplicate receipt's
/// position is accounted; a copy with other bytes of a published event at
/// a position no receipt records is `divergent_copy`; a message of an event not published yet is left to
/// the reconciler; an unknown eventId is `bypass_publish`; a copy of an
/// open attempt within its in-flight bound is waited for (the cursor stays
/// at it) and, byte-identical, is `unrecorded_copy` once past it.
pub(super) async fn bypass_scan_judgement<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    // A: published at offset 1; a copy with other bytes at 3.
    let a = c.emit(1, "a").await;
    let ce_a = c.claim_some("w1", &a).await?;
    let a1 = c.register(&ce_a.token).await?;
    eq("A's ACK", c.accept(&receipt(&ce_a, &a1, c.offset(1))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    // B: a late ACK of its first attempt (offset 4) published it while its
    // retry is still open (SENDING, within its bound); the first attempt's
    // second copy (offset 6) is a duplicate receipt; the retry's copy at 5 has none.
    let b = c.emit(2, "b").await;
    let ce_b1 = c.claim_some("w1", &b).await?;
    let b1 = c.register(&ce_b1.token).await?;
    c.expire().await?;
    c.h.advance_ms(POLICY.in_flight_bound_ms);
    let task = c.reconcile("r1", &b).await?;
    let d = decide_reconcile(&task.attempts, &LookupOutcome::Unavailable("adapter cannot look up".into()), false, &POLICY, c.h.now_ms());
    eq("B's reconcile decision", &d, &ReconcileDecision::Retry { proven_absent: false })?;
    c.s().finish_reconcile(&task.token, &d).await.map_err(err("finish_reconcile"))?;
    let ce_b2 = c.claim_retry("w2", &b).await?;
    let b2 = c.register(&ce_b2.token).await?;
    eq("B's first attempt's late ACK", c.accept(&receipt(&ce_b1, &b1, c.offset(4))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    eq("B's first attempt's second copy", c.accept(&receipt(&ce_b1, &b1, c.offset(6))).await?, ReceiptDecision::Duplicate)?;
    // C: committed, not published.
    let pending = c.emit(3, "c").await;
    let ce_c = c.claim_some("w1", &pending).await?;
    let c1 = c.register(&ce_c.token).await?;
    // D: its attempt closed NOT_SENT (the broker refused), yet a copy of it
    // is in the log: whatever its event does next, the copy refutes that.
    let d = c.emit(4, "d").await;
    let ce_d = c.claim_some("w1", &d).await?;
    let d1 = c.register(&ce_d.token).await?;
    c.s().report_not_sent(&ce_d.token, &d1.attempt_id, "refused").await.map_err(err("report_not_sent"))?;
    let unknown = EventId::generate(c.h.now_ms() as u64).to_string();
    // G: published at offset 10; a copy of its very bytes under another
    // key at 11 (a mirror that re-keys, a producer bypassing the outbox):
    // consumers partitioning by key see the event under that key, so it is
    // a divergent copy, not a mere unrecorded one.
    let g = c.emit(5, "g").await;
    let ce_g = c.claim_some("w1", &g).await?;
    let g1 = c.register(&ce_g.token).await?;
    eq("G's ACK", c.accept(&receipt(&ce_g, &g1, c.offset(10))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;

    let mut log = ScanLog { cluster_id: ce_a.destination.cluster_id.clone(), topic: ce_a.destination.topic.clone(), ..Default::default() };
    let mut put = |ce: &ClaimedEvent, m: outbox_core::store::ScannedMessage| log.partitions.entry(ce.destination.partition).or_default().push(m);
    put(&ce_a, scanned(&ce_a, &a1, c.offset(1), &ce_a.payload));
    put(&ce_a, scanned(&ce_a, &a1, c.offset(3), b"other bytes"));
    put(&ce_b1, scanned(&ce_b1, &b1, c.offset(4), &ce_b1.payload));
    put(&ce_b2, scanned(&ce_b2, &b2, c.offset(5), &ce_b2.payload));
    put(&ce_b1, scanned(&ce_b1, &b1, c.offset(6), &ce_b1.payload));
    put(&ce_b1, outbox_core::store::ScannedMessage { event_id: Some(unknown.clone()), attempt_id: None, ..scanned(&ce_b1, &b1, c.offset(7), b"bypass") });
    put(&ce_c, scanned(&ce_c, &c1, c.offset(8), &ce_c.payload));
    put(&ce_d, scanned(&ce_d, &d1, c.offset(9), &ce_d.payload));
    put(&ce_g, scanned(&ce_g, &g1, c.offset(10), &ce_g.payload));
    put(&ce_g, outbox_core::store::ScannedMessage { key: Some(b"another key".to_vec()), ..scanned(&ce_g, &g1, c.offset(11), &ce_g.payload) });
    for page in log.partitions.values_mut() {
        page.sort_by_key(|m| m.offset);
    }
    let end = |p: i32| log.partitions[&p].last().map_or(0, |m| m.offset + 1);
    let ours = |findings: &[(String, String)]| -> Vec<(String, String)> {
        let mut f: Vec<(String, String)> =
            findings.iter().filter(|(_, e)| [a.as_str(), b.as_str(), pending.as_str(), d.as_str(), unknown.as_str()].contains(&e.as_str())).cloned().collect();
        f.sort();
        f.dedup();
        f
    };
    let pair = |k: &str, e: &str| (k.to_owned(), e.to_owned());

    let ScanOutcome { findings, cursors, submitted } = c.h.bypass_scan(&log).await?;
    let mut of_g: Vec<String> = findings.iter().filter(|(_, e)| *e == g.as_str()).map(|(k, _)| k.clone()).collect();
    eq("nothing handed to the receipt transaction while answers may come", submitted, 0)?;
    let mut want = vec![pair("divergent_copy", a.as_str()), pair("bypass_publish", &unknown), pair("absence_proof_refuted", d.as_str())];
    want.sort();
    eq("findings while B's retry may still be answered", ours(&findings), want)?;
    eq("the cursor waits at the copy of B's open retry", cursors[&ce_b2.destination.partition], c.offset(5))?;
    // (C's copy, of an attempt still within its bound, is waited for too.)
    if ce_a.destination.partition != ce_b2.destination.partition && ce_a.destination.partition != ce_c.destination.partition {
        eq("A's partition is read to its end", cursors[&ce_a.destination.partition], end(ce_a.destination.partition))?;
    }

    c.h.advance_ms(POLICY.in_flight_bound_ms + LEASE_MS);
    let ScanOutcome { findings, cursors, submitted } = c.h.bypass_scan(&log).await?;
    // (G's copies are judged in the first scan, or in this one where they
    // share B's partition past the cursor that waited.)
    of_g.extend(findings.iter().filter(|(_, e)| *e == g.as_str()).map(|(k, _)| k.clone()));
    of_g.sort();
    of_g.dedup();
    eq("G's copy under another key", of_g, vec!["divergent_copy".to_owned()])?;
    eq("C's copy, the one past its bound of an unpublished event, is handed to the receipt transaction", submitted, 1)?;
    ensure(ours(&findings).contains(&pair("unrecorded_copy", b.as_str())), || format!("B's retry's copy past its bound is unrecorded_copy; findings {findings:?}"))?;
    // (D's copy is read again where it shares B's partition past the
    // waiting cursor: the same finding again, which a store keeps once.)
    ensure(!ours(&findings).iter().any(|(_, e)| e == a.as_str() || e == pending.as_str()), || format!("nothing read again of A, nothing of C; findings {findings:?}"))?;
    eq("the cursor passes the judged copy", cursors[&ce_b2.destination.partition], end(ce_b2.destination.partition))?;
    // C's copy, past its bound with C still unpublished, is what a lookup
    // would find: the scan handed it to the receipt transaction.
    c.expect_state(&pending, EventState::Published).await?;

    // E: B's partition's log replaced (a cluster come back empty, a topic
    // recreated) and grown past the cursor before the scan came back: the
    // offset alone cannot tell. The message below the cursor is another
    // one, so the new log is read from its start, and what it holds below
    // the old cursor is judged.
    let p = ce_b2.destination.partition;
    let at = cursors[&p];
    let (low, below) = (EventId::generate(c.h.now_ms() as u64).to_string(), EventId::generate(c.h.now_ms() as u64).to_string());
    let stray = |id: &str, offset: i64| outbox_core::store::ScannedMessage { event_id: Some(id.to_owned()), attempt_id: None, receipt: None, ..scanned(&ce_b1, &b1, offset, b"another log") };
    let replaced = ScanLog { partitions: [(p, vec![stray(&low, c.offset(2)), stray(&below, at - 1)])].into_iter().collect(), ..log.clone() };
    let ScanOutcome { findings, cursors, .. } = c.h.bypass_scan(&replaced).await?;
    eq("a log holding another message below the cursor is read again from its start", cursors[&p], 0)?;
    ensure(findings.iter().all(|(_, e)| *e != low && *e != below), || format!("the restart judges nothing yet; findings {findings:?}"))?;
    let ScanOutcome { findings, cursors, .. } = c.h.bypass_scan(&replaced).await?;
    let mut seen: Vec<(String, String)> = findings.into_iter().filter(|(_, e)| *e == low || *e == below).collect();
    seen.sort();
    let mut want = vec![pair("bypass_publish", &low), pair("bypass_publish", &below)];
    want.sort();
    eq("the new log's messages below the old cursor are judged", seen, want)?;
    eq("the new log is read to its end", cursors[&p], at)?;

    // F: retention deletes offsets of that log before the scan reads them:
    // the scan says which (`scan_gap`), once, and reads on from the log's
    // start.
    let (gone, kept) = (EventId::generate(c.h.now_ms() as u64).to_string(), EventId::generate(c.h.now_ms() as u64).to_string());
    let mut truncated = replaced.clone();
    truncated.partitions.entry(p).or_default().extend([stray(&gone, at), stray(&kept, at + 1)]);
    truncated.starts.insert(p, at + 1);
    let ScanOutcome { findings, cursors, .. } = c.h.bypass_scan(&truncated).await?;
    let gap = pair(outbox_core::compare::SCAN_GAP, &outbox_core::compare::scan_gap_label(&log.topic, p, (at, at + 1)));
    ensure(findings.contains(&gap), || format!("the deleted offsets are a scan_gap; findings {findings:?}"))?;
    ensure(!findings.iter().any(|(_, e)| *e == gone) && findings.contains(&pair("bypass_publish", &kept)), || format!("the deleted message is not judged, the kept one is; findings {findings:?}"))?;
    eq("the cursor moves past the gap to the log's end", cursors[&p], at + 2)?;
    let ScanOutcome { findings, .. } = c.h.bypass_scan(&truncated).await?;
    ensure(!findings.contains(&gap), || format!("the gap is said once; findings {findings:?}"))
}
