//! What a batch carries from [`Dispatcher::claim_and_send`] to
//! [`Dispatcher::settle`] ([`InFlightBatch`]), what it did ([`BatchReport`]),
//! and where a worker's next claim looks ([`ClaimCursor`]).

use outbox_core::{AttemptRecord, ClaimedEvent, SendOutcome};
use tokio::task::JoinHandle;
// tokio's clock: the simulator runs these services in virtual time.
use tokio::time::Instant;

#[cfg(doc)]
use super::{Dispatcher, DispatcherConfig};

/// What one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchReport {
    /// Claimed.
    pub claimed: usize,
    /// Sends started.
    pub sent: usize,
    /// Filled the slot.
    pub published: usize,
    /// Kept as duplicate transport receipts (or already accepted).
    pub duplicates: usize,
    /// Became DISPATCH_UNKNOWN.
    pub unknown: usize,
    /// Not persisted: eligible again.
    pub not_sent: usize,
    /// Quarantined (tampered before send, or divergent receipt).
    pub quarantined: usize,
    /// Fenced writes.
    pub fenced: usize,
}

/// Totals over batches.
impl std::ops::AddAssign for BatchReport {
    fn add_assign(&mut self, r: BatchReport) {
        self.claimed += r.claimed;
        self.sent += r.sent;
        self.published += r.published;
        self.duplicates += r.duplicates;
        self.unknown += r.unknown;
        self.not_sent += r.not_sent;
        self.quarantined += r.quarantined;
        self.fenced += r.fenced;
    }
}

/// Sends started by [`Dispatcher::claim_and_send`], waiting to be settled.
#[derive(Debug)]
pub struct InFlightBatch {
    pub(super) owner: String,
    pub(super) started: Instant,
    pub(super) report: BatchReport,
    pub(super) sends: Vec<(ClaimedEvent, AttemptRecord, JoinHandle<(SendOutcome, Option<String>)>)>,
}

impl InFlightBatch {
    /// Number of sends in flight.
    pub fn len(&self) -> usize {
        self.sends.len()
    }

    /// Whether nothing is in flight.
    pub fn is_empty(&self) -> bool {
        self.sends.is_empty()
    }

    /// The attempts in flight.
    pub fn attempts(&self) -> impl Iterator<Item = &AttemptRecord> {
        self.sends.iter().map(|(_, a, _)| a)
    }
}

/// Where a worker's next claim looks: the events its last batch published
/// (their keys' next events come first) and how many claims ago it last
/// scanned every key's head. See [`DispatcherConfig::head_scan_every`].
#[derive(Debug, Clone, Default)]
pub struct ClaimCursor {
    pub(super) published: Vec<outbox_core::EventId>,
    pub(super) since_scan: u32,
}

impl ClaimCursor {
    /// The events the last batch published, in receipt order.
    pub fn last_published(&self) -> &[outbox_core::EventId] {
        &self.published
    }
}
