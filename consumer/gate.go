package consumer

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/twmb/franz-go/pkg/kgo"
)

// conflictGate makes the member's own transactions whose conflict keys
// overlap take turns in the process, before they reach the database.
//
// The advisory locks alone would keep them apart too, but at a price that
// grows with every transaction that waits: a waiting transaction holds a
// connection, and it has taken its locks in ascending order up to the one it
// waits for, so it blocks, while it waits, every transaction that wants one
// of those. Each commit then wakes a chain of backends that each take a few
// locks and go back to sleep before one of them can run. On a workload whose
// batches all share rows, three members with six transactions in flight
// made 0.74 of the rate of one member with four, and 0.97 to 0.99 with three.
// Through the gate a member sends the database only transactions that do not
// overlap: none of them waits in Postgres for another of its own, only for
// other members' transactions.
//
// A transaction enters when none of its keys is held by one in flight and
// none is wanted by one that came before it and still waits: first come,
// first served, so a transaction with many keys is never overtaken for good
// by a stream of smaller ones. That is stricter than the locks themselves:
// a waiter reserves all its keys, where in Postgres it would hold only those
// below the one it waits for, so a later transaction that shares one of its
// higher keys waits behind it even where Postgres would let it run (and
// could keep a batch of many keys waiting for as long as smaller ones keep
// coming). And a transaction let in holds all its keys here while it may
// still wait in Postgres on another member's. Entering takes no lock of
// Postgres and no connection.
type conflictGate struct {
	mu      sync.Mutex
	held    map[int64]struct{}
	wanted  map[int64]int // keys of the waiters, counted
	waiters []*gateWaiter
	waits   atomic.Int64 // transactions that waited for their turn (Stats.TurnWaits)
}

type gateWaiter struct {
	keys  []int64
	ready chan struct{} // closed when the waiter holds its keys
}

// enterTx waits for the turn of a transaction of rec with the lock ids keys
// (from lockIDs) among the member's transactions that share one
// (conflictGate), counting a wait in the oncely.consumer.turn_waits metric,
// then takes a transaction slot (Config.Concurrency) if src is a slotter:
// waiting for a turn holds no slot, which transactions of other keys can
// use meanwhile. It returns the function that gives both back, once the
// transaction has ended; false when ctx ended or the worker stopped first.
func (c *Consumer) enterTx(ctx context.Context, keys []int64, rec *kgo.Record, src Source) (func(), bool) {
	leaveGate, ok := c.gate.enter(ctx, keys, func() { c.metrics.turnWaits.Add(ctx, 1, c.topicAttrs(rec)) })
	if !ok {
		return nil, false
	}
	sl, slotted := src.(slotter)
	if !slotted {
		return leaveGate, true
	}
	if !sl.acquire() {
		leaveGate()
		return nil, false
	}
	return func() { sl.release(); leaveGate() }, true
}

// enter waits until the transaction with the distinct lock ids keys may run,
// and returns the function that lets the next ones in once it has ended;
// waiting is called, if not nil, when it has to wait. It gives up (false)
// when ctx ends first. Without keys it returns at once.
func (g *conflictGate) enter(ctx context.Context, keys []int64, waiting func()) (leave func(), ok bool) {
	if len(keys) == 0 {
		return func() {}, true
	}
	leave = func() { g.leave(keys) }
	g.mu.Lock()
	if g.free(keys, g.wanted) {
		g.take(keys)
		g.mu.Unlock()
		return leave, true
	}
	g.waits.Add(1)
	wt := &gateWaiter{keys: keys, ready: make(chan struct{})}
	g.waiters = append(g.waiters, wt)
	if g.wanted == nil {
		g.wanted = make(map[int64]int)
	}
	for _, k := range keys {
		g.wanted[k]++
	}
	g.mu.Unlock()
	if waiting != nil {
		waiting()
	}

	select {
	case <-wt.ready:
		return leave, true
	case <-ctx.Done():
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	select {
	case <-wt.ready: // let in meanwhile: let the next ones in instead
		g.release(keys)
	default:
		g.waiters = slices.DeleteFunc(g.waiters, func(o *gateWaiter) bool { return o == wt })
		g.unwant(keys)
	}
	g.admit() // it may have held back those behind it
	return nil, false
}

// leave ends the turn of the transaction that held keys.
func (g *conflictGate) leave(keys []int64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.release(keys)
	g.admit()
}

// free reports whether none of keys is held, or counted in also.
func (g *conflictGate) free(keys []int64, also map[int64]int) bool {
	for _, k := range keys {
		if _, ok := g.held[k]; ok {
			return false
		}
		if also[k] > 0 {
			return false
		}
	}
	return true
}

func (g *conflictGate) take(keys []int64) {
	if g.held == nil {
		g.held = make(map[int64]struct{}, len(keys))
	}
	for _, k := range keys {
		g.held[k] = struct{}{}
	}
}

func (g *conflictGate) release(keys []int64) {
	for _, k := range keys {
		delete(g.held, k)
	}
}

func (g *conflictGate) unwant(keys []int64) {
	for _, k := range keys {
		if g.wanted[k]--; g.wanted[k] <= 0 {
			delete(g.wanted, k)
		}
	}
}

// admit lets in, in their order, the waiters whose keys are neither held
// nor wanted by a waiter before them.
func (g *conflictGate) admit() {
	if len(g.waiters) == 0 {
		return
	}
	var before map[int64]int // keys of the waiters still waiting, so far
	kept := g.waiters[:0]
	for _, wt := range g.waiters {
		if g.free(wt.keys, before) {
			g.take(wt.keys)
			g.unwant(wt.keys)
			close(wt.ready)
			continue
		}
		if before == nil {
			before = make(map[int64]int)
		}
		for _, k := range wt.keys {
			before[k]++
		}
		kept = append(kept, wt)
	}
	clear(g.waiters[len(kept):])
	g.waiters = kept
}
