//! The stream path (`outbox_producer::DispatchPath::Stream`) under the
//! shipped dispatcher, on real PostgreSQL and librdkafka's in-process
//! cluster: every event reaches the log once, each key's events in their
//! commit order, and the happy path leaves nothing in the exception lane.

use outbox_producer::{DispatcherConfig, DispatchPath};
use outbox_tests::count;
use outbox_tests::dispatch::{config, each_once_in_log, emit_many, keys_in_commit_order, run_two_dispatchers, started};
use sqlx::PgPool;

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn two_dispatchers_on_the_stream_publish_each_event_once_in_each_keys_commit_order(pool: PgPool) {
    outbox_producer::set_dispatch_path(&pool, DispatchPath::Stream).await.unwrap();
    let (cluster, _probe) = started(&pool, 5_000).await;
    let ids = emit_many(&pool, 20, 25).await;
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_stream").await, 500, "emit wrote stream rows");
    let cfg = DispatcherConfig { workers: 3, batch_size: 7, ..config("d") };
    run_two_dispatchers(&pool, &cluster, ids.len() as i64, cfg).await;

    assert_eq!(keys_in_commit_order(&pool, &cluster).await, 20);
    each_once_in_log(&cluster, &ids);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_duplicate_receipts").await, 0);
    // The happy path is inserts only: nothing went to the lane, and every
    // receipt names the batch that registered its attempt.
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 0, "an event left the happy path");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_publish_receipts WHERE batch_id IS NULL").await, 0);
    for id in &ids {
        let state: String = sqlx::query_scalar("SELECT outbox_event_state($1)").bind(id).fetch_one(&pool).await.unwrap();
        assert_eq!(state, "PUBLISHED", "{id}");
    }
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn many_keys_in_one_transaction_drain_on_the_stream(pool: PgPool) {
    outbox_producer::set_dispatch_path(&pool, DispatchPath::Stream).await.unwrap();
    let (cluster, _probe) = started(&pool, 5_000).await;
    let ids = emit_many(&pool, 1_500, 1).await;
    run_two_dispatchers(&pool, &cluster, ids.len() as i64, config("d")).await;
    each_once_in_log(&cluster, &ids);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 0, "an event left the happy path");
}
