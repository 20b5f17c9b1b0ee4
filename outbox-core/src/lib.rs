//! # outbox-core
//!
//! The protocol of the transactional outbox with verified delivery, with no
//! I/O: envelope and destination types and their canonical encoding and
//! digests, the closed state machine, claim fencing, the receipt decision of
//! `acceptDispatchReceipt`, and the store and broker traits.
//!
//! **Guarantee.** Decisions live here once. The PostgreSQL store, the
//! in-memory store (`outbox-memory`) and the simulator all call
//! [`decide_receipt`], [`check_fence`] and [`EventState::transition`], so what the simulator proves
//! over millions of traces is a statement about the code that runs in
//! production.
//!
//! ```
//! use outbox_core::{EmitRequest, EventId, RoutePolicy};
//!
//! let policy = RoutePolicy::new("order.created.v2", "kafka-prod", "orders", 12);
//! let request = EmitRequest {
//!     command_key: "cmd-o-42-create",
//!     tenant: "tenant-7",
//!     aggregate_type: "order",
//!     aggregate_id: "o-42",
//!     aggregate_version: 17,
//!     event_type: "order.created.v2",
//!     payload_schema: "order-v2",
//!     payload: br#"{"order":"o-42"}"#,
//! };
//! request.validate(outbox_core::DEFAULT_MAX_PAYLOAD_BYTES)?;
//! let (envelope, destination) = request.freeze(EventId::generate(1_700_000_000_000), 1_700_000_000_000, 4711, &policy)?;
//! assert_eq!(destination.routing_key, "tenant-7.order.o-42");
//! assert!(envelope.payload_digest.starts_with("sha256:"));
//! # Ok::<(), outbox_core::CoreError>(())
//! ```
#![warn(missing_docs)]

pub mod canonical;
pub mod claim;
pub mod command;
pub mod compare;
pub mod envelope;
pub mod error;
pub mod findings;
pub mod headers;
pub mod id;
pub mod labels;
pub mod log;
pub mod migration;
pub mod simulation;
pub mod skip;
pub mod receipt;
pub mod reconcile;
pub mod retention;
pub mod state;
pub mod store;
pub mod stream;
pub mod takeover;
pub mod trace_context;
pub mod trust;
pub mod watermark_record;

pub use canonical::{is_digest, sha256_digest};
pub use command::{decide_command, Command, CommandDecision, CommandRefusal};
pub use claim::{check_fence, check_registration, is_claimable, sql_state_list, REGISTRABLE_STATES, lease_expiry_sql, not_sent_backoff_ms, plan_lease_expiry, Claim, ClaimToken, Clock, FencedWrite, LeaseExpiry, LeaseExpirySql, ManualClock, SystemClock, LEASED_STATES};
pub use envelope::{Destination, EmitRequest, Envelope, Ordering, Partitioner, RoutePolicy, DEFAULT_CONTENT_TYPE, DEFAULT_MAX_PAYLOAD_BYTES};
pub use error::CoreError;
pub use headers::CloudEventsBinding;
pub use id::{AttemptId, EventId};
pub use log::{LogId, LogRef};
pub use reconcile::{
    anchor_holds, anchor_to_read, check_in_flight_bound, decide_after_submit, decide_reconcile, plan_absence_scan, scan_floor, scan_lower_bound, AbsenceScan, AnchorCheck, RecheckReason, ReconcileDecision, RetryPolicy, ScanFrom,
};
pub use retention::{may_purge, may_retain, HoldReason, LogPosition, WatermarkAnchor, WatermarkRef};
pub use migration::{check_migration_fence, decide_migration, may_keep_destination, read_fence, MigrationDecision, MigrationFence, MigrationProof, MigrationRefusal};
pub use receipt::{decide_receipt, is_unregistered_message, refutes_absence, AttemptRecord, BrokerReceipt, LockedEvent, QuarantineReason, ReceiptDecision, RejectReason};
pub use skip::{decide_skip, PoisonPolicy, PoisonRule, SkipRecord, SkipRefusal, POISON_POLICY_ACTOR, SKIP_ACTION};
pub use state::{AttemptState, EventState, ALL_STATES, TRANSITIONS as ALL_TRANSITIONS};
pub use takeover::{decide_publisher, takeover_bucket, Publisher, TakeoverPolicy, TAKEOVER_BUCKETS};
pub use store::{Broker, BypassCursor, BypassScanStore, BypassScanWrite, ScanFinding, ConsumerWatermark, EventFacts, FindingsStore, PublishedFacts, RoundFinding, SweptEvent, WatermarkPublisherFacts, ClaimedEvent, PartitionScan, ReconcileTask, ScannedMessage, FenceOutcome, LookupOutcome, OutboxStore, OutgoingMessage, ReceiptOutcome, SendOutcome, StoreError, SweepOutcome};
