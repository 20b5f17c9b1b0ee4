//! # outbox-chaos
//!
//! A real-stack chaos drill for the transactional outbox:
//! `cargo run --release -p outbox-chaos -- --events N` starts its own
//! PostgreSQL server (a producer and a consumer database), an external
//! Kafka-protocol broker process (tansu) or uses
//! `OUTBOX_CHAOS_KAFKA_BOOTSTRAP`, and runs emitters, two `outbox dispatch`
//! processes, one `outbox reconcile` and two consumer processes while it
//! SIGKILLs dispatchers and consumers, restarts PostgreSQL, pauses a
//! dispatcher past its lease and replaces the broker. Then it checks the
//! databases and the broker's log ([`check`]). See the README's
//! "Chaos drill" section.

pub mod check;
pub mod pg;
pub mod roles;
pub mod snapshot;
pub mod tansu;
