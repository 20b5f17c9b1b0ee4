//! The conformance [`Harness`] of the in-memory store.

use async_trait::async_trait;
use outbox_core::conformance::{Harness, PurgeCounts};
use outbox_core::{EmitRequest, EventId, MemoryStore, MemoryWatermark, RoutePolicy};

/// Runs `outbox_core::conformance` against a [`MemoryStore`].
#[derive(Debug, Clone)]
pub struct MemoryHarness {
    store: MemoryStore,
    policy: RoutePolicy,
}

impl MemoryHarness {
    /// A fresh store at a fixed time, routing `order.created` to `sim-cluster/orders` (4 partitions).
    pub fn new() -> Self {
        let store = MemoryStore::new();
        store.set_now_ms(1_700_000_000_000);
        MemoryHarness { store, policy: RoutePolicy::new("order.created", "sim-cluster", "orders", 4) }
    }
}

impl Default for MemoryHarness {
    fn default() -> Self {
        Self::new()
    }
}

#[async_trait]
impl Harness for MemoryHarness {
    type Store = MemoryStore;

    fn store(&self) -> &MemoryStore {
        &self.store
    }

    async fn emit(&self, command_key: &str, aggregate_id: &str, payload: &[u8]) -> EventId {
        let now = self.store.now_ms();
        let request = EmitRequest {
            command_key,
            tenant: "t1",
            aggregate_type: "order",
            aggregate_id,
            aggregate_version: 1,
            event_type: "order.created",
            payload_schema: "order-v1",
            payload,
        };
        request.validate(outbox_core::DEFAULT_MAX_PAYLOAD_BYTES).expect("valid emit request");
        let (envelope, destination) = request.freeze(EventId::generate(now as u64), now, 1, &self.policy).expect("policy resolves");
        self.store.insert(command_key, envelope, destination, payload.to_vec()).expect("insert")
    }

    async fn emit_command(&self, request: &EmitRequest<'_>) -> Result<EventId, outbox_core::CoreError> {
        let now = self.store.now_ms();
        request.validate(outbox_core::DEFAULT_MAX_PAYLOAD_BYTES)?;
        // Freezing needs a route only for the event type; a repeat of
        // another type is decided by the store before anything is inserted.
        let policy = RoutePolicy { event_type: request.event_type.to_owned(), ..self.policy.clone() };
        let (envelope, destination) = request.freeze(EventId::generate(now as u64), now, 1, &policy)?;
        self.store.insert(request.command_key, envelope, destination, request.payload.to_vec())
    }

    async fn commit_migration(
        &self,
        id: &EventId,
        to_topic: &str,
        fence: &outbox_core::MigrationFence,
        lookup: Option<&outbox_core::LookupOutcome>,
    ) -> Result<Result<u32, String>, String> {
        let old = self.store.lock().events.get(id).map(|e| e.envelope.clone()).ok_or_else(|| format!("no event {id}"))?;
        let route = RoutePolicy { topic: to_topic.to_owned(), ..self.policy.clone() };
        let destination = route.resolve(&old.tenant, &old.aggregate_type, &old.aggregate_id).map_err(|e| e.to_string())?;
        let r = self.store.commit_migration(id, destination, fence, lookup, &outbox_core::conformance::POLICY, "conformance", false).map_err(|e| e.to_string())?;
        Ok(r.map(|m| m.to_generation))
    }

    async fn purge(&self, replay_window_ms: i64, consumers: &[(&str, &[&str], bool)], watermarks: &[MemoryWatermark]) -> Result<PurgeCounts, String> {
        let mandatory: Vec<(String, Vec<String>)> =
            consumers.iter().filter(|c| c.2).map(|(id, topics, _)| ((*id).to_owned(), topics.iter().map(|t| (*t).to_owned()).collect())).collect();
        self.store.set_retention_registry(mandatory, watermarks.to_vec());
        // Pages of two, as the PostgreSQL harness: a pass pages past held events to later ones.
        let policy = outbox_producer::retention::RetentionPolicy { replay_window_ms, batch_size: 2, max_batches: 1_000 };
        let r = outbox_producer::retention::purge_with(&self.store, self.store.now_ms(), &policy, false, |_| {}).await;
        self.store.set_retention_registry(Vec::new(), Vec::new());
        let r = r.map_err(|e| e.to_string())?;
        Ok(PurgeCounts { retained: r.retained, purged: r.purged, held: r.held_by_consumers })
    }

    async fn payload(&self, id: &EventId) -> Option<Vec<u8>> {
        // A purge empties the bytes (PostgreSQL sets them NULL); payloads are never empty.
        self.store.lock().events.get(id).map(|e| e.payload.clone()).filter(|p| !p.is_empty())
    }

    async fn bypass_scan(&self, log: &outbox_core::conformance::ScanLog) -> Result<outbox_core::conformance::ScanOutcome, String> {
        use outbox_core::BypassScanStore;
        let config = outbox_producer::ReconcilerConfig {
            owner: "conformance-scan".into(),
            retry: outbox_core::conformance::POLICY,
            clock_skew_allowance_ms: 1_000,
            ..outbox_producer::ReconcilerConfig::default()
        };
        let r = outbox_producer::Reconciler::new(self.store.clone(), std::sync::Arc::new(log.clone()), config).map_err(|e| e.to_string())?;
        let report = r.scan_for_bypass().await.map_err(|e| e.to_string())?;
        let mut cursors = std::collections::BTreeMap::new();
        for p in log.partitions.keys() {
            cursors.insert(*p, self.store.bypass_cursor(&log.cluster_id, &log.topic, *p).await.map_err(|e| e.to_string())?.next_offset);
        }
        Ok(outbox_core::conformance::ScanOutcome { findings: report.findings.into_iter().map(|(k, e)| (k.to_owned(), e)).collect(), cursors, submitted: report.submitted })
    }

    async fn compare_findings(
        &self,
        thresholds: &outbox_core::conformance::FindingThresholds,
        consumers: &[(String, Vec<String>)],
        watermarks: &[outbox_core::ConsumerWatermark],
    ) -> Result<Vec<(String, String, String)>, String> {
        for (id, topics) in consumers {
            self.store.register_consumer(id, outbox_core::MemoryConsumer { critical: true, mandatory: false, topics: topics.clone() });
        }
        for w in watermarks {
            self.store.set_watermark(outbox_core::MemoryWatermark {
                consumer_id: w.consumer_id.clone(),
                cluster_id: w.cluster_id.clone(),
                topic: w.topic.clone(),
                topic_id: w.topic_id.clone(),
                partition: w.partition,
                committed_offset: w.committed_offset,
            });
        }
        let config = outbox_producer::ReconcilerConfig {
            owner: "conformance-findings".into(),
            retry: outbox_core::conformance::POLICY,
            clock_skew_allowance_ms: 1_000,
            aged_pending_ms: thresholds.aged_pending_ms,
            unknown_slo_ms: thresholds.unknown_slo_ms,
            unconsumed_after_ms: thresholds.unconsumed_after_ms,
            ..outbox_producer::ReconcilerConfig::default()
        };
        let broker = outbox_core::conformance::ScanLog { cluster_id: self.policy.cluster_id.clone(), ..Default::default() };
        let r = outbox_producer::Reconciler::new(self.store.clone(), std::sync::Arc::new(broker), config).map_err(|e| e.to_string())?;
        r.compare_findings().await.map_err(|e| e.to_string())?;
        Ok(self.store.lock().findings.keys().cloned().collect())
    }

    async fn tamper_payload(&self, id: &EventId, new_payload: &[u8]) {
        if let Some(row) = self.store.lock().events.get_mut(id) {
            row.payload = new_payload.to_vec();
        }
    }

    fn now_ms(&self) -> i64 {
        self.store.now_ms()
    }

    fn advance_ms(&self, ms: i64) {
        self.store.set_now_ms(self.store.now_ms() + ms);
    }
}
