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
// if the inbox holds its id as dead-lettered, and is a duplicate if the id
// was processed since.
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
package consumer
