//! `outbox skip`: closing a key's blocked head (a QUARANTINED event, or a
//! DISPATCH_UNKNOWN one nothing can prove) as SKIPPED, so that the later
//! events of its key go on (`outbox_producer::skip`).

use anyhow::Context;
use outbox_core::EventId;
use outbox_producer::{PgStore, SkipOutcome, SkipStore};

use super::db::open;
use super::EXIT_REFUSED;
use crate::cli::SkipArgs;

pub(super) async fn skip_cmd(url: &str, a: &SkipArgs) -> anyhow::Result<u8> {
    let id: EventId = a.event_id.parse().with_context(|| format!("{:?} is not an eventId", a.event_id))?;
    let pool = open(url, 2).await?;
    let store = PgStore::new(pool.clone());
    let outcome = store.skip_event(&id, &a.operator, &a.reason).await.with_context(|| format!("skip {id}"))?;
    if a.json {
        println!("{}", serde_json::to_string(&outcome)?);
    }
    match outcome {
        SkipOutcome::Skipped { record } => {
            if !a.json {
                println!(
                    "skipped: {id} {} -> SKIPPED by {} ({}); recorded in outbox_audit (action skip). The later events of its key are claimable; consumers see a gap in the key's sequence.",
                    record.from_state, record.operator, record.reason
                );
            }
            Ok(0)
        }
        SkipOutcome::Refused { reason } => {
            if !a.json {
                println!("refused: {reason}; nothing changed");
            }
            Ok(EXIT_REFUSED)
        }
    }
}
