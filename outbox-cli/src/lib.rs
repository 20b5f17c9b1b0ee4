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
