//! Destination migration (PROTOCOL §7): move an undelivered event to another
//! cluster or topic only after proving the old target does not hold it.
//!
//! The original envelope generation is never edited: the move writes envelope
//! generation + 1 with the new frozen destination and a *migration receipt*
//! linking the two, with the proof. While the old target is UNKNOWN and
//! cannot be asked, the move is refused: no cross-target re-send ever happens
//! in disguise. Delivery to two targets is not a migration; it is not offered
//! as one.

use outbox_core::{
    decide_migration, scan_floor, Broker, Destination, Envelope, EventId, EventState, LookupOutcome, MigrationDecision, MigrationRefusal, OutboxStore,
    RecheckReason, ReconcileDecision, RetryPolicy, RoutePolicy,
};
use serde::Serialize;
use sqlx::Row;

use crate::error::ProducerError;
use crate::pg::PgStore;

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

/// What the proof was made under, checked again under the row lock at the
/// commit: for a never-sent (PENDING) event, the claim generation it read
/// (any claim since bumps it); for a proven-absent one, the reconcile claim
/// the lookup was made under.
enum Fence {
    /// PENDING at this claim generation.
    Generation(u64),
    /// RECONCILING under this claim, with the lookup's answer.
    Claim(outbox_core::ClaimToken, LookupOutcome),
}

/// Moves `event_id` to the destination `new_route` resolves for it.
///
/// `old_broker` must be connected to the cluster the event is frozen for; it
/// is asked whether the event is there when an attempt may have reached it.
pub async fn migrate_destination<B: Broker>(
    store: &PgStore,
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
pub async fn migrate_destination_with<B: Broker>(
    store: &PgStore,
    old_broker: &B,
    event_id: &EventId,
    new_route: &RoutePolicy,
    operator: &str,
    retry: &RetryPolicy,
    dry_run: bool,
) -> Result<MigrationOutcome, ProducerError> {
    outbox_core::id::validate_identifier("operator", operator)?;
    new_route.validate()?;
    outbox_core::check_in_flight_bound(retry.in_flight_bound_ms, old_broker.max_in_flight_ms(), outbox_core::reconcile::DEFAULT_CLOCK_SKEW_ALLOWANCE_MS)
        .map_err(ProducerError::Config)?;
    let refused = |reason: String| Ok(MigrationOutcome::Refused { reason });
    let Some(read) = sqlx::query("SELECT state, claim_generation FROM outbox_events WHERE event_id = $1").bind(event_id.as_str()).fetch_optional(store.pool()).await? else {
        return Err(outbox_core::StoreError::NotFound(event_id.clone()).into());
    };
    let state = EventState::parse(read.try_get("state")?)?;
    let read_generation = read.try_get::<i64, _>("claim_generation")? as u64;
    let attempts = store.attempts(event_id).await?;
    // The decision is outbox_core::decide_migration, the same function the
    // in-memory store and the simulator use.
    let fence = match state {
        EventState::Pending => match decide_migration(state, &attempts, None, retry, store.now_ms()) {
            MigrationDecision::Move { .. } => Fence::Generation(read_generation),
            MigrationDecision::Refuse(r) => return refused(r.to_string()),
        },
        EventState::DispatchUnknown => {
            let owner = format!("migrate-{operator}");
            let mut tasks = store.begin_reconcile_where(&owner, 1, 60_000, Some(event_id)).await?;
            let Some(task) = tasks.pop() else { return refused("the event is being reconciled; try again".into()) };
            let lookup = if !old_broker.supports_lookup() || task.event.destination.cluster_id != old_broker.cluster_id() {
                LookupOutcome::Unavailable("the old target cannot be queried".into())
            } else {
                old_broker.lookup(&task.event.destination, event_id, &scan_floor(&task.attempts)).await
            };
            let now = store.now_ms();
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
            Fence::Claim(task.token, lookup)
        }
        other => match decide_migration(other, &attempts, None, retry, store.now_ms()) {
            MigrationDecision::Refuse(r) => return refused(r.to_string()),
            // decide_migration moves only PENDING or DISPATCH_UNKNOWN events; refuse rather than trust that here.
            MigrationDecision::Move { .. } => return refused(format!("state {other}: only PENDING or proven-absent DISPATCH_UNKNOWN events can move")),
        },
    };
    let outcome = commit_migration(store, event_id, new_route, operator, retry, &fence, dry_run).await;
    // A dry run, or a commit that refused, gives the reconcile claim back
    // (fenced: a claim lost meanwhile changes nothing).
    if let Fence::Claim(token, _) = &fence {
        if dry_run || !matches!(outcome, Ok(MigrationOutcome::Migrated { .. })) {
            let next = ReconcileDecision::Recheck { reason: RecheckReason::RetryNotAllowed, next_check_at_ms: store.now_ms() };
            store.finish_reconcile(token, &next).await?;
        }
    }
    outcome
}

/// The commit of a migration: under the row lock, checks the fence, reads
/// the attempts again and re-runs [`decide_migration`] on them; only then
/// writes the new envelope generation (bumping the claim generation, so
/// every earlier claim holder is fenced), closes open attempts ABSENT and
/// writes the migration receipt.
async fn commit_migration(
    store: &PgStore,
    event_id: &EventId,
    new_route: &RoutePolicy,
    operator: &str,
    retry: &RetryPolicy,
    fence: &Fence,
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
    let decision = match fence {
        Fence::Generation(read) => {
            if locked_state != EventState::Pending || locked_generation != *read {
                return refused(format!("the event changed meanwhile (now {locked_state}, claim generation {locked_generation}, read at {read}): its proof no longer holds"));
            }
            decide_migration(EventState::Pending, &attempts, None, retry, now)
        }
        Fence::Claim(token, lookup) => {
            if locked_state != EventState::Reconciling || locked_generation != token.claim_generation || locked_owner.as_deref() != Some(token.owner.as_str()) {
                return refused(format!("the reconcile claim the absence proof was made under was lost (now {locked_state}, claim generation {locked_generation})"));
            }
            decide_migration(EventState::DispatchUnknown, &attempts, Some(lookup), retry, now)
        }
    };
    let proof = match decision {
        MigrationDecision::Move { proof } => proof,
        MigrationDecision::Refuse(r) => return refused(r.to_string()),
    };
    let proof = match (&proof, fence) {
        (outbox_core::MigrationProof::NeverPersisted, _) => serde_json::json!({
            "kind": "never_persisted", "claim_generation": locked_generation,
            "attempts": attempts.iter().map(|a| (a.attempt_id.to_string(), a.state.as_str())).collect::<Vec<_>>() }),
        (outbox_core::MigrationProof::ProvenAbsent { lookup_from_offset }, _) => {
            serde_json::json!({ "kind": "proven_absent", "lookup_from_offset": lookup_from_offset, "claim_generation": locked_generation })
        }
    };
    let old: Envelope = Envelope::from_canonical(row.try_get::<&[u8], _>("envelope_canonical")?)?;
    let from_digest: String = row.try_get("destination_digest")?;
    let destination: Destination = new_route.resolve(&old.tenant, &old.aggregate_type, &old.aggregate_id)?;
    let to_digest = destination.digest();
    if to_digest == from_digest {
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
