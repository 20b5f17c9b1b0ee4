//! Sound absence proofs and acceptance: stalls, late ACKs of attempts proven
//! absent, stray messages, unreadable destinations, unfenced migrations,
//! truncated or recreated logs, receipts losing their positions, PUBLISHED
//! without a receipt, and the per-key order. Real PostgreSQL and librdkafka's
//! in-process Kafka cluster; each test is named after the defect it covers.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{headers, AttemptState, Broker, ClaimedEvent, EventState, ManualClock, OutboxStore, RetryPolicy, SendOutcome};
use outbox_producer::dispatcher::outgoing_message;
use outbox_producer::kafka::KafkaBroker;
use outbox_producer::{Dispatcher, DispatcherConfig, PgStore, Reconciler, ReconcilerConfig};
use outbox_tests::kafka::{read_topic, TestCluster};
use outbox_tests::*;
use sqlx::PgPool;

const TOPIC: &str = "orders";
const PARTITIONS: i32 = 3;

struct Fixture {
    pool: PgPool,
    cluster: TestCluster,
    broker: Arc<KafkaBroker>,
    clock: ManualClock,
    store: PgStore,
}

async fn fixture(pool: PgPool) -> Fixture {
    let Stack { pool, cluster, broker, clock, store } = stack(pool, TOPIC, PARTITIONS, |cfg| cfg.extra.push(("reconnect.backoff.max.ms".into(), "500".into()))).await;
    Fixture { pool, cluster, broker, clock, store }
}

const BOUND_MS: i64 = 30_000;

impl Fixture {
    fn reconciler(&self) -> Reconciler<KafkaBroker> {
        let cfg = ReconcilerConfig { owner: "r".into(), retry: RetryPolicy { in_flight_bound_ms: BOUND_MS, ..RetryPolicy::default() }, ..Default::default() };
        Reconciler::new(self.store.clone(), self.broker.clone(), cfg).unwrap()
    }

    fn dispatcher(&self, store: &PgStore, lease_ms: i64) -> Dispatcher<KafkaBroker> {
        let cfg = DispatcherConfig { name: "d".into(), lease_ms, ..Default::default() };
        Dispatcher::new(store.clone(), self.broker.clone(), cfg).unwrap()
    }

    /// Emits order `order`, claims it with `lease_ms` and registers an
    /// attempt, nothing sent yet.
    async fn registered(&self, order: &str, lease_ms: i64) -> (ClaimedEvent, outbox_core::AttemptRecord) {
        let e = create_order(&self.pool, order, 1).await;
        let claimed = self.store.claim_batch("w", 10, lease_ms).await.unwrap();
        let mine = claimed.into_iter().find(|c| &c.envelope.event_id == e.event_id()).unwrap();
        let a = self.store.register_attempt(&mine.token).await.unwrap();
        (mine, a)
    }

    /// The attempt's genuine message, sent now: its receipt.
    async fn send_late(&self, ev: &ClaimedEvent, a: &outbox_core::AttemptRecord) -> outbox_core::BrokerReceipt {
        let SendOutcome::Acked { partition, offset } = self.broker.send(outgoing_message(ev, a)).await else { panic!("send failed") };
        self.receipt(ev, a, partition, offset)
    }

    /// The attempt's receipt at `partition`@`offset` of this cluster's topic.
    fn receipt(&self, ev: &ClaimedEvent, a: &outbox_core::AttemptRecord, partition: i32, offset: i64) -> outbox_core::BrokerReceipt {
        outbox_core::BrokerReceipt {
            event_id: ev.envelope.event_id.clone(),
            envelope_generation: ev.envelope.envelope_generation,
            attempt_id: a.attempt_id.clone(),
            payload_digest: ev.envelope.payload_digest.clone(),
            destination_digest: ev.destination_digest.clone(),
            cluster_id: self.broker.cluster_id().to_owned(),
            topic: TOPIC.into(),
            topic_id: ev.destination.topic_id.clone(),
            partition,
            offset,
        }
    }

    async fn state(&self, id: &str) -> EventState {
        EventState::parse(&sqlx::query_scalar::<_, String>("SELECT state FROM outbox_events WHERE event_id = $1").bind(id).fetch_one(&self.pool).await.unwrap())
            .unwrap()
    }

    async fn count(&self, sql: &str) -> i64 {
        count(&self.pool, sql).await
    }

    /// The offset of `id`'s primary receipt.
    async fn receipt_offset(&self, id: &str) -> i64 {
        sqlx::query_scalar("SELECT \"offset\" FROM outbox_publish_receipts WHERE event_id = $1").bind(id).fetch_one(&self.pool).await.unwrap()
    }

    fn log_of(&self, id: &str) -> usize {
        read_topic(&self.cluster.bootstrap, TOPIC, PARTITIONS).iter().filter(|m| m.header(headers::EVENT_ID).as_deref() == Some(id)).count()
    }

    async fn findings(&self, kind: &str, id: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM outbox_findings WHERE kind = $1 AND event_id = $2 AND resolved_at_ms IS NULL")
            .bind(kind)
            .bind(id)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

// ---------------------------------------------------------------- item 1

/// Issue 19 item 1: the registration's answer comes back after the lease
/// (here: it waits on a lock for longer than the lease). The send must not
/// start: the attempt is NOT_SENT and nothing is in the log.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item1_no_send_after_the_lease_when_the_registration_answer_comes_late(pool: PgPool) {
    let f = fixture(pool).await;
    let e = create_order(&f.pool, "o-1", 1).await;
    let id = e.event_id().as_str().to_owned();
    // A store on the real clock: the stall is real time.
    let store = PgStore::new(f.pool.clone());
    let d = Arc::new(f.dispatcher(&store, 1_000));
    let mut blocker = f.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE outbox_attempts IN SHARE MODE").execute(&mut *blocker).await.unwrap();
    let task = {
        let d = d.clone();
        tokio::spawn(async move {
            let batch = d.claim_and_send("w").await.unwrap();
            d.settle(batch).await.unwrap()
        })
    };
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    blocker.commit().await.unwrap();
    let report = tokio::time::timeout(Duration::from_secs(30), task).await.unwrap().unwrap();
    assert_eq!(report.claimed, 1, "{report:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(f.log_of(&id), 0, "a message was handed to the client after its lease had run out ({report:?})");
    let state: String = sqlx::query_scalar("SELECT state FROM outbox_attempts WHERE event_id = $1").bind(&id).fetch_one(&f.pool).await.unwrap();
    assert_eq!(state, "NOT_SENT");
}

/// Issue 19 item 1: an attempt may be handed to the client until its lease
/// ends and then sit there for the adapter's longest in-flight time: the
/// in-flight bound counts from the later of registration and lease end.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item1_in_flight_bound_counts_from_the_end_of_the_lease(pool: PgPool) {
    let f = fixture(pool).await;
    let (ev, _a) = f.registered("o-1", 30_000).await;
    let id = ev.envelope.event_id.as_str().to_owned();
    f.clock.advance(30_001);
    assert_eq!(f.store.expire_leases().await.unwrap().unknown, 1);
    // Past the bound from registration, within it from the lease's end.
    f.clock.advance(15_000);
    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!((r.retried, r.rechecks), (0, 1), "an attempt that could still be sent until {} ms ago was proven absent: {r:?}", 15_000);
    assert_eq!(f.state(&id).await, EventState::DispatchUnknown);
    f.clock.advance(BOUND_MS);
    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!(r.retried, 1, "{r:?}");
}

/// Issue 19 item 1: the registration time is measured with the database's
/// clock. A dispatcher host whose clock is ten minutes behind registers an
/// attempt; a reconciler on a correct clock must not take it for old.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item1_in_flight_is_measured_with_the_database_clock(pool: PgPool) {
    let f = fixture(pool).await;
    let real: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint").fetch_one(&f.pool).await.unwrap();
    let behind = ManualClock::new(real - 600_000);
    let skewed = PgStore::with_clock(f.pool.clone(), Arc::new(behind.clone()));
    create_order(&f.pool, "o-1", 1).await;
    let claimed = skewed.claim_batch("w", 10, 1_000).await.unwrap();
    let a = skewed.register_attempt(&claimed[0].token).await.unwrap();
    skewed.report_unknown(&claimed[0].token, &a.attempt_id, "timed out").await.unwrap();
    let cfg = ReconcilerConfig { owner: "r".into(), retry: RetryPolicy { in_flight_bound_ms: BOUND_MS, ..RetryPolicy::default() }, ..Default::default() };
    let rec = Reconciler::new(PgStore::new(f.pool.clone()), f.broker.clone(), cfg).unwrap();
    let r = rec.resolve_unknown_once().await.unwrap();
    assert_eq!((r.examined, r.retried, r.rechecks), (1, 0, 1), "an attempt registered a moment ago was taken for settled: {r:?}");
}

/// Issue 19 item 1: a bound that does not cover the adapter's in-flight time
/// plus a clock skew allowance is refused.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item1_a_bound_without_a_skew_allowance_is_refused(pool: PgPool) {
    let f = fixture(pool).await;
    let max = f.broker.max_in_flight_ms().unwrap() as i64;
    let cfg = ReconcilerConfig { retry: RetryPolicy { in_flight_bound_ms: max, ..RetryPolicy::default() }, ..Default::default() };
    let err = Reconciler::new(f.store.clone(), f.broker.clone(), cfg).expect_err("a bound equal to the client's time leaves no room for clock skew");
    assert!(err.to_string().contains("skew"), "{err}");
}

// ---------------------------------------------------------------- item 2

/// Issue 19 item 2: A1 was proven absent (its message had not landed yet),
/// then its genuine ACK arrives: it fills the empty slot, and the refuted
/// proof is a finding.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item2_late_ack_of_an_absent_attempt_fills_the_slot_and_is_a_finding(pool: PgPool) {
    let f = fixture(pool).await;
    let (ev, a1) = f.registered("o-1", 1_000).await;
    let id = ev.envelope.event_id.as_str().to_owned();
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    f.clock.advance(BOUND_MS + 1);
    assert_eq!(f.reconciler().resolve_unknown_once().await.unwrap().retried, 1);
    assert_eq!(f.store.attempts(&ev.envelope.event_id).await.unwrap()[0].state, AttemptState::Absent);
    let r = f.send_late(&ev, &a1).await;
    let out = f.store.accept_dispatch_receipt(&r).await.unwrap();
    assert!(out.decision.is_primary(), "the genuine ACK of an attempt proven absent was thrown away: {out:?}");
    assert_eq!(f.state(&id).await, EventState::Published);
    assert_eq!(f.findings("absence_proof_refuted", &id).await, 1);
    // The retry claim finds nothing to send any more.
    assert_eq!(f.dispatcher(&f.store, 1_000).dispatch_once("w2").await.unwrap().sent, 0);
    assert_eq!(f.log_of(&id), 1);
}

/// Issue 19 item 2: the retry A2 published first; A1's genuine late ACK is
/// kept as a duplicate transport receipt (and a finding), not dropped.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item2_late_ack_of_an_absent_attempt_after_the_retry_is_a_duplicate_receipt(pool: PgPool) {
    let f = fixture(pool).await;
    let (ev, a1) = f.registered("o-1", 1_000).await;
    let id = ev.envelope.event_id.as_str().to_owned();
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    f.clock.advance(BOUND_MS + 1);
    assert_eq!(f.reconciler().resolve_unknown_once().await.unwrap().retried, 1);
    assert_eq!(f.dispatcher(&f.store, 1_000).dispatch_once("w2").await.unwrap().published, 1);
    let r = f.send_late(&ev, &a1).await;
    let out = f.store.accept_dispatch_receipt(&r).await.unwrap();
    assert_eq!(out.decision, outbox_core::ReceiptDecision::Duplicate, "{out:?}");
    assert_eq!(f.count("SELECT count(*) FROM outbox_duplicate_receipts").await, 1);
    assert_eq!(f.findings("absence_proof_refuted", &id).await, 1);
}

/// Issue 19 item 2: the reconciler finds A1's message (A1 proven absent
/// earlier) while A2 is UNKNOWN: the message converges instead of the event
/// looping recheck -> UNKNOWN -> refused.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item2_reconciler_finding_a_message_of_an_absent_attempt_publishes(pool: PgPool) {
    let f = fixture(pool).await;
    let (ev, a1) = f.registered("o-1", 1_000).await;
    let id = ev.envelope.event_id.as_str().to_owned();
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    f.clock.advance(BOUND_MS + 1);
    assert_eq!(f.reconciler().resolve_unknown_once().await.unwrap().retried, 1);
    // A2 registered and lost; A1's message lands meanwhile.
    let retry = f.store.claim_retries("w2", 10, 1_000).await.unwrap();
    f.store.register_attempt(&retry[0].token).await.unwrap();
    f.send_late(&ev, &a1).await;
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    f.clock.advance(BOUND_MS + 1);
    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!(r.published, 1, "{r:?}");
    assert_eq!(f.state(&id).await, EventState::Published);
    assert_eq!(f.findings("absence_proof_refuted", &id).await, 1);
    assert_eq!(f.log_of(&id), 1);
}

// ---------------------------------------------------------------- item 9

/// Issue 19 item 9: a mirror or replay tool copies only the eventId header.
/// Its message is evidence (a finding), not a reason to quarantine the
/// event; when nothing else was found, the absence logic goes on.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item9_stray_message_with_the_event_id_does_not_quarantine_the_event(pool: PgPool) {
    let f = fixture(pool).await;
    let (ev, _a1) = f.registered("o-1", 1_000).await;
    let id = ev.envelope.event_id.as_str().to_owned();
    let stray = outbox_core::OutgoingMessage {
        topic: TOPIC.into(),
        partition: ev.destination.partition,
        key: ev.destination.routing_key.as_bytes().to_vec(),
        payload: b"mirrored copy".to_vec(),
        headers: vec![(headers::EVENT_ID.to_owned(), id.as_bytes().to_vec()), (headers::ENVELOPE_GENERATION.to_owned(), b"1".to_vec())],
    };
    assert!(matches!(f.broker.send(stray).await, SendOutcome::Acked { .. }));
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    f.clock.advance(BOUND_MS + 1);
    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!(r.quarantined, 0, "{r:?}");
    assert_ne!(f.state(&id).await, EventState::Quarantined);
    assert_eq!(r.retried, 1, "no message of a registered attempt was found: the absence logic decides: {r:?}");
    assert_eq!(f.findings("unregistered_message", &id).await, 1);
    assert_eq!(f.count("SELECT count(*) FROM outbox_quarantine").await, 0);
}

// ---------------------------------------------------------------- item 7

/// Runs `sql` (with `$1` the event id) with the database's triggers off, as
/// someone with direct access to the tables could: the tampering the
/// dispatcher must catch before it sends.
async fn tamper(pool: &PgPool, sql: &str, id: &str, bytes: Option<Vec<u8>>) {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL session_replication_role = replica").execute(&mut *tx).await.unwrap();
    let q = sqlx::query(sql).bind(id);
    let q = match bytes {
        Some(b) => q.bind(b),
        None => q,
    };
    assert_eq!(q.execute(&mut *tx).await.unwrap().rows_affected(), 1, "{sql}");
    tx.commit().await.unwrap();
}

/// Issue 19 item 7: the payload and the envelope's payloadDigest are
/// rewritten together; the event row's immutable digest still names the
/// original bytes. The dispatcher must catch it before the send.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item7_payload_and_envelope_digest_rewritten_together_are_quarantined_before_the_send(pool: PgPool) {
    let f = fixture(pool).await;
    let e = create_order(&f.pool, "o-1", 1).await;
    let id = e.event_id().as_str().to_owned();
    let canonical: Vec<u8> = sqlx::query_scalar("SELECT envelope_canonical FROM outbox_envelopes WHERE event_id = $1").bind(&id).fetch_one(&f.pool).await.unwrap();
    let mut envelope = outbox_core::Envelope::from_canonical(&canonical).unwrap();
    let evil = b"{\"order\":\"o-1\",\"totalCents\":100000}".to_vec();
    envelope.payload_digest = outbox_core::sha256_digest(&evil);
    tamper(&f.pool, "UPDATE outbox_events SET payload = $2 WHERE event_id = $1", &id, Some(evil)).await;
    tamper(&f.pool, "UPDATE outbox_envelopes SET envelope_canonical = $2 WHERE event_id = $1", &id, Some(envelope.canonical_bytes())).await;
    let report = f.dispatcher(&f.store, 1_000).dispatch_once("w").await.unwrap();
    assert_eq!((report.sent, report.quarantined), (0, 1), "{report:?}");
    assert_eq!(f.log_of(&id), 0, "the rewritten payload was sent");
    assert_eq!(f.state(&id).await, EventState::Quarantined);
}

/// Issue 19 item 7: one event's frozen destination cannot be read. That
/// event is quarantined; every other event of the batch is sent.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item7_one_unreadable_destination_quarantines_that_event_only(pool: PgPool) {
    let f = fixture(pool).await;
    let bad = create_order(&f.pool, "o-bad", 1).await;
    let good = create_order(&f.pool, "o-good", 1).await;
    tamper(&f.pool, "UPDATE outbox_envelopes SET destination_canonical = $2 WHERE event_id = $1", bad.event_id().as_str(), Some(b"not a destination".to_vec())).await;
    let d = f.dispatcher(&f.store, 1_000);
    let report = d.dispatch_once("w").await.expect("one unreadable destination failed the whole claim");
    assert_eq!((report.published, report.quarantined), (1, 1), "{report:?}");
    assert_eq!(f.state(good.event_id().as_str()).await, EventState::Published);
    assert_eq!(f.state(bad.event_id().as_str()).await, EventState::Quarantined);
    let reason: String = sqlx::query_scalar("SELECT reason FROM outbox_quarantine WHERE event_id = $1").bind(bad.event_id().as_str()).fetch_one(&f.pool).await.unwrap();
    assert_eq!(reason, "frozen_record_unreadable");
    // Nothing is left for a second round to fail on.
    assert_eq!(d.dispatch_once("w").await.unwrap().claimed, 0);
}

// ---------------------------------------------------------------- item 5

/// Issue 19 item 5: the migration reads the event PENDING (never sent) and
/// stalls before its commit; meanwhile a dispatcher claims and sends A1,
/// the ACK is lost, and a reconciler holds the event RECONCILING. The
/// migration's commit must not move the event: its proof (never sent) no
/// longer holds.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item5_migration_commit_is_fenced_on_what_its_proof_read(pool: PgPool) {
    let f = fixture(pool).await;
    let e = create_order(&f.pool, "o-1", 1).await;
    let id = e.event_id().as_str().to_owned();
    // Hold the event row: the migration reads it unlocked, then waits at its commit.
    let mut dispatcher = f.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM outbox_events WHERE event_id = $1 FOR UPDATE").bind(&id).execute(&mut *dispatcher).await.unwrap();
    let migration = {
        let (store, broker, event_id) = (f.store.clone(), f.broker.clone(), e.event_id().clone());
        tokio::spawn(async move {
            let retry = RetryPolicy { in_flight_bound_ms: BOUND_MS, ..RetryPolicy::default() };
            let route = outbox_core::RoutePolicy::new(ORDER_CREATED, "cluster-new", "orders-new", 3);
            outbox_producer::migrate_destination(&store, broker.as_ref(), &event_id, &route, "ops-alice", &retry).await.unwrap()
        })
    };
    wait_count(&f.pool, "SELECT count(*) FROM pg_locks WHERE NOT granted", 1, Duration::from_secs(10)).await;
    // What a dispatcher and a reconciler do meanwhile (their statements, in
    // the transaction that holds the row): claim, register A1, send (the
    // ACK is lost), lease expiry, the reconciler's claim.
    let attempt = outbox_core::AttemptId::generate(f.store.now_ms() as u64).to_string();
    let now = f.store.now_ms();
    for sql in [
        "UPDATE outbox_events SET state = 'CLAIMED', claim_owner = 'w', claim_generation = claim_generation + 1, lease_until_ms = $2 + 1000 WHERE event_id = $1",
        "INSERT INTO outbox_attempts (attempt_id, event_id, envelope_generation, attempt_generation, claim_generation, owner, state, destination_digest, started_at_ms)
         SELECT $3, event_id, 1, 1, claim_generation, 'w', 'UNKNOWN', destination_digest, $2 FROM outbox_events WHERE event_id = $1",
        "UPDATE outbox_events SET state = 'SENDING', claim_attempt_id = $3, attempt_generation = 1 WHERE event_id = $1",
        "UPDATE outbox_events SET state = 'DISPATCH_UNKNOWN', claim_owner = NULL, unknown_since_ms = $2, claim_generation = claim_generation + 1 WHERE event_id = $1",
        "UPDATE outbox_events SET state = 'RECONCILING', claim_owner = 'r', claim_generation = claim_generation + 1, lease_until_ms = $2 + 60000, claim_attempt_id = NULL WHERE event_id = $1",
    ] {
        sqlx::query(sql).bind(&id).bind(now).bind(&attempt).execute(&mut *dispatcher).await.unwrap();
    }
    dispatcher.commit().await.unwrap();
    let out = tokio::time::timeout(Duration::from_secs(30), migration).await.unwrap().unwrap();
    assert!(matches!(out, outbox_producer::MigrationOutcome::Refused { .. }), "moved while A1 may be in the old target: {out:?}");
    let generation: i32 = sqlx::query_scalar("SELECT envelope_generation FROM outbox_events WHERE event_id = $1").bind(&id).fetch_one(&f.pool).await.unwrap();
    assert_eq!(generation, 1);
    let a1: String = sqlx::query_scalar("SELECT state FROM outbox_attempts WHERE event_id = $1").bind(&id).fetch_one(&f.pool).await.unwrap();
    assert_eq!(a1, "UNKNOWN", "A1 closed without a proof");
    assert_eq!(f.state(&id).await, EventState::Reconciling, "the reconciler's claim is untouched");
}

/// Issue 19 item 5: a dry run runs the same eligibility check: a
/// quarantined event is refused, a movable one would move, and nothing
/// changes either way.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item5_dry_run_runs_the_same_eligibility_check(pool: PgPool) {
    let f = fixture(pool).await;
    let retry = RetryPolicy { in_flight_bound_ms: BOUND_MS, ..RetryPolicy::default() };
    let route = outbox_core::RoutePolicy::new(ORDER_CREATED, "cluster-new", "orders-new", 3);
    let movable = create_order(&f.pool, "o-1", 1).await;
    let out = outbox_producer::migration::migrate_destination_with(&f.store, f.broker.as_ref(), movable.event_id(), &route, "ops-alice", &retry, true).await.unwrap();
    assert!(matches!(out, outbox_producer::MigrationOutcome::WouldMigrate { from_generation: 1, .. }), "{out:?}");
    assert_eq!(f.count("SELECT count(*) FROM outbox_envelopes").await, 1, "a dry run wrote an envelope");
    tamper(&f.pool, "UPDATE outbox_events SET payload = 'x' WHERE event_id = $1", movable.event_id().as_str(), None).await;
    assert_eq!(f.dispatcher(&f.store, 1_000).dispatch_once("w").await.unwrap().quarantined, 1);
    let out = outbox_producer::migration::migrate_destination_with(&f.store, f.broker.as_ref(), movable.event_id(), &route, "ops-alice", &retry, true).await.unwrap();
    assert!(matches!(out, outbox_producer::MigrationOutcome::Refused { .. }), "a quarantined event passed the dry run: {out:?}");
}

// ---------------------------------------------------------------- item 6

/// Issue 19 item 6: the database refuses an event inserted in any state but
/// PENDING, and PUBLISHED (RETAINED, PURGED) without a primary receipt.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item6_the_database_refuses_published_without_a_receipt(pool: PgPool) {
    let f = fixture(pool).await;
    let e = create_order(&f.pool, "o-1", 1).await;
    let id = e.event_id().as_str().to_owned();
    // The application role inserts an already-PUBLISHED event.
    let copy = outbox_core::EventId::generate(f.store.now_ms() as u64).to_string();
    sqlx::query("INSERT INTO outbox_commands (command_key, event_id, tenant, aggregate_type, aggregate_id, aggregate_version) VALUES ('raw-copy', $1, 't', 'order', 'o-9', 1)")
        .bind(&copy)
        .execute(&f.pool)
        .await
        .unwrap();
    let err = sqlx::query(
        "INSERT INTO outbox_events (event_id, command_key, state, tenant, aggregate_type, aggregate_id, aggregate_version, event_type, payload, payload_digest,
                                    destination_digest, cluster_id, topic, partition, routing_key, ordered, created_at_ms, state_since_ms)
         SELECT $2, 'raw-copy', 'PUBLISHED', tenant, aggregate_type, aggregate_id, aggregate_version, event_type, payload, payload_digest,
                destination_digest, cluster_id, topic, partition, routing_key, ordered, 0, 0 FROM outbox_events WHERE event_id = $1",
    )
    .bind(&id)
    .bind(&copy)
    .execute(&f.pool)
    .await
    .expect_err("an event inserted PUBLISHED was accepted");
    assert!(err.to_string().contains("PENDING"), "{err}");
    // The dispatcher role walks PENDING -> CLAIMED -> SENDING -> PUBLISHED with no receipt.
    let mut tx = f.pool.begin().await.unwrap();
    for sql in [
        "UPDATE outbox_events SET state = 'CLAIMED', claim_owner = 'w', claim_generation = claim_generation + 1, lease_until_ms = 1 WHERE event_id = $1",
        "UPDATE outbox_events SET state = 'SENDING' WHERE event_id = $1",
        "UPDATE outbox_events SET state = 'PUBLISHED', claim_owner = NULL WHERE event_id = $1",
    ] {
        sqlx::query(sql).bind(&id).execute(&mut *tx).await.unwrap();
    }
    let err = tx.commit().await.expect_err("PUBLISHED without a receipt was committed");
    assert!(err.to_string().contains("without a primary receipt"), "{err}");
    assert_eq!(f.state(&id).await, EventState::Pending);
    // The real path still works: a receipt in the same transaction.
    assert_eq!(f.dispatcher(&f.store, 1_000).dispatch_once("w").await.unwrap().published, 1);
}

/// Issue 19 item 6: a PUBLISHED event without a receipt that got in anyway
/// (written before the rule existed, or with the triggers off) is a finding.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item6_published_without_receipt_is_a_finding(pool: PgPool) {
    let f = fixture(pool).await;
    let e = create_order(&f.pool, "o-1", 1).await;
    let good = create_order(&f.pool, "o-2", 1).await;
    assert_eq!(f.dispatcher(&f.store, 1_000).dispatch_once("w").await.unwrap().published, 2);
    tamper(&f.pool, "DELETE FROM outbox_publish_receipts WHERE event_id = $1", e.event_id().as_str(), None).await;
    f.reconciler().compare_once().await.unwrap();
    assert_eq!(f.findings("published_without_receipt", e.event_id().as_str()).await, 1);
    assert_eq!(f.findings("published_without_receipt", good.event_id().as_str()).await, 0);
}

// ---------------------------------------------------------------- item 10

async fn emit_in(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, command_key: &str, version: i64) -> outbox_core::EventId {
    emit_for(tx, command_key, "o-same", version).await
}

/// Emits version `version` of order `aggregate` in `tx`.
async fn emit_for(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, command_key: &str, aggregate: &str, version: i64) -> outbox_core::EventId {
    let payload = order_payload(aggregate, version);
    let mut req = order_request(command_key, aggregate, &payload);
    req.aggregate_version = version;
    outbox_producer::emit(tx, &req, &outbox_producer::EmitOptions::default()).await.unwrap().event_id().clone()
}

fn log_order(f: &Fixture) -> Vec<String> {
    let mut msgs = read_topic(&f.cluster.bootstrap, TOPIC, PARTITIONS);
    msgs.sort_by_key(|m| (m.partition, m.offset));
    msgs.iter().filter_map(|m| m.header(headers::EVENT_ID)).collect()
}

/// Issue 19 item 10: the order promised per key. Events of one key are
/// published in the order of their `seq`, assigned at insert, among the
/// events committed when the dispatcher claims: an event whose transaction
/// committed before another was inserted is always published first (and
/// events of one transaction in insert order). Two transactions that
/// overlap get no order between them: here the later insert commits first,
/// is claimed alone and is published first. (Two emits of one aggregate
/// never overlap: emit's aggregate lock makes the second wait for the
/// first. The overlapping events here are of two aggregates that share a
/// key: the route's key template is per aggregate type.)
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item10_per_key_order_is_insert_order_among_committed_events(pool: PgPool) {
    let f = fixture(pool).await;
    let one_key = outbox_core::RoutePolicy {
        key_template: "{tenant}.{aggregate_type}".into(),
        ..outbox_core::RoutePolicy::new(ORDER_CREATED, f.broker.cluster_id(), TOPIC, PARTITIONS as u32)
    };
    outbox_producer::routes::revise(&f.pool, &one_key).await.unwrap();
    let d = f.dispatcher(&f.store, 5_000);
    // Serialized: A commits before B is inserted -> A before B, whenever the dispatcher runs.
    let mut t = f.pool.begin().await.unwrap();
    let a = emit_in(&mut t, "cmd-a", 1).await;
    t.commit().await.unwrap();
    let mut t = f.pool.begin().await.unwrap();
    let b = emit_in(&mut t, "cmd-b", 2).await;
    t.commit().await.unwrap();
    while d.dispatch_once("w").await.unwrap().claimed > 0 {}
    // Overlapping: T1 inserts C, T2 inserts D (later seq) and commits first;
    // the dispatcher runs in between.
    let mut t1 = f.pool.begin().await.unwrap();
    let c = emit_for(&mut t1, "cmd-c", "o-c", 1).await;
    let mut t2 = f.pool.begin().await.unwrap();
    let dd = emit_for(&mut t2, "cmd-d", "o-d", 1).await;
    t2.commit().await.unwrap();
    assert_eq!(d.dispatch_once("w").await.unwrap().published, 1, "D is the only committed open event of the key");
    t1.commit().await.unwrap();
    while d.dispatch_once("w").await.unwrap().claimed > 0 {}
    let seqs: Vec<i64> = sqlx::query_scalar("SELECT seq FROM outbox_events WHERE event_id = ANY($1) ORDER BY array_position($1, event_id)")
        .bind(vec![c.to_string(), dd.to_string()])
        .fetch_all(&f.pool)
        .await
        .unwrap();
    assert!(seqs[0] < seqs[1], "C was inserted first: {seqs:?}");
    let ids = [a, b, c, dd].map(|e| e.to_string());
    assert_eq!(log_order(&f), vec![ids[0].clone(), ids[1].clone(), ids[3].clone(), ids[2].clone()], "serialized: insert order; overlapping: the one committed (and claimed) first");
}

// ---------------------------------------------------------------- item 3

/// Issue 19 item 3: the topic was recreated (or the cluster replaced): the
/// scan floor recorded from the old log (past offset 500) lies above the new
/// log's end. An attempt recorded without an anchor (before anchors were
/// kept) cannot tell that log from a truncated one: the range proves
/// nothing, the event stays unknown (no second copy) and the lost log is a
/// finding.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item3_a_floor_above_the_log_end_is_unavailable_not_absent(pool: PgPool) {
    let f = fixture(pool).await;
    let d = f.dispatcher(&f.store, 1_000);
    let mut t = f.pool.begin().await.unwrap();
    let first = emit_in(&mut t, "cmd-1", 1).await;
    t.commit().await.unwrap();
    assert_eq!(d.dispatch_once("w").await.unwrap().published, 1);
    // The old log had reached offset 500 on this partition.
    tamper(&f.pool, "UPDATE outbox_publish_receipts SET \"offset\" = 500 WHERE event_id = $1", first.as_str(), None).await;
    let mut t = f.pool.begin().await.unwrap();
    let second = emit_in(&mut t, "cmd-2", 2).await;
    t.commit().await.unwrap();
    let claimed = f.store.claim_batch("w", 10, 1_000).await.unwrap();
    let a = f.store.register_attempt(&claimed[0].token).await.unwrap();
    assert_eq!((a.scan_from_offset, a.scan_anchor.as_ref()), (501, Some(&first)));
    // As an attempt registered before the anchor was kept.
    tamper(&f.pool, "UPDATE outbox_attempts SET scan_anchor_event_id = NULL WHERE event_id = $1", second.as_str(), None).await;
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    f.clock.advance(BOUND_MS + 1);
    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!((r.retried, r.rechecks), (0, 1), "a range above the log's end was taken for a proof of absence: {r:?}");
    assert_eq!(f.state(second.as_str()).await, EventState::DispatchUnknown);
    assert_eq!(f.findings("log_unavailable", second.as_str()).await, 1);
}

/// Issue 19, the broker replaced by an empty one: the receipts (and so an
/// attempt's scan floor) come from the old log, which had reached offset 4
/// of the partition; the new log holds other messages there, and the
/// attempt's message landed below the floor, at offset 3, its ACK lost.
/// The floor's anchor (the event whose receipt held offset 4) is not at
/// offset 4 of this log, so the lookup reads the log from its start and
/// finds the message: the event is published from it, nothing is sent
/// again. (Before: the scan started at the old floor, 5, read [5, 7),
/// called the event absent and sent a second copy.)
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn broker_replaced_a_floor_from_the_lost_log_does_not_hide_a_message_below_it(pool: PgPool) {
    let f = fixture(pool).await;
    let d = f.dispatcher(&f.store, 1_000);
    // Three events at offsets 0..2 of partition 0.
    let mut orders: Vec<String> = Vec::new();
    for _ in 0..3 {
        let not: Vec<&str> = orders.iter().map(String::as_str).collect();
        let o = order_on(&f, 0, &not);
        orders.push(o);
        create_order(&f.pool, orders.last().unwrap(), 1).await;
        assert_eq!(d.dispatch_once("w").await.unwrap().published, 1);
    }
    let last: String = sqlx::query_scalar("SELECT event_id FROM outbox_publish_receipts WHERE partition = 0 AND \"offset\" = 2").fetch_one(&f.pool).await.unwrap();
    // The old log had that event at offset 4.
    tamper(&f.pool, "UPDATE outbox_publish_receipts SET \"offset\" = 4 WHERE event_id = $1", &last, None).await;
    let not: Vec<&str> = orders.iter().map(String::as_str).collect();
    let b_order = order_on(&f, 0, &not);
    let (b, a) = f.registered(&b_order, 1_000).await;
    assert_eq!((a.scan_from_offset, a.scan_anchor.as_ref().map(|e| e.as_str())), (5, Some(last.as_str())));
    // Its message lands at offset 3 (below the floor); the ACK is lost.
    let lost_ack = f.send_late(&b, &a).await;
    assert_eq!(lost_ack.offset, 3);
    // Other events fill offsets 4..6 of the new log.
    for _ in 0..3 {
        let mut not: Vec<&str> = orders.iter().map(String::as_str).collect();
        not.push(&b_order);
        let o = order_on(&f, 0, &not);
        orders.push(o);
        create_order(&f.pool, orders.last().unwrap(), 1).await;
        d.dispatch_once("w2").await.unwrap();
    }
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    assert_eq!(f.state(b.envelope.event_id.as_str()).await, EventState::DispatchUnknown);
    f.clock.advance(BOUND_MS + 1);
    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!(r.retried, 0, "the event was sent again while its message sits in the new log: {r:?}");
    assert_eq!(f.state(b.envelope.event_id.as_str()).await, EventState::Published);
    assert_eq!(f.receipt_offset(b.envelope.event_id.as_str()).await, 3);
    assert_eq!(f.log_of(b.envelope.event_id.as_str()), 1);
}

/// The broker replaced, and the new log holds the floor's anchor event at
/// the anchor offset, written there by another attempt (a paused sender's
/// late write reached the new log): the same event, another message. The
/// anchor names the attempt whose receipt held the offset, so the lookup
/// takes this log for another one, reads it from its start and finds the
/// attempt's message below the floor. (Before: checked by event alone, the
/// anchor held, the scan started at the floor, proved the event absent
/// and sent it again; seed 495754 of the 1,000,000-trace gate.)
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn broker_replaced_the_anchor_event_by_another_attempt_at_the_anchor_offset_is_another_log(pool: PgPool) {
    let f = fixture(pool).await;
    // L: published at offset 1 of the old log by its attempt X (that log is gone).
    let l_order = order_on(&f, 0, &[]);
    let (l, x) = f.registered(&l_order, 1_000).await;
    let old = f.receipt(&l, &x, 0, 1);
    assert_eq!(f.store.accept_dispatch_receipt(&old).await.unwrap().state, EventState::Published);
    // B registers past it: floor 2, anchored at L's receipt (L, X).
    let b_order = order_on(&f, 0, &[&l_order]);
    let (b, a) = f.registered(&b_order, 1_000).await;
    assert_eq!((a.scan_from_offset, a.scan_anchor.as_ref(), a.scan_anchor_attempt.as_ref()), (2, Some(&l.envelope.event_id), Some(&x.attempt_id)));
    // The new log: B's message at offset 0 (its ACK lost), then L's
    // message of another attempt Y at offset 1, the anchor offset.
    assert_eq!(f.send_late(&b, &a).await.offset, 0);
    let y = outbox_core::AttemptRecord { attempt_id: outbox_core::AttemptId::generate(7), ..x.clone() };
    assert_eq!(f.send_late(&l, &y).await.offset, 1);
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    f.clock.advance(BOUND_MS + 1);
    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!(r.retried, 0, "B was sent again while its message sits below the floor: {r:?}");
    assert_eq!(f.state(b.envelope.event_id.as_str()).await, EventState::Published);
    assert_eq!(f.receipt_offset(b.envelope.event_id.as_str()).await, 0);
    assert_eq!(f.log_of(b.envelope.event_id.as_str()), 1);
}

/// Issue 19, the broker replaced by an empty one, shorter than the old
/// log: the floor (past the old log's offset 500) is above the new log's
/// end, so its anchor is not there; the new log is read whole. An
/// attempt whose message is not in it (it went to the lost log, or never
/// left) is proven absent from every log there is, once nothing can be in
/// flight, and retried to the same destination; one that is in it is found.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn broker_replaced_a_floor_past_the_new_logs_end_reads_the_new_log_whole(pool: PgPool) {
    let f = fixture(pool).await;
    let d = f.dispatcher(&f.store, 1_000);
    let first_order = order_on(&f, 0, &[]);
    let first = create_order(&f.pool, &first_order, 1).await;
    assert_eq!(d.dispatch_once("w").await.unwrap().published, 1);
    tamper(&f.pool, "UPDATE outbox_publish_receipts SET \"offset\" = 500 WHERE event_id = $1", first.event_id().as_str(), None).await;
    // One attempt sends (ACK lost), one never does.
    let sent_order = order_on(&f, 0, &[&first_order]);
    let (sent, a1) = f.registered(&sent_order, 1_000).await;
    assert_eq!(a1.scan_from_offset, 501);
    f.send_late(&sent, &a1).await;
    let (silent, a2) = f.registered(&order_on(&f, 0, &[&first_order, &sent_order]), 1_000).await;
    assert_eq!(a2.scan_anchor.as_ref(), Some(first.event_id()));
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    f.clock.advance(BOUND_MS + 1);
    let r = f.reconciler().resolve_unknown_once().await.unwrap();
    assert_eq!((r.published, r.retried), (1, 1), "{r:?}");
    assert_eq!(f.state(sent.envelope.event_id.as_str()).await, EventState::Published);
    assert_eq!(f.log_of(sent.envelope.event_id.as_str()), 1);
    assert_eq!(f.state(silent.envelope.event_id.as_str()).await, EventState::RetryClaimed);
    assert_eq!(f.findings("log_unavailable", silent.envelope.event_id.as_str()).await, 0);
}

/// Issue 19 item 3, at the adapter: a lower bound above the high watermark
/// is Unavailable, the bound at the end is an empty range (Absent).
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item3_lookup_of_a_range_past_the_end_of_the_log_is_unavailable(pool: PgPool) {
    let f = fixture(pool).await;
    let dest = outbox_core::RoutePolicy::new(ORDER_CREATED, f.broker.cluster_id(), TOPIC, PARTITIONS as u32).resolve("t", "order", "o-1").unwrap();
    let id = outbox_core::EventId::generate(1);
    assert_eq!(f.broker.lookup(&dest, &id, &outbox_core::ScanFrom::at(0)).await, outbox_core::LookupOutcome::Absent);
    match f.broker.lookup(&dest, &id, &outbox_core::ScanFrom::at(10)).await {
        outbox_core::LookupOutcome::Unavailable(why) => assert!(outbox_producer::kafka::is_log_incomplete(&why), "{why}"),
        other => panic!("a lower bound above the log's end answered {other:?}"),
    }
}

// ---------------------------------------------------------------- item 4

/// An order id whose events go to `partition`, different from `not`.
fn order_on(f: &Fixture, partition: i32, not: &[&str]) -> String {
    let policy = outbox_core::RoutePolicy::new(ORDER_CREATED, f.broker.cluster_id(), TOPIC, PARTITIONS as u32);
    (0..1_000)
        .map(|i| format!("o-{i}"))
        .find(|id| !not.contains(&id.as_str()) && policy.resolve("tenant-7", "order", id).unwrap().partition == partition)
        .unwrap()
}

/// Issue 19 item 4: after the log was replaced, a fresh ACK lands at a
/// position an old receipt (of another event) still claims. Offsets are
/// unique within one log, so the old receipt's log is gone: its lost
/// position is a finding, and the new receipt is accepted one position
/// epoch above it (before: refused, its event never published, its key
/// blocked), with the other receipts of the batch.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item4_a_receipt_colliding_with_a_lost_position_does_not_drop_its_batch(pool: PgPool) {
    let f = fixture(pool).await;
    let d = f.dispatcher(&f.store, 5_000);
    let old_id = order_on(&f, 0, &[]);
    let old = create_order(&f.pool, &old_id, 1).await;
    assert_eq!(d.dispatch_once("w").await.unwrap().published, 1);
    // The old log's receipt claims offset 1 of partition 0, where the next message will land.
    tamper(&f.pool, "UPDATE outbox_publish_receipts SET \"offset\" = 1 WHERE event_id = $1", old.event_id().as_str(), None).await;
    let colliding_id = order_on(&f, 0, &[&old_id]);
    let other_id = order_on(&f, 1, &[]);
    let colliding = create_order(&f.pool, &colliding_id, 1).await;
    let other = create_order(&f.pool, &other_id, 1).await;
    let report = d.dispatch_once("w").await.expect("one colliding receipt failed the whole batch");
    assert_eq!(report.published, 2, "{report:?}");
    assert_eq!(f.state(other.event_id().as_str()).await, EventState::Published);
    assert_eq!(f.state(colliding.event_id().as_str()).await, EventState::Published, "a genuine ACK at a lost position was refused");
    assert_eq!(f.findings("receipt_position_lost", old.event_id().as_str()).await, 1);
    let at_1: Vec<(String, i32)> =
        sqlx::query_as("SELECT event_id, position_epoch FROM outbox_publish_receipts WHERE partition = 0 AND \"offset\" = 1 ORDER BY position_epoch").fetch_all(&f.pool).await.unwrap();
    assert_eq!(at_1, vec![(old.event_id().to_string(), 0), (colliding.event_id().to_string(), 1)]);
    // The next attempt on the partition anchors its floor on the newest receipt there.
    let (_, a) = f.registered(&order_on(&f, 0, &[&old_id, &colliding_id]), 5_000).await;
    assert_eq!((a.scan_from_offset, a.scan_anchor.as_ref()), (2, Some(colliding.event_id())));
    // The report names the lost log.
    let report = outbox_producer::report::build_report(&f.pool, &outbox_producer::report::ReportOptions::at(outbox_core::Clock::now_ms(&f.clock))).await.unwrap();
    let lost = outbox_producer::report::LostLog {
        cluster_id: f.broker.cluster_id().to_owned(),
        topic: TOPIC.into(),
        topic_id: None,
        partition: 0,
        receipts_lost: 1,
        first_offset: 1,
        last_offset: 1,
    };
    assert_eq!(report.lost_logs, vec![lost]);
    assert!(report.to_text().contains(&format!("lost log {}/{TOPIC}/0: 1 receipts (offsets 1..1)", f.broker.cluster_id())), "{}", report.to_text());
    // The bypass scan reads the same at 0/1: the newer epoch's message, so
    // the older receipt lost its log (it is not one that never matched).
    f.reconciler().compare_once().await.unwrap();
    let detail: String = sqlx::query_scalar("SELECT detail FROM outbox_findings WHERE kind = 'receipt_position_lost' AND event_id = $1")
        .bind(old.event_id().as_str())
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert!(detail.contains("is gone (topic recreated, cluster replaced)") && !detail.contains("never matched"), "the scan did not judge it a lost log: {detail}");
}

/// A topic deleted and created again under the same name starts a new log
/// at offset 0, under another topic id. An event frozen for the new topic
/// (destination.v2 with its id) lands at a position an event of the old
/// topic (the old id) holds a receipt for: another log, so its receipt is
/// accepted too, and its attempt's scan floor counts the new log's receipts
/// only. A receipt at that position under the same topic id proves that
/// log lost its position: the lost position is a finding, the receipt is
/// accepted one position epoch above.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn receipts_of_a_recreated_topic_do_not_collide_with_the_old_logs(pool: PgPool) {
    let f = fixture(pool).await;
    let current = f.broker.topic_id(TOPIC).await.unwrap().expect("the mock cluster gives topic ids");
    let old = if current == "AAECAwQFBgcICQoLDA0ODw" { "_____________________w" } else { "AAECAwQFBgcICQoLDA0ODw" };
    let policy = |id: &str| outbox_core::RoutePolicy { topic_id: Some(id.to_owned()), ..outbox_core::RoutePolicy::new(ORDER_CREATED, f.broker.cluster_id(), TOPIC, PARTITIONS as u32) };
    let receipt_at = |c: &ClaimedEvent, a: &outbox_core::AttemptRecord, offset: i64| {
        headers::parse(&outgoing_message(c, a).headers).unwrap().receipt(f.broker.cluster_id(), TOPIC, 0, offset, &c.payload)
    };
    // The old topic: an event frozen with the old id, published at 0/0 of the old log.
    outbox_producer::routes::revise(&f.pool, &policy(old)).await.unwrap();
    let (on_old, a) = f.registered(&order_on(&f, 0, &[]), 5_000).await;
    assert_eq!(on_old.destination.topic_id.as_deref(), Some(old));
    let out = f.store.accept_dispatch_receipt(&receipt_at(&on_old, &a, 0)).await.unwrap();
    assert_eq!(out.state, EventState::Published);

    // The topic recreated: the route learns the new id; the next event lands at 0/0 of the new log.
    outbox_producer::routes::revise(&f.pool, &policy(&current)).await.unwrap();
    let new_order = order_on(&f, 0, &[&on_old.envelope.aggregate_id]);
    let on_new = create_order(&f.pool, &new_order, 1).await;
    let report = f.dispatcher(&f.store, 5_000).dispatch_once("w").await.unwrap();
    assert_eq!(report.published, 1, "the new log's receipt was refused as a collision with the old log's: {report:?}");
    assert_eq!(f.state(on_new.event_id().as_str()).await, EventState::Published);
    assert_eq!(f.findings("receipt_position_lost", on_old.envelope.event_id.as_str()).await, 0);
    let at_0: Vec<(String, Option<String>)> =
        sqlx::query_as("SELECT event_id, topic_id FROM outbox_publish_receipts WHERE partition = 0 AND \"offset\" = 0 ORDER BY topic_id = $1").bind(old).fetch_all(&f.pool).await.unwrap();
    assert_eq!(at_0, vec![(on_new.event_id().to_string(), Some(current.clone())), (on_old.envelope.event_id.to_string(), Some(old.to_owned()))]);
    let floor: i64 = sqlx::query_scalar("SELECT scan_from_offset FROM outbox_attempts WHERE event_id = $1").bind(on_new.event_id().as_str()).fetch_one(&f.pool).await.unwrap();
    assert_eq!(floor, 0, "the new log's scan floor counted the old log's receipts");

    // The same topic id at the same position: that log lost the position.
    let (again, a) = f.registered(&order_on(&f, 0, &[&on_old.envelope.aggregate_id, &new_order]), 5_000).await;
    let out = f.store.accept_dispatch_receipt(&receipt_at(&again, &a, 0)).await.unwrap();
    assert!(matches!(out.decision, outbox_core::ReceiptDecision::Accept { .. }), "{out:?}");
    assert_eq!(f.state(again.envelope.event_id.as_str()).await, EventState::Published);
    assert_eq!(f.findings("receipt_position_lost", on_new.event_id().as_str()).await, 1);
    let epoch: i32 = sqlx::query_scalar("SELECT position_epoch FROM outbox_publish_receipts WHERE event_id = $1").bind(again.envelope.event_id.as_str()).fetch_one(&f.pool).await.unwrap();
    assert_eq!(epoch, 1);
}

/// After a recreation the bypass scan reads the new log: the old log's
/// receipt at a position the new log's event now holds is a lost position
/// (that log is gone); the new log's own receipt there is its message,
/// neither lost nor an unrecorded copy.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_bypass_scan_tells_the_logs_of_a_recreated_topic_apart(pool: PgPool) {
    let f = fixture(pool).await;
    let current = f.broker.topic_id(TOPIC).await.unwrap().expect("the mock cluster gives topic ids");
    let old = if current == "AAECAwQFBgcICQoLDA0ODw" { "_____________________w" } else { "AAECAwQFBgcICQoLDA0ODw" };
    let policy = |id: &str| outbox_core::RoutePolicy { topic_id: Some(id.to_owned()), ..outbox_core::RoutePolicy::new(ORDER_CREATED, f.broker.cluster_id(), TOPIC, PARTITIONS as u32) };
    outbox_producer::routes::revise(&f.pool, &policy(old)).await.unwrap();
    let (on_old, a) = f.registered(&order_on(&f, 0, &[]), 5_000).await;
    let receipt = headers::parse(&outgoing_message(&on_old, &a).headers).unwrap().receipt(f.broker.cluster_id(), TOPIC, 0, 0, &on_old.payload);
    assert_eq!(f.store.accept_dispatch_receipt(&receipt).await.unwrap().state, EventState::Published);
    outbox_producer::routes::revise(&f.pool, &policy(&current)).await.unwrap();
    let on_new = create_order(&f.pool, &order_on(&f, 0, &[&on_old.envelope.aggregate_id]), 1).await;
    assert_eq!(f.dispatcher(&f.store, 5_000).dispatch_once("w").await.unwrap().published, 1);

    let c = f.reconciler().compare_once().await.unwrap();
    assert_eq!((c.bypass_publish, c.unrecorded_copy, c.divergent_copy), (0, 0, 0), "{c:?}");
    assert_eq!(f.findings("receipt_position_lost", on_old.envelope.event_id.as_str()).await, 1);
    assert_eq!(f.findings("receipt_position_lost", on_new.event_id().as_str()).await, 0);
    let detail: String = sqlx::query_scalar("SELECT detail FROM outbox_findings WHERE kind = 'receipt_position_lost'").fetch_one(&f.pool).await.unwrap();
    assert!(detail.contains(&format!("(topic id {old})")) && detail.contains(&format!("of topic id {current}")), "{detail}");
}

/// Issue 19 item 4: one event the reconciler cannot handle (its frozen
/// destination is unreadable) does not abort the round: it is quarantined,
/// the other event is resolved.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item4_one_bad_event_does_not_abort_the_reconcile_round(pool: PgPool) {
    let f = fixture(pool).await;
    let (bad, _) = f.registered("o-bad", 1_000).await;
    let claimed = f.store.claim_batch("w", 10, 1_000).await.unwrap();
    let good = claimed.into_iter().next().map(|c| c.envelope.event_id);
    let good = match good {
        Some(g) => g,
        None => {
            let (g, _) = f.registered("o-good", 1_000).await;
            g.envelope.event_id
        }
    };
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    f.clock.advance(BOUND_MS + 1);
    tamper(&f.pool, "UPDATE outbox_envelopes SET destination_canonical = 'garbage' WHERE event_id = $1", bad.envelope.event_id.as_str(), None).await;
    let r = f.reconciler().resolve_unknown_once().await.expect("one unreadable event aborted the round");
    assert_eq!(r.retried, 1, "{r:?}");
    assert_eq!(f.state(good.as_str()).await, EventState::RetryClaimed);
    assert_eq!(f.state(bad.envelope.event_id.as_str()).await, EventState::Quarantined);
}

/// Issue 19 item 4: the bypass scan finds a receipt whose position now holds
/// another message (the log was replaced): a finding, named after the event
/// whose receipt lost its position.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item4_the_bypass_scan_reports_a_receipt_whose_position_was_lost(pool: PgPool) {
    let f = fixture(pool).await;
    let id = order_on(&f, 0, &[]);
    let e = create_order(&f.pool, &id, 1).await;
    assert_eq!(f.dispatcher(&f.store, 5_000).dispatch_once("w").await.unwrap().published, 1);
    let rec = f.reconciler();
    assert_eq!(rec.compare_once().await.unwrap().total(), 0);
    // The receipt says offset 1; a message without an eventId lands there.
    tamper(&f.pool, "UPDATE outbox_publish_receipts SET \"offset\" = 1 WHERE event_id = $1", e.event_id().as_str(), None).await;
    let stray = outbox_core::OutgoingMessage { topic: TOPIC.into(), partition: 0, key: b"k".to_vec(), payload: b"{}".to_vec(), headers: vec![] };
    assert!(matches!(f.broker.send(stray).await, SendOutcome::Acked { offset: 1, .. }));
    rec.compare_once().await.unwrap();
    assert_eq!(f.findings("receipt_position_lost", e.event_id().as_str()).await, 1);
}

/// docs/roles.sql: the roles the services run under.
const ROLES_SQL: &str = include_str!("../../docs/roles.sql");

/// Defect (outside read): a receipt row forged by the dispatcher role (its
/// grants allow inserting receipts and publishing events) at a position
/// that holds another event's message was reported as
/// `receipt_position_lost` with the cause "the log it was recorded in is
/// gone", sending the operator to the runbook of a recreated topic. The
/// log was never replaced: the bypass scan's anchor holds, and the
/// position still holds the very message the other event's receipt
/// recorded there, in an earlier position epoch of the same log. The
/// forged receipt (it must take a later epoch: positions are unique per
/// epoch) never matched the log, and its event's message was never
/// written: the finding names that cause.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_forged_receipt_at_another_messages_position_is_not_reported_as_a_lost_log(pool: PgPool) {
    let f = fixture(pool).await;
    sqlx::raw_sql(ROLES_SQL).execute(&f.pool).await.expect("roles.sql applies");
    let d = f.dispatcher(&f.store, 5_000);
    let first = create_order(&f.pool, &order_on(&f, 0, &[]), 1).await;
    assert_eq!(d.dispatch_once("w").await.unwrap().published, 1);
    let rec = f.reconciler();
    assert_eq!(rec.compare_once().await.unwrap().total(), 0);
    // The next message of the partition, published genuinely at 0/1.
    let not = [first.envelope.aggregate_id.as_str()];
    let holder = create_order(&f.pool, &order_on(&f, 0, &not), 1).await;
    assert_eq!(d.dispatch_once("w").await.unwrap().published, 1);
    assert_eq!(f.receipt_offset(holder.event_id().as_str()).await, 1);
    // An event claimed and registered, never sent.
    let not = [first.envelope.aggregate_id.as_str(), holder.envelope.aggregate_id.as_str()];
    let (forged, a) = f.registered(&order_on(&f, 0, &not), 5_000).await;
    let id = forged.envelope.event_id.as_str().to_owned();

    // As the dispatcher role: a receipt for it at 0/1 (epoch 0 is the
    // holder's there) and the event PUBLISHED, triggers and all.
    let now = outbox_core::Clock::now_ms(&f.clock);
    let mut tx = f.pool.begin().await.unwrap();
    sqlx::query("SET LOCAL ROLE outbox_dispatcher").execute(&mut *tx).await.unwrap();
    sqlx::query(
        "INSERT INTO outbox_publish_receipts (event_id, envelope_generation, attempt_id, cluster_id, topic, topic_id, partition, \"offset\",
                                              payload_digest, destination_digest, accepted_at_ms, position_epoch)
         VALUES ($1, 1, $2, $3, $4, NULL, 0, 1, $5, $6, $7, 1)",
    )
    .bind(&id)
    .bind(a.attempt_id.as_str())
    .bind(f.broker.cluster_id())
    .bind(TOPIC)
    .bind(&forged.envelope.payload_digest)
    .bind(&forged.destination_digest)
    .bind(now)
    .execute(&mut *tx)
    .await
    .expect("the dispatcher role may insert a receipt");
    sqlx::query(
        "UPDATE outbox_events SET state = 'PUBLISHED', claim_owner = NULL, lease_until_ms = NULL, published_at_ms = $2, state_since_ms = $2
         WHERE event_id = $1",
    )
    .bind(&id)
    .bind(now)
    .execute(&mut *tx)
    .await
    .expect("the dispatcher role may publish an event");
    tx.commit().await.unwrap();
    assert_eq!(f.state(&id).await, EventState::Published);
    assert_eq!(f.log_of(&id), 0, "the forged receipt's event was never sent");

    // The bypass scan reads 0/1 (its anchor, 0/0, holds: the same log).
    let c = rec.compare_once().await.unwrap();
    assert_eq!((c.bypass_publish, c.unrecorded_copy, c.divergent_copy), (0, 0, 0), "{c:?}");
    assert_eq!(f.findings("receipt_position_lost", holder.event_id().as_str()).await, 0, "the holder's receipt matches the log");
    assert_eq!(f.findings("receipt_position_lost", &id).await, 1, "the forged receipt was not reported");
    let detail: String = sqlx::query_scalar("SELECT detail FROM outbox_findings WHERE kind = 'receipt_position_lost' AND event_id = $1")
        .bind(&id)
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert!(detail.contains("never matched the log") && detail.contains("forged or corrupted"), "the finding names another cause: {detail}");
    assert!(!detail.contains("is gone"), "the finding blames a lost log: {detail}");
    assert!(detail.contains(&format!("event {}'s message", holder.event_id())), "{detail}");
}

/// Issue 19 item 4: the broker came back with a shorter log: a receipt
/// recorded beyond the log's end names a position that is gone: a finding.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item4_a_receipt_beyond_the_log_end_is_a_finding(pool: PgPool) {
    let f = fixture(pool).await;
    let e = create_order(&f.pool, "o-1", 1).await;
    assert_eq!(f.dispatcher(&f.store, 5_000).dispatch_once("w").await.unwrap().published, 1);
    tamper(&f.pool, "UPDATE outbox_publish_receipts SET \"offset\" = 50 WHERE event_id = $1", e.event_id().as_str(), None).await;
    f.clock.advance(10_000);
    f.reconciler().compare_once().await.unwrap();
    assert_eq!(f.findings("receipt_position_lost", e.event_id().as_str()).await, 1);
}

/// Issue 19 item 4, as the chaos drill found it: more receipts beyond the
/// log's end than one round reports (`max_findings_per_kind`) are all
/// reported after enough rounds, not the same lowest ones again and again.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item4_every_receipt_beyond_the_log_end_is_reported_in_time(pool: PgPool) {
    let f = fixture(pool).await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let e = create_order(&f.pool, &format!("o-{i}"), 1).await;
        ids.push(e.event_id().to_string());
    }
    let d = f.dispatcher(&f.store, 5_000);
    let mut published = 0;
    while published < 5 {
        let r = d.dispatch_once("w").await.unwrap();
        assert!(r.claimed > 0, "nothing left to claim at {published} published");
        published += r.published;
    }
    // The broker came back empty: every receipt lies beyond the new log's end.
    for id in &ids {
        tamper(&f.pool, "UPDATE outbox_publish_receipts SET \"offset\" = \"offset\" + 100 WHERE event_id = $1", id, None).await;
    }
    f.clock.advance(10_000);
    let cfg = ReconcilerConfig {
        owner: "r".into(),
        max_findings_per_kind: 2,
        retry: RetryPolicy { in_flight_bound_ms: BOUND_MS, ..RetryPolicy::default() },
        ..Default::default()
    };
    let rec = Reconciler::new(f.store.clone(), f.broker.clone(), cfg).unwrap();
    for _ in 0..3 {
        rec.compare_once().await.unwrap();
    }
    for id in &ids {
        assert_eq!(f.findings("receipt_position_lost", id).await, 1, "{id}'s lost position was never reported in 3 rounds of 2");
    }
}

/// Issue 19 item 4: the bypass scan's cursor from the old log lies beyond
/// the new log's end; the new log is read from its start rather than never.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn item4_the_bypass_scan_reads_a_replaced_log_from_its_start(pool: PgPool) {
    let f = fixture(pool).await;
    create_order(&f.pool, "o-1", 1).await;
    assert_eq!(f.dispatcher(&f.store, 5_000).dispatch_once("w").await.unwrap().published, 1);
    let rec = f.reconciler();
    rec.compare_once().await.unwrap();
    sqlx::query("UPDATE outbox_scan_cursors SET next_offset = 900").execute(&f.pool).await.unwrap();
    // A bypass publish lands in the new log, below the old cursor.
    let stray = outbox_core::OutgoingMessage { topic: TOPIC.into(), partition: 0, key: b"k".to_vec(), payload: b"{}".to_vec(), headers: vec![] };
    assert!(matches!(f.broker.send(stray).await, SendOutcome::Acked { .. }));
    rec.compare_once().await.unwrap();
    let c = rec.compare_once().await.unwrap();
    let bypass = f.count("SELECT count(*) FROM outbox_findings WHERE kind = 'bypass_publish'").await;
    assert_eq!(bypass, 1, "the bypass publish in the new log was never read: {c:?}");
}

/// A copy written by an attempt that was still open when another attempt's
/// late ACK published its event is accounted for (PROTOCOL §5: every copy
/// is a receipt or a finding). Nothing asks about that attempt again: its
/// ACK was lost, the reconciler looks up only unresolved events, and the
/// comparison used to pass over the copy of any open attempt as an answer
/// still on its way, for ever. Once the attempt is past the in-flight
/// bound, its copy is `unrecorded_copy`.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_copy_of_an_attempt_left_open_by_a_late_ack_is_a_finding(pool: PgPool) {
    let f = fixture(pool).await;
    let (c0, a0) = f.registered("o-1", 1_000).await;
    let id = c0.envelope.event_id.as_str().to_owned();
    // The first attempt is written; its ACK is lost and the lease runs out.
    let r0 = f.send_late(&c0, &a0).await;
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    assert_eq!(f.state(&id).await, EventState::DispatchUnknown);
    // A retry (here blind: as a reconciler whose adapter cannot look up
    // does) is written too, and its ACK is lost as well.
    let task = f.store.begin_reconcile("r", 10, 1_000).await.unwrap().pop().expect("due");
    f.store.finish_reconcile(&task.token, &outbox_core::ReconcileDecision::Retry { proven_absent: false }).await.unwrap();
    let c1 = f.store.claim_retries("w2", 10, 1_000).await.unwrap().pop().expect("the retry claim");
    let a1 = f.store.register_attempt(&c1.token).await.unwrap();
    let r1 = f.send_late(&c1, &a1).await;
    f.clock.advance(1_001);
    f.store.expire_leases().await.unwrap();
    // The first attempt's late ACK publishes the event; the second stays open.
    let out = f.store.accept_dispatch_receipt(&r0).await.unwrap();
    assert!(matches!(out.decision, outbox_core::ReceiptDecision::Accept { .. }), "{out:?}");
    let open = f.store.attempts(&c0.envelope.event_id).await.unwrap().into_iter().filter(|a| a.state.possibly_in_flight()).count();
    assert_eq!(open, 1, "the retry's attempt is still open");
    assert_eq!(f.log_of(&id), 2);

    // Within the in-flight bound its answer may still come: no finding yet.
    let rec = f.reconciler();
    let c = rec.compare_once().await.unwrap();
    assert_eq!(c.unrecorded_copy, 0, "{c:?}");
    // Past it, the copy is reported.
    f.clock.advance(BOUND_MS + 10_000);
    let c = rec.compare_once().await.unwrap();
    let recorded = f.count(&format!("SELECT count(*) FROM outbox_duplicate_receipts WHERE event_id = '{id}' AND \"offset\" = {}", r1.offset)).await;
    assert!(c.unrecorded_copy == 1 || recorded == 1, "the open attempt's copy at offset {} is neither a receipt nor a finding: {c:?}", r1.offset);
    assert_eq!(f.findings("unrecorded_copy", &id).await, 1);
}
