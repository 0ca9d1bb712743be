package outbound

import (
	"bytes"
	"errors"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/oncely/oncely/internal/pgtest"
)

func TestEnqueueFanOut(t *testing.T) {
	t.Parallel()
	e := setup(t)
	all := e.subscribe(t, Subscription{URL: "https://a.example/hook"})
	orders := e.subscribe(t, Subscription{URL: "https://b.example/hook", EventTypes: []string{"order.*"}})
	paid := e.subscribe(t, Subscription{URL: "https://c.example/hook", EventTypes: []string{"invoice.paid", "order.shipped"}})
	disabled := e.subscribe(t, Subscription{URL: "https://d.example/hook", Disabled: true})
	paused := e.subscribe(t, Subscription{URL: "https://e.example/hook"})
	if err := e.store.PauseSubscription(e.ctx, e.db.Pool, paused.ID, "maintenance"); err != nil {
		t.Fatal(err)
	}
	if len(all.Secrets) != 1 || !strings.HasPrefix(all.Secrets[0], "whsec_") {
		t.Errorf("generated secrets %v, want one whsec_ secret", all.Secrets)
	}

	got := e.enqueue(t,
		Event{ID: "e1", Type: "order.created", Payload: []byte(`{}`)},
		Event{ID: "e2", Type: "invoice.paid", Payload: []byte(`{}`)},
		Event{ID: "e3", Type: "order.shipped", Payload: []byte(`{}`)},
		Event{ID: "e4", Type: "user.deleted", Payload: []byte(`{}`)},
	)
	want := map[string][]string{ // event -> subscriptions
		"e1": {all.ID.String(), orders.ID.String(), paused.ID.String()},
		"e2": {all.ID.String(), paid.ID.String(), paused.ID.String()},
		"e3": {all.ID.String(), orders.ID.String(), paid.ID.String(), paused.ID.String()},
		"e4": {all.ID.String(), paused.ID.String()},
	}
	gotBy := map[string][]string{}
	ids := map[string]bool{}
	for _, g := range got {
		gotBy[g.EventID] = append(gotBy[g.EventID], g.SubscriptionID.String())
		if ids[g.WebhookID] || !strings.HasPrefix(g.WebhookID, "msg_") {
			t.Errorf("webhook id %q repeated or malformed", g.WebhookID)
		}
		ids[g.WebhookID] = true
		if g.SubscriptionID == disabled.ID {
			t.Errorf("disabled subscription got a delivery for %s", g.EventID)
		}
	}
	for ev, subs := range want {
		if len(gotBy[ev]) != len(subs) {
			t.Errorf("event %s went to %d subscriptions %v, want %d", ev, len(gotBy[ev]), gotBy[ev], len(subs))
		}
	}

	// Enqueuing the same event again stores nothing.
	if again := e.enqueue(t, Event{ID: "e1", Type: "order.created"}); len(again) != 0 {
		t.Errorf("re-enqueue of e1 stored %d deliveries", len(again))
	}
	// A rolled-back transaction stores nothing.
	tx, err := e.db.Pool.Begin(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := e.store.Enqueue(e.ctx, tx, Event{ID: "e9", Type: "order.created"}); err != nil || len(out) != 3 {
		t.Fatalf("enqueue in tx: %v, %d stored", err, len(out))
	}
	if err := tx.Rollback(e.ctx); err != nil {
		t.Fatal(err)
	}
	if n := e.count(t, "event_id = 'e9'"); n != 0 {
		t.Errorf("rolled-back enqueue left %d rows", n)
	}
	// Bad events are refused before anything is written.
	err = pgx.BeginFunc(e.ctx, e.db.Pool, func(tx pgx.Tx) error {
		_, err := e.store.Enqueue(e.ctx, tx, Event{ID: "ok", Type: "t"}, Event{ID: "", Type: "t"})
		return err
	})
	if err == nil || !strings.Contains(err.Error(), "Event.ID") {
		t.Errorf("enqueue of an event without an id: %v", err)
	}
	// Unknown subscriptions.
	if err := e.store.ResumeSubscription(e.ctx, e.db.Pool, uuid.New()); !errors.Is(err, ErrNotFound) {
		t.Errorf("resume of an unknown subscription: %v, want ErrNotFound", err)
	}
	if _, err := e.store.GetSubscription(e.ctx, e.db.Pool, uuid.New()); !errors.Is(err, ErrNotFound) {
		t.Errorf("get of an unknown subscription: %v, want ErrNotFound", err)
	}
	// Subscription validation.
	if _, err := e.store.CreateSubscription(e.ctx, e.db.Pool, Subscription{URL: "ftp://x.example/"}); !errors.Is(err, ErrScheme) {
		t.Errorf("ftp subscription: %v, want ErrScheme", err)
	}
	if _, err := e.store.CreateSubscription(e.ctx, e.db.Pool, Subscription{URL: "https://x.example/", Secrets: []string{"hunter2"}}); err == nil ||
		!strings.Contains(err.Error(), "Subscription.Secrets") || strings.Contains(err.Error(), "hunter2") {
		t.Errorf("bad secret: %v", err)
	}
}

func TestDeliverSignedRequest(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ep := newEndpoint(t, nil)
	oldSecret, newSecret := vecSecret, func() string { s, _ := NewSecret(); return s }()
	sub := e.subscribe(t, Subscription{URL: ep.URL(), Secrets: []string{oldSecret, newSecret}})
	payload := []byte(`{"order":42,"note":"ünïcode"}`)
	enq := e.enqueue(t, Event{ID: "order-42", Type: "order.created", Payload: payload})
	if len(enq) != 1 {
		t.Fatalf("enqueued %d", len(enq))
	}
	before := time.Now().Unix()
	run(t, newDispatcher(t, e.fastConfig()))
	pgtest.WaitFor(t, e.ctx, "the delivery", func() bool { return e.delivery(t, enq[0].WebhookID).Status == StatusDelivered })

	rs := ep.requests()
	if len(rs) != 1 {
		t.Fatalf("endpoint got %d requests, want 1", len(rs))
	}
	r := rs[0]
	if r.webhookID != enq[0].WebhookID || r.attempt != 1 || r.eventType != "order.created" || !bytes.Equal(r.body, payload) {
		t.Errorf("request id=%q attempt=%d type=%q body=%q", r.webhookID, r.attempt, r.eventType, r.body)
	}
	if ct := r.header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q", ct)
	}
	ts, err := strconv.ParseInt(r.timestamp, 10, 64)
	if err != nil || ts < before-1 || ts > time.Now().Unix()+1 {
		t.Errorf("webhook-timestamp %q is not the send time in unix seconds", r.timestamp)
	}
	if n := len(strings.Fields(r.signature)); n != 2 {
		t.Errorf("webhook-signature %q holds %d signatures, want one per secret", r.signature, n)
	}
	for _, s := range []string{oldSecret, newSecret} {
		if !verifyStandardWebhooks(s, r.webhookID, r.timestamp, r.body, r.signature) {
			t.Errorf("signature does not verify with secret %.10s...", s)
		}
	}
	d := e.delivery(t, enq[0].WebhookID)
	if d.Attempts != 1 || d.LastStatus != 200 || d.LastError != "" || d.DeliveredAt.IsZero() || d.SubscriptionID != sub.ID {
		t.Errorf("delivery after success: %+v", d)
	}
}

// TestRetriesGrowWithJitter fails every delivery's first five attempts. The
// dispatcher's decision hook reports each retry delay it chose; the endpoint
// reports when each attempt arrived. Checked: every delay lies in
// [0, ceiling(k)] of its retry k; the ceilings never decrease; the delays
// are jittered (not all equal) and do grow: for every retry whose ceiling
// doubled, some delay exceeds the previous ceiling (with 20 deliveries the
// chance that none does is 2^-20); and no retry arrived before its delay
// had passed, nor much later.
func TestRetriesGrowWithJitter(t *testing.T) {
	t.Parallel()
	e := setup(t)
	const fails, n = 5, 20
	ep := newEndpoint(t, func(r request, w http.ResponseWriter, _ *http.Request) {
		if r.attempt <= fails {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	e.subscribe(t, Subscription{URL: ep.URL()})
	cfg := e.fastConfig()
	cfg.Workers, cfg.MaxInFlightPerEndpoint = 20, 20
	cfg.RetryBaseDelay, cfg.RetryMaxDelay = 40*time.Millisecond, 320*time.Millisecond
	cfg.MaxAttempts = fails + 1
	d := newDispatcher(t, cfg)
	var mu sync.Mutex
	delays := map[string][]time.Duration{} // webhook-id -> delay chosen after attempt k, at index k-1
	d.hooks = &testHooks{decided: func(id string, attempt int, dec decision) {
		if dec.status == StatusPending {
			mu.Lock()
			defer mu.Unlock()
			if len(delays[id]) != attempt-1 {
				t.Errorf("%s: decision for attempt %d after %d delays", id, attempt, len(delays[id]))
			}
			delays[id] = append(delays[id], dec.delay)
		}
	}}
	enq := e.enqueue(t, events("retry", "t", n)...)
	stop := run(t, d)
	pgtest.WaitFor(t, e.ctx, "all deliveries", func() bool { return e.count(t, "status = 'delivered'") == n })
	stop() // counters are final once Run returned

	// A sanity bound on lateness only: polling, claiming and recording take
	// time, a lot of it under -race on a loaded machine.
	const slack = 2 * time.Second
	by := byWebhookID(ep.requests())
	mu.Lock()
	defer mu.Unlock()
	maxDelay := make([]time.Duration, fails+1)
	distinct := make([]map[time.Duration]bool, fails+1)
	for _, q := range enq {
		rs, ds := by[q.WebhookID], delays[q.WebhookID]
		if len(rs) != fails+1 || len(ds) != fails {
			t.Fatalf("%s: %d requests and %d delays, want %d and %d", q.WebhookID, len(rs), len(ds), fails+1, fails)
		}
		for k := 1; k <= fails; k++ {
			if rs[k-1].attempt != k || rs[k].attempt != k+1 {
				t.Fatalf("%s: attempts %d, %d in positions %d, %d", q.WebhookID, rs[k-1].attempt, rs[k].attempt, k-1, k)
			}
			delay, ceiling := ds[k-1], d.backoff.Ceiling(k)
			if delay < 0 || delay > ceiling {
				t.Errorf("%s: delay after attempt %d is %s, outside [0, %s]", q.WebhookID, k, delay, ceiling)
			}
			if gap := rs[k].since(rs[k-1]); gap < delay || gap > delay+slack {
				t.Errorf("%s: attempt %d arrived %s after attempt %d, want within [%s, %s]", q.WebhookID, k+1, gap, k, delay, delay+slack)
			}
			maxDelay[k] = max(maxDelay[k], delay)
			if distinct[k] == nil {
				distinct[k] = map[time.Duration]bool{}
			}
			distinct[k][delay] = true
		}
	}
	for k := 1; k <= fails; k++ {
		if len(distinct[k]) < n/2 {
			t.Errorf("retry %d: only %d distinct delays among %d deliveries: not jittered", k, len(distinct[k]), n)
		}
		if k == 1 {
			continue
		}
		prev, cur := d.backoff.Ceiling(k-1), d.backoff.Ceiling(k)
		if cur < prev {
			t.Errorf("ceiling %d (%s) below ceiling %d (%s)", k, cur, k-1, prev)
		}
		if cur > prev && maxDelay[k] <= prev {
			t.Errorf("no delay after attempt %d exceeds the previous ceiling %s (largest %s): delays do not grow", k, prev, maxDelay[k])
		}
	}
	for k := 1; k <= fails; k++ {
		t.Logf("retry %d: ceiling %s, largest delay %s", k, d.backoff.Ceiling(k), maxDelay[k].Round(time.Millisecond))
	}
	if st := d.Stats(); st.Retried != n*fails || st.Delivered != n {
		t.Errorf("stats %+v, want %d retried and %d delivered", st, n*fails, n)
	}
}

// TestRetryAfter: a 429 (or 503) with Retry-After is retried no sooner than
// the header says, and no later than the cap; the other deliveries of the
// endpoint wait too. The backoff is an hour, so a prompt retry can only come
// from the header.
func TestRetryAfter(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		status    int
		header    func() string
		cap       time.Duration
		atLeast   time.Duration
		notAfter  time.Duration
		throttles bool
	}{
		{"429 seconds", 429, func() string { return "1" }, time.Hour, time.Second, 3 * time.Second, true},
		{"503 HTTP date", 503, func() string { return time.Now().Add(2 * time.Second).UTC().Format(http.TimeFormat) }, time.Hour, time.Second, 5 * time.Second, true},
		{"429 capped", 429, func() string { return "3600" }, 300 * time.Millisecond, 300 * time.Millisecond, 2500 * time.Millisecond, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			ep := newEndpoint(t, func(r request, w http.ResponseWriter, _ *http.Request) {
				if r.attempt == 1 && strings.HasSuffix(string(r.body), `"first"}`) {
					w.Header().Set("Retry-After", tc.header())
					w.WriteHeader(tc.status)
					return
				}
				w.WriteHeader(http.StatusOK)
			})
			e.subscribe(t, Subscription{URL: ep.URL()})
			cfg := e.fastConfig()
			cfg.RetryBaseDelay, cfg.RetryMaxDelay, cfg.MaxRetryAfter = time.Hour, time.Hour, tc.cap
			first := e.enqueue(t, Event{ID: "first", Type: "t", Payload: []byte(`{"k":"first"}`)})[0]
			run(t, newDispatcher(t, cfg))
			pgtest.WaitFor(t, e.ctx, "the throttled first attempt", func() bool {
				d := e.delivery(t, first.WebhookID)
				return d.Status == StatusPending && d.LastStatus == tc.status
			})
			second := e.enqueue(t, Event{ID: "second", Type: "t", Payload: []byte(`{"k":"second"}`)})[0]
			pgtest.WaitFor(t, e.ctx, "both deliveries", func() bool { return e.count(t, "status = 'delivered'") == 2 })

			by := byWebhookID(ep.requests())
			f := by[first.WebhookID]
			if len(f) != 2 {
				t.Fatalf("first delivery: %d requests, want 2", len(f))
			}
			gap := f[1].since(f[0])
			if gap < tc.atLeast || gap > tc.notAfter {
				t.Errorf("retry came %s after the %d, want within [%s, %s]", gap, tc.status, tc.atLeast, tc.notAfter)
			}
			t.Logf("Retry-After honoured: retry %s after the %d", gap.Round(time.Millisecond), tc.status)
			s := by[second.WebhookID]
			if len(s) != 1 {
				t.Fatalf("second delivery: %d requests, want 1", len(s))
			}
			if tc.throttles && s[0].since(f[0]) < tc.atLeast {
				t.Errorf("second delivery went %s after the throttling answer, want at least %s", s[0].since(f[0]), tc.atLeast)
			}
		})
	}
}

func TestTerminalAnswerIsDeadAfterOneAttempt(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ep := newEndpoint(t, func(_ request, w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusGone)
		_, _ = w.Write([]byte("this endpoint is gone"))
	})
	sub := e.subscribe(t, Subscription{URL: ep.URL()})
	enq := e.enqueue(t, Event{ID: "x", Type: "t", Payload: []byte(`{}`)})[0]
	d := newDispatcher(t, e.fastConfig())
	run(t, d)
	pgtest.WaitFor(t, e.ctx, "the dead delivery", func() bool { return e.delivery(t, enq.WebhookID).Status == StatusDead })
	got := e.delivery(t, enq.WebhookID)
	if got.Attempts != 1 || got.LastStatus != 410 || !strings.Contains(got.LastError, "410") ||
		!strings.Contains(got.LastError, "this endpoint is gone") || got.DeadAt.IsZero() {
		t.Errorf("dead delivery: %+v", got)
	}
	if n := ep.count(); n != 1 {
		t.Errorf("endpoint got %d requests, want exactly 1", n)
	}
	b, err := e.store.Breaker(e.ctx, e.db.Pool, sub.ID)
	if err != nil || b.State != BreakerClosed || b.ConsecutiveFailures != 0 {
		t.Errorf("breaker after a 410: %+v, %v; want closed without failures", b, err)
	}
}

func TestAttemptsExhaustedIsDead(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ep := newEndpoint(t, func(_ request, w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusBadGateway) })
	e.subscribe(t, Subscription{URL: ep.URL()})
	cfg := e.fastConfig()
	cfg.MaxAttempts = 3
	enq := e.enqueue(t, Event{ID: "x", Type: "t", Payload: []byte(`{}`)})[0]
	run(t, newDispatcher(t, cfg))
	pgtest.WaitFor(t, e.ctx, "the dead delivery", func() bool { return e.delivery(t, enq.WebhookID).Status == StatusDead })
	got := e.delivery(t, enq.WebhookID)
	if got.Attempts != 3 || got.LastStatus != 502 || !strings.Contains(got.LastError, "exhausted") {
		t.Errorf("dead delivery: %+v", got)
	}
	rs := ep.requests()
	if len(rs) != 3 {
		t.Fatalf("endpoint got %d requests, want 3", len(rs))
	}
	for i, r := range rs {
		if r.webhookID != enq.WebhookID || r.attempt != i+1 {
			t.Errorf("request %d: id %s attempt %d", i, r.webhookID, r.attempt)
		}
	}
}

// TestRefusesInternalAddresses: without an allow-list, loopback (the
// httptest server, also reached through the name "localhost") and the cloud
// metadata address are refused at dial time: the delivery is dead at once and
// no request arrives.
func TestRefusesInternalAddresses(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ep := newEndpoint(t, nil)
	_, port, err := net.SplitHostPort(ep.srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	cases := map[string]string{ // URL -> expected reason
		ep.URL():                                    "loopback",
		"http://localhost:" + port + "/hook":        "loopback",
		"http://169.254.169.254/latest/meta-data/":  "cloud metadata",
		"http://[::ffff:169.254.169.254]/latest":    "cloud metadata",
		"http://10.0.0.1:1/":                        "private",
		"http://[::127.0.0.1]:" + port + "/hook":    "loopback", // IPv4-compatible
		"http://[::ffff:0:127.0.0.1]:" + port + "/": "loopback", // IPv4-translated
		"http://168.63.129.16/machine":              "Azure WireServer",
	}
	ids := map[string]string{}
	for u := range cases {
		sub := e.subscribe(t, Subscription{URL: u})
		ids[u] = sub.ID.String()
	}
	e.enqueue(t, Event{ID: "x", Type: "t", Payload: []byte(`{}`)})
	cfg := e.fastConfig()
	cfg.AllowNetworks = nil
	d := newDispatcher(t, cfg)
	stop := run(t, d)
	pgtest.WaitFor(t, e.ctx, "every delivery dead", func() bool { return e.count(t, "status = 'dead'") == len(cases) })
	stop() // counters are final once Run returned
	for u, reason := range cases {
		var last string
		var attempts int
		err := e.db.Pool.QueryRow(e.ctx, `SELECT last_error, attempts FROM `+e.store.dels+` WHERE subscription_id = $1`,
			mustUUID(t, ids[u])).Scan(&last, &attempts)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(last, "refus") || !strings.Contains(last, reason) || attempts != 1 {
			t.Errorf("%s: attempts %d, last error %q; want one refused attempt naming %q", u, attempts, last, reason)
		}
	}
	if n := ep.count(); n != 0 {
		t.Errorf("the loopback endpoint got %d requests despite the refusal", n)
	}
	if st := d.Stats(); st.Refused != int64(len(cases)) {
		t.Errorf("stats %+v, want %d refused", st, len(cases))
	}
}
