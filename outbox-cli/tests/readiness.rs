//! `/readyz` of `outbox dispatch` against an external broker process (tansu)
//! the test replaces by an empty one and freezes: 503 within the bounded
//! time, the producer rebuilt, 200 again and delivery resumed without a
//! restart; with `--exit-on-fatal` the service exits 4 instead.

mod common;

use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use common::broker::{fill, scratch, Reaper, Tansu};
use common::{create_order, free_port, http_get, route, Env};

const CLUSTER: &str = "outbox-ready-cluster";
/// --kafka-producer-stall-ms of the dispatcher under test.
const STALL_MS: u64 = 4_000;
/// How long /readyz may take to turn: the stall bound, a message timeout,
/// a probe and a check interval, with margin for a loaded machine.
const TURN_BOUND: Duration = Duration::from_secs(25);

fn readyz(addr: &str) -> (String, String) {
    match std::net::TcpStream::connect(addr) {
        Ok(_) => http_get(addr, "/readyz"),
        Err(e) => (format!("unreachable: {e}"), String::new()),
    }
}

/// Polls /readyz until its status line contains `want`; returns how long it took.
async fn wait_readyz(addr: &str, want: &str, child: &mut Child, log: &Path) -> Duration {
    let started = Instant::now();
    loop {
        let (status, body) = readyz(addr);
        if status.contains(want) {
            return started.elapsed();
        }
        if let Some(s) = child.try_wait().unwrap() {
            panic!("outbox dispatch exited ({s:?}) while waiting for /readyz {want}: {}", std::fs::read_to_string(log).unwrap_or_default());
        }
        assert!(started.elapsed() < TURN_BOUND, "/readyz not {want} within {TURN_BOUND:?}: {status}\n{body}\n{}", std::fs::read_to_string(log).unwrap_or_default());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn published(env: &Env) -> i64 {
    env.count("SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'").await
}

async fn wait_published(env: &Env, n: i64, what: &str, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while published(env).await < n {
        assert!(Instant::now() < deadline, "{what}: {} of {n} published\n{}", published(env).await, std::fs::read_to_string(log).unwrap_or_default());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn spawn_dispatch(env: &Env, dir: &Path, port: u16, metrics: &str, extra: &[&str]) -> (Child, std::path::PathBuf) {
    let file = dir.join("dispatch.toml");
    std::fs::write(&file, "[kafka]\nprobe_timeout_ms = 1500\nconnect_timeout_ms = 5000\n").unwrap();
    let log = dir.join(format!("dispatch-{}.log", free_port()));
    let stall = STALL_MS.to_string();
    let child = env
        .outbox()
        .arg("--config")
        .arg(&file)
        .args(["dispatch", "--kafka-bootstrap", &format!("127.0.0.1:{port}"), "--metrics-addr", metrics, "--poll-interval-ms", "100"])
        .args(["--kafka-message-timeout-ms", "3000", "--kafka-request-timeout-ms", "2000", "--kafka-producer-stall-ms", &stall])
        .args(["--kafka-setting", "batch.num.messages=1", "--lease-ms", "10000", "--record-retry-ms", "2000"])
        .args(extra)
        .stdout(std::fs::File::create(dir.join("dispatch.out")).unwrap())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    (child, log)
}

fn stop(child: &mut Child) -> std::process::ExitStatus {
    // SAFETY: kill(2) with a child's pid we own.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(Instant::now() < deadline, "outbox dispatch did not stop after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test]
async fn readyz_turns_503_when_the_broker_is_replaced_or_frozen_and_200_after_recovery() {
    let dir = scratch("readyz");
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut first = Tansu::start(port, &addr, CLUSTER, &dir.join("tansu-1.log"));
    first.create_topic("orders", 3);
    let env = Env::new("cli_readyz").await;
    env.ok(&["migrate"]);
    route(env.pool(), CLUSTER, "orders", 3).await;
    for i in 0..3 {
        create_order(env.pool(), &format!("before-{i}")).await;
    }
    let metrics = format!("127.0.0.1:{}", free_port());
    let (child, log) = spawn_dispatch(&env, &dir, port, &metrics, &[]);
    let mut reaper = Reaper(child);
    let child = &mut reaper.0;
    wait_published(&env, 3, "before the replacement", &log).await;
    wait_readyz(&metrics, "200", child, &log).await;
    let (status, body) = http_get(&metrics, "/healthz");
    assert!(status.contains("200") && body.contains("alive"), "{status} {body}");
    let (_, body) = readyz(&metrics);
    assert!(body.contains("database: ok") && body.contains("kafka: ok") && body.contains("progress: ok"), "{body}");

    // The broker is replaced by an empty one (same address, same cluster id):
    // the old producer's id is unknown there.
    first.kill();
    let second = Tansu::start(port, &addr, CLUSTER, &dir.join("tansu-2.log"));
    second.create_topic("orders", 3);
    // The new log's first offsets would repeat positions the outbox already
    // holds receipts for (a separate defect: positions are not yet keyed by
    // the topic's identity); filler messages move this test past them.
    fill(&second.bootstrap(), "orders", 3, 10);
    for i in 0..3 {
        create_order(env.pool(), &format!("after-{i}")).await;
    }
    let to_503 = wait_readyz(&metrics, "503", child, &log).await;
    let to_200 = wait_readyz(&metrics, "200", child, &log).await;
    eprintln!("replaced broker: /readyz 503 after {to_503:?}, 200 again {to_200:?} later");
    wait_published(&env, 6, "after the replacement, without a restart", &log).await;

    // The broker stops answering (frozen), then answers again.
    second.pause();
    let frozen_503 = wait_readyz(&metrics, "503", child, &log).await;
    let (_, body) = readyz(&metrics);
    assert!(body.contains("kafka: ") && !body.contains("kafka: ok"), "the Kafka check says why: {body}");
    create_order(env.pool(), "while-frozen").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(env.count("SELECT count(*) FROM outbox_attempts a JOIN outbox_events e USING (event_id) WHERE e.command_key = 'create-while-frozen'").await, 0, "no claim, no attempt while the producer cannot deliver");
    second.resume();
    let thawed_200 = wait_readyz(&metrics, "200", child, &log).await;
    eprintln!("frozen broker: /readyz 503 after {frozen_503:?}, 200 again {thawed_200:?} after it answered");
    wait_published(&env, 7, "after the broker answered again", &log).await;

    assert!(stop(child).success());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("kafka producer rebuilt"), "the producer was rebuilt, and the log says why: {text}");
    env.drop_now().await;
}

#[tokio::test]
async fn with_exit_on_fatal_a_producer_that_cannot_deliver_exits_4() {
    let dir = scratch("exit-on-fatal");
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut first = Tansu::start(port, &addr, CLUSTER, &dir.join("tansu-1.log"));
    first.create_topic("orders", 3);
    let env = Env::new("cli_exit_fatal").await;
    env.ok(&["migrate"]);
    route(env.pool(), CLUSTER, "orders", 3).await;
    create_order(env.pool(), "one").await;
    let metrics = format!("127.0.0.1:{}", free_port());
    let (child, log) = spawn_dispatch(&env, &dir, port, &metrics, &["--exit-on-fatal"]);
    let mut reaper = Reaper(child);
    let child = &mut reaper.0;
    wait_published(&env, 1, "first event", &log).await;
    first.kill();
    let second = Tansu::start(port, &addr, CLUSTER, &dir.join("tansu-2.log"));
    second.create_topic("orders", 3);
    fill(&second.bootstrap(), "orders", 3, 10);
    create_order(env.pool(), "two").await;
    let deadline = Instant::now() + TURN_BOUND + Duration::from_secs(15);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "outbox dispatch --exit-on-fatal did not exit: {}", std::fs::read_to_string(&log).unwrap_or_default());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(status.code(), Some(4), "{text}");
    assert!(text.contains("--exit-on-fatal") && !text.contains("kafka producer rebuilt"), "{text}");
    env.drop_now().await;
}
