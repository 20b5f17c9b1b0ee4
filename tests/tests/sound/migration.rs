//! Destination migration: the commit fenced on what its proof read, and the dry run.

use super::*;

// ---------------------------------------------------------------- item 5

/// Issue 19 item 5: the migration reads the event PENDING (never sent) and
/// stalls before its commit; meanwhile a dispatcher claims and sends A1,
/// the ACK is lost, and a reconciler holds the event RECONCILING. The
/// migration's commit must not move the event: its proof (never sent) no
/// longer holds.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item5_migration_commit_is_fenced_on_what_its_proof_read(pool: PgPool) {
    let f = fixture(pool).await;
    let e = create_order(&f.pool, "o-1", 1).await;
    let id = e.event_id().as_str().to_owned();
    // Hold the event row: the migration reads it unlocked, then waits at its commit.
    let mut dispatcher = f.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM outbox_events WHERE event_id = $1 FOR UPDATE").bind(&id).execute(&mut *dispatcher).await.unwrap();
    let migration = {
        let (store, broker, event_id) = (f.store.clone(), f.broker.clone(), e.event_id().clone());
        tokio::spawn(async move {
            let retry = RetryPolicy { in_flight_bound_ms: BOUND_MS, ..RetryPolicy::default() };
            let route = outbox_core::RoutePolicy::new(ORDER_CREATED, "cluster-new", "orders-new", 3);
            outbox_producer::migrate_destination(&store, broker.as_ref(), &event_id, &route, "ops-alice", &retry).await.unwrap()
        })
    };
    wait_count(&f.pool, "SELECT count(*) FROM pg_locks WHERE NOT granted", 1, Duration::from_secs(10)).await;
    // What a dispatcher and a reconciler do meanwhile (their statements, in
    // the transaction that holds the row): claim, register A1, send (the
    // ACK is lost), lease expiry, the reconciler's claim.
    let attempt = outbox_core::AttemptId::generate(f.store.now_ms() as u64).to_string();
    let now = f.store.now_ms();
    for sql in [
        "UPDATE outbox_events SET state = 'CLAIMED', claim_owner = 'w', claim_generation = claim_generation + 1, lease_until_ms = $2 + 1000 WHERE event_id = $1",
        "INSERT INTO outbox_attempts (attempt_id, event_id, envelope_generation, attempt_generation, claim_generation, owner, state, destination_digest, started_at_ms)
         SELECT $3, event_id, 1, 1, claim_generation, 'w', 'UNKNOWN', destination_digest, $2 FROM outbox_events WHERE event_id = $1",
        "UPDATE outbox_events SET state = 'SENDING', claim_attempt_id = $3, attempt_generation = 1 WHERE event_id = $1",
        "UPDATE outbox_events SET state = 'DISPATCH_UNKNOWN', claim_owner = NULL, unknown_since_ms = $2, claim_generation = claim_generation + 1 WHERE event_id = $1",
        "UPDATE outbox_events SET state = 'RECONCILING', claim_owner = 'r', claim_generation = claim_generation + 1, lease_until_ms = $2 + 60000, claim_attempt_id = NULL WHERE event_id = $1",
    ] {
        sqlx::query(sql).bind(&id).bind(now).bind(&attempt).execute(&mut *dispatcher).await.unwrap();
    }
    dispatcher.commit().await.unwrap();
    let out = tokio::time::timeout(Duration::from_secs(30), migration).await.unwrap().unwrap();
    assert!(matches!(out, outbox_producer::MigrationOutcome::Refused { .. }), "moved while A1 may be in the old target: {out:?}");
    let generation: i32 = sqlx::query_scalar("SELECT envelope_generation FROM outbox_events WHERE event_id = $1").bind(&id).fetch_one(&f.pool).await.unwrap();
    assert_eq!(generation, 1);
    let a1: String = sqlx::query_scalar("SELECT state FROM outbox_attempts WHERE event_id = $1").bind(&id).fetch_one(&f.pool).await.unwrap();
    assert_eq!(a1, "UNKNOWN", "A1 closed without a proof");
    assert_eq!(f.state(&id).await, EventState::Reconciling, "the reconciler's claim is untouched");
}

/// Issue 19 item 5: a dry run runs the same eligibility check: a movable
/// event would move; one quarantined before any send would be re-sent
/// (issue 47); a published one is refused; and nothing changes either way.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item5_dry_run_runs_the_same_eligibility_check(pool: PgPool) {
    let f = fixture(pool).await;
    let retry = RetryPolicy { in_flight_bound_ms: BOUND_MS, ..RetryPolicy::default() };
    let route = outbox_core::RoutePolicy::new(ORDER_CREATED, "cluster-new", "orders-new", 3);
    let movable = create_order(&f.pool, "o-1", 1).await;
    let out = outbox_producer::migration::migrate_destination_with(&f.store, f.broker.as_ref(), movable.event_id(), &route, "ops-alice", &retry, true).await.unwrap();
    assert!(matches!(out, outbox_producer::MigrationOutcome::WouldMigrate { from_generation: 1, .. }), "{out:?}");
    assert_eq!(f.count("SELECT count(*) FROM outbox_envelopes").await, 1, "a dry run wrote an envelope");
    tamper(&f.pool, "UPDATE outbox_events SET payload = 'x' WHERE event_id = $1", movable.event_id().as_str(), None).await;
    assert_eq!(f.dispatcher(&f.store, 1_000).dispatch_once("w").await.unwrap().quarantined, 1);
    let out = outbox_producer::migration::migrate_destination_with(&f.store, f.broker.as_ref(), movable.event_id(), &route, "ops-alice", &retry, true).await.unwrap();
    let outbox_producer::MigrationOutcome::WouldMigrate { from_generation: 1, proof, .. } = &out else { panic!("a quarantined, never sent event would not be re-sent: {out:?}") };
    assert_eq!(proof["from_state"], "QUARANTINED", "{proof}");
    assert_eq!(f.state(movable.event_id().as_str()).await, EventState::Quarantined, "a dry run moved the event");
    assert_eq!(f.count("SELECT count(*) FROM outbox_envelopes").await, 1, "a dry run wrote an envelope");
    let sent = create_order(&f.pool, "o-2", 1).await;
    assert_eq!(f.dispatcher(&f.store, 1_000).dispatch_once("w").await.unwrap().published, 1);
    let out = outbox_producer::migration::migrate_destination_with(&f.store, f.broker.as_ref(), sent.event_id(), &route, "ops-alice", &retry, true).await.unwrap();
    assert!(matches!(out, outbox_producer::MigrationOutcome::Refused { .. }), "a published event passed the dry run: {out:?}");
}
