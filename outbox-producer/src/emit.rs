//! `emit`: the PENDING envelope inserted inside the caller's own transaction.

use outbox_core::{decide_publisher, Destination, EmitRequest, Envelope, EventId, Publisher, RoutePolicy, TakeoverPolicy, DEFAULT_MAX_PAYLOAD_BYTES};
use sqlx::{Postgres, Row, Transaction};

use crate::error::ProducerError;
use crate::routes;

/// Limits applied by [`emit`].
#[derive(Debug, Clone)]
pub struct EmitOptions {
    /// Largest accepted payload, bytes.
    pub max_payload_bytes: usize,
    /// The W3C `traceparent` of the request that committed the business
    /// change; the dispatcher sends it as a header so the trace continues
    /// through the broker.
    pub traceparent: Option<String>,
}

impl Default for EmitOptions {
    fn default() -> Self {
        EmitOptions { max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES, traceparent: None }
    }
}

/// Whether `s` has the W3C `traceparent` form `vv-<32 hex>-<16 hex>-ff`.
pub fn is_traceparent(s: &str) -> bool {
    let parts: Vec<&str> = s.split('-').collect();
    let hex = |p: &str, n: usize| p.len() == n && p.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    parts.len() == 4 && hex(parts[0], 2) && hex(parts[1], 32) && hex(parts[2], 16) && hex(parts[3], 2)
}

/// What [`emit`] froze (or found frozen by the first try of the command).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Emitted {
    /// The envelope.
    pub envelope: Envelope,
    /// The frozen destination.
    pub destination: Destination,
    /// Its digest.
    pub destination_digest: String,
    /// `false` when the command key was seen before and nothing was inserted.
    pub inserted: bool,
    /// Who sends it, frozen at emit by the takeover policy (SPEC §11):
    /// [`Publisher::Outbox`] unless a rollout leaves it to the legacy publisher.
    pub publisher: Publisher,
}

impl Emitted {
    /// The event id.
    pub fn event_id(&self) -> &EventId {
        &self.envelope.event_id
    }
}

/// Records the intent to publish inside the caller's transaction.
///
/// Resolves the current route policy of the event type into a frozen
/// destination, computes the digests and inserts the PENDING envelope. The
/// caller's business change and this row commit or roll back together.
///
/// A retried command (same `command_key`) returns the first event's identity
/// and inserts nothing; the same key with a different payload, event type or
/// aggregate is [`ProducerError::CommandKeyConflict`]. Invalid input is a typed
/// error and writes nothing.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use outbox_core::EmitRequest;
/// let mut tx = pool.begin().await?;
/// sqlx::query("INSERT INTO orders (id) VALUES ('o-42')").execute(&mut *tx).await?;
/// let emitted = outbox_producer::emit(&mut tx, &EmitRequest {
///     command_key: "create-order-o-42",
///     tenant: "tenant-7",
///     aggregate_type: "order",
///     aggregate_id: "o-42",
///     aggregate_version: 1,
///     event_type: "order.created.v2",
///     payload_schema: "order-v2",
///     payload: br#"{"order":"o-42"}"#,
/// }, &Default::default()).await?;
/// tx.commit().await?;
/// println!("{}", emitted.event_id());
/// # Ok(()) }
/// ```
pub async fn emit(tx: &mut Transaction<'_, Postgres>, request: &EmitRequest<'_>, options: &EmitOptions) -> Result<Emitted, ProducerError> {
    request.validate(options.max_payload_bytes)?;
    if let Some(tp) = options.traceparent.as_deref().filter(|tp| !is_traceparent(tp)) {
        return Err(outbox_core::CoreError::MalformedIdentifier { field: "traceparent", reason: format!("{tp:?} is not a W3C traceparent") }.into());
    }

    // One round trip for everything the freeze needs.
    let ctx = sqlx::query(&format!(
        "SELECT pg_current_xact_id()::text::bigint AS txid,
                (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS now_ms,
                (SELECT event_id FROM outbox_commands WHERE command_key = $1) AS existing,
                (SELECT max(aggregate_version) FROM outbox_commands
                  WHERE tenant = $2 AND aggregate_type = $3 AND aggregate_id = $4) AS last_version,
                p.*, t.*
         FROM (SELECT 1) one
         LEFT JOIN LATERAL (SELECT {} FROM outbox_route_policies WHERE event_type = $5
                            ORDER BY generation DESC LIMIT 1) p ON true
         LEFT JOIN LATERAL (SELECT generation AS takeover_generation, event_types AS takeover_event_types,
                                   percent_bp AS takeover_percent_bp
                            FROM outbox_takeover_policies ORDER BY generation DESC LIMIT 1) t ON true",
        routes::POLICY_COLUMNS
    ))
    .bind(request.command_key)
    .bind(request.tenant)
    .bind(request.aggregate_type)
    .bind(request.aggregate_id)
    .bind(request.event_type)
    .fetch_one(&mut **tx)
    .await?;
    if ctx.try_get::<Option<String>, _>("existing")?.is_some() {
        if let Some(existing) = existing_for_command(tx, request).await? {
            return Ok(existing);
        }
    }

    let policy: RoutePolicy =
        routes::from_row_opt(&ctx)?.ok_or_else(|| ProducerError::NoRoute { event_type: request.event_type.to_owned() })?;

    let last: Option<i64> = ctx.try_get("last_version")?;
    if let Some(last) = last.filter(|&l| request.aggregate_version < l) {
        return Err(ProducerError::AggregateVersionBackwards {
            aggregate: format!("{}/{}", request.aggregate_type, request.aggregate_id),
            version: request.aggregate_version,
            last,
        });
    }

    let txid: i64 = ctx.try_get("txid")?;
    let now_ms: i64 = ctx.try_get("now_ms")?;
    let event_id = EventId::generate(now_ms.max(0) as u64);
    let (envelope, destination) = request.freeze(event_id, now_ms, txid.max(0) as u64, &policy)?;
    let destination_digest = destination.digest();
    let takeover = match ctx.try_get::<Option<i32>, _>("takeover_generation")? {
        None => None,
        Some(generation) => Some(TakeoverPolicy {
            generation: generation as u32,
            event_types: ctx.try_get("takeover_event_types")?,
            percent_bp: ctx.try_get::<i32, _>("takeover_percent_bp")? as u32,
        }),
    };
    let publisher = decide_publisher(takeover.as_ref(), &envelope.event_type, &envelope.event_id);

    // The command key, the event row, its frozen envelope and the wake-up
    // notification in one statement. A concurrent transaction holding the
    // same command key makes this wait; if it commits, nothing is inserted here.
    let inserted: i64 = sqlx::query_scalar(
        "WITH cmd AS (
            INSERT INTO outbox_commands (command_key, event_id, tenant, aggregate_type, aggregate_id, aggregate_version)
            VALUES ($2, $1, $3, $4, $5, $6)
            ON CONFLICT (command_key) DO NOTHING
            RETURNING event_id),
         ins AS (
            INSERT INTO outbox_events (event_id, command_key, envelope_generation, state, tenant, aggregate_type, aggregate_id,
                 aggregate_version, event_type, payload, payload_digest, destination_digest, cluster_id, topic, partition,
                 routing_key, ordered, created_at_ms, state_since_ms, traceparent, publisher, takeover_generation)
            SELECT $1, $2, 1, 'PENDING', $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $16, $17, $22, $23 FROM cmd
            RETURNING event_id),
         env AS (
            INSERT INTO outbox_envelopes (event_id, envelope_generation, envelope_canonical, envelope_digest,
                 destination_canonical, destination_digest, payload_digest, created_txid, created_at_ms)
            SELECT event_id, 1, $18, $19, $20, $10, $9, $21, $16 FROM ins
            RETURNING event_id),
         wake AS (SELECT pg_notify('outbox_pending', '') FROM env)
         SELECT (SELECT count(*) FROM ins) + 0 * (SELECT count(*) FROM wake)",
    )
    .bind(envelope.event_id.as_str())
    .bind(request.command_key)
    .bind(&envelope.tenant)
    .bind(&envelope.aggregate_type)
    .bind(&envelope.aggregate_id)
    .bind(envelope.aggregate_version)
    .bind(&envelope.event_type)
    .bind(request.payload)
    .bind(&envelope.payload_digest)
    .bind(&destination_digest)
    .bind(&destination.cluster_id)
    .bind(&destination.topic)
    .bind(destination.partition)
    .bind(&destination.routing_key)
    .bind(destination.ordering == outbox_core::Ordering::Key)
    .bind(now_ms)
    .bind(options.traceparent.as_deref())
    .bind(envelope.canonical_bytes())
    .bind(envelope.digest())
    .bind(destination.canonical_bytes())
    .bind(txid)
    .bind(publisher.as_str())
    .bind(takeover.as_ref().map(|t| t.generation as i32))
    .fetch_one(&mut **tx)
    .await?;

    if inserted == 0 {
        // Another transaction committed the same command key meanwhile.
        return existing_for_command(tx, request)
            .await?
            .ok_or_else(|| ProducerError::Config("command key conflict vanished; retry the transaction".into()));
    }
    tracing::debug!(event_id = %envelope.event_id, topic = %destination.topic, publisher = publisher.as_str(), "emitted");
    Ok(Emitted { envelope, destination, destination_digest, inserted: true, publisher })
}

async fn existing_for_command(tx: &mut Transaction<'_, Postgres>, request: &EmitRequest<'_>) -> Result<Option<Emitted>, ProducerError> {
    let row = sqlx::query(
        "SELECT e.event_id, e.payload_digest, e.event_type, e.tenant, e.aggregate_type, e.aggregate_id,
                v.envelope_canonical, v.destination_canonical, v.destination_digest, e.publisher
         FROM outbox_commands c
         JOIN outbox_events e ON e.event_id = c.event_id
         JOIN outbox_envelopes v ON v.event_id = e.event_id AND v.envelope_generation = 1
         WHERE c.command_key = $1",
    )
    .bind(request.command_key)
    .fetch_optional(&mut **tx)
    .await?;
    let Some(row) = row else { return Ok(None) };
    let envelope = Envelope::from_canonical(row.try_get::<Vec<u8>, _>("envelope_canonical")?.as_slice())?;
    let conflict = |what| ProducerError::CommandKeyConflict { command_key: request.command_key.to_owned(), event_id: envelope.event_id.clone(), what };
    if envelope.payload_digest != outbox_core::sha256_digest(request.payload) {
        return Err(conflict("payload"));
    }
    if envelope.event_type != request.event_type {
        return Err(conflict("event type"));
    }
    if envelope.tenant != request.tenant || envelope.aggregate_type != request.aggregate_type || envelope.aggregate_id != request.aggregate_id {
        return Err(conflict("aggregate"));
    }
    let destination = Destination::from_canonical(row.try_get::<Vec<u8>, _>("destination_canonical")?.as_slice())?;
    let publisher = Publisher::parse(row.try_get("publisher")?)?;
    Ok(Some(Emitted { envelope, destination, destination_digest: row.try_get("destination_digest")?, inserted: false, publisher }))
}
