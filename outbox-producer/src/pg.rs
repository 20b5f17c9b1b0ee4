//! The PostgreSQL store: claims, attempts, the receipt transaction,
//! unknown/retry, lease expiry. Every method is one transaction; every
//! decision is outbox-core's.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock};

use async_trait::async_trait;
use outbox_core::claim::{check_fence, not_sent_backoff_ms, validate_lease_ms, Claim, FencedWrite, MAX_CLAIM_BATCH, NOT_SENT_BACKOFF_MAX_MS};
use outbox_core::{
    decide_receipt, AttemptId, AttemptRecord, AttemptState, BrokerReceipt, ClaimToken, ClaimedEvent, Clock, CoreError, Destination, Envelope,
    EventId, EventState, FenceOutcome, LockedEvent, OutboxStore, ReceiptDecision, ReceiptOutcome, ReconcileDecision, ReconcileTask, StoreError,
    SweepOutcome, SystemClock,
};
use sqlx::postgres::PgRow;
use sqlx::{PgPool, Postgres, Row, Transaction};

use crate::service_store::ClaimRound;
use crate::cloudevents::CloudEventsCache;
use crate::error::store_err;

type PgQuery<'q> = sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>;

/// Largest number of rows one lease sweep touches.
pub const MAX_SWEEP_ROWS: i64 = 10_000;

/// The PostgreSQL implementation of [`OutboxStore`].
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    clock: Arc<dyn Clock>,
    cluster_scope: Option<String>,
    max_protocol_version: i32,
    /// The source identity and route generations read for CloudEvents headers.
    cloudevents: Arc<CloudEventsCache>,
    /// Whether reconcile tasks measure attempt ages with the database's
    /// clock (on for [`PgStore::new`]; a store on a test clock measures
    /// with that clock only).
    database_clock: bool,
}

/// The protocol version of [`crate::PROTOCOL_VERSION`], as a number.
fn own_protocol_version() -> i32 {
    crate::PROTOCOL_VERSION.parse().unwrap_or(1)
}

fn parse_id<T: std::str::FromStr<Err = CoreError>>(s: &str) -> Result<T, StoreError> {
    s.parse().map_err(StoreError::Core)
}

fn attempt_from_row(r: &PgRow) -> Result<AttemptRecord, StoreError> {
    let g = |e: sqlx::Error| store_err(e);
    Ok(AttemptRecord {
        attempt_id: parse_id(r.try_get::<&str, _>("attempt_id").map_err(g)?)?,
        event_id: parse_id(r.try_get::<&str, _>("event_id").map_err(g)?)?,
        envelope_generation: r.try_get::<i32, _>("envelope_generation").map_err(g)? as u32,
        attempt_generation: r.try_get::<i32, _>("attempt_generation").map_err(g)? as u32,
        claim_generation: r.try_get::<i64, _>("claim_generation").map_err(g)? as u64,
        owner: r.try_get("owner").map_err(g)?,
        state: AttemptState::parse(r.try_get("state").map_err(g)?)?,
        destination_digest: r.try_get("destination_digest").map_err(g)?,
        started_at_ms: r.try_get("started_at_ms").map_err(g)?,
        send_deadline_ms: r.try_get("send_deadline_ms").map_err(g)?,
        scan_from_offset: r.try_get("scan_from_offset").map_err(g)?,
        scan_anchor: r.try_get::<Option<&str>, _>("scan_anchor_event_id").map_err(g)?.map(parse_id).transpose()?,
        scan_anchor_attempt: r.try_get::<Option<&str>, _>("scan_anchor_attempt_id").map_err(g)?.map(parse_id).transpose()?,
    })
}

fn receipt_from_row(r: &PgRow) -> Result<BrokerReceipt, StoreError> {
    let g = |e: sqlx::Error| store_err(e);
    Ok(BrokerReceipt {
        event_id: parse_id(r.try_get::<&str, _>("event_id").map_err(g)?)?,
        envelope_generation: r.try_get::<i32, _>("envelope_generation").map_err(g)? as u32,
        attempt_id: parse_id(r.try_get::<&str, _>("attempt_id").map_err(g)?)?,
        payload_digest: r.try_get("payload_digest").map_err(g)?,
        destination_digest: r.try_get("destination_digest").map_err(g)?,
        cluster_id: r.try_get("cluster_id").map_err(g)?,
        topic: r.try_get("topic").map_err(g)?,
        topic_id: r.try_get("topic_id").map_err(g)?,
        partition: r.try_get("partition").map_err(g)?,
        offset: r.try_get("offset").map_err(g)?,
    })
}

const ATTEMPT_COLUMNS: &str =
    "attempt_id, event_id, envelope_generation, attempt_generation, claim_generation, owner, state, destination_digest, started_at_ms, scan_from_offset, send_deadline_ms, scan_anchor_event_id, scan_anchor_attempt_id";
const RECEIPT_COLUMNS: &str = "event_id, envelope_generation, attempt_id, payload_digest, destination_digest, cluster_id, topic, topic_id, partition, \"offset\"";

/// A log position: cluster, topic, topic id (`None` for `destination.v1`),
/// partition, offset.
type Position = (String, String, Option<String>, i32, i64);

/// A claimed row whose frozen envelope or destination cannot be read:
/// `(event id, envelope generation, why)`.
type Unreadable = (String, i32, String);

/// The frozen envelope and destination of a claimed row (columns
/// `envelope_canonical`, `destination_canonical`), or why they cannot be read.
fn frozen_records(r: &PgRow) -> Result<Result<(Envelope, Destination), Unreadable>, StoreError> {
    let envelope = Envelope::from_canonical(r.try_get::<&[u8], _>("envelope_canonical").map_err(store_err)?);
    let destination = Destination::from_canonical(r.try_get::<&[u8], _>("destination_canonical").map_err(store_err)?);
    Ok(match envelope.and_then(|e| destination.map(|d| (e, d))) {
        Ok(p) => Ok(p),
        Err(e) => Err((r.try_get("event_id").map_err(store_err)?, r.try_get("envelope_generation").map_err(store_err)?, e.to_string())),
    })
}

/// The claim a row's columns `claim_owner`, `claim_generation` and
/// `lease_until_ms` describe.
fn claim_token(r: &PgRow, event_id: &EventId) -> Result<ClaimToken, StoreError> {
    Ok(ClaimToken {
        event_id: event_id.clone(),
        owner: r.try_get("claim_owner").map_err(store_err)?,
        claim_generation: r.try_get::<i64, _>("claim_generation").map_err(store_err)? as u64,
        lease_until_ms: r.try_get("lease_until_ms").map_err(store_err)?,
    })
}

impl PgStore {
    /// A store on `pool` using the system clock.
    pub fn new(pool: PgPool) -> Self {
        PgStore { pool, clock: Arc::new(SystemClock), cluster_scope: None, max_protocol_version: own_protocol_version(), cloudevents: Arc::default(), database_clock: true }
    }

    /// A store whose leases and timestamps follow `clock` (tests, simulations).
    pub fn with_clock(pool: PgPool, clock: Arc<dyn Clock>) -> Self {
        PgStore { pool, clock, cluster_scope: None, max_protocol_version: own_protocol_version(), cloudevents: Arc::default(), database_clock: false }
    }

    /// Fills [`ClaimedEvent::cloudevents`] of events read outside a claim
    /// (the shadow dispatcher), as a claim does.
    pub async fn attach_cloudevents(&self, events: &mut [ClaimedEvent]) -> Result<(), StoreError> {
        if self.cloudevents.fill_from_known(events) {
            return Ok(());
        }
        let mut conn = self.pool.acquire().await.map_err(store_err)?;
        self.cloudevents.attach(&mut conn, events).await
    }

    /// Restricts claims to events frozen for `cluster_id`: a dispatcher
    /// connected to one cluster never claims another cluster's events.
    pub fn scoped_to_cluster(mut self, cluster_id: impl Into<String>) -> Self {
        self.cluster_scope = Some(cluster_id.into());
        self
    }

    /// Claims only rows of protocol version `version` or older (default: this
    /// build's [`crate::PROTOCOL_VERSION`]). Rows of a newer protocol are left
    /// alone, never guessed at; [`PgStore::rows_beyond_protocol`] counts them.
    pub fn understanding_protocol(mut self, version: i32) -> Self {
        self.max_protocol_version = version;
        self
    }

    /// The newest protocol version this store claims.
    pub fn max_protocol_version(&self) -> i32 {
        self.max_protocol_version
    }

    /// Rows waiting for a dispatcher (PENDING or RETRY_CLAIMED, the outbox's
    /// own, of this store's cluster scope) that this store refuses because
    /// their protocol version is newer than it understands.
    pub async fn rows_beyond_protocol(&self) -> Result<i64, StoreError> {
        sqlx::query_scalar(
            "SELECT count(*) FROM outbox_events WHERE phase IN ('PENDING', 'RETRY_CLAIMED') AND publisher = 'outbox'
               AND protocol_version > $1 AND ($2::text IS NULL OR cluster_id = $2)",
        )
        .bind(self.max_protocol_version)
        .bind(self.cluster_scope.as_deref())
        .fetch_one(&self.pool)
        .await
        .map_err(store_err)
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The clock's time, ms.
    pub fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }

    /// Begins one of this store's transactions, planned without sequential
    /// scans (one round trip: both statements go in one message).
    ///
    /// Every statement of the store's transactions is a probe or a range
    /// of an index. A session caches the plan of a statement it runs often,
    /// and one planned while the outbox tables held a handful of analyzed
    /// rows (as autovacuum leaves young tables) would otherwise go on
    /// reading them from end to end, per batch or per key, after they have
    /// grown: measured, a claim over 200 keys of a 50,000-event table took
    /// 4.9 s instead of milliseconds. `SET LOCAL` ends with the transaction,
    /// so the connection goes back to the pool as it came.
    async fn begin(&self) -> Result<Transaction<'static, Postgres>, StoreError> {
        self.pool.begin_with("BEGIN; SET LOCAL enable_seqscan = off").await.map_err(store_err)
    }

    async fn audit(tx: &mut Transaction<'_, Postgres>, event_id: &str, actor: &str, action: &str, detail: serde_json::Value, now: i64) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO outbox_audit (event_id, actor, action, detail, at_ms) VALUES ($1, $2, $3, $4, $5)")
            .bind(event_id)
            .bind(actor)
            .bind(action)
            .bind(detail)
            .bind(now)
            .execute(&mut **tx)
            .await
            .map_err(store_err)?;
        Ok(())
    }

    /// The claim columns of one event, for explaining a refused fenced write.
    async fn claim_of(tx: &mut Transaction<'_, Postgres>, event_id: &str) -> Result<Option<(Claim, EventState)>, StoreError> {
        let row = sqlx::query("SELECT claim_owner, claim_generation, lease_until_ms, claim_attempt_id, state FROM outbox_events WHERE event_id = $1")
            .bind(event_id)
            .fetch_optional(&mut **tx)
            .await
            .map_err(store_err)?;
        let Some(r) = row else { return Ok(None) };
        let attempt: Option<String> = r.try_get("claim_attempt_id").map_err(store_err)?;
        Ok(Some((
            Claim {
                owner: r.try_get("claim_owner").map_err(store_err)?,
                claim_generation: r.try_get::<i64, _>("claim_generation").map_err(store_err)? as u64,
                lease_until_ms: r.try_get("lease_until_ms").map_err(store_err)?,
                attempt_id: attempt.map(|a| parse_id(&a)).transpose()?,
            },
            EventState::parse(r.try_get("state").map_err(store_err)?)?,
        )))
    }

    /// After a fenced UPDATE touched nothing: `Fenced` (audited) when the
    /// writer's claim is stale, `NoOp` when the claim is current but there
    /// was nothing to do.
    async fn explain_refusal(&self, tx: &mut Transaction<'_, Postgres>, token: &ClaimToken, action: &str, now: i64) -> Result<FenceOutcome, StoreError> {
        let Some((claim, state)) = Self::claim_of(tx, token.event_id.as_str()).await? else {
            return Err(StoreError::NotFound(token.event_id.clone()));
        };
        match check_fence(&claim, token, FencedWrite::Report, now) {
            Ok(()) => Ok(FenceOutcome::NoOp),
            Err(e) => {
                let detail = serde_json::json!({
                    "write": action, "owner": token.owner, "writerGeneration": token.claim_generation,
                    "currentGeneration": claim.claim_generation, "state": state.as_str(), "error": e.to_string(),
                });
                Self::audit(tx, token.event_id.as_str(), &token.owner, "stale_write", detail, now).await?;
                tracing::info!(event_id = %token.event_id, owner = %token.owner, action, "stale claim holder fenced");
                Ok(FenceOutcome::Fenced)
            }
        }
    }

    /// The claimed rows as events to send, and the rows whose frozen
    /// envelope or destination cannot be read: `(event id, envelope
    /// generation, why)`.
    fn claimed_rows(rows: Vec<PgRow>, from: EventState) -> Result<(Vec<ClaimedEvent>, Vec<Unreadable>), StoreError> {
        let mut claimed = Vec::with_capacity(rows.len());
        let mut unreadable = Vec::new();
        for r in &rows {
            let g = |e: sqlx::Error| store_err(e);
            let (envelope, destination) = match frozen_records(r)? {
                Ok(p) => p,
                Err(u) => {
                    unreadable.push(u);
                    continue;
                }
            };
            claimed.push(ClaimedEvent {
                token: claim_token(r, &envelope.event_id)?,
                envelope,
                destination,
                destination_digest: r.try_get("destination_digest").map_err(g)?,
                payload: r.try_get::<Option<Vec<u8>>, _>("payload").map_err(g)?.unwrap_or_default(),
                event_payload_digest: r.try_get("payload_digest").map_err(g)?,
                claimed_from: from,
                traceparent: r.try_get("traceparent").map_err(g)?,
                tracestate: r.try_get("tracestate").map_err(g)?,
                cloudevents: None,
                source: None,
            });
        }
        Ok((claimed, unreadable))
    }

    /// Quarantines, in the claim's transaction, claimed rows whose frozen
    /// envelope or destination cannot be read: that event can never be
    /// sent as frozen, and it must not fail the claim of every other event.
    async fn quarantine_unreadable(tx: &mut Transaction<'static, Postgres>, owner: &str, unreadable: &[(String, i32, String)], now: i64) -> Result<usize, StoreError> {
        if unreadable.is_empty() {
            return Ok(0);
        }
        for (id, _, why) in unreadable {
            tracing::error!(event_id = %id, error = %why, "frozen envelope or destination unreadable: quarantined, not sent");
        }
        let ids: Vec<&str> = unreadable.iter().map(|u| u.0.as_str()).collect();
        let gens: Vec<i32> = unreadable.iter().map(|u| u.1).collect();
        let whys: Vec<&str> = unreadable.iter().map(|u| u.2.as_str()).collect();
        let n = sqlx::query(
            "WITH t AS (SELECT * FROM UNNEST($1::text[], $2::int[], $3::text[]) AS t(event_id, gen, why)),
             ev AS (
                UPDATE outbox_events e SET state = 'QUARANTINED', claim_owner = NULL, lease_until_ms = NULL, state_since_ms = $5,
                       claim_generation = e.claim_generation + 1
                FROM t WHERE e.event_id = t.event_id AND e.claim_owner = $4 AND e.state IN ('CLAIMED', 'RETRY_CLAIMED', 'RECONCILING')
                RETURNING e.event_id, e.envelope_generation, t.why)
             INSERT INTO outbox_quarantine (event_id, envelope_generation, reason, evidence, created_at_ms)
             SELECT event_id, envelope_generation, 'frozen_record_unreadable', jsonb_build_object('error', why), $5 FROM ev",
        )
        .bind(&ids)
        .bind(&gens)
        .bind(&whys)
        .bind(owner)
        .bind(now)
        .execute(&mut **tx)
        .await
        .map_err(store_err)?
        .rows_affected();
        Ok(n as usize)
    }

    /// Registers attempts for many claims in one transaction. Each token is
    /// fenced on its own; the answer is per token, in order.
    async fn register_attempts_tx(&self, tokens: &[ClaimToken]) -> Result<Vec<Result<AttemptRecord, StoreError>>, StoreError> {
        if tokens.is_empty() {
            return Ok(vec![]);
        }
        let now = self.now_ms();
        let ids: Vec<&str> = tokens.iter().map(|t| t.event_id.as_str()).collect();
        let gens: Vec<i64> = tokens.iter().map(|t| t.claim_generation as i64).collect();
        let owners: Vec<&str> = tokens.iter().map(|t| t.owner.as_str()).collect();
        let attempt_ids: Vec<String> = tokens.iter().map(|_| AttemptId::generate(now.max(0) as u64).to_string()).collect();
        let mut tx = self.begin().await?;
        let rows = sqlx::query(&format!(
            "WITH input AS (SELECT * FROM UNNEST($1::text[], $2::bigint[], $3::text[], $4::text[]) AS t(event_id, gen, owner, attempt_id)),
             upd AS (
                UPDATE outbox_events e SET state = 'SENDING', claim_attempt_id = i.attempt_id,
                       attempt_generation = e.attempt_generation + 1, state_since_ms = $5
                FROM input i
                WHERE e.event_id = i.event_id AND e.claim_generation = i.gen AND e.claim_owner = i.owner
                  AND e.lease_until_ms > $5 AND e.state IN ({registrable}) AND e.claim_attempt_id IS NULL
                RETURNING e.event_id, e.envelope_generation, e.attempt_generation, e.destination_digest, e.cluster_id, e.topic,
                          e.partition, e.lease_until_ms, i.attempt_id, i.gen, i.owner),
             -- The topic id each frozen destination names (NULL: destination.v1).
             dest AS (
                SELECT u.*, outbox_destination_topic_id(v.destination_canonical) AS topic_id FROM upd u
                JOIN outbox_envelopes v ON v.event_id = u.event_id AND v.envelope_generation = u.envelope_generation),
             -- Where a scan for the message would start: past the highest
             -- receipted offset of its partition's log (the topic id is part
             -- of it: a recreated topic's new log starts at 0 again), looked
             -- up once per partition and topic id, by equality on the key;
             -- with the event whose receipt holds it (the newest epoch), the
             -- anchor by which a lookup recognises that log.
             floors AS MATERIALIZED (
                SELECT p.cluster_id, p.topic, p.topic_id, p.partition, coalesce(top.\"offset\" + 1, 0) AS scan_from, top.event_id AS scan_anchor, top.attempt_id AS scan_anchor_attempt
                FROM (SELECT DISTINCT cluster_id, topic, topic_id, partition FROM dest) p
                LEFT JOIN LATERAL (
                    (SELECT r.\"offset\", r.event_id, r.attempt_id FROM outbox_publish_receipts r
                     WHERE p.topic_id IS NULL AND r.cluster_id = p.cluster_id AND r.topic = p.topic AND r.topic_id IS NULL AND r.partition = p.partition
                     ORDER BY r.\"offset\" DESC, r.position_epoch DESC LIMIT 1)
                    UNION ALL
                    (SELECT r.\"offset\", r.event_id, r.attempt_id FROM outbox_publish_receipts r
                     WHERE r.cluster_id = p.cluster_id AND r.topic = p.topic AND r.topic_id = p.topic_id AND r.partition = p.partition
                     ORDER BY r.\"offset\" DESC, r.position_epoch DESC LIMIT 1)
                ) top ON true)
             INSERT INTO outbox_attempts ({ATTEMPT_COLUMNS})
             SELECT u.attempt_id, u.event_id, u.envelope_generation, u.attempt_generation, u.gen, u.owner, 'SENDING',
                    u.destination_digest, $5, f.scan_from, u.lease_until_ms, f.scan_anchor, f.scan_anchor_attempt
             FROM dest u JOIN floors f
               ON f.cluster_id = u.cluster_id AND f.topic = u.topic AND f.topic_id IS NOT DISTINCT FROM u.topic_id AND f.partition = u.partition
             RETURNING {ATTEMPT_COLUMNS}",
            registrable = outbox_core::sql_state_list(&outbox_core::REGISTRABLE_STATES),
        ))
        // Planned for each batch with its real size: a cached generic plan
        // guesses 10 input rows and joined them to the table by nested loop
        // (auto_explain: 160,000 join-filter rows for a batch of 400).
        .persistent(false)
        .bind(&ids)
        .bind(&gens)
        .bind(&owners)
        .bind(&attempt_ids)
        .bind(now)
        .fetch_all(&mut *tx)
        .await
        .map_err(store_err)?;
        let mut registered: HashMap<String, AttemptRecord> = HashMap::with_capacity(rows.len());
        for r in &rows {
            let a = attempt_from_row(r)?;
            registered.insert(a.event_id.to_string(), a);
        }
        let mut out = Vec::with_capacity(tokens.len());
        for t in tokens {
            match registered.remove(t.event_id.as_str()) {
                Some(a) => out.push(Ok(a)),
                None => {
                    let err = match Self::claim_of(&mut tx, t.event_id.as_str()).await? {
                        None => StoreError::NotFound(t.event_id.clone()),
                        // The guard that refused it, named: the statement above guards the same columns.
                        Some((claim, state)) => match outbox_core::check_registration(state, &claim, t, now) {
                            Err(e) => StoreError::Core(e),
                            Ok(()) => StoreError::Core(CoreError::IllegalTransition { from: state, to: EventState::Sending }),
                        },
                    };
                    if err.is_fenced() {
                        let detail = serde_json::json!({ "write": "register_attempt", "writerGeneration": t.claim_generation, "error": err.to_string() });
                        Self::audit(&mut tx, t.event_id.as_str(), &t.owner, "stale_write", detail, now).await?;
                    }
                    out.push(Err(err));
                }
            }
        }
        tx.commit().await.map_err(store_err)?;
        Ok(out)
    }

    /// `acceptDispatchReceipt` for many receipts in one transaction. Rows are
    /// locked in event-id order; each receipt is decided by
    /// [`decide_receipt`] against the state the earlier receipts of the same
    /// batch left.
    async fn accept_dispatch_receipts_tx(&self, receipts: &[BrokerReceipt]) -> Result<Vec<ReceiptOutcome>, StoreError> {
        if receipts.is_empty() {
            return Ok(vec![]);
        }
        let now = self.now_ms();
        let mut ids: Vec<&str> = receipts.iter().map(|r| r.event_id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        let mut tx = self.begin().await?;
        let rows = sqlx::query(
            "SELECT e.event_id, e.envelope_generation, e.state, e.payload_digest, e.destination_digest, e.unknown_since_ms, v.destination_canonical
             FROM outbox_events e
             JOIN outbox_envelopes v ON v.event_id = e.event_id AND v.envelope_generation = e.envelope_generation
             WHERE e.event_id = ANY($1) ORDER BY e.event_id FOR UPDATE OF e",
        )
        .bind(&ids)
        .fetch_all(&mut *tx)
        .await
        .map_err(store_err)?;
        let mut events: HashMap<String, LockedEvent> = HashMap::with_capacity(rows.len());
        // Events that had been UNKNOWN: publishing one records its time to resolution.
        let mut unknown_since: HashMap<String, i64> = HashMap::new();
        for r in &rows {
            let g = |e: sqlx::Error| store_err(e);
            let id: String = r.try_get("event_id").map_err(g)?;
            if let Some(since) = r.try_get::<Option<i64>, _>("unknown_since_ms").map_err(g)? {
                unknown_since.insert(id.clone(), since);
            }
            events.insert(
                id.clone(),
                LockedEvent {
                    event_id: parse_id(&id)?,
                    envelope_generation: r.try_get::<i32, _>("envelope_generation").map_err(g)? as u32,
                    state: EventState::parse(r.try_get("state").map_err(g)?)?,
                    payload_digest: r.try_get("payload_digest").map_err(g)?,
                    destination_digest: r.try_get("destination_digest").map_err(g)?,
                    destination: Destination::from_canonical(r.try_get::<&[u8], _>("destination_canonical").map_err(g)?)?,
                    slot: None,
                },
            );
        }
        // The slot is filled in the same transaction that sets PUBLISHED, and
        // only RETAINED and PURGED follow: other events have an empty slot.
        // (Were that ever violated, filling the slot again would fail on its
        // primary key, not overwrite it.)
        let (filled, generations): (Vec<&str>, Vec<i32>) = events
            .values()
            .filter(|e| matches!(e.state, EventState::Published | EventState::Retained | EventState::Purged))
            .map(|e| (e.event_id.as_str(), e.envelope_generation as i32))
            .unzip();
        if !filled.is_empty() {
            // By primary key, the current generation's slot of each.
            let slots = sqlx::query(&format!(
                "SELECT {RECEIPT_COLUMNS} FROM outbox_publish_receipts
                 WHERE (event_id, envelope_generation) IN (SELECT * FROM UNNEST($1::text[], $2::int[]))"
            ))
            .bind(&filled)
            .bind(&generations)
            .fetch_all(&mut *tx)
            .await
            .map_err(store_err)?;
            for r in slots {
                let rec = receipt_from_row(&r)?;
                if let Some(ev) = events.get_mut(rec.event_id.as_str()) {
                    ev.slot = Some(rec);
                }
            }
        }
        let mut attempts: HashMap<String, Vec<AttemptRecord>> = HashMap::new();
        // The attempts the receipts name, by primary key: a receipt is
        // decided on its own attempt only. (By event id, `event_id = ANY`
        // over a few hundred ids of a never-analyzed table is estimated as
        // the whole table, and read so, once per batch.)
        let mut attempt_ids: Vec<&str> = receipts.iter().map(|r| r.attempt_id.as_str()).collect();
        attempt_ids.sort_unstable();
        attempt_ids.dedup();
        for r in sqlx::query(&format!("SELECT {ATTEMPT_COLUMNS} FROM outbox_attempts WHERE attempt_id = ANY($1)"))
            .bind(&attempt_ids)
            .fetch_all(&mut *tx)
            .await
            .map_err(store_err)?
        {
            let a = attempt_from_row(&r)?;
            attempts.entry(a.event_id.to_string()).or_default().push(a);
        }

        // Log positions of this batch already held by another event's primary
        // receipt: the log they were recorded in is gone (the cluster
        // replaced, or a topic without a recorded id recreated) and a new
        // message sits there now: offsets are unique within one log, and
        // this receipt is a genuine ACK or a message read back at its real
        // position. A position names its topic id: a receipt of a recreated
        // topic's new log (another id) does not collide with one of the old.
        // The new receipt is accepted one position epoch above the newest
        // receipt there (the old receipt stays, as the evidence it is), and
        // the old receipt's lost position is a finding.
        // Position -> (event of the newest receipt there, its epoch).
        let mut held: HashMap<Position, (String, i32)> = HashMap::new();
        {
            let clusters: Vec<&str> = receipts.iter().map(|r| r.cluster_id.as_str()).collect();
            let topics: Vec<&str> = receipts.iter().map(|r| r.topic.as_str()).collect();
            let topic_ids: Vec<Option<&str>> = receipts.iter().map(|r| r.topic_id.as_deref()).collect();
            let partitions: Vec<i32> = receipts.iter().map(|r| r.partition).collect();
            let offsets: Vec<i64> = receipts.iter().map(|r| r.offset).collect();
            for r in sqlx::query(
                "SELECT r.cluster_id, r.topic, r.topic_id, r.partition, r.\"offset\", r.event_id, r.position_epoch FROM outbox_publish_receipts r
                 JOIN UNNEST($1::text[], $2::text[], $3::int[], $4::bigint[], $5::text[]) AS t(c, tp, p, o, tid)
                   ON r.cluster_id = t.c AND r.topic = t.tp AND r.partition = t.p AND r.\"offset\" = t.o AND r.topic_id IS NOT DISTINCT FROM t.tid
                 ORDER BY r.position_epoch",
            )
            .persistent(false)
            .bind(&clusters)
            .bind(&topics)
            .bind(&partitions)
            .bind(&offsets)
            .bind(&topic_ids)
            .fetch_all(&mut *tx)
            .await
            .map_err(store_err)?
            {
                let g = |e: sqlx::Error| store_err(e);
                let position = (
                    r.try_get("cluster_id").map_err(g)?,
                    r.try_get("topic").map_err(g)?,
                    r.try_get("topic_id").map_err(g)?,
                    r.try_get("partition").map_err(g)?,
                    r.try_get("offset").map_err(g)?,
                );
                // In epoch order: the newest receipt at a position is the last one kept.
                held.insert(position, (r.try_get("event_id").map_err(g)?, r.try_get("position_epoch").map_err(g)?));
            }
        }
        // The position epoch of each accepted receipt, in `accepted` order.
        let mut epochs: Vec<i32> = Vec::new();
        let mut accepted: Vec<&BrokerReceipt> = Vec::new();
        let mut findings: Vec<(&'static str, String, String)> = Vec::new();
        let mut duplicates: Vec<&BrokerReceipt> = Vec::new();
        let mut acked_attempts: Vec<&str> = Vec::new();
        let mut outcomes = Vec::with_capacity(receipts.len());
        for receipt in receipts {
            let Some(ev) = events.get_mut(receipt.event_id.as_str()) else {
                Self::audit(&mut tx, receipt.event_id.as_str(), "acceptDispatchReceipt", "receipt_for_unknown_event", serde_json::to_value(receipt).unwrap_or_default(), now).await?;
                outcomes.push(Err(StoreError::NotFound(receipt.event_id.clone())));
                continue;
            };
            let list = attempts.entry(receipt.event_id.to_string()).or_default();
            let position = (receipt.cluster_id.clone(), receipt.topic.clone(), receipt.topic_id.clone(), receipt.partition, receipt.offset);
            let decision = decide_receipt(ev, list, receipt);
            let mut epoch = 0;
            if let Some((holder, holder_epoch)) = held.get(&position).filter(|h| h.0.as_str() != receipt.event_id.as_str()) {
                if matches!(decision, ReceiptDecision::Accept { .. }) {
                    epoch = holder_epoch + 1;
                    tracing::error!(event_id = %receipt.event_id, holder = %holder, topic = %receipt.topic, partition = receipt.partition, offset = receipt.offset, epoch,
                        "a receipt's position is held by another event's receipt from a log that is gone: the old position is lost, the receipt accepted in the next position epoch");
                    findings.push((
                        "receipt_position_lost",
                        holder.clone(),
                        format!(
                            "its receipt's position {}/{}{}/{}@{} now holds event {}'s message: the log it was recorded in is gone (cluster replaced, or a topic without a recorded id recreated)",
                            receipt.cluster_id,
                            receipt.topic,
                            receipt.topic_id.as_deref().map(|id| format!(" (topic id {id})")).unwrap_or_default(),
                            receipt.partition,
                            receipt.offset,
                            receipt.event_id
                        ),
                    ));
                }
            }
            if matches!(decision, ReceiptDecision::Accept { .. }) {
                held.insert(position, (receipt.event_id.to_string(), epoch));
                epochs.push(epoch);
            }
            if outbox_core::refutes_absence(list, receipt, &decision) {
                tracing::warn!(event_id = %receipt.event_id, attempt_id = %receipt.attempt_id, offset = receipt.offset, "a message of an attempt proven absent is in the log: the proof was wrong");
                findings.push((
                    "absence_proof_refuted",
                    receipt.event_id.to_string(),
                    format!(
                        "attempt {} was closed ABSENT, yet its message is at {}/{}@{} ({})",
                        receipt.attempt_id,
                        receipt.topic,
                        receipt.partition,
                        receipt.offset,
                        if matches!(decision, ReceiptDecision::Accept { .. }) { "now the primary receipt" } else { "kept as a duplicate transport receipt" }
                    ),
                ));
            }
            if outbox_core::is_unregistered_message(&decision) {
                findings.push((
                    "unregistered_message",
                    receipt.event_id.to_string(),
                    format!("a message carrying the eventId at {}/{}@{} names attempt {}, which this event never registered (a mirror, a replay, a bypass)", receipt.topic, receipt.partition, receipt.offset, receipt.attempt_id),
                ));
            }
            match &decision {
                ReceiptDecision::Accept { from } => {
                    ev.state = from.transition(EventState::Published)?;
                    ev.slot = Some(receipt.clone());
                    accepted.push(receipt);
                    acked_attempts.push(receipt.attempt_id.as_str());
                    list.iter_mut().filter(|a| a.attempt_id == receipt.attempt_id).for_each(|a| a.state = AttemptState::Acked);
                }
                ReceiptDecision::AlreadyAccepted => {}
                ReceiptDecision::Duplicate => {
                    duplicates.push(receipt);
                    acked_attempts.push(receipt.attempt_id.as_str());
                    list.iter_mut().filter(|a| a.attempt_id == receipt.attempt_id).for_each(|a| a.state = AttemptState::Acked);
                }
                ReceiptDecision::Quarantine { reason, move_event } => {
                    if *move_event {
                        ev.state = ev.state.transition(EventState::Quarantined)?;
                        sqlx::query(
                            "UPDATE outbox_events SET state = 'QUARANTINED', claim_owner = NULL, lease_until_ms = NULL, unknown_since_ms = NULL,
                                    claim_generation = claim_generation + 1, state_since_ms = $2 WHERE event_id = $1",
                        )
                        .bind(receipt.event_id.as_str())
                        .bind(now)
                        .execute(&mut *tx)
                        .await
                        .map_err(store_err)?;
                        if let Some(since) = unknown_since.remove(receipt.event_id.as_str()) {
                            record_resolutions(&mut tx, &[(receipt.event_id.as_str(), since)], "QUARANTINED", now).await?;
                        }
                    }
                    sqlx::query(
                        "INSERT INTO outbox_quarantine (event_id, envelope_generation, attempt_id, reason, evidence, created_at_ms)
                         VALUES ($1, $2, $3, $4, $5, $6)",
                    )
                    .bind(receipt.event_id.as_str())
                    .bind(receipt.envelope_generation as i32)
                    .bind(receipt.attempt_id.as_str())
                    .bind(serde_json::to_value(reason).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default())
                    .bind(serde_json::json!({ "receipt": receipt, "frozenPayloadDigest": ev.payload_digest, "frozenDestinationDigest": ev.destination_digest }))
                    .bind(now)
                    .execute(&mut *tx)
                    .await
                    .map_err(store_err)?;
                    tracing::warn!(event_id = %receipt.event_id, ?reason, "receipt quarantined");
                }
                ReceiptDecision::Reject { reason } => {
                    Self::audit(&mut tx, receipt.event_id.as_str(), "acceptDispatchReceipt", "receipt_rejected", serde_json::json!({ "reason": reason, "receipt": receipt }), now)
                        .await?;
                }
            }
            outcomes.push(Ok(ReceiptOutcome { decision, primary: ev.slot.clone(), state: ev.state }));
        }

        if !accepted.is_empty() {
            let ev_ids: Vec<&str> = accepted.iter().map(|r| r.event_id.as_str()).collect();
            sqlx::query(
                "UPDATE outbox_events SET state = 'PUBLISHED', claim_owner = NULL, lease_until_ms = NULL, unknown_since_ms = NULL,
                        published_at_ms = $2, state_since_ms = $2
                 WHERE event_id = ANY($1)",
            )
            .bind(&ev_ids)
            .bind(now)
            .execute(&mut *tx)
            .await
            .map_err(store_err)?;
            let resolved: Vec<(&str, i64)> = ev_ids.iter().filter_map(|id| unknown_since.get(*id).map(|s| (*id, *s))).collect();
            record_resolutions(&mut tx, &resolved, "PUBLISHED", now).await?;
            insert_receipts(&mut tx, "outbox_publish_receipts", "accepted_at_ms", &accepted, Some(&epochs), now, "").await?;
        }
        if !duplicates.is_empty() {
            insert_receipts(
                &mut tx,
                "outbox_duplicate_receipts",
                "received_at_ms",
                &duplicates,
                None,
                now,
                "ON CONFLICT (event_id, envelope_generation, cluster_id, topic, topic_id, partition, \"offset\") DO NOTHING",
            )
            .await?;
        }
        record_findings(&mut tx, &findings, now).await?;
        if !acked_attempts.is_empty() {
            sqlx::query("UPDATE outbox_attempts SET state = 'ACKED', finished_at_ms = $2 WHERE attempt_id = ANY($1) AND state <> 'ACKED'")
                .bind(&acked_attempts)
                .bind(now)
                .execute(&mut *tx)
                .await
                .map_err(store_err)?;
        }
        tx.commit().await.map_err(store_err)?;
        outcomes.into_iter().collect()
    }

    /// All attempts of an event, oldest first, read in `tx`.
    pub(crate) async fn attempts_in(tx: &mut Transaction<'_, Postgres>, event_id: &EventId) -> Result<Vec<AttemptRecord>, StoreError> {
        sqlx::query(&format!("SELECT {ATTEMPT_COLUMNS} FROM outbox_attempts WHERE event_id = $1 ORDER BY attempt_generation"))
            .bind(event_id.as_str())
            .fetch_all(&mut **tx)
            .await
            .map_err(store_err)?
            .iter()
            .map(attempt_from_row)
            .collect()
    }

    /// Extends the leases of many live claims; returns, per token, the new
    /// lease end or `None` when the claim is no longer the holder's.
    pub async fn renew_leases(&self, tokens: &[ClaimToken], lease_ms: i64) -> Result<Vec<Option<i64>>, StoreError> {
        validate_lease_ms(lease_ms)?;
        let now = self.now_ms();
        let ids: Vec<&str> = tokens.iter().map(|t| t.event_id.as_str()).collect();
        let gens: Vec<i64> = tokens.iter().map(|t| t.claim_generation as i64).collect();
        let owners: Vec<&str> = tokens.iter().map(|t| t.owner.as_str()).collect();
        let rows = sqlx::query(&format!(
            "UPDATE outbox_events e SET lease_until_ms = $4 + $5
             FROM UNNEST($1::text[], $2::bigint[], $3::text[]) AS t(event_id, gen, owner)
             WHERE e.event_id = t.event_id AND e.claim_generation = t.gen AND e.claim_owner = t.owner AND e.lease_until_ms > $4
               AND e.state IN ({leased})
             RETURNING e.event_id, e.lease_until_ms",
            leased = outbox_core::sql_state_list(&outbox_core::LEASED_STATES),
        ))
        .persistent(false)
        .bind(&ids)
        .bind(&gens)
        .bind(&owners)
        .bind(now)
        .bind(lease_ms)
        .fetch_all(&self.pool)
        .await
        .map_err(store_err)?;
        let mut renewed: HashMap<String, i64> = HashMap::new();
        for r in rows {
            renewed.insert(r.try_get("event_id").map_err(store_err)?, r.try_get("lease_until_ms").map_err(store_err)?);
        }
        Ok(tokens.iter().map(|t| renewed.get(t.event_id.as_str()).copied()).collect())
    }

    /// The CAS DISPATCH_UNKNOWN -> RECONCILING, for due events or, with
    /// `event_id`, for that one event whatever its next check time.
    pub async fn begin_reconcile_where(&self, owner: &str, limit: usize, lease_ms: i64, event_id: Option<&EventId>) -> Result<Vec<ReconcileTask>, StoreError> {
        validate_lease_ms(lease_ms)?;
        outbox_core::id::validate_identifier("owner", owner)?;
        let now = self.now_ms();
        let mut tx = self.begin().await?;
        let rows = sqlx::query(&format!(
            "WITH c AS (
                SELECT event_id FROM outbox_events WHERE phase = '{from}' AND protocol_version <= $6
                  AND (($5::text IS NULL AND next_check_at_ms <= $3) OR event_id = $5)
                ORDER BY next_check_at_ms LIMIT $1 FOR UPDATE SKIP LOCKED)
             UPDATE outbox_events e SET state = '{claim}', claim_owner = $2, claim_generation = e.claim_generation + 1,
                    lease_until_ms = $3 + $4, claim_attempt_id = NULL, state_since_ms = $3
             {CLAIM_FROM_C}",
            claim = outbox_core::reconcile::RECONCILE_CLAIM.as_str(),
            from = outbox_core::reconcile::RECONCILE_FROM.as_str(),
        ))
        .bind(limit.min(MAX_CLAIM_BATCH) as i64)
        .bind(owner)
        .bind(now)
        .bind(lease_ms)
        .bind(event_id.map(|e| e.as_str()))
        .bind(self.max_protocol_version)
        .fetch_all(&mut *tx)
        .await
        .map_err(store_err)?;
        let mut tasks = Vec::with_capacity(rows.len());
        let mut unreadable = Vec::new();
        for r in &rows {
            let g = |e: sqlx::Error| store_err(e);
            let (envelope, destination) = match frozen_records(r)? {
                Ok(p) => p,
                // That event cannot be looked up as frozen: quarantined
                // below, the other events of the round go on.
                Err(u) => {
                    unreadable.push(u);
                    continue;
                }
            };
            let id = envelope.event_id.to_string();
            let mut attempts = Vec::new();
            for a in sqlx::query(&format!(
                "SELECT {ATTEMPT_COLUMNS}, (extract(epoch FROM clock_timestamp()) * 1000)::bigint - registered_db_ms AS db_age_ms
                 FROM outbox_attempts WHERE event_id = $1 ORDER BY attempt_generation"
            ))
            .bind(&id)
            .fetch_all(&mut *tx)
            .await
            .map_err(store_err)?
            {
                let mut attempt = attempt_from_row(&a)?;
                if self.database_clock {
                    let db_age_ms: Option<i64> = a.try_get("db_age_ms").map_err(g)?;
                    measure_with_database_clock(&mut attempt, db_age_ms, now);
                }
                attempts.push(attempt);
            }
            let slot = sqlx::query(&format!("SELECT {RECEIPT_COLUMNS} FROM outbox_publish_receipts WHERE event_id = $1 AND envelope_generation = $2"))
                .bind(&id)
                .bind(envelope.envelope_generation as i32)
                .fetch_optional(&mut *tx)
                .await
                .map_err(store_err)?
                .map(|r| receipt_from_row(&r))
                .transpose()?;
            tasks.push(ReconcileTask {
                token: claim_token(r, &envelope.event_id)?,
                event: LockedEvent {
                    event_id: envelope.event_id.clone(),
                    envelope_generation: envelope.envelope_generation,
                    state: EventState::Reconciling,
                    payload_digest: r.try_get("payload_digest").map_err(g)?,
                    destination_digest: r.try_get("destination_digest").map_err(g)?,
                    destination,
                    slot,
                },
                attempts,
                unknown_since_ms: r.try_get::<Option<i64>, _>("unknown_since_ms").map_err(g)?.unwrap_or(now),
            });
        }
        Self::quarantine_unreadable(&mut tx, owner, &unreadable, now).await?;
        tx.commit().await.map_err(store_err)?;
        Ok(tasks)
    }

    /// Runs a claim statement in a transaction of its own (planned without
    /// sequential scans, see `begin`): `$1` limit, `$2` owner, `$3` now,
    /// `$4` lease, `$5` cluster scope, `$6` highest protocol understood,
    /// `$7` (when given) event ids; it returns [`CLAIM_FROM_C`] rows.
    async fn claim_with(&self, sql: &str, owner: &str, limit: usize, lease_ms: i64, from: EventState, events: Option<&[&str]>) -> Result<Vec<ClaimedEvent>, StoreError> {
        validate_claim(owner, lease_ms)?;
        let mut tx = self.begin().await?;
        if from == EventState::Pending {
            link_arrivals(&mut tx, limit).await?;
        }
        let claimed = self.claim_in(&mut tx, sql, owner, limit, lease_ms, from, events, &mut 0).await?;
        tx.commit().await.map_err(store_err)?;
        Ok(claimed)
    }

    /// Runs a claim statement (as [`PgStore::claim_with`] describes) in `tx`,
    /// its owner and lease already validated; claims of PENDING events come
    /// back in event-id order.
    #[allow(clippy::too_many_arguments)]
    async fn claim_in(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        sql: &str,
        owner: &str,
        limit: usize,
        lease_ms: i64,
        from: EventState,
        events: Option<&[&str]>,
        quarantined: &mut usize,
    ) -> Result<Vec<ClaimedEvent>, StoreError> {
        let mut q = sqlx::query(sql)
            .bind(limit.min(MAX_CLAIM_BATCH) as i64)
            .bind(owner)
            .bind(self.now_ms())
            .bind(lease_ms)
            .bind(self.cluster_scope.as_deref())
            .bind(self.max_protocol_version);
        if let Some(events) = events {
            q = q.bind(events);
        }
        let rows = q.fetch_all(&mut **tx).await.map_err(store_err)?;
        let (mut claimed, unreadable) = Self::claimed_rows(rows, from)?;
        *quarantined += Self::quarantine_unreadable(tx, owner, &unreadable, self.now_ms()).await?;
        self.cloudevents.attach(&mut **tx, &mut claimed).await?;
        if from == EventState::Pending {
            claimed.sort_by(|a, b| a.envelope.event_id.cmp(&b.envelope.event_id));
        }
        Ok(claimed)
    }

    /// A dispatcher's claim of up to `limit` events, in one transaction:
    /// events waiting for a retry first; then, unless `scan_due`, the
    /// successors of the events `after` ([`PgStore::claim_successors`]);
    /// then, when a scan is due or the batch is not full, every key's head
    /// ([`OutboxStore::claim_batch`]). All of it commits or none of it does,
    /// and the transaction's round trips are paid once. New chains are
    /// linked to heads first, in the same transaction (`link_arrivals`).
    pub async fn claim_next(&self, owner: &str, after: &[EventId], scan_due: bool, limit: usize, lease_ms: i64) -> Result<ClaimRound, StoreError> {
        validate_claim(owner, lease_ms)?;
        let mut tx = self.begin().await?;
        link_arrivals(&mut tx, limit).await?;
        let mut quarantined = 0;
        let retries = self.claim_in(&mut tx, &CLAIM_RETRIES, owner, limit, lease_ms, EventState::RetryClaimed, None, &mut quarantined).await?;
        let mut round = ClaimRound { claimed: retries, successor_claim: false, head_scan: false, quarantined: 0 };
        if round.claimed.len() < limit {
            let mut scan = scan_due;
            if !scan {
                let found = self
                    .claim_in(&mut tx, &CLAIM_SUCCESSORS, owner, limit - round.claimed.len(), lease_ms, EventState::Pending, Some(&successor_ids(after)), &mut quarantined)
                    .await?;
                round.successor_claim = true;
                round.claimed.extend(found);
                // Successors that do not fill the batch: top it up from every
                // key's head (O(batch) since the chain heads) rather than
                // send a smaller batch, or wait when there were none. With
                // many workers each holds fewer keys, and successors alone
                // made batches of a fraction of the limit.
                scan = round.claimed.len() < limit;
            }
            if scan {
                let heads = self.claim_in(&mut tx, &CLAIM_EVERY_HEAD, owner, limit - round.claimed.len(), lease_ms, EventState::Pending, None, &mut quarantined).await?;
                round.claimed.extend(heads);
                round.head_scan = true;
            }
        }
        tx.commit().await.map_err(store_err)?;
        round.quarantined = quarantined;
        Ok(round)
    }

    /// Claims, as `owner`, up to `limit` PENDING events: the current heads
    /// of the ordering chains of `events` (given the events an owner has
    /// just published, their successors) and unordered events, oldest
    /// first. It finds them with one probe per chain named, where
    /// [`OutboxStore::claim_batch`] visits every chain's head; it never
    /// finds a chain not named, so a dispatcher must also claim with
    /// `claim_batch` (see [`crate::DispatcherConfig::head_scan_every`]). At most
    /// [`MAX_CLAIM_BATCH`] events are read.
    pub async fn claim_successors(&self, owner: &str, events: &[EventId], limit: usize, lease_ms: i64) -> Result<Vec<ClaimedEvent>, StoreError> {
        self.claim_with(&CLAIM_SUCCESSORS, owner, limit, lease_ms, EventState::Pending, Some(&successor_ids(events))).await
    }

    /// The attempts a registration of `tokens` made, where it committed: for
    /// each token, the SENDING attempt its own claim (owner and generation)
    /// registered and the event still names, under a lease that has not run
    /// out (as registration itself requires). A dispatcher asks after its
    /// registration failed with a broken connection: the commit may have
    /// gone through before the answer was lost, and then those attempts
    /// are registered and theirs to send.
    pub async fn registered_attempts(&self, tokens: &[ClaimToken]) -> Result<Vec<AttemptRecord>, StoreError> {
        if tokens.is_empty() {
            return Ok(vec![]);
        }
        let ids: Vec<&str> = tokens.iter().map(|t| t.event_id.as_str()).collect();
        let gens: Vec<i64> = tokens.iter().map(|t| t.claim_generation as i64).collect();
        let owners: Vec<&str> = tokens.iter().map(|t| t.owner.as_str()).collect();
        let rows = sqlx::query(&format!(
            "SELECT {ATTEMPT_COLUMNS} FROM outbox_attempts
             WHERE state = 'SENDING' AND (attempt_id, claim_generation, owner) IN (
                 SELECT e.claim_attempt_id, t.gen, t.owner FROM UNNEST($1::text[], $2::bigint[], $3::text[]) AS t(event_id, gen, owner)
                 JOIN outbox_events e ON e.event_id = t.event_id AND e.claim_generation = t.gen AND e.claim_owner = t.owner
                                       AND e.state = 'SENDING' AND e.lease_until_ms > $4)"
        ))
        .bind(&ids)
        .bind(&gens)
        .bind(&owners)
        .bind(self.now_ms())
        .fetch_all(&self.pool)
        .await
        .map_err(store_err)?;
        rows.iter().map(attempt_from_row).collect()
    }

    /// How far this store's clock is ahead of PostgreSQL's, ms (negative:
    /// behind), read around one round trip (the database's reading is set
    /// against the midpoint of the two local ones). Leases are written with
    /// the clock of the worker that holds them and expired with the clock of
    /// the sweeper that finds them, so a skew between hosts shortens or
    /// stretches every lease by that much. Fencing keeps that safe, not
    /// cheap: a lease cut short turns sends in flight DISPATCH_UNKNOWN.
    pub async fn clock_skew_ms(&self) -> Result<i64, StoreError> {
        let before = self.now_ms();
        let db = db_now_ms(&self.pool).await.map_err(store_err)?;
        let after = self.now_ms();
        Ok(before + (after - before) / 2 - db)
    }

    /// Age in ms of the oldest PENDING event, if any.
    pub async fn oldest_pending_age_ms(&self) -> Result<Option<i64>, StoreError> {
        let now = self.now_ms();
        let oldest = oldest_pending_created_ms(&self.pool).await.map_err(store_err)?;
        Ok(oldest.map(|o| (now - o).max(0)))
    }

    /// Counts of events per state.
    pub async fn state_counts(&self) -> Result<Vec<(EventState, i64)>, StoreError> {
        let rows = sqlx::query("SELECT state, count(*) AS n FROM outbox_events GROUP BY state ORDER BY state")
            .fetch_all(&self.pool)
            .await
            .map_err(store_err)?;
        rows.iter()
            .map(|r| Ok((EventState::parse(r.try_get("state").map_err(store_err)?)?, r.try_get("n").map_err(store_err)?)))
            .collect()
    }

    /// Applies a fenced single-row state change; the UPDATE must carry the
    /// fence (`claim_generation = $gen AND claim_owner = $owner`) itself.
    async fn fenced_update<'q>(&self, token: &'q ClaimToken, action: &str, sql: &'q str, extra: impl FnOnce(PgQuery<'q>) -> PgQuery<'q> + Send) -> Result<FenceOutcome, StoreError> {
        let now = self.now_ms();
        let mut tx = self.begin().await?;
        let q = sqlx::query(sql).bind(token.event_id.as_str()).bind(token.claim_generation as i64).bind(token.owner.as_str()).bind(now);
        let n = extra(q).execute(&mut *tx).await.map_err(store_err)?.rows_affected();
        let out = if n > 0 { FenceOutcome::Applied } else { self.explain_refusal(&mut tx, token, action, now).await? };
        tx.commit().await.map_err(store_err)?;
        Ok(out)
    }
}

/// Records, for events that had been DISPATCH_UNKNOWN (`(event id, unknown
/// since)`), how and when their unknown outcome was resolved; nothing for
/// none.
async fn record_resolutions(tx: &mut Transaction<'_, Postgres>, resolved: &[(&str, i64)], outcome: &str, now: i64) -> Result<(), StoreError> {
    if resolved.is_empty() {
        return Ok(());
    }
    let (ids, since): (Vec<&str>, Vec<i64>) = resolved.iter().copied().unzip();
    sqlx::query(
        "INSERT INTO outbox_unknown_resolutions (event_id, unknown_since_ms, resolved_at_ms, outcome)
         SELECT event_id, since, $3, $4 FROM UNNEST($1::text[], $2::bigint[]) AS t(event_id, since)",
    )
    .bind(&ids)
    .bind(&since)
    .bind(now)
    .bind(outcome)
    .execute(&mut **tx)
    .await
    .map_err(store_err)?;
    Ok(())
}

/// Inserts `receipts` into `table` with `now` in `at_column`; with `epochs`
/// (one per receipt) into its `position_epoch` too.
async fn insert_receipts(
    tx: &mut Transaction<'_, Postgres>,
    table: &str,
    at_column: &str,
    receipts: &[&BrokerReceipt],
    epochs: Option<&[i32]>,
    now: i64,
    conflict: &str,
) -> Result<(), StoreError> {
    let ev: Vec<&str> = receipts.iter().map(|r| r.event_id.as_str()).collect();
    let gen: Vec<i32> = receipts.iter().map(|r| r.envelope_generation as i32).collect();
    let att: Vec<&str> = receipts.iter().map(|r| r.attempt_id.as_str()).collect();
    let pd: Vec<&str> = receipts.iter().map(|r| r.payload_digest.as_str()).collect();
    let dd: Vec<&str> = receipts.iter().map(|r| r.destination_digest.as_str()).collect();
    let cl: Vec<&str> = receipts.iter().map(|r| r.cluster_id.as_str()).collect();
    let tp: Vec<&str> = receipts.iter().map(|r| r.topic.as_str()).collect();
    let ti: Vec<Option<&str>> = receipts.iter().map(|r| r.topic_id.as_deref()).collect();
    let pa: Vec<i32> = receipts.iter().map(|r| r.partition).collect();
    let of: Vec<i64> = receipts.iter().map(|r| r.offset).collect();
    let (epoch_column, epoch_values) = match epochs {
        Some(_) => (", position_epoch", ", $12::int[]"),
        None => ("", ""),
    };
    let sql = format!(
        "INSERT INTO {table} ({RECEIPT_COLUMNS}{epoch_column}, {at_column})
         SELECT *, $11 FROM UNNEST($1::text[], $2::int[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[], $9::int[], $10::bigint[]{epoch_values})
         {conflict}"
    );
    let query = sqlx::query(&sql)
    .bind(&ev)
    .bind(&gen)
    .bind(&att)
    .bind(&pd)
    .bind(&dd)
    .bind(&cl)
    .bind(&tp)
    .bind(&ti)
    .bind(&pa)
    .bind(&of)
    .bind(now);
    let query = match epochs {
        Some(e) => query.bind(e),
        None => query,
    };
    query
    .execute(&mut **tx)
    .await
    .map_err(store_err)?;
    Ok(())
}

/// Moves `attempt`'s registration time (and with it the end of its lease,
/// by the remaining lease its own dispatcher measured) to when the
/// database's clock says it was registered, `db_age_ms` before `now`,
/// when that is later: a dispatcher host whose clock is behind cannot make
/// an attempt look older than it is.
fn measure_with_database_clock(attempt: &mut AttemptRecord, db_age_ms: Option<i64>, now: i64) {
    let Some(age) = db_age_ms else { return };
    let registered = now.saturating_sub(age.max(0));
    if registered > attempt.started_at_ms {
        let remaining_lease = attempt.send_deadline_ms.map(|d| d.saturating_sub(attempt.started_at_ms).max(0));
        attempt.started_at_ms = registered;
        attempt.send_deadline_ms = remaining_lease.map(|r| registered.saturating_add(r));
    }
}

/// Findings that are evidence, not conditions: opened (or seen again) by
/// the statement that found them and left open until an operator resolves
/// them; a comparison round never resolves them.
/// They are `outbox_core::findings::EVIDENCE_FINDINGS`.
pub const EVIDENCE_FINDINGS: &[&str] = outbox_core::findings::EVIDENCE_FINDINGS;

/// Opens findings `(kind, event_id, detail)` in `tx`, or marks open ones seen again.
/// The open attempts (SENDING, UNKNOWN) of `event_ids`, in one query.
pub(crate) async fn unanswered_attempts_of(pool: &PgPool, event_ids: &[&str]) -> Result<Vec<AttemptRecord>, StoreError> {
    sqlx::query(&format!("SELECT {ATTEMPT_COLUMNS} FROM outbox_attempts WHERE event_id = ANY($1) AND state IN ('SENDING', 'UNKNOWN', 'ABSENT', 'NOT_SENT')"))
        .bind(event_ids)
        .fetch_all(pool)
        .await
        .map_err(store_err)?
        .iter()
        .map(attempt_from_row)
        .collect()
}

pub(crate) async fn record_findings(tx: &mut Transaction<'_, Postgres>, findings: &[(&'static str, String, String)], now: i64) -> Result<(), StoreError> {
    if findings.is_empty() {
        return Ok(());
    }
    let kinds: Vec<&str> = findings.iter().map(|f| f.0).collect();
    let ids: Vec<&str> = findings.iter().map(|f| f.1.as_str()).collect();
    let details: Vec<&str> = findings.iter().map(|f| f.2.as_str()).collect();
    sqlx::query(
        "INSERT INTO outbox_findings (kind, event_id, consumer_id, age_ms, detail, first_seen_ms, last_seen_ms)
         SELECT DISTINCT ON (k, e) k, e, '', 0, d, $4, $4 FROM UNNEST($1::text[], $2::text[], $3::text[]) AS t(k, e, d)
         ON CONFLICT (kind, event_id, consumer_id) WHERE resolved_at_ms IS NULL
         DO UPDATE SET detail = EXCLUDED.detail, last_seen_ms = EXCLUDED.last_seen_ms",
    )
    .bind(&kinds)
    .bind(&ids)
    .bind(&details)
    .bind(now)
    .execute(&mut **tx)
    .await
    .map_err(store_err)?;
    Ok(())
}

/// The database's clock, ms since the epoch.
pub async fn db_now_ms(pool: &PgPool) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint").fetch_one(pool).await
}

/// When the oldest PENDING event the outbox sends was created, ms: the
/// earliest inserted (legacy events stay PENDING here: they are the legacy
/// publisher's to send). One descent of the PENDING index: the sweeper and
/// every report ask, and neither may scan the backlog.
pub async fn oldest_pending_created_ms(pool: &PgPool) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar("SELECT created_at_ms FROM outbox_events WHERE phase = 'PENDING' AND publisher = 'outbox' ORDER BY seq LIMIT 1")
        .fetch_optional(pool)
        .await
}

/// The end of every claim statement: the UPDATE of `outbox_events e` applies
/// to the rows of the CTE `c` and returns them with their current envelope.
const CLAIM_FROM_C: &str = "FROM c, outbox_envelopes v
             WHERE e.event_id = c.event_id AND v.event_id = e.event_id AND v.envelope_generation = e.envelope_generation
             RETURNING e.event_id, e.envelope_generation, e.traceparent, e.tracestate, e.claim_owner, e.claim_generation, e.lease_until_ms, e.payload, e.destination_digest, e.payload_digest,
                 e.unknown_since_ms, e.state_since_ms, v.envelope_canonical, v.destination_canonical";

/// outbox_core's `not_sent_backoff_ms` for attempt generations 1, 2, ...
/// up to the first at its bound, which holds for every later generation:
/// report_not_sent looks its row's generation up here, so the rule is
/// stated once, in outbox-core.
/// The lease sweep: `outbox_core::plan_lease_expiry` as SQL
/// (`outbox_core::lease_expiry_sql` writes its state lists and CASE
/// expressions from the plan).
/// `finish_reconcile`, written from [`outbox_core::reconcile::plan_reconcile_finish`]:
/// `$5` the new state, `$6` the recheck's due time (NULL: unchanged), `$7`
/// whether the open attempts close ABSENT.
static FINISH_RECONCILE_SQL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH ev AS (
            UPDATE outbox_events SET state = $5, claim_owner = NULL, lease_until_ms = NULL, claim_attempt_id = NULL,
                   next_check_at_ms = coalesce($6, next_check_at_ms), state_since_ms = $4
            WHERE event_id = $1 AND claim_generation = $2 AND claim_owner = $3 AND state = '{claim}'
            RETURNING event_id),
         att AS (
            UPDATE outbox_attempts SET state = 'ABSENT', finished_at_ms = $4, detail = 'proven absent by reconciler'
            WHERE $7 AND event_id = $1 AND state IN ({open}) AND EXISTS (SELECT 1 FROM ev))
         SELECT event_id FROM ev",
        claim = outbox_core::reconcile::RECONCILE_CLAIM.as_str(),
        open = outbox_core::reconcile::OPEN_ATTEMPT_STATES.iter().map(|s| format!("'{}'", s.as_str())).collect::<Vec<_>>().join(", "),
    )
});

static EXPIRE_LEASES_SQL: LazyLock<String> = LazyLock::new(|| {
    let p = outbox_core::lease_expiry_sql("c.old_state");
    format!(
        "WITH c AS (
            SELECT event_id, state AS old_state, claim_attempt_id FROM outbox_events
            WHERE claim_owner IS NOT NULL AND lease_until_ms <= $1
              AND state IN ({leased})
            ORDER BY lease_until_ms LIMIT $2 FOR UPDATE SKIP LOCKED),
         ev AS (
            UPDATE outbox_events e SET
                state = {to},
                claim_generation = e.claim_generation + 1, claim_owner = NULL, lease_until_ms = NULL,
                claim_attempt_id = CASE WHEN c.old_state IN ({keeps}) THEN e.claim_attempt_id ELSE NULL END,
                unknown_since_ms = CASE WHEN c.old_state IN ({unknown}) THEN coalesce(e.unknown_since_ms, $1) ELSE e.unknown_since_ms END,
                next_check_at_ms = $1, state_since_ms = $1
            FROM c WHERE e.event_id = c.event_id
            RETURNING c.old_state, c.claim_attempt_id),
         att AS (
            UPDATE outbox_attempts a SET state = 'UNKNOWN', detail = 'lease expired while sending', finished_at_ms = $1
            FROM ev WHERE ev.old_state IN ({attempt}) AND a.attempt_id = ev.claim_attempt_id AND a.state = 'SENDING')
         SELECT old_state, count(*) AS n FROM ev GROUP BY old_state",
        leased = p.leased,
        to = p.to,
        keeps = p.keeps_attempt,
        unknown = p.outcome_unknown,
        attempt = p.attempt_unknown,
    )
});

static NOT_SENT_BACKOFFS: LazyLock<Vec<i64>> = LazyLock::new(|| {
    let mut schedule = Vec::new();
    for generation in 1..=64 {
        let backoff = not_sent_backoff_ms(generation);
        schedule.push(backoff);
        if backoff >= NOT_SENT_BACKOFF_MAX_MS {
            break;
        }
    }
    schedule
});

/// A claim's owner and lease, checked before any statement runs.
fn validate_claim(owner: &str, lease_ms: i64) -> Result<(), StoreError> {
    validate_lease_ms(lease_ms)?;
    outbox_core::id::validate_identifier("owner", owner)?;
    Ok(())
}

/// The ids of the events whose successors a claim looks for, at most
/// [`MAX_CLAIM_BATCH`].
fn successor_ids(events: &[EventId]) -> Vec<&str> {
    events.iter().take(MAX_CLAIM_BATCH).map(EventId::as_str).collect()
}


/// The claim of events waiting for a retry (RETRY_CLAIMED, nobody's),
/// oldest first.
static CLAIM_RETRIES: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH c AS (
            SELECT event_id FROM outbox_events WHERE phase = 'RETRY_CLAIMED' AND claim_owner IS NULL
              AND publisher = 'outbox' AND protocol_version <= $6 AND ($5::text IS NULL OR cluster_id = $5)
            ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED)
         UPDATE outbox_events e SET claim_owner = $2, claim_generation = e.claim_generation + 1,
                lease_until_ms = $3 + $4, claim_attempt_id = NULL
         {CLAIM_FROM_C}"
    )
});

/// The claim over every ordering chain's head: the claimable rows of
/// `outbox_chain_heads` (schema section 7) in seq order, read from
/// its partial index and locked with SKIP LOCKED, `LIMIT $1`: as many index
/// entries as the batch, whatever the backlog behind the heads or the
/// number of open chains, and a concurrent claim takes the next heads
/// instead of waiting for these.
static CLAIM_EVERY_HEAD: LazyLock<String> = LazyLock::new(|| {
    claim_heads_sql(
        "SELECT h.event_id FROM outbox_chain_heads h
            WHERE h.claimable_at_ms IS NOT NULL AND h.claimable_at_ms <= $3 AND h.protocol_version <= $6
              AND ($5::text IS NULL OR h.cluster_id = $5)
            ORDER BY h.seq LIMIT $1 FOR NO KEY UPDATE OF h SKIP LOCKED",
    )
});

/// The claim over the heads of the chains of the events `$7`: one
/// primary-key probe for each event and one for each chain's head,
/// whatever the number of chains in the table.
static CLAIM_SUCCESSORS: LazyLock<String> = LazyLock::new(|| {
    claim_heads_sql(
        // No ORDER BY here: ordered by seq, the planner may walk the
        // claimable index and filter by chain, reading every claimable
        // head; the claim below orders and bounds the candidates.
        "SELECT h.event_id FROM outbox_chain_heads h
            WHERE h.key_chain = ANY (ARRAY(SELECT DISTINCT key_chain FROM outbox_events WHERE event_id = ANY($7::text[]) AND ordered))
              AND h.claimable_at_ms IS NOT NULL AND h.claimable_at_ms <= $3 AND h.protocol_version <= $6
              AND ($5::text IS NULL OR h.cluster_id = $5)
            FOR NO KEY UPDATE OF h SKIP LOCKED",
    )
});

fn claim_heads_sql(heads: &str) -> String {
    format!(
        "WITH hc AS ({heads}),
             cand AS (
                -- A head of a newer protocol is refused by the head query,
                -- and so is a head waiting out its backoff after a refused
                -- send (claimable_at_ms): it still holds its key, so nothing
                -- behind it overtakes it.
                SELECT event_id FROM hc
                UNION ALL
                (SELECT event_id FROM outbox_events WHERE phase = 'PENDING' AND NOT ordered AND publisher = 'outbox'
                   AND next_check_at_ms <= $3 AND protocol_version <= $6 AND ($5::text IS NULL OR cluster_id = $5)
                 ORDER BY seq LIMIT $1)),
             c AS (
                -- The candidates come in as one array (an init plan, run
                -- once), not as a join: when a row changed since this
                -- statement's snapshot, the lock re-checks that one row's
                -- conditions instead of re-running a join. The event row
                -- is the claim's record; its state is checked again here.
                SELECT e.event_id FROM outbox_events e
                WHERE e.event_id = ANY (ARRAY(SELECT event_id FROM cand))
                  AND e.state = 'PENDING' AND e.next_check_at_ms <= $3 AND e.protocol_version <= $6
                ORDER BY e.seq LIMIT $1 FOR UPDATE OF e SKIP LOCKED)
             UPDATE outbox_events e SET state = 'CLAIMED', claim_owner = $2, claim_generation = e.claim_generation + 1,
                    lease_until_ms = $3 + $4, claim_attempt_id = NULL, state_since_ms = $3
             {CLAIM_FROM_C}"
    )
}

/// Links the chains of newly committed ordered events to heads
/// (`outbox_link_arrivals`), at most this many arrivals per claim
/// transaction, before the claim reads the heads.
const ARRIVALS_PER_CLAIM: i32 = 2_000;

/// Links the chains of newly committed ordered events to heads
/// (`outbox_link_arrivals`, schema section 7) as the first
/// statement of a claim's transaction: the claim's next statement sees
/// the new heads. It locks the arrivals it takes and the heads it inserts
/// until the claim commits; only another linker ever waits for those.
async fn link_arrivals(tx: &mut Transaction<'static, Postgres>, limit: usize) -> Result<(), StoreError> {
    let n = (limit.min(MAX_CLAIM_BATCH) as i32).saturating_mul(4).max(ARRIVALS_PER_CLAIM);
    sqlx::query("SELECT outbox_link_arrivals($1)").bind(n).execute(&mut **tx).await.map_err(store_err)?;
    Ok(())
}

#[async_trait]
impl OutboxStore for PgStore {
    async fn claim_batch(&self, owner: &str, limit: usize, lease_ms: i64) -> Result<Vec<ClaimedEvent>, StoreError> {
        self.claim_with(&CLAIM_EVERY_HEAD, owner, limit, lease_ms, EventState::Pending, None).await
    }

    async fn claim_retries(&self, owner: &str, limit: usize, lease_ms: i64) -> Result<Vec<ClaimedEvent>, StoreError> {
        self.claim_with(&CLAIM_RETRIES, owner, limit, lease_ms, EventState::RetryClaimed, None).await
    }

    async fn register_attempt(&self, token: &ClaimToken) -> Result<AttemptRecord, StoreError> {
        self.register_attempts_tx(std::slice::from_ref(token))
            .await?
            .pop()
            .unwrap_or_else(|| Err(StoreError::NotFound(token.event_id.clone())))
    }

    async fn accept_dispatch_receipt(&self, receipt: &BrokerReceipt) -> Result<ReceiptOutcome, StoreError> {
        self.accept_dispatch_receipts_tx(std::slice::from_ref(receipt))
            .await?
            .pop()
            .ok_or_else(|| StoreError::NotFound(receipt.event_id.clone()))
    }

    async fn register_attempts(&self, tokens: &[ClaimToken]) -> Result<Vec<Result<AttemptRecord, StoreError>>, StoreError> {
        self.register_attempts_tx(tokens).await
    }

    async fn accept_dispatch_receipts(&self, receipts: &[BrokerReceipt]) -> Result<Vec<ReceiptOutcome>, StoreError> {
        self.accept_dispatch_receipts_tx(receipts).await
    }

    async fn report_unknown(&self, token: &ClaimToken, attempt_id: &AttemptId, detail: &str) -> Result<FenceOutcome, StoreError> {
        self.fenced_update(
            token,
            "report_unknown",
            "WITH ev AS (
                UPDATE outbox_events SET state = 'DISPATCH_UNKNOWN', claim_owner = NULL, lease_until_ms = NULL,
                       state_since_ms = $4, unknown_since_ms = coalesce(unknown_since_ms, $4), next_check_at_ms = $4
                WHERE event_id = $1 AND claim_generation = $2 AND claim_owner = $3 AND state = 'SENDING' AND claim_attempt_id = $5
                RETURNING event_id)
             UPDATE outbox_attempts SET state = 'UNKNOWN', detail = $6, finished_at_ms = $4
             WHERE attempt_id = $5 AND state = 'SENDING' AND EXISTS (SELECT 1 FROM ev)",
            |q| q.bind(attempt_id.as_str()).bind(detail),
        )
        .await
    }

    async fn report_not_sent(&self, token: &ClaimToken, attempt_id: &AttemptId, detail: &str) -> Result<FenceOutcome, StoreError> {
        self.fenced_update(
            token,
            "report_not_sent",
            // PENDING again, claimable after the backoff of its attempt
            // generation ($7: NOT_SENT_BACKOFFS), unless an earlier attempt
            // may still be in the log (a blind
            // retry left it UNKNOWN): then its late ACK must still find the
            // event accepting, so the event waits in DISPATCH_UNKNOWN for the
            // reconciler.
            "WITH other AS (
                SELECT 1 FROM outbox_attempts WHERE event_id = $1 AND attempt_id <> $5 AND state IN ('SENDING', 'UNKNOWN') LIMIT 1),
             ev AS (
                UPDATE outbox_events SET
                       state = CASE WHEN EXISTS (SELECT 1 FROM other) THEN 'DISPATCH_UNKNOWN' ELSE 'PENDING' END,
                       unknown_since_ms = CASE WHEN EXISTS (SELECT 1 FROM other) THEN coalesce(unknown_since_ms, $4) ELSE unknown_since_ms END,
                       next_check_at_ms = CASE WHEN EXISTS (SELECT 1 FROM other) THEN $4
                                          ELSE $4 + ($7::bigint[])[LEAST(GREATEST(attempt_generation, 1), cardinality($7::bigint[]))] END,
                       claim_owner = NULL, lease_until_ms = NULL, claim_attempt_id = NULL, state_since_ms = $4
                WHERE event_id = $1 AND claim_generation = $2 AND claim_owner = $3 AND state = 'SENDING' AND claim_attempt_id = $5
                RETURNING event_id)
             UPDATE outbox_attempts SET state = 'NOT_SENT', detail = $6, finished_at_ms = $4
             WHERE attempt_id = $5 AND state = 'SENDING' AND EXISTS (SELECT 1 FROM ev)",
            |q| q.bind(attempt_id.as_str()).bind(detail).bind(NOT_SENT_BACKOFFS.as_slice()),
        )
        .await
    }

    async fn release(&self, token: &ClaimToken) -> Result<FenceOutcome, StoreError> {
        self.fenced_update(
            token,
            "release",
            "UPDATE outbox_events SET state = 'PENDING', claim_owner = NULL, lease_until_ms = NULL, state_since_ms = $4
             WHERE event_id = $1 AND claim_generation = $2 AND claim_owner = $3 AND state = 'CLAIMED'",
            |q| q,
        )
        .await
    }

    async fn quarantine_claimed(&self, token: &ClaimToken, reason: &str, evidence: serde_json::Value) -> Result<FenceOutcome, StoreError> {
        self.fenced_update(
            token,
            "quarantine",
            "WITH ev AS (
                UPDATE outbox_events SET state = 'QUARANTINED', claim_owner = NULL, lease_until_ms = NULL, state_since_ms = $4
                WHERE event_id = $1 AND claim_generation = $2 AND claim_owner = $3 AND state IN ('CLAIMED', 'RETRY_CLAIMED')
                RETURNING event_id, envelope_generation)
             INSERT INTO outbox_quarantine (event_id, envelope_generation, reason, evidence, created_at_ms)
             SELECT event_id, envelope_generation, $5, $6, $4 FROM ev",
            |q| q.bind(reason).bind(evidence),
        )
        .await
    }

    async fn renew_lease(&self, token: &ClaimToken, lease_ms: i64) -> Result<Option<i64>, StoreError> {
        Ok(self.renew_leases(std::slice::from_ref(token), lease_ms).await?.pop().flatten())
    }

    async fn expire_leases(&self) -> Result<SweepOutcome, StoreError> {
        let now = self.now_ms();
        let mut tx = self.begin().await?;
        let rows = sqlx::query(&EXPIRE_LEASES_SQL)
        .bind(now)
        .bind(MAX_SWEEP_ROWS)
        .fetch_all(&mut *tx)
        .await
        .map_err(store_err)?;
        tx.commit().await.map_err(store_err)?;
        let mut out = SweepOutcome::default();
        for r in rows {
            let n = r.try_get::<i64, _>("n").map_err(store_err)? as u64;
            match r.try_get::<&str, _>("old_state").map_err(store_err)? {
                "CLAIMED" => out.released += n,
                "SENDING" => out.unknown += n,
                _ => out.retry_expired += n,
            }
        }
        if out != SweepOutcome::default() {
            tracing::info!(?out, "expired leases");
        }
        Ok(out)
    }

    async fn begin_reconcile(&self, owner: &str, limit: usize, lease_ms: i64) -> Result<Vec<ReconcileTask>, StoreError> {
        self.begin_reconcile_where(owner, limit, lease_ms, None).await
    }

    async fn finish_reconcile(&self, token: &ClaimToken, decision: &ReconcileDecision) -> Result<FenceOutcome, StoreError> {
        let Some(plan) = outbox_core::reconcile::plan_reconcile_finish(decision) else { return Ok(FenceOutcome::NoOp) };
        self.fenced_update(token, "finish_reconcile", &FINISH_RECONCILE_SQL, move |q| {
            q.bind(plan.to.as_str()).bind(plan.next_check_at_ms).bind(plan.close_open_attempts)
        })
        .await
        .inspect(|_| {
            if let ReconcileDecision::Recheck { reason, .. } = decision {
                tracing::debug!(event_id = %token.event_id, ?reason, "unknown stays unknown");
            }
        })
    }

    async fn attempts(&self, event_id: &EventId) -> Result<Vec<AttemptRecord>, StoreError> {
        sqlx::query(&format!("SELECT {ATTEMPT_COLUMNS} FROM outbox_attempts WHERE event_id = $1 ORDER BY attempt_generation"))
            .bind(event_id.as_str())
            .fetch_all(&self.pool)
            .await
            .map_err(store_err)?
            .iter()
            .map(attempt_from_row)
            .collect()
    }

    async fn event_state(&self, event_id: &EventId) -> Result<(EventState, Option<BrokerReceipt>), StoreError> {
        let row = sqlx::query("SELECT state, envelope_generation FROM outbox_events WHERE event_id = $1")
            .bind(event_id.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(store_err)?
            .ok_or_else(|| StoreError::NotFound(event_id.clone()))?;
        let state = EventState::parse(row.try_get("state").map_err(store_err)?)?;
        let generation: i32 = row.try_get("envelope_generation").map_err(store_err)?;
        let slot = sqlx::query(&format!("SELECT {RECEIPT_COLUMNS} FROM outbox_publish_receipts WHERE event_id = $1 AND envelope_generation = $2"))
            .bind(event_id.as_str())
            .bind(generation)
            .fetch_optional(&self.pool)
            .await
            .map_err(store_err)?
            .map(|r| receipt_from_row(&r))
            .transpose()?;
        Ok((state, slot))
    }
}
