//! The Prometheus endpoint of `outbox dispatch` and `outbox reconcile`
//! (`--metrics-addr HOST:PORT`, path `/metrics`, text format 0.0.4).
//! Every metric is documented in `outbox-cli/METRICS.md`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use outbox_producer::report::Report;
use outbox_producer::{CompareReport, DispatchMetrics, ResolveReport};
use prometheus::{Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

fn counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("valid metric");
    r.register(Box::new(c.clone())).expect("unique metric");
    c
}

fn gauge(r: &Registry, name: &str, help: &str) -> IntGauge {
    let g = IntGauge::new(name, help).expect("valid metric");
    r.register(Box::new(g.clone())).expect("unique metric");
    g
}

fn fgauge(r: &Registry, name: &str, help: &str) -> Gauge {
    let g = Gauge::new(name, help).expect("valid metric");
    r.register(Box::new(g.clone())).expect("unique metric");
    g
}

fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(g.clone())).expect("unique metric");
    g
}

/// Raises a counter to `value` (the source is monotonic).
fn follow(c: &IntCounter, value: u64) {
    let now = c.get();
    if value > now {
        c.inc_by(value - now);
    }
}

/// The dispatcher's counters, mirrored from [`DispatchMetrics`] at each scrape.
#[derive(Clone)]
pub struct DispatchExport {
    source: Arc<DispatchMetrics>,
    claimed: IntCounter,
    sent: IntCounter,
    published: IntCounter,
    duplicates: IntCounter,
    unknown: IntCounter,
    not_sent: IntCounter,
    quarantined: IntCounter,
    fenced: IntCounter,
    store_retries: IntCounter,
    late_acks: IntCounter,
    batches: IntCounter,
    head_scans: IntCounter,
    successor_claims: IntCounter,
    oldest_pending: Gauge,
    refused_protocol_rows: IntGauge,
    alias_active: IntGauge,
    clock_skew: Gauge,
    in_flight: IntGauge,
    in_flight_source: Option<Arc<dyn Fn() -> usize + Send + Sync>>,
}

impl DispatchExport {
    /// Registers the dispatcher metrics.
    pub fn register(r: &Registry, source: Arc<DispatchMetrics>, in_flight: Option<Arc<dyn Fn() -> usize + Send + Sync>>) -> Self {
        source.histograms.register(r).expect("unique metric");
        DispatchExport {
            source,
            claimed: counter(r, "outbox_dispatch_claimed_total", "Events claimed by this dispatcher."),
            sent: counter(r, "outbox_dispatch_sent_total", "Sends started (attempts registered and handed to the broker client)."),
            published: counter(r, "outbox_dispatch_published_total", "Events that became PUBLISHED through this dispatcher's receipts."),
            duplicates: counter(r, "outbox_dispatch_duplicate_receipts_total", "Receipts kept as duplicate transport receipts (or already accepted)."),
            unknown: counter(r, "outbox_dispatch_unknown_total", "Attempts whose outcome is unknown (event went DISPATCH_UNKNOWN)."),
            not_sent: counter(r, "outbox_dispatch_not_sent_total", "Attempts the broker definitely did not persist (event eligible again)."),
            quarantined: counter(r, "outbox_dispatch_quarantined_total", "Events or receipts quarantined (divergent payload or destination)."),
            fenced: counter(r, "outbox_dispatch_fenced_total", "Writes refused because the claim was taken over (stale worker)."),
            store_retries: counter(r, "outbox_dispatch_store_retries_total", "Retryable database errors a settling batch rode out (answers recorded again, lease renewals skipped)."),
            late_acks: counter(r, "outbox_dispatch_late_acks_total", "ACKs that arrived after their claim's lease ran out (recorded through acceptDispatchReceipt like any other)."),
            batches: counter(r, "outbox_dispatch_batches_total", "Batches settled."),
            head_scans: counter(r, "outbox_dispatch_head_scans_total", "Claims that visited every ordering key's head."),
            successor_claims: counter(r, "outbox_dispatch_successor_claims_total", "Claims of the next events of just-published keys (one probe per key)."),
            oldest_pending: fgauge(r, "outbox_oldest_pending_age_seconds", "Age of the oldest PENDING event, seconds (0 when none)."),
            refused_protocol_rows: gauge(r, "outbox_dispatch_refused_protocol_rows", "Waiting rows of a newer protocol version this dispatcher refuses to claim."),
            alias_active: gauge(r, "outbox_dispatch_alias_active", "1 while this dispatcher may claim (no alias, or its alias names its implementation), 0 while it idles."),
            clock_skew: fgauge(r, "outbox_dispatch_clock_skew_seconds", "How far this dispatcher's clock is ahead of PostgreSQL's, seconds (negative: behind), checked every 30 s."),
            in_flight: gauge(r, "outbox_kafka_in_flight_messages", "Messages handed to the Kafka client and not yet reported on."),
            in_flight_source: in_flight,
        }
    }

    /// Copies the current values.
    pub fn refresh(&self) {
        let m = &self.source;
        let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        follow(&self.claimed, g(&m.claimed));
        follow(&self.sent, g(&m.sent));
        follow(&self.published, g(&m.published));
        follow(&self.duplicates, g(&m.duplicates));
        follow(&self.unknown, g(&m.unknown));
        follow(&self.not_sent, g(&m.not_sent));
        follow(&self.quarantined, g(&m.quarantined));
        follow(&self.fenced, g(&m.fenced));
        follow(&self.store_retries, g(&m.store_retries));
        follow(&self.late_acks, g(&m.late_acks));
        follow(&self.batches, g(&m.batches));
        follow(&self.head_scans, g(&m.head_scans));
        follow(&self.successor_claims, g(&m.successor_claims));
        self.oldest_pending.set(g(&m.oldest_pending_age_ms) as f64 / 1000.0);
        self.refused_protocol_rows.set(g(&m.refused_protocol_rows) as i64);
        self.alias_active.set(g(&m.alias_active) as i64);
        self.clock_skew.set(m.clock_skew_ms.load(Ordering::Relaxed) as f64 / 1000.0);
        if let Some(f) = &self.in_flight_source {
            self.in_flight.set(f() as i64);
        }
    }
}

/// The reconciler's round counters and the report's figures.
#[derive(Clone)]
pub struct ReconcileExport {
    rounds: IntCounter,
    round_errors: IntCounter,
    round_duration: Histogram,
    last_success: Gauge,
    examined: IntCounter,
    resolved_published: IntCounter,
    resolved_quarantined: IntCounter,
    retried: IntCounter,
    rechecks: IntCounter,
    bypass_scanned: IntCounter,
    bypass_submitted: IntCounter,
    events: IntGaugeVec,
    committed: IntGauge,
    receipts: IntGauge,
    duplicate_receipts: IntGauge,
    oldest_pending: Gauge,
    unknown_open: IntGauge,
    unknown_oldest: Gauge,
    unknown_older_than: IntGaugeVec,
    unknown_resolved: IntCounter,
    unknown_p99: GaugeVec,
    unknown_slo: Gauge,
    findings: IntGaugeVec,
    consumer_lag: IntGaugeVec,
    consumed: IntGaugeVec,
    watermark_records: IntCounterVec,
}

/// Finding kinds always exported (0 when none open).
pub const FINDING_KINDS: [&str; 21] = [
    "aged_pending",
    "unconsumed_published",
    "bypass_publish",
    "unknown_past_slo",
    "quarantined",
    "absence_proof_refuted",
    "unregistered_message",
    "receipt_position_lost",
    "log_unavailable",
    "published_without_receipt",
    "foreign_source",
    "unrecorded_copy",
    "divergent_copy",
    "scan_gap",
    "partition_count_changed",
    "stale_watermark",
    "watermark_undeclared_consumer",
    "watermark_moved_back",
    "watermark_beyond_end",
    "watermark_rejected",
    "consumer_gap",
];

/// What became of the records read from the watermark topic (label `result`).
pub const WATERMARK_RESULTS: [&str; 6] = ["applied", "out_of_date", "undeclared", "moved_back", "beyond_end", "rejected"];

impl ReconcileExport {
    /// Registers the reconciler metrics.
    pub fn register(r: &Registry) -> Self {
        ReconcileExport {
            rounds: counter(r, "outbox_reconcile_rounds_total", "Reconciler rounds completed."),
            round_errors: counter(r, "outbox_reconcile_round_errors_total", "Reconciler rounds that failed (database or broker error)."),
            round_duration: {
                let buckets = vec![0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0];
                let h = Histogram::with_opts(HistogramOpts::new("outbox_reconcile_round_duration_seconds", "Duration of one successful reconciler round (resolve, compare, report).").buckets(buckets))
                    .expect("valid metric");
                r.register(Box::new(h.clone())).expect("unique metric");
                h
            },
            last_success: fgauge(r, "outbox_reconcile_last_success_timestamp_seconds", "Unix time of the last successful round."),
            examined: counter(r, "outbox_reconcile_examined_total", "UNKNOWN events taken into RECONCILING."),
            resolved_published: counter(r, "outbox_reconcile_published_total", "UNKNOWN events found in the broker and published."),
            resolved_quarantined: counter(r, "outbox_reconcile_quarantined_total", "UNKNOWN events found divergent and quarantined."),
            retried: counter(r, "outbox_reconcile_retried_total", "UNKNOWN events proven absent: RETRY_CLAIMED to the same destination."),
            rechecks: counter(r, "outbox_reconcile_rechecks_total", "UNKNOWN events still unprovable: next check scheduled."),
            bypass_scanned: counter(r, "outbox_reconcile_bypass_scanned_messages_total", "Messages read by the bypass-publish check."),
            bypass_submitted: counter(
                r,
                "outbox_reconcile_bypass_submitted_total",
                "Copies the bypass check handed to the receipt transaction (an attempt past its in-flight bound whose event was not published, no answer to come).",
            ),
            events: gauge_vec(r, "outbox_events", "Outbox events per state.", &["state"]),
            committed: gauge(r, "outbox_committed_events", "Set 1: committed outbox events (all states)."),
            receipts: gauge(r, "outbox_publish_receipts", "Set 2: accepted primary publish receipts."),
            duplicate_receipts: gauge(r, "outbox_duplicate_receipts", "Duplicate transport receipts kept as evidence."),
            oldest_pending: fgauge(r, "outbox_oldest_pending_age_seconds", "Age of the oldest PENDING event, seconds (0 when none)."),
            unknown_open: gauge(r, "outbox_unknown_open", "Events whose dispatch outcome is unknown now."),
            unknown_oldest: fgauge(r, "outbox_unknown_oldest_age_seconds", "Age of the oldest open UNKNOWN, seconds (0 when none)."),
            unknown_older_than: gauge_vec(
                r,
                "outbox_unknown_open_older_than",
                "Open UNKNOWNs older than age_seconds (cumulative from above: each count includes every older one).",
                &["age_seconds"],
            ),
            unknown_resolved: counter(r, "outbox_unknown_resolutions_total", "UNKNOWNs resolved in this outbox database, ever (published, quarantined, migrated or skipped)."),
            unknown_p99: {
                let g = GaugeVec::new(
                    Opts::new("outbox_unknown_resolution_p99_seconds", "p99 time from DISPATCH_UNKNOWN to resolution, seconds (absent while none was resolved)."),
                    &[],
                )
                .expect("valid metric");
                r.register(Box::new(g.clone())).expect("unique metric");
                g
            },
            unknown_slo: fgauge(r, "outbox_unknown_slo_seconds", "The UNKNOWN resolution SLO the p99 is held to, seconds."),
            findings: gauge_vec(r, "outbox_findings_open", "Open reconciler findings per kind.", &["kind"]),
            consumer_lag: gauge_vec(
                r,
                "outbox_consumer_lag_events",
                "Published events at or above a critical consumer's watermark, per partition.",
                &["consumer_id", "topic", "partition"],
            ),
            consumed: gauge_vec(r, "outbox_consumer_consumed_events", "Set 3: published events a critical consumer's watermark has passed.", &["consumer_id"]),
            watermark_records: {
                let c = IntCounterVec::new(Opts::new("outbox_reconcile_watermark_records_total", "Records read from the watermark topic, by what became of them."), &["result"])
                    .expect("valid metric");
                r.register(Box::new(c.clone())).expect("unique metric");
                for k in WATERMARK_RESULTS {
                    c.with_label_values(&[k]).inc_by(0);
                }
                c
            },
        }
    }

    /// Counts one round of the watermark topic.
    pub fn watermarks(&self, w: &outbox_producer::IngestReport) {
        for (k, n) in WATERMARK_RESULTS.iter().zip([w.applied, w.out_of_date, w.undeclared, w.moved_back, w.beyond_end, w.rejected]) {
            self.watermark_records.with_label_values(&[k]).inc_by(n as u64);
        }
    }

    /// Counts one round that took `took`.
    pub fn round(&self, resolved: &ResolveReport, compared: &CompareReport, took: Duration) {
        self.rounds.inc();
        self.round_duration.observe(took.as_secs_f64());
        self.last_success.set(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0));
        self.examined.inc_by(resolved.examined as u64);
        self.resolved_published.inc_by(resolved.published as u64);
        self.resolved_quarantined.inc_by(resolved.quarantined as u64);
        self.retried.inc_by(resolved.retried as u64);
        self.rechecks.inc_by(resolved.rechecks as u64);
        self.bypass_scanned.inc_by(compared.scanned_messages as u64);
        self.bypass_submitted.inc_by(compared.bypass_submitted as u64);
    }

    /// Counts a failed round.
    pub fn round_failed(&self) {
        self.round_errors.inc();
    }

    /// Sets the gauges from a report (and the oldest open UNKNOWN's age, ms).
    pub fn report(&self, report: &Report, oldest_unknown_ms: Option<i64>) {
        self.events.reset();
        for s in outbox_core::ALL_STATES {
            let n = report.state_counts.iter().find(|(k, _)| *k == s.as_str()).map(|(_, n)| *n).unwrap_or(0);
            self.events.with_label_values(&[s.as_str()]).set(n);
        }
        self.committed.set(report.committed_events);
        self.receipts.set(report.publish_receipts);
        self.duplicate_receipts.set(report.duplicate_receipts);
        self.oldest_pending.set(report.oldest_pending_age_ms.unwrap_or(0) as f64 / 1000.0);
        self.unknown_open.set(report.unknown_open);
        self.unknown_oldest.set(oldest_unknown_ms.unwrap_or(0) as f64 / 1000.0);
        // The report's buckets count the ages in (previous bound, bound];
        // exported as "older than bound", each count taking in every older bucket.
        self.unknown_older_than.reset();
        let buckets = &report.unknown_age_histogram;
        for (i, b) in buckets.iter().enumerate().filter(|(_, b)| b.le_ms != i64::MAX) {
            let older: i64 = buckets[i + 1..].iter().map(|b| b.count).sum();
            self.unknown_older_than.with_label_values(&[(b.le_ms / 1000).to_string().as_str()]).set(older);
        }
        follow(&self.unknown_resolved, report.unknown_resolved.max(0) as u64);
        self.unknown_p99.reset();
        if let Some(p) = report.unknown_p99_resolution_ms {
            self.unknown_p99.with_label_values::<&str>(&[]).set(p as f64 / 1000.0);
        }
        self.unknown_slo.set(report.unknown_slo_ms as f64 / 1000.0);
        self.findings.reset();
        for k in FINDING_KINDS {
            self.findings.with_label_values(&[k]).set(report.findings.iter().filter(|f| f.kind == k).count() as i64);
        }
        self.consumer_lag.reset();
        // Summed over the logs of one topic name and partition (clusters,
        // and the topic ids of a topic recreated under the same name).
        for l in &report.consumer_lag {
            self.consumer_lag.with_label_values(&[l.consumer_id.as_str(), l.topic.as_str(), l.partition.to_string().as_str()]).add(l.lag_events);
        }
        self.consumed.reset();
        for (c, n) in &report.consumed_by_critical {
            self.consumed.with_label_values(&[c.as_str()]).set(*n);
        }
    }
}

/// Registers `outbox_build_info{version, command}` = 1.
pub fn build_info(r: &Registry, command: &str) {
    let g = gauge_vec(r, "outbox_build_info", "Always 1; labels carry the CLI version and the running command.", &["version", "command"]);
    g.with_label_values(&[env!("CARGO_PKG_VERSION"), command]).set(1);
}

/// The text exposition of `registry`.
pub fn encode(registry: &Registry) -> String {
    let mut buf = Vec::new();
    TextEncoder::new().encode(&registry.gather(), &mut buf).expect("text encoding");
    String::from_utf8(buf).expect("utf-8")
}

/// Serves `GET /metrics` on `addr` until the task is dropped; `refresh`
/// runs before each scrape. Returns the bound address (port 0 picks one).
pub async fn serve(
    addr: &str,
    registry: Registry,
    refresh: Arc<dyn Fn() + Send + Sync>,
) -> anyhow::Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
    serve_with_routes(addr, registry, refresh, None).await
}

/// More paths on the metrics listener: `GET path` -> `Some((status line, text body))`.
pub type Routes = Arc<dyn Fn(&str) -> Option<(&'static str, String)> + Send + Sync>;

/// [`serve`], also answering the paths of `routes` (the health checks).
pub async fn serve_with_routes(
    addr: &str,
    registry: Registry,
    refresh: Arc<dyn Fn() + Send + Sync>,
    routes: Option<Routes>,
) -> anyhow::Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await.with_context(|| format!("binding the metrics endpoint on {addr}"))?;
    let bound = listener.local_addr()?;
    let handle = tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else { continue };
            let registry = registry.clone();
            let refresh = refresh.clone();
            let routes = routes.clone();
            tokio::spawn(async move {
                // One small request per connection; bounded in size and time.
                let mut buf = vec![0u8; 8192];
                let mut n = 0;
                let read = tokio::time::timeout(Duration::from_secs(5), async {
                    while n < buf.len() {
                        match sock.read(&mut buf[n..]).await {
                            Ok(0) | Err(_) => break,
                            Ok(k) => {
                                n += k;
                                if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                                    break;
                                }
                            }
                        }
                    }
                })
                .await;
                if read.is_err() {
                    return;
                }
                let head = String::from_utf8_lossy(&buf[..n]);
                let mut parts = head.split_whitespace();
                let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
                let path = path.split('?').next().unwrap_or("");
                let extra = routes.as_ref().filter(|_| matches!(method, "GET" | "HEAD")).and_then(|r| r(path));
                let (status, ctype, body) = match (method, path) {
                    _ if extra.is_some() => {
                        let (status, body) = extra.unwrap_or_default();
                        (status, "text/plain; charset=utf-8", body)
                    }
                    ("GET" | "HEAD", "/metrics") => {
                        refresh();
                        ("200 OK", "text/plain; version=0.0.4; charset=utf-8", encode(&registry))
                    }
                    ("GET" | "HEAD", "/") => ("200 OK", "text/plain; charset=utf-8", "outbox metrics: GET /metrics\n".to_owned()),
                    ("GET" | "HEAD", _) => ("404 Not Found", "text/plain; charset=utf-8", "not found\n".to_owned()),
                    _ => ("405 Method Not Allowed", "text/plain; charset=utf-8", "GET only\n".to_owned()),
                };
                let body = if method == "HEAD" { String::new() } else { body };
                let resp = format!("HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
                let _ = sock.write_all(resp.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    Ok((bound, handle))
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_producer::report::{Bucket, ConsumerLag, Finding};

    fn registry() -> (Registry, DispatchExport) {
        let r = Registry::new();
        build_info(&r, "test");
        let d = DispatchExport::register(&r, Arc::new(DispatchMetrics::default()), Some(Arc::new(|| 7)));
        (r, d)
    }

    fn report() -> Report {
        Report {
            generated_at_ms: 0,
            committed_events: 3,
            publish_receipts: 2,
            duplicate_receipts: 0,
            consumed_by_critical: vec![("billing".into(), 1)],
            state_counts: vec![("PENDING".into(), 1), ("PUBLISHED".into(), 2)],
            oldest_pending_age_ms: Some(2_500),
            unknown_open: 0,
            unknown_age_histogram: vec![Bucket { le_ms: 60_000, count: 0 }, Bucket { le_ms: i64::MAX, count: 0 }],
            unknown_resolved: 0,
            unknown_p99_resolution_ms: None,
            unknown_slo_ms: 900_000,
            unknown_slo_verdict: outbox_producer::SloVerdict::NotApplicable,
            last_reconciler_round: None,
            consumer_lag: vec![ConsumerLag { consumer_id: "billing".into(), cluster_id: "kafka-a".into(), topic: "orders".into(), topic_id: None, partition: 0, committed_offset: 1, published_end_offset: 2, lag_events: 1 }],
            history: vec![],
            lost_logs: vec![],
            findings: vec![Finding { kind: "aged_pending".into(), event_id: "e".into(), consumer_id: None, age_ms: 1, detail: String::new() }],
            consumer_decisions: Vec::new(),
        }
    }

    #[test]
    fn every_exported_metric_is_documented() {
        let docs = include_str!("../METRICS.md");
        let (r, d) = registry();
        d.refresh();
        // Both commands export the oldest PENDING age; a process registers one of the two sets.
        let r2 = Registry::new();
        let rec = ReconcileExport::register(&r2);
        rec.round(&ResolveReport::default(), &CompareReport::default(), Duration::from_millis(40));
        rec.report(&report(), Some(1_000));
        // Histograms appear once observed.
        let m = &d.source.histograms;
        m.published("orders", "order.created.v2", 1_500);
        m.sent("orders", "order.created.v2", Duration::from_millis(3));
        m.claim.observe(0.002);
        m.receipt_transaction.observe(0.004);
        m.batch.observe(0.01);
        let r3 = Registry::new();
        let consumer = Arc::new(outbox_consumer::Metrics::default());
        consumer.register(&r3, "billing").unwrap();
        consumer.histograms.handled("billing", "orders", "order.created.v2", Duration::from_millis(2));
        consumer.histograms.consumed("billing", "orders", "order.created.v2", 2_000);
        let text = format!("{}{}{}", encode(&r), encode(&r2), encode(&r3));
        let names: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).filter_map(|l| l.split_whitespace().next()).collect();
        assert!(names.len() >= 50, "{names:?}");
        for n in names {
            assert!(docs.contains(&format!("`{n}`")), "{n} is not documented in METRICS.md");
        }
        assert!(text.contains("outbox_kafka_in_flight_messages 7"));
        assert!(text.contains("outbox_events{state=\"PUBLISHED\"} 2") && text.contains("outbox_events{state=\"QUARANTINED\"} 0"), "{text}");
        assert!(text.contains("outbox_findings_open{kind=\"aged_pending\"} 1") && text.contains("outbox_findings_open{kind=\"bypass_publish\"} 0"));
        assert!(text.contains("outbox_findings_open{kind=\"foreign_source\"} 0") && text.contains("outbox_findings_open{kind=\"divergent_copy\"} 0"));
        assert!(text.contains("outbox_consumer_lag_events{consumer_id=\"billing\",partition=\"0\",topic=\"orders\"} 1"), "{text}");
        assert!(text.contains("outbox_unknown_open_older_than{age_seconds=\"60\"} 0"), "{text}");
        assert!(!text.contains("outbox_unknown_resolution_p99_seconds") || !text.contains("outbox_unknown_resolution_p99_seconds -1"), "{text}");
        assert!(!text.contains("le=\"") || text.lines().filter(|l| l.contains("le=\"")).all(|l| l.contains("_bucket{")), "le is only for histogram buckets: {text}");
        assert!(text.contains("outbox_oldest_pending_age_seconds 2.5"));
    }

    #[test]
    fn unknown_ages_are_counted_older_than_each_bound_and_p99_appears_once_resolved() {
        let r = Registry::new();
        let rec = ReconcileExport::register(&r);
        let mut rep = report();
        let counts = [1, 2, 3, 0, 0, 4];
        let bounds = [60_000, 300_000, 900_000, 3_600_000, 21_600_000, i64::MAX];
        rep.unknown_age_histogram = bounds.iter().zip(counts).map(|(&le_ms, count)| Bucket { le_ms, count }).collect();
        rep.unknown_open = 10;
        rep.unknown_resolved = 7;
        rep.unknown_p99_resolution_ms = Some(1_500);
        rec.report(&rep, Some(30_000_000));
        let text = encode(&r);
        for (age, n) in [("60", 9), ("300", 7), ("900", 4), ("3600", 4), ("21600", 4)] {
            assert!(text.contains(&format!("outbox_unknown_open_older_than{{age_seconds=\"{age}\"}} {n}\n")), "{age}: {text}");
        }
        assert!(text.contains("outbox_unknown_resolution_p99_seconds 1.5\n") && text.contains("outbox_unknown_resolutions_total 7\n"), "{text}");
        rep.unknown_resolved = 5; // a counter never goes back
        rec.report(&rep, None);
        assert!(encode(&r).contains("outbox_unknown_resolutions_total 7\n"));
    }

    #[test]
    fn counters_follow_the_dispatcher() {
        let r = Registry::new();
        let m = Arc::new(DispatchMetrics::default());
        let d = DispatchExport::register(&r, m.clone(), None);
        m.published.store(5, Ordering::Relaxed);
        d.refresh();
        m.published.store(8, Ordering::Relaxed);
        d.refresh();
        d.refresh();
        assert!(encode(&r).contains("outbox_dispatch_published_total 8"));
    }

    #[tokio::test]
    async fn serves_metrics_over_http() {
        let r = Registry::new();
        build_info(&r, "test");
        let (addr, handle) = serve("127.0.0.1:0", r, Arc::new(|| {})).await.unwrap();
        let get = |path: &'static str| async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).await.unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        };
        let ok = get("/metrics").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK") && ok.contains("text/plain; version=0.0.4") && ok.contains("outbox_build_info{command=\"test\""), "{ok}");
        assert!(get("/other").await.starts_with("HTTP/1.1 404"));
        handle.abort();
    }
}
