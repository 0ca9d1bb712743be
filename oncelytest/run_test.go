package oncelytest_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely"
	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/oncelytest"
	"github.com/oncely/oncely/outbox"
)

// paymentsDB is a schema with a payments table whose id is unique at
// COMMIT (a deferred constraint).
func paymentsDB(t *testing.T) *oncelytest.DB {
	t.Helper()
	db := oncelytest.Schema(t, "")
	if _, err := db.Pool.Exec(t.Context(), `CREATE TABLE payments (
		id text UNIQUE DEFERRABLE INITIALLY DEFERRED, amount int NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return db
}

// pay inserts the payment the message names (its key), for its value in
// cents; "poison" is permanent, "flaky" transient, "panic" panics.
func pay(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
	switch string(m.Value) {
	case "poison":
		return dlq.Permanent(errors.New("not a payment"))
	case "flaky":
		return errors.New("the payment provider timed out")
	case "panic":
		panic("nil payment")
	}
	_, err := tx.Exec(ctx, `INSERT INTO payments (id, amount) VALUES ($1, $2::text::int)`, string(m.Key), string(m.Value))
	return err
}

func countPayments(t *testing.T, db *oncelytest.DB) int {
	t.Helper()
	var n int
	if err := db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM payments`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// A handler that succeeds is processed; Inspect sees its write inside the
// transaction, and the rollback leaves nothing behind.
func TestRunProcessed(t *testing.T) {
	t.Parallel()
	db := paymentsDB(t)
	var seen int
	out := oncelytest.RunWith(t, db.Pool, pay, oncelytest.NewMessage("payments", []byte("p1"), []byte("250")), oncelytest.Options{
		Inspect: func(ctx context.Context, tx pgx.Tx) error {
			return tx.QueryRow(ctx, `SELECT amount FROM payments WHERE id = 'p1'`).Scan(&seen)
		},
	})
	if !out.Processed() || out.Retried() || out.Err != nil {
		t.Fatalf("outcome %v, want processed", out)
	}
	if seen != 250 {
		t.Fatalf("Inspect saw amount %d, want 250", seen)
	}
	if n := countPayments(t, db); n != 0 {
		t.Fatalf("%d payments after Run, want 0: the transaction is rolled back", n)
	}
}

// Each failure gets the consumer's verdict: a transient error is retried
// until the last attempt, which dead-letters it as max_attempts; a
// permanent error and an undecodable record dead-letter at once; a panic
// is retried, and is the class on the last attempt.
func TestRunFailures(t *testing.T) {
	t.Parallel()
	db := paymentsDB(t)
	run := func(value string, attempt, maxAttempts int) oncelytest.Outcome {
		m := oncelytest.NewMessage("payments", []byte("p"), []byte(value))
		m.Attempt = attempt
		return oncelytest.RunWith(t, db.Pool, pay, m, oncelytest.Options{MaxAttempts: maxAttempts})
	}
	if out := run("flaky", 1, 3); !out.Retried() || out.Action != consumer.Retry || out.Err == nil {
		t.Errorf("flaky, attempt 1 of 3: %v, want retried", out)
	}
	if out := run("flaky", 3, 3); !out.DeadLettered(dlq.ClassMaxAttempts) {
		t.Errorf("flaky, attempt 3 of 3: %v, want dead-lettered as max_attempts", out)
	}
	if out := run("flaky", 9, 0); !out.Retried() {
		t.Errorf("flaky, attempt 9 of the default: %v, want retried", out)
	}
	if out := run("poison", 1, 3); !out.DeadLettered(dlq.ClassPermanent) || out.Retried() {
		t.Errorf("poison: %v, want dead-lettered as permanent", out)
	}
	if out := run("panic", 1, 3); !out.Retried() || !errors.As(out.Err, new(*consumer.PanicError)) {
		t.Errorf("panic, attempt 1 of 3: %v, want retried with a PanicError", out)
	}
	if out := run("panic", 3, 3); !out.DeadLettered(dlq.ClassPanic) {
		t.Errorf("panic, attempt 3 of 3: %v, want dead-lettered as panic", out)
	}
	undecodable := func(context.Context, pgx.Tx, *consumer.Message) error {
		return dlq.Undecodable(errors.New("not JSON"))
	}
	if out := oncelytest.Run(t, db.Pool, undecodable, oncelytest.NewMessage("payments", nil, []byte("{"))); !out.DeadLettered(dlq.ClassUndecodable) {
		t.Errorf("undecodable: %v, want dead-lettered as undecodable", out)
	}
}

// A violation that only COMMIT would meet (a deferred unique constraint)
// is the attempt's failure, as in the consumer: retried, attempt spent.
func TestRunDeferredConstraint(t *testing.T) {
	t.Parallel()
	db := paymentsDB(t)
	twice := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := pay(ctx, tx, m); err != nil {
			return err
		}
		return pay(ctx, tx, m)
	}
	out := oncelytest.Run(t, db.Pool, twice, oncelytest.NewMessage("payments", []byte("p1"), []byte("1")))
	var pgErr *pgconn.PgError
	if out.Action != consumer.Retry || !errors.As(out.Err, &pgErr) || pgErr.Code != "23505" {
		t.Fatalf("outcome %v, want a retry for the unique violation (23505)", out)
	}
}

// A handler that loses a lock to another transaction (lock timeout,
// 55P03) is retried without spending an attempt, even on its last one.
func TestRunContention(t *testing.T) {
	t.Parallel()
	db := paymentsDB(t)
	ctx := t.Context()
	if _, err := db.Pool.Exec(ctx, `INSERT INTO payments VALUES ('p1', 1)`); err != nil {
		t.Fatal(err)
	}
	holder, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := holder.Exec(ctx, `SELECT 1 FROM payments WHERE id = 'p1' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	refund := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '50ms'`); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `UPDATE payments SET amount = 0 WHERE id = $1`, string(m.Key))
		return err
	}
	m := oncelytest.NewMessage("refunds", []byte("p1"), nil)
	m.Attempt = 3
	out := oncelytest.RunWith(t, db.Pool, refund, m, oncelytest.Options{MaxAttempts: 3})
	if out.Action != consumer.RetryContended || !out.Retried() {
		t.Fatalf("outcome %v, want a retry for contention", out)
	}
}

// End to end with the kit's broker and schema: a real consumer processes
// each payment once (a redelivery with the same message id is a duplicate)
// and dead-letters the poison record, which the test reads back from the
// dead-letter topic.
func TestEndToEnd(t *testing.T) {
	t.Parallel()
	db := paymentsDB(t)
	dlqTopic := dlq.DefaultTopic("payments")
	k := oncelytest.StartKafka(t, "payments", dlqTopic)
	rec := func(id, key, value string) *kgo.Record {
		return &kgo.Record{Topic: "payments", Key: []byte(key), Value: []byte(value),
			Headers: []kgo.RecordHeader{{Key: consumer.DefaultMessageIDHeader, Value: []byte(id)}}}
	}
	k.Produce(t, rec("m1", "p1", "100"), rec("m2", "p2", "poison"), rec("m1", "p1", "100"), rec("m3", "p3", "300"))

	c, err := consumer.New(consumer.Config{Brokers: k.Brokers, Topics: []string{"payments"}, Group: "payments",
		Pool: db.Pool, Schema: db.Schema, Handler: pay})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := c.Run(ctx); err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	dead := k.Consume(t, dlqTopic, 1, time.Minute)
	info, err := dlq.Decode(dead[0].Headers)
	if err != nil || info.MessageID != "m2" || info.Class != dlq.ClassPermanent {
		t.Fatalf("dead-letter record %+v, %v; want m2, permanent", info, err)
	}
	deadline := time.Now().Add(time.Minute)
	for s := c.Stats(); s.Processed+s.Duplicates < 3; s = c.Stats() {
		if time.Now().After(deadline) {
			t.Fatalf("stats %+v: the other three records not handled within a minute", s)
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	wg.Wait()
	if s := c.Stats(); s.Processed != 2 || s.Duplicates != 1 || s.DeadLettered != 1 {
		t.Errorf("stats %+v, want 2 processed, 1 duplicate, 1 dead-lettered", s)
	}
	if n := countPayments(t, db); n != 2 {
		t.Errorf("%d payments, want 2", n)
	}
}

// A runner with a relay, room for HTTP handlers and a consumer runs on
// Schema's pool (sized for it) and StartKafka's broker, and processes a
// record in the test's schema.
func TestRunnerOnSchema(t *testing.T) {
	t.Parallel()
	db := paymentsDB(t)
	k := oncelytest.StartKafka(t, "payments", dlq.DefaultTopic("payments"))
	r, err := oncely.New(oncely.Config{Pool: db.Pool, Schema: db.Schema, Brokers: k.Brokers,
		Relay: &outbox.RelayConfig{}, ExtraConns: 10})
	if err != nil {
		t.Fatalf("a runner on Schema's pool: %v", err)
	}
	if _, err := r.AddConsumer(consumer.Config{Group: "payments", Topics: []string{"payments"}, Handler: pay}); err != nil {
		t.Fatal(err)
	}
	k.Produce(t, oncelytest.NewMessage("payments", []byte("p1"), []byte("100")).Record)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	deadline := time.Now().Add(time.Minute)
	for countPayments(t, db) != 1 {
		if time.Now().After(deadline) {
			t.Fatal("the record not processed within a minute")
		}
		time.Sleep(10 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run: %v", err)
	}
}
