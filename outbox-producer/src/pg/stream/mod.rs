//! The stream path in PostgreSQL (schema section 17), beside the chains
//! path, chosen by the database's `outbox_settings.dispatch_path`
//! ([`set_dispatch_path`]).
//!
//! On the happy path an event is written three times, all inserts: its
//! stream row and its command row at emit, its receipt in the publish slot.
//! Per batch (at most a claim's limit of one key bucket's events), the cut
//! writes one batch row and the bucket's lease row, a claim round one
//! `handed` step, the dispatcher's registration one `registered` step.
//!
//! - Claims (PROTOCOL §4, `claims`): a dispatcher holds key buckets'
//!   leases (`outbox_core::stream::grant_lease`); it cuts a bucket's next
//!   batch once the open one is settled (`may_cut_next_batch`), from the
//!   transactions completed between the bucket's last snapshot and a new
//!   one (`in_batch`, in SQL); it hands out one event per key at a time
//!   (`sendable_now`). A handed-out event's claim is the batch's: its
//!   owner, the batch id as claim generation, the bucket's lease.
//! - Registration (`registration`) checks the bucket's lease and records
//!   the registered positions; attempt ids name their batch and position
//!   (`batch_attempt_id`), so no row per attempt is written.
//! - Receipts (PROTOCOL §5, `receipts`): a genuine ACK of a registered
//!   attempt fills the slot; anything else moves the event to the lane
//!   first and is decided there as on the chains path.
//! - The exception lane (`lane`): an event that leaves the happy path (a
//!   report, a release, a quarantine, a receipt that is not a plain ACK, a
//!   takeover of an expired lease) is copied into `outbox_events` in the
//!   state the stream gave it, with the later events of its key in its
//!   batch, and every key with an open event in the lane hands its new
//!   events to the lane: the chains machinery takes them from there.

mod claims;
mod lane;
mod receipts;
mod registration;

use std::sync::atomic::{AtomicU8, Ordering};

use outbox_core::StoreError;
use sqlx::PgPool;

use crate::error::store_err;

/// The path new events take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DispatchPath {
    /// Each event a row of `outbox_events`, claimed through the chain heads.
    Chains,
    /// Each event a row of `outbox_stream`, dispatched in batches.
    Stream,
}

impl DispatchPath {
    /// Its name in `outbox_settings`.
    pub fn as_str(self) -> &'static str {
        match self {
            DispatchPath::Chains => "chains",
            DispatchPath::Stream => "stream",
        }
    }

    /// The path named `s`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "chains" => Some(DispatchPath::Chains),
            "stream" => Some(DispatchPath::Stream),
            _ => None,
        }
    }
}

/// Sets the path the events emitted from now on take. Events already
/// emitted drain on the path they were emitted on: a claim keeps reading
/// the stream, whatever the setting, while it holds events not yet cut
/// into a batch (an emit that read the old setting may commit after the
/// switch).
pub async fn set_dispatch_path(pool: &PgPool, path: DispatchPath) -> Result<(), StoreError> {
    let mut tx = pool.begin().await.map_err(store_err)?;
    // The buckets' lease rows, by which a claim finds the stream's work.
    claims::ensure_leases(&mut *tx, None).await?;
    sqlx::query("UPDATE outbox_settings SET dispatch_path = $1").bind(path.as_str()).execute(&mut *tx).await.map_err(store_err)?;
    tx.commit().await.map_err(store_err)?;
    Ok(())
}

/// The path events emitted now take.
pub async fn dispatch_path(pool: &PgPool) -> Result<DispatchPath, StoreError> {
    let s: String = sqlx::query_scalar("SELECT dispatch_path FROM outbox_settings").fetch_one(pool).await.map_err(store_err)?;
    DispatchPath::parse(&s).ok_or_else(|| StoreError::Backend { message: format!("unknown dispatch path {s:?}"), retryable: false })
}

/// What a store last read of the dispatch path: 0 not read yet, 1 chains, 2 stream.
#[derive(Debug, Default)]
pub(super) struct PathSeen(AtomicU8);

impl PathSeen {
    pub(super) fn set(&self, path: DispatchPath) {
        self.0.store(if path == DispatchPath::Stream { 2 } else { 1 }, Ordering::Relaxed);
    }

    /// Whether the store must look for stream events (the stream was seen,
    /// or nothing was read yet).
    pub(super) fn maybe_stream(&self) -> bool {
        self.0.load(Ordering::Relaxed) != 1
    }
}

/// How many rows of each bucket's window a claim reads: a batch holds one
/// event per key, so a bucket of k keys (in turn) gives batches of about k
/// events, and reading far more than the batch takes reads the rest again
/// next round. Learned per bucket from the last read (a hint only: a read
/// that fills its size is taken as "the window goes on", whatever the size).
#[derive(Debug, Default)]
pub(super) struct WindowReads(std::sync::Mutex<std::collections::HashMap<(String, i16), usize>>);

impl WindowReads {
    /// The rows to read of `bucket` of `cluster`.
    pub(super) fn size(&self, cluster: &str, bucket: i16) -> usize {
        self.0.lock().map(|m| m.get(&(cluster.to_owned(), bucket)).copied()).ok().flatten().unwrap_or(claims::PER_BUCKET)
    }

    /// After a read of `read` rows of the `asked`: `run` rows were the
    /// batch's, and a repeated key ended it (`repeat`).
    pub(super) fn learn(&self, cluster: &str, bucket: i16, asked: usize, read: usize, run: usize, repeat: bool) {
        let next = if repeat {
            run + 2
        } else if read == asked {
            asked * 2
        } else {
            return;
        };
        if let Ok(mut m) = self.0.lock() {
            m.insert((cluster.to_owned(), bucket), next.clamp(4, claims::PER_BUCKET));
        }
    }
}

impl crate::pg::PgStore {
    /// Whether the last claim found the stream path (claims lock disjoint
    /// key buckets there; `ServiceStore::claims_may_overlap`).
    pub(crate) fn stream_claims_may_overlap(&self) -> bool {
        self.path_seen.0.load(Ordering::Relaxed) == 2
    }

    /// Of `ids`, the events that have a row in the lane (`outbox_events`):
    /// every id when the store has seen only the chains path.
    pub(crate) async fn lane_rows(&self, ids: &[&str]) -> Result<std::collections::BTreeSet<String>, StoreError> {
        if !self.path_seen.maybe_stream() || ids.is_empty() {
            return Ok(ids.iter().map(|s| (*s).to_owned()).collect());
        }
        Ok(sqlx::query_scalar("SELECT event_id FROM outbox_events WHERE event_id = ANY($1)").bind(ids).fetch_all(&self.pool).await.map_err(store_err)?.into_iter().collect())
    }
}
