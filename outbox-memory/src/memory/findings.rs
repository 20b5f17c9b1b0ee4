//! The comparison's condition findings over the in-memory records
//! ([`FindingsStore`](outbox_core::FindingsStore)).

use async_trait::async_trait;

use outbox_core::state::EventState;
use outbox_core::store::StoreError;

use super::{MemoryEvent, MemoryState, MemoryStore};

/// What the comparison judges of one event row.
fn facts(ev: &MemoryEvent, st: &MemoryState) -> outbox_core::store::EventFacts {
    let id = &ev.envelope.event_id;
    outbox_core::store::EventFacts {
        event_id: id.to_string(),
        state: ev.state,
        held_by_dispatcher: ev.claim.owner.is_some(),
        by_outbox: true,
        created_at_ms: ev.created_at_ms,
        state_since_ms: ev.state_since_ms,
        unknown_since_ms: ev.unknown_since_ms,
        quarantine_reason: st.quarantine.iter().rev().find(|(e, _)| e == id).map(|(_, r)| r.clone()).unwrap_or_default(),
    }
}

/// The first `limit` rows of a read, as the SQL's `LIMIT`.
fn take<T>(mut v: Vec<T>, limit: i64) -> Vec<T> {
    v.truncate(usize::try_from(limit.max(0)).unwrap_or(usize::MAX));
    v
}

/// The comparison's reads and write over the in-memory records (as
/// `PgStore`'s over its tables). Its reads pre-filter as the SQL does
/// (time, state), so that a read's limit cuts the same rows; what is a
/// finding is the reconciler's call (`outbox_core::findings`).
#[async_trait]
impl outbox_core::store::FindingsStore for MemoryStore {
    async fn aged_candidates(&self, created_before_ms: i64, limit: i64) -> Result<Vec<outbox_core::store::EventFacts>, StoreError> {
        let st = self.lock();
        let mut v: Vec<&MemoryEvent> = st
            .events
            .values()
            .filter(|e| e.created_at_ms < created_before_ms)
            .filter(|e| e.state == EventState::Pending || (matches!(e.state, EventState::Claimed | EventState::Sending) && e.claim.owner.is_some()))
            .collect();
        v.sort_by_key(|e| e.seq);
        Ok(take(v.into_iter().map(|e| facts(e, &st)).collect(), limit))
    }

    async fn unknown_candidates(&self, unknown_before_ms: i64, limit: i64) -> Result<Vec<outbox_core::store::EventFacts>, StoreError> {
        let st = self.lock();
        let closed = [EventState::Published, EventState::Retained, EventState::Purged, EventState::Quarantined, EventState::Skipped];
        let mut v: Vec<&MemoryEvent> = st.events.values().filter(|e| e.unknown_since_ms.is_some_and(|u| u < unknown_before_ms) && !closed.contains(&e.state)).collect();
        v.sort_by_key(|e| e.unknown_since_ms);
        Ok(take(v.into_iter().map(|e| facts(e, &st)).collect(), limit))
    }

    async fn quarantined_candidates(&self, limit: i64) -> Result<Vec<outbox_core::store::EventFacts>, StoreError> {
        let st = self.lock();
        let mut v: Vec<&MemoryEvent> = st.events.values().filter(|e| e.state == EventState::Quarantined).collect();
        v.sort_by_key(|e| e.state_since_ms);
        Ok(take(v.into_iter().map(|e| facts(e, &st)).collect(), limit))
    }

    async fn critical_consumers(&self) -> Result<Vec<(String, Vec<String>)>, StoreError> {
        Ok(self.lock().consumers.iter().filter(|(_, c)| c.critical).map(|(id, c)| (id.clone(), c.topics.clone())).collect())
    }

    async fn published_candidates(&self, _consumer_id: &str, topics: &[String], published_before_ms: i64, limit: i64) -> Result<Vec<outbox_core::store::PublishedFacts>, StoreError> {
        let st = self.lock();
        let mut v: Vec<outbox_core::store::PublishedFacts> = st
            .events
            .values()
            .filter(|e| matches!(e.state, EventState::Published | EventState::Retained))
            .filter_map(|e| Some((e, e.slot.as_ref().filter(|s| s.envelope_generation == e.envelope.envelope_generation)?, e.published_at_ms?)))
            .filter(|(_, slot, at)| *at < published_before_ms && topics.contains(&slot.topic))
            .map(|(e, slot, at)| outbox_core::store::PublishedFacts {
                log: slot.log().to_log_id(),
                event_id: e.envelope.event_id.to_string(),
                state: e.state,
                published_at_ms: at,
                offset: slot.offset,
                position_epoch: e.slot_epoch,
                partition_replaced: st.partition_replaced(slot.log()),
                position_lost: st.position_lost(&e.envelope.event_id),
                sent_from_ms: st.sent_from(&e.envelope.event_id),
                log_id: slot.log_id.clone(),
            })
            .collect();
        v.sort_by_key(|p| p.published_at_ms);
        Ok(take(v, limit))
    }

    async fn consumer_watermarks(&self, consumer_id: &str, topics: &[String]) -> Result<Vec<outbox_core::store::ConsumerWatermark>, StoreError> {
        let st = self.lock();
        Ok(st.watermarks.iter().filter(|w| w.consumer_id == consumer_id && topics.contains(&w.log.topic)).map(|w| st.with_anchor_epoch(w)).collect())
    }

    async fn receipt_sweep_page(&self, limit: i64) -> Result<Vec<outbox_core::store::SweptEvent>, StoreError> {
        let mut st = self.lock();
        let after = st.receipt_sweep_after.clone();
        let mut all: Vec<outbox_core::store::SweptEvent> = st
            .events
            .iter()
            .filter(|(id, _)| id.as_str() > after.as_str())
            .map(|(id, e)| outbox_core::store::SweptEvent {
                event_id: id.to_string(),
                state: e.state,
                has_primary_receipt: e.slot.as_ref().is_some_and(|s| s.envelope_generation == e.envelope.envelope_generation),
                state_since_ms: e.state_since_ms,
            })
            .collect();
        all.sort_by(|a, b| a.event_id.cmp(&b.event_id));
        let page = take(all, limit);
        st.receipt_sweep_after = if i64::try_from(page.len()).unwrap_or(i64::MAX) >= limit { page.last().map(|e| e.event_id.clone()).unwrap_or_default() } else { String::new() };
        Ok(page)
    }

    async fn watermark_publishers(&self, _received_before_ms: i64, _limit: i64) -> Result<Vec<outbox_core::store::WatermarkPublisherFacts>, StoreError> {
        // The in-memory store has no broker watermark topic.
        Ok(Vec::new())
    }

    async fn record_round_findings(&self, _now_ms: i64, findings: &[outbox_core::store::RoundFinding]) -> Result<(), StoreError> {
        let mut st = self.lock();
        let seen: std::collections::BTreeSet<(String, String, String)> = findings.iter().map(|f| (f.kind.to_owned(), f.event_id.clone(), f.consumer_id.clone())).collect();
        for f in findings {
            st.findings.insert((f.kind.to_owned(), f.event_id.clone(), f.consumer_id.clone()), f.detail.clone());
        }
        // Opened first, then resolved as `round_resolves` says (as the SQL store does).
        st.findings.retain(|key, _| !outbox_core::findings::round_resolves(&key.0, seen.contains(key)));
        Ok(())
    }
}

impl super::MemoryState {
    /// Whether a receipt of the partition (cluster, topic, partition) was
    /// accepted at a position epoch above 0: its log was replaced at least
    /// once (`outbox_core::LogPosition::partition_replaced`).
    pub fn partition_replaced(&self, log: outbox_core::LogRef<'_>) -> bool {
        self.replaced_partitions().any(|replaced| replaced.same_name(&log))
    }

    /// The logs holding a receipt above position epoch 0 (each once per
    /// such receipt): their partitions' names (cluster, topic, partition)
    /// were replaced.
    pub fn replaced_partitions(&self) -> impl Iterator<Item = outbox_core::LogRef<'_>> {
        self.position_holders.iter().filter(|(_, (_, epoch))| *epoch > 0).map(|((log, _), _)| log.as_ref())
    }

    /// `w` as the decisions read it: the position epoch of its anchor's
    /// receipt at its last offset (`outbox_core::WatermarkAnchor`).
    pub fn with_anchor_epoch(&self, w: &outbox_core::store::ConsumerWatermark) -> outbox_core::store::ConsumerWatermark {
        let anchor = w.anchor_event_id.as_deref().and_then(|id| id.parse::<outbox_core::EventId>().ok()).and_then(|id| {
            let e = self.events.get(&id)?;
            let slot = e.slot.as_ref()?;
            let here = slot.log().same_name(&w.log.as_ref()) && slot.offset == w.committed_offset - 1;
            here.then_some((e.slot_epoch, e.published_at_ms))
        });
        outbox_core::store::ConsumerWatermark { anchor_epoch: anchor.map(|a| a.0), anchor_accepted_ms: anchor.and_then(|a| a.1), ..w.clone() }
    }

    /// When the message of `event_id`'s receipt was written at the earliest
    /// (`outbox_core::LogPosition::sent_from_ms`): the start of the attempt
    /// the receipt names (the message carries that attempt's id, made when
    /// it started), or the earliest start of any attempt of the event when
    /// the receipt names none of them.
    pub fn sent_from(&self, event_id: &outbox_core::EventId) -> Option<i64> {
        let attempts = self.attempts.get(event_id)?;
        let named = self.events.get(event_id).and_then(|e| e.slot.as_ref()).and_then(|s| attempts.iter().find(|a| a.attempt_id == s.attempt_id));
        named.map(|a| a.started_at_ms).or_else(|| attempts.iter().map(|a| a.started_at_ms).min())
    }

    /// Whether an open `receipt_position_lost` finding names `event_id`.
    pub fn position_lost(&self, event_id: &outbox_core::EventId) -> bool {
        self.findings.contains_key(&(outbox_core::compare::RECEIPT_POSITION_LOST.to_owned(), event_id.to_string(), String::new()))
    }
}
