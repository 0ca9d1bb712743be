package oncelytest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"runtime/debug"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
)

// Outcome is what the consumer would do after one attempt of a handler on
// a message.
type Outcome struct {
	consumer.Verdict
	// Err is the attempt's failure: what the handler returned (a
	// *consumer.PanicError when it panicked), or the deferred constraint
	// that COMMIT would have refused. Nil when Processed.
	Err error
}

// Processed reports whether the attempt succeeded: the consumer commits.
func (o Outcome) Processed() bool { return o.Action == consumer.Processed }

// Retried reports whether the consumer runs the message again: after a
// failure of its own (spending an attempt), after losing to another
// transaction, or once the database is back.
func (o Outcome) Retried() bool {
	switch o.Action {
	case consumer.Retry, consumer.RetryContended, consumer.WaitDatabase:
		return true
	}
	return false
}

// DeadLettered reports whether the consumer dead-letters the message with
// class.
func (o Outcome) DeadLettered(class dlq.Class) bool {
	return o.Action == consumer.DeadLetter && o.Class == class
}

func (o Outcome) String() string {
	if o.Err == nil {
		return o.Verdict.String()
	}
	return fmt.Sprintf("%v: %v", o.Verdict, o.Err)
}

// Options adjust RunWith.
type Options struct {
	// MaxAttempts is the consumer's Config.MaxAttempts; 0 is its default.
	// The attempt Run makes is the message's Attempt (0 counts as 1).
	MaxAttempts int
	// Inspect, when set, runs after a handler that succeeded, in the same
	// transaction before it is rolled back: the place to look at the
	// handler's writes. An error from it fails the test.
	Inspect func(ctx context.Context, tx pgx.Tx) error
}

// Run runs handler on msg once, as the consumer's record path would, in a
// transaction on pool that is always rolled back, and returns what the
// consumer would do next. A panic in the handler is an attempt that failed
// with a *consumer.PanicError, as in the consumer. When the handler
// succeeds, deferred constraints are checked (SET CONSTRAINTS ALL
// IMMEDIATE), so that a violation COMMIT would meet is the outcome too.
// Run fails the test only when the transaction cannot be begun.
func Run(tb testing.TB, pool *pgxpool.Pool, handler consumer.Handler, msg *consumer.Message) Outcome {
	tb.Helper()
	return RunWith(tb, pool, handler, msg, Options{})
}

// RunWith is Run with options.
func RunWith(tb testing.TB, pool *pgxpool.Pool, handler consumer.Handler, msg *consumer.Message, opts Options) Outcome {
	tb.Helper()
	ctx := tb.Context()
	tx, err := pool.Begin(ctx)
	if err != nil {
		tb.Fatalf("oncelytest: begin: %v", err)
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		_ = tx.Rollback(rctx)
	}()
	err = callHandler(ctx, handler, tx, msg)
	if err == nil {
		if _, cerr := tx.Exec(ctx, "SET CONSTRAINTS ALL IMMEDIATE"); cerr != nil {
			err = fmt.Errorf("oncelytest: deferred constraints (COMMIT would fail): %w", cerr)
		}
	}
	if err == nil && opts.Inspect != nil {
		if ierr := opts.Inspect(ctx, tx); ierr != nil {
			tb.Fatalf("oncelytest: inspect: %v", ierr)
		}
	}
	return Outcome{Verdict: consumer.Decide(ctx, tx, err, max(msg.Attempt, 1), opts.MaxAttempts), Err: err}
}

// callHandler runs h, turning a panic into the consumer's PanicError.
func callHandler(ctx context.Context, h consumer.Handler, tx pgx.Tx, msg *consumer.Message) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &consumer.PanicError{Value: v, Stack: debug.Stack()}
		}
	}()
	return h(ctx, tx, msg)
}

// NewMessage returns a message as the consumer hands it to a handler, on
// the first attempt: a unique ID, also in the message-id header (the
// consumer's default MessageIDHeader), partition 0, offset 0, the current
// time, and a Record with the same fields. Set other fields as needed;
// Record keeps the values it was made with.
func NewMessage(topic string, key, value []byte) *consumer.Message {
	var b [8]byte
	_, _ = rand.Read(b[:])
	id := "oncelytest-" + hex.EncodeToString(b[:])
	rec := &kgo.Record{
		Topic: topic, Key: key, Value: value, Timestamp: time.Now(),
		Headers: []kgo.RecordHeader{{Key: consumer.DefaultMessageIDHeader, Value: []byte(id)}},
	}
	return &consumer.Message{
		ID: id, Topic: topic, Key: key, Value: value, Headers: rec.Headers, Timestamp: rec.Timestamp,
		Attempt: 1, Record: rec,
	}
}
