//! Publishing the consumer's watermarks over the broker.
//!
//! [`IdempotentConsumer::run`](crate::IdempotentConsumer::run) starts one
//! background task (when [`ConsumerConfig::watermark_topic`] is set) that,
//! every `watermark_publish_interval_ms` and once more at a graceful
//! shutdown, reads the consumer's watermark rows of the cluster it consumes
//! from its own database and produces one `outboxWatermark.v1` record per row
//! (`.v2` for a row of a topic id, `.v3` at an open gap, `.v4` for a row
//! that knows the log it was read in) to the watermark topic of that cluster
//! (keyed by consumer, cluster, topic, topic id and partition, so a
//! compacted topic keeps the newest per key).
//!
//! The producer side (outbox-producer's `watermark_topic`) reads the topic
//! and applies the records to the outbox database's watermark table: the
//! consumer needs no credentials on the outbox database.
//!
//! **Never in the way of consumption.** The task has its own Kafka producer
//! and takes a database connection once per interval for one indexed read;
//! partition workers never wait for it. A publication that fails (rows
//! unreadable, a record refused or unanswered within
//! `watermark_publish_timeout_ms`) is counted in
//! [`Metrics::watermark_publish_failures`](crate::Metrics) and retried at the
//! next interval, which republishes every row anyway.
//!
//! With [`ConsumerConfig::watermark_signing_key`] every record carries the
//! key id (`outbox-watermark-key-id`) and the HMAC-SHA256 of its value bytes
//! (`outbox-watermark-signature`); see docs/WIRE.md.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::watermark_record::{self, WatermarkRecord};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::types::RDKafkaErrorCode;
use sqlx::PgPool;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::config::ConsumerConfig;
use crate::error::ConsumerError;
use crate::metrics::Metrics;
use crate::watermark::watermarks_on;

/// librdkafka property prefixes the publisher takes over from
/// [`ConsumerConfig::kafka`] (how to reach and authenticate to the cluster);
/// consumer-only properties are not given to its producer.
pub const SHARED_KAFKA_PROPERTY_PREFIXES: &[&str] = &["security.", "sasl.", "ssl.", "socket.", "broker.", "client.dns.", "client.rack"];

/// The record that publishes the watermark row `w` of a consumer of the
/// Kafka group `group_id`, at `published_at_ms` (ms since the epoch).
pub fn watermark_record_of(w: crate::Watermark, group_id: &str, published_at_ms: i64) -> WatermarkRecord {
    WatermarkRecord {
        consumer_id: w.consumer_id,
        group_id: group_id.to_owned(),
        cluster_id: w.cluster_id,
        topic: w.topic,
        topic_id: w.topic_id,
        log_id: w.log_id,
        anchor_recorded: w.anchor_recorded,
        anchor_event_id: w.anchor_event_id,
        partition: w.partition,
        committed_offset: w.committed_offset,
        open_gap_end: w.open_gap_end,
        applied_count: w.applied_count,
        duplicate_count: w.duplicate_count,
        quarantined_count: w.quarantined_count,
        dead_lettered_count: w.dead_lettered_count,
        last_event_id: w.last_event_id,
        updated_at_ms: w.updated_at.timestamp_millis(),
        published_at_ms,
    }
}

/// Partitions of the watermark topic when the publisher creates it.
pub const WATERMARK_TOPIC_PARTITIONS: i32 = 1;

/// The running publisher.
pub(crate) struct PublisherHandle {
    stop: oneshot::Sender<()>,
    handle: JoinHandle<()>,
    final_wait: Duration,
}

impl PublisherHandle {
    /// Asks for the last publication and waits for it (bounded).
    pub(crate) async fn finish(self) {
        let _ = self.stop.send(());
        let mut handle = self.handle;
        if tokio::time::timeout(self.final_wait, &mut handle).await.is_err() {
            warn!("the last watermark publication did not finish in time");
            handle.abort();
            let _ = handle.await;
        }
    }

    /// Stops at once, publishing nothing more.
    pub(crate) async fn abort(self) {
        self.handle.abort();
        let _ = self.handle.await;
    }
}

/// Starts the publisher, or returns `None` when the configuration turns it off.
pub(crate) fn start(config: &ConsumerConfig, pool: PgPool, metrics: Arc<Metrics>, cluster_id: String) -> Result<Option<PublisherHandle>, ConsumerError> {
    let Some(topic) = config.watermark_topic.clone() else {
        return Ok(None);
    };
    if config.replay {
        warn!(consumer = %config.consumer_id, watermark_topic = %topic, "replay: this consumer publishes no watermark record (its watermarks stay in its own database)");
        return Ok(None);
    }
    let timeout_ms = config.watermark_publish_timeout_ms;
    let mut k = ClientConfig::new();
    k.set("bootstrap.servers", &config.bootstrap_servers)
        .set("client.id", format!("{}-watermarks", config.consumer_id))
        .set("message.timeout.ms", timeout_ms.to_string())
        .set("linger.ms", "20");
    for (key, value) in &config.kafka {
        if SHARED_KAFKA_PROPERTY_PREFIXES.iter().any(|p| key.starts_with(p)) {
            k.set(key, value);
        }
    }
    let producer: FutureProducer = k.create()?;
    let admin: Option<AdminClient<DefaultClientContext>> = k.create().ok();
    let publisher = Publisher {
        pool,
        metrics,
        producer,
        topic,
        consumer_id: config.consumer_id.clone(),
        group_id: config.group_id.clone(),
        cluster_id,
        timeout: Duration::from_millis(timeout_ms),
        signing_key: config.watermark_signing_key.clone(),
        decider: tokio::sync::OnceCell::new(),
    };
    let interval = Duration::from_millis(config.watermark_publish_interval_ms);
    let (stop, mut stop_rx) = oneshot::channel();
    let handle = tokio::spawn(async move {
        if let Some(admin) = admin {
            publisher.create_topic(&admin).await;
        }
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = &mut stop_rx => {
                    publisher.publish_once().await;
                    break;
                }
                _ = tick.tick() => {
                    publisher.publish_once().await;
                }
            }
        }
    });
    Ok(Some(PublisherHandle { stop, handle, final_wait: Duration::from_millis(timeout_ms.saturating_add(2_000)) }))
}

struct Publisher {
    pool: PgPool,
    metrics: Arc<Metrics>,
    producer: FutureProducer,
    topic: String,
    consumer_id: String,
    group_id: String,
    cluster_id: String,
    timeout: Duration,
    signing_key: Option<outbox_core::trust::SigningKey>,
    /// The database that decided the rows, read once
    /// ([`watermark_record::DECIDER_HEADER`]); `None` when it cannot be read.
    decider: tokio::sync::OnceCell<Option<String>>,
}

impl Publisher {
    /// Creates the watermark topic compacted (`cleanup.policy=compact`) if it
    /// does not exist. A cluster that refuses (no CreateTopics right, an
    /// existing topic) leaves it as it is; produce then relies on the topic
    /// existing or on the broker creating it.
    async fn create_topic(&self, admin: &AdminClient<DefaultClientContext>) {
        let opts = AdminOptions::new().operation_timeout(Some(self.timeout)).request_timeout(Some(self.timeout));
        let topic = NewTopic::new(&self.topic, WATERMARK_TOPIC_PARTITIONS, TopicReplication::Fixed(-1)).set("cleanup.policy", "compact");
        match tokio::time::timeout(self.timeout, admin.create_topics(&[topic], &opts)).await {
            Ok(Ok(results)) => {
                for r in results {
                    match r {
                        Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                        Err((t, code)) => debug!(topic = %t, %code, "watermark topic not created"),
                    }
                }
            }
            Ok(Err(e)) => debug!(error = %e, "watermark topic not created"),
            Err(_) => debug!("watermark topic creation timed out"),
        }
    }

    /// One publication: every watermark row of this consumer on this
    /// cluster, one record each (the acknowledged ones are counted).
    async fn publish_once(&self) {
        let rows = match watermarks_on(&self.pool, &self.consumer_id, &self.cluster_id).await {
            Ok(rows) => rows,
            Err(e) => {
                Metrics::add(&self.metrics.watermark_publish_failures, 1);
                warn!(error = %e, "watermark rows unreadable; publishing at the next interval");
                return;
            }
        };
        let decider = self
            .decider
            .get_or_init(|| async {
                let d: Result<String, sqlx::Error> =
                    sqlx::query_scalar("SELECT (SELECT system_identifier FROM pg_control_system())::text || '/' || current_database()").fetch_one(&self.pool).await;
                d.map_err(|e| warn!(error = %e, "the database's identity is unreadable: watermark records name no decider")).ok()
            })
            .await
            .as_ref();
        let now_ms = chrono::Utc::now().timestamp_millis();
        let mut pending = Vec::with_capacity(rows.len());
        for w in rows {
            let record = watermark_record_of(w, &self.group_id, now_ms);
            if let Err(e) = record.validate() {
                warn!(error = %e, topic = %record.topic, partition = record.partition, "watermark row not publishable");
                continue;
            }
            let (key, value) = (record.key_bytes(), record.value_bytes());
            let mut headers = OwnedHeaders::new().insert(Header { key: watermark_record::SCHEMA_HEADER, value: Some(record.schema()) });
            if let Some(d) = decider {
                headers = headers.insert(Header { key: watermark_record::DECIDER_HEADER, value: Some(d.as_str()) });
            }
            if let Some(k) = &self.signing_key {
                let signature = k.sign(&value);
                headers = headers
                    .insert(Header { key: watermark_record::KEY_ID_HEADER, value: Some(k.key_id()) })
                    .insert(Header { key: watermark_record::SIGNATURE_HEADER, value: Some(signature.as_str()) });
            }
            let r = FutureRecord::to(&self.topic).key(&key).payload(&value).headers(headers);
            match self.producer.send_result(r) {
                Ok(delivery) => pending.push(delivery),
                Err((e, _)) => {
                    Metrics::add(&self.metrics.watermark_publish_failures, 1);
                    debug!(error = %e, "watermark record not queued");
                }
            }
        }
        let mut acked = 0;
        let all = futures::future::join_all(pending);
        match tokio::time::timeout(self.timeout, all).await {
            Ok(results) => {
                for r in results {
                    match r {
                        Ok(Ok(_)) => acked += 1,
                        Ok(Err((e, _))) => {
                            Metrics::add(&self.metrics.watermark_publish_failures, 1);
                            debug!(error = %e, "watermark record refused");
                        }
                        Err(_) => Metrics::add(&self.metrics.watermark_publish_failures, 1),
                    }
                }
            }
            Err(_) => {
                Metrics::add(&self.metrics.watermark_publish_failures, 1);
                warn!(timeout_ms = self.timeout.as_millis() as u64, "watermark publication unanswered; publishing again at the next interval");
            }
        }
        Metrics::add(&self.metrics.watermark_records_published, acked as u64);
    }
}
