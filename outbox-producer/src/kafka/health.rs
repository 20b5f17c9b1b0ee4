//! The producer's health: what its delivery reports and errors tell
//! ([`ProducerHealth`]), the probe of the cluster, and the supervision that
//! rebuilds a producer that cannot deliver ([`SupervisionStep`]).

use outbox_core::Clock as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox_core::SendOutcome;
use rdkafka::error::RDKafkaErrorCode;
use tracing::{error, warn};

use super::delivery::Inner;
use super::error::{redact_text, KafkaAdapterError};
use super::{lock, KafkaBroker};
#[cfg(doc)]
use super::settings::KafkaConfig;

/// What the delivery callbacks tell about the producer's ability to
/// deliver, shared by every producer the adapter builds.
#[derive(Debug, Default)]
pub(super) struct HealthState {
    /// When the last message was acknowledged, ms since the epoch (0: never).
    last_ack_ms: AtomicI64,
    /// When the oldest send not followed by any acknowledgement started
    /// (0: every send so far was followed by one).
    waiting_since_ms: AtomicI64,
    /// A fatal error of the current producer (idempotence broken, fenced...).
    pub(super) fatal: Mutex<Option<String>>,
    /// The last failed delivery, for the readiness report.
    last_failure: Mutex<Option<String>>,
    /// The last probe: when, and its error.
    probe: Mutex<Option<(i64, Option<String>)>>,
    /// Producers built after the first.
    rebuilds: AtomicU64,
    /// The client's last error (connection, TLS, authentication...).
    pub(super) last_client_error: Mutex<Option<String>>,
    /// When the current run of failed deliveries began, ms since the epoch
    /// (0: the last delivery report was an acknowledgement, or none failed).
    failing_since_ms: AtomicI64,
    /// Delivery reports that failed since the last acknowledgement.
    failures_in_a_row: AtomicU64,
    /// When a producer was last rebuilt because its deliveries kept failing.
    failure_rebuild_ms: AtomicI64,
}

/// Failed delivery reports in a row (no acknowledgement between them) that,
/// once they span [`FAILING_AFTER_MS`] (or `producer_stall_ms` if shorter), make a producer one that cannot
/// deliver: the cluster rejects it (a replaced broker that does not know
/// its producer id, an authorization taken away), so readiness says not
/// ready and supervision rebuilds it as soon as the cluster answers.
pub const FAILURES_IN_A_ROW: u64 = 5;
/// The longest a run of failed deliveries must last to count (shorter when
/// [`KafkaConfig::producer_stall_ms`] is), ms.
pub const FAILING_AFTER_MS: u64 = 5_000;
/// The least time between two rebuilds caused by failing deliveries, ms: a
/// topic that refuses every message (its authorization gone) fails on a new
/// producer too, and is not worth a producer a few seconds.
pub const FAILURE_REBUILD_BACKOFF_MS: i64 = 30_000;

/// How long a run of failed deliveries must last to count.
fn failing_bound_ms(producer_stall_ms: u64) -> u64 {
    FAILING_AFTER_MS.min(producer_stall_ms)
}

impl HealthState {
    pub(super) fn note_send(&self) {
        let _ = self.waiting_since_ms.compare_exchange(0, outbox_core::SystemClock.now_ms(), AtomicOrdering::AcqRel, AtomicOrdering::Acquire);
    }

    pub(super) fn note_outcome(&self, outcome: &SendOutcome) {
        match outcome {
            SendOutcome::Acked { .. } => {
                self.last_ack_ms.store(outbox_core::SystemClock.now_ms(), AtomicOrdering::Release);
                self.waiting_since_ms.store(0, AtomicOrdering::Release);
                self.failing_since_ms.store(0, AtomicOrdering::Release);
                self.failures_in_a_row.store(0, AtomicOrdering::Release);
            }
            SendOutcome::NotPersisted(why) | SendOutcome::Unknown(why) => {
                *lock(&self.last_failure) = Some(why.clone());
                let _ = self.failing_since_ms.compare_exchange(0, outbox_core::SystemClock.now_ms(), AtomicOrdering::AcqRel, AtomicOrdering::Acquire);
                self.failures_in_a_row.fetch_add(1, AtomicOrdering::AcqRel);
            }
        }
    }
}

/// What [`KafkaBroker::producer_health`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducerHealth {
    /// The current producer's fatal error, if any.
    pub fatal: Option<String>,
    /// How long the oldest send not followed by any acknowledgement has
    /// waited, ms (`None`: nothing is waiting).
    pub waiting_ms: Option<u64>,
    /// Whether `waiting_ms` exceeds [`KafkaConfig::producer_stall_ms`].
    pub stalled: bool,
    /// Delivery reports that failed since the last acknowledgement.
    pub failures_in_a_row: u64,
    /// How long they have been failing, ms (`None`: the last report was an
    /// acknowledgement, or none failed).
    pub failing_ms: Option<u64>,
    /// Whether every delivery failed, [`FAILURES_IN_A_ROW`] or more of them
    /// over at least [`FAILING_AFTER_MS`] (or `producer_stall_ms` if shorter).
    pub failing: bool,
    /// The last failed delivery.
    pub last_failure: Option<String>,
    /// When the last message was acknowledged, ms since the epoch.
    pub last_ack_ms: Option<i64>,
    /// The last probe: its age in ms and its error (`None`: never probed).
    pub last_probe: Option<(u64, Option<String>)>,
    /// Producers rebuilt since connect.
    pub rebuilds: u64,
}

impl ProducerHealth {
    /// Why the producer cannot deliver, if it cannot.
    pub fn cannot_deliver(&self) -> Option<String> {
        if let Some(f) = &self.fatal {
            return Some(format!("fatal producer error: {f}"));
        }
        let last = self.last_failure.as_deref().map(|f| format!(" (last failure: {f})")).unwrap_or_default();
        if self.stalled {
            return Some(format!("no delivery acknowledged for {} ms{last}", self.waiting_ms.unwrap_or(0)));
        }
        if self.failing {
            return Some(format!("every delivery failed for {} ms, {} in a row{last}", self.failing_ms.unwrap_or(0), self.failures_in_a_row));
        }
        None
    }
}

/// What one [`KafkaBroker::supervise_once`] found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SupervisionStep {
    /// The cluster answers and the producer delivers (or has nothing to deliver).
    Healthy,
    /// The cluster does not answer (nothing rebuilt: a new producer could not do better).
    BrokerUnreachable(String),
    /// The producer could not deliver while the cluster answered; it was rebuilt.
    Rebuilt {
        /// Why.
        cause: String,
    },
    /// The producer cannot deliver and was not rebuilt (rebuilding was not
    /// asked for, or it failed: the reason is appended).
    CannotDeliver(String),
}

impl KafkaBroker {
    /// The producer's ability to deliver, from its delivery reports and
    /// errors (no I/O).
    pub fn producer_health(&self) -> ProducerHealth {
        let inner = self.inner();
        let h = &inner.health;
        let now = outbox_core::SystemClock.now_ms();
        let since = h.waiting_since_ms.load(AtomicOrdering::Acquire);
        let waiting_ms = (since > 0).then(|| now.saturating_sub(since).max(0) as u64);
        let last_ack = h.last_ack_ms.load(AtomicOrdering::Acquire);
        let fatal = lock(&h.fatal).clone().or_else(|| inner.producer.fatal_error());
        let last_failure = lock(&h.last_failure).clone();
        let last_probe = lock(&h.probe).as_ref().map(|(at, e)| (now.saturating_sub(*at).max(0) as u64, e.clone()));
        let failing_since = h.failing_since_ms.load(AtomicOrdering::Acquire);
        let failing_ms = (failing_since > 0).then(|| now.saturating_sub(failing_since).max(0) as u64);
        let failures_in_a_row = h.failures_in_a_row.load(AtomicOrdering::Acquire);
        ProducerHealth {
            fatal,
            waiting_ms,
            stalled: waiting_ms.is_some_and(|w| w > inner.config.producer_stall_ms),
            failures_in_a_row,
            failing_ms,
            failing: failures_in_a_row >= FAILURES_IN_A_ROW && failing_ms.is_some_and(|f| f >= failing_bound_ms(inner.config.producer_stall_ms)),
            last_failure,
            last_ack_ms: (last_ack > 0).then_some(last_ack),
            last_probe,
            rebuilds: h.rebuilds.load(AtomicOrdering::Relaxed),
        }
    }

    /// Raises a fatal error inside librdkafka's current producer with
    /// librdkafka's own test hook (`rd_kafka_test_fatal_error`), as broken
    /// idempotence would: for tests of supervision. Returns whether it was raised.
    #[doc(hidden)]
    #[allow(unsafe_code)]
    pub fn raise_fatal_error_for_tests(&self, reason: &str) -> bool {
        let inner = self.inner();
        let Ok(reason) = std::ffi::CString::new(reason) else { return false };
        // SAFETY: the handle is live for the call (`inner` holds the
        // producer); `reason` is NUL-terminated and outlives the call.
        let err = unsafe {
            rdkafka_sys::rd_kafka_test_fatal_error(inner.producer.native(), rdkafka_sys::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_OUT_OF_ORDER_SEQUENCE_NUMBER, reason.as_ptr())
        };
        RDKafkaErrorCode::from(err) == RDKafkaErrorCode::NoError
    }

    /// `Ok` while the producer may be trusted with sends: no fatal error, not
    /// stalled, and the last probe (if any) answered. A dispatcher stops
    /// claiming while this is an error.
    pub fn ready(&self) -> Result<(), String> {
        let h = self.producer_health();
        if let Some(why) = h.cannot_deliver() {
            return Err(why);
        }
        match h.last_probe {
            Some((_, Some(e))) => Err(format!("the Kafka cluster does not answer: {e}")),
            _ => Ok(()),
        }
    }

    /// Asks the cluster for its metadata (at most
    /// [`KafkaConfig::probe_timeout_ms`]) and records the answer.
    pub async fn probe(&self) -> Result<(), String> {
        let inner = self.inner();
        let timeout = Duration::from_millis(inner.config.probe_timeout_ms);
        let probed = inner.clone();
        let r = tokio::task::spawn_blocking(move || probed.producer.probe(timeout).map_err(|e| redact_text(&e, &probed.config.extra)))
            .await
            .unwrap_or_else(|e| Err(format!("probe task failed: {e}")));
        *lock(&inner.health.probe) = Some((outbox_core::SystemClock.now_ms(), r.clone().err()));
        r
    }

    /// Replaces the producer by a new one (same configuration, same
    /// cluster). Messages handed to the old producer keep their delivery
    /// reports. Fails with [`KafkaAdapterError::ClusterChanged`] if the
    /// bootstrap servers now answer for another cluster.
    pub async fn rebuild(&self, cause: &str) -> Result<(), KafkaAdapterError> {
        let _one = self.shared.rebuilding.lock().await;
        let old = self.inner();
        let (config, in_flight, lookups, health, tokens, cluster) =
            (old.config.clone(), old.in_flight.clone(), old.lookups.clone(), old.health.clone(), old.tokens.clone(), old.cluster_id.clone());
        let new = tokio::task::spawn_blocking(move || Inner::build(config, in_flight, lookups, health, tokens, Some(cluster)))
            .await
            .map_err(|e| KafkaAdapterError::Task(e.to_string()))??;
        let h = &new.health;
        *lock(&h.fatal) = None;
        h.waiting_since_ms.store(0, AtomicOrdering::Release);
        h.failing_since_ms.store(0, AtomicOrdering::Release);
        h.failures_in_a_row.store(0, AtomicOrdering::Release);
        let n = h.rebuilds.fetch_add(1, AtomicOrdering::Relaxed) + 1;
        warn!(cause, rebuilds = n, cluster_id = %new.cluster_id, "kafka producer rebuilt");
        *self.shared.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(new);
        Ok(())
    }

    /// One supervision step: probe the cluster; if the producer cannot
    /// deliver while the cluster answers, rebuild it (when `rebuild`) and
    /// say so. Call it every second or so (the CLI does).
    pub async fn supervise_once(&self, rebuild: bool) -> SupervisionStep {
        let probe = self.probe().await;
        let health = self.producer_health();
        let cannot = health.cannot_deliver();
        // A producer whose deliveries only fail (not fatal, not stalled) is
        // rebuilt at most once per backoff: a topic that refuses every
        // message refuses a new producer's too.
        let only_failing = health.failing && health.fatal.is_none() && !health.stalled;
        let now = outbox_core::SystemClock.now_ms();
        let last_failure_rebuild = self.inner().health.failure_rebuild_ms.load(AtomicOrdering::Acquire);
        let backing_off = only_failing && last_failure_rebuild > 0 && now - last_failure_rebuild < FAILURE_REBUILD_BACKOFF_MS;
        match (probe, cannot) {
            (Err(e), _) => SupervisionStep::BrokerUnreachable(e),
            (Ok(()), None) => SupervisionStep::Healthy,
            (Ok(()), Some(cause)) if rebuild && backing_off => {
                SupervisionStep::CannotDeliver(format!("{cause}; rebuilt {} ms ago for the same reason, not again before {FAILURE_REBUILD_BACKOFF_MS} ms", now - last_failure_rebuild))
            }
            (Ok(()), Some(cause)) if rebuild => match self.rebuild(&cause).await {
                Ok(()) => {
                    if only_failing {
                        self.inner().health.failure_rebuild_ms.store(now, AtomicOrdering::Release);
                    }
                    SupervisionStep::Rebuilt { cause }
                }
                Err(e) => {
                    error!(cause = %cause, error = %e, "kafka producer could not be rebuilt");
                    SupervisionStep::CannotDeliver(format!("{cause}; rebuild failed: {e}"))
                }
            },
            (Ok(()), Some(cause)) => SupervisionStep::CannotDeliver(cause),
        }
    }
}
