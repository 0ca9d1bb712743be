package integration_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
)

// runs counts handler runs per message id, rolled back ones included.
type runs struct {
	mu sync.Mutex
	n  map[string]int
}

func (r *runs) add(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.n == nil {
		r.n = map[string]int{}
	}
	r.n[id]++
	return r.n[id]
}

func (r *runs) get(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.n[id]
}

// effectSeqs returns the commit order (effects.seq) of each id's effect.
func (e *env) effectSeqs(t *testing.T) map[string]int64 {
	t.Helper()
	rows, err := e.db.Pool.Query(context.Background(), `SELECT message_id, seq FROM effects`)
	if err != nil {
		t.Fatal(err)
	}
	seqs := map[string]int64{}
	var id string
	var seq int64
	if _, err := pgx.ForEachRow(rows, []any{&id, &seq}, func() error { seqs[id] = seq; return nil }); err != nil {
		t.Fatal(err)
	}
	return seqs
}

// In batch mode a failing record rolls back to its savepoint alone: the
// others of its batch commit once and are never run again; the failing
// record is retried after the batch, and a later record with its key waits
// for it. A permanently failing record is dead-lettered the same way.
func TestBatchFailingRecordRollsBackAlone(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	e.createDLQTopic(t)
	// One partition, keys a..e; "flaky" (key a) fails its first run,
	// "poison" (key b) fails for good. a-2 and b-2 follow them on their keys.
	var recs []*kgo.Record
	add := func(id, key string) {
		r := e.rec(0, id, valueOf(id, 1))
		r.Key = []byte(key)
		recs = append(recs, r)
	}
	add("a-1", "a")
	add("flaky", "a")
	add("c-1", "c")
	add("poison", "b")
	add("a-2", "a")
	add("d-1", "d")
	add("b-2", "b")
	add("e-1", "e")
	e.produceRecords(t, recs...)

	var ran runs
	cfg := e.config("a", func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		n := ran.add(msg.ID)
		if err := recordEffect("a")(ctx, tx, msg); err != nil {
			return err
		}
		switch {
		case msg.ID == "flaky" && n == 1:
			return errors.New("downstream unavailable") // after a write: the savepoint must undo it
		case msg.ID == "poison":
			return dlq.Permanent(errors.New("never valid"))
		}
		return nil
	})
	cfg.KeyParallelism = 1
	cfg.BatchSize = 100
	cfg.BatchMaxWait = time.Second // the whole backlog is one batch
	m := e.start(context.Background(), cfg)
	eventually(t, time.Minute, "all records done", func() bool {
		s := m.c.Stats()
		return s.Processed+s.DeadLettered == 8 && e.committedLag(t) == 0
	})
	if err := m.stop(t); err != nil {
		t.Fatal(err)
	}

	s := m.c.Stats()
	if s.Batches != 1 || s.Processed != 7 || s.DeadLettered != 1 || s.Retries != 1 {
		t.Errorf("stats %+v: want 1 batch, 7 processed, 1 dead-lettered, 1 retry", s)
	}
	for _, id := range []string{"a-1", "c-1", "d-1", "e-1"} {
		if n := ran.get(id); n != 1 {
			t.Errorf("%s ran %d times; the batch's good records must run once", id, n)
		}
	}
	if n := ran.get("flaky"); n != 2 {
		t.Errorf("flaky ran %d times, want 2 (failed in the batch, then retried alone)", n)
	}
	// Deferred behind their key's failing record: not run in the batch.
	for _, id := range []string{"a-2", "b-2"} {
		if n := ran.get(id); n != 1 {
			t.Errorf("%s ran %d times, want 1 (after its key's failed record)", id, n)
		}
	}
	e.assertExactlyOnce(t, 7)
	seqs := e.effectSeqs(t)
	if _, ok := seqs["poison"]; ok {
		t.Error("the dead-lettered record's effect committed; its savepoint should have undone it")
	}
	if !(seqs["a-1"] < seqs["flaky"] && seqs["flaky"] < seqs["a-2"]) {
		t.Errorf("key a applied out of order: a-1@%d flaky@%d a-2@%d", seqs["a-1"], seqs["flaky"], seqs["a-2"])
	}
	if entries := e.dlqEntries(t); len(entries) != 1 || entries[0].Info.MessageID != "poison" {
		t.Errorf("dead-letter entries %+v, want the poison alone", entries)
	}
}

// A batch handler receives the new records of a batch at once, never the
// ones already in the inbox; when it fails, the batch's records are retried
// one by one, each exactly once in effect.
func TestBatchHandlerGetsOnlyNewRecords(t *testing.T) {
	t.Parallel()
	const n = 300
	e := newEnv(t, 2)
	msgs := uniqueMsgs("bh", n, 2)
	dups := 0
	for i := 0; i < n; i += 7 { // redeliveries of every 7th message
		msgs = append(msgs, msgs[i])
		dups++
	}
	e.produce(t, msgs)

	var calls, biggest, failed atomic.Int64
	insert := func(ctx context.Context, tx pgx.Tx, batch []*consumer.Message) error {
		ids, parts, offs := make([]string, len(batch)), make([]int32, len(batch)), make([]int64, len(batch))
		for i, m := range batch {
			ids[i], parts[i], offs[i] = m.ID, m.Partition, m.Offset
		}
		_, err := tx.Exec(ctx, `INSERT INTO effects (message_id, partition, "offset", member)
			SELECT u.id, u.p, u.o, 'a' FROM unnest($1::text[], $2::int[], $3::bigint[]) AS u(id, p, o)`, ids, parts, offs)
		return err
	}
	cfg := e.config("a", nil)
	cfg.KeyParallelism = 1
	cfg.BatchSize = 50
	cfg.BatchHandler = func(ctx context.Context, tx pgx.Tx, batch []*consumer.Message) error {
		calls.Add(1)
		for {
			b := biggest.Load()
			if int64(len(batch)) <= b || biggest.CompareAndSwap(b, int64(len(batch))) {
				break
			}
		}
		if err := insert(ctx, tx, batch); err != nil {
			return err
		}
		if len(batch) > 1 && failed.CompareAndSwap(0, 1) {
			return errors.New("the first big batch fails after writing") // rolled back as a whole
		}
		return nil
	}
	m := e.start(context.Background(), cfg)
	eventually(t, time.Minute, "all records processed", func() bool {
		s := m.c.Stats()
		return s.Processed+s.Duplicates == int64(len(msgs)) && e.committedLag(t) == 0
	})
	if err := m.stop(t); err != nil {
		t.Fatal(err)
	}
	e.assertExactlyOnce(t, n)
	s := m.c.Stats()
	if s.Processed != n || s.Duplicates != int64(dups) {
		t.Errorf("stats %+v: want %d processed and %d duplicates", s, n, dups)
	}
	if biggest.Load() < 2 || s.Batches == 0 || calls.Load() >= int64(len(msgs)) {
		t.Errorf("biggest batch %d, %d batches, %d handler calls for %d records: records were not batched",
			biggest.Load(), s.Batches, calls.Load(), len(msgs))
	}
	t.Logf("%d batch handler calls, biggest %d, %d batches committed", calls.Load(), biggest.Load(), s.Batches)
}

// Key parallelism runs different keys of one partition at once: each of
// the first records of four keys waits until all four are running, which
// only concurrent processing lets happen. Records of a key stay in order.
func TestKeyParallelismRunsKeysConcurrently(t *testing.T) {
	t.Parallel()
	const keys, perKey = 4, 25
	e := newEnv(t, 1)
	var msgs []msg
	for i := range perKey {
		for k := range keys {
			msgs = append(msgs, msg{id: fmt.Sprintf("k%d-%02d", k, i), partition: 0, key: fmt.Sprint("k", k)})
		}
	}
	e.produce(t, msgs)

	var arrived sync.WaitGroup
	arrived.Add(keys)
	together := make(chan struct{})
	go func() { arrived.Wait(); close(together) }()
	var timedOut atomic.Bool
	cfg := e.config("a", func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if msg.ID[len(msg.ID)-2:] == "00" && msg.Attempt == 1 {
			arrived.Done()
			select {
			case <-together:
			case <-time.After(30 * time.Second):
				timedOut.Store(true)
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return recordEffect("a")(ctx, tx, msg)
	})
	cfg.BatchSize = 1
	cfg.KeyParallelism = keys
	m := e.start(context.Background(), cfg)
	eventually(t, time.Minute, "all processed", func() bool {
		return m.c.Stats().Processed == keys*perKey && e.committedLag(t) == 0
	})
	if err := m.stop(t); err != nil {
		t.Fatal(err)
	}
	if timedOut.Load() {
		t.Fatal("the first records of the keys never ran at the same time")
	}
	e.assertExactlyOnce(t, keys*perKey)
	seqs := e.effectSeqs(t)
	for k := range keys {
		for i := 1; i < perKey; i++ {
			prev, cur := fmt.Sprintf("k%d-%02d", k, i-1), fmt.Sprintf("k%d-%02d", k, i)
			if seqs[prev] >= seqs[cur] {
				t.Errorf("key k%d: %s applied after %s", k, prev, cur)
			}
		}
	}
}

// With key parallelism the committed offset is the low watermark: a slow
// record holds it while later records of other keys finish. Shutting down
// commits exactly up to the slow record; its successor processes that one
// and skips the rest as duplicates.
func TestKeyParallelismCommitsLowWatermark(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	msgs := []msg{{id: "first", key: "x"}, {id: "slow", key: "s"}}
	for i := range 8 {
		msgs = append(msgs, msg{id: fmt.Sprint("other-", i), key: fmt.Sprint("o", i)})
	}
	e.produce(t, msgs)

	entered := make(chan struct{})
	cfg := e.config("a", func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if msg.ID == "slow" {
			close(entered)
			<-ctx.Done() // runs until the member gives the record up
			return ctx.Err()
		}
		return recordEffect("a")(ctx, tx, msg)
	})
	cfg.BatchSize = 1
	cfg.KeyParallelism = 4
	cfg.ShutdownTimeout = 2 * time.Second
	a := e.start(context.Background(), cfg)
	a.await(t, entered)
	eventually(t, time.Minute, "the other records applied", func() bool {
		return e.count(t, `SELECT count(*) FROM effects`) == 9
	})
	if err := a.stop(t); err != nil {
		t.Fatal(err)
	}
	if off := e.committedOffset(t, 0); off != 1 {
		t.Fatalf("committed offset %d, want 1: the slow record at offset 1 never finished", off)
	}

	b := e.start(context.Background(), e.config("b", recordEffect("b")))
	eventually(t, time.Minute, "the successor caught up", func() bool {
		s := b.c.Stats()
		return s.Processed+s.Duplicates == 9 && e.committedLag(t) == 0
	})
	if err := b.stop(t); err != nil {
		t.Fatal(err)
	}
	if s := b.c.Stats(); s.Processed != 1 || s.Duplicates != 8 {
		t.Errorf("successor stats %+v: want the slow record processed and 8 duplicates", s)
	}
	e.assertExactlyOnce(t, 10)
}

// Concurrency bounds the transactions in flight across partitions and keys,
// whatever the key parallelism: never more than two here, and two reached.
func TestConcurrencyBoundsTransactions(t *testing.T) {
	t.Parallel()
	const partitions, n = 4, 400
	e := newEnv(t, partitions)
	e.produce(t, uniqueMsgs("c", n, partitions))

	var inflight, peak atomic.Int64
	pair := make(chan struct{})
	var pairOnce sync.Once
	cfg := e.config("a", func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		now := inflight.Add(1)
		defer inflight.Add(-1)
		for {
			p := peak.Load()
			if now <= p || peak.CompareAndSwap(p, now) {
				break
			}
		}
		if now == 2 {
			pairOnce.Do(func() { close(pair) })
		}
		// Until two transactions met, each waits for a second one.
		select {
		case <-pair:
		case <-time.After(10 * time.Second):
		case <-ctx.Done():
			return ctx.Err()
		}
		return recordEffect("a")(ctx, tx, msg)
	})
	cfg.BatchSize = 1
	cfg.KeyParallelism = 8
	cfg.Concurrency = 2
	m := e.start(context.Background(), cfg)
	eventually(t, time.Minute, "all processed", func() bool { return m.c.Stats().Processed == n && e.committedLag(t) == 0 })
	if err := m.stop(t); err != nil {
		t.Fatal(err)
	}
	e.assertExactlyOnce(t, n)
	select {
	case <-pair:
	default:
		t.Error("never two transactions at once; the bound should allow two")
	}
	if p := peak.Load(); p > 2 {
		t.Errorf("%d transactions in flight at once; Concurrency is 2", p)
	}
}
