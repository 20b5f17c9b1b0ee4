//! Claims: a stalled worker's late ACK and a stale worker's writes are
//! fenced; ordering chains tell cluster, topic and key apart; successor
//! claims follow the named keys, are topped up from every head, and leave
//! no key waiting more than a few claims. Real PostgreSQL and librdkafka's
//! in-process Kafka cluster.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{EventState, ManualClock, OutboxStore, RetryPolicy, StoreError};
use outbox_producer::{Dispatcher, DispatcherConfig, EmitOptions, PgStore, Reconciler, ReconcilerConfig};
use outbox_tests::dispatch::{config, emit_many, started, state_of, PARTITIONS, TOPIC};
use outbox_tests::kafka::{read_topic, NoLookup};
use outbox_tests::*;
use sqlx::PgPool;

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
