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

/// What one comparison of the three sets found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompareReport {
    /// PENDING past `aged_pending_ms`.
    pub aged_pending: usize,
    /// PUBLISHED but not passed by a critical consumer's watermark.
    pub unconsumed_published: usize,
    /// Messages in a routed topic that the outbox never committed (this round).
    pub bypass_publish: usize,
    /// UNKNOWN past the SLO.
    pub unknown_past_slo: usize,
    /// Quarantined events.
    pub quarantined: usize,
    /// PUBLISHED, RETAINED or PURGED events without a primary receipt found
    /// by this round's part of the sweep.
    pub published_without_receipt: usize,
    /// Declared consumers whose watermark records stopped arriving.
    pub stale_watermark: usize,
    /// Messages read by the bypass check.
    pub scanned_messages: usize,
    /// Copies the bypass check handed to the receipt transaction: copies
    /// of an attempt past its in-flight bound, whose event was not
    /// published, that no answer will reach (this round).
    pub bypass_submitted: usize,
    /// Messages whose `outbox-source` is another outbox's, not declared (this round).
    pub foreign_source: usize,
    /// Copies of a published event, byte-identical, at a position that is
    /// neither its primary receipt nor a recorded duplicate transport receipt (this round).
    pub unrecorded_copy: usize,
    /// Messages with a published event's id whose bytes differ from the event's (this round).
    pub divergent_copy: usize,
    /// Routed topics whose partition count is not what their routes froze (this round).
    pub partition_count_changed: usize,
}

impl CompareReport {
    /// Total findings.
    pub fn total(&self) -> usize {
        self.aged_pending
            + self.unconsumed_published
            + self.bypass_publish
            + self.unknown_past_slo
            + self.quarantined
            + self.published_without_receipt
            + self.foreign_source
            + self.unrecorded_copy
            + self.divergent_copy
            + self.stale_watermark
            + self.partition_count_changed
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
    /// Failed on their own (logged); looked at again after their lease.
    pub failed: usize,
    /// Given back unstarted: the round ran past half of its lease.
    pub given_back: usize,
}

/// What one bypass scan ([`Reconciler::scan_for_bypass`]) read and recorded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BypassScanReport {
    /// Messages read.
    pub scanned: usize,
    /// Copies handed to the receipt transaction ([`ScanJudgement::Submit`]).
    pub submitted: usize,
    /// Findings recorded: kind, and the event (or label) each names.
    pub findings: Vec<(&'static str, String)>,
    /// What the scan saw that is no finding, in words, each also logged at
    /// WARN: a partition whose broker reports its end below receipts whose
    /// events it still serves there (one note per partition per scan).
    pub notes: Vec<String>,
}

impl BypassScanReport {
    /// Adds what the scan read, what it handed to the receipt transaction
    /// and its findings about messages to `report` (receipts whose position
    /// was lost are recorded, not counted there).
    pub fn count_into(&self, report: &mut CompareReport) {
        report.scanned_messages += self.scanned;
        report.bypass_submitted += self.submitted;
        for (kind, _) in &self.findings {
            match *kind {
                "bypass_publish" => report.bypass_publish += 1,
                "foreign_source" => report.foreign_source += 1,
                "unrecorded_copy" => report.unrecorded_copy += 1,
                "divergent_copy" => report.divergent_copy += 1,
                "partition_count_changed" => report.partition_count_changed += 1,
                _ => {}
            }
        }
    }
}

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

    /// One round: expire leases, then resolve up to `batch_size` due unknowns.
    pub async fn resolve_unknown_once(&self) -> Result<ResolveReport, ProducerError> {
        self.store.expire_leases().await?;
        let tasks = self.store.begin_reconcile(&self.config.owner, self.config.batch_size, self.config.lease_ms).await?;
        let mut report = ResolveReport { examined: tasks.len(), ..Default::default() };
        self.last_examined.store(tasks.len(), std::sync::atomic::Ordering::Relaxed);
        let supports = self.broker.supports_lookup();
        for task in tasks {
            // The round is sized to its lease: a task whose claim has less
            // than half its lease left is given back (due again at once)
            // rather than started, so that a long round never works on
            // claims another reconciler has taken over.
            if self.store.now_ms() >= task.token.lease_until_ms.saturating_sub(self.config.lease_ms / 2) {
                let back = ReconcileDecision::Recheck { reason: outbox_core::RecheckReason::BrokerUnavailable, next_check_at_ms: self.store.now_ms() };
                if let Err(e) = self.store.finish_reconcile(&task.token, &back).await {
                    tracing::warn!(event_id = %task.event.event_id, error = %e, "could not give back a reconcile claim; it runs out with its lease");
                }
                report.given_back += 1;
                continue;
            }
            // One event's failure (a database error on its receipts, a
            // refused write) is logged and counted; its claim runs out with
            // its lease and the round goes on with the others.
            if let Err(e) = self.resolve_one(&task, supports, &mut report).await {
                tracing::error!(event_id = %task.event.event_id, error = %e, "reconciling this event failed; it is looked at again after its lease");
                report.failed += 1;
            }
        }
        Ok(report)
    }

    async fn resolve_one(&self, task: &outbox_core::ReconcileTask, supports: bool, report: &mut ResolveReport) -> Result<(), ProducerError> {
        let event_id = &task.event.event_id;
        // The time the decision is made at is taken before the lookup: a
        // scan answers for the log as it was when it began (the adapter
        // fetches the end offset first), so the in-flight bound must have
        // passed by then, not merely by the time the answer came back.
        let now = self.store.now_ms();
        let lookup = if !supports {
            LookupOutcome::Unavailable("the broker adapter cannot look up events".into())
        } else if task.event.destination.cluster_id != self.broker.cluster_id() {
            LookupOutcome::Unavailable(format!("connected to cluster {}, event frozen for {}", self.broker.cluster_id(), task.event.destination.cluster_id))
        } else {
            self.broker.lookup(&task.event.destination, event_id, &scan_floor(&task.attempts)).await
        };
        if let LookupOutcome::Unavailable(why) = &lookup {
            if crate::kafka::is_log_incomplete(why) {
                tracing::error!(%event_id, reason = %why, "the frozen partition's log cannot prove absence: the event stays unknown");
                self.store.record_findings(&[("log_unavailable", event_id.to_string(), why.clone())], now).await?;
            }
        }
        let decision = decide_reconcile(&task.attempts, &lookup, supports, &self.config.retry, now);
        tracing::info!(%event_id, ?decision, "reconcile decision");
        self.record_lookup(event_id.as_str(), now, scan_lower_bound(&task.attempts), &lookup, &decision).await?;
        match &decision {
            ReconcileDecision::Submit(receipts) => {
                let outcomes = self.store.accept_dispatch_receipts(receipts).await?;
                match outcomes.last().map(|o| o.state) {
                    Some(EventState::Published) => report.published += 1,
                    Some(EventState::Quarantined) => report.quarantined += 1,
                    _ => {
                        // Every message found refused (none from a
                        // registered attempt): the absence logic decides,
                        // instead of looking again and again.
                        let decisions: Vec<_> = outcomes.iter().map(|o| o.decision.clone()).collect();
                        let next = decide_after_submit(&decisions, &task.attempts, supports, &self.config.retry, now);
                        tracing::info!(%event_id, decision = ?next, "every receipt found was refused");
                        self.store.finish_reconcile(&task.token, &next).await?;
                        match next {
                            ReconcileDecision::Retry { .. } => report.retried += 1,
                            _ => report.rechecks += 1,
                        }
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
        Ok(())
    }

    /// Keeps the lookup and the decision as evidence (`outbox unknown show`).
    async fn record_lookup(&self, event_id: &str, now: i64, from_offset: i64, lookup: &LookupOutcome, decision: &ReconcileDecision) -> Result<(), ProducerError> {
        let lookup = match lookup {
            LookupOutcome::Found(receipts) => {
                let at: Vec<String> = receipts.iter().map(|r| format!("{}/{}@{}", r.topic, r.partition, r.offset)).collect();
                format!("found {} message(s) at {}", receipts.len(), at.join(", "))
            }
            LookupOutcome::Absent => "absent: the scanned range holds no message of the event".to_owned(),
            LookupOutcome::Unavailable(why) => format!("unavailable: {why}"),
        };
        let decision = match decision {
            ReconcileDecision::Submit(r) => format!("submit {} receipt(s) through the receipt transaction", r.len()),
            ReconcileDecision::Retry { proven_absent } => format!("retry to the same destination (proven absent: {proven_absent})"),
            ReconcileDecision::Recheck { reason, next_check_at_ms } => format!("recheck at {next_check_at_ms} ms ({reason:?})"),
        };
        self.store.record_lookup(&self.config.owner, event_id, now, from_offset, &lookup, &decision).await?;
        Ok(())
    }

    /// [`Reconciler::run`] without the comparison: resolves due unknowns
    /// every `interval_ms` until `shutdown` resolves. Over any store (the
    /// simulator runs it over the in-memory one); the SQL store's `run` adds
    /// the comparison of the three sets to every round.
    pub async fn run_resolving(&self, shutdown: impl std::future::Future<Output = ()> + Send) -> Result<u64, ProducerError> {
        self.rounds(shutdown, &(), |_| async { Ok((self.resolve_unknown_once().await?, CompareReport::default())) }).await
    }

    /// Reads every routed topic of this broker's cluster from its cursor and
    /// reports messages whose eventId the outbox never committed, or that
    /// carry none (`bypass_publish`); messages another, undeclared outbox
    /// wrote (`foreign_source`); and copies of published events at a
    /// position that is neither their primary receipt nor a recorded
    /// duplicate transport receipt, byte-identical (`unrecorded_copy`) or
    /// not (`divergent_copy`); and receipts whose position the log no
    /// longer has (`receipt_position_lost`). What each message is, where
    /// the cursor goes and which positions are lost are
    /// `outbox_core::compare`'s decisions; each page's evidence, findings
    /// and cursor are written in one transaction
    /// ([`BypassScanStore::record_bypass_scan`]).
    pub async fn scan_for_bypass(&self) -> Result<BypassScanReport, ProducerError>
    where
        S: BypassScanStore,
    {
        self.scan_at(self.store.now_ms()).await
    }

    async fn scan_at(&self, now: i64) -> Result<BypassScanReport, ProducerError>
    where
        S: BypassScanStore,
    {
        let cluster = self.broker.cluster_id().to_owned();
        let topics = self.store.routed_topics(&cluster).await?;
        let own_source = self.store.source_identity().await?;
        let mut report = BypassScanReport::default();
        for (topic, partitions) in topics {
            // A topic with another partition count than its routes froze
            // (brought back by auto-creation after a broker replacement, or
            // recreated): a finding naming both counts; the partitions it
            // lacks are not read (their events wait, visibly).
            let readable = match self.broker.partition_count(&topic).await {
                Ok(Some(actual)) => {
                    let routes = self.store.routes_to(&cluster, &topic).await?;
                    if let Some(detail) = outbox_core::compare::partition_count_finding(&cluster, &topic, actual, &routes) {
                        tracing::error!(%topic, actual, frozen = partitions, "{detail}");
                        let finding = ScanFinding {
                            kind: outbox_core::compare::PARTITION_COUNT_CHANGED,
                            event_id: outbox_core::compare::partition_count_label(&topic),
                            detail,
                            offset: None,
                            attempt_id: None,
                        };
                        // Recorded with partition 0's page; a cursor never
                        // moves back, so Advance(0) leaves it (and its anchor) as it is.
                        let write = BypassScanWrite { cluster_id: cluster.clone(), topic: topic.clone(), partition: 0, now_ms: now, bypass_messages: Vec::new(), findings: vec![finding], cursor: CursorMove::Advance(0), anchor: None };
                        self.store.record_bypass_scan(&write).await?;
                        report.findings.push((outbox_core::compare::PARTITION_COUNT_CHANGED, outbox_core::compare::partition_count_label(&topic)));
                    }
                    partitions.min(i32::try_from(actual).unwrap_or(i32::MAX))
                }
                Ok(None) => partitions,
                Err(e) => {
                    tracing::warn!(%topic, error = %e, "could not read the topic's partition count");
                    partitions
                }
            };
            for partition in 0..readable {
                let at = self.store.bypass_cursor(&cluster, &topic, partition).await?;
                let cursor = at.next_offset;
                // A cursor with an anchor reads the message below it again:
                // a log replaced and grown past the cursor holds another
                // message there.
                let anchored = at.anchor.is_some() && cursor > 0;
                let from = if anchored { cursor - 1 } else { cursor };
                let mut scan = match self.broker.scan_event_ids(&topic, partition, from, self.config.bypass_scan_max_messages + u64::from(anchored)).await {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::warn!(%topic, partition, error = %e, "bypass check could not read the partition");
                        continue;
                    }
                };
                if take_scan_anchor(&at, &mut scan) {
                    tracing::error!(%topic, partition, cursor, "the partition's log holds another message below the bypass scan's cursor: the log was replaced; reading the new one from its start");
                    let write = BypassScanWrite { cluster_id: cluster.clone(), topic: topic.clone(), partition, now_ms: now, bypass_messages: Vec::new(), findings: Vec::new(), cursor: CursorMove::Restart, anchor: None };
                    self.store.record_bypass_scan(&write).await?;
                    continue;
                }
                report.scanned += scan.messages.len();
                let ids: Vec<String> = scan.messages.iter().filter_map(|m| m.event_id.clone()).collect();
                let known = if ids.is_empty() { BTreeSet::new() } else { self.store.committed_event_ids(&ids).await? };
                let offsets: Vec<i64> = scan.messages.iter().map(|m| m.offset).collect();
                let receipts = if offsets.is_empty() { Vec::new() } else { self.store.receipts_at(&cluster, &topic, partition, &offsets).await? };
                let known_ids: Vec<String> = known.iter().cloned().collect();
                let (published, open) = if known_ids.is_empty() {
                    Default::default()
                } else {
                    (self.store.published_digests(&known_ids).await?, self.store.unanswered_attempts_of(&known_ids).await?)
                };
                // A copy of an open attempt still within its in-flight bound
                // may be an answer on its way (waited for); past the bound no
                // receipt will come, and its copy is judged; a copy of an
                // attempt closed without a receipt refutes its closing.
                let copies = KnownCopies::new(&receipts, published, &open, &self.config.retry, now);
                let judged: Vec<(&outbox_core::ScannedMessage, ScanJudgement)> = scan
                    .messages
                    .iter()
                    .map(|m| (m, judge_scanned(m, own_source.as_deref(), &self.config.declared_sources, &known, &copies)))
                    .collect();
                // Copies no answer will reach, of events not published yet:
                // the receipt transaction takes them before the cursor moves
                // past (a failure leaves the page to be read again).
                let submit: Vec<outbox_core::BrokerReceipt> =
                    judged.iter().filter(|(_, j)| *j == ScanJudgement::Submit).filter_map(|(m, _)| m.receipt.clone()).collect();
                if !submit.is_empty() {
                    let outcomes = self.store.accept_dispatch_receipts(&submit).await?;
                    for (r, o) in submit.iter().zip(&outcomes) {
                        tracing::warn!(event_id = %r.event_id, attempt_id = %r.attempt_id, topic = %r.topic, partition = r.partition, offset = r.offset, decision = ?o.decision, state = ?o.state, "the bypass scan found a copy of an attempt past its in-flight bound, its event unpublished: handed to the receipt transaction");
                    }
                    report.submitted += submit.len();
                }
                let mut write = BypassScanWrite {
                    cluster_id: cluster.clone(),
                    topic: topic.clone(),
                    partition,
                    now_ms: now,
                    bypass_messages: Vec::new(),
                    findings: Vec::new(),
                    cursor: next_bypass_cursor(cursor, &scan, first_wait(judged.iter().copied())),
                    anchor: None,
                };
                if let CursorMove::Advance(to) = write.cursor {
                    write.anchor = anchor_below(to, &scan.messages);
                }
                // Offsets the log's start moved past before this check read
                // them (retention, DeleteRecords): the copies they held, if
                // any, can no longer be accounted for. Said once, with the page
                // that moves the cursor past them.
                if let Some(gap) = outbox_core::compare::unread_range(cursor, &scan) {
                    tracing::warn!(%topic, partition, from = gap.0, to = gap.1, "offsets were deleted from the partition before the bypass check read them");
                    write.findings.push(ScanFinding {
                        kind: outbox_core::compare::SCAN_GAP,
                        event_id: outbox_core::compare::scan_gap_label(&topic, partition, gap),
                        detail: format!(
                            "offsets {}..{} of {cluster}/{topic}/{partition} were deleted (retention, DeleteRecords) before the bypass check read them: copies they held cannot be accounted for (raise the topic's retention above the reconciler's lag; on a partition that held data from before the outbox, this is that history)",
                            gap.0, gap.1
                        ),
                        offset: Some(gap.0),
                        attempt_id: None,
                    });
                }
                for (m, j) in &judged {
                    let ScanJudgement::Finding(kind) = *j else { continue };
                    if j.is_bypass_message() {
                        write.bypass_messages.push((*m).clone());
                    }
                    let label = m.event_id.clone().unwrap_or_else(|| format!("no-event-id@{topic}/{partition}/{}", m.offset));
                    let detail = match kind {
                        outbox_core::compare::FOREIGN_SOURCE => {
                            let s: String = m.source.as_deref().unwrap_or_default().chars().take(200).collect();
                            format!("message of source {s} at {topic}/{partition}@{}: another outbox writes this topic (declare it, or stop it)", m.offset)
                        }
                        outbox_core::compare::BYPASS_PUBLISH => {
                            let why = if m.event_id.is_some() { "eventId in the topic that the outbox never committed" } else { "message without an outbox eventId" };
                            format!("{why} at {topic}/{partition}@{}", m.offset)
                        }
                        outbox_core::compare::ABSENCE_PROOF_REFUTED => {
                            let attempt = m.attempt_id.as_deref().unwrap_or_default();
                            format!("{attempt} @{}: a copy at {cluster}/{topic}/{partition}@{} of an attempt the outbox closed without a receipt (proven absent, or not sent)", m.offset, m.offset)
                        }
                        _ => {
                            let what = if kind == outbox_core::compare::UNRECORDED_COPY { "a byte-identical copy" } else { "a copy with other bytes" };
                            format!("{what} of the published event at {cluster}/{topic}/{partition}@{}, neither its primary receipt nor a recorded duplicate", m.offset)
                        }
                    };
                    write.findings.push(ScanFinding { kind, event_id: label, detail, offset: Some(m.offset), attempt_id: m.attempt_id.clone() });
                }
                // Receipts whose position now holds another message (or one
                // without an eventId, or the same event's message of another
                // topic id), and receipts at or beyond the log's end accepted
                // well before this round began: the log they were recorded in
                // is gone. Those already reported beyond the end are skipped,
                // so that a round's limit moves on to the next ones.
                let mut beyond = Vec::new();
                // What the broker serves past its reported end, from the
                // lowest receipt beyond it: a broker may report an end below
                // records it serves (tansu 0.6: its last produce batch's base
                // offset + 1), which is no lost log.
                let mut served = Vec::new();
                let mut under_reported: Vec<i64> = Vec::new();
                if let Some(end) = scan.log_end {
                    let before = outbox_core::compare::beyond_end_accepted_before_ms(now, self.config.clock_skew_allowance_ms);
                    beyond = self.store.receipts_from(&cluster, &topic, partition, end, before, self.config.max_findings_per_kind).await?;
                    if let Some((from, max)) = outbox_core::compare::past_end_read(end, &beyond, self.config.bypass_scan_max_messages) {
                        match self.broker.read_past_reported_end(&topic, partition, from, max).await {
                            Ok(m) => served = m,
                            Err(e) => tracing::debug!(%topic, partition, from, error = %e, "could not read past the partition's reported end"),
                        }
                    }
                }
                for r in receipts.iter().chain(&beyond) {
                    let Some(lost) = receipt_position_lost(&scan, r) else { continue };
                    if matches!(lost, PositionLost::BeyondEnd { .. }) && outbox_core::compare::served_past_reported_end(r, &served) {
                        under_reported.push(r.offset);
                        continue;
                    }
                    // Another event's message there, which that event's
                    // receipt recorded in an earlier position epoch: the log
                    // was not replaced, this receipt never matched it
                    // (`outbox_core::compare::never_matched`).
                    let lost = if matches!(lost, PositionLost::HoldsOther { holder: Some(_), .. }) {
                        let epochs = self.store.receipt_epochs_at(&cluster, &topic, partition, r.offset).await?;
                        outbox_core::compare::never_matched(&lost, r, &epochs).unwrap_or(lost)
                    } else {
                        lost
                    };
                    let offset = r.offset;
                    let detail = match lost {
                        PositionLost::HoldsOther { holder, topic_id } => {
                            let of_id = r.topic_id.as_deref().map(|id| format!(" (topic id {id})")).unwrap_or_default();
                            let there = match (holder, topic_id) {
                                (None, _) => "a message without an eventId".to_owned(),
                                (Some(e), None) => format!("event {e}'s message"),
                                (Some(e), Some(id)) => format!("event {e}'s message of topic id {id}"),
                            };
                            format!("its receipt's position {cluster}/{topic}{of_id}/{partition}@{offset} now holds {there}: the log it was recorded in is gone (topic recreated, cluster replaced)")
                        }
                        PositionLost::BeyondEnd { end } => format!(
                            "its receipt's position {cluster}/{topic}/{partition}@{offset} is beyond the log's end {end}: the log it was recorded in is gone (broker replaced, topic recreated)"
                        ),
                        PositionLost::NeverMatched { holder, holder_epoch, epoch } => {
                            let of_id = r.topic_id.as_deref().map(|id| format!(" (topic id {id})")).unwrap_or_default();
                            format!(
                                "its receipt's position {cluster}/{topic}{of_id}/{partition}@{offset} (position epoch {epoch}) holds event {holder}'s message, which that event's receipt recorded there in epoch {holder_epoch}: the log was not replaced since, so this receipt never matched the log: a forged or corrupted receipt row (written without the broker's acknowledgement), not a lost log, unless the log was restored from an older copy. Its event's message may never have been written: find what wrote the row (database audit logs) and look the event up (`outbox trace`)"
                            )
                        }
                    };
                    write.findings.push(ScanFinding { kind: outbox_core::compare::RECEIPT_POSITION_LOST, event_id: r.event_id.clone(), detail, offset: None, attempt_id: None });
                }
                // Receipts beyond the reported end whose events the broker
                // still serves at their offsets: no finding; said once per
                // partition per round, in the log and the scan's report.
                if let (Some(end), Some(low), Some(high)) = (scan.log_end, under_reported.iter().min(), under_reported.iter().max()) {
                    let note = format!(
                        "{cluster}/{topic}/{partition} reports its end at {end}, yet serves the events of {} receipts at offsets {low}..={high} there: the broker under-reports its end (tansu 0.6 after a multi-record produce batch), the log is not lost; no receipt_position_lost. Have dispatchers send one record per batch (`batch.num.messages=1`) to such a broker (docs/OPERATIONS.md, `receipt_position_lost`)",
                        under_reported.len()
                    );
                    tracing::warn!(%topic, partition, log_end = end, receipts = under_reported.len(), from_offset = low, to_offset = high, "{note}");
                    report.notes.push(note);
                }
                if write.cursor == CursorMove::Restart {
                    tracing::error!(%topic, partition, cursor, log_end = ?scan.log_end, "the partition's log ends below the bypass scan's cursor: the log was replaced; reading the new one from its start");
                }
                // A page that found nothing and moves nothing writes nothing.
                let idle = write.findings.is_empty() && write.bypass_messages.is_empty() && write.cursor == CursorMove::Advance(cursor);
                if !idle {
                    self.store.record_bypass_scan(&write).await?;
                }
                report.findings.extend(write.findings.into_iter().map(|f| (f.kind, f.event_id)));
            }
        }
        Ok(report)
    }

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

/// The comparison's condition findings, over any store with their seam.
impl<B: Broker + 'static, S: ServiceStore + FindingsStore> Reconciler<B, S> {
    /// Reads the candidates of the comparison's condition findings through
    /// [`FindingsStore`] (each read bounded by `max_findings_per_kind`) and
    /// decides each with `outbox_core::findings`: `aged_pending`,
    /// `unknown_past_slo`, `quarantined`, `unconsumed_published` (per
    /// critical consumer, against its watermarks of the event's very log),
    /// `published_without_receipt` (the sweep's next page) and
    /// `stale_watermark`; then records them, resolving the open findings
    /// that no longer hold ([`FindingsStore::record_round_findings`]). Counts
    /// them; the bypass scan is not part of it.
    pub async fn compare_findings(&self) -> Result<CompareReport, ProducerError> {
        self.compare_findings_at(self.store.now_ms()).await
    }

    async fn compare_findings_at(&self, now: i64) -> Result<CompareReport, ProducerError> {
        use outbox_core::findings as f;
        let c = &self.config;
        let limit = c.max_findings_per_kind;
        let mut found: Vec<RoundFinding> = Vec::new();
        let mut push = |kind: &'static str, event_id: String, consumer_id: String, age_ms: i64, detail: String| found.push(RoundFinding { kind, event_id, consumer_id, age_ms, detail });

        for e in self.store.aged_candidates(now.saturating_sub(c.aged_pending_ms), limit).await? {
            if let Some(age) = f::aged_pending(e.state, e.held_by_dispatcher, e.by_outbox, e.created_at_ms, now, c.aged_pending_ms) {
                push(f::AGED_PENDING, e.event_id, String::new(), age, "not delivered past the threshold (PENDING or being sent): is a dispatcher running for its cluster, does the broker take its sends?".into());
            }
        }
        for e in self.store.unknown_candidates(now.saturating_sub(c.unknown_slo_ms), limit).await? {
            if let Some(age) = f::unknown_past_slo(e.state, e.unknown_since_ms, now, c.unknown_slo_ms) {
                push(f::UNKNOWN_PAST_SLO, e.event_id, String::new(), age, format!("dispatch outcome unknown past the SLO (now {})", e.state.as_str()));
            }
        }
        for e in self.store.quarantined_candidates(limit).await? {
            if let Some(age) = f::quarantined(e.state, e.state_since_ms, now) {
                push(f::QUARANTINED, e.event_id, String::new(), age, format!("quarantined: {}", e.quarantine_reason));
            }
        }
        for (consumer_id, topics) in self.store.critical_consumers().await? {
            let watermarks = self.store.consumer_watermarks(&consumer_id, &topics).await?;
            let refs: Vec<outbox_core::WatermarkRef<'_>> = watermarks.iter().map(|w| w.watermark_ref()).collect();
            for p in self.store.published_candidates(&consumer_id, &topics, now.saturating_sub(c.unconsumed_after_ms), limit).await? {
                let at = p.position();
                let Some(age) = f::unconsumed_published(p.state, p.published_at_ms, now, c.unconsumed_after_ms, &at, &consumer_id, &topics, &refs) else { continue };
                let of_id = p.topic_id.as_deref().map(|id| format!(" (topic id {id})")).unwrap_or_default();
                let detail = format!("published at {}{of_id}/{}@{}, not passed by the consumer's watermark of that log", p.topic, p.partition, p.offset);
                push(f::UNCONSUMED_PUBLISHED, p.event_id, consumer_id.clone(), age, detail);
            }
        }
        for e in self.store.receipt_sweep_page(c.published_check_batch).await? {
            if f::published_without_receipt(e.state, e.has_primary_receipt) {
                push(f::PUBLISHED_WITHOUT_RECEIPT, e.event_id, String::new(), now - e.state_since_ms, format!("{} without a primary receipt", e.state.as_str()));
            }
        }
        for p in self.store.watermark_publishers(now.saturating_sub(c.stale_watermark_after_ms), limit).await? {
            if let Some(age) = f::stale_watermark(p.records_accepted, p.last_received_ms, now, c.stale_watermark_after_ms) {
                let detail = format!(
                    "no watermark record from this consumer on cluster {} for {age} ms (threshold {} ms); its watermark stays where it was",
                    p.cluster_id, c.stale_watermark_after_ms
                );
                push(f::STALE_WATERMARK, p.cluster_id, p.consumer_id, age, detail);
            }
        }

        let mut report = CompareReport::default();
        for r in &found {
            match r.kind {
                f::AGED_PENDING => report.aged_pending += 1,
                f::UNKNOWN_PAST_SLO => report.unknown_past_slo += 1,
                f::QUARANTINED => report.quarantined += 1,
                f::UNCONSUMED_PUBLISHED => report.unconsumed_published += 1,
                f::PUBLISHED_WITHOUT_RECEIPT => report.published_without_receipt += 1,
                _ => report.stale_watermark += 1,
            }
        }
        self.store.record_round_findings(now, &found).await?;
        Ok(report)
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

/// Told of each round of a running reconciler as it ends
/// ([`Reconciler::run_observed`]): its number (from 0), what it did or why it
/// failed, and how long it took. Observing never changes what a round does.
#[async_trait::async_trait]
pub trait RoundObserver: Send + Sync {
    /// Round `round` ended.
    async fn round_done(&self, round: u64, result: Result<&(ResolveReport, CompareReport), &ProducerError>, took: std::time::Duration);
}

/// No observer.
#[async_trait::async_trait]
impl RoundObserver for () {
    async fn round_done(&self, _round: u64, _result: Result<&(ResolveReport, CompareReport), &ProducerError>, _took: std::time::Duration) {}
}

/// One reconciler round, as `outbox status` and the report show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundRecord<'a> {
    /// The reconciler.
    pub owner: &'a str,
    /// Its broker's cluster.
    pub cluster_id: &'a str,
    /// When the round ended, ms.
    pub at_ms: i64,
    /// The configured interval, ms.
    pub interval_ms: i64,
    /// The UNKNOWN SLO it judged with, ms.
    pub unknown_slo_ms: i64,
    /// UNKNOWN events it examined.
    pub examined: i32,
    /// Findings it saw.
    pub open_findings: i32,
}

/// What a reconciler round records besides its findings: a snapshot of the
/// state counts (the history `outbox status` draws) and the round itself
/// (when each reconciler last ran). Records, not decisions.
#[async_trait::async_trait]
pub trait RoundStore: Send + Sync {
    /// Snapshots the event counts per state at `now_ms`, dropping snapshots older than `keep_ms`.
    async fn record_state_snapshot(&self, now_ms: i64, keep_ms: i64) -> Result<(), ProducerError>;
    /// Records a finished round.
    async fn record_round(&self, round: &RoundRecord<'_>) -> Result<(), ProducerError>;
}

#[async_trait::async_trait]
impl RoundStore for PgStore {
    async fn record_state_snapshot(&self, now_ms: i64, keep_ms: i64) -> Result<(), ProducerError> {
        let mut tx = self.pool().begin().await?;
        sqlx::query("INSERT INTO outbox_state_snapshots (at_ms, state, count) SELECT $1, state, count(*) FROM outbox_events GROUP BY state ON CONFLICT DO NOTHING")
            .bind(now_ms)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM outbox_state_snapshots WHERE at_ms < $1").bind(now_ms - keep_ms).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn record_round(&self, r: &RoundRecord<'_>) -> Result<(), ProducerError> {
        sqlx::query(
            "INSERT INTO outbox_reconciler_rounds (owner, cluster_id, last_round_at_ms, interval_ms, unknown_slo_ms, examined, open_findings, rounds)
             VALUES ($1, $2, $3, $4, $5, $6, $7, 1)
             ON CONFLICT (owner) DO UPDATE SET cluster_id = EXCLUDED.cluster_id, last_round_at_ms = EXCLUDED.last_round_at_ms,
                 interval_ms = EXCLUDED.interval_ms, unknown_slo_ms = EXCLUDED.unknown_slo_ms, examined = EXCLUDED.examined,
                 open_findings = EXCLUDED.open_findings, rounds = outbox_reconciler_rounds.rounds + 1",
        )
        .bind(r.owner)
        .bind(r.cluster_id)
        .bind(r.at_ms)
        .bind(r.interval_ms)
        .bind(r.unknown_slo_ms)
        .bind(r.examined)
        .bind(r.open_findings)
        .execute(self.pool())
        .await?;
        Ok(())
    }
}

/// The in-memory store keeps no history of states or rounds.
#[async_trait::async_trait]
impl RoundStore for outbox_memory::MemoryStore {
    async fn record_state_snapshot(&self, _now_ms: i64, _keep_ms: i64) -> Result<(), ProducerError> {
        Ok(())
    }

    async fn record_round(&self, _round: &RoundRecord<'_>) -> Result<(), ProducerError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bypass scan's figures reach the round's report: what it read, what
    /// it handed to the receipt transaction, its findings about messages.
    #[test]
    fn a_scan_counts_into_the_rounds_report() {
        let scan = BypassScanReport { scanned: 7, submitted: 2, findings: vec![(outbox_core::compare::UNRECORDED_COPY, "evt-a".into()), (outbox_core::compare::SCAN_GAP, "t/0@1..3".into())], notes: Vec::new() };
        let mut report = CompareReport::default();
        scan.count_into(&mut report);
        scan.count_into(&mut report);
        assert_eq!((report.scanned_messages, report.bypass_submitted, report.unrecorded_copy), (14, 4, 2));
    }
}
