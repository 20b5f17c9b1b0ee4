//! The closed state machine of an event (PROTOCOL §3) and of an attempt.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::CoreError;

/// The delivery state of one event. Stored as the upper-case name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum EventState {
    /// Committed, waiting for a dispatcher.
    Pending,
    /// A dispatcher holds a fenced claim; nothing has been sent.
    Claimed,
    /// An attempt is registered and its send may be on the wire.
    Sending,
    /// The publish slot holds the primary receipt.
    Published,
    /// Published and past the replay window, waiting for consumers.
    Retained,
    /// Payload deleted; a tombstone with digests and receipt remains.
    Purged,
    /// Sent, outcome not known (timeout, possibly persisted, lease expired while sending).
    DispatchUnknown,
    /// A reconciler holds the fenced right to resolve the unknown.
    Reconciling,
    /// Proven absent: a retry to the same frozen destination is claimed.
    RetryClaimed,
    /// Payload or destination divergence; evidence kept, nothing sent.
    Quarantined,
    /// Closed by an operator (`outbox skip`, [`crate::skip`]) from
    /// QUARANTINED or DISPATCH_UNKNOWN: never published by the outbox, it no
    /// longer holds its ordering key, and the later events of its key go on.
    /// Terminal. Consumers see a gap in the key's sequence (and, for a
    /// skipped DISPATCH_UNKNOWN, perhaps a late copy the send left in the log).
    Skipped,
}

/// Every state, in the order of PROTOCOL §3.
pub const ALL_STATES: [EventState; 11] = [
    EventState::Pending,
    EventState::Claimed,
    EventState::Sending,
    EventState::Published,
    EventState::Retained,
    EventState::Purged,
    EventState::DispatchUnknown,
    EventState::Reconciling,
    EventState::RetryClaimed,
    EventState::Quarantined,
    EventState::Skipped,
];

/// The closed transition table. Anything not listed is illegal.
///
/// | from | to | why |
/// |---|---|---|
/// | PENDING | CLAIMED | a dispatcher's CAS claim |
/// | PENDING | QUARANTINED | stored payload no longer matches its digest |
/// | CLAIMED | SENDING | attempt registered, fenced on the claim |
/// | CLAIMED | PENDING | claim released unsent, or its lease expired unsent |
/// | CLAIMED | QUARANTINED | tampering found before sending |
/// | SENDING | PUBLISHED | `acceptDispatchReceipt` filled the slot |
/// | SENDING | DISPATCH_UNKNOWN | timeout, possibly persisted, lease expired while sending |
/// | SENDING | PENDING | definitely not persisted: eligible again, same destination |
/// | SENDING | QUARANTINED | a receipt with divergent payload or destination |
/// | DISPATCH_UNKNOWN | RECONCILING | a reconciler's CAS |
/// | DISPATCH_UNKNOWN | PUBLISHED | a late genuine ACK |
/// | DISPATCH_UNKNOWN | QUARANTINED | divergent receipt |
/// | RECONCILING | PUBLISHED | found in the broker, through `acceptDispatchReceipt` |
/// | RECONCILING | RETRY_CLAIMED | proven absent, policy allows re-send to the same destination |
/// | RECONCILING | DISPATCH_UNKNOWN | nothing provable: next check scheduled |
/// | RECONCILING | PENDING | proven absent and moved to a new envelope generation (migration) |
/// | RECONCILING | QUARANTINED | found but divergent |
/// | RETRY_CLAIMED | SENDING | the retry attempt is registered |
/// | RETRY_CLAIMED | PUBLISHED | a late genuine ACK of an earlier attempt |
/// | RETRY_CLAIMED | DISPATCH_UNKNOWN | the retry claim expired unsent: the reconciler looks again |
/// | RETRY_CLAIMED | QUARANTINED | divergent receipt |
/// | PUBLISHED | RETAINED | replay window passed |
/// | RETAINED | PURGED | every mandatory consumer's watermark passed |
/// | QUARANTINED | SKIPPED | an operator's skip ([`crate::skip::decide_skip`]) |
/// | QUARANTINED | PENDING | nothing of it in any log: re-sent under a new envelope generation (migration, [`crate::migration::decide_migration`]) |
/// | DISPATCH_UNKNOWN | SKIPPED | an operator's skip of an unknown nothing can prove |
///
/// The two ways back to PENDING from a state that is not a claim's
/// (RECONCILING, QUARANTINED) are taken only by a migration, which writes a
/// new envelope generation: the stores check it
/// ([`crate::migration::check_migration_fence`]), the same generation never
/// goes back.
///
/// RECONCILING -> SKIPPED is deliberately absent: a reconciler holds a
/// fenced lease then, and may be about to fill the slot; the operator waits
/// for it to finish (or for its lease to run out, back to DISPATCH_UNKNOWN).
pub const TRANSITIONS: &[(EventState, EventState)] = {
    use EventState::*;
    &[
        (Pending, Claimed),
        (Pending, Quarantined),
        (Claimed, Sending),
        (Claimed, Pending),
        (Claimed, Quarantined),
        (Sending, Published),
        (Sending, DispatchUnknown),
        (Sending, Pending),
        (Sending, Quarantined),
        (DispatchUnknown, Reconciling),
        (DispatchUnknown, Published),
        (DispatchUnknown, Quarantined),
        (Reconciling, Published),
        (Reconciling, RetryClaimed),
        (Reconciling, DispatchUnknown),
        (Reconciling, Pending),
        (Reconciling, Quarantined),
        (RetryClaimed, Sending),
        (RetryClaimed, Published),
        (RetryClaimed, DispatchUnknown),
        (RetryClaimed, Quarantined),
        (Published, Retained),
        (Retained, Purged),
        (Quarantined, Skipped),
        (Quarantined, Pending),
        (DispatchUnknown, Skipped),
    ]
};

impl EventState {
    /// The stored name (`PENDING`, `DISPATCH_UNKNOWN`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            EventState::Pending => "PENDING",
            EventState::Claimed => "CLAIMED",
            EventState::Sending => "SENDING",
            EventState::Published => "PUBLISHED",
            EventState::Retained => "RETAINED",
            EventState::Purged => "PURGED",
            EventState::DispatchUnknown => "DISPATCH_UNKNOWN",
            EventState::Reconciling => "RECONCILING",
            EventState::RetryClaimed => "RETRY_CLAIMED",
            EventState::Quarantined => "QUARANTINED",
            EventState::Skipped => "SKIPPED",
        }
    }

    /// Parses [`EventState::as_str`].
    pub fn parse(s: &str) -> Result<Self, CoreError> {
        ALL_STATES
            .iter()
            .copied()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| CoreError::InvalidEncoding(format!("unknown event state {s:?}")))
    }

    /// Whether `self -> to` is in the table.
    pub fn can_transition_to(self, to: EventState) -> bool {
        TRANSITIONS.contains(&(self, to))
    }

    /// `Ok(to)` when the transition is legal, a typed error otherwise.
    pub fn transition(self, to: EventState) -> Result<EventState, CoreError> {
        if self.can_transition_to(to) {
            Ok(to)
        } else {
            Err(CoreError::IllegalTransition { from: self, to })
        }
    }

    /// States in which the publish slot may still be filled.
    pub fn accepts_receipt(self) -> bool {
        self.can_transition_to(EventState::Published)
    }

    /// The slot is filled in these states (published and after).
    pub fn is_published(self) -> bool {
        matches!(self, EventState::Published | EventState::Retained | EventState::Purged)
    }

    /// Whether an event in this state still holds its ordering key: the
    /// later events of its key chain wait until it closes (PUBLISHED,
    /// RETAINED, PURGED, or SKIPPED by an operator). An event in flight,
    /// UNKNOWN, being retried or QUARANTINED holds it. PostgreSQL's
    /// chain-head triggers (the producer schema's section 7) close a chain's
    /// head on the same four states;
    /// `tests/tests/claims.rs::the_chain_triggers_close_a_head_on_the_core_closing_states`
    /// holds them to this.
    pub fn holds_key(self) -> bool {
        !self.is_closed()
    }

    /// The event is done with: published (and after) or SKIPPED. Nothing
    /// moves it but retention (PUBLISHED -> RETAINED -> PURGED).
    pub fn is_closed(self) -> bool {
        self.is_published() || self == EventState::Skipped
    }
}

impl fmt::Display for EventState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The state of one delivery attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum AttemptState {
    /// Registered just before the send; the message may be on the wire.
    Sending,
    /// Outcome unknown (timeout, possibly persisted, lease expired).
    Unknown,
    /// Its receipt filled the slot or was kept as a duplicate transport receipt.
    Acked,
    /// The broker definitely did not persist it.
    NotSent,
    /// The reconciler proved it absent from the frozen destination.
    Absent,
}

/// Every attempt state.
pub const ALL_ATTEMPT_STATES: [AttemptState; 5] = [AttemptState::Sending, AttemptState::Unknown, AttemptState::Acked, AttemptState::NotSent, AttemptState::Absent];

impl AttemptState {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptState::Sending => "SENDING",
            AttemptState::Unknown => "UNKNOWN",
            AttemptState::Acked => "ACKED",
            AttemptState::NotSent => "NOT_SENT",
            AttemptState::Absent => "ABSENT",
        }
    }

    /// Parses [`AttemptState::as_str`].
    pub fn parse(s: &str) -> Result<Self, CoreError> {
        [AttemptState::Sending, AttemptState::Unknown, AttemptState::Acked, AttemptState::NotSent, AttemptState::Absent]
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| CoreError::InvalidEncoding(format!("unknown attempt state {s:?}")))
    }

    /// Whether a message of this attempt may still be (or become) in the log.
    pub fn possibly_in_flight(self) -> bool {
        matches!(self, AttemptState::Sending | AttemptState::Unknown)
    }
}

impl fmt::Display for AttemptState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use EventState::*;

    #[test]
    fn every_listed_transition_is_legal() {
        for &(from, to) in TRANSITIONS {
            assert_eq!(from.transition(to), Ok(to));
        }
    }

    #[test]
    fn every_unlisted_pair_is_a_typed_error() {
        let mut illegal = 0;
        for from in ALL_STATES {
            for to in ALL_STATES {
                if !TRANSITIONS.contains(&(from, to)) {
                    illegal += 1;
                    assert_eq!(from.transition(to), Err(CoreError::IllegalTransition { from, to }));
                }
            }
        }
        assert_eq!(illegal, ALL_STATES.len() * ALL_STATES.len() - TRANSITIONS.len());
    }

    #[test]
    fn the_dangerous_shortcuts_are_illegal() {
        // Published without going through a send; a blind re-send from UNKNOWN;
        // deleting evidence before it was retained; resurrecting a purged event.
        for (from, to) in [(Pending, Published), (Claimed, Published), (DispatchUnknown, Sending), (DispatchUnknown, Pending), (Published, Purged), (Purged, Pending), (Quarantined, Claimed), (Quarantined, Sending), (Quarantined, Published), (Published, Sending), (Skipped, Pending), (Skipped, Published), (Skipped, Claimed), (Reconciling, Skipped), (Pending, Skipped), (Published, Skipped), (RetryClaimed, Skipped)] {
            assert!(from.transition(to).is_err(), "{from} -> {to}");
        }
    }

    #[test]
    fn names_round_trip() {
        for s in ALL_STATES {
            assert_eq!(EventState::parse(s.as_str()), Ok(s));
        }
        assert!(EventState::parse("LOST").is_err());
    }

    #[test]
    fn skipped_is_terminal_closed_and_not_published() {
        assert!(TRANSITIONS.iter().all(|&(f, _)| f != Skipped), "SKIPPED has no way out");
        assert!(!Skipped.holds_key() && Skipped.is_closed() && !Skipped.is_published() && !Skipped.accepts_receipt());
        let into: Vec<EventState> = TRANSITIONS.iter().filter(|&&(_, t)| t == Skipped).map(|&(f, _)| f).collect();
        assert_eq!(into, vec![Quarantined, DispatchUnknown]);
        // QUARANTINED still holds the key: only the operator's skip releases it.
        assert!(Quarantined.holds_key() && DispatchUnknown.holds_key());
    }

    #[test]
    fn every_state_is_reachable_from_pending() {
        let mut seen = vec![Pending];
        let mut i = 0;
        while i < seen.len() {
            for &(f, t) in TRANSITIONS {
                if f == seen[i] && !seen.contains(&t) {
                    seen.push(t);
                }
            }
            i += 1;
        }
        assert_eq!(seen.len(), ALL_STATES.len());
    }
}
