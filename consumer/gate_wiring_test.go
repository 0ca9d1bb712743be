package consumer

import (
	"context"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dlq"
)

// countingSource counts what the record path asks of a Source.
type countingSource struct{ pauses, retries, deadLetters, settles atomic.Int32 }

func (*countingSource) Spent() int        { return 0 }
func (*countingSource) DatabaseDown(bool) {}
func (s *countingSource) Pause(time.Duration) bool {
	s.pauses.Add(1)
	return false
}
func (s *countingSource) Retry(context.Context, time.Duration) bool {
	s.retries.Add(1)
	return false
}
func (s *countingSource) PublishDeadLetter(context.Context, *kgo.Record, *dlq.Info) bool {
	s.deadLetters.Add(1)
	return false
}
func (s *countingSource) Settle(context.Context, *kgo.Record, bool) bool {
	s.settles.Add(1)
	return true
}

// gatedPath is a record path whose pool has no server behind it: these
// tests' attempts never get past the gate.
func gatedPath(t *testing.T, mod func(*Config)) *Consumer {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	cfg := Config{Group: "g", Pool: pool, Handler: func(context.Context, pgx.Tx, *Message) error { return nil }}
	if mod != nil {
		mod(&cfg)
	}
	c, err := NewRecordPath(cfg, "test")
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// waitingInGate waits until c's gate counts n waits.
func waitingInGate(t *testing.T, c *Consumer, n int64) {
	t.Helper()
	deadline := time.Now().Add(turnBound)
	for c.gate.waits.Load() < n {
		if time.Now().After(deadline) {
			t.Fatalf("no attempt waited in the gate within %s", turnBound)
		}
		runtime.Gosched()
	}
}

// deliverWaiting delivers rec, which must wait in c's gate, ends its
// context there, and checks that nothing was counted or settled.
func deliverWaiting(t *testing.T, c *Consumer, recs ...*kgo.Record) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	srcs := make([]Source, len(recs))
	counts := make([]*countingSource, len(recs))
	for i := range recs {
		counts[i] = &countingSource{}
		srcs[i] = counts[i]
	}
	done := make(chan bool, 1)
	go func() {
		if len(recs) == 1 {
			done <- c.Deliver(ctx, recs[0], srcs[0])
		} else {
			done <- c.DeliverBatch(ctx, recs, srcs)
		}
	}()
	waitingInGate(t, c, 1)
	cancel()
	select {
	case settled := <-done:
		if settled {
			t.Error("the delivery reported its records settled")
		}
	case <-time.After(turnBound):
		t.Fatal("the delivery did not return after its context ended")
	}
	if s := c.Stats(); s.Retries != 0 || s.DeadLettered != 0 || s.Contention != 0 || s.Processed != 0 || s.TurnWaits != 1 {
		t.Errorf("stats %+v: a wait ended by its context must count only as a turn waited", s)
	}
	for i, src := range counts {
		if src.pauses.Load()+src.retries.Load()+src.deadLetters.Load()+src.settles.Load() != 0 {
			t.Errorf("record %d's source was paused %d, retried %d, dead-lettered %d, settled %d times; want none",
				i, src.pauses.Load(), src.retries.Load(), src.deadLetters.Load(), src.settles.Load())
		}
	}
}

func gateRecord(offset int64, id string) *kgo.Record {
	return &kgo.Record{Topic: "t", Offset: offset, Headers: []kgo.RecordHeader{{Key: DefaultMessageIDHeader, Value: []byte(id)}}}
}

// A record whose conflict key a transaction of the member holds waits for
// its turn before it reaches the database.
func TestRecordPathWaitsForItsTurn(t *testing.T) {
	c := gatedPath(t, func(cfg *Config) {
		cfg.ConflictKeys = func(*Message) []string { return []string{"hot"} }
	})
	leave, _ := c.gate.enter(context.Background(), []int64{conflictHash(c.cfg.Schema, "hot")}, nil)
	defer leave()
	deliverWaiting(t, c, gateRecord(1, "m1"))
}

// A batch waits for the keys of all its records.
func TestBatchPathWaitsForItsTurn(t *testing.T) {
	c := gatedPath(t, func(cfg *Config) {
		cfg.BatchSize = 4
		cfg.ConflictKeys = func(m *Message) []string { return []string{"k-" + m.ID} }
	})
	leave, _ := c.gate.enter(context.Background(), []int64{conflictHash(c.cfg.Schema, "k-m2")}, nil)
	defer leave()
	deliverWaiting(t, c, gateRecord(1, "m1"), gateRecord(2, "m2"))
}

// In the serial window (no ConflictKeys, after a loss to contention) the
// group-wide lock goes through the gate too: the member's transactions take
// turns in the process.
func TestSerialWindowTakesTurnsInTheProcess(t *testing.T) {
	c := gatedPath(t, nil)
	c.serialUntil.Store(time.Now().Add(time.Minute).UnixNano())
	leave, _ := c.gate.enter(context.Background(), c.groupLock(), nil)
	defer leave()
	deliverWaiting(t, c, gateRecord(1, "m1"))
}

// slottedSource is a countingSource that takes transaction slots, as the
// Kafka worker's does: acquire fails once the worker is stopped.
type slottedSource struct {
	countingSource
	stopped bool
	taken   atomic.Int32
}

func (s *slottedSource) acquire() bool {
	if s.stopped {
		return false
	}
	s.taken.Add(1)
	return true
}

func (s *slottedSource) release() { s.taken.Add(-1) }

// A record waiting for its turn holds no transaction slot: records of
// other keys can use it meanwhile.
func TestWaitingForATurnTakesNoSlot(t *testing.T) {
	c := gatedPath(t, func(cfg *Config) {
		cfg.ConflictKeys = func(*Message) []string { return []string{"hot"} }
	})
	leave, _ := c.gate.enter(context.Background(), []int64{conflictHash(c.cfg.Schema, "hot")}, nil)
	defer leave()
	ctx, cancel := context.WithCancel(context.Background())
	src := &slottedSource{}
	done := make(chan bool, 1)
	go func() { done <- c.Deliver(ctx, gateRecord(1, "m1"), src) }()
	waitingInGate(t, c, 1)
	if n := src.taken.Load(); n != 0 {
		t.Errorf("%d slots held by a record waiting for its turn, want 0", n)
	}
	cancel()
	if <-done {
		t.Error("Deliver reported the record settled")
	}
}

// A worker stopped between a record's turn and its slot gives the turn
// back: the next transaction with its key is not held up.
func TestStoppedBeforeASlotGivesTheTurnBack(t *testing.T) {
	c := gatedPath(t, func(cfg *Config) {
		cfg.ConflictKeys = func(*Message) []string { return []string{"hot"} }
	})
	src := &slottedSource{stopped: true}
	if c.Deliver(context.Background(), gateRecord(1, "m1"), src) {
		t.Error("Deliver reported the record settled although the worker stopped")
	}
	if s := c.Stats(); s.Retries != 0 || s.DeadLettered != 0 || s.Processed != 0 {
		t.Errorf("stats %+v: a record stopped before its transaction must count nothing", s)
	}
	if src.pauses.Load()+src.retries.Load()+src.deadLetters.Load()+src.settles.Load() != 0 {
		t.Error("the stopped record's source was asked to pause, retry, dead-letter or settle")
	}
	if !now(t, &c.gate, conflictHash(c.cfg.Schema, "hot")) {
		t.Error("the key is still held after the stopped record gave up its turn")
	}
}
