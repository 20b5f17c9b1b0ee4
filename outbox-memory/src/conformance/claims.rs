//! Claims, fencing and registration (PROTOCOL §4): a claim is granted
//! once, a stale or forged holder changes nothing, a key is held until its
//! event closes, an expired lease while sending makes the outcome unknown,
//! and an attempt registers only on a running claim, with its log's scan floor.

use outbox_core::claim::ClaimToken;
use outbox_core::error::CoreError;
use outbox_core::receipt::ReceiptDecision;
use outbox_core::reconcile::ReconcileDecision;
use outbox_core::state::{AttemptState, EventState};
use outbox_core::store::{FenceOutcome, OutboxStore, StoreError};

use super::ctx::{ensure, eq, err, receipt, Ctx};
use super::{Harness, Verdict, LEASE_MS, POLICY};

pub(super) async fn claim_register_accept_publishes<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    eq("a retried command", c.emit(1, "a").await, id.clone())?;
    c.expect_state(&id, EventState::Pending).await?;
    let ce = c.claim_some("w1", &id).await?;
    eq("claimed from", ce.claimed_from, EventState::Pending)?;
    c.expect_state(&id, EventState::Claimed).await?;
    let a = c.register(&ce.token).await?;
    eq("attempt generation", a.attempt_generation, 1)?;
    eq("attempt destination", &a.destination_digest, &ce.destination_digest)?;
    c.expect_state(&id, EventState::Sending).await?;
    let r = receipt(&ce, &a, c.offset(1));
    eq("decision", c.accept(&r).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    let (state, slot) = c.state(&id).await?;
    eq("state", state, EventState::Published)?;
    eq("slot", slot, Some(r))?;
    eq("attempt state", c.attempts(&id).await?.first().map(|a| a.state), Some(AttemptState::Acked))
}

pub(super) async fn second_claimer_is_fenced<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce = c.claim_some("w1", &id).await?;
    ensure(c.claim("w2", &id).await?.is_none(), || "a claimed event was claimed again".into())?;
    // Another owner presenting the current generation, and the holder
    // presenting a generation it was never granted, are both fenced.
    let forged = ClaimToken { owner: "w2".into(), ..ce.token.clone() };
    let e = c.s().register_attempt(&forged).await.err().ok_or("a forged owner registered an attempt")?;
    ensure(e.is_fenced(), || format!("forged owner: {e}"))?;
    let ahead = ClaimToken { claim_generation: ce.token.claim_generation + 1, ..ce.token.clone() };
    let e = c.s().register_attempt(&ahead).await.err().ok_or("a future generation registered an attempt")?;
    ensure(e.is_fenced(), || format!("future generation: {e}"))?;
    eq("release by the forged owner", c.s().release(&forged).await.map_err(err("release"))?, FenceOutcome::Fenced)?;
    c.expect_state(&id, EventState::Claimed).await?;
    let a = c.register(&ce.token).await?;
    eq("decision", c.accept(&receipt(&ce, &a, c.offset(1))).await?, ReceiptDecision::Accept { from: EventState::Sending })
}

pub(super) async fn stale_writer_after_lease_expiry<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let old = c.claim_some("w1", &id).await?;
    c.h.advance_ms(LEASE_MS + 1);
    // Still the current generation, but the lease is gone: no send.
    let e = c.s().register_attempt(&old.token).await.err().ok_or("registered with an expired lease")?;
    ensure(e.is_fenced(), || format!("expired lease: {e}"))?;
    c.s().expire_leases().await.map_err(err("expire_leases"))?;
    c.expect_state(&id, EventState::Pending).await?;
    let new = c.claim_some("w2", &id).await?;
    ensure(new.token.claim_generation > old.token.claim_generation, || "the takeover did not bump the generation".into())?;
    let e = c.s().register_attempt(&old.token).await.err().ok_or("a stale holder registered an attempt")?;
    ensure(e.is_fenced(), || format!("stale holder: {e}"))?;
    eq("stale release", c.s().release(&old.token).await.map_err(err("release"))?, FenceOutcome::Fenced)?;
    eq("stale renew", c.s().renew_lease(&old.token, LEASE_MS).await.map_err(err("renew_lease"))?, None)?;
    c.expect_state(&id, EventState::Claimed).await?;
    ensure(c.attempts(&id).await?.is_empty(), || "a stale write left an attempt".into())?;
    let a = c.register(&new.token).await?;
    eq("stale not-sent report", c.s().report_not_sent(&old.token, &a.attempt_id, "stale").await.map_err(err("report_not_sent"))?, FenceOutcome::Fenced)?;
    eq("stale unknown report", c.s().report_unknown(&old.token, &a.attempt_id, "stale").await.map_err(err("report_unknown"))?, FenceOutcome::Fenced)?;
    c.expect_state(&id, EventState::Sending).await?;
    eq("decision", c.accept(&receipt(&new, &a, c.offset(1))).await?, ReceiptDecision::Accept { from: EventState::Sending })
}

/// second attempt. Nothing refused leaves an attempt.
pub(super) async fn registration_guard<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce = c.claim_some("w1", &id).await?;
    let forged = ClaimToken { owner: "w9".into(), ..ce.token.clone() };
    let e = c.s().register_attempt(&forged).await.err().ok_or("another owner registered on w1's claim")?;
    ensure(e.is_fenced(), || format!("forged owner: {e}"))?;
    ensure(c.attempts(&id).await?.is_empty(), || "a forged registration left an attempt".into())?;
    c.expect_state(&id, EventState::Claimed).await?;
    let a = c.register(&ce.token).await?;
    match c.s().register_attempt(&ce.token).await {
        Err(StoreError::Core(CoreError::IllegalTransition { from: EventState::Sending, to: EventState::Sending })) => {}
        other => return Err(format!("a second registration on one claim: got {other:?}, want IllegalTransition SENDING -> SENDING")),
    }
    let attempts = c.attempts(&id).await?;
    eq("attempts after the second registration", attempts.iter().map(|x| &x.attempt_id).collect::<Vec<_>>(), vec![&a.attempt_id])?;

    let released = c.emit(2, "b").await;
    let ce2 = c.claim_some("w1", &released).await?;
    eq("release", c.s().release(&ce2.token).await.map_err(err("release"))?, FenceOutcome::Applied)?;
    let e = c.s().register_attempt(&ce2.token).await.err().ok_or("a released claim registered an attempt")?;
    ensure(e.is_fenced(), || format!("released claim: {e}"))?;
    ensure(c.attempts(&released).await?.is_empty(), || "a released claim left an attempt".into())?;
    c.expect_state(&released, EventState::Pending).await
}

pub(super) async fn per_key_ordering<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let first = c.emit(1, "same").await;
    let second = c.emit(2, "same").await;
    let other = c.emit(3, "other").await;
    ensure(c.claim("w1", &second).await?.is_none(), || "the second event of a key was claimable before the first was published".into())?;
    let o = c.claim_some("w1", &other).await?;
    c.s().release(&o.token).await.map_err(err("release"))?;
    let ce1 = c.claim_some("w1", &first).await?;
    let a1 = c.register(&ce1.token).await?;
    ensure(c.claim("w1", &second).await?.is_none(), || "the second event of a key was claimable while the first was SENDING".into())?;
    c.accept(&receipt(&ce1, &a1, c.offset(1))).await?;
    let ce2 = c.claim_some("w1", &second).await?;
    let a2 = c.register(&ce2.token).await?;
    eq("second", c.accept(&receipt(&ce2, &a2, c.offset(2))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    let o = c.claim_some("w1", &other).await?;
    let ao = c.register(&o.token).await?;
    eq("other", c.accept(&receipt(&o, &ao, c.offset(3))).await?, ReceiptDecision::Accept { from: EventState::Sending })
}

/// Claim eligibility (`is_claimable`, `EventState::holds_key`) on both
/// stores: the second event of a key is claimable exactly when the core
/// says so, through every state its first event passes (PENDING, CLAIMED,
/// SENDING, DISPATCH_UNKNOWN, RECONCILING, RETRY_CLAIMED, PUBLISHED).
pub(super) async fn a_key_is_held_until_its_event_closes<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let first = c.emit(1, "k").await;
    let second = c.emit(2, "k").await;
    let (one, two) = (&first, &second);
    let check = |stage: &'static str| async move {
        let (state, _) = c.state(one).await?;
        let want = outbox_core::claim::is_claimable(EventState::Pending, 0, state.holds_key(), c.h.now_ms());
        let got = c.claim("w9", two).await?;
        eq(stage, got.is_some(), want)?;
        Ok::<_, String>(got)
    };
    eq("pending", check("behind a PENDING event").await?.is_some(), false)?;
    let ce = c.claim_some("w1", &first).await?;
    check("behind a CLAIMED event").await?;
    c.register(&ce.token).await?;
    check("behind a SENDING event").await?;
    c.expire().await?;
    check("behind a DISPATCH_UNKNOWN event").await?;
    c.h.advance_ms(POLICY.in_flight_bound_ms);
    let task = c.reconcile("r1", &first).await?;
    check("behind a RECONCILING event").await?;
    eq("finish", c.s().finish_reconcile(&task.token, &ReconcileDecision::Retry { proven_absent: false }).await.map_err(err("finish_reconcile"))?, FenceOutcome::Applied)?;
    check("behind a RETRY_CLAIMED event").await?;
    let retry = c.claim_retry("w2", &first).await?;
    let a2 = c.register(&retry.token).await?;
    eq("the retry's receipt", c.accept(&receipt(&retry, &a2, c.offset(1))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    let claimed = check("behind a PUBLISHED event").await?.ok_or("the second event was not claimed once the first was published")?;
    c.s().release(&claimed.token).await.map_err(err("release"))?;
    Ok(())
}

pub(super) async fn lease_expiry_while_sending_is_unknown<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce = c.claim_some("w1", &id).await?;
    let a = c.register(&ce.token).await?;
    c.expire().await?;
    c.expect_state(&id, EventState::DispatchUnknown).await?;
    let attempts = c.attempts(&id).await?;
    eq("attempts", attempts.len(), 1)?;
    eq("attempt state", attempts[0].state, AttemptState::Unknown)?;
    eq("stale unknown report", c.s().report_unknown(&ce.token, &a.attempt_id, "timeout").await.map_err(err("report_unknown"))?, FenceOutcome::Fenced)?;
    eq("stale not-sent report", c.s().report_not_sent(&ce.token, &a.attempt_id, "refused").await.map_err(err("report_not_sent"))?, FenceOutcome::Fenced)?;
    c.expect_state(&id, EventState::DispatchUnknown).await?;
    // The late genuine ACK of the expired claim still fills the slot.
    eq("late ACK", c.accept(&receipt(&ce, &a, c.offset(1))).await?, ReceiptDecision::Accept { from: EventState::DispatchUnknown })?;
    c.expect_state(&id, EventState::Published).await
}

/// The registration floor (`advance_floor`) on both stores: an attempt
/// registered after a receipt of its partition's log records the offset
/// past that receipt, anchored at the receipt's event and attempt; a lower receipt
/// later (a late ACK of an older write) does not lower it. (The last
/// scenario of a run: its offsets are the highest of the run.)
pub(super) async fn registration_floor<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let first = c.emit(1, "k").await;
    let ce1 = c.claim_some("w1", &first).await?;
    let a1 = c.register(&ce1.token).await?;
    c.accept(&receipt(&ce1, &a1, c.offset(500))).await?;
    let second = c.emit(2, "k").await;
    let ce2 = c.claim_some("w1", &second).await?;
    eq("one partition", ce2.destination.partition, ce1.destination.partition)?;
    let a2 = c.register(&ce2.token).await?;
    eq("the second attempt's floor", (a2.scan_from_offset, a2.scan_anchor.clone()), (c.offset(500) + 1, Some(first.clone())))?;
    eq("its anchor's attempt", a2.scan_anchor_attempt.clone(), Some(a1.attempt_id.clone()))?;
    c.accept(&receipt(&ce2, &a2, c.offset(400))).await?;
    let third = c.emit(3, "k").await;
    let ce3 = c.claim_some("w1", &third).await?;
    let a3 = c.register(&ce3.token).await?;
    eq("after a lower receipt", (a3.scan_from_offset, a3.scan_anchor.clone(), a3.scan_anchor_attempt.clone()), (c.offset(500) + 1, Some(first), Some(a1.attempt_id.clone())))?;
    c.accept(&receipt(&ce3, &a3, c.offset(501))).await.map(|_| ())
}
