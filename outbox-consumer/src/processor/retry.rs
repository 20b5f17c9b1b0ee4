//! Retries: a failing handler decided alone with backoff, then a dead
//! letter; backoff after database errors.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tracing::warn;

use super::decide::Tally;
use super::{position, Fail, Prepared, Processor};
use crate::error::{ConsumerError, HandlerError};
use crate::event::{ConsumedEvent, RawMessage};
use crate::metrics::Metrics;
use crate::outcome::{DeadLettered, Outcome};
use crate::store::{ConsumerStore, DeadLetterRow};

impl<S: ConsumerStore> Processor<S> {
    /// After a database error: the error back when it is not retryable or
    /// the retries are used up; otherwise counts the retry, backs off and
    /// answers whether to go on (`false`: stopped while waiting).
    pub(super) async fn back_off_after(&self, e: ConsumerError, failures: &mut u32, stop: &AtomicBool) -> Result<bool, ConsumerError> {
        *failures += 1;
        if !e.is_retryable() || *failures >= self.retry.db_max_attempts {
            return Err(e);
        }
        Metrics::add(&self.metrics.db_retries, 1);
        warn!(error = %e, attempt = *failures, "retrying after a database error");
        Ok(self.sleep_unless_stopped(self.retry.backoff(*failures), stop).await)
    }

    /// Sleeps, waking early (returning `false`) when `stop` is set.
    async fn sleep_unless_stopped(&self, d: Duration, stop: &AtomicBool) -> bool {
        let step = Duration::from_millis(50);
        let mut left = d;
        while !left.is_zero() {
            if stop.load(Ordering::Acquire) {
                return false;
            }
            let s = left.min(step);
            tokio::time::sleep(s).await;
            left = left.saturating_sub(s);
        }
        !stop.load(Ordering::Acquire)
    }

    /// Decides one message in its own transactions: retries the handler with
    /// backoff, then dead-letters. `attempts` handler runs already failed
    /// (`last` is the latest error).
    pub(super) async fn decide_alone(&self, p: &Prepared<'_>, mut attempts: u32, mut last: Option<HandlerError>, stop: &AtomicBool) -> Result<Outcome, ConsumerError> {
        let mut db_failures = 0u32;
        loop {
            if let Some(error) = &last {
                if !error.is_retryable() || attempts >= self.retry.max_attempts {
                    return self.dead_letter(p, attempts.max(1), error, stop).await;
                }
                if !self.sleep_unless_stopped(self.retry.backoff(attempts), stop).await {
                    return Err(ConsumerError::Stopped);
                }
            }
            match self.try_slice(std::slice::from_ref(p)).await {
                Ok(Ok(mut outs)) => return outs.pop().ok_or(ConsumerError::Stopped),
                Ok(Err(fail)) => {
                    attempts += 1;
                    Metrics::add(&self.metrics.handler_failures, 1);
                    let error = match fail {
                        Fail::Handler { error, .. } => error,
                        Fail::Aborted => HandlerError::Transient("the handler ignored a failed query and left the transaction aborted".into()),
                    };
                    warn!(consumer = %self.consumer_id, event_id = %p.event_id().unwrap_or("-"), attempt = attempts, topic = %p.msg().topic,
                        partition = p.msg().partition, offset = p.msg().offset, %error, "handler failed");
                    last = Some(error);
                }
                Err(e) => {
                    if !self.back_off_after(e, &mut db_failures, stop).await? {
                        return Err(ConsumerError::Stopped);
                    }
                }
            }
        }
    }

    /// Writes the dead letter of a verified event whose handler kept failing.
    async fn dead_letter(&self, p: &Prepared<'_>, attempts: u32, error: &HandlerError, stop: &AtomicBool) -> Result<Outcome, ConsumerError> {
        let Prepared::Event { msg, event } = p else {
            return Err(ConsumerError::InvalidBatch("only verified events are dead-lettered".into()));
        };
        let mut db_failures = 0u32;
        loop {
            match self.try_dead_letter(msg, event, attempts, error).await {
                Ok(o) => {
                    self.metrics.count_outcomes(std::slice::from_ref(&o));
                    return Ok(o);
                }
                Err(e) => {
                    if !self.back_off_after(e, &mut db_failures, stop).await? {
                        return Err(ConsumerError::Stopped);
                    }
                }
            }
        }
    }

    async fn try_dead_letter(&self, msg: &RawMessage, event: &ConsumedEvent, attempts: u32, error: &HandlerError) -> Result<Outcome, ConsumerError> {
        let mut tx = self.store.begin().await?;
        // Another instance may have applied it in the meantime.
        let mut found = self.store.receipts(&mut tx, &self.consumer_id, &[event.event_id.as_str()]).await?;
        if let Some(original) = found.remove(event.event_id.as_str()) {
            let tally = Tally::one(event.topic_id.as_deref(), msg.offset, |c| {
                c.duplicates = 1;
                c.decided(msg.offset, event.event_id.as_str());
            });
            let found = self.advance_watermarks(&mut tx, msg, &tally).await?;
            self.store.commit(tx).await?;
            Metrics::add(&self.metrics.transactions, 1);
            self.report_gaps(&msg.topic, msg.partition, &found);
            return Ok(Outcome::Duplicate { original, delivery: position(msg) });
        }
        let text: String = error.to_string().chars().take(4000).collect();
        let inserted = self.store.insert_dead_letter(&mut tx, &self.consumer_id, &DeadLetterRow { msg, event, attempts, error: &text }).await?;
        let redelivery = !inserted;
        let tally = Tally::one(event.topic_id.as_deref(), msg.offset, |c| {
            if redelivery {
                c.duplicates = 1
            } else {
                c.dead_lettered = 1
            }
            c.decided(msg.offset, event.event_id.as_str());
        });
        let found = self.advance_watermarks(&mut tx, msg, &tally).await?;
        self.store.commit(tx).await?;
        Metrics::add(&self.metrics.transactions, 1);
        self.report_gaps(&msg.topic, msg.partition, &found);
        warn!(event_id = %event.event_id, offset = msg.offset, attempts, error = %text, "event dead-lettered");
        Ok(Outcome::DeadLettered(DeadLettered { event_id: event.event_id.clone(), position: position(msg), attempts, error: text, redelivery }))
    }
}
