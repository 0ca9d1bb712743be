-- Parked outbox rows: a row the broker will never accept (over the size
-- limit, an invalid topic name, no ACL for its topic) is marked parked by the
-- relay instead of blocking its shard. Later rows of the same (topic, key)
-- wait behind it until an operator retries or discards it (oncely outbox
-- retry|discard). Run with search_path set to the oncely schema.
ALTER TABLE outbox
    ADD COLUMN parked_at timestamptz,  -- set while parked; NULL otherwise
    ADD COLUMN error     text;         -- why it was parked (the last produce error)

-- The relay reads only rows it may publish: parked rows leave the index.
DROP INDEX outbox_pending_idx;
CREATE INDEX outbox_pending_idx ON outbox (shard, id) WHERE sent_at IS NULL AND parked_at IS NULL;
-- Parked rows are few; the relay looks them up per shard to hold their keys'
-- later rows back, and operators list them.
CREATE INDEX outbox_parked_idx ON outbox (shard, id) WHERE parked_at IS NOT NULL;
