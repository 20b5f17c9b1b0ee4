//! Late ACKs of attempts proven absent: they fill the slot or are duplicates, and are findings.

use super::*;

// ---------------------------------------------------------------- item 2

/// Issue 19 item 2: A1 was proven absent (its message had not landed yet),
/// then its genuine ACK arrives: it fills the empty slot, and the refuted
/// proof is a finding.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item2_late_ack_of_an_absent_attempt_fills_the_slot_and_is_a_finding(pool: PgPool) {
    let f = fixture(pool).await;
    let (ev, a1) = f.registered("o-1", 1_000).await;
    let id = ev.envelope.event_id.as_str().to_owned();
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    f.clock.advance(BOUND_MS + 1);
    assert_eq!(f.reconciler().resolve_unknown_once().await.unwrap().retried, 1);
    assert_eq!(f.store.attempts(&ev.envelope.event_id).await.unwrap()[0].state, AttemptState::Absent);
    let r = f.send_late(&ev, &a1).await;
    let out = f.store.accept_dispatch_receipt(&r).await.unwrap();
    assert!(out.decision.is_primary(), "the genuine ACK of an attempt proven absent was thrown away: {out:?}");
    assert_eq!(f.state(&id).await, EventState::Published);
    assert_eq!(f.findings("absence_proof_refuted", &id).await, 1);
    // The retry claim finds nothing to send any more.
    assert_eq!(f.dispatcher(&f.store, 1_000).dispatch_once("w2").await.unwrap().sent, 0);
    assert_eq!(f.log_of(&id), 1);
}

/// Issue 19 item 2: the retry A2 published first; A1's genuine late ACK is
/// kept as a duplicate transport receipt (and a finding), not dropped.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item2_late_ack_of_an_absent_attempt_after_the_retry_is_a_duplicate_receipt(pool: PgPool) {
    let f = fixture(pool).await;
    let (ev, a1) = f.registered("o-1", 1_000).await;
    let id = ev.envelope.event_id.as_str().to_owned();
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    f.clock.advance(BOUND_MS + 1);
    assert_eq!(f.reconciler().resolve_unknown_once().await.unwrap().retried, 1);
    assert_eq!(f.dispatcher(&f.store, 1_000).dispatch_once("w2").await.unwrap().published, 1);
    let r = f.send_late(&ev, &a1).await;
    let out = f.store.accept_dispatch_receipt(&r).await.unwrap();
    assert_eq!(out.decision, outbox_core::ReceiptDecision::Duplicate, "{out:?}");
    assert_eq!(f.count("SELECT count(*) FROM outbox_duplicate_receipts").await, 1);
    assert_eq!(f.findings("absence_proof_refuted", &id).await, 1);
}

/// Issue 19 item 2: the reconciler finds A1's message (A1 proven absent
/// earlier) while A2 is UNKNOWN: the message converges instead of the event
/// looping recheck -> UNKNOWN -> refused.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item2_reconciler_finding_a_message_of_an_absent_attempt_publishes(pool: PgPool) {
    let f = fixture(pool).await;
    let (ev, a1) = f.registered("o-1", 1_000).await;
    let id = ev.envelope.event_id.as_str().to_owned();
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    f.clock.advance(BOUND_MS + 1);
    assert_eq!(f.reconciler().resolve_unknown_once().await.unwrap().retried, 1);
    // A2 registered and lost; A1's message lands meanwhile.
    let retry = f.store.claim_retries("w2", 10, 1_000).await.unwrap();
    f.store.register_attempt(&retry[0].token).await.unwrap();
    f.send_late(&ev, &a1).await;
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    f.clock.advance(BOUND_MS + 1);
    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!(r.published, 1, "{r:?}");
    assert_eq!(f.state(&id).await, EventState::Published);
    assert_eq!(f.findings("absence_proof_refuted", &id).await, 1);
    assert_eq!(f.log_of(&id), 1);
}

/// A copy written by an attempt that was still open when another attempt's
/// late ACK published its event is accounted for (PROTOCOL §5: every copy
/// is a receipt or a finding). Nothing asks about that attempt again: its
/// ACK was lost, the reconciler looks up only unresolved events, and the
/// comparison used to pass over the copy of any open attempt as an answer
/// still on its way, for ever. Once the attempt is past the in-flight
/// bound, its copy is `unrecorded_copy`.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_copy_of_an_attempt_left_open_by_a_late_ack_is_a_finding(pool: PgPool) {
    let f = fixture(pool).await;
    let (c0, a0) = f.registered("o-1", 1_000).await;
    let id = c0.envelope.event_id.as_str().to_owned();
    // The first attempt is written; its ACK is lost and the lease runs out.
    let r0 = f.send_late(&c0, &a0).await;
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    assert_eq!(f.state(&id).await, EventState::DispatchUnknown);
    // A retry (here blind: as a reconciler whose adapter cannot look up
    // does) is written too, and its ACK is lost as well.
    let task = f.store.begin_reconcile("r", 10, 1_000).await.unwrap().pop().expect("due");
    f.store.finish_reconcile(&task.token, &outbox_core::ReconcileDecision::Retry { proven_absent: false }).await.unwrap();
    let c1 = f.store.claim_retries("w2", 10, 1_000).await.unwrap().pop().expect("the retry claim");
    let a1 = f.store.register_attempt(&c1.token).await.unwrap();
    let r1 = f.send_late(&c1, &a1).await;
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    // The first attempt's late ACK publishes the event; the second stays open.
    let out = f.store.accept_dispatch_receipt(&r0).await.unwrap();
    assert!(matches!(out.decision, outbox_core::ReceiptDecision::Accept { .. }), "{out:?}");
    let open = f.store.attempts(&c0.envelope.event_id).await.unwrap().into_iter().filter(|a| a.state.possibly_in_flight()).count();
    assert_eq!(open, 1, "the retry's attempt is still open");
    assert_eq!(f.log_of(&id), 2);

    // Within the in-flight bound its answer may still come: no finding yet.
    let rec = f.reconciler();
    let c = rec.compare_once().await.unwrap();
    assert_eq!(c.unrecorded_copy, 0, "{c:?}");
    // Past it, the copy is reported.
    f.clock.advance(BOUND_MS + 10_000);
    let c = rec.compare_once().await.unwrap();
    let recorded = f.count(&format!("SELECT count(*) FROM outbox_duplicate_receipts WHERE event_id = '{id}' AND \"offset\" = {}", r1.offset)).await;
    assert!(c.unrecorded_copy == 1 || recorded == 1, "the open attempt's copy at offset {} is neither a receipt nor a finding: {c:?}", r1.offset);
    assert_eq!(f.findings("unrecorded_copy", &id).await, 1);
}
