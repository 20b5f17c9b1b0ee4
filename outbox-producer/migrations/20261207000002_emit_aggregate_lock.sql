-- emit's "aggregate versions never go backwards" check holds under
-- concurrency: outbox_emit_lookup takes a transaction-scoped advisory lock
-- per aggregate of the batch before it reads the aggregates' last versions.
--
-- Before, emit read the last version and inserted its event with no lock
-- between: two transactions emitting for one aggregate at READ COMMITTED
-- each read the version before the other's uncommitted insert, both passed
-- the check, and one committed a version below the other's (in commit order,
-- or in seq order, which is the order the aggregate's chain is delivered in).
-- Now the second waits at the lock until the first ends, then reads with a
-- fresh snapshot (a VOLATILE function takes one per statement at READ
-- COMMITTED) and is decided against the first's committed version.
--
-- Why an advisory lock and not a row lock on a per-aggregate head row: the
-- lock lives in shared memory and is released at commit or rollback; it
-- writes nothing (no heap tuple, no index entry, no WAL, nothing to vacuum),
-- where a head row would cost every emit an upsert of one more row per
-- aggregate: a new row version, its WAL and index upkeep, on the hot path.
-- It is taken inside the lookup emit already runs, so it adds no round trip.
-- The locks of a batch are taken in key order, so two batches over the same
-- aggregates in any orders wait for each other instead of deadlocking. The
-- key is a 64-bit hash of the length-prefixed (tenant, type, id) under an
-- `outbox_aggregate:` prefix (the route policies' lock uses another
-- prefix); two aggregates whose keys collide (odds ~2^-64 per pair) only
-- wait for each other.
--
-- Isolation: at READ COMMITTED (the default) the check now holds. At
-- SERIALIZABLE the database's own conflict detection refuses one of two such
-- transactions (both read the aggregate's versions and wrote one). At
-- REPEATABLE READ the reads use the transaction's snapshot, taken before
-- the lock, so a version committed after that snapshot is not seen: only a
-- row both transactions write (the head row above) would turn that into a
-- serialization failure, and it is not taken here.
--
-- Everything else is as in section 6 of the schema (enable_seqscan off,
-- generic plans, the schema's search_path); grants on the function are kept.
CREATE OR REPLACE FUNCTION outbox_emit_lookup(p_keys text[], p_tenants text[], p_aggregate_types text[], p_aggregate_ids text[],
                                              OUT existing text[], OUT last_versions bigint[])
    LANGUAGE plpgsql VOLATILE
    SET enable_seqscan = off
    SET plan_cache_mode = force_generic_plan
    SET search_path FROM CURRENT
AS $$
BEGIN
    -- One lock per distinct aggregate, in key order (the subquery's ORDER BY
    -- keeps it from being flattened: the locks are taken in that order).
    PERFORM pg_advisory_xact_lock(l.k)
    FROM (SELECT DISTINCT hashtextextended('outbox_aggregate:' || length(a.tenant) || ':' || a.tenant
                                           || length(a.aggregate_type) || ':' || a.aggregate_type || a.aggregate_id, 0) AS k
          FROM UNNEST(p_tenants, p_aggregate_types, p_aggregate_ids) AS a(tenant, aggregate_type, aggregate_id)
          ORDER BY 1) l;
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
