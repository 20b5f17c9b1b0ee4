//! An operator's way out of a blocked key (issue 47): skip a QUARANTINED
//! or DISPATCH_UNKNOWN event, closing it SKIPPED (`outbox skip`).
//!
//! With per-key ordering every later event of a key waits while its head
//! holds the key; a QUARANTINED head has no way out of its own, nor has a
//! DISPATCH_UNKNOWN head whose absence cannot be proven (it can be neither
//! retried nor migrated). The skip is decided by the core
//! ([`outbox_core::skip::decide_skip`]) on the row as locked, and writes the
//! transition and its evidence (an `outbox_audit` row, action `skip`: who,
//! when, why, from which state) in one transaction. It bumps the claim
//! generation, so every earlier claim holder is fenced; a RECONCILING event
//! (a reconciler's lease in flight) is refused. The chain-head triggers
//! move the key's head to its next open event in the same transaction.
//!
//! The event is never published by the outbox: consumers see a gap in the
//! key's sequence. A skipped DISPATCH_UNKNOWN event may yet have reached
//! the log; a late genuine copy is kept as evidence (a duplicate transport
//! receipt), the event stays SKIPPED.

use async_trait::async_trait;
use outbox_core::id::validate_identifier;
use outbox_core::skip::{decide_skip, PoisonPolicy, PoisonRule, SkipRecord, POISON_POLICY_ACTOR, SKIP_ACTION};
use outbox_core::{EventId, EventState, StoreError};
use outbox_memory::MemoryStore;
use serde::Serialize;
use sqlx::Row;

use crate::error::ProducerError;
use crate::pg::PgStore;

/// What a skip request came to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum SkipOutcome {
    /// Closed SKIPPED; the record is its evidence as stored.
    Skipped {
        /// The evidence.
        record: SkipRecord,
    },
    /// Not skipped, and why. Nothing changed.
    Refused {
        /// The reason ([`outbox_core::SkipRefusal`]'s text).
        reason: String,
    },
}

/// The stores an operator skips an event in: [`PgStore`] in production,
/// [`MemoryStore`] in the simulator and the conformance suite.
#[async_trait]
pub trait SkipStore: Send + Sync {
    /// Skips `event_id` for `operator` (an identifier) with `reason`: under
    /// the row lock, [`decide_skip`]; then QUARANTINED or DISPATCH_UNKNOWN
    /// -> SKIPPED (claim generation bumped, claim cleared) and the evidence,
    /// in one transaction.
    async fn skip_event(&self, event_id: &EventId, operator: &str, reason: &str) -> Result<SkipOutcome, ProducerError>;

    /// The skip records of `event_id`, oldest first.
    async fn skip_records(&self, event_id: &EventId) -> Result<Vec<SkipRecord>, ProducerError>;

    /// Sets a route's poison policy (a new setting; the older ones stay as its history).
    async fn set_poison_policy(&self, rule: &PoisonRule) -> Result<(), ProducerError>;

    /// The poison policy in force for `event_type`, if one was set (none: block).
    async fn poison_policy(&self, event_type: &str) -> Result<Option<PoisonRule>, ProducerError>;

    /// Up to `limit` QUARANTINED events whose route's poison policy is
    /// skip, oldest first, each with the rule in force.
    async fn poisoned(&self, limit: usize) -> Result<Vec<(EventId, PoisonRule)>, ProducerError>;

    /// Closes up to `limit` QUARANTINED events of routes whose poison
    /// policy is skip, each as an operator's skip would (the same decision
    /// on the locked row, the same evidence), under the name
    /// [`POISON_POLICY_ACTOR`] and a reason naming the rule's setter and
    /// reason. An event another writer moved on meanwhile is refused and
    /// left alone. The skips made, oldest first.
    async fn release_poisoned(&self, limit: usize) -> Result<Vec<SkipRecord>, ProducerError> {
        let mut out = Vec::new();
        for (event_id, rule) in self.poisoned(limit).await? {
            match self.skip_event(&event_id, POISON_POLICY_ACTOR, &rule.skip_reason()).await? {
                SkipOutcome::Skipped { record } => {
                    tracing::warn!(%event_id, event_type = %rule.event_type, set_by = %rule.actor, "quarantined event skipped by its route's poison policy: its key moves on without it");
                    out.push(record);
                }
                SkipOutcome::Refused { reason } => tracing::debug!(%event_id, reason, "poison policy skip refused"),
            }
        }
        Ok(out)
    }
}

#[async_trait]
impl SkipStore for PgStore {
    async fn skip_event(&self, event_id: &EventId, operator: &str, reason: &str) -> Result<SkipOutcome, ProducerError> {
        validate_identifier("operator", operator)?;
        let now = self.now_ms();
        let mut tx = self.pool().begin().await?;
        let Some(row) = sqlx::query("SELECT state, claim_owner, unknown_since_ms FROM outbox_events WHERE event_id = $1 FOR UPDATE")
            .bind(event_id.as_str())
            .fetch_optional(&mut *tx)
            .await?
        else {
            return Err(StoreError::NotFound(event_id.clone()).into());
        };
        let state = EventState::parse(row.try_get("state")?)?;
        let owner: Option<String> = row.try_get("claim_owner")?;
        let from = match decide_skip(state, owner.as_deref(), reason) {
            Ok(from) => from,
            Err(refusal) => return Ok(SkipOutcome::Refused { reason: refusal.to_string() }),
        };
        let unknown_since_ms: Option<i64> = row.try_get("unknown_since_ms")?;
        let generation: i64 = sqlx::query_scalar(
            "UPDATE outbox_events SET state = 'SKIPPED', claim_owner = NULL, lease_until_ms = NULL, claim_attempt_id = NULL,
                    claim_generation = claim_generation + 1, unknown_since_ms = NULL, state_since_ms = $2
             WHERE event_id = $1 RETURNING claim_generation",
        )
        .bind(event_id.as_str())
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        let record = SkipRecord {
            event_id: event_id.to_string(),
            from_state: from,
            operator: operator.to_owned(),
            reason: reason.to_owned(),
            at_ms: now,
            claim_generation: generation as u64,
            unknown_since_ms,
        };
        let detail = serde_json::json!({
            "from_state": from.as_str(), "reason": reason, "claim_generation": generation, "unknown_since_ms": unknown_since_ms,
        });
        sqlx::query("INSERT INTO outbox_audit (event_id, actor, action, detail, at_ms) VALUES ($1, $2, $3, $4, $5)")
            .bind(event_id.as_str())
            .bind(operator)
            .bind(SKIP_ACTION)
            .bind(&detail)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        // A skipped UNKNOWN is resolved by the skip (its outcome SKIPPED),
        // as the reconciler's resolutions and a migration's are.
        if let (EventState::DispatchUnknown, Some(since)) = (from, unknown_since_ms) {
            sqlx::query("INSERT INTO outbox_unknown_resolutions (event_id, unknown_since_ms, resolved_at_ms, outcome) VALUES ($1, $2, $3, 'SKIPPED')")
                .bind(event_id.as_str())
                .bind(since)
                .bind(now)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        tracing::warn!(%event_id, from = %from, operator, reason, "event skipped by an operator: its key moves on without it");
        Ok(SkipOutcome::Skipped { record })
    }

    async fn skip_records(&self, event_id: &EventId) -> Result<Vec<SkipRecord>, ProducerError> {
        let rows = sqlx::query("SELECT actor, detail, at_ms FROM outbox_audit WHERE event_id = $1 AND action = $2 ORDER BY id")
            .bind(event_id.as_str())
            .bind(SKIP_ACTION)
            .fetch_all(self.pool())
            .await?;
        rows.iter().map(|r| pg_record(event_id, r)).collect()
    }

    async fn set_poison_policy(&self, rule: &PoisonRule) -> Result<(), ProducerError> {
        rule.validate()?;
        sqlx::query("INSERT INTO outbox_poison_policies (event_type, policy, actor, reason, at_ms) VALUES ($1, $2, $3, $4, $5)")
            .bind(&rule.event_type)
            .bind(rule.policy.as_str())
            .bind(&rule.actor)
            .bind(&rule.reason)
            .bind(rule.at_ms)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    async fn poison_policy(&self, event_type: &str) -> Result<Option<PoisonRule>, ProducerError> {
        let row = sqlx::query("SELECT event_type, policy, actor, reason, at_ms FROM outbox_poison_policies WHERE event_type = $1 ORDER BY id DESC LIMIT 1")
            .bind(event_type)
            .fetch_optional(self.pool())
            .await?;
        row.as_ref().map(pg_rule).transpose()
    }

    async fn poisoned(&self, limit: usize) -> Result<Vec<(EventId, PoisonRule)>, ProducerError> {
        // The rules in force that skip (one probe per event type), then
        // their types' QUARANTINED events, oldest first.
        let rows = sqlx::query(
            "WITH rules AS (
                 SELECT DISTINCT ON (event_type) event_type, policy, actor, reason, at_ms FROM outbox_poison_policies ORDER BY event_type, id DESC)
             SELECT e.event_id, r.event_type, r.policy, r.actor, r.reason, r.at_ms
             FROM rules r JOIN LATERAL (SELECT q.event_id, q.seq FROM outbox_events q
                                        WHERE q.phase = 'QUARANTINED' AND q.event_type = r.event_type ORDER BY q.seq LIMIT $1) e ON true
             WHERE r.policy = 'skip'
             ORDER BY e.seq LIMIT $1",
        )
        .bind(limit.min(10_000) as i64)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(|r| Ok((r.try_get::<&str, _>("event_id")?.parse::<EventId>().map_err(ProducerError::from)?, pg_rule(r)?))).collect()
    }
}

/// A poison rule from its `outbox_poison_policies` row.
fn pg_rule(r: &sqlx::postgres::PgRow) -> Result<PoisonRule, ProducerError> {
    Ok(PoisonRule {
        event_type: r.try_get("event_type")?,
        policy: PoisonPolicy::parse(r.try_get("policy")?).map_err(|e| ProducerError::Store(StoreError::Backend { message: e, retryable: false }))?,
        actor: r.try_get("actor")?,
        reason: r.try_get("reason")?,
        at_ms: r.try_get("at_ms")?,
    })
}

/// A skip record from its `outbox_audit` row.
fn pg_record(event_id: &EventId, r: &sqlx::postgres::PgRow) -> Result<SkipRecord, ProducerError> {
    let detail: serde_json::Value = r.try_get("detail")?;
    let bad = || ProducerError::Store(StoreError::Backend { message: format!("skip record of {event_id} unreadable: {detail}"), retryable: false });
    Ok(SkipRecord {
        event_id: event_id.to_string(),
        from_state: EventState::parse(detail["from_state"].as_str().ok_or_else(bad)?)?,
        operator: r.try_get("actor")?,
        reason: detail["reason"].as_str().ok_or_else(bad)?.to_owned(),
        at_ms: r.try_get("at_ms")?,
        claim_generation: detail["claim_generation"].as_u64().ok_or_else(bad)?,
        unknown_since_ms: detail["unknown_since_ms"].as_i64(),
    })
}

/// The simulator's store: the same decision, in [`MemoryStore::skip_event`].
#[async_trait]
impl SkipStore for MemoryStore {
    async fn skip_event(&self, event_id: &EventId, operator: &str, reason: &str) -> Result<SkipOutcome, ProducerError> {
        Ok(match MemoryStore::skip_event(self, event_id, operator, reason)? {
            Ok(record) => SkipOutcome::Skipped { record },
            Err(refusal) => SkipOutcome::Refused { reason: refusal.to_string() },
        })
    }

    async fn skip_records(&self, event_id: &EventId) -> Result<Vec<SkipRecord>, ProducerError> {
        Ok(MemoryStore::skip_records(self, event_id))
    }

    async fn set_poison_policy(&self, rule: &PoisonRule) -> Result<(), ProducerError> {
        Ok(MemoryStore::set_poison_policy(self, rule.clone())?)
    }

    async fn poison_policy(&self, event_type: &str) -> Result<Option<PoisonRule>, ProducerError> {
        Ok(MemoryStore::poison_policy(self, event_type))
    }

    async fn poisoned(&self, limit: usize) -> Result<Vec<(EventId, PoisonRule)>, ProducerError> {
        Ok(MemoryStore::poisoned(self, limit))
    }

    async fn release_poisoned(&self, limit: usize) -> Result<Vec<SkipRecord>, ProducerError> {
        Ok(MemoryStore::release_poisoned(self, limit)?)
    }
}
