//! The one error type of `outbox-consumer`, and the error a handler returns.

use std::fmt;

/// Everything that stops the consumer from deciding about a message.
///
/// None of these is a verdict about a message: a message that fails
/// verification is *quarantined* and a handler that keeps failing leads to a
/// *dead letter*; both are [`Outcome`](crate::Outcome)s, not errors. An error
/// means the decision could not be committed, so the offset was not stored and
/// the message will be seen again.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The configuration is refused; the message says which field and why.
    #[error("invalid consumer configuration: {0}")]
    Config(String),
    /// A PostgreSQL error outside the handler (receipts, watermarks, quarantine, dead letters).
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// Applying the consumer's migrations failed.
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The database was made by the migrations that came before the first
    /// release (one schema file replaced them); it cannot be upgraded in place.
    #[error("{}", outbox_core::error::pre_release_schema_message("consumer", versions))]
    PreReleaseSchema {
        /// The pre-release versions its migration history records.
        versions: Vec<i64>,
    },
    /// A Kafka client error (creating the consumer, subscribing, polling).
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    /// The messages given to one batch are not one partition in offset order.
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// A stored row does not have the form this crate writes (e.g. an eventId
    /// that does not parse): the table was edited by hand or by another version.
    #[error("corrupt row: {0}")]
    CorruptRow(String),
    /// An `after_db_commit` hook asked the consumer to stop (fault injection):
    /// the database transaction committed, the offset was not stored.
    #[error("stopped by hook after the database commit of {topic}/{partition} up to offset {last_offset}")]
    StoppedByHook {
        /// Topic of the batch.
        topic: String,
        /// Partition of the batch.
        partition: i32,
        /// Last offset whose decision committed.
        last_offset: i64,
    },
    /// A partition worker stopped unexpectedly (it panicked or was cancelled).
    #[error("partition worker failed: {0}")]
    Worker(String),
    /// The consumer is stopping (shutdown or partition revoked) and gave up the
    /// batch before deciding it; nothing was committed for the rest.
    #[error("stopped before the batch was decided")]
    Stopped,
    /// A receipt store other than PostgreSQL could not answer (a lost
    /// connection, a conflicting transaction holding a receipt): retryable.
    #[error("receipt store unavailable: {0}")]
    Unavailable(String),
}

impl ConsumerError {
    /// Whether trying the same work again later can succeed: connection
    /// losses, pool timeouts, serialization failures, deadlocks, server
    /// restarts and transient Kafka errors. Configuration errors, corrupt rows,
    /// missing tables and hook stops are not retryable.
    pub fn is_retryable(&self) -> bool {
        match self {
            ConsumerError::Database(e) => is_retryable_sqlx(e),
            ConsumerError::Unavailable(_) => true,
            ConsumerError::Kafka(e) => !matches!(
                e,
                rdkafka::error::KafkaError::ClientConfig(..)
                    | rdkafka::error::KafkaError::ClientCreation(_)
                    | rdkafka::error::KafkaError::Subscription(_)
            ),
            ConsumerError::Config(_)
            | ConsumerError::Migrate(_)
            | ConsumerError::PreReleaseSchema { .. }
            | ConsumerError::InvalidBatch(_)
            | ConsumerError::CorruptRow(_)
            | ConsumerError::StoppedByHook { .. }
            | ConsumerError::Worker(_)
            | ConsumerError::Stopped => false,
        }
    }
}

impl ConsumerError {
    /// Whether a statement found its transaction aborted: a handler ignored
    /// a failed query (SQLSTATE 25P02).
    pub(crate) fn is_aborted_transaction(&self) -> bool {
        matches!(self, ConsumerError::Database(sqlx::Error::Database(db)) if db.code().as_deref() == Some("25P02"))
    }
}

/// Whether a sqlx error is worth retrying: I/O, pool exhaustion, and the
/// SQLSTATE classes 08 (connection), 40 (serialization, deadlock), 53
/// (insufficient resources), 57P (operator intervention, server restart).
pub(crate) fn is_retryable_sqlx(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::WorkerCrashed | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            let c = c.as_ref();
            c.starts_with("08") || c.starts_with("40") || c.starts_with("53") || c.starts_with("57P")
        }),
        _ => false,
    }
}

/// Why a handler did not apply an event.
///
/// [`Transient`](HandlerError::Transient) and [`Database`](HandlerError::Database)
/// errors are retried with backoff up to the configured attempts, then the
/// event is dead-lettered; [`Permanent`](HandlerError::Permanent) errors are
/// dead-lettered at once. Whatever the handler wrote in the transaction is
/// rolled back together with the receipt.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// May succeed later (a dependency is down, an outcome is unknown).
    #[error("transient: {0}")]
    Transient(String),
    /// Will never succeed for this event (invalid payload for this consumer).
    #[error("permanent: {0}")]
    Permanent(String),
    /// A query of the handler failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// The handler ran longer than `handler_timeout_ms` (set by the consumer).
    #[error("handler timed out after {0} ms")]
    Timeout(u64),
    /// The handler panicked (set by the consumer); the panic is contained.
    #[error("handler panicked: {0}")]
    Panicked(String),
}

impl HandlerError {
    /// A [`HandlerError::Transient`] from anything printable.
    pub fn transient(e: impl fmt::Display) -> Self {
        HandlerError::Transient(e.to_string())
    }

    /// A [`HandlerError::Permanent`] from anything printable.
    pub fn permanent(e: impl fmt::Display) -> Self {
        HandlerError::Permanent(e.to_string())
    }

    /// Whether the consumer should try again (until its attempts run out).
    pub fn is_retryable(&self) -> bool {
        !matches!(self, HandlerError::Permanent(_))
    }
}
