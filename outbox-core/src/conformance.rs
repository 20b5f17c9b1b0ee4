//! One conformance suite, run against every [`OutboxStore`].
//!
//! The same scenarios run against the in-memory store (in `outbox-sim`'s
//! tests) and against the PostgreSQL store, so both are held to the same
//! protocol: claims and fencing (PROTOCOL §4), the single acceptance point
//! (PROTOCOL §5), unknown outcomes and reconciliation (PROTOCOL §3, §6) and per-key
//! ordering.
//!
//! A store plugs in through a small [`Harness`]: it emits events (the
//! business transaction and the PENDING envelope), can tamper with a stored
//! payload, and owns the clock the store reads. Every scenario creates its own
//! events under unique command keys and aggregate ids, so scenarios may share
//! one store (and one database) with each other and with leftovers of earlier
//! runs: claims and reconcile batches that pick up foreign events hand them
//! back untouched (release, or recheck far in the future).
//!
//! ```ignore
//! let results = outbox_core::conformance::run_all(&harness).await;
//! for (name, r) in &results { assert!(r.is_ok(), "{name}: {r:?}"); }
//! ```

use async_trait::async_trait;

use crate::canonical::sha256_digest;
use crate::envelope::EmitRequest;
use crate::migration::MigrationFence;
use crate::error::CoreError;
use crate::claim::ClaimToken;
use crate::id::{AttemptId, EventId};
use crate::receipt::{AttemptRecord, BrokerReceipt, QuarantineReason, ReceiptDecision, RejectReason};
use crate::reconcile::{decide_reconcile, RecheckReason, ReconcileDecision, RetryPolicy};
use crate::state::{AttemptState, EventState};
use crate::memory::MemoryWatermark;
use crate::store::{ClaimedEvent, FenceOutcome, LookupOutcome, OutboxStore, ReconcileTask, StoreError};

/// Lease every scenario asks for.
pub const LEASE_MS: i64 = 1_000;

/// The reconcile policy of the scenarios: attempts older than
/// [`RetryPolicy::in_flight_bound_ms`] are settled.
pub const POLICY: RetryPolicy = RetryPolicy { allow_retry: true, max_attempts: 10, in_flight_bound_ms: 5_000, recheck_ms: 1_000 };

/// How a store plugs into the suite.
#[async_trait]
pub trait Harness: Send + Sync {
    /// The store under test.
    type Store: OutboxStore;

    /// The store under test.
    fn store(&self) -> &Self::Store;

    /// Runs a business command with idempotency key `command_key` that
    /// commits a PENDING event for aggregate `order/{aggregate_id}` with
    /// `payload`, in one transaction, under one route policy with per-key
    /// ordering. A second call with the same key returns the first event id.
    async fn emit(&self, command_key: &str, aggregate_id: &str, payload: &[u8]) -> EventId;

    /// Runs `request` as a business command in one transaction, as the
    /// store's emit does, under a route for event type `order.created`
    /// (a request of another event type is asked only as a repeat of an
    /// existing key). Refusals come back as
    /// [`CoreError::CommandKeyConflict`] and
    /// [`CoreError::AggregateVersionBackwards`]; nothing is committed then.
    async fn emit_command(&self, request: &EmitRequest<'_>) -> Result<EventId, CoreError>;

    /// The store's migration commit (PROTOCOL §7) of `id` to topic
    /// `to_topic` of the same cluster, under `fence` (with the old target's
    /// `lookup` for a proven-absent move), with [`POLICY`]: `Ok(Ok(new
    /// envelope generation))` when it moved, `Ok(Err(reason))` when it was
    /// refused (nothing changed), `Err` when the store failed.
    async fn commit_migration(&self, id: &EventId, to_topic: &str, fence: &MigrationFence, lookup: Option<&LookupOutcome>) -> Result<Result<u32, String>, String>;

    /// One retention pass (PROTOCOL §9) at the store's clock with
    /// `replay_window_ms`, under exactly this consumer registry
    /// (`(consumer, topics it reads, mandatory)`) and these watermarks,
    /// gone again afterwards: what moved PUBLISHED -> RETAINED and
    /// RETAINED -> PURGED, and how many RETAINED events a mandatory
    /// consumer held back.
    async fn purge(&self, replay_window_ms: i64, consumers: &[(&str, &[&str], bool)], watermarks: &[MemoryWatermark]) -> Result<PurgeCounts, String>;

    /// An event's stored payload bytes; `None` once purged (the tombstone keeps none).
    async fn payload(&self, id: &EventId) -> Option<Vec<u8>>;

    /// Runs the shipped reconciler's bypass scan (`Reconciler::scan_for_bypass`,
    /// retry policy [`POLICY`], clock skew allowance 1 000 ms) at the
    /// store's clock against `log` as its broker. Answers the findings the
    /// scan recorded (kind, event id), the store's scan cursor of each
    /// partition of `log` after it, and how many copies the scan handed to
    /// the receipt transaction.
    async fn bypass_scan(&self, log: &ScanLog) -> Result<ScanOutcome, String>;

    /// Registers `consumers` (critical, each with the topic names it reads;
    /// a registered one keeps its entry), sets each of `watermarks` on its
    /// log (replacing the consumer's watermark there), then runs the
    /// shipped reconciler's condition findings (`Reconciler::compare_findings`,
    /// with `thresholds`, retry policy [`POLICY`], clock skew allowance
    /// 1 000 ms) at the store's clock. Answers the open findings after it:
    /// (kind, event id, consumer id or empty).
    async fn compare_findings(&self, thresholds: &FindingThresholds, consumers: &[(String, Vec<String>)], watermarks: &[crate::store::ConsumerWatermark]) -> Result<Vec<(String, String, String)>, String>;

    /// Overwrites the stored payload bytes of an event, leaving its frozen
    /// digest as it was (corruption, a bad migration script...).
    async fn tamper_payload(&self, id: &EventId, new_payload: &[u8]);

    /// The store's clock, ms since the epoch.
    fn now_ms(&self) -> i64;

    /// Moves the store's clock forward.
    fn advance_ms(&self, ms: i64);
}

/// What one retention pass did ([`Harness::purge`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PurgeCounts {
    /// PUBLISHED -> RETAINED.
    pub retained: u64,
    /// RETAINED -> PURGED.
    pub purged: u64,
    /// RETAINED events past the window held back by a mandatory consumer.
    pub held: u64,
}

/// The thresholds of a comparison round ([`Harness::compare_findings`]), ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FindingThresholds {
    /// `aged_pending_ms`.
    pub aged_pending_ms: i64,
    /// `unknown_slo_ms`.
    pub unknown_slo_ms: i64,
    /// `unconsumed_after_ms`.
    pub unconsumed_after_ms: i64,
}

/// A scenario's verdict.
pub type Verdict = Result<(), String>;

/// Runs every scenario in order and returns each one's name and verdict.
pub async fn run_all<H: Harness>(h: &H) -> Vec<(&'static str, Verdict)> {
    let run = format!("{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff);
    let ctx = |name: &'static str| Ctx { h, prefix: format!("conf-{run}-{name}"), offsets: offset_block() };
    vec![
        ("claim_register_accept_publishes", claim_register_accept_publishes(&ctx("publish")).await),
        ("second_claimer_is_fenced", second_claimer_is_fenced(&ctx("second")).await),
        ("stale_writer_after_lease_expiry_changes_nothing", stale_writer_after_lease_expiry(&ctx("stale")).await),
        ("old_and_new_attempt_acked_one_primary_one_duplicate", old_and_new_attempt_acked(&ctx("both")).await),
        ("not_sent_retry_after_blind_retry_stays_unknown", not_sent_retry_after_blind_retry(&ctx("blindnotsent")).await),
        ("divergent_payload_receipt_quarantines", divergent_payload_receipt_quarantines(&ctx("diverge")).await),
        ("unregistered_attempt_is_rejected", unregistered_attempt_is_rejected(&ctx("unreg")).await),
        ("same_receipt_twice_same_answer", same_receipt_twice_same_answer(&ctx("twice")).await),
        ("not_sent_is_pending_again_same_destination", not_sent_is_pending_again(&ctx("notsent")).await),
        ("lease_expiry_while_sending_is_unknown", lease_expiry_while_sending_is_unknown(&ctx("expiry")).await),
        ("per_key_ordering_holds_the_second_event", per_key_ordering(&ctx("order")).await),
        ("reconcile_absent_retries_same_destination", reconcile_absent_retries_same_destination(&ctx("retry")).await),
        ("reconcile_found_publishes_through_the_slot", reconcile_found_publishes(&ctx("found")).await),
        ("tampered_payload_is_quarantined_unsent", tampered_payload_is_quarantined(&ctx("tamper")).await),
        ("late_ack_of_an_absent_attempt_converges", late_ack_of_an_absent_attempt_converges(&ctx("refuted")).await),
        ("late_ack_of_an_absent_attempt_after_a_refused_retry_is_kept", late_ack_after_a_refused_retry_is_kept(&ctx("refusedretry")).await),
        ("stray_divergent_message_is_evidence_not_a_quarantine", stray_divergent_message_is_evidence(&ctx("stray")).await),
        ("command_keys_and_aggregate_versions", command_keys_and_aggregate_versions(&ctx("command")).await),
        ("registration_guard_refuses_every_stale_claim", registration_guard(&ctx("guard")).await),
        ("reconcile_finish_writes_its_plan", reconcile_finish_writes_its_plan(&ctx("finish")).await),
        ("migration_commit_is_fenced", migration_commit_is_fenced(&ctx("migrate")).await),
        ("a_key_is_held_until_its_event_closes", a_key_is_held_until_its_event_closes(&ctx("held")).await),
        ("purge_waits_for_every_mandatory_watermark_on_the_same_log", purge_waits_for_mandatory_watermarks(&ctx("purge")).await),
        ("registration_floor_is_past_the_logs_last_receipt", registration_floor(&ctx("floor")).await),
        ("the_bypass_scan_judges_every_message_of_a_page", bypass_scan_judgement(&ctx("scan")).await),
        ("the_comparison_judges_each_condition_and_resolves_what_no_longer_holds", comparison_findings(&ctx("findings")).await),
    ]
}

struct Ctx<'a, H> {
    h: &'a H,
    prefix: String,
    offsets: i64,
}

fn ensure(cond: bool, what: impl FnOnce() -> String) -> Verdict {
    if cond {
        Ok(())
    } else {
        Err(what())
    }
}

fn eq<T: PartialEq + std::fmt::Debug>(what: &str, got: T, want: T) -> Verdict {
    ensure(got == want, || format!("{what}: got {got:?}, want {want:?}"))
}

fn err<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> String {
    move |e| format!("{what}: {e}")
}

impl<H: Harness> Ctx<'_, H> {
    /// Log offset `n` of this scenario.
    fn offset(&self, n: i64) -> i64 {
        self.offsets + n
    }

    fn s(&self) -> &H::Store {
        self.h.store()
    }

    async fn command(&self, command_key: &str, aggregate_id: &str, aggregate_version: i64, event_type: &str, payload: &[u8]) -> Result<EventId, CoreError> {
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

    async fn emit(&self, n: u32, aggregate: &str) -> EventId {
        let key = format!("{}-cmd{n}", self.prefix);
        let agg = format!("{}-{aggregate}", self.prefix);
        self.h.emit(&key, &agg, format!("{{\"scenario\":\"{}\",\"n\":{n}}}", self.prefix).as_bytes()).await
    }

    /// Claims until `id` is among the claimed events; every other event
    /// claimed on the way is released afterwards. `Ok(None)` when `id` is not claimable.
    async fn claim(&self, owner: &str, id: &EventId) -> Result<Option<ClaimedEvent>, String> {
        let mut found = None;
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
        Ok(found)
    }

    async fn claim_some(&self, owner: &str, id: &EventId) -> Result<ClaimedEvent, String> {
        self.claim(owner, id).await?.ok_or_else(|| format!("{id} was not claimable"))
    }

    /// Takes over `id`'s retry claim; foreign retry claims are left to expire.
    async fn claim_retry(&self, owner: &str, id: &EventId) -> Result<ClaimedEvent, String> {
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
    async fn reconcile(&self, owner: &str, id: &EventId) -> Result<ReconcileTask, String> {
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

    async fn register(&self, token: &ClaimToken) -> Result<AttemptRecord, String> {
        self.s().register_attempt(token).await.map_err(err("register_attempt"))
    }

    async fn state(&self, id: &EventId) -> Result<(EventState, Option<BrokerReceipt>), String> {
        self.s().event_state(id).await.map_err(err("event_state"))
    }

    async fn expect_state(&self, id: &EventId, want: EventState) -> Verdict {
        eq("event state", self.state(id).await?.0, want)
    }

    async fn attempts(&self, id: &EventId) -> Result<Vec<AttemptRecord>, String> {
        self.s().attempts(id).await.map_err(err("attempts"))
    }

    async fn accept(&self, r: &BrokerReceipt) -> Result<ReceiptDecision, String> {
        Ok(self.s().accept_dispatch_receipt(r).await.map_err(err("accept_dispatch_receipt"))?.decision)
    }

    /// Lets a SENDING event's lease run out and sweeps it into DISPATCH_UNKNOWN.
    async fn expire(&self) -> Verdict {
        self.h.advance_ms(LEASE_MS + 1);
        self.s().expire_leases().await.map_err(err("expire_leases"))?;
        Ok(())
    }
}

/// The genuine receipt of `attempt` of `ce` at `offset`.
fn receipt(ce: &ClaimedEvent, attempt: &AttemptRecord, offset: i64) -> BrokerReceipt {
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
    }
}

/// A block of 1 000 log offsets no other scenario (of this run or an
/// earlier run on the same database) uses: one log position holds one
/// message, and stores may enforce it.
fn offset_block() -> i64 {
    use std::sync::atomic::{AtomicI64, Ordering};
    static NEXT: AtomicI64 = AtomicI64::new(0);
    let run_base = (std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0) % 1_000_000_000) * 1_000_000;
    let _ = NEXT.compare_exchange(0, run_base, Ordering::SeqCst, Ordering::SeqCst);
    NEXT.fetch_add(1_000, Ordering::SeqCst)
}

async fn claim_register_accept_publishes<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    eq("a retried command", c.emit(1, "a").await, id.clone())?;
    c.expect_state(&id, EventState::Pending).await?;
    let ce = c.claim_some("w1", &id).await?;
    eq("claimed from", ce.claimed_from, EventState::Pending)?;
    c.expect_state(&id, EventState::Claimed).await?;
    let a = c.register(&ce.token).await?;
    eq("attempt generation", a.attempt_generation, 1)?;
    eq("attempt destination", &a.destination_digest, &ce.destination_digest)?;
    c.expect_state(&id, EventState::Sending).await?;
    let r = receipt(&ce, &a, c.offset(1));
    eq("decision", c.accept(&r).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    let (state, slot) = c.state(&id).await?;
    eq("state", state, EventState::Published)?;
    eq("slot", slot, Some(r))?;
    eq("attempt state", c.attempts(&id).await?.first().map(|a| a.state), Some(AttemptState::Acked))
}

async fn second_claimer_is_fenced<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce = c.claim_some("w1", &id).await?;
    ensure(c.claim("w2", &id).await?.is_none(), || "a claimed event was claimed again".into())?;
    // Another owner presenting the current generation, and the holder
    // presenting a generation it was never granted, are both fenced.
    let forged = ClaimToken { owner: "w2".into(), ..ce.token.clone() };
    let e = c.s().register_attempt(&forged).await.err().ok_or("a forged owner registered an attempt")?;
    ensure(e.is_fenced(), || format!("forged owner: {e}"))?;
    let ahead = ClaimToken { claim_generation: ce.token.claim_generation + 1, ..ce.token.clone() };
    let e = c.s().register_attempt(&ahead).await.err().ok_or("a future generation registered an attempt")?;
    ensure(e.is_fenced(), || format!("future generation: {e}"))?;
    eq("release by the forged owner", c.s().release(&forged).await.map_err(err("release"))?, FenceOutcome::Fenced)?;
    c.expect_state(&id, EventState::Claimed).await?;
    let a = c.register(&ce.token).await?;
    eq("decision", c.accept(&receipt(&ce, &a, c.offset(1))).await?, ReceiptDecision::Accept { from: EventState::Sending })
}

async fn stale_writer_after_lease_expiry<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let old = c.claim_some("w1", &id).await?;
    c.h.advance_ms(LEASE_MS + 1);
    // Still the current generation, but the lease is gone: no send.
    let e = c.s().register_attempt(&old.token).await.err().ok_or("registered with an expired lease")?;
    ensure(e.is_fenced(), || format!("expired lease: {e}"))?;
    c.s().expire_leases().await.map_err(err("expire_leases"))?;
    c.expect_state(&id, EventState::Pending).await?;
    let new = c.claim_some("w2", &id).await?;
    ensure(new.token.claim_generation > old.token.claim_generation, || "the takeover did not bump the generation".into())?;
    let e = c.s().register_attempt(&old.token).await.err().ok_or("a stale holder registered an attempt")?;
    ensure(e.is_fenced(), || format!("stale holder: {e}"))?;
    eq("stale release", c.s().release(&old.token).await.map_err(err("release"))?, FenceOutcome::Fenced)?;
    eq("stale renew", c.s().renew_lease(&old.token, LEASE_MS).await.map_err(err("renew_lease"))?, None)?;
    c.expect_state(&id, EventState::Claimed).await?;
    ensure(c.attempts(&id).await?.is_empty(), || "a stale write left an attempt".into())?;
    let a = c.register(&new.token).await?;
    eq("stale not-sent report", c.s().report_not_sent(&old.token, &a.attempt_id, "stale").await.map_err(err("report_not_sent"))?, FenceOutcome::Fenced)?;
    eq("stale unknown report", c.s().report_unknown(&old.token, &a.attempt_id, "stale").await.map_err(err("report_unknown"))?, FenceOutcome::Fenced)?;
    c.expect_state(&id, EventState::Sending).await?;
    eq("decision", c.accept(&receipt(&new, &a, c.offset(1))).await?, ReceiptDecision::Accept { from: EventState::Sending })
}

/// PROTOCOL §5: a late genuine ACK of an old attempt and the ACK of a new attempt
/// compete for the slot; the loser is kept as a duplicate transport receipt.
/// The second attempt exists while the first one's outcome is unproven: the
/// adapter cannot look up, so the reconciler may only retry to the same
/// frozen destination (PROTOCOL §6).
async fn old_and_new_attempt_acked<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce1 = c.claim_some("w1", &id).await?;
    let a1 = c.register(&ce1.token).await?;
    c.expire().await?;
    c.h.advance_ms(POLICY.in_flight_bound_ms);
    let task = c.reconcile("r1", &id).await?;
    let lookup = LookupOutcome::Unavailable("adapter cannot look up".into());
    let d = decide_reconcile(&task.attempts, &lookup, false, &POLICY, c.h.now_ms());
    eq("reconcile decision", &d, &ReconcileDecision::Retry { proven_absent: false })?;
    eq("finish", c.s().finish_reconcile(&task.token, &d).await.map_err(err("finish_reconcile"))?, FenceOutcome::Applied)?;
    let ce2 = c.claim_retry("w2", &id).await?;
    let a2 = c.register(&ce2.token).await?;
    let (r1, r2) = (receipt(&ce1, &a1, c.offset(1)), receipt(&ce2, &a2, c.offset(2)));
    eq("new attempt's ACK", c.accept(&r2).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    eq("old attempt's late ACK", c.accept(&r1).await?, ReceiptDecision::Duplicate)?;
    eq("old attempt's late ACK again", c.accept(&r1).await?, ReceiptDecision::Duplicate)?;
    let (state, slot) = c.state(&id).await?;
    eq("state", state, EventState::Published)?;
    eq("slot", slot, Some(r2))?;
    let states: Vec<_> = c.attempts(&id).await?.iter().map(|a| a.state).collect();
    eq("attempt states", states, vec![AttemptState::Acked, AttemptState::Acked])
}

/// After a blind retry the first attempt is still UNKNOWN (possibly in the
/// log). If the retry attempt is then definitely not sent, the event's outcome
/// is still unknown: it must go back to DISPATCH_UNKNOWN, not PENDING, or the
/// first attempt's late genuine ACK could no longer fill the slot (found by
/// the simulator, seed 91609).
async fn not_sent_retry_after_blind_retry<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce1 = c.claim_some("w1", &id).await?;
    let a1 = c.register(&ce1.token).await?;
    c.expire().await?;
    c.h.advance_ms(POLICY.in_flight_bound_ms);
    let task = c.reconcile("r1", &id).await?;
    let d = decide_reconcile(&task.attempts, &LookupOutcome::Unavailable("adapter cannot look up".into()), false, &POLICY, c.h.now_ms());
    eq("reconcile decision", &d, &ReconcileDecision::Retry { proven_absent: false })?;
    c.s().finish_reconcile(&task.token, &d).await.map_err(err("finish_reconcile"))?;
    let ce2 = c.claim_retry("w2", &id).await?;
    let a2 = c.register(&ce2.token).await?;
    eq("retry not sent", c.s().report_not_sent(&ce2.token, &a2.attempt_id, "broker refused").await.map_err(err("report_not_sent"))?, FenceOutcome::Applied)?;
    c.expect_state(&id, EventState::DispatchUnknown).await?;
    let states: Vec<_> = c.attempts(&id).await?.iter().map(|a| a.state).collect();
    eq("attempt states", states, vec![AttemptState::Unknown, AttemptState::NotSent])?;
    eq("first attempt's late ACK", c.accept(&receipt(&ce1, &a1, c.offset(1))).await?, ReceiptDecision::Accept { from: EventState::DispatchUnknown })?;
    c.expect_state(&id, EventState::Published).await
}

async fn divergent_payload_receipt_quarantines<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce = c.claim_some("w1", &id).await?;
    let a = c.register(&ce.token).await?;
    let genuine = receipt(&ce, &a, c.offset(1));
    let bad = BrokerReceipt { payload_digest: sha256_digest(b"not the frozen payload"), ..genuine.clone() };
    eq("divergent receipt", c.accept(&bad).await?, ReceiptDecision::Quarantine { reason: QuarantineReason::PayloadDigestMismatch, move_event: true })?;
    c.expect_state(&id, EventState::Quarantined).await?;
    // The genuine copy is in the log too: kept as evidence, the event stays quarantined.
    eq("genuine receipt after quarantine", c.accept(&genuine).await?, ReceiptDecision::Duplicate)?;
    let (state, slot) = c.state(&id).await?;
    eq("state", state, EventState::Quarantined)?;
    eq("slot", slot, None)
}

async fn unregistered_attempt_is_rejected<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce = c.claim_some("w1", &id).await?;
    let a = c.register(&ce.token).await?;
    let genuine = receipt(&ce, &a, c.offset(2));
    let stranger = BrokerReceipt { attempt_id: AttemptId::generate(c.h.now_ms().max(0) as u64), offset: c.offset(1), ..genuine.clone() };
    eq("unregistered attempt", c.accept(&stranger).await?, ReceiptDecision::Reject { reason: RejectReason::UnregisteredAttempt })?;
    // A registered attempt, but another event's, is not this event's.
    let other = c.emit(2, "b").await;
    let other_ce = c.claim_some("w1", &other).await?;
    let other_attempt = c.register(&other_ce.token).await?;
    let borrowed = BrokerReceipt { attempt_id: other_attempt.attempt_id.clone(), offset: c.offset(3), ..genuine.clone() };
    eq("another event's attempt", c.accept(&borrowed).await?, ReceiptDecision::Reject { reason: RejectReason::UnregisteredAttempt })?;
    c.expect_state(&id, EventState::Sending).await?;
    eq("registered attempt", c.accept(&genuine).await?, ReceiptDecision::Accept { from: EventState::Sending })
}

/// An event whose first attempt's outcome became unknown (its lease ran
/// out while sending) and which a reconciler then proved absent: the
/// attempt closed ABSENT, the event RETRY_CLAIMED. Answers the event, its
/// first claim and the attempt.
async fn first_attempt_proven_absent<H: Harness>(c: &Ctx<'_, H>) -> Result<(EventId, ClaimedEvent, AttemptRecord), String> {
    let id = c.emit(1, "a").await;
    let ce1 = c.claim_some("w1", &id).await?;
    let a1 = c.register(&ce1.token).await?;
    c.expire().await?;
    c.h.advance_ms(POLICY.in_flight_bound_ms);
    let task = c.reconcile("r1", &id).await?;
    let d = decide_reconcile(&task.attempts, &LookupOutcome::Absent, true, &POLICY, c.h.now_ms());
    eq("proof", &d, &ReconcileDecision::Retry { proven_absent: true })?;
    c.s().finish_reconcile(&task.token, &d).await.map_err(err("finish_reconcile"))?;
    eq("attempt 1 closed", c.attempts(&id).await?.first().map(|a| a.state), Some(AttemptState::Absent))?;
    Ok((id, ce1, a1))
}

async fn late_ack_of_an_absent_attempt_converges<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let (id, ce1, a1) = first_attempt_proven_absent(c).await?;
    // A1's genuine message lands after all: it fills the empty slot.
    let r1 = receipt(&ce1, &a1, c.offset(1));
    eq("late ACK of the absent attempt", c.accept(&r1).await?, ReceiptDecision::Accept { from: EventState::RetryClaimed })?;
    c.expect_state(&id, EventState::Published).await?;
    eq("again", c.accept(&r1).await?, ReceiptDecision::AlreadyAccepted)
}

/// The proof of absence was wrong (a paused host wrote after the bound) and
/// the event went on without the copy: its retry was refused, it is PENDING
/// again. The late genuine ACK cannot publish it, but it is kept as a
/// duplicate transport receipt (and refutes the proof); the next attempt
/// publishes the event.
async fn late_ack_after_a_refused_retry_is_kept<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let (id, ce1, a1) = first_attempt_proven_absent(c).await?;
    let ce2 = c.claim_retry("w2", &id).await?;
    let a2 = c.register(&ce2.token).await?;
    eq("retry refused", c.s().report_not_sent(&ce2.token, &a2.attempt_id, "broker refused").await.map_err(err("report_not_sent"))?, FenceOutcome::Applied)?;
    c.expect_state(&id, EventState::Pending).await?;
    let late = receipt(&ce1, &a1, c.offset(1));
    eq("late ACK of the absent attempt", c.accept(&late).await?, ReceiptDecision::Duplicate)?;
    c.expect_state(&id, EventState::Pending).await?;
    eq("again", c.accept(&late).await?, ReceiptDecision::Duplicate)?;
    c.h.advance_ms(crate::claim::not_sent_backoff_ms(a2.attempt_generation));
    let ce3 = c.claim_some("w3", &id).await?;
    let a3 = c.register(&ce3.token).await?;
    eq("the next attempt", c.accept(&receipt(&ce3, &a3, c.offset(2))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    c.expect_state(&id, EventState::Published).await
}

async fn stray_divergent_message_is_evidence<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce = c.claim_some("w1", &id).await?;
    let a = c.register(&ce.token).await?;
    c.s().report_unknown(&ce.token, &a.attempt_id, "timed out").await.map_err(err("report_unknown"))?;
    // A mirror's copy: other bytes, no destination digest, no registered attempt.
    let genuine = receipt(&ce, &a, c.offset(2));
    let stray = BrokerReceipt {
        attempt_id: AttemptId::from_parts(0, 0),
        payload_digest: sha256_digest(b"mirrored"),
        destination_digest: String::new(),
        offset: c.offset(1),
        ..genuine.clone()
    };
    eq("stray", c.accept(&stray).await?, ReceiptDecision::Reject { reason: RejectReason::UnregisteredAttempt })?;
    c.expect_state(&id, EventState::DispatchUnknown).await?;
    eq("genuine", c.accept(&genuine).await?, ReceiptDecision::Accept { from: EventState::DispatchUnknown })
}

async fn same_receipt_twice_same_answer<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce = c.claim_some("w1", &id).await?;
    let a = c.register(&ce.token).await?;
    let r = receipt(&ce, &a, c.offset(1));
    let first = c.s().accept_dispatch_receipt(&r).await.map_err(err("accept"))?;
    eq("first", &first.decision, &ReceiptDecision::Accept { from: EventState::Sending })?;
    for _ in 0..2 {
        let again = c.s().accept_dispatch_receipt(&r).await.map_err(err("accept"))?;
        eq("again", &again.decision, &ReceiptDecision::AlreadyAccepted)?;
        eq("primary", &again.primary, &first.primary)?;
        eq("state", again.state, first.state)?;
    }
    Ok(())
}

async fn not_sent_is_pending_again<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce1 = c.claim_some("w1", &id).await?;
    let a1 = c.register(&ce1.token).await?;
    eq("not sent", c.s().report_not_sent(&ce1.token, &a1.attempt_id, "broker refused").await.map_err(err("report_not_sent"))?, FenceOutcome::Applied)?;
    c.expect_state(&id, EventState::Pending).await?;
    eq("attempt 1 state", c.attempts(&id).await?.first().map(|a| a.state), Some(AttemptState::NotSent))?;
    // Eligible again after a backoff, not at once: a send the broker always
    // refuses is not retried in a loop.
    let early = c.claim("w2", &id).await?;
    ensure(early.is_none(), || "claimable again before its backoff".into())?;
    c.h.advance_ms(crate::claim::not_sent_backoff_ms(a1.attempt_generation));
    let ce2 = c.claim_some("w2", &id).await?;
    eq("destination digest", &ce2.destination_digest, &ce1.destination_digest)?;
    eq("destination", &ce2.destination, &ce1.destination)?;
    let a2 = c.register(&ce2.token).await?;
    eq("attempt generation", a2.attempt_generation, 2)?;
    eq("attempt destination", &a2.destination_digest, &a1.destination_digest)?;
    // The closed attempt cannot fill the slot; the new one can.
    eq("closed attempt", c.accept(&receipt(&ce1, &a1, c.offset(1))).await?, ReceiptDecision::Reject { reason: RejectReason::AttemptClosed })?;
    eq("new attempt", c.accept(&receipt(&ce2, &a2, c.offset(2))).await?, ReceiptDecision::Accept { from: EventState::Sending })
}

async fn lease_expiry_while_sending_is_unknown<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce = c.claim_some("w1", &id).await?;
    let a = c.register(&ce.token).await?;
    c.expire().await?;
    c.expect_state(&id, EventState::DispatchUnknown).await?;
    let attempts = c.attempts(&id).await?;
    eq("attempts", attempts.len(), 1)?;
    eq("attempt state", attempts[0].state, AttemptState::Unknown)?;
    eq("stale unknown report", c.s().report_unknown(&ce.token, &a.attempt_id, "timeout").await.map_err(err("report_unknown"))?, FenceOutcome::Fenced)?;
    eq("stale not-sent report", c.s().report_not_sent(&ce.token, &a.attempt_id, "refused").await.map_err(err("report_not_sent"))?, FenceOutcome::Fenced)?;
    c.expect_state(&id, EventState::DispatchUnknown).await?;
    // The late genuine ACK of the expired claim still fills the slot.
    eq("late ACK", c.accept(&receipt(&ce, &a, c.offset(1))).await?, ReceiptDecision::Accept { from: EventState::DispatchUnknown })?;
    c.expect_state(&id, EventState::Published).await
}

async fn per_key_ordering<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let first = c.emit(1, "same").await;
    let second = c.emit(2, "same").await;
    let other = c.emit(3, "other").await;
    ensure(c.claim("w1", &second).await?.is_none(), || "the second event of a key was claimable before the first was published".into())?;
    let o = c.claim_some("w1", &other).await?;
    c.s().release(&o.token).await.map_err(err("release"))?;
    let ce1 = c.claim_some("w1", &first).await?;
    let a1 = c.register(&ce1.token).await?;
    ensure(c.claim("w1", &second).await?.is_none(), || "the second event of a key was claimable while the first was SENDING".into())?;
    c.accept(&receipt(&ce1, &a1, c.offset(1))).await?;
    let ce2 = c.claim_some("w1", &second).await?;
    let a2 = c.register(&ce2.token).await?;
    eq("second", c.accept(&receipt(&ce2, &a2, c.offset(2))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    let o = c.claim_some("w1", &other).await?;
    let ao = c.register(&o.token).await?;
    eq("other", c.accept(&receipt(&o, &ao, c.offset(3))).await?, ReceiptDecision::Accept { from: EventState::Sending })
}

async fn reconcile_absent_retries_same_destination<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce1 = c.claim_some("w1", &id).await?;
    let a1 = c.register(&ce1.token).await?;
    c.expire().await?;
    // Young attempt: the absence proof does not cover it yet.
    let task = c.reconcile("r1", &id).await?;
    eq("reconcile state", task.event.state, EventState::Reconciling)?;
    let d = decide_reconcile(&task.attempts, &LookupOutcome::Absent, true, &POLICY, c.h.now_ms());
    ensure(matches!(d, ReconcileDecision::Recheck { reason: RecheckReason::AttemptInFlight, .. }), || format!("young attempt: {d:?}"))?;
    eq("finish recheck", c.s().finish_reconcile(&task.token, &d).await.map_err(err("finish_reconcile"))?, FenceOutcome::Applied)?;
    c.expect_state(&id, EventState::DispatchUnknown).await?;
    c.h.advance_ms(POLICY.in_flight_bound_ms);
    let task = c.reconcile("r1", &id).await?;
    let d = decide_reconcile(&task.attempts, &LookupOutcome::Absent, true, &POLICY, c.h.now_ms());
    eq("settled attempt", &d, &ReconcileDecision::Retry { proven_absent: true })?;
    eq("finish retry", c.s().finish_reconcile(&task.token, &d).await.map_err(err("finish_reconcile"))?, FenceOutcome::Applied)?;
    c.expect_state(&id, EventState::RetryClaimed).await?;
    // The reconciler's token is spent.
    eq("stale reconciler", c.s().finish_reconcile(&task.token, &d).await.map_err(err("finish_reconcile"))?, FenceOutcome::Fenced)?;
    let ce2 = c.claim_retry("w2", &id).await?;
    eq("claimed from", ce2.claimed_from, EventState::RetryClaimed)?;
    eq("frozen destination", &ce2.destination_digest, &ce1.destination_digest)?;
    let a2 = c.register(&ce2.token).await?;
    eq("attempt generation", a2.attempt_generation, 2)?;
    eq("attempt destination", &a2.destination_digest, &a1.destination_digest)?;
    eq("decision", c.accept(&receipt(&ce2, &a2, c.offset(2))).await?, ReceiptDecision::Accept { from: EventState::Sending })
}

async fn reconcile_found_publishes<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce = c.claim_some("w1", &id).await?;
    let a = c.register(&ce.token).await?;
    c.s().report_unknown(&ce.token, &a.attempt_id, "timed out, possibly persisted").await.map_err(err("report_unknown"))?;
    c.expect_state(&id, EventState::DispatchUnknown).await?;
    let task = c.reconcile("r1", &id).await?;
    let r = receipt(&ce, &a, c.offset(1));
    let d = decide_reconcile(&task.attempts, &LookupOutcome::Found(vec![r.clone()]), true, &POLICY, c.h.now_ms());
    eq("decision", &d, &ReconcileDecision::Submit(vec![r.clone()]))?;
    eq("submit", c.accept(&r).await?, ReceiptDecision::Accept { from: EventState::Reconciling })?;
    let recheck = ReconcileDecision::Recheck { reason: RecheckReason::ReceiptsRefused, next_check_at_ms: c.h.now_ms() };
    let fin = c.s().finish_reconcile(&task.token, &recheck).await.map_err(err("finish_reconcile"))?;
    ensure(fin != FenceOutcome::Applied, || "a recheck was applied to a published event".into())?;
    let (state, slot) = c.state(&id).await?;
    eq("state", state, EventState::Published)?;
    eq("slot", slot, Some(r))
}

async fn tampered_payload_is_quarantined<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    c.h.tamper_payload(&id, b"tampered bytes").await;
    let ce = c.claim_some("w1", &id).await?;
    ensure(sha256_digest(&ce.payload) != ce.envelope.payload_digest, || "the tampered payload still matches its digest".into())?;
    let out = c.s().quarantine_claimed(&ce.token, "payload_digest_mismatch", serde_json::json!({"actual": sha256_digest(&ce.payload)})).await.map_err(err("quarantine_claimed"))?;
    eq("quarantine", out, FenceOutcome::Applied)?;
    c.expect_state(&id, EventState::Quarantined).await?;
    ensure(c.attempts(&id).await?.is_empty(), || "a quarantined event has attempts".into())?;
    ensure(c.claim("w1", &id).await?.is_none(), || "a quarantined event was claimable".into())
}

/// `emit`'s command decision (`decide_command`): a key names one event for
/// ever (a retry with the same content answers it, even after later
/// commands of its aggregate; other content is refused), and an
/// aggregate's versions never go backwards (an equal version is allowed).
async fn command_keys_and_aggregate_versions<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let n = |name: &str| format!("{}-{name}", c.prefix);
    let first = c.command(&n("k1"), &n("a"), 2, "order.created", b"{\"n\":1}").await.map_err(err("first command"))?;
    eq("a retry of the command", c.command(&n("k1"), &n("a"), 2, "order.created", b"{\"n\":1}").await.map_err(err("retry"))?, first.clone())?;
    for (what, result) in [
        ("payload", c.command(&n("k1"), &n("a"), 2, "order.created", b"{\"n\":2}").await),
        ("aggregate", c.command(&n("k1"), &n("b"), 2, "order.created", b"{\"n\":1}").await),
        ("event type", c.command(&n("k1"), &n("a"), 2, "order.paid", b"{\"n\":1}").await),
    ] {
        match result {
            Err(CoreError::CommandKeyConflict { event_id, what: got, .. }) => {
                eq("the conflict names the key's first event", &event_id, &first)?;
                eq("what differs", got, what)?;
            }
            other => return Err(format!("the key reused with another {what}: got {other:?}, want CommandKeyConflict")),
        }
    }
    match c.command(&n("k2"), &n("a"), 1, "order.created", b"{\"n\":3}").await {
        Err(CoreError::AggregateVersionBackwards { version: 1, last: 2, .. }) => {}
        other => return Err(format!("version 1 after 2: got {other:?}, want AggregateVersionBackwards {{ version: 1, last: 2 }}")),
    }
    let equal = c.command(&n("k2"), &n("a"), 2, "order.created", b"{\"n\":3}").await.map_err(err("an equal version"))?;
    ensure(equal != first, || "an equal version under a new key is a new event".into())?;
    // The other aggregate has its own versions.
    c.command(&n("k3"), &n("b"), 1, "order.created", b"{\"n\":4}").await.map_err(err("another aggregate's version 1"))?;
    c.command(&n("k4"), &n("a"), 5, "order.created", b"{\"n\":5}").await.map_err(err("version 5"))?;
    eq("a retry after later commands of the aggregate", c.command(&n("k1"), &n("a"), 2, "order.created", b"{\"n\":1}").await.map_err(err("late retry"))?, first.clone())?;
    // The refused commands wrote nothing: the key still names the first event, which waits to be claimed.
    eq("the first event's state", c.s().event_state(&first).await.map_err(err("event_state"))?.0, EventState::Pending)?;
    Ok(())
}

/// The registration guard (`check_registration`): only the current holder
/// of a running claim that has no attempt yet registers one. A forged owner
/// and a released claim are fenced (and audited); a second registration on
/// the same claim is an illegal transition (the claim is used), not a
/// second attempt. Nothing refused leaves an attempt.
async fn registration_guard<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce = c.claim_some("w1", &id).await?;
    let forged = ClaimToken { owner: "w9".into(), ..ce.token.clone() };
    let e = c.s().register_attempt(&forged).await.err().ok_or("another owner registered on w1's claim")?;
    ensure(e.is_fenced(), || format!("forged owner: {e}"))?;
    ensure(c.attempts(&id).await?.is_empty(), || "a forged registration left an attempt".into())?;
    c.expect_state(&id, EventState::Claimed).await?;
    let a = c.register(&ce.token).await?;
    match c.s().register_attempt(&ce.token).await {
        Err(StoreError::Core(CoreError::IllegalTransition { from: EventState::Sending, to: EventState::Sending })) => {}
        other => return Err(format!("a second registration on one claim: got {other:?}, want IllegalTransition SENDING -> SENDING")),
    }
    let attempts = c.attempts(&id).await?;
    eq("attempts after the second registration", attempts.iter().map(|x| &x.attempt_id).collect::<Vec<_>>(), vec![&a.attempt_id])?;

    let released = c.emit(2, "b").await;
    let ce2 = c.claim_some("w1", &released).await?;
    eq("release", c.s().release(&ce2.token).await.map_err(err("release"))?, FenceOutcome::Applied)?;
    let e = c.s().register_attempt(&ce2.token).await.err().ok_or("a released claim registered an attempt")?;
    ensure(e.is_fenced(), || format!("released claim: {e}"))?;
    ensure(c.attempts(&released).await?.is_empty(), || "a released claim left an attempt".into())?;
    c.expect_state(&released, EventState::Pending).await
}

/// `plan_reconcile_finish` on both stores: a recheck is not offered before
/// its due time and then under a new generation (the old token is fenced);
/// a blind retry leaves the open attempts UNKNOWN; a proven absence closes
/// every open attempt ABSENT, the earlier ones included.
async fn reconcile_finish_writes_its_plan<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let id = c.emit(1, "a").await;
    let ce1 = c.claim_some("w1", &id).await?;
    let a1 = c.register(&ce1.token).await?;
    c.expire().await?;
    c.h.advance_ms(POLICY.in_flight_bound_ms);
    let t1 = c.reconcile("r1", &id).await?;
    let due = c.h.now_ms() + 5_000;
    let recheck = ReconcileDecision::Recheck { reason: RecheckReason::BrokerUnavailable, next_check_at_ms: due };
    eq("finish recheck", c.s().finish_reconcile(&t1.token, &recheck).await.map_err(err("finish_reconcile"))?, FenceOutcome::Applied)?;
    c.expect_state(&id, EventState::DispatchUnknown).await?;
    ensure(c.reconcile("r2", &id).await.is_err(), || "offered before its recheck was due".into())?;
    c.h.advance_ms(5_001);
    let t2 = c.reconcile("r2", &id).await?;
    ensure(t2.token.claim_generation > t1.token.claim_generation, || "the second reconcile claim did not bump the generation".into())?;
    eq("the first reconciler's finish", c.s().finish_reconcile(&t1.token, &recheck).await.map_err(err("finish_reconcile"))?, FenceOutcome::Fenced)?;
    c.expect_state(&id, EventState::Reconciling).await?;
    let blind = ReconcileDecision::Retry { proven_absent: false };
    eq("finish blind retry", c.s().finish_reconcile(&t2.token, &blind).await.map_err(err("finish_reconcile"))?, FenceOutcome::Applied)?;
    c.expect_state(&id, EventState::RetryClaimed).await?;
    let states = |v: Vec<AttemptRecord>| v.into_iter().map(|a| (a.attempt_id, a.state)).collect::<Vec<_>>();
    eq("after a blind retry", states(c.attempts(&id).await?), vec![(a1.attempt_id.clone(), AttemptState::Unknown)])?;
    let ce2 = c.claim_retry("w2", &id).await?;
    let a2 = c.register(&ce2.token).await?;
    c.expire().await?;
    c.h.advance_ms(POLICY.in_flight_bound_ms);
    let t3 = c.reconcile("r3", &id).await?;
    eq("finish proven retry", c.s().finish_reconcile(&t3.token, &ReconcileDecision::Retry { proven_absent: true }).await.map_err(err("finish_reconcile"))?, FenceOutcome::Applied)?;
    eq("after a proof", states(c.attempts(&id).await?), vec![(a1.attempt_id, AttemptState::Absent), (a2.attempt_id, AttemptState::Absent)])?;
    c.expect_state(&id, EventState::RetryClaimed).await
}

/// The migration commit's fence (`check_migration_fence`) on both stores:
/// a PENDING event moves only at the claim generation it was read at, and a
/// proven-absent move only under the very reconcile claim its lookup was
/// made under. A refused commit changes nothing (no new generation, the
/// attempts still UNKNOWN); a fenced one then moves and closes them ABSENT.
async fn migration_commit_is_fenced<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let to = format!("{}-moved", c.prefix);
    // PENDING, never claimed: generation 0.
    let fresh = c.emit(1, "a").await;
    eq("a PENDING event read at its generation", c.h.commit_migration(&fresh, &to, &MigrationFence::Generation(0), None).await?, Ok(2))?;
    c.expect_state(&fresh, EventState::Pending).await?;
    let claimed = c.emit(2, "b").await;
    let ce = c.claim_some("w1", &claimed).await?;
    eq("release", c.s().release(&ce.token).await.map_err(err("release"))?, FenceOutcome::Applied)?;
    ensure(c.h.commit_migration(&claimed, &to, &MigrationFence::Generation(0), None).await?.is_err(), || "moved although claimed since it was read".into())?;

    let unknown = c.emit(3, "c").await;
    let ce = c.claim_some("w1", &unknown).await?;
    let a = c.register(&ce.token).await?;
    c.expire().await?;
    c.h.advance_ms(POLICY.in_flight_bound_ms);
    let operator = c.reconcile("operator", &unknown).await?;
    // The operator's claim runs out after its lookup; a reconciler takes the event.
    c.expire().await?;
    let reconciler = c.reconcile("r1", &unknown).await?;
    let stale = c.h.commit_migration(&unknown, &to, &MigrationFence::Claim(operator.token.clone()), Some(&LookupOutcome::Absent)).await?;
    ensure(stale.is_err(), || format!("moved under a lost reconcile claim: {stale:?}"))?;
    c.expect_state(&unknown, EventState::Reconciling).await?;
    eq("attempts after the refused commit", c.attempts(&unknown).await?.into_iter().map(|x| x.state).collect::<Vec<_>>(), vec![AttemptState::Unknown])?;
    eq("under the current claim", c.h.commit_migration(&unknown, &to, &MigrationFence::Claim(reconciler.token.clone()), Some(&LookupOutcome::Absent)).await?, Ok(2))?;
    c.expect_state(&unknown, EventState::Pending).await?;
    eq("attempts after the move", c.attempts(&unknown).await?.into_iter().map(|x| (x.attempt_id, x.state)).collect::<Vec<_>>(), vec![(a.attempt_id, AttemptState::Absent)])
}

/// Claim eligibility (`is_claimable`, `EventState::holds_key`) on both
/// stores: the second event of a key is claimable exactly when the core
/// says so, through every state its first event passes (PENDING, CLAIMED,
/// SENDING, DISPATCH_UNKNOWN, RECONCILING, RETRY_CLAIMED, PUBLISHED).
async fn a_key_is_held_until_its_event_closes<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let first = c.emit(1, "k").await;
    let second = c.emit(2, "k").await;
    let (one, two) = (&first, &second);
    let check = |stage: &'static str| async move {
        let (state, _) = c.state(one).await?;
        let want = crate::claim::is_claimable(EventState::Pending, 0, state.holds_key(), c.h.now_ms());
        let got = c.claim("w9", two).await?;
        eq(stage, got.is_some(), want)?;
        Ok::<_, String>(got)
    };
    eq("pending", check("behind a PENDING event").await?.is_some(), false)?;
    let ce = c.claim_some("w1", &first).await?;
    check("behind a CLAIMED event").await?;
    c.register(&ce.token).await?;
    check("behind a SENDING event").await?;
    c.expire().await?;
    check("behind a DISPATCH_UNKNOWN event").await?;
    c.h.advance_ms(POLICY.in_flight_bound_ms);
    let task = c.reconcile("r1", &first).await?;
    check("behind a RECONCILING event").await?;
    eq("finish", c.s().finish_reconcile(&task.token, &ReconcileDecision::Retry { proven_absent: false }).await.map_err(err("finish_reconcile"))?, FenceOutcome::Applied)?;
    check("behind a RETRY_CLAIMED event").await?;
    let retry = c.claim_retry("w2", &first).await?;
    let a2 = c.register(&retry.token).await?;
    eq("the retry's receipt", c.accept(&receipt(&retry, &a2, c.offset(1))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    let claimed = check("behind a PUBLISHED event").await?.ok_or("the second event was not claimed once the first was published")?;
    c.s().release(&claimed.token).await.map_err(err("release"))?;
    Ok(())
}

/// Retention's purge decision (`may_purge`, `WatermarkRef::covers_log_of`)
/// on both stores, events published on several partitions of one log:
/// nothing goes inside the replay window; past it, a mandatory consumer
/// without a watermark holds everything, and so does one whose watermark
/// has not passed an event's offset, or whose watermarks are on another
/// cluster's topic of the same name or on another topic id; once its
/// watermark on the very log has passed an event, the event is PURGED (a
/// tombstone: the row and its receipt stay, the payload goes). A consumer
/// that is not mandatory, or reads another topic, holds nothing.
async fn purge_waits_for_mandatory_watermarks<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    const W: i64 = 60_000;
    let counts = |retained, purged, held| PurgeCounts { retained, purged, held };
    // Whatever earlier scenarios published goes first, so the counts below are this scenario's.
    c.h.advance_ms(W + 1);
    c.h.purge(W, &[], &[]).await?;
    let mut events: Vec<(EventId, BrokerReceipt, Vec<u8>)> = Vec::new();
    for n in 0..64u32 {
        let id = c.emit(n, &format!("p{n}")).await;
        let ce = c.claim_some("w1", &id).await?;
        let a = c.register(&ce.token).await?;
        let r = receipt(&ce, &a, c.offset(i64::from(n)));
        eq("publish", c.accept(&r).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
        events.push((id, r, ce.payload.clone()));
        let mut partitions: Vec<i32> = events.iter().map(|e| e.1.partition).collect();
        partitions.sort_unstable();
        partitions.dedup();
        if events.len() >= 6 && partitions.len() >= 2 {
            break;
        }
    }
    let first = &events[0].1;
    let (cluster, topic, topic_id, p_a) = (first.cluster_id.clone(), first.topic.clone(), first.topic_id.clone(), first.partition);
    ensure(events.iter().all(|e| (&e.1.cluster_id, &e.1.topic, &e.1.topic_id) == (&cluster, &topic, &topic_id)), || "the events are not on one log".into())?;
    ensure(events.iter().any(|e| e.1.partition != p_a), || "the events are on one partition".into())?;
    let n = events.len() as u64;
    let mut partitions: Vec<i32> = events.iter().map(|e| e.1.partition).collect();
    partitions.sort_unstable();
    partitions.dedup();
    let last_on = |p: i32| events.iter().filter(|e| e.1.partition == p).map(|e| e.1.offset).max().unwrap_or(0);
    let wm = |cluster_id: &str, topic_id: Option<&str>, partition: i32, committed_offset: i64| MemoryWatermark {
        consumer_id: format!("{}-m", c.prefix),
        cluster_id: cluster_id.into(),
        topic: topic.clone(),
        topic_id: topic_id.map(Into::into),
        partition,
        committed_offset,
    };
    let (m, o, x, other_topic) = (format!("{}-m", c.prefix), format!("{}-o", c.prefix), format!("{}-x", c.prefix), format!("{}-other", c.prefix));
    let (on_topic, on_other): (&[&str], &[&str]) = (&[topic.as_str()], &[other_topic.as_str()]);
    let mandatory = [(m.as_str(), on_topic, true)];
    let check = |stage: &'static str, held: Vec<bool>| {
        let events = &events;
        async move {
            for ((id, r, payload), held) in events.iter().zip(held) {
                let (state, slot) = c.state(id).await?;
                let want = if held { EventState::Retained } else { EventState::Purged };
                eq(&format!("{stage}: {id} on partition {} at {}", r.partition, r.offset), state, want)?;
                eq(&format!("{stage}: {id}'s receipt"), slot.as_ref(), Some(r))?;
                let want = if held { Some(payload.clone()) } else { None };
                eq(&format!("{stage}: {id}'s payload"), c.h.payload(id).await, want)?;
            }
            Ok::<_, String>(())
        }
    };

    eq("inside the replay window", c.h.purge(W, &mandatory, &[]).await?, counts(0, 0, 0))?;
    for (id, _, _) in &events {
        c.expect_state(id, EventState::Published).await?;
    }
    c.h.advance_ms(W + 1);
    eq("no watermark", c.h.purge(W, &mandatory, &[]).await?, counts(n, 0, n))?;
    check("no watermark", vec![true; events.len()]).await?;

    // Far along every partition of another cluster's topic of the same
    // name, and of another topic id on this cluster; on this very log, at
    // the first event's offset (not past it) on its partition only.
    let other_id = if topic_id.as_deref() == Some("AAECAwQFBgcICQoLDA0ODw") { "_____________________w" } else { "AAECAwQFBgcICQoLDA0ODw" };
    let tid = topic_id.as_deref();
    let other_cluster = format!("{cluster}-b");
    let elsewhere: Vec<MemoryWatermark> = partitions.iter().flat_map(|&p| [wm(&other_cluster, tid, p, i64::MAX), wm(&cluster, Some(other_id), p, i64::MAX)]).collect();
    let here = |committed: &dyn Fn(i32) -> i64| elsewhere.iter().cloned().chain(partitions.iter().map(|&p| wm(&cluster, tid, p, committed(p)))).collect::<Vec<_>>();
    let mut behind = elsewhere.clone();
    behind.push(wm(&cluster, tid, p_a, events[0].1.offset));
    eq("watermarks not past, or of other logs", c.h.purge(W, &mandatory, &behind).await?, counts(0, 0, n))?;
    check("watermarks not past, or of other logs", vec![true; events.len()]).await?;

    // Past every event of the first partition; on each other partition at
    // its last event's offset: that one is held, the ones before it go.
    // A consumer that is not mandatory, without watermarks, and a mandatory
    // one of another topic hold nothing.
    let partly = here(&|p| if p == p_a { last_on(p) + 1 } else { last_on(p) });
    let held: Vec<bool> = events.iter().map(|e| e.1.partition != p_a && e.1.offset == last_on(e.1.partition)).collect();
    let still = held.iter().filter(|h| **h).count() as u64;
    let registry = [(m.as_str(), on_topic, true), (o.as_str(), on_topic, false), (x.as_str(), on_other, true)];
    eq("partly passed", c.h.purge(W, &registry, &partly).await?, counts(0, n - still, still))?;
    check("partly passed", held).await?;

    let passed = here(&|p| last_on(p) + 1);
    eq("all passed", c.h.purge(W, &registry, &passed).await?, counts(0, still, 0))?;
    check("all passed", vec![false; events.len()]).await?;
    eq("nothing left", c.h.purge(W, &registry, &passed).await?, counts(0, 0, 0))
}

/// The registration floor (`advance_floor`) on both stores: an attempt
/// registered after a receipt of its partition's log records the offset
/// past that receipt, anchored at the receipt's event and attempt; a lower receipt
/// later (a late ACK of an older write) does not lower it. (The last
/// scenario of a run: its offsets are the highest of the run.)
async fn registration_floor<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    let first = c.emit(1, "k").await;
    let ce1 = c.claim_some("w1", &first).await?;
    let a1 = c.register(&ce1.token).await?;
    c.accept(&receipt(&ce1, &a1, c.offset(500))).await?;
    let second = c.emit(2, "k").await;
    let ce2 = c.claim_some("w1", &second).await?;
    eq("one partition", ce2.destination.partition, ce1.destination.partition)?;
    let a2 = c.register(&ce2.token).await?;
    eq("the second attempt's floor", (a2.scan_from_offset, a2.scan_anchor.clone()), (c.offset(500) + 1, Some(first.clone())))?;
    eq("its anchor's attempt", a2.scan_anchor_attempt.clone(), Some(a1.attempt_id.clone()))?;
    c.accept(&receipt(&ce2, &a2, c.offset(400))).await?;
    let third = c.emit(3, "k").await;
    let ce3 = c.claim_some("w1", &third).await?;
    let a3 = c.register(&ce3.token).await?;
    eq("after a lower receipt", (a3.scan_from_offset, a3.scan_anchor.clone(), a3.scan_anchor_attempt.clone()), (c.offset(500) + 1, Some(first), Some(a1.attempt_id.clone())))?;
    c.accept(&receipt(&ce3, &a3, c.offset(501))).await.map(|_| ())
}

/// A broker whose topic holds only the messages a scenario put there, per
/// partition (each page ends just past its last offset); other partitions
/// and topics cannot be read. For the bypass scan ([`Harness::bypass_scan`]).
#[derive(Debug, Clone, Default)]
pub struct ScanLog {
    /// Its cluster.
    pub cluster_id: String,
    /// Its topic.
    pub topic: String,
    /// Messages per partition, in offset order.
    pub partitions: std::collections::BTreeMap<i32, Vec<crate::store::ScannedMessage>>,
    /// Per partition, the log's start where retention moved it (else 0):
    /// a scan reads nothing below it.
    pub starts: std::collections::BTreeMap<i32, i64>,
}

#[async_trait]
impl crate::store::Broker for ScanLog {
    fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    async fn send(&self, _message: crate::store::OutgoingMessage) -> crate::store::SendOutcome {
        crate::store::SendOutcome::NotPersisted("a scan log takes no sends".into())
    }

    fn supports_lookup(&self) -> bool {
        false
    }

    async fn lookup(&self, _destination: &crate::envelope::Destination, _event_id: &EventId, _from: &crate::reconcile::ScanFrom) -> LookupOutcome {
        LookupOutcome::Unavailable("a scan log answers no lookups".into())
    }

    async fn scan_event_ids(&self, topic: &str, partition: i32, from_offset: i64, max_messages: u64) -> Result<crate::store::PartitionScan, String> {
        let Some(log) = self.partitions.get(&partition).filter(|_| topic == self.topic) else { return Err(format!("{topic}/{partition} is not in the scan log")) };
        let start = self.starts.get(&partition).copied().unwrap_or(0);
        let end = log.last().map_or(0, |m| m.offset + 1).max(start);
        let from = from_offset.max(start);
        let messages: Vec<_> = log.iter().filter(|m| m.offset >= from).take(usize::try_from(max_messages).unwrap_or(usize::MAX)).cloned().collect();
        let next_offset = if messages.len() as u64 == max_messages { messages.last().map_or(from, |m| m.offset + 1) } else { from.max(end) };
        Ok(crate::store::PartitionScan { messages, next_offset, log_end: Some(end), log_start: Some(start) })
    }
}

/// The message a claimed event's attempt wrote at `offset`, as a scan reads it.
fn scanned(ce: &ClaimedEvent, attempt: &AttemptRecord, offset: i64, payload: &[u8]) -> crate::store::ScannedMessage {
    crate::store::ScannedMessage {
        offset,
        event_id: Some(ce.envelope.event_id.to_string()),
        key: Some(ce.destination.routing_key.clone().into_bytes()),
        payload_digest: sha256_digest(payload),
        source: None,
        attempt_id: Some(attempt.attempt_id.to_string()),
        topic_id: ce.destination.topic_id.clone(),
        receipt: Some(BrokerReceipt { payload_digest: sha256_digest(payload), ..receipt(ce, attempt, offset) }),
    }
}

/// The bypass scan's judgement of a page (`outbox_core::compare`), on both
/// stores through the shipped reconciler: a primary or duplicate receipt's
/// position is accounted; a copy with other bytes of a published event at
/// a position no receipt records is `divergent_copy`; a message of an event not published yet is left to
/// the reconciler; an unknown eventId is `bypass_publish`; a copy of an
/// open attempt within its in-flight bound is waited for (the cursor stays
/// at it) and, byte-identical, is `unrecorded_copy` once past it.
async fn bypass_scan_judgement<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    // A: published at offset 1; a copy with other bytes at 3.
    let a = c.emit(1, "a").await;
    let ce_a = c.claim_some("w1", &a).await?;
    let a1 = c.register(&ce_a.token).await?;
    eq("A's ACK", c.accept(&receipt(&ce_a, &a1, c.offset(1))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    // B: a late ACK of its first attempt (offset 4) published it while its
    // retry is still open (SENDING, within its bound); the first attempt's
    // second copy (offset 6) is a duplicate receipt; the retry's copy at 5 has none.
    let b = c.emit(2, "b").await;
    let ce_b1 = c.claim_some("w1", &b).await?;
    let b1 = c.register(&ce_b1.token).await?;
    c.expire().await?;
    c.h.advance_ms(POLICY.in_flight_bound_ms);
    let task = c.reconcile("r1", &b).await?;
    let d = decide_reconcile(&task.attempts, &LookupOutcome::Unavailable("adapter cannot look up".into()), false, &POLICY, c.h.now_ms());
    eq("B's reconcile decision", &d, &ReconcileDecision::Retry { proven_absent: false })?;
    c.s().finish_reconcile(&task.token, &d).await.map_err(err("finish_reconcile"))?;
    let ce_b2 = c.claim_retry("w2", &b).await?;
    let b2 = c.register(&ce_b2.token).await?;
    eq("B's first attempt's late ACK", c.accept(&receipt(&ce_b1, &b1, c.offset(4))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    eq("B's first attempt's second copy", c.accept(&receipt(&ce_b1, &b1, c.offset(6))).await?, ReceiptDecision::Duplicate)?;
    // C: committed, not published.
    let pending = c.emit(3, "c").await;
    let ce_c = c.claim_some("w1", &pending).await?;
    let c1 = c.register(&ce_c.token).await?;
    // D: its attempt closed NOT_SENT (the broker refused), yet a copy of it
    // is in the log: whatever its event does next, the copy refutes that.
    let d = c.emit(4, "d").await;
    let ce_d = c.claim_some("w1", &d).await?;
    let d1 = c.register(&ce_d.token).await?;
    c.s().report_not_sent(&ce_d.token, &d1.attempt_id, "refused").await.map_err(err("report_not_sent"))?;
    let unknown = EventId::generate(c.h.now_ms() as u64).to_string();

    let mut log = ScanLog { cluster_id: ce_a.destination.cluster_id.clone(), topic: ce_a.destination.topic.clone(), ..Default::default() };
    let mut put = |ce: &ClaimedEvent, m: crate::store::ScannedMessage| log.partitions.entry(ce.destination.partition).or_default().push(m);
    put(&ce_a, scanned(&ce_a, &a1, c.offset(1), &ce_a.payload));
    put(&ce_a, scanned(&ce_a, &a1, c.offset(3), b"other bytes"));
    put(&ce_b1, scanned(&ce_b1, &b1, c.offset(4), &ce_b1.payload));
    put(&ce_b2, scanned(&ce_b2, &b2, c.offset(5), &ce_b2.payload));
    put(&ce_b1, scanned(&ce_b1, &b1, c.offset(6), &ce_b1.payload));
    put(&ce_b1, crate::store::ScannedMessage { event_id: Some(unknown.clone()), attempt_id: None, ..scanned(&ce_b1, &b1, c.offset(7), b"bypass") });
    put(&ce_c, scanned(&ce_c, &c1, c.offset(8), &ce_c.payload));
    put(&ce_d, scanned(&ce_d, &d1, c.offset(9), &ce_d.payload));
    for page in log.partitions.values_mut() {
        page.sort_by_key(|m| m.offset);
    }
    let end = |p: i32| log.partitions[&p].last().map_or(0, |m| m.offset + 1);
    let ours = |findings: &[(String, String)]| -> Vec<(String, String)> {
        let mut f: Vec<(String, String)> =
            findings.iter().filter(|(_, e)| [a.as_str(), b.as_str(), pending.as_str(), d.as_str(), unknown.as_str()].contains(&e.as_str())).cloned().collect();
        f.sort();
        f.dedup();
        f
    };
    let pair = |k: &str, e: &str| (k.to_owned(), e.to_owned());

    let ScanOutcome { findings, cursors, submitted } = c.h.bypass_scan(&log).await?;
    eq("nothing handed to the receipt transaction while answers may come", submitted, 0)?;
    let mut want = vec![pair("divergent_copy", a.as_str()), pair("bypass_publish", &unknown), pair("absence_proof_refuted", d.as_str())];
    want.sort();
    eq("findings while B's retry may still be answered", ours(&findings), want)?;
    eq("the cursor waits at the copy of B's open retry", cursors[&ce_b2.destination.partition], c.offset(5))?;
    // (C's copy, of an attempt still within its bound, is waited for too.)
    if ce_a.destination.partition != ce_b2.destination.partition && ce_a.destination.partition != ce_c.destination.partition {
        eq("A's partition is read to its end", cursors[&ce_a.destination.partition], end(ce_a.destination.partition))?;
    }

    c.h.advance_ms(POLICY.in_flight_bound_ms + LEASE_MS);
    let ScanOutcome { findings, cursors, submitted } = c.h.bypass_scan(&log).await?;
    eq("C's copy, the one past its bound of an unpublished event, is handed to the receipt transaction", submitted, 1)?;
    ensure(ours(&findings).contains(&pair("unrecorded_copy", b.as_str())), || format!("B's retry's copy past its bound is unrecorded_copy; findings {findings:?}"))?;
    // (D's copy is read again where it shares B's partition past the
    // waiting cursor: the same finding again, which a store keeps once.)
    ensure(!ours(&findings).iter().any(|(_, e)| e == a.as_str() || e == pending.as_str()), || format!("nothing read again of A, nothing of C; findings {findings:?}"))?;
    eq("the cursor passes the judged copy", cursors[&ce_b2.destination.partition], end(ce_b2.destination.partition))?;
    // C's copy, past its bound with C still unpublished, is what a lookup
    // would find: the scan handed it to the receipt transaction.
    c.expect_state(&pending, EventState::Published).await?;

    // E: B's partition's log replaced (a cluster come back empty, a topic
    // recreated) and grown past the cursor before the scan came back: the
    // offset alone cannot tell. The message below the cursor is another
    // one, so the new log is read from its start, and what it holds below
    // the old cursor is judged.
    let p = ce_b2.destination.partition;
    let at = cursors[&p];
    let (low, below) = (EventId::generate(c.h.now_ms() as u64).to_string(), EventId::generate(c.h.now_ms() as u64).to_string());
    let stray = |id: &str, offset: i64| crate::store::ScannedMessage { event_id: Some(id.to_owned()), attempt_id: None, receipt: None, ..scanned(&ce_b1, &b1, offset, b"another log") };
    let replaced = ScanLog { partitions: [(p, vec![stray(&low, c.offset(2)), stray(&below, at - 1)])].into_iter().collect(), ..log.clone() };
    let ScanOutcome { findings, cursors, .. } = c.h.bypass_scan(&replaced).await?;
    eq("a log holding another message below the cursor is read again from its start", cursors[&p], 0)?;
    ensure(findings.iter().all(|(_, e)| *e != low && *e != below), || format!("the restart judges nothing yet; findings {findings:?}"))?;
    let ScanOutcome { findings, cursors, .. } = c.h.bypass_scan(&replaced).await?;
    let mut seen: Vec<(String, String)> = findings.into_iter().filter(|(_, e)| *e == low || *e == below).collect();
    seen.sort();
    let mut want = vec![pair("bypass_publish", &low), pair("bypass_publish", &below)];
    want.sort();
    eq("the new log's messages below the old cursor are judged", seen, want)?;
    eq("the new log is read to its end", cursors[&p], at)?;

    // F: retention deletes offsets of that log before the scan reads them:
    // the scan says which (`scan_gap`), once, and reads on from the log's
    // start.
    let (gone, kept) = (EventId::generate(c.h.now_ms() as u64).to_string(), EventId::generate(c.h.now_ms() as u64).to_string());
    let mut truncated = replaced.clone();
    truncated.partitions.entry(p).or_default().extend([stray(&gone, at), stray(&kept, at + 1)]);
    truncated.starts.insert(p, at + 1);
    let ScanOutcome { findings, cursors, .. } = c.h.bypass_scan(&truncated).await?;
    let gap = pair(crate::compare::SCAN_GAP, &crate::compare::scan_gap_label(&log.topic, p, (at, at + 1)));
    ensure(findings.contains(&gap), || format!("the deleted offsets are a scan_gap; findings {findings:?}"))?;
    ensure(!findings.iter().any(|(_, e)| *e == gone) && findings.contains(&pair("bypass_publish", &kept)), || format!("the deleted message is not judged, the kept one is; findings {findings:?}"))?;
    eq("the cursor moves past the gap to the log's end", cursors[&p], at + 2)?;
    let ScanOutcome { findings, .. } = c.h.bypass_scan(&truncated).await?;
    ensure(!findings.contains(&gap), || format!("the gap is said once; findings {findings:?}"))
}

/// What one bypass scan of [`Harness::bypass_scan`] left.
#[derive(Debug, Clone, Default)]
pub struct ScanOutcome {
    /// The findings it recorded: (kind, event id).
    pub findings: Vec<(String, String)>,
    /// The store's scan cursor of each partition after it.
    pub cursors: std::collections::BTreeMap<i32, i64>,
    /// Copies it handed to the receipt transaction.
    pub submitted: usize,
}

/// The comparison's condition findings (`outbox_core::findings`), on both
/// stores through the shipped reconciler: an old PENDING event is
/// `aged_pending`, a young one is not; a DISPATCH_UNKNOWN past the SLO is
/// `unknown_past_slo`; a quarantined event is `quarantined`; a published
/// event is `unconsumed_published` for a critical consumer whose watermark
/// is on another cluster's log, on another topic id, or at the event's
/// offset (behind it), and not for one whose watermark passed it. The next
/// round resolves the findings whose condition no longer holds (the
/// consumer caught up, the aged event was published) and keeps the others.
async fn comparison_findings<H: Harness>(c: &Ctx<'_, H>) -> Verdict {
    use crate::findings::{AGED_PENDING, QUARANTINED, UNCONSUMED_PUBLISHED, UNKNOWN_PAST_SLO};
    const T: i64 = 10_000;
    let th = FindingThresholds { aged_pending_ms: T, unknown_slo_ms: T, unconsumed_after_ms: T };
    // U: its send's outcome is unknown (the lease ran out while SENDING).
    let u = c.emit(1, "u").await;
    let ce_u = c.claim_some("w1", &u).await?;
    c.register(&ce_u.token).await?;
    c.expire().await?;
    c.expect_state(&u, EventState::DispatchUnknown).await?;
    // P: published at offset 10 of its log.
    let p = c.emit(2, "p").await;
    let ce_p = c.claim_some("w1", &p).await?;
    let a_p = c.register(&ce_p.token).await?;
    eq("P's ACK", c.accept(&receipt(&ce_p, &a_p, c.offset(10))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    // Q: quarantined by its dispatcher.
    let q = c.emit(3, "q").await;
    let ce_q = c.claim_some("w1", &q).await?;
    let out = c.s().quarantine_claimed(&ce_q.token, "conformance", serde_json::json!({})).await.map_err(err("quarantine_claimed"))?;
    eq("Q's quarantine", out, FenceOutcome::Applied)?;
    // O: PENDING past the threshold; Y: PENDING within it.
    let o = c.emit(4, "o").await;
    c.h.advance_ms(T + 1);
    let y = c.emit(5, "y").await;

    let d = &ce_p.destination;
    let other_topic_id = if d.topic_id.is_some() { None } else { Some("AAAAAAAAAAAAAAAAAAAAAQ".to_owned()) };
    let consumer = |n: &str| format!("{}-{n}", c.prefix);
    let (other_cluster, other_id, behind, passed) = (consumer("othercluster"), consumer("othertopicid"), consumer("behind"), consumer("passed"));
    let wm = |consumer_id: &str, cluster_id: &str, topic_id: Option<String>, committed_offset: i64| crate::store::ConsumerWatermark {
        consumer_id: consumer_id.to_owned(),
        cluster_id: cluster_id.to_owned(),
        topic: d.topic.clone(),
        topic_id,
        partition: d.partition,
        committed_offset,
    };
    let at = c.offset(10);
    let consumers: Vec<(String, Vec<String>)> = [&other_cluster, &other_id, &behind, &passed].iter().map(|id| ((*id).clone(), vec![d.topic.clone()])).collect();
    let watermarks = vec![
        wm(&other_cluster, "conformance-other-cluster", d.topic_id.clone(), at + 1_000),
        wm(&other_id, &d.cluster_id, other_topic_id, at + 1_000),
        wm(&behind, &d.cluster_id, d.topic_id.clone(), at),
        wm(&passed, &d.cluster_id, d.topic_id.clone(), at + 1),
    ];
    let ours = |open: Vec<(String, String, String)>| -> Vec<(String, String, String)> {
        // Critical consumers of other runs on a shared store read the topic too.
        let mine = [u.as_str(), p.as_str(), q.as_str(), o.as_str(), y.as_str()];
        let our_consumers = ["", other_cluster.as_str(), other_id.as_str(), behind.as_str(), passed.as_str()];
        let mut f: Vec<_> = open.into_iter().filter(|(_, e, c)| mine.contains(&e.as_str()) && our_consumers.contains(&c.as_str())).collect();
        f.sort();
        f
    };
    let finding = |kind: &str, e: &EventId, consumer: &str| (kind.to_owned(), e.to_string(), consumer.to_owned());
    let sorted = |mut v: Vec<(String, String, String)>| {
        v.sort();
        v
    };

    let open = ours(c.h.compare_findings(&th, &consumers, &watermarks).await?);
    let want = sorted(vec![
        finding(AGED_PENDING, &o, ""),
        finding(UNKNOWN_PAST_SLO, &u, ""),
        finding(QUARANTINED, &q, ""),
        finding(UNCONSUMED_PUBLISHED, &p, &other_cluster),
        finding(UNCONSUMED_PUBLISHED, &p, &other_id),
        finding(UNCONSUMED_PUBLISHED, &p, &behind),
    ]);
    eq("open findings after the first round", open, want)?;

    // The lagging consumer passes P; O is published.
    let ce_o = c.claim_some("w1", &o).await?;
    let a_o = c.register(&ce_o.token).await?;
    eq("O's ACK", c.accept(&receipt(&ce_o, &a_o, c.offset(11))).await?, ReceiptDecision::Accept { from: EventState::Sending })?;
    let open = ours(c.h.compare_findings(&th, &consumers, &[wm(&behind, &d.cluster_id, d.topic_id.clone(), at + 1)]).await?);
    let want = sorted(vec![
        finding(UNKNOWN_PAST_SLO, &u, ""),
        finding(QUARANTINED, &q, ""),
        finding(UNCONSUMED_PUBLISHED, &p, &other_cluster),
        finding(UNCONSUMED_PUBLISHED, &p, &other_id),
    ]);
    eq("open findings after the second round", open, want)
}
