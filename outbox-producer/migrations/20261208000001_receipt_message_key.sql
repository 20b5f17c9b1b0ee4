-- The message key a receipt's message carries (issue 47). Headers and
-- payload say nothing of the key: a message naming a registered attempt,
-- with the frozen payload, under another key than the frozen routing key
-- reaches consumers under that key and sits in another key's compaction
-- chain. The receipt decision compares it with the frozen routing key
-- (quarantine reason key_mismatch); the receipts keep it. NULL for
-- receipts recorded before the key was kept (not compared).
ALTER TABLE outbox_publish_receipts ADD COLUMN message_key bytea;
ALTER TABLE outbox_duplicate_receipts ADD COLUMN message_key bytea;
