//! `outbox dispatch`: the dispatcher service.

use std::sync::Arc;

use outbox_producer::{Dispatcher, DispatcherConfig, PgStore};
use prometheus::Registry;
use tokio::sync::watch;

use super::broker::{connect_kafka, kafka_flags};
use super::db::{connect, require_schema};
use super::print_config::{config_toml, dispatch_table};
use super::service::{shutdown_signal, start_metrics, supervise};
use crate::cli::DispatchArgs;
use crate::config::{self, DispatchFlags, FileConfig};
use crate::health::{Health, EXIT_PRODUCER_FATAL};
use crate::metrics::{self, DispatchExport};

pub(super) async fn dispatch(url: &dyn Fn() -> anyhow::Result<String>, file: &FileConfig, a: &DispatchArgs) -> anyhow::Result<u8> {
    let flags = DispatchFlags {
        name: a.name.clone(),
        workers: a.workers,
        batch_size: a.batch_size,
        lease_ms: a.lease_ms,
        poll_interval_ms: a.poll_interval_ms,
        sweep_interval_ms: a.sweep_interval_ms,
        head_scan_every: a.head_scan_every,
        shutdown_grace_ms: a.shutdown_grace_ms,
        record_retry_ms: a.record_retry_ms,
        no_listen: a.no_listen,
    };
    let cfg: DispatcherConfig = config::dispatcher_config(&flags, file)?;
    let kafka = config::kafka_config(&kafka_flags(&a.kafka), &file.kafka)?;
    let metrics_addr = a.metrics_addr.clone().or_else(|| file.metrics.addr.clone());
    if a.print_config {
        print!("{}", config_toml(url().ok().as_deref(), &kafka, metrics_addr.as_deref(), ("dispatch", dispatch_table(&cfg)))?);
        return Ok(0);
    }
    let pool = connect(&url()?, cfg.workers as u32 * 2 + 4).await?;
    require_schema(&pool).await?;
    let broker = connect_kafka(kafka).await?;
    let gate = broker.clone();
    let dispatcher = Arc::new(Dispatcher::new(PgStore::new(pool.clone()), broker.clone(), cfg.clone())?.with_claim_gate(Arc::new(move || gate.ready())));
    let (stop_tx, stop_rx) = watch::channel(false);
    let stop_tx = Arc::new(stop_tx);
    let progress = dispatcher.metrics();
    // A worker claims at least every poll interval and renews a long batch's
    // leases every half lease; recording its answers may take record_retry_ms.
    let max_silence_ms = (cfg.lease_ms.max(0) as u64) * 2 + cfg.record_retry_ms + cfg.poll_interval_ms;
    let health = Arc::new(Health::new("dispatch", pool.clone(), broker.clone(), Arc::new(move || progress.last_progress_ms.load(std::sync::atomic::Ordering::Relaxed)), max_silence_ms));
    let fatal = supervise(&health, a.exit_on_fatal, stop_tx.clone());
    let _metrics = match &metrics_addr {
        Some(addr) => {
            let registry = Registry::new();
            metrics::build_info(&registry, "dispatch");
            let b = broker.clone();
            let export = DispatchExport::register(&registry, dispatcher.metrics(), Some(Arc::new(move || b.in_flight())));
            Some(start_metrics(addr, registry, Arc::new(move || export.refresh()), Some(health.clone())).await?)
        }
        None => None,
    };
    tracing::info!(name = %cfg.name, workers = cfg.workers, batch_size = cfg.batch_size, lease_ms = cfg.lease_ms, cluster_id = broker.cluster_id(), "dispatcher running");
    {
        let stop_tx = stop_tx.clone();
        tokio::spawn(async move {
            let which = shutdown_signal().await;
            tracing::info!(signal = which, "stopping: no new claims, draining outstanding answers (a second signal exits at once)");
            let _ = stop_tx.send(true);
        });
    }
    let totals = dispatcher.clone().run(outbox_producer::until_true(stop_rx)).await?;
    let _ = broker.flush(5_000).await;
    tracing::info!(
        claimed = totals.claimed,
        sent = totals.sent,
        published = totals.published,
        duplicates = totals.duplicates,
        unknown = totals.unknown,
        not_sent = totals.not_sent,
        quarantined = totals.quarantined,
        fenced = totals.fenced,
        "dispatcher stopped"
    );
    pool.close().await;
    if let Some(cause) = fatal.lock().unwrap_or_else(|p| p.into_inner()).clone() {
        tracing::error!(cause = %cause, exit_code = EXIT_PRODUCER_FATAL, "exiting: the Kafka producer could not deliver (--exit-on-fatal)");
        return Ok(EXIT_PRODUCER_FATAL);
    }
    Ok(0)
}
