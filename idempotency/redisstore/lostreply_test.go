package redisstore_test

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/oncely/oncely/idempotency"
	"github.com/oncely/oncely/idempotency/redisstore"
)

// replyProxy forwards to Redis and can lose (drop: the connection is closed
// once Redis has answered, the answer never reaching the client) or hold
// (stall: kept until the test lets it through) the next reply of Redis.
// Redis has executed the command in both cases: the outcome is ambiguous
// for the client, as when a reply is lost to a network cut, a failover or a
// Redis restart with persistence, or arrives after the client's deadline.
type replyProxy struct {
	addr  string
	drop  atomic.Bool
	stall atomic.Bool
	held  chan struct{} // closed to let a stalled reply through
}

func newReplyProxy(t *testing.T) *replyProxy {
	t.Helper()
	ln, err := (&net.ListenConfig{}).Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &replyProxy{addr: ln.Addr().String(), held: make(chan struct{})}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	track := func(c ...net.Conn) { mu.Lock(); conns = append(conns, c...); mu.Unlock() }
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Go(func() {
		for {
			cli, err := ln.Accept()
			if err != nil {
				return
			}
			srv, err := net.Dial("tcp", redisAddr)
			if err != nil {
				_ = cli.Close()
				continue
			}
			track(cli, srv)
			wg.Go(func() {
				buf := make([]byte, 64<<10)
				for {
					n, err := cli.Read(buf)
					if n > 0 {
						if _, werr := srv.Write(buf[:n]); werr != nil {
							return
						}
					}
					if err != nil {
						_ = srv.Close()
						return
					}
				}
			})
			wg.Go(func() {
				buf := make([]byte, 64<<10)
				for {
					n, err := srv.Read(buf)
					if n > 0 {
						if p.drop.CompareAndSwap(true, false) {
							_ = cli.Close()
							_ = srv.Close()
							return
						}
						if p.stall.CompareAndSwap(true, false) {
							<-p.held
						}
						if _, werr := cli.Write(buf[:n]); werr != nil {
							return
						}
					}
					if err != nil {
						_ = cli.Close()
						return
					}
				}
			})
		}
	})
	return p
}

// TestClaimWhoseReplyIsLostTakesTheKey: Redis executes the claim's SET, and
// the reply is lost (the connection drops). go-redis, with its default
// MaxRetries (3, as in the package example), sends the SET again; Redis
// answers it with the first attempt's lock, which is this claim's own. The
// claim must be taken: answering busy leaves a lock nobody holds, so the
// request and every retry get 409 for LockTTL while nothing runs.
func TestClaimWhoseReplyIsLostTakesTheKey(t *testing.T) {
	t.Parallel()
	p := newReplyProxy(t)
	rdb := redis.NewClient(&redis.Options{Addr: p.addr}) // the defaults, retries included
	t.Cleanup(func() { _ = rdb.Close() })
	direct := client(t, redisAddr)
	s := newStore(t, rdb, redisstore.Config{Prefix: prefix(t)})
	ctx := context.Background()
	if err := rdb.Ping(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	p.drop.Store(true)
	c, err := s.Claim(ctx, "c", "k", []byte("fp"), time.Hour)
	if p.drop.Load() {
		t.Fatal("the proxy dropped no reply")
	}
	v := direct.Get(ctx, s.Key("c", "k")).Val()
	if err != nil || c.State != idempotency.ClaimTaken {
		t.Fatalf("claim whose first reply was lost: state %v, err %v; the key holds %q (PTTL %s) that no request holds: want ClaimTaken (%v)",
			c.State, err, v, direct.PTTL(ctx, s.Key("c", "k")).Val(), idempotency.ClaimTaken)
	}
}

// TestRecordWhoseReplyIsLostSucceeds: Redis executes the record script and
// the reply is lost; go-redis runs the script again, which finds the key
// holding this lease's own response. Record must report success: the
// response is stored, and ErrLeaseLost (409, "a newer request took the key
// over", logged as an error) is false.
func TestRecordWhoseReplyIsLostSucceeds(t *testing.T) {
	t.Parallel()
	p := newReplyProxy(t)
	rdb := redis.NewClient(&redis.Options{Addr: p.addr})
	t.Cleanup(func() { _ = rdb.Close() })
	direct := client(t, redisAddr)
	s := newStore(t, rdb, redisstore.Config{Prefix: prefix(t)})
	ctx := context.Background()
	resp := idempotency.StoredResponse{Fingerprint: []byte("fp"), Status: 201, Body: []byte("ok")}
	// A first record loads the script, so that the dropped reply is the
	// EVALSHA's that ran it, not a NOSCRIPT.
	warm, err := s.Claim(ctx, "c", "warm", []byte("fp"), time.Hour)
	if err != nil || warm.State != idempotency.ClaimTaken {
		t.Fatal(warm, err)
	}
	warm.Lease.Context(ctx)
	if err := warm.Lease.Record(ctx, resp); err != nil {
		t.Fatal(err)
	}
	c, err := s.Claim(ctx, "c", "k", []byte("fp"), time.Hour)
	if err != nil || c.State != idempotency.ClaimTaken {
		t.Fatal(c, err)
	}
	c.Lease.Context(ctx)
	p.drop.Store(true)
	err = c.Lease.Record(ctx, resp)
	c.Lease.Release(ctx)
	if p.drop.Load() {
		t.Fatal("the proxy dropped no reply")
	}
	stored, derr := redisstore.DecodeRecord(direct.Get(ctx, s.Key("c", "k")).Val())
	if derr != nil || string(stored.Body) != "ok" {
		t.Fatalf("the key holds %+v, %v; want the response", stored, derr)
	}
	if err != nil {
		t.Fatalf("Record whose reply was lost, its response stored: %v (ErrLeaseLost: %v); want nil", err, errors.Is(err, idempotency.ErrLeaseLost))
	}
}

// TestClaimPastItsDeadlineLeavesNoLock: the claim's SET runs in Redis, but
// its reply comes after the request's context ended (a client that went
// away, a slow Redis). Claim returns an error (503, "safe to retry"); the
// lock it took must not stay behind, or the retry gets 409 for LockTTL
// while nothing runs. The store knows the lock's token and can release it.
func TestClaimPastItsDeadlineLeavesNoLock(t *testing.T) {
	t.Parallel()
	p := newReplyProxy(t)
	// The client the package documentation shows: contexts bound its calls.
	rdb := redis.NewClient(&redis.Options{Addr: p.addr, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = rdb.Close() })
	direct := client(t, redisAddr)
	s := newStore(t, rdb, redisstore.Config{Prefix: prefix(t)})
	if err := rdb.Ping(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	p.stall.Store(true)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	_, err := s.Claim(ctx, "c", "k", []byte("fp"), time.Hour)
	cancel()
	close(p.held)
	if err == nil {
		t.Fatal("claim past its deadline succeeded")
	}
	// Claim released the key before it returned: nothing to wait for.
	bg := context.Background()
	if v := direct.Get(bg, s.Key("c", "k")).Val(); strings.HasPrefix(v, "L") {
		c, _ := s.Claim(bg, "c", "k", []byte("fp"), time.Hour)
		t.Fatalf("after a claim that failed (%v) the key holds the lock %q for %s more, nobody's: the retry's claim is %v (busy=%v), want the key free",
			err, v, direct.PTTL(bg, s.Key("c", "k")).Val(), c.State, c.State == idempotency.ClaimBusy)
	}
}
