-- Watermarks and receipts name the broker cluster of the log they were read
-- from. Two clusters may carry a topic of the same name with unrelated
-- offsets (a route revision to another cluster, a replaced cluster): a
-- watermark far along kafka-b/orders/3 says nothing about kafka-a/orders/3,
-- and retention, the unconsumed check and lag now match on the cluster too.
--
-- Rows written before this migration get the cluster '' ("not known"); no
-- receipt of the outbox has that cluster, so such a watermark holds
-- retention (it passes nothing) until the consumer writes its rows again
-- with its cluster, which it does with its next decision on each partition.
-- The constant default makes ADD COLUMN a catalogue change (no rewrite).
ALTER TABLE outbox_consumer_watermarks ADD COLUMN cluster_id text NOT NULL DEFAULT '';
ALTER TABLE outbox_consumer_watermarks DROP CONSTRAINT outbox_consumer_watermarks_pkey;
ALTER TABLE outbox_consumer_watermarks ADD PRIMARY KEY (consumer_id, cluster_id, topic, partition);

ALTER TABLE outbox_consumer_receipts ADD COLUMN cluster_id text NOT NULL DEFAULT '';
