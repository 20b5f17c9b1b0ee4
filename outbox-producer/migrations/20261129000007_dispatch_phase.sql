-- Registering an attempt (CLAIMED -> SENDING) becomes a heap-only update.
--
-- PostgreSQL writes a new entry into every index of outbox_events for each
-- new row version unless no indexed column changed (a HOT update, which
-- stays on its page and writes no index entry). Every partial index was on
-- `state`, and `state_since_ms` was the key of the quarantine index, so each
-- of the three dispatch steps rewrote the primary key, the per-key head
-- index and the lease index.
--
-- `phase` is `state` with CLAIMED and SENDING merged into INFLIGHT. The
-- indexes are on `phase`, so the registration step, which changes `state`,
-- the attempt columns and `state_since_ms` but not `phase`, the lease or
-- the key, leaves every index alone when its page has room. For every
-- other state, `phase = X` is the same condition as `state = X`; queries
-- name `phase` where they want a partial index.
--
-- `key_chain` names an ordering chain: a 64-bit hash of (cluster, topic,
-- routing key), length-prefixed so distinct triples never concatenate to
-- the same text. The per-key head index is on (key_chain, seq): the
-- dispatcher's head scan steps from chain to chain comparing one integer
-- instead of three text columns (about half the time per step), and each
-- entry is 16 bytes of key. Two chains whose hashes collide (odds ~2^-64
-- per pair) are ordered as one: stricter, never looser.
ALTER TABLE outbox_events
    ADD COLUMN phase text COLLATE "C" NOT NULL
        GENERATED ALWAYS AS (CASE WHEN state IN ('CLAIMED', 'SENDING') THEN 'INFLIGHT' ELSE state END) STORED,
    ADD COLUMN key_chain bigint NOT NULL
        GENERATED ALWAYS AS (hashtextextended(length(cluster_id) || ':' || cluster_id || length(topic) || ':' || topic || routing_key, 0)) STORED;

DROP INDEX outbox_events_pending;
CREATE INDEX outbox_events_pending ON outbox_events (seq) WHERE phase = 'PENDING';
DROP INDEX outbox_events_pending_unordered;
CREATE INDEX outbox_events_pending_unordered ON outbox_events (seq)
    WHERE phase = 'PENDING' AND NOT ordered AND publisher = 'outbox';
DROP INDEX outbox_events_open_by_key;
CREATE INDEX outbox_events_open_by_key ON outbox_events (key_chain, seq)
    WHERE phase NOT IN ('PUBLISHED', 'RETAINED', 'PURGED') AND ordered AND publisher = 'outbox';
DROP INDEX outbox_events_unknown;
CREATE INDEX outbox_events_unknown ON outbox_events (next_check_at_ms) WHERE phase = 'DISPATCH_UNKNOWN';
DROP INDEX outbox_events_retry;
CREATE INDEX outbox_events_retry ON outbox_events (seq) WHERE phase = 'RETRY_CLAIMED';
DROP INDEX outbox_events_published;
CREATE INDEX outbox_events_published ON outbox_events (published_at_ms) WHERE phase = 'PUBLISHED';
DROP INDEX outbox_events_retained;
CREATE INDEX outbox_events_retained ON outbox_events (published_at_ms) WHERE phase = 'RETAINED';
-- Quarantined events in the order they arrived (seq), no longer by
-- state_since_ms, which every step writes.
DROP INDEX outbox_events_quarantined;
CREATE INDEX outbox_events_quarantined ON outbox_events (seq) WHERE phase = 'QUARANTINED';
