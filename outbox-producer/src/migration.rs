//! Destination migration (PROTOCOL §7): move an undelivered event to another
//! cluster or topic only after proving the old target does not hold it.
//!
//! The original envelope generation is never edited: the move writes envelope
//! generation + 1 with the new frozen destination and a *migration receipt*
//! linking the two, with the proof. While the old target is UNKNOWN and
//! cannot be asked, the move is refused: no cross-target re-send ever happens
//! in disguise. Delivery to two targets is not a migration; it is not offered
//! as one.

use async_trait::async_trait;
use outbox_core::{
    check_migration_fence, decide_migration, may_keep_destination, read_fence, scan_floor, Broker, Destination, Envelope, EventId, EventState, LookupOutcome, MigrationDecision,
    MigrationFence, MigrationProof, MigrationRefusal, RecheckReason, ReconcileDecision, ReconcileTask, RetryPolicy, RoutePolicy, StoreError,
};
use outbox_memory::MemoryStore;
use serde::Serialize;
use sqlx::Row;

use crate::error::ProducerError;
use crate::pg::PgStore;
use crate::service_store::ServiceStore;

/// The lease of the reconcile claim a migration looks the old target up
/// under (an operator's command: generous).
pub const MIGRATION_CLAIM_LEASE_MS: i64 = 60_000;

/// What a migration request came to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum MigrationOutcome {
    /// Moved: a new envelope generation with the new destination, PENDING.
    Migrated {
        /// Generation left behind.
        from_generation: u32,
        /// New generation.
        to_generation: u32,
        /// The new frozen destination's digest.
        to_destination_digest: String,
    },
    /// A dry run: the event would move, with this proof. Nothing changed.
    WouldMigrate {
        /// Generation it would leave behind.
        from_generation: u32,
        /// The new frozen destination's digest.
        to_destination_digest: String,
        /// Why the old target does not hold it.
        proof: serde_json::Value,
    },
    /// Not moved, and why. Nothing was sent anywhere.
    Refused {
        /// The reason.
        reason: String,
    },
}

/// The store a destination migration runs over: [`PgStore`] in production,
/// [`MemoryStore`] in the simulator (`outbox-sim`), which runs this same
/// [`migrate_destination_in`] against the shipped dispatcher and reconciler.
/// The commit's checks are the core's: [`check_migration_fence`] and
/// [`decide_migration`] on the attempts read under the row lock.
#[async_trait]
pub trait MigrationStore: ServiceStore {
    /// The event's state and claim generation, as first read.
    async fn migration_read(&self, event_id: &EventId) -> Result<(EventState, u64), ProducerError>;

    /// The CAS DISPATCH_UNKNOWN -> RECONCILING for this one event, due or
    /// not; `None` when it is not DISPATCH_UNKNOWN (being reconciled).
    async fn begin_reconcile_event(&self, owner: &str, event_id: &EventId, lease_ms: i64) -> Result<Option<ReconcileTask>, StoreError>;

    /// The commit: under the row lock, [`check_migration_fence`] on the row,
    /// the attempts read again and [`decide_migration`] re-run on them (with
    /// the old target's `lookup` for a proven-absent move); only then the new
    /// envelope generation with the destination `new_route` resolves
    /// (bumping the claim generation, so every earlier claim holder is
    /// fenced), open attempts closed ABSENT and the migration receipt.
    #[allow(clippy::too_many_arguments)]
    async fn commit_migration(
        &self,
        event_id: &EventId,
        new_route: &RoutePolicy,
        operator: &str,
        retry: &RetryPolicy,
        fence: &MigrationFence,
        lookup: Option<&LookupOutcome>,
        dry_run: bool,
    ) -> Result<MigrationOutcome, ProducerError>;
}

/// Moves `event_id` to the destination `new_route` resolves for it.
///
/// `old_broker` must be connected to the cluster the event is frozen for; it
/// is asked whether the event is there when an attempt may have reached it.
pub async fn migrate_destination<S: MigrationStore, B: Broker>(
    store: &S,
    old_broker: &B,
    event_id: &EventId,
    new_route: &RoutePolicy,
    operator: &str,
    retry: &RetryPolicy,
) -> Result<MigrationOutcome, ProducerError> {
    migrate_destination_with(store, old_broker, event_id, new_route, operator, retry, false).await
}

/// [`migrate_destination`], or with `dry_run` the same eligibility check
/// (the same reads, the same lookup under a reconcile claim, the same
/// decision under the row lock) ending in [`MigrationOutcome::WouldMigrate`]
/// or `Refused` without moving anything. A dry run of an UNKNOWN event
/// gives its reconcile claim back with its next check due at once.
pub async fn migrate_destination_with<S: MigrationStore, B: Broker>(
    store: &S,
    old_broker: &B,
    event_id: &EventId,
    new_route: &RoutePolicy,
    operator: &str,
    retry: &RetryPolicy,
    dry_run: bool,
) -> Result<MigrationOutcome, ProducerError> {
    migrate_destination_in(store, old_broker, event_id, new_route, operator, retry, dry_run, MIGRATION_CLAIM_LEASE_MS).await
}

/// [`migrate_destination_with`] with the reconcile claim's lease
/// `claim_lease_ms` (the simulator runs it with leases as short as its
/// services').
#[allow(clippy::too_many_arguments)]
pub async fn migrate_destination_in<S: MigrationStore, B: Broker>(
    store: &S,
    old_broker: &B,
    event_id: &EventId,
    new_route: &RoutePolicy,
    operator: &str,
    retry: &RetryPolicy,
    dry_run: bool,
    claim_lease_ms: i64,
) -> Result<MigrationOutcome, ProducerError> {
    outbox_core::id::validate_identifier("operator", operator)?;
    new_route.validate()?;
    outbox_core::check_in_flight_bound(retry.in_flight_bound_ms, old_broker.max_in_flight_ms(), outbox_core::reconcile::DEFAULT_CLOCK_SKEW_ALLOWANCE_MS)
        .map_err(ProducerError::Config)?;
    let refused = |reason: String| Ok(MigrationOutcome::Refused { reason });
    let (state, read_generation) = store.migration_read(event_id).await?;
    let attempts = store.attempts(event_id).await?;
    // The decision is outbox_core::decide_migration, the same function the
    // in-memory store and the simulator use.
    let (fence, lookup) = match (state, read_fence(state, read_generation)) {
        // PENDING, or a QUARANTINED event's re-send: no lookup, the
        // attempts alone prove nothing of it is in the old target.
        (_, Some(fence)) => match decide_migration(state, &attempts, None, retry, store.now_ms()) {
            MigrationDecision::Move { .. } => (fence, None),
            MigrationDecision::Refuse(r) => return refused(r.to_string()),
        },
        (EventState::DispatchUnknown, None) => {
            let owner = format!("migrate-{operator}");
            let Some(task) = store.begin_reconcile_event(&owner, event_id, claim_lease_ms).await? else { return refused("the event is being reconciled; try again".into()) };
            // Before the lookup, as the reconciler: the scan answers for the
            // log as it was when it began.
            let now = store.now_ms();
            let lookup = if !old_broker.supports_lookup() || task.event.destination.cluster_id != old_broker.cluster_id() {
                LookupOutcome::Unavailable("the old target cannot be queried".into())
            } else {
                old_broker.lookup(&task.event.destination, event_id, &scan_floor(&task.attempts)).await
            };
            // A log that cannot prove absence (truncated, recreated,
            // compacted) is reported here as the reconciler reports it: an
            // operator asking again and again holds the event each time,
            // and the reconciler may never get to it.
            if let LookupOutcome::Unavailable(why) = &lookup {
                if crate::kafka::is_log_incomplete(why) {
                    store.record_findings(&[("log_unavailable", event_id.to_string(), why.clone())], now).await?;
                }
            }
            match decide_migration(EventState::DispatchUnknown, &task.attempts, Some(&lookup), retry, now) {
                MigrationDecision::Move { .. } => {}
                MigrationDecision::Refuse(MigrationRefusal::OldTargetHoldsEvent { receipts }) => {
                    store.accept_dispatch_receipts(&receipts).await?;
                    let (after, _) = store.event_state(event_id).await?;
                    if after == EventState::Reconciling {
                        let recheck = ReconcileDecision::Recheck { reason: RecheckReason::ReceiptsRefused, next_check_at_ms: now + retry.recheck_ms };
                        store.finish_reconcile(&task.token, &recheck).await?;
                    }
                    return refused(format!("the old target holds the event; it is now {after}"));
                }
                MigrationDecision::Refuse(r) => {
                    store.finish_reconcile(&task.token, &r.recheck(retry, now)).await?;
                    return refused(r.to_string());
                }
            }
            (MigrationFence::Claim(task.token), Some(lookup))
        }
        (other, None) => match decide_migration(other, &attempts, None, retry, store.now_ms()) {
            MigrationDecision::Refuse(r) => return refused(r.to_string()),
            // decide_migration moves only PENDING, QUARANTINED or DISPATCH_UNKNOWN events; refuse rather than trust that here.
            MigrationDecision::Move { .. } => return refused(format!("state {other}: only PENDING, QUARANTINED or proven-absent DISPATCH_UNKNOWN events can move")),
        },
    };
    let outcome = store.commit_migration(event_id, new_route, operator, retry, &fence, lookup.as_ref(), dry_run).await;
    // A dry run, or a commit that refused, gives the reconcile claim back
    // (fenced: a claim lost meanwhile changes nothing).
    if let MigrationFence::Claim(token) = &fence {
        if dry_run || !matches!(outcome, Ok(MigrationOutcome::Migrated { .. })) {
            let next = ReconcileDecision::Recheck { reason: RecheckReason::RetryNotAllowed, next_check_at_ms: store.now_ms() };
            store.finish_reconcile(token, &next).await?;
        }
    }
    outcome
}

#[async_trait]
impl MigrationStore for PgStore {
    async fn migration_read(&self, event_id: &EventId) -> Result<(EventState, u64), ProducerError> {
        // A stream event is migrated in the lane (schema section 17).
        self.stream_event_to_lane(event_id.as_str()).await?;
        let Some(read) = sqlx::query("SELECT state, claim_generation FROM outbox_events WHERE event_id = $1").bind(event_id.as_str()).fetch_optional(self.pool()).await? else {
            return Err(StoreError::NotFound(event_id.clone()).into());
        };
        Ok((EventState::parse(read.try_get("state")?)?, read.try_get::<i64, _>("claim_generation")? as u64))
    }

    async fn begin_reconcile_event(&self, owner: &str, event_id: &EventId, lease_ms: i64) -> Result<Option<ReconcileTask>, StoreError> {
        Ok(self.begin_reconcile_where(owner, 1, lease_ms, Some(event_id)).await?.pop())
    }

    async fn commit_migration(
        &self,
        event_id: &EventId,
        new_route: &RoutePolicy,
        operator: &str,
        retry: &RetryPolicy,
        fence: &MigrationFence,
        lookup: Option<&LookupOutcome>,
        dry_run: bool,
    ) -> Result<MigrationOutcome, ProducerError> {
        self.stream_event_to_lane(event_id.as_str()).await?;
        commit_migration_pg(self, event_id, new_route, operator, retry, fence, lookup, dry_run).await
    }
}

/// The simulator's store: the same checks, in [`MemoryStore::commit_migration`].
#[async_trait]
impl MigrationStore for MemoryStore {
    async fn migration_read(&self, event_id: &EventId) -> Result<(EventState, u64), ProducerError> {
        let st = self.lock();
        let ev = st.events.get(event_id).ok_or_else(|| StoreError::NotFound(event_id.clone()))?;
        Ok((ev.state, ev.claim.claim_generation))
    }

    async fn begin_reconcile_event(&self, owner: &str, event_id: &EventId, lease_ms: i64) -> Result<Option<ReconcileTask>, StoreError> {
        MemoryStore::begin_reconcile_event(self, owner, event_id, lease_ms)
    }

    async fn commit_migration(
        &self,
        event_id: &EventId,
        new_route: &RoutePolicy,
        operator: &str,
        retry: &RetryPolicy,
        fence: &MigrationFence,
        lookup: Option<&LookupOutcome>,
        dry_run: bool,
    ) -> Result<MigrationOutcome, ProducerError> {
        let old = self.lock().events.get(event_id).map(|e| e.envelope.clone()).ok_or_else(|| StoreError::NotFound(event_id.clone()))?;
        let destination = new_route.resolve(&old.tenant, &old.aggregate_type, &old.aggregate_id)?;
        match MemoryStore::commit_migration(self, event_id, destination, fence, lookup, retry, operator, dry_run)? {
            Err(reason) => Ok(MigrationOutcome::Refused { reason }),
            Ok(r) if dry_run => Ok(MigrationOutcome::WouldMigrate {
                from_generation: r.from_generation,
                to_destination_digest: r.to_destination_digest,
                proof: serde_json::to_value(&r.proof).unwrap_or_default(),
            }),
            Ok(r) => Ok(MigrationOutcome::Migrated { from_generation: r.from_generation, to_generation: r.to_generation, to_destination_digest: r.to_destination_digest }),
        }
    }
}

/// The commit of a migration in PostgreSQL: under the row lock, checks the fence, reads
/// the attempts again and re-runs [`decide_migration`] on them; only then
/// writes the new envelope generation (bumping the claim generation, so
/// every earlier claim holder is fenced), closes open attempts ABSENT and
/// writes the migration receipt.
#[allow(clippy::too_many_arguments)]
async fn commit_migration_pg(
    store: &PgStore,
    event_id: &EventId,
    new_route: &RoutePolicy,
    operator: &str,
    retry: &RetryPolicy,
    fence: &MigrationFence,
    lookup: Option<&LookupOutcome>,
    dry_run: bool,
) -> Result<MigrationOutcome, ProducerError> {
    let refused = |reason: String| Ok(MigrationOutcome::Refused { reason });
    let now = store.now_ms();
    let mut tx = store.pool().begin().await?;
    let row = sqlx::query(
        "SELECT e.state, e.envelope_generation, e.destination_digest, e.unknown_since_ms, e.claim_owner, e.claim_generation, v.envelope_canonical
         FROM outbox_events e JOIN outbox_envelopes v ON v.event_id = e.event_id AND v.envelope_generation = e.envelope_generation
         WHERE e.event_id = $1 FOR UPDATE OF e",
    )
    .bind(event_id.as_str())
    .fetch_one(&mut *tx)
    .await?;
    let locked_state = EventState::parse(row.try_get("state")?)?;
    let locked_generation = row.try_get::<i64, _>("claim_generation")? as u64;
    let locked_owner: Option<String> = row.try_get("claim_owner")?;
    // Read in this transaction, after the row lock: no attempt can be
    // registered for the event while it is held.
    let attempts = PgStore::attempts_in(&mut tx, event_id).await?;
    let decide_as = match check_migration_fence(fence, locked_state, locked_generation, locked_owner.as_deref()) {
        Ok(s) => s,
        Err(why) => return refused(why),
    };
    let decision = decide_migration(decide_as, &attempts, lookup, retry, now);
    let proof = match decision {
        MigrationDecision::Move { proof } => proof,
        MigrationDecision::Refuse(r) => return refused(r.to_string()),
    };
    let proof = match &proof {
        MigrationProof::NeverPersisted => serde_json::json!({
            "kind": "never_persisted", "claim_generation": locked_generation, "from_state": locked_state.as_str(),
            "attempts": attempts.iter().map(|a| (a.attempt_id.to_string(), a.state.as_str())).collect::<Vec<_>>() }),
        MigrationProof::ProvenAbsent { lookup_from_offset } => {
            serde_json::json!({ "kind": "proven_absent", "lookup_from_offset": lookup_from_offset, "claim_generation": locked_generation })
        }
    };
    let old: Envelope = Envelope::from_canonical(row.try_get::<&[u8], _>("envelope_canonical")?)?;
    let from_digest: String = row.try_get("destination_digest")?;
    let destination: Destination = new_route.resolve(&old.tenant, &old.aggregate_type, &old.aggregate_id)?;
    let to_digest = destination.digest();
    if to_digest == from_digest && !may_keep_destination(locked_state) {
        return refused("the new route resolves to the same destination".into());
    }
    if dry_run {
        return Ok(MigrationOutcome::WouldMigrate { from_generation: old.envelope_generation, to_destination_digest: to_digest, proof });
    }
    let envelope = Envelope { envelope_generation: old.envelope_generation + 1, ..old.clone() };
    sqlx::query(
        "INSERT INTO outbox_envelopes (event_id, envelope_generation, envelope_canonical, envelope_digest, destination_canonical,
             destination_digest, payload_digest, created_txid, created_at_ms)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(event_id.as_str())
    .bind(envelope.envelope_generation as i32)
    .bind(envelope.canonical_bytes())
    .bind(envelope.digest())
    .bind(destination.canonical_bytes())
    .bind(&to_digest)
    .bind(&envelope.payload_digest)
    .bind(envelope.created_txid as i64)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "UPDATE outbox_attempts SET state = 'ABSENT', finished_at_ms = $2, detail = 'proven absent before destination migration'
         WHERE event_id = $1 AND state IN ('SENDING', 'UNKNOWN')",
    )
    .bind(event_id.as_str())
    .bind(now)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "UPDATE outbox_events SET state = 'PENDING', envelope_generation = $2, destination_digest = $3, cluster_id = $4, topic = $5,
                partition = $6, routing_key = $7, ordered = $8, claim_owner = NULL, lease_until_ms = NULL, claim_attempt_id = NULL,
                claim_generation = claim_generation + 1,
                unknown_since_ms = NULL, next_check_at_ms = 0, state_since_ms = $9
         WHERE event_id = $1",
    )
    .bind(event_id.as_str())
    .bind(envelope.envelope_generation as i32)
    .bind(&to_digest)
    .bind(&destination.cluster_id)
    .bind(&destination.topic)
    .bind(destination.partition)
    .bind(&destination.routing_key)
    .bind(destination.ordering == outbox_core::Ordering::Key)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    if let Some(since) = row.try_get::<Option<i64>, _>("unknown_since_ms")? {
        sqlx::query("INSERT INTO outbox_unknown_resolutions (event_id, unknown_since_ms, resolved_at_ms, outcome) VALUES ($1, $2, $3, 'MIGRATED')")
            .bind(event_id.as_str())
            .bind(since)
            .bind(now)
            .execute(&mut *tx)
            .await?;
    }
    sqlx::query(
        "INSERT INTO outbox_migration_receipts (event_id, from_generation, to_generation, from_destination_digest, to_destination_digest, proof, operator, at_ms)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(event_id.as_str())
    .bind(old.envelope_generation as i32)
    .bind(envelope.envelope_generation as i32)
    .bind(&from_digest)
    .bind(&to_digest)
    .bind(&proof)
    .bind(operator)
    .bind(now)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    tracing::info!(%event_id, from = old.envelope_generation, to = envelope.envelope_generation, "destination migrated");
    Ok(MigrationOutcome::Migrated { from_generation: old.envelope_generation, to_generation: envelope.envelope_generation, to_destination_digest: to_digest })
}
