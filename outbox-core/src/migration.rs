//! Destination-migration decisions (PROTOCOL §7), with no I/O.
//!
//! [`decide_migration`]: an undelivered event moves to another
//! cluster/topic only when the old target provably does not hold it: either
//! it is PENDING and no attempt may have reached the old target, or it is
//! DISPATCH_UNKNOWN and [`decide_reconcile`] proves absence. A QUARANTINED
//! event with no attempt that may have reached the old target (tampering or
//! an unreadable destination found before any send) is re-sent under a new
//! envelope generation, to a new destination or to the same one
//! ([`may_keep_destination`]): an operator's way out of a blocked key that
//! keeps the event instead of skipping it. While the old
//! target is UNKNOWN and cannot be asked, the move is refused: no
//! cross-target re-send in disguise. [`check_migration_fence`]: the commit
//! goes through only under the claim its proof was made under.
//!
//! The PostgreSQL migration (`outbox_producer::migration`), the in-memory
//! store (`outbox_memory::MemoryStore::migrate`) and the simulator call
//! these functions.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::claim::ClaimToken;
use crate::log::LookupOutcome;
use crate::receipt::{AttemptRecord, BrokerReceipt};
use crate::reconcile::{decide_reconcile, scan_lower_bound, RecheckReason, ReconcileDecision, RetryPolicy};
use crate::state::{AttemptState, EventState};

/// What proves that the old target does not hold the event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum MigrationProof {
    /// PENDING or QUARANTINED, and no attempt may be in the old target
    /// (none in flight, none acknowledged).
    NeverPersisted,
    /// DISPATCH_UNKNOWN, and a lookup of the frozen partition from
    /// `lookup_from_offset` found nothing while no attempt may still be in flight.
    ProvenAbsent {
        /// Where the scan started ([`scan_lower_bound`]).
        lookup_from_offset: i64,
    },
}

/// Why a migration is refused. Nothing is sent anywhere.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "refusal")]
pub enum MigrationRefusal {
    /// Only PENDING, QUARANTINED (nothing sent) or proven-absent
    /// DISPATCH_UNKNOWN events can move.
    NotMovable {
        /// The event's state.
        state: EventState,
    },
    /// PENDING or QUARANTINED, but an earlier attempt may be in the old
    /// target (in flight or acknowledged).
    AttemptMayBeInOldTarget,
    /// DISPATCH_UNKNOWN and the old target cannot be asked.
    OldTargetUnqueryable {
        /// Why.
        detail: String,
    },
    /// The old target holds the event: submit these receipts through
    /// `acceptDispatchReceipt` instead of moving.
    OldTargetHoldsEvent {
        /// What the lookup found.
        receipts: Vec<BrokerReceipt>,
    },
    /// Absence is not proven for another reason (an attempt may still be in
    /// flight, retry policy, attempt budget).
    Unproven {
        /// The reconcile decision's reason.
        reason: RecheckReason,
    },
}

impl MigrationRefusal {
    /// The reconcile recheck a migrator holding a reconcile claim finishes with.
    pub fn recheck(&self, policy: &RetryPolicy, now_ms: i64) -> ReconcileDecision {
        let reason = match self {
            MigrationRefusal::Unproven { reason } => *reason,
            MigrationRefusal::OldTargetHoldsEvent { .. } => RecheckReason::ReceiptsRefused,
            _ => RecheckReason::BrokerUnavailable,
        };
        ReconcileDecision::Recheck { reason, next_check_at_ms: now_ms.saturating_add(policy.recheck_ms) }
    }
}

impl fmt::Display for MigrationRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MigrationRefusal::NotMovable { state } => write!(f, "state {state}: only PENDING, QUARANTINED with nothing sent, or proven-absent DISPATCH_UNKNOWN events can move"),
            MigrationRefusal::AttemptMayBeInOldTarget => f.write_str("an earlier attempt may be in the old target"),
            MigrationRefusal::OldTargetUnqueryable { detail } => write!(f, "old target unknown and unqueryable ({detail})"),
            MigrationRefusal::OldTargetHoldsEvent { receipts } => write!(f, "the old target holds the event ({} message(s))", receipts.len()),
            MigrationRefusal::Unproven { .. } => f.write_str("an attempt may still be in flight to the old target"),
        }
    }
}

/// What a migration request comes to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "decision")]
pub enum MigrationDecision {
    /// Move: write envelope generation + 1 with the new destination and a migration receipt carrying `proof`.
    Move {
        /// Why the old target does not hold the event.
        proof: MigrationProof,
    },
    /// Do not move.
    Refuse(MigrationRefusal),
}

/// Decides whether an event in `state` with `attempts` may move to another
/// destination. `lookup` is the old target's answer for the frozen partition
/// (from [`scan_lower_bound`]); `None` when it was not (or could not be) asked.
///
/// * PENDING: moves when no attempt may be in flight or was acknowledged.
/// * QUARANTINED: the same rule. An event quarantined by a divergent
///   receipt never moves: that receipt's attempt reached a log (its state
///   stays SENDING, UNKNOWN or ACKED), and consumers may have applied what
///   it wrote. Only an event stopped before any send (its stored payload
///   or destination found tampered or unreadable) is re-sent; the way out
///   for the others is an operator's skip ([`crate::skip`]).
/// * DISPATCH_UNKNOWN: moves only when [`decide_reconcile`] (with a broker
///   that can look up) answers `Retry { proven_absent: true }`.
/// * anything else: refused.
pub fn decide_migration(state: EventState, attempts: &[AttemptRecord], lookup: Option<&LookupOutcome>, policy: &RetryPolicy, now_ms: i64) -> MigrationDecision {
    use MigrationDecision::{Move, Refuse};
    match state {
        EventState::Quarantined if crate::simulation::mutation_active("quarantine-resend-unproven") => Move { proof: MigrationProof::NeverPersisted },
        EventState::Pending | EventState::Quarantined => {
            if attempts.iter().any(|a| a.state.possibly_in_flight() || a.state == AttemptState::Acked) {
                Refuse(MigrationRefusal::AttemptMayBeInOldTarget)
            } else {
                Move { proof: MigrationProof::NeverPersisted }
            }
        }
        EventState::DispatchUnknown => {
            let Some(lookup) = lookup else {
                return Refuse(MigrationRefusal::OldTargetUnqueryable { detail: "the old target was not asked".into() });
            };
            let decision = if crate::simulation::mutation_active("migration-without-proof") {
                ReconcileDecision::Retry { proven_absent: true }
            } else {
                decide_reconcile(attempts, lookup, true, policy, now_ms)
            };
            match decision {
                ReconcileDecision::Retry { proven_absent: true } => Move { proof: MigrationProof::ProvenAbsent { lookup_from_offset: scan_lower_bound(attempts) } },
                ReconcileDecision::Submit(receipts) => Refuse(MigrationRefusal::OldTargetHoldsEvent { receipts }),
                ReconcileDecision::Recheck { reason: RecheckReason::BrokerUnavailable, .. } | ReconcileDecision::Retry { proven_absent: false } => {
                    let detail = match lookup {
                        LookupOutcome::Unavailable(e) => e.clone(),
                        _ => "no absence proof".into(),
                    };
                    Refuse(MigrationRefusal::OldTargetUnqueryable { detail })
                }
                ReconcileDecision::Recheck { reason, .. } => Refuse(MigrationRefusal::Unproven { reason }),
            }
        }
        other => Refuse(MigrationRefusal::NotMovable { state: other }),
    }
}

/// What a migration's proof was made under, checked again by its commit
/// under the row lock ([`check_migration_fence`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MigrationFence {
    /// PENDING at this claim generation, as first read (any claim since bumps it).
    Generation(u64),
    /// QUARANTINED at this claim generation, as first read (a skip, or
    /// another re-send, since bumps it).
    Quarantined(u64),
    /// RECONCILING under this reconcile claim: the one the old target's
    /// lookup was made under.
    Claim(ClaimToken),
}

/// Whether a migration's commit may go on: the locked row (`state`,
/// `claim_generation`, `owner`) is still what the proof was made under
/// (`fence`). Answers the state [`decide_migration`] is re-run as on the
/// attempts read under the lock (PENDING, or DISPATCH_UNKNOWN for a
/// proven-absent move), or why the proof no longer holds.
///
/// A lookup's absence proof speaks only for the log as it was while its
/// reconcile claim was held: once that claim is lost, another reconciler
/// may have retried and a dispatcher sent a new attempt the lookup never
/// saw, so the commit must be made under the very same claim.
pub fn check_migration_fence(fence: &MigrationFence, state: EventState, claim_generation: u64, owner: Option<&str>) -> Result<EventState, String> {
    let decide_as = match fence {
        MigrationFence::Generation(_) => EventState::Pending,
        MigrationFence::Quarantined(_) => EventState::Quarantined,
        MigrationFence::Claim(_) => EventState::DispatchUnknown,
    };
    if crate::simulation::mutation_active("migration-unfenced") {
        return Ok(decide_as);
    }
    match fence {
        MigrationFence::Generation(read) | MigrationFence::Quarantined(read) => {
            if state != decide_as || claim_generation != *read {
                return Err(format!("the event changed meanwhile (now {state}, claim generation {claim_generation}, read at {read}): its proof no longer holds"));
            }
            Ok(decide_as)
        }
        MigrationFence::Claim(token) => {
            if state != EventState::Reconciling || claim_generation != token.claim_generation || owner != Some(token.owner.as_str()) {
                return Err(format!("the reconcile claim the absence proof was made under was lost (now {state}, claim generation {claim_generation})"));
            }
            Ok(decide_as)
        }
    }
}

/// Whether a migration from `state` may keep the event's destination: a
/// re-send of a QUARANTINED event (nothing of it in the log, the new
/// envelope generation written from the route as it is now, which also
/// mends a destination that no longer reads). Any other move is to another
/// destination, or it is no move.
pub fn may_keep_destination(state: EventState) -> bool {
    state == EventState::Quarantined
}

/// The [`MigrationFence`] a move decided on the first read (`state`,
/// `claim_generation`) commits under, for the states that move without a
/// lookup (PENDING, QUARANTINED); `None` for the others.
pub fn read_fence(state: EventState, claim_generation: u64) -> Option<MigrationFence> {
    match state {
        EventState::Pending => Some(MigrationFence::Generation(claim_generation)),
        EventState::Quarantined => Some(MigrationFence::Quarantined(claim_generation)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attempt(state: AttemptState, started_at_ms: i64) -> AttemptRecord {
        crate::receipt::sample_attempt(state, started_at_ms, 4)
    }

    const P: RetryPolicy = RetryPolicy { allow_retry: true, max_attempts: 5, in_flight_bound_ms: 1_000, recheck_ms: 500 };

    #[test]
    fn pending_moves_only_without_possible_delivery() {
        assert_eq!(decide_migration(EventState::Pending, &[], None, &P, 0), MigrationDecision::Move { proof: MigrationProof::NeverPersisted });
        let closed = [attempt(AttemptState::NotSent, 0), attempt(AttemptState::Absent, 1)];
        assert_eq!(decide_migration(EventState::Pending, &closed, None, &P, 0), MigrationDecision::Move { proof: MigrationProof::NeverPersisted });
        for s in [AttemptState::Sending, AttemptState::Unknown, AttemptState::Acked] {
            assert_eq!(decide_migration(EventState::Pending, &[attempt(s, 0)], None, &P, 0), MigrationDecision::Refuse(MigrationRefusal::AttemptMayBeInOldTarget), "{s}");
        }
    }

    #[test]
    fn unknown_moves_only_when_proven_absent() {
        let a = [attempt(AttemptState::Unknown, 0)];
        assert_eq!(
            decide_migration(EventState::DispatchUnknown, &a, Some(&LookupOutcome::Absent), &P, 5_000),
            MigrationDecision::Move { proof: MigrationProof::ProvenAbsent { lookup_from_offset: 4 } }
        );
        // Not asked, or unqueryable: refused (never a cross-target re-send while UNKNOWN).
        assert!(matches!(decide_migration(EventState::DispatchUnknown, &a, None, &P, 5_000), MigrationDecision::Refuse(MigrationRefusal::OldTargetUnqueryable { .. })));
        assert_eq!(
            decide_migration(EventState::DispatchUnknown, &a, Some(&LookupOutcome::Unavailable("down".into())), &P, 5_000),
            MigrationDecision::Refuse(MigrationRefusal::OldTargetUnqueryable { detail: "down".into() })
        );
        // Absent but an attempt may still land: refused.
        let young = [attempt(AttemptState::Unknown, 4_500)];
        assert_eq!(
            decide_migration(EventState::DispatchUnknown, &young, Some(&LookupOutcome::Absent), &P, 5_000),
            MigrationDecision::Refuse(MigrationRefusal::Unproven { reason: RecheckReason::AttemptInFlight })
        );
        // Policy forbids retries: the same rule as reconcile refuses.
        let no = RetryPolicy { allow_retry: false, ..P };
        assert_eq!(
            decide_migration(EventState::DispatchUnknown, &a, Some(&LookupOutcome::Absent), &no, 5_000),
            MigrationDecision::Refuse(MigrationRefusal::Unproven { reason: RecheckReason::RetryNotAllowed })
        );
    }

    #[test]
    fn found_in_the_old_target_is_refused_with_the_receipts() {
        let r = crate::receipt::sample_receipt(11);
        let d = decide_migration(EventState::DispatchUnknown, &[attempt(AttemptState::Unknown, 0)], Some(&LookupOutcome::Found(vec![r.clone()])), &P, 5_000);
        assert_eq!(d, MigrationDecision::Refuse(MigrationRefusal::OldTargetHoldsEvent { receipts: vec![r] }));
    }

    #[test]
    fn a_quarantined_event_is_resent_only_when_nothing_of_it_may_be_in_a_log() {
        // Stopped before any send (tampering found at the claim): re-sent.
        assert_eq!(decide_migration(EventState::Quarantined, &[], None, &P, 0), MigrationDecision::Move { proof: MigrationProof::NeverPersisted });
        let closed = [attempt(AttemptState::NotSent, 0), attempt(AttemptState::Absent, 1)];
        assert_eq!(decide_migration(EventState::Quarantined, &closed, None, &P, 0), MigrationDecision::Move { proof: MigrationProof::NeverPersisted });
        // Quarantined by a divergent receipt: its attempt reached a log.
        for s in [AttemptState::Sending, AttemptState::Unknown, AttemptState::Acked] {
            assert_eq!(decide_migration(EventState::Quarantined, &[attempt(s, 0)], None, &P, 0), MigrationDecision::Refuse(MigrationRefusal::AttemptMayBeInOldTarget), "{s}");
        }
        assert!(may_keep_destination(EventState::Quarantined));
        for s in crate::state::ALL_STATES.into_iter().filter(|s| *s != EventState::Quarantined) {
            assert!(!may_keep_destination(s), "{s}");
        }
    }

    #[test]
    fn a_resend_commits_only_while_the_event_is_quarantined_at_the_generation_read() {
        let read = read_fence(EventState::Quarantined, 3).unwrap();
        assert_eq!(read, MigrationFence::Quarantined(3));
        assert_eq!(check_migration_fence(&read, EventState::Quarantined, 3, None), Ok(EventState::Quarantined));
        // Skipped, or re-sent by another operator, meanwhile.
        assert!(check_migration_fence(&read, EventState::Skipped, 4, None).is_err());
        assert!(check_migration_fence(&read, EventState::Pending, 4, None).is_err());
        assert!(check_migration_fence(&read, EventState::Quarantined, 4, None).is_err());
        assert_eq!(read_fence(EventState::Pending, 2), Some(MigrationFence::Generation(2)));
        assert_eq!(read_fence(EventState::DispatchUnknown, 2), None);
    }

    #[test]
    fn other_states_never_move() {
        for s in crate::state::ALL_STATES {
            if matches!(s, EventState::Pending | EventState::DispatchUnknown | EventState::Quarantined) {
                continue;
            }
            assert_eq!(decide_migration(s, &[], Some(&LookupOutcome::Absent), &P, 5_000), MigrationDecision::Refuse(MigrationRefusal::NotMovable { state: s }));
        }
    }

    #[test]
    fn a_migration_commits_only_under_what_its_proof_was_made_under() {
        use crate::id::EventId;
        let token = ClaimToken { event_id: EventId::from_parts(1, 1), owner: "migrate-ops".into(), claim_generation: 4, lease_until_ms: 9_000 };
        let claim = MigrationFence::Claim(token);
        assert_eq!(check_migration_fence(&claim, EventState::Reconciling, 4, Some("migrate-ops")), Ok(EventState::DispatchUnknown));
        // Lost: taken by another reconciler, expired, or done with.
        assert!(check_migration_fence(&claim, EventState::Reconciling, 6, Some("r-1")).is_err());
        assert!(check_migration_fence(&claim, EventState::Reconciling, 4, Some("r-1")).is_err());
        assert!(check_migration_fence(&claim, EventState::DispatchUnknown, 5, None).is_err());
        assert!(check_migration_fence(&claim, EventState::Published, 7, None).is_err());
        let read = MigrationFence::Generation(3);
        assert_eq!(check_migration_fence(&read, EventState::Pending, 3, None), Ok(EventState::Pending));
        assert!(check_migration_fence(&read, EventState::Pending, 5, None).is_err());
        assert!(check_migration_fence(&read, EventState::Claimed, 4, Some("d1")).is_err());
    }

    #[test]
    fn refusals_recheck_like_the_reconciler() {
        let u = MigrationRefusal::OldTargetUnqueryable { detail: "x".into() };
        assert_eq!(u.recheck(&P, 10), ReconcileDecision::Recheck { reason: RecheckReason::BrokerUnavailable, next_check_at_ms: 510 });
        let f = MigrationRefusal::Unproven { reason: RecheckReason::AttemptInFlight };
        assert_eq!(f.recheck(&P, 10), ReconcileDecision::Recheck { reason: RecheckReason::AttemptInFlight, next_check_at_ms: 510 });
    }
}
