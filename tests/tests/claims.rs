//! Claims over the table of ordering-chain heads (`outbox_chain_heads`, the
//! schema's section 7): a claim's cost does not grow with the backlog or the
//! number of open keys; per-key order holds while emitters and several
//! dispatcher instances run together.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::{EmitRequest, OutboxStore};
use outbox_producer::{emit_batch, Dispatcher, DispatcherConfig, EmitOptions, PgStore};
use outbox_tests::kafka::read_topic;
use outbox_tests::*;
use sqlx::PgPool;

const TOPIC: &str = "orders";
const PARTITIONS: i32 = 3;

/// The tables a claim reads.
const CLAIM_TABLES: [&str; 4] = ["outbox_events", "outbox_envelopes", "outbox_chain_heads", "outbox_chain_arrivals"];

/// Emits `n` events, from `from` on, one per key (`o-<i>`), in transactions
/// of 1,000.
async fn emit_distinct_keys(pool: &PgPool, from: usize, n: usize) {
    let payload = order_payload("o", 1);
    for chunk in (from..from + n).collect::<Vec<_>>().chunks(1_000) {
        let ids: Vec<(String, String)> = chunk.iter().map(|i| (format!("o-{i}"), format!("c-{i}"))).collect();
        let requests: Vec<EmitRequest> = ids.iter().map(|(id, key)| order_request(key, id, &payload)).collect();
        let mut tx = pool.begin().await.unwrap();
        emit_batch(&mut tx, &requests, &EmitOptions::default()).await.unwrap();
        tx.commit().await.unwrap();
    }
}

async fn single_connection(pool: &PgPool) -> PgPool {
    sqlx::postgres::PgPoolOptions::new().max_connections(1).connect_with((*pool.connect_options()).clone()).await.unwrap()
}

/// Rows and index entries one claim of 100 reads with `backlog` PENDING
/// events on as many keys, every key's head linked.
async fn rows_read_by_one_claim(pool: &PgPool, backlog: usize) -> i64 {
    let own = single_connection(pool).await;
    let store = PgStore::new(own.clone());
    // The set-up runs on a connection of its own, closed before counting:
    // a backend hands its table counters over up to seconds late (one of
    // its count(*) scans once landed inside the claim's count), but always
    // when it exits.
    let setup = single_connection(pool).await;
    emit_distinct_keys(&setup, 0, backlog).await;
    // Claims of one link the arrivals (up to 2,000 a claim) until every
    // key has its head.
    while count(&setup, "SELECT count(*) FROM outbox_chain_arrivals").await > 0 {
        assert_eq!(store.claim_batch("warm", 1, 30_000).await.unwrap().len(), 1);
    }
    // What autovacuum would have done by now (it is off here, so that its
    // reads do not count): the linked arrivals' dead rows are gone, and
    // the planner has statistics of the tables as they are now.
    sqlx::query("VACUUM ANALYZE outbox_chain_arrivals, outbox_chain_heads, outbox_events").execute(&setup).await.unwrap();
    let setup_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&setup).await.unwrap();
    setup.close().await;
    let gone = std::time::Instant::now() + Duration::from_secs(10);
    while count(pool, &format!("SELECT count(*) FROM pg_stat_activity WHERE pid = {setup_pid}")).await > 0 {
        assert!(std::time::Instant::now() < gone, "the set-up connection did not end");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = reads(pool, &[&own], &CLAIM_TABLES).await;
    let claimed = store.claim_batch("w1", 100, 30_000).await.unwrap();
    let read = reads(pool, &[&own], &CLAIM_TABLES).await - before;
    assert_eq!(claimed.len(), 100);
    assert_eq!(read.seq_scans, 0, "{read:?}");
    read.rows
}

/// One claim of 100 over 20,000 PENDING events on 20,000 keys reads a few
/// index entries per claimed event, as many as over 2,000 (the loose index
/// scan over every key's head read at least one entry per key: 20,000).
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_claim_reads_rows_in_proportion_to_its_batch_not_to_the_open_keys(pool: PgPool) {
    business_schema(&pool).await;
    route(&pool, ORDER_CREATED, "cluster-a", TOPIC, PARTITIONS as u32).await;
    for t in CLAIM_TABLES {
        sqlx::query(&format!("ALTER TABLE {t} SET (autovacuum_enabled = false)")).execute(&pool).await.unwrap();
    }
    let big = rows_read_by_one_claim(&pool, 20_000).await;
    eprintln!("one claim of 100 over 20,000 keys read {big} rows and index entries");
    assert!(big < 2_000, "one claim of 100 over 20,000 keys read {big} rows and index entries");
}

/// The same bound, independent of the backlog: a tenth of it reads about
/// as much.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn a_claim_over_a_small_backlog_reads_as_much_as_over_a_large_one(pool: PgPool) {
    business_schema(&pool).await;
    route(&pool, ORDER_CREATED, "cluster-a", TOPIC, PARTITIONS as u32).await;
    for t in CLAIM_TABLES {
        sqlx::query(&format!("ALTER TABLE {t} SET (autovacuum_enabled = false)")).execute(&pool).await.unwrap();
    }
    let small = rows_read_by_one_claim(&pool, 2_000).await;
    eprintln!("one claim of 100 over 2,000 keys read {small} rows and index entries");
    assert!(small < 2_000, "one claim of 100 over 2,000 keys read {small} rows and index entries");
}

/// Emitters commit while three dispatcher instances of two workers each
/// claim, send and publish: every event reaches the log once, and each
/// key's events in the order they were committed. Heads are created by
/// claims (arrivals) and advanced by receipt transactions at the same time
/// as new events of the same keys commit.
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn per_key_order_holds_with_emitters_and_three_instances_running_together(pool: PgPool) {
    let (cluster, _probe) = outbox_tests::kafka::started(&pool, TOPIC, PARTITIONS, 10_000, &[ORDER_CREATED]).await;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut runs = Vec::new();
    for n in 0..3 {
        let broker = cluster.broker(10_000).await;
        let cfg = DispatcherConfig {
            name: format!("inst{n}"),
            workers: 2,
            batch_size: 13,
            lease_ms: 30_000,
            poll_interval_ms: 20,
            sweep_interval_ms: 100,
            head_scan_every: 2,
            ..Default::default()
        };
        let d = Arc::new(Dispatcher::new(PgStore::new(pool.clone()), broker, cfg).unwrap());
        runs.push(tokio::spawn(d.run(outbox_producer::until_true(stop_rx.clone()))));
    }
    // 30 keys, 20 versions each, one event per transaction; two emitters,
    // each owning half of the keys, commit while the dispatchers run.
    let (keys, versions) = (30usize, 20usize);
    let mut emitters = Vec::new();
    for e in 0..2 {
        let pool = pool.clone();
        emitters.push(tokio::spawn(async move {
            for v in 0..versions {
                for k in (0..keys).filter(|k| k % 2 == e) {
                    let (id, key) = (format!("o-{k}"), format!("c-{k}-{v}"));
                    let payload = order_payload(&id, v as i64);
                    let req = EmitRequest { aggregate_version: v as i64, ..order_request(&key, &id, &payload) };
                    let mut tx = pool.begin().await.unwrap();
                    emit_batch(&mut tx, &[req], &EmitOptions::default()).await.unwrap();
                    tx.commit().await.unwrap();
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    }
    for e in emitters {
        e.await.unwrap();
    }
    let total = (keys * versions) as i64;
    wait_count(&pool, "SELECT count(*) FROM outbox_events WHERE state = 'PUBLISHED'", total, Duration::from_secs(120)).await;
    stop_tx.send(true).unwrap();
    for r in runs {
        r.await.unwrap().unwrap();
    }

    assert_eq!(read_topic(&cluster.bootstrap, TOPIC, PARTITIONS).len() as i64, total, "every event in the log once");
    outbox_tests::dispatch::keys_in_commit_order(&pool, &cluster).await;
    assert_eq!(count(&pool, "SELECT count(*) FROM outbox_chain_heads").await, 0, "no head left for a chain with no open event");
}

/// The chain-head triggers close a head on the states the core says no
/// longer hold a key (`EventState::holds_key`), and on no other: every
/// trigger function that names the closing states names exactly those.
/// (The triggers are SQL in a migration; this holds them to the core.)
#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn the_chain_triggers_close_a_head_on_the_core_closing_states(pool: PgPool) {
    let closing: Vec<outbox_core::EventState> = outbox_core::state::ALL_STATES.into_iter().filter(|s| !s.holds_key()).collect();
    let list = format!("({})", outbox_core::sql_state_list(&closing));
    let functions = ["outbox_chain_heads_insert", "outbox_chain_advance", "outbox_chain_follow", "outbox_chain_move"];
    for f in functions {
        let def: String = sqlx::query_scalar("SELECT pg_get_functiondef(p.oid) FROM pg_proc p WHERE p.proname = $1")
            .bind(f)
            .fetch_one(&pool)
            .await
            .unwrap_or_else(|e| panic!("{f}: {e}"));
        // Every state list of the function that names a closing state is the core's list.
        let lists: Vec<&str> = def.match_indices("('").filter_map(|(i, _)| def[i..].find(')').map(|j| &def[i..=i + j])).filter(|l| l.contains("'PUBLISHED'")).collect();
        assert!(!lists.is_empty(), "{f} names no closing state:\n{def}");
        for l in lists {
            assert_eq!(l, list, "{f} closes a chain on {l}, the core on {list}");
        }
    }
}
