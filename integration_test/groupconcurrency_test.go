package integration_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/oncely/oncely/consumer"
)

// inFlight counts the handlers running at once, over the group and per
// member, and the most of each seen since the last reset.
type inFlight struct {
	mu        sync.Mutex
	now, most int
	member    map[string][2]int // now, most
}

func (f *inFlight) enter(member string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.now++
	f.most = max(f.most, f.now)
	m := f.member[member]
	m[0]++
	m[1] = max(m[1], m[0])
	f.member[member] = m
}

func (f *inFlight) leave(member string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.now--
	m := f.member[member]
	m[0]--
	f.member[member] = m
}

// reset forgets the most seen so far.
func (f *inFlight) reset() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.most = f.now
	for k, m := range f.member {
		f.member[k] = [2]int{m[0], m[0]}
	}
}

func (f *inFlight) mostSeen() (int, map[string]int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	per := map[string]int{}
	for k, m := range f.member {
		per[k] = m[1]
	}
	return f.most, per
}

// TestGroupConcurrencyBoundsTheGroup: three members of one group, each with
// a pool (and Concurrency) of 4 and GroupConcurrency 3, over 6 partitions.
// Each takes a share of one, so the group never runs more than 3
// transactions at once, where without the bound each member would run one
// per partition it holds (record and batch mode) or 4 (key parallelism).
// When two members leave, the one left holds every partition and takes
// the whole bound. Handlers hold their transaction open for a moment
// (pg_sleep), so that the transactions the consumer allows do overlap.
func TestGroupConcurrencyBoundsTheGroup(t *testing.T) {
	const (
		partitions = 6
		bound      = 3
		perMember  = 4
		records    = 240
	)
	e := newEnv(t, partitions)
	ctx := context.Background()
	flight := &inFlight{member: map[string][2]int{}}
	var members []*member
	for k := range 3 {
		pool := e.memberPool(t, perMember, nil)
		name := fmt.Sprintf("m%d", k)
		effect := recordEffect(name)
		cfg := e.config(name, func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			flight.enter(name)
			defer flight.leave(name)
			if _, err := tx.Exec(ctx, `SELECT pg_sleep(0.01)`); err != nil {
				return err
			}
			return effect(ctx, tx, msg)
		})
		cfg.Pool, cfg.GroupConcurrency = pool, bound
		if cfg.BatchSize > 1 {
			cfg.BatchSize = 4 // batches of a few records: many transactions
		}
		members = append(members, e.start(ctx, cfg))
	}
	settled := func(ms []*member, held, share int64) func() bool {
		return func() bool {
			for _, m := range ms {
				if s := m.c.Stats(); s.PartitionsHeld != held || s.Concurrency != share {
					return false
				}
			}
			return true
		}
	}
	eventually(t, 30*time.Second, "each member holding 2 partitions with a share of 1", settled(members, 2, 1))

	e.produce(t, uniqueMsgs("gc", records, partitions))
	eventually(t, time.Minute, "every record applied", func() bool {
		return e.count(t, `SELECT count(*) FROM effects`) >= records
	})
	most, per := flight.mostSeen()
	if most > bound {
		t.Errorf("%d transactions ran at once in the group; GroupConcurrency is %d", most, bound)
	}
	for name, n := range per {
		if n > 1 {
			t.Errorf("member %s ran %d transactions at once; its share is 1", name, n)
		}
	}
	t.Logf("three members: at most %d at once (per member %v)", most, per)

	// Two leave: the last takes every partition, and the whole bound.
	for _, m := range members[1:] {
		if err := m.stop(t); err != nil {
			t.Fatal(err)
		}
	}
	last := members[0]
	eventually(t, 30*time.Second, "the last member holding 6 partitions with a share of 3", settled([]*member{last}, partitions, bound))
	flight.reset()
	e.produce(t, uniqueMsgs("gc2", records, partitions))
	eventually(t, time.Minute, "every record applied", func() bool {
		return e.count(t, `SELECT count(*) FROM effects`) >= 2*records
	})
	if err := last.stop(t); err != nil {
		t.Fatal(err)
	}
	most, _ = flight.mostSeen()
	if most > bound || most < 2 {
		t.Errorf("the last member ran at most %d transactions at once; want more than its old share of 1, at most %d", most, bound)
	}
	t.Logf("one member: at most %d at once", most)
	e.assertExactlyOnce(t, 2*records)
}
