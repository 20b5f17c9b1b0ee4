//! Emitting transactions that overlap, as PostgreSQL runs them: an event
//! takes its position (its transaction's id and its sequence number) when
//! it is inserted, and becomes visible when its transaction commits, later,
//! possibly after transactions that took later positions; an aborted
//! transaction leaves nothing. [`MemoryStore::insert`] is one such
//! transaction committed at once.
//!
//! Not modelled: a second transaction inserting a command key that an open
//! one holds (PostgreSQL makes it wait on the unique index); emitters of one
//! aggregate serialize on its advisory lock, and the simulator keeps a key's
//! transactions one after another as they would.

use outbox_core::claim::Claim;
use outbox_core::command::{decide_command, Command, CommandDecision, CommandRefusal};
use outbox_core::envelope::{Destination, Envelope};
use outbox_core::error::CoreError;
use outbox_core::id::EventId;
use outbox_core::state::EventState;
use outbox_core::stream::{Snapshot, Xid};

use super::{MemoryEvent, MemoryState, MemoryStore};

/// An emitting transaction that has not ended: its events are invisible to
/// every read until [`MemoryStore::commit`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "an emitting transaction ends by commit or abort"]
pub struct EmitTx {
    xid: Xid,
}

impl EmitTx {
    /// Its transaction id.
    pub fn xid(&self) -> Xid {
        self.xid
    }
}

/// The first transaction id a store hands out (as `Snapshot::origin`).
const FIRST_XID: Xid = 1;

impl MemoryStore {
    /// Begins an emitting transaction; it takes its id now.
    pub fn begin_emit(&self) -> EmitTx {
        let mut st = self.lock();
        let xid = st.next_xid.max(FIRST_XID);
        st.next_xid = xid + 1;
        st.open_transactions.insert(xid, Vec::new());
        EmitTx { xid }
    }

    /// Inserts a PENDING event in `tx`, as `emit` does in the caller's
    /// transaction, decided by [`decide_command`] against what is committed
    /// and what `tx` itself inserted: a second insert with the same command
    /// key and content answers the first event id, one with other content is
    /// [`CoreError::CommandKeyConflict`], and a version below the aggregate's
    /// last is [`CoreError::AggregateVersionBackwards`]. The event takes its
    /// sequence number now; nobody sees it before the commit.
    pub fn insert_in(&self, tx: &EmitTx, command_key: &str, envelope: Envelope, destination: Destination, payload: Vec<u8>) -> Result<EventId, CoreError> {
        let now = self.now_ms();
        let mut st = self.lock();
        let st = &mut *st;
        let Some(own) = st.open_transactions.get(&tx.xid) else {
            return Err(CoreError::InvalidEncoding(format!("emitting transaction {} has ended", tx.xid)));
        };
        let aggregate = (envelope.tenant.clone(), envelope.aggregate_type.clone(), envelope.aggregate_id.clone());
        let first = own
            .iter()
            .find(|(c, _)| c == command_key)
            .map(|(_, e)| (e.envelope.event_id.clone(), Command::of(command_key, &e.envelope)))
            .or_else(|| st.commands.get(command_key).map(|id| (id.clone(), Command::of(command_key, &st.events[id].envelope))));
        let same_aggregate = |e: &Envelope| (&e.tenant, &e.aggregate_type, &e.aggregate_id) == (&aggregate.0, &aggregate.1, &aggregate.2);
        let last_version = own.iter().filter(|(_, e)| same_aggregate(&e.envelope)).map(|(_, e)| e.envelope.aggregate_version).chain(st.aggregate_versions.get(&aggregate).copied()).max();
        match decide_command(&Command::of(command_key, &envelope), first.as_ref().map(|f| &f.1), last_version) {
            Ok(CommandDecision::Repeat) => return Ok(first.map(|f| f.0).unwrap_or_else(|| envelope.event_id.clone())),
            Ok(CommandDecision::New) => {}
            Err(CommandRefusal::KeyReused { what }) => {
                let event_id = first.map(|f| f.0).unwrap_or_else(|| envelope.event_id.clone());
                return Err(CoreError::CommandKeyConflict { command_key: command_key.to_owned(), event_id, what });
            }
            Err(CommandRefusal::VersionBackwards { last }) => {
                let aggregate = format!("{}/{}", envelope.aggregate_type, envelope.aggregate_id);
                return Err(CoreError::AggregateVersionBackwards { aggregate, version: envelope.aggregate_version, last });
            }
        }
        let id = envelope.event_id.clone();
        st.next_seq += 1;
        let seq = st.next_seq;
        let destination_digest = destination.digest();
        let row = MemoryEvent {
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
        };
        st.open_transactions.entry(tx.xid).or_default().push((command_key.to_owned(), row));
        Ok(id)
    }

    /// Commits `tx`: its events become visible, with the positions they
    /// took at insert. Answers their ids, in insert order.
    pub fn commit(&self, tx: EmitTx) -> Vec<EventId> {
        let mut st = self.lock();
        let rows = st.open_transactions.remove(&tx.xid).unwrap_or_default();
        let mut ids = Vec::with_capacity(rows.len());
        for (command_key, row) in rows {
            let id = row.envelope.event_id.clone();
            let aggregate = (row.envelope.tenant.clone(), row.envelope.aggregate_type.clone(), row.envelope.aggregate_id.clone());
            let v = st.aggregate_versions.entry(aggregate).or_insert(row.envelope.aggregate_version);
            *v = (*v).max(row.envelope.aggregate_version);
            st.commands.insert(command_key, id.clone());
            st.routes.insert((row.destination.cluster_id.clone(), row.destination.topic.clone()), row.destination.partitions as i32);
            st.created_by.insert(id.clone(), tx.xid);
            st.stream_buckets.insert(id.clone(), outbox_core::stream::stream_bucket(&row.destination, &id));
            st.events.insert(id.clone(), row);
            ids.push(id);
        }
        ids
    }

    /// Aborts `tx`: nothing it inserted is ever seen (its sequence numbers
    /// stay unused, as a sequence's do).
    pub fn abort(&self, tx: EmitTx) {
        self.lock().open_transactions.remove(&tx.xid);
    }

    /// The store's snapshot now: the emitting transactions still open are in
    /// progress; every other one below the next id has completed.
    pub fn snapshot(&self) -> Snapshot {
        snapshot_of(&self.lock())
    }
}

/// The snapshot of `st` (see [`MemoryStore::snapshot`]).
pub(super) fn snapshot_of(st: &MemoryState) -> Snapshot {
    let xmax = st.next_xid.max(FIRST_XID);
    let open: Vec<Xid> = st.open_transactions.keys().copied().collect();
    // Open ids are below `xmax` by construction, and far fewer than the limit.
    Snapshot::new(open.first().copied().unwrap_or(xmax), xmax, open).unwrap_or_else(|_| Snapshot::origin())
}

/// Test support: emitting one `order.created` event of `aggregate` (tenant
/// `t`, routing key `t.order.<aggregate>`) under `command` in `tx`.
#[cfg(test)]
pub(super) fn insert_order(store: &MemoryStore, tx: &EmitTx, command: &str, aggregate: &str, version: i64) -> Result<EventId, CoreError> {
    let request = outbox_core::EmitRequest {
        command_key: command,
        tenant: "t",
        aggregate_type: "order",
        aggregate_id: aggregate,
        aggregate_version: version,
        event_type: "order.created",
        payload_schema: "order-v1",
        payload: b"{}",
    };
    let now = store.now_ms();
    let (env, dest) = request.freeze(EventId::generate(now.max(0) as u64), now, version.max(0) as u64, &outbox_core::RoutePolicy::new("order.created", "k", "orders", 3))?;
    store.insert_in(tx, command, env, dest, b"{}".to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_is_invisible_until_its_transaction_commits_and_keeps_its_earlier_position() {
        let store = MemoryStore::new();
        let slow = store.begin_emit();
        let fast = store.begin_emit();
        let a = insert_order(&store, &slow, "c-a", "o-1", 1).unwrap();
        let b = insert_order(&store, &fast, "c-b", "o-2", 1).unwrap();
        assert_eq!(store.snapshot().to_string(), format!("{}:{}:{},{}", slow.xid(), fast.xid() + 1, slow.xid(), fast.xid()));
        assert_eq!(store.commit(fast), vec![b.clone()]);
        assert!(!store.lock().events.contains_key(&a), "an open transaction's event is visible");
        assert_eq!(store.snapshot().to_string(), format!("{0}:{1}:{0}", slow.xid(), slow.xid() + 2));
        let slow_xid = slow.xid();
        store.commit(slow);
        let st = store.lock();
        assert!(st.events[&a].seq < st.events[&b].seq, "the later commit keeps the earlier position");
        assert_eq!(st.created_by[&a], slow_xid);
        drop(st);
        assert_eq!(store.snapshot().to_string(), format!("{0}:{0}:", slow_xid + 2));
    }

    #[test]
    fn an_aborted_transaction_leaves_nothing() {
        let store = MemoryStore::new();
        let tx = store.begin_emit();
        let a = insert_order(&store, &tx, "c-a", "o-1", 5).unwrap();
        store.abort(tx);
        let st = store.lock();
        assert!(!st.events.contains_key(&a) && st.commands.is_empty() && st.aggregate_versions.is_empty());
        drop(st);
        // The command and the version are free again.
        let tx = store.begin_emit();
        assert!(insert_order(&store, &tx, "c-a", "o-1", 2).is_ok());
        store.commit(tx);
    }

    #[test]
    fn a_transaction_sees_its_own_commands_and_versions() {
        let store = MemoryStore::new();
        let tx = store.begin_emit();
        let a = insert_order(&store, &tx, "c-a", "o-1", 5).unwrap();
        assert_eq!(insert_order(&store, &tx, "c-a", "o-1", 5).unwrap(), a, "a repeated command answers its first event");
        assert!(matches!(insert_order(&store, &tx, "c-b", "o-1", 4), Err(CoreError::AggregateVersionBackwards { last: 5, .. })));
        assert_eq!(store.commit(tx), vec![a]);
    }
}
