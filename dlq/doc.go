// Package dlq is oncely's dead-letter format and tooling: which errors send a
// record to the dead-letter topic at once, what a dead-letter record carries,
// and how to list, inspect and redrive dead-lettered records.
//
// # Classification
//
// The consumer dead-letters a record at once, without retries, when it is
// larger than the configured limit ([ClassOversized]), when it cannot be
// decoded ([Undecodable], [ClassUndecodable]) or when the handler returns an
// error marked with [Permanent] ([ClassPermanent]); both markers are found
// through wrapping with errors.As. Other errors and panics are retried with
// backoff up to the consumer's MaxAttempts and then dead-lettered
// ([ClassMaxAttempts], or [ClassPanic] when the last attempt panicked). A
// record whose processing killed the process (os.Exit, out of memory, a
// panic in a goroutine the handler started) as many times as the consumer's
// CrashLoopLimit is dead-lettered when its partition next starts
// ([ClassCrashLoop]).
//
// # The record
//
// A dead-letter record has the original key and value bytes, the original
// headers that pass the header policy (authorization-, cookie-, token- and
// secret-like keys are dropped; message-id and W3C trace context are always
// kept), and oncely's headers, all named with the stable prefix "oncely-dlq-"
// (see the Header constants): where the record came from (topic, partition,
// offset, timestamp), the consumer group and dedup id, the attempt count,
// the first and last failure times, the error class and message (at most
// [MaxErrorLen] bytes), and the trace context of the last attempt.
//
// # Durability and duplicates
//
// The consumer marks the record's offset only after the dead-letter produce
// was acknowledged by all in-sync replicas and the inbox recorded the message
// as dead-lettered, so a redelivery is skipped rather than dead-lettered
// again. If the dead-letter topic cannot be written, the partition waits and
// retries; it never skips. One window remains: a crash after the broker
// acknowledged the dead-letter record and before the inbox row committed
// writes the record to the dead-letter topic a second time on redelivery.
// Both copies carry the same source coordinates and dedup id; [List]
// reports such copies once (see [Entry.Copies]), and redriving either one is
// processed once, because the redriven record keeps the dedup id.
//
// # Redrive
//
// [Redrive] produces dead-lettered records back to their source topic (or
// another), with their key, value, the dedup id as message-id, the trace
// context and a [HeaderRedrive] header naming the dead-letter record, each
// after recording a redrive grant in the consumers' database
// (dedup.Inbox.GrantRedrive; [RedriveOptions] Inbox and DB are required). An
// oncely consumer processes a redriven record whose id the inbox holds as
// dead-lettered once more, consuming the grant in its claim's transaction;
// a record that only carries the header (any producer can write it) is a
// duplicate. If the id is already processed (a second redrive after a
// successful one) it is a duplicate and nothing happens; [Redrive] skips
// records the inbox says were processed without producing them.
package dlq
