-- Readings and gaps: what a consumer decided of each partition, and the
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
