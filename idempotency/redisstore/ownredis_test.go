package redisstore_test

import (
	"context"
	"net"
	"net/http"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/oncely/oncely/idempotency"
	"github.com/oncely/oncely/idempotency/redisstore"
)

// TestReplayWhenRedisIsFull: Redis at maxmemory with noeviction (the policy
// an idempotency store needs: evicting a lock or a response breaks it)
// refuses every command flagged denyoom, SET included, even a SET NX that
// would write nothing. The claim is such a SET, so a replay of a recorded
// response, and the 409 of a key in progress, become 503 for as long as
// Redis stays full, where a read (GET) of the key would answer them. The
// test runs a Redis server of its own, since it changes maxmemory.
func TestReplayWhenRedisIsFull(t *testing.T) {
	srv := startRedis(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.addr, MaxRetries: -1})
	t.Cleanup(func() { _ = rdb.Close() })
	ctx := context.Background()
	s := newStore(t, rdb, redisstore.Config{})
	fp := []byte("fp")
	c, err := s.Claim(ctx, "c", "done", fp, time.Hour)
	if err != nil || c.State != idempotency.ClaimTaken {
		t.Fatal(c, err)
	}
	c.Lease.Context(ctx)
	if err := c.Lease.Record(ctx, idempotency.StoredResponse{Fingerprint: fp, Status: 201, Body: []byte("ok")}); err != nil {
		t.Fatal(err)
	}
	busy, err := s.Claim(ctx, "c", "running", fp, time.Hour)
	if err != nil || busy.State != idempotency.ClaimTaken {
		t.Fatal(busy, err)
	}
	defer busy.Lease.Release(ctx)
	if err := rdb.ConfigSet(ctx, "maxmemory", "1").Err(); err != nil { // full: below what Redis uses
		t.Fatal(err)
	}
	defer rdb.ConfigSet(ctx, "maxmemory", "0")
	if v, err := rdb.Get(ctx, s.Key("c", "done")).Result(); err != nil || !strings.HasPrefix(v, "R") {
		t.Fatalf("a plain GET of the recorded key while Redis is full: %q, %v", v, err)
	}
	if got, err := s.Claim(ctx, "c", "done", fp, time.Hour); err != nil || got.State != idempotency.ClaimStored {
		t.Errorf("replay while Redis is full: %+v, %v; want ClaimStored (the response is there to read)", got, err)
	}
	if got, err := s.Claim(ctx, "c", "running", fp, time.Hour); err != nil || got.State != idempotency.ClaimBusy {
		t.Errorf("a key in progress while Redis is full: %+v, %v; want ClaimBusy (409), not an error (503)", got, err)
	}
}

// ownRedis is a redis-server of a test's own, on a port of its own, with an
// append-only file in a directory of the test's: it can be killed and
// started again on the same data, without touching the shared Redis.
type ownRedis struct {
	t    *testing.T
	bin  string
	dir  string
	addr string
	port int
	cmd  *exec.Cmd
}

// startRedis starts an ownRedis (appendfsync always: every write the
// server acknowledged survives a kill), skipping the test where there is
// no redis-server.
func startRedis(t *testing.T) *ownRedis {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Skip("no redis-server on PATH")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	_ = ln.Close()
	r := &ownRedis{t: t, bin: bin, dir: t.TempDir(), addr: "127.0.0.1:" + strconv.Itoa(port), port: port}
	r.start()
	t.Cleanup(r.kill)
	return r
}

func (r *ownRedis) start() {
	r.t.Helper()
	r.cmd = exec.Command(r.bin, "--port", strconv.Itoa(r.port), "--bind", "127.0.0.1", "--dir", r.dir,
		"--save", "", "--appendonly", "yes", "--appendfsync", "always", "--maxmemory-policy", "noeviction")
	if err := r.cmd.Start(); err != nil {
		r.t.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: r.addr, MaxRetries: -1})
	defer rdb.Close()
	for deadline := time.Now().Add(10 * time.Second); rdb.Ping(context.Background()).Err() != nil; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			r.t.Fatal("redis-server did not start")
		}
	}
}

// kill ends the server with SIGKILL: no shutdown, no final save.
func (r *ownRedis) kill() {
	if r.cmd != nil && r.cmd.Process != nil {
		_ = r.cmd.Process.Kill()
		_ = r.cmd.Wait()
		r.cmd = nil
	}
}

// TestRedisRestartMidRequest: the Redis server is killed (SIGKILL) while a
// request's handler runs, and started again on its append-only file. The
// request gets 503 with Retry-After (its response could not be stored),
// as does a request while Redis is down. After the restart the claim's
// lock, which the server had persisted, is still there: retries get 409,
// never a second concurrent run, until it lapses LockTTL after the last
// heartbeat; then a retry runs afresh and is replayed. No key is stranded.
func TestRedisRestartMidRequest(t *testing.T) {
	t.Parallel()
	srv := startRedis(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.addr, MaxRetries: -1, ContextTimeoutEnabled: true, DialTimeout: time.Second})
	t.Cleanup(func() { _ = rdb.Close() })
	const lockTTL = 3 * time.Second
	s := newStore(t, rdb, redisstore.Config{LockTTL: lockTTL})
	m, err := idempotency.NewWithStore(s, idempotency.Config{})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int32
	entered, release := make(chan struct{}), make(chan struct{})
	hs := serve(t, m.Require, blockingHandler(&runs, entered, release))
	key := "restart"
	first := sendAsync(t, hs, key, "{}")
	<-entered
	if v := rdb.Get(context.Background(), s.Key("c", key)).Val(); !strings.HasPrefix(v, "L") {
		t.Fatalf("while the handler runs the key holds %q, want its lock", v)
	}
	srv.kill()
	close(release)
	if r := <-first; r.status != http.StatusServiceUnavailable || r.header.Get("Retry-After") == "" {
		t.Fatalf("the request whose Redis was killed: %s, want 503 with Retry-After", r)
	}
	if r := post(t, hs, key, "{}"); r.status != http.StatusServiceUnavailable || r.header.Get("Retry-After") == "" {
		t.Fatalf("a retry while Redis is down: %s, want 503 with Retry-After", r)
	}
	srv.start()
	if v := rdb.Get(context.Background(), s.Key("c", key)).Val(); !strings.HasPrefix(v, "L") {
		t.Fatalf("after the restart the key holds %q, want the persisted lock (appendfsync always)", v)
	}
	if r := post(t, hs, key, "{}"); r.status != http.StatusConflict {
		t.Fatalf("a retry while the persisted lock holds: %s, want 409", r)
	}
	retry := postUntil(t, hs, key, "{}")
	if retry.status != http.StatusCreated || retry.body != "run-2" || retry.header.Get(idempotency.ReplayedHeader) != "" {
		t.Fatalf("retry once the lock lapsed: %s, want a fresh 201 run-2", retry)
	}
	if r := post(t, hs, key, "{}"); r.body != "run-2" || r.header.Get(idempotency.ReplayedHeader) != "true" {
		t.Fatalf("replay: %s, want run-2 replayed", r)
	}
	if runs.Load() != 2 {
		t.Fatalf("handler ran %d times, want 2", runs.Load())
	}
}
