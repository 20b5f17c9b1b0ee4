-- An attempt's scan floor is recognised by the message below it: until now
-- by its event only. A replaced log (a broker come back empty under the
-- same cluster id) may hold the same event's message at that offset,
-- written there by another attempt (a paused sender's late write): taken
-- for the old log, the floor said nothing of the new one, and an absence
-- proof above it passed over a copy below. The anchor now names the
-- attempt whose receipt held the offset, too (`outbox_core::anchor_holds`).
-- NULL for a floor of 0 and for attempts registered before this migration
-- (their anchor is checked by event, as before).
ALTER TABLE outbox_attempts ADD COLUMN scan_anchor_attempt_id text COLLATE "C"
    CHECK (scan_anchor_attempt_id IS NULL OR (octet_length(scan_anchor_attempt_id) = 30 AND scan_anchor_attempt_id ~ '^att-[0-7][0-9A-HJKMNP-TV-Z]*$'));
