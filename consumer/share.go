package consumer

import (
	"context"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
)

// groupShare is the member's share of Config.GroupConcurrency when it holds
// held of all the partitions of its topics: rounded down, so that members
// holding whole shares never exceed the group's bound together, but at least
// one (a member with partitions must make progress) and at most
// Config.Concurrency.
func groupShare(group, concurrency, held, all int) int {
	if all <= 0 || held > all {
		return min(group, concurrency) // not known: as if it held them all
	}
	return max(1, min(concurrency, group*held/all))
}

// shareTimeout bounds the metadata request that counts the topics'
// partitions; past it the member keeps the share it had.
const shareTimeout = 5 * time.Second

// startShare takes the member's first share of Config.GroupConcurrency, one
// slot, before it holds any partition; shareLoop takes the share its
// partitions give it as soon as it runs. Starting low keeps a member that
// joins a busy group from running more than its share while it counts the
// partitions.
func (r *run) startShare() {
	c := r.c
	if c.cfg.GroupConcurrency == 0 {
		return
	}
	for range c.cfg.Concurrency - 1 {
		r.slots <- struct{}{}
	}
	r.reserved = c.cfg.Concurrency - 1
	c.limit.Store(1)
	r.reshare = make(chan struct{}, 1)
	r.resize() // shareLoop's first share
	if r.countPartitions == nil {
		r.countPartitions = r.partitionCount
	}
}

// resize asks the share loop to take the member's share anew, after the
// partitions it holds changed. It never blocks.
func (r *run) resize() {
	if r.reshare == nil {
		return
	}
	select {
	case r.reshare <- struct{}{}:
	default: // one is pending: it will see this change too
	}
}

// shareLoop keeps the member's transactions in flight to its share of
// Config.GroupConcurrency: it holds r.reserved of the Concurrency slots
// itself, taking more (each waits, like a transaction, for a slot to be
// free) when the share shrinks and giving them back when it grows. It
// keeps them when it returns (when the member stops polling), so that the
// member keeps to its share while it drains.
func (r *run) shareLoop(ctx context.Context) {
	c := r.c
	all, told := 0, false
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.reshare:
		}
		if n, err := r.countPartitions(ctx); err == nil {
			all = n
		} else if ctx.Err() == nil {
			c.cfg.Logger.Warn("oncely cannot count the topics' partitions; the member's share counts them as last seen",
				"group", c.cfg.Group, "partitions", all, "err", err)
		}
		held := int(c.held.Load())
		share := groupShare(c.cfg.GroupConcurrency, c.cfg.Concurrency, held, all)
		if !r.reserve(ctx, c.cfg.Concurrency-share) {
			continue // the share moved on meanwhile, or the run ends
		}
		if int64(share) != c.limit.Swap(int64(share)) || !told {
			told = true
			c.cfg.Logger.Info("oncely member's share of the group's concurrency", "group", c.cfg.Group,
				"group_concurrency", c.cfg.GroupConcurrency, "partitions_held", held, "partitions", all, "concurrency", share)
		}
	}
}

// reserve takes slots out of r.slots, or gives its own back, until it holds
// want of them. It gives up (false) when the share moves on before it is
// done (asking shareLoop again) or ctx ends.
func (r *run) reserve(ctx context.Context, want int) bool {
	for r.reserved > want {
		<-r.slots // one of ours: the channel holds at least r.reserved
		r.reserved--
	}
	for r.reserved < want {
		select {
		case r.slots <- struct{}{}:
			r.reserved++
		case <-r.reshare:
			r.resize()
			return false
		case <-ctx.Done():
			return false
		}
	}
	return true
}

// partitionCount counts the partitions of the consumed topics.
func (r *run) partitionCount(ctx context.Context) (int, error) {
	mctx, cancel := context.WithTimeout(ctx, shareTimeout)
	defer cancel()
	md, err := kadm.NewClient(r.cl).Metadata(mctx, r.c.cfg.Topics...)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, t := range md.Topics {
		if t.Err != nil {
			return 0, t.Err
		}
		n += len(t.Partitions)
	}
	return n, nil
}
