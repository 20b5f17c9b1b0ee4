//! The runbook's steps on dead letters, watermark writers, gaps, findings
//! and UNKNOWN events: which database, then [`crate::runbook`].

use super::db::connect;

/// `outbox dead-letters`: on the consumer database when given, else the outbox database.
pub(super) async fn dead_letters(url: &dyn Fn() -> anyhow::Result<String>, c: &crate::cli::DeadLettersCommand) -> anyhow::Result<u8> {
    use crate::cli::DeadLettersCommand as D;
    let db = |over: &Option<String>| over.clone().map(Ok).unwrap_or_else(url);
    match c {
        D::List { consumer, limit, json, consumer_database_url } => {
            let pool = connect(&db(consumer_database_url)?, 2).await?;
            crate::runbook::dead_letters_list(&pool, consumer.as_deref(), *limit, *json).await
        }
        D::Show { event_id, json, consumer_database_url } => {
            let pool = connect(&db(consumer_database_url)?, 2).await?;
            crate::runbook::dead_letters_show(&pool, event_id, *json).await
        }
        D::Requeue { event_id, consumer, operator, consumer_database_url } => {
            let pool = connect(&db(consumer_database_url)?, 2).await?;
            crate::runbook::dead_letters_requeue(&pool, event_id, consumer, operator).await
        }
    }
}

/// `outbox watermarks`.
pub(super) async fn watermarks(url: &str, c: &crate::cli::WatermarksCommand) -> anyhow::Result<u8> {
    let crate::cli::WatermarksCommand::Repin { consumer, operator } = c;
    let pool = connect(url, 2).await?;
    let forgotten = outbox_producer::watermark_topic::repin(&pool, consumer).await?;
    if forgotten.is_empty() {
        println!("no database pinned for {consumer}: its next record's database is taken");
    }
    for (cluster, decider) in &forgotten {
        tracing::warn!(consumer = %consumer, cluster = %cluster, old = %decider, operator = %operator, "watermark writer forgotten");
        println!("{consumer} on {cluster}: {decider} forgotten by {operator}; the next record's database is pinned");
    }
    Ok(0)
}

/// `outbox gaps`: on the consumer database when given, else the outbox database.
pub(super) async fn gaps(url: &dyn Fn() -> anyhow::Result<String>, c: &crate::cli::GapsCommand) -> anyhow::Result<u8> {
    use crate::cli::GapsCommand as G;
    let db = |over: &Option<String>| over.clone().map(Ok).unwrap_or_else(url);
    match c {
        G::List { consumer, all, limit, json, consumer_database_url } => {
            let pool = connect(&db(consumer_database_url)?, 2).await?;
            crate::runbook::gaps_list(&pool, consumer.as_deref(), *all, *limit, *json).await
        }
        G::Accept { consumer, cluster, topic, partition, detected_from, operator, reason, consumer_database_url } => {
            let pool = connect(&db(consumer_database_url)?, 2).await?;
            crate::runbook::gaps_accept(&pool, consumer, cluster, topic, *partition, *detected_from, operator, reason).await
        }
    }
}

/// `outbox findings`.
pub(super) async fn findings(url: &str, c: &crate::cli::FindingsCommand) -> anyhow::Result<u8> {
    use crate::cli::FindingsCommand as F;
    let pool = connect(url, 2).await?;
    match c {
        F::List { all, kind, limit, json } => crate::runbook::findings_list(&pool, *all, kind.as_deref(), *limit, *json).await,
        F::Ack { id, operator, note } => crate::runbook::findings_ack(&pool, *id, operator, note.as_deref()).await,
    }
}

/// `outbox unknown`.
pub(super) async fn unknown(url: &str, c: &crate::cli::UnknownCommand) -> anyhow::Result<u8> {
    use crate::cli::UnknownCommand as U;
    let pool = connect(url, 2).await?;
    match c {
        U::List { limit, json } => crate::runbook::unknown_list(&pool, *limit, *json).await,
        U::Show { event_id, lookups, json } => crate::runbook::unknown_show(&pool, event_id, *lookups, *json).await,
    }
}
