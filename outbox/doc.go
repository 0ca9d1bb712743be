// Package outbox publishes events to Kafka exactly when the transaction that
// produced them commits: [Outbox.Enqueue] writes them into the outbox table in
// the caller's pgx.Tx, and a [Relay] publishes committed rows to Kafka.
//
// # Identity
//
// Every message gets a UUIDv7 message id when it is enqueued (or keeps the
// id the caller gives it, such as a webhook provider's delivery id), carried
// as the record's message-id header on every publish. Ids are unique in the
// outbox: enqueuing an id that is still there is skipped and reported as a
// duplicate. A relay that dies after
// producing and before marking rows sent publishes them again on restart,
// with the same ids, and downstream oncely consumers (package consumer)
// dedup them in their inbox.
//
// # Order
//
// Messages with the same topic and key reach Kafka in the order their
// enqueuing transactions committed. Two mechanisms make that so:
//
//   - Enqueue takes a transaction-scoped advisory lock per (topic, key)
//     before inserting. A second transaction enqueuing the same key waits
//     until the first commits or rolls back, and only then draws its row id,
//     so for one key, id order is commit order, even when transactions of
//     different keys commit out of id order.
//   - Rows are spread over shards by a hash of (topic, key). A relay
//     publishes a shard only while holding the shard's transaction-scoped
//     advisory lock (pg_try_advisory_xact_lock), reading its pending rows in
//     id order and marking them sent in the same transaction after the
//     broker acknowledged them. Several relays run at once and share the
//     shards; no two publish the same shard concurrently. If a relay dies,
//     its transaction ends and its lock is released as soon as Postgres
//     notices the connection is gone (at once for a killed process; for a
//     silent network partition, within the relay session's
//     idle_in_transaction_session_timeout, set to twice the produce timeout),
//     and the next relay cycle of any replica takes the shard over: the
//     failover time is the lock release plus one poll interval.
//
// Messages without a key have no order guarantee and take no lock.
//
// # Wake-up
//
// Enqueue sends a NOTIFY on commit; relays LISTEN on a dedicated connection
// and wake up at once (debounced). NOTIFY is only a hint: relays also poll
// every PollInterval, so a lost notification or listener delays publishing by
// at most one interval.
//
// # Failures
//
// If Kafka is unavailable the rows stay pending and the relay retries the
// shard with exponential backoff; nothing is lost. A produce that fails
// part-way republishes the whole batch: the records that did arrive arrive
// again with the same ids, and after dedup the order is unchanged.
//
// # Retention
//
// Sent rows are deleted by [Relay] (or [Outbox.DeleteSent]) in bounded
// batches once older than the configured retention.
package outbox
