//! Assertions over the outbox tables, called with the user's own pool,
//! connection or transaction (anything that implements [`sqlx::Acquire`]:
//! `&pool`, `&mut tx`, `&mut conn`).
//!
//! `assert_*` panic with the `check_*` twin's message; `check_*` return it.

use outbox_core::{sha256_digest, Destination, Envelope, EventId};
use sqlx::{Acquire, Postgres, Row};

/// The primary publish receipt of an event (its publish slot).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrimaryReceipt {
    /// Envelope generation the receipt is for.
    pub envelope_generation: i32,
    /// The attempt whose send was acknowledged.
    pub attempt_id: String,
    /// Broker cluster.
    pub cluster_id: String,
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
}

fn db_err(what: &str) -> impl FnOnce(sqlx::Error) -> String + '_ {
    move |e| format!("{what}: database error: {e}")
}

/// Checks that the event of `command_key` exists and is consistent with its
/// frozen envelope: the envelope and destination decode, the envelope is for
/// this event and generation, sha256 of the stored payload equals the
/// envelope's `payloadDigest` (unless PURGED, where the payload is gone), the
/// destination's canonical digest equals the stored `destinationDigest`, the
/// claim columns copy the frozen destination, and the event is not
/// QUARANTINED. Returns its eventId.
pub async fn check_emitted<'c, A>(db: A, command_key: &str) -> Result<EventId, String>
where
    A: Acquire<'c, Database = Postgres>,
{
    let what = format!("event of command {command_key:?}");
    let mut conn = db.acquire().await.map_err(db_err(&what))?;
    let row = sqlx::query(
        "SELECT e.event_id, e.state, e.payload, e.payload_digest, e.destination_digest, e.envelope_generation,
                e.cluster_id, e.topic, e.partition, e.routing_key,
                v.envelope_canonical, v.envelope_digest, v.destination_canonical, v.destination_digest AS v_destination_digest,
                v.payload_digest AS v_payload_digest
         FROM outbox_commands c
         JOIN outbox_events e ON e.event_id = c.event_id
         LEFT JOIN outbox_envelopes v ON v.event_id = e.event_id AND v.envelope_generation = e.envelope_generation
         WHERE c.command_key = $1
         UNION ALL
         -- An event of the stream path with no row in the exception lane:
         -- its stream row holds it, envelope and destination inline.
         SELECT s.event_id, outbox_event_state(s.event_id), s.payload, s.payload_digest, s.destination_digest, 1,
                s.cluster_id, s.topic, s.partition, s.routing_key,
                s.envelope_canonical, s.envelope_digest, s.destination_canonical, s.destination_digest, s.payload_digest
         FROM outbox_commands c
         JOIN outbox_stream s ON s.event_id = c.event_id
         WHERE c.command_key = $1 AND NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = s.event_id)",
    )
    .bind(command_key)
    .fetch_optional(&mut *conn)
    .await
    .map_err(db_err(&what))?;
    let Some(row) = row else {
        return Err(format!("{what}: no outbox event for this command key (was emit called in the committed transaction?)"));
    };
    let event_id: String = row.get("event_id");
    let state: String = row.get("state");
    let what = format!("event {event_id} (command {command_key:?}, state {state})");
    if state == "QUARANTINED" {
        return Err(format!("{what}: the event is QUARANTINED (see `outbox trace {event_id}`)"));
    }
    let generation: i32 = row.get("envelope_generation");
    let Some(envelope_bytes) = row.get::<Option<Vec<u8>>, _>("envelope_canonical") else {
        return Err(format!("{what}: no frozen envelope for generation {generation}"));
    };
    let envelope = Envelope::from_canonical(&envelope_bytes).map_err(|e| format!("{what}: the frozen envelope does not decode: {e}"))?;
    if envelope.event_id.as_str() != event_id || i64::from(envelope.envelope_generation) != i64::from(generation) {
        return Err(format!(
            "{what}: the frozen envelope is for {} generation {}, not for this event's generation {generation}",
            envelope.event_id, envelope.envelope_generation
        ));
    }
    let envelope_digest: String = row.get("envelope_digest");
    if envelope.digest() != envelope_digest {
        return Err(format!("{what}: envelope digest {envelope_digest} != sha256 of the canonical envelope {}", envelope.digest()));
    }
    let stored_payload_digest: String = row.get("payload_digest");
    let frozen_payload_digest: String = row.get("v_payload_digest");
    if stored_payload_digest != envelope.payload_digest || frozen_payload_digest != envelope.payload_digest {
        return Err(format!(
            "{what}: payload digests disagree: envelope {}, event row {stored_payload_digest}, envelope row {frozen_payload_digest}",
            envelope.payload_digest
        ));
    }
    match row.get::<Option<Vec<u8>>, _>("payload") {
        Some(payload) => {
            let actual = sha256_digest(&payload);
            if actual != envelope.payload_digest {
                return Err(format!("{what}: sha256 of the stored payload is {actual}, the envelope froze {}", envelope.payload_digest));
            }
        }
        None if state == "PURGED" => {}
        None => return Err(format!("{what}: the payload is missing but the event is not PURGED")),
    }
    let destination_bytes: Vec<u8> = row.get("destination_canonical");
    let destination = Destination::from_canonical(&destination_bytes).map_err(|e| format!("{what}: the frozen destination does not decode: {e}"))?;
    let frozen_destination_digest: String = row.get("v_destination_digest");
    let event_destination_digest: String = row.get("destination_digest");
    if destination.digest() != frozen_destination_digest || frozen_destination_digest != event_destination_digest {
        return Err(format!(
            "{what}: destination digests disagree: canonical {}, envelope row {frozen_destination_digest}, event row {event_destination_digest}",
            destination.digest()
        ));
    }
    let (cluster, topic, partition, key): (String, String, i32, String) = (row.get("cluster_id"), row.get("topic"), row.get("partition"), row.get("routing_key"));
    if !destination.admits(&cluster, &topic, partition) || destination.routing_key != key {
        return Err(format!(
            "{what}: the event row routes to {cluster}/{topic}/{partition} key {key:?}, the frozen destination to {}/{}/{} key {:?}",
            destination.cluster_id, destination.topic, destination.partition, destination.routing_key
        ));
    }
    Ok(envelope.event_id)
}

/// Panicking twin of [`check_emitted`].
pub async fn assert_emitted<'c, A>(db: A, command_key: &str) -> EventId
where
    A: Acquire<'c, Database = Postgres>,
{
    check_emitted(db, command_key).await.unwrap_or_else(|m| panic!("assert_emitted: {m}"))
}

/// Checks that the event is PUBLISHED (or later: RETAINED, PURGED) with
/// exactly one primary receipt, for its current envelope generation, whose
/// payload and destination digests are the event's frozen ones. Duplicate
/// transport receipts may exist (they are evidence, not errors). Returns the
/// primary receipt.
pub async fn check_published<'c, A>(db: A, event_id: &EventId) -> Result<PrimaryReceipt, String>
where
    A: Acquire<'c, Database = Postgres>,
{
    let what = format!("event {event_id}");
    let mut conn = db.acquire().await.map_err(db_err(&what))?;
    // Its row in the exception lane, else its stream row (generation 1), with
    // its state read as every reader reads it (`outbox_event_state`).
    let row = sqlx::query(
        "SELECT outbox_event_state($1) AS state, coalesce(e.envelope_generation, 1) AS envelope_generation,
                coalesce(e.payload_digest, s.payload_digest) AS payload_digest, coalesce(e.destination_digest, s.destination_digest) AS destination_digest
         FROM (SELECT $1::text AS id) x
         LEFT JOIN outbox_events e ON e.event_id = x.id
         LEFT JOIN outbox_stream s ON s.event_id = x.id AND e.event_id IS NULL
         WHERE e.event_id IS NOT NULL OR s.event_id IS NOT NULL",
    )
    .bind(event_id.as_str())
        .fetch_optional(&mut *conn)
        .await
        .map_err(db_err(&what))?
        .ok_or_else(|| format!("{what}: no such outbox event"))?;
    let state: String = row.get("state");
    let generation: i32 = row.get("envelope_generation");
    let payload_digest: String = row.get("payload_digest");
    let destination_digest: String = row.get("destination_digest");
    let receipts = sqlx::query(
        r#"SELECT envelope_generation, attempt_id, cluster_id, topic, partition, "offset", payload_digest, destination_digest
           FROM outbox_publish_receipts WHERE event_id = $1 ORDER BY envelope_generation"#,
    )
    .bind(event_id.as_str())
    .fetch_all(&mut *conn)
    .await
    .map_err(db_err(&what))?;
    if !matches!(state.as_str(), "PUBLISHED" | "RETAINED" | "PURGED") {
        return Err(format!("{what}: state is {state}, not PUBLISHED ({} primary receipt(s))", receipts.len()));
    }
    if receipts.len() != 1 {
        return Err(format!("{what}: {} primary receipts, expected exactly one", receipts.len()));
    }
    let r = &receipts[0];
    let receipt = PrimaryReceipt {
        envelope_generation: r.get("envelope_generation"),
        attempt_id: r.get("attempt_id"),
        cluster_id: r.get("cluster_id"),
        topic: r.get("topic"),
        partition: r.get("partition"),
        offset: r.get("offset"),
    };
    if receipt.envelope_generation != generation {
        return Err(format!("{what}: the primary receipt is for generation {}, the event is at {generation}", receipt.envelope_generation));
    }
    let (rp, rd): (String, String) = (r.get("payload_digest"), r.get("destination_digest"));
    if rp != payload_digest || rd != destination_digest {
        return Err(format!("{what}: the primary receipt's digests ({rp}, {rd}) differ from the frozen ones ({payload_digest}, {destination_digest})"));
    }
    Ok(receipt)
}

/// Panicking twin of [`check_published`].
pub async fn assert_published<'c, A>(db: A, event_id: &EventId) -> PrimaryReceipt
where
    A: Acquire<'c, Database = Postgres>,
{
    check_published(db, event_id).await.unwrap_or_else(|m| panic!("assert_published: {m}"))
}

/// Checks that consumer `consumer_id` holds exactly one consumption receipt
/// for `event_id` (table `outbox_consumer_receipts`, in the consumer's
/// database).
pub async fn check_consumed_once<'c, A>(db: A, consumer_id: &str, event_id: &EventId) -> Result<(), String>
where
    A: Acquire<'c, Database = Postgres>,
{
    let what = format!("consumer {consumer_id:?} and event {event_id}");
    let mut conn = db.acquire().await.map_err(db_err(&what))?;
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('outbox_consumer_receipts') IS NOT NULL")
        .fetch_one(&mut *conn)
        .await
        .map_err(db_err(&what))?;
    if !exists {
        return Err(format!("{what}: no table outbox_consumer_receipts in this database (run outbox_consumer::migrate, or pass the consumer's database)"));
    }
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_consumer_receipts WHERE consumer_id = $1 AND event_id = $2")
        .bind(consumer_id)
        .bind(event_id.as_str())
        .fetch_one(&mut *conn)
        .await
        .map_err(db_err(&what))?;
    match n {
        1 => Ok(()),
        0 => Err(format!("{what}: no consumption receipt: the consumer has not applied the event")),
        n => Err(format!("{what}: {n} consumption receipts, expected exactly one")),
    }
}

/// Panicking twin of [`check_consumed_once`].
pub async fn assert_consumed_once<'c, A>(db: A, consumer_id: &str, event_id: &EventId)
where
    A: Acquire<'c, Database = Postgres>,
{
    check_consumed_once(db, consumer_id, event_id).await.unwrap_or_else(|m| panic!("assert_consumed_once: {m}"))
}

/// Checks that a reconciliation report (`outbox_producer::build_report`, or
/// `Reconciler::report` after `Reconciler::run_once`) has no open findings
/// and that the UNKNOWN SLO is met; the message lists up to ten findings.
pub fn check_no_findings(report: &outbox_producer::Report) -> Result<(), String> {
    let mut problems: Vec<String> = report
        .findings
        .iter()
        .take(10)
        .map(|f| format!("{} {}{}: {}", f.kind, f.event_id, f.consumer_id.as_deref().map(|c| format!(" (consumer {c})")).unwrap_or_default(), f.detail))
        .collect();
    if report.findings.len() > 10 {
        problems.push(format!("... and {} more", report.findings.len() - 10));
    }
    if !report.unknown_slo_met() {
        problems.push(format!("UNKNOWN p99 to resolution {:?} ms exceeds the SLO of {} ms", report.unknown_p99_resolution_ms, report.unknown_slo_ms));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!("{} finding(s):\n  {}", report.findings.len(), problems.join("\n  ")))
    }
}

/// Panicking twin of [`check_no_findings`].
pub fn assert_no_findings(report: &outbox_producer::Report) {
    check_no_findings(report).unwrap_or_else(|m| panic!("assert_no_findings: {m}"))
}
