//! One trace's shape and fault probabilities, all drawn from its seed.

use super::FAULT_PHASE_MS;
use crate::rng::Rng;

/// Which path the in-memory store runs: today's per-event claims, or the
/// insert-only stream with its exception lane (`MemoryStore::with_stream`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StoreMode {
    /// Per-event claims (the default until the stream's cutover).
    #[default]
    Claims,
    /// Bucket leases and snapshot-cut batches.
    Stream,
}

impl StoreMode {
    /// `claims` or `stream`.
    pub fn as_str(self) -> &'static str {
        match self {
            StoreMode::Claims => "claims",
            StoreMode::Stream => "stream",
        }
    }

    /// Parses [`StoreMode::as_str`].
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "claims" => Ok(StoreMode::Claims),
            "stream" => Ok(StoreMode::Stream),
            other => Err(format!("unknown mode {other:?} (claims or stream)")),
        }
    }
}

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
