package main

import (
	"bytes"
	"context"
	cryptorand "crypto/rand"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/jsoncheck"
	"github.com/oncely/oncely/internal/testenv"
)

// checkOutput is what the tests read of `orderworker check --json`.
type checkOutput struct {
	Delivered       int      `json:"delivered"`
	DuplicatesSent  int      `json:"duplicates_sent"`
	UniqueOrders    int      `json:"unique_orders"`
	PoisonRecords   int      `json:"poison_records"`
	Effects         int64    `json:"effects"`
	EventIDs        int      `json:"event_ids"`
	DeadLettered    int      `json:"dead_lettered"`
	Transactional   int      `json:"transactional"`
	AbortedRecords  int      `json:"aborted_records"`
	UnstorableIDs   int      `json:"unstorable_ids"`
	NearLimitOrders int      `json:"near_limit_orders"`
	NearLimitPoison int      `json:"near_limit_poison"`
	EventsParked    int      `json:"events_parked"`
	DeadLetterStubs int      `json:"dead_letter_stubs"`
	Violations      []string `json:"violations"`
}

// runCheckCmd runs `orderworker check` in-process against e and returns its
// exit status, its JSON report (when it printed one) and its stderr.
func (e *env) runCheckCmd(extra ...string) (int, checkOutput, string) {
	e.t.Helper()
	args := append([]string{"check", "--json", "--brokers", strings.Join(e.kafka.Brokers, ","),
		"--topic", e.topic, "--events-topic", e.events, "--group", e.group, "--schema", e.db.Schema}, extra...)
	getenv := func(k string) string {
		if k == "DATABASE_URL" {
			return e.db.URL
		}
		return ""
	}
	var stdout, stderr bytes.Buffer
	code := run(args, getenv, &stdout, &stderr)
	var out checkOutput
	if stdout.Len() > 0 {
		jsoncheck.CheckJSONLines(e.t, "check --json", stdout.String()) // the casing of every oncely --json
		if err := json.Unmarshal(stdout.Bytes(), &out); err != nil {
			e.t.Fatalf("check --json printed %q: %v", stdout.String(), err)
		}
	}
	return code, out, stderr.String()
}

// TestCheckCommand runs a worker over orders with duplicate deliveries and
// poison records mixed in, then `orderworker check`: it must pass with the
// figures of what was produced, read back from the orders topic, and then
// fail once an order has a second effect.
func TestCheckCommand(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	batch := generate(orderSpec{Count: 200, Customers: 5, DupRate: 0.2, PoisonRate: 0.1}, newRand())
	if len(batch.Poison) != 20 || batch.Duplicates != 44 || len(batch.Deliveries) != 264 {
		t.Fatalf("generate: %d poison records, %d duplicates, %d deliveries; want 20, 44, 264",
			len(batch.Poison), batch.Duplicates, len(batch.Deliveries))
	}
	if err := produce(ctx, e.cl, e.topic, batch.Deliveries, 0); err != nil {
		t.Fatal(err)
	}
	w := e.start("worker-1")

	code, out, stderr := e.runCheckCmd("--wait", "60s")
	if code != exitOK || len(out.Violations) > 0 {
		t.Fatalf("check: exit %d, %+v; stderr: %s", code, out, stderr)
	}
	if out.Delivered != 264 || out.DuplicatesSent != 44 || out.UniqueOrders != 200 || out.PoisonRecords != 20 ||
		out.Effects != 200 || out.EventIDs != 200 || out.DeadLettered != 20 {
		t.Errorf("check: %+v; want 264 records, 44 duplicates, 200 orders with effects and events, 20 poison records dead-lettered", out)
	}
	stopAll(t, w)

	// A second effect of one order: the check must fail and say so.
	orders := pgx.Identifier{e.db.Schema, "orders"}.Sanitize()
	if _, err := e.db.Pool.Exec(ctx, `INSERT INTO `+orders+` (order_id, customer_id, amount_cents, message_id)
		SELECT order_id, customer_id, amount_cents, message_id FROM `+orders+` LIMIT 1`); err != nil {
		t.Fatal(err)
	}
	code, out, stderr = e.runCheckCmd()
	if code != exitError || !strings.Contains(stderr, "duplicate effects: 1, must be 0") ||
		!strings.Contains(strings.Join(out.Violations, "\n"), "effects: 201, must be 200") {
		t.Errorf("check after a second effect: exit %d, violations %q, stderr %q; want exit 1 naming the duplicate effect",
			code, out.Violations, stderr)
	}
}

// TestCheckFindsViolations plants in Kafka what the soak must catch and the
// check command reports: a customer's events out of order, a valid order in
// the dead-letter topic, a poison record missing from it.
func TestCheckFindsViolations(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	batch := generate(orderSpec{Count: 3, Customers: 1, PoisonRate: 0.7}, newRand()) // 2 poison records
	if len(batch.Poison) != 2 {
		t.Fatalf("%d poison records; want 2", len(batch.Poison))
	}

	// The third order's event, then the first two's: seq 3, 1, 2.
	var events []*kgo.Record
	for i, o := range []int{2, 0, 1} {
		value, _ := json.Marshal(OrderAccepted{Order: batch.Orders[o], Seq: int64(o + 1)})
		events = append(events, &kgo.Record{Topic: e.events, Key: []byte(batch.Orders[o].CustomerID), Value: value,
			Headers: []kgo.RecordHeader{{Key: eventTypeHeader, Value: []byte(orderAcceptedType)},
				{Key: "message-id", Value: fmt.Appendf(nil, "event-%d", i)}}})
	}
	if err := e.cl.ProduceSync(ctx, events...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	var r report
	if err := checkEvents(ctx, e.kafka.Brokers, e.events, batch, &r); err != nil {
		t.Fatal(err)
	}
	if r.OutOfOrderEvents != 2 || r.EventIDs != 3 || r.DuplicateEvents != 0 || r.MissingEvents != 0 || r.InvalidEvents != 0 {
		t.Errorf("events seq 3, 1, 2: %+v; want 2 out of order and nothing else wrong", r)
	}

	// The dead-letter topic holds the first poison record and an order:
	// one poison record missing, one order that should not be there.
	dlqTopic := e.kafka.CreateTopic(t, "orders_dlq", 1)
	var dead []*kgo.Record
	for _, d := range batch.Deliveries {
		if d.Duplicate || (d.Poison != nil && d.MessageID != batch.Poison[0]) || (d.Poison == nil && d.Order != batch.Orders[0]) {
			continue
		}
		src := d.record(e.topic)
		info := &dlq.Info{Topic: e.topic, Group: e.group, MessageID: d.MessageID, Attempts: 1,
			FirstFailure: time.Now(), LastFailure: time.Now(), Class: dlq.ClassPermanent, Error: "planted"}
		dead = append(dead, dlq.NewRecord(dlqTopic, src, info, dlq.HeaderPolicy{}))
	}
	if err := e.cl.ProduceSync(ctx, dead...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	r = report{}
	if err := checkDeadLetters(ctx, e.kafka.Brokers, dlqTopic, e.group, batch, &r); err != nil {
		t.Fatal(err)
	}
	if r.PoisonRecords != 2 || r.DeadLettered != 2 || r.PoisonMissing != 1 || r.OrdersDeadLettered != 1 || r.InvalidDeadLetters != 0 {
		t.Errorf("dead letters: %+v; want 2 dead-lettered ids, 1 poison record missing, 1 order", r)
	}
	var found []string
	for _, v := range r.violations() {
		if strings.Contains(v, dlqTopic) {
			found = append(found, v)
		}
	}
	if len(found) != 2 {
		t.Errorf("violations %q; want the poison record missing from and the order in %s", r.violations(), dlqTopic)
	}
}

// TestCheckPoisonKinds runs a worker over the poison the consumer must
// dead-letter or park without stopping, amid orders: orders whose message id
// is a raw 16-byte UUID or holds a NUL byte, an order and a poison record
// just under the topic's max.message.bytes (the poison's dead letter must be
// a stub), an aborted and a committed Kafka transaction (the committed one
// sends the aborted order again under its message id), and an order whose
// event is over the events topic's limit. The check must pass with each
// counted; then an effect planted for the aborted record and one for an
// order with an unstorable id must fail it, naming both records.
func TestCheckPoisonKinds(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	const limit, eventsLimit = 16384, 2048
	limitText, eventsLimitText := fmt.Sprint(limit), fmt.Sprint(eventsLimit)
	for topic, v := range map[string]*string{e.topic: &limitText, dlq.DefaultTopic(e.topic): &limitText, e.events: &eventsLimitText} {
		resp, err := e.adm.AlterTopicConfigs(ctx, []kadm.AlterConfig{{Name: "max.message.bytes", Value: v}}, topic)
		if err == nil {
			err = resp[0].Err
		}
		if err != nil {
			t.Fatalf("set max.message.bytes of %s: %v", topic, err)
		}
	}
	order := func(id, customer string) Order { return Order{OrderID: id, CustomerID: customer, AmountCents: 100} }
	rec := func(id string, value []byte) *kgo.Record {
		return &kgo.Record{Topic: e.topic, Key: []byte("k"), Value: value,
			Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte(id)}}}
	}
	orderRec := func(id string, o Order) *kgo.Record {
		v, _ := json.Marshal(o)
		return rec(id, v)
	}
	// The largest value that leaves the record's batch under limit.
	nearLimitValue := func(r *kgo.Record) int { return limit - 200 - recordBytes(r) + len(r.Value) }
	padded := orderRec("near-limit-order", order("near", "c1"))
	padded.Value = append(bytes.Repeat([]byte(" "), nearLimitValue(padded)-len(padded.Value)), padded.Value...)
	noise := rec("near-limit-poison", nil)
	noise.Value = make([]byte, nearLimitValue(noise))
	_, _ = cryptorand.Read(noise.Value) // not JSON, and incompressible
	noise.Value[0] = 0xff
	rawUUID := string([]byte{0x01, 0x8f, 0xa2, 0x00, 0xff, 0x7e, 0x70, 0x00, 0x80, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77})
	var bigID string // its event is over eventsLimit, however compressed
	for len(bigID) < 2*eventsLimit {
		bigID += cryptorand.Text()
	}

	cl := e.kafka.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()), kgo.ProducerBatchCompression(kgo.NoCompression()))
	if err := cl.ProduceSync(ctx, orderRec("plain", order("plain", "c1")), orderRec(rawUUID, order("raw-uuid", "c1")),
		orderRec("nul\x00id", order("nul", "c1"))).FirstErr(); err != nil {
		t.Fatal(err)
	}
	for _, r := range []*kgo.Record{padded, noise, orderRec("big-event", order(bigID, "c-big"))} {
		if err := cl.ProduceSync(ctx, r).FirstErr(); err != nil { // one record a batch, each under the limit
			t.Fatal(err)
		}
	}
	tx := e.kafka.Client(t, kgo.TransactionalID(testenv.UniqueName("tx")), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	var abortedAt int64
	for _, commit := range []bool{false, true} {
		if err := tx.BeginTransaction(); err != nil {
			t.Fatal(err)
		}
		recs := []*kgo.Record{orderRec("tx-1", order("tx-1", "c2"))}
		if commit {
			recs = append(recs, orderRec("tx-2", order("tx-2", "c2")))
		}
		res, err := tx.ProduceSync(ctx, recs...).First()
		if err != nil {
			t.Fatal(err)
		}
		if !commit {
			abortedAt = res.Offset
		}
		if err := tx.EndTransaction(ctx, kgo.TransactionEndTry(commit)); err != nil {
			t.Fatal(err)
		}
	}
	// A record after the transactions: committed offsets can reach the end.
	if err := cl.ProduceSync(ctx, orderRec("tail", order("tail", "c1"))).FirstErr(); err != nil {
		t.Fatal(err)
	}
	w := e.start("worker-1")
	code, out, stderr := e.runCheckCmd("--wait", "60s")
	if code != exitOK || len(out.Violations) > 0 {
		t.Fatalf("check: exit %d, %+v; stderr: %s", code, out, stderr)
	}
	want := checkOutput{Delivered: 9, UniqueOrders: 6, PoisonRecords: 3, Effects: 6, EventIDs: 5, DeadLettered: 3,
		Transactional: 2, AbortedRecords: 1, UnstorableIDs: 2, NearLimitOrders: 1, NearLimitPoison: 1, EventsParked: 1, DeadLetterStubs: 1}
	if fmt.Sprint(out) != fmt.Sprint(want) {
		t.Errorf("check: %+v\nwant   %+v", out, want)
	}
	stopAll(t, w)

	// Effects planted for the aborted record and for the order whose
	// message id is a raw UUID: the check must fail, naming both.
	orders := pgx.Identifier{e.db.Schema, "orders"}.Sanitize()
	if _, err := e.db.Pool.Exec(ctx, `INSERT INTO `+orders+` (order_id, customer_id, amount_cents, message_id, topic, partition, "offset")
		VALUES ('tx-1', 'c2', 100, 'tx-1', $1, 0, $2), ('raw-uuid', 'c1', 100, 'escaped', $1, 0, 1)`, e.topic, abortedAt); err != nil {
		t.Fatal(err)
	}
	code, out, stderr = e.runCheckCmd()
	violations := strings.Join(out.Violations, "\n")
	for _, named := range []string{
		fmt.Sprintf(`records of aborted transactions applied or dead-lettered: 1, must be 0 (aborted record %s/0/%d has an effect of order "tx-1")`, e.topic, abortedAt),
		fmt.Sprintf(`effects of no order produced: 1, must be 0 (order "raw-uuid" from %s/0/1, message-id "escaped")`, e.topic),
	} {
		if code != exitError || !strings.Contains(violations, named) {
			t.Errorf("check after planting effects: exit %d, violations:\n%s\nwant exit 1 and %q; stderr %q", code, violations, named, stderr)
		}
	}
}
