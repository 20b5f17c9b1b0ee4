-- Least-privilege roles for the transactional outbox (protocol version 1).
--
-- Apply AFTER `outbox migrate` (both migration sets), as the owner of the
-- outbox tables, in every database that holds them:
--
--     psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f docs/roles.sql
--
-- It is idempotent (run it again after every upgrade: new tables and functions get their
-- grants) and works in the outbox database, in a consumer's own database, or
-- in one shared database: a grant on a table that does not exist there is
-- skipped. The roles are NOLOGIN groups; give each service a login role of
-- its own and make it a member, e.g.
--
--     CREATE ROLE orders_dispatcher LOGIN PASSWORD '...' IN ROLE outbox_dispatcher;
--
-- Roles (see docs/OPERATIONS.md for who runs what):
--   outbox_app          the service that emits events in its own transactions
--   outbox_dispatcher   `outbox dispatch`: claims, attempts, the receipt transaction
--   outbox_reconciler   `outbox reconcile`: the dispatcher's rights for UNKNOWNs,
--                       plus findings, snapshots, bypass scan cursors, and
--                       applying watermarks published over the broker
--   outbox_operator     `outbox purge`, `outbox migrate-destination`, route
--                       policies and the consumer registry; reads everything
--   outbox_reader       `outbox status`, `trace`, `report`: read-only
--   outbox_consumer     an idempotent consumer: its receipts, watermarks,
--                       quarantine and dead letters; nothing of the outbox
--   outbox_watermark_publisher
--                       copies a consumer's watermarks into the outbox database
--   outbox_consumer_retention
--                       outbox_consumer::purge_receipts_before: deletes old
--                       consumption receipts (a separate job: the consumer
--                       itself can never delete the receipts that make
--                       redeliveries duplicates)
--
-- Nobody but the owner may DELETE outbox evidence: events, envelopes,
-- attempts and receipts are never deleted (retention only clears payloads).
-- The schema (and `outbox migrate`) stays with the owner role.
--
-- Enforced by the database, not by the services' good behaviour:
--   * column-level grants: the dispatcher (and the reconciler) UPDATE only the
--     dispatch columns of outbox_events (state, claim, lease, clocks), never
--     the payload, its digests, the publisher or the frozen destination; only
--     the operator also clears payloads (purge) and moves destinations
--     (migrate-destination); attempts change only in state, detail and end time;
--   * row-level security on outbox_events: the application role inserts only
--     PENDING events that no dispatcher has touched (a new event can never
--     arrive as PUBLISHED, CLAIMED or QUARANTINED). Every role granted
--     here reads and updates through permissive policies; a role of your own
--     that reads outbox_events needs its grants here too (the table owner is
--     not subject to row-level security).
-- A forbidden write fails with SQLSTATE 42501: "permission denied for table
-- ..." or "new row violates row-level security policy".

-- Roles (cluster-wide; created once).
DO $$
DECLARE r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['outbox_app', 'outbox_dispatcher', 'outbox_reconciler', 'outbox_operator',
                             'outbox_reader', 'outbox_consumer', 'outbox_watermark_publisher', 'outbox_consumer_retention'] LOOP
        BEGIN
            EXECUTE format('CREATE ROLE %I NOLOGIN', r);
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL; -- exists already (or was created concurrently)
        END;
    END LOOP;
END $$;

-- grant(role, privileges, table): GRANT if the table exists in this database.
CREATE OR REPLACE FUNCTION pg_temp.outbox_grant(grantee text, privileges text, tbl text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF to_regclass(tbl) IS NOT NULL THEN
        EXECUTE format('GRANT %s ON TABLE %s TO %I', privileges, tbl, grantee);
    END IF;
END $$;

-- Nothing beyond these grants (re-running the file after a change revokes what was dropped).
DO $$
DECLARE t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['outbox_meta', 'outbox_route_policies', 'outbox_states', 'outbox_transitions', 'outbox_events', 'outbox_commands',
                             'outbox_envelopes', 'outbox_attempts', 'outbox_publish_receipts', 'outbox_duplicate_receipts',
                             'outbox_quarantine', 'outbox_audit', 'outbox_consumers', 'outbox_unknown_resolutions',
                             'outbox_findings', 'outbox_scan_cursors', 'outbox_bypass_messages', 'outbox_state_snapshots',
                             'outbox_check_cursors', 'outbox_migration_receipts', 'outbox_consumer_receipts', 'outbox_consumer_watermarks',
                             'outbox_consumer_quarantine', 'outbox_consumer_dead_letters', 'outbox_takeover_policies',
                             'outbox_shadow_attempts', 'outbox_shadow_cursors', 'outbox_shadow_mismatches',
                             'outbox_dispatcher_aliases', 'outbox_dispatcher_alias_history', 'outbox_reconciler_rounds', 'outbox_unknown_lookups', 'outbox_identity',
                             'outbox_watermark_topic_cursors', 'outbox_watermark_publishers', 'outbox_chain_heads', 'outbox_chain_arrivals',
                             'outbox_consumer_readings', 'outbox_consumer_gaps', 'outbox_settings', 'outbox_stream',
                             'outbox_bucket_leases', 'outbox_bucket_slots', 'outbox_bucket_lease_log', 'outbox_batches', 'outbox_batch_steps', 'outbox_poison_policies',
                             'outbox_stream_drops', 'outbox_aggregate_heads'] LOOP
        IF to_regclass(t) IS NOT NULL THEN
            EXECUTE format('REVOKE ALL ON TABLE %s FROM outbox_app, outbox_dispatcher, outbox_reconciler, outbox_operator,
                            outbox_reader, outbox_consumer, outbox_watermark_publisher, outbox_consumer_retention', t);
        END IF;
    END LOOP;
END $$;

-- Everyone who touches outbox_events reads the protocol version and the
-- closed transition table (the transition trigger reads it as the caller).
SELECT pg_temp.outbox_grant(r, 'SELECT', t)
FROM unnest(ARRAY['outbox_app', 'outbox_dispatcher', 'outbox_reconciler', 'outbox_operator', 'outbox_reader']) r,
     unnest(ARRAY['outbox_meta', 'outbox_states', 'outbox_transitions', 'outbox_settings']) t;

-- outbox_app: emit inside the service's own transaction (insert the event and
-- its frozen envelope, read the route policy; a retried command reads its
-- first eventId). No UPDATE: a committed event is the dispatcher's.
SELECT pg_temp.outbox_grant('outbox_app', 'SELECT, INSERT', 'outbox_commands');
-- An emit at REPEATABLE READ or SERIALIZABLE writes its aggregates' head rows.
SELECT pg_temp.outbox_grant('outbox_app', 'SELECT, INSERT, UPDATE', 'outbox_aggregate_heads');
SELECT pg_temp.outbox_grant('outbox_app', 'SELECT, INSERT', 'outbox_events');
SELECT pg_temp.outbox_grant('outbox_app', 'SELECT, INSERT', 'outbox_envelopes');
SELECT pg_temp.outbox_grant('outbox_app', 'SELECT', 'outbox_route_policies');
-- emit freezes who sends the event from the current takeover policy (rollout).
SELECT pg_temp.outbox_grant('outbox_app', 'SELECT', 'outbox_takeover_policies');
-- The insert trigger on outbox_events appends each new ordered event's
-- chain to the arrivals the dispatcher links (insert-only).
SELECT pg_temp.outbox_grant('outbox_app', 'INSERT', 'outbox_chain_arrivals');
-- On the stream path (outbox_settings.dispatch_path = 'stream') emit inserts
-- one stream row per event instead, its seq drawn from outbox_events' sequence.
SELECT pg_temp.outbox_grant('outbox_app', 'SELECT, INSERT', 'outbox_stream');
DO $$
BEGIN
    IF to_regclass('outbox_events_seq_seq') IS NOT NULL THEN
        GRANT USAGE ON SEQUENCE outbox_events_seq_seq TO outbox_app;
    END IF;
END $$;

-- outbox_dispatcher: claim (UPDATE with row locks), register attempts, the
-- receipt transaction, not-sent / unknown reports, lease sweeps, quarantine
-- of divergent events, audit of stale writes. No INSERT or DELETE of events.
-- Only the dispatch columns: never payload, digests, publisher, destination.
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'SELECT', 'outbox_events');
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'UPDATE (state, state_since_ms, claim_owner, claim_generation, lease_until_ms, claim_attempt_id,
                                                          attempt_generation, unknown_since_ms, next_check_at_ms, published_at_ms)', 'outbox_events');
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'SELECT', 'outbox_envelopes');
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'SELECT, INSERT', 'outbox_attempts');
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'UPDATE (state, detail, finished_at_ms)', 'outbox_attempts');
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'SELECT, INSERT', 'outbox_publish_receipts');
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'SELECT, INSERT', 'outbox_duplicate_receipts');
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'SELECT, INSERT', 'outbox_quarantine');
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'INSERT', 'outbox_audit');
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'INSERT', 'outbox_unknown_resolutions');
-- The receipt transaction records evidence findings (absence_proof_refuted,
-- unregistered_message, receipt_position_lost) as it decides: an upsert.
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'SELECT, INSERT, UPDATE', 'outbox_findings');
-- Rollout: a dispatcher under an alias reads it; the shadow dispatcher records
-- the messages it would have sent (and sends nothing).
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'SELECT', 'outbox_dispatcher_aliases');
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'SELECT, INSERT', 'outbox_shadow_attempts');
-- CloudEvents headers: the outbox's source identity and the frozen route
-- generation's switch and content type.
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'SELECT', 'outbox_identity');
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'SELECT', 'outbox_route_policies');
-- Claims read and lock the chain heads; linking arrivals consumes them and
-- inserts heads; the update triggers on outbox_events (claim, receipt
-- transaction, reports, and every writer below that inherits these rights)
-- move heads and re-queue emptied chains.
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'SELECT, INSERT, UPDATE, DELETE', 'outbox_chain_heads');
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'SELECT, INSERT, UPDATE, DELETE', 'outbox_chain_arrivals');
-- The stream path: claims read the stream, hold the buckets' leases (a slot
-- per cluster and bucket, made on first use, locked and never updated; the
-- lease state a log of inserts, pruned by the lease sweep; the view of the
-- newest state), insert a batch per cut and a step per hand-out or
-- registration. An event leaving the happy path is
-- copied into outbox_events by outbox_stream_to_lane (below), never by an
-- insert of the dispatcher's own.
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'SELECT', 'outbox_stream');
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'SELECT', 'outbox_bucket_leases');
-- UPDATE: for the row locks (FOR UPDATE / FOR SHARE) only; the slots refuse updates.
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'SELECT, INSERT, UPDATE', 'outbox_bucket_slots');
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'SELECT, INSERT, DELETE', 'outbox_bucket_lease_log');
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'SELECT, INSERT', 'outbox_batches');
SELECT pg_temp.outbox_grant('outbox_dispatcher', 'SELECT, INSERT', 'outbox_batch_steps');

-- outbox_reconciler: the dispatcher's rights (it resolves UNKNOWNs through
-- the same receipt transaction), plus the three-set comparison and report.
GRANT outbox_dispatcher TO outbox_reconciler;
SELECT pg_temp.outbox_grant('outbox_reconciler', 'SELECT', t)
FROM unnest(ARRAY['outbox_route_policies', 'outbox_poison_policies', 'outbox_consumers', 'outbox_consumer_watermarks', 'outbox_unknown_resolutions',
                  'outbox_audit', 'outbox_migration_receipts',
                  -- the report's quarantines and dead letters per consumer
                  'outbox_consumer_quarantine', 'outbox_consumer_dead_letters']) t;
SELECT pg_temp.outbox_grant('outbox_reconciler', 'SELECT, INSERT, UPDATE', 'outbox_findings');
SELECT pg_temp.outbox_grant('outbox_reconciler', 'SELECT, INSERT, UPDATE', 'outbox_scan_cursors');
-- Watermarks published over the broker: the reconciler applies them.
SELECT pg_temp.outbox_grant('outbox_reconciler', 'SELECT, INSERT, UPDATE', 'outbox_consumer_watermarks');
SELECT pg_temp.outbox_grant('outbox_reconciler', 'SELECT, INSERT, UPDATE', 'outbox_watermark_topic_cursors');
SELECT pg_temp.outbox_grant('outbox_reconciler', 'SELECT, INSERT, UPDATE', 'outbox_watermark_publishers');
-- The sweep for published events without a primary receipt.
SELECT pg_temp.outbox_grant('outbox_reconciler', 'SELECT, INSERT, UPDATE', 'outbox_check_cursors');
SELECT pg_temp.outbox_grant('outbox_reconciler', 'SELECT, INSERT', 'outbox_bypass_messages');
-- The shadow comparison: marks where each shadowed event was seen, its cursors, its mismatches.
SELECT pg_temp.outbox_grant('outbox_reconciler', 'SELECT, INSERT, UPDATE', 'outbox_shadow_attempts');
SELECT pg_temp.outbox_grant('outbox_reconciler', 'SELECT, INSERT, UPDATE', 'outbox_shadow_cursors');
SELECT pg_temp.outbox_grant('outbox_reconciler', 'SELECT, INSERT, UPDATE', 'outbox_shadow_mismatches');
-- Each reconciler records its last round (status and report show it; a stale one is a finding).
SELECT pg_temp.outbox_grant('outbox_reconciler', 'SELECT, INSERT, UPDATE', 'outbox_reconciler_rounds');
-- Its lookups of UNKNOWN events are kept as evidence (`outbox unknown show`).
SELECT pg_temp.outbox_grant('outbox_reconciler', 'SELECT, INSERT', 'outbox_unknown_lookups');
-- Snapshots older than history_keep_ms are deleted: the only DELETE granted on the producer side.
SELECT pg_temp.outbox_grant('outbox_reconciler', 'SELECT, INSERT, DELETE', 'outbox_state_snapshots');

-- outbox_operator: retention (PUBLISHED -> RETAINED -> PURGED clears the
-- payload by UPDATE), destination migration (a new envelope generation and a
-- migration receipt), route policy revisions, the consumer registry, and
-- `outbox skip` (QUARANTINED or DISPATCH_UNKNOWN -> SKIPPED and its
-- outbox_audit row: the dispatcher's state columns and audit INSERT, inherited).
GRANT outbox_reconciler TO outbox_operator;
-- Purge clears the payload; a destination migration re-points the event at
-- its new envelope generation's frozen destination.
SELECT pg_temp.outbox_grant('outbox_operator', 'UPDATE (payload, envelope_generation, destination_digest, cluster_id, topic, partition,
                                                        routing_key, ordered)', 'outbox_events');
SELECT pg_temp.outbox_grant('outbox_operator', 'INSERT', 'outbox_envelopes');
SELECT pg_temp.outbox_grant('outbox_operator', 'SELECT, INSERT', 'outbox_migration_receipts');
SELECT pg_temp.outbox_grant('outbox_operator', 'SELECT, INSERT', 'outbox_route_policies');
-- Route poison policies (`outbox route poison`); the reconciler reads them.
SELECT pg_temp.outbox_grant('outbox_operator', 'SELECT, INSERT', 'outbox_poison_policies');
SELECT pg_temp.outbox_grant('outbox_operator', 'SELECT, INSERT, UPDATE', 'outbox_consumers');
-- `outbox dead-letters requeue` asks the consumer to run a dead letter again (it sets requeue_requested_at_ms).
SELECT pg_temp.outbox_grant('outbox_operator', 'SELECT, UPDATE', 'outbox_consumer_dead_letters');
-- `outbox gaps accept` closes a consumer's gap that cannot be replayed (closed_by, close_reason).
SELECT pg_temp.outbox_grant('outbox_operator', 'SELECT, UPDATE', 'outbox_consumer_gaps');
-- Rollout and rollback: takeover policy generations and the dispatcher alias
-- (its history is append-only).
SELECT pg_temp.outbox_grant('outbox_operator', 'SELECT, INSERT', 'outbox_takeover_policies');
SELECT pg_temp.outbox_grant('outbox_operator', 'SELECT, INSERT, UPDATE', 'outbox_dispatcher_aliases');
SELECT pg_temp.outbox_grant('outbox_operator', 'SELECT, INSERT', 'outbox_dispatcher_alias_history');

-- outbox_reader: everything, read-only (status, trace, report, dashboards).
SELECT pg_temp.outbox_grant('outbox_reader', 'SELECT', t)
FROM unnest(ARRAY['outbox_route_policies', 'outbox_events', 'outbox_commands', 'outbox_envelopes', 'outbox_attempts', 'outbox_publish_receipts',
                  'outbox_duplicate_receipts', 'outbox_quarantine', 'outbox_audit', 'outbox_consumers', 'outbox_unknown_resolutions',
                  'outbox_findings', 'outbox_scan_cursors', 'outbox_bypass_messages', 'outbox_state_snapshots', 'outbox_check_cursors',
                  'outbox_migration_receipts', 'outbox_consumer_receipts', 'outbox_consumer_watermarks',
                  'outbox_consumer_quarantine', 'outbox_consumer_dead_letters', 'outbox_takeover_policies',
                  'outbox_shadow_attempts', 'outbox_shadow_cursors', 'outbox_shadow_mismatches',
                  'outbox_dispatcher_aliases', 'outbox_dispatcher_alias_history', 'outbox_reconciler_rounds', 'outbox_unknown_lookups', 'outbox_identity',
                             'outbox_watermark_topic_cursors', 'outbox_watermark_publishers', 'outbox_chain_heads', 'outbox_chain_arrivals',
                  'outbox_consumer_readings', 'outbox_consumer_gaps', 'outbox_settings', 'outbox_stream', 'outbox_bucket_leases',
                  'outbox_bucket_slots', 'outbox_bucket_lease_log', 'outbox_batches', 'outbox_batch_steps', 'outbox_poison_policies', 'outbox_stream_drops', 'outbox_aggregate_heads']) t;

-- outbox_consumer: its own receipts (the handler's result is written back on
-- the receipt), watermarks, quarantine and dead letters (a redrive deletes
-- the dead letter). No privilege at all on the producer's tables.
SELECT pg_temp.outbox_grant('outbox_consumer', 'SELECT, INSERT, UPDATE', 'outbox_consumer_receipts');
SELECT pg_temp.outbox_grant('outbox_consumer', 'SELECT, INSERT, UPDATE', 'outbox_consumer_watermarks');
SELECT pg_temp.outbox_grant('outbox_consumer', 'SELECT, INSERT', 'outbox_consumer_quarantine');
SELECT pg_temp.outbox_grant('outbox_consumer', 'SELECT, INSERT, UPDATE, DELETE', 'outbox_consumer_dead_letters');
-- Its readings and the gaps in them (outbox_consumer::gap).
SELECT pg_temp.outbox_grant('outbox_consumer', 'SELECT, INSERT, UPDATE', 'outbox_consumer_readings');
SELECT pg_temp.outbox_grant('outbox_consumer', 'SELECT, INSERT, UPDATE', 'outbox_consumer_gaps');

-- outbox_consumer_retention: bounded deletion of receipts older than the replay
-- window and below their partition's committed watermark (which it reads).
SELECT pg_temp.outbox_grant('outbox_consumer_retention', 'SELECT, DELETE', 'outbox_consumer_receipts');
SELECT pg_temp.outbox_grant('outbox_consumer_retention', 'SELECT', 'outbox_consumer_watermarks');

-- outbox_watermark_publisher: outbox_consumer::publish_watermarks into the outbox database.
SELECT pg_temp.outbox_grant('outbox_watermark_publisher', 'SELECT, INSERT, UPDATE', 'outbox_consumer_watermarks');

-- Functions. The outbox's functions (emit's and the consumer's lookups,
-- the checks its triggers and constraints call) run with the caller's
-- rights: executing one gives nothing the caller's table grants do not.
-- Three are SECURITY DEFINER: outbox_stream_to_lane copies stream events into
-- outbox_events as PENDING, only what the stream holds, only once; the
-- dispatcher's roles execute it (below), nobody else. And
-- outbox_stream_partitions_ahead creates and attaches the stream's next
-- partitions (as the schema's owner), and outbox_stream_drop_settled drops
-- those whose events are all in the lane; the operator's retention executes
-- them. PostgreSQL lets PUBLIC execute new functions; a
-- database hardened against that (REVOKE EXECUTE ... FROM PUBLIC, or
-- default privileges) still needs every role to execute them.
DO $$
DECLARE f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
             WHERE p.pronamespace = current_schema()::regnamespace AND p.proname LIKE 'outbox\_%' AND NOT p.prosecdef LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO outbox_app, outbox_dispatcher, outbox_reconciler, outbox_operator,
                        outbox_reader, outbox_consumer, outbox_watermark_publisher, outbox_consumer_retention', f);
    END LOOP;
END $$;

DO $$
BEGIN
    IF to_regprocedure('outbox_stream_to_lane(text[])') IS NOT NULL THEN
        REVOKE EXECUTE ON FUNCTION outbox_stream_to_lane(text[]) FROM PUBLIC;
        GRANT EXECUTE ON FUNCTION outbox_stream_to_lane(text[]) TO outbox_dispatcher, outbox_reconciler, outbox_operator;
    END IF;
    -- Retention's pass keeps the stream's partitions ahead of its sequence.
    IF to_regprocedure('outbox_stream_partitions_ahead(integer)') IS NOT NULL THEN
        REVOKE EXECUTE ON FUNCTION outbox_stream_partitions_ahead(integer) FROM PUBLIC;
        GRANT EXECUTE ON FUNCTION outbox_stream_partitions_ahead(integer) TO outbox_operator;
    END IF;
    -- ... and drops the partitions whose events are all in the lane.
    IF to_regprocedure('outbox_stream_drop_settled(integer)') IS NOT NULL THEN
        REVOKE EXECUTE ON FUNCTION outbox_stream_drop_settled(integer) FROM PUBLIC;
        GRANT EXECUTE ON FUNCTION outbox_stream_drop_settled(integer) TO outbox_operator;
    END IF;
END $$;

-- Row-level security on outbox_events (see the top of this file): reads and
-- updates through permissive policies (the grants above decide who may),
-- inserts only through outbox_app's policy, and only of untouched PENDING events.
DO $$
BEGIN
    IF to_regclass('outbox_events') IS NOT NULL THEN
        ALTER TABLE outbox_events ENABLE ROW LEVEL SECURITY;
        DROP POLICY IF EXISTS outbox_events_read ON outbox_events;
        CREATE POLICY outbox_events_read ON outbox_events FOR SELECT USING (true);
        DROP POLICY IF EXISTS outbox_events_update ON outbox_events;
        CREATE POLICY outbox_events_update ON outbox_events FOR UPDATE USING (true) WITH CHECK (true);
        DROP POLICY IF EXISTS outbox_events_app_inserts_pending ON outbox_events;
        CREATE POLICY outbox_events_app_inserts_pending ON outbox_events FOR INSERT TO outbox_app
            WITH CHECK (state = 'PENDING' AND claim_owner IS NULL AND claim_generation = 0 AND lease_until_ms IS NULL
                        AND claim_attempt_id IS NULL AND attempt_generation = 0 AND envelope_generation = 1
                        AND unknown_since_ms IS NULL AND published_at_ms IS NULL AND payload IS NOT NULL);
    END IF;
END $$;

-- `outbox` commands check that every migration they know is applied.
DO $$
BEGIN
    IF to_regclass('_sqlx_migrations') IS NOT NULL THEN
        EXECUTE 'GRANT SELECT ON TABLE _sqlx_migrations TO outbox_app, outbox_dispatcher, outbox_reconciler, outbox_operator,
                 outbox_reader, outbox_consumer, outbox_watermark_publisher, outbox_consumer_retention';
    END IF;
END $$;

DROP FUNCTION pg_temp.outbox_grant(text, text, text);
