-- The reference checks of 20261129000012 name their tables unqualified, so
-- they looked them up on the inserting session's search_path: a session
-- without the outbox schema on it (pg_dump's restore scripts set it empty)
-- failed with "relation does not exist", and one with a schema of its own
-- ahead of the outbox's could satisfy a check with a table of that name.
-- Each now looks in the schema the migrations ran in, whatever the caller's
-- search_path.
ALTER FUNCTION outbox_events_check_references() SET search_path FROM CURRENT;
ALTER FUNCTION outbox_envelopes_check_references() SET search_path FROM CURRENT;
ALTER FUNCTION outbox_attempts_check_references() SET search_path FROM CURRENT;
ALTER FUNCTION outbox_publish_receipts_check_references() SET search_path FROM CURRENT;
