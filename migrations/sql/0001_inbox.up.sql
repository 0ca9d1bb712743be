-- The inbox: one row per (consumer group, message id) that a consumer has
-- finished with. A row is inserted as the first statement of the transaction
-- that carries the handler's writes, so the row and the effects commit or roll
-- back together, and a second delivery of the same message conflicts on the
-- primary key and becomes a no-op.
--
-- Unqualified names: the migrator runs this file with search_path set to the
-- configured schema (default "oncely"). To apply it by hand:
--   psql -c 'CREATE SCHEMA IF NOT EXISTS oncely'
--   PGOPTIONS='-c search_path=oncely' psql -f 0001_inbox.up.sql
CREATE TABLE inbox (
    consumer_group text        NOT NULL,
    message_id     text        NOT NULL,
    topic          text        NOT NULL DEFAULT '',
    partition      integer     NOT NULL DEFAULT -1,
    "offset"       bigint      NOT NULL DEFAULT -1,
    outcome        text        NOT NULL DEFAULT 'processed'
                               CHECK (outcome IN ('processed', 'dead_lettered')),
    processed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, message_id)
);

-- Retention deletes the oldest rows first, in bounded batches.
CREATE INDEX inbox_processed_at_idx ON inbox (processed_at);
