//! The insert-only stream's batch rule (`outbox_core::stream`) against
//! PostgreSQL's own snapshots: transactions that overlap on real
//! connections, their ids from `pg_current_xact_id()`, the cuts from
//! `pg_current_snapshot()`. The core reads PostgreSQL's text form of a
//! snapshot and answers `completed` as `pg_visible_in_snapshot` does, and
//! a batch selected in SQL between two cuts holds the transactions the
//! core's `in_batch` puts there: the one that took its id first and
//! committed last is in the later batch, where "above the last cut's
//! horizon" would skip it.

use std::collections::BTreeSet;

use outbox_core::stream::{in_batch, Snapshot, Xid};
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

async fn session(pool: &PgPool) -> PgPool {
    PgPoolOptions::new().max_connections(1).connect_with((*pool.connect_options()).clone()).await.expect("a session")
}

/// Begins a transaction on `session` that inserts row `n` and answers its id.
async fn insert_open(session: &PgPool, n: i32) -> Xid {
    sqlx::query("BEGIN").execute(session).await.unwrap();
    sqlx::query("INSERT INTO stream_probe (n) VALUES ($1)").bind(n).execute(session).await.unwrap();
    let xid: String = sqlx::query_scalar("SELECT pg_current_xact_id()::text").fetch_one(session).await.unwrap();
    xid.parse().unwrap()
}

async fn cut(pool: &PgPool) -> (String, Snapshot) {
    let text: String = sqlx::query_scalar("SELECT pg_current_snapshot()::text").fetch_one(pool).await.unwrap();
    let snap = text.parse().unwrap_or_else(|e| panic!("the core reads {text:?}: {e}"));
    (text, snap)
}

/// The rows PostgreSQL puts in the batch between two cuts (the stream's SQL form of the rule).
async fn batch_in_sql(pool: &PgPool, prev: &str, cut: &str) -> BTreeSet<i32> {
    sqlx::query_scalar(
        "SELECT n FROM stream_probe WHERE pg_visible_in_snapshot(xid, $2::pg_snapshot) AND NOT pg_visible_in_snapshot(xid, $1::pg_snapshot)",
    )
    .bind(prev)
    .bind(cut)
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

#[sqlx::test]
async fn a_transaction_that_took_its_id_first_and_committed_last_is_in_the_later_batch(pool: PgPool) {
    sqlx::query("CREATE TABLE stream_probe (xid xid8 NOT NULL DEFAULT pg_current_xact_id(), n int NOT NULL)").execute(&pool).await.unwrap();
    let (origin_text, origin) = cut(&pool).await;
    let (slow, fast, aborted) = (session(&pool).await, session(&pool).await, session(&pool).await);
    let slow_xid = insert_open(&slow, 1).await;
    let fast_xid = insert_open(&fast, 2).await;
    let aborted_xid = insert_open(&aborted, 3).await;
    assert!(slow_xid < fast_xid);
    sqlx::query("COMMIT").execute(&fast).await.unwrap();
    let (first_text, first) = cut(&pool).await;
    sqlx::query("COMMIT").execute(&slow).await.unwrap();
    sqlx::query("ROLLBACK").execute(&aborted).await.unwrap();
    let later = session(&pool).await;
    let later_xid = insert_open(&later, 4).await;
    sqlx::query("COMMIT").execute(&later).await.unwrap();
    let (second_text, second) = cut(&pool).await;

    // The core answers as PostgreSQL does, for every transaction and cut.
    for (text, snap) in [(&origin_text, &origin), (&first_text, &first), (&second_text, &second)] {
        for x in [slow_xid, fast_xid, aborted_xid, later_xid] {
            let visible: bool = sqlx::query_scalar("SELECT pg_visible_in_snapshot($1::text::xid8, $2::pg_snapshot)").bind(x.to_string()).bind(text).fetch_one(&pool).await.unwrap();
            assert_eq!(snap.completed(x), visible, "transaction {x} in snapshot {text}");
        }
    }
    assert!(origin.followed_by(&first) && first.followed_by(&second));

    // The batches in SQL, and the core's rule over the committed rows.
    assert_eq!(batch_in_sql(&pool, &origin_text, &first_text).await, BTreeSet::from([2]));
    assert_eq!(batch_in_sql(&pool, &first_text, &second_text).await, BTreeSet::from([1, 4]), "the slow transaction is in the later batch; the aborted one in none");
    let committed = [(slow_xid, 1), (fast_xid, 2), (later_xid, 4)];
    let by_core = |prev: &Snapshot, cut: &Snapshot| -> BTreeSet<i32> { committed.iter().filter(|(x, _)| in_batch(prev, cut, *x)).map(|(_, n)| *n).collect() };
    assert_eq!(by_core(&origin, &first), BTreeSet::from([2]));
    assert_eq!(by_core(&first, &second), BTreeSet::from([1, 4]));
    // What a position cursor would have done: the slow transaction's id is
    // below the first cut's horizon, so "above the horizon" skips it.
    assert!(slow_xid < first.xmax(), "the hazard the rule exists for");
}
