//! `emit` inside the caller's transaction, on real PostgreSQL (a fresh database per test).

use outbox_core::{sha256_digest, CoreError, Destination, EmitRequest, Envelope, EventState, ALL_TRANSITIONS};
use outbox_producer::{emit, emit_batch, EmitOptions, ProducerError};
use outbox_tests::*;
use sqlx::{PgPool, Row};

/// A request and the check its error must pass.
type Case<'a> = (EmitRequest<'a>, fn(&ProducerError) -> bool);

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
    let cases: Vec<Case<'_>> = vec![
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

/// A writer that bypasses `emit`: inserts a PENDING copy of event `of` as
/// `event_id`, under `command_key` and with `payload_digest` (the
/// original's where `None`).
async fn insert_copy<'e>(
    db: impl sqlx::PgExecutor<'e>,
    of: &str,
    event_id: &str,
    command_key: Option<&str>,
    payload_digest: Option<&str>,
) -> Result<sqlx::postgres::PgQueryResult, sqlx::Error> {
    sqlx::query("INSERT INTO outbox_events (event_id, command_key, state, tenant, aggregate_type, aggregate_id, aggregate_version, event_type, payload, payload_digest, destination_digest, cluster_id, topic, partition, routing_key, ordered, created_at_ms, state_since_ms)
                 SELECT $2, coalesce($3, command_key), 'PENDING', tenant, aggregate_type, aggregate_id, aggregate_version, event_type, payload,
                        coalesce($4, payload_digest), destination_digest, cluster_id, topic, partition, routing_key, ordered, 0, 0
                 FROM outbox_events WHERE event_id = $1")
        .bind(of)
        .bind(event_id)
        .bind(command_key)
        .bind(payload_digest)
        .execute(db)
        .await
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
    // Fencing generations never go backwards, whatever the state change.
    let err = sqlx::query("UPDATE outbox_events SET claim_generation = claim_generation - 1 WHERE event_id = $1").bind(id).execute(&pool).await.unwrap_err();
    assert!(err.to_string().contains("never go backwards"), "{err}");
    // A legal change in the same statement as an illegal one is not kept.
    let other_id = create_order(&pool, "o-2", 1).await.event_id().to_string();
    let err = sqlx::query("UPDATE outbox_events SET state = CASE WHEN event_id = $1 THEN 'PUBLISHED' ELSE 'QUARANTINED' END WHERE event_id IN ($1, $2)")
        .bind(id)
        .bind(&other_id)
        .execute(&pool)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("illegal outbox transition PENDING -> PUBLISHED"), "{err}");
    let other_state: String = sqlx::query_scalar("SELECT state FROM outbox_events WHERE event_id = $1").bind(&other_id).fetch_one(&pool).await.unwrap();
    assert_eq!(other_state, "PENDING");
    // A quarantined event goes back to PENDING only under a new envelope
    // generation (a re-send), never as the generation it was quarantined in.
    sqlx::query("UPDATE outbox_events SET state = 'QUARANTINED' WHERE event_id = $1").bind(&other_id).execute(&pool).await.unwrap();
    let err = sqlx::query("UPDATE outbox_events SET state = 'PENDING' WHERE event_id = $1").bind(&other_id).execute(&pool).await.unwrap_err();
    assert!(err.to_string().contains("only under a new envelope generation"), "{err}");
    // One eventId, one command key.
    let err = insert_copy(&pool, id, id, Some("other-key"), None).await.unwrap_err();
    assert!(err.to_string().contains("outbox_events_pkey"), "{err}");
    // One event per command key, even for a writer that bypasses emit: a new
    // event id under a used command key has no command row of its own.
    let other = outbox_core::EventId::generate(1).to_string();
    let err = insert_copy(&pool, id, &other, None, None).await.unwrap_err();
    assert!(err.to_string().contains("outbox_events_command_fkey"), "{err}");
    // Malformed identifiers and digests are refused at insert, even from a
    // writer that brings its own command row.
    let fresh = outbox_core::EventId::generate(2).to_string();
    for (event_id, digest, expected) in [("evt-not-an-id", outbox_core::sha256_digest(b"p"), "malformed event_id"), (fresh.as_str(), "sha256:XYZ".to_owned(), "malformed payload_digest")] {
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("INSERT INTO outbox_commands (command_key, event_id, tenant, aggregate_type, aggregate_id, aggregate_version) VALUES ($1, $2, 't', 'order', 'o-9', 1)")
            .bind(format!("raw-{event_id}"))
            .bind(event_id)
            .execute(&mut *tx)
            .await
            .unwrap();
        let err = insert_copy(&mut *tx, id, event_id, Some(&format!("raw-{event_id}")), Some(&digest)).await.unwrap_err();
        assert!(err.to_string().contains(expected), "{err}");
    }
    let state: String = sqlx::query_scalar("SELECT state FROM outbox_events WHERE event_id = $1").bind(id).fetch_one(&pool).await.unwrap();
    assert_eq!(EventState::parse(&state).unwrap(), EventState::Pending);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn emit_batch_answers_what_one_emit_after_another_would(pool: PgPool) {
    setup(&pool).await;
    let before = create_order(&pool, "o-1", 100).await;
    let (p1, p2, p3) = (order_payload("o-1", 100), order_payload("o-2", 200), order_payload("o-3", 300));
    let requests = [
        order_request("create-o-2", "o-2", &p2),
        order_request("create-o-1", "o-1", &p1), // retried command from an earlier transaction
        EmitRequest { aggregate_version: 2, ..order_request("ship-o-2", "o-2", &p2) },
        order_request("create-o-2", "o-2", &p2), // retried within the batch
        order_request("create-o-3", "o-3", &p3),
    ];
    let mut tx = pool.begin().await.unwrap();
    let out = emit_batch(&mut tx, &requests, &EmitOptions::default()).await.unwrap();
    tx.commit().await.unwrap();

    assert_eq!(out.len(), 5);
    assert_eq!(out.iter().map(|e| e.inserted).collect::<Vec<_>>(), [true, false, true, false, true]);
    assert_eq!(out[1].event_id(), before.event_id());
    assert_eq!(out[3].event_id(), out[0].event_id());
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 4);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_envelopes").await, 4);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_commands").await, 4);
    // Commit order within the batch is request order: seq follows it.
    let ids: Vec<String> = sqlx::query_scalar("SELECT event_id FROM outbox_events ORDER BY seq").fetch_all(&pool).await.unwrap();
    let expected: Vec<String> = [&before, &out[0], &out[2], &out[4]].iter().map(|e| e.event_id().to_string()).collect();
    assert_eq!(ids, expected);
    // Each stored envelope is the one answered.
    for e in [&out[0], &out[2], &out[4]] {
        let bytes: Vec<u8> = sqlx::query_scalar("SELECT envelope_canonical FROM outbox_envelopes WHERE event_id = $1")
            .bind(e.event_id().as_str())
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(Envelope::from_canonical(&bytes).unwrap(), e.envelope);
    }
    // The whole batch retried: every answer is the first one's, nothing is inserted.
    let mut tx = pool.begin().await.unwrap();
    let again = emit_batch(&mut tx, &requests, &EmitOptions::default()).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(again.iter().map(|e| e.event_id()).collect::<Vec<_>>(), out.iter().map(|e| e.event_id()).collect::<Vec<_>>());
    assert!(again.iter().all(|e| !e.inserted));
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 4);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn emit_batch_is_all_or_nothing(pool: PgPool) {
    setup(&pool).await;
    let (p1, p2, other) = (order_payload("o-1", 1), order_payload("o-2", 2), order_payload("o-1", 999));
    let v = |version, key, id, payload| EmitRequest { aggregate_version: version, ..order_request(key, id, payload) };

    // An aggregate version going backwards inside the batch.
    let mut tx = pool.begin().await.unwrap();
    let err = emit_batch(&mut tx, &[v(5, "a", "o-1", &p1), v(4, "b", "o-1", &p1)], &EmitOptions::default()).await.unwrap_err();
    assert!(matches!(err, ProducerError::AggregateVersionBackwards { version: 4, last: 5, .. }), "{err}");
    tx.commit().await.unwrap();
    // The same command key with another payload inside the batch.
    let mut tx = pool.begin().await.unwrap();
    let err = emit_batch(&mut tx, &[v(1, "k", "o-1", &p1), v(1, "k", "o-1", &other)], &EmitOptions::default()).await.unwrap_err();
    assert!(matches!(err, ProducerError::CommandKeyConflict { what: "payload", .. }), "{err}");
    tx.commit().await.unwrap();
    // An event type without a route after a valid request.
    let mut tx = pool.begin().await.unwrap();
    let unrouted = EmitRequest { event_type: "order.unrouted.v1", ..order_request("c", "o-2", &p2) };
    let err = emit_batch(&mut tx, &[v(1, "ok", "o-2", &p2), unrouted], &EmitOptions::default()).await.unwrap_err();
    assert!(matches!(err, ProducerError::NoRoute { .. }), "{err}");
    tx.commit().await.unwrap();
    // Each failed batch's transaction was committed: none of them wrote anything.
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 0, "a failed batch writes nothing");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_commands").await, 0);

    // Over the limit: refused before touching the database.
    let many: Vec<EmitRequest> = (0..=outbox_producer::MAX_EMIT_BATCH).map(|_| v(1, "x", "o-1", &p1)).collect();
    let mut tx = pool.begin().await.unwrap();
    let err = emit_batch(&mut tx, &many, &EmitOptions::default()).await.unwrap_err();
    assert!(matches!(err, ProducerError::BatchTooLarge { .. }), "{err}");
    assert!(emit_batch(&mut tx, &[], &EmitOptions::default()).await.unwrap().is_empty());
}

/// A transaction at `level` with its snapshot already taken (a business
/// read), as a service running its transactions at that level would be
/// when it emits.
async fn begin_at<'c>(pool: &PgPool, level: &str) -> sqlx::Transaction<'c, sqlx::Postgres> {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(&format!("SET TRANSACTION ISOLATION LEVEL {level}")).execute(&mut *tx).await.unwrap();
    sqlx::query("SELECT count(*) FROM orders").execute(&mut *tx).await.unwrap();
    tx
}

/// Services that run their business transactions at REPEATABLE READ or
/// SERIALIZABLE emit there too. The events commit, their references checked
/// against the transaction's own rows; and a command key that another
/// transaction committed after this one's snapshot is a retryable error,
/// never a second event, and the retry answers the committed event.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn emit_under_repeatable_read_and_serializable(pool: PgPool) {
    setup(&pool).await;
    for (n, level) in ["REPEATABLE READ", "SERIALIZABLE"].into_iter().enumerate() {
        let ids: Vec<String> = (0..3).map(|i| format!("o-{n}-{i}")).collect();
        let payloads: Vec<Vec<u8>> = ids.iter().map(|id| order_payload(id, 10)).collect();
        let keys: Vec<String> = ids.iter().map(|id| format!("create-{id}")).collect();
        let requests: Vec<EmitRequest> = (0..3).map(|i| order_request(&keys[i], &ids[i], &payloads[i])).collect();
        let mut tx = begin_at(&pool, level).await;
        for id in &ids {
            sqlx::query("INSERT INTO orders (id, total_cents) VALUES ($1, 10)").bind(id).execute(&mut *tx).await.unwrap();
        }
        let out = emit_batch(&mut tx, &requests, &EmitOptions::default()).await.unwrap_or_else(|e| panic!("{level}: {e}"));
        tx.commit().await.unwrap_or_else(|e| panic!("{level}: {e}"));
        assert!(out.iter().all(|e| e.inserted), "{level}");

        // Another transaction commits the key after this one's snapshot.
        let id = format!("o-{n}-raced");
        let payload = order_payload(&id, 10);
        let key = format!("create-{id}");
        let mut late = begin_at(&pool, level).await;
        let committed = create_order(&pool, &id, 10).await;
        let err = emit(&mut late, &order_request(&key, &id, &payload), &EmitOptions::default()).await.expect_err("a key committed after the snapshot");
        assert!(err.is_retryable(), "{level}: {err}");
        late.rollback().await.unwrap();
        let mut retry = begin_at(&pool, level).await;
        let again = emit(&mut retry, &order_request(&key, &id, &payload), &EmitOptions::default()).await.unwrap();
        retry.commit().await.unwrap();
        assert_eq!(again.event_id(), committed.event_id(), "{level}");
        assert!(!again.inserted, "{level}");
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PENDING'").await, 8);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_envelopes").await, 8);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_commands").await, 8);
}

/// The tables emit looks up.
const LOOKED_UP: [&str; 3] = ["outbox_commands", "outbox_events", "outbox_envelopes"];

/// `n` orders from `from` in one transaction, one `emit_batch`, each its own
/// command key and aggregate.
async fn emit_orders(own: &PgPool, from: usize, n: usize) {
    let ids: Vec<String> = (from..from + n).map(|i| format!("o-{i}")).collect();
    let keys: Vec<String> = ids.iter().map(|id| format!("create-{id}")).collect();
    let payload = order_payload("o", 1);
    let requests: Vec<EmitRequest> = ids.iter().zip(&keys).map(|(id, key)| order_request(key, id, &payload)).collect();
    let mut tx = own.begin().await.unwrap();
    emit_batch(&mut tx, &requests, &EmitOptions::default()).await.unwrap();
    tx.commit().await.unwrap();
}

/// emit looks its command keys, aggregates and retried commands up through
/// an index whatever the statistics said when the session planned the
/// lookups: a session that planned them against a handful of analyzed rows
/// (as autovacuum leaves a young table, and as a deployment that starts at
/// full traffic has) goes on emitting thousands of events, and answering
/// retries, without reading the outbox tables from end to end once per
/// event.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn emit_planned_on_a_tiny_table_stays_index_probes(pool: PgPool) {
    setup(&pool).await;
    let own = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect_with((*pool.connect_options()).clone()).await.unwrap();
    // Planned more than five times (PostgreSQL may settle on a generic plan
    // after five), then again with statistics of a tiny table.
    for round in 0..6 {
        emit_orders(&own, round * 3, 3).await;
    }
    sqlx::query("ANALYZE outbox_commands, outbox_events, outbox_envelopes").execute(&pool).await.unwrap();
    // Retries now, so their lookup too is planned on tiny tables.
    emit_orders(&own, 0, 18).await;
    let before = reads(&pool, &[&own], &LOOKED_UP).await;
    for round in 0..30 {
        emit_orders(&own, 1_000 + round * 200, 200).await;
    }
    // 4,000 retried commands: each answers its committed event, nothing is
    // inserted for them.
    for round in 0..20 {
        emit_orders(&own, 1_000 + round * 200, 200).await;
    }
    let read = reads(&pool, &[&own], &LOOKED_UP).await - before;
    // A lookup that scanned would start one scan per key or aggregate (200
    // per batch); a retry's join that scanned, one of each table per batch.
    assert!(read.seq_scans < 5, "emitting 6,000 events and 4,000 retries started {} sequential scans", read.seq_scans);
    // A few index entries per event or retry; a plan that read a table or
    // one of its indexes from end to end reads thousands per batch.
    assert!(read.rows < 5 * 10_000, "emitting 6,000 events and 4,000 retries read {} rows and index entries", read.rows);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 6_018);
}

/// A commit that emitted wakes the sessions listening on `outbox_pending`
/// unless `wake_dispatcher` is off; then nothing is sent, and the events
/// are committed all the same.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn wake_dispatcher_decides_whether_the_commit_notifies(pool: PgPool) {
    setup(&pool).await;
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await.unwrap();
    listener.listen("outbox_pending").await.unwrap();
    let quiet = EmitOptions { wake_dispatcher: false, ..Default::default() };
    for (n, (options, wakes)) in [(quiet.clone(), false), (EmitOptions::default(), true), (quiet, false)].into_iter().enumerate() {
        let id = format!("o-{n}");
        let payload = order_payload(&id, 1);
        let key = format!("create-{id}");
        let mut tx = pool.begin().await.unwrap();
        emit(&mut tx, &order_request(&key, &id, &payload), &options).await.unwrap();
        tx.commit().await.unwrap();
        let heard = tokio::time::timeout(std::time::Duration::from_millis(500), listener.recv()).await;
        match heard {
            Ok(notification) => {
                assert!(wakes, "emit {n} with wake_dispatcher off notified");
                assert_eq!(notification.unwrap().channel(), "outbox_pending");
            }
            Err(_) => assert!(!wakes, "emit {n} committed without a notification"),
        }
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PENDING'").await, 3);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_traceparent_the_w3c_forbids_is_refused(pool: PgPool) {
    setup(&pool).await;
    let payload = order_payload("o-1", 5);
    for (i, tp) in [
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", // version ff
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01", // all-zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", // all-zero parent id
    ]
    .into_iter()
    .enumerate()
    {
        let mut tx = pool.begin().await.unwrap();
        let key = format!("create-o-1-{i}");
        let r = emit(&mut tx, &order_request(&key, "o-1", &payload), &EmitOptions { traceparent: Some(tp.into()), ..Default::default() }).await;
        assert!(r.is_err(), "{tp} was accepted");
        let text = r.unwrap_err().to_string();
        assert!(text.contains("traceparent"), "{text}");
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 0);
    let mut tx = pool.begin().await.unwrap();
    let ok = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    emit(&mut tx, &order_request("create-o-1", "o-1", &payload), &EmitOptions { traceparent: Some(ok.into()), ..Default::default() }).await.unwrap();
    tx.commit().await.unwrap();
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_tracestate_is_validated_and_needs_a_traceparent(pool: PgPool) {
    setup(&pool).await;
    let payload = order_payload("o-1", 5);
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let many: Vec<String> = (0..33).map(|i| format!("k{i}=v")).collect();
    let many = many.join(",");
    for (traceparent, tracestate) in [(None, "vendor=1"), (Some(tp), "Vendor=1"), (Some(tp), "vendor"), (Some(tp), many.as_str())] {
        let mut tx = pool.begin().await.unwrap();
        let opts = EmitOptions { traceparent: traceparent.map(str::to_owned), tracestate: Some(tracestate.to_owned()), ..Default::default() };
        let r = emit(&mut tx, &order_request("create-o-1", "o-1", &payload), &opts).await;
        let text = r.expect_err(tracestate).to_string();
        assert!(text.contains("tracestate"), "{text}");
    }
    let mut tx = pool.begin().await.unwrap();
    let opts = EmitOptions { traceparent: Some(tp.into()), tracestate: Some("vendor=1,other=x".into()), ..Default::default() };
    let e = emit(&mut tx, &order_request("create-o-1", "o-1", &payload), &opts).await.unwrap();
    tx.commit().await.unwrap();
    let stored: Option<String> = sqlx::query_scalar("SELECT tracestate FROM outbox_events WHERE event_id = $1").bind(e.event_id().as_str()).fetch_one(&pool).await.unwrap();
    assert_eq!(stored.as_deref(), Some("vendor=1,other=x"));
    // No trace context given and no OpenTelemetry layer: none recorded.
    let plain = create_order(&pool, "o-2", 5).await;
    let stored: (Option<String>, Option<String>) = sqlx::query_as("SELECT traceparent, tracestate FROM outbox_events WHERE event_id = $1")
        .bind(plain.event_id().as_str())
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(stored, (None, None));
}

/// What emit refuses, the schema refuses from any other writer too.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_schema_refuses_a_trace_context_the_w3c_forbids_written_by_hand(pool: PgPool) {
    setup(&pool).await;
    let e = create_order(&pool, "o-1", 5).await;
    let id = e.event_id().as_str();
    let set = |tp: Option<&'static str>, ts: Option<String>| {
        let pool = pool.clone();
        async move {
            sqlx::query("UPDATE outbox_events SET traceparent = $1, tracestate = $2 WHERE event_id = $3").bind(tp).bind(ts).bind(id).execute(&pool).await
        }
    };
    for tp in [
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
    ] {
        let err = set(Some(tp), None).await.expect_err(tp);
        assert!(err.to_string().contains("W3C"), "{tp}: {err}");
    }
    let ok = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let err = set(Some(ok), Some("k=v,".repeat(200))).await.expect_err("an 800-byte tracestate");
    assert!(err.to_string().contains("W3C"), "{err}");
    let err = set(None, Some("k=v".into())).await.expect_err("a tracestate without traceparent");
    assert!(err.to_string().contains("W3C"), "{err}");
    set(Some(ok), Some("k=v".into())).await.unwrap();
}

/// Whether the session `pid` waits on a lock (a row, a key, an advisory lock).
async fn waits_on_a_lock(pool: &PgPool, pid: i32) -> bool {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock')").bind(pid).fetch_one(pool).await.unwrap()
}

/// Defect (outside read): two concurrent emits of one aggregate could commit
/// an aggregate version below one already committed. `emit` read the
/// aggregate's last version and inserted its event with no lock between
/// (READ COMMITTED, the default): neither transaction saw the other's
/// uncommitted row, so both passed `decide_command`'s rule "a new command's
/// version is not below the aggregate's last one", and whichever order they
/// committed in, one of the orders the events carry went backwards.
///
/// Transaction A emits and holds its commit; B, on another connection,
/// emits the other version of the same aggregate and commits if it can; A
/// commits. Each committed event, in commit order and in `seq` order (the
/// order its chain is delivered in), must not be below one committed
/// before it: B waits for A and is then decided against A's version.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn concurrent_emits_of_one_aggregate_never_commit_a_version_backwards(pool: PgPool) {
    setup(&pool).await;
    // (aggregate, A's version, B's version): B's higher, then B's lower.
    for (aggregate, a_version, b_version) in [("o-race-up", 2_i64, 3_i64), ("o-race-down", 3, 2)] {
        let payload = order_payload(aggregate, 1);
        let a_key = format!("{aggregate}-a");
        let mut a = pool.begin().await.unwrap();
        emit(&mut a, &EmitRequest { aggregate_version: a_version, ..order_request(&a_key, aggregate, &payload) }, &EmitOptions::default()).await.unwrap();

        let (pid_tx, pid_rx) = tokio::sync::oneshot::channel();
        let b = {
            let (pool, payload, aggregate) = (pool.clone(), payload.clone(), aggregate.to_owned());
            tokio::spawn(async move {
                let mut b = pool.begin().await.unwrap();
                let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *b).await.unwrap();
                pid_tx.send(pid).unwrap();
                let key = format!("{aggregate}-b");
                let out = emit(&mut b, &EmitRequest { aggregate_version: b_version, ..order_request(&key, &aggregate, &payload) }, &EmitOptions::default()).await;
                match out {
                    Ok(_) => b.commit().await.map(|_| true).map_err(|e| e.to_string()),
                    Err(e) => {
                        b.rollback().await.unwrap();
                        Err(e.to_string())
                    }
                }
            })
        };
        // B either commits while A is open (the race) or waits for A.
        let b_pid = pid_rx.await.unwrap();
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while !b.is_finished() && !waits_on_a_lock(&pool, b_pid).await {
            assert!(tokio::time::Instant::now() < deadline, "{aggregate}: B neither finished nor waited");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let b_first = b.is_finished();
        a.commit().await.unwrap();
        let b_out = b.await.unwrap();

        let mut commit_order = Vec::new();
        if b_first && b_out.is_ok() {
            commit_order.push(b_version);
        }
        commit_order.push(a_version);
        if !b_first && b_out.is_ok() {
            commit_order.push(b_version);
        }
        let seq_order: Vec<i64> = sqlx::query_scalar("SELECT aggregate_version FROM outbox_events WHERE aggregate_id = $1 ORDER BY seq")
            .bind(aggregate)
            .fetch_all(&pool)
            .await
            .unwrap();
        for (what, order) in [("commit", &commit_order), ("seq", &seq_order)] {
            assert!(
                order.windows(2).all(|w| w[0] <= w[1]),
                "{aggregate}: versions committed in {what} order {order:?} go backwards (B committed before A: {b_first}; B answered {b_out:?})"
            );
        }
        // A lower version that had to wait is refused against the committed one.
        if b_version < a_version {
            let err = b_out.expect_err("B's lower version committed after A's");
            assert!(err.contains("backwards") || err.contains(&format!("{a_version}")), "{err}");
        } else {
            assert_eq!(b_out, Ok(true), "B's higher version is a new event");
        }
    }
}

/// Batches over the same aggregates in opposite orders take the aggregates'
/// locks in one order (sorted), so they wait for each other and never
/// deadlock; each commits, in turn.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn emit_batches_over_the_same_aggregates_in_opposite_orders_do_not_deadlock(pool: PgPool) {
    setup(&pool).await;
    let payload = order_payload("o", 1);
    let ids: Vec<String> = (0..20).map(|i| format!("o-{i}")).collect();
    let mut tasks = Vec::new();
    for round in 0..8_i64 {
        let (pool, payload, ids) = (pool.clone(), payload.clone(), ids.clone());
        tasks.push(tokio::spawn(async move {
            let mut order: Vec<&String> = ids.iter().collect();
            if round % 2 == 1 {
                order.reverse();
            }
            let keys: Vec<String> = order.iter().map(|id| format!("{id}-{round}")).collect();
            let requests: Vec<EmitRequest> =
                order.iter().zip(&keys).map(|(id, key)| EmitRequest { aggregate_version: 1, ..order_request(key, id, &payload) }).collect();
            let mut tx = pool.begin().await.unwrap();
            emit_batch(&mut tx, &requests, &EmitOptions::default()).await.map_err(|e| e.to_string())?;
            tx.commit().await.map_err(|e| e.to_string())
        }));
    }
    for t in tasks {
        t.await.unwrap().expect("a batch failed (deadlock?)");
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 8 * 20);
}

/// One emit of `version` for `aggregate` in a transaction at `isolation`
/// whose snapshot was taken first (by `SELECT 1`, as a command handler's own
/// reads would): `Ok(true)` committed, `Err` what emit or the commit said
/// (and whether it is retryable).
async fn emit_in_snapshot(
    pool: &PgPool,
    isolation: &str,
    key: &str,
    aggregate: &str,
    version: i64,
    snapshot_taken: tokio::sync::oneshot::Sender<i32>,
    go: tokio::sync::oneshot::Receiver<()>,
) -> Result<bool, (bool, String)> {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query(&format!("SET TRANSACTION ISOLATION LEVEL {isolation}")).execute(&mut *tx).await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *tx).await.unwrap();
    snapshot_taken.send(pid).unwrap();
    go.await.unwrap();
    let payload = order_payload(aggregate, 1);
    match emit(&mut tx, &EmitRequest { aggregate_version: version, ..order_request(key, aggregate, &payload) }, &EmitOptions::default()).await {
        Ok(_) => match tx.commit().await {
            Ok(()) => Ok(true),
            Err(e) => Err((outbox_producer::ProducerError::from(e).is_retryable(), "commit".into())),
        },
        Err(e) => {
            let _ = tx.rollback().await;
            Err((e.is_retryable(), e.to_string()))
        }
    }
}

/// Defect (issue 47, version race, the REPEATABLE READ half): at REPEATABLE
/// READ a transaction's snapshot is taken at its first statement, before
/// emit waits on the aggregate's lock, so it could not see a version
/// another transaction committed meanwhile and committed a lower one. Two
/// shapes: B's snapshot is taken, then A emits version 3 and commits, then
/// B emits version 2 ("after"); A emits version 3 and holds its commit
/// while B emits version 2 and waits ("during"). B must not commit: it
/// fails with a retryable error, and B's retry is refused as a version
/// backwards. Both at one snapshot isolation level (the aggregate's head
/// row, written by such emits, is the row both write), and with A at READ
/// COMMITTED once the store writes head rows for every emit
/// (`AggregateHeads::Always`).
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn an_emit_at_snapshot_isolation_never_commits_a_version_below_one_committed_after_its_snapshot(pool: PgPool) {
    setup(&pool).await;
    for (b_isolation, a_isolation, always) in
        [("REPEATABLE READ", "REPEATABLE READ", false), ("SERIALIZABLE", "SERIALIZABLE", false), ("REPEATABLE READ", "READ COMMITTED", true)]
    {
        if always {
            outbox_producer::set_aggregate_heads(&pool, outbox_producer::AggregateHeads::Always).await.unwrap();
        }
        for shape in ["after", "during"] {
            let aggregate = format!("o-{}-{}-{shape}", b_isolation.replace(' ', "-").to_lowercase(), a_isolation.replace(' ', "-").to_lowercase());
            let (taken_tx, taken_rx) = tokio::sync::oneshot::channel();
            let (go_tx, go_rx) = tokio::sync::oneshot::channel();
            let b = {
                let (pool, isolation, aggregate) = (pool.clone(), b_isolation.to_owned(), aggregate.clone());
                tokio::spawn(async move { emit_in_snapshot(&pool, &isolation, &format!("{aggregate}-b"), &aggregate, 2, taken_tx, go_rx).await })
            };
            let b_pid = taken_rx.await.unwrap();
            let payload = order_payload(&aggregate, 1);
            let mut a = pool.begin().await.unwrap();
            sqlx::query(&format!("SET TRANSACTION ISOLATION LEVEL {a_isolation}")).execute(&mut *a).await.unwrap();
            emit(&mut a, &EmitRequest { aggregate_version: 3, ..order_request(&format!("{aggregate}-a"), &aggregate, &payload) }, &EmitOptions::default()).await.unwrap();
            if shape == "after" {
                a.commit().await.unwrap();
                go_tx.send(()).unwrap();
            } else {
                go_tx.send(()).unwrap();
                let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
                while !waits_on_a_lock(&pool, b_pid).await {
                    assert!(tokio::time::Instant::now() < deadline && !b.is_finished(), "{aggregate}: B did not wait for A");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
                a.commit().await.unwrap();
            }
            let b_out = b.await.unwrap();
            let case = format!("B at {b_isolation}, A at {a_isolation}, {shape}");
            let versions: Vec<i64> = sqlx::query_scalar("SELECT aggregate_version FROM outbox_commands WHERE aggregate_id = $1 ORDER BY aggregate_version")
                .bind(&aggregate)
                .fetch_all(&pool)
                .await
                .unwrap();
            assert_eq!(versions, vec![3], "{case}: B committed version 2 below A's committed 3 (B answered {b_out:?})");
            let (retryable, why) = b_out.expect_err("B did not commit");
            assert!(retryable, "{case}: B's refusal is retryable: {why}");
            // The retry, in a new transaction, sees A's version and refuses B's.
            let mut retry = pool.begin().await.unwrap();
            sqlx::query(&format!("SET TRANSACTION ISOLATION LEVEL {b_isolation}")).execute(&mut *retry).await.unwrap();
            let err = emit(&mut retry, &EmitRequest { aggregate_version: 2, ..order_request(&format!("{aggregate}-b"), &aggregate, &payload) }, &EmitOptions::default())
                .await
                .expect_err("the retry of version 2");
            assert!(matches!(err, ProducerError::AggregateVersionBackwards { last: 3, .. }), "{case}: {err}");
        }
    }
}
