//! Counters, readable at any time without locks, and the consumer's
//! Prometheus metrics: [`Metrics::register`] puts them into a
//! [`prometheus::Registry`] the service serves on its own `/metrics`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox_core::labels::BoundedLabels;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{HistogramOpts, HistogramVec, IntCounter, Opts, Registry};

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
    /// Handler duration and commit -> consumed histograms.
    pub histograms: ConsumerHistograms,
    /// Watermark records the broker acknowledged on the watermark topic.
    pub watermark_records_published: AtomicU64,
    /// Watermark publications that failed (a record refused or unanswered,
    /// or the rows unreadable); each is retried at the next interval.
    pub watermark_publish_failures: AtomicU64,
    /// Gaps found: ranges of a partition this consumer skipped without
    /// deciding them (module [`gap`](crate::gap)).
    pub offset_gaps: AtomicU64,
    /// Offsets in the gaps found, when found.
    pub offset_gap_offsets: AtomicU64,
}

/// Buckets of commit -> consumed, seconds: 5 ms to 1 h.
pub const LATENCY_BUCKETS_SECONDS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0];
/// Buckets of one handler run, seconds: 0.5 ms to 60 s.
pub const HANDLER_BUCKETS_SECONDS: &[f64] = &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// The consumer's histograms, labelled `consumer_id`, `topic`, `event_type`
/// (at most [`outbox_core::labels::DEFAULT_MAX_LABEL_SETS`] combinations,
/// then `_other`: the event type comes from a message header). One set per
/// process, shared by every [`Metrics`] (`Default` hands out the same
/// histograms), so several consumers of one service register into one
/// registry and are told apart by `consumer_id`.
#[derive(Clone)]
pub struct ConsumerHistograms {
    /// One handler run (applied or failed), seconds.
    pub handler: HistogramVec,
    /// From an applied event's commit (its eventId's time, taken in the
    /// emitting transaction) to the commit of the transaction that applied it.
    pub commit_to_consumed: HistogramVec,
    labels: Arc<BoundedLabels>,
}

impl std::fmt::Debug for ConsumerHistograms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsumerHistograms").finish_non_exhaustive()
    }
}

static PROCESS_HISTOGRAMS: std::sync::LazyLock<ConsumerHistograms> = std::sync::LazyLock::new(ConsumerHistograms::new);

impl Default for ConsumerHistograms {
    fn default() -> Self {
        PROCESS_HISTOGRAMS.clone()
    }
}

impl ConsumerHistograms {
    fn new() -> Self {
        let vec = |name: &str, help: &str, buckets: &[f64]| {
            HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets.to_vec()), &["consumer_id", "topic", "event_type"]).expect("valid histogram")
        };
        ConsumerHistograms {
            handler: vec("outbox_consumer_handler_duration_seconds", "Duration of one handler run (applied or failed).", HANDLER_BUCKETS_SECONDS),
            commit_to_consumed: vec(
                "outbox_consumer_commit_to_consumed_seconds",
                "Time from an event's commit in the outbox (its eventId's time) to the commit of the consumer transaction that applied it.",
                LATENCY_BUCKETS_SECONDS,
            ),
            labels: Default::default(),
        }
    }

    fn labels(&self, consumer_id: &str, topic: &str, event_type: &str) -> Vec<String> {
        self.labels.admit(&[consumer_id, topic, event_type])
    }

    /// Observes one handler run.
    pub fn handled(&self, consumer_id: &str, topic: &str, event_type: &str, took: Duration) {
        let l = self.labels(consumer_id, topic, event_type);
        self.handler.with_label_values(&[l[0].as_str(), l[1].as_str(), l[2].as_str()]).observe(took.as_secs_f64());
    }

    /// Observes one applied event's commit -> consumed latency, ms (negative: clocks apart, counted as 0).
    pub fn consumed(&self, consumer_id: &str, topic: &str, event_type: &str, latency_ms: i64) {
        let l = self.labels(consumer_id, topic, event_type);
        self.commit_to_consumed.with_label_values(&[l[0].as_str(), l[1].as_str(), l[2].as_str()]).observe(latency_ms.max(0) as f64 / 1000.0);
    }
}

/// The counters of [`Metrics`] as Prometheus counters, read at each gather.
struct CounterCollector {
    source: Arc<Metrics>,
    counters: Vec<(IntCounter, fn(&MetricsSnapshot) -> u64)>,
}

impl Collector for CounterCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.counters.iter().flat_map(|(c, _)| c.desc()).collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let snap = self.source.snapshot();
        self.counters
            .iter()
            .flat_map(|(c, read)| {
                let (now, value) = (c.get(), read(&snap));
                if value > now {
                    c.inc_by(value - now);
                }
                c.collect()
            })
            .collect()
    }
}

/// The counters exported by [`Metrics::register`]: name, help, value.
type CounterDef = (&'static str, &'static str, fn(&MetricsSnapshot) -> u64);
const COUNTERS: &[CounterDef] = &[
    ("outbox_consumer_received_messages_total", "Messages read from the broker.", |s| s.received),
    ("outbox_consumer_applied_events_total", "Events applied (handler ran, receipt committed).", |s| s.applied),
    ("outbox_consumer_duplicates_total", "Redeliveries answered with the original receipt (or dead letter).", |s| s.duplicates),
    ("outbox_consumer_quarantined_messages_total", "Messages quarantined (failed verification, or a known eventId with other bytes).", |s| s.quarantined),
    ("outbox_consumer_dead_lettered_events_total", "Events dead-lettered after their handler kept failing.", |s| s.dead_lettered),
    ("outbox_consumer_handler_failures_total", "Handler runs that failed (each retry counts).", |s| s.handler_failures),
    ("outbox_consumer_transactions_total", "Decision transactions committed.", |s| s.transactions),
    ("outbox_consumer_db_retries_total", "Database work retried after a retryable error.", |s| s.db_retries),
    ("outbox_consumer_offset_commit_failures_total", "Offset commits the broker refused or that could not be stored.", |s| s.offset_commit_failures),
    ("outbox_consumer_partitions_paused_total", "Times a partition was paused because its buffer was full.", |s| s.partitions_paused),
    ("outbox_consumer_offset_gaps_total", "Ranges of a partition this consumer skipped without deciding them (a reset group, an offset out of range): its watermark stops at each.", |s| s.offset_gaps),
    ("outbox_consumer_offset_gap_offsets_total", "Offsets in the gaps found, when found.", |s| s.offset_gap_offsets),
];

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
    /// See [`Metrics::offset_gaps`].
    pub offset_gaps: u64,
    /// See [`Metrics::offset_gap_offsets`].
    pub offset_gap_offsets: u64,
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
            offset_gaps: r(&self.offset_gaps),
            offset_gap_offsets: r(&self.offset_gap_offsets),
        }
    }

    /// Registers these metrics into `registry`: the counters as
    /// `outbox_consumer_*_total{consumer_id}` (read at each gather) and the
    /// process's histograms (once per registry; later calls find them
    /// there). Register each consumer once, under its own consumer id:
    /// several consumers of one service go into one registry. Consumers that
    /// share one [`Metrics`] (`Processor::with_metrics`) share its counters.
    pub fn register(self: &Arc<Self>, registry: &Registry, consumer_id: &str) -> prometheus::Result<()> {
        let mut counters = Vec::with_capacity(COUNTERS.len());
        for (name, help, read) in COUNTERS {
            counters.push((IntCounter::with_opts(Opts::new(*name, *help).const_label("consumer_id", consumer_id))?, *read));
        }
        registry.register(Box::new(CounterCollector { source: self.clone(), counters }))?;
        for h in [&self.histograms.handler, &self.histograms.commit_to_consumed] {
            match registry.register(Box::new(h.clone())) {
                Ok(()) | Err(prometheus::Error::AlreadyReg) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
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
