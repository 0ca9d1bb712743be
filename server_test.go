package oncely_test

import (
	"context"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/oncely/oncely"
	"github.com/oncely/oncely/internal/pgtest"
)

// TestRunnerHTTPAddr: the runner's own server serves its endpoints and the
// routes of Handle on Config.Listener from the start of Run, and closes it
// on the way out; an HTTPAddr in use is Run's error, naming the field.
func TestRunnerHTTPAddr(t *testing.T) {
	t.Parallel()
	schema, pool := newPool(t)
	ln := listen(t)
	addr := ln.Addr().String()
	runFails(t, oncely.Config{Pool: pool, Schema: schema, HTTPAddr: addr}, nil, "Config.HTTPAddr", addr)

	r, err := oncely.New(oncely.Config{Pool: pool, Schema: schema, Migrate: true, Listener: ln})
	if err != nil {
		t.Fatal(err)
	}
	r.Handle("POST /payments", http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusCreated)
	}))
	serveThenStop(t, r, addr, func() {
		if got := status(t, http.MethodPost, "http://"+addr+"/payments"); got != http.StatusCreated {
			t.Errorf("POST /payments through Handle: %d, want 201", got)
		}
	})
}

// TestAddServerListensOnAddr: with no listener, Run listens on srv.Addr
// (an address in use is its error, and the other servers' listeners are
// closed), serves on it, and the shutdown closes it.
func TestAddServerListensOnAddr(t *testing.T) {
	t.Parallel()
	schema, pool := newPool(t)
	taken, other := listen(t), listen(t)
	runFails(t, oncely.Config{Pool: pool, Schema: schema, Listener: other},
		&http.Server{Addr: taken.Addr().String(), ReadHeaderTimeout: time.Second}, "http.Server.Addr", taken.Addr().String())
	if c, err := new(net.Dialer).DialContext(t.Context(), "tcp", other.Addr().String()); err == nil {
		_ = c.Close()
		t.Errorf("the runner's other listener still accepts connections after Run failed")
	}

	free := listen(t)
	addr := free.Addr().String()
	_ = free.Close()
	r, err := oncely.New(oncely.Config{Pool: pool, Schema: schema, Migrate: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.AddServer(&http.Server{Addr: addr, Handler: r.Handler(), ReadHeaderTimeout: time.Second}, nil); err != nil {
		t.Fatal(err)
	}
	serveThenStop(t, r, addr, func() {})
}

// runFails runs a runner of cfg (with srv added when not nil) and checks
// that Run fails at once with an error naming each of want.
func runFails(t *testing.T, cfg oncely.Config, srv *http.Server, want ...string) {
	t.Helper()
	r, err := oncely.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if srv != nil {
		if err := r.AddServer(srv, nil); err != nil {
			t.Fatal(err)
		}
	}
	err = r.Run(t.Context())
	for _, w := range want {
		if err == nil || !strings.Contains(err.Error(), w) {
			t.Fatalf("Run: %v; want an error naming %s", err, w)
		}
	}
}

func newPool(t *testing.T) (schema string, pool *pgxpool.Pool) {
	t.Helper()
	db := pgtest.Postgres(t)
	pool, err := oncely.NewPool(t.Context(), db.URL, db.Schema)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return db.Schema, pool
}

func listen(t *testing.T) net.Listener {
	t.Helper()
	ln, err := new(net.ListenConfig).Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	return ln
}

// serveThenStop runs r until /readyz answers 200 on addr, calls while, then
// stops it and checks that addr no longer accepts connections.
func serveThenStop(t *testing.T, r *oncely.Runner, addr string, while func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	pgtest.Eventually(t, 30*time.Second, "GET /readyz 200 on "+addr, func() bool {
		return status(t, http.MethodGet, "http://"+addr+"/readyz") == http.StatusOK
	})
	while()
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if c, err := new(net.Dialer).DialContext(t.Context(), "tcp", addr); err == nil {
		_ = c.Close()
		t.Errorf("%s still accepts connections after Run returned", addr)
	}
}

// status is the status of a request, or -1 when it could not be sent.
func status(t *testing.T, method, url string) int {
	req, err := http.NewRequestWithContext(t.Context(), method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return -1
	}
	_ = resp.Body.Close()
	return resp.StatusCode
}
