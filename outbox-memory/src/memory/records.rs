//! The rows the in-memory store keeps, as the PostgreSQL schema's: the
//! event row, migration receipts, the consumer registry's entries and
//! watermarks, and audit records.

use outbox_core::claim::Claim;
use outbox_core::envelope::{Destination, Envelope};
use outbox_core::id::{AttemptId, EventId};
use outbox_core::migration::MigrationProof;
use outbox_core::receipt::BrokerReceipt;
use outbox_core::state::EventState;

/// One event row.
#[derive(Debug, Clone)]
pub struct MemoryEvent {
    /// Commit order.
    pub seq: u64,
    /// Frozen envelope.
    pub envelope: Envelope,
    /// Frozen destination.
    pub destination: Destination,
    /// Its digest.
    pub destination_digest: String,
    /// Stored payload.
    pub payload: Vec<u8>,
    /// State.
    pub state: EventState,
    /// Claim columns.
    pub claim: Claim,
    /// Highest attempt generation so far.
    pub attempt_generation: u32,
    /// The publish slot.
    pub slot: Option<BrokerReceipt>,
    /// The publish slot's position epoch (as the receipts table's
    /// `position_epoch`: above 0 when the receipt was accepted at a position
    /// another event's receipt held; 0 without a slot).
    pub slot_epoch: i32,
    /// When the event entered its current state, ms.
    pub state_since_ms: i64,
    /// When a DISPATCH_UNKNOWN event is due for reconciliation, ms.
    pub next_check_at_ms: i64,
    /// When it first became DISPATCH_UNKNOWN (kept until resolved), ms.
    pub unknown_since_ms: Option<i64>,
    /// When the publish slot was filled, ms (the replay window counts from here).
    pub published_at_ms: Option<i64>,
    /// How long each of its unknown outcomes took to resolve (from
    /// DISPATCH_UNKNOWN to PUBLISHED, QUARANTINED or PENDING), ms: the
    /// release gate's UNKNOWN time-to-resolution.
    pub unknown_resolved_after_ms: Vec<i64>,
    /// When it was committed, ms.
    pub created_at_ms: i64,
}

/// A migration receipt (PROTOCOL §7): links envelope generation N (kept as it
/// was, never edited) to N + 1 with its new frozen destination, with the proof.
#[derive(Debug, Clone, PartialEq)]
pub struct MigrationRecord {
    /// Event moved.
    pub event_id: EventId,
    /// Generation left behind.
    pub from_generation: u32,
    /// New generation (`from_generation + 1`).
    pub to_generation: u32,
    /// The envelope of the generation left behind, as it was frozen.
    pub from_envelope: Envelope,
    /// Its frozen destination.
    pub from_destination: Destination,
    /// Its digest.
    pub from_destination_digest: String,
    /// The new frozen destination.
    pub to_destination: Destination,
    /// Its digest.
    pub to_destination_digest: String,
    /// Why the old target does not hold the event.
    pub proof: MigrationProof,
    /// Who asked.
    pub operator: String,
    /// When, ms.
    pub at_ms: i64,
    /// Attempts of the old generation closed ABSENT by the move (only under `ProvenAbsent`).
    pub closed_attempts: Vec<AttemptId>,
}

/// One consumer's published watermark on one log, as retention reads it:
/// the store traits' [`ConsumerWatermark`](outbox_core::ConsumerWatermark), under
/// the name the in-memory store's callers know.
pub type MemoryWatermark = outbox_core::store::ConsumerWatermark;

/// A registered consumer (as `outbox_consumers`): whether the reconciler
/// compares its watermarks (`critical`), whether retention waits for it
/// (`mandatory`), and the topics it reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemoryConsumer {
    /// Compared by the reconciler (`unconsumed_published`).
    pub critical: bool,
    /// Waited for by retention.
    pub mandatory: bool,
    /// Topic names it reads.
    pub topics: Vec<String>,
}

/// An audit record (stale writes, rejected receipts).
#[derive(Debug, Clone, PartialEq)]
pub struct AuditRecord {
    /// Event concerned.
    pub event_id: EventId,
    /// What happened.
    pub action: String,
    /// Details.
    pub detail: String,
}
