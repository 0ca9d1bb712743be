// Package handredis is the hand-written Redis idempotency middleware that
// package idempotency/redisstore is measured and tested against: the shape
// most articles show (GET the cached response; else SET NX EX a lock, run
// the handler, SET the response with a TTL, DEL the lock). It is a
// baseline, not for use: a lock that expires while its handler still runs
// lets a second request run, and the first one then overwrites the second
// one's response (nothing fences it); and a GET that missed just before
// another request stored its response is followed by a SET NX that wins
// just after that request deleted its lock, so the handler runs twice.
package handredis

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/oncely/oncely/idempotency"
)

// Middleware wraps a handler with the hand-written scheme. Keys are per
// client (idempotency.WithClient) under prefix.
type Middleware struct {
	RDB     redis.UniversalClient
	Prefix  string
	LockTTL time.Duration
	TTL     time.Duration
}

type stored struct {
	Status int
	Header http.Header
	Body   []byte
}

// Handler wraps next.
func (m *Middleware) Handler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		if key == "" || r.Method != http.MethodPost {
			next.ServeHTTP(w, r)
			return
		}
		client, _ := idempotency.Client(r.Context())
		k := m.Prefix + strconv.Itoa(len(client)) + ":" + client + ":" + key
		ctx := r.Context()
		if b, err := m.RDB.Get(ctx, k+":resp").Bytes(); err == nil {
			var s stored
			if json.Unmarshal(b, &s) == nil {
				for name, v := range s.Header {
					w.Header()[name] = v
				}
				w.Header().Set(idempotency.ReplayedHeader, "true")
				w.WriteHeader(s.Status)
				_, _ = w.Write(s.Body)
				return
			}
		} else if !errors.Is(err, redis.Nil) {
			http.Error(w, "redis: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		ok, err := m.RDB.SetNX(ctx, k+":lock", "1", m.LockTTL).Result()
		if err != nil {
			http.Error(w, "redis: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		if !ok {
			w.Header().Set("Retry-After", "1")
			http.Error(w, "in progress", http.StatusConflict)
			return
		}
		rec := &capture{header: http.Header{}}
		next.ServeHTTP(rec, r)
		if rec.status == 0 {
			rec.status = http.StatusOK
		}
		if rec.status < 500 {
			b, _ := json.Marshal(stored{Status: rec.status, Header: rec.header, Body: rec.body.Bytes()})
			if err := m.RDB.Set(ctx, k+":resp", b, m.TTL).Err(); err != nil {
				http.Error(w, "redis: "+err.Error(), http.StatusServiceUnavailable)
				return
			}
		}
		m.RDB.Del(ctx, k+":lock")
		for name, v := range rec.header {
			w.Header()[name] = v
		}
		w.WriteHeader(rec.status)
		_, _ = w.Write(rec.body.Bytes())
	})
}

type capture struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func (c *capture) Header() http.Header { return c.header }
func (c *capture) WriteHeader(code int) {
	if c.status == 0 {
		c.status = code
	}
}
func (c *capture) Write(p []byte) (int, error) {
	if c.status == 0 {
		c.status = http.StatusOK
	}
	return c.body.Write(p)
}
