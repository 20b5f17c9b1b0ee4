//! Rollout and rollback (PROTOCOL §11): shadow mode, partial takeover, the
//! dispatcher alias.
//!
//! - **Takeover policy** ([`set_takeover`]): which events the outbox sends.
//!   Decided once, at emit, and frozen on the event (`publisher`): the outbox
//!   owns an event iff its type is selected and
//!   [`takeover_bucket`](outbox_core::takeover_bucket)`(eventId) < percent_bp`.
//!   Everything else stays with the current (legacy) publisher. No policy at
//!   all means the outbox owns everything. A new generation affects only
//!   events emitted after it: an event never changes hands.
//! - **Shadow mode** ([`ShadowDispatcher`], [`compare_shadow`]): for the
//!   legacy publisher's events, build exactly the message the dispatcher would
//!   send (same key, partition, payload, headers), record it, never send it;
//!   then compare with what the legacy publisher really put on the topic.
//!   There is no code path here that produces anything.
//! - **Alias** ([`switch_alias`]): dispatchers run under an alias and claim
//!   only while it names their implementation. Switching the alias is the
//!   only rollback step; the reconciler keeps reconciling whatever any
//!   implementation published.

use std::collections::HashMap;

use outbox_core::{sha256_digest, AttemptId, AttemptRecord, AttemptState, Broker, ClaimToken, ClaimedEvent, Destination, Envelope, EventState, TakeoverPolicy};
use sqlx::{PgPool, Row};

use crate::dispatcher::outgoing_message;
use crate::error::ProducerError;
use crate::topic_scan::Cursors;
use crate::pg::PgStore;
pub use crate::service_store::DispatcherAlias;

/// Publishes a new takeover policy generation and returns it. `event_types`
/// may contain `*` (every type); `percent_bp` is in basis points (500 = 5%).
/// Shadow mode: `set_takeover(pool, &[], 0)`. Only events emitted after this
/// commits are affected.
pub async fn set_takeover(pool: &PgPool, event_types: &[&str], percent_bp: u32) -> Result<TakeoverPolicy, ProducerError> {
    if percent_bp > outbox_core::TAKEOVER_BUCKETS {
        return Err(ProducerError::Config(format!("percent_bp = {percent_bp} (0..=10000)")));
    }
    for t in event_types.iter().filter(|t| **t != "*") {
        outbox_core::id::validate_identifier("event type", t)?;
    }
    let types: Vec<String> = event_types.iter().map(|t| (*t).to_owned()).collect();
    // Two concurrent revisions compute the same generation: one of them
    // fails on the primary key and changes nothing (retry it).
    let generation: i32 = sqlx::query_scalar(
        "INSERT INTO outbox_takeover_policies (generation, event_types, percent_bp)
         SELECT coalesce(max(generation), 0) + 1, $1, $2 FROM outbox_takeover_policies RETURNING generation",
    )
    .bind(&types)
    .bind(percent_bp as i32)
    .fetch_one(pool)
    .await?;
    tracing::info!(generation, ?types, percent_bp, "takeover policy revised");
    Ok(TakeoverPolicy { generation: generation as u32, event_types: types, percent_bp })
}

/// The current takeover policy; `None` when there is none (the outbox owns everything).
pub async fn current_takeover(pool: &PgPool) -> Result<Option<TakeoverPolicy>, ProducerError> {
    let row: Option<(i32, Vec<String>, i32)> =
        sqlx::query_as("SELECT generation, event_types, percent_bp FROM outbox_takeover_policies ORDER BY generation DESC LIMIT 1").fetch_optional(pool).await?;
    Ok(row.map(|(g, t, p)| TakeoverPolicy { generation: g as u32, event_types: t, percent_bp: p as u32 }))
}

/// Digest of the headers of a message, leaving out the attempt id (each
/// attempt has its own): `name=len:value\n` per header, in order.
pub fn headers_digest(headers: &[(String, Vec<u8>)]) -> String {
    let mut bytes = Vec::new();
    for (k, v) in headers.iter().filter(|(k, _)| k != outbox_core::headers::ATTEMPT_ID) {
        bytes.extend_from_slice(k.as_bytes());
        bytes.extend_from_slice(format!("={}:", v.len()).as_bytes());
        bytes.extend_from_slice(v);
        bytes.push(b'\n');
    }
    sha256_digest(&bytes)
}

/// Shadow mode's dispatcher half: records, for every legacy-owned event, the
/// message the real dispatcher would send. It claims nothing, changes no
/// event and sends nothing.
#[derive(Debug, Clone)]
pub struct ShadowDispatcher {
    store: PgStore,
}

impl ShadowDispatcher {
    /// A shadow dispatcher over `store`.
    pub fn new(store: PgStore) -> Self {
        ShadowDispatcher { store }
    }

    /// Builds and records the shadow attempts of up to `limit` legacy-owned
    /// events that have none yet, oldest first. Returns how many were recorded.
    pub async fn shadow_once(&self, limit: usize) -> Result<usize, ProducerError> {
        let now = self.store.now_ms();
        let rows = sqlx::query(
            "SELECT e.payload, e.traceparent, e.tracestate, e.destination_digest, v.envelope_canonical, v.destination_canonical
             FROM outbox_events e JOIN outbox_envelopes v ON v.event_id = e.event_id AND v.envelope_generation = e.envelope_generation
             WHERE e.publisher = 'legacy' AND NOT EXISTS (SELECT 1 FROM outbox_shadow_attempts s WHERE s.event_id = e.event_id)
             ORDER BY e.seq LIMIT $1",
        )
        .bind(limit.min(outbox_core::claim::MAX_CLAIM_BATCH) as i64)
        .fetch_all(self.store.pool())
        .await?;
        #[derive(Default)]
        struct Columns(Vec<String>, Vec<String>, Vec<i32>, Vec<Vec<u8>>, Vec<String>, Vec<String>, Vec<String>);
        let mut cols = Columns::default();
        for r in &rows {
            let envelope = Envelope::from_canonical(r.try_get::<&[u8], _>("envelope_canonical")?)?;
            let destination = Destination::from_canonical(r.try_get::<&[u8], _>("destination_canonical")?)?;
            let destination_digest: String = r.try_get("destination_digest")?;
            // Exactly the message the dispatcher would build for an attempt
            // of this event; only the attempt id is a placeholder (and left
            // out of the headers digest).
            let mut event = ClaimedEvent {
                token: ClaimToken { event_id: envelope.event_id.clone(), owner: "shadow".into(), claim_generation: 0, lease_until_ms: 0 },
                destination_digest: destination_digest.clone(),
                payload: r.try_get::<Option<Vec<u8>>, _>("payload")?.unwrap_or_default(),
                event_payload_digest: envelope.payload_digest.clone(),
                claimed_from: EventState::Pending,
                traceparent: r.try_get("traceparent")?,
                cloudevents: None,
                tracestate: r.try_get("tracestate")?,
                source: None,
                envelope,
                destination,
            };
            // The CloudEvents headers too, as the dispatcher would add them.
            self.store.attach_cloudevents(std::slice::from_mut(&mut event)).await?;
            let attempt = AttemptRecord {
                attempt_id: AttemptId::from_parts(now.max(0) as u64, 0),
                event_id: event.envelope.event_id.clone(),
                envelope_generation: event.envelope.envelope_generation,
                attempt_generation: 1,
                claim_generation: 0,
                owner: "shadow".into(),
                state: AttemptState::Sending,
                destination_digest: destination_digest.clone(),
                started_at_ms: now,
                send_deadline_ms: None,
                scan_from_offset: 0,
                scan_anchor: None,
                scan_anchor_attempt: None,
            };
            let message = outgoing_message(&event, &attempt);
            let payload_digest = sha256_digest(&message.payload);
            if payload_digest != event.envelope.payload_digest || event.destination.digest() != destination_digest {
                tracing::error!(event_id = %event.envelope.event_id, "shadow: stored event no longer matches its digests (the real dispatcher would quarantine it)");
            }
            cols.0.push(event.envelope.event_id.to_string());
            cols.1.push(message.topic.clone());
            cols.2.push(message.partition);
            cols.3.push(message.key.clone());
            cols.4.push(payload_digest);
            cols.5.push(destination_digest);
            cols.6.push(headers_digest(&message.headers));
        }
        if cols.0.is_empty() {
            return Ok(0);
        }
        let n = sqlx::query(
            "INSERT INTO outbox_shadow_attempts (event_id, topic, partition, key, payload_digest, destination_digest, headers_digest, built_at_ms)
             SELECT *, $8 FROM UNNEST($1::text[], $2::text[], $3::int[], $4::bytea[], $5::text[], $6::text[], $7::text[])
             ON CONFLICT (event_id) DO NOTHING",
        )
        .bind(&cols.0)
        .bind(&cols.1)
        .bind(&cols.2)
        .bind(&cols.3)
        .bind(&cols.4)
        .bind(&cols.5)
        .bind(&cols.6)
        .bind(now)
        .execute(self.store.pool())
        .await?
        .rows_affected();
        Ok(n as usize)
    }
}

/// What one round of [`compare_shadow`] found (new mismatches only).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShadowReport {
    /// Messages read.
    pub scanned_messages: usize,
    /// Legacy messages that matched their shadow attempt exactly.
    pub matched: usize,
    /// Shadow attempts older than the grace period with no message of their eventId.
    pub missing: usize,
    /// Messages with no shadow attempt and no outbox event behind them, or a
    /// second message of the same eventId.
    pub extra: usize,
    /// Messages whose key or payload differ from the shadow attempt.
    pub different_bytes: usize,
    /// Messages on another topic or partition than the shadow attempt.
    pub different_partition: usize,
}

impl ShadowReport {
    /// New mismatches.
    pub fn mismatches(&self) -> usize {
        self.missing + self.extra + self.different_bytes + self.different_partition
    }
}

struct Shadow {
    publisher: String,
    attempt: Option<(String, i32, Vec<u8>, String)>,
    seen: Option<(String, i32, i64)>,
}

/// Compares the shadow attempts with what the current publisher put on the
/// topics of `broker`'s cluster, reading each routed partition from its
/// shadow cursor (at most `max_messages` per partition per round; keep it at
/// or below the adapter's lookup bound). Records the mismatches in
/// `outbox_shadow_mismatches` and returns the new ones.
///
/// Events the outbox itself owns are skipped (the reconciler covers them).
/// A legacy event's message read before its shadow attempt exists stops the
/// partition's scan there until the next round, so a lagging shadow
/// dispatcher causes no false `extra`. `missing` is judged only for topics
/// read to their end in this round, for attempts built more than `grace_ms`
/// before it; a late message resolves it.
pub async fn compare_shadow<B: Broker + ?Sized>(store: &PgStore, broker: &B, grace_ms: i64, max_messages: u64) -> Result<ShadowReport, ProducerError> {
    let pool = store.pool();
    let round_start = store.now_ms();
    let cluster = broker.cluster_id().to_owned();
    let topics = crate::topic_scan::routed_topics(pool, &cluster).await?;
    let mut report = ShadowReport::default();
    let mut complete_topics: Vec<String> = Vec::new();
    for (topic, partitions) in topics {
        let mut complete = true;
        for partition in 0..partitions {
            let cursor = Cursors::Shadow.read(pool, &cluster, &topic, partition).await?;
            let scan = match broker.scan_event_ids(&topic, partition, cursor, max_messages).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(%topic, partition, error = %e, "shadow comparison could not read the partition");
                    complete = false;
                    continue;
                }
            };
            if scan.messages.len() as u64 >= max_messages {
                complete = false;
            }
            let ids: Vec<String> = scan.messages.iter().filter_map(|m| m.event_id.clone()).collect();
            let mut known: HashMap<String, Shadow> = HashMap::new();
            for r in sqlx::query(
                "SELECT e.event_id, e.publisher, s.topic, s.partition, s.key, s.payload_digest, s.seen_topic, s.seen_partition, s.seen_offset
                 FROM outbox_events e LEFT JOIN outbox_shadow_attempts s ON s.event_id = e.event_id WHERE e.event_id = ANY($1)",
            )
            .bind(&ids)
            .fetch_all(pool)
            .await?
            {
                let attempt = match r.try_get::<Option<String>, _>("topic")? {
                    Some(t) => Some((t, r.try_get("partition")?, r.try_get("key")?, r.try_get("payload_digest")?)),
                    None => None,
                };
                let seen = match r.try_get::<Option<i64>, _>("seen_offset")? {
                    Some(o) => Some((r.try_get("seen_topic")?, r.try_get("seen_partition")?, o)),
                    None => None,
                };
                known.insert(r.try_get("event_id")?, Shadow { publisher: r.try_get("publisher")?, attempt, seen });
            }

            let mut mismatches: Vec<(String, &'static str, String)> = Vec::new();
            let mut seen_now: Vec<(String, i64)> = Vec::new();
            let mut next_offset = scan.next_offset;
            for m in &scan.messages {
                let at = format!("{topic}/{partition}@{}", m.offset);
                let Some(id) = &m.event_id else {
                    mismatches.push((format!("no-event-id@{at}"), "extra", format!("message without an outbox eventId at {at}")));
                    continue;
                };
                let Some(shadow) = known.get_mut(id) else {
                    mismatches.push((id.clone(), "extra", format!("eventId the outbox never committed, at {at}")));
                    continue;
                };
                if shadow.publisher != "legacy" {
                    continue; // the outbox's own event: receipts and the bypass check cover it
                }
                let Some((s_topic, s_partition, s_key, s_payload)) = &shadow.attempt else {
                    // The shadow dispatcher has not built this one yet: read it again next round.
                    next_offset = m.offset;
                    complete = false;
                    break;
                };
                if let Some((t, p, o)) = &shadow.seen {
                    if (t.as_str(), *p, *o) != (topic.as_str(), partition, m.offset) {
                        mismatches.push((id.clone(), "extra", format!("second message of the eventId at {at} (first at {t}/{p}@{o})")));
                    }
                    continue;
                }
                shadow.seen = Some((topic.clone(), partition, m.offset));
                seen_now.push((id.clone(), m.offset));
                let mut ok = true;
                if *s_topic != topic || *s_partition != partition {
                    ok = false;
                    mismatches.push((id.clone(), "different_partition", format!("at {at}, the outbox would send to {s_topic}/{s_partition}")));
                }
                let key_differs = m.key.as_deref() != Some(s_key.as_slice());
                if key_differs || m.payload_digest != *s_payload {
                    ok = false;
                    let what = match (key_differs, m.payload_digest != *s_payload) {
                        (true, true) => "key and payload",
                        (true, false) => "key",
                        _ => "payload",
                    };
                    mismatches.push((id.clone(), "different_bytes", format!("{what} differ at {at}: payload {} vs the outbox's {s_payload}", m.payload_digest)));
                }
                if ok {
                    report.matched += 1;
                }
            }
            report.scanned_messages += scan.messages.len();

            let mut tx = pool.begin().await?;
            if !seen_now.is_empty() {
                let (ids, offsets): (Vec<String>, Vec<i64>) = seen_now.into_iter().unzip();
                sqlx::query(
                    "UPDATE outbox_shadow_attempts s SET seen_topic = $3, seen_partition = $4, seen_offset = t.o, seen_at_ms = $5
                     FROM UNNEST($1::text[], $2::bigint[]) AS t(id, o) WHERE s.event_id = t.id AND s.seen_offset IS NULL",
                )
                .bind(&ids)
                .bind(&offsets)
                .bind(&topic)
                .bind(partition)
                .bind(round_start)
                .execute(&mut *tx)
                .await?;
                sqlx::query("UPDATE outbox_shadow_mismatches SET resolved_at_ms = $2 WHERE event_id = ANY($1) AND kind = 'missing' AND resolved_at_ms IS NULL")
                    .bind(&ids)
                    .bind(round_start)
                    .execute(&mut *tx)
                    .await?;
            }
            count_new(&mut report, record(&mut tx, &mismatches, round_start).await?);
            Cursors::Shadow.advance(&mut tx, &cluster, &topic, partition, next_offset, None).await?;
            tx.commit().await?;
        }
        if complete {
            complete_topics.push(topic);
        }
    }

    // Missing: old enough, never seen, on a topic read to its end this round.
    let missing: Vec<(String, String, i32)> = sqlx::query_as(
        "SELECT event_id, topic, partition FROM outbox_shadow_attempts
         WHERE seen_offset IS NULL AND built_at_ms < $1 - $2 AND topic = ANY($3)
           AND NOT EXISTS (SELECT 1 FROM outbox_shadow_mismatches m WHERE m.event_id = outbox_shadow_attempts.event_id AND m.kind = 'missing')
         ORDER BY built_at_ms LIMIT 10000",
    )
    .bind(round_start)
    .bind(grace_ms)
    .bind(&complete_topics)
    .fetch_all(pool)
    .await?;
    let missing: Vec<(String, &'static str, String)> =
        missing.into_iter().map(|(id, t, p)| (id, "missing", format!("no message of the eventId in {t} (the outbox would send it to {t}/{p})"))).collect();
    let mut tx = pool.begin().await?;
    count_new(&mut report, record(&mut tx, &missing, round_start).await?);
    tx.commit().await?;
    if report.mismatches() > 0 {
        tracing::warn!(?report, "shadow comparison found mismatches");
    }
    Ok(report)
}

async fn record(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, mismatches: &[(String, &'static str, String)], now: i64) -> Result<Vec<String>, ProducerError> {
    if mismatches.is_empty() {
        return Ok(vec![]);
    }
    let ids: Vec<&str> = mismatches.iter().map(|m| m.0.as_str()).collect();
    let kinds: Vec<&str> = mismatches.iter().map(|m| m.1).collect();
    let details: Vec<&str> = mismatches.iter().map(|m| m.2.as_str()).collect();
    Ok(sqlx::query_scalar(
        "INSERT INTO outbox_shadow_mismatches (event_id, kind, detail, found_at_ms)
         SELECT DISTINCT ON (i, k) i, k, d, $4 FROM UNNEST($1::text[], $2::text[], $3::text[]) AS t(i, k, d)
         ON CONFLICT (event_id, kind) DO NOTHING RETURNING kind",
    )
    .bind(&ids)
    .bind(&kinds)
    .bind(&details)
    .bind(now)
    .fetch_all(&mut **tx)
    .await?)
}

fn count_new(report: &mut ShadowReport, kinds: Vec<String>) {
    for k in kinds {
        match k.as_str() {
            "missing" => report.missing += 1,
            "extra" => report.extra += 1,
            "different_bytes" => report.different_bytes += 1,
            _ => report.different_partition += 1,
        }
    }
}

/// The open shadow mismatches, `(event_id, kind, detail)`, oldest first.
pub async fn open_shadow_mismatches(pool: &PgPool) -> Result<Vec<(String, String, String)>, ProducerError> {
    Ok(sqlx::query_as("SELECT event_id, kind, detail FROM outbox_shadow_mismatches WHERE resolved_at_ms IS NULL ORDER BY found_at_ms, event_id, kind")
        .fetch_all(pool)
        .await?)
}

/// Points `alias` at `implementation` (the rollout step and the rollback
/// step alike) and records the switch in the append-only history.
/// Dispatchers of the previous implementation stop claiming within their
/// `poll_interval_ms` and settle what they have in flight; claims are fenced,
/// so the overlap sends nothing twice.
pub async fn switch_alias(pool: &PgPool, alias: &str, implementation: &str, protocol_version: i32) -> Result<DispatcherAlias, ProducerError> {
    outbox_core::id::validate_identifier("dispatcher alias", alias)?;
    outbox_core::id::validate_identifier("dispatcher implementation", implementation)?;
    if protocol_version < 1 {
        return Err(ProducerError::Config(format!("protocol_version = {protocol_version} (>= 1)")));
    }
    let mut tx = pool.begin().await?;
    let previous: Option<String> = sqlx::query_scalar("SELECT implementation FROM outbox_dispatcher_aliases WHERE alias = $1 FOR UPDATE")
        .bind(alias)
        .fetch_optional(&mut *tx)
        .await?;
    let row: (String, String, i32, i64) = sqlx::query_as(
        "INSERT INTO outbox_dispatcher_aliases (alias, implementation, protocol_version, switched_at_ms)
         VALUES ($1, $2, $3, (extract(epoch FROM clock_timestamp()) * 1000)::bigint)
         ON CONFLICT (alias) DO UPDATE SET implementation = EXCLUDED.implementation, protocol_version = EXCLUDED.protocol_version,
                                           switched_at_ms = EXCLUDED.switched_at_ms
         RETURNING alias, implementation, protocol_version, switched_at_ms",
    )
    .bind(alias)
    .bind(implementation)
    .bind(protocol_version)
    .fetch_one(&mut *tx)
    .await?;
    sqlx::query("INSERT INTO outbox_dispatcher_alias_history (alias, implementation, protocol_version, previous, switched_at_ms) VALUES ($1, $2, $3, $4, $5)")
        .bind(&row.0)
        .bind(&row.1)
        .bind(row.2)
        .bind(previous.as_deref())
        .bind(row.3)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    tracing::info!(%alias, %implementation, protocol_version, previous = previous.as_deref().unwrap_or("none"), "dispatcher alias switched");
    Ok(DispatcherAlias { alias: row.0, implementation: row.1, protocol_version: row.2, switched_at_ms: row.3 })
}

/// The current target of `alias`, if it was ever set.
pub async fn current_alias(pool: &PgPool, alias: &str) -> Result<Option<DispatcherAlias>, ProducerError> {
    let row: Option<(String, String, i32, i64)> =
        sqlx::query_as("SELECT alias, implementation, protocol_version, switched_at_ms FROM outbox_dispatcher_aliases WHERE alias = $1")
            .bind(alias)
            .fetch_optional(pool)
            .await?;
    Ok(row.map(|(alias, implementation, protocol_version, switched_at_ms)| DispatcherAlias { alias, implementation, protocol_version, switched_at_ms }))
}

/// Every alias with its current target.
pub async fn aliases(pool: &PgPool) -> Result<Vec<DispatcherAlias>, ProducerError> {
    let rows: Vec<(String, String, i32, i64)> =
        sqlx::query_as("SELECT alias, implementation, protocol_version, switched_at_ms FROM outbox_dispatcher_aliases ORDER BY alias").fetch_all(pool).await?;
    Ok(rows.into_iter().map(|(alias, implementation, protocol_version, switched_at_ms)| DispatcherAlias { alias, implementation, protocol_version, switched_at_ms }).collect())
}
