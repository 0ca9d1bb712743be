// Package console is the operator console: server-rendered pages that show
// what is stuck (consumer lag, dead letters, the outbox backlog and its
// parked rows, the inbox, outbound webhook endpoints) and, when actions are
// enabled, fix it (redrive dead letters, retry or discard parked outbox rows,
// redrive dead webhook deliveries, pause and resume endpoints).
//
// [New] returns a [Console], an http.Handler that a service mounts under a
// path of its own (http.StripPrefix is enough: every link and redirect is
// relative), and `oncely console` serves it on its own, running
// [Console.Run] beside it. Every asset is embedded; the pages
// load nothing from any other origin.
//
// Safe by default:
//   - Read-only unless Config.Actions is set: a POST is refused with 403 and
//     no action form is shown.
//   - Every POST needs the CSRF token of the form (a double-submit cookie
//     compared in constant time) and passes net/http's cross-origin
//     protection (Sec-Fetch-Site and Origin checks).
//   - Config.Auth authenticates every request and names the operator with
//     [WithIdentity]; every action is logged with that name. [BearerToken]
//     is the authentication of the standalone command.
//   - No secret is rendered: webhook secrets never, subscription URLs through
//     outbound.RedactURL, and record headers whose names suggest a credential
//     (authorization, cookie, token, secret, password, api-key, signature)
//     are shown as "[redacted]".
//
// # Dead letters of every broker
//
// The dead-letter pages show Kafka's dead-letter topics (Config.KafkaOpts,
// DeadLetterTopics; ?topic=NAME) and JetStream's dead-letter streams
// (Config.JetStream, DeadLetterStreams; ?stream=NAME) alike: the same
// filters (dlq.Filter, and the error text and key; on a stream the source
// is the subject, and the key the natsconsumer.HeaderKey header that the
// outbox relay writes), the same pages of 100, the same record view, dry
// run and redrives. Each broker is a source (see deadLetterSource) that
// lists its places, keeps an index of each, reads the records it shows or
// redrives whole, and redrives them: dlq.Redrive for Kafka,
// natsconsumer.Redrive for JetStream. A JetStream stream is addressed as a
// topic of one partition whose offsets are its stream sequences, as
// natsconsumer.DeadLetters and `oncely dlq --stream` address it (0/17).
// Without DeadLetterStreams the console shows every stream whose subjects
// all start with "dlq.", where natsconsumer.DefaultDeadLetterSubject
// puts dead letters: a stream that also captures other subjects is a
// source stream, not a dead-letter stream of the consumers. A consumer
// configured with another DeadLetterSubject needs its stream named.
//
// RabbitMQ's dead-letter queues (Config.AMQPURL, DeadLetterQueues;
// ?queue=NAME) get the same pages too. The queues must be named: RabbitMQ
// cannot list its queues over AMQP (only its management plugin can). A
// queue is not a log: RabbitMQ shows a message only by delivering it, so a
// listing (rabbitconsumer.OpenDeadLetters) takes the queue whole and holds
// its messages unacknowledged (invisible to any other reader of the queue)
// until it is closed; the console closes each listing before the request
// or round of Console.Run that made it ends, then waits (at most 2 s)
// until RabbitMQ has requeued them, so that the next listing sees them
// all. The pages are served from a snapshot: the index of the queue's last
// listing (the same index as a topic's). A view first asks RabbitMQ for
// the queue's count (a passive declaration, which takes nothing); while it
// is the snapshot's and the snapshot is younger than a minute, the view
// shows the snapshot. Otherwise the view starts a listing in the
// background (one at a time per queue; from views at most one every 2 s)
// and waits for it up to Config.ViewWait, then shows the snapshot with a
// note of its time and the queue's count now; a later view shows the new
// listing. So a dead letter that arrives after the snapshot shows within
// seconds, and one taken and another added (the count unchanged) within a
// minute; Console.Run lists a queue whose count changed at each round. A
// dry run waits for an up-to-date snapshot; a confirmed redrive lists the
// queue itself (below), and what its listing still holds after the
// redrive becomes the snapshot. Listings in one console process wait for
// each other; a listing by another reader (another console process,
// `oncely dlq --queue`) hides its messages from a listing meanwhile, which
// then waits rabbitconsumer.ListIdleTimeout for them and keeps the others. A listing's positions shift as messages leave the
// queue, so the console numbers the dead letters itself: a message keeps
// the number the first listing that showed it gave it, recognised by a
// hash of its body and headers (its group, dedup id, source queue and
// times of dead-lettering among them; not the delivery counts a listing
// changes), identical messages by their order. Those numbers are the
// offsets of the pages' refs (0/NUMBER) and of the dry run's bound: a
// confirmation lists the queue again and redrives, from that listing,
// the messages the filter matches whose numbers are at most the dry
// run's last, so that a dead letter added since is left, however the
// positions moved; one no longer there is reported. The numbers are a
// console process's: the forms carry its numbering, and another process
// (or the same after a restart) refuses them, asking for a new dry run.
//
// Redrive of dead letters goes through dlq.Redrive, which records a redrive
// grant in the consumers' inbox before producing: each redrive runs the
// message exactly once more. Redriving "every record matching the filter"
// first shows a dry run (the count, and the last matching offset of each
// partition, or sequence of the stream); the confirmation applies that
// filter to the records up to those offsets only, so a record
// dead-lettered after the dry run is not redriven by it.
//
// # The overview
//
// What is not ready and why comes first: the reasons of Config.Ready when
// the console is mounted in a service that has one (oncely.Runner.Ready;
// each error of its Unwrap() []error is a line), then the console's own
// findings: the database or the brokers unreachable, a dead-letter topic
// missing, a consumer group behind with no member, parked outbox rows, open
// webhook breakers, inbox rows older than Config.InboxRetention. Then the
// lag per group and topic and per partition with its trend, the dead
// letters by class (per hour of the last day and per day of the last two
// weeks, by last failure), the outbox backlog and parked rows per topic,
// the inbox's rows and its oldest row beside the cleaner's retention, and
// the webhook endpoints by breaker state. With RabbitMQ, the backlog of
// its queues (Config.Queues; by default the source queue of each
// dead-letter queue): messages ready and consumers, from a passive
// declaration (AMQP does not tell the messages delivered and not yet
// acknowledged; the management plugin does), with their trend; a queue
// with messages ready and no consumer is not ready. With JetStream, its
// durable consumers (of Config.Streams; by default every stream but the
// dead-letter streams): messages pending, awaiting acknowledgement,
// redelivered, pull requests waiting and the last delivery, with the
// trend of the pending; a consumer with messages pending, none awaiting
// acknowledgement, no pull request waiting and nothing delivered for a
// minute is not ready.
//
// The lag trend is the change since the oldest sample of the last 15
// minutes. The samples are kept in the console's process (an hour of them,
// at most one per 5 s): each view of the overview takes one, and
// [Console.Run] takes one every Config.SampleInterval. A restarted console
// starts its trend afresh; without Run, the trend covers only the views.
//
// # Cost
//
// Every page is meant to render in well under 300 ms on 1,000,000 inbox
// rows, 100,000 dead letters and 100,000 outbox rows; make bench-console
// measures each page beside its own queries run raw (docs/BENCHMARKS.md).
// How:
//   - Dead letters are indexed in memory (see dlqIndex): a topic is read
//     whole once, at its first view or by Run at start-up, and then only
//     its new records, at each view; the index keeps each record's place,
//     key and decoded oncely headers, not its value (some 600 bytes a
//     record: 60 MB for 100,000). The first view of a topic that Run has
//     not read yet starts the whole read (about 200 to 400 ms per 100,000
//     records) in the background and waits for it Config.ViewWait
//     (default 150 ms); past that it shows the records indexed so far
//     (the read indexes 5,000 at a time) with a note. Lists show 100
//     rows a page (keyset pages by partition/offset); counts, the dry run
//     and the redrive cover every match.
//   - A JetStream stream is indexed the same way, read through an ordered
//     consumer with headers only, from the sequence after the last one
//     read; when the stream holds fewer messages than the index (a message
//     deleted inside it), it is read whole again. On the local nats-server
//     a first read takes about 100 ms per 10,000 dead letters (1 s per
//     100,000); later views of 10,000 take 2 to 5 ms, where reading the
//     stream whole (natsconsumer.DeadLetters) takes about 80 ms.
//   - A RabbitMQ queue's pages are served from its snapshot (above): on
//     the local RabbitMQ a page of a queue of 10,000 dead letters takes 4
//     to 17 ms where one rabbitconsumer listing of it takes 0.45 to 0.7 s
//     (BenchmarkConsoleRabbitPages measures both in each round); the first
//     view in a console just started takes Config.ViewWait and says that
//     the listing goes on. At 100,000 dead letters the pages take 10 to
//     41 ms (the dry run of 33,334 matches 97 to 143 ms), a listing 4 to
//     13 s: the views no longer pay it, but a dry run on a snapshot over a
//     minute old does (Console.Run keeps it younger).
//   - The inbox is counted exactly up to 100,000 rows; above, its total
//     is the planner's estimate (or, for a table never analyzed, a block
//     sample's rows scaled by its share of the pages: within about 5 %),
//     split by group and outcome as a block sample of about 20,000 rows
//     splits it, and every such figure is marked ≈ (exact counts on
//     request: /inbox?exact=1).
//   - Parked outbox rows are listed 100 a page, their held rows counted in
//     one join.
//
// Not done here: the dead letters of brokers other than Kafka, JetStream
// and RabbitMQ, RabbitMQ's unacknowledged counts (management plugin), a
// dead-letter index shared between console processes (each reads the
// topics and streams itself), and a numbering of RabbitMQ dead letters
// shared between them.
package console
