//! Observability as Prometheus users consume it: scrapes of `outbox dispatch`,
//! `outbox reconcile` and a consumer's registry after real work (PostgreSQL,
//! librdkafka's in-process Kafka cluster) are linted by `promtool check
//! metrics`; the shipped alert rules pass `promtool check rules` and `promtool
//! test rules`; the Grafana dashboard's and the rules' queries are valid PromQL
//! over documented metrics. promtool comes from Debian's `prometheus` package
//! (scripts/setup.d/50-prometheus.sh); these tests fail without it.

mod common;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use outbox_consumer::{async_trait, ConsumedEvent, ConsumerConfig, HandlerError, IdempotentConsumer};
use outbox_testkit::KafkaFixture;
use serde_json::Value;
use sqlx::{Postgres, Transaction};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn promtool() -> Command {
    let c = Command::new("promtool");
    if which("promtool").is_none() {
        panic!("promtool is not installed: run scripts/setup.d/50-prometheus.sh (Debian package `prometheus`)");
    }
    c
}

fn which(bin: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| std::env::split_paths(&p).map(|d| d.join(bin)).find(|f| f.is_file()))
}

/// `promtool check metrics` on a scrape: lints names, units, types and help.
fn promtool_check_metrics(scrape: &str) {
    let mut child = promtool().args(["check", "metrics"]).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    child.stdin.take().unwrap().write_all(scrape.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.trim().is_empty(), "promtool check metrics: {text}\n--- scrape ---\n{scrape}");
}

/// The conventions promtool does not check: `le` only on histogram buckets,
/// cumulative buckets ending in `+Inf` = `_count`, no millisecond units.
fn assert_conventions(scrape: &str) {
    for line in scrape.lines().filter(|l| !l.starts_with('#')) {
        assert!(!line.contains("le=\"") || line.split('{').next().unwrap().ends_with("_bucket"), "le outside a histogram bucket: {line}");
        assert!(!line.contains("_milliseconds"), "a millisecond unit: {line}");
        assert!(!line.ends_with(" -1"), "-1 as a sentinel: {line}");
    }
    let histograms: Vec<&str> = scrape.lines().filter_map(|l| l.strip_prefix("# TYPE ")).filter(|l| l.ends_with(" histogram")).map(|l| l.split(' ').next().unwrap()).collect();
    for h in histograms {
        assert!(h.ends_with("_seconds"), "{h}: a histogram of durations in seconds");
        // Per label set (without le): buckets non-decreasing, +Inf equals _count.
        let mut series: std::collections::BTreeMap<String, Vec<(f64, f64)>> = Default::default();
        for line in scrape.lines().filter(|l| l.starts_with(&format!("{h}_bucket{{"))) {
            let (labels, value) = line.rsplit_once(' ').unwrap();
            let le = labels.split("le=\"").nth(1).unwrap().split('"').next().unwrap();
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap() };
            let rest: String = labels.split(',').filter(|p| !p.contains("le=\"")).collect::<Vec<_>>().join(",");
            series.entry(rest.replace(&format!("{h}_bucket{{"), "").trim_end_matches('}').to_owned()).or_default().push((le, value.parse().unwrap()));
        }
        assert!(!series.is_empty(), "{h} has no buckets");
        for (labels, mut buckets) in series {
            buckets.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
            assert!(buckets.windows(2).all(|w| w[0].1 <= w[1].1), "{h}{{{labels}}} buckets are not cumulative: {buckets:?}");
            let inf = buckets.last().unwrap();
            assert!(inf.0.is_infinite(), "{h}{{{labels}}} has no +Inf bucket");
            let count_line = if labels.is_empty() { format!("{h}_count ") } else { format!("{h}_count{{{labels}}} ") };
            let count: f64 = scrape.lines().find_map(|l| l.strip_prefix(&count_line)).unwrap_or_else(|| panic!("no {count_line}")).parse().unwrap();
            assert_eq!(inf.1, count, "{h}{{{labels}}}: +Inf bucket != _count");
        }
    }
    for c in scrape.lines().filter_map(|l| l.strip_prefix("# TYPE ")).filter(|l| l.ends_with(" counter")) {
        assert!(c.split(' ').next().unwrap().ends_with("_total"), "counter without _total: {c}");
    }
}

fn value(scrape: &str, series: &str) -> Option<f64> {
    scrape.lines().find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' '))).map(|v| v.parse().unwrap())
}

fn stop(child: &mut std::process::Child, signal: i32) {
    // SAFETY: kill(2) with a child's pid we own.
    unsafe { libc::kill(child.id() as i32, signal) };
    let deadline = Instant::now() + Duration::from_secs(40);
    while child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "child did not stop");
        std::thread::sleep(Duration::from_millis(50));
    }
}

struct Ok;

#[async_trait]
impl outbox_consumer::Handler for Ok {
    async fn handle(&self, _tx: &mut Transaction<'_, Postgres>, _event: &ConsumedEvent) -> Result<Value, HandlerError> {
        Result::Ok(serde_json::json!({"ok": true}))
    }
}

#[tokio::test]
async fn scrapes_after_real_work_pass_promtool_check_metrics() {
    let env = Env::new("cli_obs").await;
    env.ok(&["migrate"]);
    outbox_consumer::migrate(env.pool()).await.unwrap();
    let kafka = KafkaFixture::mock(1).unwrap();
    kafka.create_topic("orders", 3).await.unwrap();
    let broker = kafka.broker(|_| {}).await.unwrap();
    route(env.pool(), broker.cluster_id(), "orders", 3).await;
    outbox_producer::register_consumer(env.pool(), "fulfilment", &["orders"], true, true).await.unwrap();
    for i in 0..5 {
        create_order(env.pool(), &format!("o-{i}")).await;
    }

    // The dispatcher.
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mut dispatch = env
        .outbox()
        .args(["dispatch", "--kafka-bootstrap", kafka.bootstrap(), "--metrics-addr", &metrics_addr, "--name", "obs", "--poll-interval-ms", "100"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while env.count("SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").await < 5 {
        assert!(Instant::now() < deadline, "the dispatcher did not publish the 5 events");
        assert!(dispatch.try_wait().unwrap().is_none(), "outbox dispatch exited early");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, scrape) = http_get(&metrics_addr, "/metrics");
    stop(&mut dispatch, libc::SIGTERM);
    assert!(status.contains("200"), "{status}");
    eprintln!("--- GET /metrics of outbox dispatch ---\n{scrape}");
    let labels = "event_type=\"order.created.v2\",topic=\"orders\"";
    assert!(scrape.contains("# TYPE outbox_commit_to_published_seconds histogram"), "{scrape}");
    assert_eq!(value(&scrape, &format!("outbox_commit_to_published_seconds_count{{{labels}}}")), Some(5.0), "{scrape}");
    assert_eq!(value(&scrape, &format!("outbox_commit_to_published_seconds_bucket{{{labels},le=\"+Inf\"}}")), Some(5.0), "{scrape}");
    assert_eq!(value(&scrape, &format!("outbox_dispatch_send_duration_seconds_count{{{labels}}}")), Some(5.0), "{scrape}");
    for h in ["outbox_dispatch_claim_duration_seconds", "outbox_dispatch_receipt_transaction_duration_seconds", "outbox_dispatch_batch_duration_seconds"] {
        assert!(value(&scrape, &format!("{h}_count")).unwrap_or(0.0) >= 1.0, "{h}: {scrape}");
    }
    assert_eq!(value(&scrape, "outbox_dispatch_published_total"), Some(5.0));
    assert!(scrape.contains("outbox_dispatch_clock_skew_seconds "), "{scrape}");
    assert_conventions(&scrape);
    promtool_check_metrics(&scrape);

    // A consumer, its metrics in the service's own registry.
    let mut config = ConsumerConfig::new("fulfilment", kafka.bootstrap(), &["orders"]);
    config.session_timeout_ms = 6_000;
    config.shutdown_timeout_ms = 5_000;
    let consumer = IdempotentConsumer::new(config, env.pool().clone(), Ok).unwrap();
    let registry = outbox_consumer::prometheus::Registry::new();
    consumer.register_metrics(&registry).unwrap();
    let metrics = consumer.metrics();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run(async move {
        let _ = rx.await;
    }));
    let deadline = Instant::now() + Duration::from_secs(60);
    while metrics.snapshot().applied < 5 {
        assert!(Instant::now() < deadline, "the consumer did not apply the 5 events");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = tx.send(());
    tokio::time::timeout(Duration::from_secs(30), task).await.unwrap().unwrap().unwrap();
    let scrape = encode(&registry);
    let labels = "consumer_id=\"fulfilment\",event_type=\"order.created.v2\",topic=\"orders\"";
    assert_eq!(value(&scrape, &format!("outbox_consumer_commit_to_consumed_seconds_count{{{labels}}}")), Some(5.0), "{scrape}");
    assert_eq!(value(&scrape, &format!("outbox_consumer_handler_duration_seconds_count{{{labels}}}")), Some(5.0), "{scrape}");
    assert_eq!(value(&scrape, "outbox_consumer_applied_events_total{consumer_id=\"fulfilment\"}"), Some(5.0), "{scrape}");
    assert_conventions(&scrape);
    promtool_check_metrics(&scrape);

    // The reconciler.
    outbox_consumer::publish_watermarks(env.pool(), env.pool(), "fulfilment").await.ok();
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mut reconcile = env
        .outbox()
        .args(["reconcile", "--kafka-bootstrap", kafka.bootstrap(), "--interval-ms", "200", "--metrics-addr", &metrics_addr])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let scrape = loop {
        assert!(reconcile.try_wait().unwrap().is_none(), "outbox reconcile exited early");
        if let Result::Ok((_, body)) = std::panic::catch_unwind(|| http_get(&metrics_addr, "/metrics")) {
            if value(&body, "outbox_reconcile_rounds_total").unwrap_or(0.0) >= 1.0 {
                break body;
            }
        }
        assert!(Instant::now() < deadline, "no reconciler round exported");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    stop(&mut reconcile, libc::SIGINT);
    assert!(scrape.contains("outbox_unknown_open_older_than{age_seconds=\"900\"} 0"), "{scrape}");
    assert!(value(&scrape, "outbox_reconcile_round_duration_seconds_count").unwrap_or(0.0) >= 1.0, "{scrape}");
    assert!(scrape.contains("# TYPE outbox_unknown_resolutions_total counter"), "{scrape}");
    assert!(!scrape.contains("outbox_unknown_resolution_p99_seconds "), "absent while nothing was resolved: {scrape}");
    assert_conventions(&scrape);
    promtool_check_metrics(&scrape);
    drop(kafka);
    env.drop_now().await;
}

fn encode(registry: &outbox_consumer::prometheus::Registry) -> String {
    use outbox_consumer::prometheus::Encoder as _;
    let mut buf = Vec::new();
    outbox_consumer::prometheus::TextEncoder::new().encode(&registry.gather(), &mut buf).unwrap();
    String::from_utf8(buf).unwrap()
}

fn promtool_ok(args: &[&str], dir: &Path) -> String {
    let out = promtool().args(args).current_dir(dir).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "promtool {}: {text}", args.join(" "));
    text
}

#[test]
fn shipped_alert_rules_pass_promtool_check_and_test_rules() {
    let dir = repo().join("docs/observability");
    let checked = promtool_ok(&["check", "rules", "alerts.yml"], &dir);
    assert!(checked.contains("SUCCESS"), "{checked}");
    let tested = promtool_ok(&["test", "rules", "alerts.test.yml"], &dir);
    assert!(tested.contains("SUCCESS"), "{tested}");
    // The alerts the operations guide promises.
    let rules = std::fs::read_to_string(dir.join("alerts.yml")).unwrap();
    for alert in ["OutboxNotDispatching", "OutboxUnknownPastSLO", "OutboxQuarantine", "OutboxBypassPublish", "OutboxFindingsOpen", "OutboxReconcilerStale", "OutboxConsumerLag"] {
        assert!(rules.contains(&format!("alert: {alert}\n")), "{alert} missing");
        let tests = std::fs::read_to_string(dir.join("alerts.test.yml")).unwrap();
        assert!(tests.contains(&format!("alertname: {alert}\n")), "{alert} has no promtool test");
    }
}

/// Every `outbox_*` metric a query names, histogram suffixes removed.
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let b = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("outbox_") {
        let start = i + at;
        let mut end = start;
        while end < b.len() && (b[end].is_ascii_lowercase() || b[end].is_ascii_digit() || b[end] == b'_') {
            end += 1;
        }
        let name = &expr[start..end];
        let base = ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(name);
        out.push(base.to_owned());
        i = end;
    }
    out
}

#[test]
fn dashboard_and_rules_query_valid_promql_over_documented_metrics() {
    let docs = std::fs::read_to_string(repo().join("outbox-cli/METRICS.md")).unwrap();
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(repo().join("docs/observability/grafana-dashboard.json")).unwrap()).unwrap();
    let mut exprs: Vec<String> = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().unwrap() {
            exprs.push(t["expr"].as_str().unwrap().to_owned());
        }
    }
    assert!(exprs.len() >= 20, "{exprs:?}");
    let rules = std::fs::read_to_string(repo().join("docs/observability/alerts.yml")).unwrap();
    let rule_exprs: Vec<String> = rules.lines().filter_map(|l| l.trim().strip_prefix("expr: ")).map(str::to_owned).collect();
    assert!(rule_exprs.len() >= 13);
    for e in exprs.iter().chain(&rule_exprs) {
        let names = metric_names(e);
        assert!(!names.is_empty(), "{e} names no outbox metric");
        for n in names {
            assert!(docs.contains(&format!("`{n}`")), "{n} (in {e}) is not a documented metric");
        }
    }
    // promtool parses the dashboard's queries as recording rules.
    let dir = std::env::temp_dir().join(format!("outbox-dashboard-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut file = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, e) in exprs.iter().enumerate() {
        let e = e.replace("$__rate_interval", "5m");
        file.push_str(&format!("      - record: outbox:dashboard_{i}\n        expr: {}\n", serde_json::to_string(&e).unwrap()));
    }
    std::fs::write(dir.join("dashboard.yml"), file).unwrap();
    let out = promtool_ok(&["check", "rules", "dashboard.yml"], &dir);
    assert!(out.contains(&format!("SUCCESS: {} rules found", exprs.len())), "{out}");
    std::fs::remove_dir_all(&dir).ok();
}


#[test]
fn promtool_check_metrics_refuses_what_the_old_endpoint_served() {
    // What `outbox dispatch` and `outbox reconcile` served before: a
    // millisecond gauge and a resolutions gauge that only grows.
    let old = "# HELP outbox_dispatch_batch_max_milliseconds Slowest batch since start, ms.\n# TYPE outbox_dispatch_batch_max_milliseconds gauge\noutbox_dispatch_batch_max_milliseconds 12\n";
    assert!(std::panic::catch_unwind(|| promtool_check_metrics(old)).is_err());
    let old = "# HELP outbox_dispatch_batch_milliseconds_total Sum of batch latencies, ms.\n# TYPE outbox_dispatch_batch_milliseconds_total counter\noutbox_dispatch_batch_milliseconds_total 12\n";
    assert!(std::panic::catch_unwind(|| promtool_check_metrics(old)).is_err());
    let old = "# HELP outbox_unknown_open_by_age x\n# TYPE outbox_unknown_open_by_age gauge\noutbox_unknown_open_by_age{le=\"60\"} 0\n";
    assert!(std::panic::catch_unwind(|| assert_conventions(old)).is_err());
}
