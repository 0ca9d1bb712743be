-- Redrive grants: one row per dead-lettered message that an operator redrove
-- (`oncely dlq redrive`, dlq.Redrive) and that its consumer group has not yet
-- taken up. A record carrying the oncely-redrive header takes over a
-- dead-lettered inbox row only by deleting its grant in the transaction of
-- its claim; the header alone, which any producer can write, changes
-- nothing. Each grant lets one delivery of the message run once more. Run
-- with search_path set to the oncely schema (see 0001_inbox.up.sql).
CREATE TABLE redrive_grants (
    consumer_group text        NOT NULL,
    message_id     text        NOT NULL,
    ref            text        NOT NULL DEFAULT '', -- the dead-letter record redriven: topic/partition/offset
    granted_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, message_id)
);
