-- A batch replay: set while a partition's new owner runs the batch its dead
-- predecessor could have been running (up to this offset) as one batch
-- again, instead of one record at a time. A death during that replay counts
-- against no record, and the next owner probes those records one at a time
-- (running_offset, running_id). -1: the owner probes one record at a time
-- (its predecessor died probing or replaying), and so must the next owner,
-- should this one die before its probe ends. NULL: neither. Run with
-- search_path set to the oncely schema (see 0001_inbox.up.sql).
ALTER TABLE partition_owners ADD COLUMN replay_end bigint;
