// Package dedup is oncely's inbox: the table that makes a handler's effects
// happen once per (consumer group, message id) although messages are
// delivered at least once.
//
// # How it works
//
// [Inbox.Claim] inserts (consumer_group, message_id) with ON CONFLICT DO
// NOTHING inside the caller's transaction and reports whether the row is new.
// Use it as the first statement of the transaction that carries the effects:
//
//	BEGIN
//	  claimed := inbox.Claim(ctx, tx, entry)   -- first statement
//	  if !claimed { ROLLBACK; skip }           -- another delivery already did it
//	  ... the handler's writes ...
//	COMMIT
//
// The row and the effects commit or roll back together. Two deliveries racing
// on the same message (a redelivery, a zombie member after a rebalance, two
// replicas) serialize on the primary key: the second INSERT waits for the
// first transaction; if that commits, the second claim reports false; if it
// rolls back, the second claim succeeds. READ COMMITTED is enough.
//
// [Inbox.ClaimMany] does the same for many ids in one statement (unnest + ON
// CONFLICT DO NOTHING RETURNING), for batched transactions.
//
// [Inbox.BeginClaim] and [Inbox.BeginClaimMany] begin the transaction
// themselves, on a connection from a pgxpool.Pool, and send BEGIN and the
// claim in one round trip (pgx's Batch.BeginTx): a transaction per record
// then takes as many round trips as one without an inbox (BEGIN with the
// claim, the handler's statements, COMMIT). The transaction they return is
// pgx's own; Commit or Rollback gives the connection back to the pool. The
// oncely consumer uses them.
//
// # Retention
//
// Rows cannot be kept forever, and a row deleted too early lets a late
// redelivery apply its effects a second time. The rule: the retention of the
// inbox must exceed the retention of the source topic plus the largest lag a
// consumer group can fall behind (a record older than the topic's retention can
// no longer be delivered; a record within it can be redelivered as long as the
// group has not committed past it). [Cleaner] deletes rows whose processed_at
// (database time) is older than the configured retention, in bounded batches,
// and refuses retentions under one hour, far below any sane topic retention.
// Producer-side duplicates (the same message id published twice, hours
// apart) are deduplicated only while the first id is retained.
package dedup
