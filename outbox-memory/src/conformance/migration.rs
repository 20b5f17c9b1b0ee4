//! Destination migration (PROTOCOL §7): the commit's fence.

use outbox_core::migration::MigrationFence;
use outbox_core::state::{AttemptState, EventState};
use outbox_core::store::{FenceOutcome, LookupOutcome, OutboxStore};

use super::ctx::{ensure, eq, err, Ctx};
use super::{Harness, Verdict, POLICY};

/// The migration commit's fence (`check_migration_fence`) on both stores:
/// a PENDING event moves only at the claim generation it was read at, and a
/// proven-absent move only under the very reconcile claim its lookup was
/// made under. A refused commit changes nothing (no new generation, the
/// attempts still UNKNOWN); a fenced one then moves and closes them ABSENT.
pub(super) async fn migration_commit_is_fenced<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let to = format!("{}-moved", c.prefix);
    // PENDING, never claimed: generation 0.
    let fresh = c.emit(1, "a").await;
    eq("a PENDING event read at its generation", c.h.commit_migration(&fresh, &to, &MigrationFence::Generation(0), None).await?, Ok(2))?;
    c.expect_state(&fresh, EventState::Pending).await?;
    let claimed = c.emit(2, "b").await;
    let ce = c.claim_some("w1", &claimed).await?;
    eq("release", c.s().release(&ce.token).await.map_err(err("release"))?, FenceOutcome::Applied)?;
    ensure(c.h.commit_migration(&claimed, &to, &MigrationFence::Generation(0), None).await?.is_err(), || "moved although claimed since it was read".into())?;

    let unknown = c.emit(3, "c").await;
    let ce = c.claim_some("w1", &unknown).await?;
    let a = c.register(&ce.token).await?;
    c.expire().await?;
    c.h.advance_ms(POLICY.in_flight_bound_ms);
    let operator = c.reconcile("operator", &unknown).await?;
    // The operator's claim runs out after its lookup; a reconciler takes the event.
    c.expire().await?;
    let reconciler = c.reconcile("r1", &unknown).await?;
    let stale = c.h.commit_migration(&unknown, &to, &MigrationFence::Claim(operator.token.clone()), Some(&LookupOutcome::Absent)).await?;
    ensure(stale.is_err(), || format!("moved under a lost reconcile claim: {stale:?}"))?;
    c.expect_state(&unknown, EventState::Reconciling).await?;
    eq("attempts after the refused commit", c.attempts(&unknown).await?.into_iter().map(|x| x.state).collect::<Vec<_>>(), vec![AttemptState::Unknown])?;
    eq("under the current claim", c.h.commit_migration(&unknown, &to, &MigrationFence::Claim(reconciler.token.clone()), Some(&LookupOutcome::Absent)).await?, Ok(2))?;
    c.expect_state(&unknown, EventState::Pending).await?;
    eq("attempts after the move", c.attempts(&unknown).await?.into_iter().map(|x| (x.attempt_id, x.state)).collect::<Vec<_>>(), vec![(a.attempt_id, AttemptState::Absent)])
}
