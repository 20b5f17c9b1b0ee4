//! `outbox purge`: retention.

use std::io::Write as _;

use outbox_producer::retention::{purge, RetentionPolicy};

use super::db::open;
use super::now_ms;
use crate::cli::PurgeArgs;
use crate::config::FileConfig;

pub(super) async fn purge_cmd(url: &str, file: &FileConfig, a: &PurgeArgs) -> anyhow::Result<u8> {
    let pool = open(url, 2).await?;
    let d = RetentionPolicy::default();
    let f = &file.retention;
    let policy = RetentionPolicy {
        replay_window_ms: a.replay_window_ms.or(f.replay_window_ms).unwrap_or(d.replay_window_ms),
        batch_size: a.batch_size.or(f.batch_size).unwrap_or(d.batch_size),
        max_batches: a.max_batches.or(f.max_batches).unwrap_or(d.max_batches),
    };
    let dry_run = !a.execute;
    if dry_run {
        println!("dry run: nothing is written (pass --execute to apply); replay window {}", crate::fmt::age(policy.replay_window_ms));
    } else {
        println!(
            "purging: replay window {}, batches of {} rows, at most {} batches per phase",
            crate::fmt::age(policy.replay_window_ms),
            policy.batch_size,
            policy.max_batches
        );
    }
    let started = std::time::Instant::now();
    let result = purge(&pool, now_ms(), &policy, dry_run, |r| {
        if !r.dry_run {
            println!("  batch {:>4}: {} retained, {} purged so far ({:.1} s)", r.batches, r.retained, r.purged, started.elapsed().as_secs_f64());
            let _ = std::io::stdout().flush();
        }
    })
    .await?;
    let verb = if dry_run { "would be" } else { "were" };
    println!("{} event(s) {verb} retained (PUBLISHED -> RETAINED)", result.retained);
    println!("{} event(s) {verb} purged (payload deleted; tombstone, digests and receipt kept)", result.purged);
    println!("{} event(s) past the replay window held back by a mandatory consumer's watermark", result.held_by_consumers);
    if result.held_on_replaced_log > 0 {
        println!(
            "  of which {} destination.v1 event(s) of a replaced log (their partition holds a receipt above position epoch 0): no watermark lets them go; confirm each mandatory consumer processed them (docs/OPERATIONS.md, a topic was recreated)",
            result.held_on_replaced_log
        );
    }
    if result.held_on_lost_position > 0 {
        println!(
            "{} event(s) held because the log lost their position (an open receipt_position_lost finding): their payload is the only copy left; publish them again or resolve the finding (docs/OPERATIONS.md, a topic was recreated)",
            result.held_on_lost_position
        );
    }
    Ok(0)
}
