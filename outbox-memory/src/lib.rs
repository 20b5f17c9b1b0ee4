//! # outbox-memory
//!
//! The test doubles of the outbox, with no I/O: [`MemoryStore`], an
//! in-memory outbox store over the same decisions of `outbox-core` as the
//! PostgreSQL store, and the store conformance suite ([`conformance`]) that
//! holds every store to the protocol.
//!
//! **Guarantee.** The store decides nothing itself: claims, fencing, the
//! receipt decision, reconcile plans, migration and the comparison's reads
//! call `outbox-core`, as the PostgreSQL store does, so the simulator
//! (`outbox-sim`), which runs the shipped services over [`MemoryStore`],
//! proves statements about the code that runs in production. The
//! conformance suite runs the same scenarios on both stores.
//!
//! The producer implements its service seams (`ServiceStore`,
//! `MigrationStore`, `RetentionStore`, `RoundStore`) for [`MemoryStore`];
//! this crate depends on neither the producer nor the consumer.
//!
//! ```
//! use outbox_core::{EmitRequest, EventId, EventState, RoutePolicy};
//! use outbox_memory::MemoryStore;
//!
//! let store = MemoryStore::new();
//! store.set_now_ms(1_700_000_000_000);
//! let policy = RoutePolicy::new("order.created", "sim-cluster", "orders", 4);
//! let request = EmitRequest {
//!     command_key: "cmd-o-42-create",
//!     tenant: "tenant-7",
//!     aggregate_type: "order",
//!     aggregate_id: "o-42",
//!     aggregate_version: 1,
//!     event_type: "order.created",
//!     payload_schema: "order-v1",
//!     payload: br#"{"order":"o-42"}"#,
//! };
//! let emit = || -> Result<EventId, outbox_core::CoreError> {
//!     let (envelope, destination) = request.freeze(EventId::generate(store.now_ms() as u64), store.now_ms(), 1, &policy)?;
//!     store.insert(request.command_key, envelope, destination, request.payload.to_vec())
//! };
//! let id = emit()?;
//! assert_eq!(emit()?, id, "a retried command answers its first event");
//! assert_eq!(store.lock().events[&id].state, EventState::Pending);
//! # Ok::<(), outbox_core::CoreError>(())
//! ```
#![warn(missing_docs)]

pub mod conformance;
mod memory;

pub use memory::{AuditRecord, EmitTx, MemoryBatch, MemoryConsumer, MemoryEvent, MemoryState, MemoryStore, MemoryWatermark, MigrationRecord, StreamState};
