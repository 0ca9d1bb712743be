package integration_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/attribute"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/pgtest"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/internal/testhook"
	"github.com/oncely/oncely/outbox"
	"github.com/oncely/oncely/rabbitconsumer"
)

// rabbitURL is the RabbitMQ the tests use (.ci/run starts it).
const (
	rabbitAddr = "127.0.0.1:5672"
	rabbitURL  = "amqp://guest:guest@" + rabbitAddr + "/"
)

// Like the NATS tests, the RabbitMQ tests do not run in parallel: they
// finish before the parallel Kafka tests start.

// rabbitEnv is one test's quorum queue, its dead-letter queue (both deleted
// when the test ends) and its Postgres schema with an effects table.
type rabbitEnv struct {
	sourceDB
	url   string           // the RabbitMQ: rabbitURL, or a test's own node
	conn  *amqp.Connection // the test's own, for publishing and inspecting
	queue string
	dlq   string // rabbitconsumer.DefaultDeadLetterRoutingKey(queue)
}

func newRabbitEnv(t *testing.T) *rabbitEnv { return newRabbitEnvOn(t, rabbitURL) }

// newRabbitEnvOn is newRabbitEnv on the RabbitMQ at url.
func newRabbitEnvOn(t *testing.T, url string) *rabbitEnv {
	t.Helper()
	conn := rabbitConnTo(t, url)
	q := testenv.UniqueName("oncely-rabbit")
	e := &rabbitEnv{sourceDB: newSourceDB(t), url: url, conn: conn, queue: q, dlq: rabbitconsumer.DefaultDeadLetterRoutingKey(q)}
	for _, name := range []string{e.queue, e.dlq} {
		e.declareQueue(name)
	}
	e.deleteAtEnd(rabbitconsumer.DefaultRetryQueue(q)) // declared by the consumers
	return e
}

// rabbitConnTo is a connection of the test's own to the RabbitMQ at url,
// closed when it ends.
func rabbitConnTo(t *testing.T, url string) *amqp.Connection {
	t.Helper()
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatalf("connect to RabbitMQ at %s (is rabbitmq-server running?): %v", url, err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// channel is a new channel on the test's connection.
func (e *rabbitEnv) channel() *amqp.Channel {
	e.t.Helper()
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = ch.Close() })
	return ch
}

// declareQueue declares a durable quorum queue, deleted when the test ends.
func (e *rabbitEnv) declareQueue(name string) {
	e.t.Helper()
	if _, err := e.channel().QueueDeclare(name, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		e.t.Fatalf("declare queue %s: %v", name, err)
	}
	e.deleteAtEnd(name)
}

// deleteAtEnd deletes the queue name, if it exists, when the test ends.
func (e *rabbitEnv) deleteAtEnd(name string) {
	e.t.Cleanup(func() {
		conn, err := amqp.Dial(e.url)
		if err != nil {
			e.t.Errorf("delete queue %s: %v", name, err)
			return
		}
		defer func() { _ = conn.Close() }()
		ch, err := conn.Channel()
		if err == nil {
			_, err = ch.QueueDelete(name, false, false, false)
		}
		if err != nil {
			e.t.Errorf("delete queue %s: %v", name, err)
		}
	})
}

// config is a consumer of the test's queue.
func (e *rabbitEnv) config(h consumer.Handler) rabbitconsumer.Config {
	return rabbitconsumer.Config{
		URL: e.url, Queues: []string{e.queue}, Group: "workers", Pool: e.db.Pool, Schema: e.db.Schema, Handler: h,
		RetryBaseDelay: 10 * time.Millisecond, RetryMaxDelay: 50 * time.Millisecond,
		ShutdownTimeout: 5 * time.Second, ReconnectMaxDelay: 200 * time.Millisecond,
	}
}

// rabbitRun is a running consumer.
type rabbitRun struct {
	c      *rabbitconsumer.Consumer
	cancel context.CancelFunc
	done   chan error // Run's error
}

// start runs a consumer of cfg until stop or the end of the test.
func (e *rabbitEnv) start(ctx context.Context, cfg rabbitconsumer.Config) *rabbitRun {
	e.t.Helper()
	c, err := rabbitconsumer.New(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(ctx)
	r := &rabbitRun{c: c, cancel: cancel, done: make(chan error, 1)}
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		r.done <- c.Run(ctx)
	}()
	e.t.Cleanup(func() {
		cancel()
		select {
		case <-stopped:
		case <-time.After(15 * time.Second):
			e.t.Error("rabbitmq consumer did not stop")
		}
	})
	return r
}

// stop stops the consumer and fails the test unless Run returned nil.
func (r *rabbitRun) stop(t *testing.T) {
	t.Helper()
	r.cancel()
	select {
	case err := <-r.done:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("rabbitmq consumer did not stop")
	}
}

// publish publishes a persistent message to queue through the default
// exchange and waits for its confirmation.
func (e *rabbitEnv) publish(queue, body, messageID string, headers amqp.Table) {
	e.t.Helper()
	ch := e.channel()
	if err := ch.Confirm(false); err != nil {
		e.t.Fatal(err)
	}
	dc, err := ch.PublishWithDeferredConfirmWithContext(e.t.Context(), "", queue, true, false, amqp.Publishing{
		MessageId: messageID, Headers: headers, Body: []byte(body), DeliveryMode: amqp.Persistent, ContentType: "text/plain",
	})
	if err != nil {
		e.t.Fatal(err)
	}
	if ok, err := dc.WaitContext(e.t.Context()); !ok || err != nil {
		e.t.Fatalf("publish not confirmed: %v", err)
	}
}

// empty fails the test unless queue holds no message: with every consumer
// stopped, an unacknowledged message would be back in it.
func (e *rabbitEnv) empty(queue string) {
	e.t.Helper()
	q, err := e.channel().QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		e.t.Fatal(err)
	}
	if q.Messages != 0 {
		e.t.Fatalf("queue %s holds %d messages, want none: a message was not acknowledged", queue, q.Messages)
	}
}

// take waits for n messages in queue, takes them (acknowledged) and fails
// the test if more come within a short while.
func (e *rabbitEnv) take(queue string, n int) []amqp.Delivery {
	e.t.Helper()
	ch := e.channel()
	var out []amqp.Delivery
	deadline := time.Now().Add(30 * time.Second)
	for len(out) < n && time.Now().Before(deadline) {
		d, ok, err := ch.Get(queue, true)
		if err != nil {
			e.t.Fatal(err)
		}
		if !ok {
			time.Sleep(20 * time.Millisecond) // polling the queue: basic.get has no wait
			continue
		}
		out = append(out, d)
	}
	if len(out) != n {
		e.t.Fatalf("%d messages in %s, want %d", len(out), queue, n)
	}
	return out
}

// amqpHeader returns a string header of d.
func amqpHeader(d amqp.Delivery, key string) string {
	v, ok := d.Headers[key]
	if !ok {
		return ""
	}
	if b, ok := v.([]byte); ok {
		return string(b)
	}
	return fmt.Sprint(v)
}

// 25 deliveries of one message id (a producer's duplicates: 25 messages,
// all with the same message_id) run at once: one effect, 24 duplicates,
// every delivery acknowledged.
func TestRabbitConcurrentDuplicatesOneEffect(t *testing.T) {
	e := newRabbitEnv(t)
	for range 25 {
		e.publish(e.queue, "order", "order-1", nil)
	}
	cfg := e.config(sourceEffect("a"))
	cfg.Concurrency = 25
	r := e.start(t.Context(), cfg)
	testenv.Eventually(t, 30*time.Second, "every delivery settled", func() bool {
		st := r.c.Stats()
		return st.Processed+st.Duplicates == 25
	})
	r.stop(t)
	e.empty(e.queue)
	e.effects(1)
	if st := r.c.Stats(); st.Processed != 1 || st.Duplicates != 24 {
		t.Fatalf("processed %d, duplicates %d; want 1 and 24", st.Processed, st.Duplicates)
	}
}

// Two consumers (two connections) run one message id at the same time (a
// producer's duplicate, one copy each): the second's claim waits on the
// first's transaction, and only one effect happens.
func TestRabbitTwoConsumersRaceOneEffect(t *testing.T) {
	e := newRabbitEnv(t)
	e.publish(e.queue, "order", "order-1", nil)
	e.publish(e.queue, "order", "order-1", nil)

	var first atomic.Bool
	h := func(member string) consumer.Handler {
		return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			if first.CompareAndSwap(false, true) {
				e.waitForBlockedClaim() // the other consumer's claim waits on ours
			}
			return sourceEffect(member)(ctx, tx, msg)
		}
	}
	var rs []*rabbitRun
	for _, member := range []string{"a", "b"} {
		cfg := e.config(h(member))
		cfg.Prefetch = 1 // one copy each
		rs = append(rs, e.start(t.Context(), cfg))
	}
	testenv.Eventually(t, 30*time.Second, "both copies settled", func() bool {
		a, b := rs[0].c.Stats(), rs[1].c.Stats()
		return a.Processed+b.Processed+a.Duplicates+b.Duplicates == 2
	})
	for _, r := range rs {
		r.stop(t)
	}
	e.empty(e.queue)
	e.effects(1)
	a, b := rs[0].c.Stats(), rs[1].c.Stats()
	if a.Processed+b.Processed != 1 || a.Duplicates+b.Duplicates != 1 {
		t.Fatalf("processed %d+%d, duplicates %d+%d; want 1 and 1", a.Processed, b.Processed, a.Duplicates, b.Duplicates)
	}
	if a.Processed+a.Duplicates != 1 {
		t.Fatalf("consumer a settled %d copies, want 1: the two did not race", a.Processed+a.Duplicates)
	}
}

// The poison kinds go to the dead-letter queue at once, each with its body,
// its headers and its provenance, are recorded as dead-lettered, and the
// originals are acknowledged: a handler's dlq.Permanent error, its
// dlq.Undecodable error, and a message with no id at all (neither
// message_id nor the message-id header), which cannot be deduplicated and
// is never run.
func TestRabbitPoisonToDeadLetterQueue(t *testing.T) {
	e := newRabbitEnv(t)
	e.publish(e.queue, "not an order", "poison-1", amqp.Table{"tenant": "acme", "priority-level": int32(7)})
	e.publish(e.queue, "\xff\xfe", "garbled-1", nil)
	e.publish(e.queue, "anonymous", "", nil)
	var runs atomic.Int32
	r := e.start(t.Context(), e.config(func(_ context.Context, _ pgx.Tx, msg *consumer.Message) error {
		runs.Add(1)
		if msg.ID == "garbled-1" {
			return dlq.Undecodable(errors.New("body is not JSON"))
		}
		return dlq.Permanent(errors.New("order has no id"))
	}))
	out := e.take(e.dlq, 3)
	testenv.Eventually(t, 30*time.Second, "every message settled", func() bool { return r.c.Stats().DeadLettered == 3 })
	r.stop(t)
	e.empty(e.queue)
	byBody := map[string]amqp.Delivery{}
	for _, d := range out {
		byBody[string(d.Body)] = d
	}
	poison := byBody["not an order"]
	for k, v := range map[string]string{
		rabbitconsumer.HeaderQueue: e.queue, rabbitconsumer.HeaderExchange: "", rabbitconsumer.HeaderRoutingKey: e.queue,
		rabbitconsumer.HeaderRedelivered: "false", rabbitconsumer.HeaderDeliveryCount: "0",
		dlq.HeaderErrorClass: string(dlq.ClassPermanent), dlq.HeaderMessageID: "poison-1", dlq.HeaderAttempts: "1",
		dlq.HeaderGroup: "workers", dlq.HeaderTopic: e.queue, "tenant": "acme",
	} {
		if got := amqpHeader(poison, k); got != v {
			t.Errorf("dead letter header %s = %q, want %q", k, got, v)
		}
	}
	if _, err := strconv.ParseUint(amqpHeader(poison, rabbitconsumer.HeaderDeliveryTag), 10, 64); err != nil {
		t.Errorf("dead letter delivery tag %q: %v", amqpHeader(poison, rabbitconsumer.HeaderDeliveryTag), err)
	}
	if got, ok := poison.Headers["priority-level"].(int32); !ok || got != 7 {
		t.Errorf("dead letter header priority-level = %#v, want int32 7 (its AMQP type kept)", poison.Headers["priority-level"])
	}
	if got := amqpHeader(poison, dlq.HeaderError); !strings.Contains(got, "order has no id") {
		t.Errorf("dead letter error header %q", got)
	}
	if poison.MessageId != "poison-1" || poison.ContentType != "text/plain" || poison.DeliveryMode != amqp.Persistent {
		t.Errorf("dead letter properties: message id %q, content type %q, delivery mode %d", poison.MessageId, poison.ContentType, poison.DeliveryMode)
	}
	if got := amqpHeader(byBody["\xff\xfe"], dlq.HeaderErrorClass); got != string(dlq.ClassUndecodable) {
		t.Errorf("undecodable message's class %q", got)
	}
	anon := byBody["anonymous"]
	if got := amqpHeader(anon, dlq.HeaderErrorClass); got != string(dlq.ClassUndecodable) ||
		!strings.Contains(amqpHeader(anon, dlq.HeaderError), "no message_id") {
		t.Errorf("message without an id: class %q, error %q; want undecodable, naming the missing id", got, amqpHeader(anon, dlq.HeaderError))
	}
	if runs.Load() != 2 {
		t.Errorf("handler ran %d times, want 2 (never for the message without an id)", runs.Load())
	}
	if n := e.count(`SELECT count(*) FROM inbox WHERE message_id IN ('poison-1', 'garbled-1') AND outcome = 'dead_lettered'`); n != 2 {
		t.Errorf("inbox holds %d of the 2 dead letters with ids", n)
	}
}

// A dead letter that no queue takes (the dead-letter exchange has no
// binding for it) is returned by RabbitMQ: the message waits,
// unacknowledged and not recorded as dead-lettered, and its publish is
// retried; once a queue is bound, the copy arrives and the original is
// acknowledged.
func TestRabbitUnroutableDeadLetterWaits(t *testing.T) {
	e := newRabbitEnv(t)
	dlx := testenv.UniqueName("oncely-dlx")
	ch := e.channel()
	if err := ch.ExchangeDeclare(dlx, "direct", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ch.ExchangeDelete(dlx, false, false) })
	e.publish(e.queue, "poison", "poison-1", nil)
	logs := &logRecords{}
	cfg := e.config(func(context.Context, pgx.Tx, *consumer.Message) error { return dlq.Permanent(errors.New("refused")) })
	cfg.DeadLetterExchange, cfg.Logger = dlx, slog.New(logs)
	r := e.start(t.Context(), cfg)
	testenv.Eventually(t, 30*time.Second, "the dead-letter publish to fail", func() bool {
		count, _ := logs.warnings()
		return count["oncely rabbitmq dead-letter publish failed; the message waits"] > 0
	})
	if st := r.c.Stats(); st.DeadLettered != 0 {
		t.Fatalf("dead-lettered %d before any queue took the copy", st.DeadLettered)
	}
	if n := e.count(`SELECT count(*) FROM inbox WHERE outcome = 'dead_lettered'`); n != 0 {
		t.Fatalf("the inbox records a dead letter that was never stored (%d)", n)
	}
	if err := ch.QueueBind(e.dlq, e.dlq, dlx, false, nil); err != nil {
		t.Fatal(err)
	}
	out := e.take(e.dlq, 1)[0]
	testenv.Eventually(t, 30*time.Second, "the message settled", func() bool { return r.c.Stats().DeadLettered == 1 })
	r.stop(t)
	e.empty(e.queue)
	if got := amqpHeader(out, rabbitconsumer.HeaderQueue); got != e.queue {
		t.Errorf("dead letter's queue header %q, want %q", got, e.queue)
	}
}

// One consumer takes several queues: each message's effect happens once,
// and each queue's dead letters go to its own dead-letter queue.
func TestRabbitSeveralQueues(t *testing.T) {
	e := newRabbitEnv(t)
	second := testenv.UniqueName("oncely-rabbit")
	e.declareQueue(second)
	e.declareQueue(rabbitconsumer.DefaultDeadLetterRoutingKey(second))
	e.deleteAtEnd(rabbitconsumer.DefaultRetryQueue(second))
	for i := range 5 {
		e.publish(e.queue, "order", "first-"+strconv.Itoa(i), nil)
		e.publish(second, "order", "second-"+strconv.Itoa(i), nil)
	}
	e.publish(second, "poison", "poison-1", nil)
	cfg := e.config(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if msg.ID == "poison-1" {
			return dlq.Permanent(errors.New("refused"))
		}
		return sourceEffect("a")(ctx, tx, msg)
	})
	cfg.Queues = []string{e.queue, second}
	r := e.start(t.Context(), cfg)
	out := e.take(rabbitconsumer.DefaultDeadLetterRoutingKey(second), 1)[0]
	testenv.Eventually(t, 30*time.Second, "every message settled", func() bool {
		st := r.c.Stats()
		return st.Processed == 10 && st.DeadLettered == 1
	})
	r.stop(t)
	e.empty(e.queue)
	e.empty(second)
	e.empty(e.dlq)
	e.effects(10)
	if got := amqpHeader(out, rabbitconsumer.HeaderQueue); got != second || out.MessageId != "poison-1" {
		t.Errorf("dead letter %q from queue %q, want poison-1 from %q", out.MessageId, got, second)
	}
}

// A handler that keeps failing runs again after a backoff (a copy waits in
// the retry queue, then comes back), each attempt counted, and the
// MaxAttempts-th failure dead-letters the message (class max_attempts).
func TestRabbitRetriesThenDeadLetter(t *testing.T) {
	e := newRabbitEnv(t)
	e.publish(e.queue, "order", "flaky-1", nil)
	var mu sync.Mutex
	var attempts []int
	cfg := e.config(func(_ context.Context, _ pgx.Tx, msg *consumer.Message) error {
		mu.Lock()
		attempts = append(attempts, msg.Attempt)
		mu.Unlock()
		return errors.New("payment service unavailable")
	})
	cfg.MaxAttempts = 3
	r := e.start(t.Context(), cfg)
	out := e.take(e.dlq, 1)[0]
	testenv.Eventually(t, 30*time.Second, "the message settled", func() bool { return r.c.Stats().DeadLettered == 1 })
	r.stop(t)
	e.empty(e.queue)
	e.empty(rabbitconsumer.DefaultRetryQueue(e.queue))
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(attempts, []int{1, 2, 3}) {
		t.Fatalf("handler attempts %v, want [1 2 3]", attempts)
	}
	if _, ok := out.Headers[rabbitconsumer.HeaderAttempts]; ok {
		t.Error("the dead letter carries the retry copy's attempts header")
	}
	for k, v := range map[string]string{dlq.HeaderErrorClass: string(dlq.ClassMaxAttempts), dlq.HeaderAttempts: "3"} {
		if got := amqpHeader(out, k); got != v {
			t.Errorf("dead letter header %s = %q, want %q", k, got, v)
		}
	}
	if st := r.c.Stats(); st.Retries != 2 || st.DeadLettered != 1 {
		t.Errorf("retries %d, dead-lettered %d; want 2 and 1", st.Retries, st.DeadLettered)
	}
}

// A message waiting for its retry does not hold up the queue: with one
// place to run and one message handed over at a time (Concurrency and
// Prefetch 1), a message that fails until every other message's effect has
// committed succeeds, after them. Were the waiting message to keep its
// place, the others could not run, and it would fail all its MaxAttempts
// and be dead-lettered.
func TestRabbitRetryDoesNotBlockQueue(t *testing.T) {
	e := newRabbitEnv(t)
	const others = 10
	e.publish(e.queue, "slow", "slow-1", nil)
	for i := range others {
		e.publish(e.queue, "order", "order-"+strconv.Itoa(i), nil)
	}
	var failures atomic.Int32
	cfg := e.config(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if msg.ID == "slow-1" {
			var done int
			if err := tx.QueryRow(ctx, `SELECT count(*) FROM effects`).Scan(&done); err != nil {
				return err
			}
			if done < others {
				failures.Add(1)
				return fmt.Errorf("only %d of the others done", done)
			}
		}
		return sourceEffect("a")(ctx, tx, msg)
	})
	cfg.Concurrency, cfg.Prefetch, cfg.MaxAttempts = 1, 1, 200
	// About 10s of retries (200 of up to 100ms), for the others' 10 commits.
	cfg.RetryBaseDelay, cfg.RetryMaxDelay = 100*time.Millisecond, 100*time.Millisecond
	r := e.start(t.Context(), cfg)
	testenv.Eventually(t, 60*time.Second, "every message settled", func() bool {
		st := r.c.Stats()
		return st.Processed+st.DeadLettered == others+1
	})
	r.stop(t)
	e.empty(e.queue)
	if st := r.c.Stats(); st.DeadLettered != 0 {
		t.Fatalf("%d dead-lettered: the failing message held up the others", st.DeadLettered)
	}
	e.effects(others + 1)
	if failures.Load() == 0 {
		t.Fatal("the slow message never waited for a retry")
	}
	if n := e.count(`SELECT count(*) FROM effects WHERE at > (SELECT at FROM effects WHERE message_id = 'slow-1')`); n != 0 {
		t.Fatalf("%d effects after the slow message's", n)
	}
}

// The producer's trace context travels in AMQP headers: the attempt's
// "process <queue>" span continues it, with messaging.system=rabbitmq and
// the messaging attributes.
func TestRabbitTraceContext(t *testing.T) {
	e := newRabbitEnv(t)
	p := newTracedProducer(t)
	e.publish(e.queue, "order", "traced-1", amqp.Table{"traceparent": p.traceparent})

	cfg := e.config(sourceEffect("a"))
	cfg.TracerProvider = p.tp
	r := e.start(t.Context(), cfg)
	got := p.processSpan(t, "process "+e.queue, map[attribute.Key]string{
		"messaging.system": "rabbitmq", "messaging.destination.name": e.queue, "messaging.consumer.group.name": "workers",
		"messaging.message.id": "traced-1", "messaging.operation.type": "process", "oncely.dedup.outcome": "new",
		"messaging.rabbitmq.destination.routing_key": e.queue,
	})
	r.stop(t)
	if _, ok := got["messaging.rabbitmq.message.delivery_tag"]; !ok {
		t.Error("the span has no messaging.rabbitmq.message.delivery_tag")
	}
	if _, kafka := got["messaging.kafka.offset"]; kafka {
		t.Error("a RabbitMQ span carries messaging.kafka.offset")
	}
}

// Run fails at start-up, naming what is missing or wrong: a queue, the
// dead-letter queue, the dead-letter exchange, a retry queue declared with
// other arguments, the migrated schema. A dead letter that
// could never be published would make its message wait for ever.
func TestRabbitStartupChecks(t *testing.T) {
	e := newRabbitEnv(t)
	other := newRabbitEnv(t)
	for what, cfg := range map[string]rabbitconsumer.Config{
		"no-such-queue": func() rabbitconsumer.Config {
			cfg := e.config(sourceEffect("a"))
			cfg.Queues = []string{e.queue, "no-such-queue"}
			return cfg
		}(),
		"DeadLetterRoutingKey": func() rabbitconsumer.Config {
			cfg := e.config(sourceEffect("a"))
			cfg.DeadLetterRoutingKey = func(q string) string { return q + ".nowhere" }
			return cfg
		}(),
		"RetryQueue": func() rabbitconsumer.Config {
			cfg := e.config(sourceEffect("a"))
			wrong := e.queue + ".plain"
			e.declareQueue(wrong) // without the retry queue's dead-lettering
			cfg.RetryQueue = func(string) string { return wrong }
			return cfg
		}(),
		"DeadLetterExchange": func() rabbitconsumer.Config {
			cfg := e.config(sourceEffect("a"))
			cfg.DeadLetterExchange = "no-such-exchange"
			return cfg
		}(),
		"inbox": func() rabbitconsumer.Config {
			cfg := other.config(sourceEffect("a"))
			cfg.Schema = testenv.Postgres(t).Schema // not migrated
			return cfg
		}(),
	} {
		c, err := rabbitconsumer.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		failsAtStart(t, what, c.Run)
	}
}

// The connection is cut (a TCP proxy between consumer and RabbitMQ drops
// it) while messages are in flight: the consumer reports itself not ready,
// reconnects once the network is back, and every message's effect happens
// exactly once, those unacknowledged at the cut being delivered again.
func TestRabbitConnectionCutMidStream(t *testing.T) {
	e := newRabbitEnv(t)
	const n = 300
	for i := range n {
		e.publish(e.queue, "order", "order-"+strconv.Itoa(i), nil)
	}
	proxy := pgtest.NewTCPProxy(t, rabbitAddr)
	cfg := e.config(sourceEffect("a"))
	cfg.URL = "amqp://guest:guest@" + proxy.Addr + "/"
	cfg.Concurrency, cfg.Prefetch = 4, 32
	r := e.start(t.Context(), cfg)
	testenv.Eventually(t, 30*time.Second, "a third of the messages processed", func() bool { return r.c.Stats().Processed >= n/3 })
	proxy.Cut()
	testenv.Eventually(t, 30*time.Second, "the consumer to report the lost connection", func() bool {
		return strings.Contains(r.c.NotReady(), "RabbitMQ")
	})
	cut := r.c.Stats().Processed
	proxy.Restore()
	testenv.Eventually(t, 60*time.Second, "every message processed", func() bool { return r.c.Stats().Processed == n })
	testenv.Eventually(t, 10*time.Second, "the consumer ready again", r.c.Ready)
	r.stop(t)
	e.empty(e.queue)
	e.effects(n)
	if cut >= n {
		t.Fatalf("all %d messages were processed before the cut took effect", n)
	}
	if got := r.c.Connections(); got < 2 {
		t.Fatalf("%d connections, want a reconnection", got)
	}
	t.Logf("processed before the cut: %d, duplicates (redelivered after committing): %d", cut, r.c.Stats().Duplicates)
}

// RabbitMQ cancels the consumer of a queue that is deleted while it is
// consumed: the consumer reports the queue missing, waits for it, and
// consumes it again once it is declared again.
func TestRabbitQueueDeletedWhileConsuming(t *testing.T) {
	e := newRabbitEnv(t)
	e.publish(e.queue, "order", "order-1", nil)
	r := e.start(t.Context(), e.config(sourceEffect("a")))
	testenv.Eventually(t, 30*time.Second, "the first message processed", func() bool { return r.c.Stats().Processed == 1 })
	if _, err := e.channel().QueueDelete(e.queue, false, false, false); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 30*time.Second, "the consumer to report the queue missing", func() bool {
		return strings.Contains(r.c.NotReady(), e.queue)
	})
	if _, err := e.channel().QueueDeclare(e.queue, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatal(err)
	}
	e.publish(e.queue, "order", "order-2", nil)
	testenv.Eventually(t, 30*time.Second, "the second message processed", func() bool { return r.c.Stats().Processed == 2 })
	testenv.Eventually(t, 10*time.Second, "the consumer ready again", r.c.Ready)
	r.stop(t)
	e.empty(e.queue)
	e.effects(2)
}

// The outbox relay publishes to RabbitMQ with message_id set to each row's
// message id, one row after another with publisher confirms. A relay that
// dies after the confirmations and before marking the rows sent is followed
// by one that publishes them again (RabbitMQ keeps both copies); per key the
// queue holds the rows in enqueue order, and a Consumer applies each id
// once. A row that no queue takes is an error, not a silent drop.
func TestRabbitRelayPublishesWithMessageIDs(t *testing.T) {
	e := newRabbitEnv(t)
	ctx := t.Context()
	const n = 20
	pub := &rabbitconsumer.Publisher{URL: rabbitURL}
	t.Cleanup(func() { _ = pub.Close() })
	ids, republished := relayRepublishes(t, e.db, pub, e.queue, n)

	// The queue holds the first relay's batch, then every row: per key,
	// ids in enqueue order after the republished ones.
	msgs := e.take(e.queue, int(republished)+n)
	byKey := map[string][]string{}
	for _, m := range msgs {
		if got := amqpHeader(m, outbox.MessageIDHeader); got != m.MessageId || m.DeliveryMode != amqp.Persistent {
			t.Errorf("message_id %q, message-id header %q, delivery mode %d", m.MessageId, got, m.DeliveryMode)
		}
		key := amqpHeader(m, rabbitconsumer.HeaderKey)
		byKey[key] = append(byKey[key], m.MessageId)
	}
	for k := range 2 {
		key := "k" + strconv.Itoa(k)
		var want []string
		for i := k; i < n; i += 2 {
			want = append(want, ids[i])
		}
		got := byKey[key]
		if len(got) < len(want) || !slices.Equal(got[len(got)-len(want):], want) || !slices.Equal(got[:len(got)-len(want)], want[:len(got)-len(want)]) {
			t.Errorf("key %s: ids %v, want the republished prefix of %v, then all of it in enqueue order", key, got, want)
		}
	}
	// The copies, back in the queue, are applied once each.
	for _, m := range msgs {
		e.publish(e.queue, string(m.Body), m.MessageId, m.Headers)
	}
	r := e.start(ctx, e.config(sourceEffect("a")))
	testenv.Eventually(t, 30*time.Second, "every copy settled", func() bool {
		st := r.c.Stats()
		return st.Processed+st.Duplicates == int64(len(msgs))
	})
	r.stop(t)
	e.effects(n)

	unroutable := pub.Publish(ctx, []*kgo.Record{{Topic: testenv.UniqueName("no-queue"), Value: []byte("x")}})
	if !errors.Is(unroutable[0], rabbitconsumer.ErrUnroutable) || pub.Permanent(unroutable[0]) {
		t.Errorf("publish to a routing key no queue takes: %v, want a retried ErrUnroutable", unroutable[0])
	}
}

// The crash tests run the consumer in a child process (this test binary,
// run again with rabbitChildEnv set) that dies with os.Exit at a crash
// point: a real process death, whose connection RabbitMQ sees end.
const (
	rabbitChildEnv = "ONCELY_RABBIT_CHILD" // database url|schema|queue|max attempts|crash point
	rabbitExitCode = 3
)

// The child's crash points.
const (
	rabbitDieAfterCommit     = "after-commit"      // AfterCommit: committed, not acknowledged
	rabbitDieAfterDeadLetter = "after-dead-letter" // AfterDeadLetter: the handler's error is permanent
	rabbitDieInHandler       = "in-handler"        // the handler exits: nothing finishes
	rabbitDieAfterRetryCopy  = "after-retry-copy"  // AfterRetryCopy: the handler fails, its copy is stored, the original not acknowledged
	rabbitDieAfterBatch      = "after-batch"       // AfterCommit in batch mode: a batch committed, none of it acknowledged
)

// TestRabbitChildWorker is the child process's body; it is skipped in an
// ordinary run.
func TestRabbitChildWorker(t *testing.T) {
	spec := os.Getenv(rabbitChildEnv)
	if spec == "" {
		t.Skip("runs only as the child process of the RabbitMQ crash tests")
	}
	f := strings.Split(spec, "|")
	if len(f) != 5 {
		t.Fatalf("%s=%q: want 5 fields", rabbitChildEnv, spec)
	}
	maxAttempts, err := strconv.Atoi(f[3])
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	pool, err := testenv.NewPool(ctx, f[0], f[1], 4)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	die := func(*kgo.Record) error { os.Exit(rabbitExitCode); return nil }
	hooks := &testhook.Consumer{}
	handler := sourceEffect("child")
	batchSize := 1
	switch f[4] {
	case rabbitDieAfterCommit:
		hooks.AfterCommit = die
	case rabbitDieAfterBatch:
		hooks.AfterCommit = die
		batchSize = 10
	case rabbitDieAfterDeadLetter:
		hooks.AfterDeadLetter = die
		handler = func(context.Context, pgx.Tx, *consumer.Message) error { return dlq.Permanent(errors.New("refused")) }
	case rabbitDieInHandler:
		handler = func(context.Context, pgx.Tx, *consumer.Message) error { os.Exit(rabbitExitCode); return nil }
	case rabbitDieAfterRetryCopy:
		hooks.AfterRetryCopy = die
		handler = func(context.Context, pgx.Tx, *consumer.Message) error {
			return errors.New("payment service unavailable")
		}
	}
	c, err := rabbitconsumer.New(rabbitconsumer.Config{URL: rabbitURL, Queues: []string{f[2]}, Group: "workers",
		Pool: pool, Schema: f[1], Handler: handler, MaxAttempts: maxAttempts, BatchSize: batchSize})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Run(testhook.WithConsumer(ctx, hooks)); err != nil {
		t.Fatal(err)
	}
}

// crashChild runs the child worker until it dies at its crash point, and
// fails the test unless it did.
func (e *rabbitEnv) crashChild(maxAttempts int, point string) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(e.t.Context(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestRabbitChildWorker$", "-test.count=1")
	cmd.Env = append(os.Environ(), rabbitChildEnv+"="+strings.Join([]string{
		e.db.URL, e.db.Schema, e.queue, strconv.Itoa(maxAttempts), point}, "|"))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run() // killed when ctx ends
	if ctx.Err() != nil {
		e.t.Fatalf("child worker (%s) did not die:\n%s", point, out.String())
	}
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != rabbitExitCode {
		e.t.Fatalf("child worker (%s) ended with %v, want exit code %d:\n%s", point, err, rabbitExitCode, out.String())
	}
}

// The process dies between COMMIT and the acknowledgement: RabbitMQ
// delivers the message again to the next process, which finds the id in
// the inbox and runs no second effect.
func TestRabbitCrashBetweenCommitAndAck(t *testing.T) {
	e := newRabbitEnv(t)
	e.publish(e.queue, "order", "order-1", nil)
	e.crashChild(consumer.DefaultMaxAttempts, rabbitDieAfterCommit)
	if n := e.count(`SELECT count(*) FROM effects WHERE member = 'child'`); n != 1 {
		t.Fatalf("the crashed process's effect is missing (%d)", n)
	}
	r := e.start(t.Context(), e.config(sourceEffect("second")))
	testenv.Eventually(t, 30*time.Second, "the redelivery settled", func() bool { return r.c.Stats().Duplicates == 1 })
	r.stop(t)
	e.empty(e.queue)
	e.effects(1)
	if st := r.c.Stats(); st.Processed != 0 {
		t.Fatalf("second process processed %d, want 0", st.Processed)
	}
}

// The process dies in the middle of a handler, its transaction open: the
// transaction rolls back with the process, RabbitMQ delivers the message
// again, and the next process applies it once, as its second attempt (the
// quorum queue's x-delivery-count counts the first).
func TestRabbitCrashMidHandler(t *testing.T) {
	e := newRabbitEnv(t)
	e.publish(e.queue, "order", "order-1", nil)
	e.crashChild(consumer.DefaultMaxAttempts, rabbitDieInHandler)
	var attempt atomic.Int64
	r := e.start(t.Context(), e.config(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		attempt.Store(int64(msg.Attempt))
		return sourceEffect("second")(ctx, tx, msg)
	}))
	testenv.Eventually(t, 30*time.Second, "the redelivery processed", func() bool { return r.c.Stats().Processed == 1 })
	r.stop(t)
	e.empty(e.queue)
	e.effects(1)
	if n := e.count(`SELECT count(*) FROM effects WHERE member = 'second'`); n != 1 {
		t.Fatalf("the second process applied the message %d times, want once", n)
	}
	if got := attempt.Load(); got != 2 {
		t.Fatalf("the redelivery ran as attempt %d, want 2", got)
	}
}

// The process dies after a failed message's retry copy was confirmed and
// before the original was acknowledged: both come to the next process, and
// the inbox lets only one of them apply.
func TestRabbitCrashBetweenRetryCopyAndAck(t *testing.T) {
	e := newRabbitEnv(t)
	e.publish(e.queue, "order", "order-1", nil)
	e.crashChild(consumer.DefaultMaxAttempts, rabbitDieAfterRetryCopy)
	var mu sync.Mutex
	var attempts []int
	r := e.start(t.Context(), e.config(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		mu.Lock()
		attempts = append(attempts, msg.Attempt)
		mu.Unlock()
		return sourceEffect("second")(ctx, tx, msg)
	}))
	testenv.Eventually(t, 30*time.Second, "the original and the copy settled", func() bool {
		st := r.c.Stats()
		return st.Processed == 1 && st.Duplicates == 1
	})
	r.stop(t)
	e.empty(e.queue)
	e.empty(rabbitconsumer.DefaultRetryQueue(e.queue))
	e.effects(1)
	mu.Lock()
	defer mu.Unlock()
	if len(attempts) == 0 || attempts[0] != 2 {
		t.Errorf("attempts %v, want the first to be attempt 2 (the crashed process's failure counted)", attempts)
	}
}

// The process dies after the dead-letter copy was confirmed and recorded,
// before the acknowledgement: the next process acknowledges the redelivery
// as dead-lettered already, without a second copy.
func TestRabbitCrashAfterDeadLetterBeforeAck(t *testing.T) {
	e := newRabbitEnv(t)
	e.publish(e.queue, "poison", "poison-1", nil)
	e.crashChild(consumer.DefaultMaxAttempts, rabbitDieAfterDeadLetter)
	var runs atomic.Int32
	r := e.start(t.Context(), e.config(func(context.Context, pgx.Tx, *consumer.Message) error {
		runs.Add(1)
		return dlq.Permanent(errors.New("refused"))
	}))
	testenv.Eventually(t, 30*time.Second, "the redelivery settled", func() bool { return r.c.Stats().Duplicates == 1 })
	r.stop(t)
	e.empty(e.queue)
	e.take(e.dlq, 1)
	e.empty(e.dlq)
	if runs.Load() != 0 {
		t.Errorf("the handler ran %d times on the redelivery, want 0", runs.Load())
	}
}

// A message that kills every process that runs it is delivered again with
// a higher x-delivery-count (a quorum queue counts the deliveries that
// ended with their connection); the delivery after MaxAttempts of them
// dead-letters it as a crash loop without running the handler again. The
// messages behind it, which no process that died had started, are not
// blamed: each is applied once.
func TestRabbitCrashLoopAcrossRestarts(t *testing.T) {
	e := newRabbitEnv(t)
	e.publish(e.queue, "order", "killer-1", nil)
	const others = 3 // behind the killer: delivered to no process that it kills
	for i := range others {
		e.publish(e.queue, "order", "order-"+strconv.Itoa(i), nil)
	}
	const maxAttempts = 2
	for range maxAttempts {
		e.crashChild(maxAttempts, rabbitDieInHandler)
	}
	var runs atomic.Int32
	cfg := e.config(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		runs.Add(1)
		return sourceEffect("last")(ctx, tx, msg)
	})
	cfg.MaxAttempts = maxAttempts
	r := e.start(t.Context(), cfg)
	out := e.take(e.dlq, 1)[0]
	testenv.Eventually(t, 30*time.Second, "every message settled", func() bool {
		st := r.c.Stats()
		return st.DeadLettered == 1 && st.Processed == others
	})
	r.stop(t)
	e.empty(e.queue)
	e.empty(e.dlq)
	if got := amqpHeader(out, dlq.HeaderErrorClass); got != string(dlq.ClassCrashLoop) || out.MessageId != "killer-1" {
		t.Errorf("class %q, want crash_loop", got)
	}
	if got := amqpHeader(out, rabbitconsumer.HeaderDeliveryCount); got != strconv.Itoa(maxAttempts) {
		t.Errorf("delivery count %q, want %d", got, maxAttempts)
	}
	if got := amqpHeader(out, rabbitconsumer.HeaderRedelivered); got != "true" {
		t.Errorf("redelivered %q, want true", got)
	}
	if runs.Load() != others || e.count(`SELECT count(*) FROM effects WHERE message_id = 'killer-1'`) != 0 {
		t.Errorf("handler runs %d, the killer's effects %d; want %d (the others once each) and 0", runs.Load(),
			e.count(`SELECT count(*) FROM effects WHERE message_id = 'killer-1'`), others)
	}
	e.effects(others)
	if st := r.c.Stats(); st.CrashLoops != 1 {
		t.Errorf("crash loops %d, want 1", st.CrashLoops)
	}
}

// ready is the number of messages ready in queue.
func (e *rabbitEnv) ready(queue string) int {
	e.t.Helper()
	ch, err := e.conn.Channel() // closed at once: ready is polled
	if err != nil {
		e.t.Fatal(err)
	}
	defer func() { _ = ch.Close() }()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		e.t.Fatal(err)
	}
	return q.Messages
}

// settledIn waits until queue holds n messages ready (a listing closed
// gives its messages back asynchronously).
func (e *rabbitEnv) settledIn(queue string, n int) {
	e.t.Helper()
	testenv.Eventually(e.t, 30*time.Second, "the queue's messages ready", func() bool { return e.ready(queue) == n })
}

// openDLQ opens the test's dead-letter queue, closed when the test ends.
func (e *rabbitEnv) openDLQ() *rabbitconsumer.DeadLetterQueue {
	e.t.Helper()
	q, err := rabbitconsumer.OpenDeadLetters(e.t.Context(), rabbitURL, e.dlq)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { _ = q.Close() })
	return q
}

// deadLetterIDs lists the dead-letter queue in a listing of its own and
// returns the entries' message ids in listing order, and their refs.
func (e *rabbitEnv) deadLetterIDs() (ids, refs []string) {
	e.t.Helper()
	q := e.openDLQ()
	defer func() { _ = q.Close() }()
	all, err := q.Entries(e.t.Context(), dlq.Filter{RefuseInvalid: true})
	if err != nil {
		e.t.Fatal(err)
	}
	for _, en := range all {
		ids, refs = append(ids, en.Info.MessageID), append(refs, en.Ref())
	}
	return ids, refs
}

// publishEntry publishes to queue a message with en's value, the headers
// headerOf gives and message_id id.
func (e *rabbitEnv) publishEntry(queue, id string, en *dlq.Entry, headerOf func(*dlq.Entry) amqp.Table) {
	e.t.Helper()
	e.publish(queue, string(en.Record.Value), id, headerOf(en))
}

// recordHeaders is a record's headers as an AMQP table of strings.
func recordHeaders(en *dlq.Entry) amqp.Table {
	t := amqp.Table{}
	for _, h := range en.Record.Headers {
		t[h.Key] = string(h.Value)
	}
	return t
}

// Dead letters are listed from the dead-letter queue with package dlq's
// filters, and the listing leaves the queue as it was (the same messages,
// in the same order, for the next listing); a dry run publishes and
// removes nothing; a redrive runs the message exactly once more and
// removes its dead letter, leaving the other. A dead letter left in the
// queue after its redrive ran (its removal lost) is skipped as processed
// by the next redrive, and stays.
func TestRabbitDeadLettersRedriveOnce(t *testing.T) {
	e := newRabbitEnv(t)
	ctx := t.Context()
	e.publish(e.queue, "bad", "poison-1", amqp.Table{"tenant": "acme", "priority-level": int32(7)})
	e.publish(e.queue, "garbled", "garbled-1", nil)
	e.publish(e.queue, "good", "good-1", nil)
	var fixed atomic.Bool
	var runs atomic.Int32
	var tenant atomic.Value
	r := e.start(ctx, e.config(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		runs.Add(1)
		switch {
		case fixed.Load():
			if d, ok := rabbitconsumer.Delivery(msg); ok {
				tenant.Store(fmt.Sprintf("%s/%T(%v)/attempt %d", amqpHeader(*d, "tenant"), d.Headers["priority-level"], d.Headers["priority-level"], msg.Attempt))
			}
		case string(msg.Value) == "bad":
			return dlq.Permanent(errors.New("order has no id"))
		case string(msg.Value) == "garbled":
			return dlq.Undecodable(errors.New("body is not JSON"))
		}
		return sourceEffect("w")(ctx, tx, msg)
	}))
	testenv.Eventually(t, 30*time.Second, "two dead letters and one processed", func() bool {
		st := r.c.Stats()
		return st.DeadLettered == 2 && st.Processed == 1
	})
	e.settledIn(e.dlq, 2)

	q := e.openDLQ()
	all, err := q.Entries(ctx, dlq.Filter{RefuseInvalid: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 2 || all[0].Info.MessageID != "poison-1" || all[0].Info.Class != dlq.ClassPermanent ||
		all[0].Info.Topic != e.queue || all[0].Ref() != e.dlq+"/0/0" ||
		all[1].Info.MessageID != "garbled-1" || all[1].Ref() != e.dlq+"/0/1" {
		t.Fatalf("dead letters %+v, want poison-1 at %s/0/0 and garbled-1 at 0/1, from %s", all, e.dlq, e.queue)
	}
	for _, tc := range []struct {
		f    dlq.Filter
		want []string
	}{
		{dlq.Filter{Class: dlq.ClassUndecodable}, []string{"garbled-1"}},
		{dlq.Filter{MessageID: "poison-1"}, []string{"poison-1"}},
		{dlq.Filter{Refs: []string{"0/1"}}, []string{"garbled-1"}},
		{dlq.Filter{Refs: []string{e.dlq + "/0/0"}, Class: dlq.ClassPermanent}, []string{"poison-1"}},
		{dlq.Filter{MessageID: "good-1"}, nil},
	} {
		got, err := q.Entries(ctx, tc.f)
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, en := range got {
			ids = append(ids, en.Info.MessageID)
		}
		if !slices.Equal(ids, tc.want) {
			t.Errorf("filter %+v: %q, want %q", tc.f, ids, tc.want)
		}
	}
	if n := e.ready(e.dlq); n != 0 {
		t.Fatalf("%d dead letters ready while the listing holds them, want 0", n)
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	e.settledIn(e.dlq, 2)
	if ids, refs := e.deadLetterIDs(); !slices.Equal(ids, []string{"poison-1", "garbled-1"}) ||
		!slices.Equal(refs, []string{e.dlq + "/0/0", e.dlq + "/0/1"}) {
		t.Fatalf("listing again: %q at %q, want the same messages at the same positions", ids, refs)
	}
	e.settledIn(e.dlq, 2)

	inbox, err := dedup.New(dedup.Config{Schema: e.db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	opts := dlq.RedriveOptions{Inbox: inbox, DB: e.db.Pool}
	dry := opts
	dry.DryRun = true
	q = e.openDLQ()
	all, err = q.Entries(ctx, dlq.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	res, err := q.Redrive(ctx, all, dry)
	if err != nil || len(res) != 2 || res[0].Action != dlq.WouldRedrive || res[1].Action != dlq.WouldRedrive {
		t.Fatalf("dry run: %+v, %v", res, err)
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	e.settledIn(e.dlq, 2)
	if n := e.ready(e.queue); n != 0 {
		t.Fatalf("the dry run published: %d messages in %s", n, e.queue)
	}
	if n := e.count(`SELECT count(*) FROM redrive_grants`); n != 0 {
		t.Fatalf("the dry run granted %d redrives", n)
	}

	fixed.Store(true)
	q = e.openDLQ()
	poison, err := q.Entries(ctx, dlq.Filter{MessageID: "poison-1"})
	if err != nil || len(poison) != 1 {
		t.Fatalf("poison-1's dead letter: %d entries, %v", len(poison), err)
	}
	res, err = q.Redrive(ctx, poison, opts)
	if err != nil || len(res) != 1 || res[0].Action != dlq.Redriven || res[0].Topic != e.queue || res[0].Offset != -1 {
		t.Fatalf("redrive: %+v, %v; want redriven to %s", res, err, e.queue)
	}
	if left, err := q.Entries(ctx, dlq.Filter{}); err != nil || len(left) != 1 || left[0].Info.MessageID != "garbled-1" {
		t.Fatalf("after the redrive the listing holds %+v, %v; want garbled-1 only", left, err)
	}
	testenv.Eventually(t, 30*time.Second, "the redriven message's effect", func() bool {
		return e.count(`SELECT count(*) FROM effects WHERE message_id = 'poison-1'`) == 1
	})
	// Its own headers, in their AMQP types, and none of the dead-letter
	// queue's delivery counts (the listings' deliveries) as attempts.
	if got, _ := tenant.Load().(string); got != "acme/int32(7)/attempt 1" {
		t.Errorf("the redriven message's tenant/priority-level/attempt = %q, want acme/int32(7)/attempt 1", got)
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	e.settledIn(e.dlq, 1)
	if ids, _ := e.deadLetterIDs(); !slices.Equal(ids, []string{"garbled-1"}) {
		t.Fatalf("dead letters after the redrive: %q, want garbled-1 only", ids)
	}
	if n := e.count(`SELECT count(*) FROM inbox WHERE message_id = 'poison-1' AND outcome = 'processed'`); n != 1 {
		t.Errorf("inbox: poison-1 processed %d times, want 1", n)
	}

	// poison-1's dead letter again, as if its removal had been lost.
	e.publishEntry(e.dlq, "poison-1", &poison[0], recordHeaders)
	e.settledIn(e.dlq, 2)
	q = e.openDLQ()
	again, err := q.Entries(ctx, dlq.Filter{MessageID: "poison-1"})
	if err != nil || len(again) != 1 {
		t.Fatalf("poison-1's dead letter again: %d entries, %v", len(again), err)
	}
	res, err = q.Redrive(ctx, again, opts)
	if err != nil || len(res) != 1 || res[0].Action != dlq.SkipProcessed {
		t.Fatalf("second redrive: %+v, %v; want skipped as processed", res, err)
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	e.settledIn(e.dlq, 2)
	r.stop(t)
	e.empty(e.queue)
	e.effects(2) // good-1 and the redriven poison-1, once each
	if n := runs.Load(); n != 4 {
		t.Errorf("handler ran %d times, want 4 (good-1, poison-1, garbled-1, poison-1's redrive)", n)
	}
}

// A message that carries the oncely-redrive header without an operator's
// redrive (any producer can write it) is a duplicate of its dead-lettered
// id, whether its ref is made up or the dead letter's own: nothing runs. A
// real redrive after them runs the message once more, and a copy of the
// redriven message after it is a duplicate again.
func TestRabbitForgedRedriveHeaderChangesNothing(t *testing.T) {
	e := newRabbitEnv(t)
	ctx := t.Context()
	e.publish(e.queue, "order", "order-9", nil)
	var accept atomic.Bool
	r := e.start(ctx, e.config(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if !accept.Load() {
			return dlq.Permanent(errors.New("negative amount"))
		}
		return sourceEffect("w")(ctx, tx, msg)
	}))
	testenv.Eventually(t, 30*time.Second, "dead-lettered", func() bool { return r.c.Stats().DeadLettered == 1 })
	e.settledIn(e.dlq, 1)
	accept.Store(true)

	q := e.openDLQ()
	all, err := q.Entries(ctx, dlq.Filter{RefuseInvalid: true})
	if err != nil || len(all) != 1 {
		t.Fatalf("dead letters: %d, %v", len(all), err)
	}
	forged := func(en *dlq.Entry) amqp.Table {
		t := amqp.Table{}
		for _, h := range dlq.RedriveRecord(en, e.queue, dlq.HeaderMessageIDDefault).Headers {
			t[h.Key] = string(h.Value)
		}
		return t
	}
	e.publish(e.queue, "order", "order-9", amqp.Table{dlq.HeaderRedrive: "anything/0/0"})
	e.publishEntry(e.queue, "order-9", &all[0], forged)
	testenv.Eventually(t, 30*time.Second, "both forged copies skipped", func() bool { return r.c.Stats().Duplicates == 2 })
	if n := e.count(`SELECT count(*) FROM effects`); n != 0 {
		t.Fatalf("%d effects: a forged redrive header ran a dead-lettered message", n)
	}

	res, err := q.Redrive(ctx, all, dlq.RedriveOptions{Inbox: dedup.MustNew(e.db.Schema), DB: e.db.Pool})
	if err != nil || len(res) != 1 || res[0].Action != dlq.Redriven {
		t.Fatalf("redrive: %+v, %v", res, err)
	}
	testenv.Eventually(t, 30*time.Second, "the redriven order applied", func() bool { return r.c.Stats().Processed == 1 })
	e.publishEntry(e.queue, "order-9", &all[0], forged)
	testenv.Eventually(t, 30*time.Second, "a copy of the redriven message skipped", func() bool { return r.c.Stats().Duplicates == 3 })
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	r.stop(t)
	e.empty(e.queue)
	e.empty(e.dlq)
	e.effects(1)
	if st := r.c.Stats(); st.DeadLettered != 1 {
		t.Errorf("dead-lettered %d, want 1", st.DeadLettered)
	}
}

// `oncely dlq list|show|redrive --queue` works on a RabbitMQ dead-letter
// queue as on a Kafka topic: the dead letter listed (and in --json) and
// shown by 0/position, each listing leaving the queue as it was; a queue of
// other messages refused and left with its messages; a dry run changing
// nothing; a redrive running the message once, with its grant in the
// consumers' database, and removing the dead letter.
func TestRabbitCLIDeadLetters(t *testing.T) {
	e := newRabbitEnv(t)
	ctx := t.Context()
	oncely := oncelyCLI(t)
	e.publish(e.queue, "bad", "poison-1", nil)
	var fixed atomic.Bool
	r := e.start(ctx, e.config(func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if !fixed.Load() {
			return dlq.Permanent(errors.New("rejected by v1"))
		}
		return sourceEffect("w")(ctx, tx, msg)
	}))
	testenv.Eventually(t, 30*time.Second, "dead-lettered", func() bool { return r.c.Stats().DeadLettered == 1 })
	e.settledIn(e.dlq, 1)

	queue := []string{"--amqp", rabbitURL, "--queue", e.dlq}
	code, out, errs := oncely(t, append([]string{"dlq", "list"}, queue...)...)
	if code != 0 || !strings.Contains(out, "poison-1") || !strings.Contains(out, "permanent") || !strings.Contains(out, "0/0") {
		t.Fatalf("dlq list: exit %d\n%s\n%s", code, out, errs)
	}
	e.settledIn(e.dlq, 1)
	code, out, errs = oncely(t, append([]string{"dlq", "list", "--json", "--class", "max_attempts"}, queue...)...)
	if code != 0 || out != "" {
		t.Fatalf("dlq list --class max_attempts: exit %d\n%s\n%s, want no JSON line", code, out, errs)
	}
	code, out, errs = oncely(t, append([]string{"dlq", "list", "--json", "--class", "permanent"}, queue...)...)
	if code != 0 || strings.Count(out, "\n") != 1 || !strings.Contains(out, `"message_id":"poison-1"`) {
		t.Fatalf("dlq list --json --class permanent: exit %d\n%s\n%s, want one JSON line", code, out, errs)
	}
	code, out, errs = oncely(t, append([]string{"dlq", "show", "0/0"}, queue...)...)
	if code != 0 || !strings.Contains(out, "rejected by v1") || !strings.Contains(out, e.queue) {
		t.Fatalf("dlq show 0/0: exit %d\n%s\n%s", code, out, errs)
	}
	e.settledIn(e.dlq, 1)

	other := testenv.UniqueName("oncely-rabbit-other")
	e.declareQueue(other)
	e.publish(other, "an order", "order-1", nil)
	e.publish(other, "another", "order-2", nil)
	code, out, errs = oncely(t, "dlq", "list", "--amqp", rabbitURL, "--queue", other)
	if code == 0 || !strings.Contains(errs, "is not a dead-letter queue") {
		t.Fatalf("dlq list of a source queue: exit %d\n%s\n%s, want a refusal", code, out, errs)
	}
	e.settledIn(other, 2)
	if got := e.take(other, 2); string(got[0].Body) != "an order" || got[0].MessageId != "order-1" || string(got[1].Body) != "another" {
		t.Fatalf("the refused queue's messages: %q %q, %q; want them unchanged, in order", got[0].Body, got[0].MessageId, got[1].Body)
	}

	fixed.Store(true)
	db := []string{"--database-url", e.db.URL, "--schema", e.db.Schema}
	code, out, errs = oncely(t, append(append([]string{"dlq", "redrive", "--all", "--dry-run"}, queue...), db...)...)
	if code != 0 || !strings.Contains(out, "1 would be redriven") {
		t.Fatalf("dlq redrive --dry-run: exit %d\n%s\n%s", code, out, errs)
	}
	e.settledIn(e.dlq, 1)
	if n := e.ready(e.queue); n != 0 {
		t.Fatalf("the dry run published: %d messages in %s", n, e.queue)
	}
	code, out, errs = oncely(t, append(append([]string{"dlq", "redrive", "--message-id", "poison-1"}, queue...), db...)...)
	if code != 0 || !strings.Contains(out, "1 redriven") || !strings.Contains(out, "-> "+e.queue+"\n") {
		t.Fatalf("dlq redrive: exit %d\n%s\n%s", code, out, errs)
	}
	testenv.Eventually(t, 30*time.Second, "the redriven message's effect", func() bool {
		return e.count(`SELECT count(*) FROM effects WHERE message_id = 'poison-1'`) == 1
	})
	e.empty(e.dlq)
	code, out, errs = oncely(t, append(append([]string{"dlq", "redrive", "--all"}, queue...), db...)...)
	if code != 0 || !strings.Contains(out, "0 selected") {
		t.Fatalf("second dlq redrive: exit %d\n%s\n%s", code, out, errs)
	}
	r.stop(t)
	e.empty(e.queue)
	e.effects(1)
}

// publishDeadLetter publishes to queue a dead letter of the test's queue
// (group workers, class permanent) with message id id and body "body of
// id", as the consumer would.
func (e *rabbitEnv) publishDeadLetter(queue, id string) {
	e.t.Helper()
	e.publishDeadLetterOf(queue, id, dlq.ClassPermanent)
}

// publishDeadLetterOf is publishDeadLetter with the class class.
func (e *rabbitEnv) publishDeadLetterOf(queue, id string, class dlq.Class) {
	e.t.Helper()
	now := time.Now()
	info := dlq.Info{Topic: e.queue, Group: "workers", MessageID: id, Attempts: 1, FirstFailure: now, LastFailure: now,
		Class: class, Error: "rejected", Timestamp: now}
	h := amqp.Table{rabbitconsumer.HeaderQueue: e.queue}
	for _, x := range info.Headers() {
		h[x.Key] = string(x.Value)
	}
	e.publish(queue, "body of "+id, id, h)
}

// A listing keeps the queue's order, on a classic dead-letter queue (a
// message given back returns to its place) as on a quorum one (the
// messages given back come first, in the order given back): a second
// listing names the same messages at the same positions, a dead letter
// that came while the first was open follows them, and after a redrive
// removed one the others keep their order, the later ones a position
// earlier. The redriven copy in the source queue carries the message id,
// the redrive header naming the listing's ref, and no oncely-dlq-* header.
func TestRabbitDeadLetterListingOrder(t *testing.T) {
	for _, kind := range []string{"classic", "quorum"} {
		t.Run(kind, func(t *testing.T) {
			e := newRabbitEnv(t)
			ctx := t.Context()
			dq := testenv.UniqueName("oncely-rabbit-" + kind + ".dlq")
			if _, err := e.channel().QueueDeclare(dq, true, false, false, false, amqp.Table{"x-queue-type": kind}); err != nil {
				t.Fatal(err)
			}
			e.deleteAtEnd(dq)
			e.dlq = dq
			deadLetter := func(id string) { e.publishDeadLetter(dq, id) }
			for _, id := range []string{"m0", "m1", "m2", "m3", "m4"} {
				deadLetter(id)
			}
			want := []string{"m0", "m1", "m2", "m3", "m4"}
			if ids, refs := e.deadLetterIDs(); !slices.Equal(ids, want) || refs[4] != dq+"/0/4" {
				t.Fatalf("listing: %q at %q, want %q at 0 to 4", ids, refs, want)
			}
			e.settledIn(dq, 5)
			q := e.openDLQ()
			all, err := q.Entries(ctx, dlq.Filter{})
			if err != nil || len(all) != 5 {
				t.Fatalf("second listing: %d entries, %v", len(all), err)
			}
			deadLetter("m5") // while the listing holds the others
			for i, en := range all {
				if en.Info.MessageID != want[i] || en.Ref() != fmt.Sprintf("%s/0/%d", dq, i) {
					t.Fatalf("second listing: %s at %s, want %s at 0/%d", en.Info.MessageID, en.Ref(), want[i], i)
				}
			}
			res, err := q.Redrive(ctx, all[2:3], dlq.RedriveOptions{Inbox: dedup.MustNew(e.db.Schema), DB: e.db.Pool})
			if err != nil || len(res) != 1 || res[0].Action != dlq.Redriven {
				t.Fatalf("redrive m2: %+v, %v", res, err)
			}
			if err := q.Close(); err != nil {
				t.Fatal(err)
			}
			e.settledIn(dq, 5)
			if ids, _ := e.deadLetterIDs(); !slices.Equal(ids, []string{"m0", "m1", "m3", "m4", "m5"}) {
				t.Fatalf("listing after the redrive: %q, want m0 m1 m3 m4 m5", ids)
			}
			copies := e.take(e.queue, 1)
			c := copies[0]
			if c.MessageId != "m2" || string(c.Body) != "body of m2" || amqpHeader(c, dlq.HeaderRedrive) != dq+"/0/2" ||
				amqpHeader(c, dlq.HeaderMessageIDDefault) != "m2" || c.DeliveryMode != amqp.Persistent {
				t.Fatalf("redriven copy: message id %q, body %q, headers %v", c.MessageId, c.Body, c.Headers)
			}
			for k := range c.Headers {
				if strings.HasPrefix(k, dlq.Prefix) {
					t.Errorf("redriven copy keeps header %s", k)
				}
			}
		})
	}
}

// A redrive to a queue that does not exist (RabbitMQ returns the mandatory
// copy) fails naming it, revokes its grant and removes nothing: the dead
// letter is given back on Close.
func TestRabbitRedriveUnroutableKeepsDeadLetter(t *testing.T) {
	e := newRabbitEnv(t)
	ctx := t.Context()
	e.publishDeadLetter(e.dlq, "m0")
	q := e.openDLQ()
	all, err := q.Entries(ctx, dlq.Filter{RefuseInvalid: true})
	if err != nil || len(all) != 1 {
		t.Fatalf("dead letters: %d, %v", len(all), err)
	}
	missing := testenv.UniqueName("oncely-rabbit-missing")
	res, err := q.Redrive(ctx, all, dlq.RedriveOptions{ToTopic: missing, Inbox: dedup.MustNew(e.db.Schema), DB: e.db.Pool})
	if !errors.Is(err, rabbitconsumer.ErrUnroutable) || !strings.Contains(err.Error(), missing) || len(res) != 0 {
		t.Fatalf("redrive to a missing queue: %+v, %v; want ErrUnroutable naming %s", res, err, missing)
	}
	if n := e.count(`SELECT count(*) FROM redrive_grants`); n != 0 {
		t.Errorf("%d grants left after the failed redrive, want 0", n)
	}
	if left, err := q.Entries(ctx, dlq.Filter{}); err != nil || len(left) != 1 {
		t.Fatalf("the listing after the failed redrive: %d entries, %v; want the dead letter", len(left), err)
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	e.settledIn(e.dlq, 1)
}

// A listing of a quorum dead-letter queue of more messages than one
// prefetch can count (65,535) takes them all, each once, through a
// consumer per 65,535 on its channel, and gives them all back on Close.
// (With one consumer and no prefetch limit, RabbitMQ 3.10 handed over
// 2,000.)
func TestRabbitDeadLetterListingBeyondOnePrefetch(t *testing.T) {
	if testing.Short() {
		t.Skip("publishes 70,000 messages")
	}
	e := newRabbitEnv(t)
	ctx := t.Context()
	dq := testenv.UniqueName("oncely-rabbit-big.dlq")
	ch := e.channel()
	if _, err := ch.QueueDeclare(dq, true, false, false, false, amqp.Table{"x-queue-type": "quorum"}); err != nil {
		t.Fatal(err)
	}
	e.deleteAtEnd(dq)
	const n = 70_000
	now := time.Now()
	publishDeadLetters(t, ch, dq, e.queue, n, func(i int) (*dlq.Info, []byte) {
		id := "m" + strconv.Itoa(i)
		return &dlq.Info{Topic: e.queue, Group: "workers", MessageID: id, Attempts: 1,
			FirstFailure: now, LastFailure: now, Class: dlq.ClassPermanent, Error: "rejected", Timestamp: now}, []byte(id)
	})
	e.settledIn(dq, n)
	q, err := rabbitconsumer.OpenDeadLetters(ctx, rabbitURL, dq)
	if err != nil {
		t.Fatal(err)
	}
	all, err := q.Entries(ctx, dlq.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	ids := map[string]bool{}
	for _, en := range all {
		ids[en.Info.MessageID] = true
	}
	if len(all) != n || len(ids) != n {
		t.Fatalf("the listing took %d messages, %d distinct; want all %d", len(all), len(ids), n)
	}
	if err := q.Close(); err != nil {
		t.Fatal(err)
	}
	e.settledIn(dq, n)
}

// A handler's Enqueue inside the RabbitMQ consumer sends no NOTIFY in its
// transaction: the record path wakes the relays after the commit (the
// payload "consumer"), as the Kafka consumer does; in record and batch
// mode.
func TestRabbitWakesTheRelayAfterCommit(t *testing.T) {
	for _, size := range []int{1, 4} {
		t.Run(fmt.Sprintf("batch_size=%d", size), func(t *testing.T) {
			e := newRabbitEnv(t)
			h, listener := e.enqueueing()
			r := e.start(t.Context(), e.batchConfig(h, size))
			e.publish(e.queue, "order", "order-1", nil)
			listener.consumerWake(t)
			r.settled(t, 1)
			r.stop(t)
			e.empty(e.queue)
			e.effects(1)
		})
	}
}
