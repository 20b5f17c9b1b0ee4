//! [`OutboxTest`]: everything one end-to-end test needs, isolated from every
//! other test and from production: a database, a topic and a consumer group
//! of its own. And the wait helpers that replace polling loops.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_consumer::{ConsumerConfig, IdempotentConsumer};
use outbox_core::{Broker, EventId, RoutePolicy};
use outbox_producer::kafka::KafkaBroker;
use outbox_producer::{BatchReport, Dispatcher, DispatcherConfig, PgStore};
use sqlx::PgPool;

use crate::{check_consumed_once, check_published, pick_database, KafkaFixture, PickedDatabase, PrimaryReceipt, TestDatabase, TestkitError};

/// How often the wait helpers look, ms.
pub const POLL_MS: u64 = 50;

/// A name of its own for this test: `<prefix>-<pid>-<n>-<nanos>` (letters,
/// digits, `-`, `.` and `_` of the prefix kept; at most 200 characters).
pub fn unique_name(prefix: &str) -> String {
    let clean: String = prefix.chars().filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_')).take(100).collect();
    let clean = if clean.is_empty() { "test".to_owned() } else { clean };
    format!("{clean}-{}", crate::postgres::unique_suffix().replace('_', "-"))
}

/// One end-to-end test's world: a fresh database (both schemas migrated) on
/// the server [`pick_database`] finds, a Kafka-protocol cluster
/// ([`KafkaFixture::start`]: `OUTBOX_TEST_KAFKA_BOOTSTRAP` or the in-process
/// mock), a topic and a consumer group no other test uses, and a producer
/// adapter connected to it.
///
/// Keep it on the test's own task (the mock cluster is not `Send`); call
/// [`OutboxTest::finish`] at the end to drop the database (a panicking test
/// drops it when the fixture is dropped).
pub struct OutboxTest {
    /// The picked server (a throwaway one lives as long as this).
    pub server: PickedDatabase,
    /// The test's own database.
    pub db: TestDatabase,
    /// The Kafka-protocol cluster.
    pub kafka: KafkaFixture,
    /// A connected producer adapter.
    pub broker: Arc<KafkaBroker>,
    /// The test's own topic (3 partitions).
    pub topic: String,
    /// The test's own consumer group.
    pub group_id: String,
}

impl std::fmt::Debug for OutboxTest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxTest").field("db", &self.db.name).field("kafka", &self.kafka).field("topic", &self.topic).field("group_id", &self.group_id).finish()
    }
}

impl OutboxTest {
    /// Partitions of [`OutboxTest::topic`].
    pub const PARTITIONS: u32 = 3;

    /// Sets the world up; `name` prefixes the database, topic and group names.
    pub async fn start(name: &str) -> Result<Self, TestkitError> {
        let server = pick_database().await?;
        let db = TestDatabase::create(server.url(), name, 8).await?;
        outbox_producer::migrate(&db.pool).await.map_err(|e| TestkitError::new(format!("producer migrations: {e}")))?;
        outbox_consumer::migrate(&db.pool).await.map_err(|e| TestkitError::new(format!("consumer migrations: {e}")))?;
        let kafka = KafkaFixture::start()?;
        let topic = kafka.unique_topic(name, Self::PARTITIONS as i32).await?;
        let broker = kafka.broker(|c| c.message_timeout_ms = 10_000).await?;
        Ok(OutboxTest { server, db, kafka, broker, topic, group_id: unique_name(name) })
    }

    /// The test database's pool.
    pub fn pool(&self) -> &PgPool {
        &self.db.pool
    }

    /// Routes `event_type` to the test's topic (idempotent).
    pub async fn route(&self, event_type: &str) -> Result<RoutePolicy, TestkitError> {
        let policy = RoutePolicy::new(event_type, self.broker.cluster_id(), &self.topic, Self::PARTITIONS);
        outbox_producer::routes::ensure(self.pool(), &policy).await.map(|e| e.policy).map_err(|e| TestkitError::new(format!("routing {event_type}: {e}")))
    }

    /// A dispatcher on the test database and cluster.
    pub fn dispatcher(&self) -> Result<Arc<Dispatcher<KafkaBroker>>, TestkitError> {
        let config = DispatcherConfig { name: "testkit".into(), ..Default::default() };
        Dispatcher::new(PgStore::new(self.pool().clone()), self.broker.clone(), config).map(Arc::new).map_err(|e| TestkitError::new(format!("dispatcher: {e}")))
    }

    /// A consumer configuration reading the test's topic in the test's
    /// consumer group (short retry backoffs for tests).
    pub fn consumer_config(&self, consumer_id: &str) -> ConsumerConfig {
        let mut c = ConsumerConfig::new(consumer_id, self.kafka.bootstrap(), &[self.topic.as_str()]);
        c.group_id = self.group_id.clone();
        c.retry.initial_backoff_ms = 10;
        c.retry.max_backoff_ms = 100;
        c
    }

    /// Dispatches until no event is left to send ([`drain`] with a dispatcher of its own).
    pub async fn drain(&self, timeout: Duration) -> Result<BatchReport, TestkitError> {
        drain(&*self.dispatcher()?, timeout).await
    }

    /// Drops the test database.
    pub async fn finish(self) -> Result<(), TestkitError> {
        self.db.drop_now().await
    }
}

/// Waits until `event_id` is PUBLISHED (its publish receipt is checked as
/// [`check_published`] does) and returns the receipt; panics after
/// `timeout` with the last reason it was not.
pub async fn wait_published(pool: &PgPool, event_id: &EventId, timeout: Duration) -> PrimaryReceipt {
    let deadline = Instant::now() + timeout;
    loop {
        match check_published(pool, event_id).await {
            Ok(r) => return r,
            Err(why) if Instant::now() >= deadline => panic!("not published within {} ms: {why}", timeout.as_millis()),
            Err(_) => tokio::time::sleep(Duration::from_millis(POLL_MS)).await,
        }
    }
}

/// Waits until `consumer_id` has consumed `event_id` exactly once (as
/// [`check_consumed_once`] checks); panics after `timeout` with the last
/// reason it had not.
pub async fn wait_consumed(pool: &PgPool, consumer_id: &str, event_id: &EventId, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        match check_consumed_once(pool, consumer_id, event_id).await {
            Ok(()) => return,
            Err(why) if Instant::now() >= deadline => panic!("not consumed within {} ms: {why}", timeout.as_millis()),
            Err(_) => tokio::time::sleep(Duration::from_millis(POLL_MS)).await,
        }
    }
}

/// Dispatches (one batch after another, as owner `drain-0`) until no event
/// is PENDING, being sent or waiting for a retry; returns the totals. Fails
/// after `timeout`, or at once when an event's outcome is unknown (only the
/// reconciler resolves those).
pub async fn drain<B: Broker + 'static>(dispatcher: &Dispatcher<B>, timeout: Duration) -> Result<BatchReport, TestkitError> {
    let deadline = Instant::now() + timeout;
    let pool = dispatcher.store().pool().clone();
    let mut total = BatchReport::default();
    loop {
        let r = dispatcher.dispatch_once("drain-0").await.map_err(|e| TestkitError::new(format!("dispatching: {e}")))?;
        total += r;
        // The exception lane's undelivered events (a legacy publisher's
        // stay PENDING there and are not the outbox's), and the stream's
        // events with no receipt in their slot and no lane row.
        let (left, unknown): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM outbox_events WHERE publisher = 'outbox' AND phase IN ('PENDING', 'INFLIGHT', 'RETRY_CLAIMED'))
                    + (SELECT count(*) FROM outbox_stream s
                       WHERE NOT EXISTS (SELECT 1 FROM outbox_publish_receipts r WHERE r.event_id = s.event_id AND r.envelope_generation = 1)
                         AND NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = s.event_id)),
                    (SELECT count(*) FROM outbox_events WHERE publisher = 'outbox' AND phase IN ('DISPATCH_UNKNOWN', 'RECONCILING'))",
        )
        .fetch_one(&pool)
        .await
        .map_err(|e| TestkitError::new(format!("counting undelivered events: {e}")))?;
        if unknown > 0 {
            return Err(TestkitError::new(format!("{unknown} event(s) DISPATCH_UNKNOWN: run a reconciler round (Reconciler::run_once)")));
        }
        if left == 0 {
            return Ok(total);
        }
        if Instant::now() >= deadline {
            return Err(TestkitError::new(format!("{left} event(s) still undelivered after {} ms (is the broker up? a not-sent backoff?)", timeout.as_millis())));
        }
        if r.claimed == 0 {
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    }
}

/// Runs `consumer` until `until()` answers true (asked every [`POLL_MS`]),
/// then shuts it down gracefully (offsets committed) and returns. Fails if
/// the consumer stops with an error, or `until` is still false after
/// `timeout`.
pub async fn run_consumer_until<F, Fut>(consumer: IdempotentConsumer, timeout: Duration, mut until: F) -> Result<(), TestkitError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let mut run = tokio::spawn(consumer.run(async move {
        let _ = stop_rx.await;
    }));
    let deadline = Instant::now() + timeout;
    let reached = loop {
        if until().await {
            break true;
        }
        if Instant::now() >= deadline {
            break false;
        }
        tokio::select! {
            done = &mut run => {
                let why = match done {
                    Ok(Ok(())) => "stopped".to_owned(),
                    Ok(Err(e)) => format!("failed: {e}"),
                    Err(e) => format!("panicked: {e}"),
                };
                return Err(TestkitError::new(format!("the consumer {why} before the condition held")));
            }
            _ = tokio::time::sleep(Duration::from_millis(POLL_MS)) => {}
        }
    };
    let _ = stop_tx.send(());
    match run.await {
        Ok(Ok(())) if reached => Ok(()),
        Ok(Ok(())) => Err(TestkitError::new(format!("the condition did not hold within {} ms", timeout.as_millis()))),
        Ok(Err(e)) => Err(TestkitError::new(format!("the consumer failed: {e}"))),
        Err(e) => Err(TestkitError::new(format!("the consumer panicked: {e}"))),
    }
}
