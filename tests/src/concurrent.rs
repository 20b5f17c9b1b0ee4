//! A concurrent checker over real PostgreSQL and librdkafka's in-process
//! Kafka cluster (issue 44 item 2): many connections interleave emits
//! (overlapping, long and aborted transactions, commits whose answers are
//! lost and whose commands are retried), several real dispatchers (killed
//! and replaced mid-run: takeovers once their leases run out), sessions
//! terminated mid-statement, sends whose answers are lost (round trips
//! past the message timeout, Produce requests failed or cut off), a
//! reconciler, destination migrations and retention. Once the faults stop
//! and the services settle, it reads every record of the topics and checks
//! what the simulator checks (`outbox-sim/src/services/checks.rs`):
//!
//! - `lost:` a committed event not in the outbox, published without a
//!   receipt, or whose receipt's log position does not hold its message;
//! - `duplicate:` a copy in the log that no receipt accounts for (nor a
//!   transport retry of a receipted attempt), or anything of an aborted
//!   transaction in the store or the log;
//! - `order_violation:` per routing key, the first copies of its events
//!   (migrated ones aside) not in the order the client committed them;
//! - `stuck:` committed, not settled when the settle deadline passed, and
//!   nothing in the store blocks it;
//! - `cross_destination:` a copy in a topic/partition (or under a key)
//!   other than the destination its envelope generation froze;
//! - `second_logical_event:` a retried command answered with another
//!   event, a command with two committed events, or a copy whose payload is
//!   not the bytes the client emitted.
//!
//! The verdict is a list of violations, each prefixed by its category; the
//! checker never panics on what it finds. The order the client committed
//! each key's events in is the client's own record: an emitter holds a
//! client-side lock of every key it writes from before its transaction
//! begins until its commit is answered, so no database sequence is trusted
//! for it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_core::{headers, sha256_digest, Broker, EmitRequest, EventId, RetryPolicy, RoutePolicy};
use outbox_producer::{
    Dispatcher, DispatcherConfig, EmitOptions, KafkaBroker, KafkaConfig, MigrationOutcome, PgStore,
    Reconciler, ReconcilerConfig, RetentionPolicy,
};
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::kafka::{read_topic, LogMessage, TestCluster};
use crate::pg_proxy::CommitCutter;
use crate::ORDER_CREATED;

/// Partitions of each topic the checker writes.
pub const PARTITIONS: i32 = 3;

/// The application name of the dispatchers' sessions (the ones the
/// injected statement failures terminate).
const VICTIM_APP: &str = "outbox-checker-dispatch";

/// What one checker run does.
#[derive(Debug, Clone)]
pub struct CheckerConfig {
    /// Seeds every random draw of the workload (the interleavings also
    /// depend on timing: a seed is a hint for reproducing, not a replay).
    pub seed: u64,
    /// Concurrent emitting tasks, each with its own connections.
    pub emitters: usize,
    /// Events the emitters try to emit (aborted ones included).
    pub events: usize,
    /// Routing keys the emitters share (one more is the long transaction's).
    pub keys: usize,
    /// Dispatchers running at once.
    pub dispatchers: usize,
    /// Whether faults are injected at all (the switches below choose which).
    pub faults: bool,
    /// Dispatcher sessions terminated mid-statement.
    pub kills: bool,
    /// Dispatchers killed and replaced under another name.
    pub takeovers: bool,
    /// Sends whose answers are lost (slow broker windows, Produce errors).
    pub broker_faults: bool,
    /// Whether an operator migrates unsettled events to a second topic.
    pub migrations: bool,
    /// Whether retention runs (PUBLISHED -> RETAINED -> PURGED).
    pub retention: bool,
    /// Whether one transaction is held open across most of the emission.
    pub long_transaction: bool,
    /// How long the emitters spread their transactions over.
    pub emit_for: Duration,
    /// The dispatchers' lease (short, so killed dispatchers' work is taken over).
    pub lease_ms: i64,
    /// The Kafka adapter's message (and request) timeout.
    pub message_timeout_ms: u64,
    /// Percent of emitting transactions rolled back.
    pub abort_percent: u64,
    /// Per mille of COMMITs (emitters' and dispatchers') whose answer is lost.
    pub lost_commit_per_mille: u32,
    /// How long the services get to settle once the faults stop.
    pub settle_for: Duration,
    /// How many runs the test makes (each with its own seed and topics).
    pub rounds: usize,
    /// Event ids the checks treat as committed although the workload did
    /// not emit them: the hook that shows the checker can fail.
    pub extra_committed: Vec<String>,
}

impl CheckerConfig {
    /// The bounded run `scripts/test` makes: a few hundred events over 8 s
    /// of faults, settled in well under half a minute on two cores.
    pub fn bounded() -> Self {
        CheckerConfig {
            seed: 44,
            emitters: 4,
            events: 500,
            keys: 12,
            dispatchers: 2,
            faults: true,
            kills: true,
            takeovers: true,
            broker_faults: true,
            migrations: true,
            retention: true,
            long_transaction: true,
            emit_for: Duration::from_secs(8),
            lease_ms: 1_500,
            message_timeout_ms: 1_500,
            abort_percent: 10,
            lost_commit_per_mille: 20,
            settle_for: Duration::from_secs(25),
            rounds: 1,
            extra_committed: Vec::new(),
        }
    }

    /// [`CheckerConfig::bounded`], changed by the environment for the
    /// longer run: `OUTBOX_CHECKER_EVENTS` (the emission time grows with
    /// it, 60 events a second), `OUTBOX_CHECKER_SEED`,
    /// `OUTBOX_CHECKER_ROUNDS`, `OUTBOX_CHECKER_EMITTERS`,
    /// `OUTBOX_CHECKER_KEYS`, `OUTBOX_CHECKER_DISPATCHERS`.
    pub fn from_env() -> Self {
        let mut cfg = Self::bounded();
        let var = |name: &str| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        if let Some(events) = var("OUTBOX_CHECKER_EVENTS") {
            cfg.events = events as usize;
            cfg.emit_for = cfg.emit_for.max(Duration::from_millis(events * 1_000 / 60));
        }
        if let Some(seed) = var("OUTBOX_CHECKER_SEED") {
            cfg.seed = seed;
        }
        for (name, count) in [
            ("OUTBOX_CHECKER_ROUNDS", &mut cfg.rounds),
            ("OUTBOX_CHECKER_EMITTERS", &mut cfg.emitters),
            ("OUTBOX_CHECKER_KEYS", &mut cfg.keys),
            ("OUTBOX_CHECKER_DISPATCHERS", &mut cfg.dispatchers),
        ] {
            if let Some(n) = var(name) {
                *count = n.max(1) as usize;
            }
        }
        for (name, switch) in [
            ("OUTBOX_CHECKER_FAULTS", &mut cfg.faults),
            ("OUTBOX_CHECKER_MIGRATIONS", &mut cfg.migrations),
            ("OUTBOX_CHECKER_RETENTION", &mut cfg.retention),
            ("OUTBOX_CHECKER_KILLS", &mut cfg.kills),
            ("OUTBOX_CHECKER_TAKEOVERS", &mut cfg.takeovers),
            ("OUTBOX_CHECKER_BROKER_FAULTS", &mut cfg.broker_faults),
            ("OUTBOX_CHECKER_LONG", &mut cfg.long_transaction),
        ] {
            if let Some(n) = var(name) {
                *switch = n != 0;
            }
        }
        if let Some(n) = var("OUTBOX_CHECKER_LOST_COMMITS") {
            cfg.lost_commit_per_mille = n as u32;
        }
        if let Some(n) = var("OUTBOX_CHECKER_LEASE_MS") {
            cfg.lease_ms = n as i64;
        }
        cfg
    }
}

/// What a run did: counts of the workload, the faults and the outcome.
#[derive(Debug, Clone, Default)]
pub struct Figures {
    /// Events whose transaction committed (as far as the client knows,
    /// the long transaction's and retried commands' included).
    pub committed: u64,
    /// Events of rolled-back transactions.
    pub aborted: u64,
    /// Emitting transactions (committed, rolled back or failed).
    pub transactions: u64,
    /// Emitting transactions that failed before their commit (rolled back).
    pub emit_failures: u64,
    /// The first few failures' errors.
    pub emit_failure_examples: Vec<String>,
    /// Emitters' COMMITs whose answer was lost (the command then retried).
    pub emit_commits_unanswered: u64,
    /// Commands retried (after a lost commit answer, or on purpose).
    pub command_retries: u64,
    /// How long the emitters took, ms.
    pub emission_ms: u64,
    /// The longest emitting transaction, from waiting for its keys to its
    /// commit's answer, ms.
    pub slowest_transaction_ms: u64,
    /// Events of the long transaction (held open across others' commits).
    pub long_transaction_events: u64,
    /// Commits the long transaction was held open across.
    pub commits_under_long_transaction: u64,
    /// Dispatchers killed mid-run and replaced under another name.
    pub takeovers: u64,
    /// Dispatcher runs that ended by themselves (restarted).
    pub dispatcher_exits: u64,
    /// Dispatcher sessions terminated (`pg_terminate_backend`).
    pub sessions_killed: u64,
    /// COMMIT answers the proxies cut (emitters' and dispatchers').
    pub commit_answers_cut: u64,
    /// COMMITs that went through the proxies.
    pub commits_through_proxies: u64,
    /// Windows in which the broker answered after the message timeout.
    pub slow_broker_windows: u64,
    /// Produce request errors pushed into the mock cluster.
    pub produce_errors: u64,
    /// Destination migrations committed.
    pub migrations: u64,
    /// Destination migrations refused.
    pub migrations_refused: u64,
    /// PUBLISHED -> RETAINED by retention.
    pub retained: u64,
    /// RETAINED -> PURGED by retention.
    pub purged: u64,
    /// Events the store ended PUBLISHED, RETAINED or PURGED.
    pub published: u64,
    /// Events the store ended QUARANTINED.
    pub quarantined: u64,
    /// Events in the exception lane (`outbox_events`) at the end.
    pub in_lane: u64,
    /// UNKNOWN outcomes the reconciler resolved.
    pub unknown_resolved: u64,
    /// Records read back from the topics.
    pub log_records: u64,
    /// Extra copies of a receipted attempt (the client's transport retry).
    pub transport_copies: u64,
    /// How long the services took to settle after the faults stopped, ms.
    pub settle_ms: u64,
    /// Wall time of the run, ms.
    pub wall_ms: u64,
}

/// The outcome of a run: the violations (empty: green) and the figures.
#[derive(Debug, Clone, Default)]
pub struct Verdict {
    /// Each violation, prefixed by its category (`lost:`, `duplicate:`,
    /// `order_violation:`, `stuck:`, `cross_destination:`,
    /// `second_logical_event:`).
    pub violations: Vec<String>,
    /// What the run did.
    pub figures: Figures,
    /// For a red verdict: what the store held for the keys of the events
    /// found stuck (lane rows, chain heads, stream batches), to explain it.
    pub diagnostics: Vec<String>,
}

// ------------------------------------------------------------------ rng

/// A small deterministic generator (SplitMix64).
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// A draw in `0..n` (0 when `n` is 0).
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }

    fn percent(&mut self, p: u64) -> bool {
        self.below(100) < p
    }
}

pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

// --------------------------------------------------------------- ledger

/// One event as the client emitted it.
#[derive(Debug, Clone)]
struct EmitRecord {
    id: String,
    command: String,
    key: String,
    payload_digest: String,
    topic: String,
    partition: i32,
}

/// The client's truth: what committed (per key in commit order), what
/// was rolled back, and what the workload itself saw go wrong.
#[derive(Debug, Default, Clone)]
struct Ledger {
    committed: Vec<EmitRecord>,
    /// The ids of `committed`.
    ids: std::collections::HashSet<String>,
    /// Per routing key, event ids in the order their commits were answered
    /// (under the client-side key lock, so in commit order).
    by_key: BTreeMap<String, Vec<String>>,
    aborted: Vec<String>,
    /// First tries whose commit answer was lost and whose retry inserted
    /// another event: (command, first id).
    unanswered_first_tries: Vec<(String, String)>,
    violations: Vec<String>,
}

/// The shared state of a run's tasks.
struct Shared {
    cfg: CheckerConfig,
    ledger: Mutex<Ledger>,
    figures: Mutex<Figures>,
    /// Whether faults are being injected now.
    faults: AtomicBool,
    /// Events the emitters may still start.
    budget: AtomicUsize,
    /// Emitting transactions committed so far.
    commits: AtomicU64,
    /// One lock per routing key, holding the key's next aggregate version.
    keys: Vec<tokio::sync::Mutex<i64>>,
    key_names: Vec<String>,
    topic_a: String,
    topic_b: String,
    bootstrap: String,
    run: String,
}

impl Shared {
    fn figures(&self) -> std::sync::MutexGuard<'_, Figures> {
        self.figures.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn faulty(&self) -> bool {
        self.faults.load(Ordering::SeqCst)
    }
}

// ----------------------------------------------------------------- run

/// The services and fault injectors of a run, to be stopped at its end.
struct Services {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

/// Runs the workload on `pool` (whose dispatch path the caller chose),
/// lets the services settle, and checks what the store and the log show.
pub async fn run_checker(pool: &PgPool, cfg: &CheckerConfig) -> Verdict {
    let started = Instant::now();
    let run = format!("r{:x}", mix(cfg.seed) & 0xffff_ffff);
    let cluster = TestCluster::start();
    let (topic_a, topic_b) = (format!("orders-{run}"), format!("orders-moved-{run}"));
    cluster.topic(&topic_a, PARTITIONS);
    cluster.topic(&topic_b, PARTITIONS);
    let probe = match connect_broker(&cluster.bootstrap, cfg).await {
        Ok(b) => b,
        Err(e) => return setup_failed(format!("broker: {e}")),
    };
    crate::business_schema(pool).await;
    if let Err(e) = outbox_producer::routes::revise(
        pool,
        &RoutePolicy::new(
            ORDER_CREATED,
            probe.cluster_id(),
            &topic_a,
            PARTITIONS as u32,
        ),
    )
    .await
    {
        return setup_failed(format!("route: {e}"));
    }
    let shared = Arc::new(Shared {
        cfg: cfg.clone(),
        ledger: Mutex::default(),
        figures: Mutex::default(),
        faults: AtomicBool::new(cfg.faults),
        budget: AtomicUsize::new(cfg.events),
        commits: AtomicU64::new(0),
        keys: (0..=cfg.keys).map(|_| tokio::sync::Mutex::new(1)).collect(),
        key_names: (0..cfg.keys)
            .map(|k| format!("k{k}-{run}"))
            .chain([long_key_name(&run)])
            .collect(),
        topic_a,
        topic_b,
        bootstrap: cluster.bootstrap.clone(),
        run,
    });
    let (emit_proxy, dispatch_proxy) = match (
        CommitCutter::in_front_of(pool, cfg.seed).await,
        CommitCutter::in_front_of(pool, cfg.seed ^ 1).await,
    ) {
        (Ok(a), Ok(b)) => (a, b),
        _ => return setup_failed("could not start the PostgreSQL proxies".into()),
    };
    let (emit_pool, victims) = match (
        emit_proxy
            .pool(pool, cfg.emitters as u32 + 4, "outbox-checker-emit")
            .await,
        dispatch_proxy
            .pool(pool, 8 * cfg.dispatchers as u32 + 4, VICTIM_APP)
            .await,
    ) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            return setup_failed(format!("pools through the proxies: {e}"))
        }
    };
    if cfg.faults {
        emit_proxy.set_per_mille(cfg.lost_commit_per_mille);
        dispatch_proxy.set_per_mille(cfg.lost_commit_per_mille);
    }

    let services = start_services(&shared, pool, &victims, &probe).await;
    let emitters = start_emitters(&shared, &emit_pool);
    inject_broker_faults(
        &shared,
        &cluster,
        &emitters,
        &[&emit_proxy, &dispatch_proxy],
    )
    .await;
    for e in emitters {
        let _ = e.await;
    }
    shared.figures().emission_ms = started.elapsed().as_millis() as u64;
    // Faults stop; the services go on until every event is settled.
    shared.faults.store(false, Ordering::SeqCst);
    emit_proxy.set_per_mille(0);
    dispatch_proxy.set_per_mille(0);
    calm_broker(&cluster);
    let settle_from = Instant::now();
    let settled = settle(pool, &shared).await;
    shared.figures().settle_ms = settle_from.elapsed().as_millis() as u64;
    stop_services(services).await;
    shared.figures().commit_answers_cut = emit_proxy.cuts() + dispatch_proxy.cuts();
    shared.figures().commits_through_proxies =
        emit_proxy.commits_seen() + dispatch_proxy.commits_seen();
    emit_pool.close().await;
    victims.close().await;

    let mut violations = std::mem::take(&mut shared.ledger().violations);
    if !settled {
        violations.push(format!(
            "stuck: not every committed event settled within {} ms of the faults stopping",
            cfg.settle_for.as_millis()
        ));
    }
    let mut figures = shared.figures().clone();
    figures.committed = shared.ledger().committed.len() as u64;
    check(pool, &shared, &mut figures, &mut violations).await;
    figures.wall_ms = started.elapsed().as_millis() as u64;
    let diagnostics = diagnose(pool, &violations).await;
    Verdict {
        violations,
        figures,
        diagnostics,
    }
}

fn setup_failed(why: String) -> Verdict {
    Verdict {
        violations: vec![format!("setup: {why}")],
        ..Verdict::default()
    }
}

/// A Kafka adapter on the test cluster with the run's short timeouts, so
/// the reconciler's in-flight bound (and with it the wait before an
/// unsent UNKNOWN is retried) stays around ten seconds.
async fn connect_broker(bootstrap: &str, cfg: &CheckerConfig) -> Result<Arc<KafkaBroker>, String> {
    let mut k = KafkaConfig::new(bootstrap.to_owned());
    k.message_timeout_ms = cfg.message_timeout_ms;
    k.request_timeout_ms = cfg.message_timeout_ms;
    k.enqueue_timeout_ms = 1_000;
    k.lookup_timeout_ms = 5_000;
    k.extra
        .push(("reconnect.backoff.max.ms".into(), "1000".into()));
    KafkaBroker::connect(k)
        .await
        .map(Arc::new)
        .map_err(|e| e.to_string())
}

/// The reconciler's in-flight bound for `broker`: no sooner than the
/// adapter allows (a message may stay in the client that long).
fn in_flight_bound(broker: &KafkaBroker) -> i64 {
    broker.max_in_flight_ms().unwrap_or(30_000) as i64
        + outbox_core::reconcile::DEFAULT_CLOCK_SKEW_ALLOWANCE_MS
}

async fn start_services(
    shared: &Arc<Shared>,
    pool: &PgPool,
    victims: &PgPool,
    probe: &Arc<KafkaBroker>,
) -> Services {
    let (stop, stop_rx) = watch::channel(false);
    let mut tasks = vec![
        tokio::spawn(supervise_dispatchers(
            shared.clone(),
            victims.clone(),
            stop_rx.clone(),
        )),
        tokio::spawn(reconcile(pool.clone(), probe.clone(), stop_rx.clone())),
    ];
    if shared.cfg.long_transaction {
        tasks.push(tokio::spawn(long_transaction(shared.clone(), pool.clone())));
    }
    if shared.cfg.faults && shared.cfg.kills {
        tasks.push(tokio::spawn(kill_sessions(
            shared.clone(),
            pool.clone(),
            stop_rx.clone(),
        )));
    }
    if shared.cfg.migrations {
        tasks.push(tokio::spawn(migrate(
            shared.clone(),
            pool.clone(),
            probe.clone(),
            stop_rx.clone(),
        )));
    }
    if shared.cfg.retention {
        tasks.push(tokio::spawn(retain(
            shared.clone(),
            pool.clone(),
            stop_rx.clone(),
        )));
    }
    Services { stop, tasks }
}

async fn stop_services(s: Services) {
    let _ = s.stop.send(true);
    for t in s.tasks {
        let _ = t.await;
    }
}

/// Sleeps `ms`, or less when `stop` turns true; whether it did.
async fn pause(stop: &mut watch::Receiver<bool>, ms: u64) -> bool {
    if *stop.borrow() {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_millis(ms)) => *stop.borrow(),
        _ = stop.changed() => true,
    }
}

// ------------------------------------------------------------ emitters

fn start_emitters(shared: &Arc<Shared>, pool: &PgPool) -> Vec<JoinHandle<()>> {
    (0..shared.cfg.emitters)
        .map(|n| tokio::spawn(emitter(shared.clone(), pool.clone(), n)))
        .collect()
}

/// One emitter: transactions of one to four events for random shared keys,
/// spread over the emission time, ~`abort_percent` rolled back.
async fn emitter(shared: Arc<Shared>, pool: PgPool, n: usize) {
    let cfg = &shared.cfg;
    let mut rng = Rng(cfg.seed ^ mix(n as u64 + 1));
    // Two and a half events per transaction on average.
    let per_emitter = (cfg.events as u64 * 2 / 5 / cfg.emitters.max(1) as u64).max(1);
    let gap_ms = (cfg.emit_for.as_millis() as u64 / per_emitter).max(1);
    let mut txn = 0u64;
    loop {
        let size = 1 + rng.below(4) as usize;
        if shared
            .budget
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| {
                if b == 0 {
                    None
                } else {
                    Some(b.saturating_sub(size))
                }
            })
            .is_err()
        {
            return;
        }
        let keys: Vec<usize> = (0..size)
            .map(|_| rng.below(cfg.keys as u64) as usize)
            .collect();
        let abort = rng.percent(cfg.abort_percent);
        let hold_ms = rng.below(8);
        let tx_name = format!("{}-e{n}-t{txn}", shared.run);
        run_transaction(&shared, &pool, &tx_name, &keys, abort, hold_ms, &mut rng).await;
        txn += 1;
        tokio::time::sleep(Duration::from_millis(rng.below(2 * gap_ms))).await;
    }
}

/// The requests of one transaction, built while its keys are locked.
struct Planned {
    command: String,
    key: String,
    version: i64,
    payload: Vec<u8>,
}

impl Planned {
    fn request(&self) -> EmitRequest<'_> {
        EmitRequest {
            aggregate_version: self.version,
            ..crate::order_request(&self.command, &self.key, &self.payload)
        }
    }
}

/// One emitting transaction over `keys` (indices), holding the client-side
/// lock of each (in index order, so emitters never wait in a cycle) from
/// before it begins until its commit is answered.
async fn run_transaction(
    shared: &Shared,
    pool: &PgPool,
    name: &str,
    keys: &[usize],
    abort: bool,
    hold_ms: u64,
    rng: &mut Rng,
) {
    let began = Instant::now();
    let distinct: BTreeSet<usize> = keys.iter().copied().collect();
    let mut guards = BTreeMap::new();
    for k in distinct {
        guards.insert(k, shared.keys[k].lock().await);
    }
    let mut planned = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        let version = guards.get_mut(k).map(|g| {
            let v = **g;
            **g += 1;
            v
        });
        let key = shared.key_names[*k].clone();
        let payload = crate::order_payload(&format!("{key}-{i}"), rng.below(1_000_000) as i64);
        planned.push(Planned {
            command: format!("cmd-{name}-{i}"),
            key,
            version: version.unwrap_or(1),
            payload,
        });
    }
    shared.figures().transactions += 1;
    let outcome = emit_and_end(pool, name, &planned, abort, hold_ms).await;
    record_outcome(shared, pool, name, &planned, outcome).await;
    if !abort && rng.percent(5) {
        retry_commands(shared, pool, &planned).await;
    }
    drop(guards);
    let took = began.elapsed().as_millis() as u64;
    let mut f = shared.figures();
    f.slowest_transaction_ms = f.slowest_transaction_ms.max(took);
}

/// How an emitting transaction ended.
enum TxOutcome {
    Committed(Vec<outbox_producer::Emitted>),
    RolledBack(Vec<outbox_producer::Emitted>),
    /// The COMMIT was sent and its answer lost.
    Unanswered(Vec<outbox_producer::Emitted>),
    Failed(String),
}

/// Begins, writes the business rows, emits, holds the transaction open a
/// few ms, and commits or rolls back.
async fn emit_and_end(
    pool: &PgPool,
    name: &str,
    planned: &[Planned],
    abort: bool,
    hold_ms: u64,
) -> TxOutcome {
    let mut tx = match pool.begin().await {
        Ok(tx) => tx,
        Err(e) => return TxOutcome::Failed(format!("begin: {e}")),
    };
    if let Err(e) = sqlx::query("INSERT INTO orders (id, total_cents) VALUES ($1, 1)")
        .bind(name)
        .execute(&mut *tx)
        .await
    {
        return TxOutcome::Failed(format!("business row: {e}"));
    }
    let requests: Vec<EmitRequest<'_>> = planned.iter().map(Planned::request).collect();
    let emitted =
        match outbox_producer::emit_batch(&mut tx, &requests, &EmitOptions::default()).await {
            Ok(e) => e,
            Err(e) => return TxOutcome::Failed(format!("emit: {e}")),
        };
    tokio::time::sleep(Duration::from_millis(hold_ms)).await;
    if abort {
        let _ = tx.rollback().await;
        return TxOutcome::RolledBack(emitted);
    }
    match tx.commit().await {
        Ok(()) => TxOutcome::Committed(emitted),
        Err(_) => TxOutcome::Unanswered(emitted),
    }
}

fn record_of(e: &outbox_producer::Emitted, p: &Planned) -> EmitRecord {
    EmitRecord {
        id: e.event_id().to_string(),
        command: p.command.clone(),
        key: e.destination.routing_key.clone(),
        payload_digest: sha256_digest(&p.payload),
        topic: e.destination.topic.clone(),
        partition: e.destination.partition,
    }
}

/// Writes an ended transaction into the ledger; a lost commit answer is
/// resolved by retrying the commands (still under the key locks).
async fn record_outcome(
    shared: &Shared,
    pool: &PgPool,
    name: &str,
    planned: &[Planned],
    outcome: TxOutcome,
) {
    match outcome {
        TxOutcome::Committed(emitted) => commit_into_ledger(shared, &emitted, planned),
        TxOutcome::RolledBack(emitted) => {
            shared.figures().aborted += emitted.len() as u64;
            shared
                .ledger()
                .aborted
                .extend(emitted.iter().map(|e| e.event_id().to_string()));
        }
        TxOutcome::Failed(why) => {
            let mut f = shared.figures();
            f.emit_failures += 1;
            if f.emit_failure_examples.len() < 3 {
                f.emit_failure_examples.push(why);
            }
        }
        TxOutcome::Unanswered(first) => {
            shared.figures().emit_commits_unanswered += 1;
            resolve_unanswered(shared, pool, name, planned, first).await;
        }
    }
}

fn commit_into_ledger(shared: &Shared, emitted: &[outbox_producer::Emitted], planned: &[Planned]) {
    shared.commits.fetch_add(1, Ordering::SeqCst);
    let mut ledger = shared.ledger();
    for (e, p) in emitted.iter().zip(planned) {
        let r = record_of(e, p);
        if !ledger.ids.insert(r.id.clone()) {
            continue;
        }
        ledger
            .by_key
            .entry(r.key.clone())
            .or_default()
            .push(r.id.clone());
        ledger.committed.push(r);
    }
}

/// The client lost the answer to its COMMIT: it retries the same commands
/// until a commit is answered. A command whose first try committed must
/// be answered with the first event (a second one is a second logical
/// event); one whose first try did not commit gets a new event.
async fn retry_until_answered(
    pool: &PgPool,
    name: &str,
    planned: &[Planned],
) -> Option<Vec<outbox_producer::Emitted>> {
    for attempt in 0..20 {
        match emit_and_end(pool, &format!("{name}-retry{attempt}"), planned, false, 0).await {
            TxOutcome::Committed(e) => return Some(e),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    None
}

async fn resolve_unanswered(
    shared: &Shared,
    pool: &PgPool,
    name: &str,
    planned: &[Planned],
    first: Vec<outbox_producer::Emitted>,
) {
    shared.figures().command_retries += planned.len() as u64;
    let Some(retried) = retry_until_answered(pool, name, planned).await else {
        shared.ledger().violations.push(format!(
            "stuck: the retry of transaction {name} (its commit answer lost) never committed"
        ));
        return;
    };
    let mut ledger = shared.ledger();
    for ((f, r), p) in first.iter().zip(&retried).zip(planned) {
        if !r.inserted && r.event_id() != f.event_id() {
            ledger.violations.push(format!(
                "second_logical_event: the retry of {} (first event {}) was answered with {}",
                p.command,
                f.event_id(),
                r.event_id()
            ));
        }
        if r.inserted {
            // The first try did not commit, or it did and this is a second
            // event: the checks look for the first one in the store.
            ledger
                .unanswered_first_tries
                .push((p.command.clone(), f.event_id().to_string()));
        }
    }
    drop(ledger);
    commit_into_ledger(shared, &retried, planned);
}

/// A client retries commands that committed (as after a lost answer): the
/// answer must be the first event, and nothing is inserted.
async fn retry_commands(shared: &Shared, pool: &PgPool, planned: &[Planned]) {
    let firsts: BTreeMap<String, String> = shared
        .ledger()
        .committed
        .iter()
        .filter(|c| planned.iter().any(|p| p.command == c.command))
        .map(|c| (c.command.clone(), c.id.clone()))
        .collect();
    shared.figures().command_retries += planned.len() as u64;
    let Ok(mut tx) = pool.begin().await else {
        return;
    };
    let requests: Vec<EmitRequest<'_>> = planned.iter().map(Planned::request).collect();
    let answered = outbox_producer::emit_batch(&mut tx, &requests, &EmitOptions::default()).await;
    let _ = tx.rollback().await;
    let Ok(answered) = answered else { return };
    let mut ledger = shared.ledger();
    for (a, p) in answered.iter().zip(planned) {
        let first = firsts.get(&p.command);
        if a.inserted || first.is_some_and(|f| f != a.event_id().as_str()) {
            ledger.violations.push(format!("second_logical_event: the retry of committed command {} (first event {first:?}) was answered with {} (inserted {})", p.command, a.event_id(), a.inserted));
        }
    }
}

/// The long transaction's key: its own, but in the stream bucket of the
/// first regular key (routing keys are `tenant-7.order.<key>`), so that
/// the bucket is cut while the long transaction is open and its events
/// must come in a later cut by the snapshot rule, not by position.
fn long_key_name(run: &str) -> String {
    let bucket = |key: &str| outbox_core::stream::bucket_of_key(&format!("tenant-7.order.{key}"));
    let target = bucket(&format!("k0-{run}"));
    (0..10_000).map(|n| format!("long{n}-{run}")).find(|k| bucket(k) == target).unwrap_or_else(|| format!("long-{run}"))
}

/// A transaction on its own key held open while others commit (the
/// stream's snapshots must wait for it), then committed.
async fn long_transaction(shared: Arc<Shared>, pool: PgPool) {
    let k = shared.cfg.keys;
    let mut version = shared.keys[k].lock().await;
    let key = shared.key_names[k].clone();
    let planned: Vec<Planned> = (0..3)
        .map(|i| Planned {
            command: format!("cmd-{}-long-{i}", shared.run),
            key: key.clone(),
            version: *version + i,
            payload: crate::order_payload(&key, i),
        })
        .collect();
    *version += 3;
    let Ok(mut tx) = pool.begin().await else {
        return;
    };
    let requests: Vec<EmitRequest<'_>> = planned.iter().map(Planned::request).collect();
    let Ok(emitted) =
        outbox_producer::emit_batch(&mut tx, &requests, &EmitOptions::default()).await
    else {
        return;
    };
    let before = shared.commits.load(Ordering::SeqCst);
    // Held until most of the budget is spent (or the emission time passed).
    let deadline = Instant::now() + shared.cfg.emit_for;
    while shared.budget.load(Ordering::SeqCst) > shared.cfg.events / 4 && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if tx.commit().await.is_ok() {
        shared.figures().long_transaction_events += emitted.len() as u64;
        shared.figures().commits_under_long_transaction +=
            shared.commits.load(Ordering::SeqCst) - before;
        commit_into_ledger(&shared, &emitted, &planned);
    }
}

// ------------------------------------------------------------- services

/// A dispatcher named `name` over `victims` (the sessions the faults kill).
async fn spawn_dispatcher(
    shared: &Shared,
    victims: &PgPool,
    name: String,
    stop: watch::Receiver<bool>,
) -> Option<JoinHandle<Result<outbox_producer::BatchReport, outbox_producer::ProducerError>>> {
    let broker = connect_broker(&shared.bootstrap, &shared.cfg).await.ok()?;
    let cfg = DispatcherConfig { batch_size: 20, lease_ms: shared.cfg.lease_ms, shutdown_grace_ms: 3_000, ..crate::dispatch::config(&name) };
    let d = Dispatcher::new(PgStore::new(victims.clone()), broker, cfg).ok()?;
    Some(tokio::spawn(
        Arc::new(d).run(outbox_producer::until_true(stop)),
    ))
}

/// Runs `dispatchers` dispatchers; while faults are on, kills one now and
/// then (its task aborted: its leases run out) and starts a replacement
/// under another name; restarts one whose run ended by itself.
async fn supervise_dispatchers(
    shared: Arc<Shared>,
    victims: PgPool,
    mut stop: watch::Receiver<bool>,
) {
    let mut rng = Rng(shared.cfg.seed ^ 0xD15);
    let mut next = 0usize;
    let mut running = Vec::new();
    let takeover_every_ms = (shared.cfg.lease_ms as u64 * 2).max(500);
    let mut since_takeover = Instant::now();
    loop {
        while running.len() < shared.cfg.dispatchers {
            let name = format!("d{next}-{}", shared.run);
            next += 1;
            match spawn_dispatcher(&shared, &victims, name, stop.clone()).await {
                Some(h) => running.push(h),
                None => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        if pause(&mut stop, 100).await {
            break;
        }
        let ended = running.iter().filter(|h| h.is_finished()).count();
        if ended > 0 {
            shared.figures().dispatcher_exits += ended as u64;
            running.retain(|h| !h.is_finished());
        }
        if shared.faulty()
            && shared.cfg.takeovers
            && since_takeover.elapsed() >= Duration::from_millis(takeover_every_ms)
            && !running.is_empty()
        {
            let victim = running.swap_remove(rng.below(running.len() as u64) as usize);
            victim.abort();
            let _ = victim.await;
            shared.figures().takeovers += 1;
            since_takeover = Instant::now();
        }
    }
    for h in running {
        let _ = h.await;
    }
}

/// Terminates a random busy dispatcher session every ~100 ms while faults are on.
async fn kill_sessions(shared: Arc<Shared>, pool: PgPool, mut stop: watch::Receiver<bool>) {
    while !pause(&mut stop, 100).await {
        if !shared.faulty() {
            continue;
        }
        let killed: Result<Option<bool>, _> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE application_name = $1 AND state <> 'idle' ORDER BY random() LIMIT 1",
        )
        .bind(VICTIM_APP)
        .fetch_optional(&pool)
        .await;
        if let Ok(Some(true)) = killed {
            shared.figures().sessions_killed += 1;
        }
    }
}

/// The reconciler: resolves UNKNOWNs and compares (the bypass scan) every 300 ms.
async fn reconcile(pool: PgPool, broker: Arc<KafkaBroker>, stop: watch::Receiver<bool>) {
    let retry = RetryPolicy {
        in_flight_bound_ms: in_flight_bound(&broker),
        recheck_ms: 300,
        ..RetryPolicy::default()
    };
    let cfg = ReconcilerConfig {
        owner: "checker-reconciler".into(),
        lease_ms: 5_000,
        retry,
        interval_ms: 300,
        ..ReconcilerConfig::default()
    };
    let Ok(rec) = Reconciler::new(PgStore::new(pool), broker, cfg) else {
        return;
    };
    let _ = rec.run(outbox_producer::until_true(stop)).await;
}

/// An operator moves a random unsettled event to the second topic now and
/// then (PROTOCOL §7), while faults are on.
async fn migrate(
    shared: Arc<Shared>,
    pool: PgPool,
    broker: Arc<KafkaBroker>,
    mut stop: watch::Receiver<bool>,
) {
    let store = PgStore::new(pool.clone());
    let retry = RetryPolicy {
        in_flight_bound_ms: in_flight_bound(&broker),
        ..RetryPolicy::default()
    };
    let route = RoutePolicy::new(
        ORDER_CREATED,
        broker.cluster_id(),
        &shared.topic_b,
        PARTITIONS as u32,
    );
    while !pause(&mut stop, 400).await {
        if !shared.faulty() {
            continue;
        }
        let Some(id) = unsettled_event(&pool).await else {
            continue;
        };
        let Ok(event_id) = id.parse::<EventId>() else {
            continue;
        };
        match outbox_producer::migrate_destination(
            &store,
            broker.as_ref(),
            &event_id,
            &route,
            "ops-checker",
            &retry,
        )
        .await
        {
            Ok(MigrationOutcome::Migrated { .. }) => shared.figures().migrations += 1,
            _ => shared.figures().migrations_refused += 1,
        }
    }
}

/// A committed event neither published nor in flight (PENDING or UNKNOWN),
/// preferring the newest (the likeliest not yet taken).
async fn unsettled_event(pool: &PgPool) -> Option<String> {
    sqlx::query_scalar(
        "SELECT id FROM (
             (SELECT event_id AS id, seq FROM outbox_stream ORDER BY seq DESC LIMIT 40)
             UNION ALL
             (SELECT event_id, seq FROM outbox_events WHERE state IN ('PENDING', 'DISPATCH_UNKNOWN') ORDER BY seq DESC LIMIT 40)) c
         WHERE outbox_event_state(id) IN ('PENDING', 'DISPATCH_UNKNOWN')
         ORDER BY seq DESC LIMIT 1",
    )
    .fetch_optional(pool)
    .await
    .ok()
    .flatten()
}

/// Retention every 700 ms with a 500 ms replay window.
async fn retain(shared: Arc<Shared>, pool: PgPool, mut stop: watch::Receiver<bool>) {
    let policy = RetentionPolicy {
        replay_window_ms: 500,
        batch_size: 200,
        max_batches: 5,
    };
    while !pause(&mut stop, 700).await {
        let Ok(now) = sqlx::query_scalar::<_, i64>(
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint",
        )
        .fetch_one(&pool)
        .await
        else {
            continue;
        };
        if let Ok(r) = outbox_producer::purge(&pool, now, &policy, false, |_| {}).await {
            let mut f = shared.figures();
            f.retained += r.retained;
            f.purged += r.purged;
        }
    }
}

/// While the emitters run and faults are on: windows in which the broker
/// answers after the message timeout (the messages are written, their
/// ACKs lost), and Produce requests that fail or cut the connection. When
/// the faults' time is up, every fault stops (`proxies` cut no more).
async fn inject_broker_faults(
    shared: &Shared,
    cluster: &TestCluster,
    emitters: &[JoinHandle<()>],
    proxies: &[&CommitCutter],
) {
    let mut rng = Rng(shared.cfg.seed ^ 0xB0C);
    let slow = Duration::from_millis(shared.cfg.message_timeout_ms + 1_000);
    // Faults run for the first three quarters of the emission time, so the
    // last events are emitted in calm (and settle within the bound).
    let faults_until = Instant::now() + shared.cfg.emit_for.mul_f64(0.75);
    while emitters.iter().any(|e| !e.is_finished()) {
        tokio::time::sleep(Duration::from_millis(600 + rng.below(600))).await;
        if !shared.cfg.faults || Instant::now() >= faults_until {
            shared.faults.store(false, Ordering::SeqCst);
            proxies.iter().for_each(|p| p.set_per_mille(0));
            continue;
        }
        let Some(mock) = cluster.mock.as_ref().filter(|_| shared.cfg.broker_faults) else {
            continue;
        };
        if rng.percent(50) {
            let _ = mock.broker_round_trip_time(1, slow);
            shared.figures().slow_broker_windows += 1;
            tokio::time::sleep(Duration::from_millis(300 + rng.below(400))).await;
            let _ = mock.broker_round_trip_time(1, Duration::ZERO);
        } else {
            let errors = [
                RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION,
                RDKafkaRespErr::RD_KAFKA_RESP_ERR__TRANSPORT,
                RDKafkaRespErr::RD_KAFKA_RESP_ERR_REQUEST_TIMED_OUT,
            ];
            let n = 1 + rng.below(3) as usize;
            let pushed: Vec<RDKafkaRespErr> = (0..n)
                .map(|_| errors[rng.below(errors.len() as u64) as usize])
                .collect();
            mock.request_errors(RDKafkaApiKey::Produce, &pushed);
            shared.figures().produce_errors += n as u64;
        }
    }
}

fn calm_broker(cluster: &TestCluster) {
    if let Some(mock) = &cluster.mock {
        let _ = mock.broker_round_trip_time(1, Duration::ZERO);
        mock.clear_request_errors(RDKafkaApiKey::Produce);
    }
}

// --------------------------------------------------------------- settle

/// The states of `ids` (`outbox_event_state`: NULL when not in the outbox).
async fn states_of(
    pool: &PgPool,
    ids: &[String],
) -> Result<BTreeMap<String, Option<String>>, sqlx::Error> {
    let rows: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT id, outbox_event_state(id) FROM unnest($1::text[]) AS id")
            .bind(ids)
            .fetch_all(pool)
            .await?;
    Ok(rows.into_iter().collect())
}

fn is_final(state: Option<&str>) -> bool {
    matches!(
        state,
        Some("PUBLISHED" | "RETAINED" | "PURGED" | "QUARANTINED" | "SKIPPED")
    )
}

/// Waits until every committed event is settled (published, retained,
/// purged, quarantined or skipped); false at the deadline.
async fn settle(pool: &PgPool, shared: &Shared) -> bool {
    let deadline = Instant::now() + shared.cfg.settle_for;
    let ids: Vec<String> = shared
        .ledger()
        .committed
        .iter()
        .map(|c| c.id.clone())
        .collect();
    loop {
        if let Ok(states) = states_of(pool, &ids).await {
            if states.values().all(|s| is_final(s.as_deref())) {
                return true;
            }
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

// --------------------------------------------------------------- checks

/// A receipt: the event, its generation, attempt and log position.
#[derive(Debug, Clone, sqlx::FromRow)]
struct Receipt {
    event_id: String,
    envelope_generation: i32,
    attempt_id: String,
    topic: String,
    partition: i32,
    offset: i64,
}

/// What the store holds about the run's events, read once the services stopped.
#[derive(Debug, Default)]
struct StoreFacts {
    states: BTreeMap<String, Option<String>>,
    /// Lane rows: event -> (envelope generation, topic, partition).
    lane: BTreeMap<String, (i32, String, i32)>,
    primary: BTreeMap<String, Vec<Receipt>>,
    duplicates: BTreeMap<String, Vec<Receipt>>,
    migrated: BTreeSet<String>,
    /// Events a bypass-scan finding names (unrecorded or divergent copies).
    reported_copies: BTreeSet<String>,
    /// Command key -> the event ids the store holds for it.
    events_of_command: BTreeMap<String, BTreeSet<String>>,
}

async fn store_facts(
    pool: &PgPool,
    ids: &[String],
    commands: &[String],
) -> Result<StoreFacts, sqlx::Error> {
    let mut f = StoreFacts {
        states: states_of(pool, ids).await?,
        ..Default::default()
    };
    let lane: Vec<(String, i32, String, i32)> =
        sqlx::query_as("SELECT event_id, envelope_generation, topic, partition FROM outbox_events WHERE event_id = ANY($1)").bind(ids).fetch_all(pool).await?;
    f.lane = lane
        .into_iter()
        .map(|(id, g, t, p)| (id, (g, t, p)))
        .collect();
    let receipts =
        "SELECT event_id, envelope_generation, attempt_id, topic, partition, \"offset\" FROM";
    for r in sqlx::query_as::<_, Receipt>(&format!(
        "{receipts} outbox_publish_receipts WHERE event_id = ANY($1)"
    ))
    .bind(ids)
    .fetch_all(pool)
    .await?
    {
        f.primary.entry(r.event_id.clone()).or_default().push(r);
    }
    for r in sqlx::query_as::<_, Receipt>(&format!(
        "{receipts} outbox_duplicate_receipts WHERE event_id = ANY($1)"
    ))
    .bind(ids)
    .fetch_all(pool)
    .await?
    {
        f.duplicates.entry(r.event_id.clone()).or_default().push(r);
    }
    f.migrated = sqlx::query_scalar(
        "SELECT DISTINCT event_id FROM outbox_migration_receipts WHERE event_id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(pool)
    .await?
    .into_iter()
    .collect();
    f.reported_copies = sqlx::query_scalar("SELECT DISTINCT event_id FROM outbox_findings WHERE kind IN ('unrecorded_copy', 'divergent_copy') AND event_id = ANY($1)")
        .bind(ids)
        .fetch_all(pool)
        .await?
        .into_iter()
        .collect();
    let by_command: Vec<(String, String)> = sqlx::query_as(
        "SELECT command_key, event_id FROM outbox_stream WHERE command_key = ANY($1)
         UNION SELECT command_key, event_id FROM outbox_events WHERE command_key = ANY($1)",
    )
    .bind(commands)
    .fetch_all(pool)
    .await?;
    for (c, e) in by_command {
        f.events_of_command.entry(c).or_default().insert(e);
    }
    Ok(f)
}

/// One record of a topic.
struct Copy<'a> {
    topic: &'a str,
    m: &'a LogMessage,
}

impl Copy<'_> {
    fn at(&self) -> String {
        format!("{}/p{}@{}", self.topic, self.m.partition, self.m.offset)
    }
}

async fn check(
    pool: &PgPool,
    shared: &Shared,
    figures: &mut Figures,
    violations: &mut Vec<String>,
) {
    let ledger = shared.ledger().clone();
    let mut committed: Vec<EmitRecord> = ledger.committed.clone();
    for id in &shared.cfg.extra_committed {
        committed.push(EmitRecord {
            id: id.clone(),
            command: format!("extra-{id}"),
            key: "extra".into(),
            payload_digest: String::new(),
            topic: shared.topic_a.clone(),
            partition: 0,
        });
    }
    let mut ids: Vec<String> = committed.iter().map(|c| c.id.clone()).collect();
    ids.extend(ledger.aborted.iter().cloned());
    ids.extend(
        ledger
            .unanswered_first_tries
            .iter()
            .map(|(_, id)| id.clone()),
    );
    let commands: Vec<String> = committed.iter().map(|c| c.command.clone()).collect();
    let facts = match store_facts(pool, &ids, &commands).await {
        Ok(f) => f,
        Err(e) => {
            violations.push(format!("setup: could not read the store: {e}"));
            return;
        }
    };
    let logs: Vec<(String, Vec<LogMessage>)> = [&shared.topic_a, &shared.topic_b]
        .iter()
        .map(|t| ((*t).clone(), read_topic(&shared.bootstrap, t, PARTITIONS)))
        .collect();
    let copies: Vec<Copy<'_>> = logs
        .iter()
        .flat_map(|(t, log)| log.iter().map(move |m| Copy { topic: t, m }))
        .collect();
    figures.log_records = copies.len() as u64;
    let mut by_event: BTreeMap<String, Vec<&Copy<'_>>> = BTreeMap::new();
    for c in &copies {
        by_event
            .entry(c.m.header(headers::EVENT_ID).unwrap_or_default())
            .or_default()
            .push(c);
    }
    let record_of: BTreeMap<&str, &EmitRecord> =
        committed.iter().map(|c| (c.id.as_str(), c)).collect();
    let aborted: BTreeSet<&str> = ledger.aborted.iter().map(String::as_str).collect();

    check_settled(&committed, &facts, &by_event, figures, violations);
    check_copies(&by_event, &record_of, &aborted, &facts, figures, violations);
    check_aborted(&ledger.aborted, &facts, violations);
    check_order(&ledger.by_key, &facts, &by_event, violations);
    check_commands(
        &committed,
        &ledger.unanswered_first_tries,
        &facts,
        violations,
    );
    figures.in_lane = facts.lane.len() as u64;
    figures.unknown_resolved =
        crate::count(pool, "SELECT count(*) FROM outbox_unknown_resolutions").await as u64;
}

/// `lost` and `stuck`: every committed event is in the outbox; published
/// ones have a receipt whose position holds their message; unsettled ones
/// are blocked by something the store shows.
fn check_settled(
    committed: &[EmitRecord],
    facts: &StoreFacts,
    by_event: &BTreeMap<String, Vec<&Copy<'_>>>,
    figures: &mut Figures,
    violations: &mut Vec<String>,
) {
    // Keys blocked by a quarantined event (its successors wait by design).
    let mut blocked: BTreeSet<&str> = BTreeSet::new();
    for c in committed {
        match facts.states.get(&c.id).and_then(|s| s.as_deref()) {
            None => violations.push(format!("lost: {} committed and not in the outbox", c.id)),
            Some("PUBLISHED" | "RETAINED" | "PURGED") => {
                figures.published += 1;
                check_receipt(c, facts, by_event, violations);
            }
            Some("QUARANTINED") => {
                figures.quarantined += 1;
                blocked.insert(&c.key);
            }
            // An operator's skip closed it (and it holds no key), as the
            // settle wait counts it.
            Some("SKIPPED") => {}
            Some(_) if blocked.contains(c.key.as_str()) => {}
            Some(other) => violations.push(format!(
                "stuck: {} (key {}) is {other} at the deadline and nothing blocks it",
                c.id, c.key
            )),
        }
    }
}

/// The receipt of `c`'s current generation holds a copy of it at its position.
fn check_receipt(
    c: &EmitRecord,
    facts: &StoreFacts,
    by_event: &BTreeMap<String, Vec<&Copy<'_>>>,
    violations: &mut Vec<String>,
) {
    let generation = facts.lane.get(&c.id).map_or(1, |l| l.0);
    let Some(r) = facts
        .primary
        .get(&c.id)
        .and_then(|rs| rs.iter().find(|r| r.envelope_generation == generation))
    else {
        violations.push(format!(
            "lost: {} is published without a receipt of generation {generation}",
            c.id
        ));
        return;
    };
    let held = by_event.get(&c.id).is_some_and(|cs| {
        cs.iter()
            .any(|x| x.topic == r.topic && x.m.partition == r.partition && x.m.offset == r.offset)
    });
    if !held {
        violations.push(format!(
            "lost: {}'s receipt {}/p{}@{} does not hold its message",
            c.id, r.topic, r.partition, r.offset
        ));
    }
}

/// `duplicate`, `cross_destination` and `second_logical_event` of each copy.
fn check_copies(
    by_event: &BTreeMap<String, Vec<&Copy<'_>>>,
    record_of: &BTreeMap<&str, &EmitRecord>,
    aborted: &BTreeSet<&str>,
    facts: &StoreFacts,
    figures: &mut Figures,
    violations: &mut Vec<String>,
) {
    for (id, copies) in by_event {
        if aborted.contains(id.as_str()) {
            violations.push(format!(
                "duplicate: {} holds {id} of an aborted transaction",
                copies[0].at()
            ));
            continue;
        }
        let Some(rec) = record_of.get(id.as_str()) else {
            violations.push(format!(
                "duplicate: {} holds {id:?}, an event no committed transaction emitted",
                copies[0].at()
            ));
            continue;
        };
        let receipts: Vec<&Receipt> = facts
            .primary
            .get(id)
            .into_iter()
            .chain(facts.duplicates.get(id))
            .flatten()
            .collect();
        for c in copies {
            check_destination(c, rec, facts, violations);
            check_payload(c, rec, violations);
            let recorded = receipts.iter().any(|r| {
                r.topic == c.topic && r.partition == c.m.partition && r.offset == c.m.offset
            });
            let attempt = c.m.header(headers::ATTEMPT_ID).unwrap_or_default();
            if recorded {
                continue;
            }
            if receipts.iter().any(|r| r.attempt_id == attempt) {
                // The client wrote one attempt twice (a transport retry).
                figures.transport_copies += 1;
                continue;
            }
            if facts.reported_copies.contains(id) {
                continue;
            }
            violations.push(format!(
                "duplicate: {} holds {id} attempt {attempt}, no receipt accounts for it",
                c.at()
            ));
        }
    }
}

/// The copy is where the envelope generation it carries was frozen for,
/// under the frozen routing key.
fn check_destination(
    c: &Copy<'_>,
    rec: &EmitRecord,
    facts: &StoreFacts,
    violations: &mut Vec<String>,
) {
    let generation: i32 =
        c.m.header(headers::ENVELOPE_GENERATION)
            .and_then(|g| g.parse().ok())
            .unwrap_or(0);
    let frozen = match (generation, facts.lane.get(&rec.id)) {
        (1, _) => Some((rec.topic.as_str(), rec.partition)),
        (g, Some((lane_gen, t, p))) if g == *lane_gen => Some((t.as_str(), *p)),
        _ => None,
    };
    match frozen {
        Some((t, p)) if t == c.topic && p == c.m.partition => {}
        Some((t, p)) => violations.push(format!("cross_destination: {} holds {} generation {generation}, frozen for {t}/p{p}", c.at(), rec.id)),
        None => violations.push(format!("cross_destination: {} holds {} of generation {generation}, which the store does not hold", c.at(), rec.id)),
    }
    if c.m.key != rec.key.as_bytes() {
        violations.push(format!(
            "cross_destination: {} holds {} under key {:?}, frozen key {:?}",
            c.at(),
            rec.id,
            String::from_utf8_lossy(&c.m.key),
            rec.key
        ));
    }
}

/// The copy's bytes are the payload the client emitted.
fn check_payload(c: &Copy<'_>, rec: &EmitRecord, violations: &mut Vec<String>) {
    let digest = sha256_digest(&c.m.payload);
    let header = c.m.header(headers::PAYLOAD_DIGEST).unwrap_or_default();
    if digest != rec.payload_digest || header != rec.payload_digest {
        violations.push(format!("second_logical_event: {} holds {} with payload digest {digest} (header {header}), emitted {}", c.at(), rec.id, rec.payload_digest));
    }
}

/// Nothing of an aborted transaction is in the store.
fn check_aborted(aborted: &[String], facts: &StoreFacts, violations: &mut Vec<String>) {
    for id in aborted {
        if let Some(Some(state)) = facts.states.get(id) {
            violations.push(format!(
                "duplicate: {id} of an aborted transaction is in the store ({state})"
            ));
        }
    }
}

/// Per key, the first copies of its events (migrated ones aside) in the
/// order the client committed them, within each topic and partition.
fn check_order(
    by_key: &BTreeMap<String, Vec<String>>,
    facts: &StoreFacts,
    by_event: &BTreeMap<String, Vec<&Copy<'_>>>,
    violations: &mut Vec<String>,
) {
    for (key, ids) in by_key {
        let mut last: BTreeMap<(&str, i32), (&str, i64)> = BTreeMap::new();
        for id in ids.iter().filter(|id| !facts.migrated.contains(*id)) {
            let Some(first) = by_event.get(id).and_then(|cs| {
                cs.iter()
                    .min_by_key(|c| (c.topic, c.m.partition, c.m.offset))
            }) else {
                continue;
            };
            let at = (first.topic, first.m.partition);
            if let Some((before, offset)) = last.get(&at) {
                if first.m.offset < *offset {
                    violations.push(format!("order_violation: key {key}: {id} at {} before {before} at offset {offset}, committed earlier", first.at()));
                }
            }
            last.insert(at, (id, first.m.offset));
        }
    }
}

/// One event per command: a command whose first try's commit answer was
/// lost and whose retry inserted another event must not have both.
fn check_commands(
    committed: &[EmitRecord],
    unanswered: &[(String, String)],
    facts: &StoreFacts,
    violations: &mut Vec<String>,
) {
    for c in committed {
        if let Some(events) = facts.events_of_command.get(&c.command) {
            if events.len() > 1 {
                violations.push(format!(
                    "second_logical_event: command {} has events {events:?} in the store",
                    c.command
                ));
            }
        }
    }
    for (command, first) in unanswered {
        let first_in_store = facts.states.get(first).is_some_and(Option::is_some);
        let answered_other = committed
            .iter()
            .any(|c| &c.command == command && &c.id != first);
        if first_in_store && answered_other {
            violations.push(format!("second_logical_event: command {command}'s first event {first} committed and its retry inserted another"));
        }
    }
}

// ---------------------------------------------------------- diagnostics

/// What the store holds for the routing keys of the `stuck:` violations:
/// each key's lane rows, its chain heads and its stream rows' batches.
async fn diagnose(pool: &PgPool, violations: &[String]) -> Vec<String> {
    let mut keys: Vec<String> = violations
        .iter()
        .filter(|v| v.starts_with("stuck: evt-"))
        .filter_map(|v| {
            v.split("(key ")
                .nth(1)
                .and_then(|r| r.split(')').next())
                .map(str::to_owned)
        })
        .collect();
    keys.sort();
    keys.dedup();
    let mut out = Vec::new();
    for key in keys.iter().take(3) {
        out.extend(
            diagnose_key(pool, key)
                .await
                .unwrap_or_else(|e| vec![format!("{key}: could not read: {e}")]),
        );
    }
    let mut events: Vec<String> = violations
        .iter()
        .filter(|v| !v.starts_with("stuck:"))
        .flat_map(|v| {
            v.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                .filter(|w| w.starts_with("evt-"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    events.dedup();
    for id in events.iter().take(6) {
        out.extend(
            diagnose_event(pool, id)
                .await
                .unwrap_or_else(|e| vec![format!("{id}: could not read: {e}")]),
        );
    }
    out
}

/// One event's rows: where it lives, its attempts, receipts, batches,
/// migrations, unknown resolutions and findings, times relative to its
/// creation.
// Diagnostic rows, each read once and printed as they come.
#[allow(clippy::type_complexity)]
async fn diagnose_event(pool: &PgPool, id: &str) -> Result<Vec<String>, sqlx::Error> {
    let created: Option<(i64, i64, String)> = sqlx::query_as("SELECT seq, created_at_ms, routing_key FROM outbox_stream WHERE event_id = $1 UNION ALL SELECT seq, created_at_ms, routing_key FROM outbox_events WHERE event_id = $1 LIMIT 1")
        .bind(id)
        .fetch_optional(pool)
        .await?;
    let Some((seq, t0, key)) = created else {
        return Ok(vec![format!("event {id}: not in the store")]);
    };
    let mut out = vec![format!(
        "event {id}: seq {seq} key {key} (times in ms after its creation)"
    )];
    let lane: Option<(String, i32, i64, Option<i64>)> =
        sqlx::query_as("SELECT state, envelope_generation, claim_generation, published_at_ms - $2 FROM outbox_events WHERE event_id = $1").bind(id).bind(t0).fetch_optional(pool).await?;
    out.push(format!("  lane row: {lane:?}"));
    let attempts: Vec<(String, String, String, i64, i64, Option<i64>, Option<String>)> = sqlx::query_as(
        "SELECT attempt_id, owner, state, claim_generation, started_at_ms - $2, finished_at_ms - $2, detail FROM outbox_attempts WHERE event_id = $1 ORDER BY started_at_ms",
    )
    .bind(id)
    .bind(t0)
    .fetch_all(pool)
    .await?;
    for a in &attempts {
        out.push(format!("  attempt {a:?}"));
    }
    let batches: Vec<(i64, String, i64, i64, Option<i32>)> = sqlx::query_as(
        "SELECT id, owner, lease_generation, registered_db_ms - $2, array_position(event_ids, $1) FROM outbox_batches WHERE $1 = ANY(event_ids) ORDER BY id",
    )
    .bind(id)
    .bind(t0)
    .fetch_all(pool)
    .await?;
    for b in &batches {
        let steps: Vec<(String, i32, i64)> = sqlx::query_as("SELECT kind, round, at_ms - $2 FROM outbox_batch_steps WHERE batch_id = $1 AND ($3 - 1) = ANY(positions) ORDER BY at_ms")
            .bind(b.0)
            .bind(t0)
            .bind(b.4.unwrap_or(0))
            .fetch_all(pool)
            .await?;
        out.push(format!(
            "  batch {} owner {} lease gen {} registered at {} position {:?}, its steps {steps:?}",
            b.0, b.1, b.2, b.3, b.4
        ));
    }
    let receipts: Vec<(String, i32, String, i32, i64, i64, Option<i64>)> = sqlx::query_as(
        "SELECT 'primary', envelope_generation, topic, partition, \"offset\", accepted_at_ms - $2, batch_id FROM outbox_publish_receipts WHERE event_id = $1
         UNION ALL SELECT 'duplicate', envelope_generation, topic, partition, \"offset\", received_at_ms - $2, NULL FROM outbox_duplicate_receipts WHERE event_id = $1",
    )
    .bind(id)
    .bind(t0)
    .fetch_all(pool)
    .await?;
    for r in &receipts {
        out.push(format!("  receipt {r:?}"));
    }
    let other: Vec<String> = sqlx::query_scalar(
        "SELECT 'migration ' || from_generation || '->' || to_generation || ' at ' || (at_ms - $2) || ' ' || (proof->>'kind') FROM outbox_migration_receipts WHERE event_id = $1
         UNION ALL SELECT 'unknown resolved ' || outcome || ' (unknown at ' || (unknown_since_ms - $2) || ', resolved at ' || (resolved_at_ms - $2) || ')' FROM outbox_unknown_resolutions WHERE event_id = $1
         UNION ALL SELECT 'finding ' || kind || ': ' || detail FROM outbox_findings WHERE event_id = $1
         UNION ALL SELECT 'audit ' || action || ' ' || detail::text FROM outbox_audit WHERE event_id = $1",
    )
    .bind(id)
    .bind(t0)
    .fetch_all(pool)
    .await?;
    out.extend(other.into_iter().map(|o| format!("  {o}")));
    Ok(out)
}

// Diagnostic rows, each read once and printed as they come.
#[allow(clippy::type_complexity)]
async fn diagnose_key(pool: &PgPool, key: &str) -> Result<Vec<String>, sqlx::Error> {
    let mut out = vec![format!("key {key}:")];
    let lane: Vec<(i64, String, String, i32, String, i64, Option<String>, i64)> = sqlx::query_as(
        "SELECT seq, event_id, state, envelope_generation, topic, claim_generation, claim_owner, key_chain
         FROM outbox_events WHERE routing_key = $1 AND state NOT IN ('PURGED', 'RETAINED') ORDER BY seq",
    )
    .bind(key)
    .fetch_all(pool)
    .await?;
    for r in &lane {
        out.push(format!(
            "  lane seq {} {} {} gen {} topic {} claim gen {} owner {:?} chain {}",
            r.0, r.1, r.2, r.3, r.4, r.5, r.6, r.7
        ));
    }
    let heads: Vec<(i64, String, i64, Option<i64>)> = sqlx::query_as(
        "SELECT h.key_chain, h.event_id, h.seq, h.claimable_at_ms FROM outbox_chain_heads h
         WHERE h.key_chain IN (SELECT key_chain FROM outbox_events WHERE routing_key = $1 UNION SELECT key_chain FROM outbox_stream WHERE routing_key = $1)",
    )
    .bind(key)
    .fetch_all(pool)
    .await?;
    for h in &heads {
        let state: Option<String> = sqlx::query_scalar("SELECT outbox_event_state($1)")
            .bind(&h.1)
            .fetch_one(pool)
            .await?;
        out.push(format!(
            "  chain head {} -> {} seq {} claimable at {:?} (its state {state:?})",
            h.0, h.1, h.2, h.3
        ));
    }
    let arrivals: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT a.key_chain, count(*) FROM outbox_chain_arrivals a
         WHERE a.key_chain IN (SELECT key_chain FROM outbox_events WHERE routing_key = $1) GROUP BY a.key_chain",
    )
    .bind(key)
    .fetch_all(pool)
    .await?;
    if heads.is_empty() {
        out.push(format!("  no chain head; arrivals waiting (chain, count): {arrivals:?}"));
    } else if !arrivals.is_empty() {
        out.push(format!("  arrivals waiting (chain, count): {arrivals:?}"));
    }
    let leases: Vec<(i16, Option<String>, i64, i64, Option<i64>, bool, i64)> = sqlx::query_as(
        "SELECT l.bucket, l.owner, l.generation, l.lease_until_ms - (extract(epoch FROM clock_timestamp()) * 1000)::bigint, l.open_batch, l.window_done, l.after_seq
         FROM outbox_bucket_leases l WHERE (l.cluster_id, l.bucket) IN (SELECT cluster_id, bucket FROM outbox_stream WHERE routing_key = $1)",
    )
    .bind(key)
    .fetch_all(pool)
    .await?;
    for l in &leases {
        out.push(format!("  bucket {} lease owner {:?} generation {} expires in {} ms, open batch {:?}, window done {}, after seq {}", l.0, l.1, l.2, l.3, l.4, l.5, l.6));
        if let Some(batch) = l.4 {
            let b: Option<(String, i64, Vec<String>)> = sqlx::query_as(
                "SELECT owner, lease_generation, event_ids FROM outbox_batches WHERE id = $1",
            )
            .bind(batch)
            .fetch_optional(pool)
            .await?;
            let steps: Vec<(String, i32, Vec<i32>)> = sqlx::query_as("SELECT kind, round, positions FROM outbox_batch_steps WHERE batch_id = $1 ORDER BY round, kind").bind(batch).fetch_all(pool).await?;
            out.push(format!("    open batch {batch}: {b:?}, steps {steps:?}"));
        }
    }
    let stream: Vec<(i64, String, String, i64, Option<String>)> = sqlx::query_as(
        "SELECT s.seq, s.event_id, s.topic, s.key_chain, outbox_event_state(s.event_id) FROM outbox_stream s
         WHERE s.routing_key = $1 AND NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = s.event_id) ORDER BY s.seq",
    )
    .bind(key)
    .fetch_all(pool)
    .await?;
    for r in stream
        .iter()
        .filter(|r| r.4.as_deref() != Some("PUBLISHED"))
        .take(10)
    {
        out.push(format!(
            "  stream seq {} {} topic {} chain {} state {:?}",
            r.0, r.1, r.2, r.3, r.4
        ));
    }
    Ok(out)
}
