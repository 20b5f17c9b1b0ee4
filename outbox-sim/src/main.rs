//! `outbox-sim`: the release gate and the trace replayer.
//!
//! ```text
//! cargo run --release -p outbox-sim -- --traces 1000000        # the gate (both engines)
//! cargo run --release -p outbox-sim -- --seed 42 --log         # replay one trace (services engine)
//! cargo run --release -p outbox-sim -- --traces 100000 --mutation send-after-lease
//! cargo run --release -p outbox-sim -- --mutation list
//! ```

use std::process::ExitCode;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use outbox_sim::services::{run_services_gate, run_services_trace, ServiceFigures, SERVICE_MUTATIONS};
use outbox_sim::{run_gate, run_trace, Mutation};

const USAGE: &str = "usage: outbox-sim [--traces N] [--first-seed S] [--threads T] [--engine both|services|model] [--mutation NAME]
       outbox-sim --seed S [--engine services|model] [--log] [--mutation NAME]
       outbox-sim --mutation list

  --traces N       traces to run per engine (default 1000000; at least 1)
  --first-seed S   first seed of the run (default 1); seeds are S..S+N-1 (must not wrap)
  --threads T      worker threads (default: all cores)
  --engine E       services: the shipped Dispatcher, Reconciler, destination migration and
                   retention decision over the in-memory store;
                   model: the protocol model (consumers, migrations, retention); both (default)
  --seed S         replay one trace and print its event log (engine services unless --engine model)
  --log            with --seed: print the log (always on for --seed)
  --mutation NAME  run with a deliberate defect (the engine follows from it); `list` prints them";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Engine {
    Both,
    Services,
    Model,
}

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
    let mut mutation: Option<Mutation> = None;
    let mut service_mutation: Option<&'static str> = None;
    let mut engine: Option<Engine> = None;
    let mut list = false;
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
                "--engine" => {
                    engine = Some(match value("--engine")?.as_str() {
                        "both" => Engine::Both,
                        "services" => Engine::Services,
                        "model" => Engine::Model,
                        other => return Err(format!("unknown engine {other} (both, services, model)")),
                    })
                }
                "--mutation" => {
                    let n = value("--mutation")?;
                    if n == "list" {
                        list = true;
                    } else if let Some((name, _)) = SERVICE_MUTATIONS.iter().find(|(m, _)| *m == n) {
                        service_mutation = Some(name);
                    } else {
                        mutation = Some(Mutation::parse(&n).ok_or_else(|| format!("unknown mutation {n} (--mutation list prints them)"))?);
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
        for (name, what) in SERVICE_MUTATIONS {
            println!("{name:<28} services  {what}");
        }
        for m in Mutation::ALL {
            println!("{:<28} model     caught by {}", m.name(), m.caught_by());
        }
        return ExitCode::SUCCESS;
    }
    // The engine follows from the mutation; a contradicting --engine is refused.
    let engine = match (engine, service_mutation.is_some(), mutation.is_some()) {
        (_, true, true) => {
            eprintln!("one --mutation at a time");
            return usage();
        }
        (None | Some(Engine::Services), true, false) => Engine::Services,
        (None | Some(Engine::Model), false, true) => Engine::Model,
        (Some(_), true, false) | (Some(_), false, true) => {
            eprintln!("that mutation belongs to the other engine");
            return usage();
        }
        (None, false, false) => {
            if seed.is_some() {
                Engine::Services
            } else {
                Engine::Both
            }
        }
        (Some(e), false, false) => e,
    };
    if traces == 0 {
        eprintln!("--traces 0 would prove nothing; refused");
        return ExitCode::from(2);
    }
    if first_seed.checked_add(traces - 1).is_none() {
        eprintln!("seeds {first_seed}.. plus {traces} traces wrap around u64; refused");
        return ExitCode::from(2);
    }

    if let Some(seed) = seed {
        let (failed, log, violations) = match engine {
            Engine::Model => {
                let out = run_trace(seed, mutation, true);
                (out.failed(), out.log.unwrap_or_default(), out.violations)
            }
            _ => {
                let out = run_services_trace(seed, service_mutation, true);
                (!out.figures.clean(), out.log.unwrap_or_default(), out.violations)
            }
        };
        for line in log {
            println!("{line}");
        }
        if failed {
            println!("trace {seed} FAILED: {}", violations.join("; "));
            return ExitCode::FAILURE;
        }
        println!("trace {seed} ok");
        return ExitCode::SUCCESS;
    }

    let mut pass = true;
    let mut wall = 0.0;
    if engine != Engine::Model {
        let (figures, failing, seconds) = run_services_gate(first_seed, traces, service_mutation, threads);
        wall += seconds;
        if let Some(m) = service_mutation {
            println!("mutation {m}");
        }
        println!("engine services: the shipped Dispatcher, Reconciler, destination migration and retention decision");
        print_services(&figures, seconds);
        if !figures.clean() {
            pass = false;
            let m = service_mutation.map(|m| format!(" --mutation {m}")).unwrap_or_default();
            if let Some(&first) = failing.first() {
                println!("services.failing_seeds {failing:?}");
                println!("replay: cargo run --release -p outbox-sim -- --engine services --seed {first} --log{m}");
                let out = run_services_trace(first, service_mutation, false);
                println!("trace {first} violations: {}", out.violations.join("; "));
            }
        }
    }
    if engine != Engine::Services {
        let report = run_gate(first_seed, traces, mutation, threads);
        wall += report.wall_seconds;
        if let Some(m) = mutation {
            println!("mutation {}", m.name());
        }
        println!("engine model: the protocol model");
        for line in report.lines() {
            if line.starts_with("gate ") {
                continue;
            }
            println!("{line}");
        }
        if !report.pass() {
            pass = false;
            let m = mutation.map(|m| format!(" --mutation {}", m.name())).unwrap_or_default();
            if let Some(&first) = report.failing_seeds.first() {
                println!("failing_seeds {:?}", report.failing_seeds);
                println!("replay: cargo run --release -p outbox-sim -- --engine model --seed {first} --log{m}");
                let out = run_trace(first, mutation, true);
                println!("trace {first} violations: {}", out.violations.join("; "));
            }
        }
    }
    if pass {
        println!("{}", reach_line(traces));
    }
    println!("total_wall_seconds {wall:.1}");
    println!("gate {}", if pass { "PASS" } else { "FAIL" });
    if pass {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn print_services(figures: &ServiceFigures, seconds: f64) {
    for line in figures.lines() {
        println!("{line}");
    }
    println!("services.wall_seconds {seconds:.1}");
}
