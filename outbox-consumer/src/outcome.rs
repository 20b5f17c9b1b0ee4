//! What the consumer decided about one message.

use chrono::{DateTime, Utc};
use outbox_core::EventId;
use serde::Serialize;
use serde_json::Value;

/// Where a message sits in the log.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct Position {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
}

/// The consumption receipt of one event by one consumer: the row of
/// `outbox_consumer_receipts`, committed together with the handler's effect.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Receipt {
    /// The consumer.
    pub consumer_id: String,
    /// The event.
    pub event_id: EventId,
    /// Envelope generation of the copy that was applied.
    pub envelope_generation: u32,
    /// Event type.
    pub event_type: String,
    /// Where the applied copy was read.
    pub position: Position,
    /// The topic id the applied copy's destination names (`None`: a
    /// `destination.v1`): which log `position` is in.
    pub topic_id: Option<String>,
    /// `sha256:` digest of the applied payload.
    pub payload_digest: String,
    /// What the handler returned when it applied the event.
    pub result: Value,
    /// When the receipt transaction started (database clock).
    pub received_at: DateTime<Utc>,
}

/// Why a message was quarantined instead of handled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum QuarantineReason {
    /// [`outbox_core::headers::verify`] refused the message.
    Verification {
        /// Stable short code: `missing_header`, `malformed_header`,
        /// `payload_digest`, `destination_digest`, `placement`.
        code: String,
        /// The verification error, printed.
        detail: String,
    },
    /// The eventId was already applied with other payload bytes: the same
    /// logical event with a diverging payload is never accepted.
    DivergentDuplicate {
        /// Digest recorded in the receipt.
        receipt_digest: String,
        /// Digest of this message.
        message_digest: String,
    },
}

impl QuarantineReason {
    /// The `reason` column: `verify:<code>` or `divergent_duplicate`.
    pub fn code(&self) -> String {
        match self {
            QuarantineReason::Verification { code, .. } => format!("verify:{code}"),
            QuarantineReason::DivergentDuplicate { .. } => "divergent_duplicate".to_owned(),
        }
    }
}

/// A quarantined message (a row of `outbox_consumer_quarantine`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Quarantined {
    /// Where the message sits.
    pub position: Position,
    /// The eventId header, when readable (unverified).
    pub event_id: Option<String>,
    /// Why.
    pub reason: QuarantineReason,
    /// sha256 of the bytes received.
    pub payload_digest: String,
}

/// A dead-lettered event (a row of `outbox_consumer_dead_letters`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeadLettered {
    /// The event.
    pub event_id: EventId,
    /// Where this copy sits.
    pub position: Position,
    /// Handler attempts made before giving up.
    pub attempts: u32,
    /// The last handler error, printed.
    pub error: String,
    /// `true` when this delivery found the event already dead-lettered (a
    /// redelivery); the handler did not run again.
    pub redelivery: bool,
}

/// The decision about one message. Every message gets exactly one, in offset
/// order, and the partition's offset moves past it only after the decision
/// committed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Outcome {
    /// First delivery: the handler ran and its effect committed with the receipt.
    Applied {
        /// The new receipt.
        receipt: Receipt,
    },
    /// The event was applied before: the handler did not run; here is the
    /// original receipt with the original result.
    Duplicate {
        /// The receipt written when the event was applied.
        original: Receipt,
        /// Where this (redundant) copy sits.
        delivery: Position,
    },
    /// Verification failed or the payload diverges: recorded, not handled.
    Quarantined(Quarantined),
    /// The handler kept failing: recorded, not applied.
    DeadLettered(DeadLettered),
}

impl Outcome {
    /// Where the decided message sits.
    pub fn position(&self) -> &Position {
        match self {
            Outcome::Applied { receipt } => &receipt.position,
            Outcome::Duplicate { delivery, .. } => delivery,
            Outcome::Quarantined(q) => &q.position,
            Outcome::DeadLettered(d) => &d.position,
        }
    }

    /// The receipt (new or original), for applied and duplicate outcomes.
    pub fn receipt(&self) -> Option<&Receipt> {
        match self {
            Outcome::Applied { receipt } => Some(receipt),
            Outcome::Duplicate { original, .. } => Some(original),
            _ => None,
        }
    }

    /// Short name: `applied`, `duplicate`, `quarantined`, `dead_lettered`.
    pub fn kind(&self) -> &'static str {
        match self {
            Outcome::Applied { .. } => "applied",
            Outcome::Duplicate { .. } => "duplicate",
            Outcome::Quarantined(_) => "quarantined",
            Outcome::DeadLettered(_) => "dead_lettered",
        }
    }
}
