package main

import (
	"cmp"
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/natsconsumer"
)

// natsURL is the JetStream server of the --source jetstream tests.
var natsURL = cmp.Or(os.Getenv("NATS_URL"), "nats://127.0.0.1:4222")

// TestJetStreamSource runs the worker with --source jetstream, with each
// handler mode, as a user would: `produce --source jetstream` publishes orders with duplicates (the
// same message-id header) and poison mixed in, a worker is killed (SIGKILL)
// mid-stream and another started, and in the end every order has its
// effects once, its order.accepted event once on the events stream (in each
// customer's commit order), and every poison message is in the dead-letter
// stream with its class.
func TestJetStreamSource(t *testing.T) {
	t.Parallel()
	for name, extra := range map[string][]string{
		"batch handler":  nil,
		"record handler": {"--handler", "record"},
		"per record":     {"--batch-size", "1"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			testJetStreamSource(t, extra...)
		})
	}
}

// testJetStreamSource is TestJetStreamSource with the worker's extra flags.
func testJetStreamSource(t *testing.T, extra ...string) {
	ctx := t.Context()
	exe := workerBinary(t)
	db := testenv.Postgres(t)
	prefix := strings.ReplaceAll(testenv.UniqueName("ow"), "-", "_")
	topic, events := prefix+".orders", prefix+".events"
	nc, js, err := jetStreamConn(natsURL, "orderworker test")
	if err != nil {
		t.Fatalf("%v (is nats-server -js running?)", err)
	}
	t.Cleanup(nc.Close)
	t.Cleanup(func() {
		for _, s := range []string{topic, natsconsumer.DefaultDeadLetterSubject(topic), events} {
			dctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_ = js.DeleteStream(dctx, streamName(s))
			cancel()
		}
	})

	spec := orderSpec{Count: 600, Customers: 20, DupRate: 0.2, PoisonRate: 0.02}
	b := generate(spec, newRand())
	if err := publishOrders(ctx, natsURL, topic, events, b.Deliveries[:len(b.Deliveries)/2]); err != nil {
		t.Fatal(err)
	}
	logFile, err := os.Create(t.TempDir() + "/workers.log")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			out, _ := os.ReadFile(logFile.Name())
			t.Logf("worker logs:\n%s", tail(string(out), 150))
		}
		_ = logFile.Close()
	})
	group := "orderworker"
	start := func(name string) *workerProcess {
		args := []string{"run", "--source", "jetstream", "--nats", natsURL, "--topic", topic, "--events-topic", events,
			"--group", group, "--schema", db.Schema, "--http-addr", "127.0.0.1:0", "--ack-wait", "2s"}
		args = append(args, extra...)
		p, err := startWorkerProcess(ctx, exe, args, []string{"DATABASE_URL=" + db.URL}, name, logFile)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.kill)
		return p
	}
	q := newEffectQueries(db.Schema)
	first := start("worker-1")
	if err := poll(ctx, 60*time.Second, 20*time.Millisecond, "a first order applied", func(ctx context.Context) (bool, error) {
		n, err := queryInt(ctx, db.Pool, q.countDistinct)
		return n > 0, cmp.Or(err, alive(first))
	}); err != nil {
		t.Fatal(err)
	}
	first.kill() // SIGKILL, mid-stream: no drain, no ack of what is in flight
	if err := publishOrders(ctx, natsURL, topic, events, b.Deliveries[len(b.Deliveries)/2:]); err != nil {
		t.Fatal(err)
	}
	second := start("worker-2")
	if err := poll(ctx, 90*time.Second, 50*time.Millisecond, "every order applied, every message settled, the outbox empty", func(ctx context.Context) (bool, error) {
		if err := alive(second); err != nil {
			return false, err
		}
		n, err := queryInt(ctx, db.Pool, q.countDistinct)
		if err != nil || n < int64(len(b.Orders)) {
			return false, err
		}
		if pending, err := queryInt(ctx, db.Pool, q.pending); err != nil || pending > 0 {
			return false, err
		}
		c, err := js.Consumer(ctx, streamName(topic), group)
		if err != nil {
			return false, err
		}
		info, err := c.Info(ctx)
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0, err
	}); err != nil {
		t.Fatal(err)
	}
	stopAll(t, second)

	rep, err := checkEffects(ctx, db.Pool, db.Schema, group, b)
	if err != nil {
		t.Fatal(err)
	}
	if err := checkJetStreamEvents(ctx, js, events, b, rep); err != nil {
		t.Fatal(err)
	}
	rep.PoisonRecords = len(b.Poison) // their inbox rows are the dead letters' (checked below)
	requireExactlyOnce(t, rep)
	if rep.EventIDs != len(b.Orders) || rep.EventOrders != len(b.Orders) {
		t.Errorf("events: %d ids for %d orders, want %d each", rep.EventIDs, rep.EventOrders, len(b.Orders))
	}
	checkJetStreamDeadLetters(t, js, topic, group, b)
}

// checkJetStreamDeadLetters requires each poison message of b in the
// dead-letter stream, once, as undecodable or permanent, and nothing else
// there.
func checkJetStreamDeadLetters(t *testing.T, js jetstream.JetStream, topic, group string, b orderBatch) {
	t.Helper()
	entries, err := natsconsumer.DeadLetters(t.Context(), js, streamName(natsconsumer.DefaultDeadLetterSubject(topic)), dlq.Filter{RefuseInvalid: true})
	if err != nil {
		t.Fatal(err)
	}
	want := make(map[string]bool, len(b.Poison))
	for _, id := range b.Poison {
		want[id] = true
	}
	for _, e := range entries {
		switch {
		case !want[e.Info.MessageID]:
			t.Errorf("dead letter %s (message id %s) is not a poison message, or is there twice", e.Ref(), e.Info.MessageID)
		case e.Info.Group != group || e.Info.Topic != topic || (e.Info.Class != dlq.ClassUndecodable && e.Info.Class != dlq.ClassPermanent):
			t.Errorf("dead letter %s: group %q, topic %q, class %q; want %q, %q, undecodable or permanent", e.Ref(), e.Info.Group, e.Info.Topic, e.Info.Class, group, topic)
		}
		delete(want, e.Info.MessageID)
	}
	if len(want) > 0 {
		t.Errorf("%d poison messages not dead-lettered: %v", len(want), want)
	}
	if len(b.Poison) == 0 {
		t.Error("the batch had no poison message to check")
	}
}
