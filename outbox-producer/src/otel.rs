//! OpenTelemetry trace context between `tracing` spans and the events'
//! W3C `traceparent` (feature `otel`, on by default; it reads the context
//! that a `tracing_opentelemetry` layer attaches to spans, and finds none
//! without such a layer).

/// The current span's context as a `traceparent` and its `tracestate`
/// (when not empty and valid), when the context is a valid one.
#[cfg(feature = "otel")]
pub fn current_trace_context() -> Option<(String, Option<String>)> {
    use opentelemetry::trace::TraceContextExt as _;
    use outbox_core::trace_context::TraceParent;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let cx = tracing::Span::current().context();
    let span = cx.span();
    let sc = span.span_context();
    if !sc.is_valid() {
        return None;
    }
    let tp = TraceParent { version: 0, trace_id: sc.trace_id().to_bytes(), parent_id: sc.span_id().to_bytes(), flags: sc.trace_flags().to_u8() };
    let state = sc.trace_state().header();
    let state = Some(state).filter(|s| !s.is_empty() && outbox_core::trace_context::validate_tracestate(s).is_ok());
    Some((tp.to_string(), state))
}

/// Without the `otel` feature there is no span context to read.
#[cfg(not(feature = "otel"))]
pub fn current_trace_context() -> Option<(String, Option<String>)> {
    None
}

/// Makes `span` a child of the remote context `traceparent` (with
/// `tracestate`; and links it to it), so the dispatcher's send span belongs
/// to the trace that emitted the event. Does nothing for a missing or
/// invalid value.
#[cfg(feature = "otel")]
pub fn follow_traceparent(span: &tracing::Span, traceparent: Option<&str>, tracestate: Option<&str>) {
    use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState};
    use outbox_core::trace_context::TraceParent;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    let Some(tp) = traceparent.and_then(|t| TraceParent::parse(t).ok()) else {
        return;
    };
    let state = tracestate.and_then(|t| t.parse::<TraceState>().ok()).unwrap_or_default();
    let sc = SpanContext::new(TraceId::from_bytes(tp.trace_id), SpanId::from_bytes(tp.parent_id), TraceFlags::new(tp.flags), true, state);
    span.add_link(sc.clone());
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(sc));
}

/// Without the `otel` feature, spans are left as they are.
#[cfg(not(feature = "otel"))]
pub fn follow_traceparent(_span: &tracing::Span, _traceparent: Option<&str>, _tracestate: Option<&str>) {}
