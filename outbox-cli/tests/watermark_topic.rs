//! Consumers publish their watermarks over the broker; the reconciler reads
//! the watermark topic into the outbox database. Real PostgreSQL, librdkafka's
//! in-process Kafka cluster (or OUTBOX_KAFKA_BOOTSTRAP), the `outbox` binary.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{create_order, outbox_bin, route, Env};
use outbox_consumer::{async_trait, ConsumedEvent, ConsumerConfig, Handler, HandlerError, IdempotentConsumer};
use outbox_core::trust::SigningKey;
use outbox_core::watermark_record::{WatermarkRecord, KEY_ID_HEADER, SCHEMA, SCHEMA_HEADER, SIGNATURE_HEADER};
use outbox_core::{Clock as _, ManualClock};
use outbox_producer::kafka::KafkaBroker;
use outbox_producer::{purge, register_consumer, Dispatcher, DispatcherConfig, PgStore, Reconciler, ReconcilerConfig, RetentionPolicy, WatermarkTopicConfig, WatermarkTopicReader};
use outbox_testkit::{pick_database, KafkaFixture, TestDatabase};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use serde_json::{json, Value};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Postgres, Transaction};

/// Topics of their own per test, so that the tests also run side by side
/// against one external cluster (OUTBOX_KAFKA_BOOTSTRAP).
fn unique(name: &str) -> String {
    let n = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() % 1_000_000_000_000;
    format!("{name}-{}-{n}", std::process::id())
}

/// `postgres://<user>@host:port/<db>` on the server of `server_url` (trust
/// authentication on the test servers: the role logs in by name).
fn url_as(server_url: &str, user: &str, db: &str) -> String {
    let after = &server_url[server_url.find("://").unwrap() + 3..];
    let after = &after[after.rfind('@').map(|i| i + 1).unwrap_or(0)..];
    let host = &after[..after.find('/').unwrap_or(after.len())];
    format!("postgres://{user}@{host}/{db}")
}

/// Two databases owned by two login roles, neither able to connect to the
/// other's database; dropped (databases, then roles) at the end, also on panic.
struct TwoDatabases {
    admin_url: String,
    roles: [String; 2],
    dbs: [String; 2],
}

impl TwoDatabases {
    async fn create(admin_url: &str) -> TwoDatabases {
        let n = format!("{}_{}", std::process::id(), std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() % 1_000_000_000);
        let t = TwoDatabases {
            admin_url: admin_url.to_owned(),
            roles: [format!("wm_orders_{n}"), format!("wm_shipping_{n}")],
            dbs: [format!("wm_orders_db_{n}"), format!("wm_shipping_db_{n}")],
        };
        let admin = PgPool::connect(admin_url).await.unwrap();
        for (role, db) in t.roles.iter().zip(&t.dbs) {
            sqlx::query(&format!("CREATE ROLE {role} LOGIN")).execute(&admin).await.unwrap();
            sqlx::query(&format!("CREATE DATABASE {db} OWNER {role}")).execute(&admin).await.unwrap();
            // Nobody but its owner may connect (PUBLIC has CONNECT by default).
            sqlx::query(&format!("REVOKE ALL ON DATABASE {db} FROM PUBLIC")).execute(&admin).await.unwrap();
        }
        admin.close().await;
        t
    }

    fn url(&self, role: usize, db: usize) -> String {
        url_as(&self.admin_url, &self.roles[role], &self.dbs[db])
    }
}

impl Drop for TwoDatabases {
    fn drop(&mut self) {
        let (url, roles, dbs) = (self.admin_url.clone(), self.roles.clone(), self.dbs.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                if let Ok(pool) = PgPool::connect(&url).await {
                    for db in dbs {
                        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)")).execute(&pool).await;
                    }
                    for r in roles {
                        let _ = sqlx::query(&format!("DROP ROLE IF EXISTS {r}")).execute(&pool).await;
                    }
                }
            });
        })
        .join();
    }
}

/// Records each event in the shipping service's own table.
struct Ship;

#[async_trait]
impl Handler for Ship {
    async fn handle(&self, tx: &mut Transaction<'_, Postgres>, e: &ConsumedEvent) -> Result<Value, HandlerError> {
        sqlx::query("INSERT INTO shipments (event_id) VALUES ($1)").bind(e.event_id.as_str()).execute(&mut **tx).await?;
        Ok(json!({ "shipped": true }))
    }
}

/// The dispatcher's Kafka settings: one record per produce batch, so that a
/// broker that reports a partition's end as its last batch's base offset + 1
/// (tansu 0.6) reports it exactly (see docs/OPERATIONS.md).
fn one_record_per_batch(c: &mut outbox_producer::kafka::KafkaConfig) {
    c.message_timeout_ms = 10_000;
    c.extra.push(("batch.num.messages".into(), "1".into()));
}

async fn dispatch_all(pool: &PgPool, broker: &Arc<KafkaBroker>, want: i64) {
    let d = Dispatcher::new(PgStore::new(pool.clone()), broker.clone(), DispatcherConfig { name: "d".into(), ..Default::default() }).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        d.dispatch_once("w").await.unwrap();
        let published: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").fetch_one(pool).await.unwrap();
        if published >= want {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "only {published} of {want} published");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn run_outbox(database_url: &str, args: &[&str]) -> String {
    run_outbox_with(database_url, &[], args)
}

fn run_outbox_with(database_url: &str, env: &[(&str, &str)], args: &[&str]) -> String {
    let out = outbox_bin().env("DATABASE_URL", database_url).envs(env.iter().copied()).args(args).output().expect("run outbox");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
    eprintln!("$ outbox {}\n{stdout}{stderr}", args.join(" "));
    assert!(out.status.success(), "outbox {} failed: {stderr}", args.join(" "));
    stdout
}

/// The issue's "Must show": the shipping service's consumer runs on its own
/// database under its own login role, the outbox on another; neither role
/// can even connect to the other's database. The consumer publishes its
/// watermarks over the broker, `outbox reconcile` reads them and reports the
/// consumer caught up, `outbox status` shows zero lag, `outbox trace` shows
/// the event passed, and retention purges only what the published watermark passed.
#[tokio::test]
async fn watermarks_over_the_broker_without_cross_database_credentials() {
    let server = pick_database().await.unwrap_or_else(|e| panic!("{e}"));
    let two = TwoDatabases::create(server.url()).await;
    let (orders_url, shipping_url) = (two.url(0, 0), two.url(1, 1));
    // No grants on each other's database: not even a connection.
    for (role, db) in [(1, 0), (0, 1)] {
        let err = PgPool::connect(&two.url(role, db)).await.expect_err("a role must not reach the other's database");
        assert!(err.to_string().contains("permission denied"), "{err}");
    }
    let orders = PgPoolOptions::new().max_connections(6).connect(&orders_url).await.unwrap();
    let shipping = PgPoolOptions::new().max_connections(6).connect(&shipping_url).await.unwrap();
    // The outbox database: the producer's schema and the watermark table.
    run_outbox(&orders_url, &["migrate"]);
    outbox_consumer::migrate(&shipping).await.unwrap();
    sqlx::query("CREATE TABLE shipments (event_id text PRIMARY KEY)").execute(&shipping).await.unwrap();

    let kafka = KafkaFixture::start().unwrap();
    let (topic, wm_topic) = (unique("orders"), unique("watermarks"));
    kafka.create_topic(&topic, 2).await.unwrap();
    let broker = kafka.broker(one_record_per_batch).await.unwrap();
    route(&orders, broker.cluster_id(), &topic, 2).await;
    register_consumer(&orders, "shipping", &[&topic], true, true).await.unwrap();
    let mut first = Vec::new();
    for i in 0..6 {
        first.push(create_order(&orders, &format!("o-{i}")).await.event_id().to_string());
    }
    dispatch_all(&orders, &broker, 6).await;

    // The shipping service: its own database, publishing signed watermark
    // records over the broker (the reconciler refuses unsigned ones).
    let secret = "4c".repeat(32);
    let mut cfg = ConsumerConfig::new("shipping", kafka.bootstrap(), &[&topic]);
    cfg.watermark_publish_interval_ms = 200;
    cfg.watermark_topic = Some(wm_topic.clone());
    cfg.watermark_signing_key = Some(SigningKey::from_hex("wm-1", &secret).unwrap());
    let counters = run_shipping_until(cfg, &shipping, "the consumer did not apply the events", |_, shipped| shipped >= 6).await;
    let published = counters.watermark_records_published;
    assert!(published >= 1, "{counters:?}");
    let rows = |pool: PgPool| async move {
        sqlx::query_as::<_, (String, i32, i64, i64)>("SELECT topic, partition, committed_offset, applied_count FROM outbox_consumer_watermarks WHERE consumer_id = 'shipping' ORDER BY 1, 2")
            .fetch_all(&pool)
            .await
            .unwrap()
    };
    let consumer_rows = rows(shipping.clone()).await;
    assert_eq!(consumer_rows.iter().map(|r| r.3).sum::<i64>(), 6);

    // Before the watermark topic is read, the outbox knows of no consumption:
    // every event is unconsumed (so the checks below can fail).
    let unread = Reconciler::new(PgStore::new(orders.clone()), broker.clone(), ReconcilerConfig { owner: "r".into(), unconsumed_after_ms: 0, ..Default::default() }).unwrap();
    assert_eq!(unread.compare_once().await.unwrap().unconsumed_published, 6);
    let status = outbox_cli::status::status(&orders, outbox_producer::report::DEFAULT_RECONCILER_STALE_MS).await.unwrap();
    assert_eq!(status.consumers[0].total_lag_events, 6);

    // The producer side's reconciler reads the watermark topic (with the
    // consumer's verification key) and reports the consumer caught up.
    let keys = format!("shipping=wm-1={secret}");
    let out = run_outbox_with(
        &orders_url,
        &[("OUTBOX_RECONCILE_WATERMARK_KEYS", &keys)],
        &["reconcile", "--once", "--json", "--kafka-bootstrap", kafka.bootstrap(), "--watermark-topic", &wm_topic, "--unconsumed-after-ms", "0"],
    );
    let round: Value = serde_json::from_str(&out).unwrap();
    assert!(round["watermarkTopic"]["applied"].as_u64().unwrap() >= 2, "{round}");
    assert_eq!(round["watermarkTopic"]["movedBack"], 0, "{round}");
    assert_eq!(round["compared"]["unconsumedPublished"], 0, "{round}");
    assert_eq!(round["report"]["findings"], json!([]), "caught up: no finding left open: {round}");
    assert_eq!(rows(orders.clone()).await, consumer_rows, "the outbox holds what the consumer's database holds");
    // The records named the log each offset was read in (`.v4`).
    let log_ids = |pool: PgPool| async move {
        sqlx::query_scalar::<_, Option<String>>("SELECT log_id FROM outbox_consumer_watermarks WHERE consumer_id = 'shipping' ORDER BY topic, partition")
            .fetch_all(&pool)
            .await
            .unwrap()
    };
    let consumer_logs = log_ids(shipping.clone()).await;
    assert!(consumer_logs.iter().all(Option::is_some), "the cluster gives topic ids: {consumer_logs:?}");
    assert_eq!(log_ids(orders.clone()).await, consumer_logs);

    // Status: zero lag (library and binary).
    let status = outbox_cli::status::status(&orders, outbox_producer::report::DEFAULT_RECONCILER_STALE_MS).await.unwrap();
    assert_eq!(status.consumers[0].total_lag_events, 0, "{status:?}");
    let text = run_outbox(&orders_url, &["status"]);
    assert!(text.contains(&format!("consumer shipping [critical,mandatory] topics [{topic:?}]: lag 0 events")), "{text}");

    // Trace: consumption evidence without the consumer's database.
    let trace = run_outbox(&orders_url, &["trace", &first[0]]);
    assert!(trace.contains("declared consumers' watermarks:\n  shipping passed (committed offset"), "{trace}");

    // Four more events, published while the consumer is stopped.
    for i in 6..10 {
        create_order(&orders, &format!("o-{i}")).await;
    }
    dispatch_all(&orders, &broker, 10).await;
    let trace = run_outbox(&orders_url, &["trace", &sqlx::query_scalar::<_, String>("SELECT event_id FROM outbox_events ORDER BY seq DESC LIMIT 1").fetch_one(&orders).await.unwrap()]);
    assert!(trace.contains("  shipping not_yet"), "{trace}");

    // Retention purges only below the published watermark.
    let now: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::bigint + 1000").fetch_one(&orders).await.unwrap();
    let policy = RetentionPolicy { replay_window_ms: 0, ..Default::default() };
    let r = purge(&orders, now, &policy, false, |_| {}).await.unwrap();
    assert_eq!((r.purged, r.held_by_consumers), (6, 4), "{r:?}");
    let purged: Vec<String> = sqlx::query_scalar("SELECT event_id FROM outbox_events WHERE state = 'PURGED' ORDER BY event_id").fetch_all(&orders).await.unwrap();
    first.sort();
    assert_eq!(purged, first);

    orders.close().await;
    shipping.close().await;
    drop(two);
}

/// Runs the shipping consumer of `cfg` over `db` until `done` holds for its
/// counters and the shipments it made (checked every 100 ms, at most 60 s;
/// `what` says what was awaited), then stops it gracefully (it publishes its
/// watermarks once more); answers its counters.
async fn run_shipping_until(cfg: ConsumerConfig, db: &PgPool, what: &str, done: impl Fn(&outbox_consumer::MetricsSnapshot, i64) -> bool) -> outbox_consumer::MetricsSnapshot {
    let consumer = IdempotentConsumer::new(cfg, db.clone(), Ship).unwrap();
    let metrics = consumer.metrics();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(consumer.run(async move {
        let _ = stopped.await;
    }));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let shipments = sqlx::query_scalar::<_, i64>("SELECT count(*) FROM shipments").fetch_one(db).await.unwrap();
        if done(&metrics.snapshot(), shipments) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{what}: {:?}", metrics.snapshot());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.send(()).unwrap();
    running.await.unwrap().unwrap();
    metrics.snapshot()
}

/// One declared consumer ("shipping") on a single-partition topic with
/// three published events, and a raw producer to write records to the
/// watermark topic as any client with write access could; `key` is
/// shipping's watermark signing key, which [`Rig::send`] signs with and
/// [`Rig::reader`] verifies with.
struct Rig {
    env: Env,
    kafka: KafkaFixture,
    broker: Arc<KafkaBroker>,
    producer: FutureProducer,
    clock: ManualClock,
    topic: String,
    wm_topic: String,
    key: SigningKey,
}

async fn rig(prefix: &str) -> Rig {
    let env = Env::new(prefix).await;
    outbox_producer::migrate(env.pool()).await.unwrap();
    outbox_consumer::migrate(env.pool()).await.unwrap();
    let kafka = KafkaFixture::start().unwrap();
    let (topic, wm_topic) = (unique("orders"), unique("watermarks"));
    kafka.create_topic(&topic, 1).await.unwrap();
    kafka.create_topic(&wm_topic, 1).await.unwrap();
    let broker = kafka.broker(one_record_per_batch).await.unwrap();
    route(env.pool(), broker.cluster_id(), &topic, 1).await;
    register_consumer(env.pool(), "shipping", &[&topic], true, true).await.unwrap();
    for i in 0..3 {
        create_order(env.pool(), &format!("o-{i}")).await;
    }
    dispatch_all(env.pool(), &broker, 3).await;
    let producer: FutureProducer = ClientConfig::new().set("bootstrap.servers", kafka.bootstrap()).create().unwrap();
    let now: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::bigint").fetch_one(env.pool()).await.unwrap();
    let key = SigningKey::from_hex("wm-rig", &"5a".repeat(32)).unwrap();
    Rig { env, kafka, broker, producer, clock: ManualClock::new(now), topic, wm_topic, key }
}

impl Rig {
    fn record(&self, consumer: &str, committed: i64, updated_at_ms: i64) -> WatermarkRecord {
        WatermarkRecord {
            consumer_id: consumer.into(),
            group_id: consumer.into(),
            cluster_id: self.broker.cluster_id().into(),
            topic: self.topic.clone(),
            topic_id: None,
            log_id: None,
            anchor_recorded: false,
            anchor_event_id: None,
            partition: 0,
            committed_offset: committed,
            open_gap_end: None,
            applied_count: committed,
            duplicate_count: 0,
            quarantined_count: 0,
            dead_lettered_count: 0,
            last_event_id: None,
            updated_at_ms,
            published_at_ms: updated_at_ms,
        }
    }

    async fn send_raw(&self, key: &[u8], value: &[u8]) {
        let headers = OwnedHeaders::new().insert(Header { key: SCHEMA_HEADER, value: Some(SCHEMA) });
        self.producer.send(FutureRecord::to(&self.wm_topic).key(key).payload(value).headers(headers), Duration::from_secs(10)).await.map_err(|(e, _)| e).unwrap();
    }

    /// A record signed with the rig's key (the one [`Rig::reader`] holds for shipping).
    async fn send(&self, r: &WatermarkRecord) {
        self.send_signed(r, self.key.key_id(), &r.signature(&self.key)).await;
    }

    /// A record without signature headers.
    async fn send_unsigned(&self, r: &WatermarkRecord) {
        self.send_raw(&r.key_bytes(), &r.value_bytes()).await;
    }

    /// A record with the given key id and signature headers.
    async fn send_signed(&self, r: &WatermarkRecord, key_id: &str, signature: &str) {
        let headers = OwnedHeaders::new()
            .insert(Header { key: SCHEMA_HEADER, value: Some(SCHEMA) })
            .insert(Header { key: KEY_ID_HEADER, value: Some(key_id) })
            .insert(Header { key: SIGNATURE_HEADER, value: Some(signature) });
        let (key, value) = (r.key_bytes(), r.value_bytes());
        self.producer.send(FutureRecord::to(&self.wm_topic).key(&key).payload(&value).headers(headers), Duration::from_secs(10)).await.map_err(|(e, _)| e).unwrap();
    }

    /// A record signed with the rig's key, naming the database that decided it.
    async fn send_decided(&self, r: &WatermarkRecord, decider: &str) {
        let signature = r.signature(&self.key);
        let headers = OwnedHeaders::new()
            .insert(Header { key: SCHEMA_HEADER, value: Some(SCHEMA) })
            .insert(Header { key: KEY_ID_HEADER, value: Some(self.key.key_id()) })
            .insert(Header { key: SIGNATURE_HEADER, value: Some(signature.as_str()) })
            .insert(Header { key: outbox_core::watermark_record::DECIDER_HEADER, value: Some(decider) });
        let (key, value) = (r.key_bytes(), r.value_bytes());
        self.producer.send(FutureRecord::to(&self.wm_topic).key(&key).payload(&value).headers(headers), Duration::from_secs(10)).await.map_err(|(e, _)| e).unwrap();
    }

    /// A reader holding shipping's key.
    async fn reader(&self) -> WatermarkTopicReader {
        self.reader_with(WatermarkTopicConfig::new(self.kafka.bootstrap()).with_key("shipping", self.key.clone())).await
    }

    async fn reader_with(&self, mut cfg: WatermarkTopicConfig) -> WatermarkTopicReader {
        cfg.topic = self.wm_topic.clone();
        WatermarkTopicReader::connect(self.env.pool().clone(), cfg).await.unwrap().with_clock(Arc::new(self.clock.clone()))
    }

    fn reconciler(&self, stale_after_ms: i64) -> Reconciler<KafkaBroker> {
        let cfg = ReconcilerConfig { owner: "r".into(), stale_watermark_after_ms: stale_after_ms, ..Default::default() };
        Reconciler::new(PgStore::with_clock(self.env.pool().clone(), Arc::new(self.clock.clone())), self.broker.clone(), cfg).unwrap()
    }

    async fn committed(&self, consumer: &str) -> Option<i64> {
        sqlx::query_scalar("SELECT committed_offset FROM outbox_consumer_watermarks WHERE consumer_id = $1").bind(consumer).fetch_optional(self.env.pool()).await.unwrap()
    }

    async fn details(&self, kind: &str) -> Vec<(String, String)> {
        sqlx::query_as("SELECT consumer_id, detail FROM outbox_findings WHERE kind = $1 AND resolved_at_ms IS NULL ORDER BY id")
            .bind(kind)
            .fetch_all(self.env.pool())
            .await
            .unwrap()
    }

    async fn open_findings(&self, kind: &str) -> Vec<(String, String)> {
        sqlx::query_as("SELECT event_id, consumer_id FROM outbox_findings WHERE kind = $1 AND resolved_at_ms IS NULL ORDER BY id")
            .bind(kind)
            .fetch_all(self.env.pool())
            .await
            .unwrap()
    }
}

/// Records from an undeclared consumer, that move a watermark back, that lie
/// beyond the partition's end, or that do not decode are ignored and are
/// findings (left open by later comparison rounds); an older record
/// (reordered publication) is ignored quietly; a good one is applied.
#[tokio::test]
async fn bad_watermark_records_are_ignored_and_reported() {
    let rig = rig("wm_bad").await;
    let t = rig.clock.now_ms();
    rig.send(&rig.record("shipping", 2, t)).await; // applied
    rig.send(&rig.record("intruder", 3, t)).await; // undeclared
    rig.send(&rig.record("shipping", 1, t + 10)).await; // newer, yet moves back
    rig.send(&rig.record("shipping", 99, t + 20)).await; // beyond the end (3)
    rig.send(&rig.record("shipping", 3, t - 10)).await; // older than the stored one
    rig.send_raw(b"not a key", b"not a record").await; // undecodable
    let reader = rig.reader().await;
    let report = reader.ingest_once().await.unwrap();
    assert_eq!(
        (report.read, report.applied, report.undeclared, report.moved_back, report.beyond_end, report.out_of_date, report.rejected),
        (6, 1, 1, 1, 1, 1, 1),
        "{report:?}"
    );
    assert_eq!(rig.committed("shipping").await, Some(2), "nothing but the first record moved the watermark");
    assert_eq!(rig.committed("intruder").await, None, "an undeclared consumer gets no watermark");
    let log = format!("{}/{}/0", rig.broker.cluster_id(), rig.topic);
    assert_eq!(rig.open_findings("watermark_undeclared_consumer").await, vec![(log.clone(), "intruder".to_owned())]);
    assert_eq!(rig.open_findings("watermark_moved_back").await, vec![(log.clone(), "shipping".to_owned())]);
    assert_eq!(rig.open_findings("watermark_beyond_end").await, vec![(log, "shipping".to_owned())]);
    assert_eq!(rig.open_findings("watermark_rejected").await.len(), 1);

    // Read once: a second round reads nothing again.
    assert_eq!(reader.ingest_once().await.unwrap().read, 0);
    // Evidence stays open through comparison rounds, and shows in the report.
    let reconciler = rig.reconciler(60_000);
    reconciler.compare_once().await.unwrap();
    assert_eq!(rig.open_findings("watermark_moved_back").await.len(), 1);
    let report = reconciler.report().await.unwrap().to_text();
    assert!(report.contains("watermark_undeclared_consumer"), "{report}");

    // A good record later is applied.
    rig.send(&rig.record("shipping", 3, t + 30)).await;
    assert_eq!(reader.ingest_once().await.unwrap().applied, 1);
    assert_eq!(rig.committed("shipping").await, Some(3));
    rig.env.drop_now().await;
}

/// The defect: with no verification key for a declared consumer, an
/// unsigned record written by anyone with write access to the watermark
/// topic moved that consumer's watermark (and retention then purged what
/// the consumer never read). Now it moves nothing and is a
/// `watermark_rejected` finding saying how to configure a key or opt out;
/// more such records keep one open finding per consumer and log. With the
/// consumer opted out explicitly, the same record is applied.
#[tokio::test]
async fn an_unsigned_watermark_record_moves_nothing_without_an_opt_out() {
    let rig = rig("wm_nokey").await;
    let t = rig.clock.now_ms();
    rig.send_unsigned(&rig.record("shipping", 3, t)).await;
    let reader = rig.reader_with(WatermarkTopicConfig::new(rig.kafka.bootstrap())).await;
    let report = reader.ingest_once().await.unwrap();
    assert_eq!((report.read, report.applied, report.rejected, report.no_key, report.bad_signature), (1, 0, 1, 1, 0), "{report:?}");
    assert_eq!(rig.committed("shipping").await, None, "an unsigned record of a consumer without a key moved its watermark");
    let rejected = rig.details("watermark_rejected").await;
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    let (consumer, detail) = &rejected[0];
    assert_eq!(consumer, "shipping");
    for want in ["no watermark verification key is configured for this consumer", "OUTBOX_RECONCILE_WATERMARK_KEYS", "--watermark-unsigned shipping", "allow_unsigned"] {
        assert!(detail.contains(want), "{want}: {detail}");
    }
    let log = format!("{}/{}/0", rig.broker.cluster_id(), rig.topic);
    assert_eq!(rig.open_findings("watermark_rejected").await, vec![(log, "shipping".to_owned())], "the finding names the log, not the record");
    // A signed record is refused too: the reader holds no key to check it with.
    let r = rig.record("shipping", 3, t + 10);
    rig.send_signed(&r, rig.key.key_id(), &r.signature(&rig.key)).await;
    rig.send_unsigned(&rig.record("shipping", 3, t + 20)).await;
    let report = reader.ingest_once().await.unwrap();
    assert_eq!((report.read, report.applied, report.no_key), (2, 0, 2), "{report:?}");
    assert_eq!(rig.committed("shipping").await, None);
    let rejected = rig.details("watermark_rejected").await;
    assert_eq!(rejected.len(), 1, "still one open finding for the consumer's log: {rejected:?}");
    assert!(rejected[0].1.contains(&format!("{}/0@2 ignored", rig.wm_topic)), "the detail names the last record: {rejected:?}");
    // Retention is not fooled: nothing is purged for shipping.
    let policy = RetentionPolicy { replay_window_ms: 0, ..Default::default() };
    let purged = purge(rig.env.pool(), rig.clock.now_ms() + 1_000, &policy, false, |_| {}).await.unwrap();
    assert_eq!((purged.purged, purged.held_by_consumers), (0, 3), "{purged:?}");

    // Opted out explicitly: the same records, read again from the start, are applied.
    sqlx::query("DELETE FROM outbox_watermark_topic_cursors").execute(rig.env.pool()).await.unwrap();
    let opted = rig.reader_with(WatermarkTopicConfig::new(rig.kafka.bootstrap()).allow_unsigned("shipping")).await;
    let report = opted.ingest_once().await.unwrap();
    assert_eq!((report.read, report.applied, report.rejected, report.no_key), (3, 3, 0, 0), "{report:?}");
    assert_eq!(rig.committed("shipping").await, Some(3));
    rig.env.drop_now().await;
}

/// `outbox reconcile` refuses a declared consumer's unsigned records by
/// default (`noKey` in `--json`, the hint on stderr), applies them with the
/// consumer named in OUTBOX_RECONCILE_WATERMARK_UNSIGNED (or
/// `--watermark-unsigned`, or `[reconcile] watermark_unsigned`), prints the
/// opt-out in `--print-config`, and refuses keys and an opt-out for one
/// consumer as a configuration error.
#[tokio::test]
async fn outbox_reconcile_applies_unsigned_records_only_of_consumers_opted_out() {
    let rig = rig("wm_nokey_cli").await;
    register_consumer(rig.env.pool(), "billing", &[&rig.topic], true, true).await.unwrap();
    let t = rig.clock.now_ms();
    rig.send_unsigned(&rig.record("shipping", 2, t)).await;
    rig.send_unsigned(&rig.record("billing", 1, t)).await;
    let url = rig.env.db.url.clone();
    let reconcile = |env: &[(&str, &str)], extra: &[&str]| {
        let out = outbox_bin()
            .env("DATABASE_URL", &url)
            .envs(env.iter().copied())
            .args(["reconcile", "--once", "--kafka-bootstrap", rig.kafka.bootstrap(), "--watermark-topic", &rig.wm_topic])
            .args(extra)
            .output()
            .unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
        eprintln!("{stdout}{stderr}");
        (out.status.code(), stdout, stderr)
    };

    let (code, out, err) = reconcile(&[], &["--json"]);
    assert_eq!(code, Some(0), "{err}");
    let round: Value = serde_json::from_str(&out).unwrap();
    let w = &round["watermarkTopic"];
    assert_eq!((w["read"].as_u64(), w["applied"].as_u64(), w["rejected"].as_u64(), w["noKey"].as_u64(), w["badSignature"].as_u64()), (Some(2), Some(0), Some(2), Some(2), Some(0)), "{round}");
    assert!(err.contains("without a verification key refused"), "{err}");
    assert_eq!((rig.committed("shipping").await, rig.committed("billing").await), (None, None));

    // Billing opted out through the environment (shipping still not): billing's record applied.
    sqlx::query("DELETE FROM outbox_watermark_topic_cursors").execute(rig.env.pool()).await.unwrap();
    let (code, out, err) = reconcile(&[("OUTBOX_RECONCILE_WATERMARK_UNSIGNED", "billing")], &["--json"]);
    assert_eq!(code, Some(0), "{err}");
    let round: Value = serde_json::from_str(&out).unwrap();
    let w = &round["watermarkTopic"];
    assert_eq!((w["applied"].as_u64(), w["noKey"].as_u64()), (Some(1), Some(1)), "{round}");
    assert!(err.contains("applied unsigned (opted out of verification)") && err.contains("billing"), "{err}");
    assert_eq!((rig.committed("shipping").await, rig.committed("billing").await), (None, Some(1)));

    // Both opted out with the flag (repeatable, comma-separated too): the text line counts them.
    sqlx::query("DELETE FROM outbox_watermark_topic_cursors").execute(rig.env.pool()).await.unwrap();
    let (code, out, err) = reconcile(&[], &["--watermark-unsigned", "shipping,billing"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("watermark topic: read 2 records, applied 2, out of date 0;") && out.contains("rejected 0 (signature check 0, no key 0)"), "{out}");
    assert_eq!(rig.committed("shipping").await, Some(2));

    // --print-config shows the opt-out; from the file, replaced by the flag.
    let file = std::env::temp_dir().join(format!("{}.toml", unique("wm-unsigned")));
    std::fs::write(&file, "[reconcile]\nwatermark_unsigned = [\"billing\"]\n").unwrap();
    let print = |extra: &[&str]| {
        let out = outbox_bin().env("DATABASE_URL", &url).args(["reconcile", "--print-config", "--kafka-bootstrap", "127.0.0.1:1", "--config"]).arg(&file).args(extra).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let doc: toml::Table = String::from_utf8_lossy(&out.stdout).parse().unwrap();
        doc["reconcile"]["watermark_unsigned"].clone()
    };
    assert_eq!(print(&[]), toml::Value::Array(vec![toml::Value::String("billing".into())]));
    assert_eq!(print(&["--watermark-unsigned", "shipping"]), toml::Value::Array(vec![toml::Value::String("shipping".into())]));
    // Keys and an opt-out for one consumer: refused before anything runs.
    let out = outbox_bin()
        .env("DATABASE_URL", &url)
        .env("OUTBOX_RECONCILE_WATERMARK_KEYS", format!("billing=wm-1={}", "6b".repeat(32)))
        .args(["reconcile", "--print-config", "--kafka-bootstrap", "127.0.0.1:1", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("consumer billing has watermark verification keys and is also allowed unsigned"), "{err}");
    let out = outbox_bin().env("DATABASE_URL", &url).args(["reconcile", "--print-config", "--kafka-bootstrap", "127.0.0.1:1", "--watermark-unsigned", "bad id"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--watermark-unsigned"), "{}", String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_file(&file);
    rig.env.drop_now().await;
}

/// A topic deleted and created again under the same name is two logs: a
/// consumer's records of each (`.v1` of no topic id, `.v2` naming an id) are
/// applied to the row of their own log, and a lower offset of the new log
/// is not a watermark moving back.
#[tokio::test]
async fn records_of_two_topic_ids_are_applied_to_their_own_rows() {
    let rig = rig("wm_ids").await;
    let t = rig.clock.now_ms();
    let id = "AAECAwQFBgcICQoLDA0ODw";
    rig.send(&rig.record("shipping", 3, t)).await;
    let on_new = WatermarkRecord { topic_id: Some(id.into()), ..rig.record("shipping", 1, t + 10) };
    assert!(on_new.key_bytes().starts_with(b"outboxWatermarkKey.v2\n"));
    rig.send(&on_new).await;
    let report = rig.reader().await.ingest_once().await.unwrap();
    assert_eq!((report.applied, report.moved_back, report.findings()), (2, 0, 0), "{report:?}");
    let rows: Vec<(Option<String>, i64)> =
        sqlx::query_as("SELECT topic_id, committed_offset FROM outbox_consumer_watermarks WHERE consumer_id = 'shipping' ORDER BY topic_id NULLS FIRST")
            .fetch_all(rig.env.pool())
            .await
            .unwrap();
    assert_eq!(rows, vec![(None, 3), (Some(id.to_owned()), 1)]);
    rig.env.drop_now().await;
}

/// Issue 46, replaced log: a consumer whose topic was deleted and created
/// again (or whose cluster was replaced under the same id) reads the new
/// log from offset 0 under the same key. Its `.v4` record names the log
/// its offset was read in: a lower offset of another log id replaces the
/// row's offset and log id (before `.v4` it was refused as moved back, and
/// the row kept counting the old log's offsets as consumed in the new log);
/// a lower offset of the same log, or of no log id, still moves back.
#[tokio::test]
async fn a_record_of_a_new_log_replaces_the_watermark_instead_of_moving_back() {
    let rig = rig("wm_newlog").await;
    let t = rig.clock.now_ms();
    let (old, new) = ("AAECAwQFBgcICQoLDA0ODw", "ERESERESERESERESERESEQ");
    let on_old = WatermarkRecord { log_id: Some(old.into()), ..rig.record("shipping", 3, t) };
    assert!(on_old.value_bytes().starts_with(b"outboxWatermark.v4\n"));
    rig.send(&on_old).await;
    let reader = rig.reader().await;
    assert_eq!(reader.ingest_once().await.unwrap().applied, 1);
    let row = || async {
        sqlx::query_as::<_, (i64, Option<String>)>("SELECT committed_offset, log_id FROM outbox_consumer_watermarks WHERE consumer_id = 'shipping'")
            .fetch_one(rig.env.pool())
            .await
            .unwrap()
    };
    assert_eq!(row().await, (3, Some(old.to_owned())));

    // Lower on the same log, and lower naming no log: moved back.
    rig.send(&WatermarkRecord { log_id: Some(old.into()), ..rig.record("shipping", 1, t + 10) }).await;
    rig.send(&rig.record("shipping", 1, t + 20)).await;
    let report = reader.ingest_once().await.unwrap();
    assert_eq!((report.applied, report.moved_back), (0, 2), "{report:?}");
    assert_eq!(row().await, (3, Some(old.to_owned())));

    // Lower on a new log: the consumer's reading started over there.
    rig.send(&WatermarkRecord { log_id: Some(new.into()), applied_count: 4, ..rig.record("shipping", 1, t + 30) }).await;
    let report = reader.ingest_once().await.unwrap();
    assert_eq!((report.applied, report.moved_back), (1, 0), "{report:?}");
    assert_eq!(row().await, (1, Some(new.to_owned())), "the new log's offset and id replace the old log's");

    // The anchor a `.v4` record carries is stored with the row (retention
    // finds its receipt there); a record older than `.v4` at the same
    // offset leaves it, one that moves the offset takes its own.
    let anchor = "evt-01KBBKB13V04HMASW9NF6YY093";
    let anchored = WatermarkRecord { log_id: Some(new.into()), anchor_recorded: true, anchor_event_id: Some(anchor.into()), applied_count: 5, ..rig.record("shipping", 2, t + 40) };
    assert!(anchored.value_bytes().windows(13).any(|w| w == b"anchorEventId"));
    rig.send(&anchored).await;
    rig.send(&WatermarkRecord { applied_count: 5, ..rig.record("shipping", 2, t + 50) }).await;
    assert_eq!(reader.ingest_once().await.unwrap().applied, 2);
    let stored_anchor = || async {
        sqlx::query_as::<_, (bool, Option<String>)>("SELECT anchor_recorded, anchor_event_id FROM outbox_consumer_watermarks WHERE consumer_id = 'shipping'")
            .fetch_one(rig.env.pool())
            .await
            .unwrap()
    };
    assert_eq!(stored_anchor().await, (true, Some(anchor.to_owned())));
    rig.send(&WatermarkRecord { applied_count: 6, ..rig.record("shipping", 3, t + 60) }).await;
    assert_eq!(reader.ingest_once().await.unwrap().applied, 1);
    assert_eq!(stored_anchor().await, (false, None), "moved by a record that records no anchor");
    rig.env.drop_now().await;
}

/// Issue 46: a consumer gap is a reconciler finding naming the consumer,
/// the log and the range. A record whose watermark stands at an open gap
/// (`outboxWatermark.v3`) is applied and opens `consumer_gap`; comparison
/// rounds leave it open; an older record changes nothing; the consumer's
/// first newer record without the gap (replayed, or accepted) resolves it.
#[tokio::test]
async fn a_watermark_standing_at_a_gap_is_a_consumer_gap_finding_until_a_record_without_it() {
    let rig = rig("wm_gap").await;
    let t = rig.clock.now_ms();
    let gapped = WatermarkRecord { open_gap_end: Some(3), ..rig.record("shipping", 1, t) };
    assert!(gapped.value_bytes().starts_with(b"outboxWatermark.v3\n"));
    rig.send(&gapped).await;
    let reader = rig.reader().await;
    let report = reader.ingest_once().await.unwrap();
    assert_eq!((report.applied, report.gaps, report.findings()), (1, 1, 0), "{report:?}");
    assert_eq!(rig.committed("shipping").await, Some(1), "the watermark stays at the gap's start");
    let log = format!("{}/{}/0", rig.broker.cluster_id(), rig.topic);
    assert_eq!(rig.open_findings("consumer_gap").await, vec![(log.clone(), "shipping".to_owned())]);
    let details = rig.details("consumer_gap").await;
    assert!(details[0].1.contains("skipped offsets [1, 3)") && details[0].1.contains(&log), "{details:?}");
    rig.reconciler(60_000).compare_once().await.unwrap();
    assert_eq!(rig.open_findings("consumer_gap").await.len(), 1, "a comparison round leaves the gap open");

    // A reordered older record without the gap resolves nothing.
    rig.send(&rig.record("shipping", 1, t - 1_000)).await;
    assert_eq!(reader.ingest_once().await.unwrap().out_of_date, 1);
    assert_eq!(rig.open_findings("consumer_gap").await.len(), 1);

    // The range replayed: the watermark moves on and the finding resolves.
    rig.send(&rig.record("shipping", 3, t + 1_000)).await;
    let report = reader.ingest_once().await.unwrap();
    assert_eq!((report.applied, report.gaps), (1, 0), "{report:?}");
    assert!(rig.open_findings("consumer_gap").await.is_empty(), "resolved by the record without the gap");
    assert_eq!(rig.committed("shipping").await, Some(3));
    rig.env.drop_now().await;
}

/// A record on the watermark topic with a header name that is not UTF-8
/// (rdkafka's own header accessor panics on it): the reader reads past it
/// without panicking, and the record is judged like any other.
#[tokio::test]
async fn a_record_with_a_non_utf8_header_name_is_read_without_panicking() {
    let rig = rig("wm_header").await;
    let r = rig.record("shipping", 2, rig.clock.now_ms());
    let signature = r.signature(&rig.key);
    let headers = OwnedHeaders::new()
        .insert(Header { key: SCHEMA_HEADER, value: Some(SCHEMA) })
        .insert(Header { key: KEY_ID_HEADER, value: Some(rig.key.key_id()) })
        .insert(Header { key: SIGNATURE_HEADER, value: Some(&signature) });
    let native = headers.as_borrowed() as *const rdkafka::message::BorrowedHeaders as *mut rdkafka::bindings::rd_kafka_headers_t;
    let name = [b'x', 0xff, 0xfe];
    // SAFETY: `headers` owns the list; librdkafka copies name and value.
    let err = unsafe { rdkafka::bindings::rd_kafka_header_add(native, name.as_ptr().cast(), name.len() as isize, b"v".as_ptr().cast(), 1) };
    assert_eq!(err, rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR);
    let (key, value) = (r.key_bytes(), r.value_bytes());
    rig.producer.send(FutureRecord::to(&rig.wm_topic).key(&key).payload(&value).headers(headers), Duration::from_secs(10)).await.map_err(|(e, _)| e).unwrap();
    let report = rig.reader().await.ingest_once().await.unwrap();
    assert_eq!((report.read, report.applied), (1, 1), "{report:?}");
    assert_eq!(rig.committed("shipping").await, Some(2));
    rig.env.drop_now().await;
}

/// A declared consumer whose records stop arriving for longer than the
/// threshold raises `stale_watermark`; its watermark stays and holds
/// retention; records arriving again resolve the finding.
#[tokio::test]
async fn a_consumer_that_stops_publishing_is_stale() {
    let rig = rig("wm_stale").await;
    let t = rig.clock.now_ms();
    rig.send(&rig.record("shipping", 1, t)).await;
    let reader = rig.reader().await;
    assert_eq!(reader.ingest_once().await.unwrap().applied, 1);
    let reconciler = rig.reconciler(5_000);
    assert_eq!(reconciler.compare_once().await.unwrap().stale_watermark, 0);
    rig.clock.advance(4_000);
    assert_eq!(reconciler.compare_once().await.unwrap().stale_watermark, 0, "within the threshold");
    rig.clock.advance(2_000);
    let compared = reconciler.compare_once().await.unwrap();
    assert_eq!(compared.stale_watermark, 1, "{compared:?}");
    assert_eq!(rig.open_findings("stale_watermark").await, vec![(rig.broker.cluster_id().to_owned(), "shipping".to_owned())]);
    // The stale watermark (offset 1) holds the two events above it.
    let policy = RetentionPolicy { replay_window_ms: 0, ..Default::default() };
    let r = purge(rig.env.pool(), rig.clock.now_ms() + 1_000, &policy, false, |_| {}).await.unwrap();
    assert_eq!((r.purged, r.held_by_consumers), (1, 2), "{r:?}");

    rig.send(&rig.record("shipping", 3, t + 6_000)).await;
    assert_eq!(reader.ingest_once().await.unwrap().applied, 1);
    rig.clock.advance(1_000);
    assert_eq!(reconciler.compare_once().await.unwrap().stale_watermark, 0);
    assert!(rig.open_findings("stale_watermark").await.is_empty(), "publishing again resolves it");
    rig.env.drop_now().await;
}

/// With verification keys for "shipping": a record signed by its current
/// key, or by the old one during a rotation, is applied; an unsigned record,
/// one with a wrong signature (a forged secret, or a genuine signature moved
/// onto another value) and one signed under an unknown key id are each
/// ignored and are `watermark_rejected` with the reason. "billing" has no
/// keys and is opted out explicitly: its unsigned records are applied.
#[tokio::test]
async fn watermark_signatures_are_verified_per_consumer() {
    let rig = rig("wm_sig").await;
    register_consumer(rig.env.pool(), "billing", &[&rig.topic], true, true).await.unwrap();
    let old = SigningKey::from_hex("wm-old", &"0a".repeat(32)).unwrap();
    let new = SigningKey::from_hex("wm-new", &"0b".repeat(32)).unwrap();
    let forged = SigningKey::from_hex("wm-new", &"0c".repeat(32)).unwrap();
    let stranger = SigningKey::from_hex("wm-stranger", &"0b".repeat(32)).unwrap();
    let t = rig.clock.now_ms();
    let r1 = rig.record("shipping", 1, t);
    rig.send_signed(&r1, "wm-new", &r1.signature(&new)).await; // applied
    rig.send_unsigned(&rig.record("shipping", 2, t + 10)).await; // unsigned
    let r3 = rig.record("shipping", 2, t + 20);
    rig.send_signed(&r3, "wm-new", &r3.signature(&forged)).await; // wrong secret
    let r4 = rig.record("shipping", 3, t + 30);
    rig.send_signed(&r4, "wm-new", &r1.signature(&new)).await; // r1's signature on another value
    let r5 = rig.record("shipping", 3, t + 40);
    rig.send_signed(&r5, "wm-stranger", &r5.signature(&stranger)).await; // unknown key id
    let r6 = rig.record("shipping", 2, t + 50);
    rig.send_signed(&r6, "wm-old", &r6.signature(&old)).await; // old key, during the rotation: applied
    rig.send_unsigned(&rig.record("billing", 1, t)).await; // no keys for billing, opted out: applied
    let cfg = WatermarkTopicConfig::new(rig.kafka.bootstrap()).with_key("shipping", new.clone()).with_key("shipping", old.clone()).allow_unsigned("billing");
    let reader = rig.reader_with(cfg).await;
    let report = reader.ingest_once().await.unwrap();
    assert_eq!((report.read, report.applied, report.rejected, report.bad_signature, report.no_key), (7, 3, 4, 4, 0), "{report:?}");
    assert_eq!(rig.committed("shipping").await, Some(2), "only the signed records moved the watermark (the forged ones said 2 and 3 earlier)");
    assert_eq!(rig.committed("billing").await, Some(1));
    let rejected = rig.details("watermark_rejected").await;
    assert_eq!(rejected.len(), 4, "{rejected:?}");
    assert!(rejected.iter().all(|(c, _)| c == "shipping"), "{rejected:?}");
    let why: Vec<&str> = rejected.iter().map(|(_, d)| d.as_str()).collect();
    assert!(why[0].contains("unsigned"), "{why:?}");
    assert!(why[1].contains("is not key \"wm-new\"'s signature") && why[2].contains("is not key \"wm-new\"'s signature"), "{why:?}");
    assert!(why[3].contains("\"wm-stranger\", which is none of the consumer's verification keys"), "{why:?}");
    assert!(why.iter().all(|d| !d.contains("0b0b") && !d.contains("0a0a")), "no secret in a finding: {why:?}");

    // The rotation ends: the old key is removed, and its records are refused from then on.
    let r7 = rig.record("shipping", 3, t + 60);
    rig.send_signed(&r7, "wm-old", &r7.signature(&old)).await;
    let after = rig.reader_with(WatermarkTopicConfig::new(rig.kafka.bootstrap()).with_key("shipping", new.clone())).await;
    let report = after.ingest_once().await.unwrap();
    assert_eq!((report.read, report.applied, report.rejected), (1, 0, 1), "{report:?}");
    assert_eq!(rig.committed("shipping").await, Some(2));
    rig.env.drop_now().await;
}

/// End to end: a consumer with a watermark signing key publishes signed
/// records; `outbox reconcile` with the matching key in
/// OUTBOX_RECONCILE_WATERMARK_KEYS applies them, with another secret under
/// the same key id it refuses every one of them.
#[tokio::test]
async fn a_signing_consumer_is_verified_by_outbox_reconcile() {
    let rig = rig("wm_sig_e2e").await;
    let server = pick_database().await.unwrap_or_else(|e| panic!("{e}"));
    let two = TwoDatabases::create(server.url()).await;
    let shipping = PgPoolOptions::new().max_connections(6).connect(&two.url(1, 1)).await.unwrap();
    outbox_consumer::migrate(&shipping).await.unwrap();
    sqlx::query("CREATE TABLE shipments (event_id text PRIMARY KEY)").execute(&shipping).await.unwrap();
    let secret = "1f".repeat(32);
    let mut cfg = ConsumerConfig::new("shipping", rig.kafka.bootstrap(), &[&rig.topic]);
    cfg.watermark_publish_interval_ms = 200;
    cfg.watermark_topic = Some(rig.wm_topic.clone());
    cfg.watermark_signing_key = Some(SigningKey::from_hex("wm-1", &secret).unwrap());
    let counters = run_shipping_until(cfg, &shipping, "the consumer did not apply the events", |_, shipped| shipped >= 3).await;
    assert!(counters.watermark_records_published >= 1, "{counters:?}");

    let url = rig.env.db.url.clone();
    let reconcile = |keys: String| {
        let out = outbox_bin()
            .env("DATABASE_URL", &url)
            .env("OUTBOX_RECONCILE_WATERMARK_KEYS", keys)
            .args(["reconcile", "--once", "--json", "--kafka-bootstrap", rig.kafka.bootstrap(), "--watermark-topic", &rig.wm_topic])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_str::<Value>(&stdout).unwrap()
    };
    // Another secret under the same key id: every record refused.
    let round = reconcile(format!("shipping=wm-1={}", "2e".repeat(32)));
    let w = &round["watermarkTopic"];
    assert!(w["read"].as_u64().unwrap() >= 1 && w["rejected"] == w["read"] && w["badSignature"] == w["read"] && w["applied"] == 0, "{round}");
    assert_eq!(rig.committed("shipping").await, None);
    assert!(!rig.open_findings("watermark_rejected").await.is_empty());
    // Read the topic again from its start, with the consumer's key (and an
    // unrelated one, as during a rotation): applied.
    sqlx::query("DELETE FROM outbox_watermark_topic_cursors").execute(rig.env.pool()).await.unwrap();
    let round = reconcile(format!("shipping=wm-0={}  shipping=wm-1={secret}", "3d".repeat(32)));
    let w = &round["watermarkTopic"];
    assert!(w["applied"].as_u64().unwrap() >= 1 && w["rejected"] == 0, "{round}");
    assert_eq!(rig.committed("shipping").await, Some(3), "the consumer consumed all three events");
    shipping.close().await;
    drop(two);
    rig.env.drop_now().await;
}

/// A consumer with its own database whose trust policy names a mistyped
/// source quarantines every message and applies none. Its quarantine rows
/// are out of the outbox's reach, but its watermarks count them: after
/// `outbox reconcile` read the watermark topic, `outbox status` and `outbox
/// report` show the quarantines and say loudly that nothing was applied.
#[tokio::test]
async fn a_consumer_that_quarantines_everything_is_shown_from_its_watermarks() {
    let rig = rig("wm_quarantine").await;
    let server = pick_database().await.unwrap_or_else(|e| panic!("{e}"));
    let two = TwoDatabases::create(server.url()).await;
    let shipping = PgPoolOptions::new().max_connections(6).connect(&two.url(1, 1)).await.unwrap();
    outbox_consumer::migrate(&shipping).await.unwrap();
    sqlx::query("CREATE TABLE shipments (event_id text PRIMARY KEY)").execute(&shipping).await.unwrap();
    let mut cfg = ConsumerConfig::new("shipping", rig.kafka.bootstrap(), &[&rig.topic]);
    cfg.watermark_publish_interval_ms = 200;
    cfg.watermark_topic = Some(rig.wm_topic.clone());
    cfg.trust = outbox_consumer::TrustPolicy::default().accept(&rig.topic, &["urn:uuid:00000000-0000-4000-8000-00000000000f"], false);
    let counters = run_shipping_until(cfg, &shipping, "the consumer did not decide the messages", |m, _| m.quarantined >= 3).await;
    assert_eq!(counters.applied, 0);
    assert!(counters.watermark_records_published >= 1, "{counters:?}");
    // The outbox database has no quarantine row of this consumer.
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_consumer_quarantine").fetch_one(rig.env.pool()).await.unwrap();
    assert_eq!(rows, 0);

    let url = rig.env.db.url.clone();
    // This consumer publishes unsigned records (what is shown here is its
    // quarantine counts, not signing): opted out explicitly.
    run_outbox(&url, &["reconcile", "--once", "--kafka-bootstrap", rig.kafka.bootstrap(), "--watermark-topic", &rig.wm_topic, "--watermark-unsigned", "shipping"]);
    let status = run_outbox(&url, &["status"]);
    let line = status.lines().find(|l| l.contains("quarantined 3")).unwrap_or_else(|| panic!("no quarantine line: {status}"));
    assert!(line.contains("counted by its watermarks") && line.contains("EVERY MESSAGE QUARANTINED, NONE APPLIED"), "{line}");
    let report = run_outbox(&url, &["report"]);
    assert!(report.contains("consumer shipping quarantined 3") && report.contains("EVERY MESSAGE QUARANTINED"), "{report}");
    shipping.close().await;
    drop(two);
    rig.env.drop_now().await;
}

/// A scratch replay under the production consumer's id (its own database,
/// another group) publishes records its own database decided. The reader
/// pins the database of the consumer's first record; the replay's records
/// are a second writer: one `watermark_rejected` finding naming both
/// databases, and the watermark does not move. After `outbox watermarks
/// repin` (the consumer's database really moved), the next database is
/// pinned and its records apply.
#[tokio::test]
async fn a_replay_under_the_same_consumer_id_is_a_finding_not_a_moved_watermark() {
    let rig = rig("wm_second_writer").await;
    let t = rig.clock.now_ms();
    rig.send_decided(&rig.record("shipping", 2, t), "7716/shipping").await;
    let reader = rig.reader().await;
    let r = reader.ingest_once().await.unwrap();
    assert_eq!((r.applied, r.second_writer), (1, 0), "{r:?}");
    assert_eq!(rig.committed("shipping").await, Some(2));

    // The replay: further along, decided by another database.
    rig.send_decided(&rig.record("shipping", 3, t + 1_000), "9001/shipping_replay").await;
    rig.send_decided(&rig.record("shipping", 3, t + 2_000), "9001/shipping_replay").await;
    let r = reader.ingest_once().await.unwrap();
    assert_eq!((r.applied, r.rejected, r.second_writer), (0, 2, 2), "{r:?}");
    assert_eq!(rig.committed("shipping").await, Some(2), "the replay moved nothing");
    let found = rig.details("watermark_rejected").await;
    assert_eq!(found.len(), 1, "one finding per consumer and log: {found:?}");
    assert!(found[0].1.contains("second writer") && found[0].1.contains("9001/shipping_replay") && found[0].1.contains("7716/shipping") && found[0].1.contains("OUTBOX_CONSUMER_REPLAY"), "{found:?}");
    // The production consumer goes on.
    rig.send_decided(&rig.record("shipping", 3, t + 3_000), "7716/shipping").await;
    assert_eq!(reader.ingest_once().await.unwrap().applied, 1);
    assert_eq!(rig.committed("shipping").await, Some(3));

    // The consumer's database moved: the operator forgets the old one.
    let out = run_outbox(&rig.env.db.url, &["watermarks", "repin", "--consumer", "shipping", "--operator", "ops-alice"]);
    assert!(out.contains("7716/shipping forgotten by ops-alice"), "{out}");
    rig.send_decided(&rig.record("shipping", 3, t + 4_000), "5555/shipping").await;
    let r = reader.ingest_once().await.unwrap();
    assert_eq!((r.applied + r.out_of_date, r.second_writer), (1, 0), "{r:?}");
    let pinned: Option<String> = sqlx::query_scalar("SELECT decider FROM outbox_watermark_publishers WHERE consumer_id = 'shipping'").fetch_one(rig.env.pool()).await.unwrap();
    assert_eq!(pinned.as_deref(), Some("5555/shipping"));
    rig.env.drop_now().await;
}

/// A consumer names the database that decided its records.
#[tokio::test]
async fn a_consumer_names_the_database_that_decided_its_records() {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};
    use rdkafka::message::{Headers as _, Message as _};
    let rig = rig("wm_decider_header").await;
    let shipping_db = TestDatabase::create(rig.env.server.url(), "wm_decider_shipping", 2).await.unwrap();
    outbox_consumer::migrate(&shipping_db.pool).await.unwrap();
    sqlx::query("CREATE TABLE shipments (event_id text PRIMARY KEY)").execute(&shipping_db.pool).await.unwrap();
    let mut cfg = ConsumerConfig::new("shipping", rig.kafka.bootstrap(), &[&rig.topic]);
    cfg.watermark_publish_interval_ms = 200;
    cfg.watermark_topic = Some(rig.wm_topic.clone());
    run_shipping_until(cfg, &shipping_db.pool, "nothing published", |m, _| m.watermark_records_published > 0).await;
    let expected: String = sqlx::query_scalar("SELECT (SELECT system_identifier FROM pg_control_system())::text || '/' || current_database()").fetch_one(&shipping_db.pool).await.unwrap();
    let reader: BaseConsumer = ClientConfig::new().set("bootstrap.servers", rig.kafka.bootstrap()).set("group.id", "decider-check").set("auto.offset.reset", "earliest").create().unwrap();
    reader.subscribe(&[&rig.wm_topic]).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let decider = loop {
        assert!(std::time::Instant::now() < deadline, "no record read");
        if let Some(Ok(m)) = reader.poll(Duration::from_millis(200)) {
            let hs = m.headers().expect("headers");
            break hs.iter().find(|h| h.key == outbox_core::watermark_record::DECIDER_HEADER).and_then(|h| h.value).map(|v| String::from_utf8_lossy(v).into_owned());
        }
    };
    assert_eq!(decider.as_deref(), Some(expected.as_str()));
    drop(reader);
    shipping_db.drop_now().await.unwrap();
    rig.env.drop_now().await;
}
