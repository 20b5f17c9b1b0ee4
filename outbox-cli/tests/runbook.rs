//! The runbook's commands against real PostgreSQL and the in-process Kafka
//! mock cluster: route, findings, unknown, dead-letters, trace with the
//! consumer's own database, the last reconciler round, the SLO verdict,
//! durations and JSON shapes.

mod common;

use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::Arc;
use std::time::Duration;

use common::{create_order, read_message, route, Env, ORDER_CREATED};
use outbox_consumer::{async_trait, ConsumedEvent, ConsumerConfig, Handler, HandlerError, IdempotentConsumer, Outcome, Processor, RetryPolicy};
use outbox_core::OutboxStore as _;
use outbox_producer::{Dispatcher, DispatcherConfig, PgStore, Reconciler, ReconcilerConfig};
use outbox_testkit::{assert_published, KafkaFixture, TestDatabase};
use serde_json::Value;
use sqlx::{Postgres, Transaction};

fn json(out: &str) -> Value {
    let v: Value = serde_json::from_str(out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"));
    assert!(v.is_object(), "--json prints an object: {out}");
    v
}

/// An aged event a dispatcher keeps trying to send (the broker refuses, it
/// goes back to PENDING after a backoff) is one open finding the whole
/// time: it used to close whenever a round caught it in flight and reopen
/// at the next (5 times in 2 minutes in the field).
#[tokio::test]
async fn aged_pending_finding_stays_open_while_the_event_cycles_through_dispatch() {
    let env = Env::new("cli_flap").await;
    env.ok(&["migrate"]);
    let kafka = KafkaFixture::mock(1).unwrap();
    let broker = kafka.broker(|_| {}).await.unwrap();
    // Routed to another cluster: the bypass scan of this broker reads nothing.
    route(env.pool(), "cluster-elsewhere", "orders", 3).await;
    let e = create_order(env.pool(), "stuck").await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let store = PgStore::new(env.pool().clone());
    let rec = Reconciler::new(store.clone(), broker, ReconcilerConfig { aged_pending_ms: 1, owner: "flap".into(), ..Default::default() }).unwrap();
    let rows = || async {
        let all: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_findings WHERE kind = 'aged_pending' AND event_id = $1")
            .bind(e.event_id().as_str())
            .fetch_one(env.pool())
            .await
            .unwrap();
        let open: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_findings WHERE kind = 'aged_pending' AND event_id = $1 AND resolved_at_ms IS NULL")
            .bind(e.event_id().as_str())
            .fetch_one(env.pool())
            .await
            .unwrap();
        (all, open)
    };
    rec.run_once().await.unwrap();
    assert_eq!(rows().await, (1, 1), "PENDING past the threshold: one open finding");
    for round in 0..3 {
        // A dispatcher claims it (CLAIMED), registers an attempt (SENDING)...
        let claimed = store.claim_batch(&format!("w-{round}"), 10, 30_000).await.unwrap();
        assert_eq!(claimed.len(), 1, "round {round}: the event is claimed");
        rec.run_once().await.unwrap();
        assert_eq!(rows().await, (1, 1), "round {round}: claimed, still the same open finding");
        let attempt = store.register_attempt(&claimed[0].token).await.unwrap();
        rec.run_once().await.unwrap();
        assert_eq!(rows().await, (1, 1), "round {round}: sending, still the same open finding");
        // ... and the broker says "not persisted": back to PENDING.
        store.report_not_sent(&claimed[0].token, &attempt.attempt_id, "broker down").await.unwrap();
        rec.run_once().await.unwrap();
        assert_eq!(rows().await, (1, 1), "round {round}: PENDING again, still the same open finding");
        tokio::time::sleep(Duration::from_millis((100 << round) + 150)).await; // past the not-sent backoff (100 ms, doubling)
    }

    // `findings list` shows it; `findings ack` closes it with who and why.
    let listed = json(&env.ok(&["findings", "list", "--json"]));
    let f = &listed["findings"][0];
    assert_eq!(f["kind"], "aged_pending");
    assert_eq!(f["eventId"], e.event_id().as_str());
    assert!(f["firstSeenAt"].as_str().unwrap().ends_with('Z'), "RFC 3339 twin: {f}");
    let id = f["id"].as_i64().unwrap().to_string();
    let text = env.ok(&["findings", "list"]);
    assert!(text.contains(&format!("{id}\taged_pending\t{}", e.event_id())) && text.contains("open"), "{text}");
    let acked = env.ok(&["findings", "ack", &id, "--operator", "ops-alice", "--note", "broker maintenance"]);
    assert!(acked.contains("acknowledged by ops-alice"), "{acked}");
    assert_eq!(rows().await, (1, 0));
    assert!(env.ok(&["findings", "list"]).contains("no open findings"));
    let all = env.ok(&["findings", "list", "--all"]);
    assert!(all.contains("acked by ops-alice"), "{all}");
    let again = env.run(&["findings", "ack", &id, "--operator", "ops-alice"]);
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr).contains("already closed"));
    assert!(String::from_utf8_lossy(&env.run(&["findings", "ack", "999999", "--operator", "x"]).stderr).contains("no finding 999999"));
    drop(kafka);
    env.drop_now().await;
}

#[tokio::test]
async fn route_set_checks_the_topic_and_is_idempotent() {
    let env = Env::new("cli_route").await;
    env.ok(&["migrate"]);
    let kafka = KafkaFixture::mock(1).unwrap();
    kafka.create_topic("orders", 3).await.unwrap();
    let b = kafka.bootstrap();

    // The partition count is checked against the topic: a mismatch and a missing topic are refused.
    let wrong = env.run(&["route", "set", ORDER_CREATED, "--topic", "orders", "--partitions", "12", "--kafka-bootstrap", b]);
    assert_eq!(wrong.status.code(), Some(1));
    let err = String::from_utf8_lossy(&wrong.stderr);
    assert!(err.contains("MISMATCH: topic orders has 3 partitions") && err.contains("the route says 12") && err.contains("nothing changed"), "{err}");
    let missing = env.run(&["route", "set", ORDER_CREATED, "--topic", "nope", "--partitions", "3", "--kafka-bootstrap", b]);
    assert_eq!(missing.status.code(), Some(1), "unknown topic refused");
    assert_eq!(env.count("SELECT count(*) FROM outbox_route_policies").await, 0);
    let no_kafka = env.run(&["route", "set", ORDER_CREATED, "--topic", "orders", "--partitions", "3"]);
    assert!(String::from_utf8_lossy(&no_kafka.stderr).contains("needs a Kafka connection"));

    // Right: the cluster id comes from the connection and is printed.
    let set = env.ok(&["route", "set", ORDER_CREATED, "--topic", "orders", "--partitions", "3", "--kafka-bootstrap", b]);
    let broker = kafka.broker(|_| {}).await.unwrap();
    let cluster = broker.cluster_id().to_owned();
    assert!(set.starts_with(&format!("new route {ORDER_CREATED} generation 1: cluster {cluster} topic orders partitions 3")), "{set}");
    assert!(set.contains("check: ok, topic orders has 3 partitions"), "{set}");
    // Idempotent: the same policy again is the current generation.
    let again = json(&env.ok(&["route", "set", ORDER_CREATED, "--topic", "orders", "--partitions", "3", "--kafka-bootstrap", b, "--json"]));
    assert_eq!(again["revised"], false);
    assert_eq!(again["route"]["generation"], 1);
    assert_eq!(env.count("SELECT count(*) FROM outbox_route_policies").await, 1);
    // The library call is idempotent too.
    let current = outbox_producer::routes::current(env.pool(), ORDER_CREATED).await.unwrap().unwrap();
    let ensured = outbox_producer::routes::ensure(env.pool(), &current).await.unwrap();
    assert!(!ensured.revised && ensured.policy.generation == 1);

    // --no-check needs --cluster-id; a change is a new generation.
    let offline = env.ok(&["route", "set", ORDER_CREATED, "--topic", "orders", "--partitions", "3", "--cluster-id", &cluster, "--ordering", "none", "--no-check"]);
    assert!(offline.contains("new route") && offline.contains("generation 2") && offline.contains("check: skipped"), "{offline}");

    let show = env.ok(&["route", "show", ORDER_CREATED, "--kafka-bootstrap", b]);
    assert!(show.contains(&format!("cluster {cluster}")) && show.contains("ordering none") && show.contains("check: ok"), "{show}");
    let list = json(&env.ok(&["route", "list", "--json"]));
    assert_eq!(list["routes"].as_array().unwrap().len(), 1);
    assert_eq!(list["routes"][0]["generation"], 2);
    assert!(String::from_utf8_lossy(&env.run(&["route", "show", "nothing.v1"]).stderr).contains("no route for event type nothing.v1"));
    drop(kafka);
    env.drop_now().await;
}

#[tokio::test]
async fn unknown_list_and_show_print_attempts_and_lookups() {
    let env = Env::new("cli_unknown").await;
    env.ok(&["migrate"]);
    let kafka = KafkaFixture::mock(1).unwrap();
    kafka.create_topic("orders", 3).await.unwrap();
    let broker = kafka.broker(|_| {}).await.unwrap();
    route(env.pool(), broker.cluster_id(), "orders", 3).await;
    let e = create_order(env.pool(), "u-1").await;
    // A send whose answer never came: the attempt is UNKNOWN.
    let store = PgStore::new(env.pool().clone());
    let claimed = store.claim_batch("w", 10, 30_000).await.unwrap();
    let attempt = store.register_attempt(&claimed[0].token).await.unwrap();
    store.report_unknown(&claimed[0].token, &attempt.attempt_id, "timed out waiting for the broker").await.unwrap();
    // One reconciler round looks it up (the attempt is too young for an absence proof: recheck).
    env.ok(&["reconcile", "--once", "--kafka-bootstrap", kafka.bootstrap()]);

    let list = env.ok(&["unknown", "list"]);
    assert!(list.contains(e.event_id().as_str()) && list.contains("DISPATCH_UNKNOWN") && list.contains("attempts 1") && list.contains("lookups 1"), "{list}");
    let j = json(&env.ok(&["unknown", "list", "--json"]));
    assert_eq!(j["unknown"][0]["eventId"], e.event_id().as_str());
    assert!(j["unknown"][0]["unknownSince"].as_str().unwrap().ends_with('Z'));
    let show = env.ok(&["unknown", "show", e.event_id().as_str()]);
    assert!(show.contains(&format!("#1 {} UNKNOWN owner w", attempt.attempt_id)) && show.contains("timed out waiting for the broker"), "{show}");
    assert!(show.contains("lookups: 1 shown") && show.contains("-> recheck at"), "{show}");
    let sj = json(&env.ok(&["unknown", "show", e.event_id().as_str(), "--json"]));
    assert_eq!(sj["lookups"].as_array().unwrap().len(), 1);
    assert!(sj["lookups"][0]["lookup"].as_str().unwrap().starts_with("absent") || sj["lookups"][0]["lookup"].as_str().unwrap().starts_with("unavailable"), "{sj}");
    assert!(env.ok(&["unknown", "list", "--limit", "5"]).contains("lookups 1"));
    assert!(String::from_utf8_lossy(&env.run(&["unknown", "list", "--limit", "0"]).stderr).contains("--limit 0"));
    drop(kafka);
    env.drop_now().await;
}

/// Fails while `fail` is set.
struct Flaky(Arc<AtomicBool>);

#[async_trait]
impl Handler for Flaky {
    async fn handle(&self, _tx: &mut Transaction<'_, Postgres>, _e: &ConsumedEvent) -> Result<Value, HandlerError> {
        if self.0.load(AtomicOrdering::SeqCst) {
            Err(HandlerError::transient("warehouse API down"))
        } else {
            Ok(serde_json::json!({"shipped": true}))
        }
    }
}

/// The consumer's own database holds its receipts and dead letters: trace
/// reads it with --consumer-database-url; dead-letters list/show/requeue
/// work on it, and the running consumer redrives a requeued dead letter.
#[tokio::test]
async fn dead_letters_requeue_and_trace_with_the_consumer_database() {
    let env = Env::new("cli_dlq").await;
    env.ok(&["migrate", "--only", "producer"]);
    let consumer_db = TestDatabase::create(env.server.url(), "cli_dlq_consumer", 4).await.unwrap();
    outbox_consumer::migrate(&consumer_db.pool).await.unwrap();
    let kafka = KafkaFixture::mock(1).unwrap();
    kafka.create_topic("orders", 1).await.unwrap();
    let broker = kafka.broker(|_| {}).await.unwrap();
    route(env.pool(), broker.cluster_id(), "orders", 1).await;
    let e = create_order(env.pool(), "d-1").await;
    let d = Arc::new(Dispatcher::new(PgStore::new(env.pool().clone()), broker, DispatcherConfig { name: "dlq".into(), ..Default::default() }).unwrap());
    assert_eq!(d.dispatch_once("dlq-0").await.unwrap().published, 1);
    let receipt = assert_published(env.pool(), e.event_id()).await;

    // The handler fails every time: a dead letter in the consumer's database.
    let fail = Arc::new(AtomicBool::new(true));
    let retry = RetryPolicy { max_attempts: 2, initial_backoff_ms: 1, max_backoff_ms: 1, ..RetryPolicy::default() };
    let processor = Processor::new("shipping", consumer_db.pool.clone(), Flaky(fail.clone())).unwrap().with_retry(retry.clone()).unwrap();
    let out = processor.process_message(&read_message(kafka.bootstrap(), "orders", receipt.partition, receipt.offset)).await.unwrap();
    assert!(matches!(out, Outcome::DeadLettered(_)), "{out:?}");

    // trace: the outbox database has no consumer tables; the consumer's database has the dead letter.
    let id = e.event_id().as_str();
    let plain = env.ok(&["trace", id]);
    assert!(plain.contains("no outbox_consumer_receipts table") && plain.contains("--consumer-database-url"), "{plain}");
    let with = env.ok(&["trace", id, "--consumer-database-url", &consumer_db.url]);
    assert!(with.contains("consumer problem: attempts=2 consumer_id=shipping") && with.contains("kind=dead_lettered"), "{with}");
    assert!(with.contains("no consumption receipt yet (looked in the outbox database,"), "{with}");

    let dl = ["--consumer-database-url", consumer_db.url.as_str()];
    let list = env.ok(&[&["dead-letters", "list"][..], &dl].concat());
    assert!(list.contains(&format!("shipping\t{id}\t{ORDER_CREATED}\torders/0@{}\tattempts 2", receipt.offset)) && list.contains("warehouse API down"), "{list}");
    let lj = json(&env.ok(&[&["dead-letters", "list", "--json"][..], &dl].concat()));
    assert_eq!(lj["deadLetters"][0]["attempts"], 2);
    let show = env.ok(&[&["dead-letters", "show", id][..], &dl].concat());
    assert!(show.contains("dead-lettered") && show.contains("requeue          not requested"), "{show}");
    let wrong = env.run(&[&["dead-letters", "requeue", id, "--consumer", "billing", "--operator", "ops-alice"][..], &dl].concat());
    assert!(String::from_utf8_lossy(&wrong.stderr).contains("no dead letter"), "wrong consumer refused");

    // Requeued while the cause is still there: the running consumer runs the
    // handler once more, records the attempt, keeps the dead letter and
    // clears the request (it does not redrive it again every second).
    env.ok(&[&["dead-letters", "requeue", id, "--consumer", "shipping", "--operator", "ops-alice"][..], &dl].concat());
    let mut cfg = ConsumerConfig::new("shipping", kafka.bootstrap(), &["orders"]);
    cfg.retry = retry.clone();
    let consumer = IdempotentConsumer::new(cfg, consumer_db.pool.clone(), Flaky(fail.clone())).unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(consumer.run(async move {
        let _ = stop_rx.await;
    }));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let pending: Option<i64> = sqlx::query_scalar("SELECT requeue_requested_at_ms FROM outbox_consumer_dead_letters WHERE event_id = $1")
            .bind(id)
            .fetch_one(&consumer_db.pool)
            .await
            .unwrap();
        if pending.is_none() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the failed requeue was not cleared");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop_tx.send(());
    run.await.unwrap().unwrap();
    let (attempts, by): (i32, Option<String>) =
        sqlx::query_as("SELECT attempts, requeue_requested_by FROM outbox_consumer_dead_letters WHERE event_id = $1").bind(id).fetch_one(&consumer_db.pool).await.unwrap();
    assert_eq!((attempts, by), (3, None), "one more attempt recorded, the request cleared, the dead letter kept");

    // The cause is fixed; the running consumer picks up the requeue request.
    fail.store(false, AtomicOrdering::SeqCst);
    env.ok(&[&["dead-letters", "requeue", id, "--consumer", "shipping", "--operator", "ops-alice"][..], &dl].concat());
    assert!(env.ok(&[&["dead-letters", "show", id][..], &dl].concat()).contains("by ops-alice"));
    let mut cfg = ConsumerConfig::new("shipping", kafka.bootstrap(), &["orders"]);
    cfg.retry = retry;
    let consumer = IdempotentConsumer::new(cfg, consumer_db.pool.clone(), Flaky(fail.clone())).unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(consumer.run(async move {
        let _ = stop_rx.await;
    }));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_consumer_dead_letters").fetch_one(&consumer_db.pool).await.unwrap();
        if left == 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the requeued dead letter was not redriven");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop_tx.send(());
    run.await.unwrap().unwrap();
    let done = env.ok(&["trace", id, "--consumer-database-url", &consumer_db.url]);
    assert!(done.contains("consumers: 1") && done.contains("shipping consumed gen 1"), "{done}");
    assert!(env.ok(&[&["dead-letters", "list"][..], &dl].concat()).contains("no dead letters"));
    drop(kafka);
    consumer_db.drop_now().await.unwrap();
    env.drop_now().await;
}

#[tokio::test]
async fn status_and_report_show_the_last_round_a_stale_reconciler_and_one_slo() {
    let env = Env::new("cli_stale").await;
    env.ok(&["migrate"]);
    let kafka = KafkaFixture::mock(1).unwrap();
    kafka.create_topic("orders", 3).await.unwrap();
    let broker = kafka.broker(|_| {}).await.unwrap();
    route(env.pool(), broker.cluster_id(), "orders", 3).await;
    let d = Arc::new(Dispatcher::new(PgStore::new(env.pool().clone()), broker, DispatcherConfig { name: "stale".into(), ..Default::default() }).unwrap());
    create_order(env.pool(), "s-1").await;
    assert_eq!(d.dispatch_once("stale-0").await.unwrap().published, 1);

    // Events and no reconciler round ever: not green.
    let s = env.run(&["status", "--fail-on-findings"]);
    assert_eq!(s.status.code(), Some(2), "{}", String::from_utf8_lossy(&s.stdout));
    assert!(String::from_utf8_lossy(&s.stdout).contains("reconciler:      no round recorded"));
    assert_eq!(env.run(&["report", "--fail-on-findings"]).status.code(), Some(2));

    // One round with a 1 s SLO: status and report show it, and the report uses that SLO.
    env.ok(&["reconcile", "--once", "--kafka-bootstrap", kafka.bootstrap(), "--unknown-slo-ms", "1s", "--owner", "rec-a"]);
    let s = env.ok(&["status", "--fail-on-findings"]);
    assert!(s.contains("reconciler:      last round 20") && s.contains("by rec-a"), "{s}");
    let r = json(&env.ok(&["report", "--json", "--fail-on-findings"]));
    assert_eq!(r["unknownSloMs"], 1000, "the reconciler's SLO");
    assert_eq!(r["unknownSloVerdict"], "n/a", "nothing resolved: n/a, not met");
    assert_eq!(r["lastReconcilerRound"]["owner"], "rec-a");
    assert!(r["lastReconcilerRound"]["lastRoundAt"].as_str().unwrap().ends_with('Z'));
    assert_eq!(r["stateCounts"][0]["state"], "PUBLISHED", "pairs are objects: {}", r["stateCounts"]);
    let text = env.ok(&["report"]);
    assert!(text.contains("(SLO 1.0 s: n/a)") && text.contains("last reconciler round") && text.contains("by rec-a"), "{text}");
    assert_eq!(json(&env.ok(&["report", "--json", "--unknown-slo-ms", "2m"]))["unknownSloMs"], 120_000, "an explicit SLO wins");

    // The reconciler stopped an hour ago: a finding, exit 2.
    sqlx::query("UPDATE outbox_reconciler_rounds SET last_round_at_ms = last_round_at_ms - 3600000").execute(env.pool()).await.unwrap();
    let s = env.run(&["status", "--fail-on-findings"]);
    let out = String::from_utf8_lossy(&s.stdout);
    assert_eq!(s.status.code(), Some(2), "{out}");
    assert!(out.contains("STALE:") && out.contains("is the reconciler running?"), "{out}");
    let sj = json(&env.ok(&["status", "--json"]));
    assert_eq!(sj["reconcilerFinding"]["kind"], "reconciler_stale");
    assert_eq!(sj["stateCounts"][0]["state"], "PENDING");
    assert!(sj["now"].as_str().unwrap().ends_with('Z'));
    let r = json(&env.ok(&["report", "--json"]));
    assert!(r["findings"].as_array().unwrap().iter().any(|f| f["kind"] == "reconciler_stale"), "{}", r["findings"]);
    assert_eq!(env.run(&["report", "--fail-on-findings"]).status.code(), Some(2));
    assert_eq!(env.run(&["status", "--fail-on-findings", "--reconciler-stale-ms", "2h"]).status.code(), Some(0), "within a longer bound");
    drop(kafka);
    env.drop_now().await;
}

#[tokio::test]
async fn durations_take_units_and_plain_milliseconds() {
    let env = Env::new("cli_durations").await;
    env.ok(&["migrate"]);
    let dry = env.ok(&["purge", "--replay-window-ms", "7d"]);
    assert!(dry.contains("replay window 7d 0h"), "{dry}");
    let dry = env.ok(&["purge", "--replay-window-ms", "604800000"]);
    assert!(dry.contains("replay window 7d 0h"), "plain ms still work: {dry}");
    let cfg = env.ok(&["dispatch", "--print-config", "--lease-ms", "30s", "--poll-interval-ms", "1500", "--kafka-bootstrap", "k:9092"]);
    let parsed: toml::Value = toml::from_str(&cfg).unwrap_or_else(|e| panic!("print-config is TOML: {e}\n{cfg}"));
    assert_eq!((parsed["dispatch"]["lease_ms"].as_integer(), parsed["dispatch"]["poll_interval_ms"].as_integer()), (Some(30_000), Some(1_500)), "{cfg}");
    let bad = env.run(&["purge", "--replay-window-ms", "7x"]);
    assert_eq!(bad.status.code(), Some(2), "clap usage error");
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown unit \"x\""), "{}", String::from_utf8_lossy(&bad.stderr));
    env.drop_now().await;
}

/// A consumer's gaps live in its own database: `gaps list` shows the open
/// one (text and JSON), `gaps accept` closes it with who and why, refuses
/// one that is not open, and `--all` shows it closed.
#[tokio::test]
async fn gaps_list_and_accept_with_the_consumer_database() {
    use outbox_consumer::gap::{OffsetGap, ReadingChange};
    use outbox_consumer::{ConsumerStore as _, PgConsumerStore};
    let env = Env::new("cli_gaps").await;
    env.ok(&["migrate", "--only", "producer"]);
    let consumer_db = TestDatabase::create(env.server.url(), "cli_gaps_consumer", 2).await.unwrap();
    outbox_consumer::migrate(&consumer_db.pool).await.unwrap();
    // What the shipping consumer's processor stores when its offsets jump from 3 to 10.
    let store = PgConsumerStore::new(consumer_db.pool.clone());
    let mut tx = store.begin().await.unwrap();
    let gap = OffsetGap { detected_from: 3, from_offset: 3, to_offset: 10 };
    store.save_reading(&mut tx, "shipping", "cluster-a", "orders", 2, &ReadingChange { next_offset: 11, opened: vec![gap], shrunk: vec![], watermark_cap: Some(3), ..ReadingChange::default() }).await.unwrap();
    store.commit(tx).await.unwrap();
    // Its watermark there stands at the gap's start; copied to the outbox
    // database, the gap is a consumer_gap finding naming consumer, log and range.
    sqlx::query(
        "INSERT INTO outbox_consumer_watermarks (consumer_id, cluster_id, topic, partition, committed_offset, applied_count, duplicate_count, quarantined_count, dead_lettered_count, updated_at)
         VALUES ('shipping', 'cluster-a', 'orders', 2, 3, 3, 0, 0, 0, now())",
    )
    .execute(&consumer_db.pool)
    .await
    .unwrap();
    assert_eq!(outbox_consumer::watermarks(&consumer_db.pool, "shipping").await.unwrap()[0].open_gap_end, Some(10));
    outbox_consumer::migrate(env.pool()).await.unwrap(); // the copy's target table
    outbox_consumer::publish_watermarks(&consumer_db.pool, env.pool(), "shipping").await.unwrap();
    let gap_findings = || async {
        sqlx::query_as::<_, (String, String, String)>("SELECT event_id, consumer_id, detail FROM outbox_findings WHERE kind = 'consumer_gap' AND resolved_at_ms IS NULL")
            .fetch_all(env.pool())
            .await
            .unwrap()
    };
    let open = gap_findings().await;
    assert_eq!(open.iter().map(|f| (f.0.as_str(), f.1.as_str())).collect::<Vec<_>>(), vec![("cluster-a/orders/2", "shipping")], "{open:?}");
    assert!(open[0].2.contains("skipped offsets [3, 10)"), "{open:?}");

    let db = ["--consumer-database-url", consumer_db.url.as_str()];
    let list = env.ok(&[&["gaps", "list"][..], &db].concat());
    assert!(list.contains("shipping\tcluster-a/orders/2\tfrom 3\t") && list.contains("OPEN: offsets 3..10 unread (7)"), "{list}");
    let j = json(&env.ok(&[&["gaps", "list", "--json"][..], &db].concat()));
    assert_eq!((j["gaps"][0]["fromOffset"].as_i64(), j["gaps"][0]["toOffset"].as_i64()), (Some(3), Some(10)), "{j}");
    let accept = |from: &str| {
        [&["gaps", "accept", "--consumer", "shipping", "--cluster", "cluster-a", "--topic", "orders", "--partition", "2", "--detected-from", from][..], &["--operator", "ops-alice", "--reason", "deleted by retention"], &db]
            .concat()
            .iter()
            .map(|s| s.to_string())
            .collect::<Vec<String>>()
    };
    let args = accept("4");
    let wrong = env.run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(!wrong.status.success() && String::from_utf8_lossy(&wrong.stderr).contains("no open gap of shipping"), "{wrong:?}");
    let args = accept("3");
    let out = env.ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(out.contains("accepted by ops-alice: offsets 3..10 stay unread"), "{out}");
    assert!(env.ok(&[&["gaps", "list"][..], &db].concat()).contains("no open gaps"));
    let all = env.ok(&[&["gaps", "list", "--all"][..], &db].concat());
    assert!(all.contains("accepted by ops-alice at ") && all.contains("deleted by retention"), "{all}");
    // The accepted gap no longer stands at the watermark: the next copy resolves the finding.
    outbox_consumer::publish_watermarks(&consumer_db.pool, env.pool(), "shipping").await.unwrap();
    assert!(gap_findings().await.is_empty(), "resolved once the gap is accepted");
    consumer_db.drop_now().await.unwrap();
    env.drop_now().await;
}
