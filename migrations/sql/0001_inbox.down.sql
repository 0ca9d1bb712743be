-- Reverts 0001_inbox.up.sql. Run with search_path set to the oncely schema.
DROP TABLE IF EXISTS inbox;
