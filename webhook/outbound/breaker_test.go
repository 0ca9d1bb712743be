package outbound

import (
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/oncely/oncely/internal/pgtest"
)

// TestBreakerFlappingEndpoint: endpoint F fails until told otherwise,
// endpoint G is healthy. F's breaker opens after FailureThreshold failures;
// while it is open F's deliveries are not claimed (their attempts are not
// spent: none of them dies although F fails for many times the whole retry
// budget), F sees only probes, one at a time and a cool-down apart, and G's
// deliveries all go through meanwhile. When F recovers, a probe closes the
// breaker and F's deliveries are delivered.
func TestBreakerFlappingEndpoint(t *testing.T) {
	t.Parallel()
	e := setup(t)
	var failing atomic.Bool
	failing.Store(true)
	f := newEndpoint(t, func(_ request, w http.ResponseWriter, _ *http.Request) {
		if failing.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusOK)
	})
	g := newEndpoint(t, nil)
	fsub := e.subscribe(t, Subscription{URL: f.URL(), EventTypes: []string{"f"}})
	e.subscribe(t, Subscription{URL: g.URL(), EventTypes: []string{"g"}})
	cfg := e.fastConfig()
	cfg.Workers, cfg.MaxInFlightPerEndpoint = 4, 2
	cfg.MaxAttempts = 5 // without the breaker, F's deliveries would all die within ~0.3s
	const coolDown = 200 * time.Millisecond
	cfg.Breaker = BreakerConfig{FailureThreshold: 3, CoolDown: coolDown, PauseAfter: -1}
	d := newDispatcher(t, cfg)
	const nf, ng = 10, 40
	e.enqueue(t, events("f", "f", nf)...)
	run(t, d)

	// Wait for the breaker to open and for the attempts claimed before it
	// opened to finish: from then on, every request F gets is a probe.
	pgtest.WaitFor(t, e.ctx, "F's breaker open with nothing in flight", func() bool {
		b, err := e.store.Breaker(e.ctx, e.db.Pool, fsub.ID)
		return err == nil && b.State == BreakerOpen &&
			e.count(t, "subscription_id = $1 AND status = 'delivering'", fsub.ID) == 0
	})
	f.mu.Lock()
	probeStart := len(f.log)
	f.maxInFlight = 0
	f.mu.Unlock()
	t.Logf("breaker opened after %d requests to F", probeStart)

	start := time.Now()
	e.enqueue(t, events("g", "g", ng)...)
	pgtest.WaitFor(t, e.ctx, "G's deliveries", func() bool { return e.count(t, "status = 'delivered'") == ng })
	gTime := time.Since(start)
	if b, _ := e.store.Breaker(e.ctx, e.db.Pool, fsub.ID); b.State == BreakerClosed {
		t.Fatalf("F's breaker closed while F was failing: %+v", b)
	}
	t.Logf("G: %d deliveries in %s while F's breaker was open (%.0f/s)", ng, gTime.Round(time.Millisecond), float64(ng)/gTime.Seconds())
	pgtest.WaitFor(t, e.ctx, "three failed probes to F", func() bool { return f.count()-probeStart >= 3 })
	// While open, F saw probes only: one at a time, each at least a
	// cool-down after the previous one failed (on the database's clock:
	// request.since).
	probes := f.requests()[probeStart:]
	if _, peak := f.concurrency(); peak > 1 {
		t.Errorf("F had %d requests in flight at once while its breaker was open; want probes one at a time", peak)
	}
	for i := 1; i < len(probes); i++ {
		if gap := probes[i].since(probes[i-1]); gap < coolDown-5*time.Millisecond {
			t.Errorf("probe %d came %s after the previous failed one, want at least the cool-down %s", i, gap, coolDown)
		}
	}

	// F recovers: the next probe closes the breaker, the rest follows.
	failing.Store(false)
	pgtest.WaitFor(t, e.ctx, "F's deliveries", func() bool { return e.count(t, "status = 'delivered'") == ng+nf })
	rs := f.requests()
	if n := e.count(t, "status = 'dead'"); n != 0 {
		t.Errorf("%d deliveries died: the open breaker spent their attempts", n)
	}
	var attempts int
	if err := e.db.Pool.QueryRow(e.ctx, `SELECT sum(attempts) FROM `+e.store.dels+` WHERE subscription_id = $1`, fsub.ID).Scan(&attempts); err != nil {
		t.Fatal(err)
	}
	if attempts != len(rs) {
		t.Errorf("F's deliveries count %d attempts, F received %d requests: attempts were spent without requests", attempts, len(rs))
	}
	if n := e.count(t, "subscription_id <> $1 AND attempts <> 1", fsub.ID); n != 0 {
		t.Errorf("%d of G's deliveries needed more than one attempt", n)
	}
	b, err := e.store.Breaker(e.ctx, e.db.Pool, fsub.ID)
	if err != nil || b.State != BreakerClosed || b.ConsecutiveFailures != 0 || !b.FailingSince.IsZero() {
		t.Errorf("F's breaker after recovery: %+v, %v; want closed and clean", b, err)
	}
	t.Logf("F: %d requests for %d deliveries (%d failed probes while open)", len(rs), nf, len(probes))
}

// TestSlowEndpointDoesNotStarveOthers: endpoint S hangs; endpoint H is
// healthy. With 4 workers and at most 2 attempts per endpoint in flight, S
// holds exactly 2 workers and H's deliveries all go through while S's
// requests are still hanging.
func TestSlowEndpointDoesNotStarveOthers(t *testing.T) {
	t.Parallel()
	e := setup(t)
	release := make(chan struct{})
	s := newEndpoint(t, func(_ request, w http.ResponseWriter, req *http.Request) {
		select {
		case <-release:
		case <-req.Context().Done():
		}
		w.WriteHeader(http.StatusOK)
	})
	h := newEndpoint(t, nil)
	e.subscribe(t, Subscription{URL: s.URL(), EventTypes: []string{"s"}})
	hsub := e.subscribe(t, Subscription{URL: h.URL(), EventTypes: []string{"h"}})
	cfg := e.fastConfig()
	cfg.Workers, cfg.MaxInFlightPerEndpoint = 4, 2
	cfg.RequestTimeout, cfg.LeaseDuration = 20*time.Second, 25*time.Second
	const ns, nh = 10, 30
	e.enqueue(t, events("s", "s", ns)...) // S's work is older: it is first in line
	run(t, newDispatcher(t, cfg))
	pgtest.WaitFor(t, e.ctx, "S holding its 2 slots", func() bool { n, _ := s.concurrency(); return n == 2 })
	start := time.Now()
	e.enqueue(t, events("h", "h", nh)...)
	pgtest.WaitFor(t, e.ctx, "H's deliveries", func() bool {
		return e.count(t, "subscription_id = $1 AND status = 'delivered'", hsub.ID) == nh
	})
	hTime := time.Since(start)
	if now, peak := s.concurrency(); now != 2 || peak != 2 {
		t.Errorf("S: %d requests in flight (peak %d), want exactly the cap of 2", now, peak)
	}
	if n := e.count(t, "subscription_id <> $1 AND status = 'delivered'", hsub.ID); n != 0 {
		t.Errorf("%d of S's deliveries done while S hangs", n)
	}
	t.Logf("H: %d deliveries in %s while S held 2 of 4 workers", nh, hTime.Round(time.Millisecond))
	close(release)
	pgtest.WaitFor(t, e.ctx, "S's deliveries", func() bool { return e.count(t, "status = 'delivered'") == ns+nh })
	if _, peak := s.concurrency(); peak != 2 {
		t.Errorf("S peaked at %d requests in flight, want 2", peak)
	}
}

// TestOneProbeAtATime: an open breaker past its cool-down lets exactly one
// attempt through, however many claimers from however many pools ask at
// once; the probe's failure reopens the breaker, its success closes it, and
// then the per-endpoint cap holds across concurrent claimers.
func TestOneProbeAtATime(t *testing.T) {
	t.Parallel()
	e := setup(t)
	sub := e.subscribe(t, Subscription{URL: "https://probe.example/hook"})
	e.enqueue(t, events("p", "t", 8)...)
	cfg := e.fastConfig()
	cfg.MaxInFlightPerEndpoint = 3
	cfg.Breaker = BreakerConfig{FailureThreshold: 3, CoolDown: time.Hour, PauseAfter: -1}
	da := newDispatcher(t, cfg)
	cfg.Pool = e.secondPool(t)
	db := newDispatcher(t, cfg)
	openPast := func() {
		t.Helper()
		_, err := e.db.Pool.Exec(e.ctx, `INSERT INTO `+e.store.brks+` (subscription_id, state, consecutive_failures, opened_at, open_until)
			VALUES ($1, 'open', 3, now() - interval '2 hours', now() - interval '1 hour')
			ON CONFLICT (subscription_id) DO UPDATE SET state = 'open', open_until = now() - interval '1 hour'`, sub.ID)
		if err != nil {
			t.Fatal(err)
		}
	}
	claimAll := func() []*job {
		t.Helper()
		var (
			mu  sync.Mutex
			all []*job
			wg  sync.WaitGroup
		)
		for i := range 8 {
			d := da
			if i%2 == 1 {
				d = db
			}
			wg.Go(func() {
				js, err := d.claim(e.ctx, 4)
				if err != nil {
					t.Errorf("claim: %v", err)
				}
				mu.Lock()
				all = append(all, js...)
				mu.Unlock()
			})
		}
		wg.Wait()
		return all
	}

	openPast()
	js := claimAll()
	if len(js) != 1 || !js[0].probe {
		t.Fatalf("8 concurrent claims on a cooled-down open breaker got %d attempts, want exactly one probe", len(js))
	}
	probe := js[0]
	b, _ := e.store.Breaker(e.ctx, e.db.Pool, sub.ID)
	if b.State != BreakerHalfOpen || b.ProbeToken != probe.token {
		t.Fatalf("breaker while probing: %+v, want half-open holding the probe's lease", b)
	}
	if more := claimAll(); len(more) != 0 {
		t.Fatalf("claims during the probe got %d attempts, want none", len(more))
	}
	// The probe fails: open again for a fresh cool-down (an hour): nothing goes.
	if err := da.record(e.ctx, probe, decision{status: StatusPending, kind: failure, lastStatus: 500, lastError: "HTTP 500"}); err != nil {
		t.Fatal(err)
	}
	b, _ = e.store.Breaker(e.ctx, e.db.Pool, sub.ID)
	if b.State != BreakerOpen || !b.OpenUntil.After(e.dbNow(t).Add(59*time.Minute)) || b.ConsecutiveFailures != 4 {
		t.Fatalf("breaker after the failed probe: %+v", b)
	}
	if more := claimAll(); len(more) != 0 {
		t.Fatalf("claims right after a failed probe got %d attempts", len(more))
	}
	// Cool-down over: one probe again, and it succeeds.
	openPast()
	js = claimAll()
	if len(js) != 1 || !js[0].probe {
		t.Fatalf("second probe: %d attempts, want one probe", len(js))
	}
	if err := db.record(e.ctx, js[0], decision{status: StatusDelivered, kind: success, lastStatus: 200}); err != nil {
		t.Fatal(err)
	}
	b, _ = e.store.Breaker(e.ctx, e.db.Pool, sub.ID)
	if b.State != BreakerClosed || b.ConsecutiveFailures != 0 {
		t.Fatalf("breaker after a successful probe: %+v", b)
	}
	// Closed: 8 concurrent claimers from two pools get exactly the cap.
	js = claimAll()
	if len(js) != cfg.MaxInFlightPerEndpoint {
		t.Fatalf("closed breaker: concurrent claims got %d attempts, want the cap %d", len(js), cfg.MaxInFlightPerEndpoint)
	}
	for _, j := range js {
		if j.probe {
			t.Errorf("attempt %s claimed as a probe while closed", j.webhookID)
		}
	}
}

// TestAutoPause: an endpoint that keeps failing for PauseAfter gets its
// subscription paused with a reason; nothing more is claimed for it until
// it is resumed, and then its deliveries go out.
func TestAutoPause(t *testing.T) {
	t.Parallel()
	e := setup(t)
	var failing atomic.Bool
	failing.Store(true)
	ep := newEndpoint(t, func(_ request, w http.ResponseWriter, _ *http.Request) {
		if failing.Load() {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusOK)
	})
	sub := e.subscribe(t, Subscription{URL: ep.URL()})
	cfg := e.fastConfig()
	cfg.MaxAttempts = 100
	cfg.Breaker = BreakerConfig{FailureThreshold: 2, CoolDown: 50 * time.Millisecond, PauseAfter: 300 * time.Millisecond}
	d := newDispatcher(t, cfg)
	e.enqueue(t, events("x", "t", 3)...)
	run(t, d)
	var paused Subscription
	pgtest.WaitFor(t, e.ctx, "the subscription paused", func() bool {
		var err error
		paused, err = e.store.GetSubscription(e.ctx, e.db.Pool, sub.ID)
		return err == nil && paused.Paused()
	})
	if !strings.Contains(paused.PausedReason, "failing since") || !strings.Contains(paused.PausedReason, "HTTP 500") {
		t.Errorf("pause reason %q", paused.PausedReason)
	}
	pgtest.WaitFor(t, e.ctx, "nothing in flight", func() bool { return e.count(t, "status = 'delivering'") == 0 })
	if js, err := d.claim(e.ctx, 8); err != nil || len(js) != 0 {
		t.Errorf("claim on a paused subscription: %d attempts, %v", len(js), err)
	}
	if n := e.count(t, "status = 'pending'"); n != 3 {
		t.Errorf("%d deliveries pending while paused, want all 3 kept", n)
	}
	failing.Store(false)
	if err := e.store.ResumeSubscription(e.ctx, e.db.Pool, sub.ID); err != nil {
		t.Fatal(err)
	}
	pgtest.WaitFor(t, e.ctx, "delivery after resume", func() bool { return e.count(t, "status = 'delivered'") == 3 })
	if b, _ := e.store.Breaker(e.ctx, e.db.Pool, sub.ID); b.State != BreakerClosed {
		t.Errorf("breaker after resume: %+v", b)
	}
}
