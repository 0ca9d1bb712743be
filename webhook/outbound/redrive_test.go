package outbound

import (
	"context"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/oncely/oncely/internal/pgtest"
)

// TestRedrive: dead deliveries selected by subscription and time of death go
// back to pending with their attempts reset and their webhook-id unchanged,
// and are delivered; the others stay dead. A dry run changes nothing.
func TestRedrive(t *testing.T) {
	t.Parallel()
	e := setup(t)
	var gone atomic.Bool
	gone.Store(true)
	answer := func(_ request, w http.ResponseWriter, _ *http.Request) {
		if gone.Load() {
			w.WriteHeader(http.StatusGone)
			return
		}
		w.WriteHeader(http.StatusOK)
	}
	epA, epB := newEndpoint(t, answer), newEndpoint(t, answer)
	subA := e.subscribe(t, Subscription{URL: epA.URL(), EventTypes: []string{"a"}})
	subB := e.subscribe(t, Subscription{URL: epB.URL(), EventTypes: []string{"b"}})
	run(t, newDispatcher(t, e.fastConfig()))

	early := e.enqueue(t, events("early", "a", 3)...)
	pgtest.WaitFor(t, e.ctx, "the early deaths", func() bool { return e.count(t, "status = 'dead'") == 3 })
	mid := e.dbNow(t)
	late := e.enqueue(t, append(events("late", "a", 2), events("other", "b", 2)...)...)
	pgtest.WaitFor(t, e.ctx, "the late deaths", func() bool { return e.count(t, "status = 'dead'") == 7 })

	if _, err := e.store.Redrive(e.ctx, e.db.Pool, RedriveFilter{}); err == nil || !strings.Contains(err.Error(), "SubscriptionID") {
		t.Errorf("redrive without a subscription: %v, want an error naming SubscriptionID", err)
	}
	if _, err := e.store.Redrive(e.ctx, e.db.Pool, RedriveFilter{SubscriptionID: subA.ID, Since: mid, Until: mid}); err == nil {
		t.Error("redrive with an empty time range accepted")
	}

	lateA := map[string]bool{}
	for _, q := range late {
		if q.SubscriptionID == subA.ID {
			lateA[q.WebhookID] = true
		}
	}
	dry, err := e.store.Redrive(e.ctx, e.db.Pool, RedriveFilter{SubscriptionID: subA.ID, Since: mid, DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(dry) != 2 || !lateA[dry[0].WebhookID] || !lateA[dry[1].WebhookID] || dry[0].Status != StatusDead || dry[0].LastStatus != 410 {
		t.Fatalf("dry run listed %+v, want A's 2 late dead deliveries", dry)
	}
	if n := e.count(t, "status = 'dead'"); n != 7 {
		t.Fatalf("dry run changed something: %d dead, want 7", n)
	}

	gone.Store(false)
	before := len(epA.requests())
	redriven, err := e.store.Redrive(e.ctx, e.db.Pool, RedriveFilter{SubscriptionID: subA.ID, Since: mid, Until: e.dbNow(t).Add(time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	if len(redriven) != 2 {
		t.Fatalf("redrove %d, want 2", len(redriven))
	}
	for _, d := range redriven {
		if !lateA[d.WebhookID] || d.Status != StatusDead || d.Attempts != 1 || d.DeadAt.Before(mid) {
			t.Errorf("redriven (as it was): %+v", d)
		}
	}
	pgtest.WaitFor(t, e.ctx, "the redriven deliveries", func() bool { return e.count(t, "status = 'delivered'") == 2 })
	after := epA.requests()[before:]
	if len(after) != 2 {
		t.Fatalf("A got %d requests after the redrive, want 2", len(after))
	}
	for _, r := range after {
		if !lateA[r.webhookID] || r.attempt != 1 {
			t.Errorf("redriven request %s attempt %d: want a late webhook-id, attempt 1 (reset)", r.webhookID, r.attempt)
		}
	}
	for id := range lateA {
		d := e.delivery(t, id)
		if d.Status != StatusDelivered || d.Attempts != 1 || d.Redrives != 1 || !d.DeadAt.IsZero() {
			t.Errorf("after redrive: %+v", d)
		}
	}
	for _, q := range early {
		if d := e.delivery(t, q.WebhookID); d.Status != StatusDead {
			t.Errorf("early delivery %s (before the range) is %s", q.WebhookID, d.Status)
		}
	}
	if n := e.count(t, "subscription_id = $1 AND status = 'dead'", subB.ID); n != 2 {
		t.Errorf("B has %d dead deliveries, want its 2 untouched", n)
	}

	// Until alone selects the early ones; AllSubscriptions covers B.
	got, err := e.store.Redrive(e.ctx, e.db.Pool, RedriveFilter{SubscriptionID: subA.ID, Until: mid})
	if err != nil || len(got) != 3 {
		t.Fatalf("redrive until mid: %d, %v; want the 3 early ones", len(got), err)
	}
	got, err = e.store.Redrive(e.ctx, e.db.Pool, RedriveFilter{AllSubscriptions: true, Limit: 10})
	if err != nil || len(got) != 2 || got[0].SubscriptionID != subB.ID {
		t.Fatalf("redrive of all subscriptions: %d, %v; want B's 2", len(got), err)
	}
	pgtest.WaitFor(t, e.ctx, "everything delivered", func() bool { return e.count(t, "status = 'delivered'") == 7 })
}

// TestMetrics reads the dispatcher's instruments through a manual reader.
func TestMetrics(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ep := newEndpoint(t, func(r request, w http.ResponseWriter, _ *http.Request) {
		switch {
		case strings.Contains(string(r.body), "gone"):
			w.WriteHeader(http.StatusGone)
		case r.attempt == 1 && strings.Contains(string(r.body), "flaky"):
			w.WriteHeader(http.StatusServiceUnavailable)
		default:
			w.WriteHeader(http.StatusOK)
		}
	})
	sub := e.subscribe(t, Subscription{URL: ep.URL()})
	held := e.subscribe(t, Subscription{URL: ep.URL()}) // paused: its delivery stays queued
	if err := e.store.PauseSubscription(e.ctx, e.db.Pool, held.ID, ""); err != nil {
		t.Fatal(err)
	}
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	cfg := e.fastConfig()
	cfg.MeterProvider = mp
	e.enqueue(t,
		Event{ID: "ok", Type: "t", Payload: []byte(`{"k":"ok"}`)},
		Event{ID: "flaky", Type: "t", Payload: []byte(`{"k":"flaky"}`)},
		Event{ID: "gone", Type: "t", Payload: []byte(`{"k":"gone"}`)},
	)
	run(t, newDispatcher(t, cfg))
	pgtest.WaitFor(t, e.ctx, "the outcomes", func() bool {
		return e.count(t, "subscription_id = $1 AND status IN ('delivered', 'dead')", sub.ID) == 3
	})

	// Counters move right after each outcome's commit: collect until they
	// have all arrived, then check that they are exact.
	var rm metricdata.ResourceMetrics
	subAttr := attribute.String("oncely.webhook.subscription.id", sub.ID.String())
	sum := func(name string, id uuid.UUID) int64 {
		var n int64
		for _, m := range find(rm, name) {
			if s, ok := m.Data.(metricdata.Sum[int64]); ok {
				for _, dp := range s.DataPoints {
					if v, _ := dp.Attributes.Value("oncely.webhook.subscription.id"); v.AsString() == id.String() {
						n += dp.Value
					}
				}
			}
		}
		return n
	}
	requests := func() uint64 {
		var n uint64
		for _, m := range find(rm, MetricDuration) {
			for _, dp := range m.Data.(metricdata.Histogram[float64]).DataPoints {
				if dp.Attributes.HasValue(subAttr.Key) {
					n += dp.Count
				}
			}
		}
		return n
	}
	pgtest.WaitFor(t, e.ctx, "the counters", func() bool {
		if err := reader.Collect(e.ctx, &rm); err != nil {
			t.Fatal(err)
		}
		return sum(MetricDelivered, sub.ID) >= 2 && sum(MetricDead, sub.ID) >= 1 && requests() >= 4
	})
	if got := sum(MetricDelivered, sub.ID); got != 2 {
		t.Errorf("%s = %d, want 2", MetricDelivered, got)
	}
	if got := sum(MetricRetried, sub.ID); got != 1 {
		t.Errorf("%s = %d, want 1", MetricRetried, got)
	}
	if got := sum(MetricDead, sub.ID); got != 1 {
		t.Errorf("%s = %d, want 1", MetricDead, got)
	}
	if got := requests(); got != 4 {
		t.Errorf("%s counted %d requests, want 4", MetricDuration, got)
	}
	gauge := func(name string, match func(attribute.Set) bool) (int64, bool) {
		for _, m := range find(rm, name) {
			for _, dp := range m.Data.(metricdata.Gauge[int64]).DataPoints {
				if match(dp.Attributes) {
					return dp.Value, true
				}
			}
		}
		return 0, false
	}
	depth, ok := gauge(MetricQueueDepth, func(s attribute.Set) bool {
		v, _ := s.Value("oncely.webhook.subscription.id")
		st, _ := s.Value("oncely.webhook.delivery.status")
		return v.AsString() == held.ID.String() && st.AsString() == "pending"
	})
	if !ok || depth != 3 {
		t.Errorf("%s for the paused subscription = %d (found %v), want 3 pending", MetricQueueDepth, depth, ok)
	}
	state, ok := gauge(MetricBreakerState, func(s attribute.Set) bool {
		v, _ := s.Value("oncely.webhook.subscription.id")
		return v.AsString() == sub.ID.String()
	})
	if !ok || state != 0 {
		t.Errorf("%s = %d (found %v), want 0 (closed)", MetricBreakerState, state, ok)
	}
}

func find(rm metricdata.ResourceMetrics, name string) []metricdata.Metrics {
	var out []metricdata.Metrics
	for _, sm := range rm.ScopeMetrics {
		out = append(out, slices.DeleteFunc(slices.Clone(sm.Metrics), func(m metricdata.Metrics) bool { return m.Name != name })...)
	}
	return out
}
