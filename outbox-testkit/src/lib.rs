//! # outbox-testkit
//!
//! What a service team needs to test its own use of the outbox, in its own
//! test suite:
//!
//! * [`ThrowawayPostgres`]: a PostgreSQL server started from the locally
//!   installed binaries in a temporary directory, on a free 127.0.0.1 port,
//!   with trust authentication; stopped and removed when dropped. Works as
//!   root (the server then runs as the `postgres` system user).
//! * [`pick_database`]: `DATABASE_URL` if set, else the local server at
//!   127.0.0.1:5432 if it answers within a second, else a throwaway server.
//!   [`TestDatabase`] creates a fresh database of its own on whatever was
//!   picked and drops it afterwards.
//! * [`KafkaFixture`]: `OUTBOX_TEST_KAFKA_BOOTSTRAP` if set (the test kit
//!   never reads the services' `OUTBOX_KAFKA_BOOTSTRAP`), else librdkafka's
//!   in-process Kafka-protocol mock cluster; [`KafkaFixture::unique_topic`].
//! * [`OutboxTest`]: a database, a topic and a consumer group of the test's
//!   own, migrated, with a connected producer adapter; and the helpers
//!   [`wait_published`], [`wait_consumed`], [`drain`] and
//!   [`run_consumer_until`], each with a timeout.
//! * Assertions called in the user's own transaction or pool:
//!   [`assert_emitted`], [`assert_published`], [`assert_consumed_once`],
//!   and [`assert_no_findings`] over a reconciliation report.
//!
//! ## Assertion style
//!
//! Every `assert_*` function **panics** with a message naming the event and
//! what is wrong (like `assert_eq!`), and returns what it checked so a test
//! can go on with it. Each has a `check_*` twin returning
//! `Result<_, String>` with the same message, for tests that want to retry
//! (e.g. poll until published) or collect several failures.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) {
//! use outbox_testkit::{assert_emitted, assert_published};
//! let mut tx = pool.begin().await.unwrap();
//! // ... the business change and `outbox_producer::emit(&mut tx, ...)` ...
//! let event_id = assert_emitted(&mut tx, "create-o-42").await; // inside the transaction
//! tx.commit().await.unwrap();
//! // ... run a dispatcher ...
//! let receipt = assert_published(&pool, &event_id).await;
//! println!("at {}/{}@{}", receipt.topic, receipt.partition, receipt.offset);
//! # }
//! ```
#![warn(missing_docs)]

mod assert;
mod fixture;
mod kafka;
mod postgres;

pub use assert::{
    assert_consumed_once, assert_emitted, assert_no_findings, assert_published, check_consumed_once, check_emitted, check_no_findings,
    check_published, PrimaryReceipt,
};
pub use fixture::{drain, run_consumer_until, unique_name, wait_consumed, wait_published, OutboxTest, POLL_MS};
pub use kafka::{KafkaFixture, TEST_BOOTSTRAP_ENV};
pub use postgres::{
    find_postgres_bindir, pick_database, pick_database_with, DatabaseSource, PickOptions, PickedDatabase, TestDatabase, ThrowawayPostgres,
    DEFAULT_LOCAL_URL, FORCE_THROWAWAY_ENV,
};

/// An error of the test kit's fixtures (not of the assertions, which panic
/// or return `Result<_, String>`). The message is one line saying what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestkitError(pub String);

impl std::fmt::Display for TestkitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TestkitError {}

impl TestkitError {
    pub(crate) fn new(msg: impl Into<String>) -> Self {
        TestkitError(msg.into())
    }
}
