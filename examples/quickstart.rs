//! Quickstart: `cargo run --example quickstart`.
//!
//! The whole path of an order event, end to end, in the secure form (copy
//! this one, not an open consumer):
//! 1. an order service commits each order row and its `order.created.v2`
//!    event in one PostgreSQL transaction (`emit`); the outbox's source
//!    identity was named when its schema was made (`migrate_with_source`,
//!    as `outbox migrate --source` does);
//! 2. the dispatcher delivers the events to Kafka under fenced claims,
//!    signing every message (`DispatcherConfig::signing`), and the receipt
//!    transaction marks each PUBLISHED with its broker receipt;
//! 3. the fulfilment consumer, on a database of its own, accepts on `orders`
//!    only messages of that source signed with its key
//!    (`ConsumerConfig::trust`), reserves stock once per event, writing its
//!    `(consumerId, eventId)` receipt and the reservation in one
//!    transaction, and publishes its watermarks, signed with a key of its
//!    own, over the broker (the watermark topic `outbox.watermarks`);
//! 4. the reconciler reads the watermark topic into the outbox database,
//!    verifying the consumer's signature on every record, compares the three
//!    sets (outbox, receipts, consumer watermarks) and prints its report;
//! 5. two forged orders are written straight to the topic, one unsigned
//!    that names this outbox and one from another outbox: the consumer
//!    quarantines both and reserves nothing.
//!
//! The secrets are never in the source nor printed: each is read from
//! `OUTBOX_EXAMPLE_SIGNING_SECRET_HEX` / `OUTBOX_EXAMPLE_WATERMARK_SECRET_HEX`
//! (hex) when set, else generated for the run ([`outbox_examples::keys`]).
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
use outbox_consumer::IdempotentConsumer;
use outbox_core::trust::{seal, SigningKey};
use outbox_core::{headers, AttemptId, EmitRequest, EventId, RoutePolicy};
use outbox_examples::env::{Kafka, ScratchDb};
use outbox_examples::fulfilment::{self, FulfilmentHandler};
use outbox_examples::keys::{ExampleKey, SIGNING_SECRET_ENV, WATERMARK_SECRET_ENV};
use outbox_producer::{emit, register_consumer, Dispatcher, EmitOptions, KafkaBroker, PgStore, Reconciler, ReconcilerConfig, WatermarkTopicReader};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
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
    // The outbox's source identity, named when its schema is made (`outbox
    // migrate --source`; without it a random urn:uuid, which `outbox status`
    // shows): every message names it, and consumers accept it by name.
    let source = format!("urn:example:order-service:{}", db.name);
    outbox_producer::migrate_with_source(&pool, Some(&source)).await?;
    println!("source   : {source} (this outbox's identity, named at migrate time)");
    // The dispatcher's signing key (consumers verify with it) and the
    // fulfilment consumer's watermark key (the reconciler's reader verifies
    // with it): from the environment, else generated for this run.
    let signing = ExampleKey::from_env_or_random("order-service-k1", SIGNING_SECRET_ENV)?;
    let watermark_key = ExampleKey::from_env_or_random("fulfilment-wm-k1", WATERMARK_SECRET_ENV)?;
    println!("signing  : the dispatcher signs every message with {}", signing.describe());
    println!("           {} signs its watermark records with {}", fulfilment::CONSUMER_ID, watermark_key.describe());
    // In the outbox database: the table the reconciler applies published watermarks to.
    outbox_consumer::migrate(&pool).await?;
    outbox_consumer::migrate(&consumer_pool).await?;
    let kafka = Kafka::start(&[(TOPIC, PARTITIONS)])?;
    println!("kafka    : {}", kafka.describe());
    // The one configuration (`outbox_config`): the file the `outbox` CLI
    // reads too (`examples/outbox.toml` documents every section). A service
    // reads it with `Config::from_file("outbox.toml")` or, as variables,
    // `Config::from_env()`; here it is written with this run's databases,
    // cluster and keys. Loading validates it: among others, that fulfilment
    // holds the dispatcher's key id and the reconciler fulfilment's.
    let config = outbox_config::Config::from_toml(&config_toml(&db.url(), &consumer_db.url(), &kafka.bootstrap, &source, &signing, &watermark_key))?;
    println!("config   : {} consumer section(s), dispatcher signing key id {}", config.consumer_ids().len(), signing.key_id());
    let broker = Arc::new(KafkaBroker::connect(config.kafka_config()?).await.context("connecting the Kafka adapter")?);
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
    let dispatcher_cfg = config.dispatcher_config()?; // [dispatch], [dispatch.signing]
    let dispatcher = Dispatcher::new(PgStore::new(pool.clone()), broker.clone(), dispatcher_cfg)?;
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
    // [consumer.fulfilment]: only this outbox's messages, and only signed
    // ones (anything else is quarantined before the handler runs); its
    // watermarks go over the broker signed: only it can speak for itself.
    let consumer_cfg = config.consumer_config(fulfilment::CONSUMER_ID)?;
    println!("{} accepts only signed messages from source {source} (key id {}) on {TOPIC}", fulfilment::CONSUMER_ID, signing.key_id());
    let consumer = IdempotentConsumer::new(consumer_cfg.clone(), consumer_pool.clone(), FulfilmentHandler::default())?;
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
    // A record that names fulfilment is applied only when signed with its key.
    let watermark_cfg = config.watermark_topic_config()?.context("[reconcile] reads the watermark topic")?; // [reconcile.watermark_keys]
    let watermarks = WatermarkTopicReader::connect(pool.clone(), watermark_cfg).await?;
    let ingested = watermarks.ingest_once().await?;
    println!(
        "watermark topic {}: read {} records, applied {}, ignored with a finding {}",
        watermarks.config().topic,
        ingested.read,
        ingested.applied,
        ingested.findings()
    );
    println!("    a record of {} is applied only when signed with key id {}", fulfilment::CONSUMER_ID, watermark_key.key_id());
    anyhow::ensure!(ingested.applied > 0 && ingested.findings() == 0, "the consumer's watermarks arrive over the broker");
    let reconciler = Reconciler::new(PgStore::new(pool.clone()), broker.clone(), ReconcilerConfig { owner: "quickstart-reconciler".into(), ..Default::default() })?;
    let (resolved, compared) = reconciler.run_once().await?;
    let report = reconciler.report().await?;
    println!("first event: {} (run with --keep to trace it with the outbox CLI)", event_ids[0]);
    println!("this round: {} unknowns examined, {} messages scanned for bypass publishes\n", resolved.examined, compared.scanned_messages);
    print!("{}", report.to_text());
    anyhow::ensure!(report.findings.is_empty(), "a healthy run has no findings");

    println!("\n== 5. two forged orders written straight to the topic: quarantined, no effect");
    // What anyone allowed to produce to the topic could write: messages whose
    // digests are all right, one naming this outbox but unsigned, one from
    // another outbox, signed with that outbox's own key.
    let other_source = "urn:example:another-service";
    let other_key = ExampleKey::random("another-service-k1")?.signing_key()?;
    let forgeries = [
        (forge(&kafka.bootstrap, &policy, "o-666", &source, None).await?, "names this outbox, unsigned"),
        (forge(&kafka.bootstrap, &policy, "o-667", other_source, Some(&other_key)).await?, "from another outbox"),
    ];
    let consumer = IdempotentConsumer::new(consumer_cfg, consumer_pool.clone(), FulfilmentHandler::default())?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(consumer.run(async move {
        let _ = stop_rx.await;
    }));
    let quarantined = wait_quarantined(&consumer_pool, forgeries.len()).await;
    let _ = stop_tx.send(());
    running.await.context("consumer task")??;
    let quarantined = quarantined?;
    for ((partition, offset), what) in &forgeries {
        let reason = quarantined.iter().find(|(p, o, _)| (p, o) == (partition, offset)).map_or("not quarantined", |(_, _, r)| r.as_str());
        println!("{TOPIC}/{partition}@{offset}  {what}: quarantined {reason}");
    }
    let reasons: Vec<&str> = quarantined.iter().map(|(_, _, r)| r.as_str()).collect();
    anyhow::ensure!(
        reasons.contains(&"verify:signature_missing") && reasons.contains(&"verify:source_unknown"),
        "both forgeries are quarantined for what they are: {reasons:?}"
    );
    let (effects, orders_reserved) = fulfilment::count_effects(&consumer_pool).await?;
    println!("stock reservations: still {effects} effects for {orders_reserved} orders");
    anyhow::ensure!(effects == ORDERS as i64, "a forgery had an effect");
    let _ = Arc::strong_count(&broker);
    Ok(())
}

/// Writes an `order.created.v2` message for `order` to the partition the
/// route prescribes, bypassing the outbox: headers built and sealed as a
/// dispatcher does, naming `source`, signed with `key` if given. Returns
/// (partition, offset).
async fn forge(bootstrap: &str, policy: &RoutePolicy, order: &str, source: &str, key: Option<&SigningKey>) -> anyhow::Result<(i32, i64)> {
    let payload = serde_json::to_vec(&serde_json::json!({ "order": order, "sku": "sku-1", "quantity": 1 }))?;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_millis() as u64;
    let command_key = format!("place-order-{order}");
    let request = EmitRequest {
        command_key: &command_key,
        tenant: "tenant-7",
        aggregate_type: "order",
        aggregate_id: order,
        aggregate_version: 1,
        event_type: "order.created.v2",
        payload_schema: "order-v2",
        payload: &payload,
    };
    let (envelope, destination) = request.freeze(EventId::generate(now), now as i64, 1, policy)?;
    let mut hs = headers::build(&envelope, &destination, &destination.digest(), &AttemptId::generate(now), None);
    seal(&mut hs, source, key)?;
    let headers = hs.iter().fold(OwnedHeaders::new(), |h, (k, v)| h.insert(Header { key: k, value: Some(v) }));
    let producer: FutureProducer = rdkafka::ClientConfig::new().set("bootstrap.servers", bootstrap).set("message.timeout.ms", "10000").create()?;
    let record = FutureRecord::to(&destination.topic).partition(destination.partition).key(&destination.routing_key).payload(&payload).headers(headers);
    let delivered = producer.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e)?;
    Ok((delivered.partition, delivered.offset))
}

/// Waits until the fulfilment consumer has quarantined `n` messages;
/// returns (partition, offset, reason) of each.
async fn wait_quarantined(pool: &PgPool, n: usize) -> anyhow::Result<Vec<(i32, i64, String)>> {
    for _ in 0..600 {
        let rows: Vec<(i32, i64, String)> =
            sqlx::query_as("SELECT partition, \"offset\", reason FROM outbox_consumer_quarantine WHERE consumer_id = $1 ORDER BY partition, \"offset\"")
                .bind(fulfilment::CONSUMER_ID)
                .fetch_all(pool)
                .await?;
        if rows.len() >= n {
            return Ok(rows);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("the fulfilment consumer did not quarantine {n} messages within 60 s")
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

/// The run's `outbox.toml`: the dispatcher signs, fulfilment accepts only
/// signed messages of this outbox and signs its watermark records, the
/// reconciler verifies them. One key format throughout: `{ key_id, secret_hex }`.
fn config_toml(database_url: &str, consumer_database_url: &str, bootstrap: &str, source: &str, signing: &ExampleKey, watermark: &ExampleKey) -> String {
    let (s, w) = (signing.signing_config(), watermark.signing_config());
    let (s_id, s_hex, w_id, w_hex) = (s.key_id, s.secret_hex, w.key_id, w.secret_hex);
    let consumer = fulfilment::CONSUMER_ID;
    format!(
        r#"
database_url = "{database_url}"

[kafka]
bootstrap = "{bootstrap}"
message_timeout_ms = 10000

[dispatch]
name = "quickstart"

[dispatch.signing]
key_id = "{s_id}"
secret_hex = "{s_hex}"

[reconcile.watermark_keys]
{consumer} = [{{ key_id = "{w_id}", secret_hex = "{w_hex}" }}]

[consumer.{consumer}]
database_url = "{consumer_database_url}"
topics = ["{TOPIC}"]
watermark_publish_interval_ms = 500
watermark_signing = {{ key_id = "{w_id}", secret_hex = "{w_hex}" }}
accept = {{ {TOPIC} = ["{source}"] }}
require_signature = ["{TOPIC}"]

[consumer.{consumer}.keys]
"{source}" = [{{ key_id = "{s_id}", secret_hex = "{s_hex}" }}]
"#
    )
}
