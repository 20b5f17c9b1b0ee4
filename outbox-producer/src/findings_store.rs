//! `PgStore`'s reads and write of the comparison's condition findings
//! (`outbox_core::FindingsStore`). The reads keep their index-friendly
//! filters (the set form of `outbox_core::findings`' conditions, by time and
//! state); the reconciler records only what the core functions judge
//! findings on the rows read.

use crate::retention::{ANCHOR_JOIN, PARTITION_REPLACED, POSITION_LOST, SENT_FROM_JOIN};
use outbox_core::{ConsumerWatermark, EventFacts, EventState, PublishedFacts, RoundFinding, StoreError, SweptEvent, WatermarkPublisherFacts};
use sqlx::postgres::PgRow;
use sqlx::Row;

use crate::error::store_err;
use crate::pg::PgStore;

const EVENT_FACTS: &str = "e.event_id, e.state, e.claim_owner IS NOT NULL AS held, e.publisher = 'outbox' AS by_outbox, e.created_at_ms, e.state_since_ms, e.unknown_since_ms";

fn state_of(r: &PgRow) -> Result<EventState, StoreError> {
    let s: String = r.try_get("state").map_err(store_err)?;
    EventState::parse(&s).map_err(StoreError::from)
}

fn event_facts(r: &PgRow, quarantine_reason: String) -> Result<EventFacts, StoreError> {
    Ok(EventFacts {
        event_id: r.try_get("event_id").map_err(store_err)?,
        state: state_of(r)?,
        held_by_dispatcher: r.try_get("held").map_err(store_err)?,
        by_outbox: r.try_get("by_outbox").map_err(store_err)?,
        created_at_ms: r.try_get("created_at_ms").map_err(store_err)?,
        state_since_ms: r.try_get("state_since_ms").map_err(store_err)?,
        unknown_since_ms: r.try_get("unknown_since_ms").map_err(store_err)?,
        quarantine_reason,
    })
}

#[async_trait::async_trait]
impl outbox_core::FindingsStore for PgStore {
    async fn aged_candidates(&self, created_before_ms: i64, limit: i64) -> Result<Vec<EventFacts>, StoreError> {
        // Legacy-owned events (a rollout's shadow or partial takeover) are
        // the legacy publisher's to send; the shadow comparison covers them.
        // The in-flight half reads the leased events only (their index), a bounded set.
        let rows = sqlx::query(&format!(
            "SELECT * FROM (
                 (SELECT {EVENT_FACTS}, e.seq FROM outbox_events e
                  WHERE e.phase = 'PENDING' AND e.publisher = 'outbox' AND e.created_at_ms < $1 ORDER BY e.seq LIMIT $2)
                 UNION ALL
                 (SELECT {EVENT_FACTS}, e.seq FROM outbox_events e
                  WHERE e.claim_owner IS NOT NULL AND e.phase = 'INFLIGHT' AND e.publisher = 'outbox' AND e.created_at_ms < $1 ORDER BY e.seq LIMIT $2)
                 UNION ALL
                 -- Stream events (schema section 17) neither receipted nor in
                 -- the lane, found through each key bucket's frontier.
                 (SELECT o.event_id, o.state, o.state IN ('CLAIMED', 'SENDING') AS held,
                         true AS by_outbox, o.created_at_ms, o.created_at_ms AS state_since_ms, NULL::bigint AS unknown_since_ms, o.seq
                  FROM outbox_stream_open($1, $2::int, false) o)
             ) t ORDER BY seq LIMIT $2"
        ))
        .bind(created_before_ms)
        .bind(limit)
        .fetch_all(self.pool())
        .await
        .map_err(store_err)?;
        rows.iter().map(|r| event_facts(r, String::new())).collect()
    }

    async fn unknown_candidates(&self, unknown_before_ms: i64, limit: i64) -> Result<Vec<EventFacts>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {EVENT_FACTS} FROM outbox_events e
             WHERE e.unknown_since_ms IS NOT NULL AND e.unknown_since_ms < $1
               AND e.state NOT IN ('PUBLISHED', 'RETAINED', 'PURGED', 'QUARANTINED', 'SKIPPED')
             ORDER BY e.unknown_since_ms LIMIT $2"
        ))
        .bind(unknown_before_ms)
        .bind(limit)
        .fetch_all(self.pool())
        .await
        .map_err(store_err)?;
        rows.iter().map(|r| event_facts(r, String::new())).collect()
    }

    async fn quarantined_candidates(&self, limit: i64) -> Result<Vec<EventFacts>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {EVENT_FACTS}, coalesce(q.reason, '') AS reason FROM outbox_events e
             LEFT JOIN LATERAL (SELECT reason FROM outbox_quarantine WHERE event_id = e.event_id ORDER BY id DESC LIMIT 1) q ON true
             WHERE e.phase = 'QUARANTINED' ORDER BY e.state_since_ms LIMIT $1"
        ))
        .bind(limit)
        .fetch_all(self.pool())
        .await
        .map_err(store_err)?;
        rows.iter().map(|r| event_facts(r, r.try_get("reason").map_err(store_err)?)).collect()
    }

    async fn critical_consumers(&self) -> Result<Vec<(String, Vec<String>)>, StoreError> {
        sqlx::query_as("SELECT consumer_id, topics FROM outbox_consumers WHERE critical ORDER BY consumer_id").fetch_all(self.pool()).await.map_err(store_err)
    }

    async fn published_candidates(&self, consumer_id: &str, topics: &[String], published_before_ms: i64, limit: i64) -> Result<Vec<PublishedFacts>, StoreError> {
        // Events the consumer's watermark of their very log has passed are
        // left out here (the set form of `unconsumed_published`, so that the
        // limit cuts among the unconsumed ones); the reconciler judges the rest.
        // No watermark passes a receipt of a replaced destination.v1 log
        // (`LogPosition::on_replaced_unnamed_log`).
        let passed = if crate::report::has_watermarks(self.pool()).await.map_err(crate::topic_scan::to_store)? {
            format!("(NOT (r.topic_id IS NULL AND (r.position_epoch > 0 OR {PARTITION_REPLACED})) AND EXISTS (SELECT 1 FROM outbox_consumer_watermarks w {ANCHOR_JOIN} WHERE w.consumer_id = $4 AND w.cluster_id = r.cluster_id AND w.topic = r.topic
                     AND w.partition = r.partition AND w.topic_id IS NOT DISTINCT FROM r.topic_id AND w.committed_offset > r.\"offset\"
                     AND (r.topic_id IS NOT NULL OR w.log_id IS NULL OR r.log_id IS NULL OR w.log_id = r.log_id)
                     AND (r.topic_id IS NOT NULL OR NOT w.anchor_recorded OR (an.anchor_epoch IS NOT DISTINCT FROM r.position_epoch
                          AND NOT COALESCE(r.\"offset\" < w.committed_offset - 1 AND sf.sent_from_ms > an.anchor_accepted_ms + {skew}, false)))))",
                skew = outbox_core::retention::ANCHOR_ORDER_SKEW_MS)
        } else {
            "false".to_owned()
        };
        let rows = sqlx::query(&format!(
            "SELECT e.event_id, e.state, e.published_at_ms, r.cluster_id, r.topic, r.topic_id, r.partition, r.\"offset\", r.position_epoch, r.log_id,
                    {PARTITION_REPLACED} AS partition_replaced, {POSITION_LOST} AS position_lost, sf.sent_from_ms FROM outbox_events e
             JOIN outbox_publish_receipts r ON r.event_id = e.event_id AND r.envelope_generation = e.envelope_generation
             {SENT_FROM_JOIN}
             WHERE e.phase IN ('PUBLISHED', 'RETAINED') AND e.published_at_ms < $1 AND r.topic = ANY($3)
               AND NOT {passed}
             UNION ALL
             -- Stream events (schema section 17): published by their receipt.
             SELECT r.event_id, 'PUBLISHED', r.accepted_at_ms, r.cluster_id, r.topic, r.topic_id, r.partition, r.\"offset\", r.position_epoch, r.log_id,
                    {PARTITION_REPLACED}, {POSITION_LOST}, sf.sent_from_ms
             FROM outbox_publish_receipts r {SENT_FROM_JOIN}
             WHERE r.batch_id IS NOT NULL AND r.envelope_generation = 1 AND r.accepted_at_ms < $1 AND r.topic = ANY($3)
               AND NOT EXISTS (SELECT 1 FROM outbox_events x WHERE x.event_id = r.event_id)
               AND NOT {passed}
             ORDER BY 3 LIMIT $2"
        ))
        .bind(published_before_ms)
        .bind(limit)
        .bind(topics)
        .bind(consumer_id)
        .fetch_all(self.pool())
        .await
        .map_err(store_err)?;
        rows.iter()
            .map(|r| {
                Ok(PublishedFacts {
                    log: outbox_core::LogId { cluster_id: r.try_get("cluster_id").map_err(store_err)?, topic: r.try_get("topic").map_err(store_err)?, topic_id: r.try_get("topic_id").map_err(store_err)?, partition: r.try_get("partition").map_err(store_err)? },
                    event_id: r.try_get("event_id").map_err(store_err)?,
                    state: state_of(r)?,
                    published_at_ms: r.try_get("published_at_ms").map_err(store_err)?,
                    offset: r.try_get("offset").map_err(store_err)?,
                    position_epoch: r.try_get("position_epoch").map_err(store_err)?,
                    partition_replaced: r.try_get("partition_replaced").map_err(store_err)?,
                    position_lost: r.try_get("position_lost").map_err(store_err)?,
                    sent_from_ms: r.try_get("sent_from_ms").map_err(store_err)?,
                    log_id: r.try_get("log_id").map_err(store_err)?,
                })
            })
            .collect()
    }

    async fn consumer_watermarks(&self, consumer_id: &str, topics: &[String]) -> Result<Vec<ConsumerWatermark>, StoreError> {
        if !crate::report::has_watermarks(self.pool()).await.map_err(crate::topic_scan::to_store)? {
            return Ok(Vec::new());
        }
        type Row = (String, String, String, Option<String>, i32, i64, bool, Option<String>, Option<i32>, Option<i64>, Option<String>);
        let rows: Vec<Row> = sqlx::query_as(&format!(
            "SELECT w.consumer_id, w.cluster_id, w.topic, w.topic_id, w.partition, w.committed_offset, w.anchor_recorded, w.anchor_event_id, an.anchor_epoch, an.anchor_accepted_ms, w.log_id
             FROM outbox_consumer_watermarks w {ANCHOR_JOIN} WHERE w.consumer_id = $1 AND w.topic = ANY($2)"
        ))
        .bind(consumer_id)
        .bind(topics)
        .fetch_all(self.pool())
        .await
        .map_err(store_err)?;
        Ok(rows
            .into_iter()
            .map(|(consumer_id, cluster_id, topic, topic_id, partition, committed_offset, anchor_recorded, anchor_event_id, anchor_epoch, anchor_accepted_ms, log_id)| ConsumerWatermark {
                log: outbox_core::LogId { cluster_id, topic, topic_id, partition },
                consumer_id,
                committed_offset,
                anchor_recorded,
                anchor_event_id,
                anchor_epoch,
                anchor_accepted_ms,
                log_id,
            })
            .collect())
    }

    async fn receipt_sweep_page(&self, limit: i64) -> Result<Vec<SweptEvent>, StoreError> {
        // The database refuses such rows; the sweep finds rows written
        // with triggers disabled.
        let pool = self.pool();
        let after: String = sqlx::query_scalar("SELECT after_event_id FROM outbox_check_cursors WHERE check_name = 'published_without_receipt'")
            .fetch_optional(pool)
            .await
            .map_err(store_err)?
            .unwrap_or_default();
        let rows = sqlx::query(
            "WITH page AS (SELECT event_id, state, envelope_generation, state_since_ms FROM outbox_events WHERE event_id > $1 ORDER BY event_id LIMIT $2)
             SELECT (SELECT max(event_id) FROM page) AS last, (SELECT count(*) FROM page) AS n, p.event_id, p.state, p.state_since_ms
             FROM (SELECT 1) one LEFT JOIN page p ON p.state IN ('PUBLISHED', 'RETAINED', 'PURGED')
               AND NOT EXISTS (SELECT 1 FROM outbox_publish_receipts r WHERE r.event_id = p.event_id AND r.envelope_generation = p.envelope_generation)",
        )
        .bind(&after)
        .bind(limit)
        .fetch_all(pool)
        .await
        .map_err(store_err)?;
        let mut page = Vec::new();
        let mut next = String::new();
        for r in &rows {
            let n: i64 = r.try_get("n").map_err(store_err)?;
            if n >= limit {
                next = r.try_get::<Option<String>, _>("last").map_err(store_err)?.unwrap_or_default();
            }
            if let Some(event_id) = r.try_get::<Option<String>, _>("event_id").map_err(store_err)? {
                // Only rows without their primary receipt are read (the join's condition).
                page.push(SweptEvent { event_id, state: state_of(r)?, has_primary_receipt: false, state_since_ms: r.try_get("state_since_ms").map_err(store_err)? });
            }
        }
        sqlx::query(
            "INSERT INTO outbox_check_cursors (check_name, after_event_id) VALUES ('published_without_receipt', $1)
             ON CONFLICT (check_name) DO UPDATE SET after_event_id = EXCLUDED.after_event_id",
        )
        .bind(&next)
        .execute(pool)
        .await
        .map_err(store_err)?;
        Ok(page)
    }

    async fn watermark_publishers(&self, received_before_ms: i64, limit: i64) -> Result<Vec<WatermarkPublisherFacts>, StoreError> {
        let rows: Vec<(String, String, i64, i64)> = sqlx::query_as(
            "SELECT p.consumer_id, p.cluster_id, p.records_accepted, p.last_received_ms FROM outbox_watermark_publishers p
             JOIN outbox_consumers c ON c.consumer_id = p.consumer_id
             WHERE p.records_accepted > 0 AND p.last_received_ms < $1 ORDER BY p.last_received_ms LIMIT $2",
        )
        .bind(received_before_ms)
        .bind(limit)
        .fetch_all(self.pool())
        .await
        .map_err(store_err)?;
        Ok(rows
            .into_iter()
            .map(|(consumer_id, cluster_id, records_accepted, last_received_ms)| WatermarkPublisherFacts { consumer_id, cluster_id, records_accepted, last_received_ms })
            .collect())
    }

    async fn record_round_findings(&self, now_ms: i64, findings: &[RoundFinding]) -> Result<(), StoreError> {
        let mut tx = self.pool().begin().await.map_err(store_err)?;
        let kinds: Vec<&str> = findings.iter().map(|f| f.kind).collect();
        let ids: Vec<&str> = findings.iter().map(|f| f.event_id.as_str()).collect();
        let consumers: Vec<&str> = findings.iter().map(|f| f.consumer_id.as_str()).collect();
        let ages: Vec<i64> = findings.iter().map(|f| f.age_ms).collect();
        let details: Vec<&str> = findings.iter().map(|f| f.detail.as_str()).collect();
        sqlx::query(
            "INSERT INTO outbox_findings (kind, event_id, consumer_id, age_ms, detail, first_seen_ms, last_seen_ms)
             SELECT k, e, c, a, d, $6, $6 FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bigint[], $5::text[]) AS t(k, e, c, a, d)
             ON CONFLICT (kind, event_id, consumer_id) WHERE resolved_at_ms IS NULL
             DO UPDATE SET age_ms = EXCLUDED.age_ms, detail = EXCLUDED.detail, last_seen_ms = EXCLUDED.last_seen_ms",
        )
        .bind(&kinds)
        .bind(&ids)
        .bind(&consumers)
        .bind(&ages)
        .bind(&details)
        .bind(now_ms)
        .execute(&mut *tx)
        .await
        .map_err(store_err)?;
        // Which open findings the round resolves is
        // `outbox_core::findings::round_resolves`'s call. The read leaves out
        // evidence (which it never resolves) and findings a concurrent round
        // saw after this one began.
        let open: Vec<(i64, String, String, String)> = sqlx::query_as(
            "SELECT id, kind, event_id, consumer_id FROM outbox_findings WHERE resolved_at_ms IS NULL AND last_seen_ms <= $1 AND kind <> ALL($2) FOR UPDATE",
        )
        .bind(now_ms)
        .bind(outbox_core::findings::EVIDENCE_FINDINGS)
        .fetch_all(&mut *tx)
        .await
        .map_err(store_err)?;
        let seen: std::collections::BTreeSet<(&str, &str, &str)> = findings.iter().map(|f| (f.kind, f.event_id.as_str(), f.consumer_id.as_str())).collect();
        let resolved: Vec<i64> =
            open.iter().filter(|(_, k, e, c)| outbox_core::findings::round_resolves(k, seen.contains(&(k.as_str(), e.as_str(), c.as_str())))).map(|(id, ..)| *id).collect();
        sqlx::query("UPDATE outbox_findings SET resolved_at_ms = $1 WHERE id = ANY($2)").bind(now_ms).bind(&resolved).execute(&mut *tx).await.map_err(store_err)?;
        tx.commit().await.map_err(store_err)?;
        Ok(())
    }
}
