// Package rabbitconsumer consumes RabbitMQ queues (with the amqp091-go
// client) so that the handler's effects happen once per (Group, message
// id), although RabbitMQ delivers at least once. It runs consumer's record
// path (consumer.Deliver): the same transaction, inbox claim, failure
// classification, backoff, dead-letter decision, spans and metrics as the
// Kafka consumer and package natsconsumer; only fetching, acknowledging,
// waiting between attempts and dead-letter publishing are RabbitMQ's.
//
// # What is guaranteed
//
// For each delivery:
//
//  1. BEGIN; INSERT the message id into the inbox (first statement, ON
//     CONFLICT DO NOTHING); an id already there skips the handler; else
//     the Handler runs in the transaction; COMMIT.
//  2. Only after COMMIT is the message acknowledged (basic.ack). A crash or
//     a lost connection between COMMIT and the ack makes RabbitMQ deliver
//     the message again; its id is in the inbox, so the handler does not
//     run again. That redelivery is the one window in which a message is
//     delivered twice; its effect never happens twice.
//  3. A failure that is the message's or its handler's (an error, a panic,
//     a constraint error, a handler timeout) rolls back and runs again
//     after a backoff (exponential, full jitter), through the retry queue,
//     up to MaxAttempts; then, or at once for dlq.Permanent and
//     dlq.Undecodable errors, the message is dead-lettered.
//  4. Contention (deadlock, serialization failure, lock timeout) and an
//     unreachable database retry in place, spending no attempt.
//  5. A dead letter is published to DeadLetterExchange with the routing key
//     DeadLetterRoutingKey(queue) (by default the queue "<queue>.dlq"
//     through the default exchange), persistent and mandatory, with the
//     message's body, properties and headers, package dlq's headers (group,
//     message id, attempts, error class, error, trace context) and the
//     provenance headers HeaderQueue, HeaderExchange, HeaderRoutingKey,
//     HeaderDeliveryTag, HeaderRedelivered and HeaderDeliveryCount. Only
//     after RabbitMQ's publisher confirmation is the id recorded in the
//     inbox as dead-lettered and the original acknowledged. A dead letter
//     that is not confirmed, or that no queue takes (basic.return), is
//     published again with backoff while the message waits: it is never
//     dropped. A crash between the confirmation and the ack leaves one
//     copy: the redelivery finds the id dead-lettered in the inbox and is
//     acknowledged without a second copy.
//
// The dedup id is the message_id property, else the Config.MessageIDHeader
// header. RabbitMQ gives a message no other identity that survives a
// redelivery (a delivery tag is the channel's, and changes), so a message
// with neither is dead-lettered at once (class undecodable) with an error
// that says so, never run without the guarantee. The scope is the Group:
// two Groups process a message independently.
//
// # Retries without blocking the queue
//
// RabbitMQ has no delayed redelivery of its own, and a failed message must
// neither block the queue while it waits nor be blamed for deaths it did
// not cause. Two ways were weighed:
//
//   - Keep the failed message unacknowledged in the process, on a timer,
//     while others run. Nothing is published, but the message holds a
//     prefetch place while it waits, so Prefetch must exceed Concurrency for
//     the queue to flow; and then messages wait, delivered but not started,
//     whenever the places to run are full. A quorum queue counts
//     deliveries, not runs: when a message kills the process, every message
//     delivered to it is counted, and after MaxAttempts deaths the
//     innocent ones behind it would be dead-lettered as a crash loop with
//     it.
//   - Hand the message back through a retry queue (chosen): a copy, with
//     HeaderAttempts the attempts spent, is published to RetryQueue(queue)
//     with the backoff as its expiration, and the original is
//     acknowledged once the copy is confirmed. The retry queue has no
//     consumer and dead-letters expired messages back to the queue. The
//     message waits durably in RabbitMQ, holding no place, so Prefetch can
//     stay at Concurrency (the default): every message delivered runs at
//     once, and a process's death is counted only against the messages it
//     was running. The costs: a publish with a confirmation per retry; a
//     crash between the confirmation and the ack leaves the original to be
//     delivered again beside the copy, and the inbox lets only one apply;
//     and per-message expirations end only at the head of a queue, so a
//     retry may come later than its backoff (never sooner), by at most
//     RetryMaxDelay. When the copy cannot be published, the message waits
//     in the process instead, in its place, and runs again there.
//
// Run declares each retry queue: a quorum queue (replicated) that
// dead-letters expired copies to the queue through the default exchange
// with the at-least-once strategy (RabbitMQ drops a copy only once the
// queue confirmed it; by default dead-lettering is at most once), which
// needs the reject-publish overflow. One that exists with other arguments
// fails Run, naming it. Keep RetryMaxDelay under RabbitMQ's
// consumer_timeout (30 minutes by default) all the same: a message held
// longer by a slow handler closes its channel.
//
// # Batch mode
//
// With BatchSize above 1, the deliveries of a queue that the client holds
// when a place (of Concurrency) is free, up to BatchSize, share one
// transaction: a batch never waits to fill up, so a message that arrives
// alone runs at once, and those that arrive while every place is busy make
// up the next batches. Prefetch defaults to Concurrency x BatchSize and
// must be at least that, for the batches to fill. A batch goes through the
// batch code of the Kafka consumer (consumer.DeliverBatch): one multi-row
// inbox claim, a savepoint per message (or one BatchHandler call), one
// COMMIT, then the acknowledgement. A message whose handler fails is rolled
// back to its savepoint alone and, after the others committed, goes to the
// retry queue or the dead-letter destination as in 3 and 5, that failure
// counting as an attempt; a batch whose transaction fails as a whole runs
// each message alone.
//
// A batch is acknowledged with one basic.ack of its highest delivery tag
// (multiple) when that settles exactly the batch: the consumer consumes one
// queue (the channel's delivery tags then arrive in order on one Go
// channel) and no earlier delivery of the channel is still unacknowledged.
// Otherwise, because a multiple ack would also settle an earlier message
// still running in another batch, or abandoned, each message is
// acknowledged on its own. Acknowledgements wait for no failed neighbour:
// those of the committed messages are sent before a failed one publishes
// its retry copy or dead letter.
//
// # Attempts across crashes: use quorum queues
//
// Attempts that fail are counted in the retry copies (HeaderAttempts).
// Attempts that end with the process (os.Exit, the OOM killer, a panic in
// a goroutine the handler started) or with its connection are counted by
// the queue: a quorum queue's x-delivery-count header says how many times
// the message was delivered before (from RabbitMQ 4.3, whose
// x-delivery-count counts only the returns taken for failures, so does its
// x-acquired-count header: the larger is taken). Each such delivery counts
// as an attempt (Source.Spent): the consumer never returns a message to
// its queue itself, so an earlier delivery is one that ended without a
// verdict. A delivery that comes after MaxAttempts of them is dead-lettered
// as class crash_loop without running, unless the inbox shows it finished
// (processed, or dead-lettered) and only its ack was lost. A classic queue
// counts nothing (only the redelivered flag): there a message that kills
// every process is delivered again without limit, and the consumer warns
// once per queue when it sees a redelivery without the header. Consume
// quorum queues (x-queue-type quorum); a quorum queue's delivery-limit
// argument is a further broker-side backstop.
//
// # Connections
//
// The Consumer owns its connection (Config.URL, or Config.Dial): one
// channel consumes every queue, one in confirm mode publishes retry copies
// and dead letters.
// When the connection or a channel closes, the unacknowledged messages go
// back to their queues (RabbitMQ's doing) and the Consumer dials again with
// backoff (up to ReconnectMaxDelay), checks the queues again and resumes;
// meanwhile NotReady says RabbitMQ is not connected. Attempts in progress
// at the loss finish their transactions; their acks fail, and the
// redeliveries are recognised by the inbox. Run fails at start-up, naming
// what is missing, when the inbox table is not migrated
// (consumer.ErrNotMigrated), a queue does not exist, a retry queue exists
// with other arguments, or the dead-letter destination does not exist (the dead-letter queue, or DeadLetterExchange
// when set; whether a queue is bound to it shows only at the first dead
// letter, which is mandatory and waits until one is). RabbitMQ unreachable
// at start-up is waited for.
//
// Trace context travels in the AMQP headers traceparent and tracestate;
// each attempt is a "process <queue>" CONSUMER span with
// messaging.system=rabbitmq, messaging.destination.name the queue,
// messaging.rabbitmq.destination.routing_key and
// messaging.rabbitmq.message.delivery_tag, linked to (and, unless
// UntrustedProducers, parented by) the producer's context.
//
// # The outbox relay
//
// Publisher is an outbox.RelayConfig.Publisher: the relay publishes
// committed outbox rows to an exchange (the row's topic is the routing
// key), one after another, each after the previous publisher confirmation,
// persistent and mandatory (a row that no queue takes is an error and
// stays pending, not a silent drop), with the message_id property set to
// the row's stable message id, and marks them sent only after the
// confirmations. RabbitMQ does not deduplicate: a relay that stops between
// the confirmations and the mark publishes the rows again, and the
// consumers' inboxes skip the copies.
//
// A handler that enqueues to the outbox (outbox.Enqueue) sends no NOTIFY
// inside its transaction: the record path wakes the relays after the
// commit, as the Kafka consumer does, and Run returns after the last of
// these wake-ups went out.
//
// # Dead letters: listing and redriving
//
// OpenDeadLetters opens a dead-letter queue for the tools of package dlq
// (and `oncely dlq list|show|redrive --queue`): Entries lists it,
// Redrive runs chosen dead letters once more, Close ends. RabbitMQ queues
// are not logs: a message cannot be read without being delivered, and
// once acknowledged it is gone. So a listing is a consumer, with manual
// acknowledgement, on a channel of its own: it counts the messages ready
// (a passive declaration), takes the first with basic.get, then the rest
// through a consumer whose prefetch is their number (RabbitMQ hands over
// no more than were there when the listing began; dead letters that come
// later are not listed; past 65,535, AMQP's largest prefetch, a consumer
// for each 65,535 on the same channel) until it has them all, or none came
// for ListIdleTimeout while the queue has none ready. It holds them, unacknowledged, until Close, which
// closes the channel: RabbitMQ puts every message not redriven back in the
// queue, unchanged (body, properties, headers). Meanwhile the listed
// messages are invisible to any other consumer of the dead-letter queue,
// and RabbitMQ's consumer_timeout (30 minutes by default) bounds how long
// a listing may stay open.
//
// The listing order is the queue's order (of a queue of more than 65,536
// messages, within each consumer's share: the shares interleave). On a classic queue, a message
// given back returns to its place; on a quorum queue (RabbitMQ 3.x) the
// messages given back are delivered before the others, in the order they
// were returned, which is the listing's order: both keep the order of a
// listing for the next, and dead letters published meanwhile follow (the
// integration tests check both kinds). A broker that put the messages
// given back behind the others would keep their order too, but dead
// letters that came during a listing would then precede them. An
// entry's ref (its Record.Offset) is its position in the listing, from 0:
// "<queue>/0/<position>", and `--ref 0/<position>` names it only against
// a listing of the same messages: a redrive that removed some, or another
// consumer that took some, shifts the positions. Within one
// DeadLetterQueue (list, then redrive what was listed) the refs are
// exact; the CLI's list and redrive are two listings, so select with
// --message-id where the queue may have changed in between.
//
// A listing is a delivery: on a quorum queue each one adds 1 to the
// messages' x-delivery-count (up to RabbitMQ 4.2, which counts every
// return). Do not give a dead-letter queue a delivery-limit: its listings
// would use it up, and RabbitMQ would then drop or dead-letter the dead
// letters. With dlq.Filter.RefuseInvalid, the listing stops at the first
// message that is not a dead letter (a source queue named by mistake): a
// queue whose first message is not one is refused having delivered, and
// given back, only that message.
//
// Redrive follows dlq.RedriveWith: for each entry it records the redrive
// grant in the consumers' inbox, then publishes the copy and waits for
// the publisher confirmation (mandatory: a copy that no queue takes is an
// error, and its grant is revoked); only then does it remove the dead
// letter, acknowledging it on the listing's channel, with its copies
// (Entry.Copies). The copy goes through the default exchange with the
// source queue (HeaderQueue, the dlq.HeaderTopic of the dead letter) as
// routing key, not to the exchange and routing key it was first published
// with: the exchange may route to other queues (other Groups, which
// processed or dead-lettered the message on their own) or its bindings
// may have changed, while the grant is for the one Group that
// dead-lettered it, consuming that queue. The copy is the dead letter's
// body and properties with message_id the dedup id (the consumer reads it
// first), the dedup id also in the MessageIDHeader header, the message's
// own headers without the oncely-dlq-* ones nor the dead-letter queue's
// x-delivery-count and x-acquired-count (which the consumer would count as
// attempts lost to crashes), and dlq.HeaderRedrive naming the entry's ref.
// The consumer runs the id, held as dead-lettered in its inbox, once more
// only by consuming that grant; a copy that merely carries the header, or
// a second copy, is a duplicate.
//
// A crash, or a lost channel, between the confirmation and the removal
// leaves the dead letter in the queue beside its running copy: the grant
// lets one copy run, once, and a later redrive of the dead letter is
// skipped once the copy has run. A dead letter whose id the inbox holds as
// processed is skipped (dlq.SkipProcessed) and stays in the queue: Redrive
// removes only what it published again, and a dead letter may be the only
// account of a failure left to read; remove such messages with RabbitMQ's
// own tools. A dry run publishes and removes nothing.
//
// # What is not guaranteed
//
// Order: messages run Concurrency at a time per queue, and a retried
// message runs after later ones. A message that dies with the process
// while running beside the one that killed it (Concurrency above 1) is
// counted a death too, as in package natsconsumer; Concurrency 1 blames
// only the killer. A graceful stop finishes the attempts in progress; a
// delivery abandoned at ShutdownTimeout counts as an attempt.
package rabbitconsumer
