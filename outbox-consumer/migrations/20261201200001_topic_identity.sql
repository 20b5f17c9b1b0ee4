-- Watermarks and receipts name the topic identity of the log they count:
-- the Kafka topic id the messages' frozen destinations name
-- (`destination.v2`), NULL for `destination.v1` messages and for messages
-- whose destination does not parse. A topic deleted and created again under
-- the same name starts a new log at offset 0 under another id: a watermark
-- far along the old log says nothing about the new one, so retention, the
-- unconsumed check and lag match the topic id too, exactly (NULL matches
-- only NULL). A consumer keeps one watermark row per topic id it has
-- decided messages of on a partition.
--
-- Rows written before this migration keep NULL: they count the messages
-- decided until now as of no topic id, and go on counting the
-- destination.v1 messages; a destination.v2 message decided from now on
-- moves the row of its id. (The outbox's receipts of destination.v2 events
-- name their id since its migration 20261201090001: until the consumer has
-- decided one more destination.v2 message on a partition, such a receipt
-- is not passed by the consumer's old row.)
--
-- The key has the topic id after the partition: lookups name every column,
-- and a partition has one or two topic ids, so an index probe on the first
-- four columns finds the row.
--
-- The consumer's queries name the new key: run this migration together
-- with the upgrade of the consumers writing here (an older consumer's
-- upsert names the old primary key, which is gone).
ALTER TABLE outbox_consumer_watermarks
    ADD COLUMN topic_id text
        CHECK (topic_id IS NULL OR (topic_id ~ '^[A-Za-z0-9_-]{21}[AQgw]$' AND topic_id <> 'AAAAAAAAAAAAAAAAAAAAAA'));
ALTER TABLE outbox_consumer_watermarks DROP CONSTRAINT outbox_consumer_watermarks_pkey;
ALTER TABLE outbox_consumer_watermarks ADD CONSTRAINT outbox_consumer_watermarks_log_key
    UNIQUE NULLS NOT DISTINCT (consumer_id, cluster_id, topic, partition, topic_id);

ALTER TABLE outbox_consumer_receipts
    ADD COLUMN topic_id text
        CHECK (topic_id IS NULL OR (topic_id ~ '^[A-Za-z0-9_-]{21}[AQgw]$' AND topic_id <> 'AAAAAAAAAAAAAAAAAAAAAA'));
