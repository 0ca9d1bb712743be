-- Partition owners: one row per (consumer group, topic, partition) that a
-- consumer member holds. A member writes the row when it starts processing a
-- partition and deletes it when it lets the partition go cleanly (revoke or
-- shutdown, after its final offset commit). A row found when a member starts
-- on a partition therefore means that the previous owner died (its process
-- exited, was killed, ran out of memory): the member then runs the partition
-- in probe, one record at a time, writing each record to running_offset and
-- running_id before its handler runs. A record still running (not processed
-- in the inbox) when its owner died is what the process was running: the
-- next start counts the death against it (suspect_offset, suspect_kills),
-- and at the consumer's CrashLoopLimit the record is dead-lettered (class
-- crash_loop). Run with search_path set to the oncely schema (see
-- 0001_inbox.up.sql).
CREATE TABLE partition_owners (
    consumer_group text        NOT NULL,
    topic          text        NOT NULL,
    partition      integer     NOT NULL,
    -- A random token of the member's worker: a member that lost the
    -- partition (a zombie) neither marks nor deletes its next owner's row.
    owner          text        NOT NULL,
    started_at     timestamptz NOT NULL DEFAULT now(),
    -- Consecutive owners that did not let the partition go cleanly.
    deaths         integer     NOT NULL DEFAULT 0,
    -- The record a probe runs (or ran last): its offset and dedup id.
    running_offset bigint,
    running_id     text,
    -- The record that was running when owners died, and how many died so.
    suspect_offset bigint,
    suspect_kills  integer     NOT NULL DEFAULT 0,
    PRIMARY KEY (consumer_group, topic, partition)
);
