//! outbox-consumer
