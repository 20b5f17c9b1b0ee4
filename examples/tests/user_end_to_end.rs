//! What a service team's own end-to-end test looks like with outbox-testkit:
//! its own database, topic and consumer group; no polling loops. Configured
//! as in production, from the one configuration (`outbox_config`, filled in
//! with the test's topic, group and broker): the dispatcher signs, the
//! consumer accepts only signed messages of this outbox's source and signs
//! the watermarks it publishes.
use std::time::Duration;

use outbox_config::Config;
use outbox_consumer::IdempotentConsumer;
use outbox_core::EmitRequest;
use outbox_examples::fulfilment::{count_effects, create_tables, FulfilmentHandler};
use outbox_examples::keys::{ExampleKey, SIGNING_SECRET_ENV, WATERMARK_SECRET_ENV};
use outbox_producer::{cloudevents, Dispatcher, PgStore};
use outbox_testkit::{check_consumed_once, drain, run_consumer_until, wait_published, OutboxTest};

/// The service's configuration, as its `outbox.toml` would hold it, with the
/// test's own broker, topic and group.
fn config_toml(t: &OutboxTest, source: &str, signing: &ExampleKey, watermark: &ExampleKey) -> String {
    let (s, w) = (signing.signing_config(), watermark.signing_config());
    let (bootstrap, topic, group) = (t.kafka.bootstrap(), &t.topic, &t.group_id);
    format!(
        r#"
[kafka]
bootstrap = "{bootstrap}"

[dispatch]
name = "orders-e2e"

[dispatch.signing]
key_id = "{s_id}"
secret_hex = "{s_hex}"

[consumer.fulfilment]
topics = ["{topic}"]
group_id = "{group}"
initial_backoff_ms = 10
max_backoff_ms = 100
watermark_signing = {{ key_id = "{w_id}", secret_hex = "{w_hex}" }}
accept = {{ "{topic}" = ["{source}"] }}
require_signature = ["{topic}"]

[consumer.fulfilment.keys]
"{source}" = [{{ key_id = "{s_id}", secret_hex = "{s_hex}" }}]
"#,
        s_id = s.key_id,
        s_hex = s.secret_hex,
        w_id = w.key_id,
        w_hex = w.secret_hex,
    )
}

#[tokio::test]
async fn an_order_is_emitted_published_and_fulfilled_once() {
    let t = OutboxTest::start("orders_e2e").await.unwrap();
    t.route("order.created.v2").await.unwrap();
    create_tables(t.pool()).await.unwrap();
    // Secrets from the environment, else generated for the run; the source is the one `outbox status` shows.
    let signing = ExampleKey::from_env_or_random("orders-k1", SIGNING_SECRET_ENV).unwrap();
    let source = cloudevents::source(t.pool()).await.unwrap();

    let mut tx = t.pool().begin().await.unwrap();
    let request = EmitRequest {
        command_key: "place-order-o-42", tenant: "tenant-7", aggregate_type: "order", aggregate_id: "o-42", aggregate_version: 1,
        event_type: "order.created.v2", payload_schema: "order-v2", payload: br#"{"order":"o-42","sku":"sku-1"}"#,
    };
    let event = outbox_producer::emit(&mut tx, &request, &Default::default()).await.unwrap();
    tx.commit().await.unwrap();

    let watermark = ExampleKey::from_env_or_random("fulfilment-wm-k1", WATERMARK_SECRET_ENV).unwrap();
    let config = Config::from_toml(&config_toml(&t, &source, &signing, &watermark)).unwrap();
    let dispatcher = Dispatcher::new(PgStore::new(t.pool().clone()), t.broker.clone(), config.dispatcher_config().unwrap()).unwrap();
    drain(&dispatcher, Duration::from_secs(20)).await.unwrap();
    let receipt = wait_published(t.pool(), event.event_id(), Duration::from_secs(10)).await;
    assert_eq!(receipt.topic, t.topic);

    // It also publishes its watermarks over the broker (the default): signed, for the reconciler's reader to verify.
    let consumer = IdempotentConsumer::new(config.consumer_config("fulfilment").unwrap(), t.pool().clone(), FulfilmentHandler::default()).unwrap();
    let (pool, id) = (t.pool(), event.event_id());
    run_consumer_until(consumer, Duration::from_secs(30), || async move { check_consumed_once(pool, "fulfilment", id).await.is_ok() }).await.unwrap();
    assert_eq!(count_effects(t.pool()).await.unwrap(), (1, 1), "one reservation for one order");
    t.finish().await.unwrap();
}
