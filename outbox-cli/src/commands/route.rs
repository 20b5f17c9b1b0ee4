//! `outbox route`: setting, showing and listing route policies.

use anyhow::bail;

use super::broker::{connect_kafka, kafka_flags};
use super::db::connect;
use crate::cli::KafkaArgs;
use crate::config::{self, FileConfig};

pub(super) async fn route_cmd(url: &str, file: &FileConfig, c: &crate::cli::RouteCommand) -> anyhow::Result<u8> {
    use crate::cli::RouteCommand as R;
    let pool = connect(url, 2).await?;
    let optional_kafka = |k: &KafkaArgs| {
        let flags = kafka_flags(k);
        if flags.bootstrap.is_none() && file.kafka.bootstrap.is_none() {
            Ok(None)
        } else {
            config::kafka_config(&flags, &file.kafka).map(Some)
        }
    };
    match c {
        R::Poison(a) => route_poison(&pool, a).await,
        R::Set(a) => {
            let broker = if a.no_check { None } else {
                match optional_kafka(&a.kafka)? {
                    Some(k) => Some(connect_kafka(k).await?),
                    None => bail!("checking the partition count needs a Kafka connection (--kafka-bootstrap or OUTBOX_KAFKA_BOOTSTRAP); or pass --no-check with --cluster-id"),
                }
            };
            crate::runbook::route_set(&pool, broker.as_deref(), a).await
        }
        R::Show { event_type, json, kafka } => {
            let broker = match optional_kafka(kafka)? {
                Some(k) => Some(connect_kafka(k).await?),
                None => None,
            };
            crate::runbook::route_show(&pool, broker.as_deref(), event_type, *json).await
        }
        R::List { json } => crate::runbook::route_list(&pool, *json).await,
    }
}

/// `outbox route poison`: sets a route's poison policy (with who and why),
/// or prints the one in force.
async fn route_poison(pool: &sqlx::PgPool, a: &crate::cli::RoutePoisonArgs) -> anyhow::Result<u8> {
    use outbox_producer::SkipStore;
    let store = outbox_producer::PgStore::new(pool.clone());
    if let Some(policy) = &a.policy {
        let policy = outbox_core::PoisonPolicy::parse(policy).map_err(|e| anyhow::anyhow!(e))?;
        let rule = outbox_core::PoisonRule {
            event_type: a.event_type.clone(),
            policy,
            actor: a.operator.clone().unwrap_or_default(),
            reason: a.reason.clone().unwrap_or_default(),
            at_ms: outbox_core::Clock::now_ms(&outbox_core::SystemClock),
        };
        store.set_poison_policy(&rule).await?;
    }
    let rule = store.poison_policy(&a.event_type).await?;
    if a.json {
        println!("{}", serde_json::to_string(&serde_json::json!({ "eventType": a.event_type, "policy": rule.as_ref().map_or("block", |r| r.policy.as_str()), "set": rule }))?);
        return Ok(0);
    }
    match rule {
        Some(r) => println!(
            "{}: poison policy {} (set by {} at {} ms: {}){}",
            a.event_type,
            r.policy,
            r.actor,
            r.at_ms,
            r.reason,
            if r.policy == outbox_core::PoisonPolicy::Skip { "; the reconciler skips its QUARANTINED events, recording this setting" } else { "; a QUARANTINED event holds its key until `outbox skip`" }
        ),
        None => println!("{}: poison policy block (never set); a QUARANTINED event holds its key until `outbox skip`", a.event_type),
    }
    Ok(0)
}
