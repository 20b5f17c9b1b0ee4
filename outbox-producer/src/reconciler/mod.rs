//! The reconciler's first duty: resolve every DISPATCH_UNKNOWN (PROTOCOL §6).
//!
//! For each due event: a fenced CAS DISPATCH_UNKNOWN -> RECONCILING, a lookup
//! of the frozen partition from a sound lower bound, then outbox-core's
//! [`decide_reconcile`]: found -> through `acceptDispatchReceipt` (which
//! accepts, keeps duplicates and quarantines divergence); proven absent with
//! nothing in flight -> RETRY_CLAIMED to the same frozen destination;
//! otherwise back to DISPATCH_UNKNOWN with the next check scheduled. Every
//! attempt stays recorded.

use std::collections::BTreeSet;
use std::sync::Arc;

use outbox_core::compare::{anchor_below, first_wait, judge_scanned, next_bypass_cursor, receipt_position_lost, take_scan_anchor, CursorMove, KnownCopies, PositionLost, ScanJudgement};
use outbox_core::{BypassScanStore, BypassScanWrite, FindingsStore, RoundFinding, ScanFinding, decide_after_submit, decide_reconcile, scan_floor, scan_lower_bound, Broker, EventState, LookupOutcome, ReconcileDecision, RetryPolicy};

use crate::error::ProducerError;
use crate::pg::PgStore;
use crate::service_store::ServiceStore;

/// Default [`ReconcilerConfig::stale_watermark_after_ms`]: 60 s, twelve of
/// the consumer's default publication intervals.
pub const DEFAULT_STALE_WATERMARK_AFTER_MS: i64 = 60_000;

/// Reconciler settings; every threshold has its unit in its name.
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
    /// A PENDING event older than this is a finding (a dispatcher is not scanning).
    pub aged_pending_ms: i64,
    /// A PUBLISHED event a critical consumer has not passed after this long is a finding.
    pub unconsumed_after_ms: i64,
    /// An UNKNOWN older than this is a finding (page someone).
    pub unknown_slo_ms: i64,
    /// How far the clocks that measured a lease and a registration may be
    /// apart, ms; `retry.in_flight_bound_ms` must cover the adapter's
    /// in-flight time plus this (at least 1000).
    pub clock_skew_allowance_ms: i64,
    /// Most messages the bypass check reads per partition per round.
    pub bypass_scan_max_messages: u64,
    /// Events the sweep for PUBLISHED without a receipt reads per round (by event id).
    pub published_check_batch: i64,
    /// Most findings of one kind recorded per round.
    pub max_findings_per_kind: i64,
    /// A declared consumer that published its watermarks over the broker and
    /// whose last acceptable record is older than this is `stale_watermark`, ms.
    pub stale_watermark_after_ms: i64,
    /// State snapshots older than this are dropped, ms.
    pub history_keep_ms: i64,
    /// Pause between two rounds of [`Reconciler::run`], ms.
    pub interval_ms: u64,
    /// [`Reconciler::run`] compares the three sets (the topic scan and the
    /// condition findings) every this many rounds, the first round
    /// included; every round resolves due UNKNOWNs. 1 (the default): every
    /// round. At most [`MAX_COMPARE_EVERY_ROUNDS`].
    pub compare_every_rounds: u32,
    /// Source identities of other outboxes declared to write this outbox's
    /// topics too (two outbox databases writing one topic must be declared):
    /// the bypass scan leaves their messages alone. A message whose
    /// `outbox-source` is neither this outbox's nor declared is the finding
    /// `foreign_source`. At most [`MAX_DECLARED_SOURCES`].
    pub declared_sources: Vec<String>,
}

/// Largest [`ReconcilerConfig::compare_every_rounds`].
pub const MAX_COMPARE_EVERY_ROUNDS: u32 = 1_000;

/// Most [`ReconcilerConfig::declared_sources`].
pub const MAX_DECLARED_SOURCES: usize = 100;

impl Default for ReconcilerConfig {
    fn default() -> Self {
        ReconcilerConfig {
            owner: crate::dispatcher::default_owner_name("reconciler"),
            batch_size: 100,
            lease_ms: 60_000,
            retry: RetryPolicy::default(),
            aged_pending_ms: 60_000,
            unconsumed_after_ms: 5 * 60_000,
            unknown_slo_ms: crate::report::DEFAULT_UNKNOWN_SLO_MS,
            clock_skew_allowance_ms: outbox_core::reconcile::DEFAULT_CLOCK_SKEW_ALLOWANCE_MS,
            bypass_scan_max_messages: 10_000,
            published_check_batch: 10_000,
            max_findings_per_kind: 1_000,
            stale_watermark_after_ms: DEFAULT_STALE_WATERMARK_AFTER_MS,
            history_keep_ms: 7 * 24 * 3_600_000,
            interval_ms: 10_000,
            compare_every_rounds: 1,
            declared_sources: Vec::new(),
        }
    }
}

mod bypass_scan;
mod findings;
mod reports;
mod resolve;
mod rounds;

pub use reports::{BypassScanReport, CompareReport, ResolveReport};
pub use rounds::{RoundObserver, RoundRecord, RoundStore};

/// Resolves unknown dispatch outcomes.
#[derive(Debug)]
pub struct Reconciler<B: Broker + 'static, S: ServiceStore = PgStore> {
    store: S,
    broker: Arc<B>,
    config: ReconcilerConfig,
    /// UNKNOWNs examined by the latest resolve round (recorded with the next comparison).
    last_examined: std::sync::atomic::AtomicUsize,
}

impl<B: Broker + 'static, S: ServiceStore> Reconciler<B, S> {
    /// A reconciler over `store` asking `broker`.
    pub fn new(store: S, broker: Arc<B>, config: ReconcilerConfig) -> Result<Self, ProducerError> {
        outbox_core::id::validate_identifier("reconciler owner", &config.owner)?;
        outbox_core::claim::validate_lease_ms(config.lease_ms)?;
        outbox_core::check_in_flight_bound(config.retry.in_flight_bound_ms, broker.max_in_flight_ms(), config.clock_skew_allowance_ms)
            .map_err(|e| ProducerError::Config(format!("retry.{e}")))?;
        if config.declared_sources.len() > MAX_DECLARED_SOURCES {
            return Err(ProducerError::Config(format!("declared_sources: {} (..={MAX_DECLARED_SOURCES})", config.declared_sources.len())));
        }
        for s in &config.declared_sources {
            outbox_core::headers::validate_source(s).map_err(|e| ProducerError::Config(format!("declared_sources: {e}")))?;
        }
        if !(1..=MAX_COMPARE_EVERY_ROUNDS).contains(&config.compare_every_rounds) {
            return Err(ProducerError::Config(format!("compare_every_rounds {} (1..={MAX_COMPARE_EVERY_ROUNDS})", config.compare_every_rounds)));
        }
        if config.stale_watermark_after_ms < 1_000 {
            return Err(ProducerError::Config(format!("stale_watermark_after_ms {} (at least 1000)", config.stale_watermark_after_ms)));
        }
        // Its claims are scoped to its broker's cluster, as a dispatcher's
        // are: an UNKNOWN frozen for another cluster is that cluster's
        // reconciler's to resolve (this broker would answer "unavailable"
        // and hand it back, the two reconcilers taking it in turn).
        let store = store.scoped_to_cluster(broker.cluster_id());
        Ok(Reconciler { store, broker, config, last_examined: std::sync::atomic::AtomicUsize::new(0) })
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }
}

/// The rounds of a running reconciler.
impl<B: Broker + 'static, S: ServiceStore> Reconciler<B, S> {
    async fn rounds<F, Fut>(&self, shutdown: impl std::future::Future<Output = ()> + Send, observer: &dyn RoundObserver, mut round: F) -> Result<u64, ProducerError>
    where
        F: FnMut(u64) -> Fut,
        Fut: std::future::Future<Output = Result<(ResolveReport, CompareReport), ProducerError>>,
    {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut rounds = 0;
        let mut number = 0;
        loop {
            let started = std::time::Instant::now();
            let this = number;
            number += 1;
            let observed = async {
                let r = round(this).await;
                match &r {
                    Ok((resolved, compared)) => {
                        tracing::info!(examined = resolved.examined, published = resolved.published, retried = resolved.retried,
                            findings = compared.total(), "reconcile round");
                    }
                    Err(e) => tracing::warn!(error = %e, "reconcile round failed; retrying next interval"),
                }
                observer.round_done(this, r.as_ref(), started.elapsed()).await;
                r.is_ok()
            };
            tokio::select! {
                biased;
                ok = observed => rounds += u64::from(ok),
                () = &mut shutdown => return Ok(rounds),
            }
            tokio::select! {
                biased;
                _ = tokio::time::sleep(std::time::Duration::from_millis(self.config.interval_ms.max(1))) => {}
                () = &mut shutdown => return Ok(rounds),
            }
        }
    }
}

/// The full round (resolve, then compare the three sets), over any store
/// with the comparison's seams: production runs it over [`PgStore`], the
/// simulator over the in-memory store.
impl<B: Broker + 'static, S: ServiceStore + BypassScanStore + FindingsStore + RoundStore> Reconciler<B, S> {
    /// Compares the three sets — committed outbox, publish receipts and the
    /// critical consumers' watermarks — plus the topics themselves (bypass
    /// publishes), and records the findings: new ones are opened, ones no
    /// longer true are resolved (bypass evidence stays open). The findings
    /// are decided by the bypass scan ([`Reconciler::scan_for_bypass`]) and
    /// [`Reconciler::compare_findings`]; the state snapshots and the round
    /// (`outbox_reconciler_rounds`) are recorded after them.
    pub async fn compare_once(&self) -> Result<CompareReport, ProducerError> {
        let now = self.store.now_ms();
        // The bypass scan records its findings with the page that found
        // them (and the cursor that moved past it), in one transaction.
        let bypass = self.scan_at(now).await?;
        let mut report = self.compare_findings_at(now).await?;
        bypass.count_into(&mut report);

        self.store.record_state_snapshot(now, self.config.history_keep_ms).await?;
        if report.total() > 0 {
            tracing::warn!(?report, "reconciler findings");
        }
        let round = RoundRecord {
            owner: &self.config.owner,
            cluster_id: self.broker.cluster_id(),
            at_ms: self.store.now_ms(),
            interval_ms: i64::try_from(self.config.interval_ms).unwrap_or(i64::MAX),
            unknown_slo_ms: self.config.unknown_slo_ms.max(1),
            examined: i32::try_from(self.last_examined.load(std::sync::atomic::Ordering::Relaxed)).unwrap_or(i32::MAX),
            open_findings: i32::try_from(report.total()).unwrap_or(i32::MAX),
        };
        self.store.record_round(&round).await?;
        Ok(report)
    }

    /// One full round: resolve due UNKNOWNs, then compare the three sets
    /// (each comparison records the round: `outbox status` and the report
    /// show when the reconciler last ran, and with which SLO).
    pub async fn run_once(&self) -> Result<(ResolveReport, CompareReport), ProducerError> {
        let resolved = self.resolve_unknown_once().await?;
        let compared = self.compare_once().await?;
        Ok((resolved, compared))
    }

    /// Runs a round every `interval_ms` until `shutdown` resolves (the same
    /// shape as `Dispatcher::run` and `IdempotentConsumer::run`). A round
    /// that fails is logged and retried at the next interval; a round in
    /// progress when `shutdown` resolves is abandoned (its claims expire
    /// with their lease). Returns the number of rounds completed.
    pub async fn run(&self, shutdown: impl std::future::Future<Output = ()> + Send) -> Result<u64, ProducerError> {
        self.run_observed(shutdown, &()).await
    }

    /// [`Reconciler::run`], handing each round's outcome to `observer` as it
    /// ends (the CLI exports metrics and the report from it; the simulator
    /// runs [`Reconciler::run`], the same loop).
    pub async fn run_observed(&self, shutdown: impl std::future::Future<Output = ()> + Send, observer: &dyn RoundObserver) -> Result<u64, ProducerError> {
        self.rounds(shutdown, observer, |round| self.run_round(round)).await
    }

    /// Round number `round` (from 0) of a running reconciler: resolves due
    /// UNKNOWNs, and compares the three sets when `round` is a multiple of
    /// [`ReconcilerConfig::compare_every_rounds`] (an empty report otherwise).
    pub async fn run_round(&self, round: u64) -> Result<(ResolveReport, CompareReport), ProducerError> {
        if round % u64::from(self.config.compare_every_rounds.max(1)) == 0 {
            self.run_once().await
        } else {
            Ok((self.resolve_unknown_once().await?, CompareReport::default()))
        }
    }

}

/// The reports read the SQL store's evidence tables.
impl<B: Broker + 'static> Reconciler<B, PgStore> {
    /// The report, with this reconciler's SLO.
    pub async fn report(&self) -> Result<crate::report::Report, ProducerError> {
        let mut opts = crate::report::ReportOptions::at(self.store.now_ms());
        opts.unknown_slo_ms = self.config.unknown_slo_ms;
        crate::report::build_report(self.store.pool(), &opts).await
    }
}
