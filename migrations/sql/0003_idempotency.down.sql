-- Reverts 0003_idempotency.up.sql. Run with search_path set to the oncely schema.
DROP TABLE IF EXISTS idempotency_keys;
