package consumer

import (
	"context"
	"fmt"
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/oncely/oncely/internal/pending"
	"github.com/oncely/oncely/internal/ratelog"
)

// fakeNotify is a waker's statement that records what it sent and how
// many statements ran at once.
type fakeNotify struct {
	inFlight, maxInFlight, statements atomic.Int64

	mu     sync.Mutex
	sent   map[string]int // channel -> statements that carried it
	starts []time.Time    // each statement's start
}

func (f *fakeNotify) notify(_ context.Context, channels []string) error {
	n := f.inFlight.Add(1)
	defer f.inFlight.Add(-1)
	for {
		m := f.maxInFlight.Load()
		if n <= m || f.maxInFlight.CompareAndSwap(m, n) {
			break
		}
	}
	f.statements.Add(1)
	for range 10 { // a statement's round trip, during which more is owed
		runtime.Gosched()
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, ch := range channels {
		f.sent[ch]++
	}
	return nil
}

func (f *fakeNotify) started(at time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.starts = append(f.starts, at)
}

func (f *fakeNotify) wasSent(ch string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.sent[ch] > 0
}

// Many committed transactions owe wake-ups at once, each then waiting for
// the waker as a stopping owner does: every channel is sent, by one
// statement at a time, each waiter finds its own wake-up sent when its wait
// returns, the wake-ups owed during a statement and the pause after it
// (wakeLinger) share the next one, and the sender exits once nothing is
// owed.
func TestWakerConcurrentOwesAllSentOneSenderAtATime(t *testing.T) {
	f := &fakeNotify{sent: map[string]int{}}
	w := &waker{notify: f.notify, outage: ratelog.New(slog.New(slog.DiscardHandler), 0), started: f.started}
	const owners, rounds = 50, 20
	var wg sync.WaitGroup
	for i := range owners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range rounds {
				var wakes pending.Wakes
				own := fmt.Sprintf("ch-%d-%d", i, r)
				wakes.Add(own)
				wakes.Add("shared")
				w.owe(&wakes)
				w.wait(t.Context())
				if !f.wasSent(own) {
					t.Errorf("wait returned before %s, owed before it, was sent", own)
					return
				}
			}
		}()
	}
	wg.Wait()
	w.wait(t.Context())

	for i := range owners {
		for r := range rounds {
			if ch := fmt.Sprintf("ch-%d-%d", i, r); !f.wasSent(ch) {
				t.Errorf("%s never sent", ch)
			}
		}
	}
	if m := f.maxInFlight.Load(); m != 1 {
		t.Errorf("%d statements ran at once, want 1", m)
	}
	if n := f.statements.Load(); n > owners*rounds {
		t.Errorf("%d statements for %d owed wake-ups", n, owners*rounds)
	}
	for i := 1; i < len(f.starts); i++ { // as the sender read its clock: its pause is a lower bound
		if gap := f.starts[i].Sub(f.starts[i-1]); gap < wakeLinger {
			t.Errorf("statements %d and %d started %s apart, less than wakeLinger (%s)", i-1, i, gap, wakeLinger)
		}
	}
	if f.sent["shared"] != int(f.statements.Load()) {
		t.Errorf("the channel owed by every transaction went out in %d of %d statements", f.sent["shared"], f.statements.Load())
	}
	w.mu.Lock()
	sending, owed := w.sending, len(w.owed.Channels())
	w.mu.Unlock()
	if sending || owed != 0 || f.inFlight.Load() != 0 {
		t.Errorf("after the last wait: sender running %v, %d channels owed, %d statements in flight", sending, owed, f.inFlight.Load())
	}
	t.Logf("%d wake-ups owed, %d statements", owners*rounds, f.statements.Load())
}

// A waker that owes nothing has no sender to wait for; a transaction that
// enqueued nothing owes nothing and starts none.
func TestWakerIdle(t *testing.T) {
	f := &fakeNotify{sent: map[string]int{}}
	w := &waker{notify: f.notify, outage: ratelog.New(slog.New(slog.DiscardHandler), 0)}
	w.wait(t.Context())
	w.owe(&pending.Wakes{})
	w.mu.Lock()
	sending := w.sending
	w.mu.Unlock()
	if sending || f.statements.Load() != 0 {
		t.Fatalf("sender running %v, %d statements; want none", sending, f.statements.Load())
	}
}
