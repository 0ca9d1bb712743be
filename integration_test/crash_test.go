package integration_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/internal/testhook"
)

// A member crashes while a handler is in the middle of its transaction (its
// write made, not committed). Offsets committed until then cover only the
// records before it, whatever the commit interval; the crash leaves its
// transaction rolled back; and the next member applies it once.
func TestCrashMidHandler(t *testing.T) {
	t.Parallel()
	const before, after = 5, 3 // records on partition 0 before and after the stuck one
	e := newEnv(t, 2)
	var first, then []msg
	for i := range before {
		first = append(first, msg{id: fmt.Sprint("before-", i), partition: 0})
	}
	then = append(then, msg{id: "stuck", partition: 0})
	for i := range after {
		then = append(then, msg{id: fmt.Sprint("after-", i), partition: 0})
	}
	e.produce(t, first)

	entered := make(chan struct{})
	handler := func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
		if err := recordEffect("a")(ctx, tx, m); err != nil {
			return err
		}
		if m.ID == "stuck" {
			close(entered)
			<-ctx.Done() // mid-handler until the crash abandons the record
			return ctx.Err()
		}
		return nil
	}
	// The crash itself comes from the other partition's worker.
	hooks := &testhook.Consumer{AfterCommit: func(rec *kgo.Record) error {
		if string(rec.Value) == "crash" {
			return testhook.ErrCrash
		}
		return nil
	}}
	a := e.start(testhook.WithConsumer(context.Background(), hooks), e.config("a", handler))
	// The periodic committer commits the records before the stuck one (they
	// are produced first, so that in batch mode they are not in its batch);
	// it must never commit past it.
	eventually(t, time.Minute, "the records before the stuck one committed to Kafka", func() bool {
		return a.c.Stats().Processed == before && e.committedOffset(t, 0) >= before
	})
	e.produce(t, then)
	a.await(t, entered)
	e.produce(t, []msg{{id: "crash", partition: 1}})
	if err := a.wait(t, time.Minute); !errors.Is(err, testhook.ErrCrash) {
		t.Fatalf("Run = %v, want the simulated crash", err)
	}
	if off := e.committedOffset(t, 0); off != before {
		t.Fatalf("partition 0's committed offset is %d after the crash, want %d: the offset of the record whose transaction never committed (offset %d) was committed",
			off, before, before)
	}
	if n := e.count(t, `SELECT count(*) FROM effects WHERE message_id = 'stuck'`); n != 0 {
		t.Fatalf("the stuck record's effect committed (%d rows) although its handler never returned", n)
	}

	b := e.start(context.Background(), e.config("b", recordEffect("b")))
	total := int64(before + 1 + after + 1)
	eventually(t, time.Minute, "the second member to catch up", func() bool {
		return e.count(t, `SELECT count(*) FROM effects`) == total && e.committedLag(t) == 0
	})
	e.assertExactlyOnce(t, total)
	if n := e.count(t, `SELECT count(*) FROM effects WHERE message_id = 'stuck' AND member = 'b'`); n != 1 {
		t.Errorf("the stuck record was applied by the second member %d times, want once", n)
	}
	if err := b.stop(t); err != nil {
		t.Fatal(err)
	}
}
