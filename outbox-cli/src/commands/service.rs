//! What the two services (`dispatch`, `reconcile`) share: stopping on a
//! signal, the metrics and health endpoint, and the health loop.

use std::sync::Arc;

use prometheus::Registry;
use tokio::sync::watch;

use super::EXIT_INTERRUPTED;
use crate::health::Health;
use crate::metrics;

/// Resolves on the first SIGINT or SIGTERM; a second one exits the process at once.
pub(super) async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    let which = tokio::select! {
        _ = int.recv() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    };
    tokio::spawn(async move {
        tokio::select! {
            _ = int.recv() => {},
            _ = term.recv() => {},
        }
        eprintln!("outbox: second signal: exiting without draining");
        std::process::exit(EXIT_INTERRUPTED as i32);
    });
    which
}

pub(super) async fn start_metrics(addr: &str, registry: Registry, refresh: Arc<dyn Fn() + Send + Sync>, health: Option<Arc<Health>>) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let routes: Option<metrics::Routes> = health.map(|h| Arc::new(move |path: &str| h.route(path)) as metrics::Routes);
    let (bound, handle) = metrics::serve_with_routes(addr, registry, refresh, routes).await?;
    tracing::info!(addr = %bound, "serving Prometheus metrics at /metrics, health at /healthz and /readyz");
    Ok(handle)
}

/// Starts the health loop; with `exit_on_fatal`, a producer that cannot
/// deliver stops the service (its cause is kept for the exit).
pub(super) fn supervise(health: &Arc<Health>, exit_on_fatal: bool, stop: Arc<watch::Sender<bool>>) -> Arc<std::sync::Mutex<Option<String>>> {
    let fatal: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
    let keep = fatal.clone();
    health.clone().spawn(exit_on_fatal, move |cause| {
        tracing::error!(cause = %cause, "the Kafka producer cannot deliver: stopping (--exit-on-fatal)");
        *keep.lock().unwrap_or_else(|p| p.into_inner()) = Some(cause);
        let _ = stop.send(true);
    });
    fatal
}
