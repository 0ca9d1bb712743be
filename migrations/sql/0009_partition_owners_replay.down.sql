ALTER TABLE partition_owners DROP COLUMN replay_end;
