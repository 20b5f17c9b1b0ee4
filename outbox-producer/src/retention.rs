//! Retention (PROTOCOL §9): PUBLISHED -> RETAINED after the replay window;
//! RETAINED -> PURGED only once every mandatory consumer's watermark has
//! passed the event, in bounded batches.
//!
//! A purge deletes the payload bytes only. The event row stays as a compact
//! tombstone — eventId, command key, digests, frozen envelopes and the
//! publish receipt — so a late duplicate ACK still meets its slot and a
//! retried command still meets its first eventId after the purge.

use sqlx::PgPool;

use crate::error::ProducerError;

/// Largest batch one purge statement touches.
pub const MAX_PURGE_BATCH: i64 = 10_000;

/// When evidence may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionPolicy {
    /// The maximum replay window: nothing published more recently is retained or purged, ms.
    pub replay_window_ms: i64,
    /// Rows per statement (1..=10 000).
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
    /// RETAINED events held back because a mandatory consumer has not passed them.
    pub held_by_consumers: u64,
    /// Statements run.
    pub batches: u32,
}

/// The condition under which a RETAINED event may be purged: past the replay
/// window, and every mandatory consumer reading its topic has a watermark
/// beyond its offset on the same log (cluster, topic, topic id compared
/// exactly, partition). A mandatory consumer without such a watermark holds
/// everything: the SQL form of `outbox_core::may_purge`.
fn purgeable(watermarks: bool) -> String {
    let passed = if watermarks {
        "EXISTS (SELECT 1 FROM outbox_consumer_watermarks w WHERE w.consumer_id = c.consumer_id AND w.cluster_id = r.cluster_id
                 AND w.topic = r.topic AND w.partition = r.partition AND w.topic_id IS NOT DISTINCT FROM r.topic_id
                 AND w.committed_offset > r.\"offset\")"
    } else {
        "false"
    };
    format!(
        "e.phase = 'RETAINED' AND e.published_at_ms < $1 - $2
         AND NOT EXISTS (SELECT 1 FROM outbox_consumers c WHERE c.mandatory AND r.topic = ANY(c.topics) AND NOT {passed})"
    )
}

/// Runs retention. With `dry_run`, counts what would change and writes nothing.
/// `progress` is called after each batch with the running totals.
pub async fn purge(pool: &PgPool, now_ms: i64, policy: &RetentionPolicy, dry_run: bool, mut progress: impl FnMut(&PurgeReport)) -> Result<PurgeReport, ProducerError> {
    if !(1..=MAX_PURGE_BATCH).contains(&policy.batch_size) {
        return Err(ProducerError::Config(format!("purge batch_size {} (1..={MAX_PURGE_BATCH})", policy.batch_size)));
    }
    if policy.replay_window_ms < 0 {
        return Err(ProducerError::Config("replay_window_ms must not be negative".into()));
    }
    let watermarks = crate::report::has_watermarks(pool).await?;
    let cond = purgeable(watermarks);
    let mut report = PurgeReport { dry_run, ..Default::default() };
    let from = "outbox_events e JOIN outbox_publish_receipts r ON r.event_id = e.event_id AND r.envelope_generation = e.envelope_generation";

    if dry_run {
        report.retained = sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox_events WHERE phase = 'PUBLISHED' AND published_at_ms < $1 - $2")
            .bind(now_ms)
            .bind(policy.replay_window_ms)
            .fetch_one(pool)
            .await? as u64;
        // In a dry run, events about to be retained are judged as if they were.
        let cond_dry = cond.replace("e.phase = 'RETAINED'", "e.phase IN ('PUBLISHED', 'RETAINED')");
        report.purged = sqlx::query_scalar::<_, i64>(&format!("SELECT count(*) FROM {from} WHERE {cond_dry}")).bind(now_ms).bind(policy.replay_window_ms).fetch_one(pool).await? as u64;
        let due: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_events WHERE phase IN ('PUBLISHED', 'RETAINED') AND published_at_ms < $1 - $2")
            .bind(now_ms)
            .bind(policy.replay_window_ms)
            .fetch_one(pool)
            .await?;
        report.held_by_consumers = (due as u64).saturating_sub(report.purged);
        progress(&report);
        return Ok(report);
    }

    let retain = "UPDATE outbox_events SET state = 'RETAINED', state_since_ms = $1
         WHERE event_id IN (SELECT event_id FROM outbox_events WHERE phase = 'PUBLISHED' AND published_at_ms < $1 - $2
                            ORDER BY published_at_ms LIMIT $3 FOR UPDATE SKIP LOCKED)"
        .to_owned();
    let purge = format!(
        "UPDATE outbox_events SET state = 'PURGED', payload = NULL, state_since_ms = $1
         WHERE event_id IN (SELECT e.event_id FROM {from} WHERE {cond} ORDER BY e.published_at_ms LIMIT $3 FOR UPDATE OF e SKIP LOCKED)"
    );
    for (sql, retaining) in [(retain, true), (purge, false)] {
        for _ in 0..policy.max_batches {
            let n = sqlx::query(&sql).bind(now_ms).bind(policy.replay_window_ms).bind(policy.batch_size).execute(pool).await?.rows_affected();
            if retaining {
                report.retained += n;
            } else {
                report.purged += n;
            }
            report.batches += 1;
            progress(&report);
            if (n as i64) < policy.batch_size {
                break;
            }
        }
    }
    report.held_by_consumers = sqlx::query_scalar::<_, i64>("SELECT count(*) FROM outbox_events WHERE phase = 'RETAINED' AND published_at_ms < $1 - $2")
        .bind(now_ms)
        .bind(policy.replay_window_ms)
        .fetch_one(pool)
        .await? as u64;
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
