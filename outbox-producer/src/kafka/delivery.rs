//! The producer side: the librdkafka producer (with or without a token
//! provider), its delivery reports and the persistence status they carry,
//! the enqueue into librdkafka within the in-flight bound, and the wait
//! for a report.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{OutgoingMessage, SendOutcome};
use rdkafka::client::OAuthToken;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Header, Message, OwnedHeaders};
use rdkafka::metadata::Metadata;
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::ClientContext;
use rdkafka_sys::rd_kafka_msg_status_t;
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, error, info, warn};

use super::error::{describe_kafka_error, redact_text, KafkaAdapterError};
use super::health::HealthState;
use super::lock;
use super::oauth::{oauth_token, TokenSource};
use super::settings::KafkaConfig;
#[cfg(doc)]
use super::KafkaBroker;

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

/// What the delivery callback needs: where to put the outcome, and the
/// in-flight slot to release once librdkafka has reported.
pub(super) struct Pending {
    tx: oneshot::Sender<SendOutcome>,
    permit: OwnedSemaphorePermit,
}

/// The producer context: reads the persistence status of each delivery
/// report and completes the send's channel; records fatal errors and
/// deliveries for [`KafkaBroker::producer_health`]; forwards librdkafka logs
/// to tracing; with `OAUTH`, asks the token provider for OAUTHBEARER tokens.
pub(super) struct DeliveryContext<const OAUTH: bool> {
    health: Arc<HealthState>,
    tokens: TokenSource,
}

impl<const OAUTH: bool> ClientContext for DeliveryContext<OAUTH> {
    const ENABLE_REFRESH_OAUTH_TOKEN: bool = OAUTH;

    fn log(&self, level: RDKafkaLogLevel, fac: &str, log_message: &str) {
        forward_log(level, fac, log_message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if matches!(error.rdkafka_error_code(), Some(RDKafkaErrorCode::Fatal)) {
            error!(%error, reason, "kafka producer fatal error: every further send will fail; the producer is rebuilt by its supervisor");
            *lock(&self.health.fatal) = Some(format!("{error}: {reason}"));
        } else {
            warn!(%error, reason, "kafka producer error");
        }
        // "All broker connections are down" follows the error that says why.
        let mut last = lock(&self.health.last_client_error);
        if last.is_none() || !matches!(error.rdkafka_error_code(), Some(RDKafkaErrorCode::AllBrokersDown)) {
            *last = Some(if reason.is_empty() { error.to_string() } else { reason.to_owned() });
        }
    }

    fn generate_oauth_token(&self, config: Option<&str>) -> Result<OAuthToken, Box<dyn std::error::Error>> {
        oauth_token(&self.tokens, config)
    }
}

impl<const OAUTH: bool> ProducerContext for DeliveryContext<OAUTH> {
    type DeliveryOpaque = Box<Pending>;

    fn delivery(&self, result: &DeliveryResult<'_>, pending: Box<Pending>) {
        let outcome = delivery_outcome(result);
        let Pending { tx, permit } = *pending;
        match &outcome {
            SendOutcome::Acked { partition, offset } => debug!(partition, offset, "kafka delivery acked"),
            SendOutcome::NotPersisted(reason) => warn!(reason = %reason, "kafka delivery failed, not persisted"),
            SendOutcome::Unknown(reason) => warn!(reason = %reason, "kafka delivery outcome unknown"),
        }
        self.health.note_outcome(&outcome);
        // The slot is free before anyone can observe the outcome.
        drop(permit);
        if tx.send(outcome).is_err() {
            debug!("kafka delivery report for a send whose caller is gone");
        }
    }
}

/// The producer, with or without a token provider (librdkafka's refresh
/// hook is chosen by the context's type).
pub(super) enum AnyProducer {
    Plain(ThreadedProducer<DeliveryContext<false>>),
    OAuth(ThreadedProducer<DeliveryContext<true>>),
}

type Record<'a> = BaseRecord<'a, [u8], [u8], Box<Pending>>;

impl AnyProducer {
    fn create(config: &KafkaConfig, health: &Arc<HealthState>, tokens: &TokenSource) -> Result<AnyProducer, KafkaAdapterError> {
        let cc = config.producer_config();
        let secret = |e: KafkaError| KafkaAdapterError::Client(describe_kafka_error(&e, &config.extra));
        Ok(match tokens {
            None => AnyProducer::Plain(cc.create_with_context(DeliveryContext::<false> { health: health.clone(), tokens: None }).map_err(secret)?),
            Some(_) => AnyProducer::OAuth(cc.create_with_context(DeliveryContext::<true> { health: health.clone(), tokens: tokens.clone() }).map_err(secret)?),
        })
    }

    fn send<'a>(&self, record: Record<'a>) -> Result<(), (KafkaError, Record<'a>)> {
        match self {
            AnyProducer::Plain(p) => p.send(record),
            AnyProducer::OAuth(p) => p.send(record),
        }
    }

    fn fetch_cluster_id(&self, timeout: Duration) -> Option<String> {
        match self {
            AnyProducer::Plain(p) => p.client().fetch_cluster_id(timeout),
            AnyProducer::OAuth(p) => p.client().fetch_cluster_id(timeout),
        }
    }

    pub(super) fn fetch_metadata(&self, topic: Option<&str>, timeout: Duration) -> Result<Metadata, KafkaError> {
        match self {
            AnyProducer::Plain(p) => p.client().fetch_metadata(topic, timeout),
            AnyProducer::OAuth(p) => p.client().fetch_metadata(topic, timeout),
        }
    }

    pub(super) fn native(&self) -> *mut rdkafka_sys::rd_kafka_t {
        match self {
            AnyProducer::Plain(p) => p.client().native_ptr(),
            AnyProducer::OAuth(p) => p.client().native_ptr(),
        }
    }

    /// librdkafka's fatal error of this client, if it has one
    /// (`rd_kafka_fatal_error`): every further send fails.
    #[allow(unsafe_code)]
    pub(super) fn fatal_error(&self) -> Option<String> {
        let mut buf = [0 as std::os::raw::c_char; 512];
        // SAFETY: the handle is live for the call; librdkafka writes at most
        // `buf.len()` bytes, NUL-terminated, into `buf`.
        let err = unsafe { rdkafka_sys::rd_kafka_fatal_error(self.native(), buf.as_mut_ptr(), buf.len()) };
        if RDKafkaErrorCode::from(err) == RDKafkaErrorCode::NoError {
            return None;
        }
        // SAFETY: NUL-terminated by librdkafka within `buf`.
        let text = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned();
        Some(format!("{}: {text}", RDKafkaErrorCode::from(err)))
    }

    /// A metadata request for the brokers and the topics this client
    /// already knows (not every topic of the cluster: a probe every second
    /// must stay cheap on a cluster with thousands of topics).
    #[allow(unsafe_code)]
    pub(super) fn probe(&self, timeout: Duration) -> Result<(), String> {
        let rk = self.native();
        let timeout_ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        let mut md: *const rdkafka_sys::rd_kafka_metadata = std::ptr::null();
        // SAFETY: `rk` is the live handle of the client `self` owns, for the
        // whole call; `md` is written by librdkafka and freed once below.
        let err = unsafe { rdkafka_sys::rd_kafka_metadata(rk, 0, std::ptr::null_mut(), &mut md, timeout_ms) };
        if !md.is_null() {
            // SAFETY: `md` was returned by rd_kafka_metadata and is freed exactly once.
            unsafe { rdkafka_sys::rd_kafka_metadata_destroy(md) };
        }
        match RDKafkaErrorCode::from(err) {
            RDKafkaErrorCode::NoError => Ok(()),
            code => Err(format!("metadata request: {code}")),
        }
    }

    pub(super) fn flush(&self, timeout: Duration) -> Result<(), KafkaError> {
        match self {
            AnyProducer::Plain(p) => p.flush(timeout),
            AnyProducer::OAuth(p) => p.flush(timeout),
        }
    }
}

pub(super) fn forward_log(level: RDKafkaLogLevel, fac: &str, message: &str) {
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
            rd_kafka_msg_status_t::RD_KAFKA_MSG_STATUS_POSSIBLY_PERSISTED if outbox_core::simulation::mutation_active("possibly-persisted-as-not-persisted") => {
                // The deliberate defect: a message that may be in the log is
                // reported as never written (and would be sent again).
                SendOutcome::NotPersisted(format!("{err} (possibly persisted)"))
            }
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
pub(super) enum Enqueue {
    /// Handed over: the delivery report will complete the channel.
    Queued(oneshot::Receiver<SendOutcome>),
    /// librdkafka's local queue is full: retry with the same slot.
    QueueFull(OwnedSemaphorePermit),
    /// Refused before anything left the client.
    Refused(SendOutcome),
}

pub(super) struct Inner {
    pub(super) producer: AnyProducer,
    pub(super) cluster_id: String,
    pub(super) config: KafkaConfig,
    pub(super) in_flight: Arc<Semaphore>,
    pub(super) lookups: Arc<Semaphore>,
    pub(super) health: Arc<HealthState>,
    pub(super) tokens: TokenSource,
}

impl Inner {
    /// A producer for `config`, and the cluster id it reports (which must
    /// be `expected` when given).
    pub(super) fn build(
        config: KafkaConfig,
        in_flight: Arc<Semaphore>,
        lookups: Arc<Semaphore>,
        health: Arc<HealthState>,
        tokens: TokenSource,
        expected: Option<String>,
    ) -> Result<Inner, KafkaAdapterError> {
        let producer = AnyProducer::create(&config, &health, &tokens)?;
        let timeout = Duration::from_millis(config.connect_timeout_ms);
        let cluster_id = producer.fetch_cluster_id(timeout).filter(|id| !id.is_empty()).ok_or_else(|| KafkaAdapterError::NoClusterId {
            timeout_ms: config.connect_timeout_ms,
            last_error: lock(&health.last_client_error).clone().map(|e| redact_text(&e, &config.extra)),
        })?;
        if let Some(expected) = expected.filter(|e| *e != cluster_id) {
            return Err(KafkaAdapterError::ClusterChanged { expected, found: cluster_id });
        }
        Ok(Inner { producer, cluster_id, config, in_flight, lookups, health, tokens })
    }

    pub(super) fn enqueue(&self, m: &OutgoingMessage, permit: OwnedSemaphorePermit) -> Enqueue {
        if m.partition < 0 {
            return Enqueue::Refused(SendOutcome::NotPersisted(format!("invalid partition {}", m.partition)));
        }
        let (tx, rx) = oneshot::channel();
        let mut hs = OwnedHeaders::new_with_capacity(m.headers.len());
        for (key, value) in &m.headers {
            hs = hs.insert(Header { key: key.as_str(), value: Some(value.as_slice()) });
        }
        let record: Record<'_> = BaseRecord::with_opaque_to(&m.topic, Box::new(Pending { tx, permit }))
            .partition(m.partition)
            .key(m.key.as_slice())
            .payload(m.payload.as_slice())
            .headers(hs);
        match self.producer.send(record) {
            Ok(()) => {
                self.health.note_send();
                debug!(topic = %m.topic, partition = m.partition, "kafka message enqueued");
                Enqueue::Queued(rx)
            }
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), record)) => {
                let Pending { permit, .. } = *record.delivery_opaque;
                Enqueue::QueueFull(permit)
            }
            Err((e, _record)) => {
                warn!(topic = %m.topic, partition = m.partition, error = %e, "kafka refused to enqueue");
                let outcome = SendOutcome::NotPersisted(format!("not enqueued: {e}"));
                // A refusal of the client counts as a failed delivery (an
                // authorization the cluster took away is refused here once known).
                self.health.note_outcome(&outcome);
                Enqueue::Refused(outcome)
            }
        }
    }

    /// Drives one send to its outcome, starting from an enqueue attempt made
    /// at call time if there was one; the enqueue wait counts from `started`.
    pub(super) async fn drive(self: Arc<Self>, message: OutgoingMessage, first: Option<Enqueue>, started: tokio::time::Instant) -> SendOutcome {
        let enqueue_timeout = Duration::from_millis(self.config.enqueue_timeout_ms);
        let deadline = started + enqueue_timeout;
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
    pub(super) fn report_backstop(&self) -> Duration {
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
