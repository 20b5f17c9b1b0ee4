//! One configuration file for a service that embeds the SDK: an embedded
//! dispatcher (signing) and a consumer (accepting only signed messages of
//! this outbox) are both built from one `outbox.toml`, on real PostgreSQL
//! and librdkafka's in-process Kafka cluster.
//!
//! The mock cluster speaks no TLS, so the file is used in two variants: with
//! TLS and SASL settings, whose settings are checked to reach the
//! librdkafka configuration of the producer, the lookup consumers and the
//! consumer (no handshake is made), and the same file without them, which
//! runs end to end.

use std::time::Duration;

use outbox_config::Config;
use outbox_producer::kafka::KafkaBroker;
use outbox_producer::{Dispatcher, PgStore};
use outbox_tests::kafka::{read_topic, TestCluster};
use outbox_tests::*;
use sqlx::PgPool;

const TOPIC: &str = "orders";
const PARTITIONS: i32 = 2;
const SECRET_HEX: &str = "5eb63bbbe01eeed093cb22bb8f5acdc35eb63bbbe01eeed093cb22bb8f5acdc3";

const TLS: &str = r#"
"security.protocol" = "SASL_SSL"
"ssl.ca.location" = "/etc/outbox/ca.pem"
"ssl.certificate.location" = "/etc/outbox/client.pem"
"ssl.key.location" = "/etc/outbox/client.key"
"ssl.key.password" = "Planted_KeyPw_1"
"sasl.mechanism" = "SCRAM-SHA-512"
"sasl.username" = "orders"
"sasl.password" = "Planted_SaslPw_2"
"#;

/// The one file: `tls` goes into `[kafka.settings]`.
fn file(database_url: &str, bootstrap: &str, source: &str, tls: &str) -> String {
    format!(
        r#"
database_url = "{database_url}"

[kafka]
bootstrap = "{bootstrap}"
message_timeout_ms = 5000
lookup_timeout_ms = 3000

[kafka.settings]
"client.id" = "orders-service"
{tls}

[dispatch]
name = "embedded"
workers = 1

[dispatch.signing]
key_id = "orders-k1"
secret_hex = "{SECRET_HEX}"

[consumer.shipping]
topics = ["{TOPIC}"]
session_timeout_ms = 6000
watermark_topic = ""
require_signature = ["{TOPIC}"]

[consumer.shipping.accept]
{TOPIC} = ["{source}"]

[consumer.shipping.keys]
"{source}" = [{{ key_id = "orders-k1", secret_hex = "{SECRET_HEX}" }}]
"#
    )
}

struct Ship;

#[outbox_consumer::async_trait]
impl outbox_consumer::Handler for Ship {
    async fn handle(&self, tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, e: &outbox_consumer::ConsumedEvent) -> Result<serde_json::Value, outbox_consumer::HandlerError> {
        sqlx::query("INSERT INTO shipments (event_id) VALUES ($1)").bind(e.event_id.as_str()).execute(&mut **tx).await?;
        Ok(serde_json::json!({}))
    }
}

/// The test database's URL, from `DATABASE_URL` with this test's database.
async fn this_database_url(pool: &PgPool) -> String {
    let name: String = sqlx::query_scalar("SELECT current_database()").fetch_one(pool).await.unwrap();
    let base = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/test".into());
    let (head, _) = base.rsplit_once('/').unwrap();
    format!("{head}/{name}")
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn an_embedded_dispatcher_and_consumer_run_from_one_file(pool: PgPool) {
    let cluster = TestCluster::start();
    cluster.topic(TOPIC, PARTITIONS);
    let source: String = sqlx::query_scalar("SELECT source FROM outbox_identity").fetch_one(&pool).await.unwrap();
    let url = this_database_url(&pool).await;
    let dir = std::env::temp_dir().join(format!("outbox-one-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    // With TLS and SASL: valid, and every client gets the settings.
    let tls_path = dir.join("outbox-tls.toml");
    std::fs::write(&tls_path, file(&url, &cluster.bootstrap, &source, TLS)).unwrap();
    let tls = Config::from_file(&tls_path).unwrap();
    let kafka = tls.kafka_config().unwrap();
    let consumer = tls.consumer_config("shipping").unwrap();
    for (name, client) in [("producer", kafka.producer_config()), ("lookup", kafka.lookup_config("g")), ("consumer", consumer.client_config())] {
        for (key, want) in [("security.protocol", "SASL_SSL"), ("ssl.ca.location", "/etc/outbox/ca.pem"), ("ssl.key.password", "Planted_KeyPw_1"), ("sasl.password", "Planted_SaslPw_2"), ("sasl.username", "orders")] {
            assert_eq!(client.get(key), Some(want), "{name}: {key}");
        }
    }
    for shown in [format!("{tls:?}"), format!("{kafka:?}"), format!("{consumer:?}"), format!("{:?}", tls.dispatcher_config().unwrap())] {
        for secret in ["Planted_KeyPw_1", "Planted_SaslPw_2", SECRET_HEX] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
    }

    // The same file without them: the one the in-process cluster can serve.
    let path = dir.join("outbox.toml");
    std::fs::write(&path, file(&url, &cluster.bootstrap, &source, "")).unwrap();
    let config = Config::from_file(&path).unwrap();
    assert_eq!(config.dispatcher_config().unwrap(), tls.dispatcher_config().unwrap(), "the variants differ only in the TLS settings");
    assert_eq!(config.consumer_config("shipping").unwrap().trust, consumer.trust);

    // The service: its pool, the broker and the dispatcher, all from the file.
    let service_pool = PgPool::connect(&config.database_url().unwrap()).await.unwrap();
    let broker = std::sync::Arc::new(KafkaBroker::connect(config.kafka_config().unwrap()).await.unwrap());
    business_schema(&service_pool).await;
    route(&service_pool, ORDER_CREATED, broker.cluster_id(), TOPIC, PARTITIONS as u32).await;
    let dispatcher = Dispatcher::new(PgStore::new(service_pool.clone()), broker.clone(), config.dispatcher_config().unwrap()).unwrap();
    let a = create_order(&service_pool, "o-1", 1).await;
    let b = create_order(&service_pool, "o-2", 2).await;
    assert_eq!(dispatcher.dispatch_once("embedded-0").await.unwrap().published, 2);
    let log = read_topic(&cluster.bootstrap, TOPIC, PARTITIONS);
    assert_eq!(log.len(), 2);
    assert!(log.iter().all(|m| m.header(outbox_core::trust::KEY_ID).as_deref() == Some("orders-k1")), "signed with the file's key");

    // The consumer, from the same file, on its database (here the same one).
    let consumer_pool = PgPool::connect(&config.consumer_database_url("shipping").unwrap()).await.unwrap();
    outbox_consumer::migrate(&consumer_pool).await.unwrap();
    sqlx::query("CREATE TABLE shipments (id bigserial PRIMARY KEY, event_id text NOT NULL)").execute(&consumer_pool).await.unwrap();
    let consumer = outbox_consumer::IdempotentConsumer::new(config.consumer_config("shipping").unwrap(), consumer_pool.clone(), Ship).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run(async move {
        let _ = stopped.await;
    }));
    wait_count(&consumer_pool, "SELECT (SELECT count(*) FROM outbox_consumer_receipts) + (SELECT count(*) FROM outbox_consumer_quarantine)", 2, Duration::from_secs(60)).await;
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), task).await.unwrap().unwrap().unwrap();
    let mut shipped: Vec<String> = sqlx::query_scalar("SELECT event_id FROM shipments").fetch_all(&consumer_pool).await.unwrap();
    shipped.sort();
    let mut want = vec![a.event_id().to_string(), b.event_id().to_string()];
    want.sort();
    assert_eq!(shipped, want, "each signed event applied once");
    assert_eq!(count(&consumer_pool, "SELECT count(*) FROM outbox_consumer_quarantine").await, 0, "nothing quarantined");
    std::fs::remove_dir_all(&dir).unwrap();
}
