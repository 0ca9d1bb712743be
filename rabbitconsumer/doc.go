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
//     after a backoff (exponential, full jitter), up to MaxAttempts; then,
//     or at once for dlq.Permanent and dlq.Undecodable errors, the message
//     is dead-lettered.
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
// RabbitMQ has no delayed redelivery of its own. A failed message could be
// acknowledged and republished to a delay queue whose per-message TTL
// dead-letters it back (durable across crashes, but two publishes and an
// ack per retry, a copy to deduplicate when a crash falls between them,
// and per-message TTLs expire only at the head of a queue, so one long
// delay holds up shorter ones behind it). Instead, a failed message stays
// unacknowledged in the process while it waits for its next attempt, and
// gives up its place of Concurrency meanwhile: other messages run. What it
// holds is one of Prefetch's places (basic.qos, per queue; default
// 4×Concurrency), so a queue stalls only when Prefetch messages all wait
// for retries at once; raise Prefetch where many messages fail together.
// The message never leaves the queue until its verdict: a crash or a lost
// connection returns it to the queue, which delivers it again. Keep
// MaxAttempts×RetryMaxDelay under RabbitMQ's consumer_timeout (30 minutes
// by default), which closes a channel that holds a delivery longer.
//
// # Attempts across crashes: use quorum queues
//
// Attempts within one delivery are counted in the process. Attempts that
// end with the process (os.Exit, the OOM killer, a panic in a goroutine the
// handler started) or with its connection are counted by the queue: a
// quorum queue's x-delivery-count header (and, from RabbitMQ 4.3, whose
// x-delivery-count counts only returns taken for failures, its
// x-acquired-count header: the larger is taken) says how many times the
// message was delivered before, and each such delivery counts as an
// attempt (Source.Spent): the consumer never hands a message back itself,
// so an earlier delivery is one that ended without a verdict. A delivery that comes after MaxAttempts of them is
// dead-lettered as class crash_loop without running, unless the inbox
// shows it finished (processed, or dead-lettered) and only its ack was lost.
// A classic queue counts nothing (only the redelivered flag): there a
// message that kills every process is delivered again without limit, and
// the consumer warns once per queue when it sees a redelivery without the
// header. Consume quorum queues (x-queue-type quorum); a quorum queue's
// delivery-limit argument is a further broker-side backstop.
//
// # Connections
//
// The Consumer owns its connection (Config.URL, or Config.Dial): one
// channel consumes every queue, one in confirm mode publishes dead letters.
// When the connection or a channel closes, the unacknowledged messages go
// back to their queues (RabbitMQ's doing) and the Consumer dials again with
// backoff (up to ReconnectMaxDelay), checks the queues again and resumes;
// meanwhile NotReady says RabbitMQ is not connected. Attempts in progress
// at the loss finish their transactions; their acks fail, and the
// redeliveries are recognised by the inbox. Run fails at start-up, naming
// what is missing, when the inbox table is not migrated
// (consumer.ErrNotMigrated), a queue does not exist, or the dead-letter
// destination does not exist (the dead-letter queue, or DeadLetterExchange
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
// # What is not guaranteed
//
// Order: messages run Concurrency at a time, and a retried message runs
// after later ones. A graceful stop finishes the attempts in progress and
// hands back the messages waiting for a retry (their next delivery counts
// as an attempt); a delivery abandoned at ShutdownTimeout counts as one
// too.
package rabbitconsumer
