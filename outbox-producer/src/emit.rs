//! `emit`: the PENDING envelope inserted inside the caller's own transaction.

use outbox_core::{decide_command, decide_publisher, Command, CommandRefusal, sha256_digest, Destination, EmitRequest, Envelope, EventId, Publisher, RoutePolicy, TakeoverPolicy, DEFAULT_MAX_PAYLOAD_BYTES};
use std::collections::{HashMap, HashSet};

use sqlx::{Postgres, Row, Transaction};

use crate::error::ProducerError;
use crate::routes;

/// Limits and choices applied by [`emit`] and [`emit_batch`].
#[derive(Debug, Clone)]
pub struct EmitOptions {
    /// Largest accepted payload, bytes.
    pub max_payload_bytes: usize,
    /// The W3C `traceparent` of the request that committed the business
    /// change; the dispatcher sends it as a header so the trace continues
    /// through the broker. Validated per W3C Trace Context (version `ff`,
    /// all-zero ids and upper-case hex are refused). When `None` (the
    /// default), `emit` takes the current tracing span's OpenTelemetry
    /// context, if there is one (feature `otel`, with a
    /// `tracing_opentelemetry` layer installed).
    pub traceparent: Option<String>,
    /// The W3C `tracestate` that goes with `traceparent` (only with it; at
    /// most 512 bytes and 32 members, validated). Sent as the `tracestate`
    /// header. When `traceparent` is `None`, the current span's trace state
    /// is taken with its context.
    pub tracestate: Option<String>,
    /// Whether the transaction wakes listening dispatchers when it commits
    /// (`NOTIFY outbox_pending`; default `true`). Without it, dispatchers
    /// find the events at their next claim: at once while they are busy,
    /// within `poll_interval_ms` when idle.
    ///
    /// PostgreSQL commits transactions that notify one at a time, each
    /// waiting for the previous one's WAL flush, where it would otherwise
    /// flush many commits together. Where many emitting transactions commit
    /// at once, or the disk's flush is slow, turn this off and lower the
    /// dispatchers' `poll_interval_ms` instead. Measured on a 2-core machine,
    /// 16 sessions committing a one-row insert: 4,762 commits/s with a
    /// notification each, 12,843 without.
    pub wake_dispatcher: bool,
}

impl Default for EmitOptions {
    fn default() -> Self {
        EmitOptions { max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES, traceparent: None, tracestate: None, wake_dispatcher: true }
    }
}

/// Whether `s` is a valid W3C `traceparent`: `vv-<32 hex>-<16 hex>-<2 hex>`,
/// lower-case, version not `ff`, trace id and parent id not all zero
/// ([`outbox_core::trace_context::TraceParent::parse`]).
pub fn is_traceparent(s: &str) -> bool {
    outbox_core::trace_context::is_traceparent(s)
}

/// The trace context the events of one emit carry: the caller's
/// `traceparent` when given (validated), else the current tracing span's
/// OpenTelemetry context when there is one (feature `otel`).
fn trace_context(options: &EmitOptions) -> Result<(Option<String>, Option<String>), ProducerError> {
    let bad = |field: &'static str, value: &str, e: outbox_core::trace_context::TraceContextError| -> ProducerError {
        let shown: String = value.chars().take(100).collect();
        outbox_core::CoreError::MalformedIdentifier { field, reason: format!("{shown:?}: {e}") }.into()
    };
    if let Some(ts) = options.tracestate.as_deref() {
        if options.traceparent.is_none() {
            return Err(outbox_core::CoreError::MalformedIdentifier { field: "tracestate", reason: "a tracestate needs a traceparent".into() }.into());
        }
        outbox_core::trace_context::validate_tracestate(ts).map_err(|e| bad("tracestate", ts, e))?;
    }
    if let Some(tp) = options.traceparent.as_deref() {
        outbox_core::trace_context::TraceParent::parse(tp).map_err(|e| bad("traceparent", tp, e))?;
        return Ok((Some(tp.to_owned()), options.tracestate.clone()));
    }
    Ok(crate::otel::current_trace_context().map_or((None, None), |(tp, ts)| (Some(tp), ts)))
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
    /// Who sends it, frozen at emit by the takeover policy (PROTOCOL §11):
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
    emit_batch(tx, std::slice::from_ref(request), options)
        .await?
        .pop()
        .ok_or_else(|| ProducerError::Config("emit of one request answered nothing".into()))
}

/// Most requests one [`emit_batch`] call takes.
pub const MAX_EMIT_BATCH: usize = 10_000;

/// [`emit`] for many requests of one transaction in two round trips: the
/// answers are, in order, what `emit` would have answered for each request
/// in turn. A command key repeated within the batch is a retried command (the
/// later request gets the first one's identity, or a
/// [`ProducerError::CommandKeyConflict`]); aggregate versions must not go
/// backwards within the batch either. All or nothing: the first invalid
/// request fails the call and nothing is written.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use outbox_core::EmitRequest;
/// let lines = [("o-42", 1), ("o-43", 1)];
/// let keys: Vec<String> = lines.iter().map(|(o, _)| format!("create-order-{o}")).collect();
/// let requests: Vec<EmitRequest> = lines
///     .iter()
///     .zip(&keys)
///     .map(|((order, version), key)| EmitRequest {
///         command_key: key,
///         tenant: "tenant-7",
///         aggregate_type: "order",
///         aggregate_id: order,
///         aggregate_version: *version,
///         event_type: "order.created.v2",
///         payload_schema: "order-v2",
///         payload: br#"{"order":"created"}"#,
///     })
///     .collect();
/// let mut tx = pool.begin().await?;
/// let emitted = outbox_producer::emit_batch(&mut tx, &requests, &Default::default()).await?;
/// tx.commit().await?;
/// assert_eq!(emitted.len(), 2);
/// # Ok(()) }
/// ```
pub async fn emit_batch(tx: &mut Transaction<'_, Postgres>, requests: &[EmitRequest<'_>], options: &EmitOptions) -> Result<Vec<Emitted>, ProducerError> {
    if requests.is_empty() {
        return Ok(Vec::new());
    }
    if requests.len() > MAX_EMIT_BATCH {
        return Err(ProducerError::BatchTooLarge { len: requests.len(), max: MAX_EMIT_BATCH });
    }
    for request in requests {
        request.validate(options.max_payload_bytes)?;
    }
    let (traceparent, tracestate) = trace_context(options)?;

    // One round trip for everything the freeze needs: the transaction id and
    // clock, which command keys exist, the last version of each aggregate,
    // the current takeover policy and one row per event type's current route.
    // The lookup first takes a transaction-scoped advisory lock per
    // aggregate (in key order; `outbox_emit_lookup` in the schema): a concurrent emit
    // of the same aggregate waits here until this transaction ends and then
    // reads the version it committed, so the versions check below holds at
    // READ COMMITTED. An advisory lock writes nothing, where a row lock on an
    // aggregate head row would cost each emit one more row version and its
    // WAL; taken inside this query, it adds no round trip.
    let keys: Vec<&str> = requests.iter().map(|r| r.command_key).collect();
    let mut aggregates: Vec<(&str, &str, &str)> = requests.iter().map(|r| (r.tenant, r.aggregate_type, r.aggregate_id)).collect();
    aggregates.sort_unstable();
    aggregates.dedup();
    let mut event_types: Vec<&str> = requests.iter().map(|r| r.event_type).collect();
    event_types.sort_unstable();
    event_types.dedup();
    let rows = sqlx::query(&format!(
        "WITH ctx AS (
            SELECT pg_current_xact_id()::text::bigint AS txid,
                   (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS now_ms,
                   (SELECT dispatch_path = 'stream' FROM outbox_settings) AS stream_path,
                   -- Index probes whatever the statistics were when this
                   -- session planned them (schema section 6).
                   l.existing, l.last_versions, t.*
            FROM outbox_emit_lookup($1::text[], $2::text[], $3::text[], $4::text[]) l
            LEFT JOIN LATERAL (SELECT generation AS takeover_generation, event_types AS takeover_event_types,
                                      percent_bp AS takeover_percent_bp
                               FROM outbox_takeover_policies ORDER BY generation DESC LIMIT 1) t ON true)
         SELECT ctx.*, p.* FROM ctx
         LEFT JOIN LATERAL (SELECT DISTINCT ON (event_type) {}
                            FROM outbox_route_policies WHERE event_type = ANY($5)
                            ORDER BY event_type, generation DESC) p ON true",
        routes::POLICY_COLUMNS
    ))
    .bind(&keys)
    .bind(aggregates.iter().map(|a| a.0).collect::<Vec<_>>())
    .bind(aggregates.iter().map(|a| a.1).collect::<Vec<_>>())
    .bind(aggregates.iter().map(|a| a.2).collect::<Vec<_>>())
    .bind(&event_types)
    .fetch_all(&mut **tx)
    .await?;
    let ctx = rows.first().ok_or_else(|| ProducerError::Config("emit context query answered no row".into()))?;
    let txid: i64 = ctx.try_get("txid")?;
    let now_ms: i64 = ctx.try_get("now_ms")?;
    let stream_path: bool = ctx.try_get::<Option<bool>, _>("stream_path")?.unwrap_or(false);
    let existing: HashSet<String> = ctx.try_get::<Vec<String>, _>("existing")?.into_iter().collect();
    let mut last_version: HashMap<(&str, &str, &str), i64> = HashMap::with_capacity(aggregates.len());
    for (aggregate, last) in aggregates.iter().zip(ctx.try_get::<Vec<Option<i64>>, _>("last_versions")?) {
        if let Some(last) = last {
            last_version.insert(*aggregate, last);
        }
    }
    let takeover = match ctx.try_get::<Option<i32>, _>("takeover_generation")? {
        None => None,
        Some(generation) => Some(TakeoverPolicy {
            generation: generation as u32,
            event_types: ctx.try_get("takeover_event_types")?,
            percent_bp: ctx.try_get::<i32, _>("takeover_percent_bp")? as u32,
        }),
    };
    let mut policies: HashMap<String, RoutePolicy> = HashMap::with_capacity(rows.len());
    for row in &rows {
        if let Some(policy) = routes::from_row_opt(row)? {
            policies.insert(policy.event_type.clone(), policy);
        }
    }

    // The committed events of the command keys seen, in one query.
    let mut committed = committed_for_commands(tx, requests.iter().map(|r| r.command_key).filter(|k| existing.contains(*k))).await?;

    // Decide each request in order, exactly as one emit after another would.
    enum Answer {
        New(usize),
        Existing(Box<Emitted>),
    }
    let mut answers: Vec<Answer> = Vec::with_capacity(requests.len());
    let mut fresh: Vec<Frozen<'_, '_>> = Vec::with_capacity(requests.len());
    let mut first_of_key: HashMap<&str, usize> = HashMap::new();
    for request in requests {
        if let Some(&n) = first_of_key.get(request.command_key) {
            let first = match &answers[n] {
                Answer::New(i) => fresh[*i].emitted.clone(),
                Answer::Existing(e) => (**e).clone(),
            };
            answers.push(Answer::Existing(Box::new(same_command(request, Emitted { inserted: false, ..first })?)));
            continue;
        }
        first_of_key.insert(request.command_key, answers.len());
        if let Some(found) = committed.remove(request.command_key) {
            answers.push(Answer::Existing(Box::new(same_command(request, found)?)));
            continue;
        }
        let policy = policies.get(request.event_type).ok_or_else(|| ProducerError::NoRoute { event_type: request.event_type.to_owned() })?;
        let aggregate = (request.tenant, request.aggregate_type, request.aggregate_id);
        let digest = sha256_digest(request.payload);
        // With no earlier event for the key, the only refusal is the version's.
        if let Err(CommandRefusal::VersionBackwards { last }) = decide_command(&command_of(request, &digest), None, last_version.get(&aggregate).copied()) {
            return Err(backwards(request, last));
        }
        last_version.insert(aggregate, request.aggregate_version);
        let event_id = EventId::generate(now_ms.max(0) as u64);
        let (envelope, destination) = request.freeze(event_id, now_ms, txid.max(0) as u64, policy)?;
        // Each canonical encoding is made once: stored, and hashed for its digest.
        let (envelope_bytes, destination_bytes) = (envelope.canonical_bytes(), destination.canonical_bytes());
        let (envelope_digest, destination_digest) = (sha256_digest(&envelope_bytes), sha256_digest(&destination_bytes));
        let publisher = decide_publisher(takeover.as_ref(), &envelope.event_type, &envelope.event_id);
        answers.push(Answer::New(fresh.len()));
        let emitted = Emitted { envelope, destination, destination_digest, inserted: true, publisher };
        fresh.push(Frozen { request, emitted, envelope_bytes, envelope_digest, destination_bytes });
    }

    // The command keys, event rows, frozen envelopes and the wake-up
    // notification in one statement. A concurrent transaction holding one of
    // the command keys makes this wait; if it commits, that request's rows are
    // not inserted here and it answers the committed event.
    let mut inserted: HashSet<String> = HashSet::new();
    if !fresh.is_empty() {
        let f = fresh.as_slice();
        let ids: Vec<String> = sqlx::query_scalar(
            "WITH input AS (
                SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bigint[], $7::text[], $8::bytea[],
                                     $9::text[], $10::text[], $11::text[], $12::text[], $13::int[], $14::text[], $15::bool[],
                                     $16::bytea[], $17::text[], $18::bytea[], $19::text[], $20::int[], $27::smallint[], $28::text[])
                    WITH ORDINALITY AS i(event_id, command_key, tenant, aggregate_type, aggregate_id, aggregate_version, event_type, payload,
                                         payload_digest, destination_digest, cluster_id, topic, partition, routing_key, ordered,
                                         envelope_canonical, envelope_digest, destination_canonical, publisher, takeover_generation,
                                         bucket, topic_id, ord)),
             cmd AS (
                INSERT INTO outbox_commands (command_key, event_id, tenant, aggregate_type, aggregate_id, aggregate_version)
                SELECT command_key, event_id, tenant, aggregate_type, aggregate_id, aggregate_version FROM input ORDER BY ord
                ON CONFLICT (command_key) DO NOTHING
                RETURNING event_id),
             -- The stream path (schema section 17): the outbox's own events
             -- are one stream row each; the legacy publisher's stay rows of
             -- outbox_events, which the dispatcher never sends.
             st AS (
                INSERT INTO outbox_stream (bucket, event_id, command_key, tenant, aggregate_type, aggregate_id, aggregate_version,
                     event_type, traceparent, tracestate, payload, payload_digest, cluster_id, topic, topic_id, partition, routing_key,
                     ordered, envelope_canonical, envelope_digest, destination_canonical, destination_digest, created_txid, created_at_ms,
                     takeover_generation)
                SELECT i.bucket, i.event_id, i.command_key, i.tenant, i.aggregate_type, i.aggregate_id, i.aggregate_version,
                       i.event_type, $22, $25, i.payload, i.payload_digest, i.cluster_id, i.topic, i.topic_id, i.partition, i.routing_key,
                       i.ordered, i.envelope_canonical, i.envelope_digest, i.destination_canonical, i.destination_digest, $23, $21,
                       i.takeover_generation
                FROM input i JOIN cmd USING (event_id) WHERE $26 AND i.publisher = 'outbox' ORDER BY i.ord
                RETURNING event_id),
             ins AS (
                INSERT INTO outbox_events (event_id, command_key, envelope_generation, state, tenant, aggregate_type, aggregate_id,
                     aggregate_version, event_type, payload, payload_digest, destination_digest, cluster_id, topic, partition,
                     routing_key, ordered, created_at_ms, state_since_ms, traceparent, tracestate, publisher, takeover_generation)
                SELECT i.event_id, i.command_key, 1, 'PENDING', i.tenant, i.aggregate_type, i.aggregate_id, i.aggregate_version,
                       i.event_type, i.payload, i.payload_digest, i.destination_digest, i.cluster_id, i.topic, i.partition,
                       i.routing_key, i.ordered, $21, $21, $22, $25, i.publisher, i.takeover_generation
                FROM input i JOIN cmd USING (event_id) WHERE NOT ($26 AND i.publisher = 'outbox') ORDER BY i.ord
                RETURNING event_id),
             env AS (
                INSERT INTO outbox_envelopes (event_id, envelope_generation, envelope_canonical, envelope_digest,
                     destination_canonical, destination_digest, payload_digest, created_txid, created_at_ms)
                SELECT i.event_id, 1, i.envelope_canonical, i.envelope_digest, i.destination_canonical, i.destination_digest,
                       i.payload_digest, $23, $21
                FROM input i JOIN ins USING (event_id)
                RETURNING event_id),
             wake AS (SELECT pg_notify('outbox_pending', '') WHERE $24 AND (EXISTS (SELECT 1 FROM env) OR EXISTS (SELECT 1 FROM st)))
             SELECT event_id FROM ins WHERE (SELECT count(*) FROM wake) >= 0
             UNION ALL SELECT event_id FROM st",
        )
        .bind(col(f, |x| x.emitted.envelope.event_id.as_str()))
        .bind(col(f, |x| x.request.command_key))
        .bind(col(f, |x| x.emitted.envelope.tenant.as_str()))
        .bind(col(f, |x| x.emitted.envelope.aggregate_type.as_str()))
        .bind(col(f, |x| x.emitted.envelope.aggregate_id.as_str()))
        .bind(col(f, |x| x.emitted.envelope.aggregate_version))
        .bind(col(f, |x| x.emitted.envelope.event_type.as_str()))
        .bind(col(f, |x| x.request.payload))
        .bind(col(f, |x| x.emitted.envelope.payload_digest.as_str()))
        .bind(col(f, |x| x.emitted.destination_digest.as_str()))
        .bind(col(f, |x| x.emitted.destination.cluster_id.as_str()))
        .bind(col(f, |x| x.emitted.destination.topic.as_str()))
        .bind(col(f, |x| x.emitted.destination.partition))
        .bind(col(f, |x| x.emitted.destination.routing_key.as_str()))
        .bind(col(f, |x| x.emitted.destination.ordering == outbox_core::Ordering::Key))
        .bind(col(f, |x| x.envelope_bytes.as_slice()))
        .bind(col(f, |x| x.envelope_digest.as_str()))
        .bind(col(f, |x| x.destination_bytes.as_slice()))
        .bind(col(f, |x| x.emitted.publisher.as_str()))
        .bind(col(f, |_| takeover.as_ref().map(|t| t.generation as i32)))
        .bind(now_ms)
        .bind(traceparent.as_deref())
        .bind(txid)
        .bind(options.wake_dispatcher)
        .bind(tracestate.as_deref())
        .bind(stream_path)
        .bind(col(f, |x| outbox_core::stream::stream_bucket(&x.emitted.destination, &x.emitted.envelope.event_id) as i16))
        .bind(col(f, |x| x.emitted.destination.topic_id.as_deref()))
        .fetch_all(&mut **tx)
        .await?;
        inserted.extend(ids);
    }

    // Requests not inserted: another transaction committed the same command
    // key meanwhile; they answer its event.
    let lost = fresh.iter().filter(|f| !inserted.contains(f.emitted.envelope.event_id.as_str())).map(|f| f.request.command_key);
    let mut raced = committed_for_commands(tx, lost).await?;
    let mut out = Vec::with_capacity(answers.len());
    for answer in answers {
        match answer {
            Answer::Existing(e) => out.push(*e),
            Answer::New(i) => {
                let Frozen { request, emitted, .. } = &fresh[i];
                if inserted.contains(emitted.envelope.event_id.as_str()) {
                    tracing::debug!(event_id = %emitted.envelope.event_id, topic = %emitted.destination.topic, publisher = emitted.publisher.as_str(), "emitted");
                    out.push(emitted.clone());
                } else {
                    let found = raced
                        .remove(request.command_key)
                        .ok_or_else(|| ProducerError::Config("command key conflict vanished; retry the transaction".into()))?;
                    out.push(same_command(request, found)?);
                }
            }
        }
    }
    Ok(out)
}

/// A request of a batch with what `emit_batch` froze for it, and the canonical
/// bytes it stores.
struct Frozen<'b, 'r> {
    request: &'b EmitRequest<'r>,
    emitted: Emitted,
    envelope_bytes: Vec<u8>,
    envelope_digest: String,
    destination_bytes: Vec<u8>,
}

/// One column of the batch insert.
fn col<'a, T>(fresh: &'a [Frozen<'_, '_>], f: impl Fn(&'a Frozen<'_, '_>) -> T) -> Vec<T> {
    fresh.iter().map(f).collect()
}

/// A request repeating a command key already answered by `first`: the same
/// command (answer `first`) or a [`ProducerError::CommandKeyConflict`], as
/// [`decide_command`] decides.
fn same_command(request: &EmitRequest<'_>, first: Emitted) -> Result<Emitted, ProducerError> {
    let digest = sha256_digest(request.payload);
    let decision = decide_command(&command_of(request, &digest), Some(&Command::of(request.command_key, &first.envelope)), None);
    match decision {
        Ok(_) => Ok(first),
        Err(CommandRefusal::KeyReused { what }) => {
            Err(ProducerError::CommandKeyConflict { command_key: request.command_key.to_owned(), event_id: first.envelope.event_id.clone(), what })
        }
        // Not given a last version, a repeat is never refused for one.
        Err(CommandRefusal::VersionBackwards { last }) => Err(backwards(request, last)),
    }
}

fn backwards(request: &EmitRequest<'_>, last: i64) -> ProducerError {
    ProducerError::AggregateVersionBackwards { aggregate: format!("{}/{}", request.aggregate_type, request.aggregate_id), version: request.aggregate_version, last }
}

fn command_of<'a>(request: &'a EmitRequest<'a>, payload_digest: &'a str) -> Command<'a> {
    Command {
        command_key: request.command_key,
        payload_digest,
        event_type: request.event_type,
        tenant: request.tenant,
        aggregate_type: request.aggregate_type,
        aggregate_id: request.aggregate_id,
        aggregate_version: request.aggregate_version,
    }
}

/// The committed events of `keys`, by command key, as first emitted
/// (`inserted: false`); one query, none for no keys. Each still has to be
/// checked against the request that repeats its key ([`same_command`]).
async fn committed_for_commands<'k>(tx: &mut Transaction<'_, Postgres>, keys: impl Iterator<Item = &'k str>) -> Result<HashMap<String, Emitted>, ProducerError> {
    let keys: Vec<&str> = keys.collect();
    if keys.is_empty() {
        return Ok(HashMap::new());
    }
    // Primary-key probes whatever the statistics (schema section 6).
    let rows = sqlx::query("SELECT * FROM outbox_emit_committed($1)").bind(&keys).fetch_all(&mut **tx).await?;
    let mut found = HashMap::with_capacity(rows.len());
    for row in &rows {
        let envelope = Envelope::from_canonical(row.try_get::<&[u8], _>("envelope_canonical")?)?;
        let destination = Destination::from_canonical(row.try_get::<&[u8], _>("destination_canonical")?)?;
        let publisher = Publisher::parse(row.try_get("publisher")?)?;
        let emitted = Emitted { envelope, destination, destination_digest: row.try_get("destination_digest")?, inserted: false, publisher };
        found.insert(row.try_get("command_key")?, emitted);
    }
    Ok(found)
}

/// Which emits write their aggregates' head rows (`outbox_aggregate_heads`),
/// the row two emits of one aggregate both write, so that an emit whose
/// snapshot predates another's commit fails with a retryable serialization
/// error instead of committing a version below the other's.
///
/// An emit at READ COMMITTED needs no head row: it reads the aggregate's
/// last version after taking the aggregate's lock. An emit at REPEATABLE
/// READ or SERIALIZABLE reads with a snapshot taken at its transaction's
/// first statement, before the lock, and only a row both emits write shows
/// it a version committed since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AggregateHeads {
    /// Emits at REPEATABLE READ or SERIALIZABLE write head rows (the
    /// default): enough when every emit of an aggregate runs at one of
    /// those levels, or every one at READ COMMITTED. Costs READ COMMITTED
    /// emits nothing.
    SnapshotIsolation,
    /// Every emit writes its aggregates' head rows (one more row write per
    /// aggregate per emitting transaction): for a service whose emits of
    /// one aggregate run at READ COMMITTED and at REPEATABLE READ.
    Always,
}

impl AggregateHeads {
    /// The setting's name in `outbox_settings.aggregate_heads`.
    pub fn as_str(self) -> &'static str {
        match self {
            AggregateHeads::SnapshotIsolation => "snapshot_isolation",
            AggregateHeads::Always => "always",
        }
    }

    /// The setting of a name ([`Self::as_str`]).
    pub fn parse(s: &str) -> Option<AggregateHeads> {
        match s {
            "snapshot_isolation" => Some(AggregateHeads::SnapshotIsolation),
            "always" => Some(AggregateHeads::Always),
            _ => None,
        }
    }
}

/// Sets which emits write their aggregates' head rows ([`AggregateHeads`]);
/// emits that start after the commit follow it.
pub async fn set_aggregate_heads(pool: &sqlx::PgPool, heads: AggregateHeads) -> Result<(), ProducerError> {
    sqlx::query("UPDATE outbox_settings SET aggregate_heads = $1").bind(heads.as_str()).execute(pool).await?;
    Ok(())
}

/// Which emits write their aggregates' head rows now.
pub async fn aggregate_heads(pool: &sqlx::PgPool) -> Result<AggregateHeads, ProducerError> {
    let s: String = sqlx::query_scalar("SELECT aggregate_heads FROM outbox_settings").fetch_one(pool).await?;
    AggregateHeads::parse(&s).ok_or_else(|| ProducerError::Config(format!("unknown aggregate_heads setting {s:?}")))
}
