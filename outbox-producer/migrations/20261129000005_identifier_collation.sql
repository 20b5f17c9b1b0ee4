-- Identifiers compare byte by byte.
--
-- Event ids, attempt ids, command keys, cluster ids, topics and routing keys
-- are machine identifiers: their order is their bytes' order. Under a
-- language collation every index comparison of them goes through the
-- locale's collation routine; under "C" it is a memcmp. The dispatcher's
-- per-key head scan and every primary-key probe compare these columns.
--
-- Joining one of these columns to a column of the database's default
-- collation stays valid (the comparison uses "C"); an index on the other
-- side is then only used if it is also "C".
DROP TRIGGER outbox_events_formats_update ON outbox_events;

DO $$
DECLARE c record;
BEGIN
    FOR c IN
        SELECT table_name, string_agg(format('ALTER COLUMN %I TYPE text COLLATE "C"', column_name), ', ') AS alters
        FROM information_schema.columns
        WHERE table_schema = current_schema()
          AND table_name LIKE 'outbox\_%' AND table_name NOT LIKE 'outbox\_consumer\_%'
          AND data_type = 'text'
          AND column_name IN ('event_id', 'attempt_id', 'command_key', 'cluster_id', 'topic', 'routing_key')
        GROUP BY table_name
    LOOP
        EXECUTE format('ALTER TABLE %I %s', c.table_name, c.alters);
    END LOOP;
END $$;

CREATE TRIGGER outbox_events_formats_update BEFORE UPDATE OF event_id, payload_digest, destination_digest, traceparent ON outbox_events
    FOR EACH ROW EXECUTE FUNCTION outbox_check_formats();
