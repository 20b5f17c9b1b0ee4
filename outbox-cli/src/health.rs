//! Health of `outbox dispatch` and `outbox reconcile`, served on the metrics
//! listener (`--metrics-addr`):
//!
//! - `GET /healthz`: 200 while the process serves requests (liveness).
//! - `GET /readyz`: 200 when every check passes, else 503; the body names
//!   each check and why it fails:
//!   - `database`: `SELECT 1` answered within [`DB_CHECK_TIMEOUT_MS`] at the
//!     last check (checked every [`CHECK_EVERY_MS`]);
//!   - `kafka`: the cluster answered the last metadata probe and the producer
//!     delivers (no fatal error, an acknowledgement within
//!     `producer_stall_ms` of any send): [`KafkaBroker::ready`];
//!   - `progress`: the service's own loop moved (the dispatcher claimed or
//!     renewed its leases, the reconciler finished a round) within its bound.
//!
//! The same loop supervises the producer: when it cannot deliver while the
//! cluster answers, it is rebuilt ([`KafkaBroker::supervise_once`]), or, with
//! `--exit-on-fatal`, the service stops and exits with [`EXIT_PRODUCER_FATAL`]
//! so that its supervisor (systemd, Kubernetes) restarts it.

use outbox_core::Clock as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outbox_producer::kafka::{KafkaBroker, SupervisionStep};
use sqlx::PgPool;

/// Exit code of a service stopped by `--exit-on-fatal`.
pub const EXIT_PRODUCER_FATAL: u8 = 4;
/// How often the checks run, ms.
pub const CHECK_EVERY_MS: u64 = 1_000;
/// Longest the database check waits, ms.
pub const DB_CHECK_TIMEOUT_MS: u64 = 2_000;

/// A clock of progress: when the service last moved, ms since the epoch (0: not yet).
pub type ProgressClock = Arc<dyn Fn() -> i64 + Send + Sync>;

/// The checks of one service and their last results.
pub struct Health {
    service: &'static str,
    pool: PgPool,
    broker: Arc<KafkaBroker>,
    progress: ProgressClock,
    max_silence_ms: u64,
    started: Instant,
    last_db: Mutex<Option<(Instant, Result<(), String>)>>,
    last_step: Mutex<Option<SupervisionStep>>,
}

impl Health {
    /// Checks for `service`: `progress` must move at least every `max_silence_ms`.
    pub fn new(service: &'static str, pool: PgPool, broker: Arc<KafkaBroker>, progress: ProgressClock, max_silence_ms: u64) -> Self {
        Health { service, pool, broker, progress, max_silence_ms, started: Instant::now(), last_db: Mutex::new(None), last_step: Mutex::new(None) }
    }

    /// Runs the database check and one supervision step of the producer
    /// (rebuilding it when `rebuild`). Returns why the producer cannot
    /// deliver when it was not rebuilt.
    pub async fn check_once(&self, rebuild: bool) -> Option<String> {
        let db = match tokio::time::timeout(Duration::from_millis(DB_CHECK_TIMEOUT_MS), sqlx::query_scalar::<_, i32>("SELECT 1").fetch_one(&self.pool)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {DB_CHECK_TIMEOUT_MS} ms")),
        };
        if let Err(e) = &db {
            let was_ok = matches!(&*self.last_db.lock().unwrap_or_else(|p| p.into_inner()), Some((_, Ok(()))) | None);
            if was_ok {
                tracing::warn!(service = self.service, error = %e, "readiness: the database does not answer");
            }
        }
        *self.last_db.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), db));
        let step = self.broker.supervise_once(rebuild).await;
        let changed = self.last_step.lock().unwrap_or_else(|p| p.into_inner()).as_ref() != Some(&step);
        if changed {
            match &step {
                SupervisionStep::Healthy => tracing::info!(service = self.service, "readiness: the Kafka cluster answers and the producer delivers"),
                SupervisionStep::BrokerUnreachable(e) => tracing::warn!(service = self.service, error = %e, "readiness: the Kafka cluster does not answer"),
                SupervisionStep::Rebuilt { cause } => tracing::warn!(service = self.service, cause = %cause, "the Kafka producer could not deliver: rebuilt"),
                SupervisionStep::CannotDeliver(cause) => tracing::error!(service = self.service, cause = %cause, "the Kafka producer cannot deliver"),
            }
        }
        let fatal = match &step {
            SupervisionStep::CannotDeliver(cause) if !rebuild => Some(cause.clone()),
            _ => None,
        };
        *self.last_step.lock().unwrap_or_else(|p| p.into_inner()) = Some(step);
        fatal
    }

    /// Runs [`Health::check_once`] every [`CHECK_EVERY_MS`] until the task
    /// is dropped. With `exit_on_fatal` the producer is never rebuilt:
    /// `on_fatal` is called once with the cause instead.
    pub fn spawn(self: Arc<Self>, exit_on_fatal: bool, on_fatal: impl Fn(String) + Send + Sync + 'static) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            loop {
                if let Some(cause) = self.check_once(!exit_on_fatal).await {
                    on_fatal(cause);
                    return;
                }
                tokio::time::sleep(Duration::from_millis(CHECK_EVERY_MS)).await;
            }
        })
    }

    /// Each check: its name and `Err(why)` when it fails.
    pub fn readiness(&self) -> Vec<(&'static str, Result<(), String>)> {
        let stale_after = Duration::from_millis(CHECK_EVERY_MS * 3 + DB_CHECK_TIMEOUT_MS + self.broker.config().probe_timeout_ms);
        let db = match &*self.last_db.lock().unwrap_or_else(|p| p.into_inner()) {
            None => Err("not checked yet".to_owned()),
            Some((at, _)) if at.elapsed() > stale_after => Err(format!("last checked {} ms ago", at.elapsed().as_millis())),
            Some((_, r)) => r.clone(),
        };
        let kafka = match self.broker.producer_health().last_probe {
            None => Err("not probed yet".to_owned()),
            Some((age_ms, _)) if age_ms > stale_after.as_millis() as u64 => Err(format!("last probed {age_ms} ms ago")),
            Some(_) => self.broker.ready(),
        };
        let last = (self.progress)();
        let reference = if last > 0 { last } else { outbox_core::SystemClock.now_ms() - self.started.elapsed().as_millis() as i64 };
        let silent_ms = outbox_core::SystemClock.now_ms().saturating_sub(reference).max(0) as u64;
        let progress = if silent_ms > self.max_silence_ms {
            Err(format!("no progress for {silent_ms} ms (bound {} ms)", self.max_silence_ms))
        } else {
            Ok(())
        };
        vec![("database", db), ("kafka", kafka), ("progress", progress)]
    }

    /// The answer to `GET path`, if the path is a health path.
    pub fn route(&self, path: &str) -> Option<(&'static str, String)> {
        match path {
            "/healthz" => Some(("200 OK", format!("ok: outbox {} is alive\n", self.service))),
            "/readyz" => {
                let checks = self.readiness();
                let ready = checks.iter().all(|(_, r)| r.is_ok());
                let mut body = format!("{}\n", if ready { "ready" } else { "not ready" });
                for (name, r) in checks {
                    match r {
                        Ok(()) => body.push_str(&format!("{name}: ok\n")),
                        Err(why) => body.push_str(&format!("{name}: {why}\n")),
                    }
                }
                Some((if ready { "200 OK" } else { "503 Service Unavailable" }, body))
            }
            _ => None,
        }
    }
}
