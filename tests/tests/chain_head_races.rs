//! Two races of the "chains" dispatch path (the ordering-chain heads of the
//! schema's section 7: `outbox_chain_heads`, `outbox_chain_arrivals`,
//! `outbox_link_arrivals`, `outbox_chain_advance`, `outbox_chain_follow`,
//! `outbox_chain_move`), over real PostgreSQL, each forced into the
//! interleaving that broke the chains path before its fix.
//!
//! These tests ASSERT THE INVARIANT: no committed head names an event that
//! left its chain or is closed (PUBLISHED, RETAINED, PURGED, SKIPPED); the
//! key's later events are claimed and published; a dispatcher scoped to one
//! cluster never claims an event frozen for another. Before the fix each
//! interleaving broke it (the races as filed are quoted on each test).
//!
//! No timing luck: each interleaving is forced with explicit transactions
//! on separate connections. The operation under test runs in a spawned task
//! through the shipped API (`OutboxStore`, `MigrationStore`) or the shipped
//! SQL function; a second, raw transaction holds a row lock (or an
//! uncommitted row) that parks it at the chosen statement; the test
//! waits until PostgreSQL reports that backend waiting on a lock
//! (`pg_stat_activity`), runs the other side, then releases the lock. Where
//! the fixed schema makes the other side wait in turn (on the chain's head
//! row), the test waits for that too, and releases the first.
//! Every test has a database of its own (`sqlx::test`) and names its topic
//! and keys with a random suffix.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{AttemptRecord, BrokerReceipt, ClaimedEvent, Clock, EventId, EventState, ManualClock, MigrationFence, OutboxStore, ReceiptDecision, RetryPolicy, RoutePolicy};
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

    /// Makes `id` (of `chain`, which has no head yet) CLAIMED without a
    /// head, as the exception lane receives a handed-out stream event.
    async fn claim_without_head(&self, id: &str, chain: i64) {
        sqlx::query("UPDATE outbox_events SET state = 'CLAIMED', claim_owner = 'lane', claim_generation = claim_generation + 1, lease_until_ms = $2 WHERE event_id = $1")
            .bind(id)
            .bind(self.clock.now_ms() + LEASE_MS)
            .execute(&self.pool)
            .await
            .unwrap();
        assert_eq!(self.head(chain).await, None);
    }

    /// Reads `id` for a migration (it must be PENDING) and spawns the
    /// migration's commit, to the same topic on the new cluster, fenced by
    /// the generation read.
    async fn migrate_to_new_cluster(&self, id: &str) -> tokio::task::JoinHandle<Result<MigrationOutcome, outbox_producer::ProducerError>> {
        let event_id: EventId = id.parse().unwrap();
        let (state, generation) = self.store.migration_read(&event_id).await.unwrap();
        assert_eq!(state, EventState::Pending, "{id} read for its migration");
        let (store, new_route) = (self.store.clone(), RoutePolicy::new(ORDER_CREATED, NEW_CLUSTER, &self.topic, PARTITIONS));
        tokio::spawn(async move { store.commit_migration(&event_id, &new_route, "ops", &RetryPolicy::default(), &MigrationFence::Generation(generation), None, false).await })
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

    /// Asserts that no committed head names an event that is not an open,
    /// ordered event of the head's own chain, with the claimability of its
    /// event (claimable exactly while PENDING).
    async fn assert_heads_sound(&self) {
        let bad: Vec<(i64, String, Option<i64>, Option<i64>, Option<String>, Option<i64>)> = sqlx::query_as(
            "SELECT h.key_chain, h.event_id, h.claimable_at_ms, e.key_chain, e.state, e.next_check_at_ms
             FROM outbox_chain_heads h LEFT JOIN outbox_events e ON e.event_id = h.event_id
             WHERE e.event_id IS NULL OR e.key_chain <> h.key_chain OR NOT e.ordered
                OR e.phase IN ('PUBLISHED', 'RETAINED', 'PURGED', 'SKIPPED')
                OR h.claimable_at_ms IS DISTINCT FROM (CASE WHEN e.state = 'PENDING' THEN e.next_check_at_ms END)",
        )
        .fetch_all(&self.pool)
        .await
        .unwrap();
        assert!(bad.is_empty(), "heads on events that left their chain, closed, or with a stale claimability: {bad:?}");
    }

    /// Claims with `store` (time moved past every backoff) and publishes
    /// what it claims, round after round, until every event of `ids` is
    /// PUBLISHED; fails if a round claims nothing first (a key is stuck).
    async fn drain(&self, store: &PgStore, ids: &[&str]) {
        for _ in 0..10 {
            let mut open = Vec::new();
            for id in ids {
                if self.event(id).await.1 != EventState::Published {
                    open.push(*id);
                }
            }
            if open.is_empty() {
                return;
            }
            self.clock.advance(60_000);
            let claimed = self.claim(store, "drain").await;
            assert!(!claimed.is_empty(), "nothing claimed while {open:?} are open: a key is stuck");
            for ev in &claimed {
                self.publish(ev).await;
            }
        }
        panic!("{ids:?} not all published after 10 rounds");
    }
}

/// The ACK of attempt `a` of `ev`, at its frozen destination.
fn receipt(ev: &ClaimedEvent, a: &AttemptRecord) -> BrokerReceipt {
    outbox_tests::ack_receipt(ev, a, ev.destination.partition, 0)
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

/// Waits until the operation `task` either waits on a lock at a statement
/// starting with `statement` or finishes (the schema need not make it wait:
/// before the fix, nothing did).
async fn wait_blocked_or_done<T>(pool: &PgPool, statement: &str, task: &tokio::task::JoinHandle<T>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let sql = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE $1 || '%'";
    loop {
        let n: i64 = sqlx::query_scalar(sql).bind(statement).fetch_one(pool).await.unwrap();
        if n > 0 || task.is_finished() {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "`{statement}` neither waited nor finished");
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
/// claimed and sending. The receipt transaction goes first here.
///
/// 1. A raw transaction H locks E1's attempt row (`FOR UPDATE`).
/// 2. The receipt transaction R of E1's ACK (`accept_dispatch_receipt`,
///    spawned) publishes E1: `outbox_chain_follow` moves C_old's head to
///    E2 (uncommitted, R holds the head row), then R waits at `UPDATE
///    outbox_attempts` (H's lock).
/// 3. The migration M of E2 to cluster-b (`commit_migration`, spawned).
///    Before the fix it ran to its commit: its `outbox_chain_move` saw
///    C_old's head on E1 and left it alone, so R then committed C_old's
///    head on E2, which had left C_old. Now M waits for R: R holds E2, the
///    event it made C_old's head (`outbox_chain_rehead`), and M's move
///    would lock C_old's head row after it.
/// 4. H commits; R commits; M takes the head row, sees it on E2 (its own
///    moved event) and moves it to E3, and commits.
///
/// Invariant: C_old's head is E3; a cluster-a dispatcher claims E3, never
/// E2's generation frozen for cluster-b; a cluster-b dispatcher claims E2;
/// every event of the key is published.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn chains_path_migration_racing_the_receipt_keeps_the_old_chain_moving(pool: PgPool) {
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
    // 3. The migration of E2 to another cluster, meanwhile: it waits for
    //    R, which holds E2 (the event it made C_old's head), at its lock of
    //    E2 (before the fix it committed here).
    let m = db.migrate_to_new_cluster(&e2).await;
    wait_blocked_or_done(&db.pool, "SELECT e.state, e.envelope_generation", &m).await;
    // 4. H, then R, then M, commit.
    h.commit().await.unwrap();
    let published = tokio::time::timeout(Duration::from_secs(20), r).await.unwrap().unwrap().unwrap();
    assert!(matches!(published.decision, ReceiptDecision::Accept { .. }), "{published:?}");
    let moved = tokio::time::timeout(Duration::from_secs(20), m).await.unwrap().unwrap().unwrap();
    assert!(matches!(moved, MigrationOutcome::Migrated { to_generation: 2, .. }), "{moved:?}");

    assert_ne!(db.event(&e2).await.0, old_chain, "the migration moved E2 to another chain");
    db.assert_heads_sound().await;
    assert_eq!(db.head(old_chain).await, Some((e3.clone(), true)), "C_old's head is its next open event, E3");
    // A dispatcher of the old cluster claims E3 (its own), never E2.
    let old_cluster_only = db.store.clone().scoped_to_cluster(OLD_CLUSTER);
    let third = db.claim_only(&old_cluster_only, &e3).await;
    assert_eq!(third.destination.cluster_id, OLD_CLUSTER);
    db.publish(&third).await;
    // A dispatcher of the new cluster claims E2's new generation.
    let new_cluster_only = db.store.clone().scoped_to_cluster(NEW_CLUSTER);
    let second = db.claim_only(&new_cluster_only, &e2).await;
    assert_eq!((second.envelope.envelope_generation, second.destination.cluster_id.as_str()), (2, NEW_CLUSTER));
    db.publish(&second).await;
    db.assert_heads_sound().await;
    assert_eq!(db.head(old_chain).await, None, "C_old has no open event left");
    // The key goes on: a later event is claimed and published.
    let e4 = db.emit(&key, 4).await;
    db.drain(&old_cluster_only, &[&e4]).await;
}

/// Race 1 the other way round: the migration takes C_old's head row
/// first, and the receipt transaction publishing the head waits for it.
///
/// 1. A raw transaction Q locks the migration receipts' table against
///    inserts (`SHARE` mode): M will wait at its insert.
/// 2. The migration M of E2 to cluster-b (spawned) moves E2, then waits at
///    `INSERT INTO outbox_migration_receipts` (Q). Its move holds C_old's
///    head row (on E1, which stays the head).
/// 3. The receipt transaction R of E1's ACK (spawned). Before the fix, it
///    moved C_old's head to E2 (still C_old's in R's snapshot) and
///    committed. Now it waits on C_old's head row (M).
/// 4. Q rolls back; M commits; R takes the head row and, with a snapshot
///    taken after M's commit, moves the head to E3.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn chains_path_receipt_racing_the_migration_keeps_the_old_chain_moving(pool: PgPool) {
    let db = db(pool).await;
    let key = db.key("k");
    let e1 = db.emit(&key, 1).await;
    let e2 = db.emit(&key, 2).await;
    let e3 = db.emit(&key, 3).await;
    let old_chain = db.event(&e1).await.0;
    let first = db.claim_only(&db.store, &e1).await;
    let attempt = db.store.register_attempt(&first.token).await.unwrap();

    // 1. Q holds the migration receipts' table against inserts.
    let mut q = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE outbox_migration_receipts IN SHARE MODE").execute(&mut *q).await.unwrap();
    // 2. M moves E2 and parks.
    let m = db.migrate_to_new_cluster(&e2).await;
    wait_blocked(&db.pool, "INSERT INTO outbox_migration_receipts", &m).await;
    // 3. R publishes E1: it waits for M on C_old's head row (before the
    //    fix it committed C_old's head on E2).
    let r = {
        let (store, ack) = (db.store.clone(), receipt(&first, &attempt));
        tokio::spawn(async move { store.accept_dispatch_receipt(&ack).await })
    };
    wait_blocked_or_done(&db.pool, "UPDATE outbox_events", &r).await;
    // 4. Q rolls back, M commits, R commits.
    q.rollback().await.unwrap();
    let moved = tokio::time::timeout(Duration::from_secs(20), m).await.unwrap().unwrap().unwrap();
    assert!(matches!(moved, MigrationOutcome::Migrated { to_generation: 2, .. }), "{moved:?}");
    let published = tokio::time::timeout(Duration::from_secs(20), r).await.unwrap().unwrap().unwrap();
    assert!(matches!(published.decision, ReceiptDecision::Accept { .. }), "{published:?}");

    db.assert_heads_sound().await;
    assert_eq!(db.head(old_chain).await, Some((e3.clone(), true)), "C_old's head is its next open event, E3");
    let old_cluster_only = db.store.clone().scoped_to_cluster(OLD_CLUSTER);
    let third = db.claim_only(&old_cluster_only, &e3).await;
    db.publish(&third).await;
    let new_cluster_only = db.store.clone().scoped_to_cluster(NEW_CLUSTER);
    db.drain(&new_cluster_only, &[&e2]).await;
    db.assert_heads_sound().await;
}

/// The claim re-checks a head's event against the head: an event that is
/// not in the head's chain (a head left stale by any means, here written
/// by hand) is not claimed through it, and a cluster-scoped claim never
/// takes an event frozen for another cluster.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_claim_refuses_a_head_whose_event_left_its_chain(pool: PgPool) {
    let db = db(pool).await;
    let key = db.key("k");
    let e1 = db.emit(&key, 1).await;
    let e2 = db.emit(&key, 2).await;
    let old_chain = db.event(&e1).await.0;
    // E1 is the head, claimed; E2 moves to cluster-b (and arrives on its chain).
    db.claim_only(&db.store, &e1).await;
    let e2_id: EventId = e2.parse().unwrap();
    let (_, generation) = db.store.migration_read(&e2_id).await.unwrap();
    let new_route = RoutePolicy::new(ORDER_CREATED, NEW_CLUSTER, &db.topic, PARTITIONS);
    let moved = db.store.commit_migration(&e2_id, &new_route, "ops", &RetryPolicy::default(), &MigrationFence::Generation(generation), None, false).await.unwrap();
    assert!(matches!(moved, MigrationOutcome::Migrated { .. }), "{moved:?}");
    // A stale head, by hand: C_old's head on E2 (now on C_new, cluster-b).
    let (seq, proto): (i64, i16) = sqlx::query_as("SELECT seq, protocol_version FROM outbox_events WHERE event_id = $1").bind(&e2).fetch_one(&db.pool).await.unwrap();
    sqlx::query("UPDATE outbox_chain_heads SET event_id = $2, seq = $3, claimable_at_ms = 0, cluster_id = $4, protocol_version = $5 WHERE key_chain = $1")
        .bind(old_chain)
        .bind(&e2)
        .bind(seq)
        .bind(OLD_CLUSTER)
        .bind(proto)
        .execute(&db.pool)
        .await
        .unwrap();
    // A cluster-a dispatcher claims nothing through it.
    let old_cluster_only = db.store.clone().scoped_to_cluster(OLD_CLUSTER);
    db.clock.advance(60_000);
    let claimed = db.claim(&old_cluster_only, "a").await;
    assert!(claimed.iter().all(|c| c.envelope.event_id.as_str() != e2), "a cluster-a dispatcher claimed E2, frozen for cluster-b: {claimed:?}");
    // An unscoped claim does not take E2 through C_old's head either; it
    // takes it through C_new's head only.
    let claimed = db.claim(&db.store, "any").await;
    assert_eq!(claimed.iter().filter(|c| c.envelope.event_id.as_str() == e2).count(), 1, "E2 claimed once, through its own chain's head");
    let new_chain = db.event(&e2).await.0;
    assert_eq!(db.head(new_chain).await.map(|h| h.0), Some(e2.clone()));
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
///    in S, conflicts with no live row now: inserted. Before the fix it
///    stayed, claimable, on b1, which is PUBLISHED: every later event of
///    the key (b3) waited behind it until retention moved b1 on. Now the
///    linker re-reads the heads it inserted with a snapshot taken after the
///    insert (after its waits): b1 is closed and B has no open event, so it
///    removes that head again (and leaves B an arrival).
///
/// Invariant: B's head never names b1; b3, emitted next, is claimed and
/// published; key A is unharmed (L2 claims a1, linked by X).
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn chains_path_linker_waiting_on_a_conflict_never_heads_a_published_event(pool: PgPool) {
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
    let a2 = db.emit(&a, 2).await;
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
    // 6. X commits; L2 links with what it chose in its snapshot.
    tx_x.commit().await.unwrap();
    let claimed = tokio::time::timeout(Duration::from_secs(20), l2).await.unwrap().unwrap().unwrap();
    assert_eq!(claimed.iter().map(|c| c.envelope.event_id.as_str()).collect::<Vec<_>>(), [a1.as_str()], "L2 claims A's head");

    // The invariant: no head on b1 (PUBLISHED), nor on any closed event.
    assert_eq!(db.event(&b1).await, (chain_b, EventState::Published));
    assert!(db.head(chain_b).await.is_none_or(|h| h.0 != b1), "B's head is on b1, PUBLISHED");
    db.assert_heads_sound().await;
    // Key A, linked by X, is unharmed: its head is a1, claimed by L2.
    assert_eq!(db.head(chain_a).await.map(|h| h.0), Some(a1.clone()));
    // The key goes on: b3 is claimed and published; so is A's backlog.
    let b3 = db.emit(&b, 3).await;
    let l2_claim = claimed.into_iter().next().unwrap();
    db.publish(&l2_claim).await;
    db.drain(&db.store, &[&b3, &a2]).await;
    db.assert_heads_sound().await;
}

/// The linker against a writer of an event claimed without its chain's
/// head, as the stream's exception lane copies events in (CLAIMED,
/// SENDING, PUBLISHED): lane chain heads were seen on a PENDING event with
/// `claimable_at_ms` NULL, and the key's later events never claimed.
///
/// 1. e1, e2 of one key; e1 is claimed without a head (the lane's way:
///    its chain has none yet, and its arrival waits).
/// 2. A raw transaction W releases e1 (CLAIMED -> PENDING, as a lease
///    expiry does) and stays open: its trigger saw no head to update.
/// 3. A claim links the chain meanwhile. Before the fix it installed the
///    head on e1, not claimable (CLAIMED in its snapshot), and W's commit
///    left it so: e1 PENDING behind a head that is never offered. Now the
///    linker holds the event it heads (FOR SHARE, skipping one being
///    written): e1 is being written, so the chain is given back to a
///    later linker (an arrival), which sees e1 PENDING.
/// 4. W commits. Every head is sound, and e1 and e2 are claimed and
///    published.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn chains_path_linker_racing_a_release_of_an_event_claimed_without_a_head(pool: PgPool) {
    let db = db(pool).await;
    let key = db.key("k");
    let e1 = db.emit(&key, 1).await;
    let e2 = db.emit(&key, 2).await;
    let chain = db.event(&e1).await.0;
    // 1. e1 claimed without a head.
    db.claim_without_head(&e1, chain).await;
    // 2. W releases e1 and stays open.
    let mut w = db.pool.begin().await.unwrap();
    sqlx::query("UPDATE outbox_events SET state = 'PENDING', claim_owner = NULL, lease_until_ms = NULL, claim_generation = claim_generation + 1 WHERE event_id = $1")
        .bind(&e1)
        .execute(&mut *w)
        .await
        .unwrap();
    // 3. A claim links the chain meanwhile (it waits for nothing).
    let claimed = tokio::time::timeout(Duration::from_secs(20), db.store.claim_batch("l", 100, LEASE_MS)).await.unwrap().unwrap();
    assert!(claimed.is_empty(), "{claimed:?}");
    // 4. W commits.
    w.commit().await.unwrap();
    db.assert_heads_sound().await;
    db.drain(&db.store, &[&e1, &e2]).await;
    db.assert_heads_sound().await;
}

/// A head moved onto an event another transaction is writing (the stream's
/// checker, once in CI: 18 events of one key PENDING in the exception lane
/// for good). A re-heading that names a new event (a migration's move out
/// of the chain, a head closing) chose it in its own snapshot and copied
/// its claimability from there; a transaction writing that event
/// meanwhile could not see the new head row (uncommitted), so its own
/// trigger left it alone, and the head committed "not claimable" on an
/// event that was PENDING: the chain's arrivals were then consumed by
/// linkers that found a head, and nothing claimed the key again.
///
/// Key K, chain C: e1 CLAIMED with no head (as a handed-out stream event
/// reaches the lane), e2 and e3 PENDING.
/// 1. A raw transaction Q locks the migration receipts' table against
///    inserts: the migration M will park at its insert.
/// 2. M moves e2 to another cluster; its move re-heads C on e1 (CLAIMED,
///    not claimable) and parks.
/// 3. W releases e1 (CLAIMED -> PENDING, as a failed registration's
///    release does). Before the fix it committed at once, its trigger blind
///    to M's head. Now M holds e1 (it holds every event it newly heads, as
///    the linker does), and W waits for M.
/// 4. Q rolls back; M commits; W commits.
///
/// Invariant: every head is sound (claimable exactly while its event is
/// PENDING) and every event of the key is claimed and published.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_reheading_racing_a_write_of_the_new_head_leaves_it_claimable(pool: PgPool) {
    let db = db(pool).await;
    let key = db.key("k");
    let e1 = db.emit(&key, 1).await;
    let e2 = db.emit(&key, 2).await;
    let e3 = db.emit(&key, 3).await;
    let chain = db.event(&e1).await.0;
    db.claim_without_head(&e1, chain).await;

    // 1. Q holds the migration receipts' table against inserts.
    let mut q = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE outbox_migration_receipts IN SHARE MODE").execute(&mut *q).await.unwrap();
    // 2. M moves e2 (re-heading C on e1) and parks.
    let m = db.migrate_to_new_cluster(&e2).await;
    wait_blocked(&db.pool, "INSERT INTO outbox_migration_receipts", &m).await;
    // 3. W releases e1.
    let w = {
        let (pool, e1) = (db.pool.clone(), e1.clone());
        tokio::spawn(async move {
            sqlx::query("UPDATE outbox_events SET state = 'PENDING', claim_owner = NULL, lease_until_ms = NULL WHERE event_id = $1 AND state = 'CLAIMED'")
                .bind(&e1)
                .execute(&pool)
                .await
                .map(|r| r.rows_affected())
        })
    };
    wait_blocked_or_done(&db.pool, "UPDATE outbox_events SET state = 'PENDING'", &w).await;
    // 4. Q rolls back, M commits, W commits.
    q.rollback().await.unwrap();
    let moved = tokio::time::timeout(Duration::from_secs(20), m).await.unwrap().unwrap().unwrap();
    assert!(matches!(moved, MigrationOutcome::Migrated { to_generation: 2, .. }), "{moved:?}");
    let released = tokio::time::timeout(Duration::from_secs(20), w).await.unwrap().unwrap().unwrap();
    assert_eq!(released, 1, "e1 released");

    db.assert_heads_sound().await;
    db.drain(&db.store, &[&e1, &e2, &e3]).await;
    db.assert_heads_sound().await;
}
