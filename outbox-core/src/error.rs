//! The one error type of `outbox-core`.

use crate::state::EventState;

/// Everything the protocol core can refuse.
///
/// Each variant names one rule; none of them is a panic. Producers, consumers
/// and stores wrap this type in their own errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CoreError {
    /// An identifier (event id, attempt id, aggregate id, tenant, topic, ...)
    /// is empty, too long or uses characters outside its alphabet.
    #[error("malformed {field}: {reason}")]
    MalformedIdentifier {
        /// Which field was malformed.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The payload is empty.
    #[error("payload is empty")]
    EmptyPayload,
    /// The payload exceeds the configured limit.
    #[error("payload is {size_bytes} bytes, the limit is {limit_bytes} bytes")]
    PayloadTooLarge {
        /// Size of the rejected payload.
        size_bytes: usize,
        /// Configured limit.
        limit_bytes: usize,
    },
    /// A state transition that the closed table does not contain.
    #[error("illegal transition {from} -> {to}")]
    IllegalTransition {
        /// State the event is in.
        from: EventState,
        /// State somebody tried to move it to.
        to: EventState,
    },
    /// A write by a claim holder whose claim generation is no longer current.
    #[error("fenced: writer holds claim generation {writer_generation}, current is {current_generation}")]
    Fenced {
        /// Generation the writer holds.
        writer_generation: u64,
        /// Generation on the row.
        current_generation: u64,
    },
    /// The claim is current but its lease has run out: the holder may not send.
    #[error("lease expired at {lease_until_ms} ms, now is {now_ms} ms")]
    LeaseExpired {
        /// When the lease ended.
        lease_until_ms: i64,
        /// The time of the check.
        now_ms: i64,
    },
    /// A canonical encoding could not be parsed back.
    #[error("invalid canonical encoding: {0}")]
    InvalidEncoding(String),
    /// A route policy or destination is not usable (zero partitions, unknown partitioner...).
    #[error("invalid destination: {0}")]
    InvalidDestination(String),
    /// A command key already produced an event with other content
    /// ([`crate::command::CommandRefusal::KeyReused`]); nothing was written.
    #[error("command key {command_key:?} already produced {event_id} with different content ({what})")]
    CommandKeyConflict {
        /// The key.
        command_key: String,
        /// The event it produced first.
        event_id: crate::id::EventId,
        /// What differs.
        what: &'static str,
    },
    /// The aggregate already emitted a higher version
    /// ([`crate::command::CommandRefusal::VersionBackwards`]); nothing was written.
    #[error("aggregate {aggregate} version {version} is below the last emitted version {last}")]
    AggregateVersionBackwards {
        /// `type/id`.
        aggregate: String,
        /// Offered version.
        version: i64,
        /// Highest version already emitted.
        last: i64,
    },
}

impl CoreError {
    /// Whether retrying the same call later can succeed. Input errors and
    /// protocol violations never become valid by waiting.
    pub fn is_retryable(&self) -> bool {
        matches!(self, CoreError::LeaseExpired { .. })
    }
}

/// The message for a database made by the pre-release migrations, shared by
/// the producer's and the consumer's `migrate`.
pub fn pre_release_schema_message(side: &str, versions: &[i64]) -> String {
    let first = versions.first().copied().unwrap_or_default();
    let last = versions.last().copied().unwrap_or_default();
    format!(
        "this database's {side} schema was made by pre-release migrations ({} of them applied, versions {first} to {last}), \
         which one schema file replaced before the first release and which cannot be upgraded in place: \
         run `outbox migrate` on a new, empty database (or drop this one's outbox tables and its _sqlx_migrations table first)",
        versions.len()
    )
}
