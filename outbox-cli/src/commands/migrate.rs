//! `outbox migrate`: the producer and consumer schemas.

use anyhow::Context;
use sqlx::PgPool;

use super::db::connect;
use crate::cli::{MigrateArgs, Side};

pub(super) async fn migrate(url: &str, a: &MigrateArgs) -> anyhow::Result<u8> {
    let pool = connect(url, 2).await?;
    let applied = |pool: PgPool| async move {
        let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL").fetch_one(&pool).await?;
        if !exists {
            return Ok::<Vec<i64>, sqlx::Error>(Vec::new());
        }
        sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success ORDER BY version").fetch_all(&pool).await
    };
    let before = applied(pool.clone()).await?;
    if a.only != Some(Side::Consumer) {
        outbox_producer::migrate_with_source(&pool, a.source.as_deref()).await.context("producer migrations")?;
    }
    if a.only != Some(Side::Producer) {
        outbox_consumer::migrate(&pool).await.context("consumer migrations")?;
    }
    let after = applied(pool.clone()).await?;
    let sides = [(Side::Producer, "producer", &outbox_producer::MIGRATOR), (Side::Consumer, "consumer", &outbox_consumer::MIGRATOR)];
    for (side, name, migrator) in sides {
        if a.only.is_some_and(|only| only != side) {
            continue;
        }
        let new: Vec<String> =
            migrator.iter().filter(|m| after.contains(&m.version) && !before.contains(&m.version)).map(|m| format!("{} {}", m.version, m.description)).collect();
        if new.is_empty() {
            println!("{name} schema: up to date");
        } else {
            println!("{name} schema: applied {} migration(s): {}", new.len(), new.join(", "));
        }
    }
    outbox_producer::check_protocol(&pool).await.ok();
    Ok(0)
}
