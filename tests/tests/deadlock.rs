//! The dispatcher's retry of retryable database errors
//! (`Dispatcher::through_db_errors`) met by a real deadlock (40P01) inside
//! the receipt transaction, on real PostgreSQL and librdkafka's in-process
//! Kafka cluster.
//!
//! The receipt transaction locks its events in event-id order (`SELECT ...
//! ORDER BY e.event_id FOR UPDATE OF e`); batched updates of the same rows
//! elsewhere (lease renewal's `UPDATE ... FROM UNNEST(...)`, in the order of
//! the batch it is given) lock them in their plan's order. Two such
//! transactions over the same events in opposite orders deadlock, and
//! PostgreSQL cancels one of them.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{headers, EventState};
use outbox_producer::{Dispatcher, DispatcherConfig};
use outbox_tests::kafka::read_topic;
use outbox_tests::*;
use sqlx::PgPool;

const TOPIC: &str = "orders";
const PARTITIONS: i32 = 3;

/// Deadlocks PostgreSQL has detected in this database (the victim's backend
/// reports it; counters reach the view within a second or so).
async fn deadlocks(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT coalesce(deadlocks, 0) FROM pg_stat_database WHERE datname = current_database()").fetch_one(pool).await.unwrap()
}

/// The backend running the receipt transaction's row locks, once it waits
/// on a lock.
async fn receipt_transaction_waiting(pool: &PgPool) -> Option<i32> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'
           AND query LIKE '%FOR UPDATE OF e%'",
    )
    .fetch_optional(pool)
    .await
    .unwrap()
}

/// Two transactions take the same two event rows in opposite orders: the
/// shipped receipt transaction (through `Dispatcher::settle`) the lower
/// event id first, another transaction (as a batched update in its plan's
/// order would) the higher first. PostgreSQL reports the deadlock (40P01)
/// to the receipt transaction (the other one checks for deadlocks only after
/// 60 s); its retry then publishes both events: one primary receipt each,
/// no duplicate, each message once in the log, the other transaction's
/// writes committed too.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_deadlock_in_the_receipt_transaction_is_retried_and_nothing_is_lost_or_doubled(pool: PgPool) {
    let Stack { pool, cluster, broker, store, .. } = stack(pool, TOPIC, PARTITIONS, |_| {}).await;
    let a = create_order(&pool, "o-1", 1).await;
    let b = create_order(&pool, "o-2", 2).await;
    let mut ids = vec![a.event_id().to_string(), b.event_id().to_string()];
    ids.sort();
    let (lo, hi) = (ids[0].clone(), ids[1].clone());

    let d = Arc::new(Dispatcher::new(store.clone(), broker.clone(), DispatcherConfig { name: "d".into(), lease_ms: 60_000, ..Default::default() }).unwrap());
    let batch = d.claim_and_send("w").await.unwrap();
    assert_eq!(batch.len(), 2, "both events claimed and sent");
    let deadlocks_before = deadlocks(&pool).await;

    // The other transaction takes the higher event id's row first. It never
    // runs the deadlock check itself (its timeout is past the test's end),
    // so the receipt transaction, which checks after deadlock_timeout (1 s
    // by default), is the one PostgreSQL cancels.
    let mut other = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL deadlock_timeout = '60s'").execute(&mut *other).await.unwrap();
    let touch = "UPDATE outbox_events SET lease_until_ms = lease_until_ms WHERE event_id = $1";
    sqlx::query(touch).bind(&hi).execute(&mut *other).await.unwrap();

    // The receipt transaction locks the lower one, then waits for the higher one.
    let settle = {
        let d = d.clone();
        tokio::spawn(async move { d.settle(batch).await })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while receipt_transaction_waiting(&pool).await.is_none() {
        assert!(!settle.is_finished(), "the receipt transaction finished without waiting for the other transaction's row: {:?}", settle.await);
        assert!(tokio::time::Instant::now() < deadline, "the receipt transaction never waited on the row lock");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Now the other transaction asks for the lower one: a cycle. It gets it
    // once PostgreSQL has cancelled the receipt transaction.
    let got = tokio::time::timeout(Duration::from_secs(20), sqlx::query(touch).bind(&lo).execute(&mut *other)).await;
    got.expect("the deadlock was never broken").expect("the other transaction was cancelled instead of the receipt transaction");
    other.commit().await.unwrap();

    let report = tokio::time::timeout(Duration::from_secs(30), settle).await.expect("settle never finished").unwrap().expect("the batch failed");
    assert_eq!(report.published, 2, "{report:?}");
    assert!(d.metrics().store_retries.load(std::sync::atomic::Ordering::Relaxed) >= 1, "the receipt transaction was not retried");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while deadlocks(&pool).await <= deadlocks_before {
        assert!(tokio::time::Instant::now() < deadline, "PostgreSQL reported no deadlock");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Nothing lost, nothing doubled.
    for id in [&lo, &hi] {
        let state: String = sqlx::query_scalar("SELECT state FROM outbox_events WHERE event_id = $1").bind(id).fetch_one(&pool).await.unwrap();
        assert_eq!(EventState::parse(&state).unwrap(), EventState::Published, "{id}");
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_publish_receipts").await, 2);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_duplicate_receipts").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_attempts").await, 2, "no attempt beyond the one send per event");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_attempts WHERE state = 'ACKED'").await, 2);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_quarantine").await, 0);
    let log = read_topic(&cluster.bootstrap, TOPIC, PARTITIONS);
    for id in [&lo, &hi] {
        assert_eq!(log.iter().filter(|m| m.header(headers::EVENT_ID).as_deref() == Some(id.as_str())).count(), 1, "{id} in the log");
    }
}
