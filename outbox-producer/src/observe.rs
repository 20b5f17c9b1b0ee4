//! The dispatcher's duration histograms (Prometheus, base unit seconds).
//! Created with the dispatcher, observed on its paths, and registered into
//! a [`prometheus::Registry`] by whoever serves `/metrics`
//! ([`DispatchHistograms::register`]; `outbox dispatch` does).

use std::time::Duration;

use outbox_core::labels::BoundedLabels;
use prometheus::{Histogram, HistogramOpts, HistogramVec, Registry};

/// Buckets of commit -> PUBLISHED, seconds: 5 ms to 1 h.
pub const LATENCY_BUCKETS_SECONDS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0];
/// Buckets of one database statement or transaction, or one send, seconds: 0.5 ms to 60 s.
pub const DURATION_BUCKETS_SECONDS: &[f64] = &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

fn histogram(name: &str, help: &str, buckets: &[f64]) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec())).expect("valid histogram")
}

fn histogram_vec(name: &str, help: &str, buckets: &[f64], labels: &[&str]) -> HistogramVec {
    HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets.to_vec()), labels).expect("valid histogram")
}

/// The dispatcher's histograms. Labels are bounded: `topic` and
/// `event_type` take at most [`outbox_core::labels::DEFAULT_MAX_LABEL_SETS`]
/// combinations per process (then `_other`).
#[derive(Clone)]
pub struct DispatchHistograms {
    /// Commit -> PUBLISHED, per topic and event type: from the eventId's
    /// time (taken in the emitting transaction) to the receipt transaction
    /// that published the event.
    pub commit_to_published: HistogramVec,
    /// One claim (its statements in one transaction).
    pub claim: Histogram,
    /// One send, from handing the message to the broker client to its
    /// answer, per topic and event type.
    pub send: HistogramVec,
    /// The receipt transaction of one batch (`accept_dispatch_receipts`),
    /// including retries after retryable database errors.
    pub receipt_transaction: Histogram,
    /// One batch, claim to the last recorded answer.
    pub batch: Histogram,
    labels: std::sync::Arc<BoundedLabels>,
}

impl std::fmt::Debug for DispatchHistograms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DispatchHistograms").finish_non_exhaustive()
    }
}

impl Default for DispatchHistograms {
    fn default() -> Self {
        DispatchHistograms {
            commit_to_published: histogram_vec(
                "outbox_commit_to_published_seconds",
                "Time from an event's commit (its eventId's time, taken in the emitting transaction) to the receipt transaction that published it.",
                LATENCY_BUCKETS_SECONDS,
                &["topic", "event_type"],
            ),
            claim: histogram("outbox_dispatch_claim_duration_seconds", "Duration of one claim transaction.", DURATION_BUCKETS_SECONDS),
            send: histogram_vec(
                "outbox_dispatch_send_duration_seconds",
                "Duration of one send, from handing the message to the Kafka client to the broker's answer.",
                DURATION_BUCKETS_SECONDS,
                &["topic", "event_type"],
            ),
            receipt_transaction: histogram(
                "outbox_dispatch_receipt_transaction_duration_seconds",
                "Duration of one batch's receipt transaction (acceptDispatchReceipt), retries included.",
                DURATION_BUCKETS_SECONDS,
            ),
            batch: histogram("outbox_dispatch_batch_duration_seconds", "Duration of one batch, claim to the last recorded answer.", DURATION_BUCKETS_SECONDS),
            labels: Default::default(),
        }
    }
}

impl DispatchHistograms {
    /// Registers every histogram into `registry`.
    pub fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.commit_to_published.clone()))?;
        registry.register(Box::new(self.claim.clone()))?;
        registry.register(Box::new(self.send.clone()))?;
        registry.register(Box::new(self.receipt_transaction.clone()))?;
        registry.register(Box::new(self.batch.clone()))?;
        Ok(())
    }

    /// Observes a commit -> PUBLISHED latency, ms (negative: clocks apart, counted as 0).
    pub fn published(&self, topic: &str, event_type: &str, latency_ms: i64) {
        let l = self.labels.admit(&[topic, event_type]);
        self.commit_to_published.with_label_values(&[l[0].as_str(), l[1].as_str()]).observe(latency_ms.max(0) as f64 / 1000.0);
    }

    /// Observes one send's duration.
    pub fn sent(&self, topic: &str, event_type: &str, took: Duration) {
        let l = self.labels.admit(&[topic, event_type]);
        self.send.with_label_values(&[l[0].as_str(), l[1].as_str()]).observe(took.as_secs_f64());
    }
}
