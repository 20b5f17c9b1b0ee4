//! One trace: the world set up from the seed, the services started, then
//! the timeline of the fault phase (emits and retried commands, kills,
//! truncations, compactions, log resets, the route's move), the faults
//! stopped, the services run until every event is settled, and the checks.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::{EmitRequest, EventId, EventState, RoutePolicy};
use outbox_memory::{EmitTx, MemoryStore};
use tokio::time::Instant;

use super::broker::{compact, SimBroker};
use super::checks::{check, check_aborted, check_acks};
use super::config::{ServiceTraceConfig, StoreMode};
use super::consumers;
use super::figures::{ServiceFigures, ServiceOutcome};
use super::processes::{kill_one, new_route, start_dispatcher, start_operator, start_reconciler, DispatcherProcess, Processes};
use super::retention::start_retention;
use super::watermark_topic;
use super::store::SimStore;
use super::world::{world, Host, Shared, World};
use super::{CLUSTER, FAULT_PHASE_MS, LEASE_MS, NEW_TOPIC, PARTITIONS, T0_MS, TOPIC};
use crate::rng::Rng;

// For the doc link of `run_services_trace` only.
#[cfg(doc)]
use super::mutations::SERVICE_MUTATIONS;

/// Longest fault-free phase before a trace counts as stuck.
const SETTLE_LIMIT_MS: i64 = 3_600_000;

/// Runs the services trace `seed` names over the claims path; `mutation`
/// switches one defect of [`SERVICE_MUTATIONS`] on in the shipped code.
pub fn run_services_trace(seed: u64, mutation: Option<&'static str>, log: bool) -> ServiceOutcome {
    run_services_trace_in(StoreMode::Claims, seed, mutation, log)
}

/// Runs the services trace `seed` names over the store path `mode`.
pub fn run_services_trace_in(mode: StoreMode, seed: u64, mutation: Option<&'static str>, log: bool) -> ServiceOutcome {
    let cfg = ServiceTraceConfig::from_seed(seed);
    outbox_core::simulation::set_mutation(mutation);
    outbox_core::simulation::seed_ids(Some(seed));
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().expect("a current-thread runtime");
    let out = rt.block_on(trace(cfg, mode, log));
    outbox_core::simulation::set_mutation(None);
    outbox_core::simulation::seed_ids(None);
    out
}

async fn trace(cfg: ServiceTraceConfig, mode: StoreMode, log: bool) -> ServiceOutcome {
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
    world(&shared).note(|| format!("trace {} ({} path): {cfg:?}", cfg.seed, mode.as_str()));
    let inner = match mode {
        StoreMode::Claims => MemoryStore::new(),
        StoreMode::Stream => MemoryStore::new().with_stream(),
    };
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
    // Half the traces with retention carry the group's watermarks over the
    // watermark topic (publisher, forger, reader); the others read the
    // group's store directly. Drawn on its own.
    let over_topic = cfg.faults.retention && Rng::new(cfg.seed ^ 0x003a_7e4d).chance(0.5);
    let copy = over_topic.then(watermark_topic::SharedTopic::default);
    let topic_tasks = copy.as_ref().map(|t| watermark_topic::start(&shared, cfg.seed, consumers.store(), t.clone())).unwrap_or_default();
    if over_topic {
        world(&shared).note(|| "the group's watermarks reach retention over the watermark topic".into());
    }
    let retention = cfg.faults.retention.then(|| start_retention(&shared, &inner, consumers.store(), copy));
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
    // Emitting transactions: most commit at once; some stay open a while,
    // a few past a lease, and some abort, so that transactions commit in
    // another order than they took their positions. Their own generator too.
    let mut tx_rng = Rng::new(cfg.seed ^ 0x0be7_7a5c_7105);
    let mut open: Vec<OpenEmit> = Vec::new();
    let mut aborted: Vec<EventId> = Vec::new();
    loop {
        let emit_due = emit_at.get(i).copied().unwrap_or(i64::MAX);
        let end = if i >= emit_at.len() { FAULT_PHASE_MS.max(clock) } else { i64::MAX };
        let tx_due = open.iter().map(|o| o.due).min().unwrap_or(i64::MAX);
        let until = emit_due.min(next_kill).min(migrate_at).min(end).min(consumers.next_due()).min(tx_due);
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
        if tx_due == until {
            if let Some(at) = open.iter().position(|o| o.due == until) {
                end_emit(&shared, &inner, open.swap_remove(at), &mut emitted, &mut committed, &mut aborted);
            }
            continue;
        }
        if emit_due != until {
            break;
        }
        let key = format!("o-{}", rng.below(cfg.keys as u64));
        // Emitters of one aggregate serialize (PostgreSQL: its advisory
        // lock): one still open on this key ends first.
        if let Some(at) = open.iter().position(|o| o.key == key) {
            end_emit(&shared, &inner, open.swap_remove(at), &mut emitted, &mut committed, &mut aborted);
        }
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
        let tx = inner.begin_emit();
        match frozen.and_then(|(env, dest)| inner.insert_in(&tx, &command, env, dest, payload.clone())) {
            Ok(id) => {
                let (due, abort) = match tx_rng.below(100) {
                    0..=3 => (clock + tx_rng.range(0, 2_000), true),
                    4..=23 => (clock + tx_rng.range(1, 2_000), false),
                    24..=26 => (clock + tx_rng.range(LEASE_MS, 3 * LEASE_MS), false),
                    _ => (clock, false),
                };
                let emit = OpenEmit { due, tx, abort, id, key, command: command.clone(), payload: payload.clone(), version: i as i64 + 1, topic: route.topic.clone() };
                if due == clock {
                    end_emit(&shared, &inner, emit, &mut emitted, &mut committed, &mut aborted);
                } else {
                    let mut w = world(&shared);
                    w.figures.transactions_held_open += 1;
                    w.note(|| format!("insert {} key {} in transaction {}, open until {due}", emit.id, emit.key, emit.tx.xid()));
                    open.push(emit);
                }
            }
            Err(e) => {
                inner.abort(tx);
                world(&shared).note(|| format!("emit refused: {e}"));
            }
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
    for p in procs.dispatchers.drain(..).map(|d| d.task).chain([procs.reconciler]).chain(procs.operator).chain(retention).chain(topic_tasks) {
        p.abort();
    }
    let late_acks: u64 = procs.all_dispatchers.iter().map(|m| m.late_acks.load(std::sync::atomic::Ordering::Relaxed)).sum();
    tokio::task::yield_now().await;

    let mut w = world(&shared);
    let reported: BTreeSet<String> = w.findings.iter().filter(|(k, _)| k == "log_unavailable").map(|(_, e)| e.clone()).collect();
    report_blocked(&inner, &mut w, &reported);
    let mut violations = std::mem::take(&mut w.violations);
    if !settled {
        w.figures.stuck += 1;
        violations.push(format!("stuck: not settled within {SETTLE_LIMIT_MS} ms of the faults stopping"));
    }
    check(&inner, &mut w, &emitted, &mut violations);
    check_aborted(&inner, &mut w, &aborted, &mut violations);
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

/// An emitting transaction that has inserted its event and not ended.
struct OpenEmit {
    /// When it ends.
    due: i64,
    tx: EmitTx,
    /// Whether it ends by aborting.
    abort: bool,
    id: EventId,
    key: String,
    command: String,
    payload: Vec<u8>,
    version: i64,
    topic: String,
}

/// Ends an emitting transaction as drawn: a commit wakes the dispatchers
/// and makes the event one the checks expect published; an abort leaves
/// an event that nothing may ever show.
fn end_emit(shared: &Shared, store: &MemoryStore, o: OpenEmit, emitted: &mut Vec<(EventId, String)>, committed: &mut Vec<(String, String, Vec<u8>, i64, EventId)>, aborted: &mut Vec<EventId>) {
    let mut w = world(shared);
    if o.abort {
        store.abort(o.tx);
        w.figures.transactions_aborted += 1;
        w.note(|| format!("abort {} key {}", o.id, o.key));
        aborted.push(o.id);
        return;
    }
    store.commit(o.tx);
    w.commits += 1;
    w.committed.notify_waiters();
    w.note(|| format!("commit {} key {} to {}", o.id, o.key, o.topic));
    committed.push((o.command, o.key.clone(), o.payload, o.version, o.id.clone()));
    emitted.push((o.id, o.key));
}

/// The share of traces whose route has no per-key order.
const UNORDERED_TRACES: f64 = 0.15;
/// The share of traces with a forger (see `SimBroker::forge`).
const FORGED_TRACES: f64 = 0.1;
/// The share of traces whose topic is compacted now and then.
const COMPACTED_TRACES: f64 = 0.3;

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
    blocked_keys(store, reported).is_some()
}

/// Why a key is blocked: its head waits for an operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockedBy {
    /// The head is QUARANTINED (its copy in the log is not its payload).
    Quarantined,
    /// The head's outcome is unknown and its log cannot answer (a
    /// `log_unavailable` finding): it can neither be proven nor migrated.
    Unprovable,
}

/// A key held by a blocked head, and the events waiting behind it.
#[derive(Debug, Clone)]
struct BlockedKey {
    key: (String, String),
    head: String,
    by: BlockedBy,
    behind: u64,
}

/// When every event is settled or waits behind a blocked head, the blocked
/// keys (with what blocks each and how many events wait); `None` while
/// anything else is still open.
fn blocked_keys(store: &MemoryStore, reported: &BTreeSet<String>) -> Option<Vec<BlockedKey>> {
    let st = store.lock();
    let mut blocked: Vec<BlockedKey> = Vec::new();
    let mut by_seq: Vec<_> = st.events.values().collect();
    by_seq.sort_by_key(|e| e.seq);
    for ev in by_seq {
        let key = (ev.destination.topic.clone(), ev.destination.routing_key.clone());
        let head = |by| BlockedKey { key: key.clone(), head: ev.envelope.event_id.to_string(), by, behind: 0 };
        match ev.state {
            // An operator's skip closed it: it holds no key.
            s if s.is_closed() => {}
            EventState::Pending if blocked.iter().any(|b| b.key == key) => {
                if let Some(b) = blocked.iter_mut().find(|b| b.key == key) {
                    b.behind += 1;
                }
            }
            EventState::Quarantined => push_head(&mut blocked, head(BlockedBy::Quarantined)),
            EventState::DispatchUnknown | EventState::Reconciling if reported.contains(ev.envelope.event_id.as_str()) => push_head(&mut blocked, head(BlockedBy::Unprovable)),
            _ => return None,
        }
    }
    Some(blocked)
}

/// Records a blocked head, unless its key is blocked already (a second
/// blocked event of a key waits behind the first).
fn push_head(blocked: &mut Vec<BlockedKey>, head: BlockedKey) {
    if blocked.iter().all(|b| b.key != head.key) {
        blocked.push(head);
    }
}

/// Counts and names the events that wait behind blocked heads at the end
/// of a trace: settled for the gate (the protocol blocks such a key until
/// an operator acts), but not delivered, and reported with their cause.
fn report_blocked(store: &MemoryStore, w: &mut World, reported: &BTreeSet<String>) {
    for b in blocked_keys(store, reported).unwrap_or_default() {
        match b.by {
            BlockedBy::Quarantined => w.figures.blocked_behind_quarantined += b.behind,
            BlockedBy::Unprovable => w.figures.blocked_behind_unprovable += b.behind,
        }
        w.note(|| format!("blocked: key {}/{}: {} events wait behind {} ({:?}) for an operator (outbox skip)", b.key.0, b.key.1, b.behind, b.head, b.by));
    }
}
