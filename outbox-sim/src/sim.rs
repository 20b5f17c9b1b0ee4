//! One trace: business clients, dispatchers, reconcilers, a simulated broker
//! and consumers, driven by one seed over [`MemoryStore`] through the
//! [`OutboxStore`] trait, then run to quiescence with faults off and checked.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;

use outbox_core::memory::MemoryStore;
use outbox_core::{
    decide_migration, MigrationDecision, MigrationProof, MigrationRefusal, AttemptState, decide_after_submit, decide_reconcile, scan_lower_bound, sha256_digest, AttemptId, AttemptRecord, BrokerReceipt, ClaimToken, ClaimedEvent, Destination, EmitRequest,
    EventId, EventState, FenceOutcome, LookupOutcome, OutboxStore, ReceiptDecision, ReceiptOutcome, RecheckReason, ReconcileDecision, ReconcileTask,
    RetryPolicy, RoutePolicy,
};

use crate::figures::Figures;
use crate::mutation::Mutation;
use crate::now;
use crate::rng::Rng;

/// Simulated time at the start of every trace (ms since the epoch).
pub const T0_MS: i64 = 1_700_000_000_000;
/// Lease of every dispatcher and reconciler claim.
pub const LEASE_MS: i64 = 10_000;
/// The producer's `message.timeout.ms`: a message handed to the client is
/// written within this time of the send, or never.
pub const MESSAGE_TIMEOUT_MS: i64 = 5_000;
/// The reconcile policy. The in-flight bound covers the whole window in which
/// a registered attempt may still land in the log: the holder sends only while
/// its lease (taken at most [`LEASE_MS`] before registration) is live, and the
/// client writes within [`MESSAGE_TIMEOUT_MS`] of the send; plus a margin.
pub const RETRY_POLICY: RetryPolicy = RetryPolicy { allow_retry: true, max_attempts: 10, in_flight_bound_ms: LEASE_MS + MESSAGE_TIMEOUT_MS + 5_000, recheck_ms: 5_000 };
/// Rounds of the fault-free quiescence phase before a trace is declared stuck.
pub const QUIESCENCE_ROUNDS: usize = 2_000;
/// Claim batch size.
const BATCH: usize = 2;
const TENANT: &str = "t1";
const EVENT_TYPE: &str = "order.created";

/// How a route policy revision changes the route (PROTOCOL §7: it affects only
/// events committed after it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Revision {
    /// Another topic on the same cluster.
    NewTopic,
    /// More partitions on the same topic: keys may map elsewhere.
    MorePartitions,
    /// Another cluster, same topic name.
    NewCluster,
    /// Only the serializer changes: same placement, another destination digest.
    SerializerOnly,
}

/// Fault probabilities of one trace (per opportunity).
#[derive(Debug, Clone)]
pub struct FaultRates {
    /// A command try dies before its transaction commits.
    pub crash_before_commit: f64,
    /// A command try commits, then the process dies before answering.
    pub crash_after_commit: f64,
    /// After a crash before commit, the client gives up (the command never happened).
    pub give_up: f64,
    /// The broker refuses definitely (not persisted).
    pub not_persisted: f64,
    /// The request never reaches the log and times out (unknown to the client).
    pub unsent_timeout: f64,
    /// The write lands but its ACK is lost (written but unACKed, timeout).
    pub ack_lost: f64,
    /// The ACK is delivered twice.
    pub ack_duplicated: f64,
    /// The client's internal retry writes the message twice.
    pub write_duplicated: f64,
    /// The write takes long (up to the message timeout).
    pub slow_write: f64,
    /// A receipt transaction rolls back.
    pub receipt_rollback: f64,
    /// A receipt transaction commits but its answer is lost.
    pub receipt_answer_lost: f64,
    /// A broker lookup fails.
    pub lookup_fail: f64,
    /// Per step: some worker stalls or crashes.
    pub worker_fault: f64,
    /// A consumer dies before its database commit.
    pub consumer_crash_before_commit: f64,
    /// A consumer dies after its database commit, before its offset commit.
    pub offset_commit_lost: f64,
}

/// Everything a seed decides before the first step.
#[derive(Debug, Clone)]
pub struct TraceConfig {
    /// The seed.
    pub seed: u64,
    /// Business commands.
    pub commands: usize,
    /// Distinct aggregates (routing keys) the commands touch.
    pub aggregates: usize,
    /// Dispatchers.
    pub dispatchers: usize,
    /// Reconcilers.
    pub reconcilers: usize,
    /// Consumers.
    pub consumers: usize,
    /// Steps of the faulty phase.
    pub main_steps: usize,
    /// Whether the broker adapter can look up an eventId at all.
    pub lookup_supported: bool,
    /// A route policy revision at a step.
    pub revision: Option<(usize, Revision)>,
    /// A payload tampering at a step.
    pub tamper_step: Option<usize>,
    /// Per dispatcher: whether it checks the stored payload against its digest before sending.
    pub verifies_payload: Vec<bool>,
    /// Fault probabilities.
    pub faults: FaultRates,
    /// A destination migration mid-trace (PROTOCOL §7).
    pub migration: Option<MigrationPlan>,
    /// Retention racing slow consumers (PROTOCOL §9).
    pub retention: Option<RetentionPlan>,
}

/// A route revision to another cluster or topic, then an operator moving
/// undelivered events to it (PROTOCOL §7).
#[derive(Debug, Clone)]
pub struct MigrationPlan {
    /// Step of the route revision.
    pub step: usize,
    /// Another cluster (else another topic on the same cluster).
    pub new_cluster: bool,
    /// For how long after the revision the old target cannot be asked, ms.
    pub old_down_ms: i64,
    /// Per step after the revision: the operator tries to move one undelivered event.
    pub operator_rate: f64,
}

/// Retention passes at random points, racing consumers whose published
/// watermarks lag (PROTOCOL §9).
#[derive(Debug, Clone)]
pub struct RetentionPlan {
    /// The maximum replay window, ms.
    pub replay_window_ms: i64,
    /// Per consumer: whether it is mandatory (holds purges).
    pub mandatory: Vec<bool>,
    /// Per consumer: chance to publish its watermarks after an offset commit (slow ones rarely).
    pub watermark_rate: Vec<f64>,
    /// Per step: chance of a retention pass.
    pub purge_rate: f64,
}

impl TraceConfig {
    /// The configuration `seed` names.
    pub fn from_seed(seed: u64) -> Self {
        let mut r = Rng::new(seed ^ 0xc0ff_ee00_d15e_a5e5);
        let commands = 2 + r.below(5) as usize;
        let aggregates = 1 + r.below(3) as usize;
        let dispatchers = 1 + r.below(3) as usize;
        let reconcilers = 1 + r.below(2) as usize;
        let consumers = 1 + r.below(2) as usize;
        let main_steps = 30 + r.below(50) as usize;
        let lookup_supported = !r.chance(0.1);
        let revision = r.chance(0.4).then(|| {
            let kind = [Revision::NewTopic, Revision::MorePartitions, Revision::NewCluster, Revision::SerializerOnly][r.below(4) as usize];
            (r.below(main_steps as u64) as usize, kind)
        });
        let tamper_step = r.chance(0.1).then(|| r.below(main_steps as u64) as usize);
        let verifies_payload = (0..dispatchers).map(|_| r.chance(0.5)).collect();
        // One intensity per trace: some traces are calm, some are storms.
        let k = 0.2 + 1.3 * r.unit();
        let faults = FaultRates {
            crash_before_commit: 0.12 * k,
            crash_after_commit: 0.12 * k,
            give_up: 0.3,
            not_persisted: 0.06 * k,
            unsent_timeout: 0.04 * k,
            ack_lost: 0.12 * k,
            ack_duplicated: 0.08 * k,
            write_duplicated: 0.05 * k,
            slow_write: 0.2 * k,
            receipt_rollback: 0.1 * k,
            receipt_answer_lost: 0.08 * k,
            lookup_fail: 0.2 * k,
            worker_fault: 0.08 * k,
            consumer_crash_before_commit: 0.05 * k,
            offset_commit_lost: 0.15 * k,
        };
        // Migration and retention draw from their own stream, so traces
        // without them are the traces of earlier gate runs.
        let mut m = Rng::new(seed ^ 0x6d69_6772_6174_6531);
        let migration = m.chance(0.3).then(|| MigrationPlan {
            step: m.below(main_steps as u64 * 2 / 3) as usize,
            new_cluster: m.chance(0.5),
            old_down_ms: m.range(0, 40_000),
            operator_rate: 0.05 + 0.25 * m.unit(),
        });
        let retention = m.chance(0.5).then(|| RetentionPlan {
            replay_window_ms: [0, m.range(0, 5_000), m.range(5_000, 60_000)][m.below(3) as usize],
            mandatory: (0..consumers).map(|_| m.chance(0.75)).collect(),
            watermark_rate: (0..consumers).map(|_| [0.05, 0.3, 1.0][m.below(3) as usize]).collect(),
            purge_rate: 0.05 + 0.3 * m.unit(),
        });
        TraceConfig { seed, commands, aggregates, dispatchers, reconcilers, consumers, main_steps, lookup_supported, revision, tamper_step, verifies_payload, faults, migration, retention }
    }
}

/// What one trace produced.
#[derive(Debug, Clone)]
pub struct TraceOutcome {
    /// The seed.
    pub seed: u64,
    /// Its counters.
    pub figures: Figures,
    /// UNKNOWN time-to-resolution samples, simulated ms.
    pub resolutions: Vec<i64>,
    /// Human-readable violations (only collected with a log).
    pub violations: Vec<String>,
    /// The event log, when asked for.
    pub log: Option<Vec<String>>,
}

impl TraceOutcome {
    /// Whether the trace broke an invariant.
    pub fn failed(&self) -> bool {
        !self.figures.clean()
    }
}

/// Runs the trace `seed` names, optionally under a mutation, optionally logging.
pub fn run_trace(seed: u64, mutation: Option<Mutation>, log: bool) -> TraceOutcome {
    let cfg = TraceConfig::from_seed(seed);
    Sim::new(cfg, mutation, log).run()
}

// ---------------------------------------------------------------------------
// The world

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CmdStatus {
    Waiting,
    Done,
    GaveUp,
}

#[derive(Debug)]
struct Cmd {
    key: String,
    aggregate: String,
    payload: Vec<u8>,
    status: CmdStatus,
    next_at_ms: i64,
    tries: u32,
    /// The business row: committed with (normally) the event id of its envelope.
    business: Option<Option<EventId>>,
    /// Every event id an emit for this command returned.
    returned: Vec<EventId>,
}

#[derive(Debug)]
struct SimEvent {
    id: EventId,
    cmd: usize,
    seq: usize,
    payload_digest: String,
    dest: Destination,
    dest_digest: String,
    tampered: bool,
    /// Highest claim generation any claim call handed out for this event.
    max_granted_gen: u64,
    unknown_since_ms: Option<i64>,
    trail_flagged: bool,
    /// Attempts registered through the simulator, in order.
    attempts: Vec<AttemptId>,
    /// Frozen destination (and digest) per envelope generation, from 1.
    gens: Vec<(Destination, String)>,
    /// Whether the move into the current generation was made without an
    /// absence proof while attempts of the old one were open.
    unproven_move: bool,
    /// When the simulator first saw the event published (the step's time).
    published_seen_ms: Option<i64>,
}

impl SimEvent {
    fn gen(&self, g: u32) -> Option<&(Destination, String)> {
        self.gens.get((g as usize).wrapping_sub(1))
    }
}

#[derive(Debug)]
enum Work {
    Claimed(Box<ClaimedEvent>),
    Registered(Box<ClaimedEvent>, Box<AttemptRecord>),
}

#[derive(Debug, Clone)]
struct PendingReceipt {
    ev: usize,
    receipt: BrokerReceipt,
    genuine: bool,
    late: Option<usize>,
}

#[derive(Debug)]
struct Worker {
    name: String,
    up: bool,
    back_at_ms: i64,
    stalled_until_ms: i64,
    epoch: u32,
}

impl Worker {
    fn new(name: String) -> Self {
        Worker { name, up: true, back_at_ms: 0, stalled_until_ms: 0, epoch: 0 }
    }
    fn active(&self, now: i64) -> bool {
        self.up && now >= self.stalled_until_ms
    }
}

#[derive(Debug)]
struct Dispatcher {
    w: Worker,
    verifies_payload: bool,
    work: VecDeque<Work>,
    receipts: VecDeque<PendingReceipt>,
}

#[derive(Debug)]
struct RecTask {
    ev: usize,
    task: ReconcileTask,
    decision: Option<ReconcileDecision>,
}

#[derive(Debug)]
struct Reconciler {
    w: Worker,
    tasks: VecDeque<RecTask>,
}

#[derive(Debug)]
struct Consumer {
    w: Worker,
    positions: Vec<usize>,
    committed: Vec<usize>,
    /// The consumer's receipts table: event -> (offset of the original processing, effects).
    receipts: BTreeMap<usize, (i64, u32)>,
}

#[derive(Debug, Clone)]
struct Message {
    ev: usize,
    event_id: EventId,
    envelope_generation: u32,
    attempt: AttemptId,
    /// The payload digest header (the frozen one, as the dispatcher writes it).
    payload_digest: String,
    /// The digest of the bytes actually produced.
    bytes_digest: String,
    /// The destination digest header.
    destination_digest: String,
}

#[derive(Debug)]
struct PartitionLog {
    cluster: String,
    topic: String,
    partition: i32,
    msgs: Vec<Message>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Acked,
    NotPersisted,
    Unknown,
}

#[derive(Debug)]
struct Request {
    disp: usize,
    epoch: u32,
    ev: usize,
    token: ClaimToken,
    attempt: AttemptId,
    log: usize,
    msg: Message,
    write_at_ms: Option<i64>,
    write_twice: bool,
    offset: Option<i64>,
    outcome: Outcome,
    outcome_at_ms: i64,
    copies: u32,
    done: bool,
}

#[derive(Debug)]
struct LateAck {
    ev: usize,
    receipt: BrokerReceipt,
    decision: Option<ReceiptDecision>,
    lost_in_crash: bool,
}

#[derive(Debug, Clone, Copy)]
enum Actor {
    Clients,
    Dispatcher(usize),
    Reconciler(usize),
    Consumer(usize),
}

/// One trace's world.
pub struct Sim {
    cfg: TraceConfig,
    rng: Rng,
    now: i64,
    store: MemoryStore,
    mutation: Option<Mutation>,
    faults: bool,
    log: Option<Vec<String>>,
    policy: RoutePolicy,
    txid: u64,
    cmds: Vec<Cmd>,
    events: Vec<SimEvent>,
    disps: Vec<Dispatcher>,
    recs: Vec<Reconciler>,
    cons: Vec<Consumer>,
    logs: Vec<PartitionLog>,
    requests: Vec<Request>,
    late_acks: Vec<LateAck>,
    refused: Vec<(usize, String)>,
    figures: Figures,
    resolutions: Vec<i64>,
    violations: Vec<String>,
    /// Draws of the migration and retention hooks (own stream).
    hook_rng: Rng,
    /// The target a migration moves away from: (cluster, topic), unqueryable until the ms.
    old_target: Option<(String, String, i64)>,
    /// Published watermarks: (consumer, log) -> committed offset.
    watermarks: BTreeMap<(usize, usize), i64>,
    /// Migrations done: (event, from generation, whether a violation was already counted).
    migrated: Vec<(usize, u32, bool)>,
}

macro_rules! slog {
    ($sim:expr, $($arg:tt)*) => {
        if $sim.log.is_some() {
            let line = format!("{:>9.3}s  {}", ($sim.now - T0_MS) as f64 / 1000.0, format!($($arg)*));
            if let Some(l) = $sim.log.as_mut() {
                l.push(line);
            }
        }
    };
}

impl Sim {
    /// A world for `cfg`.
    pub fn new(cfg: TraceConfig, mutation: Option<Mutation>, log: bool) -> Self {
        let rng = Rng::new(cfg.seed);
        let store = MemoryStore::new();
        store.set_now_ms(T0_MS);
        let cmds = (0..cfg.commands)
            .map(|i| Cmd {
                key: format!("cmd-{i}"),
                aggregate: format!("o-{}", i % cfg.aggregates),
                payload: format!("{{\"order\":\"o-{}\",\"line\":{i}}}", i % cfg.aggregates).into_bytes(),
                status: CmdStatus::Waiting,
                next_at_ms: T0_MS,
                tries: 0,
                business: None,
                returned: Vec::new(),
            })
            .collect();
        let disps = (0..cfg.dispatchers)
            .map(|i| Dispatcher { w: Worker::new(format!("d{}", i + 1)), verifies_payload: cfg.verifies_payload[i], work: VecDeque::new(), receipts: VecDeque::new() })
            .collect();
        let recs = (0..cfg.reconcilers).map(|i| Reconciler { w: Worker::new(format!("r{}", i + 1)), tasks: VecDeque::new() }).collect();
        let cons = (0..cfg.consumers).map(|i| Consumer { w: Worker::new(format!("c{}", i + 1)), positions: Vec::new(), committed: Vec::new(), receipts: BTreeMap::new() }).collect();
        let mut sim = Sim {
            rng,
            now: T0_MS,
            store,
            mutation,
            faults: true,
            log: log.then(Vec::new),
            policy: RoutePolicy::new(EVENT_TYPE, "sim-cluster", "orders", 4),
            txid: 1000,
            cmds,
            events: Vec::new(),
            disps,
            recs,
            cons,
            logs: Vec::new(),
            requests: Vec::new(),
            late_acks: Vec::new(),
            refused: Vec::new(),
            figures: Figures { traces: 1, ..Figures::default() },
            resolutions: Vec::new(),
            violations: Vec::new(),
            hook_rng: Rng::new(cfg.seed ^ 0x686f_6f6b_7321),
            old_target: None,
            watermarks: BTreeMap::new(),
            migrated: Vec::new(),
            cfg,
        };
        sim.figures.commands = sim.cfg.commands as u64;
        sim.figures.traces_without_lookup = u64::from(!sim.cfg.lookup_supported);
        slog!(sim, "trace seed {} : {:?}{}", sim.cfg.seed, sim.cfg, mutation.map(|m| format!(" MUTATION {}", m.name())).unwrap_or_default());
        sim
    }

    /// Runs the faulty phase, quiescence, and the final checks.
    pub fn run(mut self) -> TraceOutcome {
        for step in 0..self.cfg.main_steps {
            self.advance();
            self.tick_broker();
            if let Some((at, kind)) = self.cfg.revision {
                if at == step {
                    self.revise(kind);
                }
            }
            if self.cfg.tamper_step == Some(step) {
                self.tamper();
            }
            self.migration_hook(step);
            self.purge_hook(step);
            self.wake();
            if self.rng.chance(self.cfg.faults.worker_fault) {
                self.worker_fault();
            }
            self.step_actor();
            self.observe();
        }
        self.quiesce();
        self.final_checks();
        TraceOutcome { seed: self.cfg.seed, figures: self.figures, resolutions: self.resolutions, violations: self.violations, log: self.log }
    }

    fn violation(&mut self, what: String) {
        if self.log.is_some() {
            slog!(self, "!! VIOLATION {what}");
            self.violations.push(what);
        }
    }

    fn unexpected(&mut self, call: &str, e: &dyn std::fmt::Display) {
        self.figures.unexpected_store_errors += 1;
        self.violation(format!("unexpected store error in {call}: {e}"));
    }

    fn set_now(&mut self, t: i64) {
        self.now = t;
        self.store.set_now_ms(t);
    }

    fn advance(&mut self) {
        let dt = match self.rng.weighted(&[60, 30, 10]) {
            0 => self.rng.range(0, 400),
            1 => self.rng.range(400, 4_000),
            _ => self.rng.range(4_000, 25_000),
        };
        self.set_now(self.now + dt);
    }

    fn ev_of(&self, id: &EventId) -> Option<usize> {
        self.events.iter().position(|e| &e.id == id)
    }

    fn an(&self, ev: usize, a: &AttemptId) -> String {
        match self.events[ev].attempts.iter().position(|x| x == a) {
            Some(i) => format!("E{ev}.a{}", i + 1),
            None => format!("E{ev}.a?{}", &a.as_str()[a.as_str().len() - 4..]),
        }
    }

    fn t(&self, ms: i64) -> String {
        format!("{:.3}s", (ms - T0_MS) as f64 / 1000.0)
    }

    fn note_grant(&mut self, ev: usize, gen: u64) {
        let e = &mut self.events[ev];
        e.max_granted_gen = e.max_granted_gen.max(gen);
    }

    // -----------------------------------------------------------------------
    // Environment: time, revisions, tampering, worker faults

    fn revise(&mut self, kind: Revision) {
        let mut p = self.policy.clone();
        p.generation += 1;
        match kind {
            Revision::NewTopic => p.topic = "orders-v2".into(),
            Revision::MorePartitions => p.partitions = 6,
            Revision::NewCluster => p.cluster_id = "sim-cluster-b".into(),
            Revision::SerializerOnly => p.serializer = "bytes-v2".into(),
        }
        self.policy = p;
        self.figures.route_revisions += 1;
        slog!(self, "ROUTE POLICY REVISION {:?}: generation {} -> {}/{} ({} partitions)", kind, self.policy.generation, self.policy.cluster_id, self.policy.topic, self.policy.partitions);
    }

    fn tamper(&mut self) {
        let candidates: Vec<usize> = {
            let st = self.store.lock();
            self.events.iter().enumerate().filter(|(_, e)| st.events.get(&e.id).is_some_and(|r| !r.state.is_published())).map(|(i, _)| i).collect()
        };
        if candidates.is_empty() {
            return;
        }
        let ev = candidates[self.rng.below(candidates.len() as u64) as usize];
        if let Some(row) = self.store.lock().events.get_mut(&self.events[ev].id) {
            row.payload = b"{\"tampered\":true}".to_vec();
        }
        self.events[ev].tampered = true;
        self.figures.events_tampered += 1;
        slog!(self, "TAMPER: stored payload of E{ev} overwritten (its frozen digest stays)");
    }

    /// Destination migration (PROTOCOL §7). At the plan's step the route policy
    /// is revised to another cluster or topic and the old target becomes
    /// unqueryable for a while; from then on, at random steps, an operator
    /// tries to move one undelivered event (PENDING or DISPATCH_UNKNOWN) to
    /// the destination the new policy resolves, through
    /// [`decide_migration`] and [`MemoryStore::migrate`]. Checked: no
    /// migration unless the old target provably does not hold the old
    /// generation (`migrations_without_proof`), no send under the new
    /// generation while the old one may be in the old target
    /// (`cross_target_resends_while_unknown`), and every message, attempt and
    /// receipt is compared with the frozen destination *of its generation*.
    fn migration_hook(&mut self, step: usize) {
        let Some(plan) = self.cfg.migration.clone() else { return };
        if step == plan.step {
            let mut p = self.policy.clone();
            let old = (p.cluster_id.clone(), p.topic.clone());
            p.generation += 1;
            if plan.new_cluster {
                p.cluster_id = format!("{}-m", p.cluster_id);
            } else {
                p.topic = format!("{}-m", p.topic);
            }
            self.policy = p;
            self.figures.route_revisions += 1;
            self.old_target = Some((old.0, old.1, self.now + plan.old_down_ms));
            slog!(self, "ROUTE POLICY REVISION for migration: generation {} -> {}/{}; the old target is unqueryable for {} ms", self.policy.generation, self.policy.cluster_id, self.policy.topic, plan.old_down_ms);
            return;
        }
        if step > plan.step && self.hook_rng.chance(plan.operator_rate) {
            self.operator_migrate();
        }
    }

    fn old_target_down(&self, dest: &Destination) -> bool {
        self.old_target.as_ref().is_some_and(|(c, t, until)| self.now < *until && dest.cluster_id == *c && dest.topic == *t)
    }

    /// Whether generation `gen` of `ev` is (or may still become) in the broker:
    /// a message of it in a log, or a write of it still on its way.
    fn generation_in_broker(&self, ev: usize, gen: u32) -> bool {
        self.logs.iter().any(|l| l.msgs.iter().any(|m| m.ev == ev && m.envelope_generation == gen))
            || self.requests.iter().any(|r| r.ev == ev && r.msg.envelope_generation == gen && r.write_at_ms.is_some() && r.offset.is_none())
    }

    /// An operator's `migrate-destination` on one undelivered event.
    fn operator_migrate(&mut self) {
        let candidates: Vec<(usize, EventState)> = {
            let st = self.store.lock();
            self.events
                .iter()
                .enumerate()
                .filter_map(|(i, e)| st.events.get(&e.id).filter(|r| matches!(r.state, EventState::Pending | EventState::DispatchUnknown)).map(|r| (i, r.state)))
                .collect()
        };
        if candidates.is_empty() {
            return;
        }
        let (ev, state) = candidates[self.hook_rng.below(candidates.len() as u64) as usize];
        let aggregate = self.cmds[self.events[ev].cmd].aggregate.clone();
        let Ok(dest) = self.policy.resolve(TENANT, "order", &aggregate) else { return };
        if dest.digest() == self.events[ev].dest_digest {
            return;
        }
        let id = self.events[ev].id.clone();
        match state {
            EventState::Pending => {
                let attempts = match now(self.store.attempts(&id)) {
                    Ok(a) => a,
                    Err(e) => return self.unexpected("attempts", &e),
                };
                match decide_migration(state, &attempts, None, &RETRY_POLICY, self.now) {
                    MigrationDecision::Move { proof } => self.do_migrate(ev, dest, proof, false, None),
                    MigrationDecision::Refuse(r) => {
                        self.figures.migrations_refused += 1;
                        slog!(self, "operator: migration of PENDING E{ev} refused: {r}");
                    }
                }
            }
            _ => {
                let task = match self.store.begin_reconcile_event("operator", &id, LEASE_MS) {
                    Ok(Some(t)) => t,
                    Ok(None) => return,
                    Err(e) => return self.unexpected("begin_reconcile_event", &e),
                };
                self.note_grant(ev, task.token.claim_generation);
                let from = scan_lower_bound(&task.attempts);
                let open_attempts: Vec<AttemptRecord> = task.attempts.iter().filter(|a| a.state.possibly_in_flight()).cloned().collect();
                let lookup = self.lookup(&task.event.destination, &id, from, &open_attempts, true);
                let decision = decide_migration(state, &task.attempts, Some(&lookup), &RETRY_POLICY, self.now);
                match decision {
                    MigrationDecision::Move { proof } => self.do_migrate(ev, dest, proof, false, Some(&task.token)),
                    MigrationDecision::Refuse(MigrationRefusal::OldTargetHoldsEvent { receipts }) => {
                        self.figures.migrations_refused += 1;
                        slog!(self, "operator: migration of E{ev} refused: the old target holds it; submitting {} receipt(s)", receipts.len());
                        for rc in &receipts {
                            let genuine = self.genuine(ev, rc);
                            if let Some(out) = self.accept(rc) {
                                self.record_receipt(ev, genuine, None, &out.decision);
                            }
                        }
                        if let Ok((EventState::Reconciling, _)) = now(self.store.event_state(&id)) {
                            let d = ReconcileDecision::Recheck { reason: RecheckReason::ReceiptsRefused, next_check_at_ms: self.now + RETRY_POLICY.recheck_ms };
                            if let Err(e) = now(self.store.finish_reconcile(&task.token, &d)) {
                                self.unexpected("finish_reconcile", &e);
                            }
                        }
                    }
                    MigrationDecision::Refuse(r) => {
                        self.figures.migrations_refused += 1;
                        if matches!(r, MigrationRefusal::OldTargetUnqueryable { .. }) {
                            self.figures.migrations_refused_unqueryable += 1;
                        }
                        slog!(self, "operator: migration of UNKNOWN E{ev} refused: {r}");
                        if let Err(e) = now(self.store.finish_reconcile(&task.token, &r.recheck(&RETRY_POLICY, self.now))) {
                            self.unexpected("finish_reconcile", &e);
                        }
                    }
                }
            }
        }
    }

    /// Applies a migration and checks it against the broker's ground truth.
    /// `unproven`: the proof was forged while old attempts were open.
    fn do_migrate(&mut self, ev: usize, dest: Destination, proof: MigrationProof, unproven: bool, claim: Option<&ClaimToken>) {
        let id = self.events[ev].id.clone();
        let from_gen = self.events[ev].gens.len() as u32;
        let held = self.generation_in_broker(ev, from_gen);
        match self.store.migrate(&id, dest.clone(), proof.clone(), "operator", claim) {
            Ok(Ok(rec)) => {
                self.figures.migrations += 1;
                slog!(self, "operator: MIGRATED E{ev} generation {} -> {} to {}/{}/p{} under {:?} (closed {} attempt(s) ABSENT)", rec.from_generation, rec.to_generation, dest.cluster_id, dest.topic, dest.partition, proof, rec.closed_attempts.len());
                let bad = held || unproven;
                if held {
                    self.figures.migrations_without_proof += 1;
                    self.violation(format!("E{ev} migrated although generation {from_gen} is (or will be) in the old target"));
                }
                if unproven {
                    self.figures.migrations_without_proof += 1;
                    self.violation(format!("E{ev} migrated under a ProvenAbsent proof no lookup backed"));
                }
                let digest = dest.digest();
                let e = &mut self.events[ev];
                e.gens.push((dest.clone(), digest.clone()));
                e.dest = dest;
                e.dest_digest = digest;
                e.unproven_move = unproven;
                self.migrated.push((ev, from_gen, bad));
            }
            Ok(Err(why)) => {
                self.figures.migrations_refused += 1;
                slog!(self, "operator: the store refused the migration of E{ev}: {why}");
            }
            Err(e) => self.unexpected("migrate", &e),
        }
    }

    /// Retention (PROTOCOL §9) at random points, racing consumers whose
    /// published watermarks lag their committed positions (some publish
    /// rarely, all stall and crash). Runs [`MemoryStore::retain_and_purge`]
    /// (`may_retain`, `may_purge`) and checks every purge against ground
    /// truth: past the replay window since the event was seen published, and
    /// every mandatory consumer's *committed* position in the event's log
    /// past its offset. Then replays a late duplicate ACK and a retried
    /// command against the tombstone: both must still be recognised.
    fn purge_hook(&mut self, _step: usize) {
        let Some(rate) = self.cfg.retention.as_ref().map(|p| p.purge_rate) else { return };
        if self.hook_rng.chance(rate) {
            self.run_purge();
        }
    }

    fn publish_watermarks(&mut self, c: usize) {
        let Some(rate) = self.cfg.retention.as_ref().map(|p| p.watermark_rate[c]) else { return };
        if !self.hook_rng.chance(rate) {
            return;
        }
        for (l, &o) in self.cons[c].committed.iter().enumerate() {
            let w = self.watermarks.entry((c, l)).or_insert(0);
            *w = (*w).max(o as i64);
        }
    }

    fn run_purge(&mut self) {
        let Some(plan) = self.cfg.retention.clone() else { return };
        // The simulator's routes learn no topic ids: every destination is
        // destination.v1, and so every log position and watermark is of no id.
        let wms: Vec<outbox_core::MemoryWatermark> = self
            .watermarks
            .iter()
            .map(|(&(c, l), &o)| outbox_core::MemoryWatermark {
                consumer_id: self.cons[c].w.name.clone(),
                cluster_id: self.logs[l].cluster.clone(),
                topic: self.logs[l].topic.clone(),
                topic_id: None,
                partition: self.logs[l].partition,
                committed_offset: o,
            })
            .collect();
        let mut topics: Vec<String> = self.logs.iter().map(|l| l.topic.clone()).collect();
        topics.sort();
        topics.dedup();
        let mandatory: Vec<(String, Vec<String>)> = (0..self.cons.len()).filter(|&c| plan.mandatory[c]).map(|c| (self.cons[c].w.name.clone(), topics.clone())).collect();
        // The slots as they were: a purge must keep them (the tombstone).
        let slots: BTreeMap<EventId, BrokerReceipt> = self.store.lock().events.iter().filter_map(|(id, r)| r.slot.clone().map(|s| (id.clone(), s))).collect();
        let out = self.store.retain_and_purge(plan.replay_window_ms, &wms, &mandatory);
        self.figures.events_retained += out.retained.len() as u64;
        self.figures.events_purged += out.purged.len() as u64;
        if out.held_by_consumers > 0 {
            self.figures.purges_held_by_consumers += 1;
        }
        if out.retained.is_empty() && out.purged.is_empty() {
            return;
        }
        slog!(self, "retention (window {} ms): {} retained, {} purged, {} held by consumers", plan.replay_window_ms, out.retained.len(), out.purged.len(), out.held_by_consumers);
        for id in out.purged {
            let Some(ev) = self.ev_of(&id) else { continue };
            let Some(slot) = slots.get(&id).cloned() else { continue };
            let kept = self.store.lock().events.get(&id).is_some_and(|r| r.slot.as_ref() == Some(&slot) && r.envelope.payload_digest == self.events[ev].payload_digest);
            if !kept {
                self.figures.late_duplicates_unrecognised_after_purge += 1;
                self.violation(format!("E{ev}'s tombstone lost its publish slot or digest"));
                continue;
            }
            let seen = self.events[ev].published_seen_ms;
            let past_window = matches!(seen, Some(p) if p < self.now - plan.replay_window_ms.max(0));
            if !past_window {
                self.figures.purged_within_replay_window += 1;
                self.violation(format!("E{ev} purged within the replay window (published at {:?}, window {} ms)", seen.map(|p| self.t(p)), plan.replay_window_ms));
            }
            let log = self.find_log(&slot.cluster_id, &slot.topic, slot.partition);
            for c in 0..self.cons.len() {
                let committed = log.and_then(|l| self.cons[c].committed.get(l).copied()).unwrap_or(0) as i64;
                if plan.mandatory[c] && committed <= slot.offset {
                    self.figures.purged_before_mandatory_watermark += 1;
                    self.violation(format!("E{ev} purged at offset {} while mandatory {} has committed only up to {committed}", slot.offset, self.cons[c].w.name));
                }
            }
            slog!(self, "retention: E{ev} PURGED (tombstone kept)");
            self.replay_against_tombstone(ev, &slot);
        }
    }

    /// A late duplicate ACK and a retried command after a purge.
    fn replay_against_tombstone(&mut self, ev: usize, slot: &BrokerReceipt) {
        self.figures.late_duplicates_after_purge += 1;
        let mut ok = true;
        match self.accept(slot) {
            Some(o) if o.decision == ReceiptDecision::AlreadyAccepted && o.state == EventState::Purged => {}
            other => {
                ok = false;
                self.violation(format!("late duplicate of E{ev}'s primary ACK after the purge: {:?}", other.map(|o| (o.decision, o.state))));
            }
        }
        let dup = self.store.lock().duplicates.iter().find(|d| d.event_id == slot.event_id).cloned();
        if let Some(dup) = dup {
            match self.accept(&dup) {
                Some(o) if o.decision == ReceiptDecision::Duplicate && o.state == EventState::Purged => {}
                other => {
                    ok = false;
                    self.violation(format!("late duplicate transport receipt of E{ev} after the purge: {:?}", other.map(|o| (o.decision, o.state))));
                }
            }
        }
        let c = self.events[ev].cmd;
        let fresh = EventId::from_parts(self.now as u64, self.hook_rng.next_u128());
        let cmd = &self.cmds[c];
        let req = EmitRequest {
            command_key: &cmd.key,
            tenant: TENANT,
            aggregate_type: "order",
            aggregate_id: &cmd.aggregate,
            aggregate_version: c as i64 + 1,
            event_type: EVENT_TYPE,
            payload_schema: "order-v1",
            payload: &cmd.payload,
        };
        let frozen = req.freeze(fresh, self.now, self.txid + 1, &self.policy);
        let (key, payload) = (cmd.key.clone(), cmd.payload.clone());
        match frozen.map_err(outbox_core::StoreError::from).map(|(env, dest)| self.store.insert(&key, env, dest, payload)) {
            Ok(Ok(id)) if id == self.events[ev].id => {}
            other => {
                ok = false;
                self.violation(format!("retried command {key} after E{ev}'s purge: {other:?}"));
            }
        }
        if !ok {
            self.figures.late_duplicates_unrecognised_after_purge += 1;
        }
    }

    fn wake(&mut self) {
        let now = self.now;
        let mut woke = Vec::new();
        for w in self.workers_mut() {
            if !w.up && now >= w.back_at_ms {
                w.up = true;
                woke.push(w.name.clone());
            }
        }
        for n in woke {
            slog!(self, "{n} restarted");
        }
    }

    fn workers_mut(&mut self) -> impl Iterator<Item = &mut Worker> {
        self.disps.iter_mut().map(|d| &mut d.w).chain(self.recs.iter_mut().map(|r| &mut r.w)).chain(self.cons.iter_mut().map(|c| &mut c.w))
    }

    fn worker_fault(&mut self) {
        let n = self.disps.len() + self.recs.len() + self.cons.len();
        let i = self.rng.below(n as u64) as usize;
        let crash = self.rng.chance(0.3);
        let stall_ms = self.rng.range(LEASE_MS / 2, 4 * LEASE_MS);
        let down_ms = self.rng.range(500, 30_000);
        let now = self.now;
        let w = self.workers_mut().nth(i).expect("worker index");
        if !w.up {
            return;
        }
        let name = w.name.clone();
        if crash {
            w.up = false;
            w.back_at_ms = now + down_ms;
            w.epoch += 1;
            self.figures.crashes += 1;
            slog!(self, "{name} CRASHED (down {down_ms} ms, loses its memory)");
            if i < self.disps.len() {
                let d = &mut self.disps[i];
                d.work.clear();
                for p in d.receipts.drain(..) {
                    if let Some(l) = p.late {
                        self.late_acks[l].lost_in_crash = true;
                    }
                }
            } else if i < self.disps.len() + self.recs.len() {
                self.recs[i - self.disps.len()].tasks.clear();
            } else {
                let c = &mut self.cons[i - self.disps.len() - self.recs.len()];
                c.positions = c.committed.clone();
            }
        } else {
            w.stalled_until_ms = w.stalled_until_ms.max(now + stall_ms);
            self.figures.stalls += 1;
            slog!(self, "{name} STALLS for {stall_ms} ms");
        }
    }

    fn step_actor(&mut self) {
        let now = self.now;
        let mut actors = Vec::with_capacity(8);
        let mut weights = Vec::with_capacity(8);
        if self.cmds.iter().any(|c| c.status == CmdStatus::Waiting && c.next_at_ms <= now) {
            actors.push(Actor::Clients);
            weights.push(3);
        }
        for (i, d) in self.disps.iter().enumerate() {
            if d.w.active(now) {
                actors.push(Actor::Dispatcher(i));
                weights.push(4);
            }
        }
        for (i, r) in self.recs.iter().enumerate() {
            if r.w.active(now) {
                actors.push(Actor::Reconciler(i));
                weights.push(2);
            }
        }
        for (i, c) in self.cons.iter().enumerate() {
            if c.w.active(now) {
                actors.push(Actor::Consumer(i));
                weights.push(2);
            }
        }
        if actors.is_empty() {
            return;
        }
        match actors[self.rng.weighted(&weights)] {
            Actor::Clients => {
                let due: Vec<usize> = (0..self.cmds.len()).filter(|&i| self.cmds[i].status == CmdStatus::Waiting && self.cmds[i].next_at_ms <= now).collect();
                let c = due[self.rng.below(due.len() as u64) as usize];
                self.command_try(c);
            }
            Actor::Dispatcher(d) => {
                self.dispatcher_step(d, false);
            }
            Actor::Reconciler(r) => {
                self.reconciler_step(r, false);
            }
            Actor::Consumer(c) => {
                self.consumer_step(c);
            }
        }
    }

    // -----------------------------------------------------------------------
    // Business commands: the business row and the envelope in one transaction

    fn command_try(&mut self, c: usize) {
        let f = self.cfg.faults.clone();
        let roll = if self.faults { self.rng.unit() } else { 1.0 };
        self.cmds[c].tries += 1;
        let tries = self.cmds[c].tries;
        if roll < f.crash_before_commit {
            if self.rng.chance(f.give_up) && self.cmds[c].business.is_none() {
                self.cmds[c].status = CmdStatus::GaveUp;
                self.figures.commands_abandoned += 1;
                slog!(self, "client {}: crashed before commit; client gives up (no business row, no event)", self.cmds[c].key);
            } else {
                self.cmds[c].next_at_ms = self.now + self.rng.range(100, 3_000);
                slog!(self, "client {}: try {tries} crashed before commit (nothing written)", self.cmds[c].key);
            }
            return;
        }
        let crash_after = roll < f.crash_before_commit + f.crash_after_commit;
        let key = if self.mutation == Some(Mutation::NewEventIdOnRetry) && tries > 1 { format!("{}-try{tries}", self.cmds[c].key) } else { self.cmds[c].key.clone() };
        if self.mutation == Some(Mutation::EmitOutsideTransaction) {
            // Mutation: the business transaction commits first, the outbox
            // insert runs in a second one; a retry that finds the business
            // row answers "already done".
            if self.cmds[c].business.is_some() {
                self.cmds[c].status = CmdStatus::Done;
                return;
            }
            self.cmds[c].business = Some(None);
            if crash_after {
                self.cmds[c].next_at_ms = self.now + self.rng.range(100, 3_000);
                slog!(self, "client {}: business committed, crashed before the separate outbox insert", self.cmds[c].key);
                return;
            }
            if let Some(id) = self.emit(c, &key) {
                self.cmds[c].business = Some(Some(id));
            }
            self.cmds[c].status = CmdStatus::Done;
            return;
        }
        // One transaction: the business row (idempotent on the command key)
        // and the PENDING envelope (emit; the store dedupes the command key).
        let Some(id) = self.emit(c, &key) else { return };
        if self.cmds[c].business.is_none() {
            self.cmds[c].business = Some(Some(id.clone()));
        }
        let ev = self.ev_of(&id).map(|e| format!("E{e}")).unwrap_or_else(|| id.to_string());
        if crash_after {
            self.figures.commands_retried_after_commit += 1;
            self.cmds[c].next_at_ms = self.now + self.rng.range(100, 3_000);
            slog!(self, "client {}: try {tries} committed {ev}, crashed before answering (will retry, same key)", self.cmds[c].key);
        } else {
            self.cmds[c].status = CmdStatus::Done;
            slog!(self, "client {}: try {tries} committed, event {ev}", self.cmds[c].key);
        }
    }

    fn emit(&mut self, c: usize, key: &str) -> Option<EventId> {
        let fresh = EventId::from_parts(self.now as u64, self.rng.next_u128());
        self.txid += 1;
        let cmd = &self.cmds[c];
        // The business transaction raises its aggregate's version by one
        // (commands of one aggregate commit in any order here; a retry
        // repeats its key and is answered by its first event).
        let version = self.store.lock().aggregate_versions.get(&(TENANT.to_owned(), "order".to_owned(), cmd.aggregate.clone())).copied().unwrap_or(0) + 1;
        let req = EmitRequest {
            command_key: key,
            tenant: TENANT,
            aggregate_type: "order",
            aggregate_id: &cmd.aggregate,
            aggregate_version: version,
            event_type: EVENT_TYPE,
            payload_schema: "order-v1",
            payload: &cmd.payload,
        };
        let (env, dest) = match req.validate(outbox_core::DEFAULT_MAX_PAYLOAD_BYTES).and_then(|_| req.freeze(fresh.clone(), self.now, self.txid, &self.policy)) {
            Ok(x) => x,
            Err(e) => {
                self.unexpected("freeze", &e);
                return None;
            }
        };
        let payload_digest = env.payload_digest.clone();
        match self.store.insert(key, env, dest.clone(), cmd.payload.clone()) {
            Ok(id) => {
                if id == fresh {
                    let dest_digest = dest.digest();
                    let gens = vec![(dest.clone(), dest_digest.clone())];
                    let seq = self.events.len();
                    slog!(self, "  emit: new event E{seq} = {id}, frozen to {}/{}/p{} (route generation {})", dest.cluster_id, dest.topic, dest.partition, dest.route_policy_generation);
                    self.events.push(SimEvent {
                        id: id.clone(),
                        cmd: c,
                        seq,
                        payload_digest,
                        dest,
                        dest_digest,
                        tampered: false,
                        max_granted_gen: 0,
                        unknown_since_ms: None,
                        trail_flagged: false,
                        attempts: Vec::new(),
                        gens,
                        unproven_move: false,
                        published_seen_ms: None,
                    });
                    self.figures.events += 1;
                }
                self.cmds[c].returned.push(id.clone());
                Some(id)
            }
            Err(e) => {
                self.unexpected("insert", &e);
                None
            }
        }
    }

    // -----------------------------------------------------------------------
    // Dispatchers

    fn next_outcome(&self, d: usize) -> Option<usize> {
        let epoch = self.disps[d].w.epoch;
        self.requests
            .iter()
            .enumerate()
            .filter(|(_, r)| r.disp == d && r.epoch == epoch && !r.done && r.outcome_at_ms <= self.now)
            .min_by_key(|(i, r)| (r.outcome_at_ms, *i))
            .map(|(i, _)| i)
    }

    /// One action of dispatcher `d`. In quiescence it takes the most urgent
    /// action; otherwise a random enabled one.
    fn dispatcher_step(&mut self, d: usize, urgent: bool) -> bool {
        let outcome = self.next_outcome(d);
        let has_receipt = !self.disps[d].receipts.is_empty();
        let has_work = !self.disps[d].work.is_empty();
        let epoch = self.disps[d].w.epoch;
        let has_outstanding = !urgent && self.requests.iter().any(|r| r.disp == d && r.epoch == epoch && !r.done);
        let choice = if urgent {
            if outcome.is_some() {
                0
            } else if has_receipt {
                1
            } else if has_work {
                2
            } else {
                3
            }
        } else {
            let w = [if outcome.is_some() { 4 } else { 0 }, if has_receipt { 4 } else { 0 }, if has_work { 5 } else { 0 }, 2, if has_work { 1 } else { 0 }, if has_outstanding { 1 } else { 0 }];
            self.rng.weighted(&w)
        };
        match choice {
            0 => {
                self.handle_outcome(d, outcome.expect("outcome chosen"));
                true
            }
            1 => {
                self.submit_receipt(d);
                true
            }
            2 => {
                self.process_work(d);
                true
            }
            3 => self.claim(d),
            4 => {
                self.renew(d);
                true
            }
            _ => {
                self.renew_outstanding(d);
                true
            }
        }
    }

    fn claim(&mut self, d: usize) -> bool {
        let name = self.disps[d].w.name.clone();
        let retries = match now(self.store.claim_retries(&name, BATCH, LEASE_MS)) {
            Ok(v) => v,
            Err(e) => {
                self.unexpected("claim_retries", &e);
                Vec::new()
            }
        };
        let fresh = match now(self.store.claim_batch(&name, BATCH, LEASE_MS)) {
            Ok(v) => v,
            Err(e) => {
                self.unexpected("claim_batch", &e);
                Vec::new()
            }
        };
        let any = !retries.is_empty() || !fresh.is_empty();
        for ce in retries.into_iter().chain(fresh) {
            let Some(ev) = self.ev_of(&ce.token.event_id) else {
                self.unexpected("claim", &format!("claimed unknown event {}", ce.token.event_id));
                continue;
            };
            self.note_grant(ev, ce.token.claim_generation);
            slog!(self, "{name} claimed E{ev} from {} (gen {}, lease until {})", ce.claimed_from, ce.token.claim_generation, self.t(ce.token.lease_until_ms));
            self.disps[d].work.push_back(Work::Claimed(Box::new(ce)));
        }
        any
    }

    /// Renews the leases of this dispatcher's sends whose answers are still
    /// outstanding, as the production dispatcher does during a long batch.
    fn renew_outstanding(&mut self, d: usize) {
        let epoch = self.disps[d].w.epoch;
        let name = self.disps[d].w.name.clone();
        let outstanding: Vec<usize> = (0..self.requests.len()).filter(|&i| self.requests[i].disp == d && self.requests[i].epoch == epoch && !self.requests[i].done).collect();
        for i in outstanding {
            let token = self.requests[i].token.clone();
            let ev = self.requests[i].ev;
            match now(self.store.renew_lease(&token, LEASE_MS)) {
                Ok(Some(until)) => {
                    self.requests[i].token.lease_until_ms = until;
                    slog!(self, "{name} renewed its claim on E{ev} (answer outstanding) until {}", self.t(until));
                }
                Ok(None) => {
                    self.figures.fenced_writes += 1;
                    slog!(self, "{name} renewal of E{ev} (answer outstanding) fenced");
                }
                Err(e) => self.unexpected("renew_lease", &e),
            }
        }
    }

    fn renew(&mut self, d: usize) {
        let Some(front) = self.disps[d].work.front() else { return };
        let token = match front {
            Work::Claimed(ce) => ce.token.clone(),
            Work::Registered(ce, _) => ce.token.clone(),
        };
        let registered = matches!(front, Work::Registered(..));
        let name = self.disps[d].w.name.clone();
        let ev = self.ev_of(&token.event_id).unwrap_or(usize::MAX);
        // Renewing after registration would let the holder send later than
        // the in-flight bound assumes (see RETRY_POLICY); the dispatcher only
        // renews claims it has not registered an attempt under yet.
        if registered {
            return;
        }
        match now(self.store.renew_lease(&token, LEASE_MS)) {
            Ok(Some(until)) => {
                if let Some(Work::Claimed(ce)) = self.disps[d].work.front_mut() {
                    ce.token.lease_until_ms = until;
                }
                slog!(self, "{name} renewed its claim on E{ev} until {}", self.t(until));
            }
            Ok(None) => {
                self.figures.fenced_writes += 1;
                slog!(self, "{name} renewal of E{ev} fenced");
            }
            Err(e) => self.unexpected("renew_lease", &e),
        }
    }

    fn process_work(&mut self, d: usize) {
        let Some(work) = self.disps[d].work.pop_front() else { return };
        let name = self.disps[d].w.name.clone();
        match work {
            Work::Claimed(ce) => {
                let Some(ev) = self.ev_of(&ce.token.event_id) else { return };
                if self.disps[d].verifies_payload && sha256_digest(&ce.payload) != ce.envelope.payload_digest {
                    let evidence = serde_json::json!({ "frozen": ce.envelope.payload_digest, "stored": sha256_digest(&ce.payload) });
                    match now(self.store.quarantine_claimed(&ce.token, "payload_digest_mismatch", evidence)) {
                        Ok(o) => slog!(self, "{name}: stored payload of E{ev} does not match its digest: quarantine -> {o:?}"),
                        Err(e) => self.unexpected("quarantine_claimed", &e),
                    }
                    return;
                }
                match now(self.store.register_attempt(&ce.token)) {
                    Ok(att) => self.registered(d, ev, ce, att),
                    Err(e) if e.is_fenced() => {
                        self.figures.fenced_writes += 1;
                        slog!(self, "{name}: register E{ev} fenced ({e}); drops the claim");
                        if self.mutation == Some(Mutation::ClaimFenceDisabled) {
                            self.force_register(d, ev, ce);
                        }
                    }
                    Err(e) => self.unexpected("register_attempt", &e),
                }
            }
            Work::Registered(ce, att) => {
                let ev = self.ev_of(&ce.token.event_id).expect("registered event is known");
                if self.now >= ce.token.lease_until_ms && self.mutation != Some(Mutation::ClaimFenceDisabled) {
                    // The lease ran out before the send: never send, say so.
                    let a = self.an(ev, &att.attempt_id);
                    match now(self.store.report_not_sent(&ce.token, &att.attempt_id, "lease expired before the send")) {
                        Ok(o) => {
                            if o == FenceOutcome::Fenced {
                                self.figures.fenced_writes += 1;
                            }
                            slog!(self, "{name}: lease on E{ev} ran out before sending {a}: not sent -> {o:?}")
                        }
                        Err(e) => self.unexpected("report_not_sent", &e),
                    }
                    return;
                }
                self.send(d, ev, &ce, &att);
            }
        }
    }

    fn registered(&mut self, d: usize, ev: usize, ce: Box<ClaimedEvent>, att: AttemptRecord) {
        self.events[ev].attempts.push(att.attempt_id.clone());
        self.figures.attempts += 1;
        let a = self.an(ev, &att.attempt_id);
        slog!(self, "{} registered {a} (attempt generation {}, scan from {})", self.disps[d].w.name, att.attempt_generation, att.scan_from_offset);
        self.disps[d].work.push_front(Work::Registered(ce, Box::new(att)));
    }

    /// Mutation `ClaimFenceDisabled`: a store whose fence check is broken
    /// lets a superseded or expired holder take the row back and register.
    fn force_register(&mut self, d: usize, ev: usize, ce: Box<ClaimedEvent>) {
        {
            let mut st = self.store.lock();
            if let Some(row) = st.events.get_mut(&ce.token.event_id) {
                row.claim.owner = Some(ce.token.owner.clone());
                row.claim.claim_generation = ce.token.claim_generation;
                row.claim.lease_until_ms = Some(self.now + LEASE_MS);
                if matches!(row.state, EventState::Claimed | EventState::RetryClaimed) {
                    row.claim.attempt_id = None;
                }
            }
        }
        match now(self.store.register_attempt(&ce.token)) {
            Ok(att) => {
                slog!(self, "MUTATION {}: fence ignored, registered E{ev} anyway", self.disps[d].w.name);
                self.registered(d, ev, ce, att);
            }
            Err(e) => slog!(self, "MUTATION: forced register of E{ev} failed: {e}"),
        }
    }

    fn log_index(&mut self, cluster: &str, topic: &str, partition: i32) -> usize {
        if let Some(i) = self.find_log(cluster, topic, partition) {
            return i;
        }
        self.logs.push(PartitionLog { cluster: cluster.to_owned(), topic: topic.to_owned(), partition, msgs: Vec::new() });
        self.logs.len() - 1
    }

    fn find_log(&self, cluster: &str, topic: &str, partition: i32) -> Option<usize> {
        self.logs.iter().position(|l| l.partition == partition && l.topic == topic && l.cluster == cluster)
    }

    fn send(&mut self, d: usize, ev: usize, ce: &ClaimedEvent, att: &AttemptRecord) {
        let retry_elsewhere = self.mutation == Some(Mutation::RetryToNewDestination) && ce.claimed_from == EventState::RetryClaimed;
        let (dest, dest_digest) = if retry_elsewhere {
            // Mutation: the retry re-resolves the route instead of using the frozen destination.
            let d = self.policy.resolve(&ce.envelope.tenant, &ce.envelope.aggregate_type, &ce.envelope.aggregate_id).expect("policy resolves");
            let g = d.digest();
            (d, g)
        } else {
            (ce.destination.clone(), ce.destination_digest.clone())
        };
        let a = self.an(ev, &att.attempt_id);
        if self.now >= ce.token.lease_until_ms || self.events[ev].max_granted_gen > ce.token.claim_generation {
            self.figures.stale_sends += 1;
            self.violation(format!("stale send of {a} by {} (gen {}, lease until {}, newest grant gen {})", ce.token.owner, ce.token.claim_generation, self.t(ce.token.lease_until_ms), self.events[ev].max_granted_gen));
        }
        let gen = ce.envelope.envelope_generation;
        if gen > 1 {
            let moved = self.events[ev].gen(gen - 1).is_some_and(|(d, _)| d.cluster_id != dest.cluster_id || d.topic != dest.topic || d.partition != dest.partition);
            let old_may_hold = (1..gen).any(|g| self.generation_in_broker(ev, g));
            if moved && (old_may_hold || self.events[ev].unproven_move) {
                self.figures.cross_target_resends_while_unknown += 1;
                self.violation(format!("{a} sent to the new target while an earlier generation of E{ev} may be in the old one"));
            }
        }
        let log = self.log_index(&dest.cluster_id, &dest.topic, dest.partition);
        let msg = Message {
            ev,
            event_id: ce.envelope.event_id.clone(),
            envelope_generation: ce.envelope.envelope_generation,
            attempt: att.attempt_id.clone(),
            payload_digest: ce.envelope.payload_digest.clone(),
            bytes_digest: sha256_digest(&ce.payload),
            destination_digest: dest_digest,
        };
        let f = &self.cfg.faults;
        let t = self.now;
        let (write_at, outcome, outcome_at) = if !self.faults {
            let w = t + self.rng.range(1, 50);
            (Some(w), Outcome::Acked, w + self.rng.range(0, 50))
        } else {
            let r = self.rng.unit();
            if r < f.not_persisted {
                (None, Outcome::NotPersisted, t + self.rng.range(1, 300))
            } else if r < f.not_persisted + f.unsent_timeout {
                (None, Outcome::Unknown, t + MESSAGE_TIMEOUT_MS)
            } else {
                let w = t + if self.rng.chance(f.slow_write) { self.rng.range(300, MESSAGE_TIMEOUT_MS) } else { self.rng.range(1, 300) };
                if self.rng.chance(f.ack_lost) {
                    (Some(w), Outcome::Unknown, t + MESSAGE_TIMEOUT_MS)
                } else {
                    (Some(w), Outcome::Acked, w + self.rng.range(0, (t + MESSAGE_TIMEOUT_MS - w).max(1)))
                }
            }
        };
        let write_twice = self.faults && write_at.is_some() && self.rng.chance(f.write_duplicated);
        let copies = if self.faults && outcome == Outcome::Acked && self.rng.chance(f.ack_duplicated) { 2 } else { 1 };
        slog!(
            self,
            "{} SENDS {a} to {}/{}/p{}{}: fate {outcome:?} at {}{}{}",
            self.disps[d].w.name,
            dest.cluster_id,
            dest.topic,
            dest.partition,
            if retry_elsewhere { " (MUTATION: re-resolved destination)" } else { "" },
            self.t(outcome_at),
            write_at.map(|w| format!(", written at {}", self.t(w))).unwrap_or_else(|| ", never written".into()),
            if write_twice { ", written twice" } else { "" }
        );
        self.requests.push(Request {
            disp: d,
            epoch: self.disps[d].w.epoch,
            ev,
            token: ce.token.clone(),
            attempt: att.attempt_id.clone(),
            log,
            msg,
            write_at_ms: write_at,
            write_twice,
            offset: None,
            outcome,
            outcome_at_ms: outcome_at,
            copies,
            done: false,
        });
    }

    fn tick_broker(&mut self) {
        let now = self.now;
        let mut due: Vec<(i64, usize)> = self.requests.iter().enumerate().filter_map(|(i, r)| r.write_at_ms.filter(|&w| w <= now && r.offset.is_none()).map(|w| (w, i))).collect();
        due.sort_unstable();
        for (_, i) in due {
            let times = if self.requests[i].write_twice { 2 } else { 1 };
            let l = self.requests[i].log;
            for _ in 0..times {
                let off = self.logs[l].msgs.len() as i64;
                let m = self.requests[i].msg.clone();
                self.logs[l].msgs.push(m);
                self.requests[i].offset = Some(off);
                self.figures.broker_messages += 1;
            }
            if self.log.is_some() {
                let (ev, att) = (self.requests[i].ev, self.requests[i].attempt.clone());
                let a = self.an(ev, &att);
                let lg = &self.logs[l];
                let line = format!("broker: {a} written to {}/{}/p{} at offset {}{}", lg.cluster, lg.topic, lg.partition, self.requests[i].offset.unwrap_or(-1), if times == 2 { " (twice)" } else { "" });
                slog!(self, "{line}");
            }
        }
    }

    fn receipt_of(&self, l: usize, offset: i64) -> BrokerReceipt {
        let lg = &self.logs[l];
        let m = &lg.msgs[offset as usize];
        BrokerReceipt {
            event_id: m.event_id.clone(),
            envelope_generation: m.envelope_generation,
            attempt_id: m.attempt.clone(),
            payload_digest: m.bytes_digest.clone(),
            destination_digest: m.destination_digest.clone(),
            cluster_id: lg.cluster.clone(),
            topic: lg.topic.clone(),
            // Every simulated destination is destination.v1.
            topic_id: None,
            partition: lg.partition,
            offset,
        }
    }

    /// Right bytes, right destination digest, right placement.
    fn genuine(&self, ev: usize, r: &BrokerReceipt) -> bool {
        let e = &self.events[ev];
        let Some((dest, digest)) = e.gen(r.envelope_generation) else { return false };
        r.payload_digest == e.payload_digest && r.destination_digest == *digest && dest.admits(&r.cluster_id, &r.topic, r.partition)
    }

    fn handle_outcome(&mut self, d: usize, ri: usize) {
        let name = self.disps[d].w.name.clone();
        let (ev, outcome, token, attempt) = {
            let r = &mut self.requests[ri];
            r.copies = r.copies.saturating_sub(1);
            if r.copies == 0 || r.outcome != Outcome::Acked {
                r.done = true;
            }
            (r.ev, r.outcome, r.token.clone(), r.attempt.clone())
        };
        if !self.requests[ri].done {
            let again = self.rng.range(1, 2_000);
            self.requests[ri].outcome_at_ms += again;
        }
        let a = self.an(ev, &attempt);
        match outcome {
            Outcome::Acked => {
                let (l, offset) = (self.requests[ri].log, self.requests[ri].offset.expect("ACKed requests are written"));
                let receipt = self.receipt_of(l, offset);
                let genuine = self.genuine(ev, &receipt);
                let late = self.now >= token.lease_until_ms || self.events[ev].max_granted_gen > token.claim_generation;
                let late_idx = (late && genuine).then(|| {
                    self.late_acks.push(LateAck { ev, receipt: receipt.clone(), decision: None, lost_in_crash: false });
                    self.late_acks.len() - 1
                });
                slog!(self, "{name} got ACK of {a} at offset {offset}{}{}", if late { " (LATE: its claim expired)" } else { "" }, if genuine { "" } else { " (not genuine)" });
                if late && self.mutation == Some(Mutation::LateAcksDropped) {
                    slog!(self, "MUTATION {name} drops the late ACK of {a}");
                    return;
                }
                self.disps[d].receipts.push_back(PendingReceipt { ev, receipt, genuine, late: late_idx });
                self.submit_receipt(d);
            }
            Outcome::NotPersisted => match now(self.store.report_not_sent(&token, &attempt, "broker: not persisted")) {
                Ok(o) => {
                    if o == FenceOutcome::Fenced {
                        self.figures.fenced_writes += 1;
                    }
                    slog!(self, "{name} got NOT PERSISTED for {a}: report_not_sent -> {o:?}")
                }
                Err(e) => self.unexpected("report_not_sent", &e),
            },
            Outcome::Unknown => match now(self.store.report_unknown(&token, &attempt, "timed out, possibly persisted")) {
                Ok(o) => {
                    if o == FenceOutcome::Fenced {
                        self.figures.fenced_writes += 1;
                    }
                    slog!(self, "{name} got TIMEOUT for {a}: report_unknown -> {o:?}")
                }
                Err(e) => self.unexpected("report_unknown", &e),
            },
        }
    }

    fn submit_receipt(&mut self, d: usize) {
        let Some(p) = self.disps[d].receipts.front().cloned() else { return };
        let name = self.disps[d].w.name.clone();
        let a = self.an(p.ev, &p.receipt.attempt_id);
        if self.faults && self.rng.chance(self.cfg.faults.receipt_rollback) {
            self.figures.receipt_rollbacks += 1;
            slog!(self, "{name}: receipt transaction for {a} ROLLED BACK (kept, will resubmit)");
            return;
        }
        let Some(out) = self.accept(&p.receipt) else {
            self.disps[d].receipts.pop_front();
            return;
        };
        self.record_receipt(p.ev, p.genuine, p.late, &out.decision);
        slog!(self, "{name}: acceptDispatchReceipt({a} @{}) -> {:?}, event {}", p.receipt.offset, out.decision, out.state);
        if self.faults && self.rng.chance(self.cfg.faults.receipt_answer_lost) {
            self.figures.receipt_answers_lost += 1;
            slog!(self, "{name}: ... committed but the answer was lost (will resubmit)");
            return;
        }
        self.disps[d].receipts.pop_front();
    }

    fn accept(&mut self, r: &BrokerReceipt) -> Option<ReceiptOutcome> {
        if self.mutation == Some(Mutation::AckWithoutDigestCheck) {
            if let Some(o) = self.accept_without_digest_check(r) {
                return Some(o);
            }
        }
        match now(self.store.accept_dispatch_receipt(r)) {
            Ok(o) => {
                if o.decision == ReceiptDecision::Duplicate {
                    self.figures.duplicate_receipts += 1;
                }
                Some(o)
            }
            Err(e) => {
                self.unexpected("accept_dispatch_receipt", &e);
                None
            }
        }
    }

    /// Mutation `AckWithoutDigestCheck`: a receipt whose payload digest is not
    /// the frozen one is written straight into the empty slot, bypassing
    /// `decide_receipt`.
    fn accept_without_digest_check(&mut self, r: &BrokerReceipt) -> Option<ReceiptOutcome> {
        let now_ms = self.now;
        let mut st = self.store.lock();
        let st = &mut *st;
        let row = st.events.get_mut(&r.event_id)?;
        if row.envelope.payload_digest == r.payload_digest || row.slot.is_some() || !row.state.accepts_receipt() {
            return None;
        }
        let from = row.state;
        MemoryStore::transition(row, EventState::Published, now_ms).ok()?;
        row.slot = Some(r.clone());
        row.claim.owner = None;
        for a in st.attempts.entry(r.event_id.clone()).or_default().iter_mut().filter(|a| a.attempt_id == r.attempt_id) {
            a.state = AttemptState::Acked;
        }
        Some(ReceiptOutcome { decision: ReceiptDecision::Accept { from }, primary: row.slot.clone(), state: row.state })
    }

    fn record_receipt(&mut self, ev: usize, genuine: bool, late: Option<usize>, decision: &ReceiptDecision) {
        if genuine && !(decision.is_primary() || *decision == ReceiptDecision::Duplicate) {
            self.refused.push((ev, format!("{decision:?}")));
        }
        if let Some(l) = late {
            self.late_acks[l].decision = Some(decision.clone());
        }
    }

    // -----------------------------------------------------------------------
    // Reconcilers

    fn reconciler_step(&mut self, r: usize, urgent: bool) -> bool {
        let has_task = !self.recs[r].tasks.is_empty();
        let choice = if urgent {
            if has_task {
                2
            } else {
                1
            }
        } else {
            self.rng.weighted(&[1, if has_task { 0 } else { 2 }, if has_task { 4 } else { 0 }])
        };
        match choice {
            0 => {
                self.sweep(r);
                true
            }
            1 => self.begin_reconcile(r),
            _ => {
                self.reconcile_task(r);
                true
            }
        }
    }

    fn sweep(&mut self, r: usize) {
        match now(self.store.expire_leases()) {
            Ok(s) => {
                if s.released + s.unknown + s.retry_expired > 0 {
                    slog!(self, "{} lease sweep: {} released, {} SENDING -> DISPATCH_UNKNOWN, {} retry/reconcile claims expired", self.recs[r].w.name, s.released, s.unknown, s.retry_expired);
                }
            }
            Err(e) => self.unexpected("expire_leases", &e),
        }
    }

    fn begin_reconcile(&mut self, r: usize) -> bool {
        let name = self.recs[r].w.name.clone();
        let tasks = match now(self.store.begin_reconcile(&name, BATCH, LEASE_MS)) {
            Ok(t) => t,
            Err(e) => {
                self.unexpected("begin_reconcile", &e);
                return false;
            }
        };
        let any = !tasks.is_empty();
        for task in tasks {
            let Some(ev) = self.ev_of(&task.token.event_id) else { continue };
            self.note_grant(ev, task.token.claim_generation);
            slog!(self, "{name} begins reconciling E{ev} (gen {}, {} attempts, unknown since {})", task.token.claim_generation, task.attempts.len(), self.t(task.unknown_since_ms));
            self.recs[r].tasks.push_back(RecTask { ev, task, decision: None });
        }
        any
    }

    fn lookup(&mut self, dest: &Destination, id: &EventId, from: i64, open_attempts: &[AttemptRecord], operator: bool) -> LookupOutcome {
        if !self.cfg.lookup_supported {
            return LookupOutcome::Unavailable("the adapter cannot look up".into());
        }
        if self.old_target_down(dest) {
            return LookupOutcome::Unavailable("the old target is unreachable".into());
        }
        let fails = self.faults && if operator { self.hook_rng.chance(self.cfg.faults.lookup_fail) } else { self.rng.chance(self.cfg.faults.lookup_fail) };
        if fails {
            self.figures.lookups_failed += 1;
            return LookupOutcome::Unavailable("lookup timed out".into());
        }
        let Some(l) = self.find_log(&dest.cluster_id, &dest.topic, dest.partition) else { return LookupOutcome::Absent };
        let found: Vec<BrokerReceipt> =
            (from.max(0) as usize..self.logs[l].msgs.len()).filter(|&o| &self.logs[l].msgs[o].event_id == id).map(|o| self.receipt_of(l, o as i64)).collect();
        if !found.is_empty() {
            return LookupOutcome::Found(found);
        }
        // Oracle: the whole partition must not hold a message of an attempt
        // that may still be in flight below the scan bound.
        let open: Vec<AttemptId> = open_attempts.iter().map(|a| a.attempt_id.clone()).collect();
        if let Some(o) = self.logs[l].msgs.iter().position(|m| &m.event_id == id && open.contains(&m.attempt)) {
            self.figures.false_absence_proofs += 1;
            self.violation(format!("lookup from offset {from} answered absent, but {}/{}/p{}@{o} holds a message of an open attempt", dest.cluster_id, dest.topic, dest.partition));
        }
        LookupOutcome::Absent
    }

    fn reconcile_task(&mut self, r: usize) {
        let name = self.recs[r].w.name.clone();
        let Some(front) = self.recs[r].tasks.front() else { return };
        let ev = front.ev;
        if front.decision.is_none() {
            let (dest, id, from, attempts) = (front.task.event.destination.clone(), front.task.event.event_id.clone(), scan_lower_bound(&front.task.attempts), front.task.attempts.clone());
            let open: Vec<AttemptRecord> = attempts.iter().filter(|a| a.state.possibly_in_flight()).cloned().collect();
            let lookup = self.lookup(&dest, &id, from, &open, false);
            let decision = decide_reconcile(&attempts, &lookup, self.cfg.lookup_supported, &RETRY_POLICY, self.now);
            if self.log.is_some() {
                let l = match &lookup {
                    LookupOutcome::Found(v) => format!("found {} message(s) at offsets {:?}", v.len(), v.iter().map(|r| r.offset).collect::<Vec<_>>()),
                    LookupOutcome::Absent => format!("absent from offset {from}"),
                    LookupOutcome::Unavailable(why) => format!("unavailable ({why})"),
                };
                let d = match &decision {
                    ReconcileDecision::Submit(v) => format!("Submit {}", v.len()),
                    other => format!("{other:?}"),
                };
                slog!(self, "{name} looks up E{ev}: {l} -> {d}");
            }
            if let Some(t) = self.recs[r].tasks.front_mut() {
                t.decision = Some(decision);
            }
            return;
        }
        let t = self.recs[r].tasks.pop_front().expect("front exists");
        let decision = t.decision.expect("decided");
        match &decision {
            ReconcileDecision::Submit(receipts) => {
                // Decisions of every receipt that was decided; a rolled-back
                // transaction decided nothing, so the absence logic may not
                // take over (the empty list keeps it a recheck).
                let mut decisions = Vec::new();
                let mut rolled_back = false;
                for rc in receipts {
                    let genuine = self.genuine(ev, rc);
                    if self.faults && self.rng.chance(self.cfg.faults.receipt_rollback) {
                        self.figures.receipt_rollbacks += 1;
                        rolled_back = true;
                        slog!(self, "{name}: receipt transaction for E{ev} @{} ROLLED BACK", rc.offset);
                        continue;
                    }
                    if let Some(out) = self.accept(rc) {
                        self.record_receipt(ev, genuine, None, &out.decision);
                        let a = self.an(ev, &rc.attempt_id);
                        slog!(self, "{name}: acceptDispatchReceipt({a} @{}) -> {:?}, event {}", rc.offset, out.decision, out.state);
                        decisions.push(out.decision);
                    }
                }
                if rolled_back {
                    decisions.clear();
                }
                match now(self.store.event_state(&t.task.token.event_id)) {
                    Ok((EventState::Reconciling, _)) => {
                        let d = decide_after_submit(&decisions, &t.task.attempts, self.cfg.lookup_supported, &RETRY_POLICY, self.now);
                        self.finish(r, ev, &t.task.token, &d);
                    }
                    Ok(_) => {}
                    Err(e) => self.unexpected("event_state", &e),
                }
            }
            d => self.finish(r, ev, &t.task.token, d),
        }
    }

    fn finish(&mut self, r: usize, ev: usize, token: &ClaimToken, d: &ReconcileDecision) {
        match now(self.store.finish_reconcile(token, d)) {
            Ok(o) => {
                if o == FenceOutcome::Fenced {
                    self.figures.fenced_writes += 1;
                }
                if o == FenceOutcome::Applied && matches!(d, ReconcileDecision::Retry { .. }) {
                    self.figures.reconcile_retries += 1;
                }
                slog!(self, "{} finishes E{ev}: {:?} -> {o:?}", self.recs[r].w.name, d);
            }
            Err(e) => self.unexpected("finish_reconcile", &e),
        }
    }

    // -----------------------------------------------------------------------
    // Consumers: receipt + effect in one transaction, then the offset commit

    fn consumer_step(&mut self, c: usize) -> bool {
        let n = self.logs.len();
        let cons = &mut self.cons[c];
        cons.positions.resize(n, 0);
        cons.committed.resize(n, 0);
        let candidates: Vec<usize> = (0..n).filter(|&l| cons.positions[l] < self.logs[l].msgs.len()).collect();
        if candidates.is_empty() {
            return false;
        }
        let l = candidates[self.rng.below(candidates.len() as u64) as usize];
        let off = self.cons[c].positions[l];
        let m = self.logs[l].msgs[off].clone();
        let name = self.cons[c].w.name.clone();
        let f = self.cfg.faults.clone();
        if m.bytes_digest != m.payload_digest {
            self.figures.consumer_quarantined += 1;
            slog!(self, "{name}: message E{} @{off} does not match its digest: quarantined, skipped", m.ev);
            let cons = &mut self.cons[c];
            cons.positions[l] = off + 1;
            cons.committed[l] = off + 1;
            return true;
        }
        if self.faults && self.rng.chance(f.consumer_crash_before_commit) {
            let cons = &mut self.cons[c];
            cons.positions = cons.committed.clone();
            slog!(self, "{name}: died before its database commit (E{} @{off})", m.ev);
            return true;
        }
        let skip_receipt = self.mutation == Some(Mutation::ConsumerSkipsReceipt);
        let entry = self.cons[c].receipts.entry(m.ev).or_insert((off as i64, 0));
        let first = entry.1 == 0;
        if first || skip_receipt {
            entry.1 += 1;
        } else {
            self.figures.consumer_redeliveries += 1;
        }
        let original = entry.0;
        slog!(self, "{name}: E{} @{off}: {}", m.ev, if first { "effect applied, receipt written".to_string() } else if skip_receipt { "MUTATION: effect applied again".to_string() } else { format!("duplicate, original receipt @{original} returned") });
        if self.faults && self.rng.chance(f.offset_commit_lost) {
            self.figures.offset_commits_lost += 1;
            let cons = &mut self.cons[c];
            cons.positions = cons.committed.clone();
            slog!(self, "{name}: died after its database commit, before the offset commit");
            return true;
        }
        let cons = &mut self.cons[c];
        cons.positions[l] = off + 1;
        cons.committed[l] = off + 1;
        self.publish_watermarks(c);
        true
    }

    // -----------------------------------------------------------------------
    // Observation after every step

    fn observe(&mut self) {
        let st = self.store.lock();
        for se in self.events.iter_mut() {
            let Some(row) = st.events.get(&se.id) else { continue };
            if se.published_seen_ms.is_none() && row.state.is_published() {
                se.published_seen_ms = Some(self.now);
            }
            match (row.unknown_since_ms, se.unknown_since_ms) {
                (Some(s), None) => {
                    se.unknown_since_ms = Some(s);
                    self.figures.unknowns += 1;
                }
                (None, Some(s)) => {
                    se.unknown_since_ms = None;
                    self.figures.unknowns_resolved += 1;
                    self.resolutions.push(row.state_since_ms - s);
                }
                (Some(s), Some(s0)) if s != s0 => {
                    self.figures.unknowns_resolved += 1;
                    self.resolutions.push(s - s0);
                    self.figures.unknowns += 1;
                    se.unknown_since_ms = Some(s);
                }
                _ => {}
            }
            if !se.trail_flagged && matches!(row.state, EventState::DispatchUnknown | EventState::Reconciling | EventState::RetryClaimed) {
                let attempts = st.attempts.get(&se.id).map_or(0, |v| v.len());
                if attempts == 0 || se.attempts.is_empty() {
                    se.trail_flagged = true;
                    self.figures.unknown_without_trail += 1;
                    if self.log.is_some() {
                        self.violations.push(format!("E{} is {} without an attempt trail", se.seq, row.state));
                    }
                }
            }
        }
    }

    // -----------------------------------------------------------------------
    // Quiescence: faults off, everybody back, run until nothing moves

    fn quiesce(&mut self) {
        self.faults = false;
        slog!(self, "---- QUIESCENCE: faults off, every worker back ----");
        let now = self.now;
        for w in self.workers_mut() {
            w.stalled_until_ms = w.stalled_until_ms.min(now);
            if !w.up {
                w.up = true;
            }
        }
        for _ in 0..QUIESCENCE_ROUNDS {
            let dt = self.rng.range(200, 2_000);
            self.set_now(self.now + dt);
            self.tick_broker();
            for c in 0..self.cmds.len() {
                if self.cmds[c].status == CmdStatus::Waiting && self.cmds[c].next_at_ms <= self.now {
                    self.command_try(c);
                }
            }
            for d in 0..self.disps.len() {
                for _ in 0..6 {
                    if !self.dispatcher_step(d, true) {
                        break;
                    }
                }
            }
            for r in 0..self.recs.len() {
                self.sweep(r);
                for _ in 0..6 {
                    if !self.reconciler_step(r, true) {
                        break;
                    }
                }
            }
            for c in 0..self.cons.len() {
                while self.consumer_step(c) {}
            }
            self.observe();
            if self.cfg.migration.as_ref().is_some_and(|p| p.step < self.cfg.main_steps) && self.hook_rng.chance(0.2) {
                self.operator_migrate();
                self.observe();
            }
            self.purge_hook(usize::MAX);
            if self.settled() {
                slog!(self, "---- settled ----");
                return;
            }
        }
        self.figures.not_quiescent += 1;
        self.violation(format!("not settled after {QUIESCENCE_ROUNDS} fault-free rounds"));
    }

    /// Whether the event's state is an allowed end state.
    fn final_state_ok(&self, st: &outbox_core::memory::MemoryState, ev: usize) -> Result<&'static str, String> {
        let se = &self.events[ev];
        let Some(row) = st.events.get(&se.id) else { return Err("missing from the store".into()) };
        if row.state.is_published() {
            return Ok("published");
        }
        if se.tampered && row.state == EventState::Quarantined {
            return Ok("quarantined_injected");
        }
        if row.state == EventState::Pending {
            let held = self.events.iter().any(|o| {
                o.seq < se.seq
                    && o.tampered
                    && o.dest.cluster_id == se.dest.cluster_id
                    && o.dest.topic == se.dest.topic
                    && o.dest.routing_key == se.dest.routing_key
                    && st.events.get(&o.id).is_some_and(|r| r.state == EventState::Quarantined)
            });
            if held {
                return Ok("held_behind_quarantine");
            }
        }
        Err(format!("ended {}", row.state))
    }

    fn settled(&self) -> bool {
        if self.cmds.iter().any(|c| c.status == CmdStatus::Waiting) {
            return false;
        }
        if self.disps.iter().any(|d| !d.work.is_empty() || !d.receipts.is_empty()) || self.recs.iter().any(|r| !r.tasks.is_empty()) {
            return false;
        }
        if self.requests.iter().any(|r| (!r.done && r.epoch == self.disps[r.disp].w.epoch) || (r.write_at_ms.is_some() && r.offset.is_none())) {
            return false;
        }
        if self.cons.iter().any(|c| (0..self.logs.len()).any(|l| c.positions.get(l).copied().unwrap_or(0) < self.logs[l].msgs.len())) {
            return false;
        }
        let st = self.store.lock();
        (0..self.events.len()).all(|e| self.final_state_ok(&st, e).is_ok())
    }

    // -----------------------------------------------------------------------
    // The invariants

    fn final_checks(&mut self) {
        let store = self.store.clone();
        let st = store.lock();
        let mut v: Vec<String> = Vec::new();
        let mut f = Figures::default();

        // Business commands and their envelopes.
        for (i, cmd) in self.cmds.iter().enumerate() {
            let mut distinct: Vec<&EventId> = Vec::new();
            for id in &cmd.returned {
                if !distinct.contains(&id) {
                    distinct.push(id);
                }
            }
            if distinct.len() > 1 {
                f.second_logical_event_ids += distinct.len() as u64 - 1;
                v.push(format!("command {} yielded {} event ids", cmd.key, distinct.len()));
            }
            match &cmd.business {
                Some(None) => {
                    f.commits_without_envelope += 1;
                    v.push(format!("command {} committed its business row without an envelope", cmd.key));
                }
                Some(Some(id)) if !st.events.contains_key(id) => {
                    f.commits_without_envelope += 1;
                    v.push(format!("command {}'s envelope {id} is not in the outbox", cmd.key));
                }
                _ => {}
            }
            if cmd.status == CmdStatus::GaveUp && cmd.business.is_some() {
                v.push(format!("command {i} gave up after committing"));
            }
        }
        for (e, se) in self.events.iter().enumerate() {
            if self.cmds[se.cmd].business.is_none() {
                f.envelopes_without_commit += 1;
                v.push(format!("E{e} has no business commit"));
            }
        }
        if st.events.len() != self.events.len() {
            f.envelopes_without_commit += st.events.len().abs_diff(self.events.len()) as u64;
            v.push(format!("the store holds {} events, the simulator committed {}", st.events.len(), self.events.len()));
        }

        // End states.
        for e in 0..self.events.len() {
            match self.final_state_ok(&st, e) {
                Ok("published") => f.events_published += 1,
                Ok("quarantined_injected") => f.quarantined_injected += 1,
                Ok(_) => f.held_behind_quarantine += 1,
                Err(why) => {
                    f.lost_events += 1;
                    v.push(format!("lost event E{e}: {why}"));
                }
            }
        }

        // Attempts: frozen destination, known to the simulator.
        for (e, se) in self.events.iter().enumerate() {
            for a in st.attempts.get(&se.id).map(|v| v.as_slice()).unwrap_or(&[]) {
                let frozen = matches!(se.gen(a.envelope_generation), Some((_, d)) if a.destination_digest == *d);
                if !frozen {
                    f.cross_destination_retries += 1;
                    v.push(format!("attempt {} of E{e} names another destination", self.an(e, &a.attempt_id)));
                }
            }
        }

        // Broker messages: at the frozen destination, traceable to an attempt.
        for lg in &self.logs {
            for (off, m) in lg.msgs.iter().enumerate() {
                let se = &self.events[m.ev];
                let frozen = se.gen(m.envelope_generation).unwrap_or(&se.gens[0]);
                if !frozen.0.admits(&lg.cluster, &lg.topic, lg.partition) || m.destination_digest != frozen.1 {
                    f.cross_destination_retries += 1;
                    v.push(format!("message of E{} at {}/{}/p{}@{off} is not at its frozen destination {}/{}/p{}", m.ev, lg.cluster, lg.topic, lg.partition, frozen.0.cluster_id, frozen.0.topic, frozen.0.partition));
                }
                match st.attempts.get(&m.event_id).and_then(|v| v.iter().find(|a| a.attempt_id == m.attempt)) {
                    None => {
                        f.untraced_messages += 1;
                        v.push(format!("message of E{} at {}/{}/p{}@{off} has no registered attempt", m.ev, lg.cluster, lg.topic, lg.partition));
                    }
                    Some(a) if a.state == AttemptState::Absent => {
                        f.false_absence_proofs += 1;
                        v.push(format!("attempt {} was closed ABSENT but its message is at {}/{}/p{}@{off}", self.an(m.ev, &m.attempt), lg.cluster, lg.topic, lg.partition));
                    }
                    Some(_) => {}
                }
            }
        }

        // Migrations: the old generation never reached the old target, the
        // store kept a receipt linking both generations with the old envelope.
        for &(e, from_gen, counted) in &self.migrated {
            let se = &self.events[e];
            let rec = st.migrations.iter().find(|m| m.event_id == se.id && m.from_generation == from_gen);
            let linked = rec.is_some_and(|m| m.to_generation == from_gen + 1 && m.from_envelope.envelope_generation == from_gen && se.gen(from_gen).is_some_and(|(_, d)| *d == m.from_destination_digest));
            if !linked {
                f.migrations_without_proof += 1;
                v.push(format!("E{e}'s migration from generation {from_gen} has no receipt linking both generations"));
            }
            if !counted && self.logs.iter().any(|l| l.msgs.iter().any(|m| m.ev == e && m.envelope_generation == from_gen)) {
                f.migrations_without_proof += 1;
                v.push(format!("E{e} was migrated, but generation {from_gen} reached the old target"));
            }
        }

        // The publish slot: the frozen payload and destination, a real message.
        for (e, se) in self.events.iter().enumerate() {
            let Some(row) = st.events.get(&se.id) else { continue };
            let Some(slot) = &row.slot else { continue };
            let msg = self.find_log(&slot.cluster_id, &slot.topic, slot.partition).and_then(|l| self.logs[l].msgs.get(slot.offset as usize));
            let real = msg.is_some_and(|m| m.event_id == se.id && m.attempt == slot.attempt_id && m.bytes_digest == se.payload_digest && m.destination_digest == se.dest_digest);
            if slot.payload_digest != se.payload_digest || slot.destination_digest != se.dest_digest || !se.dest.admits(&slot.cluster_id, &slot.topic, slot.partition) || !real {
                f.divergent_accepted += 1;
                v.push(format!("E{e}'s slot holds a divergent receipt ({}/{}/p{}@{})", slot.cluster_id, slot.topic, slot.partition, slot.offset));
            }
        }

        // Consumers: one effect per (consumer, event); every published event consumed.
        for c in &self.cons {
            for (&e, &(_, effects)) in &c.receipts {
                if effects > 1 {
                    f.duplicate_consumer_effects += effects as u64 - 1;
                    v.push(format!("{} took effect {effects} times for E{e}", c.w.name));
                }
            }
            for (e, se) in self.events.iter().enumerate() {
                if st.events.get(&se.id).is_some_and(|r| r.state.is_published()) && !c.receipts.contains_key(&e) {
                    f.published_not_consumed += 1;
                    v.push(format!("{} never consumed published E{e}", c.w.name));
                }
            }
        }

        // Late genuine ACKs converge into the slot (primary or duplicate).
        for la in &self.late_acks {
            if la.lost_in_crash || self.events[la.ev].tampered {
                continue;
            }
            f.late_acks_total += 1;
            let row = st.events.get(&la.receipt.event_id);
            let in_slot = row.and_then(|r| r.slot.as_ref()).is_some_and(|s| s.same_placement(&la.receipt) && s.attempt_id == la.receipt.attempt_id);
            let kept = st.duplicates.iter().any(|d| d.event_id == la.receipt.event_id && d.same_placement(&la.receipt));
            let decided = la.decision.as_ref().is_some_and(|d| d.is_primary() || *d == ReceiptDecision::Duplicate);
            if decided && (in_slot || kept) {
                f.late_acks_converged += 1;
            } else {
                f.late_acks_not_converged += 1;
                v.push(format!("late ACK of {} @{} did not converge (decision {:?})", self.an(la.ev, &la.receipt.attempt_id), la.receipt.offset, la.decision));
            }
        }
        for (e, d) in &self.refused {
            if self.events[*e].tampered {
                continue;
            }
            f.genuine_receipts_refused += 1;
            v.push(format!("a genuine receipt of E{e} was refused: {d}"));
        }
        drop(st);
        self.figures.merge(&f);
        for what in v {
            self.violation(what);
        }
        if self.log.is_some() {
            let mut line = String::new();
            for (n, val, _) in self.figures.entries() {
                if val > 0 {
                    let _ = write!(line, "{n}={val} ");
                }
            }
            slog!(self, "figures: {line}");
        }
    }
}
