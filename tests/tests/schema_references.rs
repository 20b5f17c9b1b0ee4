//! The references every event writes (event -> command, envelope -> event,
//! attempt -> envelope, receipt -> attempt and envelope) are checked once
//! per statement by triggers instead of foreign keys (section 1 of the
//! producer's schema). These tests hold them to what the foreign keys did:
//! a missing reference fails the whole statement with SQLSTATE 23503 and
//! the constraint's name, and a referenced row can neither go away nor
//! change the key it is referred to by.


use outbox_core::{AttemptId, EventId, OutboxStore};
use outbox_producer::PgStore;
use outbox_tests::*;
use sqlx::PgPool;

/// One order emitted, claimed and its attempt registered: the event id
/// and the attempt id.
async fn one_registered_attempt(pool: &PgPool) -> (String, String) {
    business_schema(pool).await;
    route(pool, ORDER_CREATED, "cluster-a", "orders", 6).await;
    let event = create_order(pool, "o-1", 10).await.event_id().to_string();
    let store = PgStore::new(pool.clone());
    let claimed = store.claim_batch("w1", 10, 30_000).await.unwrap();
    assert_eq!(claimed.len(), 1);
    let attempt = store.register_attempts(&[claimed[0].token.clone()]).await.unwrap().pop().unwrap().unwrap();
    (event, attempt.attempt_id.to_string())
}

/// Asserts `result` is a foreign-key refusal naming `constraint`.
fn refused_by<T: std::fmt::Debug>(result: Result<T, sqlx::Error>, constraint: &str) {
    let err = result.expect_err(constraint);
    let db = err.as_database_error().unwrap_or_else(|| panic!("{constraint}: not a database error: {err}"));
    assert_eq!(db.code().as_deref(), Some("23503"), "{constraint}: {err}");
    assert_eq!(db.constraint(), Some(constraint), "{err}");
    assert!(db.message().contains(&format!("violates foreign key constraint \"{constraint}\"")), "{err}");
}

const INSERT_ATTEMPT: &str = "INSERT INTO outbox_attempts (attempt_id, event_id, envelope_generation, attempt_generation, claim_generation, owner, state, destination_digest, started_at_ms)
     SELECT a, $2, g, 50 + 10 * g + n, 1, 'w0', 'NOT_SENT', 'sha256:0', 0 FROM unnest($1::text[], $3::int[]) WITH ORDINALITY AS t(a, g, n)";

const INSERT_RECEIPT: &str = "INSERT INTO outbox_publish_receipts (event_id, envelope_generation, attempt_id, cluster_id, topic, partition, \"offset\", payload_digest, destination_digest, accepted_at_ms)
     VALUES ($1, $2, $3, 'cluster-a', 'orders', 0, 7, 'sha256:0', 'sha256:0', 0)";

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_missing_reference_fails_the_whole_statement_as_a_foreign_key_did(pool: PgPool) {
    let (event, attempt) = one_registered_attempt(&pool).await;
    let new_attempt = || AttemptId::generate(1_700_000_000_000).to_string();

    // event -> command: a second row of a good statement names no command row.
    let good = EventId::generate(2).to_string();
    let bad = EventId::generate(3).to_string();
    sqlx::query("INSERT INTO outbox_commands (command_key, event_id, tenant, aggregate_type, aggregate_id, aggregate_version) VALUES ('raw-good', $1, 't', 'order', 'o-9', 1)")
        .bind(&good)
        .execute(&pool)
        .await
        .unwrap();
    let copy = |ids: Vec<String>, keys: Vec<&'static str>| {
        sqlx::query(
            "INSERT INTO outbox_events (event_id, command_key, state, tenant, aggregate_type, aggregate_id, aggregate_version, event_type, payload,
                                        payload_digest, destination_digest, cluster_id, topic, partition, routing_key, ordered, created_at_ms, state_since_ms)
             SELECT n.id, n.key, 'PENDING', tenant, aggregate_type, aggregate_id, aggregate_version, event_type, payload,
                    payload_digest, destination_digest, cluster_id, topic, partition, routing_key, ordered, 0, 0
             FROM outbox_events, unnest($2::text[], $3::text[]) AS n(id, key) WHERE event_id = $1",
        )
        .bind(event.clone())
        .bind(ids)
        .bind(keys)
    };
    refused_by(copy(vec![good.clone(), bad.clone()], vec!["raw-good", "raw-missing"]).execute(&pool).await, "outbox_events_command_fkey");
    // A command row of another event does not do either.
    refused_by(copy(vec![bad.clone()], vec!["raw-good"]).execute(&pool).await, "outbox_events_command_fkey");
    copy(vec![good.clone()], vec!["raw-good"]).execute(&pool).await.expect("the good row alone is taken");

    // envelope -> event.
    refused_by(
        sqlx::query(
            "INSERT INTO outbox_envelopes (event_id, envelope_generation, envelope_canonical, envelope_digest, destination_canonical, destination_digest, payload_digest, created_txid, created_at_ms)
             SELECT unnest($2::text[]), 2, envelope_canonical, envelope_digest, destination_canonical, destination_digest, payload_digest, 0, 0
             FROM outbox_envelopes WHERE event_id = $1",
        )
        .bind(&event)
        .bind(vec![good.clone(), EventId::generate(4).to_string()])
        .execute(&pool)
        .await,
        "outbox_envelopes_event_id_fkey",
    );

    // attempt -> envelope: generation 2 of the event has no envelope.
    let (a1, a2) = (new_attempt(), new_attempt());
    refused_by(
        sqlx::query(INSERT_ATTEMPT).bind(vec![a1.clone(), a2.clone()]).bind(&event).bind(vec![1, 2]).execute(&pool).await,
        "outbox_attempts_event_id_envelope_generation_fkey",
    );
    // receipt -> attempt, receipt -> envelope.
    refused_by(sqlx::query(INSERT_RECEIPT).bind(&event).bind(1).bind(&a1).execute(&pool).await, "outbox_publish_receipts_attempt_id_fkey");
    refused_by(
        sqlx::query(INSERT_RECEIPT).bind(&event).bind(2).bind(&attempt).execute(&pool).await,
        "outbox_publish_receipts_event_id_envelope_generation_fkey",
    );

    // Nothing of the refused statements stayed.
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 2);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_envelopes").await, 1);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_attempts").await, 1);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_publish_receipts").await, 0);

    // The same rows with their references are taken.
    sqlx::query(INSERT_ATTEMPT).bind(vec![a1.clone()]).bind(&event).bind(vec![1]).execute(&pool).await.expect("attempt of an existing envelope");
    sqlx::query(INSERT_RECEIPT).bind(&event).bind(1).bind(&a1).execute(&pool).await.expect("receipt of an existing attempt and envelope");
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn referenced_rows_are_never_deleted_and_keep_their_keys(pool: PgPool) {
    let (event, attempt) = one_registered_attempt(&pool).await;

    for (sql, what) in [
        ("DELETE FROM outbox_events WHERE event_id = $1", "never deleted"),
        ("DELETE FROM outbox_attempts WHERE event_id = $1", "never deleted"),
        ("DELETE FROM outbox_envelopes WHERE event_id = $1", "append-only"),
        ("DELETE FROM outbox_commands WHERE event_id = $1", "append-only"),
    ] {
        let err = sqlx::query(sql).bind(&event).execute(&pool).await.expect_err(sql);
        assert!(err.to_string().contains(what), "{sql}: {err}");
    }
    for table in ["outbox_events", "outbox_attempts", "outbox_envelopes", "outbox_commands"] {
        let err = sqlx::query(&format!("TRUNCATE {table} CASCADE")).execute(&pool).await.expect_err(table);
        assert!(err.to_string().contains("never deleted (TRUNCATE refused)"), "{table}: {err}");
    }
    let other = AttemptId::generate(9).to_string();
    for (sql, value) in [
        ("UPDATE outbox_attempts SET attempt_id = $2 WHERE attempt_id = $1", other.as_str()),
        ("UPDATE outbox_attempts SET event_id = $2 WHERE attempt_id = $1", "evt-other"),
    ] {
        let err = sqlx::query(sql).bind(&attempt).bind(value).execute(&pool).await.expect_err(sql);
        assert!(err.to_string().contains("attempt identity is immutable"), "{sql}: {err}");
    }
    let err = sqlx::query("UPDATE outbox_attempts SET envelope_generation = 2 WHERE attempt_id = $1").bind(&attempt).execute(&pool).await.unwrap_err();
    assert!(err.to_string().contains("attempt identity is immutable"), "{err}");
    // A write that keeps the identity is an ordinary update.
    sqlx::query("UPDATE outbox_attempts SET attempt_id = attempt_id, detail = 'noted' WHERE attempt_id = $1").bind(&attempt).execute(&pool).await.unwrap();

    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 1);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_attempts WHERE detail = 'noted'").await, 1);
}

/// The tables the reference checks read.
const REFERENCED: [&str; 4] = ["outbox_events", "outbox_commands", "outbox_envelopes", "outbox_attempts"];

/// Rows `from..from+n` of every table on the dispatch path, each table
/// in one statement (so each statement's check has `n` rows to check).
async fn write_rows(own: &PgPool, from: i64, n: i64) {
    let ids = "FROM generate_series($1::bigint, $1::bigint + $2::bigint - 1) AS s(i), LATERAL (SELECT 'evt-0' || lpad(i::text, 25, '0') AS id) e";
    for sql in [
        format!("INSERT INTO outbox_commands (command_key, event_id, tenant, aggregate_type, aggregate_id, aggregate_version)
                 SELECT 'k-' || i, id, 't', 'order', 'o-' || i, 1 {ids}"),
        format!("INSERT INTO outbox_events (event_id, command_key, state, tenant, aggregate_type, aggregate_id, aggregate_version, event_type, payload,
                                           payload_digest, destination_digest, cluster_id, topic, partition, routing_key, ordered, created_at_ms, state_since_ms)
                 SELECT id, 'k-' || i, 'PENDING', 't', 'order', 'o-' || i, 1, 'order.created.v2', '\\x7b7d'::bytea,
                        'sha256:' || repeat('0', 64), 'sha256:' || repeat('0', 64), 'cluster-a', 'orders', 0, 'o-' || i, true, 0, 0 {ids}"),
        format!("INSERT INTO outbox_envelopes (event_id, envelope_generation, envelope_canonical, envelope_digest, destination_canonical, destination_digest,
                                              payload_digest, created_txid, created_at_ms)
                 SELECT id, 1, '\\x00'::bytea, 'sha256:0', '\\x00'::bytea, 'sha256:0', 'sha256:0', 0, 0 {ids}"),
        format!("INSERT INTO outbox_attempts (attempt_id, event_id, envelope_generation, attempt_generation, claim_generation, owner, state, destination_digest, started_at_ms)
                 SELECT 'att-0' || lpad(i::text, 25, '0'), id, 1, 1, 1, 'w0', 'SENDING', 'sha256:0', 0 {ids}"),
        format!("INSERT INTO outbox_publish_receipts (event_id, envelope_generation, attempt_id, cluster_id, topic, partition, \"offset\", payload_digest, destination_digest, accepted_at_ms)
                 SELECT id, 1, 'att-0' || lpad(i::text, 25, '0'), 'cluster-a', 'orders', 0, i, 'sha256:0', 'sha256:0', 0 {ids}"),
    ] {
        let done = sqlx::query(&sql).bind(from).bind(n).execute(own).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
        assert_eq!(done.rows_affected(), n as u64);
    }
}

/// The checks probe an index whatever the statistics said when a session
/// planned them: a session that planned them against a handful of
/// analyzed rows (as autovacuum leaves a young table) goes on writing
/// thousands of rows without reading a referenced table from end to end.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn checks_planned_on_tiny_tables_stay_index_probes(pool: PgPool) {
    let own = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect_with((*pool.connect_options()).clone()).await.unwrap();
    // Planned here, more than five times (PostgreSQL may settle on a
    // generic plan after five), then again with statistics of tiny tables.
    for round in 0..6 {
        write_rows(&own, round * 10, 10).await;
    }
    sqlx::query("ANALYZE outbox_commands, outbox_events, outbox_envelopes, outbox_attempts").execute(&pool).await.unwrap();
    let before = reads(&pool, &[&own], &REFERENCED).await;
    for round in 0..30 {
        write_rows(&own, 1_000 + round * 200, 200).await;
    }
    let read = reads(&pool, &[&own], &REFERENCED).await - before;
    // A check that scanned would start one scan per row it checked: 6,000
    // per check.
    assert!(read.seq_scans < 10, "writing 6,000 rows per table started {} sequential scans of referenced tables", read.seq_scans);
    // One index entry per reference checked (five per row of the dispatch
    // path); a check that read a referenced table or index from end to end
    // reads thousands per statement.
    assert!(read.rows < 10 * 6_000, "writing 6,000 rows per table read {} rows and index entries of referenced tables", read.rows);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_publish_receipts").await, 6_060);
}

/// The checks look up the tables of the schema the migrations ran in,
/// whatever the inserting session's search_path: with none (as pg_dump's
/// scripts set it) a good row is taken, and a table of the same name in a
/// schema placed ahead does not satisfy a missing reference.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn checks_read_the_outbox_schema_whatever_the_search_path(pool: PgPool) {
    let (event, _) = one_registered_attempt(&pool).await;
    let schema: String = sqlx::query_scalar("SELECT current_schema()").fetch_one(&pool).await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SET search_path = ''").execute(&mut *conn).await.unwrap();
    let qualified = INSERT_ATTEMPT.replace("INSERT INTO outbox_attempts", &format!("INSERT INTO {schema}.outbox_attempts"));
    let a1 = AttemptId::generate(1_700_000_000_000).to_string();
    sqlx::query(&qualified).bind(vec![a1]).bind(&event).bind(vec![1]).execute(&mut *conn).await.expect("a good row with an empty search_path");

    // A look-alike envelope table ahead of the outbox's on the path.
    sqlx::query("CREATE SCHEMA lookalike").execute(&mut *conn).await.unwrap();
    sqlx::query(&format!("CREATE TABLE lookalike.outbox_envelopes (LIKE {schema}.outbox_envelopes)")).execute(&mut *conn).await.unwrap();
    sqlx::query("INSERT INTO lookalike.outbox_envelopes (event_id, envelope_generation, envelope_canonical, envelope_digest, destination_canonical, destination_digest, payload_digest, created_txid, created_at_ms)
                 VALUES ($1, 2, '\\x00', 'd', '\\x00', 'd', 'd', 0, 0)")
        .bind(&event)
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query(&format!("SET search_path = lookalike, {schema}")).execute(&mut *conn).await.unwrap();
    let a2 = AttemptId::generate(1_700_000_000_000).to_string();
    refused_by(
        sqlx::query(&qualified).bind(vec![a2]).bind(&event).bind(vec![2]).execute(&mut *conn).await,
        "outbox_attempts_event_id_envelope_generation_fkey",
    );
}
