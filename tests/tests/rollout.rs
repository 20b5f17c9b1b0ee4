//! Rollout and rollback (PROTOCOL §11) on real PostgreSQL and librdkafka's
//! in-process Kafka cluster: shadow mode against a simulated legacy
//! publisher, a 5% takeover, an alias switch mid-run, and an old-protocol
//! dispatcher meeting new-protocol rows.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering as AtomicOrdering;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::{headers, takeover_bucket, Broker, EmitRequest, EventId, Publisher};
use outbox_producer::rollout::{self, compare_shadow, set_takeover, switch_alias, ShadowDispatcher};
use outbox_producer::{Dispatcher, DispatcherConfig, EmitOptions, Emitted, PgStore, Reconciler, ReconcilerConfig};
use outbox_tests::kafka::{read_topic, TestCluster};
use outbox_tests::*;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use sqlx::PgPool;

const TOPIC: &str = "orders";
const PARTITIONS: i32 = 3;
const PAYMENT_CAPTURED: &str = "payment.captured.v1";

fn config(name: &str) -> DispatcherConfig {
    DispatcherConfig { name: name.into(), workers: 2, batch_size: 100, poll_interval_ms: 50, sweep_interval_ms: 100, shutdown_grace_ms: 20_000, ..Default::default() }
}

/// A fresh cluster with the topic and the route(s) to it.
async fn started(pool: &PgPool, message_timeout_ms: u64) -> (TestCluster, Arc<outbox_producer::kafka::KafkaBroker>) {
    outbox_tests::kafka::started(pool, TOPIC, PARTITIONS, message_timeout_ms, &[ORDER_CREATED, PAYMENT_CAPTURED]).await
}

async fn emit_typed(pool: &PgPool, event_type: &str, id: &str) -> Emitted {
    let payload = order_payload(id, 1);
    let key = format!("{event_type}-{id}");
    let mut tx = pool.begin().await.unwrap();
    let req = EmitRequest { event_type, ..order_request(&key, id, &payload) };
    let e = outbox_producer::emit(&mut tx, &req, &EmitOptions::default()).await.unwrap();
    tx.commit().await.unwrap();
    e
}

/// Emits `n` order events in batches of 50 per transaction.
async fn emit_orders(pool: &PgPool, prefix: &str, n: usize) -> Vec<Emitted> {
    let mut out = Vec::with_capacity(n);
    for chunk in (0..n).collect::<Vec<_>>().chunks(50) {
        let mut tx = pool.begin().await.unwrap();
        for i in chunk {
            let id = format!("{prefix}-{i}");
            let payload = order_payload(&id, *i as i64);
            let key = format!("create-{id}");
            out.push(outbox_producer::emit(&mut tx, &order_request(&key, &id, &payload), &EmitOptions::default()).await.unwrap());
        }
        tx.commit().await.unwrap();
    }
    out
}

/// Drains the outbox with one dispatcher, batch by batch.
async fn drain<B: Broker + 'static>(d: &Dispatcher<B>) -> usize {
    let mut published = 0;
    loop {
        let r = d.dispatch_once("w1").await.unwrap();
        published += r.published;
        if r.claimed == 0 {
            return published;
        }
    }
}

/// The publisher being replaced, simulated: it reads the rows the outbox
/// left to it and produces them itself (carrying the eventId header), except
/// that it drops every 1000th event and alters the payload of `alter`.
async fn legacy_publish(pool: &PgPool, bootstrap: &str, alter: &HashSet<String>) -> usize {
    let producer: FutureProducer = ClientConfig::new().set("bootstrap.servers", bootstrap).set("message.timeout.ms", "10000").create().unwrap();
    let rows: Vec<(String, String, i32, String, Vec<u8>)> =
        sqlx::query_as("SELECT event_id, topic, partition, routing_key, payload FROM outbox_events WHERE publisher = 'legacy' ORDER BY seq")
            .fetch_all(pool)
            .await
            .unwrap();
    let mut sent = 0;
    for (i, (id, topic, partition, key, payload)) in rows.iter().enumerate() {
        if (i + 1) % 1000 == 0 {
            continue; // dropped
        }
        let payload = if alter.contains(id) { b"{\"altered\":true}".to_vec() } else { payload.clone() };
        let h = OwnedHeaders::new().insert(Header { key: headers::EVENT_ID, value: Some(id.as_bytes()) });
        producer
            .send(FutureRecord::to(topic).partition(*partition).key(key.as_bytes()).payload(&payload).headers(h), Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .unwrap();
        sent += 1;
    }
    sent
}

async fn shadow_all(pool: &PgPool) -> usize {
    let shadow = ShadowDispatcher::new(PgStore::new(pool.clone()));
    let mut n = 0;
    loop {
        let k = shadow.shadow_once(500).await.unwrap();
        if k == 0 {
            return n;
        }
        n += k;
    }
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn shadow_run_finds_exactly_the_dropped_and_the_altered_events(pool: PgPool) {
    let (cluster, broker) = started(&pool, 5_000).await;
    // Shadow: the outbox owns nothing.
    let policy = set_takeover(&pool, &[], 0).await.unwrap();
    assert_eq!(policy.generation, 1);
    let emitted = emit_orders(&pool, "o", 2_000).await;
    assert!(emitted.iter().all(|e| e.publisher == Publisher::Legacy));

    // The real dispatcher claims none of them.
    let d = Dispatcher::new(PgStore::new(pool.clone()), broker.clone(), config("d")).unwrap();
    assert_eq!(d.dispatch_once("w1").await.unwrap().claimed, 0);

    let altered = emitted[500].event_id().to_string();
    let sent = legacy_publish(&pool, &cluster.bootstrap, &HashSet::from([altered.clone()])).await;
    assert_eq!(sent, 1_998);
    let dropped: HashSet<String> = [999usize, 1_999].iter().map(|i| emitted[*i].event_id().to_string()).collect();

    assert_eq!(shadow_all(&pool).await, 2_000);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_attempts").await, 0, "shadow mode registers no attempt");
    let store = PgStore::new(pool.clone());
    let report = compare_shadow(&store, &*broker, 0, 10_000).await.unwrap();
    assert_eq!(report.scanned_messages, 1_998);
    assert_eq!((report.missing, report.different_bytes, report.extra, report.different_partition), (2, 1, 0, 0), "{report:?}");
    assert_eq!(report.matched, 1_997);
    let open = rollout::open_shadow_mismatches(&pool).await.unwrap();
    let by_kind: HashMap<String, HashSet<String>> = open.iter().fold(HashMap::new(), |mut m, (id, kind, _)| {
        m.entry(kind.clone()).or_default().insert(id.clone());
        m
    });
    assert_eq!(by_kind.len(), 2, "{open:?}");
    assert_eq!(by_kind["missing"], dropped);
    assert_eq!(by_kind["different_bytes"], HashSet::from([altered]));

    // A second round finds nothing new; the reconciler sees no bypass and no aged PENDING.
    let again = compare_shadow(&store, &*broker, 0, 10_000).await.unwrap();
    assert_eq!((again.scanned_messages, again.mismatches()), (0, 0), "{again:?}");
    let rec = Reconciler::new(store, broker, ReconcilerConfig { aged_pending_ms: 0, ..ReconcilerConfig::default() }).unwrap();
    let c = rec.compare_once().await.unwrap();
    assert_eq!((c.aged_pending, c.bypass_publish), (0, 0), "{c:?}");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events WHERE state <> 'PENDING'").await, 0, "shadow changed an event");
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn shadow_reports_wrong_partitions_second_messages_and_strangers(pool: PgPool) {
    let (cluster, broker) = started(&pool, 5_000).await;
    set_takeover(&pool, &[], 0).await.unwrap();
    let emitted = emit_orders(&pool, "o", 4).await;
    let producer: FutureProducer = ClientConfig::new().set("bootstrap.servers", &cluster.bootstrap).create().unwrap();
    let send = |e: &Emitted, partition: i32, id: &str| {
        let h = OwnedHeaders::new().insert(Header { key: headers::EVENT_ID, value: Some(id.as_bytes()) });
        let payload = order_payload(&e.envelope.aggregate_id, e.envelope.aggregate_id[2..].parse().unwrap());
        let key = e.destination.routing_key.clone();
        let producer = producer.clone();
        async move {
            producer.send(FutureRecord::to(TOPIC).partition(partition).key(key.as_bytes()).payload(&payload).headers(h), Duration::from_secs(10)).await.map_err(|(e, _)| e).unwrap();
        }
    };
    let p = |e: &Emitted| e.destination.partition;
    send(&emitted[0], p(&emitted[0]), emitted[0].event_id().as_str()).await; // right
    send(&emitted[1], (p(&emitted[1]) + 1) % PARTITIONS, emitted[1].event_id().as_str()).await; // wrong partition
    send(&emitted[2], p(&emitted[2]), emitted[2].event_id().as_str()).await; // right, then again
    send(&emitted[2], p(&emitted[2]), emitted[2].event_id().as_str()).await;
    send(&emitted[3], p(&emitted[3]), emitted[3].event_id().as_str()).await;
    let stranger = EventId::generate(1).to_string();
    send(&emitted[3], p(&emitted[3]), &stranger).await; // an eventId the outbox never committed

    let store = PgStore::new(pool.clone());
    // Before the shadow dispatcher ran: no false extra, the scan waits.
    let early = compare_shadow(&store, &*broker, 0, 10_000).await.unwrap();
    assert_eq!((early.extra, early.missing), (0, 0), "{early:?}");
    assert_eq!(shadow_all(&pool).await, 4);
    let r = compare_shadow(&store, &*broker, 0, 10_000).await.unwrap();
    let total = early.mismatches() + r.mismatches();
    assert_eq!((r.different_partition, r.extra, r.missing, r.different_bytes), (1, 2, 0, 0), "{early:?} {r:?}");
    assert_eq!(total, 3);
    let open = rollout::open_shadow_mismatches(&pool).await.unwrap();
    let kinds: HashSet<(String, String)> = open.into_iter().map(|(id, k, _)| (id, k)).collect();
    assert_eq!(
        kinds,
        HashSet::from([
            (emitted[1].event_id().to_string(), "different_partition".to_owned()),
            (emitted[2].event_id().to_string(), "extra".to_owned()),
            (stranger, "extra".to_owned()),
        ])
    );
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn five_percent_takeover_sends_only_selected_events_each_once(pool: PgPool) {
    let (cluster, broker) = started(&pool, 5_000).await;
    set_takeover(&pool, &[ORDER_CREATED], 500).await.unwrap();
    let orders = emit_orders(&pool, "o", 2_000).await;
    let mut payments = Vec::new();
    for i in 0..100 {
        payments.push(emit_typed(&pool, PAYMENT_CAPTURED, &format!("p-{i}")).await);
    }
    let owned: HashSet<String> = orders.iter().filter(|e| takeover_bucket(e.event_id()) < 500).map(|e| e.event_id().to_string()).collect();
    assert!((60..=140).contains(&owned.len()), "5% of 2000 selected {}", owned.len());
    for e in &orders {
        assert_eq!(e.publisher == Publisher::Outbox, owned.contains(e.event_id().as_str()));
    }
    assert!(payments.iter().all(|e| e.publisher == Publisher::Legacy), "an unselected type stays with the legacy publisher");

    let d = Dispatcher::new(PgStore::new(pool.clone()), broker.clone(), config("d")).unwrap();
    assert_eq!(drain(&d).await, owned.len());
    let log = read_topic(&cluster.bootstrap, TOPIC, PARTITIONS);
    let in_log: Vec<String> = log.iter().filter_map(|m| m.header(headers::EVENT_ID)).collect();
    assert_eq!(in_log.len(), owned.len(), "each selected event exactly once");
    assert_eq!(in_log.iter().cloned().collect::<HashSet<_>>(), owned);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_publish_receipts").await, owned.len() as i64);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_duplicate_receipts").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_attempts a JOIN outbox_events e USING (event_id) WHERE e.publisher = 'legacy'").await, 0);

    // A new selection generation: every type, 100%. Events that exist keep their publisher.
    let before: Vec<(String, String)> = sqlx::query_as("SELECT event_id, publisher FROM outbox_events ORDER BY seq").fetch_all(&pool).await.unwrap();
    let g2 = set_takeover(&pool, &[ORDER_CREATED, PAYMENT_CAPTURED], 10_000).await.unwrap();
    assert_eq!(g2.generation, 2);
    let late_orders = emit_orders(&pool, "late", 20).await;
    let late_payment = emit_typed(&pool, PAYMENT_CAPTURED, "p-late").await;
    assert!(late_orders.iter().chain([&late_payment]).all(|e| e.publisher == Publisher::Outbox));
    assert_eq!(drain(&d).await, 21);
    let after: Vec<(String, String)> =
        sqlx::query_as("SELECT event_id, publisher FROM outbox_events ORDER BY seq LIMIT $1").bind(before.len() as i64).fetch_all(&pool).await.unwrap();
    assert_eq!(after, before, "a new generation moved an existing event");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_attempts").await, owned.len() as i64 + 21, "one attempt per owned event");
    assert_eq!(read_topic(&cluster.bootstrap, TOPIC, PARTITIONS).len(), owned.len() + 21);
    let gens: Vec<Option<i32>> = sqlx::query_scalar("SELECT DISTINCT takeover_generation FROM outbox_events ORDER BY 1").fetch_all(&pool).await.unwrap();
    assert_eq!(gens, vec![Some(1), Some(2)]);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn alias_switch_mid_run_loses_nothing_and_sends_nothing_twice(pool: PgPool) {
    let (cluster, probe) = started(&pool, 5_000).await;
    const ALIAS: &str = "orders-dispatch";
    switch_alias(&pool, ALIAS, "outbox-rs/old", 1).await.unwrap();

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut dispatchers = Vec::new();
    let mut runs = Vec::new();
    for (name, implementation) in [("old", "outbox-rs/old"), ("new", "outbox-rs/new")] {
        let cfg = DispatcherConfig { alias: Some(ALIAS.into()), implementation: implementation.into(), ..config(name) };
        let d = Arc::new(Dispatcher::new(PgStore::new(pool.clone()), cluster.broker(10_000).await, cfg).unwrap());
        dispatchers.push(d.clone());
        runs.push(tokio::spawn(d.run(outbox_producer::until_true(stop_rx.clone()))));
    }
    let (old, new) = (dispatchers[0].metrics(), dispatchers[1].metrics());

    // Events keep coming while the alias is switched.
    let emitter = {
        let pool = pool.clone();
        tokio::spawn(async move {
            let mut n = 0;
            for round in 0..24 {
                n += emit_orders(&pool, &format!("r{round}"), 50).await.len();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            n
        })
    };
    wait_count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'", 300, Duration::from_secs(60)).await;
    assert_eq!(new.claimed.load(AtomicOrdering::Relaxed), 0, "the new implementation claimed before the switch");
    switch_alias(&pool, ALIAS, "outbox-rs/new", 1).await.unwrap();
    // The old implementation notices within its poll interval and settles what it has in flight.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let old_claimed_after_switch = old.claimed.load(AtomicOrdering::Relaxed);
    assert_eq!(old.alias_active.load(AtomicOrdering::Relaxed), 0);
    let total = emitter.await.unwrap() as i64;
    assert_eq!(total, 1_200);
    wait_count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'", total, Duration::from_secs(120)).await;
    stop_tx.send(true).unwrap();
    for r in runs {
        r.await.unwrap().unwrap();
    }

    assert_eq!(old.claimed.load(AtomicOrdering::Relaxed), old_claimed_after_switch, "the old implementation kept claiming after the switch");
    assert!(old_claimed_after_switch > 0 && new.claimed.load(AtomicOrdering::Relaxed) > 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_publish_receipts").await, total, "one primary receipt per event");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_duplicate_receipts").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_attempts").await, total, "nothing sent twice");
    let log = read_topic(&cluster.bootstrap, TOPIC, PARTITIONS);
    let ids: HashSet<String> = log.iter().filter_map(|m| m.header(headers::EVENT_ID)).collect();
    assert_eq!((log.len() as i64, ids.len() as i64), (total, total));
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_dispatcher_alias_history").await, 2);

    // What either implementation published keeps being reconciled after the switch.
    let rec = Reconciler::new(PgStore::new(pool.clone()), probe, ReconcilerConfig::default()).unwrap();
    let c = rec.compare_once().await.unwrap();
    assert_eq!((c.scanned_messages as i64, c.total()), (total, 0), "{c:?}");
}

/// Newer-protocol heads, however many and however old, never hide the
/// older-protocol events a dispatcher can send (its claim looks at a bounded
/// number of candidates: the refused ones are not among them).
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn many_newer_protocol_heads_do_not_starve_the_old_dispatcher(pool: PgPool) {
    let (_cluster, broker) = started(&pool, 5_000).await;
    for i in 0..5 {
        let e = create_order(&pool, &format!("new-{i}"), 1).await;
        sqlx::query("UPDATE outbox_events SET protocol_version = 2 WHERE event_id = $1").bind(e.event_id().as_str()).execute(&pool).await.unwrap();
    }
    let old_row = create_order(&pool, "old-0", 2).await;
    let d = Dispatcher::new(PgStore::new(pool.clone()), broker, DispatcherConfig { batch_size: 1, ..config("old") }).unwrap();
    let r = d.dispatch_once("w1").await.unwrap();
    assert_eq!((r.claimed, r.published), (1, 1), "{r:?}");
    let published: Vec<String> = sqlx::query_scalar("SELECT event_id FROM outbox_publish_receipts").fetch_all(&pool).await.unwrap();
    assert_eq!(published, vec![old_row.event_id().to_string()]);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn old_protocol_dispatcher_refuses_new_protocol_rows(pool: PgPool) {
    let (cluster, broker) = started(&pool, 5_000).await;
    // o-1 v1 is written by a newer protocol; o-1 v2 queues behind it on the same key.
    let newer = create_order(&pool, "o-1", 1).await;
    let payload = order_payload("o-1", 2);
    let mut tx = pool.begin().await.unwrap();
    let behind = outbox_producer::emit(&mut tx, &EmitRequest { aggregate_version: 2, ..order_request("update-o-1", "o-1", &payload) }, &EmitOptions::default()).await.unwrap();
    tx.commit().await.unwrap();
    let other = create_order(&pool, "o-2", 3).await;
    sqlx::query("UPDATE outbox_events SET protocol_version = 2 WHERE event_id = $1").bind(newer.event_id().as_str()).execute(&pool).await.unwrap();

    let old_store = PgStore::new(pool.clone());
    assert_eq!(old_store.max_protocol_version(), 1);
    let old = Arc::new(Dispatcher::new(old_store.clone(), broker.clone(), config("old")).unwrap());
    let r = old.dispatch_once("w1").await.unwrap();
    assert_eq!((r.claimed, r.published), (1, 1), "{r:?}");
    let published: Vec<String> = sqlx::query_scalar("SELECT event_id FROM outbox_publish_receipts").fetch_all(&pool).await.unwrap();
    assert_eq!(published, vec![other.event_id().to_string()], "only the old-protocol row without a newer head before it");
    assert_eq!(old.dispatch_once("w1").await.unwrap().claimed, 0);
    assert_eq!(old_store.rows_beyond_protocol().await.unwrap(), 1);
    let state: Vec<(String, i64)> = sqlx::query_as("SELECT state, claim_generation FROM outbox_events WHERE event_id = ANY($1) ORDER BY seq")
        .bind(vec![newer.event_id().to_string(), behind.event_id().to_string()])
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(state, vec![("PENDING".to_owned(), 0), ("PENDING".to_owned(), 0)], "refused rows are left alone");

    // Running, the old dispatcher warns and exposes the count.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let run = tokio::spawn(old.clone().run(outbox_producer::until_true(stop_rx)));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while old.metrics().refused_protocol_rows.load(AtomicOrdering::Relaxed) != 1 {
        assert!(tokio::time::Instant::now() < deadline, "refused_protocol_rows never reported");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_tx.send(true).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_attempts").await, 1);

    // A dispatcher that understands protocol 2 takes both, in key order.
    let new = Dispatcher::new(PgStore::new(pool.clone()).understanding_protocol(2), broker, config("new")).unwrap();
    assert_eq!(drain(&new).await, 2);
    let log = read_topic(&cluster.bootstrap, TOPIC, PARTITIONS);
    let key_order: Vec<String> = {
        let mut m: Vec<_> = log.iter().filter(|m| m.key == newer.destination.routing_key.as_bytes()).collect();
        m.sort_by_key(|m| m.offset);
        m.iter().filter_map(|m| m.header(headers::EVENT_ID)).collect()
    };
    assert_eq!(key_order, vec![newer.event_id().to_string(), behind.event_id().to_string()]);
}
