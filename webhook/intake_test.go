package webhook

import (
	"cmp"
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/oncely/oncely/idempotency"
	"github.com/oncely/oncely/idempotency/redisstore"
	"github.com/oncely/oncely/internal/pgtest"
)

// intakeStore is one store an Intake's tests run on, and how to count the
// keys it holds (claimed or recorded).
type intakeStore struct {
	name string
	new  func(t *testing.T) (*idempotency.Middleware, func() int)
}

var intakeStores = []intakeStore{
	{"postgres", func(t *testing.T) (*idempotency.Middleware, func() int) {
		db := pgtest.Migrate(t, pgtest.Postgres(t))
		mw, err := idempotency.New(db.Pool, idempotency.Config{Schema: db.Schema})
		if err != nil {
			t.Fatal(err)
		}
		return mw, func() int {
			var n int
			if err := db.Pool.QueryRow(context.Background(), `SELECT count(*) FROM idempotency_keys`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		}
	}},
	{"redis", func(t *testing.T) (*idempotency.Middleware, func() int) {
		rdb := redis.NewClient(&redis.Options{Addr: cmp.Or(os.Getenv("REDIS_ADDR"), "127.0.0.1:6379")})
		t.Cleanup(func() { _ = rdb.Close() })
		if err := rdb.Ping(t.Context()).Err(); err != nil {
			t.Fatalf("Redis (REDIS_ADDR, default 127.0.0.1:6379): %v", err)
		}
		prefix := "oncely-test:" + pgtest.UniqueName("intake") + ":"
		keys := func() []string {
			ks, err := rdb.Keys(context.Background(), prefix+"*").Result()
			if err != nil {
				t.Fatal(err)
			}
			return ks
		}
		t.Cleanup(func() {
			if ks := keys(); len(ks) > 0 {
				rdb.Del(context.Background(), ks...)
			}
		})
		store, err := redisstore.New(rdb, redisstore.Config{Prefix: prefix})
		if err != nil {
			t.Fatal(err)
		}
		mw, err := idempotency.NewWithStore(store, idempotency.Config{})
		if err != nil {
			t.Fatal(err)
		}
		return mw, func() int { return len(keys()) }
	}},
}

// newIntake serves an Intake of Standard Webhooks deliveries on store with
// handler.
func newIntake(t *testing.T, mw *idempotency.Middleware, h http.Handler) (*Intake, *httptest.Server) {
	t.Helper()
	in, err := NewIntake(IntakeConfig{Verifier: mustVerifier(t, NewStandardWebhooks, VerifierConfig{Secrets: []string{testSecret}}),
		Idempotency: mw, Handler: h, MaxBodyBytes: 1 << 10})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(in)
	t.Cleanup(srv.Close)
	return in, srv
}

// delivery is the Standard Webhooks delivery id with body, signed now (a
// provider signs each redelivery afresh).
func delivery(t *testing.T, url, id, body string) *http.Request {
	t.Helper()
	return signedRequest(t, url, testSecret, id, strings.NewReader(body), body, time.Now())
}

// 25 copies of one delivery at once run the handler once: the first holds
// the key while the others are answered 409 (in progress); a redelivery
// afterwards gets the handler's answer replayed byte for byte. The
// handler sees the delivery id as its key, scoped to the provider.
func TestIntakeRunsEachDeliveryOnce(t *testing.T) {
	for _, st := range intakeStores {
		t.Run(st.name, func(t *testing.T) {
			mw, _ := st.new(t)
			var runs atomic.Int32
			entered, release := make(chan struct{}), make(chan struct{})
			var gotScope, gotKey string
			in, srv := newIntake(t, mw, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				gotScope, gotKey, _ = idempotency.Key(r.Context())
				close(entered)
				<-release
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusOK)
				_, _ = w.Write([]byte(`{"charged":"ch_1"}`))
			}))
			const copies = 25
			type answer struct {
				status int
				header http.Header
				body   string
			}
			answers := make(chan answer, copies)
			var wg sync.WaitGroup
			first := func() {
				code, h, b := do(t, delivery(t, srv.URL, "msg_1", `{"amount":100}`))
				answers <- answer{code, h, b}
			}
			wg.Go(first)
			<-entered
			for range copies - 1 {
				wg.Go(first)
			}
			for range copies - 1 { // the others, while the first holds the key
				if a := <-answers; a.status != http.StatusConflict {
					t.Errorf("a copy while the first runs: %d %q, want 409", a.status, a.body)
				}
			}
			close(release)
			wg.Wait()
			if a := <-answers; a.status != http.StatusOK || a.body != `{"charged":"ch_1"}` {
				t.Fatalf("the first: %d %q", a.status, a.body)
			}
			code, h, b := do(t, delivery(t, srv.URL, "msg_1", `{"amount":100}`))
			if code != http.StatusOK || b != `{"charged":"ch_1"}` || h.Get(idempotency.ReplayedHeader) != "true" || h.Get("Content-Type") != "application/json" {
				t.Fatalf("redelivery: %d %q %v, want the first answer replayed", code, b, h)
			}
			if n := runs.Load(); n != 1 {
				t.Fatalf("handler ran %d times, want 1", n)
			}
			if gotScope != ProviderStandardWebhooks || gotKey != "msg_1" {
				t.Errorf("handler's key (%q, %q), want (%q, msg_1)", gotScope, gotKey, ProviderStandardWebhooks)
			}
			if s := in.Stats(); s.Handled != copies+1 || s.Refused != 0 {
				t.Errorf("stats %+v, want %d handled, 0 refused", s, copies+1)
			}
		})
	}
}

// Requests that fail the verification are refused before the store sees
// them: nothing is claimed or recorded, the handler does not run, and the
// genuine delivery with the same id runs afterwards. A client's own
// Idempotency-Key header cannot choose the key.
func TestIntakeRefusesBeforeClaiming(t *testing.T) {
	for _, st := range intakeStores {
		t.Run(st.name, func(t *testing.T) {
			mw, keys := st.new(t)
			var runs atomic.Int32
			in, srv := newIntake(t, mw, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				w.WriteHeader(http.StatusNoContent)
			}))
			forged := signedRequest(t, srv.URL, "whsec_"+strings.Repeat("A", 32), "msg_2", strings.NewReader(`{}`), `{}`, time.Now())
			if code, _, body := do(t, forged); code != http.StatusUnauthorized || strings.Contains(body, "msg_2") {
				t.Errorf("wrong secret: %d %q, want a terse 401", code, body)
			}
			tampered := signedRequest(t, srv.URL, testSecret, "msg_2", strings.NewReader(`{"amount":1}`), `{}`, time.Now())
			if code, _, _ := do(t, tampered); code != http.StatusUnauthorized {
				t.Errorf("tampered body: %d, want 401", code)
			}
			stale := signedRequest(t, srv.URL, testSecret, "msg_2", strings.NewReader(`{}`), `{}`, time.Now().Add(-time.Hour))
			if code, _, _ := do(t, stale); code != http.StatusUnauthorized {
				t.Errorf("stale timestamp: %d, want 401", code)
			}
			big := strings.Repeat("x", 2<<10)
			if code, _, _ := do(t, delivery(t, srv.URL, "msg_2", big)); code != http.StatusRequestEntityTooLarge {
				t.Errorf("oversized body: %d, want 413", code)
			}
			get := delivery(t, srv.URL, "msg_2", "")
			get.Method = http.MethodGet
			if code, _, _ := do(t, get); code != http.StatusMethodNotAllowed {
				t.Errorf("GET: %d, want 405", code)
			}
			if n, k := runs.Load(), keys(); n != 0 || k != 0 {
				t.Fatalf("after refusals: handler ran %d times, store holds %d keys; want 0 and 0", n, k)
			}
			genuine := delivery(t, srv.URL, "msg_2", `{}`)
			genuine.Header.Set(idempotency.DefaultHeader, "chosen-by-client")
			if code, _, _ := do(t, genuine); code != http.StatusNoContent {
				t.Fatalf("genuine delivery: %d, want 204", code)
			}
			again := delivery(t, srv.URL, "msg_2", `{}`)
			again.Header.Set(idempotency.DefaultHeader, "another-one")
			if code, h, _ := do(t, again); code != http.StatusNoContent || h.Get(idempotency.ReplayedHeader) != "true" {
				t.Fatalf("redelivery with another client key: %d, replayed %q; want the delivery id to be the key", code, h.Get(idempotency.ReplayedHeader))
			}
			if n := runs.Load(); n != 1 {
				t.Errorf("handler ran %d times, want 1", n)
			}
			if s := in.Stats(); s.Refused != 5 || s.Handled != 2 {
				t.Errorf("stats %+v, want 5 refused, 2 handled", s)
			}
		})
	}
}

// A handler that answers 5xx is not recorded: the provider's retry runs it
// again, and the answer of the run that succeeds is replayed after that.
func TestIntakeFailedDeliveryRunsAgain(t *testing.T) {
	for _, st := range intakeStores {
		t.Run(st.name, func(t *testing.T) {
			mw, _ := st.new(t)
			var runs atomic.Int32
			_, srv := newIntake(t, mw, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if runs.Add(1) == 1 {
					http.Error(w, "provider unavailable", http.StatusBadGateway)
					return
				}
				_, _ = w.Write([]byte("done"))
			}))
			if code, _, _ := do(t, delivery(t, srv.URL, "msg_3", `{}`)); code != http.StatusBadGateway {
				t.Fatalf("first: %d, want 502", code)
			}
			if code, h, b := do(t, delivery(t, srv.URL, "msg_3", `{}`)); code != http.StatusOK || b != "done" || h.Get(idempotency.ReplayedHeader) != "" {
				t.Fatalf("retry: %d %q, want a fresh run", code, b)
			}
			if code, h, b := do(t, delivery(t, srv.URL, "msg_3", `{}`)); code != http.StatusOK || b != "done" || h.Get(idempotency.ReplayedHeader) != "true" {
				t.Fatalf("redelivery: %d %q, want the replay", code, b)
			}
			if n := runs.Load(); n != 2 {
				t.Errorf("handler ran %d times, want 2", n)
			}
		})
	}
}

func TestIntakeConfigErrors(t *testing.T) {
	v := mustVerifier(t, NewStandardWebhooks, VerifierConfig{Secrets: []string{testSecret}})
	mw, err := idempotency.NewWithStore(nopStore{}, idempotency.Config{})
	if err != nil {
		t.Fatal(err)
	}
	h := http.NotFoundHandler()
	for field, cfg := range map[string]IntakeConfig{
		"Verifier":     {Idempotency: mw, Handler: h},
		"Idempotency":  {Verifier: v, Handler: h},
		"Handler":      {Verifier: v, Idempotency: mw},
		"MaxBodyBytes": {Verifier: v, Idempotency: mw, Handler: h, MaxBodyBytes: -1},
		"IDPrefix":     {Verifier: v, Idempotency: mw, Handler: h, IDPrefix: strings.Repeat("p", idempotency.DefaultMaxKeyLength)},
	} {
		if _, err := NewIntake(cfg); err == nil || !strings.Contains(err.Error(), "IntakeConfig."+field) {
			t.Errorf("%s: error %v, want it named", field, err)
		}
	}
}

// nopStore is a Store for configuration tests: it is never called.
type nopStore struct{}

func (nopStore) Claim(context.Context, string, string, []byte, time.Duration) (idempotency.Claim, error) {
	panic("nopStore: not for requests")
}
