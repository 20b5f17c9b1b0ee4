//! Destination migration (PROTOCOL §7) in the in-memory store: the
//! operator's reconcile claim, the move under a proof, and the fenced
//! commit the PostgreSQL store's migration mirrors.

use outbox_core::claim::{validate_lease_ms, ClaimToken};
use outbox_core::envelope::{Destination, Envelope};
use outbox_core::id::EventId;
use outbox_core::migration::{check_migration_fence, decide_migration, MigrationDecision, MigrationFence, MigrationProof};
use outbox_core::reconcile::{RetryPolicy, RECONCILE_FROM};
use outbox_core::state::{AttemptState, EventState};
use outbox_core::store::{LookupOutcome, ReconcileTask, StoreError};

use super::{MemoryState, MemoryStore, MigrationRecord};

impl MemoryStore {
    /// Takes one DISPATCH_UNKNOWN event (due or not) for a fenced reconcile,
    /// as an operator's migration does before asking the old target.
    pub fn begin_reconcile_event(&self, owner: &str, event_id: &EventId, lease_ms: i64) -> Result<Option<ReconcileTask>, StoreError> {
        validate_lease_ms(lease_ms)?;
        let now = self.now_ms();
        let mut st = self.lock();
        let st = &mut *st;
        let Some(ev) = st.events.get_mut(event_id) else { return Err(StoreError::NotFound(event_id.clone())) };
        if ev.state != RECONCILE_FROM {
            return Ok(None);
        }
        Ok(Some(Self::take_for_reconcile(ev, &st.attempts, owner, now, lease_ms)?))
    }

    /// Destination migration (PROTOCOL §7): writes envelope generation + 1 with
    /// `new_destination`, keeps the old envelope in a migration receipt, and
    /// makes the event PENDING for the new destination.
    ///
    /// `NeverPersisted` is re-checked here ([`decide_migration`] on the locked
    /// row: PENDING, no attempt in flight or acknowledged). `ProvenAbsent` is
    /// accepted only for a RECONCILING event (the caller holds the reconcile
    /// claim under which it looked up the old target); only then are the old
    /// generation's SENDING/UNKNOWN attempts closed ABSENT. The move fences
    /// every earlier claim. `Ok(Err(why))` when refused; nothing changed.
    ///
    /// A proven-absent move commits only under the reconcile claim
    /// (`claim`) the proof was made under; the attempts are decided again
    /// here, under the store's lock.
    pub fn migrate(
        &self,
        event_id: &EventId,
        new_destination: Destination,
        proof: MigrationProof,
        operator: &str,
        claim: Option<&ClaimToken>,
    ) -> Result<Result<MigrationRecord, String>, StoreError> {
        let now = self.now_ms();
        let mut st = self.lock();
        let st = &mut *st;
        let ev = st.events.get_mut(event_id).ok_or_else(|| StoreError::NotFound(event_id.clone()))?;
        let attempts = st.attempts.entry(event_id.clone()).or_default();
        match (&proof, ev.state) {
            (MigrationProof::NeverPersisted, EventState::Pending) => {
                if let MigrationDecision::Refuse(r) = decide_migration(EventState::Pending, attempts, None, &Default::default(), now) {
                    return Ok(Err(r.to_string()));
                }
            }
            (MigrationProof::ProvenAbsent { .. }, EventState::Reconciling) => {
                let held = claim.is_some_and(|t| check_migration_fence(&MigrationFence::Claim(t.clone()), ev.state, ev.claim.claim_generation, ev.claim.owner.as_deref()).is_ok());
                if !held {
                    return Ok(Err("the reconcile claim the absence proof was made under is not held".into()));
                }
            }
            (p, s) => return Ok(Err(format!("state {s} cannot move under proof {p:?}"))),
        }
        Self::apply_migration(st, event_id, new_destination, proof, operator, now, false)
    }

    /// The commit of a destination migration, as the PostgreSQL store's:
    /// under the store's lock, checks that the row is still what the proof
    /// was made under ([`check_migration_fence`]), re-runs
    /// [`decide_migration`] on the attempts as they are now (with the old
    /// target's `lookup` for a proven-absent move), and only then writes
    /// envelope generation + 1 with `new_destination` (as
    /// [`MemoryStore::migrate`] does). With `dry_run`, decides the same and
    /// writes nothing. `Ok(Err(why))` when refused; nothing changed.
    #[allow(clippy::too_many_arguments)]
    pub fn commit_migration(
        &self,
        event_id: &EventId,
        new_destination: Destination,
        fence: &MigrationFence,
        lookup: Option<&LookupOutcome>,
        retry: &RetryPolicy,
        operator: &str,
        dry_run: bool,
    ) -> Result<Result<MigrationRecord, String>, StoreError> {
        let now = self.now_ms();
        let mut st = self.lock();
        let st = &mut *st;
        let ev = st.events.get(event_id).ok_or_else(|| StoreError::NotFound(event_id.clone()))?;
        let decide_as = match check_migration_fence(fence, ev.state, ev.claim.claim_generation, ev.claim.owner.as_deref()) {
            Ok(s) => s,
            Err(why) => return Ok(Err(why)),
        };
        let attempts = st.attempts.get(event_id).map(Vec::as_slice).unwrap_or_default();
        let proof = match decide_migration(decide_as, attempts, lookup, retry, now) {
            MigrationDecision::Move { proof } => proof,
            MigrationDecision::Refuse(r) => return Ok(Err(r.to_string())),
        };
        Self::apply_migration(st, event_id, new_destination, proof, operator, now, dry_run)
    }

    /// Writes a migration decided under the lock (or, with `dry_run`, only
    /// builds its record).
    fn apply_migration(
        st: &mut MemoryState,
        event_id: &EventId,
        new_destination: Destination,
        proof: MigrationProof,
        operator: &str,
        now: i64,
        dry_run: bool,
    ) -> Result<Result<MigrationRecord, String>, StoreError> {
        let ev = st.events.get_mut(event_id).ok_or_else(|| StoreError::NotFound(event_id.clone()))?;
        let attempts = st.attempts.entry(event_id.clone()).or_default();
        let to_digest = new_destination.digest();
        if to_digest == ev.destination_digest && !outbox_core::may_keep_destination(ev.state) {
            return Ok(Err("the new route resolves to the same destination".into()));
        }
        let mut closed = Vec::new();
        if matches!(proof, MigrationProof::ProvenAbsent { .. }) {
            closed = attempts.iter().filter(|a| a.state.possibly_in_flight()).map(|a| a.attempt_id.clone()).collect();
        }
        let old_envelope = ev.envelope.clone();
        let record = MigrationRecord {
            event_id: event_id.clone(),
            from_generation: old_envelope.envelope_generation,
            to_generation: old_envelope.envelope_generation + 1,
            from_destination: ev.destination.clone(),
            from_destination_digest: ev.destination_digest.clone(),
            to_destination: new_destination.clone(),
            to_destination_digest: to_digest.clone(),
            from_envelope: old_envelope.clone(),
            proof,
            operator: operator.to_owned(),
            at_ms: now,
            closed_attempts: closed,
        };
        if dry_run {
            return Ok(Ok(record));
        }
        if matches!(record.proof, MigrationProof::ProvenAbsent { .. }) {
            for a in attempts.iter_mut().filter(|a| a.state.possibly_in_flight()) {
                a.state = AttemptState::Absent;
            }
        }
        st.routes.insert((new_destination.cluster_id.clone(), new_destination.topic.clone()), new_destination.partitions as i32);
        ev.envelope = Envelope { envelope_generation: old_envelope.envelope_generation + 1, ..old_envelope };
        ev.destination = new_destination;
        ev.destination_digest = to_digest;
        // The new generation is PENDING and has no publish slot yet,
        // written as the SQL store writes it (`state = 'PENDING'`, slots per
        // envelope generation): the fence and the decision before this are
        // what keep a moved event from having been delivered.
        ev.state = EventState::Pending;
        ev.slot = None;
        ev.slot_epoch = 0;
        ev.published_at_ms = None;
        ev.state_since_ms = now;
        // A migration resolves an unknown outcome too (proven absent, moved).
        if let Some(since) = ev.unknown_since_ms.take() {
            ev.unknown_resolved_after_ms.push(now - since);
        }
        ev.next_check_at_ms = 0;
        ev.claim.claim_generation += 1;
        ev.claim.owner = None;
        ev.claim.lease_until_ms = None;
        ev.claim.attempt_id = None;
        Self::audit(st, event_id, "migrated", format!("generation {} -> {} by {operator}", record.from_generation, record.to_generation));
        st.migrations.push(record.clone());
        Ok(Ok(record))
    }
}
