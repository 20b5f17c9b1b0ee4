//! An operator's skip (issue 47, `outbox_core::skip`) in the in-memory
//! store: the PostgreSQL store's skip transaction, under the store's lock.

use outbox_core::id::{validate_identifier, EventId};
use outbox_core::skip::{decide_skip, PoisonPolicy, PoisonRule, SkipRecord, SkipRefusal, POISON_POLICY_ACTOR, SKIP_ACTION};
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

    /// Sets a route's poison policy (a new setting; the older ones stay as history).
    pub fn set_poison_policy(&self, rule: PoisonRule) -> Result<(), StoreError> {
        rule.validate()?;
        self.lock().poison_rules.push(rule);
        Ok(())
    }

    /// The poison policy in force for `event_type`, if one was set.
    pub fn poison_policy(&self, event_type: &str) -> Option<PoisonRule> {
        self.lock().poison_rules.iter().rev().find(|r| r.event_type == event_type).cloned()
    }

    /// Up to `limit` QUARANTINED events whose route's poison policy is
    /// skip, oldest first, with the rule.
    pub fn poisoned(&self, limit: usize) -> Vec<(EventId, PoisonRule)> {
        let st = self.lock();
        let mut out: Vec<(u64, EventId, PoisonRule)> = st
            .events
            .iter()
            .filter(|(_, e)| e.state == EventState::Quarantined)
            .filter_map(|(id, e)| {
                let rule = st.poison_rules.iter().rev().find(|r| r.event_type == e.envelope.event_type)?;
                (rule.policy == PoisonPolicy::Skip).then(|| (e.seq, id.clone(), rule.clone()))
            })
            .collect();
        out.sort_by_key(|x| x.0);
        out.into_iter().take(limit).map(|(_, id, r)| (id, r)).collect()
    }

    /// Skips up to `limit` QUARANTINED events whose route's poison policy is
    /// skip, under [`POISON_POLICY_ACTOR`] with the rule's
    /// [`PoisonRule::skip_reason`] (the PostgreSQL store's
    /// `SkipStore::release_poisoned`). The skips made.
    pub fn release_poisoned(&self, limit: usize) -> Result<Vec<SkipRecord>, StoreError> {
        let mut out = Vec::new();
        for (event_id, rule) in self.poisoned(limit) {
            if let Ok(record) = self.skip_event(&event_id, POISON_POLICY_ACTOR, &rule.skip_reason())? {
                out.push(record);
            }
        }
        Ok(out)
    }

    /// The skip records of `event_id`, oldest first.
    pub fn skip_records(&self, event_id: &EventId) -> Vec<SkipRecord> {
        self.lock().audit.iter().filter(|a| &a.event_id == event_id && a.action == SKIP_ACTION).filter_map(|a| serde_json::from_str(&a.detail).ok()).collect()
    }
}
