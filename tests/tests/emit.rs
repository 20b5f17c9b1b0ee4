//! `emit` inside the caller's transaction, on real PostgreSQL (a fresh database per test).

use outbox_core::{sha256_digest, CoreError, Destination, EmitRequest, Envelope, EventState, ALL_TRANSITIONS};
use outbox_producer::{emit, EmitOptions, ProducerError};
use outbox_tests::*;
use sqlx::{PgPool, Row};

async fn setup(pool: &PgPool) {
    business_schema(pool).await;
    route(pool, ORDER_CREATED, "cluster-a", "orders", 6).await;
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn commit_stores_a_pending_envelope_with_correct_digests(pool: PgPool) {
    setup(&pool).await;
    let e = create_order(&pool, "o-42", 1999).await;
    assert!(e.inserted);
    assert!(e.event_id().as_str().starts_with("evt-"));

    let row = sqlx::query(
        "SELECT e.state, e.payload, e.payload_digest, e.destination_digest, v.envelope_canonical, v.destination_canonical, v.created_txid
         FROM outbox_events e JOIN outbox_envelopes v USING (event_id) WHERE event_id = $1",
    )
    .bind(e.event_id().as_str())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(row.get::<&str, _>("state"), "PENDING");
    let payload: Vec<u8> = row.get("payload");
    assert_eq!(payload, order_payload("o-42", 1999));
    assert_eq!(row.get::<String, _>("payload_digest"), sha256_digest(&payload));
    let envelope = Envelope::from_canonical(row.get::<&[u8], _>("envelope_canonical")).unwrap();
    let destination = Destination::from_canonical(row.get::<&[u8], _>("destination_canonical")).unwrap();
    assert_eq!(envelope, e.envelope);
    assert_eq!(envelope.payload_digest, sha256_digest(&payload));
    assert_eq!(envelope.payload_schema, sha256_digest(b"order-v2"));
    assert_eq!(envelope.created_txid as i64, row.get::<i64, _>("created_txid"));
    assert!(envelope.created_txid > 0);
    assert_eq!(row.get::<String, _>("destination_digest"), destination.digest());
    assert_eq!(destination.topic, "orders");
    assert_eq!(destination.routing_key, "tenant-7.order.o-42");
    assert_eq!(destination.route_policy_generation, 1);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn rollback_leaves_nothing(pool: PgPool) {
    setup(&pool).await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders VALUES ('o-1', 5)").execute(&mut *tx).await.unwrap();
    let payload = order_payload("o-1", 5);
    emit(&mut tx, &order_request("create-o-1", "o-1", &payload), &EmitOptions::default()).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_envelopes").await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn retried_command_yields_the_same_event_and_inserts_nothing(pool: PgPool) {
    setup(&pool).await;
    let first = create_order(&pool, "o-7", 100).await;
    let payload = order_payload("o-7", 100);
    let mut tx = pool.begin().await.unwrap();
    let again = emit(&mut tx, &order_request("create-o-7", "o-7", &payload), &EmitOptions::default()).await.unwrap();
    tx.commit().await.unwrap();
    assert!(!again.inserted);
    assert_eq!(again.event_id(), first.event_id());
    assert_eq!(again.destination_digest, first.destination_digest);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 1);

    // Same key, other payload: a typed error, never an overwrite.
    let other = order_payload("o-7", 999);
    let mut tx = pool.begin().await.unwrap();
    let err = emit(&mut tx, &order_request("create-o-7", "o-7", &other), &EmitOptions::default()).await.unwrap_err();
    assert!(matches!(err, ProducerError::CommandKeyConflict { what: "payload", .. }), "{err}");
    drop(tx);
    let digest: String = sqlx::query_scalar("SELECT payload_digest FROM outbox_events").fetch_one(&pool).await.unwrap();
    assert_eq!(digest, sha256_digest(&payload));
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn route_revision_affects_only_later_events(pool: PgPool) {
    setup(&pool).await;
    let before = create_order(&pool, "o-1", 1).await;
    let revised = route(&pool, ORDER_CREATED, "cluster-b", "orders-v2", 3).await;
    assert_eq!(revised.generation, 2);
    let after = create_order(&pool, "o-2", 2).await;

    assert_eq!(before.destination.route_policy_generation, 1);
    assert_eq!(after.destination.route_policy_generation, 2);
    assert_eq!(after.destination.topic, "orders-v2");
    assert_eq!(after.destination.cluster_id, "cluster-b");
    // The earlier event's stored destination did not move.
    let stored: (String, String) = sqlx::query_as("SELECT topic, destination_digest FROM outbox_events WHERE event_id = $1")
        .bind(before.event_id().as_str())
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(stored, ("orders".to_owned(), before.destination_digest.clone()));
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn same_command_key_from_two_connections_gives_one_event(pool: PgPool) {
    setup(&pool).await;
    let payload = order_payload("o-9", 9);
    let mut tx1 = pool.begin().await.unwrap();
    let first = emit(&mut tx1, &order_request("create-o-9", "o-9", &payload), &EmitOptions::default()).await.unwrap();

    // The second connection blocks on the command key until tx1 ends.
    let pool2 = pool.clone();
    let p2 = payload.clone();
    let second = tokio::spawn(async move {
        let mut tx2 = pool2.begin().await.unwrap();
        let e = emit(&mut tx2, &order_request("create-o-9", "o-9", &p2), &EmitOptions::default()).await.unwrap();
        tx2.commit().await.unwrap();
        e
    });
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert!(!second.is_finished(), "the second emit must wait for the first transaction");
    tx1.commit().await.unwrap();
    let second = second.await.unwrap();
    assert_eq!(second.event_id(), first.event_id());
    assert!(!second.inserted);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 1);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn bad_input_is_a_typed_error_and_writes_nothing(pool: PgPool) {
    setup(&pool).await;
    create_order(&pool, "o-1", 1).await; // version 1 of o-1
    let small = EmitOptions { max_payload_bytes: 16, ..Default::default() };
    let big = vec![b'x'; 17];
    let base = || EmitRequest { aggregate_version: 3, ..order_request("k-1", "o-1", b"{}") };
    let cases: Vec<(EmitRequest<'_>, fn(&ProducerError) -> bool)> = vec![
        (EmitRequest { payload: b"", ..base() }, |e| matches!(e, ProducerError::Core(CoreError::EmptyPayload))),
        (EmitRequest { payload: &big, ..base() }, |e| matches!(e, ProducerError::Core(CoreError::PayloadTooLarge { size_bytes: 17, limit_bytes: 16 }))),
        (EmitRequest { event_type: "order.deleted", ..base() }, |e| matches!(e, ProducerError::NoRoute { .. })),
        (EmitRequest { aggregate_id: "o 1; DROP", ..base() }, |e| matches!(e, ProducerError::Core(CoreError::MalformedIdentifier { field: "aggregateId", .. }))),
        (EmitRequest { tenant: "", ..base() }, |e| matches!(e, ProducerError::Core(CoreError::MalformedIdentifier { field: "tenant", .. }))),
        (EmitRequest { command_key: "", ..base() }, |e| matches!(e, ProducerError::Core(CoreError::MalformedIdentifier { field: "commandKey", .. }))),
        (EmitRequest { aggregate_version: 0, ..base() }, |e| matches!(e, ProducerError::AggregateVersionBackwards { last: 1, .. })),
    ];
    for (req, expected) in cases {
        let mut tx = pool.begin().await.unwrap();
        let err = emit(&mut tx, &req, &small).await.unwrap_err();
        assert!(expected(&err), "unexpected error {err:?}");
        assert!(!err.is_retryable());
        tx.commit().await.ok();
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 1);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn database_transition_table_is_the_core_table(pool: PgPool) {
    let rows: Vec<(String, String)> = sqlx::query_as("SELECT from_state, to_state FROM outbox_transitions ORDER BY 1, 2").fetch_all(&pool).await.unwrap();
    let mut core: Vec<(String, String)> = ALL_TRANSITIONS.iter().map(|(f, t)| (f.as_str().to_owned(), t.as_str().to_owned())).collect();
    core.sort();
    assert_eq!(rows, core);
    // The trigger's own list (inlined for speed) agrees on all 100 pairs.
    for from in outbox_core::ALL_STATES {
        for to in outbox_core::ALL_STATES {
            let allowed: bool = sqlx::query_scalar("SELECT outbox_transition_allowed($1, $2)").bind(from.as_str()).bind(to.as_str()).fetch_one(&pool).await.unwrap();
            assert_eq!(allowed, from.can_transition_to(to), "{from} -> {to}");
        }
    }
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn constraints_hold_against_a_buggy_caller(pool: PgPool) {
    setup(&pool).await;
    let e = create_order(&pool, "o-1", 1).await;
    let id = e.event_id().as_str();
    // An illegal transition written by hand is refused by the database.
    let err = sqlx::query("UPDATE outbox_events SET state = 'PUBLISHED' WHERE event_id = $1").bind(id).execute(&pool).await.unwrap_err();
    assert!(err.to_string().contains("illegal outbox transition PENDING -> PUBLISHED"), "{err}");
    // Frozen envelopes cannot be edited.
    let err = sqlx::query("UPDATE outbox_envelopes SET destination_digest = 'x' WHERE event_id = $1").bind(id).execute(&pool).await.unwrap_err();
    assert!(err.to_string().contains("append-only"), "{err}");
    // The frozen payload digest cannot be rewritten; malformed digests are refused.
    let err = sqlx::query("UPDATE outbox_events SET payload_digest = $2 WHERE event_id = $1")
        .bind(id)
        .bind(outbox_core::sha256_digest(b"other"))
        .execute(&pool)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("immutable"), "{err}");
    let err = sqlx::query("UPDATE outbox_events SET destination_digest = 'sha256:nothex' WHERE event_id = $1").bind(id).execute(&pool).await.unwrap_err();
    assert!(err.to_string().contains("malformed destination_digest"), "{err}");
    // One eventId, one command key.
    let dup = sqlx::query("INSERT INTO outbox_events (event_id, command_key, state, tenant, aggregate_type, aggregate_id, aggregate_version, event_type, payload, payload_digest, destination_digest, cluster_id, topic, partition, routing_key, ordered, created_at_ms, state_since_ms)
                           SELECT event_id, 'other-key', 'PENDING', tenant, aggregate_type, aggregate_id, aggregate_version, event_type, payload, payload_digest, destination_digest, cluster_id, topic, partition, routing_key, ordered, 0, 0 FROM outbox_events WHERE event_id = $1")
        .bind(id)
        .execute(&pool)
        .await;
    assert!(dup.is_err());
    let state: String = sqlx::query_scalar("SELECT state FROM outbox_events WHERE event_id = $1").bind(id).fetch_one(&pool).await.unwrap();
    assert_eq!(EventState::parse(&state).unwrap(), EventState::Pending);
}
