-- The most records a partition's owner can have started and not finished at
-- once: 1 for a record at a time, BatchSize for batches, MaxBufferedRecords
-- with key parallelism. When the owner dies, the record that killed it is
-- among the first in_flight records of the partition that had not finished,
-- so its next owner probes those (one at a time) and no more: before this
-- column, a probe ran every record up to the partition's end, which after
-- a crash under load could be thousands. NULL (rows written before it):
-- probe up to the end, as before. Run with search_path set to the oncely
-- schema (see 0001_inbox.up.sql).
ALTER TABLE partition_owners ADD COLUMN in_flight integer;
