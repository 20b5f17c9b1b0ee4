//! The reconciler's first duty: resolve every DISPATCH_UNKNOWN (SPEC §6).
//!
//! For each due event: a fenced CAS DISPATCH_UNKNOWN -> RECONCILING, a lookup
//! of the frozen partition from a sound lower bound, then outbox-core's
//! [`decide_reconcile`]: found -> through `acceptDispatchReceipt` (which
//! accepts, keeps duplicates and quarantines divergence); proven absent with
//! nothing in flight -> RETRY_CLAIMED to the same frozen destination;
//! otherwise back to DISPATCH_UNKNOWN with the next check scheduled. Every
//! attempt stays recorded.

use std::sync::Arc;

use outbox_core::{decide_reconcile, scan_lower_bound, Broker, EventState, LookupOutcome, OutboxStore, RecheckReason, ReconcileDecision, RetryPolicy};

use crate::error::ProducerError;
use crate::pg::PgStore;

/// Reconciler settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReconcilerConfig {
    /// Claim owner name.
    pub owner: String,
    /// Events per round.
    pub batch_size: usize,
    /// Lease of a RECONCILING claim, ms.
    pub lease_ms: i64,
    /// When to retry and when to look again.
    pub retry: RetryPolicy,
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        ReconcilerConfig { owner: format!("reconciler-{}", std::process::id()), batch_size: 100, lease_ms: 60_000, retry: RetryPolicy::default() }
    }
}

/// What one round of [`Reconciler::resolve_unknown_once`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ResolveReport {
    /// Events taken into RECONCILING.
    pub examined: usize,
    /// Found in the broker and published through the receipt transaction.
    pub published: usize,
    /// Found but divergent: quarantined.
    pub quarantined: usize,
    /// Proven absent (or no lookup): RETRY_CLAIMED to the same destination.
    pub retried: usize,
    /// Still unknown, next check scheduled.
    pub rechecks: usize,
}

/// Resolves unknown dispatch outcomes.
#[derive(Debug)]
pub struct Reconciler<B: Broker + 'static> {
    store: PgStore,
    broker: Arc<B>,
    config: ReconcilerConfig,
}

impl<B: Broker + 'static> Reconciler<B> {
    /// A reconciler over `store` asking `broker`.
    pub fn new(store: PgStore, broker: Arc<B>, config: ReconcilerConfig) -> Result<Self, ProducerError> {
        outbox_core::id::validate_identifier("reconciler owner", &config.owner)?;
        outbox_core::claim::validate_lease_ms(config.lease_ms)?;
        Ok(Reconciler { store, broker, config })
    }

    /// The store.
    pub fn store(&self) -> &PgStore {
        &self.store
    }

    /// One round: expire leases, then resolve up to `batch_size` due unknowns.
    pub async fn resolve_unknown_once(&self) -> Result<ResolveReport, ProducerError> {
        self.store.expire_leases().await?;
        let tasks = self.store.begin_reconcile(&self.config.owner, self.config.batch_size, self.config.lease_ms).await?;
        let mut report = ResolveReport { examined: tasks.len(), ..Default::default() };
        let supports = self.broker.supports_lookup();
        for task in tasks {
            let event_id = &task.event.event_id;
            let lookup = if !supports {
                LookupOutcome::Unavailable("the broker adapter cannot look up events".into())
            } else if task.event.destination.cluster_id != self.broker.cluster_id() {
                LookupOutcome::Unavailable(format!("connected to cluster {}, event frozen for {}", self.broker.cluster_id(), task.event.destination.cluster_id))
            } else {
                self.broker.lookup(&task.event.destination, event_id, scan_lower_bound(&task.attempts)).await
            };
            let now = self.store.now_ms();
            let decision = decide_reconcile(&task.attempts, &lookup, supports, &self.config.retry, now);
            tracing::info!(%event_id, ?decision, "reconcile decision");
            match &decision {
                ReconcileDecision::Submit(receipts) => {
                    let outcomes = self.store.accept_dispatch_receipts(receipts).await?;
                    match outcomes.last().map(|o| o.state) {
                        Some(EventState::Published) => report.published += 1,
                        Some(EventState::Quarantined) => report.quarantined += 1,
                        _ => {
                            let recheck = ReconcileDecision::Recheck { reason: RecheckReason::ReceiptsRefused, next_check_at_ms: now + self.config.retry.recheck_ms };
                            self.store.finish_reconcile(&task.token, &recheck).await?;
                            report.rechecks += 1;
                        }
                    }
                }
                ReconcileDecision::Retry { .. } => {
                    self.store.finish_reconcile(&task.token, &decision).await?;
                    report.retried += 1;
                }
                ReconcileDecision::Recheck { .. } => {
                    self.store.finish_reconcile(&task.token, &decision).await?;
                    report.rechecks += 1;
                }
            }
        }
        Ok(report)
    }
}
