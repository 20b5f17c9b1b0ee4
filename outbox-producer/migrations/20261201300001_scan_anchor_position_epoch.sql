-- A replaced cluster (or a topic without a recorded id deleted and created
-- again) starts each partition's log at offset 0 again, under the same
-- cluster, topic and partition. Two consequences, both handled here:
--
-- 1. An attempt's scan floor (the highest receipted offset of its
--    partition, plus one) was read from the log its receipts were recorded
--    in; on another log it could hide the attempt's message below it. The
--    attempt now also records the event whose receipt held the offset below
--    the floor (its anchor): a lookup reads that offset first, and a log
--    that no longer holds the anchor there is read from its start.
--    NULL for a floor of 0 and for attempts registered before this
--    migration (their floor is trusted as before).
ALTER TABLE outbox_attempts ADD COLUMN scan_anchor_event_id text COLLATE "C"
    CHECK (scan_anchor_event_id IS NULL OR (octet_length(scan_anchor_event_id) = 30 AND scan_anchor_event_id ~ '^evt-[0-7][0-9A-HJKMNP-TV-Z]*$'));

-- 2. A genuine ACK (or a message a lookup read) at a position another
--    event's receipt holds proves that receipt's log is gone: offsets are
--    unique within one log. The new receipt is accepted one epoch above the
--    receipts already at that position (the old one is kept, and reported
--    as `receipt_position_lost`); positions stay unique per epoch. Every
--    receipt recorded so far is epoch 0.
ALTER TABLE outbox_publish_receipts ADD COLUMN position_epoch integer NOT NULL DEFAULT 0 CHECK (position_epoch >= 0);
ALTER TABLE outbox_publish_receipts DROP CONSTRAINT outbox_publish_receipts_position_key;
ALTER TABLE outbox_publish_receipts ADD CONSTRAINT outbox_publish_receipts_position_key
    UNIQUE NULLS NOT DISTINCT (cluster_id, topic, topic_id, partition, "offset", position_epoch);
