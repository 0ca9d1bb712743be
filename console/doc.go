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
// the webhook endpoints by breaker state.
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
//     record: 60 MB for 100,000). The first view of a topic that Run has not read yet costs
//     the whole read (about 200 ms per 100,000 records). Lists show 100
//     rows a page (keyset pages by partition/offset); counts, the dry run
//     and the redrive cover every match.
//   - A JetStream stream is indexed the same way, read through an ordered
//     consumer with headers only, from the sequence after the last one
//     read; when the stream holds fewer messages than the index (a message
//     deleted inside it), it is read whole again. On the local nats-server
//     a first read takes about 100 ms per 10,000 dead letters (1 s per
//     100,000); later views of 10,000 take 2 to 5 ms, where reading the
//     stream whole (natsconsumer.DeadLetters) takes about 80 ms.
//   - The inbox is counted exactly up to 100,000 rows; above, its total
//     is the planner's estimate (or, for a table never analyzed, a block
//     sample's rows scaled by its share of the pages: within about 5 %),
//     split by group and outcome as a block sample of about 20,000 rows
//     splits it, and every such figure is marked ≈ (exact counts on
//     request: /inbox?exact=1).
//   - Parked outbox rows are listed 100 a page, their held rows counted in
//     one join.
//
// Not done here: the dead letters of brokers other than Kafka and
// JetStream (RabbitMQ's would be one more deadLetterSource), consumer lag
// of JetStream consumers, and a dead-letter index shared between console
// processes (each reads the topics and streams itself).
package console
