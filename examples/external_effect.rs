//! An external effect whose outcome is unknown, retried with the same key.
//!
//! A billing consumer charges a card for every `order.created` event. The
//! payment provider is another system: the charge cannot join the consumer's
//! database transaction. So the handler gives the provider a stable
//! idempotency key, `event.effect_key_for("charge")`, derived from
//! (consumerId, eventId, purpose) and therefore identical on every retry and
//! every redelivery.
//!
//! The first call charges the card but its reply is lost (a timeout): the
//! outcome is unknown. The handler reports a transient error, the consumer
//! rolls back and retries, the retry presents the *same* key, and the
//! provider answers with the charge it already made. One charge, one receipt;
//! a later redelivery is answered from the receipt without calling the
//! provider at all.
//!
//! The consumer is configured as in production, from its `[consumer.billing]`
//! section of the one configuration (`outbox.toml`, read with
//! `outbox_config`; see [`config_toml`]): it accepts on `orders` only
//! messages of the order service's outbox (its source identity) signed with
//! that outbox's key, and the message below is sealed and signed as its
//! dispatcher would. The key's secret is read from
//! `OUTBOX_EXAMPLE_SIGNING_SECRET_HEX` or generated for the run, never printed.
//!
//! ```text
//! cargo run --example external_effect
//! ```
//! Needs PostgreSQL (`DATABASE_URL`, default `postgres://root@127.0.0.1:5432/test`);
//! a throwaway database is created and dropped.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::ensure;
use outbox_consumer::{async_trait, ConsumedEvent, Handler, HandlerError, Outcome, Processor, RawMessage};
use outbox_core::trust::{seal, SigningKey};
use outbox_core::{headers, AttemptId, EmitRequest, EventId, RoutePolicy};
use outbox_examples::env::ScratchDb;
use outbox_examples::keys::{ExampleKey, SIGNING_SECRET_ENV};
use serde_json::{json, Value};
use sqlx::{Postgres, Transaction};

/// A payment provider stand-in that deduplicates by idempotency key, as real
/// ones (Stripe's `Idempotency-Key`, Adyen's, ...) do.
#[derive(Default)]
struct PaymentProvider {
    /// idempotency key -> charge id.
    charges: Mutex<HashMap<String, String>>,
    calls: AtomicU64,
    /// Charge, then lose the reply of the next call.
    lose_next_reply: AtomicBool,
}

enum ProviderError {
    /// The request may or may not have been executed.
    Timeout,
}

impl PaymentProvider {
    async fn charge(&self, idempotency_key: &str, order: &str, cents: i64) -> Result<String, ProviderError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let (id, new) = {
            let mut charges = self.charges.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let next = format!("ch_{}", charges.len() + 1);
            let new = !charges.contains_key(idempotency_key);
            (charges.entry(idempotency_key.to_owned()).or_insert(next).clone(), new)
        };
        println!("  provider: key {idempotency_key} order {order} {cents} cents -> {}", if new { format!("charged {id}") } else { format!("already charged {id}, not charging again") });
        if self.lose_next_reply.swap(false, Ordering::SeqCst) {
            println!("  provider: reply lost (timeout): the caller cannot know the outcome");
            return Err(ProviderError::Timeout);
        }
        Ok(id)
    }
}

struct BillingHandler {
    provider: Arc<PaymentProvider>,
}

#[async_trait]
impl Handler for BillingHandler {
    async fn handle(&self, tx: &mut Transaction<'_, Postgres>, event: &ConsumedEvent) -> Result<Value, HandlerError> {
        let body = event.json().ok_or_else(|| HandlerError::permanent("payload is not JSON"))?;
        let order = body["order"].as_str().ok_or_else(|| HandlerError::permanent("no order"))?.to_owned();
        let cents = body["amount_cents"].as_i64().unwrap_or(0);
        // The same key on every attempt and every delivery of this event.
        let key = event.effect_key_for("charge");
        let charge = match self.provider.charge(&key, &order, cents).await {
            Ok(id) => id,
            // Unknown outcome: retry later with the same key, never a new one.
            Err(ProviderError::Timeout) => return Err(HandlerError::transient("charge outcome unknown (provider timed out)")),
        };
        sqlx::query("INSERT INTO payments (order_id, charge_id, idempotency_key) VALUES ($1, $2, $3)")
            .bind(&order)
            .bind(&charge)
            .bind(&key)
            .execute(&mut **tx)
            .await?;
        Ok(json!({ "charge": charge, "idempotency_key": key }))
    }
}

/// The order service's outbox: its source identity (`outbox status` shows an
/// outbox's; `outbox migrate --source` names it), on every message it sends.
const ORDERS_SOURCE: &str = "urn:example:order-service";

/// The message a dispatcher of [`ORDERS_SOURCE`] signing with `key` would
/// send for one `order.created` event.
fn order_created(order: &str, key: &SigningKey) -> anyhow::Result<RawMessage> {
    let payload = serde_json::to_vec(&json!({ "order": order, "amount_cents": 4_200 }))?;
    let now = 1_800_000_000_000u64;
    let request = EmitRequest {
        command_key: "checkout-o-42",
        tenant: "tenant-7",
        aggregate_type: "order",
        aggregate_id: order,
        aggregate_version: 1,
        event_type: "order.created.v2",
        payload_schema: "order-v2",
        payload: &payload,
    };
    let (envelope, destination) = request.freeze(EventId::generate(now), now as i64, 1, &RoutePolicy::new("order.created.v2", "kafka-prod", "orders", 12))?;
    let mut hs = headers::build(&envelope, &destination, &destination.digest(), &AttemptId::generate(now), None);
    seal(&mut hs, ORDERS_SOURCE, Some(key))?;
    Ok(RawMessage {
        topic: destination.topic.clone(),
        partition: destination.partition,
        offset: 0,
        key: Some(destination.routing_key.into_bytes()),
        payload: Some(payload),
        headers: hs,
        non_utf8_header_names: Vec::new(),
        log_id: None,
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let db = ScratchDb::create("outbox_example", 4).await?;
    let result = run(&db.pool).await;
    db.drop_now().await?;
    result
}

async fn run(pool: &sqlx::PgPool) -> anyhow::Result<()> {
    outbox_consumer::migrate(pool).await?;
    sqlx::query("CREATE TABLE payments (order_id text NOT NULL, charge_id text NOT NULL, idempotency_key text NOT NULL)").execute(pool).await?;

    let provider = Arc::new(PaymentProvider::default());
    // The order service's dispatchers sign with this key; the consumer verifies with it.
    let signing = ExampleKey::from_env_or_random("order-service-k1", SIGNING_SECRET_ENV)?;
    // The one configuration: a service reads it with
    // `Config::from_file_and_env("outbox.toml")`; here it is written with this
    // run's key. [consumer.billing] gives the retry policy and the trust policy.
    let config = outbox_config::Config::from_toml(&config_toml(&signing))?.consumer_config("billing")?;
    // What `IdempotentConsumer::new` builds from it; the messages are handed to it directly here.
    let billing = Processor::new(&config.consumer_id, pool.clone(), BillingHandler { provider: provider.clone() })?
        .with_retry(config.retry)?
        .with_max_evidence_payload_bytes(config.max_evidence_payload_bytes)
        .with_trust(config.trust)?;
    println!("billing accepts only signed messages from source {ORDERS_SOURCE} (key id {}) on orders", signing.key_id());

    let msg = order_created("o-42", &signing.signing_key()?)?;
    println!("delivery 1 (the provider will lose its first reply):");
    provider.lose_next_reply.store(true, Ordering::SeqCst);
    let first = billing.process_message(&msg).await?;
    let Outcome::Applied { receipt } = &first else { anyhow::bail!("expected applied, got {first:?}") };
    println!("  consumer: applied after a retry with the same key; receipt result {}", receipt.result);

    println!("delivery 2 (a redelivery, e.g. the offset commit was lost):");
    let again = billing.process_message(&RawMessage { offset: 1, ..msg }).await?;
    let Outcome::Duplicate { original, .. } = &again else { anyhow::bail!("expected duplicate, got {again:?}") };
    println!("  consumer: duplicate, original receipt result {} (provider not called)", original.result);

    let charges = provider.charges.lock().map(|c| c.len()).unwrap_or(0);
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM payments").fetch_one(pool).await?;
    println!("provider calls={} charges={charges} payment_rows={rows}", provider.calls.load(Ordering::SeqCst));
    ensure!(charges == 1 && rows == 1, "the card was charged {charges} times");
    ensure!(original == receipt, "the duplicate did not return the original receipt");
    Ok(())
}

/// The run's `outbox.toml`: billing retries with backoff and accepts on
/// `orders` only messages of [`ORDERS_SOURCE`] signed with its dispatchers'
/// key (the format of `examples/outbox.toml`: a key is `{ key_id, secret_hex }`).
fn config_toml(signing: &ExampleKey) -> String {
    let s = signing.signing_config();
    let (key_id, secret_hex) = (s.key_id, s.secret_hex);
    format!(
        r#"
[kafka]
bootstrap = "kafka:9092"     # the cluster a running consumer reads; not contacted here

[consumer.billing]
topics = ["orders"]
max_attempts = 5
initial_backoff_ms = 100
max_backoff_ms = 1000
accept = {{ orders = ["{ORDERS_SOURCE}"] }}
require_signature = ["orders"]

[consumer.billing.keys]
"{ORDERS_SOURCE}" = [{{ key_id = "{key_id}", secret_hex = "{secret_hex}" }}]
"#
    )
}
