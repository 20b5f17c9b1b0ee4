//! The dispatcher: N workers claim bounded batches under fenced leases, send
//! each event to its frozen destination, and hand every broker answer to the
//! single receipt transaction.
//!
//! A batch goes through two steps, public so tests and operators can drive
//! them one at a time:
//! 1. [`Dispatcher::claim_and_send`]: claim (CAS, generation + 1), verify the
//!    stored payload and destination against their digests (quarantine on
//!    mismatch, never send), register the attempts (fenced on generation and
//!    lease), then start every send. Sends run on their own tasks: once
//!    started, a broker answer is captured even if the worker stalls.
//! 2. [`Dispatcher::settle`]: wait for the answers (renewing the leases of a
//!    long batch), then: ACK -> `accept_dispatch_receipts`; definitely not
//!    persisted -> attempt NOT_SENT, event PENDING; anything else -> attempt
//!    UNKNOWN, event DISPATCH_UNKNOWN. These writes ride out retryable
//!    database errors (a lost connection, a failover) for up to
//!    [`DispatcherConfig::record_retry_ms`]. A worker whose claim was taken over
//!    meanwhile writes nothing but audit records, yet its ACKs still go
//!    through the receipt transaction.
//!
//! Files, one job each: `config` ([`DispatcherConfig`], its defaults and
//! limits, the owner names); `metrics` ([`DispatchMetrics`]); `batch` (what
//! a batch carries between the two steps and what it did); `gate` (whether
//! this dispatcher may claim now: the claim gate and the alias); `message`
//! (the message of one attempt); `claim` (step 1); `settle` (step 2);
//! `retry` (riding out retryable database errors); `run` (one batch, and
//! [`Dispatcher::run`]: the workers, the lease sweeper and the LISTEN
//! wake-up). This file holds [`Dispatcher`] and its construction.

mod batch;
mod claim;
mod config;
mod gate;
mod message;
mod metrics;
mod retry;
mod run;
mod settle;

use std::sync::Arc;
// tokio's clock: the simulator runs these services in virtual time.
use tokio::time::Instant;

use outbox_core::Broker;

use crate::error::ProducerError;
use crate::pg::PgStore;
use crate::service_store::ServiceStore;
use gate::Gate;

pub use batch::{BatchReport, ClaimCursor, InFlightBatch};
pub use config::{
    default_owner_name, host_name, DispatcherConfig, SigningConfig, DEFAULT_BATCH_SIZE, DEFAULT_HEAD_SCAN_EVERY, DEFAULT_LEASE_MS,
    DEFAULT_POLL_INTERVAL_MS, DEFAULT_RECORD_RETRY_MS, DEFAULT_SHUTDOWN_GRACE_MS, DEFAULT_SWEEP_INTERVAL_MS, DEFAULT_WORKERS, IMPLEMENTATION,
    MAX_HEAD_SCAN_EVERY, MAX_RECORD_RETRY_MS, MAX_WORKERS,
};
pub use gate::ClaimGate;
pub use message::{outgoing_message, outgoing_message_signed, TRACESTATE_HEADER};
pub use metrics::DispatchMetrics;
pub use run::{until_true, IntoShutdown, ShutdownFuture};
#[allow(deprecated)]
pub use run::ShutdownWatch;
pub use crate::sweeper::{CLOCK_SKEW_WARN_LEASE_FRACTION, CLOCK_SKEW_WARN_MIN_MS, PROTOCOL_GAUGE_EVERY};

/// The dispatcher service.
#[derive(Debug)]
pub struct Dispatcher<B: Broker + 'static, S: ServiceStore = PgStore> {
    store: S,
    broker: Arc<B>,
    config: DispatcherConfig,
    metrics: Arc<DispatchMetrics>,
    /// When the alias was last read, and whether it named this implementation.
    alias_checked: std::sync::Mutex<Option<(Instant, bool)>>,
    /// Held while claiming (see [`Dispatcher::claim`]): all of it on the
    /// chains path, one permit of it where claims may overlap.
    claim_turn: tokio::sync::Semaphore,
    /// Checked before each claim.
    gate: Gate,
    /// [`DispatcherConfig::signing`], parsed.
    signer: Option<outbox_core::trust::SigningKey>,
}

/// How many claims of one instance may run at once where the store says
/// claims may overlap ([`ServiceStore::claims_may_overlap`]): the stream
/// path, whose claims lock disjoint key buckets. One elsewhere.
const CLAIM_PERMITS: u32 = 2;

impl<B: Broker + 'static, S: ServiceStore> Dispatcher<B, S> {
    /// A dispatcher over `store` sending through `broker`. Claims are scoped
    /// to the broker's cluster: events frozen for another cluster are never
    /// claimed here.
    pub fn new(store: S, broker: Arc<B>, config: DispatcherConfig) -> Result<Self, ProducerError> {
        config.validate()?;
        let signer = config.signing.as_ref().map(SigningConfig::key).transpose()?;
        let store = store.scoped_to_cluster(broker.cluster_id());
        Ok(Dispatcher {
            store,
            broker,
            config,
            metrics: Arc::default(),
            alias_checked: std::sync::Mutex::new(None),
            claim_turn: tokio::sync::Semaphore::new(CLAIM_PERMITS as usize),
            gate: Gate(None),
            signer,
        })
    }

    /// The counters.
    pub fn metrics(&self) -> Arc<DispatchMetrics> {
        self.metrics.clone()
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The configuration.
    pub fn config(&self) -> &DispatcherConfig {
        &self.config
    }
}
