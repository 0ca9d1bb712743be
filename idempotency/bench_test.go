package idempotency_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/oncely/oncely/idempotency"
)

// benchOrders is the handler of the benchmarks: 201 with a small JSON
// body, as the bench command's.
var benchOrders = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_, _ = w.Write([]byte(`{"id":"1"}`))
})

// benchClient sends keyed POSTs straight to a handler, reusing one request
// and one response writer, so that allocs/op counts the middleware's own
// allocations (httptest's would outnumber them).
type benchClient struct {
	tmpl *http.Request
	req  http.Request
	body strings.Reader
	w    benchWriter
}

func newBenchClient() *benchClient {
	r := httptest.NewRequestWithContext(idempotency.WithClient(context.Background(), "bench"), http.MethodPost, "/orders", nil)
	r.Header.Set("Idempotency-Key", "")
	return &benchClient{tmpl: r, w: benchWriter{h: http.Header{}}}
}

// send sends one POST with key and body to h and checks its status.
func (c *benchClient) send(b *testing.B, h http.Handler, key, body string) {
	c.req = *c.tmpl
	c.req.Header["Idempotency-Key"][0] = key
	c.body.Reset(body)
	c.req.Body = io.NopCloser(&c.body)
	c.req.ContentLength = int64(len(body))
	clear(c.w.h)
	c.w.code = 0
	h.ServeHTTP(&c.w, &c.req)
	if c.w.code != http.StatusCreated {
		b.Fatalf("key %s: status %d", key, c.w.code)
	}
}

// benchWriter is a response writer that keeps the status and discards the
// body.
type benchWriter struct {
	h    http.Header
	code int
}

func (w *benchWriter) Header() http.Header { return w.h }
func (w *benchWriter) WriteHeader(code int) {
	if w.code == 0 {
		w.code = code
	}
}

func (w *benchWriter) Write(p []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	return len(p), nil
}

// benchBodies are the request bodies the benchmarks send: the bench
// command's, and a 4 KiB one.
var benchBodies = map[string]string{
	"body=21B":  `{"sku":"A-1","qty":1}`,
	"body=4KiB": `{"sku":"A-1","qty":1,"note":"` + strings.Repeat("x", 4096-32) + `"}`,
}

// BenchmarkMiddlewareFirstRequest: first requests through the middleware
// on an in-memory store: the middleware's own work (reading and hashing the
// body, the recorder, recording, telemetry) per request.
func BenchmarkMiddlewareFirstRequest(b *testing.B) { benchMiddleware(b, false) }

// BenchmarkMiddlewareReplay: retries of recorded keys through the
// middleware on an in-memory store: the middleware's own work per replay
// (reading and hashing the body, the fingerprint check, writing the
// recorded response, telemetry).
func BenchmarkMiddlewareReplay(b *testing.B) { benchMiddleware(b, true) }

// benchMiddleware sends keyed POSTs of 1,000 keys over and over. With
// replay the keys are recorded before the timer starts; without, the store
// records nothing, so every request is a first request of its key.
func benchMiddleware(b *testing.B, replay bool) {
	for _, name := range []string{"body=21B", "body=4KiB"} {
		b.Run(name, func(b *testing.B) {
			m, err := idempotency.NewWithStore(newMemStore(replay), idempotency.Config{})
			if err != nil {
				b.Fatal(err)
			}
			h, c := m.Require(benchOrders), newBenchClient()
			keys := make([]string, 1000)
			for i := range keys {
				keys[i] = "k" + strconv.Itoa(i)
				if replay {
					c.send(b, h, keys[i], benchBodies[name])
				}
			}
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				c.send(b, h, keys[i%len(keys)], benchBodies[name])
				i++
			}
		})
	}
}
