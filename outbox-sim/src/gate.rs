//! The release gate: many traces on all cores, one sum, one verdict.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::figures::{percentile, Figures, Kind, UNKNOWN_P99_LIMIT_MS};
use crate::mutation::Mutation;
use crate::sim::run_trace;

/// Seeds a worker thread takes at a time.
const CHUNK: u64 = 256;
/// Failing seeds remembered (the smallest ones).
const KEEP_FAILING: usize = 16;

/// The result of a gate run.
#[derive(Debug, Clone)]
pub struct GateReport {
    /// Sum of every trace's counters.
    pub figures: Figures,
    /// First seed run.
    pub first_seed: u64,
    /// Last seed run.
    pub last_seed: u64,
    /// p99 of UNKNOWN time-to-resolution, simulated ms.
    pub unknown_p99_ms: i64,
    /// Largest UNKNOWN time-to-resolution, simulated ms.
    pub unknown_max_ms: i64,
    /// Number of resolution samples.
    pub unknown_samples: usize,
    /// Wall time of the run.
    pub wall_seconds: f64,
    /// Worker threads used.
    pub threads: usize,
    /// The smallest failing seeds.
    pub failing_seeds: Vec<u64>,
}

impl GateReport {
    /// PROTOCOL §10: zero violations, 100% of late valid ACKs converged, UNKNOWN p99 within 15 minutes.
    pub fn pass(&self) -> bool {
        self.figures.clean() && self.figures.late_acks_converged == self.figures.late_acks_total && self.unknown_p99_ms <= UNKNOWN_P99_LIMIT_MS
    }

    /// One `name value` line per figure, the gate's figures first, then
    /// `gate PASS` or `gate FAIL`.
    pub fn lines(&self) -> Vec<String> {
        let f = &self.figures;
        let mut out = vec![
            format!("traces {}", f.traces),
            format!("seeds {}..{}", self.first_seed, self.last_seed),
            format!("lost_events {}", f.lost_events),
            format!("second_logical_event_ids {}", f.second_logical_event_ids),
            format!("cross_destination_retries {}", f.cross_destination_retries),
            format!("divergent_accepted {}", f.divergent_accepted),
            format!("duplicate_consumer_effects {}", f.duplicate_consumer_effects),
            format!("commits_without_envelope {}", f.commits_without_envelope),
            format!("unknown_without_trail {}", f.unknown_without_trail),
            format!("late_acks_total {}", f.late_acks_total),
            format!("late_acks_converged_pct {:.3}", f.late_acks_converged_pct()),
            format!("unknown_p99_ms {}", self.unknown_p99_ms),
        ];
        let shown = [
            "traces",
            "lost_events",
            "second_logical_event_ids",
            "cross_destination_retries",
            "divergent_accepted",
            "duplicate_consumer_effects",
            "commits_without_envelope",
            "unknown_without_trail",
            "late_acks_total",
        ];
        for (name, v, kind) in f.entries() {
            if kind == Kind::MustBeZero && !shown.contains(&name) {
                out.push(format!("{name} {v}"));
            }
        }
        out.push(format!("unknown_max_ms {}", self.unknown_max_ms));
        out.push(format!("unknown_samples {}", self.unknown_samples));
        for (name, v, kind) in f.entries() {
            if kind == Kind::Info && !shown.contains(&name) {
                out.push(format!("{name} {v}"));
            }
        }
        out.push(format!("threads {}", self.threads));
        out.push(format!("wall_seconds {:.1}", self.wall_seconds));
        out.push(format!("gate {}", if self.pass() { "PASS" } else { "FAIL" }));
        out
    }
}

/// Runs `traces` traces from `first_seed` on `threads` threads (0: all cores).
pub fn run_gate(first_seed: u64, traces: u64, mutation: Option<Mutation>, threads: usize) -> GateReport {
    let threads = if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
    let start = Instant::now();
    let next = AtomicU64::new(0);
    let parts: Vec<(Figures, Vec<i64>, Vec<u64>)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut figures = Figures::default();
                    let mut resolutions = Vec::new();
                    let mut failing = Vec::new();
                    loop {
                        let from = next.fetch_add(CHUNK, Ordering::Relaxed);
                        if from >= traces {
                            break;
                        }
                        for i in from..(from + CHUNK).min(traces) {
                            let seed = first_seed + i;
                            let out = run_trace(seed, mutation, false);
                            if out.failed() {
                                failing.push(seed);
                                failing.sort_unstable();
                                failing.truncate(KEEP_FAILING);
                            }
                            figures.merge(&out.figures);
                            resolutions.extend_from_slice(&out.resolutions);
                        }
                    }
                    (figures, resolutions, failing)
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().expect("a simulator thread panicked")).collect()
    });
    let mut figures = Figures::default();
    let mut resolutions = Vec::new();
    let mut failing_seeds = Vec::new();
    for (f, r, s) in parts {
        figures.merge(&f);
        resolutions.extend(r);
        failing_seeds.extend(s);
    }
    failing_seeds.sort_unstable();
    failing_seeds.truncate(KEEP_FAILING);
    let unknown_p99_ms = percentile(&mut resolutions, 99.0);
    let unknown_max_ms = resolutions.iter().copied().max().unwrap_or(0);
    GateReport {
        figures,
        first_seed,
        last_seed: first_seed + traces.saturating_sub(1),
        unknown_p99_ms,
        unknown_max_ms,
        unknown_samples: resolutions.len(),
        wall_seconds: start.elapsed().as_secs_f64(),
        threads,
        failing_seeds,
    }
}
