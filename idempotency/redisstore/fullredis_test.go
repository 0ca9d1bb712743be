package redisstore_test

import (
	"context"
	"net"
	"os/exec"
	"strconv"
	"strings"
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
	cmd := exec.Command(bin, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--maxmemory-policy", "noeviction")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + strconv.Itoa(port), MaxRetries: -1})
	t.Cleanup(func() { _ = rdb.Close() })
	ctx := context.Background()
	for deadline := time.Now().Add(5 * time.Second); rdb.Ping(ctx).Err() != nil; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("redis-server did not start")
		}
	}
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
