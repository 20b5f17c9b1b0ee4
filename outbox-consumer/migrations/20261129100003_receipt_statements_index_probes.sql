-- The consumer's statements over the receipts of a batch (storing the
-- handlers' results, reading the receipts of redelivered events) run in
-- functions that plan with enable_seqscan off and a generic plan.
--
-- A session caches the plan of a statement it runs often. One planned
-- while outbox_consumer_receipts held a handful of analyzed rows (as
-- autovacuum leaves a young table) joined a batch to the receipts by
-- reading the whole table, and kept doing so, once per batch, as the table
-- grew (it keeps every receipt until purge): measured, 30 batches of 200
-- events read it 30 times. Every lookup here is a probe of the primary key
-- (consumer_id, event_id), so the setting costs nothing where statistics
-- are current. Generic plans (plan_cache_mode) are planned once per
-- session, where PostgreSQL would otherwise re-plan on every call for the
-- array parameters.
--
-- The functions run with the caller's rights, in the caller's transaction,
-- and read the schema they were created in whatever the caller's
-- search_path.

CREATE FUNCTION outbox_consumer_store_results(p_consumer_id text, p_event_ids text[], p_results jsonb[]) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET enable_seqscan = off
    SET plan_cache_mode = force_generic_plan
    SET search_path FROM CURRENT
AS $$
BEGIN
    UPDATE outbox_consumer_receipts r SET result = u.result
    FROM UNNEST(p_event_ids, p_results) AS u(event_id, result)
    WHERE r.consumer_id = p_consumer_id AND r.event_id = u.event_id;
END
$$;

CREATE FUNCTION outbox_consumer_receipts_of(p_consumer_id text, p_event_ids text[]) RETURNS SETOF outbox_consumer_receipts
    LANGUAGE plpgsql STABLE
    SET enable_seqscan = off
    SET plan_cache_mode = force_generic_plan
    SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN QUERY SELECT * FROM outbox_consumer_receipts r WHERE r.consumer_id = p_consumer_id AND r.event_id = ANY (p_event_ids);
END
$$;
