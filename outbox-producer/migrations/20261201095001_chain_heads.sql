-- Claims in O(batch): a table of ordering-chain heads (issue 21).
--
-- Until now a claim found the claimable events by walking the head of every
-- open ordering chain (a loose index scan over outbox_events_open_by_key),
-- so its cost grew with the number of open keys: measured, 100,000 pending
-- events on 100,000 keys drained at a fifth of the rate of the same backlog
-- on 1,000 keys. Here each open chain has one row naming its head: the
-- oldest open event of the chain when the head was chosen. A claim reads
-- the claimable heads in seq order from a partial index and locks them
-- (FOR NO KEY UPDATE SKIP LOCKED), `LIMIT n`: O(n) index entries, whatever the
-- backlog behind the heads or the number of chains.
--
-- `outbox_events` stays the record of every event's claim (owner,
-- claim_generation, lease_until_ms, claim_attempt_id): the head row only
-- says which event of its chain may be claimed. Every fenced write goes on
-- checking the event row as before.
--
-- Who keeps the heads:
--   * an insert of an ordered event (emit) appends its chain to
--     outbox_chain_arrivals: insert-only, so emit never waits for a
--     dispatcher or another business transaction, whatever its isolation
--     level;
--   * each claim's transaction first links arrivals
--     (outbox_link_arrivals): a chain with no visible head gets its oldest
--     open event as head; a chain with one is left alone (its new event
--     waits behind the head);
--   * any update of outbox_events (claim, registration, the receipt
--     transaction, reports, release, lease expiry, reconciliation,
--     quarantine, retention) runs the statement trigger below, which keeps
--     the head's claimability equal to its event's (PENDING and
--     next_check_at_ms) and, when the head event closes (PUBLISHED,
--     RETAINED, PURGED), moves the head to the chain's next open event in
--     the same transaction; a row trigger moves an event whose chain
--     changes (a destination migration) to its new chain.
--
-- No lost chain. A chain whose head closes and that has no next open
-- event (in the closing transaction's snapshot) loses its head row and
-- gets an arrival of its own, committed with that transaction. Take an
-- event E of the chain that the closing statement did not see: it commits
-- after that statement began. A linker that consumes E's arrival reads
-- after E committed; if it still sees the old head, the closing
-- transaction had not committed yet, so its own arrival is read by a
-- linker that starts after it committed, and so after E committed, and
-- finds E. A linker that no longer sees a head finds E itself. (Its
-- INSERT ... ON CONFLICT waits for a transaction inserting the same head.)

CREATE TABLE outbox_chain_heads (
    key_chain        bigint PRIMARY KEY,
    event_id         text NOT NULL,
    seq              bigint NOT NULL,
    -- The head's next_check_at_ms while it is PENDING; NULL while it is not
    -- claimable (in flight, DISPATCH_UNKNOWN, RETRY_CLAIMED, QUARANTINED).
    claimable_at_ms  bigint,
    cluster_id       text NOT NULL,
    protocol_version smallint NOT NULL
) WITH (fillfactor = 70);
CREATE INDEX outbox_chain_heads_claimable ON outbox_chain_heads (seq) WHERE claimable_at_ms IS NOT NULL;

CREATE TABLE outbox_chain_arrivals (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key_chain bigint NOT NULL
);

-- The head a chain gets when it has none: its oldest open event.
CREATE FUNCTION outbox_chain_heads_insert(p_chains bigint[]) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET enable_seqscan = off
    SET search_path FROM CURRENT
AS $$
BEGIN
    -- In key_chain order, as every writer of heads goes, so two of them
    -- waiting on each other's new rows wait in one direction.
    INSERT INTO outbox_chain_heads (key_chain, event_id, seq, claimable_at_ms, cluster_id, protocol_version)
    SELECT n.key_chain, n.event_id, n.seq, CASE WHEN n.state = 'PENDING' THEN n.next_check_at_ms END, n.cluster_id, n.protocol_version
    FROM (SELECT DISTINCT c FROM UNNEST(p_chains) AS c) k
    CROSS JOIN LATERAL (
        SELECT e.key_chain, e.event_id, e.seq, e.state, e.next_check_at_ms, e.cluster_id, e.protocol_version FROM outbox_events e
        WHERE e.key_chain = k.c AND e.phase NOT IN ('PUBLISHED', 'RETAINED', 'PURGED') AND e.ordered AND e.publisher = 'outbox'
        ORDER BY e.seq LIMIT 1) n
    ORDER BY n.key_chain
    ON CONFLICT (key_chain) DO NOTHING;
END
$$;

-- Links up to p_limit arrivals (oldest first, skipping those another
-- linker holds), consuming them, and returns how many it took. A claim
-- runs it first in its transaction; the locks it takes (on the arrivals
-- and on the heads it inserts) only ever make another linker wait.
CREATE FUNCTION outbox_link_arrivals(p_limit integer) RETURNS integer
    LANGUAGE plpgsql VOLATILE
    SET enable_seqscan = off
    SET search_path FROM CURRENT
AS $$
DECLARE
    taken integer;
    chains bigint[];
BEGIN
    WITH gone AS (
        DELETE FROM outbox_chain_arrivals a
        WHERE a.id IN (SELECT id FROM outbox_chain_arrivals ORDER BY id LIMIT p_limit FOR UPDATE SKIP LOCKED)
        RETURNING a.key_chain)
    SELECT count(*), array_agg(DISTINCT key_chain) INTO taken, chains FROM gone;
    IF taken = 0 THEN
        RETURN 0;
    END IF;
    -- One primary-key probe per chain; the chains with no visible head
    -- get one (see the header for why a head being closed right now needs
    -- nothing here).
    PERFORM outbox_chain_heads_insert(ARRAY(
        SELECT c FROM UNNEST(chains) AS c WHERE NOT EXISTS (SELECT 1 FROM outbox_chain_heads h WHERE h.key_chain = c)));
    RETURN taken;
END
$$;

-- Moves the heads (p_chains[i], p_events[i]), whose events closed or left
-- their chain, to each chain's next open event; a chain with none loses
-- its head row and gets an arrival, so that a linker looks at it again
-- after this transaction commits (see the header).
CREATE FUNCTION outbox_chain_advance(p_chains bigint[], p_events text[]) RETURNS void
    LANGUAGE plpgsql VOLATILE
    SET enable_seqscan = off
    SET search_path FROM CURRENT
AS $$
BEGIN
    WITH closed AS (SELECT * FROM UNNEST(p_chains, p_events) AS c(kc, ev)),
    nxt AS MATERIALIZED (
        SELECT c.kc, c.ev, n.event_id, n.seq, n.state, n.next_check_at_ms, n.cluster_id, n.protocol_version
        FROM closed c
        LEFT JOIN LATERAL (
            SELECT e.event_id, e.seq, e.state, e.next_check_at_ms, e.cluster_id, e.protocol_version FROM outbox_events e
            WHERE e.key_chain = c.kc AND e.phase NOT IN ('PUBLISHED', 'RETAINED', 'PURGED') AND e.ordered AND e.publisher = 'outbox'
            ORDER BY e.seq LIMIT 1) n ON true),
    moved AS (
        UPDATE outbox_chain_heads h
        SET event_id = x.event_id, seq = x.seq, claimable_at_ms = CASE WHEN x.state = 'PENDING' THEN x.next_check_at_ms END,
            cluster_id = x.cluster_id, protocol_version = x.protocol_version
        FROM nxt x WHERE x.event_id IS NOT NULL AND h.key_chain = x.kc AND h.event_id = x.ev),
    emptied AS (
        DELETE FROM outbox_chain_heads h USING nxt x
        WHERE x.event_id IS NULL AND h.key_chain = x.kc AND h.event_id = x.ev
        RETURNING h.key_chain)
    INSERT INTO outbox_chain_arrivals (key_chain) SELECT key_chain FROM emptied ORDER BY key_chain;
END
$$;

CREATE FUNCTION outbox_chain_arrive() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path FROM CURRENT
AS $$
BEGIN
    INSERT INTO outbox_chain_arrivals (key_chain)
    SELECT DISTINCT key_chain FROM new_rows WHERE ordered AND publisher = 'outbox';
    RETURN NULL;
END
$$;
CREATE TRIGGER outbox_events_chain_arrive AFTER INSERT ON outbox_events
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION outbox_chain_arrive();

-- Reads only the new rows, joined to outbox_chain_heads by primary key,
-- one probe per row: a plan over the transition table is made once per
-- session (it has no parameters) and would otherwise keep whatever join
-- the first, perhaps one-row, statement suggested.
CREATE FUNCTION outbox_chain_follow() RETURNS trigger
    LANGUAGE plpgsql
    SET enable_seqscan = off
    SET enable_hashjoin = off
    SET enable_mergejoin = off
    SET search_path FROM CURRENT
AS $$
DECLARE
    chains bigint[];
    events text[];
BEGIN
    -- Heads whose event closed (PUBLISHED; RETAINED and PURGED follow it).
    SELECT array_agg(h.key_chain ORDER BY h.key_chain), array_agg(h.event_id ORDER BY h.key_chain) INTO chains, events
    FROM new_rows n JOIN outbox_chain_heads h ON h.key_chain = n.key_chain AND h.event_id = n.event_id
    WHERE n.phase IN ('PUBLISHED', 'RETAINED', 'PURGED');
    IF chains IS NOT NULL THEN
        PERFORM outbox_chain_advance(chains, events);
    END IF;
    -- A head is claimable exactly while its event is PENDING, from its
    -- next_check_at_ms. SENDING follows only CLAIMED and RETRY_CLAIMED,
    -- whose heads are already not claimable: registration (and renewing a
    -- sending batch's leases) probes nothing.
    UPDATE outbox_chain_heads h SET claimable_at_ms = CASE WHEN n.state = 'PENDING' THEN n.next_check_at_ms END
    FROM new_rows n
    WHERE h.key_chain = n.key_chain AND h.event_id = n.event_id AND n.phase NOT IN ('PUBLISHED', 'RETAINED', 'PURGED') AND n.state <> 'SENDING'
      AND h.claimable_at_ms IS DISTINCT FROM (CASE WHEN n.state = 'PENDING' THEN n.next_check_at_ms END);
    RETURN NULL;
END
$$;
CREATE TRIGGER outbox_events_chain_follow AFTER UPDATE ON outbox_events
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION outbox_chain_follow();

-- An event that moves to another chain (a destination migration freezes a
-- new cluster or topic) or into or out of ordering leaves its old chain,
-- which gets its next head if the event was its head, and arrives on the
-- new one. Rare: one row at a time.
CREATE FUNCTION outbox_chain_move() RETURNS trigger
    LANGUAGE plpgsql
    SET enable_seqscan = off
    SET search_path FROM CURRENT
AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM outbox_chain_heads WHERE key_chain = OLD.key_chain AND event_id = OLD.event_id) THEN
        PERFORM outbox_chain_advance(ARRAY[OLD.key_chain], ARRAY[OLD.event_id]);
    END IF;
    IF NEW.ordered AND NEW.publisher = 'outbox' AND NEW.phase NOT IN ('PUBLISHED', 'RETAINED', 'PURGED') THEN
        INSERT INTO outbox_chain_arrivals (key_chain) VALUES (NEW.key_chain);
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER outbox_events_chain_move AFTER UPDATE ON outbox_events FOR EACH ROW
    WHEN (OLD.key_chain IS DISTINCT FROM NEW.key_chain OR OLD.ordered IS DISTINCT FROM NEW.ordered OR OLD.publisher IS DISTINCT FROM NEW.publisher)
    EXECUTE FUNCTION outbox_chain_move();

-- Existing rows: each open chain's oldest open event is its head.
INSERT INTO outbox_chain_heads (key_chain, event_id, seq, claimable_at_ms, cluster_id, protocol_version)
SELECT DISTINCT ON (key_chain) key_chain, event_id, seq, CASE WHEN state = 'PENDING' THEN next_check_at_ms END, cluster_id, protocol_version
FROM outbox_events
WHERE phase NOT IN ('PUBLISHED', 'RETAINED', 'PURGED') AND ordered AND publisher = 'outbox'
ORDER BY key_chain, seq;
