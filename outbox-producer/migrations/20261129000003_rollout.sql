-- Rollout and rollback (SPEC §11): shadow mode, partial takeover by event
-- type and eventId hash, and the dispatcher alias.

-- Who sends the event, frozen at emit and never changed: 'outbox' (the
-- dispatcher) or 'legacy' (the publisher the outbox is replacing). With no
-- takeover policy at all, every event is the outbox's.
ALTER TABLE outbox_events
    ADD COLUMN publisher text NOT NULL DEFAULT 'outbox' CHECK (publisher IN ('outbox', 'legacy')),
    ADD COLUMN takeover_generation integer;

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

-- Legacy events are never PUBLISHED here: they must not hold an outbox key's
-- ordering, and the claim indexes only hold the outbox's own events.
DROP INDEX outbox_events_open_by_key;
CREATE INDEX outbox_events_open_by_key ON outbox_events (cluster_id, topic, routing_key, seq)
    WHERE state NOT IN ('PUBLISHED', 'RETAINED', 'PURGED') AND ordered AND publisher = 'outbox';
DROP INDEX outbox_events_pending_unordered;
CREATE INDEX outbox_events_pending_unordered ON outbox_events (seq)
    WHERE state = 'PENDING' AND NOT ordered AND publisher = 'outbox';
-- The shadow dispatcher's scan: legacy events in commit order.
CREATE INDEX outbox_events_legacy ON outbox_events (seq) WHERE publisher = 'legacy';

-- Shadow mode: the message the dispatcher would have sent, built exactly as
-- it would build it, never sent. headers_digest leaves out the attempt id
-- (every attempt has its own).
CREATE TABLE outbox_shadow_attempts (
    event_id           text    PRIMARY KEY REFERENCES outbox_events,
    topic              text    NOT NULL,
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

-- How far the shadow comparison has read each partition.
CREATE TABLE outbox_shadow_cursors (
    cluster_id  text    NOT NULL,
    topic       text    NOT NULL,
    partition   integer NOT NULL,
    next_offset bigint  NOT NULL,
    PRIMARY KEY (cluster_id, topic, partition)
);

-- What the shadow comparison found; open while resolved_at_ms is NULL (a
-- 'missing' message that shows up late is resolved).
CREATE TABLE outbox_shadow_mismatches (
    event_id       text   NOT NULL,
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
