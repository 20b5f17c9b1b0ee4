-- PUBLISHED, RETAINED and PURGED only with a primary receipt; events are
-- inserted PENDING only (issue 19 item 6).
--
-- The receipt transaction sets PUBLISHED and inserts the primary receipt in
-- one transaction, state first: the check is a constraint trigger deferred
-- to the commit, so it sees both. It is queued only for a row entering one
-- of the three states (the WHEN condition), so claims, registrations and
-- lease renewals queue nothing; a publish costs one probe of the receipts'
-- primary key at commit. Receipts are append-only, so a receipt once there
-- stays there.
CREATE FUNCTION outbox_check_primary_receipt() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    st text;
BEGIN
    -- The row as it is at commit (it may have changed since the update that queued this).
    SELECT e.state INTO st FROM outbox_events e
    WHERE e.event_id = NEW.event_id AND e.state IN ('PUBLISHED', 'RETAINED', 'PURGED')
      AND NOT EXISTS (SELECT 1 FROM outbox_publish_receipts r WHERE r.event_id = e.event_id AND r.envelope_generation = e.envelope_generation);
    IF FOUND THEN
        RAISE EXCEPTION 'outbox event % is % without a primary receipt: only acceptDispatchReceipt publishes', NEW.event_id, st
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END $$;

CREATE CONSTRAINT TRIGGER outbox_events_primary_receipt AFTER UPDATE OF state ON outbox_events
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW
    WHEN (NEW.state IS DISTINCT FROM OLD.state AND NEW.state IN ('PUBLISHED', 'RETAINED', 'PURGED'))
    EXECUTE FUNCTION outbox_check_primary_receipt();

CREATE FUNCTION outbox_check_inserted_pending() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'an outbox event is inserted PENDING, not % (event %)', NEW.state, NEW.event_id USING ERRCODE = 'check_violation';
END $$;

CREATE TRIGGER outbox_events_inserted_pending AFTER INSERT ON outbox_events
    FOR EACH ROW WHEN (NEW.state <> 'PENDING')
    EXECUTE FUNCTION outbox_check_inserted_pending();

-- Where the reconciler's sweep for PUBLISHED, RETAINED or PURGED events
-- without a primary receipt (rows written before this migration, or with
-- triggers disabled) has got to, by event id.
CREATE TABLE outbox_check_cursors (
    check_name     text PRIMARY KEY,
    after_event_id text NOT NULL
);
