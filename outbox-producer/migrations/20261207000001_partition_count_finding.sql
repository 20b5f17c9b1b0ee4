-- A routed topic whose partition count is not the one its current route
-- policies froze is a finding (partition_count_changed, raised by the
-- reconciler's bypass scan, evidence kept open until an operator closes
-- it): events routed to partitions the topic lacks wait, and said nothing
-- before.
ALTER TABLE outbox_findings DROP CONSTRAINT outbox_findings_kind_check;
ALTER TABLE outbox_findings ADD CONSTRAINT outbox_findings_kind_check CHECK (kind IN (
    'aged_pending', 'unconsumed_published', 'bypass_publish', 'unknown_past_slo', 'quarantined',
    'absence_proof_refuted', 'unregistered_message', 'receipt_position_lost', 'published_without_receipt', 'log_unavailable',
    'foreign_source', 'unrecorded_copy', 'divergent_copy', 'scan_gap',
    'watermark_undeclared_consumer', 'watermark_moved_back', 'watermark_beyond_end', 'watermark_rejected', 'stale_watermark',
    'partition_count_changed'));
