-- The outbox-consumer schema, version 1.
--
-- The whole schema in one file, each table in its final form.
--
-- Sections:
--   1. Consumption receipts
--   2. Watermarks
--   3. Quarantine
--   4. Dead letters
--   5. Readings and gaps
--
-- Every table is keyed by consumer_id, so several logical consumers (and the
-- outbox database, which receives published watermarks) can share one
-- database. Offsets follow Kafka: "offset" is a message's log position,
-- committed_offset is the next position to read.
--
-- Receipts and watermarks name the log they were read from: the broker
-- cluster and the topic identity. Two clusters may carry a topic of the
-- same name with unrelated offsets (a route revision to another cluster, a
-- replaced cluster): a watermark far along kafka-b/orders/3 says nothing
-- about kafka-a/orders/3. A topic deleted and created again under the same
-- name starts a new log at offset 0 under another id. So retention, the
-- unconsumed check and lag match on the cluster and the topic id too, the
-- topic id exactly (NULL matches only NULL).
--
-- cluster_id '' means "not known"; no receipt of the outbox has that
-- cluster, so such a watermark holds retention (it passes nothing) until
-- the consumer writes its rows again with its cluster, which it does with
-- its next decision on each partition.
--
-- topic_id is the Kafka topic id the messages' frozen destinations name
-- (`destination.v2`): 16 bytes in URL-safe base64 without padding (22
-- characters). NULL for `destination.v1` messages and for messages whose
-- destination does not parse.


-- =========================================================================
-- 1. Consumption receipts
-- =========================================================================

-- One row per (consumer, event) the consumer applied: the consumption receipt.
-- It is written in the same transaction as the handler's state change, so the
-- row exists if and only if the effect committed.
--
-- fillfactor 40: room on each page for a receipt's second version. A
-- batch's claim inserts its receipts; once the handlers have run, one
-- statement gives each its result, a second row version. The result is in
-- no index, so that update is heap-only (no index entry) when the row's
-- page has room for it. At fillfactor 80 a page keeps room for about one
-- row in four: the other updates move their row to another page and write
-- an entry into each of the receipts' three indexes. At 50 that is still
-- one in three (a result is larger than the 'null' it replaces); at 40
-- every page keeps room for the second version of each of its rows (test:
-- storing_handler_results_writes_no_index_entries). Measured with
-- `consume_bench` (100,000 events, one receipt each, on this project's
-- 2-core machine): PostgreSQL's CPU per event 30-31 us at 80, 23-26 us at
-- 50 and 40. The price is space: the table takes about 2.5 times its
-- packed size until its receipts are purged.
CREATE TABLE outbox_consumer_receipts (
    consumer_id         text        NOT NULL,
    -- Format checked by outbox_consumer_receipts_event_id_format (below).
    event_id            text        NOT NULL,
    envelope_generation integer     NOT NULL CHECK (envelope_generation >= 1),
    event_type          text        NOT NULL,
    topic               text        NOT NULL,
    partition           integer     NOT NULL CHECK (partition >= 0),
    "offset"            bigint      NOT NULL CHECK ("offset" >= 0),
    payload_digest      text        NOT NULL,
    -- What the handler returned the first time; returned again on duplicates.
    result              jsonb       NOT NULL DEFAULT 'null'::jsonb,
    received_at         timestamptz NOT NULL DEFAULT now(),
    cluster_id          text        NOT NULL DEFAULT '',
    topic_id            text
        CHECK (topic_id IS NULL OR (topic_id ~ '^[A-Za-z0-9_-]{21}[AQgw]$' AND topic_id <> 'AAAAAAAAAAAAAAAAAAAAAA')),
    PRIMARY KEY (consumer_id, event_id)
) WITH (fillfactor = 40);
CREATE INDEX outbox_consumer_receipts_position ON outbox_consumer_receipts (consumer_id, topic, partition, "offset");
CREATE INDEX outbox_consumer_receipts_received ON outbox_consumer_receipts (consumer_id, received_at);

-- The event id's format, `^evt-[0-7][0-9A-HJKMNP-TV-Z]{25}$`, written
-- without counted repetition: a 30-byte value matching the pattern with
-- `*`, every character it admits being one byte. PostgreSQL's regular
-- expressions match it several times faster than `{25}` (see the
-- producer's outbox_events_formats_insert trigger); a test checks both
-- forms agree.
ALTER TABLE outbox_consumer_receipts ADD CONSTRAINT outbox_consumer_receipts_event_id_format
    CHECK (octet_length(event_id) = 30 AND event_id ~ '^evt-[0-7][0-9A-HJKMNP-TV-Z]*$');


-- =========================================================================
-- 2. Watermarks
-- =========================================================================

-- Per (consumer, cluster, topic, partition, topic id): every message below
-- committed_offset has been decided (applied, duplicate, quarantined or
-- dead-lettered), and the decision committed. Counts are cumulative
-- decisions. A consumer whose state lives in another database copies these
-- rows, same columns, into the outbox database's table of the same name
-- (outbox_consumer::publish_watermarks).
--
-- A consumer keeps one row per topic id it has decided messages of on a
-- partition. The key has the topic id after the partition: lookups name
-- every column, and a partition has one or two topic ids, so an index probe
-- on the first four columns finds the row. The table has no primary key
-- (topic_id may be NULL); outbox_consumer_watermarks_log_key is the key,
-- and the consumer's upserts name it.
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
    cluster_id          text        NOT NULL DEFAULT '',
    topic_id            text
        CHECK (topic_id IS NULL OR (topic_id ~ '^[A-Za-z0-9_-]{21}[AQgw]$' AND topic_id <> 'AAAAAAAAAAAAAAAAAAAAAA')),
    -- The event of the message at committed_offset - 1, when the consumer
    -- decided it as a genuine message of it (NULL otherwise, and for rows a
    -- watermark record moved): retention and the reconciler find its
    -- receipt there to tell a destination.v1 watermark of another log under
    -- the same name (outbox_core::WatermarkAnchor).
    anchor_event_id     text,
    -- Whether the consumer's own store wrote the anchor (false for a row a
    -- watermark record moved: judged by its log's name alone).
    anchor_recorded     boolean     NOT NULL DEFAULT false,
    -- The identity of the log committed_offset counts in, as the consumer
    -- saw it (the topic's id when it fetched; NULL: not known). A row moved
    -- by messages of another log is replaced, not raised: the new log's
    -- offsets start anew (outbox_consumer::gap::reading_in_log).
    log_id              text        CHECK (log_id IS NULL OR length(log_id) <= 64),
    CONSTRAINT outbox_consumer_watermarks_log_key
        UNIQUE NULLS NOT DISTINCT (consumer_id, cluster_id, topic, partition, topic_id)
);


-- =========================================================================
-- 3. Quarantine
-- =========================================================================

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


-- =========================================================================
-- 4. Dead letters
-- =========================================================================

-- Verified events whose handler kept failing: bounded retries, then a record
-- here, never a silent skip. One per (consumer, event); a redelivery of a
-- dead-lettered event is not retried automatically (see redrive).
--
-- `outbox dead-letters requeue` asks the consumer to run a dead-lettered
-- event's handler again: it sets requeue_requested_at_ms (and who asked);
-- the running consumer picks the request up within a second, redrives the
-- event in one transaction with its receipt (the dead letter is deleted) or,
-- if the handler fails again, clears the request and records the attempt.
CREATE TABLE outbox_consumer_dead_letters (
    consumer_id             text        NOT NULL,
    event_id                text        NOT NULL,
    envelope_generation     integer     NOT NULL,
    event_type              text        NOT NULL,
    topic                   text        NOT NULL,
    partition               integer     NOT NULL CHECK (partition >= 0),
    "offset"                bigint      NOT NULL CHECK ("offset" >= 0),
    message_key             bytea,
    payload_digest          text        NOT NULL,
    payload                 bytea       NOT NULL,
    headers                 jsonb       NOT NULL,
    attempts                integer     NOT NULL CHECK (attempts >= 1),
    last_error              text        NOT NULL,
    dead_lettered_at        timestamptz NOT NULL DEFAULT now(),
    requeue_requested_at_ms bigint,
    requeue_requested_by    text        CHECK (length(requeue_requested_by) <= 200),
    PRIMARY KEY (consumer_id, event_id)
);
CREATE INDEX outbox_consumer_dead_letters_requeue ON outbox_consumer_dead_letters (consumer_id, requeue_requested_at_ms)
    WHERE requeue_requested_at_ms IS NOT NULL;

-- =========================================================================
-- 5. Readings and gaps
-- =========================================================================

-- What a consumer decided of each partition, and the
-- ranges it skipped.
--
-- A consumer's watermark says "every message below this offset was decided
-- here"; retention and the reconciler count on it. Kafka can make a consumer
-- skip offsets (its committed offset fell below the log's start, a group was
-- reset to the end, a new group started at the end). The consumer then keeps
-- a gap instead of a watermark that passes the range: its watermark rows stop
-- at the first open gap's start until the range is replayed (the gap shrinks
-- and closes by itself) or an operator accepts it (closed_by, close_reason).
-- The decision is outbox_consumer::gap::decide_reading.

-- Per consumer and log partition: the offset after the greatest one decided.
CREATE TABLE outbox_consumer_readings (
    consumer_id text        NOT NULL,
    cluster_id  text        NOT NULL,
    topic       text        NOT NULL,
    partition   integer     NOT NULL CHECK (partition >= 0),
    next_offset bigint      NOT NULL CHECK (next_offset >= 0),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    -- The log the reading is kept in (RawMessage::log_id; NULL: not known).
    -- Messages of another log start the reading over: next_offset is
    -- replaced and the old log's gap rows are removed.
    log_id      text        CHECK (log_id IS NULL OR length(log_id) <= 64),
    PRIMARY KEY (consumer_id, cluster_id, topic, partition)
);

-- A range [from_offset, to_offset) of a partition the consumer skipped.
-- detected_from (where the range began when found) is its identity; a replay
-- moves from_offset up (or to_offset down) over what it decided.
CREATE TABLE outbox_consumer_gaps (
    consumer_id   text        NOT NULL,
    cluster_id    text        NOT NULL,
    topic         text        NOT NULL,
    partition     integer     NOT NULL CHECK (partition >= 0),
    detected_from bigint      NOT NULL CHECK (detected_from >= 0),
    from_offset   bigint      NOT NULL,
    to_offset     bigint      NOT NULL,
    detected_at   timestamptz NOT NULL DEFAULT now(),
    -- Set when the range was all decided (close_reason 'replayed') or an
    -- operator accepted it (closed_by, close_reason: who and why).
    closed_at     timestamptz,
    closed_by     text,
    close_reason  text,
    PRIMARY KEY (consumer_id, cluster_id, topic, partition, detected_from),
    CHECK (detected_from <= from_offset AND to_offset > detected_from),
    CHECK (closed_at IS NOT NULL OR from_offset < to_offset),
    CHECK ((closed_at IS NULL) = (close_reason IS NULL))
);

CREATE INDEX outbox_consumer_gaps_open ON outbox_consumer_gaps (consumer_id, cluster_id, topic, partition) WHERE closed_at IS NULL;
