package integration_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/attribute"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dedup"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/internal/testhook"
	"github.com/oncely/oncely/natsconsumer"
	"github.com/oncely/oncely/outbox"
)

// natsURL is the JetStream server the tests use (.ci/run starts it).
const natsURL = "nats://127.0.0.1:4222"

// The NATS tests do not run in parallel with the rest: they finish before
// the parallel Kafka tests start, so that neither adds its load to the
// other's timing-bound checks (the relay's 1s ProduceTimeout among them).

// natsEnv is one test's JetStream stream, its dead-letter stream (both
// deleted when the test ends) and its Postgres schema with an effects table.
type natsEnv struct {
	sourceDB
	js      jetstream.JetStream
	stream  string // the stream; its subjects are stream + ".>"
	dlq     string // the dead-letter stream; subjects "dlq." + stream + ".>"
	subject string // the subject the tests publish to
}

func newNATSEnv(t *testing.T) *natsEnv {
	t.Helper()
	js, err := jetstream.New(natsConn(t))
	if err != nil {
		t.Fatal(err)
	}
	return newNATSEnvOn(t, js)
}

// newNATSEnvOn is newNATSEnv on the server of js.
func newNATSEnvOn(t *testing.T, js jetstream.JetStream) *natsEnv {
	t.Helper()
	ctx := t.Context()
	name := strings.ToUpper(strings.NewReplacer("-", "_", ".", "_").Replace(testenv.UniqueName("oncely")))
	e := &natsEnv{sourceDB: newSourceDB(t), js: js, stream: name, dlq: name + "_DLQ", subject: name + ".orders"}
	for stream, subject := range map[string]string{e.stream: name + ".>", e.dlq: "dlq." + name + ".>"} {
		if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subject}}); err != nil {
			t.Fatalf("create stream %s: %v", stream, err)
		}
		t.Cleanup(func() {
			dctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := js.DeleteStream(dctx, stream); err != nil {
				t.Errorf("delete stream %s: %v", stream, err)
			}
		})
	}
	return e
}

// natsConn is a connection of the test's own, closed when it ends.
func natsConn(t *testing.T) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(natsURL, nats.MaxReconnects(0))
	if err != nil {
		t.Fatalf("connect to NATS at %s (is nats-server -js running?): %v", natsURL, err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// config is a consumer of the test's stream on a connection of its own.
func (e *natsEnv) config(js jetstream.JetStream, h consumer.Handler) natsconsumer.Config {
	return natsconsumer.Config{
		JetStream: js, Stream: e.stream, Durable: "workers", Pool: e.db.Pool, Schema: e.db.Schema, Handler: h,
		RetryBaseDelay: 10 * time.Millisecond, RetryMaxDelay: 50 * time.Millisecond,
		AckWait: time.Second, ShutdownTimeout: 5 * time.Second,
	}
}

// ownJetStream is a JetStream context on a new connection: one process.
func (e *natsEnv) ownJetStream() (*nats.Conn, jetstream.JetStream) {
	nc := natsConn(e.t)
	js, err := jetstream.New(nc)
	if err != nil {
		e.t.Fatal(err)
	}
	return nc, js
}

// start runs a consumer of cfg until the test ends; the channel gets Run's
// error.
func (e *natsEnv) start(ctx context.Context, cfg natsconsumer.Config) (*natsconsumer.Consumer, <-chan error) {
	e.t.Helper()
	c, err := natsconsumer.New(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(ctx)
	done, stopped := make(chan error, 1), make(chan struct{})
	go func() {
		defer close(stopped)
		done <- c.Run(ctx)
	}()
	e.t.Cleanup(func() {
		cancel()
		select {
		case <-stopped:
		case <-time.After(15 * time.Second):
			e.t.Error("nats consumer did not stop")
		}
	})
	return c, done
}

// publish stores a message with headers and waits for its PubAck.
func (e *natsEnv) publish(subject, data string, headers map[string]string) {
	e.t.Helper()
	m := nats.NewMsg(subject)
	m.Data = []byte(data)
	for k, v := range headers {
		m.Header.Set(k, v)
	}
	if _, err := e.js.PublishMsg(e.t.Context(), m); err != nil {
		e.t.Fatal(err)
	}
}

// settled waits until the durable has no message pending or unacknowledged.
func (e *natsEnv) settled() {
	e.t.Helper()
	testenv.Eventually(e.t, 30*time.Second, "every message acknowledged or terminated", func() bool {
		c, err := e.js.Consumer(e.t.Context(), e.stream, "workers")
		if err != nil {
			return false
		}
		info, err := c.Info(e.t.Context())
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0 && info.NumRedelivered == 0
	})
}

// deadLetters waits for n messages in the dead-letter stream and returns them.
func (e *natsEnv) deadLetters(n int) []jetstream.Msg {
	e.t.Helper()
	c, err := e.js.CreateOrUpdateConsumer(e.t.Context(), e.dlq, jetstream.ConsumerConfig{AckPolicy: jetstream.AckNonePolicy})
	if err != nil {
		e.t.Fatal(err)
	}
	var out []jetstream.Msg
	deadline := time.Now().Add(30 * time.Second)
	for len(out) < n && time.Now().Before(deadline) {
		batch, err := c.Fetch(n-len(out), jetstream.FetchMaxWait(time.Second))
		if err != nil {
			e.t.Fatal(err)
		}
		for m := range batch.Messages() {
			out = append(out, m)
		}
	}
	if len(out) != n {
		e.t.Fatalf("%d dead letters, want %d", len(out), n)
	}
	return out
}

// 25 deliveries of one message id (a producer's duplicates: 25 stored
// messages, all with the same message-id header) run at once: one effect,
// 24 duplicates, every delivery acknowledged.
func TestNATSConcurrentDuplicatesOneEffect(t *testing.T) {
	e := newNATSEnv(t)
	for range 25 {
		e.publish(e.subject, "order", map[string]string{"message-id": "order-1"})
	}
	cfg := e.config(e.js, sourceEffect("a"))
	cfg.Concurrency = 25
	c, _ := e.start(t.Context(), cfg)
	e.settled()
	e.effects(1)
	if st := c.Stats(); st.Processed != 1 || st.Duplicates != 24 {
		t.Fatalf("processed %d, duplicates %d; want 1 and 24", st.Processed, st.Duplicates)
	}
}

// The process dies between COMMIT and the acknowledgement: JetStream
// delivers the message again to the next process, which finds the id in
// the inbox and runs no second effect.
func TestNATSCrashBetweenCommitAndAck(t *testing.T) {
	e := newNATSEnv(t)
	e.publish(e.subject, "order", map[string]string{nats.MsgIdHdr: "order-1"})

	nc1, js1 := e.ownJetStream()
	crashed := false
	ctx := testhook.WithConsumer(t.Context(), &testhook.Consumer{AfterCommit: func(*kgo.Record) error {
		crashed = true
		return testhook.ErrCrash
	}})
	_, done := e.start(ctx, e.config(js1, sourceEffect("first")))
	select {
	case err := <-done:
		if !errors.Is(err, testhook.ErrCrash) || !crashed {
			t.Fatalf("first process: %v, want the simulated crash", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("first process did not crash")
	}
	nc1.Close() // the process is gone with its connection

	_, js2 := e.ownJetStream()
	second, _ := e.start(t.Context(), e.config(js2, sourceEffect("second")))
	e.settled()
	e.effects(1)
	if n := e.count(`SELECT count(*) FROM effects WHERE member = 'first'`); n != 1 {
		t.Fatalf("the crashed process's effect is missing (%d)", n)
	}
	if st := second.Stats(); st.Duplicates != 1 || st.Processed != 0 {
		t.Fatalf("second process: processed %d, duplicates %d; want 0 and 1", st.Processed, st.Duplicates)
	}
}

// Two processes run one message id at the same time (a producer's
// duplicate, one copy each): the second's claim waits on the first's
// transaction, and only one effect happens.
func TestNATSTwoConsumersRaceOneEffect(t *testing.T) {
	e := newNATSEnv(t)
	e.publish(e.subject, "order", map[string]string{"message-id": "order-1"})
	e.publish(e.subject, "order", map[string]string{"message-id": "order-1"})

	var first atomic.Bool
	h := func(member string) consumer.Handler {
		return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			if first.CompareAndSwap(false, true) {
				e.waitForBlockedClaim() // the other process's claim waits on ours
			}
			return sourceEffect(member)(ctx, tx, msg)
		}
	}
	var cs []*natsconsumer.Consumer
	for _, member := range []string{"a", "b"} {
		_, js := e.ownJetStream()
		cfg := e.config(js, h(member))
		cfg.FetchAhead = -1 // each process holds one message: the one it runs
		c, _ := e.start(t.Context(), cfg)
		cs = append(cs, c)
	}
	e.settled()
	e.effects(1)
	a, b := cs[0].Stats(), cs[1].Stats()
	if a.Processed+b.Processed != 1 || a.Duplicates+b.Duplicates != 1 {
		t.Fatalf("processed %d+%d, duplicates %d+%d; want 1 and 1", a.Processed, b.Processed, a.Duplicates, b.Duplicates)
	}
}

// A poison message (the handler's dlq.Permanent error) goes to the
// dead-letter stream at once, with its data, its headers and its
// provenance, is recorded as dead-lettered, and the original is terminated.
func TestNATSPoisonToDeadLetterStream(t *testing.T) {
	e := newNATSEnv(t)
	e.publish(e.subject, "not an order", map[string]string{nats.MsgIdHdr: "poison-1", "tenant": "acme"})
	var runs atomic.Int32
	_, _ = e.start(t.Context(), e.config(e.js, func(context.Context, pgx.Tx, *consumer.Message) error {
		runs.Add(1)
		return dlq.Permanent(errors.New("order has no id"))
	}))
	out := e.deadLetters(1)[0]
	e.settled()
	want := map[string]string{
		natsconsumer.HeaderStream: e.stream, natsconsumer.HeaderSubject: e.subject,
		natsconsumer.HeaderSequence: "1", natsconsumer.HeaderDeliveryCount: "1", natsconsumer.HeaderConsumer: "workers",
		dlq.HeaderErrorClass: string(dlq.ClassPermanent), dlq.HeaderMessageID: "poison-1", dlq.HeaderAttempts: "1",
		dlq.HeaderGroup: "workers", "tenant": "acme",
	}
	for k, v := range want {
		if got := out.Headers().Get(k); got != v {
			t.Errorf("dead letter header %s = %q, want %q", k, got, v)
		}
	}
	if got := out.Headers().Get(dlq.HeaderError); !strings.Contains(got, "order has no id") {
		t.Errorf("dead letter error header %q", got)
	}
	if string(out.Data()) != "not an order" || out.Subject() != "dlq."+e.subject {
		t.Errorf("dead letter %q on %s", out.Data(), out.Subject())
	}
	if runs.Load() != 1 {
		t.Errorf("handler ran %d times, want 1", runs.Load())
	}
	if n := e.count(`SELECT count(*) FROM inbox WHERE message_id = 'poison-1' AND outcome = 'dead_lettered'`); n != 1 {
		t.Errorf("inbox holds the dead letter %d times, want 1", n)
	}
}

// A handler that keeps failing is handed back with NakWithDelay; each
// redelivery's attempt is JetStream's delivery count, and the MaxAttempts-th
// failure dead-letters the message (class max_attempts).
func TestNATSRetriesThenDeadLetter(t *testing.T) {
	e := newNATSEnv(t)
	e.publish(e.subject, "order", map[string]string{nats.MsgIdHdr: "flaky-1"})
	var mu sync.Mutex
	var attempts []int
	cfg := e.config(e.js, func(_ context.Context, _ pgx.Tx, msg *consumer.Message) error {
		mu.Lock()
		attempts = append(attempts, msg.Attempt)
		mu.Unlock()
		return errors.New("payment service unavailable")
	})
	cfg.MaxAttempts = 3
	c, _ := e.start(t.Context(), cfg)
	out := e.deadLetters(1)[0]
	e.settled()
	mu.Lock()
	defer mu.Unlock()
	if len(attempts) != 3 || attempts[0] != 1 || attempts[1] != 2 || attempts[2] != 3 {
		t.Fatalf("handler attempts %v, want [1 2 3]", attempts)
	}
	for k, v := range map[string]string{dlq.HeaderErrorClass: string(dlq.ClassMaxAttempts), dlq.HeaderAttempts: "3",
		natsconsumer.HeaderDeliveryCount: "3"} {
		if got := out.Headers().Get(k); got != v {
			t.Errorf("dead letter header %s = %q, want %q", k, got, v)
		}
	}
	if st := c.Stats(); st.Retries != 2 || st.DeadLettered != 1 {
		t.Errorf("retries %d, dead-lettered %d; want 2 and 1", st.Retries, st.DeadLettered)
	}
}

// A message whose attempts never reach a verdict (the process is stopped
// mid-handler, each time past its ShutdownTimeout) is delivered again with
// a higher delivery count; the delivery after MaxAttempts dead-letters it as
// a crash loop without running the handler again.
func TestNATSCrashLoopAcrossRestarts(t *testing.T) {
	e := newNATSEnv(t)
	e.publish(e.subject, "order", map[string]string{nats.MsgIdHdr: "killer-1"})
	const maxAttempts = 2
	var runs atomic.Int32
	for i := range maxAttempts {
		nc, js := e.ownJetStream()
		entered := make(chan struct{})
		cfg := e.config(js, func(ctx context.Context, _ pgx.Tx, _ *consumer.Message) error {
			runs.Add(1)
			close(entered)
			<-ctx.Done() // never finishes: only the process's end stops it
			return ctx.Err()
		})
		cfg.MaxAttempts, cfg.ShutdownTimeout = maxAttempts, 10*time.Millisecond
		ctx, cancel := context.WithCancel(t.Context())
		_, done := e.start(ctx, cfg)
		select {
		case <-entered:
		case <-time.After(30 * time.Second):
			t.Fatalf("process %d never ran the handler", i)
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("process %d stopped with %v", i, err)
		}
		nc.Close()
	}
	_, js := e.ownJetStream()
	cfg := e.config(js, sourceEffect("last"))
	cfg.MaxAttempts = maxAttempts
	c, _ := e.start(t.Context(), cfg)
	out := e.deadLetters(1)[0]
	e.settled()
	if got := out.Headers().Get(dlq.HeaderErrorClass); got != string(dlq.ClassCrashLoop) {
		t.Errorf("class %q, want crash_loop", got)
	}
	if got := out.Headers().Get(natsconsumer.HeaderDeliveryCount); got != strconv.Itoa(maxAttempts+1) {
		t.Errorf("delivery count %q, want %d", got, maxAttempts+1)
	}
	if runs.Load() != maxAttempts || e.count(`SELECT count(*) FROM effects`) != 0 {
		t.Errorf("handler runs %d (want %d), effects %d (want 0)", runs.Load(), maxAttempts, e.count(`SELECT count(*) FROM effects`))
	}
	if st := c.Stats(); st.CrashLoops != 1 {
		t.Errorf("crash loops %d, want 1", st.CrashLoops)
	}
}

// The producer's trace context travels in NATS headers: the attempt's
// "process <subject>" span continues it, with messaging.system=nats and the
// messaging attributes.
func TestNATSTraceContext(t *testing.T) {
	e := newNATSEnv(t)
	p := newTracedProducer(t)
	e.publish(e.subject, "order", map[string]string{nats.MsgIdHdr: "traced-1", "traceparent": p.traceparent})

	cfg := e.config(e.js, sourceEffect("a"))
	cfg.TracerProvider = p.tp
	_, _ = e.start(t.Context(), cfg)
	e.settled()
	got := p.processSpan(t, "process "+e.subject, map[attribute.Key]string{
		"messaging.system": "nats", "messaging.destination.name": e.subject, "messaging.consumer.group.name": "workers",
		"messaging.message.id": "traced-1", "messaging.operation.type": "process", "oncely.dedup.outcome": "new",
	})
	if _, kafka := got["messaging.kafka.offset"]; kafka {
		t.Error("a NATS span carries messaging.kafka.offset")
	}
}

// Run fails at start-up, naming what is wrong, when no stream captures the
// dead-letter subject or the stream does not exist: a dead letter could
// never be published, and the message would wait for ever.
func TestNATSStartupChecks(t *testing.T) {
	e := newNATSEnv(t)
	for what, cfg := range map[string]natsconsumer.Config{
		"DeadLetterSubject": func() natsconsumer.Config {
			cfg := e.config(e.js, sourceEffect("a"))
			cfg.DeadLetterSubject = func(subject string) string { return "nowhere." + subject }
			return cfg
		}(),
		"NO_SUCH_STREAM": func() natsconsumer.Config {
			cfg := e.config(e.js, sourceEffect("a"))
			cfg.Stream = "NO_SUCH_STREAM"
			return cfg
		}(),
	} {
		c, err := natsconsumer.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		failsAtStart(t, what, c.Run)
	}
}

// The outbox relay publishes to JetStream with Nats-Msg-Id set to each
// row's message id. A relay that dies after the PubAcks and before marking
// the rows sent is followed by one that publishes them again: JetStream's
// duplicate window stores each message once, in enqueue order per key.
func TestNATSRelayPublishesWithMessageIDs(t *testing.T) {
	e := newNATSEnv(t)
	ctx := t.Context()
	const n = 20
	ids, _ := relayRepublishes(t, e.db, natsconsumer.JetStreamPublisher{JetStream: e.js}, e.subject, n)

	stream, err := e.js.Stream(ctx, e.stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != n {
		t.Fatalf("stream holds %d messages, want %d: the republish was not deduplicated", info.State.Msgs, n)
	}
	// Per key, the stored order is the enqueue order; every id once.
	byKey := map[string][]string{}
	for seq := range uint64(n) {
		m, err := stream.GetMsg(ctx, seq+1)
		if err != nil {
			t.Fatal(err)
		}
		key := m.Header.Get(natsconsumer.HeaderKey)
		byKey[key] = append(byKey[key], m.Header.Get(nats.MsgIdHdr))
	}
	for k := range 2 {
		key := "k" + strconv.Itoa(k)
		var want []string
		for i := k; i < n; i += 2 {
			want = append(want, ids[i])
		}
		if !slices.Equal(byKey[key], want) {
			t.Errorf("key %s: stored ids %v, want %v (enqueue order, each once)", key, byKey[key], want)
		}
	}
}

// A dead letter of the JetStream stream is listed from its dead-letter
// stream (natsconsumer.DeadLetters, the filters of package dlq), a dry run
// publishes nothing, and a redrive runs the message exactly once more,
// seconds after the original: the redriven copy carries no Nats-Msg-Id, so
// JetStream's duplicate window, which still holds the original's id, keeps
// it. A second redrive of the same dead letter is skipped as processed.
func TestNATSDeadLettersRedriveOnce(t *testing.T) {
	e := newNATSEnv(t)
	ctx := t.Context()
	e.publish(e.subject, "bad", map[string]string{nats.MsgIdHdr: "poison-1", "tenant": "acme"})
	e.publish(e.subject, "good", map[string]string{nats.MsgIdHdr: "good-1"})
	var fixed atomic.Bool
	var runs atomic.Int32
	_, _ = e.start(ctx, e.config(e.js, func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		runs.Add(1)
		if string(msg.Value) == "bad" && !fixed.Load() {
			return dlq.Permanent(errors.New("order has no id"))
		}
		return sourceEffect("w")(ctx, tx, msg)
	}))
	e.deadLetters(1)
	e.settled()

	all, err := natsconsumer.DeadLetters(ctx, e.js, e.dlq, dlq.Filter{})
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 1 || all[0].Info == nil || all[0].Info.MessageID != "poison-1" || all[0].Info.Topic != e.subject ||
		all[0].Info.Class != dlq.ClassPermanent || all[0].Ref() != "dlq."+e.subject+"/0/1" {
		t.Fatalf("dead letters %+v, want poison-1 of %s at dlq.%s/0/1", all, e.subject, e.subject)
	}
	if none, err := natsconsumer.DeadLetters(ctx, e.js, e.dlq, dlq.Filter{MessageID: "good-1"}); err != nil || len(none) != 0 {
		t.Fatalf("filter by another id: %d entries, %v", len(none), err)
	}
	if byClass, err := natsconsumer.DeadLetters(ctx, e.js, e.dlq, dlq.Filter{Class: dlq.ClassPermanent, Refs: []string{"0/1"}}); err != nil || len(byClass) != 1 {
		t.Fatalf("filter by class and ref: %d entries, %v", len(byClass), err)
	}

	inbox, err := dedup.New(dedup.Config{Schema: e.db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	opts := dlq.RedriveOptions{Inbox: inbox, DB: e.db.Pool}
	dry := opts
	dry.DryRun = true
	res, err := natsconsumer.Redrive(ctx, e.js, all, dry)
	if err != nil || len(res) != 1 || res[0].Action != dlq.WouldRedrive {
		t.Fatalf("dry run: %+v, %v", res, err)
	}
	if n := streamMsgs(t, e.js, e.stream); n != 2 {
		t.Fatalf("the dry run published: the stream holds %d messages, want 2", n)
	}

	fixed.Store(true)
	res, err = natsconsumer.Redrive(ctx, e.js, all, opts)
	if err != nil || len(res) != 1 || res[0].Action != dlq.Redriven || res[0].Topic != e.subject || res[0].Offset != 3 {
		t.Fatalf("redrive: %+v, %v; want redriven to %s at sequence 3", res, err, e.subject)
	}
	testenv.Eventually(t, 30*time.Second, "the redriven message's effect", func() bool {
		return e.count(`SELECT count(*) FROM effects WHERE message_id = 'poison-1'`) == 1
	})
	e.settled()
	if n := e.count(`SELECT count(*) FROM inbox WHERE message_id = 'poison-1' AND outcome = 'processed'`); n != 1 {
		t.Errorf("inbox: poison-1 processed %d times, want 1", n)
	}

	res, err = natsconsumer.Redrive(ctx, e.js, all, opts)
	if err != nil || len(res) != 1 || res[0].Action != dlq.SkipProcessed {
		t.Fatalf("second redrive: %+v, %v; want skipped as processed", res, err)
	}
	e.settled()
	e.effects(2) // good-1 and the redriven poison-1, once each
	if n := runs.Load(); n != 3 {
		t.Errorf("handler ran %d times, want 3 (good-1, poison-1, its redrive)", n)
	}
}

// streamMsgs is the number of messages stored in stream.
func streamMsgs(t *testing.T, js jetstream.JetStream, stream string) uint64 {
	t.Helper()
	s, err := js.Stream(t.Context(), stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return info.State.Msgs
}

// `oncely dlq list|show|redrive --stream` works on a JetStream dead-letter
// stream as on a Kafka topic: the dead letter listed (and in --json), shown
// by 0/sequence, redriven once with its grant in the consumers' database,
// and a stream of other messages refused.
func TestNATSCLIDeadLetters(t *testing.T) {
	e := newNATSEnv(t)
	ctx := t.Context()
	oncely := oncelyCLI(t)
	e.publish(e.subject, "bad", map[string]string{nats.MsgIdHdr: "poison-1"})
	var fixed atomic.Bool
	_, _ = e.start(ctx, e.config(e.js, func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if !fixed.Load() {
			return dlq.Permanent(errors.New("rejected by v1"))
		}
		return sourceEffect("w")(ctx, tx, msg)
	}))
	e.deadLetters(1)
	e.settled()

	stream := []string{"--nats", natsURL, "--stream", e.dlq}
	code, out, errs := oncely(t, append([]string{"dlq", "list"}, stream...)...)
	if code != 0 || !strings.Contains(out, "poison-1") || !strings.Contains(out, "permanent") || !strings.Contains(out, "0/1") {
		t.Fatalf("dlq list: exit %d\n%s\n%s", code, out, errs)
	}
	code, out, errs = oncely(t, append([]string{"dlq", "list", "--json", "--class", "max_attempts"}, stream...)...)
	if code != 0 || out != "" {
		t.Fatalf("dlq list --class max_attempts: exit %d\n%s\n%s, want no JSON line", code, out, errs)
	}
	code, out, errs = oncely(t, append([]string{"dlq", "list", "--json", "--class", "permanent"}, stream...)...)
	if code != 0 || strings.Count(out, "\n") != 1 || !strings.Contains(out, `"message_id":"poison-1"`) {
		t.Fatalf("dlq list --json --class permanent: exit %d\n%s\n%s, want one JSON line", code, out, errs)
	}
	code, out, errs = oncely(t, append([]string{"dlq", "show", "0/1"}, stream...)...)
	if code != 0 || !strings.Contains(out, "rejected by v1") || !strings.Contains(out, e.subject) {
		t.Fatalf("dlq show 0/1: exit %d\n%s\n%s", code, out, errs)
	}
	code, out, errs = oncely(t, "dlq", "list", "--nats", natsURL, "--stream", e.stream)
	if code == 0 || !strings.Contains(errs, "is not a dead-letter stream") {
		t.Fatalf("dlq list of the source stream: exit %d\n%s\n%s, want a refusal", code, out, errs)
	}

	fixed.Store(true)
	db := []string{"--database-url", e.db.URL, "--schema", e.db.Schema}
	code, out, errs = oncely(t, append(append([]string{"dlq", "redrive", "--all"}, stream...), db...)...)
	if code != 0 || !strings.Contains(out, "1 redriven") {
		t.Fatalf("dlq redrive: exit %d\n%s\n%s", code, out, errs)
	}
	testenv.Eventually(t, 30*time.Second, "the redriven message's effect", func() bool {
		return e.count(`SELECT count(*) FROM effects WHERE message_id = 'poison-1'`) == 1
	})
	e.settled()
	code, out, errs = oncely(t, append(append([]string{"dlq", "redrive", "--all"}, stream...), db...)...)
	if code != 0 || !strings.Contains(out, "1 skipped (processed)") {
		t.Fatalf("second dlq redrive: exit %d\n%s\n%s", code, out, errs)
	}
	e.settled()
	e.effects(1)
}

// relayRepublishes enqueues n rows to topic (keys k0 and k1 in turn) and
// relays them with pub: a first relay dies after its first batch's
// confirmation, before marking it sent; a second publishes every row. It
// returns the rows' message ids in enqueue order and how many rows the
// first relay published (published again by the second).
func relayRepublishes(t *testing.T, db *testenv.DB, pub outbox.Publisher, topic string, n int) (ids []string, republished int64) {
	t.Helper()
	ctx := t.Context()
	ob, err := outbox.New(outbox.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		out, err := ob.Enqueue(ctx, tx, outbox.Message{Topic: topic, Key: []byte("k" + strconv.Itoa(i%2)), Value: []byte(strconv.Itoa(i))})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, out[0].MessageID)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	relay := func(ctx context.Context) (*outbox.Relay, <-chan error) {
		r, err := outbox.NewRelay(outbox.RelayConfig{Outbox: outbox.Config{Schema: db.Schema}, Pool: db.Pool,
			Publisher: pub, PollInterval: 50 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- r.Run(ctx) }()
		return r, done
	}
	var published atomic.Int64
	_, done := relay(testhook.WithRelay(ctx, &testhook.Relay{AfterProduce: func(k int) error {
		published.Add(int64(k))
		return testhook.ErrCrash
	}}))
	if err := <-done; !errors.Is(err, testhook.ErrCrash) || published.Load() == 0 {
		t.Fatalf("first relay: %v after %d published, want the simulated crash after a batch", err, published.Load())
	}
	rctx, cancel := context.WithCancel(ctx)
	second, done := relay(rctx)
	testenv.Eventually(t, 30*time.Second, "the second relay to publish every row", func() bool {
		return second.Stats().Published == int64(n)
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	return ids, published.Load()
}

// A handler's Enqueue inside the JetStream consumer sends no NOTIFY in its
// transaction: the record path wakes the relays after the commit (the
// payload "consumer"), as the Kafka consumer does; in record and batch
// mode.
func TestNATSWakesTheRelayAfterCommit(t *testing.T) {
	for _, size := range []int{1, 4} {
		t.Run(fmt.Sprintf("batch_size=%d", size), func(t *testing.T) {
			e := newNATSEnv(t)
			h, listener := e.enqueueing()
			e.start(t.Context(), e.batchConfig(e.js, h, size))
			e.publish(e.subject, "order", map[string]string{nats.MsgIdHdr: "order-1"})
			listener.consumerWake(t)
			e.settled()
			e.effects(1)
		})
	}
}
