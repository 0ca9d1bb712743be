// Package orderload is the contended workload of the benchmark and of the
// chaos measurement: orders keyed by order id, whose effects are the
// orderworker example's (an order row, an upsert of the customer's balance,
// an order.accepted event through oncely's outbox keyed by customer). Records
// of every partition touch the same few balance rows and the same outbox
// keys, so transactions of different partitions contend.
//
// It holds the tables, the record format, the per-record and the set-based
// effects, the hand-written inbox claim and the verification, so that the
// benchmark's modes and the chaos workers do exactly the same work.
package orderload

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/oncely/oncely/outbox"
)

// EventsTopic is the topic of the order.accepted events.
const EventsTopic = "order-events"

// Order is a record's JSON value: the example's three fields, and the
// produce time in unix nanoseconds for the benchmark's latency.
type Order struct {
	OrderID     string `json:"order_id"`
	CustomerID  string `json:"customer_id"`
	AmountCents int64  `json:"amount_cents"`
	SentNS      int64  `json:"sent_ns,omitempty"`
}

// Decode reads a record value.
func Decode(v []byte) (Order, error) {
	var o Order
	if err := json.Unmarshal(v, &o); err != nil {
		return o, fmt.Errorf("orderload: decode order: %w", err)
	}
	if o.OrderID == "" || o.CustomerID == "" {
		return o, errors.New("orderload: order without order_id or customer_id")
	}
	return o, nil
}

// CustomerOf returns the customer id of a record value without decoding the
// rest: the conflict key of the workload.
func CustomerOf(v []byte) string {
	var o struct {
		CustomerID string `json:"customer_id"`
	}
	_ = json.Unmarshal(v, &o)
	return o.CustomerID
}

// Accepted is the order.accepted event's value: the order and its customer's
// sequence number.
type Accepted struct {
	OrderID     string `json:"order_id"`
	CustomerID  string `json:"customer_id"`
	AmountCents int64  `json:"amount_cents"`
	Seq         int64  `json:"seq"`
}

// Gen is a deterministic order generator: order i has the id "order-<i>",
// the message id "msg-<i>", an amount of 1..1000 cents and one of customers
// customers, drawn from a generator seeded with seed.
type Gen struct {
	customers []int
}

// NewGen returns the generator of n orders over customers customers.
func NewGen(n, customers int, seed uint64) Gen {
	rng := rand.New(rand.NewPCG(seed, 0x6f6e63656c79))
	c := make([]int, n)
	for i := range c {
		c[i] = rng.IntN(customers)
	}
	return Gen{customers: c}
}

// Len is the number of orders.
func (g Gen) Len() int { return len(g.customers) }

// Order returns order i.
func (g Gen) Order(i int, sentNS int64) Order {
	return Order{OrderID: "order-" + strconv.Itoa(i), CustomerID: fmt.Sprintf("cust-%03d", g.customers[i]),
		AmountCents: int64(i%1000) + 1, SentNS: sentNS}
}

// MessageID is order i's message id (the message-id header).
func MessageID(i int) string { return "msg-" + strconv.Itoa(i) }

// Tables are the example's two tables, as examples/orderworker creates them,
// with the orders table's two extra columns: app (the application_name of
// the session that inserted the row) and inserted_at (the clock at insert),
// which the chaos measurement reads to tell when a restarted process first
// committed. The example's and the benchmark's INSERTs leave them to their
// defaults.
func Tables(schema string) []string {
	return []string{
		`CREATE TABLE ` + pgx.Identifier{schema, "orders"}.Sanitize() + ` (
			id           bigserial   PRIMARY KEY,
			order_id     text        NOT NULL,
			customer_id  text        NOT NULL,
			amount_cents bigint      NOT NULL,
			message_id   text        NOT NULL,
			topic        text,
			partition    int,
			"offset"     bigint,
			created_at   timestamptz NOT NULL DEFAULT now(),
			app          text        DEFAULT current_setting('application_name'),
			inserted_at  timestamptz DEFAULT clock_timestamp())`,
		`CREATE TABLE ` + pgx.Identifier{schema, "customer_balances"}.Sanitize() + ` (
			customer_id   text   PRIMARY KEY,
			balance_cents bigint NOT NULL,
			order_count   bigint NOT NULL DEFAULT 0)`,
	}
}

// Store runs the workload's statements in one schema.
type Store struct {
	schema string
	events *outbox.Outbox

	claim, insertOrder, addToBalance string
	insertOrders, addToBalances      string
}

// NewStore returns the statements of schema, built once.
func NewStore(schema string) (*Store, error) {
	events, err := outbox.New(outbox.Config{Schema: schema})
	if err != nil {
		return nil, err
	}
	orders := pgx.Identifier{schema, "orders"}.Sanitize()
	balances := pgx.Identifier{schema, "customer_balances"}.Sanitize()
	return &Store{
		schema: schema,
		events: events,
		claim: `INSERT INTO ` + pgx.Identifier{schema, "inbox"}.Sanitize() + ` (consumer_group, message_id, topic, partition, "offset")
			VALUES ($1, $2, $3, $4, $5) ON CONFLICT (consumer_group, message_id) DO NOTHING`,
		insertOrder: `INSERT INTO ` + orders + ` (order_id, customer_id, amount_cents, message_id, topic, partition, "offset")
			VALUES ($1, $2, $3, $4, $5, $6, $7)`,
		addToBalance: `INSERT INTO ` + balances + ` AS b (customer_id, balance_cents, order_count) VALUES ($1, $2, 1)
			ON CONFLICT (customer_id) DO UPDATE SET balance_cents = b.balance_cents + EXCLUDED.balance_cents,
				order_count = b.order_count + 1
			RETURNING order_count`,
		insertOrders: `INSERT INTO ` + orders + ` (order_id, customer_id, amount_cents, message_id, topic, partition, "offset")
			SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::text[], $6::int[], $7::bigint[])`,
		// One row per customer, in customer order: two transactions that
		// share customers lock their rows in the same order.
		addToBalances: `INSERT INTO ` + balances + ` AS b (customer_id, balance_cents, order_count)
			SELECT customer_id, sum(amount), count(*) FROM unnest($1::text[], $2::bigint[]) AS u(customer_id, amount)
			GROUP BY customer_id ORDER BY customer_id
			ON CONFLICT (customer_id) DO UPDATE SET balance_cents = b.balance_cents + EXCLUDED.balance_cents,
				order_count = b.order_count + EXCLUDED.order_count
			RETURNING customer_id, order_count`,
	}, nil
}

// Schema is the store's schema.
func (s *Store) Schema() string { return s.schema }

// Source is where a record came from: what the orders row keeps.
type Source struct {
	MessageID string
	Topic     string
	Partition int32
	Offset    int64
}

// HandClaim is the inbox claim a user writes by hand without oncely's
// consumer: the message id inserted into oncely's inbox table, ON CONFLICT
// DO NOTHING. It reports whether the id was new.
func (s *Store) HandClaim(ctx context.Context, tx pgx.Tx, group string, src Source) (bool, error) {
	tag, err := tx.Exec(ctx, s.claim, group, src.MessageID, src.Topic, src.Partition, src.Offset)
	return err == nil && tag.RowsAffected() == 1, err
}

// Apply is the example's per-record handler: the order row, the balance
// upsert (whose order_count is the event's seq), the order.accepted event.
func (s *Store) Apply(ctx context.Context, tx pgx.Tx, o Order, src Source) error {
	// As the example: the order row and the balance in one round trip.
	var seq int64
	b := &pgx.Batch{}
	b.Queue(s.insertOrder, o.OrderID, o.CustomerID, o.AmountCents, src.MessageID, src.Topic, src.Partition, src.Offset)
	b.Queue(s.addToBalance, o.CustomerID, o.AmountCents).QueryRow(func(row pgx.Row) error { return row.Scan(&seq) })
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("insert order %s and add to balance of %s: %w", o.OrderID, o.CustomerID, err)
	}
	return s.enqueue(ctx, tx, []Order{o}, []int64{seq})
}

func (s *Store) enqueue(ctx context.Context, tx pgx.Tx, orders []Order, seqs []int64) error {
	msgs := make([]outbox.Message, len(orders))
	for i, o := range orders {
		v, err := json.Marshal(Accepted{OrderID: o.OrderID, CustomerID: o.CustomerID, AmountCents: o.AmountCents, Seq: seqs[i]})
		if err != nil {
			return err
		}
		msgs[i] = outbox.Message{Topic: EventsTopic, Key: []byte(o.CustomerID), Value: v,
			Headers: []outbox.Header{{Key: "type", Value: []byte("order.accepted")}}}
	}
	if _, err := s.events.Enqueue(ctx, tx, msgs...); err != nil {
		return fmt.Errorf("enqueue order.accepted: %w", err)
	}
	return nil
}

// ApplyMany is the set-based handler of a batch of orders, in offset order:
// one multi-row insert of the orders, the balances summed per customer and
// upserted in customer order by one statement, each order's seq derived from
// its customer's returned count (a customer's k orders get count-k+1..count
// in the order given), and one Enqueue of all the events (the outbox takes
// its per-key locks sorted, in one statement).
func (s *Store) ApplyMany(ctx context.Context, tx pgx.Tx, orders []Order, srcs []Source) error {
	n := len(orders)
	var (
		orderIDs, customers, msgIDs, topics = make([]string, n), make([]string, n), make([]string, n), make([]string, n)
		amounts, offsets                    = make([]int64, n), make([]int64, n)
		parts                               = make([]int32, n)
	)
	for i, o := range orders {
		orderIDs[i], customers[i], amounts[i] = o.OrderID, o.CustomerID, o.AmountCents
		msgIDs[i], topics[i], parts[i], offsets[i] = srcs[i].MessageID, srcs[i].Topic, srcs[i].Partition, srcs[i].Offset
	}
	b := &pgx.Batch{}
	b.Queue(s.insertOrders, orderIDs, customers, amounts, msgIDs, topics, parts, offsets)
	counts := make(map[string]int64, n)
	b.Queue(s.addToBalances, customers, amounts).Query(func(rows pgx.Rows) error {
		var (
			c     string
			count int64
		)
		_, err := pgx.ForEachRow(rows, []any{&c, &count}, func() error { counts[c] = count; return nil })
		return err
	})
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("insert orders and balances: %w", err)
	}
	// The customer's count is the seq of its last order in the batch.
	inBatch := make(map[string]int64, len(counts))
	for _, c := range customers {
		inBatch[c]++
	}
	seqs := make([]int64, n)
	seen := make(map[string]int64, len(counts))
	for i, c := range customers {
		seen[c]++
		seqs[i] = counts[c] - inBatch[c] + seen[c]
	}
	return s.enqueue(ctx, tx, orders, seqs)
}

// Retryable reports whether err is contention a plain user retries the
// transaction on: a deadlock, a serialization failure, a lock timeout.
func Retryable(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && slices.Contains([]string{"40P01", "40001", "55P03"}, pe.Code)
}

// DBTX runs queries: a pool, a connection or a transaction.
type DBTX interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Check is what the database holds after a run.
type Check struct {
	Orders, DistinctOrders, Inbox int64
	BadBalances                   int64 // customers whose balance or count is not their orders'
	Events, DistinctEventOrders   int64
	BadSeqs                       int64 // customers whose events' seqs are not 1..n
}

// Verify checks that each of want orders was applied exactly once: one order
// row per order, one inbox row per message id, every balance the sum and
// count of its customer's orders, one event per order, and each customer's
// event seqs 1..n without gaps or repeats.
func (s *Store) Verify(ctx context.Context, db DBTX, want int64) (Check, error) {
	var c Check
	t := func(name string) string { return pgx.Identifier{s.schema, name}.Sanitize() }
	events := []any{EventsTopic}
	qs := []struct {
		sql        string
		args, dest []any
	}{
		{`SELECT count(*), count(DISTINCT order_id) FROM ` + t("orders"), nil, []any{&c.Orders, &c.DistinctOrders}},
		{`SELECT count(*) FROM ` + t("inbox"), nil, []any{&c.Inbox}},
		{`SELECT count(*) FROM ` + t("customer_balances") + ` b FULL JOIN
			(SELECT customer_id, sum(amount_cents) AS s, count(*) AS n FROM ` + t("orders") + ` GROUP BY 1) o USING (customer_id)
			WHERE b.balance_cents IS DISTINCT FROM o.s OR b.order_count IS DISTINCT FROM o.n`, nil, []any{&c.BadBalances}},
		{`SELECT count(*), count(DISTINCT convert_from(value, 'UTF8')::jsonb->>'order_id') FROM ` + t("outbox") +
			` WHERE topic = $1`, events, []any{&c.Events, &c.DistinctEventOrders}},
		{`SELECT count(*) FROM (SELECT key, count(*) AS n, count(DISTINCT seq) AS d, min(seq) AS lo, max(seq) AS hi
			FROM (SELECT key, (convert_from(value, 'UTF8')::jsonb->>'seq')::bigint AS seq FROM ` + t("outbox") +
			` WHERE topic = $1) e GROUP BY key) k WHERE n <> d OR lo <> 1 OR hi <> n`, events, []any{&c.BadSeqs}},
	}
	for _, q := range qs {
		if err := db.QueryRow(ctx, q.sql, q.args...).Scan(q.dest...); err != nil {
			return c, fmt.Errorf("verify: %w", err)
		}
	}
	switch {
	case c.Orders != want || c.DistinctOrders != want:
		return c, fmt.Errorf("verify: %d order rows for %d distinct orders, want %d of each", c.Orders, c.DistinctOrders, want)
	case c.Inbox != want:
		return c, fmt.Errorf("verify: %d inbox rows, want %d", c.Inbox, want)
	case c.BadBalances != 0:
		return c, fmt.Errorf("verify: %d customers whose balance is not the sum and count of their orders", c.BadBalances)
	case c.Events != want || c.DistinctEventOrders != want:
		return c, fmt.Errorf("verify: %d order.accepted events for %d distinct orders, want %d of each", c.Events, c.DistinctEventOrders, want)
	case c.BadSeqs != 0:
		return c, fmt.Errorf("verify: %d customers whose event seqs are not 1..n", c.BadSeqs)
	}
	return c, nil
}
