//! The environment an example runs in: a PostgreSQL database of its own and
//! a Kafka-protocol cluster.
//!
//! * PostgreSQL: `DATABASE_URL` (default `postgres://root@127.0.0.1:5432/test`)
//!   names the server; the example creates a database of its own on it and
//!   drops it at the end, so runs never see each other's rows.
//! * Kafka: `OUTBOX_KAFKA_BOOTSTRAP` names an external cluster; otherwise an
//!   in-process Kafka-protocol cluster (librdkafka's mock cluster) is started.

use std::sync::Arc;

use anyhow::Context;
use outbox_producer::kafka::{KafkaBroker, KafkaConfig};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

/// Default server when `DATABASE_URL` is not set.
pub const DEFAULT_DATABASE_URL: &str = "postgres://root@127.0.0.1:5432/test";

/// A database created for one run, dropped by [`ScratchDb::drop_now`].
pub struct ScratchDb {
    admin: PgConnectOptions,
    /// The database's name.
    pub name: String,
    /// A pool on it.
    pub pool: PgPool,
}

impl ScratchDb {
    /// Creates `<prefix>_<pid>` on the server `DATABASE_URL` names.
    pub async fn create(prefix: &str, max_connections: u32) -> anyhow::Result<Self> {
        let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned());
        Self::create_on(&url, prefix, max_connections).await
    }

    /// Creates `<prefix>_<pid>` on the server of `url`.
    pub async fn create_on(url: &str, prefix: &str, max_connections: u32) -> anyhow::Result<Self> {
        let admin: PgConnectOptions = url.parse().with_context(|| format!("DATABASE_URL {url:?} is not a PostgreSQL URL"))?;
        let admin = admin.disable_statement_logging();
        let name = format!("{prefix}_{}", std::process::id());
        let mut conn = admin.connect().await.with_context(|| format!("cannot connect to PostgreSQL at {url}"))?;
        sqlx::query(&format!("DROP DATABASE IF EXISTS {name}")).execute(&mut conn).await?;
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut conn).await?;
        let pool = PgPoolOptions::new().max_connections(max_connections).connect_with(admin.clone().database(&name)).await?;
        Ok(ScratchDb { admin, name, pool })
    }

    /// Closes the pool and drops the database.
    pub async fn drop_now(self) -> anyhow::Result<()> {
        self.pool.close().await;
        let mut conn = self.admin.connect().await?;
        sqlx::query(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name)).execute(&mut conn).await?;
        Ok(())
    }
}

/// A Kafka-protocol cluster for one run.
pub struct Kafka {
    /// Keeps the in-process cluster alive (it is not `Send`: keep it on the main task).
    pub mock: Option<MockCluster<'static, DefaultProducerContext>>,
    /// Bootstrap servers.
    pub bootstrap: String,
}

impl Kafka {
    /// `OUTBOX_KAFKA_BOOTSTRAP`, or an in-process cluster with `topics` created.
    pub fn start(topics: &[(&str, i32)]) -> anyhow::Result<Self> {
        if let Ok(b) = std::env::var(outbox_producer::kafka::BOOTSTRAP_ENV) {
            return Ok(Kafka { mock: None, bootstrap: b });
        }
        let mock = MockCluster::new(1).context("starting the in-process Kafka cluster")?;
        for (t, p) in topics {
            mock.create_topic(t, *p, 1).with_context(|| format!("creating topic {t}"))?;
        }
        let bootstrap = mock.bootstrap_servers();
        Ok(Kafka { mock: Some(mock), bootstrap })
    }

    /// Where the cluster is, for printing.
    pub fn describe(&self) -> String {
        match self.mock {
            Some(_) => format!("in-process Kafka-protocol cluster at {}", self.bootstrap),
            None => format!("Kafka at {}", self.bootstrap),
        }
    }

    /// A connected producer adapter.
    pub async fn broker(&self, configure: impl FnOnce(&mut KafkaConfig)) -> anyhow::Result<Arc<KafkaBroker>> {
        let mut cfg = KafkaConfig::new(self.bootstrap.clone());
        configure(&mut cfg);
        Ok(Arc::new(KafkaBroker::connect(cfg).await.context("connecting the Kafka adapter")?))
    }
}
