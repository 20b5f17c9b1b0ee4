//! The reconciler on real PostgreSQL and librdkafka's in-process Kafka
//! cluster: one test per branch of PROTOCOL §6, §7 and §9.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{headers, EventState, ManualClock, OutboxStore, RetryPolicy, RoutePolicy};
use outbox_producer::kafka::KafkaBroker;
use outbox_producer::{
    migrate_destination, purge, register_consumer, Dispatcher, DispatcherConfig, MigrationOutcome, PgStore, Reconciler, ReconcilerConfig, RetentionPolicy,
};
use outbox_tests::kafka::{read_topic, TestCluster};
use outbox_tests::*;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use sqlx::PgPool;

const TOPIC: &str = "orders";
const PARTITIONS: i32 = 3;

struct Fixture {
    pool: PgPool,
    cluster: TestCluster,
    broker: Arc<KafkaBroker>,
    clock: ManualClock,
    store: PgStore,
}

async fn fixture(pool: PgPool) -> Fixture {
    let Stack { pool, cluster, broker, clock, store } = stack(pool, TOPIC, PARTITIONS, |cfg| cfg.extra.push(("reconnect.backoff.max.ms".into(), "500".into()))).await;
    Fixture { pool, cluster, broker, clock, store }
}

impl Fixture {
    fn dispatcher(&self) -> Dispatcher<KafkaBroker> {
        let cfg = DispatcherConfig { name: "d".into(), lease_ms: 1_000, ..Default::default() };
        Dispatcher::new(self.store.clone(), self.broker.clone(), cfg).unwrap()
    }

    fn reconciler(&self) -> Reconciler<KafkaBroker> {
        let cfg = ReconcilerConfig { owner: "r".into(), retry: RetryPolicy { in_flight_bound_ms: 30_000, ..RetryPolicy::default() }, ..Default::default() };
        Reconciler::new(self.store.clone(), self.broker.clone(), cfg).unwrap()
    }

    /// A dispatcher registers an attempt and dies before sending: after its
    /// lease the event is DISPATCH_UNKNOWN and nothing is in the log.
    async fn unknown_never_sent(&self, order: &str) -> outbox_producer::Emitted {
        let e = create_order(&self.pool, order, 1).await;
        let claimed = self.store.claim_batch("crashed", 10, 1_000).await.unwrap();
        let mine = claimed.iter().find(|c| &c.envelope.event_id == e.event_id()).unwrap();
        self.store.register_attempt(&mine.token).await.unwrap();
        for c in claimed.iter().filter(|c| &c.envelope.event_id != e.event_id()) {
            self.store.release(&c.token).await.unwrap();
        }
        self.clock.advance(1_500);
        assert_eq!(self.store.expire_leases().await.unwrap().unknown, 1);
        assert_eq!(self.state(e.event_id().as_str()).await, EventState::DispatchUnknown);
        e
    }

    async fn state(&self, id: &str) -> EventState {
        EventState::parse(&sqlx::query_scalar::<_, String>("SELECT state FROM outbox_events WHERE event_id = $1").bind(id).fetch_one(&self.pool).await.unwrap())
            .unwrap()
    }

    async fn count(&self, sql: &str) -> i64 {
        count(&self.pool, sql).await
    }

    fn log_of(&self, topic: &str, id: &str) -> usize {
        read_topic(&self.cluster.bootstrap, topic, PARTITIONS).iter().filter(|m| m.header(headers::EVENT_ID).as_deref() == Some(id)).count()
    }
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn written_but_unacked_message_is_found_by_the_scan_and_published(pool: PgPool) {
    let f = fixture(pool).await;
    let d = f.dispatcher();
    create_order(&f.pool, "o-0", 1).await;
    assert_eq!(d.dispatch_once("w").await.unwrap().published, 1);
    let e = create_order(&f.pool, "o-1", 1).await;
    let mock = f.cluster.mock.as_ref().unwrap();
    mock.broker_round_trip_time(1, Duration::from_millis(7_000)).unwrap();
    assert_eq!(d.dispatch_once("w").await.unwrap().unknown, 1);
    mock.broker_round_trip_time(1, Duration::ZERO).unwrap();

    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!((r.published, r.retried), (1, 0), "{r:?}");
    assert_eq!(f.state(e.event_id().as_str()).await, EventState::Published);
    assert_eq!(f.count("SELECT count(*) FROM outbox_unknown_resolutions WHERE outcome = 'PUBLISHED'").await, 1);
    assert_eq!(f.log_of(TOPIC, e.event_id().as_str()), 1, "found, not re-sent");
}

/// A reconciler claims only the UNKNOWN events frozen for its own broker's
/// cluster, as a dispatcher claims: another cluster's reconciler would get
/// "unavailable" from its broker and hand the event back, two reconcilers
/// taking each other's events in turn. A store scoped to the other cluster
/// claims exactly the other event.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_reconciler_claims_only_its_own_clusters_unknowns(pool: PgPool) {
    let f = fixture(pool).await;
    let ours = f.unknown_never_sent("o-ours").await;
    route(&f.pool, ORDER_CREATED, "cluster-b", TOPIC, PARTITIONS as u32).await;
    let theirs = f.unknown_never_sent("o-theirs").await;

    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!(r.examined, 1, "only this cluster's UNKNOWN: {r:?}");
    assert_eq!(f.state(theirs.event_id().as_str()).await, EventState::DispatchUnknown);
    // The reconciler records each lookup it made, with the event it asked about.
    let asked = |id: String| format!("SELECT count(*) FROM outbox_unknown_lookups WHERE owner = 'r' AND event_id = '{id}'");
    assert!(f.count(&asked(ours.event_id().to_string())).await >= 1, "this cluster's event was looked up");
    assert_eq!(f.count(&asked(theirs.event_id().to_string())).await, 0, "another cluster's event was never taken");

    let b = f.store.clone().scoped_to_cluster("cluster-b");
    let tasks = b.begin_reconcile("rb", 10, 1_000).await.unwrap();
    assert_eq!(tasks.iter().map(|t| t.event.event_id.to_string()).collect::<Vec<_>>(), vec![theirs.event_id().to_string()]);
}

/// A receipt whose payload diverges from the frozen envelope quarantines an
/// UNKNOWN event, and the unknown outcome is recorded as resolved by
/// quarantine, since the time it became unknown.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn divergent_receipt_for_an_unknown_event_quarantines_it_and_records_the_resolution(pool: PgPool) {
    let f = fixture(pool).await;
    let e = f.unknown_never_sent("o-1").await;
    let id = e.event_id().as_str();
    let since: i64 = sqlx::query_scalar("SELECT unknown_since_ms FROM outbox_events WHERE event_id = $1").bind(id).fetch_one(&f.pool).await.unwrap();
    let attempt: String = sqlx::query_scalar("SELECT attempt_id FROM outbox_attempts WHERE event_id = $1").bind(id).fetch_one(&f.pool).await.unwrap();
    let tampered = outbox_core::BrokerReceipt {
        event_id: e.event_id().clone(),
        envelope_generation: 1,
        attempt_id: attempt.parse().unwrap(),
        payload_digest: outbox_core::sha256_digest(b"not what was frozen"),
        destination_digest: e.destination_digest.clone(),
        cluster_id: f.broker.cluster_id().into(),
        topic: TOPIC.into(),
        topic_id: e.destination.topic_id.clone(),
        partition: e.destination.partition,
        offset: 0,
        key: Some(e.destination.routing_key.as_bytes().to_vec()),
        log_id: None,
    };
    let out = f.store.accept_dispatch_receipt(&tampered).await.unwrap();
    assert!(matches!(out.decision, outbox_core::ReceiptDecision::Quarantine { move_event: true, .. }), "{out:?}");
    assert_eq!(f.state(id).await, EventState::Quarantined);
    let resolutions: Vec<(String, i64, String)> =
        sqlx::query_as("SELECT event_id, unknown_since_ms, outcome FROM outbox_unknown_resolutions").fetch_all(&f.pool).await.unwrap();
    assert_eq!(resolutions, vec![(id.to_owned(), since, "QUARANTINED".to_owned())]);
    assert_eq!(f.count("SELECT count(*) FROM outbox_publish_receipts").await, 0);
}

/// Issue 47: a forger writes the registered attempt's very headers and the
/// frozen payload to the frozen partition, under another key than the
/// frozen routing key, while the attempt's own outcome is unknown. The
/// reconciler's lookup finds that message; it is not the event's
/// publication (consumers partitioning by key would see the event under the
/// forged key): the receipt transaction quarantines it as `key_mismatch`,
/// with the key found in the evidence, and nothing fills the slot.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_copy_under_another_key_found_by_the_lookup_is_quarantined_not_published(pool: PgPool) {
    let f = fixture(pool).await;
    let e = create_order(&f.pool, "o-1", 1).await;
    let id = e.event_id().as_str();
    let claimed = f.store.claim_batch("crashed", 10, 1_000).await.unwrap();
    let mine = claimed.iter().find(|c| &c.envelope.event_id == e.event_id()).unwrap();
    let attempt = f.store.register_attempt(&mine.token).await.unwrap();
    for c in claimed.iter().filter(|c| &c.envelope.event_id != e.event_id()) {
        f.store.release(&c.token).await.unwrap();
    }
    use outbox_core::Broker as _;
    let mut forged = outbox_producer::dispatcher::outgoing_message(mine, &attempt);
    assert_eq!(forged.key, mine.destination.routing_key.as_bytes());
    forged.key = b"tenant-9.order.someone-else".to_vec();
    assert!(matches!(f.broker.send(forged.clone()).await, outbox_core::SendOutcome::Acked { .. }));
    f.clock.advance(1_500);
    assert_eq!(f.store.expire_leases().await.unwrap().unknown, 1);

    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!(f.state(id).await, EventState::Quarantined, "a copy under another key was taken for the publication: {r:?}");
    assert_eq!((r.published, r.quarantined), (0, 1), "{r:?}");
    let (reason, key): (String, Option<String>) =
        sqlx::query_as("SELECT reason, evidence->'receipt'->>'key' FROM outbox_quarantine WHERE event_id = $1").bind(id).fetch_one(&f.pool).await.unwrap();
    assert_eq!((reason.as_str(), key), ("key_mismatch", Some(hex::encode(&forged.key))));
    assert_eq!(f.count("SELECT count(*) FROM outbox_publish_receipts").await, 0);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn proven_absent_gives_exactly_one_retry_to_the_same_destination(pool: PgPool) {
    let f = fixture(pool).await;
    let e = f.unknown_never_sent("o-1").await;
    let id = e.event_id().as_str();
    let rec = f.reconciler();

    // Young attempt: it may still be in flight inside a client, so no proof yet.
    let r = rec.resolve_unknown_once().await.unwrap();
    assert_eq!((r.retried, r.rechecks), (0, 1), "{r:?}");
    assert_eq!(f.state(id).await, EventState::DispatchUnknown);

    f.clock.advance(60_000);
    let r = rec.resolve_unknown_once().await.unwrap();
    assert_eq!(r.retried, 1, "{r:?}");
    assert_eq!(f.state(id).await, EventState::RetryClaimed);
    // Nothing else is due: another round changes nothing.
    assert_eq!(rec.resolve_unknown_once().await.unwrap().examined, 0);

    assert_eq!(f.dispatcher().dispatch_once("w").await.unwrap().published, 1);
    let attempts: Vec<(i32, String, String)> =
        sqlx::query_as("SELECT attempt_generation, state, destination_digest FROM outbox_attempts ORDER BY 1").fetch_all(&f.pool).await.unwrap();
    assert_eq!(attempts, vec![(1, "ABSENT".into(), e.destination_digest.clone()), (2, "ACKED".into(), e.destination_digest.clone())]);
    assert_eq!(f.log_of(TOPIC, id), 1);
    assert_eq!(f.count("SELECT count(*) FROM outbox_unknown_resolutions").await, 1);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn unqueryable_broker_keeps_the_event_unknown_with_no_cross_target_send(pool: PgPool) {
    let f = fixture(pool).await;
    let e = f.unknown_never_sent("o-1").await;
    let id = e.event_id().as_str();
    // The route moves to another cluster meanwhile: it must not matter.
    route(&f.pool, ORDER_CREATED, "cluster-elsewhere", "orders-elsewhere", 3).await;
    f.clock.advance(60_000);
    f.cluster.mock.as_ref().unwrap().broker_down(1).unwrap();
    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!((r.retried, r.rechecks, r.published), (0, 1, 0), "{r:?}");
    assert_eq!(f.state(id).await, EventState::DispatchUnknown);
    let next: i64 = sqlx::query_scalar("SELECT next_check_at_ms FROM outbox_events WHERE event_id = $1").bind(id).fetch_one(&f.pool).await.unwrap();
    assert!(next > f.store.now_ms(), "the next check is scheduled");
    assert_eq!(f.count("SELECT count(*) FROM outbox_attempts").await, 1, "no new attempt");
    assert_eq!(f.count("SELECT count(DISTINCT destination_digest) FROM outbox_attempts").await, 1);
    // A dispatcher of another cluster never claims it.
    f.cluster.mock.as_ref().unwrap().broker_up(1).unwrap();
    let other = TestCluster::start();
    other.topic("orders-elsewhere", 3);
    let other_broker = other.broker(5_000).await;
    let d = Dispatcher::new(f.store.clone(), other_broker, DispatcherConfig { name: "x".into(), ..Default::default() }).unwrap();
    assert_eq!(d.dispatch_once("x").await.unwrap().claimed, 0);
    assert_eq!(f.state(id).await, EventState::DispatchUnknown);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn bypass_publish_is_detected_and_a_healthy_run_has_no_findings(pool: PgPool) {
    let f = fixture(pool).await;
    for i in 0..5 {
        create_order(&f.pool, &format!("o-{i}"), i).await;
    }
    assert_eq!(f.dispatcher().dispatch_once("w").await.unwrap().published, 5);
    let rec = f.reconciler();
    let c = rec.compare_once().await.unwrap();
    assert_eq!(c.total(), 0, "{c:?}");
    assert_eq!(c.scanned_messages, 5);
    let report = rec.report().await.unwrap();
    assert!(report.findings.is_empty());
    assert_eq!((report.committed_events, report.publish_receipts), (5, 5));

    // Someone publishes around the outbox: one message with a made-up eventId, one with none.
    let producer: FutureProducer = ClientConfig::new().set("bootstrap.servers", &f.cluster.bootstrap).create().unwrap();
    let forged = outbox_core::EventId::generate(1);
    let hdrs = rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header { key: headers::EVENT_ID, value: Some(forged.as_str()) });
    producer.send(FutureRecord::to(TOPIC).partition(0).key("k").payload("{}").headers(hdrs), Duration::from_secs(5)).await.unwrap();
    producer.send(FutureRecord::<str, str>::to(TOPIC).partition(1).payload("{}"), Duration::from_secs(5)).await.unwrap();

    let c = rec.compare_once().await.unwrap();
    assert_eq!(c.bypass_publish, 2, "{c:?}");
    let report = rec.report().await.unwrap();
    let bypass: Vec<_> = report.findings.iter().filter(|x| x.kind == "bypass_publish").collect();
    assert_eq!(bypass.len(), 2);
    assert!(bypass.iter().any(|x| x.event_id == forged.as_str()));
    assert!(report.to_text().contains("bypass_publish"));
    // The next round reads on from its cursor; the evidence stays open.
    let c = rec.compare_once().await.unwrap();
    assert_eq!((c.bypass_publish, c.scanned_messages), (0, 0));
    assert_eq!(rec.report().await.unwrap().findings.len(), 2);
}

/// Two messages of one forged eventId in one page: two findings of one kind
/// and event in one round. The round once failed on them (its findings
/// upsert met one row twice) after the scan's cursor had moved past them,
/// so they were never recorded; the scan now records each page's findings
/// with its cursor, one row per kind and event.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn two_findings_of_one_event_in_one_page_are_recorded(pool: PgPool) {
    let f = fixture(pool).await;
    let producer: FutureProducer = ClientConfig::new().set("bootstrap.servers", &f.cluster.bootstrap).create().unwrap();
    let forged = outbox_core::EventId::generate(1);
    for _ in 0..2 {
        let hdrs = rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header { key: headers::EVENT_ID, value: Some(forged.as_str()) });
        producer.send(FutureRecord::to(TOPIC).partition(0).key("k").payload("{}").headers(hdrs), Duration::from_secs(5)).await.unwrap();
    }
    let rec = f.reconciler();
    let c = rec.compare_once().await.unwrap();
    assert_eq!((c.bypass_publish, c.scanned_messages), (2, 2), "{c:?}");
    let report = rec.report().await.unwrap();
    let bypass: Vec<_> = report.findings.iter().filter(|x| x.kind == "bypass_publish").collect();
    assert_eq!(bypass.len(), 1, "{:?}", report.findings);
    assert_eq!(bypass[0].event_id, forged.as_str());
}

/// A message on an outbox topic with a header name that is not UTF-8
/// (rdkafka's own header accessor panics on it): the bypass scan reports it,
/// reads past it, and the next round starts after it.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn bypass_scan_reports_a_non_utf8_header_name_and_moves_on(pool: PgPool) {
    let f = fixture(pool).await;
    create_order(&f.pool, "o-1", 1).await;
    assert_eq!(f.dispatcher().dispatch_once("w").await.unwrap().published, 1);
    let producer: FutureProducer = ClientConfig::new().set("bootstrap.servers", &f.cluster.bootstrap).create().unwrap();
    let forged = outbox_core::EventId::generate(1);
    let hdrs = rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header { key: headers::EVENT_ID, value: Some(forged.as_str()) });
    let native = hdrs.as_borrowed() as *const rdkafka::message::BorrowedHeaders as *mut rdkafka::bindings::rd_kafka_headers_t;
    let name = [b'x', 0xff, 0xfe];
    // SAFETY: `hdrs` owns the list; librdkafka copies name and value.
    let err = unsafe { rdkafka::bindings::rd_kafka_header_add(native, name.as_ptr().cast(), name.len() as isize, b"v".as_ptr().cast(), 1) };
    assert_eq!(err, rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR);
    producer.send(FutureRecord::to(TOPIC).partition(0).key("k").payload("{}").headers(hdrs), Duration::from_secs(5)).await.unwrap();
    create_order(&f.pool, "o-2", 2).await;
    assert_eq!(f.dispatcher().dispatch_once("w").await.unwrap().published, 1);

    let rec = f.reconciler();
    let c = rec.compare_once().await.unwrap();
    assert_eq!((c.bypass_publish, c.scanned_messages), (1, 3), "{c:?}");
    let report = rec.report().await.unwrap();
    assert!(report.findings.iter().any(|x| x.kind == "bypass_publish" && x.event_id == forged.as_str()), "{:?}", report.findings);
    let c = rec.compare_once().await.unwrap();
    assert_eq!((c.bypass_publish, c.scanned_messages), (0, 0), "the cursor moved past the message");
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn aged_pending_and_unknown_past_slo_are_findings(pool: PgPool) {
    let f = fixture(pool).await;
    let stuck = create_order(&f.pool, "o-stuck", 1).await;
    let unknown = f.unknown_never_sent("o-unknown").await;
    f.clock.advance(20 * 60_000);
    f.cluster.mock.as_ref().unwrap().broker_down(1).unwrap();
    let rec = f.reconciler();
    let c = rec.compare_once().await.unwrap();
    assert!(c.aged_pending >= 1 && c.unknown_past_slo == 1, "{c:?}");
    let report = rec.report().await.unwrap();
    assert!(report.findings.iter().any(|x| x.kind == "aged_pending" && x.event_id == stuck.event_id().as_str()));
    assert!(report.findings.iter().any(|x| x.kind == "unknown_past_slo" && x.event_id == unknown.event_id().as_str()));
    assert_eq!(report.unknown_open, 1);
    assert_eq!(report.unknown_age_histogram.iter().map(|b| b.count).sum::<i64>(), 1);
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn purge_never_overtakes_a_lagging_mandatory_consumer(pool: PgPool) {
    let f = fixture(pool).await;
    outbox_consumer::migrate(&f.pool).await.unwrap();
    let mut ids = Vec::new();
    for i in 0..6 {
        ids.push(create_order(&f.pool, &format!("o-{i}"), i).await);
    }
    assert_eq!(f.dispatcher().dispatch_once("w").await.unwrap().published, 6);
    register_consumer(&f.pool, "fulfilment", &[TOPIC], true, true).await.unwrap();
    // The consumer has passed everything on partition 0 only.
    let end0: i64 = f.count("SELECT coalesce(max(\"offset\") + 1, 0) FROM outbox_publish_receipts WHERE partition = 0").await;
    sqlx::query("INSERT INTO outbox_consumer_watermarks (consumer_id, cluster_id, topic, partition, committed_offset) VALUES ('fulfilment', $3, $1, 0, $2)")
        .bind(TOPIC)
        .bind(end0)
        .bind(f.broker.cluster_id())
        .execute(&f.pool)
        .await
        .unwrap();
    let on_p0 = f.count("SELECT count(*) FROM outbox_publish_receipts WHERE partition = 0").await as u64;
    let policy = RetentionPolicy { replay_window_ms: 60_000, batch_size: 2, max_batches: 100 };

    // Inside the replay window nothing moves.
    let r = purge(&f.pool, f.store.now_ms(), &policy, false, |_| {}).await.unwrap();
    assert_eq!((r.retained, r.purged), (0, 0));
    let later = f.store.now_ms() + 120_000;
    let dry = purge(&f.pool, later, &policy, true, |_| {}).await.unwrap();
    assert_eq!((dry.retained, dry.purged, dry.held_by_consumers), (6, on_p0, 6 - on_p0));
    assert_eq!(f.count("SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").await, 6, "a dry run writes nothing");

    let r = purge(&f.pool, later, &policy, false, |_| {}).await.unwrap();
    assert_eq!((r.retained, r.purged, r.held_by_consumers), (6, on_p0, 6 - on_p0), "{r:?}");
    assert!(r.batches > 2, "bounded batches");
    assert_eq!(f.count("SELECT count(*) FROM outbox_events WHERE state = 'PURGED' AND partition <> 0").await, 0);

    // The consumer is far along a topic of the same name on another
    // cluster: that says nothing about this cluster's log, nothing more goes.
    sqlx::query("INSERT INTO outbox_consumer_watermarks (consumer_id, cluster_id, topic, partition, committed_offset) VALUES ('fulfilment', 'kafka-b', $1, 1, 1000), ('fulfilment', 'kafka-b', $1, 2, 1000)")
        .bind(TOPIC)
        .execute(&f.pool)
        .await
        .unwrap();
    let r = purge(&f.pool, later, &policy, false, |_| {}).await.unwrap();
    assert_eq!((r.purged, r.held_by_consumers), (0, 6 - on_p0), "a watermark on another cluster held nothing back: {r:?}");
    let report = f.reconciler().report().await.unwrap();
    assert!(report.consumer_lag.iter().all(|l| l.cluster_id == f.broker.cluster_id()), "lag is of this cluster's logs: {:?}", report.consumer_lag);
    assert_eq!(report.consumer_lag.iter().map(|l| l.lag_events).sum::<i64>(), 6 - on_p0 as i64);

    // The consumer catches up on this cluster: the rest goes.
    sqlx::query("INSERT INTO outbox_consumer_watermarks (consumer_id, cluster_id, topic, partition, committed_offset) VALUES ('fulfilment', $2, $1, 1, 1000), ('fulfilment', $2, $1, 2, 1000)")
        .bind(TOPIC)
        .bind(f.broker.cluster_id())
        .execute(&f.pool)
        .await
        .unwrap();
    let r = purge(&f.pool, later, &policy, false, |_| {}).await.unwrap();
    assert_eq!((r.purged, r.held_by_consumers), (6 - on_p0, 0));

    // Tombstones: receipts and digests stay; a retried command still gets its first eventId.
    assert_eq!(f.count("SELECT count(*) FROM outbox_events WHERE state = 'PURGED' AND payload IS NULL").await, 6);
    assert_eq!(f.count("SELECT count(*) FROM outbox_publish_receipts").await, 6);
    let payload = order_payload("o-0", 0);
    let mut tx = f.pool.begin().await.unwrap();
    let again = outbox_producer::emit(&mut tx, &order_request("create-o-0", "o-0", &payload), &Default::default()).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!((again.event_id(), again.inserted), (ids[0].event_id(), false));
    // A late duplicate ACK after the purge is still recognised as a duplicate.
    let primary: (String, String, i32, i64) =
        sqlx::query_as("SELECT event_id, attempt_id, partition, \"offset\" FROM outbox_publish_receipts LIMIT 1").fetch_one(&f.pool).await.unwrap();
    let dup = outbox_core::BrokerReceipt {
        event_id: primary.0.parse().unwrap(),
        envelope_generation: 1,
        attempt_id: primary.1.parse().unwrap(),
        payload_digest: sqlx::query_scalar("SELECT payload_digest FROM outbox_events WHERE event_id = $1").bind(&primary.0).fetch_one(&f.pool).await.unwrap(),
        destination_digest: sqlx::query_scalar("SELECT destination_digest FROM outbox_events WHERE event_id = $1").bind(&primary.0).fetch_one(&f.pool).await.unwrap(),
        cluster_id: f.broker.cluster_id().into(),
        topic: TOPIC.into(),
        topic_id: None,
        partition: primary.2,
        offset: primary.3 + 10_000,
        key: None,
        log_id: None,
    };
    let out = f.store.accept_dispatch_receipt(&dup).await.unwrap();
    assert_eq!(out.decision, outbox_core::ReceiptDecision::Duplicate);
    assert_eq!(out.state, EventState::Purged);
}

/// A page in which every candidate is held neither ends nor repeats the
/// pass: pages follow a keyset on `(published_at_ms, event_id)`, so the
/// events after held ones are judged in the same call; and one call judges
/// at most `batch_size * max_batches` candidates.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn purge_pages_past_held_events_within_its_bound(pool: PgPool) {
    let f = fixture(pool).await;
    outbox_consumer::migrate(&f.pool).await.unwrap();
    for i in 0..9 {
        create_order(&f.pool, &format!("o-{i}"), i).await;
    }
    let mut published = 0;
    while published < 9 {
        published += f.dispatcher().dispatch_once("w").await.unwrap().published;
    }
    register_consumer(&f.pool, "fulfilment", &[TOPIC], false, true).await.unwrap();
    let later = f.store.now_ms() + 120_000;
    let one_by_one = RetentionPolicy { replay_window_ms: 60_000, batch_size: 1, max_batches: 100 };
    // No watermark: every page holds its one event, and the pass ends.
    let r = purge(&f.pool, later, &one_by_one, false, |_| {}).await.unwrap();
    assert_eq!((r.retained, r.purged, r.held_by_consumers), (9, 0, 9), "{r:?}");

    // The events in the order a pass reads them. The consumer passes every
    // event of the partition whose first event comes last in that order:
    // all the events before it are held.
    let order: Vec<i32> = sqlx::query_scalar(
        "SELECT r.partition FROM outbox_events e JOIN outbox_publish_receipts r ON r.event_id = e.event_id AND r.envelope_generation = e.envelope_generation
         ORDER BY e.published_at_ms, e.event_id",
    )
    .fetch_all(&f.pool)
    .await
    .unwrap();
    let first_of = |p: i32| order.iter().position(|q| *q == p);
    let p = (0..PARTITIONS).filter(|p| first_of(*p).is_some()).max_by_key(|p| first_of(*p)).unwrap();
    let (before, on_p) = (first_of(p).unwrap(), order.iter().filter(|q| **q == p).count() as u64);
    assert!(before > 0, "the events are on one partition: {order:?}");
    sqlx::query("INSERT INTO outbox_consumer_watermarks (consumer_id, cluster_id, topic, partition, committed_offset) VALUES ('fulfilment', $1, $2, $3, 1000000)")
        .bind(f.broker.cluster_id())
        .bind(TOPIC)
        .bind(p)
        .execute(&f.pool)
        .await
        .unwrap();
    // Bounded: `before` pages of one judge the held events only.
    let tight = RetentionPolicy { max_batches: before as u32, ..one_by_one };
    let r = purge(&f.pool, later, &tight, false, |_| {}).await.unwrap();
    assert_eq!((r.purged, r.held_by_consumers), (0, before as u64), "{r:?}");
    let dry = purge(&f.pool, later, &tight, true, |_| {}).await.unwrap();
    assert_eq!((dry.purged, dry.held_by_consumers), (0, before as u64), "the dry run is bounded alike: {dry:?}");
    // With room, the same call pages past them to the passed events.
    let dry = purge(&f.pool, later, &one_by_one, true, |_| {}).await.unwrap();
    assert_eq!((dry.retained, dry.purged, dry.held_by_consumers), (0, on_p, 9 - on_p), "{dry:?}");
    let r = purge(&f.pool, later, &one_by_one, false, |_| {}).await.unwrap();
    assert_eq!((r.purged, r.held_by_consumers), (on_p, 9 - on_p), "{r:?}");
    assert_eq!(f.count("SELECT count(*) FROM outbox_events e JOIN outbox_publish_receipts r USING (event_id) WHERE e.state = 'PURGED'").await, on_p as i64);
    assert_eq!(f.count(&format!("SELECT count(*) FROM outbox_events e JOIN outbox_publish_receipts r USING (event_id) WHERE e.state = 'PURGED' AND r.partition <> {p}")).await, 0);
}

/// Retention on PostgreSQL decides with `outbox_core::may_purge` on the
/// rows it reads for each page (the mandatory consumers of the page's
/// topics, their watermarks on the page's logs): over seeded random
/// registries and watermarks (several mandatory and optional consumers, rows
/// on this cluster and on another cluster with the same topic name, rows of
/// no topic id, of the topic's id and of another incarnation's id, offsets
/// around each event's), every pass purges exactly the events `may_purge`
/// allows for the rows as they are in the database. Half the events are
/// destination.v1 (receipts of no topic id), half destination.v2 naming the
/// topic's id: a watermark of another topic id never lets a receipt go.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn purge_decides_as_may_purge_does(pool: PgPool) {
    let f = fixture(pool).await;
    outbox_consumer::migrate(&f.pool).await.unwrap();
    let topic_id = f.broker.topic_id(TOPIC).await.unwrap().expect("the mock cluster gives topic ids");
    let other_id = if topic_id == "AAECAwQFBgcICQoLDA0ODw" { "_____________________w" } else { "AAECAwQFBgcICQoLDA0ODw" };
    for i in 0..36 {
        if i == 18 {
            let policy = RoutePolicy { topic_id: Some(topic_id.clone()), ..RoutePolicy::new(ORDER_CREATED, f.broker.cluster_id(), TOPIC, PARTITIONS as u32) };
            outbox_producer::routes::revise(&f.pool, &policy).await.unwrap();
        }
        create_order(&f.pool, &format!("o-{i}"), i).await;
    }
    let mut published = 0;
    while published < 36 {
        published += f.dispatcher().dispatch_once("w").await.unwrap().published;
    }
    let here = f.broker.cluster_id().to_owned();
    let policy = RetentionPolicy { replay_window_ms: 60_000, batch_size: 7, max_batches: 1_000 };
    let later = f.store.now_ms() + 120_000;
    let mut seed: u64 = 0x5eed_0f_2026;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let (mut purged_total, mut purged_v2, mut held_total, mut rounds_where_the_id_decided) = (0, 0, 0, 0);
    for round in 0..12 {
        sqlx::query("DELETE FROM outbox_consumer_watermarks").execute(&f.pool).await.unwrap();
        sqlx::query("DELETE FROM outbox_consumers").execute(&f.pool).await.unwrap();
        for c in ["c1", "c2", "c3"] {
            let topics: &[&str] = if next(4) == 0 { &["other"] } else { &[TOPIC] };
            register_consumer(&f.pool, c, topics, false, next(3) != 0).await.unwrap();
            for p in 0..PARTITIONS {
                for cluster in [here.as_str(), "kafka-b"] {
                    for id in [None, Some(topic_id.as_str()), Some(other_id)] {
                        if next(3) == 0 {
                            continue;
                        }
                        sqlx::query(
                            "INSERT INTO outbox_consumer_watermarks (consumer_id, cluster_id, topic, topic_id, partition, committed_offset) VALUES ($1, $2, $3, $4, $5, $6)",
                        )
                        .bind(c)
                        .bind(cluster)
                        .bind(TOPIC)
                        .bind(id)
                        .bind(p)
                        .bind(next(16) as i64)
                        .execute(&f.pool)
                        .await
                        .unwrap();
                    }
                }
            }
        }
        // What the core decides for the rows as they are now (events due are retained first).
        let wm_rows: Vec<(String, String, String, Option<String>, i32, i64)> =
            sqlx::query_as("SELECT consumer_id, cluster_id, topic, topic_id, partition, committed_offset FROM outbox_consumer_watermarks").fetch_all(&f.pool).await.unwrap();
        let registry: Vec<(String, bool, Vec<String>)> = sqlx::query_as("SELECT consumer_id, mandatory, topics FROM outbox_consumers").fetch_all(&f.pool).await.unwrap();
        // (event id, state, published at, and the receipt's cluster, topic, topic id, partition, offset, position epoch)
        type EventRow = (String, String, i64, String, String, Option<String>, i32, i64, i32);
        let events: Vec<EventRow> = sqlx::query_as(
            "SELECT e.event_id, e.state, e.published_at_ms, r.cluster_id, r.topic, r.topic_id, r.partition, r.\"offset\", r.position_epoch
             FROM outbox_events e JOIN outbox_publish_receipts r ON r.event_id = e.event_id AND r.envelope_generation = e.envelope_generation",
        )
        .fetch_all(&f.pool)
        .await
        .unwrap();
        let watermarks: Vec<outbox_core::WatermarkRef<'_>> = wm_rows
            .iter()
            .filter(|w| registry.iter().any(|(c, mandatory, _)| *mandatory && c == &w.0))
            .map(|w| outbox_core::WatermarkRef { log: outbox_core::LogRef { cluster_id: &w.1, topic: &w.2, topic_id: w.3.as_deref(), partition: w.4 }, consumer_id: &w.0, committed_offset: w.5, anchor: outbox_core::WatermarkAnchor::Unrecorded, log_id: None })
            .collect();
        // With `blind`, as a predicate that ignores topic ids would decide.
        let decide = |blind: bool| -> Vec<String> {
            let watermarks: Vec<outbox_core::WatermarkRef<'_>> = watermarks.iter().map(|w| outbox_core::WatermarkRef { log: outbox_core::LogRef { topic_id: w.log.topic_id.filter(|_| !blind), ..w.log }, ..*w }).collect();
            let mut ids: Vec<String> = events
                .iter()
                .filter(|(_, state, published_at, cluster, topic, topic_id, partition, offset, position_epoch)| {
                    let state = EventState::parse(state).unwrap();
                    let state =
                        if state == EventState::Published && outbox_core::may_retain(*published_at, later, policy.replay_window_ms) { EventState::Retained } else { state };
                    let on_topic: Vec<&str> = registry.iter().filter(|(_, m, topics)| *m && topics.iter().any(|t| t == topic)).map(|(c, _, _)| c.as_str()).collect();
                    let topic_id = topic_id.as_deref().filter(|_| !blind);
                    let partition_replaced = events.iter().any(|e| (&e.3, &e.4, e.6) == (cluster, topic, *partition) && e.8 > 0);
                    let at = outbox_core::LogPosition { log: outbox_core::LogRef { cluster_id: cluster, topic, topic_id, partition: *partition }, offset: *offset, position_epoch: *position_epoch, partition_replaced, position_lost: false, sent_from_ms: None, log_id: None };
                    outbox_core::may_purge(state, *published_at, later, policy.replay_window_ms, at, &watermarks, &on_topic).is_ok()
                })
                .map(|e| e.0.clone())
                .collect();
            ids.sort();
            ids
        };
        let expected = decide(false);
        if decide(true) != expected {
            rounds_where_the_id_decided += 1;
        }
        let open = events.iter().filter(|e| e.1 != "PURGED").count();
        let before: Vec<String> = sqlx::query_scalar("SELECT event_id FROM outbox_events WHERE state = 'PURGED'").fetch_all(&f.pool).await.unwrap();
        let r = purge(&f.pool, later, &policy, false, |_| {}).await.unwrap();
        let mut got: Vec<String> = sqlx::query_scalar("SELECT event_id FROM outbox_events WHERE state = 'PURGED' AND NOT (event_id = ANY($1))")
            .bind(&before)
            .fetch_all(&f.pool)
            .await
            .unwrap();
        got.sort();
        assert_eq!(got, expected, "round {round}: the database purged what may_purge does not allow, or held what it allows ({r:?})");
        purged_total += got.len();
        purged_v2 += events.iter().filter(|e| e.5.is_some() && got.contains(&e.0)).count();
        held_total += open - got.len();
    }
    assert!(purged_total > 0 && held_total > 0, "the scenarios purge some and hold some back: {purged_total} purged, {held_total} held");
    assert!(purged_v2 > 0, "destination.v2 events are purged by their own topic id's watermarks");
    assert!(rounds_where_the_id_decided > 0, "no round where the topic id decided: the scenarios do not cover it");
    eprintln!("purge_decides_as_may_purge_does: {purged_total} purged ({purged_v2} destination.v2), {held_total} held, the topic id decided {rounds_where_the_id_decided} of 12 rounds");
    let v2: i64 = f.count("SELECT count(*) FROM outbox_publish_receipts WHERE topic_id IS NOT NULL").await;
    assert_eq!(v2, 18, "half the receipts name the topic id");
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn migration_is_refused_while_unknown_and_accepted_after_proof(pool: PgPool) {
    let f = fixture(pool).await;
    f.cluster.topic("orders-eu", PARTITIONS);
    let e = f.unknown_never_sent("o-1").await;
    let id = e.event_id();
    let new_route = RoutePolicy::new(ORDER_CREATED, f.broker.cluster_id(), "orders-eu", PARTITIONS as u32);
    let retry = RetryPolicy { in_flight_bound_ms: 30_000, ..RetryPolicy::default() };
    f.clock.advance(60_000);

    f.cluster.mock.as_ref().unwrap().broker_down(1).unwrap();
    let out = migrate_destination(&f.store, f.broker.as_ref(), id, &new_route, "ops-alice", &retry).await.unwrap();
    assert!(matches!(&out, MigrationOutcome::Refused { reason } if reason.contains("unqueryable")), "{out:?}");
    assert_eq!(f.state(id.as_str()).await, EventState::DispatchUnknown);
    assert_eq!(f.count("SELECT count(*) FROM outbox_envelopes").await, 1);
    assert_eq!(f.count("SELECT count(*) FROM outbox_migration_receipts").await, 0);

    f.cluster.mock.as_ref().unwrap().broker_up(1).unwrap();
    let out = migrate_destination(&f.store, f.broker.as_ref(), id, &new_route, "ops-alice", &retry).await.unwrap();
    let MigrationOutcome::Migrated { from_generation, to_generation, to_destination_digest } = out else { panic!("{out:?}") };
    assert_eq!((from_generation, to_generation), (1, 2));
    assert_eq!(f.state(id.as_str()).await, EventState::Pending);
    let original: String = sqlx::query_scalar("SELECT destination_digest FROM outbox_envelopes WHERE envelope_generation = 1").fetch_one(&f.pool).await.unwrap();
    assert_eq!(original, e.destination_digest, "the original envelope is never edited");
    let receipt: (i32, i32, String, String) =
        sqlx::query_as("SELECT from_generation, to_generation, to_destination_digest, proof->>'kind' FROM outbox_migration_receipts").fetch_one(&f.pool).await.unwrap();
    assert_eq!(receipt, (1, 2, to_destination_digest.clone(), "proven_absent".into()));

    assert_eq!(f.dispatcher().dispatch_once("w").await.unwrap().published, 1);
    assert_eq!(f.log_of("orders-eu", id.as_str()), 1);
    assert_eq!(f.log_of(TOPIC, id.as_str()), 0);
    // A published event cannot be moved.
    let out = migrate_destination(&f.store, f.broker.as_ref(), id, &RoutePolicy::new(ORDER_CREATED, "c", "t", 1), "ops-alice", &retry).await.unwrap();
    assert!(matches!(out, MigrationOutcome::Refused { .. }));
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_reconciler_whose_absence_proofs_could_miss_an_in_flight_message_refuses_to_start(pool: PgPool) {
    let f = fixture(pool).await;
    let too_short = ReconcilerConfig { retry: RetryPolicy { in_flight_bound_ms: 1_000, ..RetryPolicy::default() }, ..Default::default() };
    let err = Reconciler::new(f.store.clone(), f.broker.clone(), too_short).unwrap_err();
    assert!(err.to_string().contains("in_flight_bound_ms"), "{err}");
}

/// A critical consumer far along another incarnation of the topic (a
/// watermark of another topic id) has not consumed the events of this one:
/// they are unconsumed findings and lag of their own log, named with its
/// topic id, until a watermark of their topic id passes them.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_watermark_of_another_topic_id_does_not_consume_the_events(pool: PgPool) {
    let f = fixture(pool).await;
    outbox_consumer::migrate(&f.pool).await.unwrap();
    let topic_id = f.broker.topic_id(TOPIC).await.unwrap().expect("the mock cluster gives topic ids");
    let other_id = if topic_id == "AAECAwQFBgcICQoLDA0ODw" { "_____________________w" } else { "AAECAwQFBgcICQoLDA0ODw" };
    let policy = RoutePolicy { topic_id: Some(topic_id.clone()), ..RoutePolicy::new(ORDER_CREATED, f.broker.cluster_id(), TOPIC, PARTITIONS as u32) };
    outbox_producer::routes::revise(&f.pool, &policy).await.unwrap();
    for i in 0..4 {
        create_order(&f.pool, &format!("o-{i}"), i).await;
    }
    assert_eq!(f.dispatcher().dispatch_once("w").await.unwrap().published, 4);
    register_consumer(&f.pool, "fulfilment", &[TOPIC], true, true).await.unwrap();
    let watermark = |id: String| {
        let pool = f.pool.clone();
        let cluster = f.broker.cluster_id().to_owned();
        async move {
            for p in 0..PARTITIONS {
                sqlx::query("INSERT INTO outbox_consumer_watermarks (consumer_id, cluster_id, topic, topic_id, partition, committed_offset) VALUES ('fulfilment', $1, $2, $3, $4, 1000)")
                    .bind(&cluster)
                    .bind(TOPIC)
                    .bind(&id)
                    .bind(p)
                    .execute(&pool)
                    .await
                    .unwrap();
            }
        }
    };
    watermark(other_id.to_owned()).await;
    let rec = Reconciler::new(f.store.clone(), f.broker.clone(), ReconcilerConfig { owner: "r".into(), unconsumed_after_ms: 1_000, ..Default::default() }).unwrap();
    f.clock.advance(5_000);
    let c = rec.compare_once().await.unwrap();
    assert_eq!(c.unconsumed_published, 4, "a watermark of another topic id passed the events: {c:?}");
    let report = rec.report().await.unwrap();
    assert!(report.consumer_lag.iter().all(|l| l.topic_id.as_deref() == Some(topic_id.as_str())), "{:?}", report.consumer_lag);
    assert_eq!(report.consumer_lag.iter().map(|l| l.lag_events).sum::<i64>(), 4);
    let text = report.to_text();
    assert!(text.contains(&format!("{}/{TOPIC} (topic id {topic_id})/", f.broker.cluster_id())), "{text}");

    watermark(topic_id.clone()).await;
    assert_eq!(rec.compare_once().await.unwrap().unconsumed_published, 0);
    assert_eq!(rec.report().await.unwrap().consumer_lag.iter().map(|l| l.lag_events).sum::<i64>(), 0);
}

/// The topic came back with fewer partitions than its route froze (a broker
/// replacement, then auto-creation with the broker's default count): events
/// routed to the missing partitions cannot be sent and wait. The reconciler
/// says so: one `partition_count_changed` finding naming the topic, the
/// route and both counts, kept (not repeated) round after round; it reads
/// only the partitions the topic has, and the rest of the topic is checked
/// as before.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_topic_with_fewer_partitions_than_its_route_froze_is_a_finding(pool: PgPool) {
    let f = fixture(pool).await;
    // The route freezes 6 partitions; the cluster's topic has 3.
    route(&f.pool, ORDER_CREATED, f.broker.cluster_id(), TOPIC, 6).await;
    let mut stalled = 0;
    for i in 0..12 {
        let e = create_order(&f.pool, &format!("o-{i}"), i).await;
        let p: i32 = sqlx::query_scalar("SELECT partition FROM outbox_events WHERE event_id = $1").bind(e.event_id().as_str()).fetch_one(&f.pool).await.unwrap();
        stalled += i32::from(p >= PARTITIONS);
    }
    assert!(stalled > 0 && stalled < 12, "the keys spread over the six frozen partitions ({stalled} on missing ones)");
    let d = f.dispatcher();
    let r = d.dispatch_once("w").await.unwrap();
    assert_eq!(r.published, 12 - stalled as usize, "{r:?}");
    assert_eq!(f.count("SELECT count(*) FROM outbox_events WHERE state = 'PENDING' AND partition >= 3").await, i64::from(stalled));

    let rec = f.reconciler();
    let c = rec.compare_once().await.unwrap();
    assert_eq!(c.partition_count_changed, 1, "{c:?}");
    assert_eq!(c.scanned_messages, 12 - stalled as usize, "the partitions the topic has are read");
    assert_eq!(c.bypass_publish + c.unrecorded_copy, 0, "{c:?}");
    let report = rec.report().await.unwrap();
    let found: Vec<_> = report.findings.iter().filter(|x| x.kind == "partition_count_changed").collect();
    assert_eq!(found.len(), 1, "{:?}", report.findings);
    assert_eq!(found[0].event_id, "orders/partitions");
    let detail = &found[0].detail;
    assert!(detail.contains("has 3 partitions") && detail.contains(&format!("{ORDER_CREATED} (6)")) && detail.contains("partitions 3..6") && detail.contains("PENDING"), "{detail}");
    // Round after round: the same finding, not a new one.
    rec.compare_once().await.unwrap();
    assert_eq!(f.count("SELECT count(*) FROM outbox_findings WHERE kind = 'partition_count_changed'").await, 1);
    // The route matching the topic again: no new finding.
    route(&f.pool, ORDER_CREATED, f.broker.cluster_id(), TOPIC, PARTITIONS as u32).await;
    assert_eq!(rec.compare_once().await.unwrap().partition_count_changed, 0);
}
