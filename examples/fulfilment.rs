//! Fulfilment: a consumer that reserves stock once per `order.created` event.
//!
//! The reservation is a row in `stock_reservations`, written by the handler
//! on the consumer's receipt transaction. The table deliberately has **no**
//! unique constraint on the order: "one row per order" is guaranteed by the
//! `(consumerId, eventId)` receipt alone, so a duplicate effect would be
//! visible as a second row, and [`count_effects`] can prove there is none.
//!
//! Payload (JSON): `{"order": "o-42", "sku": "sku-1", "quantity": 2}`;
//! `orderId` / `order_id` are accepted for `order`, and the aggregate id of
//! the message is used when the payload names no order. `sku` defaults to
//! `"unknown"` and `quantity` to 1.

use outbox_consumer::{async_trait, ConsumedEvent, Handler, HandlerError};
use serde_json::{json, Value};
use sqlx::{PgPool, Postgres, Transaction};

/// The consumer id the examples use for fulfilment.
pub const CONSUMER_ID: &str = "fulfilment";

/// Largest quantity one reservation may hold.
pub const MAX_QUANTITY: i64 = 10_000;

/// Reserves stock for every `order.created*` event; other event types are
/// acknowledged (with a receipt) and ignored.
#[derive(Debug, Clone)]
pub struct FulfilmentHandler {
    event_type_prefix: String,
}

impl Default for FulfilmentHandler {
    fn default() -> Self {
        FulfilmentHandler { event_type_prefix: "order.created".to_owned() }
    }
}

impl FulfilmentHandler {
    /// Reserves for event types starting with `prefix` (default `order.created`,
    /// which also matches `order.created.v2`).
    pub fn for_event_types(prefix: &str) -> Self {
        FulfilmentHandler { event_type_prefix: prefix.to_owned() }
    }
}

/// Creates `stock_reservations` if it does not exist.
pub async fn create_tables(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS stock_reservations (
             reservation_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
             order_id       text        NOT NULL,
             event_id       text        NOT NULL,
             tenant         text        NOT NULL,
             sku            text        NOT NULL,
             quantity       integer     NOT NULL CHECK (quantity BETWEEN 1 AND 10000),
             reserved_at    timestamptz NOT NULL DEFAULT now()
         )",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Reservation rows and distinct orders among them: equal when no order was
/// reserved twice.
pub async fn count_effects(pool: &PgPool) -> sqlx::Result<(i64, i64)> {
    sqlx::query_as("SELECT count(*), count(DISTINCT order_id) FROM stock_reservations").fetch_one(pool).await
}

/// Reservation rows of one order (1 after any number of deliveries).
pub async fn reservations_of(pool: &PgPool, order_id: &str) -> sqlx::Result<i64> {
    sqlx::query_scalar("SELECT count(*) FROM stock_reservations WHERE order_id = $1").bind(order_id).fetch_one(pool).await
}

fn text<'a>(v: &'a Value, keys: &[&str]) -> Option<&'a str> {
    keys.iter().find_map(|k| v.get(*k).and_then(Value::as_str)).filter(|s| !s.is_empty())
}

#[async_trait]
impl Handler for FulfilmentHandler {
    async fn handle(&self, tx: &mut Transaction<'_, Postgres>, event: &ConsumedEvent) -> Result<Value, HandlerError> {
        if !event.event_type.starts_with(&self.event_type_prefix) {
            return Ok(json!({ "ignored": event.event_type }));
        }
        let body = event.json().ok_or_else(|| HandlerError::permanent("order.created payload is not JSON"))?;
        let order_id = text(&body, &["order", "orderId", "order_id"])
            .or_else(|| event.aggregate().map(|(_, id, _)| id))
            .ok_or_else(|| HandlerError::permanent("order.created names no order"))?
            .to_owned();
        let sku = text(&body, &["sku"]).unwrap_or("unknown").to_owned();
        let quantity = body.get("quantity").and_then(Value::as_i64).unwrap_or(1);
        if !(1..=MAX_QUANTITY).contains(&quantity) {
            return Err(HandlerError::permanent(format!("quantity {quantity} outside 1..={MAX_QUANTITY}")));
        }
        let reservation_id: i64 = sqlx::query_scalar(
            "INSERT INTO stock_reservations (order_id, event_id, tenant, sku, quantity)
             VALUES ($1, $2, $3, $4, $5) RETURNING reservation_id",
        )
        .bind(&order_id)
        .bind(event.event_id.as_str())
        .bind(&event.tenant)
        .bind(&sku)
        .bind(quantity as i32)
        .fetch_one(&mut **tx)
        .await?;
        Ok(json!({ "reservation_id": reservation_id, "order": order_id, "sku": sku, "quantity": quantity }))
    }
}
