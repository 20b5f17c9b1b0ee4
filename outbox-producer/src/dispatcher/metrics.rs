//! [`DispatchMetrics`]: the counters an operator looks at.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering as AtomicOrdering};

#[cfg(doc)]
use super::Dispatcher;
#[cfg(doc)]
use crate::pg::PgStore;

/// Counters an operator looks at. Exported as Prometheus metrics by the CLI.
#[derive(Debug, Default)]
pub struct DispatchMetrics {
    /// Events claimed.
    pub claimed: AtomicU64,
    /// Sends started.
    pub sent: AtomicU64,
    /// Events that became PUBLISHED through this dispatcher's receipts.
    pub published: AtomicU64,
    /// Receipts kept as duplicate transport receipts.
    pub duplicates: AtomicU64,
    /// Attempts whose outcome is unknown.
    pub unknown: AtomicU64,
    /// Attempts the broker definitely did not persist.
    pub not_sent: AtomicU64,
    /// Events or receipts quarantined.
    pub quarantined: AtomicU64,
    /// Writes refused because the claim was taken over.
    pub fenced: AtomicU64,
    /// Retryable database errors a settling batch rode out: a recording of
    /// broker answers tried again, or a lease renewal skipped.
    pub store_retries: AtomicU64,
    /// ACKs that arrived after their claim's lease had run out (by the
    /// store's clock; a renewal that found the claim gone counts as run
    /// out): recorded through acceptDispatchReceipt like any other, since
    /// a claim decides who may send, not what happened.
    pub late_acks: AtomicU64,
    /// Batches settled.
    pub batches: AtomicU64,
    /// Sum of batch latencies, ms (with `batches`, the mean).
    pub batch_ms_total: AtomicU64,
    /// Slowest batch, ms.
    pub batch_ms_max: AtomicU64,
    /// Claims that scanned every ordering chain's head.
    pub head_scans: AtomicU64,
    /// Claims of the successors of just-published events.
    pub successor_claims: AtomicU64,
    /// Age of the oldest PENDING event at the last sweep, ms.
    pub oldest_pending_age_ms: AtomicU64,
    /// Rows waiting for a dispatcher that this one refuses because their
    /// protocol version is newer than it understands, at the last sweep.
    pub refused_protocol_rows: AtomicU64,
    /// 1 while this dispatcher may claim (no alias, or its alias names its
    /// implementation), 0 while it idles.
    pub alias_active: AtomicU64,
    /// How far this dispatcher's clock is ahead of PostgreSQL's, ms
    /// (negative: behind), at the last check ([`PgStore::clock_skew_ms`]).
    pub clock_skew_ms: AtomicI64,
    /// Duration histograms (commit -> PUBLISHED, claim, send, receipt
    /// transaction, batch), for Prometheus.
    pub histograms: crate::observe::DispatchHistograms,
    /// 1 while the claim gate ([`Dispatcher::with_claim_gate`]) holds claims
    /// back (the producer cannot deliver), 0 otherwise.
    pub claims_paused: AtomicU64,
    /// When a worker last completed a claim or renewed its leases, ms since
    /// the epoch (0: not yet): a readiness check sees a stuck dispatcher.
    pub last_progress_ms: AtomicI64,
}

pub(super) fn inc(c: &AtomicU64, n: u64) {
    c.fetch_add(n, AtomicOrdering::Relaxed);
}
