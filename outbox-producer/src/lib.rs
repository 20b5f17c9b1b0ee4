//! # outbox-producer
//!
//! The producer half of the transactional outbox with verified delivery.
//!
//! **Guarantee.** [`emit()`] inserts the event's frozen envelope in the caller's
//! own transaction, so a business change never commits without its event and
//! a rollback leaves nothing. From there, an event becomes PUBLISHED only
//! through [`PgStore`]'s `accept_dispatch_receipt`, with a broker receipt
//! whose payload digest, destination digest and placement match what was
//! frozen at commit.
//!
//! Pieces: [`emit()`] and [`routes`] (route policies with generations),
//! [`PgStore`] (the PostgreSQL store: claims, attempts, the receipt
//! transaction, unknown/retry), the dispatcher loop, and the Kafka adapter.
#![warn(missing_docs)]

pub mod cloudevents;
pub mod conformance;
pub mod dispatcher;
pub mod emit;
pub mod error;
mod findings_store;
pub mod kafka;
pub mod migration;
pub mod observe;
pub mod otel;
pub mod pg;
pub mod reconciler;
pub mod report;
pub mod retention;
pub mod rollout;
pub mod routes;
pub mod service_store;
pub mod skip;
mod pg_service;
pub mod sweeper;
mod topic_scan;
pub mod watermark_topic;

pub use dispatcher::{until_true, BatchReport, IntoShutdown, ClaimCursor, Dispatcher, DispatcherConfig, DispatchMetrics, InFlightBatch, SigningConfig};
pub use emit::{aggregate_heads, emit, emit_batch, set_aggregate_heads, AggregateHeads, EmitOptions, Emitted, MAX_EMIT_BATCH};
pub use error::ProducerError;
pub use kafka::{KafkaBroker, KafkaConfig};
pub use migration::{migrate_destination, MigrationOutcome, MigrationStore};
pub use pg::{dispatch_path, set_dispatch_path, DispatchPath, PgStore};
pub use skip::{SkipOutcome, SkipStore};
pub use sweeper::{LeaseSweeper, Sweep};
pub use service_store::{ClaimRound, CommitListener, DispatcherAlias, Notice, ServiceStore, NOTIFY_CHANNEL};
pub use reconciler::{BypassScanReport, CompareReport, Reconciler, ReconcilerConfig, ResolveReport, RoundObserver, RoundRecord, RoundStore, DEFAULT_STALE_WATERMARK_AFTER_MS};
pub use watermark_topic::{IngestReport, WatermarkTopicConfig, WatermarkTopicReader};
pub use report::{build_report, consumer_decisions, ConsumerDecisions, DecisionCounts, ReconcilerRound, Report, ReportOptions, SloVerdict};
pub use routes::EnsuredRoute;
pub use rollout::{compare_shadow, set_takeover, switch_alias, ShadowDispatcher, ShadowReport};
pub use retention::{purge, register_consumer, PurgeReport, RetentionPolicy};

/// The producer's schema (`migrations/`, one file: outbox tables, route
/// policies, consumer registry, reconciler evidence), as a migrator.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!();

/// Versions of the pre-release migrations (37 files, 2026-11-29 to
/// 2026-12-08) that the one schema file replaced before any release. A
/// database that has any of them applied is refused by [`migrate`]: it
/// cannot be upgraded in place.
pub const PRE_RELEASE_MIGRATIONS: [i64; 37] = [
    20261129000001, 20261129000002, 20261129000003, 20261129000004, 20261129000005, 20261129000006, 20261129000007, 20261129000008,
    20261129000009, 20261129000010, 20261129000011, 20261129000012, 20261129000013, 20261129000014, 20261201010001, 20261201010002,
    20261201030001, 20261201030002, 20261201040001, 20261201040002, 20261201050001, 20261201060001, 20261201070001, 20261201080001,
    20261201090001, 20261201095001, 20261201300001, 20261202060001, 20261202070001, 20261202080001, 20261202090001, 20261204010001,
    20261206000001, 20261207000001, 20261207000002, 20261207000003, 20261208000001,
];

/// The protocol version this build reads and writes.
pub const PROTOCOL_VERSION: &str = "1";

/// Applies the producer's migrations. Other migration sets (the consumer's)
/// may share the database; their versions are ignored here.
pub async fn migrate(pool: &sqlx::PgPool) -> Result<(), ProducerError> {
    migrate_with_source(pool, None).await
}

/// [`migrate`], naming the outbox's source identity (`ce_source` and
/// `outbox-source` of every message it sends, PROTOCOL §8) when the schema is
/// made: consumers can then be configured with it before this database
/// exists. `None` makes a random `urn:uuid:`. The identity never changes: on
/// a database that has one, a different `source` is refused (the same one
/// is accepted, so a deployment can pass it on every run).
pub async fn migrate_with_source(pool: &sqlx::PgPool, source: Option<&str>) -> Result<(), ProducerError> {
    if let Some(s) = source {
        outbox_core::headers::validate_source(s).map_err(|e| ProducerError::Config(format!("source identity: {e}")))?;
    }
    let found = applied_among(pool, &PRE_RELEASE_MIGRATIONS).await?;
    if !found.is_empty() {
        return Err(ProducerError::PreReleaseSchema { versions: found });
    }
    let mut conn = pool.acquire().await?;
    // The schema's seed row reads the session's `outbox.source` (empty: a
    // random one); the setting is cleared again before the connection goes
    // back to the pool.
    sqlx::query("SELECT set_config('outbox.source', $1, false)").bind(source.unwrap_or("")).execute(&mut *conn).await?;
    let mut m = sqlx::migrate::Migrator { ignore_missing: true, ..clone_migrator() };
    m.set_locking(true);
    let ran = m.run(&mut *conn).await;
    sqlx::query("SELECT set_config('outbox.source', '', false)").execute(&mut *conn).await?;
    ran?;
    if let Some(wanted) = source {
        let have: String = sqlx::query_scalar("SELECT source FROM outbox_identity").fetch_one(&mut *conn).await?;
        if have != wanted {
            return Err(ProducerError::Config(format!(
                "this outbox's source identity is {have:?}, made when its schema was; it never changes (consumers and the messages already sent name it): \
                 leave --source out, or pass {have:?}"
            )));
        }
    }
    Ok(())
}

/// Which of `versions` the database's migration history (`_sqlx_migrations`)
/// records; none when it has no history.
async fn applied_among(pool: &sqlx::PgPool, versions: &[i64]) -> Result<Vec<i64>, sqlx::Error> {
    let has_history: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL").fetch_one(pool).await?;
    if !has_history {
        return Ok(Vec::new());
    }
    sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE version = ANY($1) ORDER BY version").bind(versions).fetch_all(pool).await
}

fn clone_migrator() -> sqlx::migrate::Migrator {
    sqlx::migrate::Migrator {
        migrations: MIGRATOR.migrations.clone(),
        ignore_missing: MIGRATOR.ignore_missing,
        locking: MIGRATOR.locking,
        no_tx: MIGRATOR.no_tx,
    }
}

/// Refuses to run against a database of a protocol this build does not understand.
pub async fn check_protocol(pool: &sqlx::PgPool) -> Result<(), ProducerError> {
    let found: Option<String> = sqlx::query_scalar("SELECT value FROM outbox_meta WHERE key = 'protocol_version'").fetch_optional(pool).await?;
    match found.as_deref() {
        Some(PROTOCOL_VERSION) => Ok(()),
        other => Err(ProducerError::ProtocolVersion { found: other.unwrap_or("none").to_owned(), understood: PROTOCOL_VERSION }),
    }
}
