//! # outbox-consumer
//!
//! The idempotent consumer of the transactional outbox (PROTOCOL §8).
//!
//! **Guarantee.** For each consumer (`consumerId`) and each event
//! (`eventId`), the handler's database effect commits at most once, and
//! together with a consumption receipt; the broker offset moves past a
//! message only after its decision committed. Hence, whatever the broker
//! redelivers (a lost offset commit, a producer retry, a replay, a
//! rebalance), every event has *exactly one* committed effect per consumer,
//! and a redelivery is answered with the *original* receipt, including the
//! result the handler recorded the first time.
//!
//! For every message, in order within its partition:
//! 1. **Verify** with [`outbox_core::headers::verify`]: the payload hashes to
//!    its digest, the destination header to its digest, and the message sits
//!    on the topic, partition and key its frozen destination prescribes. A
//!    message that fails is **quarantined** with its evidence
//!    (`outbox_consumer_quarantine`), the handler never sees it, and the
//!    partition moves on. Then the trust checks ([`TrustPolicy`],
//!    [`verify_message_with`]): the claims digest where present, and on
//!    topics with a policy the accepted sources and signatures.
//! 2. **Claim** the receipt `(consumerId, eventId)` in
//!    `outbox_consumer_receipts` (`INSERT .. ON CONFLICT DO NOTHING`). If it
//!    exists, the outcome is [`Outcome::Duplicate`] with the original receipt
//!    (or a quarantine, if the same eventId arrives with other payload bytes).
//! 3. **Handle**: the [`Handler`] runs on the *same* transaction; its result
//!    is stored in the receipt.
//! 4. Move the partition's **watermark** (`outbox_consumer_watermarks`) in the
//!    same transaction, **commit**, then store and commit the broker offset.
//!
//! Many messages of one partition share one transaction (multi-row claims),
//! which is what makes the consumer fast; a failing handler splits the batch
//! so that only the failing event is retried: bounded attempts with
//! exponential backoff ([`RetryPolicy`]), then a **dead letter**
//! (`outbox_consumer_dead_letters`), never a silent skip. Partitions are
//! processed by independent workers, so a poisoned partition does not stop
//! the others.
//!
//! **External effects** (payments, e-mail) cannot join the transaction. Give
//! the other system [`ConsumedEvent::effect_key`] (see [`effect_key`]) as its
//! idempotency key: it is the same on every delivery and every retry, so an
//! effect whose outcome was unknown is retried with the same key and happens
//! once.
//!
//! ## Watermarks and the outbox database
//!
//! Each row of `outbox_consumer_watermarks` says, for one consumer and one
//! log (cluster, topic, topic id, partition), that every message below
//! `committed_offset` has a committed decision (applied, duplicate,
//! quarantined or dead-lettered), with cumulative counts of each. The topic
//! id is the one the decided messages' destinations name
//! ([`ConsumedEvent::topic_id`]; none for `destination.v1`): a topic
//! deleted and created again under the same name starts a new log at offset
//! 0 under another id, and gets rows of its own. A batch counts each
//! message under its own id, and moves each id's row to its last message
//! plus one. The producer side's reconciler and retention read this table
//! *in the outbox database*: an event published at `(cluster, topic, topic
//! id, partition, offset)` is consumed by a consumer once that consumer's
//! `committed_offset` for that same log (the topic id matched exactly) is
//! greater than `offset`.
//!
//! **Contract for a consumer whose state lives in another database than the
//! outbox:** its receipts and watermarks are written in its own database
//! (they must commit with its own state), and its watermark rows must reach
//! the outbox database's `outbox_consumer_watermarks`. Two ways:
//!
//! - **Over the broker** (the default, no credentials on the outbox
//!   database): [`IdempotentConsumer::run`] publishes every row to the
//!   compacted watermark topic of its cluster
//!   ([`ConsumerConfig::watermark_topic`], default `outbox.watermarks`) every
//!   [`ConsumerConfig::watermark_publish_interval_ms`] and at shutdown, as
//!   `outboxWatermark.v1` records (`.v2` for a row of a topic id, `.v3` at an open gap, `.v4` naming the log read;
//!   docs/WIRE.md); the producer side's
//!   reconciler applies those of registered consumers. Publishing never
//!   holds up consumption; a failed publication is counted
//!   ([`Metrics::watermark_publish_failures`]) and retried next interval.
//! - **A database copy**, for a consumer allowed to write the outbox
//!   database: [`publish_watermarks`], called periodically (every few
//!   seconds) and at shutdown.
//!
//! Both are monotonic and idempotent, so publishing too often or
//! concurrently is safe; publishing too rarely only delays retention and
//! raises "not consumed" alarms, it can never let an unconsumed event be
//! purged.
//!
//! ## Example
//!
//! ```no_run
//! use outbox_consumer::{async_trait, ConsumedEvent, ConsumerConfig, Handler, HandlerError, IdempotentConsumer};
//! use serde_json::{json, Value};
//! use sqlx::{Postgres, Transaction};
//!
//! struct Reserve;
//!
//! #[async_trait]
//! impl Handler for Reserve {
//!     async fn handle(&self, tx: &mut Transaction<'_, Postgres>, e: &ConsumedEvent) -> Result<Value, HandlerError> {
//!         sqlx::query("INSERT INTO reservations (event_id) VALUES ($1)").bind(e.event_id.as_str()).execute(&mut **tx).await?;
//!         Ok(json!({ "reserved": true }))
//!     }
//! }
//!
//! # async fn run() -> Result<(), outbox_consumer::ConsumerError> {
//! let pool = sqlx::PgPool::connect("postgres://root@127.0.0.1/test").await?;
//! outbox_consumer::migrate(&pool).await?;
//! let config = ConsumerConfig::new("fulfilment", "127.0.0.1:9092", &["orders"]);
//! let consumer = IdempotentConsumer::new(config, pool, Reserve)?;
//! consumer.run(async { let _ = tokio::signal::ctrl_c().await; }).await
//! # }
//! ```
#![warn(missing_docs)]

mod config;
mod consumer;
mod error;
mod event;
pub mod dead_letters;
pub mod gap;
mod gaps_pg;
mod handler;
mod metrics;
mod otel;
mod outcome;
mod processor;
mod quarantine_log;
pub mod memory;
pub mod store;
pub mod readiness;
mod trust;
mod watermark;
mod watermark_publisher;

pub use async_trait::async_trait;
pub use config::*;
pub use dead_letters::{dead_letters_of, list_dead_letters, request_requeue, DeadLetter};
pub use consumer::{run_partition, AfterCommitHook, BatchLimits, CommittedBatch, HookAction, IdempotentConsumer, OffsetCommit};
pub use error::{ConsumerError, HandlerError};
pub use event::{effect_key, ConsumedEvent, RawMessage, DEFAULT_EFFECT_PURPOSE, EFFECT_KEY_SCHEMA};
pub use gaps_pg::{accept_gap, list_gaps, GapRecord, MAX_GAP_ROWS};
pub use handler::Handler;
pub use metrics::{ConsumerHistograms, Metrics, MetricsSnapshot};
/// The Prometheus client the consumer's metrics are registered with.
pub use prometheus;
pub use outcome::{DeadLettered, Outcome, Position, QuarantineReason, Quarantined, Receipt};
pub use quarantine_log::{QUARANTINE_LOG_LINES_PER_WINDOW, QUARANTINE_LOG_WINDOW, QUARANTINE_RUN_ALARM};
pub use readiness::ConsumerReadiness;
pub use store::{ConsumerStore, PgConsumerStore, TxHandler};
pub use processor::{purge_receipts_before, receipt, verify_message, verify_message_with, Processor, Rejection, LIMIT_PURGE_ROWS, MAX_RESULT_BYTES};
pub use trust::{TopicTrust, TrustPolicy, LIMIT_TRUST_ENTRIES};
pub use watermark::{publish_watermarks, watermarks, Watermark, MAX_WATERMARK_ROWS};
pub use watermark_publisher::{watermark_record_of, SHARED_KAFKA_PROPERTY_PREFIXES, WATERMARK_TOPIC_PARTITIONS};

/// The consumer's schema (`migrations/`, one file, version `20261208200001`),
/// for `#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]` and tools.
/// In a database shared with other migration sets, use [`migrate`].
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!();

/// Versions of the pre-release migrations (8 files, 2026-11-29 to
/// 2026-12-07) that the one schema file replaced before any release. A
/// database that has any of them applied is refused by [`migrate`].
pub const PRE_RELEASE_MIGRATIONS: [i64; 8] =
    [20261129100001, 20261129100002, 20261201130001, 20261201190001, 20261201200001, 20261204020001, 20261206100001, 20261207100001];

/// Applies the consumer's migrations, ignoring versions applied by other
/// migration sets in the same database (the producer's). Run it on the
/// consumer's database, and on the outbox database of a consumer that
/// publishes its watermarks there.
pub async fn migrate(pool: &sqlx::PgPool) -> Result<(), ConsumerError> {
    let has_history: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL").fetch_one(pool).await?;
    if has_history {
        let found: Vec<i64> =
            sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE version = ANY($1) ORDER BY version").bind(&PRE_RELEASE_MIGRATIONS[..]).fetch_all(pool).await?;
        if !found.is_empty() {
            return Err(ConsumerError::PreReleaseSchema { versions: found });
        }
    }
    let mut m: sqlx::migrate::Migrator = sqlx::migrate!();
    m.set_ignore_missing(true);
    m.run(pool).await?;
    Ok(())
}
