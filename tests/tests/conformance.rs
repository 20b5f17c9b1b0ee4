//! The store conformance suite of `outbox_core::conformance`, against the
//! PostgreSQL store (the in-memory store runs the same suite in outbox-sim).

use std::sync::Arc;

use async_trait::async_trait;
use outbox_core::conformance::PurgeCounts;
use outbox_core::{CoreError, EmitRequest, EventId, ManualClock, MemoryWatermark};
use outbox_producer::migration::{MigrationOutcome, MigrationStore};
use outbox_producer::{emit, purge, register_consumer, EmitOptions, PgStore, ProducerError, RetentionPolicy};
use sqlx::PgPool;

struct PgHarness {
    pool: PgPool,
    store: PgStore,
    clock: ManualClock,
}

#[async_trait]
impl outbox_core::conformance::Harness for PgHarness {
    type Store = PgStore;

    fn store(&self) -> &PgStore {
        &self.store
    }

    async fn emit(&self, command_key: &str, aggregate_id: &str, payload: &[u8]) -> EventId {
        let mut tx = self.pool.begin().await.expect("begin");
        let req = EmitRequest {
            command_key,
            tenant: "conformance",
            aggregate_type: "order",
            aggregate_id,
            aggregate_version: 1,
            event_type: "order.created",
            payload_schema: "order-v1",
            payload,
        };
        let e = emit(&mut tx, &req, &EmitOptions::default()).await.expect("emit");
        tx.commit().await.expect("commit");
        if e.inserted {
            self.committed_now(&e.envelope.event_id).await;
        }
        e.envelope.event_id
    }

    async fn emit_command(&self, request: &EmitRequest<'_>) -> Result<EventId, CoreError> {
        let mut tx = self.pool.begin().await.expect("begin");
        match emit(&mut tx, request, &EmitOptions::default()).await {
            Ok(e) => {
                tx.commit().await.expect("commit");
                if e.inserted {
                    self.committed_now(&e.envelope.event_id).await;
                }
                Ok(e.envelope.event_id)
            }
            Err(ProducerError::CommandKeyConflict { command_key, event_id, what }) => Err(CoreError::CommandKeyConflict { command_key, event_id, what }),
            Err(ProducerError::AggregateVersionBackwards { aggregate, version, last }) => Err(CoreError::AggregateVersionBackwards { aggregate, version, last }),
            Err(e) => panic!("emit: {e}"),
        }
    }

    async fn commit_migration(
        &self,
        id: &EventId,
        to_topic: &str,
        fence: &outbox_core::MigrationFence,
        lookup: Option<&outbox_core::LookupOutcome>,
    ) -> Result<Result<u32, String>, String> {
        let route = outbox_core::RoutePolicy::new("order.created", "sim-cluster", to_topic, 4);
        match MigrationStore::commit_migration(&self.store, id, &route, "conformance", &outbox_core::conformance::POLICY, fence, lookup, false).await {
            Ok(MigrationOutcome::Migrated { to_generation, .. }) => Ok(Ok(to_generation)),
            Ok(MigrationOutcome::Refused { reason }) => Ok(Err(reason)),
            Ok(other) => Err(format!("not a dry run, yet {other:?}")),
            Err(e) => Err(e.to_string()),
        }
    }

    async fn purge(&self, replay_window_ms: i64, consumers: &[(&str, &[&str], bool)], watermarks: &[MemoryWatermark]) -> Result<PurgeCounts, String> {
        let e = |what: &'static str| move |e: sqlx::Error| format!("{what}: {e}");
        for (id, topics, mandatory) in consumers {
            register_consumer(&self.pool, id, topics, false, *mandatory).await.map_err(|e| e.to_string())?;
        }
        for w in watermarks {
            sqlx::query(
                "INSERT INTO outbox_consumer_watermarks (consumer_id, cluster_id, topic, topic_id, partition, committed_offset) VALUES ($1, $2, $3, $4, $5, $6)",
            )
            .bind(&w.consumer_id)
            .bind(&w.cluster_id)
            .bind(&w.topic)
            .bind(&w.topic_id)
            .bind(w.partition)
            .bind(w.committed_offset)
            .execute(&self.pool)
            .await
            .map_err(e("watermark"))?;
        }
        // Pages of two: a pass pages past held events to later ones.
        let policy = RetentionPolicy { replay_window_ms, batch_size: 2, max_batches: 1_000 };
        let r = purge(&self.pool, self.now_ms(), &policy, false, |_| {}).await.map_err(|e| e.to_string());
        let ids: Vec<&str> = consumers.iter().map(|c| c.0).chain(watermarks.iter().map(|w| w.consumer_id.as_str())).collect();
        sqlx::query("DELETE FROM outbox_consumer_watermarks WHERE consumer_id = ANY($1)").bind(&ids).execute(&self.pool).await.map_err(e("cleanup"))?;
        sqlx::query("DELETE FROM outbox_consumers WHERE consumer_id = ANY($1)").bind(&ids).execute(&self.pool).await.map_err(e("cleanup"))?;
        let r = r?;
        Ok(PurgeCounts { retained: r.retained, purged: r.purged, held: r.held_by_consumers })
    }

    async fn payload(&self, id: &EventId) -> Option<Vec<u8>> {
        sqlx::query_scalar("SELECT payload FROM outbox_events WHERE event_id = $1").bind(id.as_str()).fetch_one(&self.pool).await.expect("payload")
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
            let topics: Vec<&str> = topics.iter().map(String::as_str).collect();
            outbox_producer::register_consumer(&self.pool, id, &topics, true, false).await.map_err(|e| e.to_string())?;
        }
        for w in watermarks {
            let log = "consumer_id = $1 AND cluster_id = $2 AND topic = $3 AND topic_id IS NOT DISTINCT FROM $4 AND partition = $5";
            sqlx::query(&format!("DELETE FROM outbox_consumer_watermarks WHERE {log}"))
                .bind(&w.consumer_id)
                .bind(&w.cluster_id)
                .bind(&w.topic)
                .bind(&w.topic_id)
                .bind(w.partition)
                .execute(&self.pool)
                .await
                .map_err(|e| e.to_string())?;
            sqlx::query("INSERT INTO outbox_consumer_watermarks (consumer_id, cluster_id, topic, topic_id, partition, committed_offset) VALUES ($1, $2, $3, $4, $5, $6)")
                .bind(&w.consumer_id)
                .bind(&w.cluster_id)
                .bind(&w.topic)
                .bind(&w.topic_id)
                .bind(w.partition)
                .bind(w.committed_offset)
                .execute(&self.pool)
                .await
                .map_err(|e| e.to_string())?;
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
        let broker = outbox_core::conformance::ScanLog { cluster_id: "sim-cluster".into(), ..Default::default() };
        let r = outbox_producer::Reconciler::new(self.store.clone(), Arc::new(broker), config).map_err(|e| e.to_string())?;
        r.compare_findings().await.map_err(|e| e.to_string())?;
        sqlx::query_as("SELECT kind, event_id, consumer_id FROM outbox_findings WHERE resolved_at_ms IS NULL").fetch_all(&self.pool).await.map_err(|e| e.to_string())
    }

    async fn tamper_payload(&self, id: &EventId, new_payload: &[u8]) {
        sqlx::query("UPDATE outbox_events SET payload = $2 WHERE event_id = $1").bind(id.as_str()).bind(new_payload).execute(&self.pool).await.expect("tamper");
    }

    fn now_ms(&self) -> i64 {
        outbox_core::Clock::now_ms(&self.clock)
    }

    fn advance_ms(&self, ms: i64) {
        self.clock.advance(ms);
    }
}

impl PgHarness {
    /// `emit` stamps a new event with the database's clock; the suite's
    /// ages are on the harness's clock (the store's): the event is
    /// committed now on it.
    async fn committed_now(&self, id: &EventId) {
        let now = outbox_core::Clock::now_ms(&self.clock);
        sqlx::query("UPDATE outbox_events SET created_at_ms = $2 WHERE event_id = $1")
            .bind(id.as_str())
            .bind(now)
            .execute(&self.pool)
            .await
            .expect("commit time on the harness clock");
    }
}

async fn harness(pool: PgPool) -> PgHarness {
    outbox_consumer::migrate(&pool).await.expect("consumer migrations (watermarks)");
    outbox_producer::routes::revise(&pool, &outbox_core::RoutePolicy::new("order.created", "sim-cluster", "orders", 4)).await.expect("route");
    // Retention reads the consumers' watermarks.
    outbox_consumer::migrate(&pool).await.expect("consumer tables");
    let clock = ManualClock::new(1_800_000_000_000);
    PgHarness { store: PgStore::with_clock(pool.clone(), Arc::new(clock.clone())), pool, clock }
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn postgres_store_passes_the_conformance_suite(pool: PgPool) {
    let h = harness(pool).await;
    let results = outbox_core::conformance::run_all(&h).await;
    assert!(results.len() >= 10, "the suite has {} scenarios", results.len());
    let failed: Vec<String> = results.iter().filter_map(|(n, r)| r.as_ref().err().map(|e| format!("{n}: {e}"))).collect();
    assert!(failed.is_empty(), "conformance failures:\n{}", failed.join("\n"));
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_suite_can_run_twice_on_one_database(pool: PgPool) {
    let h = harness(pool).await;
    for _ in 0..2 {
        for (n, r) in outbox_core::conformance::run_all(&h).await {
            assert!(r.is_ok(), "{n}: {r:?}");
        }
    }
}
