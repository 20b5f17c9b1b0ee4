//! The stream path (`outbox_producer::DispatchPath::Stream`) under faults,
//! on real PostgreSQL and librdkafka's in-process cluster: a claim whose
//! answer never reached its dispatcher, and sends that stay in flight
//! longer than the lease. Each test injects the real fault.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{Broker, Destination, OutboxStore, EventId, LookupOutcome, OutgoingMessage, PartitionScan, ScanFrom, ScannedMessage, SendOutcome};
use outbox_producer::{until_true, DispatchPath, Dispatcher, DispatcherConfig, KafkaBroker, PgStore};
use outbox_tests::count;
use outbox_tests::dispatch::{config, each_once_in_log, emit_many, keys_in_commit_order, started};
use sqlx::PgPool;

/// The owner name worker `worker` of a dispatcher configured with `cfg`
/// claims under (`DispatcherConfig::owner`: `<name>-<worker>`).
fn worker_owner(cfg: &DispatcherConfig, worker: usize) -> String {
    format!("{}-{worker}", cfg.name)
}

/// Runs `dispatcher` until every event of `ids` is PUBLISHED or `within`
/// passes, then stops it; panics, with where the unpublished events
/// stand, when they did not all make it.
async fn run_until_published<B: Broker + 'static>(pool: &PgPool, dispatcher: Dispatcher<B, PgStore>, ids: &[String], within: Duration) {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let run = tokio::spawn(Arc::new(dispatcher).run(until_true(stop_rx)));
    let deadline = tokio::time::Instant::now() + within;
    let unpublished = loop {
        let unpublished: Vec<(String, String)> =
            sqlx::query_as("SELECT id, outbox_event_state(id) FROM unnest($1::text[]) AS t(id) WHERE outbox_event_state(id) <> 'PUBLISHED' ORDER BY id")
                .bind(ids)
                .fetch_all(pool)
                .await
                .unwrap();
        if unpublished.is_empty() || tokio::time::Instant::now() >= deadline {
            break unpublished;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    stop_tx.send(true).unwrap();
    run.await.unwrap().unwrap();
    if !unpublished.is_empty() {
        let leases: Vec<(i16, Option<String>, i64, Option<i64>)> =
            sqlx::query_as("SELECT bucket, owner, generation, open_batch FROM outbox_bucket_leases WHERE open_batch IS NOT NULL ORDER BY bucket").fetch_all(pool).await.unwrap();
        panic!(
            "{} of {} events not PUBLISHED within {within:?}: {unpublished:?}; buckets with an open batch (bucket, owner, generation, batch): {leases:?}",
            unpublished.len(),
            ids.len()
        );
    }
}

/// A claim on the stream commits but its answer is lost (the connection
/// dropped with the COMMIT's answer): its batches' events were handed out
/// to a dispatcher that never got them, so nobody registers or sends them.
/// The dispatcher that goes on claiming under the same owner name must not
/// keep those buckets' leases alive for ever: the leases run out, the
/// batches are taken over (their hand-outs go to the exception lane,
/// PENDING, as nothing of them was sent) and every event is published,
/// once, each key's events in their commit order.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_stream_claim_whose_answer_was_lost_does_not_wedge_its_buckets(pool: PgPool) {
    outbox_producer::set_dispatch_path(&pool, DispatchPath::Stream).await.unwrap();
    let (cluster, broker) = started(&pool, 5_000).await;
    let ids = emit_many(&pool, 8, 3).await;
    let cfg = DispatcherConfig { workers: 1, lease_ms: 1_500, ..config("d") };
    let owner = worker_owner(&cfg, 0);

    // The claim the live dispatcher's worker made, whose answer was lost:
    // committed (a batch per bucket holding events, each handed out), its
    // events never seen by the dispatcher.
    let lost = PgStore::new(pool.clone()).claim_next(&owner, &[], true, 100, cfg.lease_ms).await.unwrap();
    assert!(!lost.claimed.is_empty(), "the claim handed events out");
    // Kept only to try them once everything is published, as a dispatcher
    // that got the answer very late would.
    let late_tokens: Vec<_> = lost.claimed.iter().map(|c| c.token.clone()).collect();
    drop(lost);
    assert!(count(&pool, "SELECT count(*) FROM outbox_bucket_leases WHERE open_batch IS NOT NULL").await > 0);

    let d = Dispatcher::new(PgStore::new(pool.clone()), broker, cfg).unwrap();
    run_until_published(&pool, d, &ids, Duration::from_secs(20)).await;

    each_once_in_log(&cluster, &ids);
    assert_eq!(keys_in_commit_order(&pool, &cluster).await, 8);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_duplicate_receipts").await, 0);
    // The lost hand-outs were taken over as never sent: PENDING in the
    // lane, sent from there, not DISPATCH_UNKNOWN.
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_attempts WHERE state <> 'ACKED'").await, 0, "an attempt other than the one that published");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_bucket_leases WHERE open_batch IS NOT NULL").await, 0, "a batch still open");

    // The lost answer's tokens come too late: on the stream the takeover
    // closed their batch and raised the lease's generation; in the lane the
    // events were claimed again under a later generation and published. So
    // none of them registers an attempt (nothing could send one twice).
    let late = OutboxStore::register_attempts(&PgStore::new(pool.clone()), &late_tokens).await.unwrap();
    assert!(late.iter().all(Result::is_err), "a registration under the lost claim went through: {late:?}");
}

/// A broker whose every send waits `delay` before it goes to Kafka (the
/// trait's methods are called by path: `KafkaBroker` has inherent ones of
/// the same names).
struct SlowBroker {
    inner: Arc<KafkaBroker>,
    delay: Duration,
}

#[async_trait]
impl Broker for SlowBroker {
    fn cluster_id(&self) -> &str {
        Broker::cluster_id(&*self.inner)
    }

    async fn send(&self, message: OutgoingMessage) -> SendOutcome {
        tokio::time::sleep(self.delay).await;
        Broker::send(&*self.inner, message).await
    }

    fn supports_lookup(&self) -> bool {
        Broker::supports_lookup(&*self.inner)
    }

    fn max_in_flight_ms(&self) -> Option<u64> {
        Broker::max_in_flight_ms(&*self.inner).map(|ms| ms + self.delay.as_millis() as u64)
    }

    async fn lookup(&self, destination: &Destination, event_id: &EventId, from: &ScanFrom) -> LookupOutcome {
        Broker::lookup(&*self.inner, destination, event_id, from).await
    }

    async fn scan_event_ids(&self, topic: &str, partition: i32, from_offset: i64, max_messages: u64) -> Result<PartitionScan, String> {
        Broker::scan_event_ids(&*self.inner, topic, partition, from_offset, max_messages).await
    }

    async fn read_past_reported_end(&self, topic: &str, partition: i32, from_offset: i64, max_messages: u64) -> Result<Vec<ScannedMessage>, String> {
        Broker::read_past_reported_end(&*self.inner, topic, partition, from_offset, max_messages).await
    }

    async fn partition_count(&self, topic: &str) -> Result<Option<u32>, String> {
        Broker::partition_count(&*self.inner, topic).await
    }
}

/// Normal operation with sends slower than the lease: every batch stays in
/// flight longer than `lease_ms`, and a key's next batch waits for its
/// previous send's answer. The buckets being worked on stay alive (the
/// dispatcher renews the leases of its sends in flight, and a claim that
/// hands out renews the bucket's lease), so nothing is taken over and
/// nothing leaves the happy path.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn stream_sends_in_flight_longer_than_the_lease_keep_their_buckets(pool: PgPool) {
    outbox_producer::set_dispatch_path(&pool, DispatchPath::Stream).await.unwrap();
    let (cluster, broker) = started(&pool, 10_000).await;
    let ids = emit_many(&pool, 6, 3).await;
    // Renewals every second; a send takes longer than the whole lease.
    let cfg = DispatcherConfig { workers: 2, lease_ms: 2_000, ..config("d") };
    let slow = Arc::new(SlowBroker { inner: broker, delay: Duration::from_millis(2_500) });
    let d = Dispatcher::new(PgStore::new(pool.clone()), slow, cfg).unwrap();
    run_until_published(&pool, d, &ids, Duration::from_secs(60)).await;

    each_once_in_log(&cluster, &ids);
    assert_eq!(keys_in_commit_order(&pool, &cluster).await, 6);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 0, "an event left the happy path (a bucket was taken over)");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_publish_receipts WHERE batch_id IS NULL").await, 0);
}
