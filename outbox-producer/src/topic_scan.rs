//! What the bypass check (reconciler) and the shadow comparison (rollout)
//! share: the topics routed to a cluster, and a per-partition read cursor
//! that only moves forward.

use sqlx::{PgPool, Postgres, Transaction};

use crate::error::ProducerError;

/// A table of read cursors, one row per (cluster, topic, partition).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cursors {
    /// `outbox_scan_cursors`: the reconciler's bypass check.
    Bypass,
    /// `outbox_shadow_cursors`: the rollout's shadow comparison.
    Shadow,
}

impl Cursors {
    fn table(self) -> &'static str {
        match self {
            Cursors::Bypass => "outbox_scan_cursors",
            Cursors::Shadow => "outbox_shadow_cursors",
        }
    }

    /// The next offset to read (0 for a partition never read).
    pub(crate) async fn read(self, pool: &PgPool, cluster_id: &str, topic: &str, partition: i32) -> Result<i64, ProducerError> {
        let next: Option<i64> = sqlx::query_scalar(&format!("SELECT next_offset FROM {} WHERE cluster_id = $1 AND topic = $2 AND partition = $3", self.table()))
            .bind(cluster_id)
            .bind(topic)
            .bind(partition)
            .fetch_optional(pool)
            .await?;
        Ok(next.unwrap_or(0))
    }

    /// Moves the cursor to `next_offset`, never backwards.
    pub(crate) async fn advance(self, tx: &mut Transaction<'_, Postgres>, cluster_id: &str, topic: &str, partition: i32, next_offset: i64) -> Result<(), ProducerError> {
        let t = self.table();
        sqlx::query(&format!(
            "INSERT INTO {t} (cluster_id, topic, partition, next_offset) VALUES ($1, $2, $3, $4)
             ON CONFLICT (cluster_id, topic, partition) DO UPDATE SET next_offset = greatest({t}.next_offset, EXCLUDED.next_offset)"
        ))
        .bind(cluster_id)
        .bind(topic)
        .bind(partition)
        .bind(next_offset)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    /// Moves the cursor back to the start of the log: only when the log's
    /// end is below it, which a log that was kept never is (the topic was
    /// recreated, the broker came back empty): the new log is read from its
    /// start.
    pub(crate) async fn restart(self, tx: &mut Transaction<'_, Postgres>, cluster_id: &str, topic: &str, partition: i32) -> Result<(), ProducerError> {
        sqlx::query(&format!("UPDATE {} SET next_offset = 0 WHERE cluster_id = $1 AND topic = $2 AND partition = $3", self.table()))
            .bind(cluster_id)
            .bind(topic)
            .bind(partition)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

/// Every topic the current route policies send to `cluster_id`, with its partition count.
pub(crate) async fn routed_topics(pool: &PgPool, cluster_id: &str) -> Result<Vec<(String, i32)>, ProducerError> {
    Ok(sqlx::query_as("SELECT DISTINCT ON (topic) topic, partitions FROM outbox_route_policies WHERE cluster_id = $1 ORDER BY topic, generation DESC")
        .bind(cluster_id)
        .fetch_all(pool)
        .await?)
}
