//! Counters, readable at any time without locks.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::outcome::Outcome;

/// Counters of one consumer instance (since it started). Outcome counters
/// move only after the decision committed.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Messages read from the broker.
    pub received: AtomicU64,
    /// Events applied (handler ran, receipt written).
    pub applied: AtomicU64,
    /// Redeliveries answered with the original receipt (or dead letter).
    pub duplicates: AtomicU64,
    /// Messages quarantined.
    pub quarantined: AtomicU64,
    /// Events dead-lettered.
    pub dead_lettered: AtomicU64,
    /// Handler runs that failed (each retry counts).
    pub handler_failures: AtomicU64,
    /// Database transactions committed.
    pub transactions: AtomicU64,
    /// Database work retried after a retryable error.
    pub db_retries: AtomicU64,
    /// Offset commits the broker refused or that could not be stored.
    pub offset_commit_failures: AtomicU64,
    /// Times a partition was paused because its buffer was full.
    pub partitions_paused: AtomicU64,
    /// Watermark records the broker acknowledged on the watermark topic.
    pub watermark_records_published: AtomicU64,
    /// Watermark publications that failed (a record refused or unanswered,
    /// or the rows unreadable); each is retried at the next interval.
    pub watermark_publish_failures: AtomicU64,
}

/// A copy of [`Metrics`] at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MetricsSnapshot {
    /// See [`Metrics::received`].
    pub received: u64,
    /// See [`Metrics::applied`].
    pub applied: u64,
    /// See [`Metrics::duplicates`].
    pub duplicates: u64,
    /// See [`Metrics::quarantined`].
    pub quarantined: u64,
    /// See [`Metrics::dead_lettered`].
    pub dead_lettered: u64,
    /// See [`Metrics::handler_failures`].
    pub handler_failures: u64,
    /// See [`Metrics::transactions`].
    pub transactions: u64,
    /// See [`Metrics::db_retries`].
    pub db_retries: u64,
    /// See [`Metrics::offset_commit_failures`].
    pub offset_commit_failures: u64,
    /// See [`Metrics::partitions_paused`].
    pub partitions_paused: u64,
    /// See [`Metrics::watermark_records_published`].
    pub watermark_records_published: u64,
    /// See [`Metrics::watermark_publish_failures`].
    pub watermark_publish_failures: u64,
}

impl MetricsSnapshot {
    /// Messages decided: applied + duplicates + quarantined + dead-lettered.
    pub fn decided(&self) -> u64 {
        self.applied + self.duplicates + self.quarantined + self.dead_lettered
    }
}

impl Metrics {
    /// Reads every counter.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        MetricsSnapshot {
            received: r(&self.received),
            applied: r(&self.applied),
            duplicates: r(&self.duplicates),
            quarantined: r(&self.quarantined),
            dead_lettered: r(&self.dead_lettered),
            handler_failures: r(&self.handler_failures),
            transactions: r(&self.transactions),
            db_retries: r(&self.db_retries),
            offset_commit_failures: r(&self.offset_commit_failures),
            partitions_paused: r(&self.partitions_paused),
            watermark_records_published: r(&self.watermark_records_published),
            watermark_publish_failures: r(&self.watermark_publish_failures),
        }
    }

    pub(crate) fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn count_outcomes(&self, outcomes: &[Outcome]) {
        for o in outcomes {
            let c = match o {
                Outcome::Applied { .. } => &self.applied,
                Outcome::Duplicate { .. } => &self.duplicates,
                Outcome::Quarantined(_) => &self.quarantined,
                Outcome::DeadLettered(d) if d.redelivery => &self.duplicates,
                Outcome::DeadLettered(_) => &self.dead_lettered,
            };
            Self::add(c, 1);
        }
    }
}
