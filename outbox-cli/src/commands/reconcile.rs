//! `outbox reconcile`: the reconciler service, the watermark topic's
//! reader beside it, and what each round exports.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::RetryPolicy;
use outbox_producer::kafka::{KafkaBroker, KafkaConfig};
use outbox_producer::{PgStore, Reconciler, ReconcilerConfig};
use prometheus::Registry;
use sqlx::PgPool;
use tokio::sync::watch;

use super::broker::{connect_kafka, kafka_flags};
use super::db::{connect, require_schema};
use super::print_config::{config_toml, reconcile_table, watermark_keys_value};
use super::service::{shutdown_signal, start_metrics, supervise};
use super::{now_ms, EXIT_FINDINGS};
use crate::cli::ReconcileArgs;
use crate::config::{self, FileConfig};
use crate::health::{Health, EXIT_PRODUCER_FATAL};
use crate::metrics::{self, ReconcileExport};

fn reconciler_config(a: &ReconcileArgs, file: &FileConfig) -> ReconcilerConfig {
    let f = &file.reconcile;
    let mut c = ReconcilerConfig::default();
    let retry_default = RetryPolicy::default();
    if let Some(v) = a.owner.clone().or(f.owner.clone()) {
        c.owner = v;
    }
    c.batch_size = a.batch_size.or(f.batch_size).unwrap_or(c.batch_size);
    c.lease_ms = a.lease_ms.or(f.lease_ms).unwrap_or(c.lease_ms);
    c.retry = RetryPolicy {
        allow_retry: if a.no_retry { false } else { f.allow_retry.unwrap_or(retry_default.allow_retry) },
        max_attempts: a.max_attempts.or(f.max_attempts).unwrap_or(retry_default.max_attempts),
        in_flight_bound_ms: a.in_flight_bound_ms.or(f.in_flight_bound_ms).unwrap_or(retry_default.in_flight_bound_ms),
        recheck_ms: a.recheck_ms.or(f.recheck_ms).unwrap_or(retry_default.recheck_ms),
    };
    c.aged_pending_ms = a.aged_pending_ms.or(f.aged_pending_ms).unwrap_or(c.aged_pending_ms);
    c.unconsumed_after_ms = a.unconsumed_after_ms.or(f.unconsumed_after_ms).unwrap_or(c.unconsumed_after_ms);
    c.unknown_slo_ms = a.unknown_slo_ms.or(f.unknown_slo_ms).unwrap_or(c.unknown_slo_ms);
    c.bypass_scan_max_messages = a.bypass_scan_max_messages.or(f.bypass_scan_max_messages).unwrap_or(c.bypass_scan_max_messages);
    c.stale_watermark_after_ms = a.stale_watermark_after_ms.or(f.stale_watermark_after_ms).unwrap_or(c.stale_watermark_after_ms);
    c.max_findings_per_kind = f.max_findings_per_kind.unwrap_or(c.max_findings_per_kind);
    c.history_keep_ms = f.history_keep_ms.unwrap_or(c.history_keep_ms);
    c.compare_every_rounds = f.compare_every_rounds.unwrap_or(c.compare_every_rounds);
    let flag_sources: Vec<String> = a.declared_sources.iter().map(|s| s.trim().to_owned()).filter(|s| !s.is_empty()).collect();
    c.declared_sources = if flag_sources.is_empty() { f.declared_sources.clone().unwrap_or_default() } else { flag_sources };
    c
}

/// Environment variable of the watermark records' verification keys
/// (space-separated `CONSUMER_ID=KEY_ID=HEX`); it replaces the file's `watermark_keys`.
pub const WATERMARK_KEYS_ENV: &str = "OUTBOX_RECONCILE_WATERMARK_KEYS";
/// Environment variable of `--watermark-unsigned` (comma-separated consumer
/// ids); flag or variable replace the file's `watermark_unsigned`.
pub const WATERMARK_UNSIGNED_ENV: &str = "OUTBOX_RECONCILE_WATERMARK_UNSIGNED";

/// The watermark topic the reconciler reads, unless turned off.
fn watermark_topic_config(a: &ReconcileArgs, file: &FileConfig, kafka: &KafkaConfig) -> anyhow::Result<Option<outbox_producer::WatermarkTopicConfig>> {
    if a.no_watermark_topic {
        return Ok(None);
    }
    let topic = a.watermark_topic.clone().or(file.reconcile.watermark_topic.clone()).unwrap_or_else(|| outbox_producer::watermark_topic::DEFAULT_TOPIC.to_owned());
    if topic.trim().is_empty() {
        return Ok(None);
    }
    let mut c = outbox_producer::WatermarkTopicConfig::new(kafka.bootstrap_servers.clone());
    c.topic = topic.trim().to_owned();
    for (k, v) in &kafka.extra {
        if outbox_consumer::SHARED_KAFKA_PROPERTY_PREFIXES.iter().any(|p| k.starts_with(p)) {
            c.kafka.insert(k.clone(), v.clone());
        }
    }
    c.verify_keys = match std::env::var(WATERMARK_KEYS_ENV).ok().filter(|v| !v.trim().is_empty()) {
        Some(text) => outbox_producer::WatermarkTopicConfig::parse_keys(WATERMARK_KEYS_ENV, text.split_whitespace())?,
        None => file.reconcile.watermark_verify_keys()?,
    };
    c.allow_unsigned = if a.watermark_unsigned.iter().any(|s| !s.trim().is_empty()) {
        outbox_producer::WatermarkTopicConfig::parse_unsigned(&format!("--watermark-unsigned ({WATERMARK_UNSIGNED_ENV})"), a.watermark_unsigned.iter().map(String::as_str))?
    } else {
        outbox_producer::WatermarkTopicConfig::parse_unsigned("[reconcile] watermark_unsigned", file.reconcile.watermark_unsigned.iter().flatten().map(String::as_str))?
    };
    c.validate()?;
    Ok(Some(c))
}

pub(super) async fn reconcile(url: &dyn Fn() -> anyhow::Result<String>, file: &FileConfig, a: &ReconcileArgs) -> anyhow::Result<u8> {
    let mut cfg = reconciler_config(a, file);
    let interval_ms = a.interval_ms.or(file.reconcile.interval_ms).unwrap_or(10_000).max(100);
    cfg.interval_ms = interval_ms;
    let kafka = config::kafka_config(&kafka_flags(&a.kafka), &file.kafka)?;
    let metrics_addr = a.metrics_addr.clone().or_else(|| file.metrics.addr.clone());
    let watermark_cfg = watermark_topic_config(a, file, &kafka)?;
    if a.print_config {
        let mut table = reconcile_table(&cfg, interval_ms);
        table.insert("watermark_topic".into(), toml::Value::String(watermark_cfg.as_ref().map(|w| w.topic.clone()).unwrap_or_else(|| "off".into())));
        if let Some(w) = &watermark_cfg {
            table.insert("watermark_keys".into(), watermark_keys_value(w));
            table.insert("watermark_unsigned".into(), toml::Value::Array(w.allow_unsigned.iter().cloned().map(toml::Value::String).collect()));
        }
        print!("{}", config_toml(url().ok().as_deref(), &kafka, metrics_addr.as_deref(), ("reconcile", table))?);
        return Ok(0);
    }
    let pool = connect(&url()?, 6).await?;
    require_schema(&pool).await?;
    let broker = connect_kafka(kafka).await?;
    let reconciler = Reconciler::new(PgStore::new(pool.clone()), broker.clone(), cfg.clone())?;
    let watermarks = match watermark_cfg {
        None => None,
        Some(wc) => match outbox_producer::WatermarkTopicReader::connect(pool.clone(), wc).await {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!(error = %e, "not reading the watermark topic");
                None
            }
        },
    };
    if a.once {
        let ingested = match &watermarks {
            None => None,
            Some(r) => match r.ingest_once().await {
                Ok(rep) => Some(rep),
                Err(e) => {
                    tracing::warn!(error = %e, "watermark topic round failed");
                    None
                }
            },
        };
        let (resolved, compared) = reconciler.run_once().await?;
        let report = reconciler.report().await?;
        if a.json {
            println!("{}", crate::fmt::json(&serde_json::json!({
                "resolved": { "examined": resolved.examined, "published": resolved.published, "quarantined": resolved.quarantined, "retried": resolved.retried, "rechecks": resolved.rechecks },
                "compared": { "agedPending": compared.aged_pending, "unconsumedPublished": compared.unconsumed_published, "bypassPublish": compared.bypass_publish,
                              "unknownPastSlo": compared.unknown_past_slo, "quarantined": compared.quarantined, "scannedMessages": compared.scanned_messages,
                              "bypassSubmitted": compared.bypass_submitted,
                              "foreignSource": compared.foreign_source, "unrecordedCopy": compared.unrecorded_copy, "divergentCopy": compared.divergent_copy, "partitionCountChanged": compared.partition_count_changed },
                "watermarkTopic": ingested.map(|w| serde_json::json!({
                    "read": w.read, "applied": w.applied, "outOfDate": w.out_of_date, "undeclared": w.undeclared,
                    "movedBack": w.moved_back, "beyondEnd": w.beyond_end, "rejected": w.rejected, "badSignature": w.bad_signature, "noKey": w.no_key })),
                "report": report,
            }))?);
        } else {
            if let Some(w) = ingested {
                println!(
                    "watermark topic: read {} records, applied {}, out of date {}; ignored with a finding: undeclared {}, moved back {}, beyond end {}, rejected {} (signature check {}, no key {})",
                    w.read, w.applied, w.out_of_date, w.undeclared, w.moved_back, w.beyond_end, w.rejected, w.bad_signature, w.no_key
                );
            }
            println!(
                "round: examined {} UNKNOWN (published {}, quarantined {}, retried {}, recheck {}); bypass check read {} messages, handed {} copies to the receipt transaction",
                resolved.examined, resolved.published, resolved.quarantined, resolved.retried, resolved.rechecks, compared.scanned_messages, compared.bypass_submitted
            );
            print!("{}", report.to_text());
        }
        return Ok(if a.fail_on_findings && !report.findings.is_empty() { EXIT_FINDINGS } else { 0 });
    }

    let registry = Registry::new();
    metrics::build_info(&registry, "reconcile");
    let export = ReconcileExport::register(&registry);
    let last_round: Arc<std::sync::atomic::AtomicI64> = Arc::default();
    let progress = last_round.clone();
    // A round may take its lease (its claims) and then some lookups.
    let max_silence_ms = interval_ms * 3 + (cfg.lease_ms.max(0) as u64) * 2;
    let health = Arc::new(Health::new("reconcile", pool.clone(), broker.clone(), Arc::new(move || progress.load(std::sync::atomic::Ordering::Relaxed)), max_silence_ms));
    let (fatal_tx, mut fatal_rx) = watch::channel(false);
    let fatal = supervise(&health, a.exit_on_fatal, Arc::new(fatal_tx));
    let _metrics = match &metrics_addr {
        Some(addr) => Some(start_metrics(addr, registry.clone(), Arc::new(|| {}), Some(health.clone())).await?),
        None => None,
    };
    tracing::info!(owner = %cfg.owner, interval_ms, unknown_slo_ms = cfg.unknown_slo_ms, "reconciler running");
    // Two services until a signal or a fatal producer error stops both: the
    // reconciler's own loop (Reconciler::run_observed, the loop the
    // simulator runs) and the watermark-topic reader beside it.
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopper = async {
        tokio::select! {
            which = shutdown_signal() => tracing::info!(signal = which, "reconciler stopping (a round in progress is abandoned; its claims expire with their lease)"),
            _ = fatal_rx.changed() => {}
        }
        let _ = stop_tx.send(true);
    };
    let watermark_reader = async {
        if let Some(reader) = &watermarks {
            reader
                .run(outbox_producer::until_true(stop_rx.clone()), Duration::from_millis(interval_ms), |r| {
                    if let Ok(w) = r {
                        export.watermarks(w);
                    }
                })
                .await;
        }
    };
    let observer = RoundExport { export: &export, reconciler: &reconciler, pool: &pool, last_round: &last_round };
    let rounds = reconciler.run_observed(outbox_producer::until_true(stop_rx.clone()), &observer);
    let ((), (), rounds) = tokio::join!(stopper, watermark_reader, rounds);
    tracing::info!(rounds = rounds.unwrap_or(0), "reconciler stopped");
    pool.close().await;
    if let Some(cause) = fatal.lock().unwrap_or_else(|p| p.into_inner()).clone() {
        tracing::error!(cause = %cause, exit_code = EXIT_PRODUCER_FATAL, "exiting: the Kafka producer could not deliver (--exit-on-fatal)");
        return Ok(EXIT_PRODUCER_FATAL);
    }
    Ok(0)
}

/// What `outbox reconcile` does after each round of the reconciler: the
/// round's metrics, the report's gauges, and the progress readiness checks.
struct RoundExport<'a> {
    export: &'a ReconcileExport,
    reconciler: &'a Reconciler<KafkaBroker, PgStore>,
    pool: &'a PgPool,
    last_round: &'a std::sync::atomic::AtomicI64,
}

#[async_trait::async_trait]
impl outbox_producer::RoundObserver for RoundExport<'_> {
    async fn round_done(&self, _round: u64, result: Result<&(outbox_producer::ResolveReport, outbox_producer::CompareReport), &outbox_producer::ProducerError>, took: Duration) {
        let Ok((resolved, compared)) = result else {
            self.export.round_failed();
            return;
        };
        self.last_round.store(now_ms(), std::sync::atomic::Ordering::Relaxed);
        // The report's gauges are read before the round is counted: a scrape
        // that sees the round sees its report.
        let report = self.reconciler.report().await;
        let unknown = crate::status::unknown_open(self.pool, now_ms()).await;
        self.export.round(resolved, compared, took);
        match (report, unknown) {
            (Ok(report), Ok((_, oldest_unknown))) => {
                self.export.report(&report, oldest_unknown);
                tracing::info!(findings = report.findings.len(), unknown_open = report.unknown_open, slo_met = report.unknown_slo_met(), "reconcile report");
            }
            (Err(e), _) => tracing::warn!(error = %e, "could not read the report after the round; its gauges keep their last values"),
            (_, Err(e)) => tracing::warn!(error = %e, "could not read the open UNKNOWNs after the round; the gauge keeps its last value"),
        }
    }
}
