//! Resolving the unknown (PROTOCOL §6): the due DISPATCH_UNKNOWN events, each looked up and decided by `decide_reconcile`.

use super::*;

impl<B: Broker + 'static, S: ServiceStore> Reconciler<B, S> {
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
        // Routes whose poison policy is skip: their QUARANTINED events
        // (quarantined now or before) close SKIPPED, with the evidence an
        // operator's skip keeps. A failure is logged; the next round tries again.
        match self.store.release_poisoned(self.config.batch_size).await {
            Ok(skipped) => report.poison_skipped = skipped.len(),
            Err(e) => tracing::warn!(error = %e, "could not release the events of routes whose poison policy is skip; the next round tries again"),
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
}
