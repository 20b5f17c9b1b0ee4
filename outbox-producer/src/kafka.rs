//! The Kafka broker adapter: [`outbox_core::Broker`] over librdkafka (rdkafka).
//!
//! **Guarantee.** A send reports [`SendOutcome::Acked`] only for a message the
//! cluster acknowledged with `acks=all`, at the position it was written;
//! [`SendOutcome::NotPersisted`] only when librdkafka says the message was
//! *not* persisted (its `NOT_PERSISTED` status, or it never left the client);
//! everything else, notably a request that timed out after the broker may
//! have written it, is [`SendOutcome::Unknown`]. A lookup answers
//! [`LookupOutcome::Absent`] only after reading every offset of the frozen
//! partition from the lower bound to the high watermark captured when the
//! scan began.
//!
//! Pieces:
//! - [`KafkaConfig`]: bootstrap servers and every limit, with units in names.
//! - [`KafkaBroker`]: an idempotent producer (`enable.idempotence=true`,
//!   `acks=all`) on a [`ThreadedProducer`] whose delivery callback reads the
//!   persistence status with `rd_kafka_message_status` and completes a
//!   oneshot channel carried as the delivery opaque. The report is captured
//!   by the channel even while the caller is not polling its future (a
//!   stalled worker), so a late poll still yields the genuine outcome.
//! - Lookup: a fresh, group-less [`BaseConsumer`] assigned to the frozen
//!   partition, bounded in messages and time.
//!
//! ## Lookup
//!
//! A fresh consumer (unique `group.id`, `enable.auto.commit=false`, manual
//! `assign`, `read_uncommitted` since this producer is never transactional)
//! reads the frozen partition:
//! - The range is `[from_offset, high watermark)`, both watermarks read
//!   first. An empty range is `Absent`; the answer says nothing of messages
//!   written after the scan began.
//! - A log that starts above `from_offset` (truncated), a `from_offset`
//!   above the high watermark (the topic was recreated, the cluster
//!   replaced, the partition truncated) or a range in which some offset
//!   holds no record (a compacted topic, deleted records, transaction
//!   markers) is `Unavailable` with a reason starting [`LOG_INCOMPLETE`],
//!   never `Absent`.
//! - A range wider than [`KafkaConfig::lookup_max_messages`] offsets, a scan
//!   longer than [`KafkaConfig::lookup_timeout_ms`], or any broker or consumer
//!   error is `Unavailable`, never `Absent`. A destination on another cluster
//!   than the connected one is `Unavailable` too.
//! - A message matches when its last `outbox-event-id` header equals the
//!   eventId. Its receipt is [`outbox_core::headers::MessageClaims::receipt`]
//!   of its parsed headers at its real position, with the digest of the
//!   bytes read back, so divergent bytes are quarantined by the receipt
//!   decision. If the other headers do not parse, the receipt is built from
//!   what can be read (generation or 0, attemptId or the nil id, destination
//!   digest header or empty), with the real payload digest and position: the
//!   receipt decision rejects or quarantines it rather than it going unseen.
//!   A key that contradicts the destination header is only logged, since a
//!   receipt has no field for it.
//!
//! **Invariant:** the client never chooses a partition: every record carries
//! the partition of the frozen destination.
//!
//! **Invariant:** an in-flight slot (see [`KafkaConfig::max_in_flight`]) is
//! released only when librdkafka has reported the message's fate, not when the
//! caller stops waiting.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_core::headers;
use outbox_core::{sha256_digest, AttemptId, Broker, BrokerReceipt, Destination, EventId, LookupOutcome, OutgoingMessage, PartitionScan, ScannedMessage, SendOutcome};
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use rdkafka_sys::rd_kafka_msg_status_t;
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, error, info, warn};

/// Environment variable read by [`KafkaConfig::from_env`]: the bootstrap
/// servers, `host:port[,host:port...]`.
pub const BOOTSTRAP_ENV: &str = "OUTBOX_KAFKA_BOOTSTRAP";

/// Default [`KafkaConfig::message_timeout_ms`].
pub const DEFAULT_MESSAGE_TIMEOUT_MS: u64 = 30_000;
/// Default [`KafkaConfig::request_timeout_ms`].
pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 10_000;
/// Default [`KafkaConfig::max_in_flight`].
pub const DEFAULT_MAX_IN_FLIGHT: usize = 1_000;
/// Default [`KafkaConfig::enqueue_timeout_ms`].
pub const DEFAULT_ENQUEUE_TIMEOUT_MS: u64 = 5_000;
/// Default [`KafkaConfig::connect_timeout_ms`].
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 10_000;
/// Default [`KafkaConfig::lookup_max_messages`].
pub const DEFAULT_LOOKUP_MAX_MESSAGES: u64 = 1_000_000;
/// Default [`KafkaConfig::lookup_timeout_ms`].
pub const DEFAULT_LOOKUP_TIMEOUT_MS: u64 = 30_000;
/// Default [`KafkaConfig::max_concurrent_lookups`].
pub const DEFAULT_MAX_CONCURRENT_LOOKUPS: usize = 4;

/// Slack added to the longest time librdkafka may take to report on a
/// message before a send whose report never came is declared
/// [`SendOutcome::Unknown`]. This is only a backstop against a lost report.
const DELIVERY_REPORT_SLACK_MS: u64 = 5_000;
/// librdkafka's default `reconnect.backoff.max.ms`. While a leader is
/// unreachable, expired messages are noticed between reconnect attempts, so
/// a report may come this much after `message.timeout.ms`.
const LIBRDKAFKA_RECONNECT_BACKOFF_MAX_MS: u64 = 10_000;
/// Pause between two enqueue attempts while librdkafka's local queue is full.
const ENQUEUE_RETRY_PAUSE_MS: u64 = 10;
/// Longest single consumer poll during a lookup.
const LOOKUP_POLL_SLICE_MS: u64 = 100;

/// librdkafka settings the adapter sets itself and that
/// [`KafkaConfig::extra`] may not override: they carry the guarantees.
const PROTECTED_SETTINGS: &[&str] = &[
    "bootstrap.servers",
    "metadata.broker.list",
    "enable.idempotence",
    "acks",
    "request.required.acks",
    "message.timeout.ms",
    "delivery.timeout.ms",
    "request.timeout.ms",
    "transactional.id",
    "group.id",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "auto.offset.reset",
    "isolation.level",
    "enable.partition.eof",
];

/// Configuration of a [`KafkaBroker`]. Every limit has its unit in its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KafkaConfig {
    /// `bootstrap.servers`: `host:port[,host:port...]`.
    pub bootstrap_servers: String,
    /// `message.timeout.ms`: how long librdkafka may try to deliver one
    /// message (queueing, retries, in flight) before reporting it failed.
    /// Default 30 000.
    pub message_timeout_ms: u64,
    /// `request.timeout.ms`: how long one produce request may wait for the
    /// broker's answer. Default 10 000.
    pub request_timeout_ms: u64,
    /// Most messages handed to librdkafka and not yet reported on. A send
    /// beyond the bound waits for a slot (at most `enqueue_timeout_ms`).
    /// Default 1 000.
    pub max_in_flight: usize,
    /// Longest a send waits for an in-flight slot and for room in
    /// librdkafka's local queue before it gives up with
    /// [`SendOutcome::NotPersisted`] (nothing was handed over). Default 5 000.
    pub enqueue_timeout_ms: u64,
    /// Longest [`KafkaBroker::connect`] waits for the cluster id. Default 10 000.
    pub connect_timeout_ms: u64,
    /// Most offsets one lookup may scan; a wider range answers
    /// [`LookupOutcome::Unavailable`]. Default 1 000 000.
    pub lookup_max_messages: u64,
    /// Longest one lookup may take, watermarks included; past it the lookup
    /// answers [`LookupOutcome::Unavailable`]. Default 30 000.
    pub lookup_timeout_ms: u64,
    /// Most lookups scanning at the same time (each uses its own consumer).
    /// Default 4.
    pub max_concurrent_lookups: usize,
    /// Raw librdkafka settings applied to both the producer and the lookup
    /// consumers (security, client.id, tuning...). The settings the adapter
    /// relies on (idempotence, acks, timeouts, consumer group and offset
    /// settings) are refused here; use the typed fields.
    pub extra: Vec<(String, String)>,
}

impl KafkaConfig {
    /// A configuration for `bootstrap_servers` with the default limits.
    pub fn new(bootstrap_servers: impl Into<String>) -> Self {
        KafkaConfig {
            bootstrap_servers: bootstrap_servers.into(),
            message_timeout_ms: DEFAULT_MESSAGE_TIMEOUT_MS,
            request_timeout_ms: DEFAULT_REQUEST_TIMEOUT_MS,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            enqueue_timeout_ms: DEFAULT_ENQUEUE_TIMEOUT_MS,
            connect_timeout_ms: DEFAULT_CONNECT_TIMEOUT_MS,
            lookup_max_messages: DEFAULT_LOOKUP_MAX_MESSAGES,
            lookup_timeout_ms: DEFAULT_LOOKUP_TIMEOUT_MS,
            max_concurrent_lookups: DEFAULT_MAX_CONCURRENT_LOOKUPS,
            extra: Vec::new(),
        }
    }

    /// A configuration with the default limits for the bootstrap servers in
    /// the `OUTBOX_KAFKA_BOOTSTRAP` environment variable ([`BOOTSTRAP_ENV`]).
    pub fn from_env() -> Result<Self, KafkaAdapterError> {
        match std::env::var(BOOTSTRAP_ENV) {
            Ok(v) if !v.trim().is_empty() => Ok(KafkaConfig::new(v.trim())),
            Ok(_) => Err(KafkaAdapterError::Config(format!("{BOOTSTRAP_ENV} is empty"))),
            Err(e) => Err(KafkaAdapterError::Config(format!("{BOOTSTRAP_ENV}: {e}"))),
        }
    }

    /// Adds one raw librdkafka setting (see [`KafkaConfig::extra`]).
    pub fn with_setting(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.extra.push((key.into(), value.into()));
        self
    }

    /// Checks the limits and the extra settings.
    pub fn validate(&self) -> Result<(), KafkaAdapterError> {
        let fail = |m: String| Err(KafkaAdapterError::Config(m));
        if self.bootstrap_servers.trim().is_empty() {
            return fail("bootstrap_servers is empty".into());
        }
        let positive: [(&str, u64); 7] = [
            ("message_timeout_ms", self.message_timeout_ms),
            ("request_timeout_ms", self.request_timeout_ms),
            ("enqueue_timeout_ms", self.enqueue_timeout_ms),
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("lookup_max_messages", self.lookup_max_messages),
            ("lookup_timeout_ms", self.lookup_timeout_ms),
            ("max_in_flight", self.max_in_flight as u64),
        ];
        for (name, v) in positive {
            if v == 0 {
                return fail(format!("{name} must be positive"));
            }
        }
        if self.max_concurrent_lookups == 0 {
            return fail("max_concurrent_lookups must be positive".into());
        }
        // librdkafka takes these as C ints.
        for (name, v) in [("message_timeout_ms", self.message_timeout_ms), ("request_timeout_ms", self.request_timeout_ms)] {
            if v > i32::MAX as u64 {
                return fail(format!("{name} {v} is too large"));
            }
        }
        if self.max_in_flight > Semaphore::MAX_PERMITS {
            return fail(format!("max_in_flight {} is too large", self.max_in_flight));
        }
        for (k, _) in &self.extra {
            if PROTECTED_SETTINGS.contains(&k.trim()) {
                return fail(format!("extra setting {k:?} is set by the adapter; use the typed field"));
            }
        }
        Ok(())
    }

    fn producer_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        for (k, v) in &self.extra {
            c.set(k, v);
        }
        c.set("bootstrap.servers", &self.bootstrap_servers)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("message.timeout.ms", self.message_timeout_ms.to_string())
            .set("request.timeout.ms", self.request_timeout_ms.to_string())
            .set_log_level(RDKafkaLogLevel::Info);
        c
    }

    fn lookup_config(&self, group_id: &str) -> ClientConfig {
        let mut c = ClientConfig::new();
        for (k, v) in &self.extra {
            c.set(k, v);
        }
        c.set("bootstrap.servers", &self.bootstrap_servers)
            .set("group.id", group_id)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "error")
            .set("enable.partition.eof", "false")
            // Our producer is never transactional: every message it wrote is
            // in the log for good, whatever transactions others run.
            .set("isolation.level", "read_uncommitted")
            .set("check.crcs", "true")
            .set_log_level(RDKafkaLogLevel::Info);
        c
    }
}

/// Errors of the Kafka adapter's setup calls. Sends and lookups never fail
/// with an error: they answer with [`SendOutcome`] and [`LookupOutcome`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaAdapterError {
    /// The configuration is invalid (a limit is zero, a protected setting in `extra`...).
    #[error("kafka adapter configuration: {0}")]
    Config(String),
    /// librdkafka refused to create or use a client.
    #[error("kafka client: {0}")]
    Client(#[from] KafkaError),
    /// The cluster did not tell its id within the connect timeout.
    #[error("no cluster id from the Kafka cluster within {timeout_ms} ms")]
    NoClusterId {
        /// The timeout that ran out.
        timeout_ms: u64,
    },
    /// Topic metadata could not be read or is not usable.
    #[error("kafka metadata: {0}")]
    Metadata(String),
    /// A blocking task of the adapter failed.
    #[error("kafka adapter task: {0}")]
    Task(String),
}

impl KafkaAdapterError {
    /// Whether the same call may succeed if retried (the cluster may be
    /// unreachable for now).
    pub fn is_retryable(&self) -> bool {
        matches!(self, KafkaAdapterError::NoClusterId { .. } | KafkaAdapterError::Metadata(_))
    }
}

/// What the delivery callback needs: where to put the outcome, and the
/// in-flight slot to release once librdkafka has reported.
struct Pending {
    tx: oneshot::Sender<SendOutcome>,
    permit: OwnedSemaphorePermit,
}

/// The producer context: reads the persistence status of each delivery
/// report and completes the send's channel; forwards librdkafka logs to tracing.
struct DeliveryContext;

impl ClientContext for DeliveryContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        forward_log(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if matches!(error.rdkafka_error_code(), Some(RDKafkaErrorCode::Fatal)) {
            error!(%error, reason, "kafka producer fatal error: every further send will fail");
        } else {
            warn!(%error, reason, "kafka producer error");
        }
    }
}

impl ProducerContext for DeliveryContext {
    type DeliveryOpaque = Box<Pending>;

    fn delivery(&self, result: &DeliveryResult<'_>, pending: Box<Pending>) {
        let outcome = delivery_outcome(result);
        let Pending { tx, permit } = *pending;
        match &outcome {
            SendOutcome::Acked { partition, offset } => debug!(partition, offset, "kafka delivery acked"),
            SendOutcome::NotPersisted(reason) => warn!(reason = %reason, "kafka delivery failed, not persisted"),
            SendOutcome::Unknown(reason) => warn!(reason = %reason, "kafka delivery outcome unknown"),
        }
        // The slot is free before anyone can observe the outcome.
        drop(permit);
        if tx.send(outcome).is_err() {
            debug!("kafka delivery report for a send whose caller is gone");
        }
    }
}

struct LookupContext;

impl ClientContext for LookupContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        forward_log(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        debug!(%error, reason, "kafka lookup consumer error");
    }
}

impl rdkafka::consumer::ConsumerContext for LookupContext {}

fn forward_log(level: RDKafkaLogLevel, fac: &str, message: &str) {
    match level {
        RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical | RDKafkaLogLevel::Error => {
            error!(target: "librdkafka", fac, "{message}")
        }
        RDKafkaLogLevel::Warning => warn!(target: "librdkafka", fac, "{message}"),
        RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => info!(target: "librdkafka", fac, "{message}"),
        RDKafkaLogLevel::Debug => debug!(target: "librdkafka", fac, "{message}"),
    }
}

/// The outcome of one delivery report.
fn delivery_outcome(result: &DeliveryResult<'_>) -> SendOutcome {
    match result {
        Ok(msg) if msg.offset() >= 0 => SendOutcome::Acked { partition: msg.partition(), offset: msg.offset() },
        Ok(msg) => SendOutcome::Unknown(format!("acknowledged without an offset on partition {}", msg.partition())),
        Err((err, msg)) => match persistence_status(msg) {
            rd_kafka_msg_status_t::RD_KAFKA_MSG_STATUS_NOT_PERSISTED => SendOutcome::NotPersisted(format!("{err} (not persisted)")),
            rd_kafka_msg_status_t::RD_KAFKA_MSG_STATUS_POSSIBLY_PERSISTED => SendOutcome::Unknown(format!("{err} (possibly persisted)")),
            // An error report with status PERSISTED: the message is in the
            // log but we have no trustworthy position for it.
            rd_kafka_msg_status_t::RD_KAFKA_MSG_STATUS_PERSISTED => SendOutcome::Unknown(format!("{err} (persisted, reported as failed)")),
        },
    }
}

#[allow(unsafe_code)]
fn persistence_status(msg: &BorrowedMessage<'_>) -> rd_kafka_msg_status_t {
    // SAFETY: `msg.ptr()` points to the librdkafka message of a delivery
    // report, valid for as long as `msg` is borrowed; the call only reads it.
    unsafe { rdkafka_sys::rd_kafka_message_status(msg.ptr()) }
}

/// The result of one attempt to hand a message to librdkafka.
enum Enqueue {
    /// Handed over: the delivery report will complete the channel.
    Queued(oneshot::Receiver<SendOutcome>),
    /// librdkafka's local queue is full: retry with the same slot.
    QueueFull(OwnedSemaphorePermit),
    /// Refused before anything left the client.
    Refused(SendOutcome),
}

struct Inner {
    producer: ThreadedProducer<DeliveryContext>,
    cluster_id: String,
    config: KafkaConfig,
    in_flight: Arc<Semaphore>,
    lookups: Arc<Semaphore>,
}

impl Inner {
    fn enqueue(&self, m: &OutgoingMessage, permit: OwnedSemaphorePermit) -> Enqueue {
        if m.partition < 0 {
            return Enqueue::Refused(SendOutcome::NotPersisted(format!("invalid partition {}", m.partition)));
        }
        let (tx, rx) = oneshot::channel();
        let mut hs = OwnedHeaders::new_with_capacity(m.headers.len());
        for (key, value) in &m.headers {
            hs = hs.insert(Header { key: key.as_str(), value: Some(value.as_slice()) });
        }
        let record: BaseRecord<'_, [u8], [u8], Box<Pending>> = BaseRecord::with_opaque_to(&m.topic, Box::new(Pending { tx, permit }))
            .partition(m.partition)
            .key(m.key.as_slice())
            .payload(m.payload.as_slice())
            .headers(hs);
        match self.producer.send(record) {
            Ok(()) => {
                debug!(topic = %m.topic, partition = m.partition, "kafka message enqueued");
                Enqueue::Queued(rx)
            }
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), record)) => {
                let Pending { permit, .. } = *record.delivery_opaque;
                Enqueue::QueueFull(permit)
            }
            Err((e, _record)) => {
                warn!(topic = %m.topic, partition = m.partition, error = %e, "kafka refused to enqueue");
                Enqueue::Refused(SendOutcome::NotPersisted(format!("not enqueued: {e}")))
            }
        }
    }

    /// Drives one send to its outcome, starting from an enqueue attempt made
    /// at call time if there was one.
    async fn drive(self: Arc<Self>, message: OutgoingMessage, first: Option<Enqueue>) -> SendOutcome {
        let enqueue_timeout = Duration::from_millis(self.config.enqueue_timeout_ms);
        let deadline = tokio::time::Instant::now() + enqueue_timeout;
        let mut step = first;
        let rx = loop {
            let attempt = match step.take() {
                Some(a) => a,
                None => {
                    let permit = match tokio::time::timeout_at(deadline, Arc::clone(&self.in_flight).acquire_owned()).await {
                        Ok(Ok(p)) => p,
                        Ok(Err(_)) => return SendOutcome::NotPersisted("kafka adapter closed".into()),
                        Err(_) => {
                            warn!(topic = %message.topic, max_in_flight = self.config.max_in_flight, "no in-flight slot for a send");
                            return SendOutcome::NotPersisted(format!(
                                "no in-flight slot within {} ms ({} in flight)",
                                self.config.enqueue_timeout_ms, self.config.max_in_flight
                            ));
                        }
                    };
                    self.enqueue(&message, permit)
                }
            };
            match attempt {
                Enqueue::Queued(rx) => break rx,
                Enqueue::Refused(outcome) => return outcome,
                Enqueue::QueueFull(permit) => {
                    if tokio::time::Instant::now() >= deadline {
                        warn!(topic = %message.topic, "librdkafka queue full for the whole enqueue timeout");
                        return SendOutcome::NotPersisted(format!("librdkafka queue full for {} ms", self.config.enqueue_timeout_ms));
                    }
                    debug!(topic = %message.topic, "librdkafka queue full, retrying enqueue");
                    tokio::time::sleep(Duration::from_millis(ENQUEUE_RETRY_PAUSE_MS)).await;
                    step = Some(self.enqueue(&message, permit));
                }
            }
        };
        await_report(rx, self.report_backstop()).await
    }

    /// How long a send waits for its delivery report before answering
    /// Unknown: `message_timeout_ms + request_timeout_ms +
    /// reconnect.backoff.max.ms` + slack.
    fn report_backstop(&self) -> Duration {
        let c = &self.config;
        let backoff_ms = c
            .extra
            .iter()
            .rev()
            .find(|(k, _)| k.trim() == "reconnect.backoff.max.ms")
            .and_then(|(_, v)| v.trim().parse::<u64>().ok())
            .unwrap_or(LIBRDKAFKA_RECONNECT_BACKOFF_MAX_MS);
        Duration::from_millis(c.message_timeout_ms.saturating_add(c.request_timeout_ms).saturating_add(backoff_ms).saturating_add(DELIVERY_REPORT_SLACK_MS))
    }
}

/// Waits for a delivery report. A report already in the channel always wins
/// over the backstop, however late the caller polls.
async fn await_report(mut rx: oneshot::Receiver<SendOutcome>, backstop: Duration) -> SendOutcome {
    match tokio::time::timeout(backstop, &mut rx).await {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(_)) => SendOutcome::Unknown("delivery report lost: the producer was closed with the message in flight".into()),
        Err(_) => match rx.try_recv() {
            Ok(outcome) => outcome,
            Err(_) => {
                warn!(backstop_ms = backstop.as_millis() as u64, "no kafka delivery report within the backstop");
                SendOutcome::Unknown(format!("no delivery report within {} ms", backstop.as_millis()))
            }
        },
    }
}

/// The Kafka side of the protocol: an idempotent producer that sends each
/// message to its frozen partition and reports its persistence status, and
/// bounded scans of a partition for an eventId.
///
/// Cheap to clone; clones share the producer and the limits.
#[derive(Clone)]
pub struct KafkaBroker {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for KafkaBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaBroker")
            .field("cluster_id", &self.inner.cluster_id)
            .field("bootstrap_servers", &self.inner.config.bootstrap_servers)
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

impl KafkaBroker {
    /// Creates the idempotent producer (`enable.idempotence=true`,
    /// `acks=all`) and reads the cluster id, failing with
    /// [`KafkaAdapterError::NoClusterId`] if the cluster does not tell it
    /// within [`KafkaConfig::connect_timeout_ms`].
    pub async fn connect(config: KafkaConfig) -> Result<KafkaBroker, KafkaAdapterError> {
        config.validate()?;
        tokio::task::spawn_blocking(move || KafkaBroker::connect_blocking(config))
            .await
            .map_err(|e| KafkaAdapterError::Task(e.to_string()))?
    }

    fn connect_blocking(config: KafkaConfig) -> Result<KafkaBroker, KafkaAdapterError> {
        let producer: ThreadedProducer<DeliveryContext> = config.producer_config().create_with_context(DeliveryContext)?;
        let timeout = Duration::from_millis(config.connect_timeout_ms);
        let cluster_id = producer
            .client()
            .fetch_cluster_id(timeout)
            .filter(|id| !id.is_empty())
            .ok_or(KafkaAdapterError::NoClusterId { timeout_ms: config.connect_timeout_ms })?;
        info!(cluster_id = %cluster_id, bootstrap = %config.bootstrap_servers, "kafka adapter connected");
        let in_flight = Arc::new(Semaphore::new(config.max_in_flight));
        let lookups = Arc::new(Semaphore::new(config.max_concurrent_lookups));
        Ok(KafkaBroker { inner: Arc::new(Inner { producer, cluster_id, config, in_flight, lookups }) })
    }

    /// The cluster id the cluster reported at connect.
    pub fn cluster_id(&self) -> &str {
        &self.inner.cluster_id
    }

    /// The configuration in force.
    pub fn config(&self) -> &KafkaConfig {
        &self.inner.config
    }

    /// Messages handed to librdkafka and not yet reported on.
    pub fn in_flight(&self) -> usize {
        self.inner.config.max_in_flight.saturating_sub(self.inner.in_flight.available_permits())
    }

    /// Sends one message to its explicit topic and partition and returns a
    /// `'static` future of its outcome, so callers can spawn it.
    ///
    /// If an in-flight slot is free, the message is handed to librdkafka
    /// right here, before the future is polled; otherwise at the future's
    /// first poll, after waiting (at most [`KafkaConfig::enqueue_timeout_ms`])
    /// for a slot. Once handed over, the delivery report is captured whether
    /// or not the future is being polled, and a later poll yields it.
    /// Dropping the future does not withdraw the message.
    pub fn send_detached(&self, message: OutgoingMessage) -> impl Future<Output = SendOutcome> + Send + 'static {
        let inner = Arc::clone(&self.inner);
        let first = Arc::clone(&inner.in_flight).try_acquire_owned().ok().map(|permit| inner.enqueue(&message, permit));
        inner.drive(message, first)
    }

    /// The partition count of `topic`, from the cluster's metadata (for
    /// checking route policies against the real topic).
    pub async fn partition_count(&self, topic: &str) -> Result<u32, KafkaAdapterError> {
        let inner = Arc::clone(&self.inner);
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let timeout = Duration::from_millis(inner.config.connect_timeout_ms);
            let md = inner.producer.client().fetch_metadata(Some(&topic), timeout)?;
            let t = md.topics().iter().find(|t| t.name() == topic).ok_or_else(|| KafkaAdapterError::Metadata(format!("topic {topic} not in metadata")))?;
            if let Some(e) = t.error() {
                return Err(KafkaAdapterError::Metadata(format!("topic {topic}: {}", RDKafkaErrorCode::from(e))));
            }
            if t.partitions().is_empty() {
                return Err(KafkaAdapterError::Metadata(format!("topic {topic} has no partitions")));
            }
            u32::try_from(t.partitions().len()).map_err(|_| KafkaAdapterError::Metadata(format!("topic {topic}: too many partitions")))
        })
        .await
        .map_err(|e| KafkaAdapterError::Task(e.to_string()))?
    }

    /// Waits (at most `timeout_ms`) until every message handed to librdkafka
    /// has been reported on.
    pub async fn flush(&self, timeout_ms: u64) -> Result<(), KafkaAdapterError> {
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || inner.producer.flush(Duration::from_millis(timeout_ms)))
            .await
            .map_err(|e| KafkaAdapterError::Task(e.to_string()))?
            .map_err(KafkaAdapterError::from)
    }
}

#[async_trait]
impl Broker for KafkaBroker {
    fn cluster_id(&self) -> &str {
        &self.inner.cluster_id
    }

    /// Hands the message to librdkafka at the first poll (see
    /// [`KafkaBroker::send_detached`]) and waits for its delivery report.
    async fn send(&self, message: OutgoingMessage) -> SendOutcome {
        self.send_detached(message).await
    }

    fn supports_lookup(&self) -> bool {
        true
    }

    /// The enqueue wait plus the delivery-report backstop: past it librdkafka
    /// has given up on the message, so it can no longer be written.
    fn max_in_flight_ms(&self) -> Option<u64> {
        let backstop = u64::try_from(self.inner.report_backstop().as_millis()).unwrap_or(u64::MAX);
        Some(self.inner.config.enqueue_timeout_ms.saturating_add(backstop))
    }

    /// Scans `destination.topic` / `destination.partition` from
    /// `from_offset` (raised to the low watermark) to the high watermark read
    /// at the start, for messages whose `outbox-event-id` header is
    /// `event_id`. See the [module documentation](self) for what a match reports.
    async fn lookup(&self, destination: &Destination, event_id: &EventId, from_offset: i64) -> LookupOutcome {
        if destination.cluster_id != self.inner.cluster_id {
            return LookupOutcome::Unavailable(format!(
                "destination is on cluster {}, this adapter is connected to {}",
                destination.cluster_id, self.inner.cluster_id
            ));
        }
        let timeout = Duration::from_millis(self.inner.config.lookup_timeout_ms);
        let started = Instant::now();
        let permit = match tokio::time::timeout(timeout, Arc::clone(&self.inner.lookups).acquire_owned()).await {
            Ok(Ok(p)) => p,
            Ok(Err(_)) => return LookupOutcome::Unavailable("kafka adapter closed".into()),
            Err(_) => return LookupOutcome::Unavailable(format!("no lookup slot within {} ms", timeout.as_millis())),
        };
        let deadline = started + timeout;
        let scan = ScanRequest {
            cluster_id: self.inner.cluster_id.clone(),
            topic: destination.topic.clone(),
            partition: destination.partition,
            event_id: event_id.clone(),
            from_offset,
            max_messages: self.inner.config.lookup_max_messages,
            deadline,
        };
        let config = self.inner.config.clone();
        let outcome = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            scan_partition(&config, &scan)
        })
        .await;
        match outcome {
            Ok(o) => {
                debug!(event_id = %event_id, topic = %destination.topic, partition = destination.partition, outcome = ?o, "kafka lookup");
                o
            }
            Err(e) => LookupOutcome::Unavailable(format!("lookup task failed: {e}")),
        }
    }

    /// Reads the eventId header of up to `max_messages` messages of
    /// `topic`/`partition` from `from_offset`, for the bypass check.
    async fn scan_event_ids(&self, topic: &str, partition: i32, from_offset: i64, max_messages: u64) -> Result<PartitionScan, String> {
        let timeout = Duration::from_millis(self.inner.config.lookup_timeout_ms);
        let permit = match tokio::time::timeout(timeout, Arc::clone(&self.inner.lookups).acquire_owned()).await {
            Ok(Ok(p)) => p,
            _ => return Err("no lookup slot".into()),
        };
        let req = ScanRequest {
            cluster_id: self.inner.cluster_id.clone(),
            topic: topic.to_owned(),
            partition,
            event_id: EventId::from_parts(0, 0),
            from_offset,
            max_messages: max_messages.min(self.inner.config.lookup_max_messages),
            deadline: Instant::now() + timeout,
        };
        let config = self.inner.config.clone();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let mut messages = Vec::new();
            let next_offset = scan_range(&config, &req, Some(req.max_messages), |msg| {
                let hs = message_headers(msg);
                let text = |name: &str| hs.iter().rev().find(|(k, _)| k == name).map(|(_, v)| String::from_utf8_lossy(v).into_owned());
                let (event_id, source, attempt_id) = (text(headers::EVENT_ID), text(outbox_core::trust::SOURCE), text(headers::ATTEMPT_ID));
                messages.push(ScannedMessage {
                    offset: msg.offset(),
                    event_id,
                    source,
                    attempt_id,
                    key: msg.key().map(<[u8]>::to_vec),
                    payload_digest: sha256_digest(msg.payload().unwrap_or_default()),
                });
            })?;
            Ok(PartitionScan { messages, next_offset })
        })
        .await
        .map_err(|e| format!("scan task failed: {e}"))?
    }
}

/// One bounded scan.
struct ScanRequest {
    cluster_id: String,
    topic: String,
    partition: i32,
    event_id: EventId,
    from_offset: i64,
    max_messages: u64,
    deadline: Instant,
}

impl ScanRequest {
    fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }
}

static LOOKUP_SEQ: AtomicU64 = AtomicU64::new(0);

/// How the reason of a lookup that found the log incomplete (truncated,
/// recreated, compacted) begins: see [`is_log_incomplete`].
pub const LOG_INCOMPLETE: &str = "log incomplete: ";

/// Whether an [`LookupOutcome::Unavailable`] reason says the log itself
/// cannot prove absence (truncated, recreated, compacted), as opposed to a
/// broker that could not be asked: the reconciler reports it as the finding
/// `log_unavailable`.
pub fn is_log_incomplete(reason: &str) -> bool {
    reason.starts_with(LOG_INCOMPLETE)
}

/// Scans one partition with a fresh consumer; see the module documentation.
///
/// - The range is `[max(from_offset, low watermark), high watermark)`, with
///   both watermarks read first; an empty range is `Absent`. A range wider
///   than `lookup_max_messages` offsets, a deadline that runs out or any
///   broker or consumer error is `Unavailable`.
/// - A message matches when its last `outbox-event-id` header equals the
///   eventId. Its receipt is `MessageClaims::receipt` of its parsed headers
///   at its real position, with the digest of the bytes read back. If the
///   headers do not parse, the receipt is built from what can be read (the
///   generation or 0, the attemptId or the nil id, the destination digest
///   header or empty) with the real payload digest and position, so the
///   receipt decision rejects or quarantines it rather than it going unseen.
/// - Messages whose placement or key contradict their destination header are
///   still reported (the receipt carries the real placement; the decision
///   quarantines a wrong partition); a wrong key is logged as a warning,
///   since a receipt has no field for it.
fn scan_partition(config: &KafkaConfig, req: &ScanRequest) -> LookupOutcome {
    let mut found = Vec::new();
    let scanned = scan_range(config, req, None, |msg| {
        if let Some(receipt) = match_message(&req.cluster_id, &req.event_id, msg) {
            found.push(receipt);
        }
    });
    match scanned {
        Err(what) => {
            warn!(topic = %req.topic, partition = req.partition, event_id = %req.event_id, reason = %what, "kafka lookup unavailable");
            LookupOutcome::Unavailable(what)
        }
        Ok(_) if found.is_empty() => LookupOutcome::Absent,
        Ok(_) => LookupOutcome::Found(found),
    }
}

/// Reads `[max(from_offset, low), end)` of one partition with a fresh
/// consumer, where `end` is the high watermark read at the start, or
/// `from_offset + limit` if that is lower. Calls `on_message` for each
/// message in order and returns the next offset to read. A range wider than
/// `max_messages` (with no `limit`), a deadline that runs out or any broker
/// error is an `Err`.
fn scan_range(config: &KafkaConfig, req: &ScanRequest, limit: Option<u64>, mut on_message: impl FnMut(&BorrowedMessage<'_>)) -> Result<i64, String> {
    if req.from_offset < 0 {
        return Err(format!("negative lower bound {}", req.from_offset));
    }
    let seq = LOOKUP_SEQ.fetch_add(1, AtomicOrdering::Relaxed);
    let group_id = format!("outbox-lookup-{}-{}-{}", std::process::id(), seq, req.event_id.as_str());
    let consumer: BaseConsumer<LookupContext> = config.lookup_config(&group_id).create_with_context(LookupContext).map_err(|e| format!("lookup consumer: {e}"))?;
    let (low, high) = consumer
        .fetch_watermarks(&req.topic, req.partition, req.remaining())
        .map_err(|e| format!("watermarks of {}/{}: {e}", req.topic, req.partition))?;
    // A lookup (no limit) is an absence proof: it must read every offset
    // from the lower bound. A log that starts above the bound was truncated
    // (retention, deleted records) and a bound above the log's end belongs
    // to another log (the topic was recreated, the cluster replaced, the
    // partition truncated): either way messages may be gone unseen.
    let proof = limit.is_none();
    if proof && low > req.from_offset {
        return Err(format!(
            "{LOG_INCOMPLETE}{}/{} starts at offset {low}, above the lower bound {}: the log was truncated and messages below may be gone",
            req.topic, req.partition, req.from_offset
        ));
    }
    if proof && req.from_offset > high {
        return Err(format!(
            "{LOG_INCOMPLETE}the lower bound {} of {}/{} is above its end {high}: the log was recreated or truncated since it was recorded",
            req.from_offset, req.topic, req.partition
        ));
    }
    let start = req.from_offset.max(low).max(0);
    let high = match limit {
        Some(l) => high.min(start.saturating_add(i64::try_from(l).unwrap_or(i64::MAX))),
        None => high,
    };
    if start >= high {
        debug!(topic = %req.topic, partition = req.partition, start, low, high, "kafka scan: empty range");
        return Ok(start.max(req.from_offset));
    }
    let width = u64::try_from(high - start).unwrap_or(u64::MAX);
    if width > req.max_messages {
        return Err(format!("range [{start}, {high}) of {}/{} exceeds the lookup bound of {} messages", req.topic, req.partition, req.max_messages));
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&req.topic, req.partition, Offset::Offset(start)).map_err(|e| format!("assignment: {e}"))?;
    consumer.assign(&tpl).map_err(|e| format!("assign {}/{}: {e}", req.topic, req.partition))?;
    debug!(topic = %req.topic, partition = req.partition, start, high, "kafka scan");
    let mut next = start;
    let mut read: u64 = 0;
    while next < high {
        let remaining = req.remaining();
        if remaining.is_zero() {
            return Err(format!("scan timed out at offset {next} of [{start}, {high}) of {}/{}", req.topic, req.partition));
        }
        match consumer.poll(remaining.min(Duration::from_millis(LOOKUP_POLL_SLICE_MS))) {
            None | Some(Err(KafkaError::PartitionEOF(_))) => {
                // Offsets without messages (e.g. transaction markers) advance
                // the position without yielding anything.
                if let Some(p) = position_of(&consumer, &req.topic, req.partition) {
                    next = next.max(p);
                }
            }
            Some(Err(e)) => return Err(format!("reading {}/{} at offset {next}: {e}", req.topic, req.partition)),
            Some(Ok(msg)) => {
                if msg.topic() != req.topic || msg.partition() != req.partition || msg.offset() < next {
                    continue;
                }
                if msg.offset() >= high {
                    break;
                }
                // A record above the next expected offset: the offsets in
                // between hold no record (compaction removed them, or
                // transaction markers): the range cannot prove absence.
                if proof && msg.offset() > next {
                    return Err(format!(
                        "{LOG_INCOMPLETE}offsets [{next}, {}) of {}/{} hold no record (a compacted topic, deleted records or transaction markers)",
                        msg.offset(),
                        req.topic,
                        req.partition
                    ));
                }
                next = msg.offset() + 1;
                read += 1;
                if read > req.max_messages {
                    return Err(format!("scan read more than {} messages", req.max_messages));
                }
                on_message(&msg);
            }
        }
    }
    debug!(topic = %req.topic, partition = req.partition, start, high, read, "kafka scan complete");
    Ok(next)
}

fn position_of(consumer: &BaseConsumer<LookupContext>, topic: &str, partition: i32) -> Option<i64> {
    let tpl = consumer.position().ok()?;
    match tpl.find_partition(topic, partition)?.offset() {
        Offset::Offset(o) => Some(o),
        _ => None,
    }
}

/// Every header of a message, read without panicking whatever it holds
/// (rdkafka's own accessors panic on a name that is not UTF-8): such a name
/// is decoded lossily, so it can never equal an outbox header name, and the
/// message is read, reported and passed like any other.
pub fn message_headers(msg: &BorrowedMessage<'_>) -> Vec<(String, Vec<u8>)> {
    let Some(h) = msg.headers() else {
        return Vec::new();
    };
    let count = h.count();
    let mut out = Vec::with_capacity(count);
    for idx in 0..count {
        let mut name: *const std::os::raw::c_char = std::ptr::null();
        let mut value: *const std::os::raw::c_void = std::ptr::null();
        let mut size: usize = 0;
        // `BorrowedHeaders` is a zero-sized view whose address is librdkafka's
        // header list (rdkafka casts it the same way).
        let native = h as *const rdkafka::message::BorrowedHeaders as *const rdkafka_sys::rd_kafka_headers_t;
        // SAFETY: the list lives as long as `msg`; the pointers written are
        // borrowed from it and copied out below.
        let err = unsafe { rdkafka_sys::rd_kafka_header_get_all(native, idx, &mut name, &mut value, &mut size) };
        if err != rdkafka_sys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR || name.is_null() {
            continue;
        }
        // SAFETY: header names are NUL-terminated; `value` spans `size` bytes.
        let name = String::from_utf8_lossy(unsafe { std::ffi::CStr::from_ptr(name) }.to_bytes()).into_owned();
        let value = if value.is_null() { Vec::new() } else { unsafe { std::slice::from_raw_parts(value.cast::<u8>(), size) }.to_vec() };
        out.push((name, value));
    }
    out
}

/// The receipt of `msg` if its last eventId header is `event_id`.
fn match_message(cluster_id: &str, event_id: &EventId, msg: &BorrowedMessage<'_>) -> Option<BrokerReceipt> {
    let owned = message_headers(msg);
    let hit = owned.iter().rev().find(|(k, _)| k == headers::EVENT_ID)?;
    if hit.1 != event_id.as_str().as_bytes() {
        return None;
    }
    let payload = msg.payload().unwrap_or_default();
    let (topic, partition, offset) = (msg.topic(), msg.partition(), msg.offset());
    Some(match headers::parse(&owned) {
        Ok(claims) => {
            if let Err(e) = claims.check(payload, topic, partition, msg.key()) {
                warn!(event_id = %event_id, topic, partition, offset, error = %e, "kafka lookup: matching message does not verify");
            }
            claims.receipt(cluster_id, topic, partition, offset, payload)
        }
        Err(e) => {
            warn!(event_id = %event_id, topic, partition, offset, error = %e, "kafka lookup: matching message has unreadable headers");
            let text = |name: &str| owned.iter().rev().find(|(k, _)| k == name).and_then(|(_, v)| std::str::from_utf8(v).ok());
            BrokerReceipt {
                event_id: event_id.clone(),
                envelope_generation: text(headers::ENVELOPE_GENERATION).and_then(|v| v.parse().ok()).unwrap_or(0),
                attempt_id: text(headers::ATTEMPT_ID).and_then(|v| v.parse().ok()).unwrap_or_else(|| AttemptId::from_parts(0, 0)),
                payload_digest: sha256_digest(payload),
                destination_digest: text(headers::DESTINATION_DIGEST).unwrap_or_default().to_owned(),
                cluster_id: cluster_id.to_owned(),
                topic: topic.to_owned(),
                partition,
                offset,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_report_already_received_wins_over_the_backstop() {
        let (tx, rx) = oneshot::channel();
        assert!(tx.send(SendOutcome::Acked { partition: 1, offset: 9 }).is_ok());
        assert_eq!(await_report(rx, Duration::ZERO).await, SendOutcome::Acked { partition: 1, offset: 9 });
    }

    #[tokio::test]
    async fn a_missing_or_lost_report_is_unknown() {
        let (tx, rx) = oneshot::channel::<SendOutcome>();
        assert!(matches!(await_report(rx, Duration::from_millis(10)).await, SendOutcome::Unknown(_)));
        drop(tx);
        let (tx, rx) = oneshot::channel::<SendOutcome>();
        drop(tx);
        assert!(matches!(await_report(rx, Duration::from_secs(5)).await, SendOutcome::Unknown(_)));
    }
}
