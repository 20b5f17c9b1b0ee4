//! Unknown outcomes and reconciliation (PROTOCOL §3, §6): not-sent reports,
//! retries to the same frozen destination, proofs of absence and the late
//! ACKs that refute them, a found copy published through the slot, and the
//! reconcile finish's plan.

use outbox_core::id::EventId;
use outbox_core::receipt::{AttemptRecord, ReceiptDecision, RejectReason};
use outbox_core::reconcile::{decide_reconcile, RecheckReason, ReconcileDecision};
use outbox_core::state::{AttemptState, EventState};
use outbox_core::store::{ClaimedEvent, FenceOutcome, LookupOutcome, OutboxStore};

use super::ctx::{ensure, eq, err, receipt, Ctx};
use super::{Harness, Verdict, POLICY};

/// After a blind retry the first attempt is still UNKNOWN (possibly in the
/// log). If the retry attempt is then definitely not sent, the event's outcome
/// is still unknown: it must go back to DISPATCH_UNKNOWN, not PENDING, or the
/// first attempt's late genuine ACK could no longer fill the slot (found by
/// the simulator, seed 91609).
pub(super) async fn not_sent_retry_after_blind_retry<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce1 = c.claim_some("w1", &id).await?;
    let a1 = c.register(&ce1.token).await?;
    c.expire().await?;
    c.h.advance_ms(POLICY.in_flight_bound_ms);
    let task = c.reconcile("r1", &id).await?;
    let d = decide_reconcile(&task.attempts, &LookupOutcome::Unavailable("adapter cannot look up".into()), false, &POLICY, c.h.now_ms());
    eq("reconcile decision", &d, &ReconcileDecision::Retry { proven_absent: false })?;
    c.s().finish_reconcile(&task.token, &d).await.map_err(err("finish_reconcile"))?;
    let ce2 = c.claim_retry("w2", &id).await?;
    let a2 = c.register(&ce2.token).await?;
    eq("retry not sent", c.s().report_not_sent(&ce2.token, &a2.attempt_id, "broker refused").await.map_err(err("report_not_sent"))?, FenceOutcome::Applied)?;
    c.expect_state(&id, EventState::DispatchUnknown).await?;
    let states: Vec<_> = c.attempts(&id).await?.iter().map(|a| a.state).collect();
    eq("attempt states", states, vec![AttemptState::Unknown, AttemptState::NotSent])?;
    eq("first attempt's late ACK", c.accept(&receipt(&ce1, &a1, c.offset(1))).await?, ReceiptDecision::Accept { from: EventState::DispatchUnknown })?;
    c.expect_state(&id, EventState::Published).await
}

pub(super) async fn not_sent_is_pending_again<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce1 = c.claim_some("w1", &id).await?;
    let a1 = c.register(&ce1.token).await?;
    eq("not sent", c.s().report_not_sent(&ce1.token, &a1.attempt_id, "broker refused").await.map_err(err("report_not_sent"))?, FenceOutcome::Applied)?;
    c.expect_state(&id, EventState::Pending).await?;
    eq("attempt 1 state", c.attempts(&id).await?.first().map(|a| a.state), Some(AttemptState::NotSent))?;
    // Eligible again after a backoff, not at once: a send the broker always
    // refuses is not retried in a loop.
    let early = c.claim("w2", &id).await?;
    ensure(early.is_none(), || "claimable again before its backoff".into())?;
    c.h.advance_ms(outbox_core::claim::not_sent_backoff_ms(a1.attempt_generation));
    let ce2 = c.claim_some("w2", &id).await?;
    eq("destination digest", &ce2.destination_digest, &ce1.destination_digest)?;
    eq("destination", &ce2.destination, &ce1.destination)?;
    let a2 = c.register(&ce2.token).await?;
    eq("attempt generation", a2.attempt_generation, 2)?;
    eq("attempt destination", &a2.destination_digest, &a1.destination_digest)?;
    // The closed attempt cannot fill the slot; the new one can.
    eq("closed attempt", c.accept(&receipt(&ce1, &a1, c.offset(1))).await?, ReceiptDecision::Reject { reason: RejectReason::AttemptClosed })?;
    eq("new attempt", c.accept(&receipt(&ce2, &a2, c.offset(2))).await?, ReceiptDecision::Accept { from: EventState::Sending })
}

/// An event whose first attempt's outcome became unknown (its lease ran
/// out while sending) and which a reconciler then proved absent: the
/// attempt closed ABSENT, the event RETRY_CLAIMED. Answers the event, its
/// first claim and the attempt.
pub(super) async fn first_attempt_proven_absent<H: Harness>(c: &Ctx<'_, H>) -> Result<(EventId, ClaimedEvent, AttemptRecord), String> {
    let id = c.emit(1, "a").await;
    let ce1 = c.claim_some("w1", &id).await?;
    let a1 = c.register(&ce1.token).await?;
    c.expire().await?;
    c.h.advance_ms(POLICY.in_flight_bound_ms);
    let task = c.reconcile("r1", &id).await?;
    let d = decide_reconcile(&task.attempts, &LookupOutcome::Absent, true, &POLICY, c.h.now_ms());
    eq("proof", &d, &ReconcileDecision::Retry { proven_absent: true })?;
    c.s().finish_reconcile(&task.token, &d).await.map_err(err("finish_reconcile"))?;
    eq("attempt 1 closed", c.attempts(&id).await?.first().map(|a| a.state), Some(AttemptState::Absent))?;
    Ok((id, ce1, a1))
}

pub(super) async fn late_ack_of_an_absent_attempt_converges<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let (id, ce1, a1) = first_attempt_proven_absent(c).await?;
    // A1's genuine message lands after all: it fills the empty slot.
    let r1 = receipt(&ce1, &a1, c.offset(1));
    eq("late ACK of the absent attempt", c.accept(&r1).await?, ReceiptDecision::Accept { from: EventState::RetryClaimed })?;
    c.expect_state(&id, EventState::Published).await?;
    eq("again", c.accept(&r1).await?, ReceiptDecision::AlreadyAccepted)
}

/// The proof of absence was wrong (a paused host wrote after the bound) and
/// the event went on without the copy: its retry was refused, it is PENDING
/// again. The late genuine ACK cannot publish it, but it is kept as a
/// duplicate transport receipt (and refutes the proof); the next attempt
/// publishes the event.
pub(super) async fn late_ack_after_a_refused_retry_is_kept<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let (id, ce1, a1) = first_attempt_proven_absent(c).await?;
    let ce2 = c.claim_retry("w2", &id).await?;
    let a2 = c.register(&ce2.token).await?;
    eq("retry refused", c.s().report_not_sent(&ce2.token, &a2.attempt_id, "broker refused").await.map_err(err("report_not_sent"))?, FenceOutcome::Applied)?;
    c.expect_state(&id, EventState::Pending).await?;
    let late = receipt(&ce1, &a1, c.offset(1));
    eq("late ACK of the absent attempt", c.accept(&late).await?, ReceiptDecision::Duplicate)?;
    c.expect_state(&id, EventState::Pending).await?;
    eq("again", c.accept(&late).await?, ReceiptDecision::Duplicate)?;
    c.h.advance_ms(outbox_core::claim::not_sent_backoff_ms(a2.attempt_generation));
    let ce3 = c.claim_some("w3", &id).await?;
    let a3 = c.register(&ce3.token).await?;
    eq("the next attempt", c.accept(&receipt(&ce3, &a3, c.offset(2))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    c.expect_state(&id, EventState::Published).await
}

pub(super) async fn reconcile_absent_retries_same_destination<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce1 = c.claim_some("w1", &id).await?;
    let a1 = c.register(&ce1.token).await?;
    c.expire().await?;
    // Young attempt: the absence proof does not cover it yet.
    let task = c.reconcile("r1", &id).await?;
    eq("reconcile state", task.event.state, EventState::Reconciling)?;
    let d = decide_reconcile(&task.attempts, &LookupOutcome::Absent, true, &POLICY, c.h.now_ms());
    ensure(matches!(d, ReconcileDecision::Recheck { reason: RecheckReason::AttemptInFlight, .. }), || format!("young attempt: {d:?}"))?;
    eq("finish recheck", c.s().finish_reconcile(&task.token, &d).await.map_err(err("finish_reconcile"))?, FenceOutcome::Applied)?;
    c.expect_state(&id, EventState::DispatchUnknown).await?;
    c.h.advance_ms(POLICY.in_flight_bound_ms);
    let task = c.reconcile("r1", &id).await?;
    let d = decide_reconcile(&task.attempts, &LookupOutcome::Absent, true, &POLICY, c.h.now_ms());
    eq("settled attempt", &d, &ReconcileDecision::Retry { proven_absent: true })?;
    eq("finish retry", c.s().finish_reconcile(&task.token, &d).await.map_err(err("finish_reconcile"))?, FenceOutcome::Applied)?;
    c.expect_state(&id, EventState::RetryClaimed).await?;
    // The reconciler's token is spent.
    eq("stale reconciler", c.s().finish_reconcile(&task.token, &d).await.map_err(err("finish_reconcile"))?, FenceOutcome::Fenced)?;
    let ce2 = c.claim_retry("w2", &id).await?;
    eq("claimed from", ce2.claimed_from, EventState::RetryClaimed)?;
    eq("frozen destination", &ce2.destination_digest, &ce1.destination_digest)?;
    let a2 = c.register(&ce2.token).await?;
    eq("attempt generation", a2.attempt_generation, 2)?;
    eq("attempt destination", &a2.destination_digest, &a1.destination_digest)?;
    eq("decision", c.accept(&receipt(&ce2, &a2, c.offset(2))).await?, ReceiptDecision::Accept { from: EventState::Sending })
}

pub(super) async fn reconcile_found_publishes<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce = c.claim_some("w1", &id).await?;
    let a = c.register(&ce.token).await?;
    c.s().report_unknown(&ce.token, &a.attempt_id, "timed out, possibly persisted").await.map_err(err("report_unknown"))?;
    c.expect_state(&id, EventState::DispatchUnknown).await?;
    let task = c.reconcile("r1", &id).await?;
    let r = receipt(&ce, &a, c.offset(1));
    let d = decide_reconcile(&task.attempts, &LookupOutcome::Found(vec![r.clone()]), true, &POLICY, c.h.now_ms());
    eq("decision", &d, &ReconcileDecision::Submit(vec![r.clone()]))?;
    eq("submit", c.accept(&r).await?, ReceiptDecision::Accept { from: EventState::Reconciling })?;
    let recheck = ReconcileDecision::Recheck { reason: RecheckReason::ReceiptsRefused, next_check_at_ms: c.h.now_ms() };
    let fin = c.s().finish_reconcile(&task.token, &recheck).await.map_err(err("finish_reconcile"))?;
    ensure(fin != FenceOutcome::Applied, || "a recheck was applied to a published event".into())?;
    let (state, slot) = c.state(&id).await?;
    eq("state", state, EventState::Published)?;
    eq("slot", slot, Some(r))
}

/// `plan_reconcile_finish` on both stores: a recheck is not offered before
/// its due time and then under a new generation (the old token is fenced);
/// a blind retry leaves the open attempts UNKNOWN; a proven absence closes
/// every open attempt ABSENT, the earlier ones included.
pub(super) async fn reconcile_finish_writes_its_plan<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce1 = c.claim_some("w1", &id).await?;
    let a1 = c.register(&ce1.token).await?;
    c.expire().await?;
    c.h.advance_ms(POLICY.in_flight_bound_ms);
    let t1 = c.reconcile("r1", &id).await?;
    let due = c.h.now_ms() + 5_000;
    let recheck = ReconcileDecision::Recheck { reason: RecheckReason::BrokerUnavailable, next_check_at_ms: due };
    eq("finish recheck", c.s().finish_reconcile(&t1.token, &recheck).await.map_err(err("finish_reconcile"))?, FenceOutcome::Applied)?;
    c.expect_state(&id, EventState::DispatchUnknown).await?;
    ensure(c.reconcile("r2", &id).await.is_err(), || "offered before its recheck was due".into())?;
    c.h.advance_ms(5_001);
    let t2 = c.reconcile("r2", &id).await?;
    ensure(t2.token.claim_generation > t1.token.claim_generation, || "the second reconcile claim did not bump the generation".into())?;
    eq("the first reconciler's finish", c.s().finish_reconcile(&t1.token, &recheck).await.map_err(err("finish_reconcile"))?, FenceOutcome::Fenced)?;
    c.expect_state(&id, EventState::Reconciling).await?;
    let blind = ReconcileDecision::Retry { proven_absent: false };
    eq("finish blind retry", c.s().finish_reconcile(&t2.token, &blind).await.map_err(err("finish_reconcile"))?, FenceOutcome::Applied)?;
    c.expect_state(&id, EventState::RetryClaimed).await?;
    let states = |v: Vec<AttemptRecord>| v.into_iter().map(|a| (a.attempt_id, a.state)).collect::<Vec<_>>();
    eq("after a blind retry", states(c.attempts(&id).await?), vec![(a1.attempt_id.clone(), AttemptState::Unknown)])?;
    let ce2 = c.claim_retry("w2", &id).await?;
    let a2 = c.register(&ce2.token).await?;
    c.expire().await?;
    c.h.advance_ms(POLICY.in_flight_bound_ms);
    let t3 = c.reconcile("r3", &id).await?;
    eq("finish proven retry", c.s().finish_reconcile(&t3.token, &ReconcileDecision::Retry { proven_absent: true }).await.map_err(err("finish_reconcile"))?, FenceOutcome::Applied)?;
    eq("after a proof", states(c.attempts(&id).await?), vec![(a1.attempt_id, AttemptState::Absent), (a2.attempt_id, AttemptState::Absent)])?;
    c.expect_state(&id, EventState::RetryClaimed).await
}
