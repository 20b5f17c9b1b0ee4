//! The environment an example runs in: a PostgreSQL database of its own and
//! a Kafka-protocol cluster.
//!
//! * PostgreSQL: `DATABASE_URL` names the server. Without it, the local
//!   server at `postgres://root@127.0.0.1:5432/test` is used if it answers
//!   within a second, else a throwaway server is started from the locally
//!   installed PostgreSQL binaries and removed at the end (zero setup:
//!   `apt-get install postgresql` is all it needs). `--throwaway-postgres`
//!   on the example's command line (or `OUTBOX_THROWAWAY_POSTGRES=1`) always
//!   starts a throwaway server. The example creates a database of its own on
//!   the server and drops it at the end, so runs never see each other's rows.
//! * Kafka: `OUTBOX_KAFKA_BOOTSTRAP` names an external cluster; otherwise an
//!   in-process Kafka-protocol cluster (librdkafka's mock cluster) is started.

use std::sync::Arc;

use anyhow::Context;
use outbox_producer::kafka::{KafkaBroker, KafkaConfig};
use outbox_testkit::{pick_database_with, PickOptions, PickedDatabase};
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

/// The local server tried when `DATABASE_URL` is not set.
pub const DEFAULT_DATABASE_URL: &str = outbox_testkit::DEFAULT_LOCAL_URL;

/// The command-line flag that forces a throwaway PostgreSQL server.
pub const THROWAWAY_FLAG: &str = "--throwaway-postgres";

/// Whether the command line carries `--throwaway-postgres`.
pub fn force_throwaway_from_args() -> bool {
    std::env::args().skip(1).any(|a| a == THROWAWAY_FLAG)
}

/// A database created for one run, dropped by [`ScratchDb::drop_now`].
pub struct ScratchDb {
    admin: PgConnectOptions,
    /// The database's name.
    pub name: String,
    /// A pool on it.
    pub pool: PgPool,
    where_: String,
    /// Keeps a throwaway server alive until the database is dropped.
    server: Option<PickedDatabase>,
}

impl ScratchDb {
    /// Creates `<prefix>_<pid>` on the server `DATABASE_URL` names; without
    /// it, on the local server if it answers, else on a throwaway server.
    /// `--throwaway-postgres` on the command line forces the throwaway server.
    pub async fn create(prefix: &str, max_connections: u32) -> anyhow::Result<Self> {
        Self::create_with(prefix, max_connections, force_throwaway_from_args()).await
    }

    /// [`ScratchDb::create`] with the throwaway server forced or not.
    pub async fn create_with(prefix: &str, max_connections: u32, force_throwaway: bool) -> anyhow::Result<Self> {
        let mut options = PickOptions::default();
        options.force_throwaway |= force_throwaway;
        let picked = pick_database_with(options).await.context("no PostgreSQL server")?;
        let mut db = Self::create_on(picked.url(), prefix, max_connections).await?;
        db.where_ = picked.describe();
        db.server = Some(picked);
        Ok(db)
    }

    /// Creates `<prefix>_<pid>` on the server of `url`.
    pub async fn create_on(url: &str, prefix: &str, max_connections: u32) -> anyhow::Result<Self> {
        let admin: PgConnectOptions = url.parse().with_context(|| format!("DATABASE_URL {url:?} is not a PostgreSQL URL"))?;
        let admin = admin.disable_statement_logging();
        let name = format!("{prefix}_{}", std::process::id());
        let mut conn = admin.connect().await.with_context(|| format!("cannot connect to PostgreSQL at {url}"))?;
        sqlx::query(&format!("DROP DATABASE IF EXISTS {name}")).execute(&mut conn).await?;
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut conn).await?;
        // Durable commits whatever the server's default: the benchmarks measure them.
        let db = admin.clone().database(&name).options([("synchronous_commit", "on")]);
        let pool = PgPoolOptions::new().max_connections(max_connections).connect_with(db).await?;
        let where_ = format!("PostgreSQL at {}:{}", admin.get_host(), admin.get_port());
        Ok(ScratchDb { admin, name, pool, where_, server: None })
    }

    /// A connection URL of the scratch database (user, host, port, name; no password).
    pub fn url(&self) -> String {
        format!("postgres://{}@{}:{}/{}", self.admin.get_username(), self.admin.get_host(), self.admin.get_port(), self.name)
    }

    /// Whether the database lives on a throwaway server that ends with this process.
    pub fn is_throwaway(&self) -> bool {
        self.server.as_ref().is_some_and(|s| s.throwaway().is_some())
    }

    /// Where the database is, for printing (no credentials).
    pub fn describe(&self) -> String {
        format!("database {} on {}", self.name, self.where_)
    }

    /// Closes the pool and drops the database (and stops a throwaway server).
    pub async fn drop_now(self) -> anyhow::Result<()> {
        self.pool.close().await;
        let mut conn = self.admin.connect().await?;
        sqlx::query(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name)).execute(&mut conn).await?;
        drop(conn);
        drop(self.server);
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
