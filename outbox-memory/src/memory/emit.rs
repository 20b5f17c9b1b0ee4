//! The emit transaction: a PENDING event inserted as the caller's
//! transaction would, decided by `decide_command`.

use outbox_core::claim::Claim;
use outbox_core::command::{decide_command, Command, CommandDecision, CommandRefusal};
use outbox_core::envelope::{Destination, Envelope};
use outbox_core::error::CoreError;
use outbox_core::id::EventId;
use outbox_core::state::EventState;

use super::{MemoryEvent, MemoryStore};

impl MemoryStore {
    /// Inserts a PENDING event, as `emit` does in the caller's transaction,
    /// decided by [`decide_command`]: a second insert with the same command
    /// key and content returns the first event id, one with other content is
    /// [`CoreError::CommandKeyConflict`], and a version below the aggregate's
    /// last is [`CoreError::AggregateVersionBackwards`].
    pub fn insert(&self, command_key: &str, envelope: Envelope, destination: Destination, payload: Vec<u8>) -> Result<EventId, CoreError> {
        let now = self.now_ms();
        let mut st = self.lock();
        let aggregate = (envelope.tenant.clone(), envelope.aggregate_type.clone(), envelope.aggregate_id.clone());
        let first = st.commands.get(command_key).map(|id| (id, Command::of(command_key, &st.events[id].envelope)));
        match decide_command(&Command::of(command_key, &envelope), first.as_ref().map(|f| &f.1), st.aggregate_versions.get(&aggregate).copied()) {
            Ok(CommandDecision::Repeat) => return Ok(first.map(|f| f.0.clone()).unwrap_or_else(|| envelope.event_id.clone())),
            Ok(CommandDecision::New) => {}
            Err(CommandRefusal::KeyReused { what }) => {
                let event_id = first.map(|f| f.0.clone()).unwrap_or_else(|| envelope.event_id.clone());
                return Err(CoreError::CommandKeyConflict { command_key: command_key.to_owned(), event_id, what });
            }
            Err(CommandRefusal::VersionBackwards { last }) => {
                let aggregate = format!("{}/{}", envelope.aggregate_type, envelope.aggregate_id);
                return Err(CoreError::AggregateVersionBackwards { aggregate, version: envelope.aggregate_version, last });
            }
        }
        let v = st.aggregate_versions.entry(aggregate).or_insert(envelope.aggregate_version);
        *v = (*v).max(envelope.aggregate_version);
        let id = envelope.event_id.clone();
        st.next_seq += 1;
        let seq = st.next_seq;
        let destination_digest = destination.digest();
        st.commands.insert(command_key.to_owned(), id.clone());
        st.routes.insert((destination.cluster_id.clone(), destination.topic.clone()), destination.partitions as i32);
        st.events.insert(
            id.clone(),
            MemoryEvent {
                seq,
                envelope,
                destination,
                destination_digest,
                payload,
                state: EventState::Pending,
                claim: Claim { owner: None, claim_generation: 0, lease_until_ms: None, attempt_id: None },
                attempt_generation: 0,
                slot: None,
                slot_epoch: 0,
                state_since_ms: now,
                next_check_at_ms: 0,
                unknown_since_ms: None,
                published_at_ms: None,
                unknown_resolved_after_ms: Vec::new(),
                created_at_ms: now,
            },
        );
        Ok(id)
    }
}
