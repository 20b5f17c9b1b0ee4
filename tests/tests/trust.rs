//! Source identity, message authentication and every copy accounted for, on
//! real PostgreSQL and librdkafka's in-process Kafka cluster: what the
//! dispatcher writes, what a consumer's policy accepts of it, and what the
//! reconciler's bypass scan reports.

use std::sync::Arc;
use std::time::Duration;

use outbox_consumer::{verify_message_with, RawMessage, TrustPolicy};
use outbox_core::trust::{self, SigningKey};
use outbox_core::{headers, RetryPolicy, RoutePolicy};
use outbox_producer::kafka::KafkaBroker;
use outbox_producer::{Dispatcher, DispatcherConfig, PgStore, Reconciler, ReconcilerConfig, SigningConfig};
use outbox_tests::kafka::{read_topic, LogMessage, TestCluster};
use outbox_tests::*;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use sqlx::PgPool;

const TOPIC: &str = "orders";
const PARTITIONS: i32 = 2;
const SECRET_HEX: &str = "5eb63bbbe01eeed093cb22bb8f5acdc35eb63bbbe01eeed093cb22bb8f5acdc3";

struct Fixture {
    pool: PgPool,
    cluster: TestCluster,
    broker: Arc<KafkaBroker>,
    source: String,
}

async fn fixture(pool: PgPool) -> Fixture {
    let Stack { pool, cluster, broker, .. } = stack(pool, TOPIC, PARTITIONS, |_| {}).await;
    let source = sqlx::query_scalar("SELECT source FROM outbox_identity").fetch_one(&pool).await.unwrap();
    Fixture { pool, cluster, broker, source }
}

impl Fixture {
    fn dispatcher(&self, signing: Option<SigningConfig>) -> Dispatcher<KafkaBroker> {
        let cfg = DispatcherConfig { name: "d".into(), signing, ..Default::default() };
        Dispatcher::new(PgStore::new(self.pool.clone()), self.broker.clone(), cfg).unwrap()
    }

    fn reconciler(&self, declared_sources: Vec<String>) -> Reconciler<KafkaBroker> {
        let cfg = ReconcilerConfig { owner: "r".into(), retry: RetryPolicy { in_flight_bound_ms: 120_000, ..RetryPolicy::default() }, declared_sources, ..Default::default() };
        Reconciler::new(PgStore::new(self.pool.clone()), self.broker.clone(), cfg).unwrap()
    }

    async fn produce(&self, partition: i32, key: &[u8], payload: &[u8], hs: &[(String, Vec<u8>)]) {
        let producer: FutureProducer = ClientConfig::new().set("bootstrap.servers", &self.cluster.bootstrap).create().unwrap();
        let mut h = OwnedHeaders::new();
        for (k, v) in hs {
            h = h.insert(Header { key: k, value: Some(v) });
        }
        producer.send(FutureRecord::to(TOPIC).partition(partition).key(key).payload(payload).headers(h), Duration::from_secs(5)).await.unwrap();
    }

    async fn open_findings(&self, kind: &str) -> Vec<String> {
        sqlx::query_scalar("SELECT event_id FROM outbox_findings WHERE kind = $1 AND resolved_at_ms IS NULL ORDER BY event_id").bind(kind).fetch_all(&self.pool).await.unwrap()
    }
}

fn raw(m: &LogMessage) -> RawMessage {
    RawMessage {
        topic: TOPIC.into(),
        partition: m.partition,
        offset: m.offset,
        key: Some(m.key.clone()),
        payload: Some(m.payload.clone()),
        headers: m.headers.clone(),
        non_utf8_header_names: Vec::new(),
        log_id: None,
    }
}

/// The dispatcher writes the outbox's source and the claims digest on every
/// message, the route's CloudEvents switch notwithstanding, and with a
/// signing key a signature a consumer holding the key accepts.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn dispatched_messages_name_their_source_and_verify_under_the_consumer_policy(pool: PgPool) {
    let f = fixture(pool).await;
    create_order(&f.pool, "o-unsigned", 1).await;
    assert_eq!(f.dispatcher(None).dispatch_once("w").await.unwrap().published, 1);
    // CloudEvents off for the route: outbox-source is still written.
    outbox_producer::routes::revise(&f.pool, &RoutePolicy { cloudevents: false, ..RoutePolicy::new(ORDER_CREATED, f.broker.cluster_id(), TOPIC, PARTITIONS as u32) }).await.unwrap();
    create_order(&f.pool, "o-signed", 2).await;
    let signing = SigningConfig { key_id: "k-2026-12".into(), secret_hex: SECRET_HEX.into() };
    assert!(!format!("{signing:?}").contains(SECRET_HEX), "the secret is never printed");
    assert_eq!(f.dispatcher(Some(signing)).dispatch_once("w").await.unwrap().published, 1);

    let log = read_topic(&f.cluster.bootstrap, TOPIC, PARTITIONS);
    assert_eq!(log.len(), 2);
    let key = SigningKey::from_hex("k-2026-12", SECRET_HEX).unwrap();
    let strict = TrustPolicy::default().accept(TOPIC, &[&f.source], true).with_key(&f.source, key.clone());
    for m in &log {
        assert_eq!(m.header(trust::SOURCE).as_deref(), Some(f.source.as_str()));
        let t = trust::check_claims(&m.headers).unwrap();
        assert!(t.claims.is_some(), "a claims digest on every message");
        let signed = m.header(headers::AGGREGATE).unwrap().contains("o-signed");
        assert_eq!(m.header(headers::CE_SOURCE).is_some(), !signed, "CloudEvents follows the route; outbox-source does not");
        let verdict = verify_message_with("c", &raw(m), &strict);
        if signed {
            assert_eq!(t.key_id.as_deref(), Some("k-2026-12"));
            assert!(key.verifies(&t.claims.unwrap(), &t.signature.unwrap()));
            assert_eq!(verdict.unwrap().source.as_deref(), Some(f.source.as_str()));
        } else {
            assert_eq!(verdict.unwrap_err().quarantined.reason.code(), "verify:signature_missing");
        }
    }
}

/// A message another outbox wrote (its own source) is `foreign_source`,
/// not a silent pass; declared, it is left alone.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_message_of_another_outbox_is_a_foreign_source_finding_unless_declared(pool: PgPool) {
    let f = fixture(pool).await;
    create_order(&f.pool, "o-1", 1).await;
    assert_eq!(f.dispatcher(None).dispatch_once("w").await.unwrap().published, 1);
    let rec = f.reconciler(Vec::new());
    assert_eq!(rec.compare_once().await.unwrap().total(), 0, "a healthy run has no findings");

    // Another outbox database (a test run pointed at the shared topic) writes
    // a genuine-looking message of its own.
    let mine = read_topic(&f.cluster.bootstrap, TOPIC, PARTITIONS).pop().unwrap();
    let other = "urn:uuid:99999999-9999-4999-8999-999999999999";
    let foreign_id = outbox_core::EventId::generate(1);
    let mut hs = mine.headers.clone();
    for (k, v) in hs.iter_mut() {
        if k == headers::EVENT_ID {
            *v = foreign_id.as_str().as_bytes().to_vec();
        }
    }
    trust::seal(&mut hs, other, None).unwrap();
    f.produce(mine.partition, &mine.key, &mine.payload, &hs).await;
    let c = rec.compare_once().await.unwrap();
    assert_eq!((c.foreign_source, c.bypass_publish), (1, 0), "{c:?}");
    assert_eq!(f.open_findings("foreign_source").await, vec![foreign_id.to_string()]);
    let kept: Option<String> = sqlx::query_scalar("SELECT source FROM outbox_bypass_messages WHERE event_id = $1").bind(foreign_id.as_str()).fetch_one(&f.pool).await.unwrap();
    assert_eq!(kept.as_deref(), Some(other));

    // Declared: a second message of that outbox is no finding.
    f.produce(mine.partition, &mine.key, &mine.payload, &hs).await;
    let c = f.reconciler(vec![other.to_owned()]).compare_once().await.unwrap();
    assert_eq!((c.foreign_source, c.bypass_publish, c.scanned_messages), (0, 0, 1), "{c:?}");
}

/// A byte-identical copy of a published event at a new offset is
/// `unrecorded_copy`; the real eventId with other bytes is `divergent_copy`.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn copies_of_published_events_at_unrecorded_positions_are_findings(pool: PgPool) {
    let f = fixture(pool).await;
    create_order(&f.pool, "o-1", 1).await;
    create_order(&f.pool, "o-2", 2).await;
    assert_eq!(f.dispatcher(None).dispatch_once("w").await.unwrap().published, 2);
    let rec = f.reconciler(Vec::new());
    assert_eq!(rec.compare_once().await.unwrap().total(), 0);

    let log = read_topic(&f.cluster.bootstrap, TOPIC, PARTITIONS);
    let (a, b) = (&log[0], &log[1]);
    // A mirror or a replay tool copies a's message byte for byte.
    f.produce(a.partition, &a.key, &a.payload, &a.headers).await;
    // Someone republishes b's eventId with other bytes (and consistent digests).
    let mut hs = b.headers.clone();
    let other = b"{\"order\":\"o-2\",\"total_cents\":999999}".to_vec();
    for (k, v) in hs.iter_mut() {
        if k == headers::PAYLOAD_DIGEST {
            *v = outbox_core::sha256_digest(&other).into_bytes();
        }
    }
    trust::seal(&mut hs, &f.source, None).unwrap();
    f.produce(b.partition, &b.key, &other, &hs).await;

    let c = rec.compare_once().await.unwrap();
    assert_eq!((c.unrecorded_copy, c.divergent_copy, c.bypass_publish, c.foreign_source), (1, 1, 0, 0), "{c:?}");
    assert_eq!(f.open_findings("unrecorded_copy").await, vec![a.header(headers::EVENT_ID).unwrap()]);
    assert_eq!(f.open_findings("divergent_copy").await, vec![b.header(headers::EVENT_ID).unwrap()]);
    // Evidence stays open on the next round, which reads nothing new.
    let c = rec.compare_once().await.unwrap();
    assert_eq!(c.scanned_messages, 0);
    assert_eq!(f.open_findings("unrecorded_copy").await.len() + f.open_findings("divergent_copy").await.len(), 2);
    let text = rec.report().await.unwrap().to_text();
    assert!(text.contains("unrecorded_copy") && text.contains("divergent_copy"), "{text}");
}

struct Ship;

#[outbox_consumer::async_trait]
impl outbox_consumer::Handler for Ship {
    async fn handle(&self, tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, e: &outbox_consumer::ConsumedEvent) -> Result<serde_json::Value, outbox_consumer::HandlerError> {
        sqlx::query("INSERT INTO shipments (event_id) VALUES ($1)").bind(e.event_id.as_str()).execute(&mut **tx).await?;
        Ok(serde_json::json!({}))
    }
}

/// End to end with the real dispatcher and the real consumer: the key is
/// rotated between two events (dispatchers switched from the old key to the
/// new), the consumer accepts both keys; a forgery with this outbox's source
/// but no signature is quarantined and ships nothing.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn signed_events_are_applied_once_across_a_key_rotation_and_a_forgery_ships_nothing(pool: PgPool) {
    let f = fixture(pool).await;
    outbox_consumer::migrate(&f.pool).await.unwrap();
    sqlx::query("CREATE TABLE shipments (id bigserial PRIMARY KEY, event_id text NOT NULL)").execute(&f.pool).await.unwrap();
    let old = SigningConfig { key_id: "k-2026-11".into(), secret_hex: "11".repeat(32) };
    let new = SigningConfig { key_id: "k-2026-12".into(), secret_hex: "22".repeat(32) };
    let a = create_order(&f.pool, "o-old-key", 1).await;
    assert_eq!(f.dispatcher(Some(old.clone())).dispatch_once("w").await.unwrap().published, 1);
    let b = create_order(&f.pool, "o-new-key", 2).await;
    assert_eq!(f.dispatcher(Some(new.clone())).dispatch_once("w").await.unwrap().published, 1);
    // A forgery: real-looking headers, this outbox's source, a fresh eventId, no key.
    let real = read_topic(&f.cluster.bootstrap, TOPIC, PARTITIONS).pop().unwrap();
    let forged_id = outbox_core::EventId::generate(1);
    let mut hs: Vec<(String, Vec<u8>)> = real.headers.iter().filter(|(k, _)| !k.starts_with("ce_") && k != "content-type").cloned().collect();
    for (k, v) in hs.iter_mut() {
        if k == headers::EVENT_ID {
            *v = forged_id.as_str().as_bytes().to_vec();
        }
    }
    trust::seal(&mut hs, &f.source, None).unwrap();
    f.produce(real.partition, &real.key, &real.payload, &hs).await;

    let mut cfg = outbox_consumer::ConsumerConfig::new("shipping", f.cluster.bootstrap.clone(), &[TOPIC]);
    cfg.session_timeout_ms = 6_000;
    cfg.trust = TrustPolicy::default().accept(TOPIC, &[&f.source], true).with_key(&f.source, old.key().unwrap()).with_key(&f.source, new.key().unwrap());
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s = seen.clone();
    let consumer = outbox_consumer::IdempotentConsumer::new(cfg, f.pool.clone(), Ship).unwrap().after_db_commit(move |batch| {
        s.lock().unwrap().extend(batch.outcomes.iter().cloned());
        outbox_consumer::HookAction::Continue
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run(async move {
        let _ = stopped.await;
    }));
    wait_count(&f.pool, "SELECT (SELECT count(*) FROM outbox_consumer_receipts) + (SELECT count(*) FROM outbox_consumer_quarantine)", 3, Duration::from_secs(60)).await;
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), task).await.unwrap().unwrap().unwrap();

    let shipped: Vec<String> = sqlx::query_scalar("SELECT event_id FROM shipments ORDER BY id").fetch_all(&f.pool).await.unwrap();
    let mut want = vec![a.event_id().to_string(), b.event_id().to_string()];
    let mut got = shipped.clone();
    want.sort();
    got.sort();
    assert_eq!(got, want, "each genuine event shipped once, old key and new");
    let q: Vec<(Option<String>, String)> = sqlx::query_as("SELECT event_id, reason FROM outbox_consumer_quarantine").fetch_all(&f.pool).await.unwrap();
    assert_eq!(q, vec![(Some(forged_id.to_string()), "verify:signature_missing".to_owned())]);
    assert_eq!(seen.lock().unwrap().len(), 3);
    // The report shows the consumer's quarantine.
    let report = f.reconciler(Vec::new()).report().await.unwrap();
    assert_eq!(report.consumer_decisions.len(), 1);
    assert_eq!(report.consumer_decisions[0].quarantined_by_reason, vec![("verify:signature_missing".to_owned(), 1)]);
}
