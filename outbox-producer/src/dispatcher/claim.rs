//! Step 1, [`Dispatcher::claim_and_send`]: claim a batch, verify each event
//! against its digests, register the attempts, start the sends (each only
//! while its claim's lease lasts).

use outbox_core::Clock as _;
use std::collections::HashMap;
use std::sync::atomic::Ordering as AtomicOrdering;
use std::sync::Arc;
use std::time::Duration;
// tokio's clock: the simulator runs these services in virtual time.
use tokio::time::Instant;

use outbox_core::{AttemptRecord, Broker, ClaimToken, ClaimedEvent, EventId, FenceOutcome, OutgoingMessage, SendOutcome, StoreError};
use tracing::Instrument;

use super::metrics::inc;
use super::retry::is_retryable_backend;
use super::{outgoing_message_signed, BatchReport, ClaimCursor, Dispatcher, InFlightBatch};
#[cfg(doc)]
use super::DispatcherConfig;
use crate::error::ProducerError;
use crate::service_store::ServiceStore;

/// Hands `message` to the broker client only while `deadline` (the claim's
/// lease, measured locally) has not passed; past it, the message is not
/// sent at all: a stalled worker whose lease ran out (its registration's
/// answer came late, the process was paused) never sends, so an absence
/// proof made after the lease plus the in-flight bound holds.
async fn send_before<B: Broker + ?Sized>(broker: Arc<B>, message: OutgoingMessage, deadline: Instant) -> SendOutcome {
    let now = Instant::now();
    if now >= deadline && !outbox_core::simulation::mutation_active("send-after-lease") {
        tracing::warn!(late_ms = now.duration_since(deadline).as_millis() as u64, "lease ran out before the send: not sent");
        return SendOutcome::NotPersisted("the claim's lease ran out before the message was handed to the client".into());
    }
    broker.send(message).await
}

impl<B: Broker + 'static, S: ServiceStore> Dispatcher<B, S> {
    /// Step 1: claim a batch as `owner`, verify, register attempts and start
    /// the sends. Claims nothing while [`Dispatcher::alias_active`] is false.
    pub async fn claim_and_send(&self, owner: &str) -> Result<InFlightBatch, ProducerError> {
        self.claim_and_send_from(owner, &mut ClaimCursor::default()).await
    }

    pub(super) async fn claim_and_send_from(&self, owner: &str, cursor: &mut ClaimCursor) -> Result<InFlightBatch, ProducerError> {
        let mut report = BatchReport::default();
        let started = Instant::now();
        if !self.alias_active().await? || !self.gate_open() {
            self.metrics.last_progress_ms.store(outbox_core::SystemClock.now_ms(), AtomicOrdering::Relaxed);
            return Ok(InFlightBatch { owner: owner.to_owned(), started, report, sends: Vec::new() });
        }
        let (claimed, unreadable) = self.claim(owner, cursor).await?;
        self.metrics.last_progress_ms.store(outbox_core::SystemClock.now_ms(), AtomicOrdering::Relaxed);
        report.claimed = claimed.len() + unreadable;
        report.quarantined += unreadable;
        inc(&self.metrics.quarantined, unreadable as u64);
        inc(&self.metrics.claimed, claimed.len() as u64);

        // Never send bytes or a destination that no longer match what was frozen.
        let mut verified = Vec::with_capacity(claimed.len());
        for ev in claimed {
            if let Err(evidence) = ev.verify_before_send() {
                tracing::error!(event_id = %ev.envelope.event_id, %evidence, "stored event no longer matches its digests: quarantined, not sent");
                if self.store.quarantine_claimed(&ev.token, "stored_payload_or_destination_diverged", evidence).await? == FenceOutcome::Applied {
                    report.quarantined += 1;
                    inc(&self.metrics.quarantined, 1);
                }
                continue;
            }
            verified.push(ev);
        }

        let tokens: Vec<_> = verified.iter().map(|e| e.token.clone()).collect();
        let registered = match self.store.register_attempts(&tokens).await {
            Ok(r) => r,
            Err(e) => match self.registered_after_all(&tokens, &e).await {
                Some(r) => r,
                None => {
                    // Nothing was sent: give the claims back rather than leave
                    // them to their leases (best effort; the sweeper is the backstop).
                    for t in &tokens {
                        if let Err(re) = self.store.release(t).await {
                            tracing::debug!(event_id = %t.event_id, error = %re, "release after a failed registration");
                        }
                    }
                    return Err(e.into());
                }
            },
        };
        // A local, monotonic deadline per claim for handing its message to
        // the client: what is left of its lease by the store's clock (the
        // clock that computed the lease end), from now on. A registration
        // whose answer came late leaves little or nothing.
        let (now_ms, now) = (self.store.now_ms(), Instant::now());
        let mut sends = Vec::with_capacity(verified.len());
        // Each partition's log identity, read once per batch before any of
        // its sends starts (the read precedes each write, so a receipt
        // never names a log newer than the one written; the receipt
        // records it).
        let mut log_ids: Vec<(String, i32, Option<String>)> = Vec::new();
        for (ev, reg) in verified.into_iter().zip(registered) {
            match reg {
                Ok(attempt) => {
                    let (topic, partition) = (&ev.destination.topic, ev.destination.partition);
                    let log_id = match log_ids.iter().find(|(t, p, _)| t == topic && *p == partition) {
                        Some((_, _, id)) => id.clone(),
                        None => {
                            let id = self.broker.log_id(topic, partition);
                            log_ids.push((topic.clone(), partition, id.clone()));
                            id
                        }
                    };
                    let send_deadline = now + Duration::from_millis(ev.token.lease_until_ms.saturating_sub(now_ms).max(0) as u64);
                    let message = outgoing_message_signed(&ev, &attempt, self.signer.as_ref());
                    let broker = self.broker.clone();
                    let span = tracing::info_span!("outbox_send", event_id = %ev.envelope.event_id, attempt_id = %attempt.attempt_id,
                        topic = %ev.destination.topic, partition = ev.destination.partition);
                    // The send belongs to the trace that emitted the event.
                    crate::otel::follow_traceparent(&span, ev.traceparent.as_deref(), ev.tracestate.as_deref());
                    let metrics = self.metrics.clone();
                    let (topic, event_type) = (ev.destination.topic.clone(), ev.envelope.event_type.clone());
                    let handle = tokio::spawn(
                        async move {
                            let at = Instant::now();
                            let outcome = send_before(broker, message, send_deadline).await;
                            metrics.histograms.sent(&topic, &event_type, at.elapsed());
                            (outcome, log_id)
                        }
                        .instrument(span),
                    );
                    sends.push((ev, attempt, handle));
                }
                Err(e) if e.is_fenced() => {
                    report.fenced += 1;
                    inc(&self.metrics.fenced, 1);
                    tracing::info!(event_id = %ev.envelope.event_id, "claim lost before sending: not sent");
                }
                // Sends of this batch may have started: their answers must
                // still be settled, so an unexpected refusal only skips
                // its own event (its claim runs out with its lease).
                Err(e) => tracing::error!(event_id = %ev.envelope.event_id, error = %e, "attempt not registered: not sent"),
            }
        }
        report.sent = sends.len();
        inc(&self.metrics.sent, sends.len() as u64);
        Ok(InFlightBatch { owner: owner.to_owned(), started, report, sends })
    }

    /// After the registration of `tokens` failed with `error`: where the
    /// connection broke, the commit may have gone through before its answer
    /// was lost. One transaction registers the whole batch, so either every
    /// attempt it could make is there (`Some`: those are sent; the other
    /// tokens were refused by it) or none is (`None`: nothing was registered).
    async fn registered_after_all(&self, tokens: &[ClaimToken], error: &StoreError) -> Option<Vec<Result<AttemptRecord, StoreError>>> {
        if !is_retryable_backend(error) {
            return None;
        }
        let found = match self.through_db_errors("registered_attempts", || self.store.registered_attempts(tokens)).await {
            Ok(found) if !found.is_empty() => found,
            Ok(_) => return None,
            Err(e) => {
                tracing::warn!(error = %e, "could not learn whether a failed registration committed; its claims run out with their leases");
                return None;
            }
        };
        tracing::warn!(registered = found.len(), error = %error, "registration committed although its answer was lost; sending its attempts");
        let mut by_event: HashMap<EventId, AttemptRecord> = found.into_iter().map(|a| (a.event_id.clone(), a)).collect();
        Some(
            tokens
                .iter()
                .map(|t| {
                    by_event.remove(&t.event_id).ok_or_else(|| StoreError::Backend {
                        message: format!("the registration that committed refused {}", t.event_id),
                        retryable: false,
                    })
                })
                .collect(),
        )
    }

    /// Claims up to a batch, in one transaction: retries first, then the
    /// successors of what the cursor's last batch published, then (on a full
    /// claim, see [`DispatcherConfig::head_scan_every`]) every key's head. One claim at a time
    /// per instance on the chains path: two claims running together would
    /// scan the same key heads, and each would keep the rows the other had
    /// just claimed locked until it commits, stalling their registration.
    /// On the stream path ([`ServiceStore::claims_may_overlap`]) two: each
    /// locks the key buckets it cuts and skips those the other holds, so a
    /// claim no longer waits for the other's round trips.
    async fn claim(&self, owner: &str, cursor: &mut ClaimCursor) -> Result<(Vec<ClaimedEvent>, usize), ProducerError> {
        let (batch, lease) = (self.config.batch_size, self.config.lease_ms);
        let after = std::mem::take(&mut cursor.published);
        let scan_due = after.is_empty() || cursor.since_scan.saturating_add(1) >= self.config.head_scan_every;
        let permits = if self.store.claims_may_overlap() { 1 } else { super::CLAIM_PERMITS };
        let _turn = self.claim_turn.acquire_many(permits).await.map_err(|e| ProducerError::Config(format!("the claim turn is closed: {e}")))?;
        let at = Instant::now();
        let round = self.store.claim_next(owner, &after, scan_due, batch, lease).await?;
        self.metrics.histograms.claim.observe(at.elapsed().as_secs_f64());
        if round.successor_claim {
            inc(&self.metrics.successor_claims, 1);
        }
        if round.head_scan {
            inc(&self.metrics.head_scans, 1);
            cursor.since_scan = 0;
        } else {
            cursor.since_scan = cursor.since_scan.saturating_add(1);
        }
        Ok((round.claimed, round.quarantined))
    }
}
