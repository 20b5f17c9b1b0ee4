//! Reproductions of two known races of today's "chains" dispatch path (the
//! ordering-chain heads of the schema's section 7: `outbox_chain_heads`,
//! `outbox_chain_arrivals`, `outbox_link_arrivals`, `outbox_chain_advance`,
//! `outbox_chain_follow`, `outbox_chain_move`), over real PostgreSQL.
//!
//! These tests ASSERT THAT THE HARM OCCURS: each passes when its race
//! reproduces on the chains path. They are the record of the defects the
//! "stream" path replaces; that path gets the same scenarios, asserting
//! the opposite. When the chains path is fixed or removed, these tests are
//! expected to fail (or go).
//!
//! No timing luck: each interleaving is forced with explicit transactions
//! on separate connections. The operation under test runs in a spawned task
//! through the shipped API (`OutboxStore`, `MigrationStore`) or the shipped
//! SQL function; a second, raw transaction holds a row lock (or an
//! uncommitted head row) that parks it at the chosen statement; the test
//! waits until PostgreSQL reports that backend waiting on a lock
//! (`pg_stat_activity`), runs the other side, then releases the lock.
//! Every test has a database of its own (`sqlx::test`) and names its topic
//! and keys with a random suffix.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{AttemptRecord, BrokerReceipt, ClaimedEvent, EventId, EventState, ManualClock, MigrationFence, OutboxStore, ReceiptDecision, RetryPolicy, RoutePolicy};
use outbox_producer::{emit, EmitOptions, MigrationOutcome, MigrationStore, PgStore};
use outbox_tests::*;
use sqlx::{PgPool, Postgres, Transaction};

const OLD_CLUSTER: &str = "cluster-a";
const NEW_CLUSTER: &str = "cluster-b";
const PARTITIONS: u32 = 3;
const LEASE_MS: i64 = 30_000;

/// The test's database, its topic and a store on a manual clock.
struct Db {
    pool: PgPool,
    topic: String,
    sfx: String,
    clock: ManualClock,
    store: PgStore,
}

async fn db(pool: PgPool) -> Db {
    let sfx = format!("{:x}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() ^ std::process::id() as u128);
    let topic = format!("orders-{sfx}");
    route(&pool, ORDER_CREATED, OLD_CLUSTER, &topic, PARTITIONS).await;
    let now: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::bigint").fetch_one(&pool).await.unwrap();
    let clock = ManualClock::new(now);
    let store = PgStore::with_clock(pool.clone(), Arc::new(clock.clone()));
    Db { pool, topic, sfx, clock, store }
}

impl Db {
    /// A key (an aggregate id) of this test.
    fn key(&self, name: &str) -> String {
        format!("{name}-{}", self.sfx)
    }

    /// Emits version `version` of `aggregate` in `tx`; its event id.
    async fn emit_in(&self, tx: &mut Transaction<'_, Postgres>, aggregate: &str, version: i64) -> String {
        let payload = order_payload(aggregate, version);
        let command_key = format!("{aggregate}-v{version}");
        let mut req = order_request(&command_key, aggregate, &payload);
        req.aggregate_version = version;
        emit(tx, &req, &EmitOptions::default()).await.unwrap().event_id().as_str().to_owned()
    }

    /// Emits version `version` of `aggregate` in a business transaction of its own.
    async fn emit(&self, aggregate: &str, version: i64) -> String {
        let mut tx = self.pool.begin().await.unwrap();
        let id = self.emit_in(&mut tx, aggregate, version).await;
        tx.commit().await.unwrap();
        id
    }

    /// The ordering chain `aggregate`'s events take, read from an emit that
    /// is rolled back (the generated column, not a copy of its formula).
    async fn chain_of_key(&self, aggregate: &str) -> i64 {
        let mut tx = self.pool.begin().await.unwrap();
        let id = self.emit_in(&mut tx, aggregate, 1).await;
        let chain = sqlx::query_scalar("SELECT key_chain FROM outbox_events WHERE event_id = $1").bind(&id).fetch_one(&mut *tx).await.unwrap();
        tx.rollback().await.unwrap();
        chain
    }

    /// The event's current chain and state.
    async fn event(&self, id: &str) -> (i64, EventState) {
        let (chain, state): (i64, String) = sqlx::query_as("SELECT key_chain, state FROM outbox_events WHERE event_id = $1").bind(id).fetch_one(&self.pool).await.unwrap();
        (chain, EventState::parse(&state).unwrap())
    }

    /// The head row of `chain`: its event and whether the head scan offers it.
    async fn head(&self, chain: i64) -> Option<(String, bool)> {
        sqlx::query_as("SELECT event_id, claimable_at_ms IS NOT NULL FROM outbox_chain_heads WHERE key_chain = $1").bind(chain).fetch_optional(&self.pool).await.unwrap()
    }

    /// Claims (every chain's head) as `owner` with `store`.
    async fn claim(&self, store: &PgStore, owner: &str) -> Vec<ClaimedEvent> {
        store.claim_batch(owner, 100, LEASE_MS).await.unwrap()
    }

    /// Claims exactly `id` (and nothing else) with `store`.
    async fn claim_only(&self, store: &PgStore, id: &str) -> ClaimedEvent {
        let mut claimed = self.claim(store, "d").await;
        assert_eq!(claimed.iter().map(|c| c.envelope.event_id.as_str()).collect::<Vec<_>>(), [id], "the claim");
        claimed.pop().unwrap()
    }

    /// Registers an attempt of `ev` and accepts its ACK: PUBLISHED.
    async fn publish(&self, ev: &ClaimedEvent) {
        let a = self.store.register_attempt(&ev.token).await.unwrap();
        let out = self.store.accept_dispatch_receipt(&receipt(ev, &a)).await.unwrap();
        assert_eq!(out.state, EventState::Published, "{out:?}");
    }

    /// Asserts that `id` is never claimed: the key is stuck. Claims over
    /// every head, time moved past every lease and the lease sweep run in
    /// between, several rounds; `id` stays PENDING.
    async fn assert_never_claimable(&self, id: &str) {
        for _ in 0..3 {
            self.clock.advance(10 * 60_000);
            self.store.expire_leases().await.unwrap();
            let claimed = self.claim(&self.store, "late").await;
            assert!(claimed.iter().all(|c| c.envelope.event_id.as_str() != id), "{id} was claimed: the key is not stuck");
        }
        assert_eq!(self.event(id).await.1, EventState::Pending);
    }
}

/// The ACK of attempt `a` of `ev`, at its frozen destination.
fn receipt(ev: &ClaimedEvent, a: &AttemptRecord) -> BrokerReceipt {
    BrokerReceipt {
        event_id: ev.envelope.event_id.clone(),
        envelope_generation: ev.envelope.envelope_generation,
        attempt_id: a.attempt_id.clone(),
        payload_digest: ev.envelope.payload_digest.clone(),
        destination_digest: ev.destination_digest.clone(),
        cluster_id: ev.destination.cluster_id.clone(),
        topic: ev.destination.topic.clone(),
        topic_id: ev.destination.topic_id.clone(),
        partition: ev.destination.partition,
        offset: 0,
        key: Some(ev.destination.routing_key.as_bytes().to_vec()),
    }
}

/// Waits until a backend of this test's database whose statement starts
/// with `statement` waits on a lock (the spawned operation is parked where
/// the test wants it); fails if `task` ends first.
async fn wait_blocked<T>(pool: &PgPool, statement: &str, task: &tokio::task::JoinHandle<T>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let sql = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE $1 || '%'";
    loop {
        let n: i64 = sqlx::query_scalar(sql).bind(statement).fetch_one(pool).await.unwrap();
        if n > 0 {
            return;
        }
        assert!(!task.is_finished(), "the operation finished without waiting at `{statement}`");
        assert!(tokio::time::Instant::now() < deadline, "nothing ever waited at `{statement}`");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Race 1, as filed: "A destination migration that commits while the
/// receipt transaction publishes the head of the moving event's old chain
/// leaves that chain's head on an event that has left it: every later event
/// of the key stays PENDING for good, and for a migration to another
/// cluster a dispatcher of the old cluster can claim the new generation
/// (the claim re-checks neither cluster nor chain)."
///
/// Key K, chain C_old (cluster-a): E1, E2, E3, all PENDING; E1 is the head,
/// claimed and sending.
///
/// 1. A raw transaction H locks E1's attempt row (`FOR UPDATE`).
/// 2. The receipt transaction R of E1's ACK (`accept_dispatch_receipt`,
///    spawned) locks E1, runs `UPDATE outbox_events SET state =
///    'PUBLISHED'`, whose statement trigger `outbox_chain_follow` calls
///    `outbox_chain_advance`: in R's snapshot E2 is C_old's next open
///    event, so the head row becomes (C_old, E2), uncommitted. R then
///    inserts the publish receipt and waits at `UPDATE outbox_attempts`
///    (H's lock).
/// 3. The migration of E2 to cluster-b (`MigrationStore::commit_migration`,
///    the shipped commit) runs to its commit: it locks only E2's row (not
///    the head row), and its row trigger `outbox_chain_move` asks whether
///    E2 heads C_old: in its snapshot the head is still (C_old, E1), so it
///    advances nothing; it adds an arrival for C_new. Nothing it touches is
///    locked by R, nothing R touches is locked by it.
/// 4. H commits; R commits. C_old's head is E2, which is now on C_new.
///
/// Harm: C_old's head row names E2, an event of another chain and cluster,
/// and stays claimable; a dispatcher scoped to cluster-a claims E2's new
/// generation (frozen for cluster-b) through it; once E2 is PUBLISHED,
/// nothing ever moves C_old's head again (`outbox_chain_follow` joins heads
/// on the event's *new* chain), so E3 stays PENDING for good.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn chains_path_migration_racing_the_receipt_leaves_the_key_stuck(pool: PgPool) {
    let db = db(pool).await;
    let key = db.key("k");
    let e1 = db.emit(&key, 1).await;
    let e2 = db.emit(&key, 2).await;
    let e3 = db.emit(&key, 3).await;
    let old_chain = db.event(&e1).await.0;
    let first = db.claim_only(&db.store, &e1).await;
    let attempt = db.store.register_attempt(&first.token).await.unwrap();

    // 1. H holds E1's attempt row.
    let mut h = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM outbox_attempts WHERE attempt_id = $1 FOR UPDATE").bind(attempt.attempt_id.as_str()).execute(&mut *h).await.unwrap();
    // 2. R publishes E1 (head advanced to E2, uncommitted) and parks.
    let r = {
        let (store, ack) = (db.store.clone(), receipt(&first, &attempt));
        tokio::spawn(async move { store.accept_dispatch_receipt(&ack).await })
    };
    wait_blocked(&db.pool, "UPDATE outbox_attempts", &r).await;
    // 3. The migration of E2 to another cluster commits meanwhile.
    let e2_id: EventId = e2.parse().unwrap();
    let (state, generation) = db.store.migration_read(&e2_id).await.unwrap();
    assert_eq!(state, EventState::Pending);
    let new_route = RoutePolicy::new(ORDER_CREATED, NEW_CLUSTER, &db.topic, PARTITIONS);
    let moved = db.store.commit_migration(&e2_id, &new_route, "ops", &RetryPolicy::default(), &MigrationFence::Generation(generation), None, false).await.unwrap();
    assert!(matches!(moved, MigrationOutcome::Migrated { to_generation: 2, .. }), "{moved:?}");
    // 4. H, then R, commit.
    h.commit().await.unwrap();
    let published = tokio::time::timeout(Duration::from_secs(20), r).await.unwrap().unwrap().unwrap();
    assert!(matches!(published.decision, ReceiptDecision::Accept { .. }), "{published:?}");

    // The harm: C_old's head is E2, which left C_old.
    let (new_chain, _) = db.event(&e2).await;
    assert_ne!(new_chain, old_chain, "the migration moved E2 to another chain");
    assert_eq!(db.head(old_chain).await, Some((e2.clone(), true)), "C_old's head is E2, an event that left it, and is offered");
    // A dispatcher of the old cluster claims E2's new generation, frozen
    // for the new cluster, through C_old's stale head.
    let old_cluster_only = db.store.clone().scoped_to_cluster(OLD_CLUSTER);
    let wrong = db.claim_only(&old_cluster_only, &e2).await;
    assert_eq!(wrong.envelope.envelope_generation, 2);
    assert_eq!(wrong.destination.cluster_id, NEW_CLUSTER, "a cluster-a dispatcher holds an event frozen for cluster-b");
    // E2 published: C_old's head stays on it; E3 is never claimed.
    db.publish(&wrong).await;
    assert_eq!(db.head(old_chain).await, Some((e2.clone(), true)), "C_old's head stays on E2, now PUBLISHED");
    db.assert_never_claimable(&e3).await;
    assert_eq!(db.event(&e3).await, (old_chain, EventState::Pending));
}

/// Race 2, as filed: "The arrivals linker chooses heads in a snapshot
/// taken before it waits on a conflicting insert, and can install a head
/// on an event already PUBLISHED, blocking its key until retention."
///
/// Two keys on chains A and B with key_chain(A) < key_chain(B) (the order
/// `outbox_chain_heads_insert` inserts in). Each step below is one commit
/// or one statement; X and L3 are claim transactions stopped after their
/// first statement, `SELECT outbox_link_arrivals(..)`.
///
/// 1. a1 committed (arrival of A). X links it: head (A, a1), uncommitted.
/// 2. b1 committed (arrival of B). L3 links it (a1's arrival is X's,
///    skipped): head (B, b1), uncommitted.
/// 3. b2, a2 committed (arrivals of B and A).
/// 4. A dispatcher's claim L2 (`claim_batch`, spawned) links: it takes the
///    arrivals of b2 and a2; neither chain has a visible head, so
///    `outbox_chain_heads_insert` runs one INSERT whose snapshot S chooses
///    (A, a1) and (B, b1), b1 PENDING. Inserting (A, a1) meets X's
///    uncommitted row: `ON CONFLICT` waits for X.
/// 5. L3 commits (head (B, b1)). A dispatcher claims b1 and publishes it
///    (head -> b2), claims b2 and publishes it: B has no open event left,
///    so `outbox_chain_advance` deletes B's head row (and adds an arrival).
/// 6. X commits. L2 wakes: (A, a1) conflicts, nothing done; (B, b1), chosen
///    in S, conflicts with no live row now: inserted, claimable, on b1,
///    which is PUBLISHED.
///
/// Harm: B's head names a PUBLISHED event and is offered to every head
/// scan; every later event of the key (b3) waits behind it, never claimed,
/// until retention moves b1 on (`outbox_chain_follow` on RETAINED).
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn chains_path_linker_with_a_stale_snapshot_heads_a_published_event(pool: PgPool) {
    let db = db(pool).await;
    let (x, y) = (db.key("x"), db.key("y"));
    let (cx, cy) = (db.chain_of_key(&x).await, db.chain_of_key(&y).await);
    assert_ne!(cx, cy);
    // A: the chain inserted first; B: the victim.
    let ((a, chain_a), (b, chain_b)) = if cx < cy { ((x, cx), (y, cy)) } else { ((y, cy), (x, cx)) };
    let link = "SELECT outbox_link_arrivals(2000)";

    // 1. X links a1's chain and stays open.
    let a1 = db.emit(&a, 1).await;
    let mut tx_x = db.pool.begin().await.unwrap();
    sqlx::query(link).execute(&mut *tx_x).await.unwrap();
    // 2. L3 links b1's chain and stays open.
    let b1 = db.emit(&b, 1).await;
    let mut l3 = db.pool.begin().await.unwrap();
    sqlx::query(link).execute(&mut *l3).await.unwrap();
    // 3. More events on both keys.
    let b2 = db.emit(&b, 2).await;
    db.emit(&a, 2).await;
    // 4. L2 chooses (A, a1) and (B, b1) in its snapshot and waits for X.
    let l2 = {
        let store = db.store.clone();
        tokio::spawn(async move { store.claim_batch("l2", 100, LEASE_MS).await })
    };
    wait_blocked(&db.pool, link.split('(').next().unwrap(), &l2).await;
    // 5. Meanwhile B's head is committed, b1 and b2 are published, and B's
    //    head row is deleted.
    l3.commit().await.unwrap();
    for ev in [&b1, &b2] {
        let claimed = db.claim_only(&db.store, ev).await;
        db.publish(&claimed).await;
    }
    assert_eq!(db.head(chain_b).await, None, "B has no open event: its head row is gone");
    // 6. X commits; L2 inserts the head it chose in its snapshot.
    tx_x.commit().await.unwrap();
    let claimed = tokio::time::timeout(Duration::from_secs(20), l2).await.unwrap().unwrap().unwrap();
    assert_eq!(claimed.iter().map(|c| c.envelope.event_id.as_str()).collect::<Vec<_>>(), [a1.as_str()], "L2 claims A's head");

    // The harm: B's head is b1, PUBLISHED, and offered to every head scan.
    assert_eq!(db.event(&b1).await, (chain_b, EventState::Published));
    assert_eq!(db.head(chain_b).await, Some((b1.clone(), true)), "B's head is on a PUBLISHED event");
    // Every later event of the key waits behind it.
    let b3 = db.emit(&b, 3).await;
    db.assert_never_claimable(&b3).await;
    assert_eq!(db.head(chain_b).await, Some((b1, true)));
    // Key A, linked by X, is unharmed: its head is a1, claimed by L2.
    assert_eq!(db.head(chain_a).await.map(|h| h.0), Some(a1));
}
