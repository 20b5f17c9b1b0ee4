//! OpenTelemetry end to end, with an in-memory span exporter: a request's
//! span around `emit` -> the stored `traceparent` -> the dispatcher's send
//! span -> the message header -> the consumer's handler span, one trace id
//! throughout. Real PostgreSQL and librdkafka's in-process Kafka cluster.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use outbox_consumer::{async_trait, ConsumedEvent, ConsumerConfig, HandlerError, IdempotentConsumer};
use outbox_core::headers;
use outbox_producer::{emit, Dispatcher, DispatcherConfig, EmitOptions, PgStore};
use outbox_tests::kafka::{read_topic, started};
use outbox_tests::*;
use serde_json::Value;
use sqlx::{PgPool, Postgres, Transaction};
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::layer::SubscriberExt as _;

const TOPIC: &str = "orders";

/// The exporter behind the process-wide subscriber (set once per test binary).
fn exporter() -> &'static InMemorySpanExporter {
    static EXPORTER: OnceLock<(InMemorySpanExporter, SdkTracerProvider)> = OnceLock::new();
    &EXPORTER
        .get_or_init(|| {
            let exporter = InMemorySpanExporter::default();
            let provider = SdkTracerProvider::builder().with_simple_exporter(exporter.clone()).build();
            let subscriber = tracing_subscriber::registry().with(tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-tests")));
            tracing::subscriber::set_global_default(subscriber).expect("one subscriber per test binary");
            (exporter, provider)
        })
        .0
}

/// Records the trace id of the span the handler runs in.
#[derive(Default)]
struct Recorder {
    seen: Mutex<Vec<(String, TraceId, String)>>,
}

#[async_trait]
impl outbox_consumer::Handler for Recorder {
    async fn handle(&self, _tx: &mut Transaction<'_, Postgres>, event: &ConsumedEvent) -> Result<Value, HandlerError> {
        let cx = tracing::Span::current().context();
        let sc = cx.span().span_context().clone();
        self.seen.lock().unwrap().push((event.event_id.as_str().to_owned(), sc.trace_id(), sc.trace_state().header()));
        Ok(serde_json::json!({}))
    }
}

#[sqlx::test(migrator = "outbox_producer::MIGRATOR")]
async fn one_trace_id_from_emit_to_the_consumers_handler_span(pool: PgPool) {
    let exporter = exporter();
    outbox_consumer::migrate(&pool).await.unwrap();
    let (cluster, broker) = started(&pool, TOPIC, 3, 5_000, &[ORDER_CREATED]).await;

    // The service's request span, continuing a caller's trace that carries a
    // tracestate; emit takes its context (no traceparent passed).
    let caller = SpanContext::new(
        TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap(),
        SpanId::from_hex("b7ad6b7169203331").unwrap(),
        TraceFlags::SAMPLED,
        true,
        "vendor=t61rcWkgMzE,other=1".parse::<TraceState>().unwrap(),
    );
    let request = tracing::info_span!("place_order");
    request.set_parent(opentelemetry::Context::new().with_remote_span_context(caller)).unwrap();
    let emitted = create_order(&pool, "o-1", 100).instrument(request.clone()).await;
    let request_cx = request.context().span().span_context().clone();
    assert!(request_cx.is_valid(), "the subscriber gives spans an OpenTelemetry context");
    let trace_id = request_cx.trace_id();
    assert_eq!(trace_id, TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap());
    drop(request);
    let stored: Option<String> =
        sqlx::query_scalar("SELECT traceparent FROM outbox_events WHERE event_id = $1").bind(emitted.event_id().as_str()).fetch_one(&pool).await.unwrap();
    let expected = format!("00-{}-{}-01", trace_id, request_cx.span_id());
    assert_eq!(stored.as_deref(), Some(expected.as_str()));
    let stored: Option<String> =
        sqlx::query_scalar("SELECT tracestate FROM outbox_events WHERE event_id = $1").bind(emitted.event_id().as_str()).fetch_one(&pool).await.unwrap();
    assert_eq!(stored.as_deref(), Some("vendor=t61rcWkgMzE,other=1"));

    // A traceparent the caller passes wins over the span's.
    let given = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let other = async {
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("INSERT INTO orders (id, total_cents) VALUES ('o-2', 1)").execute(&mut *tx).await.unwrap();
        let payload = order_payload("o-2", 1);
        let e = emit(&mut tx, &order_request("create-o-2", "o-2", &payload), &EmitOptions { traceparent: Some(given.into()), ..Default::default() }).await.unwrap();
        tx.commit().await.unwrap();
        e
    }
    .instrument(tracing::info_span!("another_request"))
    .await;
    let stored: Option<String> = sqlx::query_scalar("SELECT traceparent FROM outbox_events WHERE event_id = $1").bind(other.event_id().as_str()).fetch_one(&pool).await.unwrap();
    assert_eq!(stored.as_deref(), Some(given));

    // Dispatch: the header carries the emit's context.
    let d = Dispatcher::new(PgStore::new(pool.clone()), broker, DispatcherConfig { name: "otel".into(), ..Default::default() }).unwrap();
    let r = d.dispatch_once("w1").await.unwrap();
    assert_eq!(r.published, 2, "{r:?}");
    let log = read_topic(&cluster.bootstrap, TOPIC, 3);
    let msg = log.iter().find(|m| m.header(headers::EVENT_ID).as_deref() == Some(emitted.event_id().as_str())).unwrap();
    assert_eq!(msg.header(headers::TRACEPARENT).as_deref(), Some(expected.as_str()));
    assert_eq!(msg.header("tracestate").as_deref(), Some("vendor=t61rcWkgMzE,other=1"));

    // Consume.
    let recorder = Arc::new(Recorder::default());
    let mut config = ConsumerConfig::new("fulfilment", cluster.bootstrap.clone(), &[TOPIC]);
    config.session_timeout_ms = 6_000;
    config.shutdown_timeout_ms = 5_000;
    let consumer = IdempotentConsumer::new(config, pool.clone(), recorder.clone()).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(consumer.run(async move {
        let _ = stopped.await;
    }));
    let deadline = Instant::now() + Duration::from_secs(60);
    while recorder.seen.lock().unwrap().len() < 2 {
        assert!(Instant::now() < deadline, "the consumer did not apply both events");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(30), task).await.unwrap().unwrap().unwrap();
    let seen = recorder.seen.lock().unwrap().clone();
    let in_handler = seen.iter().find(|(id, ..)| id == emitted.event_id().as_str()).unwrap();
    assert_eq!(in_handler.1, trace_id, "the handler runs in the emitting request's trace");
    assert_eq!(in_handler.2, "vendor=t61rcWkgMzE,other=1", "with its tracestate");
    let given_trace = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
    assert_eq!(seen.iter().find(|(id, ..)| id == other.event_id().as_str()).unwrap().1, given_trace);

    // The exported spans: emit's request span, the send span and the handler
    // span of the event share one trace id; send and handler are children of
    // (and linked to) the request span.
    let spans = exporter.get_finished_spans().unwrap();
    let of_trace: Vec<_> = spans.iter().filter(|s| s.span_context.trace_id() == trace_id).collect();
    let names: Vec<&str> = of_trace.iter().map(|s| s.name.as_ref()).collect();
    for want in ["place_order", "outbox_send", "outbox_handle"] {
        assert!(names.contains(&want), "{want} not in the trace: {names:?}");
    }
    for child in of_trace.iter().filter(|s| s.name == "outbox_send" || s.name == "outbox_handle") {
        assert_eq!(child.parent_span_id, request_cx.span_id(), "{} is a child of the emitting span", child.name);
        assert!(child.links.iter().any(|l| l.span_context.span_id() == request_cx.span_id()), "{} links the emitting span", child.name);
    }
    let handle = of_trace.iter().find(|s| s.name == "outbox_handle").unwrap();
    assert!(handle.attributes.iter().any(|kv| kv.key.as_str() == "event_id" && kv.value.as_str() == emitted.event_id().as_str()), "{:?}", handle.attributes);
    assert_ne!(request_cx.span_id(), SpanId::INVALID);
}
