//! Step 2, [`Dispatcher::settle`]: wait for a batch's answers (renewing its
//! leases meanwhile), then record each: ACKs through the receipt
//! transaction, the rest as not sent or unknown.

use outbox_core::Clock as _;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::time::Duration;
// tokio's clock: the simulator runs these services in virtual time.
use tokio::time::Instant;

use futures::stream::{FuturesUnordered, StreamExt};
use outbox_core::{Broker, BrokerReceipt, FenceOutcome, ReceiptDecision, SendOutcome, StoreError};

use super::metrics::inc;
use super::retry::RECORD_RETRY_MAX_WAIT;
use super::{BatchReport, ClaimCursor, Dispatcher, InFlightBatch};
use crate::error::ProducerError;
use crate::service_store::ServiceStore;

impl<B: Broker + 'static, S: ServiceStore> Dispatcher<B, S> {
    /// Step 2: wait for every answer of the batch and record it.
    pub async fn settle(&self, batch: InFlightBatch) -> Result<BatchReport, ProducerError> {
        self.settle_into(batch, &mut ClaimCursor::default()).await
    }

    /// [`Dispatcher::settle`], noting in `cursor` the events it published.
    pub(super) async fn settle_into(&self, batch: InFlightBatch, cursor: &mut ClaimCursor) -> Result<BatchReport, ProducerError> {
        let InFlightBatch { owner, started, mut report, sends } = batch;
        let renew_every = Duration::from_millis((self.config.lease_ms / 2).max(1) as u64);
        let mut tokens: Vec<Option<outbox_core::ClaimToken>> = sends.iter().map(|(ev, ..)| Some(ev.token.clone())).collect();
        // Each send's lease as last granted or renewed (store clock, ms);
        // i64::MIN once a renewal found the claim gone.
        let mut lease_until: Vec<i64> = sends.iter().map(|(ev, ..)| ev.token.lease_until_ms).collect();
        // Whether each answer arrived after its lease ran out.
        let mut late: Vec<bool> = vec![false; sends.len()];
        let mut pending: FuturesUnordered<_> = sends
            .into_iter()
            .enumerate()
            .map(|(i, (ev, attempt, handle))| async move {
                let (outcome, log_id) = handle.await.unwrap_or_else(|e| (SendOutcome::Unknown(format!("send task failed: {e}")), None));
                (i, ev, attempt, outcome, log_id)
            })
            .collect();
        let mut results = Vec::with_capacity(pending.len());
        let mut next_renewal = tokio::time::Instant::now() + renew_every;
        loop {
            tokio::select! {
                biased;
                next = pending.next() => match next {
                    Some(r) => {
                        tokens[r.0] = None;
                        late[r.0] = lease_until[r.0] < self.store.now_ms();
                        results.push(r);
                    }
                    None => break,
                },
                _ = tokio::time::sleep_until(next_renewal) => {
                    // A long batch keeps its claims alive while answers are outstanding.
                    let (which, outstanding): (Vec<usize>, Vec<_>) = tokens.iter().enumerate().filter_map(|(i, t)| t.clone().map(|t| (i, t))).unzip();
                    match self.store.renew_leases(&outstanding, self.config.lease_ms).await {
                        Ok(renewed) => {
                            self.metrics.last_progress_ms.store(outbox_core::SystemClock.now_ms(), AtomicOrdering::Relaxed);
                            for (&i, r) in which.iter().zip(&renewed) {
                                lease_until[i] = r.unwrap_or(i64::MIN);
                            }
                            let lost = renewed.iter().filter(|r| r.is_none()).count();
                            if lost > 0 {
                                tracing::warn!(owner = %owner, lost, "claims lost while sends were outstanding; their answers still go through acceptDispatchReceipt");
                            }
                            next_renewal = tokio::time::Instant::now() + renew_every;
                        }
                        // The sends are out: their answers must still be
                        // recorded, whatever becomes of the leases. A lease
                        // that runs out turns its event DISPATCH_UNKNOWN
                        // (the sweeper), and an ACK of this batch still
                        // publishes it through acceptDispatchReceipt.
                        Err(e) => {
                            inc(&self.metrics.store_retries, 1);
                            tracing::warn!(owner = %owner, error = %e, "lease renewal failed while sends were outstanding; trying again soon");
                            // An eighth of the lease, at most 2 s.
                            next_renewal = tokio::time::Instant::now() + (renew_every / 4).min(RECORD_RETRY_MAX_WAIT);
                        }
                    }
                }
            }
        }

        let cluster_id = self.broker.cluster_id().to_owned();
        let mut receipts: Vec<BrokerReceipt> = Vec::new();
        let mut receipt_types: Vec<&str> = Vec::new();
        let mut reports = Vec::new();
        for (i, ev, attempt, outcome, log_id) in &results {
            match outcome {
                SendOutcome::Acked { partition, offset } => {
                    if late[*i] {
                        inc(&self.metrics.late_acks, 1);
                        tracing::info!(event_id = %ev.envelope.event_id, attempt_id = %attempt.attempt_id, "ACK after the claim's lease ran out: recorded like any other");
                        if outbox_core::simulation::mutation_active("late-acks-dropped") {
                            continue;
                        }
                    }
                    receipt_types.push(ev.envelope.event_type.as_str());
                    receipts.push(BrokerReceipt {
                    event_id: ev.envelope.event_id.clone(),
                    envelope_generation: ev.envelope.envelope_generation,
                    attempt_id: attempt.attempt_id.clone(),
                    // The bytes sent were checked against this digest before the send.
                    payload_digest: ev.envelope.payload_digest.clone(),
                    destination_digest: ev.destination_digest.clone(),
                    cluster_id: cluster_id.clone(),
                    topic: ev.destination.topic.clone(),
                    // The log position's identity is the topic id the frozen
                    // destination names (the adapter refused the send if the
                    // topic now has another).
                    topic_id: ev.destination.topic_id.clone(),
                    partition: *partition,
                    offset: *offset,
                    // The key the message was sent under (`outgoing_message`).
                    key: Some(ev.destination.routing_key.as_bytes().to_vec()),
                    // The log's identity as the client knew it before the write.
                    log_id: log_id.clone(),
                    });
                }
                SendOutcome::NotPersisted(why) => reports.push((ev, attempt, false, why)),
                SendOutcome::Unknown(why) => reports.push((ev, attempt, true, why)),
            }
        }

        // Every answer is recorded even when another one fails: the first
        // failure is returned after the rest were tried.
        let mut failed: Option<StoreError> = None;
        cursor.published.clear();
        let receipts_at = Instant::now();
        let accepted = self.through_db_errors("accept_dispatch_receipts", || self.store.accept_dispatch_receipts(&receipts)).await;
        if !receipts.is_empty() {
            self.metrics.histograms.receipt_transaction.observe(receipts_at.elapsed().as_secs_f64());
        }
        let published_at_ms = outbox_core::SystemClock.now_ms();
        match accepted {
            Ok(outcomes) => {
                for ((outcome, receipt), event_type) in outcomes.into_iter().zip(&receipts).zip(&receipt_types) {
                    match outcome.decision {
                        ReceiptDecision::Accept { .. } => {
                            self.metrics.histograms.published(&receipt.topic, event_type, published_at_ms - receipt.event_id.unix_ms() as i64);
                            cursor.published.push(receipt.event_id.clone());
                            report.published += 1;
                            inc(&self.metrics.published, 1);
                        }
                        ReceiptDecision::AlreadyAccepted | ReceiptDecision::Duplicate => {
                            report.duplicates += 1;
                            inc(&self.metrics.duplicates, 1);
                        }
                        ReceiptDecision::Quarantine { .. } => {
                            report.quarantined += 1;
                            inc(&self.metrics.quarantined, 1);
                        }
                        ReceiptDecision::Reject { reason } => tracing::error!(?reason, "own receipt rejected by acceptDispatchReceipt"),
                    }
                }
            }
            Err(e) => {
                tracing::error!(owner = %owner, receipts = receipts.len(), error = %e,
                    "receipts not recorded; their events wait for their leases to expire (DISPATCH_UNKNOWN) and the reconciler");
                failed = Some(e);
            }
        }
        for (ev, attempt, unknown, why) in reports {
            let recorded = if unknown {
                tracing::warn!(event_id = %ev.envelope.event_id, attempt_id = %attempt.attempt_id, reason = %why, "dispatch outcome unknown");
                self.through_db_errors("report_unknown", || self.store.report_unknown(&ev.token, &attempt.attempt_id, why)).await
            } else {
                self.through_db_errors("report_not_sent", || self.store.report_not_sent(&ev.token, &attempt.attempt_id, why)).await
            };
            match recorded {
                Ok(outcome) if unknown => self.tally(outcome, &mut report, |r| &mut r.unknown, &self.metrics.unknown),
                Ok(outcome) => self.tally(outcome, &mut report, |r| &mut r.not_sent, &self.metrics.not_sent),
                Err(e) => {
                    tracing::error!(event_id = %ev.envelope.event_id, error = %e, "outcome not recorded; the event waits for its lease to expire");
                    failed.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failed {
            return Err(e.into());
        }
        let ms = started.elapsed().as_millis() as u64;
        inc(&self.metrics.batches, 1);
        inc(&self.metrics.batch_ms_total, ms);
        self.metrics.batch_ms_max.fetch_max(ms, AtomicOrdering::Relaxed);
        self.metrics.histograms.batch.observe(started.elapsed().as_secs_f64());
        if report.claimed > 0 {
            tracing::debug!(owner = %owner, ?report, batch_ms = ms, "batch settled");
        }
        Ok(report)
    }

    /// Counts one fenced report: under `applied` when it changed the row, as
    /// fenced when the claim had gone stale, not at all for a no-op.
    fn tally(&self, outcome: FenceOutcome, report: &mut BatchReport, applied: impl FnOnce(&mut BatchReport) -> &mut usize, metric: &AtomicU64) {
        match outcome {
            FenceOutcome::Applied => {
                *applied(report) += 1;
                inc(metric, 1);
            }
            FenceOutcome::Fenced => {
                report.fenced += 1;
                inc(&self.metrics.fenced, 1);
            }
            FenceOutcome::NoOp => {}
        }
    }
}
