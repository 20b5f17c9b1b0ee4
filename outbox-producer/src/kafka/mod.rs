//! The Kafka broker adapter: [`outbox_core::Broker`] over librdkafka (rdkafka).
//!
//! **Guarantee.** A send reports [`SendOutcome::Acked`] only for a message the
//! cluster acknowledged with `acks=all`, at the position it was written;
//! [`SendOutcome::NotPersisted`] only when librdkafka says the message was
//! *not* persisted (its `NOT_PERSISTED` status, or it never left the client);
//! everything else, notably a request that timed out after the broker may
//! have written it, is [`SendOutcome::Unknown`]. A lookup answers
//! [`LookupOutcome::Absent`] only after reading every offset of the frozen
//! partition from the lower bound to its end as captured when the scan
//! began: the high watermark, or past the records the broker serves beyond
//! it.
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
//! - The range is `[from.offset, end)`, both watermarks read first. The
//!   end is the high watermark unless the broker serves records past it (a
//!   broker that under-reports its end, tansu 0.6 after a multi-record
//!   produce batch): the partition is read from the high watermark with a
//!   consumer of its own until the broker says it ends (at most
//!   [`PAST_END_READ_MS`]), and the end is past the last record served
//!   ([`outbox_core::reconcile::absence_proof_end`]; a WARN once per
//!   partition). A read that does not reach the partition's end is
//!   `Unavailable`. An empty range is `Absent`; the answer says nothing of
//!   messages written after the scan began.
//! - The lower bound is sound only on the log it was read from. When it
//!   has an anchor (the event whose receipt held `from.offset - 1`), that
//!   offset is read first, with a consumer of its own: when it holds
//!   another message, or lies at or past the log's end, the partition is
//!   another log (the cluster replaced by an empty one, a topic without a
//!   recorded id recreated) and is read from offset 0 instead
//!   ([`outbox_core::plan_absence_scan`]), so a message of the new log
//!   below the old bound is found, not declared absent. Such a log that no
//!   longer starts at 0, or an anchor offset that holds no record, is
//!   `Unavailable`.
//! - A log that starts above `from.offset` (truncated), a `from.offset`
//!   above the high watermark with no anchor to tell the log (the topic was
//!   recreated, the cluster replaced, the partition truncated) or a range
//!   in which some offset holds no record (a compacted topic, deleted
//!   records, transaction markers) is `Unavailable` with a reason starting
//!   [`LOG_INCOMPLETE`], never `Absent`.
//! - A `destination.v2` names its topic's id: when the topic now has
//!   another id (deleted and created again under the same name) the lookup
//!   is `Unavailable` with a reason starting [`LOG_INCOMPLETE`] ("the topic
//!   was recreated") before anything is read; when the cluster gives no id
//!   or cannot be asked, `Unavailable` too.
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
//! ## Sends to a `destination.v2`
//!
//! A message whose `outbox-destination` header is a `destination.v2` names
//! the topic id frozen with the event. Before it is handed to librdkafka the
//! topic's current id is checked against it: a topic that now has another
//! id (deleted and created again under the same name) is not the
//! destination's log, and the send is [`SendOutcome::NotPersisted`] with
//! nothing written. The current id is read once per topic per
//! [`TOPIC_ID_CACHE_MS`] ([`KafkaBroker::topic_id`]: a metadata request and
//! a topic description, not one per message); a send that finds no fresh
//! answer waits for the read at most half of
//! [`KafkaConfig::enqueue_timeout_ms`], within its enqueue wait; a lookup's
//! own (always fresh) read of the id replaces it.
//! When the id cannot be read (the cluster gives no topic ids, or does not
//! answer in time) the send goes ahead unchecked (logged at debug): the
//! lookup still refuses to call a range of such a log absent. A recreation
//! less than [`TOPIC_ID_CACHE_MS`] before a send, or between the check and
//! the write, is not caught here; the receipt then names the frozen id, and
//! the bypass scan's lost positions and the lookups report the log's
//! change.
//!
//! **Invariant:** an in-flight slot (see [`KafkaConfig::max_in_flight`]) is
//! released only when librdkafka has reported the message's fate, not when the
//! caller stops waiting.
//!
//! ## Files
//!
//! One job each: `settings` (the limits' defaults, which librdkafka
//! settings are the adapter's own, secret or about the connection, and
//! [`KafkaConfig`]); `error` ([`KafkaAdapterError`], error texts with
//! secrets masked); `oauth` (OAUTHBEARER token providers); `delivery` (the
//! producer, its delivery reports, the enqueue and its in-flight slots);
//! `health` ([`ProducerHealth`], probes and [`SupervisionStep`]s);
//! `topic_id` (reading topic ids, the send-time check of a
//! `destination.v2`); `scan` (bounded partition scans: lookups and the
//! bypass check). This file holds [`KafkaBroker`] and its [`Broker`]
//! implementation.

mod delivery;
mod error;
mod health;

/// The longest a read past a partition's reported end (the bypass scan's,
/// a lookup's, the watermark reader's) waits for messages, ms: a broker
/// serves at once what it holds there.
pub const PAST_END_READ_MS: u64 = 2_000;
mod oauth;
mod scan;
mod settings;
mod topic_id;

use std::future::Future;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use outbox_core::{Broker, Destination, EventId, LookupOutcome, OutgoingMessage, PartitionScan, ScanFrom, ScannedMessage, SendOutcome};
use rdkafka::message::Message;
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};
#[cfg(doc)]
use rdkafka::{consumer::BaseConsumer, producer::ThreadedProducer};

use delivery::Inner;
use oauth::TokenSource;
use scan::{scan_partition, scan_range, ScanRequest};
pub(crate) use scan::{last_served_past, warn_under_reported};
use topic_id::{frozen_topic_id, recreated, topic_in, TopicIdRead};

pub use error::{describe_kafka_error, redact_text, KafkaAdapterError};
pub use health::{ProducerHealth, SupervisionStep, FAILING_AFTER_MS, FAILURES_IN_A_ROW, FAILURE_REBUILD_BACKOFF_MS};
pub use oauth::{OAuthBearerToken, OAuthTokenProvider};
pub use scan::{is_log_incomplete, message_headers, LOG_INCOMPLETE};
pub use settings::{
    is_connection_setting, is_secret_setting, redact_setting, split_setting, KafkaConfig, BOOTSTRAP_ENV, DEFAULT_CONNECT_TIMEOUT_MS, DEFAULT_ENQUEUE_TIMEOUT_MS,
    DEFAULT_LOOKUP_MAX_MESSAGES, DEFAULT_LOOKUP_TIMEOUT_MS, DEFAULT_MAX_CONCURRENT_LOOKUPS, DEFAULT_MAX_IN_FLIGHT, DEFAULT_MESSAGE_TIMEOUT_MS, DEFAULT_PROBE_TIMEOUT_MS,
    DEFAULT_PRODUCER_STALL_MS, DEFAULT_REQUEST_TIMEOUT_MS,
};
pub use topic_id::{destination_topic_id, TOPIC_ID_CACHE_MS};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The Kafka side of the protocol: an idempotent producer that sends each
/// message to its frozen partition and reports its persistence status, and
/// bounded scans of a partition for an eventId.
///
/// Cheap to clone; clones share the producer and the limits.
///
/// **Supervision.** A producer that cannot deliver (a fatal error such as
/// broken idempotence, or no acknowledgement for
/// [`KafkaConfig::producer_stall_ms`] while it has messages to deliver, e.g.
/// after the cluster was replaced and answers `UnknownProducerId`) is
/// reported by [`KafkaBroker::producer_health`] and
/// [`KafkaBroker::ready`]; [`KafkaBroker::supervise_once`], called
/// periodically, rebuilds it once the cluster answers again. Sends already
/// handed to the old producer keep their delivery reports.
#[derive(Clone)]
pub struct KafkaBroker {
    shared: Arc<Shared>,
}

struct Shared {
    cluster_id: String,
    config: KafkaConfig,
    current: RwLock<Arc<Inner>>,
    rebuilding: tokio::sync::Mutex<()>,
    /// The topic ids sends to a `destination.v2` are checked against.
    topic_ids: Mutex<std::collections::HashMap<String, TopicIdRead>>,
}

impl std::fmt::Debug for KafkaBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.inner();
        f.debug_struct("KafkaBroker")
            .field("cluster_id", &inner.cluster_id)
            .field("bootstrap_servers", &inner.config.bootstrap_servers)
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
        KafkaBroker::connect_inner(config, None).await
    }

    /// [`KafkaBroker::connect`] with a source of SASL/OAUTHBEARER tokens used
    /// by the producer and the lookup consumers (see [`OAuthTokenProvider`]).
    pub async fn connect_with_token_provider(config: KafkaConfig, provider: Arc<dyn OAuthTokenProvider>) -> Result<KafkaBroker, KafkaAdapterError> {
        KafkaBroker::connect_inner(config, Some(provider)).await
    }

    async fn connect_inner(config: KafkaConfig, tokens: TokenSource) -> Result<KafkaBroker, KafkaAdapterError> {
        config.validate()?;
        let inner = tokio::task::spawn_blocking(move || {
            let in_flight = Arc::new(Semaphore::new(config.max_in_flight));
            let lookups = Arc::new(Semaphore::new(config.max_concurrent_lookups));
            Inner::build(config, in_flight, lookups, Arc::default(), tokens, None)
        })
        .await
        .map_err(|e| KafkaAdapterError::Task(e.to_string()))??;
        info!(cluster_id = %inner.cluster_id, bootstrap = %inner.config.bootstrap_servers, "kafka adapter connected");
        Ok(KafkaBroker {
            shared: Arc::new(Shared {
                cluster_id: inner.cluster_id.clone(),
                config: inner.config.clone(),
                current: RwLock::new(Arc::new(inner)),
                rebuilding: tokio::sync::Mutex::new(()),
                topic_ids: Mutex::default(),
            }),
        })
    }

    fn inner(&self) -> Arc<Inner> {
        self.shared.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The cluster id the cluster reported at connect.
    pub fn cluster_id(&self) -> &str {
        // Fixed for the adapter's life: a rebuild never changes it.
        &self.shared.cluster_id
    }

    /// The configuration in force.
    pub fn config(&self) -> &KafkaConfig {
        &self.shared.config
    }

    /// Messages handed to librdkafka and not yet reported on.
    pub fn in_flight(&self) -> usize {
        let inner = self.inner();
        inner.config.max_in_flight.saturating_sub(inner.in_flight.available_permits())
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
    ///
    /// A message to a `destination.v2` is first checked against its topic's
    /// current id (see the [module documentation](self)): refused
    /// ([`SendOutcome::NotPersisted`], nothing written) when the topic now
    /// has another id. Without a fresh read of that id at hand, the message
    /// is handed over at the first poll, once the id is read (within the
    /// enqueue wait).
    pub fn send_detached(&self, message: OutgoingMessage) -> impl Future<Output = SendOutcome> + Send + 'static {
        let frozen = frozen_topic_id(&message.headers);
        let (refused, unchecked) = match &frozen {
            None => (None, false),
            Some(f) => match self.cached_topic_id(&message.topic) {
                Some(current) => (recreated(&message.topic, current.as_deref(), f), false),
                None => (None, true),
            },
        };
        let inner = self.inner();
        let first = if refused.is_none() && !unchecked { Arc::clone(&inner.in_flight).try_acquire_owned().ok().map(|permit| inner.enqueue(&message, permit)) } else { None };
        let this = self.clone();
        async move {
            let started = tokio::time::Instant::now();
            if let Some(reason) = refused {
                warn!(topic = %message.topic, %reason, "send refused: the destination's topic was recreated");
                return SendOutcome::NotPersisted(reason);
            }
            let inner = match frozen.filter(|_| unchecked) {
                None => inner,
                Some(frozen) => {
                    let wait = Duration::from_millis(this.shared.config.enqueue_timeout_ms / 2);
                    let current = this.topic_id_for_send(&message.topic, started + wait).await;
                    if let Some(reason) = recreated(&message.topic, current.as_deref(), &frozen) {
                        warn!(topic = %message.topic, %reason, "send refused: the destination's topic was recreated");
                        return SendOutcome::NotPersisted(reason);
                    }
                    this.inner()
                }
            };
            inner.drive(message, first, started).await
        }
    }

    /// A lookup slot (waited for at most the lookup timeout) and the request
    /// of a read of `topic`/`partition` from `from_offset`, of up to
    /// `max_messages` (capped by the configuration), for any event.
    async fn read_request(&self, topic: &str, partition: i32, from_offset: i64, max_messages: u64) -> Result<(tokio::sync::OwnedSemaphorePermit, ScanRequest), String> {
        let timeout = Duration::from_millis(self.shared.config.lookup_timeout_ms);
        let permit = match tokio::time::timeout(timeout, Arc::clone(&self.inner().lookups).acquire_owned()).await {
            Ok(Ok(p)) => p,
            _ => return Err("no lookup slot".into()),
        };
        let req = ScanRequest {
            tokens: self.inner().tokens.clone(),
            cluster_id: self.shared.cluster_id.clone(),
            topic: topic.to_owned(),
            partition,
            event_id: EventId::from_parts(0, 0),
            from: ScanFrom::at(from_offset),
            max_messages: max_messages.min(self.shared.config.lookup_max_messages),
            deadline: Instant::now() + timeout,
        };
        Ok((permit, req))
    }

    /// The partition count of `topic`, from the cluster's metadata (for
    /// checking route policies against the real topic).
    pub async fn partition_count(&self, topic: &str) -> Result<u32, KafkaAdapterError> {
        let inner = self.inner();
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let timeout = Duration::from_millis(inner.config.connect_timeout_ms);
            let md = inner.producer.fetch_metadata(Some(&topic), timeout)?;
            let t = topic_in(&md, &topic)?;
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
        let inner = self.inner();
        tokio::task::spawn_blocking(move || inner.producer.flush(Duration::from_millis(timeout_ms)))
            .await
            .map_err(|e| KafkaAdapterError::Task(e.to_string()))?
            .map_err(KafkaAdapterError::from)
    }
}

#[async_trait]
impl Broker for KafkaBroker {
    /// The topic's id as last read (at most [`TOPIC_ID_CACHE_MS`] ago; a
    /// read is begun when there is none).
    fn log_id(&self, topic: &str, _partition: i32) -> Option<String> {
        self.log_id_now(topic)
    }

    fn cluster_id(&self) -> &str {
        &self.shared.cluster_id
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
        let backstop = u64::try_from(self.inner().report_backstop().as_millis()).unwrap_or(u64::MAX);
        Some(self.shared.config.enqueue_timeout_ms.saturating_add(backstop))
    }

    /// Scans `destination.topic` / `destination.partition` from
    /// `from.offset` (raised to the low watermark; from 0 when its anchor
    /// shows the bound was read from another log) to the high watermark read
    /// at the start, for messages whose `outbox-event-id` header is
    /// `event_id`. See the [module documentation](self) for what a match reports.
    async fn lookup(&self, destination: &Destination, event_id: &EventId, from: &ScanFrom) -> LookupOutcome {
        if destination.cluster_id != self.shared.cluster_id {
            return LookupOutcome::Unavailable(format!(
                "destination is on cluster {}, this adapter is connected to {}",
                destination.cluster_id, self.shared.cluster_id
            ));
        }
        let timeout = Duration::from_millis(self.shared.config.lookup_timeout_ms);
        let started = Instant::now();
        // A destination.v2 names its topic's identity: the partition's log is
        // that destination's only while the topic still has that id.
        if let Some(frozen) = &destination.topic_id {
            let current = match tokio::time::timeout(timeout, self.topic_id(&destination.topic)).await {
                Ok(Ok(id)) => {
                    // The freshest answer there is: sends check against it too.
                    self.remember_topic_id(&destination.topic, id.clone());
                    id
                }
                Ok(Err(e)) => return LookupOutcome::Unavailable(format!("reading the topic id of {}: {e}", destination.topic)),
                Err(_) => return LookupOutcome::Unavailable(format!("no topic id for {} within {} ms", destination.topic, timeout.as_millis())),
            };
            match current {
                Some(now) if &now == frozen => {}
                Some(now) => {
                    return LookupOutcome::Unavailable(format!(
                        "{LOG_INCOMPLETE}topic {} has id {now}, the destination froze id {frozen}: the topic was recreated, its log is not the destination's",
                        destination.topic
                    ))
                }
                None => {
                    return LookupOutcome::Unavailable(format!(
                        "the cluster gives no topic id for {}, the destination froze id {frozen}: cannot tell whether the topic was recreated",
                        destination.topic
                    ))
                }
            }
        }
        let permit = match tokio::time::timeout(timeout.saturating_sub(started.elapsed()), Arc::clone(&self.inner().lookups).acquire_owned()).await {
            Ok(Ok(p)) => p,
            Ok(Err(_)) => return LookupOutcome::Unavailable("kafka adapter closed".into()),
            Err(_) => return LookupOutcome::Unavailable(format!("no lookup slot within {} ms", timeout.as_millis())),
        };
        // The log's identity as known before the read: the receipts of what
        // it finds record it.
        let log_id = self.log_id_now(&destination.topic);
        let deadline = started + timeout;
        let scan = ScanRequest {
            tokens: self.inner().tokens.clone(),
            cluster_id: self.shared.cluster_id.clone(),
            topic: destination.topic.clone(),
            partition: destination.partition,
            event_id: event_id.clone(),
            from: from.clone(),
            max_messages: self.shared.config.lookup_max_messages,
            deadline,
        };
        let config = self.shared.config.clone();
        let outcome = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            scan_partition(&config, &scan)
        })
        .await;
        match outcome {
            Ok(mut o) => {
                if let LookupOutcome::Found(found) = &mut o {
                    for r in found.iter_mut() {
                        r.log_id = log_id.clone();
                    }
                }
                debug!(event_id = %event_id, topic = %destination.topic, partition = destination.partition, outcome = ?o, "kafka lookup");
                o
            }
            Err(e) => LookupOutcome::Unavailable(format!("lookup task failed: {e}")),
        }
    }

    /// Reads the eventId header of up to `max_messages` messages of
    /// `topic`/`partition` from `from_offset`, for the bypass check.
    async fn scan_event_ids(&self, topic: &str, partition: i32, from_offset: i64, max_messages: u64) -> Result<PartitionScan, String> {
        let (permit, req) = self.read_request(topic, partition, from_offset, max_messages).await?;
        let config = self.shared.config.clone();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let mut messages = Vec::new();
            let (next_offset, log_start, log_end) = scan_range(&config, &req, Some(req.max_messages), |msg| {
                let hs = message_headers(msg);
                messages.push(ScannedMessage::read(&req.cluster_id, msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.payload().unwrap_or_default(), &hs));
            })?;
            Ok(PartitionScan { messages, next_offset, log_end: Some(log_end), log_start: Some(log_start) })
        })
        .await
        .map_err(|e| format!("scan task failed: {e}"))?
    }

    /// Reads up to `max_messages` messages of `topic`/`partition` from
    /// `from_offset` as the broker serves them, past the end it reports
    /// (for the reconciler's check of receipts at or beyond that end).
    async fn read_past_reported_end(&self, topic: &str, partition: i32, from_offset: i64, max_messages: u64) -> Result<Vec<ScannedMessage>, String> {
        let (permit, mut req) = self.read_request(topic, partition, from_offset, max_messages).await?;
        // A broker serves at once what it holds past the end it reports; one
        // that holds nothing there (a replaced log) may answer nothing at
        // all, and the reconciler's round must not wait a lookup timeout per
        // partition for it.
        req.deadline = req.deadline.min(Instant::now() + Duration::from_millis(PAST_END_READ_MS));
        let config = self.shared.config.clone();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let mut messages = Vec::new();
            scan::read_past_reported_end(&config, &req, |msg| {
                let hs = message_headers(msg);
                messages.push(ScannedMessage::read(&req.cluster_id, msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.payload().unwrap_or_default(), &hs));
            })?;
            Ok(messages)
        })
        .await
        .map_err(|e| format!("read task failed: {e}"))?
    }

    async fn partition_count(&self, topic: &str) -> Result<Option<u32>, String> {
        KafkaBroker::partition_count(self, topic).await.map(Some).map_err(|e| e.to_string())
    }
}
