package oncelytest_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/oncelytest"
)

// A handler's test: the message's outcome, as the consumer would see it.
// In a test, pass its *testing.T where this example passes t.
func ExampleRun() {
	t := newExampleT()
	defer t.finish()

	db := oncelytest.Schema(t, os.Getenv("DATABASE_URL"))
	if _, err := db.Pool.Exec(context.Background(), `CREATE TABLE orders (id text PRIMARY KEY)`); err != nil {
		panic(err)
	}
	handler := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if len(m.Key) == 0 {
			return dlq.Permanent(errors.New("an order without an id"))
		}
		_, err := tx.Exec(ctx, `INSERT INTO orders (id) VALUES ($1)`, string(m.Key))
		return err
	}

	out := oncelytest.Run(t, db.Pool, handler, oncelytest.NewMessage("orders", []byte("o-1"), nil))
	fmt.Println(out.Processed())

	out = oncelytest.Run(t, db.Pool, handler, oncelytest.NewMessage("orders", nil, nil))
	fmt.Println(out.DeadLettered(dlq.ClassPermanent), out)
	// Output:
	// true
	// true dead-letter (permanent): an order without an id
}

// An end-to-end test of a worker: a broker and a schema of the test's own,
// a record produced, the consumer run until it has processed it.
func ExampleStartKafka() {
	t := newExampleT()
	defer t.finish()

	db := oncelytest.Schema(t, os.Getenv("DATABASE_URL"))
	k := oncelytest.StartKafka(t, "orders", dlq.DefaultTopic("orders"))
	k.Produce(t, oncelytest.NewMessage("orders", []byte("o-1"), []byte("{}")).Record)

	done := make(chan string, 1)
	c, err := consumer.New(consumer.Config{Brokers: k.Brokers, Topics: []string{"orders"}, Group: "orders",
		Pool: db.Pool, Schema: db.Schema,
		Handler: func(_ context.Context, _ pgx.Tx, m *consumer.Message) error {
			done <- string(m.Key)
			return nil
		}})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan error, 1)
	go func() { stopped <- c.Run(ctx) }()
	fmt.Println("handled", <-done)
	cancel()
	fmt.Println("stopped:", <-stopped)
	// Output:
	// handled o-1
	// stopped: <nil>
}

// exampleT stands in for a test's *testing.T in the examples, which have
// none: it runs the cleanups at finish and panics on a failure.
type exampleT struct {
	testing.TB
	cleanups []func()
}

func newExampleT() *exampleT { return &exampleT{} }

func (t *exampleT) Helper()                           {}
func (t *exampleT) Context() context.Context          { return context.Background() }
func (t *exampleT) Cleanup(f func())                  { t.cleanups = append(t.cleanups, f) }
func (t *exampleT) Errorf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }
func (t *exampleT) Fatalf(format string, args ...any) { panic(fmt.Sprintf(format, args...)) }

func (t *exampleT) finish() {
	for i := len(t.cleanups) - 1; i >= 0; i-- {
		t.cleanups[i]()
	}
}
