-- Sound absence proofs (issue 19).
--
-- The end of the lease an attempt was registered under (in the registering
-- dispatcher's clock, like started_at_ms): its message is handed to the
-- client only before it. And the registration time by the database's own
-- clock, so that a reconciler measures how long ago an attempt was
-- registered without trusting the registering host's clock. Rows written
-- before this migration keep NULL in both (the bound then counts from
-- started_at_ms, as before).
ALTER TABLE outbox_attempts ADD COLUMN send_deadline_ms bigint;
ALTER TABLE outbox_attempts ADD COLUMN registered_db_ms bigint;
ALTER TABLE outbox_attempts ALTER COLUMN registered_db_ms SET DEFAULT ((extract(epoch FROM clock_timestamp()) * 1000)::bigint);

-- New findings: evidence that stays open until an operator closes it.
--   absence_proof_refuted     a genuine message of an attempt closed ABSENT
--   unregistered_message      a message with the event's id that no registered attempt sent
--   receipt_position_lost     a receipt's log position no longer holds its event's message
--   published_without_receipt PUBLISHED/RETAINED/PURGED with no primary receipt
--   log_unavailable           a lookup could not prove anything: the log is truncated, recreated or compacted
ALTER TABLE outbox_findings DROP CONSTRAINT outbox_findings_kind_check;
ALTER TABLE outbox_findings ADD CONSTRAINT outbox_findings_kind_check CHECK (kind IN (
    'aged_pending', 'unconsumed_published', 'bypass_publish', 'unknown_past_slo', 'quarantined',
    'absence_proof_refuted', 'unregistered_message', 'receipt_position_lost', 'published_without_receipt', 'log_unavailable'));
