//! The in-memory outbox store: an [`OutboxStore`] over the same decisions
//! as the PostgreSQL store. The simulator and the conformance suite use it;
//! it keeps every record the PostgreSQL schema keeps (attempts, primary and
//! duplicate receipts, quarantine, audit), with a clock the caller sets.
//!
//! Its parts, one job each: the records (`records.rs`), the emit
//! transaction (`emit.rs`) and emitting transactions that overlap
//! (`transactions.rs`), the stream mode (`stream.rs`), the protocol's claims, receipts, reports and
//! reconcile (`outbox.rs`, the [`OutboxStore`] implementation, with the row
//! writes they share in `rows.rs`), destination migration (`migration.rs`), an operator's skip (`skip.rs`),
//! the consumer registry and watermarks (`consumers.rs`), and the
//! reconciler's reads: the bypass scan (`bypass_scan.rs`) and the
//! comparison's findings (`findings.rs`).
//!
//! [`OutboxStore`]: outbox_core::OutboxStore

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex, MutexGuard};

use outbox_core::id::{AttemptId, EventId};
use outbox_core::receipt::{AttemptRecord, BrokerReceipt};
use outbox_core::store::{BypassCursor, ScannedMessage};
use outbox_core::stream::Xid;

mod bypass_scan;
mod consumers;
mod emit;
mod findings;
mod migration;
mod outbox;
mod records;
mod rows;
mod skip;
mod stream;
mod transactions;

pub use records::{AuditRecord, MemoryConsumer, MemoryEvent, MemoryWatermark, MigrationRecord};
pub use stream::{MemoryBatch, StreamState};
pub use transactions::EmitTx;

/// Everything the store holds; public for the simulator's invariant checks.
#[derive(Debug, Default)]
pub struct MemoryState {
    /// Events by id.
    pub events: BTreeMap<EventId, MemoryEvent>,
    /// Attempts by event, oldest first.
    pub attempts: BTreeMap<EventId, Vec<AttemptRecord>>,
    /// Duplicate transport receipts.
    pub duplicates: Vec<BrokerReceipt>,
    /// Quarantine records: event, reason.
    pub quarantine: Vec<(EventId, String)>,
    /// Audit records.
    pub audit: Vec<AuditRecord>,
    /// Command key -> event id.
    pub commands: BTreeMap<String, EventId>,
    /// Highest primary offset accepted per (cluster, topic, topic id,
    /// partition). The cluster is part of the key: two clusters may carry the
    /// same topic name (a route revision to another cluster), and their
    /// offsets are unrelated; so is the topic id: a topic deleted and created
    /// again under the same name starts another log at offset 0.
    /// The value is the offset past it (an attempt's scan floor) and the
    /// event whose receipt holds it (the floor's anchor).
    pub partition_high: BTreeMap<outbox_core::LogId, (i64, EventId, AttemptId)>,
    /// The newest primary receipt at each log position (cluster, topic,
    /// topic id, partition, offset), of any event or envelope generation
    /// (kept after a migration, as the receipts table keeps its rows): its
    /// event and position epoch, from which the next receipt there takes its
    /// epoch (`outbox_core::compare::next_position_epoch`, as PostgreSQL's
    /// receipt transaction does).
    pub position_holders: BTreeMap<(outbox_core::LogId, i64), (EventId, i32)>,
    /// Migration receipts, in order.
    pub migrations: Vec<MigrationRecord>,
    /// The highest version each aggregate (tenant, type, id) emitted.
    pub aggregate_versions: BTreeMap<(String, String, String), i64>,
    /// The topics events were routed to, per (cluster, topic): the
    /// partition count of the latest destination (the bypass scan reads them).
    pub routes: BTreeMap<(String, String), i32>,
    /// Open findings, (kind, event id or label, consumer id or empty) -> detail.
    pub findings: BTreeMap<(String, String, String), String>,
    /// Registered consumers by id (the comparison reads the critical ones).
    pub consumers: BTreeMap<String, MemoryConsumer>,
    /// Consumers' watermarks, one per consumer and log.
    pub watermarks: Vec<MemoryWatermark>,
    /// The published-without-receipt sweep's cursor: the last event id of its last full page.
    pub receipt_sweep_after: String,
    /// The bypass scan's cursors, (cluster, topic, partition) -> next offset.
    pub bypass_cursors: BTreeMap<(String, String, i32), BypassCursor>,
    /// Bypass evidence by (cluster, topic, partition, offset): messages
    /// the outbox never committed or another outbox wrote, and when seen.
    pub bypass_messages: BTreeMap<(String, String, i32, i64), (ScannedMessage, i64)>,
    /// Emitting transactions not yet ended, by transaction id: their events
    /// (with their command keys), invisible to every read.
    pub open_transactions: BTreeMap<Xid, Vec<(String, MemoryEvent)>>,
    /// The transaction that created each committed event.
    pub created_by: BTreeMap<EventId, Xid>,
    /// The key bucket of each committed event, from the destination it was
    /// committed with (`outbox_core::stream::stream_bucket`): the stream
    /// row's column, which a later migration does not move.
    pub stream_buckets: BTreeMap<EventId, u32>,
    /// The stream's records, when the store runs the stream ([`MemoryStore::with_stream`]).
    pub stream: Option<StreamState>,
    /// Every poison policy set, oldest first (the latest of an event type is in force).
    pub poison_rules: Vec<outbox_core::skip::PoisonRule>,
    next_seq: u64,
    next_xid: Xid,
}

/// The in-memory store. Cheap to clone; clones share state.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    state: Arc<Mutex<MemoryState>>,
    now_ms: Arc<AtomicI64>,
}

impl MemoryStore {
    /// An empty store at time 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the clock.
    pub fn set_now_ms(&self, now_ms: i64) {
        self.now_ms.store(now_ms, AtomicOrdering::SeqCst);
    }

    /// Reads the clock.
    pub fn now_ms(&self) -> i64 {
        self.now_ms.load(AtomicOrdering::SeqCst)
    }

    /// Locks the state for inspection.
    pub fn lock(&self) -> MutexGuard<'_, MemoryState> {
        // A panic while holding the lock would already have failed the run.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}
