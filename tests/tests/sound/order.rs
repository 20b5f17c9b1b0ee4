//! Per-key order among committed events.

use super::*;

/// Issue 19 item 10: the order promised per key. Events of one key are
/// published in the order of their `seq`, assigned at insert, among the
/// events committed when the dispatcher claims: an event whose transaction
/// committed before another was inserted is always published first (and
/// events of one transaction in insert order). Two transactions that
/// overlap get no order between them: here the later insert commits first,
/// is claimed alone and is published first. (Two emits of one aggregate
/// never overlap: emit's aggregate lock makes the second wait for the
/// first. The overlapping events here are of two aggregates that share a
/// key: the route's key template is per aggregate type.)
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item10_per_key_order_is_insert_order_among_committed_events(pool: PgPool) {
    let f = fixture(pool).await;
    let one_key = outbox_core::RoutePolicy {
        key_template: "{tenant}.{aggregate_type}".into(),
        ..outbox_core::RoutePolicy::new(ORDER_CREATED, f.broker.cluster_id(), TOPIC, PARTITIONS as u32)
    };
    outbox_producer::routes::revise(&f.pool, &one_key).await.unwrap();
    let d = f.dispatcher(&f.store, 5_000);
    // Serialized: A commits before B is inserted -> A before B, whenever the dispatcher runs.
    let mut t = f.pool.begin().await.unwrap();
    let a = emit_in(&mut t, "cmd-a", 1).await;
    t.commit().await.unwrap();
    let mut t = f.pool.begin().await.unwrap();
    let b = emit_in(&mut t, "cmd-b", 2).await;
    t.commit().await.unwrap();
    while d.dispatch_once("w").await.unwrap().claimed > 0 {}
    // Overlapping: T1 inserts C, T2 inserts D (later seq) and commits first;
    // the dispatcher runs in between.
    let mut t1 = f.pool.begin().await.unwrap();
    let c = emit_for(&mut t1, "cmd-c", "o-c", 1).await;
    let mut t2 = f.pool.begin().await.unwrap();
    let dd = emit_for(&mut t2, "cmd-d", "o-d", 1).await;
    t2.commit().await.unwrap();
    assert_eq!(d.dispatch_once("w").await.unwrap().published, 1, "D is the only committed open event of the key");
    t1.commit().await.unwrap();
    while d.dispatch_once("w").await.unwrap().claimed > 0 {}
    let seqs: Vec<i64> = sqlx::query_scalar("SELECT seq FROM outbox_events WHERE event_id = ANY($1) ORDER BY array_position($1, event_id)")
        .bind(vec![c.to_string(), dd.to_string()])
        .fetch_all(&f.pool)
        .await
        .unwrap();
    assert!(seqs[0] < seqs[1], "C was inserted first: {seqs:?}");
    let ids = [a, b, c, dd].map(|e| e.to_string());
    assert_eq!(log_order(&f), vec![ids[0].clone(), ids[1].clone(), ids[3].clone(), ids[2].clone()], "serialized: insert order; overlapping: the one committed (and claimed) first");
}
