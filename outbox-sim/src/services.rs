//! The services engine: one trace runs the shipped
//! `outbox_producer::Dispatcher` and
//! `outbox_producer::Reconciler` (their own loops: `run` and
//! `run_resolving`) over the in-memory store, against a simulated broker, on
//! a seeded single-threaded executor in virtual time.
//!
//! Faults are injected at the seams the services talk through:
//! - the store ([`SimStore`]): calls that fail before doing anything, that
//!   commit and lose their answer, and that stall (a paused process, a
//!   stuck connection) for up to two leases;
//! - the broker ([`SimBroker`]): refused sends (not persisted), requests
//!   that never reach the log and time out, writes whose ACK is lost, ACKs
//!   delivered late (after the lease), writes the client repeats, failed
//!   lookups; the client keeps writing what it was handed after its process
//!   died, within the message timeout;
//! - processes: dispatchers and the reconciler killed at any await (their
//!   task dropped, so every worker stops) and restarted under a new owner.
//!
//! Then faults stop, the services run until every event is settled, and the
//! checks read the store and the log (names as Jepsen's Kafka checker uses
//! them where they apply): `lost_write` (an event committed and not
//! published, or whose receipt's position does not hold it), `duplicate` (a
//! copy in the log from an attempt the store has no receipt of), and
//! `refuted_absence` (a copy of an attempt the store closed as not sent or
//! proven absent), `inconsistent_offsets` (two events' receipts at one
//! position), `order_violation` (a key's events published out of commit
//! order), `unresolved_unknown` (an outcome still unknown after the run).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::memory::MemoryStore;
use outbox_core::{
    headers, sha256_digest, AttemptId, AttemptRecord, AttemptState, Broker, BrokerReceipt, ClaimToken, ClaimedEvent, Destination, EmitRequest, EventId,
    EventState, FenceOutcome, LookupOutcome, OutboxStore, OutgoingMessage, ReceiptOutcome, ReconcileDecision, ReconcileTask, RetryPolicy, RoutePolicy,
    SendOutcome, StoreError, SweepOutcome,
};
use outbox_producer::service_store::{ClaimRound, ServiceStore};
use outbox_producer::{Dispatcher, DispatcherConfig, Reconciler, ReconcilerConfig};
use tokio::time::Instant;

use crate::rng::Rng;

/// Simulated time at the start of every trace (ms since the epoch).
const T0_MS: i64 = 1_700_000_000_000;
/// The dispatchers' and the reconciler's lease.
const LEASE_MS: i64 = 10_000;
/// The broker client's message timeout: a message handed to it is written
/// within this long, or never.
const MESSAGE_TIMEOUT_MS: i64 = 5_000;
const CLUSTER: &str = "sim-cluster";
const TOPIC: &str = "orders";
const PARTITIONS: u32 = 3;
/// Virtual time the faults last, from the first event.
const FAULT_PHASE_MS: i64 = 40_000;
/// Longest fault-free phase before a trace counts as stuck.
const SETTLE_LIMIT_MS: i64 = 3_600_000;

/// Deliberate defects in shipped code, each switched by
/// [`outbox_core::simulation::mutation_active`] at one line.
pub const SERVICE_MUTATIONS: [(&str, &str); 3] = [
    ("send-after-lease", "the dispatcher hands a message to the client after its claim's lease ran out"),
    ("bound-from-registration-clock", "the in-flight bound counts from the attempt's registration, not from the end of the lease it was sent under"),
    ("absence-from-truncated-log", "a lookup range below the log's start (or above its end) proves absence"),
];

/// Fault probabilities of one trace.
#[derive(Debug, Clone, Copy)]
pub struct ServiceFaults {
    /// A store call fails before doing anything.
    pub store_fail: f64,
    /// A store call commits and its answer is lost.
    pub store_answer_lost: f64,
    /// A store call stalls (a paused process, a stuck connection: up to
    /// four leases), before the call or after its commit.
    pub store_stall: f64,
    /// A store call commits and its answer comes late (up to one lease).
    pub answer_late: f64,
    /// A send is refused (definitely not persisted).
    pub not_persisted: f64,
    /// A send never reaches the log and times out.
    pub unsent_timeout: f64,
    /// A write lands and its ACK is lost.
    pub ack_lost: f64,
    /// The client writes the message twice.
    pub write_duplicated: f64,
    /// The write and its ACK come late (up to the message timeout).
    pub slow_write: f64,
    /// A lookup fails.
    pub lookup_fail: f64,
    /// Mean virtual ms between process kills (0: none).
    pub kill_every_ms: i64,
    /// When (virtual ms from the start) retention deletes every record of
    /// one partition written so far, if it does in this trace.
    pub truncate_at_ms: Option<i64>,
}

impl ServiceFaults {
    fn from_rng(rng: &mut Rng) -> Self {
        let mut p = |max: f64| if rng.chance(0.3) { 0.0 } else { rng.unit() * max };
        let f = ServiceFaults {
            store_fail: p(0.05),
            store_answer_lost: p(0.05),
            store_stall: p(0.03),
            answer_late: p(0.1),
            not_persisted: p(0.1),
            unsent_timeout: p(0.1),
            ack_lost: p(0.15),
            write_duplicated: p(0.05),
            slow_write: p(0.2),
            lookup_fail: p(0.2),
            kill_every_ms: 0,
            truncate_at_ms: None,
        };
        let kill_every_ms = if rng.chance(0.7) { rng.range(1_000, 8_000) } else { 0 };
        let truncate_at_ms = rng.chance(0.3).then(|| rng.range(1_000, FAULT_PHASE_MS));
        ServiceFaults { kill_every_ms, truncate_at_ms, ..f }
    }
}

/// One trace's shape, all drawn from its seed.
#[derive(Debug, Clone)]
pub struct ServiceTraceConfig {
    /// The seed.
    pub seed: u64,
    /// Events committed.
    pub events: usize,
    /// Routing keys (aggregates).
    pub keys: usize,
    /// Dispatcher processes.
    pub dispatchers: usize,
    /// Workers per dispatcher.
    pub workers: usize,
    /// Claim batch size.
    pub batch: usize,
    /// Faults.
    pub faults: ServiceFaults,
}

impl ServiceTraceConfig {
    /// The trace `seed` names.
    pub fn from_seed(seed: u64) -> Self {
        let mut rng = Rng::new(seed ^ 0x5e41_1ce5);
        ServiceTraceConfig {
            seed,
            events: rng.range(1, 24) as usize,
            keys: rng.range(1, 6) as usize,
            dispatchers: rng.range(1, 3) as usize,
            workers: rng.range(1, 2) as usize,
            batch: rng.range(1, 4) as usize,
            faults: ServiceFaults::from_rng(&mut rng),
        }
    }
}

/// Declares [`ServiceFigures`] from one list of its counters: informational
/// ones, then the violations (each must stay zero); merging, the
/// violations and the printed lines all follow the list.
macro_rules! service_figures {
    (info { $($(#[doc = $idoc:expr])* $info:ident,)* } violations { $($(#[doc = $vdoc:expr])* $violation:ident,)* }) => {
        /// Counters of one or many traces.
        #[derive(Debug, Clone, Default, PartialEq, Eq)]
        pub struct ServiceFigures {
            $($(#[doc = $idoc])* pub $info: u64,)*
            $($(#[doc = $vdoc])* pub $violation: u64,)*
        }

        impl ServiceFigures {
            /// Adds `o`.
            pub fn merge(&mut self, o: &ServiceFigures) {
                $(self.$info += o.$info;)*
                $(self.$violation += o.$violation;)*
            }

            /// Violations: every one must be zero.
            pub fn violations(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($violation), self.$violation)),*]
            }

            fn info(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($info), self.$info)),*]
            }
        }
    };
}

service_figures! {
    info {
        /// Traces run.
        traces,
        /// Events committed.
        events,
        /// Events published.
        published,
        /// Events quarantined.
        quarantined,
        /// Attempts registered.
        attempts,
        /// Attempts whose outcome became unknown (and was resolved).
        unknown_attempts,
        /// Process kills.
        kills,
        /// Store faults injected.
        store_faults,
        /// Broker faults injected.
        broker_faults,
        /// Copies in the log beyond one per event (all accounted for).
        duplicates_in_log,
        /// Partitions truncated by retention while events were in flight.
        truncations,
        /// Unknown outcomes left unresolved and reported (the log that could
        /// prove them was truncated: the finding `log_unavailable`).
        unknown_reported,
    }
    violations {
        /// Committed events not published, or published at a position that does not hold them.
        lost_write,
        /// Copies from attempts the store holds no receipt of.
        duplicate,
        /// Copies of attempts the store closed as not sent or proven absent.
        refuted_absence,
        /// Positions holding receipts of two events.
        inconsistent_offsets,
        /// A key's events published out of commit order.
        order_violation,
        /// Unknown outcomes left after the run.
        unresolved_unknown,
        /// Traces that did not settle.
        stuck,
    }
}

impl ServiceFigures {
    /// Whether no violation was counted.
    pub fn clean(&self) -> bool {
        self.violations().iter().all(|(_, v)| *v == 0)
    }

    /// `name value` lines, the informational counters first.
    pub fn lines(&self) -> Vec<String> {
        self.info().into_iter().chain(self.violations()).map(|(n, v)| format!("services.{n} {v}")).collect()
    }
}

/// What one services trace produced.
#[derive(Debug, Clone)]
pub struct ServiceOutcome {
    /// The seed.
    pub seed: u64,
    /// Its counters.
    pub figures: ServiceFigures,
    /// The violations, in words.
    pub violations: Vec<String>,
    /// The trace's log, when asked for.
    pub log: Option<Vec<String>>,
}

// ---------------------------------------------------------------------------
// The world the services run in

/// Shared by the store, the broker and the driver of one trace.
struct World {
    rng: Rng,
    faults: ServiceFaults,
    /// Whether faults are injected now.
    on: bool,
    start: Instant,
    figures: ServiceFigures,
    log: Option<Vec<String>>,
    /// Per partition, every message written, in order (including those
    /// retention deleted since: consumers may have read them).
    logs: BTreeMap<i32, Vec<Stored>>,
    /// Per partition, the first offset still in the log.
    log_start: BTreeMap<i32, i64>,
    /// Findings the services recorded: (kind, event id).
    findings: Vec<(String, String)>,
    /// Client requests not answered yet (the log may still change).
    in_client: usize,
}

#[derive(Debug, Clone)]
struct Stored {
    event_id: String,
    attempt_id: String,
    headers: Vec<(String, Vec<u8>)>,
    payload: Vec<u8>,
}

impl World {
    fn now_ms(&self) -> i64 {
        T0_MS + i64::try_from(self.start.elapsed().as_millis()).unwrap_or(i64::MAX / 2)
    }

    fn note(&mut self, line: impl FnOnce() -> String) {
        if self.log.is_some() {
            let at = self.now_ms() - T0_MS;
            let line = line();
            if let Some(log) = &mut self.log {
                log.push(format!("{at:>8} ms  {line}"));
            }
        }
    }
}

type Shared = Arc<Mutex<World>>;

fn world(w: &Shared) -> std::sync::MutexGuard<'_, World> {
    w.lock().unwrap_or_else(|p| p.into_inner())
}

// ---------------------------------------------------------------------------
// The store seam

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
    inner: MemoryStore,
    world: Shared,
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
    fn sync_clock(&self) {
        let now = world(&self.world).now_ms();
        self.inner.set_now_ms(now);
    }

    /// Before a call: maybe stall, maybe fail; returns the fault and the
    /// stall to take after the call (a commit whose answer comes late).
    async fn before(&self, what: &str) -> Result<(StoreFault, u64), StoreError> {
        let (stall, stall_after, fault) = {
            let mut w = world(&self.world);
            if !w.on {
                (0, false, StoreFault::None)
            } else {
                let f = w.faults;
                // A stall is a process paused (GC, VM) or a connection stuck,
                // up to four leases, before the call or after its commit.
                let (stall, stall_after) = if w.rng.chance(f.store_stall) {
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

    async fn after<T>(&self, (fault, stall): (StoreFault, u64), what: &str, r: Result<T, StoreError>) -> Result<T, StoreError> {
        if stall > 0 {
            tokio::time::sleep(Duration::from_millis(stall)).await;
            self.sync_clock();
        }
        match (fault, r) {
            (StoreFault::AnswerLost, Ok(_)) => Err(lost(what)),
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
        faulty!(self, "accept_dispatch_receipt", self.inner.accept_dispatch_receipt(receipt))
    }
    async fn register_attempts(&self, tokens: &[ClaimToken]) -> Result<Vec<Result<AttemptRecord, StoreError>>, StoreError> {
        faulty!(self, "register_attempts", self.inner.register_attempts(tokens))
    }
    async fn accept_dispatch_receipts(&self, receipts: &[BrokerReceipt]) -> Result<Vec<ReceiptOutcome>, StoreError> {
        faulty!(self, "accept_dispatch_receipts", self.inner.accept_dispatch_receipts(receipts))
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
        faulty!(self, "finish_reconcile", self.inner.finish_reconcile(token, decision))
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

// ---------------------------------------------------------------------------
// The broker seam

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Written,
    Refused,
    NeverWritten,
    AckLost,
    WrittenTwice,
}

/// A Kafka-like log per partition behind a client that owns each request
/// until it is answered: what it was handed is written (or not) whether or
/// not the process that sent it is still alive.
pub struct SimBroker {
    world: Shared,
}

impl SimBroker {
    fn write(w: &mut World, m: &OutgoingMessage) -> i64 {
        let find = |name: &str| m.headers.iter().rev().find(|(k, _)| k == name).map(|(_, v)| String::from_utf8_lossy(v).into_owned()).unwrap_or_default();
        let stored = Stored { event_id: find(headers::EVENT_ID), attempt_id: find(headers::ATTEMPT_ID), headers: m.headers.clone(), payload: m.payload.clone() };
        let log = w.logs.entry(m.partition).or_default();
        log.push(stored);
        let offset = log.len() as i64 - 1;
        let (e, a) = (find(headers::EVENT_ID), find(headers::ATTEMPT_ID));
        w.note(|| format!("log p{}@{offset}: {e} attempt {a}", m.partition));
        offset
    }
}

#[async_trait]
impl Broker for SimBroker {
    fn cluster_id(&self) -> &str {
        CLUSTER
    }

    async fn send(&self, message: OutgoingMessage) -> SendOutcome {
        let (fate, write_after, answer_after) = {
            let mut w = world(&self.world);
            let f = w.faults;
            let on = w.on;
            let mut pick = |p: f64| on && w.rng.chance(p);
            let fate = if pick(f.not_persisted) {
                Fate::Refused
            } else if pick(f.unsent_timeout) {
                Fate::NeverWritten
            } else if pick(f.ack_lost) {
                Fate::AckLost
            } else if pick(f.write_duplicated) {
                Fate::WrittenTwice
            } else {
                Fate::Written
            };
            let slow = pick(f.slow_write);
            let write_after = if slow { w.rng.range(1, MESSAGE_TIMEOUT_MS) } else { w.rng.range(1, 20) };
            let answer_after = match fate {
                Fate::NeverWritten | Fate::AckLost => MESSAGE_TIMEOUT_MS,
                _ => write_after,
            };
            if fate != Fate::Written || slow {
                w.figures.broker_faults += 1;
            }
            w.in_client += 1;
            w.note(|| format!("client takes p{} ({fate:?}, write in {write_after} ms)", message.partition));
            (fate, write_after, answer_after)
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let world_ref = self.world.clone();
        // The client: lives on whether or not the sender does.
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(write_after as u64)).await;
            let mut written = None;
            {
                let mut w = world(&world_ref);
                match fate {
                    Fate::Written | Fate::AckLost => written = Some(SimBroker::write(&mut w, &message)),
                    Fate::WrittenTwice => {
                        SimBroker::write(&mut w, &message);
                        written = Some(SimBroker::write(&mut w, &message));
                    }
                    Fate::Refused | Fate::NeverWritten => {}
                }
            }
            if answer_after > write_after {
                tokio::time::sleep(Duration::from_millis((answer_after - write_after) as u64)).await;
            }
            let outcome = match (fate, written) {
                (Fate::Refused, _) => SendOutcome::NotPersisted("simulated: refused".into()),
                (Fate::NeverWritten | Fate::AckLost, _) | (_, None) => SendOutcome::Unknown("simulated: message timed out".into()),
                (_, Some(offset)) => SendOutcome::Acked { partition: message.partition, offset },
            };
            world(&world_ref).in_client -= 1;
            let _ = tx.send(outcome);
        });
        rx.await.unwrap_or_else(|_| SendOutcome::Unknown("simulated: client gone".into()))
    }

    fn supports_lookup(&self) -> bool {
        true
    }

    fn max_in_flight_ms(&self) -> Option<u64> {
        Some(MESSAGE_TIMEOUT_MS as u64)
    }

    async fn lookup(&self, destination: &Destination, event_id: &EventId, from: &outbox_core::ScanFrom) -> LookupOutcome {
        let mut w = world(&self.world);
        let p = w.faults.lookup_fail;
        if w.on && w.rng.chance(p) {
            w.figures.broker_faults += 1;
            return LookupOutcome::Unavailable("simulated: lookup failed".into());
        }
        let start = w.log_start.get(&destination.partition).copied().unwrap_or(0);
        let end = w.logs.get(&destination.partition).map_or(0, |l| l.len() as i64);
        // The anchor check as the Kafka adapter makes it, decided by the same core function.
        let check = match &from.anchor {
            Some(anchor) if from.offset > 0 => {
                let at = from.offset - 1;
                if at >= end {
                    outbox_core::AnchorCheck::BeyondEnd
                } else if at < start {
                    outbox_core::AnchorCheck::NoRecord
                } else {
                    match w.logs.get(&destination.partition).and_then(|l| l.get(at as usize)) {
                        Some(m) if m.event_id == anchor.as_str() => outbox_core::AnchorCheck::Holds,
                        Some(_) => outbox_core::AnchorCheck::HoldsOther,
                        None => outbox_core::AnchorCheck::NoRecord,
                    }
                }
            }
            _ => outbox_core::AnchorCheck::NoAnchor,
        };
        let plan = match outbox_core::plan_absence_scan(&destination.topic, destination.partition, from, start, end, check) {
            Ok(plan) => plan,
            Err(why) => return LookupOutcome::Unavailable(why),
        };
        let Some(log) = w.logs.get(&destination.partition) else { return LookupOutcome::Absent };
        let from = usize::try_from(plan.start.max(start).max(0)).unwrap_or(usize::MAX);
        let mut found = Vec::new();
        for (offset, m) in log.iter().enumerate().skip(from) {
            if m.event_id != event_id.as_str() {
                continue;
            }
            let Ok(claims) = headers::parse(&m.headers) else { continue };
            found.push(BrokerReceipt {
                event_id: claims.event_id,
                envelope_generation: claims.envelope_generation,
                attempt_id: claims.attempt_id,
                payload_digest: sha256_digest(&m.payload),
                destination_digest: claims.destination_digest,
                cluster_id: CLUSTER.into(),
                topic: destination.topic.clone(),
                topic_id: claims.destination.topic_id.clone(),
                partition: destination.partition,
                offset: offset as i64,
            });
        }
        if found.is_empty() {
            LookupOutcome::Absent
        } else {
            LookupOutcome::Found(found)
        }
    }
}

// ---------------------------------------------------------------------------
// One trace

/// Runs the services trace `seed` names; `mutation` switches one defect of
/// [`SERVICE_MUTATIONS`] on in the shipped code.
pub fn run_services_trace(seed: u64, mutation: Option<&'static str>, log: bool) -> ServiceOutcome {
    let cfg = ServiceTraceConfig::from_seed(seed);
    outbox_core::simulation::set_mutation(mutation);
    outbox_core::simulation::seed_ids(Some(seed));
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().expect("a current-thread runtime");
    let out = rt.block_on(trace(cfg, log));
    outbox_core::simulation::set_mutation(None);
    outbox_core::simulation::seed_ids(None);
    out
}

fn dispatcher_config(name: String, cfg: &ServiceTraceConfig) -> DispatcherConfig {
    DispatcherConfig {
        name,
        workers: cfg.workers,
        batch_size: cfg.batch,
        lease_ms: LEASE_MS,
        poll_interval_ms: 500,
        sweep_interval_ms: 1_000,
        listen: false,
        shutdown_grace_ms: 0,
        ..DispatcherConfig::default()
    }
}

fn reconciler_config(owner: String) -> ReconcilerConfig {
    ReconcilerConfig {
        owner,
        batch_size: 8,
        lease_ms: LEASE_MS,
        interval_ms: 1_000,
        // As tight as the adapter's bound allows: the bound counts from the
        // end of the lease an attempt was sent under.
        retry: RetryPolicy { allow_retry: true, max_attempts: 10, in_flight_bound_ms: MESSAGE_TIMEOUT_MS + 2_000, recheck_ms: 2_000 },
        clock_skew_allowance_ms: 1_000,
        ..ReconcilerConfig::default()
    }
}

type Process = tokio::task::JoinHandle<()>;

fn start_dispatcher(store: &SimStore, broker: &Arc<SimBroker>, cfg: &ServiceTraceConfig, name: String) -> Process {
    let d = Dispatcher::new(store.clone(), broker.clone(), dispatcher_config(name, cfg)).expect("a valid dispatcher config");
    let d = Arc::new(d);
    tokio::spawn(async move {
        let _ = d.run(std::future::pending()).await;
    })
}

fn start_reconciler(store: &SimStore, broker: &Arc<SimBroker>, owner: String) -> Process {
    let r = Reconciler::new(store.clone(), broker.clone(), reconciler_config(owner)).expect("a valid reconciler config");
    tokio::spawn(async move {
        let _ = r.run_resolving(std::future::pending()).await;
    })
}

async fn trace(cfg: ServiceTraceConfig, log: bool) -> ServiceOutcome {
    let mut rng = Rng::new(cfg.seed);
    let shared: Shared = Arc::new(Mutex::new(World {
        rng: Rng::new(cfg.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 1),
        faults: cfg.faults,
        on: true,
        start: Instant::now(),
        figures: ServiceFigures { traces: 1, ..Default::default() },
        log: log.then(Vec::new),
        logs: BTreeMap::new(),
        log_start: BTreeMap::new(),
        findings: Vec::new(),
        in_client: 0,
    }));
    world(&shared).note(|| format!("trace {}: {cfg:?}", cfg.seed));
    let inner = MemoryStore::new();
    inner.set_now_ms(T0_MS);
    let store = SimStore { inner: inner.clone(), world: shared.clone() };
    let broker = Arc::new(SimBroker { world: shared.clone() });
    let policy = RoutePolicy::new("order.created", CLUSTER, TOPIC, PARTITIONS);

    let mut incarnation = 0usize;
    let mut dispatchers: Vec<Process> = (0..cfg.dispatchers)
        .map(|d| {
            incarnation += 1;
            start_dispatcher(&store, &broker, &cfg, format!("d{d}-{incarnation}"))
        })
        .collect();
    incarnation += 1;
    let mut reconciler = start_reconciler(&store, &broker, format!("r-{incarnation}"));
    if let Some(at) = cfg.faults.truncate_at_ms {
        let partition = rng.below(u64::from(PARTITIONS)) as i32;
        let w = shared.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(at as u64)).await;
            let mut w = world(&w);
            let end = w.logs.get(&partition).map_or(0, |l| l.len() as i64);
            w.log_start.insert(partition, end);
            w.figures.truncations += 1;
            w.note(|| format!("retention deletes p{partition} below {end}"));
        });
    }

    // Emitters commit events at random times; a killer kills processes.
    let mut emitted: Vec<(EventId, String)> = Vec::new();
    let mut next_kill = if cfg.faults.kill_every_ms > 0 { rng.range(1, 2 * cfg.faults.kill_every_ms) } else { i64::MAX };
    let emit_gaps: Vec<i64> = (0..cfg.events).map(|_| rng.range(0, 2 * FAULT_PHASE_MS / cfg.events.max(1) as i64)).collect();
    let mut clock = 0i64;
    for (i, gap) in emit_gaps.iter().enumerate() {
        let until = clock + gap;
        while next_kill <= until {
            tokio::time::sleep_until(Instant::now() + Duration::from_millis((next_kill - clock).max(0) as u64)).await;
            clock = next_kill;
            kill_one(&shared, &mut rng, &store, &broker, &cfg, &mut dispatchers, &mut reconciler, &mut incarnation);
            next_kill = clock + rng.range(1, 2 * cfg.faults.kill_every_ms);
        }
        tokio::time::sleep(Duration::from_millis((until - clock).max(0) as u64)).await;
        clock = until;
        let key = format!("o-{}", rng.below(cfg.keys as u64));
        let payload = format!("{{\"order\":\"{key}\",\"n\":{i}}}").into_bytes();
        let now = world(&shared).now_ms();
        inner.set_now_ms(now);
        let command = format!("cmd-{i}");
        let request = EmitRequest {
            command_key: &command,
            tenant: "t1",
            aggregate_type: "order",
            aggregate_id: &key,
            aggregate_version: i as i64 + 1,
            event_type: "order.created",
            payload_schema: "order-v1",
            payload: &payload,
        };
        let frozen = request.validate(outbox_core::DEFAULT_MAX_PAYLOAD_BYTES).and_then(|_| request.freeze(EventId::generate(now as u64), now, i as u64 + 1, &policy));
        match frozen.and_then(|(env, dest)| inner.insert(&command, env, dest, payload.clone())) {
            Ok(id) => {
                world(&shared).note(|| format!("commit {id} key {key}"));
                emitted.push((id, key));
            }
            Err(e) => world(&shared).note(|| format!("emit refused: {e}")),
        }
    }
    // The rest of the fault phase.
    while clock < FAULT_PHASE_MS {
        let until = next_kill.min(FAULT_PHASE_MS);
        tokio::time::sleep(Duration::from_millis((until - clock).max(0) as u64)).await;
        clock = until;
        if next_kill <= clock {
            kill_one(&shared, &mut rng, &store, &broker, &cfg, &mut dispatchers, &mut reconciler, &mut incarnation);
            next_kill = clock + rng.range(1, 2 * cfg.faults.kill_every_ms);
        }
    }

    // Faults stop; the services run until every event is settled.
    {
        let mut w = world(&shared);
        w.on = false;
        w.note(|| "faults stop".into());
    }
    let settle_from = Instant::now();
    let mut settled = false;
    while settle_from.elapsed() < Duration::from_millis(SETTLE_LIMIT_MS as u64) {
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        inner.set_now_ms(world(&shared).now_ms());
        let reported: BTreeSet<String> = world(&shared).findings.iter().filter(|(k, _)| k == "log_unavailable").map(|(_, e)| e.clone()).collect();
        if world(&shared).in_client == 0 && all_settled(&inner, &reported) {
            settled = true;
            break;
        }
    }
    for p in dispatchers.drain(..) {
        p.abort();
    }
    reconciler.abort();
    tokio::task::yield_now().await;

    let mut w = world(&shared);
    let mut violations = Vec::new();
    if !settled {
        w.figures.stuck += 1;
        violations.push(format!("stuck: not settled within {SETTLE_LIMIT_MS} ms of the faults stopping"));
    }
    check(&inner, &mut w, &emitted, &mut violations);
    if let Some(log) = &mut w.log {
        for v in &violations {
            log.push(format!("VIOLATION {v}"));
        }
    }
    ServiceOutcome { seed: cfg.seed, figures: w.figures.clone(), violations, log: w.log.take() }
}

#[allow(clippy::too_many_arguments)]
fn kill_one(
    shared: &Shared,
    rng: &mut Rng,
    store: &SimStore,
    broker: &Arc<SimBroker>,
    cfg: &ServiceTraceConfig,
    dispatchers: &mut [Process],
    reconciler: &mut Process,
    incarnation: &mut usize,
) {
    *incarnation += 1;
    let victim = rng.below(dispatchers.len() as u64 + 1) as usize;
    let mut w = world(shared);
    w.figures.kills += 1;
    if victim == dispatchers.len() {
        w.note(|| format!("kill the reconciler; restart as r-{incarnation}"));
        drop(w);
        reconciler.abort();
        *reconciler = start_reconciler(store, broker, format!("r-{incarnation}"));
    } else {
        w.note(|| format!("kill dispatcher {victim}; restart as d{victim}-{incarnation}"));
        drop(w);
        dispatchers[victim].abort();
        dispatchers[victim] = start_dispatcher(store, broker, cfg, format!("d{victim}-{incarnation}"));
    }
}

/// Every event published or quarantined, or unknown and reported (its log
/// was truncated), or waiting behind such a predecessor on its key (which
/// holds the key by design).
fn all_settled(store: &MemoryStore, reported: &BTreeSet<String>) -> bool {
    let st = store.lock();
    let mut blocked_keys = BTreeSet::new();
    let mut by_seq: Vec<_> = st.events.values().collect();
    by_seq.sort_by_key(|e| e.seq);
    for ev in by_seq {
        match ev.state {
            EventState::Published => {}
            EventState::Quarantined => {
                blocked_keys.insert(ev.destination.routing_key.clone());
            }
            EventState::DispatchUnknown | EventState::Reconciling if reported.contains(ev.envelope.event_id.as_str()) => {
                blocked_keys.insert(ev.destination.routing_key.clone());
            }
            EventState::Pending if blocked_keys.contains(&ev.destination.routing_key) => {}
            _ => return false,
        }
    }
    true
}

fn check(store: &MemoryStore, w: &mut World, emitted: &[(EventId, String)], violations: &mut Vec<String>) {
    let st = store.lock();
    w.figures.events += emitted.len() as u64;
    // Receipts the store holds, by position.
    let mut receipts: BTreeMap<(i32, i64), Vec<(String, String)>> = BTreeMap::new();
    for ev in st.events.values() {
        if let Some(slot) = &ev.slot {
            receipts.entry((slot.partition, slot.offset)).or_default().push((slot.event_id.to_string(), slot.attempt_id.to_string()));
        }
    }
    for d in &st.duplicates {
        receipts.entry((d.partition, d.offset)).or_default().push((d.event_id.to_string(), d.attempt_id.to_string()));
    }
    for ((p, o), rs) in &receipts {
        let events: BTreeSet<&String> = rs.iter().map(|(e, _)| e).collect();
        if events.len() > 1 {
            w.figures.inconsistent_offsets += 1;
            violations.push(format!("inconsistent_offsets: p{p}@{o} holds receipts of {events:?}"));
        }
    }
    let attempts_by_id: BTreeMap<String, &AttemptRecord> = st.attempts.values().flatten().map(|a| (a.attempt_id.to_string(), a)).collect();
    w.figures.attempts += attempts_by_id.len() as u64;
    // Every event: published with its slot holding it, or settled otherwise.
    let mut published_by_key: BTreeMap<String, Vec<(u64, i32, i64)>> = BTreeMap::new();
    for (id, key) in emitted {
        let Some(ev) = st.events.get(id) else {
            w.figures.lost_write += 1;
            violations.push(format!("lost_write: {id} committed and not in the outbox"));
            continue;
        };
        match ev.state {
            EventState::Published => {
                w.figures.published += 1;
                let Some(slot) = &ev.slot else {
                    w.figures.lost_write += 1;
                    violations.push(format!("lost_write: {id} PUBLISHED without a receipt"));
                    continue;
                };
                let holds = w.logs.get(&slot.partition).and_then(|l| l.get(usize::try_from(slot.offset).ok()?)).is_some_and(|m| {
                    m.event_id == id.as_str() && m.attempt_id == slot.attempt_id.as_str() && sha256_digest(&m.payload) == ev.envelope.payload_digest
                });
                if !holds {
                    w.figures.lost_write += 1;
                    violations.push(format!("lost_write: {id}'s receipt p{}@{} does not hold its message", slot.partition, slot.offset));
                }
                published_by_key.entry(key.clone()).or_default().push((ev.seq, slot.partition, slot.offset));
            }
            EventState::Quarantined => w.figures.quarantined += 1,
            EventState::DispatchUnknown | EventState::Reconciling => {
                if w.findings.iter().any(|(k, e)| k == "log_unavailable" && e == id.as_str()) {
                    w.figures.unknown_reported += 1;
                } else {
                    w.figures.unresolved_unknown += 1;
                    violations.push(format!("unresolved_unknown: {id} is {:?} and no finding reports it", ev.state));
                }
            }
            _ => {}
        }
    }
    w.figures.unknown_attempts += st.audit.iter().filter(|a| a.action == "unknown").count() as u64
        + attempts_by_id.values().filter(|a| a.state == AttemptState::Absent).count() as u64;
    for a in st.audit.iter().filter(|a| a.action == "absence_proof_refuted") {
        w.figures.refuted_absence += 1;
        violations.push(format!("refuted_absence: the store saw a copy of {} after proving it absent ({})", a.event_id, a.detail));
    }
    if w.log.is_some() {
        let mut lines = Vec::new();
        for ev in st.events.values() {
            lines.push(format!("final {} seq {} {:?} slot {:?}", ev.envelope.event_id, ev.seq, ev.state, ev.slot.as_ref().map(|r| (r.partition, r.offset, r.attempt_id.to_string()))));
            for a in st.attempts.get(&ev.envelope.event_id).into_iter().flatten() {
                lines.push(format!("      attempt {} by {} gen {} {:?}", a.attempt_id, a.owner, a.claim_generation, a.state));
            }
        }
        for a in &st.audit {
            lines.push(format!("audit {} {} {}", a.event_id, a.action, a.detail));
        }
        if let Some(log) = &mut w.log {
            log.extend(lines);
        }
    }
    // Every copy in the log is accounted for.
    let mut copies_per_event: BTreeMap<&str, u64> = BTreeMap::new();
    for (p, log) in &w.logs {
        for (o, m) in log.iter().enumerate() {
            *copies_per_event.entry(m.event_id.as_str()).or_default() += 1;
            let recorded = receipts.get(&(*p, o as i64)).is_some_and(|rs| rs.iter().any(|(e, _)| e == &m.event_id));
            let attempt = attempts_by_id.get(&m.attempt_id);
            match attempt.map(|a| a.state) {
                Some(AttemptState::NotSent | AttemptState::Absent) => {
                    w.figures.refuted_absence += 1;
                    violations.push(format!("refuted_absence: p{p}@{o} holds {} attempt {}, closed {:?}", m.event_id, m.attempt_id, attempt.map(|a| a.state)));
                }
                _ if recorded => {}
                // Reported instead: its event's log was truncated before a
                // lookup could find it (the finding `log_unavailable`).
                _ if w.findings.iter().any(|(k, e)| k == "log_unavailable" && *e == m.event_id) => {}
                // A transport copy of an attempt whose receipt the store
                // holds elsewhere (the client wrote it twice): evidence the
                // reconciler's scan reports, not a second send.
                Some(AttemptState::Acked) => {}
                other => {
                    w.figures.duplicate += 1;
                    violations.push(format!("duplicate: p{p}@{o} holds {} attempt {} ({other:?}), no receipt accounts for it", m.event_id, m.attempt_id));
                }
            }
        }
    }
    w.figures.duplicates_in_log += copies_per_event.values().map(|n| n.saturating_sub(1)).sum::<u64>();
    // Per key, publication follows commit order: positions rise with seq.
    for (key, mut evs) in published_by_key {
        evs.sort();
        for pair in evs.windows(2) {
            let ((s1, p1, o1), (s2, p2, o2)) = (pair[0], pair[1]);
            if p1 == p2 && o2 < o1 {
                w.figures.order_violation += 1;
                violations.push(format!("order_violation: key {key}: seq {s2} at p{p2}@{o2} before seq {s1} at p{p1}@{o1}"));
            }
        }
    }
}

/// The services gate over `traces` seeds from `first_seed`, on `threads`
/// threads (0: all cores).
pub fn run_services_gate(first_seed: u64, traces: u64, mutation: Option<&'static str>, threads: usize) -> (ServiceFigures, Vec<u64>, f64) {
    let threads = if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
    let start = std::time::Instant::now();
    let next = std::sync::atomic::AtomicU64::new(0);
    let parts: Vec<(ServiceFigures, Vec<u64>)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut figures = ServiceFigures::default();
                    let mut failing = Vec::new();
                    loop {
                        let from = next.fetch_add(64, std::sync::atomic::Ordering::Relaxed);
                        if from >= traces {
                            break;
                        }
                        for i in from..(from + 64).min(traces) {
                            let out = run_services_trace(first_seed + i, mutation, false);
                            if !out.figures.clean() {
                                failing.push(first_seed + i);
                                failing.sort_unstable();
                                failing.truncate(16);
                            }
                            figures.merge(&out.figures);
                        }
                    }
                    (figures, failing)
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().expect("a simulator thread panicked")).collect()
    });
    let mut figures = ServiceFigures::default();
    let mut failing = Vec::new();
    for (f, s) in parts {
        figures.merge(&f);
        failing.extend(s);
    }
    failing.sort_unstable();
    failing.truncate(16);
    (figures, failing, start.elapsed().as_secs_f64())
}
