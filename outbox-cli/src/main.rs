//! `outbox`: the operator's command line. See `outbox --help`.

fn main() -> std::process::ExitCode {
    outbox_cli::main_with(std::env::args())
}
