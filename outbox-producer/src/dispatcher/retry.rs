//! Riding out retryable database errors (a lost connection, a restart or
//! failover) while a batch records the broker's answers.

use std::time::Duration;
// tokio's clock: the simulator runs these services in virtual time.
use tokio::time::Instant;

use outbox_core::{Broker, StoreError};

use super::metrics::inc;
use super::Dispatcher;
#[cfg(doc)]
use super::DispatcherConfig;
use crate::service_store::ServiceStore;

/// First wait before recording a broker answer again; it doubles up to
/// [`RECORD_RETRY_MAX_WAIT`].
const RECORD_RETRY_FIRST_WAIT: Duration = Duration::from_millis(50);
pub(super) const RECORD_RETRY_MAX_WAIT: Duration = Duration::from_secs(2);

/// A database failure the same call may get past (a lost connection, a
/// restart, a serialization failure); not a protocol refusal.
pub(super) fn is_retryable_backend(e: &StoreError) -> bool {
    matches!(e, StoreError::Backend { retryable: true, .. })
}

impl<B: Broker + 'static, S: ServiceStore> Dispatcher<B, S> {
    /// Runs `call`, and again after each retryable database error (lost
    /// connection, restart, serialization failure, deadlock), waiting 50 ms
    /// doubling to 2 s, for at most [`DispatcherConfig::record_retry_ms`]:
    /// answers the broker already gave are not dropped because PostgreSQL
    /// blinked. Each call made through it is a read or safe to repeat when
    /// its first commit went through unseen (the
    /// connection broke before the answer): the receipt is then already
    /// accepted (counted as a duplicate), and the report finds its claim
    /// released and changes nothing (counted, and audited, as fenced).
    pub(super) async fn through_db_errors<T, F, Fut>(&self, what: &'static str, mut call: F) -> Result<T, StoreError>
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
}
