package integration_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/oncely/oncely/consumer"
	"github.com/oncely/oncely/dlq"
	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/outbox"
)

// runToEnd runs a consumer that must fail at start-up and returns Run's
// error; the test fails if Run does not return within d.
func runToEnd(t *testing.T, cfg consumer.Config, d time.Duration) error {
	t.Helper()
	c, err := consumer.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	select {
	case err := <-done:
		return err
	case <-time.After(d):
		cancel()
		<-done
		t.Fatalf("Run did not fail within %s", d)
		return nil
	}
}

// TestStartFailsOnMissingTopics: a source topic or a dead-letter topic that
// does not exist fails Run at start-up with ErrMissingTopics naming each
// one, and the consumer creates none of them (a typo must not make a
// topic).
func TestStartFailsOnMissingTopics(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	typo := testenv.UniqueName("ordres")
	noDLQ := e.kafka.CreateTopic(t, "nodlq", 1)
	cfg := e.config("a", recordEffect("a"))
	cfg.Topics = []string{e.topic, typo, noDLQ}
	err := runToEnd(t, cfg, time.Minute)
	if !errors.Is(err, consumer.ErrMissingTopics) {
		t.Fatalf("Run = %v, want ErrMissingTopics", err)
	}
	for _, want := range []string{typo, dlq.DefaultTopic(typo), dlq.DefaultTopic(noDLQ)} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Run's error %q does not name the missing topic %s", err, want)
		}
	}
	for _, present := range []string{e.topic + ",", e.topic + " ", dlq.DefaultTopic(e.topic), noDLQ + ","} {
		if strings.Contains(err.Error(), present) {
			t.Errorf("Run's error %q names %q, which exists", err, present)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	topics, err := kadm.NewClient(e.kafka.Client(t)).ListTopics(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, missing := range []string{typo, dlq.DefaultTopic(typo), dlq.DefaultTopic(noDLQ)} {
		if topics.Has(missing) {
			t.Errorf("the consumer created topic %s", missing)
		}
	}
}

// TestStartWaitsForUnreachableBroker: with no broker answering at the
// configured address, Run neither fails nor waits silently: past
// BrokerTimeout it logs an ERROR and NotReady names the address, and it
// returns nil once asked to stop.
func TestStartWaitsForUnreachableBroker(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	cfg := e.config("a", recordEffect("a"))
	cfg.Brokers = []string{"127.0.0.1:1"}
	cfg.BrokerTimeout = 500 * time.Millisecond
	var logs lockedBuffer
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	m := e.start(context.Background(), cfg)
	eventually(t, time.Minute, "not ready, naming the unreachable broker, and an ERROR logged", func() bool {
		why := m.c.NotReady()
		out := logs.String()
		return strings.Contains(why, "no Kafka broker answers") && strings.Contains(why, "127.0.0.1:1") &&
			strings.Contains(out, "level=ERROR") && strings.Contains(out, "cannot reach any Kafka broker")
	})
	if err := m.stop(t); err != nil {
		t.Fatalf("Run = %v after a stop while waiting for the brokers, want nil", err)
	}
}

// TestReadinessFollowsTheBroker: a running consumer whose broker stops
// answering reports not ready, naming the brokers, and logs an ERROR.
func TestReadinessFollowsTheBroker(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	if e.kafka.Cluster == nil {
		t.Skip("stopping the broker needs the in-process kfake broker (KAFKA_BROKERS is set)")
	}
	cfg := e.config("a", recordEffect("a"))
	cfg.ShutdownTimeout = 2 * time.Second
	var logs lockedBuffer
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	e.produce(t, uniqueMsgs("r", 5, 1))
	m := e.start(context.Background(), cfg)
	eventually(t, time.Minute, "ready and processing", func() bool { return m.c.Ready() && m.c.Stats().Processed == 5 })
	e.kafka.Cluster.Close()
	eventually(t, time.Minute, "not ready, naming the broker", func() bool {
		why := m.c.NotReady()
		return strings.Contains(why, "no Kafka broker answers") && strings.Contains(why, e.kafka.Brokers[0])
	})
	if out := logs.String(); !strings.Contains(out, "level=ERROR") || !strings.Contains(out, "cannot reach any Kafka broker") {
		t.Errorf("no ERROR logged when the broker went away:\n%s", out)
	}
}

// TestRelayReadinessFollowsTheBroker: a relay with nothing to publish whose
// broker stops answering reports not ready, naming the brokers, and logs an
// ERROR; it claimed ready only once a broker had answered.
func TestRelayReadinessFollowsTheBroker(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	if e.kafka.Cluster == nil {
		t.Skip("stopping the broker needs the in-process kfake broker (KAFKA_BROKERS is set)")
	}
	var logs lockedBuffer
	relay, _ := e.startRelay(context.Background(), t, func(c *outbox.RelayConfig) {
		c.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	})
	eventually(t, time.Minute, "the relay ready", relay.Ready)
	e.kafka.Cluster.Close()
	eventually(t, time.Minute, "the relay not ready, naming the broker", func() bool {
		why := relay.NotReady()
		return strings.Contains(why, "no Kafka broker answers") && strings.Contains(why, e.kafka.Brokers[0])
	})
	if out := logs.String(); !strings.Contains(out, "level=ERROR") || !strings.Contains(out, "cannot reach any Kafka broker") {
		t.Errorf("no ERROR logged when the broker went away:\n%s", out)
	}
}

// TestReadinessReportsAStuckPartition: a partition on one record for longer
// than StuckAfter makes the consumer not ready, naming the partition and
// the offset, while its other partition, idle as long, is not named; once
// the record finishes, it is ready again. In every mode.
func TestReadinessReportsAStuckPartition(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	g := newGate()
	defer g.open()
	e.produce(t, []msg{{id: "ok", partition: 1, key: "k"}, {id: "a", partition: 0, key: "k"}, {id: "stuck", partition: 0, key: "k"}})
	cfg := e.config("a", func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if msg.ID == "stuck" {
			g.wait()
		}
		return recordEffect("a")(ctx, tx, msg)
	})
	cfg.StuckAfter = 500 * time.Millisecond
	m := e.start(context.Background(), cfg)
	eventually(t, time.Minute, "not ready, naming the stuck partition", func() bool {
		why := m.c.NotReady()
		return strings.Contains(why, "partition "+e.topic+"/0 stuck on offset") && !strings.Contains(why, e.topic+"/1")
	})
	g.open()
	eventually(t, time.Minute, "ready again once the record finished", func() bool {
		return m.c.Ready() && e.count(t, `SELECT count(*) FROM effects`) == 3
	})
	e.assertExactlyOnce(t, 3)
}

// TestIDFallbackIsCountedAndLogged: records without a message id header
// are counted in oncely.consumer.id_fallback, one each, and logged with a
// WARN naming their topic and partition, at most once a minute per
// partition. Records with an id (in any casing) count nothing.
func TestIDFallbackIsCountedAndLogged(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 2)
	tl := newTel(t)
	var logs lockedBuffer
	cfg := e.config("a", recordEffect("a"))
	cfg.MeterProvider = tl.mp
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	var recs []*kgo.Record
	for i := range 10 {
		recs = append(recs, &kgo.Record{Topic: e.topic, Partition: int32(i % 2), Key: []byte("k"), Value: []byte("no id")})
	}
	recs = append(recs, &kgo.Record{Topic: e.topic, Partition: 0, Key: []byte("k"), Value: []byte("id"),
		Headers: []kgo.RecordHeader{{Key: "Message-ID", Value: []byte("with-id")}}})
	e.produceRecords(t, recs...)
	m := e.start(context.Background(), cfg)
	eventually(t, time.Minute, "all processed", func() bool { return m.c.Stats().Processed == 11 })
	if n := tl.sum(t, "oncely.consumer.id_fallback"); n != 10 {
		t.Errorf("oncely.consumer.id_fallback = %d, want 10", n)
	}
	out := logs.String()
	for p := range 2 {
		want := "partition=" + itoa(p)
		if n := strings.Count(out, "without a message id"); n != 2 || !strings.Contains(out, want) || !strings.Contains(out, "topic="+e.topic) {
			t.Errorf("%d id-fallback WARNs, want one per partition naming topic and %s:\n%s", n, want, out)
		}
	}
}

// lockedBuffer is a bytes.Buffer safe for a logger and a test at once.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestCommittedOffsetsNeverMoveBack: while members join and leave and
// records flow, a sampler reads the group's committed offsets over and
// over: no partition's committed offset ever moves backwards (a revoked or
// lost member's periodic commit of an older snapshot would move it back,
// and its next owner would process those records again), and every record
// has one effect.
func TestCommittedOffsetsNeverMoveBack(t *testing.T) {
	t.Parallel()
	const partitions, n = 4, 4000
	e := newEnv(t, partitions)
	adm := kadm.NewClient(e.kafka.Client(t))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var (
		mu        sync.Mutex
		backwards []string
		samples   int
	)
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		seen := map[int32]int64{}
		for ctx.Err() == nil {
			fctx, fcancel := context.WithTimeout(ctx, 5*time.Second)
			offsets, err := adm.FetchOffsets(fctx, e.group)
			fcancel()
			if err != nil {
				continue
			}
			mu.Lock()
			samples++
			offsets.Each(func(o kadm.OffsetResponse) {
				if prev, ok := seen[o.Partition]; ok && o.At < prev {
					backwards = append(backwards, fmt.Sprintf("partition %d: %d after %d", o.Partition, o.At, prev))
				}
				seen[o.Partition] = max(seen[o.Partition], o.At)
			})
			mu.Unlock()
		}
	}()

	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		msgs := uniqueMsgs("o", n, partitions)
		for i := 0; i < n; i += 250 {
			e.produce(t, msgs[i:i+250])
		}
	}()
	effects := func() int64 { return e.count(t, `SELECT count(*) FROM effects`) }
	at := func(k int64) {
		eventually(t, time.Minute, fmt.Sprintf("%d effects", k), func() bool { return effects() >= k })
	}
	a := e.start(context.Background(), e.config("a", recordEffect("a")))
	at(500)
	b := e.start(context.Background(), e.config("b", recordEffect("b")))
	at(1500)
	if err := a.stop(t); err != nil {
		t.Fatalf("a: %v", err)
	}
	c := e.start(context.Background(), e.config("c", recordEffect("c")))
	at(2500)
	if err := b.stop(t); err != nil {
		t.Fatalf("b: %v", err)
	}
	wg.Wait()
	eventually(t, 2*time.Minute, "all records applied and committed", func() bool {
		return effects() == n && e.committedLag(t) == 0
	})
	cancel()
	<-sampled
	if err := c.stop(t); err != nil {
		t.Fatal(err)
	}
	e.assertExactlyOnce(t, n)
	mu.Lock()
	defer mu.Unlock()
	if samples < 10 {
		t.Errorf("only %d samples of the committed offsets", samples)
	}
	if len(backwards) > 0 {
		t.Errorf("committed offsets moved backwards: %s", strings.Join(backwards, "; "))
	}
}
