//! The store seam: the in-memory store behind the faults of a database
//! ([`SimStore`]: calls that fail, stall or commit with their answer lost),
//! stamped with its host's clock, and the dispatchers' listening sessions.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{
    AttemptId, AttemptRecord, AttemptState, BrokerReceipt, ClaimToken, ClaimedEvent, EventId, EventState, FenceOutcome, LookupOutcome, OutboxStore,
    ReceiptOutcome, ReconcileDecision, ReconcileTask, RetryPolicy, RoutePolicy, StoreError, SweepOutcome,
};
use outbox_core::MigrationFence;
use outbox_memory::MemoryStore;
use outbox_producer::migration::{MigrationOutcome, MigrationStore};
use outbox_producer::service_store::{ClaimRound, CommitListener, Notice, ServiceStore};
use outbox_producer::ProducerError;

use super::world::{world, Busy, Host, Shared};
use super::LEASE_MS;

#[derive(Clone, Copy, PartialEq, Eq)]
enum StoreFault {
    None,
    Fail,
    AnswerLost,
}

/// The in-memory store behind the faults of a database: failures before
/// the call, commits whose answer is lost, stalls. Its clock follows
/// virtual time.
#[derive(Clone)]
pub struct SimStore {
    pub(super) inner: MemoryStore,
    pub(super) world: Shared,
    /// Chance per call of a long pause of the process using this store (the
    /// operator's: `ServiceFaults::operator_pause`).
    pub(super) pause: f64,
    /// The host of the process using this store.
    pub(super) host: Arc<Host>,
}

impl std::fmt::Debug for SimStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SimStore")
    }
}

fn lost(what: &str) -> StoreError {
    StoreError::Backend { message: format!("simulated: connection lost during {what}"), retryable: true }
}

impl SimStore {
    /// Stamps the next call with this host's clock.
    fn sync_clock(&self) {
        let now = world(&self.world).now_ms();
        self.inner.set_now_ms(now + self.host.skew_ms);
    }

    /// Before a call: maybe stall, maybe fail; returns the fault and the
    /// stall to take after the call (a commit whose answer comes late).
    async fn before(&self, what: &str) -> Result<(StoreFault, u64), StoreError> {
        self.host.wait_running(&self.world).await;
        let (stall, stall_after, fault) = {
            let mut w = world(&self.world);
            if !w.on {
                (0, false, StoreFault::None)
            } else {
                let f = w.faults;
                // A stall is a process paused (GC, VM) or a connection stuck,
                // up to four leases, before the call or after its commit.
                let pause = self.pause;
                let (stall, stall_after) = if pause > 0.0 && w.rng.chance(pause) {
                    (w.rng.range(1, 6 * LEASE_MS), false)
                } else if w.rng.chance(f.store_stall) {
                    (w.rng.range(1, 4 * LEASE_MS), w.rng.chance(0.5))
                } else if w.rng.chance(f.answer_late) {
                    (w.rng.range(1, LEASE_MS), true)
                } else {
                    (0, false)
                };
                let fault = if w.rng.chance(f.store_fail) {
                    StoreFault::Fail
                } else if w.rng.chance(f.store_answer_lost) {
                    StoreFault::AnswerLost
                } else {
                    StoreFault::None
                };
                if stall > 0 || fault != StoreFault::None {
                    w.figures.store_faults += 1;
                    let when = if stall_after { "after" } else { "before" };
                    w.note(|| format!("store fault at {what}: stall {stall} ms {when} the call, {}", match fault { StoreFault::Fail => "fails", StoreFault::AnswerLost => "answer lost", StoreFault::None => "then answers" }));
                }
                (stall, stall_after, fault)
            }
        };
        if stall > 0 && !stall_after {
            tokio::time::sleep(Duration::from_millis(stall as u64)).await;
        }
        self.sync_clock();
        if fault == StoreFault::Fail {
            return Err(lost(what));
        }
        Ok((fault, if stall_after { stall as u64 } else { 0 }))
    }

    /// Counts a receipt call in progress until the guard drops (answered,
    /// or its process killed).
    fn busy(&self) -> Busy {
        world(&self.world).in_store += 1;
        Busy(self.world.clone())
    }

    /// Notes when attempts of `event_id` were closed ABSENT.
    fn note_absent(&self, event_id: &EventId) {
        let closed: Vec<String> = self.inner.lock().attempts.get(event_id).into_iter().flatten().filter(|a| a.state == AttemptState::Absent).map(|a| a.attempt_id.to_string()).collect();
        let mut w = world(&self.world);
        let now = w.now_ms();
        for a in closed {
            w.absent_at.entry(a).or_insert(now);
        }
    }

    /// Notes the attempts of `receipts` as ones this host called the store with.
    fn tried(&self, receipts: &[BrokerReceipt]) {
        let mut w = world(&self.world);
        for r in receipts {
            w.tried_by.insert((self.host.id, r.attempt_id.to_string()));
        }
    }

    /// Notes the attempts of `receipts` as handed to the store.
    fn handed(&self, receipts: &[BrokerReceipt]) -> &Self {
        let mut w = world(&self.world);
        for r in receipts {
            w.handed_by.insert((self.host.id, r.attempt_id.to_string()));
        }
        self
    }

    async fn after<T, E: From<StoreError>>(&self, (fault, stall): (StoreFault, u64), what: &str, r: Result<T, E>) -> Result<T, E> {
        if stall > 0 {
            tokio::time::sleep(Duration::from_millis(stall)).await;
            self.sync_clock();
        }
        match (fault, r) {
            (StoreFault::AnswerLost, Ok(_)) => Err(lost(what).into()),
            (_, r) => r,
        }
    }
}

macro_rules! faulty {
    ($self:ident, $what:literal, $call:expr) => {{
        let fault = $self.before($what).await?;
        let r = $call.await;
        $self.after(fault, $what, r).await
    }};
}

#[async_trait]
impl OutboxStore for SimStore {
    async fn claim_batch(&self, owner: &str, limit: usize, lease_ms: i64) -> Result<Vec<ClaimedEvent>, StoreError> {
        faulty!(self, "claim_batch", self.inner.claim_batch(owner, limit, lease_ms))
    }
    async fn claim_retries(&self, owner: &str, limit: usize, lease_ms: i64) -> Result<Vec<ClaimedEvent>, StoreError> {
        faulty!(self, "claim_retries", self.inner.claim_retries(owner, limit, lease_ms))
    }
    async fn register_attempt(&self, token: &ClaimToken) -> Result<AttemptRecord, StoreError> {
        faulty!(self, "register_attempt", self.inner.register_attempt(token))
    }
    async fn accept_dispatch_receipt(&self, receipt: &BrokerReceipt) -> Result<ReceiptOutcome, StoreError> {
        let _busy = self.busy();
        self.tried(std::slice::from_ref(receipt));
        faulty!(self, "accept_dispatch_receipt", async { self.handed(std::slice::from_ref(receipt)).inner.accept_dispatch_receipt(receipt).await })
    }
    async fn register_attempts(&self, tokens: &[ClaimToken]) -> Result<Vec<Result<AttemptRecord, StoreError>>, StoreError> {
        faulty!(self, "register_attempts", self.inner.register_attempts(tokens))
    }
    async fn accept_dispatch_receipts(&self, receipts: &[BrokerReceipt]) -> Result<Vec<ReceiptOutcome>, StoreError> {
        let _busy = self.busy();
        self.tried(receipts);
        faulty!(self, "accept_dispatch_receipts", async { self.handed(receipts).inner.accept_dispatch_receipts(receipts).await })
    }
    async fn report_unknown(&self, token: &ClaimToken, attempt_id: &AttemptId, detail: &str) -> Result<FenceOutcome, StoreError> {
        faulty!(self, "report_unknown", self.inner.report_unknown(token, attempt_id, detail))
    }
    async fn report_not_sent(&self, token: &ClaimToken, attempt_id: &AttemptId, detail: &str) -> Result<FenceOutcome, StoreError> {
        faulty!(self, "report_not_sent", self.inner.report_not_sent(token, attempt_id, detail))
    }
    async fn release(&self, token: &ClaimToken) -> Result<FenceOutcome, StoreError> {
        faulty!(self, "release", self.inner.release(token))
    }
    async fn quarantine_claimed(&self, token: &ClaimToken, reason: &str, evidence: serde_json::Value) -> Result<FenceOutcome, StoreError> {
        faulty!(self, "quarantine_claimed", self.inner.quarantine_claimed(token, reason, evidence))
    }
    async fn renew_lease(&self, token: &ClaimToken, lease_ms: i64) -> Result<Option<i64>, StoreError> {
        faulty!(self, "renew_lease", self.inner.renew_lease(token, lease_ms))
    }
    async fn expire_leases(&self) -> Result<SweepOutcome, StoreError> {
        faulty!(self, "expire_leases", self.inner.expire_leases())
    }
    async fn begin_reconcile(&self, owner: &str, limit: usize, lease_ms: i64) -> Result<Vec<ReconcileTask>, StoreError> {
        faulty!(self, "begin_reconcile", self.inner.begin_reconcile(owner, limit, lease_ms))
    }
    async fn finish_reconcile(&self, token: &ClaimToken, decision: &ReconcileDecision) -> Result<FenceOutcome, StoreError> {
        faulty!(self, "finish_reconcile", async {
            let r = self.inner.finish_reconcile(token, decision).await;
            self.note_absent(&token.event_id);
            r
        })
    }
    async fn attempts(&self, event_id: &EventId) -> Result<Vec<AttemptRecord>, StoreError> {
        faulty!(self, "attempts", self.inner.attempts(event_id))
    }
    async fn event_state(&self, event_id: &EventId) -> Result<(EventState, Option<BrokerReceipt>), StoreError> {
        faulty!(self, "event_state", self.inner.event_state(event_id))
    }
}

#[async_trait]
impl ServiceStore for SimStore {
    /// The simulated operator's store: the in-memory store's release (no
    /// fault drawn; the simulator sets no poison policy).
    async fn release_poisoned(&self, limit: usize) -> Result<Vec<outbox_core::SkipRecord>, outbox_producer::ProducerError> {
        ServiceStore::release_poisoned(&self.inner, limit).await
    }

    fn now_ms(&self) -> i64 {
        self.sync_clock();
        self.inner.now_ms()
    }
    fn scoped_to_cluster(self, _cluster_id: &str) -> Self {
        self
    }
    async fn claim_next(&self, owner: &str, after: &[EventId], scan_due: bool, limit: usize, lease_ms: i64) -> Result<ClaimRound, StoreError> {
        faulty!(self, "claim_next", ServiceStore::claim_next(&self.inner, owner, after, scan_due, limit, lease_ms))
    }
    async fn renew_leases(&self, tokens: &[ClaimToken], lease_ms: i64) -> Result<Vec<Option<i64>>, StoreError> {
        faulty!(self, "renew_leases", ServiceStore::renew_leases(&self.inner, tokens, lease_ms))
    }
    async fn registered_attempts(&self, tokens: &[ClaimToken]) -> Result<Vec<AttemptRecord>, StoreError> {
        faulty!(self, "registered_attempts", ServiceStore::registered_attempts(&self.inner, tokens))
    }
    async fn listen(&self) -> Result<Option<Box<dyn CommitListener>>, StoreError> {
        let fault = self.before("listen").await?;
        let (seen, committed) = {
            let w = world(&self.world);
            (w.commits, w.committed.clone())
        };
        let listener = SimListener { seen, committed, world: self.world.clone(), host: self.host.clone(), down: false };
        self.after(fault, "listen", Ok(Some(Box::new(listener) as Box<dyn CommitListener>))).await
    }
    async fn record_findings(&self, findings: &[(&'static str, String, String)], _now_ms: i64) -> Result<(), StoreError> {
        let fault = self.before("record_findings").await?;
        {
            let mut w = world(&self.world);
            for (kind, event_id, detail) in findings {
                w.note(|| format!("finding {kind} {event_id}: {detail}"));
                w.findings.push(((*kind).to_owned(), event_id.clone()));
            }
        }
        self.after(fault, "record_findings", Ok(())).await
    }
}

/// A dispatcher's listening session: hears each commit made while it
/// listens (several commits between two reads are one notice, as
/// PostgreSQL folds them for a session that is busy). While faults are on,
/// a session is lost now and then: the notice goes with it, and the next
/// read either fails (not replaced yet) or says it was replaced.
struct SimListener {
    /// The commits counted when it last read.
    seen: u64,
    /// Woken at each commit.
    committed: Arc<tokio::sync::Notify>,
    world: Shared,
    host: Arc<Host>,
    /// Lost and not replaced yet.
    down: bool,
}

/// The chance that a notice finds its session lost.
const LISTEN_LOST: f64 = 0.05;

#[async_trait]
impl CommitListener for SimListener {
    async fn next(&mut self) -> Result<Notice, StoreError> {
        if std::mem::take(&mut self.down) {
            self.seen = world(&self.world).commits;
            return Ok(Notice::Replaced);
        }
        loop {
            let notified = self.committed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let commits = world(&self.world).commits;
            if commits > self.seen {
                self.seen = commits;
                break;
            }
            notified.await;
        }
        self.host.wait_running(&self.world).await;
        let mut w = world(&self.world);
        if w.on && w.listen_rng.chance(LISTEN_LOST) {
            w.figures.listen_sessions_lost += 1;
            w.note(|| format!("host {}: its LISTEN session is lost with a notice", self.host.id));
            if w.listen_rng.chance(0.5) {
                self.down = true;
                return Err(lost("LISTEN"));
            }
            self.seen = w.commits;
            return Ok(Notice::Replaced);
        }
        Ok(Notice::Committed)
    }
}

/// The bypass scan's reads answer at once; its one write (evidence,
/// findings and cursor in one transaction) meets the store's faults.
#[async_trait]
impl outbox_core::BypassScanStore for SimStore {
    async fn routed_topics(&self, cluster_id: &str) -> Result<Vec<(String, i32)>, StoreError> {
        self.inner.routed_topics(cluster_id).await
    }
    async fn routes_to(&self, cluster_id: &str, topic: &str) -> Result<Vec<(String, i32)>, StoreError> {
        self.inner.routes_to(cluster_id, topic).await
    }
    async fn source_identity(&self) -> Result<Option<String>, StoreError> {
        self.inner.source_identity().await
    }
    async fn bypass_cursor(&self, cluster_id: &str, topic: &str, partition: i32) -> Result<outbox_core::BypassCursor, StoreError> {
        self.inner.bypass_cursor(cluster_id, topic, partition).await
    }
    async fn committed_event_ids(&self, event_ids: &[String]) -> Result<BTreeSet<String>, StoreError> {
        self.inner.committed_event_ids(event_ids).await
    }
    async fn receipts_at(&self, cluster_id: &str, topic: &str, partition: i32, offsets: &[i64]) -> Result<Vec<outbox_core::compare::RecordedReceipt>, StoreError> {
        self.inner.receipts_at(cluster_id, topic, partition, offsets).await
    }
    async fn published_digests(&self, event_ids: &[String]) -> Result<BTreeMap<String, outbox_core::compare::PublishedCopy>, StoreError> {
        self.inner.published_digests(event_ids).await
    }
    async fn unanswered_attempts_of(&self, event_ids: &[String]) -> Result<Vec<AttemptRecord>, StoreError> {
        self.inner.unanswered_attempts_of(event_ids).await
    }
    async fn receipts_from(
        &self,
        cluster_id: &str,
        topic: &str,
        partition: i32,
        from_offset: i64,
        accepted_before_ms: i64,
        limit: i64,
    ) -> Result<Vec<outbox_core::compare::RecordedReceipt>, StoreError> {
        self.inner.receipts_from(cluster_id, topic, partition, from_offset, accepted_before_ms, limit).await
    }
    async fn record_bypass_scan(&self, write: &outbox_core::BypassScanWrite) -> Result<(), StoreError> {
        faulty!(self, "record_bypass_scan", async {
            let r = self.inner.record_bypass_scan(write).await;
            if r.is_ok() {
                let mut w = world(&self.world);
                for f in &write.findings {
                    w.note(|| format!("finding {} {}: {}", f.kind, f.event_id, f.detail));
                    w.findings.push((f.kind.to_owned(), f.event_id.clone()));
                    if let (Some(offset), Some(attempt)) = (f.offset, &f.attempt_id) {
                        w.copies_reported.insert((write.topic.clone(), write.partition, offset, attempt.clone()));
                    }
                    if f.kind == outbox_core::compare::SCAN_GAP {
                        if let Some((from, to)) = outbox_core::compare::scan_gap_range(&f.event_id) {
                            let key = (write.topic.clone(), write.partition);
                            let incarnation = w.incarnation(&key);
                            w.scan_gaps.push((key, incarnation, from, to));
                        }
                    }
                }
            }
            r
        })
    }
}

/// The comparison's condition findings: reads answer directly (the
/// in-memory store's), the round's write goes through the faults.
#[async_trait]
impl outbox_core::FindingsStore for SimStore {
    async fn aged_candidates(&self, created_before_ms: i64, limit: i64) -> Result<Vec<outbox_core::EventFacts>, StoreError> {
        self.inner.aged_candidates(created_before_ms, limit).await
    }
    async fn unknown_candidates(&self, unknown_before_ms: i64, limit: i64) -> Result<Vec<outbox_core::EventFacts>, StoreError> {
        self.inner.unknown_candidates(unknown_before_ms, limit).await
    }
    async fn quarantined_candidates(&self, limit: i64) -> Result<Vec<outbox_core::EventFacts>, StoreError> {
        self.inner.quarantined_candidates(limit).await
    }
    async fn critical_consumers(&self) -> Result<Vec<(String, Vec<String>)>, StoreError> {
        self.inner.critical_consumers().await
    }
    async fn published_candidates(&self, consumer_id: &str, topics: &[String], published_before_ms: i64, limit: i64) -> Result<Vec<outbox_core::PublishedFacts>, StoreError> {
        self.inner.published_candidates(consumer_id, topics, published_before_ms, limit).await
    }
    async fn consumer_watermarks(&self, consumer_id: &str, topics: &[String]) -> Result<Vec<outbox_core::ConsumerWatermark>, StoreError> {
        self.inner.consumer_watermarks(consumer_id, topics).await
    }
    async fn receipt_sweep_page(&self, limit: i64) -> Result<Vec<outbox_core::SweptEvent>, StoreError> {
        self.inner.receipt_sweep_page(limit).await
    }
    async fn watermark_publishers(&self, received_before_ms: i64, limit: i64) -> Result<Vec<outbox_core::WatermarkPublisherFacts>, StoreError> {
        self.inner.watermark_publishers(received_before_ms, limit).await
    }
    async fn record_round_findings(&self, now_ms: i64, findings: &[outbox_core::RoundFinding]) -> Result<(), StoreError> {
        faulty!(self, "record_round_findings", self.inner.record_round_findings(now_ms, findings))
    }
}

#[async_trait]
impl outbox_producer::RoundStore for SimStore {
    async fn record_state_snapshot(&self, now_ms: i64, keep_ms: i64) -> Result<(), ProducerError> {
        self.inner.record_state_snapshot(now_ms, keep_ms).await
    }
    async fn record_round(&self, round: &outbox_producer::RoundRecord<'_>) -> Result<(), ProducerError> {
        self.inner.record_round(round).await
    }
}

#[async_trait]
impl MigrationStore for SimStore {
    async fn migration_read(&self, event_id: &EventId) -> Result<(EventState, u64), ProducerError> {
        faulty!(self, "migration_read", MigrationStore::migration_read(&self.inner, event_id))
    }
    async fn begin_reconcile_event(&self, owner: &str, event_id: &EventId, lease_ms: i64) -> Result<Option<ReconcileTask>, StoreError> {
        faulty!(self, "begin_reconcile_event", MigrationStore::begin_reconcile_event(&self.inner, owner, event_id, lease_ms))
    }
    async fn commit_migration(
        &self,
        event_id: &EventId,
        new_route: &RoutePolicy,
        operator: &str,
        retry: &RetryPolicy,
        fence: &MigrationFence,
        lookup: Option<&LookupOutcome>,
        dry_run: bool,
    ) -> Result<MigrationOutcome, ProducerError> {
        faulty!(self, "commit_migration", MigrationStore::commit_migration(&self.inner, event_id, new_route, operator, retry, fence, lookup, dry_run))
    }
}
