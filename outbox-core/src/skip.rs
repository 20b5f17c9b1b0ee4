//! An operator's way out of a blocked key (issue 47): SKIPPED.
//!
//! With per-key ordering, an event that holds its key and cannot move on
//! blocks every later event of the key: a QUARANTINED event has no way out,
//! and a DISPATCH_UNKNOWN event whose absence cannot be proven cannot be
//! retried or migrated. An operator may close such an event as SKIPPED
//! (`outbox skip <event-id> --operator <name> --reason <text>`): it is never
//! published by the outbox, it no longer holds its key, and the key's next
//! event becomes claimable. The store writes the transition and its
//! evidence (who, when, why, from which state) in one transaction, under
//! the event's row lock, after [`decide_skip`] on the locked row.
//!
//! Only the two blocked states can be skipped. Everything else is refused
//! with a reason: an event on its way (PENDING, CLAIMED, SENDING,
//! RETRY_CLAIMED) is the dispatcher's; a RECONCILING event is under a
//! reconciler's fenced lease, which may be about to fill the slot; a
//! published event is in the log already.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::state::EventState;

/// The audit action a skip is recorded under (`outbox_audit.action`, the
/// in-memory store's audit records).
pub const SKIP_ACTION: &str = "skip";

/// The longest reason accepted, in bytes.
pub const MAX_SKIP_REASON_BYTES: usize = 1_000;

/// The states a skip may close.
pub const SKIPPABLE_STATES: [EventState; 2] = [EventState::Quarantined, EventState::DispatchUnknown];

/// Why a skip was refused. Nothing changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "refusal")]
pub enum SkipRefusal {
    /// The reason is empty (or only whitespace).
    NoReason,
    /// The reason is longer than [`MAX_SKIP_REASON_BYTES`].
    ReasonTooLong {
        /// Its length in bytes.
        bytes: usize,
    },
    /// Already SKIPPED.
    AlreadySkipped,
    /// PUBLISHED, RETAINED or PURGED: the event is in the log.
    Published {
        /// The event's state.
        state: EventState,
    },
    /// PENDING, CLAIMED, SENDING or RETRY_CLAIMED: on its way, not blocked.
    NotBlocked {
        /// The event's state.
        state: EventState,
    },
    /// RECONCILING: a reconciler holds the fenced lease and may yet find
    /// the event in the log.
    UnderReconcile,
    /// A claim is held on the event (a lease not yet swept).
    ClaimHeld {
        /// Its owner.
        owner: String,
    },
}

impl fmt::Display for SkipRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SkipRefusal::NoReason => f.write_str("a skip needs a reason (--reason): it is recorded as the evidence of the gap"),
            SkipRefusal::ReasonTooLong { bytes } => write!(f, "the reason is {bytes} bytes; at most {MAX_SKIP_REASON_BYTES}"),
            SkipRefusal::AlreadySkipped => f.write_str("the event is already SKIPPED"),
            SkipRefusal::Published { state } => write!(f, "the event is {state}: it is in the log, there is nothing to skip"),
            SkipRefusal::NotBlocked { state } => {
                write!(f, "the event is {state}: it is on its way to the log, not blocked; only QUARANTINED or DISPATCH_UNKNOWN events can be skipped")
            }
            SkipRefusal::UnderReconcile => {
                f.write_str("the event is RECONCILING: a reconciler holds its lease and may still find it in the log; retry after the reconcile round (or its lease) ends")
            }
            SkipRefusal::ClaimHeld { owner } => write!(f, "a claim of {owner} is held on the event; retry once its lease is swept"),
        }
    }
}

impl std::error::Error for SkipRefusal {}

/// Whether an event in `state`, with claim owner `claim_owner` (as read
/// under its row lock), may be skipped for `reason`: `Ok(from)`, the state
/// it leaves (QUARANTINED or DISPATCH_UNKNOWN), or the refusal.
pub fn decide_skip(state: EventState, claim_owner: Option<&str>, reason: &str) -> Result<EventState, SkipRefusal> {
    if reason.trim().is_empty() {
        return Err(SkipRefusal::NoReason);
    }
    if reason.len() > MAX_SKIP_REASON_BYTES {
        return Err(SkipRefusal::ReasonTooLong { bytes: reason.len() });
    }
    match state {
        EventState::Quarantined | EventState::DispatchUnknown => {
            if let Some(owner) = claim_owner {
                return Err(SkipRefusal::ClaimHeld { owner: owner.to_owned() });
            }
            debug_assert!(state.can_transition_to(EventState::Skipped));
            Ok(state)
        }
        EventState::Skipped => Err(SkipRefusal::AlreadySkipped),
        EventState::Reconciling => Err(SkipRefusal::UnderReconcile),
        EventState::Published | EventState::Retained | EventState::Purged => Err(SkipRefusal::Published { state }),
        EventState::Pending | EventState::Claimed | EventState::Sending | EventState::RetryClaimed => Err(SkipRefusal::NotBlocked { state }),
    }
}

/// The evidence of one skip: who, when, why, and from which state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkipRecord {
    /// The skipped event.
    pub event_id: String,
    /// The state it left.
    pub from_state: EventState,
    /// Who skipped it.
    pub operator: String,
    /// Why.
    pub reason: String,
    /// When, ms since the epoch (the store's clock).
    pub at_ms: i64,
    /// Its claim generation after the skip (bumped: every earlier claim
    /// holder is fenced).
    pub claim_generation: u64,
    /// Since when it was DISPATCH_UNKNOWN, for a skipped unknown.
    pub unknown_since_ms: Option<i64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{ALL_STATES, TRANSITIONS};
    use EventState::*;

    #[test]
    fn the_two_blocked_states_are_skipped() {
        assert_eq!(decide_skip(Quarantined, None, "poison payload, ticket 12"), Ok(Quarantined));
        assert_eq!(decide_skip(DispatchUnknown, None, "cluster gone"), Ok(DispatchUnknown));
    }

    #[test]
    fn every_other_state_is_refused_with_its_reason() {
        for s in [Pending, Claimed, Sending, RetryClaimed] {
            assert_eq!(decide_skip(s, None, "x"), Err(SkipRefusal::NotBlocked { state: s }), "{s}");
        }
        for s in [Published, Retained, Purged] {
            assert_eq!(decide_skip(s, None, "x"), Err(SkipRefusal::Published { state: s }), "{s}");
        }
        assert_eq!(decide_skip(Reconciling, Some("rec-1"), "x"), Err(SkipRefusal::UnderReconcile));
        assert_eq!(decide_skip(Skipped, None, "x"), Err(SkipRefusal::AlreadySkipped));
        assert!(decide_skip(Pending, None, "x").unwrap_err().to_string().contains("not blocked"));
        assert!(decide_skip(Published, None, "x").unwrap_err().to_string().contains("in the log"));
    }

    #[test]
    fn a_held_claim_or_a_missing_reason_is_refused() {
        assert_eq!(decide_skip(DispatchUnknown, Some("d1"), "x"), Err(SkipRefusal::ClaimHeld { owner: "d1".into() }));
        assert_eq!(decide_skip(Quarantined, None, "  "), Err(SkipRefusal::NoReason));
        assert_eq!(decide_skip(Quarantined, None, &"r".repeat(MAX_SKIP_REASON_BYTES + 1)), Err(SkipRefusal::ReasonTooLong { bytes: MAX_SKIP_REASON_BYTES + 1 }));
    }

    #[test]
    fn the_decision_agrees_with_the_transition_table() {
        for s in ALL_STATES {
            assert_eq!(decide_skip(s, None, "x").is_ok(), TRANSITIONS.contains(&(s, Skipped)), "{s}");
            assert_eq!(decide_skip(s, None, "x").is_ok(), SKIPPABLE_STATES.contains(&s), "{s}");
        }
    }
}

/// What a route does with an event of its type that blocks its key for
/// good (QUARANTINED): block the key until an operator decides (the
/// default), or skip the event and record the gap (the key moves on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoisonPolicy {
    /// The key waits behind its QUARANTINED event until an operator skips
    /// it (or the cause is repaired): nothing is lost without a person's
    /// decision.
    #[default]
    Block,
    /// The reconciler closes a QUARANTINED event SKIPPED in its next round,
    /// with the evidence an operator's skip keeps (who set the policy, and
    /// why, in the skip's reason): the key moves on; consumers see a gap.
    Skip,
}

impl PoisonPolicy {
    /// Its name (`block`, `skip`).
    pub fn as_str(self) -> &'static str {
        match self {
            PoisonPolicy::Block => "block",
            PoisonPolicy::Skip => "skip",
        }
    }

    /// The policy named `s`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "block" => Ok(PoisonPolicy::Block),
            "skip" => Ok(PoisonPolicy::Skip),
            other => Err(format!("poison policy is block or skip, not {other:?}")),
        }
    }
}

impl fmt::Display for PoisonPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The operator name a skip made by a poison policy is recorded under.
pub const POISON_POLICY_ACTOR: &str = "poison-policy";

/// A route's poison policy as set: by whom, why, when. The latest setting
/// of an event type is the one in force; none means [`PoisonPolicy::Block`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoisonRule {
    /// The event type (the route) it applies to.
    pub event_type: String,
    /// The policy.
    pub policy: PoisonPolicy,
    /// Who set it (an identifier).
    pub actor: String,
    /// Why.
    pub reason: String,
    /// When, ms.
    pub at_ms: i64,
}

impl PoisonRule {
    /// Checks a setting before it is stored: the actor an identifier, a
    /// reason given and not longer than [`MAX_SKIP_REASON_BYTES`].
    pub fn validate(&self) -> Result<(), crate::CoreError> {
        crate::id::validate_identifier("poison policy actor", &self.actor)?;
        crate::id::validate_identifier("event type", &self.event_type)?;
        if self.reason.trim().is_empty() || self.reason.len() > MAX_SKIP_REASON_BYTES {
            return Err(crate::CoreError::MalformedIdentifier {
                field: "poison policy reason",
                reason: format!("1 to {MAX_SKIP_REASON_BYTES} bytes, not blank ({} bytes given)", self.reason.len()),
            });
        }
        Ok(())
    }

    /// The reason a skip made under this rule records: the rule's setter and
    /// reason, so the evidence names the person behind the decision.
    pub fn skip_reason(&self) -> String {
        format!("route {}'s poison policy is skip (set by {}: {})", self.event_type, self.actor, self.reason)
    }
}
