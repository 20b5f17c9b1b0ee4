//! `outbox-sim`: the release gate and the trace replayer.
//!
//! ```text
//! cargo run --release -p outbox-sim -- --traces 1000000        # the gate
//! cargo run --release -p outbox-sim -- --seed 42 --log         # replay one trace
//! cargo run --release -p outbox-sim -- --traces 100000 --mutation send-after-lease
//! cargo run --release -p outbox-sim -- --traces 100000 --mode stream   # the stream path
//! cargo run --release -p outbox-sim -- --mutation list
//! ```

use std::process::ExitCode;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use outbox_sim::services::{run_services_gate_in, run_services_trace_in, StoreMode, COMPONENT_MUTATIONS, SERVICE_MUTATIONS, STREAM_MUTATIONS, UNKNOWN_P99_LIMIT_MS};

const USAGE: &str = "usage: outbox-sim [--traces N] [--first-seed S] [--threads T] [--mode M] [--mutation NAME]
       outbox-sim --seed S [--log] [--mode M] [--mutation NAME]
       outbox-sim --mutation list

  --traces N       traces to run (default 1000000; at least 1)
  --first-seed S   first seed of the run (default 1); seeds are S..S+N-1 (must not wrap)
  --threads T      worker threads (default: all cores)
  --seed S         replay one trace and print its event log
  --log            with --seed: print the log (always on for --seed)
  --mode M         the store's path: claims (per-event claims, the default) or
                   stream (the insert-only stream: bucket leases, batches cut by
                   snapshots, today's machinery as its exception lane)
  --mutation NAME  run with a deliberate defect in shipped code; `list` prints them

Every trace runs the shipped Dispatcher, Reconciler, destination migration,
retention decision and consumer Processor over the in-memory stores, in
virtual time, under faults.";

/// Zero violations in `n` independent traces bound the per-trace violation
/// rate below 3/n with 95% confidence (the rule of three).
fn reach_line(n: u64) -> String {
    format!("reach: zero violations in {n} traces bound the per-trace violation rate below {:.2e} at 95% confidence (3/n)", 3.0 / n.max(1) as f64)
}

fn main() -> ExitCode {
    let mut traces: u64 = 1_000_000;
    let mut first_seed: u64 = 1;
    let mut threads: usize = 0;
    let mut seed: Option<u64> = None;
    let mut mutation: Option<&'static str> = None;
    let mut list = false;
    let mut mode = StoreMode::Claims;
    let mut args = std::env::args().skip(1);
    let usage = || {
        eprintln!("{USAGE}");
        ExitCode::from(2)
    };
    while let Some(a) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        let r: Result<(), String> = (|| {
            match a.as_str() {
                "--traces" => traces = value("--traces")?.replace('_', "").parse().map_err(|e| format!("--traces: {e}"))?,
                "--first-seed" => first_seed = value("--first-seed")?.parse().map_err(|e| format!("--first-seed: {e}"))?,
                "--threads" => threads = value("--threads")?.parse().map_err(|e| format!("--threads: {e}"))?,
                "--seed" => seed = Some(value("--seed")?.parse().map_err(|e| format!("--seed: {e}"))?),
                "--mode" => mode = StoreMode::parse(&value("--mode")?)?,
                "--mutation" => {
                    let n = value("--mutation")?;
                    if n == "list" {
                        list = true;
                    } else {
                        if let Some((_, _, test)) = COMPONENT_MUTATIONS.iter().find(|(m, ..)| *m == n) {
                            let mut t = test.split(' ');
                            let (package, binary, name) = (t.next().unwrap_or(""), t.next().unwrap_or(""), t.next().unwrap_or(""));
                            return Err(format!("mutation {n} is caught by a component test, not the gate: cargo test -p {package} --test {binary} {name}"));
                        }
                        let (name, _) = SERVICE_MUTATIONS.iter().chain(&STREAM_MUTATIONS).find(|(m, _)| *m == n).ok_or_else(|| format!("unknown mutation {n} (--mutation list prints them)"))?;
                        mutation = Some(name);
                    }
                }
                "--log" => {}
                "-h" | "--help" => return Err(String::new()),
                other => return Err(format!("unknown argument {other}")),
            }
            Ok(())
        })();
        if let Err(e) = r {
            if !e.is_empty() {
                eprintln!("{e}");
            }
            return usage();
        }
    }
    if list {
        println!("caught by the gate (outbox-sim --mutation NAME):");
        for (name, what) in SERVICE_MUTATIONS {
            println!("  {name:<36} {what}");
        }
        println!("caught by the gate over the stream path (outbox-sim --mode stream --mutation NAME):");
        for (name, what) in STREAM_MUTATIONS {
            println!("  {name:<36} {what}");
        }
        println!("caught by a component test (cargo test -p PACKAGE --test BINARY TEST):");
        for (name, what, test) in COMPONENT_MUTATIONS {
            println!("  {name:<36} {what}\n  {:<36} test: {test}", "");
        }
        return ExitCode::SUCCESS;
    }
    if let Some(m) = mutation.filter(|m| mode != StoreMode::Stream && STREAM_MUTATIONS.iter().any(|(n, _)| n == m)) {
        eprintln!("mutation {m} is in the stream path, which --mode claims does not run: add --mode stream");
        return ExitCode::from(2);
    }
    if traces == 0 {
        eprintln!("--traces 0 would prove nothing; refused");
        return ExitCode::from(2);
    }
    if first_seed.checked_add(traces - 1).is_none() {
        eprintln!("seeds {first_seed}.. plus {traces} traces wrap around u64; refused");
        return ExitCode::from(2);
    }

    if let Some(seed) = seed {
        let out = run_services_trace_in(mode, seed, mutation, true);
        for line in out.log.unwrap_or_default() {
            println!("{line}");
        }
        if !out.figures.clean() {
            println!("trace {seed} FAILED: {}", out.violations.join("; "));
            return ExitCode::FAILURE;
        }
        println!("trace {seed} ok");
        return ExitCode::SUCCESS;
    }

    let gate = run_services_gate_in(mode, first_seed, traces, mutation, threads);
    if let Some(m) = mutation {
        println!("mutation {m}");
    }
    println!("engine services: the shipped Dispatcher, Reconciler, destination migration, retention decision and consumer Processor");
    println!("mode {}", mode.as_str());
    println!("seeds {first_seed}..{}", first_seed + traces - 1);
    for line in gate.figures.lines() {
        println!("{line}");
    }
    println!("services.unknown_samples {}", gate.unknown_samples);
    println!("services.unknown_p99_ms {} (limit {UNKNOWN_P99_LIMIT_MS})", gate.unknown_p99_ms);
    println!("services.unknown_max_ms {}", gate.unknown_max_ms);
    println!("services.wall_seconds {:.1}", gate.wall_seconds);
    let pass = gate.pass();
    if !pass {
        let m = format!("{}{}", if mode == StoreMode::Stream { " --mode stream" } else { "" }, mutation.map(|m| format!(" --mutation {m}")).unwrap_or_default());
        if let Some(&first) = gate.failing_seeds.first() {
            println!("services.failing_seeds {:?}", gate.failing_seeds);
            println!("replay: cargo run --release -p outbox-sim -- --seed {first} --log{m}");
            let out = run_services_trace_in(mode, first, mutation, false);
            println!("trace {first} violations: {}", out.violations.join("; "));
        }
    } else {
        println!("{}", reach_line(traces));
    }
    println!("total_wall_seconds {:.1}", gate.wall_seconds);
    println!("gate {}", if pass { "PASS" } else { "FAIL" });
    if pass {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
