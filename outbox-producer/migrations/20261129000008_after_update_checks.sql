-- The checks on updates of outbox_events run after the row is written, and
-- only for rows that break a rule.
--
-- A BEFORE UPDATE row trigger makes PostgreSQL lock each row before the
-- trigger sees it (GetTupleForTrigger): one tuple lock, written to the WAL,
-- for every row updated, even by statements that had not locked the row
-- themselves (registering an attempt), and one PL/pgSQL call per row. The
-- same rules as AFTER UPDATE row triggers with a WHEN condition cost neither
-- for a legal update: the condition is evaluated as the row is written and
-- an event is queued only for an offending row, whose check function then
-- raises at the end of the statement. The statement fails as before, with
-- the same errors, and nothing it wrote stays.
DROP TRIGGER outbox_events_transition ON outbox_events;
CREATE TRIGGER outbox_events_transition AFTER UPDATE ON outbox_events
    FOR EACH ROW
    WHEN ((OLD.state IS DISTINCT FROM NEW.state AND NOT outbox_transition_allowed(OLD.state, NEW.state))
          OR NEW.event_id <> OLD.event_id OR NEW.command_key <> OLD.command_key OR NEW.seq <> OLD.seq
          OR NEW.payload_digest <> OLD.payload_digest
          OR NEW.claim_generation < OLD.claim_generation OR NEW.attempt_generation < OLD.attempt_generation
          OR NEW.envelope_generation < OLD.envelope_generation)
    EXECUTE FUNCTION outbox_check_transition();

DROP TRIGGER outbox_events_formats_update ON outbox_events;
CREATE TRIGGER outbox_events_formats_update AFTER UPDATE OF event_id, payload_digest, destination_digest, traceparent ON outbox_events
    FOR EACH ROW
    WHEN (NEW.event_id IS DISTINCT FROM OLD.event_id OR NEW.payload_digest IS DISTINCT FROM OLD.payload_digest
          OR NEW.destination_digest IS DISTINCT FROM OLD.destination_digest OR NEW.traceparent IS DISTINCT FROM OLD.traceparent)
    EXECUTE FUNCTION outbox_check_formats();
