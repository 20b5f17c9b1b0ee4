//! Other languages read what the dispatcher produced: the CloudEvents SDK
//! of Python (`cloudevents`, Kafka protocol binding, binary mode) and the
//! independent verifier under `interop/`, which checks every message's
//! digests, destination and partition from docs/WIRE.md alone.
//!
//! They run on librdkafka's in-process cluster (its loopback bootstrap
//! address is reachable from the Python process) or on the cluster named by
//! `OUTBOX_TEST_KAFKA_BOOTSTRAP` (each test makes its own topics there).
//!
//! The Python packages are installed by `scripts/setup.d/60-interop.sh`
//! into `target/interop-venv` (or set `OUTBOX_INTEROP_PYTHON`). Without
//! them these tests fail, naming the script: they are never skipped.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use outbox_core::{headers, RoutePolicy};
use outbox_producer::{Dispatcher, DispatcherConfig, EmitOptions, Emitted, PgStore};
use outbox_tests::kafka::{LogMessage, TestCluster};
use outbox_tests::*;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::ClientConfig;
use serde_json::Value;
use sqlx::PgPool;

const PARTITIONS: i32 = 4;

/// A topic of its own for one test, so the Python readers see only its
/// messages on an external cluster too (`OUTBOX_TEST_KAFKA_BOOTSTRAP`),
/// created there through the admin API.
async fn fresh_topic(cluster: &TestCluster, prefix: &str, partitions: i32) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    let name = format!("{prefix}-{}-{nanos}", std::process::id());
    if cluster.mock.is_some() {
        cluster.topic(&name, partitions);
        return name;
    }
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new().set("bootstrap.servers", &cluster.bootstrap).create().unwrap();
    let topic = NewTopic::new(&name, partitions, TopicReplication::Fixed(1));
    for r in admin.create_topics([&topic], &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)))).await.unwrap() {
        r.unwrap_or_else(|(t, e)| panic!("create topic {t}: {e}"));
    }
    name
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn python() -> PathBuf {
    let p = std::env::var_os("OUTBOX_INTEROP_PYTHON").map(PathBuf::from).unwrap_or_else(|| repo_root().join("target/interop-venv/bin/python"));
    assert!(p.exists(), "no Python with cloudevents and confluent-kafka at {}: run scripts/setup.d/60-interop.sh (scripts/test does)", p.display());
    p
}

/// Runs `interop/<script>` with `args`: (exit code, stdout lines, stderr).
fn run_python(script: &str, args: &[&str]) -> (i32, Vec<String>, String) {
    let out = Command::new(python()).current_dir(repo_root().join("interop")).env("PYTHONDONTWRITEBYTECODE", "1").arg(script).args(args).output().expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout).lines().map(str::to_owned).collect();
    (out.status.code().unwrap_or(-1), stdout, String::from_utf8_lossy(&out.stderr).into_owned())
}

fn config() -> DispatcherConfig {
    DispatcherConfig { name: "interop".into(), workers: 1, batch_size: 100, lease_ms: 30_000, poll_interval_ms: 50, listen: false, ..Default::default() }
}

/// Dispatches until `n` events are PUBLISHED.
async fn dispatch_all(pool: &PgPool, broker: std::sync::Arc<outbox_producer::kafka::KafkaBroker>, n: i64) {
    let d = Dispatcher::new(PgStore::new(pool.clone()), broker, config()).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while count(pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").await < n {
        assert!(tokio::time::Instant::now() < deadline, "events not published in time");
        d.dispatch_once("w1").await.unwrap();
    }
}

async fn emit_one(pool: &PgPool, event_type: &str, id: &str) -> Emitted {
    let payload = order_payload(id, 100);
    let key = format!("{event_type}-{id}");
    let mut tx = pool.begin().await.unwrap();
    let e = outbox_producer::emit(&mut tx, &outbox_core::EmitRequest { event_type, ..order_request(&key, id, &payload) }, &EmitOptions::default()).await.unwrap();
    tx.commit().await.unwrap();
    e
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_cloudevents_sdk_of_python_reads_the_dispatched_messages(pool: PgPool) {
    let cluster = TestCluster::start();
    let topic = fresh_topic(&cluster, "interop-ce", PARTITIONS).await;
    let plain_topic = fresh_topic(&cluster, "interop-plain", 1).await;
    let (topic, plain_topic) = (topic.as_str(), plain_topic.as_str());
    let broker = cluster.broker(5_000).await;
    let json_route = RoutePolicy { content_type: "application/json".into(), ..RoutePolicy::new(ORDER_CREATED, broker.cluster_id(), topic, PARTITIONS as u32) };
    outbox_producer::routes::revise(&pool, &json_route).await.unwrap();
    let mut emitted = Vec::new();
    for i in 0..6 {
        emitted.push(emit_one(&pool, ORDER_CREATED, &format!("o-{i}")).await);
    }
    // The switch is the route generation's, frozen at commit: an event
    // emitted under a generation with CloudEvents on keeps them after a
    // revision turns them off; one emitted after the revision has none.
    let plain = RoutePolicy::new("order.cancelled.v1", broker.cluster_id(), plain_topic, 1);
    outbox_producer::routes::revise(&pool, &plain).await.unwrap();
    let before = emit_one(&pool, "order.cancelled.v1", "o-1").await;
    outbox_producer::routes::revise(&pool, &RoutePolicy { cloudevents: false, ..plain }).await.unwrap();
    let after = emit_one(&pool, "order.cancelled.v1", "o-2").await;
    // A content type that is no media type is a typed error, and the database refuses it too.
    let bad = RoutePolicy { content_type: "json".into(), ..RoutePolicy::new("order.bad.v1", broker.cluster_id(), plain_topic, 1) };
    let err = outbox_producer::routes::revise(&pool, &bad).await.unwrap_err();
    assert!(err.to_string().contains("contentType"), "{err}");
    let err = sqlx::query("INSERT INTO outbox_route_policies (event_type, generation, cluster_id, topic, partitions, partitioner, key_template, serializer, durability, required_acks, ordering, content_type)
                           VALUES ('order.bad.v1', 1, 'c', 't', 1, 'murmur2', '{tenant}', 'bytes', 'durable', 'all', 'key', 'application/json x')")
        .execute(&pool)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("check constraint"), "{err}");
    let refused = sqlx::query("UPDATE outbox_route_policies SET cloudevents = true").execute(&pool).await.unwrap_err();
    assert!(refused.to_string().contains("append-only"), "{refused}");
    dispatch_all(&pool, broker, 8).await;

    let source: String = sqlx::query_scalar("SELECT source FROM outbox_identity").fetch_one(&pool).await.unwrap();
    assert!(source.starts_with("urn:uuid:"), "{source}");
    let (code, lines, stderr) = run_python("cloudevents_read.py", &["--bootstrap", &cluster.bootstrap, "--topic", topic, "--expect", &emitted.len().to_string()]);
    assert_eq!(code, 0, "cloudevents_read.py: {stderr}\n{lines:?}");
    assert_eq!(lines.len(), emitted.len(), "{lines:?}");
    for line in &lines {
        let ce: Value = serde_json::from_str(line).unwrap();
        let a = &ce["attributes"];
        let e = emitted.iter().find(|e| a["id"] == e.event_id().as_str()).unwrap_or_else(|| panic!("ce id not emitted: {line}"));
        assert_eq!(a["specversion"], "1.0", "{line}");
        assert_eq!(a["source"], source.as_str(), "{line}");
        assert_eq!(a["type"], ORDER_CREATED, "{line}");
        assert_eq!(a["datacontenttype"], "application/json", "{line}");
        assert_eq!(a["time"], headers::rfc3339_ms(e.envelope.occurred_at_ms).as_str(), "{line}");
        assert_eq!(ce["partitionkey"], e.destination.routing_key.as_str(), "{line}");
        assert_eq!(ce["partition"], e.destination.partition, "{line}");
        let want: Value = serde_json::from_slice(&order_payload(&e.envelope.aggregate_id, 100)).unwrap();
        assert_eq!(ce["data"], want, "{line}");
        // The SDK sees the outbox headers as extensions it does not know, not as CloudEvents attributes.
        assert!(a.get("outbox-event-id").is_none());
    }

    let log = read_n(&cluster.bootstrap, plain_topic, 2);
    assert_eq!(log.len(), 2);
    let of = |e: &Emitted| log.iter().find(|m| m.header(headers::EVENT_ID).as_deref() == Some(e.event_id().as_str())).unwrap();
    assert_eq!(of(&before).header(headers::CE_ID).as_deref(), Some(before.event_id().as_str()));
    assert_eq!(of(&before).header(headers::CONTENT_TYPE).as_deref(), Some("application/octet-stream"));
    assert!(of(&after).headers.iter().all(|(k, _)| !k.starts_with("ce_") && k != headers::CONTENT_TYPE), "{:?}", of(&after).headers);
    // Either way the outbox headers verify.
    for m in &log {
        headers::verify(&m.headers, &m.payload, plain_topic, m.partition, Some(&m.key)).unwrap();
    }
}

/// The first `n` messages of `topic` (every partition), whatever high
/// watermark the broker reports.
fn read_n(bootstrap: &str, topic: &str, n: usize) -> Vec<LogMessage> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::{Headers, Message};
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", format!("interop-reader-{topic}"))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("isolation.level", "read_uncommitted")
        .create()
        .unwrap();
    consumer.subscribe(&[topic]).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut out = Vec::new();
    while out.len() < n {
        assert!(std::time::Instant::now() < deadline, "read {} of {n} messages of {topic}", out.len());
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
            let headers = m.headers().map(|h| h.iter().map(|x| (x.key.to_owned(), x.value.map(<[u8]>::to_vec).unwrap_or_default())).collect()).unwrap_or_default();
            out.push(LogMessage { partition: m.partition(), offset: m.offset(), key: m.key().unwrap_or_default().to_vec(), payload: m.payload().unwrap_or_default().to_vec(), headers });
        }
    }
    out
}

/// Produces `messages` (partition, key, value, headers) to `topic` as they are.
fn produce_raw(bootstrap: &str, topic: &str, messages: &[(i32, Vec<u8>, Vec<u8>, Vec<(String, Vec<u8>)>)]) {
    let p: BaseProducer = ClientConfig::new().set("bootstrap.servers", bootstrap).create().unwrap();
    for (partition, key, value, hs) in messages {
        let mut owned = OwnedHeaders::new();
        for (k, v) in hs {
            owned = owned.insert(Header { key: k, value: Some(v) });
        }
        p.send(BaseRecord::to(topic).partition(*partition).key(key).payload(value).headers(owned)).map_err(|(e, _)| e).unwrap();
    }
    p.flush(Duration::from_secs(10)).unwrap();
}

fn replace_header(hs: &mut [(String, Vec<u8>)], name: &str, value: Vec<u8>) {
    hs.iter_mut().find(|(k, _)| k == name).unwrap().1 = value;
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_python_verifier_checks_every_dispatched_message_and_catches_tampering(pool: PgPool) {
    let (code, lines, stderr) = run_python("verify.py", &["--self-test"]);
    assert_eq!(code, 0, "{lines:?} {stderr}");

    let cluster = TestCluster::start();
    let topic = fresh_topic(&cluster, "interop-verify", PARTITIONS).await;
    let topic = topic.as_str();
    let broker = cluster.broker(5_000).await;
    business_schema(&pool).await;
    route(&pool, ORDER_CREATED, broker.cluster_id(), topic, PARTITIONS as u32).await;
    let mut ids = Vec::new();
    for i in 0..40 {
        // Keys of every length modulo 4, so murmur2's tail cases all occur.
        ids.push(create_order(&pool, &format!("o-{i}{}", "k".repeat(i % 5)), i as i64).await.event_id().to_string());
    }
    dispatch_all(&pool, broker, 40).await;

    let (code, lines, stderr) = run_python("verify.py", &["--bootstrap", &cluster.bootstrap, "--topic", topic, "--expect", "40"]);
    assert_eq!(code, 0, "verify.py: {stderr}\n{}", lines.join("\n"));
    assert_eq!(lines.last().map(String::as_str), Some("verified: 40 passed, 0 failed"));
    let mut seen: Vec<String> = lines[..lines.len() - 1]
        .iter()
        .map(|l| {
            let r: Value = serde_json::from_str(l).unwrap();
            assert_eq!((r["ok"].as_bool(), r["cloudevents"].as_bool()), (Some(true), Some(true)), "{l}");
            r["eventId"].as_str().unwrap().to_owned()
        })
        .collect();
    seen.sort();
    ids.sort();
    assert_eq!(seen, ids);

    // The same messages altered as a faulty or hostile producer would: the
    // verifier must name each fault.
    let log = read_n(&cluster.bootstrap, topic, 1);
    let m = &log[0];
    let good = (m.partition, m.key.clone(), m.payload.clone(), m.headers.clone());
    let mut cases: Vec<(&str, (i32, Vec<u8>, Vec<u8>, Vec<(String, Vec<u8>)>))> = Vec::new();
    cases.push(("untouched", good.clone()));
    let mut c = good.clone();
    c.2.push(b' ');
    cases.push(("payload digest", c));
    let mut c = good.clone();
    c.0 = (c.0 + 1) % PARTITIONS;
    cases.push(("message on", c));
    let mut c = good.clone();
    c.1 = b"another-key".to_vec();
    cases.push(("message key", c));
    let mut c = good.clone();
    let dest = String::from_utf8(m.header(headers::DESTINATION).unwrap().into_bytes()).unwrap().replace("requiredAcks=3:all", "requiredAcks=1:1");
    replace_header(&mut c.3, headers::DESTINATION, dest.into_bytes());
    cases.push(("destination digest", c));
    let mut c = good.clone();
    replace_header(&mut c.3, headers::CE_ID, b"evt-01J00000000000000000000000".to_vec());
    cases.push(("ce_id", c));
    let mut c = good.clone();
    c.3.retain(|(k, _)| k != headers::ATTEMPT_ID);
    cases.push(("header outbox-attempt-id missing", c));
    // Another tenant's name on the real bytes: only the claims digest shows it.
    let mut c = good.clone();
    replace_header(&mut c.3, headers::TENANT, b"tenant-other".to_vec());
    cases.push(("claims digest", c));
    // Appended to the same topic (placement is part of what is checked).
    produce_raw(&cluster.bootstrap, topic, &cases.iter().map(|(_, m)| m.clone()).collect::<Vec<_>>());
    let (code, lines, stderr) = run_python("verify.py", &["--bootstrap", &cluster.bootstrap, "--topic", topic, "--expect", "48"]);
    assert_eq!(code, 1, "verify.py must fail: {stderr}\n{}", lines.join("\n"));
    assert_eq!(lines.last().map(String::as_str), Some("verified: 41 passed, 7 failed"));
    let results: Vec<Value> = lines[..lines.len() - 1].iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    for (what, _) in &cases[1..] {
        let hits = results.iter().filter(|r| r["errors"].as_array().unwrap().iter().any(|e| e.as_str().unwrap().starts_with(what))).count();
        assert_eq!(hits, 1, "one message with an error starting {what:?}: {results:?}");
    }
    assert_eq!(results.iter().filter(|r| r["ok"] == true).count(), 41);
}
