//! What a running reconciler records and tells of each round: the observer, the round record and the store that keeps it.

use super::*;

/// Told of each round of a running reconciler as it ends
/// ([`Reconciler::run_observed`]): its number (from 0), what it did or why it
/// failed, and how long it took. Observing never changes what a round does.
#[async_trait::async_trait]
pub trait RoundObserver: Send + Sync {
    /// Round `round` ended.
    async fn round_done(&self, round: u64, result: Result<&(ResolveReport, CompareReport), &ProducerError>, took: std::time::Duration);
}

/// No observer.
#[async_trait::async_trait]
impl RoundObserver for () {
    async fn round_done(&self, _round: u64, _result: Result<&(ResolveReport, CompareReport), &ProducerError>, _took: std::time::Duration) {}
}

/// One reconciler round, as `outbox status` and the report show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundRecord<'a> {
    /// The reconciler.
    pub owner: &'a str,
    /// Its broker's cluster.
    pub cluster_id: &'a str,
    /// When the round ended, ms.
    pub at_ms: i64,
    /// The configured interval, ms.
    pub interval_ms: i64,
    /// The UNKNOWN SLO it judged with, ms.
    pub unknown_slo_ms: i64,
    /// UNKNOWN events it examined.
    pub examined: i32,
    /// Findings it saw.
    pub open_findings: i32,
}

/// What a reconciler round records besides its findings: a snapshot of the
/// state counts (the history `outbox status` draws) and the round itself
/// (when each reconciler last ran). Records, not decisions.
#[async_trait::async_trait]
pub trait RoundStore: Send + Sync {
    /// Snapshots the event counts per state at `now_ms`, dropping snapshots older than `keep_ms`.
    async fn record_state_snapshot(&self, now_ms: i64, keep_ms: i64) -> Result<(), ProducerError>;
    /// Records a finished round.
    async fn record_round(&self, round: &RoundRecord<'_>) -> Result<(), ProducerError>;
}

#[async_trait::async_trait]
impl RoundStore for PgStore {
    async fn record_state_snapshot(&self, now_ms: i64, keep_ms: i64) -> Result<(), ProducerError> {
        let mut tx = self.pool().begin().await?;
        sqlx::query("INSERT INTO outbox_state_snapshots (at_ms, state, count) SELECT $1, state, count(*) FROM outbox_events GROUP BY state ON CONFLICT DO NOTHING")
            .bind(now_ms)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM outbox_state_snapshots WHERE at_ms < $1").bind(now_ms - keep_ms).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn record_round(&self, r: &RoundRecord<'_>) -> Result<(), ProducerError> {
        sqlx::query(
            "INSERT INTO outbox_reconciler_rounds (owner, cluster_id, last_round_at_ms, interval_ms, unknown_slo_ms, examined, open_findings, rounds)
             VALUES ($1, $2, $3, $4, $5, $6, $7, 1)
             ON CONFLICT (owner) DO UPDATE SET cluster_id = EXCLUDED.cluster_id, last_round_at_ms = EXCLUDED.last_round_at_ms,
                 interval_ms = EXCLUDED.interval_ms, unknown_slo_ms = EXCLUDED.unknown_slo_ms, examined = EXCLUDED.examined,
                 open_findings = EXCLUDED.open_findings, rounds = outbox_reconciler_rounds.rounds + 1",
        )
        .bind(r.owner)
        .bind(r.cluster_id)
        .bind(r.at_ms)
        .bind(r.interval_ms)
        .bind(r.unknown_slo_ms)
        .bind(r.examined)
        .bind(r.open_findings)
        .execute(self.pool())
        .await?;
        Ok(())
    }
}

/// The in-memory store keeps no history of states or rounds.
#[async_trait::async_trait]
impl RoundStore for outbox_memory::MemoryStore {
    async fn record_state_snapshot(&self, _now_ms: i64, _keep_ms: i64) -> Result<(), ProducerError> {
        Ok(())
    }

    async fn record_round(&self, _round: &RoundRecord<'_>) -> Result<(), ProducerError> {
        Ok(())
    }
}
