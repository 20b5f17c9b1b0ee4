//! A readiness signal for the service that embeds an [`IdempotentConsumer`]
//! (its own `/readyz`, a Kubernetes probe...).
//!
//! [`ConsumerReadiness::check`] is `Ok` while the consumer runs, has not
//! stopped on an error, and its last probes found the Kafka cluster
//! answering (a metadata request) and the database answering (`SELECT 1`),
//! both at most [`PROBE_EVERY_MS`] × 3 ago. The probes run inside
//! [`IdempotentConsumer::run`].
//!
//! [`IdempotentConsumer`]: crate::IdempotentConsumer
//! [`IdempotentConsumer::run`]: crate::IdempotentConsumer::run

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// How often the run loop probes the cluster and the database, ms.
pub const PROBE_EVERY_MS: u64 = 2_000;
/// Longest one probe waits, ms.
pub const PROBE_TIMEOUT_MS: u64 = 2_000;

#[derive(Debug, Default)]
struct State {
    running: AtomicBool,
    stopped: Mutex<Option<String>>,
    kafka: Mutex<Option<(std::time::Instant, Result<(), String>)>>,
    database: Mutex<Option<(std::time::Instant, Result<(), String>)>>,
}

/// Cheap to clone; every clone sees the same consumer.
#[derive(Debug, Clone, Default)]
pub struct ConsumerReadiness {
    state: Arc<State>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl ConsumerReadiness {
    /// `Ok` when the consumer is ready; otherwise why not.
    pub fn check(&self) -> Result<(), String> {
        let s = &self.state;
        if let Some(why) = lock(&s.stopped).clone() {
            return Err(format!("stopped: {why}"));
        }
        if !s.running.load(Ordering::Acquire) {
            return Err("not running".into());
        }
        let stale = std::time::Duration::from_millis(PROBE_EVERY_MS * 3 + PROBE_TIMEOUT_MS);
        for (name, probe) in [("kafka", &s.kafka), ("database", &s.database)] {
            match &*lock(probe) {
                None => return Err(format!("{name}: not probed yet")),
                Some((at, _)) if at.elapsed() > stale => return Err(format!("{name}: last probed {} ms ago", at.elapsed().as_millis())),
                Some((_, Err(e))) => return Err(format!("{name}: {e}")),
                Some((_, Ok(()))) => {}
            }
        }
        Ok(())
    }

    /// Whether [`ConsumerReadiness::check`] is `Ok`.
    pub fn is_ready(&self) -> bool {
        self.check().is_ok()
    }

    pub(crate) fn started(&self) {
        *lock(&self.state.stopped) = None;
        self.state.running.store(true, Ordering::Release);
    }

    pub(crate) fn stopped(&self, why: Option<String>) {
        self.state.running.store(false, Ordering::Release);
        *lock(&self.state.stopped) = Some(why.unwrap_or_else(|| "shut down".into()));
    }

    pub(crate) fn kafka(&self, r: Result<(), String>) {
        *lock(&self.state.kafka) = Some((std::time::Instant::now(), r));
    }

    pub(crate) fn database(&self, r: Result<(), String>) {
        *lock(&self.state.database) = Some((std::time::Instant::now(), r));
    }
}
