//! Dispatch benchmark: `cargo run --release --example dispatch_bench`.
//!
//! Emitters commit orders (transactions of `--txn-events` events, each
//! through one `emit_batch`) spread round-robin over `--keys` routing keys
//! while the dispatcher, with per-key ordering on, publishes them to the in-process
//! Kafka-protocol cluster (or `OUTBOX_KAFKA_BOOTSTRAP`). PostgreSQL commits
//! are durable (`synchronous_commit = on` on every connection).
//!
//! Prints one line:
//! `dispatch events=<n> events_per_s=<x> p50_ms=<a> p99_ms=<b>`
//! where `events_per_s` is events over the wall time from the first commit
//! to the last PUBLISHED, and the latencies are commit -> PUBLISHED
//! (`published_at_ms - created_at_ms` of each event). Comment lines on
//! stderr (`# ...`) add the emitters' rate, the drain rate and, on Linux,
//! the CPU the whole machine spent over the run and per event: machines of
//! one kind differ in speed, and CPU per event travels between them where
//! events/s does not.
//!
//! Options: `--events N` (100000), `--keys K` (1000), `--emitters E` (2),
//! `--txn-events T` (100), `--workers W` (4), `--batch B` (300),
//! `--partitions P` (12); `--preload` (emit everything, then start the
//! dispatcher), `--no-wake` (emit with `wake_dispatcher` off), `--keep-db`.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use outbox_core::{EmitRequest, RoutePolicy};
use outbox_examples::env::{Kafka, ScratchDb};
use outbox_producer::{emit_batch, Dispatcher, DispatcherConfig, EmitOptions, PgStore};

struct Args {
    events: usize,
    keys: usize,
    emitters: usize,
    txn_events: usize,
    workers: usize,
    batch: usize,
    partitions: i32,
    preload: bool,
    keep_db: bool,
    no_wake: bool,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args { events: 100_000, keys: 1_000, emitters: 2, txn_events: 100, workers: 4, batch: 300, partitions: 12, preload: false, keep_db: false, no_wake: false };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--preload" {
            a.preload = true;
            continue;
        }
        if flag == "--keep-db" {
            a.keep_db = true;
            continue;
        }
        if flag == "--no-wake" {
            a.no_wake = true;
            continue;
        }
        let v: usize = it.next().with_context(|| format!("{flag} needs a value"))?.parse().with_context(|| format!("{flag} takes a number"))?;
        match flag.as_str() {
            "--events" => a.events = v,
            "--keys" => a.keys = v.max(1),
            "--emitters" => a.emitters = v.clamp(1, 16),
            "--txn-events" => a.txn_events = v.clamp(1, 10_000),
            "--workers" => a.workers = v,
            "--batch" => a.batch = v,
            "--partitions" => a.partitions = v.clamp(1, 1_000) as i32,
            other => anyhow::bail!("unknown option {other}"),
        }
    }
    Ok(a)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let db = ScratchDb::create("outbox_dispatch_bench", 24).await?;
    let result = run(&args, &db).await;
    if args.keep_db {
        eprintln!("# kept database {}", db.name);
    } else {
        db.drop_now().await?;
    }
    result
}

async fn run(args: &Args, db: &ScratchDb) -> anyhow::Result<()> {
    let pool = db.pool.clone();
    outbox_producer::migrate(&pool).await?;
    let kafka = Kafka::start(&[("orders", args.partitions)])?;
    let broker = kafka
        .broker(|c| {
            c.max_in_flight = 20_000;
            c.message_timeout_ms = 60_000;
        })
        .await?;
    outbox_producer::routes::revise(&pool, &RoutePolicy::new("order.created.v2", broker_cluster(&broker), "orders", args.partitions as u32)).await?;

    let dispatcher = Arc::new(Dispatcher::new(
        PgStore::new(pool.clone()),
        broker.clone(),
        DispatcherConfig { name: "bench".into(), workers: args.workers, batch_size: args.batch, poll_interval_ms: 20, ..Default::default() }.with_env()?,
    )?);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut run = if args.preload { None } else { Some(tokio::spawn(dispatcher.clone().run(outbox_producer::until_true(stop_rx.clone())))) };

    let cpu_at_start = machine_cpu_s();
    let started = Instant::now();
    // Emitter e owns the keys k with k % emitters == e, so each key's
    // versions are committed in order by one emitter.
    let mut emitters = Vec::new();
    for e in 0..args.emitters {
        let pool = pool.clone();
        let (keys, txn_events, total, nemit) = (args.keys, args.txn_events, args.events, args.emitters);
        let options = EmitOptions { wake_dispatcher: !args.no_wake, ..EmitOptions::default() };
        emitters.push(tokio::spawn(async move {
            let payload = br#"{"order":"bench","totalCents":1999,"items":[{"sku":"sku-1","qty":1}]}"#;
            let mine: Vec<usize> = (0..total).filter(|n| (n % keys) % nemit == e).collect();
            for chunk in mine.chunks(txn_events) {
                let ids: Vec<(String, String)> = chunk.iter().map(|n| (format!("o-{}", n % keys), format!("cmd-{n}"))).collect();
                let requests: Vec<EmitRequest> = chunk
                    .iter()
                    .zip(&ids)
                    .map(|(&n, (aggregate_id, command_key))| EmitRequest {
                        command_key,
                        tenant: "tenant-1",
                        aggregate_type: "order",
                        aggregate_id,
                        aggregate_version: (n / keys) as i64,
                        event_type: "order.created.v2",
                        payload_schema: "order-v2",
                        payload,
                    })
                    .collect();
                let mut tx = pool.begin().await?;
                emit_batch(&mut tx, &requests, &options).await?;
                tx.commit().await?;
            }
            anyhow::Ok(())
        }));
    }
    for e in emitters {
        e.await??;
    }
    let emitted_s = started.elapsed().as_secs_f64();
    let drain_started = Instant::now();
    if run.is_none() {
        run = Some(tokio::spawn(dispatcher.clone().run(outbox_producer::until_true(stop_rx))));
    }

    // Progress comes from the dispatcher's own counter, not from a query:
    // polling the database would take CPU from the system being measured.
    // The receipts are counted once, at the end.
    let metrics = dispatcher.metrics();
    loop {
        let published = metrics.published.load(std::sync::atomic::Ordering::Relaxed);
        if published as usize >= args.events {
            break;
        }
        anyhow::ensure!(started.elapsed().as_secs() < 900, "not all events published after 900 s ({published})");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let wall_s = started.elapsed().as_secs_f64();
    let drain_s = drain_started.elapsed().as_secs_f64();
    let cpu_s = cpu_at_start.zip(machine_cpu_s()).map(|(a, b)| b - a);
    stop_tx.send(true)?;
    if let Some(run) = run {
        run.await??;
    }

    let (p50, p99, first, last): (f64, f64, i64, i64) = sqlx::query_as(
        "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY published_at_ms - created_at_ms),
                percentile_cont(0.99) WITHIN GROUP (ORDER BY published_at_ms - created_at_ms),
                min(created_at_ms), max(published_at_ms)
         FROM outbox_events",
    )
    .fetch_one(&pool)
    .await?;
    let receipts: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_publish_receipts").fetch_one(&pool).await?;
    anyhow::ensure!(receipts as usize == args.events, "{receipts} receipts for {} events", args.events);
    let span_s = ((last - first).max(1) as f64) / 1000.0;
    eprintln!(
        "# {} ; emit {:.0} events/s ; wall {:.1} s ; dispatch-only drain {:.0} events/s (meaningful with --preload) ; keys {} ; workers {} ; batch {} ; ordering on",
        kafka.describe(),
        args.events as f64 / emitted_s,
        wall_s,
        args.events as f64 / drain_s,
        args.keys,
        args.workers,
        args.batch
    );
    if let Some(cpu_s) = cpu_s {
        // The whole machine's CPU (PostgreSQL, emitters, dispatcher and the
        // in-process cluster): comparable across machines of different
        // speed where events/s alone is not.
        eprintln!("# machine cpu {cpu_s:.1} s over the run ; {:.0} us of cpu per event", cpu_s * 1e6 / args.events as f64);
    }
    println!("dispatch events={} events_per_s={:.0} p50_ms={:.0} p99_ms={:.0}", args.events, args.events as f64 / span_s, p50, p99);
    Ok(())
}

/// CPU seconds the whole machine has spent busy since boot (user, nice,
/// system, irq, softirq, steal), from Linux's `/proc/stat`, whose unit is
/// USER_HZ (100 per second); `None` elsewhere.
fn machine_cpu_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<f64> = stat.lines().next()?.strip_prefix("cpu ")?.split_whitespace().map(|f| f.parse().unwrap_or(0.0)).collect();
    let busy: f64 = [0, 1, 2, 5, 6, 7].iter().filter_map(|&i| fields.get(i)).sum();
    Some(busy / 100.0)
}

fn broker_cluster(b: &outbox_producer::kafka::KafkaBroker) -> &str {
    b.cluster_id()
}
