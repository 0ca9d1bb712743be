// Package consumer is a Kafka consumer-group member whose handler's effects
// happen once per (consumer group, message id), although Kafka delivers at
// least once.
//
// # The record path
//
// Records of one partition are processed in order by that partition's worker;
// partitions are processed in parallel. For each record:
//
//  1. BEGIN a Postgres transaction.
//  2. INSERT the record's dedup id into the inbox (package dedup) with ON
//     CONFLICT DO NOTHING. This is the first statement of the transaction;
//     it goes to Postgres with the BEGIN, in one round trip
//     (dedup.Inbox.BeginClaim).
//  3. If the id was already there, the record is a duplicate: roll back and
//     skip the handler. Otherwise run the Handler with the transaction.
//  4. COMMIT. The inbox row and the handler's writes commit together.
//  5. Mark the record's offset. Marked offsets are committed to Kafka every
//     CommitInterval, and synchronously when partitions are revoked and on
//     shutdown.
//
// A handler error or panic rolls the transaction back and the record is
// retried in place with exponential backoff and full jitter; the partition
// waits meanwhile (its order is kept). After MaxAttempts failed handler runs
// the record goes to its dead-letter topic (package dlq), and so do, at
// once, records that cannot be decoded (see Decoded and JSON, or a KeyFunc
// error), records whose handler returned a dlq.Permanent error, and records
// over MaxRecordBytes. A dead-lettered record's offset is marked only after
// the dead-letter produce was acknowledged and the inbox recorded the id as
// dead-lettered, so a redelivery skips it. If the dead-letter topic cannot
// be written, the partition waits and retries; other partitions keep
// flowing. Database outages (begin, claim or commit failing, a dropped
// connection) are retried without limit: the consumer waits for the
// database rather than failing records. Meanwhile the partition fetches
// nothing more (its group membership and heartbeats go on, so no rebalance
// follows) and Ready reports false; the first transaction that reaches the
// database again resumes it.
//
// A record redriven from a dead-letter topic (it carries the
// dlq.HeaderRedrive header and its original dedup id) is processed once more
// if the inbox holds its id as dead-lettered and a redrive grant for it
// exists (recorded by dlq.Redrive) for the dead-letter record its header
// names: its claim consumes the grant in the same transaction, so each
// redrive runs the message once. Without such a grant (the header alone,
// which any producer can write, even naming another dead-letter record
// while an operator's grant is pending) or if the id was processed since,
// it is a duplicate.
//
// # Start-up and readiness
//
// Run fails at start-up, with an error naming what is wrong, when a table it
// uses (inbox, redrive_grants, partition_owners) is missing
// (ErrNotMigrated) or when a topic or its dead-letter topic does not exist
// (ErrMissingTopics): the consumer never creates topics. Brokers that do
// not answer at start-up are waited for; past Config.BrokerTimeout an
// ERROR names them. Ready is false, and NotReady says why, while no broker
// answers (checked every two seconds, and while starting), a partition
// waits for the database or for its dead-letter topic, or a partition has been on one
// record longer than Config.StuckAfter. Only the partitions the member owns
// count: a revoked one stops counting at once.
//
// # Records that kill the process
//
// A handler (or a KeyFunc) that kills the process (os.Exit, running out of
// memory, a panic in a goroutine it started) leaves no error to count: Message.Attempt
// starts again in each process, and every owner of the partition would die
// on the record in turn. So each partition a member holds has a row in
// the partition_owners table (migration 0006), written when its worker
// starts (as soon as the partition is assigned, whether or not it has
// records) and deleted when the partition leaves the member cleanly (a
// revoke, a shutdown, after the final offset commit). A member that finds
// the row already there knows that the previous owner died, and runs the
// partition in probe through the records the dead owner could have been
// running (as many of the partition's unfinished records as it could have
// had started at once: 1, its BatchSize, or its MaxBufferedRecords with key
// parallelism, written to its row as in_flight, migration 0008; records the
// inbox holds as finished go by as duplicates without counting, and without
// a KeyFunc pass in bulk: one statement asks the inbox about the records
// buffered ahead, and those it finds finished pass without a mark or a
// transaction each, as they run no user code; a row without it probes
// up to the records there when the probe started): one record at a time, each in its own transaction, whatever
// the mode, and one at a time across all of the member's probing
// partitions, each record's offset written to the row before its KeyFunc
// and handler run (its id too, once KeyFunc has returned it). When the
// process dies, the next start counts the death against the record marked
// then if its id was not known yet or the inbox does not hold it (processed,
// or dead-lettered with no redrive of it pending), so a mark left on a
// finished record counts for nothing, and the mark is cleared when the
// probe ends; when Config.CrashLoopLimit deaths are counted against it, the
// probe dead-letters it (class crash_loop, its error saying how many
// processes it killed) through the dead-letter path above, instead of
// running it or its KeyFunc, and the partition goes on. Its dead letter
// carries the id the mark held, or topic/partition/offset when the process
// died in KeyFunc (as an undecodable record's). A death while the
// partition was idle, between records or outside a probe counts against no
// record, so the record that kills every process is dead-lettered on the
// start after it killed at most CrashLoopLimit+1 of them. In batch mode and
// with key parallelism, without a KeyFunc, a death outside a probe is first
// replayed: the
// records the dead owner could have been running run again as this
// consumer runs records (one batch, or on the lanes), marked as a replay in
// the row (migration 0009); a death during the replay counts against no
// record and makes the next start probe one record at a time, so a restart
// after a kill from outside costs one batch, and the record that kills
// every process, one death more (CrashLoopLimit+2). Probing
// partitions take turns, so a
// marked record is never blamed for another probing partition's record; a
// partition not in probe can still kill the process while a marked record
// runs, which blames that record once (it is dead-lettered only after
// CrashLoopLimit such deaths on it). Ordinary processing pays
// nothing for this: a statement when a partition is assigned and one when
// it is revoked. A probe does pay: after a crash, up to a batch of the
// partition's unfinished records (a buffer with key parallelism) run one
// record at a time, with a mark per record (one statement; two with a
// KeyFunc), one statement per look-ahead of up to 1000 buffered records,
// and one more when the probe ends; with a KeyFunc, every record that had
// finished is marked and claimed in a transaction of its own too.
//
// # Batches and key parallelism
//
// With Config.BatchSize above 1, up to BatchSize records of a partition
// share a transaction: one multi-row inbox claim (dedup.Inbox.ClaimMany),
// then each new record's Handler under a savepoint of its own (or one
// BatchHandler call for all of them), one commit, then the offsets. A record
// whose handler fails is rolled back to its savepoint and its claim released
// (dedup.Inbox.Release); after the commit it is retried on the record path
// above, and so are the later records of the batch with its key, in order.
// Records that cannot join a batch (oversized, an undecodable id, a redrive)
// take the record path in their place.
//
// With Config.KeyParallelism above 1, a partition's records with different
// keys run concurrently, up to KeyParallelism at a time, and records with
// the same key in offset order. The marked offset is the low watermark. In
// both modes the order across keys may change (never within a key); per
// partition, Config.Concurrency bounds the transactions in flight.
//
// # When effects contend
//
// Records are often keyed apart from the rows their handlers write: orders
// keyed by order id, each adding to its customer's balance. Then the
// transactions of different partitions, and of different members, write the
// same rows, and two batches that lock them in differing orders deadlock.
// Four things keep that from collapsing throughput:
//
//   - Config.ConflictKeys names the rows a message writes ("customer:42").
//     Every transaction locks its records' keys (pg_advisory_xact_lock of a
//     hash) in ascending order, in the round trip that begins it, before
//     any handler runs. Transactions that share a key, of any member, take
//     turns; Postgres never sees a cycle. Transactions that share none run
//     side by side. Those of one member take their turns in the process,
//     before they begin, first come first served (Stats.TurnWaits,
//     oncely.consumer.turn_waits), so none waits in Postgres behind another
//     of its own member: waiters there hold the locks they took so far and
//     block the rest, and each one more slowed the group down. A batch
//     locks all its records' keys at once: hot keys make batches take
//     turns, so make batches cheap (a BatchHandler doing set-based writes
//     takes a few round trips for a whole batch).
//   - Contention is not failure. A deadlock (40P01), a serialization
//     failure (40001) or a lock timeout (55P03) runs the transaction again
//     after a pause of a few milliseconds, spends no attempt, is counted in
//     Stats.Contention and the oncely.consumer.contention metric, and never
//     dead-letters a record.
//   - Without ConflictKeys, nothing says which transactions conflict. A
//     batch bounds its lock waits (Config.BatchLockTimeout); the first
//     record of a batch that loses to contention rolls the batch back, and
//     the consumer runs its transactions one at a time, group-wide (they
//     all take one advisory lock of the group), until none has lost for ten
//     seconds. Members join the window as they lose in turn. Throughput then
//     is that of one transaction at a time, without deadlocks; ConflictKeys
//     lets transactions of unrelated rows run side by side instead.
//   - Config.GroupConcurrency bounds the transactions in flight of the
//     whole group: each member runs its share, by the partitions it holds,
//     and takes a new one at every rebalance. Batches that write the same
//     hot rows commit one after another, and each member with a pool of its
//     own would otherwise add transactions that only wait; the bound keeps
//     the group at what serves the rows best, however many members it has
//     (once a rebalance has settled, with no more members than the bound).
//
// A batch's savepoints cost no round trip of their own: each travels in front
// of its handler's first statement (a handler's statements go through a
// pgx.Tx that sends it with the first of them). What the batch's handlers
// enqueue to the outbox (outbox.Enqueue, messages without an id) is written
// once, in one statement with its per-key locks in sorted order, just before
// the batch commits; a record rolled back to its savepoint takes its
// messages with it.
//
// # Where a new group starts
//
// A group reads a partition from its committed offset. Where it has none (a
// new group, or a topic or partition added later), Config.StartOffset
// decides: StartEarliest (the default) reads from the oldest record the
// broker keeps, so a new group processes the topic's whole retained
// history; StartLatest reads only what is produced after the group got the
// partition, and never sees the records before. A committed offset that
// retention has since deleted resumes at the oldest record kept, whatever
// StartOffset says: records that still exist are never skipped.
//
// # Where duplicates are possible, and why they do no harm
//
// Offsets are an optimisation. A record's offset is committed only after its
// transaction committed, so the committed offset never passes a record whose
// effects are not durable. The converse window is open by design: a member
// that crashes after step 4 and before its offset commit leaves records whose
// effects committed but whose offsets did not; the next owner of the
// partition receives them again. Step 2 finds their ids and skips them. The
// same happens to a zombie: a member that lost its partition (session
// timeout, a rebalance it held up past RevokeTimeout) while its handler was
// still running. Its transaction and the new owner's serialize on the inbox's
// primary key: if the zombie commits first, the new owner's claim is a no-op;
// if the zombie's transaction was abandoned (rolled back), the new owner
// applies the effects. Either way, once. READ COMMITTED is enough.
//
// What the inbox cannot catch: effects outside the transaction (HTTP calls,
// emails: use an outbox), and two different ids for one logical message (with
// neither KeyFunc nor a message-id header, the id is topic/partition/offset,
// so a producer that publishes the same message twice produces two ids).
//
// # Group membership
//
// The member uses the cooperative-sticky balancer, so partitions that do not
// move keep flowing during a rebalance. Revoked partitions finish (or, after
// RevokeTimeout, abandon) their in-flight record and commit their offsets
// before the rebalance proceeds; lost partitions commit nothing. Static
// membership (InstanceID) lets a restarted member take its partitions back
// without a group-wide rebalance, and a short SessionTimeout moves a killed
// member's partitions on quickly. Shutdown finishes in-flight records,
// commits, and leaves the group as a bounded best effort (ShutdownTimeout).
//
// # Other brokers
//
// The record path (Consumer.deliver in consumer.go: the transaction, the
// claim, the handler, the classification, the backoff, the dead-letter
// decision, spans and metrics) is the same for every broker. What differs
// is a Source: how a failed record comes back (the Kafka worker waits and
// runs it again; JetStream is told NakWithDelay), how a finished one is
// acknowledged, how a dead-letter copy is written and confirmed, and what
// the broker counts of a record's deliveries. NewRecordPath and Deliver
// give that path to an adapter; packages natsconsumer and rabbitconsumer
// are two.
package consumer
