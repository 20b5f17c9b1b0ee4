//! The store a [`Dispatcher`](crate::Dispatcher) and the resolve path of a
//! [`Reconciler`](crate::Reconciler) run over: [`OutboxStore`] plus the
//! few calls the services make beyond the protocol's (the successor claim,
//! batch lease renewal, the recovery of a registration whose answer was
//! lost, gauges and evidence).
//!
//! Two implementations ship: [`PgStore`](crate::PgStore) (production,
//! in `pg_service.rs`) and [`MemoryStore`] (the simulator, `outbox-sim`, which runs these same
//! services over it in virtual time). A service is written once, generic
//! over this trait, so that what the simulator proves is the code that runs.
//!
//! Where production does I/O the simulator has no use for (LISTEN/NOTIFY,
//! the rollout alias, the evidence tables), the method has a default that
//! does nothing and `PgStore` does the real thing.

use async_trait::async_trait;
use outbox_core::{AttemptRecord, AttemptState, ClaimToken, ClaimedEvent, EventId, EventState, OutboxStore, StoreError};
use outbox_memory::MemoryStore;

/// A dispatcher alias: which implementation claims under it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatcherAlias {
    /// The alias.
    pub alias: String,
    /// The implementation whose dispatchers claim under it.
    pub implementation: String,
    /// The protocol version that implementation speaks.
    pub protocol_version: i32,
    /// When it was last switched, ms since the epoch.
    pub switched_at_ms: i64,
}

/// What one claim round claimed, and which claims it ran.
#[derive(Debug, Default)]
pub struct ClaimRound {
    /// The events, retries first.
    pub claimed: Vec<ClaimedEvent>,
    /// Whether it claimed successors.
    pub successor_claim: bool,
    /// Whether it scanned every key's head.
    pub head_scan: bool,
    /// Claimed rows quarantined because their frozen envelope or destination
    /// could not be read.
    pub quarantined: usize,
}

/// The store the dispatcher and the reconciler's resolve path run over.
#[async_trait]
pub trait ServiceStore: OutboxStore + Send + Sync + 'static {
    /// The store's clock, ms (the clock leases are written with).
    fn now_ms(&self) -> i64;

    /// This store, claiming only events frozen for `cluster_id`.
    fn scoped_to_cluster(self, cluster_id: &str) -> Self
    where
        Self: Sized;

    /// One claim round in one transaction: retries first, then the
    /// successors of `after` unless `scan_due`, then (when a scan is due or
    /// no successor was ready) every key's head.
    async fn claim_next(&self, owner: &str, after: &[EventId], scan_due: bool, limit: usize, lease_ms: i64) -> Result<ClaimRound, StoreError>;

    /// Renews every claim of `tokens` still held; `None` where it was lost.
    async fn renew_leases(&self, tokens: &[ClaimToken], lease_ms: i64) -> Result<Vec<Option<i64>>, StoreError>;

    /// The attempts a registration of `tokens` made, where it committed
    /// (asked after a registration failed with its answer lost).
    async fn registered_attempts(&self, tokens: &[ClaimToken]) -> Result<Vec<AttemptRecord>, StoreError>;

    /// A session that hears commits of new work (PostgreSQL: `LISTEN
    /// outbox_pending`), if the store has one: `Ok(None)` means the store
    /// notifies nothing and the dispatcher polls; an error means the
    /// session could not be opened (the dispatcher polls as well).
    async fn listen(&self) -> Result<Option<Box<dyn CommitListener>>, StoreError> {
        Ok(None)
    }

    /// Closes up to `limit` QUARANTINED events of routes whose poison
    /// policy is skip, as an operator's skip would
    /// ([`crate::skip::SkipStore::release_poisoned`]); the reconciler's
    /// round runs it. The skips made.
    async fn release_poisoned(&self, limit: usize) -> Result<Vec<outbox_core::SkipRecord>, crate::ProducerError>;

    /// Whether two claims of one dispatcher may run at once: claims that
    /// lock disjoint work and wait for none of each other's rows (the
    /// stream path's bucket leases, `FOR UPDATE SKIP LOCKED`). No by default.
    fn claims_may_overlap(&self) -> bool {
        false
    }

    /// Age of the oldest PENDING event (a gauge).
    async fn oldest_pending_age_ms(&self) -> Result<Option<i64>, StoreError> {
        Ok(None)
    }

    /// How far this store's clock is from the database's (a gauge).
    async fn clock_skew_ms(&self) -> Result<i64, StoreError> {
        Ok(0)
    }

    /// Rows of a newer protocol this store leaves alone (a gauge).
    async fn rows_beyond_protocol(&self) -> Result<i64, StoreError> {
        Ok(0)
    }

    /// The newest protocol version this store claims.
    fn max_protocol_version(&self) -> i32 {
        crate::PROTOCOL_VERSION.parse().unwrap_or(1)
    }

    /// Which implementation the dispatcher alias `alias` names now, if set.
    async fn current_alias(&self, _alias: &str) -> Result<Option<DispatcherAlias>, crate::ProducerError> {
        Ok(None)
    }

    /// Records findings (kind, event id, detail) as evidence.
    async fn record_findings(&self, _findings: &[(&'static str, String, String)], _now_ms: i64) -> Result<(), StoreError> {
        Ok(())
    }

    /// Keeps a reconciler's lookup and decision as evidence.
    async fn record_lookup(&self, _owner: &str, _event_id: &str, _now_ms: i64, _from_offset: i64, _lookup: &str, _decision: &str) -> Result<(), StoreError> {
        Ok(())
    }
}

/// The channel `emit` notifies on commit (`pg_notify('outbox_pending', '')`).
pub const NOTIFY_CHANNEL: &str = "outbox_pending";

/// What a dispatcher's listening session hears.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notice {
    /// New work was committed.
    Committed,
    /// The session was lost and another one listens now: what was
    /// notified in between went to the lost session, so the workers look
    /// once.
    Replaced,
}

/// A session that hears commits of new work ([`ServiceStore::listen`]).
/// The dispatcher's loop over it (wake the workers on each notice, poll
/// while the session is down) is one piece of code for PostgreSQL and the
/// simulator.
#[async_trait]
pub trait CommitListener: Send {
    /// The next notice. An error is a session lost and not replaced yet:
    /// the next call tries to open another.
    async fn next(&mut self) -> Result<Notice, StoreError>;
}

/// The simulator's store: one cluster, one clock (set by the simulation).
#[async_trait]
impl ServiceStore for MemoryStore {
    fn now_ms(&self) -> i64 {
        MemoryStore::now_ms(self)
    }

    async fn release_poisoned(&self, limit: usize) -> Result<Vec<outbox_core::SkipRecord>, crate::ProducerError> {
        Ok(MemoryStore::release_poisoned(self, limit)?)
    }

    /// The simulated outbox holds one cluster's events.
    fn scoped_to_cluster(self, _cluster_id: &str) -> Self {
        self
    }

    async fn claim_next(&self, owner: &str, _after: &[EventId], _scan_due: bool, limit: usize, lease_ms: i64) -> Result<ClaimRound, StoreError> {
        // The memory store finds every head in one pass; the successor
        // claim is an index-probe optimisation of the SQL store.
        let mut claimed = self.claim_retries(owner, limit, lease_ms).await?;
        if claimed.len() < limit {
            claimed.extend(self.claim_batch(owner, limit - claimed.len(), lease_ms).await?);
        }
        Ok(ClaimRound { claimed, successor_claim: false, head_scan: true, quarantined: 0 })
    }

    async fn renew_leases(&self, tokens: &[ClaimToken], lease_ms: i64) -> Result<Vec<Option<i64>>, StoreError> {
        let mut out = Vec::with_capacity(tokens.len());
        for t in tokens {
            out.push(self.renew_lease(t, lease_ms).await?);
        }
        Ok(out)
    }

    async fn registered_attempts(&self, tokens: &[ClaimToken]) -> Result<Vec<AttemptRecord>, StoreError> {
        let now = MemoryStore::now_ms(self);
        let st = self.lock();
        let mut out = Vec::new();
        for t in tokens {
            let Some(ev) = st.events.get(&t.event_id) else { continue };
            let held = ev.state == EventState::Sending
                && ev.claim.owner.as_deref() == Some(t.owner.as_str())
                && ev.claim.claim_generation == t.claim_generation
                && ev.claim.lease_until_ms.is_some_and(|l| l > now);
            if let (true, Some(attempt_id)) = (held, &ev.claim.attempt_id) {
                if let Some(a) = st.attempts.get(&t.event_id).and_then(|v| v.iter().find(|a| &a.attempt_id == attempt_id && a.state == AttemptState::Sending)) {
                    out.push(a.clone());
                }
            }
        }
        Ok(out)
    }
}
