-- Reverts 0005_outbox_parked.up.sql: parked rows become pending again. Run
-- with search_path set to the oncely schema.
DROP INDEX IF EXISTS outbox_parked_idx;
DROP INDEX IF EXISTS outbox_pending_idx;
ALTER TABLE outbox DROP COLUMN IF EXISTS parked_at, DROP COLUMN IF EXISTS error;
CREATE INDEX outbox_pending_idx ON outbox (shard, id) WHERE sent_at IS NULL;
