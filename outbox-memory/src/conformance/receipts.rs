//! The receipt decision (PROTOCOL §5): one primary receipt per event, a
//! competing genuine copy kept as a duplicate, a divergent copy
//! quarantined, an unregistered attempt rejected, the same receipt answered
//! the same, and a payload that no longer matches its digest quarantined
//! before it is sent.

use outbox_core::canonical::sha256_digest;
use outbox_core::id::AttemptId;
use outbox_core::receipt::{BrokerReceipt, QuarantineReason, ReceiptDecision, RejectReason};
use outbox_core::reconcile::{decide_reconcile, ReconcileDecision};
use outbox_core::state::{AttemptState, EventState};
use outbox_core::store::{FenceOutcome, LookupOutcome, OutboxStore};

use super::ctx::{ensure, eq, err, receipt, Ctx};
use super::{Harness, Verdict, POLICY};

/// PROTOCOL §5: a late genuine ACK of an old attempt and the ACK of a new attempt
/// compete for the slot; the loser is kept as a duplicate transport receipt.
/// The second attempt exists while the first one's outcome is unproven: the
/// adapter cannot look up, so the reconciler may only retry to the same
/// frozen destination (PROTOCOL §6).
pub(super) async fn old_and_new_attempt_acked<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce1 = c.claim_some("w1", &id).await?;
    let a1 = c.register(&ce1.token).await?;
    c.expire().await?;
    c.h.advance_ms(POLICY.in_flight_bound_ms);
    let task = c.reconcile("r1", &id).await?;
    let lookup = LookupOutcome::Unavailable("adapter cannot look up".into());
    let d = decide_reconcile(&task.attempts, &lookup, false, &POLICY, c.h.now_ms());
    eq("reconcile decision", &d, &ReconcileDecision::Retry { proven_absent: false })?;
    eq("finish", c.s().finish_reconcile(&task.token, &d).await.map_err(err("finish_reconcile"))?, FenceOutcome::Applied)?;
    let ce2 = c.claim_retry("w2", &id).await?;
    let a2 = c.register(&ce2.token).await?;
    let (r1, r2) = (receipt(&ce1, &a1, c.offset(1)), receipt(&ce2, &a2, c.offset(2)));
    eq("new attempt's ACK", c.accept(&r2).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    eq("old attempt's late ACK", c.accept(&r1).await?, ReceiptDecision::Duplicate)?;
    eq("old attempt's late ACK again", c.accept(&r1).await?, ReceiptDecision::Duplicate)?;
    let (state, slot) = c.state(&id).await?;
    eq("state", state, EventState::Published)?;
    eq("slot", slot, Some(r2))?;
    let states: Vec<_> = c.attempts(&id).await?.iter().map(|a| a.state).collect();
    eq("attempt states", states, vec![AttemptState::Acked, AttemptState::Acked])
}

pub(super) async fn divergent_payload_receipt_quarantines<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce = c.claim_some("w1", &id).await?;
    let a = c.register(&ce.token).await?;
    let genuine = receipt(&ce, &a, c.offset(1));
    let bad = BrokerReceipt { payload_digest: sha256_digest(b"not the frozen payload"), ..genuine.clone() };
    eq("divergent receipt", c.accept(&bad).await?, ReceiptDecision::Quarantine { reason: QuarantineReason::PayloadDigestMismatch, move_event: true })?;
    c.expect_state(&id, EventState::Quarantined).await?;
    // The genuine copy is in the log too: kept as evidence, the event stays quarantined.
    eq("genuine receipt after quarantine", c.accept(&genuine).await?, ReceiptDecision::Duplicate)?;
    let (state, slot) = c.state(&id).await?;
    eq("state", state, EventState::Quarantined)?;
    eq("slot", slot, None)
}

/// A receipt of a registered attempt that names another topic id than the
/// frozen destination (here a `destination.v1`, which names none) is
/// another log's position, not the event's publication: quarantined as a
/// placement mismatch, the slot left empty; the genuine receipt that
/// follows is kept as evidence.
pub(super) async fn receipt_of_another_topic_id_quarantines<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce = c.claim_some("w1", &id).await?;
    eq("frozen topic id", &ce.destination.topic_id, &None)?;
    let a = c.register(&ce.token).await?;
    let genuine = receipt(&ce, &a, c.offset(1));
    let recreated = BrokerReceipt { topic_id: Some("AAECAwQFBgcICQoLDA0ODw".into()), offset: c.offset(2), ..genuine.clone() };
    eq("another topic id", c.accept(&recreated).await?, ReceiptDecision::Quarantine { reason: QuarantineReason::PlacementMismatch, move_event: true })?;
    c.expect_state(&id, EventState::Quarantined).await?;
    eq("genuine receipt after quarantine", c.accept(&genuine).await?, ReceiptDecision::Duplicate)?;
    let (state, slot) = c.state(&id).await?;
    eq("state", state, EventState::Quarantined)?;
    eq("slot", slot, None)
}

/// Issue 47: a message naming a registered attempt, with the frozen payload
/// and destination, on the frozen partition, under another key than the
/// frozen routing key (a forged or re-keyed copy a lookup found) is not the
/// event's publication: consumers partitioning by key would see it under
/// that key. Quarantined as a key mismatch, the slot left empty; the
/// genuine receipt that follows is kept as evidence. A receipt recorded
/// before the key was kept (no key) is not judged by it, and after the slot
/// is filled a re-keyed copy is evidence that leaves the event alone. The
/// slot a store reads back carries the key it was accepted with.
pub(super) async fn receipt_under_another_key_quarantines<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce = c.claim_some("w1", &id).await?;
    let a = c.register(&ce.token).await?;
    let genuine = receipt(&ce, &a, c.offset(1));
    eq("genuine key", genuine.key.as_deref(), Some(ce.destination.routing_key.as_bytes()))?;
    let rekeyed = BrokerReceipt { key: Some(b"another-tenant.order.someone-else".to_vec()), offset: c.offset(2), ..genuine.clone() };
    eq("another key", c.accept(&rekeyed).await?, ReceiptDecision::Quarantine { reason: QuarantineReason::KeyMismatch, move_event: true })?;
    c.expect_state(&id, EventState::Quarantined).await?;
    // No key at all reads as the empty key: not the routing key either.
    let keyless = BrokerReceipt { key: Some(Vec::new()), offset: c.offset(3), ..genuine.clone() };
    eq("no key", c.accept(&keyless).await?, ReceiptDecision::Quarantine { reason: QuarantineReason::KeyMismatch, move_event: false })?;
    eq("genuine receipt after quarantine", c.accept(&genuine).await?, ReceiptDecision::Duplicate)?;
    let (state, slot) = c.state(&id).await?;
    eq("state", state, EventState::Quarantined)?;
    eq("slot", slot, None)?;

    let other = c.emit(2, "b").await;
    let ce = c.claim_some("w1", &other).await?;
    let a = c.register(&ce.token).await?;
    let unkeyed = BrokerReceipt { key: None, ..receipt(&ce, &a, c.offset(4)) };
    eq("receipt without a recorded key", c.accept(&unkeyed).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    let stray = BrokerReceipt { key: Some(b"another-tenant.order.someone-else".to_vec()), ..receipt(&ce, &a, c.offset(5)) };
    eq("another key after publish", c.accept(&stray).await?, ReceiptDecision::Quarantine { reason: QuarantineReason::KeyMismatch, move_event: false })?;
    let (state, slot) = c.state(&other).await?;
    eq("state after publish", state, EventState::Published)?;
    eq("slot after publish", slot, Some(unkeyed))
}

pub(super) async fn unregistered_attempt_is_rejected<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce = c.claim_some("w1", &id).await?;
    let a = c.register(&ce.token).await?;
    let genuine = receipt(&ce, &a, c.offset(2));
    let stranger = BrokerReceipt { attempt_id: AttemptId::generate(c.h.now_ms().max(0) as u64), offset: c.offset(1), ..genuine.clone() };
    eq("unregistered attempt", c.accept(&stranger).await?, ReceiptDecision::Reject { reason: RejectReason::UnregisteredAttempt })?;
    // A registered attempt, but another event's, is not this event's.
    let other = c.emit(2, "b").await;
    let other_ce = c.claim_some("w1", &other).await?;
    let other_attempt = c.register(&other_ce.token).await?;
    let borrowed = BrokerReceipt { attempt_id: other_attempt.attempt_id.clone(), offset: c.offset(3), ..genuine.clone() };
    eq("another event's attempt", c.accept(&borrowed).await?, ReceiptDecision::Reject { reason: RejectReason::UnregisteredAttempt })?;
    c.expect_state(&id, EventState::Sending).await?;
    eq("registered attempt", c.accept(&genuine).await?, ReceiptDecision::Accept { from: EventState::Sending })
}

pub(super) async fn stray_divergent_message_is_evidence<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce = c.claim_some("w1", &id).await?;
    let a = c.register(&ce.token).await?;
    c.s().report_unknown(&ce.token, &a.attempt_id, "timed out").await.map_err(err("report_unknown"))?;
    // A mirror's copy: other bytes, no destination digest, no registered attempt.
    let genuine = receipt(&ce, &a, c.offset(2));
    let stray = BrokerReceipt {
        attempt_id: AttemptId::from_parts(0, 0),
        payload_digest: sha256_digest(b"mirrored"),
        destination_digest: String::new(),
        offset: c.offset(1),
        ..genuine.clone()
    };
    eq("stray", c.accept(&stray).await?, ReceiptDecision::Reject { reason: RejectReason::UnregisteredAttempt })?;
    c.expect_state(&id, EventState::DispatchUnknown).await?;
    eq("genuine", c.accept(&genuine).await?, ReceiptDecision::Accept { from: EventState::DispatchUnknown })
}

pub(super) async fn same_receipt_twice_same_answer<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce = c.claim_some("w1", &id).await?;
    let a = c.register(&ce.token).await?;
    let r = receipt(&ce, &a, c.offset(1));
    let first = c.s().accept_dispatch_receipt(&r).await.map_err(err("accept"))?;
    eq("first", &first.decision, &ReceiptDecision::Accept { from: EventState::Sending })?;
    for _ in 0..2 {
        let again = c.s().accept_dispatch_receipt(&r).await.map_err(err("accept"))?;
        eq("again", &again.decision, &ReceiptDecision::AlreadyAccepted)?;
        eq("primary", &again.primary, &first.primary)?;
        eq("state", again.state, first.state)?;
    }
    Ok(())
}

pub(super) async fn tampered_payload_is_quarantined<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    c.h.tamper_payload(&id, b"tampered bytes").await;
    let ce = c.claim_some("w1", &id).await?;
    ensure(sha256_digest(&ce.payload) != ce.envelope.payload_digest, || "the tampered payload still matches its digest".into())?;
    let out = c.s().quarantine_claimed(&ce.token, "payload_digest_mismatch", serde_json::json!({"actual": sha256_digest(&ce.payload)})).await.map_err(err("quarantine_claimed"))?;
    eq("quarantine", out, FenceOutcome::Applied)?;
    c.expect_state(&id, EventState::Quarantined).await?;
    ensure(c.attempts(&id).await?.is_empty(), || "a quarantined event has attempts".into())?;
    ensure(c.claim("w1", &id).await?.is_none(), || "a quarantined event was claimable".into())
}
