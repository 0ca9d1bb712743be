// Command orderworker is oncely's runnable example: a Kafka consumer that
// records orders and credits customer balances, exactly once per order,
// although Kafka delivers at least once and workers crash, and announces
// each order with exactly one order.accepted event through oncely's outbox.
//
// Usage:
//
//	orderworker [run] [flags]   consume the orders topic (the worker)
//	orderworker demo [flags]    crash a worker mid-stream and prove no order counted twice
//	orderworker produce [flags] publish random orders, some of them twice
//	orderworker check [flags]   check the history: each order counted, announced
//	                            and each poison record dead-lettered exactly once
//
// The demo needs nothing but a Postgres (DATABASE_URL, default the local
// server); Kafka runs in-process:
//
//	go run ./examples/orderworker demo
//
// Every record on the orders topic is a JSON order with a message-id header.
// The handler inserts a row into orders, adds the amount to the customer's
// balance and enqueues an order.accepted event (key: the order id) for the
// events topic (--events-topic, default order-events), all in one
// transaction. Neither write is idempotent; oncely's inbox, claimed in the
// same transaction, is what makes a redelivered or republished order a
// no-op. An outbox relay running next to the consumer publishes the events
// once the transaction committed. A record that is not a valid order (not
// JSON, a field missing, an amount that is not positive) goes to the
// dead-letter topic orders.dlq at once, and the orders behind it keep
// flowing.
//
// With --source jetstream or rabbitmq the orders come from, and the events
// go to, NATS JetStream (subjects of the same names, streams created if
// missing) or RabbitMQ (queues of the same names, declared if missing)
// instead; see the README.
//
// Orders also arrive over HTTP, on the worker's --http-addr, and reach the
// same consumer through the outbox and the orders topic:
//
//	POST /webhooks/orders  a Standard Webhooks delivery whose body is the
//	                       order; secret(s) in WEBHOOK_SECRET (whsec_...,
//	                       comma-separated while rotating); 202 once stored,
//	                       503 while no secret is configured
//	POST /orders           the order as JSON, with an Idempotency-Key header
//	                       (400 without); 202 once stored, and every retry
//	                       with the key gets the same response back
//
// The worker serves GET /healthz (also GET /readyz, with the reasons when
// not ready), GET /livez and GET /metrics (Prometheus text format) on
// --http-addr too, exports spans and metrics over OTLP/HTTP when
// OTEL_EXPORTER_OTLP_ENDPOINT (or its _TRACES_ or _METRICS_ variant) is set,
// configured by the standard OTEL_* variables, and writes spans to stdout
// with --trace-stdout. Run `orderworker run -h` for the worker's flags and
// their environment variables.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/examples/orderworker/internal/testhalt"
	"github.com/oncely/oncely/internal/kafkaflags"
	"github.com/oncely/oncely/webhook"
	"github.com/oncely/oncely/webhook/outbound"
)

// Exit codes.
const (
	exitOK    = 0 // clean shutdown, or a demo whose checks passed
	exitError = 1 // the consumer (or the demo's checks) failed
	exitUsage = 2 // invalid command line or environment
)

const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

func main() {
	os.Exit(run(os.Args[1:], os.Getenv, os.Stdout, os.Stderr))
}

// run dispatches to a subcommand and returns the process's exit code.
func run(args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	cmd := "run"
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		cmd, args = args[0], args[1:]
	}
	switch cmd {
	case "run":
		return runCmd(args, getenv, stdout, stderr)
	case "demo":
		return demoCmd(args, getenv, stdout, stderr)
	case "produce":
		return produceCmd(args, getenv, stdout, stderr)
	case "check":
		return checkCmd(args, getenv, stdout, stderr)
	case "help":
		printf(stdout, "usage: orderworker [run|demo|produce|check] [flags]; `orderworker CMD -h` lists a command's flags\n")
		return exitOK
	default:
		printf(stderr, "orderworker: unknown command %q (want run, demo, produce or check)\n", cmd)
		return exitUsage
	}
}

// runCmd is the worker: it consumes until SIGTERM or SIGINT, then drains,
// commits its offsets, leaves the group, lets the relay publish the last
// events and flushes its telemetry.
func runCmd(args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	cfg, err := parseRunFlags(args, getenv, stderr)
	if err != nil {
		return usageExit(stderr, err)
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	go func() {
		// After the first signal, restore the default behaviour: a second
		// Ctrl-C kills the process instead of waiting for the drain.
		<-ctx.Done()
		stop()
	}()

	if err := runWorker(ctx, cfg, stdout, log); err != nil {
		log.Error("orderworker failed", "err", err)
		return exitError
	}
	return exitOK
}

// parseRunFlags parses the worker's flags. Each flag falls back to an
// environment variable, then to a default; flags win.
func parseRunFlags(args []string, getenv func(string) string, stderr io.Writer) (cfg workerConfig, err error) {
	fs := flag.NewFlagSet("orderworker run", flag.ContinueOnError)
	fs.SetOutput(stderr)
	source := fs.String("source", envOr(getenv, "SOURCE", sourceKafka), "broker of the orders and the events: kafka; jetstream (NATS JetStream at --nats; the streams are created if missing); rabbitmq (RabbitMQ at --amqp; the queues are declared if missing); the Kafka flags are unused with the others (env SOURCE)")
	fs.StringVar(&cfg.NATSURL, "nats", envOr(getenv, "NATS_URL", nats.DefaultURL), "NATS server of --source jetstream (env NATS_URL)")
	fs.StringVar(&cfg.AMQPURL, "amqp", "", "RabbitMQ of --source rabbitmq (env AMQP_URL; default "+outbound.RedactURL(defaultAMQPURL)+")")
	ackWait := fs.String("ack-wait", envOr(getenv, "ACK_WAIT", "30s"), "with --source jetstream: how long JetStream waits for an ack before delivering a message again, the time a crashed worker's messages take to come back, a Go duration (env ACK_WAIT)")
	brokers := fs.String("brokers", getenv("KAFKA_BROKERS"), "comma-separated seed brokers (env KAFKA_BROKERS); empty: start an in-process kfake cluster")
	fs.StringVar(&cfg.Topic, "topic", "orders", "topic (or subject) to consume; POST /orders and POST /webhooks/orders publish to it, through the outbox")
	fs.StringVar(&cfg.EventsTopic, "events-topic", envOr(getenv, "EVENTS_TOPIC", "order-events"), "topic of the order.accepted events, published through the outbox (env EVENTS_TOPIC)")
	// The environment is read after parsing: a default taken from it would
	// be printed, password included, by -h.
	fs.StringVar(&cfg.DatabaseURL, "database-url", "", "Postgres URL (env DATABASE_URL; default "+defaultDatabaseURL+")")
	fs.StringVar(&cfg.Group, "group", envOr(getenv, "CONSUMER_GROUP", "orderworker"), "consumer group, also the dedup scope (env CONSUMER_GROUP)")
	fs.StringVar(&cfg.HTTPAddr, "http-addr", envOr(getenv, "HTTP_ADDR", "127.0.0.1:8080"), "address of GET /healthz, GET /metrics, POST /orders and POST /webhooks/orders; port 0 picks one (env HTTP_ADDR)")
	batchSize := fs.String("batch-size", envOr(getenv, "BATCH_SIZE", "100"), "records of a partition per transaction, one inbox claim for all (env BATCH_SIZE); 1: a transaction per record; with --key-parallelism above 1 the default is 1")
	keyPar := fs.String("key-parallelism", envOr(getenv, "KEY_PARALLELISM", "1"), "records of one partition with different keys processed at once, each key's records in order (env KEY_PARALLELISM); for slow handlers, instead of batches")
	groupConc := fs.String("group-concurrency", envOr(getenv, "GROUP_CONCURRENCY", "0"), "transactions in flight across all instances of the group; each instance runs its share, by the partitions it holds, taken anew at every rebalance (env GROUP_CONCURRENCY); 0: each instance runs up to its pool's size, whatever the group")
	handler := fs.String("handler", envOr(getenv, "HANDLER", "batch"), "with --batch-size above 1: batch, the set-based batch handler (each statement covers the whole batch), or record, the per-record handler under a savepoint per order (env HANDLER)")
	session := fs.String("session-timeout", envOr(getenv, "SESSION_TIMEOUT", "10s"), "group session timeout, a Go duration (env SESSION_TIMEOUT)")
	rebalance := fs.String("rebalance-timeout", envOr(getenv, "REBALANCE_TIMEOUT", "30s"), "how long a rebalance waits for the group's members to rejoin, a Go duration (env REBALANCE_TIMEOUT)")
	fs.StringVar(&cfg.InstanceID, "instance-id", getenv("INSTANCE_ID"), "static group membership id, unique per live instance (env INSTANCE_ID)")
	fs.StringVar(&cfg.Schema, "schema", envOr(getenv, "ONCELY_SCHEMA", "orderworker"), "schema of oncely's and the example's tables (env ONCELY_SCHEMA)")
	fs.BoolVar(&cfg.TraceStdout, "trace-stdout", false, "write spans to stdout, one JSON object a line; OTLP export is set with the standard OTEL_EXPORTER_OTLP_* variables")
	// No default from the environment here: flag's usage text would print
	// it. WEBHOOK_SECRET is read below unless the flag was given.
	secrets := fs.String("webhook-secret", "", "Standard Webhooks secret(s) of POST /webhooks/orders, whsec_<base64>, comma-separated while rotating (env WEBHOOK_SECRET, better: a command line is visible to every user of the machine); empty: the route answers 503")
	var kafkaSecurity kafkaflags.Flags
	kafkaSecurity.Register(fs, getenv)
	if err := parse(fs, args); err != nil {
		return cfg, err
	}
	if !kafkaflags.Given(fs, "webhook-secret") {
		*secrets = getenv("WEBHOOK_SECRET")
	}
	if !kafkaflags.Given(fs, "database-url") {
		cfg.DatabaseURL = envOr(getenv, "DATABASE_URL", defaultDatabaseURL)
	}
	if !kafkaflags.Given(fs, "amqp") { // read after parsing, as DATABASE_URL: -h must not print a password
		cfg.AMQPURL = envOr(getenv, "AMQP_URL", defaultAMQPURL)
	}
	if cfg.WebhookSecrets, err = parseSecrets(*secrets); err != nil {
		return cfg, invalidFlag("--webhook-secret (WEBHOOK_SECRET)", err)
	}
	if cfg.testHalt, err = testhalt.Parse(getenv); err != nil {
		return cfg, invalidFlag(testhalt.Env, err)
	}
	if cfg.OTLPTraces, cfg.OTLPMetrics, err = otlpExport(getenv); err != nil {
		return cfg, err
	}

	if cfg.Source, err = parseSource(*source); err != nil {
		return cfg, invalidFlag("--source (SOURCE)", err)
	}
	if cfg.Brokers, err = parseBrokers(*brokers); err != nil {
		return cfg, invalidFlag("--brokers (KAFKA_BROKERS)", err)
	}
	if cfg.KafkaOpts, err = kafkaOpts(&kafkaSecurity, cfg.Brokers); err != nil {
		return cfg, err
	}
	if cfg.KeyParallelism, err = strconv.Atoi(*keyPar); err != nil || cfg.KeyParallelism < 1 {
		return cfg, invalidFlag("--key-parallelism (KEY_PARALLELISM)", fmt.Errorf("want a whole number of at least 1, got %q", *keyPar))
	}
	if cfg.KeyParallelism > 1 && !kafkaflags.Given(fs, "batch-size") && getenv("BATCH_SIZE") == "" {
		*batchSize = "1"
	}
	if cfg.BatchSize, err = strconv.Atoi(*batchSize); err != nil || cfg.BatchSize < 1 {
		return cfg, invalidFlag("--batch-size (BATCH_SIZE)", fmt.Errorf("want a whole number of at least 1, got %q", *batchSize))
	}
	if cfg.BatchSize > 1 && cfg.KeyParallelism > 1 {
		return cfg, invalidFlag("--batch-size (BATCH_SIZE)", fmt.Errorf("%d cannot be combined with --key-parallelism %d: batches suit cheap handlers, key parallelism slow ones", cfg.BatchSize, cfg.KeyParallelism))
	}
	if cfg.GroupConcurrency, err = strconv.Atoi(*groupConc); err != nil || cfg.GroupConcurrency < 0 {
		return cfg, invalidFlag("--group-concurrency (GROUP_CONCURRENCY)", fmt.Errorf("want a whole number, 0 or more, got %q", *groupConc))
	}
	if cfg.Source != sourceKafka && cfg.GroupConcurrency > 0 {
		return cfg, invalidFlag("--group-concurrency (GROUP_CONCURRENCY)", errors.New("is Kafka's: it shares the bound by the partitions each instance holds"))
	}
	switch *handler {
	case "batch":
	case "record":
		cfg.RecordHandler = true
	default:
		return cfg, invalidFlag("--handler (HANDLER)", fmt.Errorf("want batch or record, got %q", *handler))
	}
	if cfg.AckWait, err = positiveDuration("--ack-wait (ACK_WAIT)", *ackWait); err != nil {
		return cfg, err
	}
	if cfg.Source == sourceRabbitMQ && cfg.KeyParallelism > 1 {
		return cfg, invalidFlag("--key-parallelism (KEY_PARALLELISM)", errors.New("is Kafka's: a RabbitMQ worker runs 4 transactions (batches of --batch-size) at once"))
	}
	if cfg.Source == sourceJetStream && cfg.KeyParallelism > 1 {
		return cfg, invalidFlag("--key-parallelism (KEY_PARALLELISM)", errors.New("is Kafka's: a JetStream worker runs 4 transactions (batches of --batch-size) at once"))
	}
	if cfg.SessionTimeout, err = positiveDuration("--session-timeout (SESSION_TIMEOUT)", *session); err != nil {
		return cfg, err
	}
	if cfg.RebalanceTimeout, err = positiveDuration("--rebalance-timeout (REBALANCE_TIMEOUT)", *rebalance); err != nil {
		return cfg, err
	}
	if _, err := pgxpool.ParseConfig(cfg.DatabaseURL); err != nil {
		return cfg, invalidFlag("--database-url (DATABASE_URL)", err)
	}
	if err := validateSchema(cfg.Schema); err != nil {
		return cfg, invalidFlag("--schema (ONCELY_SCHEMA)", err)
	}
	switch {
	case cfg.Topic == "":
		return cfg, invalidFlag("--topic", errors.New("must not be empty"))
	case cfg.EventsTopic == "":
		return cfg, invalidFlag("--events-topic (EVENTS_TOPIC)", errors.New("must not be empty"))
	case cfg.EventsTopic == cfg.Topic || cfg.EventsTopic == dlq.DefaultTopic(cfg.Topic):
		// The worker would consume its own events: each one would look
		// like an order and publish another event, forever.
		return cfg, invalidFlag("--events-topic (EVENTS_TOPIC)", fmt.Errorf("%q is the consumed topic or its dead-letter topic", cfg.EventsTopic))
	case cfg.Group == "":
		return cfg, invalidFlag("--group (CONSUMER_GROUP)", errors.New("must not be empty"))
	case cfg.HTTPAddr == "":
		return cfg, invalidFlag("--http-addr (HTTP_ADDR)", errors.New("must not be empty"))
	}
	return cfg, nil
}

// positiveDuration parses the value of the flag name as a Go duration
// above zero.
func positiveDuration(name, s string) (time.Duration, error) {
	d, err := time.ParseDuration(s)
	if err != nil || d <= 0 {
		return 0, invalidFlag(name, fmt.Errorf("want a positive Go duration such as 10s, got %q", s))
	}
	return d, nil
}

// errReported is a command-line error the flag package already printed.
var errReported = errors.New("invalid command line")

// parse runs fs.Parse; -h returns flag.ErrHelp.
func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return errReported
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("%s: unexpected argument %q", fs.Name(), fs.Arg(0))
	}
	return nil
}

// invalidFlag is the error for a flag's invalid value. name also names the
// environment variable the value may have come from.
func invalidFlag(name string, err error) error {
	return fmt.Errorf("invalid %s: %w", name, err)
}

// usageExit prints a command-line error and returns the exit code for it:
// 0 for -h, 2 otherwise.
func usageExit(stderr io.Writer, err error) int {
	switch {
	case errors.Is(err, flag.ErrHelp):
		return exitOK
	case !errors.Is(err, errReported):
		printf(stderr, "orderworker: %v\n", err)
	}
	return exitUsage
}

// printf writes to the terminal (stdout, stderr): a failed write there has
// nowhere to be reported, so this one place ignores it.
func printf(w io.Writer, format string, args ...any) { _, _ = fmt.Fprintf(w, format, args...) }

func envOr(getenv func(string) string, key, def string) string {
	if v := getenv(key); v != "" {
		return v
	}
	return def
}

// kafkaOpts returns the franz-go options of the TLS and SASL flags. They
// need --brokers: the in-process kfake cluster speaks neither.
func kafkaOpts(f *kafkaflags.Flags, brokers []string) ([]kgo.Opt, error) {
	opts, err := f.Opts()
	if err != nil {
		return nil, fmt.Errorf("invalid %w", err)
	}
	if len(opts) > 0 && len(brokers) == 0 {
		return nil, invalidFlag("--brokers (KAFKA_BROKERS)", errors.New("the TLS and SASL flags need brokers to connect to; the in-process kfake cluster takes neither"))
	}
	return opts, nil
}

// parseBrokers splits a comma-separated list; an empty list is allowed
// (in-process kfake), an empty entry is not.
func parseBrokers(s string) ([]string, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var out []string
	for i, b := range strings.Split(s, ",") {
		b = strings.TrimSpace(b)
		if b == "" {
			return nil, fmt.Errorf("entry %d of %q is empty", i, s)
		}
		out = append(out, b)
	}
	return out, nil
}

// parseSecrets splits a comma-separated list of Standard Webhooks secrets and
// checks that each is whsec_ followed by base64; an empty list is allowed
// (the webhook route then answers 503). Errors never quote a secret.
func parseSecrets(s string) ([]string, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var out []string
	for i, sec := range strings.Split(s, ",") {
		sec = strings.TrimSpace(sec)
		if sec == "" {
			return nil, fmt.Errorf("entry %d of the list is empty", i)
		}
		out = append(out, sec)
	}
	if _, err := webhook.NewStandardWebhooks(webhook.VerifierConfig{Secrets: out}); err != nil {
		return nil, err
	}
	return out, nil
}

// schemaRE mirrors oncely's allow-list for schema names: the name is also
// quoted with pgx.Identifier, but refusing odd names early gives a clear
// error at start-up instead of a surprising schema.
var schemaRE = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

func validateSchema(s string) error {
	if !schemaRE.MatchString(s) || strings.HasPrefix(s, "pg_") {
		return fmt.Errorf("%q: want lower-case letters, digits and underscores, not starting with a digit or pg_", s)
	}
	return nil
}

// produceCmd publishes random orders to a running worker's topic.
func produceCmd(args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("orderworker produce", flag.ContinueOnError)
	fs.SetOutput(stderr)
	source := fs.String("source", envOr(getenv, "SOURCE", sourceKafka), "broker to publish to: kafka, jetstream (NATS at --nats; the worker's streams are created if missing) or rabbitmq (RabbitMQ at --amqp; the worker's queues are declared if missing) (env SOURCE)")
	natsURL := fs.String("nats", envOr(getenv, "NATS_URL", nats.DefaultURL), "NATS server of --source jetstream (env NATS_URL)")
	amqpURL := fs.String("amqp", "", "RabbitMQ of --source rabbitmq (env AMQP_URL; default "+outbound.RedactURL(defaultAMQPURL)+")")
	brokers := fs.String("brokers", getenv("KAFKA_BROKERS"), "comma-separated seed brokers (env KAFKA_BROKERS); required with --source kafka")
	topic := fs.String("topic", "orders", "topic (or subject) to produce to")
	events := fs.String("events-topic", envOr(getenv, "EVENTS_TOPIC", "order-events"), "with --source jetstream or rabbitmq: the events subject or queue, created if missing (env EVENTS_TOPIC)")
	count := fs.Int("count", 1000, "orders to produce")
	dupRate := fs.Float64("dup-rate", 0.2, "fraction of records produced a second time with the same message-id")
	poisonRate := fs.Float64("poison-rate", 0, "poison records (not valid orders: they go to the dead-letter topic) to mix in, as a fraction of --count")
	customers := fs.Int("customers", 50, "number of distinct customers")
	keyBy := fs.String("key-by", "order", "what the records are keyed by: order (the order id: one customer's orders spread over every partition, as on most real topics) or customer")
	rate := fs.Int("rate", 0, "records per second; 0: as fast as possible")
	var kafkaSecurity kafkaflags.Flags
	kafkaSecurity.Register(fs, getenv)
	seed := fs.Uint64("seed", 0, "seed of the random customers, amounts, poison records and duplicates (ids stay random); 0: a random seed")
	retryFor := fs.Duration("retry-for", 0, "with --source jetstream or rabbitmq: how long to keep publishing a message again, under the same message id, after a publish failed (the broker restarting, the connection lost); 0: fail at once")
	history := fs.String("history", "", "a file to write the records to, one JSON object a line, before they are published: what `check --history` checks a RabbitMQ queue's worker against (a queue keeps no history)")
	if err := parse(fs, args); err != nil {
		return usageExit(stderr, err)
	}
	src, err := parseSource(*source)
	if err != nil {
		return usageExit(stderr, invalidFlag("--source (SOURCE)", err))
	}
	var bs []string
	var kopts []kgo.Opt
	if src == sourceKafka {
		if bs, err = requiredBrokers(*brokers); err != nil {
			return usageExit(stderr, invalidFlag("--brokers (KAFKA_BROKERS)", err))
		}
		if kopts, err = kafkaOpts(&kafkaSecurity, bs); err != nil {
			return usageExit(stderr, err)
		}
	}
	spec := orderSpec{Count: *count, Customers: *customers, DupRate: *dupRate, PoisonRate: *poisonRate}
	if name, err := spec.validate(); err != nil {
		return usageExit(stderr, invalidFlag(name, err))
	}
	if *rate < 0 {
		return usageExit(stderr, invalidFlag("--rate", errors.New("must not be negative")))
	}
	if *keyBy != "order" && *keyBy != "customer" {
		return usageExit(stderr, invalidFlag("--key-by", fmt.Errorf("want order or customer, got %q", *keyBy)))
	}
	if *retryFor < 0 {
		return usageExit(stderr, invalidFlag("--retry-for", errors.New("must not be negative")))
	}
	if *retryFor > 0 && src == sourceKafka {
		return usageExit(stderr, invalidFlag("--retry-for", errors.New("applies to --source jetstream and rabbitmq; a Kafka producer retries by itself")))
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	rng := newRand()
	if *seed != 0 {
		rng = rand.New(rand.NewPCG(*seed, 0))
	}
	batch := generate(spec, rng)
	if *keyBy == "customer" {
		batch.KeyByCustomer()
	}
	if *history != "" {
		if err := writeHistory(*history, *topic, batch.Deliveries); err != nil {
			printf(stderr, "orderworker: %v\n", err)
			return exitError
		}
	}
	repeated, o := 0, publishOpts{PerSecond: *rate, RetryFor: *retryFor}
	switch src {
	case sourceJetStream:
		repeated, err = publishOrders(ctx, *natsURL, *topic, *events, batch.Deliveries, o)
	case sourceRabbitMQ:
		if !kafkaflags.Given(fs, "amqp") {
			*amqpURL = envOr(getenv, "AMQP_URL", defaultAMQPURL)
		}
		repeated, err = publishRabbit(ctx, *amqpURL, *topic, *events, batch.Deliveries, o)
	default:
		err = produceOrders(ctx, bs, kopts, *topic, batch.Deliveries, *rate)
	}
	if err != nil {
		printf(stderr, "orderworker: %v\n", err)
		return exitError
	}
	printf(stdout, "produced %d records to %s: %d orders (total %d cents), %d poison records and %d duplicate deliveries",
		len(batch.Deliveries), *topic, len(batch.Orders), batch.totalCents(), len(batch.Poison), batch.Duplicates)
	if repeated > 0 {
		printf(stdout, "; %d publishes repeated after a failure", repeated)
	}
	printf(stdout, "\n")
	return exitOK
}

// produceOrders produces ds to the Kafka topic, perSecond a second.
func produceOrders(ctx context.Context, brokers []string, kopts []kgo.Opt, topic string, ds []delivery, perSecond int) error {
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(brokers...)}, kopts...)...)
	if err != nil {
		return fmt.Errorf("kafka client: %w", err)
	}
	defer cl.Close()
	return produce(ctx, cl, topic, ds, perSecond)
}

// publishOrders publishes ds to the JetStream subject, after making sure
// the worker's streams exist, paced and retried as o says (publishEach),
// and returns how many publishes were repeats after a failure.
func publishOrders(ctx context.Context, url, subject, eventsSubject string, ds []delivery, o publishOpts) (int, error) {
	nc, js, err := jetStreamConn(url, "orderworker produce")
	if err != nil {
		return 0, err
	}
	defer nc.Close()
	if err := ensureStreams(ctx, js, subject, eventsSubject); err != nil {
		return 0, err
	}
	return publishEach(ctx, ds, o, jetStreamPublish(js, subject))
}

// requiredBrokers is parseBrokers for a command that needs brokers.
func requiredBrokers(s string) ([]string, error) {
	bs, err := parseBrokers(s)
	if err == nil && len(bs) == 0 {
		err = errors.New("required (a worker started without brokers logs its in-process address)")
	}
	return bs, err
}
