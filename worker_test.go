package oncely_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely"
	"github.com/oncely/oncely/internal/pgtest"
	"github.com/oncely/oncely/outbox"
)

// fakeWorker is a Worker whose readiness the test sets, which records when
// it runs and holds its return until released.
type fakeWorker struct {
	notReady atomic.Pointer[string]
	started  chan struct{}
	stopped  chan struct{} // closed when Run's context ended
	release  chan struct{} // Run returns once it is closed
	err      error         // Run's error, returned at once when set
	returned atomic.Bool   // Run returned after its release
	once     sync.Once
}

func newFakeWorker() *fakeWorker {
	return &fakeWorker{started: make(chan struct{}), stopped: make(chan struct{}), release: make(chan struct{})}
}

func (w *fakeWorker) Run(ctx context.Context) error {
	w.once.Do(func() { close(w.started) })
	if w.err != nil {
		return w.err
	}
	<-ctx.Done()
	close(w.stopped)
	<-w.release
	w.returned.Store(true)
	return nil
}

func (w *fakeWorker) NotReady() string {
	if p := w.notReady.Load(); p != nil {
		return *p
	}
	return ""
}

func (w *fakeWorker) setNotReady(why string) { w.notReady.Store(&why) }

// TestRunnerRunsWorkers: a Worker starts with the components, its NotReady
// is a reason of Ready (and /readyz), the shutdown ends its context and
// Run waits for it to return; one whose Run fails stops the runner with an
// error naming it.
func TestRunnerRunsWorkers(t *testing.T) {
	t.Parallel()
	schema, pool := newPool(t)
	r, err := oncely.New(oncely.Config{Pool: pool, Schema: schema, Migrate: true})
	if err != nil {
		t.Fatal(err)
	}
	w := newFakeWorker()
	w.setNotReady("connecting to nats://127.0.0.1:4222")
	if err := r.AddWorker("jetstream ORDERS/workers", w); err != nil {
		t.Fatal(err)
	}
	for name, bad := range map[string]oncely.Worker{"": w, "nil": nil, "jetstream ORDERS/workers": w} {
		if err := r.AddWorker(name, bad); !errors.Is(err, oncely.ErrInvalidConfig) {
			t.Errorf("AddWorker(%q, %v): %v, want ErrInvalidConfig", name, bad, err)
		}
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	<-w.started
	pgtest.Eventually(t, 30*time.Second, "the worker's reason in Ready", func() bool {
		err := r.Ready()
		return err != nil && strings.Contains(err.Error(), "jetstream ORDERS/workers: connecting to nats://127.0.0.1:4222")
	})
	w.setNotReady("")
	pgtest.Eventually(t, 30*time.Second, "the runner ready", func() bool { return r.Ready() == nil })

	cancel()
	<-w.stopped
	select {
	case err := <-done:
		t.Fatalf("Run returned (%v) before the worker did", err)
	default:
	}
	close(w.release)
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if !w.returned.Load() {
		t.Fatal("Run returned before the worker's Run did")
	}
	if err := r.AddWorker("late", newFakeWorker()); err == nil {
		t.Error("AddWorker after Run succeeded")
	}

	failing := newFakeWorker()
	failing.err = errors.New("stream ORDERS not found")
	r2, err := oncely.New(oncely.Config{Pool: pool, Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := r2.AddWorker("jetstream ORDERS/workers", failing); err != nil {
		t.Fatal(err)
	}
	if err := r2.Run(t.Context()); err == nil || !strings.Contains(err.Error(), "jetstream ORDERS/workers") || !strings.Contains(err.Error(), "stream ORDERS not found") {
		t.Fatalf("Run with a failing worker: %v, want its error, naming it", err)
	}
}

// chanPublisher is an outbox.Publisher that hands each record to a channel.
type chanPublisher chan *kgo.Record

func (chanPublisher) System() string           { return "test" }
func (chanPublisher) Refuse(*kgo.Record) error { return nil }
func (chanPublisher) Permanent(error) bool     { return false }
func (p chanPublisher) Publish(_ context.Context, recs []*kgo.Record) []error {
	for _, r := range recs {
		p <- r
	}
	return make([]error, len(recs))
}

// TestRunnerRelayToAnotherBroker: a runner whose relay has a Publisher
// (another broker's) needs no Kafka brokers, and its relay publishes what
// a transaction enqueued through it.
func TestRunnerRelayToAnotherBroker(t *testing.T) {
	t.Parallel()
	schema, pool := newPool(t)
	if _, err := oncely.New(oncely.Config{Pool: pool, Schema: schema, Relay: &outbox.RelayConfig{}}); !errors.Is(err, oncely.ErrInvalidConfig) || !strings.Contains(err.Error(), "Brokers") {
		t.Fatalf("a Kafka relay without brokers: %v, want an error naming Brokers", err)
	}
	pub := make(chanPublisher, 1)
	r, err := oncely.New(oncely.Config{Pool: pool, Schema: schema, Migrate: true, Relay: &outbox.RelayConfig{Publisher: pub}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	pgtest.Eventually(t, 30*time.Second, "the runner ready", func() bool { return r.Ready() == nil })
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := r.Outbox().Enqueue(ctx, tx, outbox.Message{ID: "evt-1", Topic: "order-events", Value: []byte("accepted")})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case rec := <-pub:
		if rec.Topic != "order-events" || string(rec.Value) != "accepted" {
			t.Errorf("published %s %q", rec.Topic, rec.Value)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the relay published nothing in 30s")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
}
