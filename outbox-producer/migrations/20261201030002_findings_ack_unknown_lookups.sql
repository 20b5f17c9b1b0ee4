-- `outbox findings ack`: an operator closes a finding, with who and why
-- (a condition that still holds opens a new finding at the next round).
ALTER TABLE outbox_findings
    ADD COLUMN acked_by    text CHECK (length(acked_by) <= 200),
    ADD COLUMN acked_at_ms bigint,
    ADD COLUMN ack_note    text CHECK (length(ack_note) <= 2000);

-- The reconciler's lookups of UNKNOWN events, as evidence for `outbox
-- unknown show`: what the broker answered and what was decided.
CREATE TABLE outbox_unknown_lookups (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id  text   NOT NULL,
    owner     text   NOT NULL,
    at_ms     bigint NOT NULL,
    from_offset bigint NOT NULL,
    lookup    text   NOT NULL CHECK (length(lookup) <= 2000),
    decision  text   NOT NULL CHECK (length(decision) <= 2000)
);
CREATE INDEX outbox_unknown_lookups_event ON outbox_unknown_lookups (event_id, id);
