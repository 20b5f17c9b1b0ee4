//! The services gate: many traces on all cores, their counters summed, the
//! smallest failing seeds kept, and the verdict (zero violations, unknown
//! outcomes resolved in time).

use super::figures::ServiceFigures;
use super::config::StoreMode;
use super::trace::run_services_trace_in;

/// SPEC §10's bound on the time to resolve an unknown outcome: p99 within
/// 15 minutes (of simulated time).
pub const UNKNOWN_P99_LIMIT_MS: i64 = 15 * 60 * 1_000;

/// The result of a gate run.
#[derive(Debug, Clone)]
pub struct ServicesGate {
    /// Every trace's counters, summed.
    pub figures: ServiceFigures,
    /// The smallest failing seeds (at most 16).
    pub failing_seeds: Vec<u64>,
    /// Wall time of the run.
    pub wall_seconds: f64,
    /// p99 of the time an unknown outcome took to resolve, virtual ms.
    pub unknown_p99_ms: i64,
    /// The longest, virtual ms.
    pub unknown_max_ms: i64,
    /// How many unknown outcomes were resolved.
    pub unknown_samples: usize,
}

impl ServicesGate {
    /// Zero violations, and unknown outcomes resolved within
    /// [`UNKNOWN_P99_LIMIT_MS`] at the 99th percentile.
    pub fn pass(&self) -> bool {
        self.figures.clean() && self.unknown_p99_ms <= UNKNOWN_P99_LIMIT_MS
    }
}

/// The services gate over `traces` seeds from `first_seed`, on `threads`
/// threads (0: all cores): counters, the smallest failing seeds, wall seconds.
pub fn run_services_gate(first_seed: u64, traces: u64, mutation: Option<&'static str>, threads: usize) -> (ServiceFigures, Vec<u64>, f64) {
    let g = run_services_gate_report(first_seed, traces, mutation, threads);
    (g.figures, g.failing_seeds, g.wall_seconds)
}

/// The services gate over `traces` seeds from `first_seed`, on `threads`
/// threads (0: all cores), over the claims path.
pub fn run_services_gate_report(first_seed: u64, traces: u64, mutation: Option<&'static str>, threads: usize) -> ServicesGate {
    run_services_gate_in(StoreMode::Claims, first_seed, traces, mutation, threads)
}

/// The services gate over the store path `mode`.
pub fn run_services_gate_in(mode: StoreMode, first_seed: u64, traces: u64, mutation: Option<&'static str>, threads: usize) -> ServicesGate {
    let threads = if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
    let start = std::time::Instant::now();
    let next = std::sync::atomic::AtomicU64::new(0);
    let parts: Vec<(ServiceFigures, Vec<u64>, Vec<i64>)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut figures = ServiceFigures::default();
                    let mut failing = Vec::new();
                    let mut resolved = Vec::new();
                    loop {
                        let from = next.fetch_add(64, std::sync::atomic::Ordering::Relaxed);
                        if from >= traces {
                            break;
                        }
                        for i in from..(from + 64).min(traces) {
                            let out = run_services_trace_in(mode, first_seed + i, mutation, false);
                            if !out.figures.clean() {
                                failing.push(first_seed + i);
                                failing.sort_unstable();
                                failing.truncate(16);
                            }
                            figures.merge(&out.figures);
                            resolved.extend_from_slice(&out.unknown_resolved_ms);
                        }
                    }
                    (figures, failing, resolved)
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().expect("a simulator thread panicked")).collect()
    });
    let mut figures = ServiceFigures::default();
    let mut failing = Vec::new();
    let mut resolved = Vec::new();
    for (f, s, r) in parts {
        figures.merge(&f);
        failing.extend(s);
        resolved.extend(r);
    }
    failing.sort_unstable();
    failing.truncate(16);
    resolved.sort_unstable();
    let unknown_p99_ms = if resolved.is_empty() { 0 } else { resolved[((resolved.len() - 1) as f64 * 0.99).round() as usize] };
    ServicesGate {
        figures,
        failing_seeds: failing,
        wall_seconds: start.elapsed().as_secs_f64(),
        unknown_p99_ms,
        unknown_max_ms: resolved.last().copied().unwrap_or(0),
        unknown_samples: resolved.len(),
    }
}
