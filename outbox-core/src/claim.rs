//! Claims and the fencing rule (PROTOCOL §4).
//!
//! A claim decides who may *try* to send; it never says what happened. It is
//! granted by a compare-and-set that bumps `claim_generation`, and every later
//! write of the holder is fenced on that generation.

use serde::{Deserialize, Serialize};

use crate::error::CoreError;
use crate::id::{AttemptId, EventId};

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
