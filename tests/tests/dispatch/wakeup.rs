//! When a running dispatcher looks for work: at once after a short claim of
//! a backlog, and on every commit through LISTEN/NOTIFY, also when its
//! LISTEN session is killed and replaced. Real PostgreSQL and librdkafka's
//! in-process Kafka cluster.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::EventState;
use outbox_producer::{Dispatcher, DispatcherConfig, EmitOptions, PgStore};
use outbox_tests::dispatch::{config, emit_many, started, state_of};
use outbox_tests::kafka::TestCluster;
use outbox_tests::*;
use sqlx::PgPool;

/// A backlog on fewer keys than the batch size: every claim is short (one
/// head per key), yet the workers keep claiming without waiting for the
/// poll interval; only an empty claim waits.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn short_claims_of_a_backlog_do_not_wait_for_the_poll_interval(pool: PgPool) {
    let (_cluster, broker) = started(&pool, 10_000).await;
    emit_many(&pool, 4, 15).await;
    // 60 events on 4 keys: each claim finds at most 4 heads; nothing wakes
    // the workers but their own loop (no LISTEN, a 60 s poll).
    let cfg = DispatcherConfig { workers: 2, batch_size: 100, poll_interval_ms: 60_000, listen: false, ..config("short") };
    let d = Arc::new(Dispatcher::new(PgStore::new(pool.clone()), broker, cfg).unwrap());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let run = tokio::spawn(d.clone().run(outbox_producer::until_true(stop_rx)));
    wait_count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'", 60, Duration::from_secs(20)).await;
    stop_tx.send(true).unwrap();
    let total = run.await.unwrap().unwrap();
    assert_eq!(total.published, 60, "{total:?}");
    assert!(d.metrics().batches.load(std::sync::atomic::Ordering::Relaxed) >= 15, "one head per key per claim: at least 15 batches");
}

/// The sessions of this test's database that LISTEN (a `FROM ... WHERE` clause).
const LISTENING: &str = "FROM pg_stat_activity WHERE query LIKE 'LISTEN%' AND datname = current_database()";

/// A running one-worker dispatcher that only a notification can wake
/// within a test (a 10 min poll), once its LISTEN session is up.
async fn listening_dispatcher(pool: &PgPool) -> (TestCluster, tokio::sync::watch::Sender<bool>, tokio::task::JoinHandle<Result<outbox_producer::BatchReport, outbox_producer::ProducerError>>) {
    let (cluster, broker) = started(pool, 5_000).await;
    let cfg = DispatcherConfig { workers: 1, poll_interval_ms: 600_000, listen: true, ..config("listen") };
    let d = Arc::new(Dispatcher::new(PgStore::new(pool.clone()), broker, cfg).unwrap());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let run = tokio::spawn(d.run(outbox_producer::until_true(stop_rx)));
    wait_count(pool, &format!("SELECT count(*) {LISTENING}"), 1, Duration::from_secs(10)).await;
    (cluster, stop_tx, run)
}

/// The session that LISTENs for `outbox_pending` is killed (as a restart or
/// failover kills it): the dispatcher listens again on a new one, and a
/// later commit still wakes it at once, not after the poll interval.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_killed_listen_session_is_replaced_and_commits_still_wake_the_dispatcher(pool: PgPool) {
    let (_cluster, stop_tx, run) = listening_dispatcher(&pool).await;
    let first = create_order(&pool, "o-1", 1).await;
    wait_count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'", 1, Duration::from_secs(10)).await;

    let old: i32 = sqlx::query_scalar(&format!("SELECT pid {LISTENING}")).fetch_one(&pool).await.unwrap();
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)").bind(old).fetch_one(&pool).await.unwrap();
    assert!(killed);
    // Another session listens again.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let pids: Vec<i32> = sqlx::query_scalar(&format!("SELECT pid {LISTENING}")).fetch_all(&pool).await.unwrap();
        if pids.iter().any(|p| *p != old) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "nobody LISTENs again after the session was killed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let second = create_order(&pool, "o-2", 2).await;
    wait_count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'", 2, Duration::from_secs(15)).await;
    stop_tx.send(true).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(state_of(&pool, first.event_id().as_str()).await, EventState::Published);
    assert_eq!(state_of(&pool, second.event_id().as_str()).await, EventState::Published);
}

/// An event committed while the LISTEN session is being replaced (its
/// notification goes to a session that is gone) is still dispatched at
/// once: after listening again, the dispatcher looks for work it may not
/// have been told about.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn an_event_committed_while_listen_is_replaced_is_not_left_to_the_poll(pool: PgPool) {
    let (_cluster, stop_tx, run) = listening_dispatcher(&pool).await;
    // Let the workers' first (empty) claim pass: from here only a wake-up moves them.
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The commit lands while the listening session is being terminated.
    let mut tx = pool.begin().await.unwrap();
    let payload = order_payload("o-gap", 1);
    let e = outbox_producer::emit(&mut tx, &order_request("c-gap", "o-gap", &payload), &EmitOptions::default()).await.unwrap();
    sqlx::query(&format!("SELECT pg_terminate_backend(pid) {LISTENING}")).execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();

    wait_count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'", 1, Duration::from_secs(15)).await;
    stop_tx.send(true).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(state_of(&pool, e.event_id().as_str()).await, EventState::Published);
}
