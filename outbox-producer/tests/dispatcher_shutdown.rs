//! `Dispatcher::run`'s shutdown argument (issue 48.5): a future, as
//! documented, and — for callers of the signature before it — a
//! `watch::Receiver<bool>`, still accepted, still stopping the run on
//! `true`, with a deprecation warning at run time that names the caller's
//! line and the replacement. The compiler cannot warn there (`#[deprecated]`
//! on a trait impl has no effect, rust-lang/rust#39935): this file compiling
//! is the proof that the old call compiles.
//!
//! In memory: `outbox_memory::MemoryStore` and a broker that is never sent
//! to (no events), so no PostgreSQL or Kafka is needed.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use outbox_core::{Broker, Destination, EventId, LookupOutcome, OutgoingMessage, ScanFrom, SendOutcome};
use outbox_memory::MemoryStore;
use outbox_producer::{until_true, Dispatcher, DispatcherConfig};
use tokio::sync::watch;

/// A broker with nothing to do: the store holds no events.
struct IdleBroker;

#[async_trait]
impl Broker for IdleBroker {
    fn cluster_id(&self) -> &str {
        "idle-cluster"
    }

    async fn send(&self, _message: OutgoingMessage) -> SendOutcome {
        unreachable!("no events, no sends")
    }

    fn supports_lookup(&self) -> bool {
        false
    }

    async fn lookup(&self, _destination: &Destination, _event_id: &EventId, _from: &ScanFrom) -> LookupOutcome {
        LookupOutcome::Unavailable("idle".into())
    }
}

fn dispatcher() -> Arc<Dispatcher<IdleBroker, MemoryStore>> {
    let config = DispatcherConfig { name: "shutdown-test".into(), poll_interval_ms: 20, sweep_interval_ms: 50, shutdown_grace_ms: 1_000, ..Default::default() };
    Arc::new(Dispatcher::new(MemoryStore::new(), Arc::new(IdleBroker), config).expect("dispatcher"))
}

/// The WARN lines logged while `f` runs on this thread (a minimal
/// `tracing` subscriber: the message and the `caller` field of each event
/// at WARN or above).
fn warnings_during<T>(f: impl FnOnce() -> T) -> (T, Vec<String>) {
    #[derive(Default)]
    struct Lines(Mutex<Vec<String>>);
    struct Capture(Arc<Lines>);
    struct Fields(String);
    impl tracing::field::Visit for Fields {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            self.0.push_str(&format!(" {}={value:?}", field.name()));
        }
    }
    impl tracing::Subscriber for Capture {
        fn enabled(&self, m: &tracing::Metadata<'_>) -> bool {
            *m.level() <= tracing::Level::WARN
        }
        fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
            tracing::span::Id::from_u64(1)
        }
        fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
        fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
        fn event(&self, e: &tracing::Event<'_>) {
            let mut fields = Fields(String::new());
            e.record(&mut fields);
            self.0 .0.lock().unwrap().push(fields.0);
        }
        fn enter(&self, _: &tracing::span::Id) {}
        fn exit(&self, _: &tracing::span::Id) {}
    }
    let lines = Arc::new(Lines::default());
    let out = tracing::subscriber::with_default(Capture(lines.clone()), f);
    let got = lines.0.lock().unwrap().clone();
    (out, got)
}

/// The call of the old signature, `run(rx)` with a `watch::Receiver<bool>`,
/// compiles, runs until the receiver holds `true`, then returns the totals.
#[tokio::test]
async fn run_with_a_watch_receiver_still_compiles_and_stops_on_true() {
    let d = dispatcher();
    let (stop_tx, stop_rx) = watch::channel(false);
    let ((run, line), warnings) = warnings_during(|| (tokio::spawn(d.clone().run(stop_rx)), line!()));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!run.is_finished(), "runs while the receiver holds false");
    stop_tx.send(true).unwrap();
    let totals = tokio::time::timeout(Duration::from_secs(10), run).await.expect("stops once the receiver holds true").unwrap().unwrap();
    assert_eq!(totals.claimed, 0);

    // The deprecation, at run time: once, naming this file and line, and the replacement.
    let deprecated: Vec<&String> = warnings.iter().filter(|w| w.contains("is deprecated")).collect();
    assert_eq!(deprecated.len(), 1, "one deprecation warning per call: {warnings:?}");
    let w = deprecated[0];
    assert!(w.contains("Dispatcher::run(watch::Receiver<bool>)") && w.contains("run(outbox_producer::until_true(rx))"), "{w}");
    assert!(w.contains(&format!("dispatcher_shutdown.rs:{line}:")), "names the caller's line {line}: {w}");
}

/// The receiver's sender dropped stops the run too, as `until_true` does.
#[tokio::test]
async fn run_with_a_watch_receiver_stops_when_its_sender_is_dropped() {
    let d = dispatcher();
    let (stop_tx, stop_rx) = watch::channel(false);
    let run = tokio::spawn(d.run(stop_rx));
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(stop_tx);
    tokio::time::timeout(Duration::from_secs(10), run).await.expect("stops once the sender is gone").unwrap().unwrap();
}

/// The documented form is unchanged and says nothing: a future
/// (`until_true(rx)`, an `async` block, `std::future::pending()`).
#[tokio::test]
async fn run_with_a_future_is_unchanged_and_does_not_warn() {
    let d = dispatcher();
    let (stop_tx, stop_rx) = watch::channel(false);
    let (run, warnings) = warnings_during(|| tokio::spawn(d.clone().run(until_true(stop_rx))));
    assert!(warnings.iter().all(|w| !w.contains("deprecated")), "{warnings:?}");
    stop_tx.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(10), run).await.expect("stops").unwrap().unwrap();

    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(d.clone().run(async move {
        let _ = rx.await;
    }));
    tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), run).await.expect("stops").unwrap().unwrap();

    // Never resolves: the run goes on until it is dropped.
    let run = tokio::spawn(d.run(std::future::pending()));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!run.is_finished());
    run.abort();
}

/// The deprecated `run_watch` still works (and is `#[deprecated]`, a
/// compiler warning where it is named).
#[tokio::test]
#[allow(deprecated)]
async fn run_watch_still_works() {
    let d = dispatcher();
    let (stop_tx, stop_rx) = watch::channel(false);
    let run = tokio::spawn(d.run_watch(stop_rx));
    stop_tx.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(10), run).await.expect("stops").unwrap().unwrap();
}
