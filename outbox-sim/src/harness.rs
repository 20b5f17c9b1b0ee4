//! The conformance [`Harness`] of the in-memory store. The services it runs
//! (migration, retention, the reconciler's scan and comparison) are run as
//! for every store by `outbox_producer::conformance`; what is here is what
//! the in-memory store does differently.

use async_trait::async_trait;
use outbox_core::{ConsumerWatermark, CoreError, EmitRequest, EventId, LookupOutcome, MigrationFence, RoutePolicy};
use outbox_memory::conformance::{route, FindingThresholds, Harness, PurgeCounts, ScanLog, ScanOutcome, TOPIC};
use outbox_memory::{MemoryConsumer, MemoryStore, MemoryWatermark};
use outbox_producer::conformance;

/// Runs `outbox_memory::conformance` against a [`MemoryStore`].
#[derive(Debug, Clone)]
pub struct MemoryHarness {
    store: MemoryStore,
}

impl MemoryHarness {
    /// A fresh store at a fixed time, routing the suite's events by
    /// `route(TOPIC)` (`order.created` to `sim-cluster/orders`, 4 partitions).
    pub fn new() -> Self {
        let store = MemoryStore::new();
        store.set_now_ms(1_700_000_000_000);
        MemoryHarness { store }
    }

    /// As [`MemoryHarness::new`], over a store that runs the insert-only
    /// stream ([`MemoryStore::with_stream`]).
    pub fn stream() -> Self {
        let store = MemoryStore::new().with_stream();
        store.set_now_ms(1_700_000_000_000);
        MemoryHarness { store }
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

    async fn emit_command(&self, request: &EmitRequest<'_>) -> Result<EventId, CoreError> {
        let now = self.store.now_ms();
        request.validate(outbox_core::DEFAULT_MAX_PAYLOAD_BYTES)?;
        // Freezing needs a route only for the event type; a repeat of
        // another type is decided by the store before anything is inserted.
        let policy = outbox_memory::conformance::routes().into_iter().find(|r| r.event_type == request.event_type).unwrap_or_else(|| RoutePolicy { event_type: request.event_type.to_owned(), ..route(TOPIC) });
        let (envelope, destination) = request.freeze(EventId::generate(now as u64), now, 1, &policy)?;
        self.store.insert(request.command_key, envelope, destination, request.payload.to_vec())
    }

    async fn commit_migration(&self, id: &EventId, to_topic: &str, fence: &MigrationFence, lookup: Option<&LookupOutcome>) -> Result<Result<u32, String>, String> {
        conformance::commit_migration(&self.store, id, to_topic, fence, lookup).await
    }

    async fn skip_event(&self, id: &EventId, operator: &str, reason: &str) -> Result<Result<outbox_core::SkipRecord, String>, String> {
        conformance::skip_event(&self.store, id, operator, reason).await
    }

    async fn skip_records(&self, id: &EventId) -> Result<Vec<outbox_core::SkipRecord>, String> {
        conformance::skip_records(&self.store, id).await
    }

    async fn set_poison_policy(&self, rule: &outbox_core::PoisonRule) -> Result<(), String> {
        conformance::set_poison_policy(&self.store, rule).await
    }

    async fn release_poisoned(&self, limit: usize) -> Result<Vec<outbox_core::SkipRecord>, String> {
        conformance::release_poisoned(&self.store, limit).await
    }

    async fn purge(&self, replay_window_ms: i64, consumers: &[(&str, &[&str], bool)], watermarks: &[MemoryWatermark]) -> Result<PurgeCounts, String> {
        let mandatory: Vec<(String, Vec<String>)> =
            consumers.iter().filter(|c| c.2).map(|(id, topics, _)| ((*id).to_owned(), topics.iter().map(|t| (*t).to_owned()).collect())).collect();
        self.store.set_retention_registry(mandatory, watermarks.to_vec());
        let r = conformance::purge(&self.store, self.store.now_ms(), replay_window_ms).await;
        self.store.set_retention_registry(Vec::new(), Vec::new());
        r
    }

    async fn payload(&self, id: &EventId) -> Option<Vec<u8>> {
        // A purge empties the bytes (PostgreSQL sets them NULL); payloads are never empty.
        self.store.lock().events.get(id).map(|e| e.payload.clone()).filter(|p| !p.is_empty())
    }

    async fn bypass_scan(&self, log: &ScanLog) -> Result<ScanOutcome, String> {
        conformance::bypass_scan(&self.store, log).await
    }

    async fn compare_findings(&self, thresholds: &FindingThresholds, consumers: &[(String, Vec<String>)], watermarks: &[ConsumerWatermark]) -> Result<Vec<(String, String, String)>, String> {
        for (id, topics) in consumers {
            self.store.register_consumer(id, MemoryConsumer { critical: true, mandatory: false, topics: topics.clone() });
        }
        for w in watermarks {
            self.store.set_watermark(w.clone());
        }
        conformance::compare_findings(&self.store, thresholds).await?;
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
