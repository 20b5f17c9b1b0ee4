-- The format checks on every insert, written without counted repetition.
--
-- PostgreSQL's regular expressions expand a counted repetition such as
-- `[0-9a-f]{64}` into one automaton state per repetition, and matching
-- such a pattern costs several microseconds per value: profiled with
-- perf during dispatch_bench, the insert trigger's conditions on
-- outbox_events (event id and two digests) and the attempt id CHECK were
-- about 8% of the machine's CPU. Each check below is the same condition
-- written as a length test plus a pattern with `*`: every character the
-- pattern admits is one byte, so "the pattern matches and the value has
-- exactly N bytes" holds for exactly the values the counted pattern
-- matched (the traceparent's dashes are pinned by position). The same
-- checks run 4-8 times faster. outbox_check_formats(), which raises the
-- error for an offending row, keeps the counted patterns.
--
-- A test evaluates the conditions installed here against the counted
-- patterns on generated and mutated values.
DROP TRIGGER outbox_events_formats_insert ON outbox_events;
CREATE TRIGGER outbox_events_formats_insert AFTER INSERT ON outbox_events
    FOR EACH ROW
    WHEN (octet_length(NEW.event_id) <> 30 OR NEW.event_id !~ '^evt-[0-7][0-9A-HJKMNP-TV-Z]*$'
          OR octet_length(NEW.payload_digest) <> 71 OR NEW.payload_digest !~ '^sha256:[0-9a-f]*$'
          OR octet_length(NEW.destination_digest) <> 71 OR NEW.destination_digest !~ '^sha256:[0-9a-f]*$'
          OR (NEW.traceparent IS NOT NULL
              AND (octet_length(NEW.traceparent) <> 55 OR NEW.traceparent !~ '^[0-9a-f]*-[0-9a-f]*-[0-9a-f]*-[0-9a-f]*$'
                   OR substr(NEW.traceparent, 3, 1) <> '-' OR substr(NEW.traceparent, 36, 1) <> '-'
                   OR substr(NEW.traceparent, 53, 1) <> '-')))
    EXECUTE FUNCTION outbox_check_formats();

-- Added NOT VALID: the rows already there were checked by the constraint it
-- replaces, which admits the same values, so nothing is scanned and the
-- table is locked only for the catalogue change. New and updated rows are
-- checked as before. `ALTER TABLE outbox_attempts VALIDATE CONSTRAINT
-- outbox_attempts_attempt_id_format` marks it validated if wanted (it reads
-- the table under a lock that lets writes go on).
ALTER TABLE outbox_attempts DROP CONSTRAINT outbox_attempts_attempt_id_check;
ALTER TABLE outbox_attempts ADD CONSTRAINT outbox_attempts_attempt_id_format
    CHECK (octet_length(attempt_id) = 30 AND attempt_id ~ '^att-[0-7][0-9A-HJKMNP-TV-Z]*$') NOT VALID;
