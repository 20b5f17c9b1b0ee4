//! `outbox takeover`, `outbox alias` and `outbox shadow`: taking over from
//! a legacy publisher.

use outbox_producer::{rollout, PgStore};

use super::broker::{connect_kafka, kafka_flags};
use super::db::open;
use super::EXIT_FINDINGS;
use crate::cli::{AliasCommand, ShadowArgs, TakeoverCommand};
use crate::config::{self, FileConfig};

pub(super) async fn takeover_cmd(url: &str, c: &TakeoverCommand) -> anyhow::Result<u8> {
    let pool = open(url, 2).await?;
    if let TakeoverCommand::Set { event_types, percent_bp } = c {
        let types: Vec<&str> = event_types.iter().map(String::as_str).collect();
        rollout::set_takeover(&pool, &types, *percent_bp).await?;
    }
    match rollout::current_takeover(&pool).await? {
        None => println!("takeover: none (the outbox sends every event)"),
        Some(p) => println!(
            "takeover generation {}: the outbox sends {} of event types [{}]; everything else stays with the legacy publisher",
            p.generation,
            format_args!("{}.{:02}%", p.percent_bp / 100, p.percent_bp % 100),
            p.event_types.join(", ")
        ),
    }
    Ok(0)
}

pub(super) async fn alias_cmd(url: &str, c: &AliasCommand) -> anyhow::Result<u8> {
    let pool = open(url, 2).await?;
    if let AliasCommand::Switch { alias, implementation, protocol_version } = c {
        let before = rollout::current_alias(&pool, alias).await?;
        rollout::switch_alias(&pool, alias, implementation, *protocol_version).await?;
        println!("alias {alias}: {} -> {implementation}", before.map(|b| b.implementation).unwrap_or_else(|| "none".into()));
    }
    for a in rollout::aliases(&pool).await? {
        println!("{}\t{}\tprotocol {}\tswitched at {}", a.alias, a.implementation, a.protocol_version, crate::fmt::ts(a.switched_at_ms));
    }
    Ok(0)
}

pub(super) async fn shadow_cmd(url: &str, file: &FileConfig, a: &ShadowArgs) -> anyhow::Result<u8> {
    let kafka = config::kafka_config(&kafka_flags(&a.kafka), &file.kafka)?;
    let pool = open(url, 2).await?;
    let broker = connect_kafka(kafka).await?;
    let store = PgStore::new(pool.clone());
    let shadow = rollout::ShadowDispatcher::new(store.clone());
    let mut built = 0;
    loop {
        let n = shadow.shadow_once(1_000).await?;
        built += n;
        if n == 0 {
            break;
        }
    }
    let r = rollout::compare_shadow(&store, &*broker, a.grace_ms.unwrap_or(60_000), a.max_messages.unwrap_or(100_000)).await?;
    println!(
        "shadow: {built} built, {} messages read, {} matched; new mismatches: {} missing, {} extra, {} different_bytes, {} different_partition",
        r.scanned_messages, r.matched, r.missing, r.extra, r.different_bytes, r.different_partition
    );
    let open = rollout::open_shadow_mismatches(&pool).await?;
    for (id, kind, detail) in &open {
        println!("{kind}\t{id}\t{detail}");
    }
    Ok(if open.is_empty() { 0 } else { EXIT_FINDINGS })
}
