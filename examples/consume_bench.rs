//! Consumer throughput: N verified events through the idempotent consumer,
//! each with its receipt committed durably in PostgreSQL.
//!
//! ```text
//! cargo run --release --example consume_bench [N]
//! ```
//! Prints one line: `consume events=<n> events_per_s=<x>`; comment lines on
//! stderr (`# ...`) add the CPU the machine, the bench process and its
//! database's PostgreSQL backends spent while the consumer ran, per event
//! (`outbox_examples::cpu`).
//!
//! * N: first argument, else `OUTBOX_BENCH_EVENTS`, else 100000.
//! * `OUTBOX_BENCH_PARTITIONS`: partitions of the topic. Default: enough
//!   that each partition holds at most ~3.5 MiB, because the mock cluster
//!   keeps only 5 MiB (or 100000 messages) per partition and silently drops
//!   the oldest beyond that; the bench refuses to run if the log start moved.
//! * `OUTBOX_BENCH_BATCH` (default 1000): `max_batch_messages`.
//! * `OUTBOX_BENCH_HANDLER`: `receipt` (default; the handler returns a small
//!   result, the receipt is the only write) or `fulfilment` (one
//!   `stock_reservations` insert per event as well).
//!
//! The events are produced first (outbox-core envelopes and headers, frozen
//! partition and key, as a dispatcher sends them) to an in-process Kafka mock
//! cluster. The clock starts when the consumer receives its first message
//! (after the group join) and stops when every event's receipt has committed.
//! PostgreSQL runs with `synchronous_commit = on`; a throwaway database
//! `outbox_bench_<pid>` is created and dropped. Every receipt is checked at
//! the end.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use outbox_consumer::{async_trait, ConsumedEvent, ConsumerConfig, Handler, HandlerError, IdempotentConsumer};
use outbox_core::{headers, AttemptId, EmitRequest, EventId, RoutePolicy};
use outbox_examples::cpu::CpuMeter;
use outbox_examples::env::ScratchDb;
use outbox_examples::fulfilment;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{json, Value};
use sqlx::{Postgres, Transaction};

const TOPIC: &str = "orders";
const EVENT_TYPE: &str = "order.created.v2";

/// The receipt is the state: the handler only returns a result.
struct ReceiptOnly;

#[async_trait]
impl Handler for ReceiptOnly {
    async fn handle(&self, _tx: &mut Transaction<'_, Postgres>, e: &ConsumedEvent) -> Result<Value, HandlerError> {
        Ok(json!({ "offset": e.offset }))
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> anyhow::Result<T> {
    match std::env::var(name) {
        Ok(v) => v.parse().map_err(|_| anyhow::anyhow!("{name}={v:?} is not valid")),
        Err(_) => Ok(default),
    }
}

/// Largest log the bench puts in one partition of the mock cluster (which
/// keeps 5 MiB per partition and drops older messages).
const MAX_PARTITION_BYTES: usize = 3_500_000;

/// One event, before its partition count is known.
struct Event {
    order: String,
    payload: Vec<u8>,
    /// Approximate bytes on the log (payload, key, headers).
    size: usize,
}

fn build_messages(n: usize) -> anyhow::Result<Vec<Event>> {
    (0..n)
        .map(|i| {
            let order = format!("o-{i}");
            let payload = serde_json::to_vec(&json!({ "order": order, "sku": format!("sku-{}", i % 97), "quantity": 1 + i % 5 }))?;
            // Headers of a typical event: ~700 bytes (measured once below).
            let size = payload.len() + 760;
            Ok(Event { order, payload, size })
        })
        .collect()
}

async fn produce(bootstrap: &str, events: Vec<Event>, partitions: u32) -> anyhow::Result<()> {
    let policy = RoutePolicy::new(EVENT_TYPE, "mock", TOPIC, partitions);
    let now = 1_800_000_000_000u64;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("linger.ms", "5")
        .set("batch.num.messages", "10000")
        .set("queue.buffering.max.messages", "1000000")
        .set("queue.buffering.max.kbytes", "1048576")
        .create()?;
    let mut pending = Vec::with_capacity(10_000);
    for (i, e) in events.iter().enumerate() {
        let req = EmitRequest {
            command_key: &e.order,
            tenant: "tenant-1",
            aggregate_type: "order",
            aggregate_id: &e.order,
            aggregate_version: 1,
            event_type: EVENT_TYPE,
            payload_schema: "order-v2",
            payload: &e.payload,
        };
        let (envelope, destination) = req.freeze(EventId::generate(now + i as u64), (now + i as u64) as i64, i as u64, &policy)?;
        let hs = headers::build(&envelope, &destination, &destination.digest(), &AttemptId::generate(now), None);
        if i == 0 {
            let actual: usize = hs.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>() + destination.routing_key.len();
            ensure!(actual <= 760, "headers grew to {actual} bytes: raise the size estimate");
        }
        let mut h = OwnedHeaders::new();
        for (k, v) in &hs {
            h = h.insert(Header { key: k, value: Some(v) });
        }
        let rec = FutureRecord::to(TOPIC).partition(destination.partition).key(&destination.routing_key).payload(&e.payload).headers(h);
        pending.push(producer.send_result(rec).map_err(|(e, _)| e)?);
        if pending.len() >= 10_000 {
            for d in pending.drain(..) {
                d.await?.map_err(|(e, _)| e)?;
            }
        }
    }
    for d in pending {
        d.await?.map_err(|(e, _)| e)?;
    }
    Ok(())
}

/// Every produced message is still in the log (the mock's retention kept it).
fn check_nothing_dropped(bootstrap: &str, partitions: u32, n: usize) -> anyhow::Result<()> {
    let c: BaseConsumer = ClientConfig::new().set("bootstrap.servers", bootstrap).create()?;
    let mut total = 0i64;
    for p in 0..partitions as i32 {
        let (low, high) = c.fetch_watermarks(TOPIC, p, Duration::from_secs(10))?;
        ensure!(low == 0, "the mock cluster dropped the first {low} messages of partition {p} (5 MiB per partition): use more partitions");
        total += high;
    }
    ensure!(total == n as i64, "{total} messages in the topic, {n} produced");
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Silent unless RUST_LOG asks for more.
    let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "error".into())).with_writer(std::io::stderr).try_init();
    let n: usize = match std::env::args().nth(1) {
        Some(a) => a.parse().with_context(|| format!("event count {a:?}"))?,
        None => env_or("OUTBOX_BENCH_EVENTS", 100_000)?,
    };
    ensure!((1..=10_000_000).contains(&n), "event count {n} (1..=10000000)");
    let messages = build_messages(n)?;
    let bytes: usize = messages.iter().map(|m| m.size).sum();
    let needed = u32::try_from(bytes.div_ceil(MAX_PARTITION_BYTES)).unwrap_or(u32::MAX).max(4);
    let partitions: u32 = env_or("OUTBOX_BENCH_PARTITIONS", needed)?;
    ensure!((1..=256).contains(&partitions), "partitions {partitions} (1..=256)");
    let batch: usize = env_or("OUTBOX_BENCH_BATCH", 1_000)?;
    let handler_kind: String = env_or("OUTBOX_BENCH_HANDLER", "receipt".to_owned())?;

    let db = ScratchDb::create("outbox_bench", partitions + 4).await?;
    let pool = db.pool.clone();

    let mock = MockCluster::new(1).context("mock cluster")?;
    mock.create_topic(TOPIC, partitions as i32, 1)?;
    let bootstrap = mock.bootstrap_servers();

    let result = bench(&pool, &bootstrap, messages, partitions, batch, &handler_kind).await;
    db.drop_now().await?;
    drop(mock);
    let rate = result?;
    println!("consume events={n} events_per_s={rate:.0}");
    Ok(())
}

async fn bench(pool: &sqlx::PgPool, bootstrap: &str, messages: Vec<Event>, partitions: u32, batch: usize, handler_kind: &str) -> anyhow::Result<f64> {
    let n = messages.len();
    outbox_consumer::migrate(pool).await?;
    let sync: String = sqlx::query_scalar("SHOW synchronous_commit").fetch_one(pool).await?;
    ensure!(sync == "on", "synchronous_commit is {sync}");
    produce(bootstrap, messages, partitions).await?;
    check_nothing_dropped(bootstrap, partitions, n)?;

    let mut cfg = ConsumerConfig::new("bench", bootstrap, &[TOPIC]);
    cfg.max_batch_messages = batch;
    cfg.max_buffered_per_partition = (batch * 4).max(1_000);
    let consumer = match handler_kind {
        "receipt" => IdempotentConsumer::new(cfg, pool.clone(), ReceiptOnly)?,
        "fulfilment" => {
            fulfilment::create_tables(pool).await?;
            IdempotentConsumer::new(cfg, pool.clone(), fulfilment::FulfilmentHandler::default())?
        }
        other => bail!("OUTBOX_BENCH_HANDLER={other:?} (receipt or fulfilment)"),
    };
    let metrics = consumer.metrics();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run(async move {
        let _ = stop_rx.await;
    }));

    let deadline = Instant::now() + Duration::from_secs(60);
    while metrics.received.load(Ordering::Relaxed) == 0 {
        ensure!(Instant::now() < deadline && !task.is_finished(), "the consumer received nothing");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let start = Instant::now();
    let meter = CpuMeter::start(pool).await;
    let (mut last, mut last_change) = (0, Instant::now());
    loop {
        let decided = metrics.snapshot().decided();
        if decided >= n as u64 {
            break;
        }
        if decided != last {
            (last, last_change) = (decided, Instant::now());
        }
        ensure!(last_change.elapsed() < Duration::from_secs(30) && !task.is_finished(), "consumer stalled at {:?}", metrics.snapshot());
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = start.elapsed();
    for line in meter.finish(pool).await.lines(n) {
        eprintln!("{line}");
    }
    let _ = stop_tx.send(());
    task.await??;

    let m = metrics.snapshot();
    ensure!(m.applied == n as u64 && m.quarantined == 0 && m.dead_lettered == 0, "unexpected outcomes {m:?}");
    let receipts: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_consumer_receipts").fetch_one(pool).await?;
    ensure!(receipts == n as i64, "{receipts} receipts for {n} events");
    Ok(n as f64 / elapsed.as_secs_f64())
}
