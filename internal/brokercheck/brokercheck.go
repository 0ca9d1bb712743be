// Package brokercheck tells, for readiness probes, whether a Kafka broker
// answers: a consumer or relay with nothing to do would not notice
// otherwise.
package brokercheck

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// notYet is what State holds before any check answered.
var notYet = "no Kafka broker has answered yet"

// State says why no broker answers; it holds nil while one does.
type State struct{ why atomic.Pointer[string] }

// Unchecked sets the state to "not answered yet", for a caller that must
// not look ready before the first check.
func (s *State) Unchecked() { s.why.Store(&notYet) }

// SetDown records why no broker answers.
func (s *State) SetDown(why string) { s.why.Store(&why) }

// Up records that a broker answered.
func (s *State) Up() { s.why.Store(nil) }

// Down returns why no broker answers, and whether that is so.
func (s *State) Down() (string, bool) {
	if why := s.why.Load(); why != nil {
		return *why, true
	}
	return "", false
}

// Watch checks that a broker of cl answers, at once and then every
// interval, until ctx ends, and records the outcome in s. The change is
// logged once each way: an ERROR, naming who, when the brokers stop
// answering, an INFO when they answer again.
func Watch(ctx context.Context, cl *kgo.Client, brokers []string, interval time.Duration, s *State, log *slog.Logger, who string) {
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		pctx, cancel := context.WithTimeout(ctx, max(interval, 5*time.Second))
		err := cl.Ping(pctx)
		cancel()
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			// Logged before the state changes, so that whoever sees the
			// state can find the line.
			why := fmt.Sprintf("no Kafka broker answers (%s): %v", strings.Join(brokers, ", "), err)
			if prev := s.why.Load(); prev == nil || prev == &notYet {
				log.Error(who+" cannot reach any Kafka broker; not ready", "brokers", brokers, "err", err)
			}
			s.why.Store(&why)
		default:
			if prev := s.why.Swap(nil); prev != nil && prev != &notYet {
				log.Info(who+" reaches Kafka again", "brokers", brokers)
			}
		}
		t.Reset(interval)
	}
}
