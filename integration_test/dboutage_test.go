package integration_test

import (
	"context"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/outbox"
)

// These tests cut the database off through a TCP proxy (testenv.PostgresProxy)
// instead of stopping it, so they run against the shared local server: the
// components under test reach Postgres through the proxy, the assertions
// read it directly.

// The consumer's database becomes unreachable mid-stream, for longer than
// several session timeouts. The consumer reports not ready; it stops
// fetching as soon as its transactions fail to reach the database, with
// room left in its buffers (records produced during the outage are not even
// fetched); it commits no offset past a record whose transaction did not
// commit before the outage; it keeps its group
// membership (no member rejoins, the member id stays); and once the database
// is back it applies every record exactly once.
func TestConsumerWaitsOutDatabaseOutage(t *testing.T) {
	t.Parallel()
	const partitions, perPartition = 2, 1000
	e := newEnvWithKafka(t, partitions, kfake.GroupMinSessionTimeout(500*time.Millisecond))
	if e.kafka.Cluster == nil {
		t.Skip("observing fetches and joins needs the in-process kfake broker (KAFKA_BROKERS is set)")
	}
	var (
		mu        sync.Mutex
		maxOffset = map[int32]int64{} // highest offset a Fetch request asked for, per partition
		joins     atomic.Int64
	)
	e.kafka.Cluster.ControlKey(kmsg.Fetch.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		e.kafka.Cluster.KeepControl()
		mu.Lock()
		defer mu.Unlock()
		for _, topic := range req.(*kmsg.FetchRequest).Topics { // the test's topic is the only one fetched
			for _, p := range topic.Partitions {
				maxOffset[p.Partition] = max(maxOffset[p.Partition], p.FetchOffset)
			}
		}
		return nil, nil, false
	})
	e.kafka.Cluster.ControlKey(kmsg.JoinGroup.Int16(), func(kmsg.Request) (kmsg.Response, error, bool) {
		e.kafka.Cluster.KeepControl()
		joins.Add(1)
		return nil, nil, false
	})
	fetched := func() map[int32]int64 {
		mu.Lock()
		defer mu.Unlock()
		return maps.Clone(maxOffset)
	}
	proxy := testenv.NewPostgresProxy(t)
	cfg := e.config("a", recordEffect("a"))
	cfg.Pool = proxy.Pool(t, e.db.Schema, 8)
	cfg.SessionTimeout = time.Second
	// The default buffers (2000 records a partition) hold the whole
	// backlog: only the database outage can pause fetching here.
	m := e.start(context.Background(), cfg)
	members := func() []string {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		groups, err := kadm.NewClient(e.kafka.Client(t)).DescribeGroups(ctx, e.group)
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, mem := range groups[e.group].Members {
			ids = append(ids, mem.MemberID)
		}
		return ids
	}

	e.produce(t, uniqueMsgs("before", partitions*perPartition, partitions))
	eventually(t, time.Minute, "the consumer ready and mid-stream", func() bool {
		return m.c.Ready() && m.c.Stats().Processed >= 100 // both partitions far from done
	})
	before := members()
	joinsBefore := joins.Load()

	proxy.Cut()
	cutAt := time.Now()
	eventually(t, 30*time.Second, "the consumer to report not ready", func() bool { return !m.c.Ready() })
	r0 := m.c.Stats().Retries
	eventually(t, time.Minute, "20 failed attempts", func() bool { return m.c.Stats().Retries >= r0+20 })
	downStats := m.c.Stats()
	// Every partition's worker has failed to reach the database by now,
	// so fetching is paused: records produced from here on are not fetched
	// while the database is away.
	e.produce(t, uniqueMsgs("during", partitions*perPartition, partitions))
	r1 := m.c.Stats().Retries
	eventually(t, time.Minute, "an outage of 3 session timeouts and 50 more failed attempts", func() bool {
		return time.Since(cutAt) > 3*cfg.SessionTimeout && m.c.Stats().Retries >= r1+50
	})
	for p, off := range fetched() {
		if off > perPartition {
			t.Errorf("partition %d: fetched from offset %d while the database was down; fetching should have paused at the %d records produced before",
				p, off, perPartition)
		}
	}
	if s := m.c.Stats(); s.Processed != downStats.Processed || s.Duplicates != downStats.Duplicates {
		t.Errorf("records committed while the database was down: %+v, then %+v", downStats, s)
	}
	// Offsets of records finished before the cut may still reach Kafka
	// (the committer runs every CommitInterval); none may pass a record
	// without its effect.
	for p, off := range e.committedOffsets(t, partitions) {
		if n := e.count(t, `SELECT count(*) FROM effects WHERE partition = $1 AND "offset" < $2`, p, off); n != off {
			t.Errorf("partition %d: offset %d committed during the outage, but only %d records below it have effects", p, off, n)
		}
	}
	if n, after := joins.Load()-joinsBefore, members(); n != 0 || !slices.Equal(after, before) {
		t.Errorf("group membership changed during the outage: %d joins, members %v, then %v", n, before, after)
	}
	if m.c.Ready() {
		t.Error("the consumer reports ready while the database is down")
	}
	t.Logf("down %s: %+v; fetch offsets %v", time.Since(cutAt).Round(time.Millisecond), m.c.Stats(), fetched())

	proxy.Restore()
	eventually(t, time.Minute, "the consumer ready again", m.c.Ready)
	eventually(t, 2*time.Minute, "every record applied and committed", func() bool {
		return e.count(t, `SELECT count(*) FROM effects`) == 2*partitions*perPartition && e.committedLag(t) == 0
	})
	e.assertExactlyOnce(t, 2*partitions*perPartition)
	if n := joins.Load() - joinsBefore; n != 0 {
		t.Errorf("%d group joins after the outage; the member should have kept its partitions", n)
	}
	if err := m.stop(t); err != nil {
		t.Fatal(err)
	}
}

// committedOffsets returns the group's committed offset of each partition.
func (e *env) committedOffsets(t *testing.T, partitions int) []int64 {
	t.Helper()
	out := make([]int64, partitions)
	for p := range out {
		out[p] = e.committedOffset(t, int32(p))
	}
	return out
}

// The relay's database becomes unreachable: the relay reports not ready,
// publishes nothing, and the rows enqueued meanwhile wait in the outbox;
// once the database is back it publishes them, every message under the id
// it was enqueued with.
func TestRelayWaitsOutDatabaseOutage(t *testing.T) {
	t.Parallel()
	const n = 100
	e := newEnv(t, 2)
	ctx := context.Background()
	proxy := testenv.NewPostgresProxy(t)
	batch := func(prefix string) []outbox.Message {
		var msgs []outbox.Message
		for i := range n {
			msgs = append(msgs, outbox.Message{Topic: e.topic, Key: []byte(fmt.Sprint("k", i%10)), Value: []byte(fmt.Sprint(prefix, i))})
		}
		return msgs
	}
	var ids []string
	for _, q := range e.enqueue(t, ctx, true, batch("before-")...) {
		ids = append(ids, q.MessageID)
	}
	relay, _ := e.startRelay(ctx, t, func(c *outbox.RelayConfig) { c.Pool = proxy.Pool(t, e.db.Schema, 4) })
	eventually(t, time.Minute, "the first batch published", func() bool { return relay.Stats().Published == n && relay.Ready() })

	proxy.Cut()
	eventually(t, 30*time.Second, "the relay to report not ready", func() bool { return !relay.Ready() })
	for _, q := range e.enqueue(t, ctx, true, batch("during-")...) { // through the direct pool: the database is up
		ids = append(ids, q.MessageID)
	}
	st, err := e.outbox(t).Status(ctx, e.db.Pool)
	if err != nil || st.Pending != n || relay.Stats().Published != n {
		t.Fatalf("while cut off: status %+v, %v, relay %+v; want %d pending and nothing more published", st, err, relay.Stats(), n)
	}

	proxy.Restore()
	eventually(t, time.Minute, "the relay ready again and the outbox empty", func() bool {
		st, err := e.outbox(t).Status(ctx, e.db.Pool)
		return relay.Ready() && err == nil && st.Pending == 0
	})
	recs := e.readTopic(t, e.topic, func(recs []*kgo.Record) bool { return len(distinctIDs(recs)) >= 2*n })
	if got := distinctIDs(recs); !slices.Equal(got, sorted(ids)) {
		t.Errorf("published ids %d, enqueued %d: they differ", len(got), len(ids))
	}
}

func distinctIDs(recs []*kgo.Record) []string {
	var ids []string
	for _, r := range recs {
		for _, h := range r.Headers {
			if h.Key == outbox.MessageIDHeader {
				ids = append(ids, string(h.Value))
			}
		}
	}
	return slices.Compact(sorted(ids))
}

func sorted(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}

// A webhook receiver whose pool's connections all die answers 503 and
// stores nothing; when the database is back, the provider's retry is
// stored once and acknowledged.
func TestWebhookReceiverWaitsOutDatabaseOutage(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	proxy := testenv.NewPostgresProxy(t)
	rc, srv := e.webhookReceiver(t, proxy.Pool(t, e.db.Schema, 4), nil)
	first := signWebhook(t, webhookSecret, "msg_before", []byte(`{"order_id":"o-1"}`), time.Now())
	if s, _ := first.post(t, http.MethodPost, srv.URL, true); s != http.StatusAccepted {
		t.Fatalf("before the outage: %d, want 202", s)
	}
	proxy.Cut() // the pool's connections die under it
	d := signWebhook(t, webhookSecret, "msg_during", []byte(`{"order_id":"o-2"}`), time.Now())
	for i := range 3 {
		if s, h := d.post(t, http.MethodPost, srv.URL, true); s != http.StatusServiceUnavailable || h.Get("Retry-After") == "" {
			t.Fatalf("attempt %d during the outage: %d, Retry-After %q; want 503 with Retry-After", i, s, h.Get("Retry-After"))
		}
	}
	if rows := e.outboxRows(t); rows != 1 {
		t.Fatalf("%d outbox rows after the refused attempts, want only the first delivery's", rows)
	}
	proxy.Restore()
	eventually(t, 30*time.Second, "the retry to be acknowledged", func() bool {
		s, _ := d.post(t, http.MethodPost, srv.URL, true)
		return s == http.StatusAccepted
	})
	if rows := e.outboxRows(t); rows != 2 {
		t.Fatalf("%d outbox rows, want 2", rows)
	}
	if st := rc.Stats(); st.Stored != 2 || st.Failed < 3 {
		t.Errorf("receiver stats %+v: want 2 stored and the 3 attempts during the outage failed", st)
	}
}
