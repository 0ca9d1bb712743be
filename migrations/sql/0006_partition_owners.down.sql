-- Reverts 0006_partition_owners.up.sql. Run with search_path set to the oncely schema.
DROP TABLE IF EXISTS partition_owners;
