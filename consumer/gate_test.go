package consumer

import (
	"context"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
)

// now reports whether a transaction with keys would enter g at once: enter
// with a context that has ended lets in only what need not wait.
func now(t *testing.T, g *conflictGate, keys ...int64) bool {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	leave, ok := g.enter(ctx, keys, nil)
	if ok {
		leave()
	}
	return ok
}

// waitFor enters g with keys in a goroutine once the gate counts it as
// waiting, and returns what its enter returns.
func waitFor(t *testing.T, ctx context.Context, g *conflictGate, keys ...int64) <-chan func() {
	t.Helper()
	before := g.waits.Load()
	entered := make(chan func(), 1)
	go func() {
		leave, ok := g.enter(ctx, keys, nil)
		if !ok {
			leave = nil
		}
		entered <- leave
	}()
	for g.waits.Load() == before {
		select {
		case <-entered:
			t.Fatalf("keys %v entered without waiting", keys)
		default:
			runtime.Gosched()
		}
	}
	return entered
}

func TestGateKeepsOverlappingTransactionsApart(t *testing.T) {
	var g conflictGate
	const workers, rounds, keys = 8, 400, 10
	var inside [keys]atomic.Int32
	var together atomic.Int32 // most transactions seen inside at once
	var in atomic.Int32
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			for range rounds {
				set := make([]int64, 0, 4)
				for range 1 + rng.IntN(4) {
					set = append(set, int64(rng.IntN(keys)))
				}
				set = lockIDs(set)
				leave, ok := g.enter(context.Background(), set, nil)
				if !ok {
					t.Error("enter gave up without a cancelled context")
					return
				}
				n := in.Add(1)
				for cur := together.Load(); n > cur && !together.CompareAndSwap(cur, n); cur = together.Load() {
				}
				for _, k := range set {
					if got := inside[k].Add(1); got != 1 {
						t.Errorf("key %d held by %d transactions at once", k, got)
					}
				}
				runtime.Gosched()
				for _, k := range set {
					inside[k].Add(-1)
				}
				in.Add(-1)
				leave()
			}
		})
	}
	wg.Wait()
	if together.Load() < 2 {
		t.Errorf("never more than %d transaction inside at once: transactions with disjoint keys must run side by side", together.Load())
	}
	if g.waits.Load() == 0 {
		t.Error("no transaction ever waited: the test did not contend")
	}
	if len(g.held) != 0 || len(g.wanted) != 0 || len(g.waiters) != 0 {
		t.Errorf("gate not empty at the end: held %v, wanted %v, %d waiters", g.held, g.wanted, len(g.waiters))
	}
}

func TestGateTurnsAreFirstComeFirstServed(t *testing.T) {
	var g conflictGate
	leaveA, ok := g.enter(context.Background(), []int64{1}, nil)
	if !ok {
		t.Fatal("A could not enter an empty gate")
	}
	if !now(t, &g, 2) {
		t.Fatal("a transaction with other keys waited for A")
	}
	b := waitFor(t, context.Background(), &g, 1, 2)
	if now(t, &g, 2) {
		t.Fatal("C (key 2) overtook B (keys 1, 2), which came first and waits for A")
	}
	if !now(t, &g, 3) {
		t.Fatal("D (key 3) waited although no one holds or wants its key")
	}
	leaveA()
	leaveB := <-b
	if leaveB == nil {
		t.Fatal("B gave up")
	}
	if now(t, &g, 2) {
		t.Fatal("C entered while B holds key 2")
	}
	leaveB()
	if !now(t, &g, 1, 2) {
		t.Fatal("keys 1 and 2 still held after B left")
	}
	if got := g.waits.Load(); got != 3 {
		t.Errorf("waits = %d, want 3 (B, and the two probes of C that could not enter)", got)
	}
}

func TestGateWaiterThatGivesUpLetsOthersIn(t *testing.T) {
	var g conflictGate
	leaveA, _ := g.enter(context.Background(), []int64{1}, nil)
	ctxB, cancelB := context.WithCancel(context.Background())
	b := waitFor(t, ctxB, &g, 1, 2)
	c := waitFor(t, context.Background(), &g, 2) // behind B, for key 2
	cancelB()
	if leave := <-b; leave != nil {
		t.Fatal("B entered although A still holds key 1")
	}
	leaveC := <-c // B no longer holds C back
	if leaveC == nil {
		t.Fatal("C gave up")
	}
	leaveC()
	leaveA()
	if !now(t, &g, 1, 2) || len(g.held) != 0 || len(g.wanted) != 0 || len(g.waiters) != 0 {
		t.Errorf("gate not empty: held %v, wanted %v, %d waiters", g.held, g.wanted, len(g.waiters))
	}
}

// A waiter let in at the moment its context ends either takes its turn or
// hands it on; either way no key stays held.
func TestGateWaiterLetInAsItGivesUp(t *testing.T) {
	for range 50 {
		var g conflictGate
		leaveA, _ := g.enter(context.Background(), []int64{1}, nil)
		ctxB, cancelB := context.WithCancel(context.Background())
		b := waitFor(t, ctxB, &g, 1, 2)
		g.mu.Lock() // B's cancellation and A's leaving land together
		cancelB()
		g.release([]int64{1})
		g.admit()
		g.mu.Unlock()
		if leave := <-b; leave != nil {
			leave()
		}
		_ = leaveA // A's keys were released by hand above
		if len(g.held) != 0 || len(g.wanted) != 0 || len(g.waiters) != 0 {
			t.Fatalf("gate not empty: held %v, wanted %v, %d waiters", g.held, g.wanted, len(g.waiters))
		}
	}
}

func TestLockIDsSortsAndDropsDuplicates(t *testing.T) {
	in := []int64{5, 1, 5, 3, 1}
	got := lockIDs(in)
	if want := []int64{1, 3, 5}; !slices.Equal(got, want) {
		t.Errorf("lockIDs = %v, want %v", got, want)
	}
	if !slices.Equal(in, []int64{5, 1, 5, 3, 1}) {
		t.Errorf("lockIDs changed its argument: %v", in)
	}
}
