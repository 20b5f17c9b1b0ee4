//! Shared pieces of the runnable examples (`cargo run --example <name>`).

pub mod cpu;
pub mod env;
pub mod fulfilment;
pub mod keys;

/// The README's snippets, compiled as doctests (`cargo test -p outbox-examples --doc`).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
