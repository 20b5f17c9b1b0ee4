//! The user's side: what to do with one verified event, inside the receipt
//! transaction.

use async_trait::async_trait;
use serde_json::Value;
use sqlx::{Postgres, Transaction};

use crate::error::HandlerError;
use crate::event::ConsumedEvent;

/// Applies one verified event.
///
/// The handler runs on the consumer's transaction, the one that writes the
/// `(consumerId, eventId)` receipt: everything it writes through `tx` commits
/// together with the receipt, or not at all. What it returns is stored in the
/// receipt and handed back, unchanged, on every later duplicate.
///
/// Rules for implementors:
/// - Write state only through `tx`. Do not commit it (you cannot) and do not
///   swallow a failed query: return the error, the transaction is aborted.
/// - The handler can run more than once for one event when a transaction
///   rolls back (a failure of this or of a later event of the same batch, a
///   lost connection). Only its writes through `tx` are guaranteed once;
///   calls to other systems must carry [`ConsumedEvent::effect_key`] (or
///   [`ConsumedEvent::effect_key_for`]) so the other system can deduplicate.
/// - It is called for events of one partition in offset order, never
///   concurrently for one partition; different partitions run concurrently.
/// - The returned JSON must serialize to at most
///   [`MAX_RESULT_BYTES`](crate::MAX_RESULT_BYTES); larger results are a
///   permanent failure.
#[async_trait]
pub trait Handler: Send + Sync {
    /// Applies `event` within `tx`; the JSON result is recorded in the receipt.
    async fn handle(&self, tx: &mut Transaction<'_, Postgres>, event: &ConsumedEvent) -> Result<Value, HandlerError>;
}

#[async_trait]
impl<H: Handler + ?Sized> Handler for std::sync::Arc<H> {
    async fn handle(&self, tx: &mut Transaction<'_, Postgres>, event: &ConsumedEvent) -> Result<Value, HandlerError> {
        (**self).handle(tx, event).await
    }
}
