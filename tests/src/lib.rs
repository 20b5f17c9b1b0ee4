//! Integration tests of the outbox workspace against real PostgreSQL and a Kafka-protocol broker.
