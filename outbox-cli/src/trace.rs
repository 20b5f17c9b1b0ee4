//! `outbox trace <eventId>`: one event's whole life, from the frozen
//! envelope to every consumer's receipt.

use std::fmt::Write as _;

use outbox_core::{Destination, Envelope};
use serde::Serialize;
use serde_json::Value;
use sqlx::postgres::PgRow;
use sqlx::{PgPool, Row};

use crate::fmt::ts;

/// One envelope generation with its frozen destination.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EnvelopeRecord {
    /// Generation.
    pub generation: i32,
    /// The decoded envelope (None if it does not decode).
    pub envelope: Option<Envelope>,
    /// Decoding error, if any.
    pub envelope_error: Option<String>,
    /// Stored envelope digest.
    pub envelope_digest: String,
    /// Whether sha256 of the canonical envelope equals the stored digest.
    pub envelope_digest_ok: bool,
    /// The decoded destination.
    pub destination: Option<Destination>,
    /// Decoding error, if any.
    pub destination_error: Option<String>,
    /// Stored destination digest.
    pub destination_digest: String,
    /// Whether sha256 of the canonical destination equals the stored digest.
    pub destination_digest_ok: bool,
    /// Creating transaction id.
    pub created_txid: i64,
    /// When frozen, ms.
    pub created_at_ms: i64,
}

/// One dispatch attempt.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AttemptRecord {
    /// Attempt id (sent as a header).
    pub attempt_id: String,
    /// Envelope generation.
    pub envelope_generation: i32,
    /// Attempt generation (1, 2, ...).
    pub attempt_generation: i32,
    /// Claim generation that registered it.
    pub claim_generation: i64,
    /// Claim owner (dispatcher worker or reconciler).
    pub owner: String,
    /// SENDING, UNKNOWN, ACKED, NOT_SENT, ABSENT.
    pub state: String,
    /// Started, ms.
    pub started_at_ms: i64,
    /// Finished, ms.
    pub finished_at_ms: Option<i64>,
    /// Lower bound of a lookup scan.
    pub scan_from_offset: i64,
    /// The event whose receipt held the offset below that bound when the
    /// attempt was registered (how a lookup recognises the bound's log).
    pub scan_anchor_event_id: Option<String>,
    /// Detail (reason of UNKNOWN / NOT_SENT...).
    pub detail: Option<String>,
}

/// A broker receipt (primary or duplicate).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ReceiptRecord {
    /// Envelope generation.
    pub envelope_generation: i32,
    /// Attempt acknowledged.
    pub attempt_id: String,
    /// Cluster.
    pub cluster_id: String,
    /// Topic.
    pub topic: String,
    /// The topic id of the log (from the destination the message names;
    /// `None`: destination.v1).
    pub topic_id: Option<String>,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// Payload digest of the receipt.
    pub payload_digest: String,
    /// Destination digest of the receipt.
    pub destination_digest: String,
    /// Accepted (primary) or received (duplicate), ms.
    pub at_ms: i64,
}

/// One consumer's receipt of the event.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConsumerReceiptRecord {
    /// Consumer.
    pub consumer_id: String,
    /// Envelope generation consumed.
    pub envelope_generation: i32,
    /// Where it was read.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// The handler's recorded result.
    pub result: Value,
    /// When, RFC 3339.
    pub received_at: String,
}

/// Whether a declared consumer's watermark (in the outbox database: copied
/// there, or published over the broker and applied by the reconciler) has
/// passed the event's log position.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ConsumerWatermarkRecord {
    /// Consumer, as declared in `outbox_consumers`.
    pub consumer_id: String,
    /// `passed` (every message up to the event's offset is decided: consumed,
    /// a duplicate, quarantined or dead-lettered), `not_yet`, `no_watermark`,
    /// `not_its_topic`, or `not_published`.
    pub verdict: String,
    /// The consumer's committed offset on the event's log, if any.
    pub committed_offset: Option<i64>,
    /// When the consumer last moved that watermark, RFC 3339 (its clock).
    pub updated_at: Option<String>,
}

/// The whole trace.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Trace {
    /// Event id.
    pub event_id: String,
    /// The event row (claim, clocks, placement), as JSON.
    pub event: Value,
    /// Every envelope generation.
    pub envelopes: Vec<EnvelopeRecord>,
    /// Every attempt.
    pub attempts: Vec<AttemptRecord>,
    /// Primary receipts (the publish slot, one per generation at most).
    pub primary_receipts: Vec<ReceiptRecord>,
    /// Duplicate transport receipts (evidence).
    pub duplicate_receipts: Vec<ReceiptRecord>,
    /// Quarantine records.
    pub quarantine: Vec<Value>,
    /// Audit records (stale writes, refused receipts, operator actions).
    pub audit: Vec<Value>,
    /// UNKNOWN resolutions.
    pub unknown_resolutions: Vec<Value>,
    /// Destination migration receipts.
    pub migrations: Vec<Value>,
    /// Reconciler findings about it (open and resolved).
    pub findings: Vec<Value>,
    /// Consumption receipts, when this database has the consumer tables.
    pub consumer_receipts: Option<Vec<ConsumerReceiptRecord>>,
    /// Consumer-side quarantine and dead letters of this eventId.
    pub consumer_problems: Vec<Value>,
    /// Where the consumer side was read: the outbox database and each `--consumer-database-url`.
    pub consumer_sources: Vec<String>,
    /// Per declared consumer: whether its watermark passed the event.
    pub consumer_watermarks: Vec<ConsumerWatermarkRecord>,
}

async fn exists(pool: &PgPool, table: &str) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL").bind(table).fetch_one(pool).await
}

/// Rows of `sql` (with `$1` = event id) as JSON objects, if `table` exists.
async fn json_rows(pool: &PgPool, table: &str, sql: &str, event_id: &str) -> Result<Vec<Value>, sqlx::Error> {
    if !exists(pool, table).await? {
        return Ok(Vec::new());
    }
    let rows: Vec<Value> = sqlx::query_scalar(&format!("SELECT to_jsonb(t) FROM ({sql}) t")).bind(event_id).fetch_all(pool).await?;
    Ok(rows)
}

/// The receipts of one event in `table` (primary or duplicate), with the
/// time column `at_column`, in `order_by` order.
async fn receipts_of(pool: &PgPool, table: &str, at_column: &str, order_by: &str, event_id: &str) -> Result<Vec<ReceiptRecord>, sqlx::Error> {
    let rows = sqlx::query(&format!(
        r#"SELECT envelope_generation, attempt_id, cluster_id, topic, topic_id, partition, "offset", payload_digest, destination_digest, {at_column}
           FROM {table} WHERE event_id = $1 ORDER BY {order_by}"#
    ))
    .bind(event_id)
    .fetch_all(pool)
    .await?;
    Ok(rows.iter().map(|r| receipt(r, at_column)).collect())
}

fn receipt(r: &PgRow, at: &str) -> ReceiptRecord {
    ReceiptRecord {
        envelope_generation: r.get("envelope_generation"),
        attempt_id: r.get("attempt_id"),
        cluster_id: r.get("cluster_id"),
        topic: r.get("topic"),
        topic_id: r.get("topic_id"),
        partition: r.get("partition"),
        offset: r.get("offset"),
        payload_digest: r.get("payload_digest"),
        destination_digest: r.get("destination_digest"),
        at_ms: r.get(at),
    }
}

/// Reads the trace; `None` if no such event.
pub async fn trace(pool: &PgPool, event_id: &str) -> Result<Option<Trace>, sqlx::Error> {
    let event: Option<Value> = sqlx::query_scalar(
        "SELECT to_jsonb(t) FROM (SELECT event_id, command_key, state, envelope_generation, tenant, aggregate_type, aggregate_id, aggregate_version,
                event_type, traceparent, octet_length(payload) AS payload_bytes, payload_digest, destination_digest, cluster_id, topic, partition,
                routing_key, ordered, claim_owner, claim_generation, lease_until_ms, claim_attempt_id, attempt_generation, created_at_ms,
                state_since_ms, next_check_at_ms, unknown_since_ms, published_at_ms, seq
         FROM outbox_events WHERE event_id = $1) t",
    )
    .bind(event_id)
    .fetch_optional(pool)
    .await?;
    // An event of the stream path with no row in the exception lane: its
    // stream row, its state as every reader reads it (`outbox_event_state`).
    let on_stream = event.is_none();
    let event = match event {
        Some(e) => e,
        None => {
            let stream: Option<Value> = sqlx::query_scalar(
                "SELECT to_jsonb(t) FROM (SELECT event_id, command_key, outbox_event_state(event_id) AS state, 1 AS envelope_generation, tenant, aggregate_type,
                        aggregate_id, aggregate_version, event_type, traceparent, octet_length(payload) AS payload_bytes, payload_digest, destination_digest,
                        cluster_id, topic, partition, routing_key, ordered, created_at_ms, seq, bucket, 'stream' AS path
                 FROM outbox_stream WHERE event_id = $1) t",
            )
            .bind(event_id)
            .fetch_optional(pool)
            .await?;
            let Some(e) = stream else { return Ok(None) };
            e
        }
    };

    let mut envelopes = Vec::new();
    for r in sqlx::query(if on_stream {
        "SELECT 1 AS envelope_generation, envelope_canonical, envelope_digest, destination_canonical, destination_digest, created_txid, created_at_ms
         FROM outbox_stream WHERE event_id = $1"
    } else {
        "SELECT envelope_generation, envelope_canonical, envelope_digest, destination_canonical, destination_digest, created_txid, created_at_ms
         FROM outbox_envelopes WHERE event_id = $1 ORDER BY envelope_generation"
    })
    .bind(event_id)
    .fetch_all(pool)
    .await?
    {
        let env_bytes: Vec<u8> = r.get("envelope_canonical");
        let dest_bytes: Vec<u8> = r.get("destination_canonical");
        let envelope_digest: String = r.get("envelope_digest");
        let destination_digest: String = r.get("destination_digest");
        let (envelope, envelope_error) = match Envelope::from_canonical(&env_bytes) {
            Ok(e) => (Some(e), None),
            Err(e) => (None, Some(e.to_string())),
        };
        let (destination, destination_error) = match Destination::from_canonical(&dest_bytes) {
            Ok(d) => (Some(d), None),
            Err(e) => (None, Some(e.to_string())),
        };
        envelopes.push(EnvelopeRecord {
            generation: r.get("envelope_generation"),
            envelope_digest_ok: outbox_core::sha256_digest(&env_bytes) == envelope_digest,
            destination_digest_ok: outbox_core::sha256_digest(&dest_bytes) == destination_digest,
            envelope,
            envelope_error,
            envelope_digest,
            destination,
            destination_error,
            destination_digest,
            created_txid: r.get("created_txid"),
            created_at_ms: r.get("created_at_ms"),
        });
    }

    let attempts = if on_stream { stream_attempts(pool, event_id).await? } else { lane_attempts(pool, event_id).await? };

    let primary_receipts = receipts_of(pool, "outbox_publish_receipts", "accepted_at_ms", "envelope_generation", event_id).await?;

    let duplicate_receipts = receipts_of(pool, "outbox_duplicate_receipts", "received_at_ms", "id", event_id).await?;

    let quarantine = json_rows(pool, "outbox_quarantine", "SELECT * FROM outbox_quarantine WHERE event_id = $1 ORDER BY id", event_id).await?;
    let audit = json_rows(pool, "outbox_audit", "SELECT * FROM outbox_audit WHERE event_id = $1 ORDER BY id", event_id).await?;
    let unknown_resolutions =
        json_rows(pool, "outbox_unknown_resolutions", "SELECT * FROM outbox_unknown_resolutions WHERE event_id = $1 ORDER BY id", event_id).await?;
    let migrations = json_rows(pool, "outbox_migration_receipts", "SELECT * FROM outbox_migration_receipts WHERE event_id = $1 ORDER BY id", event_id).await?;
    let findings = json_rows(pool, "outbox_findings", "SELECT * FROM outbox_findings WHERE event_id = $1 ORDER BY id", event_id).await?;

    let (consumer_receipts, consumer_problems) = consumer_side(pool, event_id).await?;
    let consumer_watermarks = consumer_watermarks(pool, event_id).await?;

    Ok(Some(Trace {
        event_id: event_id.to_owned(),
        event,
        envelopes,
        attempts,
        primary_receipts,
        duplicate_receipts,
        quarantine,
        audit,
        unknown_resolutions,
        migrations,
        findings,
        consumer_receipts,
        consumer_problems,
        consumer_sources: vec!["the outbox database".into()],
        consumer_watermarks,
    }))
}

/// The attempts of an event in the exception lane: its rows of `outbox_attempts`.
async fn lane_attempts(pool: &PgPool, event_id: &str) -> Result<Vec<AttemptRecord>, sqlx::Error> {
    Ok(sqlx::query(
        "SELECT attempt_id, envelope_generation, attempt_generation, claim_generation, owner, state, started_at_ms, finished_at_ms, scan_from_offset, scan_anchor_event_id, detail
         FROM outbox_attempts WHERE event_id = $1 ORDER BY attempt_generation",
    )
    .bind(event_id)
    .fetch_all(pool)
    .await?
    .iter()
    .map(|r| AttemptRecord {
        attempt_id: r.get("attempt_id"),
        envelope_generation: r.get("envelope_generation"),
        attempt_generation: r.get("attempt_generation"),
        claim_generation: r.get("claim_generation"),
        owner: r.get("owner"),
        state: r.get("state"),
        started_at_ms: r.get("started_at_ms"),
        finished_at_ms: r.get("finished_at_ms"),
        scan_from_offset: r.get("scan_from_offset"),
        scan_anchor_event_id: r.get("scan_anchor_event_id"),
        detail: r.get("detail"),
    })
    .collect())
}

/// The attempt of a stream event with no lane row: the one its batch
/// registered (ACKED once its receipt fills the slot), as the store reads it.
async fn stream_attempts(pool: &PgPool, event_id: &str) -> Result<Vec<AttemptRecord>, sqlx::Error> {
    use outbox_core::OutboxStore;
    let Ok(id) = event_id.parse::<outbox_core::EventId>() else { return Ok(Vec::new()) };
    let store = outbox_producer::PgStore::new(pool.clone());
    let attempts = store.attempts(&id).await.map_err(|e| sqlx::Error::Protocol(format!("the stream event's attempt: {e}")))?;
    Ok(attempts
        .into_iter()
        .map(|a| AttemptRecord {
            attempt_id: a.attempt_id.to_string(),
            envelope_generation: a.envelope_generation as i32,
            attempt_generation: a.attempt_generation as i32,
            claim_generation: a.claim_generation as i64,
            owner: a.owner,
            state: a.state.to_string(),
            started_at_ms: a.started_at_ms,
            finished_at_ms: None,
            scan_from_offset: a.scan_from_offset,
            scan_anchor_event_id: a.scan_anchor.map(|e| e.to_string()),
            detail: None,
        })
        .collect())
}

/// The consumer side of one event in one database: its consumption
/// receipts (None without the consumer tables) and its consumer quarantine
/// and dead-letter rows.
pub async fn consumer_side(pool: &PgPool, event_id: &str) -> Result<(Option<Vec<ConsumerReceiptRecord>>, Vec<Value>), sqlx::Error> {
    let consumer_receipts = if exists(pool, "outbox_consumer_receipts").await? {
        Some(
            sqlx::query(
                r#"SELECT consumer_id, envelope_generation, topic, partition, "offset", result, to_char(received_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') AS received_at
                   FROM outbox_consumer_receipts WHERE event_id = $1 ORDER BY received_at, consumer_id"#,
            )
            .bind(event_id)
            .fetch_all(pool)
            .await?
            .iter()
            .map(|r| ConsumerReceiptRecord {
                consumer_id: r.get("consumer_id"),
                envelope_generation: r.get("envelope_generation"),
                topic: r.get("topic"),
                partition: r.get("partition"),
                offset: r.get("offset"),
                result: r.get("result"),
                received_at: r.get("received_at"),
            })
            .collect(),
        )
    } else {
        None
    };
    let mut consumer_problems = json_rows(
        pool,
        "outbox_consumer_quarantine",
        r#"SELECT 'quarantined' AS kind, consumer_id, topic, partition, "offset", reason, evidence, quarantined_at FROM outbox_consumer_quarantine WHERE event_id = $1 ORDER BY id"#,
        event_id,
    )
    .await?;
    consumer_problems.extend(
        json_rows(
            pool,
            "outbox_consumer_dead_letters",
            r#"SELECT 'dead_lettered' AS kind, consumer_id, topic, partition, "offset", attempts, last_error, dead_lettered_at FROM outbox_consumer_dead_letters WHERE event_id = $1"#,
            event_id,
        )
        .await?,
    );

    Ok((consumer_receipts, consumer_problems))
}

impl Trace {
    /// Adds what the consumers' own database `source` holds about this event.
    pub async fn add_consumer_database(&mut self, pool: &PgPool, source: &str) -> Result<(), sqlx::Error> {
        let (receipts, problems) = consumer_side(pool, &self.event_id).await?;
        if let Some(rs) = receipts {
            self.consumer_receipts.get_or_insert_with(Vec::new).extend(rs);
        }
        self.consumer_problems.extend(problems);
        self.consumer_sources.push(source.to_owned());
        Ok(())
    }
}

/// Per declared consumer, whether its watermark passed the event's primary
/// receipt (cluster, topic, topic id, partition, offset of the current
/// generation): its watermark of that very log, the topic id matched exactly.
async fn consumer_watermarks(pool: &PgPool, event_id: &str) -> Result<Vec<ConsumerWatermarkRecord>, sqlx::Error> {
    if !exists(pool, "outbox_consumers").await? {
        return Ok(Vec::new());
    }
    let position: Option<(String, String, Option<String>, i32, i64)> = sqlx::query_as(
        r#"SELECT r.cluster_id, r.topic, r.topic_id, r.partition, r."offset" FROM outbox_events e
           JOIN outbox_publish_receipts r ON r.event_id = e.event_id AND r.envelope_generation = e.envelope_generation WHERE e.event_id = $1"#,
    )
    .bind(event_id)
    .fetch_optional(pool)
    .await?;
    let has_watermarks = exists(pool, "outbox_consumer_watermarks").await?;
    let consumers: Vec<(String, Vec<String>)> = sqlx::query_as("SELECT consumer_id, topics FROM outbox_consumers ORDER BY consumer_id LIMIT 1000").fetch_all(pool).await?;
    let mut out = Vec::with_capacity(consumers.len());
    for (consumer_id, topics) in consumers {
        let mut rec = ConsumerWatermarkRecord { consumer_id, verdict: String::new(), committed_offset: None, updated_at: None };
        rec.verdict = match &position {
            None => "not_published".into(),
            Some((_, topic, ..)) if !topics.contains(topic) => "not_its_topic".into(),
            Some(_) if !has_watermarks => "no_watermark".into(),
            Some((cluster, topic, topic_id, partition, offset)) => {
                let w: Option<(i64, String)> = sqlx::query_as(
                    r#"SELECT committed_offset, to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') FROM outbox_consumer_watermarks
                       WHERE consumer_id = $1 AND cluster_id = $2 AND topic = $3 AND partition = $4 AND topic_id IS NOT DISTINCT FROM $5"#,
                )
                .bind(&rec.consumer_id)
                .bind(cluster)
                .bind(topic)
                .bind(partition)
                .bind(topic_id)
                .fetch_optional(pool)
                .await?;
                match w {
                    None => "no_watermark".into(),
                    Some((committed, at)) => {
                        rec.committed_offset = Some(committed);
                        rec.updated_at = Some(at);
                        if committed > *offset { "passed".into() } else { "not_yet".into() }
                    }
                }
            }
        };
        out.push(rec);
    }
    Ok(out)
}

fn opt_ts(v: &Value) -> String {
    v.as_i64().map(ts).unwrap_or_else(|| "-".into())
}

fn compact(v: &Value) -> String {
    match v {
        Value::Object(m) => m.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| format!("{k}={}", v.to_string().trim_matches('"'))).collect::<Vec<_>>().join(" "),
        other => other.to_string(),
    }
}

impl Trace {
    /// Plain text for a terminal.
    pub fn to_text(&self) -> String {
        let e = &self.event;
        let s = |k: &str| e.get(k).map(|v| v.to_string().trim_matches('"').to_owned()).unwrap_or_default();
        let mut o = String::new();
        let _ = writeln!(o, "event {}", self.event_id);
        let _ = writeln!(o, "  state              {} since {}", s("state"), opt_ts(&e["state_since_ms"]));
        let _ = writeln!(o, "  command key        {}", s("command_key"));
        let _ = writeln!(o, "  aggregate          {}/{}@{}  type {}  tenant {}", s("aggregate_type"), s("aggregate_id"), s("aggregate_version"), s("event_type"), s("tenant"));
        let _ = writeln!(o, "  committed          {}", opt_ts(&e["created_at_ms"]));
        let _ = writeln!(o, "  envelope gen       {}  attempt gen {}", s("envelope_generation"), s("attempt_generation"));
        let _ = writeln!(o, "  payload            {} bytes  {}", if e["payload_bytes"].is_null() { "purged:".into() } else { s("payload_bytes") }, s("payload_digest"));
        let _ = writeln!(o, "  routes to          {}/{}/{} key {}", s("cluster_id"), s("topic"), s("partition"), s("routing_key"));
        if !e["claim_owner"].is_null() {
            let _ = writeln!(o, "  claim              owner {} generation {} lease until {} attempt {}", s("claim_owner"), s("claim_generation"), opt_ts(&e["lease_until_ms"]), s("claim_attempt_id"));
        } else {
            let _ = writeln!(o, "  claim              none (claim generation {})", s("claim_generation"));
        }
        if !e["unknown_since_ms"].is_null() {
            let _ = writeln!(o, "  UNKNOWN since      {} (next check {})", opt_ts(&e["unknown_since_ms"]), opt_ts(&e["next_check_at_ms"]));
        }
        if !e["published_at_ms"].is_null() {
            let _ = writeln!(o, "  published          {}", opt_ts(&e["published_at_ms"]));
        }
        if !e["traceparent"].is_null() {
            let _ = writeln!(o, "  traceparent        {}", s("traceparent"));
        }
        for v in &self.envelopes {
            let _ = writeln!(o, "envelope generation {} frozen {} (txid {})", v.generation, ts(v.created_at_ms), v.created_txid);
            match &v.envelope {
                Some(env) => {
                    let _ = writeln!(
                        o,
                        "  outboxEnvelope.v1  aggregate {}/{}@{} type {} payloadSchema {} payloadDigest {} occurredAt {}",
                        env.aggregate_type, env.aggregate_id, env.aggregate_version, env.event_type, env.payload_schema, env.payload_digest, ts(env.occurred_at_ms)
                    );
                }
                None => {
                    let _ = writeln!(o, "  envelope DOES NOT DECODE: {}", v.envelope_error.as_deref().unwrap_or("?"));
                }
            }
            let _ = writeln!(o, "  envelope digest    {} {}", v.envelope_digest, if v.envelope_digest_ok { "(verified)" } else { "(MISMATCH)" });
            match &v.destination {
                Some(d) => {
                    let _ = writeln!(
                        o,
                        "  {:<19}{}/{}{} partition {} of {} key {} ({}) route {}@{} serializer {} acks {} ordering {}",
                        d.schema(),
                        d.cluster_id,
                        d.topic,
                        d.topic_id.as_deref().map(|id| format!(" (topic id {id})")).unwrap_or_default(),
                        d.partition,
                        d.partitions,
                        d.routing_key,
                        d.partitioner.as_str(),
                        d.route_policy,
                        d.route_policy_generation,
                        d.serializer,
                        d.required_acks,
                        d.ordering.as_str()
                    );
                }
                None => {
                    let _ = writeln!(o, "  destination DOES NOT DECODE: {}", v.destination_error.as_deref().unwrap_or("?"));
                }
            }
            let _ = writeln!(o, "  destination digest {} {}", v.destination_digest, if v.destination_digest_ok { "(verified)" } else { "(MISMATCH)" });
        }
        let _ = writeln!(o, "attempts: {}", self.attempts.len());
        for a in &self.attempts {
            let _ = writeln!(
                o,
                "  #{} {} gen {} owner {} claim generation {} {} started {}{}{}",
                a.attempt_generation,
                a.attempt_id,
                a.envelope_generation,
                a.owner,
                a.claim_generation,
                a.state,
                ts(a.started_at_ms),
                a.finished_at_ms.map(|f| format!(" finished {}", ts(f))).unwrap_or_default(),
                a.detail.as_deref().map(|d| format!(" ({d})")).unwrap_or_default()
            );
        }
        let rec = |o: &mut String, label: &str, r: &ReceiptRecord| {
            let _ = writeln!(
                o,
                "  {label} gen {} {}/{}{} partition {} offset {} attempt {} at {}",
                r.envelope_generation,
                r.cluster_id,
                r.topic,
                r.topic_id.as_deref().map(|id| format!(" (topic id {id})")).unwrap_or_default(),
                r.partition,
                r.offset,
                r.attempt_id,
                ts(r.at_ms)
            );
        };
        if self.primary_receipts.is_empty() {
            let _ = writeln!(o, "publish receipt: none (publish slot empty)");
        } else {
            let _ = writeln!(o, "publish receipt:");
            for r in &self.primary_receipts {
                rec(&mut o, "primary  ", r);
            }
        }
        for r in &self.duplicate_receipts {
            rec(&mut o, "duplicate", r);
        }
        for (label, rows) in [
            ("quarantine", &self.quarantine),
            ("unknown resolution", &self.unknown_resolutions),
            ("migration", &self.migrations),
            ("finding", &self.findings),
            ("audit", &self.audit),
            ("consumer problem", &self.consumer_problems),
        ] {
            for r in rows.iter() {
                let _ = writeln!(o, "{label}: {}", compact(r));
            }
        }
        match &self.consumer_receipts {
            None => {
                let _ = writeln!(
                    o,
                    "consumers: no outbox_consumer_receipts table in {} (the receipts live in the consumer's database: pass --consumer-database-url)",
                    self.consumer_sources.join(", ")
                );
            }
            Some(rs) if rs.is_empty() => {
                let _ = writeln!(o, "consumers: no consumption receipt yet (looked in {})", self.consumer_sources.join(", "));
            }
            Some(rs) => {
                let _ = writeln!(o, "consumers: {}", rs.len());
                for r in rs {
                    let _ = writeln!(o, "  {} consumed gen {} at {}/{} offset {} on {} result {}", r.consumer_id, r.envelope_generation, r.topic, r.partition, r.offset, r.received_at, r.result);
                }
            }
        }
        if !self.consumer_watermarks.is_empty() {
            let _ = writeln!(o, "declared consumers' watermarks:");
            for w in &self.consumer_watermarks {
                let at = match (w.committed_offset, &w.updated_at) {
                    (Some(c), Some(t)) => format!(" (committed offset {c}, moved {t})"),
                    _ => String::new(),
                };
                let _ = writeln!(o, "  {} {}{at}", w.consumer_id, w.verdict);
            }
        }
        o
    }
}
