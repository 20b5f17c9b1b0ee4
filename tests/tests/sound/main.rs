//! Sound absence proofs and acceptance: stalls, late ACKs of attempts proven
//! absent, stray messages, unreadable destinations, unfenced migrations,
//! truncated or recreated logs, receipts losing their positions, PUBLISHED
//! without a receipt, and the per-key order. Real PostgreSQL and librdkafka's
//! in-process Kafka cluster; each test is named after the defect it covers.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{headers, AttemptState, Broker, ClaimedEvent, EventState, ManualClock, OutboxStore, RetryPolicy, SendOutcome};
use outbox_producer::dispatcher::outgoing_message;
use outbox_producer::kafka::KafkaBroker;
use outbox_producer::{Dispatcher, DispatcherConfig, PgStore, Reconciler, ReconcilerConfig};
use outbox_tests::kafka::{read_topic, TestCluster};
use outbox_tests::*;
use sqlx::PgPool;

mod lease_and_bound;
mod late_acks;
mod acceptance;
mod migration;
mod order;
mod lost_logs;

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

const BOUND_MS: i64 = 30_000;

impl Fixture {
    fn reconciler(&self) -> Reconciler<KafkaBroker> {
        let cfg = ReconcilerConfig { owner: "r".into(), retry: RetryPolicy { in_flight_bound_ms: BOUND_MS, ..RetryPolicy::default() }, ..Default::default() };
        Reconciler::new(self.store.clone(), self.broker.clone(), cfg).unwrap()
    }

    fn dispatcher(&self, store: &PgStore, lease_ms: i64) -> Dispatcher<KafkaBroker> {
        let cfg = DispatcherConfig { name: "d".into(), lease_ms, ..Default::default() };
        Dispatcher::new(store.clone(), self.broker.clone(), cfg).unwrap()
    }

    /// Emits order `order`, claims it with `lease_ms` and registers an
    /// attempt, nothing sent yet.
    async fn registered(&self, order: &str, lease_ms: i64) -> (ClaimedEvent, outbox_core::AttemptRecord) {
        let e = create_order(&self.pool, order, 1).await;
        let claimed = self.store.claim_batch("w", 10, lease_ms).await.unwrap();
        let mine = claimed.into_iter().find(|c| &c.envelope.event_id == e.event_id()).unwrap();
        let a = self.store.register_attempt(&mine.token).await.unwrap();
        (mine, a)
    }

    /// The attempt's genuine message, sent now: its receipt.
    async fn send_late(&self, ev: &ClaimedEvent, a: &outbox_core::AttemptRecord) -> outbox_core::BrokerReceipt {
        let SendOutcome::Acked { partition, offset } = self.broker.send(outgoing_message(ev, a)).await else { panic!("send failed") };
        self.receipt(ev, a, partition, offset)
    }

    /// The attempt's receipt at `partition`@`offset` of this cluster's topic.
    fn receipt(&self, ev: &ClaimedEvent, a: &outbox_core::AttemptRecord, partition: i32, offset: i64) -> outbox_core::BrokerReceipt {
        outbox_tests::ack_receipt(ev, a, partition, offset)
    }

    async fn state(&self, id: &str) -> EventState {
        EventState::parse(&sqlx::query_scalar::<_, String>("SELECT state FROM outbox_events WHERE event_id = $1").bind(id).fetch_one(&self.pool).await.unwrap())
            .unwrap()
    }

    async fn count(&self, sql: &str) -> i64 {
        count(&self.pool, sql).await
    }

    /// The offset of `id`'s primary receipt.
    async fn receipt_offset(&self, id: &str) -> i64 {
        sqlx::query_scalar("SELECT \"offset\" FROM outbox_publish_receipts WHERE event_id = $1").bind(id).fetch_one(&self.pool).await.unwrap()
    }

    fn log_of(&self, id: &str) -> usize {
        read_topic(&self.cluster.bootstrap, TOPIC, PARTITIONS).iter().filter(|m| m.header(headers::EVENT_ID).as_deref() == Some(id)).count()
    }

    async fn findings(&self, kind: &str, id: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM outbox_findings WHERE kind = $1 AND event_id = $2 AND resolved_at_ms IS NULL")
            .bind(kind)
            .bind(id)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

/// Runs `sql` (with `$1` the event id) with the database's triggers off, as
/// someone with direct access to the tables could: the tampering the
/// dispatcher must catch before it sends.
async fn tamper(pool: &PgPool, sql: &str, id: &str, bytes: Option<Vec<u8>>) {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL session_replication_role = replica").execute(&mut *tx).await.unwrap();
    let q = sqlx::query(sql).bind(id);
    let q = match bytes {
        Some(b) => q.bind(b),
        None => q,
    };
    assert_eq!(q.execute(&mut *tx).await.unwrap().rows_affected(), 1, "{sql}");
    tx.commit().await.unwrap();
}

async fn emit_in(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, command_key: &str, version: i64) -> outbox_core::EventId {
    emit_for(tx, command_key, "o-same", version).await
}

/// Emits version `version` of order `aggregate` in `tx`.
async fn emit_for(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, command_key: &str, aggregate: &str, version: i64) -> outbox_core::EventId {
    let payload = order_payload(aggregate, version);
    let mut req = order_request(command_key, aggregate, &payload);
    req.aggregate_version = version;
    outbox_producer::emit(tx, &req, &outbox_producer::EmitOptions::default()).await.unwrap().event_id().clone()
}

fn log_order(f: &Fixture) -> Vec<String> {
    let mut msgs = read_topic(&f.cluster.bootstrap, TOPIC, PARTITIONS);
    msgs.sort_by_key(|m| (m.partition, m.offset));
    msgs.iter().filter_map(|m| m.header(headers::EVENT_ID)).collect()
}

/// An order id whose events go to `partition`, different from `not`.
fn order_on(f: &Fixture, partition: i32, not: &[&str]) -> String {
    let policy = outbox_core::RoutePolicy::new(ORDER_CREATED, f.broker.cluster_id(), TOPIC, PARTITIONS as u32);
    (0..1_000)
        .map(|i| format!("o-{i}"))
        .find(|id| !not.contains(&id.as_str()) && policy.resolve("tenant-7", "order", id).unwrap().partition == partition)
        .unwrap()
}

/// docs/roles.sql: the roles the services run under.
const ROLES_SQL: &str = include_str!("../../../docs/roles.sql");
