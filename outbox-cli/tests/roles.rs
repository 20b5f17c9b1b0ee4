//! docs/roles.sql: each service works under its least-privilege role, and
//! nothing more is allowed. Applied to a fresh database after both migration
//! sets; every step below connects as a login role that is only a member of
//! the role under test.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{read_message, route, Env};
use outbox_consumer::{async_trait, ConsumedEvent, Handler, HandlerError, Processor};
use outbox_core::OutboxStore;
use outbox_producer::{Dispatcher, DispatcherConfig, PgStore, Reconciler, ReconcilerConfig};
use outbox_testkit::{assert_consumed_once, assert_emitted, assert_published, KafkaFixture};
use serde_json::Value;
use sqlx::{PgPool, Postgres, Transaction};

const ROLES_SQL: &str = include_str!("../../docs/roles.sql");

/// Login roles created for this test, dropped at the end (also on panic).
struct Logins {
    admin_url: String,
    names: Vec<String>,
}

impl Drop for Logins {
    fn drop(&mut self) {
        let (url, names) = (self.admin_url.clone(), std::mem::take(&mut self.names));
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                if let Ok(pool) = PgPool::connect(&url).await {
                    for n in names {
                        let _ = sqlx::query(&format!("DROP ROLE IF EXISTS {n}")).execute(&pool).await;
                    }
                }
            });
        })
        .join();
    }
}

fn url_as(db_url: &str, user: &str) -> String {
    // postgres://<user>@host:port/db (trust authentication on the test servers).
    let after = &db_url[db_url.find("://").unwrap() + 3..];
    let host = &after[after.rfind('@').map(|i| i + 1).unwrap_or(0)..];
    format!("postgres://{user}@{host}")
}

fn denied(r: Result<sqlx::postgres::PgQueryResult, sqlx::Error>, what: &str) {
    match r {
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42501") => {}
        other => panic!("{what}: expected permission denied, got {other:?}"),
    }
}

struct Noop;

#[async_trait]
impl Handler for Noop {
    async fn handle(&self, _tx: &mut Transaction<'_, Postgres>, _e: &ConsumedEvent) -> Result<Value, HandlerError> {
        Ok(Value::Null)
    }
}


async fn emit_as_app(pool: &PgPool, id: &str) -> outbox_core::EventId {
    let mut tx = pool.begin().await.unwrap();
    common::emit_order(&mut tx, id).await;
    let event_id = assert_emitted(&mut tx, &format!("create-{id}")).await;
    tx.commit().await.unwrap();
    event_id
}

#[tokio::test]
async fn every_service_works_under_its_role_and_nothing_more() {
    let env = Env::new("cli_roles").await;
    let owner = env.pool().clone();
    outbox_producer::migrate(&owner).await.unwrap();
    outbox_consumer::migrate(&owner).await.unwrap();
    // A hardened database: nobody executes the outbox's functions unless
    // granted (PostgreSQL lets PUBLIC execute new functions by default).
    sqlx::raw_sql(
        "DO $$ DECLARE f regprocedure; BEGIN
             FOR f IN SELECT p.oid::regprocedure FROM pg_proc p WHERE p.pronamespace = current_schema()::regnamespace AND p.proname LIKE 'outbox%' LOOP
                 EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
             END LOOP;
         END $$",
    )
    .execute(&owner)
    .await
    .unwrap();
    sqlx::raw_sql(ROLES_SQL).execute(&owner).await.expect("roles.sql applies");
    sqlx::raw_sql(ROLES_SQL).execute(&owner).await.expect("roles.sql is idempotent");

    let suffix = env.db.name.rsplit('_').next().unwrap().to_owned();
    let mut logins = Logins { admin_url: env.server.url().to_owned(), names: Vec::new() };
    let mut pool_as = std::collections::HashMap::new();
    for role in ["app", "dispatcher", "reconciler", "operator", "reader", "consumer", "consumer_retention"] {
        let login = format!("t_{role}_{suffix}");
        sqlx::query(&format!("CREATE ROLE {login} LOGIN IN ROLE outbox_{role}")).execute(&owner).await.unwrap();
        logins.names.push(login.clone());
        let url = url_as(&env.db.url, &login);
        let pool = PgPool::connect(&url).await.unwrap_or_else(|e| panic!("connect as {login}: {e}"));
        pool_as.insert(role, (pool, url));
    }
    let pool = |r: &str| pool_as[r].0.clone();
    let url = |r: &str| pool_as[r].1.clone();

    // The business table is the service's own.
    sqlx::query("CREATE TABLE orders (id text PRIMARY KEY)").execute(&owner).await.unwrap();
    sqlx::query(&format!("GRANT SELECT, INSERT ON orders TO t_app_{suffix}")).execute(&owner).await.unwrap();
    let kafka = KafkaFixture::mock(1).unwrap();
    kafka.create_topic("orders", 3).await.unwrap();
    kafka.create_topic("orders-eu", 3).await.unwrap();
    let broker = kafka.broker(|c| c.message_timeout_ms = 10_000).await.unwrap();
    route(&owner, broker.cluster_id(), "orders", 3).await;

    // outbox_app emits in its own transaction.
    let published = emit_as_app(&pool("app"), "o-1").await;
    let later = emit_as_app(&pool("app"), "o-2").await;

    // outbox_dispatcher claims, sends and records receipts; sweeps leases.
    outbox_producer::check_protocol(&pool("dispatcher")).await.unwrap();
    let store = PgStore::new(pool("dispatcher"));
    let d = Arc::new(Dispatcher::new(store.clone(), broker.clone(), DispatcherConfig { name: "roles".into(), batch_size: 1, ..Default::default() }).unwrap());
    assert_eq!(d.dispatch_once("roles-0").await.unwrap().published, 1);
    store.expire_leases().await.expect("lease sweep as outbox_dispatcher");
    let receipt = assert_published(&owner, &published).await;

    // outbox_reconciler: a full round and the report.
    let rec = Reconciler::new(PgStore::new(pool("reconciler")), broker.clone(), ReconcilerConfig { aged_pending_ms: 1, ..Default::default() }).unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let (_, compared) = rec.run_once().await.expect("reconciler round as outbox_reconciler");
    assert_eq!(compared.aged_pending, 1, "o-2 is still PENDING");
    rec.report().await.expect("report as outbox_reconciler");

    // outbox_consumer applies the message: receipt and watermark.
    let processor = Processor::new("fulfilment", pool("consumer"), Noop).unwrap();
    processor.process_message(&read_message(kafka.bootstrap(), "orders", receipt.partition, receipt.offset)).await.expect("consume as outbox_consumer");
    assert_consumed_once(&owner, "fulfilment", &published).await;

    // outbox_reconciler applies a watermark published over the broker.
    outbox_producer::register_consumer(&owner, "shipping", &["orders"], false, false).await.unwrap();
    let record = outbox_core::watermark_record::WatermarkRecord {
        consumer_id: "shipping".into(),
        group_id: "shipping".into(),
        cluster_id: broker.cluster_id().into(),
        topic: "orders".into(),
        topic_id: None,
        log_id: None,
        anchor_recorded: false,
        anchor_event_id: None,
        partition: receipt.partition,
        committed_offset: receipt.offset + 1,
        open_gap_end: None,
        applied_count: 1,
        duplicate_count: 0,
        quarantined_count: 0,
        dead_lettered_count: 0,
        last_event_id: Some(published.as_str().to_owned()),
        updated_at_ms: chrono::Utc::now().timestamp_millis(),
        published_at_ms: chrono::Utc::now().timestamp_millis(),
    };
    let producer: rdkafka::producer::FutureProducer = rdkafka::ClientConfig::new().set("bootstrap.servers", kafka.bootstrap()).create().unwrap();
    let (key, value) = (record.key_bytes(), record.value_bytes());
    producer
        .send(rdkafka::producer::FutureRecord::to(outbox_core::watermark_record::DEFAULT_TOPIC).key(&key).payload(&value), Duration::from_secs(10))
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    // The record is unsigned: its consumer is opted out of signatures by name.
    let reader = outbox_producer::WatermarkTopicReader::connect(pool("reconciler"), outbox_producer::WatermarkTopicConfig::new(kafka.bootstrap()).allow_unsigned("shipping")).await.unwrap();
    assert_eq!(reader.ingest_once().await.expect("watermark topic as outbox_reconciler").applied, 1);

    // The CLI under least privilege: reader inspects, operator purges and migrates.
    let as_role = |r: &str, args: &[&str]| {
        let out = common::outbox_bin().env("DATABASE_URL", url(r)).args(args).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.code(), text)
    };
    for args in [&["status"][..], &["trace", published.as_str()], &["report"]] {
        let (code, text) = as_role("reader", args);
        assert_eq!(code, Some(0), "outbox {args:?} as outbox_reader: {text}");
    }
    let (code, text) = as_role("reader", &["purge", "--execute", "--replay-window-ms", "0"]);
    assert_eq!(code, Some(1), "the reader cannot purge: {text}");
    assert!(text.contains("permission denied"), "{text}");
    let (code, text) = as_role("operator", &["purge", "--execute", "--replay-window-ms", "0"]);
    assert_eq!(code, Some(0), "purge as outbox_operator: {text}");
    assert!(text.contains("1 event(s) were retained"), "{text}");
    let (code, text) = as_role("operator", &["migrate-destination", later.as_str(), "--operator", "ops", "--to-topic", "orders-eu", "--kafka-bootstrap", kafka.bootstrap()]);
    assert_eq!(code, Some(0), "migrate-destination as outbox_operator: {text}");
    // An operator skips a quarantined event (issue 47); the reader cannot.
    let blocked = emit_as_app(&pool("app"), "o-3").await;
    sqlx::query("UPDATE outbox_events SET state = 'QUARANTINED' WHERE event_id = $1").bind(blocked.as_str()).execute(&owner).await.unwrap();
    let (code, text) = as_role("reader", &["skip", blocked.as_str(), "--operator", "ops", "--reason", "roles test"]);
    assert_eq!(code, Some(1), "the reader cannot skip: {text}");
    assert!(text.contains("permission denied"), "{text}");
    let (code, text) = as_role("operator", &["skip", blocked.as_str(), "--operator", "ops", "--reason", "roles test"]);
    assert_eq!(code, Some(0), "skip as outbox_operator: {text}");

    // And nothing more.
    let (dispatcher, app, reader, consumer) = (pool("dispatcher"), pool("app"), pool("reader"), pool("consumer"));
    let id = published.as_str();
    denied(sqlx::query("DELETE FROM outbox_events WHERE event_id = $1").bind(id).execute(&dispatcher).await, "dispatcher DELETE event");
    denied(sqlx::query("DELETE FROM outbox_publish_receipts").execute(&dispatcher).await, "dispatcher DELETE receipt");
    denied(sqlx::query("DELETE FROM outbox_attempts").execute(&dispatcher).await, "dispatcher DELETE attempt");
    denied(sqlx::query("UPDATE outbox_envelopes SET created_at_ms = 0").execute(&dispatcher).await, "dispatcher UPDATE envelope");
    denied(sqlx::query("INSERT INTO outbox_route_policies (event_type) VALUES ('x')").execute(&dispatcher).await, "dispatcher INSERT route");
    denied(sqlx::query("SELECT 1 FROM outbox_consumer_receipts").execute(&dispatcher).await, "dispatcher reads consumer receipts");
    denied(sqlx::query("UPDATE outbox_events SET tenant = tenant").execute(&app).await, "app UPDATE event");
    denied(sqlx::query("DELETE FROM outbox_events").execute(&app).await, "app DELETE event");
    denied(sqlx::query("SELECT 1 FROM outbox_attempts").execute(&app).await, "app reads attempts");
    denied(sqlx::query("UPDATE outbox_events SET tenant = tenant").execute(&reader).await, "reader UPDATE");
    denied(sqlx::query("INSERT INTO outbox_findings (kind) VALUES ('x')").execute(&reader).await, "reader INSERT");
    denied(sqlx::query("SELECT 1 FROM outbox_events").execute(&consumer).await, "consumer reads outbox_events");
    denied(sqlx::query("UPDATE outbox_events SET tenant = tenant").execute(&consumer).await, "consumer UPDATE outbox_events");
    denied(sqlx::query("SELECT 1 FROM outbox_publish_receipts").execute(&consumer).await, "consumer reads receipts");
    denied(sqlx::query("DELETE FROM outbox_consumer_receipts").execute(&consumer).await, "consumer DELETE receipts");
    denied(sqlx::query("INSERT INTO outbox_events (event_id) VALUES ('x')").execute(&consumer).await, "consumer INSERT event");
    denied(sqlx::query("UPDATE outbox_attempts SET state = state").execute(&consumer).await, "consumer UPDATE attempts");
    denied(sqlx::query("INSERT INTO outbox_publish_receipts (event_id) VALUES ('x')").execute(&consumer).await, "consumer INSERT receipt");
    denied(sqlx::query("UPDATE outbox_consumers SET topics = topics").execute(&consumer).await, "consumer UPDATE the consumer registry");

    // Column-level grants: the dispatcher (and the reconciler, and the
    // operator through them) change only dispatch columns.
    let reconciler = pool("reconciler");
    for column in ["payload = payload", "payload_digest = payload_digest", "publisher = publisher", "destination_digest = destination_digest",
                   "cluster_id = cluster_id", "topic = topic", "partition = partition", "routing_key = routing_key", "event_type = event_type",
                   "tenant = tenant", "command_key = command_key", "envelope_generation = envelope_generation", "traceparent = traceparent", "aggregate_id = aggregate_id"] {
        let sql = format!("UPDATE outbox_events SET {column} WHERE event_id = $1");
        denied(sqlx::query(&sql).bind(id).execute(&dispatcher).await, &format!("dispatcher UPDATE {column}"));
        denied(sqlx::query(&sql).bind(id).execute(&reconciler).await, &format!("reconciler UPDATE {column}"));
    }
    for column in ["payload_digest = payload_digest", "publisher = publisher", "event_type = event_type", "tenant = tenant"] {
        denied(sqlx::query(&format!("UPDATE outbox_events SET {column} WHERE event_id = $1")).bind(id).execute(&pool("operator")).await, &format!("operator UPDATE {column}"));
    }
    for column in ["destination_digest = destination_digest", "owner = owner", "event_id = event_id", "started_at_ms = started_at_ms", "scan_from_offset = scan_from_offset"] {
        denied(sqlx::query(&format!("UPDATE outbox_attempts SET {column}")).execute(&dispatcher).await, &format!("dispatcher UPDATE attempts {column}"));
    }
    denied(sqlx::query("UPDATE outbox_publish_receipts SET \"offset\" = \"offset\"").execute(&dispatcher).await, "dispatcher UPDATE receipt");
    denied(sqlx::query("INSERT INTO outbox_events (event_id) VALUES ('x')").execute(&dispatcher).await, "dispatcher INSERT event");
    // The dispatch columns it needs stay writable (a no-op update of a row it does not hold).
    sqlx::query("UPDATE outbox_events SET next_check_at_ms = next_check_at_ms WHERE event_id = 'evt-none'").execute(&dispatcher).await.expect("dispatch columns are writable");

    // Row-level security: the application inserts only untouched PENDING events.
    let copy = |state: &str, extra: &str| {
        format!(
            "INSERT INTO outbox_events (event_id, command_key, envelope_generation, state, tenant, aggregate_type, aggregate_id, aggregate_version,
                                        event_type, payload, payload_digest, destination_digest, cluster_id, topic, partition, routing_key, ordered,
                                        created_at_ms, state_since_ms{})
             SELECT 'evt-01J00000000000000000000' || $2, command_key || $2, 1, '{state}', tenant, aggregate_type, aggregate_id, aggregate_version,
                    event_type, payload, payload_digest, destination_digest, cluster_id, topic, partition, routing_key, ordered,
                    created_at_ms, state_since_ms{}
             FROM outbox_events WHERE event_id = $1",
            if extra.is_empty() { String::new() } else { format!(", {}", extra.split('=').next().unwrap()) },
            if extra.is_empty() { String::new() } else { format!(", {}", extra.split('=').nth(1).unwrap()) },
        )
    };
    // The app may read its events back but not other tables it could copy from: it copies its own PENDING event.
    for (n, (state, extra)) in [("PUBLISHED", ""), ("CLAIMED", "claim_owner='me'"), ("QUARANTINED", ""), ("DISPATCH_UNKNOWN", ""), ("PENDING", "claim_generation=5"), ("PENDING", "published_at_ms=1")].iter().enumerate() {
        let r = sqlx::query(&copy(state, extra)).bind(later.as_str()).bind(format!("{n}")).execute(&app).await;
        denied(r, &format!("app INSERT a {state} event {extra}"));
    }

    // Receipt retention is a separate role; it can do nothing else.
    let retention = pool("consumer_retention");
    denied(sqlx::query("INSERT INTO outbox_consumer_receipts (consumer_id) VALUES ('x')").execute(&retention).await, "retention INSERT receipts");
    denied(sqlx::query("SELECT 1 FROM outbox_events").execute(&retention).await, "retention reads outbox_events");
    let far_future = chrono::Utc::now() + chrono::Duration::days(1);
    let purged = outbox_consumer::purge_receipts_before(&retention, "fulfilment", far_future, 100).await.expect("purge receipts as outbox_consumer_retention");
    assert_eq!(purged, 1);

    for (_, (p, _)) in pool_as.drain() {
        p.close().await;
    }
    drop(kafka);
    env.drop_now().await;
    drop(logins);
}
