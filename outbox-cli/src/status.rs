//! `outbox status`: the numbers an operator looks at first, straight from
//! the tables (no reconciler needed).

use std::fmt::Write as _;

use outbox_core::ALL_STATES;
use serde::Serialize;
use sqlx::{PgPool, Row};

use crate::fmt::{age, ts};

/// Lag of one consumer on one partition's log (a topic recreated under the
/// same name has a log per topic id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PartitionLag {
    /// Broker cluster of the log.
    pub cluster_id: String,
    /// Topic.
    pub topic: String,
    /// The topic id of the log (`None`: destination.v1 events, watermark rows of no id).
    pub topic_id: Option<String>,
    /// Partition.
    pub partition: i32,
    /// Next offset the consumer will read (0 without a watermark).
    pub committed_offset: i64,
    /// One past the highest published offset the outbox knows there.
    pub published_end_offset: i64,
    /// Published events at or above the committed offset.
    pub lag_events: i64,
    /// When the watermark last moved, ms since the epoch (None: no watermark).
    pub watermark_updated_at_ms: Option<i64>,
}

/// One registered consumer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConsumerStatus {
    /// Consumer id.
    pub consumer_id: String,
    /// Compared by the reconciler.
    pub critical: bool,
    /// Held by retention.
    pub mandatory: bool,
    /// Topics it reads.
    pub topics: Vec<String>,
    /// Per partition with published events or a watermark.
    pub partitions: Vec<PartitionLag>,
    /// Sum of `lag_events`.
    pub total_lag_events: i64,
}

/// The whole status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    /// The database's clock, ms since the epoch.
    pub now_ms: i64,
    /// The outbox's source identity (the CloudEvents `ce_source` of its
    /// messages); None on a schema migrated before it existed.
    pub source: Option<String>,
    /// Every state with its count (zeros included), in the order of PROTOCOL §3.
    #[serde(serialize_with = "outbox_producer::report::pairs::states")]
    pub state_counts: Vec<(String, i64)>,
    /// Total events.
    pub total_events: i64,
    /// Age of the oldest PENDING event, ms.
    pub oldest_pending_age_ms: Option<i64>,
    /// Events whose dispatch outcome is unknown (DISPATCH_UNKNOWN, RECONCILING, RETRY_CLAIMED).
    pub unknown_open: i64,
    /// Age of the oldest of them (since it became unknown), ms.
    pub oldest_unknown_age_ms: Option<i64>,
    /// Open reconciler findings by kind (empty if the reconciler never ran).
    #[serde(serialize_with = "outbox_producer::report::pairs::kinds")]
    pub open_findings: Vec<(String, i64)>,
    /// What the open findings that stall events say, in words (a topic
    /// whose partition count is not what its routes froze), at most 20.
    pub stalls: Vec<String>,
    /// Registered consumers (critical ones with their lag).
    pub consumers: Vec<ConsumerStatus>,
    /// Whether `outbox_consumer_watermarks` exists in this database.
    pub watermarks_table: bool,
    /// The most recent reconciler round (None: no reconciler ever ran here).
    pub last_reconciler_round: Option<outbox_producer::ReconcilerRound>,
    /// `reconciler_stale` when the last round is missing or too old.
    pub reconciler_finding: Option<outbox_producer::report::Finding>,
    /// Quarantines (by reason) and dead letters per consumer, where the
    /// consumer tables are in this database.
    pub consumer_decisions: Vec<outbox_producer::ConsumerDecisions>,
}

async fn exists(pool: &PgPool, table: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL").bind(table).fetch_one(pool).await
}

/// Oldest open UNKNOWN: (count, age ms).
pub async fn unknown_open(pool: &PgPool, now_ms: i64) -> Result<(i64, Option<i64>), sqlx::Error> {
    let row = sqlx::query(
        "SELECT count(*) AS n, min(coalesce(unknown_since_ms, state_since_ms)) AS since FROM outbox_events
         WHERE state IN ('DISPATCH_UNKNOWN', 'RECONCILING', 'RETRY_CLAIMED')",
    )
    .fetch_one(pool)
    .await?;
    let since: Option<i64> = row.get("since");
    Ok((row.get("n"), since.map(|s| (now_ms - s).max(0))))
}

/// Reads the status; a last reconciler round older than `reconciler_stale_ms`
/// (or three of its intervals) is a finding.
pub async fn status(pool: &PgPool, reconciler_stale_ms: i64) -> Result<Status, outbox_producer::ProducerError> {
    let now_ms = outbox_producer::pg::db_now_ms(pool).await?;
    let source: Option<String> =
        if exists(pool, "outbox_identity").await? { sqlx::query_scalar("SELECT source FROM outbox_identity").fetch_optional(pool).await? } else { None };
    // In the exception lane and on the stream, as every reader of state.
    let counts: Vec<(String, i64)> = sqlx::query_as("SELECT state, n FROM outbox_state_counts()").fetch_all(pool).await?;
    let mut state_counts: Vec<(String, i64)> =
        ALL_STATES.iter().map(|s| (s.to_string(), counts.iter().find(|(n, _)| *n == s.to_string()).map(|(_, c)| *c).unwrap_or(0))).collect();
    for (s, n) in &counts {
        if !state_counts.iter().any(|(k, _)| k == s) {
            state_counts.push((s.clone(), *n));
        }
    }
    let total_events = state_counts.iter().map(|(_, n)| n).sum();
    // The same figure as the dispatcher's gauge and the report: the outbox's
    // own events (a legacy publisher's stay PENDING here), one index descent.
    let oldest_pending = outbox_producer::pg::oldest_pending_created_ms(pool).await?;
    let (unknown_open, oldest_unknown_age_ms) = unknown_open(pool, now_ms).await?;
    let (open_findings, stalls): (Vec<(String, i64)>, Vec<String>) = if exists(pool, "outbox_findings").await? {
        (
            sqlx::query_as("SELECT kind, count(*) FROM outbox_findings WHERE resolved_at_ms IS NULL GROUP BY kind ORDER BY kind").fetch_all(pool).await?,
            sqlx::query_scalar("SELECT detail FROM outbox_findings WHERE resolved_at_ms IS NULL AND kind = 'partition_count_changed' ORDER BY first_seen_ms, id LIMIT 20")
                .fetch_all(pool)
                .await?,
        )
    } else {
        (Vec::new(), Vec::new())
    };

    let watermarks_table = exists(pool, "outbox_consumer_watermarks").await?;
    let has_topics: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_name = 'outbox_consumers' AND column_name = 'topics')")
            .fetch_one(pool)
            .await?;
    let topics_col = if has_topics { "topics" } else { "'{}'::text[]" };
    let registered: Vec<(String, bool, bool, Vec<String>)> =
        sqlx::query_as(&format!("SELECT consumer_id, critical, mandatory, {topics_col} FROM outbox_consumers ORDER BY consumer_id")).fetch_all(pool).await?;
    let mut consumers = Vec::new();
    for (consumer_id, critical, mandatory, topics) in registered {
        let mut partitions = Vec::new();
        if critical {
            // Every log (cluster, topic, topic id, partition) of its topics
            // that has published events, and every watermark it published;
            // the topic id matched exactly (NULL with NULL).
            let wm = if watermarks_table {
                "SELECT cluster_id, topic, topic_id, partition, committed_offset, (extract(epoch FROM updated_at) * 1000)::bigint AS updated_ms
                 FROM outbox_consumer_watermarks WHERE consumer_id = $1"
            } else {
                "SELECT NULL::text AS cluster_id, NULL::text AS topic, NULL::text AS topic_id, NULL::int AS partition, NULL::bigint AS committed_offset,
                        NULL::bigint AS updated_ms WHERE false"
            };
            let rows = sqlx::query(&format!(
                "WITH wm AS ({wm}),
                      pub AS (SELECT cluster_id, topic, topic_id, partition, max(\"offset\") + 1 AS end_offset FROM outbox_publish_receipts
                              WHERE topic = ANY($2) GROUP BY cluster_id, topic, topic_id, partition),
                      parts AS (SELECT cluster_id, topic, topic_id, partition FROM pub UNION SELECT cluster_id, topic, topic_id, partition FROM wm)
                 SELECT p.cluster_id, p.topic, p.topic_id, p.partition, coalesce(wm.committed_offset, 0) AS committed,
                        coalesce(pub.end_offset, 0) AS end_offset, wm.updated_ms,
                        (SELECT count(*) FROM outbox_publish_receipts r
                          WHERE r.cluster_id = p.cluster_id AND r.topic = p.topic AND r.topic_id IS NOT DISTINCT FROM p.topic_id
                            AND r.partition = p.partition AND r.\"offset\" >= coalesce(wm.committed_offset, 0)) AS lag
                 FROM parts p
                 LEFT JOIN wm ON wm.cluster_id = p.cluster_id AND wm.topic = p.topic AND wm.topic_id IS NOT DISTINCT FROM p.topic_id AND wm.partition = p.partition
                 LEFT JOIN pub ON pub.cluster_id = p.cluster_id AND pub.topic = p.topic AND pub.topic_id IS NOT DISTINCT FROM p.topic_id
                                  AND pub.partition = p.partition
                 ORDER BY p.cluster_id, p.topic, p.partition, p.topic_id NULLS FIRST"
            ))
            .bind(&consumer_id)
            .bind(&topics)
            .fetch_all(pool)
            .await?;
            for r in rows {
                partitions.push(PartitionLag {
                    cluster_id: r.get("cluster_id"),
                    topic: r.get("topic"),
                    topic_id: r.get("topic_id"),
                    partition: r.get("partition"),
                    committed_offset: r.get("committed"),
                    published_end_offset: r.get("end_offset"),
                    lag_events: r.get("lag"),
                    watermark_updated_at_ms: r.get("updated_ms"),
                });
            }
        }
        let total_lag_events = partitions.iter().map(|p| p.lag_events).sum();
        consumers.push(ConsumerStatus { consumer_id, critical, mandatory, topics, partitions, total_lag_events });
    }
    let last_reconciler_round = outbox_producer::report::last_reconciler_round(pool, now_ms).await?;
    let reconciler_finding = outbox_producer::report::stale_reconciler_finding(last_reconciler_round.as_ref(), total_events, reconciler_stale_ms);
    Ok(Status {
        last_reconciler_round,
        reconciler_finding,
        now_ms,
        source,
        state_counts,
        total_events,
        oldest_pending_age_ms: oldest_pending.map(|o| (now_ms - o).max(0)),
        unknown_open,
        oldest_unknown_age_ms,
        open_findings,
        stalls,
        consumers,
        watermarks_table,
        consumer_decisions: outbox_producer::consumer_decisions(pool).await.map_err(|e| sqlx::Error::Protocol(e.to_string()))?,
    })
}

impl Status {
    /// Open findings in all, the stale-reconciler one included.
    pub fn findings_total(&self) -> i64 {
        self.open_findings.iter().map(|(_, n)| n).sum::<i64>() + i64::from(self.reconciler_finding.is_some())
    }

    /// Plain text for a terminal.
    pub fn to_text(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "outbox status at {}", ts(self.now_ms));
        let _ = writeln!(o, "source:          {}", self.source.as_deref().unwrap_or("none (run outbox migrate)"));
        let _ = writeln!(o, "events: {}", self.total_events);
        for (s, n) in &self.state_counts {
            let _ = writeln!(o, "  {s:<17} {n:>10}");
        }
        let _ = writeln!(o, "oldest PENDING:  {}", self.oldest_pending_age_ms.map(age).unwrap_or_else(|| "none".into()));
        let _ = writeln!(
            o,
            "UNKNOWN open:    {} (oldest {})",
            self.unknown_open,
            self.oldest_unknown_age_ms.map(age).unwrap_or_else(|| "none".into())
        );
        match &self.last_reconciler_round {
            None => {
                let _ = writeln!(o, "reconciler:      no round recorded");
            }
            Some(r) => {
                let _ = writeln!(o, "reconciler:      last round {} ({} ago) by {}", ts(r.last_round_at_ms), age(r.age_ms), r.owner);
            }
        }
        if let Some(f) = &self.reconciler_finding {
            let _ = writeln!(o, "STALE:           {}", f.detail);
        }
        if self.open_findings.is_empty() {
            let _ = writeln!(o, "open findings:   none");
        } else {
            let f: Vec<String> = self.open_findings.iter().map(|(k, n)| format!("{k}={n}")).collect();
            let _ = writeln!(o, "open findings:   {}", f.join(" "));
        }
        for s in &self.stalls {
            let _ = writeln!(o, "  STALLED: {s}");
        }
        if self.consumers.is_empty() {
            let _ = writeln!(o, "consumers:       none registered");
        }
        for c in &self.consumers {
            let flags = [c.critical.then_some("critical"), c.mandatory.then_some("mandatory")].into_iter().flatten().collect::<Vec<_>>().join(",");
            let _ = writeln!(o, "consumer {} [{}] topics {:?}: lag {} events", c.consumer_id, flags, c.topics, c.total_lag_events);
            if c.critical && c.partitions.is_empty() {
                let _ = writeln!(o, "  nothing published on its topics yet{}", if self.watermarks_table { "" } else { " (no watermark table here)" });
            }
            if let Some(d) = self.consumer_decisions.iter().find(|d| d.consumer_id == c.consumer_id) {
                let _ = writeln!(o, "  {}", d.describe());
            }
            for p in &c.partitions {
                let seen = p.watermark_updated_at_ms.map(|t| format!("watermark moved {} ago", age((self.now_ms - t).max(0)))).unwrap_or_else(|| "no watermark".into());
                let of_id = p.topic_id.as_deref().map(|id| format!(" (topic id {id})")).unwrap_or_default();
                let _ = writeln!(
                    o,
                    "  {}/{}{of_id}/{}: committed {} of {} ({} behind; {seen})",
                    p.cluster_id, p.topic, p.partition, p.committed_offset, p.published_end_offset, p.lag_events
                );
            }
        }
        // Consumers that quarantined or dead-lettered without being registered.
        for d in self.consumer_decisions.iter().filter(|d| !self.consumers.iter().any(|c| c.consumer_id == d.consumer_id)) {
            let _ = writeln!(o, "consumer {} (not registered): {}", d.consumer_id, d.describe());
        }
        o
    }
}

