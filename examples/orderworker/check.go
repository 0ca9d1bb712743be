package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/kafkaflags"
	"github.com/oncely/oncely/internal/topicread"
)

// checkCmd checks a deployment's history, once its workers have caught up:
// every record on the orders topic against the database, the events topic
// and the dead-letter topic. It prints the report and exits 1 if a check
// failed.
func checkCmd(args []string, getenv func(string) string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("orderworker check", flag.ContinueOnError)
	fs.SetOutput(stderr)
	brokers := fs.String("brokers", getenv("KAFKA_BROKERS"), "comma-separated seed brokers (env KAFKA_BROKERS); required")
	topic := fs.String("topic", "orders", "the orders topic; its dead letters are on <topic>.dlq")
	events := fs.String("events-topic", envOr(getenv, "EVENTS_TOPIC", "order-events"), "topic of the order.accepted events (env EVENTS_TOPIC)")
	dbURL := fs.String("database-url", "", "Postgres URL (env DATABASE_URL; default "+defaultDatabaseURL+")")
	group := fs.String("group", envOr(getenv, "CONSUMER_GROUP", "orderworker"), "the workers' consumer group (env CONSUMER_GROUP)")
	schema := fs.String("schema", envOr(getenv, "ONCELY_SCHEMA", "orderworker"), "the workers' schema (env ONCELY_SCHEMA)")
	wait := fs.Duration("wait", 0, "first wait, up to this long, until the group's committed offsets reached the end of the topic and the outbox is empty")
	asJSON := fs.Bool("json", false, "print the report as one JSON object (snake_case keys), with the failed checks under \"violations\"")
	if err := parse(fs, args); err != nil {
		return usageExit(stderr, err)
	}
	if !kafkaflags.Given(fs, "database-url") {
		*dbURL = envOr(getenv, "DATABASE_URL", defaultDatabaseURL)
	}
	bs, err := requiredBrokers(*brokers)
	if err != nil {
		return usageExit(stderr, invalidFlag("--brokers (KAFKA_BROKERS)", err))
	}
	if err := validateSchema(*schema); err != nil {
		return usageExit(stderr, invalidFlag("--schema (ONCELY_SCHEMA)", err))
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	rep, err := runCheck(ctx, *dbURL, bs, *topic, *events, *group, *schema, *wait)
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
// from the orders topic and checks it.
func runCheck(ctx context.Context, dbURL string, brokers []string, topic, events, group, schema string, wait time.Duration) (*report, error) {
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	if wait > 0 {
		cl, err := kgo.NewClient(kgo.SeedBrokers(brokers...))
		if err != nil {
			return nil, err
		}
		defer cl.Close()
		adm, q := kadm.NewClient(cl), newEffectQueries(schema)
		if err := poll(ctx, wait, 100*time.Millisecond, "the group's offsets at the end of "+topic+" and an empty outbox",
			func(ctx context.Context) (bool, error) {
				if ok, err := offsetsCaughtUp(ctx, adm, group, topic); !ok || err != nil {
					return false, err
				}
				n, err := queryInt(ctx, pool, q.pending)
				return n == 0, err
			}); err != nil {
			return nil, err
		}
	}
	b, err := readHistory(ctx, brokers, topic)
	if err != nil {
		return nil, err
	}
	rep, err := checkEffects(ctx, pool, schema, group, b)
	if err != nil {
		return nil, err
	}
	if err := checkEvents(ctx, brokers, events, b, rep); err != nil {
		return nil, err
	}
	if err := checkDeadLetters(ctx, brokers, dlq.DefaultTopic(topic), group, b, rep); err != nil {
		return nil, err
	}
	return rep, nil
}

// report is what the demo and the check command print, and what the tests
// assert: every order produced has exactly one effect and one event, and
// every poison record is in the dead-letter topic, whatever Kafka delivered
// and whichever worker died.
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

	// The dead-letter topic, read back from Kafka (checkDeadLetters).
	DeadLetterTopic    string `json:"dead_letter_topic"`    // "": not checked
	DeadLettered       int    `json:"dead_lettered"`        // distinct message ids the group dead-lettered
	DeadLetterCopies   int    `json:"dead_letter_copies"`   // further dead-letter records of those ids (a crash between produce and inbox write)
	PoisonMissing      int    `json:"poison_missing"`       // poison records not in the dead-letter topic: must be 0
	OrdersDeadLettered int    `json:"orders_dead_lettered"` // valid orders in the dead-letter topic: must be 0
	InvalidDeadLetters int    `json:"invalid_dead_letters"` // dead-letter records that do not decode or name no produced record: must be 0
}

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
	must := func(what string, got, want int64) {
		if got != want {
			v = append(v, fmt.Sprintf("%s: %d, must be %d", what, got, want))
		}
	}
	must("effects", r.Effects, int64(r.UniqueOrders))
	must("duplicate effects", r.DuplicateEffects, 0)
	must("missing effects", r.MissingEffects, 0)
	must("customers whose balance is not the sum of their orders", int64(r.BalanceErrors), 0)
	must("last worker's exit status", int64(r.LastExit), 0)
	v = append(v, r.eventViolations()...)
	if r.DeadLetterTopic != "" {
		must("inbox rows", r.InboxRows, int64(r.UniqueOrders+r.PoisonRecords))
		must("poison records missing from "+r.DeadLetterTopic, int64(r.PoisonMissing), 0)
		must("valid orders in "+r.DeadLetterTopic, int64(r.OrdersDeadLettered), 0)
		must("invalid dead-letter records", int64(r.InvalidDeadLetters), 0)
	}
	return v
}

func (r *report) eventViolations() []string {
	if r.EventsTopic == "" {
		return nil
	}
	var v []string
	must := func(what string, got, want int) {
		if got != want {
			v = append(v, fmt.Sprintf("%s on %s: %d, must be %d", what, r.EventsTopic, got, want))
		}
	}
	must("distinct event message ids", r.EventIDs, r.UniqueOrders)
	must("orders with an event", r.EventOrders, r.UniqueOrders)
	must("orders with events under several message ids", r.DuplicateEvents, 0)
	must("orders without an event", r.MissingEvents, 0)
	must("invalid events", r.InvalidEvents, 0)
	must("events out of order for their customer", r.OutOfOrderEvents, 0)
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
	}
	if r.DeadLetterTopic != "" {
		printf(tw, "poison records dead-lettered to %s\t%d\t(+ %d copies)\n", r.DeadLetterTopic, r.DeadLettered, r.DeadLetterCopies)
		printf(tw, "poison records missing from it\t%s\n", mustBe0(int64(r.PoisonMissing)))
		printf(tw, "valid orders in it\t%s\n", mustBe0(int64(r.OrdersDeadLettered)))
		if r.InvalidDeadLetters != 0 {
			printf(tw, "invalid dead-letter records\t%s\n", mustBe0(int64(r.InvalidDeadLetters)))
		}
	}
	printf(tw, "last worker exit status\t%d\t\n", r.LastExit)
	_ = tw.Flush()
}

// effectQueries are the demo's and the tests' read-only checks, qualified
// with the schema like the worker's statements.
type effectQueries struct {
	count, countDistinct, duplicates, missing, inbox, balances, pending string
}

func newEffectQueries(schema string) effectQueries {
	orders := pgx.Identifier{schema, "orders"}.Sanitize()
	return effectQueries{
		count:         `SELECT count(*) FROM ` + orders,
		countDistinct: `SELECT count(DISTINCT order_id) FROM ` + orders,
		duplicates:    `SELECT count(*) FROM (SELECT order_id FROM ` + orders + ` GROUP BY order_id HAVING count(*) > 1) d`,
		missing: `SELECT count(*) FROM unnest($1::text[]) AS p(order_id)
			WHERE NOT EXISTS (SELECT 1 FROM ` + orders + ` o WHERE o.order_id = p.order_id)`,
		inbox:    `SELECT count(*) FROM ` + pgx.Identifier{schema, "inbox"}.Sanitize() + ` WHERE consumer_group = $1`,
		balances: `SELECT customer_id, balance_cents FROM ` + pgx.Identifier{schema, "customer_balances"}.Sanitize(),
		pending:  `SELECT count(*) FROM ` + pgx.Identifier{schema, "outbox"}.Sanitize() + ` WHERE sent_at IS NULL`,
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
	}
	ids := make([]string, len(b.Orders))
	for i, o := range b.Orders {
		ids[i] = o.OrderID
	}
	var err error
	if r.Effects, err = queryInt(ctx, pool, q.count); err != nil {
		return nil, fmt.Errorf("count effects: %w", err)
	}
	if r.DuplicateEffects, err = queryInt(ctx, pool, q.duplicates); err != nil {
		return nil, fmt.Errorf("count duplicate effects: %w", err)
	}
	if r.MissingEffects, err = queryInt(ctx, pool, q.missing, ids); err != nil {
		return nil, fmt.Errorf("count missing effects: %w", err)
	}
	if r.InboxRows, err = queryInt(ctx, pool, q.inbox, group); err != nil {
		return nil, fmt.Errorf("count inbox rows: %w", err)
	}
	actual := make(map[string]int64)
	var customer string
	var cents int64
	rows, _ := pool.Query(ctx, q.balances) // an error surfaces from ForEachRow
	if _, err := pgx.ForEachRow(rows, []any{&customer, &cents}, func() error {
		actual[customer] = cents
		return nil
	}); err != nil {
		return nil, fmt.Errorf("read balances: %w", err)
	}
	want := b.balances()
	r.Customers = len(want)
	for c, cents := range want {
		if actual[c] != cents {
			r.BalanceErrors++
		}
	}
	for c := range actual {
		if _, ok := want[c]; !ok {
			r.BalanceErrors++ // a balance for a customer nobody ordered for
		}
	}
	return r, nil
}

// checkEvents reads the events topic back from Kafka and fills in r's event
// figures. Each order must have exactly one order.accepted event, told
// apart by its message id: a relay that died after producing and before
// marking its rows sent republishes them with the same ids (a downstream
// inbox dedups those), but a second message id for one order would be a
// second event, which the inbox upstream is there to prevent. Each
// customer's events, in topic order and without the republished ones, must
// number 1, 2, 3...: the outbox keeps one key's events in commit order.
func checkEvents(ctx context.Context, brokers []string, topic string, b orderBatch, r *report) error {
	recs, err := readTopic(ctx, brokers, topic)
	if err != nil {
		return fmt.Errorf("read events: %w", err)
	}
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
		if header(rec, eventTypeHeader) != orderAcceptedType || id == "" || dec.Decode(&ev) != nil ||
			string(rec.Key) != ev.CustomerID || ev.Order != produced[ev.OrderID] {
			r.InvalidEvents++
			continue
		}
		r.EventRecords++
		if prev, seen := orderOf[id]; seen {
			r.Republished++
			if prev != ev.OrderID {
				r.InvalidEvents++ // one message id, two orders
			}
			continue
		}
		if ev.Seq != lastSeq[ev.CustomerID]+1 {
			r.OutOfOrderEvents++
		}
		lastSeq[ev.CustomerID] = ev.Seq
		orderOf[id] = ev.OrderID
		if idsOf[ev.OrderID] == nil {
			idsOf[ev.OrderID] = make(map[string]int)
		}
		idsOf[ev.OrderID][id]++
	}
	r.EventIDs, r.EventOrders = len(orderOf), len(idsOf)
	for _, ids := range idsOf {
		if len(ids) > 1 {
			r.DuplicateEvents++
		}
	}
	for id := range produced {
		if idsOf[id] == nil {
			r.MissingEvents++
		}
	}
	return nil
}

// checkDeadLetters reads the dead-letter topic back from Kafka and fills in
// r's dead-letter figures: each poison record of b must be there, under its
// message id, and no valid order may be. A record dead-lettered twice (its
// worker died between the dead-letter produce and the inbox write, and the
// record was delivered again) counts once, its further records as copies.
func checkDeadLetters(ctx context.Context, brokers []string, topic, group string, b orderBatch, r *report) error {
	entries, err := dlq.List(ctx, []kgo.Opt{kgo.SeedBrokers(brokers...)}, topic, dlq.Filter{})
	if err != nil {
		return fmt.Errorf("read dead letters: %w", err)
	}
	poison, orders := make(map[string]bool), make(map[string]bool) // message ids
	for _, d := range b.Deliveries {
		if d.Poison != nil {
			poison[d.MessageID] = true
		} else {
			orders[d.MessageID] = true
		}
	}
	r.DeadLetterTopic, r.PoisonRecords = topic, len(b.Poison)
	seen := make(map[string]bool)
	for _, e := range entries {
		if e.Err != nil {
			r.InvalidDeadLetters++
			continue
		}
		if e.Info.Group != group {
			continue // another consumer group's
		}
		id := e.Info.MessageID
		r.DeadLetterCopies += e.Copies - 1
		if seen[id] {
			r.DeadLetterCopies++ // from another delivery of the record
			continue
		}
		seen[id] = true
		switch {
		case orders[id]:
			r.OrdersDeadLettered++
		case !poison[id]:
			r.InvalidDeadLetters++ // names no record that was produced
		}
	}
	r.DeadLettered = len(seen)
	for _, id := range b.Poison {
		if !seen[id] {
			r.PoisonMissing++
		}
	}
	return nil
}

// readHistory reads the orders topic back from Kafka: what the producers
// sent. A record whose value the worker's handler accepts as an order is an
// order, any other a poison record; a message id seen before is a duplicate
// delivery.
func readHistory(ctx context.Context, brokers []string, topic string) (orderBatch, error) {
	recs, err := readTopic(ctx, brokers, topic)
	if err != nil {
		return orderBatch{}, fmt.Errorf("read orders: %w", err)
	}
	var b orderBatch
	seen := make(map[string]bool)
	for _, rec := range recs {
		d := delivery{MessageID: header(rec, consumer.DefaultMessageIDHeader)}
		if d.MessageID == "" { // the consumer's fallback id
			d.MessageID = fmt.Sprintf("%s/%d/%d", rec.Topic, rec.Partition, rec.Offset)
		}
		var err error
		if d.Order, err = parseOrder(rec.Value); err != nil {
			d.Poison = append([]byte{}, rec.Value...) // not nil, even for an empty value
		}
		d.Duplicate = seen[d.MessageID]
		seen[d.MessageID] = true
		switch {
		case d.Duplicate:
			b.Duplicates++
		case d.Poison != nil:
			b.Poison = append(b.Poison, d.MessageID)
		default:
			b.Orders = append(b.Orders, d.Order)
		}
		b.Deliveries = append(b.Deliveries, d)
	}
	return b, nil
}

// parseOrder tells an order from a poison record as the worker does: with
// the handler's decoding (consumer.JSON) and Order.validate.
func parseOrder(value []byte) (Order, error) {
	var o Order
	decode := consumer.JSON(func(_ context.Context, _ pgx.Tx, _ *consumer.Message, v Order) error {
		o = v
		return v.validate()
	})
	err := decode(context.Background(), nil, &consumer.Message{Value: value})
	return o, err
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
