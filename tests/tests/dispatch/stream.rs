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

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn events_emitted_on_the_stream_drain_after_the_path_is_switched_back_to_chains(pool: PgPool) {
    // Events take the path of the moment they are emitted, and drain on
    // it whatever the setting says later: a switch back to the chains path
    // does not strand the stream's backlog.
    outbox_producer::set_dispatch_path(&pool, DispatchPath::Stream).await.unwrap();
    let (cluster, _probe) = started(&pool, 5_000).await;
    let mut ids = emit_many(&pool, 10, 5).await;
    // An emit that read the stream setting and commits after the switch.
    let mut late = pool.begin().await.unwrap();
    let late_payload = outbox_tests::order_payload("late", 1);
    let late_req = outbox_tests::order_request("late-command", "late-order", &late_payload);
    let late_id = outbox_producer::emit(&mut late, &late_req, &outbox_producer::EmitOptions::default()).await.unwrap().event_id().to_string();
    outbox_producer::set_dispatch_path(&pool, DispatchPath::Chains).await.unwrap();
    late.commit().await.unwrap();
    ids.push(late_id);
    for n in 0..50 {
        // Other orders (keys): a key's chains events do not wait for its
        // stream events (README, "The stream path").
        let (order, payload) = (format!("later-o-{}", n % 10), outbox_tests::order_payload("x", n));
        let command = format!("later-{n}");
        let req = outbox_core::EmitRequest { aggregate_version: n / 10, ..outbox_tests::order_request(&command, &order, &payload) };
        let mut tx = pool.begin().await.unwrap();
        ids.push(outbox_producer::emit(&mut tx, &req, &outbox_producer::EmitOptions::default()).await.unwrap().event_id().to_string());
        tx.commit().await.unwrap();
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_stream").await, 51);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 50);
    run_two_dispatchers(&pool, &cluster, ids.len() as i64, config("d")).await;
    each_once_in_log(&cluster, &ids);
    for id in &ids {
        let state: String = sqlx::query_scalar("SELECT outbox_event_state($1)").bind(id).fetch_one(&pool).await.unwrap();
        assert_eq!(state, "PUBLISHED", "{id}");
    }
}
