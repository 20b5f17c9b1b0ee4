//! Retention (PROTOCOL §9): PUBLISHED -> RETAINED after the replay window;
//! RETAINED -> PURGED only once every mandatory consumer's watermark has
//! passed the event, in bounded batches. The purge decision is
//! `outbox_core::may_purge` itself, run here on each locked candidate (the
//! in-memory store runs the same function).
//!
//! A purge deletes the payload bytes only. The event row stays as a compact
//! tombstone — eventId, command key, digests, frozen envelopes and the
//! publish receipt — so a late duplicate ACK still meets its slot and a
//! retried command still meets its first eventId after the purge.

use outbox_core::{may_purge, EventState, HoldReason, LogPosition, WatermarkRef};
use sqlx::{PgConnection, PgPool, Row};

use crate::error::ProducerError;

/// Largest batch one purge statement touches.
pub const MAX_PURGE_BATCH: i64 = 10_000;

/// When evidence may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// The maximum replay window: nothing published more recently is retained or purged, ms.
    pub replay_window_ms: i64,
    /// Rows per batch: a retain statement, or a page of purge candidates (1..=10 000).
    pub batch_size: i64,
    /// Most batches per call (bounds one call's work).
    pub max_batches: u32,
}

impl Default for RetentionPolicy {
    fn default() -> Self {
        RetentionPolicy { replay_window_ms: 7 * 24 * 3_600_000, batch_size: 1_000, max_batches: 100 }
    }
}

/// What a retention pass did (or, in a dry run, would do).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PurgeReport {
    /// Whether nothing was written.
    pub dry_run: bool,
    /// PUBLISHED -> RETAINED.
    pub retained: u64,
    /// RETAINED -> PURGED.
    pub purged: u64,
    /// RETAINED events judged in this pass and held back because a
    /// mandatory consumer has not passed them (in a dry run, PUBLISHED ones
    /// past the window too, judged as if retained).
    pub held_by_consumers: u64,
    /// Batches run: retain statements and purge pages (in a dry run, pages read).
    pub batches: u32,
}

/// One candidate past the replay window with its primary receipt's log position.
struct Candidate {
    event_id: String,
    state: EventState,
    published_at_ms: i64,
    cluster_id: String,
    topic: String,
    topic_id: Option<String>,
    partition: i32,
    offset: i64,
}

/// Where a pass's keyset stands: the last candidate read, in
/// `(published_at_ms, event_id)` order.
type Cursor = (i64, String);

const START: (i64, &str) = (i64::MIN, "");

/// One page of candidates, and where the next page starts.
struct Page {
    candidates: Vec<Candidate>,
    /// The last event read (candidate or not), `None` for an empty page.
    last: Option<Cursor>,
    /// Whether the page was full (more may follow).
    full: bool,
}

/// One page of the events in `phase` (a literal: the partial indexes are on
/// `phase`) published before the replay window, after `after` in
/// `(published_at_ms, event_id)` order, then their primary receipts.
/// `lock`: `FOR UPDATE SKIP LOCKED` (the caller's transaction purges them).
///
/// The events are read alone (index on `published_at_ms`, an incremental
/// sort by `event_id`, then the limit), so a page reads about
/// `batch_size` rows however many candidates follow; joined with the
/// receipts in one statement the planner may sort every candidate past the
/// cursor instead. The receipts are then read by key for the page's events.
async fn candidates(conn: &mut PgConnection, phase: &'static str, now_ms: i64, policy: &RetentionPolicy, after: &Cursor, lock: bool) -> Result<Page, ProducerError> {
    debug_assert!(matches!(phase, "PUBLISHED" | "RETAINED"));
    let lock = if lock { "FOR UPDATE SKIP LOCKED" } else { "" };
    let events: Vec<(String, String, i64, i32)> = sqlx::query_as(&format!(
        "SELECT event_id, state, published_at_ms, envelope_generation FROM outbox_events
         WHERE phase = '{phase}' AND published_at_ms < $1 - $2
           AND published_at_ms >= $3 AND (published_at_ms, event_id) > ($3, $4)
         ORDER BY published_at_ms, event_id LIMIT $5 {lock}"
    ))
    .bind(now_ms)
    .bind(policy.replay_window_ms)
    .bind(after.0)
    .bind(&after.1)
    .bind(policy.batch_size)
    .fetch_all(&mut *conn)
    .await?;
    let last = events.last().map(|e| (e.2, e.0.clone()));
    let full = events.len() as i64 >= policy.batch_size;
    if events.is_empty() {
        return Ok(Page { candidates: Vec::new(), last, full });
    }
    let ids: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    let rows = sqlx::query(
        "SELECT event_id, envelope_generation, cluster_id, topic, topic_id, partition, \"offset\" FROM outbox_publish_receipts WHERE event_id = ANY($1)",
    )
    .bind(&ids)
    .fetch_all(&mut *conn)
    .await?;
    let mut receipts = std::collections::HashMap::with_capacity(rows.len());
    for r in &rows {
        receipts.insert((r.try_get::<String, _>("event_id")?, r.try_get::<i32, _>("envelope_generation")?), r);
    }
    let mut candidates = Vec::with_capacity(events.len());
    // An event without a receipt of its generation (which the schema
    // forbids for PUBLISHED and RETAINED) is not judged: nothing says where it is.
    for (event_id, state, published_at_ms, generation) in events {
        let Some(r) = receipts.get(&(event_id.clone(), generation)) else { continue };
        candidates.push(Candidate {
            state: EventState::parse(&state)?,
            published_at_ms,
            cluster_id: r.try_get("cluster_id")?,
            topic: r.try_get("topic")?,
            topic_id: r.try_get("topic_id")?,
            partition: r.try_get("partition")?,
            offset: r.try_get("offset")?,
            event_id,
        });
    }
    Ok(Page { candidates, last, full })
}

/// What `may_purge` decided for one page.
#[derive(Default)]
struct Decided {
    purge: Vec<String>,
    held: u64,
}

/// Decides a page with `outbox_core::may_purge`, on what it needs read in
/// one query: the mandatory consumers reading the page's topics, and their
/// watermarks on those topics. Which watermark is of an event's log
/// (cluster, topic id, partition) is `WatermarkRef::covers_log_of`'s to
/// say, not the query's. `as_retained`: judge PUBLISHED candidates as if
/// retained (a dry run).
async fn decide(conn: &mut PgConnection, page: &[Candidate], now_ms: i64, policy: &RetentionPolicy, watermarks: bool, as_retained: bool) -> Result<Decided, ProducerError> {
    let mut topics: Vec<&str> = page.iter().map(|c| c.topic.as_str()).collect();
    topics.sort_unstable();
    topics.dedup();
    type Row = (String, Vec<String>, Option<String>, Option<String>, Option<String>, Option<i32>, Option<i64>);
    let rows: Vec<Row> = if watermarks {
        sqlx::query_as(
            "SELECT c.consumer_id, c.topics, w.cluster_id, w.topic, w.topic_id, w.partition, w.committed_offset
             FROM outbox_consumers c
             LEFT JOIN outbox_consumer_watermarks w ON w.consumer_id = c.consumer_id AND w.topic = ANY($1::text[])
             WHERE c.mandatory AND c.topics && $1::text[]",
        )
        .bind(&topics)
        .fetch_all(&mut *conn)
        .await?
    } else {
        sqlx::query_as(
            "SELECT consumer_id, topics, NULL::text, NULL::text, NULL::text, NULL::int, NULL::bigint
             FROM outbox_consumers WHERE mandatory AND topics && $1::text[]",
        )
        .bind(&topics)
        .fetch_all(&mut *conn)
        .await?
    };
    let mut consumers: Vec<(&str, &[String])> = rows.iter().map(|r| (r.0.as_str(), r.1.as_slice())).collect();
    consumers.sort_unstable();
    consumers.dedup();
    let wms: Vec<WatermarkRef<'_>> = rows
        .iter()
        .filter_map(|(consumer_id, _, cluster_id, topic, topic_id, partition, committed_offset)| {
            Some(WatermarkRef {
                consumer_id,
                cluster_id: cluster_id.as_deref()?,
                topic: topic.as_deref()?,
                topic_id: topic_id.as_deref(),
                partition: (*partition)?,
                committed_offset: (*committed_offset)?,
            })
        })
        .collect();
    let mut out = Decided::default();
    for c in page {
        let on_topic: Vec<&str> = consumers.iter().filter(|(_, topics)| topics.iter().any(|t| *t == c.topic)).map(|(id, _)| *id).collect();
        let at = LogPosition { cluster_id: &c.cluster_id, topic: &c.topic, topic_id: c.topic_id.as_deref(), partition: c.partition, offset: c.offset };
        let state = if as_retained && c.state == EventState::Published { EventState::Retained } else { c.state };
        match may_purge(state, c.published_at_ms, now_ms, policy.replay_window_ms, at, &wms, &on_topic) {
            Ok(()) => out.purge.push(c.event_id.clone()),
            Err(HoldReason::NoWatermark { .. } | HoldReason::WatermarkBehind { .. }) => out.held += 1,
            Err(HoldReason::NotRetained { .. } | HoldReason::WithinReplayWindow) => {}
        }
    }
    Ok(out)
}

/// Runs retention. With `dry_run`, judges what would change and writes nothing.
/// `progress` is called after each batch with the running totals.
///
/// PUBLISHED -> RETAINED past the replay window (`outbox_core::may_retain`'s
/// condition, in SQL); then RETAINED -> PURGED as `outbox_core::may_purge`
/// decides: each batch, in one transaction, locks a page of RETAINED events
/// past the window (`FOR UPDATE SKIP LOCKED`, oldest first), reads the
/// registry and watermarks the decision needs in one query, decides each
/// event in Rust and purges exactly those it allows. Pages follow a keyset
/// on `(published_at_ms, event_id)`, so events held by a consumer are read
/// once per call and never stop the later ones from being judged; a call
/// reads at most `batch_size * max_batches` candidates per phase.
/// `held_by_consumers` counts the events judged and held back in this call.
/// A dry run reads the same pages without locks (the PUBLISHED ones judged
/// as if retained), bounded the same way.
pub async fn purge(pool: &PgPool, now_ms: i64, policy: &RetentionPolicy, dry_run: bool, mut progress: impl FnMut(&PurgeReport)) -> Result<PurgeReport, ProducerError> {
    if !(1..=MAX_PURGE_BATCH).contains(&policy.batch_size) {
        return Err(ProducerError::Config(format!("purge batch_size {} (1..={MAX_PURGE_BATCH})", policy.batch_size)));
    }
    if policy.replay_window_ms < 0 {
        return Err(ProducerError::Config("replay_window_ms must not be negative".into()));
    }
    let watermarks = crate::report::has_watermarks(pool).await?;
    let mut report = PurgeReport { dry_run, ..Default::default() };

    if dry_run {
        let mut conn = pool.acquire().await?;
        for phase in ["PUBLISHED", "RETAINED"] {
            let mut after: Cursor = (START.0, START.1.to_owned());
            for _ in 0..policy.max_batches {
                let page = candidates(&mut conn, phase, now_ms, policy, &after, false).await?;
                let decided = decide(&mut conn, &page.candidates, now_ms, policy, watermarks, true).await?;
                if phase == "PUBLISHED" {
                    report.retained += page.candidates.len() as u64;
                }
                report.purged += decided.purge.len() as u64;
                report.held_by_consumers += decided.held;
                report.batches += 1;
                progress(&report);
                match page.last {
                    Some(last) if page.full => after = last,
                    _ => break,
                }
            }
        }
        return Ok(report);
    }

    let retain = "UPDATE outbox_events SET state = 'RETAINED', state_since_ms = $1
         WHERE event_id IN (SELECT event_id FROM outbox_events WHERE phase = 'PUBLISHED' AND published_at_ms < $1 - $2
                            ORDER BY published_at_ms LIMIT $3 FOR UPDATE SKIP LOCKED)";
    for _ in 0..policy.max_batches {
        let n = sqlx::query(retain).bind(now_ms).bind(policy.replay_window_ms).bind(policy.batch_size).execute(pool).await?.rows_affected();
        report.retained += n;
        report.batches += 1;
        progress(&report);
        if (n as i64) < policy.batch_size {
            break;
        }
    }

    let mut after: Cursor = (START.0, START.1.to_owned());
    for _ in 0..policy.max_batches {
        let mut tx = pool.begin().await?;
        let page = candidates(&mut tx, "RETAINED", now_ms, policy, &after, true).await?;
        let decided = decide(&mut tx, &page.candidates, now_ms, policy, watermarks, false).await?;
        let n = if decided.purge.is_empty() {
            0
        } else {
            sqlx::query("UPDATE outbox_events SET state = 'PURGED', payload = NULL, state_since_ms = $1 WHERE event_id = ANY($2) AND phase = 'RETAINED'")
                .bind(now_ms)
                .bind(&decided.purge)
                .execute(&mut *tx)
                .await?
                .rows_affected()
        };
        tx.commit().await?;
        report.purged += n;
        report.held_by_consumers += decided.held;
        report.batches += 1;
        progress(&report);
        match page.last {
            Some(last) if page.full => after = last,
            _ => break,
        }
    }
    tracing::info!(?report, "retention pass");
    Ok(report)
}

/// Registers (or updates) a consumer the reconciler and retention know about.
/// `critical`: its watermark is compared with the published set;
/// `mandatory`: nothing on its topics is purged before its watermark passes.
pub async fn register_consumer(pool: &PgPool, consumer_id: &str, topics: &[&str], critical: bool, mandatory: bool) -> Result<(), ProducerError> {
    outbox_core::id::validate_identifier("consumerId", consumer_id)?;
    sqlx::query(
        "INSERT INTO outbox_consumers (consumer_id, critical, mandatory, topics) VALUES ($1, $2, $3, $4)
         ON CONFLICT (consumer_id) DO UPDATE SET critical = EXCLUDED.critical, mandatory = EXCLUDED.mandatory, topics = EXCLUDED.topics",
    )
    .bind(consumer_id)
    .bind(critical)
    .bind(mandatory)
    .bind(topics)
    .execute(pool)
    .await?;
    Ok(())
}
