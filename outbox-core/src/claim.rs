//! Claims and the fencing rule (PROTOCOL §4).
//!
//! A claim decides who may *try* to send; it never says what happened. It is
//! granted by a compare-and-set that bumps `claim_generation`, and every later
//! write of the holder is fenced on that generation.

use serde::{Deserialize, Serialize};

use crate::error::CoreError;
use crate::id::{AttemptId, EventId};
use crate::state::EventState;

/// Shortest lease a dispatcher may ask for.
pub const MIN_LEASE_MS: i64 = 100;
/// Longest lease a dispatcher may ask for: a dead worker holds events at most this long.
pub const MAX_LEASE_MS: i64 = 10 * 60 * 1000;
/// Largest batch one claim call may take.
pub const MAX_CLAIM_BATCH: usize = 10_000;
/// Backoff after the first send the broker refused outright (not persisted).
pub const NOT_SENT_BACKOFF_BASE_MS: i64 = 100;
/// Longest backoff after a refused send.
pub const NOT_SENT_BACKOFF_MAX_MS: i64 = 10_000;

/// How long an event whose send was refused outright (not persisted) waits,
/// PENDING, before it may be claimed again: [`NOT_SENT_BACKOFF_BASE_MS`]
/// after its first attempt, doubling with each attempt, at most
/// [`NOT_SENT_BACKOFF_MAX_MS`]. A message the broker can never take (larger
/// than its size limit, a topic it refuses) is retried a few times a minute,
/// not in a loop; it stays PENDING, never lost, and still holds its key.
pub fn not_sent_backoff_ms(attempt_generation: u32) -> i64 {
    let doublings = attempt_generation.saturating_sub(1).min(20);
    (NOT_SENT_BACKOFF_BASE_MS << doublings).min(NOT_SENT_BACKOFF_MAX_MS)
}

/// The claim columns of an event row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    /// Who holds (or last held) the claim.
    pub owner: Option<String>,
    /// Bumped by every grant and by every takeover (lease expiry, reconciler).
    pub claim_generation: u64,
    /// End of the lease, ms since the epoch.
    pub lease_until_ms: Option<i64>,
    /// The attempt registered under this claim, once it is.
    pub attempt_id: Option<AttemptId>,
}

/// What a claim holder carries and presents with every write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimToken {
    /// The event claimed.
    pub event_id: EventId,
    /// The holder.
    pub owner: String,
    /// The generation granted.
    pub claim_generation: u64,
    /// The lease granted.
    pub lease_until_ms: i64,
}

/// What a fenced write wants to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FencedWrite {
    /// Register an attempt and send: needs the current generation *and* a live lease.
    Send,
    /// Record an outcome (unknown, not sent, release): needs the current generation.
    Report,
}

/// Checks a holder's write against the row's current claim.
///
/// Invariant: a writer whose generation is not the row's current one changes
/// nothing; a writer whose lease ran out may not send.
pub fn check_fence(row: &Claim, token: &ClaimToken, write: FencedWrite, now_ms: i64) -> Result<(), CoreError> {
    if row.claim_generation != token.claim_generation || row.owner.as_deref() != Some(token.owner.as_str()) {
        return Err(CoreError::Fenced { writer_generation: token.claim_generation, current_generation: row.claim_generation });
    }
    if write == FencedWrite::Send {
        let lease_until_ms = row.lease_until_ms.unwrap_or(i64::MIN);
        if now_ms >= lease_until_ms {
            return Err(CoreError::LeaseExpired { lease_until_ms, now_ms });
        }
    }
    Ok(())
}

/// Claim eligibility (PROTOCOL §4): a PENDING event whose back-off is over
/// (`next_check_at_ms <= now_ms`) and whose key no earlier event of its
/// chain holds ([`EventState::holds_key`]; `key_held` is false for an
/// unordered event). `MemoryStore::claim_batch` asks it per event;
/// PostgreSQL keeps the same answer in `outbox_chain_heads.claimable_at_ms`
/// (the head of each chain, claimable at its due time while PENDING) and
/// adds its deployment filters (the dispatcher's cluster scope, the protocol
/// versions it speaks, the rollout's publisher). Conformance
/// `a_key_is_held_until_its_event_closes` runs it on both stores.
pub fn is_claimable(state: EventState, next_check_at_ms: i64, key_held: bool, now_ms: i64) -> bool {
    state == EventState::Pending && next_check_at_ms <= now_ms && !key_held
}

/// The states from which a claim holder may register its attempt (the
/// registration guard of PROTOCOL §4): a dispatcher's claim or a retry
/// claim, not yet used for an attempt. `PgStore::register_attempts` writes
/// its state list from this constant; core test
/// `registrable_states_are_the_states_that_may_start_sending` ties it to the
/// transition table.
pub const REGISTRABLE_STATES: [EventState; 2] = [EventState::Claimed, EventState::RetryClaimed];

/// The registration guard: whether `token` may register an attempt on an
/// event in `state` whose claim is `row` at `now_ms`. First the fence (the
/// current generation and owner, a running lease: [`check_fence`] for a
/// send), then the claim itself (a registrable state, no attempt yet).
/// Both stores decide with it: `MemoryStore::register_attempt` before it
/// writes, and `PgStore` (whose statement guards the same columns, its
/// state list from [`REGISTRABLE_STATES`]) to name the refusal of every
/// token its statement did not register.
pub fn check_registration(state: EventState, row: &Claim, token: &ClaimToken, now_ms: i64) -> Result<(), CoreError> {
    check_fence(row, token, FencedWrite::Send, now_ms)?;
    if !REGISTRABLE_STATES.contains(&state) || row.attempt_id.is_some() {
        return Err(CoreError::IllegalTransition { from: state, to: EventState::Sending });
    }
    Ok(())
}

/// Checks a requested lease length.
pub fn validate_lease_ms(lease_ms: i64) -> Result<(), CoreError> {
    if !(MIN_LEASE_MS..=MAX_LEASE_MS).contains(&lease_ms) {
        return Err(CoreError::InvalidDestination(format!("lease of {lease_ms} ms is outside {MIN_LEASE_MS}..={MAX_LEASE_MS} ms")));
    }
    Ok(())
}

/// The claim a successful CAS writes: generation + 1, fresh lease.
pub fn grant(previous: &Claim, owner: &str, now_ms: i64, lease_ms: i64) -> Claim {
    Claim {
        owner: Some(owner.to_owned()),
        claim_generation: previous.claim_generation + 1,
        lease_until_ms: Some(now_ms.saturating_add(lease_ms)),
        attempt_id: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_sent_backoff_doubles_per_attempt_up_to_its_bound() {
        let got: Vec<i64> = [0, 1, 2, 3, 7, 8, 9, 40, u32::MAX].into_iter().map(not_sent_backoff_ms).collect();
        assert_eq!(got, vec![100, 100, 200, 400, 6_400, 10_000, 10_000, 10_000, 10_000]);
    }

    fn token(gen: u64) -> ClaimToken {
        ClaimToken { event_id: EventId::from_parts(1, 1), owner: "w1".into(), claim_generation: gen, lease_until_ms: 2_000 }
    }

    #[test]
    fn current_holder_may_send_within_lease() {
        let row = grant(&Claim { owner: None, claim_generation: 4, lease_until_ms: None, attempt_id: None }, "w1", 1_000, 1_000);
        assert_eq!(row.claim_generation, 5);
        assert_eq!(check_fence(&row, &token(5), FencedWrite::Send, 1_999), Ok(()));
    }

    #[test]
    fn expired_lease_may_report_but_not_send() {
        let row = Claim { owner: Some("w1".into()), claim_generation: 5, lease_until_ms: Some(2_000), attempt_id: None };
        assert!(matches!(check_fence(&row, &token(5), FencedWrite::Send, 2_000), Err(CoreError::LeaseExpired { .. })));
        assert_eq!(check_fence(&row, &token(5), FencedWrite::Report, 2_000), Ok(()));
    }

    #[test]
    fn stale_generation_is_fenced_for_every_write() {
        let row = grant(&Claim { owner: Some("w1".into()), claim_generation: 5, lease_until_ms: Some(2_000), attempt_id: None }, "w2", 3_000, 1_000);
        for w in [FencedWrite::Send, FencedWrite::Report] {
            assert_eq!(check_fence(&row, &token(5), w, 3_001), Err(CoreError::Fenced { writer_generation: 5, current_generation: 6 }));
        }
        // Same generation number presented by another owner is fenced too.
        let forged = ClaimToken { owner: "w9".into(), ..token(6) };
        assert!(check_fence(&row, &forged, FencedWrite::Report, 3_001).is_err());
    }

    #[test]
    fn registrable_states_are_the_states_that_may_start_sending() {
        let may_send: Vec<EventState> = crate::state::ALL_STATES.into_iter().filter(|s| s.can_transition_to(EventState::Sending)).collect();
        assert_eq!(may_send, REGISTRABLE_STATES.to_vec());
    }

    #[test]
    fn registration_needs_the_fence_a_registrable_state_and_no_attempt_yet() {
        let row = Claim { owner: Some("w1".into()), claim_generation: 5, lease_until_ms: Some(2_000), attempt_id: None };
        for s in REGISTRABLE_STATES {
            assert_eq!(check_registration(s, &row, &token(5), 1_999), Ok(()));
        }
        assert!(matches!(check_registration(EventState::Claimed, &row, &token(5), 2_000), Err(CoreError::LeaseExpired { .. })));
        assert!(matches!(check_registration(EventState::Claimed, &row, &token(4), 1_000), Err(CoreError::Fenced { .. })));
        let used = Claim { attempt_id: Some(AttemptId::from_parts(1, 1)), ..row.clone() };
        assert_eq!(check_registration(EventState::Claimed, &used, &token(5), 1_000), Err(CoreError::IllegalTransition { from: EventState::Claimed, to: EventState::Sending }));
        for s in [EventState::Sending, EventState::Reconciling, EventState::Pending, EventState::Published] {
            assert_eq!(check_registration(s, &row, &token(5), 1_000), Err(CoreError::IllegalTransition { from: s, to: EventState::Sending }));
        }
    }

    #[test]
    fn lease_limits() {
        assert!(validate_lease_ms(MIN_LEASE_MS - 1).is_err());
        assert!(validate_lease_ms(MAX_LEASE_MS + 1).is_err());
        assert!(validate_lease_ms(30_000).is_ok());
    }
}

/// Where stores read the time from. Production uses [`SystemClock`]; tests
/// and the simulator use [`ManualClock`] so leases expire when they say.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> i64;
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
    }
}

/// A clock that moves only when told. Clones share the time.
#[derive(Debug, Clone, Default)]
pub struct ManualClock(std::sync::Arc<std::sync::atomic::AtomicI64>);

impl ManualClock {
    /// A clock at `now_ms`.
    pub fn new(now_ms: i64) -> Self {
        let c = ManualClock::default();
        c.set(now_ms);
        c
    }
    /// Sets the time.
    pub fn set(&self, now_ms: i64) {
        self.0.store(now_ms, std::sync::atomic::Ordering::SeqCst);
    }
    /// Moves the time forward.
    pub fn advance(&self, ms: i64) {
        self.0.fetch_add(ms, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// What the expiry of a claim's lease does to the event that holds it
/// (PROTOCOL §4): a holder that stalled past its lease holds a dead
/// generation, and the row moves on without it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseExpiry {
    /// The state the event moves to.
    pub to: EventState,
    /// Whether the claim's open attempt (SENDING) becomes UNKNOWN: it may
    /// have been handed to the client, so its outcome is not known.
    pub attempt_unknown: bool,
    /// Whether the event keeps its claim's attempt id (the attempt the
    /// reconciler will ask about).
    pub keeps_attempt: bool,
    /// Whether the event's outcome is unknown from now on (its unknown
    /// interval starts, if it has not yet).
    pub outcome_unknown: bool,
}

/// The states whose claims carry a lease that can expire.
pub const LEASED_STATES: [EventState; 4] = [EventState::Claimed, EventState::Sending, EventState::RetryClaimed, EventState::Reconciling];

/// The decision of the lease sweep for an event in `state` whose lease ran
/// out (`None`: `state` holds no lease). Every store applies exactly this:
/// `MemoryStore::expire_leases` calls it, and `PgStore::expire_leases` runs
/// the SQL [`lease_expiry_sql`] writes from it.
///
/// - CLAIMED (nothing was sent): back to PENDING, the attempt id dropped.
/// - SENDING (the message may be in the client or the log):
///   DISPATCH_UNKNOWN, its attempt UNKNOWN.
/// - RETRY_CLAIMED, RECONCILING (a retry or a reconciliation abandoned):
///   DISPATCH_UNKNOWN again, for the next reconciler.
///
/// The claim generation is bumped in every case (the holder is fenced).
pub fn plan_lease_expiry(state: EventState) -> Option<LeaseExpiry> {
    match state {
        EventState::Claimed => Some(LeaseExpiry { to: EventState::Pending, attempt_unknown: false, keeps_attempt: false, outcome_unknown: false }),
        EventState::Sending => Some(LeaseExpiry { to: EventState::DispatchUnknown, attempt_unknown: true, keeps_attempt: true, outcome_unknown: true }),
        EventState::RetryClaimed | EventState::Reconciling => {
            Some(LeaseExpiry { to: EventState::DispatchUnknown, attempt_unknown: false, keeps_attempt: true, outcome_unknown: true })
        }
        _ => None,
    }
}

/// `'CLAIMED', 'RETRY_CLAIMED'`: states as an SQL list, for a store's
/// `state IN (...)` written from a core constant.
pub fn sql_state_list(states: &[EventState]) -> String {
    states.iter().map(|s| format!("'{}'", s.as_str())).collect::<Vec<_>>().join(", ")
}

/// The SQL of [`plan_lease_expiry`] over a column `old` holding the state:
/// the leased states (`IN` list), and CASE expressions for the new state,
/// for whether the attempt id is kept, whether the outcome is unknown, and
/// the states whose attempt becomes UNKNOWN (`IN` list). Written from the
/// plan, so that the PostgreSQL sweep cannot drift from it.
pub fn lease_expiry_sql(old: &str) -> LeaseExpirySql {
    let quote = |s: EventState| format!("'{}'", s.as_str());
    let list = |f: &dyn Fn(&LeaseExpiry) -> bool| {
        sql_state_list(&LEASED_STATES.into_iter().filter(|s| plan_lease_expiry(*s).is_some_and(|p| f(&p))).collect::<Vec<_>>())
    };
    let mut to = format!("CASE {old}");
    for s in LEASED_STATES {
        if let Some(p) = plan_lease_expiry(s) {
            to.push_str(&format!(" WHEN {} THEN {}", quote(s), quote(p.to)));
        }
    }
    to.push_str(" END");
    LeaseExpirySql {
        leased: sql_state_list(&LEASED_STATES),
        to,
        keeps_attempt: list(&|p| p.keeps_attempt),
        outcome_unknown: list(&|p| p.outcome_unknown),
        attempt_unknown: list(&|p| p.attempt_unknown),
    }
}

/// SQL fragments of [`lease_expiry_sql`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseExpirySql {
    /// `'CLAIMED', 'SENDING', ...`: the states with a lease.
    pub leased: String,
    /// `CASE old WHEN 'CLAIMED' THEN 'PENDING' ... END`: the new state.
    pub to: String,
    /// The states whose event keeps its attempt id.
    pub keeps_attempt: String,
    /// The states after which the outcome is unknown.
    pub outcome_unknown: String,
    /// The states whose open attempt becomes UNKNOWN.
    pub attempt_unknown: String,
}

#[cfg(test)]
mod lease_expiry_tests {
    use super::*;
    use crate::state::ALL_STATES;

    #[test]
    fn every_leased_state_has_a_legal_expiry_and_no_other_state_has_one() {
        for s in ALL_STATES {
            match plan_lease_expiry(s) {
                Some(p) => {
                    assert!(LEASED_STATES.contains(&s), "{s}");
                    assert!(s.can_transition_to(p.to), "{s} -> {}", p.to);
                    // Only an attempt that may be in the log makes the outcome unknown.
                    assert_eq!(p.attempt_unknown, s == EventState::Sending, "{s}");
                    assert_eq!(p.outcome_unknown, p.to == EventState::DispatchUnknown, "{s}");
                }
                None => assert!(!LEASED_STATES.contains(&s), "{s} has a lease and no expiry"),
            }
        }
        assert_eq!(plan_lease_expiry(EventState::Claimed).map(|p| p.to), Some(EventState::Pending));
    }

    #[test]
    fn the_sql_is_written_from_the_plan() {
        let sql = lease_expiry_sql("c.old_state");
        assert_eq!(sql.leased, "'CLAIMED', 'SENDING', 'RETRY_CLAIMED', 'RECONCILING'");
        assert_eq!(
            sql.to,
            "CASE c.old_state WHEN 'CLAIMED' THEN 'PENDING' WHEN 'SENDING' THEN 'DISPATCH_UNKNOWN' WHEN 'RETRY_CLAIMED' THEN 'DISPATCH_UNKNOWN' WHEN 'RECONCILING' THEN 'DISPATCH_UNKNOWN' END"
        );
        assert_eq!(sql.attempt_unknown, "'SENDING'");
        assert_eq!(sql.keeps_attempt, "'SENDING', 'RETRY_CLAIMED', 'RECONCILING'");
        assert_eq!(sql.outcome_unknown, sql.keeps_attempt);
    }
}
