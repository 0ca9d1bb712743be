package integration_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/internal/sqlident"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/outbox"
)

// What the tests of the broker sources that run the consumer's record path
// (natsconsumer, rabbitconsumer) share.

// sourceDB is the Postgres side of a broker source's test: a migrated
// schema of its own with an effects table.
type sourceDB struct {
	t  *testing.T
	db *testenv.DB
}

func newSourceDB(t *testing.T) sourceDB {
	t.Helper()
	db := testenv.Migrated(t)
	if _, err := db.Pool.Exec(t.Context(), `CREATE TABLE effects (message_id text NOT NULL, member text NOT NULL,
		at timestamptz NOT NULL DEFAULT clock_timestamp())`); err != nil {
		t.Fatal(err)
	}
	return sourceDB{t: t, db: db}
}

// sourceEffect records one effect per handler run.
func sourceEffect(member string) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects (message_id, member) VALUES ($1, $2)`, msg.ID, member)
		return err
	}
}

// enqueueing is a handler that enqueues each message's id to the outbox
// of d's schema and records its effect, and a listener of that outbox's
// wake-ups.
func (d sourceDB) enqueueing() (consumer.Handler, *wakeListener) {
	d.t.Helper()
	ob, err := outbox.New(outbox.Config{Schema: d.db.Schema})
	if err != nil {
		d.t.Fatal(err)
	}
	return enqueueingHandler(ob, "events", sourceEffect("a")), listenForWakes(d.t, d.db)
}

func (d sourceDB) count(sql string, args ...any) int64 {
	d.t.Helper()
	var n int64
	if err := d.db.Pool.QueryRow(d.t.Context(), sql, args...).Scan(&n); err != nil {
		d.t.Fatal(err)
	}
	return n
}

// effects fails the test unless the handlers' effects number want, one per
// message id.
func (d sourceDB) effects(want int64) {
	d.t.Helper()
	if n, ids := d.count(`SELECT count(*) FROM effects`), d.count(`SELECT count(DISTINCT message_id) FROM effects`); n != want || ids != want {
		d.t.Fatalf("%d effects of %d message ids, want %d of %d", n, ids, want, want)
	}
}

// waitForBlockedClaim waits until an inbox claim waits on another
// transaction's lock.
func (d sourceDB) waitForBlockedClaim() {
	d.t.Helper()
	pattern := "INSERT INTO " + sqlident.Table(d.db.Schema, "inbox") + "%"
	testenv.Eventually(d.t, 30*time.Second, "an inbox claim to wait on another transaction", func() bool {
		return d.count(`SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1`, pattern) > 0
	})
}

// tracedProducer is a producer's span, ended, whose context a test puts in
// a message's traceparent header, and the tracer provider that records the
// consumer's spans.
type tracedProducer struct {
	tp          *sdktrace.TracerProvider
	rec         *tracetest.SpanRecorder
	span        trace.Span
	traceparent string
}

func newTracedProducer(t *testing.T) *tracedProducer {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	ctx, span := tp.Tracer("producer").Start(t.Context(), "send orders")
	carrier := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(ctx, carrier)
	span.End()
	return &tracedProducer{tp: tp, rec: rec, span: span, traceparent: carrier["traceparent"]}
}

// processSpan waits for the span named name, fails the test unless it is
// the producer span's child with the attributes want, and returns its
// attributes.
func (p *tracedProducer) processSpan(t *testing.T, name string, want map[attribute.Key]string) map[attribute.Key]string {
	t.Helper()
	var span sdktrace.ReadOnlySpan
	testenv.Eventually(t, 30*time.Second, "the span "+name, func() bool {
		for _, s := range p.rec.Ended() {
			if s.Name() == name {
				span = s
				return true
			}
		}
		return false
	})
	if parent, producer := span.Parent(), p.span.SpanContext(); parent.TraceID() != producer.TraceID() || parent.SpanID() != producer.SpanID() {
		t.Errorf("%s's parent %v, want the producer's span %v", name, parent, producer)
	}
	got := map[attribute.Key]string{}
	for _, a := range span.Attributes() {
		got[a.Key] = a.Value.String()
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("span attribute %s = %q, want %q", k, got[k], v)
		}
	}
	return got
}

// failsAtStart fails the test unless run (a consumer's Run) returns an
// error naming what within 10s.
func failsAtStart(t *testing.T, what string, run func(context.Context) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if err := run(ctx); err == nil || !strings.Contains(err.Error(), what) {
		t.Errorf("Run: %v, want an error naming %s", err, what)
	}
}
