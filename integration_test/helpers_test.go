package integration_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/sqlident"
	"github.com/oncely/oncely/internal/telemetry"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/migrations"
)

func TestMain(m *testing.M) { os.Exit(testenv.Main(m)) }

// env is one test's services: its own schema and Kafka topic.
type env struct {
	t     *testing.T
	db    *testenv.DB
	kafka *testenv.Kafka
	topic string
	group string
	dlqID [16]byte // the dead-letter topic's id
}

func newEnv(t *testing.T, partitions int32) *env {
	t.Helper()
	return newEnvWithKafka(t, partitions)
}

// newEnvWithKafka is newEnv with options for the in-process kfake cluster.
func newEnvWithKafka(t *testing.T, partitions int32, opts ...kfake.Opt) *env {
	t.Helper()
	db := testenv.Postgres(t)
	ctx := context.Background()
	m, err := migrations.New(db.Pool, migrations.Config{Schema: db.Schema})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Up(ctx); err != nil {
		t.Fatal(err)
	}
	// The effect table: one row per handler run that committed. Like the
	// orderworker's tables it has no unique constraint, so only the inbox
	// keeps effects single.
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE effects (
		seq bigserial PRIMARY KEY, message_id text NOT NULL, partition int NOT NULL,
		"offset" bigint NOT NULL, member text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return newKafkaEnv(t, db, testenv.NewKafka(t, opts...), partitions)
}

// newKafkaEnv creates the env's topic on k, and its dead-letter topic: the
// consumer checks at start-up that both exist.
func newKafkaEnv(t *testing.T, db *testenv.DB, k *testenv.Kafka, partitions int32) *env {
	t.Helper()
	topic := k.CreateTopic(t, "orders", partitions)
	return &env{t: t, db: db, kafka: k, topic: topic, group: testenv.UniqueName("g"),
		dlqID: k.CreateTopicNamed(t, dlq.DefaultTopic(topic), 1)}
}

// config returns a consumer config for the env with fast retries.
func (e *env) config(member string, h consumer.Handler) consumer.Config {
	var logger *slog.Logger
	var opts []kgo.Opt
	if os.Getenv("ONCELY_TEST_LOG") != "" { // debugging aid: consumer and franz-go logs on stderr
		logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})).With("member", member)
		opts = append(opts, kgo.WithLogger(kgo.BasicLogger(os.Stderr, kgo.LogLevelInfo, func() string { return member + " " })))
	}
	cfg := consumer.Config{
		Logger:         logger,
		ClientOpts:     opts,
		Brokers:        e.kafka.Brokers,
		Topics:         []string{e.topic},
		Group:          e.group,
		Pool:           e.db.Pool,
		Schema:         e.db.Schema,
		Handler:        h,
		RetryBaseDelay: 5 * time.Millisecond,
		RetryMaxDelay:  50 * time.Millisecond,
		CommitInterval: 100 * time.Millisecond,
		SessionTimeout: 6 * time.Second,
	}
	consumerMode.apply(&cfg)
	return cfg
}

// mode is one of the consumer's processing modes. The whole suite runs in
// the mode named by ONCELY_CONSUMER_MODE (record, batch or perkey; default
// record), so every exactly-once test covers every mode: `make test-modes`.
type mode struct {
	name           string
	batchSize      int
	keyParallelism int
}

var modes = map[string]mode{
	"record": {name: "record"},
	"batch":  {name: "batch", batchSize: 64},
	"perkey": {name: "perkey", keyParallelism: 8},
}

var consumerMode = func() mode {
	name := os.Getenv("ONCELY_CONSUMER_MODE")
	if name == "" {
		return modes["record"]
	}
	m, ok := modes[name]
	if !ok {
		panic(fmt.Sprintf("ONCELY_CONSUMER_MODE=%q: want record, batch or perkey", name))
	}
	return m
}()

func (m mode) apply(cfg *consumer.Config) {
	cfg.BatchSize = m.batchSize
	cfg.KeyParallelism = m.keyParallelism
}

// recordEffect is the effect every test handler applies: one row.
func recordEffect(member string) consumer.Handler {
	return func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		_, err := tx.Exec(ctx, `INSERT INTO effects (message_id, partition, "offset", member) VALUES ($1, $2, $3, $4)`,
			msg.ID, msg.Partition, msg.Offset, member)
		return err
	}
}

// member is a running consumer.
type member struct {
	c      *consumer.Consumer
	cancel context.CancelFunc
	done   chan error
}

func (e *env) start(ctx context.Context, cfg consumer.Config) *member {
	e.t.Helper()
	c, err := consumer.New(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(ctx)
	m := &member{c: c, cancel: cancel, done: make(chan error, 1)}
	go func() { m.done <- c.Run(ctx) }()
	e.t.Cleanup(func() {
		cancel()
		select {
		case err := <-m.done:
			_ = err // the test asserted on Run's error already, if it cared
		case <-time.After(30 * time.Second):
			e.t.Error("consumer did not stop within 30s of cleanup")
		}
	})
	return m
}

// await waits for ch to close, failing the test if Run returns first.
func (m *member) await(t *testing.T, ch <-chan struct{}) {
	t.Helper()
	select {
	case <-ch:
	case err := <-m.done:
		m.done <- err
		t.Fatalf("consumer.Run returned early: %v", err)
	case <-time.After(time.Minute):
		t.Fatal("timed out waiting for the handler")
	}
}

// stop cancels the member and returns Run's error.
func (m *member) stop(t *testing.T) error {
	t.Helper()
	m.cancel()
	return m.wait(t, 20*time.Second)
}

func (m *member) wait(t *testing.T, d time.Duration) error {
	t.Helper()
	select {
	case err := <-m.done:
		m.done <- err // keep it for cleanup
		return err
	case <-time.After(d):
		t.Fatalf("consumer.Run did not return within %s", d)
		return nil
	}
}

// msg is a record to produce: a message id header, a partition and a key
// (none when empty).
type msg struct {
	id        string
	partition int32
	key       string
}

func (e *env) produce(t *testing.T, msgs []msg) {
	t.Helper()
	cl := e.kafka.Client(t, kgo.RecordPartitioner(kgo.ManualPartitioner()), kgo.ProducerLinger(0))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const chunk = 1000
	for i := 0; i < len(msgs); i += chunk {
		var recs []*kgo.Record
		for _, m := range msgs[i:min(i+chunk, len(msgs))] {
			rec := &kgo.Record{
				Topic: e.topic, Partition: m.partition, Value: []byte(m.id),
				Headers: []kgo.RecordHeader{{Key: "message-id", Value: []byte(m.id)}},
			}
			if m.key != "" {
				rec.Key = []byte(m.key)
			}
			recs = append(recs, rec)
		}
		if err := cl.ProduceSync(ctx, recs...).FirstErr(); err != nil {
			t.Fatalf("produce: %v", err)
		}
	}
}

// count runs a count query.
func (e *env) count(t *testing.T, sql string, args ...any) int64 {
	t.Helper()
	var n int64
	if err := e.db.Pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// eventually polls cond until it holds or d passes.
func eventually(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	testenv.Eventually(t, d, what, cond)
}

// committedLag returns, summed over partitions, end offset minus the group's
// committed offset.
func (e *env) committedLag(t *testing.T) int64 {
	t.Helper()
	adm := kadm.NewClient(e.kafka.Client(t))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ends, err := adm.ListEndOffsets(ctx, e.topic)
	if err != nil {
		t.Fatal(err)
	}
	committed, err := adm.FetchOffsets(ctx, e.group)
	if err != nil {
		t.Fatal(err)
	}
	var lag int64
	ends.Each(func(o kadm.ListedOffset) {
		c, ok := committed.Lookup(o.Topic, o.Partition)
		at := int64(0)
		if ok {
			at = c.At
		}
		lag += o.Offset - at
	})
	return lag
}

// committedOffset returns the group's committed offset of one partition (0 if none).
func (e *env) committedOffset(t *testing.T, partition int32) int64 {
	t.Helper()
	adm := kadm.NewClient(e.kafka.Client(t))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	committed, err := adm.FetchOffsets(ctx, e.group)
	if err != nil {
		t.Fatal(err)
	}
	if c, ok := committed.Lookup(e.topic, partition); ok {
		return c.At
	}
	return 0
}

// uniqueMsgs returns n messages with ids prefix-0.. spread over partitions.
func uniqueMsgs(prefix string, n int, partitions int32) []msg {
	out := make([]msg, n)
	for i := range out {
		out[i] = msg{id: fmt.Sprintf("%s-%d", prefix, i), partition: int32(i) % partitions,
			key: fmt.Sprintf("key-%d", keyOf(i, partitions))}
	}
	return out
}

// keyOf is the key uniqueMsgs gives its i-th message: 16 keys per
// partition, so that per-key mode has work to run side by side.
func keyOf(i int, partitions int32) int { return (i / int(partitions)) % 16 }

// assertExactlyOnce checks that every id has exactly one effect.
func (e *env) assertExactlyOnce(t *testing.T, want int64) {
	t.Helper()
	if n := e.count(t, `SELECT count(*) FROM effects`); n != want {
		t.Errorf("effects = %d, want %d", n, want)
	}
	if n := e.count(t, `SELECT count(DISTINCT message_id) FROM effects`); n != want {
		t.Errorf("distinct ids with an effect = %d, want %d", n, want)
	}
	if n := e.count(t, `SELECT count(*) FROM (SELECT 1 FROM effects GROUP BY message_id HAVING count(*) > 1) d`); n != 0 {
		t.Errorf("%d ids have more than one effect", n)
	}
}

// gate blocks handlers until released.
type gate struct {
	once    sync.Once
	release chan struct{}
}

func newGate() *gate  { return &gate{release: make(chan struct{})} }
func (g *gate) open() { g.once.Do(func() { close(g.release) }) }
func (g *gate) wait() { <-g.release }

func itoa(i int) string { return fmt.Sprint(i) }

// injectInto writes ctx's trace context into rec's headers, as an
// instrumented producer would.
func injectInto(ctx context.Context, rec *kgo.Record) { telemetry.Inject(ctx, &rec.Headers) }

// waitForBlockedClaim waits until an inbox claim in this test's schema is
// blocked on another transaction's row lock: two deliveries really race.
func (e *env) waitForBlockedClaim(t *testing.T) {
	t.Helper()
	pattern := "INSERT INTO " + sqlident.Table(e.db.Schema, "inbox") + "%"
	eventually(t, 30*time.Second, "an inbox claim to wait on another transaction", func() bool {
		return e.count(t, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1`, pattern) > 0
	})
}

// pollFor calls cond every 100ms until it returns true, up to timeout;
// past it, an error naming what. For goroutines other than the test's,
// which may not fail the test with Fatal.
func pollFor(timeout time.Duration, what string, cond func() bool) error {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-deadline.C:
			return fmt.Errorf("waited %s for %s", timeout, what)
		case <-tick.C:
		}
	}
	return nil
}
