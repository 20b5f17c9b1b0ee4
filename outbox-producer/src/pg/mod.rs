//! The PostgreSQL store: claims, attempts, the receipt transaction,
//! unknown/retry, lease expiry. Every method is one transaction; every
//! decision is outbox-core's.
//!
//! Files, one job each: `rows` (reading attempts, receipts, claims and
//! frozen records out of rows); `fence` (the fenced single-row write, the
//! explanation of a refused one, the audit trail); `claims` (the claim
//! statements and their transactions); `attempts` (registering attempts,
//! reading them back); `leases` (renewal and the lease sweep's statement);
//! `receipts` (`acceptDispatchReceipt`); `reconcile` (beginning and
//! finishing reconciliation); `findings` (evidence findings and the open
//! attempts the bypass scan asks about); `status` (the database's clock,
//! the backlog's age, counts per state); `outbox_store` ([`OutboxStore`]
//! for [`PgStore`]). This file holds [`PgStore`], its construction and its
//! transactions.

mod attempts;
mod claims;
mod fence;
mod findings;
mod leases;
mod outbox_store;
mod receipts;
mod reconcile;
mod rows;
mod status;
mod stream;

use std::sync::Arc;

use outbox_core::{ClaimedEvent, Clock, StoreError, SystemClock};
use sqlx::{PgPool, Postgres, Transaction};

use crate::cloudevents::CloudEventsCache;
use crate::error::store_err;
#[cfg(doc)]
use outbox_core::OutboxStore;

pub use findings::EVIDENCE_FINDINGS;
pub(crate) use findings::{record_findings, unanswered_attempts_of};
pub use leases::MAX_SWEEP_ROWS;
pub use status::{db_now_ms, oldest_pending_created_ms};
pub use stream::{dispatch_path, set_dispatch_path, DispatchPath};

/// The PostgreSQL implementation of [`OutboxStore`].
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    clock: Arc<dyn Clock>,
    cluster_scope: Option<String>,
    max_protocol_version: i32,
    /// The source identity and route generations read for CloudEvents headers.
    cloudevents: Arc<CloudEventsCache>,
    /// Whether reconcile tasks measure attempt ages with the database's
    /// clock (on for [`PgStore::new`]; a store on a test clock measures
    /// with that clock only).
    database_clock: bool,
    /// The dispatch path this store last read (schema section 17).
    path_seen: Arc<stream::PathSeen>,
    /// Claims on the stream so far (which bucket a round starts at).
    stream_rounds: Arc<std::sync::atomic::AtomicU64>,
    /// How much of each bucket's window a claim reads.
    window_reads: Arc<stream::WindowReads>,
    /// The highest lease-log seq the lease sweep has pruned up to.
    lease_log_pruned: Arc<std::sync::atomic::AtomicI64>,
}

/// The protocol version of [`crate::PROTOCOL_VERSION`], as a number.
fn own_protocol_version() -> i32 {
    crate::PROTOCOL_VERSION.parse().unwrap_or(1)
}

impl PgStore {
    /// A store on `pool` using the system clock.
    pub fn new(pool: PgPool) -> Self {
        PgStore { pool, clock: Arc::new(SystemClock), cluster_scope: None, max_protocol_version: own_protocol_version(), cloudevents: Arc::default(), database_clock: true, path_seen: Arc::default(), stream_rounds: Arc::default(), window_reads: Arc::default(), lease_log_pruned: Arc::default() }
    }

    /// A store whose leases and timestamps follow `clock` (tests, simulations).
    pub fn with_clock(pool: PgPool, clock: Arc<dyn Clock>) -> Self {
        PgStore { pool, clock, cluster_scope: None, max_protocol_version: own_protocol_version(), cloudevents: Arc::default(), database_clock: false, path_seen: Arc::default(), stream_rounds: Arc::default(), window_reads: Arc::default(), lease_log_pruned: Arc::default() }
    }

    /// Fills [`ClaimedEvent::cloudevents`] of events read outside a claim
    /// (the shadow dispatcher), as a claim does.
    pub async fn attach_cloudevents(&self, events: &mut [ClaimedEvent]) -> Result<(), StoreError> {
        if self.cloudevents.fill_from_known(events) {
            return Ok(());
        }
        let mut conn = self.pool.acquire().await.map_err(store_err)?;
        self.cloudevents.attach(&mut conn, events).await
    }

    /// Restricts claims to events frozen for `cluster_id`: a dispatcher
    /// connected to one cluster never claims another cluster's events.
    pub fn scoped_to_cluster(mut self, cluster_id: impl Into<String>) -> Self {
        self.cluster_scope = Some(cluster_id.into());
        self
    }

    /// Claims only rows of protocol version `version` or older (default: this
    /// build's [`crate::PROTOCOL_VERSION`]). Rows of a newer protocol are left
    /// alone, never guessed at; [`PgStore::rows_beyond_protocol`] counts them.
    pub fn understanding_protocol(mut self, version: i32) -> Self {
        self.max_protocol_version = version;
        self
    }

    /// The newest protocol version this store claims.
    pub fn max_protocol_version(&self) -> i32 {
        self.max_protocol_version
    }

    /// Rows waiting for a dispatcher (PENDING or RETRY_CLAIMED, the outbox's
    /// own, of this store's cluster scope) that this store refuses because
    /// their protocol version is newer than it understands.
    pub async fn rows_beyond_protocol(&self) -> Result<i64, StoreError> {
        sqlx::query_scalar(
            "SELECT count(*) FROM outbox_events WHERE phase IN ('PENDING', 'RETRY_CLAIMED') AND publisher = 'outbox'
               AND protocol_version > $1 AND ($2::text IS NULL OR cluster_id = $2)",
        )
        .bind(self.max_protocol_version)
        .bind(self.cluster_scope.as_deref())
        .fetch_one(&self.pool)
        .await
        .map_err(store_err)
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The clock's time, ms.
    pub fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }

    /// Begins one of this store's transactions, planned without sequential
    /// scans (one round trip: both statements go in one message).
    ///
    /// Every statement of the store's transactions is a probe or a range
    /// of an index. A session caches the plan of a statement it runs often,
    /// and one planned while the outbox tables held a handful of analyzed
    /// rows (as autovacuum leaves young tables) would otherwise go on
    /// reading them from end to end, per batch or per key, after they have
    /// grown: measured, a claim over 200 keys of a 50,000-event table took
    /// 4.9 s instead of milliseconds. `SET LOCAL` ends with the transaction,
    /// so the connection goes back to the pool as it came.
    ///
    /// JIT compilation is off too: with sequential scans off, a plan that
    /// has to read a table whole (a one-row settings table, a statement over
    /// a partitioned table) is costed past `jit_above_cost`, and compiling it
    /// took 5-16 ms per statement (auto_explain, `dispatch_bench --path
    /// stream`), many times what running it takes.
    async fn begin(&self) -> Result<Transaction<'static, Postgres>, StoreError> {
        self.pool.begin_with("BEGIN; SET LOCAL enable_seqscan = off; SET LOCAL jit = off").await.map_err(store_err)
    }
}
