package integration_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/internal/testhook"
)

// Duplicate deliveries: 10k messages, 20% of them delivered a second time
// with the same message-id at a later offset. Each must have one effect.
func TestDuplicateDeliveriesHaveOneEffect(t *testing.T) {
	t.Parallel()
	const partitions, unique = 4, 10_000
	e := newEnv(t, partitions)
	msgs := uniqueMsgs("order", unique, partitions)
	rng := rand.New(rand.NewPCG(1, 2))
	dups := 0
	for i := range unique {
		if rng.IntN(5) == 0 { // 20%
			m := msgs[i]
			m.partition = rng.Int32N(partitions) // a duplicate may even land elsewhere
			msgs = append(msgs, m)
			dups++
		}
	}
	e.produce(t, msgs)

	m := e.start(context.Background(), e.config("a", recordEffect("a")))
	eventually(t, 2*time.Minute, "all records processed and committed", func() bool {
		s := m.c.Stats()
		return s.Processed+s.Duplicates == int64(len(msgs)) && e.committedLag(t) == 0
	})
	e.assertExactlyOnce(t, unique)
	s := m.c.Stats()
	if s.Duplicates != int64(dups) || s.Processed != unique {
		t.Errorf("stats = %+v, want %d processed and %d duplicates", s, unique, dups)
	}
	if n := e.count(t, `SELECT count(*) FROM inbox WHERE consumer_group = $1`, e.group); n != unique {
		t.Errorf("inbox rows = %d, want %d", n, unique)
	}
	if err := m.stop(t); err != nil {
		t.Fatalf("Run: %v", err)
	}
	t.Logf("delivered %d records (%d duplicates): %+v", len(msgs), dups, s)
}

// A member crashes after a record's transaction committed and before its
// offset was committed. The next member receives the committed records again
// and skips them as duplicates.
func TestCrashAfterDBCommitBeforeOffsetCommit(t *testing.T) {
	t.Parallel()
	const partitions, n = 3, 3000
	e := newEnv(t, partitions)
	e.produce(t, uniqueMsgs("m", n, partitions))

	var seen atomic.Int64
	hooks := &testhook.Consumer{AfterCommit: func(*kgo.Record) error {
		if seen.Add(1) == 1200 {
			return testhook.ErrCrash
		}
		return nil
	}}
	cfg := e.config("a", recordEffect("a"))
	cfg.CommitInterval = time.Hour // nothing reaches Kafka before the crash
	first := e.start(testhook.WithConsumer(context.Background(), hooks), cfg)
	err := first.wait(t, time.Minute)
	if !errors.Is(err, testhook.ErrCrash) {
		t.Fatalf("first member: Run = %v, want the simulated crash", err)
	}
	applied := e.count(t, `SELECT count(*) FROM effects`)
	if applied < 1200 || applied >= n {
		t.Fatalf("effects after crash = %d, want between 1200 and %d", applied, n)
	}
	if lag := e.committedLag(t); lag != n {
		t.Fatalf("after the crash the group's lag is %d, want %d (no offsets committed)", lag, n)
	}

	second := e.start(context.Background(), e.config("b", recordEffect("b")))
	eventually(t, time.Minute, "second member to catch up", func() bool {
		s := second.c.Stats()
		return s.Processed+s.Duplicates == n && e.committedLag(t) == 0
	})
	e.assertExactlyOnce(t, n)
	// Counted again now: a transaction whose COMMIT was on the wire when
	// the crash abandoned it may have committed on the server after Run
	// returned (the client never learnt its outcome). The inbox makes it a
	// duplicate all the same.
	applied = e.count(t, `SELECT count(*) FROM effects WHERE member = 'a'`)
	s := second.c.Stats()
	if s.Duplicates != applied || s.Processed != n-applied {
		t.Errorf("second member stats %+v: want %d duplicates (the redelivered committed records) and %d processed", s, applied, n-applied)
	}
	if err := second.stop(t); err != nil {
		t.Fatal(err)
	}
}

// A zombie: member A's handler is stuck inside its transaction when A
// gives up the partition (its shutdown abandons the record and leaves the
// group). Member B takes the partition and delivers the same record; B's
// inbox claim waits on A's open transaction. When A's handler returns, its
// transaction can no longer commit, and B's effect is the only one.
func TestZombieMemberRacesNewOwner(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.produce(t, []msg{{id: "contested", partition: 0}})

	g := newGate()
	defer g.open()
	entered := make(chan struct{})
	var zombieErr atomic.Value
	cfgA := e.config("a", func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if err := recordEffect("a")(ctx, tx, msg); err != nil {
			return err
		}
		close(entered)
		g.wait() // stuck, deaf to ctx, like a handler blocked on a slow call
		_, err := tx.Exec(context.Background(), `SELECT 1`)
		zombieErr.Store(fmt.Sprint(err))
		return nil
	})
	cfgA.ShutdownTimeout = time.Second
	a := e.start(context.Background(), cfgA)
	a.await(t, entered)

	if err := a.stop(t); err != nil { // abandons the stuck record, leaves the group
		t.Fatalf("A: Run = %v", err)
	}
	b := e.start(context.Background(), e.config("b", recordEffect("b")))

	// B's claim must be waiting on A's row lock: the two really race.
	e.waitForBlockedClaim(t)
	if got := b.c.Stats().Processed; got != 0 {
		t.Fatalf("B processed %d records while A's transaction was open", got)
	}
	g.open()
	eventually(t, 30*time.Second, "B to apply the record", func() bool { return b.c.Stats().Processed == 1 })
	e.assertExactlyOnce(t, 1)
	if n := e.count(t, `SELECT count(*) FROM effects WHERE member = 'b'`); n != 1 {
		t.Errorf("B's effects = %d, want 1 (A's transaction was abandoned)", n)
	}
	if a.c.Stats().Processed != 0 {
		t.Errorf("A counted %d processed records; its transaction must not have committed", a.c.Stats().Processed)
	}
	if err := b.stop(t); err != nil {
		t.Fatal(err)
	}
}

// Members join and leave while 10k records flow: no loss, no duplicate
// effect, and per partition the effects follow the offsets.
func TestRebalanceMidStream(t *testing.T) {
	t.Parallel()
	const partitions, n = 6, 10_000
	e := newEnv(t, partitions)

	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // the stream: produced in slices while members come and go
		defer wg.Done()
		msgs := uniqueMsgs("r", n, partitions)
		for i := 0; i < n; i += 500 {
			e.produce(t, msgs[i:i+500])
		}
	}()
	effects := func() int64 { return e.count(t, `SELECT count(*) FROM effects`) }
	startAt := func(at int64) {
		eventually(t, time.Minute, fmt.Sprintf("%d effects", at), func() bool { return effects() >= at })
	}

	m1 := e.start(context.Background(), e.config("m1", recordEffect("m1")))
	startAt(1500)
	m2 := e.start(context.Background(), e.config("m2", recordEffect("m2")))
	startAt(3000)
	m3 := e.start(context.Background(), e.config("m3", recordEffect("m3")))
	startAt(4500)
	if err := m1.stop(t); err != nil {
		t.Fatalf("m1: %v", err)
	}
	startAt(6000)
	m4 := e.start(context.Background(), e.config("m4", recordEffect("m4")))
	startAt(7500)
	if err := m2.stop(t); err != nil {
		t.Fatalf("m2: %v", err)
	}
	wg.Wait()
	eventually(t, 2*time.Minute, "all records applied and committed", func() bool {
		return effects() == n && e.committedLag(t) == 0
	})
	e.assertExactlyOnce(t, n)

	// Per partition, effects in commit order have strictly rising offsets.
	rows, err := e.db.Pool.Query(context.Background(), `SELECT partition, "offset" FROM effects ORDER BY seq`)
	if err != nil {
		t.Fatal(err)
	}
	last := map[int32]int64{}
	var p int32
	var off int64
	if _, err := pgx.ForEachRow(rows, []any{&p, &off}, func() error {
		if prev, ok := last[p]; ok && off <= prev {
			return fmt.Errorf("partition %d: offset %d applied after %d", p, off, prev)
		}
		last[p] = off
		return nil
	}); err != nil {
		t.Error(err)
	}
	members := e.count(t, `SELECT count(DISTINCT member) FROM effects`)
	if members < 3 {
		t.Errorf("only %d members applied effects; the rebalances did not move work", members)
	}
	for _, m := range []*member{m3, m4} {
		if err := m.stop(t); err != nil {
			t.Fatal(err)
		}
	}
}

// A handler that fails, then panics, then succeeds is retried with backoff
// and applies its effect once.
func TestHandlerErrorAndPanicAreRetried(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.produce(t, []msg{{id: "flaky", partition: 0}, {id: "next", partition: 0}})

	var mu sync.Mutex
	var attempts []int
	cfg := e.config("a", func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if err := recordEffect("a")(ctx, tx, msg); err != nil {
			return err
		}
		if msg.ID != "flaky" {
			return nil
		}
		mu.Lock()
		attempts = append(attempts, msg.Attempt)
		mu.Unlock()
		switch msg.Attempt {
		case 1:
			return errors.New("transient failure")
		case 2:
			panic("handler bug")
		}
		return nil
	})
	m := e.start(context.Background(), cfg)
	eventually(t, 30*time.Second, "both records done", func() bool { return m.c.Stats().Processed == 2 })
	e.assertExactlyOnce(t, 2)
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(attempts, []int{1, 2, 3}) {
		t.Errorf("attempts = %v, want [1 2 3]", attempts)
	}
	if r := m.c.Stats().Retries; r != 2 {
		t.Errorf("retries = %d, want 2", r)
	}
}

// After a graceful shutdown a new member redelivers nothing already
// processed: it sees only records produced afterwards.
func TestGracefulShutdownCommitsOffsets(t *testing.T) {
	t.Parallel()
	const partitions, n = 4, 2000
	e := newEnv(t, partitions)
	e.produce(t, uniqueMsgs("g", n, partitions))
	cfg := e.config("a", recordEffect("a"))
	cfg.CommitInterval = time.Hour // only the shutdown commit can save the offsets
	first := e.start(context.Background(), cfg)
	eventually(t, time.Minute, "first member processed everything", func() bool { return first.c.Stats().Processed == n })
	if err := first.stop(t); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if lag := e.committedLag(t); lag != 0 {
		t.Fatalf("lag after graceful shutdown = %d, want 0", lag)
	}

	e.produce(t, uniqueMsgs("after", partitions, partitions)) // one per partition
	second := e.start(context.Background(), e.config("b", recordEffect("b")))
	eventually(t, time.Minute, "second member processed the new records", func() bool {
		return second.c.Stats().Processed == partitions && e.committedLag(t) == 0
	})
	if s := second.c.Stats(); s.Duplicates != 0 || s.Processed != partitions {
		t.Errorf("second member %+v: want only the %d new records, no redelivery", s, partitions)
	}
	e.assertExactlyOnce(t, n+partitions)
}

// A tiny per-partition buffer makes fetching pause and resume all the time;
// every record still arrives once.
func TestBackpressurePausesFetching(t *testing.T) {
	t.Parallel()
	const partitions, n = 2, 3000
	e := newEnv(t, partitions)
	e.produce(t, uniqueMsgs("b", n, partitions))
	cfg := e.config("a", recordEffect("a"))
	cfg.MaxBufferedRecords = 8
	cfg.MaxPollRecords = 16
	m := e.start(context.Background(), cfg)
	eventually(t, time.Minute, "all processed", func() bool { return m.c.Stats().Processed == n && e.committedLag(t) == 0 })
	e.assertExactlyOnce(t, n)
}

// The classic zombie: member A is cut off from the group coordinator (its
// heartbeats go unanswered) while its handler is inside a transaction. The
// group expires A's session and gives the partition to B, which delivers
// the same record; B's claim waits on A's open transaction. A, unaware, then
// commits. B's claim finds the id and B's transaction is a no-op.
func TestZombieCommitsFirstNewOwnerSkips(t *testing.T) {
	t.Parallel()
	e := newEnvWithKafka(t, 1, kfake.GroupMinSessionTimeout(500*time.Millisecond))
	if e.kafka.Cluster == nil {
		t.Skip("cutting a member off its coordinator needs the in-process kfake broker (KAFKA_BROKERS is set)")
	}
	e.produce(t, []msg{{id: "contested", partition: 0}})

	var cutOff atomic.Bool
	e.kafka.Cluster.ControlKey(kmsg.Heartbeat.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		e.kafka.Cluster.KeepControl()
		hb := req.(*kmsg.HeartbeatRequest)
		if cutOff.Load() && hb.InstanceID != nil && *hb.InstanceID == "zombie-a" {
			return nil, nil, true // swallowed: A never hears of the rebalance
		}
		return nil, nil, false
	})

	g := newGate()
	defer g.open()
	entered := make(chan struct{})
	cfgA := e.config("a", func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if err := recordEffect("a")(ctx, tx, msg); err != nil {
			return err
		}
		close(entered)
		g.wait()
		return nil
	})
	cfgA.InstanceID = "zombie-a"
	cfgA.SessionTimeout = time.Second
	cfgA.RebalanceTimeout = time.Second
	cfgA.ShutdownTimeout = 2 * time.Second
	a := e.start(context.Background(), cfgA)
	a.await(t, entered)
	cutOff.Store(true)

	cfgB := e.config("b", recordEffect("b"))
	cfgB.SessionTimeout = time.Second
	b := e.start(context.Background(), cfgB)
	e.waitForBlockedClaim(t)
	g.open() // A's handler returns and A commits: it never learnt it lost the partition
	eventually(t, 30*time.Second, "B to skip the record as a duplicate", func() bool { return b.c.Stats().Duplicates == 1 })
	e.assertExactlyOnce(t, 1)
	if n := e.count(t, `SELECT count(*) FROM effects WHERE member = 'a'`); n != 1 {
		t.Errorf("A's effects = %d, want 1 (the zombie committed first)", n)
	}
	if s := b.c.Stats(); s.Processed != 0 {
		t.Errorf("B processed %d records; its transaction should have been a no-op", s.Processed)
	}
	a.cancel()
	_ = a.wait(t, 30*time.Second) // A may report errors: it was fenced
	if err := b.stop(t); err != nil {
		t.Fatal(err)
	}
}
