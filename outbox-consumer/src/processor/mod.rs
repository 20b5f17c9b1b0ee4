//! Deciding about messages against PostgreSQL, without Kafka: verification,
//! receipts, duplicates, quarantine, retries, dead letters and watermarks.
//!
//! **Invariant:** a receipt row exists if and only if the handler's writes for
//! that event committed; the claim (`INSERT .. ON CONFLICT DO NOTHING`) comes
//! before the handler in the same transaction, so two processors racing on one
//! event serialize on the receipt's primary key and only one runs the effect.
//!
//! **Invariant:** the watermark of a partition moves in the transaction that
//! decides the messages below it, never before. A partition has one
//! watermark row per topic id its messages' destinations name (a topic
//! recreated under the same name is another log): each message moves the
//! row of its own id.
//!
//! Files: this one holds the [`Processor`] and its batch loop; `decide`
//! the decision transaction and the watermarks; `retry` retries, backoff
//! and dead letters; `redrive` the redrive of a dead letter; `verify` the
//! checks before any database work; `receipts` reading and purging
//! receipts.

mod decide;
mod receipts;
mod redrive;
mod retry;
mod verify;

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use futures::FutureExt as _;
use outbox_core::headers;
use outbox_core::id::validate_identifier;
use serde_json::Value;
use sqlx::PgPool;
use tracing::{info_span, warn, Instrument as _};

use crate::config::{RetryPolicy, DEFAULT_MAX_EVIDENCE_PAYLOAD_BYTES, LIMIT_MAX_BATCH_MESSAGES};
use crate::error::{ConsumerError, HandlerError};
use crate::event::{ConsumedEvent, RawMessage};
use crate::handler::Handler;
use crate::quarantine_log::QuarantineLog;
use crate::store::{ConsumerStore, PgConsumerStore, TxHandler};
use crate::metrics::Metrics;
use crate::outcome::{Outcome, Position, Quarantined};
use crate::trust::TrustPolicy;

pub use receipts::{purge_receipts_before, receipt, LIMIT_PURGE_ROWS};
pub use verify::{verify_message, verify_message_with, Rejection};

/// Largest handler result stored in a receipt, serialized: 1 MiB.
pub const MAX_RESULT_BYTES: usize = 1024 * 1024;

/// Decides about messages of one consumer: verifies them, writes receipts
/// and runs the handler in one transaction, answers duplicates with the
/// original receipt, quarantines what does not verify, retries failing
/// handlers and dead-letters what keeps failing.
///
/// Usable without Kafka: build [`RawMessage`]s and call
/// [`process_batch`](Processor::process_batch). The Kafka runner
/// ([`IdempotentConsumer`](crate::IdempotentConsumer)) calls the same code.
///
/// The decisions are made here, once; the receipt store `S` only reads and
/// writes rows in a transaction ([`ConsumerStore`]). Production uses
/// PostgreSQL ([`PgConsumerStore`], the default); the simulator runs this
/// same processor over [`MemoryConsumerStore`](crate::memory::MemoryConsumerStore).
pub struct Processor<S: ConsumerStore = PgConsumerStore> {
    consumer_id: String,
    /// Broker cluster of the log this processor decides about; set once
    /// (by [`with_cluster_id`](Processor::with_cluster_id) or by the Kafka
    /// runner from the broker's metadata), `''` until then.
    cluster_id: std::sync::OnceLock<String>,
    store: S,
    handler: Arc<dyn TxHandler<S::Tx>>,
    retry: RetryPolicy,
    max_evidence_payload_bytes: usize,
    metrics: Arc<Metrics>,
    trust: Arc<TrustPolicy>,
    quarantine_log: QuarantineLog,
}

impl<S: ConsumerStore> std::fmt::Debug for Processor<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Processor").field("consumer_id", &self.consumer_id).field("retry", &self.retry).finish_non_exhaustive()
    }
}

/// A message after verification.
enum Prepared<'a> {
    Event { msg: &'a RawMessage, event: ConsumedEvent },
    Bad { msg: &'a RawMessage, quarantined: Quarantined, evidence: Value },
}

impl Prepared<'_> {
    fn msg(&self) -> &RawMessage {
        match self {
            Prepared::Event { msg, .. } | Prepared::Bad { msg, .. } => msg,
        }
    }

    fn event_id(&self) -> Option<&str> {
        match self {
            Prepared::Event { event, .. } => Some(event.event_id.as_str()),
            Prepared::Bad { .. } => None,
        }
    }
}

/// Why a batch transaction was rolled back without an infrastructure error.
enum Fail {
    /// The handler refused the message at this index of the slice.
    Handler { index: usize, error: HandlerError },
    /// A statement after the handlers found the transaction aborted: some
    /// handler ignored a failed query. Which one is found by going one by one.
    Aborted,
}

fn position(msg: &RawMessage) -> Position {
    Position { topic: msg.topic.clone(), partition: msg.partition, offset: msg.offset }
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

impl Processor<PgConsumerStore> {
    /// A processor for `consumer_id` (validated with
    /// [`outbox_core::id::validate_identifier`]) with the default
    /// [`RetryPolicy`], keeping its receipts in PostgreSQL.
    pub fn new(consumer_id: &str, pool: PgPool, handler: impl Handler + 'static) -> Result<Self, ConsumerError> {
        Processor::over(PgConsumerStore::new(pool), consumer_id, handler)
    }

    /// The pool receipts are written to.
    pub fn pool(&self) -> &PgPool {
        self.store.pool()
    }
}

impl<S: ConsumerStore> Processor<S> {
    /// A processor for `consumer_id` over the receipt store `store` (see
    /// [`ConsumerStore`]), with the default [`RetryPolicy`].
    pub fn over(store: S, consumer_id: &str, handler: impl TxHandler<S::Tx> + 'static) -> Result<Self, ConsumerError> {
        validate_identifier("consumerId", consumer_id).map_err(|e| ConsumerError::Config(e.to_string()))?;
        Ok(Processor {
            consumer_id: consumer_id.to_owned(),
            cluster_id: std::sync::OnceLock::new(),
            store,
            handler: Arc::new(handler),
            retry: RetryPolicy::default(),
            max_evidence_payload_bytes: DEFAULT_MAX_EVIDENCE_PAYLOAD_BYTES,
            metrics: Arc::new(Metrics::default()),
            trust: Arc::new(TrustPolicy::default()),
            quarantine_log: QuarantineLog::default(),
        })
    }

    /// Verifies every message under `trust` (validated): accepted sources
    /// per topic, signatures and verification keys.
    pub fn with_trust(mut self, trust: TrustPolicy) -> Result<Self, ConsumerError> {
        trust.validate()?;
        self.trust = Arc::new(trust);
        Ok(self)
    }

    /// The trust policy in force.
    pub fn trust(&self) -> &TrustPolicy {
        &self.trust
    }

    /// Replaces the retry policy (validated).
    pub fn with_retry(mut self, retry: RetryPolicy) -> Result<Self, ConsumerError> {
        retry.validate()?;
        self.retry = retry;
        Ok(self)
    }

    /// Largest quarantined payload stored verbatim.
    pub fn with_max_evidence_payload_bytes(mut self, bytes: usize) -> Self {
        self.max_evidence_payload_bytes = bytes;
        self
    }

    /// Counts into `metrics` instead of a private set.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// The consumer id.
    pub fn consumer_id(&self) -> &str {
        &self.consumer_id
    }

    /// Names the broker cluster whose log this processor reads (the Kafka
    /// cluster id, as the outbox's routes and receipts name it). Receipts
    /// and watermarks carry it, so retention and reconciliation match a
    /// watermark only to events of that cluster. The Kafka runner sets it
    /// from the broker; set it yourself when driving a processor without
    /// Kafka. The first value set stays.
    pub fn with_cluster_id(self, cluster_id: impl Into<String>) -> Self {
        let _ = self.cluster_id.set(cluster_id.into());
        self
    }

    /// Sets the cluster if none is set yet; answers the cluster in force.
    pub(crate) fn set_cluster_id_if_unset(&self, cluster_id: String) -> &str {
        self.cluster_id.get_or_init(|| cluster_id)
    }

    /// The broker cluster this processor reads (`''` when not set).
    pub fn cluster_id(&self) -> &str {
        self.cluster_id.get().map_or("", String::as_str)
    }

    /// The counters.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The receipt store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Decides about one message (a batch of one).
    pub async fn process_message(&self, msg: &RawMessage) -> Result<Outcome, ConsumerError> {
        let mut outs = self.process_batch(std::slice::from_ref(msg)).await?;
        outs.pop().ok_or(ConsumerError::Stopped)
    }

    /// Decides about messages of one partition, given in increasing offset
    /// order (at most [`LIMIT_MAX_BATCH_MESSAGES`]). Returns one outcome per
    /// message, in order. As many messages as possible share one transaction;
    /// a failing handler splits the batch so that the events before it commit,
    /// the failing one is retried alone with backoff (then dead-lettered), and
    /// the rest continue. On `Err`, some leading messages may have committed;
    /// processing them again yields duplicates, never second effects.
    pub async fn process_batch(&self, msgs: &[RawMessage]) -> Result<Vec<Outcome>, ConsumerError> {
        self.process_batch_until(msgs, &AtomicBool::new(false)).await
    }

    /// [`process_batch`](Self::process_batch) that gives up between
    /// transactions (and during backoff) once `stop` is set, returning the
    /// outcomes decided so far: a prefix of `msgs`.
    pub(crate) async fn process_batch_until(&self, msgs: &[RawMessage], stop: &AtomicBool) -> Result<Vec<Outcome>, ConsumerError> {
        check_batch(msgs)?;
        let (Some(first), Some(last)) = (msgs.first(), msgs.last()) else {
            return Ok(Vec::new());
        };
        let span = info_span!("outbox_consume_batch", consumer = %self.consumer_id, topic = %first.topic, partition = first.partition, first_offset = first.offset, last_offset = last.offset, messages = msgs.len());
        async move {
            let prepared: Vec<Prepared<'_>> = msgs.iter().map(|m| self.prepare(m)).collect();
            let n = prepared.len();
            let mut outcomes = Vec::with_capacity(n);
            let mut i = 0;
            let mut end = n;
            // A handler failure at absolute index j, decided alone once the
            // events before it committed.
            let mut pending: Option<(usize, HandlerError)> = None;
            let mut db_failures = 0u32;
            while i < n {
                if stop.load(Ordering::Acquire) {
                    break;
                }
                if let Some((j, error)) = pending.take() {
                    if j == i {
                        let o = self.decide_alone(&prepared[i], 1, Some(error), stop).await?;
                        outcomes.push(o);
                        i += 1;
                        end = n;
                        continue;
                    }
                    pending = Some((j, error));
                }
                match self.try_slice(&prepared[i..end]).await {
                    Ok(Ok(outs)) => {
                        db_failures = 0;
                        i = end;
                        end = n;
                        outcomes.extend(outs);
                    }
                    Ok(Err(Fail::Handler { index, error })) => {
                        db_failures = 0;
                        Metrics::add(&self.metrics.handler_failures, 1);
                        let p = &prepared[i + index];
                        warn!(consumer = %self.consumer_id, event_id = %p.event_id().unwrap_or("-"), attempt = 1, topic = %p.msg().topic,
                            partition = p.msg().partition, offset = p.msg().offset, %error, "handler failed");
                        // Commit the events before it (if any), then decide it alone.
                        end = i + index;
                        pending = Some((i + index, error));
                    }
                    Ok(Err(Fail::Aborted)) => {
                        db_failures = 0;
                        warn!("a handler ignored a failed query; deciding the batch one message at a time");
                        for p in &prepared[i..end] {
                            if stop.load(Ordering::Acquire) {
                                return Ok(outcomes);
                            }
                            outcomes.push(self.decide_alone(p, 0, None, stop).await?);
                            i += 1;
                        }
                        end = n;
                    }
                    Err(e) => {
                        if !self.back_off_after(e, &mut db_failures, stop).await? {
                            break;
                        }
                    }
                }
            }
            Ok(outcomes)
        }
        .instrument(span)
        .await
    }

    /// Verifies one message.
    fn prepare<'a>(&self, msg: &'a RawMessage) -> Prepared<'a> {
        match verify_message_with(&self.consumer_id, msg, &self.trust) {
            Ok(event) => Prepared::Event { msg, event },
            Err(Rejection { quarantined, evidence }) => Prepared::Bad { msg, quarantined, evidence },
        }
    }

    /// Runs the handler with its time limit, containing panics.
    async fn run_handler(&self, tx: &mut S::Tx, event: &ConsumedEvent) -> Result<Value, HandlerError> {
        let span = info_span!("outbox_handle", consumer = %self.consumer_id, event_id = %event.event_id, topic = %event.topic,
            partition = event.partition, offset = event.offset, event_type = %event.event_type);
        // The handler's span continues the trace that emitted the event.
        crate::otel::follow_traceparent(&span, event.header(headers::TRACEPARENT), event.header(crate::otel::TRACESTATE));
        let call = AssertUnwindSafe(self.handler.handle_in(tx, event)).catch_unwind().instrument(span);
        let at = std::time::Instant::now();
        let result = match tokio::time::timeout(Duration::from_millis(self.retry.handler_timeout_ms), call).await {
            Err(_) => Err(HandlerError::Timeout(self.retry.handler_timeout_ms)),
            Ok(Err(panic)) => Err(HandlerError::Panicked(panic_message(panic.as_ref()))),
            Ok(Ok(r)) => r,
        };
        self.metrics.histograms.handled(&self.consumer_id, &event.topic, &event.event_type, at.elapsed());
        let result = result?;
        let size = serde_json::to_vec(&result).map(|v| v.len()).unwrap_or(usize::MAX);
        if size > MAX_RESULT_BYTES {
            return Err(HandlerError::Permanent(format!("handler result is {size} bytes, the limit is {MAX_RESULT_BYTES}")));
        }
        Ok(result)
    }

    /// One transaction over a slice: claim, handle, record, commit.
    async fn try_slice(&self, slice: &[Prepared<'_>]) -> Result<Result<Vec<Outcome>, Fail>, ConsumerError> {
        let mut tx = self.store.begin().await?;
        let (outs, found) = match self.decide_in(&mut tx, slice).await? {
            Ok(v) => v,
            Err(fail) => {
                self.store.rollback(tx).await;
                return Ok(Err(fail));
            }
        };
        self.store.commit(tx).await?;
        Metrics::add(&self.metrics.transactions, 1);
        if let Some(p) = slice.first() {
            self.report_gaps(&p.msg().topic, p.msg().partition, &found);
        }
        self.metrics.count_outcomes(&outs);
        self.observe_consumed(&outs);
        self.quarantine_log.observe(&self.consumer_id, &outs);
        Ok(Ok(outs))
    }

    /// Observes commit -> consumed for the events a committed transaction applied.
    fn observe_consumed(&self, outs: &[Outcome]) {
        let now_ms = Utc::now().timestamp_millis();
        for o in outs {
            if let Outcome::Applied { receipt } = o {
                let latency_ms = now_ms - receipt.event_id.unix_ms() as i64;
                self.metrics.histograms.consumed(&self.consumer_id, &receipt.position.topic, &receipt.event_type, latency_ms);
            }
        }
    }
}

/// A batch is one partition, offsets strictly increasing, within the limit.
fn check_batch(msgs: &[RawMessage]) -> Result<(), ConsumerError> {
    if msgs.len() > LIMIT_MAX_BATCH_MESSAGES {
        return Err(ConsumerError::InvalidBatch(format!("{} messages, the limit is {LIMIT_MAX_BATCH_MESSAGES}", msgs.len())));
    }
    for w in msgs.windows(2) {
        if w[0].topic != w[1].topic || w[0].partition != w[1].partition {
            return Err(ConsumerError::InvalidBatch("messages of more than one partition".into()));
        }
        if w[0].log_id != w[1].log_id {
            return Err(ConsumerError::InvalidBatch("messages of more than one log (log_id)".into()));
        }
        if w[0].offset >= w[1].offset {
            return Err(ConsumerError::InvalidBatch(format!("offset {} follows {}", w[1].offset, w[0].offset)));
        }
    }
    if let Some(m) = msgs.iter().find(|m| m.offset < 0 || m.partition < 0) {
        return Err(ConsumerError::InvalidBatch(format!("negative position {}/{}", m.partition, m.offset)));
    }
    Ok(())
}
