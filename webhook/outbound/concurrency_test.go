package outbound

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/oncely/oncely/internal/pgtest"
)

// TestTwoDispatchersNeverDeliverAnAttemptTwice runs two dispatchers, each
// with its own connection pool (two replicas), over the same deliveries to
// three endpoints that fail a third of the time. Every (webhook-id, attempt)
// reaches an endpoint exactly once, no two attempts of one delivery are ever
// in flight together, attempts are numbered 1..n without gaps,
// each delivery got exactly one 2xx, and the stored attempt count equals the
// requests received.
func TestTwoDispatchersNeverDeliverAnAttemptTwice(t *testing.T) {
	t.Parallel()
	e := setup(t)
	answer := func(_ request, w http.ResponseWriter, _ *http.Request) {
		time.Sleep(time.Duration(rand.IntN(3)) * time.Millisecond) // the endpoint's latency, not synchronisation
		if rand.IntN(3) == 0 {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusOK)
	}
	eps := []*endpoint{newEndpoint(t, answer), newEndpoint(t, answer), newEndpoint(t, answer)}
	for _, ep := range eps {
		e.subscribe(t, Subscription{URL: ep.URL()})
	}
	const n = 40 // events; each goes to all three endpoints
	cfg := e.fastConfig()
	cfg.Workers, cfg.MaxInFlightPerEndpoint, cfg.MaxAttempts = 6, 4, 50
	cfg.RetryBaseDelay, cfg.RetryMaxDelay = 2*time.Millisecond, 10*time.Millisecond
	a := newDispatcher(t, cfg)
	cfg.Pool = e.secondPool(t)
	b := newDispatcher(t, cfg)
	enq := e.enqueue(t, events("ev", "t", n)...)
	stopA, stopB := run(t, a), run(t, b)
	pgtest.WaitFor(t, e.ctx, "every delivery", func() bool { return e.count(t, "status = 'delivered'") == 3*n })
	stopA() // counters are final once Run returned
	stopB()

	seen := map[string]int{}
	var total int
	for _, ep := range eps {
		for _, r := range ep.requests() {
			seen[fmt.Sprintf("%s#%d", r.webhookID, r.attempt)]++
			total++
		}
	}
	for k, c := range seen {
		if c != 1 {
			t.Errorf("attempt %s delivered %d times", k, c)
		}
	}
	for i, ep := range eps {
		ep.mu.Lock()
		if ep.overlaps != 0 {
			t.Errorf("endpoint %d: %d requests arrived while another attempt of the same delivery was in flight", i, ep.overlaps)
		}
		ep.mu.Unlock()
	}
	var sumAttempts int
	for _, q := range enq {
		d := e.delivery(t, q.WebhookID)
		sumAttempts += d.Attempts
		for k := 1; k <= d.Attempts; k++ {
			if seen[fmt.Sprintf("%s#%d", q.WebhookID, k)] != 1 {
				t.Errorf("%s: attempt %d of %d never arrived", q.WebhookID, k, d.Attempts)
			}
		}
	}
	if sumAttempts != total {
		t.Errorf("stored attempts %d, requests received %d", sumAttempts, total)
	}
	sa, sb := a.Stats(), b.Stats()
	if sa.Claimed == 0 || sb.Claimed == 0 || sa.Claimed+sb.Claimed != int64(total) {
		t.Errorf("claims: %d + %d, want both non-zero and summing to %d requests", sa.Claimed, sb.Claimed, total)
	}
	if sa.Delivered+sb.Delivered != 3*n {
		t.Errorf("delivered: %d + %d, want %d", sa.Delivered, sb.Delivered, 3*n)
	}
	t.Logf("%d deliveries, %d requests (%d retries); dispatcher A claimed %d, B %d",
		3*n, total, total-3*n, sa.Claimed, sb.Claimed)
}

// TestCrashMidDeliveryRetriesWithSameWebhookID: dispatcher A claims an
// attempt and "dies" while the endpoint is still handling it (the request is
// cut, nothing is recorded, A's connection pool is closed). Once A's lease
// expires, dispatcher B (another pool) makes the delivery due again and
// delivers attempt 2 with the same webhook-id, which is what lets the
// receiver deduplicate.
func TestCrashMidDeliveryRetriesWithSameWebhookID(t *testing.T) {
	t.Parallel()
	e := setup(t)
	gotFirst := make(chan struct{})
	ep := newEndpoint(t, func(r request, w http.ResponseWriter, req *http.Request) {
		if r.attempt == 1 {
			close(gotFirst)
			<-req.Context().Done() // hangs until the client goes away
			return
		}
		w.WriteHeader(http.StatusOK)
	})
	e.subscribe(t, Subscription{URL: ep.URL()})
	enq := e.enqueue(t, Event{ID: "crash", Type: "t", Payload: []byte(`{"x":1}`)})[0]

	cfg := e.fastConfig()
	cfg.RequestTimeout, cfg.LeaseDuration = time.Second, 1200*time.Millisecond
	cfg.DrainTimeout = time.Millisecond // cut the request at once when A stops
	poolA := e.secondPool(t)
	cfg.Pool = poolA
	a := newDispatcher(t, cfg)
	var crashed atomic.Bool
	a.hooks = &testHooks{abandon: func(string, int) bool { return crashed.Load() }}
	stopA := run(t, a)
	select {
	case <-gotFirst:
	case <-e.ctx.Done():
		t.Fatal("attempt 1 never arrived")
	}
	crashed.Store(true)
	stopA()
	poolA.Close() // its sessions end, as a killed process's would
	d := e.delivery(t, enq.WebhookID)
	if d.Status != StatusDelivering || d.Attempts != 1 {
		t.Fatalf("after the crash: %+v, want still delivering (leased) with 1 attempt", d)
	}

	cfg.Pool = e.db.Pool
	cfg.DrainTimeout = 0
	b := newDispatcher(t, cfg)
	stopB := run(t, b)
	pgtest.WaitFor(t, e.ctx, "the retry", func() bool { return e.delivery(t, enq.WebhookID).Status == StatusDelivered })
	stopB()
	rs := ep.requests()
	if len(rs) != 2 || rs[0].webhookID != enq.WebhookID || rs[1].webhookID != enq.WebhookID ||
		rs[0].attempt != 1 || rs[1].attempt != 2 {
		t.Fatalf("requests %v, want attempts 1 and 2 of %s", summary(rs), enq.WebhookID)
	}
	if rs[0].timestamp == "" || rs[1].signature == "" {
		t.Error("missing Standard Webhooks headers")
	}
	d = e.delivery(t, enq.WebhookID)
	if d.Attempts != 2 || d.LastStatus != 200 {
		t.Errorf("after the retry: %+v", d)
	}
	if st := b.Stats(); st.Reaped != 1 || st.Delivered != 1 {
		t.Errorf("B's stats %+v, want 1 reaped lease and 1 delivery", st)
	}
	if st := a.Stats(); st.Delivered+st.Retried+st.Dead != 0 {
		t.Errorf("A recorded outcomes after its crash: %+v", st)
	}
}

func summary(rs []request) []string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = fmt.Sprintf("%s#%d", r.webhookID, r.attempt)
	}
	return out
}
