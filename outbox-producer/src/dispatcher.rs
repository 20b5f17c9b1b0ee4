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

use outbox_core::Clock as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering as AtomicOrdering};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
// tokio's clock: the simulator runs these services in virtual time.
use tokio::time::Instant;

use futures::stream::{FuturesUnordered, StreamExt};
use outbox_core::claim::{MAX_CLAIM_BATCH, MAX_LEASE_MS, MIN_LEASE_MS};
use outbox_core::{
    headers, AttemptRecord, Broker, BrokerReceipt, ClaimToken, ClaimedEvent, EventId, FenceOutcome, OutgoingMessage,
    ReceiptDecision, SendOutcome, StoreError,
};
use serde::Deserialize;
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::error::ProducerError;
use crate::pg::PgStore;
use crate::service_store::{Notice, ServiceStore};
use crate::sweeper::LeaseSweeper;

/// Default number of concurrent workers.
pub const DEFAULT_WORKERS: usize = 2;
/// Default claim batch size.
pub const DEFAULT_BATCH_SIZE: usize = 500;
/// Default lease, ms.
pub const DEFAULT_LEASE_MS: i64 = 30_000;
/// Default fallback poll interval when no notification arrives, ms.
pub const DEFAULT_POLL_INTERVAL_MS: u64 = 1_000;
/// Default lease sweep interval, ms.
pub const DEFAULT_SWEEP_INTERVAL_MS: u64 = 1_000;
/// Default time shutdown waits for outstanding broker answers, ms.
pub const DEFAULT_SHUTDOWN_GRACE_MS: u64 = 30_000;
/// Default of [`DispatcherConfig::record_retry_ms`].
pub const DEFAULT_RECORD_RETRY_MS: u64 = 30_000;
/// Largest [`DispatcherConfig::record_retry_ms`].
pub const MAX_RECORD_RETRY_MS: u64 = 600_000;
/// First wait before recording a broker answer again; it doubles up to
/// [`RECORD_RETRY_MAX_WAIT`].
const RECORD_RETRY_FIRST_WAIT: Duration = Duration::from_millis(50);
const RECORD_RETRY_MAX_WAIT: Duration = Duration::from_secs(2);
pub use crate::sweeper::{CLOCK_SKEW_WARN_LEASE_FRACTION, CLOCK_SKEW_WARN_MIN_MS, PROTOCOL_GAUGE_EVERY};
/// Most workers one dispatcher runs.
pub const MAX_WORKERS: usize = 64;
/// Default of [`DispatcherConfig::head_scan_every`].
pub const DEFAULT_HEAD_SCAN_EVERY: u32 = 4;
/// Largest [`DispatcherConfig::head_scan_every`].
pub const MAX_HEAD_SCAN_EVERY: u32 = 64;
/// This build's implementation name, the default of [`DispatcherConfig::implementation`].
pub const IMPLEMENTATION: &str = concat!("outbox-rs/", env!("CARGO_PKG_VERSION"));

/// Dispatcher settings. Precedence: defaults, then a TOML file, then
/// `OUTBOX_DISPATCH_*` environment variables, then explicit code.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DispatcherConfig {
    /// Owner prefix; worker `i` claims as `<name>-<i>`.
    pub name: String,
    /// Concurrent workers (1..=64).
    pub workers: usize,
    /// Events per claim (1..=10000).
    pub batch_size: usize,
    /// Claim lease, ms; a batch outliving half of it renews it.
    pub lease_ms: i64,
    /// Fallback poll interval, ms, when LISTEN/NOTIFY is quiet or off. A
    /// worker waits (for a notification or this long) only after a claim
    /// that found nothing or a batch the broker did not take; otherwise it
    /// claims again at once.
    pub poll_interval_ms: u64,
    /// Lease sweep interval, ms.
    pub sweep_interval_ms: u64,
    /// A worker claims the next events of the keys it has just published
    /// ([`PgStore::claim_successors`], one index probe per key) and scans
    /// every ordering key's head ([`OutboxStore::claim_batch`](outbox_core::OutboxStore::claim_batch)) instead on
    /// its first claim and whenever `head_scan_every - 1` claims went by
    /// without a scan; a claim whose successors do not fill the batch is
    /// topped up from every key's head. A key no
    /// worker has in hand waits at most `head_scan_every - 1` more batches
    /// of a worker than it would under a scan on every claim (`1`: scan on
    /// every claim, strict oldest-first across keys). 1..=64.
    pub head_scan_every: u32,
    /// How long shutdown waits for outstanding answers, ms.
    pub shutdown_grace_ms: u64,
    /// How long a batch keeps trying to record the broker's answers (the
    /// receipt transaction, not-sent and unknown reports) while PostgreSQL
    /// fails with a retryable error: a lost connection, a restart or
    /// failover, a serialization failure or deadlock. Waits 50 ms, doubling
    /// to 2 s, between tries. Past it the batch fails and its events are
    /// left to their leases (DISPATCH_UNKNOWN, then the reconciler).
    /// 0..=600000; 0 tries once.
    pub record_retry_ms: u64,
    /// Wake on `NOTIFY outbox_pending` (sent by `emit`).
    pub listen: bool,
    /// The dispatcher alias this instance runs under (PROTOCOL §11). With an
    /// alias, it claims only while the alias names its `implementation`
    /// (checked at most every `poll_interval_ms`); otherwise it idles.
    /// Switching the alias is the rollout's only rollback step.
    pub alias: Option<String>,
    /// This instance's implementation name, e.g. `outbox-rs/0.1.0`.
    pub implementation: String,
    /// Message authentication: with a key, every message carries
    /// `outbox-key-id` and `outbox-signature`, an HMAC-SHA256 of its
    /// `outboxClaims.v1` record ([`outbox_core::trust`]). `None`: unsigned
    /// (the source and the claims digest are still written).
    pub signing: Option<SigningConfig>,
}

/// The dispatcher's signing key (`[dispatch.signing]`, or
/// `OUTBOX_DISPATCH_SIGNING_KEY_ID` and `OUTBOX_DISPATCH_SIGNING_SECRET_HEX`).
/// Its `Debug` never shows the secret.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SigningConfig {
    /// The key id consumers look the verification key up by, e.g. `2026-12`.
    pub key_id: String,
    /// The secret, hex (16..=64 bytes: 32..=128 hex digits).
    pub secret_hex: String,
}

impl std::fmt::Debug for SigningConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningConfig").field("key_id", &self.key_id).field("secret_hex", &"***").finish()
    }
}

impl SigningConfig {
    /// The key, checked.
    pub fn key(&self) -> Result<outbox_core::trust::SigningKey, ProducerError> {
        outbox_core::trust::SigningKey::from_hex(&self.key_id, &self.secret_hex).map_err(|e| ProducerError::Config(format!("dispatch.signing: {e}")))
    }
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        DispatcherConfig {
            name: default_owner_name("dispatcher"),
            workers: DEFAULT_WORKERS,
            batch_size: DEFAULT_BATCH_SIZE,
            lease_ms: DEFAULT_LEASE_MS,
            poll_interval_ms: DEFAULT_POLL_INTERVAL_MS,
            sweep_interval_ms: DEFAULT_SWEEP_INTERVAL_MS,
            head_scan_every: DEFAULT_HEAD_SCAN_EVERY,
            shutdown_grace_ms: DEFAULT_SHUTDOWN_GRACE_MS,
            record_retry_ms: DEFAULT_RECORD_RETRY_MS,
            listen: true,
            alias: None,
            implementation: IMPLEMENTATION.to_owned(),
            signing: None,
        }
    }
}

/// `<prefix>-<host name>-<pid>`: a claim owner that tells hosts apart (in a
/// container every process is pid 1, the host name is the pod's). The host
/// name is reduced to the characters an identifier may hold.
pub fn default_owner_name(prefix: &str) -> String {
    let host = host_name().unwrap_or_else(|| "host".to_owned());
    let host: String = host.chars().filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')).take(100).collect();
    let host = if host.is_empty() { "host".to_owned() } else { host };
    format!("{prefix}-{host}-{}", std::process::id())
}

/// This machine's host name: `HOSTNAME`, else `/proc/sys/kernel/hostname`,
/// else `/etc/hostname`; read once per process (every default config asks).
pub fn host_name() -> Option<String> {
    static NAME: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        let clean = |s: String| Some(s.trim().to_owned()).filter(|s| !s.is_empty());
        std::env::var("HOSTNAME")
            .ok()
            .and_then(clean)
            .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok().and_then(clean))
            .or_else(|| std::fs::read_to_string("/etc/hostname").ok().and_then(clean))
    })
    .clone()
}

fn env_parse<T: std::str::FromStr>(key: &str, into: &mut T) -> Result<(), ProducerError> {
    if let Ok(v) = std::env::var(key) {
        *into = v.trim().parse().map_err(|_| ProducerError::Config(format!("{key}={v:?} is not a valid value")))?;
    }
    Ok(())
}

impl DispatcherConfig {
    /// Reads a TOML file of these fields (unknown keys are an error).
    pub fn from_file(path: &std::path::Path) -> Result<Self, ProducerError> {
        let text = std::fs::read_to_string(path).map_err(|e| ProducerError::Config(format!("{}: {e}", path.display())))?;
        let cfg: DispatcherConfig = toml::from_str(&text).map_err(|e| ProducerError::Config(format!("{}: {e}", path.display())))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Applies `OUTBOX_DISPATCH_NAME`, `_WORKERS`, `_BATCH_SIZE`, `_LEASE_MS`,
    /// `_POLL_INTERVAL_MS`, `_SWEEP_INTERVAL_MS`, `_HEAD_SCAN_EVERY`,
    /// `_SHUTDOWN_GRACE_MS`, `_RECORD_RETRY_MS`, `_LISTEN`, `_ALIAS`, `_IMPLEMENTATION`,
    /// `_SIGNING_KEY_ID` with `_SIGNING_SECRET_HEX` (both or neither).
    pub fn with_env(mut self) -> Result<Self, ProducerError> {
        env_parse("OUTBOX_DISPATCH_NAME", &mut self.name)?;
        env_parse("OUTBOX_DISPATCH_WORKERS", &mut self.workers)?;
        env_parse("OUTBOX_DISPATCH_BATCH_SIZE", &mut self.batch_size)?;
        env_parse("OUTBOX_DISPATCH_LEASE_MS", &mut self.lease_ms)?;
        env_parse("OUTBOX_DISPATCH_POLL_INTERVAL_MS", &mut self.poll_interval_ms)?;
        env_parse("OUTBOX_DISPATCH_SWEEP_INTERVAL_MS", &mut self.sweep_interval_ms)?;
        env_parse("OUTBOX_DISPATCH_HEAD_SCAN_EVERY", &mut self.head_scan_every)?;
        env_parse("OUTBOX_DISPATCH_SHUTDOWN_GRACE_MS", &mut self.shutdown_grace_ms)?;
        env_parse("OUTBOX_DISPATCH_RECORD_RETRY_MS", &mut self.record_retry_ms)?;
        env_parse("OUTBOX_DISPATCH_LISTEN", &mut self.listen)?;
        if let Ok(a) = std::env::var("OUTBOX_DISPATCH_ALIAS") {
            self.alias = Some(a.trim().to_owned()).filter(|a| !a.is_empty());
        }
        env_parse("OUTBOX_DISPATCH_IMPLEMENTATION", &mut self.implementation)?;
        let key_id = std::env::var("OUTBOX_DISPATCH_SIGNING_KEY_ID").ok().filter(|v| !v.trim().is_empty());
        let secret = std::env::var("OUTBOX_DISPATCH_SIGNING_SECRET_HEX").ok().filter(|v| !v.trim().is_empty());
        match (key_id, secret) {
            (Some(key_id), Some(secret_hex)) => self.signing = Some(SigningConfig { key_id: key_id.trim().to_owned(), secret_hex }),
            (None, None) => {}
            _ => return Err(ProducerError::Config("set both OUTBOX_DISPATCH_SIGNING_KEY_ID and OUTBOX_DISPATCH_SIGNING_SECRET_HEX, or neither".into())),
        }
        self.validate()?;
        Ok(self)
    }

    /// Checks every limit.
    pub fn validate(&self) -> Result<(), ProducerError> {
        outbox_core::id::validate_identifier("dispatcher name", &self.name)?;
        outbox_core::id::validate_identifier("dispatcher implementation", &self.implementation)?;
        if let Some(alias) = &self.alias {
            outbox_core::id::validate_identifier("dispatcher alias", alias)?;
        }
        let bad = |m: String| Err(ProducerError::Config(m));
        if !(1..=MAX_WORKERS).contains(&self.workers) {
            return bad(format!("workers = {} (1..={MAX_WORKERS})", self.workers));
        }
        if !(1..=MAX_CLAIM_BATCH).contains(&self.batch_size) {
            return bad(format!("batch_size = {} (1..={MAX_CLAIM_BATCH})", self.batch_size));
        }
        if !(MIN_LEASE_MS..=MAX_LEASE_MS).contains(&self.lease_ms) {
            return bad(format!("lease_ms = {} ({MIN_LEASE_MS}..={MAX_LEASE_MS})", self.lease_ms));
        }
        if !(1..=MAX_HEAD_SCAN_EVERY).contains(&self.head_scan_every) {
            return bad(format!("head_scan_every = {} (1..={MAX_HEAD_SCAN_EVERY})", self.head_scan_every));
        }
        if !(10..=600_000).contains(&self.poll_interval_ms) || !(10..=600_000).contains(&self.sweep_interval_ms) {
            return bad("poll_interval_ms and sweep_interval_ms must be within 10..=600000".into());
        }
        if self.record_retry_ms > MAX_RECORD_RETRY_MS {
            return bad(format!("record_retry_ms = {} (0..={MAX_RECORD_RETRY_MS})", self.record_retry_ms));
        }
        if let Some(s) = &self.signing {
            s.key()?;
        }
        Ok(())
    }

    fn owner(&self, worker: usize) -> String {
        format!("{}-{worker}", self.name)
    }
}

/// Counters an operator looks at. Exported as Prometheus metrics by the CLI.
#[derive(Debug, Default)]
pub struct DispatchMetrics {
    /// Events claimed.
    pub claimed: AtomicU64,
    /// Sends started.
    pub sent: AtomicU64,
    /// Events that became PUBLISHED through this dispatcher's receipts.
    pub published: AtomicU64,
    /// Receipts kept as duplicate transport receipts.
    pub duplicates: AtomicU64,
    /// Attempts whose outcome is unknown.
    pub unknown: AtomicU64,
    /// Attempts the broker definitely did not persist.
    pub not_sent: AtomicU64,
    /// Events or receipts quarantined.
    pub quarantined: AtomicU64,
    /// Writes refused because the claim was taken over.
    pub fenced: AtomicU64,
    /// Retryable database errors a settling batch rode out: a recording of
    /// broker answers tried again, or a lease renewal skipped.
    pub store_retries: AtomicU64,
    /// ACKs that arrived after their claim's lease had run out (by the
    /// store's clock; a renewal that found the claim gone counts as run
    /// out): recorded through acceptDispatchReceipt like any other, since
    /// a claim decides who may send, not what happened.
    pub late_acks: AtomicU64,
    /// Batches settled.
    pub batches: AtomicU64,
    /// Sum of batch latencies, ms (with `batches`, the mean).
    pub batch_ms_total: AtomicU64,
    /// Slowest batch, ms.
    pub batch_ms_max: AtomicU64,
    /// Claims that scanned every ordering chain's head.
    pub head_scans: AtomicU64,
    /// Claims of the successors of just-published events.
    pub successor_claims: AtomicU64,
    /// Age of the oldest PENDING event at the last sweep, ms.
    pub oldest_pending_age_ms: AtomicU64,
    /// Rows waiting for a dispatcher that this one refuses because their
    /// protocol version is newer than it understands, at the last sweep.
    pub refused_protocol_rows: AtomicU64,
    /// 1 while this dispatcher may claim (no alias, or its alias names its
    /// implementation), 0 while it idles.
    pub alias_active: AtomicU64,
    /// How far this dispatcher's clock is ahead of PostgreSQL's, ms
    /// (negative: behind), at the last check ([`PgStore::clock_skew_ms`]).
    pub clock_skew_ms: AtomicI64,
    /// Duration histograms (commit -> PUBLISHED, claim, send, receipt
    /// transaction, batch), for Prometheus.
    pub histograms: crate::observe::DispatchHistograms,
    /// 1 while the claim gate ([`Dispatcher::with_claim_gate`]) holds claims
    /// back (the producer cannot deliver), 0 otherwise.
    pub claims_paused: AtomicU64,
    /// When a worker last completed a claim or renewed its leases, ms since
    /// the epoch (0: not yet): a readiness check sees a stuck dispatcher.
    pub last_progress_ms: AtomicI64,
}

/// A check run before every claim: `Err(why)` holds claims back (see
/// [`Dispatcher::with_claim_gate`]).
pub type ClaimGate = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

struct Gate(Option<ClaimGate>);

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Gate(set)" } else { "Gate(none)" })
    }
}

/// A database failure the same call may get past (a lost connection, a
/// restart, a serialization failure); not a protocol refusal.
fn is_retryable_backend(e: &StoreError) -> bool {
    matches!(e, StoreError::Backend { retryable: true, .. })
}

fn inc(c: &AtomicU64, n: u64) {
    c.fetch_add(n, AtomicOrdering::Relaxed);
}

/// What one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchReport {
    /// Claimed.
    pub claimed: usize,
    /// Sends started.
    pub sent: usize,
    /// Filled the slot.
    pub published: usize,
    /// Kept as duplicate transport receipts (or already accepted).
    pub duplicates: usize,
    /// Became DISPATCH_UNKNOWN.
    pub unknown: usize,
    /// Not persisted: eligible again.
    pub not_sent: usize,
    /// Quarantined (tampered before send, or divergent receipt).
    pub quarantined: usize,
    /// Fenced writes.
    pub fenced: usize,
}

/// Sends started by [`Dispatcher::claim_and_send`], waiting to be settled.
#[derive(Debug)]
pub struct InFlightBatch {
    owner: String,
    started: Instant,
    report: BatchReport,
    sends: Vec<(ClaimedEvent, AttemptRecord, JoinHandle<SendOutcome>)>,
}

impl InFlightBatch {
    /// Number of sends in flight.
    pub fn len(&self) -> usize {
        self.sends.len()
    }

    /// Whether nothing is in flight.
    pub fn is_empty(&self) -> bool {
        self.sends.is_empty()
    }

    /// The attempts in flight.
    pub fn attempts(&self) -> impl Iterator<Item = &AttemptRecord> {
        self.sends.iter().map(|(_, a, _)| a)
    }
}

/// Where a worker's next claim looks: the events its last batch published
/// (their keys' next events come first) and how many claims ago it last
/// scanned every key's head. See [`DispatcherConfig::head_scan_every`].
#[derive(Debug, Clone, Default)]
pub struct ClaimCursor {
    published: Vec<outbox_core::EventId>,
    since_scan: u32,
}

impl ClaimCursor {
    /// The events the last batch published, in receipt order.
    pub fn last_published(&self) -> &[outbox_core::EventId] {
        &self.published
    }
}

/// The dispatcher service.
#[derive(Debug)]
pub struct Dispatcher<B: Broker + 'static, S: ServiceStore = PgStore> {
    store: S,
    broker: Arc<B>,
    config: DispatcherConfig,
    metrics: Arc<DispatchMetrics>,
    /// When the alias was last read, and whether it named this implementation.
    alias_checked: std::sync::Mutex<Option<(Instant, bool)>>,
    /// Held while claiming (see [`Dispatcher::claim`]).
    claim_turn: tokio::sync::Mutex<()>,
    /// Checked before each claim.
    gate: Gate,
    /// [`DispatcherConfig::signing`], parsed.
    signer: Option<outbox_core::trust::SigningKey>,
}

/// Hands `message` to the broker client only while `deadline` (the claim's
/// lease, measured locally) has not passed; past it, the message is not
/// sent at all: a stalled worker whose lease ran out (its registration's
/// answer came late, the process was paused) never sends, so an absence
/// proof made after the lease plus the in-flight bound holds.
async fn send_before<B: Broker + ?Sized>(broker: Arc<B>, message: OutgoingMessage, deadline: Instant) -> SendOutcome {
    let now = Instant::now();
    if now >= deadline && !outbox_core::simulation::mutation_active("send-after-lease") {
        tracing::warn!(late_ms = now.duration_since(deadline).as_millis() as u64, "lease ran out before the send: not sent");
        return SendOutcome::NotPersisted("the claim's lease ran out before the message was handed to the client".into());
    }
    broker.send(message).await
}

/// The W3C `tracestate` header, sent with `traceparent` when one was recorded at emit.
pub const TRACESTATE_HEADER: &str = "tracestate";

/// Builds the message for one attempt of one claimed event: the outbox
/// headers, then the CloudEvents headers when its route generation has them on.
pub fn outgoing_message(event: &ClaimedEvent, attempt: &AttemptRecord) -> OutgoingMessage {
    outgoing_message_signed(event, attempt, None)
}

/// [`outgoing_message`], plus the source and claims digest (when the store
/// knows its source) and, with `key`, the signature ([`outbox_core::trust::seal`]).
pub fn outgoing_message_signed(event: &ClaimedEvent, attempt: &AttemptRecord, key: Option<&outbox_core::trust::SigningKey>) -> OutgoingMessage {
    let mut headers = headers::build(&event.envelope, &event.destination, &event.destination_digest, &attempt.attempt_id, event.traceparent.as_deref());
    if let Some(source) = &event.source {
        if let Err(e) = outbox_core::trust::seal(&mut headers, source, key) {
            // Unreachable: `build` writes every covered header.
            tracing::error!(event_id = %event.envelope.event_id, error = %e, "could not seal the message claims");
        }
    }
    if let Some(binding) = &event.cloudevents {
        headers.extend(headers::cloudevents(&event.envelope, binding));
    }
    if let (Some(_), Some(ts)) = (&event.traceparent, &event.tracestate) {
        headers.push((TRACESTATE_HEADER.into(), ts.as_bytes().to_vec()));
    }
    OutgoingMessage {
        topic: event.destination.topic.clone(),
        partition: event.destination.partition,
        key: event.destination.routing_key.as_bytes().to_vec(),
        payload: event.payload.clone(),
        headers,
    }
}

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
            claim_turn: tokio::sync::Mutex::new(()),
            gate: Gate(None),
            signer,
        })
    }

    /// Holds claims back while `gate` answers `Err(why)`, e.g. while the
    /// Kafka producer cannot deliver ([`crate::kafka::KafkaBroker::ready`]):
    /// events stay PENDING instead of spending attempts on a producer that
    /// is being rebuilt. Sends already started are settled as usual.
    pub fn with_claim_gate(mut self, gate: ClaimGate) -> Self {
        self.gate = Gate(Some(gate));
        self
    }

    /// Whether the claim gate lets claims through; logs each change.
    fn gate_open(&self) -> bool {
        let verdict = self.gate.0.as_ref().map(|g| g()).unwrap_or(Ok(()));
        let paused = u64::from(verdict.is_err());
        if self.metrics.claims_paused.swap(paused, AtomicOrdering::Relaxed) != paused {
            match &verdict {
                Err(why) => tracing::warn!(reason = %why, "claims paused: the producer cannot deliver"),
                Ok(()) => tracing::info!("claims resumed"),
            }
        }
        verdict.is_ok()
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

    /// Whether this dispatcher may claim now: no alias configured, or the
    /// alias currently names this implementation. Read from the database at
    /// most every `poll_interval_ms`; an alias never set means idle.
    pub async fn alias_active(&self) -> Result<bool, ProducerError> {
        let Some(alias) = &self.config.alias else {
            self.metrics.alias_active.store(1, AtomicOrdering::Relaxed);
            return Ok(true);
        };
        let fresh_for = Duration::from_millis(self.config.poll_interval_ms);
        let cached = *self.alias_checked.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, active)) = cached.filter(|(at, _)| at.elapsed() < fresh_for) {
            return Ok(active);
        }
        let current = self.store.current_alias(alias).await?;
        let active = current.as_ref().is_some_and(|a| a.implementation == self.config.implementation);
        if cached.map(|(_, was)| was) != Some(active) {
            let now_serving = current.as_ref().map(|a| a.implementation.as_str()).unwrap_or("nobody");
            tracing::info!(%alias, implementation = %self.config.implementation, now_serving, active, "dispatcher alias checked");
        }
        *self.alias_checked.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), active));
        self.metrics.alias_active.store(u64::from(active), AtomicOrdering::Relaxed);
        Ok(active)
    }

    /// Step 1: claim a batch as `owner`, verify, register attempts and start
    /// the sends. Claims nothing while [`Dispatcher::alias_active`] is false.
    pub async fn claim_and_send(&self, owner: &str) -> Result<InFlightBatch, ProducerError> {
        self.claim_and_send_from(owner, &mut ClaimCursor::default()).await
    }

    async fn claim_and_send_from(&self, owner: &str, cursor: &mut ClaimCursor) -> Result<InFlightBatch, ProducerError> {
        let mut report = BatchReport::default();
        let started = Instant::now();
        if !self.alias_active().await? || !self.gate_open() {
            self.metrics.last_progress_ms.store(outbox_core::SystemClock.now_ms(), AtomicOrdering::Relaxed);
            return Ok(InFlightBatch { owner: owner.to_owned(), started, report, sends: Vec::new() });
        }
        let (claimed, unreadable) = self.claim(owner, cursor).await?;
        self.metrics.last_progress_ms.store(outbox_core::SystemClock.now_ms(), AtomicOrdering::Relaxed);
        report.claimed = claimed.len() + unreadable;
        report.quarantined += unreadable;
        inc(&self.metrics.quarantined, unreadable as u64);
        inc(&self.metrics.claimed, claimed.len() as u64);

        // Never send bytes or a destination that no longer match what was frozen.
        let mut verified = Vec::with_capacity(claimed.len());
        for ev in claimed {
            if let Err(evidence) = ev.verify_before_send() {
                tracing::error!(event_id = %ev.envelope.event_id, %evidence, "stored event no longer matches its digests: quarantined, not sent");
                if self.store.quarantine_claimed(&ev.token, "stored_payload_or_destination_diverged", evidence).await? == FenceOutcome::Applied {
                    report.quarantined += 1;
                    inc(&self.metrics.quarantined, 1);
                }
                continue;
            }
            verified.push(ev);
        }

        let tokens: Vec<_> = verified.iter().map(|e| e.token.clone()).collect();
        let registered = match self.store.register_attempts(&tokens).await {
            Ok(r) => r,
            Err(e) => match self.registered_after_all(&tokens, &e).await {
                Some(r) => r,
                None => {
                    // Nothing was sent: give the claims back rather than leave
                    // them to their leases (best effort; the sweeper is the backstop).
                    for t in &tokens {
                        if let Err(re) = self.store.release(t).await {
                            tracing::debug!(event_id = %t.event_id, error = %re, "release after a failed registration");
                        }
                    }
                    return Err(e.into());
                }
            },
        };
        // A local, monotonic deadline per claim for handing its message to
        // the client: what is left of its lease by the store's clock (the
        // clock that computed the lease end), from now on. A registration
        // whose answer came late leaves little or nothing.
        let (now_ms, now) = (self.store.now_ms(), Instant::now());
        let mut sends = Vec::with_capacity(verified.len());
        for (ev, reg) in verified.into_iter().zip(registered) {
            match reg {
                Ok(attempt) => {
                    let send_deadline = now + Duration::from_millis(ev.token.lease_until_ms.saturating_sub(now_ms).max(0) as u64);
                    let message = outgoing_message_signed(&ev, &attempt, self.signer.as_ref());
                    let broker = self.broker.clone();
                    let span = tracing::info_span!("outbox_send", event_id = %ev.envelope.event_id, attempt_id = %attempt.attempt_id,
                        topic = %ev.destination.topic, partition = ev.destination.partition);
                    // The send belongs to the trace that emitted the event.
                    crate::otel::follow_traceparent(&span, ev.traceparent.as_deref(), ev.tracestate.as_deref());
                    let metrics = self.metrics.clone();
                    let (topic, event_type) = (ev.destination.topic.clone(), ev.envelope.event_type.clone());
                    let handle = tokio::spawn(
                        async move {
                            let at = Instant::now();
                            let outcome = send_before(broker, message, send_deadline).await;
                            metrics.histograms.sent(&topic, &event_type, at.elapsed());
                            outcome
                        }
                        .instrument(span),
                    );
                    sends.push((ev, attempt, handle));
                }
                Err(e) if e.is_fenced() => {
                    report.fenced += 1;
                    inc(&self.metrics.fenced, 1);
                    tracing::info!(event_id = %ev.envelope.event_id, "claim lost before sending: not sent");
                }
                // Sends of this batch may have started: their answers must
                // still be settled, so an unexpected refusal only skips
                // its own event (its claim runs out with its lease).
                Err(e) => tracing::error!(event_id = %ev.envelope.event_id, error = %e, "attempt not registered: not sent"),
            }
        }
        report.sent = sends.len();
        inc(&self.metrics.sent, sends.len() as u64);
        Ok(InFlightBatch { owner: owner.to_owned(), started, report, sends })
    }

    /// After the registration of `tokens` failed with `error`: where the
    /// connection broke, the commit may have gone through before its answer
    /// was lost. One transaction registers the whole batch, so either every
    /// attempt it could make is there (`Some`: those are sent; the other
    /// tokens were refused by it) or none is (`None`: nothing was registered).
    async fn registered_after_all(&self, tokens: &[ClaimToken], error: &StoreError) -> Option<Vec<Result<AttemptRecord, StoreError>>> {
        if !is_retryable_backend(error) {
            return None;
        }
        let found = match self.through_db_errors("registered_attempts", || self.store.registered_attempts(tokens)).await {
            Ok(found) if !found.is_empty() => found,
            Ok(_) => return None,
            Err(e) => {
                tracing::warn!(error = %e, "could not learn whether a failed registration committed; its claims run out with their leases");
                return None;
            }
        };
        tracing::warn!(registered = found.len(), error = %error, "registration committed although its answer was lost; sending its attempts");
        let mut by_event: HashMap<EventId, AttemptRecord> = found.into_iter().map(|a| (a.event_id.clone(), a)).collect();
        Some(
            tokens
                .iter()
                .map(|t| {
                    by_event.remove(&t.event_id).ok_or_else(|| StoreError::Backend {
                        message: format!("the registration that committed refused {}", t.event_id),
                        retryable: false,
                    })
                })
                .collect(),
        )
    }

    /// Claims up to a batch, in one transaction: retries first, then the
    /// successors of what the cursor's last batch published, then (on a full
    /// claim, see [`DispatcherConfig::head_scan_every`]) every key's head. One claim at a time
    /// per instance: two claims running together would scan the same key
    /// heads, and each would keep the rows the other had just claimed locked
    /// until it commits, stalling their registration.
    async fn claim(&self, owner: &str, cursor: &mut ClaimCursor) -> Result<(Vec<ClaimedEvent>, usize), ProducerError> {
        let (batch, lease) = (self.config.batch_size, self.config.lease_ms);
        let after = std::mem::take(&mut cursor.published);
        let scan_due = after.is_empty() || cursor.since_scan.saturating_add(1) >= self.config.head_scan_every;
        let _turn = self.claim_turn.lock().await;
        let at = Instant::now();
        let round = self.store.claim_next(owner, &after, scan_due, batch, lease).await?;
        self.metrics.histograms.claim.observe(at.elapsed().as_secs_f64());
        if round.successor_claim {
            inc(&self.metrics.successor_claims, 1);
        }
        if round.head_scan {
            inc(&self.metrics.head_scans, 1);
            cursor.since_scan = 0;
        } else {
            cursor.since_scan = cursor.since_scan.saturating_add(1);
        }
        Ok((round.claimed, round.quarantined))
    }

    /// Step 2: wait for every answer of the batch and record it.
    pub async fn settle(&self, batch: InFlightBatch) -> Result<BatchReport, ProducerError> {
        self.settle_into(batch, &mut ClaimCursor::default()).await
    }

    /// [`Dispatcher::settle`], noting in `cursor` the events it published.
    async fn settle_into(&self, batch: InFlightBatch, cursor: &mut ClaimCursor) -> Result<BatchReport, ProducerError> {
        let InFlightBatch { owner, started, mut report, sends } = batch;
        let renew_every = Duration::from_millis((self.config.lease_ms / 2).max(1) as u64);
        let mut tokens: Vec<Option<outbox_core::ClaimToken>> = sends.iter().map(|(ev, ..)| Some(ev.token.clone())).collect();
        // Each send's lease as last granted or renewed (store clock, ms);
        // i64::MIN once a renewal found the claim gone.
        let mut lease_until: Vec<i64> = sends.iter().map(|(ev, ..)| ev.token.lease_until_ms).collect();
        // Whether each answer arrived after its lease ran out.
        let mut late: Vec<bool> = vec![false; sends.len()];
        let mut pending: FuturesUnordered<_> = sends
            .into_iter()
            .enumerate()
            .map(|(i, (ev, attempt, handle))| async move {
                let outcome = handle.await.unwrap_or_else(|e| SendOutcome::Unknown(format!("send task failed: {e}")));
                (i, ev, attempt, outcome)
            })
            .collect();
        let mut results = Vec::with_capacity(pending.len());
        let mut next_renewal = tokio::time::Instant::now() + renew_every;
        loop {
            tokio::select! {
                biased;
                next = pending.next() => match next {
                    Some(r) => {
                        tokens[r.0] = None;
                        late[r.0] = lease_until[r.0] < self.store.now_ms();
                        results.push(r);
                    }
                    None => break,
                },
                _ = tokio::time::sleep_until(next_renewal) => {
                    // A long batch keeps its claims alive while answers are outstanding.
                    let (which, outstanding): (Vec<usize>, Vec<_>) = tokens.iter().enumerate().filter_map(|(i, t)| t.clone().map(|t| (i, t))).unzip();
                    match self.store.renew_leases(&outstanding, self.config.lease_ms).await {
                        Ok(renewed) => {
                            self.metrics.last_progress_ms.store(outbox_core::SystemClock.now_ms(), AtomicOrdering::Relaxed);
                            for (&i, r) in which.iter().zip(&renewed) {
                                lease_until[i] = r.unwrap_or(i64::MIN);
                            }
                            let lost = renewed.iter().filter(|r| r.is_none()).count();
                            if lost > 0 {
                                tracing::warn!(owner = %owner, lost, "claims lost while sends were outstanding; their answers still go through acceptDispatchReceipt");
                            }
                            next_renewal = tokio::time::Instant::now() + renew_every;
                        }
                        // The sends are out: their answers must still be
                        // recorded, whatever becomes of the leases. A lease
                        // that runs out turns its event DISPATCH_UNKNOWN
                        // (the sweeper), and an ACK of this batch still
                        // publishes it through acceptDispatchReceipt.
                        Err(e) => {
                            inc(&self.metrics.store_retries, 1);
                            tracing::warn!(owner = %owner, error = %e, "lease renewal failed while sends were outstanding; trying again soon");
                            // An eighth of the lease, at most 2 s.
                            next_renewal = tokio::time::Instant::now() + (renew_every / 4).min(RECORD_RETRY_MAX_WAIT);
                        }
                    }
                }
            }
        }

        let cluster_id = self.broker.cluster_id().to_owned();
        let mut receipts: Vec<BrokerReceipt> = Vec::new();
        let mut receipt_types: Vec<&str> = Vec::new();
        let mut reports = Vec::new();
        for (i, ev, attempt, outcome) in &results {
            match outcome {
                SendOutcome::Acked { partition, offset } => {
                    if late[*i] {
                        inc(&self.metrics.late_acks, 1);
                        tracing::info!(event_id = %ev.envelope.event_id, attempt_id = %attempt.attempt_id, "ACK after the claim's lease ran out: recorded like any other");
                        if outbox_core::simulation::mutation_active("late-acks-dropped") {
                            continue;
                        }
                    }
                    receipt_types.push(ev.envelope.event_type.as_str());
                    receipts.push(BrokerReceipt {
                    event_id: ev.envelope.event_id.clone(),
                    envelope_generation: ev.envelope.envelope_generation,
                    attempt_id: attempt.attempt_id.clone(),
                    // The bytes sent were checked against this digest before the send.
                    payload_digest: ev.envelope.payload_digest.clone(),
                    destination_digest: ev.destination_digest.clone(),
                    cluster_id: cluster_id.clone(),
                    topic: ev.destination.topic.clone(),
                    // The log position's identity is the topic id the frozen
                    // destination names (the adapter refused the send if the
                    // topic now has another).
                    topic_id: ev.destination.topic_id.clone(),
                    partition: *partition,
                    offset: *offset,
                    });
                }
                SendOutcome::NotPersisted(why) => reports.push((ev, attempt, false, why)),
                SendOutcome::Unknown(why) => reports.push((ev, attempt, true, why)),
            }
        }

        // Every answer is recorded even when another one fails: the first
        // failure is returned after the rest were tried.
        let mut failed: Option<StoreError> = None;
        cursor.published.clear();
        let receipts_at = Instant::now();
        let accepted = self.through_db_errors("accept_dispatch_receipts", || self.store.accept_dispatch_receipts(&receipts)).await;
        if !receipts.is_empty() {
            self.metrics.histograms.receipt_transaction.observe(receipts_at.elapsed().as_secs_f64());
        }
        let published_at_ms = outbox_core::SystemClock.now_ms();
        match accepted {
            Ok(outcomes) => {
                for ((outcome, receipt), event_type) in outcomes.into_iter().zip(&receipts).zip(&receipt_types) {
                    match outcome.decision {
                        ReceiptDecision::Accept { .. } => {
                            self.metrics.histograms.published(&receipt.topic, event_type, published_at_ms - receipt.event_id.unix_ms() as i64);
                            cursor.published.push(receipt.event_id.clone());
                            report.published += 1;
                            inc(&self.metrics.published, 1);
                        }
                        ReceiptDecision::AlreadyAccepted | ReceiptDecision::Duplicate => {
                            report.duplicates += 1;
                            inc(&self.metrics.duplicates, 1);
                        }
                        ReceiptDecision::Quarantine { .. } => {
                            report.quarantined += 1;
                            inc(&self.metrics.quarantined, 1);
                        }
                        ReceiptDecision::Reject { reason } => tracing::error!(?reason, "own receipt rejected by acceptDispatchReceipt"),
                    }
                }
            }
            Err(e) => {
                tracing::error!(owner = %owner, receipts = receipts.len(), error = %e,
                    "receipts not recorded; their events wait for their leases to expire (DISPATCH_UNKNOWN) and the reconciler");
                failed = Some(e);
            }
        }
        for (ev, attempt, unknown, why) in reports {
            let recorded = if unknown {
                tracing::warn!(event_id = %ev.envelope.event_id, attempt_id = %attempt.attempt_id, reason = %why, "dispatch outcome unknown");
                self.through_db_errors("report_unknown", || self.store.report_unknown(&ev.token, &attempt.attempt_id, why)).await
            } else {
                self.through_db_errors("report_not_sent", || self.store.report_not_sent(&ev.token, &attempt.attempt_id, why)).await
            };
            match recorded {
                Ok(outcome) if unknown => self.tally(outcome, &mut report, |r| &mut r.unknown, &self.metrics.unknown),
                Ok(outcome) => self.tally(outcome, &mut report, |r| &mut r.not_sent, &self.metrics.not_sent),
                Err(e) => {
                    tracing::error!(event_id = %ev.envelope.event_id, error = %e, "outcome not recorded; the event waits for its lease to expire");
                    failed.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failed {
            return Err(e.into());
        }
        let ms = started.elapsed().as_millis() as u64;
        inc(&self.metrics.batches, 1);
        inc(&self.metrics.batch_ms_total, ms);
        self.metrics.batch_ms_max.fetch_max(ms, AtomicOrdering::Relaxed);
        self.metrics.histograms.batch.observe(started.elapsed().as_secs_f64());
        if report.claimed > 0 {
            tracing::debug!(owner = %owner, ?report, batch_ms = ms, "batch settled");
        }
        Ok(report)
    }

    /// Runs `call`, and again after each retryable database error (lost
    /// connection, restart, serialization failure, deadlock), waiting 50 ms
    /// doubling to 2 s, for at most [`DispatcherConfig::record_retry_ms`]:
    /// answers the broker already gave are not dropped because PostgreSQL
    /// blinked. Each call made through it is a read or safe to repeat when
    /// its first commit went through unseen (the
    /// connection broke before the answer): the receipt is then already
    /// accepted (counted as a duplicate), and the report finds its claim
    /// released and changes nothing (counted, and audited, as fenced).
    async fn through_db_errors<T, F, Fut>(&self, what: &'static str, mut call: F) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        let deadline = Instant::now() + Duration::from_millis(self.config.record_retry_ms);
        let mut wait = RECORD_RETRY_FIRST_WAIT;
        loop {
            match call().await {
                Err(e) if is_retryable_backend(&e) && Instant::now() + wait <= deadline => {
                    inc(&self.metrics.store_retries, 1);
                    tracing::warn!(what, error = %e, retry_in_ms = wait.as_millis() as u64, "database call failed; trying again");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(RECORD_RETRY_MAX_WAIT);
                }
                other => return other,
            }
        }
    }

    /// Counts one fenced report: under `applied` when it changed the row, as
    /// fenced when the claim had gone stale, not at all for a no-op.
    fn tally(&self, outcome: FenceOutcome, report: &mut BatchReport, applied: impl FnOnce(&mut BatchReport) -> &mut usize, metric: &AtomicU64) {
        match outcome {
            FenceOutcome::Applied => {
                *applied(report) += 1;
                inc(metric, 1);
            }
            FenceOutcome::Fenced => {
                report.fenced += 1;
                inc(&self.metrics.fenced, 1);
            }
            FenceOutcome::NoOp => {}
        }
    }

    /// One batch, both steps, with a full claim (every key's head).
    pub async fn dispatch_once(&self, owner: &str) -> Result<BatchReport, ProducerError> {
        self.dispatch_next(owner, &mut ClaimCursor::default()).await
    }

    /// One batch, both steps, as a worker runs them: the claim starts from
    /// `cursor` (the successors of the events the previous batch published,
    /// and a scan of every key's head when one is due), and the cursor
    /// then holds the events this batch published.
    pub async fn dispatch_next(&self, owner: &str, cursor: &mut ClaimCursor) -> Result<BatchReport, ProducerError> {
        let batch = self.claim_and_send_from(owner, cursor).await?;
        self.settle_into(batch, cursor).await
    }

    /// Runs the workers, the lease sweeper and the LISTEN wake-up until
    /// `shutdown` resolves (the same shape as `Reconciler::run` and
    /// `IdempotentConsumer::run`: e.g. `async { let _ = tokio::signal::ctrl_c().await; }`);
    /// then stops claiming, drains outstanding answers (bounded by
    /// `shutdown_grace_ms`) and returns the totals. A `watch::Receiver<bool>`
    /// becomes a shutdown future with [`until_true`].
    pub async fn run(self: Arc<Self>, shutdown: impl std::future::Future<Output = ()> + Send) -> Result<BatchReport, ProducerError> {
        let (stop_tx, stop_rx) = watch::channel(false);
        let run = self.run_with(stop_rx);
        let mut run = std::pin::pin!(run);
        let mut shutdown = std::pin::pin!(shutdown);
        tokio::select! {
            biased;
            r = &mut run => return r,
            () = &mut shutdown => {}
        }
        let _ = stop_tx.send(true);
        run.await
    }

    /// [`Dispatcher::run`] until `shutdown` becomes true.
    #[deprecated(note = "use `run(shutdown_future)`; `outbox_producer::until_true(rx)` turns a watch::Receiver<bool> into one")]
    pub async fn run_watch(self: Arc<Self>, shutdown: watch::Receiver<bool>) -> Result<BatchReport, ProducerError> {
        self.run_with(shutdown).await
    }

    async fn run_with(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) -> Result<BatchReport, ProducerError> {
        let wake = Arc::new(Notify::new());
        // Owned by this future: dropping it (a cancelled run) stops every task.
        let mut tasks = tokio::task::JoinSet::new();
        if self.config.listen {
            let me = self.clone();
            let wake = wake.clone();
            let mut stop = shutdown.clone();
            tasks.spawn(async move {
                let mut listener = match me.store.listen().await {
                    Ok(Some(l)) => l,
                    Ok(None) => return Ok(BatchReport::default()),
                    Err(e) => {
                        tracing::warn!(error = %e, "LISTEN unavailable; polling only");
                        return Ok(BatchReport::default());
                    }
                };
                loop {
                    tokio::select! {
                        biased;
                        n = listener.next() => match n {
                            Ok(Notice::Committed) => wake.notify_waiters(),
                            // The session was lost (a restart, a failover, a
                            // killed backend) and another one listens now.
                            // What was notified meanwhile went to the lost
                            // session: the workers look once.
                            Ok(Notice::Replaced) => {
                                tracing::warn!("LISTEN session lost and replaced; looking for work committed meanwhile");
                                wake.notify_waiters();
                            }
                            // Not even replaced yet: the next try_recv
                            // connects again; meanwhile the workers look
                            // once a second.
                            Err(e) => {
                                tracing::warn!(error = %e, "LISTEN session lost; polling until it is back");
                                tokio::time::sleep(Duration::from_secs(1)).await;
                                wake.notify_waiters();
                            }
                        },
                        _ = stop.changed() => return Ok(BatchReport::default()),
                    }
                }
            });
        }
        {
            let me = self.clone();
            let stop = shutdown.clone();
            tasks.spawn(async move {
                let sweeper = LeaseSweeper::new(&me.store, Duration::from_millis(me.config.sweep_interval_ms), me.config.lease_ms);
                sweeper
                    .run(until_true(stop), |sweep| {
                        if let Some(age) = sweep.oldest_pending_age_ms {
                            me.metrics.oldest_pending_age_ms.store(age.unwrap_or(0).max(0) as u64, AtomicOrdering::Relaxed);
                        }
                        if let Some(skew) = sweep.clock_skew_ms {
                            me.metrics.clock_skew_ms.store(skew, AtomicOrdering::Relaxed);
                        }
                        if let Some(refused) = sweep.rows_beyond_protocol {
                            me.metrics.refused_protocol_rows.store(refused.max(0) as u64, AtomicOrdering::Relaxed);
                        }
                    })
                    .await;
                Ok(BatchReport::default())
            });
        }
        for w in 0..self.config.workers {
            let me = self.clone();
            let wake = wake.clone();
            let mut stop = shutdown.clone();
            let owner = self.config.owner(w);
            tasks.spawn(
                async move {
                    let mut total = BatchReport::default();
                    let mut cursor = ClaimCursor::default();
                    let poll = Duration::from_millis(me.config.poll_interval_ms);
                    while !*stop.borrow() {
                        // Registered before the claim: a commit notified while
                        // the claim runs (after its statements took their
                        // snapshots, or after it linked the new chains) wakes
                        // the wait below instead of going to no waiter.
                        let notified = wake.notified();
                        tokio::pin!(notified);
                        notified.as_mut().enable();
                        match me.dispatch_next(&owner, &mut cursor).await {
                            Ok(r) => {
                                total += r;
                                // A batch that found work and met no broker failure
                                // looks again at once: under per-key ordering a short
                                // batch does not mean the backlog is empty, only that
                                // the other heads were still in flight, and their
                                // receipts free the next ones. An empty claim, or
                                // sends the broker did not take (it may be down),
                                // wait for a wake-up or the poll interval.
                                if r.claimed > 0 && r.not_sent == 0 && r.unknown == 0 {
                                    continue;
                                }
                            }
                            Err(e) => tracing::warn!(error = %e, retryable = e.is_retryable(), "batch failed"),
                        }
                        tokio::select! {
                            biased;
                            _ = notified => {}
                            _ = tokio::time::sleep(poll) => {}
                            _ = stop.changed() => {}
                        }
                    }
                    Ok::<_, ProducerError>(total)
                }
                .instrument(tracing::info_span!("worker", worker = w)),
            );
        }
        while !*shutdown.borrow() {
            if shutdown.changed().await.is_err() {
                break;
            }
        }
        tracing::info!("dispatcher stopping: no new claims; draining outstanding answers");
        let grace = Duration::from_millis(self.config.shutdown_grace_ms);
        let mut total = BatchReport::default();
        let drained = tokio::time::timeout(grace, async {
            while let Some(r) = tasks.join_next().await {
                if let Ok(Ok(r)) = r {
                    total += r;
                }
            }
        })
        .await;
        if drained.is_err() {
            tracing::warn!("shutdown grace elapsed; unanswered attempts will turn DISPATCH_UNKNOWN when their leases expire");
        }
        Ok(total)
    }
}

/// A shutdown future for [`Dispatcher::run`] (or `Reconciler::run`, or the
/// consumer's `run`) that resolves once `rx` holds `true` or its sender is
/// dropped.
pub async fn until_true(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

/// Totals over batches.
impl std::ops::AddAssign for BatchReport {
    fn add_assign(&mut self, r: BatchReport) {
        self.claimed += r.claimed;
        self.sent += r.sent;
        self.published += r.published;
        self.duplicates += r.duplicates;
        self.unknown += r.unknown;
        self.not_sent += r.not_sent;
        self.quarantined += r.quarantined;
        self.fenced += r.fenced;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_owner_names_the_host() {
        let host = host_name().expect("a host name");
        let name = DispatcherConfig::default().name;
        let expected_host: String = host.chars().filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')).collect();
        assert!(name.starts_with(&format!("dispatcher-{expected_host}-")), "{name} should carry the host name {host}");
        assert!(name.ends_with(&format!("-{}", std::process::id())), "{name}");
        outbox_core::id::validate_identifier("dispatcher name", &name).expect("a valid identifier");
        assert!(crate::ReconcilerConfig::default().owner.starts_with(&format!("reconciler-{expected_host}-")));
    }
}
