//! # outbox-sim
//!
//! A seeded, deterministic simulator of the outbox protocol and the release
//! gate of PROTOCOL §10.
//!
//! **Guarantee.** A trace drives the decision code of `outbox-core` — the
//! state table, claim fencing, `decide_receipt`, `decide_reconcile` — through
//! the [`outbox_core::OutboxStore`] trait of [`outbox_core::MemoryStore`], the
//! same calls the dispatcher, reconciler and PostgreSQL store make. One seed
//! names one trace on every machine; the gate runs traces on all cores.
//!
//! Two engines: the services engine ([`services`]) runs the shipped
//! services (`Dispatcher`, `Reconciler`, the destination migration, the
//! retention decision) over the in-memory store in virtual time; the model
//! engine ([`sim`], described below) drives the core's decisions through
//! its own loops, for what the services engine does not run yet.
//!
//! ## A trace (model engine)
//!
//! The seed picks 2-6 business commands over 1-3 aggregates, 1-3
//! dispatchers, 1-2 reconcilers, 1-2 consumers, a fault intensity, whether
//! the broker adapter can look up an eventId at all (90%), a route policy
//! revision (40%), a payload tampering (10%), a destination migration (30%)
//! and retention (50%). Then 30-80 steps of a faulty
//! phase; in each, time moves (mostly milliseconds, sometimes tens of
//! seconds, so leases expire), the broker writes what is due, and one actor
//! acts:
//!
//! * **clients** run a command: the business row and the PENDING envelope in
//!   one transaction (`MemoryStore::insert`); a try may die before the commit,
//!   or after it and be retried with the same command key;
//! * **dispatchers** claim (`claim_retries`, `claim_batch`), renew leases,
//!   register attempts, send, and handle the broker's answer (`accept_dispatch_receipt`,
//!   `report_not_sent`, `report_unknown`); they stall (GC pauses longer than a
//!   lease) and crash, losing what they held in memory;
//! * the **broker** refuses, times out unwritten, writes with delay, writes
//!   twice, loses ACKs (written but unACKed), duplicates and reorders ACKs;
//! * **reconcilers** sweep leases (`expire_leases`), `begin_reconcile`, look
//!   up the frozen partition from `scan_lower_bound` (lookups fail),
//!   `decide_reconcile`, submit found receipts and `finish_reconcile`;
//! * **consumers** read every partition in order, write the
//!   `(consumerId, eventId)` receipt and the effect in one transaction, then
//!   commit the offset — and may die in between (redelivery);
//! * receipt transactions roll back, or commit and lose their answer.
//!
//! Then **quiescence**: faults off, every worker back, rounds until nothing
//! moves; then the invariants are checked (see [`Figures`]).
//!
//! ## End states
//!
//! After quiescence every committed event must be PUBLISHED, with two
//! exceptions the trace itself causes and that need an operator: an event
//! whose stored payload the trace tampered with may end QUARANTINED; and an
//! event behind such a quarantined event of the same routing key stays
//! PENDING (per-key ordering). Anything else — DISPATCH_UNKNOWN after
//! quiescence, a spent attempt budget, an untampered QUARANTINED — is a
//! lost event.
//!
//! ## Migration and retention
//!
//! In 30% of traces (drawn from their own random stream, so the other traces
//! are unchanged) the route policy is revised mid-trace to another cluster or
//! topic, the old target becomes unqueryable for up to 40 s, and an operator
//! tries at random steps to move one undelivered event to the new
//! destination (`decide_migration`, `MemoryStore::migrate`): refused while
//! the old target is UNKNOWN and unqueryable, accepted only under proof.
//! In 50% of traces retention passes run at random points
//! (`MemoryStore::retain_and_purge`: `may_retain`, `may_purge`) against
//! mandatory consumers whose published watermarks lag (some publish rarely);
//! every purge is checked against the consumers' committed positions and the
//! replay window, then a late duplicate ACK and a retried command are
//! replayed against the tombstone.
//!
#![warn(missing_docs)]

pub mod figures;
pub mod gate;
pub mod harness;
pub mod mutation;
pub mod rng;
pub mod services;
pub mod sim;

pub use figures::Figures;
pub use gate::{run_gate, GateReport};
pub use harness::MemoryHarness;
pub use mutation::Mutation;
pub use sim::{run_trace, TraceConfig, TraceOutcome};

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll};

/// Runs a future of the in-memory store to completion on this thread. The
/// memory store never awaits, so one poll finishes it; anything else falls
/// back to a blocking executor.
pub fn now<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let mut cx = Context::from_waker(futures::task::noop_waker_ref());
    match f.as_mut().poll(&mut cx) {
        Poll::Ready(v) => v,
        Poll::Pending => futures::executor::block_on(f),
    }
}
