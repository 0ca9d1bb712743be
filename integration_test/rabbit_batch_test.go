package integration_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/rabbitconsumer"
)

// batchConfig is config in batch mode: up to size messages a transaction.
func (e *rabbitEnv) batchConfig(h consumer.Handler, size int) rabbitconsumer.Config {
	cfg := e.config(h)
	cfg.BatchSize = size
	return cfg
}

// settled waits until r has settled n deliveries (processed, duplicates
// and dead letters).
func (r *rabbitRun) settled(t *testing.T, n int64) {
	t.Helper()
	testenv.Eventually(t, 30*time.Second, "every delivery settled", func() bool {
		st := r.c.Stats()
		return st.Processed+st.Duplicates+st.DeadLettered == n
	})
}

// Batch mode: 25 deliveries of one message id run in batches of up to 10,
// three batches at once: one effect, 24 duplicates (within a batch's
// multi-row claim and across concurrent batches), every delivery
// acknowledged.
func TestRabbitBatchConcurrentDuplicatesOneEffect(t *testing.T) {
	e := newRabbitEnv(t)
	for range 25 {
		e.publish(e.queue, "order", "order-1", nil)
	}
	cfg := e.batchConfig(sourceEffect("a"), 10)
	cfg.Concurrency = 3
	r := e.start(t.Context(), cfg)
	r.settled(t, 25)
	r.stop(t)
	e.empty(e.queue)
	e.effects(1)
	if st := r.c.Stats(); st.Processed != 1 || st.Duplicates != 24 || st.Batches == 0 {
		t.Fatalf("processed %d, duplicates %d, batches %d; want 1, 24 and some", st.Processed, st.Duplicates, st.Batches)
	}
	if n := r.c.Connections(); n != 1 {
		t.Fatalf("%d connections, want 1: an acknowledgement closed the channel", n)
	}
}

// Batch mode: the process dies after a batch's COMMIT and before any of
// its acknowledgements. RabbitMQ delivers every message again to the next
// process, which finds the committed ids in the inbox: no second effect.
func TestRabbitBatchCrashBetweenCommitAndAck(t *testing.T) {
	e := newRabbitEnv(t)
	const n = 5
	for i := range n {
		e.publish(e.queue, "order", fmt.Sprint("order-", i), nil)
	}
	e.crashChild(consumer.DefaultMaxAttempts, rabbitDieAfterBatch)
	committed := e.count(`SELECT count(*) FROM effects WHERE member = 'child'`)
	if committed < 1 || committed > n {
		t.Fatalf("the crashed process committed %d effects, want its first batch's (1 to %d)", committed, n)
	}
	t.Logf("the crashed process's first batch committed %d of %d messages", committed, n)
	e.settledIn(e.queue, n) // none was acknowledged: all come back
	r := e.start(t.Context(), e.batchConfig(sourceEffect("second"), 10))
	r.settled(t, n)
	r.stop(t)
	e.empty(e.queue)
	e.effects(n)
	if st := r.c.Stats(); st.Duplicates != committed || st.Processed != n-committed {
		t.Fatalf("second process: processed %d, duplicates %d; want %d and %d", st.Processed, st.Duplicates, n-committed, committed)
	}
}

// Batch mode: two consumers each hold a copy of one message id in their
// batch, beside messages of their own, at the same time: the second's
// multi-row claim waits on the first's transaction, and the id takes
// effect once; every other message once too.
func TestRabbitBatchTwoConsumersRaceOneEffect(t *testing.T) {
	e := newRabbitEnv(t)
	publish := func(member string) {
		e.publish(e.queue, "order", "order-1", nil)
		for i := range 2 {
			e.publish(e.queue, "order", fmt.Sprint(member, "-", i), nil)
		}
	}
	entered := make(chan struct{})
	h := raceHandler(e.sourceDB, entered)
	publish("a")
	cfgA := e.batchConfig(h("a"), 3) // prefetch 3: a holds its own three, b gets the rest
	a := e.start(t.Context(), cfgA)
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("a never ran order-1")
	}
	publish("b")
	b := e.start(t.Context(), e.batchConfig(h("b"), 10))
	testenv.Eventually(t, 30*time.Second, "every delivery settled", func() bool {
		sa, sb := a.c.Stats(), b.c.Stats()
		return sa.Processed+sb.Processed+sa.Duplicates+sb.Duplicates == 6
	})
	a.stop(t)
	b.stop(t)
	e.empty(e.queue)
	e.effects(5)
	if n := e.count(`SELECT count(*) FROM effects WHERE message_id = 'order-1'`); n != 1 {
		t.Fatalf("order-1 took effect %d times", n)
	}
	sa, sb := a.c.Stats(), b.c.Stats()
	if sa.Processed+sb.Processed != 5 || sa.Duplicates+sb.Duplicates != 1 || sb.Duplicates != 1 || sb.Batches == 0 {
		t.Fatalf("processed %d+%d, duplicates %d+%d, b's batches %d; want 5, b's one duplicate and some batches",
			sa.Processed, sb.Processed, sa.Duplicates, sb.Duplicates, sb.Batches)
	}
}

// Batch mode: among messages that run in batches, a poison message
// (dlq.Permanent) is rolled back to its savepoint and dead-lettered, and a
// flaky one (fails its first attempt) goes through the retry queue and
// commits on its second attempt, while their neighbours commit, each run
// once.
func TestRabbitBatchPoisonDeadLetteredNeighboursCommit(t *testing.T) {
	e := newRabbitEnv(t)
	for _, id := range poisonBatchIDs {
		e.publish(e.queue, id, id, nil)
	}
	var p poisonBatch
	r := e.start(t.Context(), e.batchConfig(p.handler(), 10))
	out := e.take(e.dlq, 1)[0]
	r.settled(t, 5)
	r.stop(t)
	e.empty(e.queue)
	if got := amqpHeader(out, dlq.HeaderMessageID); got != "poison-1" {
		t.Fatalf("dead letter of %q, want poison-1", got)
	}
	if got := amqpHeader(out, dlq.HeaderErrorClass); got != string(dlq.ClassPermanent) {
		t.Errorf("dead letter class %q, want permanent", got)
	}
	p.check(e.sourceDB, r.c.Stats(), "its copy from the retry queue")
}

// A BatchHandler receives the new messages of each batch at once, in one
// transaction with their claims: never a duplicate, whether its copy is in
// the same batch or an earlier one.
func TestRabbitBatchHandler(t *testing.T) {
	e := newRabbitEnv(t)
	for i := range 6 {
		e.publish(e.queue, "order", fmt.Sprint("order-", i%4), nil) // 2 duplicates
	}
	var mu sync.Mutex
	var seen []string
	var calls atomic.Int32
	cfg := e.config(nil)
	cfg.BatchSize = 10
	cfg.BatchHandler = func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
		calls.Add(1)
		mu.Lock()
		for _, m := range msgs {
			seen = append(seen, m.ID)
		}
		mu.Unlock()
		for _, m := range msgs {
			if err := sourceEffect("a")(ctx, tx, m); err != nil {
				return err
			}
		}
		return nil
	}
	r := e.start(t.Context(), cfg)
	r.settled(t, 6)
	t.Logf("%d batch handler calls", calls.Load())
	r.stop(t)
	e.empty(e.queue)
	e.effects(4)
	mu.Lock()
	defer mu.Unlock()
	slices.Sort(seen)
	if want := []string{"order-0", "order-1", "order-2", "order-3"}; !slices.Equal(seen, want) {
		t.Errorf("batch handler got %v in %d calls, want each new message once: %v", seen, calls.Load(), want)
	}
	if st := r.c.Stats(); st.Processed != 4 || st.Duplicates != 2 || st.Batches == 0 {
		t.Errorf("processed %d, duplicates %d, batches %d; want 4, 2 and some", st.Processed, st.Duplicates, st.Batches)
	}
	if n := r.c.Connections(); n != 1 {
		t.Errorf("%d connections, want 1: an acknowledgement closed the channel", n)
	}
}
