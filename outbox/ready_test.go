package outbox_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"

	"github.com/oncely/oncely/internal/pgtest"
	"github.com/oncely/oncely/outbox"
)

// gateMeter holds the relay's gauge registration, which Run makes once it
// is running, until the test releases it.
type gateMeter struct {
	noop.Meter
	once     sync.Once
	entered  chan struct{}
	released chan struct{}
}

func (m *gateMeter) RegisterCallback(f metric.Callback, insts ...metric.Observable) (metric.Registration, error) {
	m.once.Do(func() { close(m.entered) })
	<-m.released
	return m.Meter.RegisterCallback(f, insts...)
}

type gateProvider struct {
	noop.MeterProvider
	m *gateMeter
}

func (p gateProvider) Meter(string, ...metric.MeterOption) metric.Meter { return p.m }

// A running relay is not ready before a broker answered: with a broker that
// does not answer, Ready is false from the moment Run runs.
func TestRelayNotReadyBeforeABrokerAnswered(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	m := &gateMeter{entered: make(chan struct{}), released: make(chan struct{})}
	r, err := outbox.NewRelay(outbox.RelayConfig{Pool: db.Pool, Brokers: []string{"127.0.0.1:1"}, MeterProvider: gateProvider{m: m}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Run = %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("Run did not return within 30s of its context's end")
		}
	}()
	select {
	case <-m.entered: // running, before any broker check
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not register its gauges")
	}
	ready, why := r.Ready(), r.NotReady()
	close(m.released)
	if ready {
		t.Fatalf("Ready before any broker check (NotReady %q)", why)
	}
	if why == "not publishing (starting, stopped or failed)" {
		t.Fatalf("NotReady = %q while running; want the brokers named", why)
	}
}
