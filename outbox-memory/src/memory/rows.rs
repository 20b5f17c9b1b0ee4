//! How the store's operations write one event row: the transition (through
//! the core's table), audit records, the views the decisions read (the
//! locked event, the claimed event), the key check of per-key ordering,
//! the fenced write every claim holder's write goes through, and the
//! reconcile claim.

use std::collections::BTreeMap;

use outbox_core::claim::{check_fence, check_registration, grant, ClaimToken, FencedWrite};
use outbox_core::envelope::Ordering;
use outbox_core::error::CoreError;
use outbox_core::id::{AttemptId, EventId};
use outbox_core::receipt::{AttemptRecord, LockedEvent};
use outbox_core::reconcile::RECONCILE_CLAIM;
use outbox_core::state::{AttemptState, EventState};
use outbox_core::store::{ClaimedEvent, FenceOutcome, ReconcileTask, StoreError};

use super::{AuditRecord, MemoryEvent, MemoryState, MemoryStore};

impl MemoryStore {
    /// Moves an event, through the transition table.
    pub fn transition(ev: &mut MemoryEvent, to: EventState, now_ms: i64) -> Result<(), CoreError> {
        ev.state = ev.state.transition(to)?;
        ev.state_since_ms = now_ms;
        if to == EventState::Published {
            ev.published_at_ms.get_or_insert(now_ms);
        }
        match to {
            // Due for the reconciler at once, as in PostgreSQL; a recheck
            // sets its own time after this transition.
            EventState::DispatchUnknown => {
                ev.unknown_since_ms.get_or_insert(now_ms);
                ev.next_check_at_ms = now_ms;
            }
            EventState::Published | EventState::Quarantined | EventState::Pending => {
                if let Some(since) = ev.unknown_since_ms.take() {
                    ev.unknown_resolved_after_ms.push(now_ms - since);
                }
            }
            _ => {}
        }
        Ok(())
    }

    pub(super) fn audit(st: &mut MemoryState, event_id: &EventId, action: &str, detail: String) {
        st.audit.push(AuditRecord { event_id: event_id.clone(), action: action.to_owned(), detail });
    }

    /// The event as the receipt and reconcile decisions see it.
    pub(super) fn locked(ev: &MemoryEvent) -> LockedEvent {
        LockedEvent {
            event_id: ev.envelope.event_id.clone(),
            envelope_generation: ev.envelope.envelope_generation,
            state: ev.state,
            payload_digest: ev.envelope.payload_digest.clone(),
            destination: ev.destination.clone(),
            destination_digest: ev.destination_digest.clone(),
            slot: ev.slot.clone(),
        }
    }

    pub(super) fn claimed(ev: &MemoryEvent, from: EventState) -> ClaimedEvent {
        ClaimedEvent {
            token: ClaimToken {
                event_id: ev.envelope.event_id.clone(),
                owner: ev.claim.owner.clone().unwrap_or_default(),
                claim_generation: ev.claim.claim_generation,
                lease_until_ms: ev.claim.lease_until_ms.unwrap_or(0),
            },
            envelope: ev.envelope.clone(),
            destination: ev.destination.clone(),
            destination_digest: ev.destination_digest.clone(),
            payload: ev.payload.clone(),
            event_payload_digest: ev.envelope.payload_digest.clone(),
            claimed_from: from,
            traceparent: None,
            // The in-memory store has no source identity: no CloudEvents headers.
            cloudevents: None,
            tracestate: None,
            source: None,
        }
    }

    /// Registers `attempt_id` for `token`'s claim, as every registration
    /// does: the registration guard (`check_registration`), CLAIMED or
    /// RETRY_CLAIMED to SENDING, the attempt with the scan floor and anchor
    /// of the event's log, named on the event's claim.
    pub(super) fn register_in(st: &mut MemoryState, token: &ClaimToken, attempt_id: AttemptId, now: i64) -> Result<AttemptRecord, StoreError> {
        let ev = st.events.get_mut(&token.event_id).ok_or_else(|| StoreError::NotFound(token.event_id.clone()))?;
        check_registration(ev.state, &ev.claim, token, now)?;
        Self::transition(ev, EventState::Sending, now)?;
        ev.attempt_generation += 1;
        let floor = st.partition_high.get(&ev.destination.log().to_log_id());
        let attempt = AttemptRecord {
            attempt_id,
            event_id: token.event_id.clone(),
            envelope_generation: ev.envelope.envelope_generation,
            attempt_generation: ev.attempt_generation,
            claim_generation: token.claim_generation,
            owner: token.owner.clone(),
            state: AttemptState::Sending,
            destination_digest: ev.destination_digest.clone(),
            started_at_ms: now,
            send_deadline_ms: Some(token.lease_until_ms),
            scan_from_offset: floor.map_or(0, |f| f.0),
            scan_anchor: floor.map(|f| f.1.clone()),
            scan_anchor_attempt: floor.map(|f| f.2.clone()),
        };
        ev.claim.attempt_id = Some(attempt.attempt_id.clone());
        st.attempts.entry(token.event_id.clone()).or_default().push(attempt.clone());
        Ok(attempt)
    }

    /// Whether an earlier event of the same destination and key holds the key.
    pub(super) fn key_blocked(st: &MemoryState, ev: &MemoryEvent) -> bool {
        ev.destination.ordering == Ordering::Key
            && st.events.values().any(|o| {
                o.seq < ev.seq
                    && o.destination.topic == ev.destination.topic
                    && o.destination.cluster_id == ev.destination.cluster_id
                    && o.destination.routing_key == ev.destination.routing_key
                    && o.state.holds_key()
            })
    }

    pub(super) fn fenced_write<T>(
        &self,
        token: &ClaimToken,
        write: FencedWrite,
        action: &str,
        f: impl FnOnce(&mut MemoryState, i64) -> Result<T, StoreError>,
    ) -> Result<Result<T, CoreError>, StoreError> {
        let now = self.now_ms();
        let mut st = self.lock();
        let ev = st.events.get(&token.event_id).ok_or_else(|| StoreError::NotFound(token.event_id.clone()))?;
        if let Err(e) = check_fence(&ev.claim, token, write, now) {
            Self::audit(&mut st, &token.event_id, "stale_write", format!("{action} by {} gen {}: {e}", token.owner, token.claim_generation));
            return Ok(Err(e));
        }
        f(&mut st, now).map(Ok)
    }

    pub(super) fn take_for_reconcile(ev: &mut MemoryEvent, attempts: &BTreeMap<EventId, Vec<AttemptRecord>>, owner: &str, now: i64, lease_ms: i64) -> Result<ReconcileTask, StoreError> {
        let since = ev.unknown_since_ms.unwrap_or(ev.state_since_ms);
        Self::transition(ev, RECONCILE_CLAIM, now)?;
        ev.claim = grant(&ev.claim, owner, now, lease_ms);
        ev.claim.attempt_id = None;
        Ok(ReconcileTask {
            token: Self::claimed(ev, EventState::DispatchUnknown).token,
            event: Self::locked(ev),
            attempts: attempts.get(&ev.envelope.event_id).cloned().unwrap_or_default(),
            unknown_since_ms: since,
        })
    }
}

pub(super) fn to_outcome(r: Result<FenceOutcome, CoreError>) -> Result<FenceOutcome, StoreError> {
    match r {
        Ok(o) => Ok(o),
        Err(CoreError::Fenced { .. } | CoreError::LeaseExpired { .. }) => Ok(FenceOutcome::Fenced),
        Err(e) => Err(e.into()),
    }
}
