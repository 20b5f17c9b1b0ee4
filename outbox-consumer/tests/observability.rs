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

impl Captured {
    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

/// Every INFO-and-above line of this thread, without colours, until the guard drops.
fn capture_logs() -> (Captured, tracing::subscriber::DefaultGuard) {
    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt().with_ansi(false).with_max_level(tracing::Level::INFO).with_writer(move || writer.clone()).finish();
    (logs, tracing::subscriber::set_default(subscriber))
}

#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn handler_failures_log_at_warn_with_event_id_and_attempt_and_are_exported(pool: PgPool) {
    let (logs, _guard) = capture_logs();

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

    let text = logs.text();
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

/// A consumer that quarantines says so: a WARN line per quarantined message
/// (reason, position and eventId), limited per window with the rest summed
/// up; an ERROR once nothing but quarantines came through for ten messages
/// in a row; the counter in the registry. (A mistyped accepted source once
/// quarantined all 3,007 messages of a replay without one line.)
#[sqlx::test(migrator = "outbox_consumer::MIGRATOR")]
async fn quarantines_are_logged_rate_limited_and_counted_and_a_run_of_them_is_an_error(pool: PgPool) {
    let (logs, _guard) = capture_logs();

    create_effects_table(&pool).await;
    let h = TestHandler::default();
    // Its own consumer id: the handler histograms are the process's, shared
    // with the test above, which counts billing's handler runs.
    let p = Processor::new("audit", pool.clone(), h.clone()).unwrap();
    let registry = Registry::new();
    p.metrics().register(&registry, "audit").unwrap();
    // 25 messages whose bytes were changed on the way: each fails its digest.
    let msgs: Vec<RawMessage> = (0..25)
        .map(|i| {
            let mut m = fixture_on("orders", 4, 2, &format!("t{i}")).raw(i);
            m.payload = Some(format!("{{\"order\":\"forged-{i}\"}}").into_bytes());
            m
        })
        .collect();
    let outs = p.process_batch(&msgs).await.unwrap();
    assert!(outs.iter().all(|o| o.kind() == "quarantined"), "{outs:?}");
    assert_eq!(h.calls(), 0);

    let text = logs.text();
    let lines: Vec<&str> = text.lines().filter(|l| l.contains("message quarantined")).collect();
    assert_eq!(lines.len(), outbox_consumer::QUARANTINE_LOG_LINES_PER_WINDOW as usize, "at most the window's budget: {text}");
    assert!(lines[0].contains(" WARN ") && lines[0].contains("consumer=audit") && lines[0].contains("partition=2") && lines[0].contains("offset=0"), "{}", lines[0]);
    assert!(lines[0].contains("reason=verify:payload_digest") && lines[0].contains("event_id=evt-"), "{}", lines[0]);
    let alarm: Vec<&str> = text.lines().filter(|l| l.contains("every one of the last")).collect();
    assert_eq!(alarm.len(), 1, "once at 10 in a row (the next at 100): {text}");
    assert!(alarm[0].contains(" ERROR ") && alarm[0].contains("last 10 messages was quarantined") && alarm[0].contains("trust policy"), "{}", alarm[0]);

    let mut buf = Vec::new();
    TextEncoder::new().encode(&registry.gather(), &mut buf).unwrap();
    let scrape = String::from_utf8(buf).unwrap();
    assert!(scrape.contains("outbox_consumer_quarantined_messages_total{consumer_id=\"audit\"} 25"), "{scrape}");

    // An applied event ends the run: ten more quarantines raise it again.
    let good = fixture_on("orders", 4, 2, "good");
    assert_eq!(p.process_message(&good.raw(25)).await.unwrap().kind(), "applied");
    let more: Vec<RawMessage> = (26..36)
        .map(|i| {
            let mut m = fixture_on("orders", 4, 2, &format!("t{i}")).raw(i);
            m.payload = Some(b"{}".to_vec());
            m
        })
        .collect();
    p.process_batch(&more).await.unwrap();
    let text = logs.text();
    assert_eq!(text.lines().filter(|l| l.contains("every one of the last 10 messages")).count(), 2, "{text}");
}
