-- The outbox schema (producer side), protocol version 1.
--
-- The whole schema in one file: tables, indexes, functions, triggers and
-- seed rows, each in its final form.
--
-- Invariants held by the database itself, whatever the caller does:
--   * one event per eventId and one eventId per command idempotency key;
--   * one publish slot per (eventId, envelopeGeneration), one event per log
--     position;
--   * frozen envelopes and destinations are never updated;
--   * an event's state moves only along the closed transition table.
--
-- Sections:
--    1. Shared trigger functions
--    2. Event states and the transition table
--    3. Commands: one event per command key
--    4. Events
--    5. Envelopes: frozen envelopes and destinations
--    6. Emit lookups
--    7. Claims: ordering-chain heads
--    8. Attempts
--    9. Receipts
--   10. Quarantine and audit
--   11. Reconciler: UNKNOWN resolutions, findings, rounds and scans
--   12. Routes
--   13. Rollout: takeover, shadow mode, dispatcher alias
--   14. Destination migrations
--   15. Consumer registry and watermarks
--   16. Protocol version and source identity
--
-- Machine identifiers (event ids, attempt ids, command keys, cluster ids,
-- topics, routing keys) of the dispatch, receipt, reconciler and rollout
-- tables are `COLLATE "C"`: their order is their bytes' order, so every
-- index comparison of them is a memcmp, not a call to the locale's
-- collation routine. The dispatcher's per-key head scan and every
-- primary-key probe compare these columns. Joining such a column to one of
-- the default collation stays valid (the comparison uses "C"); an index on
-- the other side is then only used if it is also "C". Not every identifier
-- column is "C" (outbox_chain_heads, outbox_unknown_lookups, the watermark
-- tables and outbox_route_policies.topic_id, for example, use the
-- database's default): each table says which of its columns are.


-- =========================================================================
-- 1. Shared trigger functions
-- =========================================================================

-- Append-only tables refuse every UPDATE and DELETE.
CREATE FUNCTION outbox_frozen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only', TG_TABLE_NAME USING ERRCODE = 'check_violation';
END $$;

-- Referenced rows stay. Events and attempts are updated but never deleted
-- (nothing in the outbox deletes them; retention clears payloads), and
-- TRUNCATE is refused on every table other rows refer to. A row trigger
-- fires only for a row being deleted, so it costs nothing else.
CREATE FUNCTION outbox_never_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'rows of % are never deleted (% refused): other outbox rows refer to them', TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'foreign_key_violation', TABLE = TG_TABLE_NAME;
END $$;

-- The references between the tables every event writes (event -> command,
-- envelope -> event, attempt -> envelope, receipt -> attempt and envelope)
-- are not foreign keys but statement-level triggers (the *_references
-- triggers below), one per table.
--
-- A foreign key checks each inserted row on its own: one query through SPI,
-- with an executor started and a KEY SHARE lock taken (and written to the
-- WAL) on the referenced row, five times per event. The lock is there so
-- the referenced row cannot be deleted before the insert commits; here no
-- referenced row can be deleted at all (envelopes and commands are
-- append-only, events and attempts are never deleted, TRUNCATE is refused
-- on all four, and their identifying columns never change). So what remains
-- of the foreign key is "the referenced row exists when the row is
-- inserted", and one statement-level trigger per table checks it for every
-- row the statement inserted in a single query, one index probe per row.
-- Measured over dispatch_bench runs (--preload, 100,000 events), per-row
-- checks took about a fifth of the machine's CPU.
--
-- A missing reference is refused as by a foreign key: SQLSTATE 23503, the
-- constraint name a foreign key would have, the same message, and the whole
-- statement fails. The probes are LATERAL subqueries with LIMIT 1, so they
-- never become a hash join over the whole referenced table, and the check
-- functions plan with enable_seqscan off: a session caches a check's plan,
-- and one made while a table held a handful of rows would otherwise go on
-- scanning it, once per row checked, after it has grown. The checks run
-- with the inserting role's rights, which read the referenced tables
-- already (docs/roles.sql), and look the tables up in the schema this file
-- ran in (search_path FROM CURRENT), whatever the caller's search_path: a
-- session without the outbox schema on it (pg_dump's restore scripts set it
-- empty) would otherwise fail with "relation does not exist", and one with
-- a schema of its own ahead of the outbox's could satisfy a check with a
-- table of that name. What a tool may see: these references are not listed
-- in pg_constraint.

-- What PostgreSQL raises for a row whose foreign key finds nothing.
CREATE FUNCTION outbox_missing_reference(tbl text, constraint_name text, key text, referenced text) RETURNS void
    LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'insert or update on table "%" violates foreign key constraint "%"', tbl, constraint_name
        USING ERRCODE = 'foreign_key_violation', CONSTRAINT = constraint_name, TABLE = tbl,
              DETAIL = format('Key %s is not present in table "%s".', key, referenced);
END $$;


-- =========================================================================
-- 2. Event states and the transition table
-- =========================================================================

CREATE TABLE outbox_states (
    state text PRIMARY KEY
);
INSERT INTO outbox_states (state) VALUES
    ('PENDING'), ('CLAIMED'), ('SENDING'), ('PUBLISHED'), ('RETAINED'), ('PURGED'),
    ('DISPATCH_UNKNOWN'), ('RECONCILING'), ('RETRY_CLAIMED'), ('QUARANTINED'), ('SKIPPED');

-- The closed transition table; outbox-core's TRANSITIONS is checked against it by a test.
CREATE TABLE outbox_transitions (
    from_state text NOT NULL REFERENCES outbox_states,
    to_state   text NOT NULL REFERENCES outbox_states,
    PRIMARY KEY (from_state, to_state)
);
INSERT INTO outbox_transitions (from_state, to_state) VALUES
    ('PENDING', 'CLAIMED'), ('PENDING', 'QUARANTINED'),
    ('CLAIMED', 'SENDING'), ('CLAIMED', 'PENDING'), ('CLAIMED', 'QUARANTINED'),
    ('SENDING', 'PUBLISHED'), ('SENDING', 'DISPATCH_UNKNOWN'), ('SENDING', 'PENDING'), ('SENDING', 'QUARANTINED'),
    ('DISPATCH_UNKNOWN', 'RECONCILING'), ('DISPATCH_UNKNOWN', 'PUBLISHED'), ('DISPATCH_UNKNOWN', 'QUARANTINED'),
    ('RECONCILING', 'PUBLISHED'), ('RECONCILING', 'RETRY_CLAIMED'), ('RECONCILING', 'DISPATCH_UNKNOWN'),
    ('RECONCILING', 'PENDING'), ('RECONCILING', 'QUARANTINED'),
    ('RETRY_CLAIMED', 'SENDING'), ('RETRY_CLAIMED', 'PUBLISHED'), ('RETRY_CLAIMED', 'DISPATCH_UNKNOWN'),
    ('RETRY_CLAIMED', 'QUARANTINED'),
    ('PUBLISHED', 'RETAINED'), ('RETAINED', 'PURGED'),
    -- An operator's skip (`outbox skip`): the way out of a blocked key.
    ('QUARANTINED', 'SKIPPED'), ('DISPATCH_UNKNOWN', 'SKIPPED'),
    -- An operator's re-send (`outbox migrate-destination`) of a quarantined
    -- event nothing of which is in any log: a new envelope generation only.
    ('QUARANTINED', 'PENDING');

-- The closed transition table, enforced on every state change. The list is
-- the outbox_transitions table's (a test checks both against outbox-core);
-- it is inlined here so the check costs no query per row.
CREATE FUNCTION outbox_transition_allowed(from_state text, to_state text) RETURNS boolean
    LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT (from_state || '>' || to_state) = ANY (ARRAY[
        'PENDING>CLAIMED', 'PENDING>QUARANTINED',
        'CLAIMED>SENDING', 'CLAIMED>PENDING', 'CLAIMED>QUARANTINED',
        'SENDING>PUBLISHED', 'SENDING>DISPATCH_UNKNOWN', 'SENDING>PENDING', 'SENDING>QUARANTINED',
        'DISPATCH_UNKNOWN>RECONCILING', 'DISPATCH_UNKNOWN>PUBLISHED', 'DISPATCH_UNKNOWN>QUARANTINED',
        'RECONCILING>PUBLISHED', 'RECONCILING>RETRY_CLAIMED', 'RECONCILING>DISPATCH_UNKNOWN',
        'RECONCILING>PENDING', 'RECONCILING>QUARANTINED',
        'RETRY_CLAIMED>SENDING', 'RETRY_CLAIMED>PUBLISHED', 'RETRY_CLAIMED>DISPATCH_UNKNOWN', 'RETRY_CLAIMED>QUARANTINED',
        'PUBLISHED>RETAINED', 'RETAINED>PURGED',
        'QUARANTINED>SKIPPED', 'DISPATCH_UNKNOWN>SKIPPED', 'QUARANTINED>PENDING'])
$$;


-- =========================================================================
-- 3. Commands: one event per command key
-- =========================================================================

-- Command keys and aggregate versions, in an insert-only table. They are
-- only read at emit time, so they are not indexed on outbox_events, whose
-- every dispatch step (claim, attempt registration, receipt) writes a new
-- row version into each of its full indexes: here they are written once.
--
-- One event per command key, held by the database for every writer, not
-- only for emit: each event row names its command row (checked once, at
-- insert, by outbox_events_references; the columns never change), and a
-- command row names exactly one event (outbox_commands_event_key).
CREATE TABLE outbox_commands (
    command_key       text COLLATE "C" PRIMARY KEY,
    event_id          text COLLATE "C" NOT NULL,
    tenant            text NOT NULL,
    aggregate_type    text NOT NULL,
    aggregate_id      text NOT NULL,
    aggregate_version bigint NOT NULL CHECK (aggregate_version >= 0),
    CONSTRAINT outbox_commands_event_key UNIQUE (event_id, command_key)
);
-- emit's "aggregate versions never go backwards" check.
CREATE INDEX outbox_commands_aggregate ON outbox_commands (tenant, aggregate_type, aggregate_id, aggregate_version);
CREATE TRIGGER outbox_commands_frozen BEFORE UPDATE OR DELETE ON outbox_commands
    FOR EACH ROW EXECUTE FUNCTION outbox_frozen();
CREATE TRIGGER outbox_commands_never_truncated BEFORE TRUNCATE ON outbox_commands
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_never_deleted();


-- =========================================================================
-- 4. Events
-- =========================================================================

-- One row per event: its identity, its current state and claim, and copies
-- of its current frozen destination.
--
-- fillfactor 60: room on each page for the versions a row's updates write.
-- An event row is written four times (insert, claim, registration,
-- publish); with free space more of those versions land on their own page,
-- where PostgreSQL needs neither a free-space-map search nor the tuple lock
-- it WAL-logs before moving a row to another page. Measured by pg_waldump
-- over a 20,000-event dispatch_bench run, per event, with this table at 60
-- and outbox_attempts at 50 against 75 and 70: index entries 17.7 against
-- 19.0, heap-only updates 1.41 against 0.78, tuple locks 8.1 against 9.4,
-- WAL 6.6 against 6.9 kB. The price is space: the table takes about 1/0.6
-- of its packed size (`outbox purge` shrinks the payload, not the row
-- count).
CREATE TABLE outbox_events (
    seq                 bigint GENERATED ALWAYS AS IDENTITY,
    -- Formats of event_id, digests and traceparent are checked by the
    -- outbox_events_formats trigger at insert (and on change): a CHECK would be
    -- re-evaluated on each of the row's state updates.
    event_id            text COLLATE "C" PRIMARY KEY,
    -- Immutable (outbox_events_transition); unique through outbox_commands.
    command_key         text COLLATE "C" NOT NULL,
    protocol_version    smallint NOT NULL DEFAULT 1,
    envelope_generation integer NOT NULL DEFAULT 1 CHECK (envelope_generation >= 1),
    state               text NOT NULL CHECK (state IN ('PENDING', 'CLAIMED', 'SENDING', 'PUBLISHED', 'RETAINED', 'PURGED',
                                                       'DISPATCH_UNKNOWN', 'RECONCILING', 'RETRY_CLAIMED', 'QUARANTINED', 'SKIPPED')),
    tenant              text NOT NULL,
    aggregate_type      text NOT NULL,
    aggregate_id        text NOT NULL,
    aggregate_version   bigint NOT NULL CHECK (aggregate_version >= 0),
    event_type          text NOT NULL,
    traceparent         text,
    payload             bytea CHECK (payload IS NULL OR octet_length(payload) > 0),
    payload_digest      text NOT NULL,
    destination_digest  text NOT NULL,
    -- Copies of the current generation's frozen destination, for claiming and ordering.
    cluster_id          text COLLATE "C" NOT NULL,
    topic               text COLLATE "C" NOT NULL,
    partition           integer NOT NULL CHECK (partition >= 0),
    routing_key         text COLLATE "C" NOT NULL,
    ordered             boolean NOT NULL,
    -- The claim.
    claim_owner         text,
    claim_generation    bigint NOT NULL DEFAULT 0,
    lease_until_ms      bigint,
    claim_attempt_id    text,
    attempt_generation  integer NOT NULL DEFAULT 0,
    -- Clocks, ms since the epoch.
    created_at_ms       bigint NOT NULL,
    state_since_ms      bigint NOT NULL,
    next_check_at_ms    bigint NOT NULL DEFAULT 0,
    unknown_since_ms    bigint,
    published_at_ms     bigint,
    -- Who sends the event, frozen at emit and never changed: 'outbox' (the
    -- dispatcher) or 'legacy' (the publisher the outbox is replacing). With
    -- no takeover policy at all, every event is the outbox's.
    publisher           text NOT NULL DEFAULT 'outbox' CHECK (publisher IN ('outbox', 'legacy')),
    takeover_generation integer,
    -- `phase` is `state` with CLAIMED and SENDING merged into INFLIGHT; the
    -- partial indexes are on `phase`, not `state`. PostgreSQL writes a new
    -- entry into every index for each new row version unless no indexed
    -- column changed (a HOT update, which stays on its page and writes no
    -- index entry). Registering an attempt (CLAIMED -> SENDING) changes
    -- `state`, the attempt columns and `state_since_ms` but not `phase`, the
    -- lease or the key, so it leaves every index alone when its page has
    -- room. For every other state, `phase = X` is the same condition as
    -- `state = X`; queries name `phase` where they want a partial index.
    phase               text COLLATE "C" NOT NULL
        GENERATED ALWAYS AS (CASE WHEN state IN ('CLAIMED', 'SENDING') THEN 'INFLIGHT' ELSE state END) STORED,
    -- `key_chain` names an ordering chain: a 64-bit hash of (cluster, topic,
    -- routing key), length-prefixed so distinct triples never concatenate to
    -- the same text. The per-key head index is on (key_chain, seq): a scan
    -- from chain to chain compares one integer instead of three text
    -- columns (about half the time per step), and each entry is 16 bytes of
    -- key. Two chains whose hashes collide (odds ~2^-64 per pair) are
    -- ordered as one: stricter, never looser.
    key_chain           bigint NOT NULL
        GENERATED ALWAYS AS (hashtextextended(length(cluster_id) || ':' || cluster_id || length(topic) || ':' || topic || routing_key, 0)) STORED,
    -- W3C `tracestate` recorded at emit alongside `traceparent`, sent as the
    -- `tracestate` header. Its form and length (at most 512 bytes, 32
    -- members) are checked by emit (outbox_core::trace_context::validate_tracestate).
    tracestate          text,
    CHECK ((state IN ('CLAIMED', 'SENDING', 'RECONCILING')) <= (claim_owner IS NOT NULL)),
    CHECK ((state = 'PURGED') = (payload IS NULL))
) WITH (fillfactor = 60);

-- Every UPDATE of a state writes a new entry into each full index, so full
-- indexes are few; the states the dispatcher, an operator or the reconciler
-- looks up have small partial indexes instead. Legacy events are never
-- PUBLISHED here: they must not hold an outbox key's ordering, and the
-- claim indexes only hold the outbox's own events.
CREATE INDEX outbox_events_pending ON outbox_events (seq) WHERE phase = 'PENDING';
CREATE INDEX outbox_events_pending_unordered ON outbox_events (seq)
    WHERE phase = 'PENDING' AND NOT ordered AND publisher = 'outbox';
-- Per-key ordering: the oldest open event of each chain, one index descent per chain.
CREATE INDEX outbox_events_open_by_key ON outbox_events (key_chain, seq)
    WHERE phase NOT IN ('PUBLISHED', 'RETAINED', 'PURGED', 'SKIPPED') AND ordered AND publisher = 'outbox';
CREATE INDEX outbox_events_unknown ON outbox_events (next_check_at_ms) WHERE phase = 'DISPATCH_UNKNOWN';
CREATE INDEX outbox_events_leased ON outbox_events (lease_until_ms) WHERE claim_owner IS NOT NULL;
CREATE INDEX outbox_events_retry ON outbox_events (seq) WHERE phase = 'RETRY_CLAIMED';
CREATE INDEX outbox_events_published ON outbox_events (published_at_ms) WHERE phase = 'PUBLISHED';
CREATE INDEX outbox_events_retained ON outbox_events (published_at_ms) WHERE phase = 'RETAINED';
-- Quarantined events in the order they arrived (seq), not by
-- state_since_ms, which every step writes.
CREATE INDEX outbox_events_quarantined ON outbox_events (seq) WHERE phase = 'QUARANTINED';
CREATE INDEX outbox_events_unknown_since ON outbox_events (unknown_since_ms) WHERE unknown_since_ms IS NOT NULL;
-- The shadow dispatcher's scan: legacy events in commit order.
CREATE INDEX outbox_events_legacy ON outbox_events (seq) WHERE publisher = 'legacy';

-- The checks on outbox_events are AFTER row triggers with a WHEN condition,
-- so they cost nothing for a legal row. A BEFORE UPDATE row trigger makes
-- PostgreSQL lock each row before the trigger sees it (GetTupleForTrigger):
-- one tuple lock, written to the WAL, for every row updated, even by
-- statements that had not locked the row themselves (registering an
-- attempt), and one PL/pgSQL call per row (measured with auto_explain
-- during dispatch_bench, the call cost about four foreign-key checks per
-- emitted event). With an AFTER trigger the condition is evaluated by the
-- executor as the row is written, and an event is queued only for an
-- offending row, whose check function then raises at the end of the
-- statement: the statement fails, and nothing it wrote stays.

-- State transitions, identity and generations.
CREATE FUNCTION outbox_check_transition() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state IS DISTINCT FROM OLD.state AND NOT outbox_transition_allowed(OLD.state, NEW.state) THEN
        RAISE EXCEPTION 'illegal outbox transition % -> % for %', OLD.state, NEW.state, OLD.event_id
            USING ERRCODE = 'check_violation';
    END IF;
    IF OLD.state = 'QUARANTINED' AND NEW.state = 'PENDING' AND NEW.envelope_generation = OLD.envelope_generation THEN
        RAISE EXCEPTION 'a quarantined event goes back to PENDING only under a new envelope generation (%)', OLD.event_id
            USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.event_id <> OLD.event_id OR NEW.command_key <> OLD.command_key OR NEW.seq <> OLD.seq
       OR NEW.payload_digest <> OLD.payload_digest THEN
        RAISE EXCEPTION 'outbox event identity is immutable' USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.claim_generation < OLD.claim_generation OR NEW.attempt_generation < OLD.attempt_generation
       OR NEW.envelope_generation < OLD.envelope_generation THEN
        RAISE EXCEPTION 'outbox generations never go backwards' USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER outbox_events_transition AFTER UPDATE ON outbox_events
    FOR EACH ROW
    WHEN ((OLD.state IS DISTINCT FROM NEW.state AND NOT outbox_transition_allowed(OLD.state, NEW.state))
          OR (OLD.state = 'QUARANTINED' AND NEW.state = 'PENDING' AND NEW.envelope_generation = OLD.envelope_generation)
          OR NEW.event_id <> OLD.event_id OR NEW.command_key <> OLD.command_key OR NEW.seq <> OLD.seq
          OR NEW.payload_digest <> OLD.payload_digest
          OR NEW.claim_generation < OLD.claim_generation OR NEW.attempt_generation < OLD.attempt_generation
          OR NEW.envelope_generation < OLD.envelope_generation)
    EXECUTE FUNCTION outbox_check_transition();

-- Formats of event_id, the digests and traceparent. The function raises the
-- error for an offending row and states the formats with counted patterns.
CREATE FUNCTION outbox_check_formats() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' OR NEW.event_id IS DISTINCT FROM OLD.event_id THEN
        IF NEW.event_id !~ '^evt-[0-7][0-9A-HJKMNP-TV-Z]{25}$' THEN
            RAISE EXCEPTION 'malformed event_id %', NEW.event_id USING ERRCODE = 'check_violation';
        END IF;
    END IF;
    IF TG_OP = 'INSERT' OR NEW.payload_digest IS DISTINCT FROM OLD.payload_digest THEN
        IF NEW.payload_digest !~ '^sha256:[0-9a-f]{64}$' THEN
            RAISE EXCEPTION 'malformed payload_digest %', NEW.payload_digest USING ERRCODE = 'check_violation';
        END IF;
    END IF;
    IF TG_OP = 'INSERT' OR NEW.destination_digest IS DISTINCT FROM OLD.destination_digest THEN
        IF NEW.destination_digest !~ '^sha256:[0-9a-f]{64}$' THEN
            RAISE EXCEPTION 'malformed destination_digest %', NEW.destination_digest USING ERRCODE = 'check_violation';
        END IF;
    END IF;
    IF (TG_OP = 'INSERT' OR NEW.traceparent IS DISTINCT FROM OLD.traceparent) AND NEW.traceparent IS NOT NULL
       AND NEW.traceparent !~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$' THEN
        RAISE EXCEPTION 'malformed traceparent %', NEW.traceparent USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$;
-- The insert trigger's condition is written without counted repetition.
-- PostgreSQL's regular expressions expand a counted repetition such as
-- `[0-9a-f]{64}` into one automaton state per repetition, and matching such
-- a pattern costs several microseconds per value: profiled with perf during
-- dispatch_bench, these conditions and the attempt id check were about 8%
-- of the machine's CPU. Each check is the same condition written as a
-- length test plus a pattern with `*`: every character the pattern admits
-- is one byte, so "the pattern matches and the value has exactly N bytes"
-- holds for exactly the values the counted pattern matches (the
-- traceparent's dashes are pinned by position). These run 4-8 times faster.
-- A test evaluates them against the counted patterns on generated and
-- mutated values.
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
-- Fires only when a checked column is written and changed.
CREATE TRIGGER outbox_events_formats_update AFTER UPDATE OF event_id, payload_digest, destination_digest, traceparent ON outbox_events
    FOR EACH ROW
    WHEN (NEW.event_id IS DISTINCT FROM OLD.event_id OR NEW.payload_digest IS DISTINCT FROM OLD.payload_digest
          OR NEW.destination_digest IS DISTINCT FROM OLD.destination_digest OR NEW.traceparent IS DISTINCT FROM OLD.traceparent)
    EXECUTE FUNCTION outbox_check_formats();

-- W3C Trace Context, for every writer (emit refuses the same values first,
-- with a clearer message): a traceparent of version ff or with an all-zero
-- trace id or parent id, a tracestate without a traceparent, empty, or
-- longer than 512 bytes. The form of the traceparent (55 bytes, lower-case
-- hex, dashes) is checked by outbox_events_formats_*. Updates that do not
-- touch the two columns skip it.
CREATE FUNCTION outbox_refuse_trace_context() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'trace context refused for %: traceparent % or a tracestate of % bytes is not valid W3C Trace Context (version ff and all-zero ids are forbidden; a tracestate needs a traceparent and holds 1..512 bytes)',
        NEW.event_id, NEW.traceparent, octet_length(NEW.tracestate)
        USING ERRCODE = 'check_violation';
END $$;
CREATE TRIGGER outbox_events_trace_context AFTER INSERT OR UPDATE OF traceparent, tracestate ON outbox_events
    FOR EACH ROW
    WHEN ((NEW.traceparent IS NOT NULL
           AND (left(NEW.traceparent, 2) = 'ff'
                OR substr(NEW.traceparent, 4, 32) = '00000000000000000000000000000000'
                OR substr(NEW.traceparent, 37, 16) = '0000000000000000'))
          OR (NEW.tracestate IS NOT NULL
              AND (NEW.traceparent IS NULL OR octet_length(NEW.tracestate) NOT BETWEEN 1 AND 512)))
    EXECUTE FUNCTION outbox_refuse_trace_context();

-- Events are inserted PENDING only.
CREATE FUNCTION outbox_check_inserted_pending() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'an outbox event is inserted PENDING, not % (event %)', NEW.state, NEW.event_id USING ERRCODE = 'check_violation';
END $$;
CREATE TRIGGER outbox_events_inserted_pending AFTER INSERT ON outbox_events
    FOR EACH ROW WHEN (NEW.state <> 'PENDING')
    EXECUTE FUNCTION outbox_check_inserted_pending();

-- Each event names its command row (see section 1 for why this is a
-- statement-level check and not a foreign key).
CREATE FUNCTION outbox_events_check_references() RETURNS trigger LANGUAGE plpgsql
    SET enable_seqscan = off
    SET search_path FROM CURRENT
AS $$
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

CREATE TRIGGER outbox_events_never_deleted BEFORE DELETE ON outbox_events
    FOR EACH ROW EXECUTE FUNCTION outbox_never_deleted();
CREATE TRIGGER outbox_events_never_truncated BEFORE TRUNCATE ON outbox_events
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_never_deleted();


-- =========================================================================
-- 5. Envelopes: frozen envelopes and destinations
-- =========================================================================

-- Frozen envelopes and destinations, one row per envelope generation. Never updated.
CREATE TABLE outbox_envelopes (
    event_id              text COLLATE "C" NOT NULL,
    envelope_generation   integer NOT NULL,
    envelope_canonical    bytea NOT NULL,
    envelope_digest       text NOT NULL,
    destination_canonical bytea NOT NULL,
    destination_digest    text NOT NULL,
    payload_digest        text NOT NULL,
    created_txid          bigint NOT NULL,
    created_at_ms         bigint NOT NULL,
    PRIMARY KEY (event_id, envelope_generation)
);
CREATE TRIGGER outbox_envelopes_frozen BEFORE UPDATE OR DELETE ON outbox_envelopes
    FOR EACH ROW EXECUTE FUNCTION outbox_frozen();
CREATE TRIGGER outbox_envelopes_never_truncated BEFORE TRUNCATE ON outbox_envelopes
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_never_deleted();

-- Each envelope names its event (see section 1).
CREATE FUNCTION outbox_envelopes_check_references() RETURNS trigger LANGUAGE plpgsql
    SET enable_seqscan = off
    SET search_path FROM CURRENT
AS $$
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


-- =========================================================================
-- 6. Emit lookups
-- =========================================================================

-- emit's lookups in outbox_commands (which command keys exist, the last
-- version of each aggregate, the committed events of retried keys) run in
-- functions that plan with enable_seqscan off, as the reference checks do.
--
-- A session caches the plan of a statement it runs often. One planned
-- while outbox_commands held a handful of analyzed rows (autovacuum
-- analyzes a young table after its first fifty rows; a deployment that
-- starts at full traffic grows it by a million before the next analyze)
-- would read the table from end to end once per key and once per
-- aggregate: measured, 12,001 sequential scans for 6,000 events, each
-- longer than the one before. Every lookup here has an index that answers
-- it in one descent (the primary keys, outbox_commands_aggregate), so the
-- setting costs nothing where statistics are current.
--
-- Their plans are generic (plan_cache_mode): planned once per session, as
-- a statement without parameters is. Left to choose, PostgreSQL would plan
-- these afresh on every call for their array parameters, which took a
-- single-event emit's lookup from about 70 to about 190 us.
--
-- outbox_emit_committed is STABLE: it reads with the snapshot of the
-- statement that calls it, at any isolation level (outbox_emit_lookup is
-- VOLATILE, below, so that it reads after its lock). They run with the caller's
-- rights and read the schema they were created in, whatever the caller's
-- search_path.

-- outbox_emit_lookup: emit's "aggregate versions never go backwards" check
-- holds under concurrency: it takes a transaction-scoped advisory lock
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
-- Isolation: at READ COMMITTED (the default) the check holds by the lock.
-- At REPEATABLE READ and SERIALIZABLE the reads use the transaction's
-- snapshot, taken before the lock, so a version committed after that
-- snapshot would not be seen. There the emit also writes the aggregates'
-- head rows (outbox_aggregate_heads): a head row written by an emit that
-- committed after this snapshot fails the write with a serialization error
-- (40001, retryable), and the retry reads the committed version. Head rows
-- cost READ COMMITTED emits nothing unless outbox_settings.aggregate_heads
-- is 'always' (for services whose emits of one aggregate run at both
-- kinds of level: a READ COMMITTED emit that writes none is not seen by a
-- REPEATABLE READ one). Tested by
-- an_emit_at_snapshot_isolation_never_commits_a_version_below_one_committed_after_its_snapshot.
--
-- The aggregates' head rows: one per aggregate an emit at REPEATABLE READ
-- or SERIALIZABLE (or any emit, with outbox_settings.aggregate_heads =
-- 'always') wrote, holding the last such emit's transaction id. The row is
-- what two emits of one aggregate both write: at REPEATABLE READ, an emit
-- whose snapshot predates the other's commit fails on it with a
-- serialization error (40001), which the caller retries, instead of
-- deciding its version without the other's. A READ COMMITTED emit needs
-- none (it reads after the aggregate's lock) and writes none unless the
-- setting is 'always'. One small row per aggregate, kept (an aggregate's
-- history of commands is kept too).
CREATE TABLE outbox_aggregate_heads (
    tenant         text NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    last_txid      bigint NOT NULL,
    PRIMARY KEY (tenant, aggregate_type, aggregate_id)
);

CREATE FUNCTION outbox_emit_lookup(p_keys text[], p_tenants text[], p_aggregate_types text[], p_aggregate_ids text[],
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
    -- At REPEATABLE READ or SERIALIZABLE (or always, by the setting), the
    -- aggregates' head rows, after the locks and before the reads: a head
    -- row another emit wrote since this transaction's snapshot fails here
    -- with a serialization error (40001), so the versions read below are
    -- never older than the aggregate's last committed emit that wrote one.
    IF current_setting('transaction_isolation') <> 'read committed'
       OR (SELECT s.aggregate_heads = 'always' FROM outbox_settings s) THEN
        INSERT INTO outbox_aggregate_heads AS h (tenant, aggregate_type, aggregate_id, last_txid)
        SELECT DISTINCT a.tenant, a.aggregate_type, a.aggregate_id, pg_current_xact_id()::text::bigint
        FROM UNNEST(p_tenants, p_aggregate_types, p_aggregate_ids) AS a(tenant, aggregate_type, aggregate_id)
        ORDER BY 1, 2, 3
        ON CONFLICT (tenant, aggregate_type, aggregate_id) DO UPDATE SET last_txid = EXCLUDED.last_txid;
    END IF;
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
        -- A stream event (section 17) has its first envelope inline and is the outbox's.
        SELECT k.key, v.envelope_canonical, v.destination_canonical, v.destination_digest, v.publisher
        FROM UNNEST(p_keys) AS k(key)
        CROSS JOIN LATERAL (SELECT c.event_id FROM outbox_commands c WHERE c.command_key = k.key LIMIT 1) c
        CROSS JOIN LATERAL (
            (SELECT y.envelope_canonical, y.destination_canonical, y.destination_digest, x.publisher
             FROM outbox_events x JOIN outbox_envelopes y ON y.event_id = x.event_id AND y.envelope_generation = 1
             WHERE x.event_id = c.event_id LIMIT 1)
            UNION ALL
            (SELECT s.envelope_canonical, s.destination_canonical, s.destination_digest, 'outbox'::text
             FROM outbox_stream s WHERE s.event_id = c.event_id LIMIT 1)
            LIMIT 1) v;
END
$$;


-- =========================================================================
-- 7. Claims: ordering-chain heads
-- =========================================================================

-- Claims in O(batch). Each open ordering chain has one row naming its
-- head: the oldest open event of the chain when the head was chosen. A
-- claim reads the claimable heads in seq order from a partial index and
-- locks them (FOR NO KEY UPDATE SKIP LOCKED), `LIMIT n`: O(n) index
-- entries, whatever the backlog behind the heads or the number of chains.
-- (Walking the head of every open chain over outbox_events_open_by_key
-- instead costs in proportion to the number of open keys: measured,
-- 100,000 pending events on 100,000 keys drained at a fifth of the rate of
-- the same backlog on 1,000 keys.)
--
-- `outbox_events` stays the record of every event's claim (owner,
-- claim_generation, lease_until_ms, claim_attempt_id): the head row only
-- says which event of its chain may be claimed. Every fenced write checks
-- the event row.
--
-- Who keeps the heads:
--   * an insert of an ordered event (emit) appends its chain to
--     outbox_chain_arrivals: insert-only, so emit never waits for a
--     dispatcher or another business transaction, whatever its isolation
--     level;
--   * each claim's transaction first links arrivals
--     (outbox_link_arrivals): a chain with no visible head gets its oldest
--     open event as head; a chain with one is left alone (its new event
--     waits behind the head);
--   * any update of outbox_events (claim, registration, the receipt
--     transaction, reports, release, lease expiry, reconciliation,
--     quarantine, retention) runs the statement trigger below, which keeps
--     the head's claimability equal to its event's (PENDING and
--     next_check_at_ms) and, when the head event closes (PUBLISHED,
--     RETAINED, PURGED, or SKIPPED by an operator), moves the head to the
--     chain's next open event in the same transaction; a row trigger moves
--     an event whose chain changes (a destination migration) to its new chain.
--
-- No lost chain. A chain whose head closes and that has no next open
-- event (in the closing transaction's snapshot) loses its head row and
-- gets an arrival of its own, committed with that transaction. Take an
-- event E of the chain that the closing statement did not see: it commits
-- after that statement began. A linker that consumes E's arrival reads
-- after E committed; if it still sees the old head, the closing
-- transaction had not committed yet, so its own arrival is read by a
-- linker that starts after it committed, and so after E committed, and
-- finds E. A linker that no longer sees a head finds E itself. (Its
-- INSERT ... ON CONFLICT waits for a transaction inserting the same head,
-- and what the new head names is chosen after that wait: see
-- outbox_link_arrivals.)
--
-- A head is sound: every committed head row names an open, ordered event
-- of the outbox on its own chain, claimable exactly while that event is
-- PENDING. Every writer of a chain's head holds the head row (locked, or
-- its own new row) before it chooses what the row names, and chooses with
-- a snapshot taken after it got the row (outbox_chain_advance): of two
-- transactions changing one chain's head, the second decides with the
-- first's result. Where the head row does not exist yet, the linker inserts
-- it (outbox_link_arrivals), and a migration's move inserts the row it
-- locks (outbox_chain_move). Every writer that makes a head name another
-- event holds that event before its final choice (outbox_chain_rehead), so
-- a transaction writing the event waits, and then sees the committed head:
-- the head's claimability stays its event's. The claim checks the event
-- row again (its chain and cluster) and never hands out an event through a
-- head that is not its own chain's.

CREATE TABLE outbox_chain_heads (
    key_chain        bigint PRIMARY KEY,
    event_id         text NOT NULL,
    seq              bigint NOT NULL,
    -- The head's next_check_at_ms while it is PENDING; NULL while it is not
    -- claimable (in flight, DISPATCH_UNKNOWN, RETRY_CLAIMED, QUARANTINED).
    claimable_at_ms  bigint,
    cluster_id       text NOT NULL,
    protocol_version smallint NOT NULL
) WITH (fillfactor = 70);
CREATE INDEX outbox_chain_heads_claimable ON outbox_chain_heads (seq) WHERE claimable_at_ms IS NOT NULL;

CREATE TABLE outbox_chain_arrivals (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key_chain bigint NOT NULL
);

-- The heads chains get when they have none: each chain's oldest open
-- event, chosen in this statement's snapshot. Returns the chains it
-- inserted a head for, which the caller then holds (uncommitted rows of
-- its own) and must check again with outbox_chain_advance: the INSERT may
-- have waited on another transaction's new head (ON CONFLICT), and what it
-- chose after that wait is from its snapshot taken before it.
CREATE FUNCTION outbox_chain_heads_insert(p_chains bigint[]) RETURNS bigint[]
    LANGUAGE plpgsql VOLATILE
    SET enable_seqscan = off
    SET search_path FROM CURRENT
AS $$
DECLARE
    inserted bigint[];
BEGIN
    -- In key_chain order, as every writer of heads goes, so two of them
    -- waiting on each other's new rows wait in one direction.
    WITH ins AS (
        INSERT INTO outbox_chain_heads (key_chain, event_id, seq, claimable_at_ms, cluster_id, protocol_version)
        SELECT n.key_chain, n.event_id, n.seq, CASE WHEN n.state = 'PENDING' THEN n.next_check_at_ms END, n.cluster_id, n.protocol_version
        FROM (SELECT DISTINCT c FROM UNNEST(p_chains) AS c) k
        CROSS JOIN LATERAL (
            SELECT e.key_chain, e.event_id, e.seq, e.state, e.next_check_at_ms, e.cluster_id, e.protocol_version FROM outbox_events e
            WHERE e.key_chain = k.c AND e.phase NOT IN ('PUBLISHED', 'RETAINED', 'PURGED', 'SKIPPED') AND e.ordered AND e.publisher = 'outbox'
            ORDER BY e.seq LIMIT 1) n
        ORDER BY n.key_chain
        ON CONFLICT (key_chain) DO NOTHING
        RETURNING key_chain)
    SELECT array_agg(key_chain ORDER BY key_chain) INTO inserted FROM ins;
    RETURN inserted;
END
$$;

-- Links up to p_limit arrivals (oldest first, skipping those another
-- linker holds), consuming them, and returns how many it took. A claim
-- runs it first in its transaction; the locks it takes (on the arrivals
-- and on the heads it inserts) make another linker wait, and a
-- destination migration moving an event out of one of those chains
-- (outbox_chain_move).
--
-- Never a head on a closed event (the race this fixes: the INSERT chose
-- (B, b1) in a snapshot taken before it waited on another linker's new
-- head of chain A; meanwhile b1 was published and B's head row deleted,
-- so the insert of (B, b1) met no conflict, and B's head named a
-- PUBLISHED event until retention). The INSERT only takes the heads (rows
-- of this transaction, which any other writer of those chains' heads
-- waits for); what they name is chosen after it, by outbox_chain_advance.
-- At READ COMMITTED each statement of this VOLATILE function reads with a
-- snapshot of its own, taken when it starts, which sees every transaction
-- committed before it, those the INSERT waited on included. The linker
-- then holds each chosen event (FOR SHARE, skipping one another
-- transaction is writing) and chooses again, until every head names an
-- event it held before the choice. So when it is done each head names an
-- event that was open, on that chain, with that claimability, in a
-- snapshot taken after the event was held; and nothing changes the event
-- until this transaction ends. A writer of it waits for that, and its own
-- trigger (outbox_chain_follow, a fresh statement after its UPDATE) then
-- sees the committed head and moves it or updates its claimability. This
-- covers events that change without having been claimed through this
-- head: the stream's exception lane copies events in already CLAIMED,
-- SENDING or PUBLISHED, and before, a head installed on one while its
-- receipt or lease expiry committed stayed on a PUBLISHED event, or not
-- claimable on a PENDING one. A move out of the chain (outbox_chain_move)
-- waits on the head row, inserted or not. A chain whose chosen event is
-- being written (or that is still moving after three rounds) is given
-- back: its head row goes and it gets an arrival, for a later linker.
-- (At REPEATABLE READ or SERIALIZABLE there is one snapshot per
-- transaction; a claim's transaction is READ COMMITTED.)
CREATE FUNCTION outbox_link_arrivals(p_limit integer) RETURNS integer
    LANGUAGE plpgsql VOLATILE
    SET enable_seqscan = off
    SET search_path FROM CURRENT
AS $$
DECLARE
    taken integer;
    chains bigint[];
    linked bigint[];
BEGIN
    WITH gone AS (
        DELETE FROM outbox_chain_arrivals a
        WHERE a.id IN (SELECT id FROM outbox_chain_arrivals ORDER BY id LIMIT p_limit FOR UPDATE SKIP LOCKED)
        RETURNING a.key_chain)
    SELECT count(*), array_agg(DISTINCT key_chain) INTO taken, chains FROM gone;
    IF taken = 0 THEN
        RETURN 0;
    END IF;
    -- One primary-key probe per chain; the chains with no visible head
    -- get one (see the header for why a head being closed right now needs
    -- nothing here).
    linked := outbox_chain_heads_insert(ARRAY(
        SELECT c FROM UNNEST(chains) AS c WHERE NOT EXISTS (SELECT 1 FROM outbox_chain_heads h WHERE h.key_chain = c)));
    -- Choose what each new head names with a snapshot taken after the
    -- INSERT's waits, holding every event it names: see above.
    PERFORM outbox_chain_rehead(linked, '{}');
    RETURN taken;
END
$$;

-- Re-heads the chains p_chains, whose head rows the caller holds (locked
-- FOR NO KEY UPDATE, by an ON CONFLICT DO UPDATE, or inserted by its own
-- transaction): a head whose event is no longer an open, ordered event of
-- the outbox on that very chain (it closed, or a migration moved it to
-- another chain) moves to the chain's oldest open event; a chain with
-- none loses its head row and gets an arrival, so that a linker looks at
-- it again after this transaction commits (see the header). A head that
-- still holds stays, with its event's current claimability.
--
-- It decides from the chain's current members, not from what the caller
-- saw: it is one statement of a VOLATILE function, so at READ COMMITTED
-- it reads with a snapshot taken when it starts, after the caller got the
-- head rows. Whoever held a head row before the caller has committed by
-- then, and its changes (a head already moved, an event moved out of the
-- chain) are seen: of two transactions that change one chain's head, the
-- second decides with the first's result, whichever order they come in.
CREATE FUNCTION outbox_chain_advance(p_chains bigint[]) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET enable_seqscan = off
    SET search_path FROM CURRENT
AS $$
BEGIN
    WITH nxt AS MATERIALIZED (
        SELECT h.key_chain AS kc, h.event_id AS was, h.claimable_at_ms AS was_claimable,
               n.event_id, n.seq, n.next_check_at_ms, n.cluster_id, n.protocol_version,
               CASE WHEN n.state = 'PENDING' THEN n.next_check_at_ms END AS claimable
        FROM outbox_chain_heads h
        LEFT JOIN LATERAL (
            -- The head's own event if it still holds the chain, else the
            -- chain's oldest open event.
            SELECT u.event_id, u.seq, u.state, u.next_check_at_ms, u.cluster_id, u.protocol_version FROM (
                (SELECT 0 AS pick, e.event_id, e.seq, e.state, e.next_check_at_ms, e.cluster_id, e.protocol_version FROM outbox_events e
                 WHERE e.event_id = h.event_id AND e.key_chain = h.key_chain
                   AND e.phase NOT IN ('PUBLISHED', 'RETAINED', 'PURGED', 'SKIPPED') AND e.ordered AND e.publisher = 'outbox')
                UNION ALL
                (SELECT 1 AS pick, e.event_id, e.seq, e.state, e.next_check_at_ms, e.cluster_id, e.protocol_version FROM outbox_events e
                 WHERE e.key_chain = h.key_chain AND e.phase NOT IN ('PUBLISHED', 'RETAINED', 'PURGED', 'SKIPPED') AND e.ordered AND e.publisher = 'outbox'
                 ORDER BY e.seq LIMIT 1)) u
            ORDER BY u.pick LIMIT 1) n ON true
        WHERE h.key_chain = ANY (p_chains)),
    moved AS (
        UPDATE outbox_chain_heads h
        SET event_id = x.event_id, seq = x.seq, claimable_at_ms = x.claimable, cluster_id = x.cluster_id, protocol_version = x.protocol_version
        FROM nxt x WHERE x.event_id IS NOT NULL AND h.key_chain = x.kc
          AND (x.event_id IS DISTINCT FROM x.was OR x.claimable IS DISTINCT FROM x.was_claimable)),
    emptied AS (
        DELETE FROM outbox_chain_heads h USING nxt x
        WHERE x.event_id IS NULL AND h.key_chain = x.kc
        RETURNING h.key_chain)
    INSERT INTO outbox_chain_arrivals (key_chain) SELECT key_chain FROM emptied ORDER BY key_chain;
END
$$;

-- Re-heads the chains p_chains (whose head rows the caller holds, as for
-- outbox_chain_advance) so that every head it leaves names an event this
-- transaction holds, or one that head already named (p_named: a writer of
-- that event sees the committed head and waits for the row the caller
-- holds). outbox_chain_advance chooses in its own snapshot and copies the
-- chosen event's claimability from there; a transaction writing that
-- event meanwhile cannot see the new head (not committed), so its own
-- trigger leaves it alone, and the head would commit with a claimability
-- the event no longer has (the race this fixes: a migration's move
-- re-headed a chain on an event CLAIMED in its snapshot while a release
-- made it PENDING; the head committed not claimable, and the key's later
-- events waited for ever). So each newly named event is held (FOR SHARE,
-- skipping one another transaction is writing) and the chain chosen
-- again with a snapshot taken after, until every head names an event held
-- before the choice; a chain whose chosen event is being written (or that
-- is still moving after three rounds) is given back: its head row goes and
-- it gets an arrival, for a later linker. A writer of a held event waits
-- for this transaction, and its trigger then sees the committed head.
CREATE FUNCTION outbox_chain_rehead(p_chains bigint[], p_named text[]) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET enable_seqscan = off
    SET search_path FROM CURRENT
AS $$
DECLARE
    linked bigint[] := p_chains;
    chosen text[];
    held text[] := coalesce(p_named, '{}');
    gone bigint[];
    pass integer := 0;
BEGIN
    WHILE cardinality(linked) > 0 LOOP
        pass := pass + 1;
        PERFORM outbox_chain_advance(linked);
        SELECT coalesce(array_agg(h.key_chain ORDER BY h.key_chain), '{}'), coalesce(array_agg(h.event_id ORDER BY h.key_chain), '{}')
        INTO linked, chosen
        FROM outbox_chain_heads h WHERE h.key_chain = ANY (linked) AND NOT (h.event_id = ANY (held));
        EXIT WHEN cardinality(linked) = 0;
        IF pass > 3 THEN
            gone := linked;
        ELSE
            -- Never waits: an event another transaction is writing is not
            -- held, and its chain is given back (below).
            SELECT held || coalesce(array_agg(l.event_id), '{}') INTO held
            FROM (SELECT e.event_id FROM outbox_events e WHERE e.event_id = ANY (chosen) FOR SHARE OF e SKIP LOCKED) l;
            gone := ARRAY(SELECT t.c FROM UNNEST(linked, chosen) AS t(c, ev) WHERE NOT (t.ev = ANY (held)));
        END IF;
        -- Given back: no head from this transaction, and an arrival, so
        -- that a later linker (after that writer commits) links the chain.
        IF cardinality(gone) > 0 THEN
            DELETE FROM outbox_chain_heads WHERE key_chain = ANY (gone);
            INSERT INTO outbox_chain_arrivals (key_chain) SELECT c FROM UNNEST(gone) AS c ORDER BY c;
            linked := ARRAY(SELECT c FROM UNNEST(linked) AS c WHERE NOT (c = ANY (gone)));
        END IF;
    END LOOP;
END
$$;

-- An inserted ordered event of the outbox arrives on its chain.
CREATE FUNCTION outbox_chain_arrive() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path FROM CURRENT
AS $$
BEGIN
    INSERT INTO outbox_chain_arrivals (key_chain)
    SELECT DISTINCT key_chain FROM new_rows WHERE ordered AND publisher = 'outbox';
    RETURN NULL;
END
$$;
CREATE TRIGGER outbox_events_chain_arrive AFTER INSERT ON outbox_events
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION outbox_chain_arrive();

-- Reads only the new rows, joined to outbox_chain_heads by primary key,
-- one probe per row: a plan over the transition table is made once per
-- session (it has no parameters) and would otherwise keep whatever join
-- the first, perhaps one-row, statement suggested.
CREATE FUNCTION outbox_chain_follow() RETURNS trigger
    LANGUAGE plpgsql
    SET enable_seqscan = off
    SET enable_hashjoin = off
    SET enable_mergejoin = off
    SET search_path FROM CURRENT
AS $$
DECLARE
    chains bigint[];
BEGIN
    -- Heads whose event closed (PUBLISHED, RETAINED and PURGED following
    -- it; or SKIPPED by an operator).
    SELECT array_agg(DISTINCT h.key_chain) INTO chains
    FROM new_rows n JOIN outbox_chain_heads h ON h.key_chain = n.key_chain AND h.event_id = n.event_id
    WHERE n.phase IN ('PUBLISHED', 'RETAINED', 'PURGED', 'SKIPPED');
    IF chains IS NOT NULL THEN
        -- Take the head rows first (in key_chain order), then decide with
        -- a snapshot taken after (outbox_chain_advance): a migration moving
        -- another event out of the chain holds the row until it commits
        -- (outbox_chain_move), and is then seen.
        PERFORM 1 FROM outbox_chain_heads WHERE key_chain = ANY (chains) ORDER BY key_chain FOR NO KEY UPDATE;
        PERFORM outbox_chain_rehead(chains, '{}');
    END IF;
    -- A head is claimable exactly while its event is PENDING, from its
    -- next_check_at_ms. SENDING follows only CLAIMED and RETRY_CLAIMED,
    -- whose heads are already not claimable: registration (and renewing a
    -- sending batch's leases) probes nothing.
    UPDATE outbox_chain_heads h SET claimable_at_ms = CASE WHEN n.state = 'PENDING' THEN n.next_check_at_ms END
    FROM new_rows n
    WHERE h.key_chain = n.key_chain AND h.event_id = n.event_id AND n.phase NOT IN ('PUBLISHED', 'RETAINED', 'PURGED', 'SKIPPED') AND n.state <> 'SENDING'
      AND h.claimable_at_ms IS DISTINCT FROM (CASE WHEN n.state = 'PENDING' THEN n.next_check_at_ms END);
    RETURN NULL;
END
$$;
CREATE TRIGGER outbox_events_chain_follow AFTER UPDATE ON outbox_events
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION outbox_chain_follow();

-- An event that moves to another chain (a destination migration freezes a
-- new cluster or topic) or into or out of ordering leaves its old chain,
-- which gets its next head if the event was its head, and arrives on the
-- new one. Rare: one row at a time.
--
-- It always takes the old chain's head row before it looks at it (the race
-- this fixes: the receipt transaction publishing the head E1 had moved the
-- head to E2, uncommitted; the migration of E2, reading the head as E1,
-- left it alone; the receipt then committed the old chain's head on E2, an
-- event of another chain: the old chain never moved again, and a
-- dispatcher of the old cluster claimed E2's new generation). The INSERT
-- ... ON CONFLICT DO UPDATE ... WHERE false writes nothing over an
-- existing row but locks it, waiting for a transaction that holds it (a
-- receipt transaction advancing it) or that is inserting it (a linker);
-- with no row at all it inserts a placeholder naming the moved event,
-- which outbox_chain_advance replaces or removes at once. Then
-- outbox_chain_advance decides with a snapshot taken after the lock: a
-- head the other transaction left on the moved event moves on to the
-- chain's next open event. The other way round, a receipt transaction
-- that comes second waits in outbox_chain_follow on the row this holds,
-- and decides after this commits, no longer seeing the moved event.
CREATE FUNCTION outbox_chain_move() RETURNS trigger
    LANGUAGE plpgsql
    SET enable_seqscan = off
    SET search_path FROM CURRENT
AS $$
BEGIN
    IF OLD.ordered AND OLD.publisher = 'outbox' THEN
        INSERT INTO outbox_chain_heads (key_chain, event_id, seq, claimable_at_ms, cluster_id, protocol_version)
        VALUES (OLD.key_chain, OLD.event_id, OLD.seq, NULL, OLD.cluster_id, OLD.protocol_version)
        ON CONFLICT (key_chain) DO UPDATE SET event_id = EXCLUDED.event_id WHERE false;
        -- A committed head that stays on its event needs no hold (see
        -- outbox_chain_rehead); the placeholder names the moved event.
        PERFORM outbox_chain_rehead(ARRAY[OLD.key_chain],
            ARRAY(SELECT h.event_id FROM outbox_chain_heads h WHERE h.key_chain = OLD.key_chain AND h.event_id <> OLD.event_id));
    END IF;
    IF NEW.ordered AND NEW.publisher = 'outbox' AND NEW.phase NOT IN ('PUBLISHED', 'RETAINED', 'PURGED', 'SKIPPED') THEN
        INSERT INTO outbox_chain_arrivals (key_chain) VALUES (NEW.key_chain);
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER outbox_events_chain_move AFTER UPDATE ON outbox_events FOR EACH ROW
    WHEN (OLD.key_chain IS DISTINCT FROM NEW.key_chain OR OLD.ordered IS DISTINCT FROM NEW.ordered OR OLD.publisher IS DISTINCT FROM NEW.publisher)
    EXECUTE FUNCTION outbox_chain_move();


-- =========================================================================
-- 8. Attempts
-- =========================================================================

-- One row per attempt to send an event's envelope generation.
--
-- fillfactor 50: an attempt row is inserted once and updated once
-- (SENDING -> ACKED, or UNKNOWN / NOT_SENT), within a second of its insert.
-- At 50 every page keeps room for each of its rows' second version, so the
-- update is heap-only (no index entry; `state` is not indexed) instead of
-- one in two at 70. The price is space: about twice the packed size.
CREATE TABLE outbox_attempts (
    -- Format checked by outbox_attempts_attempt_id_format (below).
    attempt_id          text COLLATE "C" PRIMARY KEY,
    event_id            text COLLATE "C" NOT NULL,
    envelope_generation integer NOT NULL,
    attempt_generation  integer NOT NULL CHECK (attempt_generation >= 1),
    claim_generation    bigint NOT NULL,
    owner               text NOT NULL,
    state               text NOT NULL CHECK (state IN ('SENDING', 'UNKNOWN', 'ACKED', 'NOT_SENT', 'ABSENT')),
    destination_digest  text NOT NULL,
    started_at_ms       bigint NOT NULL,
    scan_from_offset    bigint NOT NULL DEFAULT 0,
    finished_at_ms      bigint,
    detail              text,
    -- The end of the lease the attempt was registered under (in the
    -- registering dispatcher's clock, like started_at_ms): its message is
    -- handed to the client only before it. NULL: the absence bound counts
    -- from started_at_ms.
    send_deadline_ms    bigint,
    -- The registration time by the database's own clock, so that a
    -- reconciler measures how long ago an attempt was registered without
    -- trusting the registering host's clock.
    registered_db_ms    bigint DEFAULT ((extract(epoch FROM clock_timestamp()) * 1000)::bigint),
    -- The scan floor's anchor. An attempt's scan floor is the highest
    -- receipted offset of its partition, plus one. A replaced cluster (or a
    -- topic without a recorded id deleted and created again) starts each
    -- partition's log at offset 0 again, under the same cluster, topic and
    -- partition, where the floor could hide the attempt's message below it.
    -- So the attempt records the event and the attempt whose receipt held
    -- the offset below the floor: a lookup reads that offset first, and a
    -- log that no longer holds that message there (of that event, written
    -- by that attempt: `outbox_core::anchor_holds`) is read from its start.
    -- The attempt matters too: a replaced log may hold the same event's
    -- message at that offset, written there by another attempt (a paused
    -- sender's late write). NULL for a floor of 0; an anchor without an
    -- attempt id is checked by event only.
    scan_anchor_event_id text COLLATE "C"
        CHECK (scan_anchor_event_id IS NULL OR (octet_length(scan_anchor_event_id) = 30 AND scan_anchor_event_id ~ '^evt-[0-7][0-9A-HJKMNP-TV-Z]*$')),
    scan_anchor_attempt_id text COLLATE "C"
        CHECK (scan_anchor_attempt_id IS NULL OR (octet_length(scan_anchor_attempt_id) = 30 AND scan_anchor_attempt_id ~ '^att-[0-7][0-9A-HJKMNP-TV-Z]*$')),
    UNIQUE (event_id, attempt_generation)
) WITH (fillfactor = 50);

-- The attempt id's format, without counted repetition (see the
-- outbox_events_formats_insert trigger): `^att-[0-7][0-9A-HJKMNP-TV-Z]{25}$`.
ALTER TABLE outbox_attempts ADD CONSTRAINT outbox_attempts_attempt_id_format
    CHECK (octet_length(attempt_id) = 30 AND attempt_id ~ '^att-[0-7][0-9A-HJKMNP-TV-Z]*$');

-- Each attempt names its envelope (see section 1).
CREATE FUNCTION outbox_attempts_check_references() RETURNS trigger LANGUAGE plpgsql
    SET enable_seqscan = off
    SET search_path FROM CURRENT
AS $$
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

CREATE TRIGGER outbox_attempts_never_deleted BEFORE DELETE ON outbox_attempts
    FOR EACH ROW EXECUTE FUNCTION outbox_never_deleted();
CREATE TRIGGER outbox_attempts_never_truncated BEFORE TRUNCATE ON outbox_attempts
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


-- =========================================================================
-- 9. Receipts
-- =========================================================================

-- Receipts name the topic identity of their log position: the Kafka topic
-- id the message's frozen destination names (`destination.v2`), NULL for a
-- `destination.v1`. A topic deleted and created again under the same name
-- starts a new log at offset 0: a position of the new log is not one of the
-- old, so the position key is (cluster, topic, topic id, partition, offset),
-- the topic id compared exactly (NULL matches only NULL). Text form of a
-- topic id: 16 bytes in URL-safe base64 without padding (22 characters).

-- The topic id a frozen destination's canonical bytes name: the `topicId`
-- field of a `destination.v2` (third field, after the length-prefixed
-- `clusterId` and `topic`), NULL for any other record. Bytes that claim
-- `destination.v2` and do not parse are refused: emit only stores bytes
-- outbox-core has parsed.
CREATE FUNCTION outbox_destination_topic_id(canonical bytea) RETURNS text
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    rest bytea;
    field text;
    digits bytea;
    colon integer;
    len integer;
BEGIN
    IF substring(canonical FROM 1 FOR 15) IS DISTINCT FROM convert_to(E'destination.v2\n', 'UTF8') THEN
        RETURN NULL;
    END IF;
    rest := substring(canonical FROM 16);
    FOREACH field IN ARRAY ARRAY['clusterId', 'topic', 'topicId'] LOOP
        -- <field>=<byte length>:<value>\n
        colon := position('\x3a'::bytea IN rest);
        IF substring(rest FROM 1 FOR length(field) + 1) IS DISTINCT FROM convert_to(field || '=', 'UTF8')
           OR colon NOT BETWEEN length(field) + 3 AND length(field) + 14 THEN
            RAISE EXCEPTION 'malformed destination.v2: field % expected', field USING ERRCODE = 'data_exception';
        END IF;
        digits := substring(rest FROM length(field) + 2 FOR colon - length(field) - 2);
        IF encode(digits, 'escape') !~ '^[0-9]{1,9}$' THEN
            RAISE EXCEPTION 'malformed destination.v2: field % has no length', field USING ERRCODE = 'data_exception';
        END IF;
        len := encode(digits, 'escape')::integer;
        IF length(rest) < colon + len + 1 OR get_byte(rest, colon + len) <> 10 THEN
            RAISE EXCEPTION 'malformed destination.v2: field % truncated', field USING ERRCODE = 'data_exception';
        END IF;
        IF field = 'topicId' THEN
            RETURN convert_from(substring(rest FROM colon + 1 FOR len), 'UTF8');
        END IF;
        rest := substring(rest FROM colon + len + 2);
    END LOOP;
    RETURN NULL;
END $$;

-- The single publish slot. Append-only.
CREATE TABLE outbox_publish_receipts (
    event_id            text COLLATE "C" NOT NULL,
    envelope_generation integer NOT NULL,
    attempt_id          text COLLATE "C" NOT NULL,
    cluster_id          text COLLATE "C" NOT NULL,
    topic               text COLLATE "C" NOT NULL,
    partition           integer NOT NULL CHECK (partition >= 0),
    "offset"            bigint NOT NULL CHECK ("offset" >= 0),
    payload_digest      text NOT NULL,
    destination_digest  text NOT NULL,
    accepted_at_ms      bigint NOT NULL,
    topic_id            text COLLATE "C"
        CHECK (topic_id IS NULL OR (topic_id ~ '^[A-Za-z0-9_-]{21}[AQgw]$' AND topic_id <> 'AAAAAAAAAAAAAAAAAAAAAA')),
    -- A replaced cluster (or a topic without a recorded id deleted and
    -- created again) starts each partition's log at offset 0 again. A
    -- genuine ACK (or a message a lookup read) at a position another
    -- event's receipt holds proves that receipt's log is gone: offsets are
    -- unique within one log. The new receipt is accepted one epoch above
    -- the receipts already at that position (the old one is kept, and
    -- reported as `receipt_position_lost`); positions are unique per epoch.
    position_epoch      integer NOT NULL DEFAULT 0 CHECK (position_epoch >= 0),
    -- The key the receipt's message carries: the receipt decision compares
    -- it with the frozen routing key (quarantine reason key_mismatch). NULL
    -- for a receipt recorded without it (not compared).
    message_key         bytea,
    -- A receipt of a stream event's attempt: the batch that registered it
    -- (section 17), where other receipts name a row of outbox_attempts.
    batch_id            bigint,
    -- The log's identity as the client that wrote (or read) the message
    -- knew it just before: the topic's id then (NULL: not known). Beside a
    -- destination.v1 (no topic_id) it tells which log of the partition's
    -- name the receipt is in: a consumer watermark kept under another log
    -- id does not cover it (outbox_core::WatermarkRef::anchor_agrees_with).
    log_id              text CHECK (log_id IS NULL OR length(log_id) <= 64),
    PRIMARY KEY (event_id, envelope_generation),
    -- One event per log position (per epoch), the position naming its
    -- topic identity. With the topic id before the partition, it serves the
    -- lookups of one log (the highest receipted offset of a partition of
    -- one topic id, where an attempt's scan starts).
    CONSTRAINT outbox_publish_receipts_position_key
        UNIQUE NULLS NOT DISTINCT (cluster_id, topic, topic_id, partition, "offset", position_epoch)
);
-- The position without the topic id, not unique, for the lookups by
-- position whatever the log (the bypass scan: which receipts claim the
-- offsets it read, or offsets past the log's end).
CREATE INDEX outbox_publish_receipts_position ON outbox_publish_receipts (cluster_id, topic, partition, "offset");
-- The receipts accepted above epoch 0 (rare: each one marks a partition
-- whose log was replaced), by partition: retention and the reconciler ask
-- of every destination.v1 receipt whether its partition holds one
-- (outbox_core::LogPosition::partition_replaced), in one probe.
CREATE INDEX outbox_publish_receipts_replaced ON outbox_publish_receipts (cluster_id, topic, partition)
    WHERE position_epoch > 0;
-- The scan floor of a destination.v1 attempt in one index probe.
-- Registration reads, per partition of its batch, the highest receipted
-- offset of the partition's log (the attempt's scan floor, with the
-- receipt's event and attempt as its anchor). For a destination.v2 the
-- position key answers that with one backward probe. For a destination.v1
-- (no topic id) neither of the indexes above can: the key cannot be read in
-- offset order under `topic_id IS NULL`, and the position index lacks the
-- epoch, so PostgreSQL would read every receipt of the partition and sort
-- them, once per partition per batch (under `dispatch_bench --preload`,
-- 100,000 events on 12 partitions, 176 us of the database's time per
-- event, and more the longer the table). This index holds only the
-- receipts of logs without a topic id, in the order the floor is read.
CREATE INDEX outbox_publish_receipts_v1_floor ON outbox_publish_receipts (cluster_id, topic, partition, "offset", position_epoch)
    WHERE topic_id IS NULL;
-- The scan floor of one partition's log, read by every registration (the
-- chains path's and the stream's cut): past its highest receipted offset,
-- with the receipt's event and attempt (the newest epoch) as the anchor by
-- which a lookup recognises the log; 0 and no anchor for a log without
-- receipts. One index probe: the position key for a topic id, the v1
-- floor index without one. Planned once per session (a SQL function with a
-- SET clause is planned again on every statement that calls it: 627 us
-- for a claim's 12 logs, against 360 us with this plan kept).
CREATE FUNCTION outbox_log_floor(p_cluster text, p_topic text, p_topic_id text, p_partition integer)
    RETURNS TABLE (scan_from bigint, scan_anchor text, scan_anchor_attempt text)
    LANGUAGE plpgsql STABLE
    SET plan_cache_mode = force_generic_plan
    SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN QUERY
    SELECT coalesce(top."offset" + 1, 0), top.event_id::text, top.attempt_id::text
    FROM (SELECT 1) one
    LEFT JOIN LATERAL (
        (SELECT r."offset", r.event_id, r.attempt_id FROM outbox_publish_receipts r
         WHERE p_topic_id IS NULL AND r.cluster_id = p_cluster AND r.topic = p_topic AND r.topic_id IS NULL AND r.partition = p_partition
         ORDER BY r."offset" DESC, r.position_epoch DESC LIMIT 1)
        UNION ALL
        (SELECT r."offset", r.event_id, r.attempt_id FROM outbox_publish_receipts r
         WHERE r.cluster_id = p_cluster AND r.topic = p_topic AND r.topic_id = p_topic_id AND r.partition = p_partition
         ORDER BY r."offset" DESC, r.position_epoch DESC LIMIT 1)
    ) top ON true;
END
$$;
CREATE TRIGGER outbox_publish_receipts_frozen BEFORE UPDATE OR DELETE ON outbox_publish_receipts
    FOR EACH ROW EXECUTE FUNCTION outbox_frozen();

-- Each receipt names its attempt and its envelope (see section 1).
CREATE FUNCTION outbox_publish_receipts_check_references() RETURNS trigger LANGUAGE plpgsql
    SET enable_seqscan = off
    SET search_path FROM CURRENT
AS $$
DECLARE bad record;
BEGIN
    SELECT n.event_id, n.envelope_generation, n.attempt_id, a.found AS attempt_found INTO bad FROM outbox_new_rows n
    LEFT JOIN LATERAL (SELECT true AS found FROM outbox_attempts x WHERE n.batch_id IS NULL AND x.attempt_id = n.attempt_id
                       UNION ALL
                       SELECT true FROM outbox_batches b WHERE b.id = n.batch_id AND n.event_id = ANY(b.event_ids)
                       LIMIT 1) a ON true
    -- A stream receipt's event is a stream row (generation 1); any other's an envelope.
    LEFT JOIN LATERAL (SELECT true AS found FROM outbox_envelopes v
                       WHERE n.batch_id IS NULL AND v.event_id = n.event_id AND v.envelope_generation = n.envelope_generation
                       UNION ALL
                       SELECT true FROM outbox_stream s WHERE n.batch_id IS NOT NULL AND n.envelope_generation = 1 AND s.event_id = n.event_id
                       LIMIT 1) r ON true
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

-- Every other genuine receipt of the same event: evidence, not an error.
CREATE TABLE outbox_duplicate_receipts (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id            text COLLATE "C" NOT NULL,
    envelope_generation integer NOT NULL,
    attempt_id          text COLLATE "C" NOT NULL REFERENCES outbox_attempts,
    cluster_id          text COLLATE "C" NOT NULL,
    topic               text COLLATE "C" NOT NULL,
    partition           integer NOT NULL,
    "offset"            bigint NOT NULL,
    payload_digest      text NOT NULL,
    destination_digest  text NOT NULL,
    received_at_ms      bigint NOT NULL,
    topic_id            text COLLATE "C"
        CHECK (topic_id IS NULL OR (topic_id ~ '^[A-Za-z0-9_-]{21}[AQgw]$' AND topic_id <> 'AAAAAAAAAAAAAAAAAAAAAA')),
    message_key         bytea,
    log_id              text CHECK (log_id IS NULL OR length(log_id) <= 64),
    CONSTRAINT outbox_duplicate_receipts_position_key
        UNIQUE NULLS NOT DISTINCT (event_id, envelope_generation, cluster_id, topic, topic_id, partition, "offset")
);

-- PUBLISHED, RETAINED and PURGED only with a primary receipt.
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


-- =========================================================================
-- 10. Quarantine and audit
-- =========================================================================

CREATE TABLE outbox_quarantine (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id            text COLLATE "C" NOT NULL,
    envelope_generation integer,
    attempt_id          text COLLATE "C",
    reason              text NOT NULL,
    evidence            jsonb NOT NULL,
    created_at_ms       bigint NOT NULL
);
CREATE INDEX outbox_quarantine_event ON outbox_quarantine (event_id);

-- Stale writes, refused receipts, operator actions.
CREATE TABLE outbox_audit (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id  text COLLATE "C",
    actor     text NOT NULL,
    action    text NOT NULL,
    detail    jsonb NOT NULL,
    at_ms     bigint NOT NULL
);
CREATE INDEX outbox_audit_event ON outbox_audit (event_id);


-- =========================================================================
-- 11. Reconciler: UNKNOWN resolutions, findings, rounds and scans
-- =========================================================================

-- Every resolution of an UNKNOWN: the SLO's raw data.
CREATE TABLE outbox_unknown_resolutions (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id         text   COLLATE "C" NOT NULL,
    unknown_since_ms bigint NOT NULL,
    resolved_at_ms   bigint NOT NULL,
    outcome          text   NOT NULL CHECK (outcome IN ('PUBLISHED', 'QUARANTINED', 'MIGRATED', 'SKIPPED'))
);
CREATE INDEX outbox_unknown_resolutions_at ON outbox_unknown_resolutions (resolved_at_ms);

-- The reconciler's lookups of UNKNOWN events, as evidence for `outbox
-- unknown show`: what the broker answered and what was decided.
CREATE TABLE outbox_unknown_lookups (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id  text   NOT NULL,
    owner     text   NOT NULL,
    at_ms     bigint NOT NULL,
    from_offset bigint NOT NULL,
    lookup    text   NOT NULL CHECK (length(lookup) <= 2000),
    decision  text   NOT NULL CHECK (length(decision) <= 2000)
);
CREATE INDEX outbox_unknown_lookups_event ON outbox_unknown_lookups (event_id, id);

-- Findings of the three-set comparison and of the other checks; open while
-- resolved_at_ms is NULL. Kinds:
--   aged_pending, unconsumed_published, bypass_publish, unknown_past_slo,
--   quarantined               the three-set comparison
--   absence_proof_refuted     a genuine message of an attempt closed ABSENT
--   unregistered_message      a message with the event's id that no registered attempt sent
--   receipt_position_lost     a receipt's log position no longer holds its event's message
--   published_without_receipt PUBLISHED/RETAINED/PURGED with no primary receipt
--   log_unavailable           a lookup could not prove anything: the log is truncated, recreated or compacted
--   foreign_source            a message on an outbox topic whose outbox-source is another
--                             outbox's, not declared to the reconciler
--   unrecorded_copy           a byte-identical copy of a published event at a position
--                             that is neither its primary nor a recorded duplicate receipt
--   divergent_copy            the same, with bytes whose digest differs from the event's
--   scan_gap                  offsets the log's start moved past (retention,
--                             DeleteRecords) before the bypass check read them
--   watermark_*, stale_watermark  raised by the watermark topic's reader (section 15)
-- The kinds from absence_proof_refuted to divergent_copy are evidence that
-- stays open until an operator closes it. `outbox findings ack` closes a
-- finding and records who and why (a condition that still holds opens a new
-- finding at the next round).
CREATE TABLE outbox_findings (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind           text   NOT NULL CHECK (kind IN (
        'aged_pending', 'unconsumed_published', 'bypass_publish', 'unknown_past_slo', 'quarantined',
        'absence_proof_refuted', 'unregistered_message', 'receipt_position_lost', 'published_without_receipt', 'log_unavailable',
        'foreign_source', 'unrecorded_copy', 'divergent_copy', 'scan_gap',
        'watermark_undeclared_consumer', 'watermark_moved_back', 'watermark_beyond_end', 'watermark_rejected', 'stale_watermark',
        'partition_count_changed', 'consumer_gap')),
    event_id       text   COLLATE "C" NOT NULL,
    consumer_id    text   NOT NULL DEFAULT '',
    detail         text   NOT NULL,
    age_ms         bigint NOT NULL,
    first_seen_ms  bigint NOT NULL,
    last_seen_ms   bigint NOT NULL,
    resolved_at_ms bigint,
    acked_by       text CHECK (length(acked_by) <= 200),
    acked_at_ms    bigint,
    ack_note       text CHECK (length(ack_note) <= 2000)
);
CREATE UNIQUE INDEX outbox_findings_open ON outbox_findings (kind, event_id, consumer_id) WHERE resolved_at_ms IS NULL;

-- The last round of each reconciler: `outbox status` and `outbox report`
-- show when the reconciler last compared the three sets, and a round older
-- than the staleness bound is a finding (a reconciler that is down cannot
-- record findings of its own). The SLO the reconciler holds UNKNOWNs to is
-- recorded with it, so the report judges the SLO by the same figure.
CREATE TABLE outbox_reconciler_rounds (
    owner             text    COLLATE "C" PRIMARY KEY,
    cluster_id        text    NOT NULL,
    last_round_at_ms  bigint  NOT NULL,
    interval_ms       bigint  NOT NULL CHECK (interval_ms >= 0),
    unknown_slo_ms    bigint  NOT NULL CHECK (unknown_slo_ms > 0),
    examined          integer NOT NULL CHECK (examined >= 0),
    open_findings     integer NOT NULL CHECK (open_findings >= 0),
    rounds            bigint  NOT NULL CHECK (rounds >= 1)
);

-- Counts per state over time, one row per reconciler round.
CREATE TABLE outbox_state_snapshots (
    at_ms  bigint NOT NULL,
    state  text   NOT NULL,
    count  bigint NOT NULL,
    PRIMARY KEY (at_ms, state)
);

-- Where the reconciler's sweep for PUBLISHED, RETAINED or PURGED events
-- without a primary receipt (rows written with triggers disabled) has got
-- to, by event id.
CREATE TABLE outbox_check_cursors (
    check_name     text PRIMARY KEY,
    after_event_id text NOT NULL
);

-- How far the bypass scan has read each partition. The cursor recognises
-- its log: a replaced cluster (or a topic deleted and created again) starts
-- the partition's log at offset 0 under the same cluster, topic and
-- partition, and once the new log has grown past the cursor, the offset
-- alone cannot tell. So the cursor keeps what the message below it was
-- (`anchor`, `outbox_core::compare::scan_anchor`): a page begins by reading
-- that offset again, and a log that holds another message there is read
-- from its start. NULL for a cursor at 0 and for a cursor whose previous
-- message was not read (trusted as it is).
CREATE TABLE outbox_scan_cursors (
    cluster_id  text    COLLATE "C" NOT NULL,
    topic       text    COLLATE "C" NOT NULL,
    partition   integer NOT NULL,
    next_offset bigint  NOT NULL,
    anchor      text    CHECK (anchor IS NULL OR octet_length(anchor) <= 512),
    PRIMARY KEY (cluster_id, topic, partition)
);

-- Messages seen in a topic that the outbox never committed (kept: evidence).
CREATE TABLE outbox_bypass_messages (
    cluster_id  text    COLLATE "C" NOT NULL,
    topic       text    COLLATE "C" NOT NULL,
    partition   integer NOT NULL,
    "offset"    bigint  NOT NULL,
    event_id    text    COLLATE "C",
    seen_at_ms  bigint  NOT NULL,
    -- The message's outbox-source header (NULL: none).
    source      text,
    PRIMARY KEY (cluster_id, topic, partition, "offset")
);


-- =========================================================================
-- 12. Routes
-- =========================================================================

-- Route policies, one row per generation of an event type's route.
-- Append-only: an event's destination freezes its route generation, so
-- what an event sends is fixed at its commit.
CREATE TABLE outbox_route_policies (
    event_type    text    NOT NULL,
    generation    integer NOT NULL CHECK (generation >= 1),
    cluster_id    text    COLLATE "C" NOT NULL,
    topic         text    COLLATE "C" NOT NULL,
    partitions    integer NOT NULL CHECK (partitions BETWEEN 1 AND 100000),
    partitioner   text    NOT NULL CHECK (partitioner IN ('murmur2')),
    key_template  text    NOT NULL,
    serializer    text    NOT NULL,
    durability    text    NOT NULL,
    required_acks text    NOT NULL CHECK (required_acks IN ('all', '1')),
    ordering      text    NOT NULL CHECK (ordering IN ('key', 'none')),
    created_at    timestamptz NOT NULL DEFAULT now(),
    -- CloudEvents Kafka protocol binding (binary mode): whether the
    -- generation's messages carry the CloudEvents headers, and the
    -- payload's media type.
    cloudevents   boolean NOT NULL DEFAULT true,
    content_type  text    NOT NULL DEFAULT 'application/octet-stream'
        CHECK (octet_length(content_type) BETWEEN 3 AND 200 AND content_type ~ '^[A-Za-z0-9!#$&^_.+-]+/[A-Za-z0-9!#$&^_.+-]+ *(;[ -~]*)?$'),
    -- The Kafka topic id of the generation's topic, learned when the route
    -- was set against the cluster (NULL: not learned). Events routed by a
    -- generation with an id freeze a `destination.v2` naming it, so a topic
    -- deleted and created again under the same name is another destination;
    -- the others freeze a `destination.v1`.
    topic_id      text
        CHECK (topic_id IS NULL OR (topic_id ~ '^[A-Za-z0-9_-]{21}[AQgw]$' AND topic_id <> 'AAAAAAAAAAAAAAAAAAAAAA')),
    PRIMARY KEY (event_type, generation)
);
CREATE TRIGGER outbox_route_policies_frozen BEFORE UPDATE OR DELETE ON outbox_route_policies
    FOR EACH ROW EXECUTE FUNCTION outbox_frozen();

-- Each route's poison policy, as set (`outbox route poison`): what becomes
-- of an event of the type that blocks its key for good (QUARANTINED):
-- `block` (the default: the key waits for an operator) or `skip` (the
-- reconciler closes it SKIPPED, recording this setting in the skip's
-- evidence). Insert-only: the latest row of an event type is in force,
-- the older ones are its history.
CREATE TABLE outbox_poison_policies (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_type text   NOT NULL,
    policy     text   NOT NULL CHECK (policy IN ('block', 'skip')),
    actor      text   NOT NULL,
    reason     text   NOT NULL CHECK (octet_length(reason) BETWEEN 1 AND 1000),
    at_ms      bigint NOT NULL
);
CREATE INDEX outbox_poison_policies_type ON outbox_poison_policies (event_type, id);
CREATE TRIGGER outbox_poison_policies_frozen BEFORE UPDATE OR DELETE ON outbox_poison_policies
    FOR EACH ROW EXECUTE FUNCTION outbox_frozen();


-- =========================================================================
-- 13. Rollout: takeover, shadow mode, dispatcher alias
-- =========================================================================

-- Rollout and rollback (SPEC §11): shadow mode, partial takeover by event
-- type and eventId hash, and the dispatcher alias. Who sends each event is
-- outbox_events.publisher.

-- Takeover policies, one row per generation; the highest is current. The
-- outbox owns an event iff its event type is listed AND
-- takeover_bucket(eventId) < percent_bp (basis points, 0..=10000).
-- Shadow mode is a policy that selects nothing (no event types, or 0 bp).
CREATE TABLE outbox_takeover_policies (
    generation  integer PRIMARY KEY CHECK (generation >= 1),
    event_types text[]  NOT NULL,
    percent_bp  integer NOT NULL CHECK (percent_bp BETWEEN 0 AND 10000),
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- Shadow mode: the message the dispatcher would have sent, built exactly as
-- it would build it, never sent. headers_digest leaves out the attempt id
-- (every attempt has its own).
CREATE TABLE outbox_shadow_attempts (
    event_id           text    COLLATE "C" PRIMARY KEY REFERENCES outbox_events,
    topic              text    COLLATE "C" NOT NULL,
    partition          integer NOT NULL,
    key                bytea   NOT NULL,
    payload_digest     text    NOT NULL,
    destination_digest text    NOT NULL,
    headers_digest     text    NOT NULL,
    built_at_ms        bigint  NOT NULL,
    -- Where the current publisher's first message of this eventId was seen.
    seen_topic         text,
    seen_partition     integer,
    seen_offset        bigint,
    seen_at_ms         bigint
);
CREATE INDEX outbox_shadow_attempts_unseen ON outbox_shadow_attempts (built_at_ms) WHERE seen_offset IS NULL;

-- How far the shadow comparison has read each partition. Same shape as
-- outbox_scan_cursors (the same code writes both), but no anchor.
CREATE TABLE outbox_shadow_cursors (
    cluster_id  text    COLLATE "C" NOT NULL,
    topic       text    COLLATE "C" NOT NULL,
    partition   integer NOT NULL,
    next_offset bigint  NOT NULL,
    anchor      text    CHECK (anchor IS NULL),
    PRIMARY KEY (cluster_id, topic, partition)
);

-- What the shadow comparison found; open while resolved_at_ms is NULL (a
-- 'missing' message that shows up late is resolved).
CREATE TABLE outbox_shadow_mismatches (
    event_id       text   COLLATE "C" NOT NULL,
    kind           text   NOT NULL CHECK (kind IN ('missing', 'extra', 'different_bytes', 'different_partition')),
    detail         text   NOT NULL,
    found_at_ms    bigint NOT NULL,
    resolved_at_ms bigint,
    PRIMARY KEY (event_id, kind)
);

-- The dispatcher alias: dispatchers configured with an alias claim only
-- while the alias names their implementation. Switching it is the rollback.
CREATE TABLE outbox_dispatcher_aliases (
    alias            text    PRIMARY KEY,
    implementation   text    NOT NULL,
    protocol_version integer NOT NULL CHECK (protocol_version >= 1),
    switched_at_ms   bigint  NOT NULL
);
CREATE TABLE outbox_dispatcher_alias_history (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    alias            text    NOT NULL,
    implementation   text    NOT NULL,
    protocol_version integer NOT NULL,
    previous         text,
    switched_at_ms   bigint  NOT NULL
);
CREATE TRIGGER outbox_dispatcher_alias_history_frozen BEFORE UPDATE OR DELETE ON outbox_dispatcher_alias_history
    FOR EACH ROW EXECUTE FUNCTION outbox_frozen();


-- =========================================================================
-- 14. Destination migrations
-- =========================================================================

-- A destination migration: the old generation proven absent from its target,
-- the new generation with its new frozen destination.
CREATE TABLE outbox_migration_receipts (
    id                      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id                text    COLLATE "C" NOT NULL REFERENCES outbox_events,
    from_generation         integer NOT NULL,
    to_generation           integer NOT NULL,
    from_destination_digest text    NOT NULL,
    to_destination_digest   text    NOT NULL,
    proof                   jsonb   NOT NULL,
    operator                text    NOT NULL,
    at_ms                   bigint  NOT NULL,
    UNIQUE (event_id, to_generation),
    CHECK (to_generation = from_generation + 1)
);


-- =========================================================================
-- 15. Consumer registry and watermarks
-- =========================================================================

-- Consumers whose watermarks the reconciler compares (critical) and that
-- retention waits for (mandatory), and which topics each reads (a critical
-- consumer is compared only against events on its topics).
CREATE TABLE outbox_consumers (
    consumer_id text PRIMARY KEY,
    critical    boolean NOT NULL DEFAULT true,
    mandatory   boolean NOT NULL DEFAULT true,
    created_at  timestamptz NOT NULL DEFAULT now(),
    topics      text[] NOT NULL DEFAULT '{}'
);

-- Consumers publish their watermarks over the broker (the watermark topic,
-- `outbox.watermarks` by default, one per cluster); the producer side reads
-- it and applies the records to outbox_consumer_watermarks (the consumer
-- crate's table). The reader keeps its read position and, per consumer and
-- cluster, when a record last arrived (for stale_watermark); the findings
-- it raises are the watermark_* kinds of outbox_findings.

-- How far the reader has applied each partition of the watermark topic. The
-- position moves in the transaction that applies the records below it, so a
-- record is applied once; a first read starts at the log's start.
CREATE TABLE outbox_watermark_topic_cursors (
    cluster_id  text    NOT NULL,
    topic       text    NOT NULL,
    partition   integer NOT NULL CHECK (partition >= 0),
    next_offset bigint  NOT NULL CHECK (next_offset >= 0),
    PRIMARY KEY (cluster_id, topic, partition)
);

-- Per declared consumer and cluster: when its last acceptable record was
-- read (the reader's clock), the consumer's own time in it, and counts.
CREATE TABLE outbox_watermark_publishers (
    consumer_id          text   NOT NULL,
    cluster_id           text   NOT NULL,
    last_received_ms     bigint NOT NULL,
    last_published_at_ms bigint NOT NULL,
    records_accepted     bigint NOT NULL DEFAULT 0 CHECK (records_accepted >= 0),
    records_ignored      bigint NOT NULL DEFAULT 0 CHECK (records_ignored >= 0),
    -- The database that decided a consumer's watermark records (the
    -- outbox-watermark-decider header: its PostgreSQL system identifier and
    -- database name). The watermark topic's reader pins the first one it sees
    -- per consumer and cluster; a record of another database under the same
    -- consumer id (a scratch replay, a copy of the consumer's database) is a
    -- watermark_rejected finding and moves nothing. `outbox watermarks repin`
    -- clears it when the consumer's database really moved.
    decider              text CHECK (decider IS NULL OR length(decider) BETWEEN 1 AND 200),
    PRIMARY KEY (consumer_id, cluster_id)
);


-- =========================================================================
-- 16. Protocol version and source identity
-- =========================================================================

CREATE TABLE outbox_meta (
    key   text PRIMARY KEY,
    value text NOT NULL
);
INSERT INTO outbox_meta (key, value) VALUES ('protocol_version', '1');

-- The outbox's source identity (CloudEvents `ce_source`): made once, when
-- this schema is created, and never changed, so `ce_source` + `ce_id` name
-- an event the same way on every attempt for as long as the database
-- lives. A copy of the database (a restored backup, a clone) keeps it.
CREATE TABLE outbox_identity (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    source     text NOT NULL CHECK (octet_length(source) BETWEEN 1 AND 200 AND source !~ '[^!-~]'),
    created_at timestamptz NOT NULL DEFAULT now()
);
-- The operator may name it when the schema is made (`outbox migrate
-- --source`, `outbox_producer::migrate_with_source`: the migrating
-- session's `outbox.source` setting), so that consumers can be configured
-- before this database exists; otherwise it is a random `urn:uuid:`.
INSERT INTO outbox_identity (source)
    VALUES (coalesce(nullif(current_setting('outbox.source', true), ''), 'urn:uuid:' || gen_random_uuid()));
CREATE TRIGGER outbox_identity_frozen BEFORE UPDATE OR DELETE ON outbox_identity
    FOR EACH ROW EXECUTE FUNCTION outbox_frozen();
CREATE TRIGGER outbox_identity_never_truncated BEFORE TRUNCATE ON outbox_identity
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_frozen();


-- =========================================================================
-- 17. The stream: the insert-only dispatch path
-- =========================================================================

-- Which path new events take (ARCHITECTURE.md, "The stream"): 'chains'
-- (each event a row of outbox_events, claimed through the chain heads) or
-- 'stream' (each event a row of outbox_stream, dispatched in batches cut
-- by snapshot per key bucket; an event that leaves the happy path is
-- copied into outbox_events, the exception lane, and goes on there).
-- `outbox_producer::set_dispatch_path` switches it.
--
-- aggregate_heads: which emits write their aggregates' head rows
-- (outbox_aggregate_heads, section 5): 'snapshot_isolation' (emits at
-- REPEATABLE READ or SERIALIZABLE) or 'always' (every emit).
-- `outbox_producer::set_aggregate_heads` switches it.
CREATE TABLE outbox_settings (
    singleton     boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    dispatch_path text NOT NULL DEFAULT 'chains' CHECK (dispatch_path IN ('chains', 'stream')),
    aggregate_heads text NOT NULL DEFAULT 'snapshot_isolation' CHECK (aggregate_heads IN ('snapshot_isolation', 'always'))
);
INSERT INTO outbox_settings DEFAULT VALUES;

-- One row per event, inserted by emit and never updated: the envelope and
-- the destination inline, the creating transaction's id (a batch is the
-- bucket's rows whose transaction completed between two snapshots,
-- `outbox_core::stream::in_batch`), the key bucket. `seq` is drawn from
-- outbox_events' sequence, so an event keeps its place when it is copied
-- into the lane. Partitioned by range of seq, so that retention can drop
-- whole partitions; the default partition takes what no range holds.
CREATE TABLE outbox_stream (
    seq                   bigint NOT NULL DEFAULT nextval('outbox_events_seq_seq') CHECK (seq > 0),
    xid                   xid8 NOT NULL DEFAULT pg_current_xact_id(),
    bucket                smallint NOT NULL CHECK (bucket >= 0 AND bucket < 64),
    event_id              text COLLATE "C" NOT NULL,
    command_key           text COLLATE "C" NOT NULL,
    protocol_version      smallint NOT NULL DEFAULT 1,
    tenant                text NOT NULL,
    aggregate_type        text NOT NULL,
    aggregate_id          text NOT NULL,
    aggregate_version     bigint NOT NULL CHECK (aggregate_version >= 0),
    event_type            text NOT NULL,
    traceparent           text,
    tracestate            text,
    payload               bytea NOT NULL CHECK (octet_length(payload) > 0),
    payload_digest        text NOT NULL,
    cluster_id            text COLLATE "C" NOT NULL,
    topic                 text COLLATE "C" NOT NULL,
    -- The frozen destination's topic id (NULL: destination.v1).
    topic_id              text COLLATE "C",
    partition             integer NOT NULL CHECK (partition >= 0),
    routing_key           text COLLATE "C" NOT NULL,
    ordered               boolean NOT NULL,
    envelope_canonical    bytea NOT NULL,
    envelope_digest       text NOT NULL,
    destination_canonical bytea NOT NULL,
    destination_digest    text NOT NULL,
    created_txid          bigint NOT NULL,
    created_at_ms         bigint NOT NULL,
    takeover_generation   integer,
    -- outbox_events.key_chain's expression: the lane and the stream name a key alike.
    key_chain             bigint NOT NULL
        GENERATED ALWAYS AS (hashtextextended(length(cluster_id) || ':' || cluster_id || length(topic) || ':' || topic || routing_key, 0)) STORED
) PARTITION BY RANGE (seq);
CREATE TABLE outbox_stream_p0 PARTITION OF outbox_stream FOR VALUES FROM (MINVALUE) TO (16777216);
CREATE TABLE outbox_stream_p1 PARTITION OF outbox_stream FOR VALUES FROM (16777216) TO (33554432);
CREATE TABLE outbox_stream_default PARTITION OF outbox_stream DEFAULT;
-- A new window's lowest seq is found through its transactions' ids; the
-- window is then read in seq order (outbox_stream_window). The seq index
-- is partial (every seq is above 0) so that only a query saying `seq > 0`
-- can use it: the lowest seq's query does not, and so is never planned as
-- a read of the bucket's whole history in seq order, which PostgreSQL
-- would choose on a partition without statistics yet (a new partition),
-- where both indexes look alike.
CREATE INDEX outbox_stream_cut ON outbox_stream (cluster_id, bucket, xid);
CREATE INDEX outbox_stream_window_seq ON outbox_stream (cluster_id, bucket, seq) WHERE seq > 0;
-- Readers of one event (state, trace, receipts).
CREATE INDEX outbox_stream_event ON outbox_stream (event_id);
CREATE TRIGGER outbox_stream_frozen BEFORE UPDATE OR DELETE ON outbox_stream
    FOR EACH ROW EXECUTE FUNCTION outbox_frozen();

-- Partitions ahead of the stream: outbox_stream_p<n> holds seqs
-- [n * 2^24, (n + 1) * 2^24) (p0 from the lowest). Creates and attaches
-- the partitions up to `p_ahead` past the one the sequence is in, so that
-- events never land in the default partition (whose rows no partition can
-- take over, and which retention cannot drop). Each is created alone,
-- then attached: the attach takes a SHARE UPDATE EXCLUSIVE lock on the
-- stream, which neither emits nor claims conflict with, and an ACCESS
-- EXCLUSIVE lock on the default partition, which every reader of the
-- whole stream holds a share of while it runs. So it waits at most
-- lock_timeout (100 ms: claims that read the stream meanwhile wait behind
-- it that long at most), and gives up until its next call (retention's
-- pass calls it) when a reader holds the default partition. A range the
-- sequence is already in is not attached if its rows went to the default
-- partition (the attach would fail on them): partitions start past it.
-- Answers how many it attached.
CREATE FUNCTION outbox_stream_partitions_ahead(p_ahead integer) RETURNS integer
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path FROM CURRENT
    SET lock_timeout = '100ms'
AS $$
DECLARE
    width constant bigint := 16777216;
    have integer;
    cur integer;
    lower_ integer;
    n integer;
    made integer := 0;
    part text;
BEGIN
    IF p_ahead IS NULL OR p_ahead < 1 OR p_ahead > 64 THEN
        RAISE EXCEPTION 'partitions ahead: 1 to 64, not %', p_ahead;
    END IF;
    SELECT max(substring(c.relname FROM '^outbox_stream_p([0-9]+)$')::integer) INTO have
    FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
    WHERE i.inhparent = 'outbox_stream'::regclass AND c.relname ~ '^outbox_stream_p[0-9]+$';
    cur := ((SELECT last_value FROM outbox_events_seq_seq) / width)::integer;
    lower_ := coalesce(have, -1) + 1;
    IF lower_ <= cur AND EXISTS (SELECT 1 FROM outbox_stream_default) THEN
        lower_ := cur + 1;
    END IF;
    FOR n IN lower_ .. cur + p_ahead LOOP
        part := format('outbox_stream_p%s', n);
        BEGIN
            EXECUTE format('CREATE TABLE IF NOT EXISTS %I (LIKE outbox_stream INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING GENERATED)', part);
            EXECUTE format('ALTER TABLE outbox_stream ATTACH PARTITION %I FOR VALUES FROM (%s) TO (%s)', part, n * width, (n + 1) * width);
            made := made + 1;
        EXCEPTION WHEN lock_not_available THEN
            RAISE NOTICE 'outbox_stream_partitions_ahead: % not attached: a reader holds the default partition; the next call tries again', part;
            RETURN made;
        END;
    END LOOP;
    RETURN made;
END
$$;
REVOKE EXECUTE ON FUNCTION outbox_stream_partitions_ahead(integer) FROM PUBLIC;

-- Retention drops a stream partition once every event in it is in the
-- exception lane (settled there, or retained there for the replay window),
-- so that the stream's storage goes by the partition, never by a DELETE.
-- Two passes at least: a partition the sequence has left is first marked
-- with the transaction horizon of that moment (seen_xmax); a transaction
-- that drew a seq in it and has not committed is below that horizon, and
-- no later transaction can draw one there. Once every transaction below
-- the mark has ended, the partition's rows are final: if each has its lane
-- row, the partition is detached and dropped under a lock timeout of
-- 100 ms (a reader of the whole stream holding it makes the drop give up
-- until a later pass; emits and claims queue behind the waiting detach for
-- at most that long).
CREATE TABLE outbox_stream_drops (
    partition    text COLLATE "C" PRIMARY KEY,
    seen_xmax    xid8 NOT NULL,
    marked_at_ms bigint NOT NULL
);
CREATE FUNCTION outbox_stream_drop_settled(p_max integer) RETURNS integer
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path FROM CURRENT
    SET lock_timeout = '100ms'
AS $$
DECLARE
    width constant bigint := 16777216;
    cur integer;
    r record;
    mark xid8;
    settled boolean;
    dropped integer := 0;
BEGIN
    IF p_max IS NULL OR p_max < 1 OR p_max > 64 THEN
        RAISE EXCEPTION 'stream partitions to drop: 1 to 64, not %', p_max;
    END IF;
    cur := ((SELECT last_value FROM outbox_events_seq_seq) / width)::integer;
    FOR r IN
        SELECT c.relname::text AS part, substring(c.relname FROM '^outbox_stream_p([0-9]+)$')::integer AS n
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = 'outbox_stream'::regclass AND c.relname ~ '^outbox_stream_p[0-9]+$'
        ORDER BY 2
    LOOP
        -- The partition the sequence is in, and those past it, stay.
        EXIT WHEN r.n >= cur OR dropped >= p_max;
        SELECT d.seen_xmax INTO mark FROM outbox_stream_drops d WHERE d.partition = r.part;
        IF NOT FOUND THEN
            INSERT INTO outbox_stream_drops (partition, seen_xmax, marked_at_ms)
            VALUES (r.part, pg_snapshot_xmax(pg_current_snapshot()), (extract(epoch FROM clock_timestamp()) * 1000)::bigint);
            -- Its rows are final only once the transactions below the mark end.
            RETURN dropped;
        END IF;
        IF pg_snapshot_xmin(pg_current_snapshot()) < mark THEN
            RETURN dropped;
        END IF;
        EXECUTE format('SELECT NOT EXISTS (SELECT 1 FROM %I s WHERE NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = s.event_id))', r.part)
            INTO settled;
        IF NOT settled THEN
            RETURN dropped;
        END IF;
        BEGIN
            EXECUTE format('ALTER TABLE outbox_stream DETACH PARTITION %I', r.part);
            EXECUTE format('DROP TABLE %I', r.part);
            DELETE FROM outbox_stream_drops d WHERE d.partition = r.part;
            dropped := dropped + 1;
        EXCEPTION WHEN lock_not_available THEN
            RAISE NOTICE 'outbox_stream_drop_settled: % not dropped: a reader holds the stream; the next call tries again', r.part;
            RETURN dropped;
        END;
    END LOOP;
    RETURN dropped;
END
$$;
REVOKE EXECUTE ON FUNCTION outbox_stream_drop_settled(integer) FROM PUBLIC;

-- Each bucket of a cluster's keys has one lease: who cuts and sends its
-- batches, until when, under which generation (every grant raises it and
-- fences the holders before). `prev_cut`..`cut` is the window the bucket's
-- batches are taken from, `after_seq` how far into it (a batch takes at
-- most the claim's limit); `window_done` says the next batch needs a new
-- snapshot; `cut_seq` bounds the seqs of the window's events (every event
-- of a transaction visible in `cut` drew its seq before that snapshot was
-- taken). `open_batch` is the batch being sent. Written per grant,
-- renewal and cut, never per event.
--
-- Insert-only, so that a held snapshot (a long report, an idle
-- transaction, a replication slot) leaves no row versions for the hot path
-- to walk: an updated row keeps every version since the oldest snapshot,
-- and each read of it walks them all. So the state is a log, one row per
-- write, read newest first (one index descent; the rows behind it are
-- never read), and the lock is a row of its own that is locked, never
-- written:
-- - `outbox_bucket_slots`: one row per cluster and bucket, inserted once.
--   A claim locks the slots it cuts (FOR UPDATE SKIP LOCKED), a
--   registration or a receipt the slots of its batches (FOR SHARE), a
--   renewal, a takeover or a move to the lane FOR UPDATE. A row lock writes
--   no row version.
-- - `outbox_bucket_lease_log`: the state, a row per write by a holder of
--   the slot's lock, read after the lock is held (in a later statement, so
--   in a snapshot that sees every write of the holders before).
--   `outbox_bucket_lease_log_prune` (run by the lease sweep) deletes the
--   rows behind each slot's newest.
-- - `outbox_bucket_leases`: each slot with its newest state (a view).
CREATE TABLE outbox_bucket_slots (
    cluster_id     text COLLATE "C" NOT NULL,
    bucket         smallint NOT NULL CHECK (bucket >= 0 AND bucket < 64),
    PRIMARY KEY (cluster_id, bucket)
);
CREATE TRIGGER outbox_bucket_slots_frozen BEFORE UPDATE OR DELETE ON outbox_bucket_slots
    FOR EACH ROW EXECUTE FUNCTION outbox_frozen();
CREATE TABLE outbox_bucket_lease_log (
    cluster_id     text COLLATE "C" NOT NULL,
    bucket         smallint NOT NULL CHECK (bucket >= 0 AND bucket < 64),
    seq            bigint GENERATED ALWAYS AS IDENTITY,
    owner          text,
    generation     bigint NOT NULL DEFAULT 0,
    lease_until_ms bigint NOT NULL DEFAULT 0,
    prev_cut       pg_snapshot NOT NULL DEFAULT '1:1:',
    cut            pg_snapshot NOT NULL DEFAULT '1:1:',
    after_seq      bigint NOT NULL DEFAULT 0,
    cut_seq        bigint NOT NULL DEFAULT 0,
    window_done    boolean NOT NULL DEFAULT true,
    open_batch     bigint,
    PRIMARY KEY (cluster_id, bucket, seq)
);
-- The prune's order (rows behind the newest, oldest first).
CREATE INDEX outbox_bucket_lease_log_seq ON outbox_bucket_lease_log (seq);
CREATE TRIGGER outbox_bucket_lease_log_frozen BEFORE UPDATE ON outbox_bucket_lease_log
    FOR EACH ROW EXECUTE FUNCTION outbox_frozen();
-- The one definition of "a slot's newest state" (with its row's `seq`);
-- every reader, the locking functions and the prune read through it.
CREATE VIEW outbox_bucket_leases AS
    SELECT k.cluster_id, k.bucket, l.owner, l.generation, l.lease_until_ms, l.prev_cut, l.cut, l.after_seq, l.cut_seq, l.window_done, l.open_batch,
           l.seq AS state_seq
    FROM outbox_bucket_slots k
    CROSS JOIN LATERAL (SELECT g.owner, g.generation, g.lease_until_ms, g.prev_cut, g.cut, g.after_seq, g.cut_seq, g.window_done, g.open_batch, g.seq
                        FROM outbox_bucket_lease_log g WHERE g.cluster_id = k.cluster_id AND g.bucket = k.bucket
                        ORDER BY g.seq DESC LIMIT 1) l;

-- Deletes the lease log's rows behind each slot's newest, at most p_limit,
-- oldest first, of seq above p_after (the caller's last answer: every row
-- at or below it is deleted already, so rows a held snapshot keeps are not
-- read again). Answers how far every row is deleted: below the lowest of
-- the slots' newest rows every row is behind its slot's newest. One prune
-- at a time (every dispatcher's lease sweep runs one): a prune that finds
-- another running returns at once, rather than wait for its row locks.
CREATE FUNCTION outbox_bucket_lease_log_prune(p_after bigint, p_limit integer) RETURNS bigint
    LANGUAGE plpgsql VOLATILE
    SET search_path FROM CURRENT
AS $$
DECLARE
    v_floor bigint;
    v_deleted bigint;
    v_max bigint;
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtextextended('outbox_bucket_lease_log_prune', 0)) THEN
        RETURN p_after;
    END IF;
    SELECT min(l.state_seq) INTO v_floor FROM outbox_bucket_leases l;
    IF v_floor IS NULL THEN
        RETURN p_after;
    END IF;
    WITH gone AS (
        DELETE FROM outbox_bucket_lease_log g
        WHERE g.seq IN (
            SELECT x.seq FROM outbox_bucket_lease_log x
            WHERE x.seq > p_after
              AND x.seq < (SELECT l.state_seq FROM outbox_bucket_leases l WHERE l.cluster_id = x.cluster_id AND l.bucket = x.bucket)
            ORDER BY x.seq LIMIT p_limit)
        RETURNING g.seq)
    SELECT count(*), max(gone.seq) INTO v_deleted, v_max FROM gone;
    IF v_deleted >= p_limit THEN
        RETURN greatest(p_after, least(v_floor - 1, v_max));
    END IF;
    RETURN greatest(p_after, v_floor - 1);
END
$$;

-- One row per batch, inserted by the cut (its registration: every event of
-- it may be sent from then on). The id is the claim generation of its
-- events; an attempt id names (batch, index) (`outbox_core::stream::batch_attempt_id`).
-- `floors` holds each partition log's scan floor at the cut, as an
-- attempt's registration records it.
CREATE TABLE outbox_batches (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    cluster_id       text COLLATE "C" NOT NULL,
    bucket           smallint NOT NULL,
    lease_generation bigint NOT NULL,
    owner            text NOT NULL,
    prev_cut         pg_snapshot NOT NULL,
    cut              pg_snapshot NOT NULL,
    after_seq        bigint NOT NULL,
    event_ids        text[] NOT NULL,
    -- Per event: its ordering key (NULL: unordered), and its log's entry in `floors`.
    keys             text[] NOT NULL,
    floor_of         integer[] NOT NULL,
    cut_at_ms        bigint NOT NULL,
    registered_db_ms bigint NOT NULL DEFAULT ((extract(epoch FROM clock_timestamp()) * 1000)::bigint),
    floors           jsonb NOT NULL DEFAULT '[]'
);
CREATE TRIGGER outbox_batches_frozen BEFORE UPDATE OR DELETE ON outbox_batches
    FOR EACH ROW EXECUTE FUNCTION outbox_frozen();

-- The steps of a batch's events, one row per claim round or registration,
-- never per event: `handed` (given to the owner in a claim: one send in
-- flight per key, so a key's next event is handed out once the previous
-- one is settled) and `registered` (the owner registered their attempts:
-- they may be sent). A registered event without a receipt when the lease
-- runs out is DISPATCH_UNKNOWN; a handed one that was not registered was
-- never sent.
CREATE TABLE outbox_batch_steps (
    batch_id  bigint NOT NULL,
    kind      text NOT NULL CHECK (kind IN ('handed', 'registered')),
    round     integer NOT NULL,
    positions integer[] NOT NULL,
    at_ms     bigint NOT NULL,
    PRIMARY KEY (batch_id, kind, round)
);
CREATE TRIGGER outbox_batch_steps_frozen BEFORE UPDATE OR DELETE ON outbox_batch_steps
    FOR EACH ROW EXECUTE FUNCTION outbox_frozen();

-- The events per state, wherever they live, as outbox_event_state reads
-- one: the lane's rows by their state; a stream event with no lane row
-- PUBLISHED with a receipt in its slot, else SENDING or CLAIMED as its
-- bucket's open batch registered or handed it out, else PENDING. Reads
-- every row of both (as a count of the lane alone did): for `outbox status`
-- and the report, not for a hot path.
CREATE FUNCTION outbox_state_counts() RETURNS TABLE (state text, n bigint)
    LANGUAGE sql STABLE
    SET search_path FROM CURRENT
AS $$
    WITH open_batch AS (
        SELECT x.event_id,
               EXISTS (SELECT 1 FROM outbox_batch_steps st WHERE st.batch_id = b.id AND st.kind = 'registered' AND (x.pos - 1)::int = ANY (st.positions)) AS registered,
               EXISTS (SELECT 1 FROM outbox_batch_steps st WHERE st.batch_id = b.id AND st.kind = 'handed' AND (x.pos - 1)::int = ANY (st.positions)) AS handed
        FROM outbox_bucket_leases l JOIN outbox_batches b ON b.id = l.open_batch
        CROSS JOIN unnest(b.event_ids) WITH ORDINALITY AS x(event_id, pos)),
    stream AS (
        SELECT CASE
                 WHEN EXISTS (SELECT 1 FROM outbox_publish_receipts r WHERE r.event_id = s.event_id AND r.envelope_generation = 1) THEN 'PUBLISHED'
                 WHEN o.registered THEN 'SENDING'
                 WHEN o.handed THEN 'CLAIMED'
                 ELSE 'PENDING' END AS state
        FROM outbox_stream s LEFT JOIN open_batch o ON o.event_id = s.event_id
        WHERE NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = s.event_id))
    SELECT t.state, sum(t.n)::bigint FROM (
        SELECT e.state, count(*) AS n FROM outbox_events e GROUP BY e.state
        UNION ALL
        SELECT x.state, count(*) FROM stream x GROUP BY x.state) t
    GROUP BY t.state
$$;

-- The stream's open events (no receipt in the slot, no lane row) created
-- before p_created_before, oldest first, at most p_limit, with their
-- state: the reconciler's aged-event candidates. Found per key bucket
-- through its frontier, as outbox_oldest_pending_ms finds the oldest: its
-- open batch's unsettled events (CLAIMED or SENDING once handed out or
-- registered), the rest of a window not read to its end, the events not
-- cut yet, and for a bucket without a lease row its first events; never
-- the published history (a query for "no receipt" over the whole stream
-- read every row of it, every round). With p_pending_only, only the events
-- not handed out (PENDING).
CREATE FUNCTION outbox_stream_open(p_created_before bigint, p_limit integer, p_pending_only boolean)
    RETURNS TABLE (event_id text, state text, created_at_ms bigint, seq bigint)
    LANGUAGE plpgsql STABLE
    SET enable_seqscan = off
    SET jit = off
    SET plan_cache_mode = force_generic_plan
    SET search_path FROM CURRENT
AS $$
DECLARE
    l record;
BEGIN
    RETURN QUERY
    WITH unleased AS MATERIALIZED (
        -- Buckets with no lease row yet (a route added since the claims made them).
        SELECT rc.cluster_id, bk::smallint AS bucket
        FROM (SELECT DISTINCT p.cluster_id FROM outbox_route_policies p) rc CROSS JOIN generate_series(0, 63) bk
        WHERE NOT EXISTS (SELECT 1 FROM outbox_bucket_leases x WHERE x.cluster_id = rc.cluster_id AND x.bucket = bk)),
    frontier AS (
        -- Each lease row's open batch (a lateral read per row, bounded, so
        -- that no plan reads every batch).
        SELECT x.event_id, x.state, x.created_at_ms, x.seq
        FROM outbox_bucket_leases lb
        CROSS JOIN LATERAL (
            SELECT u.event_id::text,
                   CASE WHEN EXISTS (SELECT 1 FROM outbox_batch_steps st WHERE st.batch_id = b.id AND st.kind = 'registered' AND (u.pos - 1)::int = ANY (st.positions)) THEN 'SENDING'
                        WHEN EXISTS (SELECT 1 FROM outbox_batch_steps st WHERE st.batch_id = b.id AND st.kind = 'handed' AND (u.pos - 1)::int = ANY (st.positions)) THEN 'CLAIMED'
                        ELSE 'PENDING' END AS state,
                   s.created_at_ms, s.seq
            FROM outbox_batches b
            CROSS JOIN unnest(b.event_ids) WITH ORDINALITY AS u(event_id, pos)
            JOIN outbox_stream s ON s.event_id = u.event_id
            WHERE b.id = lb.open_batch
              AND NOT EXISTS (SELECT 1 FROM outbox_publish_receipts r WHERE r.event_id = u.event_id AND r.envelope_generation = 1)
              AND NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = u.event_id)
            LIMIT 1000) x
        WHERE lb.open_batch IS NOT NULL AND (NOT p_pending_only OR x.state = 'PENDING')
        UNION ALL
        SELECT w.event_id, 'PENDING', w.created_at_ms, w.seq
        FROM outbox_bucket_leases lw
        CROSS JOIN LATERAL (
            SELECT s.event_id::text, s.created_at_ms, s.seq FROM outbox_stream s
            WHERE NOT lw.window_done AND s.cluster_id = lw.cluster_id AND s.bucket = lw.bucket
              AND s.xid >= pg_snapshot_xmin(lw.prev_cut) AND s.xid < pg_snapshot_xmax(lw.cut)
              AND pg_visible_in_snapshot(s.xid, lw.cut) AND NOT pg_visible_in_snapshot(s.xid, lw.prev_cut)
              AND s.seq + 0 > lw.after_seq AND s.created_at_ms < p_created_before
              AND NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = s.event_id)
            ORDER BY s.seq + 0 LIMIT p_limit) w
        UNION ALL
        -- Not cut yet: begun at or after the cut (past its xmax), or running
        -- when it was taken (between its xmin and xmax, not visible): two
        -- ranges of the bucket's transaction ids, never the cut's own.
        SELECT c.event_id, 'PENDING', c.created_at_ms, c.seq
        FROM outbox_bucket_leases lc
        CROSS JOIN LATERAL (
            (SELECT s.event_id::text, s.created_at_ms, s.seq FROM outbox_stream s
             WHERE s.cluster_id = lc.cluster_id AND s.bucket = lc.bucket AND s.xid >= pg_snapshot_xmax(lc.cut)
               AND s.created_at_ms < p_created_before
               AND NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = s.event_id)
             ORDER BY s.seq + 0 LIMIT p_limit)
            UNION ALL
            (SELECT s.event_id::text, s.created_at_ms, s.seq FROM outbox_stream s
             WHERE s.cluster_id = lc.cluster_id AND s.bucket = lc.bucket
               AND s.xid >= pg_snapshot_xmin(lc.cut) AND s.xid < pg_snapshot_xmax(lc.cut) AND NOT pg_visible_in_snapshot(s.xid, lc.cut)
               AND s.created_at_ms < p_created_before
               AND NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = s.event_id)
             ORDER BY s.seq + 0 LIMIT p_limit)) c
        UNION ALL
        SELECT n.event_id, 'PENDING', n.created_at_ms, n.seq
        FROM unleased m
        CROSS JOIN LATERAL (
            SELECT s.event_id::text, s.created_at_ms, s.seq FROM outbox_stream s
            WHERE s.cluster_id = m.cluster_id AND s.bucket = m.bucket AND s.seq > 0 AND s.created_at_ms < p_created_before
              AND NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = s.event_id)
            ORDER BY s.seq LIMIT p_limit) n)
    SELECT f.event_id, f.state, f.created_at_ms, f.seq FROM frontier f
    WHERE f.created_at_ms < p_created_before
    ORDER BY f.seq LIMIT p_limit;
END
$$;

-- When the oldest PENDING event the outbox sends was created, ms: the
-- dispatcher's `oldest_pending` gauge and `outbox status` read it. In the
-- lane, the earliest inserted (one descent of the PENDING index; legacy
-- events stay PENDING there: they are the legacy publisher's to send); on
-- the stream, the first of its open events not handed out
-- (outbox_stream_open, each key bucket's frontier).
CREATE FUNCTION outbox_oldest_pending_ms() RETURNS bigint
    LANGUAGE sql STABLE
    SET search_path FROM CURRENT
AS $$
    SELECT least(
        (SELECT e.created_at_ms FROM outbox_events e WHERE e.phase = 'PENDING' AND e.publisher = 'outbox' ORDER BY e.seq LIMIT 1),
        (SELECT o.created_at_ms FROM outbox_stream_open(9223372036854775807, 1, true) o))
$$;

-- A claim's first read (outbox_producer's `claim_paths`): whether the
-- stream may have anything to claim (it is the dispatch path, or it still
-- holds open batches, windows not read to their end, or events not cut
-- yet), and whether the chains machinery may (always on the chains path;
-- on the stream, only while the exception lane holds arrivals to link,
-- PENDING or retry events, or claimable chain heads). Planned once per
-- session: as a client statement it was planned again on every claim
-- (0.4-0.7 ms of a claim, against 0.03 ms to run it).
CREATE FUNCTION outbox_claim_paths(p_scope text) RETURNS TABLE (stream boolean, lane_busy boolean)
    LANGUAGE plpgsql STABLE
    SET plan_cache_mode = force_generic_plan
    SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN QUERY
    SELECT s.dispatch_path = 'stream'
           OR EXISTS (SELECT 1 FROM outbox_bucket_leases l
                      WHERE (p_scope IS NULL OR l.cluster_id = p_scope)
                        AND (l.open_batch IS NOT NULL OR NOT l.window_done
                             OR EXISTS (SELECT 1 FROM outbox_stream x
                                        WHERE x.cluster_id = l.cluster_id AND x.bucket = l.bucket
                                          AND x.xid >= pg_snapshot_xmin(l.cut) AND NOT pg_visible_in_snapshot(x.xid, l.cut)))),
           s.dispatch_path <> 'stream'
           OR EXISTS (SELECT 1 FROM outbox_chain_arrivals)
           OR EXISTS (SELECT 1 FROM outbox_events WHERE phase = 'RETRY_CLAIMED')
           OR EXISTS (SELECT 1 FROM outbox_events WHERE phase = 'PENDING' AND publisher = 'outbox')
           OR EXISTS (SELECT 1 FROM outbox_chain_heads WHERE claimable_at_ms IS NOT NULL)
    FROM outbox_settings s;
END
$$;

-- The bucket leases a claim by p_owner may hold: its own, the vacant and
-- the run out, locked (a concurrent claim skips them: each bucket is cut
-- by one claim at a time, which is what fences the lease row's writes),
-- with the claim's snapshot (a new window's cut).
--
-- Two statements: the lock of the slots, then their state, read in a
-- snapshot taken after the locks are held (a state read in the locking
-- statement's snapshot may miss the write of a holder that released the
-- slot since). A slot whose state no longer qualifies stays locked until
-- the claim ends and is not answered.
CREATE FUNCTION outbox_stream_claim_leases(p_scope text, p_owner text, p_now bigint)
    RETURNS TABLE (cluster_id text, bucket smallint, owner text, generation bigint, lease_until_ms bigint, prev_cut text, cut text,
                   after_seq bigint, cut_seq bigint, window_done boolean, open_batch bigint, snapshot text)
    LANGUAGE plpgsql VOLATILE
    SET search_path FROM CURRENT
AS $$
DECLARE
    v_clusters text[];
    v_buckets smallint[];
BEGIN
    SELECT array_agg(x.cluster_id ORDER BY x.cluster_id, x.bucket), array_agg(x.bucket ORDER BY x.cluster_id, x.bucket)
    INTO v_clusters, v_buckets
    FROM (SELECT k.cluster_id, k.bucket FROM outbox_bucket_slots k
          JOIN outbox_bucket_leases l ON l.cluster_id = k.cluster_id AND l.bucket = k.bucket
          WHERE (p_scope IS NULL OR k.cluster_id = p_scope) AND (l.owner = p_owner OR l.owner IS NULL OR l.lease_until_ms <= p_now)
          ORDER BY k.cluster_id, k.bucket
          FOR UPDATE OF k SKIP LOCKED) x;
    RETURN QUERY
    SELECT l.cluster_id::text, l.bucket, l.owner, l.generation, l.lease_until_ms, l.prev_cut::text, l.cut::text, l.after_seq, l.cut_seq, l.window_done,
           l.open_batch, pg_current_snapshot()::text
    FROM unnest(v_clusters, v_buckets) AS u(cluster_id, bucket)
    JOIN outbox_bucket_leases l ON l.cluster_id = u.cluster_id AND l.bucket = u.bucket
    WHERE l.owner = p_owner OR l.owner IS NULL OR l.lease_until_ms <= p_now
    ORDER BY l.cluster_id, l.bucket;
END
$$;

-- The leases of the buckets of batches p_batches, locked (FOR SHARE, or
-- FOR UPDATE when p_exclusive) in key order, then read (after the locks).
CREATE FUNCTION outbox_stream_lock_leases(p_batches bigint[], p_exclusive boolean)
    RETURNS TABLE (id bigint, owner text, generation bigint, lease_until_ms bigint, open_batch bigint)
    LANGUAGE plpgsql VOLATILE
    SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_exclusive THEN
        PERFORM 1 FROM outbox_bucket_slots k
        WHERE (k.cluster_id, k.bucket) IN (SELECT b.cluster_id, b.bucket FROM outbox_batches b WHERE b.id = ANY (p_batches))
        ORDER BY k.cluster_id, k.bucket FOR UPDATE OF k;
    ELSE
        PERFORM 1 FROM outbox_bucket_slots k
        WHERE (k.cluster_id, k.bucket) IN (SELECT b.cluster_id, b.bucket FROM outbox_batches b WHERE b.id = ANY (p_batches))
        ORDER BY k.cluster_id, k.bucket FOR SHARE OF k;
    END IF;
    RETURN QUERY
    SELECT b.id, l.owner, l.generation, l.lease_until_ms, l.open_batch
    FROM outbox_batches b JOIN outbox_bucket_leases l ON l.cluster_id = b.cluster_id AND l.bucket = b.bucket
    WHERE b.id = ANY (p_batches);
END
$$;

-- Renews the leases of batches p_batches (each with the owner renewing
-- it) that are their bucket's open batch under that owner's running lease
-- of the batch's generation: a new state row with the lease running to
-- p_now + p_lease_ms at least. Answers (batch, new lease end) per renewal.
CREATE FUNCTION outbox_stream_renew(p_batches bigint[], p_owners text[], p_now bigint, p_lease_ms bigint)
    RETURNS TABLE (id bigint, lease_until_ms bigint)
    LANGUAGE plpgsql VOLATILE
    SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM 1 FROM outbox_bucket_slots k
    WHERE (k.cluster_id, k.bucket) IN (SELECT b.cluster_id, b.bucket FROM outbox_batches b WHERE b.id = ANY (p_batches))
    ORDER BY k.cluster_id, k.bucket FOR UPDATE OF k;
    RETURN QUERY
    WITH renewed AS (
        INSERT INTO outbox_bucket_lease_log (cluster_id, bucket, owner, generation, lease_until_ms, prev_cut, cut, after_seq, cut_seq, window_done, open_batch)
        SELECT l.cluster_id, l.bucket, l.owner, l.generation, greatest(l.lease_until_ms, p_now + p_lease_ms), l.prev_cut, l.cut, l.after_seq, l.cut_seq,
               l.window_done, l.open_batch
        FROM UNNEST(p_batches, p_owners) AS t(batch_id, owner)
        JOIN outbox_batches b ON b.id = t.batch_id
        JOIN outbox_bucket_leases l ON l.cluster_id = b.cluster_id AND l.bucket = b.bucket
        WHERE l.open_batch = b.id AND l.owner = t.owner AND b.owner = t.owner AND l.generation = b.lease_generation AND l.lease_until_ms > p_now
        RETURNING outbox_bucket_lease_log.open_batch, outbox_bucket_lease_log.lease_until_ms)
    SELECT r.open_batch, r.lease_until_ms FROM renewed r;
END
$$;

-- The open batches whose lease ran out by p_now, their slots locked
-- (skipping those another transaction holds) and their state read after
-- the locks: the lease sweep takes them over (`outbox_stream_close` then
-- closes them).
CREATE FUNCTION outbox_stream_expired(p_now bigint) RETURNS SETOF bigint
    LANGUAGE plpgsql VOLATILE
    SET search_path FROM CURRENT
AS $$
DECLARE
    v_clusters text[];
    v_buckets smallint[];
BEGIN
    SELECT array_agg(x.cluster_id), array_agg(x.bucket) INTO v_clusters, v_buckets
    FROM (SELECT k.cluster_id, k.bucket FROM outbox_bucket_slots k
          JOIN outbox_bucket_leases l ON l.cluster_id = k.cluster_id AND l.bucket = k.bucket
          WHERE l.open_batch IS NOT NULL AND l.lease_until_ms <= p_now
          ORDER BY k.cluster_id, k.bucket
          FOR UPDATE OF k SKIP LOCKED) x;
    RETURN QUERY
    SELECT l.open_batch FROM unnest(v_clusters, v_buckets) AS u(cluster_id, bucket)
    JOIN outbox_bucket_leases l ON l.cluster_id = u.cluster_id AND l.bucket = u.bucket
    WHERE l.open_batch IS NOT NULL AND l.lease_until_ms <= p_now;
END
$$;

-- Closes open batches p_batches (their slots locked by the caller): a new
-- state row of each bucket without its open batch.
CREATE FUNCTION outbox_stream_close(p_batches bigint[]) RETURNS void
    LANGUAGE sql VOLATILE
    SET search_path FROM CURRENT
AS $$
    INSERT INTO outbox_bucket_lease_log (cluster_id, bucket, owner, generation, lease_until_ms, prev_cut, cut, after_seq, cut_seq, window_done, open_batch)
    SELECT l.cluster_id, l.bucket, l.owner, l.generation, l.lease_until_ms, l.prev_cut, l.cut, l.after_seq, l.cut_seq, l.window_done, NULL
    FROM outbox_batches b JOIN outbox_bucket_leases l ON l.cluster_id = b.cluster_id AND l.bucket = b.bucket
    WHERE b.id = ANY (p_batches) AND l.open_batch = b.id
$$;

-- Writes the lease state of the slots locked by the caller: one log row
-- per slot (`outbox_bucket_lease_log`).
CREATE FUNCTION outbox_bucket_lease_write(p_clusters text[], p_buckets smallint[], p_owners text[], p_generations bigint[], p_leases bigint[],
                                          p_prev_cuts text[], p_cuts text[], p_after bigint[], p_cut_seqs bigint[], p_done boolean[], p_open bigint[])
    RETURNS void
    LANGUAGE sql VOLATILE
    SET search_path FROM CURRENT
AS $$
    INSERT INTO outbox_bucket_lease_log (cluster_id, bucket, owner, generation, lease_until_ms, prev_cut, cut, after_seq, cut_seq, window_done, open_batch)
    SELECT t.cluster_id, t.bucket, t.owner, t.generation, t.lease, t.prev_cut::pg_snapshot, t.cut::pg_snapshot, t.after_seq, t.cut_seq, t.done, t.open_batch
    FROM UNNEST(p_clusters, p_buckets, p_owners, p_generations, p_leases, p_prev_cuts, p_cuts, p_after, p_cut_seqs, p_done, p_open)
         AS t(cluster_id, bucket, owner, generation, lease, prev_cut, cut, after_seq, cut_seq, done, open_batch)
$$;

-- The next events of each bucket's window, buckets in the order given,
-- at most `p_per_bucket[i]` of the i-th and `p_limit` in all: for the i-th bucket, its events whose
-- transaction is visible in p_cut[i] and not in p_prev[i] (the batch rule,
-- `outbox_core::stream::in_batch`; tests/tests/stream_snapshots.rs holds
-- this SQL to it), past p_after[i], in seq order. `to_lane` marks an event
-- whose key has an open event in the lane (it waits behind it there) or
-- whose protocol version is newer than the claimer understands. Each row
-- carries what a send of the event needs: a new batch is handed out from
-- this answer, without reading its rows again.
--
-- A window is read in seq order between two bounds: `upto`, the highest
-- seq of the bucket a claim can see when it first reads the window (its
-- statements run after its snapshot was taken, at read committed, so every
-- event of the window is at or below it), and the window's lowest seq,
-- found through its transactions' ids (its query cannot use the partial
-- seq index: see outbox_stream_window_seq). A read past the first batch
-- (p_after[i] > 0 with its bound p_upto[i]) reads on from p_after[i]: a
-- large window is read once, not once per batch.
CREATE FUNCTION outbox_stream_window(p_clusters text[], p_buckets smallint[], p_prev pg_snapshot[], p_cut pg_snapshot[],
                                     p_after bigint[], p_upto bigint[], p_limit integer, p_per_bucket integer[], p_max_protocol integer)
    RETURNS TABLE (ord integer, seq bigint, event_id text, key_chain bigint, routing_key text, ordered boolean, to_lane boolean,
                   topic text, topic_id text, partition integer, upto bigint,
                   envelope_canonical bytea, destination_canonical bytea, destination_digest text, payload bytea, payload_digest text,
                   traceparent text, tracestate text)
    LANGUAGE plpgsql STABLE
    SET enable_seqscan = off
    -- A plan that must read a table whole with sequential scans off is
    -- costed past the JIT threshold, and compiling it took 0.9 s per bucket.
    SET jit = off
    -- Each statement planned once per session: with custom plans PL/pgSQL
    -- planned the lowest-seq query again for every bucket of every claim
    -- (three partitions' worth), 130 us a bucket, 8.5 ms a claim over 64
    -- empty buckets; generic, 1.4 ms. Neither plan depends on the values:
    -- both read one bucket's index range (see outbox_stream_window_seq).
    SET plan_cache_mode = force_generic_plan
    SET search_path FROM CURRENT
AS $$
DECLARE
    i integer;
    left_ integer := p_limit;
    n integer;
    lo bigint;
    hi bigint;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'outbox_stream_window runs at read committed (a claim reads what committed before its snapshot), not %',
            current_setting('transaction_isolation');
    END IF;
    FOR i IN 1 .. coalesce(cardinality(p_buckets), 0) LOOP
        EXIT WHEN left_ <= 0;
        IF p_after[i] > 0 AND p_upto[i] > 0 THEN
            lo := p_after[i] + 1;
            hi := p_upto[i];
        ELSE
            lo := (SELECT min(s.seq + 0) FROM outbox_stream s
                   WHERE s.cluster_id = p_clusters[i] AND s.bucket = p_buckets[i]
                     AND s.xid >= pg_snapshot_xmin(p_prev[i]) AND s.xid < pg_snapshot_xmax(p_cut[i])
                     AND pg_visible_in_snapshot(s.xid, p_cut[i]) AND NOT pg_visible_in_snapshot(s.xid, p_prev[i])
                     AND s.seq + 0 > p_after[i]);
            -- An empty window (most buckets, most claims) needs no bound.
            CONTINUE WHEN lo IS NULL;
            hi := (SELECT max(x.seq) FROM outbox_stream x WHERE x.cluster_id = p_clusters[i] AND x.bucket = p_buckets[i] AND x.seq > 0);
        END IF;
        RETURN QUERY
            SELECT i, s.seq, s.event_id::text, s.key_chain, s.routing_key::text, s.ordered,
                   (s.protocol_version > p_max_protocol
                    -- Moved to the lane before its cut (an operator's write): it is the lane's.
                    OR EXISTS (SELECT 1 FROM outbox_events x WHERE x.event_id = s.event_id)
                    OR (s.ordered AND EXISTS (SELECT 1 FROM outbox_events e
                                              WHERE e.key_chain = s.key_chain AND e.phase NOT IN ('PUBLISHED', 'RETAINED', 'PURGED', 'SKIPPED')
                                                AND e.ordered AND e.publisher = 'outbox'))),
                   s.topic::text, s.topic_id::text, s.partition, hi,
                   s.envelope_canonical, s.destination_canonical, s.destination_digest, s.payload, s.payload_digest,
                   s.traceparent, s.tracestate
            FROM outbox_stream s
            WHERE s.cluster_id = p_clusters[i] AND s.bucket = p_buckets[i]
              AND s.seq > 0 AND s.seq >= lo AND s.seq <= hi
              AND pg_visible_in_snapshot(s.xid, p_cut[i]) AND NOT pg_visible_in_snapshot(s.xid, p_prev[i])
            ORDER BY s.seq
            LIMIT least(left_, p_per_bucket[i]);
        GET DIAGNOSTICS n = ROW_COUNT;
        left_ := left_ - n;
    END LOOP;
END
$$;

-- The exception lane: copies stream events into outbox_events (PENDING,
-- with their seq) and their envelopes, once; the caller then moves each to
-- where its claim left it. It copies only what the stream holds, so the
-- dispatcher may run it without inserting events itself.
CREATE FUNCTION outbox_stream_to_lane(p_events text[]) RETURNS SETOF text
    LANGUAGE sql VOLATILE SECURITY DEFINER
    SET search_path FROM CURRENT
AS $$
    WITH src AS (
        SELECT s.* FROM outbox_stream s
        WHERE s.event_id = ANY(p_events)
          AND NOT EXISTS (SELECT 1 FROM outbox_events e WHERE e.event_id = s.event_id)
        ORDER BY s.seq),
    ins AS (
        INSERT INTO outbox_events (seq, event_id, command_key, protocol_version, envelope_generation, state, tenant, aggregate_type,
             aggregate_id, aggregate_version, event_type, payload, payload_digest, destination_digest, cluster_id, topic, partition,
             routing_key, ordered, created_at_ms, state_since_ms, traceparent, tracestate, publisher, takeover_generation)
        OVERRIDING SYSTEM VALUE
        SELECT seq, event_id, command_key, protocol_version, 1, 'PENDING', tenant, aggregate_type, aggregate_id, aggregate_version,
               event_type, payload, payload_digest, destination_digest, cluster_id, topic, partition, routing_key, ordered,
               created_at_ms, created_at_ms, traceparent, tracestate, 'outbox', takeover_generation
        FROM src ORDER BY seq
        RETURNING event_id),
    env AS (
        INSERT INTO outbox_envelopes (event_id, envelope_generation, envelope_canonical, envelope_digest,
             destination_canonical, destination_digest, payload_digest, created_txid, created_at_ms)
        SELECT s.event_id, 1, s.envelope_canonical, s.envelope_digest, s.destination_canonical, s.destination_digest,
               s.payload_digest, s.created_txid, s.created_at_ms
        FROM src s JOIN ins USING (event_id)
        RETURNING event_id)
    SELECT event_id FROM env
$$;
-- Executed by the dispatcher's roles only (docs/roles.sql).
REVOKE EXECUTE ON FUNCTION outbox_stream_to_lane(text[]) FROM PUBLIC;

-- Each event's state, wherever it lives: the lane row's; else PUBLISHED
-- with a receipt in its slot; else SENDING when its bucket's open batch
-- registered its attempt, CLAIMED when that batch handed it out; else
-- PENDING. Every
-- reader of one event's state reads it here.
CREATE FUNCTION outbox_event_state(p_event text) RETURNS text
    LANGUAGE sql STABLE
    SET search_path FROM CURRENT
AS $$
    SELECT coalesce(
        (SELECT e.state FROM outbox_events e WHERE e.event_id = p_event),
        (SELECT CASE
                  WHEN EXISTS (SELECT 1 FROM outbox_publish_receipts r WHERE r.event_id = p_event AND r.envelope_generation = 1) THEN 'PUBLISHED'
                  WHEN b.id IS NULL THEN 'PENDING'
                  WHEN EXISTS (SELECT 1 FROM outbox_batch_steps x WHERE x.batch_id = b.id AND x.kind = 'registered'
                                                                  AND (b.pos - 1) = ANY(x.positions)) THEN 'SENDING'
                  WHEN EXISTS (SELECT 1 FROM outbox_batch_steps x WHERE x.batch_id = b.id AND x.kind = 'handed'
                                                                  AND (b.pos - 1) = ANY(x.positions)) THEN 'CLAIMED'
                  ELSE 'PENDING' END
         FROM outbox_stream s
         LEFT JOIN outbox_bucket_leases l ON l.cluster_id = s.cluster_id AND l.bucket = s.bucket
         LEFT JOIN LATERAL (SELECT b.id, array_position(b.event_ids, s.event_id) AS pos FROM outbox_batches b
                            WHERE b.id = l.open_batch AND s.event_id = ANY(b.event_ids)) b ON true
         WHERE s.event_id = p_event))
$$;
