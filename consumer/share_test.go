package consumer

import "testing"

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
