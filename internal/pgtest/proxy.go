package pgtest

import (
	"context"
	"io"
	"net"
	"net/url"
	"strconv"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// PostgresProxy is a TCP proxy in front of a Postgres that a test cuts off
// to make the database unreachable without stopping it: Cut drops every
// connection through the proxy (transactions in flight die with them) and
// closes new ones at once, until Restore. It needs the database's URL in
// postgres:// form.
type PostgresProxy struct {
	URL  string // the database's URL with the proxy's address
	Addr string // the proxy's host:port

	target string
	ln     net.Listener
	wg     sync.WaitGroup

	mu    sync.Mutex
	down  bool
	conns map[net.Conn]struct{}
}

// NewPostgresProxy starts a proxy to the tests' Postgres (DatabaseURL),
// stopped when the test ends.
func NewPostgresProxy(t testing.TB) *PostgresProxy {
	t.Helper()
	return NewPostgresProxyAt(t, DatabaseURL(t))
}

// NewPostgresProxyAt starts a proxy to the Postgres at dbURL, stopped when
// the test ends.
func NewPostgresProxyAt(t testing.TB, dbURL string) *PostgresProxy {
	t.Helper()
	cfg, err := pgconn.ParseConfig(dbURL)
	if err != nil {
		t.Fatalf("pgtest: proxy: %v", err)
	}
	u, err := url.Parse(dbURL)
	if err != nil || u.Scheme == "" {
		t.Fatalf("pgtest: proxy: DATABASE_URL must be a postgres:// URL")
	}
	p := NewTCPProxy(t, net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))))
	u.Host = p.Addr
	p.URL = u.String()
	return p
}

// NewTCPProxy starts a proxy to any TCP server at target (host:port), such
// as Redis, stopped when the test ends; clients dial its Addr. URL is empty.
func NewTCPProxy(t testing.TB, target string) *PostgresProxy {
	t.Helper()
	ln, err := (&net.ListenConfig{}).Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("pgtest: proxy: %v", err)
	}
	p := &PostgresProxy{Addr: ln.Addr().String(), target: target, ln: ln, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(func() {
		_ = ln.Close()
		p.Cut()
		p.wg.Wait()
	})
	return p
}

// Pool returns a pool through the proxy whose search_path is schema,
// closed when the test ends.
func (p *PostgresProxy) Pool(t testing.TB, schema string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	pool, err := NewPool(context.Background(), p.URL, schema, maxConns)
	if err != nil {
		t.Fatalf("pgtest: proxy pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// Cut drops every connection through the proxy and refuses new ones.
func (p *PostgresProxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down = true
	for c := range p.conns {
		_ = c.Close()
	}
}

// Restore lets connections through again.
func (p *PostgresProxy) Restore() {
	p.mu.Lock()
	p.down = false
	p.mu.Unlock()
}

func (p *PostgresProxy) accept() {
	defer p.wg.Done()
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return // the listener closed at cleanup
		}
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			p.serve(client)
		}()
	}
}

// serve pipes one client connection to the server until either side or
// Cut closes it.
func (p *PostgresProxy) serve(client net.Conn) {
	server, err := (&net.Dialer{}).Dial("tcp", p.target)
	if err != nil {
		_ = client.Close()
		return
	}
	if !p.track(client, server) {
		_ = client.Close()
		_ = server.Close()
		return
	}
	defer p.untrack(client, server)
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src) // until either side, or Cut, closes
		_ = client.Close()
		_ = server.Close()
		done <- struct{}{}
	}
	go pipe(server, client)
	go pipe(client, server)
	<-done
	<-done
}

// track registers an open pair, unless the proxy is cut.
func (p *PostgresProxy) track(conns ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.down {
		return false
	}
	for _, c := range conns {
		p.conns[c] = struct{}{}
	}
	return true
}

func (p *PostgresProxy) untrack(conns ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range conns {
		delete(p.conns, c)
	}
}
