//! The `outbox` binary against real PostgreSQL (a fresh database per test)
//! and the in-process Kafka mock cluster (its ports are real, so the binary
//! can connect to it from its own process).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::CommandFactory;
use common::{create_order, free_port, http_get, outbox_bin, read_message, route, Env};
use outbox_consumer::{async_trait, ConsumedEvent, Handler, HandlerError, Processor};
use outbox_producer::{Dispatcher, DispatcherConfig, PgStore};
use outbox_testkit::{assert_published, KafkaFixture};
use serde_json::Value;
use sqlx::{Postgres, Transaction};

const COMMANDS: [&str; 20] = [
    "migrate", "dispatch", "reconcile", "status", "trace", "report", "purge", "migrate-destination", "takeover", "alias", "shadow", "route", "dead-letters",
    "findings", "unknown", "gaps", "watermarks", "skip", "dispatch-path", "aggregate-heads",
];

#[test]
fn help_lists_every_command_and_documents_every_flag() {
    let out = outbox_bin().arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for c in COMMANDS {
        assert!(help.contains(&format!("\n  {c} ")), "--help lists {c}:\n{help}");
        let sub = outbox_bin().args([c, "--help"]).output().unwrap();
        assert!(sub.status.success(), "{c} --help");
        assert!(String::from_utf8_lossy(&sub.stdout).contains(&format!("Usage: outbox {c}")));
    }
    assert!(help.contains("CONFIGURATION PRECEDENCE"), "precedence documented in --help");
    // Every command and every argument carries a doc comment.
    let cmd = outbox_cli::cli::Cli::command();
    let mut missing = Vec::new();
    for a in cmd.get_arguments() {
        if a.get_help().is_none() {
            missing.push(format!("outbox --{}", a.get_id()));
        }
    }
    for sub in cmd.get_subcommands() {
        if sub.get_about().is_none() {
            missing.push(format!("outbox {}", sub.get_name()));
        }
        for a in sub.get_arguments() {
            if a.get_help().is_none() && a.get_id() != "help" {
                missing.push(format!("outbox {} {}", sub.get_name(), a.get_id()));
            }
        }
    }
    assert!(missing.is_empty(), "undocumented: {missing:?}");
}

#[tokio::test]
async fn migrate_then_status_on_an_empty_outbox() {
    let env = Env::new("cli_status").await;
    let out = env.ok(&["migrate"]);
    // One schema file per crate, each applied once.
    assert_eq!(outbox_producer::MIGRATOR.iter().count(), 1, "the producer's schema is one file");
    assert_eq!(outbox_consumer::MIGRATOR.iter().count(), 1, "the consumer's schema is one file");
    assert!(out.contains("producer schema: applied 1 migration(s): 20261208100001 outbox schema"), "{out}");
    assert!(out.contains("consumer schema: applied 1 migration(s): 20261208200001 consumer schema"), "{out}");
    let out = env.ok(&["migrate"]);
    assert!(out.contains("producer schema: up to date") && out.contains("consumer schema: up to date"), "{out}");
    let status = env.ok(&["status"]);
    assert!(status.contains("events: 0"), "{status}");
    assert!(status.contains("PENDING") && status.contains("QUARANTINED"), "{status}");
    assert!(status.contains("oldest PENDING:  none") && status.contains("UNKNOWN open:    0"), "{status}");
    let json: Value = serde_json::from_str(&env.ok(&["status", "--json"])).unwrap();
    assert_eq!(json["totalEvents"], 0);
    assert_eq!(json["stateCounts"].as_array().unwrap().len(), outbox_core::ALL_STATES.len());
    // The source identity made at migrate time (the CloudEvents ce_source), shown and frozen.
    let source: String = sqlx::query_scalar("SELECT source FROM outbox_identity").fetch_one(env.pool()).await.unwrap();
    assert!(source.starts_with("urn:uuid:") && source.len() == 45, "{source}");
    assert!(status.contains(&format!("source:          {source}")), "{status}");
    assert_eq!(json["source"], source.as_str());
    let refused = sqlx::query("UPDATE outbox_identity SET source = 'urn:x'").execute(env.pool()).await.unwrap_err();
    assert!(refused.to_string().contains("append-only"), "{refused}");

    // No database configured at all: one clear line.
    let out = outbox_bin().arg("status").output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no database: pass --database-url, set DATABASE_URL"));
    env.drop_now().await;
}

/// An operator names the source identity when the schema is made, so that
/// consumers can be configured before the database exists; it never changes
/// after: the same name is accepted again, another or a malformed one is
/// refused, and a later migrate without one keeps it.
#[tokio::test]
async fn migrate_names_the_source_identity_and_keeps_it() {
    let env = Env::new("cli_named_source").await;
    let bad = env.run(&["migrate", "--source", "has space"]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("source identity"), "{bad:?}");
    assert_eq!(env.count("SELECT count(*) FROM pg_tables WHERE tablename = 'outbox_identity'").await, 0, "nothing made for a refused name");

    env.ok(&["migrate", "--source", "urn:example:orders-prod"]);
    let source: String = sqlx::query_scalar("SELECT source FROM outbox_identity").fetch_one(env.pool()).await.unwrap();
    assert_eq!(source, "urn:example:orders-prod");
    assert!(env.ok(&["status"]).contains("source:          urn:example:orders-prod"));
    // The same name again (a deployment passes it on every run), and none.
    env.ok(&["migrate", "--source", "urn:example:orders-prod"]);
    env.ok(&["migrate"]);
    let other = env.run(&["migrate", "--source", "urn:example:orders-staging"]);
    assert_eq!(other.status.code(), Some(1));
    let err = String::from_utf8_lossy(&other.stderr);
    assert!(err.contains("\"urn:example:orders-prod\"") && err.contains("never changes"), "{err}");
    let kept: String = sqlx::query_scalar("SELECT source FROM outbox_identity").fetch_one(env.pool()).await.unwrap();
    assert_eq!(kept, "urn:example:orders-prod");
    env.drop_now().await;
}

/// A database whose migration history records the pre-release migrations
/// (the 38 files the two schema files replaced) is refused by `outbox
/// migrate` with what to do, and left as it was: neither crate's schema is
/// applied over it.
#[tokio::test]
async fn migrate_refuses_a_database_made_by_the_pre_release_migrations() {
    let env = Env::new("cli_prerelease").await;
    // sqlx's history table, as the pre-release migrations left it.
    sqlx::query("CREATE TABLE _sqlx_migrations (version BIGINT PRIMARY KEY, description TEXT NOT NULL, installed_on TIMESTAMPTZ NOT NULL DEFAULT now(), success BOOLEAN NOT NULL, checksum BYTEA NOT NULL, execution_time BIGINT NOT NULL)")
        .execute(env.pool())
        .await
        .unwrap();
    for (side, versions) in [("producer", &outbox_producer::PRE_RELEASE_MIGRATIONS[..2]), ("consumer", &outbox_consumer::PRE_RELEASE_MIGRATIONS[..1])] {
        for v in versions {
            sqlx::query("INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) VALUES ($1, 'pre-release', true, '\\x00', 1)")
                .bind(v)
                .execute(env.pool())
                .await
                .unwrap();
        }
        let only = format!("--only={side}");
        let out = env.run(&["migrate", &only]);
        assert_eq!(out.status.code(), Some(1), "{side}: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("this database's {side} schema was made by pre-release migrations")), "{err}");
        assert!(err.contains("run `outbox migrate` on a new, empty database"), "{err}");
    }
    assert_eq!(env.count("SELECT count(*) FROM _sqlx_migrations").await, 3, "nothing applied over it");
    assert_eq!(env.count("SELECT count(*) FROM pg_tables WHERE tablename LIKE 'outbox_%'").await, 0, "no table made");
    env.drop_now().await;
}

#[tokio::test]
async fn config_precedence_is_flags_then_environment_then_file() {
    let dir = std::env::temp_dir().join(format!("outbox-cli-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("outbox.toml");
    std::fs::write(&file, "[kafka]\nbootstrap = \"file:9092\"\nmessage_timeout_ms = 1111\n[dispatch]\nworkers = 3\nbatch_size = 33\nlease_ms = 20000\nhead_scan_every = 2\n[metrics]\naddr = \"127.0.0.1:1\"\n").unwrap();
    let cfg = |envs: &[(&str, &str)], flags: &[&str]| {
        let mut c = outbox_bin();
        c.args(["dispatch", "--print-config", "--config"]).arg(&file).args(flags);
        for (k, v) in envs {
            c.env(k, v);
        }
        let out = c.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8(out.stdout).unwrap();
        let doc: toml::Table = toml::from_str(&text).unwrap_or_else(|e| panic!("--print-config is not TOML: {e}\n{text}"));
        // What it prints is a --config file this build reads back.
        outbox_cli::config::FileConfig::parse(&text).unwrap_or_else(|e| panic!("--print-config is not a config file: {e}\n{text}"));
        doc
    };
    let get = |doc: &toml::Table, path: &str| -> String {
        let (section, key) = path.split_once('.').unwrap();
        match &doc[section][key] {
            toml::Value::String(s) => s.clone(),
            other => other.to_string(),
        }
    };
    let from_file = cfg(&[], &[]);
    assert_eq!((get(&from_file, "dispatch.workers"), get(&from_file, "dispatch.batch_size")), ("3".into(), "33".into()), "{from_file}");
    assert_eq!((get(&from_file, "kafka.bootstrap"), get(&from_file, "kafka.message_timeout_ms")), ("file:9092".into(), "1111".into()));
    assert_eq!(get(&from_file, "dispatch.poll_interval_ms"), "1000", "defaults fill the rest");
    assert_eq!(get(&from_file, "dispatch.head_scan_every"), "2");
    assert_eq!(get(&cfg(&[("OUTBOX_DISPATCH_HEAD_SCAN_EVERY", "3")], &[]), "dispatch.head_scan_every"), "3");
    assert_eq!(get(&cfg(&[("OUTBOX_DISPATCH_HEAD_SCAN_EVERY", "3")], &["--head-scan-every", "1"]), "dispatch.head_scan_every"), "1");
    assert_eq!(get(&from_file, "dispatch.record_retry_ms"), "30000");
    assert_eq!(get(&cfg(&[("OUTBOX_DISPATCH_RECORD_RETRY_MS", "5000")], &[]), "dispatch.record_retry_ms"), "5000");
    assert_eq!(get(&cfg(&[("OUTBOX_DISPATCH_RECORD_RETRY_MS", "5000")], &["--record-retry-ms", "0"]), "dispatch.record_retry_ms"), "0");
    let env = cfg(&[("OUTBOX_DISPATCH_WORKERS", "5"), ("OUTBOX_KAFKA_BOOTSTRAP", "env:9092"), ("OUTBOX_METRICS_ADDR", "127.0.0.1:2")], &[]);
    assert_eq!((get(&env, "dispatch.workers"), get(&env, "dispatch.batch_size")), ("5".into(), "33".into()));
    assert_eq!((get(&env, "kafka.bootstrap"), get(&env, "metrics.addr")), ("env:9092".into(), "127.0.0.1:2".into()));
    let flags = cfg(&[("OUTBOX_DISPATCH_WORKERS", "5"), ("OUTBOX_KAFKA_BOOTSTRAP", "env:9092")], &["--workers", "7", "--kafka-bootstrap", "flag:9092"]);
    assert_eq!((get(&flags, "dispatch.workers"), get(&flags, "kafka.bootstrap")), ("7".into(), "flag:9092".into()));
    assert!(get(&flags, "dispatch.name").starts_with("dispatcher-"), "the default owner carries the host name");
    // A typo in the file is an error naming the file.
    std::fs::write(&file, "[dispatch]\nwokers = 3\n").unwrap();
    let out = outbox_bin().args(["dispatch", "--print-config", "--config"]).arg(&file).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("outbox.toml"), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}

struct Fulfil;

#[async_trait]
impl Handler for Fulfil {
    async fn handle(&self, _tx: &mut Transaction<'_, Postgres>, e: &ConsumedEvent) -> Result<Value, HandlerError> {
        Ok(serde_json::json!({ "fulfilled": e.event_id.as_str() }))
    }
}


/// `outbox status` reports the oldest PENDING event the outbox sends, as the
/// dispatcher's gauge and the report do: a legacy publisher's events stay
/// PENDING in the table and do not count.
#[tokio::test]
async fn status_oldest_pending_leaves_out_the_legacy_publishers_events() {
    let env = Env::new("cli_status_legacy").await;
    env.ok(&["migrate"]);
    route(env.pool(), "cluster-x", "orders", 3).await;
    outbox_producer::set_takeover(env.pool(), &["*"], 0).await.unwrap();
    let legacy = create_order(env.pool(), "o-legacy").await;
    assert_eq!(legacy.publisher.as_str(), "legacy");
    // The legacy event is an hour old; the outbox's own one is new.
    sqlx::query("UPDATE outbox_events SET created_at_ms = created_at_ms - 3600000 WHERE event_id = $1")
        .bind(legacy.event_id().as_str())
        .execute(env.pool())
        .await
        .unwrap();
    outbox_producer::set_takeover(env.pool(), &["*"], 10_000).await.unwrap();
    assert_eq!(create_order(env.pool(), "o-outbox").await.publisher.as_str(), "outbox");
    let json: Value = serde_json::from_str(&env.ok(&["status", "--json"])).unwrap();
    let age = json["oldestPendingAgeMs"].as_i64().unwrap();
    assert!(age < 600_000, "the outbox's own PENDING event is seconds old, not the legacy one's hour: {age} ms");
}

#[tokio::test]
async fn trace_shows_envelope_attempt_receipt_and_consumer() {
    let env = Env::new("cli_trace").await;
    env.ok(&["migrate"]);
    let kafka = KafkaFixture::mock(1).unwrap();
    kafka.create_topic("orders", 3).await.unwrap();
    let broker = kafka.broker(|c| c.message_timeout_ms = 10_000).await.unwrap();
    route(env.pool(), broker.cluster_id(), "orders", 3).await;
    let e = create_order(env.pool(), "o-42").await;
    let id = e.event_id().clone();

    let before = env.ok(&["trace", id.as_str()]);
    assert!(before.contains("state              PENDING") && before.contains("publish receipt: none"), "{before}");

    let d = Arc::new(Dispatcher::new(PgStore::new(env.pool().clone()), broker, DispatcherConfig { name: "clitest".into(), ..Default::default() }).unwrap());
    assert_eq!(d.dispatch_once("clitest-0").await.unwrap().published, 1);
    let receipt = assert_published(env.pool(), &id).await;
    let processor = Processor::new("fulfilment", env.pool().clone(), Fulfil).unwrap();
    processor.process_message(&read_message(kafka.bootstrap(), "orders", receipt.partition, receipt.offset)).await.unwrap();

    let t = env.ok(&["trace", id.as_str()]);
    assert!(t.contains(&format!("event {id}")), "{t}");
    assert!(t.contains("state              PUBLISHED"), "{t}");
    assert!(t.contains("outboxEnvelope.v1  aggregate order/o-42@1 type order.created.v2"), "{t}");
    assert!(t.contains("(verified)") && !t.contains("MISMATCH"), "{t}");
    assert!(t.contains(&format!("destination.v1     {}/orders partition {}", e.destination.cluster_id, receipt.partition)), "{t}");
    assert!(t.contains("attempts: 1"), "{t}");
    assert!(t.contains(&format!("#1 {} gen 1 owner clitest-0 claim generation 1 ACKED", receipt.attempt_id)), "{t}");
    assert!(t.contains(&format!("primary   gen 1 {}/orders partition {} offset {} attempt {}", e.destination.cluster_id, receipt.partition, receipt.offset, receipt.attempt_id)), "{t}");
    assert!(t.contains("consumers: 1") && t.contains(&format!("fulfilment consumed gen 1 at orders/{} offset {}", receipt.partition, receipt.offset)), "{t}");

    let j: Value = serde_json::from_str(&env.ok(&["trace", id.as_str(), "--json"])).unwrap();
    assert_eq!(j["primaryReceipts"][0]["offset"], receipt.offset);
    assert_eq!(j["attempts"][0]["state"], "ACKED");
    assert_eq!(j["envelopes"][0]["envelope"]["eventId"], id.as_str());
    assert_eq!(j["consumerReceipts"][0]["consumerId"], "fulfilment");

    let missing = env.run(&["trace", "evt-01J0000000000000000000000A"]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no outbox event evt-01J0000000000000000000000A"));
    let bad = env.run(&["trace", "order-42"]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("is not an eventId"));
    drop(kafka);
    env.drop_now().await;
}

/// `outbox trace` and `outbox status` on the stream path: an event that is
/// a stream row (no row in the exception lane) is traced with its state,
/// its frozen envelope and destination, its batch's attempt and its
/// receipt, and counted by `status` (before, trace answered "no outbox
/// event" and status counted no events).
#[tokio::test]
async fn trace_and_status_read_a_stream_event() {
    let env = Env::new("cli_trace_stream").await;
    env.ok(&["migrate"]);
    let kafka = KafkaFixture::mock(1).unwrap();
    kafka.create_topic("orders", 3).await.unwrap();
    let broker = kafka.broker(|c| c.message_timeout_ms = 10_000).await.unwrap();
    route(env.pool(), broker.cluster_id(), "orders", 3).await;
    outbox_producer::set_dispatch_path(env.pool(), outbox_producer::DispatchPath::Stream).await.unwrap();
    let e = create_order(env.pool(), "o-7").await;
    let id = e.event_id().clone();

    let before = env.ok(&["trace", id.as_str()]);
    assert!(before.contains(&format!("event {id}")) && before.contains("state              PENDING") && before.contains("publish receipt: none"), "{before}");
    let status: Value = serde_json::from_str(&env.ok(&["status", "--json"])).unwrap();
    assert_eq!(status["totalEvents"], 1, "{status}");

    let d = Arc::new(Dispatcher::new(PgStore::new(env.pool().clone()), broker, DispatcherConfig { name: "clitest".into(), ..Default::default() }).unwrap());
    assert_eq!(d.dispatch_once("clitest-0").await.unwrap().published, 1);
    let receipt = assert_published(env.pool(), &id).await;
    let t = env.ok(&["trace", id.as_str()]);
    assert!(t.contains("state              PUBLISHED"), "{t}");
    assert!(t.contains("outboxEnvelope.v1  aggregate order/o-7@1") && t.contains("(verified)") && !t.contains("MISMATCH"), "{t}");
    assert!(t.contains("attempts: 1") && t.contains(&format!("#1 {} gen 1 owner clitest-0", receipt.attempt_id)) && t.contains("ACKED"), "{t}");
    assert!(t.contains(&format!("primary   gen 1 {}/orders partition {} offset {} attempt {}", e.destination.cluster_id, receipt.partition, receipt.offset, receipt.attempt_id)), "{t}");
    let j: Value = serde_json::from_str(&env.ok(&["trace", id.as_str(), "--json"])).unwrap();
    assert_eq!(j["event"]["path"], "stream");
    let status: Value = serde_json::from_str(&env.ok(&["status", "--json"])).unwrap();
    assert_eq!(status["totalEvents"], 1, "{status}");
    drop(kafka);
    env.drop_now().await;
}

#[tokio::test]
async fn dispatch_process_publishes_serves_metrics_and_drains_on_sigterm() {
    let env = Env::new("cli_dispatch").await;
    env.ok(&["migrate"]);
    let kafka = KafkaFixture::mock(1).unwrap();
    kafka.create_topic("orders", 3).await.unwrap();
    let broker = kafka.broker(|_| {}).await.unwrap();
    route(env.pool(), broker.cluster_id(), "orders", 3).await;
    for i in 0..5 {
        create_order(env.pool(), &format!("o-{i}")).await;
    }
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mut child = env
        .outbox()
        .args(["dispatch", "--kafka-bootstrap", kafka.bootstrap(), "--metrics-addr", &metrics_addr, "--name", "clidispatch", "--poll-interval-ms", "100", "--log-format", "json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while env.count("SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").await < 5 {
        assert!(Instant::now() < deadline, "the dispatcher did not publish the 5 events");
        assert!(child.try_wait().unwrap().is_none(), "outbox dispatch exited early");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // An event emitted while it runs is woken by NOTIFY.
    create_order(env.pool(), "o-late").await;
    while env.count("SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").await < 6 {
        assert!(Instant::now() < deadline, "late event not published");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, body) = http_get(&metrics_addr, "/metrics");
    assert!(status.contains("200"), "{status}");
    assert!(body.contains("# TYPE outbox_dispatch_published_total counter"), "{body}");
    assert!(body.contains("outbox_dispatch_published_total 6"), "{body}");
    assert!(body.contains("outbox_dispatch_claimed_total 6"), "{body}");
    assert!(body.contains("outbox_oldest_pending_age_seconds"), "{body}");
    assert!(body.contains("outbox_build_info{command=\"dispatch\""), "{body}");
    assert!(http_get(&metrics_addr, "/nope").0.contains("404"));

    // SAFETY: kill(2) with a child's pid we own.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(40);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "outbox dispatch did not stop after SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(status.success(), "exit {status:?}: {stderr}");
    let stopped = stderr.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).find(|v| v["message"] == "dispatcher stopped").unwrap_or_else(|| panic!("a JSON 'dispatcher stopped' line: {stderr}"));
    assert_eq!(stopped["published"], 6);
    drop(kafka);
    env.drop_now().await;
}

#[tokio::test]
async fn reconcile_once_report_purge_and_migrate_destination() {
    let env = Env::new("cli_ops").await;
    env.ok(&["migrate"]);
    let kafka = KafkaFixture::mock(1).unwrap();
    kafka.create_topic("orders", 3).await.unwrap();
    kafka.create_topic("orders-eu", 3).await.unwrap();
    let broker = kafka.broker(|c| c.message_timeout_ms = 10_000).await.unwrap();
    route(env.pool(), broker.cluster_id(), "orders", 3).await;
    let published: Vec<_> = {
        let mut v = Vec::new();
        for i in 0..2 {
            v.push(create_order(env.pool(), &format!("p-{i}")).await);
        }
        v
    };
    let d = Arc::new(Dispatcher::new(PgStore::new(env.pool().clone()), broker.clone(), DispatcherConfig { name: "cliops".into(), ..Default::default() }).unwrap());
    assert_eq!(d.dispatch_once("cliops-0").await.unwrap().published, 2);
    let pending = create_order(env.pool(), "stuck").await;
    tokio::time::sleep(Duration::from_millis(20)).await;

    // One reconciler round: the stuck PENDING event is a finding.
    let out = env.run(&["reconcile", "--once", "--kafka-bootstrap", kafka.bootstrap(), "--aged-pending-ms", "1", "--fail-on-findings"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "findings -> exit 2: {stdout}");
    assert!(stdout.contains("round: examined 0 UNKNOWN") && stdout.contains(&format!("aged_pending {}", pending.event_id())), "{stdout}");
    let status = env.ok(&["status"]);
    assert!(status.contains("open findings:   aged_pending=1"), "{status}");

    // The report, as text, JSON and HTML.
    let html = std::env::temp_dir().join(format!("outbox-cli-report-{}.html", std::process::id()));
    let text = env.ok(&["report", "--html", html.to_str().unwrap()]);
    assert!(text.contains("committed outbox events   3") && text.contains("accepted publish receipts 2"), "{text}");
    let page = std::fs::read_to_string(&html).unwrap();
    std::fs::remove_file(&html).unwrap();
    for id in ["chart-states", "chart-unknown-age", "chart-lag", "findings"] {
        assert!(page.contains(&format!("id=\"{id}\"")), "{id}");
    }
    assert!(page.contains(pending.event_id().as_str()));
    let j: Value = serde_json::from_str(&env.ok(&["report", "--json"])).unwrap();
    assert_eq!(j["committedEvents"], 3);
    assert!(!j["history"].as_array().unwrap().is_empty(), "the reconciler round recorded a snapshot");
    assert_eq!(env.run(&["report", "--fail-on-findings"]).status.code(), Some(2));

    // Purge: a dry run writes nothing; --execute retains then purges, batch by batch.
    let dry = env.ok(&["purge", "--replay-window-ms", "0"]);
    assert!(dry.contains("dry run") && dry.contains("2 event(s) would be retained") && dry.contains("2 event(s) would be purged"), "{dry}");
    assert_eq!(env.count("SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").await, 2);
    let run = env.ok(&["purge", "--execute", "--replay-window-ms", "0", "--batch-size", "1"]);
    assert!(run.contains("batch    1: 1 retained") && run.contains("2 event(s) were purged"), "{run}");
    assert_eq!(env.count("SELECT count(*) FROM outbox_events WHERE state = 'PURGED' AND payload IS NULL").await, 2);
    let t = env.ok(&["trace", published[0].event_id().as_str()]);
    assert!(t.contains("state              PURGED") && t.contains("purged:"), "tombstone keeps the receipt: {t}");

    // Destination migration: a dry run, a refusal (published), then the move.
    // The dry run runs the same eligibility check as the move: it asks the old target.
    let dry = env.ok(&["migrate-destination", pending.event_id().as_str(), "--operator", "ops-alice", "--to-topic", "orders-eu", "--dry-run", "--kafka-bootstrap", kafka.bootstrap()]);
    assert!(dry.contains("/orders-eu partition") && dry.contains("dry run: nothing changed"), "{dry}");
    let dry_refused = env.run(&["migrate-destination", published[1].event_id().as_str(), "--operator", "ops-alice", "--to-topic", "orders-eu", "--dry-run", "--kafka-bootstrap", kafka.bootstrap()]);
    assert_eq!(dry_refused.status.code(), Some(3), "a dry run of a published event passed the check");
    let refused = env.run(&["migrate-destination", published[1].event_id().as_str(), "--operator", "ops-alice", "--to-topic", "orders-eu", "--kafka-bootstrap", kafka.bootstrap()]);
    assert_eq!(refused.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&refused.stdout).contains("refused:"));
    let moved = env.ok(&["migrate-destination", pending.event_id().as_str(), "--operator", "ops-alice", "--to-topic", "orders-eu", "--kafka-bootstrap", kafka.bootstrap()]);
    assert!(moved.contains("migrated: envelope generation 1 -> 2"), "{moved}");
    let t = env.ok(&["trace", pending.event_id().as_str()]);
    assert!(t.contains("envelope generation 1") && t.contains("envelope generation 2") && t.contains("migration: ") && t.contains("operator=ops-alice"), "{t}");
    assert!(t.contains("routes to          ") && t.contains("/orders-eu/"), "{t}");
    drop(kafka);
    env.drop_now().await;
}

#[tokio::test]
async fn reconcile_loop_exports_report_metrics_and_stops_on_sigint() {
    let env = Env::new("cli_reconcile_loop").await;
    env.ok(&["migrate"]);
    let kafka = KafkaFixture::mock(1).unwrap();
    kafka.create_topic("orders", 3).await.unwrap();
    let broker = kafka.broker(|_| {}).await.unwrap();
    route(env.pool(), broker.cluster_id(), "orders", 3).await;
    outbox_producer::register_consumer(env.pool(), "billing", &["orders"], true, true).await.unwrap();
    let stuck = create_order(env.pool(), "stuck").await;
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mut child = env
        .outbox()
        .args(["reconcile", "--kafka-bootstrap", kafka.bootstrap(), "--interval-ms", "200", "--aged-pending-ms", "1", "--metrics-addr", &metrics_addr])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let body = loop {
        assert!(child.try_wait().unwrap().is_none(), "outbox reconcile exited early");
        if let Ok((_, body)) = std::panic::catch_unwind(|| http_get(&metrics_addr, "/metrics")) {
            if body.contains("outbox_findings_open{kind=\"aged_pending\"} 1") {
                break body;
            }
        }
        assert!(Instant::now() < deadline, "no aged_pending finding exported");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(body.contains("outbox_events{state=\"PENDING\"} 1"), "{body}");
    assert!(body.contains("outbox_committed_events 1") && body.contains("outbox_unknown_open 0"), "{body}");
    assert!(body.contains("outbox_consumer_consumed_events{consumer_id=\"billing\"} 0"), "{body}");
    assert!(body.contains("outbox_unknown_slo_seconds 900"), "{body}");
    assert!(body.contains("outbox_reconcile_last_success_timestamp_seconds"), "{body}");
    // The watermark topic is read every round (nobody publishes to it here).
    assert!(body.contains("outbox_reconcile_watermark_records_total{result=\"moved_back\"} 0"), "{body}");
    assert!(body.contains("outbox_findings_open{kind=\"stale_watermark\"} 0"), "{body}");
    let rounds: f64 = body.lines().find_map(|l| l.strip_prefix("outbox_reconcile_rounds_total ")).unwrap().parse().unwrap();
    assert!(rounds >= 1.0);
    let status = env.ok(&["status"]);
    assert!(status.contains("consumer billing [critical,mandatory]"), "{status}");
    // SAFETY: kill(2) with a child's pid we own.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "outbox reconcile did not stop after SIGINT");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let out = child.wait_with_output().unwrap();
    assert!(status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("reconciler stopping"));
    let t = env.ok(&["trace", stuck.event_id().as_str()]);
    assert!(t.contains("finding: ") && t.contains("kind=aged_pending"), "{t}");
    drop(kafka);
    env.drop_now().await;
}

#[tokio::test]
async fn rollout_commands_set_the_takeover_policy_and_switch_the_alias() {
    let env = Env::new("cli_rollout").await;
    env.ok(&["migrate"]);
    assert!(env.ok(&["takeover", "show"]).contains("takeover: none (the outbox sends every event)"));
    let out = env.ok(&["takeover", "set", "--percent-bp", "0"]);
    assert!(out.contains("takeover generation 1: the outbox sends 0.00% of event types []"), "{out}");
    let out = env.ok(&["takeover", "set", "--event-type", "order.created.v2", "--event-type", "audit.logged.v1", "--percent-bp", "500"]);
    assert!(out.contains("takeover generation 2: the outbox sends 5.00% of event types [order.created.v2, audit.logged.v1]"), "{out}");
    let out = env.ok(&["alias", "switch", "orders-dispatch", "outbox-rs/0.1.0"]);
    assert!(out.contains("alias orders-dispatch: none -> outbox-rs/0.1.0"), "{out}");
    let out = env.ok(&["alias", "switch", "orders-dispatch", "outbox-rs/0.0.9", "--protocol-version", "1"]);
    assert!(out.contains("alias orders-dispatch: outbox-rs/0.1.0 -> outbox-rs/0.0.9"), "{out}");
    assert!(env.ok(&["alias", "show"]).contains("orders-dispatch\toutbox-rs/0.0.9\tprotocol 1"));
    let history: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_dispatcher_alias_history").fetch_one(env.pool()).await.unwrap();
    assert_eq!(history, 2);
    env.drop_now().await;
}

/// Every finding kind the reconciler records and the metrics export is one
/// the database accepts: the schema's kind check lists them, and one that
/// forgot a kind would make that finding's insert fail.
#[tokio::test]
async fn the_schema_accepts_every_finding_kind() {
    let env = Env::new("cli_finding_kinds").await;
    outbox_producer::migrate(env.pool()).await.unwrap();
    for kind in outbox_cli::metrics::FINDING_KINDS {
        let r = sqlx::query("INSERT INTO outbox_findings (kind, event_id, detail, age_ms, first_seen_ms, last_seen_ms) VALUES ($1, 'evt-x', 'test', 0, 0, 0)")
            .bind(kind)
            .execute(env.pool())
            .await;
        assert!(r.is_ok(), "finding kind {kind} refused by the schema: {r:?}");
    }
    let refused = sqlx::query("INSERT INTO outbox_findings (kind, event_id, detail, age_ms, first_seen_ms, last_seen_ms) VALUES ('no_such_kind', 'evt-x', 'test', 0, 0, 0)")
        .execute(env.pool())
        .await;
    assert!(refused.is_err(), "the check still refuses unknown kinds");
    // A finding that stalls events is spelled out by `outbox status`, with what to do.
    sqlx::query("INSERT INTO outbox_findings (kind, event_id, detail, age_ms, first_seen_ms, last_seen_ms) VALUES ('partition_count_changed', 'orders/partitions', $1, 0, 0, 0)")
        .bind(outbox_core::compare::partition_count_finding("kafka-a", "orders", 4, &[("order.created".into(), 6)]).unwrap())
        .execute(env.pool())
        .await
        .unwrap();
    let status = env.ok(&["status"]);
    assert!(status.contains("  STALLED: topic kafka-a/orders has 4 partitions; its route policies froze more: order.created (6)") && status.contains("increase the topic's partition count to 6"), "{status}");
    env.drop_now().await;
}

/// `outbox skip` (issue 47): a QUARANTINED head holds its key, so the key's
/// next event is not claimable; the skip of a PENDING event (or without a
/// reason) is refused with exit 3 and changes nothing; the skip of the head
/// closes it SKIPPED, records who and why in outbox_audit, and the next
/// event is claimable; `outbox trace` and `outbox status` show SKIPPED.
#[tokio::test]
async fn skip_frees_a_key_blocked_by_its_quarantined_head() {
    use outbox_core::{EmitRequest, OutboxStore};
    let env = Env::new("cli_skip").await;
    env.ok(&["migrate"]);
    route(env.pool(), "cluster-x", "orders", 3).await;
    // Two events of one order (one key), versions 1 and 2.
    let mut ids = Vec::new();
    for v in 1..=2i64 {
        let key = format!("skip-o-1-v{v}");
        let request = EmitRequest {
            command_key: &key,
            tenant: "tenant-7",
            aggregate_type: "order",
            aggregate_id: "o-1",
            aggregate_version: v,
            event_type: "order.created.v2",
            payload_schema: "order-v2",
            payload: br#"{"order":"o-1"}"#,
        };
        let mut tx = env.pool().begin().await.unwrap();
        ids.push(outbox_producer::emit(&mut tx, &request, &outbox_producer::EmitOptions::default()).await.unwrap().envelope.event_id);
        tx.commit().await.unwrap();
    }
    let (head, next) = (ids[0].as_str(), ids[1].as_str());

    let pending = env.run(&["skip", head, "--operator", "ops-alice", "--reason", "too early"]);
    assert_eq!(pending.status.code(), Some(3), "the skip of a PENDING event was not refused");
    let out = String::from_utf8_lossy(&pending.stdout);
    assert!(out.contains("refused:") && out.contains("PENDING"), "{out}");
    assert_eq!(env.count("SELECT count(*) FROM outbox_audit WHERE action = 'skip'").await, 0);

    sqlx::query("UPDATE outbox_events SET state = 'QUARANTINED' WHERE event_id = $1").bind(head).execute(env.pool()).await.unwrap();
    let store = PgStore::new(env.pool().clone());
    assert!(store.claim_batch("cli-skip-d", 10, 30_000).await.unwrap().is_empty(), "the next event was claimable behind a QUARANTINED head");

    let no_reason = env.run(&["skip", head, "--operator", "ops-alice", "--reason", " "]);
    assert_eq!(no_reason.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&no_reason.stdout).contains("needs a reason"));
    let missing = env.run(&["skip", head, "--operator", "ops-alice"]);
    assert!(!missing.status.success() && String::from_utf8_lossy(&missing.stderr).contains("--reason"), "--reason is required");

    let out = env.ok(&["skip", head, "--operator", "ops-alice", "--reason", "poison payload, OPS-47"]);
    assert!(out.contains(&format!("skipped: {head} QUARANTINED -> SKIPPED by ops-alice")), "{out}");
    let (actor, detail): (String, Value) = sqlx::query_as("SELECT actor, detail FROM outbox_audit WHERE event_id = $1 AND action = 'skip'").bind(head).fetch_one(env.pool()).await.unwrap();
    assert_eq!(actor, "ops-alice");
    assert_eq!(detail["reason"], "poison payload, OPS-47");
    assert_eq!(detail["from_state"], "QUARANTINED");

    let claimed = store.claim_batch("cli-skip-d", 10, 30_000).await.unwrap();
    assert_eq!(claimed.iter().map(|c| c.token.event_id.as_str()).collect::<Vec<_>>(), vec![next], "the next event of the key is claimable after the skip");

    let again: Value = serde_json::from_str(&String::from_utf8_lossy(&env.run(&["skip", head, "--operator", "ops-alice", "--reason", "again", "--json"]).stdout)).unwrap();
    assert_eq!(again["outcome"], "refused");
    assert!(again["reason"].as_str().unwrap().contains("already SKIPPED"), "{again}");
    let t = env.ok(&["trace", head]);
    assert!(t.contains("state              SKIPPED") && t.contains("ops-alice"), "{t}");
    assert!(env.ok(&["status"]).contains("SKIPPED"));
    env.drop_now().await;
}

/// `outbox migrate-destination --to-topic` from a route that recorded its
/// topic's id: the new destination is of another topic, which that id does
/// not name, so it names none (destination.v1) and is sent; keeping the
/// old topic's id would have made every send of it refused as a recreated
/// topic.
#[tokio::test]
async fn migrate_destination_to_another_topic_does_not_keep_the_old_topic_id() {
    let env = Env::new("cli_migrate_topic_id").await;
    env.ok(&["migrate"]);
    let kafka = KafkaFixture::mock(1).unwrap();
    kafka.create_topic("orders", 3).await.unwrap();
    kafka.create_topic("orders-eu", 3).await.unwrap();
    let broker = kafka.broker(|c| c.message_timeout_ms = 10_000).await.unwrap();
    let id = broker.topic_id("orders").await.unwrap().expect("the mock cluster gives topic ids");
    let policy = outbox_core::RoutePolicy { topic_id: Some(id.clone()), ..outbox_core::RoutePolicy::new(common::ORDER_CREATED, broker.cluster_id(), "orders", 3) };
    outbox_producer::routes::revise(env.pool(), &policy).await.unwrap();
    let pending = create_order(env.pool(), "stuck").await;
    assert_eq!(pending.destination.topic_id.as_deref(), Some(id.as_str()));
    let moved = env.ok(&["migrate-destination", pending.event_id().as_str(), "--operator", "ops-alice", "--to-topic", "orders-eu", "--kafka-bootstrap", kafka.bootstrap()]);
    assert!(moved.contains("migrated: envelope generation 1 -> 2"), "{moved}");
    let canonical: Vec<u8> = sqlx::query_scalar("SELECT destination_canonical FROM outbox_envelopes WHERE event_id = $1 AND envelope_generation = 2")
        .bind(pending.event_id().as_str())
        .fetch_one(env.pool())
        .await
        .unwrap();
    let moved_to = outbox_core::Destination::from_canonical(&canonical).unwrap();
    assert_eq!((moved_to.topic.as_str(), moved_to.topic_id.as_deref()), ("orders-eu", None));
    let d = Dispatcher::new(PgStore::new(env.pool().clone()), broker.clone(), DispatcherConfig { name: "cliops".into(), ..Default::default() }).unwrap();
    let r = d.dispatch_once("cliops-0").await.unwrap();
    assert_eq!((r.published, r.not_sent), (1, 0), "{r:?}");
    drop(kafka);
    env.drop_now().await;
}

/// `outbox migrate-destination` of a QUARANTINED event (issue 47's other
/// way out of a blocked key): one stopped before any send (its destination
/// found unreadable at the claim) is re-sent under a new envelope
/// generation to the destination its route gives now, the same one, with
/// the proof and its state recorded in the migration receipt, and is then
/// published; one with an attempt that may be in the topic is refused
/// (exit 3) and stays QUARANTINED.
#[tokio::test]
async fn migrate_destination_resends_a_quarantined_event_nothing_of_which_was_sent() {
    use outbox_core::OutboxStore;
    let env = Env::new("cli_resend").await;
    env.ok(&["migrate"]);
    let kafka = KafkaFixture::mock(1).unwrap();
    kafka.create_topic("orders", 3).await.unwrap();
    let broker = kafka.broker(|c| c.message_timeout_ms = 10_000).await.unwrap();
    route(env.pool(), broker.cluster_id(), "orders", 3).await;
    let unsent = create_order(env.pool(), "resend-1").await;
    let sent = create_order(env.pool(), "resend-2").await;
    let store = PgStore::new(env.pool().clone());
    let claimed = store.claim_batch("cli-resend-d", 10, 30_000).await.unwrap();
    assert_eq!(claimed.len(), 2);
    for c in &claimed {
        if c.token.event_id == *unsent.event_id() {
            store.quarantine_claimed(&c.token, "destination_unreadable", serde_json::json!({"detail": "test"})).await.unwrap();
        } else {
            store.register_attempt(&c.token).await.unwrap();
        }
    }
    // The second's attempt is registered (its send may be in the topic) when it is quarantined.
    sqlx::query("UPDATE outbox_events SET state = 'QUARANTINED' WHERE event_id = $1").bind(sent.event_id().as_str()).execute(env.pool()).await.unwrap();

    let refused = env.run(&["migrate-destination", sent.event_id().as_str(), "--operator", "ops-alice", "--kafka-bootstrap", kafka.bootstrap()]);
    assert_eq!(refused.status.code(), Some(3), "{}", String::from_utf8_lossy(&refused.stdout));
    assert!(String::from_utf8_lossy(&refused.stdout).contains("an earlier attempt may be in the old target"), "{}", String::from_utf8_lossy(&refused.stdout));

    let moved = env.ok(&["migrate-destination", unsent.event_id().as_str(), "--operator", "ops-alice", "--kafka-bootstrap", kafka.bootstrap()]);
    assert!(moved.contains("(QUARANTINED)") && moved.contains("migrated: envelope generation 1 -> 2"), "{moved}");
    let (from, to, proof): (String, String, Value) = sqlx::query_as("SELECT from_destination_digest, to_destination_digest, proof FROM outbox_migration_receipts WHERE event_id = $1")
        .bind(unsent.event_id().as_str())
        .fetch_one(env.pool())
        .await
        .unwrap();
    assert_eq!(from, to, "a re-send keeps the destination its route gives");
    assert_eq!((proof["kind"].as_str(), proof["from_state"].as_str()), (Some("never_persisted"), Some("QUARANTINED")), "{proof}");
    let states: Vec<(String, String)> = sqlx::query_as("SELECT event_id, state FROM outbox_events ORDER BY seq").fetch_all(env.pool()).await.unwrap();
    assert_eq!(states, vec![(unsent.event_id().to_string(), "PENDING".into()), (sent.event_id().to_string(), "QUARANTINED".into())]);

    let d = Dispatcher::new(store, broker.clone(), DispatcherConfig { name: "cliresend".into(), ..Default::default() }).unwrap();
    let r = d.dispatch_once("cliresend-0").await.unwrap();
    assert_eq!((r.published, r.not_sent), (1, 0), "{r:?}");
    let generation: i32 = sqlx::query_scalar("SELECT envelope_generation FROM outbox_events WHERE event_id = $1 AND state = 'PUBLISHED'")
        .bind(unsent.event_id().as_str())
        .fetch_one(env.pool())
        .await
        .unwrap();
    assert_eq!(generation, 2);
    drop(kafka);
    env.drop_now().await;
}

/// `outbox dispatch-path`: prints the path in force (chains on a new
/// database), switches it with --set (the database's setting, and the
/// buckets' lease rows for the stream), says when nothing changed, and
/// refuses a path it does not know.
#[tokio::test]
async fn dispatch_path_prints_and_switches_the_path() {
    let env = Env::new("cli_dispatch_path").await;
    env.ok(&["migrate"]);
    route(env.pool(), "cluster-x", "orders", 3).await;
    assert_eq!(env.ok(&["dispatch-path"]).trim(), "dispatch path: chains");
    let out = env.ok(&["dispatch-path", "--set", "stream"]);
    assert!(out.starts_with("dispatch path: chains -> stream;"), "{out}");
    assert_eq!(outbox_producer::dispatch_path(env.pool()).await.unwrap(), outbox_producer::DispatchPath::Stream);
    assert_eq!(env.count("SELECT count(*) FROM outbox_bucket_leases WHERE cluster_id = 'cluster-x'").await, 64);
    assert_eq!(env.ok(&["dispatch-path", "--set", "stream"]).trim(), "dispatch path: stream (unchanged)");
    let bad = env.run(&["dispatch-path", "--set", "both"]);
    assert_eq!(bad.status.code(), Some(2), "{}", String::from_utf8_lossy(&bad.stderr));
    assert_eq!(env.ok(&["dispatch-path"]).trim(), "dispatch path: stream");
    assert!(env.ok(&["dispatch-path", "--set", "chains"]).starts_with("dispatch path: stream -> chains;"));
    env.drop_now().await;
}

/// `outbox aggregate-heads`: prints the setting in force
/// (snapshot_isolation on a new database), switches it with --set (a READ
/// COMMITTED emit then writes its aggregate's head row), says when nothing
/// changed, and refuses a setting it does not know.
#[tokio::test]
async fn aggregate_heads_prints_and_switches_the_setting() {
    let env = Env::new("cli_aggregate_heads").await;
    env.ok(&["migrate"]);
    assert_eq!(env.ok(&["aggregate-heads"]).trim(), "aggregate heads: snapshot_isolation");
    let out = env.ok(&["aggregate-heads", "--set", "always"]);
    assert!(out.starts_with("aggregate heads: snapshot_isolation -> always;"), "{out}");
    assert_eq!(outbox_producer::aggregate_heads(env.pool()).await.unwrap(), outbox_producer::AggregateHeads::Always);
    assert_eq!(env.ok(&["aggregate-heads", "--set", "always"]).trim(), "aggregate heads: always (unchanged)");
    let bad = env.run(&["aggregate-heads", "--set", "never"]);
    assert_eq!(bad.status.code(), Some(2), "{}", String::from_utf8_lossy(&bad.stderr));
    assert!(env.ok(&["aggregate-heads", "--set", "snapshot-isolation"]).starts_with("aggregate heads: always -> snapshot_isolation;"));
    env.drop_now().await;
}

/// `outbox route poison` (issue 47): without --policy it prints the policy
/// in force (block, never set); setting one needs an operator and a reason;
/// the setting is stored with them, and `--json` reads it back.
#[tokio::test]
async fn route_poison_sets_and_shows_a_routes_poison_policy() {
    let env = Env::new("cli_poison").await;
    env.ok(&["migrate"]);
    route(env.pool(), "cluster-x", "orders", 3).await;
    let shown = env.ok(&["route", "poison", common::ORDER_CREATED]);
    assert!(shown.contains("poison policy block (never set)"), "{shown}");
    let bare = env.run(&["route", "poison", common::ORDER_CREATED, "--policy", "skip"]);
    assert!(!bare.status.success(), "a policy without an operator and a reason was accepted");
    let bad = env.run(&["route", "poison", common::ORDER_CREATED, "--policy", "drop", "--operator", "ops-bob", "--reason", "r"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("block or skip"), "{}", String::from_utf8_lossy(&bad.stderr));
    let set = env.ok(&["route", "poison", common::ORDER_CREATED, "--policy", "skip", "--operator", "ops-bob", "--reason", "order events accept gaps, OPS-9"]);
    assert!(set.contains("poison policy skip (set by ops-bob") && set.contains("OPS-9"), "{set}");
    let json: Value = serde_json::from_str(&env.ok(&["route", "poison", common::ORDER_CREATED, "--json"])).unwrap();
    assert_eq!(json["policy"], "skip", "{json}");
    assert_eq!(json["set"]["actor"], "ops-bob", "{json}");
    assert_eq!(env.count("SELECT count(*) FROM outbox_poison_policies").await, 1);
}
