//! What the dispatcher's integration tests (`tests/tests/dispatch_*.rs`)
//! share: the topic they route to, a dispatcher configuration, a started
//! cluster, backlogs of events, and checks of what reached the log.

use std::collections::BTreeMap;
use std::sync::Arc;

use outbox_core::{headers, EventState};
use outbox_producer::{Dispatcher, DispatcherConfig, EmitOptions, PgStore};
use sqlx::PgPool;

use crate::kafka::{read_topic, TestCluster};
use crate::{order_payload, order_request, ORDER_CREATED};

/// The topic the tests route [`ORDER_CREATED`] to.
pub const TOPIC: &str = "orders";
/// Its partitions.
pub const PARTITIONS: i32 = 3;

/// A dispatcher configuration named `name`: two workers, batches of 100, a
/// 30 s lease, quick polls and sweeps, LISTEN on.
pub fn config(name: &str) -> DispatcherConfig {
    DispatcherConfig { name: name.into(), workers: 2, batch_size: 100, lease_ms: 30_000, poll_interval_ms: 50, sweep_interval_ms: 100, shutdown_grace_ms: 20_000, listen: true, ..Default::default() }
}

/// A fresh cluster with the topic and the route(s) to it.
pub async fn started(pool: &PgPool, message_timeout_ms: u64) -> (TestCluster, Arc<outbox_producer::kafka::KafkaBroker>) {
    crate::kafka::started(pool, TOPIC, PARTITIONS, message_timeout_ms, &[ORDER_CREATED]).await
}

/// The state of event `id`.
pub async fn state_of(pool: &PgPool, id: &str) -> EventState {
    let s: String = sqlx::query_scalar("SELECT state FROM outbox_events WHERE event_id = $1").bind(id).fetch_one(pool).await.unwrap();
    EventState::parse(&s).unwrap()
}

/// Emits `per_key` events for each of `orders` orders (one routing key
/// each), and returns their ids in commit order.
pub async fn emit_many(pool: &PgPool, orders: usize, per_key: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for o in 0..orders {
        let mut tx = pool.begin().await.unwrap();
        for v in 0..per_key {
            let id = format!("o-{o}");
            let payload = order_payload(&id, v as i64);
            let key = format!("c-{o}-{v}");
            let req = outbox_core::EmitRequest { aggregate_version: v as i64, ..order_request(&key, &id, &payload) };
            ids.push(outbox_producer::emit(&mut tx, &req, &EmitOptions::default()).await.unwrap().event_id().to_string());
            if per_key > 1 {
                // Separate commits per event of a key, so commit order is the event order.
                tx.commit().await.unwrap();
                tx = pool.begin().await.unwrap();
            }
        }
        tx.commit().await.unwrap();
    }
    ids
}

/// Runs two dispatcher instances (`inst0`, `inst1`, both built before
/// either runs, so neither gets a head start) until `total` receipts fill
/// their publish slots, then stops them.
pub async fn run_two_dispatchers(pool: &PgPool, cluster: &TestCluster, total: i64, cfg: DispatcherConfig) {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut dispatchers = Vec::new();
    for n in 0..2 {
        let broker = cluster.broker(10_000).await;
        dispatchers.push(Arc::new(Dispatcher::new(PgStore::new(pool.clone()), broker, DispatcherConfig { name: format!("inst{n}"), ..cfg.clone() }).unwrap()));
    }
    let runs: Vec<_> = dispatchers.into_iter().map(|d| tokio::spawn(d.run(outbox_producer::until_true(stop_rx.clone())))).collect();
    crate::wait_count(pool, "SELECT count(*) FROM outbox_publish_receipts", total, std::time::Duration::from_secs(120)).await;
    stop_tx.send(true).unwrap();
    for r in runs {
        r.await.unwrap().unwrap();
    }
}

/// Asserts that each routing key's events are in the log in the order
/// they were committed (and nothing else is there); the number of keys.
/// Events of either path: the chains path's rows and the stream's (whose
/// `seq` comes from the same sequence).
pub async fn keys_in_commit_order(pool: &PgPool, cluster: &TestCluster) -> usize {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "SELECT routing_key, event_id FROM (
             SELECT seq, routing_key, event_id FROM outbox_events
             UNION ALL
             SELECT seq, routing_key, event_id FROM outbox_stream s WHERE NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = s.event_id)) t
         ORDER BY seq",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let mut committed: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (k, id) in rows {
        committed.entry(k).or_default().push(id);
    }
    let mut log = read_topic(&cluster.bootstrap, TOPIC, PARTITIONS);
    log.sort_by_key(|m| (m.partition, m.offset));
    let mut logged: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for m in &log {
        logged.entry(String::from_utf8(m.key.clone()).unwrap()).or_default().push(m.header(headers::EVENT_ID).unwrap());
    }
    assert_eq!(logged, committed, "a key's events reached the log out of commit order");
    committed.len()
}

/// Asserts that the log holds exactly `ids`, each once.
pub fn each_once_in_log(cluster: &TestCluster, ids: &[String]) {
    let mut in_log: Vec<String> = read_topic(&cluster.bootstrap, TOPIC, PARTITIONS).iter().filter_map(|m| m.header(headers::EVENT_ID)).collect();
    in_log.sort();
    let mut want = ids.to_vec();
    want.sort();
    assert_eq!(in_log, want, "the log must hold every event exactly once");
}
