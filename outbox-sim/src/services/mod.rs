//! The services engine: one trace runs the shipped
//! `outbox_producer::Dispatcher` and
//! `outbox_producer::Reconciler` (their own loops: `run` and
//! `run_resolving`), and in some traces the shipped destination migration
//! (`outbox_producer::migration::migrate_destination_in`, driven by an
//! operator) and retention pass (`outbox_producer::retention::purge_with`,
//! whose decision is `outbox_core::may_purge`), over the in-memory store, against a
//! simulated broker, on a seeded single-threaded executor in virtual time.
//!
//! Emitting transactions overlap as they do in PostgreSQL: an event takes
//! its position (transaction id, sequence) when it is inserted, and most
//! transactions commit at once, but about a fifth stay open for up to two
//! seconds, a few for one to three leases, and some abort; transactions
//! commit in another order than they took their positions. A key's
//! transactions run one after another (emitters of one aggregate
//! serialize on its lock). Nothing of an aborted transaction may ever be
//! seen (`aborted_visible`).
//!
//! Faults are injected at the seams the services talk through:
//! - the store ([`SimStore`]): calls that fail before doing anything, that
//!   commit and lose their answer, and that stall (a paused process, a
//!   stuck connection) for up to four leases;
//! - the broker ([`SimBroker`]): refused sends (not persisted), requests
//!   that never reach the log and time out, writes whose ACK is lost, ACKs
//!   delivered late (after the lease), writes the client repeats, failed
//!   lookups, slow lookups (a long scan answers for the log as it was when
//!   it began); the client keeps writing what it was handed after its
//!   process died, within the message timeout; and, in a few traces, while
//!   the dispatchers run, `TOPIC` deleted and created again under the same
//!   name (8%), or the cluster replaced by an empty one (5%): the affected
//!   partitions start again as empty logs at offset 0, the old messages
//!   gone, and the consumer reads them from their start. The route's
//!   destinations record no topic id (`destination.v1`), the harder case:
//!   only the scan floors' anchors (`anchor_to_read`, `plan_absence_scan`)
//!   tell the new log from the old one;
//! - processes: dispatchers, the reconciler and the operator killed at any
//!   await (their task dropped, so every worker stops) and restarted under a
//!   new owner; the operator also paused for up to six leases;
//! - clocks: each dispatcher's and reconciler's host has its own clock,
//!   off true time by up to `MAX_CLOCK_SKEW_MS` either way, and stamps its
//!   store calls with it (as `PgStore` stamps leases with its host's);
//! - hosts: a dispatcher's host stopped (a VM paused, a laptop suspended, a
//!   container frozen) right after it handed a message to its client, for
//!   two to five leases. Nothing of the host runs meanwhile, the dispatcher
//!   nor its client: its lease runs out by the database's clock, and the
//!   message leaves the client's buffer only when the host resumes, after
//!   the in-flight bound the reconciler waited out (a client's message
//!   timeout is a promise about its host's running time). This is how a
//!   genuine ACK of an attempt closed ABSENT arises in production (the
//!   bound rules it out for a host that keeps running: a lookup after the
//!   bound sees every write that can still land, and a truncated or
//!   replaced log proves nothing); the protocol's answer is that the
//!   receipt competes for the slot (primary or duplicate), the attempt
//!   becomes ACKED and the store records `absence_proof_refuted`
//!   (counted as `absence_refuted_late`, not a violation, when a host pause
//!   explains it). The mutation `absent-attempt-ack-discarded` rejects such
//!   a receipt: the copy stays in the log, its attempt ABSENT, and
//!   `refuted_absence` counts it. Not in traces with a migration (a late
//!   copy of the generation a migration left is not repaired by design).
//!
//! Migration: the old topic degrades (ACKs lost, lookups slow), then the
//! route moves to `NEW_TOPIC` and the operator migrates every undelivered
//! event of `TOPIC`, asking again for the refused ones until none is left,
//! racing the dispatchers and the reconciler. Retention: the consumer group
//! (the shipped `Processor`, below) is the mandatory consumer; a retention
//! job purges every 0.6–6 s on the watermarks its receipt store holds, and
//! on a topic of the same name on `OTHER_CLUSTER` (far ahead). Its owners
//! sometimes start at the log's end (a group reset to latest): the offsets
//! skipped must stay a gap its watermark does not pass. In half the traces
//! with retention the watermarks reach it over the watermark topic: the
//! group publishes its rows as signed records, a forger writes records
//! moving the group's watermark to a partition's end (unsigned, or under a
//! key not the group's) and replays old ones, and the reader runs the
//! shipped reader's round (`outbox_producer::watermark_topic::{decide,
//! round}`) into the copy retention reads.
//!
//! Then faults stop, the services run until every event is settled, and the
//! checks read the store and the log (names as Jepsen's Kafka checker uses
//! them where they apply): `lost_write` (an event committed and not
//! published, or whose receipt's position does not hold it in any log that
//! partition has had: one whose position held it in a log that is gone
//! since is `receipt_positions_lost`, the broker's loss, which the
//! PostgreSQL store reports as the finding `receipt_position_lost` from its
//! receipt transaction's position epochs and its reconciler's topic scan;
//! the in-memory store has no position epochs), `duplicate` (a
//! copy in the log from an attempt the store has no receipt of, unless the
//! reconciler's bypass scan, which the engine runs, recorded a finding
//! naming it: `copies_reported`), and
//! `refuted_absence` (a copy of an attempt the store closed as not sent or
//! proven absent, or a proof the store saw refuted, unless a host pause
//! explains it: then the copy's receipt must have been accepted, or never
//! have reached the store (the scan's finding names it, `copies_reported`,
//! or not yet, `late_copies_unheard`); a copy in a log gone
//! before the proof that closed its attempt is no refutation: the proof was
//! about the log that replaced it, and its ACK arriving after the proof is
//! `absence_refuted_late` too), `inconsistent_offsets` (two events' receipts at one
//! position of one log), `order_violation` (a key's events published out of commit
//! order within one log), `unresolved_unknown` (an outcome still unknown after the run),
//! `migrated_over_copy` (a copy of the generation a migration left behind,
//! in the target it left while that log was there: delivered to the new
//! target while a copy sat in the old one) and `premature_purge` (an event purged that the
//! mandatory consumer group never applied nor dead-lettered; checked when
//! the purge happens). The consumer side adds `unseen` and
//! `watermark_passes_unread` (`consumers.rs`).
//!
//! The engine's parts, one job each:
//! - `config`: one trace's shape and fault probabilities, drawn from its seed;
//! - `figures`: the counters of one or many traces, and one trace's outcome;
//! - `world`: the state the store, the broker and the driver share (logs,
//!   hosts, clocks, what the services did);
//! - `store`: the store seam, the in-memory store behind a database's
//!   faults ([`SimStore`]), with the dispatchers' listening sessions;
//! - `broker`: the broker seam, a log per partition behind a client
//!   ([`SimBroker`]), and the log cleaner;
//! - `processes`: the shipped services as processes on hosts of their own
//!   (dispatchers, the reconciler, the operator's migration) and their killer;
//! - `retention`: the mandatory consumer's watermarks and the retention job;
//! - `watermark_topic`: the group's publisher, the forger and the reader
//!   of the watermark topic, and the copy they keep;
//! - `trace`: one trace: emits, retried commands, faults on a timeline,
//!   kills, the settling phase;
//! - `checks`: what the stores and the logs must show once a trace settled;
//! - `consumers`: the consumer group (the shipped `Processor`) and its checks;
//! - `mutations`: the catalogue of deliberate defects the gate must catch;
//! - `gate`: many traces on all cores, and the gate's verdict.

mod broker;
mod checks;
mod config;
mod consumers;
mod figures;
mod gate;
mod mutations;
mod processes;
mod retention;
mod store;
mod trace;
mod watermark_topic;
mod world;

pub use broker::SimBroker;
pub use config::{ServiceFaults, ServiceTraceConfig, StoreMode, MAX_CLOCK_SKEW_MS};
pub use figures::{ServiceFigures, ServiceOutcome};
pub use gate::{run_services_gate, run_services_gate_in, run_services_gate_report, ServicesGate, UNKNOWN_P99_LIMIT_MS};
pub use mutations::{COMPONENT_MUTATIONS, SERVICE_MUTATIONS, STREAM_MUTATIONS};
pub use store::SimStore;
pub use trace::{run_services_trace, run_services_trace_in};

/// Simulated time at the start of every trace (ms since the epoch).
const T0_MS: i64 = 1_700_000_000_000;
/// The dispatchers' and the reconciler's lease.
const LEASE_MS: i64 = 10_000;
/// The broker client's message timeout: a message handed to it is written
/// within this long, or never.
const MESSAGE_TIMEOUT_MS: i64 = 5_000;
const CLUSTER: &str = "sim-cluster";
const TOPIC: &str = "orders";
/// The topic an operator migrates `TOPIC`'s undelivered events to.
const NEW_TOPIC: &str = "orders-v2";
const PARTITIONS: u32 = 3;
/// Virtual time the faults last, from the first event.
const FAULT_PHASE_MS: i64 = 40_000;
