//! Shared helpers of the workspace's integration tests (real PostgreSQL, a
//! Kafka-protocol broker).

use outbox_core::{EmitRequest, RoutePolicy};
use outbox_producer::{emit, EmitOptions, Emitted};
use sqlx::PgPool;

/// The event type the tests route.
pub const ORDER_CREATED: &str = "order.created.v2";

/// Creates the business table the tests write to.
pub async fn business_schema(pool: &PgPool) {
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, total_cents bigint NOT NULL)")
        .execute(pool)
        .await
        .expect("orders table");
}

/// Publishes a route for `event_type` to `topic` on `cluster_id`.
pub async fn route(pool: &PgPool, event_type: &str, cluster_id: &str, topic: &str, partitions: u32) -> RoutePolicy {
    outbox_producer::routes::revise(pool, &RoutePolicy::new(event_type, cluster_id, topic, partitions)).await.expect("route policy")
}

/// The JSON payload of order `id`.
pub fn order_payload(id: &str, total_cents: i64) -> Vec<u8> {
    format!(r#"{{"order":"{id}","totalCents":{total_cents}}}"#).into_bytes()
}

/// One business transaction: insert the order and emit `order.created.v2`.
pub async fn create_order(pool: &PgPool, id: &str, total_cents: i64) -> Emitted {
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("INSERT INTO orders (id, total_cents) VALUES ($1, $2)").bind(id).bind(total_cents).execute(&mut *tx).await.expect("order row");
    let payload = order_payload(id, total_cents);
    let command_key = format!("create-{id}");
    let e = emit(&mut tx, &order_request(&command_key, id, &payload), &EmitOptions::default()).await.expect("emit");
    tx.commit().await.expect("commit");
    e
}

/// The emit request of `create_order`.
pub fn order_request<'a>(command_key: &'a str, id: &'a str, payload: &'a [u8]) -> EmitRequest<'a> {
    EmitRequest {
        command_key,
        tenant: "tenant-7",
        aggregate_type: "order",
        aggregate_id: id,
        aggregate_version: 1,
        event_type: ORDER_CREATED,
        payload_schema: "order-v2",
        payload,
    }
}
