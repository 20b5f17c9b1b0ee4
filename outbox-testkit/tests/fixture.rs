//! OutboxTest isolates each test (database, topic, consumer group), reads
//! only the tests' Kafka variable, and its wait helpers time out.

use std::time::{Duration, Instant};

use outbox_consumer::{async_trait, ConsumedEvent, Handler, HandlerError};
use outbox_testkit::{drain, run_consumer_until, KafkaFixture, OutboxTest};

struct Ack;

#[async_trait]
impl Handler for Ack {
    async fn handle(&self, _tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, _e: &ConsumedEvent) -> Result<serde_json::Value, HandlerError> {
        Ok(serde_json::Value::Null)
    }
}

#[tokio::test]
async fn fixtures_are_isolated_and_ignore_the_services_kafka_variable() {
    // The services' variable points at a production cluster: the test kit must not use it.
    std::env::set_var("OUTBOX_KAFKA_BOOTSTRAP", "production-kafka.invalid:9092");
    let k = KafkaFixture::start().unwrap();
    match std::env::var("OUTBOX_TEST_KAFKA_BOOTSTRAP") {
        Ok(t) if !t.trim().is_empty() => assert_eq!(k.bootstrap(), t.trim(), "the tests' variable names the cluster"),
        _ => assert!(k.is_mock(), "OUTBOX_KAFKA_BOOTSTRAP is ignored: {k:?}"),
    }
    drop(k);

    let a = OutboxTest::start("iso").await.unwrap();
    let b = OutboxTest::start("iso").await.unwrap();
    assert_ne!(a.db.name, b.db.name);
    assert_ne!(a.topic, b.topic);
    assert_ne!(a.group_id, b.group_id);
    assert!(a.topic.starts_with("iso-") && a.topic != "orders", "{}", a.topic);
    assert_eq!(a.broker.partition_count(&a.topic).await.unwrap(), OutboxTest::PARTITIONS, "the topic exists");
    let cfg = a.consumer_config("shipping");
    assert_eq!((cfg.group_id.as_str(), cfg.topics.as_slice()), (a.group_id.as_str(), std::slice::from_ref(&a.topic)));
    let route = a.route("order.created.v2").await.unwrap();
    assert_eq!((route.topic.as_str(), route.generation), (a.topic.as_str(), 1));
    assert_eq!(a.route("order.created.v2").await.unwrap().generation, 1, "idempotent");
    b.finish().await.unwrap();
    a.finish().await.unwrap();
}

#[tokio::test]
async fn helpers_time_out_with_a_reason() {
    let t = OutboxTest::start("timeouts").await.unwrap();
    // Nothing to send: drain returns at once.
    let r = drain(&*t.dispatcher().unwrap(), Duration::from_secs(5)).await.unwrap();
    assert_eq!(r.claimed, 0);
    // A condition that never holds: run_consumer_until fails after its timeout, consumer stopped.
    let consumer = outbox_consumer::IdempotentConsumer::new(t.consumer_config("c"), t.pool().clone(), Ack).unwrap();
    let started = Instant::now();
    let err = run_consumer_until(consumer, Duration::from_millis(500), || async { false }).await.unwrap_err();
    assert!(err.to_string().contains("did not hold within 500 ms"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(20));
    // wait_published panics with the reason.
    let id: outbox_core::EventId = "evt-01J0000000000000000000000A".parse().unwrap();
    let pool = t.pool().clone();
    let panicked = tokio::spawn(async move { outbox_testkit::wait_published(&pool, &id, Duration::from_millis(200)).await }).await.unwrap_err();
    let msg = panicked.into_panic().downcast::<String>().map(|s| *s).unwrap_or_default();
    assert!(msg.contains("not published within 200 ms"), "{msg}");
    t.finish().await.unwrap();
}
