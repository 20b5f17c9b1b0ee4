//! outbox-producer
