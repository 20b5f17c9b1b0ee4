//! An operator's skip (issue 47, `outbox_core::skip`): the way out of a
//! key blocked by a QUARANTINED head or a DISPATCH_UNKNOWN head nothing can
//! prove. The key's next event waits while the head holds the key, and is
//! claimable once the head is SKIPPED; the skip is recorded (who, when,
//! why, from which state); a skip of anything else is refused, and so is a
//! skip under a reconciler's lease.

use outbox_core::migration::MigrationFence;
use outbox_core::skip::{PoisonPolicy, PoisonRule, SkipRecord, POISON_POLICY_ACTOR};
use outbox_core::state::EventState;
use outbox_core::store::{FenceOutcome, OutboxStore};
use outbox_core::{ReceiptDecision, ReconcileDecision, RecheckReason};

use super::ctx::{ensure, eq, err, receipt, Ctx};
use super::{Harness, Verdict};

/// The operator the scenarios skip as.
const OPERATOR: &str = "oncall-alice";

async fn refused<H: Harness>(c: &Ctx<'_, H>, what: &str, id: &outbox_core::id::EventId, want: &str) -> Verdict {
    match c.h.skip_event(id, OPERATOR, "should be refused").await? {
        Ok(r) => Err(format!("{what}: skipped, {r:?}")),
        Err(reason) => ensure(reason.contains(want), || format!("{what}: refused for {reason:?}, want a reason naming {want:?}")),
    }
}

fn the_record(what: &str, records: &[SkipRecord], id: &outbox_core::id::EventId, from: EventState, reason: &str) -> Verdict {
    eq(&format!("{what}: skip records"), records.len(), 1)?;
    let r = &records[0];
    eq(&format!("{what}: record's event"), r.event_id.as_str(), id.as_str())?;
    eq(&format!("{what}: record's from state"), r.from_state, from)?;
    eq(&format!("{what}: record's operator"), r.operator.as_str(), OPERATOR)?;
    eq(&format!("{what}: record's reason"), r.reason.as_str(), reason)
}

/// Two events of one key, the first (its stored payload tampered with)
/// QUARANTINED: it holds its key, the second is not claimable.
async fn quarantined_head<H: Harness>(c: &Ctx<'_, H>) -> Result<(outbox_core::id::EventId, outbox_core::id::EventId), String> {
    let head = c.emit(1, "k").await;
    let next = c.emit(2, "k").await;
    c.h.tamper_payload(&head, b"poison bytes").await;
    let ce = c.claim_some("w1", &head).await?;
    let out = c.s().quarantine_claimed(&ce.token, "payload_digest_mismatch", serde_json::json!({})).await.map_err(err("quarantine_claimed"))?;
    eq("quarantine", out, FenceOutcome::Applied)?;
    c.expect_state(&head, EventState::Quarantined).await?;
    ensure(c.claim("w1", &next).await?.is_none(), || "the next event of a key was claimable behind a QUARANTINED head".into())?;
    Ok((head, next))
}

/// A QUARANTINED head (its stored payload tampered with) holds its key:
/// the next event of the key is not claimable. Skipping the next
/// (PENDING) event is refused; skipping the head closes it SKIPPED with
/// its evidence, and the next event is claimable and publishes; skipping
/// it then (PUBLISHED) or the head again is refused.
pub(super) async fn skip_of_a_quarantined_head_frees_its_key<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let (head, next) = quarantined_head(c).await?;

    refused(c, "skip of a PENDING event", &next, "PENDING").await?;
    c.expect_state(&next, EventState::Pending).await?;
    ensure(c.h.skip_records(&next).await?.is_empty(), || "a refused skip left a record".into())?;

    let reason = "poison payload; consumers agreed to the gap (ticket OPS-47)";
    let rec = c.h.skip_event(&head, OPERATOR, reason).await?.map_err(|r| format!("skip of the QUARANTINED head refused: {r}"))?;
    eq("skip's from state", rec.from_state, EventState::Quarantined)?;
    c.expect_state(&head, EventState::Skipped).await?;
    the_record("quarantined head", &c.h.skip_records(&head).await?, &head, EventState::Quarantined, reason)?;
    ensure(c.claim("w1", &head).await?.is_none(), || "a SKIPPED event was claimable".into())?;

    let ce2 = c.claim("w1", &next).await?.ok_or("the next event of the key was not claimable after its head was skipped")?;
    let a2 = c.register(&ce2.token).await?;
    eq("next's receipt", c.accept(&receipt(&ce2, &a2, c.offset(1))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    c.expect_state(&next, EventState::Published).await?;

    refused(c, "skip of a PUBLISHED event", &next, "PUBLISHED").await?;
    refused(c, "second skip", &head, "already SKIPPED").await?;
    c.expect_state(&head, EventState::Skipped).await?;
    the_record("after the refused skips", &c.h.skip_records(&head).await?, &head, EventState::Quarantined, reason)
}

/// A DISPATCH_UNKNOWN head (its sender's lease ran out while sending)
/// holds its key. While a reconciler holds it (RECONCILING) a skip is
/// refused; once the reconciler finds nothing provable and puts it back,
/// the skip closes it and the next event is claimable. Stale writers of
/// the head are fenced, and a late genuine copy of its send is kept as
/// evidence: the head stays SKIPPED.
pub(super) async fn skip_of_an_unprovable_unknown_head_is_fenced_and_frees_its_key<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let head = c.emit(1, "k").await;
    let next = c.emit(2, "k").await;
    let ce = c.claim_some("w1", &head).await?;
    let a = c.register(&ce.token).await?;
    c.expire().await?;
    c.expect_state(&head, EventState::DispatchUnknown).await?;
    ensure(c.claim("w2", &next).await?.is_none(), || "the next event of a key was claimable behind a DISPATCH_UNKNOWN head".into())?;

    let task = c.reconcile("rec-1", &head).await?;
    c.expect_state(&head, EventState::Reconciling).await?;
    refused(c, "skip under a reconcile lease", &head, "RECONCILING").await?;
    c.expect_state(&head, EventState::Reconciling).await?;
    let nothing = ReconcileDecision::Recheck { reason: RecheckReason::BrokerUnavailable, next_check_at_ms: c.h.now_ms() + 3_600_000 };
    c.s().finish_reconcile(&task.token, &nothing).await.map_err(err("finish_reconcile"))?;
    c.expect_state(&head, EventState::DispatchUnknown).await?;

    let reason = "cluster decommissioned; absence cannot be proven";
    let rec = c.h.skip_event(&head, OPERATOR, reason).await?.map_err(|r| format!("skip of the DISPATCH_UNKNOWN head refused: {r}"))?;
    eq("skip's from state", rec.from_state, EventState::DispatchUnknown)?;
    c.expect_state(&head, EventState::Skipped).await?;
    the_record("unknown head", &c.h.skip_records(&head).await?, &head, EventState::DispatchUnknown, reason)?;

    // The reconciler's old claim and the expired sender are fenced.
    let late = c.s().finish_reconcile(&task.token, &nothing).await;
    ensure(late.is_err() || late.as_ref().is_ok_and(|o| *o == FenceOutcome::Fenced), || format!("a reconciler's stale finish after the skip: {late:?}"))?;
    eq("stale not-sent report", c.s().report_not_sent(&ce.token, &a.attempt_id, "refused").await.map_err(err("report_not_sent"))?, FenceOutcome::Fenced)?;
    c.expect_state(&head, EventState::Skipped).await?;

    let ce2 = c.claim("w2", &next).await?.ok_or("the next event of the key was not claimable after its head was skipped")?;
    let a2 = c.register(&ce2.token).await?;
    eq("next's receipt", c.accept(&receipt(&ce2, &a2, c.offset(2))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;

    // The head's send did reach the log after all: its copy is evidence, the head stays SKIPPED.
    eq("late copy of the skipped head", c.accept(&receipt(&ce, &a, c.offset(3))).await?, ReceiptDecision::Duplicate)?;
    c.expect_state(&head, EventState::Skipped).await?;
    ensure(c.state(&head).await?.1.is_none(), || "a SKIPPED event's slot was filled".into())
}

/// The other way out of a blocked key: a re-send. A QUARANTINED head
/// stopped before any send (its destination found unreadable at the claim)
/// is re-sent under a new envelope generation to the same destination
/// (`outbox migrate-destination` with the route as it is): only at the
/// claim generation it was read at; it is then PENDING, claimed, sent and
/// published under generation 2, and the key's next event goes on. A head
/// quarantined by a divergent receipt (its attempt's message is in the log)
/// is never re-sent, and stays QUARANTINED; a PENDING event is never
/// "re-sent" to the destination it already has.
pub(super) async fn resend_of_a_quarantined_head_publishes_it_under_a_new_generation<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let head = c.emit(1, "k").await;
    let next = c.emit(2, "k").await;
    let ce = c.claim_some("w1", &head).await?;
    let out = c.s().quarantine_claimed(&ce.token, "destination_unreadable", serde_json::json!({"detail": "frozen destination does not parse"})).await.map_err(err("quarantine_claimed"))?;
    eq("quarantine", out, FenceOutcome::Applied)?;
    c.expect_state(&head, EventState::Quarantined).await?;
    ensure(c.claim("w2", &next).await?.is_none(), || "the next event of a key was claimable behind a QUARANTINED head".into())?;

    let read = ce.token.claim_generation;
    let stale = c.h.commit_migration(&head, super::TOPIC, &MigrationFence::Quarantined(read + 1), None).await?;
    ensure(stale.is_err(), || format!("re-sent at a claim generation it was not read at: {stale:?}"))?;
    let pending = c.h.commit_migration(&next, super::TOPIC, &MigrationFence::Generation(0), None).await?;
    ensure(pending.as_ref().is_err_and(|r| r.contains("same destination")), || format!("a PENDING event moved to the destination it has: {pending:?}"))?;
    c.expect_state(&head, EventState::Quarantined).await?;

    eq("re-send of the quarantined head", c.h.commit_migration(&head, super::TOPIC, &MigrationFence::Quarantined(read), None).await?, Ok(2))?;
    c.expect_state(&head, EventState::Pending).await?;
    ensure(c.claim("w2", &next).await?.is_none(), || "the next event of a key was claimable while its re-sent head is PENDING".into())?;
    let again = c.h.commit_migration(&head, super::TOPIC, &MigrationFence::Quarantined(read), None).await?;
    ensure(again.is_err(), || format!("re-sent twice from one read: {again:?}"))?;

    let ce2 = c.claim("w3", &head).await?.ok_or("the re-sent head was not claimable")?;
    eq("the claim's envelope generation", ce2.envelope.envelope_generation, 2)?;
    let a2 = c.register(&ce2.token).await?;
    eq("re-sent head's receipt", c.accept(&receipt(&ce2, &a2, c.offset(1))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    c.expect_state(&head, EventState::Published).await?;
    let ce3 = c.claim("w3", &next).await?.ok_or("the next event of the key was not claimable after its head was re-sent and published")?;
    let a3 = c.register(&ce3.token).await?;
    eq("next's receipt", c.accept(&receipt(&ce3, &a3, c.offset(2))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;

    // Quarantined by a divergent receipt: its attempt wrote to the log.
    let diverged = c.emit(3, "d").await;
    let ce4 = c.claim_some("w1", &diverged).await?;
    let a4 = c.register(&ce4.token).await?;
    let mut bad = receipt(&ce4, &a4, c.offset(3));
    bad.payload_digest = outbox_core::sha256_digest(b"other bytes");
    ensure(matches!(c.accept(&bad).await?, ReceiptDecision::Quarantine { move_event: true, .. }), || "a divergent receipt did not quarantine".into())?;
    c.expect_state(&diverged, EventState::Quarantined).await?;
    let refused = c.h.commit_migration(&diverged, super::TOPIC, &MigrationFence::Quarantined(ce4.token.claim_generation + 1), None).await?;
    let refused_at_read = c.h.commit_migration(&diverged, super::TOPIC, &MigrationFence::Quarantined(ce4.token.claim_generation), None).await?;
    ensure(refused.is_err() && refused_at_read.is_err(), || format!("an event quarantined by a divergent receipt was re-sent: {refused:?} {refused_at_read:?}"))?;
    c.expect_state(&diverged, EventState::Quarantined).await
}

/// A route's poison policy: with none set, and with `block`, a release
/// leaves a QUARANTINED head holding its key; with `skip` (who, why), the
/// release closes it SKIPPED as an operator's skip would, under
/// [`POISON_POLICY_ACTOR`] with a reason naming the policy's setter and
/// reason, and the key's next event is claimable.
pub(super) async fn a_routes_poison_policy_releases_its_quarantined_heads<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let (head, next) = quarantined_head(c).await?;
    let mine = |records: &[SkipRecord]| records.iter().find(|r| r.event_id == head.as_str()).cloned();
    ensure(mine(&c.h.release_poisoned(1_000).await?).is_none(), || "a release without a policy skipped the head".into())?;
    c.expect_state(&head, EventState::Quarantined).await?;

    let rule = |policy, actor: &str, reason: &str| PoisonRule { event_type: "order.created".into(), policy, actor: actor.into(), reason: reason.into(), at_ms: 0 };
    c.h.set_poison_policy(&rule(PoisonPolicy::Block, "oncall-bob", "gaps need a person (OPS-48)")).await?;
    ensure(mine(&c.h.release_poisoned(1_000).await?).is_none(), || "a release under block skipped the head".into())?;
    c.expect_state(&head, EventState::Quarantined).await?;
    ensure(c.claim("w1", &next).await?.is_none(), || "the next event of a key was claimable behind a QUARANTINED head".into())?;

    let skip = rule(PoisonPolicy::Skip, "oncall-bob", "order events accept gaps (OPS-49)");
    c.h.set_poison_policy(&skip).await?;
    let rec = mine(&c.h.release_poisoned(1_000).await?).ok_or("a release under skip left the QUARANTINED head")?;
    eq("released from", rec.from_state, EventState::Quarantined)?;
    eq("released by", rec.operator.as_str(), POISON_POLICY_ACTOR)?;
    eq("released for", rec.reason.clone(), skip.skip_reason())?;
    c.expect_state(&head, EventState::Skipped).await?;
    eq("skip records", c.h.skip_records(&head).await?.len(), 1)?;
    ensure(mine(&c.h.release_poisoned(1_000).await?).is_none(), || "a SKIPPED event was released again".into())?;
    let ce2 = c.claim("w1", &next).await?.ok_or("the next event of the key was not claimable after its head was released")?;
    let a2 = c.register(&ce2.token).await?;
    eq("next's receipt", c.accept(&receipt(&ce2, &a2, c.offset(1))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    c.h.set_poison_policy(&rule(PoisonPolicy::Block, "oncall-bob", "back to the default (OPS-50)")).await
}
