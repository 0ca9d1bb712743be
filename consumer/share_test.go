package consumer

import (
	"context"
	"log/slog"
	"runtime"
	"testing"
	"time"
)

func TestGroupShare(t *testing.T) {
	for _, c := range []struct {
		group, concurrency, held, all, want int
	}{
		{4, 4, 6, 6, 4}, // one member: the whole bound
		{4, 4, 2, 6, 1}, // one of three: 4/3 rounded down
		{4, 4, 3, 6, 2}, // one of two
		{4, 4, 1, 6, 1}, // less than one: still one
		{6, 4, 6, 6, 4}, // never above Concurrency
		{6, 4, 2, 6, 2},
		{12, 8, 4, 12, 4},
		{4, 4, 0, 6, 1},   // nothing held yet
		{3, 4, 2, 0, 3},   // partitions not counted: as if it held them all
		{3, 2, 7, 6, 2},   // held more than counted (a topic grew): the same
		{5, 10, 5, 10, 2}, // 2.5 rounded down
	} {
		if got := groupShare(c.group, c.concurrency, c.held, c.all); got != c.want {
			t.Errorf("groupShare(group %d, concurrency %d, held %d of %d) = %d, want %d",
				c.group, c.concurrency, c.held, c.all, got, c.want)
		}
	}
}

// Members whose shares are whole never exceed the group's bound together,
// however the partitions fall among them.
func TestGroupSharesKeepToTheBound(t *testing.T) {
	for group := 1; group <= 12; group++ {
		for all := 1; all <= 12; all++ {
			for members := 1; members <= min(group, all); members++ {
				sum := 0
				for m := range members { // as even as a balancer makes it
					held := all / members
					if m < all%members {
						held++
					}
					sum += groupShare(group, 64, held, all)
				}
				if sum > group {
					t.Errorf("group %d over %d partitions, %d members: shares sum to %d", group, all, members, sum)
				}
			}
		}
	}
}

// The share loop follows the partitions the member holds: it takes slots
// out of Concurrency as the share shrinks, waiting for transactions in
// flight to give theirs back, gives them back as the share grows, gives up
// a reservation when the share moves on meanwhile, and keeps its slots when
// the member stops.
func TestShareLoopFollowsThePartitionsHeld(t *testing.T) {
	c := &Consumer{cfg: Config{Group: "g", Concurrency: 4, GroupConcurrency: 3, Logger: slog.New(slog.DiscardHandler)}}
	r := &run{c: c, slots: make(chan struct{}, 4),
		countPartitions: func(context.Context) (int, error) { return 6, nil }}
	free := func() int { // slots a transaction could take now
		n := 0
		for {
			select {
			case r.slots <- struct{}{}:
				n++
				continue
			default:
			}
			for range n {
				<-r.slots
			}
			return n
		}
	}
	until := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("%s: share %d, %d of 4 slots taken", what, c.limit.Load(), len(r.slots))
			}
			runtime.Gosched()
		}
	}
	settle := func(what string, share int64) {
		t.Helper()
		until(what, func() bool { return c.limit.Load() == share })
	}
	taken := func(what string, n int) {
		t.Helper()
		until(what, func() bool { return len(r.slots) == n })
	}

	r.startShare()
	if n := free(); n != 1 || c.limit.Load() != 1 {
		t.Fatalf("before the loop: %d slots free, share %d; want 1 and 1", n, c.limit.Load())
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	c.held.Store(6)
	go func() {
		defer close(done)
		r.shareLoop(ctx)
	}()
	settle("holding 6 of 6", 3)
	if n := free(); n != 3 {
		t.Fatalf("holding 6 of 6: %d slots free, want 3", n)
	}

	// Three transactions in flight; the member drops to 2 of 6 (share 1):
	// the loop waits for two of them to end.
	for range 3 {
		r.slots <- struct{}{}
	}
	c.held.Store(2)
	r.resize()
	<-r.slots                                 // one transaction ends: the loop takes its slot
	taken("the loop takes the freed slot", 4) // 2 in flight, 2 reserved
	if c.limit.Load() != 3 {
		t.Fatalf("share %d while the loop still waits for a slot, want the old 3", c.limit.Load())
	}
	// Before another ends, the member gets its partitions back: the loop
	// gives up waiting and gives a slot back instead.
	c.held.Store(6)
	r.resize()
	taken("holding 6 again with 2 in flight", 3) // 2 in flight, 1 reserved
	if c.limit.Load() != 3 {
		t.Fatalf("holding 6 again: share %d, want 3", c.limit.Load())
	}
	c.held.Store(2)
	r.resize()
	<-r.slots
	<-r.slots // both transactions end
	settle("holding 2 of 6", 1)
	if n := free(); n != 1 {
		t.Fatalf("holding 2 of 6: %d slots free, want 1", n)
	}

	cancel()
	<-done
	if len(r.slots) != 3 || r.reserved != 3 {
		t.Fatalf("after the loop: %d slots taken, %d reserved; want the 3 reserved kept", len(r.slots), r.reserved)
	}
}
