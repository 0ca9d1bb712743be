package redisstore_test

import (
	"cmp"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/oncely/oncely/idempotency"
	"github.com/oncely/oncely/idempotency/redisstore"
	"github.com/oncely/oncely/internal/handredis"
	"github.com/oncely/oncely/internal/pgtest"
	"github.com/oncely/oncely/webhook"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// redisAddr is the tests' Redis (REDIS_ADDR, default 127.0.0.1:6379).
var redisAddr = cmp.Or(os.Getenv("REDIS_ADDR"), "127.0.0.1:6379")

// prefix returns a key prefix of the test's own, whose keys are deleted
// when the test ends.
func prefix(t *testing.T) string {
	t.Helper()
	p := "oncely-test:" + uuid.NewString() + ":"
	rdb := client(t, redisAddr)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		var keys []string
		iter := rdb.Scan(ctx, 0, p+"*", 1000).Iterator()
		for iter.Next(ctx) {
			keys = append(keys, iter.Val())
		}
		if len(keys) > 0 {
			_ = rdb.Del(ctx, keys...).Err()
		}
	})
	return p
}

// client returns a Redis client of addr, closed when the test ends. It
// does not retry: a test that cuts Redis off wants the error at once.
func client(t *testing.T, addr string) *redis.Client {
	t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialTimeout: time.Second})
	t.Cleanup(func() { _ = rdb.Close() })
	return rdb
}

func newStore(t *testing.T, rdb redis.UniversalClient, cfg redisstore.Config) *redisstore.Store {
	t.Helper()
	s, err := redisstore.New(rdb, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// serve starts a server that names client "c" and runs h behind mw.
func serve(t *testing.T, mw func(http.Handler) http.Handler, h http.Handler) *httptest.Server {
	t.Helper()
	inner := mw(h)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		inner.ServeHTTP(w, r.WithContext(idempotency.WithClient(r.Context(), "c")))
	}))
	t.Cleanup(srv.Close)
	return srv
}

type response struct {
	status int
	header http.Header
	body   string
}

func (r response) String() string { return fmt.Sprintf("%d %v %q", r.status, r.header, r.body) }

func post(t *testing.T, srv *httptest.Server, key, body string) response {
	t.Helper()
	r, err := send(t, srv, key, body)
	if err != nil {
		t.Fatalf("POST: %v", err)
	}
	return r
}

// send is post for goroutines: it returns the error.
func send(t *testing.T, srv *httptest.Server, key, body string) (response, error) {
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/orders", strings.NewReader(body))
	if err != nil {
		return response{}, err
	}
	req.Header.Set("Idempotency-Key", key)
	resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Do(req)
	if err != nil {
		return response{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return response{resp.StatusCode, resp.Header, string(b)}, err
}

// sendAsync sends a POST from a goroutine; its response arrives on the
// channel (a failed send is an error of the test, and a zero response).
func sendAsync(t *testing.T, srv *httptest.Server, key, body string) <-chan response {
	ch := make(chan response, 1)
	go func() {
		r, err := send(t, srv, key, body)
		if err != nil {
			t.Errorf("POST: %v", err)
		}
		ch <- r
	}()
	return ch
}

// postUntil repeats a POST while it gets 409, up to a deadline.
func postUntil(t *testing.T, srv *httptest.Server, key, body string) response {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for wait := time.Millisecond; ; wait = min(2*wait, 50*time.Millisecond) {
		r := post(t, srv, key, body)
		if r.status != http.StatusConflict {
			return r
		}
		if time.Now().After(deadline) {
			t.Fatalf("still 409 after 20 s: %s", r)
		}
		time.Sleep(wait) // polling a condition with a deadline
	}
}

// blockingHandler answers 201 with "run-N" for its Nth run; its first run
// closes entered and waits for release before answering.
func blockingHandler(runs *atomic.Int32, entered, release chan struct{}) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		if n == 1 {
			close(entered)
			<-release
		}
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "run-%d", n)
	})
}

// staleStore is the lock-expiry race. Replica A takes a key and its handler
// runs long; A loses Redis (a proxy between them is cut), so its lock
// cannot be extended and lapses; replica B's retry then takes the key, runs
// and records "run-2". Then A gets Redis back and its handler finishes. It
// returns A's answer, B's answer and what a later retry is replayed.
func staleStore(t *testing.T, mw func(rdb *redis.Client) func(http.Handler) http.Handler) (a, b, replay response) {
	t.Helper()
	proxy := pgtest.NewTCPProxy(t, redisAddr)
	var runs atomic.Int32
	entered, release := make(chan struct{}), make(chan struct{})
	h := blockingHandler(&runs, entered, release)
	srvA := serve(t, mw(client(t, proxy.Addr)), h)
	srvB := serve(t, mw(client(t, redisAddr)), h)

	key := uuid.NewString()
	first := sendAsync(t, srvA, key, "{}")
	<-entered
	proxy.Cut()
	b = postUntil(t, srvB, key, "{}") // 409 until A's lock lapses
	proxy.Restore()
	close(release)
	a = <-first
	replay = post(t, srvB, key, "{}")
	if runs.Load() != 2 {
		t.Fatalf("handler ran %d times, want 2 (A, then B after A's lock lapsed)", runs.Load())
	}
	return a, b, replay
}

// TestStaleClaimCannotStore: the fencing token refuses the store of a
// request whose lock lapsed while a newer request took the key: the newer
// request's response stays recorded and is what retries get; the stale
// request's client gets 409 and its retry gets that response too.
func TestStaleClaimCannotStore(t *testing.T) {
	t.Parallel()
	p := prefix(t)
	a, b, replay := staleStore(t, func(rdb *redis.Client) func(http.Handler) http.Handler {
		s := newStore(t, rdb, redisstore.Config{Prefix: p, LockTTL: 300 * time.Millisecond, Heartbeat: 100 * time.Millisecond})
		m, err := idempotency.NewWithStore(s, idempotency.Config{})
		if err != nil {
			t.Fatal(err)
		}
		return m.Handler
	})
	if b.status != http.StatusCreated || b.body != "run-2" || b.header.Get(idempotency.ReplayedHeader) != "" {
		t.Fatalf("B after A's lock lapsed: %s, want a fresh 201 run-2", b)
	}
	if a.status != http.StatusConflict || a.header.Get("Retry-After") == "" {
		t.Errorf("A, whose claim was taken over: %s, want 409 with Retry-After", a)
	}
	if replay.status != http.StatusCreated || replay.body != "run-2" || replay.header.Get(idempotency.ReplayedHeader) != "true" {
		t.Fatalf("replay: %s, want B's run-2 replayed (A's stale response must not overwrite it)", replay)
	}
}

// TestHandWrittenStoresStale runs the same race against the hand-written
// SET NX + GET middleware (internal/handredis): with nothing to fence it,
// A's stale response overwrites B's, so a retry is replayed a response
// that differs from the one B's client got. This is the failure that
// TestStaleClaimCannotStore rules out.
func TestHandWrittenStoresStale(t *testing.T) {
	t.Parallel()
	p := prefix(t)
	_, b, replay := staleStore(t, func(rdb *redis.Client) func(http.Handler) http.Handler {
		m := &handredis.Middleware{RDB: rdb, Prefix: p, LockTTL: 300 * time.Millisecond, TTL: time.Hour}
		return m.Handler
	})
	if b.body != "run-2" {
		t.Fatalf("B: %s, want run-2", b)
	}
	if replay.body != "run-1" {
		t.Fatalf("hand-written replay: %s; expected A's stale run-1 to have overwritten B's response", replay)
	}
}

// TestRedisGoneMidRequest: Redis becomes unreachable while a request's
// handler runs (a proxy is cut; the server is not restarted). The request
// gets 503 with Retry-After, so does a request while Redis is away, and
// once Redis is back the key is not stranded: a retry runs afresh as soon
// as the unrecorded claim's lock lapses, and is then replayed.
func TestRedisGoneMidRequest(t *testing.T) {
	t.Parallel()
	proxy := pgtest.NewTCPProxy(t, redisAddr)
	var runs atomic.Int32
	entered, release := make(chan struct{}), make(chan struct{})
	s := newStore(t, client(t, proxy.Addr), redisstore.Config{Prefix: prefix(t), LockTTL: 500 * time.Millisecond})
	m, err := idempotency.NewWithStore(s, idempotency.Config{})
	if err != nil {
		t.Fatal(err)
	}
	srv := serve(t, m.Require, blockingHandler(&runs, entered, release))
	key := uuid.NewString()
	first := sendAsync(t, srv, key, "{}")
	<-entered
	proxy.Cut()
	close(release)
	if r := <-first; r.status != http.StatusServiceUnavailable || r.header.Get("Retry-After") == "" || !strings.Contains(r.body, "safe to retry") {
		t.Fatalf("the request whose Redis went away: %s, want 503 with Retry-After", r)
	}
	if r := post(t, srv, key, "{}"); r.status != http.StatusServiceUnavailable || r.header.Get("Retry-After") == "" {
		t.Fatalf("a retry while Redis is away: %s, want 503 with Retry-After", r)
	}
	proxy.Restore()
	retry := postUntil(t, srv, key, "{}")
	if retry.status != http.StatusCreated || retry.body != "run-2" || retry.header.Get(idempotency.ReplayedHeader) != "" {
		t.Fatalf("retry after Redis came back: %s, want a fresh 201 run-2", retry)
	}
	if r := post(t, srv, key, "{}"); r.body != "run-2" || r.header.Get(idempotency.ReplayedHeader) != "true" {
		t.Fatalf("replay: %s, want run-2 replayed", r)
	}
}

// TestFencingToken drives the Store directly: a claim whose lock lapsed
// (no heartbeat) is succeeded by a newer claim with another token; the
// stale lease's Record is refused with ErrLeaseLost, its Release frees
// nothing of the newer claim, and the newer one's response is stored.
func TestFencingToken(t *testing.T) {
	t.Parallel()
	rdb := client(t, redisAddr)
	s := newStore(t, rdb, redisstore.Config{Prefix: prefix(t), LockTTL: 200 * time.Millisecond})
	ctx := context.Background()
	fp := []byte("fp")
	old := takenClaim(t, s, "k", time.Hour)
	if c, err := s.Claim(ctx, "c", "k", fp, time.Hour); err != nil || c.State != idempotency.ClaimBusy {
		t.Fatalf("claim while held: %+v, %v; want busy", c, err)
	}
	key := s.Key("c", "k")
	oldLock := rdb.Get(ctx, key).Val()
	waitGone(t, rdb, key)
	cur := takenClaim(t, s, "k", time.Hour)
	curLock := rdb.Get(ctx, key).Val()
	if len(oldLock) != 33 || oldLock[0] != 'L' || len(curLock) != 33 || curLock[0] != 'L' || oldLock == curLock {
		t.Fatalf("locks %q then %q, want two different L<token> values", oldLock, curLock)
	}
	want := idempotency.StoredResponse{Fingerprint: fp, Status: 201, Names: []string{"Content-Type"}, Values: []string{"a\x80b"}, Body: []byte{0, 1, 2}}
	if err := old.Lease.Record(ctx, idempotency.StoredResponse{Fingerprint: fp, Status: 200, Body: []byte("stale")}); !errors.Is(err, idempotency.ErrLeaseLost) {
		t.Fatalf("stale Record = %v, want ErrLeaseLost", err)
	}
	old.Lease.Release(ctx)
	if got := rdb.Get(ctx, key).Val(); got != curLock {
		t.Fatalf("after the stale lease's Record and Release the key holds %q, want the current claim's lock %q", got, curLock)
	}
	if err := cur.Lease.Record(ctx, want); err != nil {
		t.Fatalf("current Record: %v", err)
	}
	cur.Lease.Release(ctx)
	got, err := s.Claim(ctx, "c", "k", fp, time.Hour)
	if err != nil || got.State != idempotency.ClaimStored {
		t.Fatalf("claim after the record: %+v, %v; want stored", got, err)
	}
	if fmt.Sprint(got.Stored) != fmt.Sprint(want) {
		t.Fatalf("stored %+v, want %+v", got.Stored, want)
	}
	// A stale lease whose key now holds a response changes nothing either.
	if err := old.Lease.Record(ctx, idempotency.StoredResponse{Fingerprint: fp, Status: 200, Body: []byte("stale")}); !errors.Is(err, idempotency.ErrLeaseLost) {
		t.Fatalf("stale Record over a response = %v, want ErrLeaseLost", err)
	}
	if v, err := redisstore.DecodeRecord(rdb.Get(ctx, key).Val()); err != nil || fmt.Sprint(v) != fmt.Sprint(want) {
		t.Fatalf("after a stale Record over the response the key holds %+v, %v; want %+v", v, err, want)
	}
}

// TestLapsedLockWithoutRivalStillRecords: a claim whose lock lapsed while
// no other request took the key keeps its right to the key: its heartbeat
// takes the key again and its response is stored.
func TestLapsedLockWithoutRivalStillRecords(t *testing.T) {
	t.Parallel()
	rdb := client(t, redisAddr)
	s := newStore(t, rdb, redisstore.Config{Prefix: prefix(t), LockTTL: 150 * time.Millisecond, Heartbeat: 50 * time.Millisecond})
	ctx := context.Background()
	fp := []byte("fp")
	c := takenClaim(t, s, "k", time.Hour)
	key := s.Key("c", "k")
	waitGone(t, rdb, key) // no heartbeat yet: Context not called
	hctx := c.Lease.Context(ctx)
	deadline := time.Now().Add(10 * time.Second)
	for rdb.Exists(ctx, key).Val() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the heartbeat never took the lapsed key again")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if hctx.Err() != nil {
		t.Fatalf("handler context cancelled (%v) though no rival took the key", context.Cause(hctx))
	}
	resp := idempotency.StoredResponse{Fingerprint: fp, Status: 201, Body: []byte("ok")}
	if err := c.Lease.Record(ctx, resp); err != nil {
		t.Fatalf("Record after the lapse: %v", err)
	}
	if v, err := redisstore.DecodeRecord(rdb.Get(ctx, key).Val()); err != nil || string(v.Body) != "ok" {
		t.Fatalf("recorded %+v, %v", v, err)
	}
}

func waitGone(t *testing.T, rdb *redis.Client, key string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for rdb.Exists(context.Background(), key).Val() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%s still exists after 10 s", key)
		}
		time.Sleep(10 * time.Millisecond) // polling a condition with a deadline
	}
}

// TestHeartbeatHoldsTheKey: a handler that runs for several LockTTLs keeps
// its key: a second request meanwhile gets 409, and the handler runs once.
func TestHeartbeatHoldsTheKey(t *testing.T) {
	t.Parallel()
	const lockTTL = 200 * time.Millisecond
	s := newStore(t, client(t, redisAddr), redisstore.Config{Prefix: prefix(t), LockTTL: lockTTL})
	m, err := idempotency.NewWithStore(s, idempotency.Config{})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	entered, release := make(chan struct{}), make(chan struct{})
	srv := serve(t, m.Require, blockingHandler(&runs, entered, release))
	key := uuid.NewString()
	first := sendAsync(t, srv, key, "{}")
	<-entered
	start := time.Now()
	for time.Since(start) < 5*lockTTL { // what is tested is the passing of time
		if r := post(t, srv, key, "{}"); r.status != http.StatusConflict {
			t.Fatalf("while the first request runs (%s after its claim): %s, want 409", time.Since(start), r)
		}
		time.Sleep(lockTTL / 4)
	}
	close(release)
	if r := <-first; r.status != http.StatusCreated || r.body != "run-1" {
		t.Fatalf("first request: %s", r)
	}
	if r := post(t, srv, key, "{}"); r.body != "run-1" || runs.Load() != 1 {
		t.Fatalf("replay %s after %d runs, want run-1 after 1", r, runs.Load())
	}
}

// TestKeysHashTag: a key is one Redis key with one hash tag after the
// prefix (a user's braces in scope or key never choose the Cluster slot),
// and the tag depends on scope and key both.
func TestKeysHashTag(t *testing.T) {
	t.Parallel()
	s := newStore(t, client(t, redisAddr), redisstore.Config{Prefix: "p:"})
	tag := func(k string) string { return k[strings.IndexByte(k, '{') : strings.IndexByte(k, '}')+1] }
	record := s.Key("alice", "k{1}")
	if strings.Count(record, "{") != 1 || !strings.HasPrefix(record, "p:{") || !strings.HasSuffix(record, "}") {
		t.Fatalf("key %q: want p:{<hash>}", record)
	}
	other := s.Key("bob", "k{1}")
	split := s.Key("alice", "k{") // ("alice", "k{1}") must not equal ("alice1", "k{") and the like
	joined := s.Key("alicek", "{1}")
	if tag(other) == tag(record) || tag(split) == tag(record) || tag(joined) == tag(record) {
		t.Fatal("different (scope, key) pairs share a record")
	}
}

func TestNewValidates(t *testing.T) {
	t.Parallel()
	rdb := client(t, redisAddr)
	for _, tc := range []struct {
		cfg   redisstore.Config
		field string
	}{
		{redisstore.Config{Prefix: "a{b}:"}, "Config.Prefix"},
		{redisstore.Config{LockTTL: -time.Second}, "Config.LockTTL"},
		{redisstore.Config{LockTTL: time.Millisecond}, "Config.LockTTL"},
		{redisstore.Config{Heartbeat: -time.Second}, "Config.Heartbeat"},
		{redisstore.Config{LockTTL: time.Second, Heartbeat: time.Second}, "Config.Heartbeat"},
	} {
		if _, err := redisstore.New(rdb, tc.cfg); err == nil || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("New(%+v) = %v, want an error naming %s", tc.cfg, err, tc.field)
		}
	}
	if _, err := redisstore.New(nil, redisstore.Config{}); err == nil {
		t.Error("New(nil) succeeded")
	}
	if _, err := idempotency.NewWithStore(nil, idempotency.Config{}); err == nil {
		t.Error("NewWithStore(nil) succeeded")
	}
}

// TestWebhookIntakeOnce: a webhook intake without Postgres (webhook.Intake
// on the Redis store, as Example_webhookIntake): 25 concurrent copies of one
// signed delivery are processed once, the others get 409 or the replayed
// 204; a redelivery later gets the replay; a bad signature is refused
// before anything is claimed.
func TestWebhookIntakeOnce(t *testing.T) {
	t.Parallel()
	verifier, err := webhook.NewStandardWebhooks(webhook.VerifierConfig{Secrets: []string{"whsec_" + base64.StdEncoding.EncodeToString([]byte("secret"))}})
	if err != nil {
		t.Fatal(err)
	}
	s := newStore(t, client(t, redisAddr), redisstore.Config{Prefix: prefix(t)})
	m, err := idempotency.NewWithStore(s, idempotency.Config{})
	if err != nil {
		t.Fatal(err)
	}
	var processed atomic.Int32
	h, err := webhook.NewIntake(webhook.IntakeConfig{Verifier: verifier, Idempotency: m,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			processed.Add(1)
			w.WriteHeader(http.StatusNoContent)
		})})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	id, body := "msg_"+uuid.NewString(), `{"type":"invoice.paid"}`
	deliver := func(sig string) (int, bool) {
		ts := strconv.FormatInt(time.Now().Unix(), 10)
		if sig == "" {
			mac := hmac.New(sha256.New, []byte("secret"))
			mac.Write([]byte(id + "." + ts + "." + body))
			sig = base64.StdEncoding.EncodeToString(mac.Sum(nil))
		}
		req, _ := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL, strings.NewReader(body))
		req.Header.Set("webhook-id", id)
		req.Header.Set("webhook-timestamp", ts)
		req.Header.Set("webhook-signature", "v1,"+sig)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Errorf("deliver: %v", err)
			return 0, false
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode, resp.Header.Get(idempotency.ReplayedHeader) == "true"
	}
	if st, _ := deliver(base64.StdEncoding.EncodeToString([]byte("forged"))); st != http.StatusUnauthorized {
		t.Fatalf("forged delivery: %d, want 401", st)
	}
	start := make(chan struct{})
	var wg sync.WaitGroup
	var fresh, replays, busy atomic.Int32
	for range 25 {
		wg.Go(func() {
			<-start
			switch st, replayed := deliver(""); {
			case st == http.StatusNoContent && !replayed:
				fresh.Add(1)
			case st == http.StatusNoContent:
				replays.Add(1)
			case st == http.StatusConflict:
				busy.Add(1)
			default:
				t.Errorf("concurrent delivery: %d, want 204 or 409", st)
			}
		})
	}
	close(start)
	wg.Wait()
	if fresh.Load() != 1 || processed.Load() != 1 {
		t.Fatalf("%d fresh answers, %d runs (replays %d, 409s %d); want 1 and 1", fresh.Load(), processed.Load(), replays.Load(), busy.Load())
	}
	if st, replayed := deliver(""); st != http.StatusNoContent || !replayed || processed.Load() != 1 {
		t.Fatalf("redelivery: %d replayed=%v after %d runs, want the replayed 204 and 1 run", st, replayed, processed.Load())
	}
}

// TestRecordExpiresWithTTL: the recorded response and its fingerprint are
// one value that expires Config.TTL after the claim, with no lock left
// behind; once it has expired the key runs afresh.
func TestRecordExpiresWithTTL(t *testing.T) {
	t.Parallel()
	rdb := client(t, redisAddr)
	s := newStore(t, rdb, redisstore.Config{Prefix: prefix(t)})
	m, err := idempotency.NewWithStore(s, idempotency.Config{TTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	entered, release := make(chan struct{}), make(chan struct{})
	close(release)
	srv := serve(t, m.Require, blockingHandler(&runs, entered, release))
	key := uuid.NewString()
	if r := post(t, srv, key, "{}"); r.status != http.StatusCreated || r.body != "run-1" {
		t.Fatalf("first: %s", r)
	}
	ctx := context.Background()
	record := s.Key("c", key)
	value, err := rdb.Get(ctx, record).Result()
	if err != nil {
		t.Fatal(err)
	}
	stored, err := redisstore.DecodeRecord(value)
	if err != nil || stored.Status != http.StatusCreated || string(stored.Body) != "run-1" || len(stored.Fingerprint) != 32 {
		t.Fatalf("record %q: %+v, %v: want status, body and a 32-byte fingerprint together", value, stored, err)
	}
	if ttl := rdb.PTTL(ctx, record).Val(); ttl <= 59*time.Minute || ttl > time.Hour {
		t.Errorf("record expires in %s, want the TTL (1h) counted from the claim", ttl)
	}
	if err := rdb.PExpire(ctx, record, time.Millisecond).Err(); err != nil {
		t.Fatal(err)
	}
	waitGone(t, rdb, record)
	if r := post(t, srv, key, "{}"); r.status != http.StatusCreated || r.body != "run-2" || r.header.Get(idempotency.ReplayedHeader) != "" {
		t.Fatalf("after the record expired: %s, want a fresh run-2", r)
	}
}

// TestResponseEncodingRoundTrips: a recorded response comes back byte for
// byte, whatever bytes its fingerprint, headers and body hold, and a value
// of another layout is refused rather than replayed wrongly.
func TestResponseEncodingRoundTrips(t *testing.T) {
	want := idempotency.StoredResponse{
		Fingerprint: []byte{0, 1, 2, 0xff, 0},
		Status:      http.StatusAccepted,
		Names:       []string{"Content-Type", "X-Empty", "X-Bin"},
		Values:      []string{"application/json", "", "a\x00b\xffc"},
		Body:        []byte("\x00{\"ok\":true}\xff"),
	}
	got, err := redisstore.DecodeResponse(redisstore.EncodeResponse(want))
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("round trip: %+v, %v; want %+v", got, err, want)
	}
	empty := idempotency.StoredResponse{Fingerprint: []byte{}, Status: http.StatusNoContent, Names: []string{}, Values: []string{}, Body: []byte{}}
	if got, err := redisstore.DecodeResponse(redisstore.EncodeResponse(empty)); err != nil || !reflect.DeepEqual(got, empty) {
		t.Fatalf("empty round trip: %+v, %v", got, err)
	}
	for _, bad := range []string{"", "201", "\x03201", "\x0399x\x00\x00", "\x03201\x00\x00\x05Name"} {
		if got, err := redisstore.DecodeResponse([]byte(bad)); err == nil {
			t.Errorf("decode %q = %+v, want an error", bad, got)
		}
	}
}

// TestForeignKeyIsAClearError: a key under the prefix that the store did
// not write (another program's, or a hash of an earlier layout) is an
// error naming the key and the prefix, and is left as it was.
func TestForeignKeyIsAClearError(t *testing.T) {
	t.Parallel()
	rdb := client(t, redisAddr)
	p := prefix(t)
	s := newStore(t, rdb, redisstore.Config{Prefix: p})
	ctx := context.Background()
	key := s.Key("c", "k")
	if err := rdb.HSet(ctx, key, "resp", "x").Err(); err != nil {
		t.Fatal(err)
	}
	_, err := s.Claim(ctx, "c", "k", []byte("fp"), time.Hour)
	if err == nil || !strings.Contains(err.Error(), "not this store's") || !strings.Contains(err.Error(), key) || !strings.Contains(err.Error(), p) {
		t.Fatalf("claim of a hash key: %v; want an error naming the key and the prefix", err)
	}
	if v := rdb.HGet(ctx, key, "resp").Val(); v != "x" {
		t.Fatalf("the foreign key was changed: resp %q", v)
	}
	if err := rdb.Set(ctx, key, "plain", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Claim(ctx, "c", "k", []byte("fp"), time.Hour); err == nil || !strings.Contains(err.Error(), "neither a lock nor a response") {
		t.Fatalf("claim of a foreign string key: %v; want an error", err)
	}
}

// TestStaleLeaseRecordsWhenTheNewerOneReleased: a claim's lock lapses, a
// newer claim takes the key and then releases it without a response (its
// handler failed). The key is empty again, and the stale lease, which no
// live claim contends with, records its response; a retry replays it.
func TestStaleLeaseRecordsWhenTheNewerOneReleased(t *testing.T) {
	t.Parallel()
	rdb := client(t, redisAddr)
	s := newStore(t, rdb, redisstore.Config{Prefix: prefix(t), LockTTL: 150 * time.Millisecond})
	ctx := context.Background()
	fp := []byte("fp")
	stale := takenClaim(t, s, "k", time.Hour)
	waitGone(t, rdb, s.Key("c", "k"))
	newer := takenClaim(t, s, "k", time.Hour)
	newer.Lease.Release(ctx)
	if n := rdb.Exists(ctx, s.Key("c", "k")).Val(); n != 0 {
		t.Fatal("the newer claim's Release left the key")
	}
	if err := stale.Lease.Record(ctx, idempotency.StoredResponse{Fingerprint: fp, Status: 201, Body: []byte("stale")}); err != nil {
		t.Fatalf("stale Record on the empty key: %v, want it stored", err)
	}
	got, err := s.Claim(ctx, "c", "k", fp, time.Hour)
	if err != nil || got.State != idempotency.ClaimStored || string(got.Stored.Body) != "stale" {
		t.Fatalf("retry: %+v, %v; want the stale lease's response replayed", got, err)
	}
}

// TestHeartbeatCancelsTheHandlerWhenTheKeyIsTaken: while the handler runs,
// the key holds a newer claim's lock (as after its lock lapsed and a retry
// took the key). The next heartbeat finds that lock, leaves it, and cancels
// the handler's context with ErrLeaseLost as its cause.
func TestHeartbeatCancelsTheHandlerWhenTheKeyIsTaken(t *testing.T) {
	t.Parallel()
	rdb := client(t, redisAddr)
	s := newStore(t, rdb, redisstore.Config{Prefix: prefix(t), LockTTL: 300 * time.Millisecond, Heartbeat: 100 * time.Millisecond})
	ctx := context.Background()
	c := takenClaim(t, s, "k", time.Hour)
	defer c.Lease.Release(ctx)
	// Take the key over the way a newer claim whose lock is live does.
	if err := rdb.Set(ctx, s.Key("c", "k"), "Lnewer", time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	hctx := c.Lease.Context(ctx)
	select {
	case <-hctx.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the handler's context was not cancelled after the key was taken")
	}
	if cause := context.Cause(hctx); !errors.Is(cause, idempotency.ErrLeaseLost) {
		t.Fatalf("cause %v, want ErrLeaseLost", cause)
	}
	if v := rdb.Get(ctx, s.Key("c", "k")).Val(); v != "Lnewer" {
		t.Fatalf("the heartbeat changed the newer claim's key: %q", v)
	}
}

// TestResponseTTLCountsFromTheClaim: a response recorded a second after
// its claim expires TTL after the claim, not after the record.
func TestResponseTTLCountsFromTheClaim(t *testing.T) {
	t.Parallel()
	rdb := client(t, redisAddr)
	s := newStore(t, rdb, redisstore.Config{Prefix: prefix(t), LockTTL: 100 * time.Millisecond})
	ctx := context.Background()
	fp := []byte("fp")
	const ttl = 5 * time.Second
	c := takenClaim(t, s, "k", ttl)
	c.Lease.Context(ctx)
	time.Sleep(time.Second) // the handler's time, which the TTL includes
	if err := c.Lease.Record(ctx, idempotency.StoredResponse{Fingerprint: fp, Status: 201}); err != nil {
		t.Fatal(err)
	}
	if pttl := rdb.PTTL(ctx, s.Key("c", "k")).Val(); pttl > ttl-time.Second || pttl < ttl-2*time.Second {
		t.Fatalf("response expires in %s, want TTL (%s) less the second since the claim", pttl, ttl)
	}
}

// takenClaim claims ("c", key) with fingerprint "fp" on s, and fails the
// test unless the claim took the key.
func takenClaim(t *testing.T, s *redisstore.Store, key string, ttl time.Duration) idempotency.Claim {
	t.Helper()
	c, err := s.Claim(context.Background(), "c", key, []byte("fp"), ttl)
	if err != nil || c.State != idempotency.ClaimTaken {
		t.Fatalf("claim of %q: %+v, %v; want it taken", key, c, err)
	}
	return c
}
