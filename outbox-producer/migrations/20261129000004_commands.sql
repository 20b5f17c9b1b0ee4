-- Command keys and aggregate versions move to an insert-only table.
--
-- Every dispatch step (claim, attempt registration, receipt) writes a new
-- version of the event row, and each new version is entered into every full
-- index of outbox_events. The command-key unique index and the aggregate index
-- are only read at emit time, yet they were rewritten three times per event,
-- with a uniqueness check each time. Here they are written once.
CREATE TABLE outbox_commands (
    command_key       text PRIMARY KEY,
    event_id          text NOT NULL,
    tenant            text NOT NULL,
    aggregate_type    text NOT NULL,
    aggregate_id      text NOT NULL,
    aggregate_version bigint NOT NULL CHECK (aggregate_version >= 0)
);
INSERT INTO outbox_commands (command_key, event_id, tenant, aggregate_type, aggregate_id, aggregate_version)
SELECT command_key, event_id, tenant, aggregate_type, aggregate_id, aggregate_version FROM outbox_events;
-- emit's "aggregate versions never go backwards" check.
CREATE INDEX outbox_commands_aggregate ON outbox_commands (tenant, aggregate_type, aggregate_id, aggregate_version);
CREATE TRIGGER outbox_commands_frozen BEFORE UPDATE OR DELETE ON outbox_commands
    FOR EACH ROW EXECUTE FUNCTION outbox_frozen();

-- outbox_events keeps its command_key column (immutable, checked by the
-- transition trigger); uniqueness is outbox_commands' primary key.
ALTER TABLE outbox_events DROP CONSTRAINT outbox_events_command_key_key;
DROP INDEX outbox_events_aggregate;

-- Room on each page for the next version of a row. An event row is rewritten
-- three times on its way to PUBLISHED and an attempt row once (SENDING ->
-- ACKED); with free space the new version stays on the same page (for
-- attempts, whose state is not indexed, as a heap-only update).
ALTER TABLE outbox_events SET (fillfactor = 75);
ALTER TABLE outbox_attempts SET (fillfactor = 70);
