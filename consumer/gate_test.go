package consumer

import (
	"context"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
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

// turnBound bounds how long a test waits for a gate to let a waiter in: a
// lost wake-up fails the test instead of hanging it.
const turnBound = 10 * time.Second

// let returns what a waiter from waitFor got: its leave function, or nil
// when it gave up.
func let(t *testing.T, entered <-chan func()) func() {
	t.Helper()
	select {
	case leave := <-entered:
		return leave
	case <-time.After(turnBound):
		t.Fatalf("a waiter was not let in within %s: a lost wake-up", turnBound)
		return nil
	}
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

// randomKeys returns 1 to most distinct keys below keys, sorted.
func randomKeys(rng *rand.Rand, most, keys int) []int64 {
	set := make([]int64, 0, most)
	for range 1 + rng.IntN(most) {
		set = append(set, int64(rng.IntN(keys)))
	}
	return lockIDs(set)
}

// holdAlone counts set's keys in inside for a moment, failing the test if
// another transaction counted one of them at the same time.
func holdAlone(t *testing.T, inside []atomic.Int32, set []int64) {
	for _, k := range set {
		if n := inside[k].Add(1); n != 1 {
			t.Errorf("key %d held by %d transactions at once", k, n)
		}
	}
	runtime.Gosched()
	for _, k := range set {
		inside[k].Add(-1)
	}
}

// stressGate runs 8 workers through g, 400 transactions each, on random
// sets of up to most of keys keys, checking that no key is ever held twice at
// once; with giveUp a third of the transactions end their context at a
// random moment, waiting or not. It returns the most transactions seen
// inside at once and how many gave up, and checks the gate is empty at the
// end.
func stressGate(t *testing.T, g *conflictGate, keys, most int, giveUp bool) (together int32, gaveUp int64) {
	t.Helper()
	inside := make([]atomic.Int32, keys)
	var most32, in atomic.Int32
	var gave atomic.Int64
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), uint64(keys)))
			for range 400 {
				set := randomKeys(rng, most, keys)
				ctx, cancel := context.WithCancel(context.Background())
				if giveUp && rng.IntN(3) == 0 {
					time.AfterFunc(time.Duration(rng.IntN(50))*time.Microsecond, cancel)
				}
				leave, ok := g.enter(ctx, set, nil)
				if !ok {
					gave.Add(1)
					cancel()
					continue
				}
				n := in.Add(1)
				for cur := most32.Load(); n > cur && !most32.CompareAndSwap(cur, n); cur = most32.Load() {
				}
				holdAlone(t, inside, set)
				in.Add(-1)
				leave()
				cancel()
			}
		})
	}
	waitGroup(t, &wg)
	if len(g.held) != 0 || len(g.wanted) != 0 || len(g.waiters) != 0 {
		t.Errorf("gate not empty at the end: held %v, wanted %v, %d waiters", g.held, g.wanted, len(g.waiters))
	}
	return most32.Load(), gave.Load()
}

func TestGateKeepsOverlappingTransactionsApart(t *testing.T) {
	var g conflictGate
	together, gaveUp := stressGate(t, &g, 10, 4, false)
	if gaveUp != 0 {
		t.Errorf("%d transactions gave up without their context ending", gaveUp)
	}
	if together < 2 {
		t.Errorf("never more than %d transaction inside at once: transactions with disjoint keys must run side by side", together)
	}
	if g.waits.Load() == 0 {
		t.Error("no transaction ever waited: the test did not contend")
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
	leaveB := let(t, b)
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
	if leave := let(t, b); leave != nil {
		t.Fatal("B entered although A still holds key 1")
	}
	leaveC := let(t, c) // B no longer holds C back
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
		if leave := let(t, b); leave != nil {
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

// waitGroup waits for wg, failing the test past turnBound.
func waitGroup(t *testing.T, wg *sync.WaitGroup) {
	t.Helper()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(turnBound):
		t.Fatalf("workers still in the gate after %s: a lost wake-up", turnBound)
	}
}

// A waiter is let in only when no waiter before it wants one of its keys,
// also when its own keys come free first.
func TestGateLetsWaitersInInTheirOrder(t *testing.T) {
	var g conflictGate
	leaveA, _ := g.enter(context.Background(), []int64{1}, nil)
	leaveH, _ := g.enter(context.Background(), []int64{3}, nil)
	b := waitFor(t, context.Background(), &g, 1, 2) // waits for A
	c := waitFor(t, context.Background(), &g, 2, 3) // waits for H, and behind B for key 2
	leaveH()
	g.mu.Lock()
	_, cIn := g.held[2]
	g.mu.Unlock()
	if cIn {
		t.Fatal("C (keys 2, 3) was let in when H left, ahead of B (keys 1, 2), which came first")
	}
	leaveA()
	leaveB := let(t, b)
	if leaveB == nil {
		t.Fatal("B gave up")
	}
	leaveB()
	if leaveC := let(t, c); leaveC == nil {
		t.Fatal("C gave up")
	} else {
		leaveC()
	}
}

// Mutual exclusion, and nothing left behind, while a third of the waiters
// give up at random moments.
func TestGateWaitersGivingUpLoseNoWakeUp(t *testing.T) {
	var g conflictGate
	if _, gaveUp := stressGate(t, &g, 12, 6, true); gaveUp == 0 {
		t.Error("no waiter gave up: the test did not exercise giving up")
	}
}
