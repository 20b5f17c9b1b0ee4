-- The format checks on inserts into outbox_events run after the row is
-- written, and only for a row that breaks one.
--
-- The BEFORE INSERT trigger called PL/pgSQL once per row; measured with
-- auto_explain during dispatch_bench, that call cost about four foreign-key
-- checks per emitted event. As an AFTER INSERT row trigger with a WHEN
-- condition, the same patterns are matched by the executor as the row is
-- written, and the check function (which raises the same errors) runs only
-- for an offending row, at the end of the statement, which then fails and
-- keeps nothing. outbox_check_formats() itself is unchanged.
DROP TRIGGER outbox_events_formats_insert ON outbox_events;
CREATE TRIGGER outbox_events_formats_insert AFTER INSERT ON outbox_events
    FOR EACH ROW
    WHEN (NEW.event_id !~ '^evt-[0-7][0-9A-HJKMNP-TV-Z]{25}$'
          OR NEW.payload_digest !~ '^sha256:[0-9a-f]{64}$'
          OR NEW.destination_digest !~ '^sha256:[0-9a-f]{64}$'
          OR (NEW.traceparent IS NOT NULL AND NEW.traceparent !~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'))
    EXECUTE FUNCTION outbox_check_formats();
