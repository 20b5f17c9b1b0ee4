//! The dispatcher under database faults: connections cut off mid-receipt
//! or mid-renewal, COMMIT answers lost after the commit, sessions killed at
//! random; nothing is lost or sent twice. Real PostgreSQL and librdkafka's
//! in-process Kafka cluster, each test injecting the real fault.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{Broker, RetryPolicy};
use outbox_producer::{Dispatcher, DispatcherConfig, PgStore, Reconciler, ReconcilerConfig};
use outbox_tests::dispatch::{config, each_once_in_log, emit_many, keys_in_commit_order, started};
use outbox_tests::kafka::TestCluster;
use outbox_tests::pg_proxy::CommitCutter;
use outbox_tests::*;
use sqlx::PgPool;

/// A session of its own, in a transaction that holds the lock `lock_sql`
/// takes, and its backend pid.
async fn holding(pool: &PgPool, lock_sql: &str) -> (sqlx::Transaction<'static, sqlx::Postgres>, i32) {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(lock_sql).execute(&mut *tx).await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *tx).await.unwrap();
    (tx, pid)
}

/// Terminates the backend that waits for `blocker`'s lock, once one does,
/// as a lost connection, a restart or a failover would cut it off; its
/// statement is returned.
async fn kill_the_session_waiting_for(pool: &PgPool, blocker: i32) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let waiting: Option<(i32, String)> = sqlx::query_as("SELECT pid, query FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))")
            .bind(blocker)
            .fetch_optional(pool)
            .await
            .unwrap();
        if let Some((pid, query)) = waiting {
            let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)").bind(pid).fetch_one(pool).await.unwrap();
            assert!(killed, "backend {pid} could not be terminated");
            return query;
        }
        assert!(tokio::time::Instant::now() < deadline, "no session ever waited for backend {blocker}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Every event PUBLISHED by the one attempt it was sent with, with one
/// primary receipt, and in the log exactly once.
async fn published_once_each(pool: &PgPool, cluster: &TestCluster, ids: &[String]) {
    let n = ids.len() as i64;
    assert_eq!(count(pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").await, n);
    assert_eq!(count(pool, "SELECT count(*) FROM outbox_attempts WHERE state = 'ACKED'").await, n);
    assert_eq!(count(pool, "SELECT count(*) FROM outbox_attempts").await, n, "an event was sent twice");
    assert_eq!(count(pool, "SELECT count(DISTINCT event_id) FROM outbox_publish_receipts").await, n);
    each_once_in_log(cluster, ids);
}

/// The receipt transaction's connection is cut off (its backend
/// terminated, as by a restart or failover) after the broker ACKed the
/// batch: the batch records the ACKs again on a new connection instead
/// of dropping them, so no event is left for its lease to turn
/// DISPATCH_UNKNOWN and nothing is sent twice.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn receipts_cut_off_by_a_lost_connection_are_recorded_on_a_new_one(pool: PgPool) {
    let (cluster, broker) = started(&pool, 5_000).await;
    let ids = emit_many(&pool, 20, 1).await;
    let d = Arc::new(Dispatcher::new(PgStore::new(pool.clone()), broker, config("d")).unwrap());
    // Receipts wait to be inserted while this session holds the table.
    let (blocker, blocker_pid) = holding(&pool, "LOCK TABLE outbox_publish_receipts IN SHARE MODE").await;
    let batch = tokio::spawn({
        let d = d.clone();
        async move { d.dispatch_once("w1").await }
    });
    let killed = kill_the_session_waiting_for(&pool, blocker_pid).await;
    assert!(killed.contains("outbox_publish_receipts"), "not the receipt transaction: {killed}");
    // The next try waits for the lock again; then PostgreSQL is back.
    tokio::time::sleep(Duration::from_millis(300)).await;
    blocker.rollback().await.unwrap();

    let r = batch.await.unwrap().expect("the batch records its ACKs after losing its connection");
    assert_eq!((r.sent, r.published, r.unknown), (20, 20, 0), "{r:?}");
    assert!(d.metrics().store_retries.load(std::sync::atomic::Ordering::Relaxed) >= 1);
    published_once_each(&pool, &cluster, &ids).await;
}

/// A lease renewal cut off while the batch's sends are outstanding does not
/// abandon the batch: the broker's ACKs, arriving after it, are recorded.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_lease_renewal_cut_off_mid_batch_still_records_the_acks(pool: PgPool) {
    let (cluster, broker) = started(&pool, 10_000).await;
    // Lease 1 s: the batch renews every 500 ms while the ACKs take 2 s.
    let d = Arc::new(Dispatcher::new(PgStore::new(pool.clone()), broker, DispatcherConfig { lease_ms: 1_000, ..config("d") }).unwrap());
    // Warm the connection and metadata, so the next Produce request really goes out.
    let mut ids = emit_many(&pool, 1, 1).await;
    assert_eq!(d.dispatch_once("w0").await.unwrap().published, 1);
    let mut batch_ids = Vec::new();
    for o in 0..10 {
        batch_ids.push(create_order(&pool, &format!("r-{o}"), 1).await.event_id().to_string());
    }
    ids.extend(batch_ids.iter().cloned());
    cluster.mock.as_ref().expect("this fault needs the mock cluster").broker_round_trip_time(1, Duration::from_millis(2_000)).unwrap();

    let batch = tokio::spawn({
        let d = d.clone();
        async move { d.dispatch_once("w1").await }
    });
    // Once the attempts are registered (the sends are out), hold the rows
    // the renewal updates.
    wait_count(&pool, "SELECT count(*) FROM outbox_attempts WHERE state = 'SENDING'", 10, Duration::from_secs(10)).await;
    let lock = format!("SELECT 1 FROM outbox_events WHERE event_id IN ('{}') FOR UPDATE", batch_ids.join("','"));
    let (blocker, blocker_pid) = holding(&pool, &lock).await;
    let killed = kill_the_session_waiting_for(&pool, blocker_pid).await;
    assert!(killed.contains("lease_until_ms"), "not the lease renewal: {killed}");
    blocker.rollback().await.unwrap();

    let r = batch.await.unwrap().expect("the batch outlives a failed lease renewal");
    assert_eq!((r.sent, r.published, r.unknown), (10, 10, 0), "{r:?}");
    assert!(d.metrics().store_retries.load(std::sync::atomic::Ordering::Relaxed) >= 1);
    cluster.mock.as_ref().unwrap().broker_round_trip_time(1, Duration::ZERO).unwrap();
    published_once_each(&pool, &cluster, &ids).await;
}

/// Two dispatcher instances run while their PostgreSQL sessions are killed
/// at random, mid-statement or mid-transaction, every 40 ms (as a flapping
/// network or a failover would), with a reconciler for what the kills leave
/// unknown. Every event ends PUBLISHED with one primary receipt, each is in
/// the log exactly once, and each key's events are in the log in commit order.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn dispatchers_whose_connections_are_killed_at_random_lose_and_duplicate_nothing(pool: PgPool) {
    let (cluster, broker) = started(&pool, 3_000).await;
    let ids = emit_many(&pool, 200, 8).await;
    let total = ids.len() as i64;

    // The dispatchers' own sessions, told apart by their application name.
    const VICTIM: &str = "outbox-chaos-dispatch";
    let victims = sqlx::postgres::PgPoolOptions::new()
        .max_connections(12)
        .connect_with((*pool.connect_options()).clone().application_name(VICTIM))
        .await
        .unwrap();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let cfg = DispatcherConfig { workers: 2, batch_size: 50, lease_ms: 3_000, ..config("chaos") };
    let mut runs = Vec::new();
    for n in 0..2 {
        let d = Dispatcher::new(PgStore::new(victims.clone()), cluster.broker(3_000).await, DispatcherConfig { name: format!("chaos{n}"), ..cfg.clone() }).unwrap();
        runs.push(tokio::spawn(Arc::new(d).run(outbox_producer::until_true(stop_rx.clone()))));
    }
    let killer = tokio::spawn({
        let (pool, mut stop) = (pool.clone(), stop_rx.clone());
        async move {
            let mut kills = 0u32;
            while !*stop.borrow() {
                let killed: Option<bool> = sqlx::query_scalar(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                     WHERE application_name = $1 AND state <> 'idle' ORDER BY random() LIMIT 1",
                )
                .bind(VICTIM)
                .fetch_optional(&pool)
                .await
                .unwrap();
                kills += u32::from(killed == Some(true));
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(40)) => {}
                    _ = stop.changed() => {}
                }
            }
            kills
        }
    });
    // What a kill leaves unknown (a commit whose answer was lost, a batch
    // that gave up), the reconciler resolves from the log.
    let reconciler = tokio::spawn({
        let (pool, broker, mut stop) = (pool.clone(), broker.clone(), stop_rx.clone());
        async move {
            // No sooner than the adapter allows: a message may stay in the client that long.
            let bound = broker.max_in_flight_ms().expect("the Kafka adapter bounds its in-flight time") as i64 + outbox_core::reconcile::DEFAULT_CLOCK_SKEW_ALLOWANCE_MS;
            let retry = RetryPolicy { in_flight_bound_ms: bound, recheck_ms: 300, ..RetryPolicy::default() };
            let rec = Reconciler::new(PgStore::new(pool), broker, ReconcilerConfig { lease_ms: 5_000, retry, ..ReconcilerConfig::default() }).unwrap();
            while !*stop.borrow() {
                let _ = rec.resolve_unknown_once().await;
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                    _ = stop.changed() => {}
                }
            }
        }
    });
    wait_count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'", total, Duration::from_secs(150)).await;
    stop_tx.send(true).unwrap();
    let kills = killer.await.unwrap();
    reconciler.await.unwrap();
    for r in runs {
        r.await.unwrap().unwrap();
    }
    assert!(kills >= 10, "only {kills} sessions were killed: the fault did not happen");

    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_publish_receipts").await, total, "one primary receipt per event");
    assert_eq!(count(&pool, "SELECT count(DISTINCT event_id) FROM outbox_publish_receipts").await, total);
    each_once_in_log(&cluster, &ids);
    assert_eq!(keys_in_commit_order(&pool, &cluster).await, 200);
    let unknowns = count(&pool, "SELECT count(*) FROM outbox_unknown_resolutions").await;
    eprintln!("{kills} sessions killed; {unknowns} events went DISPATCH_UNKNOWN and were resolved by the reconciler");
}

/// One batch over 20 events (one per key) by a dispatcher whose session
/// loses the answer to the COMMIT after a statement containing `fragment`:
/// its report, the cluster, and the events.
async fn one_batch_losing_the_commit_answer_after(pool: &PgPool, fragment: &str) -> (outbox_producer::BatchReport, TestCluster, Vec<String>) {
    let (cluster, broker) = started(pool, 5_000).await;
    let ids = emit_many(pool, 20, 1).await;
    let cutter = CommitCutter::in_front_of(pool, 0).await.unwrap();
    let through = cutter.pool(pool, 8, "db-faults").await.unwrap();
    let d = Dispatcher::new(PgStore::new(through), broker, config("d")).unwrap();
    cutter.arm_after(fragment);
    let r = d.dispatch_once("w1").await.expect("the batch goes on after losing a COMMIT's answer");
    assert_eq!(cutter.cuts(), 1, "the COMMIT's answer was not cut");
    (r, cluster, ids)
}

/// The receipt transaction commits, but its answer is lost with the
/// connection: the batch records the same receipts again, finds them
/// already accepted, and every event stays PUBLISHED once by its single
/// attempt, with one primary receipt.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn receipts_committed_whose_answer_was_lost_are_found_already_accepted(pool: PgPool) {
    let (r, cluster, ids) = one_batch_losing_the_commit_answer_after(&pool, "INSERT INTO outbox_publish_receipts").await;
    assert_eq!((r.sent, r.published, r.duplicates, r.unknown), (20, 0, 20, 0), "{r:?}");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_publish_receipts").await, 20);
    published_once_each(&pool, &cluster, &ids).await;
}

/// The registration commits, but its answer is lost with the connection:
/// the dispatcher finds its attempts registered and sends them, instead of
/// leaving the events SENDING, unsent, for their leases and the reconciler.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_registration_committed_whose_answer_was_lost_is_sent(pool: PgPool) {
    let (r, cluster, ids) = one_batch_losing_the_commit_answer_after(&pool, "INSERT INTO outbox_attempts").await;
    assert_eq!((r.claimed, r.sent, r.published, r.unknown), (20, 20, 20, 0), "{r:?}");
    published_once_each(&pool, &cluster, &ids).await;
}
