//! The trace context a message carries (W3C `traceparent` and `tracestate`
//! headers), extracted into the handler's span (feature `otel`, on by
//! default; it takes effect where a `tracing_opentelemetry` layer is installed).

/// The W3C `tracestate` header name.
pub const TRACESTATE: &str = "tracestate";

/// Makes `span` a child of the remote context in `traceparent` (with
/// `tracestate`), and links it to it. A missing or invalid `traceparent`
/// (per W3C Trace Context) leaves the span as it is; an invalid
/// `tracestate` is dropped.
#[cfg(feature = "otel")]
pub fn follow_traceparent(span: &tracing::Span, traceparent: Option<&[u8]>, tracestate: Option<&[u8]>) {
    use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState};
    use outbox_core::trace_context::{validate_tracestate, TraceParent};
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let Some(tp) = traceparent.and_then(|t| std::str::from_utf8(t).ok()).and_then(|t| TraceParent::parse(t).ok()) else {
        return;
    };
    let state = tracestate
        .and_then(|t| std::str::from_utf8(t).ok())
        .filter(|t| validate_tracestate(t).is_ok())
        .and_then(|t| t.parse::<TraceState>().ok())
        .unwrap_or_default();
    let sc = SpanContext::new(TraceId::from_bytes(tp.trace_id), SpanId::from_bytes(tp.parent_id), TraceFlags::new(tp.flags), true, state);
    span.add_link(sc.clone());
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(sc));
}

/// Without the `otel` feature, spans are left as they are.
#[cfg(not(feature = "otel"))]
pub fn follow_traceparent(_span: &tracing::Span, _traceparent: Option<&[u8]>, _tracestate: Option<&[u8]>) {}
