//! The store's settings: `outbox dispatch-path`, which path events emitted
//! from now on take (`outbox_producer::set_dispatch_path`), and `outbox
//! aggregate-heads`, which emits write their aggregates' head rows
//! (`outbox_producer::set_aggregate_heads`).

use outbox_producer::{AggregateHeads, DispatchPath};

use super::db::open;
use crate::cli::{AggregateHeadsArgs, DispatchPathArgs, HeadsArg, PathArg};

pub(super) async fn dispatch_path_cmd(url: &str, a: &DispatchPathArgs) -> anyhow::Result<u8> {
    let pool = open(url, 2).await?;
    let before = outbox_producer::dispatch_path(&pool).await?;
    let Some(set) = a.set else {
        println!("dispatch path: {}", before.as_str());
        return Ok(0);
    };
    let path = match set {
        PathArg::Chains => DispatchPath::Chains,
        PathArg::Stream => DispatchPath::Stream,
    };
    outbox_producer::set_dispatch_path(&pool, path).await?;
    tracing::info!(from = before.as_str(), to = path.as_str(), "dispatch path set");
    if before == path {
        println!("dispatch path: {} (unchanged)", path.as_str());
    } else {
        println!(
            "dispatch path: {} -> {}; events emitted from now on take it, events already emitted drain on the path they took",
            before.as_str(),
            path.as_str()
        );
    }
    Ok(0)
}

pub(super) async fn aggregate_heads_cmd(url: &str, a: &AggregateHeadsArgs) -> anyhow::Result<u8> {
    let pool = open(url, 2).await?;
    let before = outbox_producer::aggregate_heads(&pool).await?;
    let Some(set) = a.set else {
        println!("aggregate heads: {}", before.as_str());
        return Ok(0);
    };
    let heads = match set {
        HeadsArg::SnapshotIsolation => AggregateHeads::SnapshotIsolation,
        HeadsArg::Always => AggregateHeads::Always,
    };
    outbox_producer::set_aggregate_heads(&pool, heads).await?;
    tracing::info!(from = before.as_str(), to = heads.as_str(), "aggregate heads set");
    if before == heads {
        println!("aggregate heads: {} (unchanged)", heads.as_str());
    } else {
        println!("aggregate heads: {} -> {}; emits that start from now on follow it", before.as_str(), heads.as_str());
    }
    Ok(0)
}
