//! One scenario, two receipt stores: the shipped `Processor` over
//! PostgreSQL (`PgConsumerStore`) and over `MemoryConsumerStore` (the store
//! the simulator runs it on) must decide the same messages the same way and
//! leave the same receipts, dead letters, quarantine rows, watermarks and
//! effects. A store that answers a claim, a receipt read or a watermark move
//! differently turns this red.

mod common;

use common::*;
use outbox_consumer::memory::{MemoryConsumerStore, MemoryTx};
use outbox_consumer::{async_trait, ConsumedEvent, ConsumerStore, Handler, HandlerError, Outcome, Processor, RawMessage, RetryPolicy, TxHandler};
use serde_json::{json, Value};
use sqlx::{PgPool, Postgres, Row as _, Transaction};

const TOPIC: &str = "orders";

/// Fails permanently for one order key; records an effect otherwise.
#[derive(Clone)]
struct Scripted {
    refuse: String,
}

impl Scripted {
    fn decide(&self, event: &ConsumedEvent) -> Result<Value, HandlerError> {
        let order = event.json().and_then(|v| v["order"].as_str().map(str::to_owned)).unwrap_or_default();
        if order == self.refuse {
            return Err(HandlerError::permanent("this order is refused"));
        }
        Ok(json!({ "order": order, "offset": event.offset }))
    }
}

#[async_trait]
impl Handler for Scripted {
    async fn handle(&self, tx: &mut Transaction<'_, Postgres>, event: &ConsumedEvent) -> Result<Value, HandlerError> {
        let out = self.decide(event)?;
        sqlx::query("INSERT INTO conformance_effects (event_id) VALUES ($1)").bind(event.event_id.as_str()).execute(&mut **tx).await?;
        Ok(out)
    }
}

#[async_trait]
impl TxHandler<MemoryTx> for Scripted {
    async fn handle_in(&self, tx: &mut MemoryTx, event: &ConsumedEvent) -> Result<Value, HandlerError> {
        let out = self.decide(event)?;
        tx.write_effect("effects", json!(event.event_id.as_str()));
        Ok(out)
    }
}

/// What a store ends with, in a form both stores give.
#[derive(Debug, PartialEq, Eq)]
struct Summary {
    outcomes: Vec<Vec<String>>,
    /// (event id, offset, result) of every receipt, by event id.
    receipts: Vec<(String, i64, String)>,
    dead_letters: Vec<(String, u32)>,
    quarantined_offsets: Vec<i64>,
    /// (topic id, committed offset, applied, duplicates, quarantined, dead-lettered).
    watermarks: Vec<(Option<String>, i64, i64, i64, i64, i64)>,
    /// Event ids with an effect, sorted (one per applied event).
    effects: Vec<String>,
    /// (detected from, from, to, closed) of the partition's gaps.
    gaps: Vec<(i64, i64, i64, bool)>,
    /// The partition's reading: the offset after the greatest one decided.
    next_offset: Option<i64>,
}

fn describe(outs: &[Outcome]) -> Vec<String> {
    outs.iter()
        .map(|o| match o {
            Outcome::Applied { receipt } => format!("applied {}@{}", receipt.event_id, receipt.position.offset),
            Outcome::Duplicate { original, delivery } => format!("duplicate {} of @{} at @{}", original.event_id, original.position.offset, delivery.offset),
            Outcome::Quarantined(q) => format!("quarantined @{} {}", q.position.offset, q.reason.code()),
            Outcome::DeadLettered(d) => format!("dead_lettered {} @{} attempts {} redelivery {}", d.event_id, d.position.offset, d.attempts, d.redelivery),
            other => format!("{other:?}"),
        })
        .collect()
}

/// The batches of the scenario, all of partition 1 of `orders`.
fn batches() -> Vec<Vec<RawMessage>> {
    static FIXTURES: std::sync::OnceLock<[Fixture; 4]> = std::sync::OnceLock::new();
    let [a, b, refused, c] = FIXTURES.get_or_init(|| [fixture_on(TOPIC, 4, 1, "a"), fixture_on(TOPIC, 4, 1, "b"), fixture_on(TOPIC, 4, 1, "refused"), fixture_on(TOPIC, 4, 1, "c")]);
    let mut forged = b.raw(3);
    forged.payload = Some(b"{\"order\":\"forged\"}".to_vec());
    let mut divergent = a.raw(8);
    divergent.payload = Some(b"{\"order\":\"other bytes\"}".to_vec());
    vec![
        // New, new, duplicate inside the batch, forged bytes.
        vec![a.raw(0), b.raw(1), a.raw(2), forged],
        // A handler that refuses: the events before it commit, it is dead-lettered, the rest go on.
        vec![c.raw(4), refused.raw(5), b.raw(6)],
        // Redeliveries after a restart: the dead letter, the forged position again, a divergent copy.
        vec![refused.raw(7), divergent],
        // The offsets jump from 9 to 12 (a reset group): a gap.
        vec![c.raw(12)],
        // A replay of the gap's first two offsets shrinks it.
        vec![b.raw(9), a.raw(10)],
    ]
}

async fn run<S: ConsumerStore>(p: &Processor<S>) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for batch in batches() {
        out.push(describe(&p.process_batch(&batch).await.expect("the batch is decided")));
    }
    // The forged position delivered again alone.
    let forged_again = batches().remove(0).remove(3);
    out.push(describe(&p.process_batch(&[forged_again]).await.expect("decided")));
    out
}

fn retry() -> RetryPolicy {
    RetryPolicy { max_attempts: 2, initial_backoff_ms: 1, max_backoff_ms: 2, ..RetryPolicy::default() }
}

fn handler(refused_order: &str) -> Scripted {
    Scripted { refuse: refused_order.to_owned() }
}

/// The order key `fixture_on` picks for a tag on partition 1.
fn refused_order() -> String {
    fixture_on(TOPIC, 4, 1, "refused").envelope.aggregate_id
}

async fn on_postgres(pool: &PgPool) -> Summary {
    sqlx::query("CREATE TABLE conformance_effects (event_id text NOT NULL)").execute(pool).await.unwrap();
    let p = Processor::new("billing", pool.clone(), handler(&refused_order())).unwrap().with_retry(retry()).unwrap().with_cluster_id("kafka-a");
    let outcomes = run(&p).await;
    let mut receipts: Vec<(String, i64, String)> = sqlx::query(r#"SELECT event_id, "offset", result::text AS result FROM outbox_consumer_receipts WHERE consumer_id = 'billing'"#)
        .fetch_all(pool)
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get::<String, _>("event_id"), r.get::<i64, _>("offset"), canonical(&r.get::<String, _>("result"))))
        .collect();
    let dead_letters = sqlx::query("SELECT event_id, attempts FROM outbox_consumer_dead_letters WHERE consumer_id = 'billing' ORDER BY event_id")
        .fetch_all(pool)
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get::<String, _>("event_id"), r.get::<i32, _>("attempts") as u32))
        .collect();
    let quarantined_offsets = sqlx::query_scalar(r#"SELECT "offset" FROM outbox_consumer_quarantine WHERE consumer_id = 'billing' ORDER BY "offset""#).fetch_all(pool).await.unwrap();
    let watermarks = sqlx::query(
        "SELECT topic_id, committed_offset, applied_count, duplicate_count, quarantined_count, dead_lettered_count FROM outbox_consumer_watermarks
         WHERE consumer_id = 'billing' AND cluster_id = 'kafka-a' AND topic = 'orders' AND partition = 1 ORDER BY topic_id NULLS FIRST",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get("topic_id"), r.get("committed_offset"), r.get("applied_count"), r.get("duplicate_count"), r.get("quarantined_count"), r.get("dead_lettered_count")))
    .collect();
    let mut effects: Vec<String> = sqlx::query_scalar("SELECT event_id FROM conformance_effects").fetch_all(pool).await.unwrap();
    effects.sort();
    receipts.sort();
    let gaps = sqlx::query_as::<_, (i64, i64, i64, bool)>(
        "SELECT detected_from, from_offset, to_offset, closed_at IS NOT NULL FROM outbox_consumer_gaps
         WHERE consumer_id = 'billing' AND cluster_id = 'kafka-a' AND topic = 'orders' AND partition = 1 ORDER BY detected_from",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let next_offset = sqlx::query_scalar("SELECT next_offset FROM outbox_consumer_readings WHERE consumer_id = 'billing' AND cluster_id = 'kafka-a' AND topic = 'orders' AND partition = 1")
        .fetch_optional(pool)
        .await
        .unwrap();
    Summary { outcomes, receipts, dead_letters, quarantined_offsets, watermarks, effects, gaps, next_offset }
}

async fn in_memory() -> Summary {
    let store = MemoryConsumerStore::new();
    let p = Processor::over(store.clone(), "billing", handler(&refused_order())).unwrap().with_retry(retry()).unwrap().with_cluster_id("kafka-a");
    let outcomes = run(&p).await;
    let st = store.lock();
    let receipts = st.receipts.values().map(|r| (r.event_id.to_string(), r.position.offset, canonical(&r.result.to_string()))).collect();
    let dead_letters = st.dead_letters.iter().map(|((_, id), (attempts, _, _))| (id.clone(), *attempts)).collect();
    let quarantined_offsets = st.quarantine.keys().map(|(_, _, _, o)| *o).collect();
    let watermarks = st
        .watermarks
        .iter()
        .filter(|((c, cl, t, p, _), _)| c == "billing" && cl == "kafka-a" && t == TOPIC && *p == 1)
        .map(|(_, w)| (w.topic_id.clone(), w.committed_offset, w.applied, w.duplicates, w.quarantined, w.dead_lettered))
        .collect();
    let mut effects: Vec<String> = st.effects.get("effects").into_iter().flatten().filter_map(|v| v.as_str().map(str::to_owned)).collect();
    effects.sort();
    let gaps = st.gaps.values().map(|g| (g.gap.detected_from, g.gap.from_offset, g.gap.to_offset, g.close_reason.is_some())).collect();
    let next_offset = st.readings.get(&("billing".to_owned(), "kafka-a".to_owned(), TOPIC.to_owned(), 1)).copied();
    Summary { outcomes, receipts, dead_letters, quarantined_offsets, watermarks, effects, gaps, next_offset }
}

fn canonical(json_text: &str) -> String {
    serde_json::from_str::<Value>(json_text).map(|v| v.to_string()).unwrap_or_else(|_| json_text.to_owned())
}

#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn the_memory_store_decides_as_postgres_does(pool: PgPool) {
    let pg = on_postgres(&pool).await;
    let mem = in_memory().await;
    assert_eq!(pg, mem, "the two stores disagree");
    // And what they agree on is the protocol: one effect per applied event,
    // the refused one dead-lettered once, both forged positions quarantined once.
    let applied: usize = pg.outcomes.iter().flatten().filter(|o| o.starts_with("applied")).count();
    assert_eq!(applied, 3, "{:#?}", pg.outcomes);
    assert_eq!(pg.effects.len(), 3);
    assert_eq!(pg.receipts.len(), 3);
    assert_eq!(pg.dead_letters.len(), 1);
    assert_eq!(pg.quarantined_offsets, vec![3, 8]);
    assert!(pg.outcomes[2].iter().any(|o| o.contains("redelivery true")), "{:#?}", pg.outcomes);
    let forged_again = pg.outcomes.last().unwrap();
    assert_eq!(forged_again.len(), 1);
    assert!(forged_again[0].starts_with("quarantined @3"), "{forged_again:?}");
    let (_, committed, applied_n, dups, quarantined, dead) = pg.watermarks[0].clone();
    // The gap [9, 12) found at offset 12, then shrunk to [11, 12) by the
    // replay: the watermark stops at its start.
    assert_eq!(pg.gaps, vec![(9, 11, 12, false)]);
    assert_eq!(pg.next_offset, Some(13));
    assert_eq!((committed, applied_n, quarantined, dead), (11, 3, 2, 1), "{:?}", pg.watermarks);
    assert!(dups >= 6, "{:?}", pg.watermarks);
}

/// (gaps as (detected from, from, to, closed), next offset, watermark rows
/// as (committed offset, log id)) of partition 1.
type LogState = (Vec<(i64, i64, i64, bool)>, Option<i64>, Vec<(i64, Option<String>)>);

async fn pg_state(pool: &PgPool) -> LogState {
    let gaps = sqlx::query_as::<_, (i64, i64, i64, bool)>(
        "SELECT detected_from, from_offset, to_offset, closed_at IS NOT NULL FROM outbox_consumer_gaps
         WHERE consumer_id = 'billing' AND partition = 1 ORDER BY detected_from",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let next = sqlx::query_scalar("SELECT next_offset FROM outbox_consumer_readings WHERE consumer_id = 'billing' AND partition = 1").fetch_optional(pool).await.unwrap();
    let marks = sqlx::query_as("SELECT committed_offset, log_id FROM outbox_consumer_watermarks WHERE consumer_id = 'billing' AND partition = 1 ORDER BY topic_id NULLS FIRST")
        .fetch_all(pool)
        .await
        .unwrap();
    (gaps, next, marks)
}

fn mem_state(store: &MemoryConsumerStore) -> LogState {
    let st = store.lock();
    let gaps = st.gaps.values().map(|g| (g.gap.detected_from, g.gap.from_offset, g.gap.to_offset, g.close_reason.is_some())).collect();
    let next = st.readings.get(&("billing".to_owned(), "kafka-a".to_owned(), TOPIC.to_owned(), 1)).copied();
    let marks = st.watermarks.iter().filter(|((_, _, _, p, _), _)| *p == 1).map(|(_, w)| (w.committed_offset, w.log_id.clone())).collect();
    (gaps, next, marks)
}

/// The messages of the scenario below: `tag`'s events at `offsets` of
/// partition 1, fetched from the log `log`.
fn of_log(log: &str, tag: &str, offsets: std::ops::Range<i64>) -> Vec<RawMessage> {
    offsets.map(|o| RawMessage { log_id: Some(log.to_owned()), ..fixture_on(TOPIC, 4, 1, &format!("{tag}{o}")).raw(o) }).collect()
}

/// A partition's log replaced under the consumer (the topic deleted and
/// created again under its name, or the cluster replaced), and the consumer
/// goes on reading the new log from the old log's position (its group's
/// committed offset). The new log's offsets below that position were never
/// read: without the log's identity the reads look continuous and the
/// watermark passes them (retention would purge their events). With it,
/// the reading starts over in the new log: `[0, 3)` of it is a gap, the old
/// log's watermark row is replaced by one at 0, and a replay of the new
/// log's start closes the gap and lets the watermark move on. Both stores alike.
#[tokio::test]
async fn a_replaced_log_read_from_the_old_position_is_a_gap_on_both_stores() {
    // Its own database: `run_mutant` runs this test again in a child process.
    let db = own_database("consumer_replaced_log").await;
    let pool = db.pool.clone();
    sqlx::query("CREATE TABLE conformance_effects (event_id text NOT NULL)").execute(&pool).await.unwrap();
    let pg = Processor::new("billing", pool.clone(), handler("none")).unwrap().with_retry(retry()).unwrap().with_cluster_id("kafka-a");
    let store = MemoryConsumerStore::new();
    let mem = Processor::over(store.clone(), "billing", handler("none")).unwrap().with_retry(retry()).unwrap().with_cluster_id("kafka-a");
    let old = of_log("log-A", "old", 0..3);
    let new_after = of_log("log-B", "new", 3..5);
    let new_start = of_log("log-B", "new", 0..3);
    let mixed: Vec<RawMessage> = old[2..].iter().chain(&new_after[..1]).cloned().collect();
    assert!(pg.process_batch(&mixed).await.is_err(), "a batch of two logs is refused");

    for batch in [&old, &new_after] {
        assert!(pg.process_batch(batch).await.unwrap().iter().all(|o| o.kind() == "applied"));
        assert!(mem.process_batch(batch).await.unwrap().iter().all(|o| o.kind() == "applied"));
    }
    let want: LogState = (vec![(0, 0, 3, false)], Some(5), vec![(0, Some("log-B".into()))]);
    assert_eq!(pg_state(&pool).await, want, "PostgreSQL, after the new log's 3..5");
    assert_eq!(mem_state(&store), want, "memory, after the new log's 3..5");

    for p in [pg.process_batch(&new_start).await.unwrap(), mem.process_batch(&new_start).await.unwrap()] {
        assert!(p.iter().all(|o| o.kind() == "applied"));
    }
    // The watermark moves to what the replay decided (3); the next message
    // decided moves it on past 3..5.
    let want: LogState = (vec![(0, 3, 3, true)], Some(5), vec![(3, Some("log-B".into()))]);
    assert_eq!(pg_state(&pool).await, want, "PostgreSQL, after the replay");
    assert_eq!(mem_state(&store), want, "memory, after the replay");
    db.drop_now().await;
}

/// The deliberate defect `replaced-log-read-as-continuous` (the reading goes
/// on across a replaced log) turns the replaced-log test red.
#[test]
fn the_replaced_log_test_catches_a_reading_kept_across_logs() {
    let out = run_mutant("a_replaced_log_read_from_the_old_position_is_a_gap_on_both_stores", "replaced-log-read-as-continuous");
    assert!(out.contains("panicked") && out.contains("after the new log's 3..5"), "{out}");
}
