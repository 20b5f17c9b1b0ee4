//! The reconciler's bypass scan over the in-memory records
//! ([`BypassScanStore`](outbox_core::BypassScanStore)).

use std::collections::BTreeMap;

use async_trait::async_trait;

use outbox_core::id::EventId;
use outbox_core::receipt::{AttemptRecord, BrokerReceipt};
use outbox_core::state::AttemptState;
use outbox_core::store::StoreError;

use super::MemoryStore;

/// The bypass scan's reads and write over the in-memory records (as
/// `PgStore`'s over its tables).
#[async_trait]
impl outbox_core::store::BypassScanStore for MemoryStore {
    async fn routed_topics(&self, cluster_id: &str) -> Result<Vec<(String, i32)>, StoreError> {
        Ok(self.lock().routes.iter().filter(|((c, _), _)| c == cluster_id).map(|((_, t), n)| (t.clone(), *n)).collect())
    }

    async fn routes_to(&self, cluster_id: &str, topic: &str) -> Result<Vec<(String, i32)>, StoreError> {
        // Routes are kept per topic here, not per event type.
        Ok(self.lock().routes.get(&(cluster_id.to_owned(), topic.to_owned())).map(|n| vec![("every event type".to_owned(), *n)]).unwrap_or_default())
    }

    async fn source_identity(&self) -> Result<Option<String>, StoreError> {
        // The in-memory store has no source identity (its messages carry no `outbox-source`).
        Ok(None)
    }

    async fn bypass_cursor(&self, cluster_id: &str, topic: &str, partition: i32) -> Result<outbox_core::store::BypassCursor, StoreError> {
        Ok(self.lock().bypass_cursors.get(&(cluster_id.to_owned(), topic.to_owned(), partition)).cloned().unwrap_or_default())
    }

    async fn committed_event_ids(&self, event_ids: &[String]) -> Result<std::collections::BTreeSet<String>, StoreError> {
        let st = self.lock();
        Ok(event_ids.iter().filter(|id| id.parse::<EventId>().is_ok_and(|id| st.events.contains_key(&id))).cloned().collect())
    }

    async fn receipts_at(&self, cluster_id: &str, topic: &str, partition: i32, offsets: &[i64]) -> Result<Vec<outbox_core::compare::RecordedReceipt>, StoreError> {
        let st = self.lock();
        let at = |r: &BrokerReceipt| r.cluster_id == cluster_id && r.topic == topic && r.partition == partition && offsets.contains(&r.offset);
        let recorded = |r: &BrokerReceipt, primary: bool| outbox_core::compare::RecordedReceipt { event_id: r.event_id.to_string(), topic_id: r.topic_id.clone(), offset: r.offset, primary };
        let primaries = st.events.values().filter_map(|e| e.slot.as_ref()).filter(|r| at(r)).map(|r| recorded(r, true));
        Ok(primaries.chain(st.duplicates.iter().filter(|r| at(r)).map(|r| recorded(r, false))).collect())
    }

    async fn published_digests(&self, event_ids: &[String]) -> Result<BTreeMap<String, outbox_core::compare::PublishedCopy>, StoreError> {
        let st = self.lock();
        Ok(event_ids
            .iter()
            .filter_map(|id| st.events.get(&id.parse::<EventId>().ok()?))
            .filter(|e| e.slot.as_ref().is_some_and(|s| s.envelope_generation == e.envelope.envelope_generation))
            .map(|e| (e.envelope.event_id.to_string(), outbox_core::compare::PublishedCopy { payload_digest: e.envelope.payload_digest.clone(), routing_key: e.destination.routing_key.clone() }))
            .collect())
    }

    async fn unanswered_attempts_of(&self, event_ids: &[String]) -> Result<Vec<AttemptRecord>, StoreError> {
        let st = self.lock();
        Ok(event_ids
            .iter()
            .filter_map(|id| st.attempts.get(&id.parse::<EventId>().ok()?))
            .flatten()
            .filter(|a| a.state != AttemptState::Acked)
            .cloned()
            .collect())
    }

    async fn receipts_from(
        &self,
        cluster_id: &str,
        topic: &str,
        partition: i32,
        from_offset: i64,
        accepted_before_ms: i64,
        limit: i64,
    ) -> Result<Vec<outbox_core::compare::RecordedReceipt>, StoreError> {
        let st = self.lock();
        let mut out: Vec<outbox_core::compare::RecordedReceipt> = st
            .events
            .values()
            .filter_map(|e| e.slot.as_ref().filter(|r| r.offset >= from_offset && r.partition == partition && r.topic == topic && r.cluster_id == cluster_id).map(|r| (e, r)))
            .filter(|(e, _)| e.published_at_ms.is_some_and(|at| at < accepted_before_ms))
            .map(|(_, r)| r)
            .filter(|r| !st.findings.contains_key(&(outbox_core::compare::RECEIPT_POSITION_LOST.to_owned(), r.event_id.to_string(), String::new())))
            .map(|r| outbox_core::compare::RecordedReceipt { event_id: r.event_id.to_string(), topic_id: r.topic_id.clone(), offset: r.offset, primary: true })
            .collect();
        out.sort_by_key(|r| r.offset);
        out.truncate(usize::try_from(limit.max(0)).unwrap_or(usize::MAX));
        Ok(out)
    }

    async fn record_bypass_scan(&self, write: &outbox_core::store::BypassScanWrite) -> Result<(), StoreError> {
        let mut st = self.lock();
        let (cluster, topic, partition) = (write.cluster_id.clone(), write.topic.clone(), write.partition);
        for m in &write.bypass_messages {
            st.bypass_messages.entry((cluster.clone(), topic.clone(), partition, m.offset)).or_insert_with(|| (m.clone(), write.now_ms));
        }
        for f in &write.findings {
            st.findings.insert((f.kind.to_owned(), f.event_id.clone(), String::new()), f.detail.clone());
        }
        let cursor = st.bypass_cursors.entry((cluster, topic, partition)).or_default();
        match write.cursor {
            outbox_core::compare::CursorMove::Advance(to) if to > cursor.next_offset => {
                *cursor = outbox_core::store::BypassCursor { next_offset: to, anchor: write.anchor.clone() };
            }
            outbox_core::compare::CursorMove::Advance(_) => {}
            outbox_core::compare::CursorMove::Restart => *cursor = outbox_core::store::BypassCursor::default(),
        }
        Ok(())
    }
}
