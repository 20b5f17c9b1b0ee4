//! What each broker answer makes of a dispatched event (an ACK, an answer
//! past the message timeout, a broker down, a message refused every time),
//! what travels with the message, and that a tampered event is never sent.
//! Real PostgreSQL and librdkafka's in-process Kafka cluster, each test
//! injecting the real fault.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{headers, Broker, EventState, LookupOutcome};
use outbox_producer::{Dispatcher, EmitOptions, PgStore, Reconciler, ReconcilerConfig};
use outbox_tests::dispatch::{config, started, state_of, PARTITIONS, TOPIC};
use outbox_tests::kafka::read_topic;
use outbox_tests::*;
use sqlx::PgPool;

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
