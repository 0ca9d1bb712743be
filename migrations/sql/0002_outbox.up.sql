-- The transactional outbox: messages enqueued in the caller's transaction and
-- published to Kafka by the relay. Run with search_path set to the oncely
-- schema (see 0001_inbox.up.sql).
CREATE TABLE outbox (
    id            bigserial   PRIMARY KEY,
    message_id    text        NOT NULL UNIQUE,  -- the record's message-id header: a UUIDv7, or the caller's stable id
    topic         text        NOT NULL,
    key           bytea,
    value         bytea,
    header_keys   text[]      NOT NULL DEFAULT '{}',
    header_values bytea[]     NOT NULL DEFAULT '{}',
    shard         integer     NOT NULL,         -- hash of (topic, key): one relay per shard at a time
    created_at    timestamptz NOT NULL DEFAULT now(),
    sent_at       timestamptz,                  -- NULL while pending
    CHECK (cardinality(header_keys) = cardinality(header_values))
);

-- The relay reads pending rows of one shard in id order.
CREATE INDEX outbox_pending_idx ON outbox (shard, id) WHERE sent_at IS NULL;
-- Retention deletes the oldest sent rows first.
CREATE INDEX outbox_sent_idx ON outbox (sent_at) WHERE sent_at IS NOT NULL;
