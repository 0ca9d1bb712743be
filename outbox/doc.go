// Package outbox publishes events to Kafka exactly when the transaction that
// produced them commits: [Outbox.Enqueue] writes them into the outbox table in
// the caller's pgx.Tx, and a [Relay] publishes committed rows to Kafka.
// Through RelayConfig.Publisher the relay publishes to another broker
// instead (natsconsumer.JetStreamPublisher: NATS JetStream, with
// Nats-Msg-Id set to the message id; rabbitconsumer.Publisher: a RabbitMQ
// exchange, with message_id set to it); shards, order, marking sent and
// parking are the same.
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
// A NOTIFY inside a transaction costs its commit: Postgres takes a
// database-wide lock for it at commit and holds it until the commit record
// is flushed, so transactions that notify commit one at a time. Inside a
// consumer's handler (consumer.Consumer, and the JetStream and RabbitMQ
// consumers of packages natsconsumer and rabbitconsumer, which run the same
// record path), Enqueue therefore sends none: the consumer sends the
// wake-up after the transaction commits, outside it, one statement at a
// time (at most one per 5 ms) for all the transactions that committed
// meanwhile, and its Run
// returns after the last one. Elsewhere (a transaction of your own),
// Enqueue notifies inside the transaction as described above.
//
// # Failures
//
// A failure is classified by its cause. If Kafka is unavailable or answers
// with a transient error (timeouts, leadership moves, a topic whose metadata
// is still settling, a missing cluster-level ACL of the relay itself) the
// rows stay pending and the relay retries the shard with exponential
// backoff; nothing is lost. The rows the broker acknowledged before the
// failure are marked sent; a row after a failed row of its (topic, key) is
// produced again after it, and downstream inboxes dedup the repeat.
//
// A row the broker will never accept is parked instead of blocking its
// shard: a record over the producer's batch limit (checked before producing,
// as kgo refuses it without sending it) or the topic's max.message.bytes
// (MESSAGE_TOO_LARGE, RECORD_LIST_TOO_LARGE), an invalid topic name, a
// missing ACL for its topic (TOPIC_AUTHORIZATION_FAILED), a record the topic
// rejects (INVALID_RECORD, POLICY_VIOLATION). A row that failed that way in a
// batch is produced again on its own first, so rows that only shared its
// Kafka batch are published. Parking writes parked_at and the error into the
// row, in the transaction that marks the batch's other rows sent. The later
// rows of the parked row's (topic, key) are held back, unpublished, so that
// per-key order holds; every other key flows. Parked rows are counted in
// [RelayStats].Parked, [Status].Parked and the oncely.outbox.parked gauge,
// logged at error level, listed by [Outbox.Parked] (`oncely outbox parked`),
// and released by [Outbox.Retry] or [Outbox.RetryAll] (published again, then
// the held rows after it, in order; parked again if still refused) or
// [Outbox.Discard] (deleted; the held rows flow). [Outbox.Enqueue] refuses a
// topic name Kafka would refuse at once. Parked rows are never deleted by
// retention.
//
// Order around a refused row rests on two things: the relay leaves the
// later rows of its key pending (or holds them back) whatever their own
// result, and franz-go fails every batch buffered for a partition after the
// broker refuses one of its batches, so none of them lands ahead of it.
//
// # Retention
//
// Sent rows are deleted by [Relay] (or [Outbox.DeleteSent]) in bounded
// batches once older than the configured retention.
package outbox
