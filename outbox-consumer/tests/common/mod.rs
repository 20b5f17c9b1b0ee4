//! Shared fixtures: events frozen by outbox-core, a recording handler with
//! scripted failures, a Kafka mock cluster and a producer.
#![allow(dead_code)]

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_consumer::{async_trait, ConsumedEvent, Handler, HandlerError, RawMessage};
use outbox_core::headers;
use outbox_core::{AttemptId, Destination, EmitRequest, Envelope, EventId, RoutePolicy};
use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{DefaultProducerContext, FutureProducer, FutureRecord};
use serde_json::{json, Value};
use sqlx::{PgPool, Postgres, Transaction};

pub const EVENT_TYPE: &str = "order.created";
pub const CLUSTER: &str = "mock";

/// One frozen event and the message a dispatcher would send for it.
#[derive(Debug, Clone)]
pub struct Fixture {
    pub envelope: Envelope,
    pub destination: Destination,
    pub payload: Vec<u8>,
    pub headers: Vec<(String, Vec<u8>)>,
}

impl Fixture {
    pub fn event_id(&self) -> &EventId {
        &self.envelope.event_id
    }

    pub fn partition(&self) -> i32 {
        self.destination.partition
    }

    /// The message as read at `offset`.
    pub fn raw(&self, offset: i64) -> RawMessage {
        RawMessage {
            topic: self.destination.topic.clone(),
            partition: self.destination.partition,
            offset,
            key: Some(self.destination.routing_key.as_bytes().to_vec()),
            payload: Some(self.payload.clone()),
            headers: self.headers.clone(),
            non_utf8_header_names: Vec::new(),
            log_id: None,
        }
    }
}

/// An `order.created` event for `order` on `topic`.
pub fn fixture(topic: &str, partitions: u32, order: &str) -> Fixture {
    fixture_of(topic, None, partitions, order)
}

/// An `order.created` event for `order` on `topic`, its destination naming
/// `topic_id` (`destination.v2`) when given.
pub fn fixture_of(topic: &str, topic_id: Option<&str>, partitions: u32, order: &str) -> Fixture {
    let payload = serde_json::to_vec(&json!({ "order": order, "sku": "sku-1", "quantity": 2 })).unwrap_or_default();
    let req = EmitRequest {
        command_key: &format!("create-{order}"),
        tenant: "tenant-1",
        aggregate_type: "order",
        aggregate_id: order,
        aggregate_version: 1,
        event_type: EVENT_TYPE,
        payload_schema: "order-v1",
        payload: &payload,
    };
    let now = 1_800_000_000_000;
    let policy = RoutePolicy { topic_id: topic_id.map(str::to_owned), ..RoutePolicy::new(EVENT_TYPE, CLUSTER, topic, partitions) };
    let (envelope, destination) = req.freeze(EventId::generate(now), now as i64, 42, &policy).expect("freeze");
    let headers = headers::build(&envelope, &destination, &destination.digest(), &AttemptId::generate(now), None);
    Fixture { envelope, destination, payload, headers }
}

/// An event whose frozen partition is `partition`.
pub fn fixture_on(topic: &str, partitions: u32, partition: i32, tag: &str) -> Fixture {
    for i in 0..10_000 {
        let f = fixture(topic, partitions, &format!("o-{tag}-{i}"));
        if f.partition() == partition {
            return f;
        }
    }
    panic!("no key for partition {partition}");
}

/// Scripted behaviour of [`TestHandler`] for one event.
#[derive(Debug, Clone, Copy)]
pub enum Script {
    /// Fail (transiently) this many times, then succeed.
    FailTimes(u32),
    /// Always fail transiently.
    AlwaysFail,
    /// Fail permanently.
    Permanent,
    /// Panic.
    Panic,
    /// Run a failing query and ignore the error.
    SwallowDbError,
}

/// A handler that records one row per effect in `test_effects` (no unique
/// constraint: a second effect would show) and counts its calls.
#[derive(Clone, Default)]
pub struct TestHandler {
    pub calls: Arc<AtomicU64>,
    pub scripts: Arc<Mutex<HashMap<String, Script>>>,
    pub failures: Arc<Mutex<HashMap<String, u32>>>,
    /// Milliseconds each call sleeps (inside the transaction).
    pub delay_ms: Arc<AtomicU64>,
}

impl TestHandler {
    pub fn script(&self, id: &EventId, s: Script) {
        self.scripts.lock().unwrap().insert(id.as_str().to_owned(), s);
    }

    pub fn clear(&self, id: &EventId) {
        self.scripts.lock().unwrap().remove(id.as_str());
    }

    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }
}

pub async fn create_effects_table(pool: &PgPool) {
    sqlx::query(r#"CREATE TABLE IF NOT EXISTS test_effects (id bigserial PRIMARY KEY, consumer_id text NOT NULL, event_id text NOT NULL, "offset" bigint NOT NULL)"#)
        .execute(pool)
        .await
        .expect("create test_effects");
}

/// (effect rows, distinct events among them).
pub async fn effects(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as("SELECT count(*), count(DISTINCT (consumer_id, event_id)) FROM test_effects").fetch_one(pool).await.expect("count effects")
}

pub async fn effects_of(pool: &PgPool, id: &EventId) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM test_effects WHERE event_id = $1").bind(id.as_str()).fetch_one(pool).await.expect("count")
}

#[async_trait]
impl Handler for TestHandler {
    async fn handle(&self, tx: &mut Transaction<'_, Postgres>, e: &ConsumedEvent) -> Result<Value, HandlerError> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let script = self.scripts.lock().unwrap().get(e.event_id.as_str()).copied();
        let delay = self.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        // The effect is written before any failure, so a failure must roll it back.
        sqlx::query(r#"INSERT INTO test_effects (consumer_id, event_id, "offset") VALUES ($1, $2, $3)"#)
            .bind(&e.consumer_id)
            .bind(e.event_id.as_str())
            .bind(e.offset)
            .execute(&mut **tx)
            .await?;
        match script {
            None => {}
            Some(Script::FailTimes(n)) => {
                let mut f = self.failures.lock().unwrap();
                let seen = f.entry(e.event_id.as_str().to_owned()).or_insert(0);
                if *seen < n {
                    *seen += 1;
                    return Err(HandlerError::transient(format!("scripted failure {seen} of {n}")));
                }
            }
            Some(Script::AlwaysFail) => return Err(HandlerError::transient("always fails")),
            Some(Script::Permanent) => return Err(HandlerError::permanent("cannot ever apply")),
            Some(Script::Panic) => panic!("handler bug"),
            Some(Script::SwallowDbError) => {
                let _ = sqlx::query("SELECT 1/0").execute(&mut **tx).await;
            }
        }
        Ok(json!({ "applied_at_offset": e.offset, "call": call, "effect_key": e.effect_key }))
    }
}

/// Polls `f` every 20 ms until it returns true, for at most `secs` seconds.
pub async fn wait_until<F, Fut>(secs: u64, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A mock Kafka cluster (not `Send`: keep it on the test thread, alive).
pub struct Kafka {
    pub cluster: MockCluster<'static, DefaultProducerContext>,
    pub producer: FutureProducer,
}

impl Kafka {
    pub fn new(topic: &str, partitions: i32) -> Kafka {
        let cluster = MockCluster::new(1).expect("mock cluster");
        cluster.create_topic(topic, partitions, 1).expect("topic");
        let producer = ClientConfig::new()
            .set("bootstrap.servers", cluster.bootstrap_servers())
            .set("enable.idempotence", "true")
            .set("linger.ms", "1")
            .create()
            .expect("producer");
        Kafka { cluster, producer }
    }

    pub fn bootstrap(&self) -> String {
        self.cluster.bootstrap_servers()
    }

    /// Sends a fixture where its destination says; returns the offset.
    pub async fn send(&self, f: &Fixture) -> i64 {
        self.send_raw(&f.destination.topic, f.partition(), f.destination.routing_key.as_bytes(), &f.payload, &f.headers).await
    }

    /// Sends a message whose headers are given as raw bytes, names included
    /// (a name need not be UTF-8: librdkafka takes any bytes); returns the offset.
    pub async fn send_raw_names(&self, topic: &str, partition: i32, key: &[u8], payload: &[u8], hs: &[(Vec<u8>, Vec<u8>)]) -> i64 {
        let h = OwnedHeaders::new_with_capacity(hs.len());
        for (k, v) in hs {
            // `as_borrowed` is a view whose address is librdkafka's header list.
            let native = h.as_borrowed() as *const rdkafka::message::BorrowedHeaders as *mut rdkafka::bindings::rd_kafka_headers_t;
            // SAFETY: the list is owned by `h`, alive here; librdkafka copies name and value.
            let err = unsafe { rdkafka::bindings::rd_kafka_header_add(native, k.as_ptr().cast(), k.len() as isize, v.as_ptr().cast(), v.len() as isize) };
            assert_eq!(err, rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR);
        }
        let rec = FutureRecord::to(topic).partition(partition).key(key).payload(payload).headers(h);
        let d = self.producer.send(rec, Duration::from_secs(10)).await.map_err(|(e, _)| e).expect("send");
        d.offset
    }

    /// Sends arbitrary bytes (for tampering); returns the offset.
    pub async fn send_raw(&self, topic: &str, partition: i32, key: &[u8], payload: &[u8], hs: &[(String, Vec<u8>)]) -> i64 {
        let mut h = OwnedHeaders::new();
        for (k, v) in hs {
            h = h.insert(Header { key: k, value: Some(v) });
        }
        let rec = FutureRecord::to(topic).partition(partition).key(key).payload(payload).headers(h);
        let d = self.producer.send(rec, Duration::from_secs(10)).await.map_err(|(e, _)| e).expect("send");
        d.offset
    }
}

/// A consumer configuration for tests: small backoffs, fast sessions.
pub fn config(kafka: &Kafka, consumer_id: &str, topic: &str) -> outbox_consumer::ConsumerConfig {
    let mut c = outbox_consumer::ConsumerConfig::new(consumer_id, kafka.bootstrap(), &[topic]);
    c.retry.initial_backoff_ms = 20;
    c.retry.max_backoff_ms = 100;
    c.retry.max_attempts = 4;
    c.session_timeout_ms = 6_000;
    c.shutdown_timeout_ms = 5_000;
    c.kafka.insert("heartbeat.interval.ms".into(), "500".into());
    c.kafka.insert("topic.metadata.refresh.interval.ms".into(), "500".into());
    c
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).with_test_writer().try_init();
}

/// Runs the test `test` of this test binary again, alone, in a child process
/// with the deliberate defect `mutation` switched on
/// (`outbox_core::simulation::MUTATION_ENV`), and expects it to fail: the
/// test catches that defect. Answers the child's output.
/// A migrated database of its own for a test that [`run_mutant`] runs
/// again in a child process. `#[sqlx::test]` names a test's database after
/// the test's path and drops any database of that name before creating
/// it, so the child's run of the same test would drop the database the
/// parent's run is using (seen in CI: "database ... does not exist", the
/// parent's test failing while its mutant check ran). A name unique to the
/// process and the moment cannot collide.
pub struct OwnDatabase {
    pub pool: PgPool,
    admin: sqlx::postgres::PgConnectOptions,
    name: String,
    dropped: bool,
}

/// Creates and migrates a database named `<prefix>_<pid>_<n>_<nanos>` on
/// the server of `DATABASE_URL`.
pub async fn own_database(prefix: &str) -> OwnDatabase {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let url = std::env::var("DATABASE_URL").expect("DATABASE_URL must be set");
    let admin: sqlx::postgres::PgConnectOptions = url.parse().expect("DATABASE_URL is a PostgreSQL URL");
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    let name = format!("{prefix}_{}_{}_{nanos}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
    let mut conn = sqlx::ConnectOptions::connect(&admin).await.expect("connect to DATABASE_URL");
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut conn).await.expect("create the test's database");
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(5).connect_with(admin.clone().database(&name)).await.expect("connect to the test's database");
    outbox_consumer::MIGRATOR.run(&pool).await.expect("migrate the test's database");
    OwnDatabase { pool, admin, name, dropped: false }
}

async fn drop_database(admin: &sqlx::postgres::PgConnectOptions, name: &str) {
    let mut conn = sqlx::ConnectOptions::connect(admin).await.expect("connect to DATABASE_URL");
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).execute(&mut conn).await.expect("drop the test's database");
}

impl OwnDatabase {
    /// Closes the pool and drops the database.
    pub async fn drop_now(mut self) {
        self.dropped = true;
        self.pool.close().await;
        drop_database(&self.admin, &self.name).await;
    }
}

/// A test that panicked (a mutant's run always does) drops its database
/// too, from a thread of its own: the test's runtime may be unwinding.
impl Drop for OwnDatabase {
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        let (admin, name) = (self.admin.clone(), self.name.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime to drop the test's database");
            rt.block_on(drop_database(&admin, &name));
        })
        .join();
    }
}

/// Runs `test` of this test binary again in a child process with the
/// deliberate defect `mutation` switched on, expects it to fail, and answers
/// its output. A test it runs uses [`own_database`], not `#[sqlx::test]`.
pub fn run_mutant(test: &str, mutation: &str) -> String {
    let out = std::process::Command::new(std::env::current_exe().expect("this test binary"))
        .args([test, "--exact", "--test-threads", "1", "--nocapture"])
        .env(outbox_core::simulation::MUTATION_ENV, mutation)
        .output()
        .expect("the test binary runs again");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("running 1 test"), "the child ran no test named {test}: {text}");
    assert!(!out.status.success(), "{test} passed with the defect {mutation} switched on: it does not catch it\n{text}");
    text
}
