//! What the scenarios share: the per-scenario context over the harness
//! (claiming, reconciling and reading back one event among foreign ones),
//! the verdict helpers, the genuine receipt of an attempt, and the blocks
//! of log offsets that keep scenarios apart.

use outbox_core::canonical::sha256_digest;
use outbox_core::claim::ClaimToken;
use outbox_core::envelope::EmitRequest;
use outbox_core::error::CoreError;
use outbox_core::id::EventId;
use outbox_core::receipt::{AttemptRecord, BrokerReceipt, ReceiptDecision};
use outbox_core::reconcile::{RecheckReason, ReconcileDecision};
use outbox_core::state::EventState;
use outbox_core::store::{ClaimedEvent, OutboxStore, ReconcileTask};

use super::{Harness, Verdict, LEASE_MS};

/// One scenario's view of the harness: its own command keys and
/// aggregate ids (under `prefix`) and its own block of log offsets.
pub(super) struct Ctx<'a, H> {
    pub(super) h: &'a H,
    pub(super) prefix: String,
    pub(super) offsets: i64,
}

pub(super) fn ensure(cond: bool, what: impl FnOnce() -> String) -> Verdict {
    if cond {
        Ok(())
    } else {
        Err(what())
    }
}

pub(super) fn eq<T: PartialEq + std::fmt::Debug>(what: &str, got: T, want: T) -> Verdict {
    ensure(got == want, || format!("{what}: got {got:?}, want {want:?}"))
}

pub(super) fn err<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> String {
    move |e| format!("{what}: {e}")
}

impl<H: Harness> Ctx<'_, H> {
    /// Log offset `n` of this scenario.
    pub(super) fn offset(&self, n: i64) -> i64 {
        self.offsets + n
    }

    pub(super) fn s(&self) -> &H::Store {
        self.h.store()
    }

    pub(super) async fn command(&self, command_key: &str, aggregate_id: &str, aggregate_version: i64, event_type: &str, payload: &[u8]) -> Result<EventId, CoreError> {
        let request = EmitRequest {
            command_key,
            tenant: "conformance",
            aggregate_type: "order",
            aggregate_id,
            aggregate_version,
            event_type,
            payload_schema: "order-v1",
            payload,
        };
        self.h.emit_command(&request).await
    }

    pub(super) async fn emit(&self, n: u32, aggregate: &str) -> EventId {
        let key = format!("{}-cmd{n}", self.prefix);
        let agg = format!("{}-{aggregate}", self.prefix);
        self.h.emit(&key, &agg, format!("{{\"scenario\":\"{}\",\"n\":{n}}}", self.prefix).as_bytes()).await
    }

    /// [`Ctx::emit`] of an event of [`super::REPLACED_EVENT_TYPE`], routed to
    /// [`super::REPLACED_TOPIC`].
    pub(super) async fn emit_on_replaced_topic(&self, n: u32, aggregate: &str) -> Result<EventId, String> {
        let key = format!("{}-cmd{n}", self.prefix);
        let agg = format!("{}-{aggregate}", self.prefix);
        let payload = format!("{{\"scenario\":\"{}\",\"n\":{n}}}", self.prefix);
        self.command(&key, &agg, 1, super::REPLACED_EVENT_TYPE, payload.as_bytes()).await.map_err(err("emit on the replaced topic"))
    }

    /// Claims until `id` is among the claimed events; every other event
    /// claimed on the way is released afterwards. `Ok(None)` when `id` is not claimable.
    ///
    /// Two passes, the foreign claims of the first released before the
    /// second: on the stream a claim held here holds its key bucket's batch
    /// open, and a later event of another key of the bucket (another
    /// scenario's, or `id`) is cut only once that batch is settled.
    pub(super) async fn claim(&self, owner: &str, id: &EventId) -> Result<Option<ClaimedEvent>, String> {
        let mut found = None;
        for _pass in 0..2 {
            let mut foreign = Vec::new();
            for _ in 0..64 {
                let batch = self.s().claim_batch(owner, 16, LEASE_MS).await.map_err(err("claim_batch"))?;
                if batch.is_empty() {
                    break;
                }
                for ce in batch {
                    if &ce.token.event_id == id {
                        found = Some(ce);
                    } else {
                        foreign.push(ce.token);
                    }
                }
                if found.is_some() {
                    break;
                }
            }
            for token in &foreign {
                self.s().release(token).await.map_err(err("release of a foreign claim"))?;
            }
            if found.is_some() {
                break;
            }
        }
        Ok(found)
    }

    pub(super) async fn claim_some(&self, owner: &str, id: &EventId) -> Result<ClaimedEvent, String> {
        self.claim(owner, id).await?.ok_or_else(|| format!("{id} was not claimable"))
    }

    /// Takes over `id`'s retry claim; foreign retry claims are left to expire.
    pub(super) async fn claim_retry(&self, owner: &str, id: &EventId) -> Result<ClaimedEvent, String> {
        for _ in 0..64 {
            let batch = self.s().claim_retries(owner, 16, LEASE_MS).await.map_err(err("claim_retries"))?;
            if batch.is_empty() {
                break;
            }
            if let Some(ce) = batch.into_iter().find(|ce| &ce.token.event_id == id) {
                return Ok(ce);
            }
        }
        Err(format!("{id}'s retry claim was not offered"))
    }

    /// Begins reconciling `id`; other due events are put back with a recheck far ahead.
    pub(super) async fn reconcile(&self, owner: &str, id: &EventId) -> Result<ReconcileTask, String> {
        let mut found = None;
        for _ in 0..64 {
            let tasks = self.s().begin_reconcile(owner, 16, LEASE_MS).await.map_err(err("begin_reconcile"))?;
            if tasks.is_empty() {
                break;
            }
            for t in tasks {
                if &t.token.event_id == id {
                    found = Some(t);
                } else {
                    let later = ReconcileDecision::Recheck { reason: RecheckReason::BrokerUnavailable, next_check_at_ms: self.h.now_ms() + 3_600_000 };
                    self.s().finish_reconcile(&t.token, &later).await.map_err(err("finish_reconcile of a foreign task"))?;
                }
            }
            if found.is_some() {
                break;
            }
        }
        found.ok_or_else(|| format!("{id} was not offered for reconciliation"))
    }

    pub(super) async fn register(&self, token: &ClaimToken) -> Result<AttemptRecord, String> {
        self.s().register_attempt(token).await.map_err(err("register_attempt"))
    }

    pub(super) async fn state(&self, id: &EventId) -> Result<(EventState, Option<BrokerReceipt>), String> {
        self.s().event_state(id).await.map_err(err("event_state"))
    }

    pub(super) async fn expect_state(&self, id: &EventId, want: EventState) -> Verdict {
        eq("event state", self.state(id).await?.0, want)
    }

    pub(super) async fn attempts(&self, id: &EventId) -> Result<Vec<AttemptRecord>, String> {
        self.s().attempts(id).await.map_err(err("attempts"))
    }

    pub(super) async fn accept(&self, r: &BrokerReceipt) -> Result<ReceiptDecision, String> {
        Ok(self.s().accept_dispatch_receipt(r).await.map_err(err("accept_dispatch_receipt"))?.decision)
    }

    /// Lets a SENDING event's lease run out and sweeps it into DISPATCH_UNKNOWN.
    pub(super) async fn expire(&self) -> Verdict {
        self.h.advance_ms(LEASE_MS + 1);
        self.s().expire_leases().await.map_err(err("expire_leases"))?;
        Ok(())
    }
}

/// The genuine receipt of `attempt` of `ce` at `offset`.
pub(super) fn receipt(ce: &ClaimedEvent, attempt: &AttemptRecord, offset: i64) -> BrokerReceipt {
    BrokerReceipt {
        event_id: ce.envelope.event_id.clone(),
        envelope_generation: ce.envelope.envelope_generation,
        attempt_id: attempt.attempt_id.clone(),
        payload_digest: sha256_digest(&ce.payload),
        destination_digest: ce.destination_digest.clone(),
        cluster_id: ce.destination.cluster_id.clone(),
        topic: ce.destination.topic.clone(),
        topic_id: ce.destination.topic_id.clone(),
        partition: ce.destination.partition,
        offset,
        key: Some(ce.destination.routing_key.as_bytes().to_vec()),
        log_id: None,
    }
}

/// A block of 1 000 log offsets no other scenario (of this run or an
/// earlier run on the same database) uses: one log position holds one
/// message, and stores may enforce it.
pub(super) fn offset_block() -> i64 {
    use std::sync::atomic::{AtomicI64, Ordering};
    static NEXT: AtomicI64 = AtomicI64::new(0);
    let run_base = (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0) % 1_000_000_000) * 1_000_000;
    let _ = NEXT.compare_exchange(0, run_base, Ordering::SeqCst, Ordering::SeqCst);
    NEXT.fetch_add(1_000, Ordering::SeqCst)
}
