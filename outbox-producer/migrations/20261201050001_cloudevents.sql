-- CloudEvents Kafka protocol binding (binary mode).
--
-- The outbox's source identity (`ce_source`): made once, when this migration
-- runs, and never changed, so `ce_source` + `ce_id` name an event the same
-- way on every attempt for as long as the database lives. A copy of the
-- database (a restored backup, a clone) keeps it.
CREATE TABLE outbox_identity (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    source     text NOT NULL CHECK (octet_length(source) BETWEEN 1 AND 200 AND source !~ '[^!-~]'),
    created_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO outbox_identity (source) VALUES ('urn:uuid:' || gen_random_uuid());
CREATE TRIGGER outbox_identity_frozen BEFORE UPDATE OR DELETE ON outbox_identity
    FOR EACH ROW EXECUTE FUNCTION outbox_frozen();
CREATE TRIGGER outbox_identity_never_truncated BEFORE TRUNCATE ON outbox_identity
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_frozen();

-- Per route generation: whether its messages carry the CloudEvents headers
-- (on by default, existing generations included) and the payload's media
-- type. An event's destination freezes its route generation, and
-- generations become append-only here, so what an event sends is fixed at
-- its commit.
ALTER TABLE outbox_route_policies
    ADD COLUMN cloudevents boolean NOT NULL DEFAULT true,
    ADD COLUMN content_type text NOT NULL DEFAULT 'application/octet-stream'
        CHECK (octet_length(content_type) BETWEEN 3 AND 200 AND content_type ~ '^[A-Za-z0-9!#$&^_.+-]+/[A-Za-z0-9!#$&^_.+-]+ *(;[ -~]*)?$');
CREATE TRIGGER outbox_route_policies_frozen BEFORE UPDATE OR DELETE ON outbox_route_policies
    FOR EACH ROW EXECUTE FUNCTION outbox_frozen();
