//! The reconciliation report: the three sets (committed outbox, publish
//! receipts, critical consumers' watermarks), the findings, and the UNKNOWN
//! SLO figures. Built by [`build_report`]; rendered as text by
//! [`Report::to_text`] and as HTML by the CLI.

use serde::Serialize;

/// Serializes `(name, count)` pairs as objects `{"name": .., "count": ..}`
/// under the given key names (JSON readers get objects, not positional arrays).
pub mod pairs {
    use serde::ser::{SerializeMap, SerializeSeq, Serializer};

    fn pairs<S: Serializer>(v: &[(String, i64)], key: &str, s: S) -> Result<S::Ok, S::Error> {
        struct Pair<'a>(&'a str, &'a str, i64);
        impl serde::Serialize for Pair<'_> {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let mut m = s.serialize_map(Some(2))?;
                m.serialize_entry(self.0, self.1)?;
                m.serialize_entry("count", &self.2)?;
                m.end()
            }
        }
        let mut seq = s.serialize_seq(Some(v.len()))?;
        for (name, n) in v {
            seq.serialize_element(&Pair(key, name, *n))?;
        }
        seq.end()
    }

    /// `[{"state": "PENDING", "count": 3}, ...]`.
    pub fn states<S: Serializer>(v: &[(String, i64)], s: S) -> Result<S::Ok, S::Error> {
        pairs(v, "state", s)
    }

    /// `[{"consumerId": "billing", "count": 3}, ...]`.
    pub fn consumers<S: Serializer>(v: &[(String, i64)], s: S) -> Result<S::Ok, S::Error> {
        pairs(v, "consumerId", s)
    }

    /// `[{"kind": "aged_pending", "count": 3}, ...]`.
    pub fn kinds<S: Serializer>(v: &[(String, i64)], s: S) -> Result<S::Ok, S::Error> {
        pairs(v, "kind", s)
    }
}

/// One finding of the three-set comparison.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Finding {
    /// `aged_pending`, `unconsumed_published`, `bypass_publish`, `unknown_past_slo`, `quarantined`,
    /// `absence_proof_refuted`, `unregistered_message`, `receipt_position_lost`, `log_unavailable`, `published_without_receipt`,
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

/// Lag of one critical consumer on one partition's log (a topic recreated
/// under the same name has a log per topic id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConsumerLag {
    /// Consumer.
    pub consumer_id: String,
    /// Broker cluster of the log.
    pub cluster_id: String,
    /// Topic.
    pub topic: String,
    /// The topic id the receipts of the log name (`None`: destination.v1).
    pub topic_id: Option<String>,
    /// Partition.
    pub partition: i32,
    /// The consumer's committed offset (next offset it will read).
    pub committed_offset: i64,
    /// One past the highest published offset the outbox knows on this partition.
    pub published_end_offset: i64,
    /// Published events at or above the committed offset.
    pub lag_events: i64,
}

/// A partition log the outbox recorded receipts in and that is gone: its
/// open `receipt_position_lost` findings, by the log their receipts name
/// (the cluster replaced by an empty one, a topic recreated under the same
/// name). docs/OPERATIONS.md §6 says what to do with its events.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LostLog {
    /// Broker cluster.
    pub cluster_id: String,
    /// Topic.
    pub topic: String,
    /// The topic id the receipts name (`None`: destination.v1).
    pub topic_id: Option<String>,
    /// Partition.
    pub partition: i32,
    /// Published events whose receipt's position no longer holds their message.
    pub receipts_lost: i64,
    /// Lowest and highest offset of those receipts.
    pub first_offset: i64,
    /// See `first_offset`.
    pub last_offset: i64,
}

/// What one consumer decided without an effect: its quarantines (by reason)
/// and dead letters, from `outbox_consumer_quarantine` and
/// `outbox_consumer_dead_letters` where those tables are in the outbox
/// database (a consumer sharing it, or one that copies them there), and the
/// counts its watermarks carry (every consumer that publishes its
/// watermarks, whatever database its rows live in).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConsumerDecisions {
    /// Consumer.
    pub consumer_id: String,
    /// Quarantined messages (rows in the outbox database).
    pub quarantined: i64,
    /// Quarantines per reason (`verify:source_unknown`, `divergent_duplicate`, ...).
    pub quarantined_by_reason: Vec<(String, i64)>,
    /// Dead-lettered events (rows in the outbox database).
    pub dead_lettered: i64,
    /// What its watermarks count, summed over its logs (`None`: no watermark here).
    pub watermark_counts: Option<DecisionCounts>,
}

/// A consumer's decisions as its watermarks count them (cumulative).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DecisionCounts {
    /// Events applied.
    pub applied: i64,
    /// Redeliveries answered without a second effect.
    pub duplicates: i64,
    /// Messages quarantined.
    pub quarantined: i64,
    /// Events dead-lettered.
    pub dead_lettered: i64,
}

impl ConsumerDecisions {
    /// Quarantined messages: the rows here, or what its watermarks count
    /// when more (its rows live in its own database).
    pub fn quarantined_total(&self) -> i64 {
        self.quarantined.max(self.watermark_counts.map_or(0, |c| c.quarantined))
    }

    /// Dead-lettered events, the same way.
    pub fn dead_lettered_total(&self) -> i64 {
        self.dead_lettered.max(self.watermark_counts.map_or(0, |c| c.dead_lettered))
    }

    /// Whether it quarantined messages and applied none: a trust policy that
    /// refuses what the producer sends (a mistyped accepted source, a
    /// missing key).
    pub fn quarantines_everything(&self) -> bool {
        self.watermark_counts.is_some_and(|c| c.quarantined > 0 && c.applied == 0 && c.duplicates == 0 && c.dead_lettered == 0)
    }

    /// One line for `outbox status` and the report.
    pub fn describe(&self) -> String {
        let reasons: Vec<String> = self.quarantined_by_reason.iter().map(|(r, n)| format!("{r}={n}")).collect();
        let detail = if !reasons.is_empty() {
            format!(" ({})", reasons.join(" "))
        } else if self.quarantined_total() > 0 {
            " (counted by its watermarks; the rows, with reasons and evidence, are in its own database: outbox trace --consumer-database-url)".to_owned()
        } else {
            String::new()
        };
        let loud = if self.quarantines_everything() {
            " -- EVERY MESSAGE QUARANTINED, NONE APPLIED: check its trust policy (accepted sources, verification keys) against what the producer sends"
        } else {
            ""
        };
        format!("quarantined {}{detail} dead-lettered {}{loud}", self.quarantined_total(), self.dead_lettered_total())
    }
}

/// Most consumers [`consumer_decisions`] lists.
pub const MAX_CONSUMER_DECISIONS: i64 = 1_000;

/// Quarantines and dead letters per consumer, read from the outbox database
/// (empty where the consumer tables are not there or this role may not read them).
pub async fn consumer_decisions(pool: &PgPool) -> Result<Vec<ConsumerDecisions>, ProducerError> {
    // Absent, or not readable by this role: nothing to show (never an error).
    let (q, d, w): (bool, bool, bool) = sqlx::query_as(
        "SELECT coalesce(has_table_privilege(to_regclass('outbox_consumer_quarantine'), 'SELECT'), false),
                coalesce(has_table_privilege(to_regclass('outbox_consumer_dead_letters'), 'SELECT'), false),
                coalesce(has_table_privilege(to_regclass('outbox_consumer_watermarks'), 'SELECT'), false)",
    )
        .fetch_one(pool)
        .await?;
    let mut out: std::collections::BTreeMap<String, ConsumerDecisions> = std::collections::BTreeMap::new();
    fn entry<'a>(out: &'a mut std::collections::BTreeMap<String, ConsumerDecisions>, c: String) -> &'a mut ConsumerDecisions {
        out.entry(c.clone()).or_insert_with(|| ConsumerDecisions { consumer_id: c, quarantined: 0, quarantined_by_reason: Vec::new(), dead_lettered: 0, watermark_counts: None })
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
    if w {
        // Only consumers whose watermarks count something without an effect.
        let rows: Vec<(String, i64, i64, i64, i64)> = sqlx::query_as(
            "SELECT consumer_id, sum(applied_count)::int8, sum(duplicate_count)::int8, sum(quarantined_count)::int8, sum(dead_lettered_count)::int8
             FROM outbox_consumer_watermarks GROUP BY consumer_id
             HAVING sum(quarantined_count) > 0 OR sum(dead_lettered_count) > 0
             ORDER BY consumer_id LIMIT $1",
        )
        .bind(MAX_CONSUMER_DECISIONS)
        .fetch_all(pool)
        .await?;
        for (c, applied, duplicates, quarantined, dead_lettered) in rows {
            entry(&mut out, c).watermark_counts = Some(DecisionCounts { applied, duplicates, quarantined, dead_lettered });
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

/// The last recorded round of a reconciler.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReconcilerRound {
    /// The reconciler's owner name.
    pub owner: String,
    /// The cluster it was connected to.
    pub cluster_id: String,
    /// When its last round finished, ms since the epoch.
    pub last_round_at_ms: i64,
    /// How long ago, ms.
    pub age_ms: i64,
    /// Its pause between rounds, ms.
    pub interval_ms: i64,
    /// The UNKNOWN SLO it holds events to, ms.
    pub unknown_slo_ms: i64,
    /// Rounds it has recorded.
    pub rounds: i64,
}

/// Whether the UNKNOWN SLO is met.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum SloVerdict {
    /// Resolutions exist, their p99 is within the SLO, and no open UNKNOWN is older than it.
    #[serde(rename = "met")]
    Met,
    /// The p99 of the resolutions exceeds the SLO, or an open UNKNOWN is older than it.
    #[serde(rename = "missed")]
    Missed,
    /// Nothing resolved yet and nothing open past the SLO: no evidence either way.
    #[serde(rename = "n/a")]
    NotApplicable,
}

impl SloVerdict {
    /// `met`, `MISSED` or `n/a`.
    pub fn as_str(&self) -> &'static str {
        match self {
            SloVerdict::Met => "met",
            SloVerdict::Missed => "MISSED",
            SloVerdict::NotApplicable => "n/a",
        }
    }
}

/// Counts per state at one moment, for the "events per state over time" chart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StateSnapshot {
    /// When, ms since the epoch.
    pub at_ms: i64,
    /// State name -> count.
    #[serde(serialize_with = "pairs::states")]
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
    #[serde(serialize_with = "pairs::consumers")]
    pub consumed_by_critical: Vec<(String, i64)>,
    /// Current counts per state.
    #[serde(serialize_with = "pairs::states")]
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
    /// Findings; empty on a healthy system. Besides the reconciler's own,
    /// a `reconciler_stale` finding when no reconciler round was recorded
    /// within `reconciler_stale_ms` (a stopped reconciler records nothing).
    pub findings: Vec<Finding>,
    /// Logs that are gone, from the open `receipt_position_lost` findings
    /// (every one counted, whatever `max_findings` lists).
    pub lost_logs: Vec<LostLog>,
    /// The most recent reconciler round (None: no reconciler ever ran here).
    pub last_reconciler_round: Option<ReconcilerRound>,
    /// The UNKNOWN SLO verdict (one source: [`slo_verdict`], with the SLO the last reconciler round recorded).
    pub unknown_slo_verdict: SloVerdict,
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
    /// Take the SLO the last reconciler round recorded, when there is one,
    /// instead of `unknown_slo_ms` (so the report judges by the reconciler's
    /// figure). Set it to false when `unknown_slo_ms` was given explicitly.
    pub use_reconciler_slo: bool,
    /// A last reconciler round older than this (or three of its intervals,
    /// whichever is longer) is a `reconciler_stale` finding, ms.
    pub reconciler_stale_ms: i64,
}

impl ReportOptions {
    /// Defaults at `now_ms`: SLO 15 minutes, 1 000 findings, 200 snapshots.
    pub fn at(now_ms: i64) -> Self {
        ReportOptions {
            now_ms,
            unknown_slo_ms: DEFAULT_UNKNOWN_SLO_MS,
            max_findings: 1_000,
            max_history: 200,
            use_reconciler_slo: true,
            reconciler_stale_ms: DEFAULT_RECONCILER_STALE_MS,
        }
    }
}

/// The UNKNOWN time-to-resolution SLO: 15 minutes (PROTOCOL §10).
pub const DEFAULT_UNKNOWN_SLO_MS: i64 = 15 * 60 * 1000;

/// A reconciler whose last round is older than this is stale: 5 minutes.
pub const DEFAULT_RECONCILER_STALE_MS: i64 = 5 * 60 * 1000;

/// The most recent round any reconciler recorded (None if the table is
/// missing or empty).
pub async fn last_reconciler_round(pool: &PgPool, now_ms: i64) -> Result<Option<ReconcilerRound>, ProducerError> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('outbox_reconciler_rounds') IS NOT NULL").fetch_one(pool).await?;
    if !exists {
        return Ok(None);
    }
    let row = sqlx::query(
        "SELECT owner, cluster_id, last_round_at_ms, interval_ms, unknown_slo_ms, rounds FROM outbox_reconciler_rounds
         ORDER BY last_round_at_ms DESC, owner LIMIT 1",
    )
    .fetch_optional(pool)
    .await?;
    row.map(|r| {
        let at: i64 = r.try_get("last_round_at_ms")?;
        Ok(ReconcilerRound {
            owner: r.try_get("owner")?,
            cluster_id: r.try_get("cluster_id")?,
            last_round_at_ms: at,
            age_ms: (now_ms - at).max(0),
            interval_ms: r.try_get("interval_ms")?,
            unknown_slo_ms: r.try_get("unknown_slo_ms")?,
            rounds: r.try_get("rounds")?,
        })
    })
    .transpose()
    .map_err(|e: sqlx::Error| e.into())
}

/// The `reconciler_stale` finding for `round` at `now_ms`, if the round is
/// missing (with events to reconcile) or older than the bound.
pub fn stale_reconciler_finding(round: Option<&ReconcilerRound>, committed_events: i64, stale_ms: i64) -> Option<Finding> {
    match round {
        None if committed_events > 0 => Some(Finding {
            kind: "reconciler_stale".into(),
            event_id: String::new(),
            consumer_id: None,
            age_ms: 0,
            detail: "no reconciler round recorded: nothing proves the outbox complete (run `outbox reconcile`)".into(),
        }),
        None => None,
        Some(r) => {
            let bound = stale_ms.max(r.interval_ms.saturating_mul(3));
            (r.age_ms > bound).then(|| Finding {
                kind: "reconciler_stale".into(),
                event_id: String::new(),
                consumer_id: None,
                age_ms: r.age_ms,
                detail: format!("last reconciler round by {} is older than {} ms: is the reconciler running?", r.owner, bound),
            })
        }
    }
}

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
    // In the exception lane and on the stream (`outbox_state_counts`).
    let state_counts: Vec<(String, i64)> = sqlx::query_as("SELECT state, n FROM outbox_state_counts() ORDER BY state").fetch_all(pool).await?;
    let committed_events = state_counts.iter().map(|(_, n)| n).sum();
    let publish_receipts = scalar("SELECT count(*) FROM outbox_publish_receipts").await?;
    let duplicate_receipts = scalar("SELECT count(*) FROM outbox_duplicate_receipts").await?;
    let oldest_pending = crate::pg::oldest_pending_created_ms(pool).await?;

    let unknown_since: Vec<i64> = sqlx::query_scalar(
        "SELECT unknown_since_ms FROM outbox_events
         WHERE unknown_since_ms IS NOT NULL AND state NOT IN ('PUBLISHED', 'RETAINED', 'PURGED', 'QUARANTINED', 'SKIPPED')",
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
    let last_reconciler_round = last_reconciler_round(pool, now).await?;
    let unknown_slo_ms = match &last_reconciler_round {
        Some(r) if opts.use_reconciler_slo => r.unknown_slo_ms,
        _ => opts.unknown_slo_ms,
    };
    let unknown_p99_resolution_ms: Option<i64> = row.try_get("p99")?;

    let mut consumed_by_critical = Vec::new();
    let mut consumer_lag = Vec::new();
    let watermarks = has_watermarks(pool).await?;
    let critical: Vec<(String, Vec<String>)> = sqlx::query_as("SELECT consumer_id, topics FROM outbox_consumers WHERE critical ORDER BY consumer_id").fetch_all(pool).await?;
    for (consumer_id, topics) in &critical {
        let wm_join = if watermarks {
            "LEFT JOIN outbox_consumer_watermarks w ON w.consumer_id = $1 AND w.cluster_id = r.cluster_id AND w.topic = r.topic AND w.partition = r.partition
                 AND w.topic_id IS NOT DISTINCT FROM r.topic_id"
        } else {
            "LEFT JOIN (SELECT NULL::text AS cluster_id, NULL::text AS topic, NULL::int AS partition, NULL::bigint AS committed_offset) w ON false"
        };
        let rows = sqlx::query(&format!(
            "SELECT r.cluster_id, r.topic, r.topic_id, r.partition, coalesce(max(w.committed_offset), 0) AS committed, max(r.\"offset\") + 1 AS end_offset,
                    count(*) FILTER (WHERE r.\"offset\" >= coalesce(w.committed_offset, 0)) AS lag,
                    count(*) FILTER (WHERE r.\"offset\" < coalesce(w.committed_offset, 0)) AS consumed
             FROM outbox_publish_receipts r {wm_join}
             WHERE r.topic = ANY($2)
             GROUP BY r.cluster_id, r.topic, r.topic_id, r.partition ORDER BY r.cluster_id, r.topic, r.partition, r.topic_id NULLS FIRST"
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
                topic_id: r.try_get("topic_id")?,
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

    let mut findings = sqlx::query("SELECT kind, event_id, consumer_id, age_ms, detail FROM outbox_findings WHERE resolved_at_ms IS NULL ORDER BY kind, first_seen_ms LIMIT $1")
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
    findings.extend(stale_reconciler_finding(last_reconciler_round.as_ref(), committed_events, opts.reconciler_stale_ms));
    // A finding names the event whose primary receipt's position was lost.
    let lost_logs = sqlx::query(
        "SELECT r.cluster_id, r.topic, r.topic_id, r.partition, count(*) AS receipts_lost, min(r.\"offset\") AS first_offset, max(r.\"offset\") AS last_offset
         FROM outbox_findings f JOIN outbox_publish_receipts r ON r.event_id = f.event_id
         WHERE f.kind = 'receipt_position_lost' AND f.resolved_at_ms IS NULL
         GROUP BY r.cluster_id, r.topic, r.topic_id, r.partition ORDER BY r.cluster_id, r.topic, r.topic_id, r.partition",
    )
    .fetch_all(pool)
    .await?
    .iter()
    .map(|r| {
        Ok(LostLog {
            cluster_id: r.try_get("cluster_id")?,
            topic: r.try_get("topic")?,
            topic_id: r.try_get("topic_id")?,
            partition: r.try_get("partition")?,
            receipts_lost: r.try_get("receipts_lost")?,
            first_offset: r.try_get("first_offset")?,
            last_offset: r.try_get("last_offset")?,
        })
    })
    .collect::<Result<Vec<_>, sqlx::Error>>()?;
    let open_past_slo = unknown_since.iter().filter(|since| now - **since > unknown_slo_ms).count() as i64;

    Ok(Report {
        unknown_slo_verdict: slo_verdict(unknown_p99_resolution_ms, open_past_slo, unknown_slo_ms),
        last_reconciler_round,
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
        unknown_slo_ms,
        consumer_lag,
        history,
        findings,
        lost_logs,
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

/// The one SLO verdict: missed when the p99 of the resolutions exceeds the
/// SLO or any open UNKNOWN is older than it; `n/a` when nothing was resolved
/// (and nothing is past it); met otherwise.
pub fn slo_verdict(p99_ms: Option<i64>, open_past_slo: i64, slo_ms: i64) -> SloVerdict {
    match p99_ms {
        _ if open_past_slo > 0 => SloVerdict::Missed,
        Some(p) if p > slo_ms => SloVerdict::Missed,
        Some(_) => SloVerdict::Met,
        None => SloVerdict::NotApplicable,
    }
}

impl Report {
    /// Whether the UNKNOWN SLO is not missed (true for `met` and `n/a`; see
    /// [`Report::unknown_slo_verdict`] for the three-way answer).
    pub fn unknown_slo_met(&self) -> bool {
        self.unknown_slo_verdict != SloVerdict::Missed
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
            self.unknown_slo_verdict.as_str()
        );
        match &self.last_reconciler_round {
            None => {
                let _ = writeln!(out, "  last reconciler round     never");
            }
            Some(r) => {
                let _ = writeln!(out, "  last reconciler round     {} ago by {} on cluster {} ({} rounds)", ms(r.age_ms), r.owner, r.cluster_id, r.rounds);
            }
        }
        for l in &self.consumer_lag {
            let of_id = l.topic_id.as_deref().map(|id| format!(" (topic id {id})")).unwrap_or_default();
            let _ = writeln!(
                out,
                "  lag {} {}/{}{of_id}/{}: committed {} of {} ({} behind)",
                l.consumer_id, l.cluster_id, l.topic, l.partition, l.committed_offset, l.published_end_offset, l.lag_events
            );
        }
        for c in &self.consumer_decisions {
            let _ = writeln!(out, "  consumer {} {}", c.consumer_id, c.describe());
        }
        for l in &self.lost_logs {
            let of_id = l.topic_id.as_deref().map(|id| format!(" (topic id {id})")).unwrap_or_default();
            let _ = writeln!(
                out,
                "  lost log {}/{}{of_id}/{}: {} receipts (offsets {}..{}) no longer hold their events (receipt_position_lost; docs/OPERATIONS.md §6)",
                l.cluster_id, l.topic, l.partition, l.receipts_lost, l.first_offset, l.last_offset
            );
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
