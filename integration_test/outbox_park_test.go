package integration_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/oncely/oncely/internal/testenv"
	"github.com/oncely/oncely/outbox"
)

// oneShard returns an outbox whose messages all land in one shard, and a
// relay over it: a parked row shares its shard with every other key.
func (e *env) oneShard(ctx context.Context, t *testing.T, mutate func(*outbox.RelayConfig)) (*outbox.Outbox, *outbox.Relay) {
	t.Helper()
	o, err := outbox.New(outbox.Config{Schema: e.db.Schema, Shards: 1})
	if err != nil {
		t.Fatal(err)
	}
	r, _ := e.startRelay(ctx, t, func(c *outbox.RelayConfig) {
		c.Outbox.Shards = 1
		if mutate != nil {
			mutate(c)
		}
	})
	return o, r
}

func enqueueWith(t *testing.T, ctx context.Context, e *env, o *outbox.Outbox, msgs ...outbox.Message) {
	t.Helper()
	if err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
		_, err := o.Enqueue(ctx, tx, msgs...)
		return err
	}); err != nil {
		t.Fatal(err)
	}
}

// produceFailed answers pr with the error code that code gives each topic.
func produceFailed(pr *kmsg.ProduceRequest, code func(kmsg.ProduceRequestTopic) int16) *kmsg.ProduceResponse {
	resp := pr.ResponseKind().(*kmsg.ProduceResponse)
	for _, rt := range pr.Topics {
		st := kmsg.NewProduceResponseTopic()
		st.Topic, st.TopicID = rt.Topic, rt.TopicID
		for _, rp := range rt.Partitions {
			sp := kmsg.NewProduceResponseTopicPartition()
			sp.Partition, sp.ErrorCode = rp.Partition, code(rt)
			st.Partitions = append(st.Partitions, sp)
		}
		resp.Topics = append(resp.Topics, st)
	}
	return resp
}

// waitDrained waits until o has nothing pending or parked.
func waitDrained(t *testing.T, e *env, o *outbox.Outbox) {
	t.Helper()
	eventually(t, 10*time.Second, "nothing pending or parked", func() bool {
		st, err := o.Status(context.Background(), e.db.Pool)
		return err == nil && st.Pending == 0 && st.Parked == 0
	})
}

// noise returns n incompressible bytes.
func noise(n int) []byte {
	b := make([]byte, n)
	rng := rand.New(rand.NewPCG(uint64(n), 9))
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	return b
}

// byKey groups the values of recs by key, in topic order.
func byKey(recs []*kgo.Record) map[string][]string {
	m := map[string][]string{}
	for _, r := range recs {
		v := string(r.Value)
		if len(v) > 32 {
			v = fmt.Sprintf("<%d bytes>", len(v))
		}
		m[string(r.Key)] = append(m[string(r.Key)], v)
	}
	return m
}

// gauge reads an int64 gauge's value from the reader.
func (tl *tel) gauge(t *testing.T, name string) (int64, bool) {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := tl.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if g, ok := m.Data.(metricdata.Gauge[int64]); ok && m.Name == name && len(g.DataPoints) > 0 {
				return g.DataPoints[0].Value, true
			}
		}
	}
	return 0, false
}

// TestRelayParksRowTheBrokerNeverAccepts: one 1.1 MB row among healthy rows
// of five other keys in the same shard is parked with its error instead of
// blocking the shard; the five are published, the stats, the gauge, Status
// and Parked count it; the later row of its key stays unpublished until the
// parked row is discarded, then flows.
func TestRelayParksRowTheBrokerNeverAccepts(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	tl := newTel(t)
	ctx := context.Background()
	o, relay := e.oneShard(ctx, t, func(c *outbox.RelayConfig) { c.MeterProvider = tl.mp })

	msgs := []outbox.Message{{Topic: e.topic, Key: []byte("big"), Value: noise(1_100_000)}}
	for i := range 5 {
		msgs = append(msgs, outbox.Message{Topic: e.topic, Key: []byte(fmt.Sprint("k", i)), Value: []byte("ok")})
	}
	msgs = append(msgs, outbox.Message{Topic: e.topic, Key: []byte("big"), Value: []byte("after-big")})
	enqueueWith(t, ctx, e, o, msgs...)

	eventually(t, time.Minute, "the five healthy rows published and the big one parked", func() bool {
		s := relay.Stats()
		return s.Published == 5 && s.Parked == 1
	})
	st, err := o.Status(ctx, e.db.Pool)
	if err != nil || st.Parked != 1 || st.Pending != 1 || st.Sent != 5 {
		t.Fatalf("status %+v, %v; want 1 parked, 1 pending (held behind it), 5 sent", st, err)
	}
	if n, ok := tl.gauge(t, "oncely.outbox.parked"); !ok || n != 1 {
		t.Errorf("oncely.outbox.parked = %d (reported: %v), want 1", n, ok)
	}
	parked, err := o.Parked(ctx, e.db.Pool, 0)
	if err != nil || len(parked) != 1 {
		t.Fatalf("parked rows %+v, %v; want 1", parked, err)
	}
	p := parked[0]
	if string(p.Key) != "big" || p.Size < 1_100_000 || p.Held != 1 || p.ParkedAt.IsZero() || !strings.Contains(p.Error, "MESSAGE_TOO_LARGE") {
		t.Fatalf("parked row %+v; want key big, >= 1.1 MB, 1 held, a time and MESSAGE_TOO_LARGE", p)
	}

	// A marker of another key, enqueued last, is published: had the held
	// row been published, it would be on the topic before the marker.
	enqueueWith(t, ctx, e, o, outbox.Message{Topic: e.topic, Key: []byte("marker"), Value: []byte("m")})
	recs := e.readTopic(t, e.topic, func(r []*kgo.Record) bool { return len(byKey(r)["marker"]) == 1 })
	if got := byKey(recs); len(recs) != 6 || len(got["big"]) != 0 {
		t.Fatalf("published before the discard: %v; want the five healthy rows and the marker, nothing of key big", got)
	}

	if err := o.Discard(ctx, e.db.Pool, p.ID); err != nil {
		t.Fatal(err)
	}
	if err := o.Discard(ctx, e.db.Pool, p.ID); !errors.Is(err, outbox.ErrNotParked) {
		t.Errorf("second discard: %v, want ErrNotParked", err)
	}
	recs = e.readTopic(t, e.topic, func(r []*kgo.Record) bool { return len(byKey(r)["big"]) == 1 })
	if got := byKey(recs)["big"]; len(got) != 1 || got[0] != "after-big" {
		t.Fatalf("key big after the discard: %v; want only its later row", got)
	}
	waitDrained(t, e, o)
}

// TestRelayParksTheRowsTheBrokerRefusedAmongPartitions: a batch of rows
// spread over eight partitions, three of them too large for the topic's
// max.message.bytes: exactly those three are parked and every other row is
// published. The relay used to pair ProduceSync's results, which come in
// the order the records completed, with its rows in the order given: a
// refused row could be marked sent (an event lost) and a published one
// parked or produced again.
func TestRelayParksTheRowsTheBrokerRefusedAmongPartitions(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	limit := "4096"
	small, err := kadm.NewClient(e.kafka.Client(t)).CreateTopic(ctx, 8, 1, map[string]*string{"max.message.bytes": &limit}, e.topic+"_wide")
	if err == nil {
		err = small.Err
	}
	if err != nil {
		t.Fatal(err)
	}
	o, relay := e.oneShard(ctx, t, nil)
	var msgs []outbox.Message
	for i := range 40 {
		msgs = append(msgs, outbox.Message{Topic: small.Topic, Key: []byte(fmt.Sprint("k", i)), Value: []byte(fmt.Sprint("v", i))})
		if i%13 == 6 {
			msgs = append(msgs, outbox.Message{Topic: small.Topic, Key: []byte(fmt.Sprint("big", i)), Value: noise(8000)})
		}
	}
	enqueueWith(t, ctx, e, o, msgs...)
	eventually(t, time.Minute, "every row published or parked", func() bool {
		st, err := o.Status(ctx, e.db.Pool)
		return err == nil && st.Pending == 0
	})
	parked, err := o.Parked(ctx, e.db.Pool, 0)
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, p := range parked {
		keys = append(keys, string(p.Key))
	}
	if fmt.Sprint(keys) != "[big6 big19 big32]" {
		t.Errorf("parked %v; want exactly the three rows over the limit", keys)
	}
	recs := e.readTopic(t, small.Topic, func(r []*kgo.Record) bool { return len(r) >= 40 })
	// A produce that failed as a whole (a timeout on a loaded machine) is
	// published again, under the same message ids: then a key may appear
	// more than once, but never with another id or value. The relay counts
	// a batch once it has committed it.
	eventually(t, time.Minute, "every row counted", func() bool {
		s := relay.Stats()
		return s.Published >= 40 && s.Parked >= 3
	})
	s := relay.Stats()
	for i := range 40 {
		key := fmt.Sprint("k", i)
		var values []string
		ids := map[string]bool{}
		for _, r := range recs {
			if string(r.Key) != key {
				continue
			}
			values = append(values, string(r.Value))
			for _, h := range r.Headers {
				if h.Key == "message-id" {
					ids[string(h.Value)] = true
				}
			}
		}
		want := fmt.Sprintf("v%d", i)
		switch {
		case len(values) == 0:
			t.Errorf("key %s never published", key)
		case len(ids) != 1:
			t.Errorf("key %s published under %d message ids; want one", key, len(ids))
		case len(values) > 1 && s.ProduceErrors == 0:
			t.Errorf("key %s published %d times without a failed produce; want once", key, len(values))
		}
		for _, v := range values {
			if v != want {
				t.Errorf("key %s on the topic: %q; want %q", key, v, want)
			}
		}
	}
	if s.Published != 40 || s.Parked != 3 {
		t.Errorf("stats %+v; want 40 published, 3 parked", s)
	}
}

// smallTopicEnv returns an env, a context of two minutes, an admin client
// and a topic of one partition whose max.message.bytes is 4096.
func smallTopicEnv(t *testing.T) (*env, context.Context, *kadm.Client, string) {
	t.Helper()
	e := newEnv(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	adm := kadm.NewClient(e.kafka.Client(t))
	limit := "4096"
	small, err := adm.CreateTopic(ctx, 1, 1, map[string]*string{"max.message.bytes": &limit}, e.topic+"_small")
	if err == nil {
		err = small.Err
	}
	if err != nil {
		t.Fatal(err)
	}
	return e, ctx, adm, small.Topic
}

// raiseLimit lets topic take messages of up to 2 MB.
func raiseLimit(ctx context.Context, t *testing.T, adm *kadm.Client, topic string) {
	t.Helper()
	raised := "2000000"
	if _, err := adm.AlterTopicConfigs(ctx, []kadm.AlterConfig{{Name: "max.message.bytes", Value: &raised}}, topic); err != nil {
		t.Fatal(err)
	}
}

// TestRelayRetryPublishesParkedRowThenItsSuccessors: the topic's
// max.message.bytes refuses one row; the rows sharing its Kafka batch are
// published, it is parked, and the rows of its key enqueued with it and
// after it wait. Once the limit is raised, Retry publishes it and then its
// successors, in order.
func TestRelayRetryPublishesParkedRowThenItsSuccessors(t *testing.T) {
	t.Parallel()
	e, ctx, adm, topic := smallTopicEnv(t)
	o, relay := e.oneShard(ctx, t, nil)

	var msgs []outbox.Message
	for i := range 5 {
		msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte(fmt.Sprint("k", i)), Value: []byte(fmt.Sprint("v", i))})
	}
	msgs = append(msgs, outbox.Message{Topic: topic, Key: []byte("b"), Value: noise(8000)},
		outbox.Message{Topic: topic, Key: []byte("k0"), Value: []byte("v0-2")},
		outbox.Message{Topic: topic, Key: []byte("b"), Value: []byte("b-2")})
	enqueueWith(t, ctx, e, o, msgs...)
	eventually(t, time.Minute, "the six healthy rows published and the big one parked", func() bool {
		s := relay.Stats()
		return s.Published == 6 && s.Parked == 1
	})
	enqueueWith(t, ctx, e, o, outbox.Message{Topic: topic, Key: []byte("b"), Value: []byte("b-3")})
	parked, err := o.Parked(ctx, e.db.Pool, 0)
	if err != nil || len(parked) != 1 || string(parked[0].Key) != "b" || parked[0].Held != 2 || !strings.Contains(parked[0].Error, "MESSAGE_TOO_LARGE") {
		t.Fatalf("parked %+v, %v; want key b, holding 2 rows, MESSAGE_TOO_LARGE", parked, err)
	}

	// Retrying with the limit unchanged parks it again, still holding its key.
	if err := o.Retry(ctx, e.db.Pool, parked[0].ID); err != nil {
		t.Fatal(err)
	}
	eventually(t, time.Minute, "parked again", func() bool { return relay.Stats().Parked == 2 })
	if s := relay.Stats(); s.Published != 6 {
		t.Fatalf("stats %+v after a retry the broker still refuses: nothing more may be published", s)
	}

	raiseLimit(ctx, t, adm, topic)
	if n, err := o.RetryAll(ctx, e.db.Pool); err != nil || n != 1 {
		t.Fatalf("retry all: %d, %v; want 1", n, err)
	}
	recs := e.readTopic(t, topic, func(r []*kgo.Record) bool { return len(byKey(r)["b"]) >= 3 })
	got := byKey(recs)
	if want := []string{"<8000 bytes>", "b-2", "b-3"}; fmt.Sprint(got["b"]) != fmt.Sprint(want) {
		t.Fatalf("key b on the topic: %v; want %v (the parked row first, then its successors in order)", got["b"], want)
	}
	if fmt.Sprint(got["k0"]) != "[v0 v0-2]" {
		t.Errorf("key k0: %v", got["k0"])
	}
	waitDrained(t, e, o)
}

// TestRelayParksRowsWithAnInvalidTopic: a row stored before Enqueue checked
// topic names (here written with SQL) is parked as InvalidTopicException
// before producing; the shard's other rows flow. Enqueue refuses such a
// topic at once, naming the message.
func TestRelayParksRowsWithAnInvalidTopic(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx := context.Background()
	o, relay := e.oneShard(ctx, t, nil)
	for i, topic := range []string{"", "bad topic", strings.Repeat("t", 250), "..", "café"} {
		err := pgx.BeginFunc(ctx, e.db.Pool, func(tx pgx.Tx) error {
			_, err := o.Enqueue(ctx, tx, outbox.Message{Topic: e.topic, Value: []byte("fine")}, outbox.Message{Topic: topic})
			return err
		})
		if err == nil || !strings.Contains(err.Error(), "message 1") {
			t.Errorf("topic %d %q: Enqueue said %v; want a refusal naming message 1", i, topic, err)
		}
	}
	if _, err := e.db.Pool.Exec(ctx, `INSERT INTO outbox (message_id, topic, key, value, shard) VALUES
		('m-bad', 'bad topic', 'k', 'x', 0), ('m-bad-2', 'bad topic', 'k', 'y', 0)`); err != nil {
		t.Fatal(err)
	}
	enqueueWith(t, ctx, e, o, outbox.Message{Topic: e.topic, Key: []byte("k"), Value: []byte("good")})
	eventually(t, time.Minute, "the good row published and the bad one parked", func() bool {
		s := relay.Stats()
		return s.Published == 1 && s.Parked == 1
	})
	parked, err := o.Parked(ctx, e.db.Pool, 0)
	if err != nil || len(parked) != 1 || parked[0].MessageID != "m-bad" || !strings.Contains(parked[0].Error, "INVALID_TOPIC_EXCEPTION") || parked[0].Held != 1 {
		t.Fatalf("parked %+v, %v; want m-bad with INVALID_TOPIC_EXCEPTION, holding m-bad-2", parked, err)
	}
}

// TestRelayParksOnTopicAuthorizationButWaitsOutTransientErrors: the broker
// answers produces to one topic with TOPIC_AUTHORIZATION_FAILED (a missing
// ACL) and to another, for a while, with UNKNOWN_TOPIC_OR_PARTITION (as while
// a topic is being created). The first topic's row is parked, and a row of
// another topic in the same shard is published after it; the second's is
// retried, never parked, and published once the broker recovers.
func TestRelayParksOnTopicAuthorizationButWaitsOutTransientErrors(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	if e.kafka.Cluster == nil {
		t.Skip("failing produces needs the in-process kfake broker (KAFKA_BROKERS is set)")
	}
	ctx := context.Background()
	denied, settling := testenv.UniqueName("denied"), testenv.UniqueName("settling")
	deniedID, settlingID := e.kafka.CreateTopicNamed(t, denied, 1), e.kafka.CreateTopicNamed(t, settling, 1)
	var settled atomic.Bool
	e.kafka.Cluster.ControlKey(kmsg.Produce.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		e.kafka.Cluster.KeepControl()
		pr := req.(*kmsg.ProduceRequest)
		codes := map[string]int16{denied: kerr.TopicAuthorizationFailed.Code}
		if !settled.Load() {
			codes[settling] = kerr.UnknownTopicOrPartition.Code
		}
		named := func(rt kmsg.ProduceRequestTopic) string { // newer requests name topics by id only
			switch rt.TopicID {
			case deniedID:
				return denied
			case settlingID:
				return settling
			}
			return rt.Topic
		}
		mine := false
		for _, rt := range pr.Topics {
			_, ok := codes[named(rt)]
			mine = mine || ok
		}
		if !mine {
			return nil, nil, false // kfake handles a request of other topics
		}
		return produceFailed(pr, func(rt kmsg.ProduceRequestTopic) int16 {
			if code, ok := codes[named(rt)]; ok {
				return code
			}
			return kerr.NotLeaderForPartition.Code // sharing a request with them: try again
		}), nil, true
	})
	o, relay := e.oneShard(ctx, t, nil)
	// One at a time: the fake answers a request that mixes a refused topic
	// with others by refusing the others too (NOT_LEADER, retried).
	enqueueWith(t, ctx, e, o, outbox.Message{Topic: denied, Key: []byte("k"), Value: []byte("no acl")})
	eventually(t, time.Minute, "the denied row parked", func() bool { return relay.Stats().Parked == 1 })
	enqueueWith(t, ctx, e, o, outbox.Message{Topic: e.topic, Key: []byte("k"), Value: []byte("fine")})
	eventually(t, time.Minute, "a row of another topic in the shard published", func() bool { return relay.Stats().Published == 1 })
	parked, err := o.Parked(ctx, e.db.Pool, 0)
	if err != nil || len(parked) != 1 || parked[0].Topic != denied || !strings.Contains(parked[0].Error, "TOPIC_AUTHORIZATION_FAILED") {
		t.Fatalf("parked %+v, %v; want only the denied topic's row, with TOPIC_AUTHORIZATION_FAILED", parked, err)
	}
	errs := relay.Stats().ProduceErrors
	enqueueWith(t, ctx, e, o, outbox.Message{Topic: settling, Key: []byte("k"), Value: []byte("later")})
	eventually(t, time.Minute, "the settling row retried", func() bool { return relay.Stats().ProduceErrors >= errs+2 })
	if s := relay.Stats(); s.Parked != 1 || s.Published != 1 {
		t.Fatalf("stats %+v while the topic settles: a transient error must not park or publish", s)
	}
	settled.Store(true)
	recs := e.readTopic(t, settling, func(r []*kgo.Record) bool { return len(r) >= 1 })
	if string(recs[0].Value) != "later" {
		t.Fatalf("settling topic: %q", recs[0].Value)
	}
	if s := relay.Stats(); s.Parked != 1 {
		t.Errorf("stats %+v: a transient error must not park", s)
	}
}

// refusalRace holds the record whose value is successor, when the client
// buffers it (a hook) or partitions it (a partitioner, as when its topic's
// partitions were not known yet at Produce), until the client has failed
// the record of key whose value is larger than limit, at most a second:
// the moment at which a producer that sends records as they come would
// send the successor after its predecessor was refused.
type refusalRace struct {
	key, successor string
	limit          int
	partitioning   bool // hold it while it is partitioned, not buffered
	refused        chan struct{}
	once           atomic.Bool
	raced          atomic.Bool
}

func (h *refusalRace) hold(r *kgo.Record) {
	if string(r.Value) != h.successor || !h.once.CompareAndSwap(false, true) {
		return
	}
	select {
	case <-h.refused:
		h.raced.Store(true)
	case <-time.After(time.Second):
	}
}

func (h *refusalRace) OnProduceRecordBuffered(r *kgo.Record) {
	if !h.partitioning {
		h.hold(r)
	}
}

func (h *refusalRace) OnProduceRecordUnbuffered(r *kgo.Record, err error) {
	if err != nil && string(r.Key) == h.key && len(r.Value) > h.limit {
		select {
		case <-h.refused:
		default:
			close(h.refused)
		}
	}
}

// The partitioner: every record to partition 0.
func (h *refusalRace) ForTopic(string) kgo.TopicPartitioner { return h }
func (h *refusalRace) RequiresConsistency(*kgo.Record) bool { return true }
func (h *refusalRace) Partition(r *kgo.Record, _ int) int {
	if h.partitioning {
		h.hold(r)
	}
	return 0
}

// sentValues lists the values of the uncompressed record batches of a
// produce request's partition, or nil for a compressed one.
func sentValues(rp kmsg.ProduceRequestTopicPartition) []string {
	var b kmsg.RecordBatch
	if b.ReadFrom(rp.Records) != nil || b.Attributes&7 != 0 {
		return nil
	}
	var vals []string
	for src := b.Records; len(src) > 0; {
		var r kmsg.Record
		l, n := binary.Varint(src)
		if n <= 0 || r.ReadFrom(src) != nil {
			return vals
		}
		vals = append(vals, string(r.Value))
		src = src[n+int(l):]
	}
	return vals
}

// TestRelayLetsNoSuccessorPastARefusedRow: the broker refuses a row for
// good while rows of its key after it are on their way: handed to the
// producer only after the refusal came back, or sent in a batch of their
// own before it. None may reach the topic before it: they stay pending
// behind the parked row, and once it is retried the key reads in order,
// each row once.
func TestRelayLetsNoSuccessorPastARefusedRow(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// inFlight: b-3 goes in a batch of its own, sent while the batch
		// before it awaits its answer (a row of another key published
		// first lets the producer pipeline).
		inFlight bool
		// partitioning: b-2 is held while it is partitioned, which for a
		// topic the client did not know yet happens after Produce returned.
		partitioning bool
	}{{"buffered after the refusal", false, false}, {"sent behind it", true, false}, {"partitioned after the refusal", false, true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e, ctx, adm, topic := smallTopicEnv(t)
			var sentEarly atomic.Bool // b-3 reached the broker in a batch of its own before the retry
			var retried atomic.Bool
			e.kafka.Cluster.ControlKey(kmsg.Produce.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
				e.kafka.Cluster.KeepControl()
				for _, rt := range req.(*kmsg.ProduceRequest).Topics {
					for _, rp := range rt.Partitions {
						vals := sentValues(rp)
						big := slices.ContainsFunc(vals, func(v string) bool { return len(v) > 4096 })
						if slices.Contains(vals, "b-3") && !big && !retried.Load() {
							sentEarly.Store(true)
						}
					}
				}
				return nil, nil, false
			})
			race := &refusalRace{key: "b", successor: "b-2", limit: 4096, partitioning: tc.partitioning, refused: make(chan struct{})}
			o, relay := e.oneShard(ctx, t, func(c *outbox.RelayConfig) {
				c.ClientOpts = append(c.ClientOpts, kgo.WithHooks(race), kgo.RecordPartitioner(race),
					kgo.ProducerBatchCompression(kgo.NoCompression()))
				if tc.inFlight {
					// The big row and b-2 fill a batch; b-3 needs another.
					c.ClientOpts = append(c.ClientOpts, kgo.ProducerBatchMaxBytes(8200))
				}
			})
			published := int64(0)
			if tc.inFlight {
				enqueueWith(t, ctx, e, o, outbox.Message{Topic: topic, Key: []byte("a"), Value: []byte("a-1")})
				eventually(t, time.Minute, "the first row published", func() bool { return relay.Stats().Published == 1 })
				published = 1
			}
			enqueueWith(t, ctx, e, o, outbox.Message{Topic: topic, Key: []byte("b"), Value: noise(8000)},
				outbox.Message{Topic: topic, Key: []byte("b"), Value: []byte("b-2")},
				outbox.Message{Topic: topic, Key: []byte("b"), Value: []byte("b-3")})
			eventually(t, time.Minute, "the big row parked", func() bool { return relay.Stats().Parked == 1 })
			t.Logf("the refusal came back before b-2 was buffered or partitioned: %v; b-3 reached the broker without it before the retry: %v",
				race.raced.Load(), sentEarly.Load())
			if s := relay.Stats(); s.Published != published {
				t.Fatalf("stats %+v: nothing of key b may be published while its first row is refused", s)
			}

			raiseLimit(ctx, t, adm, topic)
			retried.Store(true)
			if n, err := o.RetryAll(ctx, e.db.Pool); err != nil || n != 1 {
				t.Fatalf("retry all: %d, %v; want 1", n, err)
			}
			waitDrained(t, e, o)
			recs := e.readTopic(t, topic, func(r []*kgo.Record) bool { return len(byKey(r)["b"]) >= 3 })
			if got, want := byKey(recs)["b"], []string{"<8000 bytes>", "b-2", "b-3"}; fmt.Sprint(got) != fmt.Sprint(want) {
				t.Fatalf("key b on the topic: %v; want %v", got, want)
			}
		})
	}
}

// TestRelayPublishesWithinTheClientsBuffer: ClientOpts that bound the
// producer's buffer (MaxBufferedRecords, MaxBufferedBytes) below a batch
// of rows: the relay publishes the batch in parts that fit, every row
// once, each key in order, with no failed produce. (Handed over whole, a
// row that does not fit beside the others would fail at once while a
// later, smaller row of its key went out.)
func TestRelayPublishesWithinTheClientsBuffer(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	o, relay := e.oneShard(ctx, t, func(c *outbox.RelayConfig) {
		c.ClientOpts = append(c.ClientOpts, kgo.MaxBufferedBytes(10_000), kgo.MaxBufferedRecords(2))
	})
	enqueueWith(t, ctx, e, o, outbox.Message{Topic: e.topic, Key: []byte("x"), Value: noise(5000)},
		outbox.Message{Topic: e.topic, Key: []byte("b"), Value: noise(6000)},
		outbox.Message{Topic: e.topic, Key: []byte("b"), Value: []byte("b-2")},
		outbox.Message{Topic: e.topic, Key: []byte("b"), Value: []byte("b-3")},
		outbox.Message{Topic: e.topic, Key: []byte("b"), Value: []byte("b-4")})
	// The relay counts a batch once it has committed it.
	eventually(t, time.Minute, "the five rows published", func() bool { return relay.Stats().Published >= 5 })
	waitDrained(t, e, o)
	recs := e.readTopic(t, e.topic, func(r []*kgo.Record) bool { return len(r) >= 5 })
	got := byKey(recs)
	if fmt.Sprint(got["b"]) != "[<6000 bytes> b-2 b-3 b-4]" || fmt.Sprint(got["x"]) != "[<5000 bytes>]" {
		t.Fatalf("on the topic: %v; want x once, and b's four rows in order", got)
	}
	if s := relay.Stats(); s.Published != 5 || s.ProduceErrors != 0 || s.Parked != 0 {
		t.Fatalf("stats %+v; want 5 published, nothing failed or parked", s)
	}
}

// unorderedPublisher breaks Publisher.Publish's promise once: in its first
// call it fails the first record (transiently) and confirms the second.
type unorderedPublisher struct {
	mu    sync.Mutex
	calls int
	sent  []string // values confirmed, in order
}

var errFlaky = errors.New("flaky")

func (*unorderedPublisher) System() string           { return "fake" }
func (*unorderedPublisher) Refuse(*kgo.Record) error { return nil }
func (*unorderedPublisher) Permanent(err error) bool { return false }
func (p *unorderedPublisher) Publish(_ context.Context, recs []*kgo.Record) []error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls++
	errs := make([]error, len(recs))
	for i, r := range recs {
		if p.calls == 1 && i == 0 {
			errs[i] = errFlaky
			continue
		}
		p.sent = append(p.sent, string(r.Value))
	}
	return errs
}

// TestRelaySaysWhenAPublisherLetARowPastAFailedOne: a Publisher confirms a
// row although an earlier row of its key failed in the same call. The relay
// logs it as an error, keeps the row pending and publishes it again after
// the one it follows.
func TestRelaySaysWhenAPublisherLetARowPastAFailedOne(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pub, logs := &unorderedPublisher{}, &lockedBuffer{}
	o, relay := e.oneShard(ctx, t, func(c *outbox.RelayConfig) {
		c.Publisher, c.Logger = pub, slog.New(slog.NewTextHandler(logs, nil))
	})
	enqueueWith(t, ctx, e, o, outbox.Message{Topic: e.topic, Key: []byte("a"), Value: []byte("a-1")},
		outbox.Message{Topic: e.topic, Key: []byte("a"), Value: []byte("a-2")})
	// The relay counts a batch once it has committed it.
	eventually(t, time.Minute, "both rows published", func() bool { return relay.Stats().Published == 2 })
	waitDrained(t, e, o)
	pub.mu.Lock()
	sent := fmt.Sprint(pub.sent)
	pub.mu.Unlock()
	if sent != "[a-2 a-1 a-2]" {
		t.Fatalf("confirmed %s; want [a-2 a-1 a-2]", sent)
	}
	if n := strings.Count(logs.String(), "ahead of an earlier row of its key"); n != 1 {
		t.Fatalf("%d error lines for the row let past; want 1. Logs:\n%s", n, logs.String())
	}
}
