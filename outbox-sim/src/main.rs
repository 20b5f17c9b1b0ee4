//! `outbox-sim`: the release gate and the trace replayer.
//!
//! ```text
//! cargo run --release -p outbox-sim -- --traces 1000000        # the gate
//! cargo run --release -p outbox-sim -- --seed 42 --log         # replay one trace
//! cargo run --release -p outbox-sim -- --traces 5000 --mutation consumer-skips-receipt
//! ```

use std::process::ExitCode;

use outbox_sim::services::{run_services_gate, run_services_trace, SERVICE_MUTATIONS};
use outbox_sim::{run_gate, run_trace, Mutation};

const USAGE: &str = "usage: outbox-sim [--traces N] [--first-seed S] [--threads T] [--mutation NAME]
       outbox-sim --seed S [--log] [--mutation NAME]

  --traces N       traces to run (default 1000000)
  --first-seed S   first seed of the run (default 1); seeds are S..S+N-1
  --threads T      worker threads (default: all cores)
  --seed S         replay one trace and print its event log
  --log            with --seed: print the log (always on for --seed)
  --mutation NAME  run with a deliberate bug: ";

fn main() -> ExitCode {
    let mut traces: u64 = 1_000_000;
    let mut first_seed: u64 = 1;
    let mut threads: usize = 0;
    let mut seed: Option<u64> = None;
    let mut mutation: Option<Mutation> = None;
    let mut service_mutation: Option<&'static str> = None;
    let mut engine = String::from("services");
    let mut args = std::env::args().skip(1);
    let usage = || {
        let names: Vec<&str> = Mutation::ALL.iter().map(|m| m.name()).collect();
        eprintln!("{USAGE}{}", names.join(", "));
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
                "--mutation" => {
                    let n = value("--mutation")?;
                    if let Some((name, _)) = SERVICE_MUTATIONS.iter().find(|(m, _)| *m == n) {
                        service_mutation = Some(name);
                        engine = "services".into();
                    } else {
                        mutation = Some(Mutation::parse(&n).ok_or_else(|| format!("unknown mutation {n}"))?);
                        engine = "model".into();
                    }
                }
                "--engine" => engine = value("--engine")?,
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

    if engine == "services" {
        let m = service_mutation.map(|m| format!(" --mutation {m}")).unwrap_or_default();
        if let Some(seed) = seed {
            let out = run_services_trace(seed, service_mutation, true);
            for line in out.log.iter().flatten() {
                println!("{line}");
            }
            if !out.figures.clean() {
                println!("trace {seed} FAILED: {}", out.violations.join("; "));
                return ExitCode::FAILURE;
            }
            println!("trace {seed} ok");
            return ExitCode::SUCCESS;
        }
        let (figures, failing, wall) = run_services_gate(first_seed, traces, service_mutation, threads);
        for line in figures.lines() {
            println!("{line}");
        }
        println!("wall_seconds {wall:.1}");
        if figures.clean() {
            println!("gate PASS");
            return ExitCode::SUCCESS;
        }
        if let Some(&first) = failing.first() {
            println!("failing_seeds {failing:?}");
            println!("replay: cargo run --release -p outbox-sim -- --engine services --seed {first} --log{m}");
            let out = run_services_trace(first, service_mutation, false);
            println!("trace {first} violations: {}", out.violations.join("; "));
        }
        println!("gate FAIL");
        return ExitCode::FAILURE;
    }
    if let Some(seed) = seed {
        let out = run_trace(seed, mutation, true);
        for line in out.log.iter().flatten() {
            println!("{line}");
        }
        if out.failed() {
            println!("trace {seed} FAILED: {}", out.violations.join("; "));
            return ExitCode::FAILURE;
        }
        println!("trace {seed} ok");
        return ExitCode::SUCCESS;
    }

    let report = run_gate(first_seed, traces, mutation, threads);
    if let Some(m) = mutation {
        println!("mutation {}", m.name());
    }
    for line in report.lines() {
        println!("{line}");
    }
    if report.pass() {
        return ExitCode::SUCCESS;
    }
    let m = mutation.map(|m| format!(" --mutation {}", m.name())).unwrap_or_default();
    if let Some(&first) = report.failing_seeds.first() {
        println!("failing_seeds {:?}", report.failing_seeds);
        println!("replay: cargo run --release -p outbox-sim -- --seed {first} --log{m}");
        let out = run_trace(first, mutation, true);
        for line in out.log.iter().flatten() {
            println!("{line}");
        }
        println!("trace {first} violations: {}", out.violations.join("; "));
    }
    ExitCode::FAILURE
}
