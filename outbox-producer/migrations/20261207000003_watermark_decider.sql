-- The database that decided a consumer's watermark records (the
-- outbox-watermark-decider header: its PostgreSQL system identifier and
-- database name). The watermark topic's reader pins the first one it sees
-- per consumer and cluster; a record of another database under the same
-- consumer id (a scratch replay, a copy of the consumer's database) is a
-- watermark_rejected finding and moves nothing. `outbox watermarks repin`
-- clears it when the consumer's database really moved.
ALTER TABLE outbox_watermark_publishers
    ADD COLUMN decider text CHECK (decider IS NULL OR length(decider) BETWEEN 1 AND 200);
