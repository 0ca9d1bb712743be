package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely"
	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/migrations"
	"github.com/oncely/oncely/outbox"
	"github.com/oncely/oncely/rabbitconsumer"
	"github.com/oncely/oncely/webhook"
)

// Order is the JSON value of a record on the orders topic.
type Order struct {
	OrderID     string `json:"order_id"`
	CustomerID  string `json:"customer_id"`
	AmountCents int64  `json:"amount_cents"`
}

// validate checks what the JSON decoding cannot: the ids are there and the
// amount is positive. The consumer dead-letters an order that fails it;
// POST /orders refuses it with 400.
func (o Order) validate() error {
	switch {
	case o.OrderID == "" || o.CustomerID == "":
		return errors.New("order_id and customer_id are required")
	case o.AmountCents <= 0:
		return fmt.Errorf("order %s: amount_cents must be positive, got %d", o.OrderID, o.AmountCents)
	}
	return nil
}

// OrderAccepted is the value of the event the handler publishes, through
// oncely's outbox, for every order it applies: a record on the events topic
// (default order-events) with the customer id as its key, a type header of
// "order.accepted" and the outbox's message-id header. Seq numbers the
// customer's accepted orders from 1 in the order their transactions
// committed; because the outbox keeps one key's events in commit order, a
// reader of the topic sees each customer's Seq go 1, 2, 3... (republished
// events, recognisable by their message id, aside).
type OrderAccepted struct {
	Order
	Seq int64 `json:"seq"`
}

// Headers of the events the handler publishes.
const (
	eventTypeHeader   = "type"
	orderAcceptedType = "order.accepted"
)

// The shutdown after SIGTERM, within the 10s that orchestrators usually
// grant before they send SIGKILL: the runner's 8s (the HTTP server stops
// taking requests, the consumer drains for up to 6s, the relay publishes the
// last events for up to 1s), then up to telemetryFlushTimeout to export the
// last spans and metrics.
const (
	shutdownTimeout       = 8 * time.Second
	telemetryFlushTimeout = time.Second
)

// store is the example's own tables. Every statement is qualified with the
// schema, quoted by pgx.Identifier, and built once here; values are always
// bind parameters.
type store struct {
	schema string
	create []string // CREATE ... IF NOT EXISTS, in order

	insertOrder  string
	addToBalance string
	// The batch handler's: every order of a batch in one statement, every
	// customer's balance in one statement.
	insertOrders  string
	addToBalances string

	events      *outbox.Outbox // oncely's outbox table, in the same schema
	eventsTopic string
}

// newStore returns the example's tables in schema; the handler publishes its
// events to eventsTopic through the outbox in the same schema.
func newStore(schema, eventsTopic string) (*store, error) {
	events, err := outbox.New(outbox.Config{Schema: schema})
	if err != nil {
		return nil, err
	}
	orders := pgx.Identifier{schema, "orders"}.Sanitize()
	balances := pgx.Identifier{schema, "customer_balances"}.Sanitize()
	return &store{
		schema:      schema,
		events:      events,
		eventsTopic: eventsTopic,
		create: []string{
			// No UNIQUE (order_id), on purpose: nothing in the table stops
			// a second delivery from inserting a second row. Exactly one
			// row per order is the inbox's doing, and the demo and the
			// tests count the rows to prove it.
			`CREATE TABLE IF NOT EXISTS ` + orders + ` (
				id           bigserial   PRIMARY KEY,
				order_id     text        NOT NULL,
				customer_id  text        NOT NULL,
				amount_cents bigint      NOT NULL,
				message_id   text        NOT NULL,
				topic        text,
				partition    int,
				"offset"     bigint,
				created_at   timestamptz NOT NULL DEFAULT now())`,
			`CREATE TABLE IF NOT EXISTS ` + balances + ` (
				customer_id   text   PRIMARY KEY,
				balance_cents bigint NOT NULL,
				order_count   bigint NOT NULL DEFAULT 0)`,
			// Schemas created before events carried a sequence.
			`ALTER TABLE ` + balances + ` ADD COLUMN IF NOT EXISTS order_count bigint NOT NULL DEFAULT 0`,
		},
		insertOrder: `INSERT INTO ` + orders + `
			(order_id, customer_id, amount_cents, message_id, topic, partition, "offset")
			VALUES ($1, $2, $3, $4, $5, $6, $7)`,
		// Adding to a balance is the textbook effect that must not run
		// twice: a redelivered order would credit the customer again. The
		// row lock it takes also serializes one customer's transactions,
		// so order_count numbers them in commit order.
		addToBalance: `INSERT INTO ` + balances + ` AS b (customer_id, balance_cents, order_count)
			VALUES ($1, $2, 1)
			ON CONFLICT (customer_id) DO UPDATE SET balance_cents = b.balance_cents + EXCLUDED.balance_cents,
				order_count = b.order_count + 1
			RETURNING order_count`,
		insertOrders: `INSERT INTO ` + orders + `
			(order_id, customer_id, amount_cents, message_id, topic, partition, "offset")
			SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::text[], $6::int[], $7::bigint[])`,
		// One row per customer, in customer order: two batches that share
		// customers lock their balance rows in the same order. (The
		// consumer's conflict locks already make them take turns; the
		// order keeps that true for any other writer of balances.)
		addToBalances: `INSERT INTO ` + balances + ` AS b (customer_id, balance_cents, order_count)
			SELECT * FROM unnest($1::text[], $2::bigint[], $3::bigint[]) ORDER BY 1
			ON CONFLICT (customer_id) DO UPDATE SET balance_cents = b.balance_cents + EXCLUDED.balance_cents,
				order_count = b.order_count + EXCLUDED.order_count
			RETURNING customer_id, order_count`,
	}, nil
}

// lockKey names the advisory lock that serializes the example's CREATE
// TABLE statements among instances starting at the same moment (two
// concurrent CREATE TABLE IF NOT EXISTS of one table can fail on the
// catalog's unique index). The tests hold it to observe a worker that is not
// ready yet.
func (s *store) lockKey() string { return "oncely-orderworker/" + s.schema }

// migrate is a worker's start-up, for the demo and the tests: oncely's
// migrations, then the example's tables.
func (s *store) migrate(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger) error {
	m, err := migrations.New(pool, migrations.Config{Schema: s.schema, Logger: log})
	if err != nil {
		return err
	}
	if _, err := m.Up(ctx); err != nil {
		return err
	}
	return s.createTables(ctx, pool)
}

// createTables creates the example's tables (oncely's are the runner's
// migrations), in one transaction under an advisory lock, so any number of
// instances may run it at once.
func (s *store) createTables(ctx context.Context, pool *pgxpool.Pool) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended($1, 0))`, s.lockKey()); err != nil {
			return fmt.Errorf("orderworker: lock for migrations: %w", err)
		}
		for _, stmt := range s.create {
			if _, err := tx.Exec(ctx, stmt); err != nil {
				return fmt.Errorf("orderworker: create tables: %w", err)
			}
		}
		return nil
	})
}

// handler is the consumer.Handler: consumer.JSON decodes each record's value
// into an Order and hands it to apply. A value that does not decode (bad
// JSON, a field of the wrong type, an unknown field) will not decode on a
// later attempt either, so consumer.JSON marks the error dlq.Undecodable and
// the consumer dead-letters the record at once, to "<topic>.dlq", instead of
// retrying it or stopping the partition.
func (s *store) handler() consumer.Handler { return consumer.JSON(s.apply) }

// conflictKeys names the row an order's handler writes that other
// partitions' orders write too: its customer's balance. Orders are keyed by
// order id, so one customer's orders arrive on every partition, and every
// member of the group; the consumer locks these keys in sorted order before
// a transaction's handler runs, so transactions that share a customer take
// turns instead of deadlocking on the balance rows (and on the outbox's
// per-customer lock). A value that does not decode names no key: the
// handler dead-letters it.
//
// Only the per-record handler needs them: in a batch of its records, or in
// transactions of one record each run side by side, customers are written
// in the order the records come. applyBatch writes each customer once, in
// customer order, and then the outbox locks its customers in sorted order:
// two of its batches can wait on each other's commit, never on each other.
func conflictKeys(msg *consumer.Message) []string {
	o, err := consumer.DecodeJSON[Order](msg.Value)
	if err != nil || o.CustomerID == "" {
		return nil
	}
	return []string{"customer:" + o.CustomerID}
}

// batchHandler is the default handler (--handler batch): the orders of a
// batch are applied set-based, in three round trips whatever their number,
// with the same effects and guarantees as apply, the per-record handler.
func (s *store) batchHandler() consumer.BatchHandler { return s.applyBatch }

// applyBatch runs inside the transaction whose first statement claimed the
// ids of every message of msgs in the inbox:
// one statement inserts all their order rows, one adds to each customer's
// balance once, in customer order, and one enqueues all their events. A
// message that does not decode, or whose order is invalid, is set aside with
// Fail: the batch commits without it and the consumer dead-letters it.
//
// Seq stays the customer's count of accepted orders in commit order: the
// customer's balance row is locked until commit, and a customer's k orders
// in this batch take the numbers count-k+1 .. count, in offset order.
func (s *store) applyBatch(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
	type accepted struct {
		msg *consumer.Message
		o   Order
	}
	orders := make([]accepted, 0, len(msgs))
	for _, msg := range msgs {
		o, err := consumer.DecodeJSON[Order](msg.Value)
		if err != nil {
			msg.Fail(dlq.Undecodable(err))
			continue
		}
		if err := o.validate(); err != nil {
			msg.Fail(dlq.Permanent(fmt.Errorf("orderworker: record %s/%d/%d: %w", msg.Topic, msg.Partition, msg.Offset, err)))
			continue
		}
		orders = append(orders, accepted{msg, o})
	}
	if len(orders) == 0 {
		return nil
	}
	n := len(orders)
	var (
		orderIDs, customers, msgIDs, topics = make([]string, n), make([]string, n), make([]string, n), make([]string, n)
		amounts, offsets                    = make([]int64, n), make([]int64, n)
		partitions                          = make([]int32, n)
		perCustomer                         = map[string]*[2]int64{} // cents, orders
	)
	for i, a := range orders {
		orderIDs[i], customers[i], amounts[i] = a.o.OrderID, a.o.CustomerID, a.o.AmountCents
		msgIDs[i], topics[i], partitions[i], offsets[i] = a.msg.ID, a.msg.Topic, a.msg.Partition, a.msg.Offset
		t := perCustomer[a.o.CustomerID]
		if t == nil {
			t = new([2]int64)
			perCustomer[a.o.CustomerID] = t
		}
		t[0] += a.o.AmountCents
		t[1]++
	}
	ids := slices.Sorted(maps.Keys(perCustomer))
	cents, counts := make([]int64, len(ids)), make([]int64, len(ids))
	for i, id := range ids {
		cents[i], counts[i] = perCustomer[id][0], perCustomer[id][1]
	}
	// The order rows and the balances in one round trip.
	next := make(map[string]int64, len(ids)) // the next order's seq, per customer
	b := &pgx.Batch{}
	b.Queue(s.insertOrders, orderIDs, customers, amounts, msgIDs, topics, partitions, offsets)
	b.Queue(s.addToBalances, ids, cents, counts).Query(func(rows pgx.Rows) error {
		var id string
		var count int64
		_, err := pgx.ForEachRow(rows, []any{&id, &count}, func() error {
			next[id] = count - perCustomer[id][1] + 1
			return nil
		})
		return err
	})
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("orderworker: insert %d orders and add to %d balances: %w", n, len(ids), err)
	}
	events := make([]outbox.Message, n)
	for i, a := range orders {
		seq := next[a.o.CustomerID]
		next[a.o.CustomerID]++
		value, err := json.Marshal(OrderAccepted{Order: a.o, Seq: seq})
		if err != nil {
			return fmt.Errorf("orderworker: encode order.accepted for %s: %w", a.o.OrderID, err)
		}
		events[i] = s.accepted(a.o, value)
		events[i].Context = a.msg.Context() // the event continues its order's trace
	}
	// One statement for all events; the outbox takes its per-customer
	// locks in sorted order.
	if _, err := s.events.Enqueue(ctx, tx, events...); err != nil {
		return fmt.Errorf("orderworker: enqueue %d order.accepted events: %w", n, err)
	}
	return nil
}

// accepted is the outbox message of an order.accepted event.
func (s *store) accepted(o Order, value []byte) outbox.Message {
	return outbox.Message{
		Topic: s.eventsTopic,
		Key:   []byte(o.CustomerID), // one customer's events stay in commit order
		Value: value,
		Headers: []outbox.Header{
			{Key: eventTypeHeader, Value: []byte(orderAcceptedType)},
			{Key: "content-type", Value: []byte("application/json")},
		},
	}
}

// apply runs inside the transaction whose first statement claimed msg.ID in
// the inbox, so its writes commit together with that claim, or not at all:
// the order's row, the customer's balance, and the order.accepted event in
// the outbox, which the relay publishes once the transaction committed.
// Neither of the first two writes is idempotent by itself, and the event
// gets a new message id each time: the inbox is what makes each order count,
// and be announced, once.
func (s *store) apply(ctx context.Context, tx pgx.Tx, msg *consumer.Message, o Order) error {
	// An order that is wrong now is wrong on every retry: dead-letter it at
	// once (class permanent) instead of retrying it MaxAttempts times.
	if err := o.validate(); err != nil {
		return dlq.Permanent(fmt.Errorf("orderworker: record %s/%d/%d: %w", msg.Topic, msg.Partition, msg.Offset, err))
	}
	// The order row and the balance in one round trip (a pgx.Batch: the
	// statements run in order, in tx).
	var seq int64
	b := &pgx.Batch{}
	b.Queue(s.insertOrder, o.OrderID, o.CustomerID, o.AmountCents, msg.ID, msg.Topic, msg.Partition, msg.Offset)
	b.Queue(s.addToBalance, o.CustomerID, o.AmountCents).QueryRow(func(row pgx.Row) error { return row.Scan(&seq) })
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("orderworker: insert order %s and add to the balance of %s: %w", o.OrderID, o.CustomerID, err)
	}
	value, err := json.Marshal(OrderAccepted{Order: o, Seq: seq})
	if err != nil {
		return fmt.Errorf("orderworker: encode order.accepted for %s: %w", o.OrderID, err)
	}
	// ctx carries the consumer's process span: the outbox stores its trace
	// context with the event, and the relay's send span continues it.
	if _, err := s.events.Enqueue(ctx, tx, s.accepted(o, value)); err != nil {
		return fmt.Errorf("orderworker: enqueue order.accepted for %s: %w", o.OrderID, err)
	}
	return nil
}

// workerConfig is the run command's configuration (flags in main.go).
type workerConfig struct {
	// Source is the broker of the orders and the events: kafka, or
	// jetstream (NATS at NATSURL).
	Source         string
	NATSURL        string
	AMQPURL        string
	AckWait        time.Duration // JetStream's redelivery delay of an unacknowledged message
	Brokers        []string      // empty: start an in-process kfake cluster
	KafkaOpts      []kgo.Opt     // TLS and SASL, from the --tls* and --sasl-* flags
	Topic          string
	EventsTopic    string // where the order.accepted events go
	DatabaseURL    string
	Group          string
	HTTPAddr       string
	SessionTimeout time.Duration
	// RebalanceTimeout bounds how long a rebalance waits for members to
	// rejoin (consumer.Config.RebalanceTimeout).
	RebalanceTimeout time.Duration
	InstanceID       string
	Schema           string
	BatchSize        int // records per transaction (consumer.Config.BatchSize)
	KeyParallelism   int // orders of a partition processed at once
	GroupConcurrency int // consumer.Config.GroupConcurrency (Kafka)
	// RecordHandler runs the per-record handler (apply) in batches too,
	// each order under a savepoint, instead of the set-based batch handler.
	RecordHandler bool

	// Telemetry. The OTLP exporters read the standard OTEL_EXPORTER_OTLP_*
	// variables themselves; these say whether to start them.
	TraceStdout bool // spans to stdout, one JSON object a line
	OTLPTraces  bool // OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT is set
	OTLPMetrics bool // OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT is set

	// WebhookSecrets verify POST /webhooks/orders (Standard Webhooks,
	// whsec_...; several while rotating). Empty: the route answers 503.
	WebhookSecrets []string
	// testHalt is the TEST-ONLY crash point of POST /orders (package
	// testhalt); "" normally.
	testHalt string
}

// runWorker is the worker: telemetry, then oncely's runner with the
// consumer, the outbox relay, the idempotency cleanup and the HTTP server,
// until ctx is cancelled. It returns nil after a clean shutdown.
func runWorker(ctx context.Context, cfg workerConfig, stdout io.Writer, log *slog.Logger) error {
	var js jetstream.JetStream
	if cfg.Source == sourceJetStream {
		nc, j, err := jetStreamConn(cfg.NATSURL, "orderworker "+cmp.Or(cfg.InstanceID, cfg.Group))
		if err != nil {
			return err
		}
		defer nc.Close()
		if err := ensureStreams(ctx, j, cfg.Topic, cfg.EventsTopic); err != nil {
			return err
		}
		js = j
	} else if cfg.Source == sourceRabbitMQ {
		if err := ensureQueues(cfg.AMQPURL, cfg.Topic, cfg.EventsTopic); err != nil {
			return err
		}
	} else if len(cfg.Brokers) == 0 {
		cluster, err := startKfake(cfg.Topic, cfg.EventsTopic)
		if err != nil {
			return err
		}
		defer cluster.Close()
		cfg.Brokers = cluster.ListenAddrs()
		log.Info("no --brokers: started an in-process kfake cluster; feed it with `orderworker produce --brokers ADDR`",
			"brokers", cfg.Brokers[0], "topic", cfg.Topic, "events_topic", cfg.EventsTopic)
	}
	pcfg, err := pgxpool.ParseConfig(cfg.DatabaseURL)
	if err != nil {
		return err
	}
	// The runner keeps connections for the relay (2), the cleanups (1) and
	// the HTTP handlers (httpConns); the per-key lanes need one each on top.
	// pool_max_conns in the URL wins, and the runner refuses one too small.
	if !strings.Contains(cfg.DatabaseURL, "pool_max_conns") {
		pcfg.MaxConns = max(pcfg.MaxConns, int32(cfg.KeyParallelism)+4) + 3 + httpConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return fmt.Errorf("orderworker: database: %w", err)
	}
	defer pool.Close()

	tel, err := newTelemetry(ctx, cfg, stdout, log)
	if err != nil {
		return err
	}
	defer func() {
		// After the runner stopped, so that the final export includes the
		// components' last spans and counts.
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), telemetryFlushTimeout)
		defer cancel()
		if err := tel.shutdown(fctx); err != nil {
			log.Warn("orderworker telemetry: flush on exit failed", "err", err)
		}
	}()

	st, err := newStore(cfg.Schema, cfg.EventsTopic)
	if err != nil {
		return err
	}
	relay := &outbox.RelayConfig{ClientID: cfg.InstanceID}
	switch {
	case js != nil:
		relay = jetStreamRelay(js)
	case cfg.Source == sourceRabbitMQ:
		// Through the default exchange: an event's topic is the queue's name.
		pub := &rabbitconsumer.Publisher{URL: cfg.AMQPURL}
		defer pub.Close()
		relay = &outbox.RelayConfig{Publisher: pub}
	}
	r, err := oncely.New(oncely.Config{
		Pool: pool, Schema: cfg.Schema, Brokers: cfg.Brokers, KafkaOpts: cfg.KafkaOpts, Logger: log,
		TracerProvider: tel.tracerProvider, MeterProvider: tel.meterProvider, MetricsHandler: tel.metrics,
		// oncely's migrations (the inbox, the outbox, the idempotency
		// keys), then the example's tables.
		Migrate:     true,
		BeforeStart: func(ctx context.Context) error { return st.createTables(ctx, pool) },
		// Every instance runs a relay: relays share the outbox's shards
		// through advisory locks, so per-customer event order holds with
		// any number of them. It creates no topic: the events topic must
		// exist, as the consumed ones must (the runner checks those).
		// Its Kafka client id is the instance id, like the consumer's
		// (empty: oncely-<hostname>-<pid>).
		Relay:           relay,
		ExtraConns:      httpConns,
		ShutdownTimeout: shutdownTimeout,
	})
	if err != nil {
		return err
	}
	var stats func() consumer.Stats
	switch {
	case js != nil:
		w, err := addJetStreamWorker(r, pool, cfg, js, st, log, tel)
		if err != nil {
			return err
		}
		stats = w.Stats
	case cfg.Source == sourceRabbitMQ:
		w, err := addRabbitWorker(r, pool, cfg, st, log, tel)
		if err != nil {
			return err
		}
		stats = w.Stats
	default:
		ccfg := consumer.Config{
			Topics: []string{cfg.Topic}, Group: cfg.Group,
			BatchSize: cfg.BatchSize, KeyParallelism: cfg.KeyParallelism, InstanceID: cfg.InstanceID,
			GroupConcurrency: cfg.GroupConcurrency,
			SessionTimeout:   cfg.SessionTimeout, RebalanceTimeout: cfg.RebalanceTimeout,
		}
		if cfg.BatchSize > 1 && !cfg.RecordHandler {
			// No conflict keys: applyBatch writes the shared rows in
			// customer order, so its batches never deadlock, and keys
			// would make whole batches take turns. For the same reason its
			// lock waits need no bound: a wait lasts until the batch
			// ahead commits (and a deadlock, should another writer of
			// these rows cause one, is still broken by Postgres and
			// retried as contention).
			ccfg.BatchHandler = st.batchHandler()
			ccfg.BatchLockTimeout = -1
		} else {
			ccfg.Handler, ccfg.ConflictKeys = st.handler(), conflictKeys
		}
		c, err := r.AddConsumer(ccfg)
		if err != nil {
			return err
		}
		stats = c.Stats
	}
	api, err := newHTTPAPI(cfg, r, log)
	if err != nil {
		return err
	}
	if err := serveHTTP(ctx, r, cfg.HTTPAddr, api, log); err != nil {
		return err
	}

	err = r.Run(ctx)
	s, rs := stats(), r.Relay().Stats()
	var ws webhook.Stats
	if api.receiver != nil {
		ws = api.receiver.Stats()
	}
	// processed: records whose effects this process committed;
	// duplicates: deliveries the inbox turned into no-ops; events_published:
	// outbox rows this process's relay published (events, and orders from
	// the HTTP routes); webhooks_*: POST /webhooks/orders stored, found
	// already stored, refused. The demo and the tests read this line.
	log.Info("orderworker stopped", "processed", s.Processed, "duplicates", s.Duplicates,
		"dead_lettered", s.DeadLettered, "retries", s.Retries, "offset_commits", s.OffsetCommits,
		"events_published", rs.Published, "webhooks_stored", ws.Stored, "webhooks_duplicates", ws.Duplicates,
		"webhooks_refused", ws.Refused)
	return err
}

// httpConns are the pool connections kept for the HTTP routes.
const httpConns = 2

// serveHTTP listens on addr (port 0 picks a free port; the chosen address
// is logged) and hands the server to r, which serves it from the start and
// stops it first on the way out. Routes: GET /healthz (readiness, as
// /readyz), the runner's GET /livez, /readyz and /metrics, and the order
// routes of api, which answer 503 until the runner started.
func serveHTTP(ctx context.Context, r *oncely.Runner, addr string, api *httpAPI, log *slog.Logger) error {
	ln, err := new(net.ListenConfig).Listen(ctx, "tcp", addr)
	if err != nil {
		return fmt.Errorf("orderworker: --http-addr: %w", err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /healthz", http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if err := r.Ready(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		_, _ = fmt.Fprintln(w, "ok")
	}))
	mux.Handle("/", r.Handler())
	api.register(mux, r.Started)
	log.Info("orderworker http listening", "addr", ln.Addr().String())
	return r.AddServer(&http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}, ln)
}

// startKfake starts an in-process Kafka (kfake speaks the real wire
// protocol) with the topic, its dead-letter topic and the events topic
// created. Its group minimum session timeout is lowered from kfake's 6s so
// that short --session-timeout values work.
func startKfake(topic, eventsTopic string) (*kfake.Cluster, error) {
	c, err := kfake.NewCluster(
		kfake.NumBrokers(1),
		kfake.SeedTopics(4, topic, dlq.DefaultTopic(topic), eventsTopic),
		kfake.GroupMinSessionTimeout(time.Second),
	)
	if err != nil {
		return nil, fmt.Errorf("orderworker: start kfake: %w", err)
	}
	return c, nil
}
