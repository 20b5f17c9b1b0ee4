//! The assertions, used the way a service team would: emit in their own
//! transaction, dispatch to the in-process Kafka mock cluster, consume, and
//! check each step.

use std::sync::Arc;
use std::time::Duration;

use outbox_consumer::{async_trait, ConsumedEvent, Handler, HandlerError, Processor, RawMessage};
use outbox_core::{EmitRequest, RoutePolicy};
use outbox_producer::{emit, Dispatcher, DispatcherConfig, EmitOptions, PgStore, Reconciler, ReconcilerConfig};
use outbox_testkit::{
    assert_consumed_once, assert_emitted, assert_no_findings, assert_published, check_consumed_once, check_emitted, check_no_findings, check_published,
    pick_database, KafkaFixture, TestDatabase,
};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use serde_json::{json, Value};
use sqlx::{Postgres, Transaction};

struct Count;

#[async_trait]
impl Handler for Count {
    async fn handle(&self, tx: &mut Transaction<'_, Postgres>, e: &ConsumedEvent) -> Result<Value, HandlerError> {
        sqlx::query("INSERT INTO effects (event_id) VALUES ($1)").bind(e.event_id.as_str()).execute(&mut **tx).await?;
        Ok(json!({"ok": true}))
    }
}

fn read_one(bootstrap: &str, topic: &str, partition: i32, offset: i64) -> RawMessage {
    let c: BaseConsumer = ClientConfig::new().set("bootstrap.servers", bootstrap).set("group.id", "testkit-reader").set("enable.auto.commit", "false").create().unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(offset)).unwrap();
    c.assign(&tpl).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::time::Instant::now() < deadline {
        if let Some(Ok(m)) = c.poll(Duration::from_millis(200)) {
            if m.offset() == offset {
                return RawMessage::from_kafka(&m);
            }
        }
    }
    panic!("message {topic}/{partition}@{offset} not read");
}

#[tokio::test]
async fn emitted_published_and_consumed_once() {
    let server = pick_database().await.unwrap_or_else(|e| panic!("{e}"));
    let db = TestDatabase::create(server.url(), "testkit_assert", 5).await.unwrap();
    let pool = db.pool.clone();
    outbox_producer::migrate(&pool).await.unwrap();
    outbox_consumer::migrate(&pool).await.unwrap();
    sqlx::query("CREATE TABLE orders (id text PRIMARY KEY)").execute(&pool).await.unwrap();
    sqlx::query("CREATE TABLE effects (event_id text PRIMARY KEY)").execute(&pool).await.unwrap();

    let kafka = KafkaFixture::start().unwrap();
    kafka.create_topic("orders", 3).await.unwrap();
    let broker = kafka.broker(|c| c.message_timeout_ms = 10_000).await.unwrap();
    outbox_producer::routes::revise(&pool, &RoutePolicy::new("order.created.v2", broker.cluster_id(), "orders", 3)).await.unwrap();

    // Emit in the user's own transaction, and assert inside it.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders (id) VALUES ('o-42')").execute(&mut *tx).await.unwrap();
    let payload = br#"{"order":"o-42"}"#;
    let request = EmitRequest {
        command_key: "create-o-42",
        tenant: "tenant-7",
        aggregate_type: "order",
        aggregate_id: "o-42",
        aggregate_version: 1,
        event_type: "order.created.v2",
        payload_schema: "order-v2",
        payload,
    };
    let emitted = emit(&mut tx, &request, &EmitOptions::default()).await.unwrap();
    let event_id = assert_emitted(&mut tx, "create-o-42").await;
    assert_eq!(&event_id, emitted.event_id());
    tx.commit().await.unwrap();
    assert_eq!(assert_emitted(&pool, "create-o-42").await, event_id);
    assert!(check_emitted(&pool, "no-such-command").await.unwrap_err().contains("no outbox event"));
    let not_yet = check_published(&pool, &event_id).await.unwrap_err();
    assert!(not_yet.contains("state is PENDING"), "{not_yet}");

    // Dispatch one batch to the mock cluster.
    let dispatcher = Arc::new(Dispatcher::new(PgStore::new(pool.clone()), broker, DispatcherConfig { name: "testkit".into(), ..Default::default() }).unwrap());
    let report = dispatcher.dispatch_once("testkit-0").await.unwrap();
    assert_eq!(report.published, 1, "{report:?}");
    let receipt = assert_published(&pool, &event_id).await;
    assert_eq!(receipt.topic, "orders");
    assert_eq!(assert_emitted(&pool, "create-o-42").await, event_id, "still consistent once published");

    // Consume it twice (a redelivery): one receipt, one effect.
    assert!(check_consumed_once(&pool, "fulfilment", &event_id).await.unwrap_err().contains("no consumption receipt"));
    let msg = read_one(kafka.bootstrap(), &receipt.topic, receipt.partition, receipt.offset);
    let processor = Processor::new("fulfilment", pool.clone(), Count).unwrap();
    processor.process_message(&msg).await.unwrap();
    processor.process_message(&msg).await.unwrap();
    assert_consumed_once(&pool, "fulfilment", &event_id).await;
    let effects: i64 = sqlx::query_scalar("SELECT count(*) FROM effects").fetch_one(&pool).await.unwrap();
    assert_eq!(effects, 1);

    // The reconciler agrees: nothing to report.
    let reconciler = Reconciler::new(PgStore::new(pool.clone()), kafka.broker(|_| {}).await.unwrap(), ReconcilerConfig::default()).unwrap();
    reconciler.run_once().await.unwrap();
    assert_no_findings(&reconciler.report().await.unwrap());
    // A PENDING event past the threshold is a finding, and the message names it.
    let mut tx = pool.begin().await.unwrap();
    let late = emit(&mut tx, &EmitRequest { command_key: "create-o-43", aggregate_id: "o-43", ..request }, &EmitOptions::default()).await.unwrap();
    tx.commit().await.unwrap();
    let strict = Reconciler::new(PgStore::new(pool.clone()), kafka.broker(|_| {}).await.unwrap(), ReconcilerConfig { aged_pending_ms: 0, ..Default::default() }).unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    strict.run_once().await.unwrap();
    let err = check_no_findings(&strict.report().await.unwrap()).unwrap_err();
    assert!(err.contains(&format!("aged_pending {}", late.event_id())), "{err}");

    // A tampered payload is caught.
    sqlx::query("ALTER TABLE outbox_events DISABLE TRIGGER outbox_events_transition").execute(&pool).await.unwrap();
    sqlx::query("UPDATE outbox_events SET payload = 'tampered' WHERE event_id = $1").bind(event_id.as_str()).execute(&pool).await.unwrap();
    let err = check_emitted(&pool, "create-o-42").await.unwrap_err();
    assert!(err.contains("sha256 of the stored payload"), "{err}");

    drop(kafka);
    db.drop_now().await.unwrap();
}

#[tokio::test]
#[should_panic(expected = "assert_published")]
async fn assert_published_panics_with_the_event() {
    let server = pick_database().await.unwrap();
    let db = TestDatabase::create(server.url(), "testkit_panic", 2).await.unwrap();
    outbox_producer::migrate(&db.pool).await.unwrap();
    let id: outbox_core::EventId = "evt-01J0000000000000000000000A".parse().unwrap();
    let pool = db.pool.clone();
    // TestDatabase's Drop removes the database after the panic.
    assert_published(&pool, &id).await;
}

/// The same helpers on the stream path (`outbox_producer::set_dispatch_path`):
/// an event emitted there is a stream row until it leaves the happy path,
/// and the assertions and `drain` read it where it lives (before, they read
/// the exception lane only: `assert_emitted` found no event, `drain`
/// stopped with the backlog still there).
#[tokio::test]
async fn the_assertions_and_drain_read_the_stream() {
    let server = pick_database().await.unwrap_or_else(|e| panic!("{e}"));
    let db = TestDatabase::create(server.url(), "testkit_stream", 5).await.unwrap();
    let pool = db.pool.clone();
    outbox_producer::migrate(&pool).await.unwrap();
    let kafka = KafkaFixture::start().unwrap();
    kafka.create_topic("orders", 3).await.unwrap();
    let broker = kafka.broker(|c| c.message_timeout_ms = 10_000).await.unwrap();
    outbox_producer::routes::revise(&pool, &RoutePolicy::new("order.created.v2", broker.cluster_id(), "orders", 3)).await.unwrap();
    outbox_producer::set_dispatch_path(&pool, outbox_producer::DispatchPath::Stream).await.unwrap();

    let mut ids = Vec::new();
    for n in 0..30 {
        let (command, order) = (format!("create-o-{n}"), format!("o-{n}"));
        let payload = format!(r#"{{"order":"{order}"}}"#);
        let request = EmitRequest {
            command_key: &command,
            tenant: "tenant-7",
            aggregate_type: "order",
            aggregate_id: &order,
            aggregate_version: 1,
            event_type: "order.created.v2",
            payload_schema: "order-v2",
            payload: payload.as_bytes(),
        };
        let mut tx = pool.begin().await.unwrap();
        let emitted = emit(&mut tx, &request, &EmitOptions::default()).await.unwrap();
        assert_eq!(&assert_emitted(&mut tx, &command).await, emitted.event_id(), "inside the emitting transaction");
        tx.commit().await.unwrap();
        ids.push(emitted.event_id().clone());
    }
    let on_stream: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_stream").fetch_one(&pool).await.unwrap();
    assert_eq!(on_stream, 30, "the events are stream rows");
    assert_eq!(assert_emitted(&pool, "create-o-0").await, ids[0]);
    let not_yet = check_published(&pool, &ids[0]).await.unwrap_err();
    assert!(not_yet.contains("state is PENDING"), "{not_yet}");

    // A dispatcher with small batches: drain must go on until the stream is empty.
    let dispatcher = Dispatcher::new(PgStore::new(pool.clone()), broker, DispatcherConfig { name: "testkit".into(), batch_size: 4, ..Default::default() }).unwrap();
    let total = outbox_testkit::drain(&dispatcher, Duration::from_secs(60)).await.unwrap();
    assert_eq!(total.published, 30, "{total:?}");
    for id in &ids {
        let receipt = assert_published(&pool, id).await;
        assert_eq!(receipt.topic, "orders");
    }
    assert_eq!(assert_emitted(&pool, "create-o-7").await, ids[7], "still consistent once published");
    drop(kafka);
    db.drop_now().await.unwrap();
}
