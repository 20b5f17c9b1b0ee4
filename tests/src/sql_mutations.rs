//! Deliberate defects in the stream path's SQL, each a rewrite of one
//! function of the installed schema: the concurrent checker
//! (`tests/tests/concurrent.rs`) must turn red under each.
//!
//! A mutation replaces one fragment of one function's definition (as
//! `pg_get_functiondef` gives it) everywhere it occurs (a function may
//! read the same way in two branches, e.g. `outbox_stream_window`'s first
//! and later reads of a window) and installs the result with the
//! definition's own `CREATE OR REPLACE FUNCTION`; applying it fails when
//! the fragment is not there, so a change of the schema can not quietly
//! leave a mutation without effect.

use sqlx::PgPool;

/// One deliberate defect of the stream's SQL.
#[derive(Debug, Clone, Copy)]
pub struct SqlMutation {
    /// Its name.
    pub name: &'static str,
    /// The defect, in words.
    pub defect: &'static str,
    /// The function rewritten (its name; it is not overloaded).
    pub function: &'static str,
    /// The fragment of its definition replaced...
    pub from: &'static str,
    /// ...by this.
    pub to: &'static str,
    /// The kind of violation the checker must report under it
    /// (the prefix of the verdict's line, e.g. `lost`).
    pub caught_as: &'static str,
}

/// The catalogue.
pub const SQL_MUTATIONS: [SqlMutation; 4] = [
    SqlMutation {
        name: "stream-sql-reversed-order",
        defect: "the window reads a bucket's events newest first, so a batch takes a key's later event before its earlier one (and the window's position passes the earlier ones by)",
        function: "outbox_stream_window",
        from: "ORDER BY s.seq\n",
        to: "ORDER BY s.seq DESC\n",
        caught_as: "stuck",
    },
    SqlMutation {
        name: "stream-sql-lane-state-dropped",
        defect: "the window no longer asks whether a key has an open event in the exception lane, so the key's later events are cut into batches and sent while the earlier one waits there",
        function: "outbox_stream_window",
        from: "AND e.ordered AND e.publisher = 'outbox'",
        to: "AND e.ordered AND e.publisher = 'outbox' AND false",
        caught_as: "order_violation",
    },
    SqlMutation {
        name: "stream-sql-unfenced-lease-write",
        defect: "a claim reads the bucket leases it will rewrite without locking their slots, so two claims cut the same bucket from the same window",
        function: "outbox_stream_claim_leases",
        from: "FOR UPDATE OF k SKIP LOCKED",
        to: "",
        caught_as: "duplicate",
    },
    SqlMutation {
        name: "stream-sql-cut-by-position",
        defect: "a batch takes the transactions above the last cut's horizon instead of those completed since the last cut: a transaction that took its id before a cut and committed after it is in no batch",
        function: "outbox_stream_window",
        from: "AND NOT pg_visible_in_snapshot(s.xid, p_prev[i])",
        to: "AND s.xid >= pg_snapshot_xmax(p_prev[i])",
        caught_as: "stuck",
    },
];

/// The mutation named `name`.
pub fn sql_mutation(name: &str) -> Option<SqlMutation> {
    SQL_MUTATIONS.iter().find(|m| m.name == name).copied()
}

impl SqlMutation {
    /// Installs the defect in `pool`'s database. Fails when the function is
    /// missing or the fragment is not in its definition.
    pub async fn apply(&self, pool: &PgPool) -> Result<(), String> {
        let def: String = sqlx::query_scalar("SELECT pg_get_functiondef(p.oid) FROM pg_proc p WHERE p.proname = $1")
            .bind(self.function)
            .fetch_optional(pool)
            .await
            .map_err(|e| format!("{}: reading {}: {e}", self.name, self.function))?
            .ok_or_else(|| format!("{}: no function {}", self.name, self.function))?;
        let found = def.matches(self.from).count();
        if found == 0 {
            return Err(format!("{}: {:?} is not in {}'s definition", self.name, self.from, self.function));
        }
        let mutated = def.replace(self.from, self.to);
        sqlx::raw_sql(&mutated).execute(pool).await.map_err(|e| format!("{}: installing the mutated {}: {e}", self.name, self.function))?;
        Ok(())
    }
}

/// Events of the stream cut into more than one batch (a batch's events are
/// handed out and sent; an event is cut once, and leaves the stream for
/// the exception lane rather than into a second batch): one line each.
pub async fn events_in_two_batches(pool: &PgPool) -> Vec<String> {
    let rows: Vec<(String, Vec<i64>)> = sqlx::query_as(
        "SELECT x.event_id, array_agg(b.id ORDER BY b.id) FROM outbox_batches b CROSS JOIN unnest(b.event_ids) AS x(event_id)
         GROUP BY x.event_id HAVING count(*) > 1 ORDER BY x.event_id",
    )
    .fetch_all(pool)
    .await
    .expect("the batches are readable");
    rows.into_iter().map(|(e, b)| format!("duplicate: {e} was cut into batches {b:?}")).collect()
}
