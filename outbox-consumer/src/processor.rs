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

use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::FutureExt as _;
use outbox_core::headers::{self, VerifyError};
use outbox_core::id::validate_identifier;
use outbox_core::{sha256_digest, EventId};
use serde_json::{json, Value};
use sqlx::{PgPool, Row as _};
use tracing::{error, info_span, warn, Instrument as _};

use crate::config::{RetryPolicy, DEFAULT_MAX_EVIDENCE_PAYLOAD_BYTES, LIMIT_MAX_BATCH_MESSAGES};
use crate::error::{ConsumerError, HandlerError};
use crate::event::{headers_from_json, headers_json, ConsumedEvent, RawMessage, MAX_EVIDENCE_HEADER_BYTES};
use crate::gap::{capped_watermark, decide_reading, OffsetGap};
use crate::handler::Handler;
use crate::quarantine_log::QuarantineLog;
use crate::store::{receipt_from_row, Claim, ConsumerStore, DeadLetterRow, PgConsumerStore, QuarantineRow, TxHandler, WatermarkAdvance, RECEIPT_COLUMNS};
use crate::metrics::Metrics;
use crate::outcome::{DeadLettered, Outcome, Position, Quarantined, QuarantineReason, Receipt};
use crate::trust::TrustPolicy;

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

/// A message to quarantine: the message, its record, the evidence, and
/// the topic id it counts under ([`topic_id_of`]).
type Quarantine<'a> = (&'a RawMessage, Quarantined, Value, Option<String>);

/// Per-transaction counts for one watermark row.
#[derive(Default)]
struct Counts {
    applied: i64,
    duplicates: i64,
    quarantined: i64,
    dead_lettered: i64,
    last_event_id: Option<String>,
    /// The last offset of a message counted here.
    last_offset: i64,
}

/// Gaps found in a transaction, reported once it committed.
type Found = Vec<OffsetGap>;

/// Per-transaction counts for the watermarks of a partition: one row per
/// topic id the decided messages name (see [`topic_id_of`]), in order of
/// first appearance. Each row moves to the last offset of a message with
/// its id, plus one.
#[derive(Default)]
struct Tally(Vec<(Option<String>, Counts)>, Vec<i64>);

impl Tally {
    /// A tally of one message.
    fn one(topic_id: Option<&str>, offset: i64, f: impl FnOnce(&mut Counts)) -> Tally {
        let mut t = Tally::default();
        f(t.of(topic_id, offset));
        t
    }

    /// The counts of `topic_id`, with `offset` noted as a message of it.
    fn of(&mut self, topic_id: Option<&str>, offset: i64) -> &mut Counts {
        self.1.push(offset);
        let i = match self.0.iter().position(|(t, _)| t.as_deref() == topic_id) {
            Some(i) => i,
            None => {
                self.0.push((topic_id.map(str::to_owned), Counts { last_offset: offset, ..Counts::default() }));
                self.0.len() - 1
            }
        };
        let c = &mut self.0[i].1;
        c.last_offset = c.last_offset.max(offset);
        c
    }
}

/// The topic id of the log a message is a position of, as far as the
/// message tells: the one its verified destination names, else the one its
/// `outbox-destination` header names when that parses (a quarantined
/// message), else none (`destination.v1`, or no readable destination).
fn topic_id_of(p: &Prepared<'_>) -> Option<String> {
    match p {
        Prepared::Event { event, .. } => event.topic_id.clone(),
        Prepared::Bad { msg, .. } => msg
            .headers
            .iter()
            .rev()
            .find(|(k, _)| k == headers::DESTINATION)
            .and_then(|(_, v)| outbox_core::Destination::from_canonical(v).ok())
            .and_then(|d| d.topic_id),
    }
}

fn position(msg: &RawMessage) -> Position {
    Position { topic: msg.topic.clone(), partition: msg.partition, offset: msg.offset }
}

/// Why verification refused a message: the quarantine record and the
/// evidence stored with it.
#[derive(Debug, Clone)]
pub struct Rejection {
    /// The quarantine record (position, eventId if readable, reason, digest).
    pub quarantined: Quarantined,
    /// Bounded evidence: the error, the headers, the key, sizes.
    pub evidence: Value,
}

/// Verifies one message against its own headers, before any database work:
/// the checks every message passes before a handler may see it. Pure and
/// total: it answers for any bytes, never panics, and bounds the evidence it
/// keeps. The [`Processor`] calls exactly this.
///
/// This accepts any source (an open [`TrustPolicy`]); the claims digest is
/// still checked where present. See [`verify_message_with`].
pub fn verify_message(consumer_id: &str, msg: &RawMessage) -> Result<ConsumedEvent, Rejection> {
    verify_message_with(consumer_id, msg, &TrustPolicy::default())
}

/// [`verify_message`] under a trust policy: after the digests and the
/// placement, the claims digest, the topic's accepted sources and its
/// signature rules ([`TrustPolicy::check`]).
pub fn verify_message_with(consumer_id: &str, msg: &RawMessage, trust: &TrustPolicy) -> Result<ConsumedEvent, Rejection> {
    let payload = msg.payload_bytes();
    let verified = match msg.non_utf8_header_names.first() {
        Some(&index) => Err(VerifyError::HeaderName { index }),
        None => headers::verify(&msg.headers, payload, &msg.topic, msg.partition, msg.key.as_deref())
            .and_then(|claims| trust.check(&msg.topic, &msg.headers).map(|t| (claims, t.source))),
    };
    match verified {
        Ok((claims, source)) => Ok(ConsumedEvent::new(consumer_id, claims, source, msg)),
        Err(e) => {
            let event_id = msg
                .headers
                .iter()
                .rev()
                .find(|(k, _)| k == headers::EVENT_ID)
                .and_then(|(_, v)| std::str::from_utf8(v).ok())
                .map(|s| s.chars().take(100).collect::<String>());
            let evidence = json!({
                "error": e.to_string(),
                "headers": headers_json(&msg.headers, MAX_EVIDENCE_HEADER_BYTES),
                "key": bytes_json(msg.key.as_deref()),
                "payloadBytes": payload.len(),
                "tombstone": msg.payload.is_none(),
            });
            let quarantined = Quarantined {
                position: position(msg),
                event_id,
                reason: QuarantineReason::Verification { code: verify_code(&e).to_owned(), detail: e.to_string() },
                payload_digest: sha256_digest(payload),
            };
            Err(Rejection { quarantined, evidence })
        }
    }
}

fn verify_code(e: &VerifyError) -> &'static str {
    match e {
        VerifyError::MissingHeader(_) => "missing_header",
        VerifyError::Malformed { .. } => "malformed_header",
        VerifyError::PayloadDigest { .. } => "payload_digest",
        VerifyError::DestinationDigest => "destination_digest",
        VerifyError::Placement(_) => "placement",
        VerifyError::HeaderName { .. } => "header_name",
        VerifyError::ClaimsDigest => "claims_digest",
        VerifyError::SourceMissing => "source_missing",
        VerifyError::SourceUnknown(_) => "source_unknown",
        VerifyError::SignatureMissing => "signature_missing",
        VerifyError::KeyUnknown(_) => "key_unknown",
        VerifyError::SignatureBad => "signature_bad",
        VerifyError::CeSourceMismatch { .. } => "ce_source_mismatch",
        _ => "other",
    }
}

fn bytes_json(b: Option<&[u8]>) -> Value {
    match b {
        None => Value::Null,
        Some(b) => match std::str::from_utf8(b) {
            Ok(s) => json!({ "utf8": s }),
            Err(_) => json!({ "hex": hex::encode(b) }),
        },
    }
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

/// The receipt of one event for one consumer, if the consumer applied it.
pub async fn receipt(pool: &PgPool, consumer_id: &str, event_id: &EventId) -> Result<Option<Receipt>, ConsumerError> {
    let sql = format!("SELECT {RECEIPT_COLUMNS} FROM outbox_consumer_receipts WHERE consumer_id = $1 AND event_id = $2");
    let row = sqlx::query(&sql).bind(consumer_id).bind(event_id.as_str()).fetch_optional(pool).await?;
    row.as_ref().map(receipt_from_row).transpose()
}

/// Most receipts [`purge_receipts_before`] deletes per call.
pub const LIMIT_PURGE_ROWS: i64 = 100_000;

/// Deletes at most `max_rows` (up to [`LIMIT_PURGE_ROWS`]) receipts of
/// `consumer_id` received before `received_before` *and* below the
/// committed watermark of their log (cluster, topic, topic id, partition),
/// oldest first; returns how many were
/// deleted. Call it in a loop until it returns less than `max_rows`.
///
/// The watermark condition is the consumer-side twin of the outbox's
/// retention rule: a receipt whose offset the watermark has not passed may
/// still see its message redelivered (the offset commit may not have
/// happened), so it is kept whatever its age.
///
/// A receipt is what makes a redelivery a duplicate: once it is gone, a
/// replay of that event would apply it again. Only purge receipts older than
/// the longest possible replay window (the topic's retention, plus any
/// re-publication from the outbox you allow), the same rule as the outbox's
/// own retention (PROTOCOL §9). Dead letters and quarantine rows are never purged
/// here.
pub async fn purge_receipts_before(pool: &PgPool, consumer_id: &str, received_before: DateTime<Utc>, max_rows: i64) -> Result<u64, ConsumerError> {
    if !(1..=LIMIT_PURGE_ROWS).contains(&max_rows) {
        return Err(ConsumerError::Config(format!("max_rows {max_rows} (1..={LIMIT_PURGE_ROWS})")));
    }
    let n = sqlx::query(
        "DELETE FROM outbox_consumer_receipts WHERE consumer_id = $1 AND event_id IN (
             SELECT r.event_id FROM outbox_consumer_receipts r
             WHERE r.consumer_id = $1 AND r.received_at < $2
               AND EXISTS (SELECT 1 FROM outbox_consumer_watermarks w
                           WHERE w.consumer_id = r.consumer_id AND w.cluster_id = r.cluster_id AND w.topic = r.topic AND w.partition = r.partition
                             AND w.topic_id IS NOT DISTINCT FROM r.topic_id AND w.committed_offset > r.\"offset\")
             ORDER BY r.received_at LIMIT $3)",
    )
    .bind(consumer_id)
    .bind(received_before)
    .bind(max_rows)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(n)
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

    /// The body of a decision transaction, without begin and commit.
    async fn decide_in(&self, tx: &mut S::Tx, slice: &[Prepared<'_>]) -> Result<Result<(Vec<Outcome>, Found), Fail>, ConsumerError> {
        let Some(last) = slice.last() else {
            return Ok(Ok((Vec::new(), Vec::new())));
        };
        let last_msg = last.msg();
        // First occurrence of each eventId in the slice: the one that may be claimed.
        let mut seen = HashSet::new();
        let firsts: Vec<&ConsumedEvent> = slice
            .iter()
            .filter_map(|p| match p {
                Prepared::Event { event, .. } if seen.insert(event.event_id.as_str()) => Some(event),
                _ => None,
            })
            .collect();
        let mut claims = if outbox_core::simulation::mutation_active("consumer-skips-receipt") {
            // The deliberate defect: the handler runs without the
            // `(consumerId, eventId)` receipt being claimed (or written).
            firsts.iter().map(|e| (e.event_id.as_str().to_owned(), Claim::New(Utc::now()))).collect()
        } else {
            self.store.claim(tx, &self.consumer_id, self.cluster_id(), &firsts).await?
        };
        let earlier: Vec<&str> = firsts.iter().map(|e| e.event_id.as_str()).filter(|id| !claims.contains_key(*id)).collect();
        let mut receipts = self.store.receipts(tx, &self.consumer_id, &earlier).await?;
        if outbox_core::simulation::mutation_active("redelivery-reapplied") {
            // The deliberate defect: a redelivery is applied again instead
            // of being answered with its receipt.
            for id in receipts.keys() {
                claims.insert(id.clone(), Claim::New(Utc::now()));
            }
            receipts.clear();
        }
        let mut dead_ids: Vec<&str> = claims.iter().filter(|(_, c)| matches!(c, Claim::Dead)).map(|(id, _)| id.as_str()).collect();
        dead_ids.sort_unstable();
        let dead = self.store.dead_letters(tx, &self.consumer_id, &dead_ids).await?;

        let mut outs = Vec::with_capacity(slice.len());
        let mut tally = Tally::default();
        let mut results: Vec<(String, Value)> = Vec::new();
        let mut quarantine: Vec<Quarantine<'_>> = Vec::new();
        for (index, p) in slice.iter().enumerate() {
            let topic_id = topic_id_of(p);
            // Every message decided moves the watermark of its topic id.
            let counts = tally.of(topic_id.as_deref(), p.msg().offset);
            let (msg, event) = match p {
                Prepared::Bad { msg, quarantined, evidence } => {
                    quarantine.push((msg, quarantined.clone(), evidence.clone(), topic_id));
                    outs.push(Outcome::Quarantined(quarantined.clone()));
                    continue;
                }
                Prepared::Event { msg, event } => (*msg, event),
            };
            let id = event.event_id.as_str();
            if let Some(original) = receipts.get(id) {
                if original.payload_digest == event.payload_digest {
                    counts.duplicates += 1;
                    outs.push(Outcome::Duplicate { original: original.clone(), delivery: position(msg) });
                } else {
                    let q = Quarantined {
                        position: position(msg),
                        event_id: Some(id.to_owned()),
                        reason: QuarantineReason::DivergentDuplicate { receipt_digest: original.payload_digest.clone(), message_digest: event.payload_digest.clone() },
                        payload_digest: event.payload_digest.clone(),
                    };
                    let evidence = json!({
                        "error": "eventId already applied with other payload bytes",
                        "receipt": original,
                        "headers": headers_json(&msg.headers, MAX_EVIDENCE_HEADER_BYTES),
                        "key": bytes_json(msg.key.as_deref()),
                        "payloadBytes": event.payload.len(),
                    });
                    quarantine.push((msg, q.clone(), evidence, topic_id));
                    outs.push(Outcome::Quarantined(q));
                }
                continue;
            }
            match claims.get(id) {
                Some(Claim::Dead) => {
                    counts.duplicates += 1;
                    let (attempts, error) = dead.get(id).cloned().unwrap_or((0, String::new()));
                    outs.push(Outcome::DeadLettered(DeadLettered { event_id: event.event_id.clone(), position: position(msg), attempts, error, redelivery: true }));
                }
                Some(Claim::New(received_at)) => match self.run_handler(tx, event).await {
                    Ok(result) => {
                        let receipt = Receipt {
                            consumer_id: self.consumer_id.clone(),
                            event_id: event.event_id.clone(),
                            envelope_generation: event.envelope_generation,
                            event_type: event.event_type.clone(),
                            position: position(msg),
                            topic_id: event.topic_id.clone(),
                            payload_digest: event.payload_digest.clone(),
                            result: result.clone(),
                            received_at: *received_at,
                        };
                        results.push((id.to_owned(), result));
                        counts.applied += 1;
                        counts.last_event_id = Some(id.to_owned());
                        receipts.insert(id.to_owned(), receipt.clone());
                        outs.push(Outcome::Applied { receipt });
                    }
                    Err(error) => return Ok(Err(Fail::Handler { index, error })),
                },
                None => {
                    // Neither claimed, nor dead, nor an earlier receipt: the
                    // receipt was removed between the claim and the read.
                    return Err(ConsumerError::CorruptRow(format!("receipt of {id} vanished during the batch")));
                }
            }
        }
        match self.record(tx, last_msg, &results, &quarantine, tally).await {
            Ok(found) => Ok(Ok((outs, found))),
            Err(e) if e.is_aborted_transaction() && !results.is_empty() => Ok(Err(Fail::Aborted)),
            Err(e) => Err(e),
        }
    }

    /// Stores handler results, quarantine rows and the watermark.
    async fn record(&self, tx: &mut S::Tx, last: &RawMessage, results: &[(String, Value)], quarantine: &[Quarantine<'_>], mut tally: Tally) -> Result<Found, ConsumerError> {
        self.store.store_results(tx, &self.consumer_id, results).await?;
        if !quarantine.is_empty() {
            let rows: Vec<QuarantineRow<'_>> = quarantine
                .iter()
                .map(|(msg, q, e, _)| {
                    let mut evidence = e.clone();
                    evidence["reason"] = serde_json::to_value(&q.reason).unwrap_or(Value::Null);
                    QuarantineRow { msg, quarantined: q.clone(), evidence }
                })
                .collect();
            let inserted = self.store.quarantine(tx, &self.consumer_id, &rows, self.max_evidence_payload_bytes).await?;
            for (m, _, _, topic_id) in quarantine {
                let c = tally.of(topic_id.as_deref(), m.offset);
                if inserted.contains(&m.offset) {
                    c.quarantined += 1;
                } else {
                    // A quarantined position seen again is a redelivery.
                    c.duplicates += 1;
                }
            }
        }
        self.advance_watermarks(tx, last, &tally).await
    }

    /// Moves the partition's watermark rows, one per topic id in `tally`:
    /// each to the last offset of a message of its id, plus one (never
    /// back), adding its counts, but never past the start of a gap in what
    /// this consumer read (module [`gap`](crate::gap)): answers the gaps this
    /// transaction found.
    async fn advance_watermarks(&self, tx: &mut S::Tx, at: &RawMessage, tally: &Tally) -> Result<Found, ConsumerError> {
        let (cluster, topic, partition) = (self.cluster_id(), &at.topic, at.partition);
        let before = self.store.reading(tx, &self.consumer_id, cluster, topic, partition).await?;
        let mut change = decide_reading(&before, &tally.1);
        if outbox_core::simulation::mutation_active("watermark-passes-gaps") {
            // The deliberate defect: the watermark moves to the last offset
            // decided plus one, past a range this consumer never read.
            change.watermark_cap = None;
        }
        if before.next_offset != Some(change.next_offset) || !change.opened.is_empty() || !change.shrunk.is_empty() {
            self.store.save_reading(tx, &self.consumer_id, cluster, topic, partition, &change).await?;
        }
        let rows: Vec<WatermarkAdvance> = tally
            .0
            .iter()
            .map(|(topic_id, c)| WatermarkAdvance {
                topic_id: topic_id.clone(),
                committed_offset: capped_watermark(c.last_offset.saturating_add(1), change.watermark_cap),
                applied: c.applied,
                duplicates: c.duplicates,
                quarantined: c.quarantined,
                dead_lettered: c.dead_lettered,
                last_event_id: c.last_event_id.clone(),
            })
            .collect();
        self.store.advance_watermarks(tx, &self.consumer_id, cluster, topic, partition, &rows).await?;
        Ok(change.opened)
    }

    /// Says, once the transaction that found them committed, which ranges of
    /// a partition this consumer skipped: an error line each and the
    /// `offset_gaps` counters.
    fn report_gaps(&self, topic: &str, partition: i32, found: &[OffsetGap]) {
        for g in found {
            Metrics::add(&self.metrics.offset_gaps, 1);
            Metrics::add(&self.metrics.offset_gap_offsets, g.len().max(0) as u64);
            error!(consumer = %self.consumer_id, cluster = %self.cluster_id(), topic, partition, from_offset = g.from_offset, to_offset = g.to_offset,
                "offsets skipped: this consumer never read [from_offset, to_offset) of the partition (the group was reset, its offset fell out of range, or it started past the log's start); its watermark stays at from_offset until the range is replayed or the gap accepted (docs/OPERATIONS.md, \"A consumer gap\")");
        }
    }

    /// After a database error: the error back when it is not retryable or
    /// the retries are used up; otherwise counts the retry, backs off and
    /// answers whether to go on (`false`: stopped while waiting).
    async fn back_off_after(&self, e: ConsumerError, failures: &mut u32, stop: &AtomicBool) -> Result<bool, ConsumerError> {
        *failures += 1;
        if !e.is_retryable() || *failures >= self.retry.db_max_attempts {
            return Err(e);
        }
        Metrics::add(&self.metrics.db_retries, 1);
        warn!(error = %e, attempt = *failures, "retrying after a database error");
        Ok(self.sleep_unless_stopped(self.retry.backoff(*failures), stop).await)
    }

    /// Sleeps, waking early (returning `false`) when `stop` is set.
    async fn sleep_unless_stopped(&self, d: Duration, stop: &AtomicBool) -> bool {
        let step = Duration::from_millis(50);
        let mut left = d;
        while !left.is_zero() {
            if stop.load(Ordering::Acquire) {
                return false;
            }
            let s = left.min(step);
            tokio::time::sleep(s).await;
            left = left.saturating_sub(s);
        }
        !stop.load(Ordering::Acquire)
    }

    /// Decides one message in its own transactions: retries the handler with
    /// backoff, then dead-letters. `attempts` handler runs already failed
    /// (`last` is the latest error).
    async fn decide_alone(&self, p: &Prepared<'_>, mut attempts: u32, mut last: Option<HandlerError>, stop: &AtomicBool) -> Result<Outcome, ConsumerError> {
        let mut db_failures = 0u32;
        loop {
            if let Some(error) = &last {
                if !error.is_retryable() || attempts >= self.retry.max_attempts {
                    return self.dead_letter(p, attempts.max(1), error, stop).await;
                }
                if !self.sleep_unless_stopped(self.retry.backoff(attempts), stop).await {
                    return Err(ConsumerError::Stopped);
                }
            }
            match self.try_slice(std::slice::from_ref(p)).await {
                Ok(Ok(mut outs)) => return outs.pop().ok_or(ConsumerError::Stopped),
                Ok(Err(fail)) => {
                    attempts += 1;
                    Metrics::add(&self.metrics.handler_failures, 1);
                    let error = match fail {
                        Fail::Handler { error, .. } => error,
                        Fail::Aborted => HandlerError::Transient("the handler ignored a failed query and left the transaction aborted".into()),
                    };
                    warn!(consumer = %self.consumer_id, event_id = %p.event_id().unwrap_or("-"), attempt = attempts, topic = %p.msg().topic,
                        partition = p.msg().partition, offset = p.msg().offset, %error, "handler failed");
                    last = Some(error);
                }
                Err(e) => {
                    if !self.back_off_after(e, &mut db_failures, stop).await? {
                        return Err(ConsumerError::Stopped);
                    }
                }
            }
        }
    }

    /// Writes the dead letter of a verified event whose handler kept failing.
    async fn dead_letter(&self, p: &Prepared<'_>, attempts: u32, error: &HandlerError, stop: &AtomicBool) -> Result<Outcome, ConsumerError> {
        let Prepared::Event { msg, event } = p else {
            return Err(ConsumerError::InvalidBatch("only verified events are dead-lettered".into()));
        };
        let mut db_failures = 0u32;
        loop {
            match self.try_dead_letter(msg, event, attempts, error).await {
                Ok(o) => {
                    self.metrics.count_outcomes(std::slice::from_ref(&o));
                    return Ok(o);
                }
                Err(e) => {
                    if !self.back_off_after(e, &mut db_failures, stop).await? {
                        return Err(ConsumerError::Stopped);
                    }
                }
            }
        }
    }

    async fn try_dead_letter(&self, msg: &RawMessage, event: &ConsumedEvent, attempts: u32, error: &HandlerError) -> Result<Outcome, ConsumerError> {
        let mut tx = self.store.begin().await?;
        // Another instance may have applied it in the meantime.
        let mut found = self.store.receipts(&mut tx, &self.consumer_id, &[event.event_id.as_str()]).await?;
        if let Some(original) = found.remove(event.event_id.as_str()) {
            let tally = Tally::one(event.topic_id.as_deref(), msg.offset, |c| c.duplicates = 1);
            let found = self.advance_watermarks(&mut tx, msg, &tally).await?;
            self.store.commit(tx).await?;
            Metrics::add(&self.metrics.transactions, 1);
            self.report_gaps(&msg.topic, msg.partition, &found);
            return Ok(Outcome::Duplicate { original, delivery: position(msg) });
        }
        let text: String = error.to_string().chars().take(4000).collect();
        let inserted = self.store.insert_dead_letter(&mut tx, &self.consumer_id, &DeadLetterRow { msg, event, attempts, error: &text }).await?;
        let redelivery = !inserted;
        let tally = Tally::one(event.topic_id.as_deref(), msg.offset, |c| if redelivery { c.duplicates = 1 } else { c.dead_lettered = 1 });
        let found = self.advance_watermarks(&mut tx, msg, &tally).await?;
        self.store.commit(tx).await?;
        Metrics::add(&self.metrics.transactions, 1);
        self.report_gaps(&msg.topic, msg.partition, &found);
        warn!(event_id = %event.event_id, offset = msg.offset, attempts, error = %text, "event dead-lettered");
        Ok(Outcome::DeadLettered(DeadLettered { event_id: event.event_id.clone(), position: position(msg), attempts, error: text, redelivery }))
    }
}

impl Processor<PgConsumerStore> {
    /// Runs the handler once more for a dead-lettered event (after the cause
    /// was fixed). In one transaction the dead letter is removed and the event
    /// is applied with its receipt; if the handler fails again, nothing changes
    /// but the dead letter's `attempts` and `last_error`. Returns `None` when
    /// there is no such dead letter.
    pub async fn redrive_dead_letter(&self, event_id: &EventId) -> Result<Option<Outcome>, ConsumerError> {
        let mut tx = self.pool().begin().await?;
        let row = sqlx::query(
            r#"DELETE FROM outbox_consumer_dead_letters WHERE consumer_id = $1 AND event_id = $2
               RETURNING topic, partition, "offset", message_key, payload, headers"#,
        )
        .bind(&self.consumer_id)
        .bind(event_id.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let headers_value: Value = row.try_get("headers")?;
        let msg = RawMessage {
            topic: row.try_get("topic")?,
            partition: row.try_get("partition")?,
            offset: row.try_get("offset")?,
            key: row.try_get("message_key")?,
            payload: Some(row.try_get("payload")?),
            headers: headers_from_json(&headers_value).ok_or_else(|| ConsumerError::CorruptRow(format!("dead letter headers of {event_id}")))?,
            non_utf8_header_names: Vec::new(),
        };
        let p = self.prepare(&msg);
        if let Prepared::Bad { quarantined, .. } = &p {
            return Err(ConsumerError::CorruptRow(format!("dead letter {event_id} no longer verifies: {:?}", quarantined.reason)));
        }
        match self.decide_in(&mut tx, std::slice::from_ref(&p)).await? {
            Ok((mut outs, found)) => {
                tx.commit().await?;
                Metrics::add(&self.metrics.transactions, 1);
                self.report_gaps(&msg.topic, msg.partition, &found);
                self.metrics.count_outcomes(&outs);
                Ok(outs.pop())
            }
            Err(fail) => {
                let _ = tx.rollback().await;
                Metrics::add(&self.metrics.handler_failures, 1);
                let error = match fail {
                    Fail::Handler { error, .. } => error.to_string(),
                    Fail::Aborted => "the handler ignored a failed query and left the transaction aborted".to_owned(),
                };
                let error: String = error.chars().take(4000).collect();
                let attempts: i32 = sqlx::query_scalar(
                    "UPDATE outbox_consumer_dead_letters SET attempts = attempts + 1, last_error = $3,
                         requeue_requested_at_ms = NULL, requeue_requested_by = NULL
                     WHERE consumer_id = $1 AND event_id = $2 RETURNING attempts",
                )
                .bind(&self.consumer_id)
                .bind(event_id.as_str())
                .bind(&error)
                .fetch_one(self.pool())
                .await?;
                warn!(consumer = %self.consumer_id, event_id = %event_id, attempt = attempts, error = %error, "handler failed on redrive; the event stays dead-lettered");
                Ok(Some(Outcome::DeadLettered(DeadLettered {
                    event_id: event_id.clone(),
                    position: position(&msg),
                    attempts: u32::try_from(attempts).unwrap_or(0),
                    error,
                    redelivery: true,
                })))
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
        if w[0].offset >= w[1].offset {
            return Err(ConsumerError::InvalidBatch(format!("offset {} follows {}", w[1].offset, w[0].offset)));
        }
    }
    if let Some(m) = msgs.iter().find(|m| m.offset < 0 || m.partition < 0) {
        return Err(ConsumerError::InvalidBatch(format!("negative position {}/{}", m.partition, m.offset)));
    }
    Ok(())
}
