//! The dispatcher on real PostgreSQL and librdkafka's in-process Kafka
//! cluster, each test injecting the real fault.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::{headers, Broker, EventState, LookupOutcome, ManualClock, OutboxStore, RetryPolicy, StoreError};
use outbox_producer::{Dispatcher, DispatcherConfig, EmitOptions, PgStore, Reconciler, ReconcilerConfig};
use outbox_tests::kafka::{read_topic, NoLookup, TestCluster};
use outbox_tests::*;
use sqlx::PgPool;

const TOPIC: &str = "orders";
const PARTITIONS: i32 = 3;

fn config(name: &str) -> DispatcherConfig {
    DispatcherConfig { name: name.into(), workers: 2, batch_size: 100, lease_ms: 30_000, poll_interval_ms: 50, sweep_interval_ms: 100, shutdown_grace_ms: 20_000, listen: true, ..Default::default() }
}

async fn setup(pool: &PgPool, cluster_id: &str) {
    business_schema(pool).await;
    route(pool, ORDER_CREATED, cluster_id, TOPIC, PARTITIONS as u32).await;
}

/// A fresh cluster with the topic and the route(s) to it.
async fn started(pool: &PgPool, message_timeout_ms: u64) -> (TestCluster, Arc<outbox_producer::kafka::KafkaBroker>) {
    outbox_tests::kafka::started(pool, TOPIC, PARTITIONS, message_timeout_ms, &[ORDER_CREATED]).await
}

async fn state_of(pool: &PgPool, id: &str) -> EventState {
    let s: String = sqlx::query_scalar("SELECT state FROM outbox_events WHERE event_id = $1").bind(id).fetch_one(pool).await.unwrap();
    EventState::parse(&s).unwrap()
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn ack_publishes_with_a_receipt_matching_the_log(pool: PgPool) {
    let (cluster, broker) = started(&pool, 5_000).await;
    let e = create_order(&pool, "o-1", 10).await;
    let d = Dispatcher::new(PgStore::new(pool.clone()), broker.clone(), config("d")).unwrap();
    let r = d.dispatch_once("w1").await.unwrap();
    assert_eq!((r.claimed, r.sent, r.published), (1, 1, 1));
    assert_eq!(state_of(&pool, e.event_id().as_str()).await, EventState::Published);
    let (topic, partition, offset): (String, i32, i64) =
        sqlx::query_as("SELECT topic, partition, \"offset\" FROM outbox_publish_receipts").fetch_one(&pool).await.unwrap();
    let log = read_topic(&cluster.bootstrap, TOPIC, PARTITIONS);
    assert_eq!(log.len(), 1);
    let m = &log[0];
    assert_eq!((topic.as_str(), m.partition, m.offset), (TOPIC, partition, offset));
    assert_eq!(m.partition, e.destination.partition);
    assert_eq!(m.key, e.destination.routing_key.as_bytes());
    assert_eq!(m.header(headers::EVENT_ID).as_deref(), Some(e.event_id().as_str()));
    let claims = headers::verify(&m.headers, &m.payload, TOPIC, m.partition, Some(&m.key)).unwrap();
    assert_eq!(claims.destination_digest, e.destination_digest);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn traceparent_recorded_at_emit_travels_as_a_header(pool: PgPool) {
    let (cluster, broker) = started(&pool, 5_000).await;
    let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let payload = order_payload("o-1", 1);
    let mut tx = pool.begin().await.unwrap();
    outbox_producer::emit(&mut tx, &order_request("c-1", "o-1", &payload), &EmitOptions { traceparent: Some(tp.into()), ..Default::default() }).await.unwrap();
    tx.commit().await.unwrap();
    let d = Dispatcher::new(PgStore::new(pool.clone()), broker, config("d")).unwrap();
    d.dispatch_once("w1").await.unwrap();
    let log = read_topic(&cluster.bootstrap, TOPIC, PARTITIONS);
    assert_eq!(log[0].header(headers::TRACEPARENT).as_deref(), Some(tp));
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn round_trip_longer_than_message_timeout_is_unknown_never_published(pool: PgPool) {
    let (cluster, broker) = started(&pool, 1_500).await;
    let d = Dispatcher::new(PgStore::new(pool.clone()), broker.clone(), config("d")).unwrap();
    // Warm the connection and metadata, so the next Produce request really goes out.
    create_order(&pool, "o-0", 1).await;
    assert_eq!(d.dispatch_once("w1").await.unwrap().published, 1);
    let e = create_order(&pool, "o-1", 10).await;
    let id = e.event_id().as_str();

    // The broker writes the message but its answer arrives after message.timeout.ms.
    let mock = cluster.mock.as_ref().expect("this fault needs the mock cluster");
    mock.broker_round_trip_time(1, Duration::from_millis(4_000)).unwrap();
    let r = d.dispatch_once("w1").await.unwrap();
    assert_eq!((r.sent, r.unknown, r.published), (1, 1, 0), "{r:?}");
    assert_eq!(state_of(&pool, id).await, EventState::DispatchUnknown);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_publish_receipts").await, 1);
    let attempt_state: String = sqlx::query_scalar("SELECT state FROM outbox_attempts WHERE event_id = $1").bind(id).fetch_one(&pool).await.unwrap();
    assert_eq!(attempt_state, "UNKNOWN");

    // The message is in the log although its ACK never came.
    mock.broker_round_trip_time(1, Duration::ZERO).unwrap();
    match broker.lookup(&e.destination, e.event_id(), &outbox_core::ScanFrom::at(0)).await {
        LookupOutcome::Found(rs) => assert_eq!(rs.len(), 1),
        other => panic!("written-but-unACKed message not found: {other:?}"),
    }
    // Only the receipt transaction may publish it: the reconciler's scan finds it.
    let rec = Reconciler::new(PgStore::new(pool.clone()), broker, ReconcilerConfig::default()).unwrap();
    let rr = rec.resolve_unknown_once().await.unwrap();
    assert_eq!(rr.published, 1, "{rr:?}");
    assert_eq!(state_of(&pool, id).await, EventState::Published);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_publish_receipts").await, 2);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn broker_down_is_not_persisted_and_the_event_is_eligible_again(pool: PgPool) {
    let (cluster, broker) = started(&pool, 1_000).await;
    let e = create_order(&pool, "o-1", 10).await;
    let id = e.event_id().as_str();
    let mock = cluster.mock.as_ref().expect("this fault needs the mock cluster");

    mock.broker_down(1).unwrap();
    let d = Dispatcher::new(PgStore::new(pool.clone()), broker.clone(), config("d")).unwrap();
    let r = d.dispatch_once("w1").await.unwrap();
    assert_eq!((r.sent, r.not_sent, r.unknown, r.published), (1, 1, 0, 0), "{r:?}");
    assert_eq!(state_of(&pool, id).await, EventState::Pending);
    let first: (String, String) = sqlx::query_as("SELECT state, destination_digest FROM outbox_attempts").fetch_one(&pool).await.unwrap();
    assert_eq!(first, ("NOT_SENT".to_owned(), e.destination_digest.clone()));

    // Once the broker is back (the client may need a reconnect or two) and
    // the event's backoff has passed, it goes out to the same destination
    // and is published once.
    mock.broker_up(1).unwrap();
    let mut published = 0;
    for _ in 0..60 {
        published += d.dispatch_once("w1").await.unwrap().published;
        if published > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(published, 1);
    let attempts: Vec<(i32, String, String)> =
        sqlx::query_as("SELECT attempt_generation, state, destination_digest FROM outbox_attempts ORDER BY 1").fetch_all(&pool).await.unwrap();
    assert!(attempts.len() >= 2);
    let (last, earlier) = attempts.split_last().unwrap();
    assert_eq!(last.1, "ACKED");
    assert!(earlier.iter().all(|a| a.1 == "NOT_SENT"), "{attempts:?}");
    assert!(attempts.iter().all(|a| a.2 == e.destination_digest), "every attempt to the frozen destination");
    let log = read_topic(&cluster.bootstrap, TOPIC, PARTITIONS);
    assert_eq!(log.len(), 1, "the refused send must not be in the log");
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn stalled_worker_late_ack_becomes_a_duplicate_transport_receipt(pool: PgPool) {
    let (cluster, broker) = started(&pool, 5_000).await;
    let e = create_order(&pool, "o-1", 10).await;
    let id = e.event_id().as_str();
    let clock = ManualClock::new(sqlx::query_scalar::<_, i64>("SELECT (extract(epoch FROM now()) * 1000)::bigint").fetch_one(&pool).await.unwrap());
    let store = PgStore::with_clock(pool.clone(), Arc::new(clock.clone()));
    let cfg = DispatcherConfig { lease_ms: 1_000, ..config("d") };

    // Worker 1 sends, then stalls: its batch is never settled while its lease runs out.
    let d1 = Dispatcher::new(store.clone(), broker.clone(), cfg.clone()).unwrap();
    let stalled = d1.claim_and_send("w1").await.unwrap();
    assert_eq!(stalled.len(), 1);
    let first_attempt = stalled.attempts().next().unwrap().attempt_id.clone();
    // Its message reaches the log and librdkafka receives the ACK; nobody settles it.
    for _ in 0..100 {
        if !read_topic(&cluster.bootstrap, TOPIC, PARTITIONS).is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    clock.advance(1_500);
    let swept = store.expire_leases().await.unwrap();
    assert_eq!(swept.unknown, 1);
    assert_eq!(state_of(&pool, id).await, EventState::DispatchUnknown);

    // The broker adapter cannot answer lookups: the reconciler may only retry the same destination.
    clock.advance(10_000);
    let rec_cfg = ReconcilerConfig { retry: RetryPolicy { in_flight_bound_ms: 5_000, ..RetryPolicy::default() }, ..ReconcilerConfig::default() };
    let rec = Reconciler::new(store.clone(), Arc::new(NoLookup(broker.clone())), rec_cfg).unwrap();
    assert_eq!(rec.resolve_unknown_once().await.unwrap().retried, 1);
    assert_eq!(state_of(&pool, id).await, EventState::RetryClaimed);

    // Worker 2 takes over and publishes.
    let d2 = Dispatcher::new(store.clone(), broker.clone(), cfg).unwrap();
    let r2 = d2.dispatch_once("w2").await.unwrap();
    assert_eq!(r2.published, 1, "{r2:?}");

    // Worker 1 wakes up: its genuine late ACK still goes through acceptDispatchReceipt.
    let r1 = d1.settle(stalled).await.unwrap();
    assert_eq!((r1.published, r1.duplicates), (0, 1), "{r1:?}");

    assert_eq!(state_of(&pool, id).await, EventState::Published);
    let primary: (String, i32) = sqlx::query_as("SELECT r.attempt_id, a.attempt_generation FROM outbox_publish_receipts r JOIN outbox_attempts a USING (attempt_id)")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(primary.1, 2);
    let dups: Vec<String> = sqlx::query_scalar("SELECT attempt_id FROM outbox_duplicate_receipts").fetch_all(&pool).await.unwrap();
    assert_eq!(dups, vec![first_attempt.to_string()]);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_attempts WHERE state = 'ACKED'").await, 2);
    assert_eq!(count(&pool, "SELECT count(DISTINCT destination_digest) FROM outbox_attempts").await, 1);
    assert_eq!(read_topic(&cluster.bootstrap, TOPIC, PARTITIONS).len(), 2);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn stale_worker_changes_no_row_and_is_audited(pool: PgPool) {
    business_schema(&pool).await;
    route(&pool, ORDER_CREATED, "cluster-a", TOPIC, 3).await;
    let e = create_order(&pool, "o-1", 10).await;
    let id = e.event_id().as_str();
    let clock = ManualClock::new(1_000_000);
    let store = PgStore::with_clock(pool.clone(), Arc::new(clock.clone()));

    let old = store.claim_batch("w1", 10, 1_000).await.unwrap().remove(0);
    clock.advance(2_000);
    assert_eq!(store.expire_leases().await.unwrap().released, 1);
    let new = store.claim_batch("w2", 10, 1_000).await.unwrap().remove(0);
    assert_eq!(new.token.claim_generation, old.token.claim_generation + 2);
    let row = || async { sqlx::query_scalar::<_, String>("SELECT row_to_json(e)::text FROM outbox_events e WHERE event_id = $1").bind(id).fetch_one(&pool).await.unwrap() };
    let before = row().await;

    let err = store.register_attempt(&old.token).await.unwrap_err();
    assert!(err.is_fenced(), "{err}");
    assert!(matches!(err, StoreError::Core(outbox_core::CoreError::Fenced { .. })));
    assert_eq!(store.release(&old.token).await.unwrap(), outbox_core::FenceOutcome::Fenced);
    assert_eq!(store.quarantine_claimed(&old.token, "x", serde_json::json!({})).await.unwrap(), outbox_core::FenceOutcome::Fenced);
    assert_eq!(store.renew_lease(&old.token, 1_000).await.unwrap(), None);
    assert_eq!(row().await, before, "a stale holder changed the row");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_attempts").await, 0);
    let audits = count(&pool, "SELECT count(*) FROM outbox_audit WHERE actor = 'w1' AND action = 'stale_write'").await;
    assert_eq!(audits, 3);
    // The new holder is unaffected.
    assert!(store.register_attempt(&new.token).await.is_ok());
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn tampered_envelope_is_quarantined_and_never_sent(pool: PgPool) {
    let (cluster, broker) = started(&pool, 5_000).await;
    let e = create_order(&pool, "o-1", 10).await;
    let ok = create_order(&pool, "o-2", 20).await;
    sqlx::query("UPDATE outbox_events SET payload = convert_to('{\"order\":\"o-1\",\"totalCents\":1}', 'UTF8') WHERE event_id = $1")
        .bind(e.event_id().as_str())
        .execute(&pool)
        .await
        .unwrap();
    let d = Dispatcher::new(PgStore::new(pool.clone()), broker, config("d")).unwrap();
    let r = d.dispatch_once("w1").await.unwrap();
    assert_eq!((r.quarantined, r.sent, r.published), (1, 1, 1), "{r:?}");
    assert_eq!(state_of(&pool, e.event_id().as_str()).await, EventState::Quarantined);
    assert_eq!(state_of(&pool, ok.event_id().as_str()).await, EventState::Published);
    let reason: String = sqlx::query_scalar("SELECT reason FROM outbox_quarantine WHERE event_id = $1").bind(e.event_id().as_str()).fetch_one(&pool).await.unwrap();
    assert_eq!(reason, "stored_payload_or_destination_diverged");
    let log = read_topic(&cluster.bootstrap, TOPIC, PARTITIONS);
    assert!(log.iter().all(|m| m.header(headers::EVENT_ID).as_deref() != Some(e.event_id().as_str())));
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_attempts WHERE event_id = (SELECT event_id FROM outbox_quarantine)").await, 0);
}

/// Registering an attempt (CLAIMED -> SENDING) is a heap-only update: no
/// index of outbox_events reads a column it writes, so PostgreSQL keeps the
/// new row version on its page and writes no index entry.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn registering_an_attempt_writes_no_index_entry(pool: PgPool) {
    let indexed: Vec<String> = sqlx::query_scalar(
        r"SELECT DISTINCT a.attname::text FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum > 0
          WHERE i.indrelid = 'outbox_events'::regclass
            AND (a.attnum = ANY (i.indkey::int2[])
                 OR coalesce(pg_get_expr(i.indpred, i.indrelid), '') ~ ('\m' || a.attname || '\M')
                 OR coalesce(pg_get_expr(i.indexprs, i.indrelid), '') ~ ('\m' || a.attname || '\M'))",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(indexed.contains(&"phase".to_owned()) && indexed.contains(&"event_id".to_owned()), "{indexed:?}");
    for written in ["state", "claim_attempt_id", "attempt_generation", "state_since_ms"] {
        assert!(!indexed.iter().any(|c| c == written), "an index reads {written}, which registration writes: {indexed:?}");
    }

    // The same, observed: four events claimed (new versions, indexed) and
    // registered (heap-only), counted once the store's connections exit.
    setup(&pool, "cluster-a").await;
    for i in 0..4 {
        create_order(&pool, &format!("o-{i}"), 10).await;
    }
    let own = single_connection(&pool).await;
    let store = PgStore::new(own.clone());
    let claimed = store.claim_batch("w1", 10, 30_000).await.unwrap();
    assert_eq!(claimed.len(), 4);
    let tokens: Vec<_> = claimed.iter().map(|c| c.token.clone()).collect();
    assert!(store.register_attempts(&tokens).await.unwrap().iter().all(|r| r.is_ok()));
    own.close().await;
    let stats = table_stats_once(&pool, "outbox_events", |t| t.n_tup_upd >= 8).await;
    assert_eq!((stats.n_tup_upd, stats.n_tup_hot_upd), (8, 4), "4 claims with index entries, 4 registrations without");
}

/// Ordering chains are (cluster, topic, routing key), hashed into
/// `key_chain`: the same triple is one chain, and triples whose parts only
/// concatenate alike are not.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn key_chain_tells_cluster_topic_and_key_apart(pool: PgPool) {
    business_schema(&pool).await;
    route(&pool, "t.one.v1", "a", "bc", 1).await;
    route(&pool, "t.two.v1", "ab", "c", 1).await;
    route(&pool, "t.three.v1", "a", "bc", 1).await;
    let payload = order_payload("k", 1);
    let mut tx = pool.begin().await.unwrap();
    for (n, event_type) in ["t.one.v1", "t.two.v1", "t.three.v1"].into_iter().enumerate() {
        let key = format!("cmd-{n}");
        let request = outbox_core::EmitRequest { event_type, aggregate_version: n as i64 + 1, ..order_request(&key, "k", &payload) };
        outbox_producer::emit(&mut tx, &request, &EmitOptions::default()).await.unwrap();
    }
    tx.commit().await.unwrap();
    let chains: Vec<(String, i64)> = sqlx::query_as("SELECT event_type, key_chain FROM outbox_events ORDER BY seq").fetch_all(&pool).await.unwrap();
    assert_eq!(chains.len(), 3);
    assert_ne!(chains[0].1, chains[1].1, "a/bc/k and ab/c/k are different keys: {chains:?}");
    assert_eq!(chains[0].1, chains[2].1, "the same cluster, topic and key is one chain: {chains:?}");
}

async fn emit_many(pool: &PgPool, orders: usize, per_key: usize) -> Vec<String> {
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

async fn run_two_dispatchers(pool: &PgPool, cluster: &TestCluster, total: i64, cfg: DispatcherConfig) {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // Both instances are built (brokers connected) before either runs, so
    // neither gets a head start on the backlog.
    let mut dispatchers = Vec::new();
    for n in 0..2 {
        let broker = cluster.broker(10_000).await;
        dispatchers.push(Arc::new(Dispatcher::new(PgStore::new(pool.clone()), broker, DispatcherConfig { name: format!("inst{n}"), ..cfg.clone() }).unwrap()));
    }
    let runs: Vec<_> = dispatchers.into_iter().map(|d| tokio::spawn(d.run(outbox_producer::until_true(stop_rx.clone())))).collect();
    wait_count(pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'", total, Duration::from_secs(120)).await;
    stop_tx.send(true).unwrap();
    for r in runs {
        r.await.unwrap().unwrap();
    }
}

/// A backlog on fewer keys than the batch size: every claim is short (one
/// head per key), yet the workers keep claiming without waiting for the
/// poll interval; only an empty claim waits.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn short_claims_of_a_backlog_do_not_wait_for_the_poll_interval(pool: PgPool) {
    let (_cluster, broker) = started(&pool, 10_000).await;
    emit_many(&pool, 4, 15).await;
    // 60 events on 4 keys: each claim finds at most 4 heads; nothing wakes
    // the workers but their own loop (no LISTEN, a 60 s poll).
    let cfg = DispatcherConfig { workers: 2, batch_size: 100, poll_interval_ms: 60_000, listen: false, ..config("short") };
    let d = Arc::new(Dispatcher::new(PgStore::new(pool.clone()), broker, cfg).unwrap());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let run = tokio::spawn(d.clone().run(outbox_producer::until_true(stop_rx)));
    wait_count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'", 60, Duration::from_secs(20)).await;
    stop_tx.send(true).unwrap();
    let total = run.await.unwrap().unwrap();
    assert_eq!(total.published, 60, "{total:?}");
    assert!(d.metrics().batches.load(std::sync::atomic::Ordering::Relaxed) >= 15, "one head per key per claim: at least 15 batches");
}

/// A claim of successors looks only at the keys of the events named, and
/// only where their head is PENDING.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn successor_claims_follow_only_the_named_keys(pool: PgPool) {
    let (_cluster, broker) = started(&pool, 10_000).await;
    // Keys o-0, o-1, o-2, two events each: a0 a1 b0 b1 c0 c1.
    let ids = emit_many(&pool, 3, 2).await;
    let (a0, a1, b1, c1) = (&ids[0], &ids[1], &ids[3], &ids[5]);
    let d = Dispatcher::new(PgStore::new(pool.clone()), broker, config("succ")).unwrap();
    assert_eq!(d.dispatch_once("w1").await.unwrap().published, 3, "the three heads");

    let store = PgStore::new(pool.clone());
    let event = |id: &String| id.parse::<outbox_core::EventId>().unwrap();
    let got: Vec<String> = store.claim_successors("w1", &[event(a0)], 10, 30_000).await.unwrap().iter().map(|c| c.envelope.event_id.to_string()).collect();
    assert_eq!(got.as_slice(), std::slice::from_ref(a1), "only the named key's next event");
    // Its head is now in flight: nothing more on that key.
    assert!(store.claim_successors("w1", &[event(a0)], 10, 30_000).await.unwrap().is_empty());
    assert!(store.claim_successors("w1", &[], 10, 30_000).await.unwrap().is_empty());
    // The full claim finds the other keys' heads, and not o-0's (in flight).
    let mut rest: Vec<String> = store.claim_batch("w1", 10, 30_000).await.unwrap().iter().map(|c| c.envelope.event_id.to_string()).collect();
    rest.sort();
    let mut want = vec![b1.clone(), c1.clone()];
    want.sort();
    assert_eq!(rest, want);
}

/// A claim whose successors do not fill its batch tops it up from every
/// key's head in the same transaction: with many workers, each holds a few
/// keys, and successors alone made batches a fraction of the limit (four
/// instances of four workers on 1,000 keys claimed about 60 events a batch
/// of 300).
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn successors_that_do_not_fill_the_batch_are_topped_up_from_every_head(pool: PgPool) {
    let (_cluster, broker) = started(&pool, 10_000).await;
    // Keys o-0, o-1, o-2, three events each: a0 a1 a2 b0 b1 b2 c0 c1 c2.
    let ids = emit_many(&pool, 3, 3).await;
    let (a0, a1, b0, b1, c1) = (&ids[0], &ids[1], &ids[3], &ids[4], &ids[7]);
    let d = Dispatcher::new(PgStore::new(pool.clone()), broker, config("topup")).unwrap();
    assert_eq!(d.dispatch_once("w1").await.unwrap().published, 3, "the three heads");
    let store = PgStore::new(pool.clone());
    let claimed = |r: &outbox_producer::ClaimRound| {
        let mut got: Vec<String> = r.claimed.iter().map(|c| c.envelope.event_id.to_string()).collect();
        got.sort();
        got
    };
    // A batch its successor fills scans no head.
    let full = store.claim_next("w1", &[a0.parse().unwrap()], false, 1, 30_000).await.unwrap();
    assert_eq!((claimed(&full), full.successor_claim, full.head_scan), (vec![a1.clone()], true, false));
    // One that its successors leave short takes the other keys' heads too
    // (o-0's head, a1, is in flight).
    let short = store.claim_next("w1", &[b0.parse().unwrap()], false, 10, 30_000).await.unwrap();
    let mut want = vec![b1.clone(), c1.clone()];
    want.sort();
    assert_eq!((claimed(&short), short.successor_claim, short.head_scan), (want, true, true));
}

/// Emits A0 A1 A2 B0 A3 .. A9 (keys `<tag>-a`, `<tag>-b`, one transaction
/// each), dispatches them one per batch under `head_scan_every = every`, and
/// returns where B0 went in the send order (A's order is checked).
async fn send_position_of_the_other_key(pool: &PgPool, broker: Arc<outbox_producer::kafka::KafkaBroker>, tag: &str, every: u32) -> usize {
    let mut order = Vec::new();
    let mut a_version = 0;
    for n in 0..11 {
        let (id, version) = if n == 3 {
            (format!("{tag}-b"), 0)
        } else {
            a_version += 1;
            (format!("{tag}-a"), a_version)
        };
        let payload = order_payload(&id, n);
        let command = format!("{tag}-cmd-{n}");
        let req = outbox_core::EmitRequest { aggregate_version: version, ..order_request(&command, &id, &payload) };
        let mut tx = pool.begin().await.unwrap();
        order.push(outbox_producer::emit(&mut tx, &req, &EmitOptions::default()).await.unwrap().event_id().to_string());
        tx.commit().await.unwrap();
    }
    let b0 = order[3].clone();
    let d = Dispatcher::new(PgStore::new(pool.clone()), broker, DispatcherConfig { batch_size: 1, head_scan_every: every, ..config(tag) }).unwrap();
    let mut cursor = outbox_producer::ClaimCursor::default();
    let mut sent = Vec::new();
    for _ in 0..order.len() {
        assert_eq!(d.dispatch_next("w1", &mut cursor).await.unwrap().published, 1);
        sent.push(cursor.last_published()[0].to_string());
    }
    let a_sent: Vec<&String> = sent.iter().filter(|id| **id != b0).collect();
    let a_committed: Vec<&String> = order.iter().filter(|id| **id != b0).collect();
    assert_eq!(a_sent, a_committed, "key A in commit order");
    let scans = d.metrics().head_scans.load(std::sync::atomic::Ordering::Relaxed);
    if every > 1 {
        assert!(scans < order.len() as u64, "{scans} head scans for {} claims", order.len());
    }
    sent.iter().position(|id| *id == b0).unwrap()
}

/// A worker claims its keys' successors first, yet scans every key's head
/// at least every `head_scan_every` claims: an older event of another key
/// waits a few batches, never until the busy key drains. With
/// `head_scan_every = 1` every claim is oldest-first across keys.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn successors_go_first_and_every_key_is_scanned_within_a_few_claims(pool: PgPool) {
    let (_cluster, broker) = started(&pool, 10_000).await;
    let at = send_position_of_the_other_key(&pool, broker.clone(), "four", 4).await;
    // Oldest-first on every claim would send B0 fourth (index 3).
    assert!(at > 3, "A's successors went first: {at}");
    assert!(at <= 4, "B0 waited at most 4 claims: {at}");
    assert_eq!(send_position_of_the_other_key(&pool, broker, "one", 1).await, 3, "a scan on every claim is oldest-first");
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn two_dispatcher_instances_publish_every_event_exactly_once(pool: PgPool) {
    let (cluster, _probe) = started(&pool, 5_000).await;
    let ids = emit_many(&pool, 3_000, 1).await;
    run_two_dispatchers(&pool, &cluster, 3_000, config("d")).await;

    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").await, 3_000);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_publish_receipts").await, 3_000);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_duplicate_receipts").await, 0);
    let owners: Vec<(String, i64)> = sqlx::query_as("SELECT split_part(owner, '-', 1), count(*) FROM outbox_attempts GROUP BY 1 ORDER BY 1").fetch_all(&pool).await.unwrap();
    assert_eq!(owners.len(), 2, "both instances worked: {owners:?}");
    // Neither instance's claims stall behind the other's: when a claim had
    // to re-check rows the other instance had just claimed, it used to wait
    // seconds while the other drained nearly everything.
    // (With the stall, the starved instance got one or two batches of 100;
    // shared fairly, each gets about half.)
    assert!(owners.iter().all(|(_, n)| *n >= 300), "each instance sent at least a tenth of the events: {owners:?}");
    assert_eq!(ids.len(), 3_000);
    each_once_in_log(&cluster, &ids);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn parallel_workers_keep_each_keys_commit_order_in_the_log(pool: PgPool) {
    let (cluster, _probe) = started(&pool, 5_000).await;
    let ids = emit_many(&pool, 20, 25).await;
    let cfg = DispatcherConfig { workers: 3, batch_size: 7, ..config("d") };
    run_two_dispatchers(&pool, &cluster, ids.len() as i64, cfg).await;

    assert_eq!(keys_in_commit_order(&pool, &cluster).await, 20);
}

/// Asserts that each routing key's events are in the log in the order
/// they were committed (and nothing else is there); the number of keys.
async fn keys_in_commit_order(pool: &PgPool, cluster: &TestCluster) -> usize {
    let rows: Vec<(String, String)> = sqlx::query_as("SELECT routing_key, event_id FROM outbox_events ORDER BY seq").fetch_all(pool).await.unwrap();
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
async fn graceful_shutdown_stops_claiming_and_settles_every_started_send(pool: PgPool) {
    let (_cluster, broker) = started(&pool, 10_000).await;
    emit_many(&pool, 2_000, 1).await;
    let d = Arc::new(Dispatcher::new(PgStore::new(pool.clone()), broker, DispatcherConfig { batch_size: 50, ..config("d") }).unwrap());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let run = tokio::spawn(d.clone().run(outbox_producer::until_true(stop_rx)));
    // Stop in the middle of the backlog.
    wait_count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'", 100, Duration::from_secs(60)).await;
    stop_tx.send(true).unwrap();
    let total = run.await.unwrap().unwrap();
    let published = count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").await;
    assert!(published < 2_000, "shutdown came too late to test anything ({published})");
    assert_eq!(total.published as i64, published, "every started send was settled and recorded");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events WHERE state IN ('CLAIMED', 'SENDING')").await, 0, "no claim left behind");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_attempts WHERE state = 'SENDING'").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PENDING'").await, 2_000 - published);
    // Nothing is claimed after the stop.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").await, published);
}

/// A pool of one connection: the statistics of what it did reach
/// `pg_stat_user_tables` when it is closed (its backend exits).
async fn single_connection(pool: &PgPool) -> PgPool {
    sqlx::postgres::PgPoolOptions::new().max_connections(1).connect_with((*pool.connect_options()).clone()).await.unwrap()
}

/// One table's counters in `pg_stat_user_tables`.
#[derive(Debug, sqlx::FromRow)]
struct TableStats {
    n_tup_ins: i64,
    n_tup_upd: i64,
    n_tup_hot_upd: i64,
    seq_scan: i64,
}

/// `table`'s counters once `arrived` says the expected writes have been
/// flushed (statistics reach the view when a backend reports them).
async fn table_stats_once(pool: &PgPool, table: &str, arrived: impl Fn(&TableStats) -> bool) -> TableStats {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let stats: TableStats = sqlx::query_as(
            "SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd, seq_scan FROM pg_stat_user_tables, LATERAL (SELECT pg_stat_clear_snapshot()) s WHERE relname = $1",
        )
        .bind(table)
        .fetch_one(pool)
        .await
        .unwrap();
        if arrived(&stats) {
            return stats;
        }
        assert!(tokio::time::Instant::now() < deadline, "statistics of {table} never arrived: {stats:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The broker's receipt of the registered attempt `a` of the claimed event
/// `c`, written at `offset` of its frozen partition on cluster-a.
fn receipt_on_cluster_a(c: &outbox_core::ClaimedEvent, a: &outbox_core::AttemptRecord, offset: i64) -> outbox_core::BrokerReceipt {
    outbox_core::BrokerReceipt {
        event_id: c.envelope.event_id.clone(),
        envelope_generation: c.envelope.envelope_generation,
        attempt_id: a.attempt_id.clone(),
        payload_digest: c.envelope.payload_digest.clone(),
        destination_digest: c.destination_digest.clone(),
        cluster_id: "cluster-a".into(),
        topic: TOPIC.into(),
        topic_id: c.destination.topic_id.clone(),
        partition: c.destination.partition,
        offset,
    }
}

/// The receipt transaction finds its attempts through an index even where
/// the table has never been analyzed (a new deployment, autovacuum behind,
/// just after `pg_upgrade`): without statistics, "event_id = ANY (a few
/// hundred ids)" is estimated as the whole table, and a sequential scan per
/// batch would grow with every attempt ever made.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn receipt_batches_find_attempts_by_index_without_statistics(pool: PgPool) {
    // 200 ids: past 1 / 0.005 (PostgreSQL's default equality selectivity),
    // the unanalyzed estimate is the whole table. 50,000 rows: enough that a
    // correctly estimated primary-key lookup of 200 rows is an index scan.
    const EVENTS: usize = 200;
    const EARLIER_PER_EVENT: i64 = 250;
    setup(&pool, "cluster-a").await;
    emit_many(&pool, EVENTS, 1).await;
    let own = single_connection(&pool).await;
    let store = PgStore::new(own.clone());
    let claimed = store.claim_batch("w1", EVENTS, 30_000).await.unwrap();
    assert_eq!(claimed.len(), EVENTS);
    let tokens: Vec<_> = claimed.iter().map(|c| c.token.clone()).collect();
    let attempts: Vec<_> = store.register_attempts(&tokens).await.unwrap().into_iter().map(Result::unwrap).collect();
    // Earlier attempts of the same events (closed, not sent), so the
    // table holds many rows per event looked up.
    sqlx::query(
        "INSERT INTO outbox_attempts (attempt_id, event_id, envelope_generation, attempt_generation, claim_generation, owner, state,
                                      destination_digest, started_at_ms)
         SELECT 'att-7' || lpad((row_number() OVER ())::text, 25, '0'), a.event_id, a.envelope_generation, 100 + g, 1, 'w0', 'NOT_SENT',
                a.destination_digest, 0
         FROM outbox_attempts a, generate_series(1, $1) g",
    )
    .bind(EARLIER_PER_EVENT)
    .execute(&own)
    .await
    .unwrap();
    own.close().await;
    let rows = EVENTS as i64 * (1 + EARLIER_PER_EVENT);
    let before = table_stats_once(&pool, "outbox_attempts", |t| t.n_tup_ins >= rows).await.seq_scan;

    let receipts: Vec<_> = claimed.iter().zip(&attempts).enumerate().map(|(n, (c, a))| receipt_on_cluster_a(c, a, n as i64)).collect();
    let own = single_connection(&pool).await;
    let outcomes = PgStore::new(own.clone()).accept_dispatch_receipts(&receipts).await.unwrap();
    assert!(outcomes.iter().all(|o| o.state == EventState::Published), "{:?}", outcomes.iter().find(|o| o.state != EventState::Published));
    own.close().await;
    let after = table_stats_once(&pool, "outbox_attempts", |t| t.n_tup_upd >= EVENTS as i64).await.seq_scan;
    assert_eq!(after, before, "the receipt transaction scanned outbox_attempts sequentially");
}

/// A message the broker never takes (here larger than the client's
/// `message.max.bytes`) is refused outright each time. Its event is
/// retried with a doubling backoff, not in a loop: over two seconds it
/// gathers a handful of NOT_SENT attempts, not hundreds; it stays PENDING
/// (never lost, never PUBLISHED by guess) and still holds its key, so the
/// next event of the same order is not sent ahead of it.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_message_the_broker_always_refuses_backs_off_and_holds_its_key(pool: PgPool) {
    let (cluster, _) = started(&pool, 5_000).await;
    let mut cfg = outbox_producer::kafka::KafkaConfig::new(cluster.bootstrap.clone());
    cfg.extra.push(("message.max.bytes".into(), "1000".into()));
    let broker = Arc::new(outbox_producer::kafka::KafkaBroker::connect(cfg).await.unwrap());
    let big = format!(r#"{{"order":"o-1","totalCents":10,"note":"{}"}}"#, "x".repeat(2_000)).into_bytes();
    let small = order_payload("o-1", 20);
    let mut tx = pool.begin().await.unwrap();
    let stuck = outbox_producer::emit(&mut tx, &order_request("c-1", "o-1", &big), &EmitOptions::default()).await.unwrap();
    let next = outbox_producer::emit(&mut tx, &outbox_core::EmitRequest { aggregate_version: 2, ..order_request("c-2", "o-1", &small) }, &EmitOptions::default()).await.unwrap();
    tx.commit().await.unwrap();

    let d = Arc::new(Dispatcher::new(PgStore::new(pool.clone()), broker, config("d")).unwrap());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let run = tokio::spawn(d.clone().run(outbox_producer::until_true(stop_rx)));
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop_tx.send(true).unwrap();
    run.await.unwrap().unwrap();

    let states: Vec<String> = sqlx::query_scalar("SELECT state FROM outbox_attempts WHERE event_id = $1").bind(stuck.event_id().as_str()).fetch_all(&pool).await.unwrap();
    // 100 + 200 + 400 + 800 ms of backoff fit in two seconds: about five.
    assert!((2..=8).contains(&states.len()), "{} attempts in two seconds", states.len());
    assert!(states.iter().all(|s| s == "NOT_SENT"), "{states:?}");
    assert_eq!(state_of(&pool, stuck.event_id().as_str()).await, EventState::Pending);
    // The wait the store set is outbox-core's rule for the event's attempt count.
    let (wait, generation): (i64, i32) = sqlx::query_as("SELECT next_check_at_ms - state_since_ms, attempt_generation FROM outbox_events WHERE event_id = $1")
        .bind(stuck.event_id().as_str())
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!((wait, generation as usize), (outbox_core::not_sent_backoff_ms(generation as u32), states.len()));
    assert_eq!(state_of(&pool, next.event_id().as_str()).await, EventState::Pending, "sent ahead of its key's head");
    assert_eq!(count(&pool, &format!("SELECT count(*) FROM outbox_attempts WHERE event_id = '{}'", next.event_id())).await, 0);
    assert!(read_topic(&cluster.bootstrap, TOPIC, PARTITIONS).is_empty());
}

/// A session of its own, in a transaction that holds the lock `lock_sql`
/// takes, and its backend pid.
async fn holding(pool: &PgPool, lock_sql: &str) -> (sqlx::Transaction<'static, sqlx::Postgres>, i32) {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(lock_sql).execute(&mut *tx).await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *tx).await.unwrap();
    (tx, pid)
}

/// Terminates the backend that waits for `blocker`'s lock, once one does,
/// as a lost connection, a restart or a failover would cut it off; its
/// statement is returned.
async fn kill_the_session_waiting_for(pool: &PgPool, blocker: i32) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let waiting: Option<(i32, String)> = sqlx::query_as("SELECT pid, query FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))")
            .bind(blocker)
            .fetch_optional(pool)
            .await
            .unwrap();
        if let Some((pid, query)) = waiting {
            let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)").bind(pid).fetch_one(pool).await.unwrap();
            assert!(killed, "backend {pid} could not be terminated");
            return query;
        }
        assert!(tokio::time::Instant::now() < deadline, "no session ever waited for backend {blocker}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Every event PUBLISHED by the one attempt it was sent with, with one
/// primary receipt, and in the log exactly once.
async fn published_once_each(pool: &PgPool, cluster: &TestCluster, ids: &[String]) {
    let n = ids.len() as i64;
    assert_eq!(count(pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").await, n);
    assert_eq!(count(pool, "SELECT count(*) FROM outbox_attempts WHERE state = 'ACKED'").await, n);
    assert_eq!(count(pool, "SELECT count(*) FROM outbox_attempts").await, n, "an event was sent twice");
    assert_eq!(count(pool, "SELECT count(DISTINCT event_id) FROM outbox_publish_receipts").await, n);
    each_once_in_log(cluster, ids);
}

/// Asserts that the log holds exactly `ids`, each once.
fn each_once_in_log(cluster: &TestCluster, ids: &[String]) {
    let mut in_log: Vec<String> = read_topic(&cluster.bootstrap, TOPIC, PARTITIONS).iter().filter_map(|m| m.header(headers::EVENT_ID)).collect();
    in_log.sort();
    let mut want = ids.to_vec();
    want.sort();
    assert_eq!(in_log, want, "the log must hold every event exactly once");
}

/// The receipt transaction's connection is cut off (its backend
/// terminated, as by a restart or failover) after the broker ACKed the
/// batch: the batch records the ACKs again on a new connection instead
/// of dropping them, so no event is left for its lease to turn
/// DISPATCH_UNKNOWN and nothing is sent twice.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn receipts_cut_off_by_a_lost_connection_are_recorded_on_a_new_one(pool: PgPool) {
    let (cluster, broker) = started(&pool, 5_000).await;
    let ids = emit_many(&pool, 20, 1).await;
    let d = Arc::new(Dispatcher::new(PgStore::new(pool.clone()), broker, config("d")).unwrap());
    // Receipts wait to be inserted while this session holds the table.
    let (blocker, blocker_pid) = holding(&pool, "LOCK TABLE outbox_publish_receipts IN SHARE MODE").await;
    let batch = tokio::spawn({
        let d = d.clone();
        async move { d.dispatch_once("w1").await }
    });
    let killed = kill_the_session_waiting_for(&pool, blocker_pid).await;
    assert!(killed.contains("outbox_publish_receipts"), "not the receipt transaction: {killed}");
    // The next try waits for the lock again; then PostgreSQL is back.
    tokio::time::sleep(Duration::from_millis(300)).await;
    blocker.rollback().await.unwrap();

    let r = batch.await.unwrap().expect("the batch records its ACKs after losing its connection");
    assert_eq!((r.sent, r.published, r.unknown), (20, 20, 0), "{r:?}");
    assert!(d.metrics().store_retries.load(std::sync::atomic::Ordering::Relaxed) >= 1);
    published_once_each(&pool, &cluster, &ids).await;
}

/// A lease renewal cut off while the batch's sends are outstanding does not
/// abandon the batch: the broker's ACKs, arriving after it, are recorded.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_lease_renewal_cut_off_mid_batch_still_records_the_acks(pool: PgPool) {
    let (cluster, broker) = started(&pool, 10_000).await;
    // Lease 1 s: the batch renews every 500 ms while the ACKs take 2 s.
    let d = Arc::new(Dispatcher::new(PgStore::new(pool.clone()), broker, DispatcherConfig { lease_ms: 1_000, ..config("d") }).unwrap());
    // Warm the connection and metadata, so the next Produce request really goes out.
    let mut ids = emit_many(&pool, 1, 1).await;
    assert_eq!(d.dispatch_once("w0").await.unwrap().published, 1);
    let mut batch_ids = Vec::new();
    for o in 0..10 {
        batch_ids.push(create_order(&pool, &format!("r-{o}"), 1).await.event_id().to_string());
    }
    ids.extend(batch_ids.iter().cloned());
    cluster.mock.as_ref().expect("this fault needs the mock cluster").broker_round_trip_time(1, Duration::from_millis(2_000)).unwrap();

    let batch = tokio::spawn({
        let d = d.clone();
        async move { d.dispatch_once("w1").await }
    });
    // Once the attempts are registered (the sends are out), hold the rows
    // the renewal updates.
    wait_count(&pool, "SELECT count(*) FROM outbox_attempts WHERE state = 'SENDING'", 10, Duration::from_secs(10)).await;
    let lock = format!("SELECT 1 FROM outbox_events WHERE event_id IN ('{}') FOR UPDATE", batch_ids.join("','"));
    let (blocker, blocker_pid) = holding(&pool, &lock).await;
    let killed = kill_the_session_waiting_for(&pool, blocker_pid).await;
    assert!(killed.contains("lease_until_ms"), "not the lease renewal: {killed}");
    blocker.rollback().await.unwrap();

    let r = batch.await.unwrap().expect("the batch outlives a failed lease renewal");
    assert_eq!((r.sent, r.published, r.unknown), (10, 10, 0), "{r:?}");
    assert!(d.metrics().store_retries.load(std::sync::atomic::Ordering::Relaxed) >= 1);
    cluster.mock.as_ref().unwrap().broker_round_trip_time(1, Duration::ZERO).unwrap();
    published_once_each(&pool, &cluster, &ids).await;
}

/// The system clock moved by a fixed amount: a host whose clock is off.
#[derive(Debug)]
struct ShiftedClock(i64);

impl outbox_core::Clock for ShiftedClock {
    fn now_ms(&self) -> i64 {
        outbox_core::SystemClock.now_ms() + self.0
    }
}

/// A dispatcher on a host whose clock is ahead of or behind PostgreSQL's
/// reports by how much, with its sign, in its skew gauge.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_host_clock_off_from_the_database_shows_in_the_skew_gauge(pool: PgPool) {
    let (_cluster, broker) = started(&pool, 5_000).await;
    for shift in [120_000i64, -45_000, 0] {
        let store = PgStore::with_clock(pool.clone(), Arc::new(ShiftedClock(shift)));
        let d = Arc::new(Dispatcher::new(store, broker.clone(), config("skew")).unwrap());
        let gauge = d.metrics();
        gauge.clock_skew_ms.store(i64::MIN, std::sync::atomic::Ordering::Relaxed);
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let run = tokio::spawn(d.clone().run(outbox_producer::until_true(stop_rx)));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let skew = loop {
            let skew = gauge.clock_skew_ms.load(std::sync::atomic::Ordering::Relaxed);
            if skew != i64::MIN {
                break skew;
            }
            assert!(tokio::time::Instant::now() < deadline, "the skew was never measured");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        stop_tx.send(true).unwrap();
        run.await.unwrap().unwrap();
        assert!((skew - shift).abs() < 2_000, "clock shifted by {shift} ms, measured {skew} ms");
    }
}

/// Two dispatcher instances run while their PostgreSQL sessions are killed
/// at random, mid-statement or mid-transaction, every 40 ms (as a flapping
/// network or a failover would), with a reconciler for what the kills leave
/// unknown. Every event ends PUBLISHED with one primary receipt, each is in
/// the log exactly once, and each key's events are in the log in commit order.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn dispatchers_whose_connections_are_killed_at_random_lose_and_duplicate_nothing(pool: PgPool) {
    let (cluster, broker) = started(&pool, 3_000).await;
    let ids = emit_many(&pool, 200, 8).await;
    let total = ids.len() as i64;

    // The dispatchers' own sessions, told apart by their application name.
    const VICTIM: &str = "outbox-chaos-dispatch";
    let victims = sqlx::postgres::PgPoolOptions::new()
        .max_connections(12)
        .connect_with((*pool.connect_options()).clone().application_name(VICTIM))
        .await
        .unwrap();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let cfg = DispatcherConfig { workers: 2, batch_size: 50, lease_ms: 3_000, ..config("chaos") };
    let mut runs = Vec::new();
    for n in 0..2 {
        let d = Dispatcher::new(PgStore::new(victims.clone()), cluster.broker(3_000).await, DispatcherConfig { name: format!("chaos{n}"), ..cfg.clone() }).unwrap();
        runs.push(tokio::spawn(Arc::new(d).run(outbox_producer::until_true(stop_rx.clone()))));
    }
    let killer = tokio::spawn({
        let (pool, mut stop) = (pool.clone(), stop_rx.clone());
        async move {
            let mut kills = 0u32;
            while !*stop.borrow() {
                let killed: Option<bool> = sqlx::query_scalar(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                     WHERE application_name = $1 AND state <> 'idle' ORDER BY random() LIMIT 1",
                )
                .bind(VICTIM)
                .fetch_optional(&pool)
                .await
                .unwrap();
                kills += u32::from(killed == Some(true));
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(40)) => {}
                    _ = stop.changed() => {}
                }
            }
            kills
        }
    });
    // What a kill leaves unknown (a commit whose answer was lost, a batch
    // that gave up), the reconciler resolves from the log.
    let reconciler = tokio::spawn({
        let (pool, broker, mut stop) = (pool.clone(), broker.clone(), stop_rx.clone());
        async move {
            // No sooner than the adapter allows: a message may stay in the client that long.
            let bound = broker.max_in_flight_ms().expect("the Kafka adapter bounds its in-flight time") as i64 + outbox_core::reconcile::DEFAULT_CLOCK_SKEW_ALLOWANCE_MS;
            let retry = RetryPolicy { in_flight_bound_ms: bound, recheck_ms: 300, ..RetryPolicy::default() };
            let rec = Reconciler::new(PgStore::new(pool), broker, ReconcilerConfig { lease_ms: 5_000, retry, ..ReconcilerConfig::default() }).unwrap();
            while !*stop.borrow() {
                let _ = rec.resolve_unknown_once().await;
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                    _ = stop.changed() => {}
                }
            }
        }
    });
    wait_count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'", total, Duration::from_secs(150)).await;
    stop_tx.send(true).unwrap();
    let kills = killer.await.unwrap();
    reconciler.await.unwrap();
    for r in runs {
        r.await.unwrap().unwrap();
    }
    assert!(kills >= 10, "only {kills} sessions were killed: the fault did not happen");

    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_publish_receipts").await, total, "one primary receipt per event");
    assert_eq!(count(&pool, "SELECT count(DISTINCT event_id) FROM outbox_publish_receipts").await, total);
    each_once_in_log(&cluster, &ids);
    assert_eq!(keys_in_commit_order(&pool, &cluster).await, 200);
    let unknowns = count(&pool, "SELECT count(*) FROM outbox_unknown_resolutions").await;
    eprintln!("{kills} sessions killed; {unknowns} events went DISPATCH_UNKNOWN and were resolved by the reconciler");
}

/// The sessions of this test's database that LISTEN (a `FROM ... WHERE` clause).
const LISTENING: &str = "FROM pg_stat_activity WHERE query LIKE 'LISTEN%' AND datname = current_database()";

/// A running one-worker dispatcher that only a notification can wake
/// within a test (a 10 min poll), once its LISTEN session is up.
async fn listening_dispatcher(pool: &PgPool) -> (TestCluster, tokio::sync::watch::Sender<bool>, tokio::task::JoinHandle<Result<outbox_producer::BatchReport, outbox_producer::ProducerError>>) {
    let (cluster, broker) = started(pool, 5_000).await;
    let cfg = DispatcherConfig { workers: 1, poll_interval_ms: 600_000, listen: true, ..config("listen") };
    let d = Arc::new(Dispatcher::new(PgStore::new(pool.clone()), broker, cfg).unwrap());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let run = tokio::spawn(d.run(outbox_producer::until_true(stop_rx)));
    wait_count(pool, &format!("SELECT count(*) {LISTENING}"), 1, Duration::from_secs(10)).await;
    (cluster, stop_tx, run)
}

/// The session that LISTENs for `outbox_pending` is killed (as a restart or
/// failover kills it): the dispatcher listens again on a new one, and a
/// later commit still wakes it at once, not after the poll interval.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_killed_listen_session_is_replaced_and_commits_still_wake_the_dispatcher(pool: PgPool) {
    let (_cluster, stop_tx, run) = listening_dispatcher(&pool).await;
    let first = create_order(&pool, "o-1", 1).await;
    wait_count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'", 1, Duration::from_secs(10)).await;

    let old: i32 = sqlx::query_scalar(&format!("SELECT pid {LISTENING}")).fetch_one(&pool).await.unwrap();
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)").bind(old).fetch_one(&pool).await.unwrap();
    assert!(killed);
    // Another session listens again.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let pids: Vec<i32> = sqlx::query_scalar(&format!("SELECT pid {LISTENING}")).fetch_all(&pool).await.unwrap();
        if pids.iter().any(|p| *p != old) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "nobody LISTENs again after the session was killed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let second = create_order(&pool, "o-2", 2).await;
    wait_count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'", 2, Duration::from_secs(15)).await;
    stop_tx.send(true).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(state_of(&pool, first.event_id().as_str()).await, EventState::Published);
    assert_eq!(state_of(&pool, second.event_id().as_str()).await, EventState::Published);
}

/// An event committed while the LISTEN session is being replaced (its
/// notification goes to a session that is gone) is still dispatched at
/// once: after listening again, the dispatcher looks for work it may not
/// have been told about.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn an_event_committed_while_listen_is_replaced_is_not_left_to_the_poll(pool: PgPool) {
    let (_cluster, stop_tx, run) = listening_dispatcher(&pool).await;
    // Let the workers' first (empty) claim pass: from here only a wake-up moves them.
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The commit lands while the listening session is being terminated.
    let mut tx = pool.begin().await.unwrap();
    let payload = order_payload("o-gap", 1);
    let e = outbox_producer::emit(&mut tx, &order_request("c-gap", "o-gap", &payload), &EmitOptions::default()).await.unwrap();
    sqlx::query(&format!("SELECT pg_terminate_backend(pid) {LISTENING}")).execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();

    wait_count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'", 1, Duration::from_secs(15)).await;
    stop_tx.send(true).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(state_of(&pool, e.event_id().as_str()).await, EventState::Published);
}

/// A TCP proxy in front of PostgreSQL that loses the answer to one COMMIT:
/// once armed with a statement fragment, the first COMMIT its session sends
/// after a statement containing the fragment reaches the server, and the
/// connection is then closed before the server's answer reaches the client.
/// The transaction is committed; the client sees a broken connection.
struct CommitAnswerCutter {
    port: u16,
    armed: Arc<std::sync::Mutex<Option<String>>>,
    cuts: Arc<std::sync::atomic::AtomicU32>,
}

impl CommitAnswerCutter {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let armed: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
        let cuts: Arc<std::sync::atomic::AtomicU32> = Arc::default();
        let (a, c) = (armed.clone(), cuts.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect("127.0.0.1:5432").await else { continue };
                tokio::spawn(Self::session(client, server, a.clone(), c.clone()));
            }
        });
        CommitAnswerCutter { port, armed, cuts }
    }

    /// The next COMMIT after a statement containing `fragment` loses its answer.
    fn arm(&self, fragment: &str) {
        *self.armed.lock().unwrap() = Some(fragment.to_owned());
    }

    fn cuts(&self) -> u32 {
        self.cuts.load(std::sync::atomic::Ordering::SeqCst)
    }

    async fn session(
        client: tokio::net::TcpStream,
        server: tokio::net::TcpStream,
        armed: Arc<std::sync::Mutex<Option<String>>>,
        cuts: Arc<std::sync::atomic::AtomicU32>,
    ) -> std::io::Result<()> {
        use std::sync::atomic::{AtomicBool, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut cr, mut cw) = client.into_split();
        let (mut sr, mut sw) = server.into_split();
        let cut = Arc::new(AtomicBool::new(false));
        let down = {
            let cut = cut.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16 * 1024];
                loop {
                    let n = sr.read(&mut buf).await?;
                    if n == 0 || cut.load(Ordering::SeqCst) {
                        // The server's answer to the cut COMMIT is dropped.
                        return cw.shutdown().await;
                    }
                    cw.write_all(&buf[..n]).await?;
                }
            })
        };
        // Untyped start-up messages (SSL or GSS encryption requests, then the
        // startup message), then typed messages: a type byte, a length, a body.
        loop {
            let len = cr.read_u32().await?;
            let mut body = vec![0u8; len as usize - 4];
            cr.read_exact(&mut body).await?;
            sw.write_u32(len).await?;
            sw.write_all(&body).await?;
            let code = body.get(..4).map(|b| u32::from_be_bytes(b.try_into().unwrap()));
            if !(len == 8 && matches!(code, Some(80877103 | 80877104))) {
                break;
            }
        }
        let mut seen = false;
        loop {
            let kind = cr.read_u8().await?;
            let len = cr.read_u32().await?;
            let mut body = vec![0u8; len as usize - 4];
            cr.read_exact(&mut body).await?;
            let text = String::from_utf8_lossy(&body);
            {
                let mut armed = armed.lock().unwrap();
                if let Some(fragment) = armed.as_deref() {
                    seen |= text.contains(fragment);
                    if seen && kind == b'Q' && text.starts_with("COMMIT") {
                        *armed = None;
                        cut.store(true, Ordering::SeqCst);
                        cuts.fetch_add(1, Ordering::SeqCst);
                    }
                } else {
                    seen = false;
                }
            }
            sw.write_u8(kind).await?;
            sw.write_u32(len).await?;
            sw.write_all(&body).await?;
            if cut.load(Ordering::SeqCst) {
                break;
            }
        }
        let _ = down.await;
        Ok(())
    }
}

/// A pool on `pool`'s database through `cutter`.
async fn pool_through(pool: &PgPool, cutter: &CommitAnswerCutter) -> PgPool {
    let options = (*pool.connect_options()).clone().host("127.0.0.1").port(cutter.port).ssl_mode(sqlx::postgres::PgSslMode::Disable);
    sqlx::postgres::PgPoolOptions::new().max_connections(8).connect_with(options).await.unwrap()
}

/// One batch over 20 events (one per key) by a dispatcher whose session
/// loses the answer to the COMMIT after a statement containing `fragment`:
/// its report, the cluster, and the events.
async fn one_batch_losing_the_commit_answer_after(pool: &PgPool, fragment: &str) -> (outbox_producer::BatchReport, TestCluster, Vec<String>) {
    let (cluster, broker) = started(pool, 5_000).await;
    let ids = emit_many(pool, 20, 1).await;
    let cutter = CommitAnswerCutter::start().await;
    let through = pool_through(pool, &cutter).await;
    let d = Dispatcher::new(PgStore::new(through), broker, config("d")).unwrap();
    cutter.arm(fragment);
    let r = d.dispatch_once("w1").await.expect("the batch goes on after losing a COMMIT's answer");
    assert_eq!(cutter.cuts(), 1, "the COMMIT's answer was not cut");
    (r, cluster, ids)
}

/// The receipt transaction commits, but its answer is lost with the
/// connection: the batch records the same receipts again, finds them
/// already accepted, and every event stays PUBLISHED once by its single
/// attempt, with one primary receipt.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn receipts_committed_whose_answer_was_lost_are_found_already_accepted(pool: PgPool) {
    let (r, cluster, ids) = one_batch_losing_the_commit_answer_after(&pool, "INSERT INTO outbox_publish_receipts").await;
    assert_eq!((r.sent, r.published, r.duplicates, r.unknown), (20, 0, 20, 0), "{r:?}");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_publish_receipts").await, 20);
    published_once_each(&pool, &cluster, &ids).await;
}

/// The registration commits, but its answer is lost with the connection:
/// the dispatcher finds its attempts registered and sends them, instead of
/// leaving the events SENDING, unsent, for their leases and the reconciler.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_registration_committed_whose_answer_was_lost_is_sent(pool: PgPool) {
    let (r, cluster, ids) = one_batch_losing_the_commit_answer_after(&pool, "INSERT INTO outbox_attempts").await;
    assert_eq!((r.claimed, r.sent, r.published, r.unknown), (20, 20, 20, 0), "{r:?}");
    published_once_each(&pool, &cluster, &ids).await;
}

/// The tables a dispatch round reads and writes.
const DISPATCH_TABLES: [&str; 5] = ["outbox_events", "outbox_envelopes", "outbox_attempts", "outbox_publish_receipts", "outbox_commands"];

/// One dispatch round by `store` over `n` new orders that `emitter`
/// commits in one transaction: claim, register, accept a receipt for each
/// (offsets from `offset` on), then ask for their successors (there are
/// none). Returns the next offset.
async fn dispatch_round(emitter: &PgPool, store: &PgStore, round: usize, n: usize, mut offset: i64) -> i64 {
    let ids: Vec<String> = (0..n).map(|i| format!("o-{round}-{i}")).collect();
    let keys: Vec<String> = ids.iter().map(|id| format!("c-{id}")).collect();
    let payload = order_payload("o", 1);
    let requests: Vec<_> = ids.iter().zip(&keys).map(|(id, key)| order_request(key, id, &payload)).collect();
    let mut tx = emitter.begin().await.unwrap();
    outbox_producer::emit_batch(&mut tx, &requests, &EmitOptions::default()).await.unwrap();
    tx.commit().await.unwrap();

    let claimed = store.claim_batch("w1", n, 30_000).await.unwrap();
    assert_eq!(claimed.len(), n, "round {round}");
    let tokens: Vec<_> = claimed.iter().map(|c| c.token.clone()).collect();
    let attempts: Vec<_> = store.register_attempts(&tokens).await.unwrap().into_iter().map(Result::unwrap).collect();
    let receipts: Vec<_> = claimed
        .iter()
        .zip(&attempts)
        .map(|(c, a)| {
            offset += 1;
            receipt_on_cluster_a(c, a, offset)
        })
        .collect();
    let outcomes = store.accept_dispatch_receipts(&receipts).await.unwrap();
    assert!(outcomes.iter().all(|o| o.state == EventState::Published), "round {round}");
    let published: Vec<_> = claimed.iter().map(|c| c.envelope.event_id.clone()).collect();
    assert!(store.claim_successors("w1", &published, n, 30_000).await.unwrap().is_empty());
    offset
}

/// The dispatcher's statements (the claims over every head and over
/// successors, registration, the receipt transaction) probe indexes
/// whatever the statistics said when its session planned them. A session
/// that planned them against a handful of analyzed rows (as autovacuum
/// leaves young tables) goes on dispatching after the tables have grown
/// several hundredfold without reading an outbox table from end to end. It
/// did read them, once per key in the head claim: three rounds of 200
/// events over 50,000 took 15.8 s, the claim 4.9 s of each.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn dispatch_planned_on_tiny_tables_stays_index_probes(pool: PgPool) {
    setup(&pool, "cluster-a").await;
    // Only the sessions' own statements in the counters: autovacuum's reads
    // of these tables (and the statistics a background ANALYZE would leave
    // half-way through the test) made the figure vary from 19,000 to 33,000.
    for t in DISPATCH_TABLES {
        sqlx::query(&format!("ALTER TABLE {t} SET (autovacuum_enabled = false)")).execute(&pool).await.unwrap();
    }
    let own = single_connection(&pool).await;
    let emitter = single_connection(&pool).await;
    let store = PgStore::new(own.clone());
    // Planned more than five times (PostgreSQL may settle on a generic plan
    // after five), then again with statistics of tiny tables.
    let mut offset = 0;
    for round in 0..6 {
        offset = dispatch_round(&emitter, &store, round, 3, offset).await;
    }
    sqlx::query("ANALYZE").execute(&pool).await.unwrap();
    for round in 6..12 {
        offset = dispatch_round(&emitter, &store, round, 3, offset).await;
    }
    // The tables grow through other sessions.
    let others = single_connection(&pool).await;
    let bulk = PgStore::new(others.clone());
    for round in 12..52 {
        offset = dispatch_round(&others, &bulk, round, 500, offset).await;
    }
    // What the sessions that planned on tiny tables read from here on.
    let before = reads(&pool, &[&own, &emitter, &others], &DISPATCH_TABLES).await;
    for round in 52..55 {
        offset = dispatch_round(&emitter, &store, round, 200, offset).await;
    }
    let read = reads(&pool, &[&own, &emitter], &DISPATCH_TABLES).await - before;
    eprintln!("dispatching 600 events over 20,000: {} rows and index entries read, {} sequential scans", read.rows, read.seq_scans);
    // A statement that scanned would start one scan per round at least.
    assert!(read.seq_scans < 5, "dispatching 600 events over 20,000 started {} sequential scans of the outbox tables", read.seq_scans);
    // A few dozen index entries per event; a plan that read a table or one
    // of its indexes from end to end reads 20,000 per round, 60,000 in all.
    // The figure is bimodal with no scan at all (measured alone, same code:
    // 15,832 and 28,335; 30,085 in a full run), so the bound sits between
    // the upper mode and one table read end to end per round.
    assert!(read.rows < 70 * 600, "dispatching 600 events over 20,000 read {} rows and index entries", read.rows);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").await, 20_636);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn v1_and_v2_destinations_dispatch_verify_and_are_found(pool: PgPool) {
    let (cluster, broker) = started(&pool, 5_000).await;
    // Generation 1 has no topic id: its event freezes destination.v1.
    let e1 = create_order(&pool, "o-v1", 10).await;
    let id = broker.topic_id(TOPIC).await.unwrap().expect("the mock cluster gives topic ids");
    let g2 = outbox_producer::routes::revise(&pool, &outbox_core::RoutePolicy { topic_id: Some(id.clone()), ..outbox_core::RoutePolicy::new(ORDER_CREATED, broker.cluster_id(), TOPIC, PARTITIONS as u32) })
        .await
        .unwrap();
    assert_eq!(g2.generation, 2);
    let e2 = create_order(&pool, "o-v2", 20).await;
    assert_eq!(e1.destination.topic_id, None);
    assert_eq!(e2.destination.topic_id.as_deref(), Some(id.as_str()));
    let d = Dispatcher::new(PgStore::new(pool.clone()), broker.clone(), config("d")).unwrap();
    let r = d.dispatch_once("w1").await.unwrap();
    assert_eq!((r.claimed, r.sent, r.published), (2, 2, 2));
    let log = read_topic(&cluster.bootstrap, TOPIC, PARTITIONS);
    assert_eq!(log.len(), 2);
    for (e, schema) in [(&e1, "destination.v1\n"), (&e2, "destination.v2\n")] {
        assert_eq!(state_of(&pool, e.event_id().as_str()).await, EventState::Published);
        let m = log.iter().find(|m| m.header(headers::EVENT_ID).as_deref() == Some(e.event_id().as_str())).expect("in the log");
        assert!(m.header(headers::DESTINATION).unwrap().starts_with(schema), "{schema}");
        let claims = headers::verify(&m.headers, &m.payload, TOPIC, m.partition, Some(&m.key)).unwrap();
        assert_eq!(claims.destination_digest, e.destination_digest);
        match broker.lookup(&e.destination, e.event_id(), &outbox_core::ScanFrom::at(0)).await {
            LookupOutcome::Found(receipts) => assert_eq!((receipts.len(), receipts[0].offset), (1, m.offset)),
            other => panic!("expected Found, got {other:?}"),
        }
    }
}

/// An event frozen for a topic that was deleted and created again under
/// the same name (its destination.v2 names the old id) is not sent into the
/// new topic's log: its attempt is NOT_SENT with the reason, the event
/// stays PENDING (a destination migration moves it), nothing is written.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn an_event_frozen_for_a_recreated_topic_is_not_sent(pool: PgPool) {
    let (cluster, broker) = started(&pool, 5_000).await;
    let current = broker.topic_id(TOPIC).await.unwrap().expect("the mock cluster gives topic ids");
    let old = if current == "AAECAwQFBgcICQoLDA0ODw" { "_____________________w" } else { "AAECAwQFBgcICQoLDA0ODw" };
    let policy = outbox_core::RoutePolicy { topic_id: Some(old.to_owned()), ..outbox_core::RoutePolicy::new(ORDER_CREATED, broker.cluster_id(), TOPIC, PARTITIONS as u32) };
    outbox_producer::routes::revise(&pool, &policy).await.unwrap();
    let e = create_order(&pool, "o-old", 10).await;
    let d = Dispatcher::new(PgStore::new(pool.clone()), broker.clone(), config("d")).unwrap();
    let r = d.dispatch_once("w1").await.unwrap();
    assert_eq!((r.claimed, r.published, r.not_sent), (1, 0, 1), "{r:?}");
    assert_eq!(state_of(&pool, e.event_id().as_str()).await, EventState::Pending);
    let (state, detail): (String, Option<String>) =
        sqlx::query_as("SELECT state, detail FROM outbox_attempts WHERE event_id = $1").bind(e.event_id().as_str()).fetch_one(&pool).await.unwrap();
    assert_eq!(state, "NOT_SENT");
    assert!(detail.as_deref().is_some_and(|d| d.contains("recreated") && d.contains(old)), "{detail:?}");
    assert!(read_topic(&cluster.bootstrap, TOPIC, PARTITIONS).is_empty(), "written into the recreated topic's log");
}

/// The database reads the topic id of a frozen destination as outbox-core
/// does (the scan floor of an attempt uses it): a destination.v2's `topicId`, whatever
/// bytes the length-prefixed cluster id and topic before it hold; none for
/// a destination.v1; bytes that claim destination.v2 and do not parse are
/// refused.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_database_reads_a_destinations_topic_id_as_the_core_does(pool: PgPool) {
    let ids = [None, Some("AAECAwQFBgcICQoLDA0ODw"), Some("_____________________w")];
    let clusters = ["kafka-prod", "a:b", "x\ntopicId=22:AAAAAAAAAAAAAAAAAAAAAQ\n", "日本"];
    for cluster in clusters {
        for topic_id in ids {
            let policy = outbox_core::RoutePolicy { topic_id: topic_id.map(str::to_owned), ..outbox_core::RoutePolicy::new(ORDER_CREATED, "cluster-a", "orders.v2", 6) };
            // Bytes a route would refuse to make, read all the same.
            let d = outbox_core::Destination { cluster_id: cluster.to_owned(), ..policy.resolve("t", "order", "o-1").unwrap() };
            let bytes = d.canonical_bytes();
            assert_eq!(outbox_core::Destination::from_canonical(&bytes).unwrap().topic_id.as_deref(), topic_id);
            let read: Option<String> = sqlx::query_scalar("SELECT outbox_destination_topic_id($1)").bind(&bytes).fetch_one(&pool).await.unwrap();
            assert_eq!(read.as_deref(), topic_id, "{:?}", String::from_utf8_lossy(&bytes));
        }
    }
    for bad in [&b"destination.v2\nclusterId=3:ab\n"[..], b"destination.v2\nclusterId=x:a\n", b"destination.v2\ntopic=1:a\n", b"destination.v2\nclusterId=1:a\ntopic=1:b\ntopicId=30:short\n"] {
        let r: Result<Option<String>, _> = sqlx::query_scalar("SELECT outbox_destination_topic_id($1)").bind(bad).fetch_one(&pool).await;
        assert!(r.is_err(), "{:?} was read as {r:?}", String::from_utf8_lossy(bad));
    }
}

/// An attempt's scan floor is the highest receipted offset of its
/// partition's log: registration finds it with one index probe per
/// partition, however many receipts the partition holds, and for a
/// destination.v1 (no topic id) as for a destination.v2. For v1 it read
/// every receipt of the partition (a backward scan of the position index
/// filtered on the topic id, then a sort): under `dispatch_bench
/// --preload`, 2,367 receipts per partition per batch, the statement 176 µs
/// of the database's time per event over 100,000 events, growing with the
/// table.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn registration_finds_each_scan_floor_without_reading_the_partitions_receipts(pool: PgPool) {
    setup(&pool, "cluster-a").await;
    let own = single_connection(&pool).await;
    let store = PgStore::new(own.clone());
    let mut offset = 0;
    for round in 0..6 {
        offset = dispatch_round(&own, &store, round, 500, offset).await;
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_publish_receipts WHERE topic_id IS NULL").await, 3_000);
    let payload = order_payload("o", 1);
    let ids: Vec<String> = (0..30).map(|i| format!("o-last-{i}")).collect();
    let keys: Vec<String> = ids.iter().map(|id| format!("c-{id}")).collect();
    let requests: Vec<_> = ids.iter().zip(&keys).map(|(id, key)| order_request(key, id, &payload)).collect();
    let mut tx = own.begin().await.unwrap();
    outbox_producer::emit_batch(&mut tx, &requests, &EmitOptions::default()).await.unwrap();
    tx.commit().await.unwrap();
    let claimed = store.claim_batch("w1", 30, 30_000).await.unwrap();
    assert_eq!(claimed.len(), 30);
    let tokens: Vec<_> = claimed.iter().map(|c| c.token.clone()).collect();

    let before = reads(&pool, &[&own], &["outbox_publish_receipts"]).await;
    let attempts: Vec<_> = store.register_attempts(&tokens).await.unwrap().into_iter().map(Result::unwrap).collect();
    let read = reads(&pool, &[&own], &["outbox_publish_receipts"]).await - before;

    // Each floor is right: one past the highest offset receipted on the attempt's partition.
    let tops: Vec<(i32, i64)> =
        sqlx::query_as("SELECT partition, max(\"offset\") FROM outbox_publish_receipts GROUP BY partition").fetch_all(&pool).await.unwrap();
    let tops: BTreeMap<i32, i64> = tops.into_iter().collect();
    for (c, a) in claimed.iter().zip(&attempts) {
        assert_eq!(a.scan_from_offset, tops[&c.destination.partition] + 1, "{}", a.event_id);
        assert!(a.scan_anchor.is_some());
    }
    // A probe per partition reads an entry or two and its row; reading
    // the partitions' receipts reads about 1,000 each.
    assert!(read.rows <= 4 * PARTITIONS as i64, "registering 30 attempts over 3,000 receipts read {} receipt rows and index entries", read.rows);
}
