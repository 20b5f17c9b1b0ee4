//! `outbox`: the operator's command line. See `outbox --help`.

use std::process::ExitCode;

use clap::Parser;
use outbox_cli::cli::Cli;
use outbox_cli::commands;
use outbox_cli::config::FileConfig;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let file = match &cli.config {
        Some(path) => match FileConfig::load(path) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("outbox: error: {e:#}");
                return ExitCode::from(1);
            }
        },
        None => FileConfig::default(),
    };
    if let Err(e) = commands::init_logging(&cli, &file) {
        eprintln!("outbox: error: {e:#}");
        return ExitCode::from(1);
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
