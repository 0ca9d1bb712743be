// Package natsconsumer is a durable NATS JetStream pull consumer whose
// handler's effects happen once per (Durable, message id), although
// JetStream delivers at least once. It runs consumer's record path
// (consumer.Deliver): the same transaction, inbox claim, failure
// classification, backoff, dead-letter decision, spans and metrics as the
// Kafka consumer; only fetching, acknowledging and dead-letter publishing
// are JetStream's.
//
// # What is guaranteed
//
// For each delivery:
//
//  1. BEGIN; INSERT the message id into the inbox (first statement, ON
//     CONFLICT DO NOTHING); an id already there skips the handler; else
//     the Handler runs in the transaction; COMMIT.
//  2. Only after COMMIT is the message acknowledged (Ack; Run confirms the
//     acks it sent with a round trip to the server before it returns). A
//     crash, a lost connection or a lost ack between COMMIT and the
//     server's receipt of the ack makes JetStream deliver the message again
//     (after AckWait); its id is in the inbox, so the handler does not run
//     again. That redelivery is the one window in which a message is
//     delivered twice; its effect never happens twice.
//  3. A failure that is the message's or its handler's (an error, a panic,
//     a constraint error, a handler timeout) rolls back and is handed back
//     with NakWithDelay (exponential backoff, full jitter). JetStream's
//     delivery count (message metadata) is the attempt count: deliveries
//     that ended with a crash count as well, so a message that kills its
//     process is seen across restarts. On the MaxAttempts-th failed
//     delivery, or at once for dlq.Permanent and dlq.Undecodable errors,
//     the message is dead-lettered; the consumer's MaxDeliver is
//     MaxAttempts+1, and a delivery beyond MaxAttempts (none of the others
//     reached a verdict) is dead-lettered as class crash_loop without
//     running, unless the inbox already holds it.
//  4. Contention (deadlock, serialization failure, lock timeout) and an
//     unreachable database retry in place, spending no attempt; the
//     message is kept from redelivery with InProgress meanwhile.
//  5. A dead letter is published to DeadLetterSubject(subject) with the
//     message's data and headers and provenance headers (HeaderStream,
//     HeaderSubject, HeaderSequence, HeaderDeliveryCount, HeaderConsumer,
//     and package dlq's group, message id, attempts, error class, error and
//     trace context). Only after the DLQ stream's PubAck is the id recorded
//     in the inbox as dead-lettered and the original terminated (Term). If
//     the DLQ stream does not answer, the message waits (InProgress) and
//     the publish is retried with backoff: it is never dropped. A crash
//     between the PubAck and Term republishes the copy with the same
//     Nats-Msg-Id, which the DLQ stream's duplicate window absorbs.
//
// # Batch mode
//
// With BatchSize above 1, the messages one pull request brings (up to
// BatchSize, those the consumer has ready: a batch never waits to fill up)
// share one transaction, through the batch code of the Kafka consumer
// (consumer.DeliverBatch): one multi-row inbox claim, a savepoint per
// message (or one BatchHandler call), one COMMIT, then an Ack per message.
// A message whose handler fails is rolled back to its savepoint alone and,
// after the others committed, handed back with NakWithDelay or
// dead-lettered as in 3 and 5, that failure counting as an attempt; a
// batch whose transaction fails as a whole runs each message alone. The
// consumer's AckPolicy stays explicit: with AckAll, the ack of one message
// would acknowledge every earlier one, those handed back with a Nak and
// those still running in another batch among them.
//
// The dedup id is the Nats-Msg-Id header, else Config.MessageIDHeader,
// else "<stream>/<sequence>" (which dedups redeliveries, not a producer's
// duplicate publish). The scope is the Durable: two durables process a
// message independently.
//
// Trace context travels in the NATS headers traceparent and tracestate;
// each attempt is a "process <subject>" CONSUMER span with
// messaging.system=nats, linked to (and, unless UntrustedProducers,
// parented by) the producer's context.
//
// # The outbox relay
//
// JetStreamPublisher is an outbox.RelayConfig.Publisher: the relay publishes
// committed outbox rows to JetStream (the row's topic is the subject), one
// after another, each after the previous PubAck, with Nats-Msg-Id set to the
// row's message id, and marks them sent only after the PubAcks. A relay that
// stops between the PubAcks and the mark publishes the rows again; the
// stream's duplicate window (Duplicates, default 2 minutes) stores them
// once, and a consumer's inbox skips a republish that comes later.
//
// A handler that enqueues to the outbox (outbox.Enqueue) sends no NOTIFY
// inside its transaction: the record path wakes the relays after the
// commit, as the Kafka consumer does, and Run returns after the last of
// these wake-ups went out.
//
// # What is not guaranteed
//
// Order: messages run Concurrency at a time, and a retried message comes
// back after later ones. A message redelivered because its AckWait passed
// while its attempt still ran (a handler longer than AckWait whose
// InProgress did not reach the server) runs a second attempt concurrently;
// the inbox's unique index serialises the two and one of them is a
// duplicate. A graceful stop finishes the attempts in progress and the
// messages fetched ahead (FetchAhead); a delivery abandoned at
// ShutdownTimeout counts as an attempt, as does every redelivery. A crash
// counts a delivery for every message the process held: those running
// (Concurrency, or Concurrency batches) and those fetched ahead.
//
// # Readiness
//
// Ready and NotReady say whether Run consumes: its connection is up, its
// last fetch succeeded, its last attempt reached the database and its last
// dead-letter publish (if one failed) succeeded since. oncely.Runner's
// AddWorker puts the reasons in /readyz.
package natsconsumer
