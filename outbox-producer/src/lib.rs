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
mod topic_scan;
pub mod watermark_topic;

pub use dispatcher::{until_true, BatchReport, ClaimCursor, Dispatcher, DispatcherConfig, DispatchMetrics, InFlightBatch, SigningConfig};
pub use emit::{emit, emit_batch, EmitOptions, Emitted, MAX_EMIT_BATCH};
pub use error::ProducerError;
pub use kafka::{KafkaBroker, KafkaConfig};
pub use migration::{migrate_destination, MigrationOutcome, MigrationStore};
pub use pg::PgStore;
pub use service_store::{ClaimRound, CommitListener, Notice, ServiceStore, NOTIFY_CHANNEL};
pub use reconciler::{BypassScanReport, CompareReport, Reconciler, ReconcilerConfig, ResolveReport, RoundRecord, RoundStore, DEFAULT_STALE_WATERMARK_AFTER_MS};
pub use watermark_topic::{IngestReport, WatermarkTopicConfig, WatermarkTopicReader};
pub use report::{build_report, consumer_decisions, ConsumerDecisions, ReconcilerRound, Report, ReportOptions, SloVerdict};
pub use routes::EnsuredRoute;
pub use rollout::{compare_shadow, set_takeover, switch_alias, ShadowDispatcher, ShadowReport};
pub use retention::{purge, register_consumer, PurgeReport, RetentionPolicy};

/// The producer's schema migrations (outbox tables, route policies, consumer registry).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!();

/// The protocol version this build reads and writes.
pub const PROTOCOL_VERSION: &str = "1";

/// Applies the producer's migrations. Other migration sets (the consumer's)
/// may share the database; their versions are ignored here.
pub async fn migrate(pool: &sqlx::PgPool) -> Result<(), ProducerError> {
    let mut m = sqlx::migrate::Migrator { ignore_missing: true, ..clone_migrator() };
    m.set_locking(true);
    m.run(pool).await?;
    Ok(())
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
