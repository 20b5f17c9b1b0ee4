-- W3C Trace Context in the schema, for every writer (emit refuses the same
-- values first, with a clearer message): a traceparent of version ff or
-- with an all-zero trace id or parent id, a tracestate without a
-- traceparent, empty, or longer than 512 bytes. The form of the traceparent
-- (55 bytes, lower-case hex, dashes) is checked by outbox_events_formats_*.
--
-- Like the format checks, an AFTER row trigger whose WHEN condition holds
-- only for an offending row: a legal insert evaluates the condition and
-- calls no function; updates that do not touch the two columns skip it.
-- Nothing existing is rewritten or scanned.
CREATE FUNCTION outbox_refuse_trace_context() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'trace context refused for %: traceparent % or a tracestate of % bytes is not valid W3C Trace Context (version ff and all-zero ids are forbidden; a tracestate needs a traceparent and holds 1..512 bytes)',
        NEW.event_id, NEW.traceparent, octet_length(NEW.tracestate)
        USING ERRCODE = 'check_violation';
END $$;

CREATE TRIGGER outbox_events_trace_context AFTER INSERT OR UPDATE OF traceparent, tracestate ON outbox_events
    FOR EACH ROW
    WHEN ((NEW.traceparent IS NOT NULL
           AND (left(NEW.traceparent, 2) = 'ff'
                OR substr(NEW.traceparent, 4, 32) = '00000000000000000000000000000000'
                OR substr(NEW.traceparent, 37, 16) = '0000000000000000'))
          OR (NEW.tracestate IS NOT NULL
              AND (NEW.traceparent IS NULL OR octet_length(NEW.tracestate) NOT BETWEEN 1 AND 512)))
    EXECUTE FUNCTION outbox_refuse_trace_context();
