//! Quickstart: `cargo run --example quickstart`.
//!
//! The whole path of an order event, end to end:
//! 1. an order service commits each order row and its `order.created.v2`
//!    event in one PostgreSQL transaction (`emit`);
//! 2. the dispatcher delivers the events to Kafka under fenced claims, and
//!    the receipt transaction marks each PUBLISHED with its broker receipt;
//! 3. the fulfilment consumer, on a database of its own, reserves stock once
//!    per event, writing its `(consumerId, eventId)` receipt and the
//!    reservation in one transaction, and publishes its watermarks over the
//!    broker (the watermark topic `outbox.watermarks`);
//! 4. the reconciler reads the watermark topic into the outbox database,
//!    compares the three sets (outbox, receipts, consumer watermarks) and
//!    prints its report.
//!
//! PostgreSQL: `DATABASE_URL`, else the local server, else a throwaway one
//! (`--throwaway-postgres` forces it). Kafka: `OUTBOX_KAFKA_BOOTSTRAP`, else
//! an in-process Kafka-protocol cluster. Two scratch databases (the outbox's
//! and the fulfilment consumer's) are created for the run and dropped at the
//! end, unless `--keep` is given (then the `outbox` CLI can `trace` its
//! events afterwards).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use outbox_consumer::{ConsumerConfig, IdempotentConsumer};
use outbox_core::{EmitRequest, RoutePolicy};
use outbox_examples::env::{Kafka, ScratchDb};
use outbox_examples::fulfilment::{self, FulfilmentHandler};
use outbox_producer::{emit, register_consumer, Dispatcher, DispatcherConfig, EmitOptions, PgStore, Reconciler, ReconcilerConfig, WatermarkTopicConfig, WatermarkTopicReader};
use sqlx::PgPool;

const TOPIC: &str = "orders";
const PARTITIONS: i32 = 3;
const ORDERS: usize = 5;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into())).with_target(false).init();
    let keep = std::env::args().any(|a| a == "--keep");
    let db = ScratchDb::create("outbox_quickstart", 10).await?;
    // The consumer's own database, on the same server (a consumer needs no
    // access to the outbox database: its watermarks go over the broker).
    let consumer_db = ScratchDb::create_on(&db.url(), "outbox_quickstart_fulfilment", 5).await?;
    let result = run(&db, &consumer_db).await;
    if keep && !db.is_throwaway() {
        println!("\nkept {} and {}; look at any event with:", db.describe(), consumer_db.describe());
        println!("  DATABASE_URL={} cargo run -p outbox-cli -- trace <eventId>", db.url());
    } else {
        consumer_db.drop_now().await?;
        db.drop_now().await?;
    }
    result
}

async fn run(db: &ScratchDb, consumer_db: &ScratchDb) -> anyhow::Result<()> {
    let pool = db.pool.clone();
    let consumer_pool = consumer_db.pool.clone();
    println!("== setup");
    println!("outbox   : {}", db.describe());
    println!("consumer : {}", consumer_db.describe());
    outbox_producer::migrate(&pool).await?;
    // In the outbox database: the table the reconciler applies published watermarks to.
    outbox_consumer::migrate(&pool).await?;
    outbox_consumer::migrate(&consumer_pool).await?;
    let kafka = Kafka::start(&[(TOPIC, PARTITIONS)])?;
    println!("kafka    : {}", kafka.describe());
    let broker = kafka.broker(|c| c.message_timeout_ms = 10_000).await?;
    let policy = outbox_producer::routes::revise(&pool, &RoutePolicy::new("order.created.v2", broker.cluster_id(), TOPIC, PARTITIONS as u32)).await?;
    println!("route    : order.created.v2 -> {}/{} ({} partitions, key {}, generation {})", policy.cluster_id, policy.topic, policy.partitions, policy.key_template, policy.generation);
    register_consumer(&pool, fulfilment::CONSUMER_ID, &[TOPIC], true, true).await?;
    fulfilment::create_tables(&consumer_pool).await?;
    sqlx::query("CREATE TABLE orders (id text PRIMARY KEY, sku text NOT NULL, quantity int NOT NULL)").execute(&pool).await?;

    println!("\n== 1. order service: order row + event, one transaction each");
    let mut event_ids = Vec::new();
    for i in 1..=ORDERS {
        let order_id = format!("o-{}", 40 + i);
        let payload = serde_json::to_vec(&serde_json::json!({ "order": order_id, "sku": format!("sku-{i}"), "quantity": i }))?;
        let mut tx = pool.begin().await?;
        sqlx::query("INSERT INTO orders (id, sku, quantity) VALUES ($1, $2, $3)").bind(&order_id).bind(format!("sku-{i}")).bind(i as i32).execute(&mut *tx).await?;
        let command_key = format!("place-order-{order_id}");
        let e = emit(
            &mut tx,
            &EmitRequest {
                command_key: &command_key,
                tenant: "tenant-7",
                aggregate_type: "order",
                aggregate_id: &order_id,
                aggregate_version: 1,
                event_type: "order.created.v2",
                payload_schema: "order-v2",
                payload: &payload,
            },
            &EmitOptions::default(),
        )
        .await?;
        tx.commit().await?;
        let state: String = sqlx::query_scalar("SELECT state FROM outbox_events WHERE event_id = $1").bind(e.event_id().as_str()).fetch_one(&pool).await?;
        println!("{}  {state}", e.event_id());
        println!("    aggregate {}/{}@{}  type {}", e.envelope.aggregate_type, e.envelope.aggregate_id, e.envelope.aggregate_version, e.envelope.event_type);
        println!("    payloadDigest     {}", e.envelope.payload_digest);
        println!("    payloadSchema     {}", e.envelope.payload_schema);
        println!("    destination       {}/{} partition {} key {}", e.destination.cluster_id, e.destination.topic, e.destination.partition, e.destination.routing_key);
        println!("    destinationDigest {}", e.destination_digest);
        event_ids.push(e.event_id().to_string());
    }
    // A retried command yields the same event, never a second one.
    let retried = {
        let order_id = "o-41";
        let payload = serde_json::to_vec(&serde_json::json!({ "order": order_id, "sku": "sku-1", "quantity": 1 }))?;
        let mut tx = pool.begin().await?;
        let req = EmitRequest {
            command_key: "place-order-o-41",
            tenant: "tenant-7",
            aggregate_type: "order",
            aggregate_id: order_id,
            aggregate_version: 1,
            event_type: "order.created.v2",
            payload_schema: "order-v2",
            payload: &payload,
        };
        let e = emit(&mut tx, &req, &EmitOptions::default()).await?;
        tx.commit().await?;
        e
    };
    println!("retried command place-order-o-41 -> {} (inserted: {})", retried.event_id(), retried.inserted);

    println!("\n== 2. dispatcher: fenced claims, Kafka, the receipt transaction");
    let dispatcher = Dispatcher::new(PgStore::new(pool.clone()), broker.clone(), DispatcherConfig { name: "quickstart".into(), ..Default::default() })?;
    for _ in 0..50 {
        let r = dispatcher.dispatch_once("quickstart-0").await?;
        if r.claimed == 0 {
            break;
        }
    }
    let receipts: Vec<(String, String, String, i32, i64)> = sqlx::query_as(
        "SELECT e.event_id, e.state, r.topic, r.partition, r.\"offset\" FROM outbox_events e
         JOIN outbox_publish_receipts r USING (event_id) ORDER BY e.seq",
    )
    .fetch_all(&pool)
    .await?;
    for (id, state, topic, partition, offset) in &receipts {
        println!("{id}  {state}  receipt {topic}/{partition}@{offset}");
    }
    anyhow::ensure!(receipts.len() == ORDERS, "{} of {ORDERS} events published", receipts.len());

    println!("\n== 3. fulfilment consumer (its own database): one receipt and one effect per event");
    let mut consumer_cfg = ConsumerConfig::new(fulfilment::CONSUMER_ID, kafka.bootstrap.clone(), &[TOPIC]);
    consumer_cfg.watermark_publish_interval_ms = 500;
    let consumer = IdempotentConsumer::new(consumer_cfg, consumer_pool.clone(), FulfilmentHandler::default())?;
    let consumer_metrics = consumer.metrics();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(consumer.run(async move {
        let _ = stop_rx.await;
    }));
    wait_consumed(&consumer_pool, ORDERS as i64).await?;
    let _ = stop_tx.send(());
    running.await.context("consumer task")??;
    let published = consumer_metrics.snapshot().watermark_records_published;
    println!("watermark records published over the broker: {published} (failed publications: {})", consumer_metrics.snapshot().watermark_publish_failures);
    let rows: Vec<(String, i32, i64, serde_json::Value)> = sqlx::query_as(
        "SELECT event_id, partition, \"offset\", result FROM outbox_consumer_receipts WHERE consumer_id = $1 ORDER BY partition, \"offset\"",
    )
    .bind(fulfilment::CONSUMER_ID)
    .fetch_all(&consumer_pool)
    .await?;
    for (id, partition, offset, result) in &rows {
        println!("{id}  consumed at {partition}@{offset}  result {result}");
    }
    let (effects, orders_reserved) = fulfilment::count_effects(&consumer_pool).await?;
    println!("stock reservations: {effects} effects for {orders_reserved} orders ({ORDERS} orders placed)");
    anyhow::ensure!(effects == ORDERS as i64, "expected one effect per order");

    println!("\n== 4. reconciler: the watermark topic, three sets, findings, UNKNOWN SLO");
    let watermarks = WatermarkTopicReader::connect(pool.clone(), WatermarkTopicConfig::new(kafka.bootstrap.clone())).await?;
    let ingested = watermarks.ingest_once().await?;
    println!(
        "watermark topic {}: read {} records, applied {}, ignored with a finding {}",
        watermarks.config().topic,
        ingested.read,
        ingested.applied,
        ingested.findings()
    );
    anyhow::ensure!(ingested.applied > 0 && ingested.findings() == 0, "the consumer's watermarks arrive over the broker");
    let reconciler = Reconciler::new(PgStore::new(pool.clone()), broker.clone(), ReconcilerConfig { owner: "quickstart-reconciler".into(), ..Default::default() })?;
    let (resolved, compared) = reconciler.run_once().await?;
    let report = reconciler.report().await?;
    println!("first event: {} (run with --keep to trace it with the outbox CLI)", event_ids[0]);
    println!("this round: {} unknowns examined, {} messages scanned for bypass publishes\n", resolved.examined, compared.scanned_messages);
    print!("{}", report.to_text());
    anyhow::ensure!(report.findings.is_empty(), "a healthy run has no findings");
    let _ = Arc::strong_count(&broker);
    Ok(())
}

async fn wait_consumed(pool: &PgPool, n: i64) -> anyhow::Result<()> {
    for _ in 0..600 {
        let done: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_consumer_receipts WHERE consumer_id = $1").bind(fulfilment::CONSUMER_ID).fetch_one(pool).await?;
        let wm: Option<i64> = sqlx::query_scalar("SELECT sum(applied_count)::bigint FROM outbox_consumer_watermarks WHERE consumer_id = $1")
            .bind(fulfilment::CONSUMER_ID)
            .fetch_one(pool)
            .await?;
        if done >= n && wm.unwrap_or(0) >= n {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("the fulfilment consumer did not consume {n} events within 60 s")
}
