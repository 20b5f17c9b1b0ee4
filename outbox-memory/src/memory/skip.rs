//! An operator's skip (issue 47, `outbox_core::skip`) in the in-memory
//! store: the PostgreSQL store's skip transaction, under the store's lock.

use outbox_core::id::{validate_identifier, EventId};
use outbox_core::skip::{decide_skip, SkipRecord, SkipRefusal, SKIP_ACTION};
use outbox_core::state::EventState;
use outbox_core::store::StoreError;

use super::MemoryStore;

impl MemoryStore {
    /// Closes a QUARANTINED or DISPATCH_UNKNOWN event as SKIPPED for
    /// `operator`, with `reason`: under the store's lock, [`decide_skip`] on
    /// the event as it is now; then the transition (bumping the claim
    /// generation, so every earlier claim holder is fenced) and the audit
    /// record (action [`SKIP_ACTION`], the [`SkipRecord`] as its detail)
    /// together. The event no longer holds its key. `Ok(Err(refusal))`
    /// when refused; nothing changed.
    pub fn skip_event(&self, event_id: &EventId, operator: &str, reason: &str) -> Result<Result<SkipRecord, SkipRefusal>, StoreError> {
        validate_identifier("operator", operator)?;
        let now = self.now_ms();
        let mut st = self.lock();
        let st = &mut *st;
        let ev = st.events.get_mut(event_id).ok_or_else(|| StoreError::NotFound(event_id.clone()))?;
        let from = match decide_skip(ev.state, ev.claim.owner.as_deref(), reason) {
            Ok(from) => from,
            Err(refusal) => return Ok(Err(refusal)),
        };
        let unknown_since_ms = ev.unknown_since_ms.take();
        Self::transition(ev, EventState::Skipped, now)?;
        ev.claim.claim_generation += 1;
        ev.claim.owner = None;
        ev.claim.lease_until_ms = None;
        ev.claim.attempt_id = None;
        let record = SkipRecord {
            event_id: event_id.to_string(),
            from_state: from,
            operator: operator.to_owned(),
            reason: reason.to_owned(),
            at_ms: now,
            claim_generation: ev.claim.claim_generation,
            unknown_since_ms,
        };
        let detail = serde_json::to_string(&record).map_err(|e| StoreError::Backend { message: e.to_string(), retryable: false })?;
        Self::audit(st, event_id, SKIP_ACTION, detail);
        Ok(Ok(record))
    }

    /// The skip records of `event_id`, oldest first.
    pub fn skip_records(&self, event_id: &EventId) -> Vec<SkipRecord> {
        self.lock().audit.iter().filter(|a| &a.event_id == event_id && a.action == SKIP_ACTION).filter_map(|a| serde_json::from_str(&a.detail).ok()).collect()
    }
}
