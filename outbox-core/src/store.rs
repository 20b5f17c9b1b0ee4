//! The store and broker traits. The PostgreSQL store, the in-memory store
//! (`outbox-memory`) and the simulator implement them over the same
//! decisions of this crate.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::claim::ClaimToken;
use crate::envelope::{Destination, Envelope};
use crate::error::CoreError;
use crate::id::{AttemptId, EventId};
use crate::receipt::{AttemptRecord, BrokerReceipt, LockedEvent, ReceiptDecision};
use crate::reconcile::ReconcileDecision;
use crate::state::EventState;

pub use crate::log::{BypassCursor, LookupOutcome, OutgoingMessage, PartitionScan, ScannedMessage, SendOutcome};

/// Errors of a store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A protocol rule refused the call (fenced, lease expired, illegal transition...).
    #[error(transparent)]
    Core(#[from] CoreError),
    /// The event does not exist.
    #[error("no event {0}")]
    NotFound(EventId),
    /// The backend failed (connection, serialization failure...).
    #[error("store backend: {message}")]
    Backend {
        /// What failed.
        message: String,
        /// Whether the same call may succeed if retried.
        retryable: bool,
    },
}

impl StoreError {
    /// Whether retrying the call can succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            StoreError::Core(e) => e.is_retryable(),
            StoreError::NotFound(_) => false,
            StoreError::Backend { retryable, .. } => *retryable,
        }
    }

    /// Whether the caller lost its claim.
    pub fn is_fenced(&self) -> bool {
        matches!(self, StoreError::Core(CoreError::Fenced { .. } | CoreError::LeaseExpired { .. }))
    }
}

/// An event a dispatcher now holds a claim on, with everything it needs to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedEvent {
    /// The fenced claim.
    pub token: ClaimToken,
    /// The frozen envelope.
    pub envelope: Envelope,
    /// The frozen destination.
    pub destination: Destination,
    /// Its stored digest.
    pub destination_digest: String,
    /// The stored payload bytes.
    pub payload: Vec<u8>,
    /// The event row's own payload digest, frozen at commit and immutable
    /// (the one `acceptDispatchReceipt` compares with): the bytes, the
    /// envelope's `payloadDigest` and this must all agree before a send.
    pub event_payload_digest: String,
    /// The state the claim was granted from (PENDING, or RETRY_CLAIMED for a reconciler's retry).
    pub claimed_from: EventState,
    /// W3C trace context recorded at emit, if any.
    pub traceparent: Option<String>,
    /// The CloudEvents attributes of the route generation frozen in the
    /// destination; `None` when that route sends no CloudEvents headers.
    pub cloudevents: Option<crate::headers::CloudEventsBinding>,
    /// W3C `tracestate` recorded at emit with the `traceparent`, if any.
    pub tracestate: Option<String>,
    /// The outbox's source identity, written in `outbox-source` on every
    /// message (whatever the route's CloudEvents switch); `None` when the
    /// store has none (the in-memory store).
    pub source: Option<String>,
}

impl ClaimedEvent {
    /// Checks, before a send, that the stored bytes, the envelope's
    /// `payloadDigest`, the event row's immutable payload digest, and the
    /// destination and its stored digest all agree. `Err` carries the
    /// evidence: such an event is quarantined, never sent.
    pub fn verify_before_send(&self) -> Result<(), serde_json::Value> {
        let bytes = crate::canonical::sha256_digest(&self.payload);
        let destination = self.destination.digest();
        if bytes == self.envelope.payload_digest && self.envelope.payload_digest == self.event_payload_digest && destination == self.destination_digest {
            return Ok(());
        }
        Err(serde_json::json!({
            "storedPayloadDigest": bytes, "envelopePayloadDigest": self.envelope.payload_digest, "eventPayloadDigest": self.event_payload_digest,
            "frozenDestinationDigest": self.destination_digest, "storedDestinationDigest": destination,
        }))
    }
}

/// The answer of a fenced write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FenceOutcome {
    /// The write was applied.
    Applied,
    /// The writer's claim is no longer current: nothing changed, an audit record was written.
    Fenced,
    /// Nothing to do (e.g. the receipt already published the event).
    NoOp,
}

/// The answer of `acceptDispatchReceipt`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReceiptOutcome {
    /// What the decision was.
    pub decision: ReceiptDecision,
    /// The receipt in the publish slot after the transaction, if any.
    pub primary: Option<BrokerReceipt>,
    /// The event's state after the transaction.
    pub state: EventState,
}

/// What a lease sweep changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SweepOutcome {
    /// CLAIMED rows whose lease ran out unsent: back to PENDING.
    pub released: u64,
    /// SENDING rows whose lease ran out: DISPATCH_UNKNOWN, attempt UNKNOWN.
    pub unknown: u64,
    /// RETRY_CLAIMED rows whose lease ran out unsent: back to DISPATCH_UNKNOWN.
    pub retry_expired: u64,
}

/// The storage side of the protocol. Every method is one transaction.
#[async_trait]
pub trait OutboxStore: Send + Sync {
    /// Claims up to `limit` eligible events (PENDING, and RETRY_CLAIMED retries
    /// are handled by [`OutboxStore::claim_retries`]) with a CAS that bumps the
    /// claim generation. With per-key ordering, an event is eligible only when
    /// every earlier event of its destination and key is published.
    async fn claim_batch(&self, owner: &str, limit: usize, lease_ms: i64) -> Result<Vec<ClaimedEvent>, StoreError>;

    /// Takes over RETRY_CLAIMED events for sending (same frozen destination).
    async fn claim_retries(&self, owner: &str, limit: usize, lease_ms: i64) -> Result<Vec<ClaimedEvent>, StoreError>;

    /// Registers an attempt in SENDING under a live claim: CLAIMED or
    /// RETRY_CLAIMED -> SENDING. Fenced on generation and lease.
    async fn register_attempt(&self, token: &ClaimToken) -> Result<AttemptRecord, StoreError>;

    /// The single acceptance point (PROTOCOL §5).
    async fn accept_dispatch_receipt(&self, receipt: &BrokerReceipt) -> Result<ReceiptOutcome, StoreError>;

    /// Registers attempts for many claims; the answer is per token, in order.
    /// Stores may do this in one transaction; each token is fenced on its own.
    async fn register_attempts(&self, tokens: &[ClaimToken]) -> Result<Vec<Result<AttemptRecord, StoreError>>, StoreError> {
        let mut out = Vec::with_capacity(tokens.len());
        for t in tokens {
            match self.register_attempt(t).await {
                Err(e) if !e.is_fenced() && !matches!(e, StoreError::Core(_)) => return Err(e),
                r => out.push(r),
            }
        }
        Ok(out)
    }

    /// `acceptDispatchReceipt` for many receipts; stores may batch them in
    /// one transaction, each still decided by the same rule.
    async fn accept_dispatch_receipts(&self, receipts: &[BrokerReceipt]) -> Result<Vec<ReceiptOutcome>, StoreError> {
        let mut out = Vec::with_capacity(receipts.len());
        for r in receipts {
            out.push(self.accept_dispatch_receipt(r).await?);
        }
        Ok(out)
    }

    /// The send's outcome is unknown: attempt UNKNOWN, event DISPATCH_UNKNOWN.
    async fn report_unknown(&self, token: &ClaimToken, attempt_id: &AttemptId, detail: &str) -> Result<FenceOutcome, StoreError>;

    /// The broker definitely did not persist: attempt NOT_SENT, event PENDING
    /// again (same frozen destination) — or DISPATCH_UNKNOWN when an earlier
    /// attempt may still be in the log (after a blind retry), so that its late
    /// ACK still converges.
    async fn report_not_sent(&self, token: &ClaimToken, attempt_id: &AttemptId, detail: &str) -> Result<FenceOutcome, StoreError>;

    /// Gives back a claim that sent nothing: CLAIMED -> PENDING.
    async fn release(&self, token: &ClaimToken) -> Result<FenceOutcome, StoreError>;

    /// The stored payload or destination no longer matches its digest: quarantine, never send.
    async fn quarantine_claimed(&self, token: &ClaimToken, reason: &str, evidence: serde_json::Value) -> Result<FenceOutcome, StoreError>;

    /// Extends a live claim's lease. Returns the new lease end, or `Fenced`.
    async fn renew_lease(&self, token: &ClaimToken, lease_ms: i64) -> Result<Option<i64>, StoreError>;

    /// Applies lease expiry to every row whose lease ran out, bumping the
    /// claim generation so the old holder is fenced.
    async fn expire_leases(&self) -> Result<SweepOutcome, StoreError>;

    /// Takes up to `limit` DISPATCH_UNKNOWN events whose next check is due:
    /// a fenced CAS to RECONCILING that bumps the claim generation.
    async fn begin_reconcile(&self, owner: &str, limit: usize, lease_ms: i64) -> Result<Vec<ReconcileTask>, StoreError>;

    /// Applies a reconciler's `Retry` or `Recheck` (fenced on its claim). A
    /// `Submit` goes through [`OutboxStore::accept_dispatch_receipt`] first;
    /// if the event is still RECONCILING afterwards, finish with `Recheck`.
    async fn finish_reconcile(&self, token: &ClaimToken, decision: &ReconcileDecision) -> Result<FenceOutcome, StoreError>;

    /// All attempts of an event, oldest first.
    async fn attempts(&self, event_id: &EventId) -> Result<Vec<AttemptRecord>, StoreError>;

    /// Current state and publish slot of an event.
    async fn event_state(&self, event_id: &EventId) -> Result<(EventState, Option<BrokerReceipt>), StoreError>;
}

/// One RECONCILING event handed to a reconciler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReconcileTask {
    /// The reconciler's fenced claim.
    pub token: ClaimToken,
    /// The locked view of the event.
    pub event: LockedEvent,
    /// Its attempts, oldest first.
    pub attempts: Vec<AttemptRecord>,
    /// Since when the event has been DISPATCH_UNKNOWN, ms.
    pub unknown_since_ms: i64,
}

/// The broker side of the protocol.
#[async_trait]
pub trait Broker: Send + Sync {
    /// The cluster identity this adapter is connected to.
    fn cluster_id(&self) -> &str;

    /// Sends one message and waits for its outcome.
    async fn send(&self, message: OutgoingMessage) -> SendOutcome;

    /// The identity of `topic`'s log (its partition `partition`) as this
    /// client knows it now, without I/O: the topic's id as last read
    /// (`None`: not known). Read just before a send (or a lookup's read),
    /// it is recorded in the receipt ([`crate::BrokerReceipt::log_id`]):
    /// it may lag a replacement of the log, but never names one that did
    /// not exist before the message was written.
    fn log_id(&self, _topic: &str, _partition: i32) -> Option<String> {
        None
    }

    /// Whether [`Broker::lookup`] can answer at all.
    fn supports_lookup(&self) -> bool;

    /// The longest a message of a send may stay in flight (and so still land
    /// in the log) after the send began, if the adapter knows. A reconciler's
    /// [`crate::RetryPolicy::in_flight_bound_ms`] must not be shorter, or an
    /// absence proof could miss a message that is still on its way.
    fn max_in_flight_ms(&self) -> Option<u64> {
        None
    }

    /// Scans `destination`'s partition from `from.offset` to the high
    /// watermark for messages carrying `event_id`. An adapter that can read
    /// the log checks `from.anchor` first ([`crate::plan_absence_scan`]): a
    /// bound read from another log (the cluster replaced, the topic
    /// recreated) must not hide this log's messages below it.
    async fn lookup(&self, destination: &Destination, event_id: &EventId, from: &crate::ScanFrom) -> LookupOutcome;

    /// Reads the eventIds of up to `max_messages` messages of a partition
    /// from `from_offset` (for the reconciler's bypass check). Adapters that
    /// cannot read the log answer `Err`.
    async fn scan_event_ids(&self, topic: &str, partition: i32, from_offset: i64, max_messages: u64) -> Result<PartitionScan, String> {
        let _ = (topic, partition, from_offset, max_messages);
        Err("this broker adapter cannot read the log".into())
    }

    /// Reads up to `max_messages` messages of a partition from `from_offset`
    /// as the broker serves them, **not** stopping at the end (high
    /// watermark) it reports; stops where it serves nothing more. For the
    /// reconciler's check of receipts at or beyond that end
    /// (`outbox_core::compare::served_past_reported_end`): a broker that
    /// reports its end below records it still serves (tansu 0.6 after a
    /// multi-record produce batch) has not lost them. Adapters that cannot
    /// read the log answer `Err` (such receipts stay `receipt_position_lost`).
    async fn read_past_reported_end(&self, topic: &str, partition: i32, from_offset: i64, max_messages: u64) -> Result<Vec<ScannedMessage>, String> {
        let _ = (topic, partition, from_offset, max_messages);
        Err("this broker adapter cannot read the log".into())
    }

    /// The partition count the cluster reports for `topic` now (`Ok(None)`:
    /// this adapter cannot tell). The reconciler compares it with what the
    /// topic's routes froze.
    async fn partition_count(&self, topic: &str) -> Result<Option<u32>, String> {
        let _ = topic;
        Ok(None)
    }
}

/// A finding of one page of the bypass scan, with the message it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanFinding {
    /// Its kind (`crate::compare`'s constants).
    pub kind: &'static str,
    /// The event it names (or a label for a message without an eventId).
    pub event_id: String,
    /// In words.
    pub detail: String,
    /// The offset of the message it is about (`None`: a receipt's position, beyond the log's end).
    pub offset: Option<i64>,
    /// The attempt id that message carries, if any.
    pub attempt_id: Option<String>,
}

/// What one page of the bypass scan writes, in one transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BypassScanWrite {
    /// Broker cluster.
    pub cluster_id: String,
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// When the scan judged the page, ms.
    pub now_ms: i64,
    /// Messages kept as bypass evidence (`bypass_publish`, `foreign_source`).
    pub bypass_messages: Vec<ScannedMessage>,
    /// Findings to open (or mark seen again).
    pub findings: Vec<ScanFinding>,
    /// Where the cursor goes.
    pub cursor: crate::compare::CursorMove,
    /// With an [`CursorMove::Advance`](crate::compare::CursorMove::Advance):
    /// what the message below the new cursor is
    /// ([`scan_anchor`](crate::compare::scan_anchor)), when the page read it.
    pub anchor: Option<String>,
}

/// The reads and the one write of the reconciler's bypass scan
/// (`Reconciler::scan_for_bypass`, which decides with `crate::compare`).
/// `PgStore` and `MemoryStore` implement it.
#[async_trait]
pub trait BypassScanStore: Send + Sync {
    /// The topics routed to `cluster_id`, with their partition counts, by topic.
    async fn routed_topics(&self, cluster_id: &str) -> Result<Vec<(String, i32)>, StoreError>;

    /// The current route policies (the latest generation of each event
    /// type) that send to `topic` on `cluster_id`: event type and frozen
    /// partition count.
    async fn routes_to(&self, cluster_id: &str, topic: &str) -> Result<Vec<(String, i32)>, StoreError>;

    /// This outbox's source identity, if the store has one.
    async fn source_identity(&self) -> Result<Option<String>, StoreError>;

    /// The next offset the scan reads in (cluster, topic, partition); 0 for one never read.
    async fn bypass_cursor(&self, cluster_id: &str, topic: &str, partition: i32) -> Result<BypassCursor, StoreError>;

    /// Which of `event_ids` the outbox committed.
    async fn committed_event_ids(&self, event_ids: &[String]) -> Result<std::collections::BTreeSet<String>, StoreError>;

    /// The receipts, primary and duplicate, at `offsets` of (cluster, topic, partition), of any topic id.
    async fn receipts_at(&self, cluster_id: &str, topic: &str, partition: i32, offsets: &[i64]) -> Result<Vec<crate::compare::RecordedReceipt>, StoreError>;

    /// The payload digests and routing keys of the published events (a
    /// primary receipt of their current envelope generation exists) among
    /// `event_ids`.
    async fn published_digests(&self, event_ids: &[String]) -> Result<std::collections::BTreeMap<String, crate::compare::PublishedCopy>, StoreError>;

    /// The attempts of `event_ids` that no receipt answered: open (SENDING,
    /// UNKNOWN) and closed without one (ABSENT, NOT_SENT).
    async fn unanswered_attempts_of(&self, event_ids: &[String]) -> Result<Vec<crate::receipt::AttemptRecord>, StoreError>;

    /// Primary receipts of (cluster, topic, partition) at or beyond
    /// `from_offset`, accepted before `accepted_before_ms`, whose event has
    /// no open `receipt_position_lost` finding; lowest offset first, at most `limit`.
    async fn receipts_from(
        &self,
        cluster_id: &str,
        topic: &str,
        partition: i32,
        from_offset: i64,
        accepted_before_ms: i64,
        limit: i64,
    ) -> Result<Vec<crate::compare::RecordedReceipt>, StoreError>;

    /// The primary receipts at `offset` of (cluster, topic, partition), of
    /// any topic id, with their position epochs: what tells a receipt that
    /// never matched the log from a lost position
    /// ([`crate::compare::never_matched`]). Read only for a receipt whose
    /// position holds another event's message. A store that keeps no
    /// position epochs answers none (the default): such receipts stay lost
    /// positions.
    async fn receipt_epochs_at(&self, cluster_id: &str, topic: &str, partition: i32, offset: i64) -> Result<Vec<crate::compare::PositionEpoch>, StoreError> {
        let _ = (cluster_id, topic, partition, offset);
        Ok(Vec::new())
    }

    /// Records the page's bypass messages and findings and moves the cursor, in one transaction.
    async fn record_bypass_scan(&self, write: &BypassScanWrite) -> Result<(), StoreError>;
}

/// An event row's facts, as the comparison's condition findings read them
/// ([`crate::findings`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventFacts {
    /// The event.
    pub event_id: String,
    /// Its state.
    pub state: EventState,
    /// A dispatcher holds its claim (an owner is set).
    pub held_by_dispatcher: bool,
    /// This outbox publishes it (not a legacy publisher during a rollout).
    pub by_outbox: bool,
    /// When it was committed, ms.
    pub created_at_ms: i64,
    /// When it entered its state, ms.
    pub state_since_ms: i64,
    /// When it first became DISPATCH_UNKNOWN, ms.
    pub unknown_since_ms: Option<i64>,
    /// Why it was quarantined (the latest reason), if it was.
    pub quarantine_reason: String,
}

/// A published event's facts with its primary receipt's log position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishedFacts {
    /// The event.
    pub event_id: String,
    /// Its state.
    pub state: EventState,
    /// When its publish slot was filled, ms.
    pub published_at_ms: i64,
    /// The primary receipt's log (its topic id `None`: `destination.v1`).
    pub log: crate::log::LogId,
    /// Its offset.
    pub offset: i64,
    /// Its position epoch (above 0: accepted at a position another event's
    /// receipt held, in a log that replaced that one).
    pub position_epoch: i32,
    /// Whether a receipt of its partition has a position epoch above 0
    /// (see [`crate::LogPosition::partition_replaced`]).
    pub partition_replaced: bool,
    /// Whether an open `receipt_position_lost` finding names it.
    pub position_lost: bool,
    /// When its receipt's message was written at the earliest, ms (see
    /// [`crate::LogPosition::sent_from_ms`]).
    pub sent_from_ms: Option<i64>,
    /// The log id its receipt names (see [`crate::BrokerReceipt::log_id`]).
    pub log_id: Option<String>,
}

impl PublishedFacts {
    /// The primary receipt's log position.
    pub fn position(&self) -> crate::LogPosition<'_> {
        crate::LogPosition {
            log: self.log.as_ref(),
            offset: self.offset,
            position_epoch: self.position_epoch,
            partition_replaced: self.partition_replaced,
            position_lost: self.position_lost,
            sent_from_ms: self.sent_from_ms,
            log_id: self.log_id.as_deref(),
        }
    }
}

/// A consumer's watermark on one log, owned (see [`crate::WatermarkRef`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerWatermark {
    /// The consumer.
    pub consumer_id: String,
    /// The log (its topic id `None`: `destination.v1`).
    pub log: crate::log::LogId,
    /// The next offset the consumer reads.
    pub committed_offset: i64,
    /// Whether the consumer that moved it recorded its anchor (the outbox
    /// consumer's own store does, and so do its copies: `.v4` watermark
    /// records and `publish_watermarks`; a record older than `.v4` does
    /// not; see [`crate::WatermarkAnchor`]).
    pub anchor_recorded: bool,
    /// The event the consumer recorded at `committed_offset - 1`, when it
    /// decided a genuine message of one there (`None`: another message,
    /// or an offset it capped at a gap).
    pub anchor_event_id: Option<String>,
    /// The position epoch of that event's receipt at that position, as the
    /// store read it with the watermark (`None`: no receipt of it there).
    pub anchor_epoch: Option<i32>,
    /// When that receipt was accepted, ms (`None`: no receipt of it there).
    pub anchor_accepted_ms: Option<i64>,
    /// The log the consumer kept the watermark in, as its fetches saw it
    /// (the topic's id; `None`: not known, or a copy that does not carry it).
    pub log_id: Option<String>,
}

impl ConsumerWatermark {
    /// As the core's decisions take it.
    pub fn watermark_ref(&self) -> crate::retention::WatermarkRef<'_> {
        crate::retention::WatermarkRef {
            consumer_id: &self.consumer_id,
            log: self.log.as_ref(),
            committed_offset: self.committed_offset,
            log_id: self.log_id.as_deref(),
            anchor: if self.anchor_recorded {
                crate::retention::WatermarkAnchor::At {
                    epoch: self.anchor_epoch.filter(|_| self.anchor_event_id.is_some()),
                    accepted_at_ms: self.anchor_accepted_ms.filter(|_| self.anchor_event_id.is_some()),
                }
            } else {
                crate::retention::WatermarkAnchor::Unrecorded
            },
        }
    }
}

/// A consumer's watermark publisher over the broker (per cluster).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatermarkPublisherFacts {
    /// The consumer.
    pub consumer_id: String,
    /// The cluster whose watermark topic it publishes to.
    pub cluster_id: String,
    /// Records accepted so far.
    pub records_accepted: i64,
    /// When the last accepted record arrived, ms.
    pub last_received_ms: i64,
}

/// One event of a page of the published-without-receipt sweep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SweptEvent {
    /// The event.
    pub event_id: String,
    /// Its state.
    pub state: EventState,
    /// A primary receipt of its current envelope generation exists.
    pub has_primary_receipt: bool,
    /// When it entered its state, ms.
    pub state_since_ms: i64,
}

/// A condition finding of a round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundFinding {
    /// Its kind ([`crate::findings`]' constants).
    pub kind: &'static str,
    /// The event it names (a cluster for `stale_watermark`).
    pub event_id: String,
    /// The consumer it names, or empty.
    pub consumer_id: String,
    /// Its age, ms.
    pub age_ms: i64,
    /// In words.
    pub detail: String,
}

/// The reads and the one write of the comparison's condition findings
/// (`Reconciler::compare_findings`, which decides with
/// [`crate::findings`]). Every read is bounded by `limit`; a store may
/// pre-filter candidates (by time, with an index), and the reconciler
/// records only those the core functions judge findings. `PgStore` and
/// `MemoryStore` implement it.
#[async_trait]
pub trait FindingsStore: Send + Sync {
    /// Undelivered candidates (PENDING, or CLAIMED/SENDING held by a
    /// dispatcher) committed before `created_before_ms`, oldest first.
    async fn aged_candidates(&self, created_before_ms: i64, limit: i64) -> Result<Vec<EventFacts>, StoreError>;

    /// Events unknown since before `unknown_before_ms` (not closed), longest first.
    async fn unknown_candidates(&self, unknown_before_ms: i64, limit: i64) -> Result<Vec<EventFacts>, StoreError>;

    /// Quarantined events, with their latest reason, longest first.
    async fn quarantined_candidates(&self, limit: i64) -> Result<Vec<EventFacts>, StoreError>;

    /// The critical consumers and the topics each reads.
    async fn critical_consumers(&self) -> Result<Vec<(String, Vec<String>)>, StoreError>;

    /// Published (or retained) events on `topics`, published before
    /// `published_before_ms`, with their primary receipt; the store may
    /// leave out those `consumer_id`'s watermark of their log has passed.
    /// Oldest first.
    async fn published_candidates(&self, consumer_id: &str, topics: &[String], published_before_ms: i64, limit: i64) -> Result<Vec<PublishedFacts>, StoreError>;

    /// `consumer_id`'s watermarks on `topics`, every cluster and topic id.
    async fn consumer_watermarks(&self, consumer_id: &str, topics: &[String]) -> Result<Vec<ConsumerWatermark>, StoreError>;

    /// The next page of the published-without-receipt sweep (by event id,
    /// after the sweep's cursor, at most `limit` events, wrapping around at
    /// the end); moves the cursor. The store may leave out events that have
    /// their primary receipt or are not in a published state.
    async fn receipt_sweep_page(&self, limit: i64) -> Result<Vec<SweptEvent>, StoreError>;

    /// Declared consumers' watermark publishers whose last record arrived
    /// before `received_before_ms`, oldest first.
    async fn watermark_publishers(&self, received_before_ms: i64, limit: i64) -> Result<Vec<WatermarkPublisherFacts>, StoreError>;

    /// Opens the round's `findings` (or marks open ones seen again) at
    /// `now_ms`, and resolves every open finding the round did not see
    /// that [`crate::findings::round_resolves`] resolves; one transaction.
    async fn record_round_findings(&self, now_ms: i64, findings: &[RoundFinding]) -> Result<(), StoreError>;
}
