//! # outbox-sim
//!
//! A seeded, deterministic simulator of the outbox and the release gate of
//! PROTOCOL §10.
//!
//! **Guarantee.** A trace runs the *shipped* services — the producer's
//! `Dispatcher` (its own `run`: workers, lease sweeper), the `Reconciler`
//! (`run_resolving`), the destination migration (`migrate_destination_in`),
//! the retention pass (`outbox_producer::retention::purge_with`, deciding with `may_purge`)
//! and the consumer's `Processor` with its partition loop `run_partition` —
//! over the in-memory stores, against a simulated broker, on a seeded
//! current-thread runtime in virtual time. No service loop exists only
//! here: the simulator drives processes (starts, kills, pauses them),
//! clients (emits and retried commands), the broker and the faults, and
//! checks what the shipped code left in the stores and the logs. One seed
//! names one trace on every machine, bit for bit; the gate runs traces on
//! all cores.
//!
//! Faults enter at the seams the services talk through (see
//! [`services`]): store calls that fail, stall or commit with their answer
//! lost; listening sessions lost with a notice; broker sends refused, timed out unwritten, written with their ACK
//! lost, written twice, written late; hosts paused with a message in their
//! client's buffer, clocks skewed per host; processes killed at any await;
//! logs truncated, compacted, deleted and recreated, clusters replaced;
//! forged messages carrying an attempt's headers; consumers that crash
//! between their database commit and their offset commit, rebalance with a
//! batch in flight, and see duplicated and reordered deliveries.
//!
//! Mutations (`--mutation list`) are one-line switches in shipped code
//! ([`outbox_core::simulation::mutation_active`]); each must turn the gate
//! red, and the failing seed's printed replay command fails the same way.
#![warn(missing_docs)]

pub mod harness;
pub mod rng;
pub mod services;

pub use harness::MemoryHarness;
pub use services::{run_services_gate, run_services_gate_in, run_services_gate_report, run_services_trace, run_services_trace_in, ServiceFigures, ServicesGate, StoreMode, COMPONENT_MUTATIONS, SERVICE_MUTATIONS, STREAM_MUTATIONS};

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
