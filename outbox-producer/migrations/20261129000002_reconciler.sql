-- Reconciler, retention and migration records.

-- Which topics a registered consumer reads (a critical consumer is compared
-- only against events on its topics).
ALTER TABLE outbox_consumers ADD COLUMN topics text[] NOT NULL DEFAULT '{}';

-- Every resolution of an UNKNOWN: the SLO's raw data.
CREATE TABLE outbox_unknown_resolutions (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id         text   NOT NULL,
    unknown_since_ms bigint NOT NULL,
    resolved_at_ms   bigint NOT NULL,
    outcome          text   NOT NULL CHECK (outcome IN ('PUBLISHED', 'QUARANTINED', 'MIGRATED'))
);
CREATE INDEX outbox_unknown_resolutions_at ON outbox_unknown_resolutions (resolved_at_ms);

-- Findings of the three-set comparison; open while resolved_at_ms is NULL.
CREATE TABLE outbox_findings (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind           text   NOT NULL CHECK (kind IN ('aged_pending', 'unconsumed_published', 'bypass_publish', 'unknown_past_slo', 'quarantined')),
    event_id       text   NOT NULL,
    consumer_id    text   NOT NULL DEFAULT '',
    detail         text   NOT NULL,
    age_ms         bigint NOT NULL,
    first_seen_ms  bigint NOT NULL,
    last_seen_ms   bigint NOT NULL,
    resolved_at_ms bigint
);
CREATE UNIQUE INDEX outbox_findings_open ON outbox_findings (kind, event_id, consumer_id) WHERE resolved_at_ms IS NULL;

-- How far the bypass scan has read each partition.
CREATE TABLE outbox_scan_cursors (
    cluster_id  text    NOT NULL,
    topic       text    NOT NULL,
    partition   integer NOT NULL,
    next_offset bigint  NOT NULL,
    PRIMARY KEY (cluster_id, topic, partition)
);

-- Messages seen in a topic that the outbox never committed (kept: evidence).
CREATE TABLE outbox_bypass_messages (
    cluster_id  text    NOT NULL,
    topic       text    NOT NULL,
    partition   integer NOT NULL,
    "offset"    bigint  NOT NULL,
    event_id    text,
    seen_at_ms  bigint  NOT NULL,
    PRIMARY KEY (cluster_id, topic, partition, "offset")
);

-- Counts per state over time, one row per reconciler round.
CREATE TABLE outbox_state_snapshots (
    at_ms  bigint NOT NULL,
    state  text   NOT NULL,
    count  bigint NOT NULL,
    PRIMARY KEY (at_ms, state)
);

-- A destination migration: the old generation proven absent from its target,
-- the new generation with its new frozen destination.
CREATE TABLE outbox_migration_receipts (
    id                      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id                text    NOT NULL REFERENCES outbox_events,
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
