//! The reconciliation report: the three sets (committed outbox, publish
//! receipts, critical consumers' watermarks), the findings, and the UNKNOWN
//! SLO figures. Built by [`build_report`]; rendered as text by
//! [`Report::to_text`] and as HTML by the CLI.

use serde::Serialize;

/// One finding of the three-set comparison.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Finding {
    /// `aged_pending`, `unconsumed_published`, `bypass_publish`, `unknown_past_slo`, `quarantined`,
    /// `foreign_source`, `unrecorded_copy`, `divergent_copy`, ... (docs/OPERATIONS.md).
    pub kind: String,
    /// The event concerned (or the eventId found in the topic, for a bypass).
    pub event_id: String,
    /// The consumer concerned, for `unconsumed_published`.
    pub consumer_id: Option<String>,
    /// Age of the condition, ms.
    pub age_ms: i64,
    /// Human-readable detail.
    pub detail: String,
}

/// Lag of one critical consumer on one partition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConsumerLag {
    /// Consumer.
    pub consumer_id: String,
    /// Broker cluster of the log.
    pub cluster_id: String,
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The consumer's committed offset (next offset it will read).
    pub committed_offset: i64,
    /// One past the highest published offset the outbox knows on this partition.
    pub published_end_offset: i64,
    /// Published events at or above the committed offset.
    pub lag_events: i64,
}

/// What one consumer decided without an effect: its quarantines (by reason)
/// and dead letters, from `outbox_consumer_quarantine` and
/// `outbox_consumer_dead_letters` where those tables are in the outbox
/// database (a consumer sharing it, or one that copies them there).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConsumerDecisions {
    /// Consumer.
    pub consumer_id: String,
    /// Quarantined messages.
    pub quarantined: i64,
    /// Quarantines per reason (`verify:source_unknown`, `divergent_duplicate`, ...).
    pub quarantined_by_reason: Vec<(String, i64)>,
    /// Dead-lettered events.
    pub dead_lettered: i64,
}

/// Most consumers [`consumer_decisions`] lists.
pub const MAX_CONSUMER_DECISIONS: i64 = 1_000;

/// Quarantines and dead letters per consumer, read from the outbox database
/// (empty where the consumer tables are not there or this role may not read them).
pub async fn consumer_decisions(pool: &PgPool) -> Result<Vec<ConsumerDecisions>, ProducerError> {
    // Absent, or not readable by this role: nothing to show (never an error).
    let (q, d): (bool, bool) = sqlx::query_as(
        "SELECT coalesce(has_table_privilege(to_regclass('outbox_consumer_quarantine'), 'SELECT'), false),
                coalesce(has_table_privilege(to_regclass('outbox_consumer_dead_letters'), 'SELECT'), false)",
    )
        .fetch_one(pool)
        .await?;
    let mut out: std::collections::BTreeMap<String, ConsumerDecisions> = std::collections::BTreeMap::new();
    fn entry<'a>(out: &'a mut std::collections::BTreeMap<String, ConsumerDecisions>, c: String) -> &'a mut ConsumerDecisions {
        out.entry(c.clone()).or_insert_with(|| ConsumerDecisions { consumer_id: c, quarantined: 0, quarantined_by_reason: Vec::new(), dead_lettered: 0 })
    }
    if q {
        let rows: Vec<(String, String, i64)> = sqlx::query_as(
            "SELECT consumer_id, reason, count(*) FROM outbox_consumer_quarantine
             WHERE consumer_id IN (SELECT DISTINCT consumer_id FROM outbox_consumer_quarantine ORDER BY consumer_id LIMIT $1)
             GROUP BY consumer_id, reason ORDER BY consumer_id, reason",
        )
        .bind(MAX_CONSUMER_DECISIONS)
        .fetch_all(pool)
        .await?;
        for (c, reason, n) in rows {
            let e = entry(&mut out, c);
            e.quarantined += n;
            e.quarantined_by_reason.push((reason, n));
        }
    }
    if d {
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT consumer_id, count(*) FROM outbox_consumer_dead_letters GROUP BY consumer_id ORDER BY consumer_id LIMIT $1").bind(MAX_CONSUMER_DECISIONS).fetch_all(pool).await?;
        for (c, n) in rows {
            entry(&mut out, c).dead_lettered += n;
        }
    }
    Ok(out.into_values().collect())
}

/// One bucket of a histogram.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Bucket {
    /// Upper bound of the bucket, ms (the last bucket is open: `i64::MAX`).
    pub le_ms: i64,
    /// Count in the bucket.
    pub count: i64,
}

/// Counts per state at one moment, for the "events per state over time" chart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StateSnapshot {
    /// When, ms since the epoch.
    pub at_ms: i64,
    /// State name -> count.
    pub counts: Vec<(String, i64)>,
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// When it was built, ms since the epoch.
    pub generated_at_ms: i64,
    /// Set 1: committed outbox events (all states).
    pub committed_events: i64,
    /// Set 2: accepted publish receipts (primary slots).
    pub publish_receipts: i64,
    /// Duplicate transport receipts kept as evidence.
    pub duplicate_receipts: i64,
    /// Set 3: per critical consumer, published events its watermark has passed.
    pub consumed_by_critical: Vec<(String, i64)>,
    /// Current counts per state.
    pub state_counts: Vec<(String, i64)>,
    /// Age of the oldest PENDING event, ms.
    pub oldest_pending_age_ms: Option<i64>,
    /// UNKNOWN events open now.
    pub unknown_open: i64,
    /// Age histogram of the open UNKNOWNs.
    pub unknown_age_histogram: Vec<Bucket>,
    /// UNKNOWNs resolved (ever), and their time-to-resolution p99, ms.
    pub unknown_resolved: i64,
    /// p99 of time from DISPATCH_UNKNOWN to resolution, ms (None if none resolved).
    pub unknown_p99_resolution_ms: Option<i64>,
    /// The SLO the p99 is held to, ms (15 minutes by default).
    pub unknown_slo_ms: i64,
    /// Lag per critical consumer and partition.
    pub consumer_lag: Vec<ConsumerLag>,
    /// Events per state over time (from the reconciler's snapshots).
    pub history: Vec<StateSnapshot>,
    /// Findings; empty on a healthy system.
    pub findings: Vec<Finding>,
    /// Quarantines and dead letters per consumer (where the consumer tables
    /// are in the outbox database).
    pub consumer_decisions: Vec<ConsumerDecisions>,
}

use sqlx::{PgPool, Row};

use crate::error::ProducerError;

/// What [`build_report`] needs to know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportOptions {
    /// "Now", ms since the epoch.
    pub now_ms: i64,
    /// The UNKNOWN SLO, ms.
    pub unknown_slo_ms: i64,
    /// Most findings listed.
    pub max_findings: i64,
    /// Most history snapshots included.
    pub max_history: i64,
}

impl ReportOptions {
    /// Defaults at `now_ms`: SLO 15 minutes, 1 000 findings, 200 snapshots.
    pub fn at(now_ms: i64) -> Self {
        ReportOptions { now_ms, unknown_slo_ms: DEFAULT_UNKNOWN_SLO_MS, max_findings: 1_000, max_history: 200 }
    }
}

/// The UNKNOWN time-to-resolution SLO: 15 minutes (SPEC §10).
pub const DEFAULT_UNKNOWN_SLO_MS: i64 = 15 * 60 * 1000;

/// Upper bounds of the UNKNOWN age histogram, ms.
pub const UNKNOWN_AGE_BUCKETS_MS: [i64; 6] = [60_000, 5 * 60_000, 15 * 60_000, 60 * 60_000, 6 * 60 * 60_000, i64::MAX];

/// Whether the consumer side's watermark table exists in this database.
pub(crate) async fn has_watermarks(pool: &PgPool) -> Result<bool, ProducerError> {
    Ok(sqlx::query_scalar::<_, bool>("SELECT to_regclass('outbox_consumer_watermarks') IS NOT NULL").fetch_one(pool).await?)
}

/// Builds the report from the outbox database.
pub async fn build_report(pool: &PgPool, opts: &ReportOptions) -> Result<Report, ProducerError> {
    let now = opts.now_ms;
    let scalar = |sql: &'static str| async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(pool).await };
    let committed_events = scalar("SELECT count(*) FROM outbox_events").await?;
    let publish_receipts = scalar("SELECT count(*) FROM outbox_publish_receipts").await?;
    let duplicate_receipts = scalar("SELECT count(*) FROM outbox_duplicate_receipts").await?;
    let state_counts: Vec<(String, i64)> = sqlx::query_as("SELECT state, count(*) FROM outbox_events GROUP BY state ORDER BY state").fetch_all(pool).await?;
    let oldest_pending = crate::pg::oldest_pending_created_ms(pool).await?;

    let unknown_since: Vec<i64> = sqlx::query_scalar(
        "SELECT unknown_since_ms FROM outbox_events
         WHERE unknown_since_ms IS NOT NULL AND state NOT IN ('PUBLISHED', 'RETAINED', 'PURGED', 'QUARANTINED')",
    )
    .fetch_all(pool)
    .await?;
    let mut unknown_age_histogram: Vec<Bucket> = UNKNOWN_AGE_BUCKETS_MS.iter().map(|&le_ms| Bucket { le_ms, count: 0 }).collect();
    for since in &unknown_since {
        let age = (now - since).max(0);
        if let Some(b) = unknown_age_histogram.iter_mut().find(|b| age <= b.le_ms) {
            b.count += 1;
        }
    }
    let row = sqlx::query(
        "SELECT count(*) AS n, percentile_disc(0.99) WITHIN GROUP (ORDER BY resolved_at_ms - unknown_since_ms) AS p99
         FROM outbox_unknown_resolutions",
    )
    .fetch_one(pool)
    .await?;
    let unknown_resolved: i64 = row.try_get("n")?;
    let unknown_p99_resolution_ms: Option<i64> = row.try_get("p99")?;

    let mut consumed_by_critical = Vec::new();
    let mut consumer_lag = Vec::new();
    let watermarks = has_watermarks(pool).await?;
    let critical: Vec<(String, Vec<String>)> = sqlx::query_as("SELECT consumer_id, topics FROM outbox_consumers WHERE critical ORDER BY consumer_id").fetch_all(pool).await?;
    for (consumer_id, topics) in &critical {
        let wm_join = if watermarks {
            "LEFT JOIN outbox_consumer_watermarks w ON w.consumer_id = $1 AND w.cluster_id = r.cluster_id AND w.topic = r.topic AND w.partition = r.partition"
        } else {
            "LEFT JOIN (SELECT NULL::text AS cluster_id, NULL::text AS topic, NULL::int AS partition, NULL::bigint AS committed_offset) w ON false"
        };
        let rows = sqlx::query(&format!(
            "SELECT r.cluster_id, r.topic, r.partition, coalesce(max(w.committed_offset), 0) AS committed, max(r.\"offset\") + 1 AS end_offset,
                    count(*) FILTER (WHERE r.\"offset\" >= coalesce(w.committed_offset, 0)) AS lag,
                    count(*) FILTER (WHERE r.\"offset\" < coalesce(w.committed_offset, 0)) AS consumed
             FROM outbox_publish_receipts r {wm_join}
             WHERE r.topic = ANY($2)
             GROUP BY r.cluster_id, r.topic, r.partition ORDER BY r.cluster_id, r.topic, r.partition"
        ))
        .bind(consumer_id)
        .bind(topics)
        .fetch_all(pool)
        .await?;
        let mut consumed = 0;
        for r in rows {
            consumed += r.try_get::<i64, _>("consumed")?;
            consumer_lag.push(ConsumerLag {
                consumer_id: consumer_id.clone(),
                cluster_id: r.try_get("cluster_id")?,
                topic: r.try_get("topic")?,
                partition: r.try_get("partition")?,
                committed_offset: r.try_get("committed")?,
                published_end_offset: r.try_get("end_offset")?,
                lag_events: r.try_get("lag")?,
            });
        }
        consumed_by_critical.push((consumer_id.clone(), consumed));
    }

    let snaps: Vec<(i64, String, i64)> = sqlx::query_as(
        "SELECT at_ms, state, count FROM outbox_state_snapshots
         WHERE at_ms IN (SELECT DISTINCT at_ms FROM outbox_state_snapshots ORDER BY at_ms DESC LIMIT $1) ORDER BY at_ms, state",
    )
    .bind(opts.max_history)
    .fetch_all(pool)
    .await?;
    let mut history: Vec<StateSnapshot> = Vec::new();
    for (at_ms, state, count) in snaps {
        match history.last_mut() {
            Some(h) if h.at_ms == at_ms => h.counts.push((state, count)),
            _ => history.push(StateSnapshot { at_ms, counts: vec![(state, count)] }),
        }
    }

    let findings = sqlx::query("SELECT kind, event_id, consumer_id, age_ms, detail FROM outbox_findings WHERE resolved_at_ms IS NULL ORDER BY kind, first_seen_ms LIMIT $1")
        .bind(opts.max_findings)
        .fetch_all(pool)
        .await?
        .iter()
        .map(|r| {
            let consumer: String = r.try_get("consumer_id")?;
            Ok(Finding {
                kind: r.try_get("kind")?,
                event_id: r.try_get("event_id")?,
                consumer_id: (!consumer.is_empty()).then_some(consumer),
                age_ms: r.try_get("age_ms")?,
                detail: r.try_get("detail")?,
            })
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?;

    Ok(Report {
        generated_at_ms: now,
        committed_events,
        publish_receipts,
        duplicate_receipts,
        consumed_by_critical,
        state_counts,
        oldest_pending_age_ms: oldest_pending.map(|o| (now - o).max(0)),
        unknown_open: unknown_since.len() as i64,
        unknown_age_histogram,
        unknown_resolved,
        unknown_p99_resolution_ms,
        unknown_slo_ms: opts.unknown_slo_ms,
        consumer_lag,
        history,
        findings,
        consumer_decisions: consumer_decisions(pool).await?,
    })
}

fn ms(v: i64) -> String {
    if v >= 60_000 {
        format!("{:.1} min", v as f64 / 60_000.0)
    } else if v >= 1_000 {
        format!("{:.1} s", v as f64 / 1_000.0)
    } else {
        format!("{v} ms")
    }
}

impl Report {
    /// Whether the UNKNOWN p99 meets the SLO (vacuously true with no resolutions).
    pub fn unknown_slo_met(&self) -> bool {
        self.unknown_p99_resolution_ms.is_none_or(|p| p <= self.unknown_slo_ms)
    }

    /// The plain-text rendering.
    pub fn to_text(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let _ = writeln!(out, "reconciliation report");
        let _ = writeln!(out, "  committed outbox events   {}", self.committed_events);
        let _ = writeln!(out, "  accepted publish receipts {}  (duplicate transport receipts kept: {})", self.publish_receipts, self.duplicate_receipts);
        if self.consumed_by_critical.is_empty() {
            let _ = writeln!(out, "  critical consumers        none registered");
        }
        for (c, n) in &self.consumed_by_critical {
            let _ = writeln!(out, "  consumed by {c:<14} {n}");
        }
        let states: Vec<String> = self.state_counts.iter().map(|(s, n)| format!("{s}={n}")).collect();
        let _ = writeln!(out, "  states                    {}", if states.is_empty() { "-".into() } else { states.join(" ") });
        let _ = writeln!(out, "  oldest PENDING            {}", self.oldest_pending_age_ms.map(ms).unwrap_or_else(|| "none".into()));
        let _ = writeln!(out, "  UNKNOWN open              {}", self.unknown_open);
        let _ = writeln!(
            out,
            "  UNKNOWN p99 to resolution {} over {} resolved (SLO {}: {})",
            self.unknown_p99_resolution_ms.map(ms).unwrap_or_else(|| "n/a".into()),
            self.unknown_resolved,
            ms(self.unknown_slo_ms),
            if self.unknown_slo_met() { "met" } else { "MISSED" }
        );
        for l in &self.consumer_lag {
            let _ = writeln!(out, "  lag {} {}/{}/{}: committed {} of {} ({} behind)", l.consumer_id, l.cluster_id, l.topic, l.partition, l.committed_offset, l.published_end_offset, l.lag_events);
        }
        for c in &self.consumer_decisions {
            let reasons: Vec<String> = c.quarantined_by_reason.iter().map(|(r, n)| format!("{r}={n}")).collect();
            let _ = writeln!(out, "  consumer {} quarantined {} [{}] dead-lettered {}", c.consumer_id, c.quarantined, reasons.join(" "), c.dead_lettered);
        }
        if self.findings.is_empty() {
            let _ = writeln!(out, "  findings                  none");
        } else {
            let _ = writeln!(out, "  findings                  {}", self.findings.len());
            for f in &self.findings {
                let who = f.consumer_id.as_deref().map(|c| format!(" consumer={c}")).unwrap_or_default();
                let _ = writeln!(out, "    {} {}{} age={} {}", f.kind, f.event_id, who, ms(f.age_ms), f.detail);
            }
        }
        out
    }
}
