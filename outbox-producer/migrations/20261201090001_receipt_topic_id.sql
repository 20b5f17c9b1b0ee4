-- Receipts name the topic identity of their log position: the Kafka topic
-- id the message's frozen destination names (`destination.v2`), NULL for a
-- `destination.v1`. A topic deleted and created again under the same name
-- starts a new log at offset 0: a position of the new log is not one of the
-- old, so the position key becomes (cluster, topic, topic id, partition,
-- offset), the topic id compared exactly (NULL matches only NULL).
-- Text form as the route column's (20261201080001).

-- The topic id a frozen destination's canonical bytes name: the `topicId`
-- field of a `destination.v2` (third field, after the length-prefixed
-- `clusterId` and `topic`), NULL for any other record. Bytes that claim
-- `destination.v2` and do not parse are refused: emit only stores bytes
-- outbox-core has parsed.
CREATE FUNCTION outbox_destination_topic_id(canonical bytea) RETURNS text
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    rest bytea;
    field text;
    digits bytea;
    colon integer;
    len integer;
BEGIN
    IF substring(canonical FROM 1 FOR 15) IS DISTINCT FROM convert_to(E'destination.v2\n', 'UTF8') THEN
        RETURN NULL;
    END IF;
    rest := substring(canonical FROM 16);
    FOREACH field IN ARRAY ARRAY['clusterId', 'topic', 'topicId'] LOOP
        -- <field>=<byte length>:<value>\n
        colon := position('\x3a'::bytea IN rest);
        IF substring(rest FROM 1 FOR length(field) + 1) IS DISTINCT FROM convert_to(field || '=', 'UTF8')
           OR colon NOT BETWEEN length(field) + 3 AND length(field) + 14 THEN
            RAISE EXCEPTION 'malformed destination.v2: field % expected', field USING ERRCODE = 'data_exception';
        END IF;
        digits := substring(rest FROM length(field) + 2 FOR colon - length(field) - 2);
        IF encode(digits, 'escape') !~ '^[0-9]{1,9}$' THEN
            RAISE EXCEPTION 'malformed destination.v2: field % has no length', field USING ERRCODE = 'data_exception';
        END IF;
        len := encode(digits, 'escape')::integer;
        IF length(rest) < colon + len + 1 OR get_byte(rest, colon + len) <> 10 THEN
            RAISE EXCEPTION 'malformed destination.v2: field % truncated', field USING ERRCODE = 'data_exception';
        END IF;
        IF field = 'topicId' THEN
            RETURN convert_from(substring(rest FROM colon + 1 FOR len), 'UTF8');
        END IF;
        rest := substring(rest FROM colon + len + 2);
    END LOOP;
    RETURN NULL;
END $$;

ALTER TABLE outbox_publish_receipts
    ADD COLUMN topic_id text COLLATE "C"
        CHECK (topic_id IS NULL OR (topic_id ~ '^[A-Za-z0-9_-]{21}[AQgw]$' AND topic_id <> 'AAAAAAAAAAAAAAAAAAAAAA'));
ALTER TABLE outbox_duplicate_receipts
    ADD COLUMN topic_id text COLLATE "C"
        CHECK (topic_id IS NULL OR (topic_id ~ '^[A-Za-z0-9_-]{21}[AQgw]$' AND topic_id <> 'AAAAAAAAAAAAAAAAAAAAAA'));

-- Receipts written before this migration: the topic id their own frozen
-- destination names (the column states what the envelope already froze;
-- only `destination.v2` rows change, and nothing else of them). The
-- receipts' append-only trigger is set aside for this one statement.
ALTER TABLE outbox_publish_receipts DISABLE TRIGGER outbox_publish_receipts_frozen;
UPDATE outbox_publish_receipts r SET topic_id = outbox_destination_topic_id(v.destination_canonical)
FROM outbox_envelopes v
WHERE v.event_id = r.event_id AND v.envelope_generation = r.envelope_generation
  AND substring(v.destination_canonical FROM 1 FOR 15) = convert_to(E'destination.v2\n', 'UTF8');
ALTER TABLE outbox_publish_receipts ENABLE TRIGGER outbox_publish_receipts_frozen;
UPDATE outbox_duplicate_receipts r SET topic_id = outbox_destination_topic_id(v.destination_canonical)
FROM outbox_envelopes v
WHERE v.event_id = r.event_id AND v.envelope_generation = r.envelope_generation
  AND substring(v.destination_canonical FROM 1 FOR 15) = convert_to(E'destination.v2\n', 'UTF8');

-- One event per log position, the position naming its topic identity.
-- The position index without the topic id stays, not unique, for the
-- lookups by position whatever the log (the bypass scan: which receipts
-- claim the offsets it read, or offsets past the log's end); the key,
-- with the topic id before the partition, serves the lookups of one log
-- (the highest receipted offset of a partition of one topic id, where an
-- attempt's scan starts).
ALTER TABLE outbox_publish_receipts DROP CONSTRAINT outbox_publish_receipts_cluster_id_topic_partition_offset_key;
ALTER TABLE outbox_publish_receipts ADD CONSTRAINT outbox_publish_receipts_position_key
    UNIQUE NULLS NOT DISTINCT (cluster_id, topic, topic_id, partition, "offset");
CREATE INDEX outbox_publish_receipts_position ON outbox_publish_receipts (cluster_id, topic, partition, "offset");

ALTER TABLE outbox_duplicate_receipts DROP CONSTRAINT outbox_duplicate_receipts_event_id_envelope_generation_clus_key;
ALTER TABLE outbox_duplicate_receipts ADD CONSTRAINT outbox_duplicate_receipts_position_key
    UNIQUE NULLS NOT DISTINCT (event_id, envelope_generation, cluster_id, topic, topic_id, partition, "offset");
