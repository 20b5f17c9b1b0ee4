-- The references between the outbox tables that every event writes
-- (event -> command, envelope -> event, attempt -> envelope, receipt ->
-- attempt and envelope) are checked once per statement instead of once
-- per row.
--
-- A foreign key checks each inserted row on its own: one query through
-- SPI, with an executor started and a KEY SHARE lock taken (and written to
-- the WAL) on the referenced row, five times per event. The lock is there
-- so the referenced row cannot be deleted before the insert commits; here
-- no referenced row can be deleted at all (envelopes and commands were
-- append-only already; events and attempts become so below, TRUNCATE is
-- refused on all four, and their identifying columns never change). So
-- what remains of the foreign key is "the referenced row exists when the
-- row is inserted", and one statement-level trigger per table checks it for
-- every row the statement inserted in a single query, one index probe per
-- row. Measured over dispatch_bench runs (--preload, 100,000 events), the
-- per-row checks took about a fifth of the machine's CPU.
--
-- A missing reference is refused as before: SQLSTATE 23503, the same
-- constraint name, the same message, and the whole statement fails. The
-- probes are LATERAL subqueries with LIMIT 1, so they never become a hash
-- join over the whole referenced table, and the check functions plan with
-- enable_seqscan off: a session caches a check's plan, and one made while
-- a table held a handful of rows would otherwise go on scanning it, once
-- per row checked, after it has grown. The checks run with the inserting role's rights,
-- which read the referenced tables already (docs/roles.sql). The
-- difference a tool may see: these references are no longer listed in
-- pg_constraint.

ALTER TABLE outbox_events DROP CONSTRAINT outbox_events_command_fkey;
ALTER TABLE outbox_envelopes DROP CONSTRAINT outbox_envelopes_event_id_fkey;
ALTER TABLE outbox_attempts DROP CONSTRAINT outbox_attempts_event_id_envelope_generation_fkey;
ALTER TABLE outbox_publish_receipts DROP CONSTRAINT outbox_publish_receipts_attempt_id_fkey;
ALTER TABLE outbox_publish_receipts DROP CONSTRAINT outbox_publish_receipts_event_id_envelope_generation_fkey;

-- What PostgreSQL raises for a row whose foreign key finds nothing.
CREATE FUNCTION outbox_missing_reference(tbl text, constraint_name text, key text, referenced text) RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'insert or update on table "%" violates foreign key constraint "%"', tbl, constraint_name
        USING ERRCODE = 'foreign_key_violation', CONSTRAINT = constraint_name, TABLE = tbl,
              DETAIL = format('Key %s is not present in table "%s".', key, referenced);
END $$;

CREATE FUNCTION outbox_events_check_references() RETURNS trigger LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE bad record;
BEGIN
    SELECT n.event_id, n.command_key INTO bad FROM outbox_new_rows n
    LEFT JOIN LATERAL (SELECT true AS found FROM outbox_commands c
                       WHERE c.event_id = n.event_id AND c.command_key = n.command_key LIMIT 1) r ON true
    WHERE r.found IS NULL LIMIT 1;
    IF FOUND THEN
        PERFORM outbox_missing_reference('outbox_events', 'outbox_events_command_fkey',
            format('(event_id, command_key)=(%s, %s)', bad.event_id, bad.command_key), 'outbox_commands');
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER outbox_events_references AFTER INSERT ON outbox_events
    REFERENCING NEW TABLE AS outbox_new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_events_check_references();

CREATE FUNCTION outbox_envelopes_check_references() RETURNS trigger LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE bad record;
BEGIN
    SELECT n.event_id INTO bad FROM outbox_new_rows n
    LEFT JOIN LATERAL (SELECT true AS found FROM outbox_events e WHERE e.event_id = n.event_id LIMIT 1) r ON true
    WHERE r.found IS NULL LIMIT 1;
    IF FOUND THEN
        PERFORM outbox_missing_reference('outbox_envelopes', 'outbox_envelopes_event_id_fkey',
            format('(event_id)=(%s)', bad.event_id), 'outbox_events');
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER outbox_envelopes_references AFTER INSERT ON outbox_envelopes
    REFERENCING NEW TABLE AS outbox_new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_envelopes_check_references();

CREATE FUNCTION outbox_attempts_check_references() RETURNS trigger LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE bad record;
BEGIN
    SELECT n.event_id, n.envelope_generation INTO bad FROM outbox_new_rows n
    LEFT JOIN LATERAL (SELECT true AS found FROM outbox_envelopes v
                       WHERE v.event_id = n.event_id AND v.envelope_generation = n.envelope_generation LIMIT 1) r ON true
    WHERE r.found IS NULL LIMIT 1;
    IF FOUND THEN
        PERFORM outbox_missing_reference('outbox_attempts', 'outbox_attempts_event_id_envelope_generation_fkey',
            format('(event_id, envelope_generation)=(%s, %s)', bad.event_id, bad.envelope_generation), 'outbox_envelopes');
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER outbox_attempts_references AFTER INSERT ON outbox_attempts
    REFERENCING NEW TABLE AS outbox_new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_attempts_check_references();

CREATE FUNCTION outbox_publish_receipts_check_references() RETURNS trigger LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE bad record;
BEGIN
    SELECT n.event_id, n.envelope_generation, n.attempt_id, a.found AS attempt_found INTO bad FROM outbox_new_rows n
    LEFT JOIN LATERAL (SELECT true AS found FROM outbox_attempts x WHERE x.attempt_id = n.attempt_id LIMIT 1) a ON true
    LEFT JOIN LATERAL (SELECT true AS found FROM outbox_envelopes v
                       WHERE v.event_id = n.event_id AND v.envelope_generation = n.envelope_generation LIMIT 1) r ON true
    WHERE a.found IS NULL OR r.found IS NULL LIMIT 1;
    IF FOUND AND bad.attempt_found IS NULL THEN
        PERFORM outbox_missing_reference('outbox_publish_receipts', 'outbox_publish_receipts_attempt_id_fkey',
            format('(attempt_id)=(%s)', bad.attempt_id), 'outbox_attempts');
    ELSIF FOUND THEN
        PERFORM outbox_missing_reference('outbox_publish_receipts', 'outbox_publish_receipts_event_id_envelope_generation_fkey',
            format('(event_id, envelope_generation)=(%s, %s)', bad.event_id, bad.envelope_generation), 'outbox_envelopes');
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER outbox_publish_receipts_references AFTER INSERT ON outbox_publish_receipts
    REFERENCING NEW TABLE AS outbox_new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_publish_receipts_check_references();

-- Referenced rows stay. Events and attempts are updated but never deleted
-- (nothing in the outbox deletes them; retention clears payloads). A row
-- trigger fires only for a row being deleted, so it costs nothing else.
CREATE FUNCTION outbox_never_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'rows of % are never deleted (% refused): other outbox rows refer to them', TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'foreign_key_violation', TABLE = TG_TABLE_NAME;
END $$;
CREATE TRIGGER outbox_events_never_deleted BEFORE DELETE ON outbox_events
    FOR EACH ROW EXECUTE FUNCTION outbox_never_deleted();
CREATE TRIGGER outbox_attempts_never_deleted BEFORE DELETE ON outbox_attempts
    FOR EACH ROW EXECUTE FUNCTION outbox_never_deleted();
CREATE TRIGGER outbox_events_never_truncated BEFORE TRUNCATE ON outbox_events
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_never_deleted();
CREATE TRIGGER outbox_attempts_never_truncated BEFORE TRUNCATE ON outbox_attempts
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_never_deleted();
CREATE TRIGGER outbox_envelopes_never_truncated BEFORE TRUNCATE ON outbox_envelopes
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_never_deleted();
CREATE TRIGGER outbox_commands_never_truncated BEFORE TRUNCATE ON outbox_commands
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_never_deleted();

-- An attempt's identity (its id, which receipts name, and the envelope it
-- names) never changes; the dispatcher's updates never set these columns,
-- so the trigger is not even considered for them.
CREATE FUNCTION outbox_attempt_identity_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'outbox attempt identity is immutable (%)', OLD.attempt_id USING ERRCODE = 'check_violation';
END $$;
CREATE TRIGGER outbox_attempts_identity AFTER UPDATE OF attempt_id, event_id, envelope_generation ON outbox_attempts
    FOR EACH ROW
    WHEN (NEW.attempt_id <> OLD.attempt_id OR NEW.event_id <> OLD.event_id OR NEW.envelope_generation <> OLD.envelope_generation)
    EXECUTE FUNCTION outbox_attempt_identity_changed();
