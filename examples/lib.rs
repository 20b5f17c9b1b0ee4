//! Shared pieces of the runnable examples (`cargo run --example <name>`).

pub mod env;
pub mod fulfilment;
