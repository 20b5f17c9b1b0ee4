//! Redriving a dead letter (PostgreSQL only).

use outbox_core::EventId;
use serde_json::Value;
use sqlx::Row as _;
use tracing::warn;

use super::{position, Fail, Prepared, Processor};
use crate::error::ConsumerError;
use crate::event::{headers_from_json, RawMessage};
use crate::metrics::Metrics;
use crate::outcome::{DeadLettered, Outcome};
use crate::store::PgConsumerStore;

impl Processor<PgConsumerStore> {
    /// Runs the handler once more for a dead-lettered event (after the cause
    /// was fixed). In one transaction the dead letter is removed and the event
    /// is applied with its receipt; if the handler fails again, nothing changes
    /// but the dead letter's `attempts` and `last_error`. Returns `None` when
    /// there is no such dead letter.
    pub async fn redrive_dead_letter(&self, event_id: &EventId) -> Result<Option<Outcome>, ConsumerError> {
        let mut tx = self.pool().begin().await?;
        let row = sqlx::query(
            r#"DELETE FROM outbox_consumer_dead_letters WHERE consumer_id = $1 AND event_id = $2
               RETURNING topic, partition, "offset", message_key, payload, headers"#,
        )
        .bind(&self.consumer_id)
        .bind(event_id.as_str())
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let headers_value: Value = row.try_get("headers")?;
        let msg = RawMessage {
            topic: row.try_get("topic")?,
            partition: row.try_get("partition")?,
            offset: row.try_get("offset")?,
            key: row.try_get("message_key")?,
            payload: Some(row.try_get("payload")?),
            headers: headers_from_json(&headers_value).ok_or_else(|| ConsumerError::CorruptRow(format!("dead letter headers of {event_id}")))?,
            non_utf8_header_names: Vec::new(),
            // A dead letter's log is not kept: the partition's reading stays
            // in the log it is in.
            log_id: None,
        };
        let p = self.prepare(&msg);
        if let Prepared::Bad { quarantined, .. } = &p {
            return Err(ConsumerError::CorruptRow(format!("dead letter {event_id} no longer verifies: {:?}", quarantined.reason)));
        }
        match self.decide_in(&mut tx, std::slice::from_ref(&p)).await? {
            Ok((mut outs, found)) => {
                tx.commit().await?;
                Metrics::add(&self.metrics.transactions, 1);
                self.report_gaps(&msg.topic, msg.partition, &found);
                self.metrics.count_outcomes(&outs);
                Ok(outs.pop())
            }
            Err(fail) => {
                let _ = tx.rollback().await;
                Metrics::add(&self.metrics.handler_failures, 1);
                let error = match fail {
                    Fail::Handler { error, .. } => error.to_string(),
                    Fail::Aborted => "the handler ignored a failed query and left the transaction aborted".to_owned(),
                };
                let error: String = error.chars().take(4000).collect();
                let attempts: i32 = sqlx::query_scalar(
                    "UPDATE outbox_consumer_dead_letters SET attempts = attempts + 1, last_error = $3,
                         requeue_requested_at_ms = NULL, requeue_requested_by = NULL
                     WHERE consumer_id = $1 AND event_id = $2 RETURNING attempts",
                )
                .bind(&self.consumer_id)
                .bind(event_id.as_str())
                .bind(&error)
                .fetch_one(self.pool())
                .await?;
                warn!(consumer = %self.consumer_id, event_id = %event_id, attempt = attempts, error = %error, "handler failed on redrive; the event stays dead-lettered");
                Ok(Some(Outcome::DeadLettered(DeadLettered {
                    event_id: event_id.clone(),
                    position: position(&msg),
                    attempts: u32::try_from(attempts).unwrap_or(0),
                    error,
                    redelivery: true,
                })))
            }
        }
    }
}
