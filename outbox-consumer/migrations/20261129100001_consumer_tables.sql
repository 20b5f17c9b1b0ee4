-- outbox-consumer schema, version 1.
--
-- Every table is keyed by consumer_id, so several logical consumers (and the
-- outbox database, which receives published watermarks) can share one
-- database. Offsets follow Kafka: "offset" is a message's log position,
-- committed_offset is the next position to read.

-- One row per (consumer, event) the consumer applied: the consumption receipt.
-- It is written in the same transaction as the handler's state change, so the
-- row exists if and only if the effect committed.
CREATE TABLE outbox_consumer_receipts (
    consumer_id         text        NOT NULL,
    event_id            text        NOT NULL CHECK (event_id ~ '^evt-[0-7][0-9A-HJKMNP-TV-Z]{25}$'),
    envelope_generation integer     NOT NULL CHECK (envelope_generation >= 1),
    event_type          text        NOT NULL,
    topic               text        NOT NULL,
    partition           integer     NOT NULL CHECK (partition >= 0),
    "offset"            bigint      NOT NULL CHECK ("offset" >= 0),
    payload_digest      text        NOT NULL,
    -- What the handler returned the first time; returned again on duplicates.
    result              jsonb       NOT NULL DEFAULT 'null'::jsonb,
    received_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_id, event_id)
) WITH (fillfactor = 80);
CREATE INDEX outbox_consumer_receipts_position ON outbox_consumer_receipts (consumer_id, topic, partition, "offset");
CREATE INDEX outbox_consumer_receipts_received ON outbox_consumer_receipts (consumer_id, received_at);

-- Per (consumer, topic, partition): every message below committed_offset has
-- been decided (applied, duplicate, quarantined or dead-lettered), and the
-- decision committed. Counts are cumulative decisions. A consumer whose state
-- lives in another database copies these rows, same columns, into the outbox
-- database's table of the same name (outbox_consumer::publish_watermarks).
CREATE TABLE outbox_consumer_watermarks (
    consumer_id         text        NOT NULL,
    topic               text        NOT NULL,
    partition           integer     NOT NULL CHECK (partition >= 0),
    committed_offset    bigint      NOT NULL CHECK (committed_offset >= 0),
    applied_count       bigint      NOT NULL DEFAULT 0 CHECK (applied_count >= 0),
    duplicate_count     bigint      NOT NULL DEFAULT 0 CHECK (duplicate_count >= 0),
    quarantined_count   bigint      NOT NULL DEFAULT 0 CHECK (quarantined_count >= 0),
    dead_lettered_count bigint      NOT NULL DEFAULT 0 CHECK (dead_lettered_count >= 0),
    last_event_id       text,
    updated_at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_id, topic, partition)
);

-- Messages that failed verification (digest, destination or placement
-- mismatch, missing headers) or that reuse an eventId with other bytes. The
-- handler never saw them; the partition moved on.
CREATE TABLE outbox_consumer_quarantine (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer_id         text        NOT NULL,
    topic               text        NOT NULL,
    partition           integer     NOT NULL CHECK (partition >= 0),
    "offset"            bigint      NOT NULL CHECK ("offset" >= 0),
    -- The eventId header when it could be read; not trustworthy by definition.
    event_id            text,
    reason              text        NOT NULL,
    evidence            jsonb       NOT NULL,
    -- sha256 of the bytes actually received, and the bytes when small enough.
    payload_digest      text        NOT NULL,
    payload_bytes       integer     NOT NULL CHECK (payload_bytes >= 0),
    payload             bytea,
    quarantined_at      timestamptz NOT NULL DEFAULT now(),
    UNIQUE (consumer_id, topic, partition, "offset")
);
CREATE INDEX outbox_consumer_quarantine_event ON outbox_consumer_quarantine (event_id);

-- Verified events whose handler kept failing: bounded retries, then a record
-- here, never a silent skip. One per (consumer, event); a redelivery of a
-- dead-lettered event is not retried automatically (see redrive).
CREATE TABLE outbox_consumer_dead_letters (
    consumer_id         text        NOT NULL,
    event_id            text        NOT NULL,
    envelope_generation integer     NOT NULL,
    event_type          text        NOT NULL,
    topic               text        NOT NULL,
    partition           integer     NOT NULL CHECK (partition >= 0),
    "offset"            bigint      NOT NULL CHECK ("offset" >= 0),
    message_key         bytea,
    payload_digest      text        NOT NULL,
    payload             bytea       NOT NULL,
    headers             jsonb       NOT NULL,
    attempts            integer     NOT NULL CHECK (attempts >= 1),
    last_error          text        NOT NULL,
    dead_lettered_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_id, event_id)
);
