//! CPU spent over a benchmark run, for the `# machine cpu` and `# own cpu`
//! lines the benchmarks print. Events per second compare builds only on
//! one machine within the hour; CPU per event travels better.
//!
//! * machine: every core's busy time (user, nice, system, irq, softirq,
//!   steal) from Linux's `/proc/stat`: PostgreSQL, the bench, the
//!   in-process cluster and whatever else runs on the machine;
//! * own: this process and the PostgreSQL backends connected to the
//!   bench's database, from `/proc/<pid>/stat`, which other work on the
//!   machine does not inflate.
//!
//! Both are `None` where `/proc` is not there or the server's processes
//! are not visible (another host, a container).

use std::collections::HashMap;

/// CPU counters at the start of a run.
pub struct CpuMeter {
    machine_s: Option<f64>,
    process_s: Option<f64>,
    backends_s: HashMap<i32, f64>,
}

/// CPU seconds spent between [`CpuMeter::start`] and [`CpuMeter::finish`].
#[derive(Debug, Clone, Copy)]
pub struct CpuSpent {
    /// The whole machine's busy CPU.
    pub machine_s: Option<f64>,
    /// This process and its database's PostgreSQL backends.
    pub own_s: Option<(f64, f64)>,
}

impl CpuMeter {
    /// Reads the counters now.
    pub async fn start(pool: &sqlx::PgPool) -> Self {
        CpuMeter { machine_s: machine_cpu_s(), process_s: proc_cpu_s("self"), backends_s: backends_cpu_s(pool).await }
    }

    /// What was spent since [`CpuMeter::start`]. A backend that connected
    /// meanwhile counts from its start; one that disconnected meanwhile is
    /// not seen (keep the pool's connections open over the run).
    pub async fn finish(&self, pool: &sqlx::PgPool) -> CpuSpent {
        let machine_s = self.machine_s.zip(machine_cpu_s()).map(|(a, b)| b - a);
        let now = backends_cpu_s(pool).await;
        let own_s = match (self.process_s, proc_cpu_s("self")) {
            (Some(a), Some(b)) if !now.is_empty() => Some((b - a, now.iter().map(|(pid, s)| s - self.backends_s.get(pid).copied().unwrap_or(0.0)).sum())),
            _ => None,
        };
        CpuSpent { machine_s, own_s }
    }
}

impl CpuSpent {
    /// The `# machine cpu` and `# own cpu` lines, per event of `events`.
    pub fn lines(&self, events: usize) -> Vec<String> {
        let per = |s: f64| s * 1e6 / events.max(1) as f64;
        let mut out = Vec::new();
        if let Some(m) = self.machine_s {
            out.push(format!("# machine cpu {m:.1} s over the run ; {:.0} us of cpu per event", per(m)));
        }
        if let Some((process_s, backends_s)) = self.own_s {
            out.push(format!(
                "# own cpu: bench process {process_s:.1} s + its PostgreSQL backends {backends_s:.1} s ; {:.0} us of cpu per event ({:.0} + {:.0})",
                per(process_s + backends_s),
                per(process_s),
                per(backends_s)
            ));
        }
        out
    }
}

/// CPU seconds of each PostgreSQL backend connected to the pool's database.
async fn backends_cpu_s(pool: &sqlx::PgPool) -> HashMap<i32, f64> {
    let pids: Vec<i32> = sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE datname = current_database()").fetch_all(pool).await.unwrap_or_default();
    pids.into_iter().filter_map(|p| proc_cpu_s(&p.to_string()).map(|s| (p, s))).collect()
}

/// CPU seconds (user + system) of a process, from `/proc/<pid>/stat`
/// (USER_HZ, 100 per second).
fn proc_cpu_s(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) in parentheses.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let (utime, stime): (f64, f64) = (f.get(11)?.parse().ok()?, f.get(12)?.parse().ok()?);
    Some((utime + stime) / 100.0)
}

/// CPU seconds the whole machine has spent busy since boot (user, nice,
/// system, irq, softirq, steal), from `/proc/stat` (USER_HZ).
fn machine_cpu_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<f64> = stat.lines().next()?.strip_prefix("cpu ")?.split_whitespace().map(|f| f.parse().unwrap_or(0.0)).collect();
    let busy: f64 = [0, 1, 2, 5, 6, 7].iter().filter_map(|&i| fields.get(i)).sum();
    Some(busy / 100.0)
}
