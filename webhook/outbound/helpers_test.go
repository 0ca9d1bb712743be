package outbound

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely/internal/pgtest"
	"github.com/oncely/oncely/migrations"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// loopback is what tests allow-list: httptest servers listen on 127.0.0.1.
var loopback = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}

type env struct {
	db    *pgtest.DB
	store *Store
	ctx   context.Context
}

// setup gives the test its own schema with oncely's tables.
func setup(t *testing.T) *env {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	t.Cleanup(cancel)
	db := pgtest.Postgres(t)
	m, err := migrations.New(db.Pool, migrations.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Up(ctx); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	store, err := NewStore(Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	return &env{db: db, store: store, ctx: ctx}
}

// fastConfig is a dispatcher configuration with test-sized delays.
func (e *env) fastConfig() DispatcherConfig {
	return DispatcherConfig{
		Store:                  Config{Schema: e.db.Schema},
		Pool:                   e.db.Pool,
		Workers:                8,
		MaxInFlightPerEndpoint: 4,
		RequestTimeout:         5 * time.Second,
		LeaseDuration:          10 * time.Second,
		PollInterval:           10 * time.Millisecond,
		MaxAttempts:            5,
		RetryBaseDelay:         10 * time.Millisecond,
		RetryMaxDelay:          50 * time.Millisecond,
		Breaker:                BreakerConfig{FailureThreshold: 1000, CoolDown: time.Second, PauseAfter: -1},
		AllowNetworks:          loopback,
	}
}

func newDispatcher(t *testing.T, cfg DispatcherConfig) *Dispatcher {
	t.Helper()
	d, err := NewDispatcher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// run starts d and stops it when the test ends (or when the returned stop
// is called), failing the test if Run fails or does not return.
func run(t *testing.T, d *Dispatcher) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("Run: %v", err)
				}
			case <-time.After(30 * time.Second):
				t.Errorf("Run did not return within 30s of cancellation")
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

func (e *env) subscribe(t *testing.T, sub Subscription) Subscription {
	t.Helper()
	s, err := e.store.CreateSubscription(e.ctx, e.db.Pool, sub)
	if err != nil {
		t.Fatalf("create subscription: %v", err)
	}
	return s
}

// enqueue enqueues events in a transaction of its own and commits it.
func (e *env) enqueue(t *testing.T, events ...Event) []Enqueued {
	t.Helper()
	var out []Enqueued
	err := pgx.BeginFunc(e.ctx, e.db.Pool, func(tx pgx.Tx) error {
		var err error
		out, err = e.store.Enqueue(e.ctx, tx, events...)
		return err
	})
	if err != nil {
		t.Fatalf("enqueue: %v", err)
	}
	return out
}

// events returns n events of type typ with ids prefix-0..n-1.
func events(prefix, typ string, n int) []Event {
	out := make([]Event, n)
	for i := range out {
		out[i] = Event{ID: fmt.Sprintf("%s-%d", prefix, i), Type: typ, Payload: fmt.Appendf(nil, `{"n":%d}`, i)}
	}
	return out
}

func (e *env) delivery(t *testing.T, webhookID string) Delivery {
	t.Helper()
	d, err := e.store.GetDelivery(e.ctx, e.db.Pool, webhookID)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// count runs a count(*) over webhook_deliveries with the given condition.
func (e *env) count(t *testing.T, where string, args ...any) int {
	t.Helper()
	var n int
	q := `SELECT count(*) FROM ` + e.store.dels + ` WHERE ` + where
	if err := e.db.Pool.QueryRow(e.ctx, q, args...).Scan(&n); err != nil {
		t.Fatalf("count %q: %v", where, err)
	}
	return n
}

func (e *env) dbNow(t *testing.T) time.Time {
	t.Helper()
	var now time.Time
	if err := e.db.Pool.QueryRow(e.ctx, `SELECT now()`).Scan(&now); err != nil {
		t.Fatal(err)
	}
	return now
}

// request is one request an endpoint received.
type request struct {
	webhookID string
	attempt   int
	timestamp string
	signature string
	eventType string
	header    http.Header
	body      []byte
	at        time.Time
}

// since is how long after earlier req came, on the wall clock: the clock
// that the database keeps delays and cool-downs by (now()), so that a step
// of the machine's wall clock moves both alike. time.Time.Sub would use the
// monotonic readings, which such a step sets apart from now().
func (req request) since(earlier request) time.Duration {
	return req.at.Round(0).Sub(earlier.at.Round(0))
}

// endpoint is an httptest server that records every request and answers
// with a scripted handler.
type endpoint struct {
	srv *httptest.Server
	mu  sync.Mutex
	log []request
	// inFlight and maxInFlight count concurrent requests.
	inFlight, maxInFlight int
	// perID counts requests in flight per webhook-id; overlaps counts
	// requests that arrived while another of the same webhook-id was in
	// flight.
	perID    map[string]int
	overlaps int
	answer   func(r request, w http.ResponseWriter, req *http.Request)
}

// newEndpoint starts a server; answer writes the response (nil: 200).
func newEndpoint(t *testing.T, answer func(r request, w http.ResponseWriter, req *http.Request)) *endpoint {
	t.Helper()
	ep := &endpoint{answer: answer, perID: map[string]int{}}
	ep.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		attempt, _ := strconv.Atoi(req.Header.Get(HeaderAttempt))
		r := request{
			webhookID: req.Header.Get(HeaderID), attempt: attempt,
			timestamp: req.Header.Get(HeaderTimestamp), signature: req.Header.Get(HeaderSignature),
			eventType: req.Header.Get(HeaderEventType), header: req.Header.Clone(), body: body, at: time.Now(),
		}
		ep.mu.Lock()
		ep.log = append(ep.log, r)
		ep.inFlight++
		ep.maxInFlight = max(ep.maxInFlight, ep.inFlight)
		if ep.perID[r.webhookID] > 0 {
			ep.overlaps++
		}
		ep.perID[r.webhookID]++
		ep.mu.Unlock()
		defer func() {
			ep.mu.Lock()
			ep.inFlight--
			ep.perID[r.webhookID]--
			ep.mu.Unlock()
		}()
		if ep.answer == nil {
			w.WriteHeader(http.StatusOK)
			return
		}
		ep.answer(r, w, req)
	}))
	t.Cleanup(ep.srv.Close)
	return ep
}

func (ep *endpoint) URL() string { return ep.srv.URL + "/hook" }

func (ep *endpoint) requests() []request {
	ep.mu.Lock()
	defer ep.mu.Unlock()
	return append([]request(nil), ep.log...)
}

func (ep *endpoint) count() int {
	ep.mu.Lock()
	defer ep.mu.Unlock()
	return len(ep.log)
}

func (ep *endpoint) concurrency() (now, peak int) {
	ep.mu.Lock()
	defer ep.mu.Unlock()
	return ep.inFlight, ep.maxInFlight
}

// byWebhookID groups requests by webhook-id, in arrival order.
func byWebhookID(rs []request) map[string][]request {
	m := map[string][]request{}
	for _, r := range rs {
		m[r.webhookID] = append(m[r.webhookID], r)
	}
	return m
}

// verifyStandardWebhooks is an independent implementation of the Standard
// Webhooks v1 check, written from the specification: the signed content is
// id + "." + timestamp + "." + body, the key is the base64 part of the whsec_
// secret, decoded, and the header holds space-separated "v1,<base64>"
// signatures, any of which may match.
func verifyStandardWebhooks(secret, id, timestamp string, body []byte, header string) bool {
	key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(secret, "whsec_"))
	if err != nil {
		return false
	}
	mac := hmac.New(sha256.New, key)
	mac.Write([]byte(id + "." + timestamp + "." + string(body)))
	want := mac.Sum(nil)
	for _, entry := range strings.Split(header, " ") {
		version, sig, ok := strings.Cut(entry, ",")
		if !ok || version != "v1" {
			continue
		}
		got, err := base64.StdEncoding.DecodeString(sig)
		if err == nil && hmac.Equal(got, want) {
			return true
		}
	}
	return false
}

func mustUUID(t *testing.T, s string) uuid.UUID {
	t.Helper()
	u, err := uuid.Parse(s)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// secondPool opens another pool on the test's schema, as a second replica
// would have.
func (e *env) secondPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	p, err := pgtest.NewPool(e.ctx, e.db.URL, e.db.Schema, 8)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}
