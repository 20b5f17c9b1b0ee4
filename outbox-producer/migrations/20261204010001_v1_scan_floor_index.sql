-- The scan floor of a destination.v1 attempt in one index probe.
--
-- Registration reads, per partition of its batch, the highest receipted
-- offset of the partition's log (the attempt's scan floor, with the
-- receipt's event and attempt as its anchor). For a destination.v2 the
-- position key (cluster_id, topic, topic_id, partition, "offset",
-- position_epoch) answers that with one backward probe. For a
-- destination.v1 (no topic id) neither index did: the key cannot be read
-- in offset order under `topic_id IS NULL`, and the position index lacks
-- the epoch, so PostgreSQL read every receipt of the partition and sorted
-- them, once per partition per batch. Under `dispatch_bench --preload`
-- (100,000 events on 12 partitions) that statement took 176 µs of the
-- database's time per event, and more the longer the table.
--
-- This index holds only the receipts of logs without a topic id, in the
-- order the floor is read.
CREATE INDEX outbox_publish_receipts_v1_floor ON outbox_publish_receipts (cluster_id, topic, partition, "offset", position_epoch)
    WHERE topic_id IS NULL;
