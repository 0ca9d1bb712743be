package integration_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.opentelemetry.io/otel/trace"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/internal/testhook"
	"github.com/oncely/oncely/outbox"
)

func (e *env) outbox(t *testing.T) *outbox.Outbox {
	t.Helper()
	o, err := outbox.New(outbox.Config{Schema: e.db.Schema, Shards: 16})
	if err != nil {
		t.Fatal(err)
	}
	return o
}

// startRelay runs a relay until the test ends; wait returns its Run error.
func (e *env) startRelay(ctx context.Context, t *testing.T, mutate func(*outbox.RelayConfig)) (r *outbox.Relay, wait func() error) {
	t.Helper()
	cfg := outbox.RelayConfig{Outbox: outbox.Config{Schema: e.db.Schema, Shards: 16}, Pool: e.db.Pool,
		Brokers: e.kafka.Brokers, PollInterval: 50 * time.Millisecond, RetryBaseDelay: 10 * time.Millisecond,
		RetryMaxDelay: 200 * time.Millisecond, ProduceTimeout: time.Second}
	if mutate != nil {
		mutate(&cfg)
	}
	r, err := outbox.NewRelay(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	var runErr error
	go func() { runErr = r.Run(ctx); close(done) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Error("relay did not stop")
		}
	})
	return r, func() error { <-done; return runErr }
}

// enqueue commits msgs in one transaction (or rolls it back).
func (e *env) enqueue(t *testing.T, ctx context.Context, commit bool, msgs ...outbox.Message) []outbox.Enqueued {
	t.Helper()
	tx, err := e.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	out, err := e.outbox(t).Enqueue(ctx, tx, msgs...)
	if err != nil {
		t.Fatal(err)
	}
	if commit {
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	return out
}

// readTopic consumes topic from the start until stop says enough.
func (e *env) readTopic(t *testing.T, topic string, stop func(recs []*kgo.Record) bool) []*kgo.Record {
	t.Helper()
	cl := e.kafka.Client(t, kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var recs []*kgo.Record
	for !stop(recs) {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("reading %s: timed out with %d records", topic, len(recs))
		}
		fs.EachRecord(func(r *kgo.Record) { recs = append(recs, r) })
	}
	return recs
}

func header(r *kgo.Record, k string) string {
	for _, h := range r.Headers {
		if h.Key == k {
			return string(h.Value)
		}
	}
	return ""
}

// A rolled-back transaction publishes nothing; a committed one publishes its
// messages with a UUIDv7 message-id and the enqueuer's trace context.
func TestOutboxPublishesOnlyCommitted(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx := context.Background()
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5}, TraceFlags: trace.FlagsSampled})
	tctx := trace.ContextWithSpanContext(ctx, sc)
	e.startRelay(ctx, t, nil)

	e.enqueue(t, tctx, false, outbox.Message{Topic: e.topic, Key: []byte("k"), Value: []byte("rolled-back")})
	want := e.enqueue(t, tctx, true,
		outbox.Message{Topic: e.topic, Key: []byte("k"), Value: []byte("one"), Headers: []outbox.Header{{Key: "type", Value: []byte("order.accepted")}}},
		outbox.Message{Topic: e.topic, Key: []byte("k"), Value: []byte("two")})
	e.readTopic(t, e.topic, func(r []*kgo.Record) bool { return len(r) >= 2 })
	// Give a wrongly published rolled-back message every chance to show up:
	// one more committed marker must be the third and last record.
	e.enqueue(t, ctx, true, outbox.Message{Topic: e.topic, Key: []byte("k"), Value: []byte("marker")})
	recs := e.readTopic(t, e.topic, func(r []*kgo.Record) bool { return len(r) >= 3 })
	if len(recs) != 3 || string(recs[0].Value) != "one" || string(recs[1].Value) != "two" || string(recs[2].Value) != "marker" {
		for _, r := range recs {
			t.Logf("record %q", r.Value)
		}
		t.Fatal("published records are not exactly the committed ones, in order")
	}
	for i, r := range recs[:2] {
		id, err := uuid.Parse(header(r, "message-id"))
		if err != nil || id.Version() != 7 || id.String() != want[i].MessageID {
			t.Errorf("record %d message-id %q (%v), want UUIDv7 %s", i, header(r, "message-id"), err, want[i].MessageID)
		}
		if tp := header(r, "traceparent"); tp != fmt.Sprintf("00-%s-%s-01", sc.TraceID(), sc.SpanID()) {
			t.Errorf("record %d traceparent %q", i, tp)
		}
	}
	if header(recs[0], "type") != "order.accepted" {
		t.Error("custom header lost")
	}
	// The relay marks rows sent right after the broker's ack.
	eventually(t, 10*time.Second, "status: 0 pending, 3 sent", func() bool {
		st, err := e.outbox(t).Status(ctx, e.db.Pool)
		return err == nil && st.Pending == 0 && st.Sent == 3 && st.OldestPending == 0
	})
}

// The relay dies after the broker acknowledged a batch and before marking it
// sent. The next relay republishes it with the same ids; a downstream oncely
// consumer applies each event once.
func TestRelayCrashBetweenProduceAndMark(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	ctx := context.Background()
	const n = 300
	var msgs []outbox.Message
	for i := range n {
		msgs = append(msgs, outbox.Message{Topic: e.topic, Key: []byte(fmt.Sprint("k", i%10)), Value: []byte(fmt.Sprint(i))})
	}
	e.enqueue(t, ctx, true, msgs...)

	var produced atomic.Int64
	hooks := &testhook.Relay{AfterProduce: func(n int) error {
		produced.Add(int64(n))
		return testhook.ErrCrash
	}}
	_, wait := e.startRelay(testhook.WithRelay(ctx, hooks), t, nil)
	if err := wait(); !errors.Is(err, testhook.ErrCrash) {
		t.Fatalf("first relay: %v, want the simulated crash", err)
	}
	st, _ := e.outbox(t).Status(ctx, e.db.Pool)
	if produced.Load() == 0 || st.Pending != n {
		t.Fatalf("after the crash: %d produced, status %+v; want some produced and all %d pending", produced.Load(), st, n)
	}
	relay, _ := e.startRelay(ctx, t, nil)
	c := e.start(ctx, e.config("down", recordEffect("down")))
	eventually(t, time.Minute, "every published record consumed downstream", func() bool {
		s := c.c.Stats()
		return relay.Stats().Published == n && s.Processed+s.Duplicates == n+produced.Load()
	})
	if s := c.c.Stats(); s.Processed != n || s.Duplicates != produced.Load() {
		t.Errorf("downstream %+v: want %d processed and the %d republished records skipped as duplicates (same message ids)",
			s, n, produced.Load())
	}
	e.assertExactlyOnce(t, n)
}

// Three relays over 20k messages on 200 keys, enqueued by concurrent
// transactions that commit out of id order: every message is published, and
// per key the messages arrive in commit order.
func TestThreeRelaysKeepPerKeyOrder(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 8)
	ctx := context.Background()
	if _, err := e.db.Pool.Exec(ctx, `CREATE TABLE key_seq (key text PRIMARY KEY, seq bigint NOT NULL);
		CREATE TABLE expected (message_id uuid PRIMARY KEY, key text NOT NULL, seq bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		e.startRelay(ctx, t, func(c *outbox.RelayConfig) { c.BatchSize = 200 })
	}
	const total, keys, workers, perTx = 20_000, 200, 8, 5
	ob := e.outbox(t)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for range total / workers / perTx {
				if err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
					var msgs []outbox.Message
					for range perTx {
						k := fmt.Sprint("key-", rng.IntN(keys))
						msgs = append(msgs, outbox.Message{Topic: e.topic, Key: []byte(k), Value: []byte(k)})
					}
					out, err := ob.Enqueue(ctx, tx, msgs...)
					if err != nil {
						return err
					}
					// The per-key counter is taken after Enqueue: if Enqueue did not
					// serialize same-key transactions, seq order could differ from id order.
					for i, m := range msgs {
						if _, err := tx.Exec(ctx, `INSERT INTO key_seq VALUES ($1, 1) ON CONFLICT (key) DO UPDATE SET seq = key_seq.seq + 1`, string(m.Key)); err != nil {
							return err
						}
						if _, err := tx.Exec(ctx, `INSERT INTO expected SELECT $2, $1, seq FROM key_seq WHERE key = $1`, string(m.Key), out[i].MessageID); err != nil {
							return err
						}
					}
					if rng.IntN(3) == 0 { // hold some transactions open so others commit past them
						time.Sleep(time.Duration(rng.IntN(2000)) * time.Microsecond)
					}
					return nil
				}); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()

	seen, read := map[string]bool{}, 0
	recs := e.readTopic(t, e.topic, func(r []*kgo.Record) bool {
		for ; read < len(r); read++ {
			seen[header(r[read], "message-id")] = true
		}
		return len(seen) >= total
	})
	seqOf := map[string]int64{}
	rows, _ := e.db.Pool.Query(ctx, `SELECT message_id::text, seq FROM expected`)
	var id string
	var seq int64
	if _, err := pgx.ForEachRow(rows, []any{&id, &seq}, func() error { seqOf[id] = seq; return nil }); err != nil {
		t.Fatal(err)
	}
	if len(seqOf) != total {
		t.Fatalf("%d expected rows, want %d", len(seqOf), total)
	}
	last := map[string]int64{}
	violations, dups := 0, 0
	applied := map[string]bool{}
	for _, r := range recs {
		id := header(r, "message-id")
		if applied[id] {
			dups++ // a republish: an oncely consumer would skip it
			continue
		}
		applied[id] = true
		k := string(r.Key)
		if s := seqOf[id]; s <= last[k] {
			violations++
		} else {
			last[k] = s
		}
	}
	if violations != 0 || len(applied) != total {
		t.Fatalf("%d per-key order violations, %d distinct messages of %d", violations, len(applied), total)
	}
	t.Logf("%d records read, %d distinct, %d republished duplicates, 0 order violations", len(recs), len(applied), dups)
}

// Kafka refuses every produce for a while: rows stay pending, then all are
// published once it recovers.
func TestRelaySurvivesKafkaOutage(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	if e.kafka.Cluster == nil {
		t.Skip("refusing produces needs the in-process kfake broker (KAFKA_BROKERS is set)")
	}
	ctx := context.Background()
	var down atomic.Bool
	down.Store(true)
	e.kafka.Cluster.ControlKey(kmsg.Produce.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		e.kafka.Cluster.KeepControl()
		if !down.Load() {
			return nil, nil, false
		}
		return produceFailed(req.(*kmsg.ProduceRequest), func(kmsg.ProduceRequestTopic) int16 { return kerr.NotEnoughReplicas.Code }), nil, true
	})
	relay, _ := e.startRelay(ctx, t, nil)
	const n = 500
	var msgs []outbox.Message
	for i := range n {
		msgs = append(msgs, outbox.Message{Topic: e.topic, Key: []byte(fmt.Sprint(i % 7)), Value: []byte(fmt.Sprint(i))})
	}
	e.enqueue(t, ctx, true, msgs...)
	eventually(t, time.Minute, "the relay to hit the outage", func() bool { return relay.Stats().ProduceErrors >= 2 })
	st, err := e.outbox(t).Status(ctx, e.db.Pool)
	if err != nil || st.Pending != n || st.OldestPending <= 0 {
		t.Fatalf("during the outage: %+v, %v; want %d pending with an age", st, err, n)
	}
	down.Store(false)
	eventually(t, time.Minute, "all published after recovery", func() bool {
		st, err := e.outbox(t).Status(ctx, e.db.Pool)
		return err == nil && st.Pending == 0
	})
	seen := map[string]bool{}
	e.readTopic(t, e.topic, func(r []*kgo.Record) bool {
		for _, rec := range r {
			seen[header(rec, "message-id")] = true
		}
		return len(seen) >= n
	})
	if len(seen) != n {
		t.Fatalf("%d distinct messages published, want %d", len(seen), n)
	}
}

// A handler enqueues follow-up events in its transaction: when it fails and
// rolls back the events vanish with it; when it commits they are published.
func TestHandlerEventsFollowItsTransaction(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	events := e.kafka.CreateTopic(t, "events", 1)
	ob := e.outbox(t)
	var calls atomic.Int64
	cfg := e.config("a", func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		v, _ := json.Marshal(map[string]string{"order": msg.ID})
		if _, err := ob.Enqueue(ctx, tx, outbox.Message{Topic: events, Key: []byte(msg.ID), Value: v}); err != nil {
			return err
		}
		if calls.Add(1) == 1 {
			return errors.New("first attempt fails after enqueuing")
		}
		return recordEffect("a")(ctx, tx, msg)
	})
	e.startRelay(ctx, t, nil)
	e.produce(t, []msg{{id: "o-1"}})
	c := e.start(ctx, cfg)
	eventually(t, time.Minute, "handled", func() bool { return c.c.Stats().Processed == 1 })
	// Same key, so the marker is published after anything enqueued before it.
	e.enqueue(t, ctx, true, outbox.Message{Topic: events, Key: []byte("o-1"), Value: []byte("marker")})
	recs := e.readTopic(t, events, func(r []*kgo.Record) bool { return len(r) >= 2 })
	if len(recs) != 2 || string(recs[0].Value) != `{"order":"o-1"}` || string(recs[1].Value) != "marker" {
		for _, r := range recs {
			t.Logf("event %s: %s", r.Key, r.Value)
		}
		t.Fatal("want exactly the committed attempt's event, then the marker")
	}
}

// TestBatchHandlersEventsFollowTheirRecords: in a batch, the events each
// record's handler enqueues are written with the batch (in batch mode, in
// one statement before it commits): a record that fails after enqueuing
// takes its event with it, and every record's event is published once, in
// the records' order. In every consumer mode.
func TestBatchHandlersEventsFollowTheirRecords(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	events := e.kafka.CreateTopic(t, "events", 1)
	ob := e.outbox(t)
	var failed atomic.Bool
	cfg := e.config("a", func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if _, err := ob.Enqueue(ctx, tx, outbox.Message{Topic: events, Key: []byte("k"), Value: []byte(msg.ID)}); err != nil {
			return err
		}
		if msg.ID == "o-7" && failed.CompareAndSwap(false, true) {
			return errors.New("fails once after enqueuing")
		}
		return recordEffect("a")(ctx, tx, msg)
	})
	const n = 20
	var msgs []msg
	for i := range n {
		msgs = append(msgs, msg{id: "o-" + itoa(i), key: "k"})
	}
	e.produce(t, msgs) // all there before the consumer starts: one batch in batch mode
	e.startRelay(ctx, t, nil)
	c := e.start(ctx, cfg)
	eventually(t, time.Minute, "handled", func() bool { return c.c.Stats().Processed == n })
	recs := e.readTopic(t, events, func(r []*kgo.Record) bool { return len(r) >= n })
	var got []string
	for _, r := range recs {
		got = append(got, string(r.Value))
	}
	var want []string
	for _, m := range msgs {
		want = append(want, m.id)
	}
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("events %v; want each record's once, in order: %v", got, want)
	}
}

// wakeListener LISTENs, on a connection of its own, on the outbox channel
// of a schema: it sees the wake-ups that relays would.
type wakeListener struct {
	conn   *pgx.Conn
	listen string // the LISTEN statement, as pg_stat_activity shows it
}

// wakeListenerApp is the application_name of a wakeListener's connection.
const wakeListenerApp = "wake-test-listener"

// listenForWakes starts listening on db's outbox channel; the connection
// is closed when the test ends.
func listenForWakes(t *testing.T, db *testenv.DB) *wakeListener {
	t.Helper()
	ctx := context.Background()
	cfg := db.Pool.Config().ConnConfig.Copy()
	cfg.RuntimeParams["application_name"] = wakeListenerApp
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	l := &wakeListener{conn: conn, listen: "LISTEN " + pgx.Identifier{"oncely_outbox_" + db.Schema}.Sanitize()}
	if _, err := conn.Exec(ctx, l.listen); err != nil {
		t.Fatal(err)
	}
	return l
}

// consumerWake waits for a consumer's wake-up, sent after its commit (the
// payload "consumer"), and fails the test if a notification sent inside a
// transaction (the payload "", delivered at its commit, so before the
// consumer's) comes first, or none comes within a minute.
func (l *wakeListener) consumerWake(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	n, err := l.conn.WaitForNotification(ctx)
	if err != nil {
		t.Fatalf("no wake-up from the consumer after the handler's commit: %v", err)
	}
	if n.Payload != "consumer" {
		t.Fatalf("notification %q before the consumer's wake-up: the handler's transaction notified", n.Payload)
	}
}

// enqueueingHandler enqueues the message's id to ob's topic, then runs h.
func enqueueingHandler(ob *outbox.Outbox, topic string, h consumer.Handler) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if _, err := ob.Enqueue(ctx, tx, outbox.Message{Topic: topic, Key: []byte(msg.ID), Value: []byte(msg.ID)}); err != nil {
			return err
		}
		return h(ctx, tx, msg)
	}
}

// TestConsumerWakesTheRelayAfterCommit: a handler's Enqueue inside a running
// consumer sends no NOTIFY in its transaction (whose commit would then take
// Postgres's database-wide notify lock and hold it through the commit's
// flush); the member sends the wake-up after the commit, with the payload
// "consumer". An in-transaction NOTIFY (payload "") would be delivered at
// the commit, before the member's. A relay that polls once an hour still
// publishes what the handler enqueued at once. In every consumer mode.
func TestConsumerWakesTheRelayAfterCommit(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	events := e.kafka.CreateTopic(t, "events", 1)
	listener := listenForWakes(t, e.db)
	e.produce(t, []msg{{id: "o-1"}})
	e.start(ctx, e.config("a", enqueueingHandler(e.outbox(t), events, recordEffect("a"))))
	listener.consumerWake(t)

	// A relay that would poll only hourly publishes a later event: woken.
	// A notification sent before its listener's LISTEN is lost (Postgres
	// keeps none for later listeners), so the record comes once it listens.
	e.startRelay(ctx, t, func(cfg *outbox.RelayConfig) { cfg.PollInterval = time.Hour })
	eventually(t, time.Minute, "the relay to listen", func() bool {
		return e.count(t, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND query = $1 AND application_name <> $2`, listener.listen, wakeListenerApp) == 1
	})
	e.produce(t, []msg{{id: "o-2"}})
	// The two events have different keys, so no order between them is
	// promised: the relay's first poll (o-1) may still be running on one
	// shard while the wake-up publishes o-2 on another.
	recs := e.readTopic(t, events, func(r []*kgo.Record) bool { return len(r) >= 2 })
	var got []string
	for _, r := range recs {
		got = append(got, string(r.Value))
	}
	if slices.Sort(got); !slices.Equal(got, []string{"o-1", "o-2"}) {
		t.Fatalf("events %q; want o-1 and o-2", got)
	}
}
