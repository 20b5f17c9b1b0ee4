//! Topic ids: reading a topic's current id (DescribeTopics), the id a
//! `destination.v2` froze, and the send-time check that refuses a send to a
//! topic recreated under the same name.

use std::time::{Duration, Instant};

use outbox_core::headers;
use outbox_core::Destination;
use rdkafka::error::RDKafkaErrorCode;
use tokio::sync::watch;
use tracing::debug;

use super::delivery::AnyProducer;
use super::error::{redact_text, KafkaAdapterError};
use super::{lock, KafkaBroker};
#[cfg(doc)]
use super::settings::KafkaConfig;

/// How long a topic id read for the send-time check of a `destination.v2`
/// is used, ms (see the [module documentation](super)).
pub const TOPIC_ID_CACHE_MS: u64 = 5_000;

/// One read of a topic's current id for the send-time check: when it began,
/// and its answer once there (`Some(None)`: no id could be read: the
/// cluster gives none, or it could not be asked).
#[derive(Clone)]
pub(super) struct TopicIdRead {
    began: Instant,
    answer: watch::Receiver<Option<Option<String>>>,
}

/// The topic id a message's `outbox-destination` header (the last one)
/// freezes, when it is a `destination.v2` that parses.
pub(super) fn frozen_topic_id(hs: &[(String, Vec<u8>)]) -> Option<String> {
    let (_, bytes) = hs.iter().rev().find(|(k, _)| k == headers::DESTINATION)?;
    if !bytes.starts_with(outbox_core::envelope::DESTINATION_SCHEMA_V2.as_bytes()) {
        return None;
    }
    Destination::from_canonical(bytes).ok()?.topic_id
}

/// Why a send to `topic` with frozen topic id `frozen` is refused, when the
/// topic's current id is known to be another.
pub(super) fn recreated(topic: &str, current: Option<&str>, frozen: &str) -> Option<String> {
    match current {
        Some(now) if now != frozen => Some(format!(
            "topic {topic} has id {now}, the destination froze id {frozen}: the topic was recreated, its log is not the destination's; nothing was sent"
        )),
        _ => None,
    }
}

/// The topic id the last `outbox-destination` header names, when that
/// header parses as a destination (`None`: a `destination.v1`, or no
/// readable destination).
pub fn destination_topic_id(hs: &[(String, Vec<u8>)]) -> Option<String> {
    let (_, bytes) = hs.iter().rev().find(|(k, _)| k == headers::DESTINATION)?;
    Destination::from_canonical(bytes).ok()?.topic_id
}

/// `topic`'s entry in `md`, or why the cluster gave none usable.
pub(super) fn topic_in<'m>(md: &'m rdkafka::metadata::Metadata, topic: &str) -> Result<&'m rdkafka::metadata::MetadataTopic, KafkaAdapterError> {
    let t = md.topics().iter().find(|t| t.name() == topic).ok_or_else(|| KafkaAdapterError::Metadata(format!("topic {topic} not in metadata")))?;
    match t.error() {
        Some(e) => Err(KafkaAdapterError::Metadata(format!("topic {topic}: {}", RDKafkaErrorCode::from(e)))),
        None => Ok(t),
    }
}

impl KafkaBroker {
    /// Keeps `id`, just read, as the current id of `topic` for the sends.
    pub(super) fn remember_topic_id(&self, topic: &str, id: Option<String>) {
        let (_, answer) = watch::channel(Some(id));
        lock(&self.shared.topic_ids).insert(topic.to_owned(), TopicIdRead { began: Instant::now(), answer });
    }

    /// The current id of `topic` as read less than [`TOPIC_ID_CACHE_MS`]
    /// ago, when that read has answered (no I/O): `Some(None)` when no id
    /// could be read.
    pub(super) fn cached_topic_id(&self, topic: &str) -> Option<Option<String>> {
        let reads = lock(&self.shared.topic_ids);
        let read = reads.get(topic).filter(|r| r.began.elapsed() < Duration::from_millis(TOPIC_ID_CACHE_MS))?;
        let answer = read.answer.borrow().clone();
        answer
    }

    /// The current id of `topic` for the send-time check: the answer of a
    /// read begun less than [`TOPIC_ID_CACHE_MS`] ago, or of one begun now
    /// (one read per topic at a time, its answer kept for the others),
    /// waiting for it until `deadline`. `None`: not known (no id, no answer
    /// in time, an error: all logged at debug).
    pub(super) async fn topic_id_for_send(&self, topic: &str, deadline: tokio::time::Instant) -> Option<String> {
        let mut answer = self.topic_id_read(topic);
        let id = match tokio::time::timeout_at(deadline, answer.wait_for(Option::is_some)).await {
            Ok(Ok(id)) => id.clone().flatten(),
            _ => {
                debug!(%topic, "topic id not read within the send's wait: sent unchecked");
                None
            }
        };
        id
    }

    /// The id of `topic`'s log for a receipt, without waiting: the answer
    /// of a read begun less than [`TOPIC_ID_CACHE_MS`] ago (one is begun
    /// when there is none), `None` until it is in or when no id could be
    /// read.
    pub(super) fn log_id_now(&self, topic: &str) -> Option<String> {
        let answer = self.topic_id_read(topic);
        let id = answer.borrow().clone();
        id.flatten()
    }

    /// The read of `topic`'s current id begun less than
    /// [`TOPIC_ID_CACHE_MS`] ago, or one begun now (one read per topic at a
    /// time, its answer kept for the others).
    fn topic_id_read(&self, topic: &str) -> watch::Receiver<Option<Option<String>>> {
        {
            let mut reads = lock(&self.shared.topic_ids);
            match reads.get(topic).filter(|r| r.began.elapsed() < Duration::from_millis(TOPIC_ID_CACHE_MS)) {
                Some(r) => r.answer.clone(),
                None => {
                    let (tx, rx) = watch::channel(None);
                    reads.insert(topic.to_owned(), TopicIdRead { began: Instant::now(), answer: rx.clone() });
                    let (broker, topic) = (self.clone(), topic.to_owned());
                    tokio::spawn(async move {
                        let id = match broker.topic_id(&topic).await {
                            Ok(id) => {
                                if id.is_none() {
                                    debug!(%topic, "the cluster gives no topic id: sends to destination.v2 are not checked against it");
                                }
                                id
                            }
                            Err(e) => {
                                debug!(%topic, error = %e, "topic id not read: sends to destination.v2 go unchecked until it is");
                                None
                            }
                        };
                        let _ = tx.send(Some(id));
                    });
                    rx
                }
            }
        }
    }

    /// The topic id of `topic` as the cluster reports it now (Kafka's topic
    /// UUID, in its usual text form: URL-safe base64 without padding, 22
    /// characters), or `None` when the cluster gives no topic ids (all-zero
    /// id). A topic deleted and created again under the same name has a new
    /// id. Bounded by [`KafkaConfig::connect_timeout_ms`].
    pub async fn topic_id(&self, topic: &str) -> Result<Option<String>, KafkaAdapterError> {
        let inner = self.inner();
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let timeout = Duration::from_millis(inner.config.connect_timeout_ms);
            inner
                .producer
                .topic_id(&topic, timeout)
                .map(|id| id.map(|b| outbox_core::envelope::topic_id_text(&b)))
                .map_err(|e| KafkaAdapterError::Metadata(redact_text(&e, &inner.config.extra)))
        })
        .await
        .map_err(|e| KafkaAdapterError::Task(e.to_string()))?
    }
}

impl AnyProducer {
    /// The topic id of `topic` (Kafka's 16-byte topic UUID):
    /// [`outbox_topic_id::topic_id`] over this producer's client.
    fn topic_id(&self, topic: &str, timeout: Duration) -> Result<Option<[u8; 16]>, String> {
        match self {
            AnyProducer::Plain(p) => outbox_topic_id::topic_id(rdkafka::producer::Producer::client(p), topic, timeout),
            AnyProducer::OAuth(p) => outbox_topic_id::topic_id(rdkafka::producer::Producer::client(p), topic, timeout),
        }
    }
}
