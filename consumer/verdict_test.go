package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/pgtest"
)

// Decide gives the record path's verdict for every kind of failure: the
// handler's own errors spend attempts up to MaxAttempts, permanent ones
// dead-letter at once with their class, a panic on the last attempt is
// class panic, and contention and a database that went away never spend
// an attempt.
func TestDecide(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	flaky := errors.New("flaky")
	panicked := &consumer.PanicError{Value: "boom"}
	retry := consumer.Verdict{Action: consumer.Retry}
	dead := func(c dlq.Class) consumer.Verdict { return consumer.Verdict{Action: consumer.DeadLetter, Class: c} }
	for _, tc := range []struct {
		err          error
		attempt, max int
		want         consumer.Verdict
	}{
		{nil, 1, 3, consumer.Verdict{Action: consumer.Processed}},
		{flaky, 1, 3, retry},
		{flaky, 2, 3, retry},
		{flaky, 3, 3, dead(dlq.ClassMaxAttempts)},
		{fmt.Errorf("wrapped: %w", flaky), 5, 3, dead(dlq.ClassMaxAttempts)},
		{flaky, 9, 0, retry},                       // 0 is DefaultMaxAttempts
		{flaky, 10, 0, dead(dlq.ClassMaxAttempts)}, // the default's last attempt
		{panicked, 1, 3, retry},                    // a panic is retried like an error
		{panicked, 3, 3, dead(dlq.ClassPanic)},     // and is the class when it is the last
		{dlq.Permanent(flaky), 1, 3, dead(dlq.ClassPermanent)},
		{fmt.Errorf("decode: %w", dlq.Undecodable(flaky)), 1, 3, dead(dlq.ClassUndecodable)},
		{&pgconn.PgError{Code: "23505"}, 1, 3, retry}, // a constraint: the record's doing
		{&pgconn.PgError{Code: "40P01"}, 3, 3, consumer.Verdict{Action: consumer.RetryContended}},
		{&pgconn.PgError{Code: "40001"}, 3, 3, consumer.Verdict{Action: consumer.RetryContended}},
		{&pgconn.PgError{Code: "57P01"}, 3, 3, consumer.Verdict{Action: consumer.WaitDatabase}},
		{context.DeadlineExceeded, 3, 3, dead(dlq.ClassMaxAttempts)}, // the handler's own deadline
	} {
		if got := consumer.Decide(ctx, tx, tc.err, tc.attempt, tc.max); got != tc.want {
			t.Errorf("Decide(%v, attempt %d of %d) = %v, want %v", tc.err, tc.attempt, tc.max, got, tc.want)
		}
	}
}
