package redisstore_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/redis/go-redis/v9"

	"github.com/oncely/oncely/idempotency"
	"github.com/oncely/oncely/idempotency/redisstore"
	"github.com/oncely/oncely/internal/handredis"
)

// benchBody is the request body of the benchmarks (the bench command's).
const benchBody = `{"sku":"A-1","qty":1}`

// benchHandlers returns the middleware on the Redis store and the
// hand-written SET NX + GET middleware, both around the bench command's
// handler (201, a small JSON body), under a key prefix deleted afterwards.
func benchHandlers(b *testing.B) map[string]http.Handler {
	b.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr})
	b.Cleanup(func() { _ = rdb.Close() })
	if err := rdb.Ping(b.Context()).Err(); err != nil {
		b.Fatalf("redis at %s: %v", redisAddr, err)
	}
	p := "oncely-bench:" + uuid.NewString() + ":"
	b.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		iter := rdb.Scan(ctx, 0, p+"*", 1000).Iterator()
		var keys []string
		for iter.Next(ctx) {
			if keys = append(keys, iter.Val()); len(keys) == 1000 {
				_ = rdb.Del(ctx, keys...).Err()
				keys = keys[:0]
			}
		}
		if len(keys) > 0 {
			_ = rdb.Del(ctx, keys...).Err()
		}
	})
	var effects atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := effects.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":"` + strconv.FormatInt(n, 10) + `"}`))
	})
	s, err := redisstore.New(rdb, redisstore.Config{Prefix: p + "store:"})
	if err != nil {
		b.Fatal(err)
	}
	m, err := idempotency.NewWithStore(s, idempotency.Config{})
	if err != nil {
		b.Fatal(err)
	}
	return map[string]http.Handler{
		"store": m.Require(h),
		"hand":  (&handredis.Middleware{RDB: rdb, Prefix: p + "hand:", LockTTL: 30 * time.Second, TTL: time.Hour}).Handler(h),
	}
}

// benchRequest sends one keyed POST to h and checks its status.
func benchRequest(b *testing.B, h http.Handler, key string) {
	req := httptest.NewRequestWithContext(context.Background(), http.MethodPost, "/orders", strings.NewReader(benchBody))
	req.Header.Set("Idempotency-Key", key)
	req = req.WithContext(idempotency.WithClient(req.Context(), "bench"))
	w := httptest.NewRecorder()
	h.ServeHTTP(w, req)
	if w.Code != http.StatusCreated {
		b.Fatalf("key %s: status %d: %s", key, w.Code, w.Body)
	}
}

// BenchmarkFirstRequest: keyed POSTs with fresh keys, one after another,
// through the Redis store and the hand-written version (allocs/op and CPU
// per request; the round trips to Redis dominate ns/op).
func BenchmarkFirstRequest(b *testing.B) {
	for _, name := range []string{"store", "hand"} {
		b.Run(name, func(b *testing.B) {
			h := benchHandlers(b)[name]
			b.ReportAllocs()
			defer reportCPU(b)()
			i := 0
			for b.Loop() {
				benchRequest(b, h, "k"+strconv.Itoa(i))
				i++
			}
		})
	}
}

// BenchmarkReplay: retries of recorded keys (1,000 keys, recorded before
// the timer starts), each answered from Redis without running the handler.
func BenchmarkReplay(b *testing.B) {
	for _, name := range []string{"store", "hand"} {
		b.Run(name, func(b *testing.B) {
			h := benchHandlers(b)[name]
			keys := make([]string, 1000)
			for i := range keys {
				keys[i] = "k" + strconv.Itoa(i)
				benchRequest(b, h, keys[i])
			}
			b.ReportAllocs()
			defer reportCPU(b)()
			i := 0
			for b.Loop() {
				benchRequest(b, h, keys[i%len(keys)])
				i++
			}
		})
	}
}

// reportCPU reports the CPU time this process spent per request, from now
// until the returned function runs (after the loop): unlike ns/op, it does
// not count the wait for Redis's replies, nor other processes' load.
func reportCPU(b *testing.B) func() {
	start := processCPU()
	return func() { b.ReportMetric(float64(processCPU()-start)/float64(b.N), "cpu-ns/op") }
}

func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
