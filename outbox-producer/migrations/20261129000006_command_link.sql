-- One event per command key, held by the database for every writer, not only
-- for emit: each event row names its command row (checked once, at insert;
-- the columns never change), and a command row names exactly one event.
ALTER TABLE outbox_commands ADD CONSTRAINT outbox_commands_event_key UNIQUE (event_id, command_key);
ALTER TABLE outbox_events ADD CONSTRAINT outbox_events_command_fkey
    FOREIGN KEY (event_id, command_key) REFERENCES outbox_commands (event_id, command_key);
