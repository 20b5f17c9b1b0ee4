//! What the bypass check (reconciler) and the shadow comparison (rollout)
//! share: the topics routed to a cluster, and a per-partition read cursor
//! that only moves forward.

use std::collections::{BTreeMap, BTreeSet};

use outbox_core::compare::{CursorMove, RecordedReceipt};
use sqlx::{PgPool, Postgres, Row, Transaction};

use crate::error::{store_err, ProducerError};

/// A table of read cursors, one row per (cluster, topic, partition).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cursors {
    /// `outbox_scan_cursors`: the reconciler's bypass check.
    Bypass,
    /// `outbox_shadow_cursors`: the rollout's shadow comparison.
    Shadow,
}

impl Cursors {
    fn table(self) -> &'static str {
        match self {
            Cursors::Bypass => "outbox_scan_cursors",
            Cursors::Shadow => "outbox_shadow_cursors",
        }
    }

    /// The next offset to read (0 for a partition never read).
    pub(crate) async fn read(self, pool: &PgPool, cluster_id: &str, topic: &str, partition: i32) -> Result<i64, ProducerError> {
        let next: Option<i64> = sqlx::query_scalar(&format!("SELECT next_offset FROM {} WHERE cluster_id = $1 AND topic = $2 AND partition = $3", self.table()))
            .bind(cluster_id)
            .bind(topic)
            .bind(partition)
            .fetch_optional(pool)
            .await?;
        Ok(next.unwrap_or(0))
    }

    /// The bypass cursor with its anchor.
    pub(crate) async fn read_anchored(pool: &PgPool, cluster_id: &str, topic: &str, partition: i32) -> Result<outbox_core::BypassCursor, ProducerError> {
        let row: Option<(i64, Option<String>)> =
            sqlx::query_as("SELECT next_offset, anchor FROM outbox_scan_cursors WHERE cluster_id = $1 AND topic = $2 AND partition = $3")
                .bind(cluster_id)
                .bind(topic)
                .bind(partition)
                .fetch_optional(pool)
                .await?;
        Ok(row.map(|(next_offset, anchor)| outbox_core::BypassCursor { next_offset, anchor }).unwrap_or_default())
    }

    /// Moves the cursor to `next_offset` with its anchor (what the message
    /// below it is; the shadow comparison keeps none), never backwards; the
    /// anchor is kept when the cursor does not move forward.
    pub(crate) async fn advance(self, tx: &mut Transaction<'_, Postgres>, cluster_id: &str, topic: &str, partition: i32, next_offset: i64, anchor: Option<&str>) -> Result<(), ProducerError> {
        sqlx::query(&format!(
            "INSERT INTO {} AS c (cluster_id, topic, partition, next_offset, anchor) VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (cluster_id, topic, partition) DO UPDATE
             SET anchor = CASE WHEN EXCLUDED.next_offset > c.next_offset THEN EXCLUDED.anchor ELSE c.anchor END,
                 next_offset = greatest(c.next_offset, EXCLUDED.next_offset)",
            self.table()
        ))
        .bind(cluster_id)
        .bind(topic)
        .bind(partition)
        .bind(next_offset)
        .bind(anchor)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    /// Moves the cursor back to the start of the log: only when the log's
    /// end is below it, which a log that was kept never is (the topic was
    /// recreated, the broker came back empty): the new log is read from its
    /// start.
    pub(crate) async fn restart(self, tx: &mut Transaction<'_, Postgres>, cluster_id: &str, topic: &str, partition: i32) -> Result<(), ProducerError> {
        sqlx::query(&format!("UPDATE {} SET next_offset = 0, anchor = NULL WHERE cluster_id = $1 AND topic = $2 AND partition = $3", self.table()))
            .bind(cluster_id)
            .bind(topic)
            .bind(partition)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// Every topic the current route policies send to `cluster_id`, with its partition count.
pub(crate) async fn routed_topics(pool: &PgPool, cluster_id: &str) -> Result<Vec<(String, i32)>, ProducerError> {
    Ok(sqlx::query_as("SELECT DISTINCT ON (topic) topic, partitions FROM outbox_route_policies WHERE cluster_id = $1 ORDER BY topic, generation DESC")
        .bind(cluster_id)
        .fetch_all(pool)
        .await?)
}

pub(crate) fn to_store(e: ProducerError) -> outbox_core::StoreError {
    match e {
        ProducerError::Store(e) => e,
        e => outbox_core::StoreError::Backend { message: e.to_string(), retryable: e.is_retryable() },
    }
}

/// The bypass scan's reads and write over the evidence tables (the SQL the
/// reconciler ran itself before the scan was written over a store seam).
#[async_trait::async_trait]
impl outbox_core::BypassScanStore for crate::pg::PgStore {
    async fn routed_topics(&self, cluster_id: &str) -> Result<Vec<(String, i32)>, outbox_core::StoreError> {
        routed_topics(self.pool(), cluster_id).await.map_err(to_store)
    }

    async fn routes_to(&self, cluster_id: &str, topic: &str) -> Result<Vec<(String, i32)>, outbox_core::StoreError> {
        sqlx::query_as(
            "SELECT event_type, partitions FROM (SELECT DISTINCT ON (event_type) event_type, cluster_id, topic, partitions
                                                  FROM outbox_route_policies ORDER BY event_type, generation DESC) AS current
             WHERE cluster_id = $1 AND topic = $2 ORDER BY event_type",
        )
        .bind(cluster_id)
        .bind(topic)
        .fetch_all(self.pool())
        .await
        .map_err(store_err)
    }

    async fn source_identity(&self) -> Result<Option<String>, outbox_core::StoreError> {
        crate::cloudevents::source(self.pool()).await.map(Some)
    }

    async fn bypass_cursor(&self, cluster_id: &str, topic: &str, partition: i32) -> Result<outbox_core::BypassCursor, outbox_core::StoreError> {
        Cursors::read_anchored(self.pool(), cluster_id, topic, partition).await.map_err(to_store)
    }

    async fn committed_event_ids(&self, event_ids: &[String]) -> Result<BTreeSet<String>, outbox_core::StoreError> {
        Ok(sqlx::query_scalar::<_, String>("SELECT event_id FROM outbox_events WHERE event_id = ANY($1) UNION SELECT event_id FROM outbox_stream WHERE event_id = ANY($1)")
            .bind(event_ids)
            .fetch_all(self.pool())
            .await
            .map_err(store_err)?
            .into_iter()
            .collect())
    }

    async fn receipts_at(&self, cluster_id: &str, topic: &str, partition: i32, offsets: &[i64]) -> Result<Vec<RecordedReceipt>, outbox_core::StoreError> {
        sqlx::query(
            "SELECT event_id, topic_id, \"offset\", true AS is_primary FROM outbox_publish_receipts WHERE cluster_id = $1 AND topic = $2 AND partition = $3 AND \"offset\" = ANY($4)
             UNION ALL
             SELECT event_id, topic_id, \"offset\", false FROM outbox_duplicate_receipts WHERE cluster_id = $1 AND topic = $2 AND partition = $3 AND \"offset\" = ANY($4)",
        )
        .bind(cluster_id)
        .bind(topic)
        .bind(partition)
        .bind(offsets)
        .fetch_all(self.pool())
        .await
        .map_err(store_err)?
        .iter()
        .map(|r| Ok(RecordedReceipt { event_id: r.try_get("event_id")?, topic_id: r.try_get("topic_id")?, offset: r.try_get("offset")?, primary: r.try_get("is_primary")? }))
        .collect::<Result<_, sqlx::Error>>()
        .map_err(store_err)
    }

    async fn published_digests(&self, event_ids: &[String]) -> Result<BTreeMap<String, outbox_core::compare::PublishedCopy>, outbox_core::StoreError> {
        if event_ids.is_empty() {
            return Ok(BTreeMap::new());
        }
        sqlx::query_as::<_, (String, String, String)>(
            "SELECT e.event_id, e.payload_digest, e.routing_key FROM outbox_events e WHERE e.event_id = ANY($1)
               AND EXISTS (SELECT 1 FROM outbox_publish_receipts r WHERE r.event_id = e.event_id AND r.envelope_generation = e.envelope_generation)
             UNION ALL
             SELECT s.event_id, s.payload_digest, s.routing_key FROM outbox_stream s WHERE s.event_id = ANY($1)
               AND NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = s.event_id)
               AND EXISTS (SELECT 1 FROM outbox_publish_receipts r WHERE r.event_id = s.event_id AND r.envelope_generation = 1)",
        )
        .bind(event_ids)
        .fetch_all(self.pool())
        .await
        .map(|rows| rows.into_iter().map(|(id, payload_digest, routing_key)| (id, outbox_core::compare::PublishedCopy { payload_digest, routing_key })).collect())
        .map_err(store_err)
    }

    async fn unanswered_attempts_of(&self, event_ids: &[String]) -> Result<Vec<outbox_core::AttemptRecord>, outbox_core::StoreError> {
        if event_ids.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<&str> = event_ids.iter().map(String::as_str).collect();
        let mut out = crate::pg::unanswered_attempts_of(self.pool(), &ids).await?;
        // Stream events (schema section 17): the attempt their open batch registered.
        let lane = self.lane_rows(&ids).await?;
        for id in ids.iter().filter(|id| !lane.contains(**id)) {
            out.extend(self.stream_attempts(id).await?.into_iter().filter(|a| a.state == outbox_core::AttemptState::Sending));
        }
        Ok(out)
    }

    async fn receipts_from(
        &self,
        cluster_id: &str,
        topic: &str,
        partition: i32,
        from_offset: i64,
        accepted_before_ms: i64,
        limit: i64,
    ) -> Result<Vec<RecordedReceipt>, outbox_core::StoreError> {
        sqlx::query(
            "SELECT r.event_id, r.topic_id, r.\"offset\" FROM outbox_publish_receipts r
             WHERE r.cluster_id = $1 AND r.topic = $2 AND r.partition = $3 AND r.\"offset\" >= $4 AND r.accepted_at_ms < $5
               AND NOT EXISTS (SELECT 1 FROM outbox_findings f
                               WHERE f.kind = 'receipt_position_lost' AND f.event_id = r.event_id AND f.resolved_at_ms IS NULL)
             ORDER BY r.\"offset\" LIMIT $6",
        )
        .bind(cluster_id)
        .bind(topic)
        .bind(partition)
        .bind(from_offset)
        .bind(accepted_before_ms)
        .bind(limit)
        .fetch_all(self.pool())
        .await
        .map_err(store_err)?
        .iter()
        .map(|r| Ok(RecordedReceipt { event_id: r.try_get("event_id")?, topic_id: r.try_get("topic_id")?, offset: r.try_get("offset")?, primary: true }))
        .collect::<Result<_, sqlx::Error>>()
        .map_err(store_err)
    }

    async fn receipt_epochs_at(&self, cluster_id: &str, topic: &str, partition: i32, offset: i64) -> Result<Vec<outbox_core::compare::PositionEpoch>, outbox_core::StoreError> {
        // One probe of outbox_publish_receipts_position.
        sqlx::query(
            "SELECT event_id, topic_id, \"offset\", position_epoch FROM outbox_publish_receipts
             WHERE cluster_id = $1 AND topic = $2 AND partition = $3 AND \"offset\" = $4",
        )
        .bind(cluster_id)
        .bind(topic)
        .bind(partition)
        .bind(offset)
        .fetch_all(self.pool())
        .await
        .map_err(store_err)?
        .iter()
        .map(|r| {
            Ok(outbox_core::compare::PositionEpoch {
                event_id: r.try_get("event_id")?,
                topic_id: r.try_get("topic_id")?,
                offset: r.try_get("offset")?,
                position_epoch: r.try_get("position_epoch")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(store_err)
    }

    async fn record_bypass_scan(&self, write: &outbox_core::BypassScanWrite) -> Result<(), outbox_core::StoreError> {
        let mut tx = self.pool().begin().await.map_err(store_err)?;
        let (cluster, topic, partition) = (&write.cluster_id, &write.topic, write.partition);
        for m in &write.bypass_messages {
            sqlx::query(
                "INSERT INTO outbox_bypass_messages (cluster_id, topic, partition, \"offset\", event_id, seen_at_ms, source)
                 VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT DO NOTHING",
            )
            .bind(cluster)
            .bind(topic)
            .bind(partition)
            .bind(m.offset)
            .bind(m.event_id.as_deref())
            .bind(write.now_ms)
            .bind(m.source.as_deref())
            .execute(&mut *tx)
            .await
            .map_err(store_err)?;
        }
        let findings: Vec<(&'static str, String, String)> = write.findings.iter().map(|f| (f.kind, f.event_id.clone(), f.detail.clone())).collect();
        crate::pg::record_findings(&mut tx, &findings, write.now_ms).await?;
        match write.cursor {
            CursorMove::Restart => Cursors::Bypass.restart(&mut tx, cluster, topic, partition).await.map_err(to_store)?,
            CursorMove::Advance(to) => Cursors::Bypass.advance(&mut tx, cluster, topic, partition, to, write.anchor.as_deref()).await.map_err(to_store)?,
        }
        tx.commit().await.map_err(store_err)
    }
}
