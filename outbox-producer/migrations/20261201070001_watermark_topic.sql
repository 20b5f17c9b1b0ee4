-- Consumers publish their watermarks over the broker (the watermark topic,
-- `outbox.watermarks` by default, one per cluster); the producer side reads
-- it and applies the records to outbox_consumer_watermarks. This adds what
-- that reader keeps: its read position and, per consumer and cluster, when
-- a record last arrived (for stale_watermark); and the findings it raises.

-- How far the reader has applied each partition of the watermark topic. The
-- position moves in the transaction that applies the records below it, so a
-- record is applied once; a first read starts at the log's start.
CREATE TABLE outbox_watermark_topic_cursors (
    cluster_id  text    NOT NULL,
    topic       text    NOT NULL,
    partition   integer NOT NULL CHECK (partition >= 0),
    next_offset bigint  NOT NULL CHECK (next_offset >= 0),
    PRIMARY KEY (cluster_id, topic, partition)
);

-- Per declared consumer and cluster: when its last acceptable record was
-- read (the reader's clock), the consumer's own time in it, and counts.
CREATE TABLE outbox_watermark_publishers (
    consumer_id          text   NOT NULL,
    cluster_id           text   NOT NULL,
    last_received_ms     bigint NOT NULL,
    last_published_at_ms bigint NOT NULL,
    records_accepted     bigint NOT NULL DEFAULT 0 CHECK (records_accepted >= 0),
    records_ignored      bigint NOT NULL DEFAULT 0 CHECK (records_ignored >= 0),
    PRIMARY KEY (consumer_id, cluster_id)
);

ALTER TABLE outbox_findings DROP CONSTRAINT outbox_findings_kind_check;
ALTER TABLE outbox_findings ADD CONSTRAINT outbox_findings_kind_check CHECK (kind IN (
    'aged_pending', 'unconsumed_published', 'bypass_publish', 'unknown_past_slo', 'quarantined',
    'absence_proof_refuted', 'unregistered_message', 'receipt_position_lost', 'published_without_receipt', 'log_unavailable',
    'foreign_source', 'unrecorded_copy', 'divergent_copy',
    'watermark_undeclared_consumer', 'watermark_moved_back', 'watermark_beyond_end', 'watermark_rejected', 'stale_watermark'));
