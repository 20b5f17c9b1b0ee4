//! The consumer end to end: librdkafka's in-process mock cluster and real
//! PostgreSQL. Messages are produced exactly as a dispatcher produces them
//! (outbox-core envelopes and headers, frozen partition and key).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use outbox_consumer::{ConsumerError, HookAction, IdempotentConsumer, Outcome};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use sqlx::PgPool;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

type Seen = Arc<Mutex<Vec<Outcome>>>;

/// A running consumer that records every committed outcome.
struct Running {
    seen: Seen,
    metrics: Arc<outbox_consumer::Metrics>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ConsumerError>>,
}

impl Running {
    fn start(consumer: IdempotentConsumer) -> Running {
        let seen: Seen = Arc::default();
        let s = seen.clone();
        let consumer = consumer.after_db_commit(move |b| {
            s.lock().unwrap().extend_from_slice(b.outcomes);
            HookAction::Continue
        });
        let metrics = consumer.metrics();
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(consumer.run(async move {
            let _ = rx.await;
        }));
        Running { seen, metrics, stop: Some(tx), task }
    }

    fn outcomes(&self) -> Vec<Outcome> {
        self.seen.lock().unwrap().clone()
    }

    async fn wait_decided(&self, n: usize) {
        let seen = self.seen.clone();
        wait_until(60, &format!("{n} decisions"), || {
            let seen = seen.clone();
            async move { seen.lock().unwrap().len() >= n }
        })
        .await;
    }

    async fn stop(mut self) -> Vec<Outcome> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        let r = tokio::time::timeout(Duration::from_secs(30), &mut self.task).await.expect("consumer stops in time");
        r.expect("task").expect("clean stop");
        self.outcomes()
    }
}

async fn receipts(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM outbox_consumer_receipts").fetch_one(pool).await.unwrap()
}

fn committed_offset(kafka: &Kafka, group: &str, topic: &str, partition: i32) -> Option<i64> {
    let c: BaseConsumer = ClientConfig::new().set("bootstrap.servers", kafka.bootstrap()).set("group.id", group).create().unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition(topic, partition);
    let got = c.committed_offsets(tpl, Duration::from_secs(10)).unwrap();
    match got.find_partition(topic, partition).map(|e| e.offset()) {
        Some(Offset::Offset(o)) => Some(o),
        _ => None,
    }
}

/// The process dies after the receipt transaction committed and before the
/// offset commit: a new instance receives the message again, gets the
/// original receipt back, and no second effect happens.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn crash_after_db_commit_before_offset_commit(pool: PgPool) {
    init_tracing();
    create_effects_table(&pool).await;
    let kafka = Kafka::new("orders", 2);
    let f = fixture("orders", 2, "o-crash");
    let offset = kafka.send(&f).await;
    let h = TestHandler::default();

    let first: Seen = Arc::default();
    let s = first.clone();
    let c1 = IdempotentConsumer::new(config(&kafka, "fulfilment", "orders"), pool.clone(), h.clone()).unwrap().after_db_commit(move |b| {
        s.lock().unwrap().extend_from_slice(b.outcomes);
        HookAction::Crash
    });
    let r = tokio::time::timeout(Duration::from_secs(60), c1.run(std::future::pending())).await.expect("first instance crashes");
    assert!(matches!(r, Err(ConsumerError::StoppedByHook { last_offset, .. }) if last_offset == offset), "{r:?}");
    let original = first.lock().unwrap()[0].receipt().cloned().expect("applied");
    assert_eq!(h.calls(), 1);
    assert_eq!(committed_offset(&kafka, "fulfilment", "orders", f.partition()), None, "the offset commit was lost");

    let c2 = Running::start(IdempotentConsumer::new(config(&kafka, "fulfilment", "orders"), pool.clone(), h.clone()).unwrap());
    c2.wait_decided(1).await;
    let outs = c2.stop().await;
    match &outs[0] {
        Outcome::Duplicate { original: o, delivery } => {
            assert_eq!(o, &original, "the original receipt, with the original result");
            assert_eq!(delivery.offset, offset);
        }
        other => panic!("expected a duplicate, got {other:?}"),
    }
    assert_eq!(h.calls(), 1, "the handler did not run again");
    assert_eq!(effects(&pool).await, (1, 1));
    assert_eq!(committed_offset(&kafka, "fulfilment", "orders", f.partition()), Some(offset + 1));
}

/// The same message produced twice, events out of order across partitions:
/// one effect per event, duplicates answered with the original receipt.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn duplicated_and_reordered_messages(pool: PgPool) {
    create_effects_table(&pool).await;
    let kafka = Kafka::new("orders", 2);
    let (a, b, c) = (fixture_on("orders", 2, 0, "a"), fixture_on("orders", 2, 0, "b"), fixture_on("orders", 2, 0, "c"));
    let d = fixture_on("orders", 2, 1, "d");
    // A producer retry re-sends a; c was created last but is sent before b's
    // re-send; d on the other partition is duplicated too.
    for f in [&a, &b, &a, &d, &c, &b, &d] {
        kafka.send(f).await;
    }
    let h = TestHandler::default();
    let r = Running::start(IdempotentConsumer::new(config(&kafka, "fulfilment", "orders"), pool.clone(), h.clone()).unwrap());
    r.wait_decided(7).await;
    let outs = r.stop().await;
    let p0: Vec<&str> = outs.iter().filter(|o| o.position().partition == 0).map(Outcome::kind).collect();
    assert_eq!(p0, ["applied", "applied", "duplicate", "applied", "duplicate"]);
    let p1: Vec<&str> = outs.iter().filter(|o| o.position().partition == 1).map(Outcome::kind).collect();
    assert_eq!(p1, ["applied", "duplicate"]);
    for o in &outs {
        if let Outcome::Duplicate { original, delivery } = o {
            assert!(original.position.offset < delivery.offset);
            assert_eq!(original.result["applied_at_offset"], original.position.offset);
        }
    }
    assert_eq!(h.calls(), 4);
    assert_eq!(effects(&pool).await, (4, 4));
}

/// Tampered bytes and a misplaced copy are quarantined with evidence; the
/// partition keeps moving and the watermark passes them.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn tampered_messages_are_quarantined_and_later_messages_processed(pool: PgPool) {
    create_effects_table(&pool).await;
    let kafka = Kafka::new("orders", 2);
    let g1 = fixture_on("orders", 2, 0, "g1");
    let victim = fixture_on("orders", 2, 0, "v");
    let g2 = fixture_on("orders", 2, 0, "g2");
    kafka.send(&g1).await;
    let tampered = kafka.send_raw("orders", 0, victim.destination.routing_key.as_bytes(), b"{\"order\":\"stolen\"}", &victim.headers).await;
    // The genuine bytes on the wrong partition.
    kafka.send_raw("orders", 1, victim.destination.routing_key.as_bytes(), &victim.payload, &victim.headers).await;
    let last = kafka.send(&g2).await;
    let h = TestHandler::default();
    let r = Running::start(IdempotentConsumer::new(config(&kafka, "fulfilment", "orders"), pool.clone(), h.clone()).unwrap());
    r.wait_decided(4).await;
    let outs = r.stop().await;
    let mut q: Vec<String> = outs
        .iter()
        .filter_map(|o| match o {
            Outcome::Quarantined(q) => Some(q.reason.code()),
            _ => None,
        })
        .collect();
    q.sort();
    assert_eq!(q, ["verify:payload_digest", "verify:placement"]);
    assert_eq!(h.calls(), 2);
    let rows: Vec<(i32, i64, String)> = sqlx::query_as(r#"SELECT partition, "offset", reason FROM outbox_consumer_quarantine ORDER BY partition"#).fetch_all(&pool).await.unwrap();
    assert_eq!(rows[0], (0, tampered, "verify:payload_digest".to_owned()));
    let w = outbox_consumer::watermarks(&pool, "fulfilment").await.unwrap();
    let w0 = w.iter().find(|w| w.partition == 0).unwrap();
    assert_eq!((w0.committed_offset, w0.applied_count, w0.quarantined_count), (last + 1, 2, 1));
    let probe: BaseConsumer = ClientConfig::new().set("bootstrap.servers", kafka.bootstrap()).create().unwrap();
    let cluster = probe.client().fetch_cluster_id(Duration::from_secs(10)).expect("cluster id");
    assert!(w.iter().all(|w| w.cluster_id == cluster), "watermarks name the cluster read: {w:?}");
    let in_receipts: Vec<String> = sqlx::query_scalar("SELECT DISTINCT cluster_id FROM outbox_consumer_receipts").fetch_all(&pool).await.unwrap();
    assert_eq!(in_receipts, [cluster]);
    assert_eq!(committed_offset(&kafka, "fulfilment", "orders", 0), Some(last + 1));
}

/// A header name that is not UTF-8 (rdkafka's own accessor panics on it):
/// the message is quarantined with its reason, nothing panics, and the next
/// valid message of the partition is applied once.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn non_utf8_header_name_is_quarantined_and_the_partition_moves_on(pool: PgPool) {
    create_effects_table(&pool).await;
    let kafka = Kafka::new("orders", 2);
    let poisoned = fixture_on("orders", 2, 0, "p");
    let next = fixture_on("orders", 2, 0, "n");
    // The genuine event's headers and bytes, plus one header whose name is not UTF-8.
    let mut raw: Vec<(Vec<u8>, Vec<u8>)> = poisoned.headers.iter().map(|(k, v)| (k.clone().into_bytes(), v.clone())).collect();
    raw.push((vec![b'x', 0xff, 0xfe, b'y'], b"v".to_vec()));
    let bad = kafka.send_raw_names("orders", 0, poisoned.destination.routing_key.as_bytes(), &poisoned.payload, &raw).await;
    let last = kafka.send(&next).await;
    let h = TestHandler::default();
    let r = Running::start(IdempotentConsumer::new(config(&kafka, "fulfilment", "orders"), pool.clone(), h.clone()).unwrap());
    r.wait_decided(2).await;
    let outs = r.stop().await;
    let codes: Vec<String> = outs.iter().filter_map(|o| if let Outcome::Quarantined(q) = o { Some(q.reason.code()) } else { None }).collect();
    assert_eq!(codes, ["verify:header_name"]);
    assert_eq!(h.calls(), 1, "only the valid message ran its handler");
    assert_eq!(effects(&pool).await, (1, 1));
    let rows: Vec<(i64, String)> = sqlx::query_as(r#"SELECT "offset", reason FROM outbox_consumer_quarantine"#).fetch_all(&pool).await.unwrap();
    assert_eq!(rows, [(bad, "verify:header_name".to_owned())]);
    assert_eq!(committed_offset(&kafka, "fulfilment", "orders", 0), Some(last + 1));
}

/// A handler failing twice then succeeding: applied once, in order with the
/// events around it.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn handler_failing_twice_then_succeeding(pool: PgPool) {
    create_effects_table(&pool).await;
    let kafka = Kafka::new("orders", 1);
    let fs: Vec<_> = (0..6).map(|i| fixture("orders", 1, &format!("o-{i}"))).collect();
    for f in &fs {
        kafka.send(f).await;
    }
    let h = TestHandler::default();
    h.script(fs[2].event_id(), Script::FailTimes(2));
    let r = Running::start(IdempotentConsumer::new(config(&kafka, "fulfilment", "orders"), pool.clone(), h.clone()).unwrap());
    r.wait_decided(6).await;
    let m = r.metrics.snapshot();
    let outs = r.stop().await;
    assert!(outs.iter().all(|o| o.kind() == "applied"));
    assert_eq!((m.applied, m.handler_failures, m.dead_lettered), (6, 2, 0));
    // Effects committed in offset order.
    let offsets: Vec<i64> = sqlx::query_scalar(r#"SELECT "offset" FROM test_effects ORDER BY id"#).fetch_all(&pool).await.unwrap();
    assert_eq!(offsets, (0..6).collect::<Vec<i64>>());
}

/// A handler that always fails ends in a dead letter after bounded retries;
/// meanwhile the other partition keeps flowing, and the poisoned partition
/// continues after the dead letter.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn poison_message_is_dead_lettered_and_other_partitions_flow(pool: PgPool) {
    create_effects_table(&pool).await;
    let kafka = Kafka::new("orders", 2);
    let poison = fixture_on("orders", 2, 0, "poison");
    let after = fixture_on("orders", 2, 0, "after");
    kafka.send(&poison).await;
    kafka.send(&after).await;
    let others: Vec<_> = (0..20).map(|i| fixture_on("orders", 2, 1, &format!("ok{i}"))).collect();
    for f in &others {
        kafka.send(f).await;
    }
    let h = TestHandler::default();
    h.script(poison.event_id(), Script::AlwaysFail);
    let mut cfg = config(&kafka, "fulfilment", "orders");
    cfg.retry.max_attempts = 6;
    cfg.retry.initial_backoff_ms = 400;
    cfg.retry.max_backoff_ms = 1_000;
    let r = Running::start(IdempotentConsumer::new(cfg, pool.clone(), h.clone()).unwrap());
    let seen = r.seen.clone();
    wait_until(60, "partition 1 done", || {
        let seen = seen.clone();
        async move { seen.lock().unwrap().iter().filter(|o| o.position().partition == 1).count() == 20 }
    })
    .await;
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_consumer_dead_letters").fetch_one(&pool).await.unwrap();
    assert_eq!(dead, 0, "partition 1 finished while partition 0 was still retrying its poison message");
    r.wait_decided(22).await;
    let outs = r.stop().await;
    let p0: Vec<&str> = outs.iter().filter(|o| o.position().partition == 0).map(Outcome::kind).collect();
    assert_eq!(p0, ["dead_lettered", "applied"]);
    let (attempts, error): (i32, String) = sqlx::query_as("SELECT attempts, last_error FROM outbox_consumer_dead_letters WHERE event_id = $1").bind(poison.event_id().as_str()).fetch_one(&pool).await.unwrap();
    assert_eq!(attempts, 6);
    assert!(error.contains("always fails"));
    assert_eq!(effects(&pool).await, (21, 21));
    let w0 = outbox_consumer::watermarks(&pool, "fulfilment").await.unwrap().into_iter().find(|w| w.partition == 0).unwrap();
    assert_eq!((w0.committed_offset, w0.dead_lettered_count, w0.applied_count), (2, 1, 1));
}

/// Two instances of one group, partitions moving between them while batches
/// are in flight: every event has exactly one effect.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn rebalance_between_two_instances_has_no_duplicate_effect(pool: PgPool) {
    init_tracing();
    create_effects_table(&pool).await;
    let kafka = Kafka::new("orders", 4);
    let h = TestHandler::default();
    // Slow handlers keep batches in flight across the rebalances.
    h.delay_ms.store(2, std::sync::atomic::Ordering::SeqCst);
    let mut n = 0;
    let mut produce = |count: usize| {
        let fs: Vec<_> = (0..count).map(|i| fixture("orders", 4, &format!("o-{n}-{i}"))).collect();
        n += 1;
        fs
    };
    let mut cfg = config(&kafka, "fulfilment", "orders");
    cfg.max_batch_messages = 20;

    for f in produce(150) {
        kafka.send(&f).await;
    }
    let a = Running::start(IdempotentConsumer::new(cfg.clone(), pool.clone(), h.clone()).unwrap());
    a.wait_decided(20).await;
    let b = Running::start(IdempotentConsumer::new(cfg.clone(), pool.clone(), h.clone()).unwrap());
    for f in produce(150) {
        kafka.send(&f).await;
    }
    let p = pool.clone();
    wait_until(90, "300 receipts", || {
        let p = p.clone();
        async move { receipts(&p).await == 300 }
    })
    .await;
    // Both instances took part.
    let outs_a = a.stop().await;
    for f in produce(100) {
        kafka.send(&f).await;
    }
    let p = pool.clone();
    wait_until(90, "400 receipts", || {
        let p = p.clone();
        async move { receipts(&p).await == 400 }
    })
    .await;
    let outs_b = b.stop().await;
    let applied_a = outs_a.iter().filter(|o| o.kind() == "applied").count();
    let applied_b = outs_b.iter().filter(|o| o.kind() == "applied").count();
    assert!(applied_a > 0 && applied_b > 0, "a={applied_a} b={applied_b}");
    assert_eq!(applied_a + applied_b, 400);
    assert_eq!(effects(&pool).await, (400, 400), "no event has a second effect");
    let dups = outs_a.iter().chain(&outs_b).filter(|o| o.kind() == "duplicate").count();
    tracing::info!(applied_a, applied_b, dups, "rebalance test");
}

/// The readiness signal an embedding service exposes: not ready before the
/// run, ready while it runs and the cluster and database answer, not ready
/// while the cluster is down, ready again after, not ready once stopped.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn readiness_follows_the_cluster_and_the_run(pool: PgPool) {
    init_tracing();
    create_effects_table(&pool).await;
    let kafka = Kafka::new("orders", 2);
    let consumer = IdempotentConsumer::new(config(&kafka, "fulfilment", "orders"), pool.clone(), TestHandler::default()).unwrap();
    let readiness = consumer.readiness();
    assert_eq!(readiness.check(), Err("not running".into()));
    let r = Running::start(consumer);
    let ready = |want: bool, what: &'static str| {
        let readiness = readiness.clone();
        async move {
            wait_until(30, what, || {
                let readiness = readiness.clone();
                async move { readiness.is_ready() == want }
            })
            .await
        }
    };
    ready(true, "ready while running").await;
    kafka.cluster.broker_down(1).unwrap();
    ready(false, "not ready while the cluster is down").await;
    assert!(readiness.check().unwrap_err().starts_with("kafka"), "{:?}", readiness.check());
    kafka.cluster.broker_up(1).unwrap();
    ready(true, "ready again").await;
    r.stop().await;
    assert_eq!(readiness.check(), Err("stopped: shut down".into()));
}

/// The consumer publishes its watermarks to the watermark topic. While the
/// broker refuses that topic, consumption goes on undisturbed, every failed
/// publication is counted, and the next intervals try again; once the topic
/// is writable the record arrives with the consumer's committed offset.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn watermark_publication_failures_are_counted_retried_and_never_block(pool: PgPool) {
    use outbox_core::watermark_record::{WatermarkRecord, DEFAULT_TOPIC};
    use rdkafka::message::Message as _;
    use rdkafka::types::RDKafkaRespErr;

    create_effects_table(&pool).await;
    let kafka = Kafka::new("orders", 1);
    kafka.cluster.create_topic(DEFAULT_TOPIC, 1, 1).unwrap();
    kafka.cluster.topic_error(DEFAULT_TOPIC, RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED).unwrap();
    let mut last = 0;
    for i in 0..20 {
        last = kafka.send(&fixture("orders", 1, &format!("o-wm-{i}"))).await;
    }
    let mut cfg = config(&kafka, "fulfilment", "orders");
    cfg.watermark_publish_interval_ms = 100;
    cfg.watermark_publish_timeout_ms = 500;
    let c = Running::start(IdempotentConsumer::new(cfg, pool.clone(), TestHandler::default()).unwrap());
    c.wait_decided(20).await;
    let m = c.metrics.clone();
    wait_until(30, "two failed publications", || {
        let m = m.clone();
        async move { m.snapshot().watermark_publish_failures >= 2 }
    })
    .await;
    assert_eq!(m.snapshot().watermark_records_published, 0, "{:?}", m.snapshot());
    assert_eq!(receipts(&pool).await, 20, "consumption was not held up by the failing publication");

    kafka.cluster.topic_error(DEFAULT_TOPIC, RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR).unwrap();
    wait_until(30, "a published watermark record", || {
        let m = m.clone();
        async move { m.snapshot().watermark_records_published >= 1 }
    })
    .await;
    c.stop().await;
    let reader: BaseConsumer = ClientConfig::new().set("bootstrap.servers", kafka.bootstrap()).set("group.id", "wm-check").create().unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(DEFAULT_TOPIC, 0, Offset::Beginning).unwrap();
    reader.assign(&tpl).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let record = loop {
        assert!(std::time::Instant::now() < deadline, "no watermark record read");
        if let Some(Ok(msg)) = reader.poll(Duration::from_millis(200)) {
            break WatermarkRecord::decode(msg.key(), msg.payload()).unwrap();
        }
    };
    assert_eq!((record.consumer_id.as_str(), record.topic.as_str(), record.partition), ("fulfilment", "orders", 0));
    assert_eq!(record.committed_offset, last + 1);
    assert_eq!(record.applied_count, 20);
}

/// The last publication happens at a graceful shutdown: with an interval far
/// longer than the run, the record carrying the final watermark can only
/// come from it.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn watermarks_are_published_once_more_at_shutdown(pool: PgPool) {
    use outbox_core::watermark_record::{WatermarkRecord, DEFAULT_TOPIC};
    use rdkafka::message::Message as _;

    create_effects_table(&pool).await;
    let kafka = Kafka::new("orders", 1);
    kafka.cluster.create_topic(DEFAULT_TOPIC, 1, 1).unwrap();
    let mut last = 0;
    for i in 0..5 {
        last = kafka.send(&fixture("orders", 1, &format!("o-end-{i}"))).await;
    }
    let mut cfg = config(&kafka, "fulfilment", "orders");
    cfg.watermark_publish_interval_ms = 600_000;
    let c = Running::start(IdempotentConsumer::new(cfg, pool.clone(), TestHandler::default()).unwrap());
    c.wait_decided(5).await;
    let m = c.metrics.clone();
    assert_eq!(m.snapshot().watermark_records_published, 0, "nothing to publish at the first interval");
    c.stop().await;
    assert_eq!(m.snapshot().watermark_records_published, 1, "{:?}", m.snapshot());
    let reader: BaseConsumer = ClientConfig::new().set("bootstrap.servers", kafka.bootstrap()).set("group.id", "wm-check").create().unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(DEFAULT_TOPIC, 0, Offset::Beginning).unwrap();
    reader.assign(&tpl).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let record = loop {
        assert!(std::time::Instant::now() < deadline, "no watermark record read");
        if let Some(Ok(msg)) = reader.poll(Duration::from_millis(200)) {
            break WatermarkRecord::decode(msg.key(), msg.payload()).unwrap();
        }
    };
    assert_eq!((record.committed_offset, record.applied_count), (last + 1, 5));
}

/// Commits `offset` for `group` on a partition, as `kafka-consumer-groups
/// --reset-offsets` does: as a member of the group (the in-process cluster
/// takes commits from members only), which then leaves.
fn reset_group(kafka: &Kafka, group: &str, topic: &str, partition: i32, offset: i64) {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", kafka.bootstrap())
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("session.timeout.ms", "6000")
        .create()
        .unwrap();
    c.subscribe(&[topic]).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while c.assignment().map(|a| a.count()).unwrap_or(0) == 0 {
        assert!(std::time::Instant::now() < deadline, "no assignment for the reset");
        let _ = c.poll(Duration::from_millis(100));
    }
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(offset)).unwrap();
    c.commit(&tpl, rdkafka::consumer::CommitMode::Sync).expect("offset reset");
    c.unsubscribe();
    drop(c);
    assert_eq!(committed_offset(kafka, group, topic, partition), Some(offset));
}

async fn open_gaps(pool: &PgPool, consumer: &str) -> Vec<(String, i32, i64, i64)> {
    outbox_consumer::list_gaps(pool, Some(consumer), false, 100).await.unwrap().into_iter().map(|g| (g.topic, g.partition, g.from_offset, g.to_offset)).collect()
}

async fn watermark_of(pool: &PgPool, consumer: &str, partition: i32) -> i64 {
    outbox_consumer::watermarks(pool, consumer).await.unwrap().iter().filter(|w| w.partition == partition).map(|w| w.committed_offset).max().unwrap()
}

/// An operator resets the group to the end of the log while five messages
/// were still unread: the consumer resumes past them. Its watermark stays
/// where its reading stopped and the skipped range is an open gap, counted.
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn a_group_reset_to_the_end_is_a_gap_the_watermark_does_not_pass(pool: PgPool) {
    init_tracing();
    create_effects_table(&pool).await;
    let kafka = Kafka::new("orders", 1);
    let h = TestHandler::default();
    for i in 0..3 {
        kafka.send(&fixture("orders", 1, &format!("read-{i}"))).await;
    }
    let c = Running::start(IdempotentConsumer::new(config(&kafka, "fulfilment", "orders"), pool.clone(), h.clone()).unwrap());
    c.wait_decided(3).await;
    c.stop().await;
    assert_eq!(committed_offset(&kafka, "fulfilment", "orders", 0), Some(3));

    let mut end = 0;
    for i in 0..5 {
        end = kafka.send(&fixture("orders", 1, &format!("skipped-{i}"))).await + 1;
    }
    reset_group(&kafka, "fulfilment", "orders", 0, end);
    let later: Vec<Fixture> = (0..2).map(|i| fixture("orders", 1, &format!("later-{i}"))).collect();
    for f in &later {
        kafka.send(f).await;
    }
    let c = Running::start(IdempotentConsumer::new(config(&kafka, "fulfilment", "orders"), pool.clone(), h.clone()).unwrap());
    c.wait_decided(2).await;
    let metrics = c.metrics.clone();
    let outs = c.stop().await;
    let applied: Vec<String> = outs.iter().filter_map(|o| o.receipt()).map(|r| r.event_id.to_string()).collect();
    assert_eq!(applied, later.iter().map(|f| f.event_id().to_string()).collect::<Vec<_>>(), "only the messages after the reset were read");
    assert_eq!(open_gaps(&pool, "fulfilment").await, vec![("orders".to_owned(), 0, 3, 8)]);
    assert_eq!(watermark_of(&pool, "fulfilment", 0).await, 3, "the watermark stays below the unread messages");
    let gapped: Vec<Option<i64>> = outbox_consumer::watermarks(&pool, "fulfilment").await.unwrap().iter().map(|w| w.open_gap_end).collect();
    assert_eq!(gapped, vec![Some(8)], "what its watermark record says: [3, 8) skipped");
    assert_eq!(metrics.snapshot().offset_gaps, 1);
}

/// Every message the consumer fetches carries the id of its topic's log as
/// the cluster reports it (DescribeTopics), and the partition's reading
/// and watermark are kept under it: a topic created again under its name
/// has another id, and its messages then start the reading over
/// (`store_conformance::a_replaced_log_read_from_the_old_position_is_a_gap_on_both_stores`).
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn fetched_messages_carry_their_topics_id_into_the_reading_and_watermark(pool: PgPool) {
    init_tracing();
    create_effects_table(&pool).await;
    let kafka = Kafka::new("orders", 1);
    let h = TestHandler::default();
    for i in 0..3 {
        kafka.send(&fixture("orders", 1, &format!("id-{i}"))).await;
    }
    let c = Running::start(IdempotentConsumer::new(config(&kafka, "fulfilment", "orders"), pool.clone(), h.clone()).unwrap());
    c.wait_decided(3).await;
    c.stop().await;
    let admin: BaseConsumer = ClientConfig::new().set("bootstrap.servers", kafka.bootstrap()).create().unwrap();
    let id = outbox_topic_id::topic_id(admin.client(), "orders", Duration::from_secs(10)).expect("DescribeTopics").expect("the mock cluster gives topic ids");
    let id = outbox_core::envelope::topic_id_text(&id);
    let marks: Vec<(i64, Option<String>)> =
        sqlx::query_as("SELECT committed_offset, log_id FROM outbox_consumer_watermarks WHERE consumer_id = 'fulfilment'").fetch_all(&pool).await.unwrap();
    assert_eq!(marks, vec![(3, Some(id.clone()))]);
    let reading: Option<String> = sqlx::query_scalar("SELECT log_id FROM outbox_consumer_readings WHERE consumer_id = 'fulfilment'").fetch_one(&pool).await.unwrap();
    assert_eq!(reading, Some(id));
}

/// A scratch replay (a new group, its own database, the production
/// consumer's id) in replay mode publishes no watermark record: the
/// production consumer's watermarks on the watermark topic are left alone
/// (a replay once published under the production name and moved them).
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn a_replay_under_the_same_consumer_id_publishes_no_watermark(pool: PgPool) {
    use outbox_core::watermark_record::DEFAULT_TOPIC;

    create_effects_table(&pool).await;
    let kafka = Kafka::new("orders", 1);
    kafka.cluster.create_topic(DEFAULT_TOPIC, 1, 1).unwrap();
    for i in 0..3 {
        kafka.send(&fixture("orders", 1, &format!("o-replay-{i}"))).await;
    }
    let mut cfg = config(&kafka, "fulfilment", "orders");
    cfg.group_id = "fulfilment-replay-1".into();
    cfg.watermark_publish_interval_ms = 200;
    cfg.replay = true;
    let c = Running::start(IdempotentConsumer::new(cfg, pool.clone(), TestHandler::default()).unwrap());
    c.wait_decided(3).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let m = c.metrics.clone();
    c.stop().await;
    assert_eq!((m.snapshot().applied, m.snapshot().watermark_records_published), (3, 0), "{:?}", m.snapshot());
    // Its own database has its watermark; the topic has nothing.
    assert_eq!(outbox_consumer::watermarks(&pool, "fulfilment").await.unwrap()[0].committed_offset, 3);
    let reader: BaseConsumer = ClientConfig::new().set("bootstrap.servers", kafka.bootstrap()).set("group.id", "wm-check").create().unwrap();
    let (low, high) = reader.fetch_watermarks(DEFAULT_TOPIC, 0, Duration::from_secs(10)).unwrap();
    assert_eq!(high - low, 0, "no record on the watermark topic");
}
