//! `Dispatcher::run`, the service: two instances publish every event
//! exactly once, parallel workers keep each key's commit order, a graceful
//! shutdown settles every started send, and the clock-skew gauge reads the
//! host's offset. Real PostgreSQL and librdkafka's in-process Kafka cluster.

use std::sync::Arc;
use std::time::Duration;

use outbox_producer::{Dispatcher, DispatcherConfig, PgStore};
use outbox_tests::dispatch::{config, each_once_in_log, emit_many, keys_in_commit_order, run_two_dispatchers, started};
use outbox_tests::*;
use sqlx::PgPool;

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn two_dispatcher_instances_publish_every_event_exactly_once(pool: PgPool) {
    let (cluster, _probe) = started(&pool, 5_000).await;
    let ids = emit_many(&pool, 3_000, 1).await;
    run_two_dispatchers(&pool, &cluster, 3_000, config("d")).await;

    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").await, 3_000);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_publish_receipts").await, 3_000);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_duplicate_receipts").await, 0);
    let owners: Vec<(String, i64)> = sqlx::query_as("SELECT split_part(owner, '-', 1), count(*) FROM outbox_attempts GROUP BY 1 ORDER BY 1").fetch_all(&pool).await.unwrap();
    assert_eq!(owners.len(), 2, "both instances worked: {owners:?}");
    // Neither instance's claims stall behind the other's: when a claim had
    // to re-check rows the other instance had just claimed, it used to wait
    // seconds while the other drained nearly everything.
    // (With the stall, the starved instance got one or two batches of 100;
    // shared fairly, each gets about half.)
    assert!(owners.iter().all(|(_, n)| *n >= 300), "each instance sent at least a tenth of the events: {owners:?}");
    assert_eq!(ids.len(), 3_000);
    each_once_in_log(&cluster, &ids);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn parallel_workers_keep_each_keys_commit_order_in_the_log(pool: PgPool) {
    let (cluster, _probe) = started(&pool, 5_000).await;
    let ids = emit_many(&pool, 20, 25).await;
    let cfg = DispatcherConfig { workers: 3, batch_size: 7, ..config("d") };
    run_two_dispatchers(&pool, &cluster, ids.len() as i64, cfg).await;

    assert_eq!(keys_in_commit_order(&pool, &cluster).await, 20);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn graceful_shutdown_stops_claiming_and_settles_every_started_send(pool: PgPool) {
    let (_cluster, broker) = started(&pool, 10_000).await;
    emit_many(&pool, 2_000, 1).await;
    let d = Arc::new(Dispatcher::new(PgStore::new(pool.clone()), broker, DispatcherConfig { batch_size: 50, ..config("d") }).unwrap());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let run = tokio::spawn(d.clone().run(outbox_producer::until_true(stop_rx)));
    // Stop in the middle of the backlog.
    wait_count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'", 100, Duration::from_secs(60)).await;
    stop_tx.send(true).unwrap();
    let total = run.await.unwrap().unwrap();
    let published = count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").await;
    assert!(published < 2_000, "shutdown came too late to test anything ({published})");
    assert_eq!(total.published as i64, published, "every started send was settled and recorded");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events WHERE state IN ('CLAIMED', 'SENDING')").await, 0, "no claim left behind");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_attempts WHERE state = 'SENDING'").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PENDING'").await, 2_000 - published);
    // Nothing is claimed after the stop.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").await, published);
}

/// The system clock moved by a fixed amount: a host whose clock is off.
#[derive(Debug)]
struct ShiftedClock(i64);

impl outbox_core::Clock for ShiftedClock {
    fn now_ms(&self) -> i64 {
        outbox_core::SystemClock.now_ms() + self.0
    }
}

/// A dispatcher on a host whose clock is ahead of or behind PostgreSQL's
/// reports by how much, with its sign, in its skew gauge.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_host_clock_off_from_the_database_shows_in_the_skew_gauge(pool: PgPool) {
    let (_cluster, broker) = started(&pool, 5_000).await;
    for shift in [120_000i64, -45_000, 0] {
        let store = PgStore::with_clock(pool.clone(), Arc::new(ShiftedClock(shift)));
        let d = Arc::new(Dispatcher::new(store, broker.clone(), config("skew")).unwrap());
        let gauge = d.metrics();
        gauge.clock_skew_ms.store(i64::MIN, std::sync::atomic::Ordering::Relaxed);
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let run = tokio::spawn(d.clone().run(outbox_producer::until_true(stop_rx)));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let skew = loop {
            let skew = gauge.clock_skew_ms.load(std::sync::atomic::Ordering::Relaxed);
            if skew != i64::MIN {
                break skew;
            }
            assert!(tokio::time::Instant::now() < deadline, "the skew was never measured");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        stop_tx.send(true).unwrap();
        run.await.unwrap().unwrap();
        assert!((skew - shift).abs() < 2_000, "clock shifted by {shift} ms, measured {skew} ms");
    }
}
