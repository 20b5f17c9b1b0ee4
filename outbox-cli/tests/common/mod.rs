//! Helpers of the CLI tests: a fresh database per test on the server the
//! test kit picks (DATABASE_URL, the local server, or a throwaway one), the
//! `outbox` binary, and a business transaction that emits an event.
#![allow(dead_code)]

use std::process::{Command, Output};

pub mod broker;

use outbox_core::{EmitRequest, RoutePolicy};
use outbox_producer::{emit, EmitOptions, Emitted};
use outbox_testkit::{pick_database, PickedDatabase, TestDatabase};
use outbox_consumer::RawMessage;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};
use sqlx::{PgPool, Postgres, Transaction};

pub const ORDER_CREATED: &str = "order.created.v2";

/// The server and a fresh database on it (dropped by `drop_now`).
pub struct Env {
    pub server: PickedDatabase,
    pub db: TestDatabase,
}

impl Env {
    pub async fn new(prefix: &str) -> Env {
        let server = pick_database().await.unwrap_or_else(|e| panic!("{e}"));
        let db = TestDatabase::create(server.url(), prefix, 8).await.unwrap_or_else(|e| panic!("{e}"));
        Env { server, db }
    }

    pub fn pool(&self) -> &PgPool {
        &self.db.pool
    }

    /// `outbox` with DATABASE_URL set to this database and a clean environment.
    pub fn outbox(&self) -> Command {
        let mut c = outbox_bin();
        c.env("DATABASE_URL", &self.db.url);
        c
    }

    /// Runs `outbox args...` and returns its output.
    pub fn run(&self, args: &[&str]) -> Output {
        let out = self.outbox().args(args).output().expect("run outbox");
        eprintln!("$ outbox {}\n{}{}", args.join(" "), String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        out
    }

    /// Runs it and requires exit code 0; returns stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(out.status.success(), "outbox {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    }

    pub async fn drop_now(self) {
        self.db.drop_now().await.unwrap();
    }

    pub async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(self.pool()).await.unwrap()
    }
}

/// The binary with every variable that could change its behaviour removed.
pub fn outbox_bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_outbox"));
    for (k, _) in std::env::vars() {
        if k.starts_with("OUTBOX_") || k == "DATABASE_URL" || k == "RUST_LOG" {
            c.env_remove(k);
        }
    }
    c
}

/// Routes `order.created.v2` to `topic` on `cluster_id`.
pub async fn route(pool: &PgPool, cluster_id: &str, topic: &str, partitions: u32) {
    outbox_producer::routes::revise(pool, &RoutePolicy::new(ORDER_CREATED, cluster_id, topic, partitions)).await.expect("route");
}

/// Inside `tx`: an order row and its `order.created.v2` event (command key `create-<id>`).
pub async fn emit_order(tx: &mut Transaction<'_, Postgres>, id: &str) -> Emitted {
    sqlx::query("INSERT INTO orders (id) VALUES ($1)").bind(id).execute(&mut **tx).await.unwrap();
    let payload = format!(r#"{{"order":"{id}"}}"#);
    let command_key = format!("create-{id}");
    let request = EmitRequest {
        command_key: &command_key,
        tenant: "tenant-7",
        aggregate_type: "order",
        aggregate_id: id,
        aggregate_version: 1,
        event_type: ORDER_CREATED,
        payload_schema: "order-v2",
        payload: payload.as_bytes(),
    };
    emit(tx, &request, &EmitOptions::default()).await.expect("emit")
}

/// One business transaction: an order row and its `order.created.v2` event.
pub async fn create_order(pool: &PgPool, id: &str) -> Emitted {
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY)").execute(pool).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    let e = emit_order(&mut tx, id).await;
    tx.commit().await.unwrap();
    e
}

/// Reads the message at `topic/partition@offset` back from the broker.
#[allow(dead_code)] // not every test binary reads messages
pub fn read_message(bootstrap: &str, topic: &str, partition: i32, offset: i64) -> RawMessage {
    let c: BaseConsumer = ClientConfig::new().set("bootstrap.servers", bootstrap).set("group.id", "cli-test-reader").set("enable.auto.commit", "false").create().unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, Offset::Offset(offset)).unwrap();
    c.assign(&tpl).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while std::time::Instant::now() < deadline {
        if let Some(Ok(m)) = c.poll(std::time::Duration::from_millis(200)) {
            if m.offset() == offset {
                return RawMessage::from_kafka(&m);
            }
        }
    }
    panic!("message {topic}/{partition}@{offset} not read");
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// GET http://addr/path, returns (status line, body).
pub fn http_get(addr: &str, path: &str) -> (String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the metrics endpoint");
    s.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    (head.lines().next().unwrap_or("").to_owned(), body.to_owned())
}
