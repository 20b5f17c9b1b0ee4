//! The emit transaction: a PENDING event inserted as the caller's
//! transaction would, decided by `decide_command`, and committed at once
//! (`transactions.rs` has transactions that stay open).

use outbox_core::envelope::{Destination, Envelope};
use outbox_core::error::CoreError;
use outbox_core::id::EventId;

use super::MemoryStore;

impl MemoryStore {
    /// Inserts a PENDING event and commits, as `emit` in a caller's
    /// transaction that commits at once: [`MemoryStore::insert_in`] in a
    /// transaction of its own. A second insert with the same command key
    /// and content returns the first event id, one with other content is
    /// [`CoreError::CommandKeyConflict`], and a version below the
    /// aggregate's last is [`CoreError::AggregateVersionBackwards`].
    pub fn insert(&self, command_key: &str, envelope: Envelope, destination: Destination, payload: Vec<u8>) -> Result<EventId, CoreError> {
        let tx = self.begin_emit();
        match self.insert_in(&tx, command_key, envelope, destination, payload) {
            Ok(id) => {
                self.commit(tx);
                Ok(id)
            }
            Err(e) => {
                self.abort(tx);
                Err(e)
            }
        }
    }
}
