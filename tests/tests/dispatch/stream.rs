//! The stream path (`outbox_producer::DispatchPath::Stream`) under the
//! shipped dispatcher, on real PostgreSQL and librdkafka's in-process
//! cluster: every event reaches the log once, each key's events in their
//! commit order, and the happy path leaves nothing in the exception lane.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::headers;
use outbox_producer::{Dispatcher, DispatcherConfig, DispatchPath, PgStore};
use outbox_tests::dispatch::{config, each_once_in_log, emit_many, started, PARTITIONS, TOPIC};
use outbox_tests::kafka::{read_topic, TestCluster};
use outbox_tests::{count, wait_count};
use sqlx::PgPool;

/// Runs two dispatcher instances until `total` receipts fill their slots.
async fn run_two(pool: &PgPool, cluster: &TestCluster, total: i64, cfg: DispatcherConfig) {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut dispatchers = Vec::new();
    for n in 0..2 {
        let broker = cluster.broker(10_000).await;
        dispatchers.push(Arc::new(Dispatcher::new(PgStore::new(pool.clone()), broker, DispatcherConfig { name: format!("inst{n}"), ..cfg.clone() }).unwrap()));
    }
    let runs: Vec<_> = dispatchers.into_iter().map(|d| tokio::spawn(d.run(outbox_producer::until_true(stop_rx.clone())))).collect();
    wait_count(pool, "SELECT count(*) FROM outbox_publish_receipts", total, Duration::from_secs(120)).await;
    stop_tx.send(true).unwrap();
    for r in runs {
        r.await.unwrap().unwrap();
    }
}

/// Each routing key's events in the log in stream (commit) order; the number of keys.
async fn keys_in_stream_order(pool: &PgPool, cluster: &TestCluster) -> usize {
    let rows: Vec<(String, String)> = sqlx::query_as("SELECT routing_key, event_id FROM outbox_stream ORDER BY seq").fetch_all(pool).await.unwrap();
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

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn two_dispatchers_on_the_stream_publish_each_event_once_in_each_keys_commit_order(pool: PgPool) {
    outbox_producer::set_dispatch_path(&pool, DispatchPath::Stream).await.unwrap();
    let (cluster, _probe) = started(&pool, 5_000).await;
    let ids = emit_many(&pool, 20, 25).await;
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_stream").await, 500, "emit wrote stream rows");
    let cfg = DispatcherConfig { workers: 3, batch_size: 7, ..config("d") };
    run_two(&pool, &cluster, ids.len() as i64, cfg).await;

    assert_eq!(keys_in_stream_order(&pool, &cluster).await, 20);
    each_once_in_log(&cluster, &ids);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_duplicate_receipts").await, 0);
    // The happy path is inserts only: nothing went to the lane, and every
    // receipt names the batch that registered its attempt.
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 0, "an event left the happy path");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_publish_receipts WHERE batch_id IS NULL").await, 0);
    for id in &ids {
        let state: String = sqlx::query_scalar("SELECT outbox_event_state($1)").bind(id).fetch_one(&pool).await.unwrap();
        assert_eq!(state, "PUBLISHED", "{id}");
    }
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn many_keys_in_one_transaction_drain_on_the_stream(pool: PgPool) {
    outbox_producer::set_dispatch_path(&pool, DispatchPath::Stream).await.unwrap();
    let (cluster, _probe) = started(&pool, 5_000).await;
    let ids = emit_many(&pool, 1_500, 1).await;
    run_two(&pool, &cluster, ids.len() as i64, config("d")).await;
    each_once_in_log(&cluster, &ids);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 0, "an event left the happy path");
}
