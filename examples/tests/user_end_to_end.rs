//! What a service team's own end-to-end test looks like with outbox-testkit:
//! its own database, topic and consumer group; no polling loops.
use std::time::Duration;

use outbox_consumer::IdempotentConsumer;
use outbox_core::EmitRequest;
use outbox_examples::fulfilment::{count_effects, create_tables, FulfilmentHandler};
use outbox_testkit::{check_consumed_once, run_consumer_until, wait_published, OutboxTest};

#[tokio::test]
async fn an_order_is_emitted_published_and_fulfilled_once() {
    let t = OutboxTest::start("orders_e2e").await.unwrap();
    t.route("order.created.v2").await.unwrap();
    create_tables(t.pool()).await.unwrap();

    let mut tx = t.pool().begin().await.unwrap();
    let request = EmitRequest {
        command_key: "place-order-o-42", tenant: "tenant-7", aggregate_type: "order", aggregate_id: "o-42", aggregate_version: 1,
        event_type: "order.created.v2", payload_schema: "order-v2", payload: br#"{"order":"o-42","sku":"sku-1"}"#,
    };
    let event = outbox_producer::emit(&mut tx, &request, &Default::default()).await.unwrap();
    tx.commit().await.unwrap();

    t.drain(Duration::from_secs(20)).await.unwrap();
    let receipt = wait_published(t.pool(), event.event_id(), Duration::from_secs(10)).await;
    assert_eq!(receipt.topic, t.topic);

    let consumer = IdempotentConsumer::new(t.consumer_config("fulfilment"), t.pool().clone(), FulfilmentHandler::default()).unwrap();
    let (pool, id) = (t.pool(), event.event_id());
    run_consumer_until(consumer, Duration::from_secs(30), || async move { check_consumed_once(pool, "fulfilment", id).await.is_ok() }).await.unwrap();
    assert_eq!(count_effects(t.pool()).await.unwrap(), (1, 1), "one reservation for one order");
    t.finish().await.unwrap();
}
