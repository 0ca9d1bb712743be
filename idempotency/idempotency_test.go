package idempotency_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/oncely/oncely/idempotency"
	"github.com/oncely/oncely/internal/pgtest"
	"github.com/oncely/oncely/internal/sqlident"
	"github.com/oncely/oncely/migrations"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// env is one test's schema, middleware and server.
type env struct {
	t       *testing.T
	ctx     context.Context
	db      *pgtest.DB
	mw      *idempotency.Middleware
	srv     *httptest.Server
	keys    string    // quoted idempotency_keys table
	effects string    // quoted table the handlers write their effect rows to
	redis   *redisEnv // the Redis store's client and prefix; nil: Postgres store
}

// setup migrates a fresh schema, creates the effects table and serves
// routes (path -> handler) behind a Middleware built from cfg.
//
// Routes under /req/ use Require, all others Handler. arm runs on the
// middleware before the server starts (to set test hooks).
func setup(t *testing.T, cfg idempotency.Config, routes map[string]http.Handler, arm ...func(*idempotency.Middleware)) *env {
	t.Helper()
	return setupEnv(t, backends[0], nil, cfg, routes, arm...)
}

// backend is a store the shared middleware tests run against.
type backend struct {
	name  string
	redis bool
}

// backends: the Postgres store (New) and the Redis store (NewWithStore with
// package redisstore), in that order.
var backends = []backend{{"postgres", false}, {"redis", true}}

// eachStore runs test once per store, in parallel subtests named after it.
func eachStore(t *testing.T, test func(*testing.T, backend)) {
	t.Parallel()
	for _, s := range backends {
		t.Run(s.name, func(t *testing.T) { test(t, s) })
	}
}

// setup is setup on the store s.
func (s backend) setup(t *testing.T, cfg idempotency.Config, routes map[string]http.Handler, arm ...func(*idempotency.Middleware)) *env {
	t.Helper()
	return setupEnv(t, s, nil, cfg, routes, arm...)
}

// setupOrders is setupOrders on the store s.
func (s backend) setupOrders(t *testing.T, cfg idempotency.Config) *env {
	t.Helper()
	var e *env
	e = s.setup(t, cfg, map[string]http.Handler{
		"/orders": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { e.orders()(w, r) }),
	})
	return e
}

// rollsBack reports whether the store undoes the handler's writes with an
// unrecorded key (Postgres: they share a transaction). With the Redis store
// the test's effect rows are written outside any store and stay.
func (e *env) rollsBack() bool { return e.redis == nil }

// setupOrders is setup with the orders handler alone, on /orders.
func setupOrders(t *testing.T, cfg idempotency.Config) *env {
	t.Helper()
	var e *env
	e = setup(t, cfg, map[string]http.Handler{
		"/orders": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { e.orders()(w, r) }),
	})
	return e
}

// setupVia is setup with the middleware reaching Postgres through proxy
// (nil: directly); the test's own queries go directly.
func setupVia(t *testing.T, proxy *pgtest.PostgresProxy, cfg idempotency.Config, routes map[string]http.Handler, arm ...func(*idempotency.Middleware)) *env {
	t.Helper()
	return setupEnv(t, backends[0], proxy, cfg, routes, arm...)
}

func setupEnv(t *testing.T, s backend, proxy *pgtest.PostgresProxy, cfg idempotency.Config, routes map[string]http.Handler, arm ...func(*idempotency.Middleware)) *env {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	db := pgtest.Postgres(t)
	mig, err := migrations.New(db.Pool, migrations.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := mig.Up(ctx); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	e := &env{
		t: t, ctx: ctx, db: db,
		keys:    sqlident.Table(db.Schema, "idempotency_keys"),
		effects: sqlident.Table(db.Schema, "effects"),
	}
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE `+e.effects+` (
		id text PRIMARY KEY, key text NOT NULL, body bytea NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	cfg.Schema = db.Schema
	cfg.Logger = slog.New(slog.NewTextHandler(testWriter{t}, nil))
	var pool idempotency.DB = db.Pool
	if proxy != nil {
		pool = proxy.Pool(t, db.Schema, 8)
	}
	if s.redis {
		e.redis = newRedisEnv(t)
		e.mw, err = idempotency.NewWithStore(e.redis.store, cfg)
	} else {
		e.mw, err = idempotency.New(pool, cfg)
	}
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	for _, f := range arm {
		f(e.mw)
	}
	mux := http.NewServeMux()
	for path, h := range routes {
		if strings.HasPrefix(path, "/req/") {
			mux.Handle(path, e.mw.Require(h))
		} else {
			mux.Handle(path, e.mw.Handler(h))
		}
	}
	e.srv = httptest.NewUnstartedServer(authenticate(mux))
	e.srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the panic test's stack trace is expected
	e.srv.Start()
	t.Cleanup(e.srv.Close)
	return e
}

// authenticate stands in for an authentication middleware: it names the
// client of X-Client (default "client-1") with idempotency.WithClient; a
// request with X-Anonymous names none.
func authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Anonymous") == "" {
			client := r.Header.Get("X-Client")
			if client == "" {
				client = "client-1"
			}
			r = r.WithContext(idempotency.WithClient(r.Context(), client))
		}
		next.ServeHTTP(w, r)
	})
}

// orders is the test's "create an order" handler: it writes one effect row
// through the request's transaction and answers 201 with a body, a Location
// and an X-Run header that are unique to this run of the handler.
func (e *env) orders() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if err := e.writeEffect(r); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		e.answerCreated(w, r)
	}
}

// writeEffect inserts the effect row of one handler run and returns its id
// in the request's header map (X-Effect-Id, read by answerCreated).
func (e *env) writeEffect(r *http.Request) error {
	var tx interface {
		Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
	}
	tx, ok := idempotency.Tx(r.Context())
	switch {
	case !ok && e.redis != nil:
		tx = e.db.Pool // an effect outside any store, as a call to another service is
	case !ok:
		return errors.New("no transaction in the request context")
	}
	_, key, ok := idempotency.Key(r.Context())
	if !ok {
		return errors.New("no key in the request context")
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return err
	}
	id := uuid.NewString()
	if _, err := tx.Exec(r.Context(), `INSERT INTO `+e.effects+` (id, key, body) VALUES ($1, $2, $3)`, id, key, body); err != nil {
		return err
	}
	r.Header.Set("X-Effect-Id", id)
	return nil
}

func (e *env) answerCreated(w http.ResponseWriter, r *http.Request) {
	id := r.Header.Get("X-Effect-Id")
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/orders/"+id)
	w.Header().Set("X-Run", id) // not in ReplayHeaders: the replay must not carry it
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"id":%q}`, id)
}

// testWriter sends the middleware's log lines to the test log.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

type response struct {
	status int
	header http.Header
	body   []byte
}

func (r response) replayed() bool { return r.header.Get(idempotency.ReplayedHeader) == "true" }

func (r response) String() string {
	return fmt.Sprintf("%d %v %q", r.status, r.header, r.body)
}

// send makes one request; key "" sends no key header. Safe in goroutines.
func (e *env) send(client *http.Client, method, path, key, body string, hdr ...string) (response, error) {
	req, err := http.NewRequestWithContext(e.ctx, method, e.srv.URL+path, strings.NewReader(body))
	if err != nil {
		return response{}, err
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Add(hdr[i], hdr[i+1])
	}
	resp, err := client.Do(req)
	if err != nil {
		return response{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return response{}, err
	}
	return response{status: resp.StatusCode, header: resp.Header, body: b}, nil
}

// post sends a POST with the server's client and fails the test on a
// transport error.
func (e *env) post(path, key, body string, hdr ...string) response {
	e.t.Helper()
	r, err := e.send(e.srv.Client(), http.MethodPost, path, key, body, hdr...)
	if err != nil {
		e.t.Fatalf("POST %s: %v", path, err)
	}
	return r
}

// freshClient never reuses a connection, so that net/http's Transport
// cannot retry a keyed request by itself after a broken connection (it
// treats requests with an Idempotency-Key header as replayable).
func freshClient() *http.Client {
	return &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
}

// postUntilDone retries a POST while it gets 409 (key in progress), up to
// a deadline, and returns the first other response.
func (e *env) postUntilDone(path, key, body string) response {
	e.t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for wait := time.Millisecond; ; wait = min(2*wait, 100*time.Millisecond) {
		r := e.post(path, key, body)
		if r.status != http.StatusConflict {
			return r
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("POST %s key %s: still 409 after 20 s", path, key)
		}
		time.Sleep(wait) // polling a condition with a deadline, not synchronisation
	}
}

func (e *env) count(table, where string, args ...any) int {
	e.t.Helper()
	var n int
	if err := e.db.Pool.QueryRow(e.ctx, `SELECT count(*) FROM `+table+` WHERE `+where, args...).Scan(&n); err != nil {
		e.t.Fatalf("count %s where %s: %v", table, where, err)
	}
	return n
}

func (e *env) effectsFor(key string) int { return e.count(e.effects, "key = $1", key) }

// storedKeys counts the keys the store holds or has recorded.
func (e *env) storedKeys() int {
	if e.redis != nil {
		return e.redis.storedKeys(e.t)
	}
	return e.count(e.keys, "true")
}

// stored reports a response recorded for (scope, key).
func (e *env) stored(scope, key string) bool {
	if e.redis != nil {
		return e.redis.stored(e.t, scope, key)
	}
	return e.count(e.keys, "scope = $1 AND key = $2 AND status > 0", scope, key) == 1
}

// requireCreated asserts a first (not replayed) 201 from the orders handler.
func requireCreated(t *testing.T, r response) {
	t.Helper()
	if r.status != http.StatusCreated || r.replayed() || r.header.Get("X-Run") == "" {
		t.Fatalf("want a fresh 201 from the handler, got %s", r)
	}
}

// requireReplayOf asserts that replay is first replayed: same status, the
// recorded headers and the same body byte for byte, and none of the others.
func requireReplayOf(t *testing.T, replay, first response) {
	t.Helper()
	if !replay.replayed() {
		t.Fatalf("want a replay, got %s", replay)
	}
	if replay.status != first.status || !bytes.Equal(replay.body, first.body) {
		t.Fatalf("replay %d %q differs from the first response %d %q", replay.status, replay.body, first.status, first.body)
	}
	for _, h := range []string{"Content-Type", "Location"} {
		if got, want := replay.header.Values(h), first.header.Values(h); !slices.Equal(got, want) {
			t.Errorf("replayed %s = %q, first response had %q", h, got, want)
		}
	}
	if v := replay.header.Get("X-Run"); v != "" {
		t.Errorf("replay carries X-Run %q, which is not in ReplayHeaders", v)
	}
}

// TestConcurrentIdenticalRequests is the hammer: 25 identical POSTs with one
// key, released together, give statuses in {201, 409} and exactly one
// effect; the single fresh 201 is the one every later retry replays.
func TestConcurrentIdenticalRequests(t *testing.T) { eachStore(t, testConcurrentIdenticalRequests) }

func testConcurrentIdenticalRequests(t *testing.T, s backend) {
	t.Parallel()
	var e *env
	e = s.setup(t, idempotency.Config{}, map[string]http.Handler{
		"/req/orders": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { e.orders()(w, r) }),
	})
	const n = 25
	for round := range 4 {
		key := uuid.NewString()
		body := fmt.Sprintf(`{"sku":"A-1","qty":%d}`, round+1)
		start := make(chan struct{})
		results := make([]response, n)
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				<-start
				results[i], errs[i] = e.send(e.srv.Client(), http.MethodPost, "/req/orders", key, body)
			})
		}
		close(start)
		wg.Wait()

		var fresh []response
		statuses := map[int]int{}
		for i, r := range results {
			if errs[i] != nil {
				t.Fatalf("round %d request %d: %v", round, i, errs[i])
			}
			statuses[r.status]++
			switch {
			case r.status == http.StatusCreated && !r.replayed():
				fresh = append(fresh, r)
			case r.status == http.StatusCreated:
			case r.status == http.StatusConflict:
				if r.header.Get("Retry-After") != "1" {
					t.Errorf("409 without Retry-After: 1: %s", r)
				}
			default:
				t.Errorf("round %d: status %d outside {201, 409}: %s", round, r.status, r)
			}
		}
		t.Logf("round %d: statuses %v", round, statuses)
		if len(fresh) != 1 {
			t.Fatalf("round %d: %d fresh 201s, want exactly 1 (statuses %v)", round, len(fresh), statuses)
		}
		if got := e.effectsFor(key); got != 1 {
			t.Fatalf("round %d: %d effect rows for one key, want 1", round, got)
		}
		for _, r := range results {
			if r.status == http.StatusCreated && r.replayed() {
				requireReplayOf(t, r, fresh[0])
			}
		}
		// A later retry replays the first response byte for byte.
		requireReplayOf(t, e.post("/req/orders", key, body), fresh[0])
		if got := e.effectsFor(key); got != 1 {
			t.Fatalf("round %d: %d effect rows after the retry, want 1", round, got)
		}
	}
}

// TestInProgressIs409 holds the first request inside its handler while 24
// others with the same key arrive: each gets 409 with Retry-After at once
// (none waits for the first), and after the first completes they replay.
func TestInProgressIs409(t *testing.T) { eachStore(t, testInProgressIs409) }

func testInProgressIs409(t *testing.T, s backend) {
	t.Parallel()
	entered, release := make(chan struct{}), make(chan struct{})
	var calls atomic.Int32
	var e *env
	e = s.setup(t, idempotency.Config{RetryAfter: 2500 * time.Millisecond}, map[string]http.Handler{
		"/req/orders": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if err := e.writeEffect(r); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			if calls.Add(1) == 1 {
				close(entered)
				<-release
			}
			e.answerCreated(w, r)
		}),
	})
	key := uuid.NewString()
	first := make(chan response, 1)
	go func() {
		r, err := e.send(e.srv.Client(), http.MethodPost, "/req/orders", key, `{"sku":"B"}`)
		if err != nil {
			t.Errorf("first request: %v", err)
		}
		first <- r
	}()
	<-entered

	var wg sync.WaitGroup
	for range 24 {
		wg.Go(func() {
			r, err := e.send(e.srv.Client(), http.MethodPost, "/req/orders", key, `{"sku":"B"}`)
			switch {
			case err != nil:
				t.Errorf("concurrent request: %v", err)
			case r.status != http.StatusConflict || r.header.Get("Retry-After") != "3":
				t.Errorf("concurrent request while the key is in progress: got %s, want 409 with Retry-After: 3", r)
			case r.header.Get("Content-Type") != "application/problem+json":
				t.Errorf("409 Content-Type %q, want application/problem+json", r.header.Get("Content-Type"))
			}
		})
	}
	wg.Wait() // all 24 answered while the first is still blocked in its handler
	close(release)
	r1 := <-first
	requireCreated(t, r1)
	requireReplayOf(t, e.post("/req/orders", key, `{"sku":"B"}`), r1)
	if calls.Load() != 1 || e.effectsFor(key) != 1 {
		t.Fatalf("handler ran %d times, %d effect rows; want 1 and 1", calls.Load(), e.effectsFor(key))
	}
}

// TestReplayIsByteForByte records a binary body, repeated headers and a
// status without a body, and replays them exactly; a header outside the
// allow-list is not replayed.
func TestReplayIsByteForByte(t *testing.T) { eachStore(t, testReplayIsByteForByte) }

func testReplayIsByteForByte(t *testing.T, s backend) {
	t.Parallel()
	binary := make([]byte, 256)
	for i := range binary {
		binary[i] = byte(i)
	}
	var calls atomic.Int32
	e := s.setup(t, idempotency.Config{ReplayHeaders: []string{"content-type", "X-Multi", "Location"}}, map[string]http.Handler{
		"/blob": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			calls.Add(1)
			w.Header().Set("Content-Type", "application/octet-stream")
			w.Header().Add("X-Multi", "b")
			w.Header().Add("X-Multi", "a")
			w.Header().Set("X-Run", uuid.NewString())
			w.WriteHeader(http.StatusAccepted)
			_, _ = w.Write(binary[:100])
			_, _ = w.Write(binary[100:])
		}),
		"/empty": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			calls.Add(1)
			w.WriteHeader(http.StatusNoContent)
		}),
		"/sniffed": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			calls.Add(1)
			_, _ = io.WriteString(w, "<html><body>made</body></html>")
		}),
	})
	for _, path := range []string{"/blob", "/empty", "/sniffed"} {
		key := uuid.NewString()
		before := calls.Load()
		first := e.post(path, key, "payload")
		if first.replayed() {
			t.Fatalf("%s: first response marked replayed: %s", path, first)
		}
		for range 3 {
			again := e.post(path, key, "payload")
			requireReplayOf(t, again, first)
			if got, want := again.header.Values("X-Multi"), first.header.Values("X-Multi"); !slices.Equal(got, want) {
				t.Errorf("%s: replayed X-Multi %q, want %q", path, got, want)
			}
		}
		if calls.Load() != before+1 {
			t.Errorf("%s: handler ran %d times for one key, want once", path, calls.Load()-before)
		}
		switch path {
		case "/blob":
			if first.status != http.StatusAccepted || !bytes.Equal(first.body, binary) {
				t.Errorf("/blob first response %s", first)
			}
		case "/empty":
			if first.status != http.StatusNoContent || len(first.body) != 0 {
				t.Errorf("/empty first response %s", first)
			}
		case "/sniffed":
			if first.status != http.StatusOK || first.header.Get("Content-Type") != "text/html; charset=utf-8" {
				t.Errorf("/sniffed first response %s: want 200 with the sniffed Content-Type", first)
			}
		}
	}
}

// TestReplayHeaders: by default the headers that describe the body and
// the created resource are replayed, and Set-Cookie and unlisted headers
// are not; Set-Cookie is replayed once listed; a header that the response's
// Connection header names is hop-by-hop and never recorded, even if listed.
func TestReplayHeaders(t *testing.T) { eachStore(t, testReplayHeaders) }

func testReplayHeaders(t *testing.T, s backend) {
	t.Parallel()
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Type", "text/plain")
		h.Set("Content-Language", "de")
		h.Set("Location", "/orders/1")
		h.Set("ETag", `"v1"`)
		h.Set("Last-Modified", "Wed, 21 Oct 2015 07:28:00 GMT")
		h.Add("Link", "</orders/1/items>; rel=items")
		h.Set("Set-Cookie", "session="+uuid.NewString())
		h.Set("X-Hop", "only-for-this-hop")
		h.Set("Connection", "X-Hop")
		h.Set("X-Run", uuid.NewString())
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "made")
	})
	for _, tc := range []struct {
		name      string
		cfg       idempotency.Config
		replayed  []string
		notReplay []string
	}{
		{"default", idempotency.Config{},
			[]string{"Content-Type", "Content-Language", "Location", "Etag", "Last-Modified", "Link"},
			[]string{"Set-Cookie", "X-Run", "X-Hop"}},
		{"Set-Cookie listed", idempotency.Config{ReplayHeaders: []string{"Content-Type", "set-cookie", "X-Hop"}},
			[]string{"Content-Type", "Set-Cookie"},
			[]string{"Location", "X-Run", "X-Hop"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := s.setup(t, tc.cfg, map[string]http.Handler{"/h": handler})
			key := uuid.NewString()
			first := e.post("/h", key, "")
			if first.status != http.StatusCreated || first.replayed() || first.header.Get("Set-Cookie") == "" {
				t.Fatalf("first response %s: want a fresh 201 with every header", first)
			}
			again := e.post("/h", key, "")
			if !again.replayed() || again.status != http.StatusCreated || string(again.body) != "made" {
				t.Fatalf("want a replay, got %s", again)
			}
			for _, h := range tc.replayed {
				if got, want := again.header.Values(h), first.header.Values(h); len(want) == 0 || !slices.Equal(got, want) {
					t.Errorf("replayed %s = %q, want %q", h, got, want)
				}
			}
			for _, h := range tc.notReplay {
				if v := again.header.Values(h); len(v) > 0 {
					t.Errorf("replay carries %s %q", h, v)
				}
			}
		})
	}
}

// TestOtherRequestSameKeyIs422: a key reused for a different method, path,
// body (the raw bytes: JSON whitespace counts) or, unless IgnoreQuery is set,
// query.
func TestOtherRequestSameKeyIs422(t *testing.T) { eachStore(t, testOtherRequestSameKeyIs422) }

func testOtherRequestSameKeyIs422(t *testing.T, s backend) {
	t.Parallel()
	for _, ignore := range []bool{false, true} {
		withQuery := !ignore
		t.Run(fmt.Sprintf("IgnoreQuery=%v", ignore), func(t *testing.T) {
			t.Parallel()
			var e *env
			e = s.setup(t, idempotency.Config{IgnoreQuery: ignore}, map[string]http.Handler{
				"/orders": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { e.orders()(w, r) }),
				"/other":  http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { e.orders()(w, r) }),
			})
			key := uuid.NewString()
			first := e.post("/orders?x=1", key, `{"sku":"C","qty":1}`)
			requireCreated(t, first)
			for name, try := range map[string]func() (response, error){
				"body": func() (response, error) {
					return e.send(e.srv.Client(), http.MethodPost, "/orders?x=1", key, `{"sku":"C","qty":2}`)
				},
				"JSON whitespace": func() (response, error) {
					return e.send(e.srv.Client(), http.MethodPost, "/orders?x=1", key, `{"sku": "C", "qty": 1}`)
				},
				"JSON key order": func() (response, error) {
					return e.send(e.srv.Client(), http.MethodPost, "/orders?x=1", key, `{"qty":1,"sku":"C"}`)
				},
				"path": func() (response, error) {
					return e.send(e.srv.Client(), http.MethodPost, "/other?x=1", key, `{"sku":"C","qty":1}`)
				},
				"method": func() (response, error) {
					return e.send(e.srv.Client(), http.MethodPatch, "/orders?x=1", key, `{"sku":"C","qty":1}`)
				},
			} {
				r, err := try()
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				if r.status != http.StatusUnprocessableEntity || r.replayed() {
					t.Errorf("same key, other %s: got %s, want 422", name, r)
				}
			}
			r := e.post("/orders?x=2", key, `{"sku":"C","qty":1}`)
			if withQuery && r.status != http.StatusUnprocessableEntity {
				t.Errorf("other query: got %s, want 422", r)
			}
			if r := e.post("/orders", key, `{"sku":"C","qty":1}`); withQuery && r.status != http.StatusUnprocessableEntity {
				t.Errorf("no query after ?x=1: got %s, want 422", r)
			}
			if !withQuery {
				requireReplayOf(t, r, first)
			}
			requireReplayOf(t, e.post("/orders?x=1", key, `{"sku":"C","qty":1}`), first)
			if n := e.effectsFor(key); n != 1 {
				t.Errorf("%d effect rows, want 1", n)
			}
		})
	}
}

// TestQueryIsPartOfTheFingerprintByDefault: with the default config, POST
// /orders?x=1 under the key of an earlier POST /orders gets 422, never the
// /orders response; the same query again replays.
func TestQueryIsPartOfTheFingerprintByDefault(t *testing.T) {
	eachStore(t, testQueryIsPartOfTheFingerprintByDefault)
}

func testQueryIsPartOfTheFingerprintByDefault(t *testing.T, s backend) {
	t.Parallel()
	e := s.setupOrders(t, idempotency.Config{})
	key := uuid.NewString()
	first := e.post("/orders", key, "{}")
	requireCreated(t, first)
	if r := e.post("/orders?x=1", key, "{}"); r.status != http.StatusUnprocessableEntity || r.replayed() {
		t.Fatalf("POST /orders?x=1 with the key of POST /orders: got %s, want 422", r)
	}
	requireReplayOf(t, e.post("/orders", key, "{}"), first)
	other := uuid.NewString()
	withQuery := e.post("/orders?x=1", other, "{}")
	requireCreated(t, withQuery)
	requireReplayOf(t, e.post("/orders?x=1", other, "{}"), withQuery)
	if r := e.post("/orders?x=2", other, "{}"); r.status != http.StatusUnprocessableEntity {
		t.Fatalf("other query: got %s, want 422", r)
	}
	if n := e.effectsFor(key) + e.effectsFor(other); n != 2 {
		t.Errorf("%d effect rows, want 2", n)
	}
}

// TestKeyRequiredOptionalAndInvalid: no key on a Require route is 400 and
// the handler does not run; on a Handler route, and for methods outside
// Config.Methods, the request passes through without a transaction; an
// invalid key is 400 everywhere.
func TestKeyRequiredOptionalAndInvalid(t *testing.T) { eachStore(t, testKeyRequiredOptionalAndInvalid) }

func testKeyRequiredOptionalAndInvalid(t *testing.T, s backend) {
	t.Parallel()
	var calls atomic.Int32
	passThrough := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		if _, ok := idempotency.Tx(r.Context()); ok {
			http.Error(w, "unexpected transaction", http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusOK)
	})
	e := s.setup(t, idempotency.Config{}, map[string]http.Handler{"/req/x": passThrough, "/opt/x": passThrough})

	r := e.post("/req/x", "", "{}")
	if r.status != http.StatusBadRequest || !strings.Contains(string(r.body), "requires an Idempotency-Key header") {
		t.Errorf("no key on a required route: %s, want 400", r)
	}
	if calls.Load() != 0 {
		t.Errorf("handler ran %d times on refused requests", calls.Load())
	}
	if r := e.post("/opt/x", "", "{}"); r.status != http.StatusOK {
		t.Errorf("no key on an optional route: %s, want the handler's 200", r)
	}
	if r, err := e.send(e.srv.Client(), http.MethodGet, "/req/x", "some-key", ""); err != nil || r.status != http.StatusOK {
		t.Errorf("GET with a key: %v %v, want a pass-through 200", r, err)
	}
	if calls.Load() != 2 {
		t.Errorf("handler ran %d times, want 2 (the two pass-throughs)", calls.Load())
	}

	for name, hdr := range map[string][]string{
		"too long":      {"Idempotency-Key", strings.Repeat("k", 256)},
		"inner space":   {"Idempotency-Key", "a b"},
		"empty":         {"Idempotency-Key", `""`},
		"two fields":    {"Idempotency-Key", "a", "Idempotency-Key", "b"},
		"bad sf-string": {"Idempotency-Key", `"abc`},
	} {
		for _, path := range []string{"/req/x", "/opt/x"} {
			r := e.post(path, "", "{}", hdr...)
			if r.status != http.StatusBadRequest {
				t.Errorf("%s key on %s: %s, want 400", name, path, r)
			}
		}
	}
	if calls.Load() != 2 {
		t.Errorf("handler ran on an invalid key")
	}
	if n := e.storedKeys(); n != 0 {
		t.Errorf("%d key rows after refused and pass-through requests, want 0", n)
	}
}

// TestQuotedAndBareKeyAreOneKey: the IETF draft's sf-string form and the
// bare form name the same key.
func TestQuotedAndBareKeyAreOneKey(t *testing.T) { eachStore(t, testQuotedAndBareKeyAreOneKey) }

func testQuotedAndBareKeyAreOneKey(t *testing.T, s backend) {
	t.Parallel()
	e := s.setupOrders(t, idempotency.Config{})
	key := uuid.NewString()
	first := e.post("/orders", `"`+key+`"`, "{}")
	requireCreated(t, first)
	requireReplayOf(t, e.post("/orders", key, "{}"), first)
}

// TestBodyLimit: a body above MaxBodyBytes is 413, announced or streamed,
// and nothing is recorded or run.
func TestBodyLimit(t *testing.T) { eachStore(t, testBodyLimit) }

func testBodyLimit(t *testing.T, s backend) {
	t.Parallel()
	var calls atomic.Int32
	e := s.setup(t, idempotency.Config{MaxBodyBytes: 64}, map[string]http.Handler{
		"/req/x": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { calls.Add(1) }),
	})
	if r := e.post("/req/x", "k1", strings.Repeat("x", 64)); r.status != http.StatusOK {
		t.Errorf("body at the limit: %s, want 200", r)
	}
	if r := e.post("/req/x", "k2", strings.Repeat("x", 65)); r.status != http.StatusRequestEntityTooLarge {
		t.Errorf("body over the limit: %s, want 413", r)
	}
	// Unknown length (chunked): the limit holds while reading.
	req, _ := http.NewRequestWithContext(e.ctx, http.MethodPost, e.srv.URL+"/req/x", io.MultiReader(strings.NewReader(strings.Repeat("y", 1000))))
	req.Header.Set("Idempotency-Key", "k3")
	req.ContentLength = -1
	resp, err := freshClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Errorf("chunked body over the limit: %d, want 413", resp.StatusCode)
	}
	if calls.Load() != 1 {
		t.Errorf("handler ran %d times, want 1", calls.Load())
	}
	if n := e.storedKeys(); n != 1 {
		t.Errorf("%d stored keys, want 1 (k1; none for refused requests)", n)
	}
}

// TestServerErrorIsNotRecorded: a handler that writes and then answers 500
// (or panics, or answers a retryable 429) leaves no trace: its writes and the
// key roll back together, and the retry runs the handler afresh.
func TestServerErrorIsNotRecorded(t *testing.T) { eachStore(t, testServerErrorIsNotRecorded) }

func testServerErrorIsNotRecorded(t *testing.T, s backend) {
	t.Parallel()
	for _, fail := range []string{"500", "429", "panic"} {
		t.Run(fail, func(t *testing.T) {
			t.Parallel()
			var calls atomic.Int32
			var e *env
			e = s.setup(t, idempotency.Config{}, map[string]http.Handler{
				"/req/orders": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					if err := e.writeEffect(r); err != nil {
						http.Error(w, err.Error(), http.StatusInternalServerError)
						return
					}
					if calls.Add(1) == 1 {
						switch fail {
						case "500":
							http.Error(w, "boom", http.StatusInternalServerError)
						case "429":
							http.Error(w, "slow down", http.StatusTooManyRequests)
						case "panic":
							panic("handler bug")
						}
						return
					}
					e.answerCreated(w, r)
				}),
			})
			key := uuid.NewString()
			r, err := e.send(freshClient(), http.MethodPost, "/req/orders", key, "{}")
			switch fail {
			case "panic":
				if err == nil {
					t.Fatalf("a panicking handler produced a response: %s", r)
				}
			default:
				if err != nil || r.replayed() || !strings.Contains(string(r.body), map[string]string{"500": "boom", "429": "slow down"}[fail]) {
					t.Fatalf("first request: %v %v, want the handler's own %s", r, err, fail)
				}
			}
			// The Postgres store rolls the failed run's effect back;
			// an effect outside any store (Redis) stays.
			undone := 0
			if e.rollsBack() {
				undone = 1
			}
			if n, k := e.effectsFor(key), e.storedKeys(); n != 1-undone || k != 0 {
				t.Fatalf("after the failed run: %d effect rows, %d stored or held keys; want %d and none", n, k, 1-undone)
			}
			retry := e.post("/req/orders", key, "{}")
			requireCreated(t, retry)
			requireReplayOf(t, e.post("/req/orders", key, "{}"), retry)
			if n := e.effectsFor(key); n != 2-undone || calls.Load() != 2 {
				t.Fatalf("%d effect rows after %d runs, want %d after 2", n, calls.Load(), 2-undone)
			}
		})
	}
}

// TestHandlerTransactionMisuse: the handler cannot commit or roll back the
// middleware's transaction; a success answered over a failed transaction
// becomes a 500 with no effect; a refusal over one passes through unrecorded.
func TestHandlerTransactionMisuse(t *testing.T) {
	t.Parallel()
	var e *env
	e = setup(t, idempotency.Config{}, map[string]http.Handler{
		"/commit": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			tx, _ := idempotency.Tx(r.Context())
			if err := e.writeEffect(r); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			if err := tx.Commit(r.Context()); !errors.Is(err, idempotency.ErrTxOwned) {
				http.Error(w, fmt.Sprintf("Commit: %v, want ErrTxOwned", err), http.StatusInternalServerError)
				return
			}
			if err := tx.Rollback(r.Context()); !errors.Is(err, idempotency.ErrTxOwned) {
				http.Error(w, fmt.Sprintf("Rollback: %v, want ErrTxOwned", err), http.StatusInternalServerError)
				return
			}
			e.answerCreated(w, r)
		}),
		"/failed": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			tx, _ := idempotency.Tx(r.Context())
			if err := e.writeEffect(r); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			_, _ = tx.Exec(r.Context(), "SELECT 1/0") // error swallowed: the transaction is aborted
			if r.URL.Query().Get("refuse") != "" {
				http.Error(w, "bad input", http.StatusBadRequest)
				return
			}
			e.answerCreated(w, r)
		}),
		"/large": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if err := e.writeEffect(r); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			_, _ = w.Write(make([]byte, idempotency.DefaultMaxResponseBytes+1))
		}),
	})
	key := uuid.NewString()
	first := e.post("/commit", key, "{}")
	requireCreated(t, first)
	requireReplayOf(t, e.post("/commit", key, "{}"), first)

	for _, path := range []string{"/failed", "/large"} {
		key := uuid.NewString()
		if r := e.post(path, key, "{}"); r.status != http.StatusInternalServerError || r.header.Get("X-Run") != "" {
			t.Errorf("%s: %s, want the middleware's 500", path, r)
		}
		if n, k := e.effectsFor(key), e.count(e.keys, "key = $1", key); n != 0 || k != 0 {
			t.Errorf("%s: %d effect rows, %d key rows; want none", path, n, k)
		}
	}
	key = uuid.NewString()
	for range 2 {
		if r := e.post("/failed?refuse=1", key, "{}"); r.status != http.StatusBadRequest || r.replayed() || !strings.Contains(string(r.body), "bad input") {
			t.Errorf("refusal over a failed transaction: %s, want the handler's 400, unrecorded", r)
		}
	}
	if k := e.count(e.keys, "key = $1", key); k != 0 {
		t.Errorf("%d key rows for a refusal over a failed transaction, want 0", k)
	}
}

// TestCrashBeforeCommitFreesKey: the server "dies" between the handler's
// writes and the commit (its transaction's backend is terminated, as when
// the process is killed and Postgres notices the connection is gone). The
// key is not stranded: while the first request is alive its key is 409;
// once its connection is gone a retry runs afresh, and there is exactly one
// effect. The first request's own client gets a 5xx, never a success.
func TestCrashBeforeCommitFreesKey(t *testing.T) {
	t.Parallel()
	entered := make(chan int32)
	release := make(chan struct{})
	var calls atomic.Int32
	var e *env
	e = setup(t, idempotency.Config{}, map[string]http.Handler{
		"/req/orders": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if err := e.writeEffect(r); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			if calls.Add(1) == 1 {
				tx, _ := idempotency.Tx(r.Context())
				var pid int32
				if err := tx.QueryRow(r.Context(), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				entered <- pid
				<-release
			}
			e.answerCreated(w, r)
		}),
	})
	key := uuid.NewString()
	first := make(chan response, 1)
	go func() {
		r, err := e.send(freshClient(), http.MethodPost, "/req/orders", key, `{"sku":"D"}`)
		if err != nil {
			t.Errorf("first request: %v", err)
		}
		first <- r
	}()
	pid := <-entered
	if r := e.post("/req/orders", key, `{"sku":"D"}`); r.status != http.StatusConflict {
		t.Fatalf("while the first request runs: %s, want 409", r)
	}

	var killed bool
	if err := e.db.Pool.QueryRow(e.ctx, "SELECT pg_terminate_backend($1)", pid).Scan(&killed); err != nil || !killed {
		t.Fatalf("pg_terminate_backend(%d) = %v, %v", pid, killed, err)
	}
	retry := e.postUntilDone("/req/orders", key, `{"sku":"D"}`)
	requireCreated(t, retry) // a fresh run: the crashed request left nothing behind

	close(release)
	if r := <-first; r.status < 500 {
		t.Errorf("the crashed request's client got %s, want a 5xx", r)
	}
	requireReplayOf(t, e.post("/req/orders", key, `{"sku":"D"}`), retry)
	if n := e.effectsFor(key); n != 1 {
		t.Fatalf("%d effect rows after a crash and a retry, want exactly 1", n)
	}
}

// blockFirstOrder is the orders handler of *e, counting its runs in calls,
// whose first run, after writing its effect, closes entered and waits for
// release.
func blockFirstOrder(e **env, calls *atomic.Int32, entered, release chan struct{}) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := (*e).writeEffect(r); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if calls.Add(1) == 1 {
			close(entered)
			<-release
		}
		(*e).answerCreated(w, r)
	})
}

// TestDatabaseGoneMidRequest: the database becomes unreachable while a
// keyed request's handler runs (key claimed, effect written, transaction
// open). The client gets 503 with Retry-After, nothing of the request is
// left in the database, further requests get 503 while it is away, and the
// retry once it is back runs the handler afresh, once.
func TestDatabaseGoneMidRequest(t *testing.T) {
	t.Parallel()
	entered, release := make(chan struct{}), make(chan struct{})
	proxy := pgtest.NewPostgresProxy(t)
	var e *env
	e = setupVia(t, proxy, idempotency.Config{}, map[string]http.Handler{"/req/orders": blockFirstOrder(&e, new(atomic.Int32), entered, release)})
	key := uuid.NewString()
	first := make(chan response, 1)
	go func() {
		r, err := e.send(freshClient(), http.MethodPost, "/req/orders", key, `{"sku":"E"}`)
		if err != nil {
			t.Errorf("first request: %v", err)
		}
		first <- r
	}()
	<-entered
	proxy.Cut()
	close(release)
	if r := <-first; r.status != http.StatusServiceUnavailable || r.header.Get("Retry-After") == "" {
		t.Fatalf("the request whose database went away: %s, want 503 with Retry-After", r)
	}
	if r := e.post("/req/orders", key, `{"sku":"E"}`); r.status != http.StatusServiceUnavailable || r.header.Get("Retry-After") == "" {
		t.Fatalf("a retry while the database is away: %s, want 503 with Retry-After", r)
	}
	if n := e.effectsFor(key); n != 0 {
		t.Fatalf("%d effect rows of the failed request, want none", n)
	}
	if n := e.count(e.keys, "key = $1", key); n != 0 {
		t.Fatalf("%d key rows of the failed request, want none", n)
	}
	proxy.Restore()
	requireCreated(t, e.postUntilDone("/req/orders", key, `{"sku":"E"}`))
	if n := e.effectsFor(key); n != 1 {
		t.Fatalf("%d effect rows after the retry, want 1", n)
	}
}

// TestCrashAfterCommitReplays: the server "dies" after the commit and
// before the response left (a crash hook aborts the connection). The client
// gets no response; its retry gets the committed response as a replay, and
// the effect happened once.
func TestCrashAfterCommitReplays(t *testing.T) { eachStore(t, testCrashAfterCommitReplays) }

func testCrashAfterCommitReplays(t *testing.T, s backend) {
	t.Parallel()
	var crashes atomic.Int32
	var e *env
	e = s.setup(t, idempotency.Config{}, map[string]http.Handler{
		"/orders": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { e.orders()(w, r) }),
	}, func(m *idempotency.Middleware) {
		idempotency.SetAfterCommitHook(m, func(*http.Request) error {
			if crashes.Add(1) == 1 {
				return errors.New("crash")
			}
			return nil
		})
	})
	key := uuid.NewString()
	if r, err := e.send(freshClient(), http.MethodPost, "/orders", key, `{"sku":"E"}`); err == nil {
		t.Fatalf("the crashed request got a response: %s", r)
	}
	if n := e.effectsFor(key); n != 1 {
		t.Fatalf("%d effect rows after the crash, want the 1 committed", n)
	}
	retry := e.post("/orders", key, `{"sku":"E"}`)
	if !retry.replayed() || retry.status != http.StatusCreated {
		t.Fatalf("retry after a crash after commit: %s, want the replayed 201", retry)
	}
	var id string
	if err := e.db.Pool.QueryRow(e.ctx, `SELECT id FROM `+e.effects+` WHERE key = $1`, key).Scan(&id); err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf(`{"id":%q}`, id); string(retry.body) != want || retry.header.Get("Location") != "/orders/"+id {
		t.Errorf("replay %s does not describe the committed effect %s", retry, id)
	}
	if n := e.effectsFor(key); n != 1 {
		t.Fatalf("%d effect rows after the retry, want 1", n)
	}
}

// TestClientGoneMidRequest: the connection to the client breaks while the
// handler runs (the server closes it). The handler's work still commits with
// its response, and the client's retry gets that response as a replay.
func TestClientGoneMidRequest(t *testing.T) { eachStore(t, testClientGoneMidRequest) }

func testClientGoneMidRequest(t *testing.T, s backend) {
	t.Parallel()
	entered, release := make(chan struct{}), make(chan struct{})
	var calls atomic.Int32
	var e *env
	e = s.setup(t, idempotency.Config{}, map[string]http.Handler{"/req/orders": blockFirstOrder(&e, &calls, entered, release)})
	key := uuid.NewString()
	done := make(chan error, 1)
	go func() {
		r, err := e.send(freshClient(), http.MethodPost, "/req/orders", key, `{"sku":"F"}`)
		if err == nil {
			err = fmt.Errorf("got a response: %s", r)
		}
		done <- err
	}()
	<-entered
	e.srv.CloseClientConnections()
	if err := <-done; err == nil || strings.Contains(err.Error(), "got a response") {
		t.Fatalf("client whose connection was closed: %v, want a transport error", err)
	}
	close(release)
	retry := e.postUntilDone("/req/orders", key, `{"sku":"F"}`)
	if !retry.replayed() || retry.status != http.StatusCreated {
		t.Fatalf("retry: %s, want the replay of the run that lost its client", retry)
	}
	if n := e.effectsFor(key); n != 1 || calls.Load() != 1 {
		t.Fatalf("%d effect rows, %d runs; want 1 and 1", n, calls.Load())
	}
}

// TestScopeIsolation: with a Scope function, two clients that send the
// same key and body get two independent requests.
func TestScopeIsolation(t *testing.T) { eachStore(t, testScopeIsolation) }

func testScopeIsolation(t *testing.T, s backend) {
	t.Parallel()
	var e *env
	e = s.setup(t, idempotency.Config{Scope: func(r *http.Request) string { return r.Header.Get("X-Client") }},
		map[string]http.Handler{"/req/orders": http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { e.orders()(w, r) })})
	key := uuid.NewString()
	a := e.post("/req/orders", key, "{}", "X-Client", "alice")
	b := e.post("/req/orders", key, "{}", "X-Client", "bob")
	requireCreated(t, a)
	requireCreated(t, b)
	if bytes.Equal(a.body, b.body) {
		t.Fatal("both clients got the same run")
	}
	requireReplayOf(t, e.post("/req/orders", key, "{}", "X-Client", "alice"), a)
	requireReplayOf(t, e.post("/req/orders", key, "{}", "X-Client", "bob"), b)
	if n := e.effectsFor(key); n != 2 {
		t.Errorf("%d effect rows for two clients, want 2", n)
	}
	if !e.stored("alice", key) || !e.stored("bob", key) {
		t.Errorf("want a stored key per scope")
	}
	// A scope that cannot be stored is the server's error, not the client's.
	if r := e.post("/req/orders", key, "{}", "X-Client", "bad\xffscope"); r.status != http.StatusInternalServerError {
		t.Errorf("invalid scope: %s, want 500", r)
	}
}

// TestClientsAreIndependentByDefault: with the default config, the key
// space is the client that the request's context names (WithClient): two
// clients with the same key and body get two runs, each replayed to its own
// client only; a keyed request that names no client is refused with 401
// before the handler runs. GlobalScope is the explicit opt-in to one shared
// key space.
func TestClientsAreIndependentByDefault(t *testing.T) {
	eachStore(t, testClientsAreIndependentByDefault)
}

func testClientsAreIndependentByDefault(t *testing.T, s backend) {
	t.Parallel()
	e := s.setupOrders(t, idempotency.Config{})
	key := uuid.NewString()
	a := e.post("/orders", key, "{}", "X-Client", "alice")
	b := e.post("/orders", key, "{}", "X-Client", "bob")
	requireCreated(t, a)
	requireCreated(t, b)
	if bytes.Equal(a.body, b.body) {
		t.Fatal("two clients with one key got the same run")
	}
	requireReplayOf(t, e.post("/orders", key, "{}", "X-Client", "alice"), a)
	requireReplayOf(t, e.post("/orders", key, "{}", "X-Client", "bob"), b)
	if n := e.effectsFor(key); n != 2 {
		t.Errorf("%d effect rows for two clients, want 2", n)
	}
	anon := e.post("/orders", uuid.NewString(), "{}", "X-Anonymous", "1")
	if anon.status != http.StatusUnauthorized || anon.header.Get("Content-Type") != "application/problem+json" {
		t.Fatalf("keyed request naming no client: %s, want 401 problem", anon)
	}
	if n := e.count(e.effects, "true"); n != 2 {
		t.Errorf("the refused request ran the handler: %d effect rows, want 2", n)
	}

	g := s.setupOrders(t, idempotency.Config{GlobalScope: true})
	first := g.post("/orders", key, "{}", "X-Client", "alice")
	requireCreated(t, first)
	requireReplayOf(t, g.post("/orders", key, "{}", "X-Client", "bob"), first)
	requireReplayOf(t, g.post("/orders", key, "{}", "X-Anonymous", "1"), first)
	if n := g.effectsFor(key); n != 1 {
		t.Errorf("GlobalScope: %d effect rows, want 1", n)
	}
}

// TestExpiredKeyIsFree: once its TTL has passed (by database time), a key
// runs afresh, even for another request, before cleanup deleted its row.
func TestExpiredKeyIsFree(t *testing.T) {
	t.Parallel()
	e := setupOrders(t, idempotency.Config{})
	key := uuid.NewString()
	requireCreated(t, e.post("/orders", key, `{"v":1}`))
	if _, err := e.db.Pool.Exec(e.ctx, `UPDATE `+e.keys+` SET expires_at = now() - interval '1 second' WHERE key = $1`, key); err != nil {
		t.Fatal(err)
	}
	second := e.post("/orders", key, `{"v":2}`)
	requireCreated(t, second)
	requireReplayOf(t, e.post("/orders", key, `{"v":2}`), second)
	if n := e.effectsFor(key); n != 2 {
		t.Errorf("%d effect rows, want 2 (one per TTL period)", n)
	}
	var ttl int64
	if err := e.db.Pool.QueryRow(e.ctx, `SELECT extract(epoch FROM expires_at - created_at)::bigint
		FROM `+e.keys+` WHERE key = $1`, key).Scan(&ttl); err != nil {
		t.Fatal(err)
	}
	if want := int64(idempotency.DefaultTTL.Seconds()); ttl != want {
		t.Errorf("expires_at - created_at = %d s, want the default TTL, %d s", ttl, want)
	}
}

// seedKeys inserts n completed key rows in scope whose expires_at is
// offset from database now.
func (e *env) seedKeys(scope string, n int, offset string) {
	e.t.Helper()
	_, err := e.db.Pool.Exec(e.ctx, `INSERT INTO `+e.keys+` (scope, key, fingerprint, status, expires_at)
		SELECT $1, 'k' || i, '\x00', 201, now() + $3::interval FROM generate_series(1, $2::int) AS i`, scope, n, offset)
	if err != nil {
		e.t.Fatalf("seed %s: %v", scope, err)
	}
}

// TestDeleteExpired deletes expired rows only, in batches smaller than the
// backlog, and steps over a row another transaction holds.
func TestDeleteExpired(t *testing.T) {
	t.Parallel()
	e := setup(t, idempotency.Config{CleanupBatchSize: 3}, nil)
	e.seedKeys("expired", 10, "-1 second")
	e.seedKeys("live", 5, "1 hour")

	// A row held by an open transaction (as a request taking it over would)
	// is skipped, not waited for.
	tx, err := e.db.Pool.Begin(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(e.ctx)
	if _, err := tx.Exec(e.ctx, `SELECT 1 FROM `+e.keys+` WHERE scope = 'expired' AND key = 'k1' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	n, err := e.mw.DeleteExpired(e.ctx)
	if err != nil || n != 9 {
		t.Fatalf("DeleteExpired = %d, %v; want 9 (10 expired, 1 held)", n, err)
	}
	if err := tx.Rollback(e.ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := e.mw.DeleteExpired(e.ctx); err != nil || n != 1 {
		t.Fatalf("DeleteExpired after the holder ended = %d, %v; want 1", n, err)
	}
	if n, err := e.mw.DeleteExpired(e.ctx); err != nil || n != 0 {
		t.Fatalf("DeleteExpired with nothing expired = %d, %v; want 0", n, err)
	}
	if got := e.count(e.keys, "scope = 'live'"); got != 5 {
		t.Errorf("%d live rows left, want all 5", got)
	}
	if got := e.count(e.keys, "scope = 'expired'"); got != 0 {
		t.Errorf("%d expired rows left, want 0", got)
	}
}

// TestRunCleansUp: Run deletes expired rows at once and returns nil when
// its context ends.
func TestRunCleansUp(t *testing.T) {
	t.Parallel()
	e := setup(t, idempotency.Config{CleanupBatchSize: 4, CleanupInterval: 10 * time.Millisecond}, nil)
	e.seedKeys("expired", 9, "-1 minute")
	e.seedKeys("live", 2, "1 hour")
	ctx, cancel := context.WithCancel(e.ctx)
	done := make(chan error, 1)
	go func() { done <- e.mw.Run(ctx) }()
	deadline := time.Now().Add(10 * time.Second)
	for e.count(e.keys, "scope = 'expired'") != 0 {
		if time.Now().After(deadline) {
			t.Fatal("Run left expired rows for 10 s")
		}
		time.Sleep(5 * time.Millisecond) // polling a condition with a deadline
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run = %v, want nil after cancel", err)
	}
	if got := e.count(e.keys, "scope = 'live'"); got != 2 {
		t.Errorf("%d live rows left, want 2", got)
	}
}

func TestNewValidates(t *testing.T) {
	t.Parallel()
	db := pgtest.Postgres(t)
	for _, tc := range []struct {
		cfg   idempotency.Config
		field string
	}{
		{idempotency.Config{Schema: "Bad"}, "Config.Schema"},
		{idempotency.Config{Schema: `x"; drop table y`}, "Config.Schema"},
		{idempotency.Config{Header: "Idempotency Key"}, "Config.Header"},
		{idempotency.Config{Header: "Key:"}, "Config.Header"},
		{idempotency.Config{MaxKeyLength: -1}, "Config.MaxKeyLength"},
		{idempotency.Config{MaxKeyLength: idempotency.MaxKeyLengthLimit + 1}, "Config.MaxKeyLength"},
		{idempotency.Config{Methods: []string{}}, "Config.Methods"},
		{idempotency.Config{Methods: []string{"PO ST"}}, "Config.Methods"},
		{idempotency.Config{MaxBodyBytes: -1}, "Config.MaxBodyBytes"},
		{idempotency.Config{MaxBodyBytes: idempotency.MaxBytesLimit + 1}, "Config.MaxBodyBytes"},
		{idempotency.Config{MaxResponseBytes: -5}, "Config.MaxResponseBytes"},
		{idempotency.Config{ReplayHeaders: []string{"Bad Header"}}, "Config.ReplayHeaders"},
		{idempotency.Config{ReplayHeaders: []string{"content-length"}}, "Config.ReplayHeaders"},
		{idempotency.Config{ReplayHeaders: []string{"Idempotent-Replayed"}}, "Config.ReplayHeaders"},
		{idempotency.Config{ReplayHeaders: []string{"keep-alive"}}, "Config.ReplayHeaders"},
		{idempotency.Config{ReplayHeaders: []string{"Upgrade"}}, "Config.ReplayHeaders"},
		{idempotency.Config{ReplayHeaders: []string{"TE"}}, "Config.ReplayHeaders"},
		{idempotency.Config{ReplayHeaders: []string{"Proxy-Authenticate"}}, "Config.ReplayHeaders"},
		{idempotency.Config{GlobalScope: true, Scope: func(*http.Request) string { return "x" }}, "Config.GlobalScope"},
		{idempotency.Config{TTL: -time.Hour}, "Config.TTL"},
		{idempotency.Config{TTL: time.Millisecond}, "Config.TTL"},
		{idempotency.Config{RetryAfter: -time.Second}, "Config.RetryAfter"},
		{idempotency.Config{CommitTimeout: -time.Second}, "Config.CommitTimeout"},
		{idempotency.Config{CleanupInterval: -time.Second}, "Config.CleanupInterval"},
		{idempotency.Config{CleanupBatchSize: -1}, "Config.CleanupBatchSize"},
	} {
		m, err := idempotency.New(db.Pool, tc.cfg)
		if err == nil {
			t.Errorf("New(%+v) = %v, nil; want an error", tc.cfg, m)
			continue
		}
		if !strings.Contains(err.Error(), tc.field) {
			t.Errorf("New(%+v) error %q does not name %s", tc.cfg, err, tc.field)
		}
	}
	if _, err := idempotency.New(nil, idempotency.Config{}); err == nil {
		t.Error("New(nil db) succeeded, want an error")
	}
	m, err := idempotency.New(db.Pool, idempotency.Config{})
	if err != nil {
		t.Fatalf("New with defaults: %v", err)
	}
	if m.Schema() != sqlident.DefaultSchema {
		t.Errorf("default schema %q, want %q", m.Schema(), sqlident.DefaultSchema)
	}
}

// TestTxAbsentOutsideMiddleware: Tx and Key report false on a plain context.
func TestTxAbsentOutsideMiddleware(t *testing.T) {
	t.Parallel()
	if _, ok := idempotency.Tx(context.Background()); ok {
		t.Error("Tx reports a transaction on a bare context")
	}
	if _, _, ok := idempotency.Key(context.Background()); ok {
		t.Error("Key reports a key on a bare context")
	}
}

// TestLockTimeoutIs409: a key row held by a transaction outside the
// middleware (so without the advisory lock) makes the claim wait for a row
// lock; under a lock_timeout the wait ends with SQLSTATE 55P03, which the
// middleware answers with 409 and Retry-After, not 503. Once the holder is
// gone the key runs.
func TestLockTimeoutIs409(t *testing.T) {
	t.Parallel()
	e := setup(t, idempotency.Config{}, nil)
	url := e.db.URL + "?lock_timeout=100ms"
	if strings.Contains(e.db.URL, "?") {
		url = e.db.URL + "&lock_timeout=100ms"
	}
	pool, err := pgtest.NewPool(e.ctx, url, e.db.Schema, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	mw, err := idempotency.New(pool, idempotency.Config{Schema: e.db.Schema, GlobalScope: true})
	if err != nil {
		t.Fatal(err)
	}
	h := mw.Require(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { e.orders()(w, r) }))
	serve := func(key string) *httptest.ResponseRecorder {
		req := httptest.NewRequestWithContext(e.ctx, http.MethodPost, "/orders", strings.NewReader("{}"))
		req.Header.Set("Idempotency-Key", key)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}

	key := uuid.NewString()
	holder, err := e.db.Pool.Begin(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(e.ctx)
	if _, err := holder.Exec(e.ctx, `INSERT INTO `+e.keys+` (scope, key, fingerprint, expires_at)
		VALUES ('', $1, '\x00', now() + interval '1 hour')`, key); err != nil {
		t.Fatal(err)
	}
	if rec := serve(key); rec.Code != http.StatusConflict || rec.Header().Get("Retry-After") == "" {
		t.Fatalf("key row held by another transaction: %d %v %s, want 409 with Retry-After", rec.Code, rec.Header(), rec.Body)
	}
	if err := holder.Rollback(e.ctx); err != nil {
		t.Fatal(err)
	}
	if rec := serve(key); rec.Code != http.StatusCreated {
		t.Fatalf("after the holder rolled back: %d %s, want 201", rec.Code, rec.Body)
	}
	if n := e.effectsFor(key); n != 1 {
		t.Errorf("%d effect rows, want 1", n)
	}
}
