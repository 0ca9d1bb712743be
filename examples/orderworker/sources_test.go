package main

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/natsconsumer"
	"github.com/oncely/oncely/rabbitconsumer"
	"github.com/oncely/oncely/webhook/outbound"
)

// The servers of the --source jetstream and rabbitmq tests.
var (
	natsURL = cmp.Or(os.Getenv("NATS_URL"), "nats://127.0.0.1:4222")
	amqpURL = cmp.Or(os.Getenv("AMQP_URL"), defaultAMQPURL)
)

// brokerUnderTest is what the worker's test needs of a --source other than
// Kafka, for one test's topic (subject or queue) and events topic.
type brokerUnderTest struct {
	args    []string // the worker's flags naming the broker
	publish func(ctx context.Context, ds []delivery) error
	// settled reports that the group has nothing pending or in flight.
	settled func(ctx context.Context) (bool, error)
	// events reads the events topic; deadLetters the dead letters.
	events      func(ctx context.Context) ([]*kgo.Record, func() (int, error), error)
	deadLetters func(ctx context.Context) ([]dlq.Entry, error)
}

// TestJetStreamSource and TestRabbitMQSource run the worker with --source
// jetstream and rabbitmq, with each handler mode, as a user would: `produce
// --source` publishes orders with duplicates (the same dedup id) and poison
// mixed in, in four parts; three workers are killed (SIGKILL) mid-stream one
// after another while the parts arrive, a fourth finishes, and in the end
// every order has its effects once, its order.accepted event once on the
// events topic (in each customer's commit order), and every poison message
// is a dead letter with its class.
func TestJetStreamSource(t *testing.T) { testSourceModes(t, jetStreamUnderTest) }

func TestRabbitMQSource(t *testing.T) { testSourceModes(t, rabbitUnderTest) }

// testSourceModes runs testSource on the broker of under with each handler
// mode: the batch handler, the per-record handler in batches, and a
// transaction per order.
func testSourceModes(t *testing.T, under func(t *testing.T, topic, events string) brokerUnderTest) {
	t.Parallel()
	for name, extra := range map[string][]string{
		"batch handler":  nil,
		"record handler": {"--handler", "record"},
		"per record":     {"--batch-size", "1"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			topic, events := testTopics()
			testSource(t, under(t, topic, events), topic, events, extra...)
		})
	}
}

// testTopics are a test's own orders and events topics.
func testTopics() (topic, events string) {
	prefix := strings.ReplaceAll(testenv.UniqueName("ow"), "-", "_")
	return prefix + ".orders", prefix + ".events"
}

const testGroup = "orderworker"

func testSource(t *testing.T, bt brokerUnderTest, topic, events string, extra ...string) {
	ctx := t.Context()
	exe := workerBinary(t)
	db := testenv.Postgres(t)
	spec := orderSpec{Count: 1200, Customers: 20, DupRate: 0.2, PoisonRate: 0.02}
	b := generate(spec, newRand())
	const kills = 3
	chunk := len(b.Deliveries) / (kills + 1)
	chunks := [][]delivery{}
	for i := range kills + 1 {
		end := (i + 1) * chunk
		if i == kills {
			end = len(b.Deliveries)
		}
		chunks = append(chunks, b.Deliveries[i*chunk:end])
	}
	if err := bt.publish(ctx, chunks[0]); err != nil {
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
	start := func(name string) *workerProcess {
		args := append([]string{"run", "--topic", topic, "--events-topic", events,
			"--group", testGroup, "--schema", db.Schema, "--http-addr", "127.0.0.1:0"}, bt.args...)
		p, err := startWorkerProcess(ctx, exe, append(args, extra...), []string{"DATABASE_URL=" + db.URL}, name, logFile)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.kill)
		return p
	}
	q := newEffectQueries(db.Schema)
	// Workers are killed (SIGKILL: no drain, no ack of what is in flight)
	// one after another, each once it applied orders, while the orders
	// keep arriving; the last one finishes the stream.
	applied := int64(0)
	for i := range kills {
		w := start(fmt.Sprintf("worker-%d", i+1))
		if err := poll(ctx, 60*time.Second, 20*time.Millisecond, "orders applied by "+w.Name, func(ctx context.Context) (bool, error) {
			n, err := queryInt(ctx, db.Pool, q.countDistinct)
			if n > applied {
				applied = n
				return true, nil
			}
			return false, cmp.Or(err, alive(w))
		}); err != nil {
			t.Fatal(err)
		}
		w.kill()
		if err := bt.publish(ctx, chunks[i+1]); err != nil {
			t.Fatal(err)
		}
	}
	second := start(fmt.Sprintf("worker-%d", kills+1))
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
		return bt.settled(ctx)
	}); err != nil {
		t.Fatal(err)
	}
	stopAll(t, second)

	rep, err := checkEffects(ctx, db.Pool, db.Schema, testGroup, b)
	if err != nil {
		t.Fatal(err)
	}
	recs, limit, err := bt.events(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := verifyEvents(recs, events, b, rep, limit); err != nil {
		t.Fatal(err)
	}
	entries, err := bt.deadLetters(ctx)
	if err != nil {
		t.Fatal(err)
	}
	maxBytes, err := limit()
	if err != nil {
		t.Fatal(err)
	}
	verifyDeadLetters(entries, topic, testGroup, b, rep, maxBytes) // also counts the poison messages' inbox rows
	requireExactlyOnce(t, rep)
	if rep.EventIDs != len(b.Orders) || rep.EventOrders != len(b.Orders) {
		t.Errorf("events: %d ids for %d orders, want %d each", rep.EventIDs, rep.EventOrders, len(b.Orders))
	}
	checkSourceDeadLetters(t, entries, topic, b, rep)
}

// checkSourceDeadLetters requires what verifyDeadLetters found in rep: each
// poison message of b among the dead letters, none missing, no order and
// nothing else there, each a copy of its message. A poison message the
// producer sent twice may be dead-lettered from each delivery when both run
// at once: the further ones are copies (DeadLetterCopies, logged), and the
// inbox holds the id once (requireExactlyOnce). Every entry must also be the
// test group's, from topic, as undecodable or permanent.
func checkSourceDeadLetters(t *testing.T, entries []dlq.Entry, topic string, b orderBatch, rep *report) {
	t.Helper()
	for _, e := range entries {
		if e.Info == nil {
			continue // counted in rep.InvalidDeadLetters
		}
		if e.Info.Group != testGroup || e.Info.Topic != topic || (e.Info.Class != dlq.ClassUndecodable && e.Info.Class != dlq.ClassPermanent) {
			t.Errorf("dead letter %s: group %q, topic %q, class %q; want %q, %q, undecodable or permanent", e.Ref(), e.Info.Group, e.Info.Topic, e.Info.Class, testGroup, topic)
		}
	}
	if rep.DeadLettered != len(b.Poison) || rep.PoisonMissing != 0 || rep.InvalidDeadLetters != 0 ||
		rep.OrdersDeadLettered != 0 || rep.WrongDeadLetters != 0 || rep.AbortedApplied != 0 {
		t.Errorf("dead letters: %d of %d poison messages, %d missing, %d invalid, %d orders, %d wrong, %d aborted; %v",
			rep.DeadLettered, len(b.Poison), rep.PoisonMissing, rep.InvalidDeadLetters, rep.OrdersDeadLettered,
			rep.WrongDeadLetters, rep.AbortedApplied, rep.violations())
	}
	t.Logf("%d poison messages dead-lettered, %d further copies", rep.DeadLettered, rep.DeadLetterCopies)
	if len(b.Poison) == 0 {
		t.Error("the batch had no poison message to check")
	}
}

// jetStreamUnderTest is NATS JetStream at natsURL, its streams deleted when
// the test ends.
func jetStreamUnderTest(t *testing.T, topic, events string) brokerUnderTest {
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
	return brokerUnderTest{
		args: []string{"--source", "jetstream", "--nats", natsURL, "--ack-wait", "2s"},
		publish: func(ctx context.Context, ds []delivery) error {
			_, err := publishOrders(ctx, natsURL, topic, events, ds, publishOpts{})
			return err
		},
		settled: func(ctx context.Context) (bool, error) { return jetStreamSettled(ctx, js, topic, testGroup) },
		events: func(ctx context.Context) ([]*kgo.Record, func() (int, error), error) {
			recs, err := natsconsumer.ReadStream(ctx, js, streamName(events))
			return recs, func() (int, error) { return int(nc.MaxPayload()), nil }, err
		},
		deadLetters: func(ctx context.Context) ([]dlq.Entry, error) {
			return natsconsumer.DeadLetters(ctx, js, streamName(natsconsumer.DefaultDeadLetterSubject(topic)), dlq.Filter{RefuseInvalid: true})
		},
	}
}

// rabbitUnderTest is RabbitMQ at amqpURL, the test's queues deleted when it
// ends.
func rabbitUnderTest(t *testing.T, topic, events string) brokerUnderTest {
	conn, err := amqp.Dial(amqpURL)
	if err != nil {
		t.Fatalf("RabbitMQ at %s: %v", outbound.RedactURL(amqpURL), err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	dlqQueue := rabbitconsumer.DefaultDeadLetterRoutingKey(topic)
	t.Cleanup(func() {
		for _, q := range []string{topic, dlqQueue, rabbitconsumer.DefaultRetryQueue(topic), events} {
			_, _ = ch.QueueDelete(q, false, false, false)
		}
	})
	return brokerUnderTest{
		args: []string{"--source", "rabbitmq", "--amqp", amqpURL},
		publish: func(ctx context.Context, ds []delivery) error {
			_, err := publishRabbit(ctx, amqpURL, topic, events, ds, publishOpts{})
			return err
		},
		settled: func(context.Context) (bool, error) {
			// Messages counts the ready ones: with every order applied and
			// the outbox empty, empty queues leave nothing to deliver.
			n, err := queueDepth(conn, topic)
			if err != nil || n > 0 {
				return false, err
			}
			r, err := queueDepth(conn, rabbitconsumer.DefaultRetryQueue(topic))
			return r == 0, err
		},
		events: func(ctx context.Context) ([]*kgo.Record, func() (int, error), error) {
			recs, err := readQueue(conn, events)
			return recs, func() (int, error) { return rabbitMaxMessage, nil }, err
		},
		deadLetters: func(ctx context.Context) ([]dlq.Entry, error) {
			q, err := rabbitconsumer.OpenDeadLetters(ctx, amqpURL, dlqQueue)
			if err != nil {
				return nil, err
			}
			defer q.Close()
			return q.Entries(ctx, dlq.Filter{RefuseInvalid: true})
		},
	}
}
