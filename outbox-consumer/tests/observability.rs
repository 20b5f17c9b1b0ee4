//! What a consumer tells its operator: handler failures at WARN with the
//! eventId and attempt, and its metrics in the service's Prometheus registry
//! (real PostgreSQL, messages built as a dispatcher sends them).

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use common::*;
use outbox_consumer::prometheus::{Encoder as _, Registry, TextEncoder};
use outbox_consumer::{Processor, RawMessage, RetryPolicy};
use sqlx::PgPool;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn handler_failures_log_at_warn_with_event_id_and_attempt_and_are_exported(pool: PgPool) {
    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt().with_ansi(false).with_max_level(tracing::Level::INFO).with_writer(move || writer.clone()).finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    create_effects_table(&pool).await;
    let h = TestHandler::default();
    let retry = RetryPolicy { max_attempts: 3, initial_backoff_ms: 5, max_backoff_ms: 20, ..RetryPolicy::default() };
    let p = Processor::new("billing", pool.clone(), h.clone()).unwrap().with_retry(retry).unwrap();
    let registry = Registry::new();
    p.metrics().register(&registry, "billing").unwrap();
    // A second consumer of the same service goes into the same registry.
    let shipping = Processor::new("shipping", pool.clone(), h.clone()).unwrap();
    shipping.metrics().register(&registry, "shipping").unwrap();
    let fs: Vec<_> = (0..3).map(|i| fixture_on("orders", 4, 0, &format!("f{i}"))).collect();
    h.script(fs[1].event_id(), Script::FailTimes(2));
    let msgs: Vec<RawMessage> = fs.iter().enumerate().map(|(i, f)| f.raw(i as i64)).collect();
    let outs = p.process_batch(&msgs).await.unwrap();
    assert!(outs.iter().all(|o| o.kind() == "applied"));

    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    let failed: Vec<&str> = text.lines().filter(|l| l.contains("handler failed")).collect();
    assert_eq!(failed.len(), 2, "{text}");
    for (line, attempt) in failed.iter().zip([1, 2]) {
        assert!(line.contains(" WARN "), "{line}");
        assert!(line.contains(&format!("event_id={}", fs[1].event_id())), "{line}");
        assert!(line.contains(&format!("attempt={attempt}")), "{line}");
    }

    let mut buf = Vec::new();
    TextEncoder::new().encode(&registry.gather(), &mut buf).unwrap();
    let scrape = String::from_utf8(buf).unwrap();
    assert!(scrape.contains("outbox_consumer_handler_failures_total{consumer_id=\"billing\"} 2"), "{scrape}");
    assert!(scrape.contains("outbox_consumer_applied_events_total{consumer_id=\"billing\"} 3"), "{scrape}");
    assert!(scrape.contains("outbox_consumer_applied_events_total{consumer_id=\"shipping\"} 0"), "{scrape}");
    let event_type = fs[0].envelope.event_type.clone();
    // Six handler runs: f0, f1 (fails: the batch rolls back), f0 again (its
    // events before f1 commit alone), f1 (fails), f1, f2; three applied events.
    assert!(scrape.contains(&format!("outbox_consumer_handler_duration_seconds_count{{consumer_id=\"billing\",event_type=\"{event_type}\",topic=\"orders\"}} 6")), "{scrape}");
    assert!(scrape.contains(&format!("outbox_consumer_commit_to_consumed_seconds_count{{consumer_id=\"billing\",event_type=\"{event_type}\",topic=\"orders\"}} 3")), "{scrape}");
    assert!(scrape.contains("outbox_consumer_commit_to_consumed_seconds_bucket{consumer_id=\"billing\",event_type="), "{scrape}");
}
