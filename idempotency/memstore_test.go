package idempotency_test

import (
	"context"
	"sync"
	"time"

	"github.com/oncely/oncely/idempotency"
)

// memStore is an in-memory Store, for benchmarks that measure the
// middleware's own work per request (nothing of a database's) and for tests
// of the middleware alone.
type memStore struct {
	mu     sync.Mutex
	keep   bool // record responses (false: a first-request benchmark, whose keys are never replayed)
	held   map[string]bool
	stored map[string]idempotency.StoredResponse
}

func newMemStore(keep bool) *memStore {
	return &memStore{keep: keep, held: map[string]bool{}, stored: map[string]idempotency.StoredResponse{}}
}

func (s *memStore) Claim(_ context.Context, scope, key string, _ []byte, _ time.Duration) (idempotency.Claim, error) {
	k := scope + "\x00" + key
	s.mu.Lock()
	defer s.mu.Unlock()
	if r, ok := s.stored[k]; ok {
		return idempotency.Claim{State: idempotency.ClaimStored, Stored: r}, nil
	}
	if s.held[k] {
		return idempotency.Claim{State: idempotency.ClaimBusy}, nil
	}
	s.held[k] = true
	return idempotency.Claim{State: idempotency.ClaimTaken, Lease: &memLease{s: s, k: k}}, nil
}

type memLease struct {
	s *memStore
	k string
}

func (l *memLease) Context(ctx context.Context) context.Context { return ctx }
func (l *memLease) Failed() bool                                { return false }
func (l *memLease) Record(_ context.Context, r idempotency.StoredResponse) error {
	l.s.mu.Lock()
	defer l.s.mu.Unlock()
	delete(l.s.held, l.k)
	if l.s.keep {
		l.s.stored[l.k] = r
	}
	return nil
}

func (l *memLease) Release(context.Context) {
	l.s.mu.Lock()
	defer l.s.mu.Unlock()
	delete(l.s.held, l.k)
}
