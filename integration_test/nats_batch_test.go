package integration_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testhook"
	"github.com/oncely/oncely/natsconsumer"
)

// batchConfig is config in batch mode: up to size messages a transaction.
func (e *natsEnv) batchConfig(js jetstream.JetStream, h consumer.Handler, size int) natsconsumer.Config {
	cfg := e.config(js, h)
	cfg.BatchSize = size
	return cfg
}

// runCounter counts handler runs per message id.
type runCounter struct {
	mu sync.Mutex
	n  map[string]int
}

func (r *runCounter) add(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.n == nil {
		r.n = map[string]int{}
	}
	r.n[id]++
	return r.n[id]
}

func (r *runCounter) of(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.n[id]
}

// Batch mode: 25 stored copies of one message id run in batches of 10,
// three batches at once: one effect, 24 duplicates (within a batch's
// multi-row claim and across concurrent batches), every copy acknowledged.
func TestNATSBatchConcurrentDuplicatesOneEffect(t *testing.T) {
	e := newNATSEnv(t)
	for range 25 {
		e.publish(e.subject, "order", map[string]string{"message-id": "order-1"})
	}
	cfg := e.batchConfig(e.js, sourceEffect("a"), 10)
	cfg.Concurrency = 3
	c, _ := e.start(t.Context(), cfg)
	e.settled()
	e.effects(1)
	if st := c.Stats(); st.Processed != 1 || st.Duplicates != 24 || st.Batches == 0 {
		t.Fatalf("processed %d, duplicates %d, batches %d; want 1, 24 and some", st.Processed, st.Duplicates, st.Batches)
	}
}

// Batch mode: the process dies after the batch's COMMIT and before any of
// its acknowledgements. JetStream delivers every message again to the next
// process, which finds all their ids in the inbox: no second effect.
func TestNATSBatchCrashBetweenCommitAndAck(t *testing.T) {
	e := newNATSEnv(t)
	const n = 5
	for i := range n {
		e.publish(e.subject, "order", map[string]string{nats.MsgIdHdr: fmt.Sprint("order-", i)})
	}
	nc1, js1 := e.ownJetStream()
	ctx := testhook.WithConsumer(t.Context(), &testhook.Consumer{AfterCommit: func(*kgo.Record) error {
		return testhook.ErrCrash
	}})
	first, done := e.start(ctx, e.batchConfig(js1, sourceEffect("first"), 10))
	select {
	case err := <-done:
		if !errors.Is(err, testhook.ErrCrash) {
			t.Fatalf("first process: %v, want the simulated crash", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("first process did not crash")
	}
	nc1.Close() // the process is gone with its connection
	if st := first.Stats(); st.Processed != n || st.Batches != 1 {
		t.Fatalf("first process: processed %d in %d batches, want %d in 1", st.Processed, st.Batches, n)
	}

	_, js2 := e.ownJetStream()
	second, _ := e.start(t.Context(), e.batchConfig(js2, sourceEffect("second"), 10))
	e.settled()
	e.effects(n)
	if m := e.count(`SELECT count(*) FROM effects WHERE member = 'first'`); m != n {
		t.Fatalf("%d of the crashed process's effects, want %d", m, n)
	}
	if st := second.Stats(); st.Duplicates != n || st.Processed != 0 {
		t.Fatalf("second process: processed %d, duplicates %d; want 0 and %d", st.Processed, st.Duplicates, n)
	}
}

// Batch mode: two processes each hold a copy of one message id in their
// batch, beside messages of their own, at the same time: the second's
// multi-row claim waits on the first's transaction, and the id takes
// effect once; every other message once too.
func TestNATSBatchTwoConsumersRaceOneEffect(t *testing.T) {
	e := newNATSEnv(t)
	publish := func(member string) {
		e.publish(e.subject, "order", map[string]string{"message-id": "order-1"})
		for i := range 2 {
			e.publish(e.subject, "order", map[string]string{"message-id": fmt.Sprint(member, "-", i)})
		}
	}
	entered := make(chan struct{})
	h := raceHandler(e.sourceDB, entered)
	publish("a")
	_, jsA := e.ownJetStream()
	a, _ := e.start(t.Context(), e.batchConfig(jsA, h("a"), 10))
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("a never ran order-1")
	}
	publish("b") // a is busy with its batch: b fetches these
	_, jsB := e.ownJetStream()
	b, _ := e.start(t.Context(), e.batchConfig(jsB, h("b"), 10))
	e.settled()
	e.effects(5)
	if n := e.count(`SELECT count(*) FROM effects WHERE message_id = 'order-1'`); n != 1 {
		t.Fatalf("order-1 took effect %d times", n)
	}
	sa, sb := a.Stats(), b.Stats()
	if sa.Processed+sb.Processed != 5 || sa.Duplicates+sb.Duplicates != 1 || sb.Batches == 0 {
		t.Fatalf("processed %d+%d, duplicates %d+%d, b's batches %d; want 5, 1 and some",
			sa.Processed, sb.Processed, sa.Duplicates, sb.Duplicates, sb.Batches)
	}
}

// raceHandler is the handler of the batch race tests, for consumer member
// ("a" or "b"): a's run of order-1 closes entered, then waits until b's
// claim of order-1 waits on a's transaction.
func raceHandler(d sourceDB, entered chan struct{}) func(member string) consumer.Handler {
	var once sync.Once
	return func(member string) consumer.Handler {
		return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			if member == "a" && msg.ID == "order-1" {
				once.Do(func() { close(entered) })
				d.waitForBlockedClaim() // b's claim of order-1 waits on ours
			}
			return sourceEffect(member)(ctx, tx, msg)
		}
	}
}

// Batch mode: in one batch, a poison message (dlq.Permanent) is rolled back
// to its savepoint and dead-lettered, and a flaky one (fails its first
// attempt) is handed back with NakWithDelay and commits on its redelivery,
// while their neighbours commit in the batch, each run once.
func TestNATSBatchPoisonDeadLetteredNeighboursCommit(t *testing.T) {
	e := newNATSEnv(t)
	for _, id := range poisonBatchIDs {
		e.publish(e.subject, id, map[string]string{nats.MsgIdHdr: id})
	}
	var p poisonBatch
	c, _ := e.start(t.Context(), e.batchConfig(e.js, p.handler(), 10))
	out := e.deadLetters(1)[0]
	e.settled()
	if got := out.Headers().Get(dlq.HeaderMessageID); got != "poison-1" {
		t.Fatalf("dead letter of %q, want poison-1", got)
	}
	if got := out.Headers().Get(dlq.HeaderErrorClass); got != string(dlq.ClassPermanent) {
		t.Errorf("dead letter class %q, want permanent", got)
	}
	p.check(e.sourceDB, c.Stats(), "a redelivery after the Nak")
}

// poisonBatchIDs are the messages of the poison-in-a-batch tests.
var poisonBatchIDs = []string{"ok-0", "poison-1", "ok-2", "flaky-3", "ok-4"}

// poisonBatch is the handler of the poison-in-a-batch tests, which records
// each message's attempts: poison-1 fails for good (dlq.Permanent) after
// writing its effect, flaky-3 fails its first attempt, the others succeed.
type poisonBatch struct {
	runs     runCounter
	mu       sync.Mutex
	attempts map[string][]int
}

func (p *poisonBatch) handler() consumer.Handler {
	apply := sourceEffect("a")
	return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		n := p.runs.add(msg.ID)
		p.mu.Lock()
		if p.attempts == nil {
			p.attempts = map[string][]int{}
		}
		p.attempts[msg.ID] = append(p.attempts[msg.ID], msg.Attempt)
		p.mu.Unlock()
		if err := apply(ctx, tx, msg); err != nil {
			return err
		}
		switch {
		case msg.ID == "poison-1":
			return dlq.Permanent(errors.New("order has no id")) // its insert is rolled back with it
		case msg.ID == "flaky-3" && n == 1:
			return errors.New("payment service unavailable")
		}
		return nil
	}
}

// check fails the test unless, once every message settled, the four good
// ones took effect once and the poison's effect rolled back, each message
// but flaky-3 ran once, flaky-3 ran twice (retried as retry says), the
// inbox records the dead letter, and st counts it all.
func (p *poisonBatch) check(d sourceDB, st consumer.Stats, retry string) {
	t := d.t
	t.Helper()
	d.effects(4)
	if n := d.count(`SELECT count(*) FROM effects WHERE message_id = 'poison-1'`); n != 0 {
		t.Errorf("the poison's effect committed (%d rows)", n)
	}
	for _, id := range []string{"ok-0", "poison-1", "ok-2", "ok-4"} {
		if n := p.runs.of(id); n != 1 {
			t.Errorf("%s ran %d times, want once", id, n)
		}
	}
	p.mu.Lock()
	if got := p.attempts["flaky-3"]; len(got) != 2 || got[0] != 1 || got[1] != 2 {
		t.Errorf("flaky-3's attempts %v, want [1 2] (%s)", got, retry)
	}
	p.mu.Unlock()
	if n := d.count(`SELECT count(*) FROM inbox WHERE message_id = 'poison-1' AND outcome = 'dead_lettered'`); n != 1 {
		t.Errorf("inbox holds the dead letter %d times, want 1", n)
	}
	if st.Processed != 4 || st.DeadLettered != 1 || st.Retries != 1 || st.Batches == 0 {
		t.Errorf("processed %d, dead-lettered %d, retries %d, batches %d; want 4, 1, 1 and some",
			st.Processed, st.DeadLettered, st.Retries, st.Batches)
	}
}

// A BatchHandler receives a batch's new messages at once, in one
// transaction with their claims.
func TestNATSBatchHandler(t *testing.T) {
	e := newNATSEnv(t)
	for i := range 6 {
		e.publish(e.subject, "order", map[string]string{"message-id": fmt.Sprint("order-", i%4)}) // 2 duplicates
	}
	var mu sync.Mutex
	var sizes []int
	cfg := e.config(e.js, nil)
	cfg.BatchSize = 10
	cfg.BatchHandler = func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
		mu.Lock()
		sizes = append(sizes, len(msgs))
		mu.Unlock()
		for _, m := range msgs {
			if err := sourceEffect("a")(ctx, tx, m); err != nil {
				return err
			}
		}
		return nil
	}
	c, _ := e.start(t.Context(), cfg)
	e.settled()
	e.effects(4)
	mu.Lock()
	defer mu.Unlock()
	if len(sizes) != 1 || sizes[0] != 4 {
		t.Errorf("batch handler calls with %v messages, want one call with the 4 new ones", sizes)
	}
	if st := c.Stats(); st.Processed != 4 || st.Duplicates != 2 {
		t.Errorf("processed %d, duplicates %d; want 4 and 2", st.Processed, st.Duplicates)
	}
}
