//! The runbook's commands: `route`, `dead-letters`, `findings`, `unknown`.

use anyhow::{bail, Context};
use outbox_core::{EventId, Ordering, RoutePolicy};
use serde::Serialize;
use serde_json::json;
use sqlx::{PgPool, Row};

use crate::fmt::{age, json as to_json, ts};

/// Most rows any listing prints.
pub const MAX_ROWS: i64 = 10_000;

fn check_limit(limit: i64) -> anyhow::Result<()> {
    if !(1..=MAX_ROWS).contains(&limit) {
        bail!("--limit {limit}: 1..={MAX_ROWS}");
    }
    Ok(())
}

/// What the cluster says about a route's topic.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TopicCheck {
    /// The connected cluster's id.
    pub connected_cluster_id: String,
    /// The topic's partition count in the cluster's metadata (None: unknown topic or metadata error).
    pub topic_partitions: Option<u32>,
    /// The topic's id in the cluster now (None: no ids, or not read).
    pub topic_id: Option<String>,
    /// The metadata error, if any.
    pub error: Option<String>,
    /// Whether the route agrees with the cluster (same cluster, same
    /// partition count, and the same topic id when the route names one).
    pub ok: bool,
}

/// Checks `route` against what `broker` reports.
pub async fn check_topic(broker: &outbox_producer::KafkaBroker, route: &RoutePolicy) -> TopicCheck {
    let connected = broker.cluster_id().to_owned();
    let (topic_partitions, mut error) = match broker.partition_count(&route.topic).await {
        Ok(n) => (Some(n), None),
        Err(e) => (None, Some(e.to_string())),
    };
    let topic_id = if error.is_none() {
        match broker.topic_id(&route.topic).await {
            Ok(id) => id,
            Err(e) => {
                error = Some(format!("reading the topic id: {e}"));
                None
            }
        }
    } else {
        None
    };
    let same_identity = route.topic_id.is_none() || route.topic_id == topic_id;
    let ok = connected == route.cluster_id && topic_partitions == Some(route.partitions) && error.is_none() && same_identity;
    TopicCheck { connected_cluster_id: connected, topic_partitions, topic_id, error, ok }
}

fn route_line(r: &RoutePolicy) -> String {
    format!(
        "{} generation {}: cluster {} topic {} partitions {} key {} partitioner {} ordering {} acks {}{}",
        r.event_type,
        r.generation,
        r.cluster_id,
        r.topic,
        r.partitions,
        r.key_template,
        r.partitioner.as_str(),
        r.ordering.as_str(),
        r.required_acks,
        r.topic_id.as_deref().map(|id| format!(" topic-id {id}")).unwrap_or_default()
    )
}

fn check_line(r: &RoutePolicy, c: &TopicCheck) -> String {
    match (&c.error, c.topic_partitions) {
        _ if c.connected_cluster_id != r.cluster_id => {
            format!("check: connected to cluster {}, the route names {}: not checked against its cluster", c.connected_cluster_id, r.cluster_id)
        }
        (Some(e), _) => format!("check: MISMATCH: topic {} on cluster {}: {e}", r.topic, c.connected_cluster_id),
        (None, Some(_)) if r.topic_id.is_some() && r.topic_id != c.topic_id => format!(
            "check: MISMATCH: topic {} on cluster {} has id {}, the route names id {}: the topic was recreated (set the route again to route new events to it)",
            r.topic,
            c.connected_cluster_id,
            c.topic_id.as_deref().unwrap_or("none"),
            r.topic_id.as_deref().unwrap_or("none")
        ),
        (None, Some(n)) if n == r.partitions => format!("check: ok, topic {} has {n} partitions on cluster {}", r.topic, c.connected_cluster_id),
        (None, Some(n)) => format!("check: MISMATCH: topic {} has {n} partitions on cluster {}, the route says {}", r.topic, c.connected_cluster_id, r.partitions),
        (None, None) => "check: no answer".into(),
    }
}

/// `outbox route set`: returns the exit code.
pub async fn route_set(pool: &PgPool, broker: Option<&outbox_producer::KafkaBroker>, a: &crate::cli::RouteSetArgs) -> anyhow::Result<u8> {
    let cluster_id = match (&a.cluster_id, broker) {
        (Some(c), _) => c.clone(),
        (None, Some(b)) => b.cluster_id().to_owned(),
        (None, None) => bail!("--cluster-id is required without a Kafka connection (--kafka-bootstrap or OUTBOX_KAFKA_BOOTSTRAP)"),
    };
    let mut policy = RoutePolicy::new(&a.event_type, &cluster_id, &a.topic, a.partitions);
    if let Some(t) = &a.key_template {
        policy.key_template = t.clone();
    }
    if let Some(o) = &a.ordering {
        policy.ordering = Ordering::parse(o).map_err(|e| anyhow::anyhow!("--ordering: {e} (key or none)"))?;
    }
    policy.validate().context("the route")?;
    let check = match broker {
        Some(b) => {
            let c = check_topic(b, &policy).await;
            if b.cluster_id() != policy.cluster_id {
                bail!("connected to cluster {}, but --cluster-id is {}: connect to the route's cluster to check it (or pass --no-check)", b.cluster_id(), policy.cluster_id);
            }
            if !c.ok {
                bail!("{}; nothing changed (fix the topic or --partitions, or pass --no-check)", check_line(&policy, &c));
            }
            // The topic's identity as the cluster reports it now: a route
            // revision that sees another id for the same name (the topic was
            // recreated) is a new generation.
            policy.topic_id = c.topic_id.clone();
            Some(c)
        }
        None => None,
    };
    let ensured = outbox_producer::routes::ensure(pool, &policy).await?;
    if a.json {
        println!("{}", to_json(&json!({ "route": ensured.policy, "revised": ensured.revised, "check": check }))?);
    } else {
        println!("{} {}", if ensured.revised { "new route" } else { "unchanged" }, route_line(&ensured.policy));
        match &check {
            Some(c) => println!("{}", check_line(&ensured.policy, c)),
            None => println!("check: skipped (--no-check): the partition count was not compared with the topic"),
        }
    }
    Ok(0)
}

/// `outbox route show`.
pub async fn route_show(pool: &PgPool, broker: Option<&outbox_producer::KafkaBroker>, event_type: &str, as_json: bool) -> anyhow::Result<u8> {
    let Some(r) = outbox_producer::routes::current(pool, event_type).await? else { bail!("no route for event type {event_type} (set one with `outbox route set`)") };
    let check = match broker {
        Some(b) => Some(check_topic(b, &r).await),
        None => None,
    };
    if as_json {
        println!("{}", to_json(&json!({ "route": r, "check": check }))?);
    } else {
        println!("{}", route_line(&r));
        match &check {
            Some(c) => println!("{}", check_line(&r, c)),
            None => println!("check: not connected to Kafka (pass --kafka-bootstrap to see the cluster id and check the partitions)"),
        }
    }
    Ok(if check.is_some_and(|c| !c.ok && c.connected_cluster_id == r.cluster_id) { crate::commands::EXIT_FINDINGS } else { 0 })
}

/// `outbox route list`.
pub async fn route_list(pool: &PgPool, as_json: bool) -> anyhow::Result<u8> {
    let routes = outbox_producer::routes::list(pool).await?;
    if as_json {
        println!("{}", to_json(&json!({ "routes": routes }))?);
    } else if routes.is_empty() {
        println!("no routes (set one with `outbox route set`)");
    } else {
        for r in &routes {
            println!("{}", route_line(r));
        }
    }
    Ok(0)
}

/// `outbox dead-letters list`.
pub async fn dead_letters_list(pool: &PgPool, consumer: Option<&str>, limit: i64, as_json: bool) -> anyhow::Result<u8> {
    check_limit(limit)?;
    let rows = outbox_consumer::list_dead_letters(pool, consumer, limit).await.context("reading dead letters (is this the consumer's database?)")?;
    if as_json {
        println!("{}", to_json(&json!({ "deadLetters": rows }))?);
        return Ok(0);
    }
    if rows.is_empty() {
        println!("no dead letters");
    }
    for d in &rows {
        println!(
            "{}\t{}\t{}\t{}/{}@{}\tattempts {}\tat {}{}\t{}",
            d.consumer_id,
            d.event_id,
            d.event_type,
            d.topic,
            d.partition,
            d.offset,
            d.attempts,
            d.dead_lettered_at,
            d.requeue_requested_at_ms.map(|t| format!("\trequeue requested {}", ts(t))).unwrap_or_default(),
            d.last_error.lines().next().unwrap_or("")
        );
    }
    Ok(0)
}

/// `outbox gaps list`.
pub async fn gaps_list(pool: &PgPool, consumer: Option<&str>, all: bool, limit: i64, as_json: bool) -> anyhow::Result<u8> {
    check_limit(limit)?;
    let rows = outbox_consumer::list_gaps(pool, consumer, all, limit).await.context("reading gaps (is this the consumer's database?)")?;
    if as_json {
        println!("{}", to_json(&json!({ "gaps": rows }))?);
        return Ok(0);
    }
    if rows.is_empty() {
        println!("{}", if all { "no gaps" } else { "no open gaps" });
    }
    for g in &rows {
        let state = match (&g.closed_at, &g.closed_by, &g.close_reason) {
            (None, _, _) => format!("OPEN: offsets {}..{} unread ({})", g.from_offset, g.to_offset, g.to_offset - g.from_offset),
            (Some(at), Some(by), Some(why)) => format!("accepted by {by} at {at}: {why}"),
            (Some(at), _, why) => format!("{} at {at}", why.as_deref().unwrap_or("closed")),
        };
        println!("{}\t{}/{}/{}\tfrom {}\tfound {}\t{}", g.consumer_id, g.cluster_id, g.topic, g.partition, g.detected_from, g.detected_at, state);
    }
    Ok(0)
}

/// `outbox gaps accept`.
#[allow(clippy::too_many_arguments)]
pub async fn gaps_accept(pool: &PgPool, consumer: &str, cluster: &str, topic: &str, partition: i32, detected_from: i64, operator: &str, reason: &str) -> anyhow::Result<u8> {
    match outbox_consumer::accept_gap(pool, consumer, cluster, topic, partition, detected_from, operator, reason).await.context("accepting the gap")? {
        Some(g) => {
            println!(
                "gap of {} on {}/{}/{} from {} accepted by {operator}: offsets {}..{} stay unread by this consumer; its watermark moves on with its next decision there",
                g.consumer_id, g.cluster_id, g.topic, g.partition, g.detected_from, g.from_offset, g.to_offset
            );
            Ok(0)
        }
        None => bail!("no open gap of {consumer} on {cluster}/{topic}/{partition} from {detected_from} (`outbox gaps list --all` shows the gaps)"),
    }
}

/// `outbox dead-letters show`.
pub async fn dead_letters_show(pool: &PgPool, event_id: &str, as_json: bool) -> anyhow::Result<u8> {
    let id: EventId = event_id.parse().with_context(|| format!("{event_id:?} is not an eventId"))?;
    let rows = outbox_consumer::dead_letters_of(pool, id.as_str()).await.context("reading dead letters (is this the consumer's database?)")?;
    if rows.is_empty() {
        bail!("no dead letter of {id}");
    }
    if as_json {
        println!("{}", to_json(&json!({ "eventId": id.as_str(), "deadLetters": rows }))?);
        return Ok(0);
    }
    for d in &rows {
        println!("dead letter of {} for consumer {}", d.event_id, d.consumer_id);
        println!("  event type       {} (envelope generation {})", d.event_type, d.envelope_generation);
        println!("  read at          {}/{} offset {}", d.topic, d.partition, d.offset);
        println!("  dead-lettered    {} after {} attempt(s)", d.dead_lettered_at, d.attempts);
        println!("  payload          {} bytes kept", d.payload_bytes);
        match (&d.requeue_requested_at_ms, &d.requeue_requested_by) {
            (Some(t), by) => println!("  requeue          requested {} by {}", ts(*t), by.as_deref().unwrap_or("?")),
            _ => println!("  requeue          not requested (`outbox dead-letters requeue {} --consumer {} --operator NAME`)", d.event_id, d.consumer_id),
        }
        println!("  last error       {}", d.last_error);
    }
    Ok(0)
}

/// `outbox dead-letters requeue`.
pub async fn dead_letters_requeue(pool: &PgPool, event_id: &str, consumer: &str, operator: &str) -> anyhow::Result<u8> {
    let id: EventId = event_id.parse().with_context(|| format!("{event_id:?} is not an eventId"))?;
    if !outbox_consumer::request_requeue(pool, consumer, id.as_str(), operator).await? {
        bail!("no dead letter of {id} for consumer {consumer}");
    }
    println!("requeue requested: consumer {consumer} runs the handler of {id} again within about a second while it runs; `outbox dead-letters show {id}` tells the outcome (gone: applied)");
    Ok(0)
}

/// One finding row.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FindingRow {
    /// Id (for `findings ack`).
    pub id: i64,
    /// Kind.
    pub kind: String,
    /// Event (or the eventId seen in a topic).
    pub event_id: String,
    /// Consumer, for unconsumed_published.
    pub consumer_id: Option<String>,
    /// Age of the condition when last seen, ms.
    pub age_ms: i64,
    /// Detail.
    pub detail: String,
    /// First seen, ms.
    pub first_seen_at_ms: i64,
    /// Last seen, ms.
    pub last_seen_at_ms: i64,
    /// Resolved (or acknowledged), ms.
    pub resolved_at_ms: Option<i64>,
    /// Who acknowledged it.
    pub acked_by: Option<String>,
    /// Their note.
    pub ack_note: Option<String>,
}

/// The findings.
pub async fn findings(pool: &PgPool, all: bool, kind: Option<&str>, limit: i64) -> anyhow::Result<Vec<FindingRow>> {
    check_limit(limit)?;
    let rows = sqlx::query(
        "SELECT id, kind, event_id, consumer_id, age_ms, detail, first_seen_ms, last_seen_ms, resolved_at_ms, acked_by, ack_note
         FROM outbox_findings WHERE ($1 OR resolved_at_ms IS NULL) AND ($2::text IS NULL OR kind = $2) ORDER BY id LIMIT $3",
    )
    .bind(all)
    .bind(kind)
    .bind(limit)
    .fetch_all(pool)
    .await
    .context("reading findings (has `outbox migrate` run?)")?;
    rows.iter()
        .map(|r| {
            let consumer: String = r.try_get("consumer_id")?;
            Ok(FindingRow {
                id: r.try_get("id")?,
                kind: r.try_get("kind")?,
                event_id: r.try_get("event_id")?,
                consumer_id: (!consumer.is_empty()).then_some(consumer),
                age_ms: r.try_get("age_ms")?,
                detail: r.try_get("detail")?,
                first_seen_at_ms: r.try_get("first_seen_ms")?,
                last_seen_at_ms: r.try_get("last_seen_ms")?,
                resolved_at_ms: r.try_get("resolved_at_ms")?,
                acked_by: r.try_get("acked_by")?,
                ack_note: r.try_get("ack_note")?,
            })
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()
        .map_err(Into::into)
}

/// `outbox findings list`.
pub async fn findings_list(pool: &PgPool, all: bool, kind: Option<&str>, limit: i64, as_json: bool) -> anyhow::Result<u8> {
    let rows = findings(pool, all, kind, limit).await?;
    if as_json {
        println!("{}", to_json(&json!({ "findings": rows }))?);
        return Ok(0);
    }
    if rows.is_empty() {
        println!("{}", if all { "no findings" } else { "no open findings" });
    }
    for f in &rows {
        let state = match (&f.resolved_at_ms, &f.acked_by) {
            (Some(t), Some(by)) => format!("acked by {by} {}", ts(*t)),
            (Some(t), None) => format!("resolved {}", ts(*t)),
            _ => "open".into(),
        };
        println!(
            "{}\t{}\t{}{}\tage {}\tfirst seen {}\tlast seen {}\t{state}\t{}",
            f.id,
            f.kind,
            f.event_id,
            f.consumer_id.as_deref().map(|c| format!(" consumer={c}")).unwrap_or_default(),
            age(f.age_ms),
            ts(f.first_seen_at_ms),
            ts(f.last_seen_at_ms),
            f.detail
        );
    }
    Ok(0)
}

/// `outbox findings ack`.
pub async fn findings_ack(pool: &PgPool, id: i64, operator: &str, note: Option<&str>) -> anyhow::Result<u8> {
    if operator.is_empty() || operator.chars().count() > 200 {
        bail!("--operator: 1..=200 characters");
    }
    if note.is_some_and(|n| n.chars().count() > 2000) {
        bail!("--note: at most 2000 characters");
    }
    let now = outbox_producer::pg::db_now_ms(pool).await?;
    let row: Option<(String, String)> = sqlx::query_as(
        "UPDATE outbox_findings SET resolved_at_ms = $2, acked_by = $3, acked_at_ms = $2, ack_note = $4
         WHERE id = $1 AND resolved_at_ms IS NULL RETURNING kind, event_id",
    )
    .bind(id)
    .bind(now)
    .bind(operator)
    .bind(note)
    .fetch_optional(pool)
    .await?;
    match row {
        Some((kind, event_id)) => {
            println!("finding {id} ({kind} {event_id}) acknowledged by {operator} and closed; if the condition still holds, the next reconciler round opens a new one");
            Ok(0)
        }
        None => {
            let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM outbox_findings WHERE id = $1)").bind(id).fetch_one(pool).await?;
            bail!("{}", if exists { format!("finding {id} is already closed") } else { format!("no finding {id}") })
        }
    }
}

/// One open UNKNOWN with its evidence counts.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UnknownRow {
    /// Event.
    pub event_id: String,
    /// DISPATCH_UNKNOWN, RECONCILING or RETRY_CLAIMED.
    pub state: String,
    /// Where it is frozen to.
    pub destination: String,
    /// Since when its outcome is unknown, ms.
    pub unknown_since_ms: Option<i64>,
    /// For how long, ms.
    pub unknown_age_ms: Option<i64>,
    /// The reconciler's next look, ms.
    pub next_check_at_ms: Option<i64>,
    /// Attempts registered.
    pub attempts: i64,
    /// Lookups the reconciler made.
    pub lookups: i64,
    /// The last lookup's answer.
    pub last_lookup: Option<String>,
}

/// `outbox unknown list`.
pub async fn unknown_list(pool: &PgPool, limit: i64, as_json: bool) -> anyhow::Result<u8> {
    check_limit(limit)?;
    let now = outbox_producer::pg::db_now_ms(pool).await?;
    let rows = sqlx::query(
        "SELECT e.event_id, e.state, e.cluster_id || '/' || e.topic || '/' || e.partition AS destination, e.unknown_since_ms, e.next_check_at_ms,
                (SELECT count(*) FROM outbox_attempts a WHERE a.event_id = e.event_id) AS attempts,
                (SELECT count(*) FROM outbox_unknown_lookups l WHERE l.event_id = e.event_id) AS lookups,
                (SELECT l.lookup FROM outbox_unknown_lookups l WHERE l.event_id = e.event_id ORDER BY l.id DESC LIMIT 1) AS last_lookup
         FROM outbox_events e WHERE e.state IN ('DISPATCH_UNKNOWN', 'RECONCILING', 'RETRY_CLAIMED')
         ORDER BY coalesce(e.unknown_since_ms, e.state_since_ms), e.seq LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await
    .context("reading UNKNOWN events (has `outbox migrate` run?)")?;
    let list: Vec<UnknownRow> = rows
        .iter()
        .map(|r| {
            let since: Option<i64> = r.try_get("unknown_since_ms")?;
            Ok(UnknownRow {
                event_id: r.try_get("event_id")?,
                state: r.try_get("state")?,
                destination: r.try_get("destination")?,
                unknown_since_ms: since,
                unknown_age_ms: since.map(|s| (now - s).max(0)),
                next_check_at_ms: r.try_get("next_check_at_ms")?,
                attempts: r.try_get("attempts")?,
                lookups: r.try_get("lookups")?,
                last_lookup: r.try_get("last_lookup")?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()?;
    if as_json {
        println!("{}", to_json(&json!({ "unknown": list }))?);
        return Ok(0);
    }
    if list.is_empty() {
        println!("no open UNKNOWN events");
    }
    for u in &list {
        println!(
            "{}\t{}\t{}\tunknown since {} ({})\tnext check {}\tattempts {}\tlookups {}\t{}",
            u.event_id,
            u.state,
            u.destination,
            u.unknown_since_ms.map(ts).unwrap_or_else(|| "-".into()),
            u.unknown_age_ms.map(age).unwrap_or_else(|| "-".into()),
            u.next_check_at_ms.map(ts).unwrap_or_else(|| "-".into()),
            u.attempts,
            u.lookups,
            u.last_lookup.as_deref().unwrap_or("no lookup yet")
        );
    }
    Ok(0)
}

/// `outbox unknown show`.
pub async fn unknown_show(pool: &PgPool, event_id: &str, lookups: i64, as_json: bool) -> anyhow::Result<u8> {
    check_limit(lookups)?;
    let id: EventId = event_id.parse().with_context(|| format!("{event_id:?} is not an eventId"))?;
    let Some(t) = crate::trace::trace(pool, id.as_str()).await? else { bail!("no outbox event {id}") };
    let rows = sqlx::query("SELECT owner, at_ms, from_offset, lookup, decision FROM outbox_unknown_lookups WHERE event_id = $1 ORDER BY id DESC LIMIT $2")
        .bind(id.as_str())
        .bind(lookups)
        .fetch_all(pool)
        .await?;
    let looked: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            Ok(json!({
                "owner": r.try_get::<String, _>("owner")?,
                "atMs": r.try_get::<i64, _>("at_ms")?,
                "fromOffset": r.try_get::<i64, _>("from_offset")?,
                "lookup": r.try_get::<String, _>("lookup")?,
                "decision": r.try_get::<String, _>("decision")?,
            }))
        })
        .collect::<Result<_, sqlx::Error>>()?;
    let state = t.event["state"].as_str().unwrap_or("?").to_owned();
    if as_json {
        println!("{}", to_json(&json!({ "eventId": id.as_str(), "state": state, "event": t.event, "attempts": t.attempts, "lookups": looked, "resolutions": t.unknown_resolutions }))?);
        return Ok(0);
    }
    let e = &t.event;
    println!("event {id}: {state}");
    println!("  frozen to          {}/{}/{}", e["cluster_id"].as_str().unwrap_or("?"), e["topic"].as_str().unwrap_or("?"), e["partition"]);
    if let Some(s) = e["unknown_since_ms"].as_i64() {
        println!("  unknown since      {}", ts(s));
    }
    if let Some(n) = e["next_check_at_ms"].as_i64() {
        println!("  next check         {}", ts(n));
    }
    println!("attempts: {}", t.attempts.len());
    for a in &t.attempts {
        println!(
            "  #{} {} {} owner {} started {}{}{}",
            a.attempt_generation,
            a.attempt_id,
            a.state,
            a.owner,
            ts(a.started_at_ms),
            a.finished_at_ms.map(|f| format!(" finished {}", ts(f))).unwrap_or_default(),
            a.detail.as_deref().map(|d| format!(" ({d})")).unwrap_or_default()
        );
    }
    println!("lookups: {} shown (newest first)", looked.len());
    for l in &looked {
        println!(
            "  {} by {} from offset {}: {} -> {}",
            ts(l["atMs"].as_i64().unwrap_or(0)),
            l["owner"].as_str().unwrap_or("?"),
            l["fromOffset"],
            l["lookup"].as_str().unwrap_or(""),
            l["decision"].as_str().unwrap_or("")
        );
    }
    for r in &t.unknown_resolutions {
        println!("resolution: {r}");
    }
    Ok(0)
}
