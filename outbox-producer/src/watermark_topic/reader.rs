//! The reader: the Kafka client of one cluster's watermark topic, and a
//! round that reads what is new, decides about each record and applies
//! the round in one transaction.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use outbox_core::watermark_record;
use outbox_core::{Clock, SystemClock};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use sqlx::PgPool;

use super::apply::PgRoundSink;
pub use super::round::IngestReport;
use super::round::{decide_round, RoundInput, Screened};
use super::config::WatermarkTopicConfig;
use super::decide::{screen, RecordBytes, Screen};
use crate::error::ProducerError;
use crate::kafka::PAST_END_READ_MS;

/// How long a round goes on reading after the reported ends of the
/// watermark topic's partitions while nothing more arrives, ms.
pub const READ_PAST_END_IDLE_MS: u64 = 200;

/// Finding kinds raised by the reader; evidence, left open until an operator resolves them.
pub const READER_FINDINGS: &[&str] = &["watermark_undeclared_consumer", "watermark_moved_back", "watermark_beyond_end", "watermark_rejected", outbox_core::findings::CONSUMER_GAP];

/// Reads the watermark topic of one cluster into the outbox database.
pub struct WatermarkTopicReader {
    pool: PgPool,
    client: Arc<StreamConsumer>,
    cluster_id: String,
    config: WatermarkTopicConfig,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for WatermarkTopicReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatermarkTopicReader").field("cluster_id", &self.cluster_id).field("config", &self.config).finish()
    }
}

fn kafka_err(what: &str, e: impl std::fmt::Display) -> ProducerError {
    ProducerError::Config(format!("watermark topic: {what}: {e}"))
}

impl WatermarkTopicReader {
    /// Connects to the cluster and learns its id. The outbox database must
    /// hold `outbox_consumer_watermarks` (`outbox migrate`, or
    /// `outbox_consumer::migrate`, on the outbox database).
    pub async fn connect(pool: PgPool, config: WatermarkTopicConfig) -> Result<Self, ProducerError> {
        config.validate()?;
        if !crate::report::has_watermarks(&pool).await? {
            return Err(ProducerError::Config(
                "the outbox database has no outbox_consumer_watermarks table (run `outbox migrate`, or outbox_consumer::migrate, on it)".into(),
            ));
        }
        let mut k = ClientConfig::new();
        k.set("bootstrap.servers", &config.bootstrap_servers)
            .set("group.id", &config.group_id)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false")
            .set("auto.offset.reset", "earliest")
            .set("isolation.level", "read_committed");
        for (key, value) in &config.kafka {
            k.set(key, value);
        }
        let client: Arc<StreamConsumer> = Arc::new(k.create().map_err(|e| kafka_err("client", e))?);
        let timeout = Duration::from_millis(config.round_timeout_ms);
        let c = client.clone();
        let cluster_id = tokio::task::spawn_blocking(move || c.client().fetch_cluster_id(timeout))
            .await
            .map_err(|e| kafka_err("cluster id task", e))?
            .filter(|id| !id.is_empty())
            .ok_or_else(|| kafka_err("cluster id", format!("the broker did not tell it within {} ms", config.round_timeout_ms)))?;
        if !config.allow_unsigned.is_empty() {
            tracing::warn!(
                topic = %config.topic,
                consumers = ?config.allow_unsigned,
                "watermark records of these consumers are applied unsigned (opted out of verification): anyone who can write the watermark topic can move their watermarks"
            );
        }
        Ok(WatermarkTopicReader { pool, client, cluster_id, config, clock: Arc::new(SystemClock) })
    }

    /// Uses `clock` for the arrival times that `stale_watermark` is judged by
    /// (the reconciler's clock, so both agree).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The id of the cluster read.
    pub fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    /// The configuration.
    pub fn config(&self) -> &WatermarkTopicConfig {
        &self.config
    }

    /// Low and high watermark of a partition (blocking call on a worker thread).
    async fn offsets(&self, topic: &str, partition: i32) -> Result<(i64, i64), ProducerError> {
        let c = self.client.clone();
        let topic = topic.to_owned();
        let timeout = Duration::from_millis(self.config.round_timeout_ms);
        tokio::task::spawn_blocking(move || c.fetch_watermarks(&topic, partition, timeout))
            .await
            .map_err(|e| kafka_err("offsets task", e))?
            .map_err(|e| kafka_err("offsets", e))
    }

    /// The end of `topic`/`partition` as far as the broker serves it, its
    /// reported end being `reported`: read from there (a blocking read on a
    /// worker thread, at most [`PAST_END_READ_MS`] and up to the record
    /// before `committed`). A broker whose log ends there serves nothing.
    async fn served_end(&self, topic: &str, partition: i32, reported: i64, committed: i64) -> i64 {
        let mut settings = ClientConfig::new();
        settings.set("bootstrap.servers", &self.config.bootstrap_servers);
        for (key, value) in &self.config.kafka {
            settings.set(key, value);
        }
        let deadline = std::time::Instant::now() + Duration::from_millis(PAST_END_READ_MS.min(self.config.round_timeout_ms));
        let max = u64::try_from(committed.saturating_sub(reported)).unwrap_or(0);
        let t = topic.to_owned();
        let read = tokio::task::spawn_blocking(move || crate::kafka::last_served_past(settings, &t, partition, reported, max, deadline)).await;
        let (last, outcome) = read.unwrap_or_else(|e| (None, Err(format!("read task failed: {e}"))));
        if let Err(e) = outcome {
            tracing::debug!(topic, partition, reported, error = %e, "could not read past the partition's reported end");
        }
        let served = outbox_core::reconcile::served_end(reported, last);
        if served > reported {
            crate::kafka::warn_under_reported(&self.cluster_id, topic, partition, reported, served, "the watermark reader checks committed offsets against the records served");
        }
        served
    }

    /// The partitions of the watermark topic (empty when it does not exist yet).
    async fn partitions(&self) -> Result<Vec<i32>, ProducerError> {
        let c = self.client.clone();
        let topic = self.config.topic.clone();
        let timeout = Duration::from_millis(self.config.round_timeout_ms);
        let md = tokio::task::spawn_blocking(move || c.fetch_metadata(Some(&topic), timeout).map(|md| {
            md.topics().iter().filter(|t| t.name() == topic && t.error().is_none()).flat_map(|t| t.partitions().iter().map(|p| p.id())).collect::<Vec<i32>>()
        }))
        .await
        .map_err(|e| kafka_err("metadata task", e))?
        .map_err(|e| kafka_err("metadata", e))?;
        Ok(md)
    }

    /// Ingests every `interval` until `shutdown` resolves, handing each
    /// round's report (or why it failed: it is read again next round) to
    /// `observe`. A service beside the reconciler: `outbox reconcile` runs
    /// it next to [`Reconciler::run_observed`](crate::Reconciler::run_observed).
    pub async fn run(&self, shutdown: impl std::future::Future<Output = ()> + Send, interval: std::time::Duration, mut observe: impl FnMut(Result<&IngestReport, &ProducerError>) + Send) {
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            tokio::select! {
                biased;
                () = &mut shutdown => return,
                r = self.ingest_once() => {
                    if let Err(e) = &r {
                        tracing::warn!(error = %e, "watermark topic round failed; reading again next round");
                    }
                    observe(r.as_ref());
                }
            }
            tokio::select! {
                biased;
                () = &mut shutdown => return,
                _ = tokio::time::sleep(interval) => {}
            }
        }
    }

    /// Reads what the watermark topic holds beyond the stored positions (at
    /// most `max_records_per_round`, within `round_timeout_ms`) and applies
    /// it, with its findings and the new positions, in one transaction.
    pub async fn ingest_once(&self) -> Result<IngestReport, ProducerError> {
        let topic = self.config.topic.clone();
        let mut report = IngestReport::default();
        let partitions = self.partitions().await?;
        if partitions.is_empty() {
            tracing::debug!(topic = %topic, "watermark topic not there yet");
            return Ok(report);
        }
        let stored: HashMap<i32, i64> = sqlx::query_as::<_, (i32, i64)>("SELECT partition, next_offset FROM outbox_watermark_topic_cursors WHERE cluster_id = $1 AND topic = $2")
            .bind(&self.cluster_id)
            .bind(&topic)
            .fetch_all(&self.pool)
            .await?
            .into_iter()
            .collect();
        let mut tpl = TopicPartitionList::new();
        let mut ends: HashMap<i32, i64> = HashMap::new();
        let mut starts: HashMap<i32, i64> = HashMap::new();
        for p in partitions {
            let (low, high) = self.offsets(&topic, p).await?;
            // Below the log's start (retention or compaction removed them): start there.
            let from = stored.get(&p).copied().unwrap_or(low).max(low);
            tpl.add_partition_offset(&topic, p, Offset::Offset(from)).map_err(|e| kafka_err("assign", e))?;
            starts.insert(p, from);
            if from < high {
                ends.insert(p, high);
            }
        }
        self.client.assign(&tpl).map_err(|e| kafka_err("assign", e))?;
        let deadline = tokio::time::Instant::now() + Duration::from_millis(self.config.round_timeout_ms);
        let mut messages: Vec<ReadRecord> = Vec::new();
        let mut next: HashMap<i32, i64> = HashMap::new();
        let mut last_read = tokio::time::Instant::now();
        while messages.len() < self.config.max_records_per_round {
            // Up to the reported ends, then on while records keep coming: a
            // broker may report a high watermark below its last record.
            let until = if ends.is_empty() { deadline.min(last_read + Duration::from_millis(READ_PAST_END_IDLE_MS)) } else { deadline };
            let m = match tokio::time::timeout_at(until, self.client.recv()).await {
                Err(_) => break,
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "watermark topic read error");
                    continue;
                }
                Ok(Ok(m)) => m,
            };
            let (p, off) = (m.partition(), m.offset());
            if m.topic() != topic || starts.get(&p).is_none_or(|&from| off < from) {
                // Left over from an earlier assignment: read again from the stored position.
                continue;
            }
            next.insert(p, off + 1);
            last_read = tokio::time::Instant::now();
            if ends.get(&p).is_some_and(|&end| off + 1 >= end) {
                ends.remove(&p);
            }
            // Read without rdkafka's accessors, which panic on a header name
            // that is not UTF-8; the last header of each name counts.
            let hs = crate::kafka::message_headers(&m);
            let last = |name: &str| hs.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.clone());
            let (key_id, signature, decider) = (last(watermark_record::KEY_ID_HEADER), last(watermark_record::SIGNATURE_HEADER), last(watermark_record::DECIDER_HEADER));
            messages.push(ReadRecord { partition: p, offset: off, key: m.key().map(<[u8]>::to_vec), value: m.payload().map(<[u8]>::to_vec), key_id, signature, decider });
        }
        let _ = self.client.unassign();
        report.read = messages.len();
        if messages.is_empty() {
            return Ok(report);
        }

        // Decode, and learn the end of every partition the records of
        // registered consumers speak about (only theirs: a record of anybody
        // else costs no broker request).
        let declared: Vec<String> = sqlx::query_scalar("SELECT consumer_id FROM outbox_consumers").fetch_all(&self.pool).await?;
        let screening = Screen { cluster_id: &self.cluster_id, verify_keys: &self.config.verify_keys, allow_unsigned: &self.config.allow_unsigned, declared: &declared };
        let mut decoded = Vec::with_capacity(messages.len());
        let mut data_ends: HashMap<(String, i32), Result<i64, String>> = HashMap::new();
        for m in messages {
            let (p, off) = (m.partition, m.offset);
            let bytes = RecordBytes { key: m.key.as_deref(), value: m.value.as_deref(), key_id: m.key_id.as_deref(), signature: m.signature.as_deref() };
            let r = screen(&screening, bytes);
            if let Some(r) = r.as_ref().ok().filter(|r| declared.contains(&r.consumer_id)) {
                if let std::collections::hash_map::Entry::Vacant(slot) = data_ends.entry((r.topic.clone(), r.partition)) {
                    slot.insert(self.offsets(&r.topic, r.partition).await.map(|(_, high)| high).map_err(|e| e.to_string()));
                }
            }
            decoded.push(Screened { partition: p, offset: off, record: r, decider: m.decider });
        }
        // A committed offset past a partition's reported end is checked
        // against what the broker serves there: a broker may report an end
        // below records it serves (tansu 0.6).
        let mut beyond: HashMap<(String, i32), i64> = HashMap::new();
        for screened in &decoded {
            if let Ok(r) = &screened.record {
                if let Some(Ok(end)) = data_ends.get(&(r.topic.clone(), r.partition)) {
                    if r.committed_offset > *end {
                        let highest = beyond.entry((r.topic.clone(), r.partition)).or_insert(r.committed_offset);
                        *highest = (*highest).max(r.committed_offset);
                    }
                }
            }
        }
        for ((data_topic, partition), highest) in beyond {
            let Some(Ok(reported)) = data_ends.get(&(data_topic.clone(), partition)).cloned() else { continue };
            let served = self.served_end(&data_topic, partition, reported, highest).await;
            data_ends.insert((data_topic, partition), Ok(served));
        }

        let now = self.clock.now_ms();
        let mut sink = PgRoundSink { tx: self.pool.begin().await?, cluster_id: self.cluster_id.clone(), topic: topic.clone() };
        let input = RoundInput { cluster_id: &self.cluster_id, topic: &topic, declared: &declared, data_ends: &data_ends, next: &next, now };
        let unkeyed = decide_round(&mut sink, input, decoded, &mut report).await?;
        sink.tx.commit().await?;
        if report.findings() > 0 {
            tracing::warn!(?report, "watermark records ignored");
        }
        if !unkeyed.is_empty() {
            tracing::warn!(
                consumers = ?unkeyed,
                "watermark records of declared consumers without a verification key refused: configure their keys (OUTBOX_RECONCILE_WATERMARK_KEYS) or opt them out explicitly (--watermark-unsigned)"
            );
        }
        Ok(report)
    }
}

/// A record read from the watermark topic.
struct ReadRecord {
    partition: i32,
    offset: i64,
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
    /// The last `outbox-watermark-key-id` header.
    key_id: Option<Vec<u8>>,
    /// The last `outbox-watermark-signature` header.
    signature: Option<Vec<u8>>,
    /// The last `outbox-watermark-decider` header.
    decider: Option<Vec<u8>>,
}
