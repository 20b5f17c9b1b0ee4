//! The lease and the in-flight bound: no send after the lease, the bound counted from the lease's end with the database's clock.

use super::*;

// ---------------------------------------------------------------- item 1

/// Issue 19 item 1: the registration's answer comes back after the lease
/// (here: it waits on a lock for longer than the lease). The send must not
/// start: the attempt is NOT_SENT and nothing is in the log.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item1_no_send_after_the_lease_when_the_registration_answer_comes_late(pool: PgPool) {
    let f = fixture(pool).await;
    let e = create_order(&f.pool, "o-1", 1).await;
    let id = e.event_id().as_str().to_owned();
    // A store on the real clock: the stall is real time.
    let store = PgStore::new(f.pool.clone());
    let d = Arc::new(f.dispatcher(&store, 1_000));
    let mut blocker = f.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE outbox_attempts IN SHARE MODE").execute(&mut *blocker).await.unwrap();
    let task = {
        let d = d.clone();
        tokio::spawn(async move {
            let batch = d.claim_and_send("w").await.unwrap();
            d.settle(batch).await.unwrap()
        })
    };
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    blocker.commit().await.unwrap();
    let report = tokio::time::timeout(Duration::from_secs(30), task).await.unwrap().unwrap();
    assert_eq!(report.claimed, 1, "{report:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(f.log_of(&id), 0, "a message was handed to the client after its lease had run out ({report:?})");
    let state: String = sqlx::query_scalar("SELECT state FROM outbox_attempts WHERE event_id = $1").bind(&id).fetch_one(&f.pool).await.unwrap();
    assert_eq!(state, "NOT_SENT");
}

/// Issue 19 item 1: an attempt may be handed to the client until its lease
/// ends and then sit there for the adapter's longest in-flight time: the
/// in-flight bound counts from the later of registration and lease end.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item1_in_flight_bound_counts_from_the_end_of_the_lease(pool: PgPool) {
    let f = fixture(pool).await;
    let (ev, _a) = f.registered("o-1", 30_000).await;
    let id = ev.envelope.event_id.as_str().to_owned();
    f.clock.advance(30_001);
    assert_eq!(f.store.expire_leases().await.unwrap().unknown, 1);
    // Past the bound from registration, within it from the lease's end.
    f.clock.advance(15_000);
    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!((r.retried, r.rechecks), (0, 1), "an attempt that could still be sent until {} ms ago was proven absent: {r:?}", 15_000);
    assert_eq!(f.state(&id).await, EventState::DispatchUnknown);
    f.clock.advance(BOUND_MS);
    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!(r.retried, 1, "{r:?}");
}

/// Issue 19 item 1: the registration time is measured with the database's
/// clock. A dispatcher host whose clock is ten minutes behind registers an
/// attempt; a reconciler on a correct clock must not take it for old.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item1_in_flight_is_measured_with_the_database_clock(pool: PgPool) {
    let f = fixture(pool).await;
    let real: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint").fetch_one(&f.pool).await.unwrap();
    let behind = ManualClock::new(real - 600_000);
    let skewed = PgStore::with_clock(f.pool.clone(), Arc::new(behind.clone()));
    create_order(&f.pool, "o-1", 1).await;
    let claimed = skewed.claim_batch("w", 10, 1_000).await.unwrap();
    let a = skewed.register_attempt(&claimed[0].token).await.unwrap();
    skewed.report_unknown(&claimed[0].token, &a.attempt_id, "timed out").await.unwrap();
    let cfg = ReconcilerConfig { owner: "r".into(), retry: RetryPolicy { in_flight_bound_ms: BOUND_MS, ..RetryPolicy::default() }, ..Default::default() };
    let rec = Reconciler::new(PgStore::new(f.pool.clone()), f.broker.clone(), cfg).unwrap();
    let r = rec.resolve_unknown_once().await.unwrap();
    assert_eq!((r.examined, r.retried, r.rechecks), (1, 0, 1), "an attempt registered a moment ago was taken for settled: {r:?}");
}

/// Issue 19 item 1: a bound that does not cover the adapter's in-flight time
/// plus a clock skew allowance is refused.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item1_a_bound_without_a_skew_allowance_is_refused(pool: PgPool) {
    let f = fixture(pool).await;
    let max = f.broker.max_in_flight_ms().unwrap() as i64;
    let cfg = ReconcilerConfig { retry: RetryPolicy { in_flight_bound_ms: max, ..RetryPolicy::default() }, ..Default::default() };
    let err = Reconciler::new(f.store.clone(), f.broker.clone(), cfg).expect_err("a bound equal to the client's time leaves no room for clock skew");
    assert!(err.to_string().contains("skew"), "{err}");
}

/// Issue 47 (defect): an operator's skip of a DISPATCH_UNKNOWN event closed
/// its UNKNOWN without a resolution row, so the UNKNOWN vanished from the
/// resolutions (`outbox_unknown_resolutions_total`, the resolution p99,
/// `outbox unknown show`) as if it had never been open. The skip resolves
/// it: one row, outcome SKIPPED, from the time it became UNKNOWN to the skip.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn an_operators_skip_of_an_unknown_event_is_its_resolution(pool: PgPool) {
    use outbox_producer::skip::{SkipOutcome, SkipStore};
    let f = fixture(pool).await;
    let (ev, _a) = f.registered("o-1", 30_000).await;
    let id = ev.envelope.event_id.clone();
    f.clock.advance(30_001);
    assert_eq!(f.store.expire_leases().await.unwrap().unknown, 1);
    let since: i64 = sqlx::query_scalar("SELECT unknown_since_ms FROM outbox_events WHERE event_id = $1").bind(id.as_str()).fetch_one(&f.pool).await.unwrap();
    f.clock.advance(5_000);
    let out = f.store.skip_event(&id, "ops-alice", "the broker's copy is unreadable, OPS-12").await.unwrap();
    assert!(matches!(out, SkipOutcome::Skipped { .. }), "{out:?}");
    let rows: Vec<(i64, i64, String)> = sqlx::query_as("SELECT unknown_since_ms, resolved_at_ms, outcome FROM outbox_unknown_resolutions WHERE event_id = $1")
        .bind(id.as_str())
        .fetch_all(&f.pool)
        .await
        .unwrap();
    assert_eq!(rows.len(), 1, "the skipped UNKNOWN has no resolution row: {rows:?}");
    assert_eq!((rows[0].0, rows[0].2.as_str()), (since, "SKIPPED"), "{rows:?}");
    assert_eq!(rows[0].1 - rows[0].0, 5_000, "{rows:?}");
}
