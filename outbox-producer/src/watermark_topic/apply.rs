//! The SQL of a round, in its transaction: a record applied monotonically
//! to `outbox_consumer_watermarks`, its consumer's arrival, ignored records
//! and writer pin in `outbox_watermark_publishers`, and the reader's
//! findings; and [`repin`], the operator's way to forget a pinned writer.

use std::collections::HashMap;

use outbox_core::watermark_record::WatermarkRecord;
use sqlx::{PgPool, Postgres, Row as _, Transaction};

use super::decide::{judge, Judgement, Stored};
use super::round::{RoundFinding, RoundSink};
use crate::error::ProducerError;

/// Most findings one round records per kind (the rest are counted only).
pub const MAX_FINDINGS_PER_ROUND: usize = 1_000;

/// Applies one record to `outbox_consumer_watermarks` as
/// [`judge`] decides against the row it locks: monotonically within one
/// log; a record of another log than the row's replaces it.
pub(super) async fn apply(tx: &mut Transaction<'_, Postgres>, r: &WatermarkRecord) -> Result<Judgement, ProducerError> {
    let row = sqlx::query(
        "SELECT committed_offset, applied_count, duplicate_count, quarantined_count, dead_lettered_count, log_id,
                floor(extract(epoch FROM updated_at) * 1000)::bigint AS updated_ms
         FROM outbox_consumer_watermarks
         WHERE consumer_id = $1 AND cluster_id = $2 AND topic = $3 AND partition = $4 AND topic_id IS NOT DISTINCT FROM $5 FOR UPDATE",
    )
    .bind(&r.consumer_id)
    .bind(&r.cluster_id)
    .bind(&r.topic)
    .bind(r.partition)
    .bind(r.topic_id.as_deref())
    .fetch_optional(&mut **tx)
    .await?;
    let stored = match row {
        Some(row) => Some(Stored {
            committed_offset: row.try_get("committed_offset")?,
            counts: [row.try_get("applied_count")?, row.try_get("duplicate_count")?, row.try_get("quarantined_count")?, row.try_get("dead_lettered_count")?],
            updated_at_ms: row.try_get("updated_ms")?,
            log_id: row.try_get("log_id")?,
        }),
        None => None,
    };
    let judgement = judge(stored.as_ref(), r);
    if judgement != Judgement::Apply {
        return Ok(judgement);
    }
    let updated_at = chrono::DateTime::<chrono::Utc>::from_timestamp_millis(r.updated_at_ms).unwrap_or_default();
    sqlx::query(outbox_core::watermark_record::COPY_UPSERT_SQL)
        .bind(&r.consumer_id)
        .bind([r.topic.as_str()])
        .bind([r.partition])
        .bind([r.committed_offset])
        .bind([r.applied_count])
        .bind([r.duplicate_count])
        .bind([r.quarantined_count])
        .bind([r.dead_lettered_count])
        .bind([r.last_event_id.as_deref()])
        .bind([updated_at])
        .bind([r.cluster_id.as_str()])
        .bind([r.topic_id.as_deref()])
        // A record of no log id (before `.v4`) leaves the row's as it was.
        .bind([r.log_id.as_deref()])
        .bind([r.anchor_event_id.as_deref()])
        .bind([r.anchor_recorded])
        .execute(&mut **tx)
        .await?;
    Ok(Judgement::Apply)
}

/// A declared consumer's acceptable record arrived at `now`.
pub(super) async fn arrived(tx: &mut Transaction<'_, Postgres>, r: &WatermarkRecord, now: i64) -> Result<(), ProducerError> {
    sqlx::query(
        "INSERT INTO outbox_watermark_publishers AS p (consumer_id, cluster_id, last_received_ms, last_published_at_ms, records_accepted)
         VALUES ($1, $2, $3, $4, 1)
         ON CONFLICT (consumer_id, cluster_id) DO UPDATE SET last_received_ms = GREATEST(p.last_received_ms, EXCLUDED.last_received_ms),
             last_published_at_ms = GREATEST(p.last_published_at_ms, EXCLUDED.last_published_at_ms), records_accepted = p.records_accepted + 1",
    )
    .bind(&r.consumer_id)
    .bind(&r.cluster_id)
    .bind(now)
    .bind(r.published_at_ms)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Pins `decider` as the database whose records move `r`'s consumer's
/// watermarks on its cluster (unless one is pinned already).
pub(super) async fn pin(tx: &mut Transaction<'_, Postgres>, r: &WatermarkRecord, decider: &str, now: i64) -> Result<(), ProducerError> {
    sqlx::query(
        "INSERT INTO outbox_watermark_publishers AS p (consumer_id, cluster_id, last_received_ms, last_published_at_ms, decider)
         VALUES ($1, $2, $3, 0, $4)
         ON CONFLICT (consumer_id, cluster_id) DO UPDATE SET decider = COALESCE(p.decider, EXCLUDED.decider)",
    )
    .bind(&r.consumer_id)
    .bind(&r.cluster_id)
    .bind(now)
    .bind(decider)
    .execute(&mut **tx)
    .await?;
    tracing::info!(consumer = %r.consumer_id, cluster = %r.cluster_id, decider, "watermark records of this consumer are now taken from this database only");
    Ok(())
}

/// Forgets the database pinned for `consumer_id`'s watermark records (every
/// cluster): the next record's database is pinned. For a consumer whose
/// database really moved; answers the deciders forgotten.
pub async fn repin(pool: &PgPool, consumer_id: &str) -> Result<Vec<(String, String)>, ProducerError> {
    outbox_core::id::validate_identifier("consumerId", consumer_id)?;
    Ok(sqlx::query_as(
        "UPDATE outbox_watermark_publishers p SET decider = NULL FROM outbox_watermark_publishers old
         WHERE p.consumer_id = $1 AND old.consumer_id = p.consumer_id AND old.cluster_id = p.cluster_id AND old.decider IS NOT NULL
         RETURNING p.cluster_id, old.decider",
    )
    .bind(consumer_id)
    .fetch_all(pool)
    .await?)
}

/// A declared consumer's record was ignored (counted; its arrival time does not move).
pub(super) async fn ignored(tx: &mut Transaction<'_, Postgres>, r: &WatermarkRecord, now: i64) -> Result<(), ProducerError> {
    sqlx::query(
        "INSERT INTO outbox_watermark_publishers AS p (consumer_id, cluster_id, last_received_ms, last_published_at_ms, records_ignored)
         VALUES ($1, $2, $3, 0, 1)
         ON CONFLICT (consumer_id, cluster_id) DO UPDATE SET records_ignored = p.records_ignored + 1",
    )
    .bind(&r.consumer_id)
    .bind(&r.cluster_id)
    .bind(now)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Opens (or marks seen again) the reader's findings, at most
/// [`MAX_FINDINGS_PER_ROUND`] per kind.
pub(super) async fn record_findings(tx: &mut Transaction<'_, Postgres>, findings: &[(&'static str, String, String, String)], now: i64) -> Result<(), ProducerError> {
    let mut per_kind: HashMap<&str, usize> = HashMap::new();
    let kept: Vec<&(&'static str, String, String, String)> = findings
        .iter()
        .filter(|f| {
            let n = per_kind.entry(f.0).or_default();
            *n += 1;
            *n <= MAX_FINDINGS_PER_ROUND
        })
        .collect();
    if kept.is_empty() {
        return Ok(());
    }
    let kinds: Vec<&str> = kept.iter().map(|f| f.0).collect();
    let ids: Vec<&str> = kept.iter().map(|f| f.1.as_str()).collect();
    let consumers: Vec<&str> = kept.iter().map(|f| f.2.as_str()).collect();
    let details: Vec<&str> = kept.iter().map(|f| f.3.as_str()).collect();
    sqlx::query(
        "INSERT INTO outbox_findings (kind, event_id, consumer_id, age_ms, detail, first_seen_ms, last_seen_ms)
         SELECT DISTINCT ON (k, e, c) k, e, c, 0, d, $5, $5 FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[]) AS t(k, e, c, d)
         ON CONFLICT (kind, event_id, consumer_id) WHERE resolved_at_ms IS NULL
         DO UPDATE SET detail = EXCLUDED.detail, last_seen_ms = EXCLUDED.last_seen_ms",
    )
    .bind(&kinds)
    .bind(&ids)
    .bind(&consumers)
    .bind(&details)
    .bind(now)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// What a round writes, in its PostgreSQL transaction (committed by the
/// reader after [`decide_round`](super::round::decide_round)).
pub(super) struct PgRoundSink {
    pub(super) tx: Transaction<'static, Postgres>,
    pub(super) cluster_id: String,
    /// The watermark topic.
    pub(super) topic: String,
}

#[async_trait::async_trait]
impl RoundSink for PgRoundSink {
    async fn pinned(&mut self) -> Result<HashMap<String, String>, ProducerError> {
        Ok(sqlx::query_as::<_, (String, String)>("SELECT consumer_id, decider FROM outbox_watermark_publishers WHERE cluster_id = $1 AND decider IS NOT NULL")
            .bind(&self.cluster_id)
            .fetch_all(&mut *self.tx)
            .await?
            .into_iter()
            .collect())
    }

    async fn pin(&mut self, r: &WatermarkRecord, decider: &str, now: i64) -> Result<(), ProducerError> {
        pin(&mut self.tx, r, decider, now).await
    }

    async fn ignored(&mut self, r: &WatermarkRecord, now: i64) -> Result<(), ProducerError> {
        ignored(&mut self.tx, r, now).await
    }

    async fn apply(&mut self, r: &WatermarkRecord) -> Result<Judgement, ProducerError> {
        apply(&mut self.tx, r).await
    }

    async fn arrived(&mut self, r: &WatermarkRecord, now: i64) -> Result<(), ProducerError> {
        arrived(&mut self.tx, r, now).await
    }

    async fn advance(&mut self, partition: i32, next: i64) -> Result<(), ProducerError> {
        sqlx::query(
            "INSERT INTO outbox_watermark_topic_cursors (cluster_id, topic, partition, next_offset) VALUES ($1, $2, $3, $4)
             ON CONFLICT (cluster_id, topic, partition) DO UPDATE SET next_offset = GREATEST(outbox_watermark_topic_cursors.next_offset, EXCLUDED.next_offset)",
        )
        .bind(&self.cluster_id)
        .bind(&self.topic)
        .bind(partition)
        .bind(next)
        .execute(&mut *self.tx)
        .await?;
        Ok(())
    }

    async fn resolve_gaps(&mut self, consumer: &str, logs: &[String], now: i64) -> Result<(), ProducerError> {
        sqlx::query(outbox_core::watermark_record::GAP_FINDINGS_RESOLVE_SQL).bind(consumer).bind(logs).bind(now).execute(&mut *self.tx).await?;
        Ok(())
    }

    async fn record_findings(&mut self, findings: &[RoundFinding], now: i64) -> Result<(), ProducerError> {
        record_findings(&mut self.tx, findings, now).await
    }
}
