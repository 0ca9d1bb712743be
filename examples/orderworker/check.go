package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/kafkaflags"
	"github.com/oncely/oncely/internal/topicread"
	"github.com/oncely/oncely/webhook/outbound"
)

// checkCmd checks a deployment's history, once its workers have caught up:
// every record on the orders topic (with --source rabbitmq: every record of
// the producer's history file) against the database, the events topic and
// the dead-letter topic. It prints the report and exits 1 if a check
// failed.
func checkCmd(args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("orderworker check", flag.ContinueOnError)
	fs.SetOutput(stderr)
	source := fs.String("source", envOr(getenv, "SOURCE", sourceKafka), "broker of the orders, the events and the dead letters: kafka, jetstream (NATS at --nats) or rabbitmq (RabbitMQ at --amqp, with --history) (env SOURCE)")
	natsURL := fs.String("nats", envOr(getenv, "NATS_URL", nats.DefaultURL), "NATS server of --source jetstream (env NATS_URL)")
	amqpURL := fs.String("amqp", "", "RabbitMQ of --source rabbitmq (env AMQP_URL; default "+outbound.RedactURL(defaultAMQPURL)+")")
	history := fs.String("history", "", "with --source rabbitmq, required: the file `produce --history` wrote, what was published (a queue keeps no history)")
	brokers := fs.String("brokers", getenv("KAFKA_BROKERS"), "comma-separated seed brokers (env KAFKA_BROKERS); required with --source kafka")
	topic := fs.String("topic", "orders", "the orders topic (or subject, or queue); its dead letters are on <topic>.dlq (dlq.<topic> on JetStream)")
	events := fs.String("events-topic", envOr(getenv, "EVENTS_TOPIC", "order-events"), "topic of the order.accepted events (env EVENTS_TOPIC)")
	dbURL := fs.String("database-url", "", "Postgres URL (env DATABASE_URL; default "+defaultDatabaseURL+")")
	group := fs.String("group", envOr(getenv, "CONSUMER_GROUP", "orderworker"), "the workers' consumer group (env CONSUMER_GROUP)")
	schema := fs.String("schema", envOr(getenv, "ONCELY_SCHEMA", "orderworker"), "the workers' schema (env ONCELY_SCHEMA)")
	wait := fs.Duration("wait", 0, "first wait, up to this long, until the group caught up with the orders (its committed offsets at the end of the topic; on JetStream nothing pending nor waiting for an ack; on RabbitMQ empty queues and an inbox row for every message id) and the outbox is empty")
	asJSON := fs.Bool("json", false, "print the report as one JSON object (snake_case keys), with the failed checks under \"violations\"")
	if err := parse(fs, args); err != nil {
		return usageExit(stderr, err)
	}
	if !kafkaflags.Given(fs, "database-url") {
		*dbURL = envOr(getenv, "DATABASE_URL", defaultDatabaseURL)
	}
	if !kafkaflags.Given(fs, "amqp") {
		*amqpURL = envOr(getenv, "AMQP_URL", defaultAMQPURL)
	}
	src, err := parseSource(*source)
	if err != nil {
		return usageExit(stderr, invalidFlag("--source (SOURCE)", err))
	}
	var bs []string
	switch {
	case src == sourceKafka:
		if bs, err = requiredBrokers(*brokers); err != nil {
			return usageExit(stderr, invalidFlag("--brokers (KAFKA_BROKERS)", err))
		}
	case src == sourceRabbitMQ && *history == "":
		return usageExit(stderr, invalidFlag("--history", errors.New("required with --source rabbitmq: the file `produce --history` wrote")))
	}
	if *history != "" && src != sourceRabbitMQ {
		return usageExit(stderr, invalidFlag("--history", fmt.Errorf("applies to --source rabbitmq; %s keeps the history itself", src)))
	}
	if err := validateSchema(*schema); err != nil {
		return usageExit(stderr, invalidFlag("--schema (ONCELY_SCHEMA)", err))
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	rep, err := func() (*report, error) {
		pool, err := pgxpool.New(ctx, *dbURL)
		if err != nil {
			return nil, err
		}
		defer pool.Close()
		var bc *brokerCheck
		switch src {
		case sourceJetStream:
			bc, err = jetStreamCheck(*natsURL, *topic, *events, *group)
		case sourceRabbitMQ:
			bc, err = rabbitCheck(*amqpURL, *history, *topic, *events, *group, pool, *schema)
		default:
			bc, err = kafkaCheck(bs, *topic, *events, *group)
		}
		if err != nil {
			return nil, err
		}
		defer bc.close()
		return runCheck(ctx, pool, bc, *topic, *events, *group, *schema, *wait)
	}()
	if err != nil {
		printf(stderr, "orderworker check: %v\n", err)
		return exitError
	}
	if *asJSON {
		_ = json.NewEncoder(stdout).Encode(struct {
			*report
			Violations []string `json:"violations"`
		}{rep, rep.violations()})
	} else {
		rep.print(stdout)
	}
	if v := rep.violations(); len(v) > 0 {
		printf(stderr, "orderworker check: FAILED: %s\n", strings.Join(v, "; "))
		return exitError
	}
	return exitOK
}

// runCheck waits up to wait for the workers to catch up, reads the history
// from bc and checks it.
func runCheck(ctx context.Context, pool *pgxpool.Pool, bc *brokerCheck, topic, events, group, schema string, wait time.Duration) (*report, error) {
	if wait > 0 {
		q := newEffectQueries(schema)
		if err := poll(ctx, wait, 100*time.Millisecond, "the group caught up with "+topic+" and no pending outbox row",
			func(ctx context.Context) (bool, error) {
				if ok, err := bc.caughtUp(ctx); !ok || err != nil {
					return false, err
				}
				n, err := queryInt(ctx, pool, q.pending)
				return n == 0, err
			}); err != nil {
			return nil, err
		}
	}
	b, err := bc.history(ctx)
	if err != nil {
		return nil, err
	}
	rep, err := checkEffects(ctx, pool, schema, group, b)
	if err != nil {
		return nil, err
	}
	if err := checkParked(ctx, pool, schema, b, rep); err != nil {
		return nil, err
	}
	if err := bc.events(ctx, b, rep); err != nil {
		return nil, err
	}
	if err := bc.deadLetters(ctx, b, rep); err != nil {
		return nil, err
	}
	return rep, nil
}

// report is what the demo and the check command print, and what the tests
// assert: every order produced has exactly one effect and one event, and
// every poison record is in the dead-letter topic, whatever Kafka delivered
// and whichever worker died. A failed check names the records it is about
// (see name).
type report struct {
	Delivered        int   `json:"delivered"`         // records produced: orders, poison records and duplicate deliveries
	DuplicatesSent   int   `json:"duplicates_sent"`   // of which second deliveries of a message id
	Crashes          int   `json:"crashes"`           // workers killed with SIGKILL
	UniqueOrders     int   `json:"unique_orders"`     // orders produced
	PoisonRecords    int   `json:"poison_records"`    // poison records produced (distinct message ids)
	Effects          int64 `json:"effects"`           // rows in orders
	InboxRows        int64 `json:"inbox_rows"`        // the group's inbox rows (one per message id processed or dead-lettered)
	DuplicateEffects int64 `json:"duplicate_effects"` // order ids with more than one row: must be 0
	MissingEffects   int64 `json:"missing_effects"`   // orders produced without a row: must be 0
	Customers        int   `json:"customers"`         // customers with a balance to check
	BalanceErrors    int   `json:"balance_errors"`    // customers whose balance is not the sum of their orders: must be 0
	Absorbed         int64 `json:"absorbed"`          // deliveries the inbox skipped, from the last worker's log (-1: unknown)
	LastExit         int   `json:"last_exit"`         // exit status of the last worker: 0 after a clean SIGTERM

	// What the orders topic held besides plain orders and poison values,
	// read back by the history check.
	Transactional     int   `json:"transactional"`      // records of committed Kafka transactions: applied like any other
	AbortedRecords    int   `json:"aborted_records"`    // records of aborted Kafka transactions
	AbortedApplied    int   `json:"aborted_applied"`    // of those, with an effect, an inbox row or a dead letter: must be 0
	UnexpectedEffects int64 `json:"unexpected_effects"` // rows in orders of no order produced (a poison or aborted record applied): must be 0
	UnstorableIDs     int   `json:"unstorable_ids"`     // poison records whose message id Postgres text cannot hold (not UTF-8, a NUL byte)
	NearLimitOrders   int   `json:"near_limit_orders"`  // orders within nearLimit bytes of the topic's max.message.bytes
	NearLimitPoison   int   `json:"near_limit_poison"`  // poison records as close to it

	// The order.accepted events, read back from Kafka (checkEvents).
	EventsTopic      string `json:"events_topic"`        // "": not checked
	EventRecords     int    `json:"event_records"`       // order.accepted records on the topic, republishes included
	EventIDs         int    `json:"event_ids"`           // distinct message ids among them: must equal UniqueOrders
	EventOrders      int    `json:"event_orders"`        // distinct order ids among them: must equal UniqueOrders
	Republished      int    `json:"republished"`         // records whose message id came before: a relay's republish, deduped downstream
	DuplicateEvents  int    `json:"duplicate_events"`    // orders announced under more than one message id: must be 0
	MissingEvents    int    `json:"missing_events"`      // orders produced without an event: must be 0
	InvalidEvents    int    `json:"invalid_events"`      // records that are not a well-formed event of a produced order: must be 0
	OutOfOrderEvents int    `json:"out_of_order_events"` // events whose seq is not their customer's previous event's plus one: must be 0
	EventsParked     int    `json:"events_parked"`       // orders whose event the relay parked: the broker refused it as too large (checkParked)
	InvalidParked    int    `json:"invalid_parked"`      // parked rows that are not that, or whose event fits the events topic: must be 0

	// The dead-letter topic, read back from Kafka (checkDeadLetters).
	DeadLetterTopic    string `json:"dead_letter_topic"`    // "": not checked
	DeadLettered       int    `json:"dead_lettered"`        // distinct message ids the group dead-lettered
	DeadLetterCopies   int    `json:"dead_letter_copies"`   // further dead-letter records of those ids (a crash between produce and inbox write)
	PoisonMissing      int    `json:"poison_missing"`       // poison records not in the dead-letter topic: must be 0
	OrdersDeadLettered int    `json:"orders_dead_lettered"` // valid orders in the dead-letter topic: must be 0
	InvalidDeadLetters int    `json:"invalid_dead_letters"` // dead-letter records that do not decode or name no produced record: must be 0
	DeadLetterStubs    int    `json:"dead_letter_stubs"`    // poison records dead-lettered as a stub: their full copy was over the topic's limit
	WrongDeadLetters   int    `json:"wrong_dead_letters"`   // dead letters of the wrong class, stubs whose copy fits, copies of another value: must be 0

	parked map[string]int      // order id -> bytes of the parked event's key and value (checkParked)
	named  map[string][]string // check -> the first records that failed it (name)
}

// The checks that name the records failing them, and how many each names.
const (
	checkEffectsCount = "effects"
	checkDuplicate    = "duplicate effects"
	checkMissing      = "missing effects"
	checkUnexpected   = "unexpected effects"
	checkBalances     = "balances"
	checkAborted      = "aborted records"
	checkEventIDs     = "event ids"
	checkDupEvents    = "duplicate events"
	checkMissingEvent = "missing events"
	checkInvalidEvent = "invalid events"
	checkEventOrder   = "event order"
	checkParkedRows   = "parked rows"
	checkPoison       = "poison missing"
	checkDLQOrders    = "orders dead-lettered"
	checkDLQInvalid   = "invalid dead letters"
	checkDLQForm      = "wrong dead letters"
	maxNamed          = 5
)

// name notes what, a record (or customer, or row) that failed check; the
// check's violation names the first maxNamed.
func (r *report) name(check, what string) {
	if r.named == nil {
		r.named = make(map[string][]string)
	}
	if len(r.named[check]) < maxNamed {
		r.named[check] = append(r.named[check], what)
	}
}

// nearLimit is how close to its topic's max.message.bytes a record is
// counted as near the limit.
const nearLimit = 1024

// sizeSlack covers a record batch's framing that recordBytes leaves out:
// a record within it of a limit may or may not fit.
const sizeSlack = 128

// ok reports whether every order counted exactly once, and, when they were
// checked, was announced exactly once and every poison record was
// dead-lettered.
func (r *report) ok() bool { return len(r.violations()) == 0 }

// eventsOK reports whether every order has exactly one event (by message
// id) on the events topic, in order per customer; true when the events were
// not checked.
func (r *report) eventsOK() bool { return len(r.eventViolations()) == 0 }

// violations lists the checks that failed, with the figures.
func (r *report) violations() []string {
	var v []string
	must := func(check, what string, got, want int64) {
		if got != want {
			v = append(v, r.violation(check, fmt.Sprintf("%s: %d, must be %d", what, got, want)))
		}
	}
	must(checkEffectsCount, "effects", r.Effects, int64(r.UniqueOrders))
	must(checkDuplicate, "duplicate effects", r.DuplicateEffects, 0)
	must(checkMissing, "missing effects", r.MissingEffects, 0)
	must(checkUnexpected, "effects of no order produced", r.UnexpectedEffects, 0)
	must(checkBalances, "customers whose balance is not the sum of their orders", int64(r.BalanceErrors), 0)
	must(checkAborted, "records of aborted transactions applied or dead-lettered", int64(r.AbortedApplied), 0)
	must("", "last worker's exit status", int64(r.LastExit), 0)
	v = append(v, r.eventViolations()...)
	if r.DeadLetterTopic != "" {
		must("", "inbox rows", r.InboxRows, int64(r.UniqueOrders+r.PoisonRecords))
		must(checkPoison, "poison records missing from "+r.DeadLetterTopic, int64(r.PoisonMissing), 0)
		must(checkDLQOrders, "valid orders in "+r.DeadLetterTopic, int64(r.OrdersDeadLettered), 0)
		must(checkDLQInvalid, "invalid dead-letter records", int64(r.InvalidDeadLetters), 0)
		must(checkDLQForm, "dead letters of the wrong class or form", int64(r.WrongDeadLetters), 0)
	}
	return v
}

// violation appends to text the records named for check.
func (r *report) violation(check, text string) string {
	if names := r.named[check]; len(names) > 0 {
		text += " (" + strings.Join(names, "; ") + ")"
	}
	return text
}

func (r *report) eventViolations() []string {
	if r.EventsTopic == "" {
		return nil
	}
	var v []string
	must := func(check, what string, got, want int) {
		if got != want {
			v = append(v, r.violation(check, fmt.Sprintf("%s on %s: %d, must be %d", what, r.EventsTopic, got, want)))
		}
	}
	published := r.UniqueOrders - r.EventsParked // the others' events are parked, checked below
	must(checkEventIDs, "distinct event message ids", r.EventIDs, published)
	must(checkEventIDs, "orders with an event", r.EventOrders, published)
	must(checkDupEvents, "orders with events under several message ids", r.DuplicateEvents, 0)
	must(checkMissingEvent, "orders without an event", r.MissingEvents, 0)
	must(checkInvalidEvent, "invalid events", r.InvalidEvents, 0)
	must(checkEventOrder, "events out of order for their customer", r.OutOfOrderEvents, 0)
	must(checkParkedRows, "parked outbox rows that are not an order.accepted event too large for it", r.InvalidParked, 0)
	return v
}

// print writes the report as a table, the demo's output.
func (r *report) print(w io.Writer) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	mustBe0 := func(n int64) string {
		if n == 0 {
			return "0\tok"
		}
		return fmt.Sprintf("%d\tFAIL: must be 0", n)
	}
	if r.PoisonRecords > 0 {
		printf(tw, "records delivered to Kafka\t%d\t(%d orders + %d poison records + %d duplicate deliveries)\n",
			r.Delivered, r.UniqueOrders, r.PoisonRecords, r.DuplicatesSent)
	} else {
		printf(tw, "records delivered to Kafka\t%d\t(%d orders + %d duplicate deliveries)\n", r.Delivered, r.UniqueOrders, r.DuplicatesSent)
	}
	if r.Crashes > 0 {
		printf(tw, "worker crashes (SIGKILL)\t%d\t\n", r.Crashes)
	}
	printf(tw, "unique orders\t%d\t\n", r.UniqueOrders)
	printf(tw, "effects (rows in orders)\t%d\t\n", r.Effects)
	printf(tw, "inbox rows\t%d\t\n", r.InboxRows)
	if r.Absorbed >= 0 {
		printf(tw, "deliveries skipped by the inbox (last worker)\t%d\t(duplicates and redeliveries after the crash)\n", r.Absorbed)
	}
	printf(tw, "duplicate effects\t%s\n", mustBe0(r.DuplicateEffects))
	printf(tw, "missing effects\t%s\n", mustBe0(r.MissingEffects))
	if r.BalanceErrors == 0 {
		printf(tw, "balances match\tyes\t(%d customers)\n", r.Customers)
	} else {
		printf(tw, "balances match\tNO\tFAIL: %d of %d customers differ\n", r.BalanceErrors, r.Customers)
	}
	if r.UnexpectedEffects != 0 {
		printf(tw, "effects of no order produced\t%s\n", mustBe0(r.UnexpectedEffects))
	}
	if r.AbortedRecords > 0 || r.Transactional > 0 {
		printf(tw, "records of Kafka transactions\t%d\t(committed; + %d aborted)\n", r.Transactional, r.AbortedRecords)
		printf(tw, "aborted records applied or dead-lettered\t%s\n", mustBe0(int64(r.AbortedApplied)))
	}
	if r.EventsTopic != "" {
		printf(tw, "order.accepted events on %s\t%d\t(%d distinct message ids + %d republished by a relay)\n",
			r.EventsTopic, r.EventRecords, r.EventIDs, r.Republished)
		if r.EventOrders == r.UniqueOrders {
			printf(tw, "orders with an event\t%d\tok\n", r.EventOrders)
		} else {
			printf(tw, "orders with an event\t%d\tFAIL: must be %d\n", r.EventOrders, r.UniqueOrders)
		}
		printf(tw, "duplicate events\t%s\n", mustBe0(int64(r.DuplicateEvents)))
		printf(tw, "missing events\t%s\n", mustBe0(int64(r.MissingEvents)))
		printf(tw, "events out of order per customer\t%s\n", mustBe0(int64(r.OutOfOrderEvents)))
		if r.InvalidEvents != 0 {
			printf(tw, "invalid events\t%s\n", mustBe0(int64(r.InvalidEvents)))
		}
		if r.EventsParked > 0 || r.InvalidParked > 0 {
			printf(tw, "events parked in the outbox (too large)\t%d\t\n", r.EventsParked)
			printf(tw, "invalid parked rows\t%s\n", mustBe0(int64(r.InvalidParked)))
		}
	}
	if r.DeadLetterTopic != "" {
		printf(tw, "poison records dead-lettered to %s\t%d\t(+ %d copies)\n", r.DeadLetterTopic, r.DeadLettered, r.DeadLetterCopies)
		printf(tw, "poison records missing from it\t%s\n", mustBe0(int64(r.PoisonMissing)))
		printf(tw, "valid orders in it\t%s\n", mustBe0(int64(r.OrdersDeadLettered)))
		if r.InvalidDeadLetters != 0 {
			printf(tw, "invalid dead-letter records\t%s\n", mustBe0(int64(r.InvalidDeadLetters)))
		}
		if r.DeadLetterStubs > 0 || r.UnstorableIDs > 0 {
			printf(tw, "of them stubs (copy too large)\t%d\t(+ %d with an id Postgres cannot store)\n", r.DeadLetterStubs, r.UnstorableIDs)
		}
		printf(tw, "dead letters of the wrong class or form\t%s\n", mustBe0(int64(r.WrongDeadLetters)))
	}
	printf(tw, "last worker exit status\t%d\t\n", r.LastExit)
	_ = tw.Flush()
}

// effectQueries are the demo's and the tests' read-only checks, qualified
// with the schema like the worker's statements.
type effectQueries struct {
	count, countDistinct, duplicates, missing, unexpected, inbox, balances, pending, parked string
	abortedEffects, abortedInbox                                                            string
}

func newEffectQueries(schema string) effectQueries {
	orders := pgx.Identifier{schema, "orders"}.Sanitize()
	inbox := pgx.Identifier{schema, "inbox"}.Sanitize()
	outbox := pgx.Identifier{schema, "outbox"}.Sanitize()
	// $1, $2, $3: the topics, partitions and offsets of aborted records.
	aborted := `unnest($1::text[], $2::int[], $3::bigint[]) AS a(topic, partition, off)`
	return effectQueries{
		count:         `SELECT count(*) FROM ` + orders,
		countDistinct: `SELECT count(DISTINCT order_id) FROM ` + orders,
		duplicates:    `SELECT order_id, count(*) FROM ` + orders + ` GROUP BY order_id HAVING count(*) > 1 ORDER BY order_id`,
		missing: `SELECT p.order_id FROM unnest($1::text[]) AS p(order_id)
			WHERE NOT EXISTS (SELECT 1 FROM ` + orders + ` o WHERE o.order_id = p.order_id) ORDER BY 1`,
		unexpected: `SELECT o.order_id, o.message_id, coalesce(o.topic, ''), coalesce(o.partition, -1), coalesce(o."offset", -1)
			FROM ` + orders + ` o WHERE NOT EXISTS (SELECT 1 FROM unnest($1::text[]) AS p(order_id) WHERE p.order_id = o.order_id)
			ORDER BY o.id`,
		abortedEffects: `SELECT o.order_id, o.topic, o.partition, o."offset" FROM ` + orders + ` o JOIN ` + aborted + `
			ON o.topic = a.topic AND o.partition = a.partition AND o."offset" = a.off ORDER BY o.id`,
		abortedInbox: `SELECT i.message_id, i.topic, i.partition, i."offset" FROM ` + inbox + ` i JOIN ` + aborted + `
			ON i.topic = a.topic AND i.partition = a.partition AND i."offset" = a.off WHERE i.consumer_group = $4`,
		inbox:    `SELECT count(*) FROM ` + inbox + ` WHERE consumer_group = $1`,
		balances: `SELECT customer_id, balance_cents FROM ` + pgx.Identifier{schema, "customer_balances"}.Sanitize(),
		// Parked rows wait for an operator, not for a relay.
		pending: `SELECT count(*) FROM ` + outbox + ` WHERE sent_at IS NULL AND parked_at IS NULL`,
		parked: `SELECT id, message_id, coalesce(key, ''), coalesce(value, ''), coalesce(error, '') FROM ` + outbox + `
			WHERE parked_at IS NOT NULL AND sent_at IS NULL ORDER BY id`,
	}
}

func queryInt(ctx context.Context, pool *pgxpool.Pool, sql string, args ...any) (int64, error) {
	var n int64
	err := pool.QueryRow(ctx, sql, args...).Scan(&n)
	return n, err
}

// checkEffects compares the database with what was produced.
func checkEffects(ctx context.Context, pool *pgxpool.Pool, schema, group string, b orderBatch) (*report, error) {
	q := newEffectQueries(schema)
	r := &report{
		Delivered: len(b.Deliveries), DuplicatesSent: b.Duplicates, UniqueOrders: len(b.Orders), Absorbed: -1,
		Transactional: b.Transactional, AbortedRecords: len(b.Aborted), UnstorableIDs: b.Unstorable,
		NearLimitOrders: b.NearLimitOrders, NearLimitPoison: b.NearLimitPoison,
	}
	ids := make([]string, len(b.Orders))
	for i, o := range b.Orders {
		ids[i] = o.OrderID
	}
	var err error
	if r.Effects, err = queryInt(ctx, pool, q.count); err != nil {
		return nil, fmt.Errorf("count effects: %w", err)
	}
	var order, msgID, topic string
	var n, offset int64
	var partition int32
	rows, _ := pool.Query(ctx, q.duplicates) // an error surfaces from ForEachRow
	if _, err := pgx.ForEachRow(rows, []any{&order, &n}, func() error {
		r.DuplicateEffects++
		r.name(checkDuplicate, fmt.Sprintf("order %s: %d rows", short(order), n))
		return nil
	}); err != nil {
		return nil, fmt.Errorf("find duplicate effects: %w", err)
	}
	rows, _ = pool.Query(ctx, q.missing, ids)
	if _, err := pgx.ForEachRow(rows, []any{&order}, func() error {
		r.MissingEffects++
		r.name(checkMissing, "order "+short(order))
		return nil
	}); err != nil {
		return nil, fmt.Errorf("find missing effects: %w", err)
	}
	rows, _ = pool.Query(ctx, q.unexpected, ids)
	if _, err := pgx.ForEachRow(rows, []any{&order, &msgID, &topic, &partition, &offset}, func() error {
		r.UnexpectedEffects++
		r.name(checkUnexpected, fmt.Sprintf("order %s from %s/%d/%d, message-id %s", short(order), topic, partition, offset, short(msgID)))
		return nil
	}); err != nil {
		return nil, fmt.Errorf("find unexpected effects: %w", err)
	}
	if err := checkAbortedEffects(ctx, pool, q, group, b, r); err != nil {
		return nil, err
	}
	if r.InboxRows, err = queryInt(ctx, pool, q.inbox, group); err != nil {
		return nil, fmt.Errorf("count inbox rows: %w", err)
	}
	actual := make(map[string]int64)
	var customer string
	var cents int64
	rows, _ = pool.Query(ctx, q.balances)
	if _, err := pgx.ForEachRow(rows, []any{&customer, &cents}, func() error {
		actual[customer] = cents
		return nil
	}); err != nil {
		return nil, fmt.Errorf("read balances: %w", err)
	}
	want := b.balances()
	r.Customers = len(want)
	for _, c := range sortedKeys(want) {
		if actual[c] != want[c] {
			r.BalanceErrors++
			r.name(checkBalances, fmt.Sprintf("customer %s: %d cents, must be %d", short(c), actual[c], want[c]))
		}
	}
	for _, c := range sortedKeys(actual) {
		if _, ok := want[c]; !ok {
			r.BalanceErrors++ // a balance for a customer nobody ordered for
			r.name(checkBalances, fmt.Sprintf("customer %s: %d cents, and no order", short(c), actual[c]))
		}
	}
	return r, nil
}

// checkAbortedEffects counts the records of aborted transactions that left
// an effect or an inbox row (a consumer read them uncommitted), by where
// they were read.
func checkAbortedEffects(ctx context.Context, pool *pgxpool.Pool, q effectQueries, group string, b orderBatch, r *report) error {
	if len(b.Aborted) == 0 {
		return nil
	}
	topics, partitions, offsets := make([]string, len(b.Aborted)), make([]int32, len(b.Aborted)), make([]int64, len(b.Aborted))
	for i, d := range b.Aborted {
		topics[i], partitions[i], offsets[i] = d.src.Topic, d.src.Partition, d.src.Offset
	}
	var id, topic string
	var partition int32
	var offset int64
	for _, c := range []struct{ what, sql string }{{"an effect of order", q.abortedEffects}, {"an inbox row for message-id", q.abortedInbox}} {
		args := []any{topics, partitions, offsets}
		if c.sql == q.abortedInbox {
			args = append(args, group)
		}
		rows, _ := pool.Query(ctx, c.sql, args...)
		if _, err := pgx.ForEachRow(rows, []any{&id, &topic, &partition, &offset}, func() error {
			r.AbortedApplied++
			r.name(checkAborted, fmt.Sprintf("aborted record %s/%d/%d has %s %s", topic, partition, offset, c.what, short(id)))
			return nil
		}); err != nil {
			return fmt.Errorf("find effects of aborted records: %w", err)
		}
	}
	return nil
}

// checkParked reads the outbox rows the relay parked. Each must be the
// order.accepted event of an order produced, refused by the broker as too
// large (MESSAGE_TOO_LARGE); its order then counts as announced, and
// checkEvents makes sure the event could not fit the events topic.
func checkParked(ctx context.Context, pool *pgxpool.Pool, schema string, b orderBatch, r *report) error {
	produced := make(map[string]Order, len(b.Orders))
	for _, o := range b.Orders {
		produced[o.OrderID] = o
	}
	r.parked = make(map[string]int)
	var id int64
	var msgID, reason string
	var key, value []byte
	rows, _ := pool.Query(ctx, newEffectQueries(schema).parked)
	if _, err := pgx.ForEachRow(rows, []any{&id, &msgID, &key, &value, &reason}, func() error {
		row := fmt.Sprintf("outbox row %d, message-id %s", id, msgID)
		var ev OrderAccepted
		dec := json.NewDecoder(bytes.NewReader(value))
		dec.DisallowUnknownFields()
		switch {
		case dec.Decode(&ev) != nil || string(key) != ev.CustomerID || ev.Order != produced[ev.OrderID]:
			r.InvalidParked++
			r.name(checkParkedRows, row+": not an order.accepted event of an order produced")
		case !strings.Contains(reason, "MESSAGE_TOO_LARGE"):
			r.InvalidParked++
			r.name(checkParkedRows, fmt.Sprintf("%s: parked for %s", row, short(reason)))
		case r.parked[ev.OrderID] > 0:
			r.InvalidParked++
			r.name(checkParkedRows, fmt.Sprintf("%s: a second event of order %s", row, short(ev.OrderID)))
		default:
			r.parked[ev.OrderID] = len(key) + len(value)
		}
		return nil
	}); err != nil {
		return fmt.Errorf("read parked outbox rows: %w", err)
	}
	r.EventsParked = len(r.parked)
	return nil
}

// checkEvents reads the events topic back from Kafka and fills in r's event
// figures. Each order must have exactly one order.accepted event, told
// apart by its message id: a relay that died after producing and before
// marking its rows sent republishes them with the same ids (a downstream
// inbox dedups those), but a second message id for one order would be a
// second event, which the inbox upstream is there to prevent. Each
// customer's events, in topic order and without the republished ones, must
// number 1, 2, 3...: the outbox keeps one key's events in commit order.
// An order whose event the relay parked (checkParked) has none on the topic,
// and its event must be too large for the topic's max.message.bytes.
func checkEvents(ctx context.Context, brokers []string, topic string, b orderBatch, r *report) error {
	recs, err := readTopic(ctx, brokers, topic)
	if err != nil {
		return fmt.Errorf("read events: %w", err)
	}
	return verifyEvents(recs, topic, b, r, func() (int, error) { return maxMessageBytes(ctx, brokers, topic) })
}

// verifyEvents checks the events recs read from topic against b (see
// checkEvents); maxBytes returns the broker's limit on a message, below
// which no event may be parked.
func verifyEvents(recs []*kgo.Record, topic string, b orderBatch, r *report, maxBytes func() (int, error)) error {
	produced := make(map[string]Order, len(b.Orders))
	for _, o := range b.Orders {
		produced[o.OrderID] = o
	}
	orderOf := make(map[string]string)       // message id -> order id
	idsOf := make(map[string]map[string]int) // order id -> message ids
	lastSeq := make(map[string]int64)        // customer -> seq of its latest event
	r.EventsTopic = topic
	for _, rec := range recs {
		var ev OrderAccepted
		id := header(rec, consumer.DefaultMessageIDHeader)
		dec := json.NewDecoder(bytes.NewReader(rec.Value))
		dec.DisallowUnknownFields()
		at := fmt.Sprintf("%s/%d/%d", rec.Topic, rec.Partition, rec.Offset)
		if header(rec, eventTypeHeader) != orderAcceptedType || id == "" || dec.Decode(&ev) != nil ||
			string(rec.Key) != ev.CustomerID || ev.Order != produced[ev.OrderID] {
			r.InvalidEvents++
			r.name(checkInvalidEvent, at+": not an order.accepted event of an order produced")
			continue
		}
		r.EventRecords++
		if prev, seen := orderOf[id]; seen {
			r.Republished++
			if prev != ev.OrderID {
				r.InvalidEvents++ // one message id, two orders
				r.name(checkInvalidEvent, fmt.Sprintf("%s: message-id %s of orders %s and %s", at, short(id), short(prev), short(ev.OrderID)))
			}
			continue
		}
		if ev.Seq != lastSeq[ev.CustomerID]+1 {
			r.OutOfOrderEvents++
			r.name(checkEventOrder, fmt.Sprintf("%s: customer %s seq %d after %d", at, short(ev.CustomerID), ev.Seq, lastSeq[ev.CustomerID]))
		}
		lastSeq[ev.CustomerID] = ev.Seq
		orderOf[id] = ev.OrderID
		if idsOf[ev.OrderID] == nil {
			idsOf[ev.OrderID] = make(map[string]int)
		}
		idsOf[ev.OrderID][id]++
	}
	r.EventIDs, r.EventOrders = len(orderOf), len(idsOf)
	for _, o := range b.Orders {
		ids, parked := idsOf[o.OrderID], r.parked[o.OrderID] > 0
		switch {
		case len(ids) > 1:
			r.DuplicateEvents++
			r.name(checkDupEvents, fmt.Sprintf("order %s: %d message ids", short(o.OrderID), len(ids)))
		case len(ids) == 1 && parked:
			r.DuplicateEvents++
			r.name(checkDupEvents, fmt.Sprintf("order %s: published and parked", short(o.OrderID)))
		case len(ids) == 0 && !parked:
			r.MissingEvents++
			r.name(checkMissingEvent, "order "+short(o.OrderID))
		}
	}
	if len(r.parked) == 0 {
		return nil
	}
	limit, err := maxBytes()
	if err != nil {
		return err
	}
	for _, id := range sortedKeys(r.parked) {
		if n := r.parked[id]; n < limit-sizeSlack {
			r.InvalidParked++
			r.name(checkParkedRows, fmt.Sprintf("the event of order %s: parked, though its %d bytes fit the limit of %d", short(id), n, limit))
		}
	}
	return nil
}

// checkDeadLetters reads the dead-letter topic back from Kafka and fills in
// r's dead-letter figures: each poison record of b must be there, under its
// message id, with its class (undecodable or permanent), and no valid order
// nor record of an aborted transaction may be. A dead letter is a copy of
// the record's value, or a stub without it where the copy is over the
// topic's max.message.bytes, and only there. A record dead-lettered twice
// (its worker died between the dead-letter produce and the inbox write, and
// the record was delivered again) counts once, its further records as
// copies.
func checkDeadLetters(ctx context.Context, brokers []string, topic, group string, b orderBatch, r *report) error {
	entries, err := dlq.List(ctx, []kgo.Opt{kgo.SeedBrokers(brokers...)}, topic, dlq.Filter{})
	if err != nil {
		return fmt.Errorf("read dead letters: %w", err)
	}
	limit, err := maxMessageBytes(ctx, brokers, topic)
	if err != nil {
		return err
	}
	verifyDeadLetters(entries, topic, group, b, r, limit)
	return nil
}

// verifyDeadLetters fills in r's dead-letter figures from the dead letters
// entries read from topic (see checkDeadLetters); limit is the broker's
// limit on a message, below which no dead letter may be a stub.
func verifyDeadLetters(entries []dlq.Entry, topic, group string, b orderBatch, r *report, limit int) {
	poison, orders := make(map[string]delivery), make(map[string]delivery) // by message id
	for _, d := range b.Deliveries {
		switch {
		case d.Poison == nil:
			orders[d.MessageID] = d
		case !d.Duplicate:
			poison[d.MessageID] = d
		}
	}
	aborted := make(map[string]delivery) // by topic/partition/offset
	for _, d := range b.Aborted {
		aborted[d.At] = d
	}
	r.DeadLetterTopic, r.PoisonRecords = topic, len(b.Poison)
	seen := make(map[string]bool)
	for _, e := range entries {
		if e.Err != nil {
			r.InvalidDeadLetters++
			r.name(checkDLQInvalid, fmt.Sprintf("%s: %v", e.Ref(), e.Err))
			continue
		}
		if e.Info.Group != group {
			continue // another consumer group's
		}
		if d, ok := aborted[fmt.Sprintf("%s/%d/%d", e.Info.Topic, e.Info.Partition, e.Info.Offset)]; ok {
			r.AbortedApplied++
			r.name(checkAborted, fmt.Sprintf("aborted record %s dead-lettered at %s", d.name(), e.Ref()))
			continue
		}
		id := e.Info.MessageID
		r.DeadLetterCopies += e.Copies - 1
		if seen[id] {
			r.DeadLetterCopies++ // from another delivery of the record
			continue
		}
		seen[id] = true
		if d, ok := orders[id]; ok {
			r.OrdersDeadLettered++
			r.name(checkDLQOrders, fmt.Sprintf("%s at %s", d.name(), e.Ref()))
			continue
		}
		d, ok := poison[id]
		if !ok {
			r.InvalidDeadLetters++ // names no record that was produced
			r.name(checkDLQInvalid, fmt.Sprintf("%s: message-id %s of no record produced", e.Ref(), short(id)))
			continue
		}
		r.checkDeadLetterForm(e, d, limit)
	}
	r.DeadLettered = len(seen)
	for _, id := range b.Poison {
		if !seen[id] {
			r.PoisonMissing++
			r.name(checkPoison, poison[id].name())
		}
	}
}

// checkDeadLetterForm checks e, the dead letter of the poison record d, and
// counts it if it is a stub.
func (r *report) checkDeadLetterForm(e dlq.Entry, d delivery, limit int) {
	stub := header(e.Record, dlq.HeaderStub) != ""
	if stub {
		r.DeadLetterStubs++
	}
	var wrong string
	switch {
	case d.Class != "" && e.Info.Class != d.Class:
		wrong = fmt.Sprintf("class %s, must be %s", e.Info.Class, d.Class)
	case d.src == nil: // a generated batch: nothing read back to compare with
	case stub && fullCopyBytes(e.Record, d.src) < limit-sizeSlack:
		wrong = fmt.Sprintf("a stub, though its copy of %d bytes fits the limit of %d", fullCopyBytes(e.Record, d.src), limit)
	case !stub && !bytes.Equal(e.Record.Value, d.src.Value):
		wrong = fmt.Sprintf("a value of %d bytes, not the record's %d", len(e.Record.Value), len(d.src.Value))
	}
	if wrong != "" {
		r.WrongDeadLetters++
		r.name(checkDLQForm, fmt.Sprintf("%s at %s: %s", d.name(), e.Ref(), wrong))
	}
}

// fullCopyBytes is at least the size of the full dead letter that stub
// stands for: the source record's key, value and headers, oncely's
// dead-letter headers, and a record batch's header.
func fullCopyBytes(stub, src *kgo.Record) int {
	n := 61 + recordBytes(src)
	for _, h := range stub.Headers {
		if strings.HasPrefix(h.Key, dlq.Prefix) && h.Key != dlq.HeaderStub {
			n += len(h.Key) + len(h.Value)
		}
	}
	return n
}

// recordBytes is rec's key, value and header bytes.
func recordBytes(rec *kgo.Record) int {
	n := len(rec.Key) + len(rec.Value)
	for _, h := range rec.Headers {
		n += len(h.Key) + len(h.Value)
	}
	return n
}

// maxMessageBytes returns topic's max.message.bytes: the largest record
// batch its brokers accept.
func maxMessageBytes(ctx context.Context, brokers []string, topic string) (int, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
	if err != nil {
		return 0, err
	}
	defer cl.Close()
	configs, err := kadm.NewClient(cl).DescribeTopicConfigs(ctx, topic)
	if err != nil {
		return 0, fmt.Errorf("describe %s: %w", topic, err)
	}
	rc, err := configs.On(topic, nil)
	if err == nil {
		err = rc.Err
	}
	if err != nil {
		return 0, fmt.Errorf("describe %s: %w", topic, err)
	}
	for _, c := range rc.Configs {
		if c.Key == "max.message.bytes" {
			n, err := strconv.Atoi(c.MaybeValue())
			if err != nil || n <= 0 {
				return 0, fmt.Errorf("%s: max.message.bytes %q is not a positive number", topic, c.MaybeValue())
			}
			return n, nil
		}
	}
	return 0, fmt.Errorf("%s: the brokers did not say its max.message.bytes", topic)
}

// readHistory reads the orders topic back from Kafka: what the producers
// sent, as a consumer that reads committed sees it, and apart from it the
// records of aborted transactions (read uncommitted, and not committed),
// which no consumer may see. Each record is sorted out as the consumer and
// the worker's handler would (classify); a message id seen before is a
// duplicate delivery.
func readHistory(ctx context.Context, brokers []string, topic string) (orderBatch, error) {
	opts := []kgo.Opt{kgo.SeedBrokers(brokers...)}
	recs, err := topicread.All(ctx, append(opts, kgo.FetchIsolationLevel(kgo.ReadCommitted())), topic)
	if err != nil {
		return orderBatch{}, fmt.Errorf("read orders: %w", err)
	}
	all, err := topicread.All(ctx, opts, topic)
	if err != nil {
		return orderBatch{}, fmt.Errorf("read orders uncommitted: %w", err)
	}
	limit, err := maxMessageBytes(ctx, brokers, topic)
	if err != nil {
		return orderBatch{}, err
	}
	b := historyOf(recs, limit)
	committed := make(map[string]bool, len(b.Deliveries))
	for _, d := range b.Deliveries {
		committed[d.At] = true
	}
	for _, rec := range all {
		if d := classify(rec); !committed[d.At] {
			b.Aborted = append(b.Aborted, d)
		}
	}
	return b, nil
}

// historyOf sorts recs, the records of the orders topic in the order they
// were stored, out as the consumer and the worker's handler would
// (classify); a message id seen before is a duplicate delivery. limit is
// the broker's limit on a record, to count the records near it.
func historyOf(recs []*kgo.Record, limit int) orderBatch {
	var b orderBatch
	seen := make(map[string]bool)
	for _, rec := range recs {
		d := classify(rec)
		d.Duplicate = seen[d.MessageID]
		seen[d.MessageID] = true
		near := recordBytes(rec) >= limit-nearLimit
		if rec.Attrs.IsTransactional() {
			b.Transactional++
		}
		switch {
		case d.Duplicate:
			b.Duplicates++
		case d.Poison != nil:
			b.Poison = append(b.Poison, d.MessageID)
			if d.unstorable() {
				b.Unstorable++
			}
			if near {
				b.NearLimitPoison++
			}
		default:
			b.Orders = append(b.Orders, d.Order)
			if near {
				b.NearLimitOrders++
			}
		}
		b.Deliveries = append(b.Deliveries, d)
	}
	return b
}

// classify sorts rec out as the consumer and the worker's handler do: its
// dedup id is its message-id header (in any casing), or topic/partition/
// offset without one; an id that Postgres text cannot hold makes it poison
// of class undecodable; so does a value that does not decode as an order,
// and one that fails Order.validate makes it poison of class permanent.
func classify(rec *kgo.Record) delivery {
	d := delivery{At: fmt.Sprintf("%s/%d/%d", rec.Topic, rec.Partition, rec.Offset), src: rec}
	for _, h := range rec.Headers {
		if len(h.Value) > 0 && strings.EqualFold(h.Key, consumer.DefaultMessageIDHeader) {
			d.rawID = string(h.Value)
			break
		}
	}
	d.MessageID = cmp.Or(d.rawID, d.At)
	var err error
	d.Order, d.Class, err = parseOrder(rec.Value)
	if id := d.MessageID; len(id) > consumer.MaxMessageIDLen || !utf8.ValidString(id) || strings.IndexByte(id, 0) >= 0 {
		d.MessageID, d.Class, err = d.At, dlq.ClassUndecodable, errors.New("unstorable message id")
	}
	if err != nil {
		d.Poison = append([]byte{}, rec.Value...) // not nil, even for an empty value
	}
	return d
}

// unstorable reports whether d's message-id header is one Postgres text
// cannot hold, so that its dedup id is its place in the topic.
func (d delivery) unstorable() bool { return d.rawID != "" && d.rawID != d.MessageID }

// name names d in a violation: where it was read, its message id and its
// order id, if any.
func (d delivery) name() string {
	var parts []string
	if d.At != "" {
		parts = append(parts, d.At)
	}
	id := d.MessageID
	if d.unstorable() {
		id = d.rawID
	}
	parts = append(parts, "message-id "+short(id))
	if d.Order.OrderID != "" {
		parts = append(parts, "order "+short(d.Order.OrderID))
	}
	return strings.Join(parts, " ")
}

// short quotes s for a violation, escaped and cut to 60 bytes.
func short(s string) string {
	if len(s) > 60 {
		return strconv.QuoteToASCII(s[:48]) + fmt.Sprintf("...(%d bytes)", len(s))
	}
	return strconv.QuoteToASCII(s)
}

func sortedKeys[V any](m map[string]V) []string { return slices.Sorted(maps.Keys(m)) }

// parseOrder tells an order from a poison record as the worker does: with
// the handler's decoding (consumer.DecodeJSON) and Order.validate, and
// returns the class a poison record is dead-lettered with.
func parseOrder(value []byte) (Order, dlq.Class, error) {
	o, err := consumer.DecodeJSON[Order](value)
	if err != nil {
		return o, dlq.ClassUndecodable, err
	}
	if err := o.validate(); err != nil {
		return o, dlq.ClassPermanent, err
	}
	return o, "", nil
}

func header(rec *kgo.Record, key string) string {
	for _, h := range rec.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// readTopic returns every record of topic from the start of each partition
// to its end at the time of the call.
func readTopic(ctx context.Context, brokers []string, topic string) ([]*kgo.Record, error) {
	return topicread.All(ctx, []kgo.Opt{kgo.SeedBrokers(brokers...)}, topic)
}

// offsetsCaughtUp reports whether the group's committed offsets reached the
// end of every partition of topic: nothing is left to redeliver.
func offsetsCaughtUp(ctx context.Context, adm *kadm.Client, group, topic string) (bool, error) {
	ends, err := adm.ListEndOffsets(ctx, topic)
	if err == nil {
		err = ends.Error()
	}
	if err != nil {
		return false, fmt.Errorf("list end offsets: %w", err)
	}
	committed, err := adm.FetchOffsetsForTopics(ctx, group, topic)
	if err == nil {
		err = committed.Error()
	}
	if err != nil {
		return false, fmt.Errorf("fetch committed offsets: %w", err)
	}
	caughtUp := true
	ends.Each(func(end kadm.ListedOffset) {
		c, ok := committed.Lookup(topic, end.Partition)
		if end.Offset > 0 && (!ok || c.At < end.Offset) {
			caughtUp = false
		}
	})
	return caughtUp, nil
}

// poll calls cond every interval until it returns true, and fails with what
// on timeout. An error from cond is retried (the tables may not exist yet)
// unless it is marked with giveUp. Tests and the demo synchronize with poll,
// never with sleeps.
func poll(ctx context.Context, timeout, interval time.Duration, what string, cond func(context.Context) (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	t := time.NewTicker(interval)
	defer t.Stop()
	var lastErr error
	for {
		done, err := cond(ctx)
		switch {
		case err == nil && done:
			return nil
		case errors.As(err, new(giveUpError)):
			return fmt.Errorf("waiting for %s: %w", what, err)
		case err != nil:
			lastErr = err
		}
		select {
		case <-ctx.Done():
			if lastErr != nil {
				return fmt.Errorf("waiting for %s: %w (last error: %w)", what, ctx.Err(), lastErr)
			}
			return fmt.Errorf("waiting for %s: %w", what, ctx.Err())
		case <-t.C:
		}
	}
}

type giveUpError struct{ error }

func (e giveUpError) Unwrap() error { return e.error }

// giveUp marks an error that poll must not wait out, such as a worker that
// exited.
func giveUp(err error) error { return giveUpError{err} }
