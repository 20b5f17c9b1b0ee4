//! The one error type of `outbox-producer`.

use outbox_core::{CoreError, EventId, StoreError};

/// Everything the producer side can refuse or fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProducerError {
    /// Bad input or a protocol rule (see [`CoreError`]).
    #[error(transparent)]
    Core(#[from] CoreError),
    /// No route policy exists for the event type.
    #[error("no route policy for event type {event_type:?}")]
    NoRoute {
        /// The event type asked for.
        event_type: String,
    },
    /// The command idempotency key was used before with a different payload
    /// or event identity; nothing was written.
    #[error("command key {command_key:?} already produced {event_id} with different content ({what})")]
    CommandKeyConflict {
        /// The key.
        command_key: String,
        /// The event it produced first.
        event_id: EventId,
        /// What differs.
        what: &'static str,
    },
    /// More requests in one batch than the batch limit; nothing was written.
    #[error("{len} requests in one batch; at most {max}")]
    BatchTooLarge {
        /// Requests given.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The aggregate version is lower than one already emitted for the aggregate.
    #[error("aggregate {aggregate} version {version} is below the last emitted version {last}")]
    AggregateVersionBackwards {
        /// `type/id`.
        aggregate: String,
        /// Offered version.
        version: i64,
        /// Highest version already emitted.
        last: i64,
    },
    /// The database's protocol version is not one this build understands.
    #[error("database speaks outbox protocol {found}, this build understands {understood}")]
    ProtocolVersion {
        /// Found in `outbox_meta`.
        found: String,
        /// Understood here.
        understood: &'static str,
    },
    /// A configuration value is missing or invalid.
    #[error("configuration: {0}")]
    Config(String),
    /// PostgreSQL failed.
    #[error("database: {0}")]
    Database(sqlx::Error),
    /// A table or function of the outbox is not there: the schema was never
    /// migrated, or is older than this build.
    #[error("the outbox schema is missing or older than this build ({detail}): run `outbox migrate` (or `outbox_producer::migrate`) first")]
    SchemaMissing {
        /// PostgreSQL's message, e.g. `relation "outbox_route_policies" does not exist`.
        detail: String,
    },
    /// Schema migration failed.
    #[error("migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// The database was made by the migrations that came before the first
    /// release (one schema file per crate replaced them); it cannot be
    /// upgraded in place.
    #[error("{}", outbox_core::error::pre_release_schema_message("producer", versions))]
    PreReleaseSchema {
        /// The pre-release versions its migration history records.
        versions: Vec<i64>,
    },
    /// A store operation failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<sqlx::Error> for ProducerError {
    fn from(e: sqlx::Error) -> Self {
        if let sqlx::Error::Database(d) = &e {
            // undefined_table, undefined_function, undefined_column on an outbox object.
            if matches!(d.code().as_deref(), Some("42P01" | "42883" | "42703")) && d.message().contains("outbox_") {
                return ProducerError::SchemaMissing { detail: d.message().to_owned() };
            }
        }
        ProducerError::Database(e)
    }
}

impl ProducerError {
    /// Whether retrying the same call can succeed (connection problems,
    /// serialization failures, deadlocks). Input errors never become valid.
    pub fn is_retryable(&self) -> bool {
        match self {
            ProducerError::Database(e) => is_retryable_sqlx(e),
            ProducerError::Store(e) => e.is_retryable(),
            ProducerError::Core(e) => e.is_retryable(),
            _ => false,
        }
    }
}

/// Serialization failure, deadlock, or a broken connection.
pub(crate) fn is_retryable_sqlx(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => matches!(db.code().as_deref(), Some("40001" | "40P01" | "55P03" | "57P01")),
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::WorkerCrashed => true,
        _ => false,
    }
}

/// Maps a database error into a store error.
pub(crate) fn store_err(e: sqlx::Error) -> StoreError {
    StoreError::Backend { retryable: is_retryable_sqlx(&e), message: e.to_string() }
}

