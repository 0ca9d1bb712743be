ALTER TABLE partition_owners DROP COLUMN in_flight;
