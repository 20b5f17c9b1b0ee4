//! The shipped services' side of the store conformance suite
//! ([`outbox_memory::conformance`]): the migration commit, a retention
//! pass, an operator's skip, and the reconciler's bypass scan and comparison, run over any store
//! the same way.
//!
//! Each store's [`Harness`] (the in-memory store's, `outbox_sim::MemoryHarness`,
//! and PostgreSQL's, in `tests/tests/conformance.rs`) calls these, and keeps
//! only what its store does differently: how it writes the consumer
//! registry and the watermarks a run reads, and how it reads back what the
//! run left (the open findings, the payloads).
//!
//! [`Harness`]: outbox_memory::conformance::Harness

use std::collections::BTreeMap;
use std::sync::Arc;

use outbox_core::{BypassScanStore, EventId, FindingsStore, LookupOutcome, MigrationFence};
use outbox_memory::conformance::{route, FindingThresholds, PurgeCounts, ScanLog, ScanOutcome, CLUSTER, POLICY};

use crate::migration::{MigrationOutcome, MigrationStore};
use crate::reconciler::{Reconciler, ReconcilerConfig};
use crate::retention::{purge_with, RetentionPolicy, RetentionStore};
use crate::service_store::ServiceStore;
use crate::skip::{SkipOutcome, SkipStore};

/// [`Harness::commit_migration`](outbox_memory::conformance::Harness::commit_migration):
/// the store's migration commit ([`MigrationStore::commit_migration`]) of
/// `id` to [`route`] of `to_topic`, by operator `conformance`, with
/// [`POLICY`], not a dry run.
pub async fn commit_migration<S: MigrationStore>(store: &S, id: &EventId, to_topic: &str, fence: &MigrationFence, lookup: Option<&LookupOutcome>) -> Result<Result<u32, String>, String> {
    match store.commit_migration(id, &route(to_topic), "conformance", &POLICY, fence, lookup, false).await {
        Ok(MigrationOutcome::Migrated { to_generation, .. }) => Ok(Ok(to_generation)),
        Ok(MigrationOutcome::Refused { reason }) => Ok(Err(reason)),
        Ok(other) => Err(format!("not a dry run, yet {other:?}")),
        Err(e) => Err(e.to_string()),
    }
}

/// [`Harness::skip_event`](outbox_memory::conformance::Harness::skip_event):
/// the store's skip ([`SkipStore::skip_event`]).
pub async fn skip_event<S: SkipStore>(store: &S, id: &EventId, operator: &str, reason: &str) -> Result<Result<outbox_core::SkipRecord, String>, String> {
    match store.skip_event(id, operator, reason).await {
        Ok(SkipOutcome::Skipped { record }) => Ok(Ok(record)),
        Ok(SkipOutcome::Refused { reason }) => Ok(Err(reason)),
        Err(e) => Err(e.to_string()),
    }
}

/// [`Harness::skip_records`](outbox_memory::conformance::Harness::skip_records):
/// the store's skip records ([`SkipStore::skip_records`]).
pub async fn skip_records<S: SkipStore>(store: &S, id: &EventId) -> Result<Vec<outbox_core::SkipRecord>, String> {
    store.skip_records(id).await.map_err(|e| e.to_string())
}

/// [`Harness::set_poison_policy`](outbox_memory::conformance::Harness::set_poison_policy):
/// [`SkipStore::set_poison_policy`].
pub async fn set_poison_policy<S: SkipStore>(store: &S, rule: &outbox_core::PoisonRule) -> Result<(), String> {
    store.set_poison_policy(rule).await.map_err(|e| e.to_string())
}

/// [`Harness::release_poisoned`](outbox_memory::conformance::Harness::release_poisoned):
/// [`SkipStore::release_poisoned`].
pub async fn release_poisoned<S: SkipStore>(store: &S, limit: usize) -> Result<Vec<outbox_core::SkipRecord>, String> {
    store.release_poisoned(limit).await.map_err(|e| e.to_string())
}

/// The pass of [`Harness::purge`](outbox_memory::conformance::Harness::purge),
/// once the harness has written its registry and watermarks: [`purge_with`]
/// over `store` at `now_ms` with `replay_window_ms`, in pages of two (so a
/// pass pages past held events to later ones).
pub async fn purge<S: RetentionStore>(store: &S, now_ms: i64, replay_window_ms: i64) -> Result<PurgeCounts, String> {
    let policy = RetentionPolicy { replay_window_ms, batch_size: 2, max_batches: 1_000 };
    let r = purge_with(store, now_ms, &policy, false, |_| {}).await.map_err(|e| e.to_string())?;
    Ok(PurgeCounts { retained: r.retained, purged: r.purged, held: r.held_by_consumers, replaced_log: r.held_on_replaced_log, lost_position: r.held_on_lost_position })
}

/// The reconciler's configuration in the suite: retry policy [`POLICY`],
/// clock skew allowance 1 000 ms.
fn config(owner: &str) -> ReconcilerConfig {
    ReconcilerConfig { owner: owner.into(), retry: POLICY, clock_skew_allowance_ms: 1_000, ..ReconcilerConfig::default() }
}

/// [`Harness::bypass_scan`](outbox_memory::conformance::Harness::bypass_scan):
/// the shipped reconciler's bypass scan ([`Reconciler::scan_for_bypass`])
/// over `store` against `log` as its broker; the findings it recorded, the
/// store's scan cursor of each partition of `log` after it, and how many
/// copies it handed to the receipt transaction.
pub async fn bypass_scan<S: ServiceStore + BypassScanStore + Clone>(store: &S, log: &ScanLog) -> Result<ScanOutcome, String> {
    let r = Reconciler::new(store.clone(), Arc::new(log.clone()), config("conformance-scan")).map_err(|e| e.to_string())?;
    let report = r.scan_for_bypass().await.map_err(|e| e.to_string())?;
    let mut cursors = BTreeMap::new();
    for p in log.partitions.keys() {
        cursors.insert(*p, store.bypass_cursor(&log.cluster_id, &log.topic, *p).await.map_err(|e| e.to_string())?.next_offset);
    }
    Ok(ScanOutcome { findings: report.findings.into_iter().map(|(k, e)| (k.to_owned(), e)).collect(), cursors, submitted: report.submitted })
}

/// The round of [`Harness::compare_findings`](outbox_memory::conformance::Harness::compare_findings),
/// once the harness has registered its consumers and set their
/// watermarks: the shipped reconciler's condition findings
/// ([`Reconciler::compare_findings`]) over `store` with `thresholds`,
/// against a broker of [`CLUSTER`] with nothing to scan. The harness then
/// reads the open findings from its store.
pub async fn compare_findings<S: ServiceStore + FindingsStore + Clone>(store: &S, thresholds: &FindingThresholds) -> Result<(), String> {
    let config = ReconcilerConfig {
        aged_pending_ms: thresholds.aged_pending_ms,
        unknown_slo_ms: thresholds.unknown_slo_ms,
        unconsumed_after_ms: thresholds.unconsumed_after_ms,
        ..config("conformance-findings")
    };
    let broker = ScanLog { cluster_id: CLUSTER.into(), ..Default::default() };
    let r = Reconciler::new(store.clone(), Arc::new(broker), config).map_err(|e| e.to_string())?;
    r.compare_findings().await.map_err(|e| e.to_string())?;
    Ok(())
}
