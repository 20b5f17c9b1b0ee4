-- Source identity and copies (issue 20).
--
-- New findings, evidence that stays open until an operator closes it:
--   foreign_source   a message on an outbox topic whose outbox-source is another
--                    outbox's, not declared to the reconciler
--   unrecorded_copy  a byte-identical copy of a published event at a position
--                    that is neither its primary nor a recorded duplicate receipt
--   divergent_copy   the same, with bytes whose digest differs from the event's
ALTER TABLE outbox_findings DROP CONSTRAINT outbox_findings_kind_check;
ALTER TABLE outbox_findings ADD CONSTRAINT outbox_findings_kind_check CHECK (kind IN (
    'aged_pending', 'unconsumed_published', 'bypass_publish', 'unknown_past_slo', 'quarantined',
    'absence_proof_refuted', 'unregistered_message', 'receipt_position_lost', 'published_without_receipt', 'log_unavailable',
    'foreign_source', 'unrecorded_copy', 'divergent_copy'));

-- The outbox-source header of a message kept as bypass evidence (NULL: none).
ALTER TABLE outbox_bypass_messages ADD COLUMN source text;
