//! The protocol's store operations over the in-memory records: claims,
//! attempt registration, the receipt transaction (`decide_receipt`),
//! unknown and not-sent reports, release, quarantine, leases and the
//! reconcile claim, each deciding with the core as the PostgreSQL store does.

use async_trait::async_trait;

use outbox_core::claim::{grant, is_claimable, validate_lease_ms, ClaimToken, FencedWrite, MAX_CLAIM_BATCH};
use outbox_core::error::CoreError;
use outbox_core::id::{AttemptId, EventId};
use outbox_core::receipt::{decide_receipt, AttemptRecord, BrokerReceipt, ReceiptDecision};
use outbox_core::reconcile::{plan_reconcile_finish, ReconcileDecision, OPEN_ATTEMPT_STATES, RECONCILE_CLAIM, RECONCILE_FROM};
use outbox_core::state::{AttemptState, EventState};
use outbox_core::store::{ClaimedEvent, FenceOutcome, OutboxStore, ReceiptOutcome, ReconcileTask, StoreError, SweepOutcome};

use super::rows::to_outcome;
use super::stream::{self, with_stream};
use super::{AuditRecord, MemoryStore};

#[async_trait]
impl OutboxStore for MemoryStore {
    async fn claim_batch(&self, owner: &str, limit: usize, lease_ms: i64) -> Result<Vec<ClaimedEvent>, StoreError> {
        validate_lease_ms(lease_ms)?;
        let now = self.now_ms();
        let mut st = self.lock();
        if let Some(r) = with_stream(&mut st, |st, s| stream::claim(st, s, owner, limit, lease_ms, now)) {
            return r;
        }
        // PENDING and due first (cheap), then the key (a scan of the store).
        let mut candidates: Vec<(u64, EventId)> =
            st.events.values().filter(|e| is_claimable(e.state, e.next_check_at_ms, false, now)).map(|e| (e.seq, e.envelope.event_id.clone())).collect();
        candidates.sort();
        let mut out = Vec::new();
        for (_, id) in candidates {
            if out.len() >= limit.min(MAX_CLAIM_BATCH) {
                break;
            }
            let ev = &st.events[&id];
            if !is_claimable(ev.state, ev.next_check_at_ms, Self::key_blocked(&st, ev), now) {
                continue;
            }
            let ev = st.events.get_mut(&id).ok_or_else(|| StoreError::NotFound(id.clone()))?;
            Self::transition(ev, EventState::Claimed, now)?;
            ev.claim = grant(&ev.claim, owner, now, lease_ms);
            out.push(Self::claimed(ev, EventState::Pending));
        }
        Ok(out)
    }

    async fn claim_retries(&self, owner: &str, limit: usize, lease_ms: i64) -> Result<Vec<ClaimedEvent>, StoreError> {
        validate_lease_ms(lease_ms)?;
        let now = self.now_ms();
        let mut st = self.lock();
        let mut out = Vec::new();
        for ev in st.events.values_mut() {
            if out.len() >= limit.min(MAX_CLAIM_BATCH) {
                break;
            }
            // A retry claim is granted by the reconciler; a dispatcher takes
            // it over only once the reconciler's lease is gone or unowned.
            if ev.state == EventState::RetryClaimed && ev.claim.owner.is_none() {
                ev.claim = grant(&ev.claim, owner, now, lease_ms);
                out.push(Self::claimed(ev, EventState::RetryClaimed));
            }
        }
        Ok(out)
    }

    async fn register_attempt(&self, token: &ClaimToken) -> Result<AttemptRecord, StoreError> {
        let r = self.fenced_write(token, FencedWrite::Send, "register_attempt", |st, now| {
            if let Some(r) = with_stream(st, |st, s| stream::register(st, s, token, now)).flatten() {
                return r;
            }
            Self::register_in(st, token, AttemptId::generate(now.max(0) as u64), now)
        })?;
        r.map_err(StoreError::from)
    }

    async fn accept_dispatch_receipt(&self, receipt: &BrokerReceipt) -> Result<ReceiptOutcome, StoreError> {
        let now = self.now_ms();
        let mut st = self.lock();
        let st = &mut *st;
        let ev = st.events.get_mut(&receipt.event_id).ok_or_else(|| StoreError::NotFound(receipt.event_id.clone()))?;
        let locked = Self::locked(ev);
        let attempts = st.attempts.entry(receipt.event_id.clone()).or_default();
        let decision = decide_receipt(&locked, attempts, receipt);
        if outbox_core::receipt::refutes_absence(attempts, receipt, &decision) {
            st.audit.push(AuditRecord { event_id: receipt.event_id.clone(), action: "absence_proof_refuted".into(), detail: format!("{} @{}", receipt.attempt_id, receipt.offset) });
        }
        if outbox_core::receipt::is_unregistered_message(&decision) {
            st.audit.push(AuditRecord { event_id: receipt.event_id.clone(), action: "unregistered_message".into(), detail: format!("{} @{}", receipt.attempt_id, receipt.offset) });
        }
        let mark_acked = |attempts: &mut Vec<AttemptRecord>| {
            attempts.iter_mut().filter(|a| a.attempt_id == receipt.attempt_id).for_each(|a| a.state = AttemptState::Acked)
        };
        match &decision {
            ReceiptDecision::Accept { .. } => {
                Self::transition(ev, EventState::Published, now)?;
                ev.slot = Some(receipt.clone());
                let position = (receipt.log().to_log_id(), receipt.offset);
                let newest = st.position_holders.get(&position).map(|(holder, epoch)| (holder.clone(), *epoch));
                ev.slot_epoch = outbox_core::compare::next_position_epoch(newest.as_ref().map(|(h, e)| (h.as_str(), *e)), receipt.event_id.as_str());
                // Another event's receipt at this position: its log is gone
                // (as the PostgreSQL receipt transaction records it).
                if let Some((holder, _)) = newest.filter(|(h, _)| *h != receipt.event_id) {
                    st.findings.insert((outbox_core::compare::RECEIPT_POSITION_LOST.to_owned(), holder.to_string(), String::new()), outbox_core::compare::position_taken_detail(receipt));
                }
                st.position_holders.insert(position, (receipt.event_id.clone(), ev.slot_epoch));
                let log = receipt.log().to_log_id();
                let floor = outbox_core::reconcile::advance_floor(st.partition_high.get(&log), receipt.offset, &receipt.event_id, &receipt.attempt_id);
                st.partition_high.insert(log, floor);
                ev.claim.owner = None;
                ev.claim.lease_until_ms = None;
                mark_acked(attempts);
            }
            ReceiptDecision::AlreadyAccepted => {}
            ReceiptDecision::Duplicate => {
                mark_acked(attempts);
                if !st.duplicates.iter().any(|d| d.event_id == receipt.event_id && d.same_placement(receipt)) {
                    st.duplicates.push(receipt.clone());
                }
            }
            ReceiptDecision::Quarantine { reason, move_event } => {
                if *move_event {
                    Self::transition(ev, EventState::Quarantined, now)?;
                    ev.claim.claim_generation += 1;
                    ev.claim.owner = None;
                }
                st.quarantine.push((receipt.event_id.clone(), format!("{reason:?}")));
            }
            ReceiptDecision::Reject { reason } => {
                st.audit.push(AuditRecord { event_id: receipt.event_id.clone(), action: "receipt_rejected".into(), detail: format!("{reason:?}") });
            }
        }
        let ev = &st.events[&receipt.event_id];
        Ok(ReceiptOutcome { decision, primary: ev.slot.clone(), state: ev.state })
    }

    async fn report_unknown(&self, token: &ClaimToken, attempt_id: &AttemptId, detail: &str) -> Result<FenceOutcome, StoreError> {
        let r = self.fenced_write(token, FencedWrite::Report, "report_unknown", |st, now| {
            let ev = st.events.get_mut(&token.event_id).ok_or_else(|| StoreError::NotFound(token.event_id.clone()))?;
            let attempt = st.attempts.get_mut(&token.event_id).and_then(|v| v.iter_mut().find(|a| &a.attempt_id == attempt_id));
            let Some(attempt) = attempt else { return Ok(FenceOutcome::NoOp) };
            if attempt.state != AttemptState::Sending || ev.state != EventState::Sending {
                return Ok(FenceOutcome::NoOp);
            }
            attempt.state = AttemptState::Unknown;
            Self::transition(ev, EventState::DispatchUnknown, now)?;
            ev.claim.owner = None;
            ev.claim.lease_until_ms = None;
            st.audit.push(AuditRecord { event_id: token.event_id.clone(), action: "unknown".into(), detail: detail.to_owned() });
            Ok(FenceOutcome::Applied)
        })?;
        self.left_stream(token, to_outcome(r))
    }

    async fn report_not_sent(&self, token: &ClaimToken, attempt_id: &AttemptId, detail: &str) -> Result<FenceOutcome, StoreError> {
        let r = self.fenced_write(token, FencedWrite::Report, "report_not_sent", |st, now| {
            let ev = st.events.get_mut(&token.event_id).ok_or_else(|| StoreError::NotFound(token.event_id.clone()))?;
            let attempt = st.attempts.get_mut(&token.event_id).and_then(|v| v.iter_mut().find(|a| &a.attempt_id == attempt_id));
            let Some(attempt) = attempt else { return Ok(FenceOutcome::NoOp) };
            if attempt.state != AttemptState::Sending || ev.state != EventState::Sending {
                return Ok(FenceOutcome::NoOp);
            }
            attempt.state = AttemptState::NotSent;
            // After a blind (unproven) retry an earlier attempt may still be
            // UNKNOWN, i.e. possibly in the log: the event's outcome is then
            // still unknown, and only DISPATCH_UNKNOWN keeps that attempt's
            // late genuine ACK acceptable (PENDING -> PUBLISHED is illegal).
            let earlier_open = st.attempts.get(&token.event_id).is_some_and(|v| v.iter().any(|a| &a.attempt_id != attempt_id && a.state.possibly_in_flight()));
            Self::transition(ev, if earlier_open { EventState::DispatchUnknown } else { EventState::Pending }, now)?;
            if !earlier_open {
                ev.next_check_at_ms = now + outbox_core::claim::not_sent_backoff_ms(ev.attempt_generation);
            }
            ev.claim.owner = None;
            ev.claim.lease_until_ms = None;
            ev.claim.attempt_id = None;
            st.audit.push(AuditRecord { event_id: token.event_id.clone(), action: "not_sent".into(), detail: detail.to_owned() });
            Ok(FenceOutcome::Applied)
        })?;
        self.left_stream(token, to_outcome(r))
    }

    async fn release(&self, token: &ClaimToken) -> Result<FenceOutcome, StoreError> {
        let r = self.fenced_write(token, FencedWrite::Report, "release", |st, now| {
            let ev = st.events.get_mut(&token.event_id).ok_or_else(|| StoreError::NotFound(token.event_id.clone()))?;
            let back = match ev.state {
                EventState::Claimed => EventState::Pending,
                _ => return Ok(FenceOutcome::NoOp),
            };
            Self::transition(ev, back, now)?;
            ev.claim.owner = None;
            ev.claim.lease_until_ms = None;
            Ok(FenceOutcome::Applied)
        })?;
        self.left_stream(token, to_outcome(r))
    }

    async fn quarantine_claimed(&self, token: &ClaimToken, reason: &str, evidence: serde_json::Value) -> Result<FenceOutcome, StoreError> {
        let r = self.fenced_write(token, FencedWrite::Report, "quarantine", |st, now| {
            let ev = st.events.get_mut(&token.event_id).ok_or_else(|| StoreError::NotFound(token.event_id.clone()))?;
            Self::transition(ev, EventState::Quarantined, now)?;
            ev.claim.owner = None;
            st.quarantine.push((token.event_id.clone(), format!("{reason}: {evidence}")));
            Ok(FenceOutcome::Applied)
        })?;
        self.left_stream(token, to_outcome(r))
    }

    async fn renew_lease(&self, token: &ClaimToken, lease_ms: i64) -> Result<Option<i64>, StoreError> {
        validate_lease_ms(lease_ms)?;
        {
            let now = self.now_ms();
            let mut st = self.lock();
            if let Some(r) = with_stream(&mut st, |st, s| stream::renew(st, s, token, lease_ms, now)).flatten() {
                return r;
            }
        }
        let r = self.fenced_write(token, FencedWrite::Send, "renew_lease", |st, now| {
            let ev = st.events.get_mut(&token.event_id).ok_or_else(|| StoreError::NotFound(token.event_id.clone()))?;
            let until = now + lease_ms;
            ev.claim.lease_until_ms = Some(until);
            Ok(until)
        })?;
        match r {
            Ok(until) => Ok(Some(until)),
            Err(CoreError::Fenced { .. } | CoreError::LeaseExpired { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    async fn expire_leases(&self) -> Result<SweepOutcome, StoreError> {
        let now = self.now_ms();
        let mut st = self.lock();
        let st = &mut *st;
        let mut out = SweepOutcome::default();
        // Stream mode: buckets first; the events of open batches are theirs.
        let batched = with_stream(st, |st, s| stream::expire(st, s, now, &mut out)).transpose()?.unwrap_or_default();
        for ev in st.events.values_mut().filter(|e| !batched.contains(&e.envelope.event_id)) {
            let expired = ev.claim.lease_until_ms.is_some_and(|l| l <= now) && ev.claim.owner.is_some();
            if !expired {
                continue;
            }
            let Some(plan) = outbox_core::claim::plan_lease_expiry(ev.state) else { continue };
            match ev.state {
                EventState::Claimed => out.released += 1,
                EventState::Sending => out.unknown += 1,
                _ => out.retry_expired += 1,
            }
            if plan.attempt_unknown {
                if let Some(a) = st.attempts.get_mut(&ev.envelope.event_id).and_then(|v| v.iter_mut().find(|a| Some(&a.attempt_id) == ev.claim.attempt_id.as_ref())) {
                    if a.state == AttemptState::Sending {
                        a.state = AttemptState::Unknown;
                    }
                }
            }
            Self::transition(ev, plan.to, now)?;
            ev.claim.claim_generation += 1;
            ev.claim.owner = None;
            ev.claim.lease_until_ms = None;
            if !plan.keeps_attempt {
                ev.claim.attempt_id = None;
            }
        }
        Ok(out)
    }

    async fn begin_reconcile(&self, owner: &str, limit: usize, lease_ms: i64) -> Result<Vec<ReconcileTask>, StoreError> {
        validate_lease_ms(lease_ms)?;
        let now = self.now_ms();
        let mut st = self.lock();
        let st = &mut *st;
        let mut out = Vec::new();
        for ev in st.events.values_mut() {
            if out.len() >= limit.min(MAX_CLAIM_BATCH) {
                break;
            }
            if ev.state != RECONCILE_FROM || ev.next_check_at_ms > now {
                continue;
            }
            out.push(Self::take_for_reconcile(ev, &st.attempts, owner, now, lease_ms)?);
        }
        Ok(out)
    }

    async fn finish_reconcile(&self, token: &ClaimToken, decision: &ReconcileDecision) -> Result<FenceOutcome, StoreError> {
        let r = self.fenced_write(token, FencedWrite::Report, "finish_reconcile", |st, now| {
            let ev = st.events.get_mut(&token.event_id).ok_or_else(|| StoreError::NotFound(token.event_id.clone()))?;
            let Some(plan) = plan_reconcile_finish(decision).filter(|_| ev.state == RECONCILE_CLAIM) else { return Ok(FenceOutcome::NoOp) };
            Self::transition(ev, plan.to, now)?;
            if let Some(at) = plan.next_check_at_ms {
                ev.next_check_at_ms = at;
            }
            if plan.close_open_attempts {
                for a in st.attempts.entry(token.event_id.clone()).or_default().iter_mut().filter(|a| OPEN_ATTEMPT_STATES.contains(&a.state)) {
                    a.state = AttemptState::Absent;
                }
            }
            ev.claim.owner = None;
            ev.claim.lease_until_ms = None;
            ev.claim.attempt_id = None;
            Ok(FenceOutcome::Applied)
        })?;
        to_outcome(r)
    }

    async fn attempts(&self, event_id: &EventId) -> Result<Vec<AttemptRecord>, StoreError> {
        Ok(self.lock().attempts.get(event_id).cloned().unwrap_or_default())
    }

    async fn event_state(&self, event_id: &EventId) -> Result<(EventState, Option<BrokerReceipt>), StoreError> {
        let st = self.lock();
        let ev = st.events.get(event_id).ok_or_else(|| StoreError::NotFound(event_id.clone()))?;
        Ok((ev.state, ev.slot.clone()))
    }
}
