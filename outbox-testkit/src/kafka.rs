//! A Kafka-protocol cluster for tests.

use std::sync::Arc;
use std::time::Duration;

use outbox_producer::kafka::{KafkaBroker, KafkaConfig};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::ClientConfig;

use crate::TestkitError;

/// The environment variable naming an external Kafka cluster for tests. The
/// test kit reads only this one, never the services' `OUTBOX_KAFKA_BOOTSTRAP`:
/// a shell where the production variable is set does not send test events to
/// production topics.
pub const TEST_BOOTSTRAP_ENV: &str = "OUTBOX_TEST_KAFKA_BOOTSTRAP";

/// A Kafka-protocol cluster for one test: the external cluster named by
/// `OUTBOX_TEST_KAFKA_BOOTSTRAP`, or librdkafka's in-process mock cluster
/// (`rdkafka::mocking::MockCluster`: idempotent producer, consumer groups,
/// offset commits, fetch by offset; listening on real 127.0.0.1 ports, so
/// other processes can use it too).
///
/// **Thread affinity.** The mock cluster is not `Send`: keep the fixture on
/// the thread that created it (in a `#[tokio::test]`, the test's own task on
/// the default current-thread runtime; do not move it into `tokio::spawn`).
/// The clients connected to it ([`KafkaFixture::broker`]) are `Send` and may
/// go anywhere. Dropping the fixture stops the mock cluster.
pub struct KafkaFixture {
    mock: Option<MockCluster<'static, DefaultProducerContext>>,
    bootstrap: String,
}

impl std::fmt::Debug for KafkaFixture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaFixture").field("mock", &self.mock.is_some()).field("bootstrap", &self.bootstrap).finish()
    }
}

impl KafkaFixture {
    /// `OUTBOX_TEST_KAFKA_BOOTSTRAP` if set, else a 1-broker in-process mock
    /// cluster (`OUTBOX_KAFKA_BOOTSTRAP`, the services' variable, is ignored).
    /// On an external cluster, use [`KafkaFixture::unique_topic`] and
    /// [`unique_name`](crate::unique_name) for consumer groups.
    pub fn start() -> Result<Self, TestkitError> {
        match std::env::var(TEST_BOOTSTRAP_ENV) {
            Ok(b) if !b.trim().is_empty() => Ok(KafkaFixture { mock: None, bootstrap: b.trim().to_owned() }),
            _ => Self::mock(1),
        }
    }

    /// Always an in-process mock cluster of `brokers` brokers.
    pub fn mock(brokers: i32) -> Result<Self, TestkitError> {
        let mock = MockCluster::new(brokers).map_err(|e| TestkitError::new(format!("starting the in-process Kafka mock cluster: {e}")))?;
        let bootstrap = mock.bootstrap_servers();
        Ok(KafkaFixture { mock: Some(mock), bootstrap })
    }

    /// Bootstrap servers (`host:port,...`).
    pub fn bootstrap(&self) -> &str {
        &self.bootstrap
    }

    /// Whether this is the in-process mock cluster.
    pub fn is_mock(&self) -> bool {
        self.mock.is_some()
    }

    /// The mock cluster, for fault injection (`request_errors`,
    /// `broker_down`, `broker_round_trip_time`); `None` on an external cluster.
    pub fn mock_cluster(&self) -> Option<&MockCluster<'static, DefaultProducerContext>> {
        self.mock.as_ref()
    }

    /// Creates `topic` with `partitions` partitions; an existing topic is fine.
    pub async fn create_topic(&self, topic: &str, partitions: i32) -> Result<(), TestkitError> {
        if let Some(m) = &self.mock {
            return m.create_topic(topic, partitions, 1).map_err(|e| TestkitError::new(format!("creating topic {topic}: {e}")));
        }
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", &self.bootstrap)
            .create()
            .map_err(|e| TestkitError::new(format!("admin client for {}: {e}", self.bootstrap)))?;
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
        let results = admin
            .create_topics(&[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))], &opts)
            .await
            .map_err(|e| TestkitError::new(format!("creating topic {topic}: {e}")))?;
        for r in results {
            match r {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((t, code)) => return Err(TestkitError::new(format!("creating topic {t}: {code}"))),
            }
        }
        Ok(())
    }

    /// Creates a topic of its own for this test, `<prefix>-<pid>-<n>-<nanos>`,
    /// with `partitions` partitions, and returns its name.
    pub async fn unique_topic(&self, prefix: &str, partitions: i32) -> Result<String, TestkitError> {
        let topic = crate::unique_name(prefix);
        self.create_topic(&topic, partitions).await?;
        Ok(topic)
    }

    /// A connected producer adapter; `configure` adjusts the defaults.
    pub async fn broker(&self, configure: impl FnOnce(&mut KafkaConfig)) -> Result<Arc<KafkaBroker>, TestkitError> {
        let mut cfg = KafkaConfig::new(self.bootstrap.clone());
        configure(&mut cfg);
        KafkaBroker::connect(cfg).await.map(Arc::new).map_err(|e| TestkitError::new(format!("connecting to Kafka at {}: {e}", self.bootstrap)))
    }
}
