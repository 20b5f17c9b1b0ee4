//! The stream path (`outbox_producer::DispatchPath::Stream`) under the
//! shipped dispatcher, on real PostgreSQL and librdkafka's in-process
//! cluster: every event reaches the log once, each key's events in their
//! commit order, and the happy path leaves nothing in the exception lane.

use outbox_producer::{DispatcherConfig, DispatchPath};
use outbox_tests::count;
use outbox_tests::dispatch::{config, each_once_in_log, emit_many, keys_in_commit_order, run_two_dispatchers, started};
use sqlx::PgPool;

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn two_dispatchers_on_the_stream_publish_each_event_once_in_each_keys_commit_order(pool: PgPool) {
    outbox_producer::set_dispatch_path(&pool, DispatchPath::Stream).await.unwrap();
    let (cluster, _probe) = started(&pool, 5_000).await;
    let ids = emit_many(&pool, 20, 25).await;
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_stream").await, 500, "emit wrote stream rows");
    let cfg = DispatcherConfig { workers: 3, batch_size: 7, ..config("d") };
    run_two_dispatchers(&pool, &cluster, ids.len() as i64, cfg).await;

    assert_eq!(keys_in_commit_order(&pool, &cluster).await, 20);
    each_once_in_log(&cluster, &ids);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_duplicate_receipts").await, 0);
    // The happy path is inserts only: nothing went to the lane, and every
    // receipt names the batch that registered its attempt.
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 0, "an event left the happy path");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_publish_receipts WHERE batch_id IS NULL").await, 0);
    for id in &ids {
        let state: String = sqlx::query_scalar("SELECT outbox_event_state($1)").bind(id).fetch_one(&pool).await.unwrap();
        assert_eq!(state, "PUBLISHED", "{id}");
    }
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn many_keys_in_one_transaction_drain_on_the_stream(pool: PgPool) {
    outbox_producer::set_dispatch_path(&pool, DispatchPath::Stream).await.unwrap();
    let (cluster, _probe) = started(&pool, 5_000).await;
    let ids = emit_many(&pool, 1_500, 1).await;
    run_two_dispatchers(&pool, &cluster, ids.len() as i64, config("d")).await;
    each_once_in_log(&cluster, &ids);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 0, "an event left the happy path");
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn events_emitted_on_the_stream_drain_after_the_path_is_switched_back_to_chains(pool: PgPool) {
    // Events take the path of the moment they are emitted, and drain on
    // it whatever the setting says later: a switch back to the chains path
    // does not strand the stream's backlog.
    outbox_producer::set_dispatch_path(&pool, DispatchPath::Stream).await.unwrap();
    let (cluster, _probe) = started(&pool, 5_000).await;
    let mut ids = emit_many(&pool, 10, 5).await;
    // An emit that read the stream setting and commits after the switch.
    let mut late = pool.begin().await.unwrap();
    let late_payload = outbox_tests::order_payload("late", 1);
    let late_req = outbox_tests::order_request("late-command", "late-order", &late_payload);
    let late_id = outbox_producer::emit(&mut late, &late_req, &outbox_producer::EmitOptions::default()).await.unwrap().event_id().to_string();
    outbox_producer::set_dispatch_path(&pool, DispatchPath::Chains).await.unwrap();
    late.commit().await.unwrap();
    ids.push(late_id);
    for n in 0..50 {
        // Other orders (keys): a key's chains events do not wait for its
        // stream events (README, "The stream path").
        let (order, payload) = (format!("later-o-{}", n % 10), outbox_tests::order_payload("x", n));
        let command = format!("later-{n}");
        let req = outbox_core::EmitRequest { aggregate_version: n / 10, ..outbox_tests::order_request(&command, &order, &payload) };
        let mut tx = pool.begin().await.unwrap();
        ids.push(outbox_producer::emit(&mut tx, &req, &outbox_producer::EmitOptions::default()).await.unwrap().event_id().to_string());
        tx.commit().await.unwrap();
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_stream").await, 51);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_events").await, 50);
    run_two_dispatchers(&pool, &cluster, ids.len() as i64, config("d")).await;
    each_once_in_log(&cluster, &ids);
    for id in &ids {
        let state: String = sqlx::query_scalar("SELECT outbox_event_state($1)").bind(id).fetch_one(&pool).await.unwrap();
        assert_eq!(state, "PUBLISHED", "{id}");
    }
}

/// What a run wrote, per outbox table: (inserts, updates, deletes), from
/// `pg_stat_user_tables` (a partition of the stream under its own name).
type Writes = std::collections::BTreeMap<String, (i64, i64, i64)>;

async fn writes(pool: &PgPool) -> Writes {
    let rows: Vec<(String, i64, i64, i64)> =
        sqlx::query_as("SELECT relname::text, n_tup_ins, n_tup_upd, n_tup_del FROM pg_stat_user_tables WHERE relname LIKE 'outbox\\_%'").fetch_all(pool).await.unwrap();
    rows.into_iter().map(|(t, i, u, d)| (t, (i, u, d))).collect()
}

/// The workload of the held-snapshot soak on `path`: a REPEATABLE READ
/// snapshot taken first and held throughout, then 1,000 keys' 3,000 events
/// emitted and drained by two dispatchers on a pool of their own, which is
/// closed at the end (its sessions' table statistics are reported when
/// they exit). Returns what the drain wrote, the events and the batches.
async fn held_snapshot_soak(pool: &PgPool, path: DispatchPath) -> (Writes, i64, i64) {
    // The route first, so that the switch writes the cluster's lease rows
    // now: two dispatchers creating them at their first claims race (a
    // speculative insert lost counts as an insert and a delete), which is
    // no part of the drain being measured.
    let (cluster, _probe) = started(pool, 5_000).await;
    outbox_producer::set_dispatch_path(pool, path).await.unwrap();
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ").execute(&mut *holder).await.unwrap();
    let _: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_settings").fetch_one(&mut *holder).await.unwrap();
    // 1,000 keys, three events each, the keys interleaved as business
    // transactions interleave them (one transaction per round of keys).
    let mut ids = Vec::new();
    for v in 0..3 {
        let mut tx = pool.begin().await.unwrap();
        for o in 0..1_000 {
            let (order, command) = (format!("o-{o}"), format!("c-{o}-{v}"));
            let payload = outbox_tests::order_payload(&order, v);
            let req = outbox_core::EmitRequest { aggregate_version: v, ..outbox_tests::order_request(&command, &order, &payload) };
            ids.push(outbox_producer::emit(&mut tx, &req, &outbox_producer::EmitOptions::default()).await.unwrap().event_id().to_string());
        }
        tx.commit().await.unwrap();
    }
    let dispatch_pool = sqlx::postgres::PgPoolOptions::new().max_connections(10).connect_with((*pool.connect_options()).clone()).await.unwrap();
    let before = writes(pool).await;
    run_two_dispatchers(&dispatch_pool, &cluster, ids.len() as i64, DispatcherConfig { batch_size: 300, ..config("d") }).await;
    dispatch_pool.close().await;
    // A closed session reports its statistics as it exits, just after.
    let published = |after: &Writes| after.get("outbox_publish_receipts").map_or(0, |w| w.0) - before.get("outbox_publish_receipts").map_or(0, |w| w.0);
    let mut after = writes(pool).await;
    for _ in 0..100 {
        if published(&after) >= ids.len() as i64 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        after = writes(pool).await;
    }
    // Every receipt insert of the drain seen: its updates and deletes are too.
    assert_eq!(published(&after), ids.len() as i64, "the drain's table statistics were not all reported");
    holder.rollback().await.unwrap();
    let drained: Writes = after
        .iter()
        .map(|(t, (i, u, d))| {
            let (bi, bu, bd) = before.get(t).copied().unwrap_or_default();
            (t.clone(), (i - bi, u - bu, d - bd))
        })
        .filter(|(_, w)| *w != (0, 0, 0))
        .collect();
    each_once_in_log(&cluster, &ids);
    (drained, ids.len() as i64, count(pool, "SELECT count(*) FROM outbox_batches").await)
}

/// Why `writes` leave dead row versions behind a held snapshot: an update
/// of any table, a delete of any table but the lease log, or a row in the
/// exception lane (`outbox_events`, `outbox_attempts`). The lease state is
/// a log of inserts (a few per batch, never per event: fewer than the
/// events), pruned behind each bucket's newest row by the lease sweep: its
/// deletes leave versions nobody reads (a reader starts at the newest).
fn per_event_dead_rows(writes: &Writes, events: i64, batches: i64) -> Vec<String> {
    let mut out = Vec::new();
    for (t, (i, u, d)) in writes {
        match t.as_str() {
            "outbox_bucket_lease_log" if *i < events && *u == 0 => {}
            "outbox_bucket_lease_log" => out.push(format!("{t}: {i} inserts, {u} updates and {d} deletes for {batches} batches of {events} events")),
            "outbox_events" | "outbox_attempts" if *i > 0 => out.push(format!("{t}: {i} rows in the exception lane")),
            _ if *u > 0 || *d > 0 => out.push(format!("{t}: {u} updates and {d} deletes for {events} events")),
            _ => {}
        }
    }
    out
}

/// A snapshot held through a drain (issue: flat under a held snapshot):
/// the stream's happy path updates and deletes no per-event row, so the
/// held snapshot keeps no per-event dead version, and no row is updated at
/// all: the lease state is a log of inserts, a few per batch. The bounded form of
/// `dispatch_bench --rate R --hold-snapshot-s S`.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_held_snapshot_keeps_no_per_event_dead_rows_on_the_stream(pool: PgPool) {
    let (writes, events, batches) = held_snapshot_soak(&pool, DispatchPath::Stream).await;
    eprintln!("stream: {events} events, {batches} batches, writes {writes:?}");
    let bad = per_event_dead_rows(&writes, events, batches);
    assert!(bad.is_empty(), "per-event dead rows behind a held snapshot: {bad:?}");
}

/// The soak's check can fail: the same workload on the chains path updates
/// each event's row (claim, registration, publish) and its chain head.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_soak_check_sees_the_chains_paths_per_event_updates(pool: PgPool) {
    let (writes, events, batches) = held_snapshot_soak(&pool, DispatchPath::Chains).await;
    eprintln!("chains: {events} events, {batches} batches, writes {writes:?}");
    let bad = per_event_dead_rows(&writes, events, batches);
    assert!(bad.iter().any(|b| b.starts_with("outbox_events:")), "the chains path's updates of outbox_events were not seen: {bad:?}");
}

/// The backlog's age (`oldest_pending_age_ms`: the dispatcher's
/// `oldest_pending` gauge, `outbox status`) counts the stream's events: an
/// event emitted on the stream and not yet handed out is PENDING however
/// long it waits (before this, only the lane was read, and a stream backlog
/// of any age read as none). Handed out, the batch's events are CLAIMED
/// (not PENDING, as on the lane); published, nothing is pending.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_oldest_pending_age_counts_the_streams_backlog(pool: PgPool) {
    use outbox_core::OutboxStore;
    let (_cluster, clock, now, store) = on_the_stream_with_a_manual_clock(&pool).await;
    assert_eq!(store.oldest_pending_age_ms().await.unwrap(), None, "nothing emitted");

    let ids = emit_many(&pool, 5, 1).await;
    let created = |id: String| {
        let pool = pool.clone();
        async move { sqlx::query_scalar::<_, i64>("SELECT created_at_ms FROM outbox_stream WHERE event_id = $1").bind(id).fetch_one(&pool).await.unwrap() }
    };
    let first = created(ids[0].clone()).await;
    clock.advance(60_000);
    let age = store.oldest_pending_age_ms().await.unwrap();
    assert_eq!(age, Some(now + 60_000 - first), "five stream events waiting a minute");
    assert_eq!(outbox_producer::pg::oldest_pending_created_ms(&pool).await.unwrap(), Some(first), "the CLI's reading");

    // Handed out: CLAIMED, not PENDING.
    let claimed = store.claim_batch("d", 100, 30_000).await.unwrap();
    assert_eq!(claimed.len(), ids.len());
    assert_eq!(store.oldest_pending_age_ms().await.unwrap(), None, "every event handed out");

    // A later event is PENDING, and the oldest.
    let payload = outbox_tests::order_payload("o-later", 1);
    let mut tx = pool.begin().await.unwrap();
    let later = outbox_producer::emit(&mut tx, &outbox_tests::order_request("c-later", "o-later", &payload), &outbox_producer::EmitOptions::default()).await.unwrap();
    tx.commit().await.unwrap();
    let later_created = created(later.event_id().to_string()).await;
    assert_eq!(outbox_producer::pg::oldest_pending_created_ms(&pool).await.unwrap(), Some(later_created), "the later event");
}

/// The counts per state (`PgStore::state_counts`, `outbox status`, the
/// report) count the stream's events where they stand, as
/// `outbox_event_state` reads one: PENDING until handed out, CLAIMED,
/// SENDING once registered, PUBLISHED with a receipt in the slot (before
/// this, only the lane was counted, and a stream database read as empty).
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_state_counts_count_the_streams_events(pool: PgPool) {
    use outbox_core::{EventState, OutboxStore};
    outbox_producer::set_dispatch_path(&pool, DispatchPath::Stream).await.unwrap();
    let (_cluster, _probe) = started(&pool, 5_000).await;
    let store = outbox_producer::PgStore::new(pool.clone());
    let counts = |store: outbox_producer::PgStore| async move {
        let mut c: Vec<(EventState, i64)> = store.state_counts().await.unwrap().into_iter().filter(|(_, n)| *n > 0).collect();
        c.sort_by_key(|(s, _)| s.to_string());
        c
    };
    assert_eq!(counts(store.clone()).await, vec![]);
    emit_many(&pool, 4, 1).await;
    assert_eq!(counts(store.clone()).await, vec![(EventState::Pending, 4)]);
    let claimed = store.claim_batch("d", 100, 30_000).await.unwrap();
    assert_eq!(claimed.len(), 4);
    assert_eq!(counts(store.clone()).await, vec![(EventState::Claimed, 4)]);
    let a0 = store.register_attempt(&claimed[0].token).await.unwrap();
    store.register_attempt(&claimed[1].token).await.unwrap();
    store.accept_dispatch_receipt(&outbox_tests::ack_receipt(&claimed[0], &a0, claimed[0].destination.partition, 0)).await.unwrap();
    assert_eq!(counts(store.clone()).await, vec![(EventState::Claimed, 2), (EventState::Published, 1), (EventState::Sending, 1)]);
    let via_sql: Vec<(String, i64)> = sqlx::query_as("SELECT state, n FROM outbox_state_counts() WHERE n > 0 ORDER BY state").fetch_all(&pool).await.unwrap();
    assert_eq!(via_sql, vec![("CLAIMED".into(), 2), ("PUBLISHED".into(), 1), ("SENDING".into(), 1)], "what outbox status and the report read");
}

/// Issue 45: every reader of an event's state reads what
/// `outbox_event_state` reads (stream and exception lane through one
/// function): the store's `event_state`, the counts per state (`outbox
/// status`, the report), the oldest PENDING event, and the reconciler's
/// candidates (aged, unknown, quarantined) agree with it for every event,
/// at every stage: emitted, handed out, registered, published, quarantined
/// by a divergent receipt, and after the leases ran out (registered events
/// moved to the lane DISPATCH_UNKNOWN, handed-out ones given back).
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn every_reader_of_state_reads_what_outbox_event_state_reads(pool: PgPool) {
    use outbox_core::store::FindingsStore;
    use outbox_core::{EventState, OutboxStore};
    use std::collections::{BTreeMap, BTreeSet};
    let (_cluster, clock, _now, store) = on_the_stream_with_a_manual_clock(&pool).await;
    let ids = emit_many(&pool, 6, 2).await;

    let check = |stage: &'static str| {
        let (pool, store, ids) = (pool.clone(), store.clone(), ids.clone());
        async move {
            let one: BTreeMap<String, EventState> = {
                let rows: Vec<(String, String)> = sqlx::query_as("SELECT id, outbox_event_state(id) FROM unnest($1::text[]) AS id").bind(&ids).fetch_all(&pool).await.unwrap();
                rows.into_iter().map(|(id, s)| (id, EventState::parse(&s).unwrap())).collect()
            };
            for (id, want) in &one {
                let got = store.event_state(&id.parse().unwrap()).await.unwrap().0;
                assert_eq!(got, *want, "{stage}: event_state of {id}");
            }
            let mut by_function: BTreeMap<EventState, i64> = BTreeMap::new();
            for s in one.values() {
                *by_function.entry(*s).or_default() += 1;
            }
            let counts: BTreeMap<EventState, i64> = store.state_counts().await.unwrap().into_iter().filter(|(_, n)| *n > 0).collect();
            assert_eq!(counts, by_function, "{stage}: the counts per state");
            let ids_in = |states: &[EventState]| one.iter().filter(|(_, s)| states.contains(s)).map(|(id, _)| id.clone()).collect::<BTreeSet<String>>();
            let far = clock_far(&pool).await;
            let aged_facts = store.aged_candidates(far, 1_000).await.unwrap();
            for f in &aged_facts {
                assert_eq!(Some(&f.state), one.get(&f.event_id), "{stage}: an aged candidate's state");
            }
            let aged: BTreeSet<String> = aged_facts.into_iter().map(|f| f.event_id).collect();
            assert_eq!(aged, ids_in(&[EventState::Pending, EventState::Claimed, EventState::Sending]), "{stage}: the aged-event candidates");
            let unknown: BTreeSet<String> = store.unknown_candidates(far, 1_000).await.unwrap().into_iter().map(|f| f.event_id).collect();
            assert_eq!(unknown, ids_in(&[EventState::DispatchUnknown]), "{stage}: the unknown candidates");
            let quarantined: BTreeSet<String> = store.quarantined_candidates(1_000).await.unwrap().into_iter().map(|f| f.event_id).collect();
            assert_eq!(quarantined, ids_in(&[EventState::Quarantined]), "{stage}: the quarantined candidates");
            let pending = ids_in(&[EventState::Pending]);
            let oldest: Option<i64> = if pending.is_empty() {
                None
            } else {
                sqlx::query_scalar(
                    "SELECT min(c) FROM (SELECT created_at_ms AS c FROM outbox_stream WHERE event_id = ANY($1)
                                         UNION ALL SELECT created_at_ms FROM outbox_events WHERE event_id = ANY($1)) t",
                )
                .bind(pending.iter().cloned().collect::<Vec<_>>())
                .fetch_one(&pool)
                .await
                .unwrap()
            };
            assert_eq!(outbox_producer::pg::oldest_pending_created_ms(&pool).await.unwrap(), oldest, "{stage}: the oldest PENDING event");
            one
        }
    };

    let at = check("emitted").await;
    assert!(at.values().all(|s| *s == EventState::Pending));
    // One event per key handed out; three registered; one published, one
    // met by a copy of other bytes (quarantined, to the lane).
    let claimed = store.claim_batch("d", 100, 30_000).await.unwrap();
    assert!(claimed.len() >= 3, "at most one event per key, at least three keys: {}", claimed.len());
    check("handed out").await;
    let mut registered = Vec::new();
    for c in &claimed[..3] {
        registered.push(store.register_attempt(&c.token).await.unwrap());
    }
    check("registered").await;
    store.accept_dispatch_receipt(&outbox_tests::ack_receipt(&claimed[0], &registered[0], claimed[0].destination.partition, 0)).await.unwrap();
    let mut forged = outbox_tests::ack_receipt(&claimed[1], &registered[1], claimed[1].destination.partition, 1);
    forged.payload_digest = outbox_core::canonical::sha256_digest(b"other bytes");
    store.accept_dispatch_receipt(&forged).await.unwrap();
    let at = check("published and quarantined").await;
    assert_eq!(at.values().filter(|s| **s == EventState::Published).count(), 1);
    assert_eq!(at.values().filter(|s| **s == EventState::Quarantined).count(), 1);
    // The leases run out: the registered, unsettled event is UNKNOWN in
    // the lane; the handed-out ones are given back.
    clock.advance(31_000);
    store.expire_leases().await.unwrap();
    let at = check("after the leases ran out").await;
    assert_eq!(at.values().filter(|s| **s == EventState::DispatchUnknown).count(), 1, "{at:?}");
}

/// The stream path on a started cluster, and a store on a manual clock
/// that starts at the database's now (the cluster, the clock, now, the store).
async fn on_the_stream_with_a_manual_clock(pool: &PgPool) -> (outbox_tests::kafka::TestCluster, outbox_core::ManualClock, i64, outbox_producer::PgStore) {
    outbox_producer::set_dispatch_path(pool, DispatchPath::Stream).await.unwrap();
    let (cluster, _probe) = started(pool, 5_000).await;
    let now: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::bigint").fetch_one(pool).await.unwrap();
    let clock = outbox_core::ManualClock::new(now);
    let store = outbox_producer::PgStore::with_clock(pool.clone(), std::sync::Arc::new(clock.clone()));
    (cluster, clock, now, store)
}

/// A time after every event's creation, on the database's clock.
async fn clock_far(pool: &PgPool) -> i64 {
    sqlx::query_scalar::<_, i64>("SELECT (extract(epoch FROM now()) * 1000)::bigint + 86400000").fetch_one(pool).await.unwrap()
}

/// The lease log's prune (`outbox_bucket_lease_log_prune`, run by the
/// lease sweep) deletes the rows behind each bucket's newest state, never
/// the newest, and answers how far every row is deleted: a caller that
/// goes on from that answer never leaves a row behind it, even a row that
/// was a bucket's newest when it was passed and was superseded later (a
/// quiet bucket's state row sits far behind the busy buckets' writes).
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_lease_log_prune_keeps_each_buckets_newest_and_leaves_nothing_behind(pool: PgPool) {
    let write = |bucket: i16, owner: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query("INSERT INTO outbox_bucket_lease_log (cluster_id, bucket, owner) VALUES ('c', $1, $2)").bind(bucket).bind(owner).execute(&pool).await.unwrap();
        }
    };
    sqlx::query("INSERT INTO outbox_bucket_slots (cluster_id, bucket) SELECT 'c', b::smallint FROM generate_series(0, 2) b").execute(&pool).await.unwrap();
    // Bucket 0 quiet (one row), bucket 1 busy, bucket 2 in between.
    write(0, "quiet").await;
    for _ in 0..5 {
        write(1, "busy").await;
    }
    write(2, "mid").await;
    write(2, "mid").await;
    let newest = |pool: PgPool| async move {
        sqlx::query_as::<_, (i16, i64)>("SELECT bucket, max(seq) FROM outbox_bucket_lease_log GROUP BY bucket ORDER BY bucket").fetch_all(&pool).await.unwrap()
    };
    let behind_floor = |pool: PgPool, upto: i64| async move {
        count(&pool, &format!("SELECT count(*) FROM outbox_bucket_lease_log WHERE seq <= {upto}")).await
    };
    let prune = |pool: PgPool, after: i64, limit: i32| async move {
        sqlx::query_scalar::<_, i64>("SELECT outbox_bucket_lease_log_prune($1, $2)").bind(after).bind(limit).fetch_one(&pool).await.unwrap()
    };
    let tops = newest(pool.clone()).await;
    // One prune at a time: while another holds the prune's lock, a prune
    // returns at once, deleting nothing.
    let mut other = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('outbox_bucket_lease_log_prune', 0))").execute(&mut *other).await.unwrap();
    assert_eq!(prune(pool.clone(), 0, 100).await, 0, "a prune ran beside another");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_bucket_lease_log").await, 8, "a prune beside another deleted rows");
    other.rollback().await.unwrap();
    // Two rows at a time: the answer never passes a row left in place.
    let mut after = 0;
    for _ in 0..4 {
        after = prune(pool.clone(), after, 2).await;
        assert_eq!(behind_floor(pool.clone(), after).await, 0, "a row at or below the answer {after} was left");
    }
    assert_eq!(newest(pool.clone()).await, tops, "a bucket's newest row was deleted");
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_bucket_lease_log").await, 3, "one row per bucket is left");
    // The quiet bucket's row held the answer below it; once it is
    // superseded, the next prune deletes it.
    write(0, "woke").await;
    after = prune(pool.clone(), after, 100).await;
    assert_eq!(behind_floor(pool.clone(), after).await, 0);
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_bucket_lease_log WHERE owner = 'quiet'").await, 0, "the superseded row was left behind");
    let owners: Vec<String> = sqlx::query_scalar("SELECT owner FROM outbox_bucket_leases ORDER BY bucket").fetch_all(&pool).await.unwrap();
    assert_eq!(owners, ["woke", "busy", "mid"], "the view reads each bucket's newest state");
}
