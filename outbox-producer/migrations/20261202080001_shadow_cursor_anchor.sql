-- The shadow comparison's cursors share the bypass scan's table shape (and
-- the code that writes them); they keep no anchor.
ALTER TABLE outbox_shadow_cursors ADD COLUMN anchor text CHECK (anchor IS NULL);
