-- outbox schema, protocol version 1.
-- Invariants held by the database itself, whatever the caller does:
--   * one event per eventId and one eventId per command idempotency key;
--   * one publish slot per (eventId, envelopeGeneration), one event per log position;
--   * frozen envelopes and destinations are never updated;
--   * an event's state moves only along the closed transition table.

CREATE TABLE outbox_meta (
    key   text PRIMARY KEY,
    value text NOT NULL
);
INSERT INTO outbox_meta (key, value) VALUES ('protocol_version', '1');

CREATE TABLE outbox_route_policies (
    event_type    text    NOT NULL,
    generation    integer NOT NULL CHECK (generation >= 1),
    cluster_id    text    NOT NULL,
    topic         text    NOT NULL,
    partitions    integer NOT NULL CHECK (partitions BETWEEN 1 AND 100000),
    partitioner   text    NOT NULL CHECK (partitioner IN ('murmur2')),
    key_template  text    NOT NULL,
    serializer    text    NOT NULL,
    durability    text    NOT NULL,
    required_acks text    NOT NULL CHECK (required_acks IN ('all', '1')),
    ordering      text    NOT NULL CHECK (ordering IN ('key', 'none')),
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (event_type, generation)
);

CREATE TABLE outbox_states (
    state text PRIMARY KEY
);
INSERT INTO outbox_states (state) VALUES
    ('PENDING'), ('CLAIMED'), ('SENDING'), ('PUBLISHED'), ('RETAINED'), ('PURGED'),
    ('DISPATCH_UNKNOWN'), ('RECONCILING'), ('RETRY_CLAIMED'), ('QUARANTINED');

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
    ('PUBLISHED', 'RETAINED'), ('RETAINED', 'PURGED');

CREATE TABLE outbox_events (
    seq                 bigint GENERATED ALWAYS AS IDENTITY,
    -- Formats of event_id, digests and traceparent are checked by the
    -- outbox_events_formats trigger at insert (and on change): a CHECK would be
    -- re-evaluated on each of the row's state updates.
    event_id            text PRIMARY KEY,
    command_key         text NOT NULL UNIQUE,
    protocol_version    smallint NOT NULL DEFAULT 1,
    envelope_generation integer NOT NULL DEFAULT 1 CHECK (envelope_generation >= 1),
    state               text NOT NULL CHECK (state IN ('PENDING', 'CLAIMED', 'SENDING', 'PUBLISHED', 'RETAINED', 'PURGED',
                                                       'DISPATCH_UNKNOWN', 'RECONCILING', 'RETRY_CLAIMED', 'QUARANTINED')),
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
    cluster_id          text NOT NULL,
    topic               text NOT NULL,
    partition           integer NOT NULL CHECK (partition >= 0),
    routing_key         text NOT NULL,
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
    CHECK ((state IN ('CLAIMED', 'SENDING', 'RECONCILING')) <= (claim_owner IS NOT NULL)),
    CHECK ((state = 'PURGED') = (payload IS NULL))
);
CREATE INDEX outbox_events_pending ON outbox_events (seq) WHERE state = 'PENDING';
CREATE INDEX outbox_events_pending_unordered ON outbox_events (seq) WHERE state = 'PENDING' AND NOT ordered;
-- Per-key ordering: the oldest open event of each key, one index descent per key.
CREATE INDEX outbox_events_open_by_key ON outbox_events (cluster_id, topic, routing_key, seq)
    WHERE state NOT IN ('PUBLISHED', 'RETAINED', 'PURGED') AND ordered;
CREATE INDEX outbox_events_unknown ON outbox_events (next_check_at_ms) WHERE state = 'DISPATCH_UNKNOWN';
CREATE INDEX outbox_events_leased ON outbox_events (lease_until_ms) WHERE claim_owner IS NOT NULL;
CREATE INDEX outbox_events_retry ON outbox_events (seq) WHERE state = 'RETRY_CLAIMED';
CREATE INDEX outbox_events_aggregate ON outbox_events (tenant, aggregate_type, aggregate_id, aggregate_version);
-- Every UPDATE of a state writes a new entry into each full index, so full
-- indexes are few; the states an operator or the reconciler looks up have
-- small partial indexes instead.
CREATE INDEX outbox_events_published ON outbox_events (published_at_ms) WHERE state = 'PUBLISHED';
CREATE INDEX outbox_events_retained ON outbox_events (published_at_ms) WHERE state = 'RETAINED';
CREATE INDEX outbox_events_quarantined ON outbox_events (state_since_ms) WHERE state = 'QUARANTINED';
CREATE INDEX outbox_events_unknown_since ON outbox_events (unknown_since_ms) WHERE unknown_since_ms IS NOT NULL;

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
        'PUBLISHED>RETAINED', 'RETAINED>PURGED'])
$$;

CREATE FUNCTION outbox_check_transition() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state IS DISTINCT FROM OLD.state AND NOT outbox_transition_allowed(OLD.state, NEW.state) THEN
        RAISE EXCEPTION 'illegal outbox transition % -> % for %', OLD.state, NEW.state, OLD.event_id
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
CREATE TRIGGER outbox_events_transition BEFORE UPDATE ON outbox_events
    FOR EACH ROW EXECUTE FUNCTION outbox_check_transition();

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
-- Fires only when a checked column is written (every insert; updates that touch them).
CREATE TRIGGER outbox_events_formats_insert BEFORE INSERT ON outbox_events
    FOR EACH ROW EXECUTE FUNCTION outbox_check_formats();
CREATE TRIGGER outbox_events_formats_update BEFORE UPDATE OF event_id, payload_digest, destination_digest, traceparent ON outbox_events
    FOR EACH ROW EXECUTE FUNCTION outbox_check_formats();

-- Frozen envelopes and destinations, one row per envelope generation. Never updated.
CREATE TABLE outbox_envelopes (
    event_id              text NOT NULL REFERENCES outbox_events,
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

CREATE FUNCTION outbox_frozen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only', TG_TABLE_NAME USING ERRCODE = 'check_violation';
END $$;
CREATE TRIGGER outbox_envelopes_frozen BEFORE UPDATE OR DELETE ON outbox_envelopes
    FOR EACH ROW EXECUTE FUNCTION outbox_frozen();

CREATE TABLE outbox_attempts (
    attempt_id          text PRIMARY KEY CHECK (attempt_id ~ '^att-[0-7][0-9A-HJKMNP-TV-Z]{25}$'),
    event_id            text NOT NULL,
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
    UNIQUE (event_id, attempt_generation),
    FOREIGN KEY (event_id, envelope_generation) REFERENCES outbox_envelopes (event_id, envelope_generation)
);

-- The single publish slot.
CREATE TABLE outbox_publish_receipts (
    event_id            text NOT NULL,
    envelope_generation integer NOT NULL,
    attempt_id          text NOT NULL REFERENCES outbox_attempts,
    cluster_id          text NOT NULL,
    topic               text NOT NULL,
    partition           integer NOT NULL CHECK (partition >= 0),
    "offset"            bigint NOT NULL CHECK ("offset" >= 0),
    payload_digest      text NOT NULL,
    destination_digest  text NOT NULL,
    accepted_at_ms      bigint NOT NULL,
    PRIMARY KEY (event_id, envelope_generation),
    UNIQUE (cluster_id, topic, partition, "offset"),
    FOREIGN KEY (event_id, envelope_generation) REFERENCES outbox_envelopes (event_id, envelope_generation)
);
CREATE TRIGGER outbox_publish_receipts_frozen BEFORE UPDATE OR DELETE ON outbox_publish_receipts
    FOR EACH ROW EXECUTE FUNCTION outbox_frozen();

-- Every other genuine receipt of the same event: evidence, not an error.
CREATE TABLE outbox_duplicate_receipts (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id            text NOT NULL,
    envelope_generation integer NOT NULL,
    attempt_id          text NOT NULL REFERENCES outbox_attempts,
    cluster_id          text NOT NULL,
    topic               text NOT NULL,
    partition           integer NOT NULL,
    "offset"            bigint NOT NULL,
    payload_digest      text NOT NULL,
    destination_digest  text NOT NULL,
    received_at_ms      bigint NOT NULL,
    UNIQUE (event_id, envelope_generation, cluster_id, topic, partition, "offset")
);

CREATE TABLE outbox_quarantine (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id            text NOT NULL,
    envelope_generation integer,
    attempt_id          text,
    reason              text NOT NULL,
    evidence            jsonb NOT NULL,
    created_at_ms       bigint NOT NULL
);
CREATE INDEX outbox_quarantine_event ON outbox_quarantine (event_id);

-- Stale writes, refused receipts, operator actions.
CREATE TABLE outbox_audit (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id  text,
    actor     text NOT NULL,
    action    text NOT NULL,
    detail    jsonb NOT NULL,
    at_ms     bigint NOT NULL
);
CREATE INDEX outbox_audit_event ON outbox_audit (event_id);

-- Consumers whose watermarks the reconciler compares (critical) and that
-- retention waits for (mandatory).
CREATE TABLE outbox_consumers (
    consumer_id text PRIMARY KEY,
    critical    boolean NOT NULL DEFAULT true,
    mandatory   boolean NOT NULL DEFAULT true,
    created_at  timestamptz NOT NULL DEFAULT now()
);
