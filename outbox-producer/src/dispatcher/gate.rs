//! Whether this dispatcher may claim now: the claim gate (held shut while
//! the producer cannot deliver) and the dispatcher alias (PROTOCOL §11).

use std::sync::atomic::Ordering as AtomicOrdering;
use std::sync::Arc;
use std::time::Duration;
// tokio's clock: the simulator runs these services in virtual time.
use tokio::time::Instant;

use outbox_core::Broker;

use super::Dispatcher;
use crate::error::ProducerError;
use crate::service_store::ServiceStore;

/// A check run before every claim: `Err(why)` holds claims back (see
/// [`Dispatcher::with_claim_gate`]).
pub type ClaimGate = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

pub(super) struct Gate(pub(super) Option<ClaimGate>);

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "Gate(set)" } else { "Gate(none)" })
    }
}

impl<B: Broker + 'static, S: ServiceStore> Dispatcher<B, S> {
    /// Holds claims back while `gate` answers `Err(why)`, e.g. while the
    /// Kafka producer cannot deliver ([`crate::kafka::KafkaBroker::ready`]):
    /// events stay PENDING instead of spending attempts on a producer that
    /// is being rebuilt. Sends already started are settled as usual.
    pub fn with_claim_gate(mut self, gate: ClaimGate) -> Self {
        self.gate = Gate(Some(gate));
        self
    }

    /// Whether the claim gate lets claims through; logs each change.
    pub(super) fn gate_open(&self) -> bool {
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
}
