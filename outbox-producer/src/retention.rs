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

use outbox_core::{may_purge, EventState, HoldReason, WatermarkRef};
use sqlx::{PgPool, Row};

use crate::error::ProducerError;

/// Whether the partition of receipt `r` had its log replaced: a receipt
/// of it at a position epoch above 0 (`LogPosition::partition_replaced`;
/// a probe of the partial index `outbox_publish_receipts_replaced`).
pub(crate) const PARTITION_REPLACED: &str = "EXISTS (SELECT 1 FROM outbox_publish_receipts x WHERE x.position_epoch > 0
     AND x.cluster_id = r.cluster_id AND x.topic = r.topic AND x.partition = r.partition)";

/// The receipt of watermark `w`'s anchor at its last offset, joined once
/// per watermark row as `an`: `an.anchor_epoch` (its position epoch) and
/// `an.anchor_accepted_ms` (when it was accepted); both NULL when there is
/// no anchor or no receipt of it there (`outbox_core::WatermarkAnchor`).
pub(crate) const ANCHOR_JOIN: &str = "LEFT JOIN LATERAL (SELECT ar.position_epoch AS anchor_epoch, ar.accepted_at_ms AS anchor_accepted_ms
     FROM outbox_publish_receipts ar
     WHERE ar.event_id = w.anchor_event_id AND ar.cluster_id = w.cluster_id AND ar.topic = w.topic AND ar.partition = w.partition
       AND ar.\"offset\" = w.committed_offset - 1 ORDER BY ar.position_epoch DESC LIMIT 1) an ON true";

/// When the message at receipt `r`'s position was written at the earliest
/// (`LogPosition::sent_from_ms`): the start of the attempt the receipt
/// names (the message carries that attempt's id, made when it started), or
/// for a stream event's receipt the cut of the batch that registered it.
/// Joined once per receipt row as `sf.sent_from_ms` (`OFFSET 0` keeps the
/// planner from copying the expression into each place a query reads it).
pub(crate) const SENT_FROM_JOIN: &str = "CROSS JOIN LATERAL (SELECT COALESCE((SELECT a.started_at_ms FROM outbox_attempts a WHERE a.attempt_id = r.attempt_id),
     (SELECT b.cut_at_ms FROM outbox_batches b WHERE b.id = r.batch_id)) AS sent_from_ms OFFSET 0) sf";

/// Whether an open `receipt_position_lost` finding names receipt `r`'s
/// event (`LogPosition::position_lost`).
pub(crate) const POSITION_LOST: &str = "EXISTS (SELECT 1 FROM outbox_findings f WHERE f.kind = 'receipt_position_lost' AND f.event_id = r.event_id
     AND f.consumer_id = '' AND f.resolved_at_ms IS NULL)";

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
    /// Of `held_by_consumers`, the `destination.v1` events whose receipt is
    /// of a log that replaced another under the same cluster, topic and
    /// partition (`HoldReason::ReplacedLog`): no watermark lets them go; an
    /// operator confirms each consumer processed them (docs/OPERATIONS.md).
    pub held_on_replaced_log: u64,
    /// RETAINED events held because an open `receipt_position_lost` finding
    /// says the log lost them (`HoldReason::PositionLost`): their payload
    /// is the only copy left (not counted in `held_by_consumers`).
    pub held_on_lost_position: u64,
    /// Batches run: retain statements and purge pages (in a dry run, pages read).
    pub batches: u32,
}

/// One candidate past the replay window with its primary receipt's log
/// position: the facts the comparison reads of a published event too.
pub type Candidate = outbox_core::PublishedFacts;

/// Where a pass's keyset stands: the last candidate read, in
/// `(published_at_ms, event_id)` order.
pub type Cursor = (i64, String);

const START: (i64, &str) = (i64::MIN, "");

/// One page of candidates, and where the next page starts.
#[derive(Debug, Clone, Default)]
pub struct Page {
    /// The page's events that have a primary receipt of their generation.
    pub candidates: Vec<Candidate>,
    /// The last event read (candidate or not), `None` for an empty page.
    pub last: Option<Cursor>,
    /// Whether the page was full (more may follow).
    pub full: bool,
}

/// What the purge decision reads about consumers: the mandatory consumers
/// reading any of a page's topics (id, topics), and their watermarks on
/// those topics (any cluster, topic id, partition: which one is of an
/// event's log is `WatermarkRef::covers_log_of`'s to say).
#[derive(Debug, Clone, Default)]
pub struct Registry {
    /// Mandatory consumers and the topics they read.
    pub mandatory: Vec<(String, Vec<String>)>,
    /// Their watermarks.
    pub watermarks: Vec<outbox_core::ConsumerWatermark>,
}

/// The reads and writes of a retention pass, in a store's transaction. The
/// decisions are [`purge_with`]'s (`may_retain`, `may_purge`): a store only
/// reads and writes rows. PostgreSQL ([`PgRetention`]) and the in-memory
/// store implement it, so the simulator runs this very pass.
#[async_trait::async_trait]
pub trait RetentionStore: Send + Sync {
    /// A transaction.
    type Tx: Send;
    /// Begins one.
    async fn begin(&self) -> Result<Self::Tx, ProducerError>;
    /// Commits it.
    async fn commit(&self, tx: Self::Tx) -> Result<(), ProducerError>;
    /// Upkeep once before a pass that writes (PostgreSQL: the stream's
    /// partitions ahead of its sequence). Nothing by default.
    async fn upkeep(&self) -> Result<(), ProducerError> {
        Ok(())
    }
    /// PUBLISHED -> RETAINED for at most `limit` events (oldest first)
    /// published before `before_ms` (`outbox_core::may_retain`'s
    /// condition); how many moved.
    async fn retain(&self, now_ms: i64, before_ms: i64, limit: i64) -> Result<u64, ProducerError>;
    /// A page of at most `limit` events in `state` (PUBLISHED or RETAINED)
    /// published before `before_ms`, after `after` in `(published_at_ms,
    /// event_id)` order, with their primary receipts' positions; `lock`:
    /// locked for `tx` (skipping rows another pass holds).
    async fn candidates(&self, tx: &mut Self::Tx, state: EventState, before_ms: i64, after: &Cursor, limit: i64, lock: bool) -> Result<Page, ProducerError>;
    /// The mandatory consumers reading any of `topics`, and their watermarks on them.
    async fn registry(&self, tx: &mut Self::Tx, topics: &[&str]) -> Result<Registry, ProducerError>;
    /// RETAINED -> PURGED for `ids` (payload dropped, tombstone kept); how many moved.
    async fn purge_ids(&self, tx: &mut Self::Tx, ids: &[String], now_ms: i64) -> Result<u64, ProducerError>;
}

/// What `may_purge` decided for one page.
#[derive(Default)]
struct Decided {
    purge: Vec<String>,
    held: u64,
    /// Of `held`, by `HoldReason::ReplacedLog`.
    replaced_log: u64,
    /// By `HoldReason::PositionLost`.
    lost_position: u64,
}

/// Decides a page with `outbox_core::may_purge` on `registry`.
/// `as_retained`: judge PUBLISHED candidates as if retained (a dry run).
fn decide(page: &[Candidate], registry: &Registry, now_ms: i64, policy: &RetentionPolicy, as_retained: bool) -> Decided {
    let wms: Vec<WatermarkRef<'_>> = registry.watermarks.iter().map(|w| w.watermark_ref()).collect();
    let mut out = Decided::default();
    for c in page {
        let on_topic: Vec<&str> = registry.mandatory.iter().filter(|(_, topics)| topics.iter().any(|t| *t == c.log.topic)).map(|(id, _)| id.as_str()).collect();
        let state = if as_retained && c.state == EventState::Published { EventState::Retained } else { c.state };
        match may_purge(state, c.published_at_ms, now_ms, policy.replay_window_ms, c.position(), &wms, &on_topic) {
            Ok(()) => out.purge.push(c.event_id.clone()),
            Err(HoldReason::NoWatermark { .. } | HoldReason::WatermarkBehind { .. }) => out.held += 1,
            Err(HoldReason::WatermarkOfAnotherLog { consumer_id, committed_offset }) => {
                tracing::warn!(event_id = %c.event_id, consumer_id, topic = %c.log.topic, partition = c.log.partition, offset = c.offset, committed_offset,
                    "retention holds an event a watermark of another log passed: the event the consumer recorded at its last offset has no receipt there in this event's position epoch");
                out.held += 1;
            }
            Err(HoldReason::ReplacedLog { consumer_id, position_epoch }) => {
                tracing::warn!(event_id = %c.event_id, consumer_id, topic = %c.log.topic, partition = c.log.partition, offset = c.offset, position_epoch,
                    "retention holds an event of a replaced log: no watermark of its partition can say the consumer processed it");
                out.held += 1;
                out.replaced_log += 1;
            }
            Err(HoldReason::PositionLost) => {
                tracing::warn!(event_id = %c.event_id, topic = %c.log.topic, partition = c.log.partition, offset = c.offset,
                    "retention holds an event whose position the log lost (receipt_position_lost): its payload is the only copy left");
                out.lost_position += 1;
            }
            Err(HoldReason::NotRetained { .. } | HoldReason::WithinReplayWindow) => {}
        }
    }
    out
}

/// Reads a page of `state` after `after` (locked unless `dry_run`) and the
/// registry its topics need, and decides it (a dry run judges PUBLISHED
/// events as if retained).
#[allow(clippy::too_many_arguments)]
async fn judge_page<S: RetentionStore>(
    store: &S,
    tx: &mut S::Tx,
    state: EventState,
    before_ms: i64,
    after: &Cursor,
    policy: &RetentionPolicy,
    now_ms: i64,
    dry_run: bool,
) -> Result<(Page, Decided), ProducerError> {
    let page = store.candidates(tx, state, before_ms, after, policy.batch_size, !dry_run).await?;
    let registry = store.registry(tx, &topics_of(&page.candidates)).await?;
    let decided = decide(&page.candidates, &registry, now_ms, policy, dry_run);
    Ok((page, decided))
}

impl Page {
    /// Where the next page starts, if one may follow.
    fn next(&self) -> Option<Cursor> {
        self.last.clone().filter(|_| self.full)
    }
}

/// The topics of a page, each once.
fn topics_of(page: &[Candidate]) -> Vec<&str> {
    let mut topics: Vec<&str> = page.iter().map(|c| c.log.topic.as_str()).collect();
    topics.sort_unstable();
    topics.dedup();
    topics
}

/// Runs retention on the PostgreSQL outbox: [`purge_with`] over [`PgRetention`].
pub async fn purge(pool: &PgPool, now_ms: i64, policy: &RetentionPolicy, dry_run: bool, progress: impl FnMut(&PurgeReport)) -> Result<PurgeReport, ProducerError> {
    let store = PgRetention::new(pool.clone()).await?;
    purge_with(&store, now_ms, policy, dry_run, progress).await
}

/// Runs retention. With `dry_run`, judges what would change and writes nothing.
/// `progress` is called after each batch with the running totals.
///
/// PUBLISHED -> RETAINED past the replay window (`outbox_core::may_retain`'s
/// condition); then RETAINED -> PURGED as `outbox_core::may_purge`
/// decides: each batch, in one transaction, locks a page of RETAINED events
/// past the window (oldest first, skipping rows another pass holds), reads
/// the registry and watermarks the decision needs, decides each event and
/// purges exactly those it allows. Pages follow a keyset on
/// `(published_at_ms, event_id)`, so events held by a consumer are read
/// once per call and never stop the later ones from being judged; a call
/// reads at most `batch_size * max_batches` candidates per phase.
/// `held_by_consumers` counts the events judged and held back in this call.
/// A dry run reads the same pages without locks (the PUBLISHED ones judged
/// as if retained), bounded the same way.
pub async fn purge_with<S: RetentionStore>(store: &S, now_ms: i64, policy: &RetentionPolicy, dry_run: bool, mut progress: impl FnMut(&PurgeReport)) -> Result<PurgeReport, ProducerError> {
    if !(1..=MAX_PURGE_BATCH).contains(&policy.batch_size) {
        return Err(ProducerError::Config(format!("purge batch_size {} (1..={MAX_PURGE_BATCH})", policy.batch_size)));
    }
    if policy.replay_window_ms < 0 {
        return Err(ProducerError::Config("replay_window_ms must not be negative".into()));
    }
    let before_ms = now_ms.saturating_sub(policy.replay_window_ms);
    let mut report = PurgeReport { dry_run, ..Default::default() };

    if dry_run {
        let mut tx = store.begin().await?;
        for state in [EventState::Published, EventState::Retained] {
            let mut after: Cursor = (START.0, START.1.to_owned());
            for _ in 0..policy.max_batches {
                let (page, decided) = judge_page(store, &mut tx, state, before_ms, &after, policy, now_ms, true).await?;
                if state == EventState::Published {
                    report.retained += page.candidates.len() as u64;
                }
                report.purged += decided.purge.len() as u64;
                report.held_by_consumers += decided.held;
                report.held_on_replaced_log += decided.replaced_log;
                report.held_on_lost_position += decided.lost_position;
                report.batches += 1;
                progress(&report);
                match page.next() {
                    Some(next) => after = next,
                    None => break,
                }
            }
        }
        store.commit(tx).await?;
        return Ok(report);
    }

    store.upkeep().await?;
    for _ in 0..policy.max_batches {
        let n = store.retain(now_ms, before_ms, policy.batch_size).await?;
        report.retained += n;
        report.batches += 1;
        progress(&report);
        if (n as i64) < policy.batch_size {
            break;
        }
    }

    let mut after: Cursor = (START.0, START.1.to_owned());
    for _ in 0..policy.max_batches {
        let mut tx = store.begin().await?;
        let (page, decided) = judge_page(store, &mut tx, EventState::Retained, before_ms, &after, policy, now_ms, false).await?;
        let n = if decided.purge.is_empty() { 0 } else { store.purge_ids(&mut tx, &decided.purge, now_ms).await? };
        store.commit(tx).await?;
        report.purged += n;
        report.held_by_consumers += decided.held;
        report.held_on_replaced_log += decided.replaced_log;
        report.held_on_lost_position += decided.lost_position;
        report.batches += 1;
        progress(&report);
        match page.next() {
            Some(next) => after = next,
            None => break,
        }
    }
    tracing::info!(?report, "retention pass");
    Ok(report)
}

/// The PostgreSQL outbox's rows for [`purge_with`].
#[derive(Debug, Clone)]
pub struct PgRetention {
    pool: PgPool,
    /// Whether the watermark table exists (an outbox without consumer
    /// migrations: every mandatory consumer holds everything).
    watermarks: bool,
}

/// How many of the stream's partitions (2^24 seqs each) retention keeps
/// created and attached past the one the sequence is in.
pub const STREAM_PARTITIONS_AHEAD: i32 = 2;

/// At most how many of the stream's partitions one retention pass drops
/// (each once every event in it is in the lane, `outbox_stream_drop_settled`).
pub const STREAM_PARTITIONS_DROPPED_PER_PASS: i32 = 4;

impl PgRetention {
    /// Over `pool`.
    pub async fn new(pool: PgPool) -> Result<Self, ProducerError> {
        let watermarks = crate::report::has_watermarks(&pool).await?;
        Ok(PgRetention { pool, watermarks })
    }
}

#[async_trait::async_trait]
impl RetentionStore for PgRetention {
    type Tx = sqlx::Transaction<'static, sqlx::Postgres>;

    async fn begin(&self) -> Result<Self::Tx, ProducerError> {
        Ok(self.pool.begin().await?)
    }

    async fn commit(&self, tx: Self::Tx) -> Result<(), ProducerError> {
        Ok(tx.commit().await?)
    }

    /// The stream's partitions stay ahead of its sequence, so that no
    /// event lands in its default partition, and those behind it whose
    /// events are all in the lane are dropped (schema section 17).
    async fn upkeep(&self) -> Result<(), ProducerError> {
        let attached: i32 = sqlx::query_scalar("SELECT outbox_stream_partitions_ahead($1)").bind(STREAM_PARTITIONS_AHEAD).fetch_one(&self.pool).await?;
        if attached > 0 {
            tracing::info!(attached, "stream partitions created and attached ahead of the sequence");
        }
        let dropped: i32 = sqlx::query_scalar("SELECT outbox_stream_drop_settled($1)").bind(STREAM_PARTITIONS_DROPPED_PER_PASS).fetch_one(&self.pool).await?;
        if dropped > 0 {
            tracing::info!(dropped, "stream partitions dropped: every event in them is in the lane");
        }
        Ok(())
    }

    async fn retain(&self, now_ms: i64, before_ms: i64, limit: i64) -> Result<u64, ProducerError> {
        // Published stream events are retained in the lane, until the
        // stream's partitions are dropped whole (schema section 17).
        crate::PgStore::new(self.pool.clone()).stream_published_to_lane(before_ms, limit).await?;
        let retain = "UPDATE outbox_events SET state = 'RETAINED', state_since_ms = $1
             WHERE event_id IN (SELECT event_id FROM outbox_events WHERE phase = 'PUBLISHED' AND published_at_ms < $2
                                ORDER BY published_at_ms LIMIT $3 FOR UPDATE SKIP LOCKED)";
        Ok(sqlx::query(retain).bind(now_ms).bind(before_ms).bind(limit).execute(&self.pool).await?.rows_affected())
    }

    /// The events are read alone (index on `published_at_ms`, an
    /// incremental sort by `event_id`, then the limit), so a page reads
    /// about `limit` rows however many candidates follow; joined with the
    /// receipts in one statement the planner may sort every candidate past
    /// the cursor instead. The receipts are then read by key.
    async fn candidates(&self, tx: &mut Self::Tx, state: EventState, before_ms: i64, after: &Cursor, limit: i64, lock: bool) -> Result<Page, ProducerError> {
        // A literal: the partial indexes are on `phase`.
        let phase = match state {
            EventState::Published => "PUBLISHED",
            EventState::Retained => "RETAINED",
            other => return Err(ProducerError::Config(format!("retention reads PUBLISHED or RETAINED events, not {other:?}"))),
        };
        let lock = if lock { "FOR UPDATE SKIP LOCKED" } else { "" };
        let events: Vec<(String, String, i64, i32)> = sqlx::query_as(&format!(
            "SELECT event_id, state, published_at_ms, envelope_generation FROM outbox_events
             WHERE phase = '{phase}' AND published_at_ms < $1
               AND published_at_ms >= $2 AND (published_at_ms, event_id) > ($2, $3)
             ORDER BY published_at_ms, event_id LIMIT $4 {lock}"
        ))
        .bind(before_ms)
        .bind(after.0)
        .bind(&after.1)
        .bind(limit)
        .fetch_all(&mut **tx)
        .await?;
        let last = events.last().map(|e| (e.2, e.0.clone()));
        let full = events.len() as i64 >= limit;
        if events.is_empty() {
            return Ok(Page { candidates: Vec::new(), last, full });
        }
        let ids: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
        let rows = sqlx::query(&format!(
            "SELECT r.event_id, r.envelope_generation, r.cluster_id, r.topic, r.topic_id, r.partition, r.\"offset\", r.position_epoch, r.log_id,
                    {PARTITION_REPLACED} AS partition_replaced, {POSITION_LOST} AS position_lost, sf.sent_from_ms
             FROM outbox_publish_receipts r {SENT_FROM_JOIN} WHERE r.event_id = ANY($1)"
        ))
        .bind(&ids)
        .fetch_all(&mut **tx)
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
                log: outbox_core::LogId { cluster_id: r.try_get("cluster_id")?, topic: r.try_get("topic")?, topic_id: r.try_get("topic_id")?, partition: r.try_get("partition")? },
                state: EventState::parse(&state)?,
                published_at_ms,
                offset: r.try_get("offset")?,
                position_epoch: r.try_get("position_epoch")?,
                partition_replaced: r.try_get("partition_replaced")?,
                position_lost: r.try_get("position_lost")?,
                sent_from_ms: r.try_get("sent_from_ms")?,
                event_id,
                log_id: r.try_get("log_id")?,
            });
        }
        Ok(Page { candidates, last, full })
    }

    /// One query: the mandatory consumers reading the topics, with their
    /// watermarks on them (which one is of an event's log is
    /// `covers_log_of`'s to say, not the query's).
    async fn registry(&self, tx: &mut Self::Tx, topics: &[&str]) -> Result<Registry, ProducerError> {
        if topics.is_empty() {
            return Ok(Registry::default());
        }
        type Row = (String, Vec<String>, Option<String>, Option<String>, Option<String>, Option<i32>, Option<i64>, Option<bool>, Option<String>, Option<i32>, Option<i64>, Option<String>);
        let rows: Vec<Row> = if self.watermarks {
            sqlx::query_as(&format!(
                "SELECT c.consumer_id, c.topics, w.cluster_id, w.topic, w.topic_id, w.partition, w.committed_offset, w.anchor_recorded, w.anchor_event_id, an.anchor_epoch, an.anchor_accepted_ms, w.log_id
                 FROM outbox_consumers c
                 LEFT JOIN outbox_consumer_watermarks w ON w.consumer_id = c.consumer_id AND w.topic = ANY($1::text[])
                 {ANCHOR_JOIN}
                 WHERE c.mandatory AND c.topics && $1::text[]"
            ))
            .bind(topics)
            .fetch_all(&mut **tx)
            .await?
        } else {
            sqlx::query_as(
                "SELECT consumer_id, topics, NULL::text, NULL::text, NULL::text, NULL::int, NULL::bigint, NULL::boolean, NULL::text, NULL::int, NULL::bigint, NULL::text
                 FROM outbox_consumers WHERE mandatory AND topics && $1::text[]",
            )
            .bind(topics)
            .fetch_all(&mut **tx)
            .await?
        };
        let mut registry = Registry::default();
        for (consumer_id, topics, cluster_id, topic, topic_id, partition, committed_offset, anchor_recorded, anchor_event_id, anchor_epoch, anchor_accepted_ms, log_id) in rows {
            if !registry.mandatory.iter().any(|(id, _)| *id == consumer_id) {
                registry.mandatory.push((consumer_id.clone(), topics));
            }
            if let (Some(cluster_id), Some(topic), Some(partition), Some(committed_offset)) = (cluster_id, topic, partition, committed_offset) {
                registry.watermarks.push(outbox_core::ConsumerWatermark { log: outbox_core::LogId { cluster_id, topic, topic_id, partition }, consumer_id, committed_offset, anchor_recorded: anchor_recorded.unwrap_or(false), anchor_event_id, anchor_epoch, anchor_accepted_ms, log_id });
            }
        }
        Ok(registry)
    }

    async fn purge_ids(&self, tx: &mut Self::Tx, ids: &[String], now_ms: i64) -> Result<u64, ProducerError> {
        Ok(sqlx::query("UPDATE outbox_events SET state = 'PURGED', payload = NULL, state_since_ms = $1 WHERE event_id = ANY($2) AND phase = 'RETAINED'")
            .bind(now_ms)
            .bind(ids)
            .execute(&mut **tx)
            .await?
            .rows_affected())
    }
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

/// The in-memory store's rows for [`purge_with`] (the simulator's): its
/// registry is its consumers (`register_consumer`, `set_retention_registry`) and their watermarks.
#[async_trait::async_trait]
impl RetentionStore for outbox_memory::MemoryStore {
    /// Every call holds the store's lock for its whole work: nothing to begin.
    type Tx = ();

    async fn begin(&self) -> Result<(), ProducerError> {
        Ok(())
    }

    async fn commit(&self, _tx: ()) -> Result<(), ProducerError> {
        Ok(())
    }

    async fn retain(&self, now_ms: i64, before_ms: i64, limit: i64) -> Result<u64, ProducerError> {
        let mut st = self.lock();
        let mut due: Vec<(i64, outbox_core::EventId)> = st
            .events
            .values()
            .filter(|e| e.state == EventState::Published)
            .filter_map(|e| e.published_at_ms.filter(|p| *p < before_ms).map(|p| (p, e.envelope.event_id.clone())))
            .collect();
        due.sort_unstable();
        due.truncate(usize::try_from(limit).unwrap_or(0));
        let mut n = 0;
        for (_, id) in due {
            if let Some(ev) = st.events.get_mut(&id) {
                outbox_memory::MemoryStore::transition(ev, EventState::Retained, now_ms)?;
                n += 1;
            }
        }
        Ok(n)
    }

    async fn candidates(&self, _tx: &mut (), state: EventState, before_ms: i64, after: &Cursor, limit: i64, _lock: bool) -> Result<Page, ProducerError> {
        let st = self.lock();
        let mut events: Vec<(i64, String, &outbox_memory::MemoryEvent)> = st
            .events
            .values()
            .filter(|e| e.state == state)
            .filter_map(|e| e.published_at_ms.filter(|p| *p < before_ms).map(|p| (p, e.envelope.event_id.to_string(), e)))
            .filter(|(p, id, _)| (*p, id.as_str()) > (after.0, after.1.as_str()))
            .collect();
        events.sort_unstable_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        events.truncate(usize::try_from(limit).unwrap_or(0));
        let last = events.last().map(|(p, id, _)| (*p, id.clone()));
        let full = events.len() as i64 >= limit;
        let candidates = events
            .into_iter()
            .filter_map(|(published_at_ms, event_id, e)| {
                let slot = e.slot.as_ref()?;
                Some(Candidate {
                    log: slot.log().to_log_id(),
                    event_id,
                    state: e.state,
                    published_at_ms,
                    offset: slot.offset,
                    position_epoch: e.slot_epoch,
                    partition_replaced: st.partition_replaced(slot.log()),
                    position_lost: st.position_lost(&e.envelope.event_id),
                    sent_from_ms: st.sent_from(&e.envelope.event_id),
                    log_id: slot.log_id.clone(),
                })
            })
            .collect();
        Ok(Page { candidates, last, full })
    }

    async fn registry(&self, _tx: &mut (), topics: &[&str]) -> Result<Registry, ProducerError> {
        let st = self.lock();
        let mandatory: Vec<(String, Vec<String>)> = st
            .consumers
            .iter()
            .filter(|(_, c)| c.mandatory && c.topics.iter().any(|t| topics.contains(&t.as_str())))
            .map(|(id, c)| (id.clone(), c.topics.clone()))
            .collect();
        let watermarks = st
            .watermarks
            .iter()
            .filter(|w| topics.contains(&w.log.topic.as_str()) && mandatory.iter().any(|(id, _)| *id == w.consumer_id))
            .map(|w| st.with_anchor_epoch(w))
            .collect();
        Ok(Registry { mandatory, watermarks })
    }

    async fn purge_ids(&self, _tx: &mut (), ids: &[String], now_ms: i64) -> Result<u64, ProducerError> {
        let mut st = self.lock();
        let mut n = 0;
        for id in ids {
            let Some(ev) = id.parse::<outbox_core::EventId>().ok().and_then(|id| st.events.get_mut(&id)) else { continue };
            if ev.state == EventState::Retained {
                outbox_memory::MemoryStore::transition(ev, EventState::Purged, now_ms)?;
                ev.payload = Vec::new();
                n += 1;
            }
        }
        Ok(n)
    }
}
