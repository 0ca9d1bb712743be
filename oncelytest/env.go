package oncelytest

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/migrations"
)

// DB is a test's own schema, migrated.
type DB struct {
	URL    string // the server's connection string
	Schema string // the schema: set it as the Schema of every oncely config
	// Pool is a pool whose connections have Schema as their search_path, so
	// the test's own tables land there too. It is sized for a runner, as
	// oncely.NewPool sizes one: 16 connections unless url sets
	// pool_max_conns.
	Pool *pgxpool.Pool
}

// runnerMaxConns is oncely.DefaultMaxConns (this package does not import
// the runner's, to keep its telemetry dependencies out of a test's graph).
const runnerMaxConns = 16

// Schema creates a uniquely named schema on the Postgres at url (DATABASE_URL
// when url is empty), applies oncely's migrations to it, and returns it with
// a pool whose search_path is that schema. The pool is closed and the
// schema dropped when the test ends. Tests that each take a schema can run
// in parallel on one server.
func Schema(tb testing.TB, url string) *DB {
	tb.Helper()
	url = cmp.Or(url, os.Getenv("DATABASE_URL"))
	if url == "" {
		tb.Fatalf("oncelytest: Schema needs a Postgres: pass its URL or set DATABASE_URL")
	}
	ctx := tb.Context()
	schema := uniqueName("oncelytest")
	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		tb.Fatalf("oncelytest: connect: %v", err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		tb.Fatalf("oncelytest: create schema: %v", err)
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			tb.Errorf("oncelytest: drop schema %s: %v", schema, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
			tb.Errorf("oncelytest: drop schema %s: %v", schema, err)
		}
	})
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		tb.Fatalf("oncelytest: %v", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	if !strings.Contains(url, "pool_max_conns") {
		cfg.MaxConns = runnerMaxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		tb.Fatalf("oncelytest: pool: %v", err)
	}
	tb.Cleanup(pool.Close)
	m, err := migrations.New(pool, migrations.Config{Schema: schema})
	if err != nil {
		tb.Fatalf("oncelytest: %v", err)
	}
	if _, err := m.Up(ctx); err != nil {
		tb.Fatalf("oncelytest: migrate %s: %v", schema, err)
	}
	return &DB{URL: url, Schema: schema, Pool: pool}
}

// Kafka is an in-process Kafka broker for one test.
type Kafka struct {
	Brokers []string
	// Cluster is the kfake cluster, for fault injection (ControlKey).
	Cluster *kfake.Cluster
}

// StartKafka starts an in-process Kafka broker (kfake: the Kafka wire
// protocol, consumer groups included) with topics of one partition each,
// closed when the test ends. Pass a topic's dead-letter topic too
// (dlq.DefaultTopic) when the worker may dead-letter.
func StartKafka(tb testing.TB, topics ...string) *Kafka {
	tb.Helper()
	opts := []kfake.Opt{kfake.NumBrokers(1)}
	if len(topics) > 0 {
		opts = append(opts, kfake.SeedTopics(1, topics...))
	}
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		tb.Fatalf("oncelytest: start kfake: %v", err)
	}
	tb.Cleanup(c.Close)
	return &Kafka{Brokers: c.ListenAddrs(), Cluster: c}
}

// CreateTopic creates topic with the given number of partitions.
func (k *Kafka) CreateTopic(tb testing.TB, topic string, partitions int32) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(tb.Context(), 30*time.Second)
	defer cancel()
	resp, err := kadm.NewClient(k.Client(tb)).CreateTopic(ctx, partitions, 1, nil, topic)
	if err == nil {
		err = resp.Err
	}
	if err != nil {
		tb.Fatalf("oncelytest: create topic %s: %v", topic, err)
	}
}

// Client returns a client of the broker, closed when the test ends.
func (k *Kafka) Client(tb testing.TB, opts ...kgo.Opt) *kgo.Client {
	tb.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(k.Brokers...)}, opts...)...)
	if err != nil {
		tb.Fatalf("oncelytest: kafka client: %v", err)
	}
	tb.Cleanup(cl.Close)
	return cl
}

// Produce writes recs and waits for the broker to acknowledge them all.
func (k *Kafka) Produce(tb testing.TB, recs ...*kgo.Record) {
	tb.Helper()
	if err := k.Client(tb).ProduceSync(tb.Context(), recs...).FirstErr(); err != nil {
		tb.Fatalf("oncelytest: produce: %v", err)
	}
}

// Consume reads topic from its start until it has n records, and returns
// them; it fails the test when they have not all come within timeout.
func (k *Kafka) Consume(tb testing.TB, topic string, n int, timeout time.Duration) []*kgo.Record {
	tb.Helper()
	cl := k.Client(tb, kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	ctx, cancel := context.WithTimeout(tb.Context(), timeout)
	defer cancel()
	var recs []*kgo.Record
	for len(recs) < n {
		fs := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			tb.Fatalf("oncelytest: %d of %d records on %s within %s", len(recs), n, topic, timeout)
		}
		fs.EachError(func(t string, p int32, err error) {
			tb.Fatalf("oncelytest: fetch %s/%d: %v", t, p, err)
		})
		recs = append(recs, fs.Records()...)
	}
	return recs
}

// uniqueName is prefix and 12 random hex digits: a valid schema name.
func uniqueName(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + "_" + hex.EncodeToString(b[:])
}
