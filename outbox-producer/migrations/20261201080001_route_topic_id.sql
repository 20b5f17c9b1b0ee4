-- The Kafka topic id of a route generation's topic, learned when the route
-- was set against the cluster (NULL: not learned). Events routed by a
-- generation with an id freeze a `destination.v2` naming it, so a topic
-- deleted and created again under the same name is another destination.
-- Existing generations keep NULL: their events stay `destination.v1`.
-- Text form: 16 bytes in URL-safe base64 without padding (22 characters).
ALTER TABLE outbox_route_policies
    ADD COLUMN topic_id text
        CHECK (topic_id IS NULL OR (topic_id ~ '^[A-Za-z0-9_-]{21}[AQgw]$' AND topic_id <> 'AAAAAAAAAAAAAAAAAAAAAA'));
