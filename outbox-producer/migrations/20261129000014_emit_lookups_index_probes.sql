-- emit's lookups in outbox_commands (which command keys exist, the last
-- version of each aggregate, the committed events of retried keys) run in
-- functions that plan with enable_seqscan off, as the reference checks of
-- migration 20261129000012 do.
--
-- A session caches the plan of a statement it runs often. One planned
-- while outbox_commands held a handful of analyzed rows (autovacuum
-- analyzes a young table after its first fifty rows; a deployment that
-- starts at full traffic grows it by a million before the next analyze)
-- read the table from end to end once per key and once per aggregate:
-- measured, 12,001 sequential scans for 6,000 events, each longer than the
-- one before. Every lookup here has an index that answers it in one
-- descent (the primary keys, outbox_commands_aggregate), so the setting
-- costs nothing where statistics are current.
--
-- Their plans are generic (plan_cache_mode): planned once per session, as
-- a statement without parameters is. Left to choose, PostgreSQL kept
-- planning these afresh on every call for their array parameters, which
-- took a single-event emit's lookup from about 70 to about 190 us.
--
-- The functions are STABLE: they read with the snapshot of the statement
-- that calls them, as the statements they replace did, at any isolation
-- level. They run with the caller's rights and read the schema they were
-- created in, whatever the caller's search_path.

CREATE FUNCTION outbox_emit_lookup(p_keys text[], p_tenants text[], p_aggregate_types text[], p_aggregate_ids text[],
                                   OUT existing text[], OUT last_versions bigint[])
    LANGUAGE plpgsql STABLE
    SET enable_seqscan = off
    SET plan_cache_mode = force_generic_plan
    SET search_path FROM CURRENT
AS $$
BEGIN
    -- The keys of p_keys that have a command row, one primary-key probe each.
    existing := ARRAY(SELECT k.key FROM UNNEST(p_keys) AS k(key)
                      CROSS JOIN LATERAL (SELECT 1 FROM outbox_commands c WHERE c.command_key = k.key LIMIT 1) hit);
    -- For each (tenant, type, id) in order, the highest version emitted, or
    -- NULL: one descent of outbox_commands_aggregate each.
    last_versions := ARRAY(SELECT m.v
                           FROM UNNEST(p_tenants, p_aggregate_types, p_aggregate_ids) WITH ORDINALITY AS a(tenant, aggregate_type, aggregate_id, ord)
                           CROSS JOIN LATERAL (SELECT max(c.aggregate_version) AS v FROM outbox_commands c
                                               WHERE c.tenant = a.tenant AND c.aggregate_type = a.aggregate_type
                                                 AND c.aggregate_id = a.aggregate_id) m
                           ORDER BY a.ord);
END
$$;

CREATE FUNCTION outbox_emit_committed(p_keys text[])
    RETURNS TABLE (command_key text, envelope_canonical bytea, destination_canonical bytea, destination_digest text, publisher text)
    LANGUAGE plpgsql STABLE
    SET enable_seqscan = off
    SET plan_cache_mode = force_generic_plan
    SET search_path FROM CURRENT
AS $$
BEGIN
    -- The first envelope and the publisher of each key's event: a
    -- primary-key probe in each of the three tables per key. Each probe is
    -- a LATERAL subquery with LIMIT 1, so that none can become a join that
    -- reads a table's index from end to end (with sequential scans off, a
    -- plan made on tiny tables merge-joined whole indexes instead).
    RETURN QUERY
        SELECT k.key, v.envelope_canonical, v.destination_canonical, v.destination_digest, e.publisher
        FROM UNNEST(p_keys) AS k(key)
        CROSS JOIN LATERAL (SELECT c.event_id FROM outbox_commands c WHERE c.command_key = k.key LIMIT 1) c
        CROSS JOIN LATERAL (SELECT x.publisher FROM outbox_events x WHERE x.event_id = c.event_id LIMIT 1) e
        CROSS JOIN LATERAL (SELECT y.envelope_canonical, y.destination_canonical, y.destination_digest FROM outbox_envelopes y
                            WHERE y.event_id = c.event_id AND y.envelope_generation = 1 LIMIT 1) v;
END
$$;
