//! What `emit` does with one business command (PROTOCOL §2): a command key
//! names one event for ever, and an aggregate's versions never go backwards.
//!
//! One decision for both stores: the PostgreSQL `emit` (outbox-producer)
//! reads the command keys and the aggregates' last versions in one query and
//! asks [`decide_command`] per request, in order; the in-memory store
//! (`outbox_memory::MemoryStore`) asks it under its lock. The conformance
//! scenario `command_keys_and_aggregate_versions` runs it on both.
//!
//! ```
//! use outbox_core::command::{decide_command, Command, CommandDecision, CommandRefusal};
//!
//! let first = Command {
//!     command_key: "cmd-o-42-pay",
//!     payload_digest: "sha256:aa",
//!     event_type: "order.paid",
//!     tenant: "tenant-7",
//!     aggregate_type: "order",
//!     aggregate_id: "o-42",
//!     aggregate_version: 3,
//! };
//! // A new key at or past the aggregate's last version is a new event.
//! assert_eq!(decide_command(&first, None, Some(2)), Ok(CommandDecision::New));
//! // The same key with the same content is the same command: its first event answers.
//! assert_eq!(decide_command(&first, Some(&first), Some(3)), Ok(CommandDecision::Repeat));
//! // The same key with other content is refused, and so is a version below the last.
//! let other = Command { payload_digest: "sha256:bb", ..first };
//! assert_eq!(decide_command(&other, Some(&first), Some(3)), Err(CommandRefusal::KeyReused { what: "payload" }));
//! let older = Command { command_key: "cmd-o-42-old", aggregate_version: 1, ..first };
//! assert_eq!(decide_command(&older, None, Some(3)), Err(CommandRefusal::VersionBackwards { last: 3 }));
//! ```

use crate::envelope::Envelope;

/// The identity of one business command, as `emit` is asked for it or as
/// its first event froze it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Command<'a> {
    /// Idempotency key.
    pub command_key: &'a str,
    /// `sha256:` digest of the payload bytes.
    pub payload_digest: &'a str,
    /// Event type.
    pub event_type: &'a str,
    /// Tenant.
    pub tenant: &'a str,
    /// Aggregate type.
    pub aggregate_type: &'a str,
    /// Aggregate id.
    pub aggregate_id: &'a str,
    /// Aggregate version after the command.
    pub aggregate_version: i64,
}

impl<'a> Command<'a> {
    /// The command an event was frozen from.
    pub fn of(command_key: &'a str, envelope: &'a Envelope) -> Self {
        Command {
            command_key,
            payload_digest: &envelope.payload_digest,
            event_type: &envelope.event_type,
            tenant: &envelope.tenant,
            aggregate_type: &envelope.aggregate_type,
            aggregate_id: &envelope.aggregate_id,
            aggregate_version: envelope.aggregate_version,
        }
    }
}

/// What to do with a command that is not refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommandDecision {
    /// Freeze and insert a new PENDING event.
    New,
    /// The key's first event answers; nothing is written.
    Repeat,
}

/// Why a command is refused; nothing is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommandRefusal {
    /// The key already produced an event with other content: `what` differs
    /// (`payload`, `event type` or `aggregate`).
    KeyReused {
        /// What differs.
        what: &'static str,
    },
    /// The aggregate already emitted a higher version.
    VersionBackwards {
        /// The highest version emitted for the aggregate.
        last: i64,
    },
}

/// Decides one command. `first` is the command the key produced before (in
/// the store, or earlier in the same batch), `last_version` the highest
/// version the aggregate emitted before (the store's, raised by the batch's
/// earlier new commands). A repeat is checked against the first command
/// only: its version is the first one's, so a retry after later commands of
/// the aggregate is still the same command.
pub fn decide_command(request: &Command<'_>, first: Option<&Command<'_>>, last_version: Option<i64>) -> Result<CommandDecision, CommandRefusal> {
    if let Some(first) = first.filter(|_| !crate::simulation::mutation_active("command-dedupe-disabled")) {
        let what = if first.payload_digest != request.payload_digest {
            Some("payload")
        } else if first.event_type != request.event_type {
            Some("event type")
        } else if first.tenant != request.tenant || first.aggregate_type != request.aggregate_type || first.aggregate_id != request.aggregate_id {
            Some("aggregate")
        } else {
            None
        };
        return match what {
            Some(what) => Err(CommandRefusal::KeyReused { what }),
            None => Ok(CommandDecision::Repeat),
        };
    }
    match last_version {
        Some(last) if request.aggregate_version < last => Err(CommandRefusal::VersionBackwards { last }),
        _ => Ok(CommandDecision::New),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd() -> Command<'static> {
        Command {
            command_key: "k",
            payload_digest: "sha256:aa",
            event_type: "order.created",
            tenant: "t",
            aggregate_type: "order",
            aggregate_id: "o-1",
            aggregate_version: 5,
        }
    }

    #[test]
    fn equal_versions_are_new_events_and_lower_ones_are_refused() {
        assert_eq!(decide_command(&cmd(), None, None), Ok(CommandDecision::New));
        assert_eq!(decide_command(&cmd(), None, Some(5)), Ok(CommandDecision::New));
        assert_eq!(decide_command(&cmd(), None, Some(6)), Err(CommandRefusal::VersionBackwards { last: 6 }));
    }

    #[test]
    fn a_repeat_is_judged_by_its_content_not_by_later_versions() {
        let first = cmd();
        // Later commands raised the aggregate to 9: the retry is still the same command.
        assert_eq!(decide_command(&cmd(), Some(&first), Some(9)), Ok(CommandDecision::Repeat));
        // A version that differs alone does not make another command: the key names it.
        assert_eq!(decide_command(&Command { aggregate_version: 7, ..cmd() }, Some(&first), None), Ok(CommandDecision::Repeat));
        for (changed, what) in [
            (Command { payload_digest: "sha256:bb", ..cmd() }, "payload"),
            (Command { event_type: "order.paid", ..cmd() }, "event type"),
            (Command { tenant: "u", ..cmd() }, "aggregate"),
            (Command { aggregate_type: "cart", ..cmd() }, "aggregate"),
            (Command { aggregate_id: "o-2", ..cmd() }, "aggregate"),
        ] {
            assert_eq!(decide_command(&changed, Some(&first), None), Err(CommandRefusal::KeyReused { what }));
        }
    }
}
