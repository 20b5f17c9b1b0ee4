//! The services engine: one trace runs the shipped
//! `outbox_producer::Dispatcher` and
//! `outbox_producer::Reconciler` (their own loops: `run` and
//! `run_resolving`), and in some traces the shipped destination migration
//! (`outbox_producer::migration::migrate_destination_in`, driven by an
//! operator) and retention pass (`outbox_producer::retention::purge_with`,
//! whose decision is `outbox_core::may_purge`), over the in-memory store, against a
//! simulated broker, on a seeded single-threaded executor in virtual time.
//!
//! Faults are injected at the seams the services talk through:
//! - the store ([`SimStore`]): calls that fail before doing anything, that
//!   commit and lose their answer, and that stall (a paused process, a
//!   stuck connection) for up to two leases;
//! - the broker ([`SimBroker`]): refused sends (not persisted), requests
//!   that never reach the log and time out, writes whose ACK is lost, ACKs
//!   delivered late (after the lease), writes the client repeats, failed
//!   lookups, slow lookups (a long scan answers for the log as it was when
//!   it began); the client keeps writing what it was handed after its
//!   process died, within the message timeout; and, in a few traces, while
//!   the dispatchers run, `TOPIC` deleted and created again under the same
//!   name (8%), or the cluster replaced by an empty one (5%): the affected
//!   partitions start again as empty logs at offset 0, the old messages
//!   gone, and the consumer reads them from their start. The route's
//!   destinations record no topic id (`destination.v1`), the harder case:
//!   only the scan floors' anchors (`anchor_to_read`, `plan_absence_scan`)
//!   tell the new log from the old one;
//! - processes: dispatchers, the reconciler and the operator killed at any
//!   await (their task dropped, so every worker stops) and restarted under a
//!   new owner; the operator also paused for up to six leases;
//! - clocks: each dispatcher's and reconciler's host has its own clock,
//!   off true time by up to `MAX_CLOCK_SKEW_MS` either way, and stamps its
//!   store calls with it (as `PgStore` stamps leases with its host's);
//! - hosts: a dispatcher's host stopped (a VM paused, a laptop suspended, a
//!   container frozen) right after it handed a message to its client, for
//!   two to five leases. Nothing of the host runs meanwhile, the dispatcher
//!   nor its client: its lease runs out by the database's clock, and the
//!   message leaves the client's buffer only when the host resumes, after
//!   the in-flight bound the reconciler waited out (a client's message
//!   timeout is a promise about its host's running time). This is how a
//!   genuine ACK of an attempt closed ABSENT arises in production (the
//!   bound rules it out for a host that keeps running: a lookup after the
//!   bound sees every write that can still land, and a truncated or
//!   replaced log proves nothing); the protocol's answer is that the
//!   receipt competes for the slot (primary or duplicate), the attempt
//!   becomes ACKED and the store records `absence_proof_refuted`
//!   (counted as `absence_refuted_late`, not a violation, when a host pause
//!   explains it). The mutation `absent-attempt-ack-discarded` rejects such
//!   a receipt: the copy stays in the log, its attempt ABSENT, and
//!   `refuted_absence` counts it. Not in traces with a migration (a late
//!   copy of the generation a migration left is not repaired by design).
//!
//! Migration: the old topic degrades (ACKs lost, lookups slow), then the
//! route moves to `NEW_TOPIC` and the operator migrates every undelivered
//! event of `TOPIC`, asking again for the refused ones until none is left,
//! racing the dispatchers and the reconciler. Retention: a mandatory
//! consumer reads `CLUSTER`'s logs (lagging, sometimes not at all) and a
//! topic of the same name on `OTHER_CLUSTER` (far ahead); a retention job
//! purges on its watermarks every 0.6–6 s.
//!
//! Then faults stop, the services run until every event is settled, and the
//! checks read the store and the log (names as Jepsen's Kafka checker uses
//! them where they apply): `lost_write` (an event committed and not
//! published, or whose receipt's position does not hold it in any log that
//! partition has had: one whose position held it in a log that is gone
//! since is `receipt_positions_lost`, the broker's loss, which the
//! PostgreSQL store reports as the finding `receipt_position_lost` from its
//! receipt transaction's position epochs and its reconciler's topic scan;
//! the in-memory store has no position epochs), `duplicate` (a
//! copy in the log from an attempt the store has no receipt of, unless the
//! reconciler's bypass scan, which the engine runs, recorded a finding
//! naming it: `copies_reported`), and
//! `refuted_absence` (a copy of an attempt the store closed as not sent or
//! proven absent, or a proof the store saw refuted, unless a host pause
//! explains it: then the copy's receipt must have been accepted, or never
//! have reached the store (the scan's finding names it, `copies_reported`,
//! or not yet, `late_copies_unheard`); a copy in a log gone
//! before the proof that closed its attempt is no refutation: the proof was
//! about the log that replaced it, and its ACK arriving after the proof is
//! `absence_refuted_late` too), `inconsistent_offsets` (two events' receipts at one
//! position of one log), `order_violation` (a key's events published out of commit
//! order within one log), `unresolved_unknown` (an outcome still unknown after the run),
//! `migrated_over_copy` (a copy of the generation a migration left behind,
//! in the target it left while that log was there: delivered to the new
//! target while a copy sat in the old one) and `premature_purge` (an event purged while the
//! consumer's position on its own log, cluster included, had not passed
//! it; checked when the purge happens).

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
use outbox_core::memory::MemoryWatermark;
use outbox_core::MigrationFence;
use outbox_producer::migration::{migrate_destination_in, MigrationOutcome, MigrationStore};
use outbox_producer::service_store::{ClaimRound, CommitListener, Notice, ServiceStore};
use outbox_producer::{Dispatcher, DispatcherConfig, ProducerError, Reconciler, ReconcilerConfig};
use tokio::time::Instant;

use crate::rng::Rng;

#[path = "services_consumers.rs"]
mod consumers;

/// Simulated time at the start of every trace (ms since the epoch).
const T0_MS: i64 = 1_700_000_000_000;
/// The dispatchers' and the reconciler's lease.
const LEASE_MS: i64 = 10_000;
/// The broker client's message timeout: a message handed to it is written
/// within this long, or never.
const MESSAGE_TIMEOUT_MS: i64 = 5_000;
const CLUSTER: &str = "sim-cluster";
/// Another cluster carrying a topic of the same name, which the mandatory
/// consumer reads too: its watermarks there say nothing about this one's log.
const OTHER_CLUSTER: &str = "sim-cluster-b";
const TOPIC: &str = "orders";
/// The topic an operator migrates `TOPIC`'s undelivered events to.
const NEW_TOPIC: &str = "orders-v2";
/// The mandatory consumer retention waits for.
const CONSUMER: &str = "billing";
/// Retention's policy: a short replay window, small pages.
const RETENTION_POLICY: outbox_producer::retention::RetentionPolicy = outbox_producer::retention::RetentionPolicy { replay_window_ms: 2_000, batch_size: 3, max_batches: 50 };
const PARTITIONS: u32 = 3;
/// Virtual time the faults last, from the first event.
const FAULT_PHASE_MS: i64 = 40_000;
/// Longest fault-free phase before a trace counts as stuck.
const SETTLE_LIMIT_MS: i64 = 3_600_000;

/// Deliberate defects in shipped code, each switched by
/// [`outbox_core::simulation::mutation_active`] at one line.
pub const SERVICE_MUTATIONS: [(&str, &str); 15] = [
    ("send-after-lease", "the dispatcher hands a message to the client after its claim's lease ran out"),
    ("bound-from-registration-clock", "the in-flight bound counts from the attempt's registration, not from the end of the lease it was sent under"),
    ("absence-from-truncated-log", "a lookup range below the log's start (or above its end) proves absence"),
    ("migration-unfenced", "the migration commit does not check that the row is still under the claim (reconcile claim, or claim generation) its proof was made under"),
    ("watermark-ignores-cluster", "retention matches a consumer's watermark to an event's log without comparing the cluster"),
    ("offset-before-commit", "the consumer's partition loop commits a batch's offset before its decisions commit"),
    ("redelivery-reapplied", "the consumer's processor applies a redelivered event again instead of answering with its receipt"),
    ("absent-attempt-ack-discarded", "a genuine ACK of an attempt closed ABSENT is rejected instead of competing for the slot and refuting the proof"),
    ("command-dedupe-disabled", "emit's command decision treats a retried command (its key already committed) as a new command"),
    ("purge-ignores-watermarks", "retention purges past the replay window without looking at the mandatory consumers' watermarks"),
    ("migration-without-proof", "the migration decision moves a DISPATCH_UNKNOWN event whatever the old target's lookup answered"),
    ("absence-across-holes", "a lookup range with offsets that hold no record (a compacted topic) proves absence"),
    ("consumer-skips-receipt", "the consumer's processor runs the handler without claiming (or writing) the (consumerId, eventId) receipt"),
    ("late-acks-dropped", "the dispatcher drops an ACK that arrives after its claim's lease ran out instead of recording it"),
    ("ack-without-digest-check", "acceptDispatchReceipt takes a receipt whose payload digest is not the frozen one (no quarantine)"),
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
    /// A lookup is slow (up to two leases: a long scan), answering for the
    /// log as it is at its end.
    pub lookup_slow: f64,
    /// Per store call of the operator's migration, a long pause (a laptop
    /// put to sleep, a VM paused: up to six leases) before the call.
    pub operator_pause: f64,
    /// Mean virtual ms between process kills (0: none).
    pub kill_every_ms: i64,
    /// When (virtual ms from the start) retention deletes every record of
    /// one partition written so far, if it does in this trace.
    pub truncate_at_ms: Option<i64>,
    /// When (virtual ms from the start) the route moves to `NEW_TOPIC` and
    /// an operator starts migrating `TOPIC`'s undelivered events, if it does.
    pub migrate_at_ms: Option<i64>,
    /// Whether retention runs (with a mandatory consumer's watermarks on
    /// two clusters).
    pub retention: bool,
    /// Per send, the dispatcher's host stops (a VM paused, a laptop
    /// suspended, a container frozen) right after handing the message to
    /// its client, for two to five leases: nothing of that host runs, the
    /// dispatcher nor its client, and the message leaves the client's
    /// buffer only when the host resumes. Only in traces without a migration.
    pub host_pause: f64,
    /// When (virtual ms from the start) `TOPIC` is deleted and created
    /// again under the same name, if it is: every partition a new, empty
    /// log (offsets from 0, the old messages gone).
    pub recreate_topic_at_ms: Option<i64>,
    /// When (virtual ms from the start) the cluster is replaced by an
    /// empty one, if it is: every topic's partitions new, empty logs.
    pub replace_cluster_at_ms: Option<i64>,
    /// Largest offset of a process host's clock from true time: each
    /// dispatcher's and reconciler's host draws its own within plus or
    /// minus this, and every store call it makes is stamped with its clock
    /// (as `PgStore` stamps leases with its host's). At most
    /// [`MAX_CLOCK_SKEW_MS`], so that two hosts differ by no more than the
    /// reconciler's `clock_skew_allowance_ms`.
    pub clock_skew_ms: i64,
}

/// The largest host clock offset a trace draws: half the reconciler's
/// clock skew allowance (1,000 ms), since two hosts may be off in opposite
/// directions. Skew beyond the allowance is outside the protocol's promise
/// (PROTOCOL §6: the in-flight bound is measured across clocks).
pub const MAX_CLOCK_SKEW_MS: i64 = 500;

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
            lookup_slow: 0.0,
            operator_pause: 0.0,
            kill_every_ms: 0,
            truncate_at_ms: None,
            migrate_at_ms: None,
            retention: false,
            host_pause: 0.0,
            recreate_topic_at_ms: None,
            replace_cluster_at_ms: None,
            clock_skew_ms: 0,
        };
        let kill_every_ms = if rng.chance(0.7) { rng.range(1_000, 8_000) } else { 0 };
        let truncate_at_ms = rng.chance(0.3).then(|| rng.range(1_000, FAULT_PHASE_MS));
        let migrate_at_ms = rng.chance(0.4).then(|| rng.range(1_000, FAULT_PHASE_MS));
        let retention = rng.chance(0.4);
        let lookup_slow = if rng.chance(0.5) { 0.0 } else { rng.unit() * 0.5 };
        let operator_pause = if rng.chance(0.5) { 0.0 } else { rng.unit() * 0.5 };
        // Drawn last, so that the other faults of a seed stay as they were.
        // Not with a migration: a late write of the old generation into the
        // topic a migration left is a refuted migration proof, which the
        // protocol does not repair (the copy stays in the old target).
        let host_pause = if migrate_at_ms.is_none() && rng.chance(0.4) { rng.unit() * 0.1 } else { 0.0 };
        let recreate_topic_at_ms = rng.chance(0.08).then(|| rng.range(1_000, FAULT_PHASE_MS));
        let replace_cluster_at_ms = rng.chance(0.05).then(|| rng.range(1_000, FAULT_PHASE_MS));
        let clock_skew_ms = if rng.chance(0.5) { rng.range(1, MAX_CLOCK_SKEW_MS) } else { 0 };
        ServiceFaults {
            kill_every_ms,
            truncate_at_ms,
            migrate_at_ms,
            retention,
            lookup_slow,
            operator_pause,
            host_pause,
            clock_skew_ms,
            recreate_topic_at_ms,
            replace_cluster_at_ms,
            ..f
        }
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
        /// Events an operator migrated to another destination.
        migrations,
        /// Migration requests refused (nothing moved, nothing sent).
        migrations_refused,
        /// Events retention purged (payload dropped, tombstone kept).
        purged,
        /// Retention passes that held an event back for a mandatory consumer.
        held_by_consumers,
        /// Events the consumer group applied (one receipt each).
        consumer_applied,
        /// Redeliveries the consumer group answered with a receipt.
        consumer_redeliveries,
        /// Events the consumer group dead-lettered.
        consumer_dead_lettered,
        /// Consumer owners that died after a database commit, before the offset commit.
        consumer_crashes,
        /// Copies no receipt records that the reconciler's bypass scan
        /// reported (`unrecorded_copy`, `divergent_copy`): of open attempts
        /// of events another receipt published, and late copies of paused
        /// hosts whose receipt never reached the store.
        copies_reported,
        /// Dispatcher and reconciler hosts whose clock is off.
        skewed_hosts,
        /// Kills of the consumer process.
        consumer_kills,
        /// Partitions moved to a new owner with a batch in flight.
        rebalances,
        /// Receipt-store faults injected.
        consumer_store_faults,
        /// Dispatcher hosts stopped with a message in their client's buffer.
        host_pauses,
        /// Absence proofs a genuine receipt refuted where a fault explains
        /// it (a paused host's write after the in-flight bound, or an ACK of
        /// a write into a log gone before the proof, which was about the
        /// log that replaced it), the receipt accepted (as the primary or a
        /// duplicate) and the store's finding `absence_proof_refuted`
        /// recorded: the protocol's answer to either.
        absence_refuted_late,
        /// Late copies of a paused host whose receipt never reached the
        /// store (its process was killed, the ACK lost) and that no scan
        /// finding names yet: their event is still unknown (reported as
        /// `log_unavailable`: the scan judges a copy of an attempt left
        /// UNKNOWN accounted, the lookups' to find), or the copy sits in a
        /// log the scan cannot read (gone, truncated, compacted). A copy of
        /// an attempt closed ABSENT or NOT_SENT is the scan's finding
        /// `absence_proof_refuted` (counted in `copies_reported`).
        late_copies_unheard,
        /// Topics deleted and created again, and clusters replaced by empty ones.
        log_resets,
        /// Published events whose receipt's position held their message in
        /// a log that is gone since (its topic recreated, its cluster replaced).
        receipt_positions_lost,
        /// Committed commands a client retried (same key, same content).
        commands_retried,
        /// Passes of the log cleaner over a partition of the topic.
        compactions,
        /// Records those passes removed.
        records_compacted,
        /// Lookups whose range had a hole (compacted records): no absence proof.
        lookups_over_holes,
        /// ACKs the broker client answered to a dispatcher that lived on.
        acks_to_live_senders,
        /// ACKs that reached their dispatcher after the claim's lease ran
        /// out (its `late_acks` counter): each must be recorded all the same.
        late_acks,
        /// Messages a forger wrote with a registered attempt's headers and
        /// other payload bytes.
        forged_copies,
        /// Forged messages the consumer group quarantined (their bytes do
        /// not match their digest).
        forged_quarantined,
        /// Dispatchers' LISTEN sessions lost with a notice.
        listen_sessions_lost,
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
        /// A copy of a migrated event's old generation in the old target:
        /// delivered to the new target while a copy sat in the old one.
        migrated_over_copy,
        /// An event purged before the mandatory consumer's watermark on its
        /// own log (cluster, topic, partition) had passed it.
        premature_purge,
        /// An event's effect written twice by the consumer group.
        duplicate_effect,
        /// A consumer receipt without its effect, or an effect without its receipt.
        receipt_effect_mismatch,
        /// An event published at a position the log still holds, never applied.
        unseen,
        /// A message the dispatcher wrote, quarantined by the consumer.
        genuine_quarantined,
        /// A retried command answered with another event (or refused): one
        /// business command, two logical events.
        second_logical_event_id,
        /// A publish slot holding a message of the event whose bytes are
        /// not the frozen payload (a forged copy accepted).
        divergent_accepted,
        /// An ACK that reached a dispatcher that lived on, never handed to
        /// `acceptDispatchReceipt`.
        ack_dropped,
        /// A shipped service answered an error no fault explains (an
        /// illegal transition, a refused write of its own).
        service_error,
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
    /// How long each unknown outcome took to resolve, virtual ms.
    pub unknown_resolved_ms: Vec<i64>,
}

// ---------------------------------------------------------------------------
// The world the services run in

/// Shared by the store, the broker and the driver of one trace.
struct World {
    rng: Rng,
    /// The hosts' clock offsets are drawn from their own stream, so that
    /// skew changes nothing else of a trace.
    clock_rng: Rng,
    faults: ServiceFaults,
    /// Whether faults are injected now.
    on: bool,
    start: Instant,
    figures: ServiceFigures,
    log: Option<Vec<String>>,
    /// Per (topic, partition), every message written, in order (including
    /// those retention deleted since: consumers may have read them).
    logs: BTreeMap<(String, i32), Vec<Stored>>,
    /// Per (topic, partition), the first offset still in the log.
    log_start: BTreeMap<(String, i32), i64>,
    /// Logs that are gone (a topic recreated, the cluster replaced), oldest first.
    gone: Vec<GoneLog>,
    /// When (the world's clock) a reconciler's proof closed each attempt ABSENT.
    absent_at: BTreeMap<String, i64>,
    /// The mandatory consumer's committed offsets per (cluster, topic,
    /// partition): the next offset it reads.
    consumer_at: BTreeMap<(String, String, i32), i64>,
    /// Violations found while the trace runs (a purge checked when it happens).
    violations: Vec<String>,
    /// Whether `TOPIC` is degraded (why the operator moves the route away):
    /// from then on its writes lose their ACK or time out more often, and
    /// its lookups are slow more often.
    old_degraded: bool,
    /// Findings the services recorded: (kind, event id).
    findings: Vec<(String, String)>,
    /// Client requests not answered yet (the log may still change).
    in_client: usize,
    /// Receipt calls in progress (stalled, or waiting for their host): a
    /// receipt on its way to the store may still change what it holds.
    in_store: usize,
    /// Attempts whose write a host pause held back until its host resumed.
    late_writes: BTreeSet<String>,
    /// (host, attempt) of every receipt a host's store call took.
    handed_by: BTreeSet<(usize, String)>,
    /// (host, attempt) of every receipt a host called the store with
    /// (whether or not the call got through).
    tried_by: BTreeSet<(usize, String)>,
    /// (host, attempt, position) of every ACK the broker client answered
    /// to a dispatcher of that host.
    acks_delivered: Vec<(usize, String, String)>,
    /// Hosts whose process was killed (its memory lost: an ACK it held is
    /// the reconciler's to find).
    killed_hosts: BTreeSet<usize>,
    /// Hosts started so far.
    hosts: usize,
    /// Per send whose request never reaches the log, the chance that a
    /// forger writes a message with its headers and other payload bytes
    /// (0 in most traces), and the forger's own generator.
    forge: f64,
    forge_rng: Rng,
    /// Counts the commits of new events: what dispatchers' listening
    /// sessions hear (`NOTIFY outbox_pending` in PostgreSQL).
    /// (tokio's watch channel is not used: it wakes its receivers in an
    /// order drawn at random, which would make a trace differ between runs.)
    commits: u64,
    committed: Arc<tokio::sync::Notify>,
    /// Listening sessions lost, drawn on their own.
    listen_rng: Rng,
    /// Offsets the bypass scan reported it could not read (`scan_gap`):
    /// (topic, partition), the log's incarnation, from, to.
    scan_gaps: Vec<((String, i32), usize, i64, i64)>,
    /// Copies the reconciler's bypass scan recorded a finding about
    /// (`unrecorded_copy`, `divergent_copy`): (topic, partition, offset, attempt).
    copies_reported: BTreeSet<(String, i32, i64, String)>,
}

/// The host a process runs on. A pause of the host (`ServiceFaults::host_pause`)
/// holds back everything of it: its store calls and its broker client.
#[derive(Debug, Default)]
struct Host {
    /// Which host (numbered in the order they start).
    id: usize,
    /// Until when (ms, the world's clock) the host is stopped.
    paused_until_ms: std::sync::atomic::AtomicI64,
    /// How far this host's clock is ahead of true time (negative: behind).
    skew_ms: i64,
}

impl Host {
    /// Waits until the host runs; whether it had to.
    async fn wait_running(&self, world_ref: &Shared) -> bool {
        let mut waited = false;
        loop {
            let until = self.paused_until_ms.load(std::sync::atomic::Ordering::SeqCst);
            let now = world(world_ref).now_ms();
            if until <= now {
                return waited;
            }
            waited = true;
            tokio::time::sleep(Duration::from_millis((until - now) as u64)).await;
        }
    }
}

/// A partition's log that is gone: its topic was deleted (and created
/// again), or its cluster replaced.
#[derive(Debug)]
struct GoneLog {
    /// (topic, partition).
    key: (String, i32),
    /// When it went (the world's clock).
    gone_at_ms: i64,
    /// Every message it held.
    log: Vec<Stored>,
}

#[derive(Debug, Clone)]
struct Stored {
    event_id: String,
    attempt_id: String,
    key: Vec<u8>,
    headers: Vec<(String, Vec<u8>)>,
    payload: Vec<u8>,
    /// Removed by log compaction (a later record has its key): the offset
    /// holds no record for a reader; the checks still know what was there.
    compacted: bool,
    /// Written by a forger, not by the outbox: a registered attempt's
    /// headers over other payload bytes.
    forged: bool,
    /// What the reconciler's bypass scan reads of it, computed once at
    /// the write (the scan reads a page again while it waits at a copy).
    scanned: outbox_core::ScannedMessage,
}

impl World {
    /// Which of the logs `topic`/`partition` has had (the gone ones oldest
    /// first, then the current one) holds `attempt`'s message of `event` at
    /// `offset`: its index, whether it is the current log, and the message.
    fn log_holding(&self, topic: &str, partition: i32, offset: i64, event: &str, attempt: &str) -> Option<(usize, bool, &Stored)> {
        let key = (topic.to_owned(), partition);
        let at = usize::try_from(offset).ok()?;
        let gone = self.gone.iter().filter(|g| g.key == key).map(|g| (&g.log, false));
        gone.chain(self.logs.get(&key).map(|l| (l, true)))
            .enumerate()
            .find_map(|(i, (l, current))| l.get(at).filter(|m| m.event_id == event && m.attempt_id == attempt).map(|m| (i, current, m)))
    }

    /// Deletes the logs `which` picks: their messages are gone, their
    /// partitions start again empty at offset 0, and the consumer reads them
    /// from their start (its group's offsets went with the old topic).
    fn reset_logs(&mut self, which: impl Fn(&str) -> bool) {
        let now = self.now_ms();
        let keys: Vec<(String, i32)> = self.logs.keys().filter(|(t, _)| which(t)).cloned().collect();
        for key in keys {
            let log = self.logs.remove(&key).unwrap_or_default();
            self.log_start.remove(&key);
            self.consumer_at.remove(&(CLUSTER.to_owned(), key.0.clone(), key.1));
            self.gone.push(GoneLog { key, gone_at_ms: now, log });
        }
        self.figures.log_resets += 1;
    }

    /// ACKs answered to a dispatcher that lives on and that it has not
    /// handed to `acceptDispatchReceipt` (yet): (host, attempt, position).
    fn unrecorded_acks(&self) -> impl Iterator<Item = &(usize, String, String)> {
        self.acks_delivered.iter().filter(|(host, attempt, _)| !self.killed_hosts.contains(host) && !self.handed_by.contains(&(*host, attempt.clone())))
    }

    /// Of [`World::unrecorded_acks`], those its dispatcher never even tried
    /// to record (a try whose store call failed, and that the dispatcher
    /// gave up after its retry budget, leaves the ACK to the reconciler).
    fn untried_acks(&self) -> impl Iterator<Item = &(usize, String, String)> {
        self.unrecorded_acks().filter(|(host, attempt, _)| !self.tried_by.contains(&(*host, attempt.clone())))
    }

    /// Whether a forged message sits at `offset` of `topic`/`partition`, in
    /// its current log or one that is gone.
    fn forged_at(&self, topic: &str, partition: i32, offset: i64) -> bool {
        let key = (topic.to_owned(), partition);
        let Ok(at) = usize::try_from(offset) else { return false };
        self.gone.iter().filter(|g| g.key == key).map(|g| &g.log).chain(self.logs.get(&key)).any(|l| l.get(at).is_some_and(|m| m.forged))
    }

    fn now_ms(&self) -> i64 {
        T0_MS + i64::try_from(self.start.elapsed().as_millis()).unwrap_or(i64::MAX / 2)
    }

    /// How many logs of (topic, partition) are gone: the current one's
    /// number among them.
    fn incarnation(&self, key: &(String, i32)) -> usize {
        self.gone.iter().filter(|g| g.key == *key).count()
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

/// A receipt call in progress (see `World::in_store`).
struct Busy(Shared);

impl Drop for Busy {
    fn drop(&mut self) {
        world(&self.0).in_store -= 1;
    }
}

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
    /// Chance per call of a long pause of the process using this store (the
    /// operator's: `ServiceFaults::operator_pause`).
    pause: f64,
    /// The host of the process using this store.
    host: Arc<Host>,
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
    async fn published_digests(&self, event_ids: &[String]) -> Result<BTreeMap<String, String>, StoreError> {
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
    /// The host of the process using this client.
    host: Arc<Host>,
}

/// The attempt id a message's headers name.
fn attempt_of(m: &OutgoingMessage) -> String {
    m.headers.iter().rev().find(|(k, _)| k == headers::ATTEMPT_ID).map(|(_, v)| String::from_utf8_lossy(v).into_owned()).unwrap_or_default()
}

impl SimBroker {
    /// A forger (a mirror rewriting payloads, a compromised producer)
    /// writes a message with `m`'s headers, the outbox's eventId and
    /// attemptId among them, and other payload bytes, where `m` itself
    /// never reached the log. A lookup finds it as that attempt's message;
    /// `acceptDispatchReceipt` must quarantine it, never publish it.
    fn forge(w: &mut World, m: &OutgoingMessage) {
        let mut payload = m.payload.clone();
        payload.extend_from_slice(b" (forged)");
        let forged = OutgoingMessage { payload, ..m.clone() };
        let offset = SimBroker::write(w, &forged);
        if let Some(last) = w.logs.get_mut(&(m.topic.clone(), m.partition)).and_then(|l| l.last_mut()) {
            last.forged = true;
        }
        w.figures.forged_copies += 1;
        w.note(|| format!("a forger writes {}/p{}@{offset} with the headers of attempt {} and other bytes", m.topic, m.partition, attempt_of(m)));
    }

    fn write(w: &mut World, m: &OutgoingMessage) -> i64 {
        let log = w.logs.entry((m.topic.clone(), m.partition)).or_default();
        let offset = log.len() as i64;
        let scanned = outbox_core::ScannedMessage::read(CLUSTER, &m.topic, m.partition, offset, Some(&m.key), &m.payload, &m.headers);
        let (event_id, attempt_id) = (scanned.event_id.clone().unwrap_or_default(), scanned.attempt_id.clone().unwrap_or_default());
        w.note(|| format!("log {}/p{}@{offset}: {event_id} attempt {attempt_id}", m.topic, m.partition));
        let log = w.logs.entry((m.topic.clone(), m.partition)).or_default();
        log.push(Stored { event_id, attempt_id, key: m.key.clone(), headers: m.headers.clone(), payload: m.payload.clone(), compacted: false, forged: false, scanned });
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
            let mut f = w.faults;
            if w.old_degraded && message.topic == TOPIC {
                f.ack_lost = f.ack_lost.max(0.5);
                f.unsent_timeout = f.unsent_timeout.max(0.2);
            }
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
            // The host stops right after the handover, the message still in
            // the client's buffer (drawn only where the fault is on).
            if f.host_pause > 0.0 && on && w.rng.chance(f.host_pause) {
                let until = w.now_ms() + w.rng.range(2 * LEASE_MS, 5 * LEASE_MS);
                if self.host.paused_until_ms.fetch_max(until, std::sync::atomic::Ordering::SeqCst) < until {
                    w.figures.host_pauses += 1;
                    w.note(|| format!("the sender's host stops until {} ms, p{} in its client's buffer", until - T0_MS, message.partition));
                }
            }
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
        let (attempt, topic) = (attempt_of(&message), message.topic.clone());
        let world_ref = self.world.clone();
        let host = self.host.clone();
        // The client: lives on whether or not the sender does, and runs only
        // while its host does.
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(write_after as u64)).await;
            let late = host.wait_running(&world_ref).await;
            let mut written = None;
            {
                let mut w = world(&world_ref);
                if late && matches!(fate, Fate::Written | Fate::AckLost | Fate::WrittenTwice) {
                    let a = message.headers.iter().rev().find(|(k, _)| k == headers::ATTEMPT_ID).map(|(_, v)| String::from_utf8_lossy(v).into_owned()).unwrap_or_default();
                    w.late_writes.insert(a);
                }
                match fate {
                    Fate::Written | Fate::AckLost => written = Some(SimBroker::write(&mut w, &message)),
                    Fate::WrittenTwice => {
                        SimBroker::write(&mut w, &message);
                        written = Some(SimBroker::write(&mut w, &message));
                    }
                    Fate::NeverWritten => {
                        let forge = w.forge;
                        if forge > 0.0 && w.on && w.forge_rng.chance(forge) {
                            SimBroker::forge(&mut w, &message);
                        }
                    }
                    Fate::Refused => {}
                }
            }
            if answer_after > write_after {
                tokio::time::sleep(Duration::from_millis((answer_after - write_after) as u64)).await;
            }
            host.wait_running(&world_ref).await;
            let outcome = match (fate, written) {
                (Fate::Refused, _) => SendOutcome::NotPersisted("simulated: refused".into()),
                (Fate::NeverWritten | Fate::AckLost, _) | (_, None) => SendOutcome::Unknown("simulated: message timed out".into()),
                (_, Some(offset)) => SendOutcome::Acked { partition: message.partition, offset },
            };
            world(&world_ref).in_client -= 1;
            let _ = tx.send(outcome);
        });
        let outcome = rx.await.unwrap_or_else(|_| SendOutcome::Unknown("simulated: client gone".into()));
        if let SendOutcome::Acked { partition, offset } = &outcome {
            let mut w = world(&self.world);
            w.acks_delivered.push((self.host.id, attempt, format!("{topic}/p{partition}@{offset}")));
        }
        outcome
    }

    fn supports_lookup(&self) -> bool {
        true
    }

    fn max_in_flight_ms(&self) -> Option<u64> {
        Some(MESSAGE_TIMEOUT_MS as u64)
    }

    async fn lookup(&self, destination: &Destination, event_id: &EventId, from: &outbox_core::ScanFrom) -> LookupOutcome {
        let slow = {
            let mut w = world(&self.world);
            let (fail, mut slow) = (w.faults.lookup_fail, w.faults.lookup_slow);
            if w.old_degraded && destination.topic == TOPIC {
                slow = slow.max(0.5);
            }
            if w.on && w.rng.chance(fail) {
                w.figures.broker_faults += 1;
                return LookupOutcome::Unavailable("simulated: lookup failed".into());
            }
            let slow = if w.on && w.rng.chance(slow) { w.rng.range(1, 2 * LEASE_MS) } else { 0 };
            if slow > 0 {
                w.figures.broker_faults += 1;
                w.note(|| format!("lookup of {event_id} takes {slow} ms"));
            }
            slow
        };
        // A long scan reads up to the log's end as it was when it began (as
        // the Kafka adapter's scan does: its end offset is fetched first),
        // and answers `slow` ms later.
        let answer = self.scan(destination, event_id, from);
        if slow > 0 {
            tokio::time::sleep(Duration::from_millis(slow as u64)).await;
        }
        answer
    }

    /// The reconciler's bypass scan reads the partition's current log, as
    /// the Kafka adapter's does: from the later of `from_offset` and the
    /// log's start (retention), records compaction removed skipped, up to
    /// `max_messages` offsets, with the log's end as it was when it began.
    async fn scan_event_ids(&self, topic: &str, partition: i32, from_offset: i64, max_messages: u64) -> Result<outbox_core::PartitionScan, String> {
        let w = world(&self.world);
        let key = (topic.to_owned(), partition);
        let log = w.logs.get(&key).map(Vec::as_slice).unwrap_or_default();
        let (low, end) = (w.log_start.get(&key).copied().unwrap_or(0), log.len() as i64);
        let start = from_offset.max(low).max(0);
        let high = end.min(start.saturating_add(i64::try_from(max_messages).unwrap_or(i64::MAX)));
        if start >= high {
            return Ok(outbox_core::PartitionScan { messages: Vec::new(), next_offset: start.max(from_offset), log_end: Some(end), log_start: Some(low) });
        }
        let messages = (start..high).filter_map(|o| log.get(o as usize).filter(|m| !m.compacted).map(|m| m.scanned.clone())).collect();
        Ok(outbox_core::PartitionScan { messages, next_offset: high, log_end: Some(end), log_start: Some(low) })
    }
}

impl SimBroker {
    fn scan(&self, destination: &Destination, event_id: &EventId, from: &outbox_core::ScanFrom) -> LookupOutcome {
        let w = world(&self.world);
        let log_key = (destination.topic.clone(), destination.partition);
        let start = w.log_start.get(&log_key).copied().unwrap_or(0);
        let end = w.logs.get(&log_key).map_or(0, |l| l.len() as i64);
        // The anchor check as the Kafka adapter makes it, decided by the same core function.
        let check = match outbox_core::anchor_to_read(from, start, end) {
            Ok((at, _)) => match w.logs.get(&log_key).and_then(|l| l.get(at as usize)).filter(|m| !m.compacted) {
                Some(m) if outbox_core::anchor_holds(from, Some(m.event_id.as_bytes()), Some(m.attempt_id.as_bytes())) => outbox_core::AnchorCheck::Holds,
                Some(_) => outbox_core::AnchorCheck::HoldsOther,
                None => outbox_core::AnchorCheck::NoRecord,
            },
            Err(known) => known,
        };
        let plan = match outbox_core::plan_absence_scan(&destination.topic, destination.partition, from, start, end, check) {
            Ok(plan) => plan,
            Err(why) => return LookupOutcome::Unavailable(why),
        };
        let Some(log) = w.logs.get(&log_key) else { return LookupOutcome::Absent };
        let from = usize::try_from(plan.start.max(start).max(0)).unwrap_or(usize::MAX);
        let mut found = Vec::new();
        let mut next = from as i64;
        for (offset, m) in log.iter().enumerate().skip(from) {
            // A compacted offset holds no record: the next record read is
            // above the offset expected, and the core says what that proves.
            if m.compacted {
                continue;
            }
            if let Err(why) = outbox_core::reconcile::check_no_hole(&destination.topic, destination.partition, next, offset as i64) {
                drop(w);
                world(&self.world).figures.lookups_over_holes += 1;
                return LookupOutcome::Unavailable(why);
            }
            next = offset as i64 + 1;
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
        // Commits wake the workers through the listening session; the poll
        // is the fallback for work no notice names.
        poll_interval_ms: 3_000,
        sweep_interval_ms: 1_000,
        // The listening session is the simulated one (SimListener): a
        // commit wakes the workers; the poll finds what no notice names
        // (expired leases, events put back to PENDING).
        listen: true,
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
        retry: retry_policy(),
        clock_skew_allowance_ms: 1_000,
        // The comparison (the topic scan, the condition findings) every
        // third round: a fifth of the gate's time when it ran every round.
        compare_every_rounds: 3,
        ..ReconcilerConfig::default()
    }
}

type Process = tokio::task::JoinHandle<()>;

/// The store and the broker client as a process on a host of its own sees them.
fn on_new_host(store: &SimStore, broker: &Arc<SimBroker>) -> (SimStore, Arc<SimBroker>) {
    let skew_ms = {
        let mut w = world(&store.world);
        let max = w.faults.clock_skew_ms;
        let skew = if max > 0 { w.clock_rng.range(-max, max) } else { 0 };
        if skew != 0 {
            w.figures.skewed_hosts += 1;
            w.note(|| format!("a new host, its clock {skew:+} ms off"));
        }
        skew
    };
    let id = {
        let mut w = world(&store.world);
        w.hosts += 1;
        w.hosts
    };
    let host = Arc::new(Host { id, skew_ms, ..Host::default() });
    (SimStore { host: host.clone(), ..store.clone() }, Arc::new(SimBroker { world: broker.world.clone(), host }))
}

/// A dispatcher process on a host of its own.
struct DispatcherProcess {
    task: Process,
    /// Its host.
    host: usize,
    /// Its counters (late ACKs among them).
    metrics: Arc<outbox_producer::DispatchMetrics>,
}

fn start_dispatcher(store: &SimStore, broker: &Arc<SimBroker>, cfg: &ServiceTraceConfig, name: String) -> DispatcherProcess {
    let (store, broker) = on_new_host(store, broker);
    let host = store.host.id;
    let d = Dispatcher::new(store, broker, dispatcher_config(name, cfg)).expect("a valid dispatcher config");
    let d = Arc::new(d);
    let metrics = d.metrics();
    let task = tokio::spawn(async move {
        let _ = d.run(std::future::pending()).await;
    });
    DispatcherProcess { task, host, metrics }
}

fn start_reconciler(store: &SimStore, broker: &Arc<SimBroker>, owner: String) -> Process {
    let (store, broker) = on_new_host(store, broker);
    let r = Reconciler::new(store, broker, reconciler_config(owner)).expect("a valid reconciler config");
    tokio::spawn(async move {
        let _ = r.run(std::future::pending()).await;
    })
}

/// The retry policy of the reconciler and of the operator's migrations: as
/// tight as the adapter's bound allows (the bound counts from the end of
/// the lease an attempt was sent under).
fn retry_policy() -> RetryPolicy {
    RetryPolicy { allow_retry: true, max_attempts: 10, in_flight_bound_ms: MESSAGE_TIMEOUT_MS + 2_000, recheck_ms: 2_000 }
}

/// The route after the operator's change: the same events, another topic.
fn new_route() -> RoutePolicy {
    RoutePolicy::new("order.created", CLUSTER, NEW_TOPIC, PARTITIONS)
}

/// The operator: moves every undelivered event of `TOPIC` to the new route
/// with the shipped `migrate_destination_in`, one event after another, and
/// asks again for the refused ones every few seconds until none is left.
fn start_operator(store: &SimStore, broker: &Arc<SimBroker>, name: String) -> Process {
    let store = store.clone();
    let broker = broker.clone();
    tokio::spawn(async move {
        let (route, retry) = (new_route(), retry_policy());
        loop {
            let (todo, left): (Vec<EventId>, bool) = {
                let st = store.inner.lock();
                let old: Vec<_> = st.events.values().filter(|e| e.destination.topic == TOPIC && !e.state.is_published() && e.state != EventState::Quarantined).collect();
                (old.iter().filter(|e| matches!(e.state, EventState::Pending | EventState::DispatchUnknown)).map(|e| e.envelope.event_id.clone()).collect(), !old.is_empty())
            };
            if !left {
                world(&store.world).note(|| format!("operator {name}: nothing left to migrate"));
                return;
            }
            for id in todo {
                let out = migrate_destination_in(&store, broker.as_ref(), &id, &route, &name, &retry, false, LEASE_MS).await;
                let mut w = world(&store.world);
                match out {
                    Ok(MigrationOutcome::Refused { reason }) => {
                        w.figures.migrations_refused += 1;
                        w.note(|| format!("operator {name}: {id} not migrated: {reason}"));
                    }
                    Ok(o) => w.note(|| format!("operator {name}: {id} {o:?}")),
                    Err(e) => w.note(|| format!("operator {name}: {id} failed: {e}")),
                }
            }
            let pause = world(&store.world).rng.range(1_000, 3_000);
            tokio::time::sleep(Duration::from_millis(pause as u64)).await;
        }
    })
}

/// The mandatory consumer and retention: the consumer reads `CLUSTER`'s
/// logs (sometimes not at all for a while: down, lagging) and a topic of
/// the same name on `OTHER_CLUSTER` (another log, far ahead); a retention
/// job runs the shipped retention pass (`outbox_producer::retention::purge_with`,
/// which `outbox purge` runs over PostgreSQL; its decision is `may_purge`)
/// on its watermarks every 0.6–6 s, in small pages, and every event
/// it purges is checked against the consumer's position on that event's
/// very log.
fn start_retention(shared: &Shared, inner: &MemoryStore) -> Process {
    let (shared, inner) = (shared.clone(), inner.clone());
    tokio::spawn(async move {
        let mandatory = vec![(CONSUMER.to_owned(), vec![TOPIC.to_owned(), NEW_TOPIC.to_owned()])];
        loop {
            let tick = world(&shared).rng.range(600, 6_000);
            tokio::time::sleep(Duration::from_millis(tick as u64)).await;
            let watermarks = {
                let mut w = world(&shared);
                let reading = !w.rng.chance(0.4);
                let logs: Vec<((String, i32), i64)> = w.logs.iter().map(|(k, l)| (k.clone(), l.len() as i64)).collect();
                for ((topic, partition), end) in logs {
                    let step = if reading { w.rng.range(0, 2) } else { 0 };
                    let at = w.consumer_at.entry((CLUSTER.to_owned(), topic, partition)).or_insert(0);
                    *at = (*at + step).min(end);
                }
                for partition in 0..PARTITIONS as i32 {
                    let step = w.rng.range(0, 6);
                    *w.consumer_at.entry((OTHER_CLUSTER.to_owned(), TOPIC.to_owned(), partition)).or_insert(0) += step;
                }
                let mut wms: Vec<MemoryWatermark> = w
                    .consumer_at
                    .iter()
                    .map(|((cluster_id, topic, partition), at)| MemoryWatermark {
                        consumer_id: CONSUMER.to_owned(),
                        cluster_id: cluster_id.clone(),
                        topic: topic.clone(),
                        topic_id: None,
                        partition: *partition,
                        committed_offset: *at,
                    })
                    .collect();
                // Rows come in no particular order.
                if w.rng.chance(0.5) {
                    wms.reverse();
                }
                wms
            };
            let now = world(&shared).now_ms();
            inner.set_now_ms(now);
            inner.set_retention_registry(mandatory.clone(), watermarks);
            let purged_before: BTreeSet<EventId> = inner.lock().events.values().filter(|e| e.state == EventState::Purged).map(|e| e.envelope.event_id.clone()).collect();
            let out = outbox_producer::retention::purge_with(&inner, now, &RETENTION_POLICY, false, |_| {}).await;
            let mut w = world(&shared);
            let out = match out {
                Ok(out) => out,
                Err(e) => {
                    w.violations.push(format!("service_error: the retention pass failed: {e}"));
                    w.figures.service_error += 1;
                    return;
                }
            };
            w.figures.held_by_consumers += out.held_by_consumers;
            let st = inner.lock();
            let purged: Vec<EventId> = st.events.values().filter(|e| e.state == EventState::Purged && !purged_before.contains(&e.envelope.event_id)).map(|e| e.envelope.event_id.clone()).collect();
            for id in &purged {
                let Some(slot) = st.events.get(id).and_then(|e| e.slot.as_ref()) else { continue };
                w.figures.purged += 1;
                let passed = w.consumer_at.get(&(slot.cluster_id.clone(), slot.topic.clone(), slot.partition)).copied();
                w.note(|| format!("retention purges {id} at {}/{}/p{}@{} ({CONSUMER} there at {passed:?})", slot.cluster_id, slot.topic, slot.partition, slot.offset));
                if passed.is_none_or(|at| at <= slot.offset) {
                    w.figures.premature_purge += 1;
                    let v = format!(
                        "premature_purge: {id} at {}/{}/p{}@{} purged while {CONSUMER}'s watermark on that log is {passed:?}",
                        slot.cluster_id, slot.topic, slot.partition, slot.offset
                    );
                    w.violations.push(v);
                }
            }
        }
    })
}

/// The processes of one trace the killer may kill.
struct Processes {
    dispatchers: Vec<DispatcherProcess>,
    /// Every dispatcher that ran, killed ones included.
    all_dispatchers: Vec<Arc<outbox_producer::DispatchMetrics>>,
    reconciler: Process,
    operator: Option<Process>,
    incarnation: usize,
}

async fn trace(cfg: ServiceTraceConfig, log: bool) -> ServiceOutcome {
    let mut rng = Rng::new(cfg.seed);
    let shared: Shared = Arc::new(Mutex::new(World {
        rng: Rng::new(cfg.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 1),
        clock_rng: Rng::new(cfg.seed.wrapping_mul(0xD6E8_FEB8_6659_FD93) ^ 2),
        faults: cfg.faults,
        on: true,
        start: Instant::now(),
        figures: ServiceFigures { traces: 1, ..Default::default() },
        log: log.then(Vec::new),
        logs: BTreeMap::new(),
        log_start: BTreeMap::new(),
        gone: Vec::new(),
        absent_at: BTreeMap::new(),
        consumer_at: BTreeMap::new(),
        violations: Vec::new(),
        old_degraded: false,
        findings: Vec::new(),
        in_client: 0,
        in_store: 0,
        late_writes: BTreeSet::new(),
        handed_by: BTreeSet::new(),
        tried_by: BTreeSet::new(),
        acks_delivered: Vec::new(),
        killed_hosts: BTreeSet::new(),
        hosts: 0,
        // Drawn on their own, so the rest of a trace is as it was before
        // forgers were added.
        forge: {
            let mut f = Rng::new(cfg.seed ^ 0xf0_29ed);
            if f.chance(FORGED_TRACES) { 0.1 + f.unit() * 0.4 } else { 0.0 }
        },
        forge_rng: Rng::new(cfg.seed ^ 0xf0_29ed_0002),
        commits: 0,
        committed: Arc::new(tokio::sync::Notify::new()),
        listen_rng: Rng::new(cfg.seed ^ 0x0011_57e2),
        scan_gaps: Vec::new(),
        copies_reported: BTreeSet::new(),
    }));
    world(&shared).note(|| format!("trace {}: {cfg:?}", cfg.seed));
    let inner = MemoryStore::new();
    inner.set_now_ms(T0_MS);
    let store = SimStore { inner: inner.clone(), world: shared.clone(), pause: 0.0, host: Arc::new(Host::default()) };
    let op_store = SimStore { pause: cfg.faults.operator_pause, ..store.clone() };
    let broker = Arc::new(SimBroker { world: shared.clone(), host: Arc::new(Host::default()) });
    // Some traces route without per-key order (events of one key may be in
    // flight together): then a later record of a key can be written while
    // an earlier one's outcome is unknown, and compaction can remove that
    // earlier record. Drawn on its own, like the other late additions.
    let ordering = if Rng::new(cfg.seed ^ 0x07de_7ed).chance(UNORDERED_TRACES) { outbox_core::Ordering::None } else { outbox_core::Ordering::Key };
    let policy = RoutePolicy { ordering, ..RoutePolicy::new("order.created", CLUSTER, TOPIC, PARTITIONS) };
    let moved_policy = RoutePolicy { ordering, ..new_route() };
    if ordering == outbox_core::Ordering::None {
        world(&shared).note(|| "the route has no per-key order".into());
    }

    let mut incarnation = 0usize;
    let dispatchers: Vec<DispatcherProcess> = (0..cfg.dispatchers)
        .map(|d| {
            incarnation += 1;
            start_dispatcher(&store, &broker, &cfg, format!("d{d}-{incarnation}"))
        })
        .collect();
    incarnation += 1;
    let reconciler = start_reconciler(&store, &broker, format!("r-{incarnation}"));
    let all_dispatchers = dispatchers.iter().map(|d| d.metrics.clone()).collect();
    let mut procs = Processes { dispatchers, all_dispatchers, reconciler, operator: None, incarnation };
    let mut consumers = consumers::Consumers::start(&shared, cfg.seed);
    let retention = cfg.faults.retention.then(|| start_retention(&shared, &inner));
    if let Some(at) = cfg.faults.truncate_at_ms {
        let partition = rng.below(u64::from(PARTITIONS)) as i32;
        let w = shared.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(at as u64)).await;
            let mut w = world(&w);
            let key = (TOPIC.to_owned(), partition);
            let end = w.logs.get(&key).map_or(0, |l| l.len() as i64);
            w.log_start.insert(key, end);
            w.figures.truncations += 1;
            w.note(|| format!("retention deletes {TOPIC}/p{partition} below {end}"));
        });
    }

    // The log cleaner compacts a partition of the topic now and then
    // (outbox topics should not be compacted: the product must stay sound
    // when one is). Its own generator: the rest of the trace draws as it
    // did before compaction was added.
    {
        let mut crng = Rng::new(cfg.seed ^ 0xc0_4ac7);
        if crng.chance(COMPACTED_TRACES) {
            for _ in 0..crng.range(1, 5) {
                let (at, partition) = (crng.range(1_000, FAULT_PHASE_MS), crng.below(u64::from(PARTITIONS)) as i32);
                let w = shared.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(at as u64)).await;
                    let mut w = world(&w);
                    let n = compact(w.logs.get_mut(&(TOPIC.to_owned(), partition)).map(|l| l.as_mut_slice()).unwrap_or_default());
                    w.figures.compactions += 1;
                    w.figures.records_compacted += n;
                    w.note(|| format!("the log cleaner compacts {TOPIC}/p{partition}: {n} records removed"));
                });
            }
        }
    }

    // A topic deleted and created again, a cluster replaced by an empty one.
    for (at, cluster) in [(cfg.faults.recreate_topic_at_ms, false), (cfg.faults.replace_cluster_at_ms, true)] {
        let Some(at) = at else { continue };
        let w = shared.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(at as u64)).await;
            let mut w = world(&w);
            if cluster {
                w.reset_logs(|_| true);
                w.note(|| format!("{CLUSTER} is replaced by an empty cluster: every topic's logs start again at 0"));
            } else {
                w.reset_logs(|t| t == TOPIC);
                w.note(|| format!("{TOPIC} is deleted and created again: its logs start again at 0"));
            }
        });
    }

    // Emitters commit events at random times; a killer kills processes; an
    // operator may move the route and migrate what is not delivered yet.
    let mut emitted: Vec<(EventId, String)> = Vec::new();
    let mut next_kill = if cfg.faults.kill_every_ms > 0 { rng.range(1, 2 * cfg.faults.kill_every_ms) } else { i64::MAX };
    let mut emit_at = Vec::with_capacity(cfg.events);
    let mut t = 0i64;
    for _ in 0..cfg.events {
        t += rng.range(0, 2 * FAULT_PHASE_MS / cfg.events.max(1) as i64);
        emit_at.push(t);
    }
    let mut migrate_at = cfg.faults.migrate_at_ms.unwrap_or(i64::MAX);
    // The old topic degrades first; the operator reacts a few seconds later.
    if migrate_at < i64::MAX {
        let at = (migrate_at - rng.range(2_000, 15_000)).max(0);
        let w = shared.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(at as u64)).await;
            let mut w = world(&w);
            w.old_degraded = true;
            w.note(|| format!("{TOPIC} degrades: its writes lose their ACKs, its lookups are slow"));
        });
    }
    let mut route_moved = false;
    let mut clock = 0i64;
    let mut i = 0usize;
    // Business commands whose commit answer the client may not have seen:
    // it retries them (same key, same content) at a later emit, and emit
    // must answer with the first event. Their own generator, so the rest of
    // the trace draws as it did before retries were added.
    let mut retry_rng = Rng::new(cfg.seed ^ 0xc0_ffee_5eed);
    let mut committed: Vec<(String, String, Vec<u8>, i64, EventId)> = Vec::new();
    loop {
        let emit_due = emit_at.get(i).copied().unwrap_or(i64::MAX);
        let end = if i >= emit_at.len() { FAULT_PHASE_MS.max(clock) } else { i64::MAX };
        let until = emit_due.min(next_kill).min(migrate_at).min(end).min(consumers.next_due());
        tokio::time::sleep(Duration::from_millis((until - clock).max(0) as u64)).await;
        clock = until;
        if consumers.next_due() == until {
            consumers.tick(clock);
            continue;
        }
        if next_kill == until {
            kill_one(&shared, &mut rng, &store, &op_store, &broker, &cfg, &mut procs);
            next_kill = clock + rng.range(1, 2 * cfg.faults.kill_every_ms);
            continue;
        }
        if migrate_at == until {
            migrate_at = i64::MAX;
            route_moved = true;

            procs.incarnation += 1;
            world(&shared).note(|| format!("the route moves to {NEW_TOPIC}; operator ops-{} migrates {TOPIC}'s undelivered events", procs.incarnation));
            procs.operator = Some(start_operator(&op_store, &broker, format!("ops-{}", procs.incarnation)));
            continue;
        }
        if emit_due != until {
            break;
        }
        let key = format!("o-{}", rng.below(cfg.keys as u64));
        let payload = format!("{{\"order\":\"{key}\",\"n\":{i}}}").into_bytes();
        let now = world(&shared).now_ms();
        inner.set_now_ms(now);
        if !committed.is_empty() && retry_rng.chance(COMMAND_RETRY) {
            let (command, aggregate, payload, version, first) = committed[retry_rng.below(committed.len() as u64) as usize].clone();
            retry_command(&shared, &inner, if route_moved { &moved_policy } else { &policy }, (&command, &aggregate, &payload, version, &first), now);
        }
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
        let route = if route_moved { &moved_policy } else { &policy };
        let frozen = request.validate(outbox_core::DEFAULT_MAX_PAYLOAD_BYTES).and_then(|_| request.freeze(EventId::generate(now as u64), now, i as u64 + 1, route));
        match frozen.and_then(|(env, dest)| inner.insert(&command, env, dest, payload.clone())) {
            Ok(id) => {
                {
                    let mut w = world(&shared);
                    w.commits += 1;
                    w.committed.notify_waiters();
                    w.note(|| format!("commit {id} key {key} to {}", route.topic));
                }
                committed.push((command.clone(), key.clone(), payload.clone(), i as i64 + 1, id.clone()));
                emitted.push((id, key));
            }
            Err(e) => world(&shared).note(|| format!("emit refused: {e}")),
        }
        i += 1;
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
        // A dispatcher holding an ACK it has not recorded yet (stalled in
        // another store call) is not done: the trace waits for it.
        let idle = { let w = world(&shared); w.in_client == 0 && w.in_store == 0 && w.untried_acks().next().is_none() && scanned_to_end(&inner, &w) };
        if idle && all_settled(&inner, &reported) && consumers.caught_up(&inner) {
            settled = true;
            break;
        }
    }
    for p in procs.dispatchers.drain(..).map(|d| d.task).chain([procs.reconciler]).chain(procs.operator).chain(retention) {
        p.abort();
    }
    let late_acks: u64 = procs.all_dispatchers.iter().map(|m| m.late_acks.load(std::sync::atomic::Ordering::Relaxed)).sum();
    tokio::task::yield_now().await;

    let mut w = world(&shared);
    let mut violations = std::mem::take(&mut w.violations);
    if !settled {
        w.figures.stuck += 1;
        violations.push(format!("stuck: not settled within {SETTLE_LIMIT_MS} ms of the faults stopping"));
    }
    check(&inner, &mut w, &emitted, &mut violations);
    check_acks(&inner, &mut w, late_acks, &mut violations);
    drop(w);
    consumers.finish(&inner, &mut violations);
    let unknown_resolved_ms = inner.lock().events.values().flat_map(|e| e.unknown_resolved_after_ms.iter().copied()).collect();
    let mut w = world(&shared);
    if let Some(log) = &mut w.log {
        for v in &violations {
            log.push(format!("VIOLATION {v}"));
        }
    }
    ServiceOutcome { seed: cfg.seed, figures: w.figures.clone(), violations, log: w.log.take(), unknown_resolved_ms }
}

/// Every ACK the broker client answered to a dispatcher that lived on was
/// handed by that dispatcher to `acceptDispatchReceipt` (SPEC §5: the
/// result of a request already sent is never thrown away, whatever became
/// of its claim). A killed dispatcher's ACKs are the reconciler's to find.
fn check_acks(store: &MemoryStore, w: &mut World, late_acks: u64, violations: &mut Vec<String>) {
    w.figures.late_acks += late_acks;
    w.figures.acks_to_live_senders += w.acks_delivered.iter().filter(|(host, ..)| !w.killed_hosts.contains(host)).count() as u64;
    // Receipts the store holds, by attempt.
    let st = store.lock();
    let held: BTreeSet<String> = st.events.values().filter_map(|e| e.slot.as_ref()).chain(&st.duplicates).map(|r| r.attempt_id.to_string()).collect();
    let event_of: BTreeMap<String, String> = st.attempts.values().flatten().map(|a| (a.attempt_id.to_string(), a.event_id.to_string())).collect();
    // Closed by a reconciler's proof about the log as it is now (the copy
    // went with a log since lost; a copy still there is `refuted_absence`).
    let proven_absent: BTreeSet<String> = st.attempts.values().flatten().filter(|a| a.state == AttemptState::Absent).map(|a| a.attempt_id.to_string()).collect();
    drop(st);
    let mut dropped = Vec::new();
    for (host, attempt, at) in w.unrecorded_acks() {
        // Tried, its store call failed past the dispatcher's retry budget:
        // the ACK is the reconciler's to find, and must have converged, or
        // its event be reported (`log_unavailable`: the log cannot say), or
        // its attempt be proven absent from the log there is now.
        let reported = event_of.get(attempt).is_some_and(|e| w.findings.iter().any(|(k, id)| k == "log_unavailable" && id == e));
        if w.tried_by.contains(&(*host, attempt.clone())) && (held.contains(attempt) || reported || proven_absent.contains(attempt)) {
            continue;
        }
        dropped.push(format!("ack_dropped: the ACK of attempt {attempt} at {at} reached host {host}'s dispatcher, which lived on and never recorded it"));
    }
    w.figures.ack_dropped += dropped.len() as u64;
    violations.extend(dropped);
}

/// The share of traces whose route has no per-key order.
const UNORDERED_TRACES: f64 = 0.15;
/// The share of traces with a forger (see `SimBroker::forge`).
const FORGED_TRACES: f64 = 0.1;
/// The share of traces whose topic is compacted now and then.
const COMPACTED_TRACES: f64 = 0.3;
/// The records at a log's end that compaction leaves alone (the active segment).
const ACTIVE_SEGMENT: usize = 2;

/// Compacts `log` as Kafka's log cleaner does: a record outside the active
/// segment whose key a later record has is removed. Answers how many were.
fn compact(log: &mut [Stored]) -> u64 {
    let cleanable = log.len().saturating_sub(ACTIVE_SEGMENT);
    let mut removed = 0;
    for i in 0..cleanable {
        if !log[i].compacted && log[i + 1..].iter().any(|later| !later.compacted && later.key == log[i].key) {
            log[i].compacted = true;
            removed += 1;
        }
    }
    removed
}

/// Of the emits, the share that first retries an earlier committed command.
const COMMAND_RETRY: f64 = 0.15;

/// A client retries a committed command (its commit answer was lost):
/// the shipped command decision must answer with the command's first
/// event, whatever the aggregate emitted since.
fn retry_command(shared: &Shared, store: &MemoryStore, route: &RoutePolicy, (command, aggregate, payload, version, first): (&str, &str, &[u8], i64, &EventId), now: i64) {
    let request = EmitRequest {
        command_key: command,
        tenant: "t1",
        aggregate_type: "order",
        aggregate_id: aggregate,
        aggregate_version: version,
        event_type: "order.created",
        payload_schema: "order-v1",
        payload,
    };
    // An id outside the seeded generator's stream, so a retry does not move
    // the ids of the events after it; unique, in case it is inserted.
    let mut w = world(shared);
    w.figures.commands_retried += 1;
    let fresh = EventId::from_parts(now.max(0) as u64, (1 << 79) | u128::from(w.figures.commands_retried));
    let answer = request.freeze(fresh, now, 0, route).and_then(|(env, dest)| store.insert(command, env, dest, payload.to_vec()));
    match answer {
        Ok(id) if &id == first => w.note(|| format!("retry of {command} answered with {id}")),
        other => {
            w.figures.second_logical_event_id += 1;
            w.violations.push(format!("second_logical_event_id: the retry of {command} (first event {first}) was answered {other:?}"));
        }
    }
}

fn kill_one(shared: &Shared, rng: &mut Rng, store: &SimStore, op_store: &SimStore, broker: &Arc<SimBroker>, cfg: &ServiceTraceConfig, procs: &mut Processes) {
    procs.incarnation += 1;
    let incarnation = procs.incarnation;
    let operator_alive = procs.operator.as_ref().is_some_and(|p| !p.is_finished());
    let n = procs.dispatchers.len() as u64 + 1 + u64::from(operator_alive);
    let victim = rng.below(n) as usize;
    let mut w = world(shared);
    w.figures.kills += 1;
    if victim == procs.dispatchers.len() {
        w.note(|| format!("kill the reconciler; restart as r-{incarnation}"));
        drop(w);
        procs.reconciler.abort();
        procs.reconciler = start_reconciler(store, broker, format!("r-{incarnation}"));
    } else if victim > procs.dispatchers.len() {
        w.note(|| format!("kill the operator's migration; it starts again as ops-{incarnation}"));
        drop(w);
        if let Some(p) = procs.operator.take() {
            p.abort();
        }
        procs.operator = Some(start_operator(op_store, broker, format!("ops-{incarnation}")));
    } else {
        w.note(|| format!("kill dispatcher {victim}; restart as d{victim}-{incarnation}"));
        w.killed_hosts.insert(procs.dispatchers[victim].host);
        drop(w);
        procs.dispatchers[victim].task.abort();
        procs.dispatchers[victim] = start_dispatcher(store, broker, cfg, format!("d{victim}-{incarnation}"));
        procs.all_dispatchers.push(procs.dispatchers[victim].metrics.clone());
    }
}

/// Whether the reconciler's bypass scan has read every partition's current
/// log to its end (its cursor waits at a copy whose attempt may still be
/// answered, so this holds only once each such copy was judged).
fn scanned_to_end(store: &MemoryStore, w: &World) -> bool {
    let st = store.lock();
    w.logs.iter().all(|((topic, partition), log)| st.bypass_cursors.get(&(CLUSTER.to_owned(), topic.clone(), *partition)).is_some_and(|c| c.next_offset >= log.len() as i64))
}

/// Every event published (retained and purged included) or quarantined, or
/// unknown and reported (its log was truncated), or waiting behind such a
/// predecessor on its key and destination (which holds the key by design).
fn all_settled(store: &MemoryStore, reported: &BTreeSet<String>) -> bool {
    let st = store.lock();
    let mut blocked_keys = BTreeSet::new();
    let mut by_seq: Vec<_> = st.events.values().collect();
    by_seq.sort_by_key(|e| e.seq);
    for ev in by_seq {
        let key = (ev.destination.topic.clone(), ev.destination.routing_key.clone());
        match ev.state {
            s if s.is_published() => {}
            EventState::Quarantined => {
                blocked_keys.insert(key);
            }
            EventState::DispatchUnknown | EventState::Reconciling if reported.contains(ev.envelope.event_id.as_str()) => {
                blocked_keys.insert(key);
            }
            EventState::Pending if blocked_keys.contains(&key) => {}
            _ => return false,
        }
    }
    true
}

fn check(store: &MemoryStore, w: &mut World, emitted: &[(EventId, String)], violations: &mut Vec<String>) {
    let st = store.lock();
    w.figures.events += emitted.len() as u64;
    w.figures.migrations += st.migrations.len() as u64;
    // Receipts the store holds, by position.
    let mut receipts: BTreeMap<(String, i32, i64), Vec<(String, String)>> = BTreeMap::new();
    for ev in st.events.values() {
        if let Some(slot) = &ev.slot {
            receipts.entry((slot.topic.clone(), slot.partition, slot.offset)).or_default().push((slot.event_id.to_string(), slot.attempt_id.to_string()));
        }
    }
    for d in &st.duplicates {
        receipts.entry((d.topic.clone(), d.partition, d.offset)).or_default().push((d.event_id.to_string(), d.attempt_id.to_string()));
    }
    for ((t, p, o), rs) in &receipts {
        // Receipts at one position of two logs (the topic recreated, the
        // cluster replaced in between: offsets restart) are no conflict.
        let mut by_log: BTreeMap<Option<usize>, BTreeSet<&String>> = BTreeMap::new();
        for (e, a) in rs {
            by_log.entry(w.log_holding(t, *p, *o, e, a).map(|(i, ..)| i)).or_default().insert(e);
        }
        if let Some(events) = by_log.values().find(|events| events.len() > 1) {
            w.figures.inconsistent_offsets += 1;
            violations.push(format!("inconsistent_offsets: {t}/p{p}@{o} holds receipts of {events:?}"));
        }
    }
    let attempts_by_id: BTreeMap<String, &AttemptRecord> = st.attempts.values().flatten().map(|a| (a.attempt_id.to_string(), a)).collect();
    w.figures.attempts += attempts_by_id.len() as u64;
    let migrated: BTreeSet<&EventId> = st.migrations.iter().map(|m| &m.event_id).collect();
    // Every event: published with its slot holding it, or settled otherwise.
    let mut published_by_key: BTreeMap<String, Vec<(u64, usize, i32, i64)>> = BTreeMap::new();
    for (id, key) in emitted {
        let Some(ev) = st.events.get(id) else {
            w.figures.lost_write += 1;
            violations.push(format!("lost_write: {id} committed and not in the outbox"));
            continue;
        };
        match ev.state {
            s if s.is_published() => {
                w.figures.published += 1;
                let Some(slot) = &ev.slot else {
                    w.figures.lost_write += 1;
                    violations.push(format!("lost_write: {id} PUBLISHED without a receipt"));
                    continue;
                };
                // The receipt's position holds its message, in the current
                // log or in one that is gone since (the broker lost it with
                // the topic or the cluster: not the outbox's loss).
                let held = w.log_holding(&slot.topic, slot.partition, slot.offset, id.as_str(), slot.attempt_id.as_str());
                if held.is_some_and(|(_, _, m)| sha256_digest(&m.payload) != ev.envelope.payload_digest) {
                    w.figures.divergent_accepted += 1;
                    violations.push(format!("divergent_accepted: {id}'s slot {}/p{}@{} holds other bytes than its frozen payload", slot.topic, slot.partition, slot.offset));
                    continue;
                }
                let holding = held.map(|(i, current, _)| (i, current));
                match holding {
                    Some((_, false)) => w.figures.receipt_positions_lost += 1,
                    Some(_) => {}
                    None => {
                        w.figures.lost_write += 1;
                        violations.push(format!("lost_write: {id}'s receipt {}/p{}@{} does not hold its message", slot.topic, slot.partition, slot.offset));
                    }
                }
                let log_index = holding.map_or(usize::MAX, |(i, _)| i);
                // A migrated event left its key's order on purpose (the
                // operator moved it after later events took the new route).
                if !migrated.contains(id) && ev.destination.ordering == outbox_core::Ordering::Key {
                    published_by_key.entry(format!("{}/{key}", slot.topic)).or_default().push((ev.seq, log_index, slot.partition, slot.offset));
                }
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
    // When a proof closed an attempt ABSENT: a reconciler's, or a migration's.
    let closed_at = |attempt: &str| {
        w.absent_at.get(attempt).copied().or_else(|| st.migrations.iter().find(|r| r.closed_attempts.iter().any(|a| a.as_str() == attempt)).map(|r| r.at_ms))
    };
    // Attempts with a copy in a log that is gone, and when the first went.
    let mut in_gone: BTreeMap<&str, i64> = BTreeMap::new();
    for g in &w.gone {
        for m in &g.log {
            in_gone.entry(m.attempt_id.as_str()).or_insert(g.gone_at_ms);
        }
    }
    for a in st.audit.iter().filter(|a| a.action == "absence_proof_refuted") {
        // A paused host's write, landed after the in-flight bound, or a
        // write into a log gone before the proof (which was about the log
        // that replaced it, and true of it) whose ACK came after it: the
        // protocol's answer is this finding and the receipt's acceptance.
        let attempt = a.detail.split(' ').next().unwrap_or_default();
        let explained = w.late_writes.contains(attempt) || in_gone.get(attempt).is_some_and(|g| closed_at(attempt).is_some_and(|c| c >= *g));
        if explained && attempts_by_id.get(attempt).is_some_and(|r| r.state == AttemptState::Acked) {
            w.figures.absence_refuted_late += 1;
            continue;
        }
        w.figures.refuted_absence += 1;
        violations.push(format!("refuted_absence: the store saw a copy of {} after proving it absent ({})", a.event_id, a.detail));
    }
    if w.log.is_some() {
        let mut lines = Vec::new();
        for ev in st.events.values() {
            lines.push(format!(
                "final {} seq {} {:?} gen {} slot {:?}",
                ev.envelope.event_id,
                ev.seq,
                ev.state,
                ev.envelope.envelope_generation,
                ev.slot.as_ref().map(|r| (r.topic.clone(), r.partition, r.offset, r.attempt_id.to_string()))
            ));
            for a in st.attempts.get(&ev.envelope.event_id).into_iter().flatten() {
                lines.push(format!("      attempt {} by {} gen {} envelope gen {} {:?}", a.attempt_id, a.owner, a.claim_generation, a.envelope_generation, a.state));
            }
        }
        for a in &st.audit {
            lines.push(format!("audit {} {} {}", a.event_id, a.action, a.detail));
        }
        if let Some(log) = &mut w.log {
            log.extend(lines);
        }
    }
    // Events a paused host wrote late.
    let late_events: BTreeSet<String> = w.late_writes.iter().filter_map(|a| attempts_by_id.get(a)).map(|a| a.event_id.to_string()).collect();
    // Every copy in the log is accounted for.
    let mut copies_per_event: BTreeMap<&str, u64> = BTreeMap::new();
    // The current logs, then those that are gone (with when they went), each
    // with its incarnation.
    let logs: Vec<_> = w
        .logs
        .iter()
        .map(|(key, l)| (&key.0, &key.1, l, None, w.incarnation(key)))
        .chain(w.gone.iter().enumerate().map(|(i, g)| (&g.key.0, &g.key.1, &g.log, Some(g.gone_at_ms), w.gone[..i].iter().filter(|o| o.key == g.key).count())))
        .collect();
    for (t, p, log, gone_at, incarnation) in logs {
        for (o, m) in log.iter().enumerate() {
            // Not the outbox's write: it must never fill a slot (above).
            if m.forged {
                continue;
            }
            *copies_per_event.entry(m.event_id.as_str()).or_default() += 1;
            let recorded = receipts.get(&(t.clone(), *p, o as i64)).is_some_and(|rs| rs.iter().any(|(e, _)| e == &m.event_id));
            let attempt = attempts_by_id.get(&m.attempt_id);
            // A copy of the generation a migration left behind, in the
            // target it left: the migration's proof of absence was wrong.
            // A log gone before the migration's proof was not the log it
            // proved absence in.
            let left_behind = attempt.is_some_and(|a| {
                st.migrations.iter().any(|r| {
                    r.event_id == a.event_id && r.from_generation == a.envelope_generation && r.from_destination.topic == *t && gone_at.is_none_or(|g| r.at_ms < g)
                })
            });
            if left_behind {
                w.figures.migrated_over_copy += 1;
                violations.push(format!("migrated_over_copy: {t}/p{p}@{o} holds {} attempt {} of the generation its migration proved absent from {t}", m.event_id, m.attempt_id));
                continue;
            }
            // The reconciler's bypass scan recorded a finding naming this
            // copy (`unrecorded_copy`, `divergent_copy`): its evidence.
            let reported = w.copies_reported.contains(&(t.clone(), *p, o as i64, m.attempt_id.clone()))
                // Or deleted from the log before the scan read it, and the
                // scan said so (`scan_gap`).
                || w.scan_gaps.iter().any(|((gt, gp), gi, from, to)| gt == t && gp == p && *gi == incarnation && (*from..*to).contains(&(o as i64)));
            match attempt.map(|a| a.state) {
                // A copy of an event a paused host wrote late (this copy, or
                // the retry the refuted proof let through, whose event the
                // late copy then published), whose receipt never reached the
                // store (its sender killed, its ACK lost): only the bypass
                // scan tells the store of it. One the store was handed and
                // left ABSENT is a genuine receipt discarded.
                Some(AttemptState::Absent | AttemptState::Unknown | AttemptState::Sending)
                    if late_events.contains(m.event_id.as_str()) && !w.handed_by.iter().any(|(_, a)| *a == m.attempt_id) =>
                {
                    if reported {
                        w.figures.copies_reported += 1;
                    } else {
                        w.figures.late_copies_unheard += 1;
                    }
                }
                // A copy in a log gone before the proof that closed its
                // attempt (a reconciler's, or a migration's): the proof was
                // about the log that replaced it, and true of it.
                Some(AttemptState::Absent) if gone_at.is_some_and(|g| closed_at(&m.attempt_id).is_some_and(|closed| closed >= g)) => {}
                Some(AttemptState::NotSent | AttemptState::Absent) => {
                    w.figures.refuted_absence += 1;
                    violations.push(format!("refuted_absence: {t}/p{p}@{o} holds {} attempt {}, closed {:?}", m.event_id, m.attempt_id, attempt.map(|a| a.state)));
                }
                _ if recorded => {}
                // Reported instead: its event's log was truncated before a
                // lookup could find it (the finding `log_unavailable`).
                _ if w.findings.iter().any(|(k, e)| k == "log_unavailable" && *e == m.event_id) => {}
                // A transport copy of an attempt whose receipt the store
                // holds elsewhere (the client wrote it twice): evidence the
                // reconciler's scan reports, not a second send.
                Some(AttemptState::Acked) => {}
                // A copy of an attempt still open (its ACK lost) of an
                // event another receipt published: no reconciliation asks
                // about an attempt of a published event, so no receipt
                // records it. The reconciler's bypass scan reports it
                // (`unrecorded_copy`) once the attempt is past its in-flight
                // bound (`outbox_core::compare::judge_scanned`; test
                // `sound.rs::a_copy_of_an_attempt_left_open_by_a_late_ack_is_a_finding`).
                Some(AttemptState::Unknown | AttemptState::Sending) if reported => {
                    w.figures.copies_reported += 1;
                }
                // A copy compaction removed: no longer in the log, nothing
                // can find it (and no receipt is owed for it).
                _ if m.compacted => {}
                other => {
                    w.figures.duplicate += 1;
                    violations.push(format!("duplicate: {t}/p{p}@{o} holds {} attempt {} ({other:?}), no receipt accounts for it", m.event_id, m.attempt_id));
                }
            }
        }
    }
    w.figures.duplicates_in_log += copies_per_event.values().map(|n| n.saturating_sub(1)).sum::<u64>();
    // Per key and topic, publication follows commit order: positions rise with seq.
    for (key, mut evs) in published_by_key {
        evs.sort();
        for pair in evs.windows(2) {
            let ((s1, l1, p1, o1), (s2, l2, p2, o2)) = (pair[0], pair[1]);
            // Offsets compare within one log only (a recreated topic's restart at 0).
            if p1 == p2 && l1 == l2 && o2 < o1 {
                w.figures.order_violation += 1;
                violations.push(format!("order_violation: key {key}: seq {s2} at p{p2}@{o2} before seq {s1} at p{p1}@{o1}"));
            }
        }
    }
}

/// SPEC §10's bound on the time to resolve an unknown outcome: p99 within
/// 15 minutes (of simulated time).
pub const UNKNOWN_P99_LIMIT_MS: i64 = 15 * 60 * 1_000;

/// The result of a gate run.
#[derive(Debug, Clone)]
pub struct ServicesGate {
    /// Every trace's counters, summed.
    pub figures: ServiceFigures,
    /// The smallest failing seeds (at most 16).
    pub failing_seeds: Vec<u64>,
    /// Wall time of the run.
    pub wall_seconds: f64,
    /// p99 of the time an unknown outcome took to resolve, virtual ms.
    pub unknown_p99_ms: i64,
    /// The longest, virtual ms.
    pub unknown_max_ms: i64,
    /// How many unknown outcomes were resolved.
    pub unknown_samples: usize,
}

impl ServicesGate {
    /// Zero violations, and unknown outcomes resolved within
    /// [`UNKNOWN_P99_LIMIT_MS`] at the 99th percentile.
    pub fn pass(&self) -> bool {
        self.figures.clean() && self.unknown_p99_ms <= UNKNOWN_P99_LIMIT_MS
    }
}

/// The services gate over `traces` seeds from `first_seed`, on `threads`
/// threads (0: all cores): counters, the smallest failing seeds, wall seconds.
pub fn run_services_gate(first_seed: u64, traces: u64, mutation: Option<&'static str>, threads: usize) -> (ServiceFigures, Vec<u64>, f64) {
    let g = run_services_gate_report(first_seed, traces, mutation, threads);
    (g.figures, g.failing_seeds, g.wall_seconds)
}

/// The services gate over `traces` seeds from `first_seed`, on `threads`
/// threads (0: all cores).
pub fn run_services_gate_report(first_seed: u64, traces: u64, mutation: Option<&'static str>, threads: usize) -> ServicesGate {
    let threads = if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
    let start = std::time::Instant::now();
    let next = std::sync::atomic::AtomicU64::new(0);
    let parts: Vec<(ServiceFigures, Vec<u64>, Vec<i64>)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut figures = ServiceFigures::default();
                    let mut failing = Vec::new();
                    let mut resolved = Vec::new();
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
                            resolved.extend_from_slice(&out.unknown_resolved_ms);
                        }
                    }
                    (figures, failing, resolved)
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().expect("a simulator thread panicked")).collect()
    });
    let mut figures = ServiceFigures::default();
    let mut failing = Vec::new();
    let mut resolved = Vec::new();
    for (f, s, r) in parts {
        figures.merge(&f);
        failing.extend(s);
        resolved.extend(r);
    }
    failing.sort_unstable();
    failing.truncate(16);
    resolved.sort_unstable();
    let unknown_p99_ms = if resolved.is_empty() { 0 } else { resolved[((resolved.len() - 1) as f64 * 0.99).round() as usize] };
    ServicesGate {
        figures,
        failing_seeds: failing,
        wall_seconds: start.elapsed().as_secs_f64(),
        unknown_p99_ms,
        unknown_max_ms: resolved.last().copied().unwrap_or(0),
        unknown_samples: resolved.len(),
    }
}
