//! Fenced writes: a single-row state change guarded by the claim, and,
//! when it touched nothing, whether the writer was fenced (audited) or
//! there was nothing to do.

use outbox_core::claim::{check_fence, Claim, FencedWrite};
use outbox_core::{ClaimToken, EventState, FenceOutcome, StoreError};
use sqlx::{Postgres, Row, Transaction};

use super::rows::parse_id;
use super::PgStore;
use crate::error::store_err;

type PgQuery<'q> = sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments>;

impl PgStore {
    pub(super) async fn audit(tx: &mut Transaction<'_, Postgres>, event_id: &str, actor: &str, action: &str, detail: serde_json::Value, now: i64) -> Result<(), StoreError> {
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
    pub(super) async fn claim_of(tx: &mut Transaction<'_, Postgres>, event_id: &str) -> Result<Option<(Claim, EventState)>, StoreError> {
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

    /// Applies a fenced single-row state change; the UPDATE must carry the
    /// fence (`claim_generation = $gen AND claim_owner = $owner`) itself.
    pub(super) async fn fenced_update<'q>(&self, token: &'q ClaimToken, action: &str, sql: &'q str, extra: impl FnOnce(PgQuery<'q>) -> PgQuery<'q> + Send) -> Result<FenceOutcome, StoreError> {
        let now = self.now_ms();
        let mut tx = self.begin().await?;
        let q = sqlx::query(sql).bind(token.event_id.as_str()).bind(token.claim_generation as i64).bind(token.owner.as_str()).bind(now);
        let n = extra(q).execute(&mut *tx).await.map_err(store_err)?.rows_affected();
        let out = if n > 0 { FenceOutcome::Applied } else { self.explain_refusal(&mut tx, token, action, now).await? };
        tx.commit().await.map_err(store_err)?;
        Ok(out)
    }
}
