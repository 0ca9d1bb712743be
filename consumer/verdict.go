package consumer

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"

	"github.com/oncely/oncely/dlq"
)

// DefaultMaxAttempts is Config.MaxAttempts when it is zero.
const DefaultMaxAttempts = 10

// Action is what the consumer does with a record after one attempt of its
// Handler.
type Action int

const (
	// Processed: the transaction commits and the record is done.
	Processed Action = iota
	// Retry: the record's or the handler's failure. It spends an attempt,
	// and the record runs again after a backoff.
	Retry
	// RetryContended: the transaction lost to another one (deadlock,
	// serialization failure, lock timeout). It runs again soon, spends no
	// attempt and is never dead-lettered for it.
	RetryContended
	// WaitDatabase: the database is unreachable. The record runs again,
	// without limit and without spending an attempt, once it is back.
	WaitDatabase
	// DeadLetter: the record goes to the dead-letter topic, with the
	// Verdict's Class.
	DeadLetter
)

func (a Action) String() string {
	switch a {
	case Processed:
		return "processed"
	case Retry:
		return "retry"
	case RetryContended:
		return "retry (contention)"
	case WaitDatabase:
		return "wait for the database"
	case DeadLetter:
		return "dead-letter"
	}
	return "unknown action"
}

// Verdict is the consumer's decision on an attempt.
type Verdict struct {
	Action Action
	Class  dlq.Class // the dead-letter class, when Action is DeadLetter
}

func (v Verdict) String() string {
	if v.Action == DeadLetter {
		return "dead-letter (" + string(v.Class) + ")"
	}
	return v.Action.String()
}

// Decide returns what the consumer does when a Handler, run in ctx on tx,
// returned err on the attempt-th attempt (from 1) of a record, with
// Config.MaxAttempts maxAttempts (0 means DefaultMaxAttempts). It is the
// record path's own decision, for tests (package oncelytest) and tools that
// want it without running a consumer: nil is Processed (COMMIT may still
// fail, e.g. on a deferred constraint, which is the record's failure too);
// a dlq.Permanent or dlq.Undecodable error, or a failure on the last
// attempt, is DeadLetter; contention and an unreachable database retry
// without spending the attempt.
func Decide(ctx context.Context, tx pgx.Tx, err error, attempt, maxAttempts int) Verdict {
	switch {
	case err == nil:
		return Verdict{Action: Processed}
	case isContention(err):
		return Verdict{Action: RetryContended}
	case handlerDatabaseFailed(ctx, err, tx):
		return Verdict{Action: WaitDatabase}
	}
	if maxAttempts <= 0 {
		maxAttempts = DefaultMaxAttempts
	}
	if class, ok := deadLetterClass(err, attempt, maxAttempts); ok {
		return Verdict{Action: DeadLetter, Class: class}
	}
	return Verdict{Action: Retry}
}

// deadLetterClass reports whether a record whose attempt failed with err
// (its own or its handler's failure) is dead-lettered now, after attempts
// spent attempts of maxAttempts, and with which class: at once when err is
// permanent, else when the attempts are spent (ClassPanic when the last one
// panicked).
func deadLetterClass(err error, attempts, maxAttempts int) (dlq.Class, bool) {
	if class, ok := dlq.PermanentClass(err); ok {
		return class, true
	}
	if attempts < maxAttempts {
		return "", false
	}
	if _, panicked := errors.AsType[*PanicError](err); panicked {
		return dlq.ClassPanic, true
	}
	return dlq.ClassMaxAttempts, true
}
