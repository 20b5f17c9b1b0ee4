//! Shared helpers of the workspace's integration tests (real PostgreSQL, a
//! Kafka-protocol broker).

use outbox_core::{EmitRequest, RoutePolicy};
use outbox_producer::{emit, EmitOptions, Emitted};
use sqlx::PgPool;

/// `SELECT count(*)`-style scalar of `sql`.
pub async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect("count query")
}

/// Polls `sql` (a count) until it reaches `want`; fails the test after `timeout`.
pub async fn wait_count(pool: &PgPool, sql: &str, want: i64, timeout: std::time::Duration) {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let n = count(pool, sql).await;
        if n >= want {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {want} from {sql}, have {n}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// What sessions have read from some tables: the sequential scans they
/// started, and the rows they read (rows read by sequential scans plus
/// index entries read by index scans, so an index read from end to end
/// counts as much as the table).
#[derive(Debug, Clone, Copy, Default, sqlx::FromRow)]
pub struct Reads {
    /// Sequential scans started.
    pub seq_scans: i64,
    /// Rows and index entries read.
    pub rows: i64,
}

impl std::ops::Sub for Reads {
    type Output = Reads;
    fn sub(self, before: Reads) -> Reads {
        Reads { seq_scans: self.seq_scans - before.seq_scans, rows: self.rows - before.rows }
    }
}

/// What has been read from `tables` so far, once each of `sessions`
/// (one-connection pools) has reported its counters: a session reports
/// pending counters when a transaction ends, and `pg_stat_force_next_flush`
/// makes the next report unconditional, so they are in the views before
/// the session answers. Any other connection reports its reads when it is
/// next idle for a second, possibly inside a measured window: read the
/// tables only through `sessions` until the figure is taken.
pub async fn reads(pool: &PgPool, sessions: &[&PgPool], tables: &[&str]) -> Reads {
    for session in sessions {
        sqlx::query("SELECT pg_stat_force_next_flush()").execute(*session).await.expect("flush counters");
    }
    sqlx::query_as(
        "SELECT coalesce(sum(t.seq_scan), 0)::bigint AS seq_scans,
                (coalesce(sum(t.seq_tup_read), 0)
                 + (SELECT coalesce(sum(i.idx_tup_read), 0) FROM pg_stat_user_indexes i WHERE i.relname = ANY($1)))::bigint AS rows
         FROM pg_stat_user_tables t WHERE t.relname = ANY($1)",
    )
    .bind(tables)
    .fetch_one(pool)
    .await
    .expect("table and index counters")
}

/// The event type the tests route.
pub const ORDER_CREATED: &str = "order.created.v2";

/// Creates the business table the tests write to.
pub async fn business_schema(pool: &PgPool) {
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, total_cents bigint NOT NULL)")
        .execute(pool)
        .await
        .expect("orders table");
}

/// Publishes a route for `event_type` to `topic` on `cluster_id`.
pub async fn route(pool: &PgPool, event_type: &str, cluster_id: &str, topic: &str, partitions: u32) -> RoutePolicy {
    outbox_producer::routes::revise(pool, &RoutePolicy::new(event_type, cluster_id, topic, partitions)).await.expect("route policy")
}

/// The JSON payload of order `id`.
pub fn order_payload(id: &str, total_cents: i64) -> Vec<u8> {
    format!(r#"{{"order":"{id}","totalCents":{total_cents}}}"#).into_bytes()
}

/// The order's next event (aggregate version `version`, command key
/// `update-<id>-v<version>`), emitted in a transaction of its own: the same
/// routing key as the order's [`create_order`].
pub async fn update_order(pool: &PgPool, id: &str, version: i64, total_cents: i64) -> Emitted {
    let payload = order_payload(id, total_cents);
    let command_key = format!("update-{id}-v{version}");
    let request = EmitRequest { aggregate_version: version, ..order_request(&command_key, id, &payload) };
    let mut tx = pool.begin().await.expect("begin");
    let e = emit(&mut tx, &request, &EmitOptions::default()).await.expect("emit");
    tx.commit().await.expect("commit");
    e
}

/// One business transaction: insert the order and emit `order.created.v2`.
pub async fn create_order(pool: &PgPool, id: &str, total_cents: i64) -> Emitted {
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("INSERT INTO orders (id, total_cents) VALUES ($1, $2)").bind(id).bind(total_cents).execute(&mut *tx).await.expect("order row");
    let payload = order_payload(id, total_cents);
    let command_key = format!("create-{id}");
    let e = emit(&mut tx, &order_request(&command_key, id, &payload), &EmitOptions::default()).await.expect("emit");
    tx.commit().await.expect("commit");
    e
}

/// The emit request of `create_order`.
pub fn order_request<'a>(command_key: &'a str, id: &'a str, payload: &'a [u8]) -> EmitRequest<'a> {
    EmitRequest {
        command_key,
        tenant: "tenant-7",
        aggregate_type: "order",
        aggregate_id: id,
        aggregate_version: 1,
        event_type: ORDER_CREATED,
        payload_schema: "order-v2",
        payload,
    }
}

/// The broker's ACK of attempt `a` of the claimed event `ev`, written at
/// `partition`@`offset` of its frozen destination's topic: the receipt the
/// dispatcher hands the store.
pub fn ack_receipt(ev: &outbox_core::ClaimedEvent, a: &outbox_core::AttemptRecord, partition: i32, offset: i64) -> outbox_core::BrokerReceipt {
    outbox_core::BrokerReceipt {
        event_id: ev.envelope.event_id.clone(),
        envelope_generation: ev.envelope.envelope_generation,
        attempt_id: a.attempt_id.clone(),
        payload_digest: ev.envelope.payload_digest.clone(),
        destination_digest: ev.destination_digest.clone(),
        cluster_id: ev.destination.cluster_id.clone(),
        topic: ev.destination.topic.clone(),
        topic_id: ev.destination.topic_id.clone(),
        partition,
        offset,
        key: Some(ev.destination.routing_key.as_bytes().to_vec()),
        log_id: None,
    }
}

pub mod dispatch;

pub mod concurrent;

pub mod sql_mutations;

pub mod pg_proxy;

pub mod kafka {
    //! Kafka-side helpers: an in-process Kafka-protocol cluster (librdkafka's
    //! mock cluster) or an external one from `OUTBOX_TEST_KAFKA_BOOTSTRAP`,
    //! and a reader of a whole topic.

    use std::sync::Arc;
    use std::time::Duration;

    use async_trait::async_trait;
    use outbox_core::{Broker, Destination, EventId, LookupOutcome, OutgoingMessage, SendOutcome};
    use outbox_producer::kafka::{KafkaBroker, KafkaConfig};
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::Message;
    use rdkafka::mocking::MockCluster;
    use rdkafka::producer::DefaultProducerContext;
    use rdkafka::{ClientConfig, Offset, TopicPartitionList};

    /// A broker for one test: the in-process mock cluster (kept alive by this value).
    pub struct TestCluster {
        /// The mock cluster; `None` when an external cluster is used.
        pub mock: Option<MockCluster<'static, DefaultProducerContext>>,
        /// Bootstrap servers.
        pub bootstrap: String,
    }

    impl TestCluster {
        /// Starts a 1-broker mock cluster, or uses `OUTBOX_TEST_KAFKA_BOOTSTRAP`.
        pub fn start() -> Self {
            if let Ok(b) = std::env::var("OUTBOX_TEST_KAFKA_BOOTSTRAP") {
                return TestCluster { mock: None, bootstrap: b };
            }
            let mock = MockCluster::new(1).expect("mock cluster");
            let bootstrap = mock.bootstrap_servers();
            TestCluster { mock: Some(mock), bootstrap }
        }

        /// Creates a topic (mock) — an external cluster must have it already
        /// or auto-create it.
        pub fn topic(&self, name: &str, partitions: i32) {
            if let Some(m) = &self.mock {
                m.create_topic(name, partitions, 1).expect("create topic");
            }
        }

        /// A producer adapter with a message timeout.
        pub async fn broker(&self, message_timeout_ms: u64) -> Arc<KafkaBroker> {
            let mut cfg = KafkaConfig::new(self.bootstrap.clone());
            cfg.message_timeout_ms = message_timeout_ms;
            cfg.request_timeout_ms = message_timeout_ms.min(cfg.request_timeout_ms);
            cfg.lookup_timeout_ms = 10_000;
            Arc::new(KafkaBroker::connect(cfg).await.expect("connect broker"))
        }
    }

    /// A fresh cluster with `topic`, a broker client whose messages time out
    /// after `message_timeout_ms`, the business schema, and a route from
    /// each of `event_types` to the topic on that cluster.
    pub async fn started(pool: &sqlx::PgPool, topic: &str, partitions: i32, message_timeout_ms: u64, event_types: &[&str]) -> (TestCluster, Arc<KafkaBroker>) {
        let cluster = TestCluster::start();
        cluster.topic(topic, partitions);
        let broker = cluster.broker(message_timeout_ms).await;
        crate::business_schema(pool).await;
        for t in event_types {
            crate::route(pool, t, broker.cluster_id(), topic, partitions as u32).await;
        }
        (cluster, broker)
    }

    /// One message read back from the log.
    #[derive(Debug, Clone)]
    pub struct LogMessage {
        /// Partition.
        pub partition: i32,
        /// Offset.
        pub offset: i64,
        /// Key.
        pub key: Vec<u8>,
        /// Payload.
        pub payload: Vec<u8>,
        /// Headers.
        pub headers: Vec<(String, Vec<u8>)>,
    }

    impl LogMessage {
        /// The value of a header as text.
        pub fn header(&self, name: &str) -> Option<String> {
            self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| String::from_utf8_lossy(v).into_owned())
        }
    }

    /// Reads every message of `topic` (all `partitions`) up to the high watermarks.
    pub fn read_topic(bootstrap: &str, topic: &str, partitions: i32) -> Vec<LogMessage> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("group.id", format!("reader-{}", rand_suffix()))
            .set("enable.auto.commit", "false")
            .create()
            .expect("reader");
        let mut out = Vec::new();
        for p in 0..partitions {
            let (low, high) = consumer.fetch_watermarks(topic, p, Duration::from_secs(10)).expect("watermarks");
            if high <= low {
                continue;
            }
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition_offset(topic, p, Offset::Offset(low)).expect("tpl");
            consumer.assign(&tpl).expect("assign");
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            let mut next = low;
            while next < high && std::time::Instant::now() < deadline {
                if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
                    if m.partition() != p {
                        continue;
                    }
                    next = m.offset() + 1;
                    let headers = outbox_producer::kafka::message_headers(&m);
                    out.push(LogMessage {
                        partition: p,
                        offset: m.offset(),
                        key: m.key().map(|k| k.to_vec()).unwrap_or_default(),
                        payload: m.payload().map(|k| k.to_vec()).unwrap_or_default(),
                        headers,
                    });
                }
            }
            assert!(next >= high, "could not read {topic}/{p} up to {high}");
        }
        out
    }

    fn rand_suffix() -> u64 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0) ^ (std::process::id() as u64)
    }

    /// A broker adapter that cannot look anything up: the reconciler may then
    /// only retry to the same frozen destination (PROTOCOL §6).
    pub struct NoLookup<B>(pub Arc<B>);

    #[async_trait]
    impl<B: Broker> Broker for NoLookup<B> {
        fn cluster_id(&self) -> &str {
            self.0.cluster_id()
        }
        async fn send(&self, message: OutgoingMessage) -> SendOutcome {
            self.0.send(message).await
        }
        fn supports_lookup(&self) -> bool {
            false
        }
        async fn lookup(&self, _: &Destination, _: &EventId, _: &outbox_core::ScanFrom) -> LookupOutcome {
            LookupOutcome::Unavailable("no lookup".into())
        }
    }
}

/// The stack most integration tests run over: real PostgreSQL (the test's
/// database, with the business table and a route for [`ORDER_CREATED`] to
/// `topic` on the cluster), librdkafka's in-process cluster with `topic`,
/// the Kafka adapter connected to it, and a store on a manual clock
/// starting at the database's now.
pub struct Stack {
    /// The test's database.
    pub pool: PgPool,
    /// The in-process Kafka cluster.
    pub cluster: kafka::TestCluster,
    /// The Kafka adapter.
    pub broker: std::sync::Arc<outbox_producer::KafkaBroker>,
    /// The clock of `store`.
    pub clock: outbox_core::ManualClock,
    /// A store on `clock`.
    pub store: outbox_producer::PgStore,
}

/// [`Stack`] with `topic` of `partitions` partitions; `configure` adjusts
/// the adapter's configuration (message timeout 5 s and lookup timeout 3 s
/// are set first).
pub async fn stack(pool: PgPool, topic: &str, partitions: i32, configure: impl FnOnce(&mut outbox_producer::KafkaConfig)) -> Stack {
    let cluster = kafka::TestCluster::start();
    cluster.topic(topic, partitions);
    let mut cfg = outbox_producer::KafkaConfig::new(cluster.bootstrap.clone());
    cfg.message_timeout_ms = 5_000;
    cfg.lookup_timeout_ms = 3_000;
    configure(&mut cfg);
    let broker = std::sync::Arc::new(outbox_producer::KafkaBroker::connect(cfg).await.unwrap());
    business_schema(&pool).await;
    route(&pool, ORDER_CREATED, broker.cluster_id(), topic, partitions as u32).await;
    let now: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::bigint").fetch_one(&pool).await.unwrap();
    let clock = outbox_core::ManualClock::new(now);
    let store = outbox_producer::PgStore::with_clock(pool.clone(), std::sync::Arc::new(clock.clone()));
    Stack { pool, cluster, broker, clock, store }
}

