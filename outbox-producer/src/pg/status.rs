//! What the store tells about itself: the database's clock and the skew
//! of the store's, the backlog's age, counts per state.

use outbox_core::{EventState, StoreError};
use sqlx::{PgPool, Row};

use super::PgStore;
use crate::error::store_err;

impl PgStore {
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

    /// Counts of events per state, in the exception lane and on the stream
    /// (`outbox_state_counts`, schema section 17; every row is read).
    pub async fn state_counts(&self) -> Result<Vec<(EventState, i64)>, StoreError> {
        let rows = sqlx::query("SELECT state, n FROM outbox_state_counts() ORDER BY state")
            .fetch_all(&self.pool)
            .await
            .map_err(store_err)?;
        rows.iter()
            .map(|r| Ok((EventState::parse(r.try_get("state").map_err(store_err)?)?, r.try_get("n").map_err(store_err)?)))
            .collect()
    }
}

/// The database's clock, ms since the epoch.
pub async fn db_now_ms(pool: &PgPool) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint").fetch_one(pool).await
}

/// When the oldest PENDING event the outbox sends was created, ms, in the
/// exception lane or on the stream (`outbox_oldest_pending_ms`, schema
/// section 17): in the lane the earliest inserted (legacy events stay
/// PENDING there: they are the legacy publisher's to send), on the stream
/// per key bucket the events not handed out yet. Index reads only: the
/// sweeper and every report ask.
pub async fn oldest_pending_created_ms(pool: &PgPool) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar("SELECT outbox_oldest_pending_ms()").fetch_one(pool).await
}
