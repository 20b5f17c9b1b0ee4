//! The stream's partitions are kept ahead of its sequence
//! (`outbox_stream_partitions_ahead`, called by every retention pass), so
//! that events never land in the default partition, which no partition
//! can take rows over from and retention cannot drop; and keeping them
//! ahead never stalls the hot path behind a reader of the whole stream.
//! Real PostgreSQL.

use std::time::{Duration, Instant};

use outbox_producer::{DispatchPath, RetentionPolicy};
use outbox_tests::*;
use sqlx::PgPool;

/// Seqs per partition.
const WIDTH: i64 = 1 << 24;

async fn on_the_stream(pool: &PgPool) {
    business_schema(pool).await;
    route(pool, ORDER_CREATED, "cluster-a", "orders", 3).await;
    outbox_producer::set_dispatch_path(pool, DispatchPath::Stream).await.unwrap();
}

async fn next_seq_is(pool: &PgPool, seq: i64) {
    sqlx::query("SELECT setval('outbox_events_seq_seq', $1, false)").bind(seq).execute(pool).await.unwrap();
}

async fn rows_in(pool: &PgPool, partition: &str) -> i64 {
    count(pool, &format!("SELECT count(*) FROM {partition}")).await
}

async fn partitions(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'outbox_stream'::regclass ORDER BY c.relname",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn retention_pass(pool: &PgPool) {
    let policy = RetentionPolicy { replay_window_ms: 60_000, batch_size: 100, max_batches: 10 };
    outbox_producer::purge(pool, 0, &policy, false, |_| {}).await.expect("retention pass");
}

/// A retention pass attaches the partition past the one the sequence is
/// in; events emitted across the boundary land in the partitions, none in
/// the default one. Without the pass, the same events past the last
/// partition land in the default partition.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_retention_pass_attaches_partitions_ahead_and_no_event_lands_in_the_default_partition(pool: PgPool) {
    on_the_stream(&pool).await;
    // Near the end of the last partition (p1 ends at 2 * WIDTH).
    next_seq_is(&pool, 2 * WIDTH - 3).await;
    retention_pass(&pool).await;
    let parts = partitions(&pool).await;
    assert!(parts.contains(&"outbox_stream_p2".to_owned()) && parts.contains(&"outbox_stream_p3".to_owned()), "{parts:?}");
    for i in 0..8 {
        create_order(&pool, &format!("o-{i}"), i).await;
    }
    assert_eq!(rows_in(&pool, "outbox_stream_p1").await, 3);
    assert_eq!(rows_in(&pool, "outbox_stream_p2").await, 5);
    assert_eq!(rows_in(&pool, "outbox_stream_default").await, 0, "an event landed in the default partition");
    // The sequence moved into p2: the next call attaches p4 (two ahead of
    // it), and a second one nothing.
    let ahead = || async { sqlx::query_scalar::<_, i32>("SELECT outbox_stream_partitions_ahead(2)").fetch_one(&pool).await.unwrap() };
    assert_eq!(ahead().await, 1);
    assert_eq!(ahead().await, 0);
    assert!(partitions(&pool).await.contains(&"outbox_stream_p4".to_owned()));

    // The baseline: past the partitions attached, events land in the default partition.
    next_seq_is(&pool, 5 * WIDTH).await;
    create_order(&pool, "o-past", 1).await;
    assert_eq!(rows_in(&pool, "outbox_stream_default").await, 1);
}

/// The range the sequence is in already has rows in the default partition
/// (the partitions fell behind): attaching it would fail on them, so the
/// partitions start past it, and events from there on land in them.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn partitions_that_fell_behind_start_past_the_rows_of_the_default_partition(pool: PgPool) {
    on_the_stream(&pool).await;
    next_seq_is(&pool, 2 * WIDTH + 10).await;
    create_order(&pool, "o-1", 1).await;
    assert_eq!(rows_in(&pool, "outbox_stream_default").await, 1);
    let made: i32 = sqlx::query_scalar("SELECT outbox_stream_partitions_ahead(1)").fetch_one(&pool).await.unwrap();
    assert_eq!(made, 1);
    let parts = partitions(&pool).await;
    assert!(!parts.contains(&"outbox_stream_p2".to_owned()) && parts.contains(&"outbox_stream_p3".to_owned()), "{parts:?}");
    next_seq_is(&pool, 3 * WIDTH).await;
    create_order(&pool, "o-2", 1).await;
    assert_eq!(rows_in(&pool, "outbox_stream_p3").await, 1);
    assert_eq!(rows_in(&pool, "outbox_stream_default").await, 1);
}

/// A reader of the whole stream (a report, an analytics query under a
/// held snapshot) holds a share of the default partition; the attach needs
/// it alone. The attach gives up after its lock timeout instead of waiting
/// for the reader (without the timeout this test would hang: the reader
/// ends only after it), an emit goes on while the reader holds the stream,
/// and the next call attaches once the reader is gone.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_reader_of_the_whole_stream_delays_the_attach_not_the_hot_path(pool: PgPool) {
    on_the_stream(&pool).await;
    next_seq_is(&pool, 2 * WIDTH - 3).await;
    let mut reader = pool.acquire().await.unwrap();
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ").execute(&mut *reader).await.unwrap();
    sqlx::query("SELECT count(*) FROM outbox_stream").execute(&mut *reader).await.unwrap();

    let started = Instant::now();
    let made: i32 = sqlx::query_scalar("SELECT outbox_stream_partitions_ahead(1)").fetch_one(&pool).await.unwrap();
    let took = started.elapsed();
    assert_eq!(made, 0, "attached while a reader held the default partition");
    assert!(took < Duration::from_secs(2), "the attach waited {took:?} for the reader");
    let started = Instant::now();
    create_order(&pool, "o-1", 1).await;
    assert!(started.elapsed() < Duration::from_secs(2), "an emit waited {:?} while the reader held the stream", started.elapsed());

    sqlx::query("COMMIT").execute(&mut *reader).await.unwrap();
    drop(reader);
    let made: i32 = sqlx::query_scalar("SELECT outbox_stream_partitions_ahead(1)").fetch_one(&pool).await.unwrap();
    assert_eq!(made, 1);
    assert!(partitions(&pool).await.contains(&"outbox_stream_p2".to_owned()));
}

/// The stream's ids in partition `part`.
async fn ids_in(pool: &PgPool, part: &str) -> Vec<String> {
    sqlx::query_scalar(&format!("SELECT event_id FROM {part} ORDER BY seq")).fetch_all(pool).await.unwrap()
}

async fn to_lane(pool: &PgPool, ids: &[String]) {
    sqlx::query("SELECT outbox_stream_to_lane($1::text[])").bind(ids).execute(pool).await.unwrap();
}

/// On the stream, four events across the end of p0 (so the sequence has
/// left it), and p0's events copied to the lane.
async fn p0_left_and_in_the_lane(pool: &PgPool) {
    on_the_stream(pool).await;
    next_seq_is(pool, WIDTH - 2).await;
    for i in 0..4 {
        create_order(pool, &format!("o-{i}"), 1).await;
    }
    to_lane(pool, &ids_in(pool, "outbox_stream_p0").await).await;
}

async fn drop_settled(pool: &PgPool) -> i32 {
    sqlx::query_scalar("SELECT outbox_stream_drop_settled(4)").fetch_one(pool).await.unwrap()
}

/// Until every transaction below each partition's mark has ended (the
/// horizon is the cluster's: other tests' transactions, in any database,
/// hold it back for a moment), so that what a drop answers next is about
/// the partition's rows, not the horizon.
async fn until_past_the_marks(pool: &PgPool) {
    let past = "SELECT count(*) FROM outbox_stream_drops WHERE pg_snapshot_xmin(pg_current_snapshot()) < seen_xmax";
    wait_count(pool, past, 0, Duration::from_secs(10)).await;
}

/// [`drop_settled`] once past the marks.
async fn drop_settled_past_the_marks(pool: &PgPool) -> i32 {
    until_past_the_marks(pool).await;
    drop_settled(pool).await
}

/// [`drop_settled_past_the_marks`] until it drops something (at most 5 s):
/// the detach gives up after its lock timeout behind anyone holding the
/// stream, autovacuum's analyze of a partition just written included.
async fn drop_settled_eventually(pool: &PgPool) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let n = drop_settled_past_the_marks(pool).await;
        if n > 0 || Instant::now() > deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Issue 45: retention drops a stream partition the sequence has left once
/// every event in it is in the exception lane, in two steps: a first pass
/// marks it with the transaction horizon of that moment, and it is dropped
/// only after every transaction below the mark ended (an emit that drew a
/// seq in it may still commit a row there) and each of its rows has its
/// lane row. The partition the sequence is in stays; the events of the
/// dropped one read the same through the lane.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_partition_whose_events_are_all_in_the_lane_is_dropped_after_the_transactions_before_its_mark(pool: PgPool) {
    on_the_stream(&pool).await;
    next_seq_is(&pool, WIDTH - 3).await;
    for i in 0..2 {
        create_order(&pool, &format!("o-{i}"), 1).await;
    }
    // An emit that drew a seq in p0 and has not committed.
    let mut open = pool.begin().await.unwrap();
    let payload = order_payload("o-open", 1);
    let late = outbox_producer::emit(&mut open, &order_request("c-open", "o-open", &payload), &outbox_producer::EmitOptions::default()).await.unwrap();
    for i in 2..5 {
        create_order(&pool, &format!("o-{i}"), 1).await;
    }
    assert_eq!(rows_in(&pool, "outbox_stream_p0").await, 2, "the open emit's row is not visible yet");
    assert_eq!(rows_in(&pool, "outbox_stream_p1").await, 3);

    assert_eq!(drop_settled(&pool).await, 0, "a first call marks p0");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_stream_drops WHERE partition = 'outbox_stream_p0'").await, 1);
    to_lane(&pool, &ids_in(&pool, "outbox_stream_p0").await).await;
    assert_eq!(drop_settled(&pool).await, 0, "a transaction below the mark is still open");
    assert!(partitions(&pool).await.contains(&"outbox_stream_p0".to_owned()));
    open.commit().await.unwrap();
    assert_eq!(rows_in(&pool, "outbox_stream_p0").await, 3);
    assert_eq!(drop_settled_past_the_marks(&pool).await, 0, "the open emit's event is on the stream only");
    let late_id = late.event_id().to_string();
    to_lane(&pool, std::slice::from_ref(&late_id)).await;

    let p0 = ids_in(&pool, "outbox_stream_p0").await;
    assert_eq!(drop_settled_eventually(&pool).await, 1);
    let parts = partitions(&pool).await;
    assert!(!parts.contains(&"outbox_stream_p0".to_owned()) && parts.contains(&"outbox_stream_p1".to_owned()), "{parts:?}");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_stream_drops").await, 0);
    for id in &p0 {
        let state: Option<String> = sqlx::query_scalar("SELECT outbox_event_state($1)").bind(id).fetch_one(&pool).await.unwrap();
        assert_eq!(state.as_deref(), Some("PENDING"), "{id} reads through the lane");
    }
    // The partition the sequence is in stays, whatever its events.
    to_lane(&pool, &ids_in(&pool, "outbox_stream_p1").await).await;
    assert_eq!(drop_settled(&pool).await, 0);
    assert_eq!(drop_settled(&pool).await, 0);
    assert!(partitions(&pool).await.contains(&"outbox_stream_p1".to_owned()));
}

/// A reader of the whole stream holds a share of every partition; the
/// detach needs the stream alone. The drop gives up after its lock timeout
/// instead of waiting for the reader, an emit goes on meanwhile, and a pass
/// after the reader is gone drops the partition.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_reader_of_the_whole_stream_delays_the_drop_not_the_hot_path(pool: PgPool) {
    p0_left_and_in_the_lane(&pool).await;
    assert_eq!(drop_settled(&pool).await, 0, "marked");
    let mut reader = pool.acquire().await.unwrap();
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ").execute(&mut *reader).await.unwrap();
    sqlx::query("SELECT count(*) FROM outbox_stream").execute(&mut *reader).await.unwrap();

    // The reader has no transaction id (it only reads): only its lock stops the drop.
    until_past_the_marks(&pool).await;
    let started = Instant::now();
    assert_eq!(drop_settled(&pool).await, 0, "dropped while a reader held the stream");
    assert!(started.elapsed() < Duration::from_secs(2), "the drop waited {:?} for the reader", started.elapsed());
    let started = Instant::now();
    create_order(&pool, "o-during", 1).await;
    assert!(started.elapsed() < Duration::from_secs(2), "an emit waited {:?} while the reader held the stream", started.elapsed());

    sqlx::query("COMMIT").execute(&mut *reader).await.unwrap();
    drop(reader);
    assert_eq!(drop_settled_eventually(&pool).await, 1);
    assert!(!partitions(&pool).await.contains(&"outbox_stream_p0".to_owned()));
}

/// A retention pass drops what `outbox_stream_drop_settled` allows: the
/// pass calls it (after attaching the partitions ahead).
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn retention_passes_drop_a_settled_partition(pool: PgPool) {
    p0_left_and_in_the_lane(&pool).await;
    retention_pass(&pool).await;
    assert!(partitions(&pool).await.contains(&"outbox_stream_p0".to_owned()), "the first pass only marks it");
    let deadline = Instant::now() + Duration::from_secs(5);
    while partitions(&pool).await.contains(&"outbox_stream_p0".to_owned()) && Instant::now() < deadline {
        until_past_the_marks(&pool).await;
        retention_pass(&pool).await;
    }
    assert!(!partitions(&pool).await.contains(&"outbox_stream_p0".to_owned()), "a later pass drops it");
}
