//! The store conformance suite of `outbox_memory::conformance`, against the
//! PostgreSQL store (the in-memory store runs the same suite in outbox-sim).
//! The services the harness runs are run as for every store by
//! `outbox_producer::conformance`; what is here is what PostgreSQL does
//! differently.

use std::sync::Arc;

use async_trait::async_trait;
use outbox_core::{ConsumerWatermark, CoreError, EmitRequest, EventId, LookupOutcome, ManualClock, MigrationFence};
use outbox_memory::conformance::{FindingThresholds, Harness, PurgeCounts, ScanLog, ScanOutcome};
use outbox_memory::MemoryWatermark;
use outbox_producer::conformance;
use outbox_producer::retention::PgRetention;
use outbox_producer::{emit, register_consumer, EmitOptions, PgStore, ProducerError};
use sqlx::PgPool;

struct PgHarness {
    pool: PgPool,
    store: PgStore,
    clock: ManualClock,
    /// Events go the stream path (`outbox_producer::DispatchPath::Stream`).
    stream: bool,
}

#[async_trait]
impl Harness for PgHarness {
    type Store = PgStore;

    fn store(&self) -> &PgStore {
        &self.store
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
        let e = |what: &'static str| move |e: sqlx::Error| format!("{what}: {e}");
        for (id, topics, mandatory) in consumers {
            register_consumer(&self.pool, id, topics, false, *mandatory).await.map_err(|e| e.to_string())?;
        }
        for w in watermarks {
            self.set_watermark(w).await.map_err(e("watermark"))?;
        }
        let r = match PgRetention::new(self.pool.clone()).await {
            Ok(store) => conformance::purge(&store, self.now_ms(), replay_window_ms).await,
            Err(e) => Err(e.to_string()),
        };
        let ids: Vec<&str> = consumers.iter().map(|c| c.0).chain(watermarks.iter().map(|w| w.consumer_id.as_str())).collect();
        sqlx::query("DELETE FROM outbox_consumer_watermarks WHERE consumer_id = ANY($1)").bind(&ids).execute(&self.pool).await.map_err(e("cleanup"))?;
        sqlx::query("DELETE FROM outbox_consumers WHERE consumer_id = ANY($1)").bind(&ids).execute(&self.pool).await.map_err(e("cleanup"))?;
        r
    }

    async fn payload(&self, id: &EventId) -> Option<Vec<u8>> {
        // A stream event in the lane (retention moves it there) is the lane row's.
        sqlx::query_scalar(
            "SELECT CASE WHEN EXISTS (SELECT 1 FROM outbox_events WHERE event_id = $1) THEN (SELECT payload FROM outbox_events WHERE event_id = $1)
                         ELSE (SELECT payload FROM outbox_stream WHERE event_id = $1) END",
        )
            .bind(id.as_str())
            .fetch_one(&self.pool)
            .await
            .expect("payload")
    }

    async fn bypass_scan(&self, log: &ScanLog) -> Result<ScanOutcome, String> {
        conformance::bypass_scan(&self.store, log).await
    }

    async fn compare_findings(&self, thresholds: &FindingThresholds, consumers: &[(String, Vec<String>)], watermarks: &[ConsumerWatermark]) -> Result<Vec<(String, String, String)>, String> {
        for (id, topics) in consumers {
            let topics: Vec<&str> = topics.iter().map(String::as_str).collect();
            register_consumer(&self.pool, id, &topics, true, false).await.map_err(|e| e.to_string())?;
        }
        for w in watermarks {
            self.set_watermark(w).await.map_err(|e| e.to_string())?;
        }
        conformance::compare_findings(&self.store, thresholds).await?;
        sqlx::query_as("SELECT kind, event_id, consumer_id FROM outbox_findings WHERE resolved_at_ms IS NULL").fetch_all(&self.pool).await.map_err(|e| e.to_string())
    }

    async fn tamper_payload(&self, id: &EventId, new_payload: &[u8]) {
        sqlx::query("UPDATE outbox_events SET payload = $2 WHERE event_id = $1").bind(id.as_str()).bind(new_payload).execute(&self.pool).await.expect("tamper");
        if self.stream {
            // A stream row is never updated (its trigger refuses): the tamperer disables that first.
            sqlx::query("UPDATE outbox_stream SET payload = $2 WHERE event_id = $1").bind(id.as_str()).bind(new_payload).execute(&self.pool).await.expect("tamper");
        }
    }

    fn now_ms(&self) -> i64 {
        outbox_core::Clock::now_ms(&self.clock)
    }

    fn advance_ms(&self, ms: i64) {
        self.clock.advance(ms);
    }
}

impl PgHarness {
    /// Sets a consumer's watermark on its log, replacing the one it had
    /// there (as `MemoryStore::set_watermark`).
    async fn set_watermark(&self, w: &ConsumerWatermark) -> Result<(), sqlx::Error> {
        let log = "consumer_id = $1 AND cluster_id = $2 AND topic = $3 AND topic_id IS NOT DISTINCT FROM $4 AND partition = $5";
        sqlx::query(&format!("DELETE FROM outbox_consumer_watermarks WHERE {log}"))
            .bind(&w.consumer_id)
            .bind(&w.log.cluster_id)
            .bind(&w.log.topic)
            .bind(&w.log.topic_id)
            .bind(w.log.partition)
            .execute(&self.pool)
            .await?;
        sqlx::query("INSERT INTO outbox_consumer_watermarks (consumer_id, cluster_id, topic, topic_id, partition, committed_offset, anchor_recorded, anchor_event_id, log_id) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)")
            .bind(&w.consumer_id)
            .bind(&w.log.cluster_id)
            .bind(&w.log.topic)
            .bind(&w.log.topic_id)
            .bind(w.log.partition)
            .bind(w.committed_offset)
            .bind(w.anchor_recorded)
            .bind(&w.anchor_event_id)
            .bind(&w.log_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// `emit` stamps a new event with the database's clock; the suite's
    /// ages are on the harness's clock (the store's): the event is
    /// committed now on it.
    async fn committed_now(&self, id: &EventId) {
        let now = outbox_core::Clock::now_ms(&self.clock);
        for table in ["outbox_events", "outbox_stream"] {
            sqlx::query(&format!("UPDATE {table} SET created_at_ms = $2 WHERE event_id = $1"))
                .bind(id.as_str())
                .bind(now)
                .execute(&self.pool)
                .await
                .expect("commit time on the harness clock");
        }
    }
}

async fn harness(pool: PgPool) -> PgHarness {
    outbox_consumer::migrate(&pool).await.expect("consumer migrations (watermarks)");
    for route in outbox_memory::conformance::routes() {
        outbox_producer::routes::revise(&pool, &route).await.expect("route");
    }
    // Retention reads the consumers' watermarks.
    outbox_consumer::migrate(&pool).await.expect("consumer tables");
    let clock = ManualClock::new(1_800_000_000_000);
    PgHarness { store: PgStore::with_clock(pool.clone(), Arc::new(clock.clone())), pool, clock, stream: false }
}

/// The harness on a database whose events take the stream path. Its
/// test-only writes to stream rows (the commit time on the harness's
/// clock, a tampered payload) need the rows' freeze lifted.
async fn stream_harness(pool: PgPool) -> PgHarness {
    let mut h = harness(pool).await;
    outbox_producer::set_dispatch_path(&h.pool, outbox_producer::DispatchPath::Stream).await.expect("stream path");
    for p in ["outbox_stream_p0", "outbox_stream_p1", "outbox_stream_default"] {
        sqlx::query(&format!("ALTER TABLE {p} DISABLE TRIGGER outbox_stream_frozen")).execute(&h.pool).await.expect("test-only writes");
    }
    h.stream = true;
    h
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn postgres_store_in_stream_mode_passes_the_conformance_suite(pool: PgPool) {
    let h = stream_harness(pool).await;
    // A fixed run id (see `run_all_as`): `OUTBOX_CONFORMANCE_RUN` or the suite's own.
    let run = std::env::var("OUTBOX_CONFORMANCE_RUN").ok().and_then(|s| s.parse().ok()).unwrap_or(outbox_memory::conformance::STREAM_RUN);
    let results = outbox_memory::conformance::run_all_as(&h, run).await;
    let failed: Vec<String> = results.iter().filter_map(|(n, r)| r.as_ref().err().map(|e| format!("{n}: {e}"))).collect();
    assert!(failed.is_empty(), "conformance failures in stream mode:\n{}", failed.join("\n"));
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn postgres_store_passes_the_conformance_suite(pool: PgPool) {
    let h = harness(pool).await;
    let results = outbox_memory::conformance::run_all(&h).await;
    assert!(results.len() >= 10, "the suite has {} scenarios", results.len());
    let failed: Vec<String> = results.iter().filter_map(|(n, r)| r.as_ref().err().map(|e| format!("{n}: {e}"))).collect();
    assert!(failed.is_empty(), "conformance failures:\n{}", failed.join("\n"));
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_suite_can_run_twice_on_one_database(pool: PgPool) {
    let h = harness(pool).await;
    for _ in 0..2 {
        for (n, r) in outbox_memory::conformance::run_all(&h).await {
            assert!(r.is_ok(), "{n}: {r:?}");
        }
    }
}
