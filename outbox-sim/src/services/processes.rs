//! The shipped services as processes, each on a host of its own (its clock,
//! its pauses): dispatchers, the reconciler and the operator's destination
//! migration; and the killer that kills one of them and starts it again.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{EventId, EventState, RetryPolicy, RoutePolicy};
use outbox_producer::migration::{migrate_destination_in, MigrationOutcome};
use outbox_producer::{Dispatcher, DispatcherConfig, Reconciler, ReconcilerConfig};

use super::broker::SimBroker;
use super::config::ServiceTraceConfig;
use super::store::SimStore;
use super::world::{world, Host, Shared};
use super::{CLUSTER, LEASE_MS, MESSAGE_TIMEOUT_MS, NEW_TOPIC, PARTITIONS, TOPIC};
use crate::rng::Rng;

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

pub(super) type Process = tokio::task::JoinHandle<()>;

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
pub(super) struct DispatcherProcess {
    pub(super) task: Process,
    /// Its host.
    pub(super) host: usize,
    /// Its counters (late ACKs among them).
    pub(super) metrics: Arc<outbox_producer::DispatchMetrics>,
}

pub(super) fn start_dispatcher(store: &SimStore, broker: &Arc<SimBroker>, cfg: &ServiceTraceConfig, name: String) -> DispatcherProcess {
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

pub(super) fn start_reconciler(store: &SimStore, broker: &Arc<SimBroker>, owner: String) -> Process {
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
pub(super) fn new_route() -> RoutePolicy {
    RoutePolicy::new("order.created", CLUSTER, NEW_TOPIC, PARTITIONS)
}

/// The operator: moves every undelivered event of `TOPIC` to the new route
/// with the shipped `migrate_destination_in`, one event after another, and
/// asks again for the refused ones every few seconds until none is left.
/// A QUARANTINED event is asked for once (a re-send under a new envelope
/// generation, refused unless nothing of it can be in the old topic).
pub(super) fn start_operator(store: &SimStore, broker: &Arc<SimBroker>, name: String) -> Process {
    let store = store.clone();
    let broker = broker.clone();
    tokio::spawn(async move {
        let (route, retry) = (new_route(), retry_policy());
        let mut asked_quarantined = std::collections::BTreeSet::new();
        loop {
            let (todo, left): (Vec<EventId>, bool) = {
                let st = store.inner.lock();
                let old: Vec<_> = st.events.values().filter(|e| e.destination.topic == TOPIC && !e.state.is_published() && e.state != EventState::Quarantined).collect();
                let quarantined = st.events.values().filter(|e| e.destination.topic == TOPIC && e.state == EventState::Quarantined).map(|e| e.envelope.event_id.clone());
                let quarantined: Vec<EventId> = quarantined.filter(|id| asked_quarantined.insert(id.clone())).collect();
                let todo = old.iter().filter(|e| matches!(e.state, EventState::Pending | EventState::DispatchUnknown)).map(|e| e.envelope.event_id.clone());
                let left = !old.is_empty() || !quarantined.is_empty();
                (todo.chain(quarantined).collect(), left)
            };
            if !left {
                world(&store.world).note(|| format!("operator {name}: nothing left to migrate"));
                return;
            }
            for id in todo {
                let out = migrate_destination_in(&store, broker.as_ref(), &id, &route, &name, &retry, false, LEASE_MS).await;
                let quarantined = asked_quarantined.contains(&id);
                let mut w = world(&store.world);
                match out {
                    Ok(MigrationOutcome::Refused { reason }) => {
                        w.figures.migrations_refused += 1;
                        w.figures.resends_refused += u64::from(quarantined);
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

/// The processes of one trace the killer may kill.
pub(super) struct Processes {
    pub(super) dispatchers: Vec<DispatcherProcess>,
    /// Every dispatcher that ran, killed ones included.
    pub(super) all_dispatchers: Vec<Arc<outbox_producer::DispatchMetrics>>,
    pub(super) reconciler: Process,
    pub(super) operator: Option<Process>,
    pub(super) incarnation: usize,
}

pub(super) fn kill_one(shared: &Shared, rng: &mut Rng, store: &SimStore, op_store: &SimStore, broker: &Arc<SimBroker>, cfg: &ServiceTraceConfig, procs: &mut Processes) {
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
