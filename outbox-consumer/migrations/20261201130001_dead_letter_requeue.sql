-- `outbox dead-letters requeue` asks the consumer to run a dead-lettered
-- event's handler again: it sets requeue_requested_at_ms (and who asked);
-- the running consumer picks the request up within a second, redrives the
-- event in one transaction with its receipt (the dead letter is deleted) or,
-- if the handler fails again, clears the request and records the attempt.
ALTER TABLE outbox_consumer_dead_letters
    ADD COLUMN requeue_requested_at_ms bigint,
    ADD COLUMN requeue_requested_by text CHECK (length(requeue_requested_by) <= 200);
CREATE INDEX outbox_consumer_dead_letters_requeue ON outbox_consumer_dead_letters (consumer_id, requeue_requested_at_ms)
    WHERE requeue_requested_at_ms IS NOT NULL;
