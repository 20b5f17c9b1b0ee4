//! The lease sweeper: a small service with `run(shutdown)` that, every
//! interval, expires the leases that ran out (`OutboxStore::expire_leases`:
//! CLAIMED back to PENDING, SENDING or RECONCILING to DISPATCH_UNKNOWN) and
//! reads the gauges an operator watches beside it (the oldest PENDING event,
//! this host's clock against the store's, rows of a newer protocol version).
//! A dispatcher runs one; it is generic over [`ServiceStore`], so the
//! simulator runs the same loop over its store.

use std::future::Future;
use std::time::{Duration, Instant};

use crate::service_store::ServiceStore;

/// How often the sweeper recounts rows of a newer protocol version and
/// compares this host's clock with the store's.
pub const PROTOCOL_GAUGE_EVERY: Duration = Duration::from_secs(30);
/// A clock skew is logged as a warning from this fraction of `lease_ms`
/// (and at least [`CLOCK_SKEW_WARN_MIN_MS`]).
pub const CLOCK_SKEW_WARN_LEASE_FRACTION: i64 = 10;
/// The smallest clock skew logged as a warning, ms.
pub const CLOCK_SKEW_WARN_MIN_MS: i64 = 500;

/// What one sweep read (`None`: not read this time, or the read failed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sweep {
    /// Age of the oldest PENDING event, ms (`Some(None)`: none pending).
    pub oldest_pending_age_ms: Option<Option<i64>>,
    /// How far this host's clock is ahead of the store's, ms.
    pub clock_skew_ms: Option<i64>,
    /// Rows of a protocol version newer than this build understands.
    pub rows_beyond_protocol: Option<i64>,
}

/// The lease sweeper over `store`.
#[derive(Debug)]
pub struct LeaseSweeper<'a, S: ServiceStore> {
    store: &'a S,
    every: Duration,
    lease_ms: i64,
}

impl<'a, S: ServiceStore> LeaseSweeper<'a, S> {
    /// A sweeper of `store` every `every`; `lease_ms` scales the clock-skew warning.
    pub fn new(store: &'a S, every: Duration, lease_ms: i64) -> Self {
        LeaseSweeper { store, every, lease_ms }
    }

    /// Sweeps every interval until `shutdown` resolves, handing each
    /// sweep's readings to `observe` (a dispatcher keeps them as gauges).
    /// A failed read is logged and tried again at the next sweep.
    pub async fn run(&self, shutdown: impl Future<Output = ()> + Send, mut observe: impl FnMut(&Sweep) + Send) {
        let mut shutdown = std::pin::pin!(shutdown);
        // Counting rows of a newer protocol visits the whole backlog: a
        // rollout gauge, refreshed every PROTOCOL_GAUGE_EVERY.
        let mut protocol_checked: Option<Instant> = None;
        let mut refused_before: Option<i64> = None;
        loop {
            let mut sweep = Sweep::default();
            if let Err(e) = self.store.expire_leases().await {
                tracing::warn!(error = %e, "lease sweep failed");
            }
            sweep.oldest_pending_age_ms = self.store.oldest_pending_age_ms().await.ok();
            if protocol_checked.is_none_or(|at| at.elapsed() >= PROTOCOL_GAUGE_EVERY) {
                if let Ok(skew) = self.store.clock_skew_ms().await {
                    sweep.clock_skew_ms = Some(skew);
                    let bound = (self.lease_ms / CLOCK_SKEW_WARN_LEASE_FRACTION).max(CLOCK_SKEW_WARN_MIN_MS);
                    if skew.abs() > bound {
                        tracing::warn!(skew_ms = skew, lease_ms = self.lease_ms,
                            "this host's clock differs from PostgreSQL's: leases held or swept here are cut short or stretched by that much (synchronise the clocks, NTP)");
                    }
                }
                if let Ok(refused) = self.store.rows_beyond_protocol().await {
                    protocol_checked = Some(Instant::now());
                    sweep.rows_beyond_protocol = Some(refused);
                    if refused > 0 && refused_before != Some(refused) {
                        tracing::warn!(refused, understood = self.store.max_protocol_version(),
                            "rows of a newer protocol version are waiting; this dispatcher leaves them alone (run a dispatcher that understands them)");
                    }
                    refused_before = Some(refused);
                }
            }
            observe(&sweep);
            tokio::select! {
                biased;
                () = &mut shutdown => return,
                _ = tokio::time::sleep(self.every) => {}
            }
        }
    }
}
