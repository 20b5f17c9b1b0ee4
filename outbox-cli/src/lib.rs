//! # outbox-cli
//!
//! The operator's command line for the transactional outbox (binary
//! `outbox`): schema migrations, the dispatcher and reconciler services,
//! inspection (`status`, `trace`, `report`), retention (`purge`) and
//! destination migration. See `outbox --help` and `outbox-cli/README.md`.
//!
//! The library half exists so the pieces can be tested and reused: the
//! configuration merge ([`config`]), the HTML report renderer ([`html`]),
//! the Prometheus export ([`metrics`]), and the `status` / `trace` readers.
#![warn(missing_docs)]

pub mod cli;
pub mod commands;
pub mod config;
pub mod duration;
pub mod fmt;
pub mod health;
pub mod html;
pub mod metrics;
pub mod runbook;
pub mod status;
pub mod trace;

/// The `outbox` binary's whole `main`: parses `args` (the first is the
/// program name), loads the configuration file, sets up logging, runs the
/// command on a multi-threaded runtime and turns the outcome into the exit
/// code. Other binaries that run the same services (the chaos drill's
/// processes) call it instead of copying it.
pub fn main_with(args: impl IntoIterator<Item = String>) -> std::process::ExitCode {
    use clap::Parser;
    use std::process::ExitCode;
    let cli = cli::Cli::parse_from(args);
    let file = match &cli.config {
        // The file as written is validated at start (every section it has,
        // and the key ids across them); flags and variables merged over it
        // are checked where each command uses them.
        Some(path) => match config::FileConfig::load(path).and_then(|f| f.validate().map(|()| f)) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("outbox: error: {e:#}");
                return ExitCode::from(1);
            }
        },
        None => config::FileConfig::default(),
    };
    if let Err(e) = commands::init_logging(&cli, &file) {
        eprintln!("outbox: error: {e:#}");
        return ExitCode::from(1);
    }
    for note in file.warnings() {
        tracing::warn!("{note}");
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("outbox: error: starting the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(commands::run(cli, file)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("outbox: error: {}", commands::render_error(&e));
            ExitCode::from(1)
        }
    }
}
