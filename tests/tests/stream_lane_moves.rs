//! Moves of stream events to the exception lane by an operator's
//! destination migration (`stream_event_to_lane`), racing the stream's own
//! dispatch: real PostgreSQL and librdkafka's in-process Kafka cluster.
//!
//! - A migration's move of a handed-out event, between its claim and its
//!   registration, must not let the registration go to the stream (the
//!   lane would not know the attempt, reject its receipt as
//!   `unregistered_attempt`, and send the event again).
//! - A migration's move of a key's later event must not let it overtake
//!   the key's earlier events still on the stream.

use outbox_core::{Broker, ClaimedEvent, EventState, OutboxStore, RetryPolicy, RoutePolicy, SendOutcome};
use outbox_producer::dispatcher::outgoing_message;
use outbox_producer::kafka::KafkaBroker;
use outbox_producer::{
    migrate_destination, migration::migrate_destination_with, Dispatcher, DispatcherConfig, DispatchPath, MigrationOutcome, Reconciler, ReconcilerConfig,
};
use outbox_tests::dispatch::{each_once_in_log, emit_many, keys_in_commit_order, PARTITIONS, TOPIC};
use outbox_tests::*;
use sqlx::PgPool;

/// The topic a migration would move events to.
const OTHER_TOPIC: &str = "orders-moved";
const LEASE_MS: i64 = 30_000;

/// The shared test stack, on the stream path, with a second topic to
/// migrate to.
struct Fixture(Stack);

impl std::ops::Deref for Fixture {
    type Target = Stack;
    fn deref(&self) -> &Stack {
        &self.0
    }
}

async fn fixture(pool: PgPool) -> Fixture {
    let s = stack(pool, TOPIC, PARTITIONS, |cfg| cfg.extra.push(("reconnect.backoff.max.ms".into(), "500".into()))).await;
    s.cluster.topic(OTHER_TOPIC, PARTITIONS);
    outbox_producer::set_dispatch_path(&s.pool, DispatchPath::Stream).await.unwrap();
    Fixture(s)
}

impl Fixture {
    fn retry(&self) -> RetryPolicy {
        RetryPolicy { in_flight_bound_ms: 30_000, ..RetryPolicy::default() }
    }

    fn other_route(&self) -> RoutePolicy {
        RoutePolicy::new(ORDER_CREATED, self.broker.cluster_id(), OTHER_TOPIC, PARTITIONS as u32)
    }

    fn dispatcher(&self) -> Dispatcher<KafkaBroker> {
        let cfg = DispatcherConfig { name: "d".into(), lease_ms: LEASE_MS, ..Default::default() };
        Dispatcher::new(self.store.clone(), self.broker.clone(), cfg).unwrap()
    }

    /// Sends the attempt's genuine message now and hands its receipt to the store.
    async fn send_and_settle(&self, ev: &ClaimedEvent, a: &outbox_core::AttemptRecord) -> outbox_core::ReceiptOutcome {
        let SendOutcome::Acked { partition, offset } = self.broker.send(outgoing_message(ev, a)).await else { panic!("send failed") };
        let receipt = ack_receipt(ev, a, partition, offset);
        self.store.accept_dispatch_receipt(&receipt).await.unwrap()
    }

    async fn state(&self, id: &str) -> EventState {
        let s: String = sqlx::query_scalar("SELECT outbox_event_state($1)").bind(id).fetch_one(&self.pool).await.unwrap();
        EventState::parse(&s).unwrap()
    }

    fn reconciler(&self) -> Reconciler<KafkaBroker> {
        let cfg = ReconcilerConfig { owner: "r".into(), retry: self.retry(), ..Default::default() };
        Reconciler::new(self.store.clone(), self.broker.clone(), cfg).unwrap()
    }

    /// Dispatches and reconciles until every event of the database is
    /// PUBLISHED (or the rounds run out): leases that ran out are swept
    /// between rounds.
    async fn drain(&self, d: &Dispatcher<KafkaBroker>) {
        let r = self.reconciler();
        for _ in 0..30 {
            let open = count(&self.pool, "SELECT count(*) FROM outbox_stream s WHERE outbox_event_state(s.event_id) <> 'PUBLISHED'").await;
            if open == 0 {
                return;
            }
            d.dispatch_once("w").await.unwrap();
            r.run_once().await.unwrap();
            self.clock.advance(LEASE_MS + 1_000);
            self.store.expire_leases().await.unwrap();
        }
    }

    /// Until `n` sessions wait for a lock (the lease row).
    async fn until_lock_waiters(&self, n: i64) {
        let waiting = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'";
        wait_count(&self.pool, waiting, n, std::time::Duration::from_secs(5)).await;
    }

    /// The invariants: each event once in the log (no copy that no receipt
    /// accounts for), no receipt refused as an unregistered attempt, no
    /// `unregistered_message` finding, each key's first copies in commit order.
    async fn assert_delivered_once_in_order(&self, ids: &[String]) {
        assert_eq!(count(&self.pool, "SELECT count(*) FROM outbox_audit WHERE action = 'receipt_rejected'").await, 0, "a genuine receipt was refused");
        assert_eq!(count(&self.pool, "SELECT count(*) FROM outbox_findings WHERE kind = 'unregistered_message'").await, 0);
        for id in ids {
            assert_eq!(self.state(id).await, EventState::Published, "{id}");
        }
        keys_in_commit_order(&self.pool, &self.cluster).await;
        each_once_in_log(&self.cluster, ids);
    }
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_migrations_move_between_hand_out_and_registration_keeps_the_attempt_known(pool: PgPool) {
    let f = fixture(pool).await;
    let e = create_order(&f.pool, "o-1", 1).await;
    let id = e.event_id().to_string();
    // A dispatcher's claim hands E out from a stream batch.
    let claimed = f.store.claim_batch("manual", 10, LEASE_MS).await.unwrap();
    let mine = claimed.into_iter().find(|c| c.envelope.event_id == *e.event_id()).expect("E handed out");
    // The interleaving of the checker's run, made deterministic by holding
    // E's bucket slot (its lease's lock): the operator's migration moves E to the lane
    // (waiting for the row, exclusively) while the dispatcher's
    // registration, which looked for a lane row before the move committed,
    // waits for the same row behind it.
    let mut holder = f.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM outbox_bucket_slots l JOIN outbox_stream s ON s.cluster_id = l.cluster_id AND s.bucket = l.bucket WHERE s.event_id = $1 FOR UPDATE OF l")
        .bind(&id)
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    let migration = {
        let (store, broker, event_id, route, retry) = (f.store.clone(), f.broker.clone(), e.event_id().clone(), f.other_route(), f.retry());
        tokio::spawn(async move { migrate_destination(&store, broker.as_ref(), &event_id, &route, "ops-alice", &retry).await.unwrap() })
    };
    f.until_lock_waiters(1).await;
    let registration = {
        let (store, token) = (f.store.clone(), mine.token.clone());
        tokio::spawn(async move { store.register_attempt(&token).await })
    };
    f.until_lock_waiters(2).await;
    holder.commit().await.unwrap();
    let out = migration.await.unwrap();
    let registered = registration.await.unwrap();
    // E is in the lane (CLAIMED there: the migration refused, nothing went to the other topic).
    assert!(matches!(out, MigrationOutcome::Refused { .. }), "{out:?}");
    assert_eq!(count(&f.pool, "SELECT count(*) FROM outbox_events").await, 1, "the migration moved E to the lane");
    // Registered or fenced, never behind the lane's back: an attempt the
    // dispatcher may send is one the lane (its proofs, its receipts) knows.
    let sent = match registered {
        Ok(a) => {
            let outcome = f.send_and_settle(&mine, &a).await;
            eprintln!("the dispatcher's attempt {} was settled as {outcome:?}", a.attempt_id);
            Some(a)
        }
        Err(e) => {
            eprintln!("the dispatcher's registration was refused: {e}");
            None
        }
    };
    // The lane must not send E again, whatever its leases do.
    let d = f.dispatcher();
    f.drain(&d).await;
    f.assert_delivered_once_in_order(&[id]).await;
    if let Some(a) = sent {
        let attempts = f.store.attempts(e.event_id()).await.unwrap();
        assert!(attempts.iter().any(|x| x.attempt_id == a.attempt_id), "the sent attempt is unknown to the lane: {attempts:?}");
    }
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_migration_of_a_registered_event_carries_its_attempt_into_the_lane(pool: PgPool) {
    let f = fixture(pool).await;
    let e = create_order(&f.pool, "o-1", 1).await;
    let id = e.event_id().to_string();
    let claimed = f.store.claim_batch("manual", 10, LEASE_MS).await.unwrap();
    let mine = claimed.into_iter().find(|c| c.envelope.event_id == *e.event_id()).unwrap();
    let a = f.store.register_attempt(&mine.token).await.unwrap();
    // Sent, its receipt not yet in: the migration must see the attempt.
    let SendOutcome::Acked { .. } = f.broker.send(outgoing_message(&mine, &a)).await else { panic!("send failed") };
    let out = migrate_destination(&f.store, f.broker.as_ref(), e.event_id(), &f.other_route(), "ops-alice", &f.retry()).await.unwrap();
    assert!(matches!(out, MigrationOutcome::Refused { .. }), "{out:?}");
    let attempts = f.store.attempts(e.event_id()).await.unwrap();
    assert!(attempts.iter().any(|x| x.attempt_id == a.attempt_id), "{attempts:?}");
    assert_eq!(f.state(&id).await, EventState::Sending);
    let d = f.dispatcher();
    f.drain(&d).await;
    f.assert_delivered_once_in_order(&[id]).await;
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_migrations_move_of_a_later_event_does_not_overtake_its_keys_earlier_events(pool: PgPool) {
    let f = fixture(pool).await;
    // One key, two events committed one after the other: D, then E.
    let ids = emit_many(&f.pool, 1, 2).await;
    let (d_id, e_id) = (ids[0].clone(), ids[1].clone());
    // A claim cuts a batch of D only (one event per key per batch): E is not cut yet.
    let claimed = f.store.claim_batch("manual", 10, LEASE_MS).await.unwrap();
    assert_eq!(claimed.iter().map(|c| c.envelope.event_id.to_string()).collect::<Vec<_>>(), vec![d_id.clone()]);
    let d_claim = claimed.into_iter().next().unwrap();
    assert_eq!(f.state(&e_id).await, EventState::Pending);
    // The operator's dry run moves E to the lane (and moves nothing else).
    let out = migrate_destination_with(&f.store, f.broker.as_ref(), &e_id.parse().unwrap(), &f.other_route(), "ops-alice", &f.retry(), true).await.unwrap();
    assert!(matches!(out, MigrationOutcome::WouldMigrate { .. } | MigrationOutcome::Refused { .. }), "{out:?}");
    // Another dispatcher runs meanwhile: E must not go before D.
    let d = f.dispatcher();
    d.dispatch_once("w").await.unwrap();
    // D's holder registers and sends it.
    let a = f.store.register_attempt(&d_claim.token).await.expect("D's registration");
    assert_eq!(f.send_and_settle(&d_claim, &a).await.state, EventState::Published);
    f.drain(&d).await;
    f.assert_delivered_once_in_order(&ids).await;
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_migrations_move_of_an_uncut_event_takes_its_keys_uncut_earlier_events_along(pool: PgPool) {
    let f = fixture(pool).await;
    // One key, three events: nothing cut yet when the operator moves the last.
    let ids = emit_many(&f.pool, 1, 3).await;
    let out = migrate_destination_with(&f.store, f.broker.as_ref(), &ids[2].parse().unwrap(), &f.other_route(), "ops-alice", &f.retry(), true).await.unwrap();
    assert!(matches!(out, MigrationOutcome::WouldMigrate { .. } | MigrationOutcome::Refused { .. }), "{out:?}");
    let d = f.dispatcher();
    f.drain(&d).await;
    f.assert_delivered_once_in_order(&ids).await;
}
