-- Reverts 0002_outbox.up.sql. Run with search_path set to the oncely schema.
DROP TABLE IF EXISTS outbox;
