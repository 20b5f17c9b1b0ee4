//! Reading the watermark topic: consumers' watermarks published over the
//! broker, applied to the outbox database.
//!
//! An idempotent consumer whose state lives in its own database publishes
//! its watermark rows as `outboxWatermark.v1` records (`.v2` for a row of a
//! topic id: the log of one incarnation of a topic) to a compacted topic
//! of the cluster it reads ([`DEFAULT_TOPIC`], one per cluster). The
//! [`WatermarkTopicReader`] reads that topic from the start of its log (its
//! read position is kept in `outbox_watermark_topic_cursors` and moves in
//! the transaction that applies the records) and applies each record to
//! `outbox_consumer_watermarks`, from where the unconsumed check, lag in the
//! status and the report, and the retention gate use it unchanged.
//!
//! **What is applied.** A record is applied only when all of this holds;
//! otherwise it is ignored and, but for the first case, is a finding:
//! - it decodes (`outboxWatermark.v1` or `.v2`, its key naming its value) and names
//!   the cluster it was read from (`watermark_rejected` otherwise);
//! - when [`WatermarkTopicConfig::verify_keys`] holds keys for the consumer
//!   it names: it is signed (headers `outbox-watermark-key-id` and
//!   `outbox-watermark-signature`) by one of those keys, over its exact
//!   value bytes (`watermark_rejected` otherwise, with the reason: unsigned,
//!   unknown key id, bad signature);
//! - when the reader holds no key for the consumer: the consumer is opted
//!   out of verification by name ([`WatermarkTopicConfig::allow_unsigned`]),
//!   and its records are then not checked. A declared consumer neither keyed
//!   nor opted out has every record refused, signed or not
//!   (`watermark_rejected`, saying that no key is configured for it and how
//!   to configure one or opt it out; one open finding per consumer and log,
//!   however many records arrive);
//! - the consumer is declared in `outbox_consumers`
//!   (`watermark_undeclared_consumer` otherwise);
//! - its committed offset is not beyond the end (high watermark) of the
//!   partition it speaks about (`watermark_beyond_end` otherwise);
//! - it is not older than what is stored (its `updatedAtMs`, the consumer
//!   database's time of the row, is not below the stored one): an older
//!   record is a reordered earlier publication and is ignored quietly;
//! - the committed offset and every count are at least what is stored:
//!   offsets and counts never move back (`watermark_moved_back` otherwise).
//!
//! A declared consumer that has published over the broker and whose last
//! acceptable record is older than `ReconcilerConfig::stale_watermark_after_ms`
//! is `stale_watermark` (a condition: it resolves once records arrive
//! again); its watermark stays where it was, so a mandatory consumer's
//! stale watermark holds retention.
//!
//! **Authentication.** By default a record moves a consumer's watermark only
//! when signed by a key the reader holds for that consumer. For a consumer
//! opted out ([`WatermarkTopicConfig::allow_unsigned`]; the reader logs them
//! at WARN when it connects) the reader trusts any producer with write
//! access to the watermark topic, within the rules above. For one with keys,
//! only a holder of one of them can speak for it; a replayed genuine record
//! is still bounded by the rules above (an
//! older record is out of date, a lower offset moves back), and the value
//! names the consumer, cluster, topic, topic id and partition, so a signed
//! record cannot be moved to another of them.
//!
//! A record is applied to the row of its own log: consumer, cluster, topic,
//! partition and topic id (exactly; a `.v1` record is of no topic id). The
//! partition's end it is checked against is the end of the topic's current
//! log, whatever id the record names.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use outbox_core::trust::SigningKey;
use outbox_core::watermark_record::{self, WatermarkRecord};
pub use outbox_core::watermark_record::DEFAULT_TOPIC;
use outbox_core::{Clock, SystemClock};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use sqlx::{PgPool, Postgres, Row as _, Transaction};

use crate::error::ProducerError;

/// Default [`WatermarkTopicConfig::group_id`].
pub const DEFAULT_GROUP_ID: &str = "outbox-reconciler-watermarks";
/// Default [`WatermarkTopicConfig::max_records_per_round`].
pub const DEFAULT_MAX_RECORDS_PER_ROUND: usize = 10_000;
/// Upper limit of [`WatermarkTopicConfig::max_records_per_round`].
pub const LIMIT_MAX_RECORDS_PER_ROUND: usize = 1_000_000;
/// Default [`WatermarkTopicConfig::round_timeout_ms`].
pub const DEFAULT_ROUND_TIMEOUT_MS: u64 = 10_000;
/// How long a round goes on reading after the reported ends of the
/// watermark topic's partitions while nothing more arrives, ms.
pub const READ_PAST_END_IDLE_MS: u64 = 200;
/// Most findings one round records per kind (the rest are counted only).
pub const MAX_FINDINGS_PER_ROUND: usize = 1_000;
/// Most verification keys per consumer in [`WatermarkTopicConfig::verify_keys`].
pub const LIMIT_KEYS_PER_CONSUMER: usize = 16;
/// Most consumers with verification keys.
pub const LIMIT_KEYED_CONSUMERS: usize = 10_000;
/// Most consumers in [`WatermarkTopicConfig::allow_unsigned`].
pub const LIMIT_UNSIGNED_CONSUMERS: usize = 10_000;
/// Finding kinds raised by the reader; evidence, left open until an operator resolves them.
pub const READER_FINDINGS: &[&str] = &["watermark_undeclared_consumer", "watermark_moved_back", "watermark_beyond_end", "watermark_rejected"];

/// Where the watermark topic is and how much one round reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatermarkTopicConfig {
    /// Kafka `bootstrap.servers` of the cluster whose watermark topic is read.
    pub bootstrap_servers: String,
    /// The watermark topic (default [`DEFAULT_TOPIC`]).
    pub topic: String,
    /// Kafka group id of the reader's client (default [`DEFAULT_GROUP_ID`]);
    /// the read position is kept in the outbox database, not in the group.
    pub group_id: String,
    /// Most records read and applied by one round.
    pub max_records_per_round: usize,
    /// Longest one round reads, ms (also the metadata timeout).
    pub round_timeout_ms: u64,
    /// Extra librdkafka properties (security, ...).
    pub kafka: BTreeMap<String, String>,
    /// Verification keys per consumer id: a record naming a consumer listed
    /// here is applied only when signed by one of its keys (several during a
    /// rotation). The records of a declared consumer listed neither here nor
    /// in [`Self::allow_unsigned`] are refused. `Debug` never shows the
    /// secrets.
    pub verify_keys: BTreeMap<String, Vec<SigningKey>>,
    /// Consumer ids explicitly opted out of verification: their records are
    /// applied without a signature check (signed or not), so anyone who can
    /// write the watermark topic can speak for them. A consumer may not be
    /// both here and in [`Self::verify_keys`] ([`Self::validate`] refuses it).
    pub allow_unsigned: BTreeSet<String>,
}

impl WatermarkTopicConfig {
    /// Defaults for the cluster at `bootstrap_servers`.
    pub fn new(bootstrap_servers: impl Into<String>) -> Self {
        WatermarkTopicConfig {
            bootstrap_servers: bootstrap_servers.into(),
            topic: DEFAULT_TOPIC.to_owned(),
            group_id: DEFAULT_GROUP_ID.to_owned(),
            max_records_per_round: DEFAULT_MAX_RECORDS_PER_ROUND,
            round_timeout_ms: DEFAULT_ROUND_TIMEOUT_MS,
            kafka: BTreeMap::new(),
            verify_keys: BTreeMap::new(),
            allow_unsigned: BTreeSet::new(),
        }
    }

    /// Adds a verification key for `consumer_id`.
    pub fn with_key(mut self, consumer_id: &str, key: SigningKey) -> Self {
        self.verify_keys.entry(consumer_id.to_owned()).or_default().push(key);
        self
    }

    /// Opts `consumer_id` out of verification: its records are applied
    /// unsigned (see [`Self::allow_unsigned`]). Only for a consumer that
    /// cannot sign yet, and with writes to the watermark topic restricted to
    /// the consumers' principals.
    pub fn allow_unsigned(mut self, consumer_id: &str) -> Self {
        self.allow_unsigned.insert(consumer_id.to_owned());
        self
    }

    /// Parses consumer ids opted out of verification (entries trimmed, empty
    /// ones skipped; `what` names where they come from in errors).
    pub fn parse_unsigned<'a>(what: &str, entries: impl IntoIterator<Item = &'a str>) -> Result<BTreeSet<String>, ProducerError> {
        let mut out = BTreeSet::new();
        for (i, entry) in entries.into_iter().enumerate() {
            let consumer = entry.trim();
            if consumer.is_empty() {
                continue;
            }
            outbox_core::id::validate_identifier("consumerId", consumer).map_err(|e| ProducerError::Config(format!("{what}: entry {}: {e}", i + 1)))?;
            out.insert(consumer.to_owned());
        }
        Ok(out)
    }

    /// Parses verification keys written `CONSUMER_ID=KEY_ID=HEX`, one per
    /// entry (`what` names where they come from in errors, which never
    /// repeat a secret).
    pub fn parse_keys<'a>(what: &str, entries: impl IntoIterator<Item = &'a str>) -> Result<BTreeMap<String, Vec<SigningKey>>, ProducerError> {
        let mut out: BTreeMap<String, Vec<SigningKey>> = BTreeMap::new();
        for (i, entry) in entries.into_iter().enumerate() {
            let bad = || ProducerError::Config(format!("{what}: entry {} is not CONSUMER_ID=KEY_ID=HEX", i + 1));
            let mut parts = entry.trim().rsplitn(3, '=');
            let (hex, key_id, consumer) = (parts.next().ok_or_else(bad)?, parts.next().ok_or_else(bad)?, parts.next().ok_or_else(bad)?);
            outbox_core::id::validate_identifier("consumerId", consumer).map_err(|e| ProducerError::Config(format!("{what}: entry {}: {e}", i + 1)))?;
            let key = SigningKey::from_hex(key_id, hex).map_err(|e| ProducerError::Config(format!("{what}: entry {}: {e}", i + 1)))?;
            out.entry(consumer.to_owned()).or_default().push(key);
        }
        Ok(out)
    }

    /// Checks identifiers and limits.
    pub fn validate(&self) -> Result<(), ProducerError> {
        outbox_core::id::validate_identifier("watermark topic", &self.topic)?;
        outbox_core::id::validate_identifier("watermark group id", &self.group_id)?;
        if self.bootstrap_servers.trim().is_empty() {
            return Err(ProducerError::Config("watermark topic: bootstrap_servers is empty".into()));
        }
        if !(1..=LIMIT_MAX_RECORDS_PER_ROUND).contains(&self.max_records_per_round) {
            return Err(ProducerError::Config(format!("max_records_per_round {} (1..={LIMIT_MAX_RECORDS_PER_ROUND})", self.max_records_per_round)));
        }
        if !(100..=600_000).contains(&self.round_timeout_ms) {
            return Err(ProducerError::Config(format!("round_timeout_ms {} (100..=600000)", self.round_timeout_ms)));
        }
        if self.verify_keys.len() > LIMIT_KEYED_CONSUMERS {
            return Err(ProducerError::Config(format!("verification keys for {} consumers (..={LIMIT_KEYED_CONSUMERS})", self.verify_keys.len())));
        }
        for (consumer, keys) in &self.verify_keys {
            outbox_core::id::validate_identifier("consumerId", consumer)?;
            if keys.is_empty() || keys.len() > LIMIT_KEYS_PER_CONSUMER {
                return Err(ProducerError::Config(format!("consumer {consumer}: {} verification keys (1..={LIMIT_KEYS_PER_CONSUMER})", keys.len())));
            }
            for (i, k) in keys.iter().enumerate() {
                if keys[..i].iter().any(|o| o.key_id() == k.key_id()) {
                    return Err(ProducerError::Config(format!("consumer {consumer}: key id {} given twice", k.key_id())));
                }
            }
        }
        if self.allow_unsigned.len() > LIMIT_UNSIGNED_CONSUMERS {
            return Err(ProducerError::Config(format!("{} consumers allowed unsigned watermark records (..={LIMIT_UNSIGNED_CONSUMERS})", self.allow_unsigned.len())));
        }
        for consumer in &self.allow_unsigned {
            outbox_core::id::validate_identifier("consumerId", consumer)?;
            if self.verify_keys.contains_key(consumer) {
                return Err(ProducerError::Config(format!(
                    "consumer {consumer} has watermark verification keys and is also allowed unsigned watermark records: remove one of the two (with keys its records are verified)"
                )));
            }
        }
        Ok(())
    }
}

/// Why a declared consumer's record is refused when the reader holds no key
/// for it and it is not opted out: what to configure, in code and in `outbox
/// reconcile`.
fn no_key_reason(consumer: &str) -> String {
    format!(
        "consumer {consumer}: no watermark verification key is configured for this consumer, so its records are refused (signed or not); \
         give the reconciler the consumer's key (OUTBOX_RECONCILE_WATERMARK_KEYS=\"{consumer}=KEY_ID=HEX\", [reconcile] watermark_keys, \
         WatermarkTopicConfig::with_key), or opt the consumer out of verification explicitly (--watermark-unsigned {consumer}, \
         OUTBOX_RECONCILE_WATERMARK_UNSIGNED, [reconcile] watermark_unsigned, WatermarkTopicConfig::allow_unsigned)"
    )
}

/// What one round of [`WatermarkTopicReader::ingest_once`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IngestReport {
    /// Records read.
    pub read: usize,
    /// Records applied (the stored watermark now says what they say).
    pub applied: usize,
    /// Records older than the stored watermark (reordered earlier publications), ignored.
    pub out_of_date: usize,
    /// Records of consumers not declared in `outbox_consumers`, ignored.
    pub undeclared: usize,
    /// Records that would move an offset or a count back, ignored.
    pub moved_back: usize,
    /// Records beyond the end of their partition, ignored.
    pub beyond_end: usize,
    /// Records that do not decode, name another cluster, fail their
    /// consumer's signature check, or are of a declared consumer the reader
    /// holds no key for, ignored.
    pub rejected: usize,
    /// Of [`Self::rejected`], those that failed the signature check of a
    /// consumer with keys (unsigned, unknown key id, bad signature).
    pub bad_signature: usize,
    /// Of [`Self::rejected`], those of a declared consumer that has no
    /// verification key and is not opted out
    /// ([`WatermarkTopicConfig::allow_unsigned`]), signed or not.
    pub no_key: usize,
}

impl IngestReport {
    /// Records ignored with a finding.
    pub fn findings(&self) -> usize {
        self.undeclared + self.moved_back + self.beyond_end + self.rejected
    }
}

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
            let (key_id, signature) = (last(watermark_record::KEY_ID_HEADER), last(watermark_record::SIGNATURE_HEADER));
            messages.push(ReadRecord { partition: p, offset: off, key: m.key().map(<[u8]>::to_vec), value: m.payload().map(<[u8]>::to_vec), key_id, signature });
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
        let mut decoded = Vec::with_capacity(messages.len());
        let mut data_ends: HashMap<(String, i32), Result<i64, String>> = HashMap::new();
        for m in messages {
            let (p, off) = (m.partition, m.offset);
            let r = WatermarkRecord::decode(m.key.as_deref(), m.value.as_deref()).map_err(|e| Rejected { why: e.to_string(), consumer: None, cause: Cause::Format }).and_then(|r| {
                if r.cluster_id != self.cluster_id {
                    return Err(Rejected { why: format!("names cluster {:?} but was read from cluster {:?}", r.cluster_id, self.cluster_id), consumer: None, cause: Cause::Format });
                }
                match self.config.verify_keys.get(&r.consumer_id) {
                    Some(keys) => {
                        let value = m.value.as_deref().unwrap_or_default();
                        if let Err(e) = watermark_record::verify_signature(value, m.key_id.as_deref(), m.signature.as_deref(), keys) {
                            return Err(Rejected { why: format!("consumer {}: {e}", r.consumer_id), consumer: Some(r.consumer_id.clone()), cause: Cause::Signature });
                        }
                    }
                    // Opted out by name: not checked.
                    None if self.config.allow_unsigned.contains(&r.consumer_id) => {}
                    // Neither keyed nor opted out: refused. (An undeclared
                    // consumer's record is `watermark_undeclared_consumer` below.)
                    None if declared.contains(&r.consumer_id) => {
                        return Err(Rejected { why: no_key_reason(&r.consumer_id), consumer: Some(r.consumer_id.clone()), cause: Cause::NoKey(log_of(&r)) });
                    }
                    None => {}
                }
                Ok(r)
            });
            if let Some(r) = r.as_ref().ok().filter(|r| declared.contains(&r.consumer_id)) {
                if let std::collections::hash_map::Entry::Vacant(slot) = data_ends.entry((r.topic.clone(), r.partition)) {
                    slot.insert(self.offsets(&r.topic, r.partition).await.map(|(_, high)| high).map_err(|e| e.to_string()));
                }
            }
            decoded.push((p, off, r));
        }

        let now = self.clock.now_ms();
        let mut tx = self.pool.begin().await?;
        let mut findings: Vec<(&'static str, String, String, String)> = Vec::new();
        let mut unkeyed: BTreeSet<String> = BTreeSet::new();
        // Index in `findings` of the no-key finding of each (log, consumer):
        // the last record's position wins.
        let mut no_key_at: HashMap<(String, String), usize> = HashMap::new();
        for (p, off, r) in decoded {
            let at = format!("{}/{}/{p}@{off}", self.cluster_id, topic);
            let record = match r {
                Ok(r) => r,
                Err(Rejected { why, consumer, cause }) => {
                    report.rejected += 1;
                    let consumer = consumer.unwrap_or_default();
                    match cause {
                        Cause::Format => findings.push(("watermark_rejected", at, consumer, format!("watermark record ignored: {why}"))),
                        Cause::Signature => {
                            report.bad_signature += 1;
                            findings.push(("watermark_rejected", at, consumer, format!("watermark record ignored: {why}")));
                        }
                        Cause::NoKey(log) => {
                            // One open finding per consumer and log, not per
                            // record: such a consumer publishes every few seconds.
                            report.no_key += 1;
                            let detail = format!("watermark record at {at} ignored: {why}");
                            match no_key_at.entry((log.clone(), consumer.clone())) {
                                std::collections::hash_map::Entry::Occupied(i) => findings[*i.get()].3 = detail,
                                std::collections::hash_map::Entry::Vacant(slot) => {
                                    slot.insert(findings.len());
                                    findings.push(("watermark_rejected", log, consumer.clone(), detail));
                                }
                            }
                            unkeyed.insert(consumer);
                        }
                    }
                    continue;
                }
            };
            let log = log_of(&record);
            if !declared.contains(&record.consumer_id) {
                report.undeclared += 1;
                findings.push(("watermark_undeclared_consumer", log, record.consumer_id.clone(), format!("watermark record at {at} from a consumer not declared in outbox_consumers, ignored")));
                continue;
            }
            match data_ends.get(&(record.topic.clone(), record.partition)) {
                Some(Ok(end)) if record.committed_offset <= *end => {}
                other => {
                    report.beyond_end += 1;
                    let why = match other {
                        Some(Ok(end)) => format!("committed offset {} is beyond the partition's end {end}", record.committed_offset),
                        Some(Err(e)) => format!("the partition's end could not be read ({e})"),
                        None => "the partition's end is unknown".to_owned(),
                    };
                    ignored(&mut tx, &record, now).await?;
                    findings.push(("watermark_beyond_end", log, record.consumer_id.clone(), format!("watermark record at {at} ignored: {why}")));
                    continue;
                }
            }
            match apply(&mut tx, &record).await? {
                Applied::Yes => {
                    report.applied += 1;
                    arrived(&mut tx, &record, now).await?;
                }
                Applied::OutOfDate => {
                    report.out_of_date += 1;
                    arrived(&mut tx, &record, now).await?;
                }
                Applied::MovedBack(why) => {
                    report.moved_back += 1;
                    ignored(&mut tx, &record, now).await?;
                    findings.push(("watermark_moved_back", log, record.consumer_id.clone(), format!("watermark record at {at} ignored: {why}")));
                }
            }
        }
        for (p, n) in &next {
            sqlx::query(
                "INSERT INTO outbox_watermark_topic_cursors (cluster_id, topic, partition, next_offset) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (cluster_id, topic, partition) DO UPDATE SET next_offset = GREATEST(outbox_watermark_topic_cursors.next_offset, EXCLUDED.next_offset)",
            )
            .bind(&self.cluster_id)
            .bind(&topic)
            .bind(p)
            .bind(n)
            .execute(&mut *tx)
            .await?;
        }
        record_findings(&mut tx, &findings, now).await?;
        tx.commit().await?;
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
}

/// Why a record was rejected, and the consumer it named when it decoded.
struct Rejected {
    why: String,
    consumer: Option<String>,
    cause: Cause,
}

/// What a rejection counts as.
enum Cause {
    /// Does not decode, or names another cluster.
    Format,
    /// Fails the signature check of a consumer with keys.
    Signature,
    /// Of a declared consumer without keys that is not opted out; the log
    /// the record is about (what its finding names).
    NoKey(String),
}

/// The log a record is about, as findings name it.
fn log_of(r: &WatermarkRecord) -> String {
    match &r.topic_id {
        None => format!("{}/{}/{}", r.cluster_id, r.topic, r.partition),
        Some(id) => format!("{}/{} (topic id {id})/{}", r.cluster_id, r.topic, r.partition),
    }
}

enum Applied {
    Yes,
    OutOfDate,
    MovedBack(String),
}

/// Applies one record to `outbox_consumer_watermarks`, monotonically.
async fn apply(tx: &mut Transaction<'_, Postgres>, r: &WatermarkRecord) -> Result<Applied, ProducerError> {
    let row = sqlx::query(
        "SELECT committed_offset, applied_count, duplicate_count, quarantined_count, dead_lettered_count,
                floor(extract(epoch FROM updated_at) * 1000)::bigint AS updated_ms
         FROM outbox_consumer_watermarks
         WHERE consumer_id = $1 AND cluster_id = $2 AND topic = $3 AND partition = $4 AND topic_id IS NOT DISTINCT FROM $5 FOR UPDATE",
    )
    .bind(&r.consumer_id)
    .bind(&r.cluster_id)
    .bind(&r.topic)
    .bind(r.partition)
    .bind(r.topic_id.as_deref())
    .fetch_optional(&mut **tx)
    .await?;
    if let Some(row) = row {
        let updated_ms: i64 = row.try_get("updated_ms")?;
        if r.updated_at_ms < updated_ms {
            return Ok(Applied::OutOfDate);
        }
        for (name, stored, got) in [
            ("committed offset", row.try_get::<i64, _>("committed_offset")?, r.committed_offset),
            ("applied count", row.try_get("applied_count")?, r.applied_count),
            ("duplicate count", row.try_get("duplicate_count")?, r.duplicate_count),
            ("quarantined count", row.try_get("quarantined_count")?, r.quarantined_count),
            ("dead-lettered count", row.try_get("dead_lettered_count")?, r.dead_lettered_count),
        ] {
            if got < stored {
                return Ok(Applied::MovedBack(format!("{name} {got} is below the stored {stored}")));
            }
        }
    }
    let updated_at = chrono::DateTime::<chrono::Utc>::from_timestamp_millis(r.updated_at_ms).unwrap_or_default();
    sqlx::query(outbox_core::watermark_record::COPY_UPSERT_SQL)
        .bind(&r.consumer_id)
        .bind([r.topic.as_str()])
        .bind([r.partition])
        .bind([r.committed_offset])
        .bind([r.applied_count])
        .bind([r.duplicate_count])
        .bind([r.quarantined_count])
        .bind([r.dead_lettered_count])
        .bind([r.last_event_id.as_deref()])
        .bind([updated_at])
        .bind([r.cluster_id.as_str()])
        .bind([r.topic_id.as_deref()])
        .execute(&mut **tx)
        .await?;
    Ok(Applied::Yes)
}

/// A declared consumer's acceptable record arrived at `now`.
async fn arrived(tx: &mut Transaction<'_, Postgres>, r: &WatermarkRecord, now: i64) -> Result<(), ProducerError> {
    sqlx::query(
        "INSERT INTO outbox_watermark_publishers AS p (consumer_id, cluster_id, last_received_ms, last_published_at_ms, records_accepted)
         VALUES ($1, $2, $3, $4, 1)
         ON CONFLICT (consumer_id, cluster_id) DO UPDATE SET last_received_ms = GREATEST(p.last_received_ms, EXCLUDED.last_received_ms),
             last_published_at_ms = GREATEST(p.last_published_at_ms, EXCLUDED.last_published_at_ms), records_accepted = p.records_accepted + 1",
    )
    .bind(&r.consumer_id)
    .bind(&r.cluster_id)
    .bind(now)
    .bind(r.published_at_ms)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// A declared consumer's record was ignored (counted; its arrival time does not move).
async fn ignored(tx: &mut Transaction<'_, Postgres>, r: &WatermarkRecord, now: i64) -> Result<(), ProducerError> {
    sqlx::query(
        "INSERT INTO outbox_watermark_publishers AS p (consumer_id, cluster_id, last_received_ms, last_published_at_ms, records_ignored)
         VALUES ($1, $2, $3, 0, 1)
         ON CONFLICT (consumer_id, cluster_id) DO UPDATE SET records_ignored = p.records_ignored + 1",
    )
    .bind(&r.consumer_id)
    .bind(&r.cluster_id)
    .bind(now)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Opens (or marks seen again) the reader's findings, at most
/// [`MAX_FINDINGS_PER_ROUND`] per kind.
async fn record_findings(tx: &mut Transaction<'_, Postgres>, findings: &[(&'static str, String, String, String)], now: i64) -> Result<(), ProducerError> {
    let mut per_kind: HashMap<&str, usize> = HashMap::new();
    let kept: Vec<&(&'static str, String, String, String)> = findings
        .iter()
        .filter(|f| {
            let n = per_kind.entry(f.0).or_default();
            *n += 1;
            *n <= MAX_FINDINGS_PER_ROUND
        })
        .collect();
    if kept.is_empty() {
        return Ok(());
    }
    let kinds: Vec<&str> = kept.iter().map(|f| f.0).collect();
    let ids: Vec<&str> = kept.iter().map(|f| f.1.as_str()).collect();
    let consumers: Vec<&str> = kept.iter().map(|f| f.2.as_str()).collect();
    let details: Vec<&str> = kept.iter().map(|f| f.3.as_str()).collect();
    sqlx::query(
        "INSERT INTO outbox_findings (kind, event_id, consumer_id, age_ms, detail, first_seen_ms, last_seen_ms)
         SELECT DISTINCT ON (k, e, c) k, e, c, 0, d, $5, $5 FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[]) AS t(k, e, c, d)
         ON CONFLICT (kind, event_id, consumer_id) WHERE resolved_at_ms IS NULL
         DO UPDATE SET detail = EXCLUDED.detail, last_seen_ms = EXCLUDED.last_seen_ms",
    )
    .bind(&kinds)
    .bind(&ids)
    .bind(&consumers)
    .bind(&details)
    .bind(now)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verification_keys_parse_and_validate() {
        let (a, b) = ("0a".repeat(32), "0b".repeat(32));
        let keys = WatermarkTopicConfig::parse_keys("X", [format!("shipping=wm-old={a}").as_str(), &format!("shipping=wm-new={b}"), &format!("billing=wm-1={a}")]).unwrap();
        assert_eq!(keys["shipping"].iter().map(SigningKey::key_id).collect::<Vec<_>>(), vec!["wm-old", "wm-new"]);
        assert_eq!(keys["billing"].len(), 1);
        let mut c = WatermarkTopicConfig::new("k:9092");
        c.verify_keys = keys;
        c.validate().unwrap();
        assert!(!format!("{c:?}").contains("0a0a"), "no secret in Debug");
        for bad in ["shipping", "shipping=wm-1", &format!("bad id=wm-1={a}"), "shipping=wm-1=zz", &format!("shipping=wm-1={}", "0a".repeat(8))] {
            let err = WatermarkTopicConfig::parse_keys("OUTBOX_RECONCILE_WATERMARK_KEYS", [bad]).unwrap_err().to_string();
            assert!(err.contains("OUTBOX_RECONCILE_WATERMARK_KEYS: entry 1") && !err.contains("0a0a"), "{bad}: {err}");
        }
        let twice = WatermarkTopicConfig::new("k:9092").with_key("s", SigningKey::from_hex("k", &a).unwrap()).with_key("s", SigningKey::from_hex("k", &b).unwrap());
        assert!(twice.validate().unwrap_err().to_string().contains("given twice"));
        let mut many = WatermarkTopicConfig::new("k:9092");
        for i in 0..=LIMIT_KEYS_PER_CONSUMER {
            many = many.with_key("s", SigningKey::from_hex(&format!("k{i}"), &a).unwrap());
        }
        assert!(many.validate().is_err());
        let mut empty = WatermarkTopicConfig::new("k:9092");
        empty.verify_keys.insert("s".into(), Vec::new());
        assert!(empty.validate().is_err());
    }

    #[test]
    fn unsigned_consumers_are_opted_out_by_name_and_validated() {
        assert!(WatermarkTopicConfig::new("k:9092").allow_unsigned.is_empty(), "nobody is opted out by default");
        let c = WatermarkTopicConfig::new("k:9092").allow_unsigned("billing").allow_unsigned("audit");
        c.validate().unwrap();
        assert_eq!(c.allow_unsigned.iter().map(String::as_str).collect::<Vec<_>>(), vec!["audit", "billing"]);
        let parsed = WatermarkTopicConfig::parse_unsigned("OUTBOX_RECONCILE_WATERMARK_UNSIGNED", [" billing", "", "audit ", "billing"]).unwrap();
        assert_eq!(parsed, c.allow_unsigned);
        for bad in ["*", "bad id", "a,b"] {
            let err = WatermarkTopicConfig::parse_unsigned("OUTBOX_RECONCILE_WATERMARK_UNSIGNED", [bad]).unwrap_err().to_string();
            assert!(err.contains("OUTBOX_RECONCILE_WATERMARK_UNSIGNED: entry 1"), "{bad}: {err}");
            assert!(WatermarkTopicConfig::new("k:9092").allow_unsigned(bad).validate().is_err(), "{bad}");
        }
        // Keys and an opt-out for one consumer: a configuration error.
        let both = WatermarkTopicConfig::new("k:9092").with_key("billing", SigningKey::from_hex("k", &"0a".repeat(32)).unwrap()).allow_unsigned("billing");
        let err = both.validate().unwrap_err().to_string();
        assert!(err.contains("consumer billing has watermark verification keys and is also allowed unsigned"), "{err}");
        let mut many = WatermarkTopicConfig::new("k:9092");
        many.allow_unsigned = (0..=LIMIT_UNSIGNED_CONSUMERS).map(|i| format!("c{i}")).collect();
        assert!(many.validate().is_err());
    }

    #[test]
    fn the_no_key_reason_says_how_to_configure_a_key_or_opt_out() {
        let why = no_key_reason("shipping");
        for want in ["no watermark verification key is configured", "OUTBOX_RECONCILE_WATERMARK_KEYS=\"shipping=KEY_ID=HEX\"", "with_key", "--watermark-unsigned shipping", "OUTBOX_RECONCILE_WATERMARK_UNSIGNED", "allow_unsigned"] {
            assert!(why.contains(want), "{want}: {why}");
        }
    }
}
