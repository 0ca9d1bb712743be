// Package brokersource holds what the broker adapters that run the
// consumer's record path (natsconsumer, rabbitconsumer) do alike around it:
// publishing a dead letter until the broker confirms it, and stopping with
// the messages in progress finished or abandoned.
package brokersource

import (
	"context"
	"errors"
	"sync"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/internal/backoff"
	"github.com/oncely/oncely/internal/ratelog"
	"github.com/oncely/oncely/internal/telemetry"
)

// PublishTimeout bounds one try of a dead-letter publish.
const PublishTimeout = 10 * time.Second

// Retrier publishes a dead letter again and again until the broker
// confirms it: the message waits meanwhile, never dropped.
type Retrier struct {
	Backoff backoff.Policy
	// Outage writes the warning of a failed try, at most one a minute.
	Outage *ratelog.Limiter
}

// Publish runs publish, each try bounded by PublishTimeout, until it
// succeeds (true). After a failure it warns (msg, args, the delay and the
// error) and waits a backoff with pause; it reports false when ctx ends
// (the failure is recorded on ctx's span, the dead-letter send span) or
// pause reports false (the source stopped).
func (r Retrier) Publish(ctx context.Context, pause func(time.Duration) bool, publish func(context.Context) error,
	msg string, args ...any) bool {
	for n := 1; ; n++ {
		pctx, cancel := context.WithTimeout(ctx, PublishTimeout)
		err := publish(pctx)
		cancel()
		if err == nil {
			return true
		}
		if ctx.Err() != nil {
			telemetry.Fail(trace.SpanFromContext(ctx), err, "publish")
			return false
		}
		delay := r.Backoff.Delay(n)
		r.Outage.Warn(ctx, msg, append(args[:len(args):len(args)], "delay", delay, "err", err)...)
		if !pause(delay) {
			return false
		}
	}
}

// Drain waits for the messages in progress (inFlight) for at most timeout;
// then it abandons them (abandon ends their attempts: the transactions roll
// back and the broker delivers them again) and waits for them to end.
func Drain(inFlight *sync.WaitGroup, timeout time.Duration, abandon func()) {
	done := make(chan struct{})
	go func() { inFlight.Wait(); close(done) }()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		abandon()
		<-done
	}
}

// StopError is the error Run returns: the cause with which run (Run's own
// context, derived from ctx) ended, unless it ended with ctx (a stop asked
// for: nil).
func StopError(ctx, run context.Context) error {
	if err := context.Cause(run); err != nil && !errors.Is(err, context.Cause(ctx)) {
		return err
	}
	return nil
}
