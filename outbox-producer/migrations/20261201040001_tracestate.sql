-- W3C `tracestate` recorded at emit alongside `traceparent`, sent as the
-- `tracestate` header. Adding a nullable column without a default changes
-- only the catalog: no table rewrite, no long lock. Its form and length
-- (at most 512 bytes, 32 members) are checked by emit
-- (outbox_core::trace_context::validate_tracestate).
ALTER TABLE outbox_events ADD COLUMN tracestate text;
