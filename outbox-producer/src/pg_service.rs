//! The PostgreSQL side of the services' seam: [`ServiceStore`] for
//! [`PgStore`] (the dispatcher's and the reconciler's store in production)
//! and its commit listener (`LISTEN outbox_pending`). The seam itself, and
//! the simulator's implementation, are in `service_store.rs`.

use async_trait::async_trait;
use outbox_core::{AttemptRecord, ClaimToken, EventId, StoreError};

use crate::pg::PgStore;
use crate::service_store::{ClaimRound, CommitListener, DispatcherAlias, Notice, ServiceStore, NOTIFY_CHANNEL};

#[async_trait]
impl ServiceStore for PgStore {
    async fn release_poisoned(&self, limit: usize) -> Result<Vec<outbox_core::SkipRecord>, crate::ProducerError> {
        crate::skip::SkipStore::release_poisoned(self, limit).await
    }

    fn now_ms(&self) -> i64 {
        PgStore::now_ms(self)
    }

    fn scoped_to_cluster(self, cluster_id: &str) -> Self {
        PgStore::scoped_to_cluster(self, cluster_id)
    }

    async fn claim_next(&self, owner: &str, after: &[EventId], scan_due: bool, limit: usize, lease_ms: i64) -> Result<ClaimRound, StoreError> {
        PgStore::claim_next(self, owner, after, scan_due, limit, lease_ms).await
    }

    async fn renew_leases(&self, tokens: &[ClaimToken], lease_ms: i64) -> Result<Vec<Option<i64>>, StoreError> {
        PgStore::renew_leases(self, tokens, lease_ms).await
    }

    async fn registered_attempts(&self, tokens: &[ClaimToken]) -> Result<Vec<AttemptRecord>, StoreError> {
        PgStore::registered_attempts(self, tokens).await
    }

    async fn listen(&self) -> Result<Option<Box<dyn CommitListener>>, StoreError> {
        let mut listener = sqlx::postgres::PgListener::connect_with(self.pool()).await.map_err(crate::error::store_err)?;
        listener.listen(NOTIFY_CHANNEL).await.map_err(crate::error::store_err)?;
        Ok(Some(Box::new(PgCommitListener(listener))))
    }

    async fn oldest_pending_age_ms(&self) -> Result<Option<i64>, StoreError> {
        PgStore::oldest_pending_age_ms(self).await
    }

    async fn clock_skew_ms(&self) -> Result<i64, StoreError> {
        PgStore::clock_skew_ms(self).await
    }

    async fn rows_beyond_protocol(&self) -> Result<i64, StoreError> {
        PgStore::rows_beyond_protocol(self).await
    }

    fn max_protocol_version(&self) -> i32 {
        PgStore::max_protocol_version(self)
    }

    /// On the stream path (as the last claim read it).
    fn claims_may_overlap(&self) -> bool {
        self.stream_claims_may_overlap()
    }

    async fn current_alias(&self, alias: &str) -> Result<Option<DispatcherAlias>, crate::ProducerError> {
        crate::rollout::current_alias(self.pool(), alias).await
    }

    async fn record_findings(&self, findings: &[(&'static str, String, String)], now_ms: i64) -> Result<(), StoreError> {
        let mut tx = self.pool().begin().await.map_err(crate::error::store_err)?;
        crate::pg::record_findings(&mut tx, findings, now_ms).await?;
        tx.commit().await.map_err(crate::error::store_err)
    }

    async fn record_lookup(&self, owner: &str, event_id: &str, now_ms: i64, from_offset: i64, lookup: &str, decision: &str) -> Result<(), StoreError> {
        let cut = |s: &str| s.chars().take(2000).collect::<String>();
        sqlx::query("INSERT INTO outbox_unknown_lookups (event_id, owner, at_ms, from_offset, lookup, decision) VALUES ($1, $2, $3, $4, $5, $6)")
            .bind(event_id)
            .bind(owner)
            .bind(now_ms)
            .bind(from_offset)
            .bind(cut(lookup))
            .bind(cut(decision))
            .execute(self.pool())
            .await
            .map_err(crate::error::store_err)?;
        Ok(())
    }
}

/// `LISTEN outbox_pending` on a connection of its own. sqlx's listener
/// reconnects by itself and says so with `Ok(None)`.
struct PgCommitListener(sqlx::postgres::PgListener);

#[async_trait]
impl CommitListener for PgCommitListener {
    async fn next(&mut self) -> Result<Notice, StoreError> {
        match self.0.try_recv().await {
            Ok(Some(_)) => Ok(Notice::Committed),
            Ok(None) => Ok(Notice::Replaced),
            Err(e) => Err(crate::error::store_err(e)),
        }
    }
}

