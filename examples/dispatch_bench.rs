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
//! dispatcher), `--no-wake` (emit with `wake_dispatcher` off), `--topic-id`
//! (route with the topic's id, as `outbox route set` does: the events
//! freeze `destination.v2`; without it, `destination.v1`), `--keep-db`;
//! `--instances N` (1: N dispatcher instances, each its own `Dispatcher`,
//! store and producer; each one's published count is printed, so an
//! instance that starves shows); `--rate R` (the emitters together offer R
//! events/s, one transaction at a time on a schedule, instead of as fast as
//! they can; a comment line adds commit -> PUBLISHED max); `--hold-snapshot-s
//! S` (a REPEATABLE READ transaction in the bench's database, its snapshot
//! taken by a query, held open for S seconds from the first commit or until
//! the run ends; the outbox tables' and indexes' sizes are printed before
//! and after); `--kafka-setting K=V` (repeatable: a raw librdkafka
//! producer setting, e.g. `linger.ms=0`, given to every instance's adapter,
//! which refuses the settings it relies on). An unknown option is an error.
//!
//! CPU: besides the machine's (which counts everything else running on it
//! too), `# own cpu` counts this process and the PostgreSQL backends of its
//! database (from `/proc/<pid>/stat`, read before and after the run), per
//! event; with `--preload`, the `# drain:` lines count the drain alone.
//!
//! Writes: `# writes:` counts the row writes of the outbox tables over the
//! run (inserts, updates and deletes, from `pg_stat_user_tables`, read
//! after every connection of the run has closed, so that each reported
//! its counters), per event and per table, the share of updates that were
//! HOT, and the WAL the server wrote over the run, per event (the whole
//! server's WAL: keep other work off it while measuring). The result line
//! carries `row_writes_per_event`, `hot_share` and `wal_bytes_per_event`.
//! `--path chains` (the default) is today's claims path over chain heads;
//! `--path stream` sets the database's dispatch path to the insert-only
//! stream (`outbox_producer::set_dispatch_path`) before anything is emitted.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use outbox_core::{EmitRequest, RoutePolicy};
use outbox_examples::cpu::CpuMeter;
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
    instances: usize,
    rate: Option<f64>,
    hold_snapshot_s: Option<u64>,
    topic_id: bool,
    kafka_settings: Vec<(String, String)>,
    stream: bool,
}

/// The outbox tables' write counters and the server's WAL position at one moment.
#[derive(Debug, Clone, Default)]
struct Writes {
    /// (table, inserts, updates, deletes, HOT updates).
    tables: Vec<(String, i64, i64, i64, i64)>,
    wal_lsn: String,
}

impl Writes {
    async fn read(conn: &sqlx::PgPool) -> anyhow::Result<Self> {
        let tables = sqlx::query_as(
            "SELECT relname::text, n_tup_ins, n_tup_upd, n_tup_del, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname LIKE 'outbox\\_%' ORDER BY relname",
        )
        .fetch_all(conn)
        .await?;
        let wal_lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text").fetch_one(conn).await?;
        Ok(Writes { tables, wal_lsn })
    }

    /// What was written from `before` to `self`, as comment lines and the
    /// result line's fields.
    async fn since(&self, before: &Writes, conn: &sqlx::PgPool, events: usize) -> anyhow::Result<(Vec<String>, String)> {
        let was = |t: &str| before.tables.iter().find(|b| b.0 == t).cloned().unwrap_or_default();
        let mut per_table = Vec::new();
        let (mut ins, mut upd, mut del, mut hot) = (0i64, 0i64, 0i64, 0i64);
        for (t, i, u, d, h) in &self.tables {
            let (_, bi, bu, bd, bh) = was(t);
            let (i, u, d, h) = (i - bi, u - bu, d - bd, h - bh);
            if i + u + d > 0 {
                per_table.push(format!("{t} +{i} ~{u} -{d}"));
            }
            (ins, upd, del, hot) = (ins + i, upd + u, del + d, hot + h);
        }
        let wal: i64 = sqlx::query_scalar("SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::bigint").bind(&self.wal_lsn).bind(&before.wal_lsn).fetch_one(conn).await?;
        let n = events.max(1) as f64;
        let hot_share = if upd > 0 { hot as f64 / upd as f64 } else { 0.0 };
        let lines = vec![
            format!(
                "# writes: {:.2} row writes per event ({:.2} inserts, {:.2} updates ({:.0}% HOT), {:.2} deletes) ; WAL {:.0} bytes per event (the whole server's)",
                (ins + upd + del) as f64 / n,
                ins as f64 / n,
                upd as f64 / n,
                hot_share * 100.0,
                del as f64 / n,
                wal as f64 / n
            ),
            format!("# writes by table: {}", per_table.join(" ; ")),
        ];
        Ok((lines, format!(" row_writes_per_event={:.2} hot_share={hot_share:.2} wal_bytes_per_event={:.0}", (ins + upd + del) as f64 / n, wal as f64 / n)))
    }
}

const USAGE: &str = "usage: dispatch_bench [--path chains|stream] [--events N] [--keys K] [--emitters E] [--txn-events T] [--workers W] [--batch B] [--partitions P] \
[--instances N] [--rate EVENTS_PER_S] [--hold-snapshot-s S] [--kafka-setting K=V]... [--preload] [--no-wake] [--topic-id] [--keep-db] [--throwaway-postgres]";

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        events: 100_000,
        keys: 1_000,
        emitters: 2,
        txn_events: 100,
        workers: 4,
        batch: 300,
        partitions: 12,
        preload: false,
        keep_db: false,
        no_wake: false,
        instances: 1,
        rate: None,
        hold_snapshot_s: None,
        topic_id: false,
        kafka_settings: Vec::new(),
        stream: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            "--preload" => a.preload = true,
            "--path" => match it.next().as_deref() {
                Some("chains") => a.stream = false,
                Some("stream") => a.stream = true,
                other => anyhow::bail!("--path takes chains or stream, not {other:?}\n{USAGE}"),
            },
            "--keep-db" => a.keep_db = true,
            "--no-wake" => a.no_wake = true,
            "--topic-id" => a.topic_id = true,
            "--kafka-setting" => {
                let raw = it.next().with_context(|| format!("{flag} needs K=V\n{USAGE}"))?;
                let kv = outbox_producer::kafka::split_setting(&raw)
                    .with_context(|| format!("{flag} takes K=V (the text is not shown: it may be a secret)\n{USAGE}"))?;
                a.kafka_settings.push(kv);
            }
            // Read by ScratchDb::create.
            outbox_examples::env::THROWAWAY_FLAG => {}
            "--events" | "--keys" | "--emitters" | "--txn-events" | "--workers" | "--batch" | "--partitions" | "--instances" | "--rate" | "--hold-snapshot-s" => {
                let raw = it.next().with_context(|| format!("{flag} needs a value\n{USAGE}"))?;
                let v: f64 = raw.parse().ok().filter(|v: &f64| v.is_finite() && *v >= 0.0).with_context(|| format!("{flag} takes a number, not {raw:?}\n{USAGE}"))?;
                let n = v as usize;
                match flag.as_str() {
                    "--events" => a.events = n,
                    "--keys" => a.keys = n.max(1),
                    "--emitters" => a.emitters = n.clamp(1, 16),
                    "--txn-events" => a.txn_events = n.clamp(1, 10_000),
                    "--workers" => a.workers = n,
                    "--batch" => a.batch = n,
                    "--partitions" => a.partitions = n.clamp(1, 1_000) as i32,
                    "--instances" => a.instances = n.clamp(1, 16),
                    "--rate" => a.rate = Some(v).filter(|r| *r > 0.0),
                    _ => a.hold_snapshot_s = Some(n as u64),
                }
            }
            other => anyhow::bail!("unknown option {other}\n{USAGE}"),
        }
    }
    anyhow::ensure!(!(a.preload && a.rate.is_some()), "--preload and --rate exclude each other (a preload emits as fast as it can)\n{USAGE}");
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
    if args.stream {
        outbox_producer::set_dispatch_path(&pool, outbox_producer::DispatchPath::Stream).await?;
    }
    let kafka = Kafka::start(&[("orders", args.partitions)])?;
    let mut dispatchers = Vec::new();
    let mut cluster = None;
    let mut topic_id = None;
    for i in 0..args.instances {
        let broker = kafka
            .broker(|c| {
                c.max_in_flight = 20_000;
                c.message_timeout_ms = 60_000;
                c.extra.extend(args.kafka_settings.iter().cloned());
            })
            .await?;
        cluster.get_or_insert_with(|| broker_cluster(&broker).to_owned());
        if args.topic_id && topic_id.is_none() {
            topic_id = Some(broker.topic_id("orders").await?.context("the cluster gives no topic id")?);
        }
        let name = if args.instances == 1 { "bench".to_owned() } else { format!("bench{i}") };
        dispatchers.push(Arc::new(Dispatcher::new(
            PgStore::new(pool.clone()),
            broker,
            DispatcherConfig { name, workers: args.workers, batch_size: args.batch, poll_interval_ms: 20, ..Default::default() }.with_env()?,
        )?));
    }
    let cluster = cluster.context("no dispatcher instance")?;
    let route = RoutePolicy { topic_id, ..RoutePolicy::new("order.created.v2", &cluster, "orders", args.partitions as u32) };
    outbox_producer::routes::revise(&pool, &route).await?;

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let start_all = |stop_rx: &tokio::sync::watch::Receiver<bool>| -> Vec<_> {
        dispatchers.iter().map(|d| tokio::spawn(d.clone().run(outbox_producer::until_true(stop_rx.clone())))).collect::<Vec<_>>()
    };
    let mut runs = if args.preload { Vec::new() } else { start_all(&stop_rx) };

    // The held snapshot: opened before the first commit, its snapshot taken
    // by a query (REPEATABLE READ takes it at the first statement, not at
    // BEGIN), held until `hold` has passed or the run ends.
    let (release_tx, release_rx) = tokio::sync::watch::channel(false);
    let holder = match args.hold_snapshot_s {
        Some(s) => {
            eprintln!("# sizes before: {}", table_sizes(&pool).await?);
            let mut conn = pool.acquire().await?.detach();
            sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ").execute(&mut conn).await?;
            sqlx::query("SELECT count(*) FROM outbox_events").execute(&mut conn).await?;
            let mut release_rx = release_rx.clone();
            Some(tokio::spawn(async move {
                let held = Instant::now();
                tokio::select! {
                    _ = tokio::time::sleep(std::time::Duration::from_secs(s)) => {}
                    _ = release_rx.wait_for(|r| *r) => {}
                }
                sqlx::query("ROLLBACK").execute(&mut conn).await?;
                anyhow::Ok(held.elapsed().as_secs_f64())
            }))
        }
        None => None,
    };

    let writes_before = Writes::read(&pool).await?;
    let meter = CpuMeter::start(&pool).await;
    let started = Instant::now();
    // Emitter e owns the keys k with k % emitters == e, so each key's
    // versions are committed in order by one emitter. With a rate, emitter e
    // commits its j-th transaction at (j * emitters + e) * txn_events / rate
    // seconds from the start (or at once, when behind).
    let mut emitters = Vec::new();
    for e in 0..args.emitters {
        let pool = pool.clone();
        let (keys, txn_events, total, nemit, rate) = (args.keys, args.txn_events, args.events, args.emitters, args.rate);
        let options = EmitOptions { wake_dispatcher: !args.no_wake, ..EmitOptions::default() };
        emitters.push(tokio::spawn(async move {
            let payload = br#"{"order":"bench","totalCents":1999,"items":[{"sku":"sku-1","qty":1}]}"#;
            let mine: Vec<usize> = (0..total).filter(|n| (n % keys) % nemit == e).collect();
            for (j, chunk) in mine.chunks(txn_events).enumerate() {
                if let Some(rate) = rate {
                    let due = started + std::time::Duration::from_secs_f64((j * nemit + e) as f64 * txn_events as f64 / rate);
                    tokio::time::sleep_until(due.into()).await;
                }
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
    let drain_meter = if args.preload { Some(CpuMeter::start(&pool).await) } else { None };
    if runs.is_empty() {
        runs = start_all(&stop_rx);
    }

    // Progress comes from the dispatchers' own counters, not from a query:
    // polling the database would take CPU from the system being measured.
    // The receipts are counted once, at the end.
    let published = || -> u64 { dispatchers.iter().map(|d| d.metrics().published.load(std::sync::atomic::Ordering::Relaxed)).sum() };
    loop {
        let n = published();
        if n as usize >= args.events {
            break;
        }
        anyhow::ensure!(started.elapsed().as_secs() < 1800, "not all events published after 1800 s ({n})");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let wall_s = started.elapsed().as_secs_f64();
    let drain_s = drain_started.elapsed().as_secs_f64();
    let spent = meter.finish(&pool).await;
    let drain_spent = match &drain_meter {
        Some(m) => Some(m.finish(&pool).await),
        None => None,
    };
    release_tx.send(true)?;
    let held_s = match holder {
        Some(h) => Some(h.await??),
        None => None,
    };
    stop_tx.send(true)?;
    for run in runs {
        run.await??;
    }

    let (p50, p99, max, first, last): (f64, f64, i64, i64, i64) = sqlx::query_as(
        // Events of the lane (and the chains path), and of the stream: published by their receipt.
        "WITH t AS (
            SELECT created_at_ms AS c, published_at_ms AS p FROM outbox_events WHERE published_at_ms IS NOT NULL
            UNION ALL
            SELECT s.created_at_ms, r.accepted_at_ms FROM outbox_stream s
            JOIN outbox_publish_receipts r ON r.event_id = s.event_id AND r.envelope_generation = 1
            WHERE NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = s.event_id))
         SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY p - c), percentile_cont(0.99) WITHIN GROUP (ORDER BY p - c),
                max(p - c), min(c), max(p)
         FROM t",
    )
    .fetch_one(&pool)
    .await?;
    let receipts: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_publish_receipts").fetch_one(&pool).await?;
    anyhow::ensure!(receipts as usize == args.events, "{receipts} receipts for {} events", args.events);
    let span_s = ((last - first).max(1) as f64) / 1000.0;
    // Every connection of the run reports its write counters when it
    // closes; a fresh one reads them.
    let options = (*pool.connect_options()).clone();
    pool.close().await;
    let reader = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect_with(options).await?;
    let (write_lines, write_fields) = Writes::read(&reader).await?.since(&writes_before, &reader, args.events).await?;
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
    // CPU per event: comparable across machines of different speed where
    // events/s alone is not (outbox_examples::cpu).
    for line in spent.lines(args.events) {
        eprintln!("{line}");
    }
    if let Some(d) = drain_spent {
        for line in d.lines(args.events) {
            eprintln!("{}", line.replacen("# ", "# drain: ", 1));
        }
    }
    if let Some(rate) = args.rate {
        eprintln!("# offered {rate:.0} events/s ; commit -> PUBLISHED p50 {p50:.0} ms, p99 {p99:.0} ms, max {max} ms");
    }
    {
        // Claims: how full the batches were, and how they were found.
        let sum = |f: fn(&outbox_producer::dispatcher::DispatchMetrics) -> u64| -> u64 { dispatchers.iter().map(|d| f(&d.metrics())).sum() };
        let (batches, claimed) = (sum(|m| m.batches.load(std::sync::atomic::Ordering::Relaxed)), sum(|m| m.claimed.load(std::sync::atomic::Ordering::Relaxed)));
        eprintln!(
            "# batches {batches} ; {:.0} events claimed per batch (limit {}) ; successor claims {} ; head scans {}",
            claimed as f64 / batches.max(1) as f64,
            args.batch,
            sum(|m| m.successor_claims.load(std::sync::atomic::Ordering::Relaxed)),
            sum(|m| m.head_scans.load(std::sync::atomic::Ordering::Relaxed))
        );
    }
    {
        // Where a batch's time goes: the mean of each phase over every
        // instance (a claim waits for the instance's claim turn).
        let mean = |f: fn(&outbox_producer::observe::DispatchHistograms) -> (f64, u64)| -> f64 {
            let (sum, count) = dispatchers.iter().map(|d| f(&d.metrics().histograms)).fold((0.0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
            1_000.0 * sum / count.max(1) as f64
        };
        eprintln!(
            "# phases (mean ms): claim {:.1} ; receipt transaction {:.1} ; batch (claim to last answer) {:.1}",
            mean(|h| (h.claim.get_sample_sum(), h.claim.get_sample_count())),
            mean(|h| (h.receipt_transaction.get_sample_sum(), h.receipt_transaction.get_sample_count())),
            mean(|h| (h.batch.get_sample_sum(), h.batch.get_sample_count())),
        );
    }
    if args.instances > 1 {
        let counts: Vec<String> = dispatchers.iter().enumerate().map(|(i, d)| format!("bench{i}={}", d.metrics().published.load(std::sync::atomic::Ordering::Relaxed))).collect();
        eprintln!("# published per instance: {}", counts.join(" "));
    }
    for line in &write_lines {
        eprintln!("{line}");
    }
    if let Some(held_s) = held_s {
        eprintln!("# held a REPEATABLE READ snapshot for {held_s:.1} s");
        eprintln!("# sizes after: {}", table_sizes(&reader).await?);
    }
    println!("dispatch events={} events_per_s={:.0} p50_ms={:.0} p99_ms={:.0}{write_fields}", args.events, args.events as f64 / span_s, p50, p99);
    Ok(())
}

/// The outbox tables' sizes (heap, and all of their indexes), kB.
async fn table_sizes(pool: &sqlx::PgPool) -> anyhow::Result<String> {
    let rows: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT c.relname::text, pg_relation_size(c.oid) / 1024, pg_indexes_size(c.oid) / 1024 FROM pg_class c
         WHERE c.relkind = 'r' AND c.relname IN ('outbox_events', 'outbox_chain_heads', 'outbox_chain_arrivals', 'outbox_attempts',
                                                 'outbox_envelopes', 'outbox_publish_receipts', 'outbox_commands', 'outbox_stream_p0',
                                                 'outbox_bucket_slots', 'outbox_bucket_lease_log', 'outbox_batches', 'outbox_batch_steps')
         ORDER BY c.relname",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows.iter().map(|(t, heap, idx)| format!("{t} {heap} kB + indexes {idx} kB")).collect::<Vec<_>>().join(" ; "))
}

fn broker_cluster(b: &outbox_producer::kafka::KafkaBroker) -> &str {
    b.cluster_id()
}
