//! The drill's child processes. The drill re-executes its own binary with
//! [`ROLE_ENV`] set to one of:
//!
//! - `outbox`: the shipped `outbox` command line (outbox-cli's `main`, the
//!   same code as the `outbox` binary): `outbox dispatch`, `outbox reconcile`;
//! - `emitter`: business transactions, each a `chaos_orders` row and its
//!   event (`outbox_producer::emit`) committed together, sequential per
//!   aggregate (the commit order the per-key check holds the log to);
//! - `consumer`: an [`IdempotentConsumer`] whose handler writes an effect
//!   row (`chaos_effects`, no unique constraint) in the consumer's
//!   transaction.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use outbox_consumer::{async_trait, ConsumedEvent, ConsumerConfig, Handler, HandlerError, IdempotentConsumer};
use outbox_core::EmitRequest;
use outbox_producer::{emit, EmitOptions};
use serde_json::{json, Value};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgPool, Postgres, Transaction};

/// The variable naming the role of a child process.
pub const ROLE_ENV: &str = "OUTBOX_CHAOS_ROLE";
/// The drill's event type.
pub const EVENT_TYPE: &str = "chaos.order.v1";
/// The consumers' effect table.
pub const EFFECTS_TABLE: &str = "chaos_effects";

/// Runs the role named by [`ROLE_ENV`] with the process's arguments.
pub fn run(role: &str) -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    match role {
        "outbox" => outbox_main(args),
        "emitter" | "consumer" => {
            let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into())).with_writer(std::io::stderr).try_init();
            let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("outbox-chaos {role}: {e}");
                    return ExitCode::from(1);
                }
            };
            let r = if role == "emitter" { rt.block_on(emitter(&args[1..])) } else { rt.block_on(consumer(&args[1..])) };
            match r {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("outbox-chaos {role}: error: {e:#}");
                    ExitCode::from(1)
                }
            }
        }
        other => {
            eprintln!("outbox-chaos: unknown {ROLE_ENV}={other}");
            ExitCode::from(2)
        }
    }
}

/// The `outbox` binary's `main` (`outbox_cli::main_with`), run as `outbox`.
fn outbox_main(mut args: Vec<String>) -> ExitCode {
    args[0] = "outbox".into();
    outbox_cli::main_with(args)
}

fn arg<T: std::str::FromStr>(args: &[String], i: usize, what: &str) -> Result<T> {
    args.get(i).ok_or_else(|| anyhow!("missing argument {i} ({what})"))?.parse().map_err(|_| anyhow!("argument {i} ({what}) does not parse: {:?}", args[i]))
}

/// The business schema of the producer database.
pub async fn create_business_table(pool: &PgPool) -> Result<()> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS chaos_orders (
             order_id     text PRIMARY KEY,
             aggregate_id text NOT NULL,
             version      bigint NOT NULL,
             event_id     text NOT NULL,
             committed_at timestamptz NOT NULL DEFAULT clock_timestamp()
         )",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// The effect table of the consumer database (deliberately without a unique
/// constraint: a second effect would be a second row).
pub async fn create_effect_table(pool: &PgPool) -> Result<()> {
    sqlx::query(&format!(
        "CREATE TABLE IF NOT EXISTS {EFFECTS_TABLE} (
             id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
             consumer_id text NOT NULL,
             event_id    text NOT NULL,
             order_id    text NOT NULL,
             applied_at  timestamptz NOT NULL DEFAULT clock_timestamp()
         )"
    ))
    .execute(pool)
    .await?;
    Ok(())
}

/// One order of emitter `emitter`: (order id, aggregate id, version).
pub fn order(emitter: u32, n: u64, aggregates: u64) -> (String, String, i64) {
    (format!("e{emitter}-{n}"), format!("agg-{emitter}-{}", n % aggregates), (n / aggregates + 1) as i64)
}

/// `emitter <database_url> <emitter> <events> <aggregates> <events_per_s>`.
async fn emitter(args: &[String]) -> Result<()> {
    let url: String = arg(args, 0, "database url")?;
    let me: u32 = arg(args, 1, "emitter index")?;
    let events: u64 = arg(args, 2, "events")?;
    let aggregates: u64 = arg(args, 3, "aggregates")?;
    let rate: f64 = arg(args, 4, "events per second")?;
    if aggregates == 0 || rate <= 0.0 {
        bail!("aggregates and rate must be positive");
    }
    let pool = PgPoolOptions::new().max_connections(12).acquire_timeout(Duration::from_secs(10)).connect_lazy(&url)?;
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for k in 0..aggregates.min(events) {
        let pool = pool.clone();
        tasks.spawn(async move {
            let mut n = k;
            while n < events {
                let due = started + Duration::from_secs_f64(n as f64 / rate);
                tokio::time::sleep_until(due.into()).await;
                let (order_id, aggregate_id, version) = order(me, n, aggregates);
                commit_order(&pool, &order_id, &aggregate_id, version).await?;
                n += aggregates;
            }
            Ok::<(), anyhow::Error>(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.context("emitter task")??;
    }
    println!("emitted {events}");
    Ok(())
}

/// One business transaction, retried (with the same command key) through
/// database errors for up to 180 s: a retry after a commit whose answer was
/// lost answers the first event (`inserted = false`) and writes nothing.
async fn commit_order(pool: &PgPool, order_id: &str, aggregate_id: &str, version: i64) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut backoff = Duration::from_millis(50);
    loop {
        match try_commit_order(pool, order_id, aggregate_id, version).await {
            Ok(()) => return Ok(()),
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(order_id, error = %e, "business transaction failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
            Err(e) => return Err(e.context(format!("order {order_id}: no commit within 180 s"))),
        }
    }
}

async fn try_commit_order(pool: &PgPool, order_id: &str, aggregate_id: &str, version: i64) -> Result<()> {
    let command_key = format!("order-{order_id}");
    let payload = json!({ "order": order_id, "aggregate": aggregate_id, "version": version }).to_string();
    let mut tx = pool.begin().await?;
    let emitted = emit(
        &mut tx,
        &EmitRequest {
            command_key: &command_key,
            tenant: "chaos",
            aggregate_type: "order",
            aggregate_id,
            aggregate_version: version,
            event_type: EVENT_TYPE,
            payload_schema: "chaos-order-v1",
            payload: payload.as_bytes(),
        },
        &EmitOptions::default(),
    )
    .await?;
    if emitted.inserted {
        sqlx::query("INSERT INTO chaos_orders (order_id, aggregate_id, version, event_id) VALUES ($1, $2, $3, $4)")
            .bind(order_id)
            .bind(aggregate_id)
            .bind(version)
            .bind(emitted.event_id().as_str())
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
    } else {
        tx.rollback().await?;
    }
    Ok(())
}

struct Effect {
    consumer_id: String,
}

#[async_trait]
impl Handler for Effect {
    async fn handle(&self, tx: &mut Transaction<'_, Postgres>, event: &ConsumedEvent) -> Result<Value, HandlerError> {
        let order = event.json().and_then(|v| v.get("order").and_then(Value::as_str).map(str::to_owned)).ok_or_else(|| HandlerError::permanent("payload names no order"))?;
        let id: i64 = sqlx::query_scalar(&format!("INSERT INTO {EFFECTS_TABLE} (consumer_id, event_id, order_id) VALUES ($1, $2, $3) RETURNING id"))
            .bind(&self.consumer_id)
            .bind(event.event_id.as_str())
            .bind(&order)
            .fetch_one(&mut **tx)
            .await?;
        Ok(json!({ "effect": id }))
    }
}

/// `consumer <database_url> <bootstrap> <consumer_id> <group_id> <topic>`: runs until SIGTERM/SIGINT.
async fn consumer(args: &[String]) -> Result<()> {
    let url: String = arg(args, 0, "database url")?;
    let bootstrap: String = arg(args, 1, "bootstrap")?;
    let consumer_id: String = arg(args, 2, "consumer id")?;
    let group_id: String = arg(args, 3, "group id")?;
    let topic: String = arg(args, 4, "topic")?;
    let pool = PgPoolOptions::new().max_connections(8).acquire_timeout(Duration::from_secs(10)).connect(&url).await?;
    let mut config = ConsumerConfig::new(consumer_id.clone(), bootstrap, &[topic.as_str()]);
    config.group_id = group_id;
    config.session_timeout_ms = 6_000;
    config.shutdown_timeout_ms = 5_000;
    config.watermark_publish_interval_ms = 2_000;
    let consumer = IdempotentConsumer::new(config, pool, Effect { consumer_id })?;
    consumer
        .run(async {
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        })
        .await?;
    Ok(())
}
